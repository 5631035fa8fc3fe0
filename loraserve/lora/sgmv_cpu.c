/* Segmented multi-LoRA shrink + expand, in one call per layer and module group:
 * y[tok] += (x[tok] @ A_s.T) @ B_s for every token of every segment (s = its adapter's slot),
 * B split into its per-module blocks (parts) so zero blocks are never read.
 *
 * Why C: a decode step is thousands of tiny products (adapters x groups x layers), far too many
 * BLAS calls from Python. Here each adapter's weights are streamed once per step for all of its
 * tokens, split over OpenMP threads; prefill-length segments use the same register tiles
 * (sgmv_tiles.h), which outrun per-segment BLAS calls (docs/cpu-kernels.md).
 *
 * Layout (see adapters/slot_pool.py), with W = `tile` (16 or 64, the pool's tile width):
 * slot s's A.T (packed rank r, padded to 8) at A + s*a_slot as [d_in, <=W] row-major tiles,
 * tile k at + W*k*d_in; B[s] at B + s*b_slot.
 * segs: lora_seg rows (slot, start, end, rank); parts: lora_part rows (seg, o0, o1, c0, c1,
 * boff) (lora_rows.h): rank rows [o0,o1) of t -> output columns [c0,c1) of y, through the
 * module's block of B at B[slot] + boff: B_m.T [r, n] (r = o1-o0, n = c1-c0) stored as
 * W-column strips, each [r, W] row-major at + W*k*r, then the last n % W columns as
 * [r, n % W] (layout.b_strips): every strip is one stream.
 * t: scratch [T, ldt] (ldt >= every padded rank), rows of the segments' tokens are written.
 * Built with -O3 -march=native -ffp-contract=fast; -DLORA_BF16 for bfloat16 adapter weights.
 */
#include <stdint.h>
#include <stdlib.h>

#include "lora_rows.h"
#include "sgmv_tiles.h"

/* The slot pool tile width this build runs fastest on (tuning.h). */
int lora_preferred_tile(void) { return LORA_PREFERRED_TILE; }
int lora_accepts_tile(int64_t tile) { return lora_tile_ok(tile); }

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t shrink_items(const lora_seg *g, int64_t tile) {
    return cdiv(pad8(g->rank), tile) * cdiv(g->end - g->start, LORA_SHRINK_TOKENS);
}

/* Expand work items of one part: its column chunks times its segment's token chunks. */
static int64_t expand_items(const lora_part *q, const lora_seg *segs) {
    const lora_seg *g = segs + q->seg;
    return cdiv(q->c1 - q->c0, LORA_EXPAND_COLS) * cdiv(g->end - g->start, LORA_EXPAND_TOKENS);
}

/* Whether a decode batch (no segment longer than LORA_FUSE_MAX_TOKENS) gives each thread
 * whole segments: with enough of them a thread (LORA_SEGS_PER_THREAD), or where the
 * heaviest-first order below would leave no thread more than LORA_SEGMENTS_IMBALANCE times an
 * even share of the weights (one big adapter among small ones, or three equal ones on two
 * threads, take the item path instead, which splits tiles and parts over the threads).
 * weights[s]: segment s's adapter weights in this group (its A tiles and its parts' B blocks);
 * order: the segments heaviest first. Both set either way. */
static int whole_segments(const lora_seg *segs, int64_t nseg, const lora_part *parts,
                          const int64_t *pstart, int64_t d_in, int nthreads, int64_t *weights,
                          int64_t *order) {
    int64_t total = 0;
    for (int64_t s = 0; s < nseg; s++) {
        weights[s] = pad8(segs[s].rank) * d_in;
        for (int64_t p = pstart[s]; p < pstart[s + 1]; p++)
            weights[s] += (parts[p].o1 - parts[p].o0) * (parts[p].c1 - parts[p].c0);
        total += weights[s];
        order[s] = s;
    }
    for (int64_t i = 1; i < nseg; i++) /* insertion sort by weight, descending */
        for (int64_t k = i; k > 0 && weights[order[k]] > weights[order[k - 1]]; k--) {
            int64_t tmp = order[k]; order[k] = order[k - 1]; order[k - 1] = tmp;
        }
    if (nseg >= LORA_SEGS_PER_THREAD * nthreads) return 1;
    if (nthreads > LORA_SEGS_MAX_THREADS) return 0;
    int64_t load[LORA_SEGS_MAX_THREADS] = {0}, most = 0; /* each next one to the least loaded */
    for (int64_t i = 0; i < nseg; i++) {
        int least = 0;
        for (int k = 1; k < nthreads; k++) least = load[k] < load[least] ? k : least;
        load[least] += weights[order[i]];
        most = load[least] > most ? load[least] : most;
    }
    return (double)most * nthreads <= LORA_SEGMENTS_IMBALANCE * (double)total;
}

/* Decode: a thread takes a whole segment (shrink, then expand from its own t rows), in
 * `order`: no barrier between the phases, and the last ones to finish are small. */
