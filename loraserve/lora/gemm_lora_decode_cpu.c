/* A decode step's base projection and its LoRA op in one parallel region, interleaved so
 * that reading the adapters' weights overlaps the GEMM's arithmetic.
 *
 * Why: at decode (a few tokens per adapter) the LoRA op only streams weights: 16 adapters of
 * ranks 8-64 on SmolLM2 are ~590 MB a step, ~15 ms at what two cores read, on top of a GEMM
 * that is bound by its FMAs and leaves memory idle. Here each thread runs its share of the
 * GEMM's column tiles and, inside each tile's K loop, prefetches one line per k of the LoRA
 * work it does next (ops/gemm_cpu.c's `ps` stream); after each column unit it runs the work
 * whose weights have arrived, now from cache.
 *
 * Two phases (one barrier): the shrinks t = x @ A.T (any thread, balanced by bytes), with the
 * first part of each thread's columns; then the expands, each by the thread that owns its
 * columns and only once its columns' GEMM is done, with the rest. A thread that runs out of
 * work in a phase takes what the others have not started (a work item is claimed atomically;
 * an expand only once its owner's GEMM is past its columns): the waits at the barrier and the
 * end of the region went from ~2.7 to ~1.4 ms of core time a step. Results are the same, bit
 * for bit, as the GEMM followed by lora_sgmv: the same shrink and expand code, each y element
 * its GEMM sum and then + t[j] * B[j] by FMA in order.
 *
 * Measured (benchmarks/fused_lora.py, SmolLM2 shapes, 64 tokens over 16 adapters): the LoRA
 * ops add 0.73-0.87 of what they add run separately on Zen 5, 0.69 on imitated AVX2.
 */
#include "../ops/gemm_cpu.c"
#include "sgmv_cpu.c"
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#define UNIT TILE_COLS /* GEMM columns per register tile */
#define EXPAND_STRIPS 4 /* strips per expand work item: items finish soon after their columns */

/* One work item and the floats it reads (p, n). kind 0, a shrink: segment `seg`, rank columns
 * [a, a + b). kind 1, an expand: part `a` of segment `seg`, its columns [b, b + c) (relative
 * to the part's first), ready once the GEMM is past column `end`. */
typedef struct {
    const float *p;
    int64_t n, kind, seg, a, b, c, end;
    int claimed; /* set by the thread that runs it: its owner, or one that ran out of work */
} work;

typedef struct { /* one thread's lists */
    work *shrink, *expand;
    int64_t nshrink, nexpand, shrink_floats, expand_floats, u0, u1;
    int64_t col_done; /* this thread's GEMM is done left of this column (atomic) */
    double load; /* GEMM + expands + shrinks, in floats read from memory */
} plan;

/* A GEMM column's time in floats of LoRA work, estimated on Zen 5: a column of 64 rows and
 * K = 576 is ~0.28 us of one core's FMAs, in which a core streams ~2,000 floats of LoRA work
 * (146 M a step in ~10 ms on two); M * K / 16 = 2,304 */
static double column_cost(int64_t M, int64_t K) { return (double)M * (double)K / 16.0; }

