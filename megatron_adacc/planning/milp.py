"""The direct MILP (``plan(..., method="milp")``): one binary per layer, site and action.

It is the paper's model extended with the same constraints, with the rebuild time as one continuous
variable per layer and segment. It is slower than the frontier search, kept as the cross-check and
benchmark, and the only module that imports PuLP.

A linear programme cannot call the model per policy, so its coefficients are the model's per-site
terms:
- each option's time, stored and additive transient bytes (``site_options``);
- the decoded term, as the largest compressed sum over ``decoded_sets``;
- the held sources: a compressed re-run start or operator source (``source_bytes``), forbidden for
  exact plans where a lossy codec holds it;
- the segments' run times, and the operators' times once per operator with a recomputed product;
- the hooks' time, once per layer with any action that does not recompute it whole;
- the budget, as the peak rule's limits (``budget_limits``).
The plan CBC returns is re-evaluated by the model and kept only if its exact peak fits.
"""
from __future__ import annotations

import itertools
from typing import Any

import pulp

from megatron_adacc.common.costs import ModelCosts, segment_run_s
from megatron_adacc.planning.model import (LayerPolicy, budget_limits, decoded_sets,
                                           evaluate_layer, peak_bytes, site_options,
                                           source_bytes, whole_layer_sites)
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE, VIEW_PAYLOADS

# CBC works in floating point with absolute tolerances near 1e-7: bytes are given to it in
# units of 1/1024 of the budget and times in ms, so that coefficients are of order 1..1e5
# whatever the model's size (in MiB, a test model's sites of tens of bytes fell inside CBC's
# tolerances and it returned a slower plan as optimal). Results are re-checked in exact
# integer bytes.
_BUDGET_UNITS = 1024.0
_MS = 1e3


def _cbc() -> pulp.LpSolver:
    # Cuts off: on a 3-layer test model CBC's cut generation removed the optimum (1.0 s,
    # feasible when the binaries are fixed to it) and it reported a 1.25 s plan as optimal.
    # A cross-check must be exact before it is fast. PuLP 4 bundles no solver: COIN_CMD runs
    # the CBC binary its ``cbc`` extra installs (cbcbox).
    return pulp.COIN_CMD(msg=False, gapRel=0.0, gapAbs=1e-9, threads=1, options=["cuts off"])


def _solve(problem: pulp.LpProblem) -> bool:
    # PuLP 4 reports CBC's "optimal (within gap tolerance)" as GapLimit: with _cbc's gaps of
    # zero (and 1e-9 absolute) that is the optimum.
    stats = problem.solve(_cbc())
    return stats.has_solution and stats.status in (pulp.LpSolveStatus.Optimal,
                                                   pulp.LpSolveStatus.GapLimit)


