"""Which codecs auto plans with, in two tiers, and the plan of the first tier that fits.

The profiler measures every candidate codec of a site (sites.Site.candidate_codecs); a plan may use
only some.
- First tier: each site's designated codec. With ``separate_outliers`` off (the paper's "Adacc w/o
  outlier" ablation), plain int4 where auto separates outliers.
- Second tier, the last resort: the same plus the quantize baseline's per-token INT4
  (sites.Site.last_resort_codec). It is offered where its payload is smaller than the first tier's
  codec's, and planned only when no first-tier plan fits. Costs that did not measure it have no
  second tier.

Auto never mixes outlier separation with the ablation's codec. That codec is faster and would win on
time alone, at the price of the accuracy the separation is there for.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from megatron_adacc.common import sites as site_table
from megatron_adacc.common.costs import CodecCost, ModelCosts
from megatron_adacc.planning.result import PlanResult
from megatron_adacc.planning.search import InfeasibleBudget, minimum_budget, plan


def plan_in_tiers(costs: ModelCosts, budget_bytes: int, *, separate_outliers: bool = True,
                  **options: Any) -> PlanResult:
    """The fastest plan that fits ``budget_bytes``; the last resort only when the first tier fails.

    ``options`` are ``plan``'s. The result's ``minimum_feasible_budget``, and the
    ``InfeasibleBudget`` raised when no tier fits, name ``minimum_feasible_budget(costs)``."""
    *narrower, widest = codec_tiers(costs, separate_outliers)
    for tier in narrower:
        try:
            result = plan(tier, budget_bytes, **options)
        except InfeasibleBudget:
            continue
        # The table quotes the smallest budget auto fits, the last resort's, not this tier's.
        return replace(result, minimum_feasible_budget=_minimum_budget(widest, options))
    return plan(widest, budget_bytes, **options)


def minimum_feasible_budget(costs: ModelCosts, *, separate_outliers: bool = True,
                            **options: Any) -> int:
    """The smallest budget ``plan_in_tiers`` plans for: the least peak with the widest tier.

    ``options`` are as ``plan_in_tiers``'s. The plan table, the infeasibility error and ``adacc
    plan`` all quote this figure: a plan fits it, and none fits one byte less."""
    return _minimum_budget(codec_tiers(costs, separate_outliers)[-1], options)


def _minimum_budget(costs: ModelCosts, options: dict[str, Any]) -> int:
    return minimum_budget(costs, options.get("per_layer", True),
                          options.get("allow_lossy_sources", True))


def codec_tiers(costs: ModelCosts, separate_outliers: bool = True) -> list[ModelCosts]:
    """``costs`` narrowed to each tier's codecs, narrowest first.

    The last resort is offered only at sites where its payload is smaller than the first tier's
    codec's; elsewhere it would trade accuracy for time alone. A wider tier that adds no codec is
    left out."""
    def own(site: site_table.Site) -> str | None:
        if separate_outliers:
            return site.default_codec
        return site_table.ABLATION_CODECS.get(site.default_codec, site.default_codec)

    def first_tier(site: site_table.Site, codecs: tuple[CodecCost, ...]) -> list[CodecCost]:
        return [c for c in codecs if c.codec == own(site)]

    def with_last_resort(site: site_table.Site, codecs: tuple[CodecCost, ...]
                         ) -> list[CodecCost]:
        chosen = first_tier(site, codecs)
        return chosen + [c for c in codecs if c.codec == site.last_resort_codec != own(site)
                         and all(c.payload_bytes < mine.payload_bytes for mine in chosen)]

    first = _narrowed(costs, first_tier)
    wider = _narrowed(costs, with_last_resort)
    return [first] if wider == first else [first, wider]


def last_resort_sites(result: PlanResult) -> list[str]:
    """The sites that use the last resort codec in some layer of ``result``."""
    return sorted({row.site for row in result.rows if row.codec == site_table.QUANTIZE_CODEC})


def _narrowed(costs: ModelCosts, choose: Callable[[site_table.Site, tuple[CodecCost, ...]],
                                                  list[CodecCost]]) -> ModelCosts:
    """``costs`` with each known site's codec entries narrowed to ``choose``'s."""
    sites = [replace(site, codecs=tuple(choose(site_table.get(site.name), site.codecs)))
             if site.name in site_table.SITES else site for site in costs.sites]
    return replace(costs, sites=sites)
