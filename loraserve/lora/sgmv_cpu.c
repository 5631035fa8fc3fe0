/* Segmented multi-LoRA shrink + expand for short segments (decode), in one call per layer
 * and module group: y[tok] += (x[tok] @ A[s, :r].T) @ B[s, :r] for every token of every
 * segment, B split into its per-module blocks (parts) so zero blocks are never read.
 *
 * Why C: a decode step of 16 adapters x 4 groups x 30 layers is ~4,400 tiny BLAS calls from
 * Python (~90 ms, twice the base model's whole step). Here each adapter's A and B rows are
 * streamed once per step for all of its tokens, split over OpenMP threads.
 *
 * Layout (see adapters/slot_pool.py): A[s] at A + s*a_slot, row j at + j*d_in; B[s] at
 * B + s*b_slot. segs: int64[nseg][4] = (slot, start, end, rank);
 * parts: int64[npart][7] = (seg, o0, o1, c0, c1, boff, ldp): rank rows [o0,o1) of t -> output
 * columns [c0,c1) of y, through the block of B at B[slot] + boff with row stride ldp.
 * t: scratch [T, ldt] (ldt >= every rank), rows of the segments' tokens are written.
 * Built with -O3 -march=native -ffp-contract=fast; GCC vector extensions give AVX-512 FMA
 * (or 2x AVX2) code.
 */
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline float hsum(v16 v) {
    float s = 0.f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

#define TOK_BLOCK 4   /* shrink: tokens per weight-row read (shrink_rows2x4) */
#define ROW_CHUNK 16  /* shrink work item: rank rows of one segment */
#define COL_CHUNK 2048 /* expand work item: output columns of one part */
#define PW 7 /* int64 fields per part */

/* t[tok, j..j+1] = x[tok] . A[j], x[tok] . A[j+1] for 4 tokens from tok0: eight independent
 * FMA chains in registers (enough to keep both FMA pipes busy on long segments); each x vector
 * load serves two weight rows and each weight vector four tokens. */
static void shrink_rows2x4(const float *x, int64_t ldx, const float *a, int64_t d_in,
                           int64_t tok0, float *t, int64_t ldt, int64_t j, int pf) {
    const float *x0 = x + tok0 * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    const float *a1 = a + d_in;
    v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};
    int64_t i = 0;
    for (; i + 16 <= d_in; i += 16) {
        if (pf) { /* next row pair from memory: the hardware prefetcher ramps up too slowly */
            __builtin_prefetch(a + 2 * d_in + i, 0, 0);
            __builtin_prefetch(a + 3 * d_in + i, 0, 0);
        }
        v16 av = ld(a + i), bv = ld(a1 + i), xv;
        xv = ld(x0 + i); s0 += av * xv; u0 += bv * xv;
        xv = ld(x1 + i); s1 += av * xv; u1 += bv * xv;
        xv = ld(x2 + i); s2 += av * xv; u2 += bv * xv;
        xv = ld(x3 + i); s3 += av * xv; u3 += bv * xv;
    }
    float r[8] = {hsum(s0), hsum(s1), hsum(s2), hsum(s3), hsum(u0), hsum(u1), hsum(u2), hsum(u3)};
    const float *xs[4] = {x0, x1, x2, x3};
    for (; i < d_in; i++)
        for (int k = 0; k < 4; k++) r[k] += a[i] * xs[k][i], r[4 + k] += a1[i] * xs[k][i];
    for (int k = 0; k < 4; k++) {
        t[(tok0 + k) * ldt + j] = r[k];
        t[(tok0 + k) * ldt + j + 1] = r[4 + k];
    }
}

