/*
 * test_bf16.c - BF16 and F16 weights with AVX-512 BF16 (model/matmul_bf16.c,
 * matmul_pack_run.c): the bound, invariance across batches and threads,
 * the other paths when the feature is off or the level lower, the F16
 * choice, and what the kvd binary prints.
 *
 * The bound. Each activation is rounded to bf16 (8 significant bits, to
 * nearest: |x^ - x| <= 2^-8 |x|); a bf16 x bf16 product is exact in f32;
 * the n_in products are added into one f32 sum, each addition rounded
 * (|error| <= 2^-24 of the running sum, whose magnitude is at most
 * S^ = sum |w x^|). So against the exact product over the stored weights,
 *     |out - sum w x| <= 2^-8 S + n_in 2^-24 (1 + 2^-8) S,  S = sum |w x|
 * (for f16 weights rounded to bf16 at load, another 2^-8 S); and against
 * the exact product over x^ rounded here as the kernel must round it, only
 * the summation term remains. The second check is what fails if the
 * kernel rounds differently (truncates, say), the first if it is wrong.
 * The CPU flushes bf16 subnormal inputs and results to zero; the data
 * here has none (it would add n_in 2^-126 to the bound).
 *
 * On a CPU without avx512bf16 the bf16 cases are skipped with a message;
 * the other paths still run. BF16 weights take the pairs by default only
 * where vdpbf16ps outruns the FMA (cpu_bf16_dot_fast: not on Intel's
 * cores) or AMX's tiles run them, so the kernels' cases ask for them
 * (mm_bf16_set_pairs(1), the group's setup), and test_bf16_choice checks
 * the default and KVD_BF16.
 *
 * Where the CPU has AMX's bf16 tiles, the pairs run on them (matmul_amx.c)
 * for every weight whose rows are a multiple of 32 inputs, and the cases
 * run twice: "avx512" (the tiles) and "avx512-noamx" (vdpbf16ps). The
 * tiles add a row's products in another order than vdpbf16ps, so the two
 * engines' bits differ; each is held to the same bound and is batch- and
 * thread-invariant on its own. Decoding under "avx512" runs the tiles'
 * arithmetic in vector registers, so "a token alone as in the batch" is
 * what holds that copy to the tiles' bits (test_amx_denormals adds the
 * flush of denormals).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/quant.h"
#include "tests/cpu_levels.h"
#include "tests/kvd_run.h"

static uint64_t rng_state;

static float rng_unit(void) /* [-1, 1), splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * 0x1p-52 - 1.0);
}

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* A weight matrix of type (f16 or bf16) with random rows spanning a few
 * decades, its values as stored in W. */
struct mat {
    struct mm_weight w;
    uint8_t *data;
    float *W;
    void *packed;
};

/* m from the n_out rows of n_in values in rows, as type stores them. */
static void mat_from(struct mat *m, enum ggml_type type, int n_in, int n_out, const float *rows)
{
    size_t rb = qt_row_bytes(type, n_in);
    m->data = malloc(rb * (size_t)n_out);
    m->W = malloc(sizeof(float) * (size_t)n_in * (size_t)n_out);
    m->packed = NULL;
    assert_non_null(m->data);
    assert_non_null(m->W);
    for (int o = 0; o < n_out; o++) {
        assert_int_equal(
            qt_quantize_row(type, rows + (size_t)o * n_in, m->data + rb * (size_t)o, n_in), 0);
        assert_int_equal(
            qt_dequantize_row(type, m->data + rb * (size_t)o, m->W + (size_t)o * n_in, n_in), 0);
    }
    char err[160];
    assert_int_equal(mm_weight_init(&m->w, type, n_in, n_out, m->data, err, sizeof err), 0);
}

static void mat_init(struct mat *m, enum ggml_type type, int n_in, int n_out)
{
    float *rows = malloc(sizeof(float) * (size_t)n_in * (size_t)n_out);
    assert_non_null(rows);
    for (int o = 0; o < n_out; o++) {
        float scale = powf(10.0f, 2.0f * rng_unit());
        for (int i = 0; i < n_in; i++)
            rows[(size_t)o * n_in + i] = scale * rng_unit();
    }
    mat_from(m, type, n_in, n_out, rows);
    free(rows);
}

/* Repack at the level in use; true if a copy was made. */
static bool mat_pack(struct mat *m)
{
    size_t pb = mm_pack_bytes(&m->w);
    if (!pb)
        return false;
    m->packed = aligned_alloc(64, (pb + 63) / 64 * 64);
    assert_non_null(m->packed);
    mm_pack_weight(&m->w, m->packed);
    return true;
}

static void mat_free(struct mat *m)
{
    free(m->data);
    free(m->W);
    free(m->packed);
}

