/*
 * test_quant.c - weight formats and matrix products (model/quant.c,
 * model/matmul.c).
 *
 * Every decoder is checked against a second, deliberately plain
 * transcription of its format written here element by element; every
 * product against a double-precision product over the dequantised weights,
 * with a tolerance derived from what the kernel is allowed to change:
 *
 *   float weights      f32 summation only:
 *                      |err| <= (n_in + 16) * 2^-23 * sum_i |W[o][i] x[i]|
 *   quantised weights  activation rounding to 8 bits per block of 32 plus
 *                      the same f32 summation term:
 *                      |err| <= sum_b (0.5 * max_b|x| / 127) * sum_{i in b} |W[o][i]|
 *                               + (n_in + 16) * 2^-22 * sum_i mag[o][i] |x[i]|
 *                      where mag is |W| except for q4_K, whose two terms
 *                      (d*s*q and dmin*m) may cancel: there it is their sum;
 *                      and, against a product with the activations quantised
 *                      here exactly as the kernel does, the f32 term alone.
 *
 * Results must also be bit-identical for 1, 2 and 3 threads, and a token
 * computed alone must give what it gave inside a batch. The formats of
 * model/quant_blocks.c (q4_1, q5_0, q5_1, iq4_nl, q2_K, q3_K, q5_K), which
 * kvd only reads, are checked on random blocks against transcriptions of
 * their layouts written here, and their products (model/matmul_blocks.c)
 * with the same bounds, mins counted in mag as for q4_K.
 */
#include <errno.h>
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

#include "model/quant.h"
#include "tests/cpu_levels.h"

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static uint64_t rng_state;

static void rng_seed(uint64_t s)
{
    rng_state = s;
}

static uint64_t rng_u64(void) /* splitmix64 */
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float rng_unit(void) /* [-1, 1) */
{
    return (float)((double)(rng_u64() >> 11) * 0x1p-52 - 1.0);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* Reference binary16 value, from the definition. */
static double ref_f16(uint16_t h)
{
    int sign = h >> 15, exp = (h >> 10) & 31, man = h & 1023;
    double v;
    if (exp == 31)
        v = man ? NAN : INFINITY;
    else if (exp == 0)
        v = ldexp(man, -24);
    else
        v = ldexp(1024 + man, exp - 25);
    return sign ? -v : v;
}

/* ------------------------------------------------------------------------
 * Type table
 * ------------------------------------------------------------------------ */

static void test_type_table(void **state)
{
    (void)state;
    assert_string_equal(qt_type_name(GGML_TYPE_Q4_K), "q4_K");
    assert_string_equal(qt_type_name(GGML_TYPE_BF16), "bf16");
    assert_string_equal(qt_type_name(GGML_TYPE_Q5_1), "q5_1");
    assert_null(qt_type_name((enum ggml_type)4)); /* ids 4, 5 were removed from ggml */
    assert_null(qt_type_name((enum ggml_type)77));

    assert_true(qt_type_supported(GGML_TYPE_F32));
    assert_true(qt_type_supported(GGML_TYPE_Q6_K));
    assert_true(qt_type_supported(GGML_TYPE_Q5_K));
    assert_true(qt_type_supported(GGML_TYPE_IQ4_NL));
    assert_string_equal(qt_type_name(GGML_TYPE_IQ4_NL), "iq4_nl");
    assert_true(qt_type_supported(GGML_TYPE_IQ4_XS));
    assert_string_equal(qt_type_name(GGML_TYPE_IQ4_XS), "iq4_xs");
    assert_false(qt_type_supported(GGML_TYPE_Q8_K));
    assert_false(qt_type_supported((enum ggml_type) - 1));

    assert_int_equal(qt_row_bytes(GGML_TYPE_F32, 7), 28);
    assert_int_equal(qt_row_bytes(GGML_TYPE_F16, 7), 14);
    assert_int_equal(qt_row_bytes(GGML_TYPE_BF16, 7), 14);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q8_0, 64), 68);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q4_0, 96), 54);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q4_K, 512), 288);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q6_K, 256), 210);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q4_0, 48), 0);  /* not a multiple of 32 */
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q6_K, 128), 0); /* not a multiple of 256 */
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q8_K, 256), 0); /* unsupported */
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q5_K, 256), 176);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q3_K, 512), 220);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q2_K, 256), 84);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q5_1, 64), 48);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q5_0, 32), 22);
    assert_int_equal(qt_row_bytes(GGML_TYPE_Q4_1, 96), 60);
    assert_int_equal(qt_row_bytes(GGML_TYPE_IQ4_NL, 64), 36);
    assert_int_equal(qt_row_bytes(GGML_TYPE_IQ4_XS, 512), 272);
    assert_int_equal(qt_row_bytes(GGML_TYPE_IQ4_XS, 32), 0); /* super-blocks of 256 */
    assert_int_equal(qt_row_bytes(GGML_TYPE_F32, 0), 0);
    assert_int_equal(qt_block_elems(GGML_TYPE_Q4_K), 256);
    assert_int_equal(qt_block_bytes(GGML_TYPE_Q8_0), 34);
}

/* ------------------------------------------------------------------------
 * Half precision
 * ------------------------------------------------------------------------ */

static void test_f16_to_f32_exhaustive(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float got = qt_f16_to_f32((uint16_t)h);
        double want = ref_f16((uint16_t)h);
        if (isnan(want)) {
            assert_true(isnan(got));
            assert_int_equal(signbit(got) != 0, (h >> 15) != 0);
        } else {
            if ((double)got != want || !signbit(got) != !signbit(want))
                fail_msg("f16 0x%04x: got %a, want %a", (unsigned)h, (double)got, want);
        }
    }
}

/* Round trip of every f16, and every midpoint between neighbours (ties to even). */
static void test_f32_to_f16_rounding(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        uint16_t hh = (uint16_t)h;
        float f = qt_f16_to_f32(hh);
        uint16_t back = qt_f32_to_f16(f);
        if (isnan(f)) {
            assert_true((back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0);
            assert_int_equal(back >> 15, h >> 15);
            continue;
        }
        if (back != hh)
            fail_msg("round trip of f16 0x%04x gave 0x%04x", (unsigned)h, back);
        /* neighbours of the same sign, both finite: 0x0000..0x7bfe -> next up */
        if ((h & 0x7fff) >= 0x7bff)
            continue;
        uint16_t next = (uint16_t)(h + 1);
        double a = ref_f16(hh), b = ref_f16(next);
        float mid = (float)((a + b) / 2); /* 12 significant bits: exact in f32 */
        assert_true((double)mid == (a + b) / 2);
        uint16_t even = (hh & 1) ? next : hh;
        if (qt_f32_to_f16(mid) != even)
            fail_msg("midpoint %a of 0x%04x: got 0x%04x, want 0x%04x", (double)mid, (unsigned)h,
                     qt_f32_to_f16(mid), even);
        /* one f32 step away from zero rounds to next, one step toward zero to hh */
        float above = nextafterf(mid, signbit(mid) ? -INFINITY : INFINITY);
        float below = nextafterf(mid, 0.0f);
        assert_int_equal(qt_f32_to_f16(above), next);
        assert_int_equal(qt_f32_to_f16(below), hh);
    }
}

