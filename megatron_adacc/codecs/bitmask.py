"""Bit-packing reference kernels (PyTorch, any device): 8 flags per byte, flag i in bit i."""
from __future__ import annotations

import torch

from megatron_adacc.codecs.int4 import with_nan



def _bit_shifts(device: torch.device) -> torch.Tensor:
    # made on the device: a copy from the host would wait for the stream on CUDA
    return torch.arange(8, dtype=torch.uint8, device=device)


def mask_encode(flat: torch.Tensor, pack=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bitmask codec's payload of a flat mask: its bits and, unless bool, its value.

    ``pack`` is a backend's kernel for mask_pack; the value is mask_value's."""
    return (pack or mask_pack)(flat), None if flat.dtype == torch.bool else mask_value(flat)


def mask_pack(flat: torch.Tensor) -> torch.Tensor:
    """Flat tensor -> uint8 bytes holding (flat != 0), zero-padded to whole bytes."""
    bits = (flat != 0).to(torch.uint8)
    tail = (-bits.numel()) % 8
    if tail:
        bits = torch.cat([bits, bits.new_zeros(tail)])
    return (bits.view(-1, 8) << _bit_shifts(flat.device)).sum(dim=1, dtype=torch.uint8)


def mask_unpack(packed: torch.Tensor, numel: int,
                value: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of mask_pack: the first ``numel`` flags, as bool or holding the mask's value.

    Given the mask's value (mask_value), it returns a tensor of the value's dtype, holding that
    value where set and +0 elsewhere."""
    bits = (packed.unsqueeze(1) >> _bit_shifts(packed.device)) & 1
    return expand_flags(bits.view(-1)[:numel].bool(), value)


def expand_flags(flags: torch.Tensor, value: torch.Tensor | None) -> torch.Tensor:
    return flags if value is None else torch.where(flags, value, value.new_zeros(()))


def mask_value(flat: torch.Tensor) -> torch.Tensor:
    """The one non-zero value of a mask held in a non-bool dtype, as a 1-element tensor.

    CPU dropout saves 0 and 1/(1-p). An all-zero mask gives +0. The check runs on the device: for
    a tensor that is no mask (other values, or NaN) the value is NaN. The decoded mask is then
    NaN where set, and training sees it with no host read; check_mask raises instead. An integer
    mask's value is not checked, having no NaN to flag it with."""
    lo, hi = torch.aminmax(flat)
    value = torch.where(hi != 0, hi, torch.where(lo != 0, lo, torch.zeros_like(lo)))
    if not flat.is_floating_point():  # no NaN to flag with: check_mask is the only check
        return value.reshape(1).clone()
    is_mask = ((flat == 0) | (flat == value)).all()
    return with_nan(value.reshape(1), ~is_mask)


def check_mask(flat: torch.Tensor) -> None:
    """Raise unless ``flat`` holds 0 and at most one other value.

    It reads on the host, so it is for tests and strict checking, never for the training step.
    mask_value flags such a tensor instead."""
    if flat.dtype != torch.bool and flat.numel():
        if not bool(((flat == 0) | (flat == mask_value(flat))).all()):
            raise not_a_mask(flat.dtype)


def not_a_mask(dtype: torch.dtype) -> ValueError:
    return ValueError(
        "codec 'bitmask' encodes masks: every element must be 0 or one common non-zero "
        f"value, got a {dtype} tensor with other values")
