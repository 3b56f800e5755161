"""outlier_int4's channel selection in one kernel: the Triton twin of outlier.outlier_select.

Each program sums |x| in float64 over the statistics rows (every k-th row, outlier.statistics_rows)
for a block of channels. The last program to finish (an atomic ticket) has every sum. It takes the
z-scores, the prefix count of outliers and the first ``capacity`` of them (outlier.select_channels).
The result, the selected mask and the slot indices, stays on the device, with no other launch.
Programs sum in another order than torch: the float64 sums of 16-bit values are exact, and z-scores
differ by an ulp at most.
"""
import functools

import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import EMPTY_SLOT, INDEX_DTYPE
from megatron_adacc.codecs.outlier import statistics_step
from megatron_adacc.codecs.triton.launch import (FP_FUSION, cdiv, counters, needs_int64,
                                                 row_tile, warps_for)
from megatron_adacc.codecs.triton.numerics import load_float

# Channels a program sums: a few hundred programs for a wide layer, rows 128 bytes long.
STATISTICS_COLS = 64
# Channels the last program handles at once while it selects.
SELECT_BLOCK = 1024
_SELECT_BLOCK = tl.constexpr(SELECT_BLOCK)
_EMPTY = tl.constexpr(EMPTY_SLOT)


@triton.jit
def _outlier_select(x_ptr, sums_ptr, ticket_ptr, selected_ptr, index_ptr,
                    channels, stride, step, sample_rows, capacity, threshold,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    # Constants, and the dtype from the pointer: an argument more would cost the launcher host
    # time.
    IN_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    SELECT_BLOCK: tl.constexpr = _SELECT_BLOCK
    EMPTY: tl.constexpr = _EMPTY
    col = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    total = tl.zeros([BLOCK_COLS], dtype=tl.float64)
    for first in range(0, sample_rows, BLOCK_ROWS):
        sample = first + tl.arange(0, BLOCK_ROWS)
        if INT64:
            sample = sample.to(tl.int64)
        mask = (sample < sample_rows)[:, None] & (col < channels)[None, :]
        v = load_float(x_ptr + (sample * step * stride)[:, None] + col[None, :], mask, IN_BF16)
        total += tl.sum(tl.abs(v).to(tl.float64), axis=0)
    tl.store(sums_ptr + col, total, mask=col < channels)
    # Every thread's sums are written before the ticket is taken (release): the program that
    # draws the last ticket (acquire) reads them all.
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1)
    if ticket == tl.num_programs(0) - 1:
        tl.atomic_xchg(ticket_ptr, 0)   # the last program: zero for the next launch
        _select(sums_ptr, selected_ptr, index_ptr, channels, capacity, threshold, SELECT_BLOCK,
                EMPTY)


@triton.jit
def _select(sums_ptr, selected_ptr, index_ptr, channels, capacity, threshold,
            SELECT_BLOCK: tl.constexpr, EMPTY: tl.constexpr):
    """outlier.z_score_outliers, then outlier.select_channels, by one program."""
    count = tl.zeros([SELECT_BLOCK], dtype=tl.int32)
    total = tl.zeros([SELECT_BLOCK], dtype=tl.float64)
    for first in range(0, channels, SELECT_BLOCK):
        c = first + tl.arange(0, SELECT_BLOCK)
        s = tl.load(sums_ptr + c, mask=c < channels, other=0.0, volatile=True)
        finite = (c < channels) & (s * 0.0 == 0.0)
        count += finite.to(tl.int32)
        total += tl.where(finite, s, 0.0)
    n = tl.sum(count, axis=0)
    mean = tl.sum(total, axis=0) / n.to(tl.float64)
    square = tl.zeros([SELECT_BLOCK], dtype=tl.float64)
    for first in range(0, channels, SELECT_BLOCK):
        c = first + tl.arange(0, SELECT_BLOCK)
        s = tl.load(sums_ptr + c, mask=c < channels, other=0.0, volatile=True)
        deviation = tl.where((c < channels) & (s * 0.0 == 0.0), s - mean, 0.0)
        square += deviation * deviation
    std = tl.sqrt(tl.sum(square, axis=0) / n.to(tl.float64))  # float64: sqrt.rn
    taken = 0
    for first in range(0, channels, SELECT_BLOCK):
        c = first + tl.arange(0, SELECT_BLOCK)
        s = tl.load(sums_ptr + c, mask=c < channels, other=0.0, volatile=True)
        # n broadcast first: the interpreter mistypes a scalar bool & a bool block
        outlier = (s * 0.0 != 0.0) | ((tl.zeros_like(c) + n >= 2) & ((s - mean) / std > threshold))
        outlier = outlier & (c < channels)
        rank = taken + tl.cumsum(outlier.to(tl.int32), axis=0)
        selected = outlier & (rank <= capacity)
        tl.store(selected_ptr + c, selected, mask=c < channels)
        tl.store(index_ptr + rank - 1, c, mask=selected)
        taken += tl.sum(outlier.to(tl.int32), axis=0)
    for first in range(0, capacity, SELECT_BLOCK):
        slot = first + tl.arange(0, SELECT_BLOCK)
        tl.store(index_ptr + slot, tl.full([SELECT_BLOCK], EMPTY, tl.int32),
                 mask=(slot >= taken) & (slot < capacity))


@functools.lru_cache(maxsize=4096)
def _geometry(rows: int, channels: int, stride: int) -> tuple:
    """(grid, scalar arguments after the stride, options) of a selection on [rows, channels]."""
    step = statistics_step(rows)
    sample_rows = cdiv(rows, step)
    tile = row_tile(sample_rows, STATISTICS_COLS, STATISTICS_COLS)
    return ((cdiv(channels, STATISTICS_COLS),), (step, sample_rows),
            dict(BLOCK_ROWS=tile.rows, BLOCK_COLS=STATISTICS_COLS, INT64=needs_int64(rows * stride),
                 num_warps=warps_for(tile.rows * tile.cols), enable_fp_fusion=FP_FUSION))


def outlier_select(x2d: torch.Tensor, threshold: float, capacity: int):
    """(selected channels' bool mask, their int32 indices [capacity]), as outlier.outlier_select.

    Unused index slots hold EMPTY_SLOT. x2d is [rows, channels], rows a stride apart, channels
    dense."""
    rows, channels = x2d.shape
    stride = x2d.stride(0)
    grid, args, options = _geometry(rows, channels, stride)
    device = x2d.device
    sums = torch.empty(channels, dtype=torch.float64, device=device)
    ticket = counters(device)
    selected = torch.empty(channels, dtype=torch.bool, device=device)
    index = torch.empty(capacity, dtype=INDEX_DTYPE, device=device)
    # .run is what kernel[grid](...) calls, less a lambda and a repacking of the arguments
    _outlier_select.run(
        x2d, sums, ticket, selected, index, channels, stride, *args, capacity, threshold,
        grid=grid, warmup=False, **options)
    return selected, index
