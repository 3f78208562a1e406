/*
 * test_attention.c - the fused paged attention kernel: against the
 * reference over every position scheme, KV type, head size and batch
 * shape; its memory at 128k tokens; and bad input refused. The position
 * schemes alone are tested in test_posenc.c.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "attention/attention.h"
#include "tests/cpu_levels.h"

/* ------------------------------------------------------------------------
 * Kernel: fixtures
 *
 * A pool of pages holding two layers (the kernel is pointed at layer 1, so
 * k_offset and v_offset are not zero), random K and V in the chosen type,
 * sequences whose page tables are shuffled page ids, and positions that are
 * consecutive, holed, or shuffled.
 * ------------------------------------------------------------------------ */

#include "attention/attention_internal.h"

#include <stdio.h>

#define MAX_SEQS 6

enum pos_mode {
    POS_CONSECUTIVE, /* base + i */
    POS_HOLES,       /* 4 sinks at 0..3, then increasing with random gaps from 1000 */
    POS_SHUFFLED,    /* holes, then positions permuted (not sorted) */
};

/* A scheme by name: kind plus variant. */
enum scheme {
    S_NONE,
    S_ROPE_ADJ,       /* adjacent pairs, all dims rotated */
    S_ROPE_NEOX_HALF, /* NeoX halves, half the dims rotated */
    S_ALIBI,
    S_T5_CAUSAL,
    S_T5_BIDI,
    S_COUNT
};

static const char *const scheme_names[S_COUNT] = {"none",  "rope-adjacent", "rope-neox-half",
                                                  "alibi", "t5-causal",     "t5-bidi"};

struct kcase {
    enum scheme scheme;
    int head_dim, group, n_kv_head, page_tokens;
    enum attn_type type; /* of K, and of V unless split */
    bool split;          /* V in v_type instead */
    enum attn_type v_type;
    int n_seqs;
    int n_kv[MAX_SEQS], n_q[MAX_SEQS];
    enum pos_mode pos_mode;
    int32_t shift; /* added to every position */
    int threads;
    bool mass;
    bool skip_scalar; /* compare only the SIMD path (keeps the slow scalar runs few) */
    int window;       /* kv.sliding_window: 0 = none */
};

struct fixture {
    struct kcase c;
    struct attn_params params;
    float slopes[64];
    float *t5_table;
    uint8_t *pool;
    struct attn_kv kv;
    int32_t *page_table[MAX_SEQS], *pos[MAX_SEQS], *q_pos[MAX_SEQS];
    float *q[MAX_SEQS], *out[MAX_SEQS], *mass[MAX_SEQS];
    struct attn_seq seqs[MAX_SEQS];
};