static void test_f16_specials(void **state)
{
    (void)state;
    assert_int_equal(qt_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(qt_f32_to_f16(65519.99f), 0x7bff);
    assert_int_equal(qt_f32_to_f16(65520.0f), 0x7c00); /* tie: to even = infinity */
    assert_int_equal(qt_f32_to_f16(-65520.0f), 0xfc00);
    assert_int_equal(qt_f32_to_f16(FLT_MAX), 0x7c00);
    assert_int_equal(qt_f32_to_f16(INFINITY), 0x7c00);
    assert_int_equal(qt_f32_to_f16(-INFINITY), 0xfc00);
    assert_int_equal(qt_f32_to_f16(-0.0f), 0x8000);
    assert_int_equal(qt_f32_to_f16(0x1p-25f), 0x0000); /* tie between 0 and 2^-24 */
    assert_int_equal(qt_f32_to_f16(nextafterf(0x1p-25f, 1.0f)), 0x0001);
    assert_int_equal(qt_f32_to_f16(0x1.8p-24f), 0x0002); /* tie between 1 and 2 */
    assert_int_equal(qt_f32_to_f16(FLT_MIN), 0x0000);
    assert_int_equal(qt_f32_to_f16(0x1p-14f), 0x0400);     /* smallest normal */
    assert_int_equal(qt_f32_to_f16(0x1.ff8p-15f), 0x03ff); /* largest subnormal */
    assert_int_equal(qt_f32_to_f16(0x1.ffcp-15f), 0x0400); /* tie: up to the even normal */
    /* NaNs stay NaN, even with a payload only in bits truncation would drop */
    uint16_t n1 = qt_f32_to_f16(bits_f32(0x7f800001));
    assert_true((n1 & 0x7c00) == 0x7c00 && (n1 & 0x3ff) != 0);
    uint16_t n2 = qt_f32_to_f16(bits_f32(0xffc00000));
    assert_true((n2 & 0x7c00) == 0x7c00 && (n2 & 0x3ff) != 0 && (n2 >> 15));
    assert_true(isinf(qt_f16_to_f32(0x7c00)) && qt_f16_to_f32(0x7c00) > 0);
    assert_true(isnan(qt_f16_to_f32(0x7c01)));
}

static void test_bf16(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = qt_bf16_to_f32((uint16_t)h);
        assert_int_equal(f32_bits(f), h << 16);
        uint16_t back = qt_f32_to_bf16(f);
        if (isnan(f)) {
            assert_true((back & 0x7f80) == 0x7f80 && (back & 0x7f) != 0);
            assert_int_equal(back >> 15, h >> 15);
            continue;
        }
        assert_int_equal(back, h);
        /* midpoint to the next pattern (same sign; skip into NaN/Inf) */
        if ((h & 0x7fff) >= 0x7f7f)
            continue;
        uint32_t mid = (h << 16) | 0x8000;
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        assert_int_equal(qt_f32_to_bf16(bits_f32(mid)), even);
        assert_int_equal(qt_f32_to_bf16(bits_f32(mid + 1)), h + 1);
        assert_int_equal(qt_f32_to_bf16(bits_f32(mid - 1)), h);
    }
    assert_int_equal(qt_f32_to_bf16(FLT_MAX), 0x7f80); /* rounds to infinity */
    assert_int_equal(qt_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(qt_f32_to_bf16(-INFINITY), 0xff80);
    uint16_t n = qt_f32_to_bf16(bits_f32(0x7f800001)); /* truncation alone gives inf */
    assert_true((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0);
    assert_true(isnan(qt_bf16_to_f32(qt_f32_to_bf16(NAN))));
}

/* Row conversions (SIMD) agree bit for bit with the scalar ones. */
static void test_half_rows(void **state)
{
    (void)state;
    enum { N = 65536 + 13 };
    uint16_t *h = malloc(sizeof(uint16_t) * N), *h2 = malloc(sizeof(uint16_t) * N);
    float *f = malloc(sizeof(float) * N);
    assert_non_null(h);
    assert_non_null(h2);
    assert_non_null(f);

    for (int i = 0; i < N; i++)
        h[i] = (uint16_t)(i * 40503u); /* every pattern, shuffled, plus a tail */
    qt_f16_to_f32_row(h, f, N);
    for (int i = 0; i < N; i++)
        assert_int_equal(f32_bits(f[i]), f32_bits(qt_f16_to_f32(h[i])));
    qt_bf16_to_f32_row(h, f, N);
    for (int i = 0; i < N; i++)
        assert_int_equal(f32_bits(f[i]), f32_bits(qt_bf16_to_f32(h[i])));

    rng_seed(11);
    for (int i = 0; i < N; i++) {
        uint32_t u = (uint32_t)rng_u64();
        if (i % 7 == 0) /* near ties: low 13 / 16 bits at the halfway point */
            u = (u & ~0xffffu) | (i % 14 ? 0x1000u : 0x8000u);
        f[i] = bits_f32(u);
    }
    f[3] = NAN;
    f[4] = INFINITY;
    f[5] = bits_f32(0x7f800001);
    f[6] = 65520.0f;
    f[9] = -0.0f;
    qt_f32_to_f16_row(f, h, N);
    for (int i = 0; i < N; i++)
        assert_int_equal(h[i], qt_f32_to_f16(f[i]));
    qt_f32_to_bf16_row(f, h2, N);
    for (int i = 0; i < N; i++)
        assert_int_equal(h2[i], qt_f32_to_bf16(f[i]));
    free(h);
    free(h2);
    free(f);
}

/* ------------------------------------------------------------------------
 * Quantising and dequantising the formats kvd writes
 * ------------------------------------------------------------------------ */

/* Random values whose magnitude varies per block of 32 (1e-3 .. 1e3). */
static void random_row(float *x, int n)
{
    for (int b = 0; b < n; b += 32) {
        float scale = powf(10.0f, 3.0f * rng_unit());
        for (int k = b; k < b + 32 && k < n; k++)
            x[k] = scale * rng_unit();
    }
}

static void test_known_blocks(void **state)
{
    (void)state;
    float y[32];
    /* q4_0: d = 0.5; qs[0] = 0x1f: element 0 is the low nibble (15), element 16 the high (1) */
    uint8_t q4[18] = {0};
    wr16(q4, 0x3800);
    q4[2] = 0x1f;
    q4[2 + 15] = 0x80;
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q4_0, q4, y, 32), 0);
    assert_true(y[0] == 3.5f && y[16] == -3.5f);
    assert_true(y[15] == -4.0f && y[31] == 0.0f);
    assert_true(y[1] == -4.0f && y[17] == -4.0f);
    /* q8_0: d = 0.25, q[3] = -100 */
    uint8_t q8[34] = {0};
    wr16(q8, 0x3400);
    q8[2 + 3] = (uint8_t)(int8_t)-100;
    q8[2 + 31] = 127;
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q8_0, q8, y, 32), 0);
    assert_true(y[3] == -25.0f && y[31] == 31.75f && y[0] == 0.0f);
}

static void check_quant_round_trip(enum ggml_type type)
{
    enum { N = 32 * 41 };
    float x[N], y[N];
    uint8_t buf[N * 4 + 1];
    rng_seed(1000 + (uint64_t)type);
    random_row(x, N);
    for (int k = 64; k < 96; k++) /* one all-zero block */
        x[k] = 0.0f;
    x[5] = 0.0f;
    uint8_t *dst = buf + 1; /* rows need not be aligned */
    assert_int_equal(qt_quantize_row(type, x, dst, N), 0);
    assert_int_equal(qt_dequantize_row(type, dst, y, N), 0);

    for (int b = 0; b < N; b += 32) {
        float amax = 0.0f;
        for (int k = b; k < b + 32; k++)
            amax = fmaxf(amax, fabsf(x[k]));
        for (int k = b; k < b + 32; k++) {
            double err = fabs((double)y[k] - x[k]), bound;
            switch (type) {
            case GGML_TYPE_F32:
                bound = 0;
                break;
            case GGML_TYPE_F16:
                bound = fabs(x[k]) * 0x1p-11 + 0x1p-25;
                break;
            case GGML_TYPE_BF16:
                bound = fabs(x[k]) * 0x1p-8;
                break;
            case GGML_TYPE_Q8_0:
                /* half a step of d = amax/127, plus the f16 rounding of d over 127 steps */
                bound = 0.5 * amax / 127 * (1 + 0x1p-10) + amax * 0x1p-11;
                break;
            case GGML_TYPE_Q4_1:
            case GGML_TYPE_Q5_1: /* half a step of the block's stored d */
                bound = 0.5 * qt_f16_to_f32(rd16(dst + qt_block_bytes(type) * (size_t)(b / 32))) *
                            (1 + 1e-5) +
                        1e-7 * fabs(x[k]);
                break;
            default: { /* Q4_0, Q5_0: half a step of amax/8 (/16); the far extreme may sit
                        * a full step off */
                const float s = type == GGML_TYPE_Q5_0 ? 16.0f : 8.0f;
                bound = (0.5 + s * 0x1p-11) * amax / s;
                if (fabsf(x[k]) > amax * (s - 0.6f) / s)
                    bound = (1 + s * 0x1p-11) * amax / s;
                break;
            }
            }
            if (err > bound)
                fail_msg("%s element %d: %g -> %g (err %g > %g)", qt_type_name(type), k,
                         (double)x[k], (double)y[k], err, bound);
        }
        if (amax == 0.0f)
            for (int k = b; k < b + 32; k++)
                assert_true(y[k] == 0.0f);
    }
    if (type != GGML_TYPE_Q4_1 && type != GGML_TYPE_Q5_1) /* a min's levels may miss 0 */
        assert_true(y[5] == 0.0f);
}

static void test_quant_f32(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_F32);
}

static void test_quant_f16(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_F16);
}

static void test_quant_bf16(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_BF16);
}

static void test_quant_q8_0(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_Q8_0);
}

static void test_quant_q4_0(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_Q4_0);
}

static void test_quant_q4_1_q5(void **state)
{
    (void)state;
    check_quant_round_trip(GGML_TYPE_Q4_1);
    check_quant_round_trip(GGML_TYPE_Q5_0);
    check_quant_round_trip(GGML_TYPE_Q5_1);
    /* a narrow range far from zero: the nearest f16 of the minimum (1000.5)
     * lies above it, so the min must be rounded down and the step up */
    float x[32], y[32];
    uint8_t b[24];
    for (int k = 0; k < 32; k++)
        x[k] = 1000.3f + 0.001f * (float)k;
    const enum ggml_type mins[2] = {GGML_TYPE_Q4_1, GGML_TYPE_Q5_1};
    for (int t = 0; t < 2; t++) {
        assert_int_equal(qt_quantize_row(mins[t], x, b, 32), 0);
        assert_int_equal(qt_dequantize_row(mins[t], b, y, 32), 0);
        const double half = 0.5 * qt_f16_to_f32(rd16(b)) * (1 + 1e-5) + 1e-7 * 1000.4;
        for (int k = 0; k < 32; k++)
            if (!(fabs((double)y[k] - x[k]) <= half))
                fail_msg("%s element %d: %.4f -> %.4f (half step %g)", qt_type_name(mins[t]), k,
                         (double)x[k], (double)y[k], half);
    }
}

