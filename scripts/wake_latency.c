/* How long a thread asleep on a futex takes to run once woken, after the waker has been busy
 * for a while (a step's Python part, while an OpenMP worker would sleep): what a kernel
 * thread pool that parks between a step's C calls would pay per wake, unless it is woken that
 * long ahead. docs/benchmarks.md ("Fewer writes a stream, weights on 2 MB pages") has the
 * figures. Linux.
 *
 *     gcc -O2 -o /tmp/wake_latency scripts/wake_latency.c -lpthread
 *     for gap in 100 300 1000 5000; do /tmp/wake_latency $gap; done
 */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WAKES 400

static _Atomic uint32_t word;
static _Atomic int64_t woke_ns;

static int64_t now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void *sleeper(void *arg)
{
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        while (atomic_load(&word) == seen)
            syscall(SYS_futex, &word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
        seen = atomic_load(&word);
        atomic_store(&woke_ns, now_ns());
    }
    return NULL;
}

static int by_value(const void *a, const void *b)
{
    const int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    const int64_t gap_us = argc > 1 ? atoll(argv[1]) : 300;
    int64_t latency[WAKES];
    pthread_t thread;
    pthread_create(&thread, NULL, sleeper, NULL);
    usleep(10000);
    for (int i = 0; i < WAKES; i++) {
        const int64_t until = now_ns() + gap_us * 1000;
        while (now_ns() < until) /* busy, as the step's Python is; the sleeper's core idles */
            ;
        atomic_store(&woke_ns, 0);
        const int64_t t0 = now_ns();
        atomic_fetch_add(&word, 1);
        syscall(SYS_futex, &word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
        while (atomic_load(&woke_ns) == 0)
            ;
        latency[i] = atomic_load(&woke_ns) - t0;
    }
    qsort(latency, WAKES, sizeof latency[0], by_value);
    printf("after %lld us busy: wake to running p50 %.1f us, p90 %.1f, p99 %.1f\n",
           (long long)gap_us, latency[WAKES / 2] / 1e3, latency[WAKES * 9 / 10] / 1e3,
           latency[WAKES * 99 / 100] / 1e3);
    return 0;
}
