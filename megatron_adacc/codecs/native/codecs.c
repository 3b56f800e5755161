/* Fused CPU kernels of the int4 and bitmask codecs: one pass over each group, in cache.
 *
 * Bit-exact twins of the PyTorch reference (codecs/symmetric.py, asymmetric.py, bitmask.py):
 * the same fp32 operations in the same order, IEEE division, no FMA contraction
 * (built with -ffp-contract=off, never -ffast-math). Element types: 0 fp32, 1 bf16, 2 fp16.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MIN_SCALE 1.1754943508222875e-38f /* 2^-126, as int4.MIN_SCALE */

static inline float bits_to_float(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

static inline float load(const void *p, int64_t i, int dtype) {
    if (dtype == 0) return ((const float *)p)[i];
    if (dtype == 1) return bits_to_float((uint32_t)((const uint16_t *)p)[i] << 16);
    return (float)((const _Float16 *)p)[i];
}

static inline void store(void *p, int64_t i, float v, int dtype) {
    if (dtype == 0) { ((float *)p)[i] = v; return; }
    if (dtype == 1) { /* round to nearest even; inputs here are never NaN */
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

typedef float vf8 __attribute__((vector_size(32)));
typedef uint32_t vu8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
typedef _Float16 vf16x8 __attribute__((vector_size(16)));

/* Group of `cols` inputs -> fp32 in buf. Returns 0 if the group holds NaN or Inf; lo and hi
 * are its minimum and maximum (order-independent for finite values; signed zeros cannot
 * change a scale, see symmetric.sym_scales). Written with vector types because the compiler
 * does not vectorize float min/max reductions without -ffast-math. */
static inline int group_to_float(const void *x, int64_t base, int64_t cols, int dtype, float *buf,
                                 float *lo, float *hi) {
    int64_t c = 0;
    vf8 vmin = {INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY, INFINITY};
    vf8 vmax = -vmin;
    vi8 bad = {0};
    for (; c + 8 <= cols; c += 8) {
        vf8 v;
        if (dtype == 0) memcpy(&v, (const float *)x + base + c, 32);
        else if (dtype == 1) {
            vh8 h; memcpy(&h, (const uint16_t *)x + base + c, 16);
            v = (vf8)(__builtin_convertvector(h, vu8) << 16);
        } else {
            vf16x8 h; memcpy(&h, (const _Float16 *)x + base + c, 16);
            v = __builtin_convertvector(h, vf8);
        }
        memcpy(buf + c, &v, 32);
        bad |= ((vu8)v & 0x7F800000u) == 0x7F800000u;
        vi8 below = v < vmin, above = v > vmax; /* lane masks: all ones where true */
        vmin = (vf8)(((vi8)v & below) | ((vi8)vmin & ~below));
        vmax = (vf8)(((vi8)v & above) | ((vi8)vmax & ~above));
    }
    float mn = INFINITY, mx = -INFINITY;
    int finite = 1;
    for (int k = 0; k < 8; k++) {
        finite &= bad[k] == 0;
        mn = vmin[k] < mn ? vmin[k] : mn;
        mx = vmax[k] > mx ? vmax[k] : mx;
    }
    for (; c < cols; c++) {
        float v = load(x, base + c, dtype);
        buf[c] = v;
        finite &= isfinite(v) != 0;
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    *lo = mn;
    *hi = mx;
    return finite;
}

typedef uint8_t vb8 __attribute__((vector_size(8)));

static inline vi8 clamp_codes(vi8 q) {
    const vi8 zero = {0}, fifteen = zero + 15;
    vi8 low = q < zero, high = q > fifteen;
    q = (q & ~low) | (zero & low);
    return (q & ~high) | (fifteen & high);
}

/* codes of a group: clamp(floor((v - shift) / scale + bias), 0, 15), packed two per byte.
 * The vector path truncates instead of flooring: the two differ only below 0, where the
 * clamp makes them equal. */
static inline void pack_codes(const float *buf, int64_t cols, float shift, float scale, float bias, uint8_t *out) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        vf8 a, b;
        memcpy(&a, buf + c, 32);
        memcpy(&b, buf + c + 8, 32);
        vf8 even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
        vf8 odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
        vi8 q_even = clamp_codes(__builtin_convertvector((even - shift) / scale + bias, vi8));
        vi8 q_odd = clamp_codes(__builtin_convertvector((odd - shift) / scale + bias, vi8));
        vb8 bytes = __builtin_convertvector(q_even | (q_odd << 4), vb8);
        memcpy(out + c / 2, &bytes, 8);
    }
    for (; c < cols; c += 2) {
        float even = clamp_code(floorf((buf[c] - shift) / scale + bias));
        float odd = clamp_code(floorf((buf[c + 1] - shift) / scale + bias));
        out[c / 2] = (uint8_t)((uint8_t)even | ((uint8_t)odd << 4));
    }
}

/* 16 decoded values (fp32, in element order) -> output dtype at out[i .. i+16). */
static inline void store16(void *out, int64_t i, vf8 a, vf8 b, int dtype) {
    if (dtype == 0) {
        memcpy((float *)out + i, &a, 32);
        memcpy((float *)out + i + 8, &b, 32);
    } else if (dtype == 1) { /* round to nearest even by hand, as store() */
        vu8 ua = (vu8)a, ub = (vu8)b;
        vh8 ha = __builtin_convertvector((ua + 0x7FFFu + ((ua >> 16) & 1u)) >> 16, vh8);
        vh8 hb = __builtin_convertvector((ub + 0x7FFFu + ((ub >> 16) & 1u)) >> 16, vh8);
        memcpy((uint16_t *)out + i, &ha, 16);
        memcpy((uint16_t *)out + i + 8, &hb, 16);
    } else {
        vf16x8 ha = __builtin_convertvector(a, vf16x8), hb = __builtin_convertvector(b, vf16x8);
        memcpy((_Float16 *)out + i, &ha, 16);
        memcpy((_Float16 *)out + i + 8, &hb, 16);
    }
}

/* One row of codes -> values shift + (code - bias) * scale, in element order. */
static inline void unpack_row(const uint8_t *in, int64_t cols, float shift, float bias, float scale,
                              void *out, int64_t base, int dtype) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        vb8 bytes;
        memcpy(&bytes, in + c / 2, 8);
        vi8 q = __builtin_convertvector(bytes, vi8);
        vf8 even = shift + (__builtin_convertvector(q & 15, vf8) - bias) * scale;
        vf8 odd = shift + (__builtin_convertvector(q >> 4, vf8) - bias) * scale;
        store16(out, base + c, __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11),
                __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15), dtype);
    }
    for (; c < cols; c += 2) {
        uint8_t byte = in[c / 2];
        store(out, base + c, shift + ((float)(byte & 15) - bias) * scale, dtype);
        store(out, base + c + 1, shift + ((float)(byte >> 4) - bias) * scale, dtype);
    }
}

