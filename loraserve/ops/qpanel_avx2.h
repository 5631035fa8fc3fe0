/* The panel micro-kernel of ops/qpanel_gemm.c on AVX2: a panel's sixteen int32 lanes are two
 * ymm registers (rows 0..7 and 8..15 of the panel, the two 32-byte halves of each 64-byte
 * step), and vpmaddubsw multiplies unsigned bytes with signed ones into int16 pairs.
 *
 * A tile of 3 or 4 rows computes one half of the panel over all of K, then the other: both
 * halves at once need two accumulators per row and half, more than AVX2's sixteen registers
 * hold, and the spills cost more than reading the panel's weights twice (the second time from
 * L1). Tiles of 1 or 2 rows fit, and take both halves at once: a batch-1 product is a stream
 * from memory, which a second pass over each panel slowed (docs/cpu-kernels.md).
 *
 * 4-bit quants (0..15) are the unsigned operand and x (-127..127) the signed one: a pair is at
 * most 2 * 15 * 127 in magnitude, so the eight steps of a block of 32 add up in int16
 * (vpaddw, at most 30480) and widen to int32 once per block (vpmaddwd with ones).
 * 8-bit quants, stored q + 128 for VNNI, are flipped back to signed (one xor per step, shared
 * by the rows) and multiplied as |w| . sign(x, w), as llama.cpp's AVX2 kernels do: unsigned
 * q + 128 against signed x would saturate vpmaddubsw's pairs (2 * 255 * 127). A pair is then
 * at most 2 * 128 * 127, so every step widens to int32 at once.
 *
 * Every lane's integer dot product and float operations (the same fma, in the same order)
 * are those of the AVX-512 kernel, so both builds give the same bits.
 *
 * Defines QPANEL_ISA (1), QP_Q8_STORED_OFFSET and qp_tile(...), as ops/qpanel_avx512.h
 * does. Included by ops/qpanel_gemm.c alone.
 */
#ifndef LORASERVE_QPANEL_AVX2_H
#define LORASERVE_QPANEL_AVX2_H

#define QPANEL_ISA 1
#define QP_Q8_STORED_OFFSET 0 /* flipped back to signed before the product */

SIMD_INLINE __m256i bcast4(const uint8_t *p) {
    int32_t quad;
    memcpy(&quad, p, 4);
    return _mm256_set1_epi32(quad);
}

/* eight block scales (or offsets) of half h of a panel in the kind's precision, as float32 */
SIMD_INLINE __m256 block_floats(int KIND, const void *p, int64_t b, int h) {
    if (KIND == QP_Q4_AFF32) return _mm256_loadu_ps((const float *)p + PANEL * b + 8 * h);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + PANEL * b +
                                                               8 * h)));
}

/* halves of a panel a tile of MR rows computes at once: one for 3 rows or more, whose
 * accumulators for both halves would not fit the sixteen ymm registers */
#define QP_HALVES(MR) ((MR) >= 3 ? 1 : 2)

/* the int32 dot products of a block of 32 for MR rows and the panel's halves h0.. (half h:
 * its rows 8h..8h+7, the bytes 32h..32h+31 of each 64-byte step) into sum[r][h - h0] */
