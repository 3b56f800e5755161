"""Tiny GPTs, batches, training loops, plans and assertions shared by the runtime tests."""
from __future__ import annotations

import dataclasses
import mmap

import torch

from megatron_adacc import models
from megatron_adacc.common.plan import Plan
from megatron_adacc.common.sites import SITES
from megatron_adacc.models import build as model_lib
from megatron_adacc.models.attention import local_layer_spec
from megatron_adacc.planning import default_resolution, minimum_budget, plan
from megatron_adacc.policies import predicted_activation_bytes
from megatron_adacc.runtime import ActivationRuler, apply_plan, get_adacc_layer_spec, measure_step

from helpers.storages import LiveBytes

VOCAB, SEQ, BATCH = 256, 32, 2
# The unfused GPT layer's recomputable sites and the plans its bitwise tests run (the flash
# layer's own are in test_flash_attention.py).
FLASH_ONLY = {"attn_lse", "attn_rng_state"}
RECOMPUTABLE = [s for s in models.get("gpt").sites if SITES[s].recomputable
                and s not in FLASH_ONLY]
MIXED = {  # every segment, both sides of each anchor, differing per layer
    "sites": {"qkv": "recompute", "softmax_out": "recompute", "attn_dropout_mask": "recompute",
              "gelu_in": "recompute", "ln2_stats": "recompute"},
    "layers": {"1": {"sites": {"ln2_in": "recompute", "gelu_out": "recompute",
                               "context": "recompute", "softmax_out": "retain"}}},
}
PLANS = {
    "all_retain": Plan(),
    "mixed": Plan.from_dict(MIXED),
    "recompute_all": Plan.uniform({s: "recompute" for s in RECOMPUTABLE}),
    "mlp_only": Plan.uniform({"ln2_out": "recompute", "gelu_in": "recompute",
                              "gelu_out": "recompute", "bda2_mask": "recompute"}),
}


def assert_same_training(reference, candidate):
    """Every step's loss and gradients of two ``train`` results are bitwise equal."""
    ref_losses, ref_grads = reference
    losses, grads = candidate
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b), f"step {step}: loss {a.item()} != {b.item()}"
    for step, (ga, gb) in enumerate(zip(ref_grads, grads)):
        for name in ga:
            assert torch.equal(ga[name], gb[name]), f"step {step}: gradient of {name} differs"


def build(adacc: bool, dtype=torch.float32, dropout=0.0, bias=True, layers=2, seed=1,
          submodules=None, attention_backend="unfused", attention_dropout=None, **config):
    """A tiny GPT, stock or Adacc; `submodules` replaces entries of the layer spec's
    submodules (e.g. a stand-in layernorm) in either; `attention_dropout` defaults to
    `dropout`, like the hidden dropout."""
    model_lib.set_seed(seed)
    cfg = model_lib.build_transformer_config(
        num_layers=layers, hidden_size=64, num_attention_heads=4, hidden_dropout=dropout,
        attention_dropout=dropout if attention_dropout is None else attention_dropout,
        add_bias_linear=bias,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        **config)
    spec = (get_adacc_layer_spec(attention_backend) if adacc
            else local_layer_spec(attention_backend))
    if submodules:
        spec = dataclasses.replace(
            spec, submodules=dataclasses.replace(spec.submodules, **submodules))
    # megatron casts half-precision models with its Float16Module (GPU only); cast here so
    # the position embedding and layernorms run in the activation dtype too.
    model = model_lib.build_gpt_model(cfg, VOCAB, SEQ, spec, attention_backend).to(dtype)
    if adacc:
        apply_plan(model, None, strict=True)
    return model


def batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return tokens, labels, torch.ones(BATCH, SEQ)


def loss_of(model, seed: int = 0):
    return model_lib.gpt_loss(model, *batch(seed))


def train(model, steps: int, lr: float = 1e-3, plan_for_step=None):
    """Adam steps on fixed batches with a fixed dropout stream; returns (losses, grads of
    every step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, grads = [], []
    for step in range(steps):
        if plan_for_step is not None:
            apply_plan(model, plan_for_step(step))
        optimizer.zero_grad()
        model_lib.set_seed(100 + step)
        loss = loss_of(model, step)
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads


def planned_and_measured(model, costs, fraction: float):
    """The plan auto makes (exact rebuild sources) ``fraction`` of the way from the smallest
    feasible budget to no optimisation, run for one step on ``model``: (the planner's
    result, its predicted activation bytes, the ruler's report)."""
    # The planner rounds stored bytes up to its resolution: at the exact minimum it can miss.
    low = minimum_budget(costs, allow_lossy_sources=False)
    low += costs.num_layers * default_resolution(costs)
    high = plan(costs, 10 * low).references["no optimisation"].peak_bytes
    result = plan(costs, int(low + fraction * (high - low)), allow_lossy_sources=False)
    apply_plan(model, result.plan, strict=True)
    try:
        measured = measure_step(model, lambda: loss_of(model), strict=True)[1]
    finally:
        apply_plan(model, None)
    return result, predicted_activation_bytes(costs, result), measured


def adacc_model(adacc):
    """A tiny GPT built with ``adacc``'s layer spec, as a user of the public API builds one."""
    model_lib.init_distributed(1)
    model_lib.set_seed(7)
    config = model_lib.build_transformer_config(num_layers=2, hidden_size=32,
                                                num_attention_heads=4, hidden_dropout=0.0,
                                                attention_dropout=0.0)
    return model_lib.build_gpt_model(config, 64, 16, adacc.layer_spec())


def adacc_batch():
    """A (tokens, labels, loss mask) micro-batch for ``adacc_model``."""
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return tokens, tokens.roll(-1, 1), torch.ones(2, 16)


def touch_fresh_pages(count: int) -> None:
    """First-touch ``count`` pages of host memory never touched before (a fresh anonymous
    mapping): what a heap growing into new pages does, counted as minor page faults."""
    fresh = mmap.mmap(-1, count * mmap.PAGESIZE)
    for page in range(count):
        fresh[page * mmap.PAGESIZE] = 1
    fresh.close()


def assert_gradients_close(model, reference, bound: float) -> None:
    """Every parameter's gradient within ``bound`` relative (L2) of the reference's: what a
    rebuild from a decoded, lossy source may cost."""
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        error = (param.grad - ref[name].grad).norm() / ref[name].grad.norm().clamp_min(1e-12)
        assert error < bound, name


def graph_kept_bytes(model) -> tuple[int, int]:
    """(bytes the ruler reports after forward, bytes of storages created in forward that are
    alive after it and freed by dropping the graph). Dropped, not backpropagated: backward
    also frees what a reference cycle through the graph would keep alive for good."""
    loss_of(model).backward()  # warm-up: megatron's cached causal mask and buffers exist now
    made = LiveBytes()
    with ActivationRuler(model, strict=True) as ruler:
        with made:
            loss = loss_of(model)
        ruler.forward_done()
    with_graph = made.alive()
    del loss
    without_graph = made.alive()
    kept = sum(n for key, n in with_graph.items() if key not in without_graph)
    return ruler.after_forward_bytes, kept
