"""What the evaluation benchmarks share: shapes, methods, the memory yardstick, timing, output.

bench_throughput, bench_max_batch and bench_accuracy share the model shapes, the methods under
comparison, interleaved timing (wall and CPU time), JSON and figures. Every method of a run uses the
same attention backend. The yardstick: a method *fits* a budget when

    static bytes (parameters, gradients, optimizer: engine_memory.model_static_bytes)
    + the activation peak the ActivationRuler measures during one training step <= budget.

The ruler is the same for every method. It counts:
- megatron's stock layer, and its full and selective recompute (their re-run forward's saves in
  backward, as they appear);
- Adacc plans: payloads, and decoded or rebuilt values while their layer backprops;
- torch.compile's layers: their AOT graphs save through autograd, so the saved-tensor hook sees each
  storage. Only the per-site attribution's module hooks are off there, since they make dynamo
  recompile at every step.
No method's count includes megatron's global memory buffer (see Ruler), nor the gradient working set
of a layer's backward. Adacc's planner models that workspace, so Adacc is planned with it set to
zero, against the same yardstick.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch

from megatron_adacc.models import build as model_lib
from megatron_adacc import models, planning, policies
from megatron_adacc.profiling import allocator, engine_memory
from megatron_adacc.profiling import profiler
from megatron_adacc.models.attention import local_layer_spec
from megatron_adacc.codecs import BACKEND_ENV_VAR, native
from megatron_adacc.common.plan import Plan
from megatron_adacc.runtime import ActivationRuler, apply_plan, get_adacc_layer_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "docs", "results")
FIGURES_DIR = os.path.join(ROOT, "docs", "figures")

# megatron-core's recompute_modules that run on this layer spec. "mlp" is left out: with
# biased linear layers (GPT-2's, used here) its backward recurses forever in 0.19.2, and
# pretrain_gpt.py refuses it (megatron_lm.check_args).
SELECTIVE_SETS = (("core_attn",), ("layernorm",), ("core_attn", "layernorm"))

METHODS = ("no optimisation", "megatron full recompute", "megatron block recompute",
           "megatron selective recompute",
           "naive INT4", "torch.compile + memory budget", "adacc auto")


# The attentions measured. Flash runs train, for every method, with attention dropout 0, as
# modern GPT recipes do (and as PyTorch's CPU flash kernel requires); unfused runs keep the
# attention dropout of the published GPT-2 setting.
ATTENTION_BACKENDS = ("flash", "unfused")


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 258          # a byte-level vocabulary: logits stay small
    dropout: float = 0.1      # hidden dropout; attention dropout too, except on flash
    attention: str = "unfused"
    family: str = "gpt"       # megatron_adacc.models: gpt or llama (no dropout)
    query_groups: int | None = None  # llama: grouped-query attention's K/V heads
    ffn: int | None = None    # default: the family's, as Megatron-LM's flags give it (4h;
                              # SwiGLU 8h/3 in 64s)

    @property
    def attention_dropout(self) -> float:
        return 0.0 if self.attention == "flash" else self.dropout

    def config_options(self) -> dict:
        """TransformerConfig fields of the shape's family, dropouts included."""
        options = dict(hidden_dropout=self.dropout, attention_dropout=self.attention_dropout)
        options.update(models.get(self.family).transformer_config_options(
            self.hidden, self.query_groups, self.ffn))
        return options

    def describe(self) -> str:
        options = self.config_options()
        family = (f"{self.family} family, " if self.family == "gpt" else
                  f"{self.family} family ({self.query_groups or self.heads} query groups, "
                  f"ffn {options['ffn_hidden_size']}), ")
        return (f"{family}{self.attention} attention, {self.layers} layers, hidden "
                f"{self.hidden}, {self.heads} heads, seq {self.seq}, vocab {self.vocab}, "
                f"hidden dropout {options['hidden_dropout']}, attention dropout "
                f"{options['attention_dropout']}, fp32, CPU")


def add_family_args(parser: argparse.ArgumentParser, query_groups: int | None,
                    query_groups_default: str) -> None:
    """--family, --query-groups and --ffn, as every benchmark takes them."""
    parser.add_argument("--family", choices=sorted(models.FAMILIES), default="gpt",
                        help="the model family (megatron_adacc/models): gpt (GPT-2) or llama "
                             "(RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, "
                             "untied embeddings, no dropout)")
    parser.add_argument("--query-groups", type=int, default=query_groups,
                        help="llama: grouped-query attention's key/value heads "
                             f"(default: {query_groups_default})")
    parser.add_argument("--ffn", type=int, default=None,
                        help="ffn hidden size (default: the family's)")


