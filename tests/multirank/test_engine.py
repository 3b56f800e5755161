"""Training on megatron-core's engine: its DistributedDataParallel (buckets, overlapped
reduction), its optimizer (distributed with --use-distributed-optimizer) and
dist_checkpointing; Adacc plans with the bytes that engine holds."""
import json
from pathlib import Path

import pytest
import torch

from megatron_adacc.profiling import engine_memory
from helpers import forked
from helpers.engine import held_bytes
from helpers.storages import LiveBytes
from helpers.pretrain import child_env, pretrain

HERE = Path(__file__).resolve().parent
NO_DROPOUT = ["--train-iters", "6", "--hidden-dropout", "0", "--attention-dropout", "0"]


def _relative_gap(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _losses(*flags) -> list[float]:
    return [r["loss"] for r in pretrain(*flags).records]


@pytest.mark.parametrize("flags", [[], ["--bf16"], ["--fp16", "--initial-loss-scale", "1024"],
                                   ["--use-distributed-optimizer"],
                                   ["--bf16", "--use-distributed-optimizer"]])
def test_the_planned_static_bytes_are_what_the_engine_holds_at_one_rank(flags):
    session = pretrain("--train-iters", "2", *flags)
    planned, step = session.adacc.static_bytes, session.adacc.optimizer_step_bytes
    # After a step the fp16 optimizer's fp32 gradient copies are alive; the next step's
    # zero_grad drops them before its forward, so the activations never meet them.
    assert held_bytes(session) == planned + step
    assert (step > 0) == ("--fp16" in flags)
    session.optimizer.zero_grad()
    assert held_bytes(session) == planned
    if "--use-distributed-optimizer" not in flags:  # what the Python API plans with
        assert engine_memory.model_static_bytes(session.model) == planned
        assert engine_memory.model_step_bytes(session.model) == step


@pytest.mark.parametrize("flags", [["--fp16", "--initial-loss-scale", "1024"],
                                   ["--bf16", "--use-distributed-optimizer"]])
def test_the_planned_step_bytes_are_what_torchs_foreach_adam_step_makes(flags, monkeypatch):
    """On a GPU without Transformer Engine or Apex, megatron steps with torch's AdamW, whose
    foreach path makes a workspace like every main parameter. Here the host runs foreach too."""
    from torch.optim import optimizer as torch_optimizer

    devices = torch_optimizer._get_foreach_kernels_supported_devices()
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: [*devices, "cpu"])
    session = pretrain("--train-iters", "2", *flags)
    planned = session.adacc.optimizer_step_bytes
    session.optimizer.zero_grad()  # drops the last step's fp32 gradient copies
    with LiveBytes() as live:
        session.optimizer.step()
    assert live.peak == planned
    mains = sum(main.numel() * 4 for group in session.optimizer.optimizer.param_groups
                for main in group["params"])
    copies = mains if "--fp16" in flags else 0
    assert planned == copies + max(sum(main.numel() * 4 for main in group["params"])
                                   for group in session.optimizer.optimizer.param_groups)
    # The model's rule, as if in one group, holds the no-weight-decay group's too.
    if "--use-distributed-optimizer" not in flags:
        assert engine_memory.model_step_bytes(session.model) == copies + mains


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    checkpoints = tmp_path_factory.mktemp("engine") / "ck"
    done = forked.torchrun(2, [HERE / "multirank_engine.py", checkpoints, *NO_DROPOUT],
                           cwd=checkpoints.parent, env=child_env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return checkpoints, json.loads(done.stdout.strip().splitlines()[-1])


def test_data_parallel_on_megatrons_engine_matches_one_rank(two_ranks):
    _, ranks = two_ranks
    single = _losses(*NO_DROPOUT)
    single_bf16 = _losses(*NO_DROPOUT, "--bf16")
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
    # Megatron-LM's torch_dist checkpoint of the distributed optimizer reshards to one rank.
    rest = pretrain(*NO_DROPOUT, "--use-distributed-optimizer", "--overlap-grad-reduce",
                    "--ddp-bucket-size", "20000", "--load", str(checkpoints)).records
    assert len(rest) == 3
    assert _relative_gap([r["loss"] for r in rest], straight[3:]) < 1e-5


def test_adacc_budget_holds_under_the_distributed_optimizer_at_two_ranks(two_ranks):
    _, ranks = two_ranks
    for report in ranks:
        budget = report["budget"]
        assert budget["plan"] != "none"
        assert budget["static"] + budget["activation_peak"] <= budget["budget"], budget


def test_an_asynchronous_save_resumes_on_the_uninterrupted_trajectory(tmp_path):
    # --async-save writes in the background; the run waits for the last one before it exits.
    straight = _losses(*NO_DROPOUT)
    ckpt = str(tmp_path / "ck")
    first = _losses(*NO_DROPOUT, "--save", ckpt, "--async-save", "--save-interval", "1",
                    "--exit-interval", "3")
    assert sorted(p.name for p in Path(ckpt).iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    rest = _losses(*NO_DROPOUT, "--load", ckpt)
    assert first + rest == straight


def test_finetune_loads_the_weights_only_and_starts_at_iteration_zero(tmp_path, monkeypatch):
    from megatron_adacc import Adacc

    ckpt = str(tmp_path / "ck")
    trained = pretrain(*NO_DROPOUT, "--save", ckpt, "--save-interval", "6")
    seen = {}
    real = Adacc.setup

    def setup(adacc, model, *args, **kwargs):  # the first step, before its forward
        from megatron_adacc import megatron_lm

        seen["weights"] = [p.detach().clone() for p in model.parameters()]
        seen["iteration"] = megatron_lm.session().args.iteration
        return real(adacc, model, *args, **kwargs)

    monkeypatch.setattr(Adacc, "setup", setup)
    tuned = pretrain(*NO_DROPOUT, "--load", ckpt, "--finetune", "--train-iters", "2")
    assert seen["iteration"] == 0
    assert all(torch.equal(a, b) for a, b in zip(trained.model.parameters(), seen["weights"]))
    assert [r["iteration"] for r in tuned.records] == [1, 2]
    assert tuned.scheduler.num_steps == 2 * 4  # Megatron-LM counts samples: 2 steps of 4
