"""Symmetric int4 with one scale per group of consecutive elements of a row, in Triton.

It is the Triton twin of codecs/symmetric.py for sym_int4's flat groups, naive_int4's whole rows and
outlier_int4's inliers. For the outlier codec it takes the exact channels in the encoding pass and
writes them back in the decoding pass. One encode kernel, one decode kernel.

The input is seen as [rows, width] rows ``stride`` apart (a view's rows read where they lie). A tile
is [BLOCK_ROWS, BLOCK_COLS] of whole groups, loaded as unit-stride vectors. It is reshaped to [rows,
groups, group] for the group statistics and coded there; the codes are split into even and odd for
the nibble pairs.
Exact channels that are not columns of the tile take a slower index path (CHANNEL_MOD: flat groups
of a tensor whose channels are no multiple of the group). No model site's shape reaches it.
"""
import functools
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.triton.launch import (FP_FUSION, Tile, needs_int64,
                                                 next_power_of_2, row_tile)
from megatron_adacc.codecs.triton.numerics import (bf16_bits_to_float, code_value, extremes,
                                                   non_finite, saturate_to, scale_bits, sym_codes,
                                                   sym_scale, to_output, widen)


# Exact channels a program copies at once: a 4-row tile's copy is then one element a thread at 4
# warps, and a column block of 1024 channels at outlier_int4's default capacity (one in 64, 16
# there when spread evenly) takes one pass, not two. No spills (scripts/check_kernels.py).
EXACT_SLOTS = 32


