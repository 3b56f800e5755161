"""The memory and time model: what a layer policy costs and what a plan's peak is.

Every search and the plan table take their charges and limits from here; none restates a rule.
The derivation of each term is in docs/memory-model.md. In short, for one pipeline stage with
k micro-batches in flight:

    peak = static + persistent_overhead + max(
              allocator_overhead + (k - 1) x (A + E) + E + max(
                  non_layer + R + A,                                        # end of forward
                  max_l [ sum_{j<=l} stored(j) + transient(l) ] + workspace + H ),
              optimizer_step + H )                                          # the step

- stored(l): what layer l keeps between forward and backward (retained bytes, payloads);
- transient(l): its recomputed sites, its decoded values alive together, and the compressed
  sources its rebuild reads;
- time: each compressed site's encode + decode, each rebuild by its operator or by a forward
  re-run of its segment, and ``hooked_layer_s`` once for a layer with any action, unless it
  recomputes whole and runs under megatron's checkpoint instead (``recomputes_whole``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, NamedTuple, Sequence

import numpy as np

from megatron_adacc.common import sites as site_table
from megatron_adacc.common.costs import ModelCosts, Operator, Segment, SiteCost, segment_run_s
from megatron_adacc.common.plan import RETAIN_DECISION, Decision
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE, RETAIN

# --- the per-site terms ----------------------------------------------------------------------
@dataclass(frozen=True)
class SiteOption:
    """One action at one site: its time, stored and additive transient bytes.

    A recompute's time is not its own: it depends on the layer's other recomputed sites
    (``rebuild_charges``). Nor is a compression's transient (``decoded_bytes``)."""

    decision: Decision
    time_s: float
    stored: int
    transient: int
    # A compression whose decoded value differs from the saved one: a rebuild reading it is
    # lossy.
    lossy: bool = False


def _lossy(name: str, decision: Decision) -> bool:
    return (decision.action == COMPRESS
            and decision.codec_for(name) not in site_table.LOSSLESS_CODECS)


def site_options(site: SiteCost) -> list[SiteOption]:
    """Every action a plan may take at ``site`` with its (time, stored, transient)."""
    options = [SiteOption(RETAIN_DECISION, 0.0, site.bytes, 0)]
    if site.can_compress:
        default_codec = site_table.get(site.name).default_codec
        for codec in site.codecs:
            decision = Decision(COMPRESS, None if codec.codec == default_codec else codec.codec,
                                codec.capacity)
            options.append(SiteOption(decision, codec.encode_s + codec.decode_s,
                                      codec.payload_bytes, 0,  # decoded: decoded_bytes
                                      _lossy(site.name, decision)))
    if site.can_recompute:
        options.append(SiteOption(Decision(RECOMPUTE), 0.0, 0, site.bytes))
    return options


def site_option(site: SiteCost, decision: Decision) -> SiteOption:
    """The option of ``site`` that takes ``decision``; ValueError if the costs forbid it."""
    for option in site_options(site):
        if (option.decision.action == decision.action
                and option.decision.codec_for(site.name) == decision.codec_for(site.name)):
            return option
    raise ValueError(f"site {site.name}: {decision} is not allowed by these costs")


def decoded_sets(sites: Iterable[SiteCost]) -> list[frozenset[str]]:
    """The sets of sites whose decoded values can be alive together while the layer backprops.

    That is each site alone, and each group of ``sites.DECODED_TOGETHER`` the layer saves whole."""
    names = {site.name for site in sites}
    return ([frozenset({name}) for name in sorted(names)]
            + [group for group in site_table.DECODED_TOGETHER if group <= names])


def decoded_bytes(sites: Iterable[SiteCost], compressed: Collection[str]) -> int:
    """transient(l)'s decoded term: the most bytes the compressed sites hold decoded at once."""
    sites = list(sites)
    size = {site.name: site.bytes for site in sites if site.name in compressed}
    return max((sum(size.get(name, 0) for name in group) for group in decoded_sets(sites)),
               default=0)


def source_bytes(sites: Iterable[SiteCost], name: str) -> int:
    """A rebuild source held decoded: its full size, or 0 for a site the plan never decides."""
    return next((site.bytes for site in sites if site.name == name), 0)


