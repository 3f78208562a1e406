/*
 * test_ops.c - the forward pass's element-wise kernels and norms
 * (model/ops.c) at every kernel level this build carries and this CPU runs.
 *
 *  - exp against libm's expf over the whole float range: every 251st bit
 *    pattern of both signs, and every pattern near the edges (0, the
 *    overflow threshold, the start of the subnormal results, the last
 *    non-zero result), infinities, NaNs with payloads: at most EXP_ULPS
 *    units in the last place apart (counted across the subnormals, where
 *    a unit is 2^-149), infinity and 0 and NaN exactly where libm gives them
 *    (but a result within one unit of the smallest subnormal or of FLT_MAX
 *    may land on 0 or infinity: one unit is one unit);
 *  - SwiGLU and GELU (tanh) against double-precision references, with a
 *    bound from the float rounding of their argument (and results below
 *    1e-34 allowed to be 0: exp(-x) overflows first);
 *  - RMSNorm and LayerNorm against double-precision references;
 *  - every result a function of its own input alone: the same bits for an
 *    element whether the array is run whole or in pieces at odd offsets
 *    (what makes the forward batch- and thread-invariant), and the same
 *    bits at the AVX2 and AVX-512 levels for the exp-based kernels.
 */
#include <float.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/ops.h"
#include "tests/cpu_levels.h"

/* The bound on exp's distance from libm, in units in the last place. */
#define EXP_ULPS 1

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Distance in representable floats between two non-NaN values of one sign
 * (exp's results are never negative): 0, subnormals, normals, infinity in
 * one increasing run of bit patterns. */
static uint32_t ulp_dist(float a, float b)
{
    uint32_t x = f2u(a), y = f2u(b);
    return x > y ? x - y : y - x;
}

static const struct ops_kernels *level_kernels(enum cpu_level l)
{
    static const struct ops_kernels *const t[CPU_N_LEVELS] = KERN_TABLE(ops_kernels);
    return t[l];
}

/* ------------------------------------------------------------------------
 * exp against libm
 * ------------------------------------------------------------------------ */

struct exp_stats {
    uint32_t worst;     /* largest ulp distance */
    float worst_x;      /* ... at this input */
    long n, bad;        /* inputs checked, inputs out of bounds */
};

enum { BLK = 4096 };

/* Check k->exp on the n inputs x against expf. */
static void exp_check(const struct ops_kernels *k, const float *x, int n, struct exp_stats *s)
{
    float y[BLK];
    k->exp(y, x, (size_t)n);
    for (int i = 0; i < n; i++) {
        float ref = expf(x[i]);
        s->n++;
        if (isnan(ref) || isnan(y[i])) {
            if (!(isnan(ref) && isnan(y[i]))) {
                if (s->bad++ < 5)
                    print_message("  exp(%a): %a, libm %a\n", x[i], y[i], ref);
            }
            continue;
        }
        uint32_t d = ulp_dist(y[i], ref);
        if (d > s->worst) {
            s->worst = d;
            s->worst_x = x[i];
        }
        if (d > EXP_ULPS) {
            if (s->bad++ < 5)
                print_message("  exp(%a): %a, libm %a (%u ulps)\n", x[i], y[i], ref, d);
        }
    }
}

/* Feed the bit patterns [lo, hi] with the given stride, in blocks. */
static void exp_sweep(const struct ops_kernels *k, uint64_t lo, uint64_t hi, uint64_t stride,
                      struct exp_stats *s)
{
    float x[BLK];
    int n = 0;
    for (uint64_t u = lo; u <= hi; u += stride) {
        x[n++] = u2f((uint32_t)u);
        if (n == BLK) {
            exp_check(k, x, n, s);
            n = 0;
        }
    }
    if (n)
        exp_check(k, x, n, s);
}

/* Every pattern within r of the float f, both sides. */
static void exp_around(const struct ops_kernels *k, float f, uint32_t r, struct exp_stats *s)
{
    uint32_t c = f2u(f);
    exp_sweep(k, c > r ? c - r : 0, (uint64_t)c + r, 1, s);
}

static void test_exp_vs_libm(void **state)
{
    (void)state;
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int li = 0; li < n_levels; li++) {
        const struct ops_kernels *k = level_kernels(levels[li]);
        struct exp_stats s = {0};
        exp_sweep(k, 0, 0x7fffffffu, 251, &s);          /* + 0 .. NaNs */
        exp_sweep(k, 0x80000000u, 0xffffffffu, 251, &s); /* - 0 .. NaNs */
        exp_around(k, 0.0f, 1u << 16, &s);
        exp_around(k, -0.0f, 1u << 16, &s);
        exp_around(k, logf(FLT_MAX), 1u << 16, &s);     /* overflow */
        exp_around(k, logf(FLT_MIN), 1u << 16, &s);     /* results become subnormal */
        exp_around(k, -103.972f, 1u << 16, &s);          /* the last non-zero result */
        exp_around(k, 1.0f, 1u << 12, &s);
        exp_around(k, -1.0f, 1u << 12, &s);
        exp_around(k, 0.34657359f, 1u << 12, &s);       /* ln 2 / 2: where n steps */
        float sp[] = {INFINITY, -INFINITY, NAN, -NAN, u2f(0x7fa00001u), u2f(0xffc12345u),
                      FLT_MAX, -FLT_MAX, FLT_MIN, -FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN,
                      88.8f, 88.9f, -104.0f, -104.1f, -150.0f, 200.0f, -1e30f, 1e30f};
        exp_check(k, sp, (int)(sizeof(sp) / sizeof(sp[0])), &s);
        print_message("  exp %-14s %ld inputs: worst %u ulps from libm (at %a), %ld beyond %d\n",
                      k->name, s.n, s.worst, s.worst_x, s.bad, EXP_ULPS);
        assert_int_equal(s.bad, 0);
        float y[4];
        k->exp(y, (float[]){INFINITY, -INFINITY, 0.0f, 100.0f}, 4);
        assert_true(isinf(y[0]) && y[0] > 0);
        assert_true(y[1] == 0.0f && !signbit(y[1]));
        assert_true(y[2] == 1.0f);
        assert_true(isinf(y[3]));
    }
}

