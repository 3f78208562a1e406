/*
 * test_posenc.c - the attention room's position schemes: T5 buckets, ALiBi
 * slopes and RoPE rotations, each on its own (the fused kernel that applies
 * them from position numbers is tested in test_attention.c).
 *
 * The T5 cases are the worked examples of Hugging Face's
 * _relative_position_bucket with offset = key - query; each would fail if
 * the sign convention, the halving, the float32 logarithm or the clamp
 * were wrong.
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

/* ------------------------------------------------------------------------
 * T5 buckets
 * ------------------------------------------------------------------------ */

static int bidi(int64_t off)
{
    return pos_t5_bucket(off, true, 32, 128);
}

static int causal(int64_t off)
{
    return pos_t5_bucket(off, false, 32, 128);
}

/* Assert every distance in [lo, hi] looking back maps to bucket b. */
static void expect_back_range(int lo, int hi, int b)
{
    for (int d = lo; d <= hi; d++) {
        assert_int_equal(bidi(-d), b);
        assert_int_equal(bidi(+d), b + 16); /* keys to the right: same plus 16 */
    }
}

static void test_t5_bidirectional_defaults(void **state)
{
    (void)state;
    assert_int_equal(bidi(0), 0);
    assert_int_equal(bidi(-17), 10);
    assert_int_equal(bidi(17), 26);
    for (int d = 1; d < 8; d++) {
        assert_int_equal(bidi(-d), d);
        assert_int_equal(bidi(d), d + 16);
    }
    expect_back_range(8, 11, 8);
    expect_back_range(12, 15, 9);
    expect_back_range(16, 22, 10);
    expect_back_range(23, 31, 11);
    expect_back_range(32, 32, 12);
    expect_back_range(64, 64, 14);
    expect_back_range(100, 100, 15);
    expect_back_range(128, 128, 15);
    expect_back_range(1000, 1000, 15);
    /* Bucket 16 would be "offset 0 looking forward": never selected. */
    for (int off = -5000; off <= 5000; off++)
        assert_int_not_equal(bidi(off), 16);
}

static void test_t5_causal_defaults(void **state)
{
    (void)state;
    for (int d = 0; d < 16; d++)
        assert_int_equal(causal(-d), d);
    assert_int_equal(causal(-17), 16);
    assert_int_equal(causal(17), 0); /* clamped; masking forbids it separately */
    assert_int_equal(causal(-64), 26);
    assert_int_equal(causal(-1000), 31);
    assert_int_equal(causal(-((int64_t)1 << 40)), 31);
}

/* A cached decoder must be fed absolute positions, not chunk indices. */
static void test_t5_cached_positions(void **state)
{
    (void)state;
    int64_t pos_q = 128, pos_k = 124;
    assert_int_equal(causal(pos_k - pos_q), 4);
    /* The bug this guards against: a query index reset to 0 gives +124. */
    assert_int_equal(causal(pos_k - 0), 0);
    assert_int_not_equal(causal(pos_k - pos_q), causal(pos_k - 0));
}

static void test_t5_64_buckets(void **state)
{
    (void)state;
    /* Bidirectional: each half has 32 slots, 16 exact. */
    for (int d = 0; d < 16; d++)
        assert_int_equal(pos_t5_bucket(-d, true, 64, 128), d);
    assert_int_equal(pos_t5_bucket(-16, true, 64, 128), 16); /* first log slot */
    assert_int_equal(pos_t5_bucket(5, true, 64, 128), 32 + 5);
    assert_int_equal(pos_t5_bucket(-100000, true, 64, 128), 31);
    assert_int_equal(pos_t5_bucket(100000, true, 64, 128), 63);
    /* Causal: all 64 look back, 32 exact. */
    for (int d = 0; d < 32; d++)
        assert_int_equal(pos_t5_bucket(-d, false, 64, 128), d);
    assert_int_equal(pos_t5_bucket(-32, false, 64, 128), 32);
    assert_int_equal(pos_t5_bucket(-100000, false, 64, 128), 63);
    /* Monotone, and every bucket of the causal table is reachable. */
    int prev = 0;
    int hits[64] = {0};
    for (int d = 0; d <= 200; d++) {
        int b = pos_t5_bucket(-d, false, 64, 128);
        assert_true(b >= prev);
        prev = b;
        hits[b]++;
    }
    for (int b = 0; b < 64; b++)
        assert_true(hits[b] > 0);
}

/* Two tokens: a key one step behind a query is "past"; one ahead is "future". */
static void test_t5_two_token_sign(void **state)
{
    (void)state;
    int pos_q = 1, pos_k_behind = 0, pos_k_ahead = 2;
    assert_int_equal(bidi(pos_k_behind - pos_q), 1);  /* past bucket */
    assert_int_equal(bidi(pos_k_ahead - pos_q), 17); /* future bucket */
    assert_int_equal(causal(pos_k_behind - pos_q), 1);
    assert_int_equal(causal(pos_k_ahead - pos_q), 0);
}

