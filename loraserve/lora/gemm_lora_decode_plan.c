/* The work plan of the interleaved decode op (lora/gemm_lora_decode_cpu.c): which thread runs
 * which GEMM column units, shrinks and expands. Every layer of a step has the same segments and
 * shapes, so a plan is made at a step's first call of a group and reused by the other 29
 * (making it in each call cost ~3 us of both threads' time, a serial section and its barrier).
 *
 * Per-call state is stamped with the call's number (`gen`) rather than reset: an item is
 * claimed when its stamp becomes `gen`, a unit or shrink done when its done stamp does. */
#include <stdint.h>
#include <stdlib.h>

#define EXPAND_STRIPS 4 /* strips per expand work item: items finish soon after their columns */
#define MAX_MODULES 8

/* One work item. kind 0, a shrink: segment `seg`, rank columns [a, a + b), its A tile at
 * A + off. kind 1, an expand: part `a` of segment `seg`, its columns [b, b + c) (relative to
 * the part's first), its B floats at B + off, ready once GEMM units [u0, u1) are done and so
 * are its segment's shrinks. n: the floats it reads (what is prefetched for it). */
typedef struct {
    int64_t off, n, kind, seg, a, b, c, u0, u1;
} work;

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

/* A GEMM column's time in floats of LoRA work, estimated on Zen 5: a column of 64 rows and
 * K = 576 is ~0.28 us of one core's FMAs, in which a core streams ~2,000 floats of LoRA work
 * (146 M a step in ~10 ms on two); M * K / 16 = 2,304. Work stealing evens out what it misses. */
static double column_cost(int64_t M, int64_t K) { return (double)M * (double)K / 16.0; }

/* The modules' column ranges (c0, c1) of a group's parts, distinct and in column order. */
static int64_t module_ranges(const int64_t *parts, int64_t npart, int64_t *mods, int64_t max) {
    int64_t n = 0;
    for (int64_t p = 0; p < npart; p++) {
        const int64_t c0 = parts[6 * p + 3], c1 = parts[6 * p + 4];
        int64_t i = 0;
        while (i < n && mods[2 * i] != c0) i++;
        if (i < n || n == max) continue;
        for (i = n++; i > 0 && mods[2 * i - 2] > c0; i--) /* insertion, by c0 */
            mods[2 * i] = mods[2 * i - 2], mods[2 * i + 1] = mods[2 * i - 1];
        mods[2 * i] = c0, mods[2 * i + 1] = c1;
    }
    return n;
}

/* Column c moved onto a strip boundary of the module it falls in (so each strip has one
 * owner thread), else onto the unit grid. */
static int64_t snap(int64_t c, const int64_t *mods, int64_t nmod, int64_t tile, int64_t unit) {
    for (int64_t i = 0; i < nmod; i++)
        if (c > mods[2 * i] && c < mods[2 * i + 1]) {
            const int64_t s = mods[2 * i] + (c - mods[2 * i] + tile / 2) / tile * tile;
            return s < mods[2 * i + 1] ? s : mods[2 * i + 1];
        }
    return (c + unit / 2) / unit * unit;
}

/* The end of the expand chunk that starts at c: EXPAND_STRIPS strips on, or the end of its
 * module; outside every module, the next module's start; never past `end`. */
static int64_t chunk_end(int64_t c, int64_t end, const int64_t *mods, int64_t nmod,
                         int64_t tile) {
    for (int64_t i = 0; i < nmod; i++) {
        if (c >= mods[2 * i] && c < mods[2 * i + 1]) {
            int64_t e = c + EXPAND_STRIPS * tile;
            e = e < mods[2 * i + 1] ? e : mods[2 * i + 1];
            return e < end ? e : end;
        }
        if (c < mods[2 * i]) return mods[2 * i] < end ? mods[2 * i] : end;
    }
    return end;
}

static void free_plan(dplan *pl) {
    if (!pl) return;
    free(pl->items), free(pl->seg_shrinks), free(pl->th), free(pl->claimed), free(pl->lists);
    free(pl);
}

/* The expands of columns [c0, c1) into items from n on; returns the new n. */
static int64_t add_expands(dplan *pl, int64_t n, int64_t c0, int64_t c1, const int64_t *mods,
                           int64_t nmod, const int64_t *segs, const int64_t *parts,
                           int64_t npart) {
    for (int64_t c = c0, ce; c < c1; c = ce) {
        ce = chunk_end(c, c1, mods, nmod, pl->tile);
        for (int64_t p = 0; p < npart; p++) {
            const int64_t *q = parts + 6 * p, *g = segs + 4 * q[0];
            const int64_t lo = q[3] > c ? q[3] : c, hi = q[4] < ce ? q[4] : ce;
            if (lo >= hi || g[1] == g[2]) continue;
            const int64_t r = q[2] - q[1], lc = lo - q[3];
            pl->items[n++] = (work){g[0] * pl->b_slot + q[5] + lc * r, (hi - lo) * r, 1, q[0],
                                    p, lc, hi - lo, lo / pl->unit,
                                    (hi + pl->unit - 1) / pl->unit};
        }
    }
    return n;
}

/* The plan for nt threads; 0 when out of memory. */
static dplan *make_plan(int nt, int64_t M, int64_t N, int64_t K, int64_t a_slot,
                        int64_t b_slot, const int64_t *segs, int64_t nseg,
                        const int64_t *parts, int64_t npart, int64_t tile, int64_t unit) {
    int64_t mods[2 * MAX_MODULES];
    const int64_t nmod = module_ranges(parts, npart, mods, MAX_MODULES);
    int64_t nshrink = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (segs[4 * s + 1] < segs[4 * s + 2]) nshrink += (pad8(segs[4 * s + 3]) + tile - 1) / tile;
    /* expand chunks: at most one per EXPAND_STRIPS strips, plus one per module and gap, per
     * thread, each split over the parts */
    const int64_t max_expand = nt * (N / (EXPAND_STRIPS * tile) + 2 * MAX_MODULES + 2) * npart;
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
        const int64_t *g = segs + 4 * s, rpad = pad8(g[3]);
        pl->seg_shrinks[s] = n;
        for (int64_t c0 = 0; g[1] < g[2] && c0 < rpad; c0 += tile) {
            const int64_t w = rpad - c0 < tile ? rpad - c0 : tile;
            pl->items[n++] = (work){g[0] * a_slot + c0 * K, w * K, 0, s, c0, w, 0, 0, 0};
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
