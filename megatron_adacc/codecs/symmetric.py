"""Symmetric int4 reference kernels (PyTorch, any device).

Rule (paper eq. symmetric-quant): scale = max|x| / 8, code = clip(round(x / scale), -8, 7). Two
refinements keep |x - x^| <= |scale| / 2 on every element:
- The group's sign is folded into the scale, so its largest-magnitude element lands on -8, the int4
  code without a positive twin. With the paper's rule as written, a positive maximum clips from 8 to
  7 and is off by a full step.
- If the group also holds an element of the other sign beyond 15/16 of that magnitude, the scale
  grows to that element / 7.5. It then rounds to 7, at most half a step away.
Zero stays exact. Scales are rounded up to bf16 (int4.ceil_to_bf16). A group holding NaN or +-Inf
gets a NaN scale and decodes to NaN. Decoded values saturate to the dtype's finite range
(int4.saturate).

A reduction dimension picks the grouping. reduce_dim=1 gives one scale per row of the 2-D view (flat
groups, or per token); reduce_dim=0 one scale per column (per channel).
"""
from __future__ import annotations

import torch

from megatron_adacc.codecs.int4 import (
    MIN_SCALE,
    ceil_to_bf16,
    finite_groups,
    pack_nibbles,
    saturate,
    store_scales,
    true_divide,
    unpack_nibbles,
    zero_channels,
)
from megatron_adacc.codecs.outlier import put_columns, take_columns


def sym_scales(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Signed fp32 scales from group minima and maxima (fp32).

    A scale is finite for a finite group, NaN for one holding NaN or +-Inf (int4.finite_groups)."""
    negative_extreme = -lo >= hi
    extreme = torch.where(negative_extreme, -lo, hi)
    opposite = torch.where(negative_extreme, hi, -lo)
    magnitude = ceil_to_bf16(torch.maximum(extreme / 8,
                                           true_divide(opposite, 7.5))).clamp_min(MIN_SCALE)
    scale = torch.where(negative_extreme, magnitude, -magnitude)
    return torch.where(finite_groups(lo, hi), scale, torch.nan)


def sym_encode(x2d: torch.Tensor, reduce_dim: int,
               zeroed: tuple[int, torch.Tensor, torch.Tensor] | None = None):
    """-> (packed int4 codes of x2d in row-major order, bf16 scales).

    A group with a NaN scale (sym_scales) stores the zero code 8 throughout.

    Args:
        zeroed: (channels, mask, index), the outlier codec's selected channels
            (outlier.select_channels), encoded as zeros (int4.zero_channels). With it, a third value
            is returned: their exact values [rows, len(index)] (outlier.take_columns), where a
            backend copies them in its encoding pass, else None.
    """
    if zeroed is not None:
        values = take_columns(x2d.reshape(-1, zeroed[0]), zeroed[2])
    x2d = zero_channels(x2d, zeroed)
    lo, hi = torch.aminmax(x2d, dim=reduce_dim, keepdim=True)
    scale = sym_scales(lo.float(), hi.float())
    finite = ~torch.isnan(scale)
    # One reciprocal per group, then a multiply per element: a division per element is what
    # bounds a CPU kernel, and every backend rounds 1/scale and x * (1/scale) the same way.
    y = x2d.float() * torch.where(finite, scale, 1.0).reciprocal()
    codes = torch.where(finite, torch.floor(y + 8.5).clamp(0, 15), 8.0).to(torch.uint8)
    encoded = (pack_nibbles(codes), store_scales(scale).squeeze(reduce_dim))
    return encoded if zeroed is None else (*encoded, values)


def sym_decode(packed: torch.Tensor, scales: torch.Tensor, shape2d: tuple[int, int],
               reduce_dim: int, dtype: torch.dtype,
               exact: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decoded [rows, cols] of ``dtype``, saturated to its finite range (int4.saturate).

    Args:
        exact: (channels, index, values), the outlier codec's exact channels (int32 slots,
            EMPTY_SLOT where unused). They are written over the decoded values, seen as rows of
            ``channels`` (outlier.put_columns), in the same pass where a backend can.
    """
    codes = unpack_nibbles(packed, shape2d[0] * shape2d[1]).view(shape2d)
    # (code - 8) * scale is exact in fp32 (4 x 8 significant bits) short of overflow; the
    # one rounding is the final cast to the output dtype.
    out = saturate((codes.float() - 8) * scales.float().unsqueeze(reduce_dim), dtype)
    if exact is not None:
        channels, index, values = exact
        put_columns(out.view(-1)[: values.shape[0] * channels].view(-1, channels), index, values)
    return out
