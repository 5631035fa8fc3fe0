/* The work plan of the interleaved decode op (lora/gemm_lora_decode_cpu.c): which thread runs
 * which GEMM column units, shrinks and expands. Every layer of a step has the same segments and
 * shapes, so a plan is made at a step's first call of a group and reused by the other layers
 * (made in each call, it was a serial section and a barrier per call).
 *
 * Per-call state is stamped with the call's number (`gen`) rather than reset: an item is
 * claimed when its stamp becomes `gen`, a unit or shrink done when its done stamp does. */
#ifndef LORASERVE_GEMM_LORA_DECODE_PLAN_H
#define LORASERVE_GEMM_LORA_DECODE_PLAN_H

#include <stdint.h>
#include <stdlib.h>

#include "../ops/tuning.h"
#include "lora_rows.h"

#define MAX_MODULES 8 /* distinct module column ranges of a group (7 modules in 4 groups) */

enum { SHRINK, EXPAND }; /* work.kind */

/* One work item. A shrink: segment `seg`, rank columns [col, col + width) of t, its A tile at
 * A + off. An expand: part `part` of segment `seg`, its columns [col, col + width) (relative
 * to the part's first), its B floats at B + off, ready once GEMM units [u0, u1) are done and
 * so are its segment's shrinks. n: the floats it reads (what is prefetched for it). */
typedef struct {
    int64_t off, n, kind, seg, part, col, width, u0, u1;
} work;

/* A module's output columns [c0, c1) */
typedef struct {
    int64_t c0, c1;
} col_range;

typedef struct { /* one thread's share */
    int64_t *shrink, *expand; /* indices into items: shrinks by load, expands in column order */
    int64_t nshrink, nexpand, shrink_floats, expand_floats;
    int64_t u0, ua, u1; /* my GEMM units: [u0, ua) with the shrinks, [ua, u1) with the expands */
    double load;
} share;

typedef struct {
    int nt;
    int64_t M, N, K, a_slot, b_slot, tile, unit;
    work *items;          /* the shrinks, by segment, then every thread's expands */
    int64_t *seg_shrinks; /* the shrinks of segment s: items [seg_shrinks[s], seg_shrinks[s + 1]) */
    share *th;
    int64_t gen;                                    /* the current call's number */
    int64_t *claimed, *done, *unit_claimed, *unit_done; /* stamps: items, then units */
    int64_t *lists;                                 /* storage of the shares' index lists */
} dplan;

/* A GEMM column's time in floats of LoRA work (tuning.h). */
static double column_cost(int64_t M, int64_t K) {
    return (double)M * (double)K / DECODE_MACS_PER_LORA_FLOAT;
}

/* The modules' column ranges of a group's parts, distinct and in column order. */
static int64_t module_ranges(const lora_part *parts, int64_t npart, col_range *mods,
                             int64_t max) {
    int64_t n = 0;
    for (int64_t p = 0; p < npart; p++) {
        const int64_t c0 = parts[p].c0, c1 = parts[p].c1;
        int64_t i = 0;
        while (i < n && mods[i].c0 != c0) i++;
        if (i < n || n == max) continue;
        for (i = n++; i > 0 && mods[i - 1].c0 > c0; i--) mods[i] = mods[i - 1]; /* by c0 */
        mods[i] = (col_range){c0, c1};
    }
    return n;
}

/* Column c moved onto a strip boundary of the module it falls in (so each strip has one
 * owner thread), else onto the unit grid. */
static int64_t snap(int64_t c, const col_range *mods, int64_t nmod, int64_t tile,
                    int64_t unit) {
    for (int64_t i = 0; i < nmod; i++)
        if (c > mods[i].c0 && c < mods[i].c1) {
            const int64_t s = mods[i].c0 + (c - mods[i].c0 + tile / 2) / tile * tile;
            return s < mods[i].c1 ? s : mods[i].c1;
        }
    return (c + unit / 2) / unit * unit;
}

/* The end of the expand chunk that starts at c: DECODE_EXPAND_STRIPS strips on, or the end of
 * its module; outside every module, the next module's start; never past `end`. */
static int64_t chunk_end(int64_t c, int64_t end, const col_range *mods, int64_t nmod,
                         int64_t tile) {
    for (int64_t i = 0; i < nmod; i++) {
        if (c >= mods[i].c0 && c < mods[i].c1) {
            int64_t e = c + DECODE_EXPAND_STRIPS * tile;
            e = e < mods[i].c1 ? e : mods[i].c1;
            return e < end ? e : end;
        }
        if (c < mods[i].c0) return mods[i].c0 < end ? mods[i].c0 : end;
    }
    return end;
}

static void free_plan(dplan *pl) {
    if (!pl) return;
    free(pl->items), free(pl->seg_shrinks), free(pl->th), free(pl->claimed), free(pl->lists);
    free(pl);
}

/* The expands of columns [c0, c1) into items from n on; returns the new n. */
static int64_t add_expands(dplan *pl, int64_t n, int64_t c0, int64_t c1, const col_range *mods,
                           int64_t nmod, const lora_seg *segs, const lora_part *parts,
                           int64_t npart) {
    for (int64_t c = c0, ce; c < c1; c = ce) {
        ce = chunk_end(c, c1, mods, nmod, pl->tile);
        for (int64_t p = 0; p < npart; p++) {
            const lora_part *q = parts + p;
            const lora_seg *g = segs + q->seg;
            const int64_t lo = q->c0 > c ? q->c0 : c, hi = q->c1 < ce ? q->c1 : ce;
            if (lo >= hi || g->start == g->end) continue;
            const int64_t r = q->o1 - q->o0, lc = lo - q->c0;
            pl->items[n++] = (work){.off = g->slot * pl->b_slot + q->boff + lc * r,
                                    .n = (hi - lo) * r, .kind = EXPAND, .seg = q->seg,
                                    .part = p, .col = lc, .width = hi - lo,
                                    .u0 = lo / pl->unit, .u1 = (hi + pl->unit - 1) / pl->unit};
        }
    }
    return n;
}