@triton.jit
def _sym_encode_tiles(x_ptr, selected_ptr, index_ptr, packed_ptr, scale_ptr, values_ptr,
                rows, width, stride, row_groups, channels, capacity, tensor_rows, min_scale,
                IN_BF16: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr, OUTLIER: tl.constexpr, CAPACITY_BLOCK: tl.constexpr,
                EXACT_SLOTS: tl.constexpr, EXACT_ROWS: tl.constexpr, CHANNEL_MOD: tl.constexpr,
                INT64: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    if INT64:
        row = row.to(tl.int64)
    mask = (row < rows)[:, None] & (col < width)[None, :]
    # Padding lanes read 0, which changes no group's scale (see symmetric.sym_scales).
    raw = tl.load(x_ptr + row[:, None] * stride + col[None, :], mask=mask, other=0)
    x = widen(raw, IN_BF16)
    if OUTLIER:
        slot = tl.arange(0, CAPACITY_BLOCK)
        slots = tl.load(index_ptr + slot, mask=slot < capacity, other=-1)
        # The selected channels go exact into their slot's column and are zeroed for the
        # int4 pass.
        if CHANNEL_MOD:
            element = row[:, None] * width + col[None, :]
            slot_of = _slot_of(element % channels, index_ptr, capacity, CAPACITY_BLOCK)
            tensor_row = element // channels
            tl.store(values_ptr + tensor_row * capacity + slot_of, raw,
                     mask=mask & (slot_of >= 0))
            x = tl.where(slot_of >= 0, 0.0, x)
        else:  # a tile's columns are channels: the selection's mask, one load a column
            chosen = tl.load(selected_ptr + col, mask=col < width, other=0) != 0
            x = tl.where(chosen[None, :], 0.0, x)
            _copy_exact_run(x_ptr, stride, values_ptr, index_ptr, slots, row, rows, capacity,
                            tl.program_id(1) * BLOCK_COLS, BLOCK_COLS, EXACT_SLOTS,
                            TO_VALUES=True)
        # Empty slots' columns hold +0: each tensor row's by the program holding its start.
        if CHANNEL_MOD:
            first = tl.min(row, axis=0) * width  # the program's first element, offsets' type
            starts = (first + channels - 1) // channels + tl.arange(0, EXACT_ROWS)
            owned = (starts * channels < first + BLOCK_ROWS * width) & (starts < tensor_rows)
        else:
            starts = row
            owned = (row < rows) & (row * 0 + tl.program_id(1) == 0)  # a block: see outlier_select
        tl.store(values_ptr + starts[:, None] * capacity + slot[None, :],
                 tl.zeros([EXACT_ROWS, CAPACITY_BLOCK], raw.dtype),
                 mask=owned[:, None] & ((slots < 0) & (slot < capacity))[None, :])

    GROUPS: tl.constexpr = BLOCK_COLS // GROUP
    grouped = tl.reshape(x, [BLOCK_ROWS, GROUPS, GROUP])
    lo, hi = extremes(grouped, 2)
    bad = (non_finite(lo) | non_finite(hi)) > 0
    scale = sym_scale(lo, hi, min_scale)
    inverse = tl.div_rn(1.0, tl.where(bad, 1.0, scale))[:, :, None]

    # Codes in the statistics' layout, then paired: splitting x itself made ptxas code each
    # element twice.
    code = sym_codes(grouped, inverse, bad[:, :, None])
    code_even, code_odd = tl.split(tl.reshape(code, [BLOCK_ROWS, BLOCK_COLS // 2, 2]))
    byte = (code_even | (code_odd << 4)).to(tl.uint8)
    pair_col = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
    pair = row[:, None] * (width // 2) + pair_col[None, :]
    pair_mask = (row < rows)[:, None] & (pair_col < width // 2)[None, :]
    tl.store(packed_ptr + pair, byte, mask=pair_mask)
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    tl.store(scale_ptr + row[:, None] * row_groups + group[None, :], scale_bits(scale, bad),
             mask=(row < rows)[:, None] & (group < row_groups)[None, :])


@triton.jit
def _sym_decode_tiles(packed_ptr, scale_ptr, index_ptr, values_ptr, out_ptr,
                rows, width, row_groups, numel, channels, capacity, tensor_rows,
                OUT_BF16: tl.constexpr, out_dtype: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROW_SCALE: tl.constexpr,
                EXACT: tl.constexpr, CAPACITY_BLOCK: tl.constexpr, EXACT_SLOTS: tl.constexpr,
                EXACT_ROWS: tl.constexpr, CHANNEL_MOD: tl.constexpr, INT64: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    if INT64:
        row = row.to(tl.int64)
    pair_col = tl.program_id(1) * (BLOCK_COLS // 2) + tl.arange(0, BLOCK_COLS // 2)
    pair = row[:, None] * (width // 2) + pair_col[None, :]
    pair_mask = (row < rows)[:, None] & (pair_col < width // 2)[None, :]
    byte = tl.load(packed_ptr + pair, mask=pair_mask, other=0)
    GROUPS: tl.constexpr = BLOCK_COLS // GROUP
    if ROW_SCALE:  # a row a group, decoded in column blocks (no statistics to hold whole)
        bits = tl.load(scale_ptr + row, mask=row < rows, other=0)
        scale = bf16_bits_to_float(bits)[:, None, None]
    else:
        group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
        bits = tl.load(scale_ptr + row[:, None] * row_groups + group[None, :],
                       mask=(row < rows)[:, None] & (group < row_groups)[None, :], other=0)
        scale = bf16_bits_to_float(bits)[:, :, None]
    byte = tl.reshape(byte, [BLOCK_ROWS, GROUPS, GROUP // 2])
    # (code - 8) * scale is exact in fp32; saturating keeps a finite group finite in the
    # output dtype, and a NaN scale (a non-finite group) decodes NaN.
    even = saturate_to(code_value(byte & 15, 8) * scale, out_ptr.dtype.element_ty)
    odd = saturate_to(code_value(byte >> 4, 8) * scale, out_ptr.dtype.element_ty)
    value = tl.reshape(tl.interleave(even, odd), [BLOCK_ROWS, BLOCK_COLS])
    value = to_output(value, OUT_BF16, out_dtype)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row < rows)[:, None] & (col < width)[None, :]
    tl.store(out_ptr + row[:, None] * width + col[None, :], value, mask=mask)
    if EXACT:
        # The exact channels of this tile's elements, written over the decoded ones by the
        # same program after a barrier (no other program writes these elements).
        tl.debug_barrier()
        if CHANNEL_MOD:
            slot = tl.arange(0, CAPACITY_BLOCK)
            index = tl.load(index_ptr + slot, mask=slot < capacity, other=-1)
            first = tl.min(row, axis=0) * width  # the program's first element
            end = tl.minimum(first + BLOCK_ROWS * width, numel)
            tensor_row = first // channels + tl.arange(0, EXACT_ROWS)
            target = tensor_row[:, None] * channels + index[None, :]
            ok = (index >= 0)[None, :] & (target >= first) & (target < end)
            ok = ok & (tensor_row < tensor_rows)[:, None]
            at = tensor_row[:, None] * capacity + slot[None, :]
            exact = tl.load(values_ptr + at, mask=ok, other=0)
            tl.store(out_ptr + target, exact, mask=ok)
        else:
            slot = tl.arange(0, CAPACITY_BLOCK)
            slots = tl.load(index_ptr + slot, mask=slot < capacity, other=-1)
            _copy_exact_run(out_ptr, width, values_ptr, index_ptr, slots, row, rows, capacity,
                            tl.program_id(1) * BLOCK_COLS, BLOCK_COLS, EXACT_SLOTS,
                            TO_VALUES=False)


# Each argument of a launch costs Triton's launcher host time (binding, specialisation, the cache
# key; on a GPU a pointer check too). So the kernels launched take none that is a constant or
# follows from the others: the dtype flags come from the pointers, and the codecs without exact
# channels launch lean kernels, the exact channels' arguments constants.
@triton.jit
def _sym_encode_exact(x_ptr, selected_ptr, index_ptr, packed_ptr, scale_ptr, values_ptr,
                      rows, width, stride, channels, capacity, tensor_rows,
                      GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                      CAPACITY_BLOCK: tl.constexpr, EXACT_SLOTS: tl.constexpr,
                      EXACT_ROWS: tl.constexpr, CHANNEL_MOD: tl.constexpr, INT64: tl.constexpr):
    # groups a row: GROUP divides the width, or is its power-of-two ceiling (a row a group);
    # the minimum scale is int4.MIN_SCALE, 2 ** -126 (fp32's least normal: a constant exactly)
    _sym_encode_tiles(x_ptr, selected_ptr, index_ptr, packed_ptr, scale_ptr, values_ptr, rows,
                      width, stride, tl.cdiv(width, GROUP), channels, capacity, tensor_rows,
                      1.1754943508222875e-38, x_ptr.dtype.element_ty == tl.bfloat16, GROUP,
                      BLOCK_ROWS, BLOCK_COLS, True, CAPACITY_BLOCK, EXACT_SLOTS, EXACT_ROWS,
                      CHANNEL_MOD, INT64)


@triton.jit
def _sym_decode_exact(packed_ptr, scale_ptr, index_ptr, values_ptr, out_ptr,
                      rows, width, numel, channels, capacity, tensor_rows,
                      GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
                      ROW_SCALE: tl.constexpr, CAPACITY_BLOCK: tl.constexpr,
                      EXACT_SLOTS: tl.constexpr, EXACT_ROWS: tl.constexpr,
                      CHANNEL_MOD: tl.constexpr, INT64: tl.constexpr):
    # groups a row, read without ROW_SCALE: GROUP then divides the width
    _sym_decode_tiles(packed_ptr, scale_ptr, index_ptr, values_ptr, out_ptr, rows, width,
                      tl.cdiv(width, GROUP), numel, channels, capacity, tensor_rows,
                      out_ptr.dtype.element_ty == tl.bfloat16, out_ptr.dtype.element_ty, GROUP,
                      BLOCK_ROWS, BLOCK_COLS, ROW_SCALE, True, CAPACITY_BLOCK, EXACT_SLOTS,
                      EXACT_ROWS, CHANNEL_MOD, INT64)


@triton.jit
def _sym_encode(x_ptr, packed_ptr, scale_ptr, rows, width, stride, GROUP: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, INT64: tl.constexpr):
    _sym_encode_tiles(x_ptr, None, None, packed_ptr, scale_ptr, None, rows, width, stride,
                      tl.cdiv(width, GROUP), None, None, None, 1.1754943508222875e-38,
                      x_ptr.dtype.element_ty == tl.bfloat16, GROUP, BLOCK_ROWS, BLOCK_COLS,
                      False, 1, 1, 1, False, INT64)


@triton.jit
def _sym_decode(packed_ptr, scale_ptr, out_ptr, rows, width, GROUP: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, ROW_SCALE: tl.constexpr,
                INT64: tl.constexpr):
    _sym_decode_tiles(packed_ptr, scale_ptr, None, None, out_ptr, rows, width,
                      tl.cdiv(width, GROUP), None, None, None, None,
                      out_ptr.dtype.element_ty == tl.bfloat16,
                      out_ptr.dtype.element_ty, GROUP, BLOCK_ROWS, BLOCK_COLS, ROW_SCALE, False,
                      1, 1, 1, False, INT64)


@triton.jit
def _copy_exact_run(tensor_ptr, stride, values_ptr, index_ptr, slots, row, rows, capacity,
                    start, BLOCK_COLS: tl.constexpr, EXACT_SLOTS: tl.constexpr,
                    TO_VALUES: tl.constexpr):
    """Copy the exact channels among columns [start, start + BLOCK_COLS) of ``row``.

    They go between the tensor (rows ``stride`` apart) and their slots' columns of the values
    ([rows, capacity]). They are a run of the ascending slot indices ``slots`` (every slot, -1
    where empty), counted there: no chain of dependent loads, as a binary search makes. They are
    copied EXACT_SLOTS at a time: one pass, unless the block holds more exact channels."""
    used = slots >= 0  # the used slots come first, ascending
    first_slot = tl.sum((used & (slots < start)).to(tl.int32), axis=0)
    end_slot = tl.sum((used & (slots < start + BLOCK_COLS)).to(tl.int32), axis=0)
    for first in range(first_slot, end_slot, EXACT_SLOTS):
        slot = first + tl.arange(0, EXACT_SLOTS)
        index = tl.load(index_ptr + slot, mask=slot < end_slot, other=0)
        ok = (row < rows)[:, None] & (slot < end_slot)[None, :]
        in_tensor = tensor_ptr + row[:, None] * stride + index[None, :]
        in_values = values_ptr + row[:, None] * capacity + slot[None, :]
        if TO_VALUES:
            tl.store(in_values, tl.load(in_tensor, mask=ok, other=0), mask=ok)
        else:
            tl.store(in_tensor, tl.load(in_values, mask=ok, other=0), mask=ok)


@triton.jit
def _lower_bound(channel, index_ptr, capacity, CAPACITY_BLOCK: tl.constexpr):
    """How many used slots hold a channel below ``channel``: a binary search.

    The slot indices ascend, with the empty slots (-1) at the end. The search makes
    log2(CAPACITY_BLOCK) + 1 gathers of the index."""
    position = tl.zeros_like(channel)
    for level in tl.static_range(CAPACITY_BLOCK.bit_length()):  # steps up to 2 x block - 1
        probe = position + (CAPACITY_BLOCK >> level)
        below = tl.load(index_ptr + probe - 1, mask=probe <= capacity, other=-1)
        below = tl.where(below < 0, 2147483647, below)  # an empty slot sorts last
        position = tl.where(below < channel, probe, position)
    return position


@triton.jit
def _slot_of(channel, index_ptr, capacity, CAPACITY_BLOCK: tl.constexpr):
    """The slot holding each ``channel`` in the ascending slot indices, or -1."""
    position = _lower_bound(channel, index_ptr, capacity, CAPACITY_BLOCK)
    found = tl.load(index_ptr + position, mask=position < capacity, other=-1)
    return tl.where(found == channel, position, -1)


@dataclass(frozen=True)
class Layout:
    """How the sym kernels see a tensor: [rows, width] (width even), rows ``stride`` elements apart.

    The rows are cut into groups of ``group`` elements (None: a whole row a group). Build one with
    ``layout()``, which caches it: a training step asks for the same few thousands of times."""

    rows: int
    width: int
    stride: int
    group: int
    row_groups: int
    tile: Tile
    whole_rows: bool     # a decode holds no group statistics: a row-wide group's rows decode
    decode_tile: Tile    # in column blocks
    int64: bool
    # The lean kernels' scalar arguments and options, made once with the layout: a launch then
    # costs no dictionary built or hashed.
    encode_args: tuple = field(compare=False)
    encode_options: dict = field(compare=False)
    decode_args: tuple = field(compare=False)
    decode_options: dict = field(compare=False)
    # The exact-channel kernels' options by (encode, capacity, channels): a lookup, where
    # hashing the layout for a cache would cost a microsecond a launch.
    exact_options: dict = field(compare=False, default_factory=dict)


@functools.lru_cache(maxsize=4096)
def layout(rows: int, width: int, stride: int, group: int | None = None) -> Layout:
    """The cached Layout of [rows, width] rows ``stride`` apart, in groups of ``group``."""
    whole_rows = group is None
    group = next_power_of_2(width) if whole_rows else group
    tile = row_tile(rows, width, group)
    decode_tile = row_tile(rows, width, 2) if whole_rows else tile
    row_groups = 1 if whole_rows else width // group
    int64 = needs_int64((rows - 1) * stride + width, rows * width)
    return Layout(
        rows, width, stride, group, row_groups, tile, whole_rows, decode_tile, int64,
        encode_args=(rows, width, stride),
        encode_options=dict(GROUP=group, BLOCK_ROWS=tile.rows, BLOCK_COLS=tile.cols, INT64=int64,
                            num_warps=tile.num_warps, enable_fp_fusion=FP_FUSION),
        decode_args=(rows, width),
        decode_options=dict(GROUP=decode_tile.cols if whole_rows else group,
                            BLOCK_ROWS=decode_tile.rows, BLOCK_COLS=decode_tile.cols,
                            ROW_SCALE=whole_rows, INT64=int64, num_warps=decode_tile.num_warps))


def _capacity_block(capacity: int) -> int:
    return next_power_of_2(max(capacity, 1))


def _exact_rows(tile: Tile, width: int, channels: int) -> int:
    """Tensor rows (of ``channels``) a program's elements can touch.

    That is its tile's rows, or, where flat groups cross the rows (CHANNEL_MOD), the rows its
    element range spans."""
    if channels == width:
        return tile.rows
    return next_power_of_2(-(-tile.rows * width // channels) + 1)


def _exact_options(layout: Layout, encode: bool, capacity: int, channels: int) -> dict:
    """The exact-channel kernel's constexprs and options, made once per layout and key."""
    key = (encode, capacity, channels)
    found = layout.exact_options.get(key)
    if found is None:
        found = layout.exact_options[key] = (
            _encode_config(layout, capacity, channels) if encode
            else _decode_config(layout, capacity, channels))
    return found


def _encode_config(layout: Layout, capacity: int, channels: int) -> dict:
    t, block = layout.tile, _capacity_block(capacity)
    return dict(GROUP=layout.group, BLOCK_ROWS=t.rows, BLOCK_COLS=t.cols, CAPACITY_BLOCK=block,
                EXACT_SLOTS=min(block, EXACT_SLOTS),
                EXACT_ROWS=_exact_rows(t, layout.width, channels),
                CHANNEL_MOD=channels != layout.width, INT64=layout.int64, num_warps=t.num_warps,
                enable_fp_fusion=FP_FUSION)


def _decode_config(layout: Layout, capacity: int, channels: int) -> dict:
    t, block = layout.decode_tile, _capacity_block(capacity)
    return dict(GROUP=t.cols if layout.whole_rows else layout.group, BLOCK_ROWS=t.rows,
                BLOCK_COLS=t.cols, ROW_SCALE=layout.whole_rows, CAPACITY_BLOCK=block,
                EXACT_SLOTS=min(block, EXACT_SLOTS),
                EXACT_ROWS=_exact_rows(t, layout.width, channels),
                CHANNEL_MOD=channels != layout.width, INT64=layout.int64, num_warps=t.num_warps)


def sym_encode(x: torch.Tensor, layout: Layout, outlier=None):
    """-> (packed codes, bf16 scales) of ``x`` seen through ``layout``.

    Args:
        outlier: (slot indices int32 [capacity], a [rows, capacity] output for their exact values,
            channels, the selected channels' bool mask), as outlier_select gives them. Those
            channels are copied to their slot and encoded as zeros.
    """
    device = x.device
    packed = torch.empty(layout.rows * layout.width // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(layout.rows * layout.row_groups, dtype=torch.bfloat16, device=device)
    if outlier is None:
        # .run is what kernel[grid](...) calls, less a lambda and a repacking of the arguments
        _sym_encode.run(x, packed, scales, *layout.encode_args, grid=layout.tile.grid,
                        warmup=False, **layout.encode_options)
        return packed, scales
    index, values, channels = outlier[:3]
    capacity = index.numel()
    _sym_encode_exact.run(
        x, outlier[3], index, packed, scales, values, layout.rows, layout.width, layout.stride,
        channels, capacity, values.shape[0], grid=layout.tile.grid, warmup=False,
        **_exact_options(layout, True, capacity, channels))
    return packed, scales


def sym_decode(packed: torch.Tensor, scales: torch.Tensor, layout: Layout, dtype: torch.dtype,
               exact=None) -> torch.Tensor:
    """The decoded [rows, width] tensor of ``dtype``.

    Args:
        exact: (slot indices int32 [capacity], their values [rows, capacity], channels), written
            over the decoded values in the same pass.
    """
    out = torch.empty(layout.rows, layout.width, dtype=dtype, device=packed.device)
    if exact is None:
        _sym_decode.run(packed, scales, out, *layout.decode_args, grid=layout.decode_tile.grid,
                        warmup=False, **layout.decode_options)
        return out
    index, values, channels = exact
    capacity = index.numel()
    _sym_decode_exact.run(
        packed, scales, index, values, out, layout.rows, layout.width,
        layout.rows * layout.width, channels, capacity, values.shape[0],
        grid=layout.decode_tile.grid, warmup=False,
        **_exact_options(layout, False, capacity, channels))
    return out
