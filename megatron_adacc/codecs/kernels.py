"""The kernel interface every codec backend implements, and its reference implementation.

The codecs (codec.py) call these functions only, and a backend (native/, triton/) is one ``Kernels``
value. REFERENCE is the eager PyTorch set. It is the ground truth the other backends must match byte
for byte, and their fallback for the cases they do not cover.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from megatron_adacc.codecs import asymmetric, bitmask, outlier, symmetric


@dataclass(frozen=True)
class Kernels:
    """One backend's kernels; none reads a device value on the host.

    Every output's shape follows from the inputs' shapes and the arguments alone.

    - sym_encode(x2d, reduce_dim, zeroed=None) -> (packed, scales), or with zeroed = (channels,
      selected mask, index): (packed, scales, exact values or None)
    - sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact=None) -> [rows, cols]; exact =
      (channels, index, values)
    - asym_encode(x2d) -> (packed, scales, offsets)
    - asym_decode(packed, scales, offsets, shape2d, dtype) -> [rows, cols]
    - mask_encode(flat) -> (packed, value or None); mask_unpack(packed, numel, value=None)
    - outlier_select(x2d, threshold, capacity) -> (selected mask, index [capacity])
    - take_columns(x2d, index) -> [rows, len(index)], +0 in empty slots
    The reference functions (symmetric, asymmetric, bitmask, outlier) document each.
    """

    sym_encode: Callable
    sym_decode: Callable
    asym_encode: Callable
    asym_decode: Callable
    mask_encode: Callable
    mask_unpack: Callable
    outlier_select: Callable
    take_columns: Callable
    # Whether the encode kernels read rows a stride apart where they lie (a view's rows, its
    # last dimension dense; Codec.reads_in_place): otherwise a codec hands them a copy.
    strided_rows: bool = False


REFERENCE = Kernels(
    sym_encode=symmetric.sym_encode,
    sym_decode=symmetric.sym_decode,
    asym_encode=asymmetric.asym_encode,
    asym_decode=asymmetric.asym_decode,
    mask_encode=bitmask.mask_encode,
    mask_unpack=bitmask.mask_unpack,
    outlier_select=outlier.outlier_select,
    take_columns=outlier.take_columns,
)
