"""RoPE's cos and sin are one storage for the whole model (issue 24 item 3): megatron-core
computes them in every layer's attention, for Q and again for K, and the Adacc layer keeps
one storage of each value for every layer and every micro-batch in flight. The ruler, the
profiler, the planner and the analytic model count them once, as non-layer memory; training
is bit for bit what megatron's stock layer gives; nothing outlives the graphs that saved it,
and other lengths, rotary bases or rotary fractions never share."""
import gc
import weakref

import pytest
import torch

from megatron_adacc import models
from megatron_adacc.common.plan import Plan
from megatron_adacc.models import build as model_lib
from megatron_adacc.policies import predicted_activation_peak_bytes
from megatron_adacc.profiling.profiler import profile
from megatron_adacc.runtime import apply_plan, measure_step

from helpers.runtime import SEQ, assert_same_training, batch, loss_of, planned_and_measured
from helpers.llama import EMBEDDING, HEADS, HIDDEN, build_llama, train_steps

HEAD_DIM = HIDDEN // HEADS
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
BACKENDS = pytest.mark.parametrize("backend", ["unfused", "flash"])


def _rope(percent=1.0, base=10000):
    return models.EmbeddingOptions(position_embedding_type="rope", rotary_base=base,
                                   rotary_percent=percent,
                                   untie_embeddings_and_output_weights=True)


def _rope_bytes(report) -> dict:
    return {key: n for key, n in report.by_site.items() if key[1] == "rope_cos_sin"}


class _RopeSaves:
    """An outer saved-tensor hook that sees what Adacc layers without decisions save (their
    RoPE saves reach it through the runtime's window): the storages of RoPE's cos and sin
    ([s, 1, 1, rotary dim], needing no gradient), and weak references to them."""

    def __init__(self):
        self.storages: dict[int, tuple] = {}
        self.saves = 0

    def pack(self, tensor):
        if (tensor.dim() == 4 and tensor.shape[1:3] == (1, 1) and tensor.is_floating_point()
                and not tensor.requires_grad):
            self.saves += 1
            self.storages.setdefault(tensor.untyped_storage().data_ptr(),
                                     (tuple(tensor.shape), weakref.ref(tensor)))
        return tensor

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda saved: saved)

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for _, ref in self.storages.values())


@pytest.fixture(autouse=True)
def checked_bits(monkeypatch):
    """Every shared RoPE value's bits compared with each save it stands for (a host read, so
    off outside tests: shared.SharedValues.check_bits)."""
    from megatron_adacc.runtime.shared import SHARED

    monkeypatch.setattr(SHARED, "check_bits", True)


# --- counted once ------------------------------------------------------------------------------
@DTYPES
@BACKENDS
@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_the_ruler_counts_rope_cos_sin_once_for_every_layer(distributed, dtype, backend,
                                                            percent):
    layers, act = 4, torch.tensor([], dtype=dtype).element_size()
    rot = int(HEAD_DIM * percent)
    one = SEQ * rot * act   # one of the [s, 1, 1, rotary dim] tensors
    stock = build_llama(False, dtype, backend, layers=layers, embedding=_rope(percent))
    _, stock_report = measure_step(stock, lambda: loss_of(stock))
    # megatron's stock layer: cos and sin made and saved for Q and for K in every layer
    assert _rope_bytes(stock_report) == {(layer, "rope_cos_sin"): 4 * one
                                         for layer in range(layers)}
    adacc = build_llama(True, dtype, backend, layers=layers, embedding=_rope(percent))
    plans = {
        "retain": None,
        # decisions in some layers only: the layers with decisions pack through their own
        # hook, the others run as the stock layer; all of them share
        "mixed": Plan.from_dict({"layers": {
            "1": {"sites": {"qkv": "recompute"}},
            "2": {"sites": {"swiglu_act": "recompute", "ln1_out": "compress"}}}}),
    }
    for name, plan in plans.items():
        apply_plan(adacc, plan, strict=True)
        _, report = measure_step(adacc, lambda: loss_of(adacc), strict=True)
        # one cos and one sin, counted under the first layer
        assert _rope_bytes(report) == {(0, "rope_cos_sin"): 2 * one}, name
        if plan is None:
            assert (stock_report.after_forward_bytes - report.after_forward_bytes
                    == (4 * layers - 2) * one)


