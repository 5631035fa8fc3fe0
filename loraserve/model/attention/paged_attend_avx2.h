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

static inline __attribute__((always_inline)) void attend_avx2(
        const float *qh, float *o, const float *kbase, const float *vbase, const int64_t *table,
        int64_t t_begin, int64_t L, int64_t H, int64_t G, const int64_t HD, int64_t tok_stride,
        int64_t block_size, float scale, float softcap, float *p, int fetched, item_fetch *next) {
    /* H kv heads (adjacent in a token's row) and their H * G query heads; p: [H * G, n]. */
    const int64_t n = L - t_begin, HG = H * G;
    /* the next item's lines: a share per head of every 8-token group */
    const int64_t nper = (next->lines + (n + 7) / 8 * HG - 1) / ((n + 7) / 8 * HG);
    f32x8 vmax[HG]; /* running max per query head */
    for (int64_t j = 0; j < HG; j++) vmax[j] = f32x8_set1(-INFINITY);
    /* Token rows are found block by block (a cursor, not a division per token): this
     * group's, and the K rows ATTN_K_AHEAD tokens ahead that it fetches */
    token_cursor cur = cursor_at(table, t_begin, block_size, tok_stride);
    token_cursor ahead = cursor_at(table, t_begin + ATTN_K_AHEAD, block_size, tok_stride);
    const int64_t lpr = H * HD / LINE_FLOATS; /* cache lines per token row */
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t nt = n - t0 < 8 ? n - t0 : 8;
        const float *k[8], *pv[8]; /* this group's K rows, and its V rows (prefetched below) */
        for (int64_t j = 0; j < 8; j++) { /* a short last group repeats its last token */
            const int64_t row = cursor_row(&cur);
            k[j] = kbase + row;
            pv[j] = vbase + row;
            if (j + 1 < nt) cursor_next(&cur);
        }
        cursor_next(&cur);
        /* Prefetch, spread over the head loop below (a burst overflows the miss buffers and
         * is dropped): K rows ATTN_K_AHEAD tokens ahead, and this group's V rows, which the
         * weighted sum reads after the whole score pass. A line cursor (row, line) walks
         * each list, so many lines a head. */
        const float *pk[8];
        int64_t npk = 0;
        for (int64_t j = t0 + ATTN_K_AHEAD; j < t0 + ATTN_K_AHEAD + 8 && j < n; j++) {
            pk[npk++] = kbase + cursor_row(&ahead);
            cursor_next(&ahead);
        }
        const int64_t kper = fetched ? 0 : (npk * lpr + HG - 1) / HG;
        const int64_t vper = fetched ? 0 : (nt * lpr + HG - 1) / HG;
        int64_t kj = 0, kl = 0, vj = 0, vl = 0;
        for (int64_t hg = 0; hg < HG; hg++) {
            for (int64_t c = 0; c < kper && kj < npk; c++) {
                PREFETCH(pk[kj] + kl * LINE_FLOATS, ATTN_K_HINT);
                if (++kl == lpr) kl = 0, kj++;
            }
            for (int64_t c = 0; c < vper && vj < nt; c++) {
                PREFETCH(pv[vj] + vl * LINE_FLOATS, ATTN_V_HINT);
                if (++vl == lpr) vl = 0, vj++;
            }
            fetch_item_lines(next, nper);
            const float *qg = qh + hg * HD;
            const int64_t koff = hg / G * HD; /* this query head's kv head in the row */
            f32x8 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = f32x8_zero();
            for (int64_t d = 0; d < HD; d += 8) {
                const f32x8 qd = f32x8_load(qg + d);
                for (int j = 0; j < 8; j++)
                    acc[j] = f32x8_fma(qd, f32x8_load(k[j] + koff + d), acc[j]);
            }
            f32x8 s = f32x8_mul(f32x8_hsums(acc), f32x8_set1(scale));
            float tmp[8];
            f32x8_store(tmp, s);
            if (softcap > 0.f) {
                for (int j = 0; j < 8; j++) tmp[j] = cap(tmp[j], softcap);
                s = f32x8_load(tmp);
            }
            if (nt == 8) {
                f32x8_store(p + hg * n + t0, s);
                vmax[hg] = f32x8_max(vmax[hg], s);
            } else {
                for (int64_t j = 0; j < nt; j++) {
                    p[hg * n + t0 + j] = tmp[j];
                    vmax[hg] = f32x8_max(vmax[hg], f32x8_set1(tmp[j]));
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
