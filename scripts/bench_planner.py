"""Planner solve time on the 24-layer GPT-345M-shaped problem: frontier method vs the CBC MILP.

The costs are analytic V100 ones at micro-batch 8, at several budgets, per-layer and uniform.

    python scripts/bench_planner.py [--repeats 7] [--out bench_results/planner.json]

"cold" includes building the layer frontier (once per cost table); "warm" re-plans the same costs at
another budget (the frontier is cached). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from megatron_adacc import planning
from megatron_adacc.planning import analytic
from megatron_adacc.common.units import format_size

GiB = 1024**3


def _time(costs, budget, per_layer, method, cold, repeats):
    samples, result = [], None
    for _ in range(repeats):
        if cold:
            planning.clear_frontier_cache()
        started = time.perf_counter()
        result = planning.plan(costs, budget, per_layer=per_layer, method=method)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples) * 1e3, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default="bench_results/planner.json")
    parser.add_argument("--skip-milp", action="store_true", help="skip the slow direct MILP")
    args = parser.parse_args()
    shape = analytic.ModelShape(24, 1024, 16, 1024, 50257)
    costs = analytic.analytic_costs(shape, 8, "v100-32gb")
    budgets = [int(b * GiB) for b in (8, 10, 12, 16, 20, 26)]
    rows = []
    cases = [("per-layer", True, "frontier", False), ("per-layer", True, "frontier", True),
             ("uniform", False, "frontier", False), ("uniform", False, "frontier", True)]
    if not args.skip_milp:
        cases.append(("uniform", False, "milp", True))
    for budget in budgets:
        for label, per_layer, method, cold in cases:
            repeats = 3 if method == "milp" else args.repeats
            median_ms, result = _time(costs, budget, per_layer, method, cold, repeats)
            rows.append({"budget_bytes": budget, "plan": label, "method": method,
                         "frontier": "cold" if cold else "warm", "median_ms": median_ms,
                         "added_time_ms": result.added_time_s * 1e3,
                         "peak_bytes": result.peak_bytes, "repeats": repeats})
    header = (f"{'budget':>10} {'plan':>9} {'method':>8} {'frontier':>8} {'median ms':>10} "
              f"{'added ms':>9}")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{format_size(row['budget_bytes']):>10} {row['plan']:>9} {row['method']:>8} "
              f"{row['frontier']:>8} {row['median_ms']:>10.1f} {row['added_time_ms']:>9.3f}")
    warm = [r["median_ms"] for r in rows if r["plan"] == "per-layer" and r["frontier"] == "warm"]
    cold = [r["median_ms"] for r in rows if r["plan"] == "per-layer" and r["frontier"] == "cold"]
    summary = {"per_layer_warm_median_ms": statistics.median(warm),
               "per_layer_cold_median_ms": statistics.median(cold)}
    print(f"per-layer median over budgets: warm {summary['per_layer_warm_median_ms']:.1f} ms, "
          f"cold {summary['per_layer_cold_median_ms']:.1f} ms")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"problem": "GPT-345M, 24 layers, micro-batch 8, v100-32gb",
                               "summary": summary, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
