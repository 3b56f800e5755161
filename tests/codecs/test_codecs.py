"""Activation codecs: round trips, error bounds, payload sizes, special values, wrong inputs.

Everything here runs the eager PyTorch reference; the test_native_* tests check the native C
kernels against it and tests/codecs/test_codecs_triton.py the Triton kernels.
"""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_adacc import codecs
from megatron_adacc.codecs import native, symmetric
from megatron_adacc.codecs.int4 import ceil_to_bf16

from helpers.codecs import FLOAT_DTYPES, assert_same_as_eager, edge_tensors, shapes

INT4_CODECS = ("outlier_int4", "channel_int4", "asym_int4", "sym_int4", "naive_int4")
PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- strategies

@st.composite
def activation_tensors(draw, dtypes=FLOAT_DTYPES):
    """Activation-like tensors: scaled normal data, sometimes with outlier channels, constant
    or all-zero rows, in any layout (possibly a non-contiguous view)."""
    dtype = draw(st.sampled_from(dtypes))
    rows, cols = draw(st.integers(1, 48)), draw(st.integers(1, 80))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(rows, cols, generator=gen) * 10.0 ** draw(st.integers(-6, 3))
    n_outliers = draw(st.integers(0, 3))
    if n_outliers and cols > 8:
        x[:, torch.randperm(cols, generator=gen)[:n_outliers]] *= draw(st.sampled_from([30.0, 1e3]))
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = draw(st.sampled_from([0.0, 1.5, -3.0]))
    dtype_max = torch.finfo(dtype).max  # fp16 overflows at 65504: stay finite here
    x = x.clamp(-dtype_max, dtype_max).to(dtype)
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if layout == "transposed":
        x = x.t()
    elif layout == "strided":
        x = x[:, ::2]
    return x


def _positive(x):
    """Map onto (0, 1) like softmax probabilities, for the asymmetric codec."""
    return torch.sigmoid(x.float()).to(x.dtype)


# ------------------------------------------------------------------------------ helpers