/* Runs w unless another thread has claimed it. */
static void run_work(work *w, const float *x, int64_t ldx, int64_t d_in, float *t,
                     int64_t ldt, float *y, int64_t ldy, const int64_t *segs,
                     const int64_t *parts, int64_t tile) {
    if (__atomic_exchange_n(&w->claimed, 1, __ATOMIC_ACQ_REL)) return;
    const int64_t *g = segs + 4 * w->seg;
    if (w->kind == 0) {
        shrink_tokens(x, ldx, w->p, d_in, w->b, g[1], g[2], t + w->a, ldt);
    } else {
        const int64_t *q = parts + 6 * w->a;
        expand_rows(t, ldt, w->p, tile, q[1], q[2], q[3] + w->b, w->c, g[1], g[2], y, ldy);
    }
}

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
static int64_t snap(int64_t c, const int64_t *mods, int64_t nmod, int64_t tile) {
    for (int64_t i = 0; i < nmod; i++)
        if (c > mods[2 * i] && c < mods[2 * i + 1]) {
            const int64_t s = mods[2 * i] + (c - mods[2 * i] + tile / 2) / tile * tile;
            return s < mods[2 * i + 1] ? s : mods[2 * i + 1];
        }
    return (c + UNIT / 2) / UNIT * UNIT;
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

#define MAX_MODULES 8

/* Fills every thread's lists (called by one thread). */
static void make_plans(plan *pl, int nt, const float *A, int64_t a_slot, int64_t d_in,
                       const float *B, int64_t b_slot, const int64_t *segs, int64_t nseg,
                       const int64_t *parts, int64_t npart, int64_t M, int64_t N,
                       int64_t tile) {
    int64_t mods[2 * MAX_MODULES];
    const int64_t nmod = module_ranges(parts, npart, mods, MAX_MODULES);
    for (int th = 0; th < nt; th++) { /* my columns [c0, c1): whole strips, in column order */
        const int64_t c0 = th ? snap(N * th / nt, mods, nmod, tile) : 0;
        const int64_t c1 = th + 1 < nt ? snap(N * (th + 1) / nt, mods, nmod, tile) : N;
        pl[th].u0 = c0 / UNIT;
        pl[th].u1 = c1 / UNIT;
        pl[th].nshrink = pl[th].nexpand = pl[th].shrink_floats = pl[th].expand_floats = 0;
        for (int64_t c = c0, ce; c < c1; c = ce) {
            ce = chunk_end(c, c1, mods, nmod, tile);
            for (int64_t p = 0; p < npart; p++) {
                const int64_t *q = parts + 6 * p, *g = segs + 4 * q[0];
                const int64_t lo = q[3] > c ? q[3] : c, hi = q[4] < ce ? q[4] : ce;
                if (lo >= hi || g[1] == g[2]) continue;
                const int64_t r = q[2] - q[1], lc = lo - q[3];
                work *w = pl[th].expand + pl[th].nexpand++;
                *w = (work){B + g[0] * b_slot + q[5] + lc * r, (hi - lo) * r, 1, q[0], p, lc,
                            hi - lo, hi, 0};
                pl[th].expand_floats += w->n;
            }
        }
        /* strips make the column split uneven (o_proj: 5 and 4 of 9): shrinks even it out */
        pl[th].load = (double)(c1 - c0) * column_cost(M, d_in) + (double)pl[th].expand_floats;
    }
    for (int64_t s = 0; s < nseg; s++) { /* shrinks: each to the thread with the least */
        const int64_t *g = segs + 4 * s, rpad = pad8(g[3]);
        if (g[1] == g[2]) continue;
        for (int64_t c0 = 0; c0 < rpad; c0 += tile) {
            const int64_t w = rpad - c0 < tile ? rpad - c0 : tile;
            int best = 0;
            for (int th = 1; th < nt; th++)
                if (pl[th].load < pl[best].load) best = th;
            pl[best].shrink[pl[best].nshrink++] =
                (work){A + g[0] * a_slot + c0 * d_in, w * d_in, 0, s, c0, w, 0, 0, 0};
            pl[best].shrink_floats += w * d_in;
            pl[best].load += (double)(w * d_in);
        }
    }
}

/* GEMM column units [u, ue) of all M rows (ulast: the end of this thread's units), while
 * prefetching `floats` of items[*done..n) spread over the units; after each unit, runs the
 * items fully fetched and ready (an expand once the GEMM is past its columns). */
static void gemm_units(int64_t u, int64_t ue, int64_t ulast, const float *x, int64_t ldx,
                       const float *packed, int64_t M, int64_t K, float *y, int64_t ldy,
                       work *items, int64_t n, int64_t *done, int64_t floats, float *t,
                       int64_t ldt, const int64_t *segs, const int64_t *parts, int64_t strip,
                       int64_t *col_done) {
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS, units = ue - u;
    const int64_t per_unit = units > 0 ? (floats + units - 1) / units : 0;
    int64_t wi = *done, off = 0; /* the prefetch cursor: item, floats into it */
    for (; u < ue; u++) {
        const float *b = packed + u * UNIT * K;
        float *c = y + u * UNIT;
        const float *pf = M > TILE_ROWS && u + 1 < ulast ? b + UNIT * K : 0;
        int64_t budget = per_unit;
        for (int64_t r = 0, i = 0; r < M; r += TILE_ROWS, i++) {
            const int64_t m = M - r < TILE_ROWS ? M - r : TILE_ROWS;
            int64_t lines = (budget / (tiles - i) + STREAM_LINE - 1) / STREAM_LINE;
            const float *ps = 0;
            if (wi < n && lines > 0) {
                const int64_t left = (items[wi].n - off + STREAM_LINE - 1) / STREAM_LINE;
                lines = lines < left ? lines : left;
                lines = lines < K ? lines : K;
                ps = items[wi].p + off;
                off += lines * STREAM_LINE;
                if (off >= items[wi].n) wi++, off = 0;
            } else {
                lines = 0;
            }
            budget -= lines * STREAM_LINE;
            const float *a = x + r * ldx;
#ifdef __AVX512F__
#define T_(MR) tile512(MR, 2, a, ldx, b, K, c + r * ldy, ldy, NR, pf, 0, ps, lines)
#else
#define T_(MR) tile(MR, a, ldx, b, K, c + r * ldy, ldy, NR, pf, 0, ps, lines)
#endif
            SWITCH_ROWS(m, T_)
#undef T_
            pf = 0;
        }
        const int64_t col = (u + 1) * UNIT; /* the GEMM is done left of here */
        __atomic_store_n(col_done, col, __ATOMIC_RELEASE);
        while (*done < wi && (items[*done].kind == 0 || items[*done].end <= col))
            run_work(items + (*done)++, x, ldx, K, t, ldt, y, ldy, segs, parts, strip);
    }
}

int gemm_lora_decode(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                     int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot,
                     const float *B, int64_t b_slot, const int64_t *segs, int64_t nseg,
                     const int64_t *parts, int64_t npart, float *t, int64_t ldt, int64_t tile,
                     int nthreads) {
    if (!lora_accepts_tile(tile) || tile % UNIT || N % UNIT) return -3;
    for (int64_t p = 0; p < npart; p++) /* modules of whole units (so strips are too) */
        if (parts[6 * p + 3] % UNIT || parts[6 * p + 4] % UNIT) return -3;
    int64_t mods[2 * MAX_MODULES];
    if (module_ranges(parts, npart, mods, MAX_MODULES) == MAX_MODULES) return -3;
    for (int64_t s = 0; s < nseg; s++)
        if (pad8(segs[4 * s + 3]) > ldt) return -1;
    int64_t max_shrink = 0;
    for (int64_t s = 0; s < nseg; s++) max_shrink += (pad8(segs[4 * s + 3]) + tile - 1) / tile;
    /* chunks: at most one per EXPAND_STRIPS strips, plus one per module and gap, per thread */
    const int64_t max_expand = (N / (EXPAND_STRIPS * tile) + 2 * MAX_MODULES + 2) * npart;
    int failed = 0;
    plan *pl = calloc(nthreads, sizeof *pl);
    if (!pl) return -2;
#pragma omp parallel num_threads(nthreads)
    {
        const int nt = omp_get_num_threads(), th = omp_get_thread_num();
#pragma omp single
        {
            for (int i = 0; i < nt && !failed; i++) {
                pl[i].shrink = malloc((max_shrink + 1) * sizeof(work));
                pl[i].expand = malloc((max_expand + 1) * sizeof(work));
                failed = !pl[i].shrink || !pl[i].expand;
            }
            if (!failed)
                make_plans(pl, nt, A, a_slot, K, B, b_slot, segs, nseg, parts, npart, M, N,
                           tile);
        } /* implicit barrier: every plan is made */
        if (!failed) {
            plan *me = pl + th;
            const int64_t total_s = me->shrink_floats, total_e = me->expand_floats;
            /* phase A (the shrinks and my first columns) ends at the same time X on every
             * thread: X = the mean of (shrinks + the shrinks' share of the GEMM). What the
             * estimate misses, threads that run out of work take from the others' lists. */
            double all_s = 0, all_e = 0, x_end = 0;
            for (int i = 0; i < nt; i++) all_s += pl[i].shrink_floats, all_e += pl[i].expand_floats;
            const double fa = all_s + all_e > 0 ? all_s / (all_s + all_e) : 0.0;
            const double unit_cost = UNIT * column_cost(M, K);
            for (int i = 0; i < nt; i++)
                x_end += (pl[i].shrink_floats + fa * (pl[i].u1 - pl[i].u0) * unit_cost) / nt;
            int64_t ua = me->u0 + (int64_t)((x_end - total_s) / unit_cost + 0.5);
            ua = ua < me->u0 ? me->u0 : ua > me->u1 ? me->u1 : ua;
            int64_t done = 0;
            gemm_units(me->u0, ua, me->u1, x, ldx, packed, M, K, y, ldy, me->shrink,
                       me->nshrink, &done, total_s, t, ldt, segs, parts, tile, &me->col_done);
            while (done < me->nshrink)
                run_work(me->shrink + done++, x, ldx, K, t, ldt, y, ldy, segs, parts, tile);
            for (int i = 1; i < nt; i++) { /* done early: others' shrinks, from their ends */
                const plan *o = pl + (th + i) % nt;
                for (int64_t k = o->nshrink - 1; k >= 0; k--)
                    run_work(o->shrink + k, x, ldx, K, t, ldt, y, ldy, segs, parts, tile);
            }
#pragma omp barrier
            done = 0; /* every t row is written: the expands may start */
            gemm_units(ua, me->u1, me->u1, x, ldx, packed, M, K, y, ldy, me->expand,
                       me->nexpand, &done, total_e, t, ldt, segs, parts, tile, &me->col_done);
            while (done < me->nexpand)
                run_work(me->expand + done++, x, ldx, K, t, ldt, y, ldy, segs, parts, tile);
            for (int i = 1; i < nt; i++) { /* others' expands whose columns their GEMM passed */
                plan *o = pl + (th + i) % nt;
                const int64_t col = __atomic_load_n(&o->col_done, __ATOMIC_ACQUIRE);
                for (int64_t k = o->nexpand - 1; k >= 0; k--)
                    if (o->expand[k].end <= col)
                        run_work(o->expand + k, x, ldx, K, t, ldt, y, ldy, segs, parts, tile);
            }
        }
    }
    for (int i = 0; i < nthreads; i++) free(pl[i].shrink), free(pl[i].expand);
    free(pl);
    return failed ? -2 : 0;
}
#else
int gemm_lora_decode(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                     int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot,
                     const float *B, int64_t b_slot, const int64_t *segs, int64_t nseg,
                     const int64_t *parts, int64_t npart, float *t, int64_t ldt, int64_t tile,
                     int nthreads) {
    (void)x; (void)ldx; (void)packed; (void)M; (void)N; (void)K; (void)y; (void)ldy; (void)A;
    (void)a_slot; (void)B; (void)b_slot; (void)segs; (void)nseg; (void)parts; (void)npart;
    (void)t; (void)ldt; (void)tile; (void)nthreads;
    return -3;
}
#endif
