/* Paged decode attention: each decoding sequence's one new query token attends to its
 * context (the last `window` tokens of it when window > 0), read where it lies in the blocks.
 *
 * Why C: gathering every context into a padded contiguous copy for torch's SDPA moves the
 * whole cache through memory twice per layer (write, read), and at long contexts that was most
 * of a decode step (docs/cpu-kernels.md). Here K and V are each read once.
 *
 * Layout: q/out rows [nh, hd] (unit stride within a row) at q + rows[i] * q_stride; k_cache and
 * v_cache [num_slots, kvh, hd] contiguous, slot = block * block_size + offset; tables int64
 * [n, table_stride] (block ids), lens int64 [n] (context length, the new token included: its
 * K/V are already written). Query head j reads kv head j / (nh / kvh) (grouped-query attention,
 * as transformers' repeat_kv). softcap > 0 caps each scaled score as softcap * tanh(s /
 * softcap) (Gemma 2). Work items are (sequence, kv head) pairs over OpenMP threads. Returns
 * 0, or -1 if scratch memory cannot be had.
 *
 * With AVX2 + FMA and a head size that is a multiple of 8 (every family we serve), scores are
 * computed 8 tokens at a time: eight independent multiply-add chains, one 8-float q chunk shared
 * by all, then one transposing horizontal-add tree turns the 8 partial vectors into 8 scores
 * (a per-token dot product with its own horizontal sum was latency-bound); exp is a vector
 * polynomial (relative error ~2e-7) instead of scalar expf.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../ops/simd.h"
#include "../../ops/tuning.h"
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#endif

static inline int64_t slot_of(const int64_t *table, int64_t t, int64_t block_size) {
    return table[t / block_size] * block_size + t % block_size;
}

static inline float cap(float s, float softcap) {
    return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

/* Generic path: any head size, any ISA. p holds one head's scores over the window. */
static void attend_scalar(const float *qh, float *o, const float *kbase, const float *vbase,
                          const int64_t *table, int64_t t_begin, int64_t L, int64_t G,
                          int64_t HD, int64_t tok_stride, int64_t block_size, float scale,
                          float softcap, float *p) {
    const int64_t n = L - t_begin;
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qh + g * HD;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t = 0; t < n; t++) {
            const float *k = kbase + slot_of(table, t_begin + t, block_size) * tok_stride;
            float s = 0.f;
            for (int64_t d = 0; d < HD; d++) s += qg[d] * k[d];
            s = cap(s * scale, softcap);
            p[t] = s;
            mx = s > mx ? s : mx;
        }
        for (int64_t t = 0; t < n; t++) sum += (p[t] = expf(p[t] - mx));
        float *og = o + g * HD;
        for (int64_t d = 0; d < HD; d++) og[d] = 0.f;
        for (int64_t t = 0; t < n; t++) {
            const float *v = vbase + slot_of(table, t_begin + t, block_size) * tok_stride;
            for (int64_t d = 0; d < HD; d++) og[d] += p[t] * v[d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < HD; d++) og[d] *= inv;
    }
}

#ifdef HAVE_AVX2
/* exp(x) for x <= 0 (scores minus their max): 2^n * poly(r), r = x - n ln2, |r| <= ln2 / 2. */
static inline f32x8 exp_neg(f32x8 x) {
    x = f32x8_max(x, f32x8_set1(-87.0f)); /* below: 2^n would leave the normals */
    const f32x8 n = f32x8_round(f32x8_mul(x, f32x8_set1(1.44269504f)));
    f32x8 r = f32x8_fnma(n, f32x8_set1(0.693145752f), x);
    r = f32x8_fnma(n, f32x8_set1(1.42860677e-6f), r);
    f32x8 y = f32x8_set1(1.f / 5040);
    y = f32x8_fma(y, r, f32x8_set1(1.f / 720));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 120));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 24));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 6));
    y = f32x8_fma(y, r, f32x8_set1(0.5f));
    y = f32x8_fma(y, r, f32x8_set1(1.f));
    y = f32x8_fma(y, r, f32x8_set1(1.f));
    return f32x8_mul(y, f32x8_exp2i(n));
}

