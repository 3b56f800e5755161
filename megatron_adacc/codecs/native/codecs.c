/* Fused CPU kernels of the int4 and bitmask codecs: one pass over each group, in cache.
 *
 * Bit-exact twins of the PyTorch reference (codecs/symmetric.py, asymmetric.py, bitmask.py):
 * the same fp32 operations in the same order, IEEE division, no FMA contraction
 * (built with -ffp-contract=off, never -ffast-math). Element types: 0 fp32, 1 bf16, 2 fp16.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_SCALE 1.1754943508222875e-38f /* 2^-126, as int4.MIN_SCALE */
#define NAN_SCALE_BITS 0x7FC0u /* int4.NAN_BITS[bfloat16]: a non-finite group's scale */

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline float load(const void *p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    if (dtype == 1) return bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return (float)((const _Float16 *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 0) { ((float *)p)[i] = v; return; }
    if (dtype == 1) { /* round to nearest even; a quiet NaN stays NaN */
        uint32_t b = float_to_bits(v);
        ((uint16_t *)p)[i] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
        return;
    }
    ((_Float16 *)p)[i] = (_Float16)v;
}

static inline float ceil_to_bf16(float v) { /* finite v >= 0 */
    return bits_to_float((float_to_bits(v) + 0xFFFFu) & 0xFFFF0000u);
}

static inline uint16_t bf16_bits(float exactly_bf16) { return (uint16_t)(float_to_bits(exactly_bf16) >> 16); }

static inline float clamp_code(float v) { return v < 0.0f ? 0.0f : (v > 15.0f ? 15.0f : v); }

/* The largest finite value of the element type (int4.saturate clamps decoded values to it). */
static inline float dtype_max(int dtype) {
    return dtype == 0 ? 3.4028234663852886e38f : dtype == 1 ? 3.3895313892515355e38f : 65504.0f;
}

/* int4.saturate in fp32: v clamped to [-dmax, dmax]; NaN passes (both comparisons fail). */
static inline float saturate(float v, float dmax) { return v > dmax ? dmax : (v < -dmax ? -dmax : v); }

/* Vectors of LANES fp32 lanes, one register: 16 with AVX-512, 8 elsewhere (one AVX2
 * register; wider GCC vectors there are split for arithmetic but shuffled, narrowed and
 * converted one lane at a time, with most values spilled to the stack). Written with GCC
 * vector types because the compiler does not vectorize float min/max reductions without
 * -ffast-math. The kernels step through a group BLOCK = 2 * LANES elements at a time, as a
 * Pair: the even-indexed elements in one vector, the odd-indexed ones in the other. That is
 * the order in which int4 codes pair up in a byte, and bf16 splits into it with two bit
 * operations and no shuffle (the one shuffle port is what bounds these loops). The layout of
 * a payload does not depend on LANES. */
#ifdef __AVX512F__
#define LANES 16
#else
#define LANES 8
#endif
#define BLOCK (2 * LANES)
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef _Float16 vfh __attribute__((vector_size(2 * LANES)));      /* LANES fp16 values */
typedef _Float16 vfh_block __attribute__((vector_size(4 * LANES))); /* BLOCK fp16 values */
typedef uint8_t vbytes __attribute__((vector_size(LANES)));
typedef double vd __attribute__((vector_size(4 * LANES))); /* LANES / 2 doubles: one register */
typedef uint64_t vq __attribute__((vector_size(4 * LANES)));
typedef int16_t vkey __attribute__((vector_size(4 * LANES))); /* BLOCK bf16 values' bits */
typedef float vf_half __attribute__((vector_size(2 * LANES)));      /* LANES / 2 floats: half a register */
typedef uint32_t vu_half __attribute__((vector_size(2 * LANES)));
typedef _Float16 vfh_half __attribute__((vector_size(LANES)));      /* LANES / 2 fp16 values */
/* Unaligned views for loads and stores of single registers: GCC copies arrays of vectors
 * (memcpy) through the stack in 32-byte halves, which stalls the following 64-byte load. */
typedef double vd_unaligned __attribute__((vector_size(4 * LANES), aligned(8)));
typedef float vf_unaligned __attribute__((vector_size(4 * LANES), aligned(4)));
typedef struct { vf even, odd; } Pair;

#define INLINE static inline __attribute__((always_inline))
#define PREFETCH_ELEMENTS 1024
/* Shuffle indices: of a BLOCK (two vectors) the even and odd elements, and back. */
#if LANES == 16
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31
#define FIRST_HALF 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15
#define SECOND_HALF 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31
#define INTERLEAVED_LOW 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define INTERLEAVED_HIGH 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
/* fold_lanes: the halves of each 2w-lane segment of two vectors, w = 8, 4, 2, 1 */
#define FOLD8_X 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define FOLD8_Y 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define FOLD4_X 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define FOLD4_Y 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define FOLD2_X 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define FOLD2_Y 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define FOLD1_X 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define FOLD1_Y 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static const int BIT_REVERSED[LANES] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
#define EVENS 0, 2, 4, 6, 8, 10, 12, 14
#define ODDS 1, 3, 5, 7, 9, 11, 13, 15
#define FIRST_HALF 0, 1, 2, 3, 4, 5, 6, 7
#define SECOND_HALF 8, 9, 10, 11, 12, 13, 14, 15
#define INTERLEAVED_LOW 0, 8, 1, 9, 2, 10, 3, 11
#define INTERLEAVED_HIGH 4, 12, 5, 13, 6, 14, 7, 15
#define FOLD4_X 0, 1, 2, 3, 8, 9, 10, 11
#define FOLD4_Y 4, 5, 6, 7, 12, 13, 14, 15
#define FOLD2_X 0, 1, 8, 9, 4, 5, 12, 13
#define FOLD2_Y 2, 3, 10, 11, 6, 7, 14, 15
#define FOLD1_X 0, 8, 2, 10, 4, 12, 6, 14
#define FOLD1_Y 1, 9, 3, 11, 5, 13, 7, 15
static const int BIT_REVERSED[LANES] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif
#define INTERLEAVED INTERLEAVED_LOW, INTERLEAVED_HIGH

INLINE vf splat(float v) { return (vf){0} + v; }
#define NEGATIVE_ZEROS ((vf)((vi){0} + INT32_MIN)) /* splat(-0.0f) is +0: 0 + -0 = +0 */
INLINE vf blend(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }
INLINE vf vsaturate(vf v, float dmax) { /* saturate, lane-wise */
    v = blend(v > dmax, splat(dmax), v);
    return blend(v < -dmax, splat(-dmax), v);
}

/* Decoded values as bf16 bits in the low halves of the lanes, rounded to nearest even (a quiet
 * NaN stays a NaN: its top mantissa bit absorbs the carry). */
INLINE vu bf16_rounded(vf v) {
    vu b = (vu)v;
    return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

/* bf16 keys (BF16_KEYS, where an instruction set defines key_min, key_max, key_umax and
 * fold_keys): fold_keys(v, op) leaves the signed minima (op KEY_MIN), signed maxima (KEY_MAX)
 * or unsigned maxima (KEY_UMAX) of the 16-bit words of each of the LANES groups (v[g]: group
 * g's) in the low half of lane g, by a transposing reduction that halves the registers at
 * each step of KEY_OP. */
enum { KEY_MIN, KEY_MAX, KEY_UMAX };
#define KEY_OP(a, b)                                                        \
    (op == KEY_UMAX ? key_umax((vkey)(a), (vkey)(b))                        \
     : op == KEY_MAX ? key_max((vkey)(a), (vkey)(b)) : key_min((vkey)(a), (vkey)(b)))

/* The vector primitives, per instruction set: AVX-512, AVX2 with F16C, or generic GCC vector
 * code for anything else. vmin and vmax: lane-wise, where a lane holds NaN either returns b
 * (as vminps does). bits_max and bits_umax: the lane of greater bits, as signed or unsigned
 * 32-bit integers (sym_bounds). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTOR_ISA "avx512"
INLINE vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
INLINE vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
INLINE vi widen_bytes(const uint8_t *in) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)in)); }
INLINE vi min_int(vi a, vi b) { return (vi)_mm512_min_epi32((__m512i)a, (__m512i)b); }
INLINE vf bits_max(vf a, vf b) { return (vf)_mm512_max_epi32((__m512i)a, (__m512i)b); }
INLINE vf bits_umax(vf a, vf b) { return (vf)_mm512_max_epu32((__m512i)a, (__m512i)b); }
INLINE vd to_doubles(vf_half v) { return (vd)_mm512_cvtps_pd((__m256)v); } /* GCC splits it in two */
#ifdef __AVX512BW__
/* bf16 decoding by table (unpack_group): a group's 16 possible values, rounded once, and
 * each 16 codes looked up with one vpermw of a 256-bit register (the 512-bit form, two tables
 * and 32 codes at a time, measured 10% slower); the arithmetic and rounding per element were
 * most of the decode. */
#define BF16_DECODE_TABLES
typedef __m256i Bf16Tables;

INLINE Bf16Tables bf16_tables(float shift, float bias, float scale) {
    const vf codes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return _mm512_cvtepi32_epi16((__m512i)bf16_rounded(vsaturate(shift + (codes - bias) * scale, dtype_max(1))));
}

/* 32 bytes of codes -> 64 bf16 values in element order: byte j widened into dword j, whose
 * low word indexes the table by its low nibble and high word by its high nibble (vpermw reads
 * the low 4 bits of each). */
INLINE void bf16_lookup(const uint8_t *in, Bf16Tables t, uint16_t *out) {
    for (int k = 0; k < 4; k++) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + 8 * k)));
        _mm256_storeu_si256((__m256i *)(out + 16 * k), _mm256_permutexvar_epi16(_mm256_or_si256(d, _mm256_slli_epi32(d, 12)), t));
    }
}

/* bf16 ranges on int16 keys (bf16_batch_ranges). */
#define BF16_KEYS
INLINE vkey key_min(vkey a, vkey b) { return (vkey)_mm512_min_epi16((__m512i)a, (__m512i)b); }
INLINE vkey key_max(vkey a, vkey b) { return (vkey)_mm512_max_epi16((__m512i)a, (__m512i)b); }
INLINE vkey key_umax(vkey a, vkey b) { return (vkey)_mm512_max_epu16((__m512i)a, (__m512i)b); }

