/* Causal attention of one prompt chunk: T query rows, the last T of a context of L tokens
 * (row i sits at position L - T + i and sees positions 0..L - T + i).
 *
 * Why C: torch's SDPA on a prefill chunk of ~100 tokens and 64-wide heads ran at a fifth of
 * the FMA peak (its small per-block GEMMs, docs/cpu-kernels.md), and a prefill step spent a
 * tenth of its time there. Here the query vectors that share a kv head (grouped-query
 * attention: G query heads, every row of the chunk) are taken TILE at a time, and each K and V
 * vector loaded serves all of them: scores are a small GEMM against K transposed once per
 * call (a [hd, L] copy per kv head, so that 16 tokens' scores are two vector loads a dimension),
 * and the weighted sum of V runs token by token over the tile.
 *
 * A row's result does not depend on the tile or the chunk it came in: its scores are the same
 * chain of multiply-adds, its softmax runs over its own tokens in order, and its weighted sum
 * adds V token by token from 0, tokens past its end with weight exactly 0 (which leaves the
 * sum's bits as they are). So a prompt computed in one chunk or in several gives the same bits.
 *
 * Layout: q rows [nh, hd] (unit stride within a row) at q + i * q_stride; out likewise. K and V:
 * token t's row of every kv head at k + row(t) * k_stride (v likewise), row(t) = t where table
 * is NULL (this step's own K/V: a fresh prompt), else its cache slot (table[t / block_size] *
 * block_size + t % block_size). Query head j reads kv head j / (nh / kvh).
 *
 * Returns 0; -1 when scratch memory cannot be had; -3 when this build has no kernel for the
 * shape (no AVX2 + FMA, or a head size not a multiple of 16): the caller uses torch's SDPA.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../../ops/simd.h"
#include "paged_rows.h" /* slot_of, token_cursor */

/* query vectors per tile: 6 x 2 score accumulators (16 tokens), 2 K loads and a broadcast,
 * within the 16 ymm registers */
#define TILE 6
#define TOKENS 16 /* scores per pass: two 8-float vectors */

static inline int64_t row_of(const int64_t *table, int64_t t, int64_t block_size) {
    return table ? slot_of(table, t, block_size) : t;
}

#if defined(__AVX2__) && defined(__FMA__)
#include "softmax_avx2.h"

/* Scores of the tile's query vectors (qv[j], hd floats each) against tokens [0, len) of one kv
 * head, K transposed in kt ([HD][ldk]): p[j][t] = scale * q_j . k_t, 16 tokens a pass. Always
 * a whole tile (a short one is padded with a zero vector): the loops over it are then of
 * constant length and its accumulators stay in registers. */
static void tile_scores(const float *const *qv, const float *kt, int64_t ldk, int64_t HD,
                        int64_t len, float scale, float *p, int64_t ldp) {
    const f32x8 vs = f32x8_set1(scale);
    for (int64_t t0 = 0; t0 < len; t0 += TOKENS) {
        f32x8 acc[TILE][2];
        for (int j = 0; j < TILE; j++) acc[j][0] = acc[j][1] = f32x8_zero();
        for (int64_t d = 0; d < HD; d++) {
            const f32x8 k0 = f32x8_load(kt + d * ldk + t0), k1 = f32x8_load(kt + d * ldk + t0 + 8);
            for (int j = 0; j < TILE; j++) {
                const f32x8 qd = f32x8_bcast(qv[j] + d);
                acc[j][0] = f32x8_fma(qd, k0, acc[j][0]);
                acc[j][1] = f32x8_fma(qd, k1, acc[j][1]);
            }
        }
        for (int j = 0; j < TILE; j++) {
            f32x8_store(p + j * ldp + t0, f32x8_mul(acc[j][0], vs));
            f32x8_store(p + j * ldp + t0 + 8, f32x8_mul(acc[j][1], vs));
        }
    }
}

/* p[0..len) <- exp(p - max), zero on [len, upto); returns 1 / their sum */
static float softmax_row(float *p, int64_t len, int64_t upto) {
    f32x8 vmax = f32x8_set1(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= len; t += 8) vmax = f32x8_max(vmax, f32x8_load(p + t));
    float mx = f32x8_hmax(vmax);
    for (; t < len; t++) mx = p[t] > mx ? p[t] : mx;
    const float sum = exp_shifted_sum(p, len, mx);
    for (t = len; t < upto; t++) p[t] = 0.f;
    return 1.f / sum;
}

/* out_j = inv_j * sum_t p[j][t] v_t over tokens [0, upto) of kv head column voff, 16 dims a
 * pass; v rows found through the table (or in order) */
