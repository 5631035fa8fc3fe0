/* Segmented multi-LoRA shrink + expand, in one call per layer and module group:
 * y[tok] += (x[tok] @ A_s.T) @ B_s for every token of every segment (s = its adapter's slot),
 * B split into its per-module blocks (parts) so zero blocks are never read.
 *
 * Why C: a decode step of 16 adapters x 4 groups x 30 layers is ~4,400 tiny BLAS calls from
 * Python (~90 ms, twice the base model's whole step). Here each adapter's weights are streamed
 * once per step for all of its tokens, split over OpenMP threads; prefill-length segments use
 * the same register-tiled loops, which run at 2-3x the rate of per-segment BLAS calls.
 *
 * Layout (see adapters/slot_pool.py), with W = `tile` (16 or 64, the pool's tile width):
 * slot s's A.T (packed rank r, padded to 8) at A + s*a_slot as [d_in, <=W] row-major tiles,
 * tile k at + W*k*d_in; B[s] at B + s*b_slot.
 * segs: int64[nseg][4] = (slot, start, end, rank);
 * parts: int64[npart][6] = (seg, o0, o1, c0, c1, boff): rank rows [o0,o1) of t -> output
 * columns [c0,c1) of y, through the module's block of B at B[slot] + boff: B_m.T [r, n]
 * (r = o1-o0, n = c1-c0) stored as W-column strips, each [r, W] row-major at + W*k*r,
 * then the last n % W columns as [r, n % W] (layout.b_strips): every strip is one stream.
 * t: scratch [T, ldt] (ldt >= every padded rank), rows of the segments' tokens are written.
 * Built with -O3 -march=native -ffp-contract=fast; GCC vector extensions give AVX-512 FMA
 * code, 6 tokens x 64 columns per register tile. Without AVX-512 the tiles are 6 tokens x 16
 * columns (12 ymm accumulators): the 6 x 64 tiles' 48 accumulators spilled, and on a Zen 3
 * host the narrower tiles made a 2048-token step's LoRA ops 2.4x faster (benchmarks/kernel_ab.py).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32))); /* the last 8 columns of an A tile */
/* x in every lane, as one broadcast load: `(v8){0} + x` compiled to a scalar add of zero and a
 * register broadcast (IEEE: -0 + 0 is +0, so the add cannot be dropped) on the FMA loops'
 * critical ports, ~2x the prefill time of the AVX2 tiles (benchmarks/kernel_ab.py) */
static inline v8 splat8(float x) { return (v8){x, x, x, x, x, x, x, x}; }
/* 16 floats: one zmm register with AVX-512. Without it, gcc expands 64-byte vector
 * arithmetic piecewise (-Wvector-operation-performance) and the kernel ran 8x slower; there a
 * v16 is two 8-float halves, each one ymm register. */