static uint32_t rng_next(uint32_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static float rng_unit(uint32_t *s) /* [-1, 1) */
{
    return (float)(rng_next(s) >> 8) / 8388608.0f - 1.0f;
}

static void scheme_params(struct fixture *f, int n_head)
{
    struct pos_scheme *ps = &f->params.pos;
    memset(ps, 0, sizeof(*ps));
    uint32_t seed = 777;
    switch (f->c.scheme) {
    case S_NONE:
        ps->kind = POS_NONE;
        break;
    case S_ROPE_ADJ:
    case S_ROPE_NEOX_HALF:
        ps->kind = POS_ROPE;
        ps->rope_theta = 10000.0f;
        ps->rope_freq_scale = 1.0f;
        ps->rope_pairing = f->c.scheme == S_ROPE_ADJ ? POS_ROPE_ADJACENT : POS_ROPE_NEOX;
        ps->rope_dims = f->c.scheme == S_ROPE_ADJ ? f->c.head_dim : (f->c.head_dim / 2) & ~1;
        if (ps->rope_dims < 2)
            ps->rope_dims = 2;
        break;
    case S_ALIBI:
        ps->kind = POS_ALIBI;
        assert_int_equal(pos_alibi_slopes(f->slopes, n_head, 8.0f), 0);
        ps->alibi_slopes = f->slopes;
        break;
    case S_T5_CAUSAL:
    case S_T5_BIDI:
        ps->kind = POS_T5;
        ps->t5_num_buckets = 32;
        ps->t5_max_distance = 128;
        ps->t5_bidirectional = f->c.scheme == S_T5_BIDI;
        f->t5_table = malloc(sizeof(float) * 32 * (size_t)n_head);
        assert_non_null(f->t5_table);
        for (int i = 0; i < 32 * n_head; i++)
            f->t5_table[i] = 2.0f * rng_unit(&seed);
        ps->t5_table = f->t5_table;
        break;
    case S_COUNT:
        break;
    }
}

static void positions(int32_t *pos, int n, enum pos_mode mode, int32_t shift, uint32_t *seed)
{
    int32_t p = 0;
    for (int i = 0; i < n; i++) {
        if (mode == POS_CONSECUTIVE)
            p = i;
        else if (i < 4)
            p = i;
        else if (i == 4)
            p = 1000;
        else
            p += 1 + (int32_t)(rng_next(seed) % 40);
        pos[i] = p + shift;
    }
    if (mode == POS_SHUFFLED)
        for (int i = n - 1; i > 0; i--) {
            int j = (int)(rng_next(seed) % (uint32_t)(i + 1));
            int32_t t = pos[i];
            pos[i] = pos[j];
            pos[j] = t;
        }
}

static void fixture_init(struct fixture *f, const struct kcase *c)
{
    memset(f, 0, sizeof(*f));
    f->c = *c;
    uint32_t seed = 12345u + (uint32_t)c->scheme * 7919u + (uint32_t)c->head_dim * 31u +
                    (uint32_t)c->group * 131u + (uint32_t)c->page_tokens;
    const int n_head = c->group * c->n_kv_head, D = c->head_dim;
    f->params = (struct attn_params){.n_head = n_head,
                                     .n_kv_head = c->n_kv_head,
                                     .head_dim = D,
                                     .scale = 1.0f / sqrtf((float)D),
                                     .n_threads = c->threads};
    scheme_params(f, n_head);

    /* pool: enough pages for every sequence, plus spares so ids are sparse */
    int need = 0;
    for (int s = 0; s < c->n_seqs; s++)
        need += (c->n_kv[s] + c->page_tokens - 1) / c->page_tokens;
    int n_pages = need + 3;
    const enum attn_type vt = c->split ? c->v_type : c->type;
    const size_t krow = attn_row_bytes(c->type, D), vrow = attn_row_bytes(vt, D);
    assert_true(krow > 0 && vrow > 0);
    const int rows = c->n_kv_head * c->page_tokens;
    const size_t kblock = (size_t)rows * krow, vblock = (size_t)rows * vrow;
    size_t page_bytes = 2 * (kblock + vblock) + 64;
    f->pool = malloc(page_bytes * (size_t)n_pages);
    assert_non_null(f->pool);
    /* layer 1 (the one the kernel reads) random, everything else NaN */
    memset(f->pool, 0xff, page_bytes * (size_t)n_pages);
    float x[1024];
    for (int pg = 0; pg < n_pages; pg++) {
        uint8_t *layer1 = f->pool + (size_t)pg * page_bytes + kblock + vblock;
        for (int r = 0; r < 2 * rows; r++) {
            for (int d = 0; d < D; d++)
                x[d] = rng_unit(&seed);
            if (r < rows)
                attn_store_row(layer1 + (size_t)r * krow, x, D, c->type);
            else
                attn_store_row(layer1 + kblock + (size_t)(r - rows) * vrow, x, D, vt);
        }
    }
    f->kv = (struct attn_kv){.base = f->pool,
                             .page_bytes = page_bytes,
                             .k_offset = kblock + vblock,
                             .v_offset = 2 * kblock + vblock,
                             .page_tokens = c->page_tokens,
                             .k_type = c->type,
                             .v_type = vt,
                             .n_pages = n_pages,
                             .sliding_window = c->window};
    int *ids = malloc(sizeof(int) * (size_t)n_pages);
    assert_non_null(ids);
    for (int i = 0; i < n_pages; i++)
        ids[i] = i;
    for (int i = n_pages - 1; i > 0; i--) {
        int j = (int)(rng_next(&seed) % (uint32_t)(i + 1));
        int t = ids[i];
        ids[i] = ids[j];
        ids[j] = t;
    }
    int next = 0;
    for (int s = 0; s < c->n_seqs; s++) {
        int n_kv = c->n_kv[s], n_q = c->n_q[s];
        int np = (n_kv + c->page_tokens - 1) / c->page_tokens;
        f->page_table[s] = malloc(sizeof(int32_t) * (size_t)(np + 1));
        f->pos[s] = malloc(sizeof(int32_t) * (size_t)(n_kv + 1));
        f->q_pos[s] = malloc(sizeof(int32_t) * (size_t)(n_q + 1));
        f->q[s] = malloc(sizeof(float) * (size_t)(n_q * n_head * D + 1));
        f->out[s] = malloc(sizeof(float) * (size_t)(n_q * n_head * D + 1));
        f->mass[s] = malloc(sizeof(float) * (size_t)(n_kv + 1));
        assert_true(f->page_table[s] && f->pos[s] && f->q_pos[s] && f->q[s] && f->out[s] &&
                    f->mass[s]);
        for (int i = 0; i < np; i++)
            f->page_table[s][i] = ids[next++];
        positions(f->pos[s], n_kv, c->pos_mode, c->shift, &seed);
        /* the queries are the last n_q cached tokens (a prefill chunk or a decode step) */
        for (int i = 0; i < n_q; i++) {
            int k = n_kv - n_q + i;
            f->q_pos[s][i] = k >= 0 ? f->pos[s][k] : c->shift + i;
        }
        if (c->pos_mode == POS_SHUFFLED)
            for (int i = 0; i < n_q; i++) /* a spread of positions, not just the last */
                f->q_pos[s][i] =
                    n_kv ? f->pos[s][(int)(rng_next(&seed) % (uint32_t)n_kv)] : c->shift;
        for (int i = 0; i < n_q * n_head * D; i++)
            f->q[s][i] = rng_unit(&seed);
        f->seqs[s] = (struct attn_seq){.page_table = f->page_table[s],
                                       .pos = f->pos[s],
                                       .n_kv = n_kv,
                                       .n_q = n_q,
                                       .q_pos = f->q_pos[s],
                                       .q = f->q[s],
                                       .out = f->out[s],
                                       .mass = c->mass ? f->mass[s] : NULL};
    }
    free(ids);
}

static void fixture_deinit(struct fixture *f)
{
    for (int s = 0; s < f->c.n_seqs; s++) {
        free(f->page_table[s]);
        free(f->pos[s]);
        free(f->q_pos[s]);
        free(f->q[s]);
        free(f->out[s]);
        free(f->mass[s]);
    }
    free(f->pool);
    free(f->t5_table);
}

/* Outputs and masses of one run, copied out of the fixture. */
struct result {
    float *out[MAX_SEQS], *mass[MAX_SEQS];
};

static void result_take(struct result *r, const struct fixture *f)
{
    int n_head = f->params.n_head, D = f->params.head_dim;
    for (int s = 0; s < f->c.n_seqs; s++) {
        size_t no = (size_t)f->c.n_q[s] * n_head * D, nm = (size_t)f->c.n_kv[s];
        r->out[s] = malloc(sizeof(float) * (no + 1));
        r->mass[s] = malloc(sizeof(float) * (nm + 1));
        assert_true(r->out[s] && r->mass[s]);
        memcpy(r->out[s], f->out[s], sizeof(float) * no);
        memcpy(r->mass[s], f->mass[s], sizeof(float) * nm);
    }
}

static void result_free(struct result *r, int n_seqs)
{
    for (int s = 0; s < n_seqs; s++) {
        free(r->out[s]);
        free(r->mass[s]);
    }
}

static void run_reference(struct fixture *f, struct result *r)
{
    for (int s = 0; s < f->c.n_seqs; s++)
        memset(f->mass[s], 0xff, sizeof(float) * (size_t)f->c.n_kv[s]); /* NaN: must be written */
    assert_int_equal(attn_reference(&f->params, &f->kv, f->seqs, f->c.n_seqs), 0);
    result_take(r, f);
}

static attn_ctx *fused_ctx(const struct fixture *f, bool scalar)
{
    char err[256];
    struct attn_params p = f->params;
    p.force_scalar = scalar;
    attn_ctx *ctx = attn_create(&p, err, sizeof(err));
    if (!ctx)
        fail_msg("attn_create: %s", err);
    return ctx;
}

/* One attn_run of the fixture's batch on ctx, its outputs taken into r. */
static void run_on(attn_ctx *ctx, struct fixture *f, struct result *r)
{
    for (int s = 0; s < f->c.n_seqs; s++) {
        memset(f->out[s], 0xff,
               sizeof(float) * (size_t)f->c.n_q[s] * f->params.n_head * f->params.head_dim);
        memset(f->mass[s], 0xff, sizeof(float) * (size_t)f->c.n_kv[s]);
    }
    int rc = attn_run(ctx, &f->kv, f->seqs, f->c.n_seqs);
    if (rc)
        fail_msg("attn_run: %d %s", rc, attn_error(ctx));
    result_take(r, f);
}

static void run_fused(struct fixture *f, struct result *r, bool scalar)
{
    attn_ctx *ctx = fused_ctx(f, scalar);
    run_on(ctx, f, r);
    attn_destroy(ctx);
}

static void describe(const struct kcase *c, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%s d=%d group=%d kvh=%d page=%d K %s V %s threads=%d pos=%d+%d kv=",
                     scheme_names[c->scheme], c->head_dim, c->group, c->n_kv_head, c->page_tokens,
                     attn_type_name(c->type), attn_type_name(c->split ? c->v_type : c->type),
                     c->threads, (int)c->pos_mode, (int)c->shift);
    for (int s = 0; s < c->n_seqs && n > 0 && (size_t)n < len; s++)
        n += snprintf(buf + n, len - (size_t)n, "%d/%dq ", c->n_kv[s], c->n_q[s]);
}

/* Largest |a - b| over all outputs; NaN counts as infinite. */
static double max_out_diff(const struct fixture *f, const struct result *a, const struct result *b)
{
    double worst = 0;
    for (int s = 0; s < f->c.n_seqs; s++) {
        size_t n = (size_t)f->c.n_q[s] * f->params.n_head * f->params.head_dim;
        for (size_t i = 0; i < n; i++) {
            double d = fabs((double)a->out[s][i] - (double)b->out[s][i]);
            if (!(d <= worst))
                worst = isnan(d) ? INFINITY : d;
        }
    }
    return worst;
}

/* Largest relative difference of the masses, and check each sums to heads x seeing queries. */
static double max_mass_diff(const struct fixture *f, const struct result *a, const struct result *b)
{
    double worst = 0;
    for (int s = 0; s < f->c.n_seqs; s++) {
        for (int i = 0; i < f->c.n_kv[s]; i++) {
            double x = a->mass[s][i], y = b->mass[s][i];
            double d = fabs(x - y) / (fabs(y) > 1 ? fabs(y) : 1);
            if (!(d <= worst))
                worst = isnan(d) ? INFINITY : d;
        }
    }
    return worst;
}

static void check_mass_sums(const struct fixture *f, const struct result *r)
{
    for (int s = 0; s < f->c.n_seqs; s++) {
        int seeing = 0; /* queries that see at least one key */
        for (int i = 0; i < f->c.n_q[s]; i++) {
            bool any = false;
            for (int k = 0; k < f->c.n_kv[s] && !any; k++)
                any = f->pos[s][k] <= f->q_pos[s][i];
            seeing += any;
        }
        double sum = 0;
        for (int k = 0; k < f->c.n_kv[s]; k++)
            sum += r->mass[s][k];
        double want = (double)f->params.n_head * seeing;
        if (fabs(sum - want) > 1e-4 * (want > 1 ? want : 1))
            fail_msg("mass of sequence %d sums to %.6f, want %.0f", s, sum, want);
    }
}

#define TOL_OUT 1e-4  /* f32, f16 and bf16 alike: both kernels convert exactly */
#define TOL_MASS 1e-4 /* relative, per key */

/*
 * Fused against the reference on one case: at every SIMD kernel level the
 * CPU runs (each forced in turn, so an AVX-512 machine tests the AVX2 copy
 * too), and through the scalar table.
 */
