/* The packed weight layout and register tile of our float32 GEMM, shared by the plain GEMM
 * (ops/gemm_cpu.c) and the LoRA kernels fused into it (lora/fused_tile.h).
 *
 * Packed layout: panel p holds columns 16p .. 16p+15 of W [N, K] as [K][16] floats, one 64-byte
 * line per k (zeros past N). Panels follow each other, so a thread's range of panels is one
 * sequential stream for the hardware prefetcher.
 *
 * A register tile is MR rows of x (1..TILE_ROWS) times NB neighbouring panels (1..TILE_PANELS)
 * over all of K, each row two accumulator vectors: with AVX-512 one zmm per panel (8 x 32 tiles),
 * with AVX2 the two ymm halves of one panel (6 x 16). tuning.h says why those sizes. The
 * accumulators are named variables, not an array: gcc kept an array on the stack and stored it
 * every k. MR and NB are constants in every instantiation (always_inline), so the rows and
 * panels a tile lacks compile away.
 *
 * Summation over k is in order, one FMA chain per output: results are deterministic and
 * independent of the thread count, and a kernel that goes on with more FMAs on the same
 * accumulators (the LoRA expand) adds them after the GEMM's sum, as a separate op would.
 *
 * The pieces, for a tile function with MR, NB, a, lda, b, K, c, ldc, cols and pf in scope:
 *   TILE_ACCS                     declares the accumulators, zero (and b1p_, the second
 *                                 panel)
 *   TILE_KSTEP(k)                 one k step of the GEMM (pf: the next unit's panels to fetch,
 *                                 a line per panel per step; 0 for none)
 *   TILE_LOAD_B(p0, p1) then TILE_FMAS(x, ldx, j)
 *                                 one step on other operands: rows x + r * ldx + j against the
 *                                 B vectors at p0 (first panel) and p1 (second)
 *   TILE_STORE()                  the tile into c (cols: columns of its last panel to store)
 */
#ifndef LORASERVE_GEMM_TILE_H
#define LORASERVE_GEMM_TILE_H

#include "simd.h"
#include "tuning.h"

#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_TILES 1

#define NR 16                           /* columns per panel */
#define TILE_COLS (TILE_PANELS * NR)    /* columns per register tile */