INLINE vkey fold_keys(vkey v[LANES], int op) {
    __m512i w[LANES];
    for (int j = 0; j < 8; j++) /* 256-bit half k of w[j]: group 2j + k */
        w[j] = (__m512i)KEY_OP(_mm512_shuffle_i64x2((__m512i)v[2 * j], (__m512i)v[2 * j + 1], 0x44),
                               _mm512_shuffle_i64x2((__m512i)v[2 * j], (__m512i)v[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++) /* 128-bit lane k of w[j]: group 4j + k */
        w[j] = (__m512i)KEY_OP(_mm512_shuffle_i64x2(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_i64x2(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int j = 0; j < 2; j++) /* lane k of w[j]: groups 8j + k, 8j + 4 + k */
        w[j] = (__m512i)KEY_OP(_mm512_unpacklo_epi64(w[2 * j], w[2 * j + 1]), _mm512_unpackhi_epi64(w[2 * j], w[2 * j + 1]));
    const __m512 a = _mm512_castsi512_ps(w[0]), b = _mm512_castsi512_ps(w[1]);
    vkey f = KEY_OP(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    f = KEY_OP(f, (vu)f >> 16); /* dword 4k + m: group k + 4m */
    return (vkey)_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                          (__m512i)f);
}

/* bf16 codes packed two blocks (64 elements) at a time (pack_group): one clamp of 64 bytes
 * and one permutation where narrowing each block took two. */
#define BF16_PACKED_BLOCKS 2

/* Codes of two blocks (Pair layout, each in [0, 16]: pack_blocks clamps) -> 32 bytes. */
INLINE void pack_blocks(const vi even[2], const vi odd[2], uint8_t *out) {
    /* 128-bit lane k: block 0's even codes 4k..4k+3, block 1's, then the odd ones the same */
    __m512i bytes = _mm512_packus_epi16(_mm512_packus_epi32((__m512i)even[0], (__m512i)even[1]),
                                        _mm512_packus_epi32((__m512i)odd[0], (__m512i)odd[1]));
    bytes = _mm512_min_epu8(bytes, _mm512_set1_epi8(15));
    bytes = _mm512_or_si512(bytes, _mm512_slli_epi16(_mm512_bsrli_epi128(bytes, 8), 4));
    /* dword 0 of lane k: block 0's bytes 4k..4k+3; dword 1: block 1's */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm256_storeu_si256((__m256i *)out, _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, bytes)));
}
#endif
#elif defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define VECTOR_ISA "avx2"
/* GCC does not find single instructions for these on AVX2 from generic vector code (it
 * blends for min and max, and converts to and from fp16 one lane at a time). */
#define AVX2_SHUFFLES
INLINE vf vmin(vf a, vf b) { return (vf)_mm256_min_ps((__m256)a, (__m256)b); }
INLINE vf vmax(vf a, vf b) { return (vf)_mm256_max_ps((__m256)a, (__m256)b); }
INLINE vi widen_bytes(const uint8_t *in) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)in)); }
INLINE vi min_int(vi a, vi b) { return (vi)_mm256_min_epi32((__m256i)a, (__m256i)b); }
INLINE vf bits_max(vf a, vf b) { return (vf)_mm256_max_epi32((__m256i)a, (__m256i)b); }
INLINE vf bits_umax(vf a, vf b) { return (vf)_mm256_max_epu32((__m256i)a, (__m256i)b); }
INLINE vd to_doubles(vf_half v) { return (vd)_mm256_cvtps_pd((__m128)v); }

/* The even (odd) elements of the 16 values a, b, in order: a0 a2 b0 b2 | a4 a6 b4 b6 within
 * the 128-bit lanes, then the middle 64-bit quarters swapped. */
INLINE Pair deinterleave(vf a, vf b) {
    __m256d even = _mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, _MM_SHUFFLE(2, 0, 2, 0)));
    __m256d odd = _mm256_castps_pd(_mm256_shuffle_ps((__m256)a, (__m256)b, _MM_SHUFFLE(3, 1, 3, 1)));
    return (Pair){(vf)_mm256_castpd_ps(_mm256_permute4x64_pd(even, _MM_SHUFFLE(3, 1, 2, 0))),
                  (vf)_mm256_castpd_ps(_mm256_permute4x64_pd(odd, _MM_SHUFFLE(3, 1, 2, 0)))};
}

/* The inverse: elements 0-7 in *a, 8-15 in *b. */
INLINE void interleave(Pair v, vf *a, vf *b) {
    __m256 low = _mm256_unpacklo_ps((__m256)v.even, (__m256)v.odd);   /* e0 o0 e1 o1 | e4 o4 e5 o5 */
    __m256 high = _mm256_unpackhi_ps((__m256)v.even, (__m256)v.odd);  /* e2 o2 e3 o3 | e6 o6 e7 o7 */
    *a = (vf)_mm256_permute2f128_ps(low, high, 0x20);
    *b = (vf)_mm256_permute2f128_ps(low, high, 0x31);
}

/* BLOCK fp16 values (their bits) -> the first LANES in *a, the others in *b, as fp32 (exact). */
INLINE void widen_halves(vu bits, vf *a, vf *b) {
    *a = (vf)_mm256_cvtph_ps(_mm256_castsi256_si128((__m256i)bits));
    *b = (vf)_mm256_cvtph_ps(_mm256_extracti128_si256((__m256i)bits, 1));
}

/* A Pair -> its BLOCK values as fp16 bits in element order, rounded to nearest even. */
INLINE vu narrow_to_halves(Pair v) {
    __m128i even = _mm256_cvtps_ph((__m256)v.even, _MM_FROUND_TO_NEAREST_INT);
    __m128i odd = _mm256_cvtps_ph((__m256)v.odd, _MM_FROUND_TO_NEAREST_INT);
    return (vu)_mm256_set_m128i(_mm_unpackhi_epi16(even, odd), _mm_unpacklo_epi16(even, odd));
}

/* LANES values in [0, 255] -> LANES bytes. */
INLINE vbytes narrow_bytes(vi v) {
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128((__m256i)v), _mm256_extracti128_si256((__m256i)v, 1));
    return (vbytes)_mm_cvtsi128_si64(_mm_packus_epi16(words, words));
}

/* bf16 decoding by table (unpack_group): a row's 16 possible values, rounded once, and each
 * 64 codes (32 bytes) looked up with vpshufb, low and high bytes apart; the arithmetic and
 * rounding per element were most of the decode. */
#define BF16_DECODE_TABLES
typedef struct { __m256i low, high; } Bf16Tables;

/* The tables of a group's 16 values shift + (code - bias) * scale as bf16 bits: vpshufb's
 * 16-byte tables of their low and high bytes, in both lanes. */
INLINE Bf16Tables bf16_tables(float shift, float bias, float scale) {
    const vf first = {0, 1, 2, 3, 8, 9, 10, 11}, second = {4, 5, 6, 7, 12, 13, 14, 15};
    const float dmax = dtype_max(1);
    __m256i words = _mm256_packus_epi32((__m256i)bf16_rounded(vsaturate(shift + (first - bias) * scale, dmax)),
                                        (__m256i)bf16_rounded(vsaturate(shift + (second - bias) * scale, dmax)));
    /* codes 0-7 | 8-15 */
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    __m256i bytes = _mm256_shuffle_epi8(words, split); /* low 0-7, high 0-7 | low 8-15, high 8-15 */
    return (Bf16Tables){_mm256_permute4x64_epi64(bytes, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm256_permute4x64_epi64(bytes, _MM_SHUFFLE(3, 1, 3, 1))};
}

/* 32 bytes of codes -> 64 bf16 values in element order. The dword permutation puts into each
 * lane the bytes whose codes the unpacking below brings back to that lane's outputs. */
INLINE void bf16_lookup(const uint8_t *in, Bf16Tables t, uint16_t *out) {
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i b = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)in),
                                            _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    __m256i even = _mm256_and_si256(b, nibble), odd = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
    __m256i codes[2] = {_mm256_unpacklo_epi8(even, odd), _mm256_unpackhi_epi8(even, odd)};
    for (int k = 0; k < 2; k++) { /* elements 0-7, 16-23 | 8-15, 24-31 of this half of the 64 */
        __m256i low = _mm256_shuffle_epi8(t.low, codes[k]), high = _mm256_shuffle_epi8(t.high, codes[k]);
        _mm256_storeu_si256((__m256i *)out + 2 * k, _mm256_unpacklo_epi8(low, high));
        _mm256_storeu_si256((__m256i *)out + 2 * k + 1, _mm256_unpackhi_epi8(low, high));
    }
}

/* bf16 ranges on int16 keys (bf16_batch_ranges; per group, bf16_group_blocks), and codes
 * packed four blocks (64 elements) at a time (pack_group, pack_blocks). */
#define BF16_KEYS
#define BF16_KEY_RANGES
#define BF16_PACKED_BLOCKS 4
INLINE vkey key_min(vkey a, vkey b) { return (vkey)_mm256_min_epi16((__m256i)a, (__m256i)b); }
INLINE vkey key_max(vkey a, vkey b) { return (vkey)_mm256_max_epi16((__m256i)a, (__m256i)b); }
INLINE vkey key_umax(vkey a, vkey b) { return (vkey)_mm256_max_epu16((__m256i)a, (__m256i)b); }

