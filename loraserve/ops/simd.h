/* The SIMD vocabulary of loraserve's CPU kernels: one name per vector operation, spelled here
 * once per ISA (AVX-512, AVX2 + FMA, or GCC's generic vector extensions elsewhere), so that a
 * kernel says what it computes and this file alone says how each ISA does it.
 *
 *   f32x8     8 floats: one ymm register with AVX2 (generic builds: whatever GCC makes of it)
 *   f32x16    16 floats: one zmm register (AVX-512 builds only: elsewhere GCC splits 64-byte
 *             vectors piecewise, and no kernel uses them there)
 *
 *   _zero() _set1(x) _bcast(p)     all lanes 0, x, or *p (a broadcast load)
 *   _load(p) _store(p, v)          unaligned
 *   _store_first(p, n, v)          the first n lanes only (f32x16)
 *   _load_bf16(p)                  bfloat16s widened exactly (the upper half of a float32)
 *   _fma(a, b, c)                  a * b + c, rounded once on every ISA with FMA
 *   _madd(a, b, c)                 a * b + c as the compiler sees fit: fused under
 *                                  -ffp-contract=fast, except where the target's tuning keeps
 *                                  a lone accumulation chain unfused (gcc on AMD Zen: an add
 *                                  has the shorter latency), so results may differ by ISA
 *   _fnma(a, b, c)                 c - a * b, rounded once
 *   _add _sub _mul                 lane by lane
 *   f32x8_min f32x8_max            lane by lane (AVX2 builds)
 *   f32x8_round(x)                 to the nearest integer (ties to even), as floats
 *   f32x8_exp2i(n)                 2^n for integral n in the normal range
 *   f32x8_hmax(a)                  the largest of a's lanes (NaN lanes skipped; -inf if all)
 *
 *   PREFETCH(p, hint)              the one software prefetch: hint PF_L1 (into every level),
 *                                  PF_L2 (into L2 and below, not L1) or PF_NT (non-temporal:
 *                                  one level, evicted first); tuning.h says which each stream
 *                                  takes and why
 *
 * Every function is static inline and always inlined: the kernels call them inside loops whose
 * accumulators must stay in registers.
 */
#ifndef LORASERVE_SIMD_H
#define LORASERVE_SIMD_H

#include <math.h> /* INFINITY */
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define SIMD_INLINE static inline __attribute__((always_inline))

/* ---- prefetch ---------------------------------------------------------------------------- */

/* locality levels of __builtin_prefetch: x86 prefetcht0, prefetcht1, prefetchnta */
#define PF_L1 3
#define PF_L2 2
#define PF_NT 0
/* A macro: the hint must be a constant (the instruction encodes it), and a prefetch-only helper
 * function that gcc does not inline counts as `const` to it, so its calls are dropped whole. */
#define PREFETCH(p, hint) __builtin_prefetch((const void *)(p), 0, (hint))
#define LINE_FLOATS 16 /* floats per 64-byte cache line: one prefetch covers this many */

/* ---- f32x8 ------------------------------------------------------------------------------- */

typedef float f32x8 __attribute__((vector_size(32)));

SIMD_INLINE f32x8 f32x8_zero(void) { return (f32x8){0}; }
/* an initializer, not `(f32x8){0} + x`: that is a scalar add of zero and a register broadcast
 * (IEEE keeps the add: -0 + 0 is +0) on the FMA loops' ports */
