"""The codecs: each turns a tensor into a Payload and back, through one kernel backend."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from megatron_adacc.codecs.backend import kernels_for, resolve_backend
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.int4 import (
    INDEX_DTYPE,
    SCALE_DTYPE,
    check_float_input,
    dtype_max,
    pad_to_groups,
    restore_exceptions,
    split_exceptions,
    zero_channels,
)
from megatron_adacc.codecs.payload import Payload


class Codec:
    """encode(tensor) -> Payload; decode(payload) -> tensor of the input's shape, dtype and
    device (contiguous). Both run without autograd and never keep a reference to the input;
    a non-contiguous input is encoded as its contiguous copy would be, read in place where
    the codec and its kernels can (reads_in_place).
    payload_bytes(shape, dtype) -> the payload's size without encoding anything."""

    name: str
    separates_outliers = False  # whether payload_bytes takes an outlier channel count

    def __init__(self, backend: str | None = None):
        self.backend = resolve_backend(backend)

    def encode(self, x: torch.Tensor) -> Payload:
        self._check(x)
        with torch.no_grad():
            x = x.detach()
            kernels = kernels_for(self.backend, x.device)
            if not (x.is_contiguous() or kernels.strided_rows and self.reads_in_place(x)):
                x = x.contiguous()
            tensors = self._encode(x, kernels) if x.numel() else {}
        return Payload(self.name, x.shape, x.dtype, x.device, tensors)

    def decode(self, payload: Payload) -> torch.Tensor:
        if payload.codec != self.name:
            raise ValueError(f"codec {self.name!r} cannot decode a {payload.codec!r} payload")
        if payload.numel == 0:
            return torch.empty(payload.shape, dtype=payload.dtype, device=payload.device)
        with torch.no_grad():
            kernels = kernels_for(self.backend, payload.device)
            return self._decode(payload, kernels).view(payload.shape)

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype, outlier_channels: int = 0) -> int:
        """encode(x).nbytes for every finite x of this shape and dtype; for outlier_int4, one
        with exactly `outlier_channels` outlier channels (the other codecs take 0 only).

        The rule holds for finite inputs: a group or channel holding NaN or Inf is stored raw
        besides (its index and values), so a non-finite input's payload is larger.
        """
        shape = torch.Size(shape)
        if not 0 <= outlier_channels <= (_channels(shape) if self.separates_outliers else 0):
            raise ValueError(f"codec {self.name!r} cannot keep {outlier_channels} outlier channels "
                             f"of a tensor of shape {tuple(shape)}")
        if not shape.numel():
            return 0
        return self._payload_bytes(shape, dtype, outlier_channels)

    def reads_in_place(self, x: torch.Tensor) -> bool:
        """Whether this codec's encode reads a non-contiguous ``x`` where it lies, given
        kernels that read strided rows (Kernels.strided_rows)."""
        return False

    def _check(self, x: torch.Tensor) -> None:
        check_float_input(x, self.name)

    def _payload_bytes(self, shape: torch.Size, dtype: torch.dtype, outlier_channels: int) -> int:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, kernels: Kernels) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, payload: Payload, kernels: Kernels) -> torch.Tensor:
        raise NotImplementedError


def _channels(shape: torch.Size) -> int:
    return shape[-1] if len(shape) else 1


