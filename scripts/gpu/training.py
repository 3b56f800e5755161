"""(c, d) ``pretrain_gpt.py`` runs of each method at each budget: steps, peaks and traces."""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import io
import itertools
import json
import math
import os
import statistics
import tempfile
import time

import torch

from gpu.common import (AGAIN, AUTO, AUTO_LOSSY, AUTO_UNTRACKED, BLOCK, BUDGET_FRACTIONS,
                        COPY_CALLS, DRY_MICRO_BATCH, FIRST_RUN_S, FULL, HELD,
                        INITIAL_LOSS_SCALE, NONE,
                        OPTIONAL_METHODS, PROFILE_S, PROFILE_STEPS, PYTHON_PACKAGES, QUANTIZE,
                        RETAIN_PLAN, ROOT, RUN_OVERHEAD_S, SELECTIVE, STACK_TRACE_S, STACKS,
                        STEP_FACTOR,
                        STEP_FLOPS, SYNC_CALLS, TOP_KERNELS, TRACE_S, TRACED, TRACKING_S,
                        Deadline, ModelSpec, Sizes, device_kind, note)

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


def config_values(spec: ModelSpec, dry_run: bool) -> dict:
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


def trace_start(iters: int) -> int:
    """The iteration a traced run's profiler records: its last but one."""
    return iters - 1


def untraced_end(iters: int, traced: bool) -> int:
    """The first iteration a run's step-time median leaves out, and every one after it.

    Megatron-LM's profiler warms up in the iteration before the traced one (CUPTI collects,
    and discards), records the traced one, and writes the trace in the next; an untraced run's
    last iteration is left out as a traced run's is."""
    return trace_start(iters) - 1 if traced else iters


def _window(records: list[dict], key: str, warmup: int, end: int,
            skip: set[int] = frozenset()) -> list[float]:
    """The values of ``key`` a run's median is taken over (all of them if that leaves none)."""
    # the first steps warm up; from `end` on the profiler runs (untraced_end)
    values = [r[key] for r in records if r.get(key) is not None
              and warmup < r["iteration"] < end and r["iteration"] not in skip]
    return values or [r[key] for r in records if r.get(key) is not None]


def _median_of(records: list[dict], key: str, warmup: int, end: int,
               skip: set[int] = frozenset()) -> float | None:
    values = _window(records, key, warmup, end, skip)
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


# The frames that say where a kept block came from: the project's, Megatron's and the script's.
OWN_FRAMES = ("megatron_adacc", "megatron/", "pretrain_gpt", "triton/")


def _active_blocks(snapshot: dict):
    """The allocated blocks of a ``torch.cuda.memory._snapshot()``."""
    return (block for segment in snapshot.get("segments", [])
            for block in segment.get("blocks", []) if block.get("state") == "active_allocated")


def kept_blocks(before: set[int], after: dict, limit: int = 40) -> list[dict]:
    """The blocks allocated in ``after`` (``torch.cuda.memory._snapshot()``) but not ``before``.

    Each has its size, its requested size and the first few frames of ours that allocated it
    (the allocator's history must have been on), largest first."""
    kept = []
    for block in _active_blocks(after):
        if block["address"] in before:
            continue
        frames = [f"{'/'.join(f['filename'].rsplit('/', 2)[-2:])}:{f['line']} {f['name']}"
                  for f in block.get("frames", [])
                  if any(part in f["filename"] for part in OWN_FRAMES)]
        kept.append({"size": block["size"], "requested": block.get("requested_size"),
                     "frames": frames[:4]})
    return sorted(kept, key=lambda block: -block["size"])[:limit]