def test_micro_batches_in_flight_share_one_storage_and_other_lengths_do_not(distributed):
    """Three forwards before their backwards (1F1B's warm-up): two at the full length, one
    at half of it. Both full-length ones hold the first one's cos and sin; the half-length
    one its own. After the backwards nothing is left, and the gradients are the stock
    layer's bit for bit."""
    micro_batches = [batch(0), batch(1), tuple(t[:, :SEQ // 2] for t in batch(2))]
    grads = {}
    for adacc in (False, True):
        model = build_llama(adacc, layers=3)
        saves = _RopeSaves()
        with saves.hooks():
            losses = [model_lib.gpt_loss(model, *micro_batch) for micro_batch in micro_batches]
            if adacc:
                assert sorted(shape for shape, _ in saves.storages.values()) == sorted(
                    [(SEQ, 1, 1, HEAD_DIM)] * 2 + [(SEQ // 2, 1, 1, HEAD_DIM)] * 2)
            else:   # 3 micro-batches x 3 layers x (Q, K) x (cos, sin)
                assert len(saves.storages) == 36
            assert saves.saves == 36
            for loss in losses:
                loss.backward()
        del losses
        assert saves.alive() == 0  # freed with the graphs: nothing carried to the next step
        grads[adacc] = {name: p.grad for name, p in model.named_parameters()}
    assert all(torch.equal(grads[True][name], grad) for name, grad in grads[False].items())


def test_steps_start_anew(distributed):
    model = build_llama(True, layers=2)
    kept = []
    for step in range(3):
        saves = _RopeSaves()
        with saves.hooks():
            loss_of(model, step).backward()
        kept.append(len(saves.storages))
        assert saves.alive() == 0
    assert kept == [2, 2, 2]


@pytest.mark.parametrize("other", [dict(base=500000), dict(percent=0.5)],
                         ids=["rotary-base", "rotary-percent"])
def test_other_rotary_values_are_never_shared(distributed, other):
    # Two models in flight at once, one with the default positions and one with another
    # rotary base (same shapes, other bits) or rotary fraction (another width).
    saves = _RopeSaves()
    with saves.hooks():
        losses = [loss_of(build_llama(True, embedding=embedding))
                  for embedding in (EMBEDDING, _rope(**other))]
        assert len(saves.storages) == 4
        for loss in losses:
            loss.backward()


@DTYPES
@BACKENDS
def test_sharing_trains_bitwise_like_the_stock_layer(distributed, dtype, backend):
    reference = train_steps(build_llama(False, dtype, backend, layers=3), steps=2)
    for plan in (Plan(), Plan.from_dict({"layers": {
            "0": {"sites": {"qkv": "recompute", "context": "recompute"}},
            "2": {"sites": {"ln1_out": "recompute", "swiglu_out": "recompute"}}}})):
        model = build_llama(True, dtype, backend, layers=3)
        assert_same_training(reference, train_steps(model, steps=2, plan=plan))


# --- the planner's view ----------------------------------------------------------------------
@BACKENDS
def test_the_planner_counts_rope_once_and_predicts_what_the_ruler_measures(distributed,
                                                                           backend):
    model = build_llama(True, attention_backend=backend, layers=3)
    costs = profile(model, batch(0), repeats=1, strict=True)
    rope = 2 * SEQ * HEAD_DIM * 4
    mask = SEQ * SEQ if backend == "unfused" else 0   # megatron's cached causal mask (bool)
    assert "rope_cos_sin" not in {site.name for site in costs.sites}
    assert costs.held_non_layer_bytes == rope + mask
    # Profiled and run on the same micro-batch, the prediction is byte-exact here: the peak
    # comes at the end of forward (the logits), where the shared storage is counted once.
    for fraction in (0.0, 0.5, 1.0):
        result, predicted, measured = planned_and_measured(model, costs, fraction)
        assert measured.after_forward_bytes == predicted, fraction
        assert measured.peak_bytes == predicted_activation_peak_bytes(costs, result), fraction


# --- the table ---------------------------------------------------------------------------------
def test_a_value_is_shared_by_what_made_it_and_its_bits_are_checked_when_asked():
    from megatron_adacc.runtime.shared import SharedValues

    assert not SharedValues().check_bits  # a host read: off unless asked for
    table = SharedValues(check_bits=True)
    freqs = torch.linspace(-2.0, 2.0, 8).view(8, 1, 1, 1)
    cos = torch.cos(freqs)
    assert table.canonical(("cos",), freqs, cos) is cos
    assert table.canonical(("cos",), freqs, torch.cos(freqs)) is cos
    assert table.canonical(("sin",), freqs, torch.sin(freqs)) is not cos
    other = freqs.clone()   # equal values, another tensor: another source
    assert table.canonical(("cos",), other, torch.cos(other)) is not cos
    # A view is never shared (it would pin its base); a dtype or shape is part of the key.
    whole = torch.cos(torch.cat([freqs, freqs]))
    assert table.canonical(("cos",), freqs, whole[:8]) is not cos
    assert table.canonical(("cos",), freqs, cos.double()) is not cos
    # The same key with other bits: megatron no longer makes it the way the key says. Bits,
    # not values: -0.0 == 0.0 but a product with it differs.
    zero = torch.zeros(8, 1, 1, 1)
    table.canonical(("zero",), freqs, zero)
    with pytest.raises(RuntimeError, match="differs from the one shared for it"):
        table.canonical(("cos",), freqs, cos + 1)
    with pytest.raises(RuntimeError, match="differs from the one shared for it"):
        table.canonical(("zero",), freqs, -zero)
    # Nothing is held: once the shared tensor is gone, the next one is remembered anew.
    del cos
    gc.collect()
    fresh = torch.cos(freqs)
    assert table.canonical(("cos",), freqs, fresh) is fresh