/* q4_0 uses the full level range: the largest magnitude maps to level 0 (-8 d). */
static void test_quant_q4_0_levels(void **state)
{
    (void)state;
    float x[32], y[32];
    uint8_t b[18];
    for (int k = 0; k < 32; k++)
        x[k] = (float)(k - 16) / 2; /* -8 .. 7.5 */
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q4_0, x, b, 32), 0);
    assert_true(qt_f16_to_f32(rd16(b)) == 1.0f); /* d = -(-8) / 8 */
    assert_int_equal(b[2] & 0x0f, 0);            /* x[0] = -8 -> level 0 */
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q4_0, b, y, 32), 0);
    for (int k = 0; k < 32; k++)
        assert_true(fabsf(y[k] - x[k]) <= 0.5f);
    /* same largest magnitude but positive: the scale turns negative */
    for (int k = 0; k < 32; k++)
        x[k] = -x[k];
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q4_0, x, b, 32), 0);
    assert_true(qt_f16_to_f32(rd16(b)) == -1.0f);
}

static void test_quant_errors(void **state)
{
    (void)state;
    float x[64] = {0};
    uint8_t b[256];
    assert_int_equal(qt_quantize_row(GGML_TYPE_IQ4_NL, x, b, 32), -EINVAL); /* read-only */
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_1, x, b, 32), -EINVAL);
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, b, 48), -EINVAL);
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, b, 0), -EINVAL);
    x[7] = NAN;
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, b, 32), -EINVAL);
    x[7] = INFINITY;
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q4_0, x, b, 32), -EINVAL);
    x[7] = 1e10f; /* d = 1e10 / 127 does not fit in f16 */
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, b, 32), -ERANGE);
    x[7] = 1e6f;
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q4_0, x, b, 32), -ERANGE);
    float y[32];
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q8_K, b, y, 256), -EINVAL);
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q8_0, b, y, 31), -EINVAL);
}

/* ------------------------------------------------------------------------
 * q4_K and q6_K: hand-built blocks against a plain transcription
 * ------------------------------------------------------------------------ */

/* A finite f16 scale of moderate size, either sign. */
static uint16_t random_scale(float lo, float hi)
{
    float v = lo + (hi - lo) * (rng_unit() + 1) / 2;
    return qt_f32_to_f16((rng_u64() & 1) ? -v : v);
}

static void random_k_blocks(enum ggml_type type, uint8_t *p, int n_blocks)
{
    size_t bb = qt_block_bytes(type);
    for (size_t i = 0; i < bb * (size_t)n_blocks; i++)
        p[i] = (uint8_t)rng_u64();
    for (int i = 0; i < n_blocks; i++, p += bb) {
        if (type == GGML_TYPE_Q4_K) {
            wr16(p + 0, random_scale(0.001f, 0.05f)); /* d */
            wr16(p + 2, random_scale(0.001f, 0.05f)); /* dmin */
        } else {
            wr16(p + 208, random_scale(0.0005f, 0.02f));
        }
    }
}

/*
 * q4_K from its description: 6-bit scales sc[0..7] and mins m[0..7];
 * sc[i], m[i] for i < 4 are the low six bits of bytes i and 4+i; for
 * i = 4..7 the low four bits come from byte 8+(i-4) (scale: low nibble,
 * min: high nibble) and the top two from the top two bits of byte i-4
 * (scale) and byte i (min). Element e is nibble (e/32 odd: high) of
 * qs[32*(e/64) + e%32], value d*sc[e/32]*q - dmin*m[e/32]. *mag gets
 * |d*sc*q| + |dmin*m|.
 */
/* The eight 6-bit scales and mins of q4_K and q5_K (12 bytes at s). */
static void plain_k_scales(const uint8_t *s, int *sc, int *m)
{
    for (int i = 0; i < 4; i++) {
        sc[i] = s[i] & 0x3f;
        m[i] = s[4 + i] & 0x3f;
        sc[4 + i] = (s[8 + i] & 0x0f) + 16 * (s[i] >> 6);
        m[4 + i] = (s[8 + i] >> 4) + 16 * (s[4 + i] >> 6);
    }
}

static void plain_q4_K(const uint8_t *blk, float *y, float *mag)
{
    double d = ref_f16(rd16(blk)), dmin = ref_f16(rd16(blk + 2));
    const uint8_t *s = blk + 4, *qs = blk + 16;
    int sc[8], m[8];
    plain_k_scales(s, sc, m);
    for (int e = 0; e < 256; e++) {
        int j = e / 32;
        uint8_t byte = qs[32 * (e / 64) + e % 32];
        int q = (j % 2) ? byte >> 4 : byte & 0x0f;
        y[e] = (float)(d * sc[j] * q - dmin * m[j]);
        mag[e] = (float)(fabs(d * sc[j] * q) + fabs(dmin * m[j]));
    }
}

/*
 * q6_K from its description: element e lies in half h = e/128; with
 * r = e%128, k = r/32, l = r%32 its low four bits are nibble (k >= 2: high)
 * of ql[64h + 32(k%2) + l] and its high two bits are bits 2k..2k+1 of
 * qh[32h + l]; value d * scales[e/16] * (q - 32).
 */
static void plain_q6_K(const uint8_t *blk, float *y, float *mag)
{
    const uint8_t *ql = blk, *qh = blk + 128;
    const int8_t *scales = (const int8_t *)(blk + 192);
    double d = ref_f16(rd16(blk + 208));
    for (int e = 0; e < 256; e++) {
        int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
        uint8_t lb = ql[64 * h + 32 * (k % 2) + l];
        int low = k >= 2 ? lb >> 4 : lb & 0x0f;
        int high = (qh[32 * h + l] >> (2 * k)) & 3;
        int q = low + 16 * high;
        y[e] = (float)(d * scales[e / 16] * (q - 32));
        mag[e] = fabsf(y[e]);
    }
}

static void check_k_dequant(enum ggml_type type)
{
    enum { NSB = 5 };
    uint8_t raw[NSB * 210 + 1];
    uint8_t *blk = raw + 1; /* unaligned on purpose */
    float y[NSB * 256], want[256], mag[256];
    rng_seed(500 + (uint64_t)type);
    random_k_blocks(type, blk, NSB);
    assert_int_equal(qt_dequantize_row(type, blk, y, NSB * 256), 0);
    size_t bb = qt_block_bytes(type);
    for (int i = 0; i < NSB; i++) {
        if (type == GGML_TYPE_Q4_K)
            plain_q4_K(blk + bb * (size_t)i, want, mag);
        else
            plain_q6_K(blk + bb * (size_t)i, want, mag);
        for (int e = 0; e < 256; e++) {
            float got = y[256 * i + e];
            if (fabsf(got - want[e]) > 1e-6f * mag[e])
                fail_msg("%s block %d element %d: got %g, want %g", qt_type_name(type), i, e,
                         (double)got, (double)want[e]);
        }
    }
}

static void test_q4_K_dequant(void **state)
{
    (void)state;
    check_k_dequant(GGML_TYPE_Q4_K);
}

static void test_q6_K_dequant(void **state)
{
    (void)state;
    check_k_dequant(GGML_TYPE_Q6_K);
}

/* Known answers: scales and mins packed by hand, every nibble 3. */
static void test_q4_K_known(void **state)
{
    (void)state;
    uint8_t b[144] = {0};
    int sc[8] = {1, 2, 63, 4, 17, 33, 48, 63}, m[8] = {0, 5, 6, 7, 31, 16, 1, 62};
    wr16(b, 0x3c00);     /* d = 1 */
    wr16(b + 2, 0x3800); /* dmin = 0.5 */
    for (int i = 0; i < 4; i++) {
        b[4 + i] = (uint8_t)(sc[i] | ((sc[4 + i] >> 4) << 6));
        b[8 + i] = (uint8_t)(m[i] | ((m[4 + i] >> 4) << 6));
        b[12 + i] = (uint8_t)((sc[4 + i] & 15) | ((m[4 + i] & 15) << 4));
    }
    memset(b + 16, 0x33, 128);
    float y[256];
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q4_K, b, y, 256), 0);
    for (int e = 0; e < 256; e++)
        assert_true(y[e] == (float)(3 * sc[e / 32]) - 0.5f * (float)m[e / 32]);
}

