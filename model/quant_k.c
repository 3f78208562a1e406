/*
 * quant_k.c - writing the K-quant formats q4_K, q5_K and q6_K (super-blocks
 * of 256 elements), for `kvd quantize`.
 *
 * The layouts are quant.h's and quant_blocks.c's (the readers here are the
 * reference). The encoders choose scales so that every element is within
 * half a step of a level - a bound, not only an average:
 *
 *   q4_K / q5_K  value = d * sc_j * q - dmin * m_j over 8 sub-blocks of 32,
 *                q in [0, 15] / [0, 31], sc_j and m_j 6-bit. Per sub-block
 *                the range [lo, hi] (lo <= 0: the min is subtracted) must be
 *                covered: m_j is lo rounded *up* to the stored dmin's grid,
 *                then sc_j the step that reaches hi from there, rounded *up*
 *                to the stored d's grid. d and dmin are the largest wanted
 *                value / 63, stored as the nearest f16 *at or above* it, so
 *                no 6-bit code overflows. Every element is then rounded to
 *                its nearest level: |x - x'| <= d sc_j / 2.
 *   q6_K         value = d * sc_g * (q - 32) over 16 groups of 16, q in
 *                [0, 63], sc_g int8: the step covers the group's largest
 *                magnitude in 31 levels either side (the 64th level is left
 *                unused, so the bound holds for either sign), rounded up.
 *
 * This is simpler than the mainstream quantiser's search for the scale and
 * min that minimise the squared error (which trades the bound for a lower
 * average); the error is measured in tests/test_quantize.c and the
 * perplexity it costs in the closing table of `kvd quantize`'s docs.
 */
#include <errno.h>
#include <math.h>
#include <string.h>

#include "model/quant.h"

/* The f16 nearest to v from above (v >= 0, finite): bits in *h, value
 * returned; -1 when it overflows f16. */
static float f16_up(float v, uint16_t *h)
{
    *h = qt_f32_to_f16(v);
    if (qt_f16_to_f32(*h) < v)
        (*h)++;
    if ((*h & 0x7c00) == 0x7c00)
        return -1.0f;
    return qt_f16_to_f32(*h);
}

static void put16(uint8_t *p, uint16_t h)
{
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* q4_K's 12 bytes of eight 6-bit scales and mins (qt_q4k_scale_min's inverse). */
static void pack_scales(uint8_t *s, const int *sc, const int *m)
{
    memset(s, 0, 12);
    for (int j = 0; j < 4; j++) {
        s[j] = (uint8_t)sc[j];
        s[j + 4] = (uint8_t)m[j];
    }
    for (int j = 4; j < 8; j++) {
        s[j + 4] = (uint8_t)((sc[j] & 15) | (m[j] & 15) << 4);
        s[j - 4] |= (uint8_t)((sc[j] >> 4) << 6);
        s[j] |= (uint8_t)((m[j] >> 4) << 6);
    }
}

static int ceil_code(float want, float unit, int max)
{
    if (!(unit > 0.0f))
        return 0;
    int c = (int)ceilf(want / unit);
    return c < 0 ? 0 : c > max ? max : c;
}

/*
 * One super-block of q4_K (bits 4) or q5_K (bits 5): the scales into b
 * (d at 0, dmin at 2, scales at 4) and each element's level into q[256].
 */
static int kmin_block(const float *x, uint8_t *b, int bits, uint8_t *q)
{
    const int top = (1 << bits) - 1;
    float lo[8], hi[8], mmax = 0.0f;
    for (int j = 0; j < 8; j++) {
        lo[j] = 0.0f;
        hi[j] = -INFINITY;
        for (int k = 0; k < 32; k++) {
            float v = x[32 * j + k];
            if (!isfinite(v))
                return -EINVAL;
            lo[j] = fminf(lo[j], v);
            hi[j] = fmaxf(hi[j], v);
        }
        hi[j] = fmaxf(hi[j], lo[j]);
        mmax = fmaxf(mmax, -lo[j]);
    }
    uint16_t hd, hm;
    float dmin = f16_up(mmax / 63.0f, &hm);
    if (dmin < 0.0f)
        return -ERANGE;
    int sc[8], m[8];
    float start[8], need[8], dmax = 0.0f;
    for (int j = 0; j < 8; j++) {
        m[j] = ceil_code(-lo[j], dmin, 63);
        start[j] = dmin * (float)m[j]; /* as the reader computes it */
        need[j] = (hi[j] + start[j]) / (float)top;
        dmax = fmaxf(dmax, need[j]);
    }
    float d = f16_up(dmax / 63.0f, &hd);
    if (d < 0.0f)
        return -ERANGE;
    put16(b, hd);
    put16(b + 2, hm);
    for (int j = 0; j < 8; j++) {
        sc[j] = ceil_code(need[j], d, 63);
        float step = d * (float)sc[j];
        for (int k = 0; k < 32; k++) {
            float v = step > 0.0f ? nearbyintf((x[32 * j + k] + start[j]) / step) : 0.0f;
            q[32 * j + k] = (uint8_t)(v < 0.0f ? 0 : v > (float)top ? top : (int)v);
        }
    }
    pack_scales(b + 4, sc, m);
    return 0;
}

