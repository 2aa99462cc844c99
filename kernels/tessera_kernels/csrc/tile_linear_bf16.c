/* bf16 linear by register tiles: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]), float32
 * accumulation, one rounding to bf16. Two tiles over the same packed weight: AVX512-BF16 dot
 * products (vdpbf16ps) for CPUs that have them and no AMX (AMD Zen 4 and Zen 5), where a
 * decode step at a large batch and every prompt chunk are bound by the bf16 dot-product units,
 * not by memory, and oneDNN's matmul leaves a good part of them unused; and float32 FMAs
 * (below), built for AVX-512 and for AVX2.
 *
 * W is packed once (tile_linear.py) into panels of up to NV_MAX blocks of L output columns
 * (L = 16 with AVX-512, 8 with AVX2). Within a panel, for each pair of inputs k = 2p, 2p + 1,
 * the blocks lie side by side, each holding the L columns' pairs (W[n, 2p], W[n, 2p + 1]) as
 * vdpbf16ps reads them:
 *   packed[panel_start + (p * nv + b) * 2L + 2 * j + q] = W[L * (NV_MAX * panel + b) + j][2p + q]
 * where nv is the panel's block count (NV_MAX except in the last panel) and every panel before
 * it is full. A panel's weights (K * 96 bytes: 147 KiB for K = 1536) stay in L2 while every
 * tile of MR rows of x runs over them; one register tile is MR rows x nv * L columns of
 * float32 accumulators, each weight vector feeding MR rows and each broadcast pair of x
 * feeding nv vectors. The next panel's weights are left to the hardware prefetcher: an L2
 * prefetch of it spread over this panel's row tiles gained nothing. Each output is
 * one accumulator running over k in order (oneDNN splits some sums: about one element in
 * 10^4 differs from its result in the last bit).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tile_f32.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <omp.h>

/* The FMA tiles' vectors are tile_f32.h's: L float32 lanes (L output columns per block). */
#if defined(__AVX512F__)
#define MR 8       /* rows per register tile: 8 x 3 accumulators of the 32 registers */
#define PANEL_F32 0
#define PANEL_MIN_ROWS 0
typedef __m512i veci;
#define vloadi(p) _mm512_loadu_si512((const void *)(p))
#define vshl16(w) _mm512_castsi512_ps(_mm512_slli_epi32(w, 16))
#define vhigh16(w) _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xFFFF0000u)))
#define vload_bf16(p) vshl16(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))))
#define vswap_pairs(f) _mm512_permute_ps(f, 0xB1)
#else
/* 3 x 3 accumulators of AVX2's 16 registers, with a panel's six weight vectors, below 16 rows
 * (where the weights' bytes set the pace); from 16 rows on, each panel unpacked to float32 for
 * tile_linear_f32.c's 4 x 3 tile (below): unpacking costs more than it gains below 16 rows
 * and pays from 16 rows on. */
#define MR 3
#define PANEL_F32 1
#define PANEL_MIN_ROWS 16
typedef __m256i veci;
#define vloadi(p) _mm256_loadu_si256((const __m256i *)(p))
#define vshl16(w) _mm256_castsi256_ps(_mm256_slli_epi32(w, 16))
#define vhigh16(w) _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)))
#define vload_bf16(p) vshl16(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define vswap_pairs(f) _mm256_permute_ps(f, 0xB1)
#endif

/* The FMA tiles ask for the panel's weights 4 KiB ahead: a panel is read from memory by its
 * first row tile (from L2 by the next ones), and the hardware prefetcher alone kept that tile
 * waiting on Intel cores (2 and 8 KiB ahead do as well as 4). */
#define AHEAD_ELEMS 2048

/* f rounded to bf16 into p (L values). Without AVX512-BF16 (Intel Cascade Lake, AVX2) as
 * vcvtneps2bf16 rounds: to the nearest, ties to even; a NaN stays a NaN (its low bits carried
 * into the exponent would make it infinite, so it is quieted instead). */
#if defined(__AVX512BF16__)
#define HAVE_DOT_BF16 1
static inline void store_bf16(uint16_t *p, vec f) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(f)); }
#elif defined(__AVX512F__)
#define HAVE_DOT_BF16 0
static inline void store_bf16(uint16_t *p, vec f) {
    const veci bits = _mm512_castps_si512(f);
    const veci odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    veci r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    r = _mm512_mask_or_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), bits, _mm512_set1_epi32(0x400000));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#else
