"""Symmetric int4 with one scale per channel (column) of [rows, channels], in Triton.

It is the Triton twin of codecs/symmetric.py for reduce_dim=0 (channel_int4): one encode kernel, one
decode kernel.

A channel's scale needs every row before any of its codes. So the encode launches programs of two
kinds, told apart by a ticket each draws as it starts (not its program id):
- The first ``stat_programs`` tickets take the column extremes of a chunk of rows and fold them into
  per-channel maxima by atomics. The last of them to finish turns those into scales.
- Every later ticket codes a tile once the scales are out.
A coder only waits on programs that drew earlier tickets, which are running already. So the wait
cannot deadlock however many programs the GPU holds (the forward-progress argument of decoupled
look-back scans). The interpreter runs programs one by one in order and never waits. The input is
read twice (statistics, then codes), with no other launch: the ticket counters and the maxima are
left zero for the next one (launch.counters).

It runs at 4 warps (WARPS), the fastest geometry measured exact. On the H200 its payload differed
from the reference at 8 and 16 warps (scripts/bench_codec_geometry.py): the last statistics
program zeroed the folded extremes in another thread layout than it read them in, so one warp
could zero a value before another read it. A barrier now orders them (_channel_scales); the wider
geometries are to be timed again before the pin goes.
"""
import functools

import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.triton.launch import (COUNTER_SLOTS, FP_FUSION, INTERPRET, MAX_WARPS,
                                                 cdiv, counters, needs_int64, row_tile)
from megatron_adacc.codecs.triton.numerics import (bf16_bits_to_float, code_value, extremes,
                                                   load_float, nan_maximum, nan_minimum, non_finite,
                                                   saturate_to, scale_bits, sym_codes, sym_scale,
                                                   to_output)

# On the H200 the round trip ran at 0.15, 0.23 and 0.30 of a copy at tiles of 2,048, 4,096 and
# 8,192 elements with 4 warps (scripts/bench_codec_geometry.py); 8 and 16 warps were not timed
# (see the module's docstring).
TILES, WARPS = 2, 4
# Row chunks the statistics are split into: enough programs to fill a GPU; few interpreted.
STAT_CHUNKS = 4 if INTERPRET else 256
# Per channel, after the ticket counters: max(hi, 0), max(-lo, 0) as fp32 bits, and a non-finite
# flag. Zero is the maxima's identity, so the counters' buffer holds them (symmetric.sym_scales
# gives the same scale for min(lo, 0) and max(hi, 0) as for lo and hi).
STAT_SLOTS = 3
_COUNTERS = tl.constexpr(COUNTER_SLOTS)