INLINE vkey fold_keys(vkey v[LANES], int op) {
    __m256i w[LANES];
    for (int j = 0; j < 4; j++) /* 128-bit lane k of w[j]: group 2j + k */
        w[j] = (__m256i)KEY_OP(_mm256_permute2x128_si256((__m256i)v[2 * j], (__m256i)v[2 * j + 1], 0x20),
                               _mm256_permute2x128_si256((__m256i)v[2 * j], (__m256i)v[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++) /* lane k of w[j]: groups 4j + k, 4j + 2 + k */
        w[j] = (__m256i)KEY_OP(_mm256_unpacklo_epi64(w[2 * j], w[2 * j + 1]), _mm256_unpackhi_epi64(w[2 * j], w[2 * j + 1]));
    const __m256 a = _mm256_castsi256_ps(w[0]), b = _mm256_castsi256_ps(w[1]);
    vkey f = KEY_OP(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
    f = KEY_OP(f, (vu)f >> 16); /* dword 4k + m: group k + 2m */
    return (vkey)_mm256_permutevar8x32_epi32((__m256i)f, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Codes of four blocks (Pair layout, each in [0, 16]: pack_blocks clamps) -> 32 bytes. */
INLINE void pack_blocks(const vi even[4], const vi odd[4], uint8_t *out) {
    const __m256i top = _mm256_set1_epi8(15);
    __m256i e = _mm256_packus_epi16(_mm256_packus_epi32((__m256i)even[0], (__m256i)even[1]),
                                    _mm256_packus_epi32((__m256i)even[2], (__m256i)even[3]));
    __m256i o = _mm256_packus_epi16(_mm256_packus_epi32((__m256i)odd[0], (__m256i)odd[1]),
                                    _mm256_packus_epi32((__m256i)odd[2], (__m256i)odd[3]));
    __m256i bytes = _mm256_or_si256(_mm256_min_epu8(e, top), _mm256_slli_epi16(_mm256_min_epu8(o, top), 4));
    /* dword k of lane j holds block k's codes 4j..4j+3 */
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)out, bytes);
}
#else /* the generic forms compile to three or four instructions each */
#define VECTOR_ISA "generic"
INLINE vf vmin(vf a, vf b) { return blend(a < b, a, b); }
INLINE vf vmax(vf a, vf b) { return blend(a > b, a, b); }
INLINE vi widen_bytes(const uint8_t *in) {
    vbytes bytes;
    memcpy(&bytes, in, sizeof bytes);
    return __builtin_convertvector(bytes, vi);
}
INLINE vi min_int(vi a, vi b) {
    vi less = a < b;
    return (a & less) | (b & ~less);
}
INLINE vf bits_max(vf a, vf b) { return blend((vi)a > (vi)b, a, b); }
INLINE vf bits_umax(vf a, vf b) { return blend((vi)((vu)a > (vu)b), a, b); }
INLINE vd to_doubles(vf_half v) { return __builtin_convertvector(v, vd); }
#endif

/* Shuffles and conversions as generic vector code: one or two instructions each with
 * AVX-512. */
#ifndef AVX2_SHUFFLES
INLINE Pair deinterleave(vf a, vf b) {
    return (Pair){__builtin_shufflevector(a, b, EVENS), __builtin_shufflevector(a, b, ODDS)};
}

INLINE void interleave(Pair v, vf *a, vf *b) { /* two shuffles: one of 2 * LANES measured 1.5x slower */
    *a = __builtin_shufflevector(v.even, v.odd, INTERLEAVED_LOW);
    *b = __builtin_shufflevector(v.even, v.odd, INTERLEAVED_HIGH);
}

INLINE void widen_halves(vu bits, vf *a, vf *b) {
    vfh_block halves = (vfh_block)bits;
    *a = __builtin_convertvector(__builtin_shufflevector(halves, halves, FIRST_HALF), vf);
    *b = __builtin_convertvector(__builtin_shufflevector(halves, halves, SECOND_HALF), vf);
}

INLINE vu narrow_to_halves(Pair v) {
    vfh e = __builtin_convertvector(v.even, vfh), o = __builtin_convertvector(v.odd, vfh);
    return (vu)__builtin_shufflevector(e, o, INTERLEAVED);
}

INLINE vbytes narrow_bytes(vi v) { return __builtin_convertvector(v, vbytes); }
#endif

const char *vector_isa(void) { return VECTOR_ISA; }

/* Asks for the cache lines of block [i, i + BLOCK) of x, to read (write: 0) or to write (1). */
#define PREFETCH_AT(x, i, dtype, write)                                                         \
    do {                                                                                        \
        const int size_ = (dtype) == 0 ? 4 : 2;                                                 \
        const char *at_ = (const char *)(x) + (i) * size_;                                      \
        for (int line_ = 0; line_ < BLOCK * size_; line_ += 64) __builtin_prefetch(at_ + line_, write); \
    } while (0)

/* The block PREFETCH_ELEMENTS past block i: the hardware prefetchers alone left the first
 * loads of each group waiting on memory, 40% of an encode's time, and the decode's loads of
 * codes and stores of values half of its. The distance counts elements, a batch of groups
 * ahead whatever their width: at 2048 bytes, fp32 encodes with zeroed channels waited on
 * memory (28% slower than at 4096; bf16 the same at both). A strided input's groups ask for
 * the block as far ahead in their rows (strided_offsets). */
#define PREFETCH_BLOCK(x, i, dtype, write) PREFETCH_AT(x, (i) + PREFETCH_ELEMENTS, dtype, write)

/* bf16 values two to a 32-bit lane (an even element in its low half, an odd one above) as
 * fp32 in the Pair layout: two bit operations. */
INLINE Pair bf16_pair(vu bits) { return (Pair){(vf)(bits << 16), (vf)(bits & 0xFFFF0000u)}; }

/* Elements [i, i + BLOCK) of x as fp32, for reductions that do not depend on the order of a
 * block's elements: bf16 in the Pair layout (it splits into it with two bit operations),
 * fp32 and fp16 in element order, the first LANES in .even (deinterleaving those cost two
 * shuffles a block, on the one shuffle port). With `mask` (BLOCK entries of x's element
 * width), its bits are ANDed into the elements first. */
INLINE Pair load_block(const void *x, int64_t i, int dtype, const void *mask) {
    Pair p;
    if (dtype == 1) {
        vu u, m;
        memcpy(&u, (const uint16_t *)x + i, sizeof u);
        if (mask) { memcpy(&m, mask, sizeof m); u &= m; }
        p = bf16_pair(u);
    } else if (dtype == 0) {
        memcpy(&p.even, (const float *)x + i, sizeof p.even);
        memcpy(&p.odd, (const float *)x + i + LANES, sizeof p.odd);
        if (mask) { /* one register each: a copy of both went through the stack, a stall per block */
            vi m_a, m_b;
            memcpy(&m_a, mask, sizeof m_a);
            memcpy(&m_b, (const vi *)mask + 1, sizeof m_b);
            p.even = (vf)((vi)p.even & m_a);
            p.odd = (vf)((vi)p.odd & m_b);
        }
    } else {
        vu h, m;
        memcpy(&h, (const _Float16 *)x + i, sizeof h);
        if (mask) { memcpy(&m, mask, sizeof m); h &= m; }
        widen_halves(h, &p.even, &p.odd);
    }
    return p;
}

/* The same elements in the Pair layout: even-indexed ones in .even, odd-indexed in .odd. */
INLINE Pair load_pair(const void *x, int64_t i, int dtype, const void *mask) {
    Pair p = load_block(x, i, dtype, mask);
    return dtype == 1 ? p : deinterleave(p.even, p.odd);
}


/* The inverse, for decoded values: bf16 rounds to nearest even by hand (bf16_rounded). */
INLINE void store_pair(void *out, int64_t i, Pair v, int dtype) {
    if (dtype == 1) {
        vu bits = bf16_rounded(v.even) | bf16_rounded(v.odd) << 16;
        memcpy((uint16_t *)out + i, &bits, sizeof bits);
    } else if (dtype == 0) {
        vf a, b;
        interleave(v, &a, &b);
        memcpy((float *)out + i, &a, sizeof a);
        memcpy((float *)out + i + LANES, &b, sizeof b);
    } else {
        vu h = narrow_to_halves(v);
        memcpy((_Float16 *)out + i, &h, sizeof h);
    }
}

/* Codes in [0, 15] of a block -> LANES bytes, element 2j in the low nibble of byte j. */
INLINE void pack_pair(vi even, vi odd, uint8_t *out) {
    vbytes bytes = narrow_bytes(even | (odd << 4));
    memcpy(out, &bytes, sizeof bytes);
}

INLINE Pair unpack_pair(const uint8_t *in) {
    vi b = widen_bytes(in);
    return (Pair){__builtin_convertvector(b & 15, vf), __builtin_convertvector(b >> 4, vf)};
}

/* Per-column values (scales, flags) in the Pair layout: within each whole block of BLOCK
 * columns, the even columns' entries first, then the odd ones'; the columns past the last
 * whole block in plain order. */
INLINE int64_t pair_slot(int64_t c, int64_t cols) {
    if (c >= cols / BLOCK * BLOCK) return c;
    return c / BLOCK * BLOCK + c % BLOCK / 2 + (c % 2) * LANES;
}

/* Element i of a group starting at `base` is zeroed unless keep[(base + i) % channels] (the
 * outlier codec's channels): keep (zeroing_for) holds all-ones or 0 in the element width of
 * the input, for channels + BLOCK entries, keep[j] = keep[j % channels], so one load never
 * wraps. Every group of a tensor with zeroed channels is masked: branching on whether each
 * group holds one, into loops without the mask, was mispredicted about half the time on
 * outlier data, and cost more than the masks. */
typedef struct { const void *keep; int64_t channels; } Zeroing;

static const Zeroing NO_ZEROING = {NULL, 0};

INLINE int64_t first_channel(Zeroing z, int64_t base) { return z.keep ? base % z.channels : 0; }

INLINE int64_t next_channel(Zeroing z, int64_t ch, int64_t step) {
    if (!z.keep) return 0;
    ch += step;
    return ch >= z.channels ? ch % z.channels : ch;
}

INLINE const void *keep_at(Zeroing z, int64_t ch, int dtype) {
    return z.keep ? (const char *)z.keep + ch * (dtype == 0 ? 4 : 2) : NULL;
}

INLINE float load_kept(const void *x, int64_t i, int dtype, Zeroing z, int64_t ch) {
    float v = load(x, i, dtype);
    if (!z.keep) return v;
    int kept = dtype == 0 ? ((const int32_t *)z.keep)[ch] != 0 : ((const int16_t *)z.keep)[ch] != 0;
    return kept ? v : 0.0f;
}

/* The symmetric codecs need less of a group than its range: symmetric.sym_scales gives
 * (lo, hi) the scale it gives (min(lo, -0), max(hi, +0)) (tests/codecs/test_codecs.py), the group's
 * sym bounds: its most negative element or -0 where none is negative, and its most positive
 * or +0. On IEEE bits both are maxima: the unsigned one from -0 (a set sign bit outweighs
 * every magnitude, and a greater magnitude weighs more) and the signed one from +0 (the
 * positive bits order as their values). An integer max a block each, where a range took two
 * float operations and a NaN check (or the bf16 key transform); a NaN or an infinity has
 * the greatest bits of its sign, so the bounds alone tell whether the group is finite. */

#ifdef BF16_KEYS
/* Order-preserving int16 keys of bf16 bits (the magnitude bits flipped where the sign is set,
 * -0 just below +0), and back: the map is its own inverse. A register of keys to a min or
 * max where the floats took two splitting operations for half as many. */
INLINE vkey bf16_keys(vkey w) { return w ^ ((w >> 15) & 0x7FFF); }

/* The lane-wise minimum and maximum keys of the whole blocks of a bf16 group of `cols`
 * inputs starting at channel ch; with `sym`, the lane-wise sym bounds' bits instead (the
 * sign bit, INT16_MIN, is -0). */
INLINE void group_keys(const void *x, int64_t base, int64_t ahead, int64_t cols, Zeroing z, int64_t ch, int sym,
                       vkey *low, vkey *high) {
    vkey lowest = (vkey){0} + (int16_t)(sym ? INT16_MIN : INT16_MAX);
    vkey highest = (vkey){0} + (int16_t)(sym ? 0 : INT16_MIN);
    for (int64_t c = 0; c + BLOCK <= cols; c += BLOCK) {
        PREFETCH_AT(x, ahead + c, 1, 0);
        vkey w, keep;
        memcpy(&w, (const uint16_t *)x + base + c, sizeof w);
        if (z.keep) { memcpy(&keep, keep_at(z, ch, 1), sizeof keep); w &= keep; }
        ch = next_channel(z, ch, BLOCK);
        if (sym) {
            lowest = key_umax(lowest, w);
            highest = key_max(highest, w);
        } else {
            vkey key = bf16_keys(w);
            lowest = key_min(lowest, key);
            highest = key_max(highest, key);
        }
    }
    *low = lowest;
    *high = highest;
}
#endif

#ifdef BF16_KEY_RANGES
/* group_blocks for bf16 groups of at least one whole block and a part of one (whole blocks
 * take bf16_batch_ranges). An infinity or NaN has the greatest or least key (or bits), so the
 * ranges alone tell whether the group is finite: the poison is taken before the even and odd
 * halves are folded, where vmin and vmax would drop a NaN in the first. */
INLINE void bf16_group_blocks(const void *x, int64_t base, int64_t ahead, int64_t cols, Zeroing z, int64_t ch,
                              int sym, vf *lo, vf *hi, vf *poison) {
    vkey low, high;
    group_keys(x, base, ahead, cols, z, ch, sym, &low, &high);
    if (!sym) low = bf16_keys(low), high = bf16_keys(high);
    const Pair l = bf16_pair((vu)low), h = bf16_pair((vu)high);
    *lo = sym ? bits_umax(l.even, l.odd) : vmin(l.even, l.odd);
    *hi = sym ? bits_max(h.even, h.odd) : vmax(h.even, h.odd);
    *poison = (l.even - l.even) + (l.odd - l.odd) + (h.even - h.even) + (h.odd - h.odd);
}
#endif

/* Lane-wise minima, maxima and poison (0, or NaN where a NaN or an infinity was met) of the
 * whole blocks of a group of `cols` inputs starting at channel ch; with `sym`, the lane-wise
 * sym bounds, whose poison they tell themselves. Minima and maxima of finite values do not
 * depend on the order (signed zeros cannot change a scale, see symmetric.sym_scales). */
INLINE void group_blocks(const void *x, int64_t base, int64_t ahead, int64_t cols, int dtype, Zeroing z,
                         int64_t ch, int sym, vf *lo, vf *hi, vf *poison) {
#ifdef BF16_KEY_RANGES
    if (dtype == 1 && cols >= BLOCK) {
        bf16_group_blocks(x, base, ahead, cols, z, ch, sym, lo, hi, poison);
        return;
    }
#endif
    vf vlo = sym ? NEGATIVE_ZEROS : splat(INFINITY), vhi = splat(sym ? 0.0f : -INFINITY), bad = {0};
    for (int64_t c = 0; c + BLOCK <= cols; c += BLOCK) {
        PREFETCH_AT(x, ahead + c, dtype, 0);
        Pair p = load_block(x, base + c, dtype, keep_at(z, ch, dtype));
        ch = next_channel(z, ch, BLOCK);
        if (sym) {
            vlo = bits_umax(bits_umax(p.even, p.odd), vlo);
            vhi = bits_max(bits_max(p.even, p.odd), vhi);
        } else {
            bad += (p.even - p.even) + (p.odd - p.odd); /* stays 0 unless a NaN or an infinity */
            vlo = vmin(vmin(p.even, p.odd), vlo);
            vhi = vmax(vmax(p.even, p.odd), vhi);
        }
    }
    *lo = vlo;
    *hi = vhi;
    *poison = sym ? (vlo - vlo) + (vhi - vhi) : bad;
}

/* The group's elements past its whole blocks folded into *lo and *hi; returns 0 if one is NaN
 * or infinite. */
INLINE int group_tail(const void *x, int64_t base, int64_t cols, int dtype, Zeroing z, int64_t ch, float *lo,
                      float *hi) {
    int finite = 1;
    int64_t c = cols / BLOCK * BLOCK;
    for (ch = next_channel(z, ch, c); c < cols; c++, ch = next_channel(z, ch, 1)) {
        float v = load_kept(x, base + c, dtype, z, ch);
        finite &= isfinite(v) != 0;
        *lo = v < *lo ? v : *lo;
        *hi = v > *hi ? v : *hi;
    }
    return finite;
}

/* v[j] = op of the halves of each 2w-lane segment of v[2j] and v[2j + 1] (X, Y: FOLDw_X, _Y). */
#define FOLD_LEVEL(op, v, count, X, Y)                                                              \
    for (int j = 0; j < (count); j++)                                                               \
    v[j] = op(__builtin_shufflevector(v[2 * j], v[2 * j + 1], X), __builtin_shufflevector(v[2 * j], v[2 * j + 1], Y))

/* The LANES vectors v folded by op down to v[0] (see batch_ranges). */
#if LANES == 16
#define FOLD(op, v)                               \
    do {                                          \
        FOLD_LEVEL(op, v, 8, FOLD8_X, FOLD8_Y);   \
        FOLD_LEVEL(op, v, 4, FOLD4_X, FOLD4_Y);   \
        FOLD_LEVEL(op, v, 2, FOLD2_X, FOLD2_Y);   \
        FOLD_LEVEL(op, v, 1, FOLD1_X, FOLD1_Y);   \
    } while (0)
#else
#define FOLD(op, v)                               \
    do {                                          \
        FOLD_LEVEL(op, v, 4, FOLD4_X, FOLD4_Y);   \
        FOLD_LEVEL(op, v, 2, FOLD2_X, FOLD2_Y);   \
        FOLD_LEVEL(op, v, 1, FOLD1_X, FOLD1_Y);   \
    } while (0)
#endif

INLINE vf vadd(vf a, vf b) { return a + b; }

/* Per-column multipliers and flags of channel_int4, in the Pair layout (pair_slot); no flags
 * where every column is usable (their masks took a third of the bf16 pass). */
typedef struct { const float *inv; const int32_t *ok; } Columns;

INLINE vi block_codes(vf v, vf shift, vf mul, vf bias, const int32_t *col_ok) {
    vi q = min_int(__builtin_convertvector((v - shift) * mul + bias, vi), (vi){0} + 15);
    if (col_ok) {
        vi ok;
        memcpy(&ok, col_ok, sizeof ok);
        q = (q & ok) | (8 & ~ok);
    }
    return q;
}

/* Codes of a group: clamp(floor((v - shift) * inv + bias), 0, 15), packed two per byte.
 * With per-column multipliers, element c multiplies by its column's instead, and takes
 * code 8 where its column's flag is 0; it then prefetches its input, which no range pass
 * over the group has brought in (fp32 ran 1.3x slower without). The vector path truncates
 * and clamps only above: with a usable scale, (v - shift) * inv + bias >= 0.5 - 2^-20 for
 * both codecs (sym: |v| * |inv| <= 8 and bias 8.5; asym: v >= shift and bias 0.5), where
 * truncating is flooring. */
INLINE void pack_group(const void *x, int64_t base, int64_t cols, int dtype, Zeroing z, int64_t ch, float shift,
                       float inv, float bias, Columns col, uint8_t *out) {
    int64_t c = 0;
    vf mul_even = splat(inv), mul_odd = mul_even;
#ifdef BF16_PACKED_BLOCKS
    if (dtype == 1)
        for (; c + BF16_PACKED_BLOCKS * BLOCK <= cols; c += BF16_PACKED_BLOCKS * BLOCK) {
            vi even[BF16_PACKED_BLOCKS], odd[BF16_PACKED_BLOCKS];
            for (int b = 0; b < BF16_PACKED_BLOCKS; b++) {
                const int64_t at = c + b * BLOCK;
                if (col.inv) PREFETCH_BLOCK(x, base + at, dtype, 0);
                Pair p = load_pair(x, base + at, dtype, keep_at(z, ch, dtype));
                ch = next_channel(z, ch, BLOCK);
                if (col.inv) {
                    memcpy(&mul_even, col.inv + at, sizeof mul_even);
                    memcpy(&mul_odd, col.inv + at + LANES, sizeof mul_odd);
                }
                even[b] = __builtin_convertvector((p.even - shift) * mul_even + bias, vi);
                odd[b] = __builtin_convertvector((p.odd - shift) * mul_odd + bias, vi);
                if (col.ok) { /* code 8 in the unusable columns */
                    vi ok_even, ok_odd;
                    memcpy(&ok_even, col.ok + at, sizeof ok_even);
                    memcpy(&ok_odd, col.ok + at + LANES, sizeof ok_odd);
                    even[b] = (even[b] & ok_even) | (8 & ~ok_even);
                    odd[b] = (odd[b] & ok_odd) | (8 & ~ok_odd);
                }
            }
            pack_blocks(even, odd, out + c / 2);
        }
#endif
    for (; c + BLOCK <= cols; c += BLOCK) {
        if (col.inv) PREFETCH_BLOCK(x, base + c, dtype, 0);
        Pair p = load_pair(x, base + c, dtype, keep_at(z, ch, dtype));
        ch = next_channel(z, ch, BLOCK);
        if (col.inv) { memcpy(&mul_even, col.inv + c, sizeof mul_even); memcpy(&mul_odd, col.inv + c + LANES, sizeof mul_odd); }
        pack_pair(block_codes(p.even, splat(shift), mul_even, splat(bias), col.ok ? col.ok + c : NULL),
                  block_codes(p.odd, splat(shift), mul_odd, splat(bias), col.ok ? col.ok + c + LANES : NULL),
                  out + c / 2);
    }
    for (; c < cols; c += 2) {
        uint8_t code[2];
        for (int k = 0; k < 2; k++) {
            float v = load_kept(x, base + c + k, dtype, z, ch);
            ch = next_channel(z, ch, 1);
            float mul = col.inv ? col.inv[c + k] : inv;
            int ok = col.ok ? col.ok[c + k] != 0 : 1;
            code[k] = ok ? (uint8_t)clamp_code(floorf((v - shift) * mul + bias)) : 8;
        }
        out[c / 2] = (uint8_t)(code[0] | (code[1] << 4));
    }
}

/* One group of codes -> values shift + (code - bias) * scale, saturated to the element type's
 * range (int4.saturate), in element order; with `col_scale` (Pair layout), element c takes its
 * column's scale. A NaN scale decodes NaN. */
INLINE void unpack_group(const uint8_t *in, int64_t cols, float shift, float bias, float scale,
                         const float *col_scale, void *out, int64_t base, int dtype) {
    int64_t c = 0;
#ifdef BF16_DECODE_TABLES
    if (dtype == 1 && !col_scale && cols >= 64) {
        const Bf16Tables t = bf16_tables(shift, bias, scale);
        for (; c + 64 <= cols; c += 64) {
            __builtin_prefetch(in + (c + PREFETCH_ELEMENTS) / 2);
            for (int line = 0; line < 128; line += 64) __builtin_prefetch((char *)out + 2 * (base + c + PREFETCH_ELEMENTS) + line, 1);
            bf16_lookup(in + c / 2, t, (uint16_t *)out + base + c);
        }
    }
#endif
    const float dmax = dtype_max(dtype);
    vf s_even = splat(scale), s_odd = s_even;
    for (; c + BLOCK <= cols; c += BLOCK) {
        if (col_scale) { memcpy(&s_even, col_scale + c, sizeof s_even); memcpy(&s_odd, col_scale + c + LANES, sizeof s_odd); }
        __builtin_prefetch(in + (c + PREFETCH_ELEMENTS) / 2);
        PREFETCH_BLOCK(out, base + c, dtype, 1);
        Pair q = unpack_pair(in + c / 2);
        store_pair(out, base + c, (Pair){vsaturate(shift + (q.even - bias) * s_even, dmax),
                                         vsaturate(shift + (q.odd - bias) * s_odd, dmax)}, dtype);
    }
    for (; c < cols; c += 2) {
        uint8_t byte = in[c / 2];
        float s0 = col_scale ? col_scale[c] : scale, s1 = col_scale ? col_scale[c + 1] : scale;
        store(out, base + c, saturate(shift + ((float)(byte & 15) - bias) * s0, dmax), dtype);
        store(out, base + c + 1, saturate(shift + ((float)(byte >> 4) - bias) * s1, dmax), dtype);
    }
}

/* A lane of these bits is the fp32 NaN whose bf16 bits are NAN_SCALE_BITS. */
#define NAN_SCALES ((vf)((vu){0} + (NAN_SCALE_BITS << 16)))

/* symmetric.sym_scales for LANES groups at once, from their minima, maxima and finiteness
 * (-1 or 0): the signed scales (NaN for a non-finite group), their reciprocals (1 there), and
 * whether finite. */
INLINE void sym_scales(vf lo, vf hi, vi finite, vf *scale, vf *inv, vi *ok) {
    vi negative_extreme = -lo >= hi;
    vf extreme = blend(negative_extreme, -lo, hi), opposite = blend(negative_extreme, hi, -lo);
    vf a = extreme / 8.0f, b = opposite / 7.5f;
    vf magnitude = (vf)(((vu)blend(a > b, a, b) + 0xFFFFu) & 0xFFFF0000u); /* ceil_to_bf16 */
    magnitude = blend(magnitude < MIN_SCALE, splat(MIN_SCALE), magnitude);
    *ok = finite;
    *scale = blend(*ok, blend(negative_extreme, magnitude, -magnitude), NAN_SCALES);
    *inv = 1.0f / blend(*ok, *scale, splat(1.0f));
}

/* asymmetric.asym_encode's scales and offsets for LANES groups at once; a group is flagged
 * (NaN scale, offset +0) unless finite with a finite grid top 15 * scale. */
INLINE void asym_scales(vf lo, vf hi, vi finite, vf *scale, vf *inv, vf *offset, vi *ok) {
    lo = blend(lo == 0.0f, splat(0.0f), lo); /* +0 whichever zero the reduction met first */
    vf s = (vf)(((vu)((hi - lo) / 15.0f) + 0xFFFFu) & 0xFFFF0000u); /* ceil_to_bf16 */
    s = blend(s < MIN_SCALE, splat(MIN_SCALE), s);
    const vi magnitude_bits = (vi){0} + 0x7FFFFFFF;
    *ok = finite & ((vf)((vi)(15.0f * s) & magnitude_bits) < INFINITY);
    *scale = blend(*ok, s, NAN_SCALES);
    *offset = blend(*ok, lo, splat(0.0f));
    *inv = 1.0f / blend(*ok, s, splat(1.0f));
}

/* The per-group bodies below take the element type as an argument; DTYPE_CASES inlines
 * them once per type inside each parallel loop, so that no inner loop branches on it. */
#define DTYPE_CASES(call)                      \
    switch (dtype) {                           \
    case 0: call(0); break;                    \
    case 1: call(1); break;                    \
    default: call(2); break;                   \
    }

static const Columns NO_COLUMNS = {NULL, NULL};

/* Where the groups of an input lie: it is seen as rows of `channels` elements, `stride`
 * apart (a view's rows, such as SwiGLU's gate half of fc1's output; channels when dense), and
 * a strided input's rows hold whole groups. */
typedef struct { int64_t channels, stride; } Rows;

/* Where group g of the batch of groups from r0 lies, and where it prefetches: in a dense input
 * (at NULL, a constant where the batch is encoded, so the arithmetic is all that is compiled:
 * offsets read from an array cost 8% of the AVX2 bf16 encode) PREFETCH_ELEMENTS past it;
 * in strided rows at[g] and at[LANES + g] (strided_offsets). */
INLINE int64_t group_at(const int64_t *at, int64_t r0, int64_t g, int64_t cols) {
    return at ? at[g] : (r0 + g) * cols;
}

INLINE int64_t group_ahead(const int64_t *at, int64_t r0, int64_t g, int64_t cols) {
    return at ? at[LANES + g] : (r0 + g) * cols + PREFETCH_ELEMENTS;
}

/* The element offsets of groups [r0, r0 + n) of `cols` in strided rows, at[g], and of the
 * elements PREFETCH_ELEMENTS past each along the rows, at[LANES + g]: prefetching that far
 * past in memory fell between the rows, and the gate half of SwiGLU's fc1 output encoded in
 * the time of the whole output. One division a batch each. */
INLINE const int64_t *strided_offsets(Rows rows, int64_t r0, int64_t n, int64_t cols, int64_t *at) {
    for (int64_t half = 0; half < 2; half++) {
        const int64_t first = r0 * cols + half * PREFETCH_ELEMENTS;
        int64_t row = first / rows.channels, c = first - row * rows.channels;
        for (int64_t g = 0; g < n; g++, c += cols) {
            while (c >= rows.channels) c -= rows.channels, row++;
            at[half * LANES + g] = row * rows.stride + c;
        }
    }
    return at;
}

#ifdef BF16_KEYS
/* batch_ranges for bf16 groups of whole blocks: the keys' minima and maxima (or the sym
 * bounds' bits) of each group lane-wise, then reduced for all groups at once (fold_keys). An
 * infinity or NaN has the greatest or least key (or bits), so the range alone tells whether
 * the group is finite. */
INLINE void bf16_batch_ranges(const void *x, const int64_t *at, int64_t r0, int64_t n, int64_t cols, Zeroing z,
                              int64_t ch, int sym, vf *lo, vf *hi, vi *finite) {
    vkey mins[LANES], maxs[LANES];
    for (int64_t g = 0; g < LANES; g++, ch = next_channel(z, ch, cols))
        if (g < n) group_keys(x, group_at(at, r0, g, cols), group_ahead(at, r0, g, cols), cols, z, ch, sym,
                              &mins[g], &maxs[g]);
        else mins[g] = maxs[g] = (vkey){0}; /* lanes past n are unusable: no group to range */
    vu l = (vu)fold_keys(mins, sym ? KEY_UMAX : KEY_MIN), h = (vu)fold_keys(maxs, KEY_MAX);
    if (!sym) l = (vu)bf16_keys((vkey)l), h = (vu)bf16_keys((vkey)h);
    *lo = (vf)(l << 16);
    *hi = (vf)(h << 16);
    *finite = (*lo - *lo) + (*hi - *hi) == 0.0f;
}
#endif

/* Ranges of the n <= LANES groups from r0 (where they lie: group_at), the first starting at
 * channel ch, as vectors (lane g: group g), or with `sym` their sym bounds; lanes past n
 * unusable. Each group leaves lane-wise partial results, group g's at position
 * BIT_REVERSED[g], and FOLD halves all LANES vectors at once (a transposing reduction) down to
 * one whose lane g is group g's: a fold per group and statistic where reducing each group's
 * vector alone took one per halving, plus moving the results lane by lane into the vector the
 * scales are computed from. */
INLINE void batch_ranges(const void *x, int dtype, const int64_t *at, int64_t r0, int64_t n, int64_t cols,
                         Zeroing z, int64_t ch, int sym, vf *lo, vf *hi, vi *finite) {
#ifdef BF16_KEYS
    if (dtype == 1 && cols % BLOCK == 0) {
        bf16_batch_ranges(x, at, r0, n, cols, z, ch, sym, lo, hi, finite);
        return;
    }
#endif
    const int64_t ch0 = ch;
    vf lows[LANES], highs[LANES], poisons[LANES];
    for (int64_t g = 0; g < LANES; g++) {
        const int p = BIT_REVERSED[g];
        if (g < n) {
            group_blocks(x, group_at(at, r0, g, cols), group_ahead(at, r0, g, cols), cols, dtype, z, ch, sym,
                         &lows[p], &highs[p], &poisons[p]);
            ch = next_channel(z, ch, cols);
        } else {
            lows[p] = sym ? NEGATIVE_ZEROS : splat(INFINITY);
            highs[p] = splat(sym ? 0.0f : -INFINITY);
            poisons[p] = splat(0.0f);
        }
    }
    if (sym) {
        FOLD(bits_umax, lows);
        FOLD(bits_max, highs);
    } else {
        FOLD(vmin, lows);
        FOLD(vmax, highs);
    }
    FOLD(vadd, poisons);
    *lo = lows[0];
    *hi = highs[0];
    *finite = poisons[0] == 0.0f;
    if (cols % BLOCK) /* rows of odd widths (naive_int4's): the elements past the whole blocks */
        for (int64_t g = 0, ch = ch0; g < n; g++, ch = next_channel(z, ch, cols)) {
            float l = (*lo)[g], h = (*hi)[g];
            int ok = group_tail(x, group_at(at, r0, g, cols), cols, dtype, z, ch, &l, &h);
            (*lo)[g] = l;
            (*hi)[g] = h;
            (*finite)[g] &= -ok;
        }
}


/* Groups are encoded LANES at a time: the ranges of all, then their scales in one vector
 * computation, then their codes (the group data is still in cache). `strided` is a constant
 * where it is called (group_at). */
INLINE void sym_encode_batch(const void *x, int dtype, int strided, Rows rows, int64_t r0, int64_t n, int64_t cols,
                             Zeroing z, uint8_t *packed, uint16_t *scales) {
    vf lo, hi, scale, inv;
    vi finite, ok;
    int64_t offsets[2 * LANES];
    const int64_t *at = strided ? strided_offsets(rows, r0, n, cols, offsets) : NULL;
    const int64_t ch0 = first_channel(z, r0 * cols); /* one division per batch, not per group */
    batch_ranges(x, dtype, at, r0, n, cols, z, ch0, 1, &lo, &hi, &finite);
    sym_scales(lo, hi, finite, &scale, &inv, &ok);
    for (int64_t g = 0, ch = ch0; g < n; g++, ch = next_channel(z, ch, cols)) {
        uint8_t *out = packed + (r0 + g) * cols / 2;
        scales[r0 + g] = bf16_bits(scale[g]);
        if (!ok[g]) memset(out, 0x88, (size_t)(cols / 2)); /* the zero code */
        else pack_group(x, group_at(at, r0, g, cols), cols, dtype, z, ch, 0.0f, inv[g], 8.5f, NO_COLUMNS, out);
    }
}

/* 0 unless every one of the n slots is -1 (empty) or lies in [0, limit). */
static int slots_in_range(const int32_t *index, int64_t n, int64_t limit) {
    for (int64_t k = 0; k < n; k++)
        if (index[k] < -1 || index[k] >= limit) return 0;
    return 1;
}

/* The Zeroing of int4.zero_channels' (channels, index), index strictly increasing, in the
 * element width of dtype (its keep, to free); NO_ZEROING if the allocation fails. keep starts
 * a cache line, so that a group's mask loads do not straddle two where the input's do not
 * (malloc's 16-byte alignment split every AVX-512 fp32 one: in cache, 40 zeroed channels of
 * 4096 then added 3 ns to the 6.2 a group of 64 took without; aligned, 1). */
static Zeroing zeroing_for(int dtype, int64_t channels, const int32_t *index, int64_t n) {
    const size_t width = dtype == 0 ? 4 : 2;
    char *keep = aligned_alloc(64, ((size_t)(channels + BLOCK) * width + 63) / 64 * 64);
    if (!keep) return NO_ZEROING;
    memset(keep, 0xFF, (size_t)channels * width);
    for (int64_t k = 0; k < n; k++) memset(keep + (int64_t)index[k] * width, 0, width);
    for (int64_t j = channels; j < channels + BLOCK; j++) memcpy(keep + j * width, keep + j % channels * width, width);
    return (Zeroing){keep, channels};
}

/* The outlier codec's exact channels, in a tensor seen as rows of `channels` values, `stride`
 * apart: row r of `values` (rows of `width` slots) holds elements r * stride + index[k],
 * k < n, index strictly increasing (the used slots; the `width - n` empty ones follow). The
 * codecs copy them group batch by group batch, while the batch is in cache: a pass of their
 * own over the tensor (take_columns) touched a cache line of nearly every row. */
typedef struct { const int32_t *index; int64_t n, width, channels, stride; void *values; } Exact;

/* How many of the `width` slots are used: the leading ones >= 0, strictly increasing within
 * [0, limit), all others -1 (outlier.select_channels' layout); -1 if the slots break it. */
static int64_t used_slots(const int32_t *index, int64_t width, int64_t limit) {
    int64_t n = 0;
    while (n < width && index[n] >= 0) {
        if (index[n] >= limit || (n && index[n] <= index[n - 1])) return -1;
        n++;
    }
    for (int64_t k = n; k < width; k++)
        if (index[k] != -1) return -1;
    return n;
}

/* Zeroes the empty slots [n, width) of each of `rows` rows of values (+0 bits). */
static void zero_empty_slots(void *values, int elem_size, int64_t rows, int64_t n, int64_t width) {
    if (n == width) return;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        memset((char *)values + (r * width + n) * elem_size, 0, (size_t)((width - n) * elem_size));
}

/* The first k with index[k] >= channel (n if none). */
INLINE int64_t first_exact(Exact e, int64_t channel) {
    int64_t lo = 0, hi = e.n;
    while (lo < hi) {
        int64_t mid = (lo + hi) / 2;
        if (e.index[mid] < channel) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Copies the exact channels' elements among elements [begin, end) of `tensor` (counted as if
 * dense) into `values` (into_values) or back, as elements of type T (a fixed-size copy:
 * memcpy of a variable size was a library call per element). */
#define COPY_EXACT(T)                                                                          \
    for (int64_t r = begin / e.channels; r * e.channels < end; r++) {                          \
        int64_t row = r * e.channels, from = begin > row ? begin - row : 0;                    \
        T *values = (T *)e.values + r * e.width;                                               \
        for (int64_t k = first_exact(e, from); k < e.n && row + e.index[k] < end; k++) {       \
            T *element = (T *)tensor + r * e.stride + e.index[k];                              \
            if (into_values) values[k] = *element;                                             \
            else *element = values[k];                                                         \
        }                                                                                      \
    }

INLINE void copy_exact(Exact e, void *tensor, int elem_size, int64_t begin, int64_t end, int into_values) {
    if (elem_size == 4) { COPY_EXACT(uint32_t) }
    else { COPY_EXACT(uint16_t) }
}
#undef COPY_EXACT

/* Row-grouped symmetric int4 of `rows` groups of `cols`, the input seen as rows of `channels`
 * values `stride` apart (see Rows; stride == channels: dense); with `slots` > 0, the channels
 * of the used slots of `zeroed` (outlier.select_channels' int32 layout) are encoded as zeros
 * (int4.zero_channels), and, where `exact` is not NULL, copied there, the empty slots' columns
 * +0 (see Exact; rows * cols / channels rows of `slots`). Returns 0 if the slots break their
 * layout or memory ran out (nothing written), 1 otherwise. */
int sym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols, int64_t channels, int64_t stride,
                    const int32_t *zeroed, int64_t slots, void *exact, uint8_t *packed, uint16_t *scales) {
    const int64_t n_zeroed = slots ? used_slots(zeroed, slots, channels) : 0;
    if (n_zeroed < 0) return 0;
    const Zeroing z = n_zeroed ? zeroing_for(dtype, channels, zeroed, n_zeroed) : NO_ZEROING;
    if (n_zeroed && !z.keep) return 0;
    const Rows layout = {channels, stride};
    const int strided = stride != channels;
    const Exact e = {zeroed, n_zeroed, slots, channels, stride, exact};
    const int elem_size = dtype == 0 ? 4 : 2;
    #pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += LANES) {
        int64_t n = rows - r0 < LANES ? rows - r0 : LANES;
/* the default groups, 64 wide, in loops of constant trip counts: 13% faster in bf16 with zeroed channels */
#define CALL(t)                                                                                    \
    if (strided) sym_encode_batch(x, t, 1, layout, r0, n, cols, z, packed, scales);      \
    else if (cols == 64) sym_encode_batch(x, t, 0, layout, r0, n, 64, z, packed, scales); \
    else sym_encode_batch(x, t, 0, layout, r0, n, cols, z, packed, scales)
        DTYPE_CASES(CALL)
#undef CALL
        if (exact && n_zeroed) copy_exact(e, (void *)x, elem_size, r0 * cols, (r0 + n) * cols, 1);
    }
    if (exact) zero_empty_slots(exact, elem_size, rows * cols / channels, n_zeroed, slots);
    free((void *)z.keep);
    return 1;
}

/* With `slots` > 0, the exact channels' values of the used slots (rows `exact_rows` of
 * `channels` values, see Exact) are then written over the decoded groups. Returns 0 if the
 * slots break their layout (nothing written), 1 otherwise. */
int sym_decode_rows(const uint8_t *packed, const uint16_t *scales, int64_t rows, int64_t cols, int dtype,
                    const int32_t *exact_index, int64_t slots, int64_t channels, int64_t exact_rows,
                    const void *exact_values, void *out) {
    const int64_t n_exact = slots ? used_slots(exact_index, slots, channels) : 0;
    if (n_exact < 0) return 0;
    const Exact e = {exact_index, n_exact, slots, channels, channels, (void *)exact_values};
    const int elem_size = dtype == 0 ? 4 : 2;
    const int64_t exact_end = exact_rows * channels;
    #pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += LANES) {
        int64_t n = rows - r0 < LANES ? rows - r0 : LANES;
        for (int64_t r = r0; r < r0 + n; r++) {
            const float scale = bits_to_float((uint32_t)scales[r] << 16);
            /* -0 + v == v, signed zeros too */
#define CALL(t) unpack_group(packed + r * cols / 2, cols, -0.0f, 8.0f, scale, NULL, out, r * cols, t)
            DTYPE_CASES(CALL)
#undef CALL
        }
        int64_t end = (r0 + n) * cols < exact_end ? (r0 + n) * cols : exact_end;
        if (n_exact) copy_exact(e, out, elem_size, r0 * cols, end, 0);
    }
    return 1;
}

/* Column reductions (channel_abs_sums, channel_int4's ranges but bf16's) read CHUNK_ROWS rows
 * together, each block's running values kept in registers across them: walking each column
 * down all rows measured 1.6x slower, updating the float arrays row by row 2.3x. bf16 ranges
 * on int16 keys are the exception (bf16_column_ranges). */
#define CHUNK_ROWS 16
/* The blocks the channel sums add per row step: two, a whole cache line of bf16 with AVX2 (one
 * block, half a line, measured 1.2x slower). */
#define SUM_BLOCKS 2

/* The column whose values sit at Pair-layout slot s (the inverse of pair_slot). */
INLINE int64_t slot_column(int64_t s, int64_t cols) {
    if (s >= cols / BLOCK * BLOCK) return s;
    int64_t j = s % BLOCK;
    return s - j + (j < LANES ? 2 * j : 2 * (j - LANES) + 1);
}

/* Columns [first, last) of each thread's share, in whole BLOCK-column blocks: every column
 * is reduced over the rows in row order by one thread, so results do not depend on the
 * thread count. */
static inline void column_share(int64_t cols, int64_t *first, int64_t *last) {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t blocks = (cols + BLOCK - 1) / BLOCK;
    *first = blocks * t / threads * BLOCK;
    *last = blocks * (t + 1) / threads * BLOCK;
    *last = *last < cols ? *last : cols;
}

/* |x| of block [i, i + BLOCK) of x as four vectors of LANES / 2 doubles, in abs_sum_column's
 * order. bf16 and fp32 are widened with integer shifts, no conversion: an element's bits
 * without the sign, moved so that its exponent field becomes the double's, are the double
 * |x| * 2^-896 (SCALED_SUM) exactly, zeros and subnormals included, and adding those rounds
 * as adding the |x| would (every value and partial sum is a multiple of 2^-1074, the scale
 * is a power of two). The conversions took one of the two shuffle-port operations per four
 * elements that bounded the pass on AVX2. Infinities and NaNs become finite doubles of at
 * least 2^-768; channel_abs_sums sums their columns again. fp16 (sums of finite values can
 * reach that bound) converts, unscaled. */
INLINE void abs_doubles(const void *x, int64_t i, int dtype, vd out[4]) {
    if (dtype == 1) { /* 64-bit lane L holds elements 4L..4L+3; out[j] takes element 4L + j */
        const vq magnitude = (vq){0} + (0x7FFFull << 45);
        vq q;
        memcpy(&q, (const uint16_t *)x + i, sizeof q);
        out[0] = (vd)((q << 45) & magnitude);
        out[1] = (vd)((q << 29) & magnitude);
        out[2] = (vd)((q << 13) & magnitude);
        out[3] = (vd)((q >> 3) & magnitude);
    } else if (dtype == 0) { /* register k, lane L: elements k * LANES + 2L (out[2k]) and 2L + 1 */
        const vq magnitude = (vq){0} + (0x7FFFFFFFull << 29);
        for (int k = 0; k < 2; k++) {
            vq q;
            memcpy(&q, (const float *)x + i + k * LANES, sizeof q);
            out[2 * k] = (vd)((q << 29) & magnitude);
            out[2 * k + 1] = (vd)((q >> 3) & magnitude);
        }
    } else { /* elements in order */
        for (int q = 0; q < 4; q++) {
            vfh_half h;
            memcpy(&h, (const _Float16 *)x + i + q * LANES / 2, sizeof h);
            out[q] = to_doubles((vf_half)((vu_half)__builtin_convertvector(h, vf_half) & 0x7FFFFFFFu));
        }
    }
}

/* The factor from abs_doubles' doubles to |x|, and the least double a scaled infinity or NaN
 * becomes (2^(255 - 1023)): a scaled sum below it holds finite elements only. */
#define SCALED_SUM(dtype) ((dtype) == 2 ? 1.0 : 0x1p896)
#define SCALED_NON_FINITE 0x1p-768

/* The column of slot s of abs_doubles' order in rows of `cols` values. */
INLINE int64_t abs_sum_column(int64_t s, int64_t cols, int dtype) {
    if (dtype == 2 || s >= cols / BLOCK * BLOCK) return s;
    int64_t j = s % BLOCK, quarter = j / (LANES / 2), lane = j % (LANES / 2);
    return s - j + (dtype == 1 ? 4 * lane + quarter : quarter / 2 * LANES + 2 * lane + quarter % 2);
}

/* Adds |x| of rows [r0, r0 + n) (row r at element r * stride) to the running sums of `blocks`
 * blocks of columns from c, in float64, kept in abs_doubles' order, the sums in registers
 * across the chunk's rows as update_column_ranges does: adding into the array row by row
 * stored every sum once per row and ran at a third of a copy's speed. Each column still adds
 * its rows in row order. */
INLINE void add_block_sums(const void *x, int dtype, int64_t r0, int64_t n, int64_t stride, int64_t c, int blocks,
                           double *sums) {
    vd_unaligned *at = (vd_unaligned *)(sums + c);
    vd s[4 * SUM_BLOCKS];
    for (int k = 0; k < 4 * blocks; k++) s[k] = at[k];
    for (int64_t r = r0; r < r0 + n; r++) {
        /* CHUNK_ROWS streams at once: these lines of the next chunk's row, whose start the
         * prefetchers miss (the statistics rows lie apart). Into L1: on an AMD EPYC (Zen 5) the
         * bf16 choice took 0.14 ms against 0.20 with the lines brought into L2 only, fp32 the
         * same (an Intel Xeon measured L1 25% slower, on an earlier form of this loop) */
        const char *next = (const char *)x + ((r + n) * stride + c) * (dtype == 0 ? 4 : 2);
        for (int line = 0; line < blocks * BLOCK * (dtype == 0 ? 4 : 2); line += 64) __builtin_prefetch(next + line, 0, 3);
        for (int b = 0; b < blocks; b++) {
            vd d[4];
            abs_doubles(x, r * stride + c + b * BLOCK, dtype, d);
            for (int k = 0; k < 4; k++) s[4 * b + k] += d[k];
        }
    }
    for (int k = 0; k < 4 * blocks; k++) at[k] = s[k];
}

/* Adds |x| of rows [r0, r0 + n) (row r at element r * stride) to the running sums of columns
 * [first, last) (scaled, in abs_doubles' order past the last whole block too). */
INLINE void update_column_abs_sums(const void *x, int dtype, int64_t r0, int64_t n, int64_t stride, int64_t first,
                                   int64_t last, double *sums) {
    int64_t c = first;
    for (; c + SUM_BLOCKS * BLOCK <= last; c += SUM_BLOCKS * BLOCK) add_block_sums(x, dtype, r0, n, stride, c, SUM_BLOCKS, sums);
    for (; c + BLOCK <= last; c += BLOCK) add_block_sums(x, dtype, r0, n, stride, c, 1, sums);
    for (; c < last; c++)
        for (int64_t r = r0; r < r0 + n; r++) sums[c] += fabs((double)load(x, r * stride + c, dtype)) / SCALED_SUM(dtype);
}

/* Column c's sum of |x| from its scaled sum (abs_doubles' doubles added): summed again in row
 * order, as the reference does, where it may hold an infinity or a NaN. */
static double finish_abs_sum(const void *x, int dtype, int64_t rows, int64_t stride, int64_t c, double scaled) {
    if (dtype == 2 || scaled < SCALED_NON_FINITE) return scaled * SCALED_SUM(dtype);
    double sum = 0.0;
    for (int64_t r = 0; r < rows; r++) sum += fabs((double)load(x, r * stride + c, dtype));
    return sum;
}

/* sums[c] = sum over rows of |x[r][c]| with row r at element r * stride, in float64
 * (outlier.channel_abs_sums), each column's rows added in row order. scratch: cols doubles. */
static void channel_abs_sums(const void *x, int dtype, int64_t rows, int64_t cols, int64_t stride, double *scratch,
                             double *sums) {
    #pragma omp parallel
    {
        int64_t first, last;
        column_share(cols, &first, &last);
        for (int64_t c = first; c < last; c++) scratch[c] = 0.0;
        for (int64_t r0 = 0; r0 < rows; r0 += CHUNK_ROWS) {
            int64_t n = rows - r0 < CHUNK_ROWS ? rows - r0 : CHUNK_ROWS;
#define CALL(t) update_column_abs_sums(x, t, r0, n, stride, first, last, scratch)
            DTYPE_CASES(CALL)
#undef CALL
        }
        for (int64_t s = first; s < last; s++) {
            const int64_t c = abs_sum_column(s, cols, dtype);
            sums[c] = finish_abs_sum(x, dtype, rows, stride, c, scratch[s]);
        }
    }
}

/* A z-score this close to the threshold (relative to the terms it is made of) may fall on
 * either side with another summation order than the reference's (PyTorch's, which depends on
 * its vector width). Rounding moves it by about (rows + channels) * 2^-53 of those terms:
 * 1e-6 leaves a margin of orders of magnitude for any tensor. */
#define Z_MARGIN 1e-6

/* outlier.outlier_select: outlier.outlier_channels(outlier.channel_abs_sums(
 * outlier.statistics_rows(x))) for the [rows, cols] input (rows `stride` elements apart), the
 * sample's rows (every step-th) read in place, then the first `capacity` of them kept
 * (outlier.select_channels): mask[c] = 1 for the kept channels, 0 for the others, index[k]
 * the k-th kept channel or -1; returns how many channels are outliers (capacity aside). The
 * z-scores come from the sums in one scan in C where the reference makes ten small tensor
 * operations.
 * Returns -1 where a z-score lies within Z_MARGIN of the threshold, or all finite sums are
 * (nearly) equal: the caller then runs the reference's choice. scratch: cols doubles. */
int64_t outlier_channels(const void *x, int dtype, int64_t rows, int64_t cols, int64_t stride, int64_t step,
                         double threshold, int64_t capacity, double *scratch, double *sums, uint8_t *mask,
                         int32_t *index) {
    channel_abs_sums(x, dtype, (rows + step - 1) / step, cols, step * stride, scratch, sums);
    int64_t finite = 0;
    double total = 0.0, squares = 0.0;
    for (int64_t c = 0; c < cols; c++)
        if (isfinite(sums[c])) {
            finite++;
            total += sums[c];
        }
    const double mean = total / (double)finite;
    for (int64_t c = 0; c < cols; c++)
        if (isfinite(sums[c])) squares += (sums[c] - mean) * (sums[c] - mean);
    const double std = sqrt(squares / (double)finite), spread = fabs(mean) / std;
    const int scored = finite >= 2; /* the reference's z-scores need two finite channels */
    if (scored && !(std > 0.0 && spread < 1.0 / Z_MARGIN)) return -1;
    int64_t chosen = 0;
    for (int64_t c = 0; c < cols; c++) {
        int outlier = !isfinite(sums[c]);
        if (!outlier && scored) {
            const double z = (sums[c] - mean) / std;
            if (fabs(z - threshold) <= Z_MARGIN * (1.0 + fabs(z) + spread)) return -1;
            outlier = z > threshold;
        }
        mask[c] = (uint8_t)outlier;
        chosen += outlier;
    }
    int64_t kept = 0;
    for (int64_t c = 0; c < cols; c++)
        if (mask[c]) {
            if (kept < capacity) index[kept++] = (int32_t)c;
            else mask[c] = 0;
        }
    for (int64_t k = kept; k < capacity; k++) index[k] = -1;
    return chosen;
}

/* outlier.take_columns: out[r][k] = x[r][index[k]], +0 where index[k] is -1 (an empty slot),
 * for elements of elem_size bytes. Returns 0, touching nothing, if a slot is out of range. */
int take_columns(const void *x, int elem_size, int64_t rows, int64_t cols, const int32_t *index, int64_t n,
                 void *values) {
    if (!slots_in_range(index, n, cols)) return 0;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < n; k++) {
            if (elem_size == 4)
                ((uint32_t *)values)[r * n + k] = index[k] < 0 ? 0u : ((const uint32_t *)x)[r * cols + index[k]];
            else
                ((uint16_t *)values)[r * n + k] = index[k] < 0 ? 0u : ((const uint16_t *)x)[r * cols + index[k]];
        }
    return 1;
}


