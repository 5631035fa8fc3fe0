/* The float32 FMA peak of this build's widest vectors: twelve independent FMA chains on
 * registers (no memory), per thread, over `nthreads` threads; returns GFLOP/s. The floor a
 * GEMM's rate is read against, measured in the same run as the GEMM (ab_gemm.py). Inline asm,
 * so that the compiler neither folds the chains nor spills them. */
#include <stdint.h>
#include <omp.h>

/* twelve FMAs into registers 0..11 of the prefix R's width ("z": zmm, "y": ymm) */
#define FMA(R, n) "vfmadd231ps %%" R "mm14, %%" R "mm15, %%" R "mm" #n "\n"
#define FMA12_OF(R)                                                                    \
    FMA(R, 0) FMA(R, 1) FMA(R, 2) FMA(R, 3) FMA(R, 4) FMA(R, 5) FMA(R, 6) FMA(R, 7)   \
    FMA(R, 8) FMA(R, 9) FMA(R, 10) FMA(R, 11)
#if defined(__AVX512F__)
#define LANES 16
#define FMA12 FMA12_OF("z")
#elif defined(__FMA__)
#define LANES 8
#define FMA12 FMA12_OF("y")
#endif

double fma_peak_gflops(int64_t iterations, int nthreads) {
#ifdef FMA12
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nthreads)
    {
        int64_t n = iterations;
        __asm__ volatile("1:\n" FMA12 "dec %0\n jnz 1b\n"
                         : "+r"(n)
                         :
                         : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",
                           "xmm8", "xmm9", "xmm10", "xmm11", "cc");
    }
    return nthreads * (double)iterations * 12 * LANES * 2 / (omp_get_wtime() - t0) / 1e9;
#else
    (void)iterations;
    (void)nthreads;
    return 0.0;
#endif
}
