"""Writes docs/results.md from the JSON the evaluation benchmarks publish under docs/results/
(bench_throughput.py, bench_max_batch.py, bench_accuracy.py, and bench_codecs.py as
codecs_avx512.json and codecs_avx2.json, and codecs_epyc_*.json from an AMD EPYC). Every
number on the page comes from those files; rerun the suite (scripts/run_all_benchmarks.sh)
and then this script.

    python scripts/make_results_page.py [--out docs/results.md]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex

from megatron_adacc.codecs.native import host

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")
MIB = 2 ** 20

METHODS = ("no optimisation", "megatron full recompute", "megatron block recompute",
           "megatron selective recompute",
           "naive INT4", "torch.compile + memory budget", "adacc auto")
SHORT = {"no optimisation": "none", "megatron full recompute": "full recompute",
         "megatron block recompute": "block recompute",
         "megatron selective recompute": "selective recompute", "naive INT4": "naive INT4",
         "torch.compile + memory budget": "torch.compile", "adacc auto": "Adacc auto"}


def load(name: str) -> dict | None:
    path = os.path.join(RESULTS, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def verdict(ok) -> str:
    return "not measured" if ok is None else ("**met**" if ok else "**missed**")


def mode_note(data: dict) -> str:
    run = data["run"]
    load_avg = ", ".join(f"{x:.1f}" for x in run.get("load_average", []))
    mode = ("**--quick mode** (small shape, few rounds: a smoke run, not evidence)"
            if run["quick"] else "full mode")
    took = f", took {run['wall_s'] / 60:.1f} min" if "wall_s" in run else ""
    cpus = f", {run['cpus']} CPUs" if "cpus" in run else ""
    environment = "".join(f"{name}={shlex.quote(value)} "
                          for name, value in run.get("environment", {}).items())
    return (f"{mode}; {run['started']}{took}; machine: {run['device']}{cpus}, torch "
            f"{run['torch']} with {run['threads']} threads, load average {load_avg} at the "
            f"start.\n\nCommand: `{environment}{run['command']}`")


def throughput_section(data: dict, attention: str, number: str, tag: str = "") -> list[str]:
    # the family (not GPT's) and the kernels' path, as the targets name them
    who = f"{tag.lstrip('_').replace('_', ' ')} {attention}".strip()
    out = [f"### {number} Throughput under a memory budget ({attention} attention)", "",
           "Paper: Adacc has the best throughput of its counterparts, 1.01x-1.37x over full "
           "recomputation, and adds nothing when memory is ample (Figure \"throughput\").", "",
           mode_note(data), "",
           f"Model: {describe(data['shape'])}. Static bytes (parameters, gradients, AdamW "
           f"state): {data['static_bytes'] / MIB:.1f} MiB. `budget@k` = static + the stock "
           f"model's measured activation peak at micro-batch k: no optimisation fits up to k.",
           "", f"![throughput, {attention}](figures/throughput{tag}_{attention}.png)", ""]
    for name, budget in data["budgets"].items():
        out += [f"#### {name}: {budget / MIB:.1f} MiB", "",
                "| micro-batch | " + " | ".join(SHORT[m] for m in METHODS
                                               if any(m in r for r in data["rows"][name].values()))
                + " |",
                "|---|" + "---|" * sum(1 for m in METHODS
                                       if any(m in r for r in data["rows"][name].values()))]
        for micro, methods in data["rows"][name].items():
            cells = []
            for m in METHODS:
                if not any(m in r for r in data["rows"][name].values()):
                    continue
                r = methods.get(m)
                if r is None:
                    cells.append("-")
                elif r["fits"]:
                    detail = r.get("detail", "")
                    if m == "adacc auto" and r.get("mix"):
                        detail = "/".join(f"{r['mix'].get(a, 0)}" for a in
                                          ("retain", "compress", "recompute"))
                        detail = f"r/c/rc {detail}"
                    cells.append(f"{r['tokens_per_s']:.0f} tok/s, {r['memory_bytes'] / MIB:.1f} MiB"
                                 + (f" ({detail})" if detail else ""))
                else:
                    mem = r.get("memory_bytes")
                    cells.append("does not fit" + (f" ({mem / MIB:.1f} MiB)" if mem else ""))
            out.append(f"| {micro} | " + " | ".join(cells) + " |")
        out.append("")
    t = data["summary"]["targets"]
    out += ["Adacc against each method where no optimisation does not fit (tokens/s ratio "
            "from wall-time medians; >1: Adacc faster), and against no optimisation where it "
            "fits (CPU time paired per round):", ""]
    out += [f"- {line}" for line in data["summary"]["lines"]]
    worst_fitting = t.get("min_vs_fitting_method")
    out += ["", "Targets:", "",
            target(f"{who} throughput: ahead of every method that fits, at every budget "
                   "where no optimisation does not fit",
                   t["ahead_of_every_method_where_none_does_not_fit"],
                   "; ".join([*([] if worst_fitting is None else
                                [f"worst Adacc / method {worst_fitting:.3f}x"]),
                              *t.get("adacc_does_not_fit_where_others_do", [])]) or None),
            target(f"{who} throughput: >= 1.15x Megatron full recompute there",
                   t["full_recompute_target_1_15"],
                   None if t["min_vs_full_recompute"] is None
                   else f"worst {t['min_vs_full_recompute']:.3f}x"),
            target(f"{who} throughput, memory ample: Adacc within 2% of no optimisation "
                   "(CPU time, median of per-round ratios)", t["ample_within_2pct"],
                   None if t["worst_ample_gap"] is None
                   else f"worst Adacc / none {t['worst_ample_gap']:.3f}"), ""]
    if data.get("compile_errors"):
        out += [f"torch.compile failures: {data['compile_errors']}", ""]
    return out


def max_batch_section(data: dict, attention: str, number: str, tag: str = "") -> list[str]:
    who = f"{tag.lstrip('_')} {attention}".strip()
    out = [f"### {number} Maximum micro-batch under a budget ({attention} attention)", "",
           "Paper (Table \"Maximum batch size\"): Adacc always reaches the largest batch, equal "
           "to full recomputation and 2.38x-7.62x no optimisation.", "", mode_note(data), "",
           f"Model: {describe(data['shape'])}.", "",
           f"![max batch, {attention}](figures/max_batch{tag}_{attention}.png)", ""]
    methods = [m for m in METHODS if any(m in r["methods"] for r in data["results"].values())]
    out += ["| budget | " + " | ".join(SHORT[m] for m in methods)
            + " | Adacc / none | Adacc / full recompute |",
            "|---|" + "---|" * (len(methods) + 2)]
    for name, r in data["results"].items():
        cells = []
        for m in methods:
            entry = r["methods"].get(m)
            if entry is None:
                cells.append("-")
                continue
            cell = str(entry["max_micro_batch"])
            if m in ("megatron selective recompute", "megatron block recompute"):
                cell += f" ({entry['detail']})"
            if entry.get("error"):
                cell += f" (error: {entry['error']})"
            cells.append(cell)
        ratio = lambda v: f"{v:.2f}x" if v else "-"  # noqa: E731
        out.append(f"| {name} ({r['budget_bytes'] / MIB:.1f} MiB) | " + " | ".join(cells)
                   + f" | {ratio(r['adacc_vs_none'])} | {ratio(r['adacc_vs_full_recompute'])} |")
    t = data["targets"]
    ahead = ", ".join(f"{k} ({v})" for k, v in t["methods_ahead_of_adacc"].items())
    ratio = lambda v: None if v is None else f"worst {v:.2f}x"  # noqa: E731
    out += ["", "Targets (issue 15: flash, Adacc >= every other method and >= 1.5x full "
            "recompute; unfused, Adacc >= naive INT4; the paper: >= full recompute and >= "
            "2.38x no optimisation):", ""]
    if attention == "flash":
        out += [target(f"{who} max micro-batch: Adacc >= every other method",
                       t["adacc_ge_every_method"], f"ahead of Adacc: {ahead}" if ahead else None),
                target(f"{who} max micro-batch: Adacc >= 1.5x full recompute",
                       t["adacc_ge_1_5x_full_recompute"], ratio(t["min_adacc_vs_full_recompute"]))]
    else:
        out += [target(f"{who} max micro-batch: Adacc >= naive INT4", t["adacc_ge_naive_int4"],
                       f"ahead of Adacc: {ahead}" if ahead else None)]
    out += [target(f"{who} max micro-batch: Adacc >= full recompute",
                   t["adacc_ge_full_recompute"], ratio(t["min_adacc_vs_full_recompute"])),
            target(f"{who} max micro-batch: Adacc >= 2.38x no optimisation",
                   t["adacc_ge_2_38x_none"], ratio(t["min_adacc_vs_none"])), ""]
    return out


def accuracy_section(data: dict, title: str) -> list[str]:
    labels = {"none": "no optimisation", "auto": "Adacc auto",
              "auto-no-outlier": "Adacc w/o outlier separation", "quantize": "naive INT4",
              "codecs": "Adacc's codecs on every site",
              "codecs-no-outlier": "Adacc's codecs w/o outlier separation, every site",
              "megatron-full-recompute": "Megatron full recompute",
              "pretrain": "normal training before the outlier gains (no optimisation)"}
    seeds = data["args"]["seeds"]
    probe = data["probe"]
    stress = data["args"].get("stress")
    out = [f"## {title}", "",
           "Paper (Figure \"loss\", downstream table): Adacc's loss is within 0.46%-0.5% of no "
           "optimisation; naive INT4 fails to converge late in training; outlier separation "
           "lowers the loss by 0.2%-0.7% against Adacc without it.", "", mode_note(data), "",
           f"Trainer command (per run, plus `--seed S --adacc-policy P --metrics-file F`, and "
           f"`--adacc-memory-budget B` for the Adacc runs): `{data['pretrain_command']}`. "
           "Attention: the trainer's default `--attention-backend auto`, which on the CPU "
           "is the unfused attention with attention dropout 0.1 (GPT-2's setting) and flash "
           "at attention dropout 0 (the Llama family's).", ""]
    if stress:
        a = data["args"]
        for seed, s in data["stress"].items():
            out += [f"**Stress setting (not the plain runs above).** Seed {seed}: trained "
                    f"normally (no optimisation) for {a['stress_pretrain']} of {a['iters']} "
                    f"iterations (`--exit-interval {a['stress_pretrain']} --save`); in that "
                    f"checkpoint the LayerNorm gains of channels {s['channels']} were multiplied "
                    f"by {', '.join(f'{f:.1f}' for f in s['factors'])} in every layer's two "
                    f"LayerNorms ({len(s['tensors'])} tensors), as large trained LLMs carry a "
                    f"few outlier channels; every method below continues from that checkpoint "
                    f"(`--load`) to iteration {a['iters']}. Megatron's full recompute is exact, so "
                    f"its gap shows whether the runs are deterministic (0: every other gap is "
                    f"the method's own).", ""]
    out += [
           f"Adacc budgets: fractions of the way from the planner's smallest feasible budget "
           f"({probe['minimum_feasible_budget'] / MIB:.1f} MiB) to no optimisation "
           f"({probe['no_optimisation_peak'] / MIB:.1f} MiB). What the plans do there "
           f"(site decisions over all layers):", ""]
    for fraction, entry in probe["budgets"].items():
        for policy, mix in entry["plans"].items():
            text = ", ".join(f"{k} {v}" for k, v in sorted(mix.items()))
            out.append(f"- budget {fraction} ({entry['budget_bytes'] / MIB:.1f} MiB), "
                       f"{labels[policy]}: {text}")
        if entry.get("same_plan"):
            out.append(f"- budget {fraction}: both policies make the same plan, so the "
                       f"w/o-outlier run is the auto run (not rerun)")
    out += ["", "The two \"codecs on every site\" rows compress every site with Adacc's "
            "layer-specific codecs (with and without outlier separation), as naive INT4 does "
            "with one codec: they measure the codecs' effect on the loss whatever a budget "
            "makes the planner choose.", "",
            f"![validation loss](figures/{data['args']['figure']})", "",
            "| method | " + " | ".join(f"seed {s}: final val loss (gap)" for s in seeds)
            + " | activation bytes |", "|---|" + "---|" * (len(seeds) + 1)]
    tags = []
    for r in data["runs"]:
        if r["tag"] not in tags:
            tags.append(r["tag"])
    for tag in tags:
        cells, act, name = [], "-", tag
        for seed in seeds:
            r = next((r for r in data["runs"] if r["tag"] == tag and r["seed"] == seed), None)
            if r is None:
                cells.append("-")
                continue
            name = labels[r["policy"]] + ("" if r.get("fraction") is None
                                          else f" @ budget {r['fraction']}")
            if r.get("failed"):
                cells.append("failed: " + " ".join(r.get("error", [])))
                continue
            gap = r.get("gap_pct")
            cells.append(f"{r['final_val_loss']:.4f}"
                         + (f" ({gap:+.2f}%)" if gap is not None and r["policy"] != "none"
                            else ""))
            act = f"{r['activation_bytes'] / MIB:.1f} MiB" if r.get("activation_bytes") else act
        out.append(f"| {name} | " + " | ".join(cells) + f" | {act} |")
    t = data["targets"]
    fmt = lambda gaps: ", ".join(f"{g:+.2f}%" for g in gaps) if gaps else "-"  # noqa: E731
    auto = {k: v for k, v in data["gaps_pct"].items() if k.startswith("auto@")}
    setting = ("stress" if stress else "plain") + (
        "" if data["args"].get("family", "gpt") == "gpt" else f", {data['args']['family']}")
    out += ["", "Targets:", "",
            target(f"accuracy ({setting}): Adacc within 0.5% of no optimisation (every seed "
                   "and budget)", t["adacc_within_0_5pct"],
                   "; ".join(f"{k}: {fmt(v)}" for k, v in auto.items())),
            f"- Reported ({setting}): naive INT4 gap {fmt(t['naive_int4_gaps_pct'])}; Adacc "
            f"without outlier separation " + "; ".join(f"{k}: {fmt(v)}" for k, v in
                                                       (t["no_outlier_gaps_pct"] or {}).items())
            + f"; Adacc's codecs on every site {fmt(t.get('codecs_gaps_pct'))}, without "
            f"outlier separation {fmt(t.get('codecs_no_outlier_gaps_pct'))}"
            + (f"; Megatron full recompute {fmt(t['megatron_full_recompute_gaps_pct'])}"
               if t.get("megatron_full_recompute_gaps_pct") else "") + "."]
    for pair, effect in (t.get("outlier_separation") or {}).items():
        shown = ("the two policies make the same plan: no difference to show"
                 if effect["same_plan"] else
                 f"outlier separation lowers the final loss by {effect['lower_loss_pct']:+.2f}%")
        out.append(target(f"outlier separation ({setting}), {pair}: the paper's >= 0.2% lower "
                          "loss", effect["reaches_paper_0_2pct"], shown))
    return out + [""]


def describe(shape: dict) -> str:
    attention_dropout = 0.0 if shape["attention"] == "flash" else shape["dropout"]
    family = shape.get("family", "gpt")
    family = "" if family == "gpt" else (
        f"{family} family ({shape['query_groups']} query groups, ffn "
        f"{shape['ffn'] or 'the family default'}), ")
    return (f"{family}{shape['attention']} attention, {shape['layers']} layers, hidden "
            f"{shape['hidden']}, {shape['heads']} heads, seq {shape['seq']}, vocab "
            f"{shape['vocab']}, hidden dropout {shape['dropout']}, attention dropout "
            f"{attention_dropout}, fp32 on CPU")


# The codec benchmark's home input of each codec (scripts/bench_codecs.py check_targets).
CODEC_HOMES = {"asym_int4": ("softmax_probs",), "bitmask": ("dropout_mask_bool",)}
# Each build on each CPU at hand (the CPUs differ: issue 26 asks for both vector paths on
# both makes); a column is headed by the CPU its file records.
CODEC_BUILDS = (("codecs_avx512.json", "as built (`-march=native`)", ""),
                ("codecs_avx2.json", "the AVX2 path", "ADACC_NATIVE_CFLAGS=-mno-avx512f "),
                ("codecs_epyc_avx512.json", "as built (`-march=native`)", ""),
                ("codecs_epyc_avx2.json", "the AVX2 path", "ADACC_NATIVE_CFLAGS=-mno-avx512f "),
                ("codecs_epyc_f25_avx512.json", "as built (`-march=native`)", ""),
                ("codecs_epyc_f25_avx2.json", "the AVX2 path", "ADACC_NATIVE_CFLAGS=-mno-avx512f "))
OUTLIER_ROUND_TRIP_TARGET = 0.45  # issue 26: of a plain copy, native backend, AVX2 and AVX-512


def cpu_name(cpu: dict) -> str:
    """The CPU a codec run records, as the profiles name it (host.HostCpu.describe): with its
    family and model numbers where it has them (runs before they were recorded give the model
    name alone)."""
    return host.HostCpu(cpu["model"], cpu.get("cpu_family"), cpu.get("model_number")).describe()


def codec_round_trip(r: dict) -> float:
    """bench_codecs.round_trip_per_copy: CPU time paired per round for one thread."""
    return r["roundtrip_per_copy_cpu"] if r["threads"] == 1 else r["roundtrip_per_copy_paired"]


def codecs_section(builds: list[tuple[str, str, dict]]) -> list[str]:
    """Round trip of each codec against a plain copy (scripts/bench_codecs.py, native backend,
    4096x4096 synthetic inputs, freed memory recycled), one column per CPU and vector path."""
    out = ["## 6. Codec speed (native CPU kernels)", "",
           "Round trip (encode + decode) as a fraction of a plain copy of the same bytes into an "
           "existing tensor, on 4096x4096 synthetic inputs with freed memory recycled as in a "
           "training step (`scripts/bench_codecs.py`): the median over 5 interleaved rounds of "
           "each round's ratio, in process CPU time for one thread (time spent preempted by "
           "other jobs does not count), with the medians of the wall-clock throughputs beside "
           "it. Commands:", ""]
    for name, label, env in CODEC_BUILDS:
        data = next((d for n, _, d in builds if n == name), None)
        if data is not None:
            cfg, machine = data["config"], data["machine"]
            threads = f" --threads {cfg['threads']}" if cfg.get("threads") else ""
            load_avg = ", ".join(f"{x:.1f}" for x in machine.get("load_average_at_start", []))
            out.append(f"- {label}: `{env}.venv/bin/python scripts/bench_codecs.py --backends "
                       f"{','.join(cfg['backends'])}{threads}` on {cpu_name(machine['cpu'])} "
                       f"(vector path `{machine['cpu']['native_vector_isa']}`, load average "
                       f"at start {load_avg or 'not recorded'})")
    out += ["", "| codec | input | dtype | " + " | ".join(label for _, label, _ in builds) + " |",
            "|---|---|---|" + "---|" * len(builds)]
    rows = [r for _, _, d in builds for r in d["results"] if r["suite"] == "synthetic"]
    memory = "recycled" if any(r["memory"] == "recycled" for r in rows) else "fresh"
    keys = sorted({(r["codec"], r["site"], r["dtype"]) for r in rows
                   if r["site"] in CODEC_HOMES.get(r["codec"], ("heavy_tailed_outliers",))})
    for codec, site, dtype in keys:
        cells = []
        for _, _, data in builds:
            r = next((r for r in data["results"]
                      if (r["suite"], r["memory"], r["codec"], r["site"], r["dtype"])
                      == ("synthetic", memory, codec, site, dtype)), None)
            cells.append("-" if r is None else f"{codec_round_trip(r):.2f} (medians: enc "
                         f"{r['encode_gbps']:.1f}, dec {r['decode_gbps']:.1f}, "
                         f"copy {r['copy_gbps']:.1f} GB/s)")
        out.append(f"| {codec} | {site} | {dtype[6:]} | " + " | ".join(cells) + " |")
    out.append("")
    for _, label, data in builds:
        r = next(r for r in data["results"]
                 if (r["suite"], r["memory"], r["codec"], r["site"], r["dtype"])
                 == ("synthetic", memory, "outlier_int4", "heavy_tailed_outliers",
                     "torch.bfloat16"))
        fraction = codec_round_trip(r)
        out.append(target(f"outlier_int4 round trip >= {OUTLIER_ROUND_TRIP_TARGET} of a copy, "
                          f"bf16, {label}",
                          fraction >= OUTLIER_ROUND_TRIP_TARGET, f"{fraction:.2f}"))
    return out + [""]


# Every target line of the page, also printed by main.
TARGETS: list[str] = []


def target(what: str, ok, reached: str | None) -> str:
    line = f"- {what}: {verdict(ok)}" + (f" ({reached})." if reached else ".")
    TARGETS.append(line)
    return line


HEADER = """# Evaluation results (issues 7 and 15)

