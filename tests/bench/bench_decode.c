/*
 * bench_decode.c - where one decode step's attention time goes at long
 * context on the SmolLM-135M shape (9 query heads, 3 KV heads, head dim
 * 64, 30 layers), as a fraction of the memory roofline.
 *
 * The K/V live in a real cache (cache/kv_cache.h): the pool kv_cache_create
 * maps (2 MiB pages advised), one sequence appended L tokens through
 * kv_seq_append, every layer's K and V rows written through kv_seq_k /
 * kv_seq_v, and the attention reads them through the sequence's own page
 * table, as the forward pass does. So one layer's K rows of a page are a
 * run of 3 heads x page_tokens rows, and the next page's run is 30 layers'
 * worth of bytes further on. The values are random (small halves; q8_0
 * blocks with a fixed scale): the time does not depend on them.
 *
 * Each call reads the next layer, as a model's step does, so K/V come from
 * DRAM. Per row: time per call (one layer), K/V bytes read per second, and
 * that over the bus bandwidth of a triad run just before with as many
 * threads (bench_util.h; four arrays cross the bus: "roof", the issue's
 * roofline), and over what a read-only stream of as many threads reached
 * just before ("read", bench_read: on some machines a read gets less of
 * the bus than the triad moves, and decoding only reads). With one thread
 * the time is the thread's CPU time, which a machine shared with other
 * work disturbs far less than the wall clock; with two it is the wall
 * clock (on a loaded machine the team waits for its descheduled member, so
 * those rows say more about the load than the kernel). At 4k, "hot cpu us"
 * is the same call on one layer again and again (K/V in the caches): the
 * kernel's compute alone.
 *
 * Rows: RoPE with llama's adjacent pairs (each key de-interleaved and
 * rotated as it is read, as the bench models decode), f16 and q8_0 K/V,
 * 1 and 2 threads, pages of 16 tokens (the default), at 4k, 16k and 32k
 * cached tokens. `bench_decode L` runs one context length only (any L up
 * to 131072: 64k and 128k need 1.5 and 3 GiB of f16 pool); `bench_decode L
 * profile` runs the hot f16 call at L for a profiler; `cold` after it
 * runs the 2-thread call that reads the next layer each time, `q8_0` the
 * call over q8_0 K/V, `alibi` the call with ALiBi (max_bias 8) instead of
 * RoPE: no rotation, and q8_0 keys scored in integers (attn_q8.c).
 */
#include <math.h>
#include <omp.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "cache/kv_cache.h"
#include "tests/bench/bench_attn.h"
#include "tests/bench/bench_util.h"

#define H 9
#define KVH 3
#define D 64
#define LAYERS 30
#define PT 16
#define MAX_L 131072
#define TRIAD_FLOATS ((size_t)32 << 20) /* per array of the triad beside the rows */

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void die(const char *what, const char *why)
{
    fprintf(stderr, "bench_decode: %s: %s\n", what, why);
    exit(1);
}

/* One row of K or V: random small halves, or q8_0 blocks (scale 2^-7). */
static void fill_row(uint8_t *row, enum kv_type type)
{
    if (type == KV_Q8_0) {
        for (int b = 0; b < D / 32; b++) {
            uint8_t *blk = row + b * 34;
            blk[0] = 0x00; /* f16 0x2000 = 2^-7 */
            blk[1] = 0x20;
            for (int i = 0; i < 32; i++)
                blk[2 + i] = (uint8_t)(int8_t)(bench_rnd(&rng) * 127.0f);
        }
        return;
    }
    uint16_t *h = (uint16_t *)row;
    for (int i = 0; i < D; i++)
        h[i] = (uint16_t)(0x3000 + (uint32_t)((bench_rnd(&rng) + 1.0f) * 1023.0f));
}

/* A cache whose one sequence holds L tokens of every layer's K and V. */
struct filled {
    kv_cache *cache;
    kv_seq *seq;
    struct kv_layout layout;
};

