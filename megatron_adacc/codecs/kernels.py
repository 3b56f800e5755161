"""The kernel interface every codec backend implements, and its reference implementation.

The codecs (codec.py) call these functions only; a backend (native/, triton/) is one
`Kernels` value. REFERENCE is the eager PyTorch set: the ground truth the other backends
must match byte for byte, and their fallback for the cases they do not cover.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_adacc.codecs import asymmetric, bitmask, outlier, symmetric


@dataclass(frozen=True)
class Kernels:
    sym_encode: Callable
    sym_decode: Callable
    asym_encode: Callable
    asym_decode: Callable
    mask_pack: Callable
    mask_unpack: Callable
    mask_value: Callable
    channel_abs_sums: Callable
    take_columns: Callable
    put_columns: Callable
    # outlier_int4's encode in one pass, (rows, group_size, dmax, threshold) -> (outlier mask,
    # packed, scales, usable flags, exact values) or None; without one (None, the reference's)
    # the codec takes the channel sums, then sym_encode with the outlier channels zeroed.
    outlier_encode: Callable | None = None


REFERENCE = Kernels(
    sym_encode=symmetric.sym_encode,
    sym_decode=symmetric.sym_decode,
    asym_encode=asymmetric.asym_encode,
    asym_decode=asymmetric.asym_decode,
    mask_pack=bitmask.mask_pack,
    mask_unpack=bitmask.mask_unpack,
    mask_value=bitmask.mask_value,
    channel_abs_sums=outlier.channel_abs_sums,
    take_columns=outlier.take_columns,
    put_columns=outlier.put_columns,
)
