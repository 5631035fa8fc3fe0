/* y[M, N] = x[M, K] @ W[N, K]^T for quantized weights laid out in panels for AVX-512 VNNI:
 * the GEMM micro-kernel form of the quantized product.
 *
 * Why panels: ops/qgemm_cpu.c dots one weight row with a row of x and reduces the lanes per
 * output, so every block of 32 costs a conversion and two scale products per (row, output);
 * at many rows that is more instructions per multiply-add than float32. Here sixteen output
 * rows sit side by side: one vpdpbusd multiplies four bytes of each of sixteen weight rows with
 * four bytes of x (broadcast), the int32 sums of a block of 32 stay in registers, and a block
 * ends with a few instructions per sixteen outputs. Nothing is reduced across lanes.
 *
 * Kinds (ops/qpanel.py packs them; N is padded to whole panels of PANEL = 16 rows with zeros),
 * numbered as ops/qgemm_cpu.c's:
 *   QP_Q8_ROW    int8, one float32 scale per output row (`--quantization int8`), at the end
 *   QP_Q8_F16    int8, a float16 scale per row and block of 32 (GGUF Q8_0)
 *   QP_Q4_F16    4-bit q in 0..15, w = d * (q - 8), float16 d (GGUF Q4_0, int4)
 *   QP_Q4_AFF16  4-bit, w = d * q + m, float16 d and m (GGUF Q4_1)
 *   QP_Q4_AFF32  4-bit, w = d * q + m, float32 d and m (GGUF Q4_K's sub-blocks)
 * vpdpbusd takes its first operand unsigned, and that operand is the weights: 8-bit quants are
 * stored as q + 128 and 4-bit ones are 0..15 already, while x goes in signed. The offsets then
 * depend on x alone (128 or 8 times its block's quant sum, computed once per row of x), so a
 * panel is its quants and scales and nothing else: the bytes a product reads are the format's.
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

#include "simd.h"
#include "tuning.h"

#define PANEL 16 /* output rows of a panel: the int32 lanes of one AVX-512 register */
#define ROWS QPANEL_TILE_ROWS
_Static_assert(ROWS == 4, "tile_any dispatches tiles of 1 to 4 rows");

enum { QP_Q8_ROW = 0, QP_Q8_F16 = 1, QP_Q4_F16 = 2, QP_Q4_AFF16 = 3, QP_Q4_AFF32 = 4 };
#define AFFINE(k) ((k) == QP_Q4_AFF16 || (k) == QP_Q4_AFF32)
#define FOUR_BIT(k) ((k) >= QP_Q4_F16)

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
int qpanel_available(void) { return 1; }

/* a row of quantized x: K signed bytes of q, K / 32 float scales, K / 32 int32 quant sums */
static int64_t act_bytes(int64_t K) { return (K + 8 * (K / 32) + 63) & ~(int64_t)63; }

int64_t qpanel_work_bytes(int64_t M, int64_t K) { return M * act_bytes(K); }

static inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

static void quantize_row(const float *x, int64_t K, uint8_t *out) {
    float *d = (float *)(out + K);
    int32_t *sums = (int32_t *)(out + K + 4 * (K / 32));
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
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

static inline __attribute__((always_inline)) __m512i bcast4(const uint8_t *p) {
    int32_t quad;
    memcpy(&quad, p, 4);
    return _mm512_set1_epi32(quad);
}

/* sixteen block scales (or offsets) of a panel in the kind's precision, as float32 */
static inline __attribute__((always_inline)) __m512 block_floats(int KIND, const void *p,
                                                                 int64_t b) {
    if (KIND == QP_Q4_AFF32) return _mm512_loadu_ps((const float *)p + PANEL * b);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p +
                                                                  PANEL * b)));
}

/* MR rows of quantized x (a[r]) against one panel of KIND: out[r][0..16). `d` and `m` are
 * the panel's scales and offsets (QP_Q8_ROW: its sixteen row scales). */
