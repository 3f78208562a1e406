/*
 * bench_matmul.c - speed of the matrix products per weight type.
 *
 * For a 4096 x 4096 weight matrix of each type, with 2 OpenMP threads:
 *
 *   matvec cold  one token (decoding), cycling through copies of the matrix
 *                that together exceed 512 MiB, so weights come from DRAM as
 *                in a real model: GB/s of weight bytes read.
 *   matvec hot   one token, the same matrix again and again (cache resident
 *                where it fits): shows how far the kernel is from compute bound.
 *   matmul       64 tokens (prefill), one matrix: GFLOP/s (2 flops per
 *                multiply-add).
 *
 * `bench_matmul kquant`: the K formats beside q8_0 (q8_0, q2_K to q6_K
 * with their kernels named): decoding from DRAM (cold, 2 threads), the
 * kernel's own speed on a matrix that stays in one core's L2 (4096 x 128,
 * one thread, GB/s and weights per second) and 64 tokens of that matrix.
 * Measured round-robin: every round visits the types in turn, so a
 * machine whose load changes during the run slows them alike and the "vs
 * q8_0" ratios stay fair; the one-thread, in-L2 figures are the least
 * disturbed by other processes. The load average is printed before and
 * after.
 *
 * Where the kernel level repacks q8_0 (model_pack.c does at load, and
 * decoding then runs the repacked tile), a "q8_0 rp" row measures that copy
 * the same way; "q4_0 rp" to "iq4_xs rp" the copies of the 4- and 5-bit
 * blocks' nibbles, and "q4_K rp" the 16-row q4_K copy, GB/s counted in
 * the stored rows' bytes (so beside the stored kernel's row, the same
 * weights per second scale).
 *
 * Then the decoding step of a model as kvd loads it: the SmolLM-135M shape
 * (576 x 30 layers, 9 heads, 3 KV heads, ffn 1536, tied 49152-row output),
 * q8_0, its 211 matrices repacked into one 2 MiB-aligned mapping advised as
 * huge pages, one token through all of them on 2 threads, the triad's bus
 * figure (4 arrays) measured beside it: the matrix part of a decoding
 * step's roofline, in ms per token and the fraction of the bus reached.
 *
 * `bench_matmul decode [ROUNDS [THREADS]]`: only that decoding step, for
 * q8_0, f16 (exact), f16 rounded to bf16 pairs (KVD_F16=bf16), bf16 as
 * packed by default, in pairs (KVD_BF16=pairs: AMX tiles where the CPU
 * has them; KVD_CPU=avx512-noamx for vdpbf16ps) and widened exactly
 * (KVD_BF16=exact), and f32, then q8_0, q4_K and q6_K on a 2048 x 16
 * shape (the K formats need rows of a multiple of 256; the rows of a type
 * the level does not repack are copied as stored, as model_pack.c does,
 * and the table says which), measured round-robin with a triad in each
 * round (see bench_decode_types); on one thread timed by its CPU time, the
 * figure that holds still on a shared machine.
 *
 * A STREAM-like triad (a = b + s * c over 3 x 192 MiB, 2 threads, counted as
 * 12 bytes per element like STREAM) measured in the same run gives the
 * machine's bandwidth; "cold/triad" is the fraction of it a decoding step
 * reaches. Every figure is the best of several trials (single calls for the
 * matrix-vector products, 24 MiB pieces for the triad), so that other
 * processes on a shared machine distort it less. On such a machine, also
 * run it with OMP_WAIT_POLICY=active: a sleeping OpenMP thread that must
 * wait for a busy core to wake turns every short call into milliseconds.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu/cpu.h"
#include "model/quant.h"
#include "tests/bench/bench_util.h"

#define N 4096
#define THREADS 2
#define COLD_BYTES ((size_t)512 << 20)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t rng = 0x1234567;

static float rnd(void) /* [-1, 1) */
{
    return bench_rnd(&rng);
}

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_matmul", n);
}

/* Offsets of the f16 scales in a block of the formats kvd only reads
 * (filled with random bytes here); -1: none / not such a format. */
