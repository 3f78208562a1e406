/*
 * quant.c - element formats: half precision, dequantising and quantising rows.
 *
 * Everything here works on one row at a time and is exact where the format
 * allows: f16 and bf16 conversions round to nearest-even like the hardware
 * instructions (and use them where the build has F16C / AVX-512), and the
 * block decoders are plain transcriptions of the layouts described in
 * quant.h. The q8_0 / q4_0 / q5_0 encoders round every element against the
 * scale as it is stored (f16), not against the f32 scale before storage,
 * so the stored block is the closest one for the scale it carries; q4_1 /
 * q5_1's against their stored scale and min, the min rounded down and the
 * scale up so that every element lies within half a step.
 */
#include "model/quant.h"

#include <errno.h>
#include <math.h>
#include <string.h>

#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------------
 * Element types
 * ------------------------------------------------------------------------ */

struct qt_traits {
    const char *name;
    int block;          /* elements per block */
    size_t block_bytes; /* bytes per block */
    bool supported;     /* decoded here and multiplied by matmul.c */
};

/* clang-format off */
static const struct qt_traits traits[GGML_TYPE_COUNT] = {
    [GGML_TYPE_F32] = {"f32", 1, 4, true},
    [GGML_TYPE_F16] = {"f16", 1, 2, true},
    [GGML_TYPE_Q4_0] = {"q4_0", 32, 18, true},
    [GGML_TYPE_Q4_1] = {"q4_1", 32, 20, true},
    [GGML_TYPE_Q5_0] = {"q5_0", 32, 22, true},
    [GGML_TYPE_Q5_1] = {"q5_1", 32, 24, true},
    [GGML_TYPE_Q8_0] = {"q8_0", 32, 34, true},
    [GGML_TYPE_Q8_1] = {"q8_1", 32, 36, false},
    [GGML_TYPE_Q2_K] = {"q2_K", 256, 84, true},
    [GGML_TYPE_Q3_K] = {"q3_K", 256, 110, true},
    [GGML_TYPE_Q4_K] = {"q4_K", 256, 144, true},
    [GGML_TYPE_Q5_K] = {"q5_K", 256, 176, true},
    [GGML_TYPE_Q6_K] = {"q6_K", 256, 210, true},
    [GGML_TYPE_Q8_K] = {"q8_K", 256, 292, false},
    [GGML_TYPE_IQ4_NL] = {"iq4_nl", 32, 18, true},
    [GGML_TYPE_IQ4_XS] = {"iq4_xs", 256, 136, true},
    [GGML_TYPE_BF16] = {"bf16", 1, 2, true},
    /* named, so that refusing them names them */
    [GGML_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66, false},
    [GGML_TYPE_IQ2_XS] = {"iq2_xs", 256, 74, false},
    [GGML_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98, false},
    [GGML_TYPE_IQ1_S] = {"iq1_s", 256, 50, false},
    [GGML_TYPE_IQ3_S] = {"iq3_s", 256, 110, false},
    [GGML_TYPE_IQ2_S] = {"iq2_s", 256, 82, false},
    [GGML_TYPE_IQ1_M] = {"iq1_m", 256, 56, false},
    [GGML_TYPE_TQ1_0] = {"tq1_0", 256, 54, false},
    [GGML_TYPE_TQ2_0] = {"tq2_0", 256, 66, false},
    [GGML_TYPE_MXFP4] = {"mxfp4", 32, 17, false},
};
/* clang-format on */

static const struct qt_traits *trait(enum ggml_type type)
{
    unsigned t = (unsigned)type;
    if (t >= GGML_TYPE_COUNT || !traits[t].name)
        return NULL;
    return &traits[t];
}

const char *qt_type_name(enum ggml_type type)
{
    const struct qt_traits *t = trait(type);
    return t ? t->name : NULL;
}

bool qt_type_supported(enum ggml_type type)
{
    const struct qt_traits *t = trait(type);
    return t && t->supported;
}

int qt_block_elems(enum ggml_type type)
{
    return qt_type_supported(type) ? trait(type)->block : 0;
}

