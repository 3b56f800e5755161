"""Activation bytes per layer and fwd+bwd time of runtime presets, relative to the stock layer.

``megatron_full`` is the stock layer under megatron-core's own full recompute (uniform, one layer
a checkpoint), to set Adacc's ``recompute_all`` against: the same bytes kept, another mechanism.
``hooks_only`` runs every layer under the runtime's hooks with nothing to act on: what the hooks
alone cost (the profiler's ``hooked_layer_s``).

Presets run interleaved: one step of each per round after warm-up, the order rotated each round. So
drift on a shared machine hits them alike. Times are medians over rounds. "paired" is the median
over rounds of each round's time / that round's stock time, which a load spike in one round cannot
move. ``--clock cpu`` times the process's CPU time instead of wall time. Use it with
OMP_NUM_THREADS=1 on a machine shared with other jobs: CPU time is not stretched while the scheduler
runs someone else. Writes a JSON report (--out).

    python scripts/bench_runtime.py --rounds 20 --out bench_results/runtime.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings


import torch

from megatron_adacc.models import build as model_lib
from megatron_adacc.common.plan import Plan
from megatron_adacc.runtime import (adacc_layers, apply_plan, get_adacc_layer_spec,
                                    measure_step)
from megatron_adacc.common.sites import SITE_NAMES, SITES

PAPER_COMPRESSED = ["ln1_out", "qkv", "softmax_out", "attn_dropout_mask", "attn_probs",
                    "context", "bda1_mask", "ln2_in", "ln2_out", "gelu_in", "gelu_out",
                    "bda2_mask"]
PRESETS = {
    "stock": None,
    "all_retain": Plan(),
    "compress_all": Plan.uniform({s: "compress" for s in PAPER_COMPRESSED}),
    "recompute_all": Plan.uniform({s: "recompute" for s in SITE_NAMES if SITES[s].recomputable}),
    "mixed": Plan.uniform({"qkv": "compress", "softmax_out": "recompute",
                           "attn_dropout_mask": "compress", "gelu_in": "recompute",
                           "gelu_out": "compress"}),
    "megatron_full": None,
    "hooks_only": Plan(),
}
# Presets whose layers run under the hooks though their plan keeps everything
FORCE_HOOKS = {"hooks_only"}
# Presets of the stock layer with megatron-core's recompute: their config's settings
MEGATRON_RECOMPUTE = {"megatron_full": dict(recompute_granularity="full",
                                            recompute_method="uniform", recompute_num_layers=1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--out", default="bench_results/runtime.json")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    model_lib.init_distributed(1)

    models = {}
    for name, plan in PRESETS.items():
        model_lib.set_seed(1)
        config = model_lib.build_transformer_config(
            num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
            hidden_dropout=args.dropout, attention_dropout=args.dropout,
            **MEGATRON_RECOMPUTE.get(name, {}))
        spec = None if plan is None else get_adacc_layer_spec()
        models[name] = model_lib.build_gpt_model(config, 256, args.seq, spec)
        if plan is not None:
            apply_plan(models[name], plan)
        if name in FORCE_HOOKS:
            for layer in adacc_layers(models[name]):
                layer.force_hooks = True
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
    labels = torch.randint(0, 256, (args.batch, args.seq), generator=gen)
    mask = torch.ones(args.batch, args.seq)

    clock = time.perf_counter if args.clock == "wall" else time.process_time

    def step(model):
        model.zero_grad(set_to_none=True)
        start = clock()
        model_lib.gpt_loss(model, tokens, labels, mask).backward()
        return clock() - start

    names = list(models)
    times = {name: [] for name in names}
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = step(models[name])
            if round_ >= args.warmup:
                times[name].append(elapsed)
    results = {}
    base = statistics.median(times["stock"])
    for name, model in models.items():
        _, report = measure_step(model, lambda: model_lib.gpt_loss(model, tokens, labels, mask))
        per_layer = [report.layer_bytes(layer) for layer in range(args.layers)]
        median = statistics.median(times[name])
        results[name] = {"layer_bytes": per_layer,
                         "after_forward_bytes": report.after_forward_bytes,
                         "peak_bytes": report.peak_bytes, "median_step_s": median,
                         "time_vs_stock": median / base,
                         "paired_vs_stock": statistics.median(
                             t / b for t, b in zip(times[name], times["stock"]))}
    stock_layer = results["stock"]["layer_bytes"][0]
    print(f"{'preset':15s} {'bytes/layer':>12s} {'vs stock':>9s} {'peak':>10s} "
          f"{'step ms':>9s} {'time vs stock':>14s} {'paired':>7s}")
    for name, r in results.items():
        print(f"{name:15s} {r['layer_bytes'][0]:12d} {r['layer_bytes'][0] / stock_layer:9.3f} "
              f"{r['peak_bytes']:10d} {1e3 * r['median_step_s']:9.2f} {r['time_vs_stock']:14.3f} "
              f"{r['paired_vs_stock']:7.3f}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
