/*
 * bench_attention.c - speed of the fused paged attention kernel.
 *
 * Shape: 32 query heads, 8 KV heads, head dim 128, f16 K/V in pages of 16
 * tokens, 2 OpenMP threads, L = 1k .. 128k cached tokens. Printed, never
 * asserted. Figures measured in the same run:
 *
 *   triad     a STREAM-like a = b + s * c over 3 x 256 MiB, 2 threads: the
 *             machine's memory bandwidth.
 *   peak      2 threads of independent FMA chains (the widest vectors the
 *             build has): the cores' peak GFLOP/s.
 *   decode    one query over L keys. Each call reads another "layer" of a
 *             pool of at least 1 GiB, as a model's step does, so K/V come
 *             from DRAM, not from a cache that held the previous call:
 *             GB/s of K/V bytes and that as a fraction of the triad.
 *   prefill   a 512-query chunk (the last 512 of the L cached tokens, causal
 *             inside the chunk): GFLOP/s (4 * heads * head_dim per visible
 *             query-key pair) and that as a fraction of the peak.
 *   schemes   RoPE, ALiBi and T5 time over NONE time, same shapes.
 *   reference the plain kernel's time over the fused one, where it runs in
 *             a few seconds; elsewhere the line says it was skipped and why.
 *
 * Every figure is the best of a few trials, so a busy machine shows less
 * noise (the load average at the start is printed too). The whole run takes
 * about a minute on an idle machine, two on a busy one.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "attention/attention.h"
#include "tests/bench/bench_util.h"

#define THREADS 2
#define H 32
#define KVH 8
#define D 128
#define PT 16
#define NQ_PREFILL 512
#define COLD_BYTES ((size_t)1 << 30)
#define MAX_L (128 * 1024)

static void *xalloc(size_t n)
{
    return bench_xalloc("bench_attention", n);
}

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static float rnd(void) /* [-1, 1) */
{
    return bench_rnd(&rng);
}

/* IEEE half from a float in [-1, 1) (round to nearest; no overflow possible). */
static uint16_t to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax < 0x38800000u) /* tiny: flush to zero, fine for benchmark data */
        return (uint16_t)sign;
    return (uint16_t)(sign | ((ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u) >> 13));
}

/* ------------------------------------------------------------------------
 * Machine figures
 * ------------------------------------------------------------------------ */

static double triad_gbs(void)
{
    const size_t n = (size_t)64 << 20; /* 64 Mi floats = 256 MiB per array */
    return bench_triad(THREADS, n, n, 5, NULL);
}

/* Peak FMA GFLOP/s of `threads` threads: 12 independent chains per thread. */
static double peak_gflops(int threads, const char **how)
{
    const long iters = 20000000;
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = bench_now();
        float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        {
#if defined(__AVX512F__)
            __m512 acc[12], x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
            for (int j = 0; j < 12; j++)
                acc[j] = _mm512_set1_ps((float)j);
            for (long i = 0; i < iters; i++)
                for (int j = 0; j < 12; j++)
                    acc[j] = _mm512_fmadd_ps(acc[j], x, y);
            for (int j = 0; j < 12; j++)
                sink += _mm512_reduce_add_ps(acc[j]);
#elif defined(__AVX2__) && defined(__FMA__)
            __m256 acc[12], x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
            for (int j = 0; j < 12; j++)
                acc[j] = _mm256_set1_ps((float)j);
            for (long i = 0; i < iters; i++)
                for (int j = 0; j < 12; j++)
                    acc[j] = _mm256_fmadd_ps(acc[j], x, y);
            float tmp[8];
            for (int j = 0; j < 12; j++) {
                _mm256_storeu_ps(tmp, acc[j]);
                sink += tmp[0];
            }
#else
            float acc[12];
            for (int j = 0; j < 12; j++)
                acc[j] = (float)j;
            for (long i = 0; i < iters; i++)
                for (int j = 0; j < 12; j++)
                    acc[j] = acc[j] * 0.999999f + 1e-7f;
            for (int j = 0; j < 12; j++)
                sink += acc[j];
#endif
        }
        double dt = bench_now() - t0;
        volatile float keep = sink;
        (void)keep;
        best = dt < best ? dt : best;
    }
#if defined(__AVX512F__)
    const double lanes = 16;
    *how = "avx512 fma";
#elif defined(__AVX2__) && defined(__FMA__)
    const double lanes = 8;
    *how = "avx2 fma";
#else
    const double lanes = 1;
    *how = "scalar";
