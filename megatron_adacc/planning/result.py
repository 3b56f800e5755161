"""What ``plan`` returns: the plan, its predicted peak and added time, and the plan table's rows.

There is one row per site and decision, and the totals of no optimisation and full recompute to
compare against. Every number comes from the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from megatron_adacc.common.costs import ModelCosts
from megatron_adacc.common.plan import RETAIN_DECISION, Decision, Plan
from megatron_adacc.planning.model import (LayerPolicy, evaluate_layer, forward_backward_bytes,
                                           is_hooked, peak_bytes, rebuilt_from, site_option,
                                           site_times)
from megatron_adacc.common.sites import RECOMPUTE


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
    # recomputed one, see rebuild_charges), other recomputed sites of it add nothing; an
    # operator's at its first recomputed product.
    time_added_s: float
    # A recomputed site: what its rebuild reads (an operator's sources, or the re-run's
    # start); None otherwise.
    rebuilt_from: str | None = None


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
    # The layers that run under the runtime's hooks (any action), e.g. "0-3", and what the
    # hooks add to a step there: the part of added_time_s no row holds.
    hooked_layers: str = ""
    hooks_time_s: float = 0.0
    references: dict[str, Totals] = field(default_factory=dict)

    @classmethod
    def from_layers(cls, costs: ModelCosts, layers: Sequence[LayerPolicy], *,
                    budget_bytes: int, solve_time_s: float, minimum_feasible_budget: int,
                    per_layer: bool, allow_lossy_sources: bool, method: str) -> "PlanResult":
        """The result of planning layer l to follow ``layers[l]``.

        Sites a policy leaves out are retained."""
        layer_decisions = [
            {site.name: layer.decisions.get(site.name, RETAIN_DECISION) for site in costs.sites}
            for layer in layers
        ]
        peak = peak_bytes(costs, layers)
        hooked = [index for index, decisions in enumerate(layer_decisions)
                  if is_hooked(costs.sites, decisions)]
        return cls(
            feasible=True,
            plan=Plan.from_layers(layer_decisions),
            layer_decisions=layer_decisions,
            budget_bytes=budget_bytes,
            peak_bytes=peak,
            static_bytes=costs.static_bytes,
            activation_bytes=forward_backward_bytes(costs, layers),
            added_time_s=sum(layer.time_s for layer in layers),
            solve_time_s=solve_time_s,
            minimum_feasible_budget=minimum_feasible_budget,
            per_layer=per_layer,
            allow_lossy_sources=allow_lossy_sources,
            method=method,
            rows=_rows(costs, layer_decisions),
            hooked_layers=layer_ranges(hooked),
            hooks_time_s=len(hooked) * costs.hooked_layer_s,
            references=_reference_totals(costs),
        )

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
            "hooks": {"layers": self.hooked_layers, "time_s": self.hooks_time_s},
            "references": {name: t.__dict__ for name, t in self.references.items()},
        }


def layer_ranges(layers: Iterable[int]) -> str:
    """Layer numbers as compact ranges: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
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
    by_policy = {key: (site_times(costs, decisions), rebuilt_from(costs, decisions))
                 for key, decisions in distinct.items()}
    times = [by_policy[tuple(d.items())][0] for d in layer_decisions]
    sources = [by_policy[tuple(d.items())][1] for d in layer_decisions]
    rows = []
    for site in costs.sites:
        groups: dict[tuple[Decision, str | None], list[int]] = {}
        for layer, decisions in enumerate(layer_decisions):
            key = (decisions.get(site.name, RETAIN_DECISION), sources[layer].get(site.name))
            groups.setdefault(key, []).append(layer)
        for (decision, source), layers in groups.items():
            option = site_option(site, decision)
            rows.append(SiteRow(site.name, layer_ranges(layers), len(layers), decision.action,
                                decision.codec_for(site.name), option.stored * len(layers),
                                sum(times[layer][site.name] for layer in layers), source))
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