size_t qt_block_bytes(enum ggml_type type)
{
    return qt_type_supported(type) ? trait(type)->block_bytes : 0;
}

size_t qt_row_bytes(enum ggml_type type, int n)
{
    int block = qt_block_elems(type);
    if (block == 0 || n <= 0 || n % block != 0)
        return 0;
    return (size_t)(n / block) * qt_block_bytes(type);
}

/* ------------------------------------------------------------------------
 * Half precision
 * ------------------------------------------------------------------------ */

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#ifndef __F16C__
/* Software conversions for builds without F16C. */

/* binary16 -> binary32, exact; NaNs come back quiet with their payload. */
static float f16_to_f32_soft(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ff;
    if (exp == 0x1f) /* infinity, or NaN made quiet */
        return bits_f32(sign | 0x7f800000 | (man ? 0x400000 | (man << 13) : 0));
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in f32 */
        float v = (float)man * 0x1p-24f;
        return bits_f32(sign | f32_bits(v));
    }
    return bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* binary32 -> binary16, round to nearest, ties to even. */
static uint16_t f32_to_f16_soft(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffff;

    if (a > 0x7f800000) /* NaN: quiet, top payload bits kept */
        return sign | 0x7e00 | (uint16_t)((a >> 13) & 0x1ff);
    if (a >= 0x477ff000) /* >= 65520 (halfway past 65504, ties to even): infinity */
        return sign | 0x7c00;
    if (a >= 0x38800000) { /* normal result: round the mantissa at bit 13 */
        uint32_t r = a + 0xfff + ((a >> 13) & 1);
        return sign | (uint16_t)((r - (112u << 23)) >> 13);
    }
    if (a <= 0x33000000) /* at most 2^-25: rounds to zero (2^-25 is a tie to even 0) */
        return sign;
    /* Subnormal result: units of 2^-24, the implicit bit restored. */
    uint32_t e = a >> 23; /* 102..112 */
    uint32_t mant = (a & 0x7fffff) | 0x800000;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t q = mant >> shift;
    uint32_t rem = mant & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1)))
        q++; /* may carry into the smallest normal, which is the right answer */
    return sign | (uint16_t)q;
}
#endif

float qt_f16_to_f32(uint16_t h)
{
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    return f16_to_f32_soft(h);
#endif
}

uint16_t qt_f32_to_f16(float f)
{
#ifdef __F16C__
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    return f32_to_f16_soft(f);
#endif
}

float qt_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t qt_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) /* NaN: keep it NaN (and quiet) after truncation */
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

void qt_f16_to_f32_row(const uint16_t *src, float *dst, size_t n)
{
    size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++)
        dst[i] = qt_f16_to_f32(src[i]);
}

void qt_f32_to_f16_row(const float *src, uint16_t *dst, size_t n)
{
    size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        dst[i] = qt_f32_to_f16(src[i]);
}

void qt_bf16_to_f32_row(const uint16_t *src, float *dst, size_t n)
{
    size_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + i)));
        _mm512_storeu_si512((void *)(dst + i), _mm512_slli_epi32(v, 16));
    }
#elif defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(v, 16));
    }
#endif
    for (; i < n; i++)
        dst[i] = qt_bf16_to_f32(src[i]);
}

void qt_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n)
{
    size_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
    for (; i + 16 <= n; i += 16) {
        __m512 f = _mm512_loadu_ps(src + i);
        __m512i u = _mm512_castps_si512(f);
        /* round to nearest even: add 0x7fff plus the bit that will become the lsb */
        __m512i r = _mm512_add_epi32(
            u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
        r = _mm512_srli_epi32(r, 16);
        /* NaN lanes: truncate and set the quiet bit instead */
        __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
        __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
        r = _mm512_mask_blend_epi32(nan, r, q);
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(r));
    }
#elif defined(__AVX2__)
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_loadu_ps(src + i);
        __m256i u = _mm256_castps_si256(f);
        __m256i r = _mm256_add_epi32(
            u, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
        r = _mm256_srli_epi32(r, 16);
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
        __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
        r = _mm256_blendv_epi8(r, q, nan);
        /* 8 x u32 (each <= 0xffff) -> 8 x u16 */
        __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
        _mm_storeu_si128((__m128i *)(dst + i), _mm_packus_epi32(lo, hi));
    }
#endif
    for (; i < n; i++)
        dst[i] = qt_f32_to_bf16(src[i]);
}

