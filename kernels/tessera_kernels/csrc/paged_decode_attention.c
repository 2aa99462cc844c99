/* Paged decode attention on the CPU, float32: one query token per request.
 *
 * out[b, h] = sum_t softmax_t(scale * q[b, h] . K[g(h), slot(b, t)]) V[g(h), slot(b, t)]
 * where g(h) = h / (H / KV) is the KV head a query head shares (GQA) and
 * slot(b, t) = block_tables[b, t / block_size] * block_size + t % block_size.
 *
 * Each (request, KV head) pair is one task: its K and V rows are read once, straight from
 * the paged cache, for all the query heads that share them; nothing is gathered or copied.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Eight independent partial sums so the compiler can keep them in one SIMD register
 * (a single running sum would force strict left-to-right order and stay scalar). */
static inline float dot(const float *a, const float *b, int n) {
    float acc[8] = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < 8; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int64_t *block_tables, const int64_t *context_lens,
                                float *out, int B, int H, int KV, int D, int W, int block_size,
                                int64_t S, float scale, int num_threads) {
    const int G = H / KV;
    #pragma omp parallel for collapse(2) schedule(dynamic) num_threads(num_threads)
    for (int b = 0; b < B; b++) {
        for (int kv = 0; kv < KV; kv++) {
            const int64_t L = context_lens[b];
            float *scores = (float *)malloc(sizeof(float) * (size_t)(G * L));
            const float *qb = q + ((int64_t)b * H + (int64_t)kv * G) * D;
            const float *kh = k_cache + (int64_t)kv * S * D;
            const float *vh = v_cache + (int64_t)kv * S * D;
            float maxs[64], sums[64];
            for (int g = 0; g < G; g++) maxs[g] = -INFINITY, sums[g] = 0.0f;
            for (int64_t t = 0; t < L; t++) {
                int64_t slot = block_tables[(int64_t)b * W + t / block_size] * block_size + t % block_size;
                const float *krow = kh + slot * D;
                for (int g = 0; g < G; g++) {
                    float s = dot(qb + g * D, krow, D) * scale;
                    scores[g * L + t] = s;
                    if (s > maxs[g]) maxs[g] = s;
                }
            }
            float *ob = out + ((int64_t)b * H + (int64_t)kv * G) * D;
            memset(ob, 0, sizeof(float) * G * D);
            for (int g = 0; g < G; g++)
                for (int64_t t = 0; t < L; t++) {
                    float p = expf(scores[g * L + t] - maxs[g]);
                    scores[g * L + t] = p;
                    sums[g] += p;
                }
            for (int64_t t = 0; t < L; t++) {
                int64_t slot = block_tables[(int64_t)b * W + t / block_size] * block_size + t % block_size;
                const float *vrow = vh + slot * D;
                for (int g = 0; g < G; g++) {
                    float p = scores[g * L + t];
                    float *o = ob + g * D;
                    for (int d = 0; d < D; d++) o[d] += p * vrow[d];
                }
            }
            for (int g = 0; g < G; g++)
                for (int d = 0; d < D; d++) ob[g * D + d] /= sums[g];
            free(scores);
        }
    }
}
