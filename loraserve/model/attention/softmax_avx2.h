/* The exponentials of a softmax row, shared by the attention kernels' vector paths
 * (paged_attend_avx2.h, prefill_attention.c): p[t] <- exp(p[t] - mx) for t < n, 8 at a time
 * with the vector polynomial and the tail with expf, and their sum, lanes summed in order.
 * AVX2 + FMA builds only.
 */
#ifndef LORASERVE_SOFTMAX_AVX2_H
#define LORASERVE_SOFTMAX_AVX2_H

#include <math.h>
#include <stdint.h>

#include "../../ops/simd.h"

static inline float exp_shifted_sum(float *p, int64_t n, float mx) {
    const f32x8 vmx = f32x8_set1(mx);
    f32x8 vsum = f32x8_zero();
    int64_t t = 0;
    for (; t + 8 <= n; t += 8) {
        const f32x8 e = f32x8_exp_nonpositive(f32x8_sub(f32x8_load(p + t), vmx));
        f32x8_store(p + t, e);
        vsum = f32x8_add(vsum, e);
    }
    float s8[8], sum = 0.f;
    f32x8_store(s8, vsum);
    for (int j = 0; j < 8; j++) sum += s8[j];
    for (; t < n; t++) sum += (p[t] = expf(p[t] - mx));
    return sum;
}

#endif
