/* Paged decode attention on the CPU: one query token per request, K/V cache in float32 or
 * bfloat16, arithmetic in float32 (with a bf16 cache on AVX512-BF16 the probabilities are
 * rounded to bf16 for the V pass, as torch's SDPA does).
 *
 * out[b, h] = sum_t softmax_t(scale * q[b, h] . K[g(h), slot(b, t)]) V[g(h), slot(b, t)]
 * where g(h) = h / (H / KV) is the KV head a query head shares (GQA) and
 * slot(b, t) = block_tables[b, t / block_size] * block_size + t % block_size.
 *
 * Each (request, KV head) pair is one task (or, for a prompt chunk's rows, each tile of them:
 * below): its K and V rows are read once, straight from the paged cache, for all the query
 * heads that share them; nothing is gathered or copied.
 * q and out are in the cache's dtype. Scores are made 16 tokens at a time: each token's dot
 * product is left as 16 partial sums, and the 16 tokens' partials are summed together by one
 * transposing tree of shuffles (15 steps for 16 scores, where a sum per token takes 64).
 * The softmax's exponentials are 16 at a time too (vec16.h). A task runs with its group size
 * and head size as constants (attend_any), so its accumulators stay in registers. Together
 * these halve a decode step's attention against one score at a time, a scalar exp and runtime
 * shapes.
 *
 * Memory is kept busy through both passes of a task: the K pass asks for the V rows its V pass
 * reads, and the V pass asks for the K rows of the thread's next task (claimed one ahead), both
 * into L2. Otherwise the V pass and the softmax leave memory idle, and a task's K pass waits
 * on its reads; with the prefetches a step comes close to the time of touching the same bytes
 * and nothing else.
 *
 * The rows of a prompt chunk (each token a query whose context ends at itself) go 16 at a
 * time through attend_tile (bf16 dot products) or attend_tile_f32 (FMAs: a float32 cache, or
 * bf16 without AVX512-BF16), with the rows as the lanes: each K and V row read serves 16
 * queries, which makes a prompt's attention about twice as fast as row by row. A tile sums a
 * score's products in another order than a single row, so a prompt row's last bits depend on
 * whether its chunk put it in a tile (as torch's kernels' bits depend on the batch's shape).
 *
 * A sliding window (window > 0) makes a row of context L attend to its last `window` tokens
 * only, L - window .. L - 1: a row's loops start there (the blocks before are never read, a
 * partly covered block is read from that token on), so a row without one runs as before. Soft-
 * capping (softcap > 0, Gemma 2) turns each scaled score s into softcap * tanh(s / softcap) in
 * the softmax pass, chosen once per head. Either one sends a prompt chunk's rows one at a time
 * (the tiles take neither yet).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec16.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
/* AVX512-BF16: a bf16 query row times a bf16 key row, 32 products per instruction summed in
 * pairs into float32 lanes (the products are exact in float32), no widening. */
static inline v16 dot_bf16(const uint16_t *q, const uint16_t *k, int D) {
    __m512 a = _mm512_setzero_ps();
    for (int i = 0; i < D; i += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(q + i), (__m512bh)_mm512_loadu_si512(k + i));
    v16 r;
    memcpy(&r, &a, sizeof r);
    return r;
}
#define HAVE_DOT_BF16 1
#else
#define HAVE_DOT_BF16 0
#endif

/* The rows of a context sit in blocks scattered over a cache far larger than the CPU's, and
 * the core does not run far enough ahead to the next loads by itself: ask for the K and V
 * rows AHEAD tokens on now (measured: the kernel waited on these loads). */
#define AHEAD 16
#define MAX_ACC 1024   /* G * D / 16: at most 64 query heads of 256 */
#define TILE 16        /* rows of a prompt chunk attended together (attend_tile) */
#define TILE_MIN 4     /* a shorter run of a chunk's rows goes row by row */
#define RB_MAX 8       /* rows of a tile whose V sums are made together (attend_tile): 16 / (D/16) */

/* block_size is a power of two (CacheConfig checks): a shift and a mask, not a division,
 * which would cost as much as the dot products of a row. */
static inline int64_t slot_of(const int64_t *table, int64_t t, int block_size) {
    const int shift = __builtin_ctz((unsigned)block_size);
    return (table[t >> shift] << shift) | (t & (block_size - 1));
}

static inline void prefetch_row(const char *head, int64_t slot, size_t row_bytes) {
    const char *p = head + slot * (int64_t)row_bytes;
    for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off);
}

