"""The planner: the fastest plan whose predicted peak memory fits a budget.

Input ``ModelCosts`` (plain data), output a ``Plan``. It never touches tensors.

Memory model (one pipeline stage, identical layers, layer 0 nearest the embedding):

    peak = static + max( non_layer + sum_l stored(l),                       # end of forward
                         max_l [ sum_{k<=l} stored(k) + transient(l) ] + workspace )

stored(l) is what layer l keeps between its forward and backward (retained bytes + codec
payloads); transient(l) is what exists at full size only while layer l backprops:

    transient(l) = sum of its recomputed sites            (rebuilt together, cached for
                                                           the layer's backward)
                 + DECODED_AT_ONCE x its largest compressed site
                 + the start of its re-run, if compressed (decoded by the rebuild, held
                                                           until backward takes it)

The runtime decodes a compressed value when backward first asks for it and frees it once
every view of it is taken, so decoded values do not pile up the way rebuilt ones do: at most
two are alive at once (the Q/K/V storage, decoded for the context matmul and held until the
score matmul, overlaps with each attention value in between; LayerNorm's backward reads its
input and its statistics together). ``workspace`` is the gradient working set of one
layer's backward, the same for every plan. The logits and loss tensors (non_layer) are freed
by the loss backward before any layer backprops, so they meet the layers' stored bytes only
at the end of forward.

Time model: each compressed site costs its encode + decode. Recomputed sites are rebuilt the
way the runtime rebuilds them: one forward re-run per layer (values cached for the layer's
backward), from the start of the first segment holding a recomputed site to the deepest
recomputed site of the last one. Segments before the last run whole (the next one starts
from their output), the last one up to its deepest recomputed site (``rebuild_charges``).
That is a maximum, not a sum, over the recomputed sites, so a layer's time is not additive
over its sites; its memory is. A layer policy is still a vector (time, stored, transient).
Exactness: the re-run reads one saved value, the start of its first segment; with
``allow_lossy_sources=False`` that start must not be compressed.

Per-layer plans:
1. The frontier: every single-layer policy (one action per site, layer_in-style sites never
   recomputed, with ``allow_lossy_sources=False`` no re-run from a compressed start) reduced
   to its Pareto frontier in (time, stored, transient), built site by site so the 3^n
   policies are never listed (``_frontier`` says how the rebuild time is carried).
   Swapping a dominated policy for one that dominates it lowers no constraint's slack and
   no time, so some optimal plan uses frontier policies only. The decoded term is a maximum,
   not a sum: the frontier is built once per cap (each distinct size of a compressible site,
   and 0), allowing compression only at sites no larger than the cap and charging
   DECODED_AT_ONCE x cap; a policy's own largest compressed site is one of the caps, so the
   union of these frontiers holds every policy at its exact cost.
   Transient is clipped from below at non_layer - workspace: no prefix exceeds the total
   stored, so a smaller transient can never set the peak.
2. The order: for a given multiset of layer policies the peak term max_l [prefix(l) +
   transient(l)] is minimised by putting larger transients on lower layers (Jackson's rule
   for maximum lateness: transient is the "delivery time", stored the "processing time").
   The top layer backprops with every other layer's activations still stored, so it should be
   the one with the least to rebuild.
3. The choice: a dynamic programme over layers on the state (prefix stored, time so far),
   keeping only Pareto states, pruned by branch and bound (lower bound: the LP relaxation,
   i.e. the convex hull of the frontier in (stored, time); upper bound: the better of the best
   uniform plan and the rounded LP optimum). Stored bytes are rounded up to a resolution
   (``default_resolution``: 1/1024 of a layer, 1 byte on small problems, where the result is
   exactly optimal); the plan always fits the true budget and is no slower than the optimum
   at (budget - num_layers x resolution). CBC on the same problem as a knapsack over the
   frontier (hundreds of near-tied integer columns) did not prove optimality in 20 s, hence
   the dynamic programme. The smallest feasible budget is the peak of a least-peak plan
   found without rounding, which ``plan`` falls back to: a budget it names is feasible.

Uniform plans (one policy for every layer) are a scan of the same frontier. ``method="milp"``
solves the direct formulation instead (one binary per layer, site and action; the paper's
model extended with the same constraints, the rebuild time as one continuous variable per
layer and segment): slower, kept as the cross-check and benchmark.
"""
from __future__ import annotations

import functools
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pulp

from megatron_adacc import sites as site_table
from megatron_adacc.costs import ModelCosts, Segment, SiteCost, segment_run_s
from megatron_adacc.plan import RETAIN_DECISION, Decision, Plan
from megatron_adacc.sites import COMPRESS, RECOMPUTE, RETAIN

# CBC works in floating point; bytes are given to it in MiB and times in ms so that every
# coefficient is of order 1..1e5. Results are re-checked in exact integer bytes.
_MIB = float(1 << 20)
_MS = 1e3
# Decoded values alive at once while a layer backprops (see the module docstring).
DECODED_AT_ONCE = 2


class InfeasibleBudget(ValueError):
    """No plan fits the budget. ``minimum_budget`` is the smallest budget that has one."""

    def __init__(self, budget_bytes: int, minimum_budget: int, static_bytes: int) -> None:
        from megatron_adacc.units import format_size

        self.budget_bytes = budget_bytes
        self.minimum_budget = minimum_budget
        self.static_bytes = static_bytes
        super().__init__(
            f"memory budget {format_size(budget_bytes)} is infeasible: the smallest feasible "
            f"budget is {format_size(minimum_budget)} ({minimum_budget} B; static memory alone "
            f"is {format_size(static_bytes)})"
        )


