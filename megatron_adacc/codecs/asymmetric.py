"""Asymmetric int4 reference kernels (PyTorch, any device), one scale and offset per row.

They are meant for tensors on one side of zero, such as softmax probabilities. The paper stores
offset = (max + min) / 2 and scale = (max - min) / 16, with codes clipped to [-8, 7]; that grid
stops a step short of the maximum. Here the 16 levels span [min, max] exactly:
- offset = min, stored in the input dtype. So it is exact, and the exact zeros of masked
  probabilities decode to exact zeros.
- scale = (max - min) / 15, rounded up to bf16;
- code = round((x - min) / scale), in [0, 15].
Every element is within scale / 2. A group holding NaN or +-Inf decodes to NaN. Decoded values
saturate to the dtype's finite range.
"""
from __future__ import annotations

import torch

from megatron_adacc.codecs.int4 import (MIN_SCALE, ceil_to_bf16, finite_groups, pack_nibbles,
                                        saturate, store_scales, true_divide, unpack_nibbles)


def asym_encode(x2d: torch.Tensor):
    """-> (packed int4 codes, bf16 scales, offsets in x2d's dtype).

    Some groups store a NaN scale, offset +0 and code 0 throughout, so they decode to NaN. These are
    groups holding NaN or +-Inf, and groups whose grid 15 * scale overflows fp32. That takes a range
    max - min past ~3.39e38: fp32 or bf16 inputs of both signs near the limit.
    """
    lo, hi = torch.aminmax(x2d, dim=1, keepdim=True)
    # Which zero is the minimum of {0.0, -0.0} depends on the reduction order: store +0.
    lo32 = torch.where(lo == 0, 0.0, lo.float())
    scale = ceil_to_bf16(true_divide(hi.float() - lo32, 15)).clamp_min(MIN_SCALE)
    # A finite group whose grid min + 15 * scale leaves fp32 cannot be decoded: flagged
    finite = finite_groups(lo32, hi.float()) & torch.isfinite(15 * scale)
    scale = torch.where(finite, scale, torch.nan)
    offset = torch.where(finite, lo32, 0.0)
    # as symmetric.sym_encode
    y = (x2d.float() - offset) * torch.where(finite, scale, 1.0).reciprocal()
    codes = torch.where(finite, torch.floor(y + 0.5).clamp(0, 15), 0.0).to(torch.uint8)
    return pack_nibbles(codes), store_scales(scale).squeeze(1), offset.to(x2d.dtype).squeeze(1)


def asym_decode(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                shape2d: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Decoded [rows, cols] of ``dtype``, saturated to its finite range (int4.saturate)."""
    codes = unpack_nibbles(packed, shape2d[0] * shape2d[1]).view(shape2d)
    return saturate(offsets.float().unsqueeze(1) + codes.float() * scales.float().unsqueeze(1),
                    dtype)
