/* y = x W^T with W stored in 4 or 8 bits (weight-only quantization), x and y bf16:
 * the decode step of one to a few requests, where every weight is read once per token and
 * fewer weight bytes is a faster token. Layouts (built by tessera_kernels/gemv_quant_cpu.py):
 *
 *   int4  packed [N, 32 * ceil(K / 64)] uint8: the columns in runs of 32, runs taken in pairs;
 *         byte j of pair p holds column j of run 2p in its low nibble and column j of run
 *         2p + 1 in its high one (one 32-byte load gives two runs, each in the order of x);
 *         scale and offset [N, K/G] bf16 per group of G columns (G a multiple of 32):
 *         w = q * scale + offset, q in [0, 15].
 *   int8  codes [N, K] int8, scale [N] bf16: w = q * scale.
 *
 * Column n of y is one dot product over K. For one row (single-stream decode) it is split by
 * groups, sum_g scale_g * (x_g . q_g) + offset_g * sum(x_g): the exact weights, float32 sums.
 * For several rows on a CPU with AVX512-BF16 each run's weights are made once, rounded to bf16
 * as the fake-quant reference rounds them, bf16(q * scale + offset), and every row costs one
 * dot-product instruction per run; so all rows of a call are computed alike, and two or more
 * rows give what the dequantized GEMM (dequantize_q4, for many rows) gives, up to summation
 * order. The codes are widened in registers and never written out. Rows are taken four at a
 * time, so a weight row is unpacked once per four rows and stays in L1 for the next four.
 * Threads split the columns in tiles of 16. The result is rounded to bf16 once (nearest even).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define ROWS 4   /* rows per pass: four rows' two sets of accumulators fit the 32 AVX-512 registers */

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
/* With AVX512-BF16 a run is one dot-product instruction: the codes become the bf16 values
 * 0..15 (exact) by a table lookup (vpermw reads an index's low 5 bits: the table repeats, so
 * the high nibble needs no mask) and vdpbf16ps multiplies them by 32 bf16 inputs, summing
 * pairs into float32 lanes. The products are exact, as in the float path below. */
#define BF16_DOT 1
#define L8(a) a, a + 0x10, a + 0x20, a + 0x30, a + 0x40, a + 0x50, a + 0x60, a + 0x70
static const uint16_t LEVELS[32] = {0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
                                    L8(0x4100), 0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0,
                                    0x40c0, 0x40e0, L8(0x4100)};
#undef L8
typedef __m512i run_t;

/* The two runs of a 32-byte pair as 32 bf16 values each. */
static inline void unpack_pair(const uint8_t *p, run_t *a, run_t *b) {
    const __m512i levels = _mm512_loadu_si512(LEVELS);
    __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    *a = _mm512_permutexvar_epi16(v, levels);
    *b = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), levels);
}

/* x[0..31] . run, as 16 float32 partial sums. */
static inline v16 dot_run(const uint16_t *x, const float *xs, run_t w) {
    (void)xs;
    __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(x), (__m512bh)w);
    v16 r;
    memcpy(&r, &a, sizeof r);
    return r;
}
#else
typedef struct { v16 lo, hi; } run_t;   /* a run's columns 0-15 and 16-31 as float32 */

static inline void unpack_pair(const uint8_t *p, run_t *a, run_t *b) {
    v16i first = widen_u8(p), second = widen_u8(p + 16);
    a->lo = to_float16(first & 15);
    a->hi = to_float16(second & 15);
    b->lo = to_float16(first >> 4);
    b->hi = to_float16(second >> 4);
}

static inline v16 dot_run(const uint16_t *x, const float *xs, run_t w) {
    (void)x;
    return load16(xs) * w.lo + load16(xs + 16) * w.hi;
}
#endif

static inline v16 widen_i8(const int8_t *p) {
    return to_float16(widen_s8(p));
}

/* sum_g offset_g * xsum_g, the offsets' share of one output: 16 groups at a time as lanes
 * still to be added up (returned), the groups left over as a scalar (*tail). */
static inline v16 offset_part(const uint16_t *offset, const float *xsum, int ng, float *tail) {
    v16 acc = {0};
    int g = 0;
    for (; g + 16 <= ng; g += 16) acc += widen(offset + g) * load16(xsum + g);
    float t = 0.0f;
    for (; g < ng; g++) t += bf16_to_f32(offset[g]) * xsum[g];
    *tail = t;
    return acc;
}