#define MAX_STACK_GROUP 4096

void sym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols, float dmax,
                     uint8_t *packed, uint16_t *scales, uint8_t *ok_out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        uint8_t *out = packed + base / 2;
        float lo, hi;
        float buf[MAX_STACK_GROUP]; /* wider rows are routed to the reference by the wrapper */
        int ok = group_to_float(x, base, cols, dtype, buf, &lo, &hi);
        int negative_extreme = -lo >= hi;
        float extreme = negative_extreme ? -lo : hi;
        float opposite = negative_extreme ? hi : -lo;
        float a = extreme / 8.0f, b = opposite / 7.5f;
        float magnitude = ceil_to_bf16(a > b ? a : b);
        magnitude = magnitude < MIN_SCALE ? MIN_SCALE : magnitude;
        ok = ok && magnitude * 8.0f <= dmax;
        float scale = ok ? (negative_extreme ? magnitude : -magnitude) : 0.0f;
        scales[r] = bf16_bits(scale);
        ok_out[r] = (uint8_t)ok;
        if (!ok) { memset(out, 0x88, (size_t)(cols / 2)); continue; }
        pack_codes(buf, cols, 0.0f, scale, 8.5f, out);
    }
}

void sym_decode_rows(const uint8_t *packed, const uint16_t *scales, int64_t rows, int64_t cols,
                     int dtype, void *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float scale = bits_to_float((uint32_t)scales[r] << 16);
        unpack_row(packed + r * cols / 2, cols, -0.0f, 8.0f, scale, out, r * cols, dtype); /* -0 + v == v, signed zeros too */
    }
}