def element_step(codec, payload) -> torch.Tensor:
    """|scale| that applies to each decoded element: 0 where the element must be exact
    (outlier_int4's exact channels), NaN in a group stored with a NaN scale (it held NaN or
    Inf: every element decodes NaN)."""
    t = payload.tensors
    n = payload.numel
    if n == 0:
        return torch.zeros(payload.shape)
    channels = payload.shape[-1] if len(payload.shape) else 1
    scales = t["scales"].float().abs()
    if codec.name == "channel_int4":
        return scales.expand(n // channels, channels).reshape(payload.shape)
    group = channels if codec.name == "naive_int4" else codec.group_size
    step = scales.repeat_interleave(group)[:n].reshape(-1, channels)
    if "outlier_index" in t:
        index = t["outlier_index"].long()
        step[:, index[index >= 0]] = 0
    return step.reshape(payload.shape)


def assert_within_bound(codec, x, payload, x_hat):
    """|x - x_hat| <= |scale| / 2 plus the rounding of the output dtype, element by element,
    where the scale is finite; NaN where it is NaN (a group that held NaN or Inf); x itself
    where the element is exact."""
    x32, xh32 = x.float(), x_hat.float()
    step = element_step(codec, payload)
    flagged = torch.isnan(step)
    assert bool(torch.isnan(xh32[flagged]).all()), (
        f"{codec.name}: a NaN-scale group decoded a number"
    )
    exact = step == 0
    assert torch.equal(x32[exact & ~torch.isfinite(x32)].nan_to_num(),
                       xh32[exact & ~torch.isfinite(x32)].nan_to_num()), \
        f"{codec.name}: an exact non-finite element changed"
    assert not bool((torch.isinf(xh32) & ~exact).any()), f"{codec.name}: a decoded value overflowed"
    finfo = torch.finfo(x.dtype)
    # Half a step; a hair more where a tie is decided by x * (1 / scale) + bias, three fp32
    # roundings (under 2^-18 of a step: |x / scale| <= 8); and one rounding of the decoded
    # value to the output dtype (relative eps, or absolute near the subnormals).
    bound = step / 2 * (1 + 2**-17) + (xh32.abs() * finfo.eps + finfo.smallest_normal * finfo.eps)
    err = (x32 - xh32).abs()
    ok = (err <= bound) | flagged | exact & ~torch.isfinite(x32)
    assert bool(ok.all()), (
        f"{codec.name} {x.dtype}: worst excess {(err - bound)[~ok].max().item()} "
        f"at {(~ok).nonzero()[:3].tolist()}"
    )
    # Every non-finite input element is exact or in a flagged group: it decodes non-finite.
    assert bool((exact | flagged)[~torch.isfinite(x32)].all()), (
        f"{codec.name}: a non-finite input was lost"
    )


def round_trip(name, x, **options):
    codec = codecs.get(name, backend="torch", **options)
    payload = codec.encode(x)
    return codec, payload, codec.decode(payload)


def _prepare(name, x):
    return _positive(x) if name == "asym_int4" else x


# -------------------------------------------------------------------------------- tests

def test_registry_names_and_errors(monkeypatch):
    assert set(codecs.NAMES) == {"outlier_int4", "channel_int4", "asym_int4", "sym_int4", "bitmask",
                                 "naive_int4"}
    with pytest.raises(ValueError, match="unknown codec"):
        codecs.get("zstd")
    with pytest.raises(ValueError, match="unknown codec backend"):
        codecs.get("sym_int4", backend="cuda")
    monkeypatch.setenv(codecs.BACKEND_ENV_VAR, "native")
    assert codecs.get("sym_int4").backend == "native"
    assert codecs.get("sym_int4", backend="torch").backend == "torch"
    assert codecs.get("sym_int4", group_size=32).group_size == 32
    assert codecs.get("outlier_int4", threshold=2.0).threshold == 2.0


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("name", codecs.NAMES)
def test_a_tensor_whose_storage_was_freed_is_refused_not_read(name, backend):
    # Megatron's selective recompute frees a checkpointed output's storage after forward; the
    # native outlier kernel read such a tensor's freed memory and crashed the process.
    x = torch.randn(8, 64) > 0 if name == "bitmask" else torch.randn(8, 64)
    x.untyped_storage().resize_(0)
    with pytest.raises(ValueError) as info:
        codecs.get(name, backend=backend).encode(x)
    assert str(info.value) == (f"codec {name!r}: a (8, 64) tensor reads {512 * x.element_size()} "
                               f"bytes of a 0-byte storage (freed after forward?)")


@pytest.mark.parametrize("name", INT4_CODECS)
@PROPERTY
@given(x=activation_tensors())
def test_round_trip_within_half_step(name, x):
    x = _prepare(name, x)
    codec, payload, x_hat = round_trip(name, x)
    assert (x_hat.shape, x_hat.dtype, x_hat.device) == (x.shape, x.dtype, x.device)
    assert (payload.shape, payload.dtype, payload.device) == (x.shape, x.dtype, x.device)
    assert_within_bound(codec, x, payload, x_hat)


@pytest.mark.parametrize("name", INT4_CODECS)
@PROPERTY
@given(x=edge_tensors())
def test_edge_values_within_half_step(name, x):
    # Subnormals, zeros, +-dtype max, sizes 0 and 1, shapes that are no multiple of a group.
    codec, payload, x_hat = round_trip(name, x)
    assert x_hat.shape == x.shape and x_hat.dtype == x.dtype
    flagged = torch.isnan(element_step(codec, payload))
    if bool(flagged.any()):  # asym_int4's one edge: a group's grid beyond fp32
        assert name == "asym_int4" and x.dtype in (torch.float32, torch.bfloat16)
        assert x.max().double() - x.min().double() > 3.38e38
    assert bool(torch.isfinite(x_hat[~flagged]).all()), (
        "a finite input decoded to a non-finite value"
    )
    assert_within_bound(codec, x, payload, x_hat)


@pytest.mark.parametrize("name", INT4_CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@PROPERTY
@given(data=st.data())
def test_non_finite_groups_decode_nan(name, dtype, data):
    # A group holding NaN or +-Inf stores a NaN scale and decodes NaN throughout (fp16 loss
    # scaling still sees the overflow); an exact outlier channel keeps its value; every
    # other group keeps the bound, and the payload keeps its predicted size.
    x = _prepare(name, data.draw(activation_tensors(dtypes=(dtype,)))).contiguous()
    flat = x.view(-1)
    where = data.draw(st.lists(st.integers(0, flat.numel() - 1), min_size=1, max_size=4,
                               unique=True))
    specials = data.draw(st.lists(st.sampled_from([math.nan, math.inf, -math.inf]),
                                  min_size=len(where), max_size=len(where)))
    flat[where] = torch.tensor(specials, dtype=dtype)
    codec, payload, x_hat = round_trip(name, x)
    step = element_step(codec, payload)
    exact = step == 0
    assert torch.equal(torch.isnan(x_hat), torch.isnan(step) | exact & torch.isnan(x))
    assert torch.equal(torch.isinf(x_hat), exact & torch.isinf(x))
    assert_within_bound(codec, x, payload, x_hat)
    assert payload.nbytes == codec.payload_bytes(x.shape, x.dtype)


@pytest.mark.parametrize("name", INT4_CODECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_zero_and_constant_tensors(name, dtype):
    for shape in [(0,), (0, 5), (), (1,), (3, 130)]:
        zeros = torch.zeros(shape, dtype=dtype)
        assert torch.equal(round_trip(name, zeros)[2], zeros)
        constant = torch.full(shape, 0.3, dtype=dtype)
        codec, payload, x_hat = round_trip(name, constant)
        assert_within_bound(codec, constant, payload, x_hat)


def test_sym_scale_follows_paper_rule():
    # max|x| / 8 with the group's sign folded in: the extreme element gets code -8.
    x = torch.tensor([0.5, -1.0, 2.0, 4.0] * 16)  # one group of 64, positive extreme
    codec, payload, x_hat = round_trip("sym_int4", x)
    scale = payload.tensors["scales"].float()
    assert scale.item() == -ceil_to_bf16(torch.tensor([4.0 / 8])).item()
    assert payload.tensors["packed"][1].item() & 0xF0 == 0  # element 3 (value 4.0) -> code -8 + 8
    assert x_hat[3].item() == 4.0


def test_sym_scales_depend_only_on_the_sym_bounds():
    # The native kernels give symmetric.sym_scales a group's sym bounds, min(lo, -0) and
    # max(hi, +0), where the reference gives its range (codecs.c): the same scales, bit for
    # bit, for every pair of finite lo <= hi, zeros of either sign, subnormals and values at
    # each dtype's limit included.
    gen = torch.Generator().manual_seed(3)
    edges = [0.0, 1e-45, 1e-40, 1.1754943508222875e-38, 1e-38, 0.1, 1.0, 7.5, 8.0, 15.0, 448.0,
             65504.0, 3e38, 3.4028234663852886e38]
    randoms = (torch.randn(200, generator=gen)
               * torch.exp(torch.randn(200, generator=gen) * 20)).tolist()
    values = torch.tensor(edges + [-v for v in edges] + randoms).float()
    lo, hi = (v.reshape(-1) for v in torch.meshgrid(values, values, indexing="ij"))
    lo, hi = lo[lo <= hi], hi[lo <= hi]
    bound_lo = torch.where(torch.signbit(lo), lo, -0.0)
    bound_hi = torch.where(torch.signbit(hi), 0.0, hi)
    scale = symmetric.sym_scales(lo, hi)
    assert bool(torch.isfinite(scale).all())  # every finite group has a finite scale
    assert torch.equal(scale.view(torch.int32),
                       symmetric.sym_scales(bound_lo, bound_hi).view(torch.int32))


def test_outlier_channels_are_exact_and_listed():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=gen).to(torch.bfloat16)
    x[:, [7, 50]] *= 100
    codec, payload, x_hat = round_trip("outlier_int4", x, capacity=3)
    assert payload.tensors["outlier_index"].tolist() == [7, 50, -1]  # an empty slot last
    assert payload.tensors["outlier_values"][:, 2].view(torch.int16).eq(0).all()  # +0
    assert torch.equal(x_hat[:, [7, 50]], x[:, [7, 50]])
    assert_within_bound(codec, x, payload, x_hat)
    # Threshold is configurable: a huge threshold keeps nothing exact, in the same bytes.
    _, payload_none, _ = round_trip("outlier_int4", x, threshold=1e9, capacity=3)
    assert payload_none.tensors["outlier_index"].tolist() == [-1, -1, -1]
    assert payload_none.nbytes == payload.nbytes


def test_outliers_beyond_the_capacity_go_through_int4():
    # More outlier channels than the capacity: the first in channel order are exact, the
    # rest are quantised with the others (their groups' bound), payload at the capacity.
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(32, 128, generator=gen)
    x[:, [3, 40, 41, 100]] *= 100
    for capacity in (0, 1, 2, 4, 6):
        codec, payload, x_hat = round_trip("outlier_int4", x, capacity=capacity)
        kept = [3, 40, 41, 100][:capacity]
        index = payload.tensors.get("outlier_index", torch.empty(0, dtype=torch.int32))
        assert index.tolist() == kept + [-1] * (capacity - len(kept))
        assert torch.equal(x_hat[:, kept], x[:, kept])
        assert payload.nbytes == codec.payload_bytes(x.shape, x.dtype) == \
            codecs.get("sym_int4").payload_bytes(x.shape, x.dtype) + capacity * (4 + 32 * 4)
        assert_within_bound(codec, x, payload, x_hat)
    # Without a capacity given: one channel in DEFAULT_CAPACITY_SHARE (2 of 128).
    assert codecs.get("outlier_int4").capacity_for(x.shape) == 128 // 64
    # at most every channel
    assert codecs.get("outlier_int4", capacity=500).capacity_for(x.shape) == 128
    assert int(codecs.get("outlier_int4", capacity=1).outlier_count(x)) == 4


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_outlier_channels_are_chosen_from_every_kth_row(backend):
    # Past 2 * STATISTICS_ROWS rows the channel sums read every k-th row only: the planted
    # channels are found, a channel large only in rows the sample skips is not separated (its
    # groups still meet the int4 bound), and the payload equals the reference's byte for byte.
    from megatron_adacc.codecs.outlier import STATISTICS_ROWS
    rows = 4 * STATISTICS_ROWS  # k = 4: rows 0, 4, 8, ... are read
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, 96, generator=gen)
    x[:, [7, 50]] *= 100
    x[1::4, 20] *= 100
    codec = codecs.get("outlier_int4", backend=backend, capacity=3)
    payload = codec.encode(x)
    assert payload.tensors["outlier_index"].tolist() == [7, 50, -1]
    x_hat = codec.decode(payload)
    assert torch.equal(x_hat[:, [7, 50]], x[:, [7, 50]])
    assert_within_bound(codec, x, payload, x_hat)
    x[0::4, 20] *= 100  # now the sampled rows carry it too
    assert codec.encode(x).tensors["outlier_index"].tolist() == [7, 20, 50]
    if backend == "native":
        assert_same_as_eager("native", "outlier_int4", x, capacity=3)


def test_outlier_separation_beats_naive_on_outlier_data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 128, generator=gen)
    x[:, [3, 90]] *= 60
    errors = {}
    for name in ("outlier_int4", "naive_int4"):
        _, _, x_hat = round_trip(name, x)  # outlier_int4 at its default capacity, 2 of 128
        errors[name] = ((x - x_hat).norm() / x.norm()).item()
    assert errors["outlier_int4"] * 3 < errors["naive_int4"]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@PROPERTY
