"""On CUDA a host sync stalls the training stream: no encode or decode may read a device value
on the host, and none may size an output by the data (FakeTensorMode runs them without any).
Counted on the CPU as the aten ops that sync on CUDA."""
from __future__ import annotations

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_adacc import codecs
from megatron_adacc.profiling.syncs import SyncCounter


def counted(fn, *args):
    with SyncCounter() as counter:
        result = fn(*args)
    return result, dict(counter.counts)


def activation(name: str, dtype: torch.dtype, rows: int = 48) -> torch.Tensor:
    """Outlier channels, a NaN and an Inf, groups across rows (a partial last one for 47
    rows: outlier_int4 then zeroes its channels before grouping); in fp16 a row at the
    dtype's maximum, whose int4 grid reaches past it (the decode saturates)."""
    x = torch.randn(rows, 100, generator=torch.Generator().manual_seed(2)) * 2
    x[:, [3, 60]] *= 200
    x[5, 7], x[20, 99] = math.nan, math.inf
    if dtype == torch.float16:
        x[10] = 65504.0
    if name == "asym_int4":
        x = torch.sigmoid(x)
    elif name == "bitmask":
        x = (x > 0) / 0.9
    return x.to(dtype)


def codec_options(name: str) -> dict:
    # capacity 1 of 100 channels: more outliers than it holds (channel 7 is NaN: one too)
    return {"capacity": 1} if name == "outlier_int4" else {}


def assert_sync_free(backend: str, name: str, dtype: torch.dtype, rows: int = 48) -> None:
    codec = codecs.get(name, backend=backend, **codec_options(name))
    x = activation(name, dtype, rows)
    payload, encode_syncs = counted(codec.encode, x)
    assert encode_syncs == {}, encode_syncs
    assert payload.nbytes == codec.payload_bytes(x.shape, x.dtype)
    _, decode_syncs = counted(codec.decode, payload)
    assert decode_syncs == {}, decode_syncs


ROWS = pytest.mark.parametrize("rows", [48, 47])


@ROWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", codecs.NAMES)
def test_torch_backend_never_syncs(name, dtype, rows):
    assert_sync_free("torch", name, dtype, rows)


def assert_runs_on_fake_tensors(backend: str, name: str, dtype: torch.dtype, rows: int) -> None:
    """encode and decode under FakeTensorMode: no data read, no data-dependent shape; the
    fake payload's tensors have the real one's shapes and dtypes."""
    codec = codecs.get(name, backend=backend, **codec_options(name))
    real = activation(name, dtype, rows)
    expected = codec.encode(real)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(real)
        payload = codec.encode(x)
        decoded = codec.decode(payload)
    assert {k: (t.shape, t.dtype) for k, t in payload.tensors.items()} == \
        {k: (t.shape, t.dtype) for k, t in expected.tensors.items()}
    assert payload.nbytes == codec.payload_bytes(real.shape, real.dtype)
    assert (decoded.shape, decoded.dtype) == (real.shape, real.dtype)


@ROWS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", codecs.NAMES)
def test_torch_backend_runs_on_fake_tensors(name, dtype, rows):
    assert_runs_on_fake_tensors("torch", name, dtype, rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", codecs.NAMES)
@ROWS
def test_native_backend_never_syncs_and_keeps_the_shapes(name, dtype, rows):
    # The native kernels read CPU memory through data_ptr, which fake tensors do not have, so
    # FakeTensorMode cannot run them (nor Triton's wrappers, whose interpreter reads the data
    # on the host): the shapes they give are checked against the reference's instead, and
    # their Python side against the sync counter.
    assert_sync_free("native", name, dtype, rows)
    options = codec_options(name)
    x = activation(name, dtype, rows)
    reference = codecs.get(name, backend="torch", **options).encode(x)
    payload = codecs.get(name, backend="native", **options).encode(x)
    assert {k: (t.shape, t.dtype) for k, t in payload.tensors.items()} == \
        {k: (t.shape, t.dtype) for k, t in reference.tensors.items()}


def test_the_counter_sees_syncs():
    t = torch.ones(4)
    _, syncs = counted(lambda t: (t[t > 0], t.nonzero(), bool(t.sum()), int(t.max()),
                                  torch.equal(t, t), t.unique(), t.masked_select(t > 0)), t)
    assert sum(syncs.values()) >= 7, syncs