/* Known answers: q6_K with q = element index % 64 laid out by hand. */
static void test_q6_K_known(void **state)
{
    (void)state;
    uint8_t b[210] = {0};
    int qv[256];
    for (int e = 0; e < 256; e++)
        qv[e] = (e * 7 + 3) % 64;
    for (int e = 0; e < 256; e++) {
        int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
        b[64 * h + 32 * (k % 2) + l] |= (uint8_t)((qv[e] & 15) << (k >= 2 ? 4 : 0));
        b[128 + 32 * h + l] |= (uint8_t)((qv[e] >> 4) << (2 * k));
    }
    for (int g = 0; g < 16; g++)
        b[192 + g] = (uint8_t)(int8_t)(g % 2 ? -g : g + 1);
    wr16(b + 208, 0x3800); /* d = 0.5 */
    float y[256];
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q6_K, b, y, 256), 0);
    for (int e = 0; e < 256; e++) {
        int g = e / 16, s = g % 2 ? -g : g + 1;
        assert_true(y[e] == 0.5f * (float)s * (float)(qv[e] - 32));
    }
}

/* ------------------------------------------------------------------------
 * The read-only block formats: random blocks against plain transcriptions
 * ------------------------------------------------------------------------ */

/* Offsets of the f16 scale fields of each read-only format (-1: none). */
static void scale_fields(enum ggml_type type, int *d, int *m)
{
    *m = -1;
    switch (type) {
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_Q5_K:
        *d = 0, *m = 2;
        break;
    case GGML_TYPE_Q2_K:
        *d = 80, *m = 82;
        break;
    case GGML_TYPE_Q3_K:
        *d = 108;
        break;
    default: /* q5_0, iq4_nl, iq4_xs */
        *d = 0;
        break;
    }
}

static bool read_only_type(enum ggml_type type)
{
    return type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1 ||
           type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K ||
           type == GGML_TYPE_Q5_K || type == GGML_TYPE_IQ4_XS;
}

/* Random bytes with finite, moderate scales of either sign. */
static void random_ro_blocks(enum ggml_type type, uint8_t *p, int n_blocks)
{
    size_t bb = qt_block_bytes(type);
    int d, m;
    scale_fields(type, &d, &m);
    for (size_t i = 0; i < bb * (size_t)n_blocks; i++)
        p[i] = (uint8_t)rng_u64();
    for (int i = 0; i < n_blocks; i++, p += bb) {
        wr16(p + d, random_scale(0.001f, 0.05f));
        if (m >= 0)
            wr16(p + m, random_scale(0.001f, 0.05f));
    }
}

/* The nibble of element e (< 32) of a small block's qs[16]: low nibbles
 * are elements 0..15, high nibbles 16..31. */
static int nibble(const uint8_t *qs, int e)
{
    return e < 16 ? qs[e] & 15 : qs[e - 16] >> 4;
}

/* iq4_nl's (and iq4_xs's) 16 levels. */
static const int IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                   1,    13,   25,  38,  53,  69,  89,  113};

/* q4_1, q5_0, q5_1, iq4_nl: one block of 32 from its description. */
static void plain_small(enum ggml_type type, const uint8_t *blk, float *y, float *mag)
{
    const int *levels = IQ4_LEVELS;
    double d = ref_f16(rd16(blk)), m = 0;
    for (int e = 0; e < 32; e++) {
        double v;
        if (type == GGML_TYPE_Q4_1) {
            m = ref_f16(rd16(blk + 2));
            v = d * nibble(blk + 4, e) + m;
        } else if (type == GGML_TYPE_IQ4_NL) {
            v = d * levels[nibble(blk + 2, e)];
        } else {
            bool one = type == GGML_TYPE_Q5_1;
            const uint8_t *qh = blk + (one ? 4 : 2), *qs = blk + (one ? 8 : 6);
            int high = (qh[e / 8] >> (e % 8)) & 1; /* bit e of the little-endian u32 */
            int q = nibble(qs, e) + 16 * high;
            m = one ? ref_f16(rd16(blk + 2)) : 0;
            v = one ? d * q + m : d * (q - 16);
        }
        y[e] = (float)v;
        mag[e] = (float)(fabs(v - m) + fabs(m));
    }
}

/* q2_K: element e = 128h + 32j + l takes bits 2j, 2j+1 of qs[32h + l];
 * scales[e/16]: low nibble the scale, high nibble the min. */
static void plain_q2_K(const uint8_t *blk, float *y, float *mag)
{
    const uint8_t *sc = blk, *qs = blk + 16;
    double d = ref_f16(rd16(blk + 80)), dmin = ref_f16(rd16(blk + 82));
    for (int e = 0; e < 256; e++) {
        int h = e / 128, j = e % 128 / 32, l = e % 32;
        int q = (qs[32 * h + l] >> (2 * j)) & 3;
        double a = d * (sc[e / 16] & 15) * q, b = dmin * (sc[e / 16] >> 4);
        y[e] = (float)(a - b);
        mag[e] = (float)(fabs(a) + fabs(b));
    }
}

/* q3_K: the sixteen 6-bit scales unpacked word-wise (bytes 0..3 and 4..7
 * give the low nibbles, bytes 8..11 two bits each), element e = 128h + 32j
 * + l: two bits of qs[32h + l] at 2j, minus 4 unless bit 4h + j of
 * hmask[l] is set. */
static void plain_q3_K(const uint8_t *blk, float *y, float *mag)
{
    const uint8_t *hm = blk, *qs = blk + 32, *sb = blk + 96;
    uint32_t a0, a1, tmp, words[4];
    memcpy(&a0, sb, 4);
    memcpy(&a1, sb + 4, 4);
    memcpy(&tmp, sb + 8, 4);
    words[0] = (a0 & 0x0f0f0f0f) | ((tmp & 0x03030303) << 4);
    words[1] = (a1 & 0x0f0f0f0f) | (((tmp >> 2) & 0x03030303) << 4);
    words[2] = ((a0 >> 4) & 0x0f0f0f0f) | (((tmp >> 4) & 0x03030303) << 4);
    words[3] = ((a1 >> 4) & 0x0f0f0f0f) | (((tmp >> 6) & 0x03030303) << 4);
    uint8_t scales[16];
    memcpy(scales, words, 16);
    double d = ref_f16(rd16(blk + 108));
    for (int e = 0; e < 256; e++) {
        int h = e / 128, j = e % 128 / 32, l = e % 32;
        int q = ((qs[32 * h + l] >> (2 * j)) & 3) - (((hm[l] >> (4 * h + j)) & 1) ? 0 : 4);
        y[e] = (float)(d * (scales[e / 16] - 32) * q);
        mag[e] = fabsf(y[e]);
    }
}

/* q5_K: q4_K's scales and mins; sub-block j = e/32 takes nibble (j odd:
 * high) of qs[32(j/2) + l] and bit j of qh[l] as its fifth bit. */
static void plain_q5_K(const uint8_t *blk, float *y, float *mag)
{
    double d = ref_f16(rd16(blk)), dmin = ref_f16(rd16(blk + 2));
    const uint8_t *s = blk + 4, *qh = blk + 16, *qs = blk + 48;
    int sc[8], m[8];
    plain_k_scales(s, sc, m);
    for (int e = 0; e < 256; e++) {
        int j = e / 32, l = e % 32;
        uint8_t byte = qs[32 * (j / 2) + l];
        int q = (j % 2 ? byte >> 4 : byte & 15) + 16 * ((qh[l] >> j) & 1);
        double a = d * sc[j] * q, b = dmin * m[j];
        y[e] = (float)(a - b);
        mag[e] = (float)(fabs(a) + fabs(b));
    }
}

/* iq4_xs: sub-block j's 6-bit scale, low nibble from scales_l[j/2] (byte
 * 4 + j/2; odd j the high nibble), top bits 2j.. of scales_h (bytes 2, 3),
 * minus 32; its elements iq4_nl's levels of the nibbles of qs[16j..]. */
static void plain_iq4_xs(const uint8_t *blk, float *y, float *mag)
{
    double d = ref_f16(rd16(blk));
    unsigned scales_h = blk[2] | (unsigned)blk[3] << 8;
    for (int e = 0; e < 256; e++) {
        int j = e / 32, l = e % 32;
        int ls = ((j % 2 ? blk[4 + j / 2] >> 4 : blk[4 + j / 2]) & 15) |
                 (int)((scales_h >> (2 * j)) & 3) << 4;
        y[e] = (float)(d * (ls - 32) * IQ4_LEVELS[nibble(blk + 8 + 16 * j, l)]);
        mag[e] = fabsf(y[e]);
    }
}

/* One block of any read-only format; returns its elements. */
static int plain_ro_block(enum ggml_type type, const uint8_t *blk, float *y, float *mag)
{
    switch (type) {
    case GGML_TYPE_Q2_K:
        plain_q2_K(blk, y, mag);
        return 256;
    case GGML_TYPE_Q3_K:
        plain_q3_K(blk, y, mag);
        return 256;
    case GGML_TYPE_Q5_K:
        plain_q5_K(blk, y, mag);
        return 256;
    case GGML_TYPE_IQ4_XS:
        plain_iq4_xs(blk, y, mag);
        return 256;
    default:
        plain_small(type, blk, y, mag);
        return 32;
    }
}

#define N_RO_TYPES 8
static const enum ggml_type RO_TYPES[N_RO_TYPES] = {
    GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1, GGML_TYPE_IQ4_NL,
    GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q5_K, GGML_TYPE_IQ4_XS};

/* 64 random blocks of each format (every bit pattern of every quantum
 * field occurs), unaligned, decoded and compared element by element. */
