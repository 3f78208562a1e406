/*
 * ops.c - the forward pass's element-wise kernels and norms, compiled once
 * per kernel level (cpu/kernel.h; the contract is ops.h).
 *
 * ---------------------------------------------------------------------------
 * The exponential
 * ---------------------------------------------------------------------------
 *
 * SwiGLU's silu(x) = x / (1 + exp(-x)) and GELU's tanh both come down to
 * one exp per element, and libm's expf, called once per element, cost more
 * of a Q8_0 prefill than any kernel but the matrix tile. Here exp runs 8 or
 * 16 lanes at once:
 *
 *   n = round(x / ln 2),  r = x - n ln 2            (|r| <= ln 2 / 2)
 *   exp(x) = 2^n * exp(r)
 *
 * n ln 2 is taken off in two parts (Cody and Waite): ln2_hi has 16
 * significant bits, so n * ln2_hi is exact for every |n| <= 150 and the
 * first subtraction loses nothing; ln2_lo carries the rest. exp(r) is its
 * Taylor series to r^7, by Horner's rule in fused multiply-adds: on
 * |r| <= 0.347 the first term left out, r^8 / 8!, is below 5.3e-9, a
 * tenth of a float's unit in the last place, so the error is the
 * rounding of the Horner steps (test_ops measures it: at most 2 units in
 * the last place against libm, over the whole float range).
 *
 * 2^n is built in the exponent field. Its range: x is first clamped to
 * [-104, 88.8]: below -104 the true value is under half the smallest
 * subnormal, so 0 is right; above 88.8 it is past FLT_MAX, so infinity is
 * right. n then lies in [-150, 128], more than one float exponent holds,
 * so 2^n is applied as 2^(n/2) * 2^(n - n/2), two exact powers: a result
 * that overflows becomes infinity in the last multiply, and one that falls
 * among the subnormals is rounded there once, as it should be. The clamp
 * keeps a NaN (maxps and minps return their second operand when either is
 * NaN, and x is passed second), and NaN * anything stays NaN.
 *
 * The two SIMD levels run the same operations in the same order (FMA both,
 * no approximate reciprocal), so they give the same bits; the scalar level
 * is libm, as the forward was before.
 *
 * The activations reuse exp without cancellation:
 *   silu(x) = x / (1 + exp(-x))
 *   gelu_tanh(x) = x/2 (1 + tanh(u)) = x / (1 + exp(-2u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
 * the second because 1 + tanh(u) = 2 / (1 + exp(-2u)). Far out on the
 * negative side exp overflows to infinity and the quotient is -0, the limit.
 *
 * ---------------------------------------------------------------------------
 * The norms
 * ---------------------------------------------------------------------------
 *
 * A row's sums are in double (as the forward always did: a 4,096-wide
 * row's float sum would lose digits). The scalar loop is one dependent add
 * per element; the SIMD levels keep 8 or 16 running sums in double lanes.
 * The order of the additions differs from the scalar one, so the levels
 * may differ in the last bit of a norm; every row is still summed the same
 * way in any batch and on any thread.
 */
#include "cpu/kernel.h"
#include "model/ops.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(KERN_SIMD)
#include <immintrin.h>
#endif

/* The constants of the exponential (see above). */
#define EXP_LO -104.0f
#define EXP_HI 88.8f
#define LOG2E 1.44269504088896341f
#define LN2_HI 0.693145751953125f     /* 0x3f317200: 16 significant bits */
#define LN2_LO 1.42860682030941723e-6f /* ln 2 - LN2_HI */
#define GELU_K 0.79788456f             /* sqrt(2 / pi) */
#define GELU_C 0.044715f

#if defined(KERN_SIMD)

/* ------------------------------------------------------------------------
 * The vector type of the level: V holds W floats
 * ------------------------------------------------------------------------ */

#if defined(KERN_AVX512)
#define W 16
typedef __m512 V;
typedef __m512i VI;
typedef __m512d VD;
#define v_set1 _mm512_set1_ps
#define v_loadu _mm512_loadu_ps
#define v_storeu _mm512_storeu_ps
#define v_add _mm512_add_ps
#define v_sub _mm512_sub_ps
#define v_mul _mm512_mul_ps
#define v_div _mm512_div_ps
#define v_fmadd _mm512_fmadd_ps
#define v_fnmadd _mm512_fnmadd_ps
#define v_max _mm512_max_ps
#define v_min _mm512_min_ps
#define v_round(x) _mm512_roundscale_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_cvt_i _mm512_cvtps_epi32
#define vi_set1 _mm512_set1_epi32
#define vi_add _mm512_add_epi32
#define vi_sub _mm512_sub_epi32
#define vi_srai _mm512_srai_epi32
#define vi_slli _mm512_slli_epi32
#define vi_as_v _mm512_castsi512_ps
#define vd_zero _mm512_setzero_pd
#define vd_fmadd _mm512_fmadd_pd
#define vd_add _mm512_add_pd

