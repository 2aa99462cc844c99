/* v16, v16i and v16u for CPUs without AVX-512, as C++ classes of two AVX2 registers (vec16.h
 * includes this in a C++ build for such a CPU; cbuild.py compiles the kernels as C++ there).
 *
 * Why not GCC's vector extension, as on AVX-512: GCC 12 keeps a 64-byte vector in memory when
 * no register holds it, builds a broadcast scalar lane by lane on the stack (16 stores and a
 * reload) and moves results through integer registers, which made the AVX2 build of the
 * attention kernel and the SwiGLU activation several times slower than the AVX-512 build of
 * the same source; as two __m256 members each value stays in two registers and every
 * operator is two AVX2 instructions. Same operators and lanes, so the kernels' source is one.
 */
#ifndef TESSERA_VEC16_AVX2_H
#define TESSERA_VEC16_AVX2_H

#include <immintrin.h>
#include <initializer_list>
#include <stdint.h>
#include <string.h>

struct v16;
struct v16u;

/* A brace list's values as 16 lanes, as GCC's vectors take them: the lanes not given are 0. */
template <typename T>
static inline void lanes(std::initializer_list<T> xs, T *f) {
    int i = 0;
    for (T x : xs)
        if (i < 16) f[i++] = x;
    for (; i < 16; i++) f[i] = 0;
}

/* 16 int32 lanes; a comparison's result (-1 where true, 0 where false) as in GCC's vectors. */
struct v16i {
    __m256i lo, hi;
    v16i() = default;
    v16i(__m256i l, __m256i h) : lo(l), hi(h) {}
    v16i(std::initializer_list<int32_t> xs) {   /* lanes not given are 0 */
        int32_t f[16];
        lanes(xs, f);
        lo = _mm256_loadu_si256((const __m256i *)f);
        hi = _mm256_loadu_si256((const __m256i *)(f + 8));
    }
    inline explicit v16i(v16u u);
    int32_t operator[](int i) const {
        int32_t f[16];
        memcpy(f, this, sizeof f);
        return f[i];
    }
};

/* 16 uint32 lanes: logical right shifts, unsigned comparisons. */
struct v16u {
    __m256i lo, hi;
    v16u() = default;
    v16u(__m256i l, __m256i h) : lo(l), hi(h) {}
    explicit v16u(v16i i) : lo(i.lo), hi(i.hi) {}
};
inline v16i::v16i(v16u u) : lo(u.lo), hi(u.hi) {}

struct v16 {
    __m256 lo, hi;
    v16() = default;
    v16(__m256 l, __m256 h) : lo(l), hi(h) {}
    v16(std::initializer_list<float> xs) {      /* lanes not given are 0 */
        float f[16];
        lanes(xs, f);
        lo = _mm256_loadu_ps(f);
        hi = _mm256_loadu_ps(f + 8);
    }
    float operator[](int i) const {
        float f[16];
        memcpy(f, this, sizeof f);
        return f[i];
    }
    float &operator[](int i) { return reinterpret_cast<float *>(this)[i]; }   /* cold paths only */
};

typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16 splat16(float s) { return v16(_mm256_set1_ps(s), _mm256_set1_ps(s)); }
static inline v16i splat16i(int32_t s) { return v16i(_mm256_set1_epi32(s), _mm256_set1_epi32(s)); }
static inline v16u splat16u(uint32_t s) { return v16u(_mm256_set1_epi32((int)s), _mm256_set1_epi32((int)s)); }

#define V16_FLOAT_OP(op, fn)                                                                          \
    static inline v16 operator op(v16 a, v16 b) { return v16(fn(a.lo, b.lo), fn(a.hi, b.hi)); }      \
    static inline v16 operator op(v16 a, float b) { return a op splat16(b); }                         \
    static inline v16 operator op(float a, v16 b) { return splat16(a) op b; }                         \
    static inline v16 &operator op##=(v16 &a, v16 b) { return a = a op b; }                           \
    static inline v16 &operator op##=(v16 &a, float b) { return a = a op b; }
V16_FLOAT_OP(+, _mm256_add_ps)
V16_FLOAT_OP(-, _mm256_sub_ps)
V16_FLOAT_OP(*, _mm256_mul_ps)
V16_FLOAT_OP(/, _mm256_div_ps)
#undef V16_FLOAT_OP

#define V16_CMP(op, pred)                                                                             \
    static inline v16i operator op(v16 a, v16 b) {                                                    \
        return v16i(_mm256_castps_si256(_mm256_cmp_ps(a.lo, b.lo, pred)),                             \
                    _mm256_castps_si256(_mm256_cmp_ps(a.hi, b.hi, pred)));                            \
    }                                                                                                 \
    static inline v16i operator op(v16 a, float b) { return a op splat16(b); }