void asym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols, float dmax,
                      uint8_t *packed, uint16_t *scales, void *offsets, uint8_t *ok_out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        uint8_t *out = packed + base / 2;
        float lo, hi;
        float buf[MAX_STACK_GROUP]; /* wider rows are routed to the reference by the wrapper */
        int ok = group_to_float(x, base, cols, dtype, buf, &lo, &hi);
        lo = lo == 0.0f ? 0.0f : lo; /* +0 whichever zero the reduction met first */
        float scale = ceil_to_bf16((hi - lo) / 15.0f);
        scale = scale < MIN_SCALE ? MIN_SCALE : scale;
        float top = lo + 15.0f * scale;
        ok = ok && fabsf(lo) <= dmax && fabsf(top) <= dmax;
        scale = ok ? scale : 0.0f;
        lo = ok ? lo : 0.0f;
        scales[r] = bf16_bits(scale);
        store(offsets, r, lo, dtype); /* lo is an input element: exact */
        ok_out[r] = (uint8_t)ok;
        if (!ok) { memset(out, 0, (size_t)(cols / 2)); continue; }
        pack_codes(buf, cols, lo, scale, 0.5f, out);
    }
}

void asym_decode_rows(const uint8_t *packed, const uint16_t *scales, const void *offsets,
                      int64_t rows, int64_t cols, int dtype, void *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float scale = bits_to_float((uint32_t)scales[r] << 16);
        unpack_row(packed + r * cols / 2, cols, load(offsets, r, dtype), 0.0f, scale, out, r * cols, dtype);
    }
}

/* 8 flags per byte, flag i in bit i; elem_size 1 compares bytes (bool, uint8), larger element
 * types compare as floats (dtype as above). */
static inline uint8_t pack_byte_flags(const uint8_t *x) {
    uint64_t v;
    memcpy(&v, x, 8);
    v |= (v >> 4) & 0x0F0F0F0F0F0F0F0Full; /* fold each byte's bits into its lowest bit */
    v |= (v >> 2) & 0x3333333333333333ull;
    v |= (v >> 1) & 0x5555555555555555ull;
    v &= 0x0101010101010101ull;
    return (uint8_t)((v * 0x0102040810204080ull) >> 56); /* gather bit 0 of byte j into bit j */
}

void mask_pack(const void *x, int dtype, int elem_size, int64_t numel, uint8_t *packed) {
    const int64_t bytes = (numel + 7) / 8, whole = numel / 8;
    if (elem_size == 1) {
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < whole; i++) packed[i] = pack_byte_flags((const uint8_t *)x + i * 8);
    }
    #pragma omp parallel for schedule(static)
    for (int64_t i = elem_size == 1 ? whole : 0; i < bytes; i++) {
        uint8_t byte = 0;
        for (int64_t j = 0; j < 8 && i * 8 + j < numel; j++) {
            int64_t k = i * 8 + j;
            int set = elem_size == 1 ? ((const uint8_t *)x)[k] != 0 : load(x, k, dtype) != 0.0f;
            byte |= (uint8_t)(set << j);
        }
        packed[i] = byte;
    }
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
