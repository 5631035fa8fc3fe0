/* Fused element-wise steps of a decoder layer on CPU, float32, one pass over memory each:
 *
 *   add_rms_norm: h += alpha * r (in place), then out = h * rsqrt(mean(h^2) + eps) * w
 *   rms_norm:     out = x * rsqrt(mean(x^2) + eps) * w
 *   silu_mul:     out = silu(gate) * up, gate and up the two halves of a fused gate_up row
 *   rope:         rotate q and k in place (rotate-half layout) from cos/sin tables by position
 *
 * Why: torch runs each of these as 3-6 separate kernels (rms_norm alone is pow, mean, add,
 * rsqrt, mul, mul), each a pass over [T, d] and a dispatch from Python: a visible share of a
 * long prefill step beside the GEMMs (docs/cpu-kernels.md). Rows are split over OpenMP threads
 * when there is enough work (ON_ONE_THREAD). Rows have unit stride within; row strides are
 * arguments, so views of the fused qkv / gate_up outputs are read in place.
 * Built with -ffp-contract=off: the adds and products round as torch's do (rope and the
 * residual add give torch's bits; the norm's sum and silu's exp differ in the last bit).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"
#include "tuning.h"

/* Work of fewer elements runs on the calling thread, outside any parallel region: an
 * `omp parallel if (false)` still sets up a team of one, and inside the native decode loop's
 * team (a nested region) that cost more than a batch-1 row's norm itself. */
#define ON_ONE_THREAD(elems) ((elems) < ELEMWISE_PARALLEL_MIN)

static inline float row_rstd(const float *x, int64_t d, float eps) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += x[i + j] * x[i + j];
    float s = 0.f;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < d; i++) s += x[i] * x[i];
    return 1.f / sqrtf(s / (float)d + eps);
}

static inline void rms_norm_row(const float *xr, const float *w, float *o, int64_t d,
                                float eps) {
    const float r = row_rstd(xr, d, eps);
    for (int64_t i = 0; i < d; i++) o[i] = xr[i] * r * w[i];
}

void rms_norm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t T,
              int64_t d, float eps, int nthreads) {
    if (ON_ONE_THREAD(T * d)) {
        for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * ldx, w, out + t * ldo, d, eps);
        return;
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t t = 0; t < T; t++) rms_norm_row(x + t * ldx, w, out + t * ldo, d, eps);
}

static inline void add_rms_norm_row(float *hr, const float *rr, float alpha, const float *w,
                                    float *o, int64_t d, float eps) {
    if (alpha == 1.f)
        for (int64_t i = 0; i < d; i++) hr[i] = hr[i] + rr[i];
    else
        for (int64_t i = 0; i < d; i++) hr[i] = hr[i] + alpha * rr[i];
    if (w) rms_norm_row(hr, w, o, d, eps);
}

/* w may be NULL: h is updated and nothing else is written. */
void add_rms_norm(float *h, int64_t ldh, const float *r, int64_t ldr, float alpha,
                  const float *w, float *out, int64_t ldo, int64_t T, int64_t d, float eps,
                  int nthreads) {
    if (ON_ONE_THREAD(T * d)) {
        for (int64_t t = 0; t < T; t++)
            add_rms_norm_row(h + t * ldh, r + t * ldr, alpha, w, out + t * ldo, d, eps);
        return;
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t t = 0; t < T; t++)
        add_rms_norm_row(h + t * ldh, r + t * ldr, alpha, w, out + t * ldo, d, eps);
}

/* exp(r) for |r| <= ln2/2: degree-7 Taylor (Horner), for a float or a vector of floats. */
#define EXP_POLY(r) ((((((((r) * (1.f / 5040) + 1.f / 720) * (r) + 1.f / 120) * (r) + 1.f / 24) \
                        * (r) + 1.f / 6) * (r) + 0.5f) * (r) + 1.f) * (r) + 1.f)

/* exp(x) for any float x: 2^n * EXP_POLY(r), r = x - n ln2 (relative error ~2e-7). */
static inline float exp_approx(float x) {
    x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    const float p = EXP_POLY(r);
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

#ifdef __AVX2__
#define HAVE_EXP8 1
/* exp_approx on 8 lanes (same polynomial; n rounded by the 1.5 * 2^23 trick). gcc does not
 * vectorize the scalar loop below by itself: the clamps are branches it will not if-convert
 * under trapping math, and the scalar loop was several times slower than torch's silu + mul.
 * Plain operators, not f32x8_fma: built with -ffp-contract=off, each step rounds as written. */
typedef int32_t v8i __attribute__((vector_size(32)));

static inline f32x8 exp8(f32x8 x) {
    x = f32x8_min(f32x8_max(x, f32x8_set1(-87.f)), f32x8_set1(88.f));
    const f32x8 n = (x * 1.44269504f + 12582912.f) - 12582912.f;
    const f32x8 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    return EXP_POLY(r) * (f32x8)((__builtin_convertvector(n, v8i) + 127) << 23);
}
#endif

static inline void silu_mul_row(const float *g, float *o, int64_t inter) {
    const float *u = g + inter;
    int64_t i = 0;
#ifdef HAVE_EXP8
    for (; i + 8 <= inter; i += 8) {
        const f32x8 gv = f32x8_load(g + i), uv = f32x8_load(u + i);
        f32x8_store(o + i, gv / (1.f + exp8(-gv)) * uv);
    }
#endif
    for (; i < inter; i++) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
}

void silu_mul(const float *gu, int64_t ldg, float *out, int64_t ldo, int64_t T, int64_t inter,
              int nthreads) {
    if (ON_ONE_THREAD(T * inter)) {
        for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * ldg, out + t * ldo, inter);
        return;
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * ldg, out + t * ldo, inter);
}

/* one token's heads, rotated by the table rows c and s of its position */
static inline void rope_row(float *x, int64_t heads, int64_t hd, const float *c,
                            const float *s) {
    const int64_t half = hd / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *a = x + h * hd, *b = a + half;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] + (-x2) * s[i];
            b[i] = x2 * c[half + i] + x1 * s[half + i];
        }
    }
}

/* x: [T, heads, hd] at row stride ldx (heads adjacent, hd unit stride); cos/sin: [P, hd]. */
void rope(float *x, int64_t ldx, int64_t T, int64_t heads, int64_t hd, const int64_t *positions,
          const float *cos_t, const float *sin_t, int nthreads) {
#define ROPE_ROW(t) rope_row(x + (t) * ldx, heads, hd, cos_t + positions[t] * hd, \
                             sin_t + positions[t] * hd)
    if (ON_ONE_THREAD(T * heads * hd)) {
        for (int64_t t = 0; t < T; t++) ROPE_ROW(t);
        return;
    }
#pragma omp parallel for num_threads(nthreads)
    for (int64_t t = 0; t < T; t++) ROPE_ROW(t);
#undef ROPE_ROW
}
