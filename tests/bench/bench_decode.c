/*
 * bench_decode.c - where one decode step's attention time goes at long
 * context on the SmolLM-135M shape (9 query heads, 3 KV heads, head dim
 * 64, 30 layers), as a fraction of the memory roofline.
 *
 * The K/V pool has the cache's own layout (cache/kv_cache.h): a page holds
 * page_tokens tokens of every layer's K and V, so one layer's K rows of a
 * page are a run of 3 heads x page_tokens x 128 bytes, and the next page's
 * run is 30 layers' worth of bytes further on. Each call reads the next
 * layer, as a model's step does, so K/V come from DRAM. Per row: time
 * per call (one layer), K/V bytes read per second, and that over the bus
 * bandwidth of a triad run just before with as many threads (bench_util.h;
 * four arrays cross the bus, the figure a read-only stream can reach). With
 * one thread the time is the thread's CPU time, which a machine shared with
 * other work disturbs far less than the wall clock; with two it is the wall
 * clock (on a loaded machine the team waits for its descheduled member, so
 * those rows say more about the load than the kernel). At 4k, "hot cpu us"
 * is the same call on one layer again and again (K/V in the caches): the
 * kernel's compute alone.
 *
 * Rows: RoPE (llama's keys are rotated as they are read) and no position
 * term (the bytes alone), 1 and 2 threads, pages of 16 (the default) and
 * 64 tokens, at 4k, 16k and 32k cached tokens. The whole run takes about a
 * minute. `bench_decode L` runs one context length only; `bench_decode L
 * profile` runs the hot RoPE call at L for a profiler.
 */
#include <math.h>
#include <stdbool.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "tests/bench/bench_util.h"

#define H 9
#define KVH 3
#define D 64
#define LAYERS 30
#define MAX_L 32768

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float rnd(void) /* [-1, 1) */
{
    return bench_rnd(&rng);
}

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_decode", n);
}

/* One layer's K (or V) in a page of pt tokens: f16. */
static size_t block_bytes(int pt)
{
    return (size_t)KVH * (size_t)pt * D * 2;
}

static struct attn_kv kv_view(const uint8_t *mem, int L, int pt, int layer)
{
    size_t blk = block_bytes(pt);
    return (struct attn_kv){.base = mem,
                            .page_bytes = LAYERS * 2 * blk,
                            .k_offset = (size_t)layer * 2 * blk,
                            .v_offset = (size_t)layer * 2 * blk + blk,
                            .page_tokens = pt,
                            .k_type = ATTN_F16,
                            .v_type = ATTN_F16,
                            .n_pages = L / pt};
}

static attn_ctx *ctx_for(enum pos_kind kind, int threads)
{
    struct attn_params p = {.n_head = H,
                            .n_kv_head = KVH,
                            .head_dim = D,
                            .scale = 0.125f,
                            .n_threads = threads};
    p.pos.kind = kind;
    if (kind == POS_ROPE) {
        p.pos.rope_theta = 10000.0f;
        p.pos.rope_dims = D;
        p.pos.rope_pairing = POS_ROPE_NEOX;
        p.pos.rope_freq_scale = 1.0f;
    }
    char err[256];
    attn_ctx *c = attn_create(&p, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "bench_decode: attn_create: %s\n", err);
        exit(1);
    }
    return c;
}