/* The same into L2 only (rows wanted a pass later would push L1's working set out). */
static inline void prefetch_row_l2(const char *head, int64_t slot, size_t row_bytes) {
    const char *p = head + slot * (int64_t)row_bytes;
    for (size_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* Where the thread's next task reads its K rows (len 0: no next task). */
typedef struct {
    const char *k_head;
    const int64_t *table;
    int64_t lo, len;   /* its tokens lo .. lo + len - 1 (lo: where its window starts) */
} next_task;

/* Token t's turn: ask for token t + AHEAD's K row (into L1, read next) and V row (into L2, read
 * in the V pass). */
static inline void ask_ahead(const char *kh, const char *vh, const int64_t *table, int64_t t, int64_t L,
                             int block_size, size_t row_bytes) {
    if (t + AHEAD < L) {
        const int64_t ahead = slot_of(table, t + AHEAD, block_size);
        prefetch_row(kh, ahead, row_bytes);
        prefetch_row_l2(vh, ahead, row_bytes);
    }
}

/* Spread the next task's K rows over this task's V pass, called once per token: next.len of
 * them in L calls, a running count instead of a division per token. */
static inline void ask_next(next_task next, int64_t L, int block_size, size_t row_bytes,
                            int64_t *asked, int64_t *credit) {
    for (*credit += next.len; *credit >= L && *asked < next.len; *credit -= L)
        prefetch_row_l2(next.k_head, slot_of(next.table, next.lo + (*asked)++, block_size), row_bytes);
}

#if HAVE_DOT_BF16
static const uint16_t ZERO_ROW[256] __attribute__((aligned(64))) = {0};   /* a token past the context */

/* Columns c..c+31 in order, divided by sum, from the sums over unpacklo (lo) and unpackhi (hi)
 * pairs: of each 8 columns, lo holds the first 4 and hi the last 4. */
static inline void in_order(__m512 lo, __m512 hi, float sum, v16 *out) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    out[0] = (v16)_mm512_div_ps(_mm512_permutex2var_ps(lo, first, hi), _mm512_set1_ps(sum));
    out[1] = (v16)_mm512_div_ps(_mm512_permutex2var_ps(lo, second, hi), _mm512_set1_ps(sum));
}

/* The V pass for a bf16 cache on AVX512-BF16: acc[g] = sum_t p[g, t] V[t] / sums[g], two
 * tokens per vdpbf16ps. p is rounded to bf16 first, as torch's CPU flash attention rounds its
 * probabilities for a bf16 PV product (the products stay exact in float32). The rows of tokens
 * t and t+1 are interleaved into pairs (unpacklo/hi per 128-bit lane) and multiplied by the
 * broadcast pair (p_t, p_t+1): lane k of the sums for columns c..c+31 holds column
 * c + 8(k/4) + k%4 (lo) or c + 8(k/4) + 4 + k%4 (hi), put back in order once at the end.
 * Per two tokens of one KV head and 3 query heads this is 4 loads, 4 shuffles and 12
 * vdpbf16ps, where widening both rows and 24 FMAs in float32 took 46 instructions. */
static inline __attribute__((always_inline)) void v_pass_bf16(const char *vh, const int64_t *table, int64_t lo,
        int64_t L, int G, int D, int block_size, size_t row_bytes, const uint16_t *probs, int64_t Lp,
        const float *sums, v16 *acc, next_task next) {
    const int n = D / 16;
    const int64_t Lw = L - lo;   /* tokens lo..L-1; probs[g * Lp + i] is token lo + i's */
    __m512 a[MAX_ACC];
    for (int k = 0; k < G * n; k++) a[k] = _mm512_setzero_ps();
    int64_t asked = 0, credit = 0;
    for (int64_t t = 0; t < Lw; t += 2) {
        ask_next(next, Lw, block_size, row_bytes, &asked, &credit);
        ask_next(next, Lw, block_size, row_bytes, &asked, &credit);
        const uint16_t *r0 = (const uint16_t *)vh + slot_of(table, lo + t, block_size) * D;
        const uint16_t *r1 = t + 1 < Lw ? (const uint16_t *)vh + slot_of(table, lo + t + 1, block_size) * D : ZERO_ROW;
        for (int i = 0; i < D / 32; i++) {
            const __m512i x0 = _mm512_loadu_si512(r0 + 32 * i), x1 = _mm512_loadu_si512(r1 + 32 * i);
            const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            for (int g = 0; g < G; g++) {
                uint32_t pair;   /* p[g, t] in the low half, p[g, t+1] (0 past the context) high */
                memcpy(&pair, probs + g * Lp + t, sizeof pair);
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                a[g * n + 2 * i] = _mm512_dpbf16_ps(a[g * n + 2 * i], lo, pp);
                a[g * n + 2 * i + 1] = _mm512_dpbf16_ps(a[g * n + 2 * i + 1], hi, pp);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < D / 32; i++)
            in_order(a[g * n + 2 * i], a[g * n + 2 * i + 1], sums[g], (v16 *)(acc + g * n + 2 * i));
}

/* Rows of one prompt chunk, up to 16 at a time (a tile): row i attends to the first L0 + i
 * tokens of the same context. Done row by row, each row would read every K row again and sum
 * each score's 16 partial products across lanes; a tile makes the rows the lanes instead:
 * q packed as pairs of columns per row, each K pair broadcast, so one vdpbf16ps adds a column
 * pair of 16 rows' scores and no score needs a sum across lanes. All scores of the tile go to
 * `scores` first (the max per row is then exact, as in the row kernel, not a running one);
 * the V pass is v_pass_bf16's, a few rows at a time, with the tile's K/V rows read once for
 * all of them. */

typedef struct {
    float *scores;     /* [G][Lp][TILE] */
    uint32_t *qpack;   /* [G][D/2][TILE] */
    __m512 *vpairs;    /* [Lp/2][D/16]: two V rows interleaved, in v_pass_bf16's lane order */
    uint32_t *ppairs;  /* [G][Lp/2][TILE]: two tokens' probabilities per row, bf16 */
} tile_buffers;

static inline __attribute__((always_inline)) void attend_tile(const uint16_t *q, int64_t q_stride, const char *kh,
        const char *vh, const int64_t *table, int64_t L0, int R, int G, int D, int block_size, float scale,
        size_t row_bytes, tile_buffers buf, uint16_t *out, int64_t out_stride) {
    const int n = D / 16, pairs = D / 2;
    const int64_t L = L0 + R - 1, Lp = (L + 15) / 16 * 16;
    for (int c0 = 0; c0 < G * pairs; c0 += 16) {   /* the G heads' column pairs, 16 at a time */
        v16 cols[16];
        for (int i = 0; i < TILE; i++)
            cols[i] = i >= R ? (v16){0} : load16((const float *)(q + i * q_stride) + c0);   /* as bits */
        transpose16(cols);
        memcpy(buf.qpack + c0 * TILE, cols, sizeof cols);
    }
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 scale16 = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    __m512 mx[64];
    for (int g = 0; g < G; g++) mx[g] = minus_inf;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const uint16_t *k[16];
        __mmask16 seen[16];   /* row i sees token t0 + j when t0 + j < L0 + i (and i < R) */
        for (int j = 0; j < 16; j++) {
            const int64_t t = t0 + j;
            ask_ahead(kh, vh, table, t, L, block_size, row_bytes);
            k[j] = t < L ? (const uint16_t *)kh + slot_of(table, t, block_size) * D : ZERO_ROW;
            seen[j] = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32((int)(t - L0 + 1)))
                      & _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(R));
        }
        for (int g = 0; g < G; g++) {
            __m512 s[16];
            for (int j = 0; j < 16; j++) s[j] = _mm512_setzero_ps();
            for (int c = 0; c < pairs; c++) {
                const __m512bh qc = (__m512bh)_mm512_loadu_si512(buf.qpack + (g * pairs + c) * TILE);
                #pragma GCC unroll 16
                for (int j = 0; j < 16; j++) {
                    uint32_t pair;
                    memcpy(&pair, k[j] + 2 * c, sizeof pair);
                    s[j] = _mm512_dpbf16_ps(s[j], qc, (__m512bh)_mm512_set1_epi32((int)pair));
                }
            }
            for (int j = 0; j < 16; j++) {
                const __m512 v = _mm512_mask_mul_ps(minus_inf, seen[j], s[j], scale16);
                _mm512_storeu_ps(buf.scores + ((int64_t)g * Lp + t0 + j) * TILE, v);
                mx[g] = _mm512_max_ps(mx[g], v);
            }
        }
    }
    /* The probabilities of every token, as bf16 pairs, and the V rows of every token pair,
     * interleaved, first; then the V pass a block of rb rows at a time with its rb x D/16 sums
     * (16) in registers over the whole context: each pair of V vectors loaded feeds rb rows (a row
     * at a time, its sums went to memory every 16 tokens and every V vector was loaded again
     * for every row: more loads than vdpbf16ps). Each sum still runs over the tokens in order,
     * so the bits are the same; a prompt's rows are faster so at every length
     * (bench/prompt_attention.py). */
    __m512 sums[64];
    for (int g = 0; g < G; g++) sums[g] = _mm512_setzero_ps();
    /* word 2i of a pair vector: token 2tp's probability for row i, word 2i + 1: token 2tp + 1's */
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t pairs_of_tokens = Lp / 2;
    for (int64_t tp = 0; tp < pairs_of_tokens; tp++) {
        const int64_t t = 2 * tp;
        const uint16_t *r0 = t < L ? (const uint16_t *)vh + slot_of(table, t, block_size) * D : ZERO_ROW;
        const uint16_t *r1 = t + 1 < L ? (const uint16_t *)vh + slot_of(table, t + 1, block_size) * D : ZERO_ROW;
        for (int i = 0; i < D / 32; i++) {
            const __m512i x0 = _mm512_loadu_si512(r0 + 32 * i), x1 = _mm512_loadu_si512(r1 + 32 * i);
            buf.vpairs[tp * n + 2 * i] = (__m512)_mm512_unpacklo_epi16(x0, x1);
            buf.vpairs[tp * n + 2 * i + 1] = (__m512)_mm512_unpackhi_epi16(x0, x1);
        }
        for (int g = 0; g < G; g++) {
            __m512 p[2];
            for (int h = 0; h < 2; h++) {
                const __m512 s = _mm512_loadu_ps(buf.scores + ((int64_t)g * Lp + t + h) * TILE);
                const __mmask16 seen = _mm512_cmp_ps_mask(s, minus_inf, _CMP_NEQ_OQ);
                p[h] = _mm512_maskz_mov_ps(seen, (__m512)exp16((v16)s - (v16)mx[g]));
                sums[g] = _mm512_add_ps(sums[g], p[h]);
            }
            const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(p[0])),
                                                     (__m256i)_mm512_cvtneps_pbh(p[1]), 1);
            _mm512_storeu_si512(buf.ppairs + (g * pairs_of_tokens + tp) * TILE,
                                _mm512_permutexvar_epi16(interleave, both));
        }
    }
    for (int g = 0; g < G; g++) {
        float total[16];
        _mm512_storeu_ps(total, sums[g]);
        const uint32_t *pp = buf.ppairs + g * pairs_of_tokens * TILE;
        const int rb = n >= 16 ? 1 : 16 / n > RB_MAX ? RB_MAX : 16 / n;
        for (int i0 = 0; i0 < R; i0 += rb) {
            __m512 o[RB_MAX][16];   /* D <= 256; rows past R are summed and dropped */
            for (int r = 0; r < rb; r++)
                for (int v = 0; v < n; v++) o[r][v] = _mm512_setzero_ps();
            for (int64_t tp = 0; tp < pairs_of_tokens; tp++) {
                __m512bh vp[16];
                for (int v = 0; v < n; v++) vp[v] = (__m512bh)buf.vpairs[tp * n + v];
                for (int r = 0; r < rb; r++) {
                    const __m512bh pr = (__m512bh)_mm512_set1_epi32((int)pp[tp * TILE + i0 + r]);
                    for (int v = 0; v < n; v++) o[r][v] = _mm512_dpbf16_ps(o[r][v], vp[v], pr);
                }
            }
            for (int r = 0; r < rb && i0 + r < R; r++) {
                uint16_t *row = out + (i0 + r) * out_stride + g * D;
                for (int c = 0; c < D / 32; c++) {
                    v16 cols[2];
                    in_order(o[r][2 * c], o[r][2 * c + 1], total[i0 + r], cols);
                    round_to_bf16(cols[0], row + 32 * c);
                    round_to_bf16(cols[1], row + 32 * c + 16);
                }
            }
        }
    }
}

