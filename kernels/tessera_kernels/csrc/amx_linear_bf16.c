/* bf16 linear on AMX tiles for decode batches and prompt chunks: y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]),
 * float32 accumulation, one rounding to bf16.
 *
 * A decode step at batch 64 reads every weight once and does 128 flops per weight element:
 * for AMX that is memory-bound, and oneDNN's AMX matmul streams the weights at about half the
 * bandwidth a plain read gets. This kernel reads W in the
 * order it is stored, prefetching a few tiles ahead, and uses each weight tile for two
 * 16-row blocks of x while it is in L1 (rows 32-63 find it again in L2).
 *
 * W is packed once (amx_linear.py): for each block of 32 output columns and each step of 32
 * inputs, two B tiles of 16 rows x 64 bytes, tile t's row r holding the pairs
 * (W[n, k0 + 2r], W[n, k0 + 2r + 1]) for n = n0 + 16t .. n0 + 16t + 15 (AMX's VNNI layout):
 *   packed[((nb * KB + kb) * 2 + t) * 512 + r * 32 + 2 * j + p] = W[32 nb + 16 t + j][32 kb + 2 r + p]
 * Tiles: 0-3 accumulators, 4-5 16-row blocks of x, 6-7 W: each W tile step feeds 2 x 2
 * accumulators, 32 rows (wide); each further 32 rows take another pass over W from L2 (see below).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PREFETCH_STEPS 8   /* k-steps (2 KiB of W each) ahead */
#define GROUP_BYTES (512 * 1024)   /* W read by one group of column blocks (see amx_linear_bf16) */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tile_config;

/* Linux hands out AMX state only to a process that asks for it; 0 when granted. */
int amx_linear_init(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

static void configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } c = { .u = (uint32_t)v << 16 };
    return c.f;
}

/* Rows of 32 float accumulators (+ bias) as bf16 into y, `rows` of them. */
static void store_block(const float *acc, const uint16_t *bias, uint16_t *y, int64_t y_stride, int rows) {
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        float tmp[32];
        for (int j = 0; j < 32; j++) tmp[j] = bf16_to_float(bias[j]);
        b0 = _mm512_loadu_ps(tmp);
        b1 = _mm512_loadu_ps(tmp + 16);
    }
    for (int i = 0; i < rows; i++) {
        __m512 lo = _mm512_add_ps(_mm512_load_ps(acc + i * 32), b0);
        __m512 hi = _mm512_add_ps(_mm512_load_ps(acc + i * 32 + 16), b1);
        __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512((void *)(y + i * y_stride), (__m512i)packed);
    }
}

static inline void prefetch_step(const uint16_t *wk) {   /* the 2 KiB of W PREFETCH_STEPS k-steps ahead */
    const char *ahead = (const char *)(wk + PREFETCH_STEPS * 1024);
    for (int line = 0; line < 2048; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
}

static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* Up to 32 rows (two 16-row blocks) x 32 columns: each W tile serves both row blocks. */
static void wide(const uint16_t *const *xb, int64_t xs, int blocks, const uint16_t *wb, int KB, float *acc) {
    zero_accumulators();
    for (int kb = 0; kb < KB; kb++) {
        const uint16_t *wk = wb + (int64_t)kb * 1024;
        prefetch_step(wk);
        _tile_stream_loadd(6, wk, 64);
        _tile_stream_loadd(7, wk + 512, 64);
        _tile_loadd(4, xb[0] + kb * 32, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (blocks > 1) {
            _tile_loadd(5, xb[1] + kb * 32, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc, 128);
    _tile_stored(1, acc + 16, 128);
    _tile_stored(2, acc + 16 * 32, 128);
    _tile_stored(3, acc + 16 * 32 + 16, 128);
}

/* Row block b of x: 16 rows from row 16 b, the last one (`last`) perhaps a zero-padded copy. */
static inline const uint16_t *row_block(const uint16_t *x, int64_t x_stride, const uint16_t *last, int b, int blocks) {
    return b == blocks - 1 ? last : x + (int64_t)b * 16 * x_stride;
}

/* x: [M, K] bf16, rows x_stride elements apart, M >= 1; w: packed as above; bias [N] bf16 or
 * NULL; y: [M, N] bf16 contiguous. N and K multiples of 32, x_stride >= K. Returns 0, or -1
 * for an M or stride out of range or no memory. */
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int M, int N, int K, int threads) {
    if (M < 1 || x_stride < K) return -1;
    const int KB = K / 32, NB = N / 32, blocks = (M + 15) / 16, tail = M % 16;
    /* Row block b of x is 16 rows x_stride apart; a last block of fewer rows comes from a
     * zero-padded copy (its extra rows are computed and dropped). */
    const uint16_t *last = x + (int64_t)(blocks - 1) * 16 * x_stride;
    uint16_t *pad = NULL;
    if (tail) {
        const size_t bytes = ((size_t)16 * x_stride * sizeof(uint16_t) + 127) / 64 * 64;   /* a multiple of 64 */
        pad = aligned_alloc(64, bytes);
        if (!pad) return -1;
        memset(pad, 0, (size_t)16 * x_stride * sizeof(uint16_t));
        memcpy(pad, last, ((size_t)(tail - 1) * x_stride + K) * sizeof(uint16_t));
        last = pad;
    }
    const int64_t xs = x_stride * (int64_t)sizeof(uint16_t);
    /* Each thread takes a contiguous share of the 32-column blocks, in groups of about
     * GROUP_BYTES of W: rows 0-31 over the group's blocks stream W from memory, each later
     * 32 rows then find it in L2 (and their x in L1, where it fits: K up to ~700). One W tile
     * feeding four row blocks at once instead reads x twice as often from L2, and is slower.
     * W's tiles are loaded with the streaming hint and prefetched into L2 only: W is used
     * again from L2 (by the next 32 rows), x from L1, and a W tile kept in L1 pushes x out. */
    const int group = KB == 0 || KB * 2048 >= GROUP_BYTES ? 1 : GROUP_BYTES / (KB * 2048);
    #pragma omp parallel num_threads(threads)
    {
        float acc[32 * 32] __attribute__((aligned(64)));
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int first = (int)((int64_t)NB * tid / nt), end = (int)((int64_t)NB * (tid + 1) / nt);
        configure();
        for (int g0 = first; g0 < end; g0 += group) {
            const int g1 = g0 + group < end ? g0 + group : end;
            for (int b = 0; b < blocks; b += 2) {
                const int pair = blocks - b < 2 ? 1 : 2, rows = M - 16 * b < 32 ? M - 16 * b : 32;
                const uint16_t *xb[2] = { row_block(x, x_stride, last, b, blocks),
                                          pair == 2 ? row_block(x, x_stride, last, b + 1, blocks) : x /* unread */ };
                for (int nb = g0; nb < g1; nb++) {
                    wide(xb, xs, pair, w + (int64_t)nb * KB * 1024, KB, acc);
                    store_block(acc, bias ? bias + nb * 32 : NULL, y + (int64_t)16 * b * N + nb * 32, N, rows);
                }
            }
        }
        _tile_release();
    }
    free(pad);
    return 0;
}

#else   /* built without AMX: the Python side sees -1 and uses oneDNN */
int amx_linear_init(void) { return -1; }
int amx_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                    int M, int N, int K, int threads) {
    (void)x; (void)x_stride; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
    return -1;
}
#endif
