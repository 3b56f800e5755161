"""What the runtime meets on CUDA and not in a plain CPU run, emulated on the CPU.

- Megatron's bias-dropout-add draws its masks from the default CUDA generator; attention
  dropout draws from it too, but inside the tensor-parallel tracker's fork, which swaps the
  tracker's state into it. On the CPU both draw from the CPU generator, so a recompute that
  forgot the CUDA generator would still pass every other test.
- CUDA dropout is `torch.native_dropout`, whose backward saves a bool mask (CPU dropout saves
  a float mask of 0 and 1/(1-p)).
- NVIDIA's images ship apex, and megatron's local spec then uses apex's FusedLayerNorm, which
  saves its statistics as 1-D [s*b] fp32 tensors.
"""
import pytest
import torch
from torch.overrides import handle_torch_function, has_torch_function_unary

from megatron_adacc import codecs
from megatron_adacc.models import build as model_lib
from megatron_adacc.common.plan import Plan
from megatron_adacc.runtime import UnknownSiteError, adacc_layers, apply_plan, measure_step

from helpers.runtime import (BATCH, PLANS, RECOMPUTABLE, SEQ, assert_same_training, build,
                             loss_of, train)

HIDDEN, HEADS = 64, 4  # helpers.runtime's tiny GPT
MASKS = ("attn_dropout_mask", "bda1_mask", "bda2_mask")


@pytest.fixture
def cuda_dropout(monkeypatch):
    """Dropout as on CUDA: `native_dropout` (bool masks) drawing from a generator that stands
    for the default CUDA generator, which megatron's tracker forks exactly as it forks the
    real one (through `_get_cuda_rng_state`/`_set_cuda_rng_state`). Seeding seeds it too, as
    `torch.manual_seed` seeds the CUDA generators."""
    from megatron.core.tensor_parallel import random as mrandom

    cuda_generator = torch.Generator()
    monkeypatch.setattr(mrandom, "_get_cuda_rng_state",
                        lambda *args, **kwargs: cuda_generator.get_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state",
                        lambda state, *args, **kwargs: cuda_generator.set_state(state))

    set_seed = model_lib.set_seed

    def seed_every_generator(seed):
        set_seed(seed)
        cuda_generator.manual_seed(seed)

    monkeypatch.setattr(model_lib, "set_seed", seed_every_generator)

    def dropout(input, p=0.5, training=True, inplace=False):
        # As torch's own dropout: a torch function mode (the ln2_in rebuild's) sees it first.
        if has_torch_function_unary(input):
            return handle_torch_function(dropout, (input,), input, p=p, training=training,
                                         inplace=inplace)
        if not training or p == 0:
            return input
        # native_dropout takes no generator: lend it the stand-in's state for this one draw.
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(cuda_generator.get_state())
        try:
            return torch.native_dropout(input, p, True)[0]
        finally:
            cuda_generator.set_state(torch.get_rng_state())
            torch.set_rng_state(cpu_state)

    monkeypatch.setattr(torch.nn.functional, "dropout", dropout)
    yield cuda_generator
    # Dynamo indexes torch's functions once per process, and megatron's model building asks
    # for that index: built while F.dropout is the stand-in, it would miss the real one for
    # good, and a later torch.compile through the ln2_in rebuild's mask-applying mode (the
    # fused bias-dropout-add test) would round otherwise. Left to be built again.
    torch._dynamo.trace_rules.get_torch_obj_rule_map.cache_clear()


# --- 1. recompute restores the default CUDA generator ---------------------------------------

@pytest.mark.parametrize("plan", ["mixed", "recompute_all", "mlp_only"])
def test_recompute_with_cuda_dropout_matches_stock_layer_bitwise(distributed, cuda_dropout, plan):
    stock = train(build(False, dropout=0.1), steps=2)
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS[plan], strict=True)
    assert_same_training(stock, train(model, steps=2))


def test_recompute_leaves_the_generators_where_backward_found_them(distributed, cuda_dropout):
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS["recompute_all"], strict=True)
    loss = loss_of(model)
    before = cuda_dropout.get_state(), torch.get_rng_state()
    loss.backward()
    assert torch.equal(cuda_dropout.get_state(), before[0])
    assert torch.equal(torch.get_rng_state(), before[1])


# --- 2. attribution of what CUDA saves ------------------------------------------------------

def _measure(model, plan=None):
    if plan is not None:
        apply_plan(model, plan, strict=True)
    torch.manual_seed(3)
    return measure_step(model, lambda: loss_of(model), strict=True)[1]


