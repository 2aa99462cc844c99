/* The float32 FMA register tile of tile_linear_f32.c, shared with tile_linear_bf16.c's AVX2 build
 * (which unpacks each bf16 panel into this layout first). A panel holds nv blocks of L output
 * columns for every input k:
 *   wp[(k * nv + b) * L + j] = W[column L * b + j of the panel][k]
 * A register tile is TILE_F32_ROWS rows x nv vectors of accumulators (8 x 3 of the 32 AVX-512
 * registers, 4 x 3 of AVX2's 16), each weight vector feeding every row. */
#ifndef TESSERA_TILE_F32_H
#define TESSERA_TILE_F32_H
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define L 16
#define TILE_F32_ROWS 8
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vloadf _mm512_loadu_ps
#define vstoref _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vadd _mm512_add_ps
#define vbroadcast _mm512_set1_ps
#else
#define L 8
#define TILE_F32_ROWS 4
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vloadf _mm256_loadu_ps
#define vstoref _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vadd _mm256_add_ps
#define vbroadcast _mm256_set1_ps
#endif

#define NV_MAX 3      /* L-column blocks per panel */
#define M_CHUNK 256   /* rows of x per pass over the panels (a chunk of x stays in L2) */

/* A weight vector pinned to a register once loaded. With AVX2's 16 registers (12 accumulators,
 * 3 weight vectors, 1 broadcast) GCC 12 otherwise folds the weight loads into the FMAs, reading
 * each vector once per row (16 loads per 12 FMAs instead of 7), and the loads, not the FMAs,
 * set the pace: pinned, the tile runs nearly twice as fast. The AVX-512 build (32 registers)
 * keeps its own allocation. */
#if defined(__AVX512F__)
#define IN_REGISTER(x) (void)0
#else
#define IN_REGISTER(x) __asm__("" : "+x"(x))
#endif

/* acc[r][v] = sum over k in order of x[r * xs + k] * wp[(k * nv + v) * L + 0..L-1], rows r < mr. */
static inline __attribute__((always_inline)) void tile_f32(const float *x, int64_t xs, const float *wp, int K,
                                                           const int mr, const int nv,
                                                           vec acc[TILE_F32_ROWS][NV_MAX]) {
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = vzero();
    for (int k = 0; k < K; k++) {
        const float *wk = wp + (int64_t)k * nv * L;
        vec w[NV_MAX];
        for (int v = 0; v < nv; v++) {
            w[v] = vloadf(wk + L * v);
            IN_REGISTER(w[v]);
        }
        for (int r = 0; r < mr; r++) {
            const vec a = vbroadcast(x[r * xs + k]);
            for (int v = 0; v < nv; v++) acc[r][v] = vfma(a, w[v], acc[r][v]);
        }
    }
}

#endif
#endif