static float *random_x(int n_in, int n_tok)
{
    float *x = malloc(sizeof(float) * (size_t)n_in * (size_t)n_tok);
    assert_non_null(x);
    for (int i = 0; i < n_in * n_tok; i++)
        x[i] = powf(10.0f, rng_unit()) * rng_unit();
    return x;
}

/*
 * out against the bound of the opening comment. Wr: the weights the
 * kernel multiplies (W itself, or W rounded to bf16 for f16-as-bf16), and
 * wextra the extra relative term their rounding adds (0 or 2^-8).
 */
static void check_bound(const struct mat *m, const float *Wr, double wextra, const float *x,
                        const float *out, int n_tok, const char *what)
{
    const int n_in = m->w.n_in, n_out = m->w.n_out;
    const double gamma = n_in * 0x1p-24 * (1 + 0x1p-8) * (1 + 0x1p-8);
    for (int t = 0; t < n_tok; t++) {
        const float *xt = x + (size_t)t * n_in;
        for (int o = 0; o < n_out; o++) {
            const float *wo = m->W + (size_t)o * n_in, *wr = Wr + (size_t)o * n_in;
            double ref = 0, s = 0, ref_r = 0, s_r = 0;
            for (int i = 0; i < n_in; i++) {
                double xr = qt_bf16_to_f32(qt_f32_to_bf16(xt[i]));
                ref += (double)wo[i] * xt[i];
                s += fabs((double)wo[i] * xt[i]);
                ref_r += (double)wr[i] * xr;
                s_r += fabs((double)wr[i] * xr);
            }
            double got = out[(size_t)t * n_out + o];
            double tol = (0x1p-8 + wextra) * s * (1 + 0x1p-7) + gamma * s;
            if (!(fabs(got - ref) <= tol))
                fail_msg("%s %dx%d tok %d row %d: got %.9g, want %.9g (tol %.3g)", what, n_out,
                         n_in, t, o, got, ref, tol);
            double tol_r = gamma * s_r;
            if (!(fabs(got - ref_r) <= tol_r))
                fail_msg("%s %dx%d tok %d row %d: got %.9g, want %.9g over the bf16-rounded "
                         "activations (tol %.3g)",
                         what, n_out, n_in, t, o, got, ref_r, tol_r);
        }
    }
}

static bool bf16_here(void)
{
    if (cpu_bf16_supported())
        return true;
    print_message("skipping: this CPU has no avx512bf16 (the other paths are tested)\n");
    return false;
}

/* BF16 weights at avx512 with the feature: packed in pairs, within the
 * bound, the same bits for 1, 2 and 3 threads and for a token alone (the
 * decode path) as inside any batch. Shapes: odd n_in (a padded pair), a
 * padded last group, tile tails of every size up to 2 x 12. */
