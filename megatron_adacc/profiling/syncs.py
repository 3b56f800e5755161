"""Counts the ATen ops that would make the host wait for a CUDA device, on any device.

A host sync stops the host from queueing work ahead of the GPU. On a CPU nothing waits, so
the ops that would wait on CUDA are counted instead:

- ops that read a device value on the host (``item``, ``_local_scalar_dense``, ``equal``,
  ``is_nonzero``);
- ops whose output is sized by the data (``nonzero``, ``masked_select``, ``unique*``,
  boolean-mask indexing);
- copies from a device to the host.

Megatron's RNG tracker compares the CPU generator's state, a host tensor on every device,
when a fork ends. Those reads are left out: they wait for nothing.
"""
from __future__ import annotations

import collections
import os
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero"})
_SIZED_BY_DATA = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2",
                            "unique_dim", "unique_consecutive"})
_INDEXING = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_COPIES = frozenset({"_to_copy", "copy_"})
BOOLEAN_INDEX = "boolean mask index"
DEVICE_TO_HOST = "device to host copy"

# Code that reads tensors living on the host on every device.
HOST_STATE_READERS = (os.path.join("megatron", "core", "tensor_parallel", "random.py"),)


class SyncCounter(TorchDispatchMode):
    """Counts, by op name, the ops below it that would sync the host with a CUDA device.

    ``counts`` maps an op name (or BOOLEAN_INDEX, DEVICE_TO_HOST) to its count.
    """

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _kind(func.overloadpacket.__name__, args, kwargs)
        if kind is not None and not _reads_host_state():
            self.counts[kind] += 1
        return func(*args, **kwargs)


def _kind(name: str, args: tuple, kwargs: dict) -> str | None:
    if name in _READS or name in _SIZED_BY_DATA:
        return name
    if name in _INDEXING and _has_mask_index(args):
        return BOOLEAN_INDEX
    if name in _COPIES and _to_host(name, args, kwargs):
        return DEVICE_TO_HOST
    return None


def _has_mask_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices)


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    target = tensors[0].device if name == "copy_" else kwargs.get("device")
    return (target is not None and torch.device(target).type == "cpu"
            and tensors[-1].device.type != "cpu")


def _reads_host_state() -> bool:
    return any(frame.filename.endswith(HOST_STATE_READERS)
               for frame in traceback.extract_stack())
