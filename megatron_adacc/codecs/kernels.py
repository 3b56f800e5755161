"""The kernel interface every codec backend implements, and its reference implementation.

The codecs (codec.py) call these functions only; a backend (native/, triton/) is one
`Kernels` value. REFERENCE is the eager PyTorch set: the ground truth the other backends
must match byte for byte, and their fallback for the cases they do not cover.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_adacc.codecs import asymmetric, bitmask, int4, outlier, symmetric


@dataclass(frozen=True)
class Kernels:
    sym_encode: Callable
    count_unusable: Callable
    sym_decode: Callable
    asym_encode: Callable
    asym_decode: Callable
    mask_encode: Callable
    mask_unpack: Callable
    outlier_channels: Callable
    take_columns: Callable
    put_columns: Callable
    # Whether the encode kernels read rows a stride apart where they lie (a view's rows, its
    # last dimension dense; Codec.reads_in_place): otherwise a codec hands them a copy.
    strided_rows: bool = False


REFERENCE = Kernels(
    sym_encode=symmetric.sym_encode,
    count_unusable=int4.count_unusable,
    sym_decode=symmetric.sym_decode,
    asym_encode=asymmetric.asym_encode,
    asym_decode=asymmetric.asym_decode,
    mask_encode=bitmask.mask_encode,
    mask_unpack=bitmask.mask_unpack,
    outlier_channels=outlier.outlier_channels,
    take_columns=outlier.take_columns,
    put_columns=outlier.put_columns,
)
