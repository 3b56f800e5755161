"""``--adacc-policy``: from a name to the Plan the runtime applies.

- ``none``: megatron's stock layer, no hooks at all (no plan).
- ``FILE.yaml``: a plan written, or pinned, by hand.
- ``full-recompute``: the paper's "Megatron-LM" baseline. Every site is rebuilt from layer_in.
- ``quantize``: the paper's "Quantization" baseline. Every floating-point site, layer_in included,
  is per-token INT4 (naive_int4); dropout masks are bit-packed.
- ``auto``: profile the model (or reuse its ProfileDB row). Then plan the fastest mix of retain,
  compress and recompute that fits --adacc-memory-budget.
- ``auto-no-outlier``: the paper's "Adacc w/o outlier" ablation. It is auto with plain group-wise
  int4 (sym_int4) where auto would separate outliers (outlier_int4).

The baselines are Plans run by the same runtime as ``auto``, so a comparison measures the
decisions, not two mechanisms. (Every policy keeps the shared sites, such as the causal mask.)

``auto`` plans in two tiers, both through ``plan``:
- First tier: each site's designated codec, and exact rebuild sources only. A rebuild from a lossy
  layer_in or ln2_in would change every rebuilt value.
- Last resort: per-token INT4 (sites.QUANTIZE_CODEC) joins each floating-point site's options where
  it keeps fewer bytes. The plan table marks those sites, and rank 0 warns that their accuracy is
  the quantize baseline's.
- When both tiers fail, it raises InfeasibleBudget with the smallest feasible budget.

``auto-no-outlier`` does the same with its ablation codecs. Costs without the last resort's
measurements (analytic costs, a hand-made profile) have no last resort.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_adacc import planning
from megatron_adacc.profiling import allocator
from megatron_adacc.profiling import profiler
from megatron_adacc.models.attention import backend_of
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.plan import Decision, Plan
from megatron_adacc.profiling.profile_db import ProfileDB, profile_key
from megatron_adacc.common.sites import COMPRESS, DECIDED_SITES, RECOMPUTE

NAMED = ("none", "auto", "auto-no-outlier", "full-recompute", "quantize")
AUTO_POLICIES = ("auto", "auto-no-outlier")  # profile and plan for a budget


def full_recompute_plan() -> Plan:
    return Plan.uniform({site.name: Decision(RECOMPUTE) for site in DECIDED_SITES
                         if site.recomputable})


def quantize_plan() -> Plan:
    # A site without a last resort codec but with a designated one is a dropout mask: its
    # designated bit-packing (codec None) is lossless and smaller than INT4, and on a GPU
    # the mask is a bool tensor, which INT4 does not define.
    return Plan.uniform({site.name: Decision(COMPRESS, site.last_resort_codec)
                         for site in DECIDED_SITES if site.default_codec is not None})


def is_known(policy: str) -> bool:
    return policy in NAMED or Path(policy).is_file()


def uses_runtime(policy: str) -> bool:
    """Every policy but ``none`` needs the Adacc layer spec."""
    return policy != "none"


def default_budget() -> int | None:
    """On a GPU, the memory this process may still plan for; None on a CPU.

    It is read once the model is built. Other processes' memory and the CUDA context's are not
    part of the budget."""
    return allocator.plannable_bytes()


def require_budget(policy: str, budget_bytes: int | None) -> None:
    """Raise a ValueError saying what to pass when an auto policy has no budget.

    A CPU has no device capacity to default to."""
    if policy in AUTO_POLICIES and budget_bytes is None:
        raise ValueError(f"--adacc-policy {policy} on a CPU needs --adacc-memory-budget SIZE "
                         "(e.g. 512MiB): there is no device capacity to default to")


def require_plannable(policy: str, recompute_granularity: str | None) -> None:
    """Raise a ValueError when Megatron's recompute leaves an auto policy nothing to plan.

    Under full recompute the profile sees each layer's input alone."""
    if policy in AUTO_POLICIES and recompute_granularity == "full":
        raise ValueError(f"--recompute-granularity full keeps only each layer's input, which "
                         f"leaves --adacc-policy {policy} nothing to plan; drop it (auto's "
                         f"plans include full recompute)")


def predicted_activation_bytes(costs: ModelCosts, result: planning.PlanResult) -> int:
    """Activation bytes kept when forward ends under ``result``: the ruler's ``activation_bytes``.

    With k micro-batches in flight, that is k times (every layer's stored bytes + the
    embedding's), plus the non-layer bytes."""
    return planning.forward_end_bytes(costs, _layer_policies(costs, result))