#define HAVE_DOT_BF16 0
static inline void store_bf16(uint16_t *p, vec f) {
    const veci bits = _mm256_castps_si256(f);
    const veci odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    veci r = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    const veci nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(bits, _mm256_set1_epi32(0x400000)), nan);
    r = _mm256_srli_epi32(r, 16);   /* 0..65535: packus keeps them, in two 128-bit halves */
    const veci packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}
#endif

/* The tile's accumulators (+ bias) rounded once to bf16 into y. */
static inline __attribute__((always_inline)) void store_tile(vec acc[][NV_MAX], const float *bias, uint16_t *y,
                                                             int64_t ys, const int mr, const int nv) {
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++)
            store_bf16(y + r * ys + L * v, bias ? vadd(acc[r][v], vloadf(bias + L * v)) : acc[r][v]);
}

#if HAVE_DOT_BF16
static inline __attribute__((always_inline)) void tile(const uint16_t *x, int64_t xs, const uint16_t *wp,
                                                       const float *bias, uint16_t *y, int64_t ys,
                                                       int KP, const int mr, const int nv) {
    __m512 acc[MR][NV_MAX];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < KP; p++) {
        const uint16_t *wk = wp + (int64_t)p * nv * 32;
        __m512bh w[NV_MAX];
        for (int v = 0; v < nv; v++) w[v] = (__m512bh)_mm512_loadu_si512((const void *)(wk + 32 * v));
        for (int r = 0; r < mr; r++) {
            int32_t pair;   /* x[r, 2p] and x[r, 2p + 1], read as one 32-bit lane (any alignment) */
            memcpy(&pair, x + r * xs + 2 * p, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, w[v]);
        }
    }
    store_tile(acc, bias, y, ys, mr, nv);
}
#endif

#if PANEL_F32
/* AVX2's 16 registers hold no pair tile worth having: both inputs' weight vectors at once left 3 x
 * 3 accumulators, well behind float32's 4 x 3 tile. So each thread unpacks a panel to float32 once
 * per pass over the rows (K * 96 bytes, kept in L2 while every row tile runs over it) and runs
 * tile_linear_f32.c's 4 x 3 tile: the weights still cross memory as bf16, and unpacking costs a
 * few percent of the tile's FMAs at 64 rows. Each pair goes in odd input first (2p + 1, then 2p),
 * and x the same way (the caller's xf), so every accumulator takes its products in tile_fma's
 * order below. */
static void unpack_panel(const uint16_t *wp, float *wf, int KP, int nv) {
    for (int p = 0; p < KP; p++)
        for (int v = 0; v < nv; v++) {
            const veci w = vloadi(wp + ((int64_t)p * nv + v) * 2 * L);
            vstoref(wf + ((int64_t)2 * p * nv + v) * L, vhigh16(w));
            vstoref(wf + ((int64_t)(2 * p + 1) * nv + v) * L, vshl16(w));
        }
}

static inline __attribute__((always_inline)) void tile_panel(const float *xf, int64_t xs, const float *wf,
                                                             const float *bias, uint16_t *y, int64_t ys,
                                                             int K, const int mr, const int nv) {
    vec acc[TILE_F32_ROWS][NV_MAX];
    tile_f32(xf, xs, wf, K, mr, nv, acc);
    store_tile(acc, bias, y, ys, mr, nv);
}
#endif

/* The same tile by float32 FMAs, for cores that run vdpbf16ps at a fraction of their FMA rate
 * (Intel cores without AMX: about half) or have none (Cascade Lake). One load of a pair block
 * gives both inputs' weights as float32, the even one shifted up 16 bits and the odd one with
 * its low 16 bits cleared, so the weights still cross memory as bf16; x comes as float32 (xf,
 * converted once per call) and is broadcast from memory by the FMA itself. A bf16 product is
 * exact in float32, so each FMA rounds once, as vdpbf16ps does per input on Intel (odd input
 * first, then even: the order of its pseudocode; the two tiles' results were equal bit for bit
 * there). */
