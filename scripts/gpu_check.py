"""Measure on a lent GPU, in one command planned to fit a time budget, what the CPU cannot.

    python scripts/gpu_check.py [--device-budget-s 380] [--sections codecs syncs training]
        [--models gpt-345m llama-1b] [--out gpu_check.json] [--doc docs/gpu.md]
    python scripts/gpu_check.py --dry-run      # tiny shapes on the CPU, every section
    python scripts/gpu_check.py --render RESULTS.json --doc docs/gpu.md

Each section runs in a child process (forked in a dry run), so a crashed CUDA context loses one
section only:
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

This file is the parent and the children's entry; the sections live in ``scripts/gpu/``, a module
each (``codecs``, ``syncs``, ``training``), with the predictions (``predict``), the page
(``report``) and what they share (``common``: sizes, models, methods, time estimates).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# cuBLAS needs this before CUDA starts to run deterministically (the exactness check compares
# two separately trained models, so every kernel must be run-to-run reproducible).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# The training runs of a model share a process, and each traces its last steps. Unless told to
# tear CUPTI down, Kineto leaves it attached when a trace ends (pytorch/pytorch#144455: 10-20%
# slower training afterwards), so every run after the first traced one would pay for it.
os.environ.setdefault("TEARDOWN_CUPTI", "1")

import torch  # noqa: E402
from gpu.codecs import codecs_worker  # noqa: E402
from gpu.common import (  # noqa: E402
    AUTO,
    AUTO_LOSSY,
    AUTO_UNTRACKED,
    BLOCK,
    CHILD_GRACE_S,
    CHILD_START_S,
    CODEC_CASE_S,
    CODEC_GRAPH_S,
    CODEC_SPEED_S,
    DIAGNOSTIC_METHODS,
    DRY_MICRO_BATCH,
    FULL,
    HELD,
    MIN_SECTION_S,
    MODELS,
    NONE,
    OPTIONAL_METHODS,
    PREDICT_S,
    QUANTIZE,
    RETAIN_PLAN,
    SECTIONS,
    SELECTIVE,
    SYNC_MODEL_S,
    TRACED,
    Deadline,
    Sizes,
    device_kind,
    note,
    sizes_for,
    write_json,
)
from gpu.predict import accelerator_for, predict  # noqa: E402
from gpu.report import summary_table, write_page  # noqa: E402
from gpu.syncs import syncs_worker  # noqa: E402
from gpu.training import ModelRuns, RunClock, config_values, selective_sets  # noqa: E402


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device-budget-s", type=float, default=380.0,
                        help="plan the work to end within this many seconds")
    parser.add_argument("--dry-run", "--tiny", action="store_true", dest="dry_run",
                        help="tiny models, few iterations, on the CPU: every section end to end")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS),
                        default=["gpt-345m", "llama-1b"])
    parser.add_argument("--methods", nargs="+", choices=OPTIONAL_METHODS + DIAGNOSTIC_METHODS,
                        default=list(OPTIONAL_METHODS),
                        help="which methods beside no optimisation and full recompute (which "
                             "set the budgets) the training section runs; overhead (asked "
                             "for only) splits Adacc's all-retain step into its parts; held "
                             "(asked for only) names the device blocks the first auto run "
                             "leaves allocated")
    parser.add_argument("--rounds", type=int, choices=(1, 2), default=1,
                        help="2: run each model's runs again in reverse order, so a drift of "
                             "the machine over the section weighs alike on every method")
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



def training_worker(name: str, device, sizes: Sizes, deadline: Deadline, emit,
                    accelerator: str | None, methods=OPTIONAL_METHODS, rounds: int = 1) -> None:
    from megatron_adacc.models import build as model_lib

    warnings.filterwarnings("ignore")
    # the predictions after the runs take seconds of planning
    runs = ModelRuns(name, MODELS[name], device, sizes,
                     Deadline(deadline.left() - PREDICT_S[device_kind(device.type == "cpu")]), emit,
                     rounds)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    try:
        runs.measure(methods)  # each run is pretrain_gpt.py's, with a process group of its own
    finally:
        model_lib.init_distributed(1)   # the predictions' profiles
        predict(runs, accelerator_for(device_name, accelerator))
        emit(runs.report)
        shutil.rmtree(runs.workdir, ignore_errors=True)


def worker_main(args) -> int:
    """A section's child: measures, rewriting ``--worker-out`` after every item."""
    device = torch.device("cpu" if args.dry_run else "cuda")
    # the parent's clock: the child's own start-up is spent from its time
    sizes, deadline = sizes_for(args.dry_run), Deadline(args.deadline_at - time.time())

    def emit(part) -> None:
        write_json(args.worker_out, part)

    if device.type == "cuda":
        torch.cuda.set_device(0)
    if args.worker == "codecs":
        codecs_worker(device, sizes, deadline, emit)
    elif args.worker == "syncs":
        syncs_worker(device, sizes, deadline, emit)
    else:
        training_worker(args.worker.split(":", 1)[1], device, sizes, deadline, emit,
                        args.hardware, args.methods, args.rounds)
    return 0


