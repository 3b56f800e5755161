"""Model families (see family.py): GPT-2's and Llama's, each declared in its own module."""
from megatron_adacc.models import gpt, llama  # noqa: F401  (registers the families)
from megatron_adacc.models.family import (
    FAMILIES,
    MLPS,
    NORMS,
    EmbeddingOptions,
    LayerVariant,
    ModelFamily,
    SequenceParallelNorm,
    get,
    transformer_config_options,
    mlp_part,
)

__all__ = ["FAMILIES", "MLPS", "NORMS", "EmbeddingOptions", "LayerVariant", "ModelFamily",
           "SequenceParallelNorm", "get", "transformer_config_options", "mlp_part"]
