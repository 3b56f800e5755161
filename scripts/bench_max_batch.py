"""The largest micro-batch each method fits under a budget (the paper's "Maximum batch size").

Fitting is from measured bytes: static bytes + the ActivationRuler's peak of one training step at
that micro-batch (bench_common). The search gallops, then bisects, since memory grows with the
micro-batch. Budgets are "budget@k": static + the stock model's peak at micro-batch k.

Methods:
- no optimisation; Megatron full recompute;
- Megatron block recompute, each number of layers; the fewest that reach the largest micro-batch is
  reported;
- Megatron selective recompute, each recompute_modules set; the best is reported;
- the paper's naive INT4;
- torch.compile at activation_memory_budget 0, its most memory-saving setting;
- Adacc auto, profiled and planned at each micro-batch tried. It fits when the planner finds a plan
  and the plan's measured bytes fit.

    python scripts/bench_max_batch.py [--quick] [--attention-backend flash|unfused]
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import bench_common as bc
from bench_throughput import FULL, QUICK


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bc.add_shape_args(parser, FULL, QUICK)
    parser.add_argument("--budget-at", type=int, nargs="*",
                        help="budgets: no optimisation fits up to these micro-batches")
    parser.add_argument("--cap", type=int, default=128, help="largest micro-batch tried")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    parser.add_argument("--repeats", type=int, default=1, help="profiler timing repeats")
    parser.add_argument("--out", help="default bench_results/max_batch_<attention>.json")
    parser.add_argument("--publish", help="copy under docs/results/ (default "
                                          "max_batch_<attention>.json; '' to skip)")
    parser.add_argument("--figure", help="default max_batch_<attention>.png ('' to skip)")
    args = parser.parse_args()
    bc.output_names(args, "max_batch")
    args.budget_at = args.budget_at or ([2] if args.quick else [2, 4])
    return args


def largest(memory: Callable[[int], int | None], budget: int, start: int, cap: int,
            log: dict) -> int:
    """Largest b in [0, cap] whose measured ``memory(b)`` fits ``budget`` (None: no plan).

    It assumes memory grows with b: it gallops up from ``start`` (or bisects below it), then
    bisects. ``log`` collects b -> memory bytes."""
    def check(b: int) -> bool:
        if b not in log:
            log[b] = memory(b)
        return log[b] is not None and log[b] <= budget

    start = max(1, min(start, cap))
    if not check(start):
        lo, hi = 0, start
    else:
        lo, step = start, 1
        while lo + step <= cap and check(lo + step):
            lo += step
            step *= 2
        hi = min(lo + step, cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    args = parse()
    run, began_run, shape, models = bc.start_memory_bench(args)
    static = models.static_bytes
    results = {}
    for k in args.budget_at:
        budget = static + models.none().activation_peak(bc.batch_of(shape, k))
        name = f"budget@{k}"
        print(f"{name}: {budget / 2**20:.1f} MiB ({shape.describe()})", flush=True)
        row: dict[str, dict] = {}

        def simple(variant_for):
            return lambda b: static + variant_for().activation_peak(bc.batch_of(shape, b))

        def search(method, fits, start=1, detail=""):
            began = time.perf_counter()
            log: dict[int, bool] = {}
            best = largest(fits, budget, start, args.cap, log)
            row[method] = {"max_micro_batch": best, "detail": detail, "tried": log,
                           "search_s": time.perf_counter() - began}
            print(f"  {method:32s} {best:4d}  {detail}  ({len(log)} sizes tried)", flush=True)
            return best

        search("no optimisation", simple(models.none), start=k)
        full = search("megatron full recompute", simple(models.full_recompute), start=k)
        def best_of(method: str, variants, key: str, reached: dict | None = None) -> None:
            """Each variant's largest micro-batch, and the method's: the first reaching the most.

            Variants are keyed by their detail; ``reached`` holds some already known."""
            reached = {**{v.detail: largest(simple(lambda v=v: v), budget, k, args.cap, {})
                          for v in variants}, **(reached or {})}
            chosen = max(reached, key=reached.get)
            row[method] = {"max_micro_batch": reached[chosen], "detail": chosen, key: reached}
            print(f"  {method:32s} {reached[chosen]:4d}  {reached}")

        best_of("megatron selective recompute", models.selective_variants(), "per_set")
        # Block recompute re-runs the first n layers whole (n < layers here); n = every layer
        # keeps what full recompute keeps, so it reaches full recompute's micro-batch. The
        # fewest n that reach the largest is the one reported, as Megatron users pick it.
        best_of("megatron block recompute", models.block_variants(), "per_layers",
                {f"{shape.layers} of {shape.layers} layers": full})
        search("naive INT4", simple(models.naive_int4), start=k)
        if not args.no_compile:
            def compiled_fits(b):
                peak = models.compiled_peak(0.0, bc.batch_of(shape, b))
                return None if peak is None else static + peak
            search("torch.compile + memory budget", compiled_fits, start=k,
                   detail="budget fraction 0")
            if 0.0 in models.compile_errors:
                row["torch.compile + memory budget"]["error"] = models.compile_errors[0.0]

        def adacc_fits(b):
            batch = bc.batch_of(shape, b)
            variant = models.adacc_auto(models.adacc_costs(batch, args.repeats), budget)
            return None if variant is None else static + variant.activation_peak(batch)
        search("adacc auto", adacc_fits, start=max(1, full))
        adacc = row["adacc auto"]["max_micro_batch"]
        none = row["no optimisation"]["max_micro_batch"]
        results[name] = {"budget_bytes": budget, "methods": row,
                         "adacc_vs_none": adacc / none if none else None,
                         "adacc_vs_full_recompute": adacc / full if full else None}
    targets = max_batch_targets(results)
    run.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"),
               wall_s=time.perf_counter() - began_run)
    data = {"run": run, "shape": shape.__dict__, "static_bytes": static,
            "results": results, "targets": targets,
            "args": {k: v for k, v in vars(args).items() if not k.startswith("_")}}
    bc.write_json(data, args.out, args.publish or None)
    plot(results, shape, args)
    print(targets)


def max_batch_targets(results: dict) -> dict:
    """Adacc's largest micro-batch against the other methods', worst over budgets.

    - against every other method: its plan space contains what naive INT4 and full recompute do;
    - against naive INT4 alone;
    - its ratios to full recompute (target 1.5x) and to no optimisation (the paper's 2.38x)."""
    def mb(r, method):
        return r["methods"].get(method, {}).get("max_micro_batch")

    def worst(ratio):
        values = [ratio(r) for r in results.values()]
        return min(values) if values and None not in values else None

    behind = {f"{name}: {method}": mb(r, method) for name, r in results.items()
              for method in r["methods"] if method != "adacc auto"
              and mb(r, method) > mb(r, "adacc auto")}
    vs_full = worst(lambda r: r["adacc_vs_full_recompute"])
    vs_none = worst(lambda r: r["adacc_vs_none"])
    return {
        "adacc_ge_every_method": not behind,
        "methods_ahead_of_adacc": behind,
        "adacc_ge_naive_int4": all(mb(r, "adacc auto") >= mb(r, "naive INT4")
                                   for r in results.values()),
        "adacc_ge_full_recompute": all(mb(r, "adacc auto") >= mb(r, "megatron full recompute")
                                       for r in results.values()),
        "min_adacc_vs_full_recompute": vs_full,
        "adacc_ge_1_5x_full_recompute": None if vs_full is None else vs_full >= 1.5,
        "min_adacc_vs_none": vs_none,
        "adacc_ge_2_38x_none": None if vs_none is None else vs_none >= 2.38,
    }


def plot(results, shape, args) -> None:
    plt = bc.pyplot()
    methods = [m for m in bc.METHODS if any(m in r["methods"] for r in results.values())]
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(methods) * len(results) / 2, 4))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        values = [r["methods"].get(method, {}).get("max_micro_batch", 0)
                  for r in results.values()]
        xs = [j + i * width for j in range(len(results))]
        bars = ax.bar(xs, values, width, label=method)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))])
    ax.set_xticklabels([f"{n}\n{r['budget_bytes'] / 2**20:.0f} MiB" for n, r in results.items()])
    ax.set_ylabel("largest micro-batch that fits")
    ax.legend(fontsize=7)
    ax.set_title(f"Maximum micro-batch ({'--quick, ' if args.quick else ''}{shape.describe()})",
                 fontsize=9)
    bc.save_figure(fig, args.figure)


if __name__ == "__main__":
    main()
