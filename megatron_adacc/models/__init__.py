"""Model families (see family.py): GPT-2's and Llama's, each declared in its own module."""
from megatron_adacc.models import gpt, llama  # noqa: F401  (registers the families)
from megatron_adacc.models.family import (
    FAMILIES,
    MLPS,
    NORMS,
    POSITIONS,
    EmbeddingOptions,
    LayerVariant,
    MlpPart,
    ModelFamily,
    NormPart,
    PositionPart,
    TorchNorm,
    get,
    layer_variant,
    mlp_part,
    register,
    transformer_config_options,
)

__all__ = ["FAMILIES", "MLPS", "NORMS", "POSITIONS", "EmbeddingOptions", "LayerVariant",
           "MlpPart", "ModelFamily", "NormPart", "PositionPart", "TorchNorm", "get",
           "layer_variant", "mlp_part", "register", "transformer_config_options"]
