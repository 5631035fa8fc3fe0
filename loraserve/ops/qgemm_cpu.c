/* y[M, N] = x[M, K] @ W[N, K]^T with W quantized (weight-only), x float32: the base projections
 * of a model served with 8-bit or 4-bit weights (ops/quant.py packs them; ops/qblock.h says
 * how groups, dot order and activations are laid out).
 *
 * Formats (QK_*), each a group of 64 as two blocks of 32 along K:
 *   Q8_ROW    8-bit signed, one float32 scale per output row (int8 per channel)
 *   Q8_F16    8-bit signed, a float16 scale per block (GGUF Q8_0)
 *   Q4_F16    4-bit, w = d * (q - 8), float16 d per block (GGUF Q4_0; int4)
 *   Q4_AFF16  4-bit, w = d * q + m, float16 d and m per block (GGUF Q4_1)
 *   Q4_AFF32  4-bit, w = d * q + m, float32 d and m per block (GGUF Q4_K's sub-blocks, whose
 *             d * scale products float16 cannot hold exactly)
 *
 * The activations are quantized once per call into `work` (qgemm_work_bytes), then threads
 * split the output columns into chunks of weight rows that stay in L2 (QGEMM_WBLOCK); each
 * chunk meets the rows of x a block at a time, a block that stays in L1 (QGEMM_XBLOCK), each
 * weight row QGEMM_TILE_ROWS rows of x at once, so a weight group is unpacked once per tile.
 * A batch of one reads each weight once, as one stream per thread.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qblock.h"
#include "tuning.h"

enum { QK_Q8_ROW = 0, QK_Q8_F16 = 1, QK_Q4_F16 = 2, QK_Q4_AFF16 = 3, QK_Q4_AFF32 = 4 };

int qgemm_isa(void) { return QGEMM_ISA; }

#if QGEMM_ISA
/* One row of quantized activations in `work`: xq [K] in dot order, xd [K/32] block scales,
 * xo [K/32]: per block, its byte sum times its scale, spread over the block's QLANES / 2
 * lanes (divided by them), times -offset for the symmetric formats: the offset's share,
 * applied in float32 with the weight's scale (symmetric) or offset (affine). */
typedef struct {
    const int8_t *xq;
    const float *xd;
    const float *xo;
} qact;

static int64_t row_bytes(int64_t K) { return (K + 8 * (K / 32) + 63) & ~(int64_t)63; }

static qact act_row(uint8_t *work, int64_t K, int64_t r) {
    uint8_t *p = work + r * row_bytes(K);
    const qact a = {(const int8_t *)p, (const float *)(p + K),
                    (const float *)(p + K + 4 * (K / 32))};
    return a;
}

static int weight_bits(int kind) { return kind <= QK_Q8_F16 ? 8 : 4; }

static int32_t weight_offset(int kind) {
    return weight_bits(kind) == 8 ? Q8_OFFSET : kind == QK_Q4_F16 ? 8 : 0;
}

/* round to nearest, ties to even, for |v| < 2^22: adding 1.5 * 2^23 leaves no fraction bits
 * (a form gcc vectorizes, where lrintf is a library call per element) */
static inline float round_even(float v) { return (v + 12582912.f) - 12582912.f; }

