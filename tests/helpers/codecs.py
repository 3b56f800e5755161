"""Inputs and assertions the codec tests share: hypothesis strategies, reference
comparisons, sync counts and activations with outlier channels."""
from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from megatron_adacc import codecs
from megatron_adacc.profiling.syncs import SyncCounter

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------- strategies

@st.composite
def shapes(draw, max_dims=3, max_side=40):
    """Shapes of up to ``max_dims`` sides of 0 to ``max_side``."""
    return tuple(draw(st.lists(st.integers(0, max_side), min_size=0, max_size=max_dims)))


def _finite_elements(dtype):
    bound = float(torch.finfo(dtype).max)
    width = 16 if dtype == torch.float16 else 32
    return st.floats(-bound, bound, allow_nan=False, allow_infinity=False, width=width)


@st.composite
def edge_tensors(draw, dtypes=FLOAT_DTYPES):
    """Tensors whose values hypothesis picks one by one: zeros, subnormals, dtype maxima."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes(max_side=12))
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    values = draw(hnp.arrays(np_dtype, shape, elements=_finite_elements(dtype)))
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


# ---------------------------------------------------------------------------- comparisons

def assert_same_as_eager(backend: str, name: str, x: torch.Tensor, **options) -> None:
    """``backend``'s payload bytes and decoded tensor are the eager reference's."""
    eager, fast = (codecs.get(name, backend="torch", **options),
                   codecs.get(name, backend=backend, **options))
    expected, actual = eager.encode(x), fast.encode(x)
    assert expected.tensors.keys() == actual.tensors.keys()
    for key, tensor in expected.tensors.items():
        assert tensor.dtype == actual.tensors[key].dtype, key
        assert torch.equal(tensor.reshape(-1).view(torch.uint8),
                           actual.tensors[key].reshape(-1).view(torch.uint8)), key
    assert_same_decoded(eager.decode(expected), fast.decode(actual))


def assert_same_decoded(expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Bit for bit, but NaN matches any NaN: a NaN-scale group's decoded NaN bits are not part
    of the format (they depend on the device's arithmetic and casts)."""
    assert torch.equal(expected.isnan(), actual.isnan())
    keep = ~expected.isnan()
    assert torch.equal(expected[keep].view(torch.uint8) if expected.dtype == torch.bool else
                       expected[keep].reshape(-1, 1).view(torch.uint8),
                       actual[keep].view(torch.uint8) if actual.dtype == torch.bool else
                       actual[keep].reshape(-1, 1).view(torch.uint8))


# ---------------------------------------------------------------------------- host syncs

def counted(fn, *args):
    """(``fn(*args)``, the syncing aten ops it ran, by name)."""
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
    """Encode and decode of ``activation`` run no syncing op; the payload is the predicted size."""
    codec = codecs.get(name, backend=backend, **codec_options(name))
    x = activation(name, dtype, rows)
    payload, encode_syncs = counted(codec.encode, x)
    assert encode_syncs == {}, encode_syncs
    assert payload.nbytes == codec.payload_bytes(x.shape, x.dtype)
    _, decode_syncs = counted(codec.decode, payload)
    assert decode_syncs == {}, decode_syncs


# ---------------------------------------------------------------------------- payload sizes

def with_outlier_channels(shape, dtype, k: int, seed: int = 0) -> torch.Tensor:
    """A finite tensor of `shape` whose last dimension has exactly k outlier channels for
    outlier_int4's z-score rule: every other channel has the same sum of |x| (rows scaled
    alike, signs random), the k outliers 1000 times as much. With k <= channels / 16 their
    z-score is at least sqrt(15) > 3."""
    shape = torch.Size(shape)
    channels = shape[-1] if len(shape) else 1
    assert 16 * k <= channels or k == 0
    gen = torch.Generator().manual_seed(seed)
    rows = shape.numel() // channels if channels else 0
    signs = torch.randint(0, 2, (rows, channels), generator=gen).float() * 2 - 1
    x = signs * torch.linspace(0.1, 1.0, rows).unsqueeze(1)
    x[:, torch.randperm(channels, generator=gen)[:k]] *= 1000
    return x.reshape(shape).to(dtype)