/* ------------------------------------------------------------------------
 * Activations against double references
 * ------------------------------------------------------------------------ */

static uint64_t rng = 1;

static float rnd_range(float lo, float hi)
{
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float)((rng >> 40) * (1.0 / 16777216.0));
}

enum { NACT = 20000 };

static void fill_inputs(float *h, float *g, int n)
{
    for (int i = 0; i < n; i++) {
        float span = i % 3 == 0 ? 4.0f : i % 3 == 1 ? 20.0f : 120.0f;
        h[i] = rnd_range(-span, span);
        g[i] = rnd_range(-3.0f, 3.0f);
    }
    h[0] = 0.0f;
    h[1] = -0.0f;
    h[2] = 1e-30f;
    h[3] = -1e-30f;
}

static void test_swiglu_gelu_vs_double(void **state)
{
    (void)state;
    static float h0[NACT], g[NACT], h[NACT];
    fill_inputs(h0, g, NACT);
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int li = 0; li < n_levels; li++) {
        const struct ops_kernels *k = level_kernels(levels[li]);
        double worst[3] = {0};
        for (int op = 0; op < 3; op++) {
            memcpy(h, h0, sizeof(h));
            if (op == 0)
                k->swiglu(h, g, NACT);
            else
                k->gelu_tanh(h, op == 2 ? g : NULL, NACT);
            for (int i = 0; i < NACT; i++) {
                double x = h0[i], ref, slack;
                if (op == 0) { /* silu(x) g: exp's error and three roundings */
                    ref = x / (1.0 + exp(-x)) * g[i];
                    slack = 8.0 * 0x1p-24;
                } else { /* u is rounded in float: its error moves the result by 2|du| */
                    double u = 0.7978845608028654 * x * (1.0 + 0.044715 * x * x);
                    ref = x / (1.0 + exp(-2.0 * u)) * (op == 2 ? g[i] : 1.0);
                    slack = 8.0 * 0x1p-24 + 2.0 * fabs(u) * 4.0 * 0x1p-24;
                }
                /* past x < -88.7 exp(-x) overflows and the quotient, below
                 * |x g| e^-88.7 < 1e-34, becomes 0 */
                double e = fabs(h[i] - ref), bound = slack * fabs(ref) + 1e-34;
                if (op && levels[li] == CPU_SCALAR) /* libm's 1 + tanh(u) cancels for u << 0 */
                    bound += 0x1p-22 * fabs(x) * (op == 2 ? fabs(g[i]) : 1.0);
                if (e > bound)
                    fail_msg("%s op %d x=%a: %a, reference %a", k->name, op, x, h[i], ref);
                if (fabs(ref) > 1e-30 && e / fabs(ref) > worst[op])
                    worst[op] = e / fabs(ref);
            }
        }
        print_message("  %-14s worst relative error: swiglu %.2e, gelu %.2e, geglu %.2e\n",
                      k->name, worst[0], worst[1], worst[2]);
    }
}

