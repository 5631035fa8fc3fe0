/* Float32 GEMM y[M, N] = x[M, K] @ W[N, K]^T on a weight packed once at load (AVX2 + FMA,
 * and AVX-512 tiles where the build has it).
 *
 * Why our own: on AVX2-only hosts (AMD Zen 3 here) oneDNN's and MKL's sgemm reach 95-125
 * GFLOP/s on a decode step's 64-row projections, about half the 2-core FMA peak (~200). A
 * 6 x 16 register tile (12 accumulators, 2 B loads and 6 broadcasts per 12 FMAs) on a weight
 * laid out as 16-column panels keeps the FMA ports busy. With AVX-512 (Zen 5 here, where
 * oneDNN's own tiles reach 494 GFLOP/s at 2048 rows but 336 at 64), 8 x 32 tiles over two
 * neighbouring panels (16 zmm accumulators, 2 B loads and 8 broadcasts per 16 FMAs) ran the
 * 64-row projections at 0.81 of oneDNN's time (benchmarks/gemm_shapes.py); ops/gemm.py picks
 * this kernel wherever it builds.
 *
 * Packed layout: panel p holds columns 16p .. 16p+15 as [K][16] floats, one 64-byte line per
 * k (zeros past N). Panels follow each other, so a thread's range of panels is one
 * sequential stream for the hardware prefetcher.
 *
 * Blocking: rows go in blocks of MC (MC x K floats of x stay in L2 while every panel passes
 * over them); within a block, each panel (K x 16, from memory once, then L1/L2) meets every
 * 6-row chunk. Threads split the panels of a block: each writes its own columns of y.
 * Summation over k is in order, one FMA chain per output: results are deterministic and
 * independent of the thread count.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define NR 16

/* An optional low-rank update fused into a tile's epilogue (the LoRA expand,
 * lora/gemm_expand_cpu.c): after the K loop the accumulators go on over j < nj with
 * t[row * ldt + j] as x and e + j * lde as the weight row (the tile's columns of one B strip),
 * so y = x @ W^T + t @ E with each product added in the same order as a separate expand. */
typedef struct {
    const float *t;
    int64_t ldt;
    const float *e;
    int64_t lde, nj;
} lowrank;

/* Other streams to fetch while a tile computes: n[0] 64-byte lines of p[0], then n[1] of p[1],
 * then n[2] of p[2], one line every S k steps, S = 4, 2 or 1, the widest that fits them all in
 * K. The interleaved decode LoRA (lora/gemm_lora_decode_cpu.c) fetches the next unit's panels
 * in stream 0 and the adapter weights it reads next in 1 and 2 (two: a short work item may end
 * before the tile's share), so their memory time hides under the tile's FMAs. One line per k
 * step, all at the start of K, cost the decode LoRA op 0.5 ms a step more (benchmarks/
 * fused_lora.py, an A/B).
 * Hints: with AVX-512 both into L2 (into L1 measured the same; non-temporal +0.4-0.6 ms a step).
 * Without it (a unit is one 36 KB panel at K = 576), the panel into L1 and the adapter lines
 * non-temporal: -0.5 to -1.3 ms a step (of ~11) on imitated AVX2 against both into L2, in five
 * in-process A/Bs of 31 rounds (benchmarks/decode_op_ab.py); with the panel into L2 instead,
 * +0.8 ms. */
#define STREAM_LINE 16 /* floats per line */
#ifdef __AVX512F__
#define PANEL_HINT _MM_HINT_T1
#define LORA_HINT _MM_HINT_T1
#else
#define PANEL_HINT _MM_HINT_T0
#define LORA_HINT _MM_HINT_NTA
#endif
typedef struct {
    const float *p[3];
    int64_t n[3];
} fetch;

