/* A decode step's base projection and its LoRA op in one parallel region, interleaved so
 * that reading the adapters' weights overlaps the GEMM's arithmetic.
 *
 * Why: at decode (a few tokens per adapter) the LoRA op only streams weights, hundreds of MB a
 * step for a few dozen adapters, on top of a GEMM that is bound by its FMAs and leaves memory
 * idle. Here each thread runs its share of the GEMM's column units and, inside each tile's K
 * loop, prefetches the LoRA work it does next (fused_tile.h's `fetch` streams, a line every few
 * k steps); after each column unit it runs the work whose weights have arrived, now from cache.
 *
 * The plan (gemm_lora_decode_plan.h, made once per step and group) gives each thread its
 * columns, then shrinks t = x @ A.T balanced by bytes with the first part of its columns, then
 * the expands of its own columns with the rest. There is no barrier: an expand runs once the
 * GEMM units of its columns are done and so are its segment's shrinks. A thread out of work
 * takes what the others have not started: shrinks, ready expands, and GEMM units from the end
 * of their ranges (each claimed atomically, so run exactly once). Results are the same, bit for
 * bit, as the GEMM followed by lora_sgmv: the same shrink and expand code, each y element its
 * GEMM sum and then + t[j] * B[j] in order. What it saves against the two ops run apart:
 * benchmarks/kernels/fused_lora.py (docs/cpu-kernels.md).
 */
#include <omp.h>
#include <stdint.h>

/* no fetch ahead inside the LoRA tiles: their weights were fetched under the GEMM, and the
 * extra prefetches cost (kernel_ab.py decode-op, imitated AVX2) */
#define LORA_FETCH_AHEAD_WEIGHTS 0
#include "fused_tile.h"
#include "lora_rows.h"
#include "sgmv_tiles.h"

#ifdef GEMM_TILES
#include "gemm_lora_decode_plan.h"

#define UNIT TILE_COLS /* GEMM columns per register tile */
#define MAX_THREADS 256 /* more threads: refused (-3), the caller runs the two ops */

typedef struct { /* one call's arguments */
    const float *x, *packed, *A, *B;
    float *y, *t;
    int64_t ldx, ldy, ldt;
    const lora_seg *segs;
    const lora_part *parts;
} call;

static int claim(int64_t *stamp, int64_t gen) {
    return __atomic_exchange_n(stamp, gen, __ATOMIC_ACQ_REL) != gen;
}
static int stamped(const int64_t *stamp, int64_t gen) {
    return __atomic_load_n(stamp, __ATOMIC_ACQUIRE) == gen;
}

/* Whether item i may run: a shrink always; an expand once its GEMM units and its segment's
 * shrinks are done. */
static int ready(const dplan *pl, int64_t i) {
    const work *w = pl->items + i;
    if (w->kind == SHRINK) return 1;
    for (int64_t u = w->u0; u < w->u1; u++)
        if (!stamped(pl->unit_done + u, pl->gen)) return 0;
    for (int64_t j = pl->seg_shrinks[w->seg]; j < pl->seg_shrinks[w->seg + 1]; j++)
        if (!stamped(pl->done + j, pl->gen)) return 0;
    return 1;
}

/* Runs item i unless another thread has claimed it; 1 if this call ran it. */
static int run_item(const call *c, dplan *pl, int64_t i) {
    if (!claim(pl->claimed + i, pl->gen)) return 0;
    const work *w = pl->items + i;
    const lora_seg *g = c->segs + w->seg;
    if (w->kind == SHRINK) {
        shrink_tokens(c->x, c->ldx, c->A + w->off, pl->K, w->width, g->start, g->end,
                      c->t + w->col, c->ldt);
        __atomic_store_n(pl->done + i, pl->gen, __ATOMIC_RELEASE);
    } else {
        const lora_part *q = c->parts + w->part;
        expand_rows(c->t, c->ldt, c->B + w->off, pl->tile, q->o0, q->o1, q->c0 + w->col,
                    w->width, g->start, g->end, c->y, c->ldy);
    }
    return 1;
}

/* The prefetch cursor over a list of items: the next lines to fetch. */
typedef struct {
    const call *c;
    const dplan *pl;
    const int64_t *list;
    int64_t n, wi, off, budget;
} cursor;

/* Fills streams 1 and 2 of f with the cursor's next lines for one row tile: its share of the
 * budget (tiles: the row tiles left in the unit), at most `room`, from at most two items; 0 when
 * f has no lines (stream 0 included). */