#ifdef __AVX512F__
typedef float v16 __attribute__((vector_size(64)));
static inline v16 bcast(float x) {
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
static inline v16 madd(v16 a, v16 b, v16 c) { return c + a * b; }
#else
typedef struct { v8 lo, hi; } v16;
static inline v16 bcast(float x) { v8 h = splat8(x); return (v16){h, h}; }
static inline v16 madd(v16 a, v16 b, v16 c) {
    return (v16){c.lo + a.lo * b.lo, c.hi + a.hi * b.hi};
}
#endif

static inline v16 ld(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static inline v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* Adapter weights (A, B) are float32, or with -DLORA_BF16 bfloat16: the upper 16 bits of a
 * float32, widened exactly on load; x, t, y and all arithmetic stay float32. */
#ifdef LORA_BF16
typedef uint16_t wt;
typedef uint16_t bf16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
static inline v16 ldw(const wt *p) {
    bf16x16 h;
    memcpy(&h, p, sizeof h);
    u32x16 u = __builtin_convertvector(h, u32x16) << 16;
    v16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}
static inline v8 ldw8(const wt *p) {
    uint16_t h __attribute__((vector_size(16)));
    memcpy(&h, p, sizeof h);
    uint32_t u __attribute__((vector_size(32))) =
        __builtin_convertvector(h, uint32_t __attribute__((vector_size(32)))) << 16;
    v8 v;
    memcpy(&v, &u, sizeof v);
    return v;
}
static inline float wf(wt w) {
    uint32_t u = (uint32_t)w << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#else
typedef float wt;
static inline v16 ldw(const wt *p) { return ld(p); }
static inline v8 ldw8(const wt *p) { return ld8(p); }
static inline float wf(wt w) { return w; }
#endif

/* The slot pool's tile width (`tile`, the width of A tiles and B strips, layout.py) is a
 * runtime argument: 64 suits the AVX-512 tiles (4 zmm vectors a row). On AVX2 builds 16 is
 * preferred (lora_preferred_tile): a 16-column register tile then reads its A tile or B strip
 * as one sequential stream instead of every 4th line of 64-float rows, and a decode step's
 * LoRA ops measured 0.72x the time on a Zen 3 host (benchmarks/kernel_ab.py). */
#ifdef __AVX512F__
#define PREFERRED_TILE 64
#else
#define PREFERRED_TILE 16
#endif
int lora_preferred_tile(void) { return PREFERRED_TILE; }
int lora_accepts_tile(int64_t tile) {
#ifdef __AVX512F__
    return tile == 64;
#else
    return tile == 16 || tile == 64;
#endif
}
#define TOK_CHUNK 60   /* shrink work item: tokens of one segment against one A tile */
#define COL_CHUNK 2048 /* expand work item: output columns of one part... */
#define TOK_CHUNK_E 256 /* ...for this many tokens of its segment (long prompts: both threads) */
#define PW 6 /* int64 fields per part */
#define FUSE_MAX_TOKENS 8 /* segments up to this long run shrink+expand in one work item */

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t pad8(int64_t r) { return (r + 7) / 8 * 8; } /* layout.padded_rank */

/* Shrink tile: t[tok+k, 0:w] = x[tok+k] @ at for NT tokens, at = one A tile [d_in, w] with
 * w = 16*NV + 8*H floats: each x element is broadcast against the tile's NV vectors (and its
 * last 8 columns when H), so the FMA chains stay in registers with no horizontal sums. NT, NV
 * and H are constants in every instantiation (always_inline): the guarded lines compile away.
 * (Ranks are padded to 8, not 16: rank-8 modules, the most common, read no padding.) */
#define ACC(k) v16 c##k##0 = {0}, c##k##1 = {0}, c##k##2 = {0}, c##k##3 = {0}; v8 h##k = {0}
#define FMAT(k) do { if (NT > k) { float xs_ = x##k[i]; v16 xb = bcast(xs_);          \
    if (NV > 0) c##k##0 = madd(xb, b0, c##k##0);                                       \
    if (NV > 1) c##k##1 = madd(xb, b1, c##k##1);                                       \
    if (NV > 2) c##k##2 = madd(xb, b2, c##k##2);                                       \
    if (NV > 3) c##k##3 = madd(xb, b3, c##k##3);                                       \
    if (H) h##k += splat8(xs_) * bh; } } while (0)
#define STT(k) do { if (NT > k) { float *o = t + (k) * ldt;                          \
    if (NV > 0) st(o, c##k##0);                                                        \
    if (NV > 1) st(o + 16, c##k##1);                                                   \
    if (NV > 2) st(o + 32, c##k##2);                                                   \
    if (NV > 3) st(o + 48, c##k##3);                                                   \
    if (H) st8(o + 16 * NV, h##k); } } while (0)

static inline __attribute__((always_inline)) void
shrink_tile(const float *x, int64_t ldx, const wt *at, int64_t d_in, float *t, int64_t ldt,
            int pf, const int NT, const int NV, const int H) {
    const int64_t lda = 16 * NV + 8 * H;
    const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx,
                *x5 = x4 + ldx;
    ACC(0); ACC(1); ACC(2); ACC(3); ACC(4); ACC(5);
    v16 b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    v8 bh = {0};
    for (int64_t i = 0; i < d_in; i++) {
        const wt *ar = at + i * lda;
        if (pf) /* first pass over this tile, from memory: fetch 8 rows ahead */
            for (int v = 0; v < NV + H; v++) __builtin_prefetch(ar + 8 * lda + 16 * v, 0, 0);
        if (NV > 0) b0 = ldw(ar);
        if (NV > 1) b1 = ldw(ar + 16);
        if (NV > 2) b2 = ldw(ar + 32);
        if (NV > 3) b3 = ldw(ar + 48);
        if (H) bh = ldw8(ar + 16 * NV);
        FMAT(0); FMAT(1); FMAT(2); FMAT(3); FMAT(4); FMAT(5);
    }
    STT(0); STT(1); STT(2); STT(3); STT(4); STT(5);
}

#ifdef __AVX512F__
#define TILE_W(NT)                                                                         \
    switch (w / 8) {                                                                       \
    case 1: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 0, 1); break;                  \
    case 2: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 1, 0); break;                  \
    case 3: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 1, 1); break;                  \
    case 4: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 2, 0); break;                  \
    case 5: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 2, 1); break;                  \
    case 6: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 3, 0); break;                  \
    case 7: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 3, 1); break;                  \
    default: shrink_tile(xs, ldx, at, d_in, ts, ldt, pf, NT, 4, 0); break;                 \
    }
#endif

#ifndef __AVX512F__
/* Without AVX-512: 6 tokens x 16 (or 8) columns of the tile at a time, so the accumulators
 * (12) stay in the 16 ymm registers; the tile's rows are lda = w floats apart. */
#define SACC(k) v8 s##k##0 = {0}, s##k##1 = {0}
#define SFMA(k) do { if (NT > k) { v8 xb = splat8(x##k[i]);                             \
    s##k##0 += xb * a0; if (W16) s##k##1 += xb * a1; } } while (0)
#define SST(k) do { if (NT > k) { float *o = t + (k) * ldt; st8(o, s##k##0);             \
    if (W16) st8(o + 8, s##k##1); } } while (0)

static inline __attribute__((always_inline)) void
shrink_tile16(const float *x, int64_t ldx, const wt *at, int64_t lda, int64_t d_in, float *t,
              int64_t ldt, const int NT, const int W16, const int PF) {
    const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx,
                *x5 = x4 + ldx;
    SACC(0); SACC(1); SACC(2); SACC(3); SACC(4); SACC(5);
    for (int64_t i = 0; i < d_in; i++) {
        const wt *ar = at + i * lda;
        if (PF) __builtin_prefetch(ar + 8 * lda, 0, 0);
        const v8 a0 = ldw8(ar), a1 = W16 ? ldw8(ar + 8) : (v8){0};
        SFMA(0); SFMA(1); SFMA(2); SFMA(3); SFMA(4); SFMA(5);
    }
    SST(0); SST(1); SST(2); SST(3); SST(4); SST(5);
}

#define TILE16(NT)                                                                         \
    for (int64_t c = 0; c < w; c += 16) {                                                  \
        if (w - c >= 16) { if (pf) shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 1, 1); \
                           else shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 1, 0); } \
        else shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 0, pf);              \
    }
