"""Triton kernels of the codecs (CUDA, or the CPU under TRITON_INTERPRET=1), byte-exact.

They are byte-identical to the PyTorch reference, one file per kernel family:
- sym_int4.py: sym_int4's flat groups, naive_int4's rows, and outlier_int4's inliers. It takes the
  exact channels in the encoding pass and writes them back in the decoding pass.
- outlier_select.py: outlier_int4's channel sums, z-scores and capacity slots;
- channel_int4.py: per-channel scales; asym_int4.py; bitmask.py (it checks the float mask's value on
  the device).

Each encode and decode is one kernel launch and its allocations; outlier_int4's encode is two (the
selection, then the codes). Nothing reads a device value on the host. Launch geometry comes from
launch.py. Inputs outside the kernels' layouts fall back to the reference, which is sync-free too:
- rows of odd width, whose code pairs span rows;
- encodes of rows wider than launch.MAX_ROW (naive_int4's rows are a group, held whole by one
  program);
- per-channel scales of an odd channel count, and integer masks.
"""

import torch

from megatron_adacc.codecs import asymmetric, bitmask as reference_bitmask, outlier, symmetric
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.triton import (asym_int4, bitmask, channel_int4, launch, outlier_select,
                                          sym_int4)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _layout(x2d: torch.Tensor, channels: int | None = None) -> sym_int4.Layout | None:
    """The sym kernels' view of the groups a codec hands over; None where the kernels do not apply.

    The view is [groups, width] or [rows, width] (a row a group), or, read in place, [rows,
    groups a row, width]. ``channels`` is the outlier codec's. Its rows become the kernel's rows
    where the groups tile them, so that a tile's columns are channels."""
    width = x2d.shape[-1]
    if width % 2 or x2d.stride(-1) != 1 or width > launch.MAX_ROW:
        return None
    if x2d.dim() == 3:
        if x2d.stride(1) != width or not _power_of_two(width):
            return None
        return sym_int4.layout(x2d.shape[0], x2d.shape[1] * width, x2d.stride(0), width)
    if _channel_rows(channels, width) and x2d.is_contiguous():
        return sym_int4.layout(x2d.numel() // channels, channels, channels, width)
    return sym_int4.layout(x2d.shape[0], width, x2d.stride(0))


def _channel_rows(channels: int | None, group: int) -> bool:
    """Whether groups of ``group`` tile rows of ``channels``, so a tile's columns can be them."""
    return channels is not None and channels % group == 0 and _power_of_two(group)


def _sym_encode(x2d, reduce_dim, zeroed=None):
    if reduce_dim == 0:
        if x2d.shape[1] % 2 or not x2d.is_contiguous():
            return symmetric.sym_encode(x2d, reduce_dim, zeroed)
        return channel_int4.channel_encode(x2d)
    layout = _layout(x2d, None if zeroed is None else zeroed[0])
    if layout is None:
        return symmetric.sym_encode(x2d.reshape(-1, x2d.shape[-1]), reduce_dim, zeroed)
    if zeroed is None:
        return sym_int4.sym_encode(x2d, layout)
    channels, selected, index = zeroed
    values = torch.empty(x2d.numel() // channels, index.numel(), dtype=x2d.dtype, device=x2d.device)
    return (*sym_int4.sym_encode(x2d, layout, (index, values, channels, selected)), values)


def _sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact=None):
    rows, width = shape2d
    if reduce_dim == 0:
        if width % 2:
            return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact)
        return channel_int4.channel_decode(packed, scales, shape2d, dtype)
    if width % 2:
        return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact)
    if exact is not None and _channel_rows(exact[0], width):
        layout = sym_int4.layout(rows * width // exact[0], exact[0], exact[0], width)
    else:
        layout = sym_int4.layout(rows, width, width)  # a row a group
    exact = None if exact is None else (exact[1], exact[2], exact[0])
    out = sym_int4.sym_decode(packed, scales, layout, dtype, exact)
    return out if out.shape == shape2d else out.view(shape2d)  # a view costs microseconds


def _asym_encode(x2d):
    if x2d.shape[1] % 2 or not x2d.is_contiguous():
        return asymmetric.asym_encode(x2d)
    return asym_int4.asym_encode(x2d)


def _asym_decode(packed, scales, offsets, shape2d, dtype):
    if shape2d[1] % 2:
        return asymmetric.asym_decode(packed, scales, offsets, shape2d, dtype)
    return asym_int4.asym_decode(packed, scales, offsets, shape2d, dtype)


def _mask_encode(flat):
    if flat.dtype != torch.bool and not flat.is_floating_point():
        return reference_bitmask.mask_encode(flat)
    return bitmask.mask_encode(flat)


def _outlier_select(x2d, threshold, capacity):
    if x2d.stride(1) != 1:
        return outlier.outlier_select(x2d, threshold, capacity)
    return outlier_select.outlier_select(x2d, threshold, capacity)


TRITON_KERNELS = Kernels(
    sym_encode=_sym_encode,
    sym_decode=_sym_decode,
    asym_encode=_asym_encode,
    asym_decode=_asym_decode,
    mask_encode=_mask_encode,
    mask_unpack=bitmask.mask_unpack,
    outlier_select=_outlier_select,
    take_columns=outlier.take_columns,
    strided_rows=True,
)
