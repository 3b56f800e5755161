"""The core attention of a layer spec, as ``--attention-backend`` resolves (attention_backend.py).

It is megatron-core's unfused ``DotProductAttention``, or ``FlashDotProductAttention``
(flash_attention.py), the same module on PyTorch's ``scaled_dot_product_attention``. Light to
import: megatron is imported where a spec is built.
"""
from __future__ import annotations

import dataclasses

from megatron_adacc.models.attention_backend import check_backend, resolve_backend

# What megatron-core's local spec and this package's spec functions build unless told.
DEFAULT_SPEC_BACKEND = "unfused"


def auto_core_attention(config, *args, **kwargs):
    """A core-attention builder, called by megatron like a module class.

    It picks flash or unfused from the config's attention dropout on this device."""
    backend = resolve_backend("auto", config.attention_dropout)
    return _core_attention(backend)(config, *args, **kwargs)


def _core_attention(backend: str):
    if backend == "auto":
        return auto_core_attention
    if backend == "flash":
        from megatron_adacc.models.flash_attention import FlashDotProductAttention

        return FlashDotProductAttention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    return DotProductAttention


def backend_of(model) -> str:
    """The resolved backend a built model computes attention with: "flash" or "unfused"."""
    from megatron_adacc.models.flash_attention import FlashDotProductAttention

    flash = any(isinstance(module, FlashDotProductAttention) for module in model.modules())
    return "flash" if flash else "unfused"


def local_layer_spec(attention_backend: str = DEFAULT_SPEC_BACKEND, **local_spec_kwargs):
    """megatron-core's local GPT layer spec with `attention_backend`'s core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_attention_backend(get_gpt_layer_local_spec(**local_spec_kwargs),
                                  attention_backend)


def with_attention_backend(spec, backend: str):
    """A local-spec layer `spec` whose self-attention's core attention is `backend`'s.

    A block spec (megatron-core's for mixture-of-experts models) gets it in each layer."""
    check_backend(backend)
    if hasattr(spec, "layer_specs"):
        return dataclasses.replace(spec, layer_specs=[with_attention_backend(layer, backend)
                                                      for layer in spec.layer_specs])
    attention = spec.submodules.self_attention
    core = dataclasses.replace(attention.submodules, core_attention=_core_attention(backend))
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attention, submodules=core)))
