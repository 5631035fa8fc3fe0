/* Paged decode attention: each decoding sequence's one new query token attends to its whole
 * context, read where it lies in the KV blocks.
 *
 * Why C: gathering every context into a padded contiguous copy for torch's SDPA moved the
 * whole cache through memory twice per layer (write, read) and ran at ~4 GB/s; at 128
 * sequences x 576 tokens it was 60% of a decode step. Here K and V are each read once.
 *
 * Layout: q/out rows [nh, hd] (unit stride within a row) at q + rows[i] * q_stride; k_cache and
 * v_cache [num_slots, kvh, hd] contiguous, slot = block * block_size + offset; tables int64
 * [n, table_stride] (block ids), lens int64 [n] (context length, the new token included: its
 * K/V are already written). Query head j reads kv head j / (nh / kvh) (grouped-query attention,
 * as transformers' repeat_kv). Work items are (sequence, kv head) pairs over OpenMP threads;
 * each computes the scores of its nh / kvh query heads in one pass over K, a softmax, then
 * one pass over V. Returns 0, or -1 if scratch memory cannot be had.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));

static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }

static inline float dot(const float *a, const float *b, int64_t n) {
    v8 acc = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) acc += ld8(a + d) * ld8(b + d);
    float s = acc[0] + acc[1] + acc[2] + acc[3] + acc[4] + acc[5] + acc[6] + acc[7];
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* One (sequence, kv head) work item: its G query heads over the L context tokens. Inlined with
 * a constant HD for the common head sizes, so the loops over d unroll and each head's
 * accumulator stays in registers; head by head (g outer), K and V rows come from L1/L2. */
static inline __attribute__((always_inline)) void attend(
        const float *qh, float *o, const float *kbase, const float *vbase, const int64_t *table,
        int64_t L, int64_t G, const int64_t HD, int64_t tok_stride, int64_t block_size,
        float scale, float *p) {
    for (int64_t g = 0; g < G; g++) {
        const float *qg = qh + g * HD;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t t0 = 0; t0 < L; t0 += block_size) { /* scores, block by block */
            const int64_t nt = L - t0 < block_size ? L - t0 : block_size;
            const float *k = kbase + table[t0 / block_size] * block_size * tok_stride;
            for (int64_t t = 0; t < nt; t++, k += tok_stride) {
                const float s = dot(qg, k, HD) * scale;
                p[t0 + t] = s;
                mx = s > mx ? s : mx;
            }
        }
        for (int64_t t = 0; t < L; t++) sum += (p[t] = expf(p[t] - mx)); /* unnormalised */
        float acc[HD];
        for (int64_t d = 0; d < HD; d++) acc[d] = 0.f;
        for (int64_t t0 = 0; t0 < L; t0 += block_size) { /* weighted sum of V */
            const int64_t nt = L - t0 < block_size ? L - t0 : block_size;
            const float *v = vbase + table[t0 / block_size] * block_size * tok_stride;
            for (int64_t t = 0; t < nt; t++, v += tok_stride) {
                const float w = p[t0 + t];
                for (int64_t d = 0; d < HD; d++) acc[d] += w * v[d];
            }
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < HD; d++) o[g * HD + d] = acc[d] * inv;
    }
}

int paged_decode_attention(const float *q, int64_t q_stride, const int64_t *rows, float *out,
                           int64_t out_stride, const float *k_cache, const float *v_cache,
                           const int64_t *tables, int64_t table_stride, const int64_t *lens,
                           int64_t n, int64_t nh, int64_t kvh, int64_t hd, int64_t block_size,
                           float scale, int nthreads) {
    const int64_t G = nh / kvh, tok_stride = kvh * hd;
    int64_t max_len = 0;
    for (int64_t i = 0; i < n; i++) max_len = lens[i] > max_len ? lens[i] : max_len;
    int failed = 0;
    /* A batch-1 step's few hundred dot products are not worth waking a thread team for. */
    const int parallel = n * kvh * max_len * hd >= (1 << 17);
#pragma omp parallel num_threads(nthreads) if (parallel)
    {
        float *p = malloc(sizeof(float) * (size_t)max_len); /* one head's scores */
        if (!p) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < n * kvh; w++) {
            if (!p) continue;
            const int64_t i = w / kvh, h = w % kvh;
            const float *qh = q + rows[i] * q_stride + h * G * hd; /* its G query heads */
            float *o = out + rows[i] * out_stride + h * G * hd;
            const float *kb = k_cache + h * hd, *vb = v_cache + h * hd;
            const int64_t *table = tables + i * table_stride;
            if (hd == 64)
                attend(qh, o, kb, vb, table, lens[i], G, 64, tok_stride, block_size, scale, p);
            else if (hd == 128)
                attend(qh, o, kb, vb, table, lens[i], G, 128, tok_stride, block_size, scale, p);
            else
                attend(qh, o, kb, vb, table, lens[i], G, hd, tok_stride, block_size, scale, p);
        }
        free(p);
    }
    return failed ? -1 : 0;
}
