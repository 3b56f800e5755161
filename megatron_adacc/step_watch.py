"""The step watch: Adacc times its own steps and keeps the plan that is measured fastest.

The planner predicts a plan's step as the profiled all-retain step (``meta["step_s"]``) plus the
plan's added time, per micro-batch. A cost model can be wrong on a device. On an H100, a plan
predicted at +23.7 ms a step took about +110 ms (docs/gpu.md). So Adacc times the forward and
backward of every step (``Adacc.measure``), except steps under the byte ruler. It leaves out the
first ``warmup`` of them, which run slow while caches warm up. Every ``window`` steps of a plan,
it compares the median of the plan's last ``window`` steps with:

- its prediction. At more than ``threshold`` (10%) over it, the plan's actions are re-timed on the
  real batch (``profiler.refresh_action_costs``), once per plan (``retime``). The re-timed plan
  becomes a candidate when its prediction beats the median. The recompute-only plan becomes one
  whatever its prediction: a re-time says the model missed on this device, and on the H200 the
  profile priced GPT-345M's full recompute 60% over what Megatron's took. What a re-timed plan
  still misses counts as work outside the layers (``overhead_s``). It is added to every later
  prediction, so a constant miss re-times once. Each later decision on a re-timed plan measures
  it again, so warm-up steps do not inflate it for good.
- every measured plan that fits the budget. A plan is never kept when one measured faster (by more
  than ``margin``) fits; Adacc swaps back to that one ("measured slower").
- on a GPU, the plan's allocator peak over its forward and backward. At more than the tolerance
  over the predicted peak, the excess is memory the model misses in every plan
  (``allocator_overhead_bytes`` grows by it), and Adacc re-plans for the budget ("measured over
  budget"). On the H200, GPT-345M's plans peaked about 200 MB over their predictions.

Candidates are measured ``window`` steps each, in turn. Swaps go through the rectifier, like its
own: decided between steps, applied before the next forward. Decisions use rank 0's times (``Adacc``
broadcasts them at each decision point), at steps every rank counts alike.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

from megatron_adacc import planning, policies
from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.sites import RETAIN
from megatron_adacc.rectifier import added_time_s, below_capacity

WINDOW = 3              # steps of a plan per median, and between decisions
WARMUP = WINDOW         # first timed steps left out: they run slow while caches warm up
THRESHOLD = 0.10        # measured over predicted by more than this: re-time and re-plan
MARGIN = 0.03           # a plan is left for one measured faster by more than this
RETIME_REPEATS = 3      # the profiler's repeats when re-timing a plan's actions

# A plan's measured allocator peak over its prediction by more than this share (and at least
# PEAK_SLACK_BYTES, the allocator's rounding of many small blocks) corrects the memory model.
PEAK_TOLERANCE = 0.002
PEAK_SLACK_BYTES = 4 << 20

RETIMED = "retimed"                 # swap reasons: measuring a candidate after re-timing,
MEASURED_SLOWER = "measured slower"  # back to the fastest plan measured,
OVER_BUDGET = "measured over budget"  # and away from a plan whose measured peak overran


def predicted_step_s(costs: ModelCosts, result: planning.PlanResult,
                     micro_batches: int = 1) -> float | None:
    """The cost model's step time for ``result`` on ``costs``; None without a profiled step.

    Per micro-batch, it is the profiled all-retain step plus the plan's added time. Analytic or
    hand-made costs carry no profiled step."""
    step_s = costs.meta.get("step_s")
    if step_s is None:
        return None
    return micro_batches * (step_s + added_time_s(costs, result))


def peak_excess(measured: int | None, predicted: int | None) -> int:
    """Bytes a measured peak exceeds its prediction by, beyond the tolerance; else 0."""
    if measured is None or predicted is None:
        return 0
    excess = measured - predicted
    return excess if excess > max(PEAK_SLACK_BYTES, PEAK_TOLERANCE * predicted) else 0


def fits(costs: ModelCosts, result: planning.PlanResult, budget_bytes: int) -> bool:
    """Whether ``result`` fits the budget under ``costs``, every codec it uses still offered.

    A plan keeping fewer exact outlier channels than ``costs`` now give a site does not: the
    rectifier left it for more outliers than it keeps ("capacity")."""
    if below_capacity(result, costs):
        return False
    try:
        layers = [planning.evaluate_layer(costs, decisions)
                  for decisions in result.layer_decisions]
    except ValueError:
        return False
    return planning.peak_bytes(costs, layers) <= budget_bytes


def recompute_only(policy: str, costs: ModelCosts, budget_bytes: int,
                   **options) -> planning.PlanResult | None:
    """The planner's best retain-and-recompute plan at ``budget_bytes``, or None when none fits."""
    bare = replace(costs, sites=[replace(site, codecs=()) for site in costs.sites])
    try:
        return policies.plan(policy, bare, budget_bytes, **options)
    except planning.InfeasibleBudget:
        return None