def plan_direct_milp(costs: ModelCosts, budget: int, per_layer: bool,
                     allow_lossy_sources: bool) -> list[LayerPolicy] | None:
    """The fastest plan by the direct formulation, or None when CBC finds nothing that fits.

    It has a binary per (layer, site, action) and a peak constraint per layer. With
    ``per_layer=False`` all layers share one set of binaries (the paper's model)."""
    num_layers = costs.num_layers
    limits = budget_limits(costs, budget)
    unit = max(1, budget) / _BUDGET_UNITS
    options = {site.name: site_options(site) for site in costs.sites}
    groups = range(num_layers) if per_layer else range(1)
    problem = pulp.LpProblem("adacc_direct", pulp.LpMinimize)
    x = {(g, name, i): problem.add_variable(f"x_{g}_{name}_{i}", cat="Binary")
         for g in groups for name, opts in options.items() for i in range(len(opts))}

    def total(g: int, attribute: str, scale: float) -> Any:
        return pulp.lpSum(getattr(opt, attribute) / scale * x[g, name, i]
                          for name, opts in options.items() for i, opt in enumerate(opts))

    def chosen(g: int, name: str, action: str) -> Any:
        return pulp.lpSum(x[g, name, i] for i, opt in enumerate(options.get(name, ()))
                          if opt.decision.action == action)

    # Recomputable sites by segment index, and the rebuild time of each (group, segment):
    # at least the rebuild of each recomputed site in it, and the whole segment when a
    # re-run goes on through it into a later one (see rerun_chains).
    held = [[site for site in costs.sites if site.segment == segment.name and site.can_recompute]
            for segment in costs.segments]
    rebuild = {(g, k): problem.add_variable(f"rebuild_{g}_{k}", 0)
               for g in groups for k in range(len(held))}
    # Each operator runs (continuous in [0, 1], pushed down by the objective) when one of its
    # products is recomputed.
    ran = {(g, k): problem.add_variable(f"ran_{g}_{k}", 0, 1)
           for g in groups for k in range(len(costs.operators))}
    products = [[site.name for site in costs.sites
                 if site.operator == operator.name and site.can_recompute]
                for operator in costs.operators]
    # The non-additive parts of transient(l), in budget units: the decoded term (the largest
    # compressed sum over decoded_sets) and each compressed value a rebuild reads, held.
    decoded = {g: problem.add_variable(f"decoded_{g}", 0) for g in groups}
    readable = sorted({segment.start for segment in costs.segments}
                      | {source for operator in costs.operators for source in operator.sources})
    hold = {(g, name): problem.add_variable(f"hold_{g}_{name}", 0)
            for g in groups for name in readable}

    def reads_compressed(g: int, name: str, reader: Any) -> None:
        # ``reader`` is 1 when a rebuild reads site ``name``: held if compressed, and
        # forbidden for exact plans if a lossy codec holds it, for every plan if its payload
        # holds its saved view only.
        problem.addConstraint(hold[g, name] >= source_bytes(costs.sites, name) / unit * (
            chosen(g, name, COMPRESS) + reader - 1))
        if name in VIEW_PAYLOADS:
            problem.addConstraint(chosen(g, name, COMPRESS) + reader <= 1)
        elif not allow_lossy_sources:
            lossy = pulp.lpSum(x[g, name, i] for i, opt in enumerate(options.get(name, ()))
                               if opt.lossy)
            problem.addConstraint(lossy + reader <= 1)

    # A layer with any action runs under the runtime's hooks (model.is_hooked): continuous in
    # [0, 1], pushed down by the objective. Unless it recomputes whole: a binary, at most each
    # of those sites' recompute, pushed up by the objective.
    hooked = {g: problem.add_variable(f"hooked_{g}", 0, 1) for g in groups}
    whole_sites = whole_layer_sites(costs.sites)
    whole = {g: problem.add_variable(f"whole_{g}", cat="Binary") for g in groups}
    weight = 1 if per_layer else num_layers
    problem += pulp.lpSum(weight * (total(g, "time_s", 1 / _MS)
                                    + costs.hooked_layer_s * _MS * hooked[g]
                                    + pulp.lpSum(rebuild[g, k] for k in range(len(held)))
                                    + pulp.lpSum(operator.rebuild_s * _MS * ran[g, k]
                                                 for k, operator in enumerate(costs.operators)))
                          for g in groups)
    for g in groups:
        if not whole_sites:
            problem += whole[g] == 0
        for name, opts in options.items():
            problem += pulp.lpSum(x[g, name, i] for i in range(len(opts))) == 1
            problem += hooked[g] >= chosen(g, name, COMPRESS) + chosen(g, name, RECOMPUTE) - (
                whole[g] if name in whole_sites else 0)
            if name in whole_sites:
                problem += whole[g] <= chosen(g, name, RECOMPUTE)
        for k, sites in enumerate(held):
            for site in sites:
                problem += rebuild[g, k] >= site.rebuild_s * _MS * chosen(g, site.name, RECOMPUTE)
            # A re-run of segment k starts from its start unless that start is recomputed
            # (then it is no compressed value): held when compressed.
            for site in sites:
                reads_compressed(g, costs.segments[k].start, chosen(g, site.name, RECOMPUTE))
        # Continuous in [0, 1] and pushed down by the objective: at the optimum each is 1
        # exactly when some recomputed site of its segment forces it.
        rebuilt = [problem.add_variable(f"rebuilt_{g}_{k}", 0, 1) for k in range(len(held))]
        for k, sites in enumerate(held):
            for site in sites:
                problem += rebuilt[k] >= chosen(g, site.name, RECOMPUTE)
        # Segments i < j both rebuilt, with every start after i up to j's recomputed: one
        # re-run, whose segments i..j-1 run whole.
        for i, j in itertools.combinations(range(len(held)), 2):
            starts_recomputed = pulp.lpSum(chosen(g, segment.start, RECOMPUTE)
                                           for segment in costs.segments[i + 1:j + 1])
            for k in range(i, j):
                run_ms = segment_run_s(costs.sites, costs.segments[k].name) * _MS
                problem += rebuild[g, k] >= run_ms * (rebuilt[i] + rebuilt[j] + starts_recomputed
                                                      - (j - i + 1))
        for k, operator in enumerate(costs.operators):
            for name in products[k]:
                problem += ran[g, k] >= chosen(g, name, RECOMPUTE)
                for source in operator.sources:
                    reads_compressed(g, source, chosen(g, name, RECOMPUTE))
        for group in decoded_sets(costs.sites):
            problem += decoded[g] >= pulp.lpSum(
                site.bytes / unit * chosen(g, site.name, COMPRESS)
                for site in costs.sites if site.name in group)

    def transient(g: int) -> Any:
        return (total(g, "transient", unit) + decoded[g]
                + pulp.lpSum(hold[g, name] for name in readable))

    if per_layer:
        all_stored = pulp.lpSum(total(k, "stored", unit) for k in groups)
        prefixes = [pulp.lpSum(total(k, "stored", unit) for k in range(layer + 1))
                    for layer in range(num_layers)]
    else:
        all_stored = num_layers * total(0, "stored", unit)
        prefixes = [all_stored]         # the top layer's term is the largest
    # The other in-flight micro-batches hold every layer while this one backprops.
    others = (costs.in_flight_micro_batches - 1) * all_stored
    for layer, prefix in enumerate(prefixes):
        problem += others + prefix + transient(layer) <= limits.backward / unit
    problem += all_stored <= limits.all_stored / unit
    if not _solve(problem):
        return None
    layers = []
    for layer in range(num_layers):
        g = layer if per_layer else 0
        decisions = {name: opts[i].decision for name, opts in options.items()
                     for i in range(len(opts)) if x[g, name, i].value() > 0.5}
        layers.append(evaluate_layer(costs, decisions))
    return layers if peak_bytes(costs, layers) <= budget else None
