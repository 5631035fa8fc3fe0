/* y[M, N] = x[M, K] @ W[N, K]^T for quantized weights laid out in panels: the GEMM
 * micro-kernel form of the quantized product, on AVX-512 VNNI (ops/qpanel_avx512.h) or AVX2
 * (ops/qpanel_avx2.h), whichever the build targets.
 *
 * Why panels: ops/qgemm_cpu.c dots one weight row with a row of x and reduces the lanes per
 * output, so every block of 32 costs a conversion and two scale products per (row, output);
 * at many rows that is more instructions per multiply-add than float32. Here sixteen output
 * rows sit side by side: each byte product step multiplies four bytes of each of sixteen
 * weight rows with four bytes of x (broadcast), the int32 sums of a block of 32 stay in
 * registers, and a block ends with a few instructions per sixteen outputs. Nothing is reduced
 * across lanes.
 *
 * Kinds (ops/qpanel.py packs them; N is padded to whole panels of PANEL = 16 rows with zeros),
 * numbered as ops/qgemm_cpu.c's:
 *   QP_Q8_ROW    int8, one float32 scale per output row (`--quantization int8`), at the end
 *   QP_Q8_F16    int8, a float16 scale per row and block of 32 (GGUF Q8_0)
 *   QP_Q4_F16    4-bit q in 0..15, w = d * (q - 8), float16 d (GGUF Q4_0, int4)
 *   QP_Q4_AFF16  4-bit, w = d * q + m, float16 d and m (GGUF Q4_1)
 *   QP_Q4_AFF32  4-bit, w = d * q + m, float32 d and m (GGUF Q4_K's sub-blocks)
 * 8-bit quants are stored as q + 128 (VNNI's unsigned operand) and 4-bit ones are 0..15; the
 * offsets depend on x alone (its block's quant sum, computed once per row of x), so a panel
 * is its quants and scales and nothing else: the bytes a product reads are the format's.
 * 8-bit panels: for each 4-element step s of K, 64 bytes, row l's elements 4s..4s+3 at bytes
 * 4l..4l+3. 4-bit panels: for each pair of steps, 64 bytes whose low nibbles are the first
 * step's and high nibbles the second's, in the same order. Block scales and offsets
 * [P][K/32][16] in the format's own precision; QP_Q8_ROW's row scales [P * 16].
 *
 * Activations: per row and block of 32, scale amax / 127 and quants rounded to nearest even,
 * as the dot-order kernel makes them, so both give the same integer dot products; with them,
 * each block's quant sum. Each row goes through the same instructions whatever the other rows
 * are: a row's result does not depend on the batch. Threads split the panels.
 */
#include <stdint.h>
#include <string.h>

#include "qblock.h" /* q_amax32, as the dot-order kernel scales its activations */
#include "simd.h"
#include "tuning.h"

#define PANEL 16 /* output rows of a panel: the int32 lanes of one zmm, or of two ymm */

enum { QP_Q8_ROW = 0, QP_Q8_F16 = 1, QP_Q4_F16 = 2, QP_Q4_AFF16 = 3, QP_Q4_AFF32 = 4 };
#define AFFINE(k) ((k) == QP_Q4_AFF16 || (k) == QP_Q4_AFF32)
#define FOUR_BIT(k) ((k) >= QP_Q4_F16)