static struct filled fill_cache(int L, enum kv_type type)
{
    struct kv_cache_params cp = {.page_tokens = PT,
                                 .n_layer = LAYERS,
                                 .n_kv_head = KVH,
                                 .head_dim = D,
                                 .k_type = type,
                                 .v_type = type};
    cp.memory_bytes = kv_cache_memory_for(&cp, L / PT + 1);
    char err[512] = "";
    struct filled f = {0};
    f.cache = kv_cache_create(&cp, err, sizeof(err));
    if (!f.cache)
        die("kv_cache_create", err);
    struct kv_policy pol = {.kind = KV_EVICT_NONE, .max_cache_tokens = L};
    f.seq = kv_seq_create(f.cache, &pol, false, err, sizeof(err));
    if (!f.seq)
        die("kv_seq_create", err);
    kv_cache_layout(f.cache, &f.layout);
    int32_t ids[512];
    for (int i = 0; i < 512; i++)
        ids[i] = i;
    for (int done = 0; done < L;) {
        int n = L - done < 512 ? L - done : 512, first;
        if (kv_seq_append(f.seq, ids, n, &first))
            die("kv_seq_append", "refused");
        for (int t = first; t < first + n; t++)
            for (int l = 0; l < LAYERS; l++)
                for (int g = 0; g < KVH; g++) {
                    fill_row(kv_seq_k(f.seq, l, g, t), type);
                    fill_row(kv_seq_v(f.seq, l, g, t), type);
                }
        done += n;
    }
    return f;
}

static enum attn_type attn_type_of(enum kv_type t)
{
    return t == KV_Q8_0 ? ATTN_Q8_0 : ATTN_F16;
}

/* Layer l of the filled cache, as the forward pass describes it. */
static struct attn_kv kv_view(const struct filled *f, int l)
{
    const struct kv_layout *kl = &f->layout;
    return (struct attn_kv){.base = kl->base,
                            .page_bytes = kl->page_bytes,
                            .k_offset = kv_cache_k_offset(f->cache, l),
                            .v_offset = kv_cache_v_offset(f->cache, l),
                            .page_tokens = kl->page_tokens,
                            .k_type = attn_type_of(kl->k_type),
                            .v_type = attn_type_of(kl->v_type),
                            .n_pages = kv_cache_n_pages(f->cache)};
}