@contextlib.contextmanager
def _blocks_kept(device, result: dict):
    """Record in ``result["kept_blocks"]`` the device blocks the block leaves allocated."""
    if device.type != "cuda":
        result["kept_blocks"] = None    # a CPU has no caching allocator to ask
        yield
        return
    # Python stacks at allocation only: C++ frames would cost the host far more a block
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python",
                                             max_entries=500_000)
    before = {block["address"] for block in _active_blocks(torch.cuda.memory._snapshot())}
    try:
        yield
    finally:
        torch.cuda.synchronize()
        after = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        result["kept_blocks"] = kept_blocks(before, after)


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
    # Where the host's time goes when the device idles: ATen ops (inclusive) and CUDA runtime
    # calls, by total time, with their counts.
    summary["top_ops"] = [[name, us / 1e3] for name, us in ops.most_common(TOP_KERNELS)]
    calls, count = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "cuda_runtime":
            calls[event["name"]] += event["dur"]
            count[event["name"]] += 1
    summary["runtime_calls"] = [[name, count[name], us / 1e3]
                                for name, us in calls.most_common(TOP_KERNELS)]
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
    """Self time of the traced step's Python: by package and the longest, per thread.

    ``python_self_ms`` is the step's thread's. On a GPU, backward runs on autograd's device
    thread while the step's thread waits in ``run_backward``: that thread's Python (saved-tensor
    hooks, gradient hooks) is under ``other_threads``. A frame's self time is its own, less its
    Python frames' and ATen ops'. The profiler's call-stack collection slows Python down, so
    these time where the host goes, not how long."""
    thread = steps[0]["tid"]
    begin, end = min(e["ts"] for e in steps), max(e["ts"] + e["dur"] for e in steps)
    inside = [e for e in events if e.get("cat") in ("python_function", "cpu_op")
              and begin <= e["ts"] <= end]
    summary = _thread_self_ms([e for e in inside if e.get("tid") == thread])
    others = _thread_self_ms([e for e in inside if e.get("tid") != thread])
    return {**summary, "other_threads": {"python_self_ms": others["python_self_ms"],
                                         "top_python": others["top_python"]}}


def _thread_self_ms(events: list[dict]) -> dict:
    """Python self times of one thread's (or several threads') frames, by package."""
    python, stacks = [], {}
    frames = sorted(events, key=lambda e: (e.get("tid"), e["ts"], -e["dur"]))
    for frame in frames:
        stack = stacks.setdefault(frame.get("tid"), [])
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
        # each kind of run's overheads beyond its steps (trace_kind), the first run's left out
        self.overheads: dict[str, list[float]] = collections.defaultdict(list)
        self.profiled = False
        self.started = False    # whether the process has run one already

    @staticmethod
    def trace_kind(method: str, traced: bool) -> str:
        return "stacks" if traced and method in STACKS else "traced" if traced else "untraced"

    def estimate(self, method: str, iters: int, auto: bool = False, traced: bool = True
                 ) -> float:
        kind = self.trace_kind(method, traced)
        seen = self.overheads[kind]
        trace = {"stacks": STACK_TRACE_S, "traced": TRACE_S}.get(kind, {}).get(self.kind, 0.0)
        overhead = statistics.median(seen) if seen else RUN_OVERHEAD_S[self.kind] + trace
        profile = (PROFILE_S[self.kind] + PROFILE_STEPS * self.step_s
                   if auto and not self.profiled else 0.0)
        return (overhead + iters * self.step_s * STEP_FACTOR[method] + profile
                + TRACKING_S[self.kind] * auto + FIRST_RUN_S[self.kind] * (not self.started))

    def observe(self, method: str, wall_s: float, steps_s: list[float], auto: bool,
                traced: bool) -> None:
        if method == NONE and steps_s:
            self.step_s = statistics.median(steps_s)
        if auto:
            self.profiled = True  # the profile's time goes into no overhead estimate
        elif self.started:   # the first run's holds the process's one-time start-up
            self.overheads[self.trace_kind(method, traced)].append(
                max(0.0, wall_s - sum(steps_s)))
        self.started = True


