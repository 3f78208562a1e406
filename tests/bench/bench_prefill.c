/*
 * bench_prefill.c - the weight products of a prefill (matrix x matrix)
 * against the core's multiply-add peak.
 *
 * One layer of the SmolLM-135M shape (dim 576, 9 heads of 64, 3 KV heads,
 * ffn 1536): its seven products (q 576->576, k and v 576->192, o 576->576,
 * gate and up 576->1536, down 1536->576) on a chunk of 512 tokens, for
 * q8_0, f16 and f32 weights, each both as GGUF stores the rows (matmul.c)
 * and repacked for the prefill kernels (matmul_pack.c) where the kernel
 * level has them. Printed: GOPS (2 operations per multiply-add) and the
 * fraction of the peak measured in the same run on the same core: integer
 * types against vpdpbusd's (AVX-512 VNNI: 64 multiply-adds per
 * instruction; vpmaddubsw + vpmaddwd's without it), float types against
 * the f32 FMA's (16 per instruction; 8 without AVX-512),
 * each peak a loop of independent instructions with nothing else.
 *
 * One thread, timed by its own CPU time (CLOCK_THREAD_CPUTIME_ID), best of
 * several rounds: on a machine shared with other work the wall clock says
 * more about the others than about the kernel, while a thread's CPU time
 * counts only the cycles it ran (caches shared with neighbours still
 * interfere, so compare figures of one run). The two-thread wall-clock
 * time of the same layer is printed beside it, against the vpdpbusd peak
 * of both cores at once (each by its own CPU time, summed), and the load
 * average before and after. Rounds alternate the
 * variants, so a load change slows them alike. Products over repacked
 * weights split a 512-token chunk among threads by token tiles, each
 * thread quantising its own tokens (matmul_pack_run.c).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/cpu.h"
#include "model/quant.h"
#include "tests/bench/bench_peak.h"
#include "tests/bench/bench_util.h"

#define N_TOK 512
#define ROUNDS 5
#define N_MATS 7

static const int shapes[N_MATS][2] = {/* n_in, n_out */
                                      {576, 576},  {576, 192},  {576, 192}, {576, 576},
                                      {576, 1536}, {576, 1536}, {1536, 576}};

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float rnd(void) /* [-1, 1) */
{
    return bench_rnd(&rng);
}

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_prefill", n);
}

/* The int8 peak (bench_peak.h) of two threads at once, each by its own CPU time, the
 * rates summed: what a 2-thread product could reach with both cores busy
 * (a clock that drops when both run shows here, not in the 1-core peak). */
static double int8_peak2(void)
{
    double rate[2] = {0, 0};
#pragma omp parallel num_threads(2)
    {
        int t = omp_get_thread_num();
        if (t < 2)
            rate[t] = bench_peak_int8();
    }
    return rate[0] + rate[1];
}

/* ------------------------------------------------------------------------
 * One layer's products
 * ------------------------------------------------------------------------ */

struct layer {
    enum ggml_type type;
    uint8_t *data[N_MATS];
    void *packed[N_MATS];
    size_t packed_bytes[N_MATS];
    struct mm_weight w[N_MATS];
    double macs;
};

