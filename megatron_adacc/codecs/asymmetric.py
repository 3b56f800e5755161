"""Asymmetric int4 reference kernels (PyTorch, any device), one scale and offset per row.

Meant for tensors on one side of zero such as softmax probabilities. The paper stores
offset = (max + min) / 2 and scale = (max - min) / 16 with codes clipped to [-8, 7]; that
grid stops a step short of the maximum. Here the 16 levels span [min, max] exactly:
offset = min (stored in the input dtype, so it is exact, and exact zeros of masked
probabilities decode to exact zeros), scale = (max - min) / 15 rounded up to bf16,
code = round((x - min) / scale) in [0, 15]. Every element is within scale / 2.
"""
from __future__ import annotations

import torch

from megatron_adacc.codecs.int4 import (MIN_SCALE, SCALE_DTYPE, ceil_to_bf16, pack_nibbles, true_divide,
                                        unpack_nibbles)


def asym_encode(x2d: torch.Tensor, dmax: float):
    """-> (packed int4 codes, bf16 scales, offsets in x2d's dtype, usable-scale flags)."""
    lo, hi = torch.aminmax(x2d, dim=1, keepdim=True)
    # Which zero is the minimum of {0.0, -0.0} depends on the reduction order: store +0.
    lo32 = torch.where(lo == 0, 0.0, lo.float())
    scale = ceil_to_bf16(true_divide(hi.float() - lo32, 15)).clamp_min(MIN_SCALE)
    # Usable when the whole grid min .. min + 15 * scale is finite in the input dtype; this
    # also rejects groups holding NaN or Inf (comparisons with NaN are False).
    ok = (lo32.abs() <= dmax) & ((lo32 + 15 * scale).abs() <= dmax)
    scale = torch.where(ok, scale, 0.0)
    offset = torch.where(ok, lo32, 0.0)
    y = (x2d.float() - offset) * torch.where(ok, scale, 1.0).reciprocal()  # as symmetric.sym_encode
    codes = torch.where(ok, torch.floor(y + 0.5).clamp(0, 15), 0.0).to(torch.uint8)
    return (
        pack_nibbles(codes),
        scale.to(SCALE_DTYPE).squeeze(1),
        offset.to(x2d.dtype).squeeze(1),
        ok.squeeze(1),
    )


def asym_decode(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                shape2d: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_nibbles(packed, shape2d[0] * shape2d[1]).view(shape2d)
    return (offsets.float().unsqueeze(1) + codes.float() * scales.float().unsqueeze(1)).to(dtype)