@given(shape=shapes(), threshold=st.sampled_from([2.0, 3.0]), seed=st.integers(0, 2**31 - 1))
def test_nbytes_matches_hand_count(dtype, shape, threshold, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    n, es = x.numel(), x.element_size()
    channels = shape[-1] if shape else 1
    rows = n // channels if channels else 0
    packed = (n + 1) // 2
    expected = {
        "sym_int4": packed + 2 * math.ceil(n / 64),
        "asym_int4": packed + (2 + es) * math.ceil(n / 128),
        "naive_int4": packed + 2 * rows if n else 0,
        "channel_int4": packed + 2 * channels if n else 0,
    }
    for name, count in expected.items():
        assert round_trip(name, _prepare(name, x))[1].nbytes == count, name
    for capacity in (None, 0, 1, 3):
        codec, payload, _ = round_trip("outlier_int4", x, threshold=threshold, capacity=capacity)
        k = min(channels, channels // 64 if capacity is None else capacity) if n else 0
        assert payload.nbytes == expected["sym_int4"] + k * (4 + rows * es), capacity


def test_group_size_option_changes_layout():
    x = torch.randn(1000)
    for group_size in (16, 64, 256):
        codec, payload, x_hat = round_trip("sym_int4", x, group_size=group_size)
        assert payload.tensors["scales"].numel() == math.ceil(1000 / group_size)
        assert_within_bound(codec, x, payload, x_hat)
    with pytest.raises(ValueError, match="group_size"):
        codecs.get("sym_int4", group_size=7)


def test_non_finite_group_costs_nothing_extra_and_decodes_nan():
    x = torch.randn(4, 64)
    clean = round_trip("sym_int4", x)[1].nbytes
    x[2, 5] = math.nan
    codec, payload, x_hat = round_trip("sym_int4", x)
    assert payload.nbytes == clean
    assert payload.tensors["scales"].view(torch.int16)[2].item() == 0x7FC0  # bf16 NaN
    assert payload.tensors["packed"].view(4, 32)[2].eq(0x88).all()  # the zero code 8
    assert torch.isnan(x_hat[2]).all() and not torch.isnan(x_hat[[0, 1, 3]]).any()
    assert torch.equal(x_hat[[0, 1, 3]], round_trip("sym_int4", x[[0, 1, 3]])[2])
    x[2, 5] = -math.inf
    payload = round_trip("asym_int4", x)[1]
    assert payload.tensors["scales"].view(torch.int16)[1].item() == 0x7FC0  # the 2nd group of 128
    assert (payload.tensors["offsets"][1].item() == 0
            and payload.tensors["packed"][64:128].eq(0).all())


@pytest.mark.parametrize("name", INT4_CODECS)
def test_near_dtype_max_saturates_within_bound(name):
    # fp16 at its maximum: the int4 grid of max / 8 rounded up reaches past 65504; decoding
    # saturates there instead of overflowing, and stays within half a step.
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(6)) * 1000
    x[3] = 65504.0
    x[4, ::3] = -65504.0
    if name == "asym_int4":
        x[5] = torch.linspace(-65504.0, 65504.0, 128)
    x = x.to(torch.float16)
    codec, payload, x_hat = round_trip(name, x)
    assert bool(torch.isfinite(x_hat).all())
    if name != "channel_int4":  # row 3's groups hold 65504 as their extreme: decoded exactly
        assert x_hat[3].eq(65504.0).all()
    assert_within_bound(codec, x, payload, x_hat)


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.bfloat16, torch.float16,
                                   torch.uint8])
