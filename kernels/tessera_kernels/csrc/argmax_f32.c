/* The index of each row's largest float32 value (the first one among equals; the first NaN if
 * the row has one, as torch.argmax): greedy sampling over the vocabulary. torch's argmax along
 * the last dimension takes several times as long as reading the logits once (64 rows of
 * SmolLM2's 49152 logits: a visible share of a decode step).
 *
 * Each row in one vectorized pass: every lane keeps its largest value and where it first saw
 * it (only a strictly larger value moves it), so the smallest index among the lanes holding
 * the row's maximum is the first maximum. A NaN anywhere (never larger than anything) sends
 * the row to a plain scan for the first NaN. */
#include <stdint.h>

#include "vec16.h"

static int64_t argmax_row(const float *x, int64_t V) {
    v16 m = (v16){0} - __builtin_inff();
    v16i at = {0}, nan = {0}, i16 = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    int64_t i = 0;
    for (; i + 16 <= V && i + 16 <= INT32_MAX; i += 16, i16 += 16) {
        v16 v = load16(x + i);
        v16i gt = v > m;
        nan |= v != v;
        m = select16(gt, v, m);
        at = (gt & i16) | (~gt & at);
    }
    int any_nan = 0;
    for (int j = 0; j < 16; j++) any_nan |= nan[j] != 0;
    float best = hmax(m);
    int64_t best_at = V;
    for (int j = 0; j < 16; j++)
        if (m[j] == best && at[j] < best_at) best_at = at[j];
    for (; i < V; i++) {
        any_nan |= x[i] != x[i];
        if (x[i] > best) best = x[i], best_at = i;
    }
    if (any_nan)
        for (int64_t j = 0; j < V; j++)
            if (x[j] != x[j]) return j;
    return best_at < V ? best_at : 0;   /* a row of -inf only: torch answers 0 too */
}

/* x [B, V] float32, rows `row_stride` floats apart; out [B] int64. */
void argmax_rows_f32(const float *x, int64_t row_stride, int64_t *out, int B, int64_t V, int num_threads) {
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (B > 1)
    for (int b = 0; b < B; b++) out[b] = argmax_row(x + (int64_t)b * row_stride, V);
}
