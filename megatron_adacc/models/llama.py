"""The Llama family (Llama 2/3, Mistral-style decoders), and what each part costs.

Its parts: RMSNorm, a SwiGLU MLP, rotary positions, grouped-query attention, no biases, untied
embeddings. It uses the same local spec as GPT's: megatron-core builds every part from the
TransformerConfig.
"""
import dataclasses

from megatron_adacc.models.family import (LayerVariant, MlpPart, ModelFamily, NormPart,
                                          PositionPart, register, register_positions)
from megatron_adacc.models.terms import SiteTerm, act, no_flops, sbf

# torch's RMSNorm on a CPU computes in fp32: it saves its input in fp32 (a 16-bit model's: a
# copy), rstd, and x * rstd. Its fused CUDA kernel saves the input as given and rstd (the H200's
# profile of Llama-1B: 32 MiB of bf16 input a layer, 32 KiB of rstd, nothing else).
RMSNORM = NormPart("RMSNorm", saves_normed=True, statistics_per_row=1,
                   parameters_per_channel=1, input_dtype="float32", fused_on_cuda=True)
# megatron's unfused glu: silu(x_glu) * (x_linear + offset). The SiLU saves the gate half (a
# view of fc1's whole output); the product saves the SiLU's output and the offset up half (a
# new tensor, made by the add); linear_fc2 saves the product. fc1 writes both halves; the
# SiLU of the gate half runs first, then the up half plus the offset (a copy), then the
# product. Megatron-LM's width keeps the parameters near a 4h MLP's, rounded down to 64.
SWIGLU_MLP = MlpPart(
    "swiglu", gated=True, fc1_out="swiglu_in", fc2_in="swiglu_out",
    activation_saves={"SiluBackward0": "swiglu_act", "AddBackward0": "swiglu_up"},
    site_terms={
        "swiglu_in": SiteTerm(lambda d: 2 * sbf(d), act, no_flops,
                              lambda d: 2 * sbf(d) * d.act_bytes, lambda d: d.ffn,
                              view_elements=sbf),
        "swiglu_act": SiteTerm(sbf, act, no_flops, lambda d: 2 * sbf(d) * d.act_bytes,
                               lambda d: d.ffn),
        "swiglu_up": SiteTerm(sbf, act, no_flops, lambda d: 2 * sbf(d) * d.act_bytes,
                              lambda d: d.ffn),
        "swiglu_out": SiteTerm(sbf, act, no_flops, lambda d: 3 * sbf(d) * d.act_bytes,
                               lambda d: d.ffn),
    },
    default_ffn=lambda hidden: int(4 * hidden * 2 / 3 / 64) * 64,
    # bias_swiglu_impl on CUDA saves fc1's output alone and recomputes the rest in backward
    fuses=True)
# RoPE saves cos and sin ([s, 1, 1, rotary dim]) and rotates Q and K into new tensors. Cos
# and sin are computed for Q and for K (four tensors written), and kept as one cos and one sin
# for every layer (sites.py: shared; runtime/shared.py). Unfused core attention then keeps the
# rotated Q and K. Without grouping, V is a view pinning linear_qkv's whole output; grouped K
# and V are repeated to the heads.
ROPE = PositionPart(
    "rope", learned=False,
    site_terms={"rope_cos_sin": SiteTerm(lambda d: 2 * d.seq * d.rotary_dim, act, no_flops,
                                         lambda d: 4 * d.seq * d.rotary_dim * d.act_bytes,
                                         lambda d: d.rotary_dim)},
    unfused_qkv_heads=lambda d: (2 * d.heads + (d.heads + 2 * d.groups) if d.groups == d.heads
                                 else 3 * d.heads))

LLAMA = register(ModelFamily(
    name="llama",
    description="Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied "
                "embeddings",
    variant=LayerVariant(norm=RMSNORM, mlp=SWIGLU_MLP, positions=ROPE),
    flags={"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
           "group-query-attention": True, "disable-bias-linear": True,
           "untie-embeddings-and-output-weights": True, "hidden-dropout": 0.0,
           "attention-dropout": 0.0},
))

# YaRN rotates by rescaled frequencies and scales cos and sin by its mscale, in the same calls:
# it saves what RoPE saves.
YARN = register_positions(dataclasses.replace(ROPE, name="yarn"))