@PROPERTY
@given(shape=shapes(), p=st.floats(0.0, 1.0), seed=st.integers(0, 2**31 - 1))
def test_bitmask_lossless_and_eighth_of_bool(dtype, shape, p, seed):
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(shape, generator=gen) >= p
    value = {torch.bool: True, torch.uint8: 1}.get(dtype, 1 / 0.9)
    mask = torch.where(keep, torch.tensor(value, dtype=dtype), torch.tensor(0, dtype=dtype))
    codec, payload, decoded = round_trip("bitmask", mask)
    assert decoded.dtype == dtype and decoded.shape == mask.shape
    assert torch.equal(decoded, mask)
    value_bytes = 0 if dtype == torch.bool else mask.element_size()
    assert payload.nbytes == math.ceil(mask.numel() / 8) + (value_bytes if mask.numel() else 0)


def test_bitmask_of_non_contiguous_view():
    mask = torch.rand(10, 12) > 0.5
    view = mask.t()[:, 1::3]
    assert torch.equal(round_trip("bitmask", view)[2], view)


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_bitmask_flags_non_masks(backend):
    # Checked on the device: the value stored is NaN, so training sees NaN where the mask
    # is set; the host-side check raises (tests and strict mode only).
    from megatron_adacc.codecs.bitmask import check_mask
    codec = codecs.get("bitmask", backend=backend)
    for bad in ([0.0, 1.0, 2.0], [0.0, math.nan], [math.nan, 0.0], [2.0, 0.0, -2.0]):
        payload = codec.encode(torch.tensor(bad))
        assert payload.tensors["mask_value"].isnan().all()
        assert payload.nbytes == codec.payload_bytes((len(bad),), torch.float32)
        decoded = codec.decode(payload)
        assert (torch.equal(decoded.isnan(), torch.tensor(bad) != 0)
                and decoded[decoded == 0].numel() == 1)
        with pytest.raises(ValueError, match="mask"):
            check_mask(torch.tensor(bad))
    check_mask(torch.tensor([0.0, 1.5, 1.5]))
    # An all-zero mask, signed zeros included, decodes to +0 on every backend.
    assert_same_as_eager(backend, "bitmask", torch.tensor([0.0, -0.0, 0.0]))
    assert torch.equal(codec.decode(codec.encode(torch.tensor([-0.0, 0.0]))).view(torch.int32),
                       torch.zeros(2, dtype=torch.int32))


