"""The per-layer Pareto frontier of single-layer policies in (time, stored, transient).

A single-layer policy takes one action per site. layer_in-style sites are never recomputed, and with
``allow_lossy_sources=False`` no rebuild reads a compressed value. The frontier is built site by
site, so the 3^n policies are never listed (``_frontier`` says how). It is built once per cap of the
decoded term, with transient clipped at ``model.transient_floor``. docs/memory-model.md ("Search")
says why some optimal plan uses frontier policies only.

Every charge comes from the model's per-site terms (``site_options``, ``decoded_sets``,
``rerun_source_bytes``, ``source_bytes``, the segments' run times, the operators' times).
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from megatron_adacc.common.costs import ModelCosts, Operator, Segment, SiteCost, segment_run_s
from megatron_adacc.planning.model import (LayerPolicy, SiteOption, decoded_sets,
                                           evaluate_layer, rerun_source_bytes, site_options,
                                           source_bytes, transient_floor, whole_layer_sites)
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE, RETAIN, VIEW_PAYLOADS


# pareto_indices' block of rows checked against each other, and which row precedes which in it
_BLOCK = 256
_EARLIER = np.tri(_BLOCK, k=-1, dtype=bool)


def _dominated_within(stored: np.ndarray, transient: np.ndarray) -> np.ndarray:
    """Which of at most _BLOCK rows, in order, an earlier one of them stores and holds no less."""
    n = len(stored)
    return ((stored[None, :] <= stored[:, None]) & (transient[None, :] <= transient[:, None])
            & _EARLIER[:n, :n]).any(axis=1)


def pareto_indices(points: np.ndarray) -> np.ndarray:
    """Indices of the rows of ``points`` (time, stored, transient) that no other row dominates.

    Weak dominance counts, and duplicates keep one. In lexicographic order a row is dominated iff
    some earlier row has stored and transient <= its own; its time is <= by the order. Rows are
    checked in blocks: against the staircase of (stored, transient) minima of all earlier
    blocks, with one binary search per row, then the rows it leaves against each other. So the
    cost stays near n log n, not n^2."""
    if len(points) < 2:
        return np.arange(len(points))
    order = np.lexsort((points[:, 2], points[:, 1], points[:, 0]))
    stored, transient = points[order, 1], points[order, 2]
    if (transient == transient[0]).all():
        # One transient (typically all clipped to the floor): a row is dominated iff an
        # earlier row stores no more, i.e. iff it does not store strictly less than all
        # earlier rows.
        least_before = np.minimum.accumulate(np.concatenate([[np.inf], stored[:-1]]))
        return order[stored < least_before]
    if len(order) <= _BLOCK:  # most calls: one block, no staircase
        return order[~_dominated_within(stored, transient)]
    dominated = np.zeros(len(order), dtype=bool)
    # The staircase: stored ascending, transient strictly descending; the least transient of
    # any earlier row storing at most s is that of the last step at or below s.
    stair_stored, stair_transient = np.empty(0), np.empty(0)
    for start in range(0, len(order), _BLOCK):
        end = min(start + _BLOCK, len(order))
        s, t = stored[start:end], transient[start:end]
        hit = np.zeros(end - start, dtype=bool)
        if len(stair_stored):
            step = np.searchsorted(stair_stored, s, side="right") - 1
            hit = (step >= 0) & (stair_transient[np.maximum(step, 0)] <= t)
        # Only the rows the staircase left are compared pairwise: a row that an earlier hit row
        # dominates, that row's dominator dominates too.
        left = ~hit
        hit[left] = _dominated_within(s[left], t[left])
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
    options: list[list[SiteOption]]
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


def layer_frontier(costs: ModelCosts, allow_lossy_sources: bool = True) -> Frontier:
    """The Pareto frontier of single-layer policies in (time, stored, transient).

    Transient is clipped from below at ``transient_floor``, which changes no peak. The frontier
    depends on the per-layer costs only, so re-planning the same costs at another budget reuses
    it. ``clear_frontier_cache`` forgets it, e.g. to time a cold search."""
    frontier = _frontier(tuple(costs.sites), tuple(costs.segments), tuple(costs.operators),
                         allow_lossy_sources, transient_floor(costs), costs.hooked_layer_s)
    return _with_whole_layer(frontier, costs)


def _with_whole_layer(frontier: Frontier, costs: ModelCosts) -> Frontier:
    """``frontier`` with the policy that recomputes the layer whole, charged no hooks.

    ``_frontier`` charges every policy but keeping everything the hooks' time, and may have
    pruned this one before that charge (model.recomputes_whole)."""
    whole = whole_layer_sites(costs.sites)
    if not whole or not costs.hooked_layer_s:
        return frontier
    choice = [next(index for index, option in enumerate(options)
                   if option.decision.action == (RECOMPUTE if site.name in whole else RETAIN))
              for site, options in zip(frontier.sites, frontier.options)]
    policy = evaluate_layer(costs, {site.name: frontier.options[column][index].decision
                                    for column, (site, index)
                                    in enumerate(zip(frontier.sites, choice))})
    time_s = np.append(frontier.time_s, policy.time_s)
    stored = np.append(frontier.stored, policy.stored_bytes)
    transient = np.append(frontier.transient, policy.transient_bytes)
    keep = pareto_indices(np.column_stack(
        [time_s, stored, np.maximum(transient, transient_floor(costs))]))
    choices = np.vstack([frontier.choices, np.array(choice, dtype=frontier.choices.dtype)])
    return Frontier(frontier.sites, frontier.options, time_s[keep], stored[keep],
                    transient[keep], choices[keep])


def clear_frontier_cache() -> None:
    """Forget every frontier built so far: the next plan builds its frontier anew."""
    _frontier.cache_clear()


@functools.lru_cache(maxsize=32)
def _frontier(sites: tuple[SiteCost, ...], segments: tuple[Segment, ...],
              operators: tuple[Operator, ...], allow_lossy_sources: bool,
              floor: int, hooked_layer_s: float) -> Frontier:
    """Build the frontier site by site, carrying the rebuild time in a small state.

    Site order (``_build_order``): the operators' products, last operator first; then the re-runs,
    deepest first (segments last to first, each segment's sites longest rebuild first); then the
    sites nothing rebuilds. Each product comes before its operator's sources, each site of a segment
    before the segment's start, and each segment's start before the earlier segments' sites and
    starts. (ln2_in, the MLP's start, is also an operator's product.)

    Charges, as sites are met:
    - An operator is charged at its first recomputed product, marked by a flag per operator. That
      product flags the operator's sources. A flagged compressed source is held and charged its
      bytes. A lossy codec there makes the rebuild lossy, dropped for exact plans.
    - The first recomputed site met is the deepest of the last rebuilt segment. A recomputed site in
      an earlier segment either extends that re-run (the segments between run whole) or starts its
      own (``rerun_chains``). So the rebuild time is charged as met (``rebuild_charges`` in steps).
      The state holds the lowest segment rebuilt so far, and whether every segment start met since
      is recomputed (then the re-run can still be extended).
    - A start met while its segment is the lowest rebuilt begins that re-run. Compressed, it is held
      (``rerun_source_bytes``, unless a flag charged it already); lossy, it is dropped for exact
      plans.
    - The whole is built once per cap of the decoded term. Within a cap, each decoded-together
      group's compressed bytes are carried in the state while the group has sites to come.
    - Every policy but keeping everything is charged ``hooked_layer_s`` at the end. It is the same
      for all of them, so pruning before it lost at most keeping everything, which is put back.
    """
    names = [segment.name for segment in segments]
    none = len(segments)            # "no segment rebuilt yet"
    order = _build_order(sites, segments, operators)
    run_s = np.array([segment_run_s(sites, name) for name in names])
    starts = {segment.start: index for index, segment in enumerate(segments)}
    operator_index = {operator.name: index for index, operator in enumerate(operators)}
    position = {site.name: index for index, site in enumerate(order)}
    # The sources an operator reads, each a flag in the state until it is added.
    flagged = sorted({source for operator in operators for source in operator.sources
                      if source in position}, key=position.get)
    flag_of = {name: index for index, name in enumerate(flagged)}
    reads = [[flag_of[source] for source in operator.sources if source in flag_of]
             for operator in operators]
    options = [site_options(site) for site in order]
    # Sites a rebuild may read compressed in this mode (held decoded): their bytes may still
    # join a transient.
    holdable = {site.name for site, candidates in zip(order, options)
                if site.name not in VIEW_PAYLOADS
                and any(o.decision.action == COMPRESS and (allow_lossy_sources or not o.lossy)
                        for o in candidates)}
    if np.prod([float(len(o)) for o in options]) >= 2.0**63:
        raise ValueError(f"{len(order)} sites have too many options to number every policy")
    # Pruning compares transients clipped at what still cannot reach the floor once every
    # site to come adds its most: two partial policies both below that end up at the floor
    # alike. (With GPT-sized logits the floor exceeds any layer's transient, and the
    # frontier is two-dimensional from the start.)
    to_come = np.cumsum([max(o.transient for o in candidates)
                         for candidates in options][::-1])[::-1]
    unreachable = floor - np.append(to_come[1:], 0) - (
        sum(rerun_source_bytes(sites, segment) for segment in segments
            if segment.start in holdable)
        + sum(source_bytes(sites, name) for name in flagged if name in holdable))
    compressible = {site.name: site.bytes for site, candidates in zip(order, options)
                    if any(o.decision.action == COMPRESS for o in candidates)}
    groups = [group for group in decoded_sets(sites) if len(group) > 1]
    caps = sorted({0} | {sum(compressible[name] for name in subset)
                         for group in decoded_sets(sites)
                         for size in range(1, len(group) + 1)
                         for subset in itertools.combinations(
                             sorted(group & compressible.keys()), size)})
    # groups whose last site (in build order) is site k: their sums leave the state after it
    closing = [[j for j, group in enumerate(groups)
                if max(position[name] for name in group) == k] for k in range(len(order))]
    # operators whose last product is site k: their flags leave the state after it
    last_product = {operator_index[site.operator]: k for k, site in enumerate(order)
                    if site.operator is not None}
    closing_operators = [[j for j, k_last in last_product.items() if k_last == k]
                         for k in range(len(order))]

    def grow(cap: int) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
        # (lowest rebuilt segment, its re-run extendable, compressed bytes of each open
        # group, flagged sources, operators charged) -> (time, stored, transient) rows and
        # each row's option choices as one mixed-radix integer (site k's choice is digit k).
        states = {(none, True, (0,) * len(groups), (False,) * len(flagged),
                   (False,) * len(operators)): (np.array([[0.0, 0.0, float(cap)]]),
                                                np.zeros(1, dtype=np.int64))}
        radix = 1
        for index, (site, candidates) in enumerate(zip(order, options)):
            segment = names.index(site.segment) if site.segment is not None else None
            operator = operator_index.get(site.operator)
            flag = flag_of.get(site.name)
            starting = starts.get(site.name)    # the segment this site starts, if any
            grown: dict[tuple, list[tuple[np.ndarray, np.ndarray]]] = {}
            for (lowest, extendable, sums, flags, ran), (vectors, codes) in states.items():
                for choice, option in enumerate(candidates):
                    charge = option.time_s
                    held, flags_after, ran_after = list(sums), list(flags), list(ran)
                    transient = option.transient
                    recomputed = option.decision.action == RECOMPUTE
                    # A start met while a re-run is open keeps it extendable only if it is
                    # recomputed too; kept or compressed, it begins the lowest one.
                    low, open_ = lowest, extendable and (starting is None or recomputed)
                    if recomputed:
                        if operator is not None:
                            if not ran[operator]:
                                charge, ran_after[operator] = operators[operator].rebuild_s, True
                            for j in reads[operator]:
                                flags_after[j] = True
                        elif low == none or (segment < low and not open_):
                            low, open_, charge = segment, True, site.rebuild_s
                        elif segment < low:
                            low, open_, charge = segment, True, float(run_s[segment:low].sum())
                    elif option.decision.action == COMPRESS:
                        if site.bytes > cap:
                            continue
                        read = (flag is not None and flags[flag]) or starting == lowest
                        if read:
                            if site.name in VIEW_PAYLOADS or (option.lossy
                                                              and not allow_lossy_sources):
                                continue
                            transient += site.bytes
                        held = [total + site.bytes if site.name in group else total
                                for total, group in zip(held, groups)]
                        if max(held, default=0) > cap:
                            continue
                    for j in closing[index]:
                        held[j] = 0
                    for j in closing_operators[index]:
                        ran_after[j] = False
                    if flag is not None:
                        flags_after[flag] = False
                    key = (low, open_ or low == none, tuple(held), tuple(flags_after),
                           tuple(ran_after))
                    step = np.array([charge, option.stored, transient], dtype=float)
                    grown.setdefault(key, []).append((vectors + step, codes + choice * radix))
            radix *= len(candidates)
            states = {}
            for key, parts in grown.items():
                vectors = np.concatenate([v for v, _ in parts])
                codes = np.concatenate([c for _, c in parts])
                clipped = vectors.copy()
                clipped[:, 2] = np.maximum(clipped[:, 2], unreachable[index])
                keep = pareto_indices(clipped)
                states[key] = (vectors[keep], codes[keep])
        return states

    rows, row_codes = [], []
    for cap in caps:
        for vectors, codes in grow(cap).values():
            rows.append(vectors)
            row_codes.append(codes)
    vectors, codes = np.concatenate(rows), np.concatenate(row_codes)
    # A policy appears under every cap at least its decoded term: keep the least charge,
    # which is exact.
    by_policy = np.lexsort((vectors[:, 2], codes))
    first = np.ones(len(by_policy), dtype=bool)
    first[1:] = codes[by_policy][1:] != codes[by_policy][:-1]
    vectors, codes = vectors[by_policy[first]], codes[by_policy[first]]
    # Choice 0 of every site is to retain it (site_options): code 0 keeps everything. A free
    # action may have pruned it, but not once every other policy pays for the hooks.
    if not (codes == 0).any():
        vectors = np.vstack([vectors, [0.0, sum(site.bytes for site in order), 0.0]])
        codes = np.append(codes, 0)
    vectors[codes != 0, 0] += hooked_layer_s
    clipped = vectors.copy()
    clipped[:, 2] = np.maximum(clipped[:, 2], floor)
    keep = pareto_indices(clipped)
    vectors, codes = vectors[keep], codes[keep]
    choices = np.empty((len(codes), len(order)), dtype=np.int16)
    for column, candidates in enumerate(options):
        codes, choices[:, column] = np.divmod(codes, len(candidates))
    return Frontier(order, options, vectors[:, 0], vectors[:, 1].astype(np.int64),
                    vectors[:, 2].astype(np.int64), choices)


def _build_order(sites: tuple[SiteCost, ...], segments: tuple[Segment, ...],
                 operators: tuple[Operator, ...]) -> list[SiteCost]:
    """The order ``_frontier`` adds sites in: its base order, with dependencies moved first.

    A product comes before its operator's sources, a segment's sites before its start, and a
    segment's start before the sites and starts of earlier segments. Each time, the first site of
    the base order whose turn it is is taken."""
    names = [segment.name for segment in segments]
    base = [site for operator in reversed(operators) for site in sites
            if site.operator == operator.name]
    base += [site for index in reversed(range(len(segments)))
             for site in sorted((s for s in sites if s.segment == names[index]),
                                key=lambda s: -s.rebuild_s)]
    base += [site for site in sites if site.segment is None and site.operator is None]
    sources = {operator.name: operator.sources for operator in operators}
    starts = {segment.name: segment.start for segment in segments}
    after: dict[str, set[str]] = {site.name: set() for site in base}   # site -> what precedes it
    for site in base:
        for later in (sources.get(site.operator, ()) + ((starts[site.segment],)
                                                         if site.segment in starts else ())):
            if later in after and later != site.name:
                after[later].add(site.name)
    for index, segment in enumerate(segments):
        if segment.start not in after:
            continue
        earlier = {s.start for s in segments[:index]} | {
            site.name for site in base if site.segment in names[:index]}
        for name in (earlier & after.keys()) - {segment.start}:
            after[name].add(segment.start)
    order: list[SiteCost] = []
    while base:
        placed = {site.name for site in order}
        site = next(site for site in base if after[site.name] <= placed)
        order.append(site)
        base.remove(site)
    return order
