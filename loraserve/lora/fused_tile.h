/* The GEMM's register tile (ops/gemm_tile.h) with the two hooks the LoRA ops fused into it
 * need, for gemm_expand_cpu.c and gemm_lora_decode_cpu.c (the plain GEMM has neither):
 *
 * - a low-rank epilogue (the expand, prefill): after the K loop the accumulators go on over
 *   j < nj with t[row * ldt + j] as x and e + j * lde as the weight row (the tile's columns of
 *   one B strip), so y = x @ W^T + t @ E with each product added in the same order as a
 *   separate expand;
 * - fetch streams (the interleaved decode op): other memory to prefetch while the tile computes,
 *   n[0] 64-byte lines of p[0], then n[1] of p[1], then n[2] of p[2], one line every S k steps
 *   (S = FETCH_STRIDE, half of it, or 1: the widest that fits them all in K). Stream 0 carries
 *   the next unit's panels, 1 and 2 the adapter weights read next (two: a short work item may
 *   end before the tile's share), so their memory time hides under the tile's FMAs. tuning.h
 *   gives the hints and why.
 */
#ifndef LORASERVE_FUSED_TILE_H
#define LORASERVE_FUSED_TILE_H

#include "../ops/gemm_tile.h"

#ifdef GEMM_TILES
typedef struct {
    const float *t;
    int64_t ldt;
    const float *e;
    int64_t lde, nj;
} lowrank;

typedef struct {
    const float *p[3];
    int64_t n[3];
} fetch;

#define K_STRIDED(S, ...) /* the body: __VA_ARGS__ (the step may hold commas) */          \
    {                                                                                      \
        int64_t k = 0;                                                                     \
        for (int st_ = 0; st_ < 3; st_++) {                                                \
            const float *p_ = fs->p[st_];                                                  \
            const int64_t e_ = k + fs->n[st_] * S;                                         \
            for (; k < e_;) {                                                              \
                if (st_) PREFETCH(p_, FETCH_LORA_HINT);                                    \
                else PREFETCH(p_, FETCH_PANEL_HINT);                                       \
                p_ += LINE_FLOATS;                                                         \
                for (int s_ = 0; s_ < S; s_++, k++) { __VA_ARGS__ }                        \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 4") for (; k < K; k++) { __VA_ARGS__ }                         \
    }

/* A tile's K loop with body STEP (which reads k): one loop without streams; with them the
 * fetching steps run apart from the rest, with no test per k (one loop testing `k < pn` was
 * slower: docs/cpu-kernels.md). */
#define K_LOOP(STEP)                                                                       \
    if (!fs) {                                                                             \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) { STEP }                   \
    } else if ((fs->n[0] + fs->n[1] + fs->n[2]) * FETCH_STRIDE <= K) {                     \
        K_STRIDED(FETCH_STRIDE, STEP)                                                      \
    } else if ((fs->n[0] + fs->n[1] + fs->n[2]) * (FETCH_STRIDE / 2) <= K) {               \
        K_STRIDED(FETCH_STRIDE / 2, STEP)                                                  \
    } else {                                                                               \
        K_STRIDED(1, STEP)                                                                 \
    }

/* gemm_tile over full units (NB = TILE_PANELS, every column stored), with the low-rank
 * epilogue lr and the fetch streams fs (either 0 for none). */
SIMD_INLINE void fused_tile(const int MR, const float *a, int64_t lda, const float *b, int64_t K,
                            float *c, int64_t ldc, const float *pf, const lowrank *lr,
                            const fetch *fs) {
    const int NB = TILE_PANELS;
    const int64_t cols = NR;
    (void)NB;
    TILE_ACCS
    K_LOOP(TILE_KSTEP(k))
    if (lr) /* the low-rank epilogue: the same FMAs on (t, e) */
        for (int64_t j = 0; j < lr->nj; j++) {
            TILE_LOAD_B(lr->e + j * lr->lde, lr->e + j * lr->lde + NR)
            TILE_FMAS(lr->t, lr->ldt, j)
        }
    TILE_STORE()
}
#endif

#endif