#endif
    return 2.0 * lanes * 12 * (double)iters * threads / best / 1e9;
}

/* ------------------------------------------------------------------------
 * The cache being read
 * ------------------------------------------------------------------------ */

/*
 * A pool of MAX_L / PT pages, each holding n_layers layers of K and V for
 * all KV heads: n_layers is chosen per L so the layers a sequence of L
 * tokens touches span COLD_BYTES.
 */
struct pool {
    uint8_t *mem;
    size_t bytes;
};

static const size_t BLOCK = (size_t)KVH * PT * D * 2; /* one layer's K (or V) in a page */

static int layers_for(int L)
{
    size_t per_layer = (size_t)(L / PT) * 2 * BLOCK;
    size_t n = COLD_BYTES / per_layer;
    return n < 1 ? 1 : (int)n;
}

static struct attn_kv kv_view(const struct pool *p, int L, int layer)
{
    int nl = layers_for(L);
    return (struct attn_kv){.base = p->mem,
                            .page_bytes = (size_t)nl * 2 * BLOCK,
                            .k_offset = (size_t)layer * 2 * BLOCK,
                            .v_offset = (size_t)layer * 2 * BLOCK + BLOCK,
                            .page_tokens = PT,
                            .k_type = ATTN_F16,
                            .v_type = ATTN_F16,
                            .n_pages = L / PT};
}

/* ------------------------------------------------------------------------
 * Runs
 * ------------------------------------------------------------------------ */

struct scheme_data {
    float slopes[H];
    float t5[H * 32];
};

static struct attn_params params_for(enum pos_kind kind, struct scheme_data *sd)
{
    struct attn_params p = {.n_head = H,
                            .n_kv_head = KVH,
                            .head_dim = D,
                            .scale = 1.0f / sqrtf((float)D),
                            .n_threads = THREADS};
    p.pos.kind = kind;
    if (kind == POS_ROPE) {
        p.pos.rope_theta = 10000.0f;
        p.pos.rope_dims = D;
        p.pos.rope_pairing = POS_ROPE_NEOX;
        p.pos.rope_freq_scale = 1.0f;
    } else if (kind == POS_ALIBI) {
        pos_alibi_slopes(sd->slopes, H, 8.0f);
        p.pos.alibi_slopes = sd->slopes;
    } else if (kind == POS_T5) {
        for (int i = 0; i < H * 32; i++)
            sd->t5[i] = rnd();
        p.pos.t5_table = sd->t5;
        p.pos.t5_num_buckets = 32;
        p.pos.t5_max_distance = 128;
        p.pos.t5_bidirectional = false;
    }
    return p;
}

struct batch {
    int32_t *page_table, *pos, *q_pos;
    float *q, *out;
    struct attn_seq seq;
};

static void batch_init(struct batch *b, int L, int n_q)
{
    b->page_table = xalloc(sizeof(int32_t) * (size_t)(L / PT));
    b->pos = xalloc(sizeof(int32_t) * (size_t)L);
    b->q_pos = xalloc(sizeof(int32_t) * (size_t)n_q);
    b->q = xalloc(sizeof(float) * (size_t)n_q * H * D);
    b->out = xalloc(sizeof(float) * (size_t)n_q * H * D);
    for (int i = 0; i < L / PT; i++)
        b->page_table[i] = i;
    for (int i = 0; i < L; i++)
        b->pos[i] = i;
    for (int i = 0; i < n_q; i++)
        b->q_pos[i] = L - n_q + i;
    for (size_t i = 0; i < (size_t)n_q * H * D; i++)
        b->q[i] = rnd();
    b->seq = (struct attn_seq){.page_table = b->page_table,
                               .pos = b->pos,
                               .n_kv = L,
                               .n_q = n_q,
                               .q_pos = b->q_pos,
                               .q = b->q,
                               .out = b->out};
}

static void batch_free(struct batch *b)
{
    free(b->page_table);
    free(b->pos);
    free(b->q_pos);
    free(b->q);
    free(b->out);
}

/* Seconds per call over `calls` calls, each on the next layer (cold) or on layer 0. */
static double time_calls(attn_ctx *ctx, const struct pool *p, struct batch *b, int L, int calls,
                         bool cold, int *layer)
{
    int nl = layers_for(L);
    double t0 = bench_now();
    for (int c = 0; c < calls; c++) {
        if (cold)
            *layer = (*layer + 1) % nl;
        struct attn_kv kv = kv_view(p, L, cold ? *layer : 0);
        if (attn_run(ctx, &kv, &b->seq, 1)) {
            fprintf(stderr, "bench_attention: attn_run: %s\n", attn_error(ctx));
            exit(1);
        }
    }
    return (bench_now() - t0) / calls;
}

