"""The rectifier on the demo corpus (KJV) on this CPU: auto with tracking against tracking off.

The other run keeps the plan made at iteration 0 for good. Both use the same seed, profile (one
ProfileDB) and budget. Each run is one pretrain_gpt.py (Megatron-LM's loop) in this process, the
tracking run first. The runs do not alternate in chunks, since a resumed run would start its
rectifier afresh. So load on a shared machine can hit them unevenly.

It reports:
- each run's throughput: tokens over step time, plus tracking time for the tracking run;
- their ratio (the paper reports 1.11x-1.2x from adaptation);
- the tracking overhead in percent of training time, and the swaps;
- the activation bytes the runtime measured against the budget.
Figures: outlier channels per tracked site over iterations, and the plan (action per site and layer)
over iterations.

    python scripts/bench_rectifier.py [--quick] [--out bench_results/rectifier.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import warnings

from megatron_adacc import cli, megatron_lm, planning, policies
from megatron_adacc.common.units import format_size

ACTION_CODE = {"retain": 0, "compress": 1, "recompute": 2}


def trainer_args(opts, db: str, budget: int | None, tracking: str) -> list[str]:
    flags = ["--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
             "--num-attention-heads", str(opts.heads), "--seq-length", str(opts.seq),
             "--max-position-embeddings", str(opts.seq),
             "--micro-batch-size", str(opts.batch), "--global-batch-size", str(opts.batch),
             "--train-iters", str(opts.iters), "--lr", "1e-3", "--min-lr", "1e-4",
             "--lr-warmup-iters", "5", "--eval-iters", "0", "--transformer-impl", "local",
             "--log-interval", "1000000", "--seed", "1234",
             "--activation-measure-interval", str(opts.measure_interval),
             "--adacc-policy", "auto", "--adacc-profile-db", db,
             "--adacc-memory-budget", str(budget if budget is not None else 1 << 40),
             "--adacc-tracking", tracking,
             "--adacc-tracking-max-interval", str(opts.max_interval),
             # The rectifier alone: the step watch (on by default while tracking) would also
             # swap plans, on step times this shared CPU makes noisy.
             "--adacc-step-watch", "off"]
    return flags


def pick_budget(opts, db: str) -> tuple[int, planning.PlanResult]:
    """Profile once (into ``db``) and take the budget ``--budget-fraction`` of the way up.

    The way runs from the smallest feasible budget to no optimisation. The budget is tight enough
    that the plan pays for every byte, so payload changes can matter."""
    costs = policies.designated_codecs(cli.trainer_costs(trainer_args(opts, db, None, "off")))
    loose = planning.plan(costs, 1 << 40, allow_lossy_sources=False)
    low = loose.minimum_feasible_budget
    high = loose.references["no optimisation"].peak_bytes
    budget = int(low + opts.budget_fraction * (high - low))
    return budget, planning.plan(costs, budget, allow_lossy_sources=False)


def interleaved(opts, db: str, budget: int) -> dict[str, tuple[object, list[dict]]]:
    """Each tracking setting's pretrain_gpt.py run: (its Adacc session, its records)."""
    import pretrain_gpt

    runs = {}
    for name in ("backoff", "off"):
        if pretrain_gpt.main(trainer_args(opts, db, budget, name)) != 0:
            raise SystemExit(f"bench_rectifier.py: the {name} run failed")
        session = megatron_lm.session()
        runs[name] = (session, session.records)
    return runs


def summary(records: list[dict], tokens_per_step: int, budget: int, static: int) -> dict:
    step_s = sum(r["step_time_s"] for r in records)
    tracking_s = records[-1].get("tracking_time_s_total", 0.0)
    measured = [r["activation_bytes"] for r in records if r["activation_measured"]]
    return {
        "iterations": len(records),
        "step_time_s": step_s,
        "tracking_time_s": tracking_s,
        "tokens_per_s": tokens_per_step * len(records) / (step_s + tracking_s),
        # Robust to load spikes: the median step, plus tracking spread over the run.
        "median_step_s": statistics.median(r["step_time_s"] for r in records),
        "tokens_per_s_median": tokens_per_step / (
            statistics.median(r["step_time_s"] for r in records) + tracking_s / len(records)),
        "tracking_overhead_pct": 100 * tracking_s / (step_s + tracking_s),
        "tracking_iterations": [r["iteration"] for r in records if r.get("tracking")],
        "swaps": [{"iteration": r["iteration"], **r["plan_swap"]}
                  for r in records if "plan_swap" in r],
        "guarded": sorted({s for r in records for s in r.get("guarded_sites", [])}),
        "max_measured_activation_bytes": max(measured),
        "activation_budget_bytes": budget - static,
        "final_loss": records[-1]["loss"],
    }


def plan_timeline(initial: planning.PlanResult, records: list[dict]):
    """(site, layer) -> action code at each iteration, replaying the swaps' changes."""
    current = {(site, layer): decision.action
               for layer, decisions in enumerate(initial.layer_decisions)
               for site, decision in decisions.items()}
    timeline = []
    for record in records:
        timeline.append(dict(current))   # the plan this iteration ran with
        for change in record.get("plan_swap", {}).get("changed", []):
            for layer in change["layers"]:
                current[(change["site"], layer)] = change["to"].split(":")[0]
    return timeline