# --- one layer's policies --------------------------------------------------------------------
@dataclass(frozen=True)
class _Option:
    """One action at one site: its time, stored and additive transient bytes. A recompute's
    time is not its own (it depends on the layer's other recomputed sites:
    ``rebuild_charges``), nor is a compression's transient (``layer_transient``)."""

    decision: Decision
    time_s: float
    stored: int
    transient: int


def _site_options(site: SiteCost) -> list[_Option]:
    """Every action the planner may take at ``site`` with its (time, stored, transient)."""
    options = [_Option(RETAIN_DECISION, 0.0, site.bytes, 0)]
    if site.can_compress:
        default_codec = site_table.get(site.name).default_codec
        for codec in site.codecs:
            decision = Decision(COMPRESS, None if codec.codec == default_codec else codec.codec)
            options.append(_Option(decision, codec.encode_s + codec.decode_s,
                                   codec.payload_bytes, 0))  # decoded: layer_transient
    if site.can_recompute:
        options.append(_Option(Decision(RECOMPUTE), 0.0, 0, site.bytes))
    return options


@dataclass(frozen=True)
class LayerPolicy:
    """One action per site for one layer, with its cost vector."""

    decisions: Mapping[str, Decision]
    time_s: float
    stored_bytes: int
    transient_bytes: int


def _recomputed(decisions: Mapping[str, Decision]) -> set[str]:
    return {name for name, decision in decisions.items() if decision.action == RECOMPUTE}


def _rebuilt_segments(costs: ModelCosts, recomputed: set[str]) -> list[int]:
    """Indices (into ``costs.segments``) of the segments holding a recomputed site."""
    order = [segment.name for segment in costs.segments]
    return sorted({order.index(site.segment) for site in costs.sites
                   if site.name in recomputed})


def rebuild_charges(costs: ModelCosts, recomputed: set[str]) -> dict[str, float]:
    """What rebuilding the ``recomputed`` sites of one layer adds to its backward, by the site
    that sets each part: the runtime re-runs forward once, from the start of the first segment
    holding a recomputed site to the deepest recomputed site of the last one. Each segment
    before the last runs whole (charged to its deepest recomputed site, or to the last
    segment's when it has none); the last runs up to its deepest recomputed site."""
    rebuilt = _rebuilt_segments(costs, recomputed)
    if not rebuilt:
        return {}

    def deepest(index: int) -> SiteCost | None:
        name = costs.segments[index].name
        held = [site for site in costs.sites if site.segment == name and site.name in recomputed]
        return max(held, key=lambda site: site.rebuild_s, default=None)

    last = deepest(rebuilt[-1])
    charges = {last.name: last.rebuild_s}
    for index in range(rebuilt[0], rebuilt[-1]):
        holder = deepest(index) or last
        run_s = segment_run_s(costs.sites, costs.segments[index].name)
        charges[holder.name] = charges.get(holder.name, 0.0) + run_s
    return charges


def _compressed_source(costs: ModelCosts, decisions: Mapping[str, Decision]) -> str | None:
    """The site the layer's rebuild starts from, when it is compressed (a lossy re-run)."""
    rebuilt = _rebuilt_segments(costs, _recomputed(decisions))
    if not rebuilt:
        return None
    start = costs.segments[rebuilt[0]].start
    return start if decisions.get(start, RETAIN_DECISION).action == COMPRESS else None


def is_exact(costs: ModelCosts, decisions: Mapping[str, Decision]) -> bool:
    """True when the layer's rebuild (if any) starts from a value that is not compressed."""
    return _compressed_source(costs, decisions) is None


def layer_transient(costs: ModelCosts, decisions: Mapping[str, Decision]) -> int:
    """transient(l) of the module docstring."""
    sizes = {site.name: site.bytes for site in costs.sites}
    actions = {site.name: decisions.get(site.name, RETAIN_DECISION).action for site in costs.sites}
    rebuilt = sum(sizes[name] for name, action in actions.items() if action == RECOMPUTE)
    decoded = max((sizes[name] for name, action in actions.items() if action == COMPRESS), default=0)
    source = _compressed_source(costs, decisions)
    return rebuilt + DECODED_AT_ONCE * decoded + (sizes[source] if source else 0)


def _option_for(site: SiteCost, decision: Decision) -> _Option:
    for option in _site_options(site):
        if (option.decision.action == decision.action
                and option.decision.codec_for(site.name) == decision.codec_for(site.name)):
            return option
    raise ValueError(f"site {site.name}: {decision} is not allowed by these costs")


def _site_times(costs: ModelCosts, decisions: Mapping[str, Decision]) -> dict[str, float]:
    """Added time of a layer policy by site: codec times, rebuild charges."""
    options = {site.name: _option_for(site, decisions.get(site.name, RETAIN_DECISION))
               for site in costs.sites}
    times = {name: option.time_s for name, option in options.items()}
    for name, charge in rebuild_charges(costs, _recomputed(decisions)).items():
        times[name] += charge
    return times