static void check_case(const struct kcase *c)
{
    struct fixture f;
    fixture_init(&f, c);
    struct result ref, r;
    run_reference(&f, &ref);
    char what[256];
    describe(c, what, sizeof(what));
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_AVX2, levels);
    /* runs: each SIMD level, then (unless the case skips it) the scalar table */
    int n_runs = n_levels + (c->skip_scalar && n_levels ? 0 : 1);
    for (int i = 0; i < n_runs; i++) {
        bool scalar = i == n_levels;
        if (!scalar)
            cl_force(levels[i]);
        run_fused(&f, &r, scalar);
        const char *path = scalar ? "scalar" : attn_simd_name();
        double e = max_out_diff(&f, &r, &ref);
        if (!(e <= TOL_OUT))
            fail_msg("%s: max |fused - reference| = %g (%s)", what, e, path);
        if (c->mass) {
            double m = max_mass_diff(&f, &r, &ref);
            if (!(m <= TOL_MASS))
                fail_msg("%s: mass differs from the reference by %g (%s)", what, m, path);
            check_mass_sums(&f, &r);
        }
        result_free(&r, c->n_seqs);
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
    if (c->mass)
        check_mass_sums(&f, &ref);
    result_free(&ref, c->n_seqs);
    fixture_deinit(&f);
}

/* ------------------------------------------------------------------------
 * Kernel: fused = reference
 * ------------------------------------------------------------------------ */

static const int kLengths[5] = {1, 2, 17, 1000, 4099};
static const enum attn_type kTypes[3] = {ATTN_F32, ATTN_F16, ATTN_BF16};
/* K / V pairs of the quantised runs: both q8_0, q8_0 keys with q4_0 values, both q4_0 */
static const enum attn_type kQuantK[3] = {ATTN_Q8_0, ATTN_Q8_0, ATTN_Q4_0};
static const enum attn_type kQuantV[3] = {ATTN_Q8_0, ATTN_Q4_0, ATTN_Q4_0};

/* The n-th type of a rotation: float types, or (quant) the quantised pairs. */
static void set_types(struct kcase *c, bool quant, int n)
{
    if (!quant) {
        c->type = kTypes[n % 3];
        return;
    }
    c->type = kQuantK[n % 3];
    c->split = true;
    c->v_type = kQuantV[n % 3];
}

/*
 * Decode (one query) and a 3-query chunk over every scheme x head dim
 * {64, 128} x GQA {1, 3, 4, 8} x page {1, 16, 64} (a decode step at GQA 3,
 * SmolLM's, takes the three-row block of qk); the lengths, KV types and
 * thread counts (1, 2, 3) rotate through the grid so every scheme meets
 * every length. The quantised grid is the same over q8_0 / q4_0 pairs: the
 * reference dequantises, so fused and reference see the same values.
 */
static void run_grid(bool quant)
{
    const int dims[2] = {64, 128}, groups[4] = {1, 3, 4, 8}, pages[3] = {1, 16, 64};
    int n = 0;
    for (int sc = 0; sc < S_COUNT; sc++)
        for (int di = 0; di < 2; di++)
            for (int gi = 0; gi < 4; gi++)
                for (int pi = 0; pi < 3; pi++)
                    for (int rep = 0; rep < 2; rep++, n++) {
                        struct kcase c = {
                            .scheme = (enum scheme)sc,
                            .head_dim = dims[di],
                            .group = groups[gi],
                            .n_kv_head = 2,
                            .page_tokens = pages[pi],
                            .n_seqs = 1,
                            .n_kv = {kLengths[(n + sc) % 5]},
                            .n_q = {rep == 0 ? 1 : 3},
                            .threads = 1 + n % 3,
                            .mass = n % 2 == 0,
                            .skip_scalar = (n / 2) % 2 == 1,
                        };
                        set_types(&c, quant, n);
                        if (c.n_q[0] > c.n_kv[0])
                            c.n_q[0] = c.n_kv[0];
                        check_case(&c);
                    }
}

static void test_kernel_grid(void **state)
{
    (void)state;
    run_grid(false);
}

static void test_kernel_grid_quant(void **state)
{
    (void)state;
    run_grid(true);
}

/*
 * A 512-query prefill chunk: over 600 cached tokens (a fresh prompt plus a
 * little history) for every scheme, and over 4099 for RoPE and T5.
 */
static void test_kernel_prefill_chunk(void **state)
{
    (void)state;
    for (int sc = 0; sc < 2 * S_COUNT; sc++) { /* float types, then quantised */
        struct kcase c = {.scheme = (enum scheme)(sc % S_COUNT),
                          .head_dim = sc % 2 ? 128 : 64,
                          .group = sc % 2 ? 1 : 4,
                          .n_kv_head = sc % 2 ? 2 : 1,
                          .page_tokens = 16,
                          .n_seqs = 1,
                          .n_kv = {600},
                          .n_q = {512},
                          .threads = 1 + sc % 3,
                          .mass = sc % 2 == 1};
        set_types(&c, sc >= S_COUNT, sc);
        if (sc % 2) /* keep the reference's work modest: 2 heads of 128 */
            c.group = 1, c.n_kv_head = 2;
        check_case(&c);
    }
    struct kcase big = {.scheme = S_ROPE_ADJ,
                        .head_dim = 64,
                        .group = 2,
                        .n_kv_head = 1,
                        .page_tokens = 16,
                        .type = ATTN_F16,
                        .n_seqs = 1,
                        .n_kv = {4099},
                        .n_q = {512},
                        .threads = 2,
                        .mass = true};
    big.skip_scalar = true;
    check_case(&big);
    big.scheme = S_T5_CAUSAL;
    big.type = ATTN_BF16;
    big.threads = 3;
    big.page_tokens = 64;
    big.group = 1;
    big.mass = false;
    check_case(&big);
    big.scheme = S_ROPE_NEOX_HALF; /* quantised keys rotated by the kernel, many rows */
    set_types(&big, true, 1);
    big.mass = true;
    check_case(&big);
}

/*
 * Sliding windows (Mistral, Gemma's local layers) masked in the tile loop:
 * windows of 1 (a query sees only itself), inside a tile, across tiles and
 * pages, and longer than the cache, for every scheme, over consecutive,
 * gapped and shuffled positions, decode steps beside a prefill chunk.
 */
static void test_kernel_sliding_window(void **state)
{
    (void)state;
    const int windows[4] = {1, 7, 100, 5000};
    for (int sc = 0; sc < S_COUNT; sc++)
        for (int w = 0; w < 4; w++) {
            struct kcase c = {.scheme = (enum scheme)sc,
                              .head_dim = 64,
                              .group = 2,
                              .n_kv_head = 2,
                              .page_tokens = 16,
                              .type = w % 2 ? ATTN_F16 : ATTN_F32,
                              .n_seqs = 3,
                              .n_kv = {300, 37, 1},
                              .n_q = {40, 1, 1},
                              .pos_mode = (enum pos_mode)(w % 3),
                              .threads = 1 + (sc + w) % 3,
                              .mass = w < 2,
                              .window = windows[w]};
            check_case(&c);
        }
    /* a negative window is a malformed batch */
    struct kcase c = {.scheme = S_NONE, .head_dim = 32, .group = 1, .n_kv_head = 1,
                      .page_tokens = 4, .n_seqs = 1, .n_kv = {3}, .n_q = {1}, .threads = 1,
                      .window = -2};
    struct fixture f;
    fixture_init(&f, &c);
    assert_int_equal(attn_reference(&f.params, &f.kv, f.seqs, 1), -EINVAL);
    char err[128];
    attn_ctx *ctx = attn_create(&f.params, err, sizeof(err));
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), -EINVAL);
    assert_non_null(strstr(attn_error(ctx), "sliding_window"));
    attn_destroy(ctx);
    fixture_deinit(&f);
}