#define TILE_W(NT) TILE16(NT)
#endif

/* t[tok0:tok1, 0:w] = x[tok0:tok1] @ at (w: 8..64, a multiple of 8), 6 tokens at a time. */
static void shrink_tokens(const float *x, int64_t ldx, const wt *at, int64_t d_in, int64_t w,
                          int64_t tok0, int64_t tok1, float *t, int64_t ldt) {
    for (int64_t tok = tok0; tok < tok1;) {
        const int64_t nt = tok1 - tok < 6 ? tok1 - tok : 6;
        const int pf = tok == tok0;
        const float *xs = x + tok * ldx;
        float *ts = t + tok * ldt;
        switch (nt) {
        case 1: TILE_W(1) break;
        case 2: TILE_W(2) break;
        case 3: TILE_W(3) break;
        case 4: TILE_W(4) break;
        case 5: TILE_W(5) break;
        default: TILE_W(6) break;
        }
        tok += nt;
    }
}

/* Expand tiles: y[tok, c:c+64] += t[tok, o0:o1] @ blk[:, c:c+64], accumulated in registers over
 * all rows, so each y tile is loaded and stored once (storing y per row made the expand
 * store-bound; per 8 rows, bound by moving y through L2/L3 on long segments). */
#define PF_ROWS 8 /* software prefetch distance, in rows of B */

