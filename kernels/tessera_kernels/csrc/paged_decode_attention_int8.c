/* Paged attention over an int8 KV cache (--kv-cache-dtype int8): the rows of
 * paged_decode_attention.c (a decode token, a prompt token whose context ends at itself, a
 * draft tree's node through one-slot blocks) read K and V as int8 with one float32 scale per
 * (slot, KV head), dequantized in registers; q and out float32 or bfloat16, arithmetic float32.
 *
 * Cache row layout ([KV, S, D + 4] bytes): D int8 values, then the row's scale (max|x| / 127,
 * csrc/kv_write.c), so a slot's scale moves with its values wherever a row is copied.
 *
 * out[b, h] = sum_t softmax_t(scale * sk_t * (q[b, h] . k8_t)) sv_t v8_t
 * Per token the K row is widened once (16 int8 -> 16 float32 lanes) for all G query heads of
 * its KV head, and the row's scale is applied to the score, not to the row; in the V pass the
 * probability times the row's scale weights the widened row. Scores are made 16 tokens at a
 * time, each token's dot product left as 16 partials summed by one transposing tree
 * (sum16x16), as in the 16-bit kernel. A task is one (row, KV head) pair, claimed dynamically.
 * Prompt rows go one at a time (no tiles): a prompt's attention is slower than the 16-bit
 * kernel's tiles, decode (the memory-bound case, half the bytes here) faster. A sliding window
 * and soft-capping are computed as in the 16-bit kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#define AHEAD 16      /* tokens ahead whose K and V rows are asked for (rows scattered over blocks) */
#define MAX_G 64

static inline int64_t slot_of(const int64_t *table, int64_t t, int block_size) {
    const int shift = __builtin_ctz((unsigned)block_size);
    return (table[t >> shift] << shift) | (t & (block_size - 1));
}

static inline void prefetch_row(const int8_t *p, int64_t row) {
    for (int64_t off = 0; off < row; off += 64) __builtin_prefetch(p + off);
}

/* The same into L2 only: rows read a pass later (a V row in the K pass, the next task's K rows
 * in the V pass) would push the K pass's working set out of L1. */
