"""Rounding helpers shared by the Triton codec kernels, bit-exact with codecs/int4.py."""
import triton
import triton.language as tl


@triton.jit
def ceil_to_bf16(v):
    """Smallest bf16-representable fp32 value >= v for finite v >= 0 (as int4.ceil_to_bf16).
    Callers exclude non-finite groups separately."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def to_output(v, OUT_BF16: tl.constexpr, out_dtype: tl.constexpr):
    """fp32 -> output dtype, rounding to nearest even. bf16 is rounded by hand and returned
    as its int16 bit pattern: the Triton interpreter truncates fp32 -> bf16 casts."""
    if OUT_BF16:
        bits = v.to(tl.int32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        return (rounded >> 16).to(tl.int16)
    else:
        return v.to(out_dtype)


@triton.jit
def load_float(ptr, mask, BF16_BITS: tl.constexpr):
    """Values as fp32. bf16 tensors are passed as their int16 bit patterns (launch.bits_view)
    and widened by hand: the Triton interpreter's bf16 -> fp32 cast flushes subnormals to 0,
    where a GPU's (a shift) keeps them."""
    if BF16_BITS:
        bits = tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