/* ------------------------------------------------------------------------
 * Dequantising
 * ------------------------------------------------------------------------ */

static void dequant_q8_0(const uint8_t *b, float *y, int nb)
{
    for (int i = 0; i < nb; i++, b += 34, y += 32) {
        float d = qt_f16_to_f32(qt_rd16(b));
        const int8_t *q = (const int8_t *)(b + 2);
        for (int k = 0; k < 32; k++)
            y[k] = d * (float)q[k];
    }
}

static void dequant_q4_0(const uint8_t *b, float *y, int nb)
{
    for (int i = 0; i < nb; i++, b += 18, y += 32) {
        float d = qt_f16_to_f32(qt_rd16(b));
        const uint8_t *qs = b + 2;
        for (int k = 0; k < 16; k++) {
            y[k] = d * (float)((qs[k] & 0x0f) - 8);    /* elements 0..15: low nibbles */
            y[k + 16] = d * (float)((qs[k] >> 4) - 8); /* elements 16..31: high nibbles */
        }
    }
}

static void dequant_q4_K(const uint8_t *b, float *y, int nsb)
{
    for (int i = 0; i < nsb; i++, b += 144) {
        float d = qt_f16_to_f32(qt_rd16(b + QT_Q4K_D));
        float dmin = qt_f16_to_f32(qt_rd16(b + QT_Q4K_DMIN));
        /* Sub-blocks 2c and 2c+1 are the low and high nibbles of qs[32c .. 32c+31]. */
        for (int j = 0; j < 8; j++, y += 32) {
            int sc, m;
            qt_q4k_scale_min(b + QT_Q4K_SCALES, j, &sc, &m);
            float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *q = b + QT_Q4K_QS + 32 * (j >> 1);
            int shift = (j & 1) * 4;
            for (int k = 0; k < 32; k++)
                y[k] = ds * (float)((q[k] >> shift) & 0x0f) - dm;
        }
    }
}

/*
 * q6_K: each half of 128 elements uses 64 bytes of ql and 32 of qh. Within
 * a half, element 32k + l (k = 0..3, l = 0..31) takes its low four bits from
 * ql[l + 32 * (k & 1)] (low nibble for k < 2, high for k >= 2) and its high
 * two bits from bits 2k, 2k+1 of qh[l].
 */
static void dequant_q6_K(const uint8_t *b, float *y, int nsb)
{
    for (int i = 0; i < nsb; i++, b += 210) {
        float d = qt_f16_to_f32(qt_rd16(b + QT_Q6K_D));
        const int8_t *sc = (const int8_t *)(b + QT_Q6K_SCALES);
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + QT_Q6K_QL + 64 * h;
            const uint8_t *qh = b + QT_Q6K_QH + 32 * h;
            for (int k = 0; k < 4; k++, y += 32) {
                const uint8_t *lo = ql + 32 * (k & 1);
                int nshift = (k >> 1) * 4;
                for (int l = 0; l < 32; l++) {
                    int q = ((lo[l] >> nshift) & 0x0f) | (((qh[l] >> (2 * k)) & 3) << 4);
                    int g = 8 * h + 2 * k + l / 16; /* group of 16 */
                    y[l] = d * (float)sc[g] * (float)(q - 32);
                }
            }
        }
    }
}

