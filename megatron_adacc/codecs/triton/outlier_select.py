"""outlier_int4's channel selection in one kernel: the Triton twin of outlier.outlier_select.

Each program sums |x| in float64 over a chunk of the statistics rows (every k-th row,
outlier.statistics_rows) for a block of channels: column blocks x row chunks programs, enough to
fill a GPU even for a layer of 1,024 channels. The last program of a column block to finish (an
atomic count per block) adds its chunks' sums in chunk order; the last column block's finisher
(an atomic ticket) has every channel's sum. It takes the z-scores, the prefix count of outliers
and the first ``capacity`` of them (outlier.select_channels). The result, the selected mask and
the slot indices, stays on the device, with no other launch. Programs sum in another order than
torch: the float64 sums of 16-bit values are exact, and z-scores differ by an ulp at most. The
order is fixed by the shape, so a tensor's selection is the same in every call.
"""
import functools

import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import EMPTY_SLOT, INDEX_DTYPE
from megatron_adacc.codecs.outlier import statistics_step
from megatron_adacc.codecs.triton.launch import (COUNTER_SLOTS, FP_FUSION, INTERPRET, cdiv,
                                                 counters, needs_int64, next_power_of_2,
                                                 row_tile, warps_for)
from megatron_adacc.codecs.triton.numerics import load_float

# Channels a program sums: rows 128 bytes long.
STATISTICS_COLS = 64
# Programs a selection aims at: a few per SM of an H100 or H200 (132 SMs); few interpreted.
TARGET_PROGRAMS = 8 if INTERPRET else 512
# The fewest statistics rows a chunk sums.
MIN_CHUNK_ROWS = 16
# Channels the last program handles at once while it selects.
SELECT_BLOCK = 1024
_SELECT_BLOCK = tl.constexpr(SELECT_BLOCK)
_EMPTY = tl.constexpr(EMPTY_SLOT)
_COUNTERS = tl.constexpr(COUNTER_SLOTS)


@triton.jit
def _outlier_select(x_ptr, sums_ptr, counter_ptr, selected_ptr, index_ptr,
                    channels, stride, step, sample_rows, chunk_rows, chunks, capacity, threshold,
                    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    # Constants, and the dtype from the pointer: an argument more would cost the launcher host
    # time.
    IN_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    SELECT_BLOCK: tl.constexpr = _SELECT_BLOCK
    EMPTY: tl.constexpr = _EMPTY
    COUNTERS: tl.constexpr = _COUNTERS
    chunk, block = tl.program_id(0), tl.program_id(1)
    col = block * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    total = tl.zeros([BLOCK_COLS], dtype=tl.float64)
    end = tl.minimum(sample_rows, (chunk + 1) * chunk_rows)
    for first in range(chunk * chunk_rows, end, BLOCK_ROWS):
        sample = first + tl.arange(0, BLOCK_ROWS)
        if INT64:
            sample = sample.to(tl.int64)
        mask = (sample < end)[:, None] & (col < channels)[None, :]
        v = load_float(x_ptr + (sample * step * stride)[:, None] + col[None, :], mask, IN_BF16)
        total += tl.sum(tl.abs(v).to(tl.float64), axis=0)
    tl.store(sums_ptr + chunk * channels + col, total, mask=col < channels)
    # Every thread's sums are written before the count is taken (release): the program that
    # counts its column block's last chunk (acquire) reads them all, in chunk order.
    tl.debug_barrier()
    if tl.atomic_add(counter_ptr + COUNTERS + block, 1) == chunks - 1:
        tl.atomic_xchg(counter_ptr + COUNTERS + block, 0)   # zero for the next launch
        total = tl.zeros([BLOCK_COLS], dtype=tl.float64)
        for k in range(0, chunks):
            total += tl.load(sums_ptr + k * channels + col, mask=col < channels, other=0.0,
                             volatile=True)
        # The block's sums go over its first chunk's, once every thread has read those.
        tl.debug_barrier()
        tl.store(sums_ptr + col, total, mask=col < channels)
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr, 1)
        if ticket == tl.num_programs(1) - 1:
            tl.atomic_xchg(counter_ptr, 0)   # the last column block: zero for the next launch
            _select(sums_ptr, selected_ptr, index_ptr, channels, capacity, threshold,
                    SELECT_BLOCK, EMPTY)


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
    """(grid, scalar arguments after the stride, options) of a selection on [rows, channels].

    Row chunks divide the statistics rows until the programs reach TARGET_PROGRAMS."""
    step = statistics_step(rows)
    sample_rows = cdiv(rows, step)
    blocks = cdiv(channels, STATISTICS_COLS)
    wanted = next_power_of_2(cdiv(sample_rows * blocks, TARGET_PROGRAMS))
    tile = row_tile(min(sample_rows, max(wanted, MIN_CHUNK_ROWS)), STATISTICS_COLS,
                    STATISTICS_COLS)
    chunk_rows = cdiv(max(wanted, MIN_CHUNK_ROWS), tile.rows) * tile.rows
    chunks = cdiv(sample_rows, chunk_rows)
    return ((chunks, blocks), (step, sample_rows, chunk_rows, chunks),
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
    sums = torch.empty(grid[0] * channels, dtype=torch.float64, device=device)
    counter = counters(device, COUNTER_SLOTS + grid[1])
    selected = torch.empty(channels, dtype=torch.bool, device=device)
    index = torch.empty(capacity, dtype=INDEX_DTYPE, device=device)
    # .run is what kernel[grid](...) calls, less a lambda and a repacking of the arguments
    _outlier_select.run(
        x2d, sums, counter, selected, index, channels, stride, *args,
        capacity, threshold, grid=grid, warmup=False, **options)
    return selected, index