static int quant_q4_K(const float *x, uint8_t *b, int nsb)
{
    uint8_t q[256];
    for (int i = 0; i < nsb; i++, x += 256, b += 144) {
        int rc = kmin_block(x, b, 4, q);
        if (rc)
            return rc;
        for (int j = 0; j < 8; j += 2) /* sub-blocks j, j+1: low, high nibbles */
            for (int l = 0; l < 32; l++)
                b[QT_Q4K_QS + 16 * j + l] = (uint8_t)(q[32 * j + l] | q[32 * (j + 1) + l] << 4);
    }
    return 0;
}

static int quant_q5_K(const float *x, uint8_t *b, int nsb)
{
    uint8_t q[256];
    for (int i = 0; i < nsb; i++, x += 256, b += 176) {
        int rc = kmin_block(x, b, 5, q);
        if (rc)
            return rc;
        uint8_t *qh = b + 16, *qs = b + 48;
        memset(qh, 0, 32);
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) {
                int v = q[32 * j + l];
                qh[l] |= (uint8_t)(((v >> 4) & 1) << j);
                if (j & 1)
                    qs[32 * (j / 2) + l] |= (uint8_t)((v & 15) << 4);
                else
                    qs[32 * (j / 2) + l] = (uint8_t)(v & 15);
            }
    }
    return 0;
}

static int quant_q6_K(const float *x, uint8_t *b, int nsb)
{
    for (int i = 0; i < nsb; i++, x += 256, b += 210) {
        float want[16], wmax = 0.0f;
        for (int g = 0; g < 16; g++) {
            float amax = 0.0f;
            for (int k = 0; k < 16; k++) {
                if (!isfinite(x[16 * g + k]))
                    return -EINVAL;
                amax = fmaxf(amax, fabsf(x[16 * g + k]));
            }
            want[g] = amax / 31.0f;
            wmax = fmaxf(wmax, want[g]);
        }
        uint16_t hd;
        float d = f16_up(wmax / 127.0f, &hd);
        if (d < 0.0f)
            return -ERANGE;
        put16(b + QT_Q6K_D, hd);
        int8_t *sc = (int8_t *)(b + QT_Q6K_SCALES);
        for (int g = 0; g < 16; g++)
            sc[g] = (int8_t)ceil_code(want[g], d, 127);
        memset(b + QT_Q6K_QL, 0, 128 + 64);
        for (int e = 0; e < 256; e++) {
            float step = d * (float)sc[e / 16];
            float v = step > 0.0f ? nearbyintf(x[e] / step) : 0.0f;
            int q = (v < -32.0f ? -32 : v > 31.0f ? 31 : (int)v) + 32;
            int h = e / 128, k = (e % 128) / 32, l = e % 32;
            b[QT_Q6K_QL + 64 * h + 32 * (k & 1) + l] |= (uint8_t)((q & 15) << (4 * (k >> 1)));
            b[QT_Q6K_QH + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * k));
        }
    }
    return 0;
}

int qt_quantize_k(enum ggml_type type, const float *src, void *dst, int n)
{
    if (n < 256 || n % 256)
        return -EINVAL;
    switch (type) {
    case GGML_TYPE_Q4_K:
        return quant_q4_K(src, dst, n / 256);
    case GGML_TYPE_Q5_K:
        return quant_q5_K(src, dst, n / 256);
    case GGML_TYPE_Q6_K:
        return quant_q6_K(src, dst, n / 256);
    default:
        return -EINVAL;
    }
}
