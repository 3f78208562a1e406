/*
 * bench_prefill_attn.c - the attention of one prefill chunk at long
 * context: 512 queries (a chunk of `kvd generate --batch 512`) over the
 * keys already cached before them plus their own, on the SmolLM-135M shape
 * (9 query heads, 3 KV heads, head dim 64), f16 K/V in the cache's page
 * layout (pages of 16 tokens), llama's RoPE (keys stored unrotated).
 *
 * This is the work the flash tile does (attention/attn.c: many rows share
 * a KV head, so the keys of a tile are staged once, rotated and transposed,
 * and scored as a register-blocked product). Per row: one thread's CPU
 * time per chunk (best of several; on a machine shared with other work the
 * thread's CPU time says more about the kernel than the wall clock), the
 * same per layer of a 30-layer model, and GFLOP/s counting 4 operations per
 * head element and visible (query head, key) pair - the two products
 * Q.K^T and P.V, as flash-attention papers count them. The K/V of one layer
 * is reused call after call (hot: it fits the last-level cache at 4k, not
 * at 16k), so this measures compute, not the first touch of the cache.
 * The K/V memory is mapped like the KV pool's (cpu/mem.h: 2 MiB-aligned,
 * advised as huge pages; the header line says whether the kernel took the
 * advice): in 4 KiB pages every KV page of a tile would cost a TLB miss
 * that the served path does not pay.
 *
 * `bench_prefill_attn L` runs one context length only; `bench_prefill_attn
 * L profile` repeats that chunk for a profiler.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attention/attention.h"
#include "cpu/mem.h"
#include "tests/bench/bench_attn.h"
#include "tests/bench/bench_util.h"

#define H 9
#define KVH 3
#define D 64
#define PT 16
#define CHUNK 512

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_prefill_attn", n);
}

static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Whether the last K/V mapping was advised as huge pages and the kernel took it. */
static bool huge;

/* One chunk of CHUNK queries after L cached keys: best CPU and wall seconds of `trials`. */
static void time_chunk(int L, int threads, int trials, double *cpu, double *wall)
{
    const int n = L + CHUNK, pages = (n + PT - 1) / PT;
    const size_t blk = (size_t)KVH * PT * D * 2; /* one page's K (or V) block */
    const size_t bytes = 2 * blk * (size_t)pages;
    uint16_t *mem = cpu_map_huge(bytes, true, &huge);
    if (!mem) {
        perror("bench_prefill_attn: mapping the K/V");
        exit(1);
    }
    for (size_t i = 0; i < blk * (size_t)pages; i++) /* small halves of either sign */
        mem[i] = (uint16_t)(0x3000 + (i * 2654435761u >> 20) % 0x0800) | (uint16_t)((i & 1) << 15);
    int32_t *table = xalloc(sizeof(int32_t) * (size_t)pages);
    int32_t *pos = xalloc(sizeof(int32_t) * (size_t)n);
    int32_t *qpos = xalloc(sizeof(int32_t) * CHUNK);
    float *q = xalloc(sizeof(float) * CHUNK * H * D), *out = xalloc(sizeof(float) * CHUNK * H * D);
    for (int i = 0; i < pages; i++)
        table[i] = (int32_t)((i * 7) % pages); /* pages out of order, as a pool hands them out */
    for (int i = 0; i < n; i++)
        pos[i] = i;
    for (int i = 0; i < CHUNK; i++)
        qpos[i] = L + i;
    for (int i = 0; i < CHUNK * H * D; i++)
        q[i] = bench_rnd(&rng);
    struct attn_kv kv = {.base = (const uint8_t *)mem,
                         .page_bytes = 2 * blk,
                         .k_offset = 0,
                         .v_offset = blk,
                         .page_tokens = PT,
                         .k_type = ATTN_F16,
                         .v_type = ATTN_F16,
                         .n_pages = pages};
    struct attn_seq seq = {.page_table = table, .pos = pos, .n_kv = n, .n_q = CHUNK,
                           .q_pos = qpos, .q = q, .out = out};
    /* NeoX pairs, as this bench has always measured (the models pair adjacent elements) */
    attn_ctx *ctx =
        bench_attn_ctx("bench_prefill_attn", H, KVH, D, POS_ROPE, POS_ROPE_NEOX, threads);
    *cpu = *wall = 1e30;
    for (int t = 0; t < trials; t++) {
        double t0 = bench_now(), c0 = thread_cpu();
        if (attn_run(ctx, &kv, &seq, 1)) {
            fprintf(stderr, "bench_prefill_attn: attn_run: %s\n", attn_error(ctx));
            exit(1);
        }
        double dc = thread_cpu() - c0, dt = bench_now() - t0;
        *cpu = dc < *cpu ? dc : *cpu;
        *wall = dt < *wall ? dt : *wall;
    }
    attn_destroy(ctx);
    cpu_unmap(mem, bytes);
    free(table);
    free(pos);
    free(qpos);
    free(q);
    free(out);
}

int main(int argc, char **argv)
{
    int only = argc > 1 ? atoi(argv[1]) : 0;
    bool profile = argc > 2 && !strcmp(argv[2], "profile");
    static const int Ls[] = {4096, 16384};
    char load[64];
    bench_load_average(load, sizeof(load));
    printf("prefill attention: a chunk of %d queries after L cached keys, %d query heads, "
           "%d KV heads, head dim %d, f16 K/V, RoPE, %s path, load %s\n",
           CHUNK, H, KVH, D, attn_simd_name(), load);
    if (profile) {
        double cpu, wall;
        time_chunk(only ? only : 16384, 1, 20, &cpu, &wall);
        printf("profile: %.1f ms per chunk, K/V in %s pages\n", cpu * 1e3,
               huge ? "2 MiB" : "4 KiB");
        return 0;
    }
    printf("%-6s %3s %12s %14s %8s %6s\n", "L", "thr", "ms/chunk", "ms/30 layers", "GFLOP/s",
           "pages");
    for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]); li++) {
        int L = Ls[li];
        if (only && L != only)
            continue;
        for (int threads = 1; threads <= 2; threads++) {
            double cpu, wall;
            time_chunk(L, threads, L > 8192 ? 3 : 5, &cpu, &wall);
            /* one thread: its CPU time; two: the wall clock */
            double dt = threads == 1 ? cpu : wall;
            double pairs = (double)H * ((double)CHUNK * L + (double)CHUNK * (CHUNK + 1) / 2);
            printf("%-6d %3d %12.1f %14.0f %8.1f %6s\n", L, threads, dt * 1e3, dt * 30e3,
                   4.0 * D * pairs / dt / 1e9, huge ? "2M" : "4K");
            fflush(stdout);
        }
    }
    return 0;
}
