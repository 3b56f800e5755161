"""Launch geometry of the Triton codec kernels, from the shape, and the views the wrappers pass.

The geometry follows the Triton tutorials' softmax and layer-norm. Every wrapper asks one of the
functions here for its tile and num_warps, and nothing else sizes a launch. So
scripts/check_kernels.py compiles what the codecs really launch, by recording the launches
themselves. Under TRITON_INTERPRET=1 one fixed geometry of large tiles is used: the interpreter pays
milliseconds per program instance, and num_warps means nothing there.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton.language as tl
from triton.runtime.driver import driver

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Encoders compute x * (1 / scale) + bias with two roundings, as the reference does; a fused
# multiply-add would round once and change codes at ties (and the outlier z-scores' sum of
# squares, the reference's). Decodes need no flag: code * scale is exact in fp32.
FP_FUSION = False
# Elements a program instance moves on a GPU: 32 a thread at 4 warps, four 16-byte loads in flight
# per thread.
GPU_TILE = 4096
# The interpreter's tile: few programs.
INTERPRET_TILE = 1 << 16
# Widest column block of a 2-D tile whose columns are channels.
MAX_BLOCK_COLS = 1024
# Threads a warp holds; num_warps is tile / (ELEMENTS_PER_THREAD * WARP) within [4, 16]. The H200
# ran the int4 round trips at the rate of their instructions, not of memory: SASS instructions x
# warps / issue rate gave sym, asym, naive and outlier int4's measured times within 12%. A thread's
# group statistics, scale and addresses cost as much for 16 elements as for 32: at 32 the encodes
# issue 14-32% fewer instructions (no spills; at most 96 registers on sm_80 and sm_90, 124 on
# sm_70: scripts/check_kernels.py).
WARP = 32
ELEMENTS_PER_THREAD = 32
MAX_WARPS = 16
# The widest row one program takes whole (naive_int4's group): 64 values a thread at 16 warps
# (32768, Llama-3-70B's fc1 half; checked free of spills). Wider rows spill (at 32 warps a
# thread may hold only 64 registers): they go to the reference.
MAX_ROW = 64 * MAX_WARPS * WARP
INT32_LIMIT = 2**31


@dataclass(frozen=True)
class Tile:
    """A 2-D tile: rows x cols elements a program, over a grid of row blocks x column blocks."""

    rows: int
    cols: int
    grid: tuple[int, int]
    num_warps: int


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 in plain Python.

    Triton 3.6's is a constexpr function whose host call costs microseconds, paid on every codec
    call."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def cdiv(a: int, b: int) -> int:
    """triton.cdiv in plain Python (see next_power_of_2)."""
    return -(-a // b)


def _tile_elements() -> int:
    return INTERPRET_TILE if INTERPRET else GPU_TILE


def warps_for(elements: int) -> int:
    """num_warps for a program moving ``elements`` values: with the tile, within [4, 16].

    That is the layer-norm tutorial's rule."""
    return min(max(elements // (ELEMENTS_PER_THREAD * WARP), 4), MAX_WARPS)


# Tiles depend on the shape alone, and a training step asks for the same few thousands of
# times: cached, they cost a dictionary lookup on the codecs' host path.
@functools.lru_cache(maxsize=4096)
def row_tile(rows: int, width: int, group: int, scale: int = 1, warps: int | None = None) -> Tile:
    """The tile of a kernel reducing groups of ``group`` elements of rows ``width`` wide.

    ``group`` divides ``width``, or is ``width``'s power-of-two ceiling (a whole row a group).
    - Columns: the row, cut into blocks of whole groups at most MAX_BLOCK_COLS wide, unless a group
      is wider.
    - Rows: as many as fill ``scale`` GPU tiles.
    ``warps`` fixes num_warps (on a GPU) instead of the tile's rule."""
    cols = next_power_of_2(width)
    if group < cols:
        cols = max(group, min(cols, MAX_BLOCK_COLS))
    elements = _tile_elements() * (1 if INTERPRET else scale)
    block_rows = max(1, min(elements // cols, next_power_of_2(rows)))
    grid = (cdiv(rows, block_rows), cdiv(width, cols))
    return Tile(block_rows, cols, grid,
                warps if warps is not None else warps_for(block_rows * cols))


@functools.lru_cache(maxsize=4096)
def flat_tile(numel: int, granule: int = 1) -> Tile:
    """A 1-D tile over ``numel`` elements in whole granules: rows of granules, one column block.

    A granule is, e.g., a byte's 8 mask flags."""
    granules = cdiv(numel, granule)
    rows = max(1, min(_tile_elements() // granule, next_power_of_2(granules)))
    return Tile(rows, granule, (cdiv(granules, rows), 1), warps_for(rows * granule))


# Ticket counters per (device, stream): zero between launches. A kernel that draws tickets has its
# last program put them back to zero, so no launch needs a fill kernel first. A stream runs its
# launches in order, so two launches never share a stream's counters at once.
COUNTER_SLOTS = 3
_counters: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, slots: int = COUNTER_SLOTS) -> torch.Tensor:
    """At least ``slots`` zero int32 on ``device`` for the current stream: ticket counters first.

    They are made once per device and stream, and again only to grow; the kernels leave them zero.
    A kernel may use the slots after the counters for values it folds by atomics."""
    stream = _current_stream(device) if device.type == "cuda" else None
    found = _counters.get((device, stream))
    if found is None or found.numel() < slots:
        found = torch.zeros(max(slots, COUNTER_SLOTS), dtype=torch.int32, device=device)
        # Kept unless a stand-in: FakeTensorMode's has no data, and a CUDA graph's capture
        # records the zeroing without running it (the graph zeroes its own at each replay).
        capturing = stream is not None and torch.cuda.is_current_stream_capturing()
        if type(found) is torch.Tensor and not capturing:
            _counters[(device, stream)] = found
    return found


def _current_stream(device: torch.device) -> int:
    """The raw handle of ``device``'s current stream, as Triton's launcher reads it.

    Its driver's call (torch's raw-stream getter) makes no Python Stream object, unlike
    torch.cuda.current_stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return driver.active.get_current_stream(index)


def needs_int64(*extents: int) -> bool:
    """Whether an element offset (the largest of ``extents``) can reach 2**31.

    The kernels then index in int64 (a constexpr), else in int32."""
    return max(extents, default=0) >= INT32_LIMIT


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def tl_dtype(dtype: torch.dtype):
    """Triton element type a kernel writes for `dtype`."""
    return _TL_DTYPES[dtype]