/* attend_tile with G and D as constants where models use them (as attend_any). */
static void tile_any(const uint16_t *q, int64_t q_stride, const char *kh, const char *vh, const int64_t *table,
                     int64_t L0, int R, int G, int D, int block_size, float scale, size_t row_bytes,
                     tile_buffers buf, uint16_t *out, int64_t out_stride) {
#define TILE_TASK(GG, DD) if (G == GG && D == DD) \
        return attend_tile(q, q_stride, kh, vh, table, L0, R, GG, DD, block_size, scale, row_bytes, buf, out, out_stride)
    TILE_TASK(1, 64); TILE_TASK(2, 64); TILE_TASK(3, 64); TILE_TASK(4, 64);
    TILE_TASK(5, 64); TILE_TASK(6, 64); TILE_TASK(7, 64); TILE_TASK(8, 64);
    TILE_TASK(1, 128); TILE_TASK(2, 128); TILE_TASK(3, 128); TILE_TASK(4, 128);
    TILE_TASK(5, 128); TILE_TASK(6, 128); TILE_TASK(7, 128); TILE_TASK(8, 128);
#undef TILE_TASK
    attend_tile(q, q_stride, kh, vh, table, L0, R, G, D, block_size, scale, row_bytes, buf, out, out_stride);
}
#endif

/* Row `slot` of a [S, D] cache head as float32 lanes in buf (D a multiple of 16). */
static inline void load_row(const char *head, int64_t slot, int D, int bf16, v16 *buf) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)head + slot * D;
        for (int i = 0; i < D / 16; i++) buf[i] = widen(src + 16 * i);
    } else {
        const float *src = (const float *)head + slot * D;
        for (int i = 0; i < D / 16; i++) buf[i] = load16(src + 16 * i);
    }
}

