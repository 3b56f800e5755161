"""Compression through the runtime with the paper's layer-specific codecs.

Gradient error bound, per parameter: ||g - g_ref|| / ||g_ref|| < 0.2 with every compressible
site compressed by its default codec. Why 0.2: int4 with a per-group (or per-channel) scale
max|x|/8 rounds to steps of ~max|x|/8; for bell-shaped activations in groups of 64 that max
is ~2.5 sigma, so the rounding error's RMS is ~0.09 of the tensor's. A weight gradient X^T dY
is linear in the compressed input X, so its relative error is about that of X (measured
0.10-0.11 for one site alone); with the upstream gradient dY also perturbed by the layers
above, the two add in quadrature: ~0.13 measured worst on the tiny GPT. 0.2 leaves ~50%
headroom and still fails a codec that is twice as coarse (int3-like) or drops outliers.
"""
import json
import os

import pytest
import torch

from megatron_adacc.common.plan import Plan
from megatron_adacc.runtime import apply_plan, measure_step

from helpers.runtime import build, loss_of

MASKS = ["attn_dropout_mask", "bda1_mask", "bda2_mask"]
COMPRESSIBLE = ["ln1_out", "qkv", "softmax_out", "attn_probs", "context", "ln2_in", "ln2_out",
                "gelu_in", "gelu_out"] + MASKS
GRADIENT_BOUND = 0.2


def _step(model, plan=None):
    if plan is not None:
        apply_plan(model, plan, strict=True)
    torch.manual_seed(11)
    loss, report = measure_step(model, lambda: loss_of(model), strict=True)
    return loss, {n: p.grad.float() for n, p in model.named_parameters()}, report


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_default_codecs_keep_every_gradient_within_the_bound(distributed, dtype, dropout):
    _, reference, stock = _step(build(False, dtype, dropout))
    _, grads, report = _step(build(True, dtype, dropout),
                             Plan.uniform({s: "compress" for s in COMPRESSIBLE}))
    errors = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in reference.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < GRADIENT_BOUND, (worst, errors[worst])
    assert errors[worst] > 1e-3  # the codecs really ran: int4 is not lossless
    assert report.after_forward_bytes < 0.5 * stock.after_forward_bytes


def test_bit_packed_dropout_masks_are_lossless(distributed):
    loss0, reference, stock = _step(build(False, dropout=0.1))
    loss, grads, report = _step(build(True, dropout=0.1),
                                Plan.uniform({s: "compress" for s in MASKS}))
    assert torch.equal(loss, loss0)
    assert all(torch.equal(grads[n], g) for n, g in reference.items())
    for site in MASKS:  # fp32 masks: 1 bit per element (+ one scalar)
        assert report.by_site[(0, site)] <= stock.by_site[(0, site)] / 32 + 8


def test_qkv_views_share_one_payload(distributed):
    _, _, stock = _step(build(False))
    _, _, report = _step(build(True), Plan.uniform({"qkv": "compress"}))
    # three saved views, one storage: one int4 payload (~1/8 of fp32 plus scales), not three
    assert report.by_site[(0, "qkv")] < 0.2 * stock.by_site[(0, "qkv")]


KJV = os.path.join(os.path.dirname(torch.__file__), "..", "bible", "data", "kjv.jsonl")


def _kjv_bytes(limit: int = 400_000) -> torch.Tensor:
    text = []
    with open(KJV) as f:
        for line in f:
            record = json.loads(line)
            text.append(record.get("text", "") if isinstance(record, dict) else str(record))
            if sum(map(len, text)) > limit:
                break
    return torch.tensor(list(" ".join(text).encode()[:limit]), dtype=torch.long)


def _train_on_kjv(model, steps: int, seq: int = 32, batch: int = 8) -> list[float]:
    """AdamW at lr 2e-3 with what the trainer (like megatron) trains with: gradient-norm
    clipping at 1.0 (its default) and a linear warm-up (20 steps here). Without them this
    toy's run is chaotic: unbiased gradient noise of 2-7% relative error, no compression at
    all, moved the mean of the last 20 losses by -7% to +27% across data seeds (which loss
    spikes a run hits), and compress-everything "gaps" ranged from -14% to +17%. With them
    that noise moves it by < 0.9% on every seed tried, so a 1% bound measures the codecs."""
    from megatron_adacc.models import build as model_lib

    data = _kjv_bytes()
    gen = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    losses = []
    for step in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        window = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        optimizer.zero_grad()
        loss = model_lib.gpt_loss(model, window[:, :-1], window[:, 1:], torch.ones(batch, seq))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_two_hundred_kjv_steps_stay_within_one_percent(distributed):
    stock = _train_on_kjv(build(False), 200)
    model = build(True)
    apply_plan(model, Plan.uniform({s: "compress" for s in COMPRESSIBLE}), strict=True)
    compressed = _train_on_kjv(model, 200)
    final_stock, final = sum(stock[-20:]) / 20, sum(compressed[-20:]) / 20
    print(f"KJV 200 steps, mean of last 20: stock {final_stock:.4f}, compressed {final:.4f}, "
          f"gap {100 * (final - final_stock) / final_stock:+.2f}%")
    assert final_stock < 0.75 * stock[0]  # it learned something
    assert compressed[1:] != stock[1:]  # int4 is lossy: the runs really differ
    assert abs(final - final_stock) <= 0.01 * final_stock


@pytest.mark.parametrize("plan", [
    {"layer_in": "compress", "ln1_out": "recompute", "softmax_out": "recompute"},
    {"ln2_in": "compress", "gelu_in": "recompute", "gelu_out": "recompute"},
])
def test_recompute_from_a_compressed_segment_start(distributed, plan):
    # The rebuild reads its decoded starting tensor; autograd later unpacks the same view.
    # Reading must not consume it (it once did: "unpacked twice" in backward).
    _, reference, _ = _step(build(False, dropout=0.1))
    _, grads, report = _step(build(True, dropout=0.1), Plan.uniform(plan))
    errors = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in reference.items()}
    assert max(errors.values()) < GRADIENT_BOUND
    assert max(errors.values()) > 0  # rebuilt from a lossy value: not bitwise
    start = next(site for site in plan if plan[site] == "compress")
    assert report.by_site[(0, start)] > 0