/* A row's scales (or offsets) per run of 32 columns, as float32. */
static inline void per_run(const uint16_t *src, float *out, int runs, int per_group) {
    if (per_group == 1) {
        int i = 0;
        for (; i + 16 <= runs; i += 16) {
            store16(out + i, widen(src + i));
        }
        for (; i < runs; i++) out[i] = bf16_to_f32(src[i]);
    } else {
        for (int i = 0; i < runs; i++) out[i] = bf16_to_f32(src[i / per_group]);
    }
}

#ifdef BF16_DOT
/* The 32 weights of a run, bf16(q * s + m) (a product and a sum each rounded, as the
 * reference computes them), by a lookup in the run's own 16-entry table. */
static inline __m512i run_weights(__m512i codes, float s, float m) {
    const __m512 levels = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 w = _mm512_add_round_ps(_mm512_mul_round_ps(levels, _mm512_set1_ps(s), nearest), _mm512_set1_ps(m), nearest);
    return _mm512_permutexvar_epi16(codes, (__m512i)_mm512_cvtne2ps_pbh(w, w));
}

/* Column n for several rows: the scale and offset go into the run's weights once, then each
 * row costs one dot-product instruction per run (scaling each row's partial sums instead
 * made four rows 3x the cost of one: measured). */
static inline __attribute__((always_inline))
void column_q4_weights(const uint16_t *x, const uint8_t *row, const float *sr, const float *mr,
                       v16 *part, float *tail, const int R, int K) {
    const int runs = K / 32, pairs = runs / 2;
    __m512 even[ROWS], odd[ROWS];
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm512_setzero_ps();
    for (int p = 0; p <= pairs; p++) {
        if (p == pairs && runs % 2 == 0) break;
        __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(row + 32 * p)));
        __m512i a = run_weights(v, sr[2 * p], mr[2 * p]);
        for (int r = 0; r < R; r++)
            even[r] = _mm512_dpbf16_ps(even[r], (__m512bh)_mm512_loadu_si512(x + (int64_t)r * K + 64 * p), (__m512bh)a);
        if (p == pairs) break;   /* an odd last run is alone in its pair */
        __m512i b = run_weights(_mm512_srli_epi16(v, 4), sr[2 * p + 1], mr[2 * p + 1]);
        for (int r = 0; r < R; r++)
            odd[r] = _mm512_dpbf16_ps(odd[r], (__m512bh)_mm512_loadu_si512(x + (int64_t)r * K + 64 * p + 32), (__m512bh)b);
    }
    for (int r = 0; r < R; r++) {
        __m512 t = _mm512_add_ps(even[r], odd[r]);
        memcpy(&part[16 * r], &t, sizeof t);
        tail[16 * r] = 0.0f;
    }
}
#endif

/* Column n of y for R rows (x bf16 [R, K], widened to float: xs; xsum [R, K/G]), as 16 lanes
 * still to be added up (part[16 r]) and a scalar (tail[16 r]): the tile adds up 16 columns'
 * lanes at once. Inlined with R and (for G = 32) G constants, so the accumulators live in
 * registers and the run loop unrolls. The two runs of a pair add into two sets of
 * accumulators, so one run's scaling never waits for the other's. */
static inline __attribute__((always_inline))
void column_q4(const uint16_t *x, const float *xs, const float *xsum, const uint8_t *packed, const uint16_t *scale,
               const uint16_t *offset, v16 *part, float *tail, int bf16_weights, const int R, int K, int G, int n) {
    const int ng = K / G, runs = K / 32, pairs = runs / 2, per_group = G / 32;
    const uint8_t *row = packed + (int64_t)n * 32 * ((runs + 1) / 2);
    float sr[runs], mr[runs];   /* per run, as float32: a broadcast from memory is the cheap one */
    per_run(scale + (int64_t)n * ng, sr, runs, per_group);
#ifdef BF16_DOT
    if (bf16_weights) {
        per_run(offset + (int64_t)n * ng, mr, runs, per_group);
        column_q4_weights(x, row, sr, mr, part, tail, R, K);
        return;
    }
#endif
    v16 even[ROWS], odd[ROWS];
    for (int r = 0; r < R; r++) even[r] = odd[r] = (v16){0};
    for (int p = 0; p < pairs; p++) {
        run_t a, b;
        unpack_pair(row + 32 * p, &a, &b);
        const int ka = 64 * p, kb = ka + 32;
        for (int r = 0; r < R; r++) {
            even[r] += dot_run(x + (int64_t)r * K + ka, xs + (int64_t)r * K + ka, a) * sr[2 * p];
            odd[r] += dot_run(x + (int64_t)r * K + kb, xs + (int64_t)r * K + kb, b) * sr[2 * p + 1];
        }
    }
    if (runs % 2) {   /* the last run, alone in its pair (high nibbles zero) */
        run_t a, b;
        unpack_pair(row + 32 * pairs, &a, &b);
        const int ka = 64 * pairs;
        for (int r = 0; r < R; r++) even[r] += dot_run(x + (int64_t)r * K + ka, xs + (int64_t)r * K + ka, a) * sr[runs - 1];
    }
    for (int r = 0; r < R; r++)
        part[16 * r] = even[r] + odd[r] + offset_part(offset + (int64_t)n * ng, xsum + (int64_t)r * ng, ng, &tail[16 * r]);
}

