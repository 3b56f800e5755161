"""Validation loss of the same model trained from the same seed with: no optimisation,
Adacc auto, Adacc without outlier separation (--adacc-policy auto-no-outlier) and the paper's
naive INT4 (--adacc-policy quantize): the paper's loss figure and accuracy table.

Each run is ``pretrain_gpt.py`` in a subprocess on the built-in demo corpus (KJV, byte-level
tokens), so every number comes from the product's own trainer. The Adacc runs' memory budgets
are fixed fractions of the way from the planner's smallest feasible budget to no optimisation
(read from a one-step probe): near 0 the plans must compress (lossy int4 included), higher up
they may rebuild instead, which is exact. The probe records what each plan compresses.

    python scripts/bench_accuracy.py [--quick] [--seeds 1234 4321]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import bench_common as bc

LABELS = {"none": "no optimisation", "auto": "adacc auto",
          "auto-no-outlier": "adacc w/o outlier separation", "quantize": "naive INT4",
          "codecs": "adacc codecs, every site", "codecs-no-outlier":
          "adacc codecs w/o outlier separation, every site"}


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="minutes: 2 layers, 60 steps, 1 seed")
    parser.add_argument("--seeds", type=int, nargs="*")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--budget-fractions", type=float, nargs="*",
                        help="Adacc budgets: this far from the smallest feasible budget (0) to "
                             "no optimisation (1); default 0.02 0.25 (--quick: 0.02)")
    parser.add_argument("--workdir", default="bench_results/accuracy")
    parser.add_argument("--out", default="bench_results/accuracy.json")
    parser.add_argument("--publish", default="accuracy.json")
    parser.add_argument("--figure", default="accuracy_loss.png")
    args = parser.parse_args()
    args.seeds = args.seeds or ([1234] if args.quick else [1234, 4321])
    args.iters = args.iters or (60 if args.quick else 300)
    args.budget_fractions = args.budget_fractions or ([0.02] if args.quick else [0.02, 0.25])
    return args


def model_flags(args) -> list[str]:
    layers, hidden, heads, seq = (2, 128, 4, 128) if args.quick else (4, 128, 4, 128)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--micro-batch-size", "8", "--global-batch-size", "8",
            "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-warmup-iters", str(max(1, args.iters // 20)), "--lr-decay-style", "cosine",
            "--tokenizer-type", "ByteLevel", "--eval-interval", str(max(1, args.iters // 10)),
            "--eval-iters", "4", "--log-interval", str(max(1, args.iters // 10)),
            "--adacc-profile-db", os.path.join(args.workdir, "profiles.sqlite")]


def probe_budgets(args, flags: list[str]) -> dict:
    """The planner's range for this model and micro-batch, from a one-step auto probe, the
    budget at each fraction, and what auto and auto-no-outlier plan there (how many site
    decisions compress, and with which codecs: lossless bitmasks or lossy int4)."""
    from collections import Counter

    from megatron_adacc import Adacc, AdaccConfig, planning, policies
    from megatron_adacc.arguments import parse_args
    from megatron_adacc.trainer import build_model_and_data, first_micro_batch

    probe = parse_args(flags + ["--train-iters", "1", "--lr-warmup-iters", "0",
                                "--seed", str(args.seeds[0]), "--adacc-policy", "auto",
                                "--adacc-memory-budget", "1TiB", "--adacc-tracking", "off"])
    adacc = Adacc(AdaccConfig.from_args(probe))
    model, batches, _ = build_model_and_data(probe, adacc.layer_spec())
    adacc.setup(model, first_micro_batch(batches))
    result, costs = adacc.result, adacc.costs
    minimum = result.minimum_feasible_budget
    everything = result.references["no optimisation"].peak_bytes
    budgets = {}
    for fraction in args.budget_fractions:
        budget = int(minimum + fraction * (everything - minimum))
        plans, plan_ids = {}, {}
        for policy in ("auto", "auto-no-outlier"):
            planned = planning.plan(policies.planning_costs(policy, costs), budget,
                                   allow_lossy_sources=False)
            plan_ids[policy] = planned.plan.plan_id
            mix = Counter()
            for layer in planned.layer_decisions:
                for site, decision in layer.items():
                    key = (decision.action if decision.action != "compress" else
                           f"compress:{decision.codec_for(site)}")
                    mix[key] += 1
            plans[policy] = dict(mix)
        budgets[str(fraction)] = {"budget_bytes": budget, "plans": plans, "plan_ids": plan_ids,
                                  "same_plan": len(set(plan_ids.values())) == 1}
    # Adacc's codecs on every site (what quantize does with naive INT4): the accuracy of
    # layer-specific compression itself, whatever a budget makes the planner choose.
    from megatron_adacc.plan import Decision, Plan
    from megatron_adacc.sites import ABLATION_CODECS, COMPRESS, DECIDED_SITES

    forced = {}
    for name, no_outlier in (("codecs", False), ("codecs-no-outlier", True)):
        decisions = {}
        for site in DECIDED_SITES:
            if site.default_codec is None:  # never compressed (the log-sum-exp)
                continue
            codec = ABLATION_CODECS.get(site.default_codec) if no_outlier else None
            decisions[site.name] = Decision(COMPRESS, codec)
        path = os.path.join(args.workdir, f"plan-{name}.yaml")
        Plan.uniform(decisions).save(path)
        forced[name] = path
    return {"minimum_feasible_budget": minimum, "no_optimisation_peak": everything,
            "budgets": budgets, "forced_plans": forced}


def run(args, flags, policy: str, seed: int, fraction: float | None, budget: int | None,
        plan_file: str | None = None) -> dict:
    tag = policy if fraction is None else f"{policy}@{fraction}"
    metrics = os.path.join(args.workdir, f"{tag}-seed{seed}.jsonl")
    command = [sys.executable, os.path.join(bc.ROOT, "pretrain_gpt.py"), *flags,
               "--seed", str(seed), "--adacc-policy", plan_file or policy,
               "--metrics-file", metrics]
    if budget is not None:
        command += ["--adacc-memory-budget", str(budget)]
    # A world of one of its own: not this process's rendezvous (init_distributed set it).
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    began = time.perf_counter()
    done = subprocess.run(command, cwd=bc.ROOT, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - began
    base = {"policy": policy, "fraction": fraction, "tag": tag, "seed": seed, "wall_s": elapsed}
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        print(f"  {tag} seed {seed}: FAILED ({' | '.join(tail)})", flush=True)
        return {**base, "failed": True, "error": tail}
    records = [json.loads(line) for line in open(metrics)]
    val = [(r["iteration"], r["val_loss"]) for r in records if "val_loss" in r]
    out = {**base, "val_curve": val,
           "final_val_loss": val[-1][1] if val else None,
           "final_train_loss": records[-1]["loss"],
           "train_curve": [(r["iteration"], r["loss"]) for r in records],
           "activation_bytes": records[-1].get("activation_bytes"),
           "median_tokens_per_s": sorted(r["tokens_per_s"] for r in records)[len(records) // 2],
           "plan_swaps": sum(1 for r in records if r.get("plan_swap"))}
    print(f"  {label(out):36s} seed {seed}: final val loss {out['final_val_loss']:.4f}, "
          f"activations {out['activation_bytes']} B, {elapsed:.0f} s", flush=True)
    return out


def label(r: dict) -> str:
    name = LABELS[r["policy"]]
    return name if r.get("fraction") is None else f"{name} @ budget {r['fraction']}"


def main() -> None:
    args = parse()
    meta, began_run = bc.run_info(args), time.perf_counter()
    os.makedirs(args.workdir, exist_ok=True)
    flags = model_flags(args)
    bc.init()
    probe = probe_budgets(args, flags)
    for fraction, entry in probe["budgets"].items():
        print(f"budget fraction {fraction}: {entry['budget_bytes']} B (from "
              f"{probe['minimum_feasible_budget']} to {probe['no_optimisation_peak']}); plans "
              f"{entry['plans']}", flush=True)
    runs = []
    for seed in args.seeds:
        runs.append(run(args, flags, "none", seed, None, None))
        for fraction, entry in probe["budgets"].items():
            runs.append(run(args, flags, "auto", seed, float(fraction), entry["budget_bytes"]))
            if entry["same_plan"]:
                # The same plan trains bit for bit the same: reuse the auto run.
                same = dict(runs[-1], policy="auto-no-outlier", tag=f"auto-no-outlier@{fraction}",
                            same_plan_as_auto=True)
                runs.append(same)
                print(f"  auto-no-outlier @ {fraction}: the same plan as auto, not rerun")
            else:
                runs.append(run(args, flags, "auto-no-outlier", seed, float(fraction),
                                entry["budget_bytes"]))
        for name, path in probe["forced_plans"].items():
            runs.append(run(args, flags, name, seed, None, None, plan_file=path))
        runs.append(run(args, flags, "quantize", seed, None, None))
    gaps: dict[str, list[float]] = {}
    for seed in args.seeds:
        base = next(r for r in runs if r["seed"] == seed and r["policy"] == "none")
        for r in runs:
            if r["seed"] != seed or r.get("failed") or base.get("failed"):
                continue
            r["gap_pct"] = 100 * (r["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
            if r["policy"] != "none":
                gaps.setdefault(r["tag"], []).append(r["gap_pct"])
    auto_gaps = [g for tag, values in gaps.items() if tag.startswith("auto@") for g in values]
    targets = {"adacc_worst_gap_pct": max(auto_gaps, key=abs) if auto_gaps else None,
               "adacc_within_0_5pct": (all(abs(g) <= 0.5 for g in auto_gaps)
                                       if auto_gaps else None),
               "no_outlier_gaps_pct": {t: g for t, g in gaps.items()
                                       if t.startswith("auto-no-outlier")},
               "codecs_gaps_pct": gaps.get("codecs"),
               "codecs_no_outlier_gaps_pct": gaps.get("codecs-no-outlier"),
               "naive_int4_gaps_pct": gaps.get("quantize")}
    command = " ".join([os.path.join(".", "pretrain_gpt.py"), *flags])
    meta.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"),
                wall_s=time.perf_counter() - began_run)
    data = {"run": meta, "flags": flags, "pretrain_command": command,
            "probe": probe, "runs": runs, "gaps_pct": gaps, "targets": targets,
            "args": vars(args)}
    bc.write_json(data, args.out, args.publish or None)
    plot(runs, args)
    print(targets)


def plot(runs, args) -> None:
    plt = bc.pyplot()
    fig, axes = plt.subplots(1, len(args.seeds), figsize=(6 * len(args.seeds), 4), squeeze=False)
    for ax, seed in zip(axes[0], args.seeds):
        for r in runs:
            if r["seed"] != seed or r.get("failed"):
                continue
            xs, ys = zip(*r["val_curve"]) if r["val_curve"] else ((), ())
            ax.plot(xs, ys, marker="o", markersize=3,
                    label=f"{label(r)} ({r['final_val_loss']:.4f})")
        ax.set_xlabel("iteration")
        ax.set_ylabel("validation loss")
        ax.set_title(f"seed {seed}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Validation loss, KJV byte-level ({'--quick' if args.quick else 'full'})",
                 fontsize=9)
    bc.save_figure(fig, args.figure)


if __name__ == "__main__":
    main()
