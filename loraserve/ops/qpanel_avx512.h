/* The panel micro-kernel of ops/qpanel_gemm.c on AVX-512 VNNI: a panel's sixteen int32 lanes
 * are one zmm register, and one vpdpbusd multiplies four bytes of each of sixteen weight rows
 * with four bytes of x (broadcast). vpdpbusd takes its first operand unsigned, and that
 * operand is the weights: 8-bit quants are stored as q + 128 and 4-bit ones are 0..15
 * already, while x goes in signed; the offsets are taken apart with x's block sums.
 *
 * Defines QPANEL_ISA (2), QP_Q8_STORED_OFFSET (what the product sees 8-bit quants offset
 * by) and qp_tile(KIND, MR, a, K, w, d, m, out), as ops/qpanel_avx2.h does.
 * Included by ops/qpanel_gemm.c alone, after its kinds and PANEL, ROWS.
 */
#ifndef LORASERVE_QPANEL_AVX512_H
#define LORASERVE_QPANEL_AVX512_H

#define QPANEL_ISA 2
#define QP_Q8_STORED_OFFSET 128

SIMD_INLINE __m512i bcast4(const uint8_t *p) {
    int32_t quad;
    memcpy(&quad, p, 4);
    return _mm512_set1_epi32(quad);
}

/* sixteen block scales (or offsets) of a panel in the kind's precision, as float32 */
SIMD_INLINE __m512 block_floats(int KIND, const void *p, int64_t b) {
    if (KIND == QP_Q4_AFF32) return _mm512_loadu_ps((const float *)p + PANEL * b);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p +
                                                                  PANEL * b)));
}

/* MR rows of quantized x (a[r]) against one panel of KIND: out[r][0..16). `d` and `m` are
 * the panel's scales and offsets (QP_Q8_ROW: its sixteen row scales). */
SIMD_INLINE void qp_tile(int KIND, int MR, uint8_t *const *a, int64_t K, const uint8_t *w,
                         const void *d, const void *m, float out[ROWS][PANEL]) {
    const int64_t B = K / 32;
    const int32_t offset = qp_offset(KIND);
    __m512 acc[ROWS];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < B; b++) {
        __m512i sum[ROWS];
        for (int r = 0; r < MR; r++) sum[r] = _mm512_setzero_si512();
        if (FOUR_BIT(KIND)) {
            const __m512i low = _mm512_set1_epi8(0x0f);
            for (int t = 0; t < 4; t++) {
                const __m512i v = _mm512_loadu_si512(w + (4 * b + t) * 64);
                if (QPANEL_FETCH_AHEAD_4BIT)
                    PREFETCH(w + (4 * b + t) * 64 + QPANEL_FETCH_AHEAD_4BIT, PF_L1);
                if (QPANEL_FETCH_L2_4BIT)
                    PREFETCH(w + (4 * b + t) * 64 + QPANEL_FETCH_L2_4BIT, PF_L2);
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
                if (QPANEL_FETCH_AHEAD_8BIT)
                    PREFETCH(w + (8 * b + s) * 64 + QPANEL_FETCH_AHEAD_8BIT, PF_L1);
                if (QPANEL_FETCH_L2_8BIT)
                    PREFETCH(w + (8 * b + s) * 64 + QPANEL_FETCH_L2_8BIT, PF_L2);
                for (int r = 0; r < MR; r++)
                    sum[r] = _mm512_dpbusd_epi32(sum[r], wv, bcast4(a[r] + 32 * b + 4 * s));
            }
        }
        const __m512 bs = KIND == QP_Q8_ROW ? _mm512_setzero_ps() : block_floats(KIND, d, b);
        const __m512 bm = AFFINE(KIND) ? block_floats(KIND, m, b) : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const float xd = qp_act_scales(a[r], K)[b];
            const int32_t xsum = qp_act_sums(a[r], K)[b];
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

#endif