/* NT tokens x 64 columns: 4*NT named accumulators (GCC keeps them in zmm registers; an
 * a[4][4] array went to the stack), NT a constant in every instantiation. */
#define YLD(k) v16 y##k##0 = {0}, y##k##1 = {0}, y##k##2 = {0}, y##k##3 = {0};             \
    if (NT > k) { const float *p = y + (k) * ldy; y##k##0 = ld(p); y##k##1 = ld(p + 16);   \
                  y##k##2 = ld(p + 32); y##k##3 = ld(p + 48); }
#define YFMA(k) do { if (NT > k) { v16 s = bcast(t[(k) * ldt + j]);                       \
    y##k##0 = madd(s, b0, y##k##0); y##k##1 = madd(s, b1, y##k##1);                        \
    y##k##2 = madd(s, b2, y##k##2); y##k##3 = madd(s, b3, y##k##3); } } while (0)
#define YST(k) do { if (NT > k) { float *p = y + (k) * ldy; st(p, y##k##0);               \
    st(p + 16, y##k##1); st(p + 32, y##k##2); st(p + 48, y##k##3); } } while (0)

/* y[0:NT, 0:64] += t[0:NT, o0:o1] @ b[0:o1-o0, 0:64] (t, y at the tile's first token and
 * column; b: one strip, rows ldp apart). */
#ifdef __AVX512F__
static inline __attribute__((always_inline)) void
expand_tile(const float *t, int64_t ldt, const wt *b, int64_t ldp, int64_t o0, int64_t o1,
            float *y, int64_t ldy, int pf, const int NT) {
    YLD(0) YLD(1) YLD(2) YLD(3) YLD(4) YLD(5)
    for (int64_t j = o0; j < o1; j++, b += ldp) {
        if (pf && j + PF_ROWS < o1) { /* on the first pass over this strip of B */
            const wt *p = b + PF_ROWS * ldp;
            __builtin_prefetch(p, 0, 0), __builtin_prefetch(p + 16, 0, 0);
            __builtin_prefetch(p + 32, 0, 0), __builtin_prefetch(p + 48, 0, 0);
        }
        v16 b0 = ldw(b), b1 = ldw(b + 16), b2 = ldw(b + 32), b3 = ldw(b + 48);
        YFMA(0); YFMA(1); YFMA(2); YFMA(3); YFMA(4); YFMA(5);
    }
    YST(0); YST(1); YST(2); YST(3); YST(4); YST(5);
}
#endif

#ifndef __AVX512F__
/* Without AVX-512 the 6 x 64 tile's 48 ymm accumulators spill (16 registers): 6 tokens x 16
 * columns instead, 12 accumulators + 2 of B + 1 broadcast, and four of them per strip. */
#define ZLD(k) v8 z##k##0 = {0}, z##k##1 = {0};                                          \
    if (NT > k) { const float *p = y + (k) * ldy; z##k##0 = ld8(p); z##k##1 = ld8(p + 8); }
#define ZFMA(k) do { if (NT > k) { v8 s = splat8(t[(k) * ldt + j]);                     \
    z##k##0 += s * b0; z##k##1 += s * b1; } } while (0)
#define ZST(k) do { if (NT > k) { float *p = y + (k) * ldy; st8(p, z##k##0);             \
    st8(p + 8, z##k##1); } } while (0)

static inline __attribute__((always_inline)) void
expand_tile16(const float *t, int64_t ldt, const wt *b, int64_t ldp, int64_t o0, int64_t o1,
              float *y, int64_t ldy, const int NT, const int PF) {
    ZLD(0) ZLD(1) ZLD(2) ZLD(3) ZLD(4) ZLD(5)
    for (int64_t j = o0; j < o1; j++, b += ldp) {
        if (PF && j + PF_ROWS < o1) __builtin_prefetch(b + PF_ROWS * ldp, 0, 0);
        const v8 b0 = ldw8(b), b1 = ldw8(b + 8);
        ZFMA(0); ZFMA(1); ZFMA(2); ZFMA(3); ZFMA(4); ZFMA(5);
    }
    ZST(0); ZST(1); ZST(2); ZST(3); ZST(4); ZST(5);
}

static inline __attribute__((always_inline)) void
expand_tile(const float *t, int64_t ldt, const wt *b, int64_t ldp, int64_t o0, int64_t o1,
            float *y, int64_t ldy, int pf, const int NT) {
    for (int c = 0; c < ldp; c += 16) { /* ldp: the strip's width, 16 or 64 */
        if (pf) expand_tile16(t, ldt, b + c, ldp, o0, o1, y + c, ldy, NT, 1);
        else expand_tile16(t, ldt, b + c, ldp, o0, o1, y + c, ldy, NT, 0);
    }
}
#endif

/* y[tok, c0:c0+n) += t[tok, o0:o1] @ blk for tokens [tok0, tok1), where blk holds the
 * part's [o1-o0, n] block of B as strips (see the top of this file). */
static void expand_rows(const float *t, int64_t ldt, const wt *blk, int64_t strip,
                        int64_t o0, int64_t o1, int64_t c0, int64_t n, int64_t tok0,
                        int64_t tok1, float *y, int64_t ldy) {
    const int64_t n64 = n / strip * strip, r = o1 - o0, ldp = strip;
    for (int64_t tok = tok0; tok < tok1;) {
        const int64_t nt = tok1 - tok < 6 ? tok1 - tok : 6;
        for (int64_t c = 0; c < n64; c += strip) {
            const float *tt = t + tok * ldt;
            float *yt = y + tok * ldy + c0 + c;
            const int pf = tok == tok0;
            switch (nt) {
            case 1: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 1); break;
            case 2: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 2); break;
            case 3: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 3); break;
            case 4: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 4); break;
            case 5: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 5); break;
            default: expand_tile(tt, ldt, blk + c * r, ldp, o0, o1, yt, ldy, pf, 6); break;
            }
        }
        tok += nt;
    }
    const wt *tail = blk + n64 * r; /* the last n - n64 columns: [r, n - n64] */
    for (int64_t tok = tok0; tok < tok1; tok++)
        for (int64_t c = n64; c < n; c++) {
            float acc = y[tok * ldy + c0 + c];
            for (int64_t j = o0; j < o1; j++) /* one FMA per product, as in the tiles */
                acc = __builtin_fmaf(t[tok * ldt + j], wf(tail[(j - o0) * (n - n64) + c - n64]),
                                     acc);
            y[tok * ldy + c0 + c] = acc;
        }
}