static attn_ctx *ctx_for(int threads, bool alibi)
{
    if (alibi)
        return bench_attn_ctx("bench_decode", H, KVH, D, POS_ALIBI, POS_ROPE_ADJACENT, threads);
    /* the bench models are llama files: adjacent pairs, as the model decodes them */
    return bench_attn_ctx("bench_decode", H, KVH, D, POS_ROPE, POS_ROPE_ADJACENT, threads);
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
static double time_decode(attn_ctx *ctx, const struct filled *f, int trials, bool hot, double *cpu)
{
    const int L = kv_seq_n_tokens(f->seq);
    float *q = malloc(sizeof(float) * H * D), *out = malloc(sizeof(float) * H * D);
    if (!q || !out)
        die("malloc", "out of memory");
    for (int i = 0; i < H * D; i++)
        q[i] = bench_rnd(&rng);
    int32_t qpos = kv_seq_positions(f->seq)[L - 1] + 1;
    struct attn_seq seq = {.page_table = kv_seq_page_table(f->seq),
                           .pos = kv_seq_positions(f->seq),
                           .n_kv = L,
                           .n_q = 1,
                           .q_pos = &qpos,
                           .q = q,
                           .out = out};
    double best = 1e30;
    *cpu = 1e30;
    for (int t = 0; t < trials; t++) {
        double t0 = bench_now(), c0 = thread_cpu();
        for (int l = 0; l < LAYERS; l++) {
            struct attn_kv kv = kv_view(f, hot ? 0 : l);
            if (attn_run(ctx, &kv, &seq, 1))
                die("attn_run", attn_error(ctx));
        }
        double dt = (bench_now() - t0) / LAYERS, dc = (thread_cpu() - c0) / LAYERS;
        best = dt < best ? dt : best;
        *cpu = dc < *cpu ? dc : *cpu;
    }
    free(q);
    free(out);
    return best;
}

static void run_rows(int L, enum kv_type type)
{
    struct filled f = fill_cache(L, type);
    const double kv = (double)L * KVH * 2 * (double)kv_type_row_bytes(type, D); /* one layer */
    for (int threads = 1; threads <= 2; threads++) {
        attn_ctx *ctx = ctx_for(threads, false);
        double bus = 0;
        bench_triad(threads, TRIAD_FLOATS, TRIAD_FLOATS, 3, &bus);
        const double rd = bench_read(threads, 3 * TRIAD_FLOATS * sizeof(float), 3); /* its bytes */
        double cpu, hot_cpu = 0;
        double dt = time_decode(ctx, &f, 5, false, &cpu);
        if (threads == 1)
            dt = cpu; /* alone on its thread: its CPU time */
        if (L <= 4096 && threads == 1)
            time_decode(ctx, &f, 5, true, &hot_cpu);
        printf("%-6d %5s %4d %3d %10.1f %8.2f %8.2f %5.0f%% %8.2f %5.0f%% %10.1f\n", L,
               kv_type_name(type), PT, threads, dt * 1e6, kv / dt / 1e9, bus,
               100.0 * kv / dt / 1e9 / bus, rd, rd > 0 ? 100.0 * kv / dt / 1e9 / rd : 0.0,
               hot_cpu * 1e6);
        fflush(stdout);
        attn_destroy(ctx);
    }
    kv_cache_destroy(f.cache);
}

int main(int argc, char **argv)
{
    int only = argc > 1 ? atoi(argv[1]) : 0;
    if (argc > 1 && (only < 64 || only > MAX_L))
        die("context length", "give 64..131072 tokens");
    static const int Ls[] = {4096, 16384, 32768};
    char load[64];
    bench_load_average(load, sizeof(load));
    printf("decode attention: %d query heads, %d KV heads, head dim %d, %d layers, RoPE, "
           "%s path, load %s\n",
           H, KVH, D, LAYERS, attn_simd_name(), load);
    if (argc > 2 && !strcmp(argv[2], "profile")) { /* for perf: one row, long */
        bool cold = false, q8 = false, alibi = false;
        for (int i = 3; i < argc; i++) {
            cold |= !strcmp(argv[i], "cold");
            q8 |= !strcmp(argv[i], "q8_0");
            alibi |= !strcmp(argv[i], "alibi");
        }
        struct filled f = fill_cache(only, q8 ? KV_Q8_0 : KV_F16);
        attn_ctx *ctx = ctx_for(cold ? 2 : 1, alibi);
        double cpu;
        double dt = time_decode(ctx, &f, 400, !cold, &cpu);
        printf("profile: %.1f us per call (%s K/V, %s, %s)\n", (cold ? dt : cpu) * 1e6,
               q8 ? "q8_0" : "f16", alibi ? "ALiBi" : "RoPE",
               cold ? "2 threads, each call the next layer" : "1 thread, one layer");
        attn_destroy(ctx);
        kv_cache_destroy(f.cache);
        return 0;
    }
    printf("%-6s %5s %4s %3s %10s %8s %8s %6s %8s %6s %10s\n", "L", "kv", "page", "thr", "us/layer",
           "KV GB/s", "bus GB/s", "roof", "read", "of rd", "hot cpu us");
    for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]) || (only && li == 0); li++) {
        int L = only ? only : Ls[li];
        run_rows(L, KV_F16);
        run_rows(L, KV_Q8_0);
        if (only)
            break;
    }
    return 0;
}