static const fetch *next_lines(cursor *cu, int64_t tiles, int64_t room, fetch *f) {
    int64_t want = (cu->budget / tiles + LINE_FLOATS - 1) / LINE_FLOATS;
    want = want < room ? want : room;
    f->n[1] = f->n[2] = 0;
    for (int s = 1; s < 3 && want > 0 && cu->wi < cu->n; s++) {
        const work *w = cu->pl->items + cu->list[cu->wi];
        const int64_t left = (w->n - cu->off + LINE_FLOATS - 1) / LINE_FLOATS;
        const int64_t take = want < left ? want : left;
        f->p[s] = (w->kind == EXPAND ? cu->c->B : cu->c->A) + w->off + cu->off;
        f->n[s] = take;
        cu->off += take * LINE_FLOATS;
        if (cu->off >= w->n) cu->wi++, cu->off = 0;
        cu->budget -= take * LINE_FLOATS;
        want -= take;
    }
    return f->n[0] + f->n[1] + f->n[2] ? f : 0;
}

/* GEMM column unit u of all M rows, each row tile fetching the cursor's next lines (cu: 0,
 * none). The next unit's panels (when `next`) are fetched too, one line per k step by the first
 * row tiles (as few as hold them: 2 of 8 at 64 rows with AVX-512), which then fetch no LoRA
 * lines; with too few row tiles for that, by the first tile as the plain GEMM does (`pf`),
 * again alone. Each of those choices beat the plain GEMM's way with LoRA lines in every tile
 * (kernel_ab.py decode-op; docs/cpu-kernels.md). */
static void gemm_unit(const call *c, const dplan *pl, int64_t u, int next, cursor *cu) {
    const int64_t M = pl->M, K = pl->K, tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    const float *b = c->packed + u * UNIT * K;
    float *y = c->y + u * UNIT;
    const float *panels = M > TILE_ROWS && next ? b + UNIT * K : 0; /* the next unit's */
    const int64_t plines = UNIT * K / LINE_FLOATS, ptiles = (plines + K - 1) / K;
    const int spread = panels && cu && tiles > ptiles;
    for (int64_t r = 0, i = 0, m; r < M; r += m, i++) {
        m = gemm_tile_height(M, i);
        fetch f;
        f.n[0] = 0;
        if (spread && i < ptiles) { /* its share of the panels' lines: no room for LoRA's */
            const int64_t l0 = i * K, l1 = l0 + K < plines ? l0 + K : plines;
            f.p[0] = panels + l0 * LINE_FLOATS, f.n[0] = l1 - l0;
        }
        const float *pf = !spread && i == 0 ? panels : 0; /* not spread: the first tile's */
        const fetch *fs = cu && !pf ? next_lines(cu, tiles - i, K - f.n[0], &f) : 0;
        const float *a = c->x + r * c->ldx;
#define T_(MR) fused_tile(MR, a, c->ldx, b, K, y + r * c->ldy, c->ldy, pf, 0, fs)
        SWITCH_ROWS(m, T_)
#undef T_
    }
    __atomic_store_n(pl->unit_done + u, pl->gen, __ATOMIC_RELEASE);
}

/* My GEMM units [u, ue) (ulast: the end of my range), prefetching `floats` of list[*done..n)
 * spread over them; after each unit, runs the listed items fully fetched and ready. Stops at a
 * unit another thread has taken (they take from the end: so are the rest). Budget a unit could
 * not use carries over (reset per unit, and one item per row tile, the fetches lagged and left
 * expands to run from memory after the last unit). */
static void units_with_work(const call *c, dplan *pl, int64_t u, int64_t ue, int64_t ulast,
                            const int64_t *list, int64_t n, int64_t *done, int64_t floats) {
    cursor cu = {c, pl, list, n, *done, 0, 0};
    /* spread over all but the last unit: the fetches run ahead of the work (spread over all of
     * them, some expands were still unfetched after the last unit) */
    const int64_t spread = ue - u > 1 ? ue - u - 1 : 1, per_unit = (floats + spread - 1) / spread;
    for (; u < ue; u++) {
        if (!claim(pl->unit_claimed + u, pl->gen)) return;
        cu.budget += per_unit; /* what a unit could not use (an item ended) carries over */
        gemm_unit(c, pl, u, u + 1 < ulast, &cu);
        while (*done < cu.wi && ready(pl, list[*done])) run_item(c, pl, list[(*done)++]);
    }
}

/* Until no work is left unclaimed: every thread's ready items (mine first), then, when none
 * was ready, one GEMM unit from the end of a range. Each pass starts past the items known to be
 * claimed (a full rescan after each item made this quadratic in the items). */