static inline __attribute__((always_inline)) void tile_fma(const float *xf, int64_t xs, const uint16_t *wp,
                                                           const float *bias, uint16_t *y, int64_t ys,
                                                           int KP, const int mr, const int nv) {
    vec acc[MR][NV_MAX];
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = vzero();
    for (int p = 0; p < KP; p++) {
        const uint16_t *wk = wp + (int64_t)p * nv * 2 * L;
        vec even[NV_MAX], odd[NV_MAX];
        for (int v = 0; v < nv; v++) {
            __builtin_prefetch(wk + 2 * L * v + AHEAD_ELEMS);
            const veci w = vloadi(wk + 2 * L * v);
            even[v] = vshl16(w);
            odd[v] = vhigh16(w);
        }
        for (int r = 0; r < mr; r++) {
            const vec a1 = vbroadcast(xf[r * xs + 2 * p + 1]), a0 = vbroadcast(xf[r * xs + 2 * p]);
            for (int v = 0; v < nv; v++) acc[r][v] = vfma(a0, even[v], vfma(a1, odd[v], acc[r][v]));
        }
    }
    store_tile(acc, bias, y, ys, mr, nv);
}

/* One row of x as float32 (a bf16 is the top half of its float32), L values a vector (a
 * scalar loop was a visible share of a long prompt's step on AVX2); swap: each pair's two inputs
 * exchanged (x[2p + 1] first), the order of the unpacked panels. K is even. */
static void row_to_f32(const uint16_t *x, float *xf, int K, int swap) {
    int k = 0;
    for (; k + L <= K; k += L) {
        const vec f = vload_bf16(x + k);
        vstoref(xf + k, swap ? vswap_pairs(f) : f);
    }
    for (; k < K; k++) {
        const uint32_t bits = (uint32_t)x[k] << 16;
        memcpy(xf + (k ^ swap), &bits, sizeof bits);
    }
}

/* One call per (rows, blocks) pair, so each is compiled with constant loop bounds and its
 * accumulators live in registers. depth: the tile's K (pairs of inputs for the packed bf16). */
#define TILE(F, MRV, NVV) case (MRV) * 4 + (NVV): F(x, xs, wp, bias, y, ys, depth, MRV, NVV); break;
#define TILES(F, MRV) TILE(F, MRV, 1) TILE(F, MRV, 2) TILE(F, MRV, 3)

#if HAVE_DOT_BF16
static void tile_any(const uint16_t *x, int64_t xs, const uint16_t *wp, const float *bias, uint16_t *y,
                     int64_t ys, int depth, int mr, int nv) {
    switch (mr * 4 + nv) {
        TILES(tile, 1) TILES(tile, 2) TILES(tile, 3) TILES(tile, 4)
        TILES(tile, 5) TILES(tile, 6) TILES(tile, 7) TILES(tile, 8)
    }
}
#endif

#if PANEL_F32
#if TILE_F32_ROWS != 4
#error "tile_panel_any runs tiles of 1 to 4 rows"
#endif
static void tile_panel_any(const float *x, int64_t xs, const float *wp, const float *bias, uint16_t *y,
                           int64_t ys, int depth, int mr, int nv) {
    switch (mr * 4 + nv) {
        TILES(tile_panel, 1) TILES(tile_panel, 2) TILES(tile_panel, 3) TILES(tile_panel, 4)
    }
}
#endif

static void tile_fma_any(const float *x, int64_t xs, const uint16_t *wp, const float *bias, uint16_t *y,
                         int64_t ys, int depth, int mr, int nv) {
    switch (mr * 4 + nv) {
        TILES(tile_fma, 1) TILES(tile_fma, 2) TILES(tile_fma, 3)
#if MR > 3
        TILES(tile_fma, 4) TILES(tile_fma, 5) TILES(tile_fma, 6) TILES(tile_fma, 7) TILES(tile_fma, 8)
#endif
    }
}

/* One panel (nv blocks from output column n0) over rows m0..m1 of a chunk whose x is xf as
 * float32: unpacked into `panel` for the float32 tile where given (AVX2, 16+ rows), else by the
 * FMA pair tiles or (fma 0) the vdpbf16ps ones. */
