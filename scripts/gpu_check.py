"""Check on a CUDA machine what the CPU test suite cannot, in one command.

    python scripts/gpu_check.py [--config configs/gpt-345m.yaml] [--micro-batch-size 4]
        [--iters 30] [--checks codecs exactness training] [--out gpu_check.json]
        [--doc docs/gpu.md]

1. codecs: Triton payloads and decoded tensors byte-identical to the PyTorch reference, for
   every codec, in fp32, bf16 and fp16 and several shapes, and of a view's strided rows; and
   each Triton codec's round trip on a large activation against a plain copy on the GPU;
2. exactness: retain and recompute plans (segment re-runs and operator-level rebuilds)
   bitwise equal to megatron's stock layer, GPT and Llama layers, unfused and flash attention,
   in bf16 and fp16 with dropout on, attribution strict; host synchronisations per training
   step of those and of two compress plans, counted with torch.cuda.set_sync_debug_mode;
3. memory: `pretrain_gpt.py --adacc-policy auto` for --iters steps at three budgets between
   the smallest the planner accepts and what no optimisation needs: the allocator's peak must
   stay at or under each budget; the planner's predicted peak (`adacc plan` on the same
   ProfileDB) is reported beside it;
4. throughput: tokens/s of those runs against no optimisation and megatron's full and
   selective recompute, all at the same micro-batch; each run's last step traced with
   PyTorch's profiler (--profile --use-pytorch-profiler): its wall time, the time its CUDA
   kernels ran, its host synchronisations and its longest kernels.

Writes the results as JSON and as a Markdown page after each check (what a cut-off run did
is kept); --checks runs some of them. Without CUDA it says so and exits 0. Exit status 1 when
a check fails.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# cuBLAS needs this before CUDA starts to run deterministically (the exactness check compares
# two separately trained models, so every kernel must be run-to-run reproducible).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CODEC_SHAPES = [(4097,), (333, 70), (64, 1024), (4, 8, 128, 128)]
# and a view whose rows lie a stride apart, read in place (Kernels.strided_rows): the gate
# half of a SwiGLU fc1 output of this shape
GATE_HALF_OF = (64, 4, 2 * 640)
# Budgets this far from the planner's smallest feasible budget to the allocator's peak with
# no optimisation: the range where Adacc has to choose.
BUDGET_FRACTIONS = (0.75, 0.5, 0.25)
CHECKS = ("codecs", "exactness", "training")
# One large activation (a GPT-345M micro-batch of 8's fc1 output in size) for the speed table.
SPEED_SHAPE = (8, 1024, 4096)
SPEED_REPEATS = 20
# Megatron's dynamic loss scale starts at 2**32 and halves on each fp16 overflow after the
# first two: a run of tens of iterations from there skips every optimizer step, and its
# allocator peak never holds Adam's states. Started here, the steps are taken.
INITIAL_LOSS_SCALE = 4096
RUN_TIMEOUT_S = 150
TOP_KERNELS = 8
# CUDA runtime calls that wait for the device
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync")  # one training run or plan: a hung run is reported, not waited on
WARMUP_ITERS = 5  # left out of the tokens/s medians (profiling, first rectifier iterations)
SYNC_WARNING = "synchronizing CUDA operation"


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt-345m.yaml"))
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--doc", default=os.path.join(ROOT, "docs", "gpu.md"))
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    args = parser.parse_args(argv)
    args.config = os.path.abspath(args.config)  # the training runs start in ROOT
    return args


# --- 1. codecs ------------------------------------------------------------------------------

def _codec_input(name: str, shape, dtype, gen) -> torch.Tensor:
    if name == "bitmask":  # a dropout mask: bool on CUDA, 0 and 1/(1-p) in a float dtype
        keep = torch.rand(shape, generator=gen, device="cuda") >= 0.1
        return keep if dtype == torch.bool else keep.to(dtype) / 0.9
    x = torch.randn(shape, generator=gen, device="cuda") * 4
    if x.shape[-1] > 8:
        x[..., 5] *= 80  # an outlier channel
    x.view(-1)[[3, 10]] = torch.tensor([float("nan"), float("-inf")], device="cuda")
    return (torch.sigmoid(x) if name == "asym_int4" else x).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def check_codecs() -> dict:
    from megatron_adacc import codecs

    gen = torch.Generator(device="cuda").manual_seed(0)
    cases, mismatches = 0, []
    for name in codecs.NAMES:
        reference, triton = codecs.get(name, backend="torch"), codecs.get(name, backend="triton")
        dtypes = list(FLOAT_DTYPES.values()) + ([torch.bool] if name == "bitmask" else [])
        for dtype in dtypes:
            for shape in [*CODEC_SHAPES, GATE_HALF_OF]:
                x = _codec_input(name, shape, dtype, gen)
                if shape is GATE_HALF_OF:
                    x = x[..., :shape[-1] // 2]
                expected, actual = reference.encode(x), triton.encode(x)
                case = f"{name} {dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' view'}"
                cases += 1
                if expected.tensors.keys() != actual.tensors.keys():
                    mismatches.append(f"{case}: payload keys differ")
                    continue
                for key, tensor in expected.tensors.items():
                    if not torch.equal(_bits(tensor), _bits(actual.tensors[key])):
                        mismatches.append(f"{case}: payload tensor {key!r} differs")
                if not torch.equal(_bits(reference.decode(expected)), _bits(triton.decode(actual))):
                    mismatches.append(f"{case}: decoded tensors differ")
    return {"cases": cases, "mismatches": mismatches, "ok": not mismatches,
            "speed": codec_speed(gen)}


def _median_ms(fn) -> float:
    fn()  # compiles, and warms the caching allocator
    times = []
    for _ in range(SPEED_REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def codec_speed(gen) -> list[dict]:
    """Each Triton codec's encode + decode of one large bf16 activation (a float dropout mask
    for bitmask), against a plain copy of it into an existing tensor, medians of
    SPEED_REPEATS."""
    from megatron_adacc import codecs

    rows = []
    for name in codecs.NAMES:
        x = _codec_input(name, SPEED_SHAPE, torch.bfloat16, gen)
        codec, target = codecs.get(name, backend="triton"), torch.empty_like(x)
        copy_ms = _median_ms(lambda: target.copy_(x))
        round_trip_ms = _median_ms(lambda: codec.decode(codec.encode(x)))
        payload = sum(t.numel() * t.element_size() for t in codec.encode(x).tensors.values())
        rows.append({"codec": name, "input_bytes": x.numel() * x.element_size(),
                     "payload_bytes": payload, "copy_ms": copy_ms,
                     "round_trip_ms": round_trip_ms,
                     "round_trip_of_copy": copy_ms / round_trip_ms})
    return rows


# --- 2. exactness and host synchronisations --------------------------------------------------

VOCAB, SEQ, BATCH, STEPS = 1024, 256, 4, 3


def _own_sites(family: str) -> list:
    from megatron_adacc import models
    from megatron_adacc.common.sites import SITES

    return [SITES[name] for name in models.get(family).sites]


def _plans(family: str) -> dict:
    from megatron_adacc.common.plan import Plan

    own = _own_sites(family)
    return {
        "retain": Plan(),
        "recompute attention": Plan.uniform(
            {s.name: "recompute" for s in own if s.segment == "attention" and s.recomputable}),
        "recompute mlp": Plan.uniform(
            {s.name: "recompute" for s in own if s.segment == "mlp" and s.recomputable}),
        "recompute all": Plan.uniform({s.name: "recompute" for s in own if s.recomputable}),
    }


def _compress_plans(family: str) -> dict:
    """Plans whose host synchronisations are counted, not their bits (their codecs are
    lossy): every compressible site with its designated codec, and the quantize baseline's
    naive INT4."""
    from megatron_adacc import policies
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import COMPRESS

    return {
        "compress designated": Plan.uniform({s.name: Decision(COMPRESS)
                                             for s in _own_sites(family) if s.default_codec}),
        "compress naive_int4": policies.quantize_plan(),
    }


def _tiny_model(family: str, attention_backend: str, dtype, plan):
    from megatron_adacc import models
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.models.attention import local_layer_spec
    from megatron_adacc.runtime import apply_plan, get_adacc_layer_spec

    model_lib.set_seed(1)
    options = models.get(family).transformer_config_options(256, num_query_groups=4)
    options.update(hidden_dropout=0.1, attention_dropout=0.1)
    config = model_lib.build_transformer_config(
        num_layers=2, hidden_size=256, num_attention_heads=8, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, params_dtype=dtype, **options)
    spec = (local_layer_spec(attention_backend) if plan is None
            else get_adacc_layer_spec(attention_backend))
    model = model_lib.build_gpt_model(config, VOCAB, SEQ, spec, attention_backend,
                                      embedding=models.get(family).embedding_options()).to(dtype)
    if plan is not None:
        apply_plan(model, plan, strict=True)
    return model


def _train(model) -> tuple[list, list, list]:
    """Losses, gradients and host synchronisations of each of STEPS steps, on fixed batches
    and dropout streams."""
    from megatron_adacc.models import build as model_lib

    # Plain SGD: Adam's eps underflows in fp16 and turns untouched parameters into NaN.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, grads, syncs = [], [], []
    for step in range(STEPS):
        gen = torch.Generator(device="cuda").manual_seed(step)
        tokens, labels = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, device="cuda")
                          for _ in range(2))
        optimizer.zero_grad()
        model_lib.set_seed(100 + step)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = model_lib.gpt_loss(model, tokens, labels, torch.ones_like(tokens))
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs.append(sum(SYNC_WARNING in str(w.message) for w in caught))
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, syncs


def check_exactness() -> dict:
    from megatron_adacc.models import build as model_lib

    model_lib.init_distributed(1)
    # warn_only: an op without a deterministic kernel shows up as a mismatch, not a crash.
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {"host_syncs_per_step": {}, "mismatches": []}
    try:
        for family in ("gpt", "llama"):
            for backend in ("unfused", "flash"):
                for dtype_name in ("bf16", "fp16"):
                    dtype, model = FLOAT_DTYPES[dtype_name], f"{family} {backend} {dtype_name}"
                    stock_losses, stock_grads, stock_syncs = _train(
                        _tiny_model(family, backend, dtype, None))
                    results["host_syncs_per_step"][f"{model} stock"] = stock_syncs[-1]
                    for name, plan in _plans(family).items():
                        losses, grads, syncs = _train(_tiny_model(family, backend, dtype, plan))
                        results["host_syncs_per_step"][f"{model} {name}"] = syncs[-1]
                        for step in range(STEPS):
                            # Bits, not values: NaN must match NaN where the stock layer made one.
                            if not torch.equal(_bits(losses[step]), _bits(stock_losses[step])):
                                results["mismatches"].append(f"{model} {name}: step {step} loss")
                            results["mismatches"] += [
                                f"{model} {name}: step {step} gradient of {param}"
                                for param, grad in stock_grads[step].items()
                                if not torch.equal(_bits(grads[step][param]), _bits(grad))]
                    for name, plan in _compress_plans(family).items():
                        syncs = _train(_tiny_model(family, backend, dtype, plan))[2]
                        results["host_syncs_per_step"][f"{model} {name}"] = syncs[-1]
    finally:
        torch.use_deterministic_algorithms(False)
    results["ok"] = not results["mismatches"]
    return results


# --- 3 and 4. memory and throughput through pretrain_gpt.py ----------------------------------

def _pretrain(args, workdir: str, name: str, *flags: str) -> dict:
    """One `pretrain_gpt.py` run; its metrics summarised, or the error it ended with."""
    metrics = os.path.join(workdir, f"{name.replace(' ', '_')}.jsonl")
    trace = os.path.join(workdir, f"{name.replace(' ', '_')}.trace")
    command = [sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), "--config", args.config,
               "--micro-batch-size", str(args.micro_batch_size),
               "--global-batch-size", str(args.micro_batch_size),
               "--train-iters", str(args.iters), "--lr-warmup-iters", "0", "--eval-interval", "0",
               "--initial-loss-scale", str(INITIAL_LOSS_SCALE),
               "--adacc-profile-db", os.path.join(workdir, "profiles.sqlite"),
               "--metrics-file", metrics, "--profile", "--use-pytorch-profiler",
               "--profile-step-start", str(args.iters - 1), "--profile-step-end",
               str(args.iters), "--tensorboard-dir", trace, *flags]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"still running after {RUN_TIMEOUT_S} s"}
    if done.returncode != 0:
        return {"name": name, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    with open(metrics) as handle:
        records = [json.loads(line) for line in handle]
    # the last step is traced, and slower for it
    steady = [r["tokens_per_s"] for r in records if WARMUP_ITERS < r["iteration"] < args.iters]
    return {
        "name": name,
        "tokens_per_s": statistics.median(steady or [r["tokens_per_s"] for r in records]),
        "max_memory_allocated": _largest(records, "max_memory_allocated"),
        "max_memory_reserved": _largest(records, "max_memory_reserved"),
        "skipped_steps": sum(r.get("skipped_iter", 0) for r in records),
        # the rectifier's swaps: a plan measured after a swap is not the one `adacc plan` makes
        "plan_swaps": sum(a.get("plan_id") != b.get("plan_id")
                          for a, b in zip(records, records[1:])),
        "swap_lines": [line for line in done.stdout.splitlines()
                       if line.startswith("adacc: iteration")],
        "trace": trace_summary(trace),
        "plan_table": plan_table(done.stdout),
    }


def plan_table(stdout: str) -> list[str]:
    """The plan table a run printed at set-up, from its ``adacc: policy`` line to its
    ``budget`` line (none for a run without Adacc)."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("adacc: policy")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("budget ")),
               len(lines) - 1)
    return lines[start:end + 1]


