"""Analytic cost model: site bytes add up to 34sbh + 5as^2b, rebuild times accumulate along
each segment, static bytes per precision."""
from dataclasses import replace

import pytest
import torch

from megatron_adacc import codecs, planning
from megatron_adacc.launch import read_config
from megatron_adacc.planning import analytic
from megatron_adacc.profiling import engine_memory
from megatron_adacc.common.costs import ModelCosts
from helpers import ROOT
from helpers.runtime import build
from helpers.codecs import with_outlier_channels
from helpers.llama import LLAMA3_8B_TP2

GPT345M = analytic.ModelShape(num_layers=24, hidden_size=1024, num_attention_heads=16,
                              seq_length=1024, vocab_size=50257)


@pytest.mark.parametrize("batch", [1, 8])
def test_layer_sites_add_up_to_34sbh_plus_5as2b(batch):
    s, b, h, a = 1024, batch, 1024, 16
    sizes = analytic.site_bytes(GPT345M, batch)
    stats = sizes.pop("ln1_stats") + sizes.pop("ln2_stats")
    assert sum(sizes.values()) == 34 * s * b * h + 5 * a * s * s * b
    assert stats == 2 * 2 * s * b * 4          # mean and rstd in fp32 per layernorm
    assert sizes["qkv"] == 6 * s * b * h         # Q, K and V: one site


def test_dropout_off_and_fp32_softmax_change_the_sites():
    shape = analytic.ModelShape(2, 64, 4, 32, 100, attention_dropout=0, hidden_dropout=0,
                                softmax_in_fp32=True)
    sizes = analytic.site_bytes(shape, 2)
    assert not {"attn_dropout_mask", "bda1_mask", "bda2_mask"} & set(sizes)
    assert sizes["softmax_out"] == 4 * 4 * 32 * 32 * 2
    # the matmul with V saves the fp16 cast of the fp32 probabilities (measured on a bf16
    # layer in tests/models/test_llama.py)
    assert sizes["attn_probs"] == 2 * 4 * 32 * 32 * 2
    costs = analytic.analytic_costs(shape, 2, "a100-80gb")
    # Without the bias-dropout-add mask ln2_in's edge reads no mask; it runs the output
    # projection.
    d = 2 * 32 * 64   # s * b * h
    rate = analytic.get_accelerator("a100-80gb").matmul_flops(2) * analytic.MATMUL_EFFICIENCY
    edge = costs.operator("attention_residual")
    assert edge.sources == ("layer_in", "context")
    assert edge.rebuild_s >= 2 * d * 64 / rate


def test_static_bytes():
    n = GPT345M.num_parameters
    assert n == pytest.approx(355e6, rel=0.01)
    assert analytic.static_bytes(n, "fp16") == 16 * n
    assert analytic.static_bytes(n, "bf16") == (2 + 4 + 12) * n  # fp32 gradients
    assert analytic.static_bytes(n, "fp32") == (4 + 4 + 8) * n
    assert analytic.static_bytes(10, "fp16", zero_stage=3, data_parallel_size=8) == 2 * 16


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.bfloat16, "bf16"),
                                              (torch.float16, "fp16")])
@pytest.mark.parametrize("foreach", [False, True])
def test_the_parameter_count_model_is_the_engines_for_a_real_model(distributed, dtype,
                                                                   precision, foreach,
                                                                   monkeypatch):
    """What ``adacc plan --hardware`` charges for N parameters is what megatron's engine holds
    for a model of N (``model_static_bytes``, held equal to the engine in test_engine.py) and
    adds in its step, but for Adam's step count: 4 bytes a tensor, which a count cannot know.
    ``foreach``: torch's AdamW steps on its foreach path, as on a GPU (the host made one)."""
    from torch.optim import optimizer as torch_optimizer

    devices = torch_optimizer._get_foreach_kernels_supported_devices()
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: [*devices, "cpu"] if foreach else devices)
    model = build(False, dtype=dtype)
    tensors = list(model.parameters())
    n = sum(p.numel() for p in tensors)
    assert (engine_memory.model_static_bytes(model)
            == analytic.static_bytes(n, precision) + 4 * len(tensors))
    assert engine_memory.model_step_bytes(model) == analytic.step_bytes(n, precision,
                                                                        foreach_adam=foreach)


