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