#if (defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)) || \
    (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define ROWS QPANEL_TILE_ROWS
_Static_assert(ROWS >= 1 && ROWS <= 4, "tile_any dispatches tiles of 1 to 4 rows");

/* a row of quantized x: K signed bytes of q, K / 32 float scales, K / 32 int32 quant sums */
static int64_t act_bytes(int64_t K) { return (K + 8 * (K / 32) + 63) & ~(int64_t)63; }
SIMD_INLINE const float *qp_act_scales(const uint8_t *row, int64_t K) {
    return (const float *)(row + K);
}
SIMD_INLINE const int32_t *qp_act_sums(const uint8_t *row, int64_t K) {
    return (const int32_t *)(row + K + 4 * (K / 32));
}

/* what the product sees a kind's quants offset by, per unit of x's block sum: Q4_0's are
 * q - 8 stored + 8; the affine kinds add d * q + m, their offset taken apart; 8-bit ones are
 * the ISA's (QP_Q8_STORED_OFFSET) */
#define qp_offset(KIND) (FOUR_BIT(KIND) ? (AFFINE(KIND) ? 0 : 8) : QP_Q8_STORED_OFFSET)

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include "qpanel_avx512.h"
#else
#include "qpanel_avx2.h"
#endif

/* 2 on AVX-512 VNNI, 1 on AVX2 (0: neither, the stubs below) */
int qpanel_available(void) { return QPANEL_ISA; }

int64_t qpanel_work_bytes(int64_t M, int64_t K) { return M * act_bytes(K); }

static inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

static void quantize_row(const float *x, int64_t K, uint8_t *out) {
    float *d = (float *)(out + K);
    int32_t *sums = (int32_t *)(out + K + 4 * (K / 32));
    for (int64_t b = 0; b < K / 32; b++) {
        const float scale = q_amax32(x + 32 * b) / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        int32_t sum = 0;
        for (int e = 0; e < 32; e++) {
            const int32_t q = (int32_t)round_even(x[32 * b + e] * inv);
            out[32 * b + e] = (uint8_t)(int8_t)q;
            sum += q;
        }
        d[b] = scale;
        sums[b] = sum;
    }
}

/* tiles of more rows than ROWS are never asked for: the cap keeps their code in bounds */
#define CAP(n) ((n) < ROWS ? (n) : ROWS)
#define TILE_FOR(KIND)                                                                    \
    case KIND:                                                                            \
        switch (mr) {                                                                     \
        case 1: qp_tile(KIND, 1, a, K, w, d, m, out); break;                              \
        case 2: qp_tile(KIND, CAP(2), a, K, w, d, m, out); break;                         \
        case 3: qp_tile(KIND, CAP(3), a, K, w, d, m, out); break;                         \
        default: qp_tile(KIND, CAP(4), a, K, w, d, m, out); break;                        \
        }                                                                                 \
        break;

static void tile_any(int kind, int mr, uint8_t *const *a, int64_t K, const uint8_t *w,
                     const void *d, const void *m, float out[ROWS][PANEL]) {
    switch (kind) {
        TILE_FOR(QP_Q8_ROW)
        TILE_FOR(QP_Q8_F16)
        TILE_FOR(QP_Q4_F16)
        TILE_FOR(QP_Q4_AFF16)
        TILE_FOR(QP_Q4_AFF32)
    }
}
#undef TILE_FOR
#undef CAP

/* The layout of one call's operands, shared by the two entry points below. */
typedef struct {
    int kind;
    const float *x;
    int64_t ldx, M, K, N, ldy, rb, wpanel, spanel, panels;
    const uint8_t *wp;
    const void *d, *m;
    float *y;
    uint8_t *act;
} qp_call_t;

static int qp_call(qp_call_t *c, int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                   const uint8_t *wp, const void *d, const void *m, int64_t N, float *y,
                   int64_t ldy, void *work) {
    if (kind < QP_Q8_ROW || kind > QP_Q4_AFF32 || K % 32 || M < 0 || N < 0) return -1;
    *c = (qp_call_t){.kind = kind, .x = x, .ldx = ldx, .M = M, .K = K, .N = N, .ldy = ldy,
                     .rb = act_bytes(K), .panels = (N + PANEL - 1) / PANEL, .wp = wp, .d = d,
                     .m = m, .y = y, .act = (uint8_t *)work};
    c->wpanel = FOUR_BIT(kind) ? PANEL * K / 2 : PANEL * K;
    /* bytes of a panel's scales (and of its offsets) */
    c->spanel = kind == QP_Q8_ROW ? PANEL * 4
                                  : PANEL * (K / 32) * (kind == QP_Q4_AFF32 ? 4 : 2);
    return 0;
}

/* every row of x against panel p */
static void qp_panel(const qp_call_t *c, int64_t p) {
    const uint8_t *w = c->wp + p * c->wpanel;
    const void *dp = (const char *)c->d + p * c->spanel;
    const void *mp = AFFINE(c->kind) ? (const char *)c->m + p * c->spanel : NULL;
    const int64_t n0 = p * PANEL, nv = c->N - n0 < PANEL ? c->N - n0 : PANEL;
    for (int64_t r0 = 0; r0 < c->M; r0 += ROWS) {
        const int mr = c->M - r0 < ROWS ? (int)(c->M - r0) : ROWS;
        uint8_t *a[ROWS];
        float out[ROWS][PANEL];
        for (int i = 0; i < mr; i++) a[i] = c->act + (r0 + i) * c->rb;
        tile_any(c->kind, mr, a, c->K, w, dp, mp, out);
        for (int i = 0; i < mr; i++) memcpy(c->y + (r0 + i) * c->ldy + n0, out[i], nv * 4);
    }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T; K a multiple of 32; `d` the
 * scales (row scales for QP_Q8_ROW), `m` the affine kinds' offsets (else unused); work of
 * qpanel_work_bytes(M, K). Returns 0, or -1 for an unknown kind or a K that is not a multiple
 * of 32. */
int qpanel_gemm(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                const void *d, const void *m, int64_t N, float *y, int64_t ldy, void *work,
                int nthreads) {
    qp_call_t c;
    if (qp_call(&c, kind, x, ldx, M, K, wp, d, m, N, y, ldy, work)) return -1;
#pragma omp parallel for num_threads(nthreads) schedule(static) \
    if (M * K >= QPANEL_QUANTIZE_PARALLEL_MIN)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, c.act + r * c.rb);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= QPANEL_PARALLEL_MIN)
    for (int64_t p = 0; p < c.panels; p++) qp_panel(&c, p);
    return 0;
}

