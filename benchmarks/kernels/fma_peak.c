/* The float32 FMA peak of this build's widest vectors: twelve independent FMA chains on
 * registers (no memory), per thread, over `nthreads` threads; returns GFLOP/s. The floor a
 * GEMM's rate is read against, measured in the same run as the GEMM (ab_gemm.py). Inline asm,
 * so that the compiler neither folds the chains nor spills them. */
#include <stdint.h>
#include <omp.h>

#if defined(__AVX512F__)
#define LANES 16
#define FMA12                                                                          \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm0\n vfmadd231ps %%zmm14, %%zmm15, %%zmm1\n"    \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm2\n vfmadd231ps %%zmm14, %%zmm15, %%zmm3\n"    \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm4\n vfmadd231ps %%zmm14, %%zmm15, %%zmm5\n"    \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm6\n vfmadd231ps %%zmm14, %%zmm15, %%zmm7\n"    \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm8\n vfmadd231ps %%zmm14, %%zmm15, %%zmm9\n"    \
    "vfmadd231ps %%zmm14, %%zmm15, %%zmm10\n vfmadd231ps %%zmm14, %%zmm15, %%zmm11\n"
#elif defined(__FMA__)
#define LANES 8
#define FMA12                                                                          \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm0\n vfmadd231ps %%ymm14, %%ymm15, %%ymm1\n"    \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm2\n vfmadd231ps %%ymm14, %%ymm15, %%ymm3\n"    \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm4\n vfmadd231ps %%ymm14, %%ymm15, %%ymm5\n"    \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm6\n vfmadd231ps %%ymm14, %%ymm15, %%ymm7\n"    \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm8\n vfmadd231ps %%ymm14, %%ymm15, %%ymm9\n"    \
    "vfmadd231ps %%ymm14, %%ymm15, %%ymm10\n vfmadd231ps %%ymm14, %%ymm15, %%ymm11\n"
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
