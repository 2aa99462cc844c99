/* bf16 linear by AVX512-BF16 register tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),
 * float32 accumulation, one rounding to bf16. For CPUs with AVX512-BF16 and no AMX (AMD Zen 4
 * and Zen 5), where a decode step at batch 64 and every prompt chunk are bound by the bf16
 * dot-product units, not by memory: oneDNN's matmul reached 320 GFLOP/s of the 450 that
 * vdpbf16ps gives on two Zen 4 cores.
 *
 * W is packed once (tile_linear.py) into panels of up to NV_MAX blocks of 16 output columns.
 * Within a panel, for each pair of inputs k = 2p, 2p + 1, the blocks lie side by side, each
 * holding the 16 columns' pairs (W[n, 2p], W[n, 2p + 1]) as vdpbf16ps reads them:
 *   packed[panel_start + (p * nv + b) * 32 + 2 * j + q] = W[16 * (NV_MAX * panel + b) + j][2p + q]
 * where nv is the panel's block count (NV_MAX except in the last panel) and every panel before
 * it is full. A panel's weights (K * 96 bytes: 147 KiB for K = 1536) stay in L2 while every
 * tile of MR rows of x runs over them; one register tile is MR rows x nv * 16 columns of
 * float32 accumulators, each weight vector feeding MR rows and each broadcast pair of x
 * feeding nv vectors; a tile may also prefetch a stretch of the next panel (pf_per_step cache
 * lines per pair of inputs). Each output is one accumulator running over k in order (oneDNN splits
 * some sums: about one element in 10^4 differs from its result in the last bit).
 */
#include <stdint.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define NV_MAX 3   /* 16-column blocks per panel */
#define MR 8       /* rows per register tile: 8 x 3 accumulators + 3 weight vectors */
#define M_CHUNK 256 /* rows of x per pass over the panels (a chunk of x stays in L2) */

static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t xs, const uint16_t *wp,
                                                       const float *bias, uint16_t *y, int64_t ys,
                                                       int KP, const int mr, const int nv,
                                                       const char *pf, int pf_per_step) {
    __m512 acc[MR][NV_MAX];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < KP; p++) {
        const uint16_t *wk = wp + (int64_t)p * nv * 32;
        __m512bh w[NV_MAX];
        for (int v = 0; v < nv; v++) w[v] = (__m512bh)_mm512_loadu_si512((const void *)(wk + 32 * v));
        for (int i = 0; i < pf_per_step; i++) _mm_prefetch(pf + ((int64_t)p * pf_per_step + i) * 64, _MM_HINT_T1);
        for (int r = 0; r < mr; r++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(*(const int32_t *)(x + r * xs + 2 * p));
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) {
            const __m512 out = bias ? _mm512_add_ps(acc[r][v], _mm512_loadu_ps(bias + 16 * v)) : acc[r][v];
            _mm256_storeu_si256((__m256i *)(y + r * ys + 16 * v), (__m256i)_mm512_cvtneps_pbh(out));
        }
}

/* One call per (rows, blocks) pair, so each is compiled with constant loop bounds and its
 * accumulators live in registers. */
#define TILE(MRV, NVV) case (MRV) * 4 + (NVV): tile(x, xs, wp, bias, y, ys, KP, MRV, NVV, pf, pf_per_step); break;
#define TILES(MRV) TILE(MRV, 1) TILE(MRV, 2) TILE(MRV, 3)

static void tile_any(const uint16_t *x, int64_t xs, const uint16_t *wp, const float *bias, uint16_t *y,
                     int64_t ys, int KP, int mr, int nv, const char *pf, int pf_per_step) {
    switch (mr * 4 + nv) {
        TILES(1) TILES(2) TILES(3) TILES(4) TILES(5) TILES(6) TILES(7) TILES(8)
    }
}

int tile_linear_bf16_built(void) { return 1; }

static inline int blocks_in(int panel, int NB) {   /* 16-column blocks in a panel: NV_MAX but in the last */
    return NB - panel * NV_MAX < NV_MAX ? NB - panel * NV_MAX : NV_MAX;
}

/* x: [M, K] bf16, rows x_stride elements apart; w: packed as above; bias: [N] float32 or NULL;
 * y: [M, N] bf16 contiguous. N a multiple of 16, K even, x_stride >= K. Returns 0, or -1 for
 * shapes out of range. */
int tile_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *y,
                     int M, int N, int K, int threads) {
    if (M < 1 || N % 16 || K % 2 || x_stride < K) return -1;
    const int KP = K / 2, NB = N / 16, panels = (NB + NV_MAX - 1) / NV_MAX;
    for (int m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int m1 = M - m0 < M_CHUNK ? M : m0 + M_CHUNK;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int pn = 0; pn < panels; pn++) {
            const int nv = blocks_in(pn, NB);
            const uint16_t *wp = w + (int64_t)pn * NV_MAX * KP * 32;
            const int n0 = pn * NV_MAX * 16;
            /* The row tiles of this panel share the prefetch of the next panel into L2, so its
             * weights stream from memory while these tiles compute instead of stalling its first
             * tile (Zen 4, SmolLM2's linears at 64 rows: 43-46 -> 41-42.5 ms). One tile alone
             * (8 rows or fewer) leaves it to the hardware prefetcher. */
            const int tiles = (m1 - m0 + MR - 1) / MR;
            const int64_t next_lines = pn + 1 < panels ? (int64_t)KP * blocks_in(pn + 1, NB) : 0;   /* 64 B each */
            const int64_t per_tile = tiles > 1 ? (next_lines + tiles - 1) / tiles : 0;
            const int per_step = (int)((per_tile + KP - 1) / KP);
            const char *next = (const char *)(wp + (int64_t)NV_MAX * KP * 32);
            for (int r = m0, t = 0; r < m1; r += MR, t++) {
                const int mr = m1 - r < MR ? m1 - r : MR;
                tile_any(x + r * x_stride, x_stride, wp, bias ? bias + n0 : 0, y + (int64_t)r * N + n0, N, KP, mr, nv,
                         next + t * per_tile * 64, t * per_tile < next_lines ? per_step : 0);
            }
        }
    }
    return 0;
}

#else   /* built for a CPU without AVX512-BF16 (TESSERA_MARCH): the Python side sees 0 and uses oneDNN */
int tile_linear_bf16_built(void) { return 0; }
int tile_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *y,
                     int M, int N, int K, int threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
    return -1;
}
#endif