def rerun_source_bytes(sites: Iterable[SiteCost], segment: Segment) -> int:
    """The source term of transient(l) for a re-run from ``segment``'s compressed start.

    It is the start at full size, or 0 for a site the plan never decides (so never compressed)."""
    return source_bytes(sites, segment.start)


# --- one layer ---------------------------------------------------------------------------------
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
                   if site.name in recomputed and site.segment is not None})


def rerun_chains(costs: ModelCosts, recomputed: Collection[str]) -> list[list[int]]:
    """The forward re-runs a layer's backward makes for its ``recomputed`` sites.

    Each is the indices (into ``costs.segments``) of the segments it runs, in forward order. A
    re-run passes through a segment start that is recomputed (sites.chain_reruns)."""
    return site_table.chain_reruns(_rebuilt_segments(costs, set(recomputed)),
                                   lambda index: costs.segments[index].start in recomputed)


def rebuild_charges(costs: ModelCosts, recomputed: set[str]) -> dict[str, float]:
    """What rebuilding the ``recomputed`` sites of one layer adds to its backward, by site.

    - Each re-run (``rerun_chains``) runs its segments before the last whole. Each is charged to its
      deepest recomputed site, or to the last segment's when it has none.
    - The last segment runs up to its deepest recomputed site.
    - Sites an operator rebuilds are no part of a re-run. Each operator with a recomputed product
      runs once, charged to the first such product."""
    charges: dict[str, float] = {}
    for operator, products in _running_operators(costs, recomputed):
        charges[products[0]] = operator.rebuild_s

    def deepest(index: int) -> SiteCost | None:
        name = costs.segments[index].name
        held = [site for site in costs.sites if site.segment == name and site.name in recomputed]
        return max(held, key=lambda site: site.rebuild_s, default=None)

    for chain in rerun_chains(costs, recomputed):
        last = deepest(chain[-1])
        charges[last.name] = last.rebuild_s
        for index in chain[:-1]:
            holder = deepest(index) or last
            run_s = segment_run_s(costs.sites, costs.segments[index].name)
            charges[holder.name] = charges.get(holder.name, 0.0) + run_s
    return charges


def _running_operators(costs: ModelCosts, recomputed: Collection[str]
                       ) -> list[tuple[Operator, list[str]]]:
    """The operators a layer backward runs, each with its recomputed products in site order."""
    running = []
    for operator in costs.operators:
        products = [site.name for site in costs.sites
                    if site.operator == operator.name and site.name in recomputed]
        if products:
            running.append((operator, products))
    return running


def held_sources(costs: ModelCosts, decisions: Mapping[str, Decision]) -> set[str]:
    """The compressed sites a layer's rebuild reads, decoded and held until backward takes them.

    They are each re-run's start and the running operators' sources (a lossy rebuild)."""
    compressed = {name for name, decision in decisions.items() if decision.action == COMPRESS}
    recomputed = _recomputed(decisions)
    held = {source for operator, _ in _running_operators(costs, recomputed)
            for source in operator.sources}
    held |= {costs.segments[chain[0]].start for chain in rerun_chains(costs, recomputed)}
    return held & compressed


def rebuilt_from(costs: ModelCosts, decisions: Mapping[str, Decision]) -> dict[str, str]:
    """What each recomputed site of a layer policy is rebuilt from.

    That is its operator's sources (joined by "+"), or the start of its re-run (its first
    segment's)."""
    recomputed = _recomputed(decisions)
    sources = {name: "+".join(operator.sources)
               for operator, products in _running_operators(costs, recomputed)
               for name in products}
    for chain in rerun_chains(costs, recomputed):
        start = costs.segments[chain[0]].start
        segments = {costs.segments[index].name for index in chain}
        sources.update({site.name: start for site in costs.sites
                        if site.name in recomputed and site.segment in segments})
    return sources


def is_exact(costs: ModelCosts, decisions: Mapping[str, Decision]) -> bool:
    """True when the layer's rebuild (if any) reads no value a lossy codec holds."""
    return not any(_lossy(name, decisions[name]) for name in held_sources(costs, decisions))


