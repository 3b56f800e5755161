"""--adacc-policy auto against Megatron's full recomputation and no optimisation, on a tiny GPT.

The budgets lie between "everything retained" and "full recompute". It profiles the model once and
plans for each budget. Then it times one training step (forward and backward) of every variant,
interleaved: one step of each per round after warm-up, so drift on a shared machine hits them alike.
It reports medians. The paper claims 1.01x-1.37x the throughput of full recomputation.

    python scripts/bench_auto.py [--quick] [--out bench_results/auto.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from collections import Counter


import bench_common as bc

from megatron_adacc.models import build as model_lib
from megatron_adacc import planning, policies
from megatron_adacc.profiling import profiler
from megatron_adacc.runtime import apply_plan, measure_step
from megatron_adacc.common.units import format_size

FRACTIONS = (0.25, 0.5, 0.75)   # of the way from the smallest feasible budget to no optimisation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5, help="profiler repeats")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repeats")
    parser.add_argument("--out", default="bench_results/auto.json")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.rounds, args.repeats = 2, 5, 2
    warnings.filterwarnings("ignore")
    model_lib.init_distributed(1)

    shape = bc.Shape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                     vocab=args.vocab, dropout=args.dropout)
    batch = bc.batch_of(shape, args.batch)
    adacc = bc.build(shape, adacc=True)
    started = time.perf_counter()
    # Planned exactly as --adacc-policy auto plans (designated codecs, exact sources).
    costs = policies.designated_codecs(profiler.profile(adacc, batch, repeats=args.repeats))
    profile_s = time.perf_counter() - started
    minimum = planning.minimum_budget(costs, allow_lossy_sources=False)
    minimum += costs.num_layers * planning.default_resolution(costs)
    everything = planning.plan(costs, 1 << 40).references["no optimisation"].peak_bytes

    # variant -> (model, plan to apply before each step or None)
    variants = {
        "no optimisation": (bc.build(shape), None),
        "megatron full recompute": (bc.build(shape, recompute_granularity="full",
                                             recompute_method="uniform", recompute_num_layers=1),
                                    None),
        "adacc full-recompute": (adacc, policies.full_recompute_plan()),
    }
    results = {}
    for fraction in FRACTIONS:
        budget = int(minimum + fraction * (everything - minimum))
        result = planning.plan(costs, budget, allow_lossy_sources=False)
        name = f"auto @ {format_size(budget)}"
        variants[name] = (adacc, result.plan)
        mix = Counter(d.action for layer in result.layer_decisions for d in layer.values())
        results[name] = {"budget_bytes": budget, "fraction": fraction, "mix": dict(mix),
                         "plan": result.plan.to_dict(),
                         "predicted_peak_bytes": result.peak_bytes,
                         "predicted_added_s": result.added_time_s,
                         "predicted_activation_bytes":
                             policies.predicted_activation_bytes(costs, result)}

    def loss_fn(model):
        return lambda: model_lib.gpt_loss(model, *batch)

    times = {name: [] for name in variants}
    for round_ in range(args.warmup + args.rounds):
        for name, (model, plan) in variants.items():
            if plan is not None:
                apply_plan(model, plan)
            model.zero_grad(set_to_none=True)
            began = time.perf_counter()
            loss_fn(model)().backward()
            if round_ >= args.warmup:
                times[name].append(time.perf_counter() - began)
    for name, (model, plan) in variants.items():
        if plan is not None:
            apply_plan(model, plan)
        report = measure_step(model, loss_fn(model))[1]
        results.setdefault(name, {}).update(
            median_step_s=statistics.median(times[name]),
            activation_bytes=report.after_forward_bytes,
            activation_peak_bytes=report.peak_bytes)
    full = results["megatron full recompute"]["median_step_s"]
    stock = results["no optimisation"]["median_step_s"]
    for r in results.values():
        r["throughput_vs_full_recompute"] = full / r["median_step_s"]
        r["time_vs_no_optimisation"] = r["median_step_s"] / stock

    print(f"tiny GPT: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, micro-batch {args.batch}, dropout {args.dropout}; profiled in "
          f"{profile_s:.1f} s; budgets from {format_size(minimum)} (smallest feasible) to "
          f"{format_size(everything)} (no optimisation); static "
          f"{format_size(costs.static_bytes)}")
    print(f"{'variant':26s} {'retain/compress/recompute':>26s} {'act. bytes':>11s} "
          f"{'predicted':>10s} {'step ms':>8s} {'x full-rc':>9s} {'x none':>7s}")
    for name, r in results.items():
        mix = r.get("mix")
        mix_text = (f"{mix.get('retain', 0)}/{mix.get('compress', 0)}/{mix.get('recompute', 0)}"
                    if mix else "-")
        predicted = r.get("predicted_activation_bytes")
        print(f"{name:26s} {mix_text:>26s} {r['activation_bytes']:11d} "
              f"{predicted if predicted is not None else '-':>10} "
              f"{1e3 * r['median_step_s']:8.2f} {r['throughput_vs_full_recompute']:9.3f} "
              f"{r['time_vs_no_optimisation']:7.3f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "profile_s": profile_s, "minimum_budget": minimum,
                   "no_optimisation_budget": everything, "costs": costs.to_dict(),
                   "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