static void run_panel(const uint16_t *x, int64_t x_stride, const float *xf, int K, const uint16_t *wp, float *panel,
                      const float *bias, uint16_t *y, int N, int n0, int nv, int m0, int m1, int fma) {
    const int KP = K / 2;
#if PANEL_F32
    if (panel) {
        unpack_panel(wp, panel, KP, nv);
        for (int r = m0; r < m1; r += TILE_F32_ROWS) {
            const int mr = m1 - r < TILE_F32_ROWS ? m1 - r : TILE_F32_ROWS;
            tile_panel_any(xf + (int64_t)(r - m0) * K, K, panel, bias, y + (int64_t)r * N + n0, N, K, mr, nv);
        }
        return;
    }
#else
    (void)panel;
#endif
    for (int r = m0; r < m1; r += MR) {
        const int mr = m1 - r < MR ? m1 - r : MR;
        if (fma)
            tile_fma_any(xf + (int64_t)(r - m0) * K, K, wp, bias, y + (int64_t)r * N + n0, N, KP, mr, nv);
#if HAVE_DOT_BF16
        else
            tile_any(x + r * x_stride, x_stride, wp, bias, y + (int64_t)r * N + n0, N, KP, mr, nv);
#else
        (void)x; (void)x_stride;
#endif
    }
}

/* 2: both tiles built (AVX512-BF16), 1: the FMA tiles only, 0: none (below). */
int tile_linear_bf16_built(void) { return 1 + HAVE_DOT_BF16; }
int tile_linear_bf16_lanes(void) { return L; }

/* x: [M, K] bf16, rows x_stride elements apart; w: packed as above; bias: [N] float32 or NULL;
 * y: [M, N] bf16 contiguous. N a multiple of L, K even, x_stride >= K. fma: 0 for the
 * vdpbf16ps tiles, 1 for the FMA ones. Returns 0, -1 for shapes out of range, -2 for no memory
 * (x as float32, or the unpacked panels). */
int tile_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *y,
                     int M, int N, int K, int threads, int fma) {
    if (M < 1 || N % L || K % 2 || x_stride < K || threads < 1 || (!fma && !HAVE_DOT_BF16)) return -1;
    const int KP = K / 2, NB = N / L, panels = (NB + NV_MAX - 1) / NV_MAX;
    const int64_t panel_f32 = (int64_t)K * NV_MAX * L;   /* one thread's unpacked panel */
    float *xf = NULL, *wf = NULL;
    if (fma && !(xf = (float *)malloc(sizeof(float) * (size_t)(M < M_CHUNK ? M : M_CHUNK) * K))) return -2;
    if (fma && PANEL_F32 && M >= PANEL_MIN_ROWS && !(wf = (float *)malloc(sizeof(float) * (size_t)(threads * panel_f32)))) {
        free(xf);
        return -2;
    }
    for (int m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int m1 = M - m0 < M_CHUNK ? M : m0 + M_CHUNK;
        const int unpack = PANEL_F32 && fma && m1 - m0 >= PANEL_MIN_ROWS;
        #pragma omp parallel num_threads(threads)
        {
            if (fma) {   /* this chunk of x as float32, each pair swapped for the unpacked panels */
                #pragma omp for schedule(static)
                for (int r = m0; r < m1; r++)
                    row_to_f32(x + (int64_t)r * x_stride, xf + (int64_t)(r - m0) * K, K, unpack);
            }
            float *panel = unpack ? wf + omp_get_thread_num() * panel_f32 : NULL;
            #pragma omp for schedule(static)
            for (int pn = 0; pn < panels; pn++) {
                const int n0 = pn * NV_MAX * L, nv = NB - pn * NV_MAX < NV_MAX ? NB - pn * NV_MAX : NV_MAX;
                run_panel(x, x_stride, xf, K, w + (int64_t)pn * NV_MAX * KP * 2 * L, panel, bias ? bias + n0 : 0, y,
                          N, n0, nv, m0, m1, fma);
            }
        }
    }
    free(xf);
    free(wf);
    return 0;
}

#else   /* no FMA vectors: the Python side sees 0 and uses oneDNN */
int tile_linear_bf16_built(void) { return 0; }
int tile_linear_bf16_lanes(void) { return 0; }
int tile_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const float *bias, uint16_t *y,
                     int M, int N, int K, int threads, int fma) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads; (void)fma;
    return -1;
}
#endif
