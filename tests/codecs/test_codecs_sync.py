"""On CUDA a host sync stalls the training stream: no encode or decode may read a device value
on the host, and none may size an output by the data (FakeTensorMode runs them without any).
Counted on the CPU as the aten ops that sync on CUDA."""
from __future__ import annotations


import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megatron_adacc import codecs

from helpers.codecs import activation, assert_sync_free, codec_options, counted


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