Generated by `scripts/make_results_page.py` from `docs/results/*.json`; do not edit by hand
(the prose that is not generated is `docs/results/notes.md`). Regenerate everything (full
mode, meant for an otherwise idle 2-core machine; about 45 minutes):

    scripts/run_all_benchmarks.sh          # or --quick for a few minutes
    # which runs, for A in flash unfused:
    .venv/bin/python scripts/bench_throughput.py --attention-backend A
    .venv/bin/python scripts/bench_max_batch.py --attention-backend A
    # then
    .venv/bin/python scripts/bench_accuracy.py
    .venv/bin/python scripts/bench_accuracy.py --stress
    .venv/bin/python scripts/make_results_page.py

Flash runs use attention dropout 0 for every method (PyTorch's CPU flash kernel has no
dropout, and modern GPT recipes train without it); unfused runs keep attention dropout 0.1.
Hidden dropout is 0.1 in both.

Raw JSON goes to `bench_results/` (git-ignored) with a copy under `docs/results/`; figures to
`docs/figures/`.

## How memory is measured (every method alike)

A method *fits* a budget when static bytes (parameters, gradients, fp32 AdamW moments, as
`hardware.engine_static_bytes` reads them off megatron's engine) plus the activation peak of one \
training step measured by
the `ActivationRuler` is at most the budget. The ruler counts every storage saved for backward
once while it is alive, plus values rebuilt or decoded during backward: megatron's full and
selective recompute are seen as their re-run forward saves; Adacc plans as payloads and
transients. The torch.compile peer compiles each transformer layer with inductor while
`torch._functorch.config.activation_memory_budget` is set to a fraction (0 = recompute as
much as the partitioner allows); its AOT graphs save through autograd, so the same ruler's
saved-tensor hook counts their saved storages (checked: the compiled layers' count falls as the
fraction falls). The ruler's per-site attribution hooks are left off for it, because module
hooks make dynamo recompile every step. The fraction searched is the fastest one that fits.
The ruler does not see the gradient working set of a layer's backward for any method; Adacc's
planner models that workspace, so the benchmarks plan Adacc with it set to zero, i.e. against
the same yardstick.

Megatron selective recompute is tried with every `recompute_modules` set that runs on this
layer spec, on both attentions (`core_attn`, `layernorm`, both); `mlp` is excluded because \
with biased linear
layers its backward recurses forever in megatron-core 0.16.1 (a known defect, see DESIGN.md).
"""


# The page's parts, in order: flash attention first (what a user facing a memory wall turns
# on first), then the unfused attention of the published GPT-2 setting, then accuracy.
PARTS = (
    ("## 1. Flash attention (SDPA, attention dropout 0 for every method)", (
        ("throughput_flash.json", lambda d: throughput_section(d, "flash", "1a.")),
        ("max_batch_flash.json", lambda d: max_batch_section(d, "flash", "1b.")))),
    ("## 2. Unfused attention (megatron-core's local attention, attention dropout 0.1)", (
        ("throughput_unfused.json", lambda d: throughput_section(d, "unfused", "2a.")),
        ("max_batch_unfused.json", lambda d: max_batch_section(d, "unfused", "2b.")))),
    (None, (("accuracy.json", lambda d: accuracy_section(d, "3. Accuracy: validation loss")),)),
    (None, (("accuracy_stress.json", lambda d: accuracy_section(
        d, "4. Accuracy, outlier stress setting (LayerNorm gains scaled up on a few channels)")),)),
    ("## 5. The Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention, no dropout; "
     "flash attention)", (
        ("throughput_llama_flash.json",
         lambda d: throughput_section(d, "flash", "5a.", "_llama")),
        ("max_batch_llama_flash.json",
         lambda d: max_batch_section(d, "flash", "5b.", "_llama")),
        ("accuracy_llama.json", lambda d: accuracy_section(
            d, "5c. Accuracy of the Llama family: validation loss")))),
)
# After the codecs (6.): issue 26 asks for its throughput targets on an AVX2 CPU and an AVX-512
# one; with no AVX2-only CPU at hand, an AVX-512 one runs every kernel on its AVX2 path (the
# run's environment, printed with its command, says how).
AVX2_PARTS = (
    ("## 7. The AVX2 path (the same runs with every kernel of a step on AVX2: PyTorch's, MKL's, "
     "oneDNN's and Adacc's native codecs)", (
        ("throughput_avx2_flash.json", lambda d: throughput_section(d, "flash", "7a.", "_avx2")),
        ("throughput_llama_avx2_flash.json",
         lambda d: throughput_section(d, "flash", "7b.", "_llama_avx2")))),
)


def timing_section(took: list[tuple[str, dict]]) -> list[str]:
    """How long each part of the suite took, from the runs' own clocks."""
    out = ["## How long each part took", "",
           "Each part's own clock, from after its imports (starting the interpreter and "
           "importing megatron add 10-20 s per part; `scripts/run_all_benchmarks.sh` prints "
           "each part's whole wall time).", "",
           "| part | mode | started | minutes | threads | load average at start |",
           "|---|---|---|---|---|---|"]
    total = 0.0
    for name, run in took:
        minutes = run.get("wall_s", 0) / 60
        total += minutes
        out.append(f"| `{name}` | {'--quick' if run['quick'] else 'full'} | {run['started']} | "
                   f"{minutes:.1f} | {run['threads']} | "
                   f"{', '.join(f'{x:.1f}' for x in run.get('load_average', []))} |")
    out += [f"| total | | | {total:.1f} | | |", ""]
    return out


def engine_section(data: dict) -> list[str]:
    """scripts/bench_engine.py: megatron's engine at DP=2 on gloo (no target on a CPU)."""
    shape = data["shape"]
    out = ["## Megatron's engine: overlapped bucketed gradient reduction at DP=2 (gloo)", "",
           f"`{data['command']}`: {shape['layers']} layers, hidden {shape['hidden']}, sequence "
           f"{shape['seq']}, global batch {shape['global_batch']} in micro-batches of "
           f"{shape['micro_batch']}, buckets of {shape['bucket_size']:,} elements with "
           f"--overlap-grad-reduce; median step time over {data['rounds']} interleaved rounds "
           f"of {data['iters']} steps (the first of each dropped). A CPU over gloo has no "
           "separate engine to overlap communication with: this shows the mechanism runs, on "
           "the same losses, not a speed-up.", "",
           "| run | buckets | step time | vs one reduction | largest relative loss gap |",
           "|---|---|---|---|---|"]
    base = data["rows"]["one reduction"]["median_step_time_s"]
    for name, row in data["rows"].items():
        out.append(f"| {name} | {row['buckets']} | {row['median_step_time_s'] * 1e3:.1f} ms | "
                   f"{row['median_step_time_s'] / base:.2f}x | "
                   f"{row['max_relative_loss_gap']:.1e} |")
    return out + [""]


def render_parts(parts, lines: list[str], took: list[tuple[str, dict]]) -> None:
    """Each part's heading and its sections, from the published JSON they name (a section not
    run yet says so); each run's record goes to ``took``."""
    for heading, sections in parts:
        if heading:
            lines += [heading, ""]
        for name, section in sections:
            data = load(name)
            if data is None:
                lines += [f"### {name}: not run yet", ""]
                continue
            took.append((name, data["run"]))
            lines += section(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "results.md"))
    args = parser.parse_args()
    lines = [HEADER]
    took = []
    render_parts(PARTS, lines, took)
    builds = [(name, f"{cpu_name(data['machine']['cpu'])}, {label}", data)
              for name, label, _ in CODEC_BUILDS if (data := load(name)) is not None]
    if builds:
        lines += codecs_section(builds)
    render_parts(AVX2_PARTS, lines, took)
    quick = any(run["quick"] for _, run in took)
    engine = load("engine.json")
    if engine is not None:
        lines += engine_section(engine)
    lines += timing_section(took)
    notes = os.path.join(RESULTS, "notes.md")
    if os.path.exists(notes):
        lines += ["## Why targets are missed, and what is not measured", "",
                  open(notes).read().strip(), ""]
    if quick:
        lines.insert(1, "> **These are --quick results** from a loaded shared machine: they "
                        "show the suite runs end to end, not the claims. Rerun the full suite on "
                        "an idle machine before quoting any number.\n")
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    print("Targets:")
    for line in TARGETS:
        print(line)


if __name__ == "__main__":
    main()