static void bound_invariance(const char *level)
{
    char err[200];
    if (cpu_force(level, err, sizeof err))
        fail_msg("%s: %s", level, err);
    assert_true(cpu_bf16());
    print_message("%s: %s\n", level, cpu_amx() ? "amx-bf16 tiles" : "vdpbf16ps");
    /* 200 tokens: 17 tiles of 12, split by token tiles on 2 threads, by
     * rows on 1 and 3 (7 tiles of 32 for AMX: by rows); 600: 19 tiles of
     * 32, split by token tiles on 2 threads */
    const int shapes[][3] = {{576, 70, 29}, {97, 37, 13},  {32, 16, 1},  {1536, 48, 25},
                             {3, 5, 4},     {64, 40, 200}, {128, 35, 600}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        const int n_in = shapes[s][0], n_out = shapes[s][1], n_tok = shapes[s][2];
        rng_state = 1000 + s;
        struct mat m;
        mat_init(&m, GGML_TYPE_BF16, n_in, n_out);
        assert_true(mat_pack(&m));
        assert_true(m.w.packed_bf16);
        assert_true(mm_pack_ready(&m.w));
        float *x = random_x(n_in, n_tok);
        const size_t n = (size_t)n_out * (size_t)n_tok;
        float *out[4];
        for (int k = 0; k < 4; k++) {
            out[k] = malloc(sizeof(float) * n);
            for (size_t i = 0; i < n; i++)
                out[k][i] = NAN;
        }
        for (int k = 0; k < 3; k++)
            assert_int_equal(mm_matmul(out[k], &m.w, x, n_tok, k + 1), 0);
        check_bound(&m, m.W, 0.0, x, out[0], n_tok, "bf16");
        assert_memory_equal(out[0], out[1], sizeof(float) * n);
        assert_memory_equal(out[0], out[2], sizeof(float) * n);
        /* every token alone (decode) and every split of the batch */
        for (int t = 0; t < n_tok; t++) {
            assert_int_equal(mm_matmul(out[3], &m.w, x + (size_t)t * n_in, 1, 2), 0);
            for (int o = 0; o < n_out; o++)
                if (bits(out[3][o]) != bits(out[0][(size_t)t * n_out + o]))
                    fail_msg("bf16 %dx%d: token %d alone differs at row %d", n_out, n_in, t, o);
        }
        for (int cut = 1; cut < n_tok; cut += 5) {
            assert_int_equal(mm_matmul(out[3], &m.w, x, cut, 2), 0);
            assert_int_equal(mm_matmul(out[3] + (size_t)cut * n_out, &m.w, x + (size_t)cut * n_in,
                                       n_tok - cut, 1),
                             0);
            assert_memory_equal(out[3], out[0], sizeof(float) * n);
        }
        for (int k = 0; k < 4; k++)
            free(out[k]);
        free(x);
        mat_free(&m);
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* The same with AMX's tiles (where the CPU has them) and without: each of
 * the two is invariant on its own (their bits differ from each other). */
static void test_bf16_bound_invariance(void **state)
{
    (void)state;
    if (!bf16_here()) {
        skip();
        return;
    }
    bound_invariance("avx512");
    if (cpu_amx_supported())
        bound_invariance("avx512-noamx");
    else
        print_message("no amx-bf16 here: only the vdpbf16ps kernels tested\n");
}

/*
 * The tiles flush denormal inputs and results to zero; decoding's vector
 * copy of their arithmetic (matmul_amx.c) must too, or a token alone and
 * the same token in a batch differ. Weights and activations around 1e-20
 * (products near 1e-40, below f32's smallest normal), some of them bf16
 * denormals themselves, mixed with ordinary ones.
 */
static void test_amx_denormals(void **state)
{
    (void)state;
    if (!cpu_amx_supported()) {
        print_message("skipping: no amx-bf16 here\n");
        skip();
        return;
    }
    assert_int_equal(cpu_force("avx512", NULL, 0), 0);
    const int n_in = 64, n_out = 32, n_tok = 33;
    rng_state = 77;
    float *rows = malloc(sizeof(float) * n_in * n_out);
    float *x = malloc(sizeof(float) * n_in * n_tok);
    assert_non_null(rows);
    assert_non_null(x);
    /* rows: tiny, bf16 denormals, ordinary, a mix; tokens: tiny or a mix */
    for (int o = 0; o < n_out; o++)
        for (int i = 0; i < n_in; i++) {
            const int k = o % 4 < 3 ? o % 4 : i % 3;
            rows[o * n_in + i] = rng_unit() * (k == 0 ? 1e-20f : k == 1 ? 1e-39f : 1.0f);
        }
    for (int t = 0; t < n_tok; t++)
        for (int i = 0; i < n_in; i++)
            x[t * n_in + i] = rng_unit() * (t % 2 == 0 || i % 2 ? 1e-19f : 3e-39f);
    struct mat m;
    mat_from(&m, GGML_TYPE_BF16, n_in, n_out, rows);
    assert_true(mat_pack(&m));
    float *batch = malloc(sizeof(float) * n_out * n_tok), *alone = malloc(sizeof(float) * n_out);
    assert_non_null(batch);
    assert_non_null(alone);
    assert_int_equal(mm_matmul(batch, &m.w, x, n_tok, 1), 0);
    int zero = 0;
    for (int t = 0; t < n_tok; t++) {
        assert_int_equal(mm_matmul(alone, &m.w, x + (size_t)t * n_in, 1, 1), 0);
        for (int o = 0; o < n_out; o++) {
            if (bits(alone[o]) != bits(batch[(size_t)t * n_out + o]))
                fail_msg("token %d row %d: alone %a, in the batch %a", t, o, (double)alone[o],
                         (double)batch[(size_t)t * n_out + o]);
            zero += alone[o] == 0.0f;
        }
    }
    /* the flush is exercised: some sums are zero only because of it */
    print_message("%d of %d sums flushed to zero\n", zero, n_out * n_tok);
    free(batch);
    free(alone);
    free(rows);
    free(x);
    mat_free(&m);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* Q, K and V of one x in one region (mm_matmul_many) over bf16 pairs: each
 * output bit for bit as its product alone, for a batch and for one token;
 * a mix of pairs and another layout runs one product after another. */
static void test_bf16_many(void **state)
{
    (void)state;
    if (!bf16_here()) {
        skip();
        return;
    }
    cl_force(CPU_AVX512);
    enum { N_IN = 192, N_TOK = 15 };
    const int n_outs[3] = {192, 64, 40};
    struct mat m[3];
    rng_state = 31;
    for (int i = 0; i < 3; i++) {
        mat_init(&m[i], GGML_TYPE_BF16, N_IN, n_outs[i]);
        assert_true(mat_pack(&m[i]) && m[i].w.packed_bf16);
    }
    float *x = random_x(N_IN, N_TOK);
    for (int n_tok = 1; n_tok <= N_TOK; n_tok += N_TOK - 1) {
        float *alone[3], *many[3];
        const struct mm_weight *ws[3];
        size_t need = 0;
        for (int i = 0; i < 3; i++) {
            alone[i] = malloc(sizeof(float) * (size_t)n_outs[i] * n_tok);
            many[i] = malloc(sizeof(float) * (size_t)n_outs[i] * n_tok);
            assert_int_equal(mm_matmul(alone[i], &m[i].w, x, n_tok, 1), 0);
            ws[i] = &m[i].w;
            size_t b = mm_scratch_bytes(ws[i], n_tok, 2);
            need = b > need ? b : need;
        }
        void *scratch = aligned_alloc(64, (need + 63) / 64 * 64);
        mm_matmul_many(many, ws, 3, x, n_tok, 2, scratch, NULL);
        for (int i = 0; i < 3; i++)
            assert_memory_equal(many[i], alone[i], sizeof(float) * (size_t)n_outs[i] * n_tok);
        /* the first weight in matmul_pack.c's layout instead: not one region */
        struct mm_weight plain = m[0].w;
        plain.packed = NULL;
        plain.packed_bf16 = false;
        ws[0] = &plain;
        mm_matmul_many(many, ws, 3, x, n_tok, 2, scratch, NULL);
        for (int i = 1; i < 3; i++)
            assert_memory_equal(many[i], alone[i], sizeof(float) * (size_t)n_outs[i] * n_tok);
        free(scratch);
        for (int i = 0; i < 3; i++) {
            free(alone[i]);
            free(many[i]);
        }
    }
    for (int i = 0; i < 3; i++)
        mat_free(&m[i]);
    free(x);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* The tail of a gate/up region (mm_tail): SwiGLU of block [r0, r1) x
 * [t0, t1) into gate's output, each cell counted, and whether every block
 * has the shape of the region's own split (so the tail ran inside it, on
 * the thread that wrote the block): by rows, at most a pair of row groups
 * (32 rows) over every token; by token tiles, every row over tokens from a
 * tile's start. The separate pass after the products splits the rows
 * among the threads instead, every token at once. */
struct glu_tail {
    float *g;
    const float *u;
    int *seen;
    int n_out, n_tok;
    bool inside;
};

static float silu_mul(float g, float u)
{
    return g / (1.0f + expf(-g)) * u;
}

static void glu_tail_fn(void *arg, int r0, int r1, int t0, int t1)
{
    struct glu_tail *a = arg;
    /* by rows: a pair of row groups, or up to four for a narrow batch (decoding) */
    const bool by_rows = r1 - r0 <= 128 && t0 == 0 && t1 == a->n_tok;
    const bool by_tiles = r0 == 0 && r1 == a->n_out && t0 % 12 == 0 && t1 - t0 < a->n_tok;
    if (!by_rows && !by_tiles)
        a->inside = false;
    for (int t = t0; t < t1; t++)
        for (int r = r0; r < r1; r++) {
            size_t i = (size_t)t * (size_t)a->n_out + (size_t)r;
            a->g[i] = silu_mul(a->g[i], a->u[i]);
            a->seen[i]++;
        }
}

/* Gate and up over bf16 pairs with the SwiGLU tail (the forward's MLP):
 * the tail runs inside the products' region, and the outputs are bit for
 * bit the products alone followed by the activation, at 1 to 3 threads,
 * for one token (by rows) and for 200 (by token tiles on 2 threads). */
static void test_bf16_tail(void **state)
{
    (void)state;
    if (!bf16_here()) {
        skip();
        return;
    }
    cl_force(CPU_AVX512);
    enum { N_IN = 96, N_OUT = 70, MAX_TOK = 200 };
    struct mat m[2];
    rng_state = 77;
    for (int i = 0; i < 2; i++) {
        mat_init(&m[i], GGML_TYPE_BF16, N_IN, N_OUT);
        assert_true(mat_pack(&m[i]) && m[i].w.packed_bf16);
    }
    float *x = random_x(N_IN, MAX_TOK);
    const size_t cells = (size_t)N_OUT * MAX_TOK;
    float *g = malloc(sizeof(float) * cells), *u = malloc(sizeof(float) * cells);
    float *want = malloc(sizeof(float) * cells), *up = malloc(sizeof(float) * cells);
    int *seen = malloc(sizeof(int) * cells);
    void *scratch = aligned_alloc(64, (mm_scratch_bytes(&m[0].w, MAX_TOK, 3) + 63) / 64 * 64);
    const int n_toks[] = {1, 15, MAX_TOK};
    for (size_t k = 0; k < 3; k++)
        for (int th = 1; th <= 3; th++) {
            const int n_tok = n_toks[k];
            const size_t n = (size_t)N_OUT * (size_t)n_tok;
            assert_int_equal(mm_matmul(want, &m[0].w, x, n_tok, th), 0);
            assert_int_equal(mm_matmul(up, &m[1].w, x, n_tok, th), 0);
            for (size_t i = 0; i < n; i++)
                want[i] = silu_mul(want[i], up[i]);
            memset(seen, 0, sizeof(int) * n);
            struct glu_tail a = {g, u, seen, N_OUT, n_tok, true};
            const struct mm_weight *ws[2] = {&m[0].w, &m[1].w};
            float *outs[2] = {g, u};
            mm_matmul_many(outs, ws, 2, x, n_tok, th, scratch,
                           &(struct mm_tail){glu_tail_fn, &a});
            if (!a.inside)
                fail_msg("%d tokens, %d threads: the tail ran apart from the products", n_tok, th);
            for (size_t i = 0; i < n; i++)
                assert_int_equal(seen[i], 1);
            assert_memory_equal(u, up, sizeof(float) * n);
            assert_memory_equal(g, want, sizeof(float) * n);
        }
    free(scratch);
    free(seen);
    free(g);
    free(u);
    free(want);
    free(up);
    free(x);
    for (int i = 0; i < 2; i++)
        mat_free(&m[i]);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* Element (o, k) of the bit-pattern matrix below, as stored. */
static uint16_t pattern(int o, int k)
{
    return (uint16_t)(o * 1632 + k);
}

/* The copy in pairs, lane by lane, against the scalar conversion of each
 * element (qt_f32_to_bf16 of the exact f32 of an f16: round to nearest
 * even; a bf16 as stored): 41 rows x 1,639 inputs, whose whole 16s hold
 * every one of the 65,536 bit patterns (subnormals, ties, infinities,
 * NaNs), then a 7-input tail, an odd last pair, a padded last group and
 * the zero group that completes the last pair of groups. */
static void test_bf16_pack_bits(void **state)
{
    (void)state;
    if (!bf16_here()) {
        skip();
        return;
    }
    cl_force(CPU_AVX512);
    enum { N_IN = 1639, N_OUT = 41, NP = (N_IN + 1) / 2 };
    uint16_t *data = malloc(sizeof(uint16_t) * N_IN * N_OUT);
    assert_non_null(data);
    for (int o = 0; o < N_OUT; o++)
        for (int k = 0; k < N_IN; k++)
            data[(size_t)o * N_IN + k] = pattern(o, k);
    const enum ggml_type types[2] = {GGML_TYPE_F16, GGML_TYPE_BF16};
    mm_f16_set_bf16(true);
    for (int ty = 0; ty < 2; ty++) {
        struct mm_weight w;
        char err[160];
        assert_int_equal(mm_weight_init(&w, types[ty], N_IN, N_OUT, data, err, sizeof err), 0);
        size_t pb = mm_pack_bytes(&w);
        assert_int_equal(pb, (size_t)2 * NP * 128); /* 3 groups: 2 pairs, the last half zeros */
        uint32_t *packed = aligned_alloc(64, pb);
        assert_non_null(packed);
        mm_pack_weight(&w, packed);
        assert_true(w.packed_bf16);
        for (int o = 0; o < 4 * 16; o++)
            for (int p = 0; p < NP; p++) {
                uint32_t want = 0;
                for (int h = 0; h < 2; h++) {
                    const int k = 2 * p + h;
                    if (o >= N_OUT || k >= N_IN)
                        continue;
                    uint16_t e = pattern(o, k);
                    uint32_t b = types[ty] == GGML_TYPE_BF16 ? e : qt_f32_to_bf16(qt_f16_to_f32(e));
                    want |= b << (16 * h);
                }
                /* pair o / 32, input pair p, group line (o / 16) % 2, lane o % 16 */
                uint32_t got = packed[(((size_t)(o / 32) * NP + p) * 2 + (o / 16) % 2) * 16 + o % 16];
                if (got != want)
                    fail_msg("%s row %d pair %d: 0x%08x, want 0x%08x", qt_type_name(types[ty]), o,
                             p, got, want);
            }
        free(packed);
    }
    mm_f16_set_bf16(false);
    free(data);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/*
 * A BF16 weight packed in pairs, then multiplied at every level the CPU
 * runs and with the feature forced off: where the bf16 kernels do not run
 * the copy is not used and the stored rows give exactly what a weight
 * never packed gives (the f32 path: exact products). Packed with the
 * feature off, a BF16 weight takes matmul_pack.c's exact f32 tile.
 */
static void test_bf16_lower_levels(void **state)
{
    (void)state;
    enum { N_IN = 130, N_OUT = 33, N_TOK = 9 };
    rng_state = 77;
    struct mat m;
    mat_init(&m, GGML_TYPE_BF16, N_IN, N_OUT);
    struct mm_weight plain = m.w;
    bool pairs = false;
    if (cpu_bf16_supported()) {
        cl_force(CPU_AVX512);
        assert_true(mat_pack(&m) && m.w.packed_bf16);
        pairs = true;
    }
    float *x = random_x(N_IN, N_TOK), a[N_OUT * N_TOK], b[N_OUT * N_TOK];
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int l = 0; l <= n_levels; l++) {
        char err[200], line[200];
        /* the levels, then avx512 without its bf16 kernels */
        const char *name = l < n_levels ? cpu_level_name(levels[l]) : "avx512-nobf16";
        if (l == n_levels && cpu_amx_supported()) { /* and without AMX: the vector pairs */
            assert_int_equal(cpu_force("avx512-noamx", err, sizeof err), 0);
            assert_false(cpu_amx());
            assert_non_null(strstr(mm_bf16_describe(line, sizeof line), "bf16 by avx512bf16"));
            assert_int_equal(mm_matmul(a, &m.w, x, N_TOK, 2), 0);
            check_bound(&m, m.W, 0.0, x, a, N_TOK, "bf16 pairs without amx");
        }
        if (l == n_levels && cpu_force(name, err, sizeof err)) {
            print_message("%s refused here: %s\n", name, err);
            break;
        }
        if (l < n_levels)
            cl_force(levels[l]);
        const bool bf = l < n_levels && levels[l] == CPU_AVX512 && cpu_bf16_supported();
        assert_int_equal(cpu_bf16(), bf);
        mm_bf16_describe(line, sizeof line);
        print_message("%s: %s\n", name, line);
        const char *by = cpu_amx() ? "bf16 by amx-bf16 tiles" : "bf16 by avx512bf16";
        assert_int_equal(strstr(line, by) != NULL, bf);
        assert_int_equal(cpu_amx(), bf && cpu_amx_supported());
        if (l == n_levels)
            assert_non_null(strstr(line, "exact by f32 FMA"));
        assert_int_equal(mm_pack_ready(&m.w), pairs && bf);
        assert_int_equal(mm_matmul(a, &m.w, x, N_TOK, 2), 0);
        assert_int_equal(mm_matmul(b, &plain, x, N_TOK, 2), 0);
        if (!mm_pack_ready(&m.w))
            assert_memory_equal(a, b, sizeof a);
        else
            check_bound(&m, m.W, 0.0, x, a, N_TOK, "bf16 pairs");
    }
    if (cpu_force("avx512-nobf16", NULL, 0) == 0) {
        struct mat m2;
        rng_state = 77;
        mat_init(&m2, GGML_TYPE_BF16, N_IN, N_OUT);
        assert_true(mat_pack(&m2));
        assert_false(m2.w.packed_bf16); /* matmul_pack.c's layout, exact widening */
        assert_int_equal(mm_matmul(a, &m2.w, x, N_TOK, 2), 0);
        assert_int_equal(cpu_force("auto", NULL, 0), 0);
        /* that copy still runs (exactly, f32) when the feature is back on */
        assert_true(mm_pack_ready(&m2.w));
        assert_int_equal(mm_matmul(b, &m2.w, x, N_TOK, 1), 0);
        assert_memory_equal(a, b, sizeof a);
        mat_free(&m2);
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
    free(x);
    mat_free(&m);
}

/* F16 weights stay exact by default (matmul_pack.c's layout); asked, they
 * are rounded to bf16 at load, within the bound with the weights' own
 * rounding added, batch- and thread-invariant like BF16. */
static void test_f16_choice(void **state)
{
    (void)state;
    enum { N_IN = 576, N_OUT = 40, N_TOK = 14 };
    rng_state = 5;
    struct mat m;
    mat_init(&m, GGML_TYPE_F16, N_IN, N_OUT);
    float *x = random_x(N_IN, N_TOK), a[N_OUT * N_TOK], b[N_OUT * N_TOK];
    assert_false(mm_f16_bf16());
    if (mat_pack(&m))
        assert_false(m.w.packed_bf16);
    free(m.packed);
    m.packed = NULL;
    m.w.packed = NULL;

    mm_f16_set_bf16(true);
    if (bf16_here()) {
        cl_force(CPU_AVX512);
        char line[200];
        assert_non_null(strstr(mm_bf16_describe(line, sizeof line), "f16 rounded to bf16"));
        assert_true(mat_pack(&m) && m.w.packed_bf16);
        float *Wr = malloc(sizeof(float) * N_IN * N_OUT);
        for (int i = 0; i < N_IN * N_OUT; i++)
            Wr[i] = qt_bf16_to_f32(qt_f32_to_bf16(m.W[i]));
        assert_int_equal(mm_matmul(a, &m.w, x, N_TOK, 2), 0);
        check_bound(&m, Wr, 0x1p-8, x, a, N_TOK, "f16 as bf16");
        for (int t = 0; t < N_TOK; t++) {
            assert_int_equal(mm_matmul(b, &m.w, x + (size_t)t * N_IN, 1, 1), 0);
            assert_memory_equal(b, a + (size_t)t * N_OUT, sizeof(float) * N_OUT);
        }
        free(Wr);
    }
    mm_f16_set_bf16(false);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
    free(x);
    mat_free(&m);
}

/* The default for BF16 weights follows the CPU (pairs where vdpbf16ps
 * outruns the FMA or AMX's tiles run them), said on the kernels line;
 * KVD_BF16=pairs or exact overrides it, and anything else is refused by
 * name. */
static void test_bf16_choice(void **state)
{
    (void)state;
    char err[200], line[400];
    /* the rule, against an independent reading of the CPU's make */
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f) {
        bool intel = false;
        while (fgets(line, sizeof line, f))
            if (!strncmp(line, "vendor_id", 9)) {
                intel = strstr(line, "GenuineIntel") != NULL;
                break;
            }
        fclose(f);
        print_message("vendor %s\n", intel ? "Intel" : "not Intel");
        assert_int_equal(cpu_bf16_dot_fast(), !intel);
    }
    mm_bf16_set_pairs(-1);
    const bool pairs = cpu_bf16_dot_fast() || cpu_amx(); /* pairs by default */
    assert_int_equal(mm_bf16_in_pairs(), cpu_bf16() && pairs);
    mm_bf16_describe(line, sizeof line);
    print_message("default here: %s\n", line);
    if (cpu_bf16() && !pairs)
        assert_non_null(strstr(line, "bf16 exact by f32 FMA (vdpbf16ps at half"));
    if (cpu_amx())
        assert_non_null(strstr(line, "bf16 by amx-bf16 tiles (decoding by their arithmetic in "
                                     "avx512 registers; avx512bf16 16-row pairs where"));
    if (cpu_bf16()) { /* the default packs accordingly */
        struct mat m;
        rng_state = 9;
        mat_init(&m, GGML_TYPE_BF16, 64, 20);
        assert_true(mat_pack(&m));
        assert_int_equal(m.w.packed_bf16, pairs);
        mat_free(&m);
    }
    setenv("KVD_BF16", "exact", 1);
    assert_int_equal(mm_bf16_init_env(err, sizeof err), 0);
    assert_false(mm_bf16_in_pairs());
    if (cpu_bf16())
        assert_non_null(strstr(mm_bf16_describe(line, sizeof line), "(KVD_BF16=exact)"));
    setenv("KVD_BF16", "pairs", 1);
    assert_int_equal(mm_bf16_init_env(err, sizeof err), 0);
    assert_int_equal(mm_bf16_in_pairs(), cpu_bf16());
    if (cpu_bf16())
        assert_non_null(strstr(mm_bf16_describe(line, sizeof line),
                               cpu_amx() ? "bf16 by amx-bf16 tiles (decoding by their arithmetic"
                                         : "bf16 by avx512bf16 16-row pairs"));
    setenv("KVD_BF16", "fast", 1);
    assert_int_equal(mm_bf16_init_env(err, sizeof err), -1);
    assert_non_null(strstr(err, "KVD_BF16: unknown value 'fast' (exact, pairs)"));
    assert_int_equal(mm_bf16_in_pairs(), cpu_bf16()); /* unchanged */
    unsetenv("KVD_BF16");
    assert_int_equal(mm_bf16_init_env(err, sizeof err), 0);
    assert_int_equal(mm_bf16_in_pairs(), cpu_bf16()); /* unset: unchanged */
    mm_bf16_set_pairs(1); /* the group's setting */
}

/* KVD_F16: exact, bf16, unset or empty; anything else refused by name. */
static void test_f16_env(void **state)
{
    (void)state;
    char err[200];
    unsetenv("KVD_F16");
    assert_int_equal(mm_f16_init_env(err, sizeof err), 0);
    assert_false(mm_f16_bf16());
    setenv("KVD_F16", "bf16", 1);
    assert_int_equal(mm_f16_init_env(err, sizeof err), 0);
    assert_true(mm_f16_bf16());
    setenv("KVD_F16", "exact", 1);
    assert_int_equal(mm_f16_init_env(err, sizeof err), 0);
    assert_false(mm_f16_bf16());
    setenv("KVD_F16", "fp8", 1);
    assert_int_equal(mm_f16_init_env(err, sizeof err), -1);
    assert_non_null(strstr(err, "KVD_F16: unknown value 'fp8' (exact, bf16)"));
    assert_false(mm_f16_bf16());
    unsetenv("KVD_F16");
}

/* The kvd binary prints the path it takes and runs a BF16 model on each:
 * the bf16 kernels, F16 asked as bf16, the feature forced off, the lower
 * levels; a bad KVD_F16 stops it, naming the variable. */
static void test_binary(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN") || !*getenv("KVD_BIN")) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    char dir[] = "/tmp/kvd-test-bf16-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char args[600], *err;
    snprintf(args, sizeof args,
             "mkmodel --out '%s/m.gguf' --dim 64 --layers 2 --heads 4 --kv-heads 2 --ff 128 "
             "--vocab 300 --type bf16",
             dir);
    assert_int_equal(kvd_run("", args, dir, &err), 0);
    free(err);
    snprintf(args, sizeof args, "generate --model '%s/m.gguf' --prompt hello -n 4 --temp 0", dir);

    assert_int_equal(kvd_run("KVD_F16=half", args, dir, &err), 2);
    assert_non_null(strstr(err, "kvd: KVD_F16: unknown value 'half'"));
    free(err);
    struct {
        const char *vars, *want;
        bool need_bf16, need_amx;
    } runs[] = {
        {"KVD_CPU=auto KVD_BF16=pairs", "bf16 by amx-bf16 tiles (decoding by their arithmetic",
         true, true},
        {"KVD_CPU=auto", "with avx512bf16, amx-bf16)", true, true},
        {"KVD_CPU=auto", "bf16 by amx-bf16 tiles (decoding by their arithmetic", true, true},
        {"KVD_CPU=avx512-noamx KVD_BF16=pairs", "bf16 by avx512bf16 16-row pairs, f16 exact", true,
         false},
        {"KVD_CPU=avx512-noamx", "(forced; with avx512bf16 without amx-bf16;", true, true},
        {"KVD_CPU=auto KVD_BF16=pairs",
         "repacked for avx512-vnni 16-row and avx512bf16 (bf16 pairs)", true, false},
        {"KVD_BF16=exact", "bf16 exact by f32 FMA (KVD_BF16=exact), f16 exact", true, false},
        {"KVD_BF16=half", "kvd: KVD_BF16: unknown value 'half' (exact, pairs)", false, false},
        {"KVD_CPU=auto KVD_F16=bf16", "f16 rounded to bf16 (KVD_F16=bf16)", true, false},
        {"KVD_CPU=avx512-nobf16", "bf16 and f16 exact by f32 FMA (avx512bf16 forced off)", true, false},
        {"KVD_CPU=avx2", "bf16 and f16 exact", false, false},
        {"KVD_CPU=scalar", "bf16 and f16 exact", false, false},
    };
    for (size_t r = 0; r < sizeof runs / sizeof runs[0]; r++) {
        if ((runs[r].need_bf16 && !cpu_bf16_supported()) ||
            (runs[r].need_amx && !cpu_amx_supported()))
            continue;
        int rc = kvd_run(runs[r].vars, args, dir, &err);
        const int want_rc = strstr(runs[r].want, "unknown value") ? 2 : 0;
        if (rc != want_rc || !strstr(err, runs[r].want))
            fail_msg("%s: exit %d, no '%s' in:\n%s", runs[r].vars, rc, runs[r].want, err);
        free(err);
    }
    snprintf(args, sizeof args, "rm -rf '%s'", dir);
    assert_int_equal(system(args), 0);
}

/* The kernels' cases test the pairs wherever the CPU has them. */
static int pairs_on(void **state)
{
    (void)state;
    mm_bf16_set_pairs(1);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_bound_invariance),
        cmocka_unit_test(test_amx_denormals),
        cmocka_unit_test(test_bf16_many),
        cmocka_unit_test(test_bf16_tail),
        cmocka_unit_test(test_bf16_pack_bits),
        cmocka_unit_test(test_bf16_lower_levels),
        cmocka_unit_test(test_f16_choice),
        cmocka_unit_test(test_f16_env),
        cmocka_unit_test(test_bf16_choice),
        cmocka_unit_test(test_binary),
    };
    return cmocka_run_group_tests(tests, pairs_on, NULL);
}
