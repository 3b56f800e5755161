"""The plan as a table a person reads; plain text, no dependencies.

It has one row per site and decision, then totals against no optimisation and full recompute. With
pipeline stages there is one such block per stage, under a line naming the stage, its layers, its
in-flight micro-batches, its peak and the budget.
"""
from __future__ import annotations

from megatron_adacc.planning.pipeline import StagePlan
from megatron_adacc.planning.result import PlanResult
from megatron_adacc.common.sites import QUANTIZE_CODEC
from megatron_adacc.common.units import format_size


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _codec_cell(codec: str | None) -> str:
    # A planned plan holds the quantize baseline's codec only as auto's last resort.
    if codec == QUANTIZE_CODEC:
        return f"{codec} (last resort)"
    return codec or "-"


def format_plan(result: PlanResult) -> str:
    header = ("site", "layers", "action", "codec", "rebuilt from", "bytes kept", "time added")
    body = [(row.site, row.layers, row.action, _codec_cell(row.codec), row.rebuilt_from or "-",
             format_size(row.bytes_kept), _ms(row.time_added_s)) for row in result.rows]
    if result.hooks_time_s:
        # What the layers with any action pay for running under the runtime's hooks (none
        # charged by the analytic model of an accelerator, which has them hidden).
        body.append(("(runtime hooks)", result.hooked_layers, "-", "-", "-", "-",
                     _ms(result.hooks_time_s)))
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells) -> str:
        return "  ".join(cell.ljust(width) if i < 5 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths))).rstrip()

    rule = "-" * len(line(header))
    lines = [line(header), rule, *(line(cells) for cells in body), rule]
    totals = [("this plan", result.peak_bytes, result.added_time_s)]
    totals += [(name, t.peak_bytes, t.added_time_s) for name, t in result.references.items()]
    lines.append(f"{'':<18}{'peak memory':>14}{'time added / step':>20}")
    for name, peak, added in totals:
        lines.append(f"{name:<18}{format_size(peak):>14}{_ms(added):>20}")
    lines.append(
        f"budget {format_size(result.budget_bytes)}; static {format_size(result.static_bytes)}, "
        f"activations {format_size(result.activation_bytes)}; smallest feasible budget "
        f"{format_size(result.minimum_feasible_budget)} ({result.minimum_feasible_budget} B); "
        f"{'per-layer' if result.per_layer else 'uniform'} plan, "
        f"{'lossy' if result.allow_lossy_sources else 'exact'} rebuild sources, "
        f"solved in {result.solve_time_s * 1e3:.1f} ms"
    )
    return "\n".join(lines)


def format_stages(plans: list[StagePlan]) -> str:
    """One block per pipeline stage; each table numbers the stage's layers from 0."""
    blocks = []
    for stage in plans:
        result = stage.result
        blocks.append(
            f"stage {stage.stage} of {len(plans)}: layers {stage.layers} (rows number them from "
            f"0), {stage.in_flight_micro_batches} micro-batch"
            f"{'es' if stage.in_flight_micro_batches > 1 else ''} in flight; peak "
            f"{format_size(result.peak_bytes)} of budget {format_size(result.budget_bytes)}\n"
            + format_plan(result))
    slowest = max(plans, key=lambda stage: stage.result.added_time_s)
    blocks.append(f"slowest stage: {slowest.stage}, "
                  f"{_ms(slowest.result.added_time_s)} added per micro-batch")
    return "\n\n".join(blocks)