def test_bool_dropout_masks_land_on_their_sites_and_compress_to_bits(distributed, cuda_dropout):
    stock = _measure(build(False, dropout=0.1))
    mask_bytes = {"attn_dropout_mask": BATCH * HEADS * SEQ * SEQ,
                  "bda1_mask": SEQ * BATCH * HIDDEN, "bda2_mask": SEQ * BATCH * HIDDEN}
    for layer in (0, 1):
        for site, nbytes in mask_bytes.items():  # bool: one byte per element
            assert stock.by_site[(layer, site)] == nbytes, (layer, site)
    # The causal mask is megatron's cached one: one storage for every layer.
    assert stock.by_site[(0, "attn_mask")] == SEQ * SEQ
    assert (1, "attn_mask") not in stock.by_site

    compressed = _measure(build(True, dropout=0.1), Plan.uniform({s: "compress" for s in MASKS}))
    bitmask = codecs.get("bitmask")
    payloads = {site: bitmask.encode(torch.zeros(n, dtype=torch.bool)).nbytes
                for site, n in mask_bytes.items()}
    for layer in (0, 1):
        for site in MASKS:
            assert compressed.by_site[(layer, site)] == payloads[site], (layer, site)
    # Every mask byte is accounted for: the step kept exactly the masks' savings less.
    saved = 2 * sum(mask_bytes[s] - payloads[s] for s in MASKS)
    assert stock.after_forward_bytes - compressed.after_forward_bytes == saved


def test_bool_dropout_masks_compressed_are_lossless(distributed, cuda_dropout):
    stock = train(build(False, dropout=0.1), steps=2)
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform({s: "compress" for s in MASKS}), strict=True)
    assert_same_training(stock, train(model, steps=2))


def test_a_bool_tensor_that_is_not_megatrons_mask_is_no_attention_mask(distributed):
    from megatron.core.transformer.utils import attention_mask_func

    model = build(True)
    apply_plan(model, Plan.uniform({"gelu_in": "recompute"}), strict=True)
    softmax = adacc_layers(model)[0].self_attention.core_attention.scale_mask_softmax
    softmax.mask_func = lambda scores, mask: attention_mask_func(scores, mask.clone())
    with pytest.raises(UnknownSiteError, match="layer 0"):
        loss_of(model)


class _ApexLayerNormFunction(torch.autograd.Function):
    """Saves what apex's FusedLayerNormAffineFunction saves: the input, weight, bias, and the
    mean and inverse standard deviation as 1-D fp32 tensors of one value per row."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        rows = x.reshape(-1, x.shape[-1]).float()
        mean = rows.mean(-1)
        invvar = torch.rsqrt(rows.var(-1, unbiased=False) + eps)
        normed = (rows - mean[:, None]) * invvar[:, None]
        ctx.save_for_backward(x, weight, bias, mean, invvar)
        return (normed * weight.float() + bias.float()).to(x.dtype).view_as(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, invvar = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1]).float()
        grad = grad.reshape(rows.shape).float()
        normed = (rows - mean[:, None]) * invvar[:, None]
        dnormed = grad * weight.float()
        dx = invvar[:, None] * (dnormed - dnormed.mean(-1, keepdim=True)
                                - normed * (dnormed * normed).mean(-1, keepdim=True))
        return (dx.to(x.dtype).view_as(x), (grad * normed).sum(0).to(weight.dtype),
                grad.sum(0).to(bias.dtype), None)


class ApexLikeLayerNorm(torch.nn.Module):
    """Stands in for megatron's FusedLayerNorm (apex) in the local spec."""

    def __init__(self, config, hidden_size, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        return _ApexLayerNormFunction.apply(x, self.weight, self.bias, self.eps)


APEX_NORMS = {"input_layernorm": ApexLikeLayerNorm, "pre_mlp_layernorm": ApexLikeLayerNorm}


def test_apex_layernorm_statistics_are_attributed(distributed):
    report = _measure(build(True, dropout=0.1, submodules=APEX_NORMS))
    rows = SEQ * BATCH
    for layer in (0, 1):
        for site in ("ln1_stats", "ln2_stats"):  # mean and invvar, fp32
            assert report.by_site[(layer, site)] == 2 * rows * 4, (layer, site)


def test_recompute_with_apex_layernorm_matches_stock_layer_bitwise(distributed, cuda_dropout):
    stock = train(build(False, dropout=0.1, submodules=APEX_NORMS), steps=2)
    model = build(True, dropout=0.1, submodules=APEX_NORMS)
    apply_plan(model, Plan.uniform({s: "recompute" for s in RECOMPUTABLE}), strict=True)
    assert_same_training(stock, train(model, steps=2))
