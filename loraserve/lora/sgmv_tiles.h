/* The LoRA op's register tiles, shared by the segmented op (sgmv_cpu.c) and the ops fused with
 * the GEMM (gemm_expand_cpu.c, gemm_lora_decode_cpu.c): the shrink t = x @ A.T and the expand
 * y += t @ B, over the slot pool's layout (sgmv_cpu.c's top comment, layout.py).
 *
 * Tiles are LORA_TILE_TOKENS (6) tokens by 64 columns (4 zmm vectors) with AVX-512; without it
 * 6 tokens by 16 columns (12 ymm accumulators: the 6 x 64 tiles' 48 spilled), four per 64-wide
 * tile. Products are summed in order over the rank or d_in (f32xN_madd: fused as the target's
 * tuning decides, the same in every kernel built from this header): a token's results do not
 * depend on which tokens share its tile.
 *
 * Adapter weights (A, B) are float32, or with -DLORA_BF16 bfloat16: the upper 16 bits of a
 * float32, widened exactly on load; x, t, y and all arithmetic stay float32.
 */
#ifndef LORASERVE_SGMV_TILES_H
#define LORASERVE_SGMV_TILES_H

#include <stdint.h>
#include <string.h>

#include "../ops/simd.h"
#include "../ops/tuning.h"