def trace_summary(directory: str) -> dict:
    """The traced step of rank 0's PyTorch profiler trace in ``directory``: its wall time,
    the time CUDA kernels ran in it, the CUDA runtime calls that wait for the device, and
    the longest kernels by total time (empty if no trace was written)."""
    paths = sorted(glob.glob(os.path.join(directory, "rank0*.pt.trace.json")))
    if not paths:
        return {}
    with open(paths[-1]) as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    kernels = collections.Counter()
    for event in events:
        if event.get("cat") == "kernel":
            kernels[event["name"]] += event["dur"]
    return {
        "step_ms": sum(e["dur"] for e in events
                       if e["name"].startswith("ProfilerStep#")) / 1e3,
        "kernel_ms": sum(kernels.values()) / 1e3,
        "host_syncs": sum(e["name"] in SYNC_CALLS for e in events
                          if e.get("cat") == "cuda_runtime"),
        "top_kernels": [[name, us / 1e3] for name, us in kernels.most_common(TOP_KERNELS)],
    }


def _largest(records: list[dict], key: str) -> int | None:
    # The allocator's peaks are written by the trainer on CUDA; None if it did not.
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def _plan(args, workdir: str, budget: int) -> dict:
    """`adacc plan --json` for `budget` on the runs' ProfileDB (profiling first if it is
    empty): the planner's predicted peak, or the smallest feasible budget."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "megatron_adacc.cli", "plan", "--config", args.config,
             "--micro-batch-size", str(args.micro_batch_size), "--memory-budget", f"{budget}B",
             "--profile-db", os.path.join(workdir, "profiles.sqlite"), "--exact", "--json"],
            cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {}
    return json.loads(done.stdout) if done.stdout.strip() else {}


def check_training(args, progress) -> dict:
    """The runs' report; ``progress`` is called with it as each run ends."""
    report = {"runs": [], "budgets": [], "ok": False}

    def pretrain(*run_args):
        report["runs"].append(_pretrain(args, workdir, *run_args))
        progress(report)
        return report["runs"][-1]

    with tempfile.TemporaryDirectory(prefix="adacc-gpu-check-") as workdir:
        unoptimised = pretrain("no optimisation").get("max_memory_allocated")
        pretrain("megatron full recompute", "--recompute-granularity", "full")
        pretrain("megatron selective recompute", "--recompute-granularity", "selective")
        smallest = _plan(args, workdir, 1).get("minimum_feasible_budget")
        if unoptimised is None or smallest is None:
            report["error"] = ("no allocator peak with no optimisation, or no smallest budget "
                               "from `adacc plan`")
            return report
        for fraction in BUDGET_FRACTIONS:
            budget = int(smallest + fraction * (unoptimised - smallest))
            peak = pretrain(f"adacc auto at budget {_mib(budget)} MiB",
                            "--adacc-policy", "auto", "--adacc-memory-budget", f"{budget}B",
                            "--adacc-strict").get("max_memory_allocated")
            report["budgets"].append({
                "budget_bytes": budget, "max_memory_allocated": peak,
                "predicted_peak_bytes": _plan(args, workdir, budget).get("peak_bytes"),
                "ok": peak is not None and peak <= budget})
            progress(report)
    report["ok"] = all(b["ok"] for b in report["budgets"])
    return report