static void shrink_row1(const float *x, int64_t ldx, const float *a, int64_t d_in,
                        int64_t tok, float *t, int64_t ldt, int64_t j) {
    const float *xr = x + tok * ldx;
    v16 s0 = {0}, s1 = {0};
    int64_t i = 0;
    for (; i + 32 <= d_in; i += 32) {
        s0 += ld(a + i) * ld(xr + i);
        s1 += ld(a + i + 16) * ld(xr + i + 16);
    }
    for (; i + 16 <= d_in; i += 16) s0 += ld(a + i) * ld(xr + i);
    float r = hsum(s0 + s1);
    for (; i < d_in; i++) r += a[i] * xr[i];
    t[tok * ldt + j] = r;
}

/* Expand tiles: y[tok, c:c+64] += t[tok, o0:o1] @ blk[:, c:c+64], accumulated in registers over
 * all rows, so each y tile is loaded and stored once (storing y per row made the expand
 * store-bound; per 8 rows, bound by moving y through L2/L3 on long segments). */
#define PF_ROWS 8 /* software prefetch distance, in rows of B */

/* 16 named accumulators: GCC keeps these in zmm registers (an a[4][4] array went to the stack). */
#define LD4(a, p) v16 a##0 = ld(p), a##1 = ld((p) + 16), a##2 = ld((p) + 32), a##3 = ld((p) + 48)
#define ST4(p, a) (st(p, a##0), st((p) + 16, a##1), st((p) + 32, a##2), st((p) + 48, a##3))
#define FMA4(a, s) (a##0 += (s) * b0, a##1 += (s) * b1, a##2 += (s) * b2, a##3 += (s) * b3)

static void expand_tile4(const float *t, int64_t ldt, const float *blk, int64_t ldp,
                         int64_t o0, int64_t o1, int64_t c, int64_t tok,
                         float *y, int64_t ldy, int pf) {
    float *y0 = y + tok * ldy + c, *y1 = y0 + ldy, *y2 = y1 + ldy, *y3 = y2 + ldy;
    const float *t0 = t + tok * ldt, *t1 = t0 + ldt, *t2 = t1 + ldt, *t3 = t2 + ldt;
    LD4(p, y0); LD4(q, y1); LD4(r, y2); LD4(u, y3);
    for (int64_t j = o0; j < o1; j++) {
        const float *b = blk + (j - o0) * ldp + c;
        if (pf && j + PF_ROWS < o1) { /* on the first pass over this strip of B */
            const float *p = b + PF_ROWS * ldp;
            __builtin_prefetch(p, 0, 0), __builtin_prefetch(p + 16, 0, 0);
            __builtin_prefetch(p + 32, 0, 0), __builtin_prefetch(p + 48, 0, 0);
        }
        LD4(b, b);
        FMA4(p, t0[j]); FMA4(q, t1[j]); FMA4(r, t2[j]); FMA4(u, t3[j]);
    }
    ST4(y0, p); ST4(y1, q); ST4(y2, r); ST4(y3, u);
}

static void expand_tile1(const float *t, int64_t ldt, const float *blk, int64_t ldp,
                         int64_t o0, int64_t o1, int64_t c, int64_t tok, float *y, int64_t ldy) {
    float *yr = y + tok * ldy + c;
    const float *tr = t + tok * ldt;
    v16 a0 = ld(yr), a1 = ld(yr + 16), a2 = ld(yr + 32), a3 = ld(yr + 48);
    for (int64_t j = o0; j < o1; j++) {
        const float *b = blk + (j - o0) * ldp + c;
        const float s = tr[j];
        a0 += s * ld(b); a1 += s * ld(b + 16); a2 += s * ld(b + 32); a3 += s * ld(b + 48);
    }
    st(yr, a0); st(yr + 16, a1); st(yr + 32, a2); st(yr + 48, a3);
}

/* y[tok, c0:c0+n) += t[tok, o0:o1] @ blk for tokens [tok0, tok1), where blk is the part's
 * [o1-o0, n] block of B (row stride ldp). */