/* Several sequences of very different lengths in one call: decode steps and a chunk. */
static void test_kernel_mixed_batch(void **state)
{
    (void)state;
    for (int sc = 0; sc < 2 * S_COUNT; sc++) {
        struct kcase c = {.scheme = (enum scheme)(sc % S_COUNT),
                          .head_dim = 64,
                          .group = 4,
                          .n_kv_head = 2,
                          .page_tokens = 16,
                          .n_seqs = 6,
                          .n_kv = {4099, 1, 17, 2, 1000, 300},
                          .n_q = {1, 1, 1, 2, 64, 0},
                          .threads = 1 + sc % 3,
                          .mass = true};
        set_types(&c, sc >= S_COUNT, sc);
        check_case(&c);
    }
}

/* Head dims beyond 64/128, with tails for every vector width (40 pairs, 20 pairs). */
static void test_kernel_head_dims(void **state)
{
    (void)state;
    const int dims[7] = {80, 96, 256, 40, 4, 32, 160};
    const enum scheme schemes[3] = {S_NONE, S_ROPE_ADJ, S_ROPE_NEOX_HALF};
    int n = 0;
    for (int quant = 0; quant < 2; quant++)
        for (int di = 0; di < 7; di++)
            for (int si = 0; si < 3; si++, n++) {
                if (quant && dims[di] % 32)
                    continue; /* q8_0 / q4_0 refuse such heads (test_kernel_quant_refused) */
                struct kcase c = {.scheme = schemes[si],
                                  .head_dim = dims[di],
                                  .group = 4,
                                  .n_kv_head = 2,
                                  .page_tokens = 16,
                                  .n_seqs = 2,
                                  .n_kv = {1000, 77},
                                  .n_q = {1, 9},
                                  .threads = 1 + n % 3,
                                  .mass = true};
                set_types(&c, quant, n);
                check_case(&c);
            }
}

/* Holes (sinks + window, random gaps) and shuffled positions: same as the reference. */
static void test_kernel_gaps(void **state)
{
    (void)state;
    for (int sc = 0; sc < 2 * S_COUNT; sc++) {
        for (int mode = POS_HOLES; mode <= POS_SHUFFLED; mode++) {
            struct kcase c = {.scheme = (enum scheme)(sc % S_COUNT),
                              .head_dim = 64,
                              .group = 4,
                              .n_kv_head = 2,
                              .page_tokens = 16,
                              .n_seqs = 2,
                              .n_kv = {3000, 200},
                              .n_q = {1, 20},
                              .pos_mode = (enum pos_mode)mode,
                              .threads = 2 + sc % 2,
                              .mass = true};
            set_types(&c, sc >= S_COUNT, sc + mode);
            check_case(&c);
        }
    }
}

/*
 * Adding a constant to every position leaves the output unchanged: exactly
 * for NONE, ALiBi and T5 (they see only differences), within 1e-4 for RoPE
 * at shifts up to 10^5 (and beyond: 2^24).
 */
static void test_kernel_translation(void **state)
{
    (void)state;
    const int32_t shifts[] = {1, 977, 4096, 100000, 16777216};
    for (int sc = 0; sc < S_COUNT; sc++) {
        struct kcase c = {.scheme = (enum scheme)sc,
                          .head_dim = 64,
                          .group = 4,
                          .n_kv_head = 2,
                          .page_tokens = 16,
                          .type = ATTN_F16,
                          .n_seqs = 2,
                          .n_kv = {1500, 200},
                          .n_q = {1, 8},
                          .pos_mode = sc % 2 ? POS_HOLES : POS_CONSECUTIVE,
                          .threads = 2,
                          .mass = true};
        struct fixture f0;
        fixture_init(&f0, &c);
        struct result ref0;
        run_reference(&f0, &ref0);
        for (int scalar = 0; scalar < 2; scalar++) {
            c.shift = 0;
            struct result r0;
            run_fused(&f0, &r0, scalar);
            for (size_t i = 0; i < sizeof(shifts) / sizeof(shifts[0]); i++) {
                c.shift = shifts[i];
                struct fixture f1;
                fixture_init(&f1, &c);
                struct result r1;
                run_fused(&f1, &r1, scalar);
                double d = max_out_diff(&f0, &r0, &r1);
                double dm = max_mass_diff(&f0, &r0, &r1);
                double dref = max_out_diff(&f0, &ref0, &r1);
                double tol = f0.params.pos.kind == POS_ROPE ? 1e-4 : 0.0;
                if (!(d <= tol) || !(dm <= (tol ? 1e-4 : 0.0)) || !(dref <= 1e-4))
                    fail_msg("%s %s shift %d: output moved by %g (mass %g, vs reference %g)",
                             scheme_names[sc], scalar ? "scalar" : attn_simd_name(), (int)shifts[i],
                             d, dm, dref);
                result_free(&r1, c.n_seqs);
                fixture_deinit(&f1);
            }
            result_free(&r0, c.n_seqs);
        }
        result_free(&ref0, c.n_seqs);
        fixture_deinit(&f0);
    }
}

/*
 * A context keeps the queries' RoPE angles between calls (the layers of a
 * forward pass repeat the positions): a call whose queries sit at other
 * positions, or are more or fewer, must give bit for bit what a fresh
 * context gives. Calls alternate between a batch and the same batch
 * shifted, then a larger batch, on one context.
 */
static void test_kernel_context_reused(void **state)
{
    (void)state;
    for (int sc = S_ROPE_ADJ; sc <= S_ROPE_NEOX_HALF; sc++) {
        struct kcase c = {.scheme = (enum scheme)sc,
                          .head_dim = 64,
                          .group = 3,
                          .n_kv_head = 3,
                          .page_tokens = 16,
                          .type = ATTN_F16,
                          .n_seqs = 2,
                          .n_kv = {700, 300},
                          .n_q = {1, 40},
                          .pos_mode = POS_CONSECUTIVE,
                          .threads = 2,
                          .mass = false};
        struct fixture f[3];
        fixture_init(&f[0], &c);
        c.shift = 977;
        fixture_init(&f[1], &c);
        c.n_q[0] = 5;
        c.n_q[1] = 90;
        fixture_init(&f[2], &c);
        attn_ctx *ctx = fused_ctx(&f[0], false);
        const int order[] = {0, 1, 0, 2, 1, 2, 0};
        for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
            struct fixture *fx = &f[order[i]];
            struct result kept, fresh;
            run_on(ctx, fx, &kept);
            run_fused(fx, &fresh, false);
            double d = max_out_diff(fx, &kept, &fresh);
            if (!(d == 0.0))
                fail_msg("%s call %zu (batch %d) on a reused context differs from a fresh one by %g",
                         scheme_names[sc], i, order[i], d);
            result_free(&kept, fx->c.n_seqs);
            result_free(&fresh, fx->c.n_seqs);
        }
        attn_destroy(ctx);
        for (int i = 0; i < 3; i++)
            fixture_deinit(&f[i]);
    }
}

/*
 * Two cached tokens at positions 0 and 1, a T5 table whose past and future
 * buckets differ, all logits zero except the bias. A query at position 1
 * sees key 0 one step behind (past bucket 1) and key 1 at offset 0; a query
 * at position 0 must not see key 1 at all, although its future bucket
 * (bidirectional: 17) carries a large bias.
 */