# --- report ---------------------------------------------------------------------------------

def _mib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def markdown(results: dict) -> str:
    lines = ["# GPU check", "",
             f"`python scripts/gpu_check.py` on {results['device']} (torch {results['torch']}, "
             f"config `{results['config']}`, micro-batch {results['micro_batch_size']}, "
             f"{results['iters']} iterations).", ""]
    for check in CHECKS:
        lines += SECTIONS[check](results[check]) if check in results else [
            f"## {check}", "", "Not run.", ""]
    return "\n".join(lines) + "\n"


def _codecs_section(codec: dict) -> list[str]:
    lines = ["## Triton codecs against the PyTorch reference", "",
             f"{codec['cases']} cases (codec x dtype x shape): "
             + ("payloads and decoded tensors byte-identical." if codec["ok"]
                else f"{len(codec['mismatches'])} mismatches:"), ""]
    lines += [f"- {m}" for m in codec["mismatches"]]
    lines += ["", f"Round trip (encode + decode) of one bf16 tensor of {SPEED_SHAPE} against a "
              "plain copy into an existing tensor, CUDA-event medians:", "",
              "| codec | payload / input | copy (ms) | round trip (ms) | round trip / copy speed |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['codec']} | {r['payload_bytes'] / r['input_bytes']:.3f} | "
              f"{r['copy_ms']:.3f} | {r['round_trip_ms']:.3f} | {r['round_trip_of_copy']:.2f} |"
              for r in codec.get("speed", [])]
    return lines + [""]


