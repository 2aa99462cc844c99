/* y = x W^T (+ bias) for a few rows of x, weights in bfloat16: the decode step of a batch of
 * one to a few requests, where every weight is read once per token and the speed is the
 * memory's. W is nn.Linear's [N, K] row-major bf16; x [M, K] and bias [N] bf16; y [M, N] bf16.
 *
 * Each output column n is one dot product over K: the row of W is widened 16 at a time
 * (bf16 is the top half of a float32: a 16-bit shift) and multiplied into M float32
 * accumulators, so W is streamed once for all M rows. Threads split the columns. The
 * result is rounded to bf16 (round to nearest even), as torch's bf16 matmul returns it.
 */
#include <stdint.h>
#include <string.h>

#include "vec16.h"

#define MAX_ROWS 4
/* Weight rows streamed side by side (see columns), M x COLUMNS(M) accumulators in registers: 32
 * zmm registers with AVX-512; the AVX2 build's 16 lanes take two of its 16 ymm registers, so there
 * at most four accumulators (more spill). Whether side by side at all is the caller's choice
 * (gemv_cpu.side_by_side(K), by the CPU's vendor and the row length): faster on Intel Xeons, and
 * on AMD EPYC for long rows only. */
#if defined(__AVX512F__)
#define COLUMNS(M) 4
#else
#define COLUMNS(M) ((M) == 1 ? 4 : (M) == 2 ? 2 : 1)
#endif
/* Each thread streams its columns' weights in order; the hardware prefetcher alone left them
 * well below a plain read's bandwidth on Intel Xeons: asking for the line 4 KiB ahead brings
 * the one-row products close to it. */
#define PREFETCH_BYTES 4096

/* Columns n .. n + C - 1 of y for all M rows: C weight rows streamed side by side. Inlined
 * with M and C constants (see gemv_bf16), so the M x C accumulators live in registers (with M
 * a variable they spill, and one row at a time then runs at half the memory's speed:
 * measured). Each accumulator is one column's own chain in the order of i, so the bits do not
 * depend on C; C chains side by side hide the FMA's latency, which one chain per column left
 * exposed on Intel Xeons (where C = 4 beats both 1 and 8). On AMD EPYC short rows go the other
 * way: C = 1 is the fastest, one stream per column at the memory's speed, with or without the
 * prefetch, while several streams side by side get less of the bandwidth; from 4 KiB rows on,
 * one column's chain is too long to hide and C = 4 wins there too. */
static inline __attribute__((always_inline))
void columns(const v16 *xs, const uint16_t *w, const uint16_t *bias, uint16_t *y,
             const int M, const int C, int N, int K, int n) {
    const int n16 = K / 16;
    const uint16_t *rows = w + (int64_t)n * K;
    v16 acc[MAX_ROWS * 4];   /* 4: the most columns COLUMNS(M) gives */
    for (int a = 0; a < M * C; a++) acc[a] = (v16){0};
    for (int i = 0; i < n16; i++) {
        for (int c = 0; c < C; c++) {
            const uint16_t *row = rows + (int64_t)c * K;
            if ((i & 1) == 0) __builtin_prefetch((const char *)(row + 16 * i) + PREFETCH_BYTES);
            v16 wv = widen(row + 16 * i);
            for (int m = 0; m < M; m++) acc[m * C + c] += xs[m * n16 + i] * wv;
        }
    }
    for (int c = 0; c < C; c++) {
        const float b = bias ? bf16_to_f32(bias[n + c]) : 0.0f;
        for (int m = 0; m < M; m++) y[(int64_t)m * N + n + c] = f32_to_bf16(hsum(acc[m * C + c]) + b);
    }
}

/* Groups of C columns split among the threads; the last N % C one at a time. */
#define GEMV_C(M_CONST, C_CONST) {                                                       \
    const int C = C_CONST;                                                               \
    _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                \
    for (int g = 0; g < N / C; g++) columns(xs, w, bias, y, M_CONST, C, N, K, g * C);    \
    for (int n = N / C * C; n < N; n++) columns(xs, w, bias, y, M_CONST, 1, N, K, n);    \
}
#define GEMV(M_CONST) { if (side_by_side) GEMV_C(M_CONST, COLUMNS(M_CONST)) else GEMV_C(M_CONST, 1) }

/* K must be a multiple of 16 and 1 <= M <= MAX_ROWS: the wrapper checks both. side_by_side:
 * COLUMNS(M) weight rows at a time, else one. */
void gemv_bf16(const uint16_t *x, const uint16_t *w, const uint16_t *bias, uint16_t *y,
               int M, int N, int K, int num_threads, int side_by_side) {
    const int n16 = K / 16;
    v16 xs[MAX_ROWS * n16];
    for (int m = 0; m < M; m++)
        for (int i = 0; i < n16; i++) xs[m * n16 + i] = widen(x + (int64_t)m * K + 16 * i);
    switch (M) {
        case 1: GEMV(1) break;
        case 2: GEMV(2) break;
        case 3: GEMV(3) break;
        default: GEMV(4) break;
    }
}