/* The first n < W floats at p, the rest 0; and their store. */
static inline V v_load_n(const float *p, size_t n)
{
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}

static inline void v_store_n(float *p, V v, size_t n)
{
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v);
}

/* The W floats of v as two halves in double. */
static inline VD vd_lo(V v)
{
    return _mm512_cvtps_pd(_mm512_castps512_ps256(v));
}

static inline VD vd_hi(V v)
{
    return _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1));
}

static inline double vd_sum(VD a)
{
    return _mm512_reduce_add_pd(a);
}

#else /* KERN_AVX2 */
#define W 8
typedef __m256 V;
typedef __m256i VI;
typedef __m256d VD;
#define v_set1 _mm256_set1_ps
#define v_loadu _mm256_loadu_ps
#define v_storeu _mm256_storeu_ps
#define v_add _mm256_add_ps
#define v_sub _mm256_sub_ps
#define v_mul _mm256_mul_ps
#define v_div _mm256_div_ps
#define v_fmadd _mm256_fmadd_ps
#define v_fnmadd _mm256_fnmadd_ps
#define v_max _mm256_max_ps
#define v_min _mm256_min_ps
#define v_round(x) _mm256_round_ps((x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define v_cvt_i _mm256_cvtps_epi32
#define vi_set1 _mm256_set1_epi32
#define vi_add _mm256_add_epi32
#define vi_sub _mm256_sub_epi32
#define vi_srai _mm256_srai_epi32
#define vi_slli _mm256_slli_epi32
#define vi_as_v _mm256_castsi256_ps
#define vd_zero _mm256_setzero_pd
#define vd_fmadd _mm256_fmadd_pd
#define vd_add _mm256_add_pd

static inline V v_load_n(const float *p, size_t n)
{
    float b[W] = {0};
    memcpy(b, p, n * sizeof(float));
    return _mm256_loadu_ps(b);
}

static inline void v_store_n(float *p, V v, size_t n)
{
    float b[W];
    _mm256_storeu_ps(b, v);
    memcpy(p, b, n * sizeof(float));
}

static inline VD vd_lo(V v)
{
    return _mm256_cvtps_pd(_mm256_castps256_ps128(v));
}

static inline VD vd_hi(V v)
{
    return _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
}

static inline double vd_sum(VD a)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
#endif

/* ------------------------------------------------------------------------
 * exp and the activations, W lanes at a time
 * ------------------------------------------------------------------------ */

static inline V v_exp(V x)
{
    x = v_min(v_set1(EXP_HI), v_max(v_set1(EXP_LO), x)); /* x second: a NaN stays */
    V n = v_round(v_mul(x, v_set1(LOG2E)));
    V r = v_fnmadd(n, v_set1(LN2_HI), x);
    r = v_fnmadd(n, v_set1(LN2_LO), r);
    V p = v_set1(1.0f / 5040);
    p = v_fmadd(p, r, v_set1(1.0f / 720));
    p = v_fmadd(p, r, v_set1(1.0f / 120));
    p = v_fmadd(p, r, v_set1(1.0f / 24));
    p = v_fmadd(p, r, v_set1(1.0f / 6));
    p = v_fmadd(p, r, v_set1(0.5f));
    p = v_fmadd(p, r, v_set1(1.0f));
    p = v_fmadd(p, r, v_set1(1.0f));
    VI ni = v_cvt_i(n), n1 = vi_srai(ni, 1), n2 = vi_sub(ni, n1);
    V s1 = vi_as_v(vi_slli(vi_add(n1, vi_set1(127)), 23));
    V s2 = vi_as_v(vi_slli(vi_add(n2, vi_set1(127)), 23));
    return v_mul(v_mul(p, s1), s2);
}

/* x / (1 + exp(-x)) */
static inline V v_silu(V x)
{
    V e = v_exp(v_sub(v_set1(0.0f), x));
    return v_div(x, v_add(v_set1(1.0f), e));
}

/* x / (1 + exp(-2u)), u = GELU_K x (1 + GELU_C x^2) */
static inline V v_gelu(V x)
{
    V u = v_mul(v_mul(v_set1(GELU_K), x), v_fmadd(v_mul(v_set1(GELU_C), x), x, v_set1(1.0f)));
    V e = v_exp(v_mul(v_set1(-2.0f), u));
    return v_div(x, v_add(v_set1(1.0f), e));
}

/* The loops: full vectors, then the short end through the same code. */
static void op_exp(float *y, const float *x, size_t n)
{
    size_t i = 0;
    for (; i + W <= n; i += W)
        v_storeu(y + i, v_exp(v_loadu(x + i)));
    if (i < n)
        v_store_n(y + i, v_exp(v_load_n(x + i, n - i)), n - i);
}