#ifdef __AVX512F__
typedef f32x16 tile_vec;
#define TV_ZERO f32x16_zero
#define TV_LOAD f32x16_load
#define TV_BCAST f32x16_bcast
#define TV_FMA f32x16_fma
#define TILE_ACCS                                                                          \
    tile_vec c00 = TV_ZERO(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;       \
    tile_vec c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;             \
    tile_vec c60 = c00, c61 = c00, c70 = c00, c71 = c00;                                   \
    const float *b1p_ = b + K * NR; /* the second panel */
#define TILE_LOAD_B(p0, p1)                                                                \
    const tile_vec b0 = TV_LOAD(p0), b1 = NB > 1 ? TV_LOAD(p1) : b0;
#define TILE_HAS_SECOND (NB > 1)
#define TILE_FMAS(x, ldx, j)                                                               \
    TILE_ROW(0, c00, c01, x, ldx, j) TILE_ROW(1, c10, c11, x, ldx, j)                      \
    TILE_ROW(2, c20, c21, x, ldx, j) TILE_ROW(3, c30, c31, x, ldx, j)                      \
    TILE_ROW(4, c40, c41, x, ldx, j) TILE_ROW(5, c50, c51, x, ldx, j)                      \
    TILE_ROW(6, c60, c61, x, ldx, j) TILE_ROW(7, c70, c71, x, ldx, j)
#define TILE_STORE()                                                                       \
    {                                                                                      \
        const tile_vec acc_[8][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},       \
                                     {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};      \
        for (int r_ = 0; r_ < MR; r_++) {                                                  \
            if (NB > 1) {                                                                  \
                f32x16_store(c + r_ * ldc, acc_[r_][0]);                                   \
                f32x16_store_first(c + r_ * ldc + NR, cols, acc_[r_][1]);                  \
            } else {                                                                       \
                f32x16_store_first(c + r_ * ldc, cols, acc_[r_][0]);                       \
            }                                                                              \
        }                                                                                  \
    }
#else
typedef f32x8 tile_vec;
#define TV_ZERO f32x8_zero
#define TV_LOAD f32x8_load
#define TV_BCAST f32x8_bcast
#define TV_FMA f32x8_fma
#define TILE_ACCS                                                                          \
    tile_vec c00 = TV_ZERO(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;       \
    tile_vec c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;             \
    const float *b1p_ = b + K * NR; /* the second panel (none: not read) */                \
    (void)b1p_;
/* one panel: its line's two halves (p1 is not read) */
#define TILE_LOAD_B(p0, p1) const tile_vec b0 = TV_LOAD(p0), b1 = TV_LOAD((p0) + 8);
#define TILE_HAS_SECOND 1
#define TILE_FMAS(x, ldx, j)                                                               \
    TILE_ROW(0, c00, c01, x, ldx, j) TILE_ROW(1, c10, c11, x, ldx, j)                      \
    TILE_ROW(2, c20, c21, x, ldx, j) TILE_ROW(3, c30, c31, x, ldx, j)                      \
    TILE_ROW(4, c40, c41, x, ldx, j) TILE_ROW(5, c50, c51, x, ldx, j)
#define TILE_STORE()                                                                       \
    {                                                                                      \
        const tile_vec acc_[6][2] = {{c00, c01}, {c10, c11}, {c20, c21},                   \
                                     {c30, c31}, {c40, c41}, {c50, c51}};                  \
        for (int r_ = 0; r_ < MR; r_++) { /* a partial last panel through a buffer */      \
            float tmp_[NR];                                                                \
            float *dst_ = cols == NR ? c + r_ * ldc : tmp_;                                \
            f32x8_store(dst_, acc_[r_][0]);                                                \
            f32x8_store(dst_ + 8, acc_[r_][1]);                                            \
            if (cols != NR) memcpy(c + r_ * ldc, tmp_, sizeof(float) * (size_t)cols);       \
        }                                                                                  \
    }
#endif

/* row r (when the tile has it) += x[r][j] * (b0, b1) */
#define TILE_ROW(r, acc0, acc1, x, ldx, j)                                                 \
    if (MR > r) {                                                                          \
        const tile_vec xr_ = TV_BCAST((x) + r * (ldx) + (j));                              \
        acc0 = TV_FMA(xr_, b0, acc0);                                                      \
        if (TILE_HAS_SECOND) acc1 = TV_FMA(xr_, b1, acc1);                                 \
    }

#define TILE_KSTEP(k)                                                                      \
    if (pf) {                                                                              \
        PREFETCH(pf + (k) * NR, GEMM_NEXT_PANEL_HINT);                                     \
        if (TILE_PANELS > 1) PREFETCH(pf + K * NR + (k) * NR, GEMM_NEXT_PANEL_HINT);       \
    }                                                                                      \
    TILE_LOAD_B(b + (k) * NR, b1p_ + (k) * NR)                                             \
    TILE_FMAS(a, lda, k)

/* The GEMM's tile: c[0:MR, 0:NB * 16] = a[0:MR] @ panels b[0:NB]. */
SIMD_INLINE void gemm_tile(const int MR, const int NB, const float *a, int64_t lda,
                           const float *b, int64_t K, float *c, int64_t ldc, int64_t cols,
                           const float *pf) {
    (void)NB;
    TILE_ACCS
    _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) { TILE_KSTEP(k) }
    TILE_STORE()
}

/* T_(MR) for a tile of m rows (1..TILE_ROWS), MR a constant in each branch */
#define CASES_1_5(T_)                                                                      \
    case 1: T_(1); break;                                                                  \
    case 2: T_(2); break;                                                                  \
    case 3: T_(3); break;                                                                  \
    case 4: T_(4); break;                                                                  \
    case 5: T_(5); break;
#ifdef __AVX512F__
#define CASES_6_7(T_) case 6: T_(6); break; case 7: T_(7); break;
#else
#define CASES_6_7(T_)
#endif
#define SWITCH_ROWS(m, T_)                                                                 \
    switch (m) { CASES_1_5(T_) CASES_6_7(T_) default: T_(TILE_ROWS); break; }

/* The height of row tile i of a unit's m rows: the first is full (m when fewer), the rest are
 * of near-equal height, the first (rest % their count) a row more. A 1- or 2-row tail tile has
 * too few accumulator chains for the FMA latency; the first tile stays full because it meets
 * the unit's panels from memory, and a smaller one hides less of that wait (cpu-kernels.md). */
static inline int64_t gemm_tile_height(int64_t m, int64_t i) {
    if (i == 0) return m < TILE_ROWS ? m : TILE_ROWS;
    const int64_t rest = m - TILE_ROWS, tiles = (rest + TILE_ROWS - 1) / TILE_ROWS;
    return rest / tiles + (i - 1 < rest % tiles);
}

/* Rows of x per block: at most GEMM_XBLOCK KB (the block stays in L2 while every panel passes
 * over it), blocks of equal size in whole tiles (64 rows of K = 1536 go as 3 x 24, not
 * 30 + 30 + 4). *blocks: ceil(M / the block size before that rounding). */
static inline int64_t gemm_block_rows(int64_t M, int64_t K, int64_t *blocks) {
    int64_t mc = (GEMM_XBLOCK * 1024 / 4) / K;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    *blocks = (M + mc - 1) / mc;
    return ((M + *blocks - 1) / *blocks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
}
#endif

#endif