static void test_kernel_t5_two_token_sign(void **state)
{
    (void)state;
    for (int bidi = 0; bidi < 2; bidi++) {
        for (int path = 0; path < 3; path++) { /* simd, scalar, reference */
            enum { D = 4, NB = 32 };
            float table[NB] = {0};
            table[0] = 0.25f; /* offset 0 */
            table[1] = 1.5f;  /* one step behind */
            table[17] = 9.0f; /* one step ahead, bidirectional tables only */
            if (!bidi)
                table[0] = 0.25f;
            float pool[2 * 2 * D]; /* one page of 2 tokens: K then V */
            memset(pool, 0, sizeof(pool));
            pool[2 * D + 0] = 1.0f;     /* v0 = e0 */
            pool[2 * D + D + 1] = 1.0f; /* v1 = e1 */
            int32_t page_table[1] = {0}, pos[2] = {0, 1}, q_pos[2] = {1, 0};
            float q[2 * D] = {0}, out[2 * D], mass[2];
            struct attn_kv kv = {.base = (const uint8_t *)pool,
                                 .page_bytes = sizeof(pool),
                                 .k_offset = 0,
                                 .v_offset = 2 * D * sizeof(float),
                                 .page_tokens = 2,
                                 .k_type = ATTN_F32,
                                 .v_type = ATTN_F32,
                                 .n_pages = 1};
            struct attn_seq seq = {.page_table = page_table,
                                   .pos = pos,
                                   .n_kv = 2,
                                   .n_q = 2,
                                   .q_pos = q_pos,
                                   .q = q,
                                   .out = out,
                                   .mass = mass};
            struct attn_params p = {.n_head = 1,
                                    .n_kv_head = 1,
                                    .head_dim = D,
                                    .scale = 0.5f,
                                    .n_threads = 1 + path % 2,
                                    .force_scalar = path == 1};
            p.pos = (struct pos_scheme){.kind = POS_T5,
                                        .t5_table = table,
                                        .t5_num_buckets = NB,
                                        .t5_max_distance = 128,
                                        .t5_bidirectional = bidi};
            if (path == 2) {
                assert_int_equal(attn_reference(&p, &kv, &seq, 1), 0);
            } else {
                char err[128];
                attn_ctx *ctx = attn_create(&p, err, sizeof(err));
                assert_non_null(ctx);
                assert_int_equal(attn_run(ctx, &kv, &seq, 1), 0);
                attn_destroy(ctx);
            }
            /* query at 1: weights e^1.5 (key 0, past) and e^0.25 (key 1, same position) */
            double w0 = exp(1.5), w1 = exp(0.25);
            assert_float_equal(out[0], w0 / (w0 + w1), 1e-6);
            assert_float_equal(out[1], w1 / (w0 + w1), 1e-6);
            /* query at 0: key 1 is ahead and masked, whatever its bucket's bias */
            assert_float_equal(out[D + 0], 1.0f, 1e-6);
            assert_true(out[D + 1] == 0.0f);
            assert_float_equal(mass[0], w0 / (w0 + w1) + 1.0, 1e-6);
            assert_float_equal(mass[1], w1 / (w0 + w1), 1e-6);
        }
    }
}

/* A query that sees no key gets zeros and adds no mass; an empty sequence is fine. */
static void test_kernel_nothing_visible(void **state)
{
    (void)state;
    struct kcase c = {.scheme = S_ROPE_NEOX_HALF,
                      .head_dim = 64,
                      .group = 4,
                      .n_kv_head = 2,
                      .page_tokens = 16,
                      .type = ATTN_F32,
                      .n_seqs = 2,
                      .n_kv = {100, 0},
                      .n_q = {2, 1},
                      .threads = 2,
                      .mass = true};
    struct fixture f;
    fixture_init(&f, &c);
    for (int i = 0; i < 100; i++)
        f.pos[0][i] = 50 + i;
    f.q_pos[0][0] = 10; /* before every key */
    f.q_pos[0][1] = 60;
    struct result ref, fused;
    run_reference(&f, &ref);
    run_fused(&f, &fused, false);
    assert_true(max_out_diff(&f, &fused, &ref) <= TOL_OUT);
    assert_true(max_mass_diff(&f, &fused, &ref) <= TOL_MASS);
    for (int i = 0; i < 8 * 64; i++) {
        assert_true(fused.out[0][i] == 0.0f); /* query 0, every head */
        assert_true(fused.out[1][i] == 0.0f); /* the sequence with no keys */
    }
    check_mass_sums(&f, &fused);
    result_free(&ref, 2);
    result_free(&fused, 2);
    fixture_deinit(&f);
}

/* ------------------------------------------------------------------------
 * Kernel: memory
 * ------------------------------------------------------------------------ */

static size_t rss_bytes(void)
{
    FILE *fp = fopen("/proc/self/statm", "r");
    if (!fp)
        return 0;
    unsigned long size = 0, resident = 0;
    int n = fscanf(fp, "%lu %lu", &size, &resident);
    fclose(fp);
    return n == 2 ? resident * 4096ul : 0;
}

/*
 * A decode over 128k cached tokens (f16, 2 KV heads x 64 dims, pages of 16)
 * allocates nothing beyond what a decode over 1k tokens needed: the
 * context's workspace is the same and RSS grows by less than 4 MiB.
 */
static void test_kernel_memory_128k(void **state)
{
    (void)state;
    if (!rss_bytes()) {
        print_message("no /proc/self/statm: skipping the RSS check\n");
        skip();
    }
    enum { N = 131072, PT = 16, KVH = 2, D = 64, H = 8 };
    const size_t block = (size_t)KVH * PT * D * 2, page_bytes = 2 * block;
    const int n_pages = N / PT;
    uint16_t *pool = malloc(page_bytes * n_pages);
    int32_t *page_table = malloc(sizeof(int32_t) * n_pages), *pos = malloc(sizeof(int32_t) * N);
    float *mass = malloc(sizeof(float) * N), q[H * D], out[H * D];
    assert_true(pool && page_table && pos && mass);
    uint32_t seed = 99;
    uint16_t pattern[4099]; /* random halves, repeated with an odd period over the pool */
    for (int i = 0; i < 4099; i++)
        pattern[i] = attn_f32_to_f16(rng_unit(&seed));
    for (size_t i = 0; i < page_bytes * n_pages / 2; i += 4099) /* touches every page */
        memcpy(pool + i, pattern,
               sizeof(uint16_t) *
                   (page_bytes * n_pages / 2 - i < 4099 ? page_bytes * n_pages / 2 - i : 4099));
    for (int i = 0; i < n_pages; i++)
        page_table[i] = n_pages - 1 - i;
    for (int i = 0; i < N; i++)
        pos[i] = i;
    memset(mass, 0, sizeof(float) * N);
    for (int i = 0; i < H * D; i++)
        q[i] = rng_unit(&seed);

    struct attn_params p = {
        .n_head = H, .n_kv_head = KVH, .head_dim = D, .scale = 0.125f, .n_threads = 2};
    p.pos = (struct pos_scheme){
        .kind = POS_ROPE, .rope_theta = 10000.0f, .rope_dims = D, .rope_freq_scale = 1.0f};
    char err[128];
    attn_ctx *ctx = attn_create(&p, err, sizeof(err));
    assert_non_null(ctx);
    struct attn_kv kv = {.base = (const uint8_t *)pool,
                         .page_bytes = page_bytes,
                         .k_offset = 0,
                         .v_offset = block,
                         .page_tokens = PT,
                         .k_type = ATTN_F16,
                         .v_type = ATTN_F16,
                         .n_pages = n_pages};
    int32_t q_pos = 1023;
    struct attn_seq seq = {.page_table = page_table,
                           .pos = pos,
                           .n_kv = 1024,
                           .n_q = 1,
                           .q_pos = &q_pos,
                           .q = q,
                           .out = out,
                           .mass = mass};
    assert_int_equal(attn_run(ctx, &kv, &seq, 1), 0);
    size_t ws_1k = attn_workspace_bytes(ctx);

    size_t rss0 = rss_bytes();
    seq.n_kv = N;
    q_pos = N - 1;
    assert_int_equal(attn_run(ctx, &kv, &seq, 1), 0);
    size_t rss1 = rss_bytes();
    size_t ws_128k = attn_workspace_bytes(ctx);

    print_message("decode over %d tokens: workspace %zu bytes (1k: %zu), RSS %+ld KiB\n", N,
                  ws_128k, ws_1k, ((long)rss1 - (long)rss0) / 1024);
    assert_int_equal(ws_128k, ws_1k);
    assert_true(rss1 < rss0 + 4u * 1024 * 1024);
    /* the answer is real: the mass of 128k keys sums to the 8 heads */
    double sum = 0;
    for (int i = 0; i < N; i++)
        sum += mass[i];
    assert_float_equal(sum, (double)H, 1e-3);
    attn_destroy(ctx);
    free(pool);
    free(page_table);
    free(pos);
    free(mass);
}

/* ------------------------------------------------------------------------
 * Kernel: bad input
 * ------------------------------------------------------------------------ */

/*
 * q8_0 and q4_0 rows: the block layout of attention.h, the scale rule,
 * every element within half a level of its input, q4_0's largest magnitude
 * exactly -8 levels, inf/NaN blocks read back as NaN, an all-zero block as
 * zeros.
 */
