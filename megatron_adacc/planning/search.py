"""The searches: the fastest plan whose predicted peak fits a budget, and the smallest such budget.

``plan`` returns a ``PlanResult``, and ``minimum_budget`` the smallest budget any plan fits. The
input is ``ModelCosts`` (plain data); nothing here touches tensors. Budgets become limits, and plans
peaks, through the model's peak rule only.

- Per-layer plans: the layers ordered by Jackson's rule, and a dynamic programme over the layer
  frontier (``frontier.py``), pruned by branch and bound. Stored bytes are rounded to
  ``default_resolution``; the plan always fits the true budget.
- Uniform plans (one policy for every layer): a scan of the same frontier.
- ``method="milp"``: the direct formulation (``milp.py``), slower, kept as the cross-check and
  benchmark.

docs/memory-model.md ("Search") derives the order, the bounds and the rounding's guarantee.
"""
from __future__ import annotations

import numbers
import time
from typing import Sequence

import numpy as np

from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.planning.frontier import Frontier, layer_frontier, pareto_indices
from megatron_adacc.planning.model import (LayerPolicy, budget_limits, peak_bytes,
                                           peak_from_terms, transient_floor)
from megatron_adacc.planning.result import PlanResult


class InfeasibleBudget(ValueError):
    """No plan fits the budget; ``minimum_budget`` is the smallest budget that has one.

    With ``stage`` set, it is that pipeline stage's plan that does not fit. A ``hint`` says
    what else would fit."""

    def __init__(self, budget_bytes: int, minimum_budget: int, static_bytes: int,
                 stage: int | None = None, hint: str = "") -> None:
        from megatron_adacc.common.units import format_size

        self.budget_bytes = budget_bytes
        self.minimum_budget = minimum_budget
        self.static_bytes = static_bytes
        self.stage = stage          # the pipeline stage that fits no plan, if pipelined
        self.hint = hint
        where = "" if stage is None else f"pipeline stage {stage}: "
        super().__init__(
            f"{where}memory budget {format_size(budget_bytes)} is infeasible: the smallest "
            f"feasible budget is {format_size(minimum_budget)} ({minimum_budget} B; static "
            f"memory alone is {format_size(static_bytes)})" + (f"; {hint}" if hint else "")
        )