/* The rows of one prompt chunk, up to 16 at a time, in float32 FMAs: attend_tile's scheme
 * for every other cache (float32, or bf16 without AVX512-BF16; any vector unit, v16 being one
 * AVX-512 or two AVX2 registers). In the K pass row i is lane i: q packed as one vector per
 * column, and each score one chain of FMAs over the columns in order, a K value broadcast to
 * 16 rows, so no score needs a sum across lanes and the tile's K rows are read once for its
 * rows. All scores first (the exact max per row), then the V pass with the columns as lanes,
 * a block of rows at a time. */
typedef struct {
    float *scores;   /* [G][Lp][TILE] */
    v16 *qpack;      /* [G][D]: column c of the tile's rows */
    float *rows;     /* [span_tokens(D)][D]: the K rows of 16 tokens, then the V rows of a span, as float32 */
    v16 *acc;        /* [G][TILE][D/16]: the V pass's sums between spans (AVX2: [G][D], 16 rows each) */
} tile_f32_buffers;

/* Tokens whose float32 V rows (128 KiB) stay in L2 through a tile's V pass: 512 for 64-wide
 * heads, 256 for 128-wide; at least 16, for the K pass's rows. */
static inline int64_t span_tokens(int D) {
    const int64_t span = (128 << 10) / ((int64_t)D * (int64_t)sizeof(float));
    return span > 16 ? span : 16;
}

static const float ZERO_ROW_F32[256] __attribute__((aligned(64))) = {0};   /* a token past the context */

/* Accumulators of a tile's inner loops (tokens of the K pass; rows x column vectors of the V
 * pass): 16 of 32 AVX-512 registers, or 4 two-register ones of AVX2's 16, besides a vector of
 * q or V and a broadcast. */
#if defined(__AVX512F__)
#define JB 16
/* x stays in a register: GCC would fold its load into every FMA that uses it (a 512-bit load
 * per FMA, where Zen 4 makes one a cycle) */
#define IN_REGISTER(x) __asm__("" : "+v"(x))
#define V_COLS 8    /* column vectors of a V-pass block at most: 4 x 4 for 64-wide heads (8 loads a 16 FMAs), 2 x 8 for 128 */
#else
#define JB 4
#define IN_REGISTER(x) (void)0
#define V_COLS 1    /* 4 rows x 16 columns: V read 4 times a head, not 16 (1 x 4 was 30 % slower at 1024 tokens) */
#endif

/* Token t's row as float32: in place for a float32 cache, else widened into buf. */
static inline const float *row_f32(const char *head, const int64_t *table, int64_t t, int64_t L, int D,
                                   int block_size, int bf16, float *buf) {
    if (t >= L) return ZERO_ROW_F32;
    const int64_t slot = slot_of(table, t, block_size);
    if (!bf16) return (const float *)head + slot * D;
    for (int i = 0; i < D; i += 16) {
        store16(buf + i, widen((const uint16_t *)head + slot * D + i));
    }
    return buf;
}

/* Token t's row as float32 copied into buf (the K pass reads 16 rows at fixed offsets from
 * one pointer: sixteen row pointers would not stay in registers). */
static inline void copy_row_f32(const char *head, const int64_t *table, int64_t t, int64_t L, int D,
                                int block_size, int bf16, float *buf) {
    const float *r = row_f32(head, table, t, L, D, block_size, bf16, buf);
    if (r != buf) memcpy(buf, r, sizeof(float) * D);
}

/* Scores of `tokens` tokens ([tokens][TILE rows]) to probabilities in place, e^(s - max) (0
 * where masked), each added to its row's sum in token order. */
static inline void to_probabilities(float *p, int64_t tokens, v16 mx, v16 *sum) {
    const v16 minus_inf = (v16){0} - INFINITY;
    for (int64_t t = 0; t < tokens; t++) {
        const v16 s = load16(p + t * TILE);
        const v16 e = select16(s != minus_inf, exp16(s - mx), (v16){0});
        *sum += e;
        store16(p + t * TILE, e);
    }
}

static inline __attribute__((always_inline)) void attend_tile_f32(const char *q, int64_t q_stride,
        const char *kh, const char *vh, const int64_t *table, int64_t L0, int R, int G, int D, int block_size,
        float scale, int bf16, size_t row_bytes, tile_f32_buffers buf, char *out, int64_t out_stride) {
    const int n = D / 16;
    const int64_t L = L0 + R - 1, Lp = (L + 15) / 16 * 16;
    for (int c0 = 0; c0 < G * D; c0 += 16) {   /* the G heads' columns, 16 at a time */
        v16 *cols = buf.qpack + c0;
        for (int i = 0; i < TILE; i++)
            cols[i] = i >= R ? (v16){0} : bf16 ? widen((const uint16_t *)q + i * q_stride + c0)
                                                : load16((const float *)q + i * q_stride + c0);
        transpose16(cols);
    }
    const v16i lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const v16 minus_inf = (v16){0} - INFINITY;
    v16 mx[64];
    for (int g = 0; g < G; g++) mx[g] = minus_inf;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const float *k = buf.rows;   /* [16][D] */
        v16i seen[16];   /* row i sees token t0 + j when t0 + j < L0 + i (and i < R) */
        for (int j = 0; j < 16; j++) {
            ask_ahead(kh, vh, table, t0 + j, L, block_size, row_bytes);
            copy_row_f32(kh, table, t0 + j, L, D, block_size, bf16, buf.rows + j * D);
            seen[j] = (lane >= (int)(t0 + j - L0 + 1)) & (lane < R);
        }
        for (int g = 0; g < G; g++) {
            const v16 *qg = buf.qpack + g * D;
            for (int jb = 0; jb < 16; jb += JB) {
                v16 s[JB];
                for (int j = 0; j < JB; j++) s[j] = (v16){0};
                for (int c = 0; c < D; c++) {
                    const v16 qc = qg[c];
                    #pragma GCC unroll 16
                    for (int j = 0; j < JB; j++) s[j] += qc * k[(jb + j) * D + c];
                }
                for (int j = 0; j < JB; j++) {
                    const v16 v = select16(seen[jb + j], s[j] * scale, minus_inf);
                    store16(buf.scores + ((int64_t)g * Lp + t0 + jb + j) * TILE, v);
                    mx[g] = vmax(mx[g], v);
                }
            }
        }
    }
    v16 sums[64];   /* each row's sum of its probabilities, over the tokens in order */
    for (int g = 0; g < G; g++) sums[g] = (v16){0};