static void test_read_only_dequant(void **state)
{
    (void)state;
    enum { NB = 64 };
    for (int k = 0; k < N_RO_TYPES; k++) {
        enum ggml_type type = RO_TYPES[k];
        size_t bb = qt_block_bytes(type);
        int be = qt_block_elems(type);
        uint8_t *raw = malloc(bb * NB + 1), *blk = raw + 1;
        float *y = malloc(sizeof(float) * (size_t)be * NB), want[256], mag[256];
        assert_true(raw && y);
        rng_seed(700 + (uint64_t)type);
        random_ro_blocks(type, blk, NB);
        assert_int_equal(qt_dequantize_row(type, blk, y, be * NB), 0);
        for (int i = 0; i < NB; i++) {
            assert_int_equal(plain_ro_block(type, blk + bb * (size_t)i, want, mag), be);
            for (int e = 0; e < be; e++)
                if (fabsf(y[be * i + e] - want[e]) > 1e-6f * mag[e])
                    fail_msg("%s block %d element %d: got %g, want %g", qt_type_name(type), i, e,
                             (double)y[be * i + e], (double)want[e]);
        }
        assert_int_equal(qt_dequantize_row(type, blk, y, be + 32 * (be == 32)), 0);
        if (be == 256)
            assert_int_equal(qt_dequantize_row(type, blk, y, 128), -EINVAL);
        free(raw);
        free(y);
    }
}

/* Hand-built blocks: every iq4_nl level and every q5_0 quantum in place. */
static void test_read_only_known(void **state)
{
    (void)state;
    float y[32];
    uint8_t iq[18] = {0};
    wr16(iq, 0x3c00); /* d = 1 */
    for (int k = 0; k < 16; k++)
        iq[2 + k] = (uint8_t)(k | (15 - k) << 4);
    assert_int_equal(qt_dequantize_row(GGML_TYPE_IQ4_NL, iq, y, 32), 0);
    assert_true(y[0] == -127.0f && y[8] == 1.0f && y[15] == 113.0f);
    assert_true(y[16] == 113.0f && y[31] == -127.0f && y[7] == -10.0f);
    uint8_t q5[22] = {0};
    wr16(q5, 0x3800); /* d = 0.5 */
    uint32_t qh = 0;
    for (int e = 0; e < 32; e++) /* element e holds quantum e: nibble e % 16, fifth bit e >= 16 */
        qh |= (uint32_t)(e >= 16) << e;
    memcpy(q5 + 2, &qh, 4);
    for (int k = 0; k < 16; k++)
        q5[6 + k] = (uint8_t)(k | k << 4);
    assert_int_equal(qt_dequantize_row(GGML_TYPE_Q5_0, q5, y, 32), 0);
    for (int e = 0; e < 32; e++)
        assert_true(y[e] == 0.5f * (float)(e - 16));

    /* iq4_xs: eight sub-blocks with scales at the edges of the 6 bits
     * (ls - 32 from -32 to 31), element l of sub-block j the level l % 16. */
    static const int ls[8] = {33, 34, 0, 63, 32, 48, 16, 1};
    uint8_t xs[136] = {0};
    wr16(xs, 0x3800); /* d = 0.5 */
    unsigned scales_h = 0;
    for (int j = 0; j < 8; j++) {
        xs[4 + j / 2] |= (uint8_t)((ls[j] & 15) << (4 * (j % 2)));
        scales_h |= (unsigned)(ls[j] >> 4) << (2 * j);
        for (int k = 0; k < 16; k++)
            xs[8 + 16 * j + k] = (uint8_t)(k | k << 4);
    }
    wr16(xs + 2, (uint16_t)scales_h);
    float z[256];
    assert_int_equal(qt_dequantize_row(GGML_TYPE_IQ4_XS, xs, z, 256), 0);
    for (int e = 0; e < 256; e++)
        if (z[e] != 0.5f * (float)(ls[e / 32] - 32) * (float)IQ4_LEVELS[e % 16])
            fail_msg("iq4_xs element %d: got %g", e, (double)z[e]);
}

/* ------------------------------------------------------------------------
 * Matrix products
 * ------------------------------------------------------------------------ */

static void fill_weights(enum ggml_type type, uint8_t *data, int n_in, int n_out)
{
    size_t rb = qt_row_bytes(type, n_in);
    if (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q6_K) {
        random_k_blocks(type, data, (int)(rb / qt_block_bytes(type)) * n_out);
        return;
    }
    if (read_only_type(type)) {
        random_ro_blocks(type, data, (int)(rb / qt_block_bytes(type)) * n_out);
        return;
    }
    float *row = malloc(sizeof(float) * (size_t)n_in);
    assert_non_null(row);
    for (int o = 0; o < n_out; o++) {
        for (int i = 0; i < n_in; i++)
            row[i] = rng_unit();
        if (o == 1)
            for (int i = 0; i < n_in && i < 32; i++)
                row[i] = 0.0f; /* a zero block */
        assert_int_equal(qt_quantize_row(type, row, data + rb * (size_t)o, n_in), 0);
    }
    free(row);
}

/* mag[o][i] for the tolerance: |W| except q4_K (sum of its two terms). */
static void weight_magnitudes(enum ggml_type type, const uint8_t *data, const float *W, int n_in,
                              int n_out, float *mag)
{
    size_t n = (size_t)n_in * (size_t)n_out;
    if (read_only_type(type)) {
        float y[256];
        size_t bb = qt_block_bytes(type);
        for (size_t i = 0, blk = 0; i < n; blk++)
            i += (size_t)plain_ro_block(type, data + bb * blk, y, mag + i);
        return;
    }
    if (type != GGML_TYPE_Q4_K) {
        for (size_t i = 0; i < n; i++)
            mag[i] = fabsf(W[i]);
        return;
    }
    float y[256];
    for (size_t s = 0; s < n / 256; s++)
        plain_q4_K(data + 144 * s, y, mag + 256 * s);
}

