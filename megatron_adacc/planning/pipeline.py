"""Pipeline stages under 1F1B: micro-batches in flight per stage, the layer split, a plan per stage.

Stage s (0-based) of P holds the activations of min(P - s, M) micro-batches at once. So the first
stage needs several times the last one's memory, and one plan for every stage would either waste the
last stages' memory or overrun the first's. Each stage is planned on its own ``ModelCosts`` (its
layers, static bytes, in-flight count, embedding or output activations). Each gets the fastest plan
that fits the per-device budget; ``planning.model`` states the peak rule.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.plan import Plan
from megatron_adacc.common.sites import LAYER_INPUT
from megatron_adacc.common.units import format_size
from megatron_adacc.planning.result import PlanResult
from megatron_adacc.planning.search import InfeasibleBudget
from megatron_adacc.planning.tiers import minimum_feasible_budget, plan_in_tiers


def in_flight_micro_batches(stage: int, pipeline_size: int, num_micro_batches: int) -> int:
    """Micro-batches stage ``stage`` holds at once under megatron-core's 1F1B schedule.

    That schedule (forward_backward_pipelining_without_interleaving) runs min(P - s - 1, M)
    warm-up forwards, then one more forward before each backward."""
    if not 0 <= stage < pipeline_size:
        raise ValueError(f"stage {stage} is not one of 0..{pipeline_size - 1}")
    if num_micro_batches < 1:
        raise ValueError(f"micro-batches per step must be >= 1, got {num_micro_batches}")
    return min(pipeline_size - stage, num_micro_batches)


def stage_layer_counts(num_layers: int, pipeline_size: int) -> list[int]:
    """Layers per stage: megatron-core's default split, the same number on every stage."""
    if pipeline_size < 1 or num_layers % pipeline_size:
        raise ValueError(f"{num_layers} layers do not split evenly over {pipeline_size} "
                         f"pipeline stages")
    return [num_layers // pipeline_size] * pipeline_size


@dataclass(frozen=True)
class StageMemory:
    """What one stage holds besides its layers' activations, measured on that stage.

    Fields:
        static_bytes: its own parameters, gradients and optimizer states.
        embedding_bytes: what the embedding keeps per micro-batch (the first stage).
        non_layer_bytes: non-layer activations freed before its layers backprop. That is the output
            layer and loss on the last stage, and on every stage a cached tensor every layer shares,
            such as megatron's causal mask.
        held_non_layer_bytes: the part backward does not free (that cached tensor).
        optimizer_step_bytes: what its optimizer step adds (ModelCosts.optimizer_step_bytes).
    """

    static_bytes: int
    embedding_bytes: int
    non_layer_bytes: int
    held_non_layer_bytes: int = 0
    optimizer_step_bytes: int = 0


def stage_costs(layer_costs: ModelCosts, stages: Sequence[StageMemory], num_layers: int,
                num_micro_batches: int) -> list[ModelCosts]:
    """The ``ModelCosts`` of every stage of a ``num_layers``-layer model split over the stages.

    ``layer_costs`` is one profile of a layer: the sites, segments and allocator overhead every
    stage shares, since the stages' layers are alike. ``stages`` says what each stage holds
    besides its layers."""
    counts = stage_layer_counts(num_layers, len(stages))
    # A stage after the first receives its input, its first layer's input at full size; one
    # more stays alive through each forward that follows a backward (planning.model).
    received = layer_costs.site(LAYER_INPUT).bytes if len(stages) > 1 else 0
    costs = []
    for index, (layers, memory) in enumerate(zip(counts, stages)):
        in_flight = in_flight_micro_batches(index, len(stages), num_micro_batches)
        costs.append(replace(
            layer_costs, num_layers=layers, static_bytes=memory.static_bytes,
            optimizer_step_bytes=memory.optimizer_step_bytes,
            embedding_bytes=memory.embedding_bytes, non_layer_bytes=memory.non_layer_bytes,
            held_non_layer_bytes=memory.held_non_layer_bytes,
            in_flight_micro_batches=in_flight,
            received_input_bytes=received if index > 0 and num_micro_batches > in_flight else 0,
            meta={**layer_costs.meta, "pipeline_stage": index, "pipeline_size": len(stages),
                  "num_micro_batches": num_micro_batches}))
    return costs


@dataclass
class StagePlan:
    """One stage's plan: the stage, the first (global) layer it holds, and its result.

    The result numbers its layers from 0 within the stage, as the stage's own model does."""

    stage: int
    first_layer: int
    in_flight_micro_batches: int
    result: PlanResult

    @property
    def plan(self) -> Plan:
        """The plan the stage applies: its layers numbered as in the whole model."""
        return self.result.plan.shifted(self.first_layer)

    @property
    def layers(self) -> str:
        last = self.first_layer + len(self.result.layer_decisions) - 1
        return f"{self.first_layer}-{last}"

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "layers": self.layers,
                "in_flight_micro_batches": self.in_flight_micro_batches,
                **self.result.to_dict()}


def with_lossy_hint(exc: InfeasibleBudget, stages: Sequence[ModelCosts], flag: str,
                    **options: Any) -> InfeasibleBudget:
    """``exc`` with the smallest budget lossy rebuild sources fit, and ``flag``, which allows them.

    It is ``exc`` itself where ``options`` allowed them, or where they fit nothing smaller."""
    if options.get("allow_lossy_sources", True):
        return exc
    options = {**options, "allow_lossy_sources": True}
    lossy = max(minimum_feasible_budget(costs, **options) for costs in stages)
    if lossy >= exc.minimum_budget:
        return exc
    return InfeasibleBudget(exc.budget_bytes, exc.minimum_budget, exc.static_bytes, exc.stage,
                            hint=f"with {flag}, which rebuilds recomputed values from "
                                 f"compressed ones, it is {format_size(lossy)} ({lossy} B)")


def plan_stages(stages: Sequence[ModelCosts], budget_bytes: int, **options: Any
                ) -> list[StagePlan]:
    """The fastest plan of each stage that fits ``budget_bytes``, the same budget on every device.

    Each stage is planned on its own in auto's codec tiers (``plan_in_tiers``): a stage may need the
    last resort where another does not. ``options`` are ``plan_in_tiers``'s.

    Raises:
        InfeasibleBudget: naming the first stage that fits no plan and its smallest budget.
    """
    plans, first_layer = [], 0
    for index, costs in enumerate(stages):
        try:
            result = plan_in_tiers(costs, budget_bytes, **options)
        except InfeasibleBudget as exc:
            raise InfeasibleBudget(exc.budget_bytes, exc.minimum_budget, exc.static_bytes,
                                   stage=index if len(stages) > 1 else None) from None
        plans.append(StagePlan(index, first_layer, costs.in_flight_micro_batches, result))
        first_layer += costs.num_layers
    return plans