class ModelRuns:
    """One model's training runs in this process, each ``pretrain_gpt.main`` once, by name.

    The methods are no optimisation, megatron's full recompute, selective recompute (every
    recompute_modules set the trainer and megatron-core accept), block recompute (the fewest
    layers that fit), naive INT4 (``--adacc-policy quantize``) and Adacc auto; where auto is
    refused and names ``--adacc-lossy-sources``, auto with that flag too. Runs are
    deduplicated by name, and skipped or shrunk to fit the deadline. The last step of no
    optimisation, full recompute, naive INT4 and auto is traced (its top kernels)."""

    def __init__(self, name: str, spec: ModelSpec, device, sizes: Sizes, deadline: Deadline,
                 emit, rounds: int = 1):
        self.name, self.spec, self.device, self.sizes = name, spec, device, sizes
        self.deadline, self.emit, self.rounds = deadline, emit, rounds
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []    # the runs made, in order
        self.dry_run = device.type == "cpu"
        self.values = config_values(spec, self.dry_run)
        self.clock = RunClock(device_kind(self.dry_run), self.values,
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
            # what the medians leave out (untraced_end), and whether CUPTI outlives a trace
            "profiler_iterations_left_out": True,
            "teardown_cupti": os.environ.get("TEARDOWN_CUPTI") == "1",
            "estimated_step_s": self.clock.step_s, "rounds": rounds, "runs": {}, "budgets": [],
            "notes": []}

    @property
    def runs(self) -> dict:
        return self.report["runs"]

    def run(self, run_name: str, method: str, *flags: str, traced: bool | None = None) -> dict:
        if run_name in self.runs:
            return self.runs[run_name]
        auto, traced = "auto" in flags, method in TRACED if traced is None else traced
        iters = self.sizes.auto_iters if auto else self.sizes.iters
        left, needed = self.deadline.left(), self.clock.estimate(method, iters, auto, traced)
        if run_name != AGAIN and "none" in self.runs:
            # the drift's run keeps its time: without it no difference between methods run
            # one after another can be told from the machine's drift
            left -= self.clock.estimate(NONE, self.sizes.iters, False, False)
        if needed > left:
            shrunk = self.clock.estimate(method, self.sizes.min_iters, auto, traced)
            if shrunk > left:
                note(self.report["notes"], f"{self.name}: skipped {run_name}: would take "
                                            f"~{needed:.0f} s, {left:.0f} s left")
                self.runs[run_name] = {"method": method, "skipped": "out of time",
                                       "estimated_s": needed}
                self.emit(self.report)
                return self.runs[run_name]
            note(self.report["notes"], f"{self.name}: {run_name} shrunk to "
                                        f"{self.sizes.min_iters} iterations to fit "
                                        f"({left:.0f} s left)")
            iters = self.sizes.min_iters
        print(f"gpu_check: {self.name}: {run_name} ({iters} iterations, ~{needed:.0f} s)",
              flush=True)
        result = self._pretrain(run_name, method, iters, list(flags), traced)
        result["estimated_s"] = needed
        self.runs[run_name] = result
        if run_name != AGAIN and "step_time_s" in result:
            self.calls.append((run_name, method, flags))
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
            argv += ["--profile", "--use-pytorch-profiler",
                     "--profile-step-start", str(trace_start(iters)), "--profile-step-end",
                     str(iters), "--tensorboard-dir", os.path.join(f"{stem}.trace", "tensorboard")]
            if method in STACKS:
                argv.append("--pytorch-profiler-collect-callstack")
        if self.values["fp16"]:
            argv += ["--initial-loss-scale", str(INITIAL_LOSS_SCALE)]
        if self.sizes.profile_repeats:
            argv += ["--adacc-profile-repeats", str(self.sizes.profile_repeats)]
        leftover = torch.cuda.memory_allocated() if self.device.type == "cuda" else None
        out, err = io.StringIO(), io.StringIO()
        began = time.perf_counter()
        result = {"method": method, "flags": flags, "iters": iters,
                  "memory_held_before": leftover}
        watched = (_blocks_kept(self.device, result) if method == HELD
                   else contextlib.nullcontext())
        try:
            with watched:
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
        warm, total = self.sizes.warmup, untraced_end(iters, traced)
        work = adacc_work_iterations(records)
        result.update({
            "step_time_s": _median_of(records, "step_time_s", warm, total, work),
            "window_s": _window(records, "step_time_s", warm, total, work),
            # with Adacc's periodic work in: what these first iterations paid
            "step_time_with_adacc_work_s": _median_of(records, "step_time_s", warm, total),
            # what a long run settles on: the steps of the plan the run ended on
            "last_plan_step_time_s": _median_of(
                [r for r in records if r.get("plan_id") == records[-1].get("plan_id")],
                "step_time_s", warm, total, work) if records[-1].get("plan_id") else None,
            "step_times_s": steps,     # every iteration's, to tell noise from drift
            "adacc_work_iterations": sorted(work),
            "tokens_per_s": _median_of(records, "tokens_per_s", warm, total, work),
            "peak_bytes": peak, "peak_source": source,
            "allocated_before_step": _largest(records, "memory_allocated_before"),
            # the plan the run ended on: below peak_bytes where Adacc corrected an overrun
            "last_plan_peak_bytes": _largest(
                [r for r in records if r.get("plan_id") == records[-1].get("plan_id")],
                "max_memory_allocated"),
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
            note(self.report["notes"], f"{self.name}: no budgets: no optimisation's or full "
                                        "recompute's peak was not measured")
            self.report["budgets"] = [{"fraction": f, "budget_bytes": None}
                                      for f in BUDGET_FRACTIONS]
        else:
            self.report["budgets"] = [{"fraction": f, "budget_bytes": int(low + f * (high - low))}
                                      for f in BUDGET_FRACTIONS]
        budgets = [b["budget_bytes"] for b in self.report["budgets"]]
        if "overhead" in methods:   # before any auto run has profiled in this process
            self.run("retain plan", RETAIN_PLAN, "--adacc-policy", self._retain_plan())
        if "held" in methods and budgets[-1] is not None:   # the process's first auto run
            self.run("held", HELD, "--adacc-policy", "auto", "--adacc-memory-budget",
                     f"{budgets[-1]}B", "--adacc-strict", traced=False)
        for index, budget in enumerate(budgets):
            if budget is not None and "auto" in methods:
                self.run(f"auto {index}", AUTO, "--adacc-policy", "auto",
                         "--adacc-memory-budget", f"{budget}B", "--adacc-strict")
                # the refusal names the flag where lossy rebuild sources would fit
                if "--adacc-lossy-sources" in self.runs[f"auto {index}"].get("error", ""):
                    self.run(f"auto lossy {index}", AUTO_LOSSY, "--adacc-policy", "auto",
                             "--adacc-memory-budget", f"{budget}B", "--adacc-strict",
                             "--adacc-lossy-sources")
        if "overhead" in methods and budgets[-1] is not None:
            self.run("auto untracked", AUTO_UNTRACKED, "--adacc-policy", "auto",
                     "--adacc-memory-budget", f"{budgets[-1]}B", "--adacc-strict",
                     "--adacc-tracking", "off")
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
        if self.rounds > 1:
            self._second_round()
        else:
            self._drift(none)
        self.emit(self.report)
        return self.report

    def _second_round(self) -> None:
        """Every run again, in reverse order, untraced; each method's step then spans both.

        The host's speed moved by up to half between runs of one process on the H200. Run in
        the order A B ... B A, a drift that is steady over the section weighs alike on every
        method: each step is the median of both rounds' steps."""
        first_none = self.runs.get("none", {}).get("step_time_s")
        for run_name, method, flags in reversed(self.calls):
            auto = "auto" in flags
            iters = self.sizes.auto_iters if auto else self.sizes.iters
            needed = self.clock.estimate(method, iters, auto, False)
            if needed > self.deadline.left():
                note(self.report["notes"], f"{self.name}: {run_name}: no second round: would "
                                            f"take ~{needed:.0f} s, "
                                            f"{self.deadline.left():.0f} s left")
                continue
            print(f"gpu_check: {self.name}: {run_name}, round 2", flush=True)
            again = self._pretrain(f"{run_name} 2", method, iters, list(flags), False)
            first = self.runs[run_name]
            if again.get("step_time_s") is None:
                first["round_2"] = {"error": again.get("error", "no step measured")}
                continue
            step = statistics.median(first["window_s"] + again["window_s"])
            first.update(
                rounds_step_time_s=[first["step_time_s"], again["step_time_s"]],
                tokens_per_s=(first["tokens_per_s"] * first["step_time_s"] / step
                              if first.get("tokens_per_s") else None),
                step_time_s=step, window_s=first["window_s"] + again["window_s"],
                # peak_bytes stays the first round's, whose runs set the budgets: by the second
                # the process holds more (on the H200, 37 KB more, and full recompute's second
                # round peaked that much over the budget its first round set)
                round_2={key: again.get(key) for key in (
                    "step_time_s", "last_plan_step_time_s", "peak_bytes", "memory_held_before",
                    "plan_id", "plan_swaps", "swap_lines", "step_times_s", "wall_s")})
            self.emit(self.report)
        again_none = self.runs.get("none", {}).get("round_2", {}).get("step_time_s")
        if first_none and again_none:
            self.report["drift"] = {"first_step_s": first_none, "last_step_s": again_none,
                                    "change": again_none / first_none - 1}

    def _retain_plan(self) -> str:
        """A plan file retaining every site in every layer: the all-retain plan auto picks."""
        from megatron_adacc.common.plan import Plan

        path = os.path.join(self.workdir, "retain.yaml")
        Plan.uniform({}).save(path)
        return path

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


