/* y[M, N] = x[M, K] @ W[N, K]^T for int8 per-channel weights (`--quantization int8`) laid out
 * in panels for AVX-512 VNNI: the GEMM micro-kernel form of the quantized product.
 *
 * Why panels: ops/qgemm_cpu.c dots one weight row with a row of x and reduces the lanes per
 * output, so every block of 32 costs a conversion and two scale products per (row, output);
 * at many rows that is more instructions per multiply-add than float32. Here sixteen output
 * rows sit side by side: one vpdpbusd multiplies four bytes of x (broadcast) with four bytes
 * of each of sixteen weight rows, the int32 sums of a block of 32 stay in registers, and a
 * block ends with one subtraction, one conversion and one multiply-add per sixteen outputs.
 * Nothing is reduced across lanes.
 *
 * Layout (ops/q8_panel.py packs it): panels of PANEL = 16 output rows (N padded with zero
 * rows); panel p holds, for each 4-element step s of K, 64 bytes: row p*16 + l's elements
 * 4s..4s+3 at bytes 4l..4l+3 (signed). wsum[p][b][l] = 128 * the sum of row p*16 + l's block b
 * (vpdpbusd takes the unsigned operand first: x goes in as q + 128, and 128 * sum(w) comes
 * off). wd [N padded]: the rows' scales.
 *
 * Activations: per row and block of 32, scale amax / 127 and quants rounded to nearest even,
 * as the other quantized kernel makes them, so both give the same integer dot products. Each
 * row goes through the same instructions whatever the other rows are: a row's result does
 * not depend on the batch. Threads split the panels.
 */
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PANEL 16
#define ROWS 4 /* rows of x per tile: 2 x 4 accumulators of 16 lanes, int32 and float32 */

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
int q8p_available(void) { return 1; }

static int64_t act_bytes(int64_t K) { return (K + 4 * (K / 32) + 63) & ~(int64_t)63; }

int64_t q8p_work_bytes(int64_t M, int64_t K) { return M * act_bytes(K); }

static inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

/* one row of x: K bytes of q + 128, then K / 32 float scales */
static void quantize_row(const float *x, int64_t K, uint8_t *out) {
    float *d = (float *)(out + K);
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 lo = _mm512_loadu_ps(x + 32 * b), hi = _mm512_loadu_ps(x + 32 * b + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        d[b] = scale;
        for (int e = 0; e < 32; e++)
            out[32 * b + e] = (uint8_t)((int32_t)round_even(x[32 * b + e] * inv) + 128);
    }
}

/* MR rows of quantized x against one panel: y[r][0..16) */
static inline __attribute__((always_inline)) void tile(
        int MR, uint8_t *const *a, int64_t K, const int8_t *w, const int32_t *ws,
        const float *wd, float out[ROWS][PANEL]) {
    __m512 acc[ROWS];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m512i sum[ROWS];
        for (int r = 0; r < MR; r++) sum[r] = _mm512_setzero_si512();
        for (int s = 0; s < 8; s++) {
            const __m512i wv = _mm512_loadu_si512(w + (8 * b + s) * 64);
            for (int r = 0; r < MR; r++) {
                int32_t quad;
                memcpy(&quad, a[r] + 32 * b + 4 * s, 4);
                sum[r] = _mm512_dpbusd_epi32(sum[r], _mm512_set1_epi32(quad), wv);
            }
        }
        const __m512i off = _mm512_loadu_si512(ws + PANEL * b);
        for (int r = 0; r < MR; r++) {
            const float xd = ((const float *)(a[r] + K))[b];
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum[r], off)),
                                     _mm512_set1_ps(xd), acc[r]);
        }
    }
    const __m512 scale = _mm512_loadu_ps(wd);
    for (int r = 0; r < MR; r++) _mm512_storeu_ps(out[r], _mm512_mul_ps(acc[r], scale));
}

static void tile_any(int mr, uint8_t *const *a, int64_t K, const int8_t *w, const int32_t *ws,
                     const float *wd, float out[ROWS][PANEL]) {
    switch (mr) {
    case 1: tile(1, a, K, w, ws, wd, out); break;
    case 2: tile(2, a, K, w, ws, wd, out); break;
    case 3: tile(3, a, K, w, ws, wd, out); break;
    default: tile(4, a, K, w, ws, wd, out); break;
    }
}

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T; K a multiple of 32; work of
 * q8p_work_bytes(M, K). Returns 0, or -1 for a K that is not a multiple of 32. */
int q8p_gemm(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *wp,
             const int32_t *wsum, const float *wd, int64_t N, float *y, int64_t ldy,
             void *work, int nthreads) {
    if (K % 32 || M < 0 || N < 0) return -1;
    uint8_t *act = (uint8_t *)work;
    const int64_t rb = act_bytes(K), panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 8192)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, act + r * rb);
#pragma omp parallel for num_threads(nthreads) schedule(static) if (N * K >= 65536)
    for (int64_t p = 0; p < panels; p++) {
        const int8_t *w = wp + p * PANEL * K;
        const int32_t *ws = wsum + p * PANEL * (K / 32);
        const int64_t n0 = p * PANEL, nv = N - n0 < PANEL ? N - n0 : PANEL;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
            const int mr = M - r0 < ROWS ? (int)(M - r0) : ROWS;
            uint8_t *a[ROWS];
            float out[ROWS][PANEL];
            for (int i = 0; i < mr; i++) a[i] = act + (r0 + i) * rb;
            tile_any(mr, a, K, w, ws, wd + n0, out);
            for (int i = 0; i < mr; i++) memcpy(y + (r0 + i) * ldy + n0, out[i], nv * 4);
        }
    }
    return 0;
}
#else
int q8p_available(void) { return 0; }
int64_t q8p_work_bytes(int64_t M, int64_t K) { (void)M; (void)K; return 0; }
int q8p_gemm(const float *x, int64_t ldx, int64_t M, int64_t K, const int8_t *wp,
             const int32_t *wsum, const float *wd, int64_t N, float *y, int64_t ldy,
             void *work, int nthreads) {
    (void)x; (void)ldx; (void)M; (void)K; (void)wp; (void)wsum; (void)wd; (void)N; (void)y;
    (void)ldy; (void)work; (void)nthreads;
    return -1;
}
#endif