/* Start loading column n's codes, scales and offsets (if it exists): the hardware prefetcher
 * restarts on every short weight matrix, and a decode step is a hundred of them. */
#define AHEAD 8
static inline void prefetch_column(const uint8_t *packed, const uint16_t *scale, const uint16_t *offset,
                                   int64_t row_bytes, int64_t ng, int n, int N) {
    if (n >= N) return;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(packed + n * row_bytes + b);
    __builtin_prefetch(scale + n * ng);
    __builtin_prefetch(offset + n * ng);
}

/* Columns [n0, n0 + width) of R rows of y (width <= 16): each column's lanes, then one
 * transposing tree adds up all 16 columns (a tree per column cost a third of a 576-input
 * column: measured), then the tail, and one rounding to bf16. */
static inline __attribute__((always_inline))
void tile_q4(const uint16_t *x, const float *xs, const float *xsum, const uint8_t *packed, const uint16_t *scale,
             const uint16_t *offset, uint16_t *y, int bf16_weights,
             const int R, int N, int K, int G, int n0, int width) {
    v16 part[ROWS * 16];
    float tail[ROWS * 16];
    const int64_t row_bytes = 32 * ((K / 32 + 1) / 2), ng = K / G;
    for (int c = 0; c < 16; c++) {
        if (c < width) {
            prefetch_column(packed, scale, offset, row_bytes, ng, n0 + c + AHEAD, N);
            column_q4(x, xs, xsum, packed, scale, offset, part + BITREV4[c], tail + c, bf16_weights, R, K, G, n0 + c);
        } else {
            for (int r = 0; r < R; r++) part[16 * r + BITREV4[c]] = (v16){0}, tail[16 * r + c] = 0.0f;
        }
    }
    for (int r = 0; r < R; r++) {
        uint16_t out[16];
        round_to_bf16(sum16x16(part + 16 * r) + load16(tail + 16 * r), out);
        memcpy(y + (int64_t)r * N + n0, out, sizeof(uint16_t) * width);
    }
}

static inline __attribute__((always_inline))
void column_q8(const float *xs, const int8_t *codes, const uint16_t *scale, uint16_t *y,
               const int R, int N, int K, int n) {
    const int8_t *row = codes + (int64_t)n * K;
    v16 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = (v16){0};
    for (int k = 0; k < K; k += 16) {
        v16 w = widen_i8(row + k);
        for (int r = 0; r < R; r++) acc[r] += load16(xs + (int64_t)r * K + k) * w;
    }
    const float s = bf16_to_f32(scale[n]);
    for (int r = 0; r < R; r++) y[(int64_t)r * N + n] = f32_to_bf16(hsum(acc[r]) * s);
}

/* What a call needs of x [M, K]: widened to float32 (xs, when the float path reads it) and its
 * sums per group of G columns (xsum, when G > 0). One block; NULL if out of memory. */
static float *widen_rows(const uint16_t *x, int M, int K, int G, int need_xs, float **xs, float **xsum) {
    const size_t nxs = need_xs ? (size_t)M * K : 0, nsum = G > 0 ? (size_t)M * (K / G) : 0;
    float *block = (float *)malloc(sizeof(float) * (nxs + nsum) + 64);
    if (!block) return NULL;
    *xs = need_xs ? block : NULL;
    for (size_t i = 0; i < nxs; i++) block[i] = bf16_to_f32(x[i]);
    if (G > 0) {
        *xsum = block + nxs;
        for (int m = 0; m < M; m++)
            for (int g = 0; g < K / G; g++) {
                float s = 0.0f;
                for (int k = 0; k < G; k++) s += bf16_to_f32(x[(int64_t)m * K + g * G + k]);
                (*xsum)[m * (K / G) + g] = s;
            }
    }
    return block;
}

