"""Triton codec kernels, run on the CPU by the Triton interpreter, against the PyTorch reference:
payloads byte for byte, decoded tensors bit for bit.

TRITON_INTERPRET must be set before a @triton.jit kernel is defined, i.e. before
megatron_adacc.codecs.triton is imported. Setting it here, at collection, is harmless to the
other test modules: on a CPU nothing else runs Triton (inductor emits C++ there), and the
codecs import their Triton module only when the Triton backend is asked for.
"""
from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402
import zlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from megatron_adacc import codecs  # noqa: E402
from test_codecs import edge_tensors  # noqa: E402
from test_codecs_sync import assert_sync_free  # noqa: E402

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = [(1,), (7,), (128,), (3, 64), (33, 70), (16, 128), (4, 8, 96), (2, 3, 5, 129)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def assert_same_payload_and_output(name: str, x: torch.Tensor) -> None:
    reference = codecs.get(name, backend="torch")
    triton = codecs.get(name, backend="triton")
    expected, actual = reference.encode(x), triton.encode(x)
    assert expected.tensors.keys() == actual.tensors.keys()
    for key, tensor in expected.tensors.items():
        assert tensor.dtype == actual.tensors[key].dtype, key
        assert torch.equal(_bits(tensor), _bits(actual.tensors[key])), f"{name} {x.dtype} {tuple(x.shape)}: {key}"
    assert expected.nbytes == actual.nbytes
    assert torch.equal(_bits(reference.decode(expected)), _bits(triton.decode(actual)))


def test_kernels_are_interpreted():
    import triton  # noqa: F401

    from megatron_adacc.codecs.triton import sym_int4

    assert "megatron_adacc.codecs.triton" in sys.modules
    assert type(sym_int4._sym_encode_rows).__name__ == "InterpretedFunction", \
        "the Triton kernels were imported before TRITON_INTERPRET=1 was set"


@pytest.mark.parametrize("name", ["outlier_int4", "asym_int4", "sym_int4", "naive_int4", "channel_int4"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_random_inputs_byte_identical(name, dtype):
    # A seed of our own: str hashes change with every interpreter (PYTHONHASHSEED).
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name} {dtype}".encode()))
    for shape in SHAPES:
        x = torch.randn(shape, generator=gen) * 4
        if x.shape[-1] > 8:
            x[..., 5] *= 80  # an outlier channel
        flat = x.view(-1)
        if flat.numel() > 10:
            flat[[3, 10]] = torch.tensor([math.nan, -math.inf])
        if name == "asym_int4":
            x = torch.sigmoid(x)
        assert_same_payload_and_output(name, x.to(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_outlier_exact_channels_byte_identical(dtype):
    # The encoding pass zeroes the outlier channels as it loads them; the decoding pass writes
    # the exact channels back, unless groups are stored raw (then they go on top after).
    gen = torch.Generator().manual_seed(31)
    for shape in [(33, 70), (4, 8, 96), (64, 20)]:
        x = torch.randn(shape, generator=gen)
        x[..., [1, -1]] *= 300
        assert_same_payload_and_output("outlier_int4", x.to(dtype))
        x.view(-1)[9] = math.nan
        assert_same_payload_and_output("outlier_int4", x.to(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_rows_read_in_place_byte_identical(dtype):
    # Views whose rows lie a stride apart, read where they lie (Kernels.strided_rows): the
    # gate and up halves of a SwiGLU fc1 output (rows of whole 64-element groups: in place;
    # of 96, whose groups span rows: a copy, but naive_int4's rows of 96 in place), the up
    # half of every other row. Each half holds a NaN and an infinity that an encode of the
    # other reading past its rows would meet.
    gen = torch.Generator().manual_seed(29)
    for ffn in (128, 96):
        whole = torch.randn(5, 3, 2 * ffn, generator=gen) * 3
        whole[..., 5] *= 300  # an outlier channel of the gate half
        whole[2, 1, ffn + 1], whole[4, 0, 2 * ffn - 1] = math.nan, math.inf
        whole[1, 2, 3], whole[3, 0, ffn - 1] = math.nan, -math.inf
        x = whole.to(dtype)
        for view in (x[..., :ffn], x[..., ffn:], x.view(-1, 2 * ffn)[::2, ffn:]):
            for name in ("outlier_int4", "sym_int4", "naive_int4"):
                assert_same_payload_and_output(name, view)


@pytest.mark.parametrize("name", ["asym_int4", "sym_int4"])
def test_subnormal_bf16_inputs_byte_identical(name):
    # The interpreter's bf16 -> fp32 cast flushes subnormals; the kernels widen bf16 bits by
    # hand, as the reference (and a GPU) does. A subnormal row minimum is an asym offset.
    x = torch.full((2, 128), 0.3)
    x[0, 7], x[1, 3] = 5.8775e-39, -1.1e-38
    x[1, 9] = 2.0e-39
    assert_same_payload_and_output(name, x.to(torch.bfloat16))


@pytest.mark.parametrize("name", ["outlier_int4", "asym_int4", "sym_int4", "naive_int4"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(x=edge_tensors())
def test_edge_inputs_byte_identical(name, x):
    assert_same_payload_and_output(name, x)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_byte_identical(dtype):
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        keep = torch.rand(shape, generator=gen) > 0.1
        mask = keep if dtype == torch.bool else keep.to(dtype) / 0.9
        assert_same_payload_and_output("bitmask", mask.to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", codecs.NAMES)
def test_sync_once_per_encode_and_never_in_decode(name, dtype):
    assert_sync_free("triton", name, dtype)
