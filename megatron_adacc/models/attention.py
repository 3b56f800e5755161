"""The attention backend of a layer spec: megatron-core's unfused `DotProductAttention`, or
`FlashDotProductAttention` (flash_attention.py), the same module on PyTorch's
`scaled_dot_product_attention`. Light to import (the flag parser uses it): megatron is
imported where a spec is built.

    --attention-backend unfused   megatron-core's local core attention (the s^2 tensors)
    --attention-backend flash     SDPA: its flash (or memory-efficient) kernel saves Q, K, V,
                                  the output and the log-sum-exp; no s^2 tensor exists
    --attention-backend auto      flash wherever this device's SDPA runs such a kernel with
                                  the configured attention dropout, else unfused

Megatron-LM names the flag the same and defaults to auto. On the CPU, SDPA runs its flash
kernel only without dropout (with dropout it falls back to its math path, which saves the
s^2 tensors under names the flash sites do not have), so auto picks flash there only at
attention dropout 0 and an explicit flash with dropout is refused. On CUDA the flash and
memory-efficient kernels draw their own dropout (their philox seed and offset are saved).
"""
from __future__ import annotations

import dataclasses

ATTENTION_BACKENDS = ("auto", "flash", "unfused")
# What megatron-core's local spec and this package's spec functions build unless told.
DEFAULT_SPEC_BACKEND = "unfused"


def flash_runs(attention_dropout: float, cuda: bool | None = None) -> bool:
    """Whether SDPA runs a kernel that saves only Q, K, V, the output and the log-sum-exp
    (flash or memory-efficient) at this attention dropout on this device (default: CUDA if
    there is one)."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return cuda or attention_dropout == 0


def resolve_backend(backend: str, attention_dropout: float, cuda: bool | None = None) -> str:
    """"flash" or "unfused" for a configured backend (auto resolved for this device)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        return "flash" if flash_runs(attention_dropout, cuda) else "unfused"
    if backend == "flash" and not flash_runs(attention_dropout, cuda):
        raise ValueError(
            f"--attention-backend flash with --attention-dropout {attention_dropout}: PyTorch's "
            "scaled_dot_product_attention on the CPU has no flash kernel with dropout (its math "
            "path would save the s^2 tensors); use attention dropout 0, or --attention-backend "
            "unfused or auto")
    return backend


def auto_core_attention(config, *args, **kwargs):
    """A core-attention builder (megatron calls it like a module class) that picks flash or
    unfused from the config's attention dropout on this device."""
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
    """A local-spec layer `spec` whose self-attention's core attention is `backend`'s."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    attention = spec.submodules.self_attention
    core = dataclasses.replace(attention.submodules, core_attention=_core_attention(backend))
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attention, submodules=core)))