static void op_swiglu(float *restrict h, const float *restrict g, size_t n)
{
    size_t i = 0;
    for (; i + W <= n; i += W)
        v_storeu(h + i, v_mul(v_silu(v_loadu(h + i)), v_loadu(g + i)));
    if (i < n)
        v_store_n(h + i, v_mul(v_silu(v_load_n(h + i, n - i)), v_load_n(g + i, n - i)), n - i);
}

static void op_gelu_tanh(float *restrict h, const float *restrict g, size_t n)
{
    size_t i = 0;
    for (; i + W <= n; i += W) {
        V y = v_gelu(v_loadu(h + i));
        v_storeu(h + i, g ? v_mul(y, v_loadu(g + i)) : y);
    }
    if (i < n) {
        V y = v_gelu(v_load_n(h + i, n - i));
        v_store_n(h + i, g ? v_mul(y, v_load_n(g + i, n - i)) : y, n - i);
    }
}

/* ------------------------------------------------------------------------
 * Norms
 * ------------------------------------------------------------------------ */

/* sum (x[i] - mean)^2 in double; the differences in float, as the scalar
 * layernorm takes them (mean = 0: the plain sum of squares, exactly). */
static double sum_sq(const float *x, float mean, int n)
{
    VD a = vd_zero(), b = vd_zero();
    V m = v_set1(mean);
    int i = 0;
    for (; i + W <= n; i += W) {
        V d = v_sub(v_loadu(x + i), m);
        VD lo = vd_lo(d), hi = vd_hi(d);
        a = vd_fmadd(lo, lo, a);
        b = vd_fmadd(hi, hi, b);
    }
    double s = vd_sum(a) + vd_sum(b);
    for (; i < n; i++)
        s += (double)(x[i] - mean) * (x[i] - mean);
    return s;
}

static double sum_x(const float *x, int n)
{
    VD a = vd_zero(), b = vd_zero();
    int i = 0;
    for (; i + W <= n; i += W) {
        V v = v_loadu(x + i);
        a = vd_add(a, vd_lo(v));
        b = vd_add(b, vd_hi(v));
    }
    double s = vd_sum(a) + vd_sum(b);
    for (; i < n; i++)
        s += x[i];
    return s;
}

/* out = (x - mean) * r * w (+ b): the scalar norms' last step, lane-wise */
static void norm_apply(float *out, const float *x, float mean, float r, const float *w,
                       const float *b, int n)
{
    V m = v_set1(mean), vr = v_set1(r);
    int i = 0;
    for (; i + W <= n; i += W) {
        V y = v_mul(v_mul(v_sub(v_loadu(x + i), m), vr), v_loadu(w + i));
        v_storeu(out + i, b ? v_add(y, v_loadu(b + i)) : y);
    }
    for (; i < n; i++)
        out[i] = (x[i] - mean) * r * w[i] + (b ? b[i] : 0.0f);
}

static void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    float r = 1.0f / sqrtf((float)(sum_sq(x, 0.0f, n) / n) + eps);
    norm_apply(out, x, 0.0f, r, w, NULL, n);
}

static void op_layernorm(float *out, const float *x, const float *w, const float *b, int n,
                         float eps)
{
    float mean = (float)(sum_x(x, n) / n);
    float r = 1.0f / sqrtf((float)(sum_sq(x, mean, n) / n) + eps);
    norm_apply(out, x, mean, r, w, b, n);
}

#else /* the scalar level: libm and the plain loops */

static void op_exp(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        y[i] = expf(x[i]);
}

static void op_swiglu(float *restrict h, const float *restrict g, size_t n)
{
    for (size_t i = 0; i < n; i++)
        h[i] = h[i] / (1.0f + expf(-h[i])) * g[i];
}

static void op_gelu_tanh(float *restrict h, const float *restrict g, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = h[i];
        float y = 0.5f * x * (1.0f + tanhf(GELU_K * x * (1.0f + GELU_C * x * x)));
        h[i] = g ? y * g[i] : y;
    }
}

static void op_rmsnorm(float *out, const float *x, const float *w, int n, float eps)
{
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = x[i] * r * w[i];
}

static void op_layernorm(float *out, const float *x, const float *w, const float *b, int n,
                         float eps)
{
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += x[i];
    float mean = (float)(s / n);
    double ss = 0.0;
    for (int i = 0; i < n; i++)
        ss += (double)(x[i] - mean) * (x[i] - mean);
    float r = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int i = 0; i < n; i++)
        out[i] = (x[i] - mean) * r * w[i] + (b ? b[i] : 0.0f);
}

#endif

const struct ops_kernels KERN(ops_kernels) = {
#if defined(KERN_AVX512)
    .name = "avx512",
#elif defined(KERN_AVX2)
    .name = "avx2",
#else
    .name = "scalar (libm)",
#endif
    .exp = op_exp,
    .swiglu = op_swiglu,
    .gelu_tanh = op_gelu_tanh,
    .rmsnorm = op_rmsnorm,
    .layernorm = op_layernorm,
};