/* Shrink work items of one segment: its A.T tiles times its token chunks. */
static int64_t shrink_items(const int64_t *g, int64_t tile) {
    return cdiv(pad8(g[3]), tile) * cdiv(g[2] - g[1], TOK_CHUNK);
}

/* Expand work items of one part: its column chunks times its segment's token chunks. */
static int64_t expand_items(const int64_t *q, const int64_t *segs) {
    const int64_t *g = segs + 4 * q[0];
    return cdiv(q[4] - q[3], COL_CHUNK) * cdiv(g[2] - g[1], TOK_CHUNK_E);
}

int lora_sgmv(const float *x, int64_t ldx, float *y, int64_t ldy,
              const wt *A, int64_t a_slot, int64_t d_in,
              const wt *B, int64_t b_slot,
              const int64_t *segs, int64_t nseg, const int64_t *parts, int64_t npart,
              float *t, int64_t ldt, int64_t tile, int nthreads) {
    /* Decode batches of many adapters: one work item per segment (below). Otherwise work
     * items are numbered across segments' tiles and token chunks (shrink) and parts' column
     * and token chunks (expand); each phase is one dynamic parallel loop over its items, so a few
     * adapters, or one big one, still keep every thread busy. Items write disjoint rows or
     * columns: no races. */
    int64_t nshrink = 0, nexpand = 0;
    if (!lora_accepts_tile(tile)) return -3;
    for (int64_t s = 0; s < nseg; s++) {
        if (pad8(segs[4 * s + 3]) > ldt) return -1;
        nshrink += shrink_items(segs + 4 * s, tile);
    }
    for (int64_t p = 0; p < npart; p++) nexpand += expand_items(parts + PW * p, segs);

    int64_t maxlen = 0;
    for (int64_t s = 0; s < nseg; s++)
        if (segs[4 * s + 2] - segs[4 * s + 1] > maxlen) maxlen = segs[4 * s + 2] - segs[4 * s + 1];
    if (nseg >= 4 * nthreads && maxlen <= FUSE_MAX_TOKENS) {
        /* Decode: enough adapters to keep every thread busy, so a thread takes a whole segment
         * (shrink, then expand from its own t rows): no barrier between the phases, and the
         * biggest segments go first so the last ones to finish are small. */
        int64_t *order = malloc(nseg * sizeof *order), *pstart = malloc((nseg + 1) * sizeof *pstart);
        if (!order || !pstart) { free(order); free(pstart); return -2; }
        for (int64_t s = 0; s < nseg; s++) order[s] = s;
        for (int64_t i = 1; i < nseg; i++) /* insertion sort by rank, descending */
            for (int64_t k = i; k > 0 && segs[4 * order[k] + 3] > segs[4 * order[k - 1] + 3]; k--) {
                int64_t tmp = order[k]; order[k] = order[k - 1]; order[k - 1] = tmp;
            }
        for (int64_t s = 0, p = 0; s <= nseg; s++) { /* parts come in segment order */
            while (p < npart && parts[PW * p] < s) p++;
            pstart[s] = p;
        }
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int64_t i = 0; i < nseg; i++) {
            const int64_t s = order[i], *g = segs + 4 * s, rpad = pad8(g[3]);
            for (int64_t c0 = 0; c0 < rpad; c0 += tile) {
                int64_t w = rpad - c0 < tile ? rpad - c0 : tile;
                shrink_tokens(x, ldx, A + g[0] * a_slot + c0 * d_in, d_in, w, g[1], g[2],
                              t + c0, ldt);
            }
            for (int64_t p = pstart[s]; p < pstart[s + 1]; p++) {
                const int64_t *q = parts + PW * p;
                expand_rows(t, ldt, B + g[0] * b_slot + q[5], tile, q[1], q[2], q[3], q[4] - q[3],
                            g[1], g[2], y, ldy);
            }
        }
        free(order);
        free(pstart);
        return 0;
    }

