"""What the GPU check runs and how long it may take: sizes, models, methods, time estimates."""
from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
# Runs only when asked for (--methods overhead), at no optimisation's budget: where Adacc's step
# exceeds the stock layer's when its plan retains everything. GPT-345M's all-retain auto plan
# ran 73 ms over no optimisation on the H200 (222 ms), the same kernels for 57 ms more in
# backward. Each run removes one part of Adacc:
# - RETAIN_PLAN: Adacc's layer spec and per-step work, with a fixed all-retain plan and no
#   profile (run before any auto run profiles in this process);
# - AUTO_UNTRACKED: auto's profile and plan, with neither tracking nor the step watch.
# With auto's own run and no optimisation's run again last (after every Adacc run), they split
# the difference between its parts.
RETAIN_PLAN = "adacc, fixed all-retain plan"
AUTO_UNTRACKED = "adacc auto, tracking off"
# Runs only when asked for (--methods held), as the process's first auto run: auto at no
# optimisation's budget with the allocator's history on, naming the device blocks it leaves
# allocated. On the H200 the first auto run of a process left 37,376 B that every later run
# held (64.04 MiB before it, not 64.00), and its tightest plan peaked 37,888 B over budget.
HELD = "adacc auto, blocks kept"
DIAGNOSTIC_METHODS = ("overhead", "held")
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
# one byte-identity case, compile included (the H200 of 2026-11-29: 89 cases in about 26 s)
CODEC_CASE_S = {"gpu": 0.3, "cpu": 0.05}
CODEC_GRAPH_S = {"gpu": 3.5, "cpu": 0.0}        # one codec's copy, round trip and parts graphs
CODEC_SPEED_S = {"gpu": 3.0, "cpu": 0.5}        # one codec's timing, compile included
SYNC_MODEL_S = {"gpu": 1.0, "cpu": 1.5}         # one small model's steps under one policy
# One training run's build, data and exit, beyond its steps; a trace's, and one with Python's
# call stacks too, written and read; and what the first run of a process pays once (the
# H200 of 2026-11-30: about 2.5 s, 1.5 s, 4 s and 10 s)
RUN_OVERHEAD_S = {"gpu": 3.0, "cpu": 4.0}
TRACE_S = {"gpu": 1.5, "cpu": 0.5}
STACK_TRACE_S = {"gpu": 4.0, "cpu": 0.5}
FIRST_RUN_S = {"gpu": 10.0, "cpu": 2.0}
# auto's first run profiles the model: about this many steps' time, plus set-up
PROFILE_STEPS, PROFILE_S = 60, {"gpu": 10.0, "cpu": 6.0}
# an auto run's rectifier: after iterations 1, 2, 4, 8 an extra forward and a re-plan
TRACKING_S = {"gpu": 4.0, "cpu": 2.0}
# Sustained model FLOP/s of a training step, by attention backend (the H100 run of GPT-345M
# with unfused attention in fp16 reached ~82 TFLOP/s); CPU: this machine's 2 cores.
STEP_FLOPS = {"gpu": {"flash": 350e12, "unfused": 90e12}, "cpu": {"flash": 5e9, "unfused": 5e9}}
# A method's step over no optimisation's, for estimates before it has run
STEP_FACTOR = {NONE: 1.0, FULL: 1.4, SELECTIVE: 1.15, BLOCK: 1.25, QUANTIZE: 1.3, AUTO: 1.2,
               AUTO_LOSSY: 1.2, RETAIN_PLAN: 1.2, AUTO_UNTRACKED: 1.2,
               HELD: 1.5}  # the allocator's history costs the host a stack a block
# Methods whose runs trace their last step (a trace with shapes and stacks costs seconds to
# write and read on a 1B model: the other runs are not traced)
TRACED = (NONE, FULL, QUANTIZE, AUTO, RETAIN_PLAN)
AGAIN = "none again"    # the run that measures a section's drift (ModelRuns._drift)
# Traced with Python's call stacks too (seconds more a trace): the host's time by package in
# the stock layer's step and Adacc's (trace_summary)
STACKS = (NONE, AUTO, RETAIN_PLAN)
PREDICT_S = {"gpu": 10.0, "cpu": 8.0}           # a model's predictions, after its runs
CHILD_GRACE_S = 20      # past its deadline a child is stopped; what it wrote is kept
MIN_SECTION_S = 15      # a section given less is skipped



def device_kind(dry_run: bool) -> str:
    """The key of the time estimates: "cpu" for the dry run, else "gpu"."""
    return "cpu" if dry_run else "gpu"


def sizes_for(dry_run: bool) -> Sizes:
    """The dry run's sizes or the GPU's."""
    return DRY if dry_run else GPU


class Deadline:
    """Seconds left until a fixed moment."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def write_json(path: str, data: dict) -> None:
    """Written whole, then renamed: a reader (or a kill) never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=folder, delete=False, suffix=".tmp") as handle:
        json.dump(data, handle, indent=1, default=str)
    os.replace(handle.name, path)


def note(notes: list, text: str) -> None:
    """Print ``text`` now and keep it in ``notes`` for the page."""
    print(f"gpu_check: {text}", flush=True)
    notes.append(text)


def synchronize(device) -> None:
    """Wait for ``device``'s work, where it is a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mib(nbytes) -> str:
    """Bytes as MiB for the page; "-" for None."""
    if nbytes is None:
        return "-"
    return f"{nbytes / 2**20:,.0f}" if nbytes >= 100 << 20 else f"{nbytes / 2**20:.2f}"


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``, for comparing tensors bit for bit."""
    return t.contiguous().view(-1).view(torch.uint8)
