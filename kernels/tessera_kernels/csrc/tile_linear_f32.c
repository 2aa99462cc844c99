/* float32 linear by FMA register tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), for any
 * row count, on CPUs with AVX2 and FMA (`--dtype float32`; auto is bf16 wherever the bf16 tiles
 * are built, which on AVX2 run this tile over unpacked panels). A decode step reads 4 bytes
 * per weight: at one to four rows oneDNN streams them well below what a plain read gets, and
 * at 8 to 64 rows it keeps part of the FMA units idle, on AVX-512 and on AVX2 builds alike.
 *
 * The same panels as tile_linear_bf16.c, with single inputs instead of pairs and L lanes per
 * vector (16 with AVX-512, 8 with AVX2), the register tile in tile_f32.h:
 *   packed[panel_start + (k * nv + b) * L + j] = W[L * (NV_MAX * panel + b) + j][k]
 */
#include <stdint.h>

#include "tile_f32.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define MR TILE_F32_ROWS

static inline __attribute__((always_inline)) void tile(const float *x, int64_t xs, const float *wp, const float *bias,
                                                       float *y, int64_t ys, int K, const int mr, const int nv) {
    vec acc[MR][NV_MAX];
    tile_f32(x, xs, wp, K, mr, nv, acc);
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) vstoref(y + r * ys + L * v, bias ? vadd(acc[r][v], vloadf(bias + L * v)) : acc[r][v]);
}

/* One call per (rows, blocks) pair, compiled with constant loop bounds (see tile_linear_bf16.c). */
#define TILE(MRV, NVV) case (MRV) * 4 + (NVV): tile(x, xs, wp, bias, y, ys, K, MRV, NVV); break;
#define TILES(MRV) TILE(MRV, 1) TILE(MRV, 2) TILE(MRV, 3)

static void tile_any(const float *x, int64_t xs, const float *wp, const float *bias, float *y, int64_t ys, int K,
                     int mr, int nv) {
    switch (mr * 4 + nv) {
        TILES(1) TILES(2) TILES(3) TILES(4)
#if MR > 4
        TILES(5) TILES(6) TILES(7) TILES(8)
#endif
    }
}

int tile_linear_f32_lanes(void) { return L; }

/* x: [M, K] float32, rows x_stride elements apart; w: packed as above; bias: [N] or NULL;
 * y: [M, N] contiguous. N a multiple of L, x_stride >= K. Returns 0, or -1 for shapes out
 * of range. */
int tile_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                    int M, int N, int K, int threads) {
    if (M < 1 || K < 1 || N % L || x_stride < K) return -1;
    const int NB = N / L, panels = (NB + NV_MAX - 1) / NV_MAX;
    for (int m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int m1 = M - m0 < M_CHUNK ? M : m0 + M_CHUNK;
        #pragma omp parallel for schedule(static) num_threads(threads)
        for (int pn = 0; pn < panels; pn++) {
            const int nv = NB - pn * NV_MAX < NV_MAX ? NB - pn * NV_MAX : NV_MAX;
            const float *wp = w + (int64_t)pn * NV_MAX * K * L;
            const int n0 = pn * NV_MAX * L;
            for (int r = m0; r < m1; r += MR) {
                const int mr = m1 - r < MR ? m1 - r : MR;
                tile_any(x + r * x_stride, x_stride, wp, bias ? bias + n0 : 0, y + (int64_t)r * N + n0, N, K, mr, nv);
            }
        }
    }
    return 0;
}

#else   /* no FMA vectors: the Python side sees 0 lanes and uses oneDNN */
int tile_linear_f32_lanes(void) { return 0; }
int tile_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                    int M, int N, int K, int threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
    return -1;
}
#endif