#if defined(__AVX512F__)
    for (int g = 0; g < G; g++) to_probabilities(buf.scores + (int64_t)g * Lp * TILE, L, mx[g], &sums[g]);
    /* The V pass a block of rows at a time, D's columns as the lanes: V row t (widened once)
     * feeds rb rows, each row's probability broadcast, rb x cb sums in registers, and the
     * context a span of tokens at a time, whose V rows stay in L2 while every block of every
     * head reads them (the sums wait in buf.acc between spans, stored and loaded exactly).
     * Each sum runs over the tokens in order and is divided by its row's sum: the bits of the
     * rows-as-lanes V pass below, which loads a probability vector and a broadcast V value
     * for every FMA and leaves 16 rows' sums to be transposed out. With AVX-512 the blocks are
     * faster for short and medium contexts and even for long ones (spans keep V in L2, where
     * whole-context passes read it from L3; bench/prompt_attention.py). On AVX2 (16 registers)
     * the blocks are much slower than the pass below: it keeps that. */
    const int cb = n <= V_COLS ? n : n % V_COLS == 0 ? V_COLS : n % 4 == 0 ? 4 : n % 2 == 0 ? 2 : 1;
    const int fit = JB / cb;   /* (conditionals, not loops: constants where G and D are, so o stays in registers) */
    const int rb = fit >= 16 ? 16 : fit >= 8 ? 8 : fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
    const int64_t span = span_tokens(D);
    for (int64_t s0 = 0; s0 < L; s0 += span) {
        const int64_t s1 = s0 + span < L ? s0 + span : L;
        for (int64_t t = s0; t < s1; t++)
            copy_row_f32(vh, table, t, L, D, block_size, bf16, buf.rows + (t - s0) * D);
        for (int g = 0; g < G; g++) {
            const float *p = buf.scores + (int64_t)g * Lp * TILE;
            v16 *part = buf.acc + g * TILE * n;   /* [TILE rows][n]: the sums over the spans before */
            float total[16];
            store16(total, sums[g]);
            for (int i0 = 0; i0 < R; i0 += rb)
                for (int c0 = 0; c0 < n; c0 += cb) {
                    v16 o[JB];   /* o[r * cb + c]: row i0 + r, columns 16 (c0 + c) on; rows past R summed and dropped */
                    for (int k = 0; k < rb * cb; k++) o[k] = (v16){0};
                    if (s0)
                        for (int r = 0; r < rb; r++)
                            for (int c = 0; c < cb; c++) o[r * cb + c] = part[(i0 + r) * n + c0 + c];
                    for (int64_t t = s0; t < s1; t++) {
                        v16 v[JB];   /* V row t's columns, loaded once for the rb rows */
                        for (int c = 0; c < cb; c++) {
                            v[c] = load16(buf.rows + (t - s0) * D + 16 * (c0 + c));
                            IN_REGISTER(v[c]);
                        }
                        for (int r = 0; r < rb; r++)
                            for (int c = 0; c < cb; c++) o[r * cb + c] += v[c] * p[t * TILE + i0 + r];
                    }
                    for (int r = 0; r < rb; r++)
                        for (int c = 0; c < cb; c++) {
                            if (s1 < L) {
                                part[(i0 + r) * n + c0 + c] = o[r * cb + c];
                                continue;
                            }
                            if (i0 + r >= R) continue;
                            const v16 row = o[r * cb + c] / splat16(total[i0 + r]);
                            const int64_t at = (i0 + r) * out_stride + g * D + 16 * (c0 + c);
                            if (bf16) round_to_bf16(row, (uint16_t *)out + at);
                            else store16((float *)out + at, row);
                        }
                }
        }
    }
#else
    /* The V pass the same way round as the K pass: out[row, g, d] = sum_t p[g, t, row] V[t, d],
     * the rows as lanes, each V value broadcast to 16 rows; acc[g][d] holds 16 rows' sums. */
    for (int k = 0; k < G * D; k++) buf.acc[k] = (v16){0};
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        for (int j = 0; j < 16; j++) copy_row_f32(vh, table, t0 + j, L, D, block_size, bf16, buf.rows + j * D);
        const float *v = buf.rows;   /* [16][D] */
        for (int g = 0; g < G; g++) {
            float *p = buf.scores + ((int64_t)g * Lp + t0) * TILE;   /* [16 tokens][TILE rows] */
            to_probabilities(p, 16, mx[g], &sums[g]);   /* here, while they are in L1 (15 % faster at 2048 tokens) */
            for (int d0 = 0; d0 < D; d0 += JB) {
                v16 a[JB];
                for (int d = 0; d < JB; d++) a[d] = buf.acc[g * D + d0 + d];
                for (int j = 0; j < 16; j++) {
                    const v16 pj = load16(p + j * TILE);
                    #pragma GCC unroll 16
                    for (int d = 0; d < JB; d++) a[d] += pj * v[j * D + d0 + d];
                }
                for (int d = 0; d < JB; d++) buf.acc[g * D + d0 + d] = a[d];
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int d = 0; d < D; d++) buf.acc[g * D + d] /= sums[g];
    for (int i = 0; i < R; i++)
        for (int g = 0; g < G; g++) {
            float row[256];
            for (int d = 0; d < D; d++) row[d] = buf.acc[g * D + d][i];
            for (int c = 0; c < n; c++) {
                const int64_t at = i * out_stride + g * D + 16 * c;
                if (bf16) round_to_bf16(load16(row + 16 * c), (uint16_t *)out + at);
                else store16((float *)out + at, load16(row + 16 * c));
            }
        }
#endif
}