static void test_kernel_quant_rows(void **state)
{
    (void)state;
    uint32_t seed = 99;
    float x[64], y[64];
    uint8_t row[68];
    for (int rep = 0; rep < 200; rep++) {
        float mag = rep % 2 ? 1e-3f : 40.0f;
        for (int i = 0; i < 64; i++)
            x[i] = mag * rng_unit(&seed);
        for (int t = 0; t < 2; t++) {
            enum attn_type type = t ? ATTN_Q4_0 : ATTN_Q8_0;
            attn_store_row(row, x, 64, type);
            attn_load_row(y, row, 64, type);
            size_t bb = attn_row_bytes(type, 32);
            for (int b = 0; b < 2; b++) {
                float amax = 0, vmax = 0;
                for (int i = 0; i < 32; i++)
                    if (fabsf(x[32 * b + i]) > amax)
                        amax = fabsf(x[32 * b + i]), vmax = x[32 * b + i];
                uint16_t h = (uint16_t)(row[b * bb] | (row[b * bb + 1] << 8));
                float d = attn_f16_to_f32(h);
                float want = t ? vmax / -8.0f : amax / 127.0f;
                assert_true(h == attn_f32_to_f16(want));
                /* half a level, or the clip of the top level (127 for q8_0 whose f16 scale
                 * rounded down; 7 for q4_0 on the side opposite its largest magnitude) */
                float top = t ? 7.0f : 127.0f;
                for (int i = 0; i < 32; i++) {
                    float xi = x[32 * b + i], tol = fabsf(d) * 0.5001f;
                    if (fabsf(xi) - top * fabsf(d) > tol)
                        tol = fabsf(xi) - top * fabsf(d) + 1e-6f * fabsf(xi);
                    assert_true(fabsf(y[32 * b + i] - xi) <= tol);
                }
                if (t) { /* the largest magnitude is level -8 (nibble 0) */
                    for (int i = 0; i < 32; i++)
                        if (x[32 * b + i] == vmax)
                            assert_true(y[32 * b + i] == -8.0f * d);
                }
            }
        }
    }
    assert_int_equal(attn_row_bytes(ATTN_Q8_0, 64), 68);
    assert_int_equal(attn_row_bytes(ATTN_Q4_0, 64), 36);
    assert_int_equal(attn_row_bytes(ATTN_Q4_0, 48), 0);
    assert_int_equal(attn_row_bytes(ATTN_F16, 48), 96);
    assert_int_equal(attn_type_block(ATTN_Q8_0), 32);
    assert_int_equal(attn_type_block(ATTN_BF16), 1);
    assert_string_equal(attn_type_name(ATTN_Q4_0), "q4_0");
    /* q4_0 nibble order: element i < 16 in the low nibble of byte i, i >= 16 high of i - 16 */
    for (int i = 0; i < 32; i++)
        x[i] = i == 3 ? -8.0f : i == 20 ? 7.0f : 0.0f;
    attn_store_row(row, x, 32, ATTN_Q4_0);
    assert_true(attn_f16_to_f32((uint16_t)(row[0] | (row[1] << 8))) == 1.0f);
    assert_int_equal(row[2 + 3], 0x80); /* element 3: level -8 = nibble 0; element 19: 8 */
    assert_int_equal(row[2 + 4], 0xf8); /* element 4: 0 -> 8; element 20: 7 -> 15 */
    /* zeros, and a block with NaN or inf reads back NaN (as f16 would keep them) */
    memset(x, 0, sizeof(x));
    for (int t = 0; t < 2; t++) {
        enum attn_type type = t ? ATTN_Q4_0 : ATTN_Q8_0;
        attn_store_row(row, x, 64, type);
        attn_load_row(y, row, 64, type);
        for (int i = 0; i < 64; i++)
            assert_true(y[i] == 0.0f);
        x[5] = NAN;
        x[40] = INFINITY;
        attn_store_row(row, x, 64, type);
        attn_load_row(y, row, 64, type);
        assert_true(isnan(y[0]) && isnan(y[31]) && isnan(y[32]));
        x[5] = x[40] = 0.0f;
    }
}

/*
 * The integer scores of q8_0 keys, on every path this CPU has, against
 * f32 dot products of the dequantised keys: the two-level query leaves at
 * most 2^-16 of each block's largest query element, so scores agree to
 * about 1e-5 of their size. Head sizes with an odd block count (32, 96)
 * take the tail of the two-block path.
 */
static void test_kernel_q8_scores(void **state)
{
    (void)state;
    static const char *const paths[3] = {"avx512-vnni", "avx2", "scalar"};
    const int dims[4] = {32, 64, 96, 256};
    uint32_t seed = 4242;
    float q[4][256], k[ATTN_TILE][256], S[4 * ATTN_TILE];
    uint8_t rows[ATTN_TILE][8 * 34], u1[4][256], u2[4][256];
    int16_t a16[4][256];
    float d[4][8];
    const void *kp[ATTN_TILE];
    struct attn_q8row q8[4];
    for (int di = 0; di < 4; di++) {
        const int D = dims[di];
        for (int r = 0; r < 4; r++) {
            for (int i = 0; i < D; i++)
                q[r][i] = (r == 3 ? 1e-3f : 0.2f) * rng_unit(&seed);
            q8[r] = (struct attn_q8row){.u1 = u1[r], .u2 = u2[r], .a16 = a16[r], .d = d[r]};
            attn_q8_query(&q8[r], q[r], D);
        }
        for (int t = 0; t < ATTN_TILE; t++) {
            for (int i = 0; i < D; i++)
                k[t][i] = (t % 5 == 0 ? 30.0f : 1.0f) * rng_unit(&seed);
            attn_store_row(rows[t], k[t], D, ATTN_Q8_0);
            attn_load_row(k[t], rows[t], D, ATTN_Q8_0); /* the values the cache holds */
            kp[t] = rows[t];
        }
        for (int pi = 0; pi < 3; pi++) {
            attn_qk_q8_fn fn = attn_q8_path(paths[pi]);
            if (!fn) {
                print_message("  q8_0 scores: %s not on this CPU\n", paths[pi]);
                continue;
            }
            const int nt = ATTN_TILE - 3;
            fn(S, q8, 4, kp, nt, D);
            for (int r = 0; r < 4; r++)
                for (int t = 0; t < nt; t++) {
                    double want = 0, mag = 0;
                    for (int i = 0; i < D; i++) {
                        want += (double)q[r][i] * k[t][i];
                        mag += fabs((double)q[r][i] * k[t][i]);
                    }
                    double got = S[r * ATTN_TILE + t];
                    if (!(fabs(got - want) <= 2e-5 * mag + 1e-9))
                        fail_msg("%s D=%d row %d key %d: %.9g, want %.9g (sum |q k| %.3g)",
                                 paths[pi], D, r, t, got, want, mag);
                }
        }
    }
    assert_non_null(attn_q8_path("scalar"));
    assert_null(attn_q8_path("neon"));
    print_message("  q8_0 scores run on %s\n", attn_q8_name());
}

/*
 * The keys' RoPE angles (attn_rope.c): every level's copy gives the scalar
 * copy's bits, for pair counts 1..64 and positions that cross 64- and
 * 4096-blocks, jump (holes) and go back (shuffled), and each is within a
 * few float roundings of cos/sin in double.
 */
