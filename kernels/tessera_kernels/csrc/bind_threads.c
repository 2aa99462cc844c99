/* Pin each thread of the calling thread's OpenMP team to one CPU: thread i to cpus[i].
 *
 * Every kernel here splits its work evenly over the team and ends at a barrier, so a step is
 * as fast as its slowest thread. Unpinned, libgomp's threads spin at those barriers as
 * runnable tasks: with one other busy process on 2 cores the scheduler keeps moving the three
 * of them around, and each of a step's ~360 barriers waits for a thread that is off its CPU
 * (measured, AMD EPYC Zen 4: one-stream TPOT 12.8 -> 388-724 ms next to a busy loop; pinned,
 * 30-34 ms). Pinned, the other process shares one thread's CPU and the step slows by about
 * that share, as vLLM-CPU's pinned threads do. Returns how many threads were pinned. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <omp.h>
#include <sched.h>

int bind_team(const int *cpus, int n) {
    int pinned = 0;
#pragma omp parallel num_threads(n) reduction(+ : pinned)
    {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[omp_get_thread_num()], &set);
        pinned += sched_setaffinity(0, sizeof set, &set) == 0;
    }
    return pinned;
}