def figures(records: list[dict], initial: planning.PlanResult, figure_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    os.makedirs(figure_dir, exist_ok=True)
    tracked = [r for r in records if r.get("tracking")]
    sites = sorted({s for r in tracked for s, n in r["outlier_channels"].items() if n is not None})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for site in sites:
        ax.plot([r["iteration"] for r in tracked], [r["outlier_channels"][site] for r in tracked],
                marker="o", markersize=3, label=site)
    for swap in (r for r in records if "plan_swap" in r):
        ax.axvline(swap["iteration"], color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="iteration (tracking iterations; dotted: plan swaps)",
           ylabel="outlier channels (z-score > 3), measured layer",
           title="Outlier channels per site during training (KJV, CPU)")
    ax.set_xscale("symlog", linthresh=8)
    ax.legend(fontsize=7, ncol=2)
    outliers_png = os.path.join(figure_dir, "rectifier_outliers.png")
    fig.tight_layout()
    fig.savefig(outliers_png, dpi=120)
    plt.close(fig)

    timeline = plan_timeline(initial, records)
    rows = [(site, layer) for layer, decisions in enumerate(initial.layer_decisions)
            for site in decisions]
    grid = np.array([[ACTION_CODE[state[row]] for state in timeline] for row in rows])
    fig, ax = plt.subplots(figsize=(8, 0.22 * len(rows) + 1.5))
    cmap = matplotlib.colors.ListedColormap(["#dddddd", "#4c72b0", "#dd8452"])
    ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest",
              extent=(0.5, len(timeline) + 0.5, len(rows) - 0.5, -0.5))
    ax.set_yticks(range(len(rows)), [f"L{layer} {site}" for site, layer in rows], fontsize=6)
    ax.set_xlabel("iteration")
    ax.set_title("Plan over time (grey retain, blue compress, orange recompute)")
    plan_png = os.path.join(figure_dir, "rectifier_plan.png")
    fig.tight_layout()
    fig.savefig(plan_png, dpi=120)
    plt.close(fig)
    return [outliers_png, plan_png]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--max-interval", type=int, default=64,
                        help="--adacc-tracking-max-interval (the product default is 256; a "
                             "short run would stop tracking after iteration 128)")
    parser.add_argument("--measure-interval", type=int, default=10,
                        help="--activation-measure-interval, the same for both runs")
    parser.add_argument("--budget-fraction", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true", help="40 iterations")
    parser.add_argument("--out", default="bench_results/rectifier.json")
    parser.add_argument("--figures", default="docs/figures")
    opts = parser.parse_args()
    if opts.quick:
        opts.iters, opts.max_interval = 40, 16
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as scratch:
        db = os.path.join(scratch, "profiles.sqlite")
        budget, initial = pick_budget(opts, db)
        runs = interleaved(opts, db, budget)
    tokens_per_step = opts.batch * opts.seq
    static = initial.static_bytes
    results = {name: summary(records, tokens_per_step, budget, static)
               for name, (_, records) in runs.items()}
    tracking, fixed = results["backoff"], results["off"]
    pngs = figures(runs["backoff"][1], initial, opts.figures)
    report = {
        "config": {k: v for k, v in vars(opts).items() if k not in ("out", "figures")},
        "budget_bytes": budget,
        "initial_plan": initial.plan.plan_id,
        "initial_added_time_s": initial.added_time_s,
        "throughput_ratio": tracking["tokens_per_s"] / fixed["tokens_per_s"],
        "throughput_ratio_median": tracking["tokens_per_s_median"] / fixed["tokens_per_s_median"],
        "runs": results,
        "figures": pngs,
    }
    os.makedirs(os.path.dirname(opts.out) or ".", exist_ok=True)
    with open(opts.out, "w") as out:
        json.dump(report, out, indent=1)

    print(f"budget {format_size(budget)} (activations {format_size(budget - static)}); "
          f"plan at iteration 0: {initial.plan.plan_id}, +{initial.added_time_s * 1e3:.1f} ms/step")
    print(f"{'run':<22}{'tokens/s':>10}{'median':>8}{'tracking %':>12}{'swaps':>7}{'tracked':>9}"
          f"{'max act. bytes':>16}{'final loss':>12}")
    for name, label in (("backoff", "tracking (backoff)"), ("off", "plan of iteration 0")):
        r = results[name]
        print(f"{label:<22}{r['tokens_per_s']:>10.0f}{r['tokens_per_s_median']:>8.0f}"
              f"{r['tracking_overhead_pct']:>11.2f}%"
              f"{len(r['swaps']):>7}{len(r['tracking_iterations']):>9}"
              f"{format_size(r['max_measured_activation_bytes']):>16}{r['final_loss']:>12.4f}")
    print(f"throughput ratio tracking / fixed plan: {report['throughput_ratio']:.3f}x totals, "
          f"{report['throughput_ratio_median']:.3f}x medians; "
          f"activation budget {format_size(budget - static)}")
    for swap in tracking["swaps"]:
        print(f"  swap at {swap['iteration']}: {swap['reason']}, predicted gain "
              f"{swap['predicted_gain_s'] * 1e3:.2f} ms/step, {swap['changed']}")
    print(f"figures: {', '.join(pngs)}; json: {opts.out}")


if __name__ == "__main__":
    main()