/* attend_tile_f32 with G and D as constants where models use them (as attend_any). */
static void tile_f32_any(const char *q, int64_t q_stride, const char *kh, const char *vh, const int64_t *table,
                         int64_t L0, int R, int G, int D, int block_size, float scale, int bf16, size_t row_bytes,
                         tile_f32_buffers buf, char *out, int64_t out_stride) {
#define TILE_TASK(GG, DD) if (G == GG && D == DD) \
        return attend_tile_f32(q, q_stride, kh, vh, table, L0, R, GG, DD, block_size, scale, bf16, row_bytes, buf, \
                               out, out_stride)
    TILE_TASK(1, 64); TILE_TASK(2, 64); TILE_TASK(3, 64); TILE_TASK(4, 64);
    TILE_TASK(5, 64); TILE_TASK(6, 64); TILE_TASK(7, 64); TILE_TASK(8, 64);
    TILE_TASK(1, 128); TILE_TASK(2, 128); TILE_TASK(3, 128); TILE_TASK(4, 128);
    TILE_TASK(5, 128); TILE_TASK(6, 128); TILE_TASK(7, 128); TILE_TASK(8, 128);
#undef TILE_TASK
    attend_tile_f32(q, q_stride, kh, vh, table, L0, R, G, D, block_size, scale, bf16, row_bytes, buf, out, out_stride);
}

/* softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (e^2x + 1) from one exponential (2x past
 * 18 clamped: tanh is 1 in float32 there, and e^2x stays finite). */
static inline v16 softcap16(v16 s, float softcap) {
    v16 x2 = s * (2.0f / softcap);
    x2 = (v16){0} - vmax((v16){0} - x2, (v16){0} - 18.0f);   /* min(x2, 18) */
    return softcap * (1.0f - 2.0f / (exp16(x2) + 1.0f));
}

/* A head's scores for tokens 0..Lw-1 to e^(s - mx) in place, 0 past Lw, soft-capped first
 * when `capped` (mx then the capped maximum), also as bf16 into pr unless NULL; returns their
 * sum. Inlined with `capped` a constant: the loop without it has no cap. */
static inline __attribute__((always_inline)) float to_probs(float *sc, uint16_t *pr, int64_t Lw, float mx,
                                                            float softcap, int capped) {
    v16 sv = {0};
    for (int64_t t0 = 0; t0 < Lw; t0 += 16) {
        v16 s = load16(sc + t0);
        if (capped) s = softcap16(s, softcap);
        v16 p = exp16(s - mx);
        for (int j = Lw - t0 < 16 ? (int)(Lw - t0) : 16; j < 16; j++) p[j] = 0.0f;
        store16(sc + t0, p);
#if HAVE_DOT_BF16
        if (pr != NULL) {
            __m512 pf;
            memcpy(&pf, &p, sizeof pf);
            _mm256_storeu_si256((__m256i *)(pr + t0), (__m256i)_mm512_cvtneps_pbh(pf));
        }
#else
        (void)pr;
#endif
        sv += p;
    }
    return hsum(sv);
}

/* One task: request b's query heads [kv*G, kv*G + G) over its L tokens of KV head kv.
 * Inlined with G and D constants where the caller can (see the dispatch below), so the
 * accumulators live in registers and the loops over heads and lanes unroll. */
