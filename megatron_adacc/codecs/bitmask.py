"""Bit-packing reference kernels (PyTorch, any device): 8 flags per byte, flag i of a byte in
bit i."""
from __future__ import annotations

import torch

_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)


def mask_pack(flat: torch.Tensor) -> torch.Tensor:
    """Flat tensor -> uint8 bytes holding (flat != 0), zero-padded to whole bytes."""
    bits = (flat != 0).to(torch.uint8)
    tail = (-bits.numel()) % 8
    if tail:
        bits = torch.cat([bits, bits.new_zeros(tail)])
    return (bits.view(-1, 8) << _BIT_SHIFTS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def mask_unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of mask_pack: the first `numel` flags as a bool tensor."""
    bits = (packed.unsqueeze(1) >> _BIT_SHIFTS.to(packed.device)) & 1
    return bits.view(-1)[:numel].bool()