SIMD_INLINE f32x8 f32x8_set1(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
SIMD_INLINE f32x8 f32x8_add(f32x8 a, f32x8 b) { return a + b; }
SIMD_INLINE f32x8 f32x8_sub(f32x8 a, f32x8 b) { return a - b; }
SIMD_INLINE f32x8 f32x8_mul(f32x8 a, f32x8 b) { return a * b; }
SIMD_INLINE f32x8 f32x8_madd(f32x8 a, f32x8 b, f32x8 c) { return c + a * b; }

SIMD_INLINE f32x8 f32x8_load_bf16(const uint16_t *p) {
    uint16_t h __attribute__((vector_size(16)));
    memcpy(&h, p, sizeof h);
    uint32_t u __attribute__((vector_size(32))) =
        __builtin_convertvector(h, uint32_t __attribute__((vector_size(32)))) << 16;
    f32x8 v;
    memcpy(&v, &u, sizeof v);
    return v;
}

#ifdef __AVX2__
/* the float loads and stores (vmovups): a memcpy compiles to the integer ones */
SIMD_INLINE f32x8 f32x8_load(const float *p) { return _mm256_loadu_ps(p); }
SIMD_INLINE void f32x8_store(float *p, f32x8 v) { _mm256_storeu_ps(p, v); }
SIMD_INLINE f32x8 f32x8_bcast(const float *p) { return _mm256_broadcast_ss(p); }
SIMD_INLINE f32x8 f32x8_min(f32x8 a, f32x8 b) { return _mm256_min_ps(a, b); }
SIMD_INLINE f32x8 f32x8_max(f32x8 a, f32x8 b) { return _mm256_max_ps(a, b); }
SIMD_INLINE f32x8 f32x8_round(f32x8 x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
SIMD_INLINE f32x8 f32x8_exp2i(f32x8 n) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#else /* generic: GCC's vector extensions (min, max, round, exp2i: AVX2 builds only) */
SIMD_INLINE f32x8 f32x8_load(const float *p) { f32x8 v; memcpy(&v, p, sizeof v); return v; }
SIMD_INLINE void f32x8_store(float *p, f32x8 v) { memcpy(p, &v, sizeof v); }
SIMD_INLINE f32x8 f32x8_bcast(const float *p) { return f32x8_set1(*p); }
#endif

SIMD_INLINE float f32x8_hmax(f32x8 a) {
    float lanes[8], mx = -INFINITY;
    f32x8_store(lanes, a);
    for (int j = 0; j < 8; j++) mx = lanes[j] > mx ? lanes[j] : mx;
    return mx;
}

#if defined(__AVX2__) && defined(__FMA__)
SIMD_INLINE f32x8 f32x8_fma(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fmadd_ps(a, b, c); }
SIMD_INLINE f32x8 f32x8_fnma(f32x8 a, f32x8 b, f32x8 c) { return _mm256_fnmadd_ps(a, b, c); }
#else /* an FMA where the target has one (-ffp-contract=fast) */
SIMD_INLINE f32x8 f32x8_fma(f32x8 a, f32x8 b, f32x8 c) { return c + a * b; }
SIMD_INLINE f32x8 f32x8_fnma(f32x8 a, f32x8 b, f32x8 c) { return c - a * b; }
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x <= 0 (scores minus their max, in the attention kernels): 2^n * poly(r),
 * r = x - n ln2, |r| <= ln2 / 2; relative error ~2e-7 */
SIMD_INLINE f32x8 f32x8_exp_nonpositive(f32x8 x) {
    x = f32x8_max(x, f32x8_set1(-87.0f)); /* below: 2^n would leave the normals */
    const f32x8 n = f32x8_round(f32x8_mul(x, f32x8_set1(1.44269504f)));
    f32x8 r = f32x8_fnma(n, f32x8_set1(0.693145752f), x);
    r = f32x8_fnma(n, f32x8_set1(1.42860677e-6f), r);
    f32x8 y = f32x8_set1(1.f / 5040);
    y = f32x8_fma(y, r, f32x8_set1(1.f / 720));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 120));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 24));
    y = f32x8_fma(y, r, f32x8_set1(1.f / 6));
    y = f32x8_fma(y, r, f32x8_set1(0.5f));
    y = f32x8_fma(y, r, f32x8_set1(1.f));
    y = f32x8_fma(y, r, f32x8_set1(1.f));
    return f32x8_mul(y, f32x8_exp2i(n));
}
#endif

/* ---- f32x16 (AVX-512) -------------------------------------------------------------------- */

#ifdef __AVX512F__
typedef float f32x16 __attribute__((vector_size(64)));

SIMD_INLINE f32x16 f32x16_zero(void) { return (f32x16){0}; }
SIMD_INLINE f32x16 f32x16_set1(float x) {
    return (f32x16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
SIMD_INLINE f32x16 f32x16_bcast(const float *p) { return f32x16_set1(*p); }
SIMD_INLINE f32x16 f32x16_load(const float *p) { return _mm512_loadu_ps(p); }
SIMD_INLINE void f32x16_store(float *p, f32x16 v) { _mm512_storeu_ps(p, v); }
SIMD_INLINE void f32x16_store_first(float *p, int64_t n, f32x16 v) {
    _mm512_mask_storeu_ps(p, n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1), v);
}
SIMD_INLINE f32x16 f32x16_fma(f32x16 a, f32x16 b, f32x16 c) { return _mm512_fmadd_ps(a, b, c); }
SIMD_INLINE f32x16 f32x16_madd(f32x16 a, f32x16 b, f32x16 c) { return c + a * b; }
SIMD_INLINE f32x16 f32x16_load_bf16(const uint16_t *p) {
    uint16_t h __attribute__((vector_size(32)));
    memcpy(&h, p, sizeof h);
    uint32_t u __attribute__((vector_size(64))) =
        __builtin_convertvector(h, uint32_t __attribute__((vector_size(64)))) << 16;
    f32x16 v;
    memcpy(&v, &u, sizeof v);
    return v;
}
#endif

#endif