V16_CMP(<, _CMP_LT_OQ)
V16_CMP(<=, _CMP_LE_OQ)
V16_CMP(>, _CMP_GT_OQ)
V16_CMP(>=, _CMP_GE_OQ)
V16_CMP(==, _CMP_EQ_OQ)
V16_CMP(!=, _CMP_NEQ_UQ)   /* a NaN differs from everything, itself included */
#undef V16_CMP

/* Integer lanes: the same operators for v16i and v16u (T), scalars broadcast. */
#define V16_INT_OP(T, op, fn)                                                                         \
    static inline T operator op(T a, T b) { return T(fn(a.lo, b.lo), fn(a.hi, b.hi)); }              \
    static inline T operator op(T a, int64_t b) { return a op T(_mm256_set1_epi32((int)b), _mm256_set1_epi32((int)b)); } \
    static inline T operator op(int64_t a, T b) { return T(_mm256_set1_epi32((int)a), _mm256_set1_epi32((int)a)) op b; } \
    static inline T &operator op##=(T &a, T b) { return a = a op b; }                                 \
    static inline T &operator op##=(T &a, int64_t b) { return a = a op b; }
#define V16_INT_OPS(T)                                                                                \
    V16_INT_OP(T, +, _mm256_add_epi32)                                                                \
    V16_INT_OP(T, -, _mm256_sub_epi32)                                                                \
    V16_INT_OP(T, &, _mm256_and_si256)                                                                \
    V16_INT_OP(T, |, _mm256_or_si256)                                                                 \
    V16_INT_OP(T, ^, _mm256_xor_si256)                                                                \
    static inline T operator~(T a) { return a ^ T(_mm256_set1_epi32(-1), _mm256_set1_epi32(-1)); }   \
    static inline T operator<<(T a, int n) {                                                          \
        return T(_mm256_sll_epi32(a.lo, _mm_cvtsi32_si128(n)), _mm256_sll_epi32(a.hi, _mm_cvtsi32_si128(n))); \
    }
V16_INT_OPS(v16i)
V16_INT_OPS(v16u)
#undef V16_INT_OPS
#undef V16_INT_OP

static inline v16i operator>>(v16i a, int n) {   /* arithmetic */
    return v16i(_mm256_sra_epi32(a.lo, _mm_cvtsi32_si128(n)), _mm256_sra_epi32(a.hi, _mm_cvtsi32_si128(n)));
}
static inline v16u operator>>(v16u a, int n) {   /* logical */
    return v16u(_mm256_srl_epi32(a.lo, _mm_cvtsi32_si128(n)), _mm256_srl_epi32(a.hi, _mm_cvtsi32_si128(n)));
}

static inline v16i operator==(v16i a, v16i b) {
    return v16i(_mm256_cmpeq_epi32(a.lo, b.lo), _mm256_cmpeq_epi32(a.hi, b.hi));
}
static inline v16i operator>(v16i a, v16i b) {
    return v16i(_mm256_cmpgt_epi32(a.lo, b.lo), _mm256_cmpgt_epi32(a.hi, b.hi));
}
static inline v16i operator!=(v16i a, v16i b) { return ~(a == b); }
static inline v16i operator<(v16i a, v16i b) { return b > a; }
static inline v16i operator>=(v16i a, v16i b) { return ~(b > a); }
static inline v16i operator<=(v16i a, v16i b) { return ~(a > b); }
static inline v16i operator>(v16i a, int64_t b) { return a > splat16i((int32_t)b); }
static inline v16i operator<(v16i a, int64_t b) { return a < splat16i((int32_t)b); }
static inline v16i operator>=(v16i a, int64_t b) { return a >= splat16i((int32_t)b); }
static inline v16i operator<=(v16i a, int64_t b) { return a <= splat16i((int32_t)b); }
static inline v16i operator==(v16i a, int64_t b) { return a == splat16i((int32_t)b); }
static inline v16i operator!=(v16i a, int64_t b) { return a != splat16i((int32_t)b); }

/* Unsigned comparisons: flip the sign bits, compare signed. */
static inline v16i operator>(v16u a, v16u b) {
    const v16i flip = splat16i(INT32_MIN);
    return v16i(v16i(a) ^ flip) > v16i(v16i(b) ^ flip);
}
static inline v16i operator>(v16u a, uint32_t b) { return a > splat16u(b); }
static inline v16i operator<(v16u a, uint32_t b) { return splat16u(b) > a; }

#endif
