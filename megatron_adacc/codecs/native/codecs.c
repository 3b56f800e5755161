/* Fused CPU kernels of the int4 and bitmask codecs: one pass over each group, in cache.
 *
 * Bit-exact twins of the PyTorch reference (codecs/symmetric.py, asymmetric.py, bitmask.py):
 * the same fp32 operations in the same order, IEEE division, no FMA contraction
 * (built with -ffp-contract=off, never -ffast-math). Element types: 0 fp32, 1 bf16, 2 fp16.
 */
#include <math.h>
#include <omp.h>
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

/* Group of `cols` inputs -> fp32 in buf. With `keep` (the outlier codec), element i of the
 * flattened input is zeroed unless keep[i % channels]; keep holds channels + 8 entries,
 * keep[j] = keep[j % channels], so one 8-lane load never wraps. Returns 0 if the group holds NaN or Inf; lo and hi
 * are its minimum and maximum (order-independent for finite values; signed zeros cannot
 * change a scale, see symmetric.sym_scales). Written with vector types because the compiler
 * does not vectorize float min/max reductions without -ffast-math. */
static inline int group_to_float(const void *x, int64_t base, int64_t cols, int dtype, float *buf,
                                 float *lo, float *hi, const int32_t *keep, int64_t channels) {
    int64_t c = 0, ch = keep ? base % channels : 0;
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
        if (keep) { /* zero the dropped channels: keep[i] is all ones or 0 */
            vi8 k;
            memcpy(&k, keep + ch, 32);
            v = (vf8)((vi8)v & k);
            ch += 8;
            if (ch >= channels) ch %= channels;
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
        if (keep) {
            v = keep[ch] ? v : 0.0f;
            if (++ch == channels) ch = 0;
        }
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

/* 16 consecutive 4-byte values at p (floats, or int32 masks read as their bits) -> the
 * even-indexed ones and the odd-indexed ones, the order nibbles are packed in. */
static inline void load_even_odd(const void *p, vf8 *even, vf8 *odd) {
    vf8 a, b;
    memcpy(&a, p, 32);
    memcpy(&b, (const char *)p + 32, 32);
    *even = __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14);
    *odd = __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
}

/* codes of a group: clamp(floor((v - shift) / scale + bias), 0, 15), packed two per byte.
 * With `col_scale` (per-channel scales, channel_int4) element c divides by col_scale[c]
 * instead, and takes code 8 where col_ok[c] is 0. The vector path truncates instead of
 * flooring: the two differ only below 0, where the clamp makes them equal. */
static inline void pack_codes(const float *buf, int64_t cols, float shift, float scale, float bias,
                              const float *col_scale, const int32_t *col_ok, uint8_t *out) {
    int64_t c = 0;
    const vi8 eight = {8, 8, 8, 8, 8, 8, 8, 8};
    for (; c + 16 <= cols; c += 16) {
        vf8 even, odd, div_even = {scale, scale, scale, scale, scale, scale, scale, scale};
        vf8 div_odd = div_even;
        load_even_odd(buf + c, &even, &odd);
        if (col_scale) load_even_odd(col_scale + c, &div_even, &div_odd);
        vi8 q_even = clamp_codes(__builtin_convertvector((even - shift) / div_even + bias, vi8));
        vi8 q_odd = clamp_codes(__builtin_convertvector((odd - shift) / div_odd + bias, vi8));
        if (col_ok) {
            vf8 ok_even, ok_odd;
            load_even_odd(col_ok + c, &ok_even, &ok_odd);
            q_even = (q_even & (vi8)ok_even) | (eight & ~(vi8)ok_even);
            q_odd = (q_odd & (vi8)ok_odd) | (eight & ~(vi8)ok_odd);
        }
        vb8 bytes = __builtin_convertvector(q_even | (q_odd << 4), vb8);
        memcpy(out + c / 2, &bytes, 8);
    }
    for (; c < cols; c += 2) {
        uint8_t code[2];
        for (int k = 0; k < 2; k++) {
            float div = col_scale ? col_scale[c + k] : scale;
            int ok = col_ok ? col_ok[c + k] != 0 : 1;
            code[k] = ok ? (uint8_t)clamp_code(floorf((buf[c + k] - shift) / div + bias)) : 8;
        }
        out[c / 2] = (uint8_t)(code[0] | (code[1] << 4));
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

/* One row of codes -> values shift + (code - bias) * scale, in element order; with
 * `col_scale`, element c takes col_scale[c] as its scale. */
static inline void unpack_row(const uint8_t *in, int64_t cols, float shift, float bias, float scale,
                              const float *col_scale, void *out, int64_t base, int dtype) {
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
        vb8 bytes;
        memcpy(&bytes, in + c / 2, 8);
        vi8 q = __builtin_convertvector(bytes, vi8);
        vf8 s_even = {scale, scale, scale, scale, scale, scale, scale, scale}, s_odd = s_even;
        if (col_scale) load_even_odd(col_scale + c, &s_even, &s_odd);
        vf8 even = shift + (__builtin_convertvector(q & 15, vf8) - bias) * s_even;
        vf8 odd = shift + (__builtin_convertvector(q >> 4, vf8) - bias) * s_odd;
        store16(out, base + c, __builtin_shufflevector(even, odd, 0, 8, 1, 9, 2, 10, 3, 11),
                __builtin_shufflevector(even, odd, 4, 12, 5, 13, 6, 14, 7, 15), dtype);
    }
    for (; c < cols; c += 2) {
        uint8_t byte = in[c / 2];
        float s_even = col_scale ? col_scale[c] : scale, s_odd = col_scale ? col_scale[c + 1] : scale;
        store(out, base + c, shift + ((float)(byte & 15) - bias) * s_even, dtype);
        store(out, base + c + 1, shift + ((float)(byte >> 4) - bias) * s_odd, dtype);
    }
}

/* symmetric.sym_scales for one group: the signed scale (0 if unusable), *ok whether usable. */
static inline float sym_scale(float lo, float hi, int finite, float dmax, int *ok) {
    int negative_extreme = -lo >= hi;
    float extreme = negative_extreme ? -lo : hi;
    float opposite = negative_extreme ? hi : -lo;
    float a = extreme / 8.0f, b = opposite / 7.5f;
    float magnitude = ceil_to_bf16(a > b ? a : b);
    magnitude = magnitude < MIN_SCALE ? MIN_SCALE : magnitude;
    *ok = finite && magnitude * 8.0f <= dmax;
    return *ok ? (negative_extreme ? magnitude : -magnitude) : 0.0f;
}

#define MAX_STACK_GROUP 4096

void sym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols, float dmax,
                     const int32_t *keep, int64_t channels, uint8_t *packed, uint16_t *scales, uint8_t *ok_out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        uint8_t *out = packed + base / 2;
        float lo, hi;
        float buf[MAX_STACK_GROUP]; /* wider rows are routed to the reference by the wrapper */
        int finite = group_to_float(x, base, cols, dtype, buf, &lo, &hi, keep, channels), ok;
        float scale = sym_scale(lo, hi, finite, dmax, &ok);
        scales[r] = bf16_bits(scale);
        ok_out[r] = (uint8_t)ok;
        if (!ok) { memset(out, 0x88, (size_t)(cols / 2)); continue; }
        pack_codes(buf, cols, 0.0f, scale, 8.5f, NULL, NULL, out);
    }
}