static void finish(const call *c, dplan *pl, int th) {
    const int nt = pl->nt;
    int64_t from[2 * MAX_THREADS] = {0}; /* per thread: shrinks, expands before these are claimed */
    for (;;) {
        int left = 0, ran = 0;
        for (int k = 0; k < nt && k < MAX_THREADS; k++) {
            const share *o = pl->th + (th + k) % nt;
            const int64_t *lists[2] = {o->shrink, o->expand}, counts[2] = {o->nshrink, o->nexpand};
            for (int kind = 0; kind < 2; kind++) {
                int64_t *f = from + 2 * k + kind;
                while (*f < counts[kind] && stamped(pl->claimed + lists[kind][*f], pl->gen)) (*f)++;
                for (int64_t j = *f; j < counts[kind]; j++) {
                    const int64_t i = lists[kind][j];
                    if (stamped(pl->claimed + i, pl->gen)) continue;
                    left = 1;
                    if (ready(pl, i)) ran |= run_item(c, pl, i);
                }
            }
        }
        for (int k = 0; k < nt && !ran; k++) { /* nothing ready: a unit from a range's end */
            const share *o = pl->th + (th + k) % nt;
            for (int64_t u = o->u1 - 1; u >= o->u0 && !ran; u--)
                if (!stamped(pl->unit_claimed + u, pl->gen)) {
                    left = 1;
                    if (claim(pl->unit_claimed + u, pl->gen)) gemm_unit(c, pl, u, 0, 0), ran = 1;
                }
        }
        if (!left) return;
        if (!ran) __builtin_ia32_pause();
    }
}

int gemm_lora_decode(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                     int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot,
                     const float *B, int64_t b_slot, const lora_seg *segs, int64_t nseg,
                     const lora_part *parts, int64_t npart, float *t, int64_t ldt, int64_t tile,
                     int nthreads, void **plan_slot) {
    dplan *pl = *plan_slot;
    if (!pl || pl->nt != nthreads || pl->M != M || pl->N != N || pl->K != K ||
        pl->a_slot != a_slot || pl->b_slot != b_slot || pl->tile != tile) {
        free_plan(pl); /* a plan is for one step's segments: only the shapes can differ */
        *plan_slot = 0;
        /* the layout, checked once per plan (segs and parts do not change under it) */
        if (!lora_tile_ok(tile) || tile % UNIT || N % UNIT || nthreads > MAX_THREADS)
            return -3;
        for (int64_t p = 0; p < npart; p++) /* modules of whole units (so strips are too) */
            if (parts[p].c0 % UNIT || parts[p].c1 % UNIT) return -3;
        col_range mods[MAX_MODULES];
        if (module_ranges(parts, npart, mods, MAX_MODULES) == MAX_MODULES) return -3;
        for (int64_t s = 0; s < nseg; s++)
            if (pad8(segs[s].rank) > ldt) return -1;
        *plan_slot = pl = make_plan(nthreads, M, N, K, a_slot, b_slot, segs, nseg, parts,
                                    npart, tile, UNIT);
        if (!pl) return -2;
    }
    pl->gen++;
    const call c = {x, packed, A, B, y, t, ldx, ldy, ldt, segs, parts};
#pragma omp parallel num_threads(nthreads)
    {
        const int th = omp_get_thread_num();
        if (th < pl->nt && omp_get_num_threads() == pl->nt) { /* else finish() runs it all */
            share *me = pl->th + th;
            int64_t done = 0;
            units_with_work(&c, pl, me->u0, me->ua, me->u1, me->shrink, me->nshrink, &done,
                            me->shrink_floats);
            while (done < me->nshrink) run_item(&c, pl, me->shrink[done++]);
            done = 0;
            units_with_work(&c, pl, me->ua, me->u1, me->u1, me->expand, me->nexpand, &done,
                            me->expand_floats);
        }
        finish(&c, pl, th);
    }
    return 0;
}

void gemm_lora_decode_free(void *plan) { free_plan(plan); }
#else
int gemm_lora_decode(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                     int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot,
                     const float *B, int64_t b_slot, const lora_seg *segs, int64_t nseg,
                     const lora_part *parts, int64_t npart, float *t, int64_t ldt, int64_t tile,
                     int nthreads, void **plan_slot) {
    (void)plan_slot;
    (void)x; (void)ldx; (void)packed; (void)M; (void)N; (void)K; (void)y; (void)ldy; (void)A;
    (void)a_slot; (void)B; (void)b_slot; (void)segs; (void)nseg; (void)parts; (void)npart;
    (void)t; (void)ldt; (void)tile; (void)nthreads;
    return -3;
}
void gemm_lora_decode_free(void *plan) { (void)plan; }
#endif
