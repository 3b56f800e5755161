"""Bit packing of masks, 8 flags per byte: the Triton twin of codecs/bitmask.py.

- The pack kernel also checks a float mask's value on the device (bitmask.mask_value). Each program
  takes the least and greatest non-zero element of its block, and whether it met a NaN. The last
  program to finish, by an atomic ticket, writes the value or NaN.
- The unpack kernel writes the value where a flag is set.
"""
import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.int4 import NAN_BITS
from megatron_adacc.codecs.triton.launch import (counters, flat_tile, needs_int64, tl_dtype,
                                                 warps_for)
from megatron_adacc.codecs.triton.numerics import load_float, to_output

# Partial minima a program of the last one reduces at once.
REDUCE_BLOCK = 1024
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@triton.jit
def _mask_pack_checked(x_ptr, packed_ptr, low_ptr, high_ptr, nan_ptr, counter_ptr, value_ptr,
                       numel, nan_bits,
                       CHECK: tl.constexpr, IN_BF16: tl.constexpr, value_dtype: tl.constexpr,
                       value_bits: tl.constexpr, BLOCK_BYTES: tl.constexpr,
                       REDUCE_BLOCK: tl.constexpr, INT64: tl.constexpr):
    first = tl.program_id(0) * BLOCK_BYTES
    if INT64:
        first = first.to(tl.int64)
    byte = first + tl.arange(0, BLOCK_BYTES)
    element = first * 8 + tl.arange(0, BLOCK_BYTES * 8)  # 1-D: unit stride, 16-byte vectors
    x = load_float(x_ptr + element, element < numel, IN_BF16)
    flags = tl.reshape((x != 0).to(tl.int32), [BLOCK_BYTES, 8]) << tl.arange(0, 8)[None, :]
    tl.store(packed_ptr + byte, tl.sum(flags, axis=1).to(tl.uint8), mask=byte < (numel + 7) // 8)
    if CHECK:
        set_ = x != 0
        tl.store(low_ptr + tl.program_id(0), tl.min(tl.where(set_, x, float("inf")), axis=0))
        tl.store(high_ptr + tl.program_id(0), tl.max(tl.where(set_, x, -float("inf")), axis=0))
        tl.store(nan_ptr + tl.program_id(0), tl.max((x != x).to(tl.int32), axis=0))
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1) == tl.num_programs(0) - 1:
            tl.atomic_xchg(counter_ptr, 0)   # the last program: zero for the next launch
            _mask_value(low_ptr, high_ptr, nan_ptr, value_ptr, tl.num_programs(0), nan_bits,
                        IN_BF16, value_dtype, value_bits, REDUCE_BLOCK)


# A bool mask has no value to check: this lean kernel takes no arguments for it, each of which
# would cost Triton's launcher host time.
@triton.jit
def _mask_pack(x_ptr, packed_ptr, numel, BLOCK_BYTES: tl.constexpr, INT64: tl.constexpr):
    _mask_pack_checked(x_ptr, packed_ptr, None, None, None, None, None, numel, 0, CHECK=False,
                       IN_BF16=False, value_dtype=tl.float32, value_bits=tl.int32,
                       BLOCK_BYTES=BLOCK_BYTES, REDUCE_BLOCK=1, INT64=INT64)


@triton.jit
def _mask_value(low_ptr, high_ptr, nan_ptr, value_ptr, programs, nan_bits, IN_BF16: tl.constexpr,
                value_dtype: tl.constexpr, value_bits: tl.constexpr, REDUCE_BLOCK: tl.constexpr):
    """The mask's one non-zero value, +0 if none, NaN if it holds two or a NaN."""
    low = tl.full([REDUCE_BLOCK], float("inf"), tl.float32)
    high = tl.full([REDUCE_BLOCK], -float("inf"), tl.float32)
    nan = tl.zeros([REDUCE_BLOCK], tl.int32)
    for first in range(0, programs, REDUCE_BLOCK):
        p = first + tl.arange(0, REDUCE_BLOCK)
        inside = p < programs
        low = tl.minimum(low, tl.load(low_ptr + p, mask=inside, other=float("inf"), volatile=True))
        part = tl.load(high_ptr + p, mask=inside, other=-float("inf"), volatile=True)
        high = tl.maximum(high, part)
        nan = tl.maximum(nan, tl.load(nan_ptr + p, mask=p < programs, other=0, volatile=True))
    low = tl.min(low, axis=0)
    high = tl.max(high, axis=0)
    value = tl.where(high == -float("inf"), 0.0, high)  # no element set: +0
    bits = to_output(value, IN_BF16, value_dtype).to(value_bits, bitcast=True)
    not_a_mask = (tl.max(nan, axis=0) > 0) | ((high != -float("inf")) & (low != high))
    tl.store(value_ptr, tl.where(not_a_mask, nan_bits, bits).to(value_bits))