static void scale_offsets(enum ggml_type type, int *d, int *m)
{
    static const struct {
        enum ggml_type type;
        int d, m;
    } tab[] = {
        {GGML_TYPE_Q4_K, 0, 2},   {GGML_TYPE_Q6_K, 208, -1}, {GGML_TYPE_Q4_1, 0, 2},
        {GGML_TYPE_Q5_0, 0, -1},  {GGML_TYPE_Q5_1, 0, 2},    {GGML_TYPE_IQ4_NL, 0, -1},
        {GGML_TYPE_Q2_K, 80, 82}, {GGML_TYPE_Q3_K, 108, -1}, {GGML_TYPE_Q5_K, 0, 2},
        {GGML_TYPE_IQ4_XS, 0, -1},
    };
    *d = *m = -1;
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        if (tab[i].type == type)
            *d = tab[i].d, *m = tab[i].m;
}

/* Fill one matrix: quantised from random floats, or random blocks with sane scales. */
static void make_matrix(enum ggml_type type, uint8_t *data, size_t rb)
{
    int doff, moff;
    scale_offsets(type, &doff, &moff);
    if (doff >= 0) {
        size_t bb = qt_block_bytes(type), nblk = rb / bb * N;
        for (size_t i = 0; i < nblk * bb; i++)
            data[i] = (uint8_t)(rnd() * 128 + 128);
        for (size_t i = 0; i < nblk; i++) {
            uint8_t *b = data + i * bb;
            uint16_t d = qt_f32_to_f16(0.01f * (rnd() + 1.5f));
            memcpy(b + doff, &d, 2);
            if (moff >= 0)
                memcpy(b + moff, &d, 2);
        }
        return;
    }
    float *row = xalloc(sizeof(float) * N);
    for (int o = 0; o < N; o++) {
        for (int i = 0; i < N; i++)
            row[i] = rnd();
        if (qt_quantize_row(type, row, data + (size_t)o * rb, N) != 0) {
            fprintf(stderr, "bench_matmul: quantising %s failed\n", qt_type_name(type));
            exit(1);
        }
    }
    free(row);
}

/*
 * STREAM-like triad over 3 x 192 MiB (far beyond the caches), measured the
 * way the matrix-vector products are: in pieces of 3 x 8 MiB timed one by
 * one while sweeping the arrays, keeping the fastest piece.
 */
static double triad_gbs(double *bus)
{
    /* 3 x 192 MiB in pieces of 3 x 8 MiB */
    return bench_triad(THREADS, (size_t)48 << 20, (size_t)2 << 20, 3, bus);
}

/* One call's time. */
static double time_call(float *out, const struct mm_weight *w, const float *x, int n_tok, int nth)
{
    double t0 = now();
    mm_matmul(out, w, x, n_tok, nth);
    return now() - t0;
}

#define KQ_TYPES 6
#define KQ_ROUNDS 10
#define KQ_COLD_BYTES ((size_t)256 << 20)
#define KQ_L2_ROWS 128 /* 4096 x 128: at most 0.6 MiB, inside one core's L2 */

static double gbs(size_t bytes, double t)
{
    return (double)bytes / t / 1e9;
}

