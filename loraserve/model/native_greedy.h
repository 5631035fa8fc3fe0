/* Runs of greedy decode steps in one call, over model/native_decode.c's layer loop (whose
 * static functions it calls: included by native_decode.c alone, after them).
 */
#ifndef LORASERVE_NATIVE_GREEDY_H
#define LORASERVE_NATIVE_GREEDY_H

/* The first maximum of x[0..n) (NaN counting as the maximum: the first NaN where there is
 * one): its index, with the value and whether it is a NaN. numpy's argmax, which the sampler
 * takes for greedy rows. Two passes, each one the compiler vectorizes: the maximum (and
 * whether any NaN), then the first index that holds it. */
typedef struct {
    int64_t index;
    float top;
    int nan;
} row_max_t;

static row_max_t first_max(const float *x, int64_t n) {
    float top = x[0];
    int any_nan = 0;
    for (int64_t i = 0; i < n; i++) {
        top = x[i] > top ? x[i] : top;
        any_nan |= x[i] != x[i];
    }
    for (int64_t i = 0; i < n; i++)
        if (any_nan ? x[i] != x[i] : x[i] == top) return (row_max_t){i, x[i], any_nan};
    return (row_max_t){0, x[0], 0};
}

/* The first column of part t of n consecutive parts of a row of `vocab` columns */
static int64_t part_begin(int64_t vocab, int t, int n) { return vocab * t / n; }

/* The row's first maximum from the first maxima of its n parts (parts[t] over the columns
 * from part_begin(vocab, t, n)): the first part holding a NaN, else the first part whose
 * maximum none after it exceeds. */
static int64_t join_maxima(const row_max_t *parts, int64_t vocab, int n) {
    int best = 0;
    for (int t = 0; t < n; t++) {
        if (parts[t].nan) return part_begin(vocab, t, n) + parts[t].index;
        if (parts[t].top > parts[best].top) best = t;
    }
    return part_begin(vocab, best, n) + parts[best].index;
}

/* What turns the last layer's residual stream into the next token: the final norm, lm_head
 * (a projection as above) and the embedding table the next step reads its input rows from */
typedef struct {
    projection_t head;
    const float *final_norm; /* [d] */
    const float *embed;      /* [rows, d], the family's scale applied */
} greedy_head_t;

/* One greedy step whose layers run in one team (native_decode_in_team), the final norm,
 * lm_head and the first maxima in that team too, every thread on its share: the norm as the
 * layers' element-wise kernels (every row itself at TEAM_OWN_ROWS_MAX rows or fewer, from its
 * own residual stream), lm_head through its team_fn, and each row's first maximum over the
 * columns a thread's share of lm_head just wrote, joined on the first thread. Why: at batch 1
 * the maximum over a 49,152-word vocabulary on one thread, with the other waiting, and the
 * team lm_head started of its own cost a noticeable part of a token. The same kernels on the
 * same rows, so the same logits and tokens. `parts` holds nthreads * B row maxima. Returns as
 * native_decode_greedy. */
