/* Quantized weight blocks and their integer dot products with int8 activations, per ISA: the
 * vocabulary of ops/qgemm_cpu.c.
 *
 * Weights come in groups of 64 along K: two blocks of 32 (A = elements 0..31, B = 32..63),
 * each with its own scale (and, for the affine formats, its own offset). A group's 64 values
 * are stored in "dot order": dot byte i holds element 32 * blk + 4 * (l >> 1) + (i & 3), where
 * l = i >> 2 is the int32 lane the byte is summed into and blk = l & 1. So the int32 lanes of
 * a byte dot product (vpdpbusd; vpmaddubsw + vpmaddwd) alternate A, B, A, B, and a pair of
 * per-block scales is one 64-bit broadcast (lanes A, B, A, B, ...): scales are applied per
 * lane, every group, and the lanes are summed once per output. 8-bit weights are one signed
 * byte each; 4-bit weights two to a byte: byte j of a group's 32 holds dot byte j in its low
 * nibble and dot byte j + 32 in its high one, unsigned (0..15).
 *
 * Activations are quantized per block of 32 to int8 (scale amax / 127), in the same dot
 * order, the way llama.cpp's Q8 activations are: a byte product is exact in int32, where
 * dequantizing weights to float32 in registers would spend several instructions per weight
 * and leave batch-1 decode short of memory bandwidth. With them comes, per block, its byte
 * sum times its scale (ops/qgemm_cpu.c), for the weights' offsets: (w + offset) . x is
 * w . x + offset * sum(x).
 *
 *   QLANES                   int32 lanes of one group's dot product: 16 (AVX-512 VNNI) or 8
 *                            (AVX2: a group is two 256-bit halves, added lane by lane); half
 *                            of them belong to each block
 *   qvec / qivec             QLANES floats / int32s
 *   Q8_OFFSET                what 8-bit weights are offset by in the product: 128 with VNNI
 *                            (vpdpbusd takes unsigned weights), 0 with AVX2 (|w| . sign(x, w))
 *   q8_weights(p) q4_weights(p)   one group's weights, ready for q_dot
 *   q_dot(acc, w, x, bits)   acc + the lanes' byte products of w with the int8 group at x
 *   q_amax32(p)              the largest magnitude of 32 floats
 */
#ifndef LORASERVE_QBLOCK_H
#define LORASERVE_QBLOCK_H

#include <stdint.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QGEMM_ISA 2
#define QLANES 16
#define Q8_OFFSET 128
typedef __m512 qvec;
typedef __m512i qivec;
typedef __m512i qweights;

SIMD_INLINE qweights q8_weights(const uint8_t *p) {  /* signed w + 128, as unsigned bytes */
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8((char)0x80));
}
SIMD_INLINE qweights q4_weights(const uint8_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), low = _mm256_set1_epi8(0x0f);
    const __m256i lo = _mm256_and_si256(v, low);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
SIMD_INLINE qivec q_dot(qivec acc, qweights w, const int8_t *x, int bits) {
    (void)bits;
    return _mm512_dpbusd_epi32(acc, w, _mm512_loadu_si512(x));
}
SIMD_INLINE qivec qi_zero(void) { return _mm512_setzero_si512(); }
SIMD_INLINE qvec q_load(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE qvec q_zero(void) { return _mm512_setzero_ps(); }
SIMD_INLINE qvec q_cvt(qivec v) { return _mm512_cvtepi32_ps(v); }
SIMD_INLINE qvec q_mul(qvec a, qvec b) { return _mm512_mul_ps(a, b); }
SIMD_INLINE qvec q_add(qvec a, qvec b) { return _mm512_add_ps(a, b); }
SIMD_INLINE qvec q_fma(qvec a, qvec b, qvec c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE float q_hsum(qvec v) { return _mm512_reduce_add_ps(v); }
/* lanes A, B, A, B, ... from two floats, or two halves (float16), at p */
SIMD_INLINE qvec q_pair_f32(const float *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return _mm512_castpd_ps(_mm512_set1_pd(d));
}
SIMD_INLINE float q_amax32(const float *p) {  /* the largest |p[i]| of 32 */
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(p)), b = _mm512_abs_ps(_mm512_loadu_ps(p + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}
SIMD_INLINE qvec q_pair_f16(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm512_cvtph_ps(_mm256_set1_epi32(v));
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QGEMM_ISA 1
#define QLANES 8
#define Q8_OFFSET 0
typedef __m256 qvec;
typedef __m256i qivec;
typedef struct {
    __m256i h0, h1;  /* dot bytes 0..31 and 32..63 */
} qweights;

SIMD_INLINE qweights q8_weights(const uint8_t *p) {
    const qweights w = {_mm256_loadu_si256((const __m256i *)p),
                        _mm256_loadu_si256((const __m256i *)(p + 32))};
    return w;
}
SIMD_INLINE qweights q4_weights(const uint8_t *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p), low = _mm256_set1_epi8(0x0f);
    const qweights w = {_mm256_and_si256(v, low),
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low)};
    return w;
}
/* one half's lanes: 4-bit weights are unsigned already; 8-bit ones as |w| . sign(x, w), which
 * stays within vpmaddubsw's int16 pairs (2 * 128 * 127) where x is in -127..127 */
SIMD_INLINE __m256i q_half(__m256i w, __m256i x, int bits) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p = bits == 8 ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w))
                                : _mm256_maddubs_epi16(w, x);
    return _mm256_madd_epi16(p, ones);
}
SIMD_INLINE qivec q_dot(qivec acc, qweights w, const int8_t *x, int bits) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)x);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + 32));
    return _mm256_add_epi32(acc, _mm256_add_epi32(q_half(w.h0, x0, bits),
                                                  q_half(w.h1, x1, bits)));
}
SIMD_INLINE qivec qi_zero(void) { return _mm256_setzero_si256(); }
SIMD_INLINE qvec q_load(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE qvec q_zero(void) { return _mm256_setzero_ps(); }
SIMD_INLINE qvec q_cvt(qivec v) { return _mm256_cvtepi32_ps(v); }
SIMD_INLINE qvec q_mul(qvec a, qvec b) { return _mm256_mul_ps(a, b); }
SIMD_INLINE qvec q_add(qvec a, qvec b) { return _mm256_add_ps(a, b); }
SIMD_INLINE qvec q_fma(qvec a, qvec b, qvec c) { return _mm256_fmadd_ps(a, b, c); }
SIMD_INLINE float q_hsum(qvec v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}
SIMD_INLINE qvec q_pair_f32(const float *p) {
    double d;
    memcpy(&d, p, sizeof d);
    return _mm256_castpd_ps(_mm256_set1_pd(d));
}
SIMD_INLINE float q_amax32(const float *p) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_and_ps(_mm256_loadu_ps(p), abs);
    for (int i = 8; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(p + i), abs));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
}
SIMD_INLINE qvec q_pair_f16(const uint16_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_cvtph_ps(_mm_set1_epi32(v));
}
#else
#define QGEMM_ISA 0
#endif

#endif