static void check_matmul(enum ggml_type type, int n_in, int n_out, int n_tok)
{
    const bool quantised =
        !(type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16);
    size_t rb = qt_row_bytes(type, n_in);
    assert_true(rb > 0);
    uint8_t *raw = malloc(rb * (size_t)n_out + 1);
    float *W = malloc(sizeof(float) * (size_t)n_in * (size_t)n_out);
    float *mag = malloc(sizeof(float) * (size_t)n_in * (size_t)n_out);
    float *x = malloc(sizeof(float) * (size_t)n_in * (size_t)n_tok);
    float *out[4];
    for (int k = 0; k < 4; k++)
        out[k] = malloc(sizeof(float) * (size_t)n_out * (size_t)n_tok);
    assert_non_null(raw);
    assert_non_null(W);
    assert_non_null(mag);
    assert_non_null(x);
    /* odd byte offset for the quantised formats (rows are unaligned anyway) */
    uint8_t *data = raw + (quantised ? 1 : 0);

    rng_seed(((uint64_t)type << 32) ^ ((uint64_t)n_in << 16) ^ ((uint64_t)n_out << 8) ^
             (uint64_t)n_tok);
    fill_weights(type, data, n_in, n_out);
    for (int o = 0; o < n_out; o++)
        assert_int_equal(qt_dequantize_row(type, data + rb * (size_t)o, W + (size_t)o * n_in, n_in),
                         0);
    weight_magnitudes(type, data, W, n_in, n_out, mag);
    for (int t = 0; t < n_tok; t++)
        random_row(x + (size_t)t * n_in, n_in);
    if (n_tok > 1 && n_in >= 64)
        for (int i = 32; i < 64; i++)
            x[(size_t)n_in + i] = 0.0f; /* an all-zero activation block */

    float *xhat = malloc(sizeof(float) * (size_t)n_in * (size_t)n_tok);
    assert_non_null(xhat);

    struct mm_weight w;
    char err[160];
    assert_int_equal(mm_weight_init(&w, type, n_in, n_out, data, err, sizeof err), 0);
    assert_int_equal(w.row_bytes, rb);

    /* pass 0: the rows as stored; pass 1: repacked (mm_pack_weight), when the
     * level in use has kernels over repacked weights of this type */
    void *packed = NULL;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            size_t pb = mm_pack_bytes(&w);
            if (!pb)
                break;
            packed = aligned_alloc(64, (pb + 63) / 64 * 64);
            assert_non_null(packed);
            mm_pack_weight(&w, packed);
            assert_ptr_equal(w.packed, packed);
            assert_true(mm_pack_ready(&w));
        }
        /* the activations as the kernel quantises them (quant.h): per block
         * of 32 (of 256 for the K formats, matmul_k.c, but 32 for repacked
         * q4_K, matmul_pack.c), d = max|x| / 127 and q = round-to-even(x *
         * (127 / max|x|)) in f32 */
        const int ab = mm_k_type(type) && !(pass && type == GGML_TYPE_Q4_K) ? 256 : 32;
        for (size_t b = 0; quantised && b < (size_t)n_in * n_tok; b += ab) {
            float amax = 0.0f;
            for (size_t i = b; i < b + ab; i++)
                amax = fmaxf(amax, fabsf(x[i]));
            float id = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
            for (size_t i = b; i < b + ab; i++)
                xhat[i] = d * nearbyintf(x[i] * id);
        }
        char tname[64];
        snprintf(tname, sizeof tname, "%s%s", qt_type_name(type), pass ? " (repacked)" : "");
        const int threads[3] = {1, 2, 3};
        for (int k = 0; k < 3; k++) {
            for (size_t i = 0; i < (size_t)n_out * n_tok; i++)
                out[k][i] = NAN; /* every output must be written */
            assert_int_equal(mm_matmul(out[k], &w, x, n_tok, threads[k]), 0);
        }
        /* caller-provided scratch gives the same result */
        size_t sb = mm_scratch_bytes(&w, n_tok, 2);
        /* float activations are read in place, except rounded for bf16 pairs;
         * repacked f16 weights of 3+ tokens are widened into each thread's
         * f32 copy of a pair of groups */
        const bool f16_wide = pass && !w.packed_bf16 && type == GGML_TYPE_F16 && n_tok > 2;
        assert_true(quantised || (pass && w.packed_bf16) || f16_wide ? sb > 0 : sb == 0);
        void *scratch = sb ? aligned_alloc(64, (sb + 63) / 64 * 64) : NULL;

        /* batch invariance: a token alone gives bit for bit what it gave in the batch */
        for (int t = 0; t < n_tok; t += (n_tok > 2 ? n_tok / 2 : 1)) {
            assert_int_equal(mm_matmul(out[3], &w, x + (size_t)t * n_in, 1, 2), 0);
            for (int o = 0; o < n_out; o++)
                if (f32_bits(out[3][o]) != f32_bits(out[0][(size_t)t * n_out + o]))
                    fail_msg("%s: token %d alone differs from token %d of %d at row %d", tname, t,
                             t, n_tok, o);
        }
        mm_matmul_scratch(out[3], &w, x, n_tok, 2, scratch);
        free(scratch);

        for (int t = 0; t < n_tok; t++) {
            const float *xt = x + (size_t)t * n_in;
            for (int o = 0; o < n_out; o++) {
                const float *wo = W + (size_t)o * n_in, *mo = mag + (size_t)o * n_in;
                double ref = 0, absum = 0, qbound = 0;
                for (int i = 0; i < n_in; i++) {
                    ref += (double)wo[i] * xt[i];
                    absum += (double)mo[i] * fabs(xt[i]);
                }
                double tol;
                if (quantised) {
                    for (int b = 0; b < n_in; b += ab) {
                        double amax = 0, wsum = 0;
                        for (int i = b; i < b + ab; i++) {
                            amax = fmax(amax, fabs(xt[i]));
                            wsum += fabs(wo[i]);
                        }
                        qbound += 0.5 * amax / 127 * (1 + 1e-5) * wsum;
                    }
                    tol = qbound + (n_in + 16) * 0x1p-22 * absum;
                } else {
                    tol = (n_in + 16) * 0x1p-23 * absum;
                    if (pass && w.packed_bf16) /* activations rounded to bf16 (test_bf16.c) */
                        tol += 0x1p-8 * absum;
                }
                size_t at = (size_t)t * n_out + o;
                double got = out[0][at];
                if (!(fabs(got - ref) <= tol))
                    fail_msg("%s %dx%d tok %d/%d row %d: got %.9g, want %.9g (tol %.3g)", tname,
                             n_out, n_in, t, n_tok, o, got, ref, tol);
                if (quantised) {
                    /* against the same quantised activations: only f32 rounding remains */
                    const float *xh = xhat + (size_t)t * n_in;
                    double ref2 = 0, absum2 = 0;
                    for (int i = 0; i < n_in; i++) {
                        ref2 += (double)wo[i] * xh[i];
                        absum2 += (double)mo[i] * fabs(xh[i]);
                    }
                    double tol2 = (n_in + 16) * 0x1p-22 * absum2;
                    if (!(fabs(got - ref2) <= tol2))
                        fail_msg("%s %dx%d tok %d/%d row %d: got %.9g, want %.9g with the "
                                 "activations quantised (tol %.3g)",
                                 tname, n_out, n_in, t, n_tok, o, got, ref2, tol2);
                }
                for (int k = 1; k < 4; k++)
                    if (f32_bits(out[k][at]) != f32_bits(out[0][at]))
                        fail_msg("%s: run %d differs from the 1-thread result at tok %d row %d",
                                 tname, k, t, o);
            }
        }
    }
    free(packed);
    free(raw);
    free(W);
    free(mag);
    free(x);
    free(xhat);
    for (int k = 0; k < 4; k++)
        free(out[k]);
}

/*
 * n_out 1, 7, 37 (not multiples of the row tile or group); n_tok 1, 3, 5,
 * 17; at every kernel level the CPU runs, each forced in turn (so an
 * AVX-512 machine tests the AVX2 and scalar copies too), each against the
 * double-precision reference.
 */
static void check_matmul_shapes(enum ggml_type type, const int *n_ins, int n_n_in)
{
    const int n_outs[3] = {1, 7, 37}, n_toks[4] = {1, 3, 5, 17};
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int l = 0; l < n_levels; l++) {
        cl_force(levels[l]);
        for (int a = 0; a < n_n_in; a++)
            for (int b = 0; b < 3; b++)
                for (int c = 0; c < 4; c++)
                    check_matmul(type, n_ins[a], n_outs[b], n_toks[c]);
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

static void test_matmul_f32(void **state)
{
    (void)state;
    const int n_in[4] = {1, 37, 64, 200};
    check_matmul_shapes(GGML_TYPE_F32, n_in, 4);
}

static void test_matmul_f16(void **state)
{
    (void)state;
    const int n_in[3] = {5, 64, 263};
    check_matmul_shapes(GGML_TYPE_F16, n_in, 3);
}

static void test_matmul_bf16(void **state)
{
    (void)state;
    const int n_in[3] = {5, 64, 263};
    check_matmul_shapes(GGML_TYPE_BF16, n_in, 3);
}

static void test_matmul_q8_0(void **state)
{
    (void)state;
    const int n_in[3] = {32, 96, 320};
    check_matmul_shapes(GGML_TYPE_Q8_0, n_in, 3);
}

/* Decoding's narrow tiles (matmul_pack.c: up to 8 row groups of float
 * weights and of one q8_0 token, 4 for two q8_0 tokens, as many pairs as
 * a thread's share holds): heights
 * whose shares give tiles of every group count from 1 to 8 at 1, 2 and 3
 * threads (200 rows: 13 groups, an odd last pair; 240: 15), 1 to 3 tokens,
 * each against the reference and bit for bit in a batch and alone. */
static void test_matmul_narrow(void **state)
{
    (void)state;
    const enum ggml_type types[4] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0};
    const int n_out[2] = {200, 240};
    for (int k = 0; k < 4; k++)
        for (int o = 0; o < 2; o++)
            for (int nt = 1; nt <= 3; nt++)
                check_matmul(types[k], 96, n_out[o], nt);
}

static void test_matmul_q4_0(void **state)
{
    (void)state;
    const int n_in[3] = {32, 96, 320};
    check_matmul_shapes(GGML_TYPE_Q4_0, n_in, 3);
}

/*
 * q4_0, q5_0 and iq4_nl repacked as their nibbles (and fifth bits,
 * matmul_pack_run.c) give bit for bit what q8_0 gives on the same numbers:
 * a q8_0 copy of the rows made here from their dequantised values (each
 * value over its block's scale, an integer), at 1 and 5 tokens, 1 and 2
 * threads; their copies take the stored bytes per block against q8_0's 34.
 */
