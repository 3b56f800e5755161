"""Process lifecycle soak: many consecutive short training runs, counting how each ended.

    python scripts/soak_lifecycle.py [--runs 50] [--iters 3] [--timeout 240]

It runs ``--runs`` times ``torchrun --nproc_per_node 2 pretrain_gpt.py ...
--pipeline-model-parallel-size 2`` and ``--runs`` times ``python pretrain_gpt.py ...``. Each is a
few iterations on the tiny CPU config, one after another. It counts the exit codes:
- 0 (clean);
- an abort (-6 / 134: SIGABRT, e.g. ``terminate called without an active exception`` at shutdown);
- any other code, and hangs (killed at ``--timeout``).
It prints a table and writes JSON (docs/results/soak_lifecycle.json unless --json says otherwise).
The exit status is 1 when any run did not end with 0.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN = os.path.join(ROOT, "pretrain_gpt.py")
TINY = ["--config", os.path.join(ROOT, "configs", "tiny-cpu.yaml"), "--num-layers", "2",
        "--hidden-size", "64", "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--eval-interval", "1000",
        "--eval-iters", "0", "--lr-warmup-iters", "1", "--log-interval", "1000"]
ABORTS = (-6, 134)      # SIGABRT as subprocess reports it, and as a shell would
HANG = "hang"


def _torchrun() -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--standalone"]


def commands(iters: int) -> dict[str, list[str]]:
    flags = [*TINY, "--train-iters", str(iters)]
    return {"torchrun PP=2": [*_torchrun(), PRETRAIN, *flags,
                              "--pipeline-model-parallel-size", "2"],
            "single process": [sys.executable, PRETRAIN, *flags]}


def portable(argument: str) -> str:
    """``argument`` as the record shows it, so that a record reads the same from any checkout.

    The interpreter shows as ``python``, and paths inside the repository are relative to it."""
    if argument == sys.executable:
        return "python"
    if os.path.isabs(argument) and not os.path.relpath(argument, ROOT).startswith(".."):
        return os.path.relpath(argument, ROOT)
    return argument


def run_once(command: list[str], timeout: float) -> tuple[int | str, float, str]:
    """(exit code or "hang", seconds, the stderr's last lines)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        # Its own session: a hang is killed with every process it started.
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            _, err = process.communicate(timeout=timeout)
            code: int | str = process.returncode
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            _, err = process.communicate()
            code = HANG
    return code, time.perf_counter() - started, "\n".join(err.splitlines()[-5:])


def classify(code: int | str) -> str:
    if code == HANG:
        return "hangs"
    if code in ABORTS:
        return "aborts"
    return "exit 0" if code == 0 else "other exits"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs of each kind")
    parser.add_argument("--iters", type=int, default=3, help="training iterations per run")
    parser.add_argument("--timeout", type=float, default=240.0,
                        help="seconds after which a run counts as a hang")
    parser.add_argument("--kinds", nargs="+", choices=list(commands(1)), default=None,
                        help="which kinds of run (default: both)")
    parser.add_argument("--json", default=os.path.join(ROOT, "docs", "results",
                                                       "soak_lifecycle.json"))
    args = parser.parse_args(argv)

    results = {}
    for kind, command in commands(args.iters).items():
        if args.kinds and kind not in args.kinds:
            continue
        counts = collections.Counter({"exit 0": 0, "aborts": 0, "other exits": 0, "hangs": 0})
        failures, seconds = [], []
        for index in range(args.runs):
            code, elapsed, tail = run_once(command, args.timeout)
            counts[classify(code)] += 1
            seconds.append(elapsed)
            if code != 0:
                failures.append({"run": index, "exit": code, "stderr_tail": tail})
                print(f"{kind} run {index}: exit {code}\n{tail}", file=sys.stderr, flush=True)
            if (index + 1) % 10 == 0:
                print(f"{kind}: {index + 1} runs, {dict(counts)}", file=sys.stderr, flush=True)
        results[kind] = {"runs": args.runs, **counts, "failures": failures,
                         "mean_seconds": sum(seconds) / max(1, len(seconds))}

    header = f"{'runs':<16}{'total':>7}{'exit 0':>8}{'aborts':>8}{'other':>7}{'hangs':>7}"
    print(header)
    for kind, row in results.items():
        print(f"{kind:<16}{row['runs']:>7}{row['exit 0']:>8}{row['aborts']:>8}"
              f"{row['other exits']:>7}{row['hangs']:>7}")
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as handle:
        json.dump({"args": {**vars(args), "json": portable(os.path.abspath(args.json))},
                   "commands": {kind: [portable(part) for part in command]
                                for kind, command in commands(args.iters).items()},
                   "results": results}, handle, indent=1)
    return 0 if all(row["exit 0"] == row["runs"] for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
