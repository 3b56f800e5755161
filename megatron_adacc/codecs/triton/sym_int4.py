"""Symmetric int4, one scale per row of a [rows, cols] view (cols even): the Triton twin of
codecs/symmetric.py for reduce_dim=1 (flat groups and per-token scales)."""
import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import MIN_SCALE
from megatron_adacc.codecs.triton.launch import FP_FUSION, bits_view, row_blocks, tl_dtype
from megatron_adacc.codecs.triton.numerics import ceil_to_bf16, load_float, to_output


@triton.jit
def _sym_encode_rows(x_ptr, packed_ptr, scale_ptr, ok_ptr, rows, cols, dmax, min_scale,
                     IN_BF16: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    in_row = row < rows
    mask = in_row[:, None] & (pair[None, :] < cols // 2)
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    # Padding lanes read 0, which changes no group's scale (see symmetric.sym_scales).
    even = load_float(x_ptr + offset, mask, IN_BF16)
    odd = load_float(x_ptr + offset + 1, mask, IN_BF16)

    non_finite = (even != even) | (tl.abs(even) == float("inf")) | (odd != odd) | (tl.abs(odd) == float("inf"))
    finite_row = tl.sum(non_finite.to(tl.int32), axis=1) == 0
    lo = tl.min(tl.minimum(even, odd), axis=1)
    hi = tl.max(tl.maximum(even, odd), axis=1)
    negative_extreme = -lo >= hi
    extreme = tl.where(negative_extreme, -lo, hi)
    opposite = tl.where(negative_extreme, hi, -lo)
    magnitude = tl.maximum(ceil_to_bf16(tl.maximum(tl.div_rn(extreme, 8.0), tl.div_rn(opposite, 7.5))), min_scale)
    ok = finite_row & (magnitude * 8 <= dmax)
    scale = tl.where(ok, tl.where(negative_extreme, magnitude, -magnitude), 0.0)

    inverse = tl.div_rn(1.0, tl.where(ok, scale, 1.0))[:, None]
    code_even = tl.minimum(tl.maximum(tl.floor(even * inverse + 8.5), 0.0), 15.0)
    code_odd = tl.minimum(tl.maximum(tl.floor(odd * inverse + 8.5), 0.0), 15.0)
    code_even = tl.where(ok[:, None], code_even, 8.0).to(tl.uint8)
    code_odd = tl.where(ok[:, None], code_odd, 8.0).to(tl.uint8)
    tl.store(packed_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :], code_even | (code_odd << 4), mask=mask)
    tl.store(scale_ptr + row, scale.to(tl.bfloat16), mask=in_row)
    tl.store(ok_ptr + row, ok.to(tl.int8), mask=in_row)


@triton.jit
def _sym_decode_rows(packed_ptr, scale_ptr, out_ptr, rows, cols,
                     OUT_BF16: tl.constexpr, out_dtype: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    mask = (row < rows)[:, None] & (pair[None, :] < cols // 2)
    byte = tl.load(packed_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + row, mask=row < rows, other=0.0).to(tl.float32)[:, None]
    even = ((byte & 15).to(tl.float32) - 8) * scale
    odd = ((byte >> 4).to(tl.float32) - 8) * scale
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    tl.store(out_ptr + offset, to_output(even, OUT_BF16, out_dtype), mask=mask)
    tl.store(out_ptr + offset + 1, to_output(odd, OUT_BF16, out_dtype), mask=mask)


def sym_encode_rows(x2d: torch.Tensor, dmax: float):
    rows, cols = x2d.shape
    packed = torch.empty(rows * cols // 2, dtype=torch.uint8, device=x2d.device)
    scales = torch.empty(rows, dtype=torch.bfloat16, device=x2d.device)
    ok = torch.empty(rows, dtype=torch.int8, device=x2d.device)
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _sym_encode_rows[grid](bits_view(x2d), packed, scales, ok, rows, cols, dmax, MIN_SCALE,
                           IN_BF16=x2d.dtype == torch.bfloat16, BLOCK_ROWS=block_rows,
                           BLOCK_PAIRS=block_pairs, enable_fp_fusion=FP_FUSION)
    return packed, scales, ok.bool()


def sym_decode_rows(packed: torch.Tensor, scales: torch.Tensor, shape2d, dtype: torch.dtype) -> torch.Tensor:
    rows, cols = shape2d
    out = torch.empty(shape2d, dtype=dtype, device=packed.device)
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _sym_decode_rows[grid](packed, scales, bits_view(out), rows, cols,
                           OUT_BF16=dtype == torch.bfloat16, out_dtype=tl_dtype(dtype),
                           BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs)
    return out

