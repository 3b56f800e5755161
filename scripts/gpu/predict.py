"""Each measured step's predictions, the profile's and the analytic model's, and its calibration."""
from __future__ import annotations

import argparse
import functools
import math
import os
from dataclasses import replace

import torch

from gpu.common import (AUTO, AUTO_LOSSY, BLOCK, FULL, NONE, QUANTIZE, SELECTIVE, ModelSpec, mib,
                        note)
from gpu.training import ModelRuns, model_flags


def _selective_sites(mods) -> set[str]:
    """The sites megatron's selective recompute of ``mods`` rebuilds, in this project's names.

    They are what the module's checkpoint keeps out of memory."""
    by_module = {
        "core_attn": {"softmax_out", "attn_dropout_mask", "attn_probs", "attn_lse",
                      "attn_rng_state"},
        "layernorm": {"ln1_out", "ln1_stats", "ln1_normed", "ln2_out", "ln2_stats",
                      "ln2_normed"},
        "mlp": {"gelu_in", "gelu_out", "swiglu_in", "swiglu_up", "swiglu_act", "swiglu_out"},
    }
    return set().union(*(by_module[m] for m in mods))


def equivalent_plan(method: str, detail, costs, auto_plan=None):
    """The plan of this project's sites that stands for a measured method, for pricing it.

    - Adacc's own plans are taken as they are (``auto_plan``: the auto run's, exact or lossy).
    - Megatron's recompute becomes the sites it rebuilds: a segment re-run from the layer input,
      priced as the planner prices one. That approximates megatron's checkpoints, which re-run
      from their own inputs."""
    from megatron_adacc import policies
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import RECOMPUTE, SITES

    full = policies.full_recompute_plan()
    if method == NONE:
        return Plan()
    if method == FULL:
        return full
    if method == BLOCK:
        return Plan(layers={(0, detail - 1): full.sites}) if detail else Plan()
    if method == QUANTIZE:
        return policies.quantize_plan()
    if method in (AUTO, AUTO_LOSSY):
        if auto_plan is None:
            raise ValueError("no plan of the auto run to price")
        return auto_plan
    names = {site.name for site in costs.sites}
    return Plan.uniform({name: Decision(RECOMPUTE) for name in _selective_sites(detail)
                         if name in names and SITES[name].recomputable})


def accelerator_for(device_name: str, requested: str | None) -> str:
    from megatron_adacc.planning import analytic

    if requested:
        return requested
    for key, accelerator in analytic.ACCELERATORS.items():
        if key.split("-")[0] in device_name.lower():
            return key
    return "h200-141gb"


@functools.lru_cache(maxsize=None)
def _training_flags(spec: ModelSpec, dry_run: bool) -> argparse.Namespace:
    """The model's flags as pretrain_gpt.py parses them: read only, parsed once (a calibration
    prices the model a hundred times)."""
    from megatron_adacc import cli

    return cli.training_flags(model_flags(spec, dry_run))


def _analytic_costs(spec: ModelSpec, dry_run: bool, accelerator):
    """`adacc plan --hardware`'s costs of the model at the runs' micro-batch.

    ``accelerator``: a name in the table, or an ``analytic.Accelerator``."""
    from megatron_adacc import cli
    from megatron_adacc.planning import analytic

    flags = _training_flags(spec, dry_run)
    args, _ = cli._build_parser().parse_known_args(["plan"])
    args.hardware = analytic.get_accelerator(accelerator)  # the parser takes names only
    args.micro_batch_size = flags.micro_batch_size
    args.pipeline_model_parallel_size = flags.pipeline_model_parallel_size
    args.use_distributed_optimizer = flags.use_distributed_optimizer
    return _with_naive_int4(cli._costs(args, flags, [])[0][0], accelerator, flags.hidden_size)


def _with_naive_int4(costs, accelerator: str, channels: int):
    """``costs`` with naive INT4 priced on each site whose last resort it is.

    The price follows the analytic model's own codec rule: the bytes it moves at
    analytic.CODEC_EFFICIENCY of bandwidth. ``adacc plan --hardware`` prices designated codecs
    only, and the quantize baseline is predicted from it."""
    from dataclasses import replace

    from megatron_adacc.common.sites import QUANTIZE_CODEC, SITES
    from megatron_adacc.planning import analytic

    bandwidth = analytic.get_accelerator(accelerator).memory_bandwidth
    sites = []
    for site in costs.sites:
        known = SITES.get(site.name)
        if (known is not None and known.last_resort_codec == QUANTIZE_CODEC
                and all(codec.codec != QUANTIZE_CODEC for codec in site.codecs)):
            elements = site.bytes // torch.empty((), dtype=getattr(torch, site.dtype)).itemsize
            rows = channels if elements % channels == 0 else elements
            payload = analytic.codec_payload_bytes(QUANTIZE_CODEC, elements, site.dtype, rows)
            site = replace(site, codecs=site.codecs + (
                analytic.codec_cost(QUANTIZE_CODEC, site.bytes, payload, bandwidth),))
        sites.append(site)
    return replace(costs, sites=sites)