/* one row of x into its quantized form, for weights of `kind` */
static void quantize_row(const float *x, int64_t K, int kind, qact a) {
    int8_t *xq = (int8_t *)a.xq;
    float *xd = (float *)a.xd, *xo = (float *)a.xo;
    const float off = kind == QK_Q4_AFF16 || kind == QK_Q4_AFF32 ? -1.f : (float)weight_offset(kind);
    for (int64_t g = 0; g < K / 64; g++) {
        const float *xg = x + 64 * g;
        float inv[2];
        for (int blk = 0; blk < 2; blk++) {
            const float d = q_amax32(xg + 32 * blk) / 127.f;
            xd[2 * g + blk] = d;
            inv[blk] = d > 0.f ? 1.f / d : 0.f;
        }
        int8_t q[64];
        for (int e = 0; e < 64; e++) q[e] = (int8_t)(int32_t)round_even(xg[e] * inv[e >> 5]);
        int32_t sums[2] = {0, 0};
        for (int l = 0; l < 16; l++) {  /* dot order: lanes alternate blocks A and B */
            const int8_t *src = q + 32 * (l & 1) + 4 * (l >> 1);
            memcpy(xq + 64 * g + 4 * l, src, 4);
            sums[l & 1] += src[0] + src[1] + src[2] + src[3];
        }
        for (int blk = 0; blk < 2; blk++)
            xo[2 * g + blk] = -off * (float)sums[blk] * xd[2 * g + blk] / (QLANES / 2);
    }
}

/* MR rows of x (a[0..MR)) against weight row n: out[r] = x_r . w_n */
SIMD_INLINE void tile(int kind, int MR, const qact *a, const uint8_t *qs, const void *d,
                      const void *m, int64_t n, int64_t K, float *out) {
    const int64_t G = K / 64, bits = weight_bits(kind);
    const uint8_t *wq = qs + n * (bits == 8 ? K : K / 2);
    const uint16_t *d16 = (const uint16_t *)d + n * (K / 32);
    const uint16_t *m16 = (const uint16_t *)m + n * (K / 32);
    const float *d32 = (const float *)d + n * (K / 32), *m32 = (const float *)m + n * (K / 32);
    /* a single row alternates two accumulators over the groups: one chain of FMAs would be
     * bound by their latency rather than by the ports */
    qvec acc[QGEMM_TILE_ROWS], acc1 = q_zero();
    for (int r = 0; r < MR; r++) acc[r] = q_zero();
    for (int64_t g = 0; g < G; g++) {
        const qweights w = bits == 8 ? q8_weights(wq + 64 * g) : q4_weights(wq + 32 * g);
        qvec ws = q_zero(), ms = q_zero();
        if (kind == QK_Q8_F16 || kind == QK_Q4_F16 || kind == QK_Q4_AFF16)
            ws = q_pair_f16(d16 + 2 * g);
        if (kind == QK_Q4_AFF32) ws = q_pair_f32(d32 + 2 * g);
        if (kind == QK_Q4_AFF16) ms = q_pair_f16(m16 + 2 * g);
        if (kind == QK_Q4_AFF32) ms = q_pair_f32(m32 + 2 * g);
        for (int r = 0; r < MR; r++) {
            const qvec s = q_cvt(q_dot(qi_zero(), w, a[r].xq + 64 * g, bits));
            const qvec x = q_pair_f32(a[r].xd + 2 * g), o = q_pair_f32(a[r].xo + 2 * g);
            qvec t = MR == 1 && (g & 1) ? acc1 : acc[r];
            if (kind == QK_Q8_ROW) {
                t = q_add(q_fma(s, x, t), o);
            } else {
                t = q_fma(s, q_mul(x, ws), t);
                t = q_fma(o, kind == QK_Q4_AFF16 || kind == QK_Q4_AFF32 ? ms : ws, t);
            }
            if (MR == 1 && (g & 1))
                acc1 = t;
            else
                acc[r] = t;
        }
    }
    if (MR == 1) acc[0] = q_add(acc[0], acc1);
    const float row_scale = kind == QK_Q8_ROW ? ((const float *)d)[n] : 1.f;
    for (int r = 0; r < MR; r++) out[r] = q_hsum(acc[r]) * row_scale;
}

#define TILE_FOR(KIND)                                                                     \
    case KIND:                                                                             \
        switch (mr) {                                                                      \
        case 1: tile(KIND, 1, a, qs, d, m, n, K, out); break;                              \
        case 2: tile(KIND, 2, a, qs, d, m, n, K, out); break;                              \
        case 3: tile(KIND, 3, a, qs, d, m, n, K, out); break;                              \
        default: tile(KIND, 4, a, qs, d, m, n, K, out); break;                             \
        }                                                                                  \
        break;

