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
#include <string.h>
#include <time.h>

#include "cpu/mem.h"

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

/*
 * A read-only stream: `threads` threads each sum their share of one buffer
 * of `bytes` (it must outsize the last-level cache) as BENCH_READ_STREAMS
 * sequential streams at once, each asking for its lines BENCH_READ_AHEAD
 * bytes ahead (prefetcht0); the best of `sweeps`. Returns GB/s of bytes
 * read, or 0 if the buffer cannot be allocated.
 *
 * Why beside the triad: decoding only reads, and the triad's four arrays
 * are not what a read stream gets on every machine. On an AMX Xeon (2
 * cores, 1 GiB read) a core's read streams reached 12.5 GB/s as one stream,
 * 15 GB/s as 2 to 8 streams with 2 KiB of prefetch, where the triad's bus
 * figure was 19.5 GB/s per core: a core's misses in flight cap a read,
 * and the triad keeps more in flight (three read streams and a write).
 * So there a read-only kernel reaches at most ~0.79 of the triad's bus.
 */
#define BENCH_READ_STREAMS 8
#define BENCH_READ_AHEAD 2048
typedef float bench_v16 __attribute__((vector_size(64)));

static inline float bench_read_share(const char *p, size_t len)
{
    const size_t per = len / BENCH_READ_STREAMS / 64 * 64;
    bench_v16 acc[BENCH_READ_STREAMS] = {{0}};
    for (size_t i = 0; i < per; i += 64)
        for (int j = 0; j < BENCH_READ_STREAMS; j++) {
            const char *q = p + (size_t)j * per + i;
            __builtin_prefetch(q + BENCH_READ_AHEAD, 0, 3);
            acc[j] += *(const bench_v16 *)q;
        }
    float sum = 0.0f;
    for (int j = 0; j < BENCH_READ_STREAMS; j++)
        for (int l = 0; l < 16; l++)
            sum += acc[j][l];
    return sum;
}

static inline double bench_read(int threads, size_t bytes, int sweeps)
{
    const size_t share = bytes / (size_t)threads / 64 * 64;
    /* room past the end for the last stream's prefetches */
    char *p = aligned_alloc(64, share * (size_t)threads + BENCH_READ_AHEAD);
    if (!p)
        return 0.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < threads; t++) /* each share first touched by its reader */
        memset(p + (size_t)t * share, 0x3c, share);
    memset(p + share * (size_t)threads, 0, BENCH_READ_AHEAD);
    double best = 1e30;
    volatile float sink = 0.0f;
    for (int s = 0; s < sweeps; s++) {
        double t0 = bench_now();
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : sink)
        for (int t = 0; t < threads; t++)
            sink += bench_read_share(p + (size_t)t * share, share);
        double dt = bench_now() - t0;
        best = dt < best ? dt : best;
    }
    free(p);
    return (double)share * (double)threads / best / 1e9;
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

/* n bytes for a repacked weight copy, mapped as the model maps its copy
 * (cpu/mem.h: 2 MiB pages advised unless KVD_HUGE_PAGES=off), so that a
 * product measured here meets the TLB the model's does. Free with
 * cpu_unmap(p, n). */
static inline void *bench_map_weights(const char *bench, size_t n)
{
    struct cpu_pages got;
    void *p = cpu_map_pages(n, false, &got);
    if (!p) {
        fprintf(stderr, "%s: cannot map %zu bytes\n", bench, n);
        exit(1);
    }
    return p;
}

#endif /* KVD_BENCH_UTIL_H */