@pytest.mark.parametrize("name", INT4_CODECS)
def test_wrong_inputs_raise_clear_errors(name):
    codec = codecs.get(name, backend="torch")
    for bad in (torch.arange(6), torch.ones(3, dtype=torch.bool),
                torch.ones(3, dtype=torch.float64)):
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            codec.encode(bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        codec.encode([1.0, 2.0])
    with pytest.raises(ValueError, match="cannot decode"):
        codec.decode(codecs.get("bitmask").encode(torch.ones(3, dtype=torch.bool)))


@pytest.mark.parametrize("name", codecs.NAMES)
def test_no_autograd_history_and_no_reference_to_input(name):
    x = torch.randn(16, 64, requires_grad=True)
    source = torch.where(x > 0, x / x, 0 * x) if name == "bitmask" else x * 1
    assert source.requires_grad
    codec = codecs.get(name, backend="torch")
    payload = codec.encode(source)
    assert not any(t.requires_grad for t in payload.tensors.values())
    x_hat = codec.decode(payload)
    assert not x_hat.requires_grad and x_hat.grad_fn is None
    alive = weakref.ref(source)
    del source
    gc.collect()
    assert alive() is None, "the payload keeps the input tensor alive"
    with torch.no_grad():
        assert torch.equal(codec.decode(codec.encode(x.detach() > 0)), x > 0) if name == "bitmask" \
            else codec.decode(codec.encode(x)).shape == x.shape


@pytest.mark.parametrize("name", INT4_CODECS)
@PROPERTY
@given(x=st.one_of(activation_tensors(), edge_tensors()))
def test_native_matches_eager(name, x):
    assert_same_as_eager("native", name, _prepare(name, x))


@PROPERTY
@given(x=activation_tensors(), capacity=st.sampled_from([0, 1, 3, 8]), specials=st.integers(0, 3))
def test_native_outlier_capacities_match_eager(x, capacity, specials):
    # Empty slots, full ones and outliers beyond the capacity, with NaN and Inf groups.
    x = x.contiguous()
    x.view(-1)[torch.arange(specials) * 37 % x.numel()] = torch.tensor(
        [math.nan, math.inf, -math.inf][:specials], dtype=x.dtype)
    assert_same_as_eager("native", "outlier_int4", x, capacity=capacity)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(64, 20), (7, 3, 96), (16, 4), (3, 5000)])
