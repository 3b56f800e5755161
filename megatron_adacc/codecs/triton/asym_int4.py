"""Asymmetric int4, one scale and offset per row of a [rows, cols] view (cols even): the
Triton twin of codecs/asymmetric.py."""
import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import MIN_SCALE
from megatron_adacc.codecs.triton.launch import FP_FUSION, bits_view, row_blocks, tl_dtype
from megatron_adacc.codecs.triton.numerics import ceil_to_bf16, load_float, to_output


@triton.jit
def _asym_encode_rows(x_ptr, packed_ptr, scale_ptr, offset_ptr, ok_ptr, rows, cols, dmax, min_scale,
                      IN_BF16: tl.constexpr, offset_dtype: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    in_row = row < rows
    mask = in_row[:, None] & (pair[None, :] < cols // 2)
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    even = load_float(x_ptr + offset, mask, IN_BF16)
    odd = load_float(x_ptr + offset + 1, mask, IN_BF16)

    non_finite = (even != even) | (tl.abs(even) == float("inf")) | (odd != odd) | (tl.abs(odd) == float("inf"))
    finite_row = tl.sum((non_finite & mask).to(tl.int32), axis=1) == 0
    lo = tl.min(tl.where(mask, tl.minimum(even, odd), float("inf")), axis=1)
    lo = tl.where(lo == 0, 0.0, lo)  # +0 whichever zero the reduction met first
    hi = tl.max(tl.where(mask, tl.maximum(even, odd), -float("inf")), axis=1)
    scale = tl.maximum(ceil_to_bf16(tl.div_rn(hi - lo, 15.0)), min_scale)
    ok = finite_row & (tl.abs(lo) <= dmax) & (tl.abs(lo + 15 * scale) <= dmax)
    scale = tl.where(ok, scale, 0.0)
    lo = tl.where(ok, lo, 0.0)

    inverse = tl.div_rn(1.0, tl.where(ok, scale, 1.0))[:, None]
    code_even = tl.minimum(tl.maximum(tl.floor((even - lo[:, None]) * inverse + 0.5), 0.0), 15.0)
    code_odd = tl.minimum(tl.maximum(tl.floor((odd - lo[:, None]) * inverse + 0.5), 0.0), 15.0)
    code_even = tl.where(ok[:, None], code_even, 0.0).to(tl.uint8)
    code_odd = tl.where(ok[:, None], code_odd, 0.0).to(tl.uint8)
    tl.store(packed_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :], code_even | (code_odd << 4), mask=mask)
    tl.store(scale_ptr + row, scale.to(tl.bfloat16), mask=in_row)
    # lo is an input element (or 0), so any rounding mode converts it exactly.
    tl.store(offset_ptr + row, to_output(lo, IN_BF16, offset_dtype), mask=in_row)
    tl.store(ok_ptr + row, ok.to(tl.int8), mask=in_row)


@triton.jit
def _asym_decode_rows(packed_ptr, scale_ptr, offset_ptr, out_ptr, rows, cols,
                      OUT_BF16: tl.constexpr, out_dtype: tl.constexpr,
                      BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    in_row = row < rows
    mask = in_row[:, None] & (pair[None, :] < cols // 2)
    byte = tl.load(packed_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + row, mask=in_row, other=0.0).to(tl.float32)[:, None]
    lo = load_float(offset_ptr + row, in_row, OUT_BF16)[:, None]
    even = lo + (byte & 15).to(tl.float32) * scale
    odd = lo + (byte >> 4).to(tl.float32) * scale
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    tl.store(out_ptr + offset, to_output(even, OUT_BF16, out_dtype), mask=mask)
    tl.store(out_ptr + offset + 1, to_output(odd, OUT_BF16, out_dtype), mask=mask)


def asym_encode_rows(x2d: torch.Tensor, dmax: float):
    rows, cols = x2d.shape
    packed = torch.empty(rows * cols // 2, dtype=torch.uint8, device=x2d.device)
    scales = torch.empty(rows, dtype=torch.bfloat16, device=x2d.device)
    offsets = torch.empty(rows, dtype=x2d.dtype, device=x2d.device)
    ok = torch.empty(rows, dtype=torch.int8, device=x2d.device)
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _asym_encode_rows[grid](bits_view(x2d), packed, scales, bits_view(offsets), ok, rows, cols, dmax,
                            MIN_SCALE, IN_BF16=x2d.dtype == torch.bfloat16, offset_dtype=tl_dtype(x2d.dtype),
                            BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs, enable_fp_fusion=FP_FUSION)
    return packed, scales, offsets, ok.bool()


def asym_decode_rows(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, shape2d,
                     dtype: torch.dtype) -> torch.Tensor:
    rows, cols = shape2d
    out = torch.empty(shape2d, dtype=dtype, device=packed.device)
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _asym_decode_rows[grid](packed, scales, bits_view(offsets), bits_view(out), rows, cols,
                            OUT_BF16=dtype == torch.bfloat16, out_dtype=tl_dtype(dtype),
                            BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs)
    return out
