/*
 * bench_bf16.c - F16 and BF16 weights: prefill against the f32 FMA and
 * vdpbf16ps peaks, and decode against the memory bus, path by path.
 *
 * The paths (model/matmul_bf16.h says which runs when):
 *   f16 exact      F16 widened exactly, f32 FMA tile (the default for F16)
 *   f16 as bf16    F16 rounded to bf16 at load, vdpbf16ps (KVD_F16=bf16)
 *   bf16 amx       BF16 as stored, AMX tiles (the default where the CPU has them)
 *   bf16           BF16 as stored, vdpbf16ps (the default where the CPU has
 *                  it and it outruns the FMA; avx512-noamx)
 *   bf16 FMA       BF16 widened exactly, f32 FMA (avx512-nobf16: CPUs without it)
 *   f32            for comparison, the f32 FMA tile
 *
 * Prefill: one SmolLM-135M layer (dim 576, 9 heads of 64, 3 KV heads, ffn
 * 1536: seven products) x 512 tokens, one thread by its CPU time and two
 * by the wall clock, best of several rounds (as bench_prefill). Peaks of
 * one core measured in the same run: a loop of independent f32 FMAs (16
 * multiply-adds each) and of vdpbf16ps (32 each); each path's fraction is
 * of the peak of the instruction it uses, and of the FMA peak, which says
 * what the bf16 path gains over the best an f32 kernel could do.
 *
 * Decode: the same layer's products for one token over 30 layers' weights
 * (the model's depth, ~210 MB: larger than the last-level cache of the
 * machines kvd meets, where 8 layers' 56 MB had stayed in an AMX Xeon's
 * cache and read at 121-136% of the bus; so each token streams them from
 * memory), two threads, against the bus bandwidth of bench_util.h's triad
 * measured beside it (the read-only ceiling). Load average before and
 * after.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "model/quant.h"
#include "tests/bench/bench_peak.h"
#include "tests/bench/bench_util.h"

#define N_TOK 512
#define ROUNDS 5
#define N_MATS 7
#define DEC_LAYERS 30
#define DEC_TOKENS 40

static const int shapes[N_MATS][2] = {/* n_in, n_out */
                                      {576, 576},  {576, 192},  {576, 192}, {576, 576},
                                      {576, 1536}, {576, 1536}, {1536, 576}};

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_bf16", n);
}

/* ------------------------------------------------------------------------
 * Peaks: independent chains of one instruction, per second of thread time
 * ------------------------------------------------------------------------ */

/* the peaks: tests/bench/bench_peak.h */

/* ------------------------------------------------------------------------
 * Layers, packed as one path wants
 * ------------------------------------------------------------------------ */

struct path {
    const char *name;
    enum ggml_type type;
    bool f16_bf16;     /* KVD_F16=bf16 */
    const char *level; /* cpu_force name while packing and running */
    bool dp;           /* uses vdpbf16ps */
    bool amx;          /* uses the AMX tiles: run only where the CPU has them */
};

static const struct path paths[] = {
    {"f32", GGML_TYPE_F32, false, "auto", false, false},
    {"f16 exact", GGML_TYPE_F16, false, "auto", false, false},
    {"f16 as bf16", GGML_TYPE_F16, true, "avx512-noamx", true, false},
    {"bf16 amx", GGML_TYPE_BF16, false, "auto", true, true},
    {"bf16", GGML_TYPE_BF16, false, "avx512-noamx", true, false},
    {"bf16 FMA", GGML_TYPE_BF16, false, "avx512-nobf16", false, false},
};
#define N_PATHS (sizeof paths / sizeof paths[0])

struct layer {
    struct mm_weight w[N_MATS];
    uint8_t *data[N_MATS];
    void *packed[N_MATS];
    size_t packed_bytes[N_MATS];
    double macs, bytes;
};

static void use_path(const struct path *p)
{
    char err[200];
    if (cpu_force(p->level, err, sizeof err)) {
        fprintf(stderr, "bench_bf16: %s\n", err);
        exit(1);
    }
    mm_f16_set_bf16(p->f16_bf16);
    mm_bf16_set_pairs(p->type == GGML_TYPE_BF16 && p->dp ? 1 : -1); /* "bf16": the pairs */
}

static void layer_init(struct layer *L, const struct path *p)
{
    memset(L, 0, sizeof *L);
    use_path(p);
    for (int m = 0; m < N_MATS; m++) {
        int n_in = shapes[m][0], n_out = shapes[m][1];
        size_t rb = qt_row_bytes(p->type, n_in);
        L->data[m] = xalloc(rb * (size_t)n_out);
        float *row = xalloc(sizeof(float) * (size_t)n_in);
        for (int o = 0; o < n_out; o++) {
            for (int i = 0; i < n_in; i++)
                row[i] = bench_rnd(&rng) * 0.1f;
            qt_quantize_row(p->type, row, L->data[m] + rb * (size_t)o, n_in);
        }
        free(row);
        char err[200];
        if (mm_weight_init(&L->w[m], p->type, n_in, n_out, L->data[m], err, sizeof err)) {
            fprintf(stderr, "bench_bf16: %s\n", err);
            exit(1);
        }
        size_t pb = mm_pack_bytes(&L->w[m]);
        if (pb) {
            L->packed_bytes[m] = pb;
            L->packed[m] = bench_map_weights("bench_bf16", pb);
            mm_pack_weight(&L->w[m], L->packed[m]);
            L->bytes += (double)pb;
        } else {
            L->bytes += (double)(rb * (size_t)n_out);
        }
        L->macs += (double)n_in * n_out;
    }
}

static void layer_free(struct layer *L)
{
    for (int m = 0; m < N_MATS; m++) {
        free(L->data[m]);
        if (L->packed[m])
            cpu_unmap(L->packed[m], L->packed_bytes[m]);
    }
}