def _profiled_costs(workdir: str):
    """The auto runs' profile (None if no auto run profiled): the newest row of their ProfileDB.

    That ProfileDB holds this model's profile alone."""
    from megatron_adacc.common.costs import ModelCosts
    from megatron_adacc.profiling.profile_db import ProfileDB

    path = os.path.join(workdir, "profiles.sqlite")
    if not os.path.exists(path):
        return None
    row = ProfileDB(path)._run(lambda db: db.execute(
        "SELECT costs FROM profiles ORDER BY created DESC LIMIT 1").fetchone())
    return ModelCosts.from_json(row[0]) if row else None


def predict(runs: ModelRuns, accelerator: str) -> None:
    """Each method's predicted step beside its measured one, at every budget.

    A prediction is no optimisation's measured step plus what a model says the method's plan
    adds. The models are the runtime's (metrics' predicted_step_time_s, where the trainer writes
    it), the profile's and the analytic model's (``adacc plan --hardware``). The analytic model's
    own auto plan at the budget is predicted too."""
    import bench_common

    from megatron_adacc import planning, policies

    report = runs.report
    sources = {}
    try:
        sources["analytic"] = _analytic_costs(runs.spec, runs.dry_run, accelerator)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still predicted
        note(report["notes"], f"{runs.name}: no analytic costs: {exc}")
    try:
        profiled = _profiled_costs(runs.workdir)
        if profiled is not None:
            sources["profiled"] = profiled
    except Exception as exc:  # noqa: BLE001
        note(report["notes"], f"{runs.name}: no profiled costs: {exc}")
    report["accelerator"] = accelerator
    if "profiled" in sources:
        report["memory_model"] = _memory_terms(sources["profiled"], runs.runs)
    base = runs.runs.get("none", {}).get("step_time_s")
    for index, entry in enumerate(report["budgets"]):
        budget = entry["budget_bytes"]
        auto_plan, entry["auto_plan_reproduced"] = _run_plan(
            sources.get("profiled"), runs.runs.get(f"auto {index}", {}), budget)
        lossy_plan, _ = _run_plan(sources.get("profiled"),
                                  runs.runs.get(f"auto lossy {index}", {}), budget, True)
        methods = {}
        for method_name, run_name in runs.method_rows(index).items():
            method = method_name.split(" [")[0]
            run = runs.runs.get(run_name, {}) if run_name else {}
            detail = (tuple(method_name[len(SELECTIVE) + 2:-1].split("+"))
                      if method == SELECTIVE
                      else int(run_name.split()[1]) if method == BLOCK and run_name
                      and run_name != "none" else 0 if method == BLOCK else None)
            row = {"run": run_name, "detail": detail, "step_time_s": run.get("step_time_s"),
                   "last_plan_step_time_s": run.get("last_plan_step_time_s"),
                   "plan_swaps": run.get("plan_swaps"),
                   "rounds_step_time_s": run.get("rounds_step_time_s"),
                   "tokens_per_s": run.get("tokens_per_s"), "peak_bytes": run.get("peak_bytes")}
            row.update(_fit(run, budget, run_name,
                            runs.runs.get("full", {}).get("memory_held_before")))
            for key in ("predicted_step_time_s", "measured_step_time_s"):
                if key in run:
                    row[f"runtime_{key}"] = run[key]
            if base is not None and row["step_time_s"] is not None:
                row["measured_added_s"] = row["step_time_s"] - base
            for source, costs in sources.items():
                try:
                    plan = equivalent_plan(method, detail, costs,
                                           lossy_plan if method == AUTO_LOSSY else auto_plan)
                    added = bench_common.predicted_added_s(costs, plan)
                except (planning.InfeasibleBudget, KeyError, ValueError, TypeError) as exc:
                    row[f"{source}_error"] = str(exc).splitlines()[0][:160]
                    continue
                row[f"{source}_added_s"] = added
                if base is not None:
                    row[f"{source}_step_s"] = base + added
            methods[method_name] = row
        entry["methods"] = methods
        if "analytic" in sources and budget is not None:
            try:
                result = policies.plan("auto", sources["analytic"], budget,
                                       allow_lossy_sources=False)
                entry["analytic_auto"] = {"feasible": True, "added_s": result.added_time_s,
                                          "peak_bytes": result.peak_bytes,
                                          "plan_id": result.plan.plan_id}
            except planning.InfeasibleBudget as exc:
                entry["analytic_auto"] = {"feasible": False,
                                          "minimum_feasible_budget": exc.minimum_budget}
    try:
        report["calibration"] = calibrate(runs, accelerator)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still stands
        note(report["notes"], f"{runs.name}: no calibration: {exc}")


