"""Which implementation of the codec kernels (kernels.Kernels) runs.

- "torch": the eager reference (kernels.REFERENCE), the ground truth every other backend is tested
  against.
- "native": fused C kernels for the CPU (codecs/native), built with the system C compiler on first
  use; the fastest CPU path.
- "triton": the Triton kernels in codecs/triton (CUDA, or the CPU under TRITON_INTERPRET=1).
- "auto": Triton for CUDA tensors when Triton supports the GPU; native for CPU tensors when a C
  compiler is available; the eager reference otherwise.

The default comes from the ADACC_CODEC_BACKEND environment variable, else "auto". The native and
Triton modules are imported on first use only. Building the C library or importing Triton costs
seconds, and Triton must not be imported before TRITON_INTERPRET is set.
"""
from __future__ import annotations

import functools
import os

import torch

from megatron_adacc.codecs.kernels import REFERENCE, Kernels

BACKENDS = ("auto", "torch", "native", "triton")
BACKEND_ENV_VAR = "ADACC_CODEC_BACKEND"


def resolve_backend(backend: str | None) -> str:
    name = backend if backend is not None else os.environ.get(BACKEND_ENV_VAR, "auto")
    if name not in BACKENDS:
        raise ValueError(f"unknown codec backend {name!r}; expected one of {BACKENDS}")
    return name


@functools.cache
def _triton() -> Kernels:
    from megatron_adacc.codecs.triton import TRITON_KERNELS

    return TRITON_KERNELS


@functools.cache
def _native() -> Kernels | None:
    from megatron_adacc.codecs import native

    return native.NATIVE_KERNELS if native.available() else None


@functools.cache
def triton_supports(device: torch.device) -> bool:
    """Triton is importable and the GPU is one it compiles for (compute capability >= 7.0)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device) >= (7, 0)


def describe(device: torch.device, backend: str | None = None) -> str:
    """Which kernels encode ``device``'s tensors (kernels_for); timings depend on it.

    It is "torch", "triton", or "native" with the vector path its build took ("native avx2")."""
    kernels = kernels_for(resolve_backend(backend), device)
    if kernels is REFERENCE:
        return "torch"
    if kernels is _native():
        from megatron_adacc.codecs import native

        return f"native {native.vector_isa()}"
    return "triton"


def unusable(backend: str, device_type: str) -> str | None:
    """Why ``backend``'s kernels cannot run on a ``device_type`` device; None if they can."""
    if backend == "native" and _native() is None:
        return "codec backend 'native' could not build codecs/native/codecs.c (no C compiler?)"
    if (backend == "triton" and device_type != "cuda"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return (f"codec backend 'triton' needs a CUDA tensor (got {device_type}) or "
                "TRITON_INTERPRET=1 set before triton is imported")
    return None


def kernels_for(backend: str, device: torch.device) -> Kernels:
    if backend == "torch":
        return REFERENCE
    reason = unusable(backend, device.type)
    if reason is not None:
        raise RuntimeError(reason)
    if backend == "native":
        return _native()
    if backend == "triton":
        return _triton()
    if device.type == "cuda" and triton_supports(device):
        return _triton()
    if device.type == "cpu" and _native() is not None:
        return _native()
    return REFERENCE
