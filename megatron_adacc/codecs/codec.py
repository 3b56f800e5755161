"""The codecs: each turns a tensor into a Payload and back, through one kernel backend."""
from __future__ import annotations

from typing import Sequence

import torch

from megatron_adacc.codecs.backend import kernels_for, resolve_backend
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.int4 import (
    INDEX_DTYPE,
    SCALE_DTYPE,
    check_float_input,
    pad_to_groups,
    zero_channels,
)
from megatron_adacc.codecs.outlier import outlier_channels
from megatron_adacc.codecs.payload import Payload


class Codec:
    """A codec: ``encode(tensor) -> Payload``, ``decode(payload) -> tensor``.

    - decode returns a contiguous tensor of the input's shape, dtype and device.
    - Both run without autograd and never keep a reference to the input.
    - A non-contiguous input is encoded as its contiguous copy would be. It is read in place where
      the codec and its kernels can (reads_in_place).
    - ``payload_bytes(shape, dtype)`` gives the payload's size without encoding anything."""

    name: str
    separates_outliers = False  # whether payload_bytes takes an outlier channel count

    def __init__(self, backend: str | None = None):
        self.backend = resolve_backend(backend)

    def encode(self, x: torch.Tensor) -> Payload:
        self._check(x)
        _check_storage(x, self.name)
        # Detached, nothing the codec computes from x records autograd: no torch.no_grad,
        # whose two context switches cost host time on every saved tensor. Nothing records for
        # a tensor that needs no grad, and a detach costs a tensor made.
        if x.requires_grad:
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
        kernels = kernels_for(self.backend, payload.device)  # the payload records no autograd
        out, shape = self._decode(payload, kernels), payload.shape
        # The sizes as ints: torch parses a torch.Size argument a microsecond slower.
        return out.view(*shape) if shape else out.view(shape)

    def payload_bytes(self, shape: Sequence[int], dtype: torch.dtype,
                      outlier_channels: int | None = None) -> int:
        """``encode(x).nbytes`` for every x of this shape and dtype, finite or not.

        Args:
            outlier_channels: outlier_int4's capacity of exact channels to size the payload at;
                None: this codec's own (OutlierInt4.capacity_for). Other codecs take 0.
        """
        shape = torch.Size(shape)
        if outlier_channels is None:
            outlier_channels = self._capacity(shape)
        if not 0 <= outlier_channels <= (_channels(shape) if self.separates_outliers else 0):
            raise ValueError(f"codec {self.name!r} cannot keep {outlier_channels} outlier channels "
                             f"of a tensor of shape {tuple(shape)}")
        if not shape.numel():
            return 0
        return self._payload_bytes(shape, dtype, outlier_channels)

    def _capacity(self, shape: torch.Size) -> int:
        return 0

    def reads_in_place(self, x: torch.Tensor) -> bool:
        """Whether this codec's encode reads a non-contiguous ``x`` where it lies.

        That takes kernels that read strided rows (Kernels.strided_rows)."""
        return False

    def _check(self, x: torch.Tensor) -> None:
        check_float_input(x, self.name)

    def _payload_bytes(self, shape: torch.Size, dtype: torch.dtype, outlier_channels: int) -> int:
        raise NotImplementedError

    def _encode(self, x: torch.Tensor, kernels: Kernels) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _decode(self, payload: Payload, kernels: Kernels) -> torch.Tensor:
        raise NotImplementedError


def _check_storage(x: torch.Tensor, name: str) -> None:
    """ValueError when ``x`` reads past its storage, as when the storage was freed after forward.

    Megatron's selective recompute frees what it recomputes. The kernels read raw memory, so
    this check stands between such a tensor and a crash. It reads metadata only, no device value."""
    numel = x.numel()
    if numel == 0:
        return
    if x.is_contiguous():  # the common case, without a stride tuple walked
        extent = x.storage_offset() + numel
    else:
        extent = x.storage_offset() + 1 + sum((size - 1) * stride
                                              for size, stride in zip(x.shape, x.stride()))
    held = x.untyped_storage().nbytes()
    if extent * x.element_size() > held:
        raise ValueError(f"codec {name!r}: a {tuple(x.shape)} tensor reads "
                         f"{extent * x.element_size()} bytes of a {held}-byte storage (freed "
                         f"after forward?)")