# A step with less than this share of its time in kernels waits on the host: Megatron's recompute
# then costs host time that no device roofline prices.
GPU_BOUND_SHARE = 0.7
MATMUL_EFFICIENCIES = tuple(round(0.05 + 0.01 * step, 2) for step in range(96))  # 0.05 - 1.00


def calibrate(runs: ModelRuns, accelerator: str) -> dict | None:
    """The matmul efficiency that best fits the analytic model to Megatron's measured recompute.

    A least-squares fit, over a grid, of the added time of each measured full and selective
    recompute. None with fewer than two of them measured."""
    import bench_common

    from megatron_adacc.planning import analytic

    rows = {name: row for entry in runs.report["budgets"]
            for name, row in (entry.get("methods") or {}).items()
            if name.split(" [")[0] in (FULL, SELECTIVE) and row.get("measured_added_s") is not None}
    if len(rows) < 2:
        return None
    device = analytic.get_accelerator(accelerator)

    def added(efficiency: float) -> dict[str, float]:
        costs = _analytic_costs(runs.spec, runs.dry_run,
                                replace(device, matmul_efficiency=efficiency))
        return {name: bench_common.predicted_added_s(
            costs, equivalent_plan(name.split(" [")[0], row["detail"], costs))
                for name, row in rows.items()}

    def rms_error(prices: dict[str, float]) -> float:
        return math.sqrt(sum((prices[name] - row["measured_added_s"]) ** 2
                             for name, row in rows.items()) / len(rows))

    fits = {efficiency: added(efficiency) for efficiency in MATMUL_EFFICIENCIES}
    fitted = min(fits, key=lambda efficiency: rms_error(fits[efficiency]))
    table = fits.get(device.matmul_efficiency) or added(device.matmul_efficiency)
    trace = runs.runs.get("none", {}).get("trace") or {}
    step_s = runs.runs.get("none", {}).get("step_time_s")
    return {"table_efficiency": device.matmul_efficiency, "fitted_efficiency": fitted,
            "rms_error_s": {"table": rms_error(table), "fitted": rms_error(fits[fitted])},
            "kernel_share": (trace["kernel_ms"] / 1e3 / step_s
                             if trace.get("kernel_ms") and step_s else None),
            "methods": {name: {"measured_added_s": row["measured_added_s"],
                               "table_added_s": table[name],
                               "fitted_added_s": fits[fitted][name]}
                        for name, row in rows.items()}}


def calibration_lines(fit: dict | None) -> list[str]:
    if not fit:
        return []
    errors = fit["rms_error_s"]
    line = (f"The analytic model, fitted to the added time of {len(fit['methods'])} measured full "
            f"and selective recomputes: matmul efficiency {fit['fitted_efficiency']} (the "
            f"table's {fit['table_efficiency']}), RMS error {errors['fitted'] * 1e3:.1f} ms "
            f"(the table's {errors['table'] * 1e3:.1f} ms).")
    share = fit.get("kernel_share")
    if share is not None and share < GPU_BOUND_SHARE:
        line += (f" No optimisation's step spends {share:.0%} of its time in kernels: the host "
                 "bounds it, and the fit says nothing of the device.")
    return [line, ""]