def retime(costs: ModelCosts, layer_decisions: list[dict],
           refresh: Callable[..., ModelCosts],
           replan: Callable[[ModelCosts], planning.PlanResult | None]
           ) -> tuple[ModelCosts, planning.PlanResult | None]:
    """Re-time a plan's actions and re-plan until the plan uses re-timed actions only.

    ``refresh(costs, decisions, step=...)`` re-times the actions named (a compression: its
    codec), and the step itself in the first round only; ``replan`` plans anew. So a plan is
    never tried on times profiled before the measurements showed them wrong.

    Returns:
        The re-timed costs and the last plan (None when none fits)."""
    def action(site: str, decision) -> tuple[str, str, str | None]:
        return site, decision.action, decision.codec_for(site)

    timed: set[tuple[str, str, str | None]] = set()
    new = None
    while True:
        todo = [{site: decision for site, decision in layer.items()
                 if decision.action != RETAIN and action(site, decision) not in timed}
                for layer in layer_decisions]
        if new is not None and not any(todo):
            return costs, new
        # The first round re-times the step even with no action to re-time.
        costs = refresh(costs, todo, step=new is None)
        timed |= {action(site, decision) for layer in todo for site, decision in layer.items()}
        new = replan(costs)
        if new is None:
            return costs, None
        layer_decisions = new.layer_decisions


@dataclass
class Candidates:
    """The plans a re-time offers the watch to measure."""

    by_prediction: list = field(default_factory=list)  # tried when predicted faster
    regardless: list = field(default_factory=list)     # tried whatever their prediction


@dataclass
class WatchDecision:
    """What one decision point of the watch found and decided."""

    plan_id: str
    median_s: float
    predicted_s: float | None
    retimed: bool = False
    swap_to: planning.PlanResult | None = None
    reason: str = ""

    def to_record(self) -> dict:
        record = {"plan_id": self.plan_id, "median_step_time_s": self.median_s,
                  "predicted_step_time_s": self.predicted_s, "retimed": self.retimed}
        if self.swap_to is not None:
            record.update(to=self.swap_to.plan.plan_id, reason=self.reason)
        return record