/* Running minima, maxima and poison (see group_range) of columns [first, last), in the Pair
 * layout, updated with rows [r0, r0 + n). */
INLINE void update_column_ranges(const void *x, int dtype, int64_t r0, int64_t n, int64_t cols, int64_t first,
                                 int64_t last, float *lo, float *hi, float *poison) {
    int64_t c = first;
    for (; c + BLOCK <= last; c += BLOCK) {
        vf_unaligned *lo_at = (vf_unaligned *)(lo + c), *hi_at = (vf_unaligned *)(hi + c);
        vf_unaligned *bad_at = (vf_unaligned *)(poison + c);
        vf l[2] = {lo_at[0], lo_at[1]}, h[2] = {hi_at[0], hi_at[1]}, bad[2] = {bad_at[0], bad_at[1]};
        for (int64_t r = r0; r < r0 + n; r++) {
            Pair p = load_pair(x, r * cols + c, dtype, NULL);
            vf v[2] = {p.even, p.odd};
            for (int k = 0; k < 2; k++) {
                l[k] = vmin(v[k], l[k]);
                h[k] = vmax(v[k], h[k]);
                bad[k] += v[k] - v[k];
            }
        }
        for (int k = 0; k < 2; k++) {
            lo_at[k] = l[k];
            hi_at[k] = h[k];
            bad_at[k] = bad[k];
        }
    }
    for (; c < last; c++)
        for (int64_t r = r0; r < r0 + n; r++) {
            float v = load(x, r * cols + c, dtype);
            lo[c] = v < lo[c] ? v : lo[c];
            hi[c] = v > hi[c] ? v : hi[c];
            poison[c] += v - v;
        }
}

