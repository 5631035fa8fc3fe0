/* Float32 GEMM y[M, N] = x[M, K] @ W[N, K]^T on a weight packed once at load into 16-column
 * panels, in AVX2 or AVX-512 register tiles (ops/gemm_tile.h: the layout and the tiles).
 *
 * Why our own: oneDNN's and MKL's sgemm leave a decode step's few-row projections well short of
 * the FMA peak; register tiles on a weight laid out as panels keep the FMA ports busy
 * (docs/cpu-kernels.md, benchmarks/gemm_shapes.py). ops/gemm.py picks this kernel wherever it
 * builds.
 *
 * Blocking: rows go in blocks (gemm_block_rows) that stay in L2 while every panel passes over
 * them; within a block, each unit of TILE_PANELS panels (K x 16 each, from memory once, then
 * L1/L2) meets every row tile. Threads split the units of a block: each writes its own columns
 * of y.
 */
#include <stdint.h>
#include <string.h>

#include "gemm_tile.h"

#ifdef GEMM_TILES
/* Pack W [N, K] (row stride ldw) into panels: out has ceil(N/16) * K * 16 floats. */
void gemm_pack(const float *w, int64_t ldw, int64_t N, int64_t K, float *out) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = out + p * K * NR;
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t n = p * NR + j;
                dst[k * NR + j] = n < N ? w[n * ldw + k] : 0.f;
            }
    }
}

/* Rows [0, m) of one unit of nb panels at b (cols: columns of its last panel), in the tiles
 * gemm_tile_height gives (32 rows on AVX2 as 6 6 5 5 5 5, not 6 6 6 6 6 2). With more than
 * one row tile, the first fetches the next unit (when `next`) while it reads this one (batch
 * 1 is faster without: one stream). */
static void rows_of_unit(const float *a, int64_t lda, int64_t m, const float *b, int64_t K,
                         float *c, int64_t ldc, int64_t cols, int nb, int next) {
    const float *pf = m > TILE_ROWS && next ? b + TILE_PANELS * K * NR : 0;
#define T_(MR) gemm_tile(MR, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf)
#define ROWS                                                                               \
    for (int64_t r = 0, i = 0, h; r < m; r += h, i++, pf = 0) {                            \
        h = gemm_tile_height(m, i);                                                        \
        SWITCH_ROWS(h, T_)                                                                 \
    }
#if TILE_PANELS > 1
    if (nb > 1) {
        const int NB = 2;
        ROWS;
    } else {
        const int NB = 1;
        ROWS;
    }
#else
    const int NB = 1;
    (void)nb;
    ROWS;
#endif
#undef ROWS
#undef T_
}

/* unit q (TILE_PANELS panels) of the m rows at x against the packed W */
static void gemm_unit(const float *x, int64_t ldx, int64_t m, const float *packed, int64_t N,
                      int64_t K, float *y, int64_t ldy, int64_t q) {
    const int64_t panels = (N + NR - 1) / NR, units = (panels + TILE_PANELS - 1) / TILE_PANELS;
    const int64_t p = TILE_PANELS * q;
    const int64_t nb = panels - p < TILE_PANELS ? panels - p : TILE_PANELS;
    const int64_t last = p + nb - 1;
    const int64_t cols = N - last * NR < NR ? N - last * NR : NR;
    rows_of_unit(x, ldx, m, packed + p * K * NR, K, y + p * NR, ldy, cols, (int)nb,
                 q + 1 < units);
}

#define GEMM_UNITS(N) ((((N) + NR - 1) / NR + TILE_PANELS - 1) / TILE_PANELS)

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W packed by gemm_pack. */
void gemm_packed(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                 int64_t K, float *y, int64_t ldy, int nthreads) {
    int64_t blocks;
    const int64_t mc = gemm_block_rows(M, K, &blocks), units = GEMM_UNITS(N);
    const int parallel = M * N * K >= GEMM_PARALLEL_MIN;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m = M - m0 < mc ? M - m0 : mc;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel)
        for (int64_t q = 0; q < units; q++)
            gemm_unit(x + m0 * ldx, ldx, m, packed, N, K, y + m0 * ldy, ldy, q);
    }
}

/* gemm_packed for a caller whose every thread of one OpenMP team calls it with the same
 * arguments, `work` aside (model/native_decode.c's layer loop runs a step in one team): the
 * units are an orphaned work-sharing loop over that team, ending in its barrier, each
 * computed by the same code as in gemm_packed, so the two give the same bits. The signature
 * is the layer loop's projection kernel's: `w` the packed panels; kind, w2, w3, work and
 * nthreads unused. */
int gemm_packed_team(int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                     const void *w, const void *w2, const void *w3, int64_t N, float *y,
                     int64_t ldy, void *work, int nthreads) {
    (void)kind; (void)w2; (void)w3; (void)work; (void)nthreads;
    int64_t blocks;
    const int64_t mc = gemm_block_rows(M, K, &blocks), units = GEMM_UNITS(N);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m = M - m0 < mc ? M - m0 : mc;
#pragma omp for schedule(static)
        for (int64_t q = 0; q < units; q++)
            gemm_unit(x + m0 * ldx, ldx, m, (const float *)w, N, K, y + m0 * ldy, ldy, q);
    }
    return 0;
}

int gemm_available(void) { return 1; }
#else
void gemm_pack(const float *w, int64_t ldw, int64_t N, int64_t K, float *out) {
    (void)w; (void)ldw; (void)N; (void)K; (void)out;
}
void gemm_packed(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                 int64_t K, float *y, int64_t ldy, int nthreads) {
    (void)x; (void)ldx; (void)packed; (void)M; (void)N; (void)K; (void)y; (void)ldy;
    (void)nthreads;
}
int gemm_packed_team(int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                     const void *w, const void *w2, const void *w3, int64_t N, float *y,
                     int64_t ldy, void *work, int nthreads) {
    (void)kind; (void)x; (void)ldx; (void)M; (void)K; (void)w; (void)w2; (void)w3; (void)N;
    (void)y; (void)ldy; (void)work; (void)nthreads;
    return -1;
}
int gemm_available(void) { return 0; }
#endif
