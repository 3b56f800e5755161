"""Numerics shared by the int4 codecs: nibble packing, scale rounding, input checks.

Every backend (eager, native, Triton) follows exactly these rules, which is what makes
their payloads byte-identical.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Scales are stored in bf16: two bytes (the size targets need that), and the fp32 exponent
# range, so no finite input can overflow or underflow its scale (fp16 scales would overflow
# for bf16 activations above ~5e5).
SCALE_DTYPE = torch.bfloat16
# Payloads store group and channel indices (exceptions, outlier channels) in this type.
INDEX_DTYPE = torch.int32
# Smallest normal bf16 (= fp32) number. Every scale is at least this, so all-zero and
# constant groups never divide by zero, and no scale is subnormal (GPUs may flush those).
MIN_SCALE = 2.0**-126


def check_float_input(x: object, codec: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec {codec!r} encodes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"codec {codec!r} encodes float32, bfloat16 or float16 tensors, got {x.dtype}"
        )


def dtype_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def ceil_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """Smallest bf16-representable fp32 value >= v, for finite v >= 0 (others pass through).

    Rounding the scale up (never to nearest) keeps every quantised value inside the int4
    range, so the per-element error bound holds against the scale actually stored.
    """
    bits = v.view(torch.int32)
    up = ((bits + 0xFFFF) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(v), up, v)


def true_divide(v: torch.Tensor, divisor: float) -> torch.Tensor:
    """v / divisor rounded once, as the native and Triton kernels divide, on every device:
    PyTorch's CUDA division by a Python number multiplies by the number's rounded reciprocal
    instead, which moves a scale (x / 7.5, x / 15) across a bf16 boundary where x is a
    16-bit value (seen on an H100); a divisor tensor on v's device is divided exactly."""
    return v / torch.full_like(v, divisor)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Flat uint8 codes in [0, 15] -> bytes, element 2i in the low nibble of byte i."""
    flat = codes.reshape(-1)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of pack_nibbles: the first `numel` codes."""
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).view(-1)
    return codes if codes.numel() == numel else codes[:numel]


def row_layout(x: torch.Tensor, zeroed: tuple[int, torch.Tensor] | None = None
               ) -> tuple[int, int, int, int] | None:
    """(groups, group width, channels, stride) of groups of even width as a kernel reading
    strided rows (Kernels.strided_rows) takes them where they lie: [groups, width]
    contiguous, or a codec's rows read in place (Codec.reads_in_place), [rows, width] or
    [rows, groups a row, width]: rows of `channels` elements `stride` apart (stride ==
    channels: dense). Zeroing (zero_channels' (channels, mask): a bool mask, one entry per
    channel, on x's device) counts in those channels, which strided rows must then be. None
    for any other input or mask (the reference raises on a wrong mask)."""
    if x.dim() not in (2, 3) or x.shape[-1] % 2:
        return None
    if zeroed is not None and not (zeroed[1].dtype == torch.bool and zeroed[1].device == x.device
                                   and tuple(zeroed[1].shape) == (zeroed[0],)):
        return None
    width = x.shape[-1]
    groups = x.numel() // width if width else 0
    if x.is_contiguous():
        channels = zeroed[0] if zeroed is not None else width
        return groups, width, channels, channels
    channels = width * (x.shape[1] if x.dim() == 3 else 1)
    in_rows = x.stride(-1) == 1 and (x.dim() == 2 or x.stride(1) == width) and x.stride(0) >= channels
    if not in_rows or zeroed is not None and zeroed[0] != channels:
        return None
    return groups, width, channels, x.stride(0)


def pad_to_groups(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """View a flat tensor as [groups, group_size], padding the last group with copies of the
    last element: neutral for every group statistic (min, max, |max|)."""
    tail = (-flat.numel()) % group_size
    if tail:
        flat = torch.cat([flat, flat[-1:].expand(tail)])
    return flat.view(-1, group_size)


def zero_channels(x2d: torch.Tensor, zeroed: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    """x2d with the elements of the given channels set to 0: `zeroed` = (channels, mask)
    treats the flattened x2d as rows of `channels` values and zeroes the columns where the
    bool `mask` (one entry per channel) is set. A mask, not indices: it needs no host sync."""
    if zeroed is None:
        return x2d
    channels, mask = zeroed
    return x2d.reshape(-1, channels).masked_fill(mask, 0).view(x2d.shape)


def count_unusable(ok: torch.Tensor) -> torch.Tensor:
    """How many scales are unusable (False in the bool flags `ok`), as a 0-d tensor on ok's
    device: read on the host with the encode's one sync."""
    return (~ok).count_nonzero()


def split_exceptions(x2d: torch.Tensor, ok: torch.Tensor, dim: int, count: int) -> dict[str, torch.Tensor]:
    """Raw copies of the `count` slices of x2d along `dim` whose scale was unusable (`ok`
    False); `count` is read on the host by the caller, with the encode's one sync.

    A scale is unusable when its group holds NaN or Inf or when its int4 grid would not fit
    the input dtype's finite range. Storing such groups raw makes NaN stay NaN and +-Inf stay
    +-Inf in the same element, and keeps the finite neighbours exact.
    """
    if not count:
        return {}
    index = torch.nonzero_static(~ok, size=count).view(-1)  # sized on the host: no sync
    return {"raw_index": index.to(INDEX_DTYPE), "raw_values": x2d.index_select(dim, index)}


def restore_exceptions(out2d: torch.Tensor, tensors: dict[str, torch.Tensor], dim: int) -> None:
    if "raw_index" in tensors:
        out2d.index_copy_(dim, tensors["raw_index"].long(), tensors["raw_values"])