#ifdef BF16_KEYS
/* update_column_ranges over all rows for the whole blocks of bf16 columns [first, last), row by
 * row on int16 keys held in `keys` (2 * cols entries, in L1 for rows of up to 8K channels):
 * the input is read once in order, as a copy reads it, where CHUNK_ROWS streams waited on
 * memory (twice a plain read's time). Returns the first column it left out. */
INLINE int64_t bf16_column_ranges(const void *x, int64_t rows, int64_t cols, int64_t first, int64_t last,
                                  int16_t *keys, float *lo, float *hi, float *poison) {
    const int64_t end = first + (last - first) / BLOCK * BLOCK;
    int16_t *low = keys, *high = keys + cols;
    for (int64_t c = first; c < end; c += BLOCK) {
        const vkey lowest = (vkey){0} + INT16_MAX, highest = (vkey){0} + INT16_MIN;
        memcpy(low + c, &lowest, sizeof lowest);
        memcpy(high + c, &highest, sizeof highest);
    }
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = (const uint16_t *)x + r * cols;
        for (int64_t c = first; c < end; c += BLOCK) {
            vkey w, l, h;
            memcpy(&w, row + c, sizeof w);
            memcpy(&l, low + c, sizeof l);
            memcpy(&h, high + c, sizeof h);
            const vkey key = bf16_keys(w);
            l = key_min(l, key);
            h = key_max(h, key);
            memcpy(low + c, &l, sizeof l);
            memcpy(high + c, &h, sizeof h);
        }
    }
    for (int64_t c = first; c < end; c += BLOCK) { /* to the Pair layout; the poison follows from the range */
        vkey l, h;
        memcpy(&l, low + c, sizeof l);
        memcpy(&h, high + c, sizeof h);
        const Pair lp = bf16_pair((vu)bf16_keys(l)), hp = bf16_pair((vu)bf16_keys(h));
        memcpy(lo + c, &lp.even, sizeof lp.even);
        memcpy(lo + c + LANES, &lp.odd, sizeof lp.odd);
        memcpy(hi + c, &hp.even, sizeof hp.even);
        memcpy(hi + c + LANES, &hp.odd, sizeof hp.odd);
        const vf bad_even = (lp.even - lp.even) + (hp.even - hp.even), bad_odd = (lp.odd - lp.odd) + (hp.odd - hp.odd);
        memcpy(poison + c, &bad_even, sizeof bad_even);
        memcpy(poison + c + LANES, &bad_odd, sizeof bad_odd);
    }
    return end;
}
#endif