static void decode_segments(const float *x, int64_t ldx, float *y, int64_t ldy, const wt *A,
                            int64_t a_slot, int64_t d_in, const wt *B, int64_t b_slot,
                            const lora_seg *segs, int64_t nseg, const lora_part *parts,
                            float *t, int64_t ldt, int64_t tile, int nthreads,
                            const int64_t *order, const int64_t *pstart) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t i = 0; i < nseg; i++) {
        const int64_t s = order[i], rpad = pad8(segs[s].rank);
        const lora_seg *g = segs + s;
        for (int64_t c0 = 0; c0 < rpad; c0 += tile) {
            int64_t w = rpad - c0 < tile ? rpad - c0 : tile;
            shrink_tokens(x, ldx, A + g->slot * a_slot + c0 * d_in, d_in, w, g->start, g->end,
                          t + c0, ldt);
        }
        for (int64_t p = pstart[s]; p < pstart[s + 1]; p++) {
            const lora_part *q = parts + p;
            expand_rows(t, ldt, B + g->slot * b_slot + q->boff, tile, q->o0, q->o1, q->c0,
                        q->c1 - q->c0, g->start, g->end, y, ldy);
        }
    }
}

int lora_sgmv(const float *x, int64_t ldx, float *y, int64_t ldy,
              const wt *A, int64_t a_slot, int64_t d_in,
              const wt *B, int64_t b_slot,
              const lora_seg *segs, int64_t nseg, const lora_part *parts, int64_t npart,
              float *t, int64_t ldt, int64_t tile, int nthreads) {
    /* Decode batches whose adapters share out evenly: one work item per segment
     * (whole_segments). Otherwise work items are numbered across segments' tiles and token
     * chunks (shrink) and parts' column and token chunks (expand); each phase is one dynamic
     * parallel loop over its items, so a few adapters, or one big one, still keep every thread
     * busy. Items write disjoint rows or columns: no races. */
    int64_t nshrink = 0, nexpand = 0;
    if (!lora_tile_ok(tile)) return -3;
    for (int64_t s = 0; s < nseg; s++) {
        if (pad8(segs[s].rank) > ldt) return -1;
        nshrink += shrink_items(segs + s, tile);
    }
    for (int64_t p = 0; p < npart; p++) nexpand += expand_items(parts + p, segs);

    int64_t maxlen = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (segs[s].end - segs[s].start > maxlen) maxlen = segs[s].end - segs[s].start;
    if (maxlen <= LORA_FUSE_MAX_TOKENS && nseg >= nthreads) {
        int64_t *order = malloc(nseg * sizeof *order);
        int64_t *pstart = malloc((nseg + 1) * sizeof *pstart);
        int64_t *weights = malloc(nseg * sizeof *weights);
        if (!order || !pstart || !weights) {
            free(order); free(pstart); free(weights);
            return -2;
        }
        for (int64_t s = 0, p = 0; s <= nseg; s++) { /* parts come in segment order */
            while (p < npart && parts[p].seg < s) p++;
            pstart[s] = p;
        }
        const int whole = whole_segments(segs, nseg, parts, pstart, d_in, nthreads, weights,
                                         order);
        if (whole) decode_segments(x, ldx, y, ldy, A, a_slot, d_in, B, b_slot, segs, nseg, parts,
                                   t, ldt, tile, nthreads, order, pstart);
        free(order); free(pstart); free(weights);
        if (whole) return 0;
    }

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nshrink; item++) {
            int64_t s = 0, base = 0, n;
            for (;; s++) { /* this item's segment, then its tile and token chunk there */
                n = shrink_items(segs + s, tile);
                if (base + n > item) break;
                base += n;
            }
            const lora_seg *g = segs + s;
            int64_t rpad = pad8(g->rank), nchunk = cdiv(g->end - g->start, LORA_SHRINK_TOKENS);
            int64_t k = (item - base) / nchunk, chunk = (item - base) % nchunk;
            int64_t c0 = k * tile, w = rpad - c0 < tile ? rpad - c0 : tile;
            int64_t tok0 = g->start + chunk * LORA_SHRINK_TOKENS;
            int64_t tok1 = tok0 + LORA_SHRINK_TOKENS < g->end ? tok0 + LORA_SHRINK_TOKENS : g->end;
            const wt *at = A + g->slot * a_slot + c0 * d_in; /* tile: [d_in, w] row-major */
            shrink_tokens(x, ldx, at, d_in, w, tok0, tok1, t + c0, ldt);
        }
        /* implicit barrier: every t row is complete before any expand reads it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nexpand; item++) {
            int64_t p = 0, base = 0;
            while (base + expand_items(parts + p, segs) <= item)
                base += expand_items(parts + p, segs), p++;
            const lora_part *q = parts + p;
            const lora_seg *g = segs + q->seg;
            const int64_t ntok = cdiv(g->end - g->start, LORA_EXPAND_TOKENS);
            const int64_t dc = (item - base) / ntok * LORA_EXPAND_COLS, c0 = q->c0 + dc;
            const int64_t c1 = c0 + LORA_EXPAND_COLS < q->c1 ? c0 + LORA_EXPAND_COLS : q->c1;
            const int64_t tok0 = g->start + (item - base) % ntok * LORA_EXPAND_TOKENS;
            const int64_t tok1 = tok0 + LORA_EXPAND_TOKENS < g->end ? tok0 + LORA_EXPAND_TOKENS
                                                                    : g->end;
            /* dc: whole strips */
            const wt *blk = B + g->slot * b_slot + q->boff + dc * (q->o1 - q->o0);
            expand_rows(t, ldt, blk, tile, q->o0, q->o1, c0, c1 - c0, tok0, tok1, y, ldy);
        }
    }
    return 0;
}