def predicted_activation_peak_bytes(costs: ModelCosts, result: planning.PlanResult) -> int:
    """The activation peak the ruler reports as ``activation_peak_bytes``, as an upper bound.

    See planning.activation_peak_bytes."""
    return planning.activation_peak_bytes(costs, _layer_policies(costs, result))


def predicted_peak_bytes(costs: ModelCosts, result: planning.PlanResult) -> int:
    """The peak memory the plan is predicted to reach, static included: what the budget bounds."""
    return planning.peak_bytes(costs, _layer_policies(costs, result))


def _layer_policies(costs: ModelCosts, result: planning.PlanResult
                    ) -> list[planning.LayerPolicy]:
    return [planning.evaluate_layer(costs, decisions) for decisions in result.layer_decisions]


@dataclass
class Resolved:
    name: str
    plan: Plan | None              # None: megatron's stock layer
    budget_bytes: int | None
    costs: ModelCosts | None = None    # this rank's pipeline stage's
    result: planning.PlanResult | None = None   # this rank's stage's, its layers from 0
    profile_s: float | None = None  # None: the costs came from the ProfileDB
    stages: list[planning.StagePlan] | None = None   # every stage's plan (auto)

    @property
    def plan_id(self) -> str:
        return self.plan.plan_id if self.plan is not None else "none"


def resolve(policy: str, budget_bytes: int | None, model: torch.nn.Module | None = None,
            batch: profiler.Batch | None = None, *, db: ProfileDB | None = None,
            reprofile: bool = False, repeats: int | None = None, strict: bool = False,
            loss_fn: profiler.LossFn | None = None, num_micro_batches: int = 1,
            static_bytes: int | None = None,
            optimizer_step_bytes: int | None = None, lossy_sources: bool = False) -> Resolved:
    """The plan for ``policy`` on this rank's pipeline stage, its layers numbered as in the model.

    Args:
        model, batch: ``auto`` needs the model (built with the Adacc layer spec) and one real
            micro-batch.
        num_micro_batches: per step. 1F1B keeps up to that many in flight on a stage.
        static_bytes: what this rank's parameters and optimizer hold
            (``engine_memory.engine_static_bytes``). A stored profile cannot know it. None: the
            profile's, with the optimizer held whole.
        optimizer_step_bytes: what the optimizer step adds (``engine_memory.engine_step_bytes``).
        lossy_sources: auto may rebuild a recomputed site from a compressed one
            (``--adacc-lossy-sources``).

    Raises:
        planning.InfeasibleBudget: a ValueError naming the smallest feasible budget, and the
            smaller one of lossy rebuild sources where that is smaller."""
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
                                      loss_fn, repeats)
    stage, _ = pipeline_stage()
    own = (planning.StageMemory(costs.static_bytes, costs.embedding_bytes, costs.non_layer_bytes,
                                costs.held_non_layer_bytes, costs.optimizer_step_bytes)
           if stage == 0 else profiler.stage_memory(model, batch, strict=strict, loss_fn=loss_fn))
    if static_bytes is not None:
        own = replace(own, static_bytes=static_bytes)
    if optimizer_step_bytes is not None:
        own = replace(own, optimizer_step_bytes=optimizer_step_bytes)
    stages = planning.stage_costs(costs, from_every_stage(own), model.config.num_layers,
                                  num_micro_batches)
    # Every rank plans every stage from the same costs with the same deterministic planner:
    # one plan per stage, and an infeasible budget fails on every rank alike instead of
    # leaving the others waiting.
    options = {"separate_outliers": _separates(policy), "allow_lossy_sources": lossy_sources}
    try:
        plans = planning.plan_stages(stages, budget_bytes, **options)
    except planning.InfeasibleBudget as exc:
        flag = "--adacc-lossy-sources (AdaccConfig.lossy_sources)"
        raise planning.with_lossy_hint(exc, stages, flag, **options) from None
    mine = plans[stage]
    return Resolved(policy, mine.plan, budget_bytes, stages[stage], mine.result, profile_s,
                    plans)


def pipeline_stage() -> tuple[int, int]:
    """(this rank's pipeline stage, the number of stages) from megatron's parallel state.

    Without a parallel state it is one stage."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size())


def from_every_stage(value):
    """[stage 0's ``value``, stage 1's, ...] on every rank of this rank's pipeline."""
    from megatron.core import parallel_state

    if pipeline_stage()[1] == 1:
        return [value]
    gathered = [None] * pipeline_stage()[1]
    dist.all_gather_object(gathered, value,
                           group=parallel_state.get_pipeline_model_parallel_group())
    return gathered


