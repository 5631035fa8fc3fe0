/* The round trip of an OpenMP barrier between the threads of one team, in nanoseconds: what
 * benchmarks/placement.py tells the cores' placement by (two cores on one die of the package
 * meet in about a quarter of a microsecond, on two dies in about half). */
#include <omp.h>

double barrier_ns(int barriers, int nthreads) {
    double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp barrier
#pragma omp master
        t0 = omp_get_wtime();
        for (int i = 0; i < barriers; i++) {
#pragma omp barrier
        }
#pragma omp master
        t1 = omp_get_wtime();
    }
    return (t1 - t0) / barriers * 1e9;
}