static void layer_init(struct layer *L, enum ggml_type type)
{
    memset(L, 0, sizeof *L);
    L->type = type;
    for (int m = 0; m < N_MATS; m++) {
        int n_in = shapes[m][0], n_out = shapes[m][1];
        size_t rb = qt_row_bytes(type, n_in);
        L->data[m] = xalloc(rb * (size_t)n_out);
        float *row = xalloc(sizeof(float) * (size_t)n_in);
        for (int o = 0; o < n_out; o++) {
            for (int i = 0; i < n_in; i++)
                row[i] = rnd() * 0.1f;
            if (qt_quantize_row(type, row, L->data[m] + rb * (size_t)o, n_in)) {
                fprintf(stderr, "bench_prefill: quantising %s failed\n", qt_type_name(type));
                exit(1);
            }
        }
        free(row);
        char err[200];
        if (mm_weight_init(&L->w[m], type, n_in, n_out, L->data[m], err, sizeof err)) {
            fprintf(stderr, "bench_prefill: %s\n", err);
            exit(1);
        }
        size_t pb = mm_pack_bytes(&L->w[m]);
        if (pb) {
            L->packed_bytes[m] = pb;
            L->packed[m] = bench_map_weights("bench_prefill", pb);
            mm_pack_weight(&L->w[m], L->packed[m]);
        }
        L->macs += (double)n_in * n_out * N_TOK;
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

/* The layer's products with the repacked copies (packed) or without. */
static void layer_run(struct layer *L, bool packed, const float *x, float *out, int nth)
{
    for (int m = 0; m < N_MATS; m++) {
        struct mm_weight w = L->w[m];
        if (!packed)
            w.packed = NULL;
        if (mm_matmul(out, &w, x, N_TOK, nth)) {
            fprintf(stderr, "bench_prefill: out of memory\n");
            exit(1);
        }
    }
}

int main(int argc, char **argv)
{
    (void)argv;
    if (argc > 1) {
        fprintf(stderr, "usage: bench_prefill\n");
        return 2;
    }
    char load0[64], load1[64], lvl[96];
    bench_load_average(load0, sizeof load0);
    double int8 = 0.0, fma = 0.0, int8_2 = 0.0;
    /* the best of 5 each: a clock slowed for a moment by the neighbours
     * would otherwise lower the peak and flatter the fractions */
    for (int i = 0; i < 5; i++) {
        int8 = fmax(int8, bench_peak_int8());
        fma = fmax(fma, bench_peak_fma());
        int8_2 = fmax(int8_2, int8_peak2());
    }
    const char *pk = mm_pack_kernel_name();
    printf("kernels %s: matmul %s, repacked %s\n", cpu_describe(lvl, sizeof lvl), mm_kernel_name(),
           pk ? pk : "none at this level");
    printf("one SmolLM-135M layer (7 products, dim 576, ffn 1536) x %d tokens; 1 thread by CPU "
           "time and 2 threads by wall clock, best of %d; load average before: %s\n",
           N_TOK, ROUNDS, load0);
    if (int8 > 0)
        printf("peak of one core, measured now: %s %.0f GOPS, %s %.0f GFLOPS; "
               "%s on 2 threads at once: %.0f GOPS\n\n",
               bench_peak_int8_name(), int8, bench_peak_fma_name(), fma, bench_peak_int8_name(),
               int8_2);
    else
        printf("peak: not measured (no AVX2 on this CPU)\n\n");

    float *x = xalloc(sizeof(float) * 1536 * N_TOK);
    float *out = xalloc(sizeof(float) * 1536 * N_TOK);
    for (int i = 0; i < 1536 * N_TOK; i++)
        x[i] = rnd();
    const enum ggml_type types[3] = {GGML_TYPE_Q8_0, GGML_TYPE_F16, GGML_TYPE_F32};
    struct layer L[3];
    double t1[3][2], t2[3][2];
    for (int k = 0; k < 3; k++) {
        layer_init(&L[k], types[k]);
        for (int p = 0; p < 2; p++)
            t1[k][p] = t2[k][p] = 1e30;
    }
    for (int round = 0; round < ROUNDS; round++)
        for (int k = 0; k < 3; k++)
            for (int p = 0; p < 2; p++) {
                if (p && !L[k].packed[0])
                    continue;
                double c0 = bench_thread_cpu();
                layer_run(&L[k], p, x, out, 1);
                t1[k][p] = fmin(t1[k][p], bench_thread_cpu() - c0);
                double w0 = bench_now();
                layer_run(&L[k], p, x, out, 2);
                t2[k][p] = fmin(t2[k][p], bench_now() - w0);
            }
    bench_load_average(load1, sizeof load1);

    printf("%-6s %-9s %10s %12s %8s %12s %8s %10s\n", "type", "weights", "1 thr ms", "1 thr GOPS",
           "of peak", "2 thr GOPS", "of peak", "vs stored");
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < 2; p++) {
            if (p && !L[k].packed[0])
                continue;
            double gops = 2.0 * L[k].macs / t1[k][p] / 1e9;
            double peak = types[k] == GGML_TYPE_Q8_0 ? int8 : fma;
            double gops2 = 2.0 * L[k].macs / t2[k][p] / 1e9;
            char frac[16] = "-", frac2[16] = "-"; /* 2 threads: q8_0 only (no FMA pair peak) */
            if (peak > 0)
                snprintf(frac, sizeof frac, "%.0f%%", 100.0 * gops / peak);
            if (types[k] == GGML_TYPE_Q8_0 && int8_2 > 0)
                snprintf(frac2, sizeof frac2, "%.0f%%", 100.0 * gops2 / int8_2);
            printf("%-6s %-9s %10.2f %12.1f %8s %12.1f %8s %9.2fx\n", qt_type_name(types[k]),
                   p ? "repacked" : "stored", 1e3 * t1[k][p], gops, frac, gops2, frac2,
                   t1[k][0] / t1[k][p]);
        }
    printf("\nload average after: %s\n", load1);
    for (int k = 0; k < 3; k++)
        layer_free(&L[k]);
    mm_scratch_release();
    free(x);
    free(out);
    return 0;
}