def evaluate_layer(costs: ModelCosts, decisions: Mapping[str, Decision]) -> LayerPolicy:
    """The cost vector of a layer policy, straight from the definitions."""
    options = [_option_for(site, decisions.get(site.name, RETAIN_DECISION))
               for site in costs.sites]
    return LayerPolicy(dict(decisions), sum(_site_times(costs, decisions).values()),
                       sum(o.stored for o in options), layer_transient(costs, decisions))


def peak_bytes(costs: ModelCosts, layers: Sequence[LayerPolicy]) -> int:
    """Predicted peak memory of a plan whose layer l (0 = nearest the embedding) follows
    ``layers[l]``: the memory model in this module's docstring."""
    prefix, backward_peak = 0, 0
    for layer in layers:
        prefix += layer.stored_bytes
        backward_peak = max(backward_peak, prefix + layer.transient_bytes)
    activations = max(costs.non_layer_bytes + prefix,
                      backward_peak + costs.backward_workspace_bytes)
    return costs.static_bytes + activations


def _pareto(points: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``points`` (time, stored, transient) that no other row weakly
    dominates (duplicates keep one). In lexicographic order a row is dominated iff some
    earlier row has stored and transient <= its own (its time is <= by the order). Rows are
    checked in blocks: against each other, and against the staircase of (stored, transient)
    minima of all earlier blocks (one binary search per row), so the cost stays near n log n
    instead of n^2."""
    order = np.lexsort((points[:, 2], points[:, 1], points[:, 0]))
    stored, transient = points[order, 1], points[order, 2]
    if len(order) and (transient == transient[0]).all():
        # One transient (typically all clipped to the floor): a row is dominated iff an
        # earlier row stores no more, i.e. iff it does not store strictly less than all
        # earlier rows.
        least_before = np.minimum.accumulate(np.concatenate([[np.inf], stored[:-1]]))
        return order[stored < least_before]
    dominated = np.zeros(len(order), dtype=bool)
    # The staircase: stored ascending, transient strictly descending; the least transient of
    # any earlier row storing at most s is that of the last step at or below s.
    stair_stored, stair_transient = np.empty(0), np.empty(0)
    block = 256
    earlier = np.tri(block, k=-1, dtype=bool)
    for start in range(0, len(order), block):
        end = min(start + block, len(order))
        s, t = stored[start:end], transient[start:end]
        hit = np.zeros(end - start, dtype=bool)
        if len(stair_stored):
            step = np.searchsorted(stair_stored, s, side="right") - 1
            hit = (step >= 0) & (stair_transient[np.maximum(step, 0)] <= t)
        size = end - start
        hit |= ((s[None, :] <= s[:, None]) & (t[None, :] <= t[:, None])
                & earlier[:size, :size]).any(axis=1)
        dominated[start:end] = hit
        merged_stored = np.concatenate([stair_stored, s[~hit]])
        merged_transient = np.concatenate([stair_transient, t[~hit]])
        rank = np.lexsort((merged_transient, merged_stored))
        merged_stored, merged_transient = merged_stored[rank], merged_transient[rank]
        lower = merged_transient < np.minimum.accumulate(
            np.concatenate([[np.inf], merged_transient[:-1]]))
        stair_stored, stair_transient = merged_stored[lower], merged_transient[lower]
    return order[~dominated]


@dataclass
class Frontier:
    """The Pareto-optimal single-layer policies as arrays (one row per policy)."""

    sites: list[SiteCost]              # in the order of the columns of ``choices``
    options: list[list[_Option]]
    time_s: np.ndarray
    stored: np.ndarray                 # int64 bytes
    transient: np.ndarray              # int64 bytes, true (not clipped)
    choices: np.ndarray                # option index per site

    def __len__(self) -> int:
        return len(self.time_s)

    def policy(self, k: int) -> LayerPolicy:
        decisions = {site.name: self.options[i][self.choices[k, i]].decision
                     for i, site in enumerate(self.sites)}
        return LayerPolicy(decisions, float(self.time_s[k]), int(self.stored[k]),
                           int(self.transient[k]))


def _transient_floor(costs: ModelCosts) -> int:
    """Transient bytes below which a layer's transient cannot set the peak: any prefix is at
    most the total stored, and total + non_layer is itself a term of the peak, so
    prefix + max(transient, non_layer - workspace) + workspace gives the same peak."""
    return max(0, costs.non_layer_bytes - costs.backward_workspace_bytes)


def layer_frontier(costs: ModelCosts, allow_lossy_sources: bool = True) -> Frontier:
    """The Pareto frontier of single-layer policies in (time, stored, transient), with
    transient clipped from below at ``_transient_floor`` (which changes no peak), built site
    by site so the 3^n policies are never listed. It depends on the per-layer costs only, so
    re-planning the same costs at another budget reuses it."""
    return _frontier(tuple(costs.sites), tuple(costs.segments), allow_lossy_sources,
                     _transient_floor(costs))


@functools.lru_cache(maxsize=32)
def _frontier(sites: tuple[SiteCost, ...], segments: tuple[Segment, ...],
              allow_lossy_sources: bool, transient_floor: int) -> Frontier:
    """Sites are added deepest first: the segments last to first, each segment's sites by
    rebuild time, longest first, then the sites no segment rebuilds. In that order the
    first recomputed site met is the deepest of the last rebuilt segment, and a recomputed
    site met in an earlier segment extends the re-run to it, so the rebuild time is charged
    as it is met (``rebuild_charges`` in steps) with one number of state: the lowest segment
    rebuilt so far. A second flag marks that the start of that segment was compressed; it
    clears if a still earlier segment is rebuilt (the re-run then starts elsewhere). A
    policy still carrying it at the end is lossy: dropped for exact plans, charged the
    start's size otherwise. The whole is built once per cap of the decoded term (module
    docstring)."""
    names = [segment.name for segment in segments]
    none = len(segments)            # "no segment rebuilt yet"
    order = [site for index in reversed(range(len(segments)))
             for site in sorted((s for s in sites if s.segment == names[index]),
                                key=lambda s: -s.rebuild_s)]
    order += [site for site in sites if site.segment is None]
    run_s = np.array([segment_run_s(sites, name) for name in names])
    starts = {segment.start: index for index, segment in enumerate(segments)}
    sizes = {site.name: site.bytes for site in sites}
    held_source = [sizes.get(segment.start, 0) for segment in segments]
    options = [_site_options(site) for site in order]
    if np.prod([float(len(o)) for o in options]) >= 2.0**63:
        raise ValueError(f"{len(order)} sites have too many options to number every policy")
    # Pruning compares transients clipped at what still cannot reach the floor once every
    # site to come adds its most: two partial policies both below that end up at the floor
    # alike. (With GPT-sized logits the floor exceeds any layer's transient, and the
    # frontier is two-dimensional from the start.)
    to_come = np.cumsum([max(o.transient for o in site_options)
                         for site_options in options][::-1])[::-1]
    unreachable = transient_floor - np.append(to_come[1:], 0) - (
        max(held_source, default=0) if allow_lossy_sources else 0)
    caps = sorted({0} | {site.bytes for site, site_options in zip(order, options)
                         if any(o.decision.action == COMPRESS for o in site_options)})

    def grow(cap: int) -> dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]]:
        # (lowest rebuilt segment, its start compressed) -> (time, stored, transient) rows
        # and each row's option choices as one mixed-radix integer (site k's choice is
        # digit k).
        states = {(none, False): (np.array([[0.0, 0.0, DECODED_AT_ONCE * cap]]),
                                  np.zeros(1, dtype=np.int64))}
        radix = 1
        for index, (site, site_options) in enumerate(zip(order, options)):
            segment = names.index(site.segment) if site.segment is not None else None
            grown: dict[tuple[int, bool], list[tuple[np.ndarray, np.ndarray]]] = {}
            for (lowest, pending), (vectors, codes) in states.items():
                for choice, option in enumerate(site_options):
                    key, charge = (lowest, pending), option.time_s
                    if option.decision.action == RECOMPUTE:
                        if lowest == none:
                            key, charge = (segment, False), site.rebuild_s
                        elif segment < lowest:
                            key, charge = (segment, False), float(run_s[segment:lowest].sum())
                    elif option.decision.action == COMPRESS:
                        if site.bytes > cap:
                            continue
                        if starts.get(site.name, none) == lowest != none:
                            key = (lowest, True)
                    step = np.array([charge, option.stored, option.transient], dtype=float)
                    grown.setdefault(key, []).append((vectors + step, codes + choice * radix))
            radix *= len(site_options)
            states = {}
            for key, parts in grown.items():
                vectors = np.concatenate([v for v, _ in parts])
                codes = np.concatenate([c for _, c in parts])
                clipped = vectors.copy()
                clipped[:, 2] = np.maximum(clipped[:, 2], unreachable[index])
                keep = _pareto(clipped)
                states[key] = (vectors[keep], codes[keep])
        return states

    rows, row_codes = [], []
    for cap in caps:
        for (lowest, pending), (vectors, codes) in grow(cap).items():
            if pending:
                if not allow_lossy_sources:
                    continue
                vectors = vectors + np.array([0.0, 0.0, held_source[lowest]])
            rows.append(vectors)
            row_codes.append(codes)
    vectors, codes = np.concatenate(rows), np.concatenate(row_codes)
    # A policy appears under every cap at least its largest compressed site: keep the
    # least charge, which is exact.
    by_policy = np.lexsort((vectors[:, 2], codes))
    first = np.ones(len(by_policy), dtype=bool)
    first[1:] = codes[by_policy][1:] != codes[by_policy][:-1]
    vectors, codes = vectors[by_policy[first]], codes[by_policy[first]]
    clipped = vectors.copy()
    clipped[:, 2] = np.maximum(clipped[:, 2], transient_floor)
    keep = _pareto(clipped)
    vectors, codes = vectors[keep], codes[keep]
    choices = np.empty((len(codes), len(order)), dtype=np.int16)
    for column, site_options in enumerate(options):
        codes, choices[:, column] = np.divmod(codes, len(site_options))
    return Frontier(order, options, vectors[:, 0], vectors[:, 1].astype(np.int64),
                    vectors[:, 2].astype(np.int64), choices)


# --- the result ----------------------------------------------------------------------------
@dataclass
class SiteRow:
    """One line of the plan table: one site under one decision, over some layers."""

    site: str
    layers: str                 # e.g. "0-11" or "0-3,8"
    num_layers: int
    action: str
    codec: str | None
    bytes_kept: int             # summed over those layers
    # Summed over those layers; a re-run's time shows at the site that sets it (the deepest
    # recomputed one, see rebuild_charges), other recomputed sites of it add nothing.
    time_added_s: float


@dataclass
class Totals:
    peak_bytes: int
    added_time_s: float


@dataclass
class PlanResult:
    feasible: bool
    plan: Plan
    layer_decisions: list[dict[str, Decision]]
    budget_bytes: int
    peak_bytes: int
    static_bytes: int
    activation_bytes: int       # peak - static
    added_time_s: float
    solve_time_s: float
    minimum_feasible_budget: int
    per_layer: bool
    allow_lossy_sources: bool
    method: str
    rows: list[SiteRow]
    references: dict[str, Totals] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "feasible": self.feasible,
            "budget_bytes": self.budget_bytes,
            "peak_bytes": self.peak_bytes,
            "static_bytes": self.static_bytes,
            "activation_bytes": self.activation_bytes,
            "added_time_s": self.added_time_s,
            "solve_time_s": self.solve_time_s,
            "minimum_feasible_budget": self.minimum_feasible_budget,
            "per_layer": self.per_layer,
            "allow_lossy_sources": self.allow_lossy_sources,
            "method": self.method,
            "plan": self.plan.to_dict(),
            "sites": [row.__dict__ for row in self.rows],
            "references": {name: t.__dict__ for name, t in self.references.items()},
        }


def _ranges(layers: Iterable[int]) -> str:
    spans: list[list[int]] = []
    for layer in sorted(layers):
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _rows(costs: ModelCosts, layer_decisions: list[dict[str, Decision]]) -> list[SiteRow]:
    # Layers mostly share a few policies: evaluate each distinct one once.
    distinct = {tuple(d.items()): d for d in layer_decisions}
    by_policy = {key: _site_times(costs, decisions) for key, decisions in distinct.items()}
    times = [by_policy[tuple(d.items())] for d in layer_decisions]
    rows = []
    for site in costs.sites:
        groups: dict[Decision, list[int]] = {}
        for layer, decisions in enumerate(layer_decisions):
            groups.setdefault(decisions.get(site.name, RETAIN_DECISION), []).append(layer)
        for decision, layers in groups.items():
            option = _option_for(site, decision)
            rows.append(SiteRow(site.name, _ranges(layers), len(layers), decision.action,
                                decision.codec_for(site.name), option.stored * len(layers),
                                sum(times[layer][site.name] for layer in layers)))
    return rows


def _reference_totals(costs: ModelCosts) -> dict[str, Totals]:
    nothing = evaluate_layer(costs, {})
    everything = evaluate_layer(costs, {s.name: Decision(RECOMPUTE)
                                        for s in costs.sites if s.can_recompute})
    return {
        name: Totals(peak_bytes(costs, [policy] * costs.num_layers),
                     policy.time_s * costs.num_layers)
        for name, policy in (("no optimisation", nothing), ("full recompute", everything))
    }


# --- solving -------------------------------------------------------------------------------
def _cbc() -> pulp.LpSolver:
    return pulp.PULP_CBC_CMD(msg=False, gapRel=0.0, gapAbs=1e-9, threads=1)


def _layer_dp(costs: ModelCosts, stored: np.ndarray, step_cost, final_cost,
              cost_bound: float = np.inf) -> tuple[float, list[int]] | None:
    """Exact dynamic programme over layers, bottom (0) to top, on the state (prefix stored
    bytes, cost so far). Future constraints and costs depend on the prefix only, so a state
    with no smaller prefix and no smaller cost than another is all that needs keeping.

    ``step_cost(cost, prefix)`` -> cost after adding each frontier policy (arrays broadcast
    over states x policies; inf where not allowed); ``final_cost(prefix, cost, layers)`` ->
    the objective, or a lower bound on it, of a plan whose first ``layers`` layers end in
    that state (inf where infeasible). Returns (objective, policy per layer) or None when
    nothing is feasible."""
    num_layers = costs.num_layers
    prefix = np.zeros(1, dtype=np.int64)
    cost = np.zeros(1)
    parents, picks = [], []
    for layer in range(num_layers):
        new_prefix = prefix[:, None] + stored[None, :]
        new_cost = step_cost(cost[:, None], new_prefix)
        state, pick = np.nonzero(np.isfinite(new_cost))
        candidate_prefix, candidate_cost = new_prefix[state, pick], new_cost[state, pick]
        reachable = final_cost(candidate_prefix, candidate_cost, layer + 1)
        alive = np.flatnonzero(np.isfinite(reachable) & (reachable <= cost_bound))
        if len(alive) == 0:
            return None
        state, pick = state[alive], pick[alive]
        candidate_prefix, candidate_cost = candidate_prefix[alive], candidate_cost[alive]
        order = np.lexsort((candidate_cost, candidate_prefix))
        sorted_cost = candidate_cost[order]
        best_before = np.minimum.accumulate(np.concatenate([[np.inf], sorted_cost[:-1]]))
        keep = order[sorted_cost < best_before]
        prefix, cost = candidate_prefix[keep], candidate_cost[keep]
        parents.append(state[keep])
        picks.append(pick[keep])
    objective = final_cost(prefix, cost, num_layers)
    best = int(np.argmin(objective))
    if not np.isfinite(objective[best]):
        return None
    layers = []
    for layer in reversed(range(num_layers)):
        layers.append(int(picks[layer][best]))
        best = int(parents[layer][best])
    return float(objective.min()), layers[::-1]


def _jackson_order(frontier: Frontier, picks: Sequence[int]) -> list[LayerPolicy]:
    """Layers 0.. with the largest transients lowest: the order that minimises the peak for
    this multiset of policies (see module docstring)."""
    policies = [frontier.policy(k) for k in picks]
    return sorted(policies, key=lambda p: -p.transient_bytes)


def _time_lower_bound(frontier: Frontier):
    """``bound(layers, capacity)``: a lower bound on the time of ``layers`` more layers that
    together store at most ``capacity`` bytes: the LP relaxation (layers may mix policies
    fractionally), i.e. ``layers`` x the lower convex hull of (stored, time) at the average."""
    order = np.lexsort((frontier.time_s, frontier.stored))
    xs, ys = frontier.stored[order].astype(float), frontier.time_s[order]
    hull: list[int] = []
    for i in range(len(xs)):
        if hull and ys[i] >= ys[hull[-1]]:
            continue               # stores more and is no faster: above the hull
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = (xs[hull[-2]], ys[hull[-2]]), (xs[hull[-1]], ys[hull[-1]])
            if (x2 - x1) * (ys[i] - y1) - (xs[i] - x1) * (y2 - y1) <= 0:
                hull.pop()         # the middle point is on or above the chord
            else:
                break
        hull.append(i)
    hull_x, hull_y = xs[hull], ys[hull]
    hull_policies = order[hull]

    def bound(layers: int, capacity: np.ndarray) -> np.ndarray:
        if layers == 0:
            return np.where(capacity >= 0, 0.0, np.inf)
        average = capacity / layers
        value = layers * np.interp(average, hull_x, hull_y)
        return np.where(average >= hull_x[0], value, np.inf)

    return bound, hull_policies


def _rounded_lp_plan(costs: ModelCosts, budget: int, frontier: Frontier,
                     hull: np.ndarray) -> list[LayerPolicy] | None:
    """A good feasible plan to bound the exact search: the LP optimum mixes two neighbouring
    hull policies; round the mix down to whole layers and spend what is left of the budget
    layer by layer, each on the fastest policy it pays for. None if it breaks a backward
    constraint."""
    num_layers = costs.num_layers
    capacity = budget - costs.static_bytes - costs.non_layer_bytes
    stored = frontier.stored[hull]
    fits = np.flatnonzero(stored * num_layers <= capacity)
    if len(fits) == len(hull):
        picks = [int(hull[-1])] * num_layers
    elif len(fits) == 0:
        return None
    else:
        low, high = int(hull[fits[-1]]), int(hull[fits[-1] + 1])
        s_low, s_high = int(frontier.stored[low]), int(frontier.stored[high])
        n_high = (capacity - num_layers * s_low) // (s_high - s_low)
        picks = [high] * n_high + [low] * (num_layers - n_high)
        spare = capacity - n_high * s_high - (num_layers - n_high) * s_low
        for layer, pick in reversed(list(enumerate(picks))):   # the low layers first
            upgrade = np.flatnonzero(frontier.stored <= frontier.stored[pick] + spare)
            picks[layer] = int(upgrade[np.argmin(frontier.time_s[upgrade])])
            spare -= int(frontier.stored[picks[layer]] - frontier.stored[pick])
    layers = _jackson_order(frontier, picks)
    return layers if peak_bytes(costs, layers) <= budget else None


def _plan_per_layer(costs: ModelCosts, budget: int, frontier: Frontier,
                    resolution: int) -> list[LayerPolicy] | None:
    available = budget - costs.static_bytes
    backward_limit = available - costs.backward_workspace_bytes
    forward_limit = available - costs.non_layer_bytes
    lower_bound, hull = _time_lower_bound(frontier)
    # Any feasible plan's time bounds the search: the better one of the best uniform plan
    # and the rounded LP optimum.
    candidates = [p for p in (_plan_uniform(costs, budget, frontier),
                              _rounded_lp_plan(costs, budget, frontier, hull)) if p]
    incumbent = min((sum(p.time_s for p in layers) for layers in candidates), default=np.inf)
    incumbent *= 1 + 1e-9
    # Stored bytes rounded up to the resolution: prefixes collapse onto a grid (which is what
    # keeps the search small) and every plan found still fits the true budget.
    stored = -(-frontier.stored // resolution) * resolution
    transient = np.maximum(frontier.transient, _transient_floor(costs))
    useful = _pareto(np.column_stack([frontier.time_s, stored, transient]).astype(float))
    stored, transient, time_s = stored[useful], transient[useful], frontier.time_s[useful]
    num_layers = costs.num_layers

    def step_cost(cost, prefix):
        return np.where(prefix + transient[None, :] <= backward_limit, cost + time_s[None, :],
                        np.inf)

    def final_cost(prefix, cost, layers_done):
        return cost + lower_bound(num_layers - layers_done, forward_limit - prefix)

    solved = _layer_dp(costs, stored, step_cost, final_cost, cost_bound=incumbent)
    if solved is None:
        return min(candidates, key=lambda layers: sum(p.time_s for p in layers), default=None)
    return _jackson_order(frontier, [int(useful[k]) for k in solved[1]])


def _least_peak_per_layer(costs: ModelCosts, frontier: Frontier,
                          upper_bound: int) -> list[LayerPolicy]:
    """A per-layer plan with the smallest peak (bytes exact, no rounding): the same
    programme with the running maximum of (prefix + transient) as the cost."""
    transient = frontier.transient

    def step_cost(cost, prefix):
        return np.maximum(cost, prefix + transient[None, :])

    least_stored = int(frontier.stored.min())

    def final_cost(prefix, cost, layers_done):
        # Layers still to come store at least ``least_stored`` each.
        rest = (costs.num_layers - layers_done) * least_stored
        return np.maximum(prefix + rest + costs.non_layer_bytes,
                          cost + costs.backward_workspace_bytes)

    solved = _layer_dp(costs, frontier.stored, step_cost, final_cost,
                       cost_bound=upper_bound - costs.static_bytes)
    return _jackson_order(frontier, solved[1])


def _uniform_peaks(costs: ModelCosts, frontier: Frontier) -> np.ndarray:
    """Peak of each frontier policy used by every layer (the top layer sets the backward
    term, with every layer stored)."""
    total = costs.num_layers * frontier.stored
    return costs.static_bytes + np.maximum(
        total + costs.non_layer_bytes,
        total + frontier.transient + costs.backward_workspace_bytes)


def _least_peak_plan(costs: ModelCosts, frontier: Frontier, per_layer: bool) -> list[LayerPolicy]:
    """A plan with the smallest peak: its peak is the smallest feasible budget, and ``plan``
    returns it where the rounded search finds nothing, so that budget really is feasible."""
    uniform = [frontier.policy(int(np.argmin(_uniform_peaks(costs, frontier))))] * costs.num_layers
    if not per_layer:
        return uniform
    return _least_peak_per_layer(costs, frontier, peak_bytes(costs, uniform))


def minimum_budget(costs: ModelCosts, per_layer: bool = True,
                   allow_lossy_sources: bool = True) -> int:
    """The smallest budget for which ``plan`` succeeds."""
    frontier = layer_frontier(costs, allow_lossy_sources)
    return peak_bytes(costs, _least_peak_plan(costs, frontier, per_layer))


def _plan_uniform(costs: ModelCosts, budget: int, frontier: Frontier) -> list[LayerPolicy] | None:
    fits = np.flatnonzero(_uniform_peaks(costs, frontier) <= budget)
    if len(fits) == 0:
        return None
    best = int(fits[np.argmin(frontier.time_s[fits])])
    return [frontier.policy(best)] * costs.num_layers


def _solve(problem: pulp.LpProblem) -> bool:
    problem.solve(_cbc())
    return pulp.LpStatus[problem.status] == "Optimal"


def _plan_direct_milp(costs: ModelCosts, budget: int, per_layer: bool,
                      allow_lossy_sources: bool) -> list[LayerPolicy] | None:
    """The direct formulation: a binary per (layer, site, action), peak constraint per layer.
    With ``per_layer=False`` all layers share one set of binaries (the paper's model)."""
    num_layers = costs.num_layers
    available = budget - costs.static_bytes
    options = {site.name: _site_options(site) for site in costs.sites}
    groups = range(num_layers) if per_layer else range(1)
    problem = pulp.LpProblem("adacc_direct", pulp.LpMinimize)
    x = {(g, name, i): pulp.LpVariable(f"x_{g}_{name}_{i}", cat="Binary")
         for g in groups for name, opts in options.items() for i in range(len(opts))}

    def total(g: int, attribute: str, scale: float) -> Any:
        return pulp.lpSum(getattr(opt, attribute) / scale * x[g, name, i]
                          for name, opts in options.items() for i, opt in enumerate(opts))

    def chosen(g: int, name: str, action: str) -> Any:
        return pulp.lpSum(x[g, name, i] for i, opt in enumerate(options.get(name, ()))
                          if opt.decision.action == action)

    # Recomputable sites by segment index, and the rebuild time of each (group, segment):
    # at least the rebuild of each recomputed site in it, and the whole segment when it and
    # a later segment both hold recomputed sites (see rebuild_charges).
    held = [[site for site in costs.sites if site.segment == segment.name and site.can_recompute]
            for segment in costs.segments]
    rebuild = {(g, k): pulp.LpVariable(f"rebuild_{g}_{k}", lowBound=0)
               for g in groups for k in range(len(held))}
    # The non-additive parts of transient(l), in MiB (see layer_transient).
    sizes = {site.name: site.bytes for site in costs.sites}
    decoded = {g: pulp.LpVariable(f"decoded_{g}", lowBound=0) for g in groups}
    source = {g: pulp.LpVariable(f"source_{g}", lowBound=0) for g in groups}
    weight = 1 if per_layer else num_layers
    problem += pulp.lpSum(weight * (total(g, "time_s", 1 / _MS)
                                    + pulp.lpSum(rebuild[g, k] for k in range(len(held))))
                          for g in groups)
    for g in groups:
        for name, opts in options.items():
            problem += pulp.lpSum(x[g, name, i] for i in range(len(opts))) == 1
        for k, sites in enumerate(held):
            for site in sites:
                problem += rebuild[g, k] >= site.rebuild_s * _MS * chosen(g, site.name, RECOMPUTE)
            up_to, after = sum(held[:k + 1], []), sum(held[k + 1:], [])
            if up_to and after:
                # Continuous in [0, 1] and pushed down by the objective: at the optimum each
                # is 1 exactly when some recomputed site forces it.
                first = pulp.LpVariable(f"rebuilt_to_{g}_{k}", 0, 1)
                later = pulp.LpVariable(f"rebuilt_after_{g}_{k}", 0, 1)
                for site in up_to:
                    problem += first >= chosen(g, site.name, RECOMPUTE)
                for site in after:
                    problem += later >= chosen(g, site.name, RECOMPUTE)
                run_ms = segment_run_s(costs.sites, costs.segments[k].name) * _MS
                problem += rebuild[g, k] >= run_ms * (first + later - 1)
            # A re-run starting at segment k (nothing recomputed before it) reads its start:
            # exact plans must not compress it; lossy ones hold it decoded (``source``).
            before = pulp.lpSum(chosen(g, site.name, RECOMPUTE) for site in sum(held[:k], []))
            start = costs.segments[k].start
            for site in sites:
                reads_compressed = (chosen(g, start, COMPRESS)
                                    + chosen(g, site.name, RECOMPUTE) - before - 1)
                if allow_lossy_sources:
                    problem += source[g] >= sizes.get(start, 0) / _MIB * reads_compressed
                else:
                    problem += reads_compressed <= 0
        for name, opts in options.items():
            problem += decoded[g] >= DECODED_AT_ONCE * sizes[name] / _MIB * chosen(g, name, COMPRESS)
    workspace = costs.backward_workspace_bytes / _MIB

    def transient(g: int) -> Any:
        return total(g, "transient", _MIB) + decoded[g] + source[g]

    if per_layer:
        for layer in range(num_layers):
            problem += (pulp.lpSum(total(k, "stored", _MIB) for k in range(layer + 1))
                        + transient(layer) + workspace <= available / _MIB)
        all_stored = pulp.lpSum(total(k, "stored", _MIB) for k in groups)
    else:
        problem += (num_layers * total(0, "stored", _MIB) + transient(0)
                    + workspace <= available / _MIB)
        all_stored = num_layers * total(0, "stored", _MIB)
    problem += all_stored + costs.non_layer_bytes / _MIB <= available / _MIB
    if not _solve(problem):
        return None
    layers = []
    for layer in range(num_layers):
        g = layer if per_layer else 0
        decisions = {name: opts[i].decision for name, opts in options.items()
                     for i in range(len(opts)) if x[g, name, i].value() > 0.5}
        layers.append(evaluate_layer(costs, decisions))
    return layers if peak_bytes(costs, layers) <= budget else None


def default_resolution(costs: ModelCosts) -> int:
    """Memory grid of the per-layer search: 1/1024 of a layer's activations (1 byte for
    small problems, where the search is exact)."""
    return max(1, costs.layer_bytes // 1024)


def plan(costs: ModelCosts, budget_bytes: int, per_layer: bool = True,
         allow_lossy_sources: bool = True, method: str = "frontier",
         resolution_bytes: int | None = None) -> PlanResult:
    """The plan with the least added time whose predicted peak fits ``budget_bytes``.

    Raises ``InfeasibleBudget`` (naming the smallest feasible budget) when none fits.
    ``method``: "frontier" (default, see module docstring) or "milp" (direct formulation).
    """
    if method not in ("frontier", "milp"):
        raise ValueError(f"unknown planner method {method!r}; use 'frontier' or 'milp'")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral):
        raise TypeError(f"budget_bytes must be a whole number of bytes, got {budget_bytes!r}")
    budget_bytes = int(budget_bytes)
    started = time.perf_counter()
    frontier = layer_frontier(costs, allow_lossy_sources)
    least_peak = _least_peak_plan(costs, frontier, per_layer)
    minimum = peak_bytes(costs, least_peak)
    if budget_bytes < minimum:
        raise InfeasibleBudget(budget_bytes, minimum, costs.static_bytes)
    if method == "frontier" and per_layer:
        layers = _plan_per_layer(costs, budget_bytes, frontier,
                                 resolution_bytes or default_resolution(costs))
    elif method == "frontier":
        layers = _plan_uniform(costs, budget_bytes, frontier)
    else:
        layers = _plan_direct_milp(costs, budget_bytes, per_layer, allow_lossy_sources)
    # Near the minimum the rounded search (or CBC's floating point) may find nothing; the
    # least-peak plan fits any budget >= minimum.
    layers = layers or least_peak
    solve_time = time.perf_counter() - started
    layer_decisions = [
        {site.name: layer.decisions.get(site.name, RETAIN_DECISION) for site in costs.sites}
        for layer in layers
    ]
    peak = peak_bytes(costs, layers)
    return PlanResult(
        feasible=True,
        plan=Plan.from_layers(layer_decisions),
        layer_decisions=layer_decisions,
        budget_bytes=budget_bytes,
        peak_bytes=peak,
        static_bytes=costs.static_bytes,
        activation_bytes=peak - costs.static_bytes,
        added_time_s=sum(layer.time_s for layer in layers),
        solve_time_s=solve_time,
        minimum_feasible_budget=minimum,
        per_layer=per_layer,
        allow_lossy_sources=allow_lossy_sources,
        method=method,
        rows=_rows(costs, layer_decisions),
        references=_reference_totals(costs),
    )