def _channels(shape: torch.Size) -> int:
    return shape[-1] if len(shape) else 1


def _dense_rows(x: torch.Tensor) -> bool:
    """Whether ``x`` is dense rows of its last dimension, a stride apart: [rows, channels].

    A slice of the last dimension, such as SwiGLU's gate half, is such a tensor."""
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


def _keep(t: torch.Tensor, numel: int) -> torch.Tensor:
    # A slice would pin its whole base tensor; copy it so nbytes is what stays alive.
    return t if t.numel() == numel else t[:numel].clone()


class _FlatGroups(Codec):
    """Base of the codecs that cut the flattened tensor into groups of ``group_size`` elements.

    The groups are consecutive in memory order: no transpose, and the last group is padded."""

    def __init__(self, group_size: int, backend: str | None = None):
        super().__init__(backend)
        if group_size < 2 or group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2, got {group_size}")
        self.group_size = group_size

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """The groups as [groups, group_size], or over rows where they lie for in-place reads.

        A tensor read in place (reads_in_place) gives [rows, groups a row, group_size]."""
        if x.is_contiguous():
            if x.numel() % self.group_size == 0:
                return x.view(-1, self.group_size)  # one view: each costs a microsecond
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
        # decode views the result as the payload's shape: whole groups need no view here
        return groups if groups.numel() == payload.numel else groups.view(-1)[: payload.numel]

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
        return self._quantize(x, kernels)[0]

    def _quantize(self, x, kernels, zeroed=None):
        """(packed codes and scales, the zeroed channels' exact values where the kernels took them).

        ``zeroed``: (channels, selected mask, index) of channels to encode as zeros
        (OutlierInt4). The exact values are None without ``zeroed``, or where the codec must take
        them itself."""
        values = None
        if zeroed is not None and x.numel() % self.group_size:
            # the padding of the last group copies the last element, after zeroing
            rows = x.reshape(-1, zeroed[0])
            values = kernels.take_columns(rows, zeroed[2])
            x, zeroed = zero_channels(rows, zeroed), None
        packed, scales, *exact = kernels.sym_encode(self._groups(x), 1, zeroed)
        tensors = {"packed": _keep(packed, _packed_bytes(x.numel())), "scales": scales}
        return tensors, exact[0] if exact else values

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(self._group_count(shape))

    def _decode(self, payload, kernels, exact=None):
        packed, shape2d = self._packed_groups(payload)
        groups = kernels.sym_decode(packed, payload.tensors["scales"], shape2d, 1, payload.dtype,
                                    exact)
        return self._ungroup(groups, payload)


# Without a capacity given, outlier_int4 keeps up to this share of a tensor's channels exact.
DEFAULT_CAPACITY_SHARE = 64


class OutlierInt4(SymInt4):
    """Outlier-separated int4 (paper: outlier-separated activation compression).

    Outlier channels (last dimension) are kept exact with their indices. A channel is an outlier
    when the z-score of its sum |x| exceeds ``threshold``; the sum runs over
    outlier.statistics_rows, a sample of the rows. At most ``capacity`` channels are kept, the first
    in channel order; the rest go through int4 with the others. The tensor with the kept channels
    zeroed goes through sym_int4, untransposed.

    The capacity fixes the payload whatever the data. A planner sizes it from the profile's largest
    outlier count, and the rectifier raises it. None means capacity_for's default: one channel in
    DEFAULT_CAPACITY_SHARE. Unused slots hold index -1 and zero values.
    """

    name = "outlier_int4"
    separates_outliers = True

    def __init__(self, threshold: float = 3.0, group_size: int = 64, capacity: int | None = None,
                 backend: str | None = None):
        super().__init__(group_size, backend)
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.threshold = threshold
        self.capacity = capacity

    def capacity_for(self, shape: Sequence[int]) -> int:
        """The exact channels a payload of a ``shape`` tensor holds: the capacity, at most all."""
        channels = _channels(torch.Size(shape))
        wanted = channels // DEFAULT_CAPACITY_SHARE if self.capacity is None else self.capacity
        return min(wanted, channels)

    def _capacity(self, shape):
        return self.capacity_for(shape)

    def outlier_count(self, x: torch.Tensor) -> torch.Tensor:
        """How many channels of ``x`` are outliers by the z-score rule, capacity aside.

        It returns a 0-d tensor on x's device. Reading it syncs, so it is for tracking, outside
        the step."""
        with torch.no_grad():
            rows = x.detach().reshape(-1, _channels(x.shape))
            return outlier_channels(rows, self.threshold).sum() if rows.numel() else \
                torch.zeros((), dtype=torch.int64, device=x.device)

    def _encode(self, x, kernels):
        capacity = self.capacity_for(x.shape)
        if not capacity:
            return super()._encode(x, kernels)
        rows = x.reshape(-1, _channels(x.shape))
        selected, index = kernels.outlier_select(rows, self.threshold, capacity)
        tensors, values = self._quantize(rows, kernels, (rows.shape[1], selected, index))
        if values is None:  # not copied in the encoding pass: taken now
            values = kernels.take_columns(rows, index)
        return {**tensors, "outlier_index": index, "outlier_values": values}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        rows = shape.numel() // _channels(shape)
        exact = outlier_channels * (INDEX_DTYPE.itemsize + rows * dtype.itemsize)
        return super()._payload_bytes(shape, dtype, 0) + exact

    def _decode(self, payload, kernels, exact=None):
        t = payload.tensors
        if "outlier_index" in t:  # the exact channels, written in the decoding pass
            exact = (_channels(payload.shape), t["outlier_index"], t["outlier_values"])
        return super()._decode(payload, kernels, exact)


