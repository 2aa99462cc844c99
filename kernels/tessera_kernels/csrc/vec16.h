/* Sixteen float32 lanes and the bf16 helpers the CPU kernels share. A v16 is one AVX-512
 * register, or two AVX2 ones (the compiler splits it), so every kernel has one source for
 * both kinds of machine. bf16 is the top half of a float32: widening is a 16-bit shift. */
#ifndef TESSERA_VEC16_H
#define TESSERA_VEC16_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

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
    v16u u;
    memcpy(&u, &f, sizeof u);
    v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    v16u r = (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
    v16h h = __builtin_convertvector(r, v16h);
    memcpy(out, &h, sizeof h);
}

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
    v16i gt = a > b;
    v16i ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    v16i r = (gt & ai) | (~gt & bi);
    memcpy(&a, &r, sizeof a);
    return a;
}

static inline float hmax(v16 a) {
    a = vmax(a, __builtin_shuffle(a, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    a = vmax(a, __builtin_shuffle(a, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3}));
    a = vmax(a, __builtin_shuffle(a, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
    a = vmax(a, __builtin_shuffle(a, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0}));
    return a[0];
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
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    v16 scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* silu(g) = g * sigmoid(g), the sigmoid from e^-|g| (never overflows); below -88.72 it is -0,
 * as torch's g / (1 + e^-g) is once e^-g overflows. */
static inline v16 silu16(v16 g) {
    v16i neg = g < 0;
    v16 mag = g;
    v16u bits;
    memcpy(&bits, &mag, sizeof bits);
    bits &= 0x7fffffffu;
    memcpy(&mag, &bits, sizeof mag);
    v16 e = exp16((v16){0} - mag);                       /* e^-|g| in (0, 1] */
    /* sigmoid(g) = 1 / (1 + e) for g >= 0, e / (1 + e) below: one division with the numerator
     * picked first, the same IEEE quotient as either form (Intel Xeon with AMX, 2048 x 1536
     * values: 1.40-2.03 -> 1.26-1.85 ms against two divisions) */
    v16i gone = mag > 88.72f;        /* torch: e^|g| overflows, g / inf = -0 */
    v16 one = 1.0f + (v16){0};
    v16i eb, ob;
    memcpy(&eb, &e, sizeof eb);
    memcpy(&ob, &one, sizeof ob);
    v16i num_bits = (neg & ~gone & eb) | (~neg & ob);   /* 0 where the sigmoid is 0 */
    v16 num;
    memcpy(&num, &num_bits, sizeof num);
    return g * (num / (1.0f + e));
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

static const int BITREV4[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

#endif
