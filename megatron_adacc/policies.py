"""``--adacc-policy``: from a name to the Plan the runtime applies.

    none            megatron's stock layer, no hooks at all (no plan)
    FILE.yaml       a plan written, or pinned, by hand
    full-recompute  every site rebuilt from layer_in in backward: the paper's "Megatron-LM"
                    full-recomputation baseline, run by the Adacc runtime
    quantize        the paper's "Quantization" baseline: every floating-point site, layer_in
                    included, per-token INT4 (naive_int4). Dropout masks are bit-packed
                    instead: lossless, smaller than INT4, and on a GPU they are bool tensors,
                    which INT4 does not define
    auto            profile the model (or reuse its ProfileDB row), then plan the fastest mix
                    of retain, compress and recompute that fits --adacc-memory-budget
    auto-no-outlier the paper's ablation "Adacc w/o outlier": auto, with plain group-wise
                    int4 (sym_int4) wherever auto would separate outliers (outlier_int4)

The baselines are Plans through the same runtime as ``auto``, so the comparison measures the
decisions, not two mechanisms. Megatron's cached causal mask is one storage shared by every
layer: every policy keeps it (compressing or rebuilding it per layer would cost memory).

``auto`` plans with each site's designated codec and exact rebuild sources (no recomputed site
rebuilt from a compressed anchor): a rebuild from a lossy layer_in or ln2_in would change every
rebuilt value. Its last resort: when no plan with the designated codecs fits the budget, it plans
again with the quantize baseline's per-token INT4 (sites.QUANTIZE_CODEC) added to the options
of each floating-point site where it keeps fewer bytes than the designated codec. Per-token
INT4 separates no outliers, so its payload is smaller and it fits micro-batches the
outlier-separating codecs do not; the plan table marks those
sites and rank 0 warns that their accuracy is the quantize baseline's. Only when that wider
space is infeasible too does auto raise InfeasibleBudget, naming its smallest feasible budget.
``auto-no-outlier`` likewise: its ablation codecs first, per-token INT4 as the last resort.
``plan`` is the one entry point of both tiers: set-up, the rectifier's re-plans, ``adacc plan``
(every pipeline stage on its own) and the benchmarks plan through it. Costs that lack the last
resort's measurements (analytic costs, a hand-made profile) simply have no last resort; a
ProfileDB row stored before the profiler measured it is keyed by an older code version and is
profiled again.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_adacc import allocator, planning, profiler
from megatron_adacc.attention import backend_of
from megatron_adacc.costs import ModelCosts
from megatron_adacc.plan import Decision, Plan
from megatron_adacc.profile_db import ProfileDB, profile_key
from megatron_adacc.sites import COMPRESS, DECIDED_SITES, RECOMPUTE

NAMED = ("none", "auto", "auto-no-outlier", "full-recompute", "quantize")
AUTO_POLICIES = ("auto", "auto-no-outlier")  # profile and plan for a budget


def full_recompute_plan() -> Plan:
    return Plan.uniform({site.name: Decision(RECOMPUTE) for site in DECIDED_SITES
                         if site.recomputable})


def quantize_plan() -> Plan:
    # A site without a last resort codec but with a designated one is a dropout mask: its
    # designated bit-packing (codec None) is lossless and smaller than INT4.
    return Plan.uniform({site.name: Decision(COMPRESS, site.last_resort_codec)
                         for site in DECIDED_SITES if site.default_codec is not None})


def is_known(policy: str) -> bool:
    return policy in NAMED or Path(policy).is_file()


def uses_runtime(policy: str) -> bool:
    """Every policy but ``none`` needs the Adacc layer spec."""
    return policy != "none"


def default_budget() -> int | None:
    """On a GPU, the memory this process may still plan for, read once the model is built
    (other processes' and the CUDA context's memory is not the budget's); None on a CPU."""
    return allocator.plannable_bytes()


def require_budget(policy: str, budget_bytes: int | None) -> None:
    """An auto policy plans for a budget: without one (a CPU has no capacity to default
    to) it is a ValueError saying what to pass."""
    if policy in AUTO_POLICIES and budget_bytes is None:
        raise ValueError(f"--adacc-policy {policy} on a CPU needs --adacc-memory-budget SIZE "
                         "(e.g. 512MiB): there is no device capacity to default to")


def predicted_activation_bytes(costs: ModelCosts, result: planning.PlanResult) -> int:
    """Activation bytes kept at the end of forward under ``result``, the quantity the ruler
    reports as ``activation_bytes``: non-layer bytes plus what every layer stores."""
    return costs.non_layer_bytes + sum(planning.evaluate_layer(costs, decisions).stored_bytes
                                       for decisions in result.layer_decisions)


@dataclass
class Resolved:
    name: str
    plan: Plan | None              # None: megatron's stock layer
    budget_bytes: int | None
    costs: ModelCosts | None = None
    result: planning.PlanResult | None = None
    profile_s: float | None = None  # None: the costs came from the ProfileDB

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id if self.plan is not None else "none"


def resolve(policy: str, budget_bytes: int | None, model: torch.nn.Module | None = None,
            batch: profiler.Batch | None = None, *, db: ProfileDB | None = None,
            reprofile: bool = False, strict: bool = False,
            loss_fn: profiler.LossFn | None = None,
            static_bytes: int | None = None) -> Resolved:
    """The plan for ``policy``. ``auto`` needs the model (built with the Adacc layer spec)
    and one real micro-batch, and raises planning.InfeasibleBudget (a ValueError naming the
    smallest feasible budget) when nothing fits. ``static_bytes``: what parameters and the
    optimizer hold (``optimizer.static_bytes``; None: the profile's, the optimizer held
    whole), which a stored profile cannot know."""
    if policy == "none":
        return Resolved(policy, None, budget_bytes)
    if policy == "full-recompute":
        return Resolved(policy, full_recompute_plan(), budget_bytes)
    if policy == "quantize":
        return Resolved(policy, quantize_plan(), budget_bytes)
    if policy not in AUTO_POLICIES:
        return Resolved(policy, Plan.load(policy), budget_bytes)
    require_budget(policy, budget_bytes)
    costs, profile_s = measured_costs(model, batch, db or ProfileDB(), reprofile, strict,
                                      loss_fn)
    if static_bytes is not None:
        costs = replace(costs, static_bytes=static_bytes)
    # Every rank plans the same costs with the same deterministic planner: one plan, and an
    # infeasible budget fails on every rank alike instead of leaving the others waiting.
    result = plan(policy, costs, budget_bytes, allow_lossy_sources=False)
    return Resolved(policy, result.plan, budget_bytes, costs, result, profile_s)


def plan(policy: str, costs: ModelCosts, budget_bytes: int, **options) -> planning.PlanResult:
    """The fastest plan of auto policy ``policy`` that fits ``budget_bytes`` (``options`` as
    ``planning.plan``'s): its own codecs first, the last resort only when they fit no plan
    (planning.plan_in_tiers). Raises planning.InfeasibleBudget naming the smallest budget
    of the wider space when neither fits."""
    return planning.plan_in_tiers(costs, budget_bytes, separate_outliers=_separates(policy),
                                  **options)


def planning_costs(policy: str, costs: ModelCosts) -> ModelCosts:
    """The costs ``policy`` plans with first: its own codecs, without the last resort."""
    return planning.codec_tiers(costs, _separates(policy))[0]


def designated_codecs(costs: ModelCosts) -> ModelCosts:
    """``costs`` narrowed to each site's designated codec (auto's first tier)."""
    return planning_costs("auto", costs)


def _separates(policy: str) -> bool:
    if policy not in AUTO_POLICIES:
        raise ValueError(f"only the auto policies plan from costs, not {policy!r}")
    return policy == "auto"


def last_resort_warning(policy: str, result: planning.PlanResult) -> str | None:
    """The line rank 0 prints when ``policy``'s plan had to use the last resort; None
    otherwise."""
    used = planning.last_resort_sites(result)
    if not used:
        return None
    own = {"auto": "outlier-separating codecs",
           "auto-no-outlier": "auto-no-outlier's plain int4 codecs"}[policy]
    return (f"adacc: warning: the budget is below what {own} fit: {len(used)} "
            f"site{'s' if len(used) != 1 else ''} use naive INT4 ({', '.join(used)}); expect "
            f"the accuracy of the quantize baseline there")


def measured_costs(model, batch, db: ProfileDB, reprofile: bool = False, strict: bool = False,
                   loss_fn: profiler.LossFn | None = None
                   ) -> tuple[ModelCosts, float | None]:
    """(costs, seconds spent profiling or None when the ProfileDB had them). Rank 0 looks
    the costs up (or measures them) and every rank gets rank 0's copy. When measuring, every
    rank runs the profiling steps: tensor-parallel layers need their peers."""
    config = model.config
    tokens = batch[0]
    key = profile_key(config, model.vocab_size, tokens.shape[1], tokens.shape[0],
                      profiler.device_name(tokens.device), backend_of(model))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    found = db.get(key) if rank0 and not reprofile else None
    missing = _from_rank0(found is None)
    profile_s = None
    if missing:
        started = time.perf_counter()
        found = profiler.profile(model, batch, strict=strict, loss_fn=loss_fn)
        profile_s = time.perf_counter() - started
        if rank0:
            db.put(key, found)
    return ModelCosts.from_json(_from_rank0(found.to_json() if rank0 else None)), profile_s


def _from_rank0(value):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def describe(resolved: Resolved) -> str:
    """What rank 0 prints before training: where the costs came from and the plan table."""
    from megatron_adacc.report import format_plan

    if resolved.result is None:
        return f"adacc: policy {resolved.name}, plan {resolved.plan_id}"
    origin = ("reused the profile in the ProfileDB" if resolved.profile_s is None
              else f"profiled in {resolved.profile_s:.1f} s")
    return (f"adacc: policy {resolved.name} ({origin}; {resolved.costs.meta.get('device', '?')}), "
            f"plan {resolved.plan_id}\n{format_plan(resolved.result)}")