#ifdef LORA_BF16
typedef uint16_t wt;
#define WT_LOAD8 f32x8_load_bf16
#define WT_LOAD16 f32x16_load_bf16
static inline float wf(wt w) {
    uint32_t u = (uint32_t)w << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
#else
typedef float wt;
#define WT_LOAD8 f32x8_load
#define WT_LOAD16 f32x16_load
static inline float wf(wt w) { return w; }
#endif

/* Whether this build reads slot pools of tile width `tile` (A tiles, B strips): the AVX-512
 * tiles are 64 wide; the 16-wide ones read 16 or 64. */
static inline int lora_tile_ok(int64_t tile) {
#ifdef __AVX512F__
    return tile == 64;
#else
    return tile == 16 || tile == 64;
#endif
}

/* ---- shrink: t[tok, 0:w] = x[tok] @ at, at one A tile [d_in, w] ----------------------------
 * Each x element is broadcast against the tile's vectors, so the FMA chains stay in registers
 * with no horizontal sums. NT (tokens), NV (16-wide vectors), H (a last 8-wide one) and PF
 * (fetch ahead: the tile's first pass, from memory) are constants in every instantiation
 * (always_inline): the guarded lines compile away. Ranks are padded to 8, not 16: rank-8
 * modules, the most common, read no padding. */
#ifdef __AVX512F__
#define ACC(k)                                                                             \
    f32x16 c##k##0 = f32x16_zero(), c##k##1 = f32x16_zero(), c##k##2 = f32x16_zero(),      \
           c##k##3 = f32x16_zero();                                                        \
    f32x8 h##k = f32x8_zero()
#define FMAT(k) do { if (NT > k) { float xs_ = x##k[i]; f32x16 xb = f32x16_set1(xs_);      \
    if (NV > 0) c##k##0 = f32x16_madd(xb, b0, c##k##0);                                     \
    if (NV > 1) c##k##1 = f32x16_madd(xb, b1, c##k##1);                                     \
    if (NV > 2) c##k##2 = f32x16_madd(xb, b2, c##k##2);                                     \
    if (NV > 3) c##k##3 = f32x16_madd(xb, b3, c##k##3);                                     \
    if (H) h##k = f32x8_madd(f32x8_set1(xs_), bh, h##k); } } while (0)
#define STT(k) do { if (NT > k) { float *o = t + (k) * ldt;                                \
    if (NV > 0) f32x16_store(o, c##k##0);                                                  \
    if (NV > 1) f32x16_store(o + 16, c##k##1);                                             \
    if (NV > 2) f32x16_store(o + 32, c##k##2);                                             \
    if (NV > 3) f32x16_store(o + 48, c##k##3);                                             \
    if (H) f32x8_store(o + 16 * NV, h##k); } } while (0)

SIMD_INLINE void shrink_tile(const float *x, int64_t ldx, const wt *at, int64_t d_in, float *t,
                             int64_t ldt, int pf, const int NT, const int NV, const int H) {
    const int64_t lda = 16 * NV + 8 * H;
    const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx,
                *x5 = x4 + ldx;
    ACC(0); ACC(1); ACC(2); ACC(3); ACC(4); ACC(5);
    f32x16 b0 = f32x16_zero(), b1 = f32x16_zero(), b2 = f32x16_zero(), b3 = f32x16_zero();
    f32x8 bh = f32x8_zero();
    for (int64_t i = 0; i < d_in; i++) {
        const wt *ar = at + i * lda;
        if (pf && LORA_FETCH_AHEAD_WEIGHTS)
            for (int v = 0; v < NV + H; v++)
                PREFETCH(ar + LORA_FETCH_AHEAD_WEIGHTS + 16 * v, LORA_FETCH_HINT);
        if (NV > 0) b0 = WT_LOAD16(ar);
        if (NV > 1) b1 = WT_LOAD16(ar + 16);
        if (NV > 2) b2 = WT_LOAD16(ar + 32);
        if (NV > 3) b3 = WT_LOAD16(ar + 48);
        if (H) bh = WT_LOAD8(ar + 16 * NV);
        FMAT(0); FMAT(1); FMAT(2); FMAT(3); FMAT(4); FMAT(5);
    }
    STT(0); STT(1); STT(2); STT(3); STT(4); STT(5);
}
#undef ACC
#undef FMAT
#undef STT

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
#else
/* 6 tokens x 16 (W16) or 8 columns of the tile at a time; its rows are lda = w floats apart */
#define SACC(k) f32x8 s##k##0 = f32x8_zero(), s##k##1 = f32x8_zero()
#define SFMA(k) do { if (NT > k) { f32x8 xb = f32x8_set1(x##k[i]);                         \
    s##k##0 = f32x8_madd(xb, a0, s##k##0);                                                  \
    if (W16) s##k##1 = f32x8_madd(xb, a1, s##k##1); } } while (0)
#define SST(k) do { if (NT > k) { float *o = t + (k) * ldt; f32x8_store(o, s##k##0);        \
    if (W16) f32x8_store(o + 8, s##k##1); } } while (0)

SIMD_INLINE void shrink_tile16(const float *x, int64_t ldx, const wt *at, int64_t lda,
                               int64_t d_in, float *t, int64_t ldt, const int NT, const int W16,
                               const int PF) {
    const float *x0 = x, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx, *x4 = x3 + ldx,
                *x5 = x4 + ldx;
    SACC(0); SACC(1); SACC(2); SACC(3); SACC(4); SACC(5);
    for (int64_t i = 0; i < d_in; i++) {
        const wt *ar = at + i * lda;
        if (PF && LORA_FETCH_AHEAD_WEIGHTS)
            PREFETCH(ar + LORA_FETCH_AHEAD_WEIGHTS, LORA_FETCH_HINT);
        const f32x8 a0 = WT_LOAD8(ar), a1 = W16 ? WT_LOAD8(ar + 8) : f32x8_zero();
        SFMA(0); SFMA(1); SFMA(2); SFMA(3); SFMA(4); SFMA(5);
    }
    SST(0); SST(1); SST(2); SST(3); SST(4); SST(5);
}
#undef SACC
#undef SFMA
#undef SST

#define TILE_W(NT)                                                                         \
    for (int64_t c = 0; c < w; c += 16) {                                                  \
        if (w - c >= 16) {                                                                 \
            if (pf) shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 1, 1);        \
            else shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 1, 0);           \
        } else shrink_tile16(xs, ldx, at + c, w, d_in, ts + c, ldt, NT, 0, pf);            \
    }
#endif

/* Out of line, one copy per library (its callers run it once per work item); unused where a
 * library needs only the other. */
#define LORA_ENTRY static __attribute__((noinline, unused))

/* t[tok0:tok1, 0:w] = x[tok0:tok1] @ at (w: 8..64, a multiple of 8), 6 tokens at a time. */
LORA_ENTRY void shrink_tokens(const float *x, int64_t ldx, const wt *at, int64_t d_in,
                              int64_t w, int64_t tok0, int64_t tok1, float *t, int64_t ldt) {
    for (int64_t tok = tok0; tok < tok1;) {
        const int64_t nt = tok1 - tok < LORA_TILE_TOKENS ? tok1 - tok : LORA_TILE_TOKENS;
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
#undef TILE_W

/* ---- expand: y[tok, c:c+64] += t[tok, o0:o1] @ blk[:, c:c+64] --------------------------------
 * accumulated in registers over all rank rows, so each y tile is loaded and stored once
 * (storing y per row made the expand store-bound; per 8 rows, bound by moving y through L2/L3
 * on long segments). b: one strip, rows ldp apart; pf: the strip's first pass, from memory. */
#ifdef __AVX512F__
/* NT tokens x 64 columns: 4 * NT named accumulators (GCC keeps them in zmm registers; an
 * a[4][4] array went to the stack) */
#define YLD(k)                                                                             \
    f32x16 y##k##0 = f32x16_zero(), y##k##1 = f32x16_zero(), y##k##2 = f32x16_zero(),      \
           y##k##3 = f32x16_zero();                                                        \
    if (NT > k) { const float *p = y + (k) * ldy; y##k##0 = f32x16_load(p);                \
                  y##k##1 = f32x16_load(p + 16); y##k##2 = f32x16_load(p + 32);            \
                  y##k##3 = f32x16_load(p + 48); }
#define YFMA(k) do { if (NT > k) { f32x16 s = f32x16_set1(t[(k) * ldt + j]);              \
    y##k##0 = f32x16_madd(s, b0, y##k##0); y##k##1 = f32x16_madd(s, b1, y##k##1);            \
    y##k##2 = f32x16_madd(s, b2, y##k##2); y##k##3 = f32x16_madd(s, b3, y##k##3); } } while (0)
#define YST(k) do { if (NT > k) { float *p = y + (k) * ldy; f32x16_store(p, y##k##0);      \
    f32x16_store(p + 16, y##k##1); f32x16_store(p + 32, y##k##2);                          \
    f32x16_store(p + 48, y##k##3); } } while (0)

SIMD_INLINE void expand_tile(const float *t, int64_t ldt, const wt *b, int64_t ldp, int64_t o0,
                             int64_t o1, float *y, int64_t ldy, int pf, const int NT) {
    YLD(0) YLD(1) YLD(2) YLD(3) YLD(4) YLD(5)
    for (int64_t j = o0; j < o1; j++, b += ldp) {
        if (pf && LORA_FETCH_AHEAD_WEIGHTS) {
            const wt *p = b + LORA_FETCH_AHEAD_WEIGHTS;
            PREFETCH(p, LORA_FETCH_HINT), PREFETCH(p + 16, LORA_FETCH_HINT);
            PREFETCH(p + 32, LORA_FETCH_HINT), PREFETCH(p + 48, LORA_FETCH_HINT);
        }
        f32x16 b0 = WT_LOAD16(b), b1 = WT_LOAD16(b + 16), b2 = WT_LOAD16(b + 32),
               b3 = WT_LOAD16(b + 48);
        YFMA(0); YFMA(1); YFMA(2); YFMA(3); YFMA(4); YFMA(5);
    }
    YST(0); YST(1); YST(2); YST(3); YST(4); YST(5);
}
#undef YLD
#undef YFMA
#undef YST
#else
/* 6 tokens x 16 columns: 12 accumulators + 2 of B + 1 broadcast, four of them per 64-wide
 * strip */
#define ZLD(k) f32x8 z##k##0 = f32x8_zero(), z##k##1 = f32x8_zero();                        \
    if (NT > k) { const float *p = y + (k) * ldy; z##k##0 = f32x8_load(p);                 \
                  z##k##1 = f32x8_load(p + 8); }
#define ZFMA(k) do { if (NT > k) { f32x8 s = f32x8_set1(t[(k) * ldt + j]);                 \
    z##k##0 = f32x8_madd(s, b0, z##k##0); z##k##1 = f32x8_madd(s, b1, z##k##1); } } while (0)
#define ZST(k) do { if (NT > k) { float *p = y + (k) * ldy; f32x8_store(p, z##k##0);        \
    f32x8_store(p + 8, z##k##1); } } while (0)

SIMD_INLINE void expand_tile16(const float *t, int64_t ldt, const wt *b, int64_t ldp,
                               int64_t o0, int64_t o1, float *y, int64_t ldy, const int NT,
                               const int PF) {
    ZLD(0) ZLD(1) ZLD(2) ZLD(3) ZLD(4) ZLD(5)
    for (int64_t j = o0; j < o1; j++, b += ldp) {
        if (PF && LORA_FETCH_AHEAD_WEIGHTS)
            PREFETCH(b + LORA_FETCH_AHEAD_WEIGHTS, LORA_FETCH_HINT);
        const f32x8 b0 = WT_LOAD8(b), b1 = WT_LOAD8(b + 8);
        ZFMA(0); ZFMA(1); ZFMA(2); ZFMA(3); ZFMA(4); ZFMA(5);
    }
    ZST(0); ZST(1); ZST(2); ZST(3); ZST(4); ZST(5);
}
#undef ZLD
#undef ZFMA
#undef ZST

SIMD_INLINE void expand_tile(const float *t, int64_t ldt, const wt *b, int64_t ldp, int64_t o0,
                             int64_t o1, float *y, int64_t ldy, int pf, const int NT) {
    for (int c = 0; c < ldp; c += 16) { /* ldp: the strip's width, 16 or 64 */
        if (pf) expand_tile16(t, ldt, b + c, ldp, o0, o1, y + c, ldy, NT, 1);
        else expand_tile16(t, ldt, b + c, ldp, o0, o1, y + c, ldy, NT, 0);
    }
}
#endif

/* y[tok, c0:c0+n) += t[tok, o0:o1] @ blk for tokens [tok0, tok1), where blk holds the part's
 * [o1-o0, n] block of B as strips (sgmv_cpu.c's top comment). */
LORA_ENTRY void expand_rows(const float *t, int64_t ldt, const wt *blk, int64_t strip,
                            int64_t o0, int64_t o1, int64_t c0, int64_t n, int64_t tok0,
                            int64_t tok1, float *y, int64_t ldy) {
    const int64_t n64 = n / strip * strip, r = o1 - o0, ldp = strip;
    for (int64_t tok = tok0; tok < tok1;) {
        const int64_t nt = tok1 - tok < LORA_TILE_TOKENS ? tok1 - tok : LORA_TILE_TOKENS;
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

#endif