@triton.jit
def _mask_unpack(packed_ptr, value_ptr, out_ptr, numel, VALUE: tl.constexpr,
                 BLOCK_BYTES: tl.constexpr,
                 INT64: tl.constexpr):
    first = tl.program_id(0) * BLOCK_BYTES
    if INT64:
        first = first.to(tl.int64)
    byte = first + tl.arange(0, BLOCK_BYTES)
    packed = tl.load(packed_ptr + byte, mask=byte < (numel + 7) // 8, other=0).to(tl.int32)
    flags = tl.reshape((packed[:, None] >> tl.arange(0, 8)[None, :]) & 1, [BLOCK_BYTES * 8])
    element = first * 8 + tl.arange(0, BLOCK_BYTES * 8)
    if VALUE:  # the value's bits where set, +0 elsewhere
        value = tl.load(value_ptr)
        out = tl.where(flags != 0, value, tl.zeros_like(value))
    else:
        out = flags.to(tl.uint8)
    tl.store(out_ptr + element, out, mask=element < numel)


def mask_encode(flat: torch.Tensor):
    """(packed flags, the mask's value or None) as bitmask.mask_encode, for bool and float masks."""
    numel = flat.numel()
    tile = flat_tile(numel, 8)
    device = flat.device
    packed = torch.empty((numel + 7) // 8, dtype=torch.uint8, device=device)
    if flat.dtype == torch.bool:
        # read as bool where it lies: Triton moves bool as bytes, and a uint8 view costs host time
        _mask_pack.run(flat, packed, numel, grid=tile.grid, warmup=False,
                       BLOCK_BYTES=tile.rows, INT64=needs_int64(numel + 8),
                       num_warps=tile.num_warps)
        return packed, None
    programs = tile.grid[0]
    low = torch.empty(programs, dtype=torch.float32, device=device)
    high = torch.empty(programs, dtype=torch.float32, device=device)
    nan = torch.empty(programs, dtype=torch.int32, device=device)
    counter = counters(device)
    value = torch.empty(1, dtype=flat.dtype, device=device)
    value_bits = value.view(_BITS[flat.element_size()])
    _mask_pack_checked.run(
        flat, packed, low, high, nan, counter, value_bits, numel,
        NAN_BITS[flat.dtype], grid=tile.grid, warmup=False, CHECK=True,
        IN_BF16=flat.dtype == torch.bfloat16, value_dtype=tl_dtype(flat.dtype),
        value_bits=tl.int32 if flat.element_size() == 4 else tl.int16, BLOCK_BYTES=tile.rows,
        REDUCE_BLOCK=REDUCE_BLOCK, INT64=needs_int64(numel + 8), num_warps=tile.num_warps)
    return packed, value


def mask_unpack(packed: torch.Tensor, numel: int,
                value: torch.Tensor | None = None) -> torch.Tensor:
    """The first ``numel`` flags as bool, or as ``value``'s dtype holding it where set."""
    dtype = torch.bool if value is None else value.dtype
    out = torch.empty(numel, dtype=dtype, device=packed.device)
    tile = flat_tile(numel, 8)
    if value is None:  # flags written as bool, where a uint8 view would cost host time
        value_bits, out_bits = None, out
    else:  # a value's bits, as they are: a float copy could change a NaN's
        bits = _BITS[out.element_size()]
        value_bits, out_bits = value.view(bits), out.view(bits)
    _mask_unpack.run(packed, value_bits, out_bits, numel, grid=tile.grid, warmup=False,
                     VALUE=value is not None, BLOCK_BYTES=tile.rows,
                     INT64=needs_int64(numel + 8), num_warps=warps_for(tile.rows * 8))
    return out
