"""GPT-2's family: LayerNorm, a GELU MLP, learned absolute positions, biases, tied
embeddings (megatron-core's local spec with its defaults)."""
from megatron_adacc.models.family import LayerVariant, MlpPart, ModelFamily, NormPart, register

LAYERNORM = NormPart("LayerNorm", saves_normed=False, statistics_per_row=2)
# GELU saves its input (fc1's output); linear_fc2 saves GELU's output.
GELU_MLP = MlpPart("gelu", gated=False, fc1_out="gelu_in", fc2_in="gelu_out")

GPT = register(ModelFamily(
    name="gpt",
    description="GPT-2: LayerNorm, GELU, learned positions, biases, tied embeddings",
    variant=LayerVariant(norm=LAYERNORM, mlp=GELU_MLP, rope=False),
    flags={},
))
