/* A prefill step's base projection with its whole LoRA op in one parallel region:
 * y = x @ W^T, then for every token of a segment y[tok, cols of module m] += t[tok, o0:o1] @ B_m,
 * with t = x @ A^T (the shrink) computed here too.
 *
 * Why: rows go in x blocks that stay in L2 while the GEMM's panels pass (ops/gemm_tile.h). The
 * shrink of a block's rows runs first, from that L2 copy: run on its own it reads x from memory
 * once more, and for small ranks that read is its whole cost. Then each register tile of the
 * GEMM goes on over its segment's rank rows before it stores (the expand, lora/fused_tile.h):
 * y is written once instead of written by the GEMM, then read and written again by the expand
 * (docs/cpu-kernels.md).
 *
 * Same results, bit for bit, as the GEMM followed by lora_sgmv: t by the same shrink code
 * (sgmv_tiles.h; each token's sums do not depend on which rows run together), and every y
 * element is its GEMM sum, then + t[j] * B[j] for j = o0.. in order, in both.
 *
 * Row tiles never straddle a segment (each tile has one adapter); the column unit of a tile
 * (TILE_COLS: 16 columns with AVX2, 32 with AVX-512) must lie inside one module and one B
 * strip, so every module's columns and the strip width must be multiples of it: gemm_expand
 * returns -3 otherwise (the caller then runs the two ops). A and B are sgmv_cpu.c's layout:
 * A.T as `strip`-column tiles, a module's [r, n] block of B as `strip`-column strips.
 */
#include <stdint.h>
#include <stdlib.h>

#include "fused_tile.h"
#include "lora_rows.h"
#include "sgmv_tiles.h"

#ifdef GEMM_TILES
#define UNIT TILE_COLS /* GEMM columns per register tile */

int gemm_expand_unit(void) { return UNIT; }

/* Whether this beats the GEMM followed by lora_sgmv on this build: with AVX-512 it does; with
 * AVX2 the GEMM is slower, so moving y costs relatively less, and its smaller x blocks cut
 * segments into short tiles and the shrink into small phases, one barrier each
 * (benchmarks/kernels/fused_lora.py re-measures it; docs/cpu-kernels.md). */
int gemm_expand_preferred(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* Whether every part's columns and the strip width are whole units. */
static int aligned(const lora_part *parts, int64_t npart, int64_t strip) {
    if (strip % UNIT) return 0;
    for (int64_t p = 0; p < npart; p++)
        if (parts[p].c0 % UNIT || parts[p].c1 % UNIT) return 0;
    return 1;
}

/* The epilogue of segment s's tiles at columns [cb, cb + UNIT), rows from `row`; 0 when no
 * module of the segment covers those columns. */
static const lowrank *epilogue(lowrank *lr, const lora_seg *g, const lora_part *p0,
                               const lora_part *p1, int64_t cb, int64_t row, const float *t,
                               int64_t ldt, const float *B, int64_t b_slot, int64_t strip) {
    for (const lora_part *q = p0; q < p1; q++) {
        if (cb < q->c0 || cb >= q->c1) continue;
        const int64_t r = q->o1 - q->o0, n = q->c1 - q->c0, lc = cb - q->c0, k = lc / strip;
        const int64_t sw = n - k * strip < strip ? n - k * strip : strip;
        lr->t = t + row * ldt + q->o0;
        lr->ldt = ldt;
        lr->e = B + g->slot * b_slot + q->boff + k * strip * r + lc % strip;
        lr->lde = sw;
        lr->nj = r;
        return lr;
    }
    return 0;
}

#define TILE(MR) fused_tile(MR, a, lda, b, K, c, ldc, pf, e, 0)

/* rows [r0, r1) of one column unit, all of one segment (e) or of none (e = 0), in tiles of
 * near-equal height: segments and x blocks cut rows anywhere, and full tiles with a 1- or
 * 2-row tail are slow (docs/cpu-kernels.md) */
static void unit_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, const float *b,
                      int64_t K, float *y, int64_t ldy, const lowrank *e0, const float *pf) {
    lowrank l;
    const int64_t ntiles = (r1 - r0 + TILE_ROWS - 1) / TILE_ROWS;
    for (int64_t r = r0, i = 0; r < r1; i++) {
        /* tile i of ntiles: the first (rows % ntiles) get one row more */
        const int64_t m = (r1 - r0) / ntiles + (i < (r1 - r0) % ntiles);
        const float *a = x + r * ldx;
        const int64_t lda = ldx, ldc = ldy;
        float *c = y + r * ldy;
        const lowrank *e = 0;
        if (e0) { l = *e0; l.t += (r - r0) * l.ldt; e = &l; }
        SWITCH_ROWS(m, TILE)
        r += m;
        pf = 0; /* only the first tile fetches the next unit's panels */
    }
}
#undef TILE

/* One shrink work item: t[r0:r1, c0:c0+w] = x[r0:r1] @ at (one A tile of one segment). */
typedef struct {
    const float *at;
    int64_t c0, w, r0, r1;
} shrink_item;

/* The shrink items of x block [m0, m1) into out (when not null); returns their number. */
static int64_t block_shrinks(int64_t m0, int64_t m1, const float *A, int64_t a_slot,
                             int64_t K, const lora_seg *segs, int64_t nseg, int64_t strip,
                             shrink_item *out) {
    int64_t n = 0;
    for (int64_t s = 0; s < nseg; s++) {
        const lora_seg *g = segs + s;
        const int64_t rpad = pad8(g->rank);
        const int64_t r0 = g->start > m0 ? g->start : m0, r1 = g->end < m1 ? g->end : m1;
        for (int64_t c0 = 0; r0 < r1 && c0 < rpad; c0 += strip)
            for (int64_t a = r0; a < r1; a += EXPAND_SHRINK_ROWS, n++)
                if (out)
                    out[n] = (shrink_item){A + g->slot * a_slot + c0 * K, c0,
                                           rpad - c0 < strip ? rpad - c0 : strip, a,
                                           a + EXPAND_SHRINK_ROWS < r1 ? a + EXPAND_SHRINK_ROWS
                                                                       : r1};
    }
    return n;
}