static void test_kernel_rope_angles(void **state)
{
    (void)state;
    enum { NPOS = 300, HMAX = 64 };
    static const char *const levels[3] = {"scalar", "avx2", "avx512"};
    static int32_t pos[NPOS];
    static float lo_c[ATTN_ROPE_LO * HMAX], lo_s[ATTN_ROPE_LO * HMAX];
    static float hi_c[ATTN_ROPE_LO * HMAX], hi_s[ATTN_ROPE_LO * HMAX];
    static float cs[3][NPOS * HMAX], sn[3][NPOS * HMAX];
    double theta[HMAX];
    float st_mem[3][4][HMAX];
    uint32_t seed = 99;
    for (int i = 0; i < NPOS; i++) /* runs across block edges, holes, a step back, 128k+ */
        pos[i] = i < 100   ? 4000 + i
                 : i < 200 ? 8190 + 37 * (i - 100)
                 : i < 250 ? (int32_t)(rng_next(&seed) % 200000)
                           : 131000 + (i - 250);
    const int halves[6] = {1, 3, 16, 32, 33, 64};
    for (int hi_ = 0; hi_ < 6; hi_++) {
        const int half = halves[hi_];
        for (int i = 0; i < half; i++)
            theta[i] = pow(10000.0, -2.0 * i / (2.0 * half));
        for (int j = 0; j < ATTN_ROPE_LO; j++)
            for (int i = 0; i < half; i++) {
                lo_c[j * half + i] = (float)cos(j * theta[i]);
                lo_s[j * half + i] = (float)sin(j * theta[i]);
                hi_c[j * half + i] = (float)cos(j * ATTN_ROPE_LO * theta[i]);
                hi_s[j * half + i] = (float)sin(j * ATTN_ROPE_LO * theta[i]);
            }
        struct attn_rope_tabs tb = {half, theta, lo_c, lo_s, hi_c, hi_s};
        for (int lv = 0; lv < 3; lv++) {
            attn_rope_fn fn = attn_rope_path(levels[lv]);
            if (!fn) {
                memcpy(cs[lv], cs[0], sizeof(cs[0]));
                memcpy(sn[lv], sn[0], sizeof(sn[0]));
                continue;
            }
            struct attn_rope_state st = {st_mem[lv][0], st_mem[lv][1], st_mem[lv][2],
                                         st_mem[lv][3], -1, -1};
            for (int t0 = 0; t0 < NPOS; t0 += ATTN_TILE) { /* tile by tile, as the kernel */
                int nt = NPOS - t0 < ATTN_TILE ? NPOS - t0 : ATTN_TILE;
                fn(&tb, &st, pos + t0, nt, cs[lv] + t0 * half, sn[lv] + t0 * half);
            }
            if (memcmp(cs[lv], cs[0], sizeof(float) * NPOS * half) ||
                memcmp(sn[lv], sn[0], sizeof(float) * NPOS * half))
                fail_msg("rope angles, %d pairs: %s differs from scalar", half, levels[lv]);
        }
        for (int t = 0; t < NPOS; t++)
            for (int i = 0; i < half; i++) {
                double a = pos[t] * theta[i];
                double ec = fabs(cs[0][t * half + i] - cos(a));
                double es = fabs(sn[0][t * half + i] - sin(a));
                if (!(ec <= 4e-7 && es <= 4e-7))
                    fail_msg("rope angle pos %d pair %d/%d: cos err %.3g, sin err %.3g", pos[t],
                             i, half, ec, es);
            }
    }
    assert_non_null(attn_rope_path("scalar"));
    assert_null(attn_rope_path("neon"));
}

/* The longest head the layouts test tries. */
#define PL_DMAX 128

/* Rows of queries (ld = D) or angles (ld = half) laid out in m's slots, from ADJACENT's. */
static void pair_slots(enum attn_pairs m, int half, const float *src, float *dst, int n_rows,
                       int ld)
{
    for (int r = 0; r < n_rows; r++)
        for (int i = 0; i < half; i++) {
            int p = attn_pair_at(m, i);
            dst[(size_t)r * ld + i] = src[(size_t)r * ld + p];
            if (ld > half)
                dst[(size_t)r * ld + half + i] = src[(size_t)r * ld + half + p];
        }
}

/* One level's stage_k and qk_rope in layouts ADJACENT and SHUF8 agree slot for slot. */
static void check_pair_layouts(const struct attn_ops *ops, enum attn_type type, int D,
                               const void *const *kp, const float *cs, const float *sn,
                               const float *q)
{
    enum { NT = ATTN_TILE };
    const int half = D / 2;
    static float cs8[NT * PL_DMAX / 2], sn8[NT * PL_DMAX / 2], q8[5 * PL_DMAX];
    static float st[2][NT * PL_DMAX], S[2][5 * ATTN_TILE];
    pair_slots(ATTN_PAIRS_SHUF8, half, cs, cs8, NT, half);
    pair_slots(ATTN_PAIRS_SHUF8, half, sn, sn8, NT, half);
    pair_slots(ATTN_PAIRS_SHUF8, half, q, q8, 5, D);
    ops->stage_k(st[0], kp, NT, type, D, D, ATTN_PAIRS_ADJACENT, cs, sn, half);
    ops->stage_k(st[1], kp, NT, type, D, D, ATTN_PAIRS_SHUF8, cs8, sn8, half);
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < half; i++) {
            int p = attn_pair_at(ATTN_PAIRS_SHUF8, i);
            if (st[1][t * D + i] != st[0][t * D + p] ||
                st[1][t * D + half + i] != st[0][t * D + half + p])
                fail_msg("%s stage_k %s D %d: key %d slot %d is not pair %d", ops->name,
                         attn_type_name(type), D, t, i, p);
        }
    const float *qa[5], *qs[5];
    for (int r = 0; r < 5; r++) {
        qa[r] = q + (size_t)r * D;
        qs[r] = q8 + (size_t)r * D;
    }
    for (int rows = 1; rows <= 5; rows++) {
        ops->qk_rope(S[0], qa, rows, kp, NT, type, D, D, ATTN_PAIRS_ADJACENT, cs, sn, half, NULL);
        ops->qk_rope(S[1], qs, rows, kp, NT, type, D, D, ATTN_PAIRS_SHUF8, cs8, sn8, half, NULL);
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < NT; t++) {
                float a = S[0][r * ATTN_TILE + t], b = S[1][r * ATTN_TILE + t];
                if (!(fabsf(a - b) <= 1e-5f * (float)D))
                    fail_msg("%s qk_rope %s D %d, %d rows: row %d key %d %g vs %g", ops->name,
                             attn_type_name(type), D, rows, r, t, (double)a, (double)b);
            }
    }
}

/*
 * The pairs' layouts (enum attn_pairs): with queries and angles in SHUF8's
 * slots, every level this CPU runs (scalar and its SIMD copy) stages each
 * rotated pair into its slot and scores as in ADJACENT's layout - 1 to 5
 * rows (the 3-row block too), f32 and f16 keys, heads of 64 and 96.
 */
static void test_kernel_pair_layouts(void **state)
{
    (void)state;
    enum { NT = ATTN_TILE };
    static float key[NT][PL_DMAX], cs[NT * PL_DMAX / 2], sn[NT * PL_DMAX / 2], q[5 * PL_DMAX];
    static uint16_t key16[NT][PL_DMAX];
    const struct attn_ops *levels[2] = {&attn_scalar_ops, attn_simd_ops()};
    const int dims[2] = {64, 96};
    uint32_t seed = 17;
    for (int di = 0; di < 2; di++) {
        const int D = dims[di], half = D / 2;
        for (int t = 0; t < NT; t++)
            for (int d = 0; d < D; d++) {
                key[t][d] = rng_unit(&seed);
                key16[t][d] = attn_f32_to_f16(key[t][d]);
            }
        for (int i = 0; i < NT * half; i++) {
            float a = 3.0f * rng_unit(&seed);
            cs[i] = cosf(a);
            sn[i] = sinf(a);
        }
        for (int i = 0; i < 5 * D; i++)
            q[i] = rng_unit(&seed);
        const void *k32[NT], *k16[NT];
        for (int t = 0; t < NT; t++) {
            k32[t] = key[t];
            k16[t] = key16[t];
        }
        for (int lv = 0; lv < 2; lv++) {
            if (!levels[lv])
                continue;
            check_pair_layouts(levels[lv], ATTN_F32, D, k32, cs, sn, q);
            check_pair_layouts(levels[lv], ATTN_F16, D, k16, cs, sn, q);
        }
    }
}