#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nshrink; item++) {
            int64_t s = 0, base = 0, n;
            for (;; s++) { /* this item's segment, then its tile and token chunk there */
                n = shrink_items(segs + 4 * s, tile);
                if (base + n > item) break;
                base += n;
            }
            const int64_t *g = segs + 4 * s;
            int64_t rpad = pad8(g[3]), nchunk = cdiv(g[2] - g[1], TOK_CHUNK);
            int64_t k = (item - base) / nchunk, chunk = (item - base) % nchunk;
            int64_t c0 = k * tile, w = rpad - c0 < tile ? rpad - c0 : tile;
            int64_t tok0 = g[1] + chunk * TOK_CHUNK, tok1 = tok0 + TOK_CHUNK < g[2] ? tok0 + TOK_CHUNK : g[2];
            const wt *at = A + g[0] * a_slot + c0 * d_in; /* tile: [d_in, w] row-major */
            shrink_tokens(x, ldx, at, d_in, w, tok0, tok1, t + c0, ldt);
        }
        /* implicit barrier: every t row is complete before any expand reads it */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < nexpand; item++) {
            int64_t p = 0, base = 0;
            while (base + expand_items(parts + PW * p, segs) <= item)
                base += expand_items(parts + PW * p, segs), p++;
            const int64_t *q = parts + PW * p, *g = segs + 4 * q[0];
            const int64_t ntok = cdiv(g[2] - g[1], TOK_CHUNK_E);
            const int64_t dc = (item - base) / ntok * COL_CHUNK, c0 = q[3] + dc;
            const int64_t c1 = c0 + COL_CHUNK < q[4] ? c0 + COL_CHUNK : q[4];
            const int64_t tok0 = g[1] + (item - base) % ntok * TOK_CHUNK_E;
            const int64_t tok1 = tok0 + TOK_CHUNK_E < g[2] ? tok0 + TOK_CHUNK_E : g[2];
            const wt *blk = B + g[0] * b_slot + q[5] + dc * (q[2] - q[1]); /* dc: whole strips */
            expand_rows(t, ldt, blk, tile, q[1], q[2], c0, c1 - c0, tok0, tok1, y, ldy);
        }
    }
    return 0;
}
