/* Paged decode attention on the CPU: one query token per request, K/V cache in float32 or
 * bfloat16, arithmetic in float32.
 *
 * out[b, h] = sum_t softmax_t(scale * q[b, h] . K[g(h), slot(b, t)]) V[g(h), slot(b, t)]
 * where g(h) = h / (H / KV) is the KV head a query head shares (GQA) and
 * slot(b, t) = block_tables[b, t / block_size] * block_size + t % block_size.
 *
 * Each (request, KV head) pair is one task: its K and V rows are read once, straight from
 * the paged cache, for all the query heads that share them; nothing is gathered or copied.
 * A bfloat16 row is widened into a small float32 buffer first: bf16 is the top half of a
 * float32, so widening is a 16-bit shift, which the compiler vectorizes (AVX2 or AVX-512);
 * the dot products and the softmax then run on the same float32 code for both dtypes.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256   /* and head_dim % 16 == 0: the wrapper checks both */

/* Sixteen float32 lanes: one AVX-512 register, or two AVX2 ones (the compiler splits it). */
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

/* Row `slot` of a [S, D] cache head as float32, in buf (D a multiple of 16): copied for
 * float32, widened for bf16 (bf16 is the top half of a float32: a 16-bit shift). */
static inline void load_row(const void *head, int64_t slot, int D, int bf16, v16 *buf) {
    if (!bf16) {
        memcpy(buf, (const float *)head + slot * D, sizeof(float) * D);
        return;
    }
    const uint16_t *src = (const uint16_t *)head + slot * D;
    for (int i = 0; i < D / 16; i++) {
        v16h h;
        memcpy(&h, src + 16 * i, sizeof h);
        v16u w = __builtin_convertvector(h, v16u) << 16;
        memcpy(&buf[i], &w, sizeof w);
    }
}

typedef int32_t v16i __attribute__((vector_size(64)));

/* Sum of the 16 lanes as a tree of shuffles (4 steps): a plain loop over the lanes is a chain
 * of 16 dependent additions (the compiler may not reorder float sums), 4x slower here. */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (v16i){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (v16i){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (v16i){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (v16i){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return a[0];
}

/* block_size is a power of two (CacheConfig checks): a shift and a mask, not a division,
 * which would cost as much as the dot products of a row. */
static inline int64_t slot_of(const int64_t *table, int64_t t, int block_size) {
    const int shift = __builtin_ctz((unsigned)block_size);
    return (table[t >> shift] << shift) | (t & (block_size - 1));
}

/* The rows of a context sit in blocks scattered over a cache far larger than the CPU's, and
 * a row's dot products take long enough that the core does not run ahead to the next loads by
 * itself: ask for the row AHEAD tokens on now (measured: the kernel waited on these loads). */
#define AHEAD 8
static inline void prefetch_row(const void *head, int64_t slot, size_t row_bytes) {
    const char *p = (const char *)head + slot * (int64_t)row_bytes;
    for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
}

/* q, out: float32 [B, H, D]; caches [KV, S, D] of float32 (bf16 = 0) or bfloat16 (bf16 = 1). */
void paged_decode_attention(const float *q, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens,
                            float *out, int B, int H, int KV, int D, int W, int block_size,
                            int64_t S, float scale, int num_threads, int bf16) {
    const int G = H / KV;
    const size_t elem = bf16 ? 2 : 4;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < B; b++) {
        for (int kv = 0; kv < KV; kv++) {
            const int64_t L = context_lens[b];
            const int n = D / 16;
            const size_t score_bytes = (sizeof(float) * (size_t)(G * L) + 63) / 64 * 64;
            v16 *qv = (v16 *)aligned_alloc(64, 2 * sizeof(v16) * G * n + score_bytes);
            v16 *acc = qv + G * n, row[MAX_HEAD_DIM / 16];
            float *scores = (float *)(acc + G * n);
            memcpy(qv, q + ((int64_t)b * H + (int64_t)kv * G) * D, sizeof(float) * G * D);
            const char *kh = (const char *)k_cache + (int64_t)kv * S * D * elem;
            const char *vh = (const char *)v_cache + (int64_t)kv * S * D * elem;
            float maxs[64], sums[64];
            for (int g = 0; g < G; g++) maxs[g] = -INFINITY, sums[g] = 0.0f;
            const int64_t *table = block_tables + (int64_t)b * W;
            for (int64_t t = 0; t < L; t++) {
                if (t + AHEAD < L) prefetch_row(kh, slot_of(table, t + AHEAD, block_size), D * elem);
                load_row(kh, slot_of(table, t, block_size), D, bf16, row);
                for (int g = 0; g < G; g++) {
                    v16 a = qv[g * n] * row[0];
                    for (int i = 1; i < n; i++) a += qv[g * n + i] * row[i];
                    float s = hsum(a) * scale;
                    scores[g * L + t] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            for (int g = 0; g < G; g++)
                for (int64_t t = 0; t < L; t++) {
                    float p = expf(scores[g * L + t] - maxs[g]);
                    scores[g * L + t] = p;
                    sums[g] += p;
                }
            memset(acc, 0, sizeof(float) * G * D);
            for (int64_t t = 0; t < L; t++) {
                if (t + AHEAD < L) prefetch_row(vh, slot_of(table, t + AHEAD, block_size), D * elem);
                load_row(vh, slot_of(table, t, block_size), D, bf16, row);
                for (int g = 0; g < G; g++) {
                    float p = scores[g * L + t];
                    for (int i = 0; i < n; i++) acc[g * n + i] += p * row[i];
                }
            }
            float *ob = out + ((int64_t)b * H + (int64_t)kv * G) * D;
            for (int g = 0; g < G; g++)
                for (int i = 0; i < n; i++) {
                    v16 o = acc[g * n + i] / sums[g];
                    memcpy(ob + g * D + 16 * i, &o, sizeof o);
                }
            free(qv);
        }
    }
}