SIMD_INLINE void block_dots(int KIND, int MR, uint8_t *const *a, const uint8_t *w, int64_t b,
                            int h0, __m256i sum[ROWS][2]) {
    const int NH = QP_HALVES(MR);
    const __m256i ones = _mm256_set1_epi16(1);
    if (FOUR_BIT(KIND)) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        __m256i s16[ROWS][2];
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NH; j++) s16[r][j] = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++) {
            const uint8_t *p = w + (4 * b + t) * 64;
            if (QPANEL_FETCH_AHEAD_4BIT && !h0) PREFETCH(p + QPANEL_FETCH_AHEAD_4BIT, PF_L1);
            if (QPANEL_FETCH_L2_4BIT && !h0) PREFETCH(p + QPANEL_FETCH_L2_4BIT, PF_L2);
            __m256i w0[2], w1[2];  /* [half]: the first step (low nibbles), the second (high) */
            for (int j = 0; j < NH; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * (h0 + j)));
                w0[j] = _mm256_and_si256(v, low);
                w1[j] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < MR; r++) {
                const __m256i x0 = bcast4(a[r] + 32 * b + 8 * t);
                const __m256i x1 = bcast4(a[r] + 32 * b + 8 * t + 4);
                for (int j = 0; j < NH; j++)
                    s16[r][j] = _mm256_add_epi16(
                        s16[r][j], _mm256_add_epi16(_mm256_maddubs_epi16(w0[j], x0),
                                                    _mm256_maddubs_epi16(w1[j], x1)));
            }
        }
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NH; j++) sum[r][j] = _mm256_madd_epi16(s16[r][j], ones);
        return;
    }
    const __m256i flip = _mm256_set1_epi8((char)0x80);
    for (int r = 0; r < MR; r++)
        for (int j = 0; j < NH; j++) sum[r][j] = _mm256_setzero_si256();
    for (int s = 0; s < 8; s++) {
        const uint8_t *p = w + (8 * b + s) * 64;
        if (QPANEL_FETCH_AHEAD_8BIT && !h0) PREFETCH(p + QPANEL_FETCH_AHEAD_8BIT, PF_L1);
        if (QPANEL_FETCH_L2_8BIT && !h0) PREFETCH(p + QPANEL_FETCH_L2_8BIT, PF_L2);
        __m256i q[2], mag[2];
        for (int j = 0; j < NH; j++) {
            q[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 32 * (h0 + j))),
                                    flip);
            mag[j] = _mm256_abs_epi8(q[j]);
        }
        for (int r = 0; r < MR; r++) {
            const __m256i x = bcast4(a[r] + 32 * b + 4 * s);
            for (int j = 0; j < NH; j++) {
                const __m256i pairs = _mm256_maddubs_epi16(mag[j], _mm256_sign_epi8(x, q[j]));
                sum[r][j] = _mm256_add_epi32(sum[r][j], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
}

/* MR rows of quantized x (a[r]) against one panel of KIND: out[r][0..16), QP_HALVES(MR)
 * halves of the panel at a time over the whole of K. `d` and `m` are the panel's scales and
 * offsets (QP_Q8_ROW: its sixteen row scales). */
SIMD_INLINE void qp_tile(int KIND, int MR, uint8_t *const *a, int64_t K, const uint8_t *w,
                         const void *d, const void *m, float out[ROWS][PANEL]) {
    const int NH = QP_HALVES(MR);
    const int64_t B = K / 32;
    const int32_t offset = qp_offset(KIND);
    for (int h0 = 0; h0 < 2; h0 += NH) {
        __m256 acc[ROWS][2];
        for (int r = 0; r < MR; r++)
            for (int j = 0; j < NH; j++) acc[r][j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < B; b++) {
            __m256i sum[ROWS][2];
            block_dots(KIND, MR, a, w, b, h0, sum);
            for (int j = 0; j < NH; j++) {
                const int h = h0 + j;
                const __m256 bs = KIND == QP_Q8_ROW ? _mm256_setzero_ps()
                                                    : block_floats(KIND, d, b, h);
                const __m256 bm = AFFINE(KIND) ? block_floats(KIND, m, b, h)
                                               : _mm256_setzero_ps();
                for (int r = 0; r < MR; r++) {
                    const float xd = qp_act_scales(a[r], K)[b];
                    const int32_t xsum = qp_act_sums(a[r], K)[b];
                    const __m256i dot = _mm256_sub_epi32(sum[r][j],
                                                         _mm256_set1_epi32(offset * xsum));
                    const __m256 s = KIND == QP_Q8_ROW ? _mm256_set1_ps(xd)
                                                       : _mm256_mul_ps(_mm256_set1_ps(xd), bs);
                    acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r][j]);
                    if (AFFINE(KIND))
                        acc[r][j] = _mm256_fmadd_ps(bm, _mm256_set1_ps(xd * (float)xsum),
                                                    acc[r][j]);
                }
            }
        }
        for (int j = 0; j < NH; j++) {
            const int h = h0 + j;
            const __m256 rs = KIND == QP_Q8_ROW ? _mm256_loadu_ps((const float *)d + 8 * h)
                                                : _mm256_set1_ps(1.f);
            for (int r = 0; r < MR; r++)
                _mm256_storeu_ps(out[r] + 8 * h, _mm256_mul_ps(acc[r][j], rs));
        }
    }
}

#endif