@triton.jit
def _channel_encode(x_ptr, counter_ptr, scale32_ptr, packed_ptr, scale_ptr,
                    rows, channels, col_blocks, chunks, chunk_rows,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    # Constants, and the dtype from the pointer: an argument more would cost the launcher host
    # time. The minimum scale is int4.MIN_SCALE (2 ** -126, fp32's least normal).
    IN_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    COUNTERS: tl.constexpr = _COUNTERS
    min_scale: tl.constexpr = 1.1754943508222875e-38
    ticket = tl.atomic_add(counter_ptr, 1)
    stat_programs = chunks * col_blocks
    stats_ptr = counter_ptr + COUNTERS
    if ticket < stat_programs:
        chunk = ticket // col_blocks
        col = (ticket % col_blocks) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        lo = tl.full([BLOCK_COLS], float("inf"), tl.float32)
        hi = tl.full([BLOCK_COLS], -float("inf"), tl.float32)
        end = tl.minimum(rows, (chunk + 1) * chunk_rows)
        for first in range(chunk * chunk_rows, end, BLOCK_ROWS):
            row = first + tl.arange(0, BLOCK_ROWS)
            if INT64:
                row = row.to(tl.int64)
            mask = (row < rows)[:, None] & (col < channels)[None, :]
            x = load_float(x_ptr + row[:, None] * channels + col[None, :], mask, IN_BF16)
            block_lo, block_hi = extremes(x, 0)  # padding reads 0, which moves no channel's scale
            lo, hi = nan_minimum(lo, block_lo), nan_maximum(hi, block_hi)
        bad = non_finite(lo) | non_finite(hi)
        # Non-negative fp32 bits order as int32 do; a -0 (negative bits) leaves the maximum +0.
        ok = col < channels
        tl.atomic_max(stats_ptr + col, tl.maximum(hi, 0.0).to(tl.int32, bitcast=True), mask=ok,
                      sem="relaxed")
        tl.atomic_max(stats_ptr + channels + col, tl.maximum(-lo, 0.0).to(tl.int32, bitcast=True),
                      mask=ok, sem="relaxed")
        tl.atomic_max(stats_ptr + 2 * channels + col, bad, mask=ok, sem="relaxed")
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr + 1, 1) == stat_programs - 1:
            _channel_scales(stats_ptr, scale32_ptr, scale_ptr, channels, min_scale, BLOCK_COLS)
            tl.debug_barrier()
            tl.atomic_add(counter_ptr + 1, 1)  # the scales are out
    else:
        tile = ticket - stat_programs
        row = (tile // col_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        if INT64:
            row = row.to(tl.int64)
        col = (tile % col_blocks) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
        mask = (row < rows)[:, None] & (col < channels)[None, :]
        x = load_float(x_ptr + row[:, None] * channels + col[None, :], mask, IN_BF16)
        # Spin on plain reads (an atomic would queue behind every other spinner's), then one
        # acquiring atomic orders the scales' stores before the reads below.
        while tl.load(counter_ptr + 1, volatile=True) <= stat_programs:
            pass
        tl.atomic_add(counter_ptr + 1, 0)
        scale = tl.load(scale32_ptr + col, mask=col < channels, other=1.0, volatile=True)
        inverse = tl.div_rn(1.0, tl.where(scale != scale, 1.0, scale))
        inverse = tl.where(scale != scale, float("nan"), inverse)  # NaN marks a bad channel
        code = sym_codes(x, inverse[None, :], (inverse != inverse)[None, :])
        code_even, code_odd = tl.split(tl.reshape(code, [BLOCK_ROWS, BLOCK_COLS // 2, 2]))
        pair_col = (tile % col_blocks) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
        pair_mask = (row < rows)[:, None] & (pair_col < channels // 2)[None, :]
        tl.store(packed_ptr + row[:, None] * (channels // 2) + pair_col[None, :],
                 (code_even | (code_odd << 4)).to(tl.uint8), mask=pair_mask)
    # Each program counts itself out once its threads are done with the counters; the last puts
    # them back to zero for the next launch (launch.counters).
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + 2, 1) == tl.num_programs(0) - 1:
        tl.atomic_xchg(counter_ptr, 0)
        tl.atomic_xchg(counter_ptr + 1, 0)
        tl.atomic_xchg(counter_ptr + 2, 0)


@triton.jit
def _channel_scales(stats_ptr, scale32_ptr, scale_ptr, channels, min_scale,
                    BLOCK_COLS: tl.constexpr):
    """Every channel's scale (symmetric.sym_scales) from the folded extremes, which it zeroes."""
    for first_col in range(0, channels, BLOCK_COLS):
        col = first_col + tl.arange(0, BLOCK_COLS)
        ok = col < channels
        hi = tl.load(stats_ptr + col, mask=ok, other=0, volatile=True)
        lo = tl.load(stats_ptr + channels + col, mask=ok, other=0, volatile=True)
        bad = tl.load(stats_ptr + 2 * channels + col, mask=ok, other=0, volatile=True)
        scale = sym_scale(-lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True),
                          min_scale)
        tl.store(scale_ptr + col, scale_bits(scale, bad > 0), mask=ok)
        tl.store(scale32_ptr + col, tl.where(bad > 0, float("nan"), scale), mask=ok)
        # Triton lays the zeroing stores out as the atomics that fold the extremes, not as the
        # loads above: another warp's thread zeroes a value this one may not have read yet.
        tl.debug_barrier()
        zero = tl.zeros([BLOCK_COLS], tl.int32)
        tl.store(stats_ptr + col, zero, mask=ok)
        tl.store(stats_ptr + channels + col, zero, mask=ok)
        tl.store(stats_ptr + 2 * channels + col, zero, mask=ok)


@triton.jit
def _channel_decode(packed_ptr, scale_ptr, out_ptr, rows, channels,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    # The dtype comes from the pointer: an argument more would cost the launcher host time.
    OUT_BF16: tl.constexpr = out_ptr.dtype.element_ty == tl.bfloat16
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    if INT64:
        row = row.to(tl.int64)
    pair_col = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
    pair_mask = (row < rows)[:, None] & (pair_col < channels // 2)[None, :]
    byte = tl.load(packed_ptr + row[:, None] * (channels // 2) + pair_col[None, :], mask=pair_mask,
                   other=0)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    scale = bf16_bits_to_float(tl.load(scale_ptr + col, mask=col < channels, other=0))
    scale_even, scale_odd = tl.split(tl.reshape(scale, [BLOCK_COLS // 2, 2]))
    even = saturate_to(code_value(byte & 15, 8) * scale_even[None, :], out_ptr.dtype.element_ty)
    odd = saturate_to(code_value(byte >> 4, 8) * scale_odd[None, :], out_ptr.dtype.element_ty)
    value = to_output(tl.interleave(even, odd), OUT_BF16, out_ptr.dtype.element_ty)
    mask = (row < rows)[:, None] & (col < channels)[None, :]
    tl.store(out_ptr + row[:, None] * channels + col[None, :], value, mask=mask)


@functools.lru_cache(maxsize=4096)
def _geometry(rows: int, channels: int, fp32: bool = False) -> tuple:
    """(encode grid, its scalar arguments, decode grid, options) on [rows, channels], made once.

    ``fp32``: the decode writes fp32, whose values take twice a 16-bit one's registers: its
    programs get twice the warps (at 4, a Llama-3-8B Q/K/V tile spilled)."""
    # columns: channels, in blocks. Two GPU tiles at 4 warps (see the module's docstring).
    tile = row_tile(rows, channels, 2, scale=TILES, warps=WARPS)
    col_blocks = tile.grid[1]
    chunks = min(tile.grid[0], STAT_CHUNKS)
    chunk_rows = cdiv(cdiv(rows, chunks), tile.rows) * tile.rows
    chunks = cdiv(rows, chunk_rows)
    options = dict(BLOCK_ROWS=tile.rows, BLOCK_COLS=tile.cols,
                   INT64=needs_int64(rows * channels),
                   num_warps=min(tile.num_warps * (2 if fp32 else 1), MAX_WARPS))
    return (((chunks + tile.grid[0]) * col_blocks,), (col_blocks, chunks, chunk_rows), tile.grid,
            options)


def channel_encode(x2d: torch.Tensor):
    """-> (packed codes, bf16 scales [channels]) of a contiguous [rows, channels], channels even.

    It matches symmetric.sym_encode(x2d, 0)."""
    rows, channels = x2d.shape
    grid, args, _, options = _geometry(rows, channels)
    device = x2d.device
    counter = counters(device, COUNTER_SLOTS + STAT_SLOTS * channels)
    scale32 = torch.empty(channels, dtype=torch.float32, device=device)
    packed = torch.empty(rows * channels // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(channels, dtype=torch.bfloat16, device=device)
    # .run is what kernel[grid](...) calls, less a lambda and a repacking of the arguments
    _channel_encode.run(
        x2d, counter, scale32, packed, scales, rows, channels, *args, grid=grid, warmup=False,
        enable_fp_fusion=FP_FUSION, **options)
    return packed, scales


def channel_decode(packed: torch.Tensor, scales: torch.Tensor, shape2d,
                   dtype: torch.dtype) -> torch.Tensor:
    """The decoded [rows, channels] of ``dtype`` (symmetric.sym_decode with reduce_dim=0)."""
    rows, channels = shape2d
    _, _, grid, options = _geometry(rows, channels, dtype == torch.float32)
    out = torch.empty(rows, channels, dtype=dtype, device=packed.device)
    _channel_decode.run(packed, scales, out, rows, channels, grid=grid, warmup=False,
                        **options)
    return out