int qt_dequantize_row(enum ggml_type type, const void *src, float *dst, int n)
{
    if (qt_row_bytes(type, n) == 0)
        return -EINVAL;
    const uint8_t *b = src;
    switch (type) {
    case GGML_TYPE_F32:
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return 0;
    case GGML_TYPE_F16: {
        /* src may be unaligned for uint16_t: convert through an aligned copy if so */
        if (((uintptr_t)src & 1) == 0) {
            qt_f16_to_f32_row(src, dst, (size_t)n);
        } else {
            for (int i = 0; i < n; i++)
                dst[i] = qt_f16_to_f32(qt_rd16(b + 2 * i));
        }
        return 0;
    }
    case GGML_TYPE_BF16: {
        if (((uintptr_t)src & 1) == 0) {
            qt_bf16_to_f32_row(src, dst, (size_t)n);
        } else {
            for (int i = 0; i < n; i++)
                dst[i] = qt_bf16_to_f32(qt_rd16(b + 2 * i));
        }
        return 0;
    }
    case GGML_TYPE_Q8_0:
        dequant_q8_0(b, dst, n / 32);
        return 0;
    case GGML_TYPE_Q4_0:
        dequant_q4_0(b, dst, n / 32);
        return 0;
    case GGML_TYPE_Q4_K:
        dequant_q4_K(b, dst, n / 256);
        return 0;
    case GGML_TYPE_Q6_K:
        dequant_q6_K(b, dst, n / 256);
        return 0;
    default:
        return qt_blocks_dequantize(type, b, dst, n);
    }
}

/* ------------------------------------------------------------------------
 * Quantising
 * ------------------------------------------------------------------------ */

/* Store a block scale as f16; its f32 value in *d. -ERANGE if it overflows. */
static int put_scale(uint8_t *p, float scale, float *d)
{
    uint16_t h = qt_f32_to_f16(scale);
    if ((h & 0x7c00) == 0x7c00)
        return -ERANGE;
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
    *d = qt_f16_to_f32(h);
    return 0;
}

/* Nearest level (ties to even) of x / d, clamped to [lo, hi]; 0 if d is 0. */
static int level(float x, float d, int lo, int hi)
{
    if (d == 0.0f)
        return 0;
    float v = nearbyintf(x / d);
    if (v < (float)lo)
        return lo;
    if (v > (float)hi)
        return hi;
    return (int)v;
}

static int quant_q8_0(const float *x, uint8_t *b, int nb)
{
    for (int i = 0; i < nb; i++, x += 32, b += 34) {
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            if (!isfinite(x[k]))
                return -EINVAL;
            amax = fmaxf(amax, fabsf(x[k]));
        }
        float d;
        int rc = put_scale(b, amax / 127.0f, &d);
        if (rc)
            return rc;
        for (int k = 0; k < 32; k++)
            b[2 + k] = (uint8_t)(int8_t)level(x[k], d, -127, 127);
    }
    return 0;
}

/*
 * q4_0 (half 8): the element of largest magnitude maps to level 0 (value
 * -8 d), so d = -max / 8 carries its sign; the opposite extreme lands on
 * level 15 (+7 d), the one asymmetry of the format. q5_0 (half 16: value
 * d (u - 16), u of 5 bits, the low four in nibbles as q4_0's, the fifth
 * in a u32, bit k for element k) the same way with 16 levels either side.
 */
static int quant_q4_0(const float *x, uint8_t *b, int nb, int half)
{
    const bool five = half == 16; /* q5_0: d, the fifth bits (u32 qh), the nibbles */
    const int bytes = five ? 22 : 18, qs = five ? 6 : 2;
    for (int i = 0; i < nb; i++, x += 32, b += bytes) {
        float amax = 0.0f, max = 0.0f;
        for (int k = 0; k < 32; k++) {
            if (!isfinite(x[k]))
                return -EINVAL;
            if (fabsf(x[k]) > amax) {
                amax = fabsf(x[k]);
                max = x[k];
            }
        }
        float d;
        int rc = put_scale(b, max / (float)-half, &d);
        if (rc)
            return rc;
        uint32_t qh = 0;
        for (int k = 0; k < 16; k++) {
            int lo = level(x[k], d, -half, half - 1) + half;
            int hi = level(x[k + 16], d, -half, half - 1) + half;
            b[qs + k] = (uint8_t)((lo & 15) | (hi & 15) << 4);
            qh |= (uint32_t)(lo >> 4) << k | (uint32_t)(hi >> 4) << (k + 16);
        }
        if (five)
            memcpy(b + 2, &qh, 4); /* little-endian, as the format stores it */
    }
    return 0;
}

