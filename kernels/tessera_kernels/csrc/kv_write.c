/* New K and V rows into the paged cache: token t's head h goes to row slots[t] of head h.
 *
 * k_cache[h, slots[t], :] = k[t, h, :]    (and the same for v)
 *
 * torch's index_copy_ along the cache's middle dimension costs about twice as much a layer
 * for a decode step's rows; this is one memcpy per row. k and v are views of the fused QKV
 * output: tokens k_stride elements apart, heads D apart. Element size 2 (bf16) or 4 (float32).
 * A slot of -1 (PAD_SLOT) is a padding row of a replayed step (step_graph.py): nothing is
 * written for it, as vLLM's reshape_and_cache skips the padding tokens of a CUDA graph.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PAD_SLOT (-1)

/* Returns 0, or -1 (and writes nothing) when a slot other than PAD_SLOT lies outside the
 * cache's S rows. */
int kv_write(const char *k, const char *v, int64_t k_stride, int64_t v_stride, char *k_cache, char *v_cache,
             const int64_t *slots, int T, int KV, int D, int64_t S, int elem) {
    const size_t row = (size_t)D * elem;
    for (int t = 0; t < T; t++)
        if (slots[t] != PAD_SLOT && (slots[t] < 0 || slots[t] >= S)) return -1;
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot == PAD_SLOT) continue;
        for (int h = 0; h < KV; h++) {
            const int64_t dst = ((int64_t)h * S + slot) * (int64_t)row;
            const int64_t src = ((int64_t)t * k_stride + (int64_t)h * D) * elem;
            memcpy(k_cache + dst, k + src, row);
            memcpy(v_cache + dst, v + ((int64_t)t * v_stride + (int64_t)h * D) * elem, row);
        }
    }
    return 0;
}

/* Row `src` (D values, float32 or bf16 by elem) quantized into `dst`: D int8 values, then the
 * float32 scale max|x| / 127 (symmetric, per row: a token's one KV head). q = rint(x * 127 /
 * max|x|), which rounds half to even as torch.round does, so the reference gives the same bytes.
 * An all-zero row gets scale 0 and zeros. */
static void quantize_row(const char *src, int D, int elem, int8_t *dst) {
    float x[256];   /* D <= 256 (the attention kernel's limit) */
    float amax = 0.0f;
    for (int i = 0; i < D; i++) {
        if (elem == 4) {
            memcpy(&x[i], src + 4 * i, 4);
        } else {
            uint32_t bits = (uint32_t)((const uint16_t *)src)[i] << 16;
            memcpy(&x[i], &bits, 4);
        }
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, scale = amax / 127.0f;
    for (int i = 0; i < D; i++) {
        float r = rintf(x[i] * inv);
        dst[i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    memcpy(dst + D, &scale, sizeof scale);
}

/* kv_write for an int8 cache: caches [KV, S, D + 4] bytes, each row a token's head quantized
 * (quantize_row). The same slot checks and return value as kv_write. */
int kv_write_int8(const char *k, const char *v, int64_t k_stride, int64_t v_stride, int8_t *k_cache,
                  int8_t *v_cache, const int64_t *slots, int T, int KV, int D, int64_t S, int elem) {
    const int64_t row = D + (int64_t)sizeof(float);
    if (D > 256) return -2;
    for (int t = 0; t < T; t++)
        if (slots[t] != PAD_SLOT && (slots[t] < 0 || slots[t] >= S)) return -1;
    for (int t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        if (slot == PAD_SLOT) continue;
        for (int h = 0; h < KV; h++) {
            const int64_t dst = ((int64_t)h * S + slot) * row;
            quantize_row(k + ((int64_t)t * k_stride + (int64_t)h * D) * elem, D, elem, k_cache + dst);
            quantize_row(v + ((int64_t)t * v_stride + (int64_t)h * D) * elem, D, elem, v_cache + dst);
        }
    }
    return 0;
}