/* The plan for nt threads; 0 when out of memory. */
static dplan *make_plan(int nt, int64_t M, int64_t N, int64_t K, int64_t a_slot,
                        int64_t b_slot, const lora_seg *segs, int64_t nseg,
                        const lora_part *parts, int64_t npart, int64_t tile, int64_t unit) {
    col_range mods[MAX_MODULES];
    const int64_t nmod = module_ranges(parts, npart, mods, MAX_MODULES);
    int64_t nshrink = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (segs[s].start < segs[s].end) nshrink += (pad8(segs[s].rank) + tile - 1) / tile;
    /* expand chunks: at most one per DECODE_EXPAND_STRIPS strips, plus one per module and gap,
     * per thread, each split over the parts */
    const int64_t max_expand =
        nt * (N / (DECODE_EXPAND_STRIPS * tile) + 2 * MAX_MODULES + 2) * npart;
    const int64_t max_items = nshrink + max_expand, units = N / unit;
    dplan *pl = calloc(1, sizeof *pl);
    if (!pl) return 0;
    pl->nt = nt, pl->M = M, pl->N = N, pl->K = K, pl->a_slot = a_slot, pl->b_slot = b_slot;
    pl->tile = tile, pl->unit = unit;
    pl->items = malloc((max_items + 1) * sizeof *pl->items);
    pl->seg_shrinks = malloc((nseg + 1) * sizeof *pl->seg_shrinks);
    pl->th = calloc(nt, sizeof *pl->th);
    pl->claimed = calloc(2 * (max_items + units) + 1, sizeof *pl->claimed); /* all stamps */
    pl->lists = malloc((nt * nshrink + max_items + 1) * sizeof *pl->lists);
    if (!pl->items || !pl->seg_shrinks || !pl->th || !pl->claimed || !pl->lists) {
        free_plan(pl);
        return 0;
    }
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) { /* the shrinks, by segment */
        const lora_seg *g = segs + s;
        const int64_t rpad = pad8(g->rank);
        pl->seg_shrinks[s] = n;
        for (int64_t c0 = 0; g->start < g->end && c0 < rpad; c0 += tile) {
            const int64_t w = rpad - c0 < tile ? rpad - c0 : tile;
            pl->items[n++] = (work){.off = g->slot * a_slot + c0 * K, .n = w * K,
                                    .kind = SHRINK, .seg = s, .col = c0, .width = w};
        }
    }
    pl->seg_shrinks[nseg] = n;
    int64_t *list = pl->lists;
    for (int th = 0; th < nt; th++) { /* my columns [c0, c1): whole strips, in column order */
        share *me = pl->th + th;
        const int64_t c0 = th ? snap(N * th / nt, mods, nmod, tile, unit) : 0;
        const int64_t c1 = th + 1 < nt ? snap(N * (th + 1) / nt, mods, nmod, tile, unit) : N;
        const int64_t first = n;
        me->u0 = c0 / unit, me->u1 = c1 / unit;
        n = add_expands(pl, n, c0, c1, mods, nmod, segs, parts, npart);
        me->expand = list, me->nexpand = n - first;
        for (int64_t i = first; i < n; i++) *list++ = i, me->expand_floats += pl->items[i].n;
        me->shrink = list, list += nshrink;
        /* strips make the column split uneven (o_proj: 5 and 4 of 9): shrinks even it out */
        me->load = (double)(c1 - c0) * column_cost(M, K) + (double)me->expand_floats;
    }
    pl->done = pl->claimed + n, pl->unit_claimed = pl->done + n;
    pl->unit_done = pl->unit_claimed + units;
    for (int64_t i = 0; i < pl->seg_shrinks[nseg]; i++) { /* each to the least loaded */
        share *best = pl->th;
        for (int th = 1; th < nt; th++)
            if (pl->th[th].load < best->load) best = pl->th + th;
        best->shrink[best->nshrink++] = i;
        best->shrink_floats += pl->items[i].n;
        best->load += (double)pl->items[i].n;
    }
    /* the shrinks' phase ends at the same time X on every thread: X = the mean of (shrinks +
     * the shrinks' share of the GEMM) */
    double all_s = 0, all_e = 0, x_end = 0;
    for (int i = 0; i < nt; i++) all_s += pl->th[i].shrink_floats, all_e += pl->th[i].expand_floats;
    const double fa = all_s + all_e > 0 ? all_s / (all_s + all_e) : 0.0;
    const double unit_cost = unit * column_cost(M, K);
    for (int i = 0; i < nt; i++)
        x_end += (pl->th[i].shrink_floats + fa * (pl->th[i].u1 - pl->th[i].u0) * unit_cost) / nt;
    for (int i = 0; i < nt; i++) {
        share *me = pl->th + i;
        int64_t ua = me->u0 + (int64_t)((x_end - me->shrink_floats) / unit_cost + 0.5);
        me->ua = ua < me->u0 ? me->u0 : ua > me->u1 ? me->u1 : ua;
    }
    return pl;
}

#endif