def plan(policy: str, costs: ModelCosts, budget_bytes: int, **options) -> planning.PlanResult:
    """The fastest plan of auto policy ``policy`` that fits ``budget_bytes``.

    Its own codecs come first, and the last resort only when they fit no plan
    (planning.plan_in_tiers). ``options`` are ``planning.plan``'s. Set-up, the rectifier's re-plans,
    ``adacc plan`` and the benchmarks all plan through it.

    Raises:
        planning.InfeasibleBudget: naming the smallest budget of the wider space."""
    # The last resort's per-token INT4 separates no outliers, so its payload is smaller and
    # it fits micro-batches the outlier-separating codecs do not.
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
    """The line rank 0 prints when ``policy``'s plan had to use the last resort, else None."""
    used = planning.last_resort_sites(result)
    if not used:
        return None
    own = {"auto": "outlier-separating codecs",
           "auto-no-outlier": "auto-no-outlier's plain int4 codecs"}[policy]
    return (f"adacc: warning: the budget is below what {own} fit: {len(used)} "
            f"{'site uses' if len(used) == 1 else 'sites use'} naive INT4 ({', '.join(used)}); "
            f"expect "
            f"the accuracy of the quantize baseline there")


def _loss_name(loss_fn) -> str:
    """The ProfileDB's name of a profile's loss: the module and name of its function."""
    if loss_fn is None:
        return "gpt_loss"
    func = getattr(loss_fn, "func", loss_fn)  # a functools.partial's function
    return f"{func.__module__}.{func.__qualname__}"


def measured_costs(model, batch, db: ProfileDB, reprofile: bool = False, strict: bool = False,
                   loss_fn: profiler.LossFn | None = None, repeats: int | None = None
                   ) -> tuple[ModelCosts, float | None]:
    """(costs, seconds spent profiling or None from the ProfileDB), the same on every rank.

    Rank 0 looks the costs up, or measures them, and every rank gets rank 0's copy. To measure,
    every rank of the first pipeline stage runs the profiling steps. Tensor-parallel layers need
    their peers. Every stage's layers are alike, so the first stage's profile serves them all."""
    tokens = batch[0]
    key = profile_key(model, tokens.shape[1], tokens.shape[0],
                      profiler.device_name(tokens.device), backend_of(model),
                      _loss_name(loss_fn))
    rank0 = is_rank0()
    # A row stored before the profiler measured the last resort is keyed by an older code
    # version, so it is not found and the model is profiled again.
    found = db.get(key) if rank0 and not reprofile else None
    missing = from_rank0(found is None)
    profile_s = None
    if missing and pipeline_stage()[0] == 0:
        started = time.perf_counter()
        found = profiler.profile(model, batch, strict=strict, loss_fn=loss_fn,
                                 repeats=repeats or profiler.DEFAULT_REPEATS)
        profile_s = time.perf_counter() - started
        if rank0:
            db.put(key, found)
    return ModelCosts.from_json(from_rank0(found.to_json() if rank0 else None)), profile_s


def is_rank0() -> bool:
    """Whether this process is global rank 0 (or runs without peers): it prints and writes."""
    return not dist.is_initialized() or dist.get_rank() == 0


def from_rank0(value):
    """Rank 0's ``value`` on every rank (a picklable object; itself without peers)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def describe(resolved: Resolved) -> str:
    """What rank 0 prints before training: where the costs came from, and the plan table.

    With pipeline stages, there is one block per stage."""
    from megatron_adacc.planning import format_plan, format_stages

    if resolved.result is None:
        return f"adacc: policy {resolved.name}, plan {resolved.plan_id}"
    origin = ("reused the profile in the ProfileDB" if resolved.profile_s is None
              else f"profiled in {resolved.profile_s:.1f} s")
    head = f"adacc: policy {resolved.name} ({origin}; {resolved.costs.meta.get('device', '?')})"
    if len(resolved.stages) == 1:
        return f"{head}, plan {resolved.plan_id}\n{format_plan(resolved.result)}"
    return (f"{head}, plans " + ", ".join(f"stage {s.stage}: {s.plan.plan_id}"
                                         for s in resolved.stages)
            + f"\n{format_stages(resolved.stages)}")