/* Per-channel symmetric int4 (channel_int4): one scale per column of the [rows, cols] input.
 * scratch holds 4 * cols floats, col_ok cols entries. */
void sym_encode_cols(const void *x, int dtype, int64_t rows, int64_t cols, float *scratch,
                     int32_t *col_ok, uint8_t *packed, uint16_t *scales) {
    float *lo = scratch, *hi = scratch + cols, *poison = scratch + 2 * cols, *col_inv = lo;
    #pragma omp parallel
    {
        int64_t first, last;
        column_share(cols, &first, &last);
        int64_t rest = first;
#ifdef BF16_KEYS
        if (dtype == 1)
            rest = bf16_column_ranges(x, rows, cols, first, last, (int16_t *)(scratch + 3 * cols), lo, hi, poison);
#endif
        for (int64_t c = rest; c < last; c++) { lo[c] = INFINITY; hi[c] = -INFINITY; poison[c] = 0.0f; }
        for (int64_t r0 = 0; r0 < rows && rest < last; r0 += CHUNK_ROWS) {
            int64_t n = rows - r0 < CHUNK_ROWS ? rows - r0 : CHUNK_ROWS;
#define CALL(t) update_column_ranges(x, t, r0, n, cols, rest, last, lo, hi, poison)
            DTYPE_CASES(CALL)
#undef CALL
        }
        for (int64_t s0 = first; s0 < last; s0 += LANES) {
            int64_t width = last - s0 < LANES ? last - s0 : LANES;
            vf l = splat(0.0f), h = l, bad = l, scale, inv;
            vi ok;
            memcpy(&l, lo + s0, width * sizeof(float));
            memcpy(&h, hi + s0, width * sizeof(float));
            memcpy(&bad, poison + s0, width * sizeof(float));
            sym_scales(l, h, bad == 0.0f, &scale, &inv, &ok); /* lanes past width: unused */
            for (int64_t k = 0; k < width; k++) {
                int64_t c = slot_column(s0 + k, cols);
                scales[c] = bf16_bits(scale[k]);
                col_inv[s0 + k] = inv[k]; /* 1 where unusable; lo[s0 + k] is read already */
                col_ok[s0 + k] = ok[k];
            }
        }
    }
    int all_ok = 1;
    for (int64_t s = 0; s < cols; s++) all_ok &= col_ok[s] != 0;
    const Columns col = {col_inv, all_ok ? NULL : col_ok};
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#define CALL(t) pack_group(x, r * cols, cols, t, NO_ZEROING, 0, 0.0f, 1.0f, 8.5f, col, packed + r * cols / 2)
        DTYPE_CASES(CALL)
#undef CALL
    }
}