/*
 * Best seconds per call for each of n contexts, trials interleaved (all
 * contexts once, then again) so a change in the machine's load hits every
 * scheme alike. warm: one untimed call each first.
 */
static void time_schemes(attn_ctx **ctx, int n, const struct pool *p, struct batch *b, int L,
                         int calls, int trials, bool cold, bool warm, double *best)
{
    int layer = 0;
    for (int k = 0; k < n; k++) {
        best[k] = 1e30;
        if (warm)
            time_calls(ctx[k], p, b, L, 1, cold, &layer);
    }
    for (int t = 0; t < trials; t++)
        for (int k = 0; k < n; k++) {
            double dt = time_calls(ctx[k], p, b, L, calls, cold, &layer);
            best[k] = dt < best[k] ? dt : best[k];
        }
}

static double time_reference(const struct attn_params *prm, const struct pool *p, struct batch *b,
                             int L)
{
    struct attn_kv kv = kv_view(p, L, 0);
    double t0 = bench_now();
    if (attn_reference(prm, &kv, &b->seq, 1)) {
        fprintf(stderr, "bench_attention: attn_reference failed (out of memory?)\n");
        return -1;
    }
    return bench_now() - t0;
}

int main(void)
{
    static const int Ls[] = {1024, 4096, 16384, 65536, 131072};
    static const enum pos_kind kinds[4] = {POS_NONE, POS_ROPE, POS_ALIBI, POS_T5};
    double t_start = bench_now();

    printf("attention: %d query heads, %d KV heads, head dim %d, f16 KV, pages of %d, "
           "%d threads, %s path\n",
           H, KVH, D, PT, THREADS, attn_simd_name());
    double load = -1;
    FILE *la = fopen("/proc/loadavg", "r");
    if (la) {
        if (fscanf(la, "%lf", &load) != 1)
            load = -1;
        fclose(la);
    }
    double triad = triad_gbs();
    const char *how;
    double peak1 = peak_gflops(1, &how), peak2 = peak_gflops(THREADS, &how);
    double peak = peak1 * THREADS; /* each core at its own measured peak */
    printf("machine: triad %.1f GB/s (%d threads); FMA peak %.1f GFLOP/s per core (%s), "
           "%.1f for %d threads = the peak used below (measured together: %.1f); "
           "load average %.2f at start\n\n",
           triad, THREADS, peak1, how, peak, THREADS, peak2, load);

    /* the pool: every page of a 128k sequence, filled with random halves */
    struct pool pool;
    pool.bytes = (size_t)(MAX_L / PT) * layers_for(MAX_L) * 2 * BLOCK;
    if (pool.bytes < COLD_BYTES)
        pool.bytes = COLD_BYTES;
    pool.bytes += 4 * BLOCK;
    pool.mem = xalloc(pool.bytes);
    {
        uint16_t pattern[4099];
        for (int i = 0; i < 4099; i++)
            pattern[i] = to_half(rnd());
        uint16_t *h = (uint16_t *)pool.mem;
        size_t n = pool.bytes / 2;
        for (size_t i = 0; i < n; i += 4099)
            memcpy(h + i, pattern, 2 * (n - i < 4099 ? n - i : 4099));
    }

    struct scheme_data sd;
    attn_ctx *ctx[4];
    struct attn_params prm[4];
    for (int k = 0; k < 4; k++) {
        char err[256];
        prm[k] = params_for(kinds[k], &sd);
        ctx[k] = attn_create(&prm[k], err, sizeof(err));
        if (!ctx[k]) {
            fprintf(stderr, "bench_attention: %s\n", err);
            return 1;
        }
    }

    /* --- decode --------------------------------------------------------- */
    printf("decode: 1 query, cold K/V (each call reads another layer of a %zu MiB pool); "
           "1-thr: the same on one thread\n",
           COLD_BYTES >> 20);
    printf("%8s %10s %10s %9s %9s %8s %9s %7s %7s %7s\n", "L", "fused ms", "ref ms", "ref/fused",
           "KV GB/s", "/triad", "1-thr GB/s", "rope", "alibi", "t5");
    struct attn_params one = prm[0];
    one.n_threads = 1;
    char err1[256];
    attn_ctx *ctx1 = attn_create(&one, err1, sizeof(err1));
    if (!ctx1) {
        fprintf(stderr, "bench_attention: %s\n", err1);
        return 1;
    }
    double ref_rate = 0; /* reference seconds per (head x key), from the first L */
    for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]); li++) {
        int L = Ls[li];
        struct batch b;
        batch_init(&b, L, 1);
        int calls = (int)(2e8 / ((double)L * 4096)) + 2; /* ~200 MB of K/V per trial */
        double t[4], t1;
        time_schemes(ctx, 4, &pool, &b, L, calls, 3, true, true, t);
        time_schemes(&ctx1, 1, &pool, &b, L, calls, 2, true, true, &t1);
        const double bytes = (double)L * KVH * D * 2 * 2;
        double gbs = bytes / t[0] / 1e9;
        char refcol[32] = "skipped", ratio[32] = "-";
        double est = ref_rate * (double)H * L;
        if (ref_rate == 0 || est < 3.0) {
            double tr = time_reference(&prm[0], &pool, &b, L);
            if (tr > 0) {
                ref_rate = tr / ((double)H * L);
                snprintf(refcol, sizeof(refcol), "%.1f", tr * 1e3);
                snprintf(ratio, sizeof(ratio), "%.1f", tr / t[0]);
            }
        }
        printf("%8d %10.3f %10s %9s %9.1f %8.2f %9.1f %7.2f %7.2f %7.2f\n", L, t[0] * 1e3, refcol,
               ratio, gbs, gbs / triad, bytes / t1 / 1e9, t[1] / t[0], t[2] / t[0], t[3] / t[0]);
        batch_free(&b);
    }
    attn_destroy(ctx1);

    /* --- prefill -------------------------------------------------------- */
    printf("\nprefill: a %d-query chunk (the last %d of the L cached tokens)\n", NQ_PREFILL,
           NQ_PREFILL);
    printf("%8s %10s %10s %9s %9s %8s %7s %7s %7s\n", "L", "fused ms", "ref ms", "ref/fused",
           "GFLOP/s", "/peak", "rope", "alibi", "t5");
    ref_rate = 0;
    for (size_t li = 0; li < sizeof(Ls) / sizeof(Ls[0]); li++) {
        int L = Ls[li];
        struct batch b;
        batch_init(&b, L, NQ_PREFILL);
        /* visible pairs: every query sees the history and the chunk up to itself */
        double pairs =
            (double)NQ_PREFILL * (L - NQ_PREFILL) + (double)NQ_PREFILL * (NQ_PREFILL + 1) / 2;
        double flops = 4.0 * H * D * pairs;
        bool all_schemes = L <= 16384;
        double t[4] = {0, 0, 0, 0};
        time_schemes(ctx, all_schemes ? 4 : 1, &pool, &b, L, 1, 2, false, L <= 4096, t);
        char refcol[32] = "skipped", ratio[32] = "-";
        double est = ref_rate * pairs;
        if (ref_rate == 0 || est < 3.0) {
            double tr = time_reference(&prm[0], &pool, &b, L);
            if (tr > 0) {
                ref_rate = tr / pairs;
                snprintf(refcol, sizeof(refcol), "%.0f", tr * 1e3);
                snprintf(ratio, sizeof(ratio), "%.1f", tr / t[0]);
            }
        }
        char r[3][16];
        for (int k = 1; k < 4; k++)
            snprintf(r[k - 1], sizeof(r[0]), all_schemes ? "%.2f" : "-", t[k] / t[0]);
        printf("%8d %10.1f %10s %9s %9.1f %8.2f %7s %7s %7s\n", L, t[0] * 1e3, refcol, ratio,
               flops / t[0] / 1e9, flops / t[0] / 1e9 / peak, r[0], r[1], r[2]);
        batch_free(&b);
    }
    printf("\nreference skipped where its time, extrapolated from the rows above, exceeds 3 s "
           "(it fits in memory everywhere: f32 copies of K and V, %.1f GiB at 128k)\n",
           (double)MAX_L * KVH * D * 4 * 2 / (1 << 30));
    printf("schemes beyond 16k prefill not timed (NONE only) to keep the run short\n");
    printf("targets: decode >= 0.70 of triad at L >= 16k; rope <= 1.3x none; alibi, t5 <= 1.1x "
           "none; prefill as a fraction of peak\n");
    printf("total %.0f s\n", bench_now() - t_start);

    for (int k = 0; k < 4; k++)
        attn_destroy(ctx[k]);
    free(pool.mem);
    return 0;
}