static void test_t5_degenerate_rejected(void **state)
{
    (void)state;
    char err[256];
    /* 32 buckets, max distance 8: HF would give negative ids. */
    assert_int_equal(pos_t5_check(32, 8, true, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "max_distance"));
    assert_int_equal(pos_t5_check(32, 16, false, err, sizeof(err)), -EINVAL);
    assert_int_equal(pos_t5_check(3, 128, true, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "num_buckets"));
    assert_int_equal(pos_t5_check(32, 9, true, err, sizeof(err)), 0);
    assert_int_equal(pos_t5_check(32, 17, false, err, sizeof(err)), 0);
    assert_int_equal(pos_t5_check(4, 2, true, err, sizeof(err)), 0);
    assert_int_equal(pos_t5_check(32, 128, true, err, sizeof(err)), 0);
}

/* Odd bucket counts are halved with floor division, as HF does. */
static void test_t5_odd_buckets(void **state)
{
    (void)state;
    /* 33 buckets bidirectional: 16 per half, exactly like 32. */
    for (int off = -300; off <= 300; off++) {
        assert_int_equal(pos_t5_bucket(off, true, 33, 128), bidi(off));
    }
    /* 5 buckets causal: 2 exact, then log up to slot 4. */
    assert_int_equal(pos_t5_bucket(-1, false, 5, 16), 1);
    assert_int_equal(pos_t5_bucket(-1000, false, 5, 16), 4);
}

static void test_t5_lut_matches_function(void **state)
{
    (void)state;
    const int configs[][3] = {{32, 128, 1}, {32, 128, 0}, {64, 128, 1}, {64, 128, 0},
                              {8, 20, 1},   {33, 500, 0}, {4, 3, 1}};
    for (size_t c = 0; c < sizeof(configs) / sizeof(configs[0]); c++) {
        int nb = configs[c][0], md = configs[c][1];
        bool bd = configs[c][2];
        struct pos_t5_lut lut;
        assert_int_equal(pos_t5_lut_init(&lut, bd, nb, md), 0);
        for (int64_t off = -3000; off <= 3000; off++)
            assert_int_equal(pos_t5_lut_bucket(&lut, off), pos_t5_bucket(off, bd, nb, md));
        assert_int_equal(pos_t5_lut_bucket(&lut, -((int64_t)1 << 35)),
                         pos_t5_bucket(-((int64_t)1 << 35), bd, nb, md));
        pos_t5_lut_deinit(&lut);
    }
}

static void test_t5_saturation(void **state)
{
    (void)state;
    int s = pos_t5_saturation(false, true, 32, 128);
    assert_int_equal(bidi(-s), 15);
    assert_int_equal(bidi(-(s - 1)), 14);
    s = pos_t5_saturation(false, false, 32, 128);
    assert_int_equal(causal(-s), 31);
    assert_int_equal(causal(-(s - 1)), 30);
}

/* ------------------------------------------------------------------------
 * ALiBi
 * ------------------------------------------------------------------------ */

static void test_alibi_8_heads(void **state)
{
    (void)state;
    float s[8];
    assert_int_equal(pos_alibi_slopes(s, 8, 8.0f), 0);
    for (int h = 0; h < 8; h++) /* 2^-1 ... 2^-8 */
        assert_float_equal(s[h], ldexpf(1.0f, -(h + 1)), 1e-9);
}

static void test_alibi_12_heads(void **state)
{
    (void)state;
    /* BLOOM's rule: slopes of the 8-head table, then every other slope of
     * the 16-head table: 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5. */
    const double want[12] = {0.5,       0.25,      0.125,     0.0625,
                             0.03125,   0.015625,  0.0078125, 0.00390625,
                             0.70710678, 0.35355339, 0.17677670, 0.08838835};
    float s[12];
    assert_int_equal(pos_alibi_slopes(s, 12, 8.0f), 0);
    for (int h = 0; h < 12; h++)
        assert_float_equal(s[h], want[h], 1e-6);
}

static void test_alibi_max_bias_and_errors(void **state)
{
    (void)state;
    float s[4];
    /* max_bias 16 over 4 heads: m0 = 2^-4, slopes 2^-4, 2^-8, 2^-12, 2^-16 */
    assert_int_equal(pos_alibi_slopes(s, 4, 16.0f), 0);
    for (int h = 0; h < 4; h++)
        assert_float_equal(s[h], ldexpf(1.0f, -4 * (h + 1)), 1e-12);
    assert_int_equal(pos_alibi_slopes(s, 0, 8.0f), -EINVAL);
    assert_int_equal(pos_alibi_slopes(s, 4, 0.0f), -EINVAL);
}

