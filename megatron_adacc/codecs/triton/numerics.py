"""Rounding and NaN helpers shared by the Triton codec kernels, bit-exact with codecs/int4.py."""
import triton
import triton.language as tl

from megatron_adacc.codecs.triton.launch import INTERPRET


@triton.jit
def ceil_to_bf16(v):
    """Smallest bf16-representable fp32 value >= v for finite v >= 0 (as int4.ceil_to_bf16).

    Callers exclude non-finite groups separately."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


# A GPU rounds fp32 to bf16 to nearest even, two values an instruction (cvt.rn.bf16x2.f32); by hand
# it took five integer instructions a value, a third of a decode's. The interpreter truncates.
NATIVE_BF16 = tl.constexpr(not INTERPRET)


@triton.jit
def to_output(v, OUT_BF16: tl.constexpr, out_dtype: tl.constexpr):
    """fp32 -> output dtype, rounding to nearest even.

    Interpreted, bf16 is rounded by hand, NaN giving the quiet NaN 0x7FC0 (rounding a GPU's NaN
    0x7FFFFFFF by hand would carry into the sign). A GPU's NaN bits may differ: they are no part
    of the format."""
    if OUT_BF16:
        if NATIVE_BF16:
            return v.to(tl.bfloat16)
        else:
            bits = v.to(tl.int32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return tl.where(v != v, 0x7FC0, rounded).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return v.to(out_dtype)


@triton.jit
def widen(raw, BF16_BITS: tl.constexpr):
    """Loaded values as fp32; bf16 is widened by hand, from its bits.

    The Triton interpreter's bf16 -> fp32 cast flushes subnormals to 0, where a GPU's (a shift)
    keeps them."""
    if BF16_BITS:
        return bf16_bits_to_float(raw)
    else:
        return raw.to(tl.float32)


@triton.jit
def load_float(ptr, mask, BF16_BITS: tl.constexpr):
    """Values at ``ptr`` as fp32 (widen); masked lanes read 0."""
    return widen(tl.load(ptr, mask=mask, other=0), BF16_BITS)


@triton.jit
def non_finite(v):
    """1 where v is NaN or +-Inf, else 0 (int32): v * 0 is NaN exactly there."""
    return ((v * 0.0) != 0.0).to(tl.int32)


@triton.jit
def nan_minimum(a, b):
    """Elementwise minimum, NaN where either is NaN (a GPU's plain min drops a NaN)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_maximum(a, b):
    """Elementwise maximum, NaN where either is NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


# The interpreter runs a reduction with a combine function in Python, element by element (the codec
# tests took 8x longer), and its tl.min and tl.max drop NaN. Interpreted, extremes finds NaN apart,
# to the same result; the tests run the combining reduction on small shapes too.
REDUCE_BY_COMBINE = tl.constexpr(not INTERPRET)


@triton.jit
def _nan_where_nan(x, axis: tl.constexpr, reduced):
    """``reduced`` (x reduced along ``axis``), NaN where x holds a NaN: the interpreter's way."""
    return tl.where(tl.max((x != x).to(tl.int32), axis=axis) > 0, float("nan"), reduced)


@triton.jit
def nan_min(x, axis: tl.constexpr):
    """The minimum of x along ``axis``, NaN where it holds a NaN."""
    if REDUCE_BY_COMBINE:
        return tl.reduce(x, axis, nan_minimum)
    return _nan_where_nan(x, axis, tl.min(x, axis=axis))


@triton.jit
def nan_max(x, axis: tl.constexpr):
    """The maximum of x along ``axis``, NaN where it holds a NaN."""
    if REDUCE_BY_COMBINE:
        return tl.reduce(x, axis, nan_maximum)
    return _nan_where_nan(x, axis, tl.max(x, axis=axis))


@triton.jit
def extremes(x, axis: tl.constexpr):
    """(nan_min, nan_max) of x along ``axis``.

    So a group is non-finite exactly where one of them is, with no per-element check: a GPU's
    NaN-propagating min and max cost what its plain ones do."""
    return nan_min(x, axis), nan_max(x, axis)


@triton.jit
def scale_bits(scale, bad):
    """The bf16 of a bf16-exact fp32 scale (ceil_to_bf16), or NaN where ``bad``, made from bits.

    By hand, since a GPU's cvt would canonicalise NaN to 0x7FFF."""
    bits = scale.to(tl.int32, bitcast=True) >> 16
    return tl.where(bad, 0x7FC0, bits).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def bf16_bits_to_float(value):
    """fp32 of a bf16 (or its int16 bits), widened by a shift of its bits (subnormals kept)."""
    return (value.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def saturate(v, dmax):
    """v clamped to [-dmax, dmax], NaN passing through: two NaN-propagating min/max instructions."""
    return nan_minimum(nan_maximum(v, -dmax), dmax)


@triton.jit
def saturate_to(v, dtype: tl.constexpr):
    """v saturated (saturate) to the finite range of ``dtype``, int4.dtype_max's.

    The bounds are literals, not a launch argument that would cost Triton's launcher host time."""
    if dtype == tl.bfloat16:
        return saturate(v, 3.3895313892515355e38)
    else:
        if dtype == tl.float16:
            return saturate(v, 65504.0)
        else:
            return saturate(v, 3.4028234663852886e38)


@triton.jit
def sym_scale(lo, hi, min_scale):
    """Signed fp32 scales from group minima and maxima (symmetric.sym_scales), finite groups'."""
    negative_extreme = -lo >= hi
    extreme = tl.where(negative_extreme, -lo, hi)
    opposite = tl.where(negative_extreme, hi, -lo)
    # x * 0.125 is x / 8 correctly rounded, like the division: one multiply, not a division's
    # dozen instructions.
    unrounded = tl.maximum(extreme * 0.125, tl.div_rn(opposite, 7.5))
    magnitude = tl.maximum(ceil_to_bf16(unrounded), min_scale)
    return tl.where(negative_extreme, magnitude, -magnitude)


@triton.jit
def floor_code(v):
    """floor(v) as int32 for v in [0, 15], without a conversion instruction.

    Adding 2**23 rounds v to an integer held in the low mantissa bits; one rounded up is taken
    back. A Hopper GPU converts (F2I, FRND, I2F) at an eighth of the rate it adds: that bound the
    encodes."""
    y = v + 8388608.0
    return (y.to(tl.int32, bitcast=True) - 0x4B000000) - ((y - 8388608.0) > v).to(tl.int32)


@triton.jit
def code_value(code, ZERO: tl.constexpr):
    """code - ZERO in fp32 for an integer code in [0, 2**23), not converted (see floor_code)."""
    return (code.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZERO)


@triton.jit
def sym_codes(x, inverse, bad):
    """int4 codes (8 = zero) of x * inverse (1 / scale), the zero code in bad groups.

    They are int32; floor commutes with the clamp to the codes' integer bounds."""
    code = floor_code(tl.minimum(tl.maximum(x * inverse + 8.5, 0.0), 15.0))
    return tl.where(bad, 8, code)