/* CPU seconds of the calling thread (the whole team when it runs alone). */
static double thread_cpu(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/*
 * Best seconds per call (one layer each, cycling; hot: layer 0 each time)
 * of `trials` x LAYERS calls; *cpu gets the calling thread's best CPU
 * seconds per call, which on a machine shared with other work measures a
 * one-thread run better than the wall clock does.
 */
static double time_decode(attn_ctx *ctx, const uint8_t *mem, int L, int pt, int trials, bool hot,
                          double *cpu)
{
    int32_t *table = xalloc(sizeof(int32_t) * (size_t)(L / pt));
    int32_t *pos = xalloc(sizeof(int32_t) * (size_t)L);
    float *q = xalloc(sizeof(float) * H * D), *out = xalloc(sizeof(float) * H * D);
    for (int i = 0; i < L / pt; i++)
        table[i] = i;
    for (int i = 0; i < L; i++)
        pos[i] = i;
    for (int i = 0; i < H * D; i++)
        q[i] = rnd();
    int32_t qpos = L - 1;
    struct attn_seq seq = {.page_table = table, .pos = pos, .n_kv = L, .n_q = 1,
                           .q_pos = &qpos, .q = q, .out = out};
    double best = 1e30;
    *cpu = 1e30;
    for (int t = 0; t < trials; t++) {
        double t0 = bench_now(), c0 = thread_cpu();
        for (int l = 0; l < LAYERS; l++) {
            struct attn_kv kv = kv_view(mem, L, pt, hot ? 0 : l);
            if (attn_run(ctx, &kv, &seq, 1)) {
                fprintf(stderr, "bench_decode: attn_run: %s\n", attn_error(ctx));
                exit(1);
            }
        }
        double dt = (bench_now() - t0) / LAYERS, dc = (thread_cpu() - c0) / LAYERS;
        best = dt < best ? dt : best;
        *cpu = dc < *cpu ? dc : *cpu;
    }
    free(table);
    free(pos);
    free(q);
    free(out);
    return best;
}

int main(int argc, char **argv)
{
    int only = argc > 1 ? atoi(argv[1]) : 0;
    static const int Ls[] = {4096, 16384, 32768};
    static const int pts[] = {16, 64};
    double load = -1;
    FILE *la = fopen("/proc/loadavg", "r");
    if (la) {
        if (fscanf(la, "%lf", &load) != 1)
            load = -1;
        fclose(la);
    }
    printf("decode attention: %d query heads, %d KV heads, head dim %d, %d layers, f16 K/V, "
           "%s path, load %.1f\n",
           H, KVH, D, LAYERS, attn_simd_name(), load);
    /* the pool: MAX_L tokens of every layer, written so every page is resident */
    size_t bytes = (size_t)MAX_L * LAYERS * 2 * KVH * D * 2;
    uint16_t *mem = xalloc(bytes);
    for (size_t i = 0; i < bytes / 2; i++)
        mem[i] = (uint16_t)(0x3000 + (i * 2654435761u >> 20) % 0x0800); /* small halves */
    if (argc > 2 && !strcmp(argv[2], "profile")) { /* for perf: one hot RoPE row, long */
        attn_ctx *ctx = ctx_for(POS_ROPE, 1);
        double cpu;
        time_decode(ctx, (const uint8_t *)mem, only ? only : 4096, 16, 400, true, &cpu);
        printf("profile: %.1f us per call\n", cpu * 1e6);
        attn_destroy(ctx);
        free(mem);
        return 0;
    }
    printf("%-6s %5s %4s %3s %10s %8s %8s %6s %10s\n", "L", "pos", "page", "thr", "us/layer",
           "KV GB/s", "bus GB/s", "roof", "hot cpu us");
    for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]); li++) {
        int L = Ls[li];
        if (only && L != only)
            continue;
        for (int pi = 0; pi < 2; pi++)
            for (int threads = 1; threads <= 2; threads++)
                for (int kind = 0; kind < 2; kind++) {
                    enum pos_kind pk = kind ? POS_NONE : POS_ROPE;
                    attn_ctx *ctx = ctx_for(pk, threads);
                    double bus = 0;
                    bench_triad(threads, (size_t)32 << 20, (size_t)32 << 20, 3, &bus);
                    double cpu, hot_cpu = 0;
                    double dt = time_decode(ctx, (const uint8_t *)mem, L, pts[pi], 5, false, &cpu);
                    if (threads == 1)
                        dt = cpu; /* alone on its thread: its CPU time */
                    if (L <= 4096)
                        time_decode(ctx, (const uint8_t *)mem, L, pts[pi], 5, true, &hot_cpu);
                    double kv = (double)L * KVH * D * 2 * 2; /* K and V bytes of one layer */
                    printf("%-6d %5s %4d %3d %10.1f %8.2f %8.2f %5.0f%% %10.1f\n", L,
                           pk == POS_ROPE ? "rope" : "none", pts[pi], threads, dt * 1e6,
                           kv / dt / 1e9, bus, 100.0 * kv / dt / 1e9 / bus,
                           threads == 1 ? hot_cpu * 1e6 : 0.0);
                    fflush(stdout);
                    attn_destroy(ctx);
                }
    }
    free(mem);
    return 0;
}
