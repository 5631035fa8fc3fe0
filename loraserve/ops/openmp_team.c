/* The scheduling priority of the calling thread's OpenMP workers (the calling thread keeps
 * its own): a serving process's engine thread makes its team's workers yield to the threads
 * that answer clients (ops/openmp_team.py says why). */
#define _GNU_SOURCE
#include <omp.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Returns how many workers could not be set (0: all were). */
int openmp_workers_nice(int nthreads, int nice) {
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : failed)
    if (omp_get_thread_num() != 0)
        failed += setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice) != 0;
    return failed;
}

/* The nice value of the calling thread's worker `index` (1..nthreads-1), for tests. */
int openmp_worker_nice(int nthreads, int index) {
    int value = -100;
#pragma omp parallel num_threads(nthreads)
    if (omp_get_thread_num() == index) value = getpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid));
    return value;
}
