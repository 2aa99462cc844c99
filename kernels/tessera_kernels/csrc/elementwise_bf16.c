/* The bf16 elementwise steps of a decoder layer, each one pass over its rows instead of the
 * four or five torch ops (each a dispatch, an allocation and a sweep) the same math takes.
 * Every intermediate is rounded to bf16 where the torch reference rounds it, so the results
 * are torch's up to the last bit of a float32 sum or exponential before a rounding (and a
 * gate between -88.7 and -87.3, where e^gate is below what exp16 returns, gives silu
 * ~1e-36 where torch gives ~1e-37).
 *
 * rms_norm:  y = bf16(w * bf16(x * 1/sqrt(mean(x^2) + eps)))          (HF's Llama RMSNorm)
 * silu_mul:  y = bf16(bf16(silu(gate)) * up), gate|up the two halves of each row
 * rope:      x = bf16(bf16(x * cos) + bf16(swap_halves(x) * signed_sin)), in place
 * Rows are split over threads; a row is at most a few thousand values.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec16.h"

static inline v16 round_bf16(v16 f) {    /* to the nearest bf16 (even on ties), kept as float32 */
    const v16u u = as_uint(f);
    return uint_as_float((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

static inline void store_bf16(uint16_t *p, v16 f) {   /* f already rounded: its top halves */
    v16h h = narrow16(as_uint(f) >> 16);
    memcpy(p, &h, sizeof h);
}

/* x, y [T, N] (row strides in elements), w [N]; N a multiple of 16. */
void rms_norm_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *y, int64_t y_stride,
                   int T, int N, float eps, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const uint16_t *xr = x + (int64_t)t * x_stride;
        uint16_t *yr = y + (int64_t)t * y_stride;
        v16 ss = {0};
        for (int i = 0; i < N; i += 16) {
            v16 v = widen(xr + i);
            ss += v * v;
        }
        const float r = 1.0f / sqrtf(hsum(ss) / N + eps);
        for (int i = 0; i < N; i += 16)
            store_bf16(yr + i, round_bf16(widen(w + i) * round_bf16(widen(xr + i) * r)));
    }
}

/* gu [T, 2I] (gate then up in each row, row stride in elements), y [T, I]; I a multiple of 16. */
void silu_mul_bf16(const uint16_t *gu, int64_t gu_stride, uint16_t *y, int T, int I, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const uint16_t *g = gu + (int64_t)t * gu_stride, *u = g + I;
        uint16_t *yr = y + (int64_t)t * I;
        for (int i = 0; i < I; i += 16) {
            v16 gv = widen(g + i);
            store_bf16(yr + i, round_bf16(round_bf16(silu16(gv)) * widen(u + i)));
        }
    }
}

/* x [T, heads, D] with row stride x_stride (elements between tokens; heads contiguous),
 * cos and signed_sin [T, D] bf16; D a multiple of 32 (two halves of whole vectors). */
void rope_bf16(uint16_t *x, int64_t x_stride, const uint16_t *cos, const uint16_t *sin,
               int T, int heads, int D, int num_threads) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (T > 1)
    for (int t = 0; t < T; t++) {
        const uint16_t *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int h = 0; h < heads; h++) {
            uint16_t *xr = x + (int64_t)t * x_stride + (int64_t)h * D;
            for (int i = 0; i < half; i += 16) {
                v16 lo = widen(xr + i), hi = widen(xr + half + i);
                v16 new_lo = round_bf16(round_bf16(lo * widen(c + i)) + round_bf16(hi * widen(s + i)));
                v16 new_hi = round_bf16(round_bf16(hi * widen(c + half + i)) + round_bf16(lo * widen(s + half + i)));
                store_bf16(xr + i, new_lo);
                store_bf16(xr + half + i, new_hi);
            }
        }
    }
}

/* y = bf16(a + b) over n values (n a multiple of 16), as torch adds two bf16 tensors: the
 * residual connections, a C call so that a replayed decode step (replay.py) makes them too. */
void add_bf16(const uint16_t *a, const uint16_t *b, uint16_t *y, int64_t n, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (n >= 65536)
    for (int64_t i = 0; i < n; i += 16)
        store_bf16(y + i, round_bf16(widen(a + i) + widen(b + i)));
}
