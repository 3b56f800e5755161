"""Symmetric int4, one scale per row of a [rows, cols] view (cols even): the Triton twin of
codecs/symmetric.py for reduce_dim=1 (flat groups and per-token scales), and the outlier
codec's channel statistics and exact channels around it. The encode reads its groups where
they lie, in rows a stride apart too (int4.row_layout)."""
import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import MIN_SCALE
from megatron_adacc.codecs.triton.launch import BLOCK_ELEMENTS, FP_FUSION, bits_view, row_blocks, tl_dtype
from megatron_adacc.codecs.triton.numerics import ceil_to_bf16, load_float, to_output


@triton.jit
def _channel_abs_sums(x_ptr, sums_ptr, rows, cols, stride, IN_BF16: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      BLOCK_COLS: tl.constexpr):
    col = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    total = tl.zeros([BLOCK_COLS], dtype=tl.float64)
    for r0 in range(0, rows, BLOCK_ROWS):
        row = r0 + tl.arange(0, BLOCK_ROWS)
        mask = (row < rows)[:, None] & (col < cols)[None, :]
        v = load_float(x_ptr + row[:, None].to(tl.int64) * stride + col[None, :], mask, IN_BF16)
        total += tl.sum(tl.abs(v).to(tl.float64), axis=0)
    tl.store(sums_ptr + col, total, mask=col < cols)


@triton.jit
def _kept(v, element, zeroed_ptr, channels, ZEROED: tl.constexpr):
    """v, or +0 where the element's channel is zeroed (int4.zero_channels), read from the
    channel mask as the element is loaded: no zeroed copy of the tensor."""
    if ZEROED:
        zeroed = tl.load(zeroed_ptr + element % channels) != 0
        return tl.where(zeroed, 0.0, v)
    else:
        return v


@triton.jit
def _address(element, channels, stride, STRIDED: tl.constexpr):
    """Where element `element` of the input seen as rows of `channels` values lies, the rows
    `stride` apart (int4.row_layout)."""
    if STRIDED:
        return element // channels * stride + element % channels
    else:
        return element