void sym_decode_cols(const uint8_t *packed, const uint16_t *scales, int64_t rows, int64_t cols, int dtype,
                     float *col_scale, void *out) {
    for (int64_t c = 0; c < cols; c++) col_scale[pair_slot(c, cols)] = bits_to_float((uint32_t)scales[c] << 16);
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
#define CALL(t) unpack_group(packed + r * cols / 2, cols, -0.0f, 8.0f, 1.0f, col_scale, out, r * cols, t)
        DTYPE_CASES(CALL)
#undef CALL
    }
}

INLINE void asym_encode_batch(const void *x, int dtype, int64_t r0, int64_t n, int64_t cols,
                              uint8_t *packed, uint16_t *scales, void *offsets) {
    vf lo, hi, scale, inv, offset;
    vi finite, ok;
    batch_ranges(x, dtype, NULL, r0, n, cols, NO_ZEROING, 0, 0, &lo, &hi, &finite);
    asym_scales(lo, hi, finite, &scale, &inv, &offset, &ok);
    for (int64_t g = 0; g < n; g++) {
        uint8_t *out = packed + (r0 + g) * cols / 2;
        scales[r0 + g] = bf16_bits(scale[g]);
        store(offsets, r0 + g, offset[g], dtype); /* an input element: exact */
        if (!ok[g]) memset(out, 0, (size_t)(cols / 2));
        else pack_group(x, (r0 + g) * cols, cols, dtype, NO_ZEROING, 0, offset[g], inv[g], 0.5f, NO_COLUMNS, out);
    }
}

void asym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols,
                      uint8_t *packed, uint16_t *scales, void *offsets) {
    #pragma omp parallel for schedule(static)
    for (int64_t r0 = 0; r0 < rows; r0 += LANES) {
        int64_t n = rows - r0 < LANES ? rows - r0 : LANES;
#define CALL(t) asym_encode_batch(x, t, r0, n, cols, packed, scales, offsets)
        DTYPE_CASES(CALL)
#undef CALL
    }
}

void asym_decode_rows(const uint8_t *packed, const uint16_t *scales, const void *offsets,
                      int64_t rows, int64_t cols, int dtype, void *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float scale = bits_to_float((uint32_t)scales[r] << 16);
#define CALL(t) unpack_group(packed + r * cols / 2, cols, load(offsets, r, t), 0.0f, scale, NULL, out, r * cols, t)
        DTYPE_CASES(CALL)
#undef CALL
    }
}