static void check_like_q8(enum ggml_type type)
{
    enum { N_IN = 96, N_OUT = 53, N_TOK = 5, NB = N_IN / 32 };
    const size_t rs = qt_row_bytes(type, N_IN), r8 = qt_row_bytes(GGML_TYPE_Q8_0, N_IN);
    const size_t bs = qt_row_bytes(type, 32);
    uint8_t *ds = malloc(rs * N_OUT), *d8 = malloc(r8 * N_OUT);
    assert_non_null(ds);
    assert_non_null(d8);
    rng_seed(23);
    fill_weights(type, ds, N_IN, N_OUT);
    for (int o = 0; o < N_OUT; o++) {
        float y[N_IN];
        assert_int_equal(qt_dequantize_row(type, ds + (size_t)o * rs, y, N_IN), 0);
        for (int b = 0; b < NB; b++) {
            const uint8_t *src = ds + (size_t)o * rs + bs * (size_t)b;
            uint8_t *dst = d8 + (size_t)o * r8 + 34 * (size_t)b;
            uint16_t h;
            memcpy(&h, src, 2); /* every one of these formats starts with its f16 scale */
            memcpy(dst, src, 2);
            const float d = qt_f16_to_f32(h);
            for (int j = 0; j < 32; j++) {
                float q = d != 0.0f ? y[32 * b + j] / d : 0.0f;
                assert_true(q == nearbyintf(q) && q >= -128 && q <= 127);
                dst[2 + j] = (uint8_t)(int8_t)q;
            }
        }
    }
    float x[N_IN * N_TOK], a[N_OUT * N_TOK], b[N_OUT * N_TOK];
    for (int t = 0; t < N_TOK; t++)
        random_row(x + t * N_IN, N_IN);
    struct mm_weight ws, w8;
    char err[100];
    assert_int_equal(mm_weight_init(&ws, type, N_IN, N_OUT, ds, err, sizeof err), 0);
    assert_int_equal(mm_weight_init(&w8, GGML_TYPE_Q8_0, N_IN, N_OUT, d8, err, sizeof err), 0);

    const size_t pb = mm_pack_bytes(&ws);
    if (!pb) { /* a level without repacked kernels of the type: kept as stored */
        assert_true(cpu_level() < CPU_AVX512);
        print_message("no repacked kernels at this level: %s not repacked\n", qt_type_name(type));
    } else {
        assert_int_equal(pb * 34, mm_pack_bytes(&w8) * bs);
        void *ps = aligned_alloc(64, (pb + 63) / 64 * 64);
        void *p8 = aligned_alloc(64, (mm_pack_bytes(&w8) + 63) / 64 * 64);
        assert_non_null(ps);
        assert_non_null(p8);
        mm_pack_weight(&ws, ps);
        mm_pack_weight(&w8, p8);
        assert_true(mm_pack_ready(&ws));
        const int toks[2] = {1, N_TOK};
        for (int k = 0; k < 2; k++)
            for (int th = 1; th <= 2; th++) {
                assert_int_equal(mm_matmul(a, &ws, x, toks[k], th), 0);
                assert_int_equal(mm_matmul(b, &w8, x, toks[k], th), 0);
                for (int i = 0; i < N_OUT * toks[k]; i++)
                    if (f32_bits(a[i]) != f32_bits(b[i]))
                        fail_msg("%s repacked: output %d of %d tokens differs from q8_0's",
                                 qt_type_name(type), i, toks[k]);
            }
        free(ps);
        free(p8);
    }
    free(ds);
    free(d8);
}

static void test_matmul_like_q8(void **state)
{
    (void)state;
    check_like_q8(GGML_TYPE_Q4_0);
    check_like_q8(GGML_TYPE_Q5_0);
    check_like_q8(GGML_TYPE_IQ4_NL);
}

/* The K formats through matmul_k.c at every level (check_matmul_shapes):
 * within the same bounds of the references, invariant to threads and batch. */
static void check_matmul_k(enum ggml_type type)
{
    const int n_in[2] = {256, 768};
    check_matmul_shapes(type, n_in, 2);
}

static void test_matmul_q2_K(void **state)
{
    (void)state;
    check_matmul_k(GGML_TYPE_Q2_K);
}

static void test_matmul_q3_K(void **state)
{
    (void)state;
    check_matmul_k(GGML_TYPE_Q3_K);
}

static void test_matmul_q4_K(void **state)
{
    (void)state;
    check_matmul_k(GGML_TYPE_Q4_K);
}

static void test_matmul_q5_K(void **state)
{
    (void)state;
    check_matmul_k(GGML_TYPE_Q5_K);
}

static void test_matmul_q6_K(void **state)
{
    (void)state;
    check_matmul_k(GGML_TYPE_Q6_K);
}

/* A larger product: several row groups per thread, long rows. */
/* The read-only formats through the run-time-chosen kernel, then through
 * the plain C one. */
static void test_matmul_read_only(void **state)
{
    (void)state;
    const int small[3] = {32, 96, 288}, k_in[2] = {256, 512};
    for (int pass = 0; pass < 2; pass++) {
        assert_int_equal(mm_blocks_use(pass ? "scalar" : "auto"), 0);
        print_message("read-only formats' kernel: %s\n", mm_blocks_kernel_name());
        for (int k = 0; k < N_RO_TYPES; k++) {
            enum ggml_type type = RO_TYPES[k];
            if (qt_block_elems(type) == 32)
                check_matmul_shapes(type, small, 3);
            else
                check_matmul_shapes(type, k_in, 2);
            check_matmul(type, 1024, 83, 9);
        }
    }
    assert_int_equal(mm_blocks_use("auto"), 0);
    assert_int_equal(mm_blocks_use("avx9"), -EINVAL);
}

static void test_matmul_larger(void **state)
{
    (void)state;
    const enum ggml_type types[8] = {GGML_TYPE_F32,  GGML_TYPE_F16,  GGML_TYPE_BF16,
                                     GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_K,
                                     GGML_TYPE_Q5_K, GGML_TYPE_Q6_K};
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int l = 0; l < n_levels; l++) {
        cl_force(levels[l]);
        for (int k = 0; k < 8; k++)
            check_matmul(types[k], 1024, 83, 9);
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* Batches long enough that the products over repacked weights split them
 * among threads by token tiles (matmul_pack_run.c: at least 8 tiles per
 * thread, of 6 tokens for q8_0 and 12 for float weights): still bit for
 * bit the 1-thread result at 2 and 3 threads, and a token alone gives what
 * it gave in the batch; a last partial tile (151, 293 tokens) included. */
static void test_matmul_token_split(void **state)
{
    (void)state;
    check_matmul(GGML_TYPE_Q8_0, 256, 37, 151);
    check_matmul(GGML_TYPE_F16, 64, 21, 293);
}

/* Each level's copy of the kernels is the one that runs when it is forced. */
static void test_matmul_level_names(void **state)
{
    (void)state;
    static const char *const want[CPU_N_LEVELS] = {"scalar", "avx2", "avx512-vnni"};
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    assert_true(n_levels >= 1 && levels[0] == CPU_SCALAR);
    for (int l = 0; l < n_levels; l++) {
        cl_force(levels[l]);
        assert_string_equal(mm_kernel_name(), want[levels[l]]);
        assert_string_equal(mm_k_kernel_name(), want[levels[l]]);
        print_message("level %s: matmul %s, K formats %s, read-only formats %s\n",
                      cpu_level_name(levels[l]), mm_kernel_name(), mm_k_kernel_name(),
                      mm_blocks_kernel_name());
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
    assert_int_equal(cpu_level(), cpu_best());
}

/*
 * A weight repacked at the best level, then multiplied at each level the
 * CPU runs: where the level has no kernels over repacked weights it runs
 * the stored rows (the same bits as the weight never repacked); where it
 * has them, they run (results differ from the stored rows' only in f32
 * order, which check_matmul bounds). Names: one per level, NULL for none.
 */
static void test_matmul_packed_levels(void **state)
{
    (void)state;
    enum { N_IN = 96, N_OUT = 37, N_TOK = 7 };
    size_t rb = qt_row_bytes(GGML_TYPE_Q8_0, N_IN);
    uint8_t *data = malloc(rb * N_OUT);
    float x[N_IN * N_TOK], a[N_OUT * N_TOK], b[N_OUT * N_TOK];
    rng_seed(17);
    fill_weights(GGML_TYPE_Q8_0, data, N_IN, N_OUT);
    for (int t = 0; t < N_TOK; t++)
        random_row(x + t * N_IN, N_IN);
    struct mm_weight w, plain;
    char err[100];
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q8_0, N_IN, N_OUT, data, err, sizeof err), 0);
    assert_null(w.packed);
    plain = w;
    size_t pb = mm_pack_bytes(&w);
    void *packed = pb ? aligned_alloc(64, (pb + 63) / 64 * 64) : NULL;
    if (packed)
        mm_pack_weight(&w, packed);
    enum cpu_level levels[CPU_N_LEVELS];
    int n_levels = cl_levels(CPU_SCALAR, levels);
    for (int l = 0; l < n_levels; l++) {
        cl_force(levels[l]);
        const char *name = mm_pack_kernel_name();
        print_message("level %s: repacked kernels %s\n", cpu_level_name(levels[l]),
                      name ? name : "none");
        if (levels[l] == CPU_AVX512)
            assert_string_equal(name, "avx512-vnni 16-row");
        else if (levels[l] == CPU_AVX2)
            assert_string_equal(name, "avx2-maddubs 16-row");
        else
            assert_null(name);
        assert_int_equal(mm_pack_ready(&w), packed && name);
        assert_int_equal(mm_matmul(a, &w, x, N_TOK, 2), 0);
        assert_int_equal(mm_matmul(b, &plain, x, N_TOK, 2), 0);
        if (!mm_pack_ready(&w))
            assert_memory_equal(a, b, sizeof a);
        else
            for (int i = 0; i < N_OUT * N_TOK; i++)
                assert_true(fabsf(a[i] - b[i]) <= 1e-4f * (1.0f + fabsf(b[i])));
    }
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
    free(packed);
    free(data);
}

/* A tail that adds the second product into the first over its rows and
 * counts how often each row was given (struct many_tail). */
struct many_tail {
    float *a;
    const float *b;
    int *seen; /* [n_tok][n_out] */
    int n_out;
};

static void add_tail(void *arg, int r0, int r1, int t0, int t1)
{
    const struct many_tail *m = arg;
    for (int t = t0; t < t1; t++)
        for (int r = r0; r < r1; r++) {
            m->seen[t * m->n_out + r]++;
            m->a[t * m->n_out + r] += m->b[t * m->n_out + r];
        }
}