def default_resolution(costs: ModelCosts) -> int:
    """Memory grid of the per-layer search: 1/1024 of a layer's activations.

    Small problems get 1 byte, where the search is exact."""
    return max(1, costs.layer_bytes // 1024)


def minimum_budget(costs: ModelCosts, per_layer: bool = True,
                   allow_lossy_sources: bool = True) -> int:
    """The smallest budget for which ``plan`` succeeds."""
    frontier = layer_frontier(costs, allow_lossy_sources)
    return peak_bytes(costs, _least_peak_plan(costs, frontier, per_layer))


def plan(costs: ModelCosts, budget_bytes: int, per_layer: bool = True,
         allow_lossy_sources: bool = True, method: str = "frontier",
         resolution_bytes: int | None = None) -> PlanResult:
    """The plan with the least added time whose predicted peak fits ``budget_bytes``.

    Args:
        method: "frontier" (default, see the module docstring) or "milp" (direct formulation).

    Raises:
        InfeasibleBudget: naming the smallest feasible budget, when no plan fits.
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
        # Imported here: PuLP (and its solver lookup) loads only for the cross-check.
        from megatron_adacc.planning.milp import plan_direct_milp

        layers = plan_direct_milp(costs, budget_bytes, per_layer, allow_lossy_sources)
    # Near the minimum the rounded search (or CBC's floating point) may find nothing; the
    # least-peak plan fits any budget >= minimum.
    layers = layers or least_peak
    return PlanResult.from_layers(
        costs, layers, budget_bytes=budget_bytes, solve_time_s=time.perf_counter() - started,
        minimum_feasible_budget=minimum, per_layer=per_layer,
        allow_lossy_sources=allow_lossy_sources, method=method)


# --- uniform plans -----------------------------------------------------------------------------
def _uniform_peaks(costs: ModelCosts, frontier: Frontier) -> np.ndarray:
    """Peak of each frontier policy used by every layer.

    The top layer sets the backward term, with every layer stored."""
    all_stored = costs.num_layers * frontier.stored
    return peak_from_terms(costs, all_stored, all_stored + frontier.transient)


def _plan_uniform(costs: ModelCosts, budget: int, frontier: Frontier) -> list[LayerPolicy] | None:
    fits = np.flatnonzero(_uniform_peaks(costs, frontier) <= budget)
    if len(fits) == 0:
        return None
    best = int(fits[np.argmin(frontier.time_s[fits])])
    return [frontier.policy(best)] * costs.num_layers


# --- per-layer plans ---------------------------------------------------------------------------
def _layer_dp(costs: ModelCosts, stored: np.ndarray, step_cost, final_cost,
              cost_bound: float = np.inf, carried: np.ndarray | None = None
              ) -> tuple[float, list[int]] | None:
    """Exact dynamic programme over layers, bottom (0) to top; returns (objective, picks) or None.

    The state is (prefix stored bytes, cost so far), and with ``carried`` the running maximum of
    prefix + carried[policy]. Future limits and costs depend on these only, and grow with each. So
    only states that no other state matches or beats in all of them are kept.

    Args:
        step_cost: ``step_cost(cost, prefix)`` -> cost after adding each frontier policy. Arrays
            broadcast over states x policies; inf where not allowed.
        final_cost: ``final_cost(prefix, cost, high, layers)`` -> the objective, or a lower bound on
            it, of a plan whose first ``layers`` layers end in that state. inf where infeasible;
            ``high`` is 0 without ``carried``.
    Returns None when nothing is feasible.
    """
    num_layers = costs.num_layers
    prefix = np.zeros(1, dtype=np.int64)
    cost = np.zeros(1)
    high = np.zeros(1, dtype=np.int64)
    parents, picks = [], []
    for layer in range(num_layers):
        new_prefix = prefix[:, None] + stored[None, :]
        new_cost = step_cost(cost[:, None], new_prefix)
        new_high = (np.maximum(high[:, None], new_prefix + carried[None, :])
                    if carried is not None else np.zeros_like(new_prefix))
        state, pick = np.nonzero(np.isfinite(new_cost))
        candidate_prefix, candidate_cost = new_prefix[state, pick], new_cost[state, pick]
        candidate_high = new_high[state, pick]
        reachable = final_cost(candidate_prefix, candidate_cost, candidate_high, layer + 1)
        alive = np.flatnonzero(np.isfinite(reachable) & (reachable <= cost_bound))
        if len(alive) == 0:
            return None
        keep = alive[pareto_indices(np.column_stack(
            [candidate_cost[alive], candidate_prefix[alive], candidate_high[alive]]))]
        prefix, cost, high = candidate_prefix[keep], candidate_cost[keep], candidate_high[keep]
        parents.append(state[keep])
        picks.append(pick[keep])
    objective = final_cost(prefix, cost, high, num_layers)
    best = int(np.argmin(objective))
    if not np.isfinite(objective[best]):
        return None
    layers = []
    for layer in reversed(range(num_layers)):
        layers.append(int(picks[layer][best]))
        best = int(parents[layer][best])
    return float(objective.min()), layers[::-1]


def _jackson_order(frontier: Frontier, picks: Sequence[int]) -> list[LayerPolicy]:
    """Layers 0.. with the largest transients lowest, the peak's best order for these policies."""
    policies = [frontier.policy(k) for k in picks]
    return sorted(policies, key=lambda p: -p.transient_bytes)


def _time_lower_bound(frontier: Frontier):
    """``bound(layers, capacity)``: a lower bound on the time of ``layers`` more layers.

    Those layers together store at most ``capacity`` bytes. The bound is the LP relaxation, where
    layers may mix policies: ``layers`` x the lower convex hull of (stored, time) at the average."""
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
    """A good feasible plan to bound the exact search; None if it breaks a backward limit.

    The LP optimum mixes two neighbouring hull policies. This rounds the mix down to whole
    layers, then spends what is left of the budget layer by layer, each on the fastest policy it
    pays for."""
    num_layers = costs.num_layers
    capacity = budget_limits(costs, budget).all_stored
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
    limits = budget_limits(costs, budget)
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
    transient = np.maximum(frontier.transient, transient_floor(costs))
    useful = pareto_indices(np.column_stack([frontier.time_s, stored, transient]).astype(float))
    stored, transient, time_s = stored[useful], transient[useful], frontier.time_s[useful]
    num_layers = costs.num_layers
    # The backward term is (k - 1) x all stored + max_l [prefix(l) + transient(l)]. With one
    # micro-batch in flight each layer's part is checked as it is placed; with more, the
    # total is known only at the end, so the running maximum is carried in the state, and a
    # layer is pruned as soon as the total it implies (at least its prefix) breaks the limit.
    others = costs.in_flight_micro_batches - 1

    def step_cost(cost, prefix):
        return np.where(others * prefix + prefix + transient[None, :] <= limits.backward,
                        cost + time_s[None, :], np.inf)

    def final_cost(prefix, cost, high, layers_done):
        bound = cost + lower_bound(num_layers - layers_done, limits.all_stored - prefix)
        return np.where(others * prefix + high <= limits.backward, bound, np.inf)

    solved = _layer_dp(costs, stored, step_cost, final_cost, cost_bound=incumbent,
                       carried=transient if others else None)
    if solved is None:
        return min(candidates, key=lambda layers: sum(p.time_s for p in layers), default=None)
    return _jackson_order(frontier, [int(useful[k]) for k in solved[1]])


# --- least-peak plans --------------------------------------------------------------------------
def _least_peak_per_layer(costs: ModelCosts, frontier: Frontier,
                          upper_bound: int) -> list[LayerPolicy]:
    """A per-layer plan with the smallest peak, bytes exact (no rounding).

    It is the same programme, with the running maximum of (prefix + transient) as the cost."""
    transient = frontier.transient

    def step_cost(cost, prefix):
        return np.maximum(cost, prefix + transient[None, :])

    least_stored = int(frontier.stored.min())

    def final_cost(prefix, cost, high, layers_done):
        # Layers still to come store at least ``least_stored`` each.
        rest = (costs.num_layers - layers_done) * least_stored
        return peak_from_terms(costs, prefix + rest, cost)

    solved = _layer_dp(costs, frontier.stored, step_cost, final_cost, cost_bound=upper_bound)
    return _jackson_order(frontier, solved[1])


def _least_peak_plan(costs: ModelCosts, frontier: Frontier, per_layer: bool) -> list[LayerPolicy]:
    """A plan with the smallest peak, whose peak is the smallest feasible budget.

    ``plan`` returns it where the rounded search finds nothing, so that budget really is
    feasible."""
    uniform = [frontier.policy(int(np.argmin(_uniform_peaks(costs, frontier))))] * costs.num_layers
    if not per_layer:
        return uniform
    return _least_peak_per_layer(costs, frontier, peak_bytes(costs, uniform))