static void expand_rows(const float *t, int64_t ldt, const float *blk, int64_t ldp,
                        int64_t o0, int64_t o1, int64_t c0, int64_t n, int64_t tok0,
                        int64_t tok1, float *y, int64_t ldy) {
    int64_t n64 = n / 64 * 64;
    for (int64_t c = 0; c < n64; c += 64) { /* a 64-column strip of B: r x 256 B, L1-resident */
        int64_t tok = tok0;
        for (; tok + 4 <= tok1; tok += 4)
            expand_tile4(t, ldt, blk, ldp, o0, o1, c, tok, y + c0, ldy, tok == tok0);
        for (; tok < tok1; tok++) expand_tile1(t, ldt, blk, ldp, o0, o1, c, tok, y + c0, ldy);
    }
    for (int64_t tok = tok0; tok < tok1; tok++) /* columns past the last 64-wide strip */
        for (int64_t c = n64; c < n; c++) {
            float acc = y[tok * ldy + c0 + c];
            for (int64_t j = o0; j < o1; j++) acc += t[tok * ldt + j] * blk[(j - o0) * ldp + c];
            y[tok * ldy + c0 + c] = acc;
        }
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int lora_sgmv(const float *x, int64_t ldx, float *y, int64_t ldy,
              const float *A, int64_t a_slot, int64_t d_in,
              const float *B, int64_t b_slot,
              const int64_t *segs, int64_t nseg, const int64_t *parts, int64_t npart,
              float *t, int64_t ldt, int nthreads) {
    /* Work items are numbered across segments (shrink) and parts (expand); each phase is
     * one dynamic parallel loop over its items, so many small adapters and one big one
     * both keep every thread busy. Items write disjoint rows or columns: no races. */
    int64_t nshrink = 0, nexpand = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (segs[4 * s + 3] > ldt) return -1;
        nshrink += cdiv(segs[4 * s + 3], ROW_CHUNK);
    }
    for (int64_t p = 0; p < npart; p++) nexpand += cdiv(parts[PW * p + 4] - parts[PW * p + 3], COL_CHUNK);

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nshrink; item++) {
            int64_t s = 0, base = 0;
            while (base + cdiv(segs[4 * s + 3], ROW_CHUNK) <= item) base += cdiv(segs[4 * s + 3], ROW_CHUNK), s++;
            const int64_t *g = segs + 4 * s;
            int64_t j0 = (item - base) * ROW_CHUNK, j1 = j0 + ROW_CHUNK < g[3] ? j0 + ROW_CHUNK : g[3];
            const float *As = A + g[0] * a_slot;
            int64_t tok = g[1];
            for (; tok + TOK_BLOCK <= g[2]; tok += TOK_BLOCK) {
                int64_t j = j0;
                for (; j + 2 <= j1; j += 2)
                    shrink_rows2x4(x, ldx, As + j * d_in, d_in, tok, t, ldt, j, tok == g[1]);
                for (; j < j1; j++)
                    for (int64_t k = tok; k < tok + TOK_BLOCK; k++)
                        shrink_row1(x, ldx, As + j * d_in, d_in, k, t, ldt, j);
            }
            for (; tok < g[2]; tok++)
                for (int64_t j = j0; j < j1; j++)
                    shrink_row1(x, ldx, As + j * d_in, d_in, tok, t, ldt, j);
        }
        /* implicit barrier: every t row is complete before any expand reads it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nexpand; item++) {
            int64_t p = 0, base = 0;
            while (base + cdiv(parts[PW * p + 4] - parts[PW * p + 3], COL_CHUNK) <= item)
                base += cdiv(parts[PW * p + 4] - parts[PW * p + 3], COL_CHUNK), p++;
            const int64_t *q = parts + PW * p, *g = segs + 4 * q[0];
            int64_t dc = (item - base) * COL_CHUNK, c0 = q[3] + dc;
            int64_t c1 = c0 + COL_CHUNK < q[4] ? c0 + COL_CHUNK : q[4];
            const float *blk = B + g[0] * b_slot + q[5] + dc;
            expand_rows(t, ldt, blk, q[6], q[1], q[2], c0, c1 - c0, g[1], g[2], y, ldy);
        }
    }
    return 0;
}
