"""Native CPU kernels (codecs.c), built with the system C compiler on first use, called by ctypes.

They make one fused pass per group where the PyTorch reference makes ten. They are byte-identical to
the reference (tests/codecs/test_codecs.py checks it).

The shared object is built for the machine it runs on (-march=native). So it is cached under
~/.cache/megatron-adacc/codecs (library_file), keyed by the source, the flags and the CPU
(host.HostCpu.build_identity: model name, family, model and instruction-set flags).
ADACC_NATIVE_CFLAGS adds compiler flags after those and is part of the key; e.g. "-mno-avx512f"
builds the AVX2 kernels on an AVX-512 machine. vector_isa() names the vector path a build took.

They cover row- and channel-grouped int4 (even row width), and masks of bool, uint8 and float
dtypes. They also cover the outlier codec's channel choice up to its capacity, channel zeroing and
exact channels. Other cases run the reference. No kernel's output size depends on the data.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import torch

from megatron_adacc.codecs import asymmetric, bitmask, int4, outlier, symmetric
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.native import host

_SOURCE = Path(__file__).with_name("codecs.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-shared",
          "-fPIC"]
CFLAGS_ENV_VAR = "ADACC_NATIVE_CFLAGS"
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_i64, _f32, _i32, _p = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "sym_encode_rows": [_p, _i32, _i64, _i64, _i64, _i64, _p, _i64, _p, _p, _p],
    "sym_decode_rows": [_p, _p, _i64, _i64, _i32, _p, _i64, _i64, _i64, _p, _p],
    "sym_encode_cols": [_p, _i32, _i64, _i64, _p, _p, _p, _p],
    "sym_decode_cols": [_p, _p, _i64, _i64, _i32, _p, _p],
    "outlier_channels": [_p, _i32, _i64, _i64, _i64, _i64, ctypes.c_double, _i64, _p, _p, _p, _p],
    "asym_encode_rows": [_p, _i32, _i64, _i64, _p, _p, _p],
    "asym_decode_rows": [_p, _p, _p, _i64, _i64, _i32, _p],
    "mask_encode": [_p, _i32, _i32, _i64, _p, _p],
    "mask_unpack": [_p, _i64, _p],
    "mask_unpack_values": [_p, _i64, _i32, _p, _p],
    "take_columns": [_p, _i32, _i64, _i64, _p, _i64, _p],
    "vector_isa": [],
}
_RETURNS = {**{name: ctypes.c_int
               for name in ("mask_encode", "sym_encode_rows", "sym_decode_rows", "take_columns")},
            "outlier_channels": _i64, "vector_isa": ctypes.c_char_p}


def library() -> ctypes.CDLL:
    """The library for the current ADACC_NATIVE_CFLAGS (read each call, built once per value)."""
    return _library_for(os.environ.get(CFLAGS_ENV_VAR, ""))


def vector_isa() -> str:
    """The vector path the kernels were compiled for: "avx512", "avx2" or "generic"."""
    return library().vector_isa().decode()


def _compiler_flags(cflags: str) -> list[str]:
    return [*_FLAGS, *shlex.split(cflags)]


def library_file(cflags: str | None = None) -> Path:
    """Where this CPU's library built with ``cflags`` (default: ADACC_NATIVE_CFLAGS) is cached.

    A cache shared by machines of other CPUs (a home directory on a cluster's file system) holds
    one build for each."""
    flags = _compiler_flags(os.environ.get(CFLAGS_ENV_VAR, "") if cflags is None else cflags)
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(flags).encode()
                         + host.host_cpu().build_identity().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ADACC_CACHE_DIR",
                                Path.home() / ".cache" / "megatron-adacc")) / "codecs"
    return cache / f"codecs-{key}.so"


@functools.cache
def _library_for(cflags: str) -> ctypes.CDLL:  # every kernel call asks: splitting the flags each
                                               # time cost 2 us
    target = library_file(cflags)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        compiler = os.environ.get("CC", "gcc")
        # build aside, then rename: atomic
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            subprocess.run([compiler, *_compiler_flags(cflags), str(_SOURCE), "-o", str(built),
                            "-lm"],
                           check=True, capture_output=True)
            built.replace(target)
    lib = ctypes.CDLL(str(target))
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = _RETURNS.get(name)
    return lib


@functools.cache
def available() -> bool:
    try:
        library()
    except (OSError, subprocess.CalledProcessError, FileNotFoundError):
        return False
    return True


def _native(x2d: torch.Tensor) -> bool:
    return x2d.device.type == "cpu" and x2d.shape[1] % 2 == 0 and x2d.is_contiguous()


def _slots(index: torch.Tensor) -> bool:
    """Slot indices (outlier.select_channels' layout) as the C kernels take them.

    They are int32 on the CPU, contiguous; the kernels check the values themselves."""
    return (index.dtype == torch.int32 and index.device.type == "cpu" and index.dim() == 1
            and index.is_contiguous())


def _sym_encode(x2d, reduce_dim, zeroed=None):
    if reduce_dim == 0 and zeroed is None and _native(x2d):
        rows, cols = x2d.shape
        packed = torch.empty(rows * cols // 2, dtype=torch.uint8)
        scales = torch.empty(cols, dtype=torch.bfloat16)
        scratch, col_ok = (torch.empty(4 * cols, dtype=torch.float32),
                           torch.empty(cols, dtype=torch.int32))
        library().sym_encode_cols(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], rows, cols,
                                  scratch.data_ptr(), col_ok.data_ptr(), packed.data_ptr(),
                                  scales.data_ptr())
        return packed, scales
    layout = int4.row_layout(x2d, zeroed) if reduce_dim == 1 and x2d.device.type == "cpu" else None
    if layout is None or zeroed is not None and not _slots(zeroed[2]):
        # the groups as the reference takes them ([rows, groups a row, width] read in place:
        # [groups, width]); it raises on a wrong mask
        return symmetric.sym_encode(x2d.reshape(-1, x2d.shape[-1]), reduce_dim, zeroed)
    rows, cols, channels, stride = layout
    packed = torch.empty(rows * cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, dtype=torch.bfloat16)
    if zeroed is None:
        library().sym_encode_rows(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], rows, cols, channels,
                                  stride, None, 0, None, packed.data_ptr(), scales.data_ptr())
        return packed, scales
    index = zeroed[2]  # the slots: the C kernel zeroes their channels and copies them in its pass
    # whole rows: see the codec
    exact = torch.empty(rows * cols // channels, index.numel(), dtype=x2d.dtype)
    if not library().sym_encode_rows(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], rows, cols, channels,
                                     stride, index.data_ptr(), index.numel(), exact.data_ptr(),
                                     packed.data_ptr(), scales.data_ptr()):
        # slots out of their layout (the reference raises or follows them) or out of memory in C
        return symmetric.sym_encode(x2d.reshape(-1, x2d.shape[-1]), reduce_dim, zeroed)
    return packed, scales, exact


def _sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact=None):
    if shape2d[1] % 2 or packed.device.type != "cpu" or not (
            exact is None or reduce_dim == 1 and _native_exact(exact, dtype, shape2d)):
        return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact)
    out = torch.empty(shape2d, dtype=dtype)
    if reduce_dim == 0:
        col_scale = torch.empty(shape2d[1], dtype=torch.float32)
        library().sym_decode_cols(packed.data_ptr(), scales.data_ptr(), shape2d[0], shape2d[1],
                                  _DTYPE_CODE[dtype], col_scale.data_ptr(), out.data_ptr())
        return out
    if exact is None:
        library().sym_decode_rows(packed.data_ptr(), scales.data_ptr(), shape2d[0], shape2d[1],
                                  _DTYPE_CODE[dtype], None, 0, 1, 0, None, out.data_ptr())
        return out
    channels, index, values = exact
    if not library().sym_decode_rows(packed.data_ptr(), scales.data_ptr(), shape2d[0], shape2d[1],
                                     _DTYPE_CODE[dtype], index.data_ptr(), index.numel(), channels,
                                     values.shape[0], values.data_ptr(), out.data_ptr()):
        # slots out of their layout: the reference raises on those out of range, follows the rest
        return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact)
    return out


def _native_exact(exact, dtype, shape2d) -> bool:
    """Exact channels as the C decode writes them.

    Slots are int32 on the CPU; values are contiguous [rows, slots] of the output dtype; rows of
    ``channels`` lie within the output. It checks the slots itself; the reference raises on the
    rest."""
    channels, index, values = exact
    return (_slots(index) and values.dtype == dtype and values.is_contiguous() and values.dim() == 2
            and values.shape[1] == index.numel()
            and 0 < values.shape[0] * channels <= shape2d[0] * shape2d[1])


def _outlier_select(x2d, threshold, capacity):
    rows, cols = x2d.shape
    if (x2d.device.type != "cpu" or x2d.dtype not in _DTYPE_CODE
            or not (x2d.is_contiguous() or x2d.stride(1) == 1 and x2d.stride(0) >= cols)):
        return outlier.outlier_select(x2d, threshold, capacity)
    stride = cols if x2d.is_contiguous() else x2d.stride(0)
    sums = torch.empty(2 * cols, dtype=torch.float64)  # the sums, then scratch
    mask = torch.empty(cols, dtype=torch.bool)
    index = torch.empty(capacity, dtype=torch.int32)
    if library().outlier_channels(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], rows, cols, stride,
                                  outlier.statistics_step(rows), threshold, capacity,
                                  sums.data_ptr() + 8 * cols,
                                  sums.data_ptr(), mask.data_ptr(), index.data_ptr()) < 0:
        # too close to call in another summation order
        return outlier.outlier_select(x2d, threshold, capacity)
    return mask, index


def _asym_encode(x2d):
    if not _native(x2d):
        return asymmetric.asym_encode(x2d)
    rows, cols = x2d.shape
    packed = torch.empty(rows * cols // 2, dtype=torch.uint8)
    scales = torch.empty(rows, dtype=torch.bfloat16)
    offsets = torch.empty(rows, dtype=x2d.dtype)
    library().asym_encode_rows(x2d.data_ptr(), _DTYPE_CODE[x2d.dtype], rows, cols,
                               packed.data_ptr(), scales.data_ptr(), offsets.data_ptr())
    return packed, scales, offsets


def _asym_decode(packed, scales, offsets, shape2d, dtype):
    if shape2d[1] % 2 or packed.device.type != "cpu":
        return asymmetric.asym_decode(packed, scales, offsets, shape2d, dtype)
    out = torch.empty(shape2d, dtype=dtype)
    library().asym_decode_rows(packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), shape2d[0],
                               shape2d[1], _DTYPE_CODE[dtype], out.data_ptr())
    return out


def _mask_encode(flat):
    if flat.device.type != "cpu" or not (flat.element_size() == 1 or flat.dtype in _DTYPE_CODE):
        return bitmask.mask_encode(flat)
    flat = flat.contiguous()
    packed = torch.empty((flat.numel() + 7) // 8, dtype=torch.uint8)
    # float masks: the value checked in the same pass
    checked, value = flat.dtype in _DTYPE_CODE, ctypes.c_float()
    is_mask = library().mask_encode(flat.data_ptr(), _DTYPE_CODE.get(flat.dtype, 0),
                                    flat.element_size(), flat.numel(), packed.data_ptr(),
                                    ctypes.byref(value) if checked else None)
    if checked:  # a CPU function's result: no device to wait for
        stored = torch.tensor([value.value], dtype=flat.dtype)
        return packed, stored if is_mask else int4.with_nan(stored, torch.ones(1, dtype=torch.bool))
    return packed, None if flat.dtype == torch.bool else bitmask.mask_value(flat)


def _mask_unpack(packed, numel, value=None):
    if packed.device.type != "cpu" or (value is not None and not (
            value.dtype in _DTYPE_CODE and value.device.type == "cpu" and value.is_contiguous())):
        return bitmask.mask_unpack(packed, numel, value)
    if value is None:
        flags = torch.empty(numel, dtype=torch.bool)
        library().mask_unpack(packed.data_ptr(), numel, flags.data_ptr())
        return flags
    out = torch.empty(numel, dtype=value.dtype)
    library().mask_unpack_values(packed.data_ptr(), numel, _DTYPE_CODE[value.dtype],
                                 value.data_ptr(), out.data_ptr())
    return out


def _take_columns(x2d, index):
    if (x2d.device.type == "cpu" and x2d.is_contiguous() and x2d.element_size() in (2, 4)
            and _slots(index)):
        values = torch.empty(x2d.shape[0], index.numel(), dtype=x2d.dtype)
        if library().take_columns(x2d.data_ptr(), x2d.element_size(), x2d.shape[0], x2d.shape[1],
                                  index.data_ptr(), index.numel(), values.data_ptr()):
            return values
    return outlier.take_columns(x2d, index)  # it raises on slots out of range


NATIVE_KERNELS = Kernels(
    sym_encode=_sym_encode,
    sym_decode=_sym_decode,
    asym_encode=_asym_encode,
    asym_decode=_asym_decode,
    mask_encode=_mask_encode,
    mask_unpack=_mask_unpack,
    outlier_select=_outlier_select,
    take_columns=_take_columns,
    strided_rows=True,
)