@triton.jit
def _sym_encode_rows(x_ptr, zeroed_ptr, packed_ptr, scale_ptr, ok_ptr, rows, cols, channels, stride, dmax,
                     min_scale, IN_BF16: tl.constexpr, ZEROED: tl.constexpr, STRIDED: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    in_row = row < rows
    mask = in_row[:, None] & (pair[None, :] < cols // 2)
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    at = x_ptr + _address(offset, channels, stride, STRIDED)  # a pair never spans two rows
    # Padding lanes read 0, which changes no group's scale (see symmetric.sym_scales).
    even = _kept(load_float(at, mask, IN_BF16), offset, zeroed_ptr, channels, ZEROED)
    odd = _kept(load_float(at + 1, mask, IN_BF16), offset + 1, zeroed_ptr, channels, ZEROED)

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
def _exact_or(decoded, element, slot_ptr, values_ptr, channels, n_exact, numel, EXACT: tl.constexpr):
    """decoded, or the exact value where the element's channel is an exact one (slot >= 0: its
    column in values, rows of n_exact), written in the decoding pass."""
    if EXACT:
        in_tensor = element < numel
        slot = tl.load(slot_ptr + element % channels, mask=in_tensor, other=-1)
        exact = slot >= 0
        value = tl.load(values_ptr + (element // channels) * n_exact + slot, mask=exact, other=0)
        return tl.where(exact, value, decoded)
    else:
        return decoded


@triton.jit
def _sym_decode_rows(packed_ptr, scale_ptr, slot_ptr, values_ptr, out_ptr, rows, cols, channels, n_exact, numel,
                     OUT_BF16: tl.constexpr, out_dtype: tl.constexpr, EXACT: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_PAIRS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    pair = tl.arange(0, BLOCK_PAIRS)
    mask = (row < rows)[:, None] & (pair[None, :] < cols // 2)
    byte = tl.load(packed_ptr + row[:, None].to(tl.int64) * (cols // 2) + pair[None, :], mask=mask, other=0)
    scale = tl.load(scale_ptr + row, mask=row < rows, other=0.0).to(tl.float32)[:, None]
    even = to_output(((byte & 15).to(tl.float32) - 8) * scale, OUT_BF16, out_dtype)
    odd = to_output(((byte >> 4).to(tl.float32) - 8) * scale, OUT_BF16, out_dtype)
    offset = row[:, None].to(tl.int64) * cols + 2 * pair[None, :]
    even = _exact_or(even, offset, slot_ptr, values_ptr, channels, n_exact, numel, EXACT)
    odd = _exact_or(odd, offset + 1, slot_ptr, values_ptr, channels, n_exact, numel, EXACT)
    tl.store(out_ptr + offset, even, mask=mask)
    tl.store(out_ptr + offset + 1, odd, mask=mask)


def channel_abs_sums(x2d: torch.Tensor) -> torch.Tensor:
    """outlier.channel_abs_sums in one read of x2d (its rows dense, a stride apart): columns in
    blocks, each program walks down the rows adding in float64 (no |x| temporary)."""
    rows, cols = x2d.shape
    sums = torch.empty(cols, dtype=torch.float64, device=x2d.device)
    block_cols = min(triton.next_power_of_2(max(cols, 1)), 256)
    block_rows = max(1, BLOCK_ELEMENTS // block_cols)
    _channel_abs_sums[(triton.cdiv(cols, block_cols),)](bits_view(x2d), sums, rows, cols, x2d.stride(0),
                                                        IN_BF16=x2d.dtype == torch.bfloat16,
                                                        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols)
    return sums


def sym_encode_rows(x: torch.Tensor, layout, dmax: float, zeroed=None):
    """The groups of ``x`` as int4.row_layout gives them (``layout``); `zeroed`: (channels,
    bool mask), channels encoded as zeros (int4.zero_channels)."""
    rows, cols, channels, stride = layout
    packed = torch.empty(rows * cols // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(rows, dtype=torch.bfloat16, device=x.device)
    ok = torch.empty(rows, dtype=torch.int8, device=x.device)
    mask = zeroed[1] if zeroed is not None else ok  # not read without ZEROED
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _sym_encode_rows[grid](bits_view(x), mask.view(torch.int8), packed, scales, ok, rows, cols, channels, stride,
                           dmax, MIN_SCALE, IN_BF16=x.dtype == torch.bfloat16, ZEROED=zeroed is not None,
                           STRIDED=stride != channels, BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs,
                           enable_fp_fusion=FP_FUSION)
    return packed, scales, ok.bool()


def sym_decode_rows(packed: torch.Tensor, scales: torch.Tensor, shape2d, dtype: torch.dtype, exact=None) -> torch.Tensor:
    """`exact`: (channels, index, values), the outlier codec's exact channels (outlier.put_columns)."""
    rows, cols = shape2d
    out = torch.empty(shape2d, dtype=dtype, device=packed.device)
    if exact is not None:
        channels, index, values = exact
        slot = torch.full((channels,), -1, dtype=torch.int32, device=packed.device)
        slot.index_copy_(0, index, torch.arange(index.numel(), dtype=torch.int32, device=packed.device))
        n_exact, numel, values = index.numel(), values.shape[0] * channels, bits_view(values.contiguous())
    else:
        channels, slot, n_exact, numel, values = 1, scales, 0, 0, out  # not read without EXACT
    grid, block_rows, block_pairs = row_blocks(rows, cols)
    _sym_decode_rows[grid](packed, scales, slot, values, bits_view(out), rows, cols, channels, n_exact, numel,
                           OUT_BF16=dtype == torch.bfloat16, out_dtype=tl_dtype(dtype), EXACT=exact is not None,
                           BLOCK_ROWS=block_rows, BLOCK_PAIRS=block_pairs)
    return out
