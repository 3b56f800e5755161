"""Training on megatron-core's engine: its DistributedDataParallel (buckets, overlapped
reduction), its optimizer (distributed with --use-distributed-optimizer) and
dist_checkpointing; Adacc plans with the bytes that engine holds."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_adacc.profiling import hardware
from megatron_adacc.training.arguments import parse_args
from megatron_adacc.training.checkpointing import CheckpointError
from megatron_adacc.training.trainer import Trainer
from multirank_engine import held_bytes
from test_trainer import TINY

HERE = Path(__file__).resolve().parent
NO_DROPOUT = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"],
                                   ["--use-distributed-optimizer"],
                                   ["--bf16", "--use-distributed-optimizer"]])
def test_the_planned_static_bytes_are_what_the_engine_holds_at_one_rank(flags):
    trainer = Trainer(parse_args(TINY + ["--train-iters", "2", *flags]))
    planned, step = trainer.adacc.static_bytes, trainer.adacc.optimizer_step_bytes
    trainer.train()
    # After a step the fp16 optimizer's fp32 gradient copies are alive; the next step's
    # zero_grad drops them before its forward, so the activations never meet them.
    assert held_bytes(trainer) == planned + step
    assert (step > 0) == ("--fp16" in flags)
    trainer.optimizer.zero_grad()
    assert held_bytes(trainer) == planned
    if "--use-distributed-optimizer" not in flags:  # what the Python API plans with
        assert hardware.model_static_bytes(trainer.model) == planned
        assert hardware.model_step_bytes(trainer.model) == step


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("engine") / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(HERE / "multirank_engine.py"), str(checkpoints), *TINY, *NO_DROPOUT]
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path))
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoints, json.loads(done.stdout.strip().splitlines()[-1])


def test_data_parallel_on_megatrons_engine_matches_one_rank(two_ranks):
    _, ranks = two_ranks
    single = [r["loss"] for r in Trainer(parse_args(TINY + NO_DROPOUT)).train()]
    single_bf16 = [r["loss"] for r in Trainer(parse_args(TINY + NO_DROPOUT + ["--bf16"])).train()]
    report = ranks[0]
    assert report["overlapped"]["buckets"] >= 3
    for name in ("ddp", "distributed", "overlapped"):
        assert _relative_gap(report[name]["losses"], single) < 1e-5, name
    assert _relative_gap(report["overlapped_bf16"]["losses"], single_bf16) < 1e-2


def test_the_planned_static_bytes_are_what_the_engine_holds_at_two_ranks(two_ranks):
    _, ranks = two_ranks
    for name in ("ddp", "distributed", "overlapped", "overlapped_bf16"):
        # Each rank's prediction, made before the first step, is what it holds after it;
        # Adacc budgets every rank with the most any holds.
        assert all(r[name]["held"] == r[name]["predicted"] for r in ranks), name
        assert all(r[name]["planned_static"] == max(q[name]["held"] for q in ranks)
                   for r in ranks), name
    # The distributed optimizer holds half the Adam state.
    assert all(r["distributed"]["held"] < r["ddp"]["held"] for r in ranks)


def test_a_checkpoint_written_at_two_ranks_resumes_at_two_and_at_one(two_ranks):
    checkpoints, ranks = two_ranks
    straight = ranks[0]["overlapped"]["losses"]
    assert _relative_gap(ranks[0]["resume"], straight) < 1e-5
    # dp_reshardable lays the optimizer state out by bucket: the same bucket flags.
    rest = Trainer(parse_args(TINY + NO_DROPOUT + [
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000",
        "--load", str(checkpoints)])).train()
    assert len(rest) == 3
    assert _relative_gap([r["loss"] for r in rest], straight[3:]) < 1e-5


def test_adacc_budget_holds_under_the_distributed_optimizer_at_two_ranks(two_ranks):
    _, ranks = two_ranks
    for report in ranks:
        budget = report["budget"]
        assert budget["plan"] != "none"
        assert budget["static"] + budget["activation_peak"] <= budget["budget"], budget


def test_a_tensor_parallel_checkpoints_weights_load_at_one_rank_with_no_load_optim(tmp_path):
    from megatron_adacc.training.checkpointing import CheckpointError

    common = [*TINY, "--hidden-dropout", "0", "--attention-dropout", "0",
              "--make-vocab-size-divisible-by", "256", "--train-iters", "3"]
    metrics, ckpt = tmp_path / "tp2.jsonl", tmp_path / "ck"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(HERE.parent / "pretrain_gpt.py"), *common, "--tensor-model-parallel-size",
           "2", "--save", str(ckpt), "--save-interval", "2", "--metrics-file", str(metrics)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    (ckpt / "iter_0000003").rename(tmp_path / "later")  # resume from iteration 2
    (ckpt / "latest_checkpointed_iteration.txt").write_text("2\n")
    tp2 = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    with pytest.raises(CheckpointError) as refused:
        Trainer(parse_args(common + ["--load", str(ckpt)]))
    assert str(refused.value) == (
        f"--load {ckpt}: iter_0000002 was written with --tensor-model-parallel-size 2 "
        f"--pipeline-model-parallel-size 1, this run has 1 and 1; add --no-load-optim to load "
        f"its weights only")
    (record,) = Trainer(parse_args(common + ["--load", str(ckpt), "--no-load-optim"])).train()
    assert record["iteration"] == 3
    assert _relative_gap([record["loss"]], [tp2[2]]) < 1e-5


def test_an_asynchronous_save_resumes_on_the_uninterrupted_trajectory(tmp_path):
    # --async-save writes in a background process (gloo included); the run publishes the
    # checkpoint once written and waits for the last one before it exits.
    flags = TINY + NO_DROPOUT
    straight = [r["loss"] for r in Trainer(parse_args(flags)).train()]
    ckpt = str(tmp_path / "ck")
    first = Trainer(parse_args(flags + ["--save", ckpt, "--async-save", "--save-interval", "1",
                                        "--exit-interval", "3"])).train()
    assert sorted(p.name for p in Path(ckpt).iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    rest = Trainer(parse_args(flags + ["--load", ckpt])).train()
    assert [r["loss"] for r in first + rest] == straight


def test_finetune_loads_the_weights_only_and_starts_at_iteration_zero(tmp_path):
    flags = TINY + NO_DROPOUT
    ckpt = str(tmp_path / "ck")
    trained = Trainer(parse_args(flags + ["--save", ckpt]))
    trained.train()
    tuned = Trainer(parse_args(flags + ["--load", ckpt, "--finetune", "--train-iters", "2"]))
    assert tuned.iteration == 0 and tuned.scheduler.num_steps == 0
    assert all(not inner.optimizer.state for inner in tuned.optimizer.chained_optimizers)
    assert all(torch.equal(a, b) for a, b in zip(trained.model.parameters(),
                                                 tuned.model.parameters()))
    assert [r["iteration"] for r in tuned.train()] == [1, 2]


def test_a_distributed_optimizer_checkpoint_refuses_other_buckets_in_one_line(tmp_path):
    flags = TINY + NO_DROPOUT + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                 "--ddp-bucket-size", "20000", "--train-iters", "2"]
    Trainer(parse_args(flags + ["--save", str(tmp_path)])).train()
    other = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size",
             "40000"]
    with pytest.raises(CheckpointError) as refused:
        Trainer(parse_args(TINY + NO_DROPOUT + other + ["--train-iters", "4",
                                                        "--load", str(tmp_path)])).train()
    assert str(refused.value) == (
        f"--load {tmp_path}: iter_0000002's distributed-optimizer state is laid out by DDP's "
        f"buckets (--ddp-bucket-size 20000 there, 40000 here); resume with the same flags, or "
        f"add --no-load-optim to load its weights only")
    # Its weights still load.
    Trainer(parse_args(TINY + NO_DROPOUT + other + ["--train-iters", "4", "--load",
                                                    str(tmp_path), "--no-load-optim"])).train()