class StepWatch:
    """Measured step times per plan and the decisions taken on them (see the module docstring)."""

    def __init__(self, window: int = WINDOW, threshold: float = THRESHOLD,
                 margin: float = MARGIN, warmup: int = WARMUP):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window, self.threshold, self.margin = window, threshold, margin
        # Timed steps still to leave out. A plan measured on warm-up steps would look slower
        # than one measured later, and its median stays until it runs again.
        self.warmup = warmup
        self.times: dict[str, list[float]] = {}     # plan_id -> its last steps' seconds
        self.peaks: dict[str, int] = {}             # plan_id -> its highest allocator peak
        self.results: dict[str, planning.PlanResult] = {}
        self.retimed: set[str] = set()
        self.queue: list[planning.PlanResult] = []  # candidates still to measure
        self.current: str | None = None
        self.fresh = 0          # steps of the current plan since it began or was decided on
        # Seconds a step spends outside the layers' modelled work (the schedule, gradient
        # hooks, data): what a re-timed plan still misses, the same for every plan.
        self.overhead_s = 0.0

    def begin(self, result: planning.PlanResult) -> None:
        """``result`` runs from the next step on."""
        self.current = result.plan.plan_id
        self.results[self.current] = result
        self.fresh = 0

    def record(self, plan_id: str, seconds: float) -> None:
        """One step of ``plan_id`` took ``seconds`` (forward and backward)."""
        if self.warmup > 0:
            self.warmup -= 1
            return
        times = self.times.setdefault(plan_id, [])
        times.append(seconds)
        del times[:-self.window]
        if plan_id == self.current:
            self.fresh += 1

    def record_peak(self, plan_id: str, peak_bytes: int) -> None:
        """One step of ``plan_id`` peaked at ``peak_bytes`` in the allocator (a GPU's)."""
        self.peaks[plan_id] = max(peak_bytes, self.peaks.get(plan_id, 0))

    @property
    def due(self) -> bool:
        """A decision point: the current plan ran ``window`` steps since the last."""
        return self.fresh >= self.window

    def median(self, plan_id: str) -> float | None:
        """The median of ``plan_id``'s last ``window`` steps; None until it ran that many."""
        times = self.times.get(plan_id, [])
        return statistics.median(times) if len(times) >= self.window else None

    def fastest(self, fit: Callable[[planning.PlanResult], bool]) -> str | None:
        """The measured plan with the smallest median among those ``fit`` accepts."""
        measured = [(self.median(plan_id), plan_id) for plan_id in self.results
                    if self.median(plan_id) is not None and fit(self.results[plan_id])]
        return min(measured)[1] if measured else None

    def faster_than(self, plan_id: str, fit: Callable[[planning.PlanResult], bool]
                    ) -> planning.PlanResult | None:
        """The fastest measured plan that fits and beat ``plan_id`` by over the margin, or None."""
        own, best = self.median(plan_id), self.fastest(fit)
        if own is None or best is None or best == plan_id:
            return None
        return self.results[best] if self.median(best) < (1 - self.margin) * own else None

    def decide(self, current: planning.PlanResult,
               predicted: Callable[[planning.PlanResult], float | None],
               fit: Callable[[planning.PlanResult], bool],
               retime: Callable[[], Candidates]) -> WatchDecision:
        """At a decision point (``due``), re-time if needed and pick the plan to run next.

        - It re-times when ``current`` ran more than the threshold over ``predicted(current)``.
          ``retime()`` refreshes the costs that ``predicted`` and ``fit`` read and returns the
          candidates.
        - Next runs the next candidate still to measure, else the fastest measured plan when
          ``current`` is slower."""
        plan_id = current.plan.plan_id
        self.fresh = 0
        median_s = self.median(plan_id)
        decision = WatchDecision(plan_id, median_s, predicted(current))
        if plan_id in self.retimed and decision.predicted_s is not None:
            # Its actions are timed afresh, so what its steps take beyond them is the overhead
            # now: a step's first iterations run slow (caches, the allocator), later ones not.
            self.overhead_s = max(0.0, median_s - decision.predicted_s)
        elif (decision.predicted_s is not None
                and median_s > (1 + self.threshold) * (decision.predicted_s + self.overhead_s)):
            self.retimed.add(plan_id)
            decision.retimed = True
            candidates = retime()
            retimed_s = predicted(current)
            if retimed_s is not None:
                self.overhead_s = max(0.0, median_s - retimed_s)
            for candidate in candidates.by_prediction:
                predicted_s = predicted(candidate)
                if predicted_s is not None and predicted_s + self.overhead_s < median_s:
                    self.queue.append(candidate)
            self.queue.extend(candidates.regardless)
        waiting = {}
        for candidate in self.queue:   # first come first measured, each once
            candidate_id = candidate.plan.plan_id
            if (candidate_id != plan_id and self.median(candidate_id) is None
                    and fit(candidate)):
                waiting.setdefault(candidate_id, candidate)
        self.queue = list(waiting.values())
        if self.queue:
            decision.swap_to, decision.reason = self.queue.pop(0), RETIMED
        else:
            decision.swap_to = self.faster_than(plan_id, fit)
            decision.reason = MEASURED_SLOWER if decision.swap_to is not None else ""
        return decision