/* q8_0 / q4_0 with a head size that is no multiple of 32 is refused, naming both. */
static void test_kernel_quant_refused(void **state)
{
    (void)state;
    char err[160];
    assert_int_equal(attn_type_check(ATTN_Q8_0, 40, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "q8_0"));
    assert_non_null(strstr(err, "head_dim 40"));
    assert_int_equal(attn_type_check(ATTN_F16, 40, err, sizeof(err)), 0);
    assert_int_equal(attn_type_check((enum attn_type)9, 64, err, sizeof(err)), -EINVAL);
    struct kcase c = {.scheme = S_ALIBI,
                      .head_dim = 64,
                      .group = 2,
                      .n_kv_head = 2,
                      .page_tokens = 16,
                      .n_seqs = 1,
                      .n_kv = {100},
                      .n_q = {1},
                      .threads = 1};
    set_types(&c, true, 1);
    struct fixture f;
    fixture_init(&f, &c);
    attn_ctx *ctx = attn_create(&f.params, err, sizeof(err));
    assert_non_null(ctx);
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), 0);
    struct attn_params p48 = f.params; /* the same pool read as 48-dim heads */
    p48.head_dim = 48;
    attn_ctx *c48 = attn_create(&p48, err, sizeof(err));
    assert_non_null(c48);
    assert_int_equal(attn_run(c48, &f.kv, f.seqs, 1), -EINVAL);
    assert_non_null(strstr(attn_error(c48), "q8_0"));
    assert_non_null(strstr(attn_error(c48), "head_dim 48"));
    assert_int_equal(attn_reference(&p48, &f.kv, f.seqs, 1), -EINVAL);
    attn_destroy(c48);
    attn_destroy(ctx);
    fixture_deinit(&f);
}

static void test_kernel_bad_params(void **state)
{
    (void)state;
    char err[256];
    struct attn_params ok = {.n_head = 8, .n_kv_head = 2, .head_dim = 64, .scale = 0.125f};
    struct attn_params p = ok;
    p.n_kv_head = 3;
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "n_kv_head"));
    p = ok;
    p.head_dim = 0;
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "head_dim"));
    p = ok;
    p.scale = 0.0f;
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "scale"));
    p = ok;
    p.pos = (struct pos_scheme){
        .kind = POS_ROPE, .rope_theta = 10000.0f, .rope_dims = 63, .rope_freq_scale = 1.0f};
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "rope_dims"));
    p.pos.rope_dims = 64;
    p.pos.rope_freq_scale = 0.0f; /* a zeroed field, not "no scaling" */
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "rope_freq_scale"));
    float factors[32];
    for (int i = 0; i < 32; i++)
        factors[i] = i == 7 ? 0.0f : 2.0f;
    p.pos.rope_freq_scale = 1.0f;
    p.pos.rope_freq_factors = factors;
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "rope frequency factor 7"));
    p = ok;
    p.pos.kind = POS_ALIBI;
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "alibi_slopes"));
    float table[8 * 32] = {0};
    p = ok;
    p.pos = (struct pos_scheme){.kind = POS_T5,
                                .t5_table = table,
                                .t5_num_buckets = 32,
                                .t5_max_distance = 8,
                                .t5_bidirectional = true};
    assert_null(attn_create(&p, err, sizeof(err)));
    assert_non_null(strstr(err, "max_distance"));
    assert_null(attn_create(NULL, err, sizeof(err)));
}

static void test_kernel_bad_batch(void **state)
{
    (void)state;
    struct kcase c = {.scheme = S_ALIBI,
                      .head_dim = 64,
                      .group = 4,
                      .n_kv_head = 2,
                      .page_tokens = 16,
                      .type = ATTN_F16,
                      .n_seqs = 1,
                      .n_kv = {100},
                      .n_q = {1},
                      .threads = 2};
    struct fixture f;
    fixture_init(&f, &c);
    char err[128];
    attn_ctx *ctx = attn_create(&f.params, err, sizeof(err));
    assert_non_null(ctx);
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), 0);
    assert_string_equal(attn_error(ctx), "");

    struct attn_seq bad = f.seqs[0];
    bad.n_kv = -1;
    assert_int_equal(attn_run(ctx, &f.kv, &bad, 1), -EINVAL);
    assert_non_null(strstr(attn_error(ctx), "negative"));
    bad = f.seqs[0];
    bad.pos = NULL;
    assert_int_equal(attn_run(ctx, &f.kv, &bad, 1), -EINVAL);
    bad = f.seqs[0];
    bad.q = NULL;
    assert_int_equal(attn_run(ctx, &f.kv, &bad, 1), -EINVAL);
    f.pos[0][5] = -3;
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), -EINVAL);
    assert_non_null(strstr(attn_error(ctx), "position -3"));
    f.pos[0][5] = 5;
    f.page_table[0][2] = f.kv.n_pages; /* one past the pool */
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), -EINVAL);
    assert_non_null(strstr(attn_error(ctx), "page_table[2]"));
    f.page_table[0][2] = 0;
    struct attn_kv kv = f.kv;
    kv.page_tokens = 0;
    assert_int_equal(attn_run(ctx, &kv, f.seqs, 1), -EINVAL);
    kv = f.kv;
    kv.page_bytes = kv.v_offset; /* V block would run past the page */
    assert_int_equal(attn_run(ctx, &kv, f.seqs, 1), -EINVAL);
    assert_non_null(strstr(attn_error(ctx), "does not fit"));
    assert_int_equal(attn_run(ctx, NULL, f.seqs, 1), -EINVAL);
    assert_int_equal(attn_reference(&f.params, &kv, f.seqs, 1), -EINVAL);
    /* and it still works afterwards */
    assert_int_equal(attn_run(ctx, &f.kv, f.seqs, 1), 0);
    attn_destroy(ctx);
    fixture_deinit(&f);
}

/* The exact conversions the scalar path and the fixtures rely on. */
static void test_kernel_conversions(void **state)
{
    (void)state;
    assert_true(attn_f16_to_f32(0x3c00) == 1.0f);
    assert_true(attn_f16_to_f32(0xc000) == -2.0f);
    assert_true(attn_f16_to_f32(0x7bff) == 65504.0f);
    assert_true(attn_f16_to_f32(0x0001) == ldexpf(1.0f, -24)); /* smallest subnormal */
    assert_true(attn_f16_to_f32(0x03ff) == ldexpf(1023.0f, -24));
    assert_true(isinf(attn_f16_to_f32(0xfc00)) && attn_f16_to_f32(0xfc00) < 0);
    assert_true(isnan(attn_f16_to_f32(0x7e00)));
    /* every finite half survives a round trip */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00)
            continue;
        assert_int_equal(attn_f32_to_f16(attn_f16_to_f32((uint16_t)h)), h);
    }
    assert_int_equal(attn_f32_to_f16(1.0f + ldexpf(1.0f, -11)), 0x3c00); /* tie to even */
    assert_true(attn_bf16_to_f32(0x3f80) == 1.0f);
    assert_int_equal(attn_f32_to_bf16(1.0f), 0x3f80);
    assert_non_null(attn_simd_name());
}

/* ------------------------------------------------------------------------ */

int main(int argc, char **argv)
{
    /* Idle OpenMP workers spin for milliseconds after every parallel region
     * unless told otherwise; between hundreds of short fused calls that spin
     * starves the reference kernel on a small shared machine. The policy is
     * read when libgomp loads, so set it and start again. */
    if (argc > 0 && !getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execv("/proc/self/exe", argv); /* on failure, carry on spinning */
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel_conversions),
        cmocka_unit_test(test_kernel_t5_two_token_sign),
        cmocka_unit_test(test_kernel_nothing_visible),
        cmocka_unit_test(test_kernel_grid),
        cmocka_unit_test(test_kernel_grid_quant),
        cmocka_unit_test(test_kernel_quant_rows),
        cmocka_unit_test(test_kernel_quant_refused),
        cmocka_unit_test(test_kernel_q8_scores),
        cmocka_unit_test(test_kernel_rope_angles),
        cmocka_unit_test(test_kernel_pair_layouts),
        cmocka_unit_test(test_kernel_head_dims),
        cmocka_unit_test(test_kernel_mixed_batch),
        cmocka_unit_test(test_kernel_sliding_window),
        cmocka_unit_test(test_kernel_gaps),
        cmocka_unit_test(test_kernel_translation),
        cmocka_unit_test(test_kernel_context_reused),
        cmocka_unit_test(test_kernel_prefill_chunk),
        cmocka_unit_test(test_kernel_memory_128k),
        cmocka_unit_test(test_kernel_bad_params),
        cmocka_unit_test(test_kernel_bad_batch),
    };
    return cmocka_run_group_tests_name("attention", tests, NULL, NULL);
}