/* A run of rows [r0, r1) of one segment (seg >= 0) or of none (-1) */
typedef struct {
    int64_t r0, r1, seg;
} row_run;

int gemm_expand(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot, float *t,
                int64_t ldt, const float *B, int64_t b_slot, const lora_seg *segs, int64_t nseg,
                const lora_part *parts, int64_t npart, int64_t strip, int nthreads) {
    if (N % UNIT || !aligned(parts, npart, strip) || !lora_tile_ok(strip)) return -3;
    for (int64_t s = 0; s < nseg; s++) { /* segments in token order, inside [0, M) */
        const lora_seg *g = segs + s;
        if (g->start > g->end || g->end > M || (s && g->start < segs[s - 1].end)) return -1;
        if (pad8(g->rank) > ldt) return -1;
    }
    for (int64_t p = 0; p < npart; p++) /* parts in segment order, as plan_group makes them */
        if (parts[p].seg < 0 || parts[p].seg >= nseg || (p && parts[p].seg < parts[p - 1].seg))
            return -1;
    int64_t blocks; /* x rows per block, as gemm_packed: the block stays in L2 */
    const int64_t mc = gemm_block_rows(M, K, &blocks), units = N / UNIT;
    /* runs of rows covering [0, M); shrink items by block */
    row_run *runs = malloc((2 * nseg + 1) * sizeof *runs);
    int64_t *pstart = malloc((nseg + 1) * sizeof *pstart);
    int64_t *bstart = malloc((blocks + 1) * sizeof *bstart);
    int64_t nitems = 0;
    for (int64_t b = 0; b < blocks; b++)
        nitems += block_shrinks(b * mc, b * mc + mc, A, a_slot, K, segs, nseg, strip, 0);
    shrink_item *items = malloc((nitems + 1) * sizeof *items);
    if (!runs || !pstart || !bstart || !items) {
        free(runs), free(pstart), free(bstart), free(items);
        return -2;
    }
    bstart[0] = 0;
    for (int64_t b = 0; b < blocks; b++)
        bstart[b + 1] = bstart[b] + block_shrinks(b * mc, b * mc + mc, A, a_slot, K, segs,
                                                  nseg, strip, items + bstart[b]);
    int64_t nrun = 0, row = 0;
    for (int64_t s = 0; s <= nseg; s++) {
        const int64_t start = s < nseg ? segs[s].start : M;
        if (start > row) runs[nrun++] = (row_run){row, start, -1};
        if (s == nseg) break;
        runs[nrun++] = (row_run){start, segs[s].end, s};
        row = segs[s].end;
    }
    for (int64_t s = 0, p = 0; s <= nseg; s++) {
        while (p < npart && parts[p].seg < s) p++;
        pstart[s] = p;
    }
#pragma omp parallel num_threads(nthreads)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t m0 = b * mc, m1 = M - m0 < mc ? M : m0 + mc;
        /* the block's shrinks; the barrier at the end: its t rows are complete */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = bstart[b]; i < bstart[b + 1]; i++)
            shrink_tokens(x, ldx, items[i].at, K, items[i].w, items[i].r0, items[i].r1,
                          t + items[i].c0, ldt);
        /* no barrier after the GEMM: the next block's shrinks write other rows of t */
#pragma omp for schedule(static) nowait
        for (int64_t u = 0; u < units; u++) {
            const int64_t cb = u * UNIT;
            const float *bp = packed + cb * K; /* this unit's panels: UNIT / NR of them */
            const float *pf = m1 - m0 > TILE_ROWS && u + 1 < units ? bp + UNIT * K : 0;
            for (int64_t i = 0; i < nrun; i++) {
                const row_run *rn = runs + i;
                const int64_t r0 = rn->r0 > m0 ? rn->r0 : m0, r1 = rn->r1 < m1 ? rn->r1 : m1;
                if (r0 >= r1) continue;
                lowrank l;
                const lowrank *e = 0;
                if (rn->seg >= 0)
                    e = epilogue(&l, segs + rn->seg, parts + pstart[rn->seg],
                                 parts + pstart[rn->seg + 1], cb, r0, t, ldt, B, b_slot, strip);
                unit_rows(x, ldx, r0, r1, bp, K, y + cb, ldy, e, pf);
                pf = 0;
            }
        }
    }
    free(runs), free(pstart), free(bstart), free(items);
    return 0;
}
#else
int gemm_expand_unit(void) { return 0; }
int gemm_expand_preferred(void) { return 0; }
int gemm_expand(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                int64_t K, float *y, int64_t ldy, const float *A, int64_t a_slot, float *t,
                int64_t ldt, const float *B, int64_t b_slot, const lora_seg *segs, int64_t nseg,
                const lora_part *parts, int64_t npart, int64_t strip, int nthreads) {
    (void)x; (void)ldx; (void)packed; (void)M; (void)N; (void)K; (void)y; (void)ldy; (void)t;
    (void)A; (void)a_slot;
    (void)ldt; (void)B; (void)b_slot; (void)segs; (void)nseg; (void)parts; (void)npart;
    (void)strip; (void)nthreads;
    return -3;
}
#endif
