"""16-bit training as megatron does it: loss scaling, skipped steps on overflow, and fp32
main gradients accumulated and reduced across micro-batches and data-parallel ranks."""
import json
import re

import pytest
import torch

from megatron_adacc import Adacc
from megatron_adacc.megatron_lm import ConfigError
from megatron_adacc.models import build as model_lib
from megatron_adacc.planning import analytic
from helpers.engine import inner_optimizers, main_params
from helpers import TESTS, forked
from helpers.pretrain import child_env, parse, pretrain



def at_setup(monkeypatch, act):
    """Call ``act(adacc)`` once Adacc is set up on the first step, before its forward."""
    real = Adacc.setup

    def setup(adacc, *args, **kwargs):
        result = real(adacc, *args, **kwargs)
        act(adacc)
        return result

    monkeypatch.setattr(Adacc, "setup", setup)


@pytest.mark.parametrize("hysteresis, scales", [(1, [512.0, 256.0]), (2, [1024.0, 512.0])])
def test_an_overflowing_gradient_skips_the_step_and_backs_the_scale_off(
        hysteresis, scales, capsys, monkeypatch):
    before = []

    def overflow(adacc):
        weight = next(adacc.model.parameters())
        weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        before.extend(p.detach().clone() for p in adacc.model.parameters())

    at_setup(monkeypatch, overflow)
    session = pretrain("--fp16", "--train-iters", "2", "--initial-loss-scale", "1024",
                       "--hysteresis", str(hysteresis), "--log-interval", "1")
    records = session.records
    assert [r["loss_scale"] for r in records] == scales
    assert [r["skipped_iter"] for r in records] == [1, 1]
    assert [r["grad_norm"] for r in records] == [None, None]
    assert all(torch.equal(a, b) for a, b in zip(before, session.model.parameters()))
    assert all(not inner.optimizer.state  # Adam never stepped
               for inner in inner_optimizers(session.optimizer))
    assert session.scheduler.num_steps == 0  # megatron's schedule waits for a real step
    # The project's own overflow line is gone: Megatron-LM's log line says it.
    out = capsys.readouterr().out.splitlines()
    for iteration, scale in enumerate(scales, 1):
        line = next(line for line in out if f"iteration        {iteration}/" in line)
        assert f"loss scale: {scale:.1f}" in line
        assert re.search(r"number of skipped iterations: +[1-9]", line), line


def test_a_finite_fp16_step_updates_and_keeps_the_scale(monkeypatch):
    before = []
    at_setup(monkeypatch, lambda adacc: before.extend(
        p.detach().clone() for p in adacc.model.parameters()))
    session = pretrain("--fp16", "--train-iters", "1", "--initial-loss-scale", "1024")
    (record,) = session.records
    assert record["loss_scale"] == 1024.0 and record["skipped_iter"] == 0
    assert record["grad_norm"] > 0
    assert not torch.equal(before[0], next(session.model.parameters()))
    assert all(p.dtype == torch.float16 for p in session.model.parameters())
    mains = main_params(session.optimizer).values()
    assert mains and all(m.dtype == torch.float32 for m in mains)


@pytest.mark.parametrize("flags, softmax_dtype", [([], torch.bfloat16),
                                                  (["--attention-softmax-in-fp32"], torch.float32)])
def test_the_softmax_keeps_megatron_lms_dtype_and_the_accelerator_model_agrees(
        flags, softmax_dtype, monkeypatch):
    """Megatron-LM's --attention-softmax-in-fp32 (off by default): the unfused attention's
    softmax saves its probabilities in that dtype, as ``adacc plan --hardware`` assumes."""
    seq = 32
    saved = []

    def forward(adacc):
        tokens = torch.randint(0, 100, (2, seq))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                      lambda t: t):
            model_lib.gpt_loss(adacc.model, tokens, tokens, torch.ones_like(tokens))

    at_setup(monkeypatch, forward)
    pretrain("--bf16", "--attention-backend", "unfused", "--train-iters", "1", *flags)
    scores = {t.dtype for t in saved if t.dim() == 4 and t.shape[-2:] == (seq, seq)
              and t.is_floating_point()}
    assert softmax_dtype in scores and (torch.float32 in scores) == bool(flags)
    shape = analytic.ModelShape.from_flags(
        {"num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": seq,
         "vocab-size": 256, "bf16": True, **{flag[2:]: True for flag in flags}})
    assert shape.softmax_in_fp32 == bool(flags)


def test_fp16_and_bf16_exclude_each_other():
    # Megatron-LM's own refusal (a bare assertion), in one line naming its check.
    with pytest.raises(ConfigError) as refused:
        parse("--fp16", "--bf16")
    assert re.fullmatch(r"Megatron-LM refused the flags: assert not args\.bf16 "
                        r"\(arguments\.py:\d+\)", str(refused.value)), str(refused.value)


def test_data_parallel_accumulated_gradients_are_reduced_in_fp32(tmp_path):
    # bf16: 8 micro-batches on each of 2 ranks; the gradient AdamW steps with must match an
    # fp64 sum of the same 16-bit micro-batch gradients to fp32's precision (a bf16
    # accumulation, as torch DDP does for a bf16 model, misses by about 2**16 times that).
    flags = ["--bf16", "--micro-batch-size", "1", "--global-batch-size", "16",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0",
             "--train-iters", "1"]
    done = forked.torchrun(2, [TESTS / "multirank" / "multirank_main_grads.py", *flags],
                           cwd=tmp_path, env=child_env())
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["micro_batches"] == 8
    assert verdict["error_in_fp32_bounds"] <= 1.0, verdict


def test_fp16_resume_restores_the_loss_scale_and_reproduces_the_run(tmp_path):
    # A low window makes the scale grow within the run, so the checkpoint must carry it.
    # Without dropout: whether a resumed run redraws the same masks is test_engine's and
    # the resume tests' question, not the loss scale's.
    common = ["--fp16", "--train-iters", "4", "--initial-loss-scale", "1024",
              "--loss-scale-window", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    straight = pretrain(*common).records
    ckpt = str(tmp_path / "ckpt")
    first = pretrain(*common, "--save", ckpt, "--save-interval", "2",
                     "--exit-interval", "2").records
    rest = pretrain(*common, "--load", ckpt).records
    assert [r["loss_scale"] for r in straight] == [2048.0, 4096.0, 8192.0, 16384.0]
    assert [(r["loss"], r["loss_scale"]) for r in first + rest] == \
        [(r["loss"], r["loss_scale"]) for r in straight]