static inline __attribute__((always_inline)) void tile(
        int KIND, int MR, uint8_t *const *a, int64_t K, const uint8_t *w, const void *d,
        const void *m, float out[ROWS][PANEL]) {
    const int64_t B = K / 32;
    /* the weights' offset per unit of x's block sum: 8-bit quants are stored + 128, Q4_0's
     * are q - 8 stored + 8; the affine kinds add d * q + m, their offset taken apart */
    const int32_t offset = FOUR_BIT(KIND) ? (AFFINE(KIND) ? 0 : 8) : 128;
    __m512 acc[ROWS];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i sum[ROWS];
        for (int r = 0; r < MR; r++) sum[r] = _mm512_setzero_si512();
        if (FOUR_BIT(KIND)) {
            const __m512i low = _mm512_set1_epi8(0x0f);
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(w + (4 * b + t) * 64);
                const __m512i w0 = _mm512_and_si512(v, low);
                const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < MR; r++) {
                    sum[r] = _mm512_dpbusd_epi32(sum[r], w0, bcast4(a[r] + 32 * b + 8 * t));
                    sum[r] = _mm512_dpbusd_epi32(sum[r], w1, bcast4(a[r] + 32 * b + 8 * t + 4));
                }
            }
        } else {
            for (int s = 0; s < 8; s++) {
                const __m512i wv = _mm512_loadu_si512(w + (8 * b + s) * 64);
                for (int r = 0; r < MR; r++)
                    sum[r] = _mm512_dpbusd_epi32(sum[r], wv, bcast4(a[r] + 32 * b + 4 * s));
            }
        }
        const __m512 bs = KIND == QP_Q8_ROW ? _mm512_setzero_ps() : block_floats(KIND, d, b);
        const __m512 bm = AFFINE(KIND) ? block_floats(KIND, m, b) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const float xd = ((const float *)(a[r] + K))[b];
            const int32_t xsum = ((const int32_t *)(a[r] + K + 4 * B))[b];
            const __m512i dot = _mm512_sub_epi32(sum[r], _mm512_set1_epi32(offset * xsum));
            const __m512 s = KIND == QP_Q8_ROW ? _mm512_set1_ps(xd)
                                               : _mm512_mul_ps(_mm512_set1_ps(xd), bs);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
            if (AFFINE(KIND)) acc[r] = _mm512_fmadd_ps(bm, _mm512_set1_ps(xd * (float)xsum),
                                                       acc[r]);
        }
    }
    const __m512 rs = KIND == QP_Q8_ROW ? _mm512_loadu_ps(d) : _mm512_set1_ps(1.f);
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r], rs));
}

#define TILE_FOR(KIND)                                                                    \
    case KIND:                                                                            \
        switch (mr) {                                                                     \
        case 1: tile(KIND, 1, a, K, w, d, m, out); break;                                 \
        case 2: tile(KIND, 2, a, K, w, d, m, out); break;                                 \
        case 3: tile(KIND, 3, a, K, w, d, m, out); break;                                 \
        default: tile(KIND, 4, a, K, w, d, m, out); break;                                \
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

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T; K a multiple of 32; `d` the
 * scales (row scales for QP_Q8_ROW), `m` the affine kinds' offsets (else unused); work of
 * qpanel_work_bytes(M, K). Returns 0, or -1 for an unknown kind or a K that is not a multiple
 * of 32. */
int qpanel_gemm(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *wp,
                const void *d, const void *m, int64_t N, float *y, int64_t ldy, void *work,
                int nthreads) {
    if (kind < QP_Q8_ROW || kind > QP_Q4_AFF32 || K % 32 || M < 0 || N < 0) return -1;
    uint8_t *act = (uint8_t *)work;
    const int64_t rb = act_bytes(K), panels = (N + PANEL - 1) / PANEL;
    const int64_t wpanel = FOUR_BIT(kind) ? PANEL * K / 2 : PANEL * K;
    /* bytes of a panel's scales (and of its offsets) */
    const int64_t spanel = kind == QP_Q8_ROW ? PANEL * 4
                                             : PANEL * (K / 32) * (kind == QP_Q4_AFF32 ? 4 : 2);
#pragma omp parallel for num_threads(nthreads) schedule(static) \
    if (M * K >= QPANEL_QUANTIZE_PARALLEL_MIN)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, act + r * rb);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= QPANEL_PARALLEL_MIN)
    for (int64_t p = 0; p < panels; p++) {
        const uint8_t *w = wp + p * wpanel;
        const void *dp = (const char *)d + p * spanel;
        const void *mp = AFFINE(kind) ? (const char *)m + p * spanel : NULL;
        const int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int mr = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            uint8_t *a[ROWS];
            float out[ROWS][PANEL];
            for (int i = 0; i < mr; i++) a[i] = act + (r0 + i) * rb;
            tile_any(kind, mr, a, K, w, dp, mp, out);
            for (int i = 0; i < mr; i++) memcpy(y + (r0 + i) * ldy + n0, out[i], nv * 4);
        }
    }
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
#endif
