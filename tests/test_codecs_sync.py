"""On CUDA a host sync stalls the training stream. An encode may sync once (the one host read
of its data-dependent sizes: outlier channels and groups stored raw, or the mask check of a
float bitmask); a decode never. Counted on the CPU as the aten ops that sync on CUDA."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_adacc import codecs

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.masked_select}
INDEXING = {aten.index, aten.index_put, aten.index_put_}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        boolean_index = packet in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if packet in SYNCING or boolean_index:
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


def counted(fn, *args):
    with SyncCounter() as counter:
        result = fn(*args)
    return result, counter.syncs


def activation(name: str, dtype: torch.dtype) -> torch.Tensor:
    """Outlier channels, a NaN and an Inf, a partial last group; in fp16 a row near the
    dtype's maximum, whose groups are stored raw even after the outlier channels (NaN and Inf
    among them) are zeroed."""
    x = torch.randn(48, 100, generator=torch.Generator().manual_seed(2)) * 2
    x[:, [3, 60]] *= 200
    x[5, 7], x[20, 99] = math.nan, math.inf
    if dtype == torch.float16:
        x[10] = 65504.0  # its maximum: the int4 grid of max / 8, rounded up, overflows
    if name == "asym_int4":
        x = torch.sigmoid(x)
    elif name == "bitmask":
        x = (x > 0) / 0.9
    return x.to(dtype)


def assert_sync_free(backend: str, name: str, dtype: torch.dtype) -> None:
    codec = codecs.get(name, backend=backend)
    payload, encode_syncs = counted(codec.encode, activation(name, dtype))
    if name == "outlier_int4" and dtype == torch.float16:
        assert {"outlier_index", "raw_index"} <= payload.tensors.keys()  # both sizes were read
    assert len(encode_syncs) <= 1, encode_syncs
    _, decode_syncs = counted(codec.decode, payload)
    assert decode_syncs == [], decode_syncs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", codecs.NAMES)
def test_torch_backend_syncs_once_per_encode_and_never_in_decode(name, dtype):
    assert_sync_free("torch", name, dtype)


def test_the_counter_sees_syncs():
    _, syncs = counted(lambda t: (t[t > 0], t.nonzero(), bool(t.sum()), int(t.max())), torch.ones(4))
    assert len(syncs) >= 4