static void tile_values(float *const *ov, const float *p, int64_t ldp, const float *inv,
                        const float *v, int64_t v_stride, int64_t voff, const int64_t *table,
                        int64_t block_size, int64_t HD, int64_t upto) {
    for (int64_t d0 = 0; d0 < HD; d0 += 16) {
        f32x8 acc[TILE][2];
        for (int j = 0; j < TILE; j++) acc[j][0] = acc[j][1] = f32x8_zero();
        token_cursor cur = cursor_at(table, 0, table ? block_size : 1, v_stride);
        for (int64_t t = 0; t < upto; t++) {
            const float *vt = v + (table ? cursor_row(&cur) : t * v_stride) + voff + d0;
            if (table) cursor_next(&cur);
            const f32x8 v0 = f32x8_load(vt), v1 = f32x8_load(vt + 8);
            for (int j = 0; j < TILE; j++) {
                const f32x8 w = f32x8_bcast(p + j * ldp + t);
                acc[j][0] = f32x8_fma(w, v0, acc[j][0]);
                acc[j][1] = f32x8_fma(w, v1, acc[j][1]);
            }
        }
        for (int j = 0; j < TILE; j++) {
            const f32x8 s = f32x8_set1(inv[j]);
            f32x8_store(ov[j] + d0, f32x8_mul(acc[j][0], s));
            f32x8_store(ov[j] + d0 + 8, f32x8_mul(acc[j][1], s));
        }
    }
}

int prefill_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                      int64_t T, int64_t L, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, const int64_t *table, int64_t block_size, int64_t nh,
                      int64_t kvh, int64_t hd, float scale, int nthreads) {
    if (hd % 16 || nh % kvh || T > L || T <= 0) return -3;
    /* K transposed: rows of ldk floats, whole 16-token passes and one more, so that its rows
     * are not a power of two apart (64 of them at a 4 KiB stride share a set of the L1) */
    const int64_t G = nh / kvh, ldk = (L + TOKENS - 1) / TOKENS * TOKENS + TOKENS;
    const int64_t vectors = T * G, tiles = (vectors + TILE - 1) / TILE;
    float *kt = malloc(sizeof(float) * kvh * hd * ldk);
    /* per thread: its tile's scores, then a zero query vector and an output row for the
     * vectors that pad a short tile */
    const int64_t per_thread = TILE * ldk + 2 * hd;
    float *pbuf = calloc(nthreads * per_thread, sizeof(float));
    if (!kt || !pbuf) { free(kt); free(pbuf); return -1; }
#pragma omp parallel num_threads(nthreads)
    {
        /* K transposed per kv head, token blocks of 64 shared out; columns past L are zero */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < kvh * ((ldk + 63) / 64); item++) {
            const int64_t h = item % kvh, t0 = item / kvh * 64;
            float *kh = kt + h * hd * ldk;
            for (int64_t t = t0; t < t0 + 64 && t < ldk; t++) {
                if (t >= L) {
                    for (int64_t d = 0; d < hd; d++) kh[d * ldk + t] = 0.f;
                    continue;
                }
                const float *kr = k + row_of(table, t, block_size) * k_stride + h * hd;
                for (int64_t d = 0; d < hd; d++) kh[d * ldk + t] = kr[d];
            }
        }
        float *p = pbuf + (int64_t)omp_get_thread_num() * per_thread;
        float *zero_q = p + TILE * ldk, *spare_out = zero_q + hd;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < kvh * tiles; item++) {
            const int64_t h = item / tiles, first = item % tiles * TILE;
            const int n = (int)(vectors - first < TILE ? vectors - first : TILE);
            const float *qv[TILE];
            float *ov[TILE], inv[TILE];
            int64_t len[TILE];
            for (int j = 0; j < TILE; j++) { /* vector first + j: row r, query head h * G + g */
                if (j >= n) { /* padding: scores of zero, written to the spare row */
                    qv[j] = zero_q, ov[j] = spare_out, len[j] = len[n - 1];
                    continue;
                }
                const int64_t r = (first + j) / G, g = (first + j) % G;
                qv[j] = q + r * q_stride + (h * G + g) * hd;
                ov[j] = out + r * out_stride + (h * G + g) * hd;
                len[j] = L - T + r + 1;
            }
            const int64_t upto = len[n - 1]; /* the tile's last row sees the most */
            tile_scores(qv, kt + h * hd * ldk, ldk, hd, upto, scale, p, ldk);
            for (int j = 0; j < TILE; j++) inv[j] = softmax_row(p + j * ldk, len[j], upto);
            tile_values(ov, p, ldk, inv, v, v_stride, h * hd, table, block_size, hd, upto);
        }
    }
    free(kt);
    free(pbuf);
    return 0;
}

#else

int prefill_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                      int64_t T, int64_t L, const float *k, int64_t k_stride, const float *v,
                      int64_t v_stride, const int64_t *table, int64_t block_size, int64_t nh,
                      int64_t kvh, int64_t hd, float scale, int nthreads) {
    return -3;
}

#endif