static inline __attribute__((always_inline)) void attend(const v16 *qv, const uint16_t *qh, const char *kh, const char *vh, const int64_t *table, int64_t lo, int64_t L,
                   int G, int D, int block_size, float scale, float softcap, int bf16, size_t row_bytes,
                   v16 *acc, v16 *part, float *scores, int64_t Lp, next_task next) {
    const int n = D / 16;
    const int64_t Lw = L - lo;   /* tokens lo..L-1 (a window's; lo 0 without one): scores[g * Lp + i] is token lo + i's */
    v16 row[16];    /* D <= 256 */
    v16 maxv[64];
    for (int g = 0; g < G; g++) maxv[g] = (v16){0} - INFINITY;
    for (int64_t i0 = 0; i0 < Lw; i0 += 16) {
        const int64_t t0 = lo + i0;
        const int m = Lw - i0 < 16 ? (int)(Lw - i0) : 16;
#if HAVE_DOT_BF16
        if (qh != NULL && m == 16) {
            /* A whole chunk, one query head at a time: its 16 partial sums stay in registers
             * (all heads' would not fit), each K row read from L1 once per head. */
            const uint16_t *k[16];
            for (int j = 0; j < 16; j++) {
                ask_ahead(kh, vh, table, t0 + j, L, block_size, row_bytes);
                k[j] = (const uint16_t *)kh + slot_of(table, t0 + j, block_size) * D;
            }
            for (int g = 0; g < G; g++) {
                v16 pr[16];
                #pragma GCC unroll 16
                for (int j = 0; j < 16; j++) pr[BITREV4[j]] = dot_bf16(qh + g * D, k[j], D);
                const v16 s = sum16x16(pr) * scale;
                store16(scores + g * Lp + i0, s);
                maxv[g] = vmax(maxv[g], s);
            }
            continue;
        }
#endif
        for (int j = 0; j < 16; j++) {
            if (j >= m) {
                for (int g = 0; g < G; g++) part[g * 16 + BITREV4[j]] = (v16){0};
                continue;
            }
            const int64_t t = t0 + j;
            ask_ahead(kh, vh, table, t, L, block_size, row_bytes);
#if HAVE_DOT_BF16
            if (qh != NULL) {
                const uint16_t *k = (const uint16_t *)kh + slot_of(table, t, block_size) * D;
                for (int g = 0; g < G; g++) part[g * 16 + BITREV4[j]] = dot_bf16(qh + g * D, k, D);
                continue;
            }
#endif
            load_row(kh, slot_of(table, t, block_size), D, bf16, row);
            for (int g = 0; g < G; g++) {
                v16 a = qv[g * n] * row[0];
                for (int i = 1; i < n; i++) a += qv[g * n + i] * row[i];
                part[g * 16 + BITREV4[j]] = a;
            }
        }
        for (int g = 0; g < G; g++) {
            v16 s = sum16x16(part + g * 16) * scale;
            for (int j = m; j < 16; j++) s[j] = -INFINITY;
            store16(scores + g * Lp + i0, s);
            maxv[g] = vmax(maxv[g], s);
        }
    }
    float sums[64];
#if HAVE_DOT_BF16
    uint16_t *probs = (uint16_t *)(scores + G * Lp);   /* the same probabilities in bf16 */
#endif
    for (int g = 0; g < G; g++) {
        uint16_t *pr = NULL;
#if HAVE_DOT_BF16
        if (qh != NULL) pr = probs + g * Lp;
#endif
        /* the branch once per head: a row without soft-capping runs the loop without it */
        const float mx = hmax(maxv[g]);
        sums[g] = softcap > 0 ? to_probs(scores + g * Lp, pr, Lw, softcap16(splat16(mx), softcap)[0], softcap, 1)
                              : to_probs(scores + g * Lp, pr, Lw, mx, 0, 0);
    }
#if HAVE_DOT_BF16
    if (qh != NULL) {
        v_pass_bf16(vh, table, lo, L, G, D, block_size, row_bytes, probs, Lp, sums, acc, next);
        return;
    }
#endif
    v16 a[MAX_ACC];
    for (int k = 0; k < G * n; k++) a[k] = (v16){0};
    int64_t asked = 0, credit = 0;
    for (int64_t i = 0; i < Lw; i++) {
        const int64_t t = lo + i;
        ask_next(next, Lw, block_size, row_bytes, &asked, &credit);
        load_row(vh, slot_of(table, t, block_size), D, bf16, row);
        for (int g = 0; g < G; g++) {
            const float p = scores[g * Lp + i];
            for (int i = 0; i < n; i++) a[g * n + i] += p * row[i];
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) acc[g * n + i] = a[g * n + i] / sums[g];
}

/* The task with G and D as constants for the shapes models use (GQA groups of 1 to 8, heads
 * of 64 or 128), else as variables. */
static void attend_any(const v16 *qv, const uint16_t *qh, const char *kh, const char *vh, const int64_t *table,
                       int64_t lo, int64_t L, int G, int D, int block_size, float scale, float softcap, int bf16,
                       size_t row_bytes, v16 *acc, v16 *part, float *scores, int64_t Lp, next_task next) {
#define TASK(GG, DD) if (G == GG && D == DD) \
        return attend(qv, qh, kh, vh, table, lo, L, GG, DD, block_size, scale, softcap, bf16, row_bytes, acc, part, \
                      scores, Lp, next)
    TASK(1, 64); TASK(2, 64); TASK(3, 64); TASK(4, 64); TASK(5, 64); TASK(6, 64); TASK(7, 64); TASK(8, 64);
    TASK(1, 128); TASK(2, 128); TASK(3, 128); TASK(4, 128); TASK(5, 128); TASK(6, 128); TASK(7, 128); TASK(8, 128);
#undef TASK
    attend(qv, qh, kh, vh, table, lo, L, G, D, block_size, scale, softcap, bf16, row_bytes, acc, part, scores, Lp, next);
}

/* 1 when this build rounds a bf16 cache's probabilities to bf16 (v_pass_bf16; head sizes a
 * multiple of 32), else 0. */
int probabilities_in_bf16(void) { return HAVE_DOT_BF16; }

/* Rows a < b of one prompt chunk: b's context is a's and the b - a tokens after it, in the
 * same blocks (a tile may then read every row's context through row a's table). */
static int same_context(const int64_t *tables, const int64_t *lens, int W, int block_size, int a, int b) {
    if (lens[b] != lens[a] + (b - a)) return 0;
    const int64_t blocks = (lens[b] + block_size - 1) / block_size;
    return blocks <= W && memcmp(tables + (int64_t)a * W, tables + (int64_t)b * W, sizeof(int64_t) * blocks) == 0;
}

typedef struct {
    int row, rows;   /* rows 0: one row, attend_any; else a tile of `rows` rows from `row` */
} work;

static inline int64_t tile_len(work w, const int64_t *lens) { return lens[w.row + w.rows - 1]; }

/* Which tile a chunk's rows take: bf16 dot products (attend_tile) for a bf16 cache on
 * AVX512-BF16 and head sizes a multiple of 32, else float32 FMAs (attend_tile_f32); heads of
 * up to 256. */
static inline int tiles_in_bf16(int bf16, int D) { return bf16 && HAVE_DOT_BF16 && D % 32 == 0; }
static inline int tiles_apply(int D) { return D % 16 == 0 && D <= 256; }

/* The work of one call into plan (B + 1 entries): tiles first, the longest contexts first (so
 * the threads end together), then single rows; task i is plan[i / KV] for KV head i % KV.
 * Returns its length; *n_tiles: how many are tiles (none unless `tiled`). */
static int make_plan(work *plan, int *n_tiles, const int64_t *block_tables, const int64_t *context_lens,
                     int B, int W, int block_size, int tiled) {
    int n_work = 0;
    *n_tiles = 0;
    for (int r = 0; r < B;) {
        int run = 1;
        while (tiled && r + run < B && run < TILE && same_context(block_tables, context_lens, W, block_size, r, r + run))
            run++;
        if (run >= TILE_MIN) {
            plan[n_work++] = (work){r, run};
            (*n_tiles)++;
        } else {
            for (int i = 0; i < run; i++) plan[n_work++] = (work){r + i, 0};
        }
        r += run;
    }
    /* an insertion sort: a few hundred tiles at most, its cost nothing next to one tile's */
    for (int i = 0; i < n_work; i++)
        if (plan[i].rows)
            for (int j = i; j > 0 && (!plan[j - 1].rows || tile_len(plan[j - 1], context_lens) < tile_len(plan[j], context_lens)); j--) {
                const work w = plan[j]; plan[j] = plan[j - 1]; plan[j - 1] = w;
            }
    return n_work;
}

/* How many tiles a call with these rows would make (for tests: that the tiles do run). */
int paged_decode_attention_tiles(const int64_t *block_tables, const int64_t *context_lens, int B, int W,
                                 int block_size, int D, int bf16) {
    work *plan = (work *)malloc(sizeof(work) * (B + 1));
    int n_tiles;
    make_plan(plan, &n_tiles, block_tables, context_lens, B, W, block_size, tiles_apply(D));
    free(plan);
    (void)bf16;
    return n_tiles;
}

/* The first token a row of context L sees: its window's first, or 0. */
static inline int64_t window_start(int64_t L, int window) { return window > 0 && L > window ? L - window : 0; }

/* q, out: [B, H, D] and caches [KV, S, D], all float32 (bf16 = 0) or all bfloat16 (bf16 = 1);
 * q's tokens q_stride elements apart (its heads contiguous: a view of the fused QKV output
 * needs no copy), out contiguous. scale as given (a family's query scale); window > 0: each
 * row sees its last `window` tokens; softcap > 0: scores soft-capped (see the top). Runs of at least TILE_MIN rows of one prompt chunk go in
 * tiles (bf16 dot products on AVX512-BF16, float32 FMAs otherwise), every other row alone;
 * tiles = 0 takes every row alone (the batch-invariant mode: a row's bits then do not depend on
 * whether it came in a prompt chunk or a decode step). */
void paged_decode_attention(const void *q, const void *k_cache, const void *v_cache,
                            const int64_t *block_tables, const int64_t *context_lens,
                            void *out, int B, int H, int KV, int D, int W, int block_size,
                            int64_t S, float scale, int num_threads, int bf16, int64_t q_stride, int window,
                            float softcap, int tiles) {
    const int G = H / KV, n = D / 16;
    const size_t elem = bf16 ? 2 : 4, row_bytes = D * elem;
    int64_t max_len = 0;
    for (int b = 0; b < B; b++) max_len = context_lens[b] > max_len ? context_lens[b] : max_len;
    const int64_t Lp = (max_len + 15) / 16 * 16;
    work *plan = (work *)malloc(sizeof(work) * (B + 1));
    int n_tiles;
    const int n_work = make_plan(plan, &n_tiles, block_tables, context_lens, B, W, block_size,
                                 tiles && tiles_apply(D) && window <= 0 && !(softcap > 0));
    const int tile_bf16 = tiles_in_bf16(bf16, D);
    const int tasks = n_work * KV;
    int claimed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* Per thread: query and accumulator lanes, partial sums, the scores of one task
         * (float32, then bf16). */
        v16 *qv = (v16 *)aligned_alloc(64, sizeof(v16) * (2 * G * n + 16 * G) + (6 * G * Lp + 63) / 64 * 64 + 64);
        v16 *acc = qv + G * n, *part = acc + G * n;
        float *scores = (float *)(part + 16 * G);
        /* A tile's buffers: attend_tile's (bf16) or attend_tile_f32's, one block of memory. */
        void *tile_mem = NULL;
#if HAVE_DOT_BF16
        tile_buffers tb = {0};
        if (n_tiles && tile_bf16) {
            const size_t sizes[4] = {sizeof(float) * G * Lp * TILE, sizeof(uint32_t) * G * (D / 2) * TILE,
                                     sizeof(__m512) * (Lp / 2) * n, sizeof(uint32_t) * G * (Lp / 2) * TILE};
            size_t total = 0;
            for (int i = 0; i < 4; i++) total += (sizes[i] + 63) / 64 * 64;
            char *m = (char *)(tile_mem = aligned_alloc(64, total));
            tb.scores = (float *)m; m += (sizes[0] + 63) / 64 * 64;
            tb.qpack = (uint32_t *)m; m += (sizes[1] + 63) / 64 * 64;
            tb.vpairs = (__m512 *)m; m += (sizes[2] + 63) / 64 * 64;
            tb.ppairs = (uint32_t *)m;
        }
#endif
        tile_f32_buffers tf = {0};
        if (n_tiles && !tile_bf16) {
            const size_t sizes[4] = {sizeof(float) * G * Lp * TILE, sizeof(v16) * G * D,
                                     sizeof(float) * span_tokens(D) * D, sizeof(v16) * G * TILE * n};
            size_t total = 0;
            for (int i = 0; i < 4; i++) total += (sizes[i] + 63) / 64 * 64;
            char *m = (char *)(tile_mem = aligned_alloc(64, total));
            tf.scores = (float *)m; m += (sizes[0] + 63) / 64 * 64;
            tf.qpack = (v16 *)m; m += (sizes[1] + 63) / 64 * 64;
            tf.rows = (float *)m; m += (sizes[2] + 63) / 64 * 64;
            tf.acc = (v16 *)m;
        }
        /* Dynamic scheduling, each thread holding the claim on its next task while it runs
         * this one, so it knows which rows to ask for. */
        int task = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (task < tasks) {
            const int after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const work w = plan[task / KV];
            const int b = w.row, kv = task % KV;
            const char *kh = (const char *)k_cache + (int64_t)kv * S * row_bytes;
            const char *vh = (const char *)v_cache + (int64_t)kv * S * row_bytes;
            const int64_t head0 = (int64_t)b * H + (int64_t)kv * G;
            const char *qg = (const char *)q + ((int64_t)b * q_stride + (int64_t)kv * G * D) * elem;
            if (w.rows) {
#if HAVE_DOT_BF16
                if (tile_bf16)
                    tile_any((const uint16_t *)qg, q_stride, kh, vh, block_tables + (int64_t)b * W, context_lens[b],
                             w.rows, G, D, block_size, scale, row_bytes, tb, (uint16_t *)out + head0 * D,
                             (int64_t)H * D);
                else
#endif
                    tile_f32_any(qg, q_stride, kh, vh, block_tables + (int64_t)b * W, context_lens[b], w.rows, G, D,
                                 block_size, scale, bf16, row_bytes, tf, (char *)out + head0 * D * elem,
                                 (int64_t)H * D);
                task = after;
                continue;
            }
            next_task next = {NULL, NULL, 0, 0};
            if (after < tasks && !plan[after / KV].rows) {
                const int nb = plan[after / KV].row;
                const int64_t nlo = window_start(context_lens[nb], window);
                next = (next_task){(const char *)k_cache + (int64_t)(after % KV) * S * row_bytes,
                                   block_tables + (int64_t)nb * W, nlo, context_lens[nb] - nlo};
            }
            for (int g = 0; g < G; g++)
                load_row(qg, g, D, bf16, qv + g * n);
            const uint16_t *qh = bf16 && D % 32 == 0 && HAVE_DOT_BF16 ? (const uint16_t *)qg : NULL;
            attend_any(qv, qh, kh, vh, block_tables + (int64_t)b * W, window_start(context_lens[b], window),
                       context_lens[b], G, D, block_size, scale, softcap, bf16, row_bytes, acc, part, scores, Lp, next);
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
        free(tile_mem);
    }
    free(plan);
}