static int bench_kquant(void)
{
    const enum ggml_type types[KQ_TYPES] = {GGML_TYPE_Q8_0, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K,
                                            GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
    const int n_tok = 64;
    char load0[64], load1[64];
    bench_load_average(load0, sizeof load0);
    printf("kernels: q8_0 %s, K formats %s; round-robin, best of %d rounds; load average before: "
           "%s\n",
           mm_kernel_name(), mm_k_kernel_name(), KQ_ROUNDS, load0);
    printf("cold: %dx%d, %d threads, copies over %zu MiB (DRAM); L2: %dx%d on 1 thread (the "
           "kernel's own speed); @64: 64 tokens of the L2 matrix, 1 thread\n\n",
           N, N, THREADS, KQ_COLD_BYTES >> 20, KQ_L2_ROWS, N);

    float *x = xalloc(sizeof(float) * N * n_tok);
    float *out = xalloc(sizeof(float) * N * n_tok);
    for (int i = 0; i < N * n_tok; i++)
        x[i] = rnd();
    uint8_t *data[KQ_TYPES];
    struct mm_weight w[KQ_TYPES], wl2[KQ_TYPES];
    size_t bytes[KQ_TYPES];
    int copies[KQ_TYPES];
    double cold[KQ_TYPES], l2[KQ_TYPES], mm[KQ_TYPES];
    for (int k = 0; k < KQ_TYPES; k++) {
        size_t rb = qt_row_bytes(types[k], N);
        bytes[k] = rb * N;
        copies[k] = (int)((KQ_COLD_BYTES + bytes[k] - 1) / bytes[k]);
        data[k] = xalloc(bytes[k] * (size_t)copies[k]);
        make_matrix(types[k], data[k], rb);
        for (int c = 1; c < copies[k]; c++)
            memcpy(data[k] + bytes[k] * (size_t)c, data[k], bytes[k]);
        char err[200];
        if (mm_weight_init(&w[k], types[k], N, N, data[k], err, sizeof err) != 0 ||
            mm_weight_init(&wl2[k], types[k], N, KQ_L2_ROWS, data[k], err, sizeof err) != 0) {
            fprintf(stderr, "bench_matmul: %s\n", err);
            return 1;
        }
        mm_matmul(out, &w[k], x, n_tok, THREADS); /* warm-up: threads, scratch */
        cold[k] = l2[k] = mm[k] = 1e30;
    }
    for (int round = 0; round < KQ_ROUNDS; round++)
        for (int k = 0; k < KQ_TYPES; k++) {
            /* cold: one sweep over the copies (each call a different one) */
            struct mm_weight wc = w[k];
            for (int c = 0; c < copies[k]; c++) {
                wc.data = data[k] + bytes[k] * (size_t)c;
                cold[k] = fmin(cold[k], time_call(out, &wc, x, 1, THREADS));
            }
            for (int i = 0; i < 50; i++)
                l2[k] = fmin(l2[k], time_call(out, &wl2[k], x, 1, 1));
            for (int i = 0; i < 3; i++)
                mm[k] = fmin(mm[k], time_call(out, &wl2[k], x, n_tok, 1));
        }
    bench_load_average(load1, sizeof load1);

    printf("%-6s %10s %8s %9s %8s %10s %12s %8s\n", "type", "cold GB/s", "vs q8_0", "L2 GB/s",
           "vs q8_0", "Gweights/s", "GFLOP/s @64", "vs q8_0");
    const size_t l2_elems = (size_t)N * KQ_L2_ROWS;
    for (int k = 0; k < KQ_TYPES; k++) {
        size_t b2 = bytes[k] / N * KQ_L2_ROWS, b20 = bytes[0] / N * KQ_L2_ROWS;
        printf("%-6s %10.1f %7.2fx %9.1f %7.2fx %10.1f %12.1f %7.2fx\n", qt_type_name(types[k]),
               gbs(bytes[k], cold[k]), cold[0] / cold[k] * (double)bytes[k] / (double)bytes[0],
               gbs(b2, l2[k]), l2[0] / l2[k] * (double)b2 / (double)b20,
               (double)l2_elems / l2[k] / 1e9, 2.0 * (double)l2_elems * n_tok / mm[k] / 1e9,
               mm[0] / mm[k]);
    }
    printf("\nload average after: %s\n", load1);
    for (int k = 0; k < KQ_TYPES; k++)
        free(data[k]);
    mm_scratch_release();
    free(x);
    free(out);
    return 0;
}

/* One row of the table: w, whose copies (its rows, or with packed its
 * repacked copies) lie stride bytes apart from base. Cold: a different copy
 * each call, 3 sweeps over all copies, the fastest call (a call whose
 * threads were not preempted); hot: the same matrix, best call of many;
 * 64 tokens: best of 8. */
static void measure_row(const char *name, const struct mm_weight *w0, uint8_t *base, size_t stride,
                        int copies, bool packed, const float *x, float *out, double triad)
{
    const int n_tok = 64;
    const size_t bytes = w0->row_bytes * (size_t)w0->n_out;
    struct mm_weight w = *w0;
    mm_matmul(out, &w, x, 1, THREADS); /* warm-up: threads, scratch */
    double best = 1e30;
    for (int i = 0; i < 3 * copies; i++) {
        if (packed)
            w.packed = base + stride * (size_t)(i % copies);
        else
            w.data = base + stride * (size_t)(i % copies);
        double t0 = now();
        mm_matmul(out, &w, x, 1, THREADS);
        best = fmin(best, now() - t0);
    }
    double cold = (double)bytes / best / 1e9;

    w = *w0;
    best = 1e30;
    for (int i = 0; i < 40; i++) {
        double t0 = now();
        mm_matmul(out, &w, x, 1, THREADS);
        best = fmin(best, now() - t0);
    }
    double hot = (double)bytes / best / 1e9;

    best = 1e30;
    for (int rep = 0; rep < 8; rep++) {
        double t0 = now();
        mm_matmul(out, &w, x, n_tok, THREADS);
        best = fmin(best, now() - t0);
    }
    double gflops = 2.0 * N * (double)N * n_tok / best / 1e9;
    printf("%-7s %9.1f %12.1f %11.2f %11.1f %16.1f\n", name, (double)bytes / (1 << 20), cold,
           cold / triad, hot, gflops);
    fflush(stdout);
}

/* ------------------------------------------------------------------------
 * A model's decoding step: every matrix once, one token
 * ------------------------------------------------------------------------ */

/* A model's shape for the decoding step: layers x 7 matrices (q k v o
 * gate up down) and the output matrix, each {n_in, n_out}. */
struct dec_shape {
    const char *name;
    int layers;
    int mats[8][2];
};
#define DEC_MATS_MAX (7 * 30 + 1)

static int dec_mats(const struct dec_shape *sh)
{
    return 7 * sh->layers + 1;
}

/* SmolLM-135M: 576 x 30, 9 heads and 3 KV heads of 64, ffn 1536, 49152-row output. */
static const struct dec_shape sm_shape = {"576x30",
                                          30,
                                          {{576, 576},
                                           {576, 192},
                                           {576, 192},
                                           {576, 576},
                                           {576, 1536},
                                           {576, 1536},
                                           {1536, 576},
                                           {576, 49152}}};

/* The K formats need rows of a multiple of 256 inputs, which 576 is not: a
 * 2048 x 16 llama (16 heads and 4 KV heads of 128, ffn 5632, 32000-row
 * output), the shape `kvd mkmodel --dim 2048 --layers 16` makes. */
static const struct dec_shape k_shape = {"2048x16",
                                         16,
                                         {{2048, 2048},
                                          {2048, 512},
                                          {2048, 512},
                                          {2048, 2048},
                                          {2048, 5632},
                                          {2048, 5632},
                                          {5632, 2048},
                                          {2048, 32000}}};

/* The matrices of shape sh in type, in one mapping as model_pack.c makes
 * at load: repacked where the level has kernels over repacked weights of
 * type (f16 rounded to bf16 pairs when f16_bf16; bf16 in pairs as
 * mm_bf16_set_pairs takes bf16_pairs, -1 the CPU's default), else their
 * rows copied as stored. Returns the mapping (cpu_unmap(mem, *total));
 * *bytes: the weights' bytes as stored. */
static uint8_t *model_copy(const struct dec_shape *sh, enum ggml_type type, bool f16_bf16,
                           int bf16_pairs, struct mm_weight *w, size_t *total, size_t *bytes)
{
    uint8_t *proto[8];
    for (int m = 0; m < 8; m++) { /* one matrix per shape; the layers copy them */
        const int n_in = sh->mats[m][0], n_out = sh->mats[m][1];
        size_t rb = qt_row_bytes(type, n_in);
        proto[m] = xalloc(rb * (size_t)n_out);
        float *row = xalloc(sizeof(float) * (size_t)n_in);
        for (int o = 0; o < n_out; o++) {
            for (int i = 0; i < n_in; i++)
                row[i] = rnd();
            qt_quantize_row(type, row, proto[m] + rb * (size_t)o, n_in);
        }
        free(row);
    }
    mm_f16_set_bf16(f16_bf16);
    mm_bf16_set_pairs(bf16_pairs);
    const int n = dec_mats(sh);
    *total = *bytes = 0;
    for (int k = 0; k < n; k++) {
        const int m = k == n - 1 ? 7 : k % 7;
        char err[200];
        if (mm_weight_init(&w[k], type, sh->mats[m][0], sh->mats[m][1], proto[m], err,
                           sizeof err)) {
            fprintf(stderr, "bench_matmul: %s\n", err);
            exit(1);
        }
        const size_t stored = w[k].row_bytes * (size_t)w[k].n_out, pb = mm_pack_bytes(&w[k]);
        *total += ((pb ? pb : stored) + 63) / 64 * 64;
        *bytes += stored;
    }
    uint8_t *mem = bench_map_weights("bench_matmul", *total), *p = mem;
    for (int k = 0; k < n; k++) {
        const size_t stored = w[k].row_bytes * (size_t)w[k].n_out, pb = mm_pack_bytes(&w[k]);
        if (pb) {
            mm_pack_weight(&w[k], p);
        } else { /* the stored rows, moved into the mapping */
            memcpy(p, w[k].data, stored);
            w[k].data = p;
        }
        p += ((pb ? pb : stored) + 63) / 64 * 64;
    }
    mm_f16_set_bf16(false);
    mm_bf16_set_pairs(-1);
    for (int m = 0; m < 8; m++)
        free(proto[m]);
    return mem;
}

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One decoding step: every matrix once (n), one token, on nth threads:
 * wall time, or with one thread its own CPU time (a preempted step does
 * not count the time it waited). */
static double model_step_on(const struct mm_weight *w, int n, const float *x, float *out, int nth)
{
    double t0 = nth == 1 ? cpu_now() : now();
    for (int k = 0; k < n; k++)
        mm_matmul(out, &w[k], x, 1, nth);
    return (nth == 1 ? cpu_now() : now()) - t0;
}

static void bench_model_decode(double bus)
{
    static struct mm_weight w[DEC_MATS_MAX];
    size_t total, bytes;
    uint8_t *mem = model_copy(&sm_shape, GGML_TYPE_Q8_0, false, -1, w, &total, &bytes);
    if (!mm_pack_ready(&w[0])) {
        printf("\nmodel decode: no repacked q8_0 kernels at this level\n");
        cpu_unmap(mem, total);
        return;
    }
    float *x = xalloc(sizeof(float) * 1536), *out = xalloc(sizeof(float) * 49152);
    for (int i = 0; i < 1536; i++)
        x[i] = rnd();
    double best = 1e30, sum = 0;
    const int steps = 30;
    for (int s = 0; s < steps; s++) {
        double dt = model_step_on(w, dec_mats(&sm_shape), x, out, THREADS);
        sum += dt;
        best = fmin(best, dt);
    }
    printf("\nmodel decode, 576x30 q8_0 (%d matrices, %.1f MB, repacked for %s, 2 MiB pages "
           "advised), 1 token, %d threads, best of %d steps:\n"
           "  %.2f ms per token (mean %.2f) = %.1f GB/s = %.2f of the bus (%.1f GB/s, triad's 4 "
           "arrays) = %.0f tokens/s at most from the weights alone\n",
           dec_mats(&sm_shape), (double)bytes / 1e6, mm_pack_kernel_name(), THREADS, steps, best * 1e3,
           sum / steps * 1e3, (double)bytes / best / 1e9, (double)bytes / best / 1e9 / bus, bus,
           1.0 / best);
    cpu_unmap(mem, total);
    free(x);
    free(out);
}

/*
 * `bench_matmul decode [ROUNDS]`: the model decoding step above for each
 * weight type whose copy decoding reads (q8_0, f16 exact, f16 rounded to
 * bf16 pairs, bf16 as the CPU's default packs it, in pairs as
 * KVD_BF16=pairs asks and widened as KVD_BF16=exact does, f32), and on
 * the 2048 x 16 shape q8_0, q4_K and q6_K (the K formats' rows must be a
 * multiple of 256), round-robin: every round runs 10 steps of each type in
 * turn and a triad, so a load change slows them alike. Printed per type:
 * the best and median step, GB/s of the weights as stored, and the
 * fraction of the best bus figure of the run.
 */
#define DEC_TYPES 10
#define DEC_STEPS 10

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int bench_decode_types(int rounds, int nth)
{
    static const struct {
        const char *name;
        const struct dec_shape *sh;
        enum ggml_type type;
        bool f16_bf16;
        int bf16_pairs;
    } ty[DEC_TYPES] = {{"q8_0", &sm_shape, GGML_TYPE_Q8_0, false, -1},
                       {"f16", &sm_shape, GGML_TYPE_F16, false, -1},
                       {"f16-bf16", &sm_shape, GGML_TYPE_F16, true, -1},
                       {"bf16", &sm_shape, GGML_TYPE_BF16, false, -1},
                       {"bf16-pair", &sm_shape, GGML_TYPE_BF16, false, 1},
                       {"bf16-exact", &sm_shape, GGML_TYPE_BF16, false, 0},
                       {"f32", &sm_shape, GGML_TYPE_F32, false, -1},
                       {"q8_0", &k_shape, GGML_TYPE_Q8_0, false, -1},
                       {"q4_K", &k_shape, GGML_TYPE_Q4_K, false, -1},
                       {"q6_K", &k_shape, GGML_TYPE_Q6_K, false, -1}};
    static struct mm_weight w[DEC_TYPES][DEC_MATS_MAX];
    uint8_t *mem[DEC_TYPES];
    size_t total[DEC_TYPES], bytes[DEC_TYPES];
    char la[64];
    bench_load_average(la, sizeof la);
    printf("model decode, %d thread%s, kernels %s; load average %s\n", nth,
           nth == 1 ? " (its CPU time)" : "s", mm_pack_kernel_name(), la);
    for (int i = 0; i < DEC_TYPES; i++)
        mem[i] = model_copy(ty[i].sh, ty[i].type, ty[i].f16_bf16, ty[i].bf16_pairs, w[i], &total[i],
                            &bytes[i]);
    float *x = xalloc(sizeof(float) * 5632), *out = xalloc(sizeof(float) * 49152);
    for (int i = 0; i < 5632; i++)
        x[i] = rnd();
    double *t = xalloc(sizeof(double) * DEC_TYPES * (size_t)rounds * DEC_STEPS), bus = 0;
    for (int r = 0; r < rounds; r++) {
        double b = 0;
        triad_gbs(&b);
        bus = fmax(bus, b);
        for (int i = 0; i < DEC_TYPES; i++)
            for (int s = 0; s < DEC_STEPS; s++)
                t[((size_t)i * (size_t)rounds + (size_t)r) * DEC_STEPS + (size_t)s] =
                    model_step_on(w[i], dec_mats(ty[i].sh), x, out, nth);
    }
    bench_load_average(la, sizeof la);
    printf("bus (triad's 4 arrays, best of %d): %.1f GB/s; load average after %s\n", rounds, bus,
           la);
    printf("%-10s %-8s %-8s %9s %10s %10s %8s %8s %8s\n", "type", "shape", "copy", "MB",
           "best ms", "median ms", "GB/s", "of bus", "tok/s");
    for (int i = 0; i < DEC_TYPES; i++) {
        const size_t n = (size_t)rounds * DEC_STEPS;
        double *ti = t + (size_t)i * n;
        qsort(ti, n, sizeof *ti, cmp_double);
        const double best = ti[0], med = ti[n / 2], gb = (double)bytes[i] / best / 1e9;
        printf("%-10s %-8s %-8s %9.1f %10.2f %10.2f %8.1f %8.2f %8.0f\n", ty[i].name,
               ty[i].sh->name, mm_pack_ready(&w[i][0]) ? "repacked" : "stored",
               (double)bytes[i] / 1e6, best * 1e3, med * 1e3, gb, gb / bus, 1.0 / best);
        cpu_unmap(mem[i], total[i]);
    }
    char how[384];
    printf("bf16: %s\n", mm_bf16_describe(how, sizeof how));
    mm_bf16_set_pairs(1);
    printf("bf16-pair: %s\n", mm_bf16_describe(how, sizeof how));
    mm_bf16_set_pairs(0);
    printf("bf16-exact: %s\n", mm_bf16_describe(how, sizeof how));
    mm_bf16_set_pairs(-1);
    free(t);
    free(x);
    free(out);
    return 0;
}

int main(int argc, char **argv)
{
    char bad[256];
    if (cpu_init_env(bad, sizeof bad)) { /* KVD_CPU, as kvd takes it */
        fprintf(stderr, "bench_matmul: %s\n", bad);
        return 2;
    }
    if (argc > 1 && !strcmp(argv[1], "kquant"))
        return bench_kquant();
    if (argc > 1 && !strcmp(argv[1], "decode"))
        return bench_decode_types(argc > 2 && atoi(argv[2]) > 0 ? atoi(argv[2]) : 5,
                                  argc > 3 && atoi(argv[3]) > 0 ? atoi(argv[3]) : THREADS);
    if (argc > 1) {
        fprintf(stderr, "usage: bench_matmul [kquant | decode [ROUNDS [THREADS]]]\n");
        return 2;
    }

    const enum ggml_type types[] = {
        GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16,   GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
        GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q4_1,   GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
        GGML_TYPE_IQ4_NL, GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q5_K, GGML_TYPE_IQ4_XS};
    const int n_types = (int)(sizeof types / sizeof types[0]);
    const int n_tok = 64;
    double bus = 0;
    double triad = triad_gbs(&bus);
    printf("matrix %dx%d, %d threads, kernels: %s (q2_K to q6_K: %s; q4_1 q5_0 q5_1 iq4_nl iq4_xs: "
           "%s)\n",
           N, N, THREADS, mm_kernel_name(), mm_k_kernel_name(), mm_blocks_kernel_name());
    printf("triad (a = b + s*c, 3 x 192 MiB): %.1f GB/s (the bus moves 4 arrays: %.1f GB/s)\n\n",
           triad, bus);
    printf("%-7s %9s %12s %11s %11s %16s\n", "type", "MiB", "cold GB/s", "cold/triad", "hot GB/s",
           "GFLOP/s @64 tok");

    float *x = xalloc(sizeof(float) * N * n_tok);
    float *out = xalloc(sizeof(float) * N * n_tok);
    for (int i = 0; i < N * n_tok; i++)
        x[i] = rnd();

    for (int k = 0; k < n_types; k++) {
        enum ggml_type type = types[k];
        size_t rb = qt_row_bytes(type, N), bytes = rb * N;
        int copies = (int)((COLD_BYTES + bytes - 1) / bytes);
        uint8_t *data = xalloc(bytes * (size_t)copies);
        make_matrix(type, data, rb);
        for (int c = 1; c < copies; c++)
            memcpy(data + bytes * (size_t)c, data, bytes);

        struct mm_weight w;
        char err[200];
        if (mm_weight_init(&w, type, N, N, data, err, sizeof err) != 0) {
            fprintf(stderr, "bench_matmul: %s\n", err);
            return 1;
        }
        measure_row(qt_type_name(type), &w, data, bytes, copies, false, x, out, triad);
        size_t pb = type == GGML_TYPE_Q8_0 || mm_pack_nibbles(type) ||
                                type == GGML_TYPE_Q4_K
                        ? mm_pack_bytes(&w)
                        : 0;
        if (pb) { /* decoding's own path at this level: the repacked copies */
            pb = (pb + 63) / 64 * 64;
            uint8_t *packed = bench_map_weights("bench_matmul", pb * (size_t)copies);
            for (int c = 0; c < copies; c++) {
                struct mm_weight wc = w;
                wc.data = data + bytes * (size_t)c;
                mm_pack_weight(&wc, packed + pb * (size_t)c);
            }
            w.packed = packed;
            char name[32];
            snprintf(name, sizeof name, "%s rp", qt_type_name(type));
            measure_row(name, &w, packed, pb, copies, true, x, out, triad);
            cpu_unmap(packed, pb * (size_t)copies);
        }
        free(data);
    }
    bench_model_decode(bus);
    mm_scratch_release();
    free(x);
    free(out);
    return 0;
}
