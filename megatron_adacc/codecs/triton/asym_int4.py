"""Asymmetric int4, one scale and offset per group: the Triton twin of codecs/asymmetric.py.

A group is a row of [groups, width], width even. There is one encode kernel and one decode kernel.
Tiles of whole groups load as unit-stride vectors; their codes split into even and odd for the
nibbles.
"""
import functools

import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.triton.launch import FP_FUSION, needs_int64, next_power_of_2, row_tile
from megatron_adacc.codecs.triton.numerics import (bf16_bits_to_float, ceil_to_bf16, code_value,
                                                   floor_code, load_float, nan_max, nan_min,
                                                   non_finite, saturate_to, scale_bits,
                                                   to_output)


@triton.jit
def _asym_encode(x_ptr, packed_ptr, scale_ptr, offset_ptr, rows, width,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    # The dtypes come from the pointers and the minimum scale (int4.MIN_SCALE, 2 ** -126, fp32's
    # least normal) is a constant: an argument more would cost the launcher host time.
    IN_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    min_scale: tl.constexpr = 1.1754943508222875e-38
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    if INT64:
        row = row.to(tl.int64)
    col = tl.arange(0, BLOCK_COLS)
    in_row = row < rows
    mask = in_row[:, None] & (col < width)[None, :]
    x = load_float(x_ptr + row[:, None] * width + col[None, :], mask, IN_BF16)

    lo = nan_min(tl.where(mask, x, float("inf")), 1)
    lo = tl.where(lo == 0, 0.0, lo)  # +0 whichever zero the reduction met first
    hi = nan_max(tl.where(mask, x, -float("inf")), 1)
    scale = tl.maximum(ceil_to_bf16(tl.div_rn(hi - lo, 15.0)), min_scale)
    # Non-finite: a NaN or +-Inf element (then lo or hi is), or a grid 15 * scale past fp32
    # (asymmetric.asym_encode).
    bad = (non_finite(lo) | non_finite(hi) | non_finite(15 * scale)) > 0
    lo = tl.where(bad, 0.0, lo)
    inverse = tl.div_rn(1.0, tl.where(bad, 1.0, scale))[:, None]

    # Codes in the load's layout, then paired (floor_code: no conversion instruction).
    code = floor_code(tl.minimum(tl.maximum((x - lo[:, None]) * inverse + 0.5, 0.0), 15.0))
    code = tl.where(bad[:, None], 0, code)
    code_even, code_odd = tl.split(tl.reshape(code, [BLOCK_ROWS, BLOCK_COLS // 2, 2]))
    pair = tl.arange(0, BLOCK_COLS // 2)
    tl.store(packed_ptr + row[:, None] * (width // 2) + pair[None, :],
             (code_even | (code_odd << 4)).to(tl.uint8),
             mask=in_row[:, None] & (pair < width // 2)[None, :])
    tl.store(scale_ptr + row, scale_bits(scale, bad), mask=in_row)
    # lo is an input element (or 0), so any rounding mode converts it exactly.
    tl.store(offset_ptr + row, to_output(lo, IN_BF16, offset_ptr.dtype.element_ty),
             mask=in_row)


@triton.jit
def _asym_decode(packed_ptr, scale_ptr, offset_ptr, out_ptr, rows, width,
                 BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    OUT_BF16: tl.constexpr = out_ptr.dtype.element_ty == tl.bfloat16
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    if INT64:
        row = row.to(tl.int64)
    in_row = row < rows
    pair = tl.arange(0, BLOCK_COLS // 2)
    byte = tl.load(packed_ptr + row[:, None] * (width // 2) + pair[None, :],
                   mask=in_row[:, None] & (pair < width // 2)[None, :], other=0)
    scale = bf16_bits_to_float(tl.load(scale_ptr + row, mask=in_row, other=0))[:, None]
    lo = load_float(offset_ptr + row, in_row, OUT_BF16)[:, None]
    even = saturate_to(lo + code_value(byte & 15, 0) * scale, out_ptr.dtype.element_ty)
    odd = saturate_to(lo + code_value(byte >> 4, 0) * scale, out_ptr.dtype.element_ty)
    col = tl.arange(0, BLOCK_COLS)
    value = to_output(tl.interleave(even, odd), OUT_BF16, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row[:, None] * width + col[None, :], value,
             mask=in_row[:, None] & (col < width)[None, :])


@functools.lru_cache(maxsize=4096)
def _geometry(rows: int, width: int) -> tuple[tuple, dict]:
    """(grid, options) of both kernels on [rows, width]: a dictionary lookup a call."""
    tile = row_tile(rows, width, next_power_of_2(width))
    return tile.grid, dict(BLOCK_ROWS=tile.rows, BLOCK_COLS=tile.cols,
                           INT64=needs_int64(rows * width), num_warps=tile.num_warps)


def asym_encode(x2d: torch.Tensor):
    """-> (packed codes, bf16 scales, offsets in x2d's dtype) of contiguous [groups, width]."""
    rows, width = x2d.shape
    grid, options = _geometry(rows, width)
    device = x2d.device
    packed = torch.empty(rows * width // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(rows, dtype=torch.bfloat16, device=device)
    offsets = torch.empty(rows, dtype=x2d.dtype, device=device)
    # .run is what kernel[grid](...) calls, less a lambda and a repacking of the arguments
    _asym_encode.run(x2d, packed, scales, offsets, rows, width, grid=grid, warmup=False,
                     enable_fp_fusion=FP_FUSION, **options)
    return packed, scales, offsets


def asym_decode(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, shape2d,
                dtype: torch.dtype) -> torch.Tensor:
    """The decoded [groups, width] of ``dtype``."""
    rows, width = shape2d
    grid, options = _geometry(rows, width)
    out = torch.empty(rows, width, dtype=dtype, device=packed.device)
    _asym_decode.run(packed, scales, offsets, out, rows, width, grid=grid, warmup=False,
                     **options)
    return out
