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
# Payloads store the outlier channels' indices in this type; an empty slot holds EMPTY_SLOT.
INDEX_DTYPE = torch.int32
EMPTY_SLOT = -1
# Smallest normal bf16 (= fp32) number. Every scale is at least this, so all-zero and
# constant groups never divide by zero, and no scale is subnormal (GPUs may flush those).
MIN_SCALE = 2.0**-126


# The NaN every backend writes where the format stores one (a non-finite group's scale, a
# float tensor that is no mask's value): set bit by bit, since casts differ (torch's CPU
# fp32 -> bf16 cast of NaN gives 0xFFFF, CUDA's 0x7FFF). Quiet, sign clear.
NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}
_BITS_DTYPE = {4: torch.int32, 2: torch.int16}


def with_nan(v: torch.Tensor, nan: torch.Tensor) -> torch.Tensor:
    """``v`` (a float tensor) with NAN_BITS of its dtype where the bool ``nan`` is set."""
    bits = _BITS_DTYPE[v.element_size()]
    return torch.where(nan, NAN_BITS[v.dtype], v.view(bits)).view(v.dtype)


def store_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales as SCALE_DTYPE, NaN as NAN_BITS; a finite scale is bf16-exact (ceil_to_bf16)."""
    nan = torch.isnan(scale)
    return with_nan(torch.where(nan, 0.0, scale).to(SCALE_DTYPE), nan)


def check_float_input(x: object, codec: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"codec {codec!r} encodes a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"codec {codec!r} encodes float32, bfloat16 or float16 tensors, got {x.dtype}"
        )


# torch.finfo costs a microsecond a call, paid on every decode's launch
_DTYPE_MAX = {dtype: float(torch.finfo(dtype).max) for dtype in FLOAT_DTYPES}


def dtype_max(dtype: torch.dtype) -> float:
    found = _DTYPE_MAX.get(dtype)
    return float(torch.finfo(dtype).max) if found is None else found


def saturate(v32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 decoded values clamped to [-max, +max] of ``dtype`` (NaN passes), then cast.

    A finite group's grid may reach past the dtype's range, since its scale is rounded up. A value
    is only ever moved towards the range its input came from. So the error bound |x - x^| <= scale /
    2 still holds, and a finite input never decodes to +-Inf.
    """
    bound = dtype_max(dtype)
    return v32.clamp(-bound, bound).to(dtype)


def finite_groups(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Whether each group's fp32 minimum and maximum are finite.

    A group holding NaN or +-Inf is stored with a NaN scale and decodes to NaN throughout."""
    return torch.isfinite(lo) & torch.isfinite(hi)


def ceil_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """Smallest bf16-representable fp32 value >= v, for finite v >= 0 (others pass through).

    Rounding the scale up (never to nearest) keeps every quantised value inside the int4
    range, so the per-element error bound holds against the scale actually stored.
    """
    bits = v.view(torch.int32)
    up = ((bits + 0xFFFF) & -65536).view(torch.float32)
    return torch.where(torch.isfinite(v), up, v)


def true_divide(v: torch.Tensor, divisor: float) -> torch.Tensor:
    """``v / divisor`` rounded once, as the native and Triton kernels divide, on every device.

    PyTorch's CUDA division by a Python number multiplies by the number's rounded reciprocal. On
    a 16-bit x, that moves a scale (x / 7.5, x / 15) across a bf16 boundary (seen on an H100). A
    divisor tensor on v's device is divided exactly."""
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
    """(groups, group width, channels, stride) of groups of even width, for a strided-rows kernel.

    Such a kernel (Kernels.strided_rows) takes the groups where they lie:
    - [groups, width] contiguous;
    - a codec's rows read in place (Codec.reads_in_place), [rows, width] or [rows, groups a row,
      width]: rows of ``channels`` elements ``stride`` apart (stride == channels: dense).
    Zeroing (zero_channels' (channels, mask), a bool mask per channel on x's device) counts in
    those channels, which strided rows must then be. None for any other input or mask; the
    reference raises on a wrong mask."""
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
    in_rows = (x.stride(-1) == 1 and (x.dim() == 2 or x.stride(1) == width)
               and x.stride(0) >= channels)
    if not in_rows or zeroed is not None and zeroed[0] != channels:
        return None
    return groups, width, channels, x.stride(0)


def pad_to_groups(flat: torch.Tensor, group_size: int) -> torch.Tensor:
    """View a flat tensor as [groups, group_size], padding the last group with its last element.

    That padding is neutral for every group statistic (min, max, |max|)."""
    tail = (-flat.numel()) % group_size
    if tail:
        flat = torch.cat([flat, flat[-1:].expand(tail)])
    return flat.view(-1, group_size)


def zero_channels(x2d: torch.Tensor, zeroed: tuple[int, torch.Tensor] | None) -> torch.Tensor:
    """x2d with the elements of the given channels set to 0.

    ``zeroed`` = (channels, mask) treats the flattened x2d as rows of ``channels`` values. It
    zeroes the columns where the bool ``mask`` (one entry per channel) is set. A third element
    (the outlier codec's slot indices) is ignored. A mask, not indices, needs no host sync."""
    if zeroed is None:
        return x2d
    channels, mask = zeroed[:2]
    return x2d.reshape(-1, channels).masked_fill(mask, 0).view(x2d.shape)
