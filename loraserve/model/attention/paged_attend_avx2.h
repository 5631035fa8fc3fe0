/* The paged decode attention kernel's vector path (AVX2 + FMA, a head size that is a multiple
 * of 8), included by paged_decode.c: scores 8 tokens at a time, a vector exp, the weighted sum
 * of V block by block. paged_decode.c's header says how and why; it includes this after
 * defining cap(), the soft cap both paths apply to a score.
 */
#ifndef LORASERVE_PAGED_ATTEND_AVX2_H
#define LORASERVE_PAGED_ATTEND_AVX2_H

#include <math.h>
#include <stdint.h>

#include "../../ops/simd.h"
#include "../../ops/tuning.h"
#include "paged_rows.h"
#include "softmax_avx2.h"

/* Scores are summed as the prompt kernel sums them (prefill_attention.c's tile_scores): per
 * token one multiply-add chain over the head's dimensions, in order from zero, so that both
 * kernels give a token the same score. Lanes are tokens, so K comes transposed (8 x 8 in
 * registers), and each chain is as long as the head is wide: a pass keeps up to SCORE_HEADS
 * query heads x two groups of 8 tokens in flight, the independent chains that hide the multiply-add's
 * latency. */
#define SCORE_HEADS 4 /* query heads a pass scores */
#define PASS 16       /* tokens a pass scores: two groups of 8 */

/* kt[0..8) <- dimensions off..off+7 of the 8 rows k[j]: kt[d] holds dimension off + d of the
 * 8 tokens. The loads put rows j and j + 4 in one register's halves, so that two rounds of
 * in-lane shuffles finish the transpose (no lane-crossing permutes). */
SIMD_INLINE void transpose8(const float *const *k, int64_t off, f32x8 *kt) {
    for (int half = 0; half < 2; half++) { /* dimensions 4 * half .. 4 * half + 3 */
        __m256 r[4], t[4];
        for (int j = 0; j < 4; j++)
            r[j] = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(k[j] + off + 4 * half)),
                                        _mm_loadu_ps(k[j + 4] + off + 4 * half), 1);
        t[0] = _mm256_unpacklo_ps(r[0], r[1]);
        t[1] = _mm256_unpackhi_ps(r[0], r[1]);
        t[2] = _mm256_unpacklo_ps(r[2], r[3]);
        t[3] = _mm256_unpackhi_ps(r[2], r[3]);
        kt[4 * half] = _mm256_shuffle_ps(t[0], t[2], 0x44);
        kt[4 * half + 1] = _mm256_shuffle_ps(t[0], t[2], 0xee);
        kt[4 * half + 2] = _mm256_shuffle_ps(t[1], t[3], 0x44);
        kt[4 * half + 3] = _mm256_shuffle_ps(t[1], t[3], 0xee);
    }
}

/* s[u][g] = q_g . k over the 8 tokens of group u (its transposed K at kt + u * HD), for GN
 * query heads (q_g at qg + g * HD) and NG groups. The chains are locals, indexed by constants
 * only, so that they stay in registers; s is written once at the end. */
SIMD_INLINE void score_chains(const float *qg, const f32x8 *kt, const int64_t HD, const int GN,
                              const int NG, f32x8 s[PASS / 8][SCORE_HEADS]) {
    f32x8 acc[PASS / 8][SCORE_HEADS];
    for (int u = 0; u < NG; u++)
        for (int g = 0; g < GN; g++) acc[u][g] = f32x8_zero();
    for (int64_t d = 0; d < HD; d++)
        for (int g = 0; g < GN; g++) {
            const f32x8 qd = f32x8_bcast(qg + g * HD + d);
            for (int u = 0; u < NG; u++) acc[u][g] = f32x8_fma(qd, kt[u * HD + d], acc[u][g]);
        }
    for (int u = 0; u < NG; u++)
        for (int g = 0; g < GN; g++) s[u][g] = acc[u][g];
}

/* one group's scores s, scaled (and capped), for its nt (<= 8) tokens into p[0..nt), and
 * their running max into *vmax */
SIMD_INLINE void put_scores(f32x8 s, int64_t nt, float scale, float softcap, float *p,
                            f32x8 *vmax) {
    f32x8 sc = f32x8_mul(s, f32x8_set1(scale));
    float tmp[8];
    f32x8_store(tmp, sc);
    if (softcap > 0.f) {
        for (int t = 0; t < 8; t++) tmp[t] = cap(tmp[t], softcap);
        sc = f32x8_load(tmp);
    }
    if (nt == 8) {
        f32x8_store(p, sc);
        *vmax = f32x8_max(*vmax, sc);
        return;
    }
    for (int64_t t = 0; t < nt; t++) {
        p[t] = tmp[t];
        *vmax = f32x8_max(*vmax, f32x8_set1(tmp[t]));
    }
}