/* An f16 at or below v (at or above with up): its bits in *h, its value
 * returned; NAN if it does not fit. */
static float f16_toward(float v, bool up, uint16_t *h)
{
    *h = qt_f32_to_f16(v);
    float got = qt_f16_to_f32(*h);
    if (up ? got < v : got > v) { /* one step outward: bits are sign and magnitude */
        bool neg = (*h & 0x8000) != 0, away = up != neg; /* away from zero */
        if ((*h & 0x7fff) == 0)
            *h = up ? 0x0001 : 0x8001;
        else
            *h = (uint16_t)(away ? *h + 1 : *h - 1);
    }
    if ((*h & 0x7c00) == 0x7c00)
        return NAN;
    return qt_f16_to_f32(*h);
}

/* q4_1 and q5_1 (value = d * u + m, u of 4 or 5 bits, q5_1's fifth bits as
 * q5_0's): m the block's minimum rounded down to an f16, d the step that
 * reaches its maximum from there in 15 or 31 steps, rounded up, so every
 * element lies within half a step of its level. */
static int quant_min(enum ggml_type t, const float *x, uint8_t *b, int nb)
{
    const bool five = t == GGML_TYPE_Q5_1;
    const int top = five ? 31 : 15, bytes = five ? 24 : 20, qs = five ? 8 : 4;
    for (int i = 0; i < nb; i++, x += 32, b += bytes) {
        float lo = x[0], hi = x[0];
        for (int k = 0; k < 32; k++) {
            if (!isfinite(x[k]))
                return -EINVAL;
            lo = fminf(lo, x[k]);
            hi = fmaxf(hi, x[k]);
        }
        uint16_t hd, hm;
        float m = f16_toward(lo, false, &hm), d = f16_toward((hi - m) / (float)top, true, &hd);
        if (isnan(m) || isnan(d))
            return -ERANGE;
        b[0] = (uint8_t)(hd & 0xff), b[1] = (uint8_t)(hd >> 8);
        b[2] = (uint8_t)(hm & 0xff), b[3] = (uint8_t)(hm >> 8);
        uint32_t qh = 0;
        for (int k = 0; k < 16; k++) {
            int u0 = level(x[k] - m, d, 0, top), u1 = level(x[k + 16] - m, d, 0, top);
            b[qs + k] = (uint8_t)((u0 & 15) | (u1 & 15) << 4);
            qh |= (uint32_t)(u0 >> 4) << k | (uint32_t)(u1 >> 4) << (k + 16);
        }
        if (five)
            memcpy(b + 4, &qh, 4);
    }
    return 0;
}

int qt_quantize_row(enum ggml_type type, const float *src, void *dst, int n)
{
    if (qt_row_bytes(type, n) == 0)
        return -EINVAL;
    switch (type) {
    case GGML_TYPE_F32:
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return 0;
    case GGML_TYPE_F16:
    case GGML_TYPE_BF16: {
        uint8_t *b = dst;
        for (int i = 0; i < n; i++) {
            uint16_t h = type == GGML_TYPE_F16 ? qt_f32_to_f16(src[i]) : qt_f32_to_bf16(src[i]);
            b[2 * i] = (uint8_t)(h & 0xff); /* byte stores: dst may be unaligned */
            b[2 * i + 1] = (uint8_t)(h >> 8);
        }
        return 0;
    }
    case GGML_TYPE_Q8_0:
        return quant_q8_0(src, dst, n / 32);
    case GGML_TYPE_Q4_0:
        return quant_q4_0(src, dst, n / 32, 8);
    case GGML_TYPE_Q5_0:
        return quant_q4_0(src, dst, n / 32, 16);
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_1:
        return quant_min(type, src, dst, n / 32);
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q4_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_Q6_K:
    case GGML_TYPE_IQ4_XS:
        return qt_quantize_k(type, src, dst, n);
    default:
        return -EINVAL;
    }
}
