"""Every vector path of the native kernels gives the reference's bytes. The library is built
here again with the wider instruction sets switched off (ADACC_NATIVE_CFLAGS), so that the
AVX2 and the generic paths are tested on any CPU (the default build, AVX-512 where the CPU
has it, is tested by test_codecs.py's test_native_* tests)."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_adacc import codecs
from megatron_adacc.codecs import native
from helpers.codecs import assert_same_as_eager

# flags -> the vector paths the build may take, by what the CPU has
BUILDS = {"-mno-avx512f": ("avx2", "generic"), "-mno-avx2 -mno-fma": ("generic",)}
# Whole blocks and remainders of 8 and 16 lanes, groups that wrap around rows of 20
# channels, odd rows (the reference's), per-channel scales over 5000 columns, the outlier
# codec's channel sums over a sample of the rows (2100 x 128: every 4th row).
SHAPES = [(4, 64), (7, 3, 96), (33, 70), (3, 5000), (64, 20), (1000,), (2100, 128)]


def inputs(name: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(17)
    for shape in SHAPES:
        x = torch.randn(shape, generator=gen) * 3
        x[..., 1] *= 300  # an outlier channel
        flat = x.view(-1)
        flat[[5, -3]] = torch.tensor([math.nan, 1e-39])  # a NaN group; a subnormal
        if name == "asym_int4":
            x = torch.sigmoid(x)
        # a group at the dtype's maximum: its grid reaches past it, decoded saturated
        if name != "bitmask":
            x.view(-1)[-70:-60] = torch.finfo(dtype).max * torch.tensor([1.0, -1.0]).repeat(5)
        elif name == "bitmask":
            x = (x > 0) / 0.9
        yield x.to(dtype)


@pytest.mark.parametrize("flags", list(BUILDS))
def test_vector_path_matches_reference(flags, monkeypatch):
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, flags)
    assert native.vector_isa() in BUILDS[flags]
    for name in codecs.NAMES:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for x in inputs(name, dtype):
                assert_same_as_eager("native", name, x)


@pytest.mark.parametrize("flags", ["", *BUILDS])
def test_channel_ranges_with_special_values_match_reference(flags, monkeypatch):
    # channel_int4's column ranges over several chunks of rows (bf16 takes them row by row on
    # int16 keys in both vector builds, fp32 and fp16 on floats a chunk at a time): infinities,
    # NaN and signed zeros in whole blocks, columns of zeros, and NaN-scale columns among
    # packed ones; and the same made finite (the pass that packs codes masks the NaN-scale
    # columns only in a tensor that has some).
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, flags)
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(70, 200, generator=gen)
    x[3, 5], x[40, 6], x[66, 7] = math.inf, -math.inf, math.nan
    x[:, 8] = -0.0
    x[:, 9] = 0.0
    x[::2, 10] = -0.0
    finite = x.nan_to_num(nan=1.5, posinf=7.0, neginf=-7.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same_as_eager("native", "channel_int4", x.to(dtype))
        assert_same_as_eager("native", "channel_int4", finite.to(dtype))
        assert_same_as_eager("native", "outlier_int4", x.to(dtype))


@pytest.mark.parametrize("flags", ["", *BUILDS])
def test_group_ranges_with_special_values_match_reference(flags, monkeypatch):
    # Group ranges reduced for a batch of groups at once (bf16 on int16 keys), and the
    # symmetric codecs' sym bounds on the bits (codecs.c), in every dtype: infinities, NaN of
    # both signs, signed zeros, subnormals and groups of only negatives, of only positives, of
    # only -0 or +0 and of zeroed outlier channels, in a batch cut short by the end of the
    # tensor (23 rows of 64: 23 groups of sym_int4, not a multiple of the batch).
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, flags)
    gen = torch.Generator().manual_seed(29)
    x = torch.randn(23, 64, generator=gen)
    x[0, 3], x[1, 60], x[2, 33], x[3, 0] = math.inf, -math.inf, math.nan, -math.nan
    x[4] = -x[4].abs() - 1
    x[5] = -0.0
    x[6, ::2] = -0.0
    x[6, 1::2] = 0.0
    x[7] = -x[7].abs()
    x[7, 10] = 0.0
    x[8] = x[8].abs() + 1
    x[9] = 0.0
    x[10] = x[10].abs() * 1e-39  # subnormal in fp32 and bf16, zero in fp16
    x[11] = -x[11].abs() * 1e-39
    x[12, 5] = -0.0
    x[12, 6:] = x[12, 6:].abs()
    x[:, 17] *= 500  # an outlier channel, zeroed in every group
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name in ("sym_int4", "asym_int4", "outlier_int4", "naive_int4"):
            assert_same_as_eager("native", name, x.to(dtype))


@pytest.mark.parametrize("flags", ["", *BUILDS])
def test_rows_with_a_non_finite_whole_block_match_reference(flags, monkeypatch):
    # Rows and groups of 70, whole blocks and a remainder, with a NaN or an infinity in an even
    # and an odd place: bf16 folds the even and odd halves of its whole blocks' ranges last,
    # and a NaN in the even half once went unseen there (AVX2: naive_int4 scaled the row).
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, flags)
    rows = torch.randn(6, 70, generator=torch.Generator().manual_seed(31))
    rows[0, 0], rows[1, 2], rows[2, 1], rows[3, 64], rows[4, 0], rows[5, 3] = (
        math.nan, -math.nan, math.nan, math.nan, math.inf, -math.inf)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_same_as_eager("native", "naive_int4", rows.to(dtype))
        assert_same_as_eager("native", "sym_int4", rows.to(dtype), group_size=70)


@pytest.mark.parametrize("flags", ["", *BUILDS])
def test_rows_read_in_place_match_reference(flags, monkeypatch):
    # Views whose rows lie a stride apart, read where they lie (Codec.reads_in_place): the
    # gate and up halves of a SwiGLU fc1 output of whole groups (64 and 640 channels: several
    # groups a row, batches that span rows), of widths whose groups span rows (96: a copy,
    # but naive_int4's rows of 96 in place), the up half of every other row. Each half holds
    # a NaN and an infinity that an encode of the other reading past its rows would meet.
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, flags)
    gen = torch.Generator().manual_seed(23)
    for ffn in (64, 640, 96):
        whole = torch.randn(9, 3, 2 * ffn, generator=gen) * 3
        whole[..., 5] *= 300  # an outlier channel of the gate half
        whole[2, 1, ffn + 1], whole[4, 0, 2 * ffn - 1] = math.nan, math.inf
        whole[6, 2, 3], whole[3, 0, ffn - 1] = math.nan, -math.inf
        for name in codecs.NAMES:
            if name == "bitmask":
                continue
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                x = torch.sigmoid(whole) if name == "asym_int4" else whole
                x = x.to(dtype)
                for view in (x[..., :ffn], x[..., ffn:], x.view(-1, 2 * ffn)[::2, ffn:]):
                    assert_same_as_eager("native", name, view)


# Two /proc/cpuinfo entries this project's machines gave, under one model name.
ZEN4 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\ncpu family\t: 99\n")
ZEN5 = ZEN4.replace(": 25", ": 26").replace(": 17", ": 2").replace("avx512f", "avx512f avx_vnni")


def test_the_host_cpu_is_named_by_its_family_and_model_beyond_a_shared_model_name():
    from megatron_adacc.codecs.native import host

    zen4, zen5 = host.parse_cpuinfo(ZEN4), host.parse_cpuinfo(ZEN5)
    # the first entry only
    assert zen4 == host.HostCpu("AMD EPYC", 25, 17, frozenset({"fpu", "avx2", "avx512f"}))
    assert (zen4.describe(), zen5.describe()) == ("AMD EPYC (family 25, model 17)",
                                                  "AMD EPYC (family 26, model 2)")
    # numbers alike, another instruction set: another build
    assert host.HostCpu("AMD EPYC", 25, 17).build_identity() != host.HostCpu(
        "AMD EPYC", 25, 17, frozenset({"avx512f"})).build_identity()
    # no x86 numbers (an Arm entry): the model name alone
    arm = host.parse_cpuinfo("processor\t: 0\nmodel name\t: Neoverse-V2\nmodel\t: 1\n"
                             "Features\t: fp asimd\n")
    assert arm.describe() == "Neoverse-V2" and arm.model_number is None


def test_a_build_is_cached_per_cpu_and_flags(monkeypatch, tmp_path):
    """A cache shared by machines of different CPUs (a home directory on a cluster's file
    system) must not hand one a -march=native library built on another: "AMD EPYC" was a Zen
    4 and a Zen 5 here, and a library built on one may run instructions the other lacks."""
    from megatron_adacc.codecs.native import host

    monkeypatch.setenv("ADACC_CACHE_DIR", str(tmp_path))
    files = {}
    for name, text in (("zen4", ZEN4), ("zen5", ZEN5)):
        monkeypatch.setattr(host, "host_cpu", lambda text=text: host.parse_cpuinfo(text))
        files[name] = {flags: native.library_file(flags) for flags in ("", *BUILDS)}
    assert len({f for per_cpu in files.values() for f in per_cpu.values()}) == 2 * (1 + len(BUILDS))
    assert all(f.parent == tmp_path / "codecs"
               for per_cpu in files.values() for f in per_cpu.values())
    monkeypatch.setenv(native.CFLAGS_ENV_VAR, "-mno-avx512f")
    # the environment's flags by default
    assert native.library_file() == files["zen5"]["-mno-avx512f"]