/* 8 flags per byte, flag i in bit i; elem_size 1 compares bytes (bool, uint8), larger element
 * types compare as floats (dtype as above): a flag is set unless the element is +-0.
 *
 * With AVX-512BW or AVX2 the masks go 64 bytes of elements at a time (a step): a few
 * instructions from elements to bits and back (a float mask on the CPU spent 5 ms per
 * 16 MiB in the byte loops); the byte loops below handle the rest, and everything
 * elsewhere. Per step: step_flags (which elements are non-zero), step_equal (which have the
 * given bits) and step_expand (those bits where the flag is set, 0 elsewhere). */
#if defined(__AVX512BW__) || defined(__AVX2__)
#include <immintrin.h>
#define MASK_STEPS
#define MASK_STEP_BYTES 64
#endif

#if defined(__AVX512BW__)
INLINE uint64_t step_flags(const void *x, int elem_size) {
    __m512i v = _mm512_loadu_si512(x);
    if (elem_size == 1) return _mm512_test_epi8_mask(v, v);
    if (elem_size == 2) return _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF));
    return _mm512_test_epi32_mask(v, _mm512_set1_epi32(0x7FFFFFFF));
}

INLINE uint64_t step_equal(const void *x, int elem_size, uint32_t bits) {
    __m512i v = _mm512_loadu_si512(x);
    return elem_size == 4 ? _mm512_cmpeq_epi32_mask(v, _mm512_set1_epi32((int)bits))
                          : _mm512_cmpeq_epi16_mask(v, _mm512_set1_epi16((short)bits));
}

INLINE void step_expand(uint64_t flags, int elem_size, uint32_t bits, void *out) {
    __m512i v = elem_size == 4 ? _mm512_maskz_mov_epi32((__mmask16)flags, _mm512_set1_epi32((int)bits))
                               : _mm512_maskz_mov_epi16((__mmask32)flags, _mm512_set1_epi16((short)bits));
    _mm512_storeu_si512(out, v);
}
#elif defined(__AVX2__)
/* One bit per element from the all-ones or zero lanes of two comparisons, in element order. */
INLINE uint64_t lane_bits(__m256i low, __m256i high, int elem_size) {
    if (elem_size == 1)
        return (uint32_t)_mm256_movemask_epi8(low) | (uint64_t)(uint32_t)_mm256_movemask_epi8(high) << 32;
    if (elem_size == 2) /* words to bytes; packing interleaves the 128-bit lanes, the permute undoes it */
        return (uint32_t)_mm256_movemask_epi8(_mm256_permute4x64_epi64(_mm256_packs_epi16(low, high), 0xD8));
    return (uint64_t)(_mm256_movemask_ps(_mm256_castsi256_ps(low)) | _mm256_movemask_ps(_mm256_castsi256_ps(high)) << 8);
}

INLINE __m256i lanes_equal(__m256i a, __m256i b, int elem_size) {
    if (elem_size == 1) return _mm256_cmpeq_epi8(a, b);
    if (elem_size == 2) return _mm256_cmpeq_epi16(a, b);
    return _mm256_cmpeq_epi32(a, b);
}

INLINE __m256i broadcast_bits(uint32_t bits, int elem_size) {
    if (elem_size == 1) return _mm256_set1_epi8((char)bits);
    if (elem_size == 2) return _mm256_set1_epi16((short)bits);
    return _mm256_set1_epi32((int)bits);
}

INLINE uint64_t step_equal(const void *x, int elem_size, uint32_t bits) {
    const __m256i *v = (const __m256i *)x, b = broadcast_bits(bits, elem_size);
    return lane_bits(lanes_equal(_mm256_loadu_si256(v), b, elem_size),
                     lanes_equal(_mm256_loadu_si256(v + 1), b, elem_size), elem_size);
}

INLINE uint64_t step_flags(const void *x, int elem_size) {
    const __m256i *v = (const __m256i *)x, zero = _mm256_setzero_si256();
    /* the sign bit aside, so that -0 counts as 0 */
    __m256i magnitude = broadcast_bits(elem_size == 1 ? 0xFF : elem_size == 2 ? 0x7FFF : 0x7FFFFFFF, elem_size);
    uint64_t zeros = lane_bits(lanes_equal(_mm256_and_si256(_mm256_loadu_si256(v), magnitude), zero, elem_size),
                               lanes_equal(_mm256_and_si256(_mm256_loadu_si256(v + 1), magnitude), zero, elem_size),
                               elem_size);
    int per_step = MASK_STEP_BYTES / elem_size;
    return ~zeros & (per_step == 64 ? ~0ull : (1ull << per_step) - 1);
}

INLINE void step_expand(uint64_t flags, int elem_size, uint32_t bits, void *out) {
    /* lane i of each half selects bit i of its share of the flags */
    const __m256i select = elem_size == 4 ? _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128)
                                          : _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                                              4096, 8192, 16384, (short)32768);
    const int per_half = 32 / elem_size;
    const __m256i value = broadcast_bits(bits, elem_size);
    for (int k = 0; k < 2; k++) {
        uint32_t share = (uint32_t)(flags >> (k * per_half)) & ((1u << per_half) - 1);
        __m256i set = lanes_equal(_mm256_and_si256(broadcast_bits(share, elem_size), select), select, elem_size);
        _mm256_storeu_si256((__m256i *)out + k, _mm256_and_si256(set, value));
    }
}
#endif

/* Elements (whole steps only) handled by the vector loops; the byte loops take the rest. */
INLINE int64_t stepped_elements(int64_t numel, int elem_size) {
#ifdef MASK_STEPS
    int64_t per_step = MASK_STEP_BYTES / elem_size;
    return numel / per_step * per_step;
#else
    (void)numel; (void)elem_size;
    return 0;
#endif
}

#ifdef MASK_STEPS
/* A step's flags from and to the packed bytes, in a load or store of their width: a copy of a
 * variable size into a zeroed 64-bit word stalled each step on store forwarding (the float32
 * decode ran at a third of a copy's speed). */
INLINE uint64_t load_step_flags(const uint8_t *packed, int elem_size) {
    if (elem_size == 4) { uint16_t f; memcpy(&f, packed, 2); return f; }
    if (elem_size == 2) { uint32_t f; memcpy(&f, packed, 4); return f; }
    uint64_t f;
    memcpy(&f, packed, 8);
    return f;
}

INLINE void store_step_flags(uint8_t *packed, uint64_t flags, int elem_size) {
    if (elem_size == 4) { uint16_t f = (uint16_t)flags; memcpy(packed, &f, 2); }
    else if (elem_size == 2) { uint32_t f = (uint32_t)flags; memcpy(packed, &f, 4); }
    else memcpy(packed, &flags, 8);
}
#endif

static inline uint8_t pack_byte_flags(const uint8_t *x) {
    uint64_t v;
    memcpy(&v, x, 8);
    v |= (v >> 4) & 0x0F0F0F0F0F0F0F0Full; /* fold each byte's bits into its lowest bit */
    v |= (v >> 2) & 0x3333333333333333ull;
    v |= (v >> 1) & 0x5555555555555555ull;
    v &= 0x0101010101010101ull;
    return (uint8_t)((v * 0x0102040810204080ull) >> 56); /* gather bit 0 of byte j into bit j */
}

/* The bits of `value` in the element type (dtype as above). */
static inline uint32_t value_bits(float value, int dtype) {
    if (dtype == 0) return float_to_bits(value);
    if (dtype == 1) return bf16_bits(value);
    _Float16 h = (_Float16)value;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}

/* bitmask.mask_pack and, with `value` (float dtypes, dtype as above), bitmask.mask_value in the
 * same pass: one read of the mask where the two took one each. The value is the first non-zero
 * element (+0 if none), in *value; returns 0 unless every element is 0 or that value (NaN
 * never is), 1 otherwise and always without `value`. */
int mask_encode(const void *x, int dtype, int elem_size, int64_t numel, uint8_t *packed, float *value) {
    const int64_t bytes = (numel + 7) / 8, stepped = stepped_elements(numel, elem_size);
    const int checked = value != NULL;
    float v = 0.0f;
    if (checked) {
        int64_t first = 0;
        while (first < numel && (v = load(x, first, dtype)) == 0.0f) first++;
        v = first < numel ? v : 0.0f;
    }
    int ok = v == v;
#ifdef MASK_STEPS
    /* an element passes if it is +-0 or has v's bits (v is neither zero nor NaN, so equal
     * floats have equal bits) */
    const int64_t per_step = MASK_STEP_BYTES / elem_size;
    const uint32_t bits = checked ? value_bits(v, dtype) : 0;
    const uint64_t all = per_step == 64 ? ~0ull : (1ull << per_step) - 1;
    #pragma omp parallel for reduction(&:ok) schedule(static)
    for (int64_t e = 0; e < stepped; e += per_step) {
        const char *at = (const char *)x + e * elem_size;
        const uint64_t flags = step_flags(at, elem_size);
        store_step_flags(packed + e / 8, flags, elem_size);
        if (checked) ok &= ((~flags | step_equal(at, elem_size, bits)) & all) == all;
    }
#endif
    const int64_t whole = elem_size == 1 ? numel / 8 : stepped / 8;
    if (elem_size == 1) {
        #pragma omp parallel for schedule(static)
        for (int64_t i = stepped / 8; i < whole; i++) packed[i] = pack_byte_flags((const uint8_t *)x + i * 8);
    }
    #pragma omp parallel for reduction(&:ok) schedule(static)
    for (int64_t i = whole; i < bytes; i++) {
        uint8_t byte = 0;
        for (int64_t j = 0; j < 8 && i * 8 + j < numel; j++) {
            int64_t k = i * 8 + j;
            int set;
            if (elem_size == 1) set = ((const uint8_t *)x)[k] != 0;
            else {
                const float e = load(x, k, dtype);
                set = e != 0.0f;
                ok &= !checked | (e == 0.0f) | (e == v);
            }
            byte |= (uint8_t)(set << j);
        }
        packed[i] = byte;
    }
    if (checked) *value = v;
    return ok;
}

static uint64_t spread_bits[256]; /* bit j of the index -> byte j of the entry */

__attribute__((constructor)) static void init_spread_bits(void) {
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++) spread_bits[b] |= (uint64_t)((b >> j) & 1) << (8 * j);
}

void mask_unpack(const uint8_t *packed, int64_t numel, uint8_t *flags) {
    const int64_t whole = numel / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < whole; i++) memcpy(flags + i * 8, &spread_bits[packed[i]], 8);
    for (int64_t k = whole * 8; k < numel; k++) flags[k] = (packed[k >> 3] >> (k & 7)) & 1;
}

/* bitmask.mask_unpack with a value: the bits of *value (one element of the output dtype, NaN
 * included) where the flag is set, +0 elsewhere. */
void mask_unpack_values(const uint8_t *packed, int64_t numel, int dtype, const void *value, void *out) {
    const int elem_size = dtype == 0 ? 4 : 2;
    const uint32_t bits = elem_size == 4 ? *(const uint32_t *)value : *(const uint16_t *)value;
    const int64_t bytes = (numel + 7) / 8, stepped = stepped_elements(numel, elem_size);
#ifdef MASK_STEPS
    const int64_t per_step = MASK_STEP_BYTES / elem_size;
    #pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < stepped; e += per_step) {
        step_expand(load_step_flags(packed + e / 8, elem_size), elem_size, bits, (char *)out + e * elem_size);
    }
#endif
    #pragma omp parallel for schedule(static)
    for (int64_t i = stepped / 8; i < bytes; i++)
        for (int j = 0; j < 8 && i * 8 + j < numel; j++) {
            uint32_t set = 0u - ((packed[i] >> j) & 1u);
            if (elem_size == 4) ((uint32_t *)out)[i * 8 + j] = bits & set;
            else ((uint16_t *)out)[i * 8 + j] = (uint16_t)(bits & set);
        }
}