def _exactness_section(exact: dict) -> list[str]:
    lines = ["## Retain and recompute against megatron's stock layer", "",
             f"Bitwise over the losses and every gradient of {STEPS} steps, dropout 0.1, "
             "strict attribution: " + ("equal." if exact["ok"]
                                       else f"{len(exact['mismatches'])} mismatches:"), ""]
    lines += [f"- {m}" for m in exact["mismatches"][:50]]
    lines += ["", "| model | host syncs per step |", "|---|---|"]
    lines += [f"| {name} | {count} |" for name, count in exact["host_syncs_per_step"].items()]
    return lines + [""]


def _training_section(train: dict) -> list[str]:
    lines = ["## Memory budgets (`--adacc-policy auto`)", ""]
    if train.get("error"):
        lines += [f"Not run: {train['error']}.", ""]
    lines += ["| budget (MiB) | allocator peak (MiB) | predicted peak (MiB) | within |",
              "|---|---|---|---|"]
    lines += [f"| {_mib(b['budget_bytes'])} | {_mib(b['max_memory_allocated'])} | "
              f"{_mib(b['predicted_peak_bytes'])} | {'yes' if b['ok'] else 'NO'} |"
              for b in train["budgets"]]
    lines += ["", "## Throughput at the same micro-batch", "",
              "| method | tokens/s | allocator peak (MiB) | reserved (MiB) | skipped steps | "
              "plan swaps | traced step (ms) | kernels (ms) | host syncs |",
              "|---|---|---|---|---|---|---|---|---|"]
    for run in train["runs"]:
        if "error" in run:
            lines.append(f"| {run['name']} | failed: {run['error']} | | | | | | | |")
            continue
        trace = run.get("trace") or {}
        lines.append(f"| {run['name']} | {run['tokens_per_s']:,.0f} | "
                     f"{_mib(run['max_memory_allocated'])} | "
                     f"{_mib(run['max_memory_reserved'])} | "
                     f"{run.get('skipped_steps', 'not counted')} | "
                     f"{run.get('plan_swaps', 'not counted')} | "
                     + " | ".join(_ms(trace.get(key)) for key in ("step_ms", "kernel_ms"))
                     + f" | {trace.get('host_syncs', '-')} |")
    traced = [run for run in train["runs"] if (run.get("trace") or {}).get("top_kernels")]
    if traced:
        lines += ["", "Longest kernels of each traced step (total ms):", ""]
        for run in traced:
            lines.append(f"- {run['name']}: " + "; ".join(
                f"{name[:60]} {ms:.1f}" for name, ms in run["trace"]["top_kernels"]))
    for run in train["runs"]:
        if run.get("plan_table"):
            lines += ["", f"Plan of {run['name']}, as the run printed it:", "", "```text",
                      *run["plan_table"], *run.get("swap_lines", []), "```"]
    return lines + [""]


def _ms(value) -> str:
    return "-" if value is None else f"{value:,.1f}"


SECTIONS = {"codecs": _codecs_section, "exactness": _exactness_section,
            "training": _training_section}


def main(argv=None) -> int:
    args = parse(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)")
        return 0
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "config": os.path.relpath(args.config, ROOT),
               "micro_batch_size": args.micro_batch_size, "iters": args.iters}
    for path in (args.out, args.doc):  # the image ships no docs/ folder
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(partial: dict) -> None:
        with open(args.out, "w") as handle:
            json.dump(partial, handle, indent=1)
        with open(args.doc, "w") as handle:
            handle.write(markdown(partial))

    for check in args.checks:
        if check == "codecs":
            results["codecs"] = check_codecs()
        elif check == "exactness":
            results["exactness"] = check_exactness()
        else:
            torch.cuda.empty_cache()  # the training runs are other processes on this GPU
            results["training"] = check_training(
                args, lambda report: write({**results, "training": report}))
        write(results)
        print(f"gpu_check: {check} {'passed' if results[check]['ok'] else 'FAILED'}",
              flush=True)
    failed = [check for check in args.checks if not results[check]["ok"]]
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'all checks passed'}; "
          f"{args.out}, {args.doc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
