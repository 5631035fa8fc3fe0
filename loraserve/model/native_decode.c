/* Every decoder layer of a decode-only step in one call: the same kernels the model's Python
 * loop calls one by one (the float32 or quantized GEMM, ops/fused_cpu.c's norms, rope and
 * silu, the paged decode attention), called here in the same order on the same buffers.
 *
 * Why: at batch 1 a layer's projections are a few tens of microseconds of weight streaming,
 * and the loop around them (a dozen torch dispatches, ctypes calls and allocations a layer)
 * cost about as much again (docs/cpu-kernels.md). Here a layer costs its kernels only.
 *
 * Why function pointers, not the kernels' code: each kernel stays the one compiled object the
 * Python loop calls, with its own build flags (fused_cpu.c rounds as torch does under
 * -ffp-contract=off, the GEMMs are built with contraction), so a row's result is bit for bit
 * the same whichever path its step took. The caller (native_decode.py) checks the shapes.
 *
 * Rows: B decode tokens, rows 0..B-1 of every buffer (unit stride, row strides as below).
 *
 * Adapters: where the step has LoRA rows, each projection is followed by the LoRA kernel
 * (lora/sgmv_cpu.c's lora_sgmv) on its group, as the Python loop's backend calls it after a
 * quantized projection; native_decode.py takes such steps only over quantized projections
 * (float32 panels there take the fused decode op instead).
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../ops/tuning.h" /* ELEMWISE_PARALLEL_MIN, TEAM_OWN_ROWS_MAX */
#include "native_decode.h"

/* Scratch floats of B rows: the buffers the threads share (q/k/v, the attention's output, a
 * projection's output of width d, gate/up), then each thread's own (its residual stream, the
 * norm's output, the MLP's product), where every thread computes these on all the rows (see
 * run_layers); otherwise the first thread's are everyone's. */
static int64_t shared_floats(const model_t *m, int64_t B) {
    return B * ((m->nh + 2 * m->kvh) * m->hd + m->nh * m->hd + m->d + 2 * m->inter);
}
static int64_t own_floats(const model_t *m, int64_t B) { return B * (2 * m->d + m->inter); }

/* Scratch floats for B rows on nthreads threads (native_decode.py allocates it; the GEMMs'
 * own work is `work`, work_stride bytes a thread). */
int64_t native_decode_scratch_floats(const model_t *m, int64_t B, int nthreads) {
    return shared_floats(m, B) + (nthreads > 1 ? nthreads : 1) * own_floats(m, B);
}

/* in_team: called by every thread of one team (the projection's team_fn, team_fits says) */
static int project(const projection_t *p, int in_team, const float *x, int64_t ldx, int64_t B,
                   float *y, void *work, int nthreads) {
    if (in_team)
        return p->team_fn((int)p->kind, x, ldx, B, p->k, p->w, p->w2, p->w3, p->n, y, p->n,
                          work, nthreads);
    if (p->kind == KIND_F32_PANELS) {
        ((gemm_f32_fn)(void *)p->fn)(x, ldx, (const float *)p->w, B, p->n, p->k, y, p->n,
                                     nthreads);
        return 0;
    }
    return p->fn((int)p->kind, x, ldx, B, p->k, p->w, p->w2, p->w3, p->n, y, p->n, work,
                 nthreads);
}

/* y += group g's LoRA deltas of layer li (no-op without adapters there); nonzero: refused */
static int add_lora(const lora_step_t *lora, float *lora_t, int64_t li, int g, const float *x,
                    int64_t ldx, float *y, int64_t ldy, int nthreads) {
    if (!lora || !lora->groups[g].nsegs) return 0;
    const lora_group_t *G = &lora->groups[g];
    return lora->fn(x, ldx, y, ldy, lora->tables[li][g][0], G->a_slot, G->d_in,
                    lora->tables[li][g][1], G->b_slot, G->segs, G->nsegs, G->parts, G->nparts,
                    lora_t, lora->ldt, lora->tile, nthreads);
}

/* the projection, then its group's LoRA deltas */
static int project_lora(const projection_t *p, int in_team, const lora_step_t *lora,
                        float *lora_t, int64_t li, int g, const float *x, int64_t ldx,
                        int64_t B, float *y, void *work, int nthreads) {
    return project(p, in_team, x, ldx, B, y, work, nthreads)
        || add_lora(lora, lora_t, li, g, x, ldx, y, p->n, nthreads);
}

/* The step in one OpenMP team: every thread runs the layer loop, the GEMMs and the attention
 * share their work out over the team (their _team entry points), and the element-wise kernels
 * and the K/V write take a share of the rows each. Why: at batch 1 a layer's kernels are a few
 * microseconds each, and starting and joining a team per kernel (five a layer) cost a
 * noticeable part of them; a barrier between two threads of a running team costs less. Taken
 * only where every element-wise kernel runs on one thread anyway (few rows), so each kernel
 * computes what it computes with a team of its own, bit for bit. */
