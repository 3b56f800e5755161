"""Codec.payload_bytes: the size a codec predicts from a shape, a dtype and an outlier
capacity equals encode(x).nbytes of a real input, byte for byte, finite or not."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_adacc import codecs

from helpers.codecs import with_outlier_channels

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Odd sizes, partial groups of 64 and 128, one row, many rows, more than two dimensions.
SHAPES = [(), (1,), (7,), (63,), (129,), (0, 4), (3, 5), (5, 65), (4, 96), (3, 130), (2, 3, 257),
          (1, 1000)]
OUTLIER_COUNTS = (0, 1, 3, 6)


def cases():
    for shape in SHAPES:
        channels = shape[-1] if shape else 1
        for k in OUTLIER_COUNTS:
            if k == 0 or 16 * k <= channels:
                yield shape, k


def with_non_finite(x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """x with a NaN, a +Inf and a -Inf in places that depend on the seed (fewer if small)."""
    x = x.clone()
    flat = x.view(-1)
    places = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))[:3]
    flat[places] = torch.tensor([math.nan, math.inf, -math.inf], dtype=x.dtype)[: places.numel()]
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("name", [n for n in codecs.NAMES if n != "bitmask"])
def test_int4_payload_bytes_equal_encoded_nbytes(name, dtype):
    # Finite inputs and inputs holding NaN and Inf: the same bytes, as predicted.
    for options in (({}, {"group_size": 16}) if name in ("sym_int4", "asym_int4", "outlier_int4")
                    else ({},)):
        for shape, k in cases():
            if k and name != "outlier_int4":
                continue
            codec = codecs.get(name, backend="torch", **options,
                               **({"capacity": k} if name == "outlier_int4" else {}))
            x = with_outlier_channels(shape, dtype, k)
            payload = codec.encode(x)
            if name == "outlier_int4" and k:
                # the input is what it claims
                assert payload.tensors["outlier_index"].ge(0).sum() == k
            assert codec.payload_bytes(shape, dtype, outlier_channels=k) == payload.nbytes, (
                shape, k, options)
            # at the codec's own capacity
            assert codec.payload_bytes(shape, dtype) == payload.nbytes
            if x.numel():
                assert codec.encode(with_non_finite(x)).nbytes == payload.nbytes, (
                    shape, k, options)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_outlier_payload_is_the_capacitys_whatever_the_outliers(dtype):
    # Fewer, as many and more outlier channels than the capacity: always the capacity's bytes.
    shape = (6, 160)
    for capacity in (0, 2, 5, 10):
        codec = codecs.get("outlier_int4", backend="torch", capacity=capacity)
        expected = codec.payload_bytes(shape, dtype, outlier_channels=capacity)
        assert expected == codec.payload_bytes(shape, dtype)
        for k in (0, 2, 5, 10):
            x = with_outlier_channels(shape, dtype, k)
            assert codec.encode(x).nbytes == expected, (capacity, k)
            assert codec.encode(with_non_finite(x)).nbytes == expected, (capacity, k)


@pytest.mark.parametrize("dtype", (torch.bool, *FLOAT_DTYPES))
def test_bitmask_payload_bytes_equal_encoded_nbytes(dtype):
    codec = codecs.get("bitmask", backend="torch")
    for shape in SHAPES:
        mask = with_outlier_channels(shape, torch.float32, 0) > 0
        x = mask if dtype == torch.bool else mask.to(dtype) / 0.9
        assert codec.payload_bytes(shape, dtype) == codec.encode(x).nbytes, shape
        if dtype != torch.bool and x.numel():  # no mask: a NaN value, the same bytes
            assert (codec.payload_bytes(shape, dtype)
                    == codec.encode(with_non_finite(x)).nbytes), shape


def test_outlier_count_is_for_the_outlier_codec_only():
    assert codecs.get("outlier_int4").payload_bytes((4, 64), torch.bfloat16, outlier_channels=2) > \
        codecs.get("sym_int4").payload_bytes((4, 64), torch.bfloat16)
    for name in ("sym_int4", "channel_int4", "bitmask"):
        with pytest.raises(ValueError, match="outlier channels"):
            codecs.get(name).payload_bytes((4, 64), torch.bfloat16, outlier_channels=1)
    with pytest.raises(ValueError, match="outlier channels"):  # more than there are channels
        codecs.get("outlier_int4").payload_bytes((4, 64), torch.bfloat16, outlier_channels=65)