static void tile_any(int kind, int mr, const qact *a, const uint8_t *qs, const void *d,
                     const void *m, int64_t n, int64_t K, float *out) {
    switch (kind) {
        TILE_FOR(QK_Q8_ROW)
        TILE_FOR(QK_Q8_F16)
        TILE_FOR(QK_Q4_F16)
        TILE_FOR(QK_Q4_AFF16)
        TILE_FOR(QK_Q4_AFF32)
    }
}
#undef TILE_FOR

int64_t qgemm_work_bytes(int64_t M, int64_t K) { return M * row_bytes(K); }

/* y [M, N] (row stride ldy) = x [M, K] (row stride ldx) @ W^T; K a multiple of 64; work of
 * qgemm_work_bytes(M, K), 64-byte aligned. Returns 0, or -1 for an unknown kind or a K that
 * is not a multiple of 64. */
int qgemm(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *qs,
          const void *d, const void *m, int64_t N, float *y, int64_t ldy, void *work,
          int nthreads) {
    if (kind < QK_Q8_ROW || kind > QK_Q4_AFF32 || K % 64 || M < 0 || N < 0) return -1;
    const int parallel = M * N * K >= QGEMM_PARALLEL_MIN;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= QGEMM_PARALLEL_MIN)
    for (int64_t r = 0; r < M; r++) quantize_row(x + r * ldx, K, kind, act_row(work, K, r));
    int64_t mc = QGEMM_XBLOCK * 1024 / row_bytes(K) / QGEMM_TILE_ROWS * QGEMM_TILE_ROWS;
    mc = mc < QGEMM_TILE_ROWS ? QGEMM_TILE_ROWS : mc;
    /* weight rows per chunk: within QGEMM_WBLOCK, and whole rounds of chunks for the threads */
    const int64_t wrow = (weight_bits(kind) == 8 ? K : K / 2) + K / 8, team = parallel ? nthreads : 1;
    int64_t chunks = (N * wrow + QGEMM_WBLOCK * 1024 - 1) / (QGEMM_WBLOCK * 1024);
    chunks = (chunks + team - 1) / team * team;
    const int64_t nc = (N + chunks - 1) / chunks;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (parallel)
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n0 = c * nc, n1 = N < n0 + nc ? N : n0 + nc;
        for (int64_t m0 = 0; m0 < M; m0 += mc) {
            const int64_t m1 = M - m0 < mc ? M : m0 + mc;
            for (int64_t n = n0; n < n1; n++) {
                for (int64_t r = m0; r < m1; r += QGEMM_TILE_ROWS) {
                    const int mr = m1 - r < QGEMM_TILE_ROWS ? (int)(m1 - r) : QGEMM_TILE_ROWS;
                    qact a[QGEMM_TILE_ROWS];
                    float out[QGEMM_TILE_ROWS];
                    for (int i = 0; i < mr; i++) a[i] = act_row(work, K, r + i);
                    tile_any(kind, mr, a, qs, d, m, n, K, out);
                    for (int i = 0; i < mr; i++) y[(r + i) * ldy + n] = out[i];
                }
            }
        }
    }
    return 0;
}
#else
int64_t qgemm_work_bytes(int64_t M, int64_t K) { (void)M; (void)K; return 0; }
int qgemm(int kind, const float *x, int64_t ldx, int64_t M, int64_t K, const uint8_t *qs,
          const void *d, const void *m, int64_t N, float *y, int64_t ldy, void *work,
          int nthreads) {
    (void)kind; (void)x; (void)ldx; (void)M; (void)K; (void)qs; (void)d; (void)m; (void)N;
    (void)y; (void)ldy; (void)work; (void)nthreads;
    return -1;
}
#endif