static void layer_run(struct layer *L, const float *x, float *out, int n_tok, int nth)
{
    for (int m = 0; m < N_MATS; m++)
        if (mm_matmul(out, &L->w[m], x, n_tok, nth)) {
            fprintf(stderr, "bench_bf16: out of memory\n");
            exit(1);
        }
}

/* One path: prefill (1 thread CPU time, 2 threads wall), decode (2 threads
 * wall per token over DEC_LAYERS layers). Rounds of the caller alternate
 * the paths. */
struct result {
    double t1, t2, tdec;
};

static void run_path(const struct path *p, struct layer *L, const float *x, float *out,
                     struct result *r)
{
    use_path(p);
    double c0 = bench_thread_cpu();
    layer_run(&L[0], x, out, N_TOK, 1);
    r->t1 = fmin(r->t1, bench_thread_cpu() - c0);
    double w0 = bench_now();
    layer_run(&L[0], x, out, N_TOK, 2);
    r->t2 = fmin(r->t2, bench_now() - w0);
    w0 = bench_now();
    for (int t = 0; t < DEC_TOKENS; t++)
        for (int l = 0; l < DEC_LAYERS; l++)
            layer_run(&L[l], x + t, out, 1, 2);
    r->tdec = fmin(r->tdec, (bench_now() - w0) / DEC_TOKENS);
}

int main(int argc, char **argv)
{
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "usage: bench_bf16\n");
        return 2;
    }
    char load0[64], load1[64], lvl[160], bf[160];
    bench_load_average(load0, sizeof load0);
    printf("kernels %s; %s\n", cpu_describe(lvl, sizeof lvl), mm_bf16_describe(bf, sizeof bf));
    if (!cpu_bf16_supported()) {
        printf("no avx512bf16 on this CPU (or not at the avx512 level): nothing to compare\n");
        return 0;
    }
    const bool amx = cpu_amx_supported(); /* and the tile permission with it */
    double fma = 0, dpb = 0, tdp = 0;
    for (int i = 0; i < 5; i++) { /* the best of 5, as bench_prefill */
        fma = fmax(fma, bench_peak_fma());
        dpb = fmax(dpb, bench_peak_bf16());
        if (amx)
            tdp = fmax(tdp, bench_peak_amx_bf16());
    }
    double bus = 0;
    bench_triad(2, (size_t)32 << 20, (size_t)32 << 20, 3, &bus);
    printf("peak of one core, measured now: f32 FMA %.0f GFLOPS, vdpbf16ps %.0f GFLOPS (%.2fx), "
           "tdpbf16ps ",
           fma, dpb, dpb / fma);
    if (amx)
        printf("%.0f GFLOPS (%.1fx)", tdp, tdp / fma);
    else
        printf("not measured (no amx-bf16 here)");
    printf("; bus (triad, 2 threads) %.1f GB/s; load average before: %s\n", bus, load0);
    printf("prefill: one SmolLM-135M layer x %d tokens, 1 thread by CPU time, 2 by wall clock; "
           "decode: 1 token over %d layers, 2 threads; best of %d\n\n",
           N_TOK, DEC_LAYERS, ROUNDS);

    float *x = xalloc(sizeof(float) * 1536 * N_TOK);
    float *out = xalloc(sizeof(float) * 1536 * N_TOK);
    for (int i = 0; i < 1536 * N_TOK; i++)
        x[i] = bench_rnd(&rng);
    static struct layer L[N_PATHS][DEC_LAYERS];
    struct result r[N_PATHS];
    for (size_t k = 0; k < N_PATHS; k++) {
        r[k] = (struct result){1e30, 1e30, 1e30};
        if (paths[k].amx && !amx)
            continue;
        for (int l = 0; l < DEC_LAYERS; l++)
            layer_init(&L[k][l], &paths[k]);
    }
    for (int round = 0; round < ROUNDS; round++)
        for (size_t k = 0; k < N_PATHS; k++)
            if (!paths[k].amx || amx)
                run_path(&paths[k], L[k], x, out, &r[k]);
    bench_load_average(load1, sizeof load1);
    cpu_force("auto", NULL, 0);
    mm_f16_set_bf16(false);

    printf("%-12s %9s %10s %9s %9s %10s | %12s %8s %8s\n", "path", "1 thr ms", "1 thr GF/s",
           "of own", "of FMA", "2 thr GF/s", "decode GB/s", "of bus", "ms/tok");
    for (size_t k = 0; k < N_PATHS; k++) {
        if (paths[k].amx && !amx) {
            printf("%-12s not run: no amx-bf16 here\n", paths[k].name);
            continue;
        }
        double gf = 2.0 * L[k][0].macs * N_TOK / r[k].t1 / 1e9;
        double own = paths[k].amx ? tdp : paths[k].dp ? dpb : fma; /* its instruction's peak */
        double gf2 = 2.0 * L[k][0].macs * N_TOK / r[k].t2 / 1e9;
        double gbs = L[k][0].bytes * DEC_LAYERS / r[k].tdec / 1e9;
        printf("%-12s %9.2f %10.1f %8.0f%% %8.0f%% %10.1f | %12.1f %7.0f%% %8.3f\n", paths[k].name,
               1e3 * r[k].t1, gf, 100.0 * gf / own, 100.0 * gf / fma, gf2, gbs, 100.0 * gbs / bus,
               1e3 * r[k].tdec);
    }
    printf("\nload average after: %s\n", load1);
    for (size_t k = 0; k < N_PATHS; k++)
        for (int l = 0; l < DEC_LAYERS; l++)
            if (!paths[k].amx || amx)
                layer_free(&L[k][l]);
    mm_scratch_release();
    free(x);
    free(out);
    return 0;
}
