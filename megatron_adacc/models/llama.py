"""The Llama family (Llama 2/3, Mistral-style decoders): RMSNorm, a SwiGLU MLP, rotary
positions, grouped-query attention, no biases, untied embeddings. The same local spec as
GPT's: megatron-core builds every part from the TransformerConfig."""
from megatron_adacc.models.family import LayerVariant, MlpPart, ModelFamily, NormPart, register

RMSNORM = NormPart("RMSNorm", saves_normed=True, statistics_per_row=1)
# megatron's unfused glu: silu(x_glu) * (x_linear + offset). The SiLU saves the gate half (a
# view of fc1's whole output); the product saves the SiLU's output and the offset up half (a
# new tensor, made by the add); linear_fc2 saves the product.
SWIGLU_MLP = MlpPart("swiglu", gated=True, fc1_out="swiglu_in", fc2_in="swiglu_out",
                     activation_saves={"SiluBackward0": "swiglu_act",
                                       "AddBackward0": "swiglu_up"})

LLAMA = register(ModelFamily(
    name="llama",
    description="Llama: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied "
                "embeddings",
    variant=LayerVariant(norm=RMSNORM, mlp=SWIGLU_MLP, rope=True),
    flags={"normalization": "RMSNorm", "swiglu": True, "position-embedding-type": "rope",
           "group-query-attention": True, "disable-bias-linear": True,
           "untie-embeddings-and-output-weights": True, "hidden-dropout": 0.0,
           "attention-dropout": 0.0},
))
