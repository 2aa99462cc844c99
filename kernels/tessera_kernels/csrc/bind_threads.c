/* Pin each thread of the calling thread's OpenMP team to one CPU: thread i to cpus[i].
 *
 * Every kernel here splits its work evenly over the team and ends at a barrier, so a step is
 * as fast as its slowest thread. Unpinned, libgomp's threads spin at those barriers as
 * runnable tasks: with one other busy process on 2 cores the scheduler keeps moving the three
 * of them around, and each of a step's ~360 barriers waits for a thread that is off its CPU,
 * so a decode step takes many times as long. Pinned, the other process shares one thread's
 * CPU and the step slows by about that share, as vLLM-CPU's pinned threads do.
 *
 * All or nothing: if a thread cannot be pinned (a CPU gone from the cpuset, a smaller team than
 * asked for), every thread gets its former CPUs back. Returns how many threads were pinned. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <omp.h>
#include <sched.h>
#include <stdlib.h>

int bind_team(const int *cpus, int n) {
    cpu_set_t *before = calloc((size_t)n, sizeof(cpu_set_t));
    if (before == NULL) return 0;
    int pinned = 0, team = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned, team)
    {
        int t = omp_get_thread_num();
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t], &set);
        team += 1;
        pinned += sched_getaffinity(0, sizeof before[t], &before[t]) == 0 &&
                  sched_setaffinity(0, sizeof set, &set) == 0;
    }
    if (pinned != n || team != n) {
#pragma omp parallel num_threads(n)
        {
            int t = omp_get_thread_num();
            if (CPU_COUNT(&before[t]) > 0) sched_setaffinity(0, sizeof before[t], &before[t]);
        }
        pinned = 0;
    }
    free(before);
    return pinned;
}