/* Infinities and NaN through the activations: the limits, NaN kept. */
static void test_activation_specials(void **state)
{
    (void)state;
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int li = 0; li < n_levels; li++) {
        const struct ops_kernels *k = level_kernels(levels[li]);
        float h[5] = {INFINITY, -200.0f, NAN, 200.0f, -INFINITY};
        float one[5] = {1, 1, 1, 1, 1};
        k->swiglu(h, one, 5);
        assert_true(isinf(h[0]) && h[0] > 0);
        assert_true(h[1] == 0.0f);
        assert_true(isnan(h[2]));
        assert_true(h[3] == 200.0f);
        float q[4] = {INFINITY, -50.0f, NAN, 50.0f};
        k->gelu_tanh(q, NULL, 4);
        assert_true(isinf(q[0]) && q[0] > 0);
        assert_true(q[1] == 0.0f);
        assert_true(isnan(q[2]));
        assert_true(q[3] == 50.0f);
    }
}

/* ------------------------------------------------------------------------
 * Invariance: pieces at odd offsets, and the two SIMD levels alike
 * ------------------------------------------------------------------------ */

static void run_op(const struct ops_kernels *k, int op, float *h, const float *x, const float *g,
                   size_t n)
{
    memcpy(h, x, n * sizeof(float));
    if (op == 0)
        k->exp(h, h, n);
    else if (op == 1)
        k->swiglu(h, g, n);
    else
        k->gelu_tanh(h, op == 3 ? g : NULL, n);
}

static void test_pieces_and_levels(void **state)
{
    (void)state;
    enum { N = 1000 };
    static float x[N], g[N], whole[N], pieces[N], other[N];
    fill_inputs(x, g, N);
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int li = 0; li < n_levels; li++) {
        const struct ops_kernels *k = level_kernels(levels[li]);
        for (int op = 0; op < 4; op++) {
            run_op(k, op, whole, x, g, N);
            for (size_t i = 0, len = 1; i < N; i += len, len = len % 37 + 1) {
                size_t m = i + len <= N ? len : N - i;
                run_op(k, op, pieces + i, x + i, g + i, m);
            }
            assert_memory_equal(whole, pieces, sizeof(whole));
            /* the SIMD levels give the same bits as each other */
            if (levels[li] == CPU_AVX512 && cpu_level_built(CPU_AVX2)) {
                run_op(level_kernels(CPU_AVX2), op, other, x, g, N);
                assert_memory_equal(whole, other, sizeof(whole));
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * Norms
 * ------------------------------------------------------------------------ */

static void test_norms_vs_double(void **state)
{
    (void)state;
    enum { MAXN = 4100 };
    static float x[MAXN], w[MAXN], b[MAXN], y[MAXN], y2[MAXN];
    static const int lens[] = {1, 7, 15, 16, 17, 64, 576, 577, 4099};
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int li = 0; li < n_levels; li++) {
        const struct ops_kernels *k = level_kernels(levels[li]);
        for (size_t c = 0; c < sizeof(lens) / sizeof(lens[0]); c++) {
            int n = lens[c];
            float shift = c % 2 ? 3.0f : 0.0f; /* a mean far from 0 for layernorm */
            for (int i = 0; i < n; i++) {
                x[i] = rnd_range(-2.0f, 2.0f) + shift;
                w[i] = rnd_range(0.5f, 1.5f);
                b[i] = rnd_range(-0.5f, 0.5f);
            }
            for (int ln = 0; ln < 2; ln++) {
                double mean = 0.0, ss = 0.0;
                for (int i = 0; i < n && ln; i++)
                    mean += x[i];
                mean /= n;
                for (int i = 0; i < n; i++)
                    ss += (x[i] - mean) * (x[i] - mean);
                double r = 1.0 / sqrt(ss / n + 1e-5);
                if (ln)
                    k->layernorm(y, x, w, b, n, 1e-5f);
                else
                    k->rmsnorm(y, x, w, n, 1e-5f);
                for (int i = 0; i < n; i++) {
                    double ref = (x[i] - mean) * r * w[i] + (ln ? b[i] : 0.0);
                    /* the float mean's rounding, r's and three products' */
                    double bound = 0x1p-20 * (fabs(x[i]) + fabs(mean)) * r * w[i] +
                                   0x1p-22 * fabs(ref) + 1e-30;
                    if (fabs(y[i] - ref) > bound)
                        fail_msg("%s %s n=%d i=%d: %a, reference %a", k->name,
                                 ln ? "layernorm" : "rmsnorm", n, i, y[i], ref);
                }
                /* in place gives the same bits */
                memcpy(y2, x, sizeof(float) * (size_t)n);
                if (ln)
                    k->layernorm(y2, y2, w, b, n, 1e-5f);
                else
                    k->rmsnorm(y2, y2, w, n, 1e-5f);
                assert_memory_equal(y, y2, sizeof(float) * (size_t)n);
            }
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exp_vs_libm),
        cmocka_unit_test(test_swiglu_gelu_vs_double),
        cmocka_unit_test(test_activation_specials),
        cmocka_unit_test(test_pieces_and_levels),
        cmocka_unit_test(test_norms_vs_double),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