def add_shape_args(parser: argparse.ArgumentParser, full: Shape, quick: Shape) -> None:
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--seq", type=int)
    add_family_args(parser, query_groups=None, query_groups_default="heads / 2")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="unfused",
                        help="the core attention every method runs (flash: attention dropout "
                             "0 for every method)")
    parser.add_argument("--quick", action="store_true",
                        help=f"minutes: {quick.describe()}, fewer rounds")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's choice; 1 is steadier "
                             "when other jobs share the cores)")
    parser.set_defaults(_full_shape=full, _quick_shape=quick)


def shape_from(args) -> Shape:
    base = args._quick_shape if args.quick else args._full_shape
    shape = replace(base, attention=args.attention_backend, family=args.family,
                    **{k: getattr(args, k) for k in ("layers", "hidden", "heads", "seq")
                       if getattr(args, k) is not None})
    if args.family == "llama":
        shape = replace(shape, dropout=0.0,
                        query_groups=args.query_groups or max(1, shape.heads // 2))
    return replace(shape, ffn=args.ffn)


def init(threads: int | None = None) -> None:
    """Set up before anything is measured: the threads, host memory recycling and the process group.

    Freed host memory is kept for reuse, as ``Adacc.setup`` keeps it on a CPU. So every method,
    and the profiler, run under the one allocator policy."""
    warnings.filterwarnings("ignore")
    if threads:
        torch.set_num_threads(threads)
    allocator.recycle_freed_host_memory()
    model_lib.init_distributed(1)


def build(shape: Shape, adacc: bool = False, **recompute) -> torch.nn.Module:
    model_lib.set_seed(1)
    config = model_lib.build_transformer_config(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        **shape.config_options(), **recompute)
    spec = (get_adacc_layer_spec if adacc else local_layer_spec)(shape.attention)
    return model_lib.build_gpt_model(config, shape.vocab, shape.seq, spec,
                                      embedding=models.get(shape.family).embedding_options())


def batch_of(shape: Shape, micro_batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, shape.vocab, (micro_batch, shape.seq), generator=gen),
            torch.randint(0, shape.vocab, (micro_batch, shape.seq), generator=gen),
            torch.ones(micro_batch, shape.seq))


# --- variants: one way of running one model ------------------------------------------------
@dataclass
class Variant:
    method: str                      # one of METHODS
    detail: str                      # e.g. the recompute modules, the compile fraction
    model: torch.nn.Module
    plan: Plan | None = None         # applied before every step (models are shared)
    attribute: bool = True           # ruler module hooks (off for compiled layers)
    info: dict | None = None

    @property
    def name(self) -> str:
        return f"{self.method} [{self.detail}]" if self.detail else self.method

    def activate(self) -> None:
        if self.plan is not None:
            apply_plan(self.model, self.plan)

    def step(self, batch) -> tuple[float, float]:
        """One forward and backward; returns its (wall, process CPU) time."""
        self.activate()
        self.model.zero_grad(set_to_none=True)
        wall, cpu = time.perf_counter(), time.process_time()
        model_lib.gpt_loss(self.model, *batch).backward()
        return time.perf_counter() - wall, time.process_time() - cpu

    def activation_peak(self, batch) -> int:
        self.activate()
        self.model.zero_grad(set_to_none=True)
        with Ruler(self.model if self.attribute else None) as ruler:
            loss = model_lib.gpt_loss(self.model, *batch)
            ruler.forward_done()
            loss.backward()
        self.model.zero_grad(set_to_none=True)
        return ruler.report().peak_bytes


class Ruler(ActivationRuler):
    """The ActivationRuler, not counting megatron's global memory buffer.

    That buffer is a persistent storage every method holds alike: the local attention's baddbmm
    input, grown to the largest micro-batch run so far. Eager layers never save it.
    torch.compile's graphs do save a view of it, since a graph input is free to save for the
    partitioner. Counting its whole storage would charge the compiled peer for memory that is no
    activation."""

    def keep_tensor(self, layer, site, tensor):
        # Compared by address, at save time: the buffer may be replaced (grown) during the
        # step, and a freed storage's Python id can be reused by a saved tensor's.
        from megatron.core import parallel_state

        pointer = tensor.untyped_storage().data_ptr()
        if not any(pointer == held.untyped_storage().data_ptr()
                   for held in parallel_state.get_global_memory_buffer().buffer.values()):
            super().keep_tensor(layer, site, tensor)


class Models:
    """The models of one shape, built once and shared by the variants that can share them."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.stock = build(shape)
        self.static_bytes = engine_memory.model_static_bytes(self.stock)
        self.full = build(shape, recompute_granularity="full", recompute_method="uniform",
                          recompute_num_layers=1)
        # Megatron's block recompute: the first n layers re-run whole, the rest keep
        # everything (n = the number of layers is full recompute).
        self.block = {n: build(shape, recompute_granularity="full", recompute_method="block",
                               recompute_num_layers=n) for n in range(1, shape.layers)}
        self.selective = {mods: build(shape, recompute_granularity="selective",
                                      recompute_modules=list(mods)) for mods in SELECTIVE_SETS}
        self.adacc = build(shape, adacc=True)
        self._compiled: dict[float, torch.nn.Module] = {}
        self.compile_errors: dict[float, str] = {}
        self.compile_s: dict[float, float] = {}

    def none(self) -> Variant:
        return Variant("no optimisation", "", self.stock)

    def full_recompute(self) -> Variant:
        return Variant("megatron full recompute", "", self.full)

    def block_variants(self) -> list[Variant]:
        """Block recompute of 1 .. layers - 1 layers.

        Where several fit a budget, the fastest one, the fewest layers, is compared."""
        return [Variant("megatron block recompute", f"{n} of {self.shape.layers} layers", model)
                for n, model in self.block.items()]

    def selective_variants(self) -> list[Variant]:
        return [Variant("megatron selective recompute", "+".join(mods), model)
                for mods, model in self.selective.items()]

    def naive_int4(self) -> Variant:
        return Variant("naive INT4", "", self.adacc, policies.quantize_plan())

    def compiled(self, fraction: float) -> Variant | None:
        """torch.compile (inductor) of every layer, with activation_memory_budget ``fraction``.

        That is torch._functorch.config.activation_memory_budget while it compiles. Each fraction
        gets a backend, so dynamo keeps one compiled graph per fraction. The embedding and loss
        stay eager, as for every other method."""
        if fraction in self.compile_errors:
            return None
        if fraction not in self._compiled:
            model = build(self.shape)
            backend = _budget_backend(fraction)
            for layer in model.decoder.layers:
                layer.compile(backend=backend, dynamic=True)
            self._compiled[fraction] = model
        return Variant("torch.compile + memory budget", f"budget fraction {fraction:g}",
                       self._compiled[fraction], attribute=False)

    def compiled_peak(self, fraction: float, batch) -> int | None:
        """Activation peak of the compiled model, compiled on first use; None if compiling fails.

        The error is kept in compile_errors."""
        variant = self.compiled(fraction)
        if variant is None:
            return None
        began = time.perf_counter()
        try:
            peak = variant.activation_peak(batch)
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            self.compile_errors[fraction] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            return None
        self.compile_s[fraction] = self.compile_s.get(fraction, 0.0) + time.perf_counter() - began
        return peak

    def adacc_costs(self, batch, repeats: int):
        """Profile the Adacc model on ``batch``: the costs the benchmarks plan with.

        They hold every measured codec, since ``adacc_auto`` plans auto's tiers from them. The
        backward workspace is zeroed (see the module docstring)."""
        costs = profiler.profile(self.adacc, batch, repeats=repeats)
        return replace(costs, backward_workspace_bytes=0)

    def adacc_auto(self, costs, budget: int) -> Variant | None:
        """Adacc's plan for ``budget``, as ``--adacc-policy auto`` plans; None when nothing fits.

        That is designated codecs first, and naive INT4 as the last resort."""
        try:
            result = policies.plan("auto", costs, budget, allow_lossy_sources=False)
        except planning.InfeasibleBudget:
            return None
        mix: dict[str, int] = {}
        for layer in result.layer_decisions:
            for decision in layer.values():
                mix[decision.action] = mix.get(decision.action, 0) + 1
        return Variant("adacc auto", f"budget {budget}", self.adacc, result.plan,
                       info={"mix": mix, "predicted_peak_bytes": result.peak_bytes,
                             "predicted_added_s": result.added_time_s,
                             "predicted_naive_int4_added_s": predicted_added_s(
                                 costs, policies.quantize_plan()),
                             "plan_id": result.plan.plan_id,
                             "last_resort_sites": planning.last_resort_sites(result)})


def pretrain_in_process(argv: list[str], out, err) -> int:
    """Run ``pretrain_gpt.py`` on ``argv`` in this process; returns its exit status.

    Its output goes to ``out`` and ``err``. Megatron-LM's loop tears its state down after each
    run, and the run's model is released after it. So runs in one process start as fresh ones
    do, without a process's imports.
    """
    import contextlib

    import pretrain_gpt

    from megatron_adacc import megatron_lm

    if not gc.get_freeze_count():
        # The imports' half a million objects live as long as the process. Frozen, the
        # collections after and during each run walk the runs' objects only (0.5 s less each).
        gc.collect()
        gc.freeze()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return pretrain_gpt.main(argv)
    finally:
        megatron_lm.release()  # else the next run's peak carries this run's model
        gc.collect()


def predicted_added_s(costs, plan: Plan) -> float:
    """The time the planner's model says ``plan`` adds to a step, from the profiled costs.

    Beside Adacc's own prediction, it says whether a gap to a peer is the plan's or the machine's
    (the model's error)."""
    return sum(planning.evaluate_layer(
                   costs, {site.name: decision for site in costs.sites
                           if (decision := plan.for_layer(layer).get(site.name))}).time_s
               for layer in range(costs.num_layers))


def _budget_backend(fraction: float):
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(graph, example_inputs):
        with functorch_config.patch(activation_memory_budget=fraction):
            return compile_fx(graph, example_inputs)
    return backend


def configure_dynamo() -> None:
    import torch._dynamo

    # One compiled graph per fraction and per graph break of megatron's layer.
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096


# --- timing ---------------------------------------------------------------------------------
def interleaved_times(steps: dict[str, Callable[[], tuple[float, float]]], warmup: int,
                      rounds: int) -> dict[str, dict]:
    """Time every entry in rounds of one step each; returns per-entry medians and round times.

    - Each round runs one step of every entry, so drift on a shared machine hits them alike.
    - Each round starts one entry later, so no entry always follows the same one.
    - The first ``warmup`` rounds are dropped.
    - The garbage collector runs before each step, not during it: its pauses would land on whichever
      step triggers them.
    Per entry: the median wall time, and the kept rounds' wall and CPU times aligned by round
    (for ``paired_ratio``)."""
    names = list(steps)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(warmup + rounds):
        for k in range(len(names)):
            name = names[(round_ + k) % len(names)]
            gc.collect()
            gc.disable()
            try:
                elapsed, cpu_elapsed = steps[name]()
            finally:
                gc.enable()
            if round_ >= warmup:
                wall[name].append(elapsed)
                cpu[name].append(cpu_elapsed)
    return {name: {"median_s": statistics.median(wall[name]), "times_s": wall[name],
                   "cpu_times_s": cpu[name]} for name in names}


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """The median over rounds of each round's numerator / denominator time.

    A load spike or a slow stretch in one round moves both of that round's steps, not the ratio."""
    return statistics.median(a / b for a, b in zip(numerator, denominator, strict=True))


# --- output ---------------------------------------------------------------------------------
def output_names(args, stem: str) -> None:
    """Fill the unset --out, --publish and --figure with names of the family and attention backend.

    GPT's family is left out of the name: ``stem``_flash.json, ``stem``_llama_flash.json, ... So
    the runs sit side by side."""
    family = "" if getattr(args, "family", "gpt") == "gpt" else f"_{args.family}"
    tag = f"{stem}{family}_{args.attention_backend}"
    args.out = args.out or f"bench_results/{tag}.json"
    args.publish = f"{tag}.json" if args.publish is None else args.publish
    args.figure = f"{tag}.png" if args.figure is None else args.figure


def write_json(data: dict, out: str, publish_as: str | None) -> None:
    """Write ``out`` (bench_results/, ignored by git), and with ``publish_as`` a docs/results/ copy.

    The copy is for the results page."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(data, f, indent=1, default=_jsonable)
    if publish_as:
        os.makedirs(RESULTS_DIR, exist_ok=True)
        shutil.copyfile(out, os.path.join(RESULTS_DIR, publish_as))
    print(f"wrote {out}" + (f" and docs/results/{publish_as}" if publish_as else ""))


def _jsonable(value):
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, name: str) -> str | None:
    """Write ``fig`` under docs/figures as ``name``; '' writes nothing.

    A --figure '' run leaves the published figure alone, as --publish '' does the JSON."""
    if not name:
        return None
    os.makedirs(FIGURES_DIR, exist_ok=True)
    path = os.path.join(FIGURES_DIR, name)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {os.path.relpath(path, ROOT)}")
    return path


# The environment variables that choose the kernels of a CPU run (the device name says which
# it got: profiler.device_name): the codec backend, the native kernels' build flags (e.g.
# -mno-avx512f) and PyTorch's, MKL's and oneDNN's vector ceilings. With the last four at AVX2
# an AVX-512 machine runs every kernel of a step on the AVX2 path.
KERNEL_VARIABLES = (BACKEND_ENV_VAR, native.CFLAGS_ENV_VAR, "ATEN_CPU_CAPABILITY",
                    "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def run_info(args) -> dict:
    return {"command": shlex.join(["python", *sys.argv]), "quick": bool(args.quick),
            "environment": {name: os.environ[name] for name in KERNEL_VARIABLES
                            if name in os.environ},
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "device": profiler.device_name(), "load_average": os.getloadavg(),
            "host_memory_recycled": allocator.host_memory_recycled(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def start_memory_bench(args):
    """What the memory benchmarks do first: (run info, start time, shape, the methods)."""
    init(args.threads)  # first: the run info records the threads the methods run with
    run, began = run_info(args), time.perf_counter()
    shape = shape_from(args)
    configure_dynamo()
    return run, began, shape, Models(shape)