def _chosen_options(costs: ModelCosts, decisions: Mapping[str, Decision]
                    ) -> dict[str, SiteOption]:
    """Each site's option under ``decisions`` (a site they leave out is retained)."""
    return {site.name: site_option(site, decisions.get(site.name, RETAIN_DECISION))
            for site in costs.sites}


def _layer_transient(costs: ModelCosts, decisions: Mapping[str, Decision],
                     options: Mapping[str, SiteOption]) -> int:
    """transient(l) of the module docstring."""
    additive = sum(option.transient for option in options.values())
    compressed = {name for name, option in options.items()
                  if option.decision.action == COMPRESS}
    held = sum(source_bytes(costs.sites, name) for name in held_sources(costs, decisions))
    return additive + decoded_bytes(costs.sites, compressed) + held


def _site_times(costs: ModelCosts, decisions: Mapping[str, Decision],
                options: Mapping[str, SiteOption]) -> dict[str, float]:
    times = {name: option.time_s for name, option in options.items()}
    for name, charge in rebuild_charges(costs, _recomputed(decisions)).items():
        times[name] += charge
    return times


def site_times(costs: ModelCosts, decisions: Mapping[str, Decision]) -> dict[str, float]:
    """Added time of a layer policy by site: codec times, rebuild charges."""
    return _site_times(costs, decisions, _chosen_options(costs, decisions))


def whole_layer_sites(sites: Iterable[SiteCost]) -> frozenset[str]:
    """The sites a layer must recompute, and act on nothing else, to run under the checkpoint.

    They are the sites of its own (not shared) that it can recompute. The runtime then runs the
    layer as megatron's full recompute does, without its hooks (runtime/layer.py)."""
    return frozenset(site.name for site in sites
                     if site.can_recompute and not site_table.get(site.name).shared)


def recomputes_whole(sites: Iterable[SiteCost], decisions: Mapping[str, Decision]) -> bool:
    """Whether ``decisions`` recompute every site of ``whole_layer_sites`` and compress none.

    Decisions on sites the layer does not save (not in ``sites``) change nothing."""
    sites = tuple(sites)
    whole = whole_layer_sites(sites)
    actions = [decisions[site.name].action for site in sites if site.name in decisions]
    return (bool(whole) and COMPRESS not in actions
            and all(name in decisions and decisions[name].action == RECOMPUTE for name in whole))


def is_hooked(sites: Iterable[SiteCost], decisions: Mapping[str, Decision]) -> bool:
    """Whether a layer under ``decisions`` runs under the runtime's hooks.

    It does when it has an action, unless it recomputes whole (``recomputes_whole``)."""
    return (any(decision.action != RETAIN for decision in decisions.values())
            and not recomputes_whole(sites, decisions))


def evaluate_layer(costs: ModelCosts, decisions: Mapping[str, Decision]) -> LayerPolicy:
    """The cost vector of a layer policy, straight from the definitions."""
    options = _chosen_options(costs, decisions)
    hooks_s = costs.hooked_layer_s if is_hooked(costs.sites, decisions) else 0.0
    return LayerPolicy(dict(decisions),
                       sum(_site_times(costs, decisions, options).values()) + hooks_s,
                       sum(option.stored for option in options.values()),
                       _layer_transient(costs, decisions, options))


# --- a plan's peak ---------------------------------------------------------------------------
def _held_by_others(costs: ModelCosts, all_stored):
    """(k - 1)(A + E) + E: the other in-flight micro-batches whole, and this one's embedding.

    A is one micro-batch's layers' stored bytes together."""
    others = costs.in_flight_micro_batches - 1
    return others * all_stored + (others + 1) * costs.embedding_bytes


def activation_terms(costs: ModelCosts, all_stored, backward_peak):
    """The activations part of the peak rule, given A.

    That is (k - 1)(A + E) + E + max(non_layer + R + A, ``backward_peak`` + H). Either argument
    may be an array: the searches evaluate many plans at once."""
    return _held_by_others(costs, all_stored) + np.maximum(
        costs.non_layer_bytes + costs.received_input_bytes + all_stored,
        backward_peak + costs.held_non_layer_bytes)


