"""Activation codecs (paper section "Layer-specific compression").

    codec = megatron_adacc.codecs.get("outlier_int4", threshold=3.0, capacity=8, backend="auto")
    payload = codec.encode(tensor)       # payload.nbytes, payload.shape/.dtype/.device
    tensor_hat = codec.decode(payload)   # same shape, dtype and device as `tensor`
    codec.payload_bytes(shape, dtype)    # == payload.nbytes, whatever the data

No encode or decode reads a device value on the host or sizes a tensor by the data:
- a group holding NaN or Inf is stored with a NaN scale and decodes to NaN;
- outlier_int4 keeps a fixed capacity of exact channels;
- a float tensor that is no mask gets a NaN bitmask value.

Backends: "auto", "torch" (the eager reference), "native", "triton". "auto" is the default: Triton
on CUDA, the native C kernels on CPU, eager PyTorch when neither is available. All of them produce
byte-identical payloads. ADACC_CODEC_BACKEND sets the default for codecs built without an explicit
backend.

Defaults: sym_int4 and outlier_int4 use groups of 64, asym_int4 groups of 128. Scales are bf16 (2
bytes), so payloads are 0.266 of a 16-bit tensor and 0.133 (asym 0.137) of fp32.
"""
from __future__ import annotations

from megatron_adacc.codecs.backend import BACKEND_ENV_VAR, BACKENDS
from megatron_adacc.codecs.codec import (
    AsymInt4,
    Bitmask,
    ChannelInt4,
    Codec,
    NaiveInt4,
    OutlierInt4,
    SymInt4,
)
from megatron_adacc.codecs.payload import Payload

_CODECS: dict[str, type[Codec]] = {
    cls.name: cls for cls in (OutlierInt4, ChannelInt4, AsymInt4, SymInt4, Bitmask, NaiveInt4)
}
NAMES = tuple(_CODECS)


def get(name: str, **options) -> Codec:
    """A codec by name; options are its constructor's keywords (group_size, threshold, ...)."""
    try:
        cls = _CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; expected one of {NAMES}") from None
    return cls(**options)


__all__ = ["get", "NAMES", "Codec", "Payload", "BACKENDS", "BACKEND_ENV_VAR"]
