/* The float32 elementwise steps of a decoder layer, each one pass over its rows, as
 * elementwise_bf16.c is for bf16. In float32 torch's RMSNorm is a composite of ~10 ops (pow,
 * mean, add, rsqrt, two muls, each a dispatch and an allocation), and a decode step makes
 * 61 such calls. The results equal torch's up to float32 rounding:
 * the sums run in another order, exp16 is Cephes' polynomial, and products may fuse into FMAs.
 *
 * rms_norm:  y = w * (x * 1/sqrt(mean(x^2) + eps))
 * silu_mul:  y = silu(gate) * up, gate|up the two halves of each row
 * rope:      x = x * cos + swap_halves(x) * signed_sin, in place
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"


/* x, y [T, N] (row strides in elements), w [N]; N a multiple of 16. */
void rms_norm_f32(const float *x, int64_t x_stride, const float *w, float *y, int64_t y_stride,
                  int T, int N, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (int64_t)t * x_stride;
        float *yr = y + (int64_t)t * y_stride;
        v16 ss = {0};
        for (int i = 0; i < N; i += 16) {
            v16 v = load16(xr + i);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(hsum(ss) / N + eps);
        for (int i = 0; i < N; i += 16)
            store16(yr + i, load16(w + i) * (load16(xr + i) * r));
    }
}

/* gu [T, 2I] (gate then up in each row, row stride in elements), y [T, I]; I a multiple of 16. */
void silu_mul_f32(const float *gu, int64_t gu_stride, float *y, int T, int I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * gu_stride, *u = g + I;
        float *yr = y + (int64_t)t * I;
        for (int i = 0; i < I; i += 16)
            store16(yr + i, silu16(load16(g + i)) * load16(u + i));
    }
}

/* x [T, heads, D] with row stride x_stride (elements between tokens; heads contiguous),
 * cos and signed_sin [T, D]; D a multiple of 32 (two halves of whole vectors). */
void rope_f32(float *x, int64_t x_stride, const float *cos, const float *sin,
              int T, int heads, int D, int num_threads) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int h = 0; h < heads; h++) {
            float *xr = x + (int64_t)t * x_stride + (int64_t)h * D;
            for (int i = 0; i < half; i += 16) {
                v16 lo = load16(xr + i), hi = load16(xr + half + i);
                store16(xr + i, lo * load16(c + i) + hi * load16(s + i));
                store16(xr + half + i, hi * load16(c + half + i) + lo * load16(s + half + i));
            }
        }
    }
}

/* y = a + b over n values (n a multiple of 16): the residual connections, a C call so that a
 * replayed decode step (replay.py) makes them too. */
void add_f32(const float *a, const float *b, float *y, int64_t n, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 65536)
    for (int64_t i = 0; i < n; i += 16)
        store16(y + i, load16(a + i) + load16(b + i));
}