class AsymInt4(_FlatGroups):
    """Asymmetric int4 in groups of ``group_size``, for values in (0, 1) such as softmax's."""

    name = "asym_int4"

    def __init__(self, group_size: int = 128, backend: str | None = None):
        super().__init__(group_size, backend)

    def _encode(self, x, kernels):
        packed, scales, offsets = kernels.asym_encode(self._groups(x))
        return {"packed": _keep(packed, _packed_bytes(x.numel())), "scales": scales,
                "offsets": offsets}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        groups = self._group_count(shape)
        return (_packed_bytes(shape.numel()) + _scales_bytes(groups)
                + groups * dtype.itemsize)  # offsets

    def _decode(self, payload, kernels):
        packed, shape2d = self._packed_groups(payload)
        t = payload.tensors
        groups = kernels.asym_decode(packed, t["scales"], t["offsets"], shape2d, payload.dtype)
        return self._ungroup(groups, payload)


class NaiveInt4(Codec):
    """The paper's "Quantization" baseline: symmetric int4 with one scale per token, on everything.

    A token is a row of the last dimension."""

    name = "naive_int4"

    def reads_in_place(self, x):
        return _dense_rows(x)

    def _encode(self, x, kernels):
        packed, scales = kernels.sym_encode(x.reshape(-1, _channels(x.shape)), 1)
        return {"packed": packed, "scales": scales}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(shape.numel() // _channels(shape))

    def _decode(self, payload, kernels):
        t = payload.tensors
        rows_shape = (t["scales"].numel(), _channels(payload.shape))
        return kernels.sym_decode(t["packed"], t["scales"], rows_shape, 1, payload.dtype)


class ChannelInt4(Codec):
    """Symmetric int4 with one scale per channel (last dimension), for Q, K and V."""

    name = "channel_int4"

    def _encode(self, x, kernels):
        packed, scales = kernels.sym_encode(x.reshape(-1, _channels(x.shape)), 0)
        return {"packed": packed, "scales": scales}

    def _payload_bytes(self, shape, dtype, outlier_channels):
        return _packed_bytes(shape.numel()) + _scales_bytes(_channels(shape))

    def _decode(self, payload, kernels):
        t = payload.tensors
        rows_shape = (payload.numel // _channels(payload.shape), _channels(payload.shape))
        return kernels.sym_decode(t["packed"], t["scales"], rows_shape, 0, payload.dtype)


class Bitmask(Codec):
    """Lossless bit-packed masks (dropout): 8 flags per byte.

    It accepts any dtype: bool masks (GPU dropout), or masks in the activation dtype holding 0
    and one other value (CPU dropout saves 0 and 1/(1-p)). That value is kept as one scalar. It
    is NaN if the tensor is no such mask, checked on the device (bitmask.mask_value)."""

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