def test_native_channel_paths_match_eager(dtype, shape):
    # The native kernels' channel handling beyond what the property tests reach: outlier
    # channels zeroed inside groups that wrap around rows (20 and 4 channels; 64-element
    # groups), a NaN outlier channel, and per-channel scales over whole 32-column blocks
    # plus a remainder (5000 columns), or a remainder only (20, 4).
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen)
    x[..., 1] *= 300
    x[..., -1] = math.nan
    for name in ("outlier_int4", "channel_int4"):
        assert_same_as_eager("native", name, x.to(dtype))
        assert_same_as_eager("native", name, x.nan_to_num().to(dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("channels", [1024, 1000])
def test_native_outlier_exact_channels_across_batches(dtype, channels):
    # The native outlier codec copies its exact channels batch of groups by batch (16 or 8
    # groups of 64) in the encoding and decoding passes: outlier channels at group and row
    # edges, rows that end inside a batch (1000 channels), with and without a NaN group.
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(37, channels, generator=gen)
    outliers = [0, 5, 63, 64, 511, channels - 1]
    x[:, outliers] *= 400
    payload = codecs.get("outlier_int4", backend="native", capacity=8).encode(x.to(dtype))
    assert payload.tensors["outlier_index"].tolist() == outliers + [-1, -1]
    for capacity in (8, 6, 4):  # empty slots; as many as the outliers; fewer
        assert_same_as_eager("native", "outlier_int4", x.to(dtype), capacity=capacity)
    x[3, 7] = math.nan  # a NaN group: the exact channels written over its NaNs
    assert_same_as_eager("native", "outlier_int4", x.to(dtype), capacity=8)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_native_outlier_channels_from_sums_that_rows_far_apart_decide(dtype):
    # The native channel sums pick what the reference picks: an outlier further down only, a
    # channel large in the first rows only (not an outlier over all of them), and columns
    # whose sum is not finite or passes 2^128 (bf16 and fp32 widen to doubles by integer
    # shifts and sum such columns again).
    gen = torch.Generator().manual_seed(5)
    native_codec = codecs.get("outlier_int4", backend="native", capacity=2)
    late = torch.randn(600, 256, generator=gen)
    late[300:, 7] *= 1000
    assert native_codec.encode(late.to(dtype)).tensors["outlier_index"].tolist() == [7, -1]
    assert_same_as_eager("native", "outlier_int4", late.to(dtype), capacity=2)
    early = torch.randn(600, 256, generator=gen)
    early[:128, 60] *= 3
    early[128:, 60] *= 0.5
    assert native_codec.encode(early.to(dtype)).tensors["outlier_index"].tolist() == [-1, -1]
    assert_same_as_eager("native", "outlier_int4", early.to(dtype), capacity=2)
    early[200:203, 150] = 60000.0 if dtype == torch.float16 else 3e38
    assert native_codec.encode(early.to(dtype)).tensors["outlier_index"].tolist() == [150, -1]
    assert_same_as_eager("native", "outlier_int4", early.to(dtype), capacity=2)
    early[400, 9], early[5, 3] = math.inf, math.nan
    assert_same_as_eager("native", "outlier_int4", early.to(dtype), capacity=2)
    assert_same_as_eager("native", "outlier_int4", early.to(dtype), capacity=4)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.bfloat16,
                                   torch.float16])