#define K_STRIDED(S, ...) /* the body: __VA_ARGS__ (STEP may hold commas) */               \
    {                                                                                      \
        int64_t k = 0;                                                                     \
        for (int st_ = 0; st_ < 3; st_++) {                                                \
            const float *p_ = fs->p[st_];                                                  \
            const int64_t e_ = k + fs->n[st_] * S;                                         \
            for (; k < e_;) {                                                              \
                if (st_) _mm_prefetch((const char *)p_, LORA_HINT);                        \
                else _mm_prefetch((const char *)p_, PANEL_HINT);                           \
                p_ += STREAM_LINE;                                                         \
                for (int s_ = 0; s_ < S; s_++, k++) { __VA_ARGS__ }                        \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 4") for (; k < K; k++) { __VA_ARGS__ }                         \
    }

/* A tile's K loop with body STEP (which reads k). The plain GEMM (fs a constant 0 in its
 * callers) keeps one loop; with streams the fetching steps run apart from the rest, with no
 * test per k (one loop testing `k < pn` cost the decode LoRA op ~1 ms a step). */
#define K_LOOP(STEP)                                                                       \
    if (!fs) {                                                                             \
        _Pragma("GCC unroll 4") for (int64_t k = 0; k < K; k++) { STEP }                   \
    } else if ((fs->n[0] + fs->n[1] + fs->n[2]) * 4 <= K) {                                \
        K_STRIDED(4, STEP)                                                                 \
    } else if ((fs->n[0] + fs->n[1] + fs->n[2]) * 2 <= K) {                                \
        K_STRIDED(2, STEP)                                                                 \
    } else {                                                                               \
        K_STRIDED(1, STEP)                                                                 \
    }

/* T_(MR) for a tile of m rows (1..TILE_ROWS), MR a constant in each branch: for callers that
 * cut rows into tiles themselves (lora/gemm_expand_cpu.c, lora/gemm_lora_decode_cpu.c) */
#ifdef __AVX512F__
#define ROWS_6_UP(T_) case 6: T_(6); break; case 7: T_(7); break; default: T_(8); break;
#else
#define ROWS_6_UP(T_) default: T_(6); break;
#endif
#define SWITCH_ROWS(m, T_)                                                                 \
    switch (m) {                                                                           \
    case 1: T_(1); break;                                                                  \
    case 2: T_(2); break;                                                                  \
    case 3: T_(3); break;                                                                  \
    case 4: T_(4); break;                                                                  \
    case 5: T_(5); break;                                                                  \
    ROWS_6_UP(T_)                                                                          \
    }
#ifdef __AVX512F__
#define TILE_ROWS 8 /* rows of a register tile */
#define TILE_COLS (2 * NR) /* and its columns: a pair of panels */
#else
#define TILE_ROWS 6
#define TILE_COLS NR
#endif
/* KB of x rows per block: they stay in L2 while the panels pass (Zen 3: 512 KB of L2; AVX-512
 * hosts have 1-2 MB, where 768 measured 4% faster than 192 at 2048 rows) */
#ifndef GEMM_XBLOCK
#ifdef __AVX512F__
#define GEMM_XBLOCK 768
#else
#define GEMM_XBLOCK 192
#endif
#endif

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

#ifndef __AVX512F__
/* MR rows (1..6) x 16 columns of y, over all K. cols < 16 only on a last, partial panel.
 * Named accumulators, not an array: gcc kept an array on the stack and stored it every k. */
#define ROW(r, c0, c1)                                                                     \
    if (MR > r) {                                                                          \
        const __m256 xr = _mm256_broadcast_ss(a + r * lda + k);                            \
        c0 = _mm256_fmadd_ps(xr, b0, c0);                                                  \
        c1 = _mm256_fmadd_ps(xr, b1, c1);                                                  \
    }
static inline __attribute__((always_inline)) void tile(
        const int MR, const float *a, int64_t lda, const float *b, int64_t K, float *c,
        int64_t ldc, int64_t cols, const float *pf, const lowrank *lr, const fetch *fs) {
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m256 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
#define KSTEP                                                                              \
        if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);                    \
        const __m256 b0 = _mm256_loadu_ps(b + k * NR), b1 = _mm256_loadu_ps(b + k * NR + 8); \
        ROW(0, c00, c01) ROW(1, c10, c11) ROW(2, c20, c21)                                 \
        ROW(3, c30, c31) ROW(4, c40, c41) ROW(5, c50, c51)
    K_LOOP(KSTEP)
#undef KSTEP
    if (lr) { /* the low-rank epilogue: the same FMAs on (t, e) */
        const float *a = lr->t;
        const int64_t lda = lr->ldt;
        for (int64_t k = 0; k < lr->nj; k++) {
            const __m256 b0 = _mm256_loadu_ps(lr->e + k * lr->lde);
            const __m256 b1 = _mm256_loadu_ps(lr->e + k * lr->lde + 8);
            ROW(0, c00, c01) ROW(1, c10, c11) ROW(2, c20, c21)
            ROW(3, c30, c31) ROW(4, c40, c41) ROW(5, c50, c51)
        }
    }
    const __m256 acc[6][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                              {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < MR; r++) {
        float tmp[NR];
        float *dst = cols == NR ? c + r * ldc : tmp;
        _mm256_storeu_ps(dst, acc[r][0]);
        _mm256_storeu_ps(dst + 8, acc[r][1]);
        if (cols != NR) memcpy(c + r * ldc, tmp, sizeof(float) * (size_t)cols);
    }
}
#undef ROW

static void rows_of_panel(const float *a, int64_t lda, int64_t m, const float *b, int64_t K,
                          float *c, int64_t ldc, int64_t cols, int next_panel) {
    int64_t r = 0;
    /* With more than one tile of rows, the first fetches the next panel (a line per k) while
     * it reads this one (batch 1 measured faster without: one stream) */
    const float *pf = m > 6 && next_panel ? b + K * NR : 0;
    for (; r + 6 <= m; r += 6, pf = 0) tile(6, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0);
    switch (m - r) {
    case 5: tile(5, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;
    case 4: tile(4, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;
    case 3: tile(3, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;
    case 2: tile(2, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;
    case 1: tile(1, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;
    default: break;
    }
}

#else
/* AVX-512: MR rows (1..8) x 32 columns, from two neighbouring panels (b, b + K * 16): 16 zmm
 * accumulators, 2 loads of B and 8 broadcasts per 16 FMAs. nb: panels present (1 or 2);
 * cols: columns of the last one to store (16 but on a partial last panel). */
#define ROWZ(r, c0, c1)                                                                    \
    if (MR > r) {                                                                          \
        const __m512 xr = _mm512_set1_ps(a[r * lda + k]);                                  \
        c0 = _mm512_fmadd_ps(xr, b0, c0);                                                  \
        if (NB > 1) c1 = _mm512_fmadd_ps(xr, b1, c1);                                      \
    }
static inline __attribute__((always_inline)) void tile512(
        const int MR, const int NB, const float *a, int64_t lda, const float *b, int64_t K,
        float *c, int64_t ldc, int64_t cols, const float *pf, const lowrank *lr,
        const fetch *fs) {
    __m512 c00 = _mm512_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
    __m512 c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    __m512 c60 = c00, c61 = c00, c70 = c00, c71 = c00;
    const float *b1p = b + K * NR;
#define KSTEP512                                                                           \
        if (pf) {                                                                          \
            _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);                        \
            _mm_prefetch((const char *)(pf + K * NR + k * NR), _MM_HINT_T0);               \
        }                                                                                  \
        const __m512 b0 = _mm512_loadu_ps(b + k * NR);                                     \
        const __m512 b1 = NB > 1 ? _mm512_loadu_ps(b1p + k * NR) : b0;                     \
        ROWZ(0, c00, c01) ROWZ(1, c10, c11) ROWZ(2, c20, c21) ROWZ(3, c30, c31)            \
        ROWZ(4, c40, c41) ROWZ(5, c50, c51) ROWZ(6, c60, c61) ROWZ(7, c70, c71)
    K_LOOP(KSTEP512)
#undef KSTEP512
    if (lr) { /* the low-rank epilogue: the same FMAs on (t, e) */
        const float *a = lr->t;
        const int64_t lda = lr->ldt;
        for (int64_t k = 0; k < lr->nj; k++) {
            const __m512 b0 = _mm512_loadu_ps(lr->e + k * lr->lde);
            const __m512 b1 = NB > 1 ? _mm512_loadu_ps(lr->e + k * lr->lde + NR) : b0;
            ROWZ(0, c00, c01) ROWZ(1, c10, c11) ROWZ(2, c20, c21) ROWZ(3, c30, c31)
            ROWZ(4, c40, c41) ROWZ(5, c50, c51) ROWZ(6, c60, c61) ROWZ(7, c70, c71)
        }
    }
    const __m512 acc[8][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31},
                              {c40, c41}, {c50, c51}, {c60, c61}, {c70, c71}};
    const __mmask16 last = cols >= NR ? 0xffff : (__mmask16)((1u << cols) - 1);
    for (int r = 0; r < MR; r++) {
        if (NB > 1) {
            _mm512_storeu_ps(c + r * ldc, acc[r][0]);
            _mm512_mask_storeu_ps(c + r * ldc + NR, last, acc[r][1]);
        } else {
            _mm512_mask_storeu_ps(c + r * ldc, last, acc[r][0]);
        }
    }
}
#undef ROWZ

#define TILES512(NB)                                                                       \
    for (; r + 8 <= m; r += 8, pf = 0)                                                     \
        tile512(8, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0);                \
    switch (m - r) {                                                                       \
    case 7: tile512(7, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 6: tile512(6, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 5: tile512(5, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 4: tile512(4, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 3: tile512(3, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 2: tile512(2, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    case 1: tile512(1, NB, a + r * lda, lda, b, K, c + r * ldc, ldc, cols, pf, 0, 0); break;     \
    default: break;                                                                        \
    }

/* rows of a pair of panels (nb = 1: the last, odd one); pf: the next pair, fetched by the
 * first tile when there is more than one */
static void rows_of_pair(const float *a, int64_t lda, int64_t m, const float *b, int64_t K,
                         float *c, int64_t ldc, int64_t cols, int nb, int next) {
    int64_t r = 0;
    const float *pf = m > 8 && next ? b + 2 * K * NR : 0;
    if (nb > 1) { TILES512(2) } else { TILES512(1) }
}
#undef TILES512
#endif

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T, W packed by gemm_pack. */
void gemm_packed(const float *x, int64_t ldx, const float *packed, int64_t M, int64_t N,
                 int64_t K, float *y, int64_t ldy, int nthreads) {
    const int64_t panels = (N + NR - 1) / NR;
    /* x rows per block: at most GEMM_XBLOCK KB of x (it stays in L2 while the panels pass),
     * blocks of equal size in whole tiles (64 rows of K = 1536 go as 3 x 24, not 30 + 30 + 4) */
    int64_t mc = (GEMM_XBLOCK * 1024 / 4) / K;
    if (mc < TILE_ROWS) mc = TILE_ROWS;
    const int64_t blocks = (M + mc - 1) / mc;
    mc = ((M + blocks - 1) / blocks + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    /* a team costs a few microseconds to wake: not for a tiny model's products */
    const int parallel = M * N * K >= (1 << 18);
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t m = M - m0 < mc ? M - m0 : mc;
#ifdef __AVX512F__
        const int64_t pairs = (panels + 1) / 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel)
        for (int64_t q = 0; q < pairs; q++) {
            const int64_t p = 2 * q, nb = p + 1 < panels ? 2 : 1, last = p + nb - 1;
            const int64_t cols = N - last * NR < NR ? N - last * NR : NR;
            rows_of_pair(x + m0 * ldx, ldx, m, packed + p * K * NR, K, y + m0 * ldy + p * NR,
                         ldy, cols, (int)nb, q + 1 < pairs);
        }
#else
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel)
        for (int64_t p = 0; p < panels; p++) {
            const int64_t cols = N - p * NR < NR ? N - p * NR : NR;
            rows_of_panel(x + m0 * ldx, ldx, m, packed + p * K * NR, K, y + m0 * ldy + p * NR,
                          ldy, cols, p + 1 < panels);
        }
#endif
    }
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
int gemm_available(void) { return 0; }
#endif
