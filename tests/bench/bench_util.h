/*
 * bench_util.h - what every benchmark measures the same way: time, and the
 * machine's memory bandwidth as a STREAM-like triad run in the same process,
 * so "fraction of bandwidth" figures from different benchmarks compare.
 */
#ifndef KVD_BENCH_UTIL_H
#define KVD_BENCH_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static inline double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/*
 * Triad a = b + s * c over three arrays of n floats (they must outsize the
 * last-level cache), `threads` threads, timed in pieces of `piece` floats
 * (piece = n times whole sweeps; smaller pieces match kernels that stream a
 * few MiB per call), best piece of `sweeps` sweeps.
 *
 * Returns STREAM's figure in GB/s, which counts three arrays. The memory
 * bus also reads the stored array before writing it (write-allocate), so
 * it moves four: *bus_gbs (if non-NULL) gets that figure, the ceiling for
 * a read-only stream such as decoding. Returns 0 if the arrays cannot be
 * allocated.
 */
static inline double bench_triad(int threads, size_t n, size_t piece, int sweeps, double *bus_gbs)
{
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float)),
          *c = malloc(n * sizeof(float));
    double best = 1e30;
    if (!a || !b || !c)
        goto out;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (size_t i = 0; i < n; i++) {
        a[i] = 0.0f;
        b[i] = 1.0f;
        c[i] = 2.0f;
    }
    for (int sweep = 0; sweep < sweeps; sweep++) {
        const float s = 3.0f + (float)sweep;
        for (size_t p0 = 0; p0 + piece <= n; p0 += piece) {
            double t0 = bench_now();
#pragma omp parallel for num_threads(threads) schedule(static)
            for (size_t i = p0; i < p0 + piece; i++)
                a[i] = b[i] + s * c[i];
            double dt = bench_now() - t0;
            best = dt < best ? dt : best;
        }
    }
    volatile float sink = a[n / 2];
    (void)sink;
out:
    free(a);
    free(b);
    free(c);
    if (best == 1e30)
        return 0.0;
    if (bus_gbs)
        *bus_gbs = 4.0 * sizeof(float) * (double)piece / best / 1e9;
    return 3.0 * sizeof(float) * (double)piece / best / 1e9;
}

/* The load average as /proc/loadavg gives it ("1.20 0.95 0.80"), or "?":
 * printed beside figures taken on a shared machine. */
static inline void bench_load_average(char *buf, size_t len)
{
    snprintf(buf, len, "?");
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f)
        return;
    double a, b, c;
    if (fscanf(f, "%lf %lf %lf", &a, &b, &c) == 3)
        snprintf(buf, len, "%.2f %.2f %.2f", a, b, c);
    fclose(f);
}

/* The calling thread's CPU time in seconds: on a machine shared with other
 * work it counts only the cycles this thread ran, unlike the wall clock. */
static inline double bench_thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A pseudo-random float in [-1, 1) from *state (an LCG: fixed data, not
 * statistics). */
static inline float bench_rnd(uint64_t *state)
{
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(*state >> 11) * 0x1p-52 - 1.0);
}

/* 64-byte aligned memory, or exit naming the benchmark. */
static inline void *bench_xalloc(const char *bench, size_t n)
{
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "%s: out of memory allocating %zu bytes\n", bench, n);
        exit(1);
    }
    return p;
}

#endif /* KVD_BENCH_UTIL_H */