def test_native_bitmask_wide_masks(dtype):
    # Masks long enough for the native 64-byte steps plus a remainder, with signed zeros,
    # a wrong value and a NaN placed inside the stepped part (flagged by a NaN value).
    gen = torch.Generator().manual_seed(8)
    keep = torch.rand(1000, generator=gen) > 0.3
    if dtype in (torch.bool, torch.uint8):
        assert_same_as_eager("native", "bitmask", keep.to(dtype))
        return
    mask = keep.to(dtype) / 0.9
    mask[torch.arange(3, 900, 7)] = -0.0
    assert_same_as_eager("native", "bitmask", mask)
    codec = codecs.get("bitmask", backend="native")
    for bad in (2.0, math.nan):
        wrong = mask.clone()
        wrong[500] = bad
        assert codec.encode(wrong).tensors["mask_value"].isnan().all()  # flagged, not raised
        assert_same_as_eager("native", "bitmask", wrong)


def test_native_column_copies_refuse_what_they_would_overrun():
    # The C kernels index raw memory; slots outside the rows, out of their layout (ascending
    # channels, then -1s) and values of the wrong shape go to the reference, which raises on
    # what is wrong and follows the rest.
    rows = torch.zeros(4, 6, dtype=torch.bfloat16)
    with pytest.raises((IndexError, RuntimeError)):
        native._take_columns(rows, torch.tensor([6], dtype=torch.int32))
    rows[:, 5], rows[:, 0] = 1, 2
    assert torch.equal(native._take_columns(rows, torch.tensor([0, 5, -1], dtype=torch.int32)),
                       torch.tensor([[2.0, 1.0, 0.0]] * 4, dtype=torch.bfloat16))
    with pytest.raises((IndexError, RuntimeError)):  # a zeroing mask longer than the channels
        native._sym_encode(rows.view(-1, 8), 1, (6, torch.ones(7, dtype=torch.bool),
                                                 torch.tensor([0], dtype=torch.int32)))
    # The decode writes exact channels in its pass for slots in their layout; others go to
    # the reference, which writes unordered ones and raises on the rest.
    packed, scales, shape2d = (torch.full((12,), 0x88, dtype=torch.uint8),
                               torch.ones(3, dtype=torch.bfloat16), (3, 8))
    values = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 5.0]], dtype=torch.bfloat16)
    for index in ([0, 11, -1], [11, 0, -1], [0, -1, 11]):
        out = native._sym_decode(packed, scales, shape2d, 1, torch.bfloat16,
                                 (12, torch.tensor(index, dtype=torch.int32), values))
        expected = symmetric.sym_decode(packed, scales, shape2d, 1, torch.bfloat16,
                                        (12, torch.tensor(index, dtype=torch.int32), values))
        assert torch.equal(out, expected)
        used = [k for k, i in enumerate(index) if i >= 0]
        assert out.view(-1)[index[0]] == values[0, 0] and out.sum() == values[:, used].sum()
    with pytest.raises((IndexError, RuntimeError)):
        native._sym_decode(packed, scales, shape2d, 1, torch.bfloat16,
                           (12, torch.tensor([0, 12, -1], dtype=torch.int32), values))


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.bfloat16,
                                   torch.float16])