def _dense_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is rows of its last dimension, each dense, a stride apart: viewable as
    [rows, channels] (a slice of the last dimension, such as SwiGLU's gate half)."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return False
    try:
        x.view(-1, x.shape[-1])
    except RuntimeError:
        return False
    return True


def _packed_bytes(numel: int) -> int:
    """Two int4 codes per byte, the last byte half used for an odd count."""
    return (numel + 1) // 2


def _scales_bytes(count: int) -> int:
    return count * SCALE_DTYPE.itemsize


def _read_counts(*counts: torch.Tensor | int, bound: int) -> list[int]:
    """The values of 0-d integer tensors (or ints: a CPU kernel's counts), each in [0, bound),
    read to the host at once: an encode's one device sync (on CUDA the host waits for every
    kernel queued before it), so they travel as one mixed-radix integer."""
    packed = counts[0]
    for count in counts[1:]:
        packed = packed * bound + count
    value, digits = int(packed), []
    for _ in counts:
        value, digit = divmod(value, bound)
        digits.append(digit)
    return digits[::-1]


def _exceptions(x2d: Callable[[], torch.Tensor], ok: torch.Tensor, dim: int,
                kernels: Kernels) -> dict[str, torch.Tensor]:
    """split_exceptions of the tensor ``x2d()`` gives (built only if a group is unusable),
    with the count of unusable groups read by the encode's one host sync."""
    (count,) = _read_counts(kernels.count_unusable(ok), bound=ok.numel() + 1)
    return split_exceptions(x2d(), ok, dim, count) if count else {}


def _keep(t: torch.Tensor, numel: int) -> torch.Tensor:
    # A slice would pin its whole base tensor; copy it so nbytes is what stays alive.
    return t if t.numel() == numel else t[:numel].clone()


class _FlatGroups(Codec):
    """Base of the codecs that cut the flattened tensor into groups of `group_size`
    consecutive elements, in memory order: no transpose, the last group padded."""

    def __init__(self, group_size: int, backend: str | None = None):
        super().__init__(backend)
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
        self.group_size = group_size

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """[groups, group_size], or, for a tensor read in place (reads_in_place), [rows,
        groups a row, group_size] over its rows where they lie."""
        if x.is_contiguous():
            return pad_to_groups(x.reshape(-1), self.group_size)
        return x.view(-1, _channels(x.shape)).unflatten(1, (-1, self.group_size))

    def _packed_groups(self, payload: Payload) -> tuple[torch.Tensor, tuple[int, int]]:
        """The payload's packed codes, zero-extended to whole groups, and the groups' shape."""
        packed = payload.tensors["packed"]
        shape2d = (payload.tensors["scales"].numel(), self.group_size)
        missing = shape2d[0] * shape2d[1] // 2 - packed.numel()
        if missing:
            packed = torch.cat([packed, packed.new_zeros(missing)])
        return packed, shape2d

    @staticmethod
    def _ungroup(groups: torch.Tensor, payload: Payload) -> torch.Tensor:
        flat = groups.view(-1)
        return flat if flat.numel() == payload.numel else flat[: payload.numel]

    def _group_count(self, shape: torch.Size) -> int:
        return -(-shape.numel() // self.group_size)


class SymInt4(_FlatGroups):
    """Symmetric int4 in groups of `group_size` consecutive elements."""

    name = "sym_int4"

    def __init__(self, group_size: int = 64, backend: str | None = None):
        super().__init__(group_size, backend)

    def reads_in_place(self, x):
        # groups of whole rows: none spans two of them
        return _dense_rows(x) and _channels(x.shape) % self.group_size == 0

    def _encode(self, x, kernels):
        tensors, ok, raw_groups, _ = self._quantize(x, kernels)
        return {**tensors, **_exceptions(raw_groups, ok, dim=0, kernels=kernels)}

    def _quantize(self, x, kernels, zeroed=None):
        """Packed codes and scales, the usable-scale flags, a function giving the groups as
        they are stored raw where unusable (zeroed channels zeroed: built only if needed), and
        the zeroed channels' (indices, values) where the kernel copied them in its pass (else
        None).
        `zeroed`: (channels, mask) of channels to encode as zeros (OutlierInt4)."""
        if zeroed is not None and x.numel() % self.group_size:
            # the padding of the last group copies the last element, after zeroing
            x, zeroed = zero_channels(x.reshape(-1, zeroed[0]), zeroed), None
        groups = self._groups(x)
        packed, scales, ok, *exact = kernels.sym_encode(groups, 1, dtype_max(x.dtype), zeroed)
        tensors = {"packed": _keep(packed, _packed_bytes(x.numel())), "scales": scales}
        return (tensors, ok, lambda: zero_channels(groups, zeroed).reshape(-1, self.group_size),
                exact[0] if exact else None)

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(self._group_count(shape))

    def _decode(self, payload, kernels):
        packed, shape2d = self._packed_groups(payload)
        groups = kernels.sym_decode(packed, payload.tensors["scales"], shape2d, 1, payload.dtype)
        restore_exceptions(groups, payload.tensors, dim=0)
        return self._ungroup(groups, payload)


class OutlierInt4(SymInt4):
    """Outlier-separated int4 (paper: outlier-separated activation compression): channels
    (last dimension) whose z-score of sum |x| (over outlier.statistics_rows, a sample of the
    rows) exceeds `threshold` are kept exact with their
    indices; the tensor with those channels zeroed goes through sym_int4, untransposed."""

    name = "outlier_int4"
    separates_outliers = True

    def __init__(self, threshold: float = 3.0, group_size: int = 64, backend: str | None = None):
        super().__init__(group_size, backend)
        self.threshold = threshold

    def _encode(self, x, kernels):
        rows = x.reshape(-1, _channels(x.shape))
        is_outlier = kernels.outlier_channels(rows, self.threshold)
        zeroed = (rows.shape[1], is_outlier)
        tensors, ok, raw_groups, exact = self._quantize(rows, kernels, zeroed)
        # The indices a kernel took in its pass count the outliers; else the mask does, on the device.
        outliers = exact[0].numel() if exact is not None else is_outlier.count_nonzero()
        outliers, unusable = _read_counts(outliers, kernels.count_unusable(ok),
                                          bound=max(rows.shape[1], ok.numel()) + 1)
        if unusable:
            tensors.update(split_exceptions(raw_groups(), ok, 0, unusable))
        if outliers:
            if exact is None:  # not copied in the encoding pass: taken now
                index = torch.nonzero_static(is_outlier, size=outliers).view(-1)  # sized on the host: no sync
                exact = index, kernels.take_columns(rows, index)
            tensors.update(outlier_index=exact[0].to(INDEX_DTYPE), outlier_values=exact[1])
        return tensors

    def _payload_bytes(self, shape, dtype, outlier_channels):
        rows = shape.numel() // _channels(shape)
        exact = outlier_channels * (INDEX_DTYPE.itemsize + rows * dtype.itemsize)
        return super()._payload_bytes(shape, dtype, 0) + exact

    def _decode(self, payload, kernels):
        t, channels = payload.tensors, _channels(payload.shape)
        exact = (channels, t["outlier_index"].long(), t["outlier_values"]) if "outlier_index" in t else None
        if "raw_index" in t:  # raw groups hold the outlier channels zeroed: the exact values go on top after
            rows = super()._decode(payload, kernels).view(-1, channels)
            if exact is not None:
                kernels.put_columns(rows, *exact[1:])
            return rows
        packed, shape2d = self._packed_groups(payload)  # the exact channels written in the decoding pass
        return self._ungroup(kernels.sym_decode(packed, t["scales"], shape2d, 1, payload.dtype, exact), payload)


class AsymInt4(_FlatGroups):
    """Asymmetric int4 in groups of `group_size` consecutive elements, for tensors in (0, 1)
    such as softmax probabilities."""

    name = "asym_int4"

    def __init__(self, group_size: int = 128, backend: str | None = None):
        super().__init__(group_size, backend)

    def _encode(self, x, kernels):
        groups = self._groups(x)
        packed, scales, offsets, ok = kernels.asym_encode(groups, dtype_max(x.dtype))
        return {
            "packed": _keep(packed, _packed_bytes(x.numel())),
            "scales": scales,
            "offsets": offsets,
            **_exceptions(lambda: groups, ok, dim=0, kernels=kernels),
        }

    def _payload_bytes(self, shape, dtype, outlier_channels):
        groups = self._group_count(shape)
        return _packed_bytes(shape.numel()) + _scales_bytes(groups) + groups * dtype.itemsize  # offsets

    def _decode(self, payload, kernels):
        packed, shape2d = self._packed_groups(payload)
        t = payload.tensors
        groups = kernels.asym_decode(packed, t["scales"], t["offsets"], shape2d, payload.dtype)
        restore_exceptions(groups, t, dim=0)
        return self._ungroup(groups, payload)


class NaiveInt4(Codec):
    """The paper's "Quantization" baseline: symmetric int4 with one scale per token (row of
    the last dimension), applied to everything."""

    name = "naive_int4"

    def reads_in_place(self, x):
        return _dense_rows(x)

    def _encode(self, x, kernels):
        rows = x.reshape(-1, _channels(x.shape))
        packed, scales, ok = kernels.sym_encode(rows, 1, dtype_max(x.dtype))
        return {"packed": packed, "scales": scales,
                **_exceptions(lambda: rows, ok, dim=0, kernels=kernels)}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(shape.numel() // _channels(shape))

    def _decode(self, payload, kernels):
        t = payload.tensors
        rows_shape = (t["scales"].numel(), _channels(payload.shape))
        rows = kernels.sym_decode(t["packed"], t["scales"], rows_shape, 1, payload.dtype)
        restore_exceptions(rows, t, dim=0)
        return rows


class ChannelInt4(Codec):
    """Symmetric int4 with one scale per channel (last dimension), for Q, K and V."""

    name = "channel_int4"

    def _encode(self, x, kernels):
        rows = x.reshape(-1, _channels(x.shape))
        packed, scales, ok = kernels.sym_encode(rows, 0, dtype_max(x.dtype))
        return {"packed": packed, "scales": scales,
                **_exceptions(lambda: rows, ok, dim=1, kernels=kernels)}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(_channels(shape))

    def _decode(self, payload, kernels):
        t = payload.tensors
        rows_shape = (payload.numel // _channels(payload.shape), _channels(payload.shape))
        rows = kernels.sym_decode(t["packed"], t["scales"], rows_shape, 0, payload.dtype)
        restore_exceptions(rows, t, dim=1)
        return rows


class Bitmask(Codec):
    """Lossless bit-packed masks (dropout): 8 flags per byte. Accepts any dtype: bool masks
    (GPU dropout) or masks in the activation dtype holding 0 and one other value (CPU
    dropout saves 0 and 1/(1-p)); that value is kept as one scalar."""

    name = "bitmask"

    def _check(self, x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"codec {self.name!r} encodes a torch.Tensor, got {type(x).__name__}")

    def _encode(self, x, kernels):
        flat = x.reshape(-1)
        packed, value = kernels.mask_encode(flat)
        return {"packed": packed} if value is None else {"packed": packed, "mask_value": value}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        value_bytes = 0 if dtype == torch.bool else dtype.itemsize  # the mask's one value
        return -(-shape.numel() // 8) + value_bytes

    def _decode(self, payload, kernels):
        return kernels.mask_unpack(payload.tensors["packed"], payload.numel,
                                   payload.tensors.get("mask_value"))
