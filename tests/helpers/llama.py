"""The tiny Llama the runtime tests build, and Llama-3-8B's shape for the analytic model."""
import torch
import torch.nn.functional as F

from helpers import ROOT
from helpers.runtime import SEQ, VOCAB, train
from megatron_adacc import models
from megatron_adacc.launch import read_config
from megatron_adacc.models import build as model_lib
from megatron_adacc.models.attention import local_layer_spec
from megatron_adacc.planning import analytic
from megatron_adacc.runtime import apply_plan, get_adacc_layer_spec

HEADS, GROUPS, HIDDEN, FFN = 4, 2, 64, 96
EMBEDDING = models.EmbeddingOptions(position_embedding_type="rope", rotary_base=10000,
                                    untie_embeddings_and_output_weights=True)


def build_llama(adacc: bool, dtype=torch.float32, attention_backend="unfused", layers=2,
                seed=1, dropout=0.0, embedding=EMBEDDING):
    """A tiny Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention), stock or Adacc."""
    model_lib.set_seed(seed)
    config = model_lib.build_transformer_config(
        num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, ffn_hidden_size=FFN, hidden_dropout=dropout,
        attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, layernorm_epsilon=1e-5,
        bf16=dtype == torch.bfloat16, params_dtype=dtype)
    spec = (get_adacc_layer_spec(attention_backend) if adacc
            else local_layer_spec(attention_backend))
    model = model_lib.build_gpt_model(config, VOCAB, SEQ, spec, attention_backend,
                                      embedding=embedding).to(dtype)
    if adacc:
        apply_plan(model, None, strict=True)
    return model


def train_steps(model, steps=3, plan=None):
    """``train`` for ``steps`` steps, under ``plan`` (strict) when one is given."""
    if plan is not None:
        apply_plan(model, plan, strict=True)
    return train(model, steps)


# Llama-3-8B (configs/llama3-8b.yaml, bf16) on one rank of TP=2 with sequence parallelism
LLAMA3_8B_TP2 = analytic.ModelShape.from_flags({
    **{dest.replace("_", "-"): value for dest, value in
       read_config(str(ROOT / "configs" / "llama3-8b.yaml")).items()},
    "tensor-model-parallel-size": 2, "sequence-parallel": True})