def _memory_terms(costs, runs: dict) -> dict:
    """The profile's memory terms and smallest feasible budget, beside full recompute's peak.

    The smallest feasible budget is the recompute-only plan's predicted peak. At the tightest
    budget, full recompute's measured peak, Adacc runs only if that prediction is no higher."""
    from megatron_adacc import planning

    costs = _as_the_trainer_planned(costs, next(
        (run["static_bytes"] for name, run in runs.items()
         if name.startswith("auto") and run.get("static_bytes")), None))
    return {"static_bytes": costs.static_bytes,
            "optimizer_step_bytes": costs.optimizer_step_bytes,
            "allocator_overhead_bytes": costs.allocator_overhead_bytes,
            "persistent_overhead_bytes": costs.persistent_overhead_bytes,
            "non_layer_bytes": costs.non_layer_bytes,
            "held_non_layer_bytes": costs.held_non_layer_bytes,
            "backward_workspace_bytes": costs.backward_workspace_bytes,
            "smallest_feasible_budget": planning.minimum_feasible_budget(
                costs, allow_lossy_sources=False),
            # what --adacc-lossy-sources would fit: below full recompute where the loss sets
            # the peak
            "smallest_feasible_budget_lossy_sources": planning.minimum_feasible_budget(
                costs, allow_lossy_sources=True),
            "full_recompute_peak_bytes": runs.get("full", {}).get("peak_bytes"),
            "full_recompute_forward_backward_peak_bytes": runs.get("full", {}).get(
                "forward_backward_peak_bytes"),
            "profile_peaks": costs.meta.get("profile_peaks"),
            "auto_peaks": {name: {"predicted": run["predicted_peak_bytes"],
                                  "measured": run.get("peak_bytes"),
                                  # held when a step began, against static_bytes
                                  "allocated_before_step": run.get("allocated_before_step")}
                           for name, run in runs.items() if name.startswith("auto")
                           and run.get("predicted_peak_bytes") is not None}}


def _as_the_trainer_planned(costs, static_bytes: int | None):
    """``costs`` with the engine's static bytes, as the trainer planned with them.

    A profile holds the model's (``engine_memory.model_static_bytes``). The step term stays the
    profile's: an upper bound on the engine's by the no-weight-decay group."""
    from dataclasses import replace

    return costs if static_bytes is None else replace(costs, static_bytes=static_bytes)


def _run_plan(costs, run: dict, budget: int | None, lossy_sources: bool = False):
    """The plan an auto run set out with, re-planned from its profile as the trainer planned it.

    Returns:
        (the plan, whether its id is the run's); (None, False) without a profile or a run."""
    from megatron_adacc import planning, policies

    if costs is None or budget is None or run.get("first_plan_id") is None:
        return None, False
    costs = _as_the_trainer_planned(costs, run.get("static_bytes"))
    try:
        plan = policies.plan("auto", costs, budget, allow_lossy_sources=lossy_sources).plan
    except planning.InfeasibleBudget:
        return None, False
    return plan, plan.plan_id == run["first_plan_id"]


def _fit(run: dict, budget: int | None, run_name: str | None,
         baseline_held: int | None = None) -> dict:
    """Whether a method's run fits a budget, and why not or why unknown.

    A run's peak is less what the process held before it beyond ``baseline_held``, what it
    held before full recompute's run, whose peak sets the tightest budget. On the H200 every
    run after the first auto run held the 37,376 B of counters that run's codec trials left,
    and megatron's block recompute peaked that much over full recompute's peak."""
    if run_name is None or budget is None:
        return {"fits": None, "reason": "no run planned (budgets unknown)"}
    if "skipped" in run:
        return {"fits": None, "reason": f"not run: {run['skipped']}"}
    if run.get("oom"):
        return {"fits": False, "reason": "out of memory"}
    if "error" in run:
        # an auto run refused by its planner does not fit; any other error says nothing
        return {"fits": False if "infeasible" in run["error"] else None,
                "reason": run["error"]}
    if run.get("peak_bytes") is None:
        return {"fits": None, "reason": "no peak measured"}
    held = run.get("memory_held_before")
    grown = max(0, held - baseline_held) if None not in (held, baseline_held) else 0
    fits = run["peak_bytes"] - grown <= budget
    excess = run["peak_bytes"] - grown - budget
    # a peak over by less than a MiB reads as a mebibyte's rounding otherwise
    over = f"{mib(excess)} MiB" if excess >= 1 << 20 else f"{excess:,} B"
    reason = "" if fits else (f"peak {mib(run['peak_bytes'])} MiB, {over} over the budget"
                              + (f" beyond the {grown:,} B more it began with" if grown else ""))
    last = run.get("last_plan_peak_bytes")
    if not fits and last is not None and last - grown <= budget:
        reason += f"; its last plan's {mib(last)} MiB within it"
    return {"fits": fits, "reason": reason}