static inline __attribute__((always_inline)) void attend_avx2(
        const float *qh, float *o, const float *kbase, const float *vbase, const int64_t *table,
        int64_t t_begin, int64_t L, int64_t H, int64_t G, const int64_t HD, int64_t tok_stride,
        int64_t block_size, float scale, float softcap, float *p) {
    /* H kv heads (adjacent in a token's row) and their H * G query heads; p: [H * G, n]. */
    const int64_t n = L - t_begin, HG = H * G;
    f32x8 vmax[HG]; /* running max per query head */
    for (int64_t j = 0; j < HG; j++) vmax[j] = f32x8_set1(-INFINITY);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t nt = n - t0 < 8 ? n - t0 : 8;
        const float *k[8], *pv[8]; /* this group's K rows, and its V rows (prefetched below) */
        for (int64_t j = 0; j < 8; j++) { /* a short last group repeats its last token */
            const int64_t row = slot_of(table, t_begin + t0 + (j < nt ? j : nt - 1), block_size)
                                * tok_stride;
            k[j] = kbase + row;
            pv[j] = vbase + row;
        }
        /* Prefetch, spread over the head loop below (a burst overflows the miss buffers and
         * is dropped): K rows ATTN_K_AHEAD tokens ahead, and this group's V rows, which the
         * weighted sum reads after the whole score pass */
        const float *pk[8];
        int64_t npk = 0;
        for (int64_t j = t0 + ATTN_K_AHEAD; j < t0 + ATTN_K_AHEAD + 8 && j < n; j++)
            pk[npk++] = kbase + slot_of(table, t_begin + j, block_size) * tok_stride;
        const int64_t lpr = H * HD / LINE_FLOATS, totk = npk * lpr, totv = nt * lpr;
        for (int64_t hg = 0; hg < HG; hg++) {
            for (int64_t li = hg * totk / HG; li < (hg + 1) * totk / HG; li++)
                PREFETCH(pk[li / lpr] + li % lpr * LINE_FLOATS, ATTN_K_HINT);
            for (int64_t li = hg * totv / HG; li < (hg + 1) * totv / HG; li++)
                PREFETCH(pv[li / lpr] + li % lpr * LINE_FLOATS, ATTN_V_HINT);
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
        float *pg = p + hg * n, m8[8], mx = -INFINITY;
        f32x8_store(m8, vmax[hg]);
        for (int j = 0; j < 8; j++) mx = m8[j] > mx ? m8[j] : mx;
        const f32x8 vmx = f32x8_set1(mx);
        f32x8 vsum = f32x8_zero();
        int64_t t = 0;
        for (; t + 8 <= n; t += 8) {
            const f32x8 e = exp_neg(f32x8_sub(f32x8_load(pg + t), vmx));
            f32x8_store(pg + t, e);
            vsum = f32x8_add(vsum, e);
        }
        float s8[8], sum = 0.f;
        f32x8_store(s8, vsum);
        for (int j = 0; j < 8; j++) sum += s8[j];
        for (; t < n; t++) sum += (pg[t] = expf(pg[t] - mx));
        const f32x8 inv = f32x8_set1(1.f / sum);
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

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *rows, *tables, *lens;
    float *out;
    int64_t q_stride, out_stride, table_stride, n, nh, kvh, hd, block_size, window;
    int64_t max_len, H, items;
    float scale, softcap;
} attn_call_t;

static attn_call_t attn_call(const float *q, int64_t q_stride, const int64_t *rows, float *out,
                             int64_t out_stride, const float *k_cache, const float *v_cache,
                             const int64_t *tables, int64_t table_stride, const int64_t *lens,
                             int64_t n, int64_t nh, int64_t kvh, int64_t hd,
                             int64_t block_size, float scale, int64_t window, float softcap,
                             int nthreads) {
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    if (window > 0 && window < max_len) max_len = window;
    /* A work item takes all kv heads of a sequence when there are enough sequences to share
     * out: a token's row of every head is then read whole (the hardware fetches neighbouring
     * lines anyway; reading one head's slice per pass fetched the row kvh times). */
    const int64_t H = n >= ATTN_SEQS_PER_THREAD * (int64_t)nthreads ? kvh : 1;
    return (attn_call_t){.q = q, .k_cache = k_cache, .v_cache = v_cache, .rows = rows,
                         .tables = tables, .lens = lens, .out = out, .q_stride = q_stride,
                         .out_stride = out_stride, .table_stride = table_stride, .n = n,
                         .nh = nh, .kvh = kvh, .hd = hd, .block_size = block_size,
                         .window = window, .max_len = max_len, .H = H, .items = n * (kvh / H),
                         .scale = scale, .softcap = softcap};
}

/* One thread's part of the work items: inside a parallel region, an orphaned work-sharing
 * loop over the calling team (ending in its barrier); outside one, all of them. Sets *failed
 * where its scratch cannot be had. */
static void attend_items(const attn_call_t *c, int *failed) {
    const int64_t G = c->nh / c->kvh, tok_stride = c->kvh * c->hd, H = c->H, hd = c->hd;
    float *p = malloc(sizeof(float) * (size_t)(c->max_len * G * H)); /* [H * G, window] */
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < c->items; w++) {
        if (!p) continue;
        const int64_t i = w / (c->kvh / H), h = w % (c->kvh / H) * H, L = c->lens[i];
        const int64_t t_begin = c->window > 0 && L > c->window ? L - c->window : 0;
        const float *qh = c->q + c->rows[i] * c->q_stride + h * G * hd; /* H * G query heads */
        float *o = c->out + c->rows[i] * c->out_stride + h * G * hd;
        const float *kb = c->k_cache + h * hd, *vb = c->v_cache + h * hd;
        const int64_t *table = c->tables + i * c->table_stride, bs = c->block_size;
#ifdef HAVE_AVX2
        if (hd == 64)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, G, 64, tok_stride, bs, c->scale,
                        c->softcap, p);
        else if (hd == 128)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, G, 128, tok_stride, bs, c->scale,
                        c->softcap, p);
        else if (hd % 8 == 0)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, G, hd, tok_stride, bs, c->scale,
                        c->softcap, p);
        else