static inline void prefetch_row_l2(const int8_t *p, int64_t row) {
    for (int64_t off = 0; off < row; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* Where the thread's next task reads its K rows (len 0: none): asked for during this task's V
 * pass, so that memory stays busy while the V pass computes. */
typedef struct {
    const int8_t *k_head;
    const int64_t *table;
    int64_t lo, len;
} next_task;

static inline float row_scale(const int8_t *r, int D) {
    float s;
    memcpy(&s, r + D, sizeof s);
    return s;
}

/* softcap * tanh(s / softcap), as paged_decode_attention.c's softcap16. */
static inline v16 softcap16(v16 s, float softcap) {
    v16 x2 = s * (2.0f / softcap);
    x2 = (v16){0} - vmax((v16){0} - x2, (v16){0} - 18.0f);
    return softcap * (1.0f - 2.0f / (exp16(x2) + 1.0f));
}

/* One task: query heads qv [G][D/16] (float32) over tokens lo..L-1 of one KV head's rows;
 * acc [G][D/16] gets the attention output. scores: G * Lp floats. */
static inline __attribute__((always_inline)) void attend8(const v16 *qv, const int8_t *kh, const int8_t *vh,
        const int64_t *table, int64_t lo, int64_t L, int G, int D, int block_size, float scale, float softcap,
        v16 *acc, v16 *part, float *scores, int64_t Lp, next_task next) {
    const int n = D / 16;
    const int64_t row = D + 4, Lw = L - lo;
    v16 maxv[MAX_G];
    for (int g = 0; g < G; g++) maxv[g] = (v16){0} - INFINITY;
    for (int64_t i0 = 0; i0 < Lw; i0 += 16) {
        const int m = Lw - i0 < 16 ? (int)(Lw - i0) : 16;
        float ks[16] = {0};   /* the tokens' scales times `scale` */
        for (int j = 0; j < 16; j++) {
            if (j >= m) {
                for (int g = 0; g < G; g++) part[g * 16 + BITREV4[j]] = (v16){0};
                continue;
            }
            const int64_t t = lo + i0 + j;
            if (t + AHEAD < L) {
                const int64_t ahead = slot_of(table, t + AHEAD, block_size) * row;
                prefetch_row(kh + ahead, row);
                prefetch_row_l2(vh + ahead, row);
            }
            const int8_t *k = kh + slot_of(table, t, block_size) * row;
            v16 kr[16];   /* D <= 256 */
            for (int i = 0; i < n; i++) kr[i] = to_float16(widen_s8(k + 16 * i));
            ks[j] = row_scale(k, D) * scale;
            for (int g = 0; g < G; g++) {
                v16 a = qv[g * n] * kr[0];
                for (int i = 1; i < n; i++) a += qv[g * n + i] * kr[i];
                part[g * 16 + BITREV4[j]] = a;
            }
        }
        for (int g = 0; g < G; g++) {
            v16 s = sum16x16(part + g * 16) * load16(ks);
            if (softcap > 0) s = softcap16(s, softcap);
            for (int j = m; j < 16; j++) s[j] = -INFINITY;
            store16(scores + g * Lp + i0, s);
            maxv[g] = vmax(maxv[g], s);
        }
    }
    float sums[MAX_G];
    for (int g = 0; g < G; g++) {
        const float mx = hmax(maxv[g]);
        v16 sv = (v16){0};
        for (int64_t i0 = 0; i0 < Lw; i0 += 16) {
            v16 p = exp16(load16(scores + g * Lp + i0) - mx);
            for (int j = Lw - i0 < 16 ? (int)(Lw - i0) : 16; j < 16; j++) p[j] = 0.0f;
            store16(scores + g * Lp + i0, p);
            sv += p;
        }
        sums[g] = hsum(sv);
    }
    v16 a[1024];   /* G * D / 16 <= 1024 (the Python side checks) */
    for (int k = 0; k < G * n; k++) a[k] = (v16){0};
    int64_t asked = 0, credit = 0;   /* next.len rows over Lw tokens: a running count, no division */
    for (int64_t i = 0; i < Lw; i++) {
        for (credit += next.len; credit >= Lw && asked < next.len; credit -= Lw)
            prefetch_row_l2(next.k_head + slot_of(next.table, next.lo + asked++, block_size) * row, row);
        const int8_t *v = vh + slot_of(table, lo + i, block_size) * row;
        const float sv = row_scale(v, D);
        v16 vr[16];
        for (int c = 0; c < n; c++) vr[c] = to_float16(widen_s8(v + 16 * c));
        for (int g = 0; g < G; g++) {
            const float p = scores[g * Lp + i] * sv;
            for (int c = 0; c < n; c++) a[g * n + c] += p * vr[c];
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < n; c++) acc[g * n + c] = a[g * n + c] / sums[g];
}

/* The task with G and D as constants for the shapes models use, else as variables (as the
 * 16-bit kernel's attend_any: the accumulators then stay in registers). */
static void attend8_any(const v16 *qv, const int8_t *kh, const int8_t *vh, const int64_t *table, int64_t lo,
                        int64_t L, int G, int D, int block_size, float scale, float softcap, v16 *acc, v16 *part,
                        float *scores, int64_t Lp, next_task next) {
#define TASK(GG, DD) if (G == GG && D == DD) \
        return attend8(qv, kh, vh, table, lo, L, GG, DD, block_size, scale, softcap, acc, part, scores, Lp, next)
    TASK(1, 64); TASK(2, 64); TASK(3, 64); TASK(4, 64); TASK(5, 64); TASK(6, 64); TASK(7, 64); TASK(8, 64);
    TASK(1, 128); TASK(2, 128); TASK(3, 128); TASK(4, 128); TASK(5, 128); TASK(6, 128); TASK(7, 128); TASK(8, 128);
#undef TASK
    attend8(qv, kh, vh, table, lo, L, G, D, block_size, scale, softcap, acc, part, scores, Lp, next);
}

/* q [B rows, q_stride apart][H][D] and out [B][H][D] in float32 (bf16 = 0) or bfloat16 (bf16 =
 * 1); caches [KV][S][D + 4] bytes (above); block_tables [B][W]; context_lens [B]. window > 0:
 * a row sees its last `window` tokens; softcap > 0: scores soft-capped. */
void paged_decode_attention_int8(const void *q, const int8_t *k_cache, const int8_t *v_cache,
                                 const int64_t *block_tables, const int64_t *context_lens, void *out, int B, int H,
                                 int KV, int D, int W, int block_size, int64_t S, float scale, int num_threads,
                                 int bf16, int64_t q_stride, int window, float softcap) {
    const int G = H / KV, n = D / 16;
    const int64_t row = D + 4;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    const int64_t Lp = (max_len + 15) / 16 * 16;
    const int tasks = B * KV;
    int claimed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        v16 *qv = (v16 *)aligned_alloc(64, sizeof(v16) * (2 * G * n + 16 * G) + (sizeof(float) * G * Lp + 63) / 64 * 64);
        v16 *acc = qv + G * n, *part = acc + G * n;
        float *scores = (float *)(part + 16 * G);
        /* each thread holds the claim on its next task while it runs this one, to ask for its rows */
        int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (task < tasks) {
            const int after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            next_task next = {NULL, NULL, 0, 0};
            if (after < tasks) {
                const int64_t nl = context_lens[after / KV], nlo = window > 0 && nl > window ? nl - window : 0;
                next = (next_task){k_cache + (int64_t)(after % KV) * S * row, block_tables + (int64_t)(after / KV) * W,
                                   nlo, nl - nlo};
            }
            const int b = task / KV, kv = task % KV;
            const int64_t L = context_lens[b], lo = window > 0 && L > window ? L - window : 0;
            const int64_t head0 = (int64_t)b * H + (int64_t)kv * G;
            for (int g = 0; g < G; g++) {
                const int64_t off = (int64_t)b * q_stride + (int64_t)(kv * G + g) * D;
                for (int i = 0; i < n; i++)
                    qv[g * n + i] = bf16 ? widen((const uint16_t *)q + off + 16 * i) : load16((const float *)q + off + 16 * i);
            }
            attend8_any(qv, k_cache + (int64_t)kv * S * row, v_cache + (int64_t)kv * S * row,
                        block_tables + (int64_t)b * W, lo, L, G, D, block_size, scale, softcap, acc, part, scores, Lp,
                        next);
            for (int g = 0; g < G; g++) {
                const float *a = (const float *)(acc + g * n);
                if (bf16) {
                    uint16_t *o = (uint16_t *)out + (head0 + g) * D;
                    for (int i = 0; i < D; i++) o[i] = f32_to_bf16(a[i]);
                } else {
                    memcpy((float *)out + (head0 + g) * D, a, sizeof(float) * D);
                }
            }
            task = after;
        }
        free(qv);
    }
}