static int team_fits(const model_t *m, const layer_t *layers, int64_t n_layers, int64_t B) {
    if (!m->attention_team) return 0;
    const int64_t widest = m->inter > (m->nh + m->kvh) * m->hd ? m->inter
                                                                : (m->nh + m->kvh) * m->hd;
    if (B * (widest > m->d ? widest : m->d) >= ELEMWISE_PARALLEL_MIN) return 0;
    for (int64_t li = 0; li < n_layers; li++) {
        const layer_t *L = &layers[li];
        if (!L->qkv.team_fn || !L->o.team_fn || !L->gate_up.team_fn || !L->down.team_fn)
            return 0;
    }
    return 1;
}

/* Whether a step of B rows on nthreads threads runs in one team (native_decode.py asks, for
 * its tests and benchmarks). */
int native_decode_in_team(const model_t *m, const layer_t *layers, int64_t n_layers, int64_t B,
                          int nthreads) {
    return nthreads > 1 && team_fits(m, layers, n_layers, B);
}

/* Scratch row pointers of one step, as one thread sees them: the shared buffers (qkv, a, o,
 * gu) and h, x, mlp and its GEMMs' work: its own where `own` (a thread of a team computing
 * every row itself, up to TEAM_OWN_ROWS_MAX rows: run_layers), else the first thread's. */
typedef struct {
    float *qkv, *a, *o, *gu, *h, *x, *mlp;
    void *work;
    int64_t q_size, kv_size, ld_qkv;
    int own;
} step_buffers_t;

static step_buffers_t buffers(const model_t *m, int64_t B, float *scratch, void *work,
                              int64_t work_stride, int in_team) {
    step_buffers_t s = {.q_size = m->nh * m->hd, .kv_size = m->kvh * m->hd,
                        .own = in_team && B <= TEAM_OWN_ROWS_MAX};
    const int me = s.own ? omp_get_thread_num() : 0;
    s.ld_qkv = s.q_size + 2 * s.kv_size;
    s.qkv = scratch;
    s.a = s.qkv + B * s.ld_qkv;
    s.o = s.a + B * s.q_size;
    s.gu = s.o + B * m->d;
    s.h = scratch + shared_floats(m, B) + me * own_floats(m, B);
    s.x = s.h + B * m->d;
    s.mlp = s.x + B * m->d;
    s.work = (char *)work + me * work_stride;
    return s;
}

/* rows [r0, r1) of the new tokens' K and V into the layer's cache slots */
static void write_kv(const layer_t *L, const step_buffers_t *s, int64_t r0, int64_t r1,
                     const int64_t *slots) {
    for (int64_t t = r0; t < r1; t++) {
        memcpy(L->k_cache + slots[t] * s->kv_size, s->qkv + t * s->ld_qkv + s->q_size,
               4 * s->kv_size);
        memcpy(L->v_cache + slots[t] * s->kv_size, s->qkv + t * s->ld_qkv + s->q_size +
               s->kv_size, 4 * s->kv_size);
    }
}

/* This thread's rows [*r0, *r1) of B: an even share of a team's (each row is computed by the
 * same code whoever takes it, so the split changes no bit), all of them outside a parallel
 * region, where the calling thread is a team of one. */
static void my_rows(int64_t B, int64_t *r0, int64_t *r1) {
    const int64_t me = omp_get_thread_num(), team = omp_get_num_threads();
    *r0 = B * me / team;
    *r1 = B * (me + 1) / team;
}

/* The layer loop, on one thread or by every thread of one team (in_team). In a team, the
 * threads share out each projection's panels and the attention's items, each followed by the
 * team's barrier, and the rope and the K/V write take each thread's share of the rows
 * (my_rows), then a barrier. The element-wise kernels between (the residual add, the norms,
 * silu) take a share each too, then a barrier, except up to TEAM_OWN_ROWS_MAX rows (`own`):
 * there every thread computes them on all the rows, into its own copy of the residual
 * stream, its own norm output and MLP product, and no barrier follows. Why: at one row a
 * share is all or nothing, so the other thread waited anyway, and a barrier's round trip
 * between two cores on different dies of the package costs half a microsecond: a layer has
 * six barriers so, where it had thirteen. Each row goes through the same code whichever
 * thread computes it, so every copy holds the same bits. Outside `own` the residual stream
 * is h itself. Returns as native_decode. */
