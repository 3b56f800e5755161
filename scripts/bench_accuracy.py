"""Validation loss of one model and seed under each method: the paper's loss figure and table.

The methods: no optimisation, Adacc auto, Adacc without outlier separation (--adacc-policy
auto-no-outlier), Adacc auto with lossy rebuild sources (--adacc-lossy-sources) and the paper's
naive INT4 (--adacc-policy quantize).

Each run is ``pretrain_gpt.py`` (in this process) on the built-in demo corpus (KJV, byte-level
tokens), so every number comes from the product's own trainer. The Adacc runs' budgets are fixed
fractions of the way from the planner's smallest feasible budget to no optimisation, read from a
one-step probe. Near 0 the plans must compress (lossy int4 included); higher up they may rebuild
instead, which is exact. The probe records what each plan compresses. Lossy rebuild sources
fit less, so their runs take the same fractions from their own smallest feasible budget.

--stress: the outlier stress setting (issue 15). At this scale the activations have no outlier
channels, so every method lands within a hair of no optimisation. Large trained LLMs have a few
residual-stream channels whose LayerNorm gains are tens of times the rest. So the stress run:
- trains the model normally for --stress-pretrain iterations and saves a checkpoint;
- multiplies the gains of --stress-channels channels by factors from 10 to 30, in every layer's two
  LayerNorms;
- continues training from that checkpoint (--load) to --iters with every method.
It is published as accuracy_stress.json.

    python scripts/bench_accuracy.py [--quick] [--seeds 1234 4321] [--stress]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import traceback

import bench_common as bc

LABELS = {"none": "no optimisation", "auto": "adacc auto",
          "auto-no-outlier": "adacc w/o outlier separation",
          "auto-lossy": "adacc auto, lossy rebuild sources", "quantize": "naive INT4",
          "codecs": "adacc codecs, every site", "codecs-no-outlier":
          "adacc codecs w/o outlier separation, every site",
          "megatron-full-recompute": "megatron full recompute",
          "pretrain": "normal training before the outlier gains (no optimisation)"}
# Runs named otherwise than their --adacc-policy: what they pass as it, and their own flags.
TRAINER_POLICY = {"megatron-full-recompute": "none", "pretrain": "none", "auto-lossy": "auto"}
OWN_FLAGS = {"megatron-full-recompute": ["--recompute-granularity", "full",
                                         "--recompute-method", "uniform",
                                         "--recompute-num-layers", "1"],
             "auto-lossy": ["--adacc-lossy-sources"]}
# What a run can train with, in the order they run (megatron's full recompute only in the
# stress setting).
METHODS = ("none", "auto", "auto-no-outlier", "auto-lossy", "codecs", "codecs-no-outlier",
           "quantize", "megatron-full-recompute")
# Outlier gains, as large trained LLMs show them: a few channels, tens of times the rest.
STRESS_GAIN_RANGE = (10.0, 30.0)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="minutes: 2 layers, 60 steps (--stress: 80), 1 seed")
    parser.add_argument("--seeds", type=int, nargs="*")
    parser.add_argument("--iters", type=int)
    parser.add_argument("--budget-fractions", type=float, nargs="*",
                        help="Adacc budgets: this far from the smallest feasible budget (0) to "
                             "no optimisation (1); default 0.02, the budget where plans must "
                             "compress (0.25 adds plans that also rebuild, which are exact)")
    parser.add_argument("--stress", action="store_true",
                        help="the outlier stress setting (see above)")
    parser.add_argument("--stress-pretrain", type=int,
                        help="iterations of normal training before the gains are scaled "
                             "(default: half of --iters)")
    parser.add_argument("--stress-channels", type=int, default=4,
                        help="channels whose LayerNorm gains are scaled")
    parser.add_argument("--profile-repeats", type=int,
                        help="auto's profile: timed steps per measurement (default: the "
                             "profiler's); it sets the plans, not the losses measured")
    parser.add_argument("--methods", nargs="*", choices=METHODS, default=None,
                        help="the methods trained (default: all; no optimisation always)")
    bc.add_family_args(parser, query_groups=2, query_groups_default="2")
    parser.add_argument("--workdir")
    parser.add_argument("--out")
    parser.add_argument("--publish")
    parser.add_argument("--figure", help="under docs/figures ('' to skip)")
    args = parser.parse_args()
    stem = ("accuracy_stress" if args.stress else "accuracy") + (
        "" if args.family == "gpt" else f"_{args.family}")
    args.workdir = args.workdir or f"bench_results/{stem}"
    args.out = args.out or f"bench_results/{stem}.json"
    args.publish = f"{stem}.json" if args.publish is None else args.publish
    args.figure = f"{stem}_loss.png" if args.figure is None else args.figure
    args.seeds = args.seeds or ([1234] if args.quick or args.stress else [1234, 4321])
    # Full mode: 240 iterations, so the whole suite stays within 45 minutes on 2 cores.
    args.iters = args.iters or ((80 if args.stress else 60) if args.quick else 240)
    args.stress_pretrain = args.stress_pretrain or args.iters // 2
    args.methods = ["none", *(m for m in args.methods or METHODS if m != "none"
                              and (args.stress or m != "megatron-full-recompute"))]
    if args.profile_repeats is not None and args.profile_repeats < 1:
        parser.error(f"--profile-repeats {args.profile_repeats}: must be a positive integer")
    if args.stress and not 0 < args.stress_pretrain < args.iters:
        parser.error(f"--stress-pretrain {args.stress_pretrain}: must be between 0 and --iters "
                     f"{args.iters}")
    args.budget_fractions = args.budget_fractions or [0.02]
    return args


def model_flags(args) -> list[str]:
    layers, hidden, heads, seq = (2, 128, 4, 128) if args.quick else (4, 128, 4, 128)
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--transformer-impl", "local",
            "--micro-batch-size", "8", "--global-batch-size", "8",
            "--train-iters", str(args.iters), "--lr", "1e-3", "--min-lr", "1e-4",
            "--lr-warmup-iters", str(max(1, args.iters // 20)), "--lr-decay-style", "cosine",
            "--eval-interval", str(max(1, args.iters // 10)),
            "--eval-iters", "4", "--log-interval", str(max(1, args.iters // 10)),
            "--adacc-profile-db", os.path.join(args.workdir, "profiles.sqlite"),
            *bc.models.get(args.family).argv(args.query_groups),
            *(["--ffn-hidden-size", str(args.ffn)] if args.ffn else []),
            *(["--adacc-profile-repeats", str(args.profile_repeats)]
              if args.profile_repeats is not None else [])]


def probe_budgets(args, flags: list[str]) -> dict:
    """The planner's range for this model and micro-batch, from a one-step auto probe.

    It also gives the budget at each fraction, and what auto and auto-no-outlier plan there: how
    many site decisions compress, and with which codecs (lossless bitmasks or lossy int4)."""
    from collections import Counter

    from megatron_adacc import cli, policies

    if not set(args.methods) & {"auto", "auto-no-outlier", "auto-lossy", "codecs",
                                "codecs-no-outlier"}:
        # no method plans or compresses by Adacc's codecs: nothing to profile for
        return {"minimum_feasible_budget": None, "no_optimisation_peak": None, "budgets": {},
                "forced_plans": {}}
    # one iteration of pretrain_gpt.py profiles the trainer's own model (kept in the DB)
    costs = cli.trainer_costs(flags + ["--seed", str(args.seeds[0])])
    result = policies.plan("auto", costs, 1 << 40, allow_lossy_sources=False)
    minimum = result.minimum_feasible_budget
    everything = result.references["no optimisation"].peak_bytes
    lossy_minimum = policies.plan("auto", costs, 1 << 40,
                                  allow_lossy_sources=True).minimum_feasible_budget

    def decisions(planned) -> dict:
        mix = Counter()
        for layer in planned.layer_decisions:
            for site, decision in layer.items():
                key = (decision.action if decision.action != "compress" else
                       f"compress:{decision.codec_for(site)}")
                mix[key] += 1
        return dict(mix)

    budgets = {}
    for fraction in args.budget_fractions:
        budget = int(minimum + fraction * (everything - minimum))
        lossy_budget = int(lossy_minimum + fraction * (everything - lossy_minimum))
        plans, plan_ids = {}, {}
        for policy in ("auto", "auto-no-outlier"):
            # as the policy plans in training: its own codecs, then its last resort
            planned = policies.plan(policy, costs, budget, allow_lossy_sources=False)
            plan_ids[policy] = planned.plan.plan_id
            plans[policy] = decisions(planned)
        plans["auto-lossy"] = decisions(policies.plan("auto", costs, lossy_budget,
                                                      allow_lossy_sources=True))
        budgets[str(fraction)] = {"budget_bytes": budget, "lossy_budget_bytes": lossy_budget,
                                  "plans": plans, "plan_ids": plan_ids,
                                  "same_plan": len(set(plan_ids.values())) == 1}
    # Adacc's codecs on every site (what quantize does with naive INT4): the accuracy of
    # layer-specific compression itself, whatever a budget makes the planner choose.
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import ABLATION_CODECS, COMPRESS, SITES

    forced = {}
    for name, no_outlier in (("codecs", False), ("codecs-no-outlier", True)):
        decisions = {}
        for site in (SITES[site_name] for site_name in bc.models.get(args.family).sites):
            if site.default_codec is None:  # never compressed (the log-sum-exp)
                continue
            codec = ABLATION_CODECS.get(site.default_codec) if no_outlier else None
            decisions[site.name] = Decision(COMPRESS, codec)
        path = os.path.join(args.workdir, f"plan-{name}.yaml")
        Plan.uniform(decisions).save(path)
        forced[name] = path
    return {"minimum_feasible_budget": minimum, "lossy_minimum_feasible_budget": lossy_minimum,
            "no_optimisation_peak": everything, "budgets": budgets, "forced_plans": forced}


def run(args, flags, policy: str, seed: int, fraction: float | None = None,
        budget: int | None = None, plan_file: str | None = None, extra: tuple = ()) -> dict:
    tag = policy if fraction is None else f"{policy}@{fraction}"
    metrics = os.path.join(args.workdir, f"{tag}-seed{seed}.jsonl")
    if os.path.exists(metrics):  # a resumed run appends to its metrics file
        os.remove(metrics)
    argv = [*flags, "--seed", str(seed), "--adacc-policy",
            plan_file or TRAINER_POLICY.get(policy, policy), "--metrics-file", metrics,
            *OWN_FLAGS.get(policy, ()), *extra]
    if budget is not None:
        argv += ["--adacc-memory-budget", str(budget)]
    log = os.path.join(args.workdir, f"{tag}-seed{seed}.log")
    began = time.perf_counter()
    with open(log, "w") as out:
        try:
            status = bc.pretrain_in_process(argv, out, out)
        except Exception:  # noqa: BLE001 - a run that breaks is a result
            traceback.print_exc(file=out)
            status = 1
    elapsed = time.perf_counter() - began
    base = {"policy": policy, "fraction": fraction, "tag": tag, "seed": seed, "wall_s": elapsed}
    if status != 0:
        with open(log) as handle:
            tail = handle.read().strip().splitlines()[-3:]
        print(f"  {tag} seed {seed}: FAILED ({' | '.join(tail)}; log {log})", flush=True)
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
    runs, stress = [], {}
    for seed in args.seeds:
        resume = ()
        if args.stress:
            trained = os.path.join(args.workdir, f"pretrained-seed{seed}")
            scaled = os.path.join(args.workdir, f"outlier-gains-seed{seed}")
            shutil.rmtree(trained, ignore_errors=True)
            runs.append(run(args, flags, "pretrain", seed, extra=(
                "--exit-interval", str(args.stress_pretrain), "--save", trained,
                "--save-interval", str(args.stress_pretrain))))
            if runs[-1].get("failed"):
                continue
            stress[seed] = scale_layernorm_gains(trained, scaled, args.stress_channels)
            print(f"  scaled the LayerNorm gains of channels {stress[seed]['channels']} by "
                  f"{[round(f, 1) for f in stress[seed]['factors']]} in "
                  f"{len(stress[seed]['tensors'])} tensors; every method continues from {scaled}",
                  flush=True)
            resume = ("--load", scaled)
        runs += method_runs(args, flags, probe, seed, resume)
    gaps: dict[str, list[float]] = {}
    for seed in args.seeds:
        base = next((r for r in runs if r["seed"] == seed and r["policy"] == "none"), None)
        for r in runs:
            if (base is None or r["seed"] != seed or r.get("failed") or base.get("failed")
                    or r["policy"] == "pretrain"):
                continue
            r["gap_pct"] = (100 * (r["final_val_loss"] - base["final_val_loss"])
                            / base["final_val_loss"])
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
               "naive_int4_gaps_pct": gaps.get("quantize"),
               "lossy_sources_gaps_pct": {t: g for t, g in gaps.items()
                                          if t.startswith("auto-lossy")},
               "megatron_full_recompute_gaps_pct": gaps.get("megatron-full-recompute"),
               "outlier_separation": outlier_separation_effect(runs, probe)}
    command = " ".join([os.path.join(".", "pretrain_gpt.py"), *flags])
    meta.update(finished=time.strftime("%Y-%m-%d %H:%M:%S"),
                wall_s=time.perf_counter() - began_run)
    data = {"run": meta, "flags": flags, "pretrain_command": command, "stress": stress,
            "probe": probe, "runs": runs, "gaps_pct": gaps, "targets": targets,
            "args": vars(args)}
    bc.write_json(data, args.out, args.publish or None)
    plot(runs, args)
    print(targets)


def method_runs(args, flags, probe, seed: int, resume: tuple) -> list[dict]:
    """Every method trained from ``seed``, and in the stress setting from ``resume``'s checkpoint.

    The methods: no optimisation, Adacc auto, auto-no-outlier and auto with lossy rebuild
    sources at each budget, Adacc's codecs
    on every site with and without outlier separation, and naive INT4. The stress setting adds
    megatron's full recompute, which is exact and shows the runs' own noise floor."""
    runs = [run(args, flags, "none", seed, extra=resume)]
    for fraction, entry in probe["budgets"].items():
        if "auto" in args.methods:
            runs.append(run(args, flags, "auto", seed, float(fraction), entry["budget_bytes"],
                            extra=resume))
        no_outlier = "auto-no-outlier" in args.methods
        if no_outlier and entry["same_plan"] and "auto" in args.methods:
            # The same plan trains bit for bit the same: reuse the auto run.
            runs.append(dict(runs[-1], policy="auto-no-outlier", tag=f"auto-no-outlier@{fraction}",
                             same_plan_as_auto=True))
            print(f"  auto-no-outlier @ {fraction}: the same plan as auto, not rerun")
        elif no_outlier:
            runs.append(run(args, flags, "auto-no-outlier", seed, float(fraction),
                            entry["budget_bytes"], extra=resume))
        if "auto-lossy" in args.methods:
            runs.append(run(args, flags, "auto-lossy", seed, float(fraction),
                            entry["lossy_budget_bytes"], extra=resume))
    for name, path in probe["forced_plans"].items():
        if name in args.methods:
            runs.append(run(args, flags, name, seed, plan_file=path, extra=resume))
    for name in ("quantize", "megatron-full-recompute"):
        if name in args.methods:
            runs.append(run(args, flags, name, seed, extra=resume))
    return runs


# The paper's ablation: outlier separation lowers the final loss by 0.2% to 0.7% against
# Adacc without it.
PAPER_OUTLIER_EFFECT_PCT = 0.2


def outlier_separation_effect(runs: list[dict], probe: dict) -> dict:
    """How much lower the final validation loss is with outlier separation, per pair and seed.

    The pairs are Adacc auto and auto-no-outlier at a budget, and Adacc's codecs on every site
    with and without outlier separation. The effect is in % of the loss without separation, with
    whether it reaches the paper's 0.2%. A pair whose two plans are the same has no effect to
    show (None)."""
    pairs = [(f"auto@{f}", f"auto-no-outlier@{f}", entry["same_plan"])
             for f, entry in probe["budgets"].items()]
    pairs.append(("codecs", "codecs-no-outlier", False))
    out = {}
    for with_tag, without_tag, same_plan in pairs:
        for seed in sorted({r["seed"] for r in runs}):
            pick = {r["tag"]: r for r in runs if r["seed"] == seed and not r.get("failed")}
            if with_tag not in pick or without_tag not in pick:
                continue
            without = pick[without_tag]["final_val_loss"]
            effect = (None if same_plan else
                      100 * (without - pick[with_tag]["final_val_loss"]) / without)
            out[f"{with_tag} vs {without_tag}, seed {seed}"] = {
                "lower_loss_pct": effect, "same_plan": same_plan,
                "reaches_paper_0_2pct": None if effect is None else
                effect >= PAPER_OUTLIER_EFFECT_PCT}
    return out


def scale_layernorm_gains(source: str, dest: str, channels: int) -> dict:
    """Copy the newest checkpoint under ``source`` to ``dest``, some LayerNorm gains scaled.

    The layout is Megatron-LM's: ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/`` in
    dist_checkpointing's torch_dist format. The gains of ``channels`` residual channels are
    multiplied in every decoder layer's LayerNorms, by factors spread evenly over
    STRESS_GAIN_RANGE. The channels are drawn from a fixed generator, not chosen."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from pathlib import Path

    tracker = "latest_checkpointed_iteration.txt"   # Megatron-LM's layout
    iteration = int(Path(source, tracker).read_text().strip())
    folder = Path(source, f"iter_{iteration:07d}")
    target = Path(dest, f"iter_{iteration:07d}")
    shutil.rmtree(dest, ignore_errors=True)
    # Every entry, rewritten whole. The layers' gains are stacked tensors, one row per
    # layer, under the names megatron shares with Transformer Engine's fused layers
    # (decoder.layers.<linear>.layer_norm_weight), and a 16-bit model's fp32 main copies
    # of them are scaled alike.
    state = _load_state_dict_from_keys(checkpoint_id=str(folder))
    gains = sorted(k for k in state if k.endswith(".layer_norm_weight") and k.startswith(
        ("decoder.layers.", "optimizer.state.fp32_param.decoder.layers.")))
    if not gains:
        raise SystemExit(f"no LayerNorm gains under {folder}")
    hidden = state[gains[0]].shape[-1]
    chosen = torch.randperm(hidden, generator=torch.Generator().manual_seed(0))[:channels]
    factors = torch.linspace(*STRESS_GAIN_RANGE, channels)
    for key in gains:
        state[key][..., chosen] *= factors.to(state[key].dtype)
    # Unflattened: megatron's objects (lists) stay one entry each, as megatron wrote them.
    dcp.save(state, checkpoint_id=str(target), no_dist=True,
             planner=DefaultSavePlanner(flatten_state_dict=False))
    # megatron's own files beside DCP's (metadata.json; common.pt before megatron-core 0.19)
    for megatron_file in folder.iterdir():
        if megatron_file.name != ".metadata" and megatron_file.suffix != ".distcp":
            shutil.copy(megatron_file, target / megatron_file.name)
    with open(os.path.join(dest, tracker), "w") as f:
        f.write(f"{iteration}\n")
    return {"iteration": iteration, "channels": chosen.tolist(), "factors": factors.tolist(),
            "tensors": gains}


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
    setting = "outlier stress setting, " if args.stress else ""
    fig.suptitle(f"Validation loss, KJV byte-level ({setting}"
                 f"{'--quick' if args.quick else 'full'})",
                 fontsize=9)
    bc.save_figure(fig, args.figure)


if __name__ == "__main__":
    main()
