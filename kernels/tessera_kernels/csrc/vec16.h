/* Sixteen float32 lanes and the bf16 helpers the CPU kernels share. A v16 is one AVX-512
 * register (GCC's vector extension), or, in the C++ build for a CPU without AVX-512, two AVX2
 * ones (vec16_avx2.h: the vector extension would keep it in memory there), so every kernel has
 * one source for both kinds of machine. Vectors are copied to and from memory with load16 /
 * store16 and reinterpreted with as_int / int_as_float (...), which both builds define. bf16 is
 * the top half of a float32: widening is a 16-bit shift. */
#ifndef TESSERA_VEC16_H
#define TESSERA_VEC16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#if defined(__cplusplus) && !defined(__AVX512F__)
#include "vec16_avx2.h"

static inline v16 widen(const uint16_t *p) {
    return v16(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16)),
               _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 8))), 16)));
}
static inline v16i widen_u8(const uint8_t *p) {
    return v16i(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
static inline v16i widen_s8(const int8_t *p) {
    return v16i(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)),
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
}
static inline v16 load16(const float *p) { return v16(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
static inline void store16(float *p, v16 f) { _mm256_storeu_ps(p, f.lo); _mm256_storeu_ps(p + 8, f.hi); }
/* The same 512 bits as another lane type (memcpy would move them through the stack here). */
static inline v16i as_int(v16 f) { return v16i(_mm256_castps_si256(f.lo), _mm256_castps_si256(f.hi)); }
static inline v16u as_uint(v16 f) { return v16u(_mm256_castps_si256(f.lo), _mm256_castps_si256(f.hi)); }
static inline v16 int_as_float(v16i i) { return v16(_mm256_castsi256_ps(i.lo), _mm256_castsi256_ps(i.hi)); }
static inline v16 uint_as_float(v16u u) { return v16(_mm256_castsi256_ps(u.lo), _mm256_castsi256_ps(u.hi)); }
static inline v16 to_float16(v16i i) { return v16(_mm256_cvtepi32_ps(i.lo), _mm256_cvtepi32_ps(i.hi)); }
static inline v16i to_int16(v16 f) { return v16i(_mm256_cvttps_epi32(f.lo), _mm256_cvttps_epi32(f.hi)); }
/* The low 16 bits of each lane. */
static inline v16h narrow16(v16u u) {
    const __m256i low = _mm256_set1_epi32(0xffff);
    const __m256i packed = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(u.lo, low), _mm256_and_si256(u.hi, low)), 0xd8);
    v16h h;
    memcpy(&h, &packed, sizeof h);
    return h;
}
/* (a > b) ? a : b per lane, as maxps is. */
static inline v16 vmax(v16 a, v16 b) { return v16(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }

/* hsum, hmax and sum16x16 below pair the lanes as the vector-extension versions do (same bits). */
static inline __m256 swap_halves(__m256 x) { return _mm256_permute2f128_ps(x, x, 1); }
static inline float hsum(v16 a) {
    __m256 x = _mm256_add_ps(a.lo, a.hi);
    x = _mm256_add_ps(x, swap_halves(x));
    x = _mm256_add_ps(x, _mm256_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm256_add_ps(x, _mm256_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_cvtss_f32(x);
}
static inline float hmax(v16 a) {
    __m256 x = _mm256_max_ps(a.lo, a.hi);
    x = _mm256_max_ps(x, swap_halves(x));
    x = _mm256_max_ps(x, _mm256_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2)));
    x = _mm256_max_ps(x, _mm256_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_cvtss_f32(x);
}
/* The tree's four folds: lanes of `a` to the low half of every 2w-lane block, `b` the high. */
static inline v16 fold8(v16 a, v16 b) { return v16(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi)); }
static inline __m256 fold4_half(__m256 a, __m256 b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
static inline v16 fold4(v16 a, v16 b) { return v16(fold4_half(a.lo, b.lo), fold4_half(a.hi, b.hi)); }
static inline __m256 fold2_half(__m256 a, __m256 b) {
    const __m256d x = _mm256_castps_pd(a), y = _mm256_castps_pd(b);
    return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
}
static inline v16 fold2(v16 a, v16 b) { return v16(fold2_half(a.lo, b.lo), fold2_half(a.hi, b.hi)); }
static inline __m256 fold1_half(__m256 a, __m256 b) {
    const __m256 sa = _mm256_add_ps(a, _mm256_permute_ps(a, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256 sb = _mm256_add_ps(b, _mm256_permute_ps(b, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm256_blend_ps(sa, sb, 0xaa);
}
static inline v16 fold1(v16 a, v16 b) { return v16(fold1_half(a.lo, b.lo), fold1_half(a.hi, b.hi)); }
static inline v16 sum16x16(const v16 *r) {
    v16 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) x[i] = fold8(r[2 * i], r[2 * i + 1]);
    for (int i = 0; i < 4; i++) y[i] = fold4(x[2 * i], x[2 * i + 1]);
    for (int i = 0; i < 2; i++) z[i] = fold2(y[2 * i], y[2 * i + 1]);
    return fold1(z[0], z[1]);
}
/* r[i][k] -> r[k][i] (through memory: the prompt tiles' q, once per tile). */
static inline void transpose16(v16 *r) {
    float m[16][16];
    for (int i = 0; i < 16; i++) store16(m[i], r[i]);
    for (int k = 0; k < 16; k++) {
        float col[16];
        for (int i = 0; i < 16; i++) col[i] = m[i][k];
        r[k] = load16(col);
    }
}
#else
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16 widen(const uint16_t *p) {
#if defined(__AVX512F__)
    /* One vpmovzxwd from memory and a shift: GCC 12 lowers the generic form below to two
     * 8-lane widenings, an extract and an insert (three of them on the shuffle port, which
     * the kernels' reductions need too; measured: the attention kernel's V pass waited on it). */
    __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
#else
    v16h h;
    memcpy(&h, p, sizeof h);
    v16u w = __builtin_convertvector(h, v16u) << 16;
    v16 f;
    memcpy(&f, &w, sizeof f);
    return f;
#endif
}

/* 16 bytes widened to 16 int32 lanes: unsigned (zero-extended) or signed. GCC 12 lowers
 * __builtin_convertvector from 8-bit lanes to one scalar conversion per lane, so the
 * widening instructions are named (vpmovzxbd / vpmovsxbd: one AVX-512 or two AVX2). */
#if defined(__AVX512F__)
#define WIDEN8(name, type, ext512, ext256)                                           \
    static inline v16i name(const type *p) {                                         \
        v16i r;                                                                      \
        __m512i w = ext512(_mm_loadu_si128((const __m128i *)p));                     \
        memcpy(&r, &w, sizeof r);                                                    \
        return r;                                                                    \
    }
#elif defined(__AVX2__)
#define WIDEN8(name, type, ext512, ext256)                                           \
    static inline v16i name(const type *p) {                                         \
        v16i r;                                                                      \
        __m256i a = ext256(_mm_loadl_epi64((const __m128i *)p));                     \
        __m256i b = ext256(_mm_loadl_epi64((const __m128i *)(p + 8)));               \
        memcpy(&r, &a, sizeof a);                                                    \
        memcpy((char *)&r + sizeof a, &b, sizeof b);                                 \
        return r;                                                                    \
    }
#else
#define WIDEN8(name, type, ext512, ext256)                                           \
    static inline v16i name(const type *p) {                                         \
        v16i r;                                                                      \
        for (int i = 0; i < 16; i++) r[i] = p[i];                                    \
        return r;                                                                    \
    }
#endif
WIDEN8(widen_u8, uint8_t, _mm512_cvtepu8_epi32, _mm256_cvtepu8_epi32)
WIDEN8(widen_s8, int8_t, _mm512_cvtepi8_epi32, _mm256_cvtepi8_epi32)
#undef WIDEN8

static inline v16 load16(const float *p) {
    v16 f;
    memcpy(&f, p, sizeof f);
    return f;
}
static inline void store16(float *p, v16 f) { memcpy(p, &f, sizeof f); }
static inline v16i as_int(v16 f) { return (v16i)f; }          /* the same bits as another lane type */
static inline v16u as_uint(v16 f) { return (v16u)f; }
static inline v16 int_as_float(v16i i) { return (v16)i; }
static inline v16 uint_as_float(v16u u) { return (v16)u; }
static inline v16 splat16(float s) { return (v16){0} + s; }
static inline v16 to_float16(v16i i) { return __builtin_convertvector(i, v16); }
static inline v16i to_int16(v16 f) { return __builtin_convertvector(f, v16i); }
static inline v16h narrow16(v16u u) { return __builtin_convertvector(u, v16h); }   /* the low 16 bits */

/* Sum of the 16 lanes as a tree of shuffles (4 steps): a plain loop over the lanes is a chain
 * of 16 dependent additions (the compiler may not reorder float sums), 4x slower here. */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return a[0];
}

static inline v16 vmax(v16 a, v16 b) {
    const v16i gt = a > b;
    return int_as_float((gt & as_int(a)) | (~gt & as_int(b)));
}

static inline float hmax(v16 a) {
    a = vmax(a, __builtin_shuffle(a, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    a = vmax(a, __builtin_shuffle(a, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
    a = vmax(a, __builtin_shuffle(a, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
    a = vmax(a, __builtin_shuffle(a, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
    return a[0];
}

/* Two vectors folded into one, each keeping half its lanes' sums: lanes of `a` fill the low
 * half of every 2w-lane block, lanes of `b` the high half. */
#define FOLD(a, b, lo, hi) (__builtin_shuffle(a, b, (v16i)lo) + __builtin_shuffle(a, b, (v16i)hi))
#define M8L {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}
#define M8H {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}
#define M4L {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}
#define M4H {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31}
#define M2L {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}
#define M2H {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}
#define M1L {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}
#define M1H {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}

/* Lane j of the result: the sum of the 16 lanes of r[bitrev4(j)] (the tree's pairing puts
 * input i at lane bitrev4(i), so callers store item j's partials at r[bitrev4(j)]). */
static inline v16 sum16x16(const v16 *r) {
    v16 x[8], y[4], z[2];
    for (int i = 0; i < 8; i++) x[i] = FOLD(r[2 * i], r[2 * i + 1], M8L, M8H);
    for (int i = 0; i < 4; i++) y[i] = FOLD(x[2 * i], x[2 * i + 1], M4L, M4H);
    for (int i = 0; i < 2; i++) z[i] = FOLD(y[2 * i], y[2 * i + 1], M2L, M2H);
    return FOLD(z[0], z[1], M1L, M1H);
}
/* r[i][k] -> r[k][i], 16 x 16 lanes moved bit for bit: each stage swaps the off-diagonal
 * blocks of 8, 4, 2, then 1 lanes of two rows (two two-vector shuffles, vpermt2ps). */
static inline void transpose16(v16 *r) {
    static const v16i lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                               {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                               {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                               {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
    static const v16i hi[4] = {{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                               {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
                               {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31},
                               {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
    #pragma GCC unroll 4
    for (int stage = 0, s = 8; stage < 4; stage++, s /= 2)
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            if (!(i & s)) {
                const v16 a = r[i], b = r[i + s];
                r[i] = __builtin_shuffle(a, b, lo[stage]);
                r[i + s] = __builtin_shuffle(a, b, hi[stage]);
            }
}

#endif

static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* a where mask (-1), else b. */
static inline v16 select16(v16i mask, v16 a, v16 b) {
    return int_as_float((mask & as_int(a)) | (~mask & as_int(b)));
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, as torch rounds float32 to bf16. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 16 float32 lanes rounded to bf16 (nearest even, as f32_to_bf16: a NaN stays a NaN) and stored. */
static inline void round_to_bf16(v16 f, uint16_t *out) {
    const v16u u = as_uint(f);
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    v16u r = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
    v16h h = narrow16(r);
    memcpy(out, &h, sizeof h);
}

/* e^x for x <= 0 (a softmax's scores minus their max), 16 at a time: x = n ln2 + r with
 * |r| <= ln2/2, e^r by Cephes' expf polynomial (about 1 ulp), 2^n put into the exponent
 * bits. Below -87 (where float32 e^x is denormal or zero) the result is e^-87, about 1e-38. */
static inline v16 exp16(v16 x) {
    x = vmax(x, (v16){0} - 87.0f);
    v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round to nearest */
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;                 /* ln2 in two parts */
    v16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * int_as_float((to_int16(n) + 127) << 23);
}

/* silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (never overflows); below -88.72 it is -0,
 * as torch's g / (1 + e^-g) is once e^-g overflows. */
static inline v16 silu16(v16 g) {
    v16i neg = g < 0;
    v16 mag = uint_as_float(as_uint(g) & 0x7fffffffu);
    v16 e = exp16((v16){0} - mag);                       /* e^-|g| in (0, 1] */
    /* sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below: one division with the numerator
     * picked first, the same IEEE quotient as either form, and faster than two divisions */
    v16i gone = mag > 88.72f;        /* torch: e^|g| overflows, g / inf = -0 */
    const v16 num = int_as_float((neg & ~gone & as_int(e)) | (~neg & as_int(splat16(1.0f))));   /* 0 where the sigmoid is 0 */
    return g * (num / (1.0f + e));
}

#endif
