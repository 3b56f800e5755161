"""Per-stage plans against one shared plan and against full recompute, under pipeline parallelism.

The schedule is megatron-core's 1F1B, under torchrun on this machine. At one per-device budget where
the first stage (the most micro-batches in flight) cannot keep every activation, three runs of the
trainer on the same tiny GPT:

    per-stage   --adacc-policy auto: every stage the fastest plan that fits the budget
    shared      the first stage's plan (the most constrained stage's) applied to every stage,
                as a plan file: what one setting for all stages does
    full        --adacc-policy full-recompute (Megatron-LM's full recomputation)

Each run trains a few steps. Runs are interleaved over rounds, so drift on a shared machine hits
them alike. Tokens/s is the median over the steps after the first of every round. Every run uses the
same ruler, attention and dtype. It prints a table and writes JSON to ``--out`` and
docs/results/pipeline.json.

    python scripts/bench_pipeline.py [--pipeline 2] [--rounds 2]
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
METHODS = ("per-stage", "shared", "full")


def model_flags(args) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tiny-cpu.yaml"), "--log-interval", "1000",
            "--eval-iters", "0", "--num-layers", str(args.layers), "--hidden-size",
            str(args.hidden), "--seq-length", str(args.seq), "--max-position-embeddings",
            str(args.seq), "--micro-batch-size", "2",
            "--global-batch-size", str(2 * args.micro_batches), "--lr-warmup-iters", "0",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--pipeline-model-parallel-size", str(args.pipeline)]


def worker(flags: list[str], out: str) -> None:
    """One training run under torchrun; rank 0 writes its records (every stage's readings).

    For auto, rank 0 also writes the shared plan: the first stage's plan on every stage's layers."""
    import pretrain_gpt
    from megatron_adacc import megatron_lm
    from megatron_adacc.common.plan import Plan

    if pretrain_gpt.main(flags) != 0:
        raise SystemExit("bench_pipeline.py: pretrain_gpt.py failed")
    session = megatron_lm.session()
    records = session.records
    if int(os.environ["RANK"]) == 0:
        result = {"records": records}
        stages = session.adacc.stage_plans
        if stages is not None:
            first = stages[0].result.layer_decisions
            result["shared_plan"] = Plan.from_layers(first * len(stages)).to_yaml()
        Path(out).write_text(json.dumps(result))


def run(args, method: str, budget_flags: list[str], scratch: Path, shared_plan: Path) -> dict:
    policy = {"per-stage": ["--adacc-policy", "auto", *budget_flags],
              "shared": ["--adacc-policy", str(shared_plan)],
              "full": ["--adacc-policy", "full-recompute"]}[method]
    out = scratch / f"{method}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           str(args.pipeline), __file__, "--worker", str(out), "--",
           *model_flags(args), "--train-iters", str(args.iters),
           "--activation-measure-interval", "1", *policy]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pipeline", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--budget", default="2.9MiB",
                        help="per device; the first stage must not fit everything")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="bench_results/pipeline.json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.flags, args.worker)

    scratch = Path(tempfile.mkdtemp(prefix="bench_pipeline_"))
    db = ["--adacc-profile-db", str(scratch / "profiles.sqlite")]
    budget_flags = ["--adacc-memory-budget", args.budget, *db]
    shared_plan = scratch / "shared.yaml"
    # The per-stage run first: it profiles (once, on the first stage) and gives the shared
    # plan; later rounds reuse the profile.
    first = run(args, "per-stage", budget_flags, scratch, shared_plan)
    shared_plan.write_text(first["shared_plan"])
    steps = {method: [] for method in METHODS}
    readings = {}
    for round_ in range(args.rounds):
        for method in METHODS:
            result = first if (round_, method) == (0, "per-stage") else \
                run(args, method, budget_flags, scratch, shared_plan)
            records = result["records"]
            steps[method] += [r["tokens_per_s"] for r in records[1:]]
            readings[method] = records[-1]["stages"]
    rows = []
    for method in METHODS:
        stages = readings[method]
        rows.append({"method": method, "tokens_per_s": statistics.median(steps[method]),
                     "steps": len(steps[method]),
                     "stages": [{key: s.get(key) for key in
                                 ("pipeline_stage", "plan_id", "activation_bytes",
                                  "activation_peak_bytes", "predicted_activation_bytes",
                                  "predicted_activation_peak_bytes", "static_bytes")}
                                for s in stages]})
    full = rows[-1]["tokens_per_s"]
    print(f"PP={args.pipeline}, {args.layers} layers, {args.micro_batches} micro-batches, "
          f"budget {args.budget} per device")
    print(f"{'method':<10} {'tokens/s':>9} {'vs full':>8}  per stage: plan, activation peak "
          f"measured (predicted), static bytes")
    for row in rows:
        cells = "; ".join(
            f"{s['pipeline_stage']}: {s['plan_id'] or '-'} {s['activation_peak_bytes']} "
            f"({s['predicted_activation_peak_bytes'] or '-'}) +{s['static_bytes']}"
            for s in row["stages"])
        print(f"{row['method']:<10} {row['tokens_per_s']:>9.0f} "
              f"{row['tokens_per_s'] / full:>7.2f}x  {cells}")
    report = {"pipeline_model_parallel_size": args.pipeline, "num_layers": args.layers,
              "hidden_size": args.hidden, "seq_length": args.seq,
              "num_micro_batches": args.micro_batches, "budget": args.budget,
              "rounds": args.rounds, "iters": args.iters, "results": rows,
              "shared_plan": first["shared_plan"]}
    for path in (Path(args.out), ROOT / "docs" / "results" / "pipeline.json"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
