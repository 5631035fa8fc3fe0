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
 * softcap) (Gemma 2). Work items are (sequence, kv head) pairs (query heads when there are
 * few); each OpenMP thread takes a contiguous range of them and fetches its next item's rows
 * into L2 while it runs this one (docs/cpu-kernels.md). Returns 0, or -1 if scratch memory
 * cannot be had.
 *
 * With AVX2 + FMA and a head size that is a multiple of 8 (every family we serve), scores are
 * computed 16 tokens at a time, a token to a lane: K transposed 8 x 8 in registers, and per
 * token one multiply-add chain over the head's dimensions, as the prompt kernel
 * (prefill_attention.c) sums a score, so a token attended by either kernel gets the same bits
 * (its softmax and weighted sum of V already ran in the same order in both); several query
 * heads and two groups of 8 tokens at once keep enough chains in flight. exp is a vector
 * polynomial (relative error ~2e-7) instead of scalar expf.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../ops/simd.h"
#include "../../ops/tuning.h"
#include "paged_rows.h"

/* softcap > 0: a scaled score capped to softcap * tanh(s / softcap) (both paths) */
static inline float cap(float s, float softcap) {
    return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}

#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#include "paged_attend_avx2.h"
#endif

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

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *rows, *tables, *lens;
    float *out;
    int64_t q_stride, out_stride, table_stride, n, nh, kvh, hd, block_size, window;
    int64_t max_len, H, per_seq, items; /* per_seq: work items a sequence is split into */
    int split; /* items are query heads, not kv heads (few sequences) */
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
    /* With fewer (sequence, kv head) items than ATTN_SEQS_PER_THREAD a thread, whole kv
     * heads share out unevenly (a batch-1 step's 3 kv heads on 2 threads: 2 to 1), so the
     * items are query heads: a thread takes a contiguous run of them, and runs that share
     * a kv head go through the kernel together, each K row read once per run. */
    const int split = H == 1 && nh > kvh && n * kvh < ATTN_SEQS_PER_THREAD * (int64_t)nthreads;
    const int64_t per_seq = split ? nh : kvh / H;
    return (attn_call_t){.q = q, .k_cache = k_cache, .v_cache = v_cache, .rows = rows,
                         .tables = tables, .lens = lens, .out = out, .q_stride = q_stride,
                         .out_stride = out_stride, .table_stride = table_stride, .n = n,
                         .nh = nh, .kvh = kvh, .hd = hd, .block_size = block_size,
                         .window = window, .max_len = max_len, .H = H, .per_seq = per_seq,
                         .items = n * per_seq, .split = split, .scale = scale, .softcap = softcap};
}

/* Work item w: its sequence's context [t_begin, L) and its first kv head (split: its query
 * head). */
typedef struct {
    int64_t i, h, L, t_begin;
} item_t;

static inline item_t item_of(const attn_call_t *c, int64_t w) {
    const int64_t i = w / c->per_seq, L = c->lens[i];
    return (item_t){i, w % c->per_seq * (c->split ? 1 : c->H), L,
                    c->window > 0 && L > c->window ? L - c->window : 0};
}

/* This thread's items [*w0, *w1): a contiguous range, of about equal context length per thread
 * (item w goes to the thread whose share holds the middle of its tokens), so that a thread
 * knows the item it runs next and can fetch it while it runs this one. */
static void my_items(const attn_call_t *c, int64_t *w0, int64_t *w1) {
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
    int64_t total = 0, before = 0;
    for (int64_t w = 0; w < c->items; w++) {
        const item_t it = item_of(c, w);
        total += it.L - it.t_begin;
    }
    *w0 = *w1 = 0;
    for (int64_t w = 0; w < c->items; w++) {
        const item_t it = item_of(c, w);
        const int64_t len = it.L - it.t_begin;
        const int64_t owner = total ? (2 * before + len) * team / (2 * total) : 0;
        if (owner < me) *w0 = w + 1;
        if (owner <= me) *w1 = w + 1;
        before += len;
    }
    if (*w1 < *w0) *w1 = *w0;
}

/* One thread's part of the work items: inside a parallel region, its share of the calling
 * team's (then the team's barrier); outside one, all of them. Sets *failed where its scratch
 * cannot be had. */
static void attend_items(const attn_call_t *c, int *failed) {
    const int64_t G = c->nh / c->kvh, tok_stride = c->kvh * c->hd, H = c->H, hd = c->hd;
    const int64_t bs = c->block_size, lpr = H * hd / LINE_FLOATS;
    const int64_t cap_lines = ATTN_NEXT_ITEM_KB * 1024 / (LINE_FLOATS * 4);
    float *p = malloc(sizeof(float) * (size_t)(c->max_len * G * H)); /* [H * G, window] */
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    int64_t w0, w1;
    my_items(c, &w0, &w1);
    int fetched = 0; /* this item fetched whole by the one before it: no fetches of its own */
    for (int64_t w = w0, run; p && w < w1; w += run) {
        const item_t it = item_of(c, w);
        const int64_t i = it.i, L = it.L, t_begin = it.t_begin;
        /* split: this run of query heads of one kv head (Gr of them) as one item */
        int64_t Gr = G, h = it.h, q0 = it.h * G;
        run = 1;
        if (c->split) {
            while (w + run < w1 && (it.h + run) % c->nh && (it.h + run) / G == it.h / G) run++;
            Gr = run, h = it.h / G, q0 = it.h;
        }
        const float *qh = c->q + c->rows[i] * c->q_stride + q0 * hd; /* H * Gr query heads */
        float *o = c->out + c->rows[i] * c->out_stride + q0 * hd;
        const float *kb = c->k_cache + h * hd, *vb = c->v_cache + h * hd;
        const int64_t *table = c->tables + i * c->table_stride;
        item_fetch next = {.lines = 0};
        int next_whole = 0;
        if (w + run < w1 && !c->split) {
            const item_t nx = item_of(c, w + 1);
            const int64_t lines = (nx.L - nx.t_begin) * 2 * lpr;
            next = (item_fetch){cursor_at(c->tables + nx.i * c->table_stride, nx.t_begin, bs,
                                          tok_stride),
                                c->k_cache + nx.h * hd, c->v_cache + nx.h * hd, lpr, 0,
                                lines < cap_lines ? lines : cap_lines};
            next_whole = lines <= cap_lines;
        }
#ifdef HAVE_AVX2
        if (hd == 64)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, Gr, 64, tok_stride, bs, c->scale,
                        c->softcap, p, fetched, &next);
        else if (hd == 128)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, Gr, 128, tok_stride, bs, c->scale,
                        c->softcap, p, fetched, &next);
        else if (hd % 8 == 0)
            attend_avx2(qh, o, kb, vb, table, t_begin, L, H, Gr, hd, tok_stride, bs, c->scale,
                        c->softcap, p, fetched, &next);
        else
#endif
            for (int64_t j = 0; j < H; j++)
                attend_scalar(qh + j * Gr * hd, o + j * Gr * hd, kb + j * hd, vb + j * hd,
                              table, t_begin, L, Gr, hd, tok_stride, bs, c->scale, c->softcap,
                              p);
        fetched = next_whole;
    }
    free(p);
#pragma omp barrier
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