def test_native_bitmask_matches_eager(dtype):
    gen = torch.Generator().manual_seed(5)
    for shape in [(0,), (1,), (13,), (4, 33), (2, 8, 64)]:
        keep = torch.rand(shape, generator=gen) > 0.2
        assert_same_as_eager("native", "bitmask",
                             keep.to(dtype) if dtype in (torch.bool, torch.uint8)
                             else keep.to(dtype) / 0.9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 8, 256), (1100, 200), (2100, 70)])
def test_native_outlier_paths_match_eager(dtype, shape):
    # The native outlier codec's paths: no outlier channel (channel magnitudes on a ramp:
    # every z-score below sqrt(3)); outlier channels in some groups only (the others take the
    # loops without zeroing); in every group (one in 29 channels); element counts that do not
    # divide the group size (70 x 2100 leaves a partial last group); every k-th row read in
    # place for the statistics (k = 2, 4).
    gen = torch.Generator().manual_seed(13)
    channels = shape[-1]
    x = torch.randn(shape, generator=gen).sign() * (1 + torch.arange(channels) / channels)
    assert codecs.get("outlier_int4", backend="native").encode(
        x.to(dtype)).tensors["outlier_index"].lt(0).all()
    assert_same_as_eager("native", "outlier_int4", x.to(dtype))
    for outliers in ([3], [0, channels - 6], list(range(5, channels, 29))):
        y = x.clone()
        y[..., outliers] = y[..., outliers].sign() * 1000
        payload = codecs.get("outlier_int4", backend="native",
                             capacity=len(outliers)).encode(y.to(dtype))
        assert payload.tensors["outlier_index"].tolist() == outliers
        for capacity in (len(outliers), len(outliers) // 2 + 1):
            assert_same_as_eager("native", "outlier_int4", y.to(dtype), capacity=capacity)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_outlier_choice_too_close_to_call_matches_eager(dtype):
    # A z-score at the threshold itself, and channels whose sums are all equal (z = 0 / 0):
    # the native choice leaves these to the reference's operations, which decide them.
    from megatron_adacc.codecs.outlier import channel_abs_sums, statistics_rows
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 96, generator=gen)
    x[:, 7] *= 20
    sums = channel_abs_sums(statistics_rows(x.to(dtype)))
    z = ((sums - sums.mean()) / sums.std(unbiased=False))[7].item()
    for threshold in (z, math.nextafter(z, 0), math.nextafter(z, math.inf)):
        for backend in ("torch", "native"):
            codec = codecs.get("outlier_int4", backend=backend, threshold=threshold)
            assert torch.equal(codec.encode(x.to(dtype)).tensors["outlier_index"],
                               codecs.get("outlier_int4", backend="torch", threshold=threshold)
                               .encode(x.to(dtype)).tensors["outlier_index"])
        eager = codecs.get("outlier_int4", backend="torch", threshold=threshold).encode(x.to(dtype))
        native_payload = codecs.get("outlier_int4", backend="native",
                                    threshold=threshold).encode(x.to(dtype))
        assert eager.tensors.keys() == native_payload.tensors.keys()
        for key, tensor in eager.tensors.items():
            assert torch.equal(tensor.view(-1).view(torch.uint8),
                               native_payload.tensors[key].view(-1).view(torch.uint8)), key
    constant = torch.full((64, 96), 0.75, dtype=dtype)
    assert_same_as_eager("native", "outlier_int4", constant)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.float32, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("numel", [64 * 1000, 64 * 1000 + 1, 64 * 1000 + 31, 64 * 1000 + 63])
def test_native_bitmask_tails_match_eager(dtype, numel):
    # Masks of whole vector steps (16, 32 or 64 elements) and tails of every kind past them,
    # the value checked in the packing pass: a wrong value or a NaN in the tail is flagged.
    gen = torch.Generator().manual_seed(numel)
    keep = torch.rand(numel, generator=gen) > 0.1
    mask = keep.to(dtype) if dtype in (torch.bool, torch.uint8) else keep.to(dtype) / 0.9
    assert_same_as_eager("native", "bitmask", mask)
    if dtype in (torch.bool, torch.uint8):
        return
    codec = codecs.get("bitmask", backend="native")
    for bad in (2.0, math.nan):
        wrong = mask.clone()
        wrong[-1] = bad
        assert codec.encode(wrong).tensors["mask_value"].isnan().all()  # flagged, not raised
        assert_same_as_eager("native", "bitmask", wrong)