static inline __attribute__((always_inline)) void attend_avx2(
        const float *qh, float *o, const float *kbase, const float *vbase, const int64_t *table,
        int64_t t_begin, int64_t L, int64_t H, int64_t G, const int64_t HD, int64_t tok_stride,
        int64_t block_size, float scale, float softcap, float *p, int fetched, item_fetch *next) {
    /* H kv heads (adjacent in a token's row) and their H * G query heads; p: [H * G, n]. */
    const int64_t n = L - t_begin, HG = H * G;
    /* the next item's lines: a share per 8 x 8 transpose of K (below) */
    const int64_t steps = (n + PASS - 1) / PASS * H * (PASS / 8) * (HD / 8); /* transposes */
    const int64_t nper = (next->lines + steps - 1) / steps;
    f32x8 vmax[HG]; /* running max per query head */
    for (int64_t j = 0; j < HG; j++) vmax[j] = f32x8_set1(-INFINITY);
    /* Token rows are found block by block (a cursor, not a division per token): this
     * pass's, and the K rows ATTN_K_AHEAD tokens ahead that it fetches */
    token_cursor cur = cursor_at(table, t_begin, block_size, tok_stride);
    token_cursor ahead = cursor_at(table, t_begin + ATTN_K_AHEAD, block_size, tok_stride);
    const int64_t lpr = H * HD / LINE_FLOATS; /* cache lines per token row */
    for (int64_t t0 = 0; t0 < n; t0 += PASS) {
        const int64_t nt = n - t0 < PASS ? n - t0 : PASS, NG = (nt + 7) / 8;
        /* this pass's K rows, and its V rows (prefetched below) */
        const float *k[PASS], *pv[PASS];
        for (int64_t j = 0; j < PASS; j++) { /* a short last pass repeats its last token */
            const int64_t row = cursor_row(&cur);
            k[j] = kbase + row;
            pv[j] = vbase + row;
            if (j + 1 < nt) cursor_next(&cur);
        }
        cursor_next(&cur);
        /* Prefetch, spread over the transposes below (a burst overflows the miss buffers and
         * stalls): K rows ATTN_K_AHEAD tokens ahead, and this pass's V rows, which the
         * weighted sum reads after the whole score pass. A line cursor (row, line) walks
         * each list, so many lines a head. */
        const float *pk[PASS];
        int64_t npk = 0;
        for (int64_t j = t0 + ATTN_K_AHEAD; j < t0 + ATTN_K_AHEAD + PASS && j < n; j++) {
            pk[npk++] = kbase + cursor_row(&ahead);
            cursor_next(&ahead);
        }
        /* a share of each list per 8 x 8 transpose below */
        const int64_t pass_steps = H * NG * (HD / 8);
        const int64_t kper = fetched ? 0 : (npk * lpr + pass_steps - 1) / pass_steps;
        const int64_t vper = fetched ? 0 : (nt * lpr + pass_steps - 1) / pass_steps;
        int64_t kj = 0, kl = 0, vj = 0, vl = 0;
        for (int64_t hh = 0; hh < H; hh++) {
            f32x8 kt[PASS / 8 * HD]; /* group u's dimension d of kv head hh: kt[u * HD + d] */
            for (int64_t u = 0; u < NG; u++)
                for (int64_t d = 0; d < HD; d += 8) {
                    transpose8(k + 8 * u, hh * HD + d, kt + u * HD + d);
                    for (int64_t c = 0; c < kper && kj < npk; c++) {
                        PREFETCH(pk[kj] + kl * LINE_FLOATS, ATTN_K_HINT);
                        if (++kl == lpr) kl = 0, kj++;
                    }
                    for (int64_t c = 0; c < vper && vj < nt; c++) {
                        PREFETCH(pv[vj] + vl * LINE_FLOATS, ATTN_V_HINT);
                        if (++vl == lpr) vl = 0, vj++;
                    }
                    fetch_item_lines(next, nper);
                }
            for (int64_t g0 = 0; g0 < G; g0 += SCORE_HEADS) {
                const int64_t gn = G - g0 < SCORE_HEADS ? G - g0 : SCORE_HEADS;
                f32x8 s[PASS / 8][SCORE_HEADS];
                const float *qg = qh + (hh * G + g0) * HD;
                /* constant counts: the chains stay in registers */
#define SCORE_CASE(GN)                                                                      \
    case GN:                                                                                \
        if (NG == 2) score_chains(qg, kt, HD, GN, 2, s);                                    \
        else score_chains(qg, kt, HD, GN, 1, s);                                            \
        break;
                switch (gn) {
                    SCORE_CASE(1)
                    SCORE_CASE(2)
                    SCORE_CASE(3)
                    default:
                    SCORE_CASE(SCORE_HEADS)
                }
#undef SCORE_CASE
                for (int64_t j = 0; j < gn; j++) {
                    const int64_t hg = hh * G + g0 + j;
                    for (int64_t u = 0; u < NG; u++)
                        put_scores(s[u][j], nt - 8 * u < 8 ? nt - 8 * u : 8, scale, softcap,
                                   p + hg * n + t0 + 8 * u, &vmax[hg]);
                }
            }
        }
    }
    for (int64_t hg = 0; hg < HG; hg++) {
        float *pg = p + hg * n;
        const float mx = f32x8_hmax(vmax[hg]);
        const f32x8 inv = f32x8_set1(1.f / exp_shifted_sum(pg, n, mx));
        /* weighted sum of V, 64 dims at a time so the 8 accumulators stay in registers; the
         * first head's pass brings the rows into cache for the others */
        for (int64_t d0 = 0; d0 < HD; d0 += 64) {
            const int64_t nd = HD - d0 < 64 ? (HD - d0) / 8 : 8;
            f32x8 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = f32x8_zero();
            for (int64_t b0 = 0; b0 < n;) { /* block by block: one table lookup each */
                const int64_t off = (t_begin + b0) % block_size;
                const int64_t nb = block_size - off < n - b0 ? block_size - off : n - b0;
                const float *v = vbase + slot_of(table, t_begin + b0, block_size) * tok_stride
                                 + hg / G * HD + d0;
                for (int64_t t1 = 0; t1 < nb; t1++, v += tok_stride) {
                    const f32x8 w = f32x8_set1(pg[b0 + t1]);
                    for (int64_t j = 0; j < nd; j++)
                        acc[j] = f32x8_fma(w, f32x8_load(v + 8 * j), acc[j]);
                }
                b0 += nb;
            }
            for (int64_t j = 0; j < nd; j++)
                f32x8_store(o + hg * HD + d0 + 8 * j, f32x8_mul(acc[j], inv));
        }
    }
}

#endif
