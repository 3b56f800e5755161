"""GPT-2's family, and what each part costs.

Its parts: LayerNorm, a GELU MLP, learned absolute positions, biases and tied embeddings
(megatron-core's local spec with its defaults).
"""
import dataclasses

from megatron_adacc.models.family import (LayerVariant, MlpPart, ModelFamily, NormPart,
                                          PositionPart, register, register_positions)
from megatron_adacc.models.terms import SiteTerm, act, no_flops, sbf

# LayerNorm saves its input in the activations' dtype, and its mean and rstd.
LAYERNORM = NormPart("LayerNorm", saves_normed=False, statistics_per_row=2,
                     parameters_per_channel=2)
# GELU saves its input (fc1's output); linear_fc2 saves GELU's output. Each elementwise step
# reads and writes one ffn-wide tensor.
GELU_MLP = MlpPart(
    "gelu", gated=False, fc1_out="gelu_in", fc2_in="gelu_out",
    site_terms={
        "gelu_in": SiteTerm(sbf, act, no_flops, lambda d: 2 * sbf(d) * d.act_bytes,
                            lambda d: d.ffn),
        "gelu_out": SiteTerm(sbf, act, no_flops, lambda d: 2 * sbf(d) * d.act_bytes,
                             lambda d: d.ffn),
    },
    default_ffn=lambda hidden: 4 * hidden)
# A learned position table: nothing saved inside the layer; unfused core attention keeps Q,
# K and V as views of linear_qkv's output (grouped K and V: repeated to the heads).
LEARNED_POSITIONS = PositionPart("learned_absolute", learned=True, site_terms={},
                                 unfused_qkv_heads=lambda d: 3 * d.heads)

GPT = register(ModelFamily(
    name="gpt",
    description="GPT-2: LayerNorm, GELU, learned positions, biases, tied embeddings",
    variant=LayerVariant(norm=LAYERNORM, mlp=GELU_MLP, positions=LEARNED_POSITIONS),
    flags={},
))

# --position-embedding-type none: neither a table nor a rotation, so nothing saved for them.
NO_POSITIONS = register_positions(dataclasses.replace(LEARNED_POSITIONS, name="none",
                                                      learned=False))
