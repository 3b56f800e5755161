"""Bit packing of masks, 8 flags per byte: the Triton twin of codecs/bitmask.py."""
import torch
import triton
import triton.language as tl

from megatron_adacc.codecs.triton.launch import BLOCK_ELEMENTS


@triton.jit
def _mask_pack(x_ptr, packed_ptr, numel, BLOCK_BYTES: tl.constexpr):
    byte = tl.program_id(0) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bit = tl.arange(0, 8)
    index = byte[:, None].to(tl.int64) * 8 + bit[None, :]
    flags = (tl.load(x_ptr + index, mask=index < numel, other=0) != 0).to(tl.int32)
    packed = tl.sum(flags << bit[None, :], axis=1)
    tl.store(packed_ptr + byte, packed.to(tl.uint8), mask=byte < (numel + 7) // 8)


@triton.jit
def _mask_unpack(packed_ptr, out_ptr, numel, BLOCK_BYTES: tl.constexpr):
    byte = tl.program_id(0) * BLOCK_BYTES + tl.arange(0, BLOCK_BYTES)
    bit = tl.arange(0, 8)
    packed = tl.load(packed_ptr + byte, mask=byte < (numel + 7) // 8, other=0).to(tl.int32)
    index = byte[:, None].to(tl.int64) * 8 + bit[None, :]
    tl.store(out_ptr + index, ((packed[:, None] >> bit[None, :]) & 1).to(tl.uint8), mask=index < numel)


_BLOCK_BYTES = BLOCK_ELEMENTS // 8


def mask_pack(flat: torch.Tensor) -> torch.Tensor:
    flat = flat.view(torch.uint8) if flat.dtype == torch.bool else flat
    packed = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8, device=flat.device)
    _mask_pack[(triton.cdiv(packed.numel(), _BLOCK_BYTES),)](flat, packed, flat.numel(), BLOCK_BYTES=_BLOCK_BYTES)
    return packed


def mask_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    out = torch.empty(numel, dtype=torch.bool, device=packed.device)
    _mask_unpack[(triton.cdiv(packed.numel(), _BLOCK_BYTES),)](packed, out.view(torch.uint8), numel,
                                                               BLOCK_BYTES=_BLOCK_BYTES)
    return out