/*
 * mm_matmul_many: Q8_0 and F16 weights of odd heights (odd numbers of row
 * groups), repacked when the level has kernels for them, and a set mixing
 * types (one product after another): every output the bits of mm_matmul
 * on its own, at 1, 2 and 3 threads. And with a tail over two products of
 * one height: every (row, token) handed to it once, after both products
 * wrote it.
 */
static void test_matmul_many(void **state)
{
    (void)state;
    /* 7 tokens: split by rows; 293: by token tiles (matmul_pack_run.c), at 2 and 3 threads */
    enum { N_IN = 96, N_TOK = 293, NW = 3 };
    static const int n_toks[2] = {7, N_TOK};
    static const int n_out[NW] = {37, 80, 16};
    static const enum ggml_type sets[3][NW] = {{GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0},
                                               {GGML_TYPE_F16, GGML_TYPE_F16, GGML_TYPE_F16},
                                               {GGML_TYPE_Q8_0, GGML_TYPE_F16, GGML_TYPE_Q8_0}};
    static float x[N_IN * N_TOK];
    rng_seed(29);
    for (int t = 0; t < N_TOK; t++)
        random_row(x + t * N_IN, N_IN);
    for (int set = 0; set < 3; set++) {
        struct mm_weight w[NW];
        void *data[NW], *packed[NW];
        float *one[NW], *many[NW];
        size_t scratch_bytes = 64;
        for (int i = 0; i < NW; i++) {
            enum ggml_type ty = sets[set][i];
            data[i] = malloc(qt_row_bytes(ty, N_IN) * n_out[i]);
            fill_weights(ty, data[i], N_IN, n_out[i]);
            char err[100];
            assert_int_equal(mm_weight_init(&w[i], ty, N_IN, n_out[i], data[i], err, sizeof err),
                             0);
            size_t pb = mm_pack_bytes(&w[i]);
            packed[i] = pb ? aligned_alloc(64, (pb + 63) / 64 * 64) : NULL;
            if (packed[i])
                mm_pack_weight(&w[i], packed[i]);
            one[i] = malloc(sizeof(float) * N_TOK * n_out[i]);
            many[i] = malloc(sizeof(float) * N_TOK * n_out[i]);
            size_t sb = mm_scratch_bytes(&w[i], N_TOK, 3);
            scratch_bytes = sb > scratch_bytes ? sb : scratch_bytes;
        }
        void *scratch = aligned_alloc(64, (scratch_bytes + 63) / 64 * 64);
        const struct mm_weight *wp[NW] = {&w[0], &w[1], &w[2]};
        for (int k = 0; k < 2; k++)
            for (int th = 1; th <= 3; th++) {
                const int nt = n_toks[k];
                for (int i = 0; i < NW; i++)
                    assert_int_equal(mm_matmul(one[i], &w[i], x, nt, th), 0);
                mm_matmul_many(many, wp, NW, x, nt, th, scratch, NULL);
                for (int i = 0; i < NW; i++)
                    assert_memory_equal(one[i], many[i], sizeof(float) * nt * n_out[i]);
                /* the tail: product 0 and the first 37 rows of product 1 (two
                 * pairs of groups, the second short) */
                struct mm_weight w1 = w[1];
                w1.n_out = n_out[0];
                static int seen[37 * N_TOK];
                memset(seen, 0, sizeof seen);
                struct many_tail mt = {many[0], many[1], seen, n_out[0]};
                const struct mm_weight *wt[2] = {&w[0], &w1};
                float *outs[2] = {many[0], many[1]};
                mm_matmul_many(outs, wt, 2, x, nt, th, scratch, &(struct mm_tail){add_tail, &mt});
                for (int t = 0; t < nt; t++)
                    for (int r = 0; r < n_out[0]; r++) {
                        assert_int_equal(seen[t * n_out[0] + r], 1);
                        assert_true(many[0][t * n_out[0] + r] ==
                                    one[0][t * n_out[0] + r] + one[1][t * n_out[1] + r]);
                    }
            }
        free(scratch);
        for (int i = 0; i < NW; i++) {
            free(data[i]);
            free(packed[i]);
            free(one[i]);
            free(many[i]);
        }
    }
}

static void test_weight_init_errors(void **state)
{
    (void)state;
    struct mm_weight w;
    memset(&w, 0xab, sizeof w);
    struct mm_weight before = w;
    char err[200] = "";
    uint8_t data[1024] = {0};

    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q8_K, 256, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "q8_K"));
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q8_1, 32, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "q8_1"));
    /* types the GGUF reader knows but nothing multiplies: refused by name */
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_IQ2_XXS, 256, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "weight type iq2_xxs is not supported"));
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_MXFP4, 32, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "weight type mxfp4 is not supported"));
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q5_K, 128, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "256"));
    assert_int_equal(mm_weight_init(&w, (enum ggml_type)77, 32, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "77"));
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q4_0, 48, 4, data, err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "32"));
    assert_non_null(strstr(err, "48"));
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q6_K, 128, 4, data, err, sizeof err), -EINVAL);
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_F32, 0, 4, data, err, sizeof err), -EINVAL);
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_F32, 8, 0, data, err, sizeof err), -EINVAL);
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_F32, 8, 4, NULL, err, sizeof err), -EINVAL);
    assert_memory_equal(&w, &before, sizeof w);

    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q4_K, 512, 3, data, err, sizeof err), 0);
    assert_int_equal(w.row_bytes, 288);
    assert_int_equal(w.n_in, 512);
    assert_int_equal(w.n_out, 3);
    assert_ptr_equal(w.data, data);
}

/* n_tok = 0 writes nothing; the thread-local scratch can be released and regrown. */
static void test_matmul_edges(void **state)
{
    (void)state;
    float x[64], out[2] = {42.0f, 42.0f};
    uint8_t data[2 * 68];
    struct mm_weight w;
    char err[100];
    rng_seed(3);
    for (int i = 0; i < 64; i++)
        x[i] = rng_unit();
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, data, 64), 0);
    assert_int_equal(qt_quantize_row(GGML_TYPE_Q8_0, x, data + 68, 64), 0);
    assert_int_equal(mm_weight_init(&w, GGML_TYPE_Q8_0, 64, 2, data, err, sizeof err), 0);
    assert_int_equal(mm_matmul(out, &w, x, 0, 1), 0);
    assert_true(out[0] == 42.0f && out[1] == 42.0f);
    assert_int_equal(mm_matmul(out, &w, x, 1, 0), 0);
    float first = out[0];
    assert_true(first > 0.0f); /* x . x */
    mm_scratch_release();
    assert_int_equal(mm_matmul(out, &w, x, 1, 1), 0);
    assert_true(out[0] == first && out[1] == first);
    mm_scratch_release();
    print_message("matmul kernels: %s\n", mm_kernel_name());
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_table),
        cmocka_unit_test(test_f16_to_f32_exhaustive),
        cmocka_unit_test(test_f32_to_f16_rounding),
        cmocka_unit_test(test_f16_specials),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_half_rows),
        cmocka_unit_test(test_known_blocks),
        cmocka_unit_test(test_quant_f32),
        cmocka_unit_test(test_quant_f16),
        cmocka_unit_test(test_quant_bf16),
        cmocka_unit_test(test_quant_q8_0),
        cmocka_unit_test(test_quant_q4_0),
        cmocka_unit_test(test_quant_q4_1_q5),
        cmocka_unit_test(test_quant_q4_0_levels),
        cmocka_unit_test(test_quant_errors),
        cmocka_unit_test(test_q4_K_dequant),
        cmocka_unit_test(test_q6_K_dequant),
        cmocka_unit_test(test_q4_K_known),
        cmocka_unit_test(test_q6_K_known),
        cmocka_unit_test(test_read_only_dequant),
        cmocka_unit_test(test_read_only_known),
        cmocka_unit_test(test_matmul_read_only),
        cmocka_unit_test(test_weight_init_errors),
        cmocka_unit_test(test_matmul_edges),
        cmocka_unit_test(test_matmul_level_names),
        cmocka_unit_test(test_matmul_f32),
        cmocka_unit_test(test_matmul_f16),
        cmocka_unit_test(test_matmul_bf16),
        cmocka_unit_test(test_matmul_q8_0),
        cmocka_unit_test(test_matmul_narrow),
        cmocka_unit_test(test_matmul_q4_0),
        cmocka_unit_test(test_matmul_like_q8),
        cmocka_unit_test(test_matmul_q4_K),
        cmocka_unit_test(test_matmul_q5_K),
        cmocka_unit_test(test_matmul_q2_K),
        cmocka_unit_test(test_matmul_q3_K),
        cmocka_unit_test(test_matmul_q6_K),
        cmocka_unit_test(test_matmul_larger),
        cmocka_unit_test(test_matmul_packed_levels),
        cmocka_unit_test(test_matmul_many),
        cmocka_unit_test(test_matmul_token_split),
    };
    return cmocka_run_group_tests_name("quant", tests, NULL, NULL);
}