/* ------------------------------------------------------------------------
 * RoPE
 * ------------------------------------------------------------------------ */

static float frand(unsigned *seed)
{
    *seed = *seed * 1664525u + 1013904223u;
    return (float)((*seed >> 8) & 0xffff) / 32768.0f - 1.0f;
}

static double rotated_dot(const float *q, const float *k, int dim, int rot, int64_t m,
                          int64_t n, enum pos_rope_pairing pairing)
{
    double inv[128];
    float cs[256], qr[256], kr[256];
    pos_rope_inv_freq(inv, rot, 10000.0);
    memcpy(qr, q, sizeof(float) * (size_t)dim);
    memcpy(kr, k, sizeof(float) * (size_t)dim);
    pos_rope_cos_sin(cs, inv, rot, 1.0, m);
    pos_rope_apply(qr, cs, rot, pairing);
    pos_rope_cos_sin(cs, inv, rot, 1.0, n);
    pos_rope_apply(kr, cs, rot, pairing);
    double dot = 0;
    for (int i = 0; i < dim; i++)
        dot += (double)qr[i] * kr[i];
    return dot;
}

/* <rot(q, m), rot(k, n)> depends only on n - m, for both pairings. */
static void test_rope_relative(void **state)
{
    (void)state;
    unsigned seed = 42;
    const enum pos_rope_pairing pairings[2] = {POS_ROPE_ADJACENT, POS_ROPE_NEOX};
    const int64_t shifts[] = {1, 17, 1000, 100000};
    for (int p = 0; p < 2; p++) {
        for (int trial = 0; trial < 20; trial++) {
            int dim = 64, rot = trial % 2 ? 64 : 32; /* full and partial rotation */
            float q[64], k[64];
            for (int i = 0; i < dim; i++) {
                q[i] = frand(&seed);
                k[i] = frand(&seed);
            }
            int64_t m = (int64_t)(seed % 5000), n = (int64_t)((seed >> 7) % 5000);
            double base = rotated_dot(q, k, dim, rot, m, n, pairings[p]);
            for (size_t s = 0; s < sizeof(shifts) / sizeof(shifts[0]); s++) {
                double shifted = rotated_dot(q, k, dim, rot, m + shifts[s], n + shifts[s],
                                             pairings[p]);
                assert_float_equal(base, shifted, 1e-5);
            }
        }
    }
}

/* The two pairings rotate different elements: they must not agree. */
static void test_rope_pairings_differ(void **state)
{
    (void)state;
    double inv[4];
    float cs[8];
    pos_rope_inv_freq(inv, 8, 10000.0);
    assert_float_equal(inv[0], 1.0, 0);
    assert_float_equal(inv[1], pow(10000.0, -0.25), 1e-15);
    pos_rope_cos_sin(cs, inv, 8, 1.0, 3);
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8];
    memcpy(b, a, sizeof(a));
    pos_rope_apply(a, cs, 8, POS_ROPE_ADJACENT);
    pos_rope_apply(b, cs, 8, POS_ROPE_NEOX);
    /* adjacent: (x0, x1) rotated by angle 3 */
    assert_float_equal(a[0], 1 * cosf(3) - 2 * sinf(3), 1e-6);
    assert_float_equal(a[1], 1 * sinf(3) + 2 * cosf(3), 1e-6);
    /* neox: (x0, x4) rotated by angle 3 */
    assert_float_equal(b[0], 1 * cosf(3) - 5 * sinf(3), 1e-6);
    assert_float_equal(b[4], 1 * sinf(3) + 5 * cosf(3), 1e-6);
    /* linear scaling halves the angle */
    float cs2[8];
    pos_rope_cos_sin(cs2, inv, 8, 0.5, 6);
    for (int i = 0; i < 8; i++)
        assert_float_equal(cs2[i], cs[i], 1e-6);
}

/* ------------------------------------------------------------------------ */

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_t5_bidirectional_defaults),
        cmocka_unit_test(test_t5_causal_defaults),
        cmocka_unit_test(test_t5_cached_positions),
        cmocka_unit_test(test_t5_64_buckets),
        cmocka_unit_test(test_t5_two_token_sign),
        cmocka_unit_test(test_t5_degenerate_rejected),
        cmocka_unit_test(test_t5_odd_buckets),
        cmocka_unit_test(test_t5_lut_matches_function),
        cmocka_unit_test(test_t5_saturation),
        cmocka_unit_test(test_alibi_8_heads),
        cmocka_unit_test(test_alibi_12_heads),
        cmocka_unit_test(test_alibi_max_bias_and_errors),
        cmocka_unit_test(test_rope_relative),
        cmocka_unit_test(test_rope_pairings_differ),
    };
    return cmocka_run_group_tests_name("posenc", tests, NULL, NULL);
}