static int run_layers(const model_t *m, const layer_t *layers, int64_t n_layers, float *h,
                      int64_t B, const int64_t *positions, const int64_t *slots,
                      const int64_t *rows, const int64_t *tables, int64_t table_stride,
                      const int64_t *lens, const step_buffers_t *s, int nthreads,
                      int in_team, int *attention_failed, const lora_step_t *lora,
                      float *lora_t) {
    const int64_t d = m->d, nh = m->nh, kvh = m->kvh, hd = m->hd, inter = m->inter;
    void *work = s->work;
    const int own = s->own; /* the same for every thread */
    int64_t r0, r1;
    my_rows(B, &r0, &r1);
    /* this thread's rows of the element-wise kernels, and its residual stream */
    const int64_t e0 = own ? 0 : r0, E = own ? B : r1 - r0;
    float *hh = own ? s->h : h, *he = hh + e0 * d, *xe = s->x + e0 * d;
    if (own) memcpy(hh, h, 4 * B * d);
    m->rms_norm(he, d, m->first_norm, xe, d, E, d, m->eps, nthreads);
    if (!own) {
#pragma omp barrier
    }
    for (int64_t li = 0; li < n_layers; li++) {
        const layer_t *L = &layers[li];
        /* a kernel's refusal depends on its arguments alone: every thread sees the same */
        if (project_lora(&L->qkv, in_team, lora, lora_t, li, G_QKV, s->x, d, B, s->qkv, work,
                         nthreads))
            return (int)li + 1;
        m->rope(s->qkv + r0 * s->ld_qkv, s->ld_qkv, r1 - r0, nh + kvh, hd, positions + r0,
                m->cos, m->sin, nthreads);
        write_kv(L, s, r0, r1, slots);
#pragma omp barrier
        const int refused =
            in_team ? m->attention_team(s->qkv, s->ld_qkv, rows, s->a, s->q_size, L->k_cache,
                                        L->v_cache, tables, table_stride, lens, B, nh, kvh, hd,
                                        m->block_size, m->scale, L->window, m->softcap,
                                        nthreads, attention_failed)
                    : m->attention(s->qkv, s->ld_qkv, rows, s->a, s->q_size, L->k_cache,
                                   L->v_cache, tables, table_stride, lens, B, nh, kvh, hd,
                                   m->block_size, m->scale, L->window, m->softcap, nthreads);
        if (refused) return (int)li + 1;
        if (project_lora(&L->o, in_team, lora, lora_t, li, G_O, s->a, s->q_size, B, s->o, work,
                         nthreads))
            return (int)li + 1;
        m->add_rms_norm(he, d, s->o + e0 * d, d, m->residual, L->post_norm, xe, d, E, d,
                        m->eps, nthreads);
        if (!own) {
#pragma omp barrier
        }
        if (project_lora(&L->gate_up, in_team, lora, lora_t, li, G_GATE_UP, s->x, d, B, s->gu,
                         work, nthreads))
            return (int)li + 1;
        m->silu_mul(s->gu + e0 * 2 * inter, 2 * inter, s->mlp + e0 * inter, inter, E, inter,
                    nthreads);
        if (!own) {
#pragma omp barrier
        }
        if (project_lora(&L->down, in_team, lora, lora_t, li, G_DOWN, s->mlp, inter, B, s->o,
                         work, nthreads))
            return (int)li + 1;
        m->add_rms_norm(he, d, s->o + e0 * d, d, m->residual, L->next_norm, xe, d, E, d,
                        m->eps, nthreads);
        if (!own) {
#pragma omp barrier
        }
    }
    if (own) {
#pragma omp master
        memcpy(h, hh, 4 * B * d);
    }
    return 0;
}

/* h [B, d] (the embeddings in; the last layer's residual stream out). lora: the step's LoRA
 * op, or NULL for a base-only step; lora_t: B rows of lora->ldt floats for its shrink. Returns
 * 0, or the 1-based layer whose kernel refused (a GEMM's shape, the attention's scratch, the
 * LoRA kernel's ranks or tile width). A step with adapters takes a team per kernel: the LoRA
 * kernel starts its own. */
int native_decode(const model_t *m, const layer_t *layers, int64_t n_layers, float *h,
                  int64_t B, const int64_t *positions, const int64_t *slots,
                  const int64_t *rows, const int64_t *tables, int64_t table_stride,
                  const int64_t *lens, float *scratch, void *work, int64_t work_stride,
                  int nthreads, const lora_step_t *lora, float *lora_t) {
    int attention_failed = 0;
    if (lora && lora->n_layers != n_layers) return 1;
    if (lora || !native_decode_in_team(m, layers, n_layers, B, nthreads)) {
        const step_buffers_t s = buffers(m, B, scratch, work, work_stride, 0);
        return run_layers(m, layers, n_layers, h, B, positions, slots, rows, tables,
                          table_stride, lens, &s, nthreads, 0, &attention_failed, lora,
                          lora_t);
    }
    int rc = 0;
#pragma omp parallel num_threads(nthreads)
    {
        const step_buffers_t s = buffers(m, B, scratch, work, work_stride, 1);
        const int mine = run_layers(m, layers, n_layers, h, B, positions, slots, rows,
                                    tables, table_stride, lens, &s, nthreads, 1,
                                    &attention_failed, NULL, NULL);
#pragma omp master
        rc = mine;
    }
    return rc;
}

#include "native_greedy.h" /* runs of greedy steps over the layer loop above */
