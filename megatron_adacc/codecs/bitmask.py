"""Bit-packing reference kernels (PyTorch, any device): 8 flags per byte, flag i of a byte in
bit i."""
from __future__ import annotations

import torch

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def mask_encode(flat: torch.Tensor, pack=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bitmask codec's payload of a flat mask: its bits (by ``pack``: a backend's kernel
    for mask_pack) and, unless it is a bool mask, its value (mask_value)."""
    return (pack or mask_pack)(flat), None if flat.dtype == torch.bool else mask_value(flat)


def mask_pack(flat: torch.Tensor) -> torch.Tensor:
    """Flat tensor -> uint8 bytes holding (flat != 0), zero-padded to whole bytes."""
    bits = (flat != 0).to(torch.uint8)
    tail = (-bits.numel()) % 8
    if tail:
        bits = torch.cat([bits, bits.new_zeros(tail)])
    return (bits.view(-1, 8) << _BIT_SHIFTS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def mask_unpack(packed: torch.Tensor, numel: int, value: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of mask_pack: the first `numel` flags as a bool tensor or, given the mask's
    value (mask_value), as a tensor of its dtype holding that value where set, +0 elsewhere."""
    bits = (packed.unsqueeze(1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return expand_flags(bits.view(-1)[:numel].bool(), value)


def expand_flags(flags: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    return flags if value is None else torch.where(flags, value, value.new_zeros(()))


def mask_value(flat: torch.Tensor) -> torch.Tensor:
    """The one non-zero value of a mask held in a non-bool dtype (CPU dropout saves 0 and
    1/(1-p)), as a 1-element tensor; +0 for an all-zero mask. Raises if it is no mask."""
    lo, hi = torch.aminmax(flat)
    value = torch.where(hi != 0, hi, torch.where(lo != 0, lo, torch.zeros_like(lo)))
    if not bool(((flat == 0) | (flat == value)).all()):
        raise not_a_mask(flat.dtype)
    return value.reshape(1).clone()


def not_a_mask(dtype: torch.dtype) -> ValueError:
    return ValueError(
        "codec 'bitmask' encodes masks: every element must be 0 or one common non-zero "
        f"value, got a {dtype} tensor with other values")