/* qpanel_gemm for a caller whose every thread of one OpenMP team calls it with the same
 * arguments (model/native_decode.c's layer loop runs a whole step in one team): the loops
 * below are orphaned work-sharing loops, shared out over that team, each ending in its
 * barrier, so no team is started per call. Up to TEAM_OWN_ROWS_MAX rows, each thread passes
 * its own `work` and quantizes all of x into it, with no barrier before the panels: a share
 * of one row is all or nothing, and the barrier's round trip and the quants carried to the
 * other core cost more than the row (tuning.h). Each panel and row is computed by the same
 * code as in qpanel_gemm, so the two give the same bits. `nthreads` is the team's (unused). */
int qpanel_gemm_team(int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                     const uint8_t *wp, const void *d, const void *m, int64_t N, float *y,
                     int64_t ldy, void *work, int nthreads) {
    (void)nthreads;
    qp_call_t c;
    if (qp_call(&c, kind, x, ldx, M, K, wp, d, m, N, y, ldy, work)) return -1;
    if (M <= TEAM_OWN_ROWS_MAX) {
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, c.act + r * c.rb);
    } else {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, c.act + r * c.rb);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < c.panels; p++) qp_panel(&c, p);
    return 0;
}
#else
int qpanel_available(void) { return 0; }
int64_t qpanel_work_bytes(int64_t M, int64_t K) { (void)M; (void)K; return 0; }
int qpanel_gemm(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                const void *d, const void *m, int64_t N, float *y, int64_t ldy, void *work,
                int nthreads) {
    (void)kind; (void)x; (void)ldx; (void)M; (void)K; (void)wp; (void)d; (void)m;
    (void)N; (void)y; (void)ldy; (void)work; (void)nthreads;
    return -1;
}
int qpanel_gemm_team(int kind, const float *x, int64_t ldx, int64_t M, int64_t K,
                     const uint8_t *wp, const void *d, const void *m, int64_t N, float *y,
                     int64_t ldy, void *work, int nthreads) {
    return qpanel_gemm(kind, x, ldx, M, K, wp, d, m, N, y, ldy, work, nthreads);
}
#endif