def test_zero1_static_bytes_are_the_hand_computed_formula():
    # ZeRO-1 (--use-distributed-optimizer): each of D ranks keeps the 16-bit weights and
    # gradients whole and ceil(N / D) parameters' fp32 master weights, Adam m and v.
    n = GPT345M.num_parameters
    assert n % 8 == 0
    assert analytic.static_bytes(n, "fp16", zero_stage=1, data_parallel_size=8) == \
        2 * n + 2 * n + 12 * n // 8
    # A count that does not divide: each rank holds the rounded-up shard.
    assert analytic.static_bytes(1001, "fp16", zero_stage=1, data_parallel_size=8) == \
        2 * 1001 + 2 * 1001 + 12 * 126
    assert analytic.static_bytes(1001, "fp16", zero_stage=2, data_parallel_size=8) == \
        2 * 1001 + (2 + 12) * 126
    assert analytic.static_bytes(n, "fp16", zero_stage=1, data_parallel_size=1) == 16 * n


def test_pipeline_stages_hold_their_own_parameters_and_activations():
    h, v = 1024, 50304                 # GPT-2's vocabulary padded to a multiple of 128
    layer = 12 * h * h + 13 * h
    stages = analytic.pipeline_costs(GPT345M, 8, "v100-32gb", 4, 8, zero_stage=1,
                                     data_parallel_size=2)
    assert [c.num_layers for c in stages] == [6] * 4
    assert [c.in_flight_micro_batches for c in stages] == [4, 3, 2, 1]
    # The first stage: the word and position embeddings; the last: the final LayerNorm and
    # megatron's copy of the tied word embedding.
    parameters = [6 * layer + (v + 1024) * h, 6 * layer, 6 * layer, 6 * layer + 2 * h + v * h]
    assert [c.meta["num_parameters"] for c in stages] == parameters
    assert [c.static_bytes for c in stages] == [4 * n + 12 * -(-n // 2) for n in parameters]
    s, b = 1024, 8
    assert [c.embedding_bytes for c in stages] == [s * b * h, 0, 0, 0]
    logits = s * b * v * (2 + 4)
    assert [c.non_layer_bytes for c in stages] == [0, 0, 0, 2 * s * b * h * 2 + 2 * s * b * 4
                                                   + logits]
    # Untied, the output layer is its own weight on the last stage, pipelined or not.
    untied = replace(GPT345M, untie_embeddings_and_output_weights=True)
    assert untied.output_parameters(pipelined=False) == untied.output_parameters(True) \
        == 2 * h + v * h
    # One stage is the whole model, tied embedding held once.
    whole = analytic.analytic_costs(GPT345M, 8, "v100-32gb")
    assert whole.static_bytes == 16 * (24 * layer + (v + 1024) * h + 2 * h)
    assert (whole.embedding_bytes, whole.non_layer_bytes) == (stages[0].embedding_bytes,
                                                              stages[-1].non_layer_bytes)


def test_rebuild_times_accumulate_along_each_segment():
    costs = analytic.analytic_costs(GPT345M, 8, "v100-32gb")
    for segment in costs.segments:
        times = [site.rebuild_s for site in costs.sites if site.segment == segment.name]
        assert times == sorted(times) and times[0] > 0, segment
    # The MLP's norm and activation are rebuilt by their operators, not by the re-run.
    assert [(s.segment, s.operator) for s in costs.sites][-5:] == [
        (None, "pre_mlp_layernorm"), (None, "pre_mlp_layernorm"), ("mlp", None),
        (None, "mlp.activation_func"), ("mlp", None)]
    # The attention re-run ends at the bias-dropout-add's mask (ln2_in has its edge) and
    # holds all of the segment's matmuls.
    s, b, h = 1024, 8, 1024
    flops = 2 * s * b * h * 3 * h + 2 * 2 * b * s * s * h + 2 * s * b * h * h
    assert costs.site("bda1_mask").rebuild_s == max(site.rebuild_s for site in costs.sites)
    assert costs.site("bda1_mask").rebuild_s >= flops / (125e12 * analytic.MATMUL_EFFICIENCY)


def test_operators_cost_their_own_ops():
    costs = analytic.analytic_costs(GPT345M, 8, "v100-32gb")
    s, b, h, f, act = 1024, 8, 1024, 4096, 2
    byte_rate = 900e9 * analytic.BANDWIDTH_EFFICIENCY
    assert [(op.name, op.sources) for op in costs.operators] == [
        ("input_layernorm", ("layer_in",)),
        ("attention_residual", ("layer_in", "context", "bda1_mask")),
        ("pre_mlp_layernorm", ("ln2_in",)), ("mlp.activation_func", ("gelu_in",))]
    # ln2_in's edge: the output projection, then the bias-dropout-add reading the mask (one
    # byte a value), the context's and the layer input's values and writing its output.
    stream = s * b * h
    assert costs.operator("attention_residual").rebuild_s == pytest.approx(
        2 * stream * h / (125e12 * analytic.MATMUL_EFFICIENCY)
        + (2 * stream + 3 * stream * act) / byte_rate)
    # far cheaper than the attention's re-run to the mask, which the segment re-run charged
    assert costs.operator("attention_residual").rebuild_s < costs.site("bda1_mask").rebuild_s / 5
    # The GELU reads and writes s*b*f values; a norm reads and writes s*b*h.
    assert costs.operator("mlp.activation_func").rebuild_s == pytest.approx(
        2 * s * b * f * act / byte_rate)
    assert costs.operator("input_layernorm").rebuild_s == pytest.approx(
        2 * s * b * h * act / byte_rate)
    # Rebuilding the activation output from its input is far cheaper than the MLP's re-run
    # to it (the fc1 matmul), which is what the segment mechanism charged.
    assert costs.operator("mlp.activation_func").rebuild_s < costs.site("gelu_in").rebuild_s / 5


def test_gpu_plans_use_the_operator_rebuilds():
    costs = analytic.analytic_costs(GPT345M, 8, "a100-80gb")
    retain_all = planning.peak_bytes(costs, [planning.evaluate_layer(costs, {})] * 24)
    gelu_out = costs.site("gelu_out").bytes * costs.num_layers
    result = planning.plan(costs, retain_all - gelu_out)
    assert {decisions["gelu_out"].action for decisions in result.layer_decisions} \
        == {"recompute"}
    row = next(row for row in result.rows if row.site == "gelu_out")
    assert row.rebuilt_from == "gelu_in"


def test_llama_operators_cost_their_own_ops():
    # a CPU's kernels save the SwiGLU's and RMSNorm's intermediates (CUDA's: the next test)
    costs = analytic.analytic_costs(replace(LLAMA3_8B_TP2, cuda_kernels=False), 1, "h100-80gb")
    s, b, f, act = 8192, 1, 14336 // 2, 2
    byte_rate = analytic.get_accelerator("h100-80gb").memory_bandwidth \
        * analytic.BANDWIDTH_EFFICIENCY
    assert [(op.name, op.sources) for op in costs.operators] == [
        ("input_layernorm", ("layer_in",)), ("attention_residual", ("layer_in", "context")),
        ("pre_mlp_layernorm", ("ln2_in",)), ("mlp", ("swiglu_in",))]
    # RMSNorm rebuilds its rstd and x * rstd with its output; glu the SwiGLU's three.
    assert {s.name: s.operator for s in costs.sites if s.name.startswith(("ln", "swiglu"))} \
        == {"ln1_stats": "input_layernorm", "ln1_normed": "input_layernorm",
            "ln1_out": "input_layernorm", "ln2_stats": "pre_mlp_layernorm",
            "ln2_normed": "pre_mlp_layernorm", "ln2_out": "pre_mlp_layernorm",
            "ln2_in": "attention_residual", "swiglu_in": None, "swiglu_up": "mlp",
            "swiglu_act": "mlp", "swiglu_out": "mlp"}
    # glu: the SiLU reads the gate half and writes its output, the add the up half, the
    # product reads two and writes one
    assert costs.operator("mlp").rebuild_s == pytest.approx(7 * s * b * f * act / byte_rate)
    assert costs.site("swiglu_in").segment == "mlp"


def test_on_cuda_llama_saves_what_the_h200_profiled():
    """CUDA's fused RMSNorm saves its input as given and rstd; megatron's fused SwiGLU fc1's
    output. The H200's profile of Llama-1B found those sites alone, and its measured peaks
    (docs/results/gpu_check_h200.json: no optimisation 38,669,254,656 B, full recompute
    29,222,617,600 B) are what the analytic model predicts within 0.5%."""
    cpu = analytic.analytic_costs(replace(LLAMA3_8B_TP2, cuda_kernels=False), 1, "h100-80gb")
    cuda = analytic.analytic_costs(LLAMA3_8B_TP2, 1, "h100-80gb")
    assert [site.name for site in cuda.sites] == [
        "layer_in", "ln1_stats", "ln1_out", "qkv", "attn_lse", "context", "ln2_in", "ln2_stats",
        "ln2_out", "swiglu_in", "swiglu_out"]
    assert cuda.site("layer_in").dtype == "bfloat16" and cpu.site("layer_in").dtype == "float32"
    # the SwiGLU's rebuild does the same work, its saves gone
    assert cuda.operator("mlp").rebuild_s == pytest.approx(cpu.operator("mlp").rebuild_s)
    flags = {key.replace("_", "-"): value
             for key, value in read_config(str(ROOT / "configs" / "llama-1b.yaml")).items()}
    # the lease's stack: megatron-core without Transformer Engine or Apex
    costs = analytic.analytic_costs(analytic.ModelShape.from_flags(flags, foreach_adam=True), 2,
                                    "h200-141gb")
    result = planning.plan(costs, 10 * costs.static_bytes)
    for method, measured in (("no optimisation", 38_669_254_656),
                             ("full recompute", 29_222_617_600)):
        assert result.references[method].peak_bytes == pytest.approx(measured, rel=0.005)


def test_full_recompute_of_gpt345m_in_fp16_peaks_in_torchs_foreach_adam_step():
    """With recompute, GPT-345M's fp16 step (no Transformer Engine, no Apex) peaks in the
    optimizer step: the fp32 gradient copies and AdamW's foreach workspace, 8 bytes a parameter
    over static. The H200 measured 8,718,088,192 B (docs/results/gpu_check_h200.json); the
    copies alone priced 7,136,542,720 B."""
    flags = {key.replace("_", "-"): value
             for key, value in read_config(str(ROOT / "configs" / "gpt-345m.yaml")).items()}
    shape = analytic.ModelShape.from_flags(flags, foreach_adam=True)
    costs = analytic.analytic_costs(shape, 4, "h200-141gb")
    assert costs.optimizer_step_bytes == 8 * shape.num_parameters
    full = planning.plan(costs, 10 * costs.static_bytes).references["full recompute"]
    assert full.peak_bytes == costs.static_bytes + costs.optimizer_step_bytes
    assert full.peak_bytes == pytest.approx(8_718_088_192, rel=0.025)


def test_llama_gpu_plans_rebuild_swiglu_by_its_operators():
    costs = analytic.analytic_costs(LLAMA3_8B_TP2, 1, "h100-80gb")
    retain_all = planning.peak_bytes(costs, [planning.evaluate_layer(costs, {})] * 32)
    # a budget that every operator product rebuilt in every layer meets
    operator_products = [site.name for site in costs.sites if site.operator]
    result = planning.plan(costs, retain_all - 32 * sum(
        costs.site(name).bytes for name in operator_products))
    rebuilt = {row.site: row.rebuilt_from for row in result.rows if row.action == "recompute"}
    # the cheapest rebuilds there are, the SwiGLU's operator and the norms': nothing behind
    # a matmul (the rest of the budget is met by compressing)
    sources = {"input_layernorm": "layer_in", "pre_mlp_layernorm": "ln2_in", "mlp": "swiglu_in"}
    assert rebuilt and rebuilt == {name: sources.get(costs.site(name).operator)
                                   for name in rebuilt}


def test_costs_are_consistent_and_round_trip():
    costs = analytic.analytic_costs(GPT345M, 8, "v100-32gb")
    assert costs.site("layer_in").can_recompute is False
    qkv = costs.site("qkv")
    # matmul sites are FLOP-bound: qkv = 2 * s*b*h*3h FLOPs at the derated peak, plus bias.
    flops = 2 * 1024 * 8 * 1024 * 3 * 1024
    assert qkv.rebuild_s >= flops / (125e12 * analytic.MATMUL_EFFICIENCY)
    assert qkv.codecs[0].codec == "channel_int4"
    assert qkv.codecs[0].payload_bytes == pytest.approx(qkv.bytes / 4, rel=0.01)
    mask = costs.site("attn_dropout_mask")
    assert mask.codecs[0].payload_bytes * 8 == mask.bytes
    assert ModelCosts.from_json(costs.to_json()) == costs


LLAMA_FLAGS = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                   num_query_groups=2, add_bias_linear=False)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("family", [{}, LLAMA_FLAGS], ids=["gpt", "llama"])
def test_codec_payloads_equal_real_encodes(precision, family):
    # Each site's payload is what its codec really keeps for a finite tensor of the site's
    # shape and dtype (the gate half alone for swiglu_in, a view of fc1's whole output), with
    # the outlier codec's capacity OUTLIER_CHANNEL_FRACTION of the channels.
    shape = analytic.ModelShape(2, 128, 4, 32, 100, ffn_hidden_size=1600, precision=precision,
                                **family)
    sizes = analytic.sites.layer_sites(shape)
    d = analytic.sites.dims_of(shape, 2)
    for site in analytic.analytic_costs(shape, 2, "a100-80gb").sites:
        cost = site.codecs[0]
        channels = sizes[site.name].channels(d)
        outliers = (round(channels * analytic.OUTLIER_CHANNEL_FRACTION)
                    if cost.codec == "outlier_int4" else 0)
        dtype = getattr(torch, site.dtype)
        rows = sizes[site.name].encoded_elements(d) // channels
        x = with_outlier_channels((rows, channels), torch.float32, outliers)
        x = x > 0 if dtype == torch.bool else x.to(dtype)
        assert cost.capacity == (outliers if cost.codec == "outlier_int4" else None)
        capacity = {"capacity": outliers} if cost.codec == "outlier_int4" else {}
        assert cost.payload_bytes == codecs.get(cost.codec, backend="torch",
                                                **capacity).encode(x).nbytes, site.name


def test_bf16_on_v100_is_refused():
    shape = analytic.ModelShape(2, 64, 4, 32, 100, precision="bf16")
    with pytest.raises(ValueError, match="bfloat16"):
        analytic.analytic_costs(shape, 1, "v100-32gb")


def test_shape_from_megatron_flags():
    # GPT-2's vocabulary: the caller resolves a --tokenizer-type's (adacc plan does).
    shape = analytic.ModelShape.from_flags({"num-layers": 12, "hidden_size": 768,
                                            "num-attention-heads": 12, "seq-length": 1024,
                                            "vocab-size": 50257, "fp16": True})
    assert (shape.vocab_size, shape.padded_vocab_size, shape.precision) == (50257, 50304, "fp16")
    with pytest.raises(ValueError, match="needs --vocab-size"):
        analytic.ModelShape.from_flags({"num-layers": 2, "hidden-size": 64, "seq-length": 8,
                                        "num-attention-heads": 4,
                                        "tokenizer-type": "GPT2BPETokenizer"})
    assert analytic.ModelShape.from_flags({
        "num-layers": 2, "hidden-size": 64, "num-attention-heads": 4, "seq-length": 8,
        "vocab-size": 10, "untie-embeddings-and-output-weights": True,
    }).untie_embeddings_and_output_weights
    with pytest.raises(ValueError, match="hidden-size"):
        analytic.ModelShape.from_flags({"num-layers": 2, "seq-length": 8, "vocab-size": 10})
