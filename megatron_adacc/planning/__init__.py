"""The planner: the fastest plan whose predicted peak memory fits a budget.

- ``model``: the memory/time model, a layer policy's (time, stored, transient), the peak rule.
- ``frontier``: the per-layer Pareto frontier of single-layer policies.
- ``search``: plan(), minimum_budget(), the per-layer and uniform searches over the frontier.
- ``milp``: the direct PuLP/CBC formulation, plan(..., method="milp"), imported on use only.
- ``pipeline``: 1F1B's in-flight micro-batches per stage, the layer split, a plan per stage,
  and what an infeasible budget would fit with lossy rebuild sources.
- ``tiers``: which codecs auto plans with, its own first and the quantize baseline's last.
- ``result``: PlanResult and the rows of the plan table.
- ``report``: the plan table as a person reads it.

Everything outside this package uses the names below only.
"""
from megatron_adacc.planning.frontier import (Frontier, clear_frontier_cache, layer_frontier,
                                              pareto_indices)
from megatron_adacc.planning.model import (LayerPolicy, activation_peak_bytes, evaluate_layer,
                                           forward_end_bytes, is_exact, peak_bytes,
                                           rebuild_charges, rerun_chains)
from megatron_adacc.planning.pipeline import (StageMemory, StagePlan, in_flight_micro_batches,
                                              plan_stages, stage_costs, stage_layer_counts,
                                              with_lossy_hint)
from megatron_adacc.planning.report import format_plan, format_stages
from megatron_adacc.planning.result import PlanResult, SiteRow, Totals, layer_ranges
from megatron_adacc.planning.search import (InfeasibleBudget, default_resolution,
                                            minimum_budget, plan)
from megatron_adacc.planning.tiers import (codec_tiers, last_resort_sites,
                                           minimum_feasible_budget, plan_in_tiers)

__all__ = [
    "Frontier", "InfeasibleBudget", "LayerPolicy", "PlanResult", "SiteRow", "StageMemory",
    "StagePlan", "Totals", "activation_peak_bytes", "clear_frontier_cache", "codec_tiers",
    "default_resolution", "evaluate_layer", "format_plan",
    "format_stages", "forward_end_bytes", "in_flight_micro_batches",
    "is_exact", "last_resort_sites", "layer_frontier", "layer_ranges", "minimum_budget",
    "minimum_feasible_budget", "pareto_indices",
    "peak_bytes", "plan",
    "plan_in_tiers", "plan_stages", "rebuild_charges", "rerun_chains", "stage_costs",
    "stage_layer_counts", "with_lossy_hint",
]