def _forward_backward_terms(costs: ModelCosts, all_stored, backward_peak):
    """The forward and backward's part of the peak rule over static, less the overheads."""
    return activation_terms(costs, all_stored, backward_peak + costs.backward_workspace_bytes)


def peak_from_terms(costs: ModelCosts, all_stored, backward_peak):
    """The peak rule, given A and max_l [prefix(l) + transient(l)]."""
    forward_backward = (costs.allocator_overhead_bytes
                        + _forward_backward_terms(costs, all_stored, backward_peak))
    return (costs.static_bytes + costs.persistent_overhead_bytes
            + np.maximum(forward_backward,
                         costs.held_non_layer_bytes + costs.optimizer_step_bytes))


def forward_backward_bytes(costs: ModelCosts, layers: Sequence[LayerPolicy]) -> int:
    """What a plan's forward and backward add to static at their peak: activations, workspace.

    The plan table's "activations"; neither overhead term is in it."""
    return int(_forward_backward_terms(costs, *_stored_terms(layers)))


def _stored_terms(layers: Sequence[LayerPolicy]) -> tuple[int, int]:
    """(A, max_l [prefix(l) + transient(l)]) of a plan whose layer l follows ``layers[l]``."""
    prefix, backward_peak = 0, 0
    for layer in layers:
        prefix += layer.stored_bytes
        backward_peak = max(backward_peak, prefix + layer.transient_bytes)
    return prefix, backward_peak


def peak_bytes(costs: ModelCosts, layers: Sequence[LayerPolicy]) -> int:
    """Predicted peak memory of a plan whose layer l (0 = nearest the embedding) follows layers[l].

    The memory model is in this module's docstring."""
    return int(peak_from_terms(costs, *_stored_terms(layers)))


def forward_end_bytes(costs: ModelCosts, layers: Sequence[LayerPolicy]) -> int:
    """Activations the stage holds when its k-th in-flight micro-batch's forward ends.

    That is the most it keeps for backward, the ruler's ``activation_bytes``: k (A + E) +
    non_layer."""
    all_stored = _stored_terms(layers)[0]
    return int(_held_by_others(costs, all_stored) + costs.non_layer_bytes + all_stored)


def activation_peak_bytes(costs: ModelCosts, layers: Sequence[LayerPolicy]) -> int:
    """The activation bytes alive at the stage's peak (the ruler's ``activation_peak_bytes``).

    It includes backward's decoded and rebuilt values, but not static memory or the gradients'
    workspace. It is an upper bound where decoded values or a rebuild meet stored values backward
    has already freed."""
    return int(activation_terms(costs, *_stored_terms(layers)))


class Limits(NamedTuple):
    """The peak rule turned round: the limits a budget sets on a plan.

    A plan fits iff its layers store at most ``all_stored`` bytes together (one micro-batch), and
    (k - 1) x that total + every layer's prefix + transient is at most ``backward``. The budget
    must also hold the optimizer step, which no plan changes; the searches check the smallest
    feasible budget first."""

    all_stored: int
    backward: int


def budget_limits(costs: ModelCosts, budget_bytes: int) -> Limits:
    k = costs.in_flight_micro_batches
    available = (budget_bytes - costs.static_bytes - costs.persistent_overhead_bytes
                 - costs.allocator_overhead_bytes - k * costs.embedding_bytes)
    # k x A + non_layer + R <= available; floor division keeps the limit exact in whole bytes.
    return Limits((available - costs.non_layer_bytes - costs.received_input_bytes) // k,
                  available - costs.backward_workspace_bytes - costs.held_non_layer_bytes)


def transient_floor(costs: ModelCosts) -> int:
    """Transient bytes below which a layer's transient cannot set the peak.

    Any prefix is at most the total stored, and total + non_layer + R is itself a term of the
    peak. So prefix + max(transient, non_layer + R - workspace) + workspace gives the same peak."""
    return max(0, costs.non_layer_bytes + costs.received_input_bytes
               - costs.backward_workspace_bytes - costs.held_non_layer_bytes)