# --- the parent: plan the time, run the children, write the report ----------------------------

def estimate_s(section: str, dry_run: bool, optional=OPTIONAL_METHODS, rounds: int = 1) -> float:
    """A section's seconds, from its sizes and the methods it runs (leads; see the constants)."""
    from megatron_adacc import codecs

    kind, sizes = device_kind(dry_run), sizes_for(dry_run)
    if section == "codecs":
        cases = len(codecs.NAMES) * 3 * (len(sizes.codec_shapes) + 1) + len(sizes.codec_shapes)
        per_codec = CODEC_SPEED_S[kind] + CODEC_GRAPH_S[kind]
        return CHILD_START_S[kind] + len(codecs.NAMES) * per_codec + cases * CODEC_CASE_S[kind]
    if section == "syncs":
        configs = len(sizes.sync_models) * len(sizes.sync_dtypes)
        # the five policies' counts; the exactness check after them takes what time is left
        return CHILD_START_S[kind] + configs * 5 * SYNC_MODEL_S[kind]
    name = section.split(":", 1)[1]
    spec = MODELS[name]
    values = config_values(spec, dry_run)
    clock = RunClock(kind, values, DRY_MICRO_BATCH if dry_run else spec.micro_batch)
    counts = {"auto": [AUTO] * 3 + [AUTO_LOSSY], "block": [BLOCK] * 2, "quantize": [QUANTIZE],
              "selective": [SELECTIVE] * len(selective_sets()),
              "overhead": [RETAIN_PLAN, AUTO_UNTRACKED], "held": [HELD]}
    methods = [NONE, FULL] + [m for name in optional for m in counts[name]]
    total = CHILD_START_S[kind] + PREDICT_S[kind]
    for method in methods:
        auto = method in (AUTO, AUTO_LOSSY, AUTO_UNTRACKED, HELD)
        iters = sizes.auto_iters if auto else sizes.iters
        total += clock.estimate(method, iters, auto, method in TRACED)
        clock.profiled |= auto  # the first auto run profiles
        clock.started = True    # and the first run pays the process's start-up
        if rounds > 1:  # again, untraced, with the profile stored
            total += clock.estimate(method, iters, auto, False)
    # the drift's run, where no second round measures the drift
    return total + (clock.estimate(NONE, sizes.iters, False, False) if rounds == 1 else 0.0)


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
        command += ["--methods", *args.methods, "--rounds", str(args.rounds)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        child = (_Forked(command[2:], env) if args.dry_run
                 else subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True))
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


class _Forked:
    """A dry run's section child: forked from this process, not started anew.

    It keeps the parent's imports (torch, megatron: seconds a child on two cores). A GPU run's
    children start anew: a CUDA context does not survive a fork. Polled as a Popen is."""

    def __init__(self, argv: list[str], env: dict):
        # what the children import, once, before the first fork
        import pretrain_gpt  # noqa: F401
        from megatron.training import training  # noqa: F401

        sys.stdout.flush()
        sys.stderr.flush()
        self.returncode = None
        self.pid = os.fork()
        if self.pid:
            return
        code = 1
        try:
            os.setsid()  # a process group of its own, as start_new_session gives
            os.chdir(ROOT)
            os.environ.clear()
            os.environ.update(env)
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported as the exec'd child would
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


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
    estimates = {s: estimate_s(s, args.dry_run, args.methods, args.rounds) for s in sections}
    results["estimates_s"] = estimates
    print("gpu_check: plan: " + ", ".join(f"{s} ~{e:.0f} s" for s, e in estimates.items())
          + f"; budget {args.device_budget_s:.0f} s", flush=True)

    def write(partial: dict) -> None:
        partial["elapsed_s"] = time.monotonic() - began
        write_json(args.out, partial)
        if args.doc:
            write_page(args.doc, partial)

    for index, section in enumerate(sections):
        share = allot(section, estimates, sections[index + 1:], budget.left() - CHILD_GRACE_S)
        if share < MIN_SECTION_S:
            note(results["notes"], f"skipped {section}: {share:.0f} s would be left for it "
                                    f"(estimated {estimates[section]:.0f} s)")
            _store(results, section, {"skipped": "out of time"})
            write(results)
            continue
        if share < estimates[section]:
            note(results["notes"], f"{section} gets {share:.0f} s of an estimated "
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
            note(results["notes"], f"{section}: {ended}")
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


if __name__ == "__main__":
    sys.exit(main())