#endif
            for (int64_t j = 0; j < H; j++)
                attend_scalar(qh + j * G * hd, o + j * G * hd, kb + j * hd, vb + j * hd, table,
                              t_begin, L, G, hd, tok_stride, bs, c->scale, c->softcap, p);
    }
    free(p);
}

int paged_decode_attention(const float *q, int64_t q_stride, const int64_t *rows, float *out,
                           int64_t out_stride, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens,
                           int64_t n, int64_t nh, int64_t kvh, int64_t hd, int64_t block_size,
                           float scale, int64_t window, float softcap, int nthreads) {
    const attn_call_t c = attn_call(q, q_stride, rows, out, out_stride, k_cache, v_cache,
                                    tables, table_stride, lens, n, nh, kvh, hd, block_size,
                                    scale, window, softcap, nthreads);
    int failed = 0;
    /* A batch-1 step's few hundred dot products are not worth waking a thread team for. */
    const int parallel = n * kvh * c.max_len * hd >= ATTN_PARALLEL_MIN;
#pragma omp parallel num_threads(nthreads) if (parallel)
    attend_items(&c, &failed);
    return failed ? -1 : 0;
}

/* paged_decode_attention for a caller whose every thread of one OpenMP team calls it with
 * the same arguments (model/native_decode.c): the work items are shared out over that team,
 * and every thread returns after all are done. `failed` is one int shared by the team,
 * zero before the call; -1 where any thread's scratch could not be had. */
int paged_decode_attention_team(const float *q, int64_t q_stride, const int64_t *rows,
                                float *out, int64_t out_stride, const float *k_cache,
                                const float *v_cache, const int64_t *tables,
                                int64_t table_stride, const int64_t *lens, int64_t n,
                                int64_t nh, int64_t kvh, int64_t hd, int64_t block_size,
                                float scale, int64_t window, float softcap, int nthreads,
                                int *failed) {
    const attn_call_t c = attn_call(q, q_stride, rows, out, out_stride, k_cache, v_cache,
                                    tables, table_stride, lens, n, nh, kvh, hd, block_size,
                                    scale, window, softcap, nthreads);
    attend_items(&c, failed);
    int any;
#pragma omp atomic read
    any = *failed;
    return any ? -1 : 0;
}