static int greedy_step_in_team(const model_t *m, const layer_t *layers, int64_t n_layers,
                               const greedy_head_t *g, int64_t B, int64_t *next_ids,
                               const int64_t *positions, const int64_t *slots,
                               const int64_t *rows, const int64_t *tables,
                               int64_t table_stride, const int64_t *lens, float *h,
                               float *logits, float *scratch, void *work, int64_t work_stride,
                               int nthreads, row_max_t *parts) {
    const int64_t d = m->d, vocab = g->head.n;
    int attention_failed = 0, rc = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const step_buffers_t s = buffers(m, B, scratch, work, work_stride, 1);
        int mine = run_layers(m, layers, n_layers, h, B, positions, slots, rows, tables,
                              table_stride, lens, &s, nthreads, 1, &attention_failed, NULL,
                              NULL);
        int64_t r0, r1;
        my_rows(B, &r0, &r1);
        if (!mine) {
            if (s.own) {
                m->rms_norm(s.h, d, g->final_norm, s.x, d, B, d, m->eps, nthreads);
            } else {
                m->rms_norm(h + r0 * d, d, g->final_norm, s.x + r0 * d, d, r1 - r0, d, m->eps,
                            nthreads);
#pragma omp barrier
            }
            if (project(&g->head, 1, s.x, d, B, logits, s.work, nthreads))
                mine = (int)n_layers + 1;
        }
        if (!mine) {
            const int me = omp_get_thread_num(), n = omp_get_num_threads();
            const int64_t c0 = part_begin(vocab, me, n), c1 = part_begin(vocab, me + 1, n);
            for (int64_t r = 0; r < B; r++)
                parts[r * n + me] = first_max(logits + r * vocab + c0, c1 - c0);
        }
#pragma omp barrier
#pragma omp master
        {
            const int n = omp_get_num_threads();
            rc = mine;
            for (int64_t r = 0; !rc && r < B; r++)
                next_ids[r] = join_maxima(parts + r * n, vocab, n);
        }
    }
    return rc;
}

/* `steps` decode steps of B greedy rows: each step's rows are embedded from ids[k] (ids is
 * [steps + 1][B]: the first row in, the tokens out), run through every layer (native_decode),
 * normed, projected to logits [B, vocab] and their first maxima written to ids[k + 1].
 * positions, slots and lens are [steps][B]: step k's, the tables hold every step's blocks;
 * lora and lora_t as native_decode's, the same every step (the rows' adapters do not change).
 * A step whose layers run in one team (no adapters, few rows) takes its norm, lm_head and
 * maxima in it (greedy_step_in_team). Returns 0, a 1-based layer as native_decode does, or
 * n_layers + 1 where lm_head refused. */
int native_decode_greedy(const model_t *m, const layer_t *layers, int64_t n_layers,
                         const greedy_head_t *g, int64_t steps, int64_t B, int64_t *ids,
                         const int64_t *positions, const int64_t *slots, const int64_t *rows,
                         const int64_t *tables, int64_t table_stride, const int64_t *lens,
                         float *h, float *normed, float *logits, float *scratch, void *work,
                         int64_t work_stride, int nthreads, const lora_step_t *lora,
                         float *lora_t) {
    const int64_t d = m->d, vocab = g->head.n;
    const int in_team = !lora && g->head.team_fn
                        && native_decode_in_team(m, layers, n_layers, B, nthreads);
    row_max_t *parts = in_team ? malloc(sizeof(row_max_t) * (size_t)(nthreads * B)) : NULL;
    if (in_team && !parts) return (int)n_layers + 1;
    int rc = 0;
    for (int64_t k = 0; !rc && k < steps; k++) {
        for (int64_t r = 0; r < B; r++)
            memcpy(h + r * d, g->embed + ids[k * B + r] * d, 4 * d);
        if (in_team) {
            rc = greedy_step_in_team(m, layers, n_layers, g, B, ids + (k + 1) * B,
                                     positions + k * B, slots + k * B, rows, tables,
                                     table_stride, lens + k * B, h, logits, scratch, work,
                                     work_stride, nthreads, parts);
            continue;
        }
        rc = native_decode(m, layers, n_layers, h, B, positions + k * B, slots + k * B, rows,
                           tables, table_stride, lens + k * B, scratch, work, work_stride,
                           nthreads, lora, lora_t);
        if (rc) break;
        m->rms_norm(h, d, g->final_norm, normed, d, B, d, m->eps, nthreads);
        if (project(&g->head, 0, normed, d, B, logits, work, nthreads)) {
            rc = (int)n_layers + 1;
            break;
        }
        for (int64_t r = 0; r < B; r++)
            ids[(k + 1) * B + r] = first_max(logits + r * vocab, vocab).index;
    }
    free(parts);
    return rc;
}

#endif