/* The shapes the int4 kernels can read: whole runs of 32 columns, whole groups of runs. */
static int q4_shape_ok(int M, int N, int K, int G) {
    return M >= 0 && N > 0 && K > 0 && G > 0 && G % 32 == 0 && K % G == 0;
}

/* The rows in passes of ROWS (the last pass takes what is left), R a constant in each. */
#define ROW_PASSES(CALL)                                                                 \
    {                                                                                    \
        int m0 = 0;                                                                      \
        for (; m0 + ROWS <= M; m0 += ROWS) CALL(ROWS);                                   \
        switch (M - m0) {                                                                \
            case 1: CALL(1); break;                                                      \
            case 2: CALL(2); break;                                                      \
            case 3: CALL(3); break;                                                      \
            default: break;                                                              \
        }                                                                                \
    }

/* Returns 0; -1 when out of memory; -2 for a shape the kernel cannot read (the wrapper checks
 * shapes, dtypes and devices first: this is the last line). */
int gemv_q4(const uint16_t *x, const uint8_t *packed, const uint16_t *scale, const uint16_t *offset,
            uint16_t *y, int M, int N, int K, int G, int num_threads) {
    if (!q4_shape_ok(M, N, K, G)) return -2;
#ifdef BF16_DOT
    const int need_xs = 0, need_xsum = M == 1;   /* several rows: the weights carry the offsets */
#else
    const int need_xs = 1, need_xsum = 1;
#endif
    float *xs = NULL, *xsum = NULL;
    float *block = widen_rows(x, M, K, need_xsum ? G : 0, need_xs, &xs, &xsum);
    if (!block) return -1;
    /* G = 32 (GGUF's blocks, our default) compiled with the group size a constant: the run
     * loop disappears and the groups unroll. */
#define Q4G(R, GS) tile_q4(x + (int64_t)m0 * K, xs ? xs + (int64_t)m0 * K : NULL,                    \
                           xsum ? xsum + (int64_t)m0 * (K / G) : NULL, packed, scale, offset,          \
                           y + (int64_t)m0 * N, M > 1, R, N, K, GS, n0, width)
#define Q4(R) (G == 32 ? Q4G(R, 32) : Q4G(R, G))
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int n0 = 0; n0 < N; n0 += 16) {
        const int width = N - n0 < 16 ? N - n0 : 16;
        ROW_PASSES(Q4)
    }
#undef Q4
#undef Q4G
    free(block);
    return 0;
}

/* The dense bf16 weight [N, K] of an int4 one: w = q * scale + offset in float32, the product
 * and the sum each rounded (not fused: as the reference and run_weights compute them), then
 * rounded to bf16. For many rows a GEMM on this copy beats widening the codes once per four
 * rows. Returns 0, or -2 for a shape it cannot read. */
__attribute__((optimize("fp-contract=off")))
int dequantize_q4(const uint8_t *packed, const uint16_t *scale, const uint16_t *offset, uint16_t *w,
                  int N, int K, int G, int num_threads) {
    if (!q4_shape_ok(0, N, K, G)) return -2;
    const int ng = K / G, runs = K / 32;
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int n = 0; n < N; n++) {
        const uint8_t *row = packed + (int64_t)n * 32 * ((runs + 1) / 2);
        uint16_t *out = w + (int64_t)n * K;
        for (int run = 0; run < runs; run++) {
            const uint8_t *p = row + 32 * (run / 2);
            const int shift = 4 * (run % 2), g = run * 32 / G;
            const float s = bf16_to_f32(scale[(int64_t)n * ng + g]), m = bf16_to_f32(offset[(int64_t)n * ng + g]);
            for (int half = 0; half < 2; half++) {
                v16 q = to_float16((widen_u8(p + 16 * half) >> shift) & 15);
                round_to_bf16(q * s + m, out + 32 * run + 16 * half);
            }
        }
    }
    return 0;
}

/* Returns 0; -1 when out of memory; -2 for a shape it cannot read (K a multiple of 16). */
int gemv_q8(const uint16_t *x, const int8_t *codes, const uint16_t *scale, uint16_t *y,
            int M, int N, int K, int num_threads) {
    if (M < 0 || N <= 0 || K <= 0 || K % 16) return -2;
    float *xs = NULL;
    float *block = widen_rows(x, M, K, 0, 1, &xs, NULL);
    if (!block) return -1;
#define Q8(R) column_q8(xs + (int64_t)m0 * K, codes, scale, y + (int64_t)m0 * N, R, N, K, n)
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")
    for (int n = 0; n < N; n++) ROW_PASSES(Q8)
#undef Q8
    free(block);
    return 0;
}
