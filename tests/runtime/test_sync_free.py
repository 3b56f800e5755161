"""Adacc's step adds no host synchronisation to the stock megatron layer (issue 45 part 1).

On CUDA a host sync (reading a device value, or an output sized by the data) stalls the host
until the GPU has drained its queue, so the host can no longer run ahead. Counted on the CPU
as the aten ops that sync on CUDA (profiling.syncs.SyncCounter), over one forward and
backward of a small GPT and a small Llama: the Adacc layer under each policy must make no
sync op the stock layer does not. The codecs run the "torch" backend here, whose every
operation dispatches through aten (the native kernels run outside it; their Python side is
counted in test_codecs_sync)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from megatron_adacc import codecs, policies
from megatron_adacc.common.plan import Decision, Plan
from megatron_adacc.common.sites import COMPRESS
from megatron_adacc.planning import default_resolution, minimum_budget, plan as make_plan
from megatron_adacc.profiling.profiler import profile
from megatron_adacc.profiling.syncs import SyncCounter
from megatron_adacc.runtime import apply_plan

from helpers.runtime import batch, build, loss_of
from helpers.llama import build_llama

# One site per codec (GPT): every codec of codecs.NAMES runs in one step.
GPT_EVERY_CODEC = {"ln1_out": "outlier_int4", "qkv": "channel_int4", "softmax_out": "asym_int4",
                   "gelu_in": "sym_int4", "ln2_out": "naive_int4", "bda1_mask": "bitmask",
                   "attn_dropout_mask": "bitmask"}
LLAMA_EVERY_CODEC = {"ln1_out": "outlier_int4", "qkv": "channel_int4", "softmax_out": "asym_int4",
                     "swiglu_act": "sym_int4", "ln2_out": "naive_int4", "bda1_mask": "bitmask"}
FAMILIES = {"gpt": (build, GPT_EVERY_CODEC), "llama": (build_llama, LLAMA_EVERY_CODEC)}


def counted_step(model) -> Counter:
    """The sync ops of one forward and backward of ``model`` (its gradients then dropped)."""
    torch.manual_seed(5)
    with SyncCounter() as counter:
        loss_of(model).backward()
    model.zero_grad(set_to_none=True)
    return counter.counts


def auto_plan(model) -> Plan:
    """auto's plan a quarter of the way from the smallest budget it can meet to no
    optimisation: a budget that makes it compress."""
    costs = profile(model, batch(0), repeats=1, strict=True)
    low = (minimum_budget(costs, allow_lossy_sources=False)
           + costs.num_layers * default_resolution(costs))
    high = make_plan(costs, 10 * low).references["no optimisation"].peak_bytes
    result = policies.plan("auto", costs, int(low + 0.25 * (high - low)))
    return result.plan


def plans(model, every_codec: dict[str, str]) -> dict[str, Plan | None]:
    return {
        "none": None,
        "retain": Plan(),
        "full-recompute": policies.full_recompute_plan(),
        "quantize": policies.quantize_plan(),
        "auto": auto_plan(model),
        "every codec": Plan.uniform({site: Decision(COMPRESS, codec)
                                     for site, codec in every_codec.items()}),
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_adacc_adds_no_host_sync_to_the_stock_layer(distributed, monkeypatch, family):
    monkeypatch.setenv(codecs.BACKEND_ENV_VAR, "torch")
    builder, every_codec = FAMILIES[family]
    stock = counted_step(builder(False, dropout=0.1))
    model = builder(True, dropout=0.1)
    used = set()
    for name, chosen in plans(model, every_codec).items():
        apply_plan(model, chosen, strict=True)
        syncs = counted_step(model)
        assert syncs - stock == Counter(), (name, syncs - stock)
        if name == "auto":  # at a compressing budget
            assert any(action == COMPRESS for layer in model.modules()
                       for action, _ in getattr(layer, "actions", {}).values())
        if chosen is not None:
            used |= {codec.name for layer in model.modules() for action, codec in
                     getattr(layer, "actions", {}).values() if codec is not None}
    assert used >= set(codecs.NAMES), used  # every codec really ran


def test_the_step_counter_sees_a_sync_in_a_layer(distributed, monkeypatch):
    # A layer that reads a value on the host is seen: the count is not vacuous.
    model = build(True)
    block = model.decoder.layers[0].mlp
    original = block.forward

    def syncing_forward(*args, **kwargs):
        output = original(*args, **kwargs)
        bool(output[0].abs().sum() > 0)
        return output

    monkeypatch.setattr(block, "forward", syncing_forward)
    assert counted_step(model)["_local_scalar_dense"] == 1