void sym_decode_rows(const uint8_t *packed, const uint16_t *scales, int64_t rows, int64_t cols,
                     int dtype, void *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float scale = bits_to_float((uint32_t)scales[r] << 16);
        unpack_row(packed + r * cols / 2, cols, -0.0f, 8.0f, scale, NULL, out, r * cols, dtype); /* -0 + v == v, signed zeros too */
    }
}

/* Columns [first, last) of each thread's share, in whole 16-column blocks: every column is
 * reduced over the rows in row order by one thread, so results do not depend on the thread
 * count. */
static inline void column_share(int64_t cols, int64_t *first, int64_t *last) {
    int threads = omp_get_num_threads(), t = omp_get_thread_num();
    int64_t blocks = (cols + 15) / 16;
    *first = blocks * t / threads * 16;
    *last = blocks * (t + 1) / threads * 16;
    *last = *last < cols ? *last : cols;
}

/* sums[c] = sum over rows of |x[r][c]|, in float64 (outlier.channel_abs_sums). */
void channel_abs_sums(const void *x, int dtype, int64_t rows, int64_t cols, double *sums) {
    #pragma omp parallel
    {
        int64_t first, last;
        column_share(cols, &first, &last);
        for (int64_t c = first; c < last; c++) sums[c] = 0.0;
        for (int64_t r = 0; r < rows; r++) {
            const int64_t base = r * cols;
            if (dtype == 0) {
                const float *row = (const float *)x + base;
                for (int64_t c = first; c < last; c++) sums[c] += fabs((double)row[c]);
            } else if (dtype == 1) {
                const uint16_t *row = (const uint16_t *)x + base;
                for (int64_t c = first; c < last; c++) sums[c] += fabs((double)bits_to_float((uint32_t)row[c] << 16));
            } else {
                const _Float16 *row = (const _Float16 *)x + base;
                for (int64_t c = first; c < last; c++) sums[c] += fabs((double)row[c]);
            }
        }
    }
}

/* Per-channel symmetric int4 (channel_int4): one scale per column of the [rows, cols] input.
 * col_scale and col_ok are scratch of `cols` entries. */
