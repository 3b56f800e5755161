"""Step time at two data-parallel ranks on megatron-core's engine, overlapped reduction or not.

The engine runs under torchrun, with gloo on this machine. It compares the gradient reduction
overlapped with backward in several buckets (--overlap-grad-reduce --ddp-bucket-size) against one
reduction after backward, with and without the distributed optimizer.

On a CPU over gloo there is no separate communication engine to overlap with, so no target is set.
The table shows that the mechanism runs (the bucket count, the same losses), and what it costs or
saves here. Runs are interleaved over rounds, so drift on a shared machine hits them alike. The step
time is the median over every round's steps after its first. It prints a table and writes JSON to
``--out`` (default docs/results/engine.json).

    python scripts/bench_engine.py [--quick] [--rounds 3] [--iters 6]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "one reduction": [],
    "overlapped, bucketed": ["--overlap-grad-reduce"],
    "distributed optimizer": ["--use-distributed-optimizer"],
    "distributed, overlapped": ["--use-distributed-optimizer", "--overlap-grad-reduce"],
}


def model_flags(args) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
            "--eval-iters", "0", "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--seq-length", str(args.seq),
            "--max-position-embeddings", str(args.seq), "--micro-batch-size", "2",
            "--global-batch-size", "8", "--lr-warmup-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--train-iters", str(args.iters),
            "--ddp-bucket-size", str(args.bucket_size)]


def worker(flags: list[str], out: str) -> None:
    """One run under torchrun; rank 0 writes its step times, losses and bucket count."""
    from megatron.training import training

    import pretrain_gpt
    from megatron_adacc import megatron_lm

    # The DDP-wrapped model Megatron-LM builds, kept to count its gradient buckets.
    built = {}
    setup = training.setup_model_and_optimizer

    def keep(*args, **kwargs):
        result = setup(*args, **kwargs)
        built["model"] = result[0]
        return result

    training.setup_model_and_optimizer = keep
    if pretrain_gpt.main(flags) != 0:
        raise SystemExit("bench_engine.py: pretrain_gpt.py failed")
    records = megatron_lm.session().records
    if int(os.environ["RANK"]) == 0:
        Path(out).write_text(json.dumps({
            "step_time_s": [r["step_time_s"] for r in records],
            "losses": [r["loss"] for r in records],
            "buckets": sum(len(b.buckets) for chunk in built["model"]
                           for b in chunk.buffers)}))


def run(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        out = os.path.join(work, "run.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", __file__, "--worker", out, *flags]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            raise SystemExit(f"bench_engine.py: a run failed:\n{done.stderr[-3000:]}")
        return json.loads(Path(out).read_text())


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[3:], sys.argv[2])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 steps")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--bucket-size", type=int, default=200_000,
                        help="elements per bucket with --overlap-grad-reduce")
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "engine.json"))
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.iters = 2, 4
    times = {name: [] for name in RUNS}
    seen = {}
    for _ in range(args.rounds):
        for name, extra in RUNS.items():
            result = run([*model_flags(args), *extra])
            times[name] += result["step_time_s"][1:]
            seen[name] = result
    rows = {name: {"median_step_time_s": statistics.median(times[name]),
                   "buckets": seen[name]["buckets"], "losses": seen[name]["losses"]}
            for name in RUNS}
    base = rows["one reduction"]
    print(f"{'DP=2 on gloo':26s} {'buckets':>8s} {'step time':>12s} {'vs one':>8s} "
          f"{'max loss gap':>13s}")
    for name, row in rows.items():
        gap = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], base["losses"]))
        row["max_relative_loss_gap"] = gap
        print(f"{name:26s} {row['buckets']:8d} {row['median_step_time_s'] * 1e3:9.1f} ms "
              f"{row['median_step_time_s'] / base['median_step_time_s']:7.2f}x {gap:13.2e}")
    data = {"command": " ".join(["python", "scripts/bench_engine.py", *sys.argv[1:]]),
            "shape": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq,
                      "micro_batch": 2, "global_batch": 8, "bucket_size": args.bucket_size},
            "rounds": args.rounds, "iters": args.iters, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