void sym_encode_cols(const void *x, int dtype, int64_t rows, int64_t cols, float dmax, float *col_scale,
                     int32_t *col_ok, uint8_t *packed, uint16_t *scales, uint8_t *ok_out) {
    #pragma omp parallel
    {
        int64_t first, last;
        column_share(cols, &first, &last);
        float lo[16], hi[16];
        for (int64_t c0 = first; c0 < last; c0 += 16) { /* min, max and finiteness per column */
            int64_t width = last - c0 < 16 ? last - c0 : 16;
            int finite[16];
            for (int k = 0; k < width; k++) { lo[k] = INFINITY; hi[k] = -INFINITY; finite[k] = 1; }
            for (int64_t r = 0; r < rows; r++) {
                for (int k = 0; k < width; k++) {
                    float v = load(x, r * cols + c0 + k, dtype);
                    finite[k] &= isfinite(v) != 0;
                    lo[k] = v < lo[k] ? v : lo[k];
                    hi[k] = v > hi[k] ? v : hi[k];
                }
            }
            for (int k = 0; k < width; k++) {
                int ok;
                float scale = sym_scale(lo[k], hi[k], finite[k], dmax, &ok);
                scales[c0 + k] = bf16_bits(scale);
                ok_out[c0 + k] = (uint8_t)ok;
                col_scale[c0 + k] = ok ? scale : 1.0f;
                col_ok[c0 + k] = ok ? -1 : 0;
            }
        }
    }
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float buf[MAX_STACK_GROUP], lo, hi;
        for (int64_t c0 = 0; c0 < cols; c0 += MAX_STACK_GROUP) {
            int64_t width = cols - c0 < MAX_STACK_GROUP ? cols - c0 : MAX_STACK_GROUP;
            group_to_float(x, r * cols + c0, width, dtype, buf, &lo, &hi, NULL, 0);
            pack_codes(buf, width, 0.0f, 1.0f, 8.5f, col_scale + c0, col_ok + c0, packed + (r * cols + c0) / 2);
        }
    }
}

void sym_decode_cols(const uint8_t *packed, const uint16_t *scales, int64_t rows, int64_t cols, int dtype,
                     float *col_scale, void *out) {
    for (int64_t c = 0; c < cols; c++) col_scale[c] = bits_to_float((uint32_t)scales[c] << 16);
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        unpack_row(packed + r * cols / 2, cols, -0.0f, 8.0f, 1.0f, col_scale, out, r * cols, dtype);
}

void asym_encode_rows(const void *x, int dtype, int64_t rows, int64_t cols, float dmax,
                      uint8_t *packed, uint16_t *scales, void *offsets, uint8_t *ok_out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        uint8_t *out = packed + base / 2;
        float lo, hi;
        float buf[MAX_STACK_GROUP]; /* wider rows are routed to the reference by the wrapper */
        int ok = group_to_float(x, base, cols, dtype, buf, &lo, &hi, NULL, 0);
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
        pack_codes(buf, cols, lo, scale, 0.5f, NULL, NULL, out);
    }
}

void asym_decode_rows(const uint8_t *packed, const uint16_t *scales, const void *offsets,
                      int64_t rows, int64_t cols, int dtype, void *out) {
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float scale = bits_to_float((uint32_t)scales[r] << 16);
        unpack_row(packed + r * cols / 2, cols, load(offsets, r, dtype), 0.0f, scale, NULL, out, r * cols, dtype);
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

/* bitmask.mask_value for float dtypes: the first non-zero element (+0 if none) in *value;
 * returns 0 unless every element is 0 or that value (NaN never is). */
int mask_value(const void *x, int dtype, int64_t numel, float *value) {
    int64_t first = 0;
    float v = 0.0f;
    while (first < numel && (v = load(x, first, dtype)) == 0.0f) first++;
    v = first < numel ? v : 0.0f;
    int ok = v == v;
    #pragma omp parallel for reduction(&:ok) schedule(static)
    for (int64_t k = first; k < numel; k++) {
        float e = load(x, k, dtype);
        ok &= (e == 0.0f) | (e == v);
    }
    *value = v;
    return ok;
}

/* bitmask.mask_unpack with a value: `value` where the flag is set, +0 elsewhere, as the
 * bit pattern of the output dtype. */
void mask_unpack_values(const uint8_t *packed, int64_t numel, int dtype, float value, void *out) {
    const int64_t bytes = (numel + 7) / 8;
    if (dtype == 0) {
        const uint32_t bits = float_to_bits(value);
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < bytes; i++)
            for (int j = 0; j < 8 && i * 8 + j < numel; j++)
                ((uint32_t *)out)[i * 8 + j] = bits & (0u - ((packed[i] >> j) & 1u));
        return;
    }
    uint16_t bits;
    if (dtype == 1) bits = bf16_bits(value);
    else { _Float16 h = (_Float16)value; memcpy(&bits, &h, 2); }
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < bytes; i++)
        for (int j = 0; j < 8 && i * 8 + j < numel; j++)
            ((uint16_t *)out)[i * 8 + j] = (uint16_t)(bits & (0u - ((packed[i] >> j) & 1u)));
}
