/*
 * quant_k.c - writing the K-quant formats q2_K to q6_K and iq4_xs
 * (super-blocks of 256 elements), for `kvd quantize` and `kvd mkmodel`.
 *
 * The layouts are quant.h's and quant_blocks.c's (the readers here are the
 * reference). The encoders choose scales so that every element is within
 * half a step of a level - a bound, not only an average:
 *
 *   q4_K / q5_K  value = d * sc_j * q - dmin * m_j over 8 sub-blocks of 32,
 *                q in [0, 15] / [0, 31], sc_j and m_j 6-bit (q2_K the same
 *                over 16 groups of 16, q in [0, 3], sc_j and m_j 4-bit,
 *                d and dmin the largest wanted value / 15). Per sub-block
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
 *   q3_K         value = d * (sc_g - 32) * q, q in [-4, 3], sc_g 6-bit: the
 *                step covers the group's positive elements in 3 levels and
 *                its negative ones in 4, or with a negative scale the other
 *                way round, whichever step is smaller (the 8th level is
 *                half of q3_K's range below 4 bits: RMS error 0.20 -> 0.16
 *                of the RMS on Gaussian rows), rounded up.
 *   iq4_xs       value = d * (ls_j - 32) * K[q] over 8 sub-blocks of 32, K
 *                iq4_nl's 16 fixed levels (-127 .. 113, closer near zero),
 *                ls_j 6-bit: the scale puts the sub-block's largest
 *                magnitude on -127 (its sign chosen so), rounded up in
 *                magnitude, and each element takes the nearest level.
 *                The levels are not evenly spaced, so the bound is half
 *                the widest gap or the 14 above the top level, whichever
 *                is more: |x - x'| <= 14 |d (ls_j - 32)|.
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

/* A super-block's scales as kmin_block chooses them: f16 bits of d and
 * dmin, and the codes of each group's scale and min. */
struct kmin {
    uint16_t hd, hm;
    int sc[16], m[16];
};

/*
 * One super-block of q4_K (ng 8, bits 4, codes up to 63), q5_K (8, 5, 63)
 * or q2_K (16, 2, 15): the scales into k and each element's level into
 * q[256].
 */
static int kmin_block(const float *x, int ng, int bits, int cmax, struct kmin *k, uint8_t *q)
{
    const int top = (1 << bits) - 1, gs = 256 / ng;
    float lo[16], hi[16], mmax = 0.0f;
    for (int j = 0; j < ng; j++) {
        lo[j] = 0.0f;
        hi[j] = -INFINITY;
        for (int e = 0; e < gs; e++) {
            float v = x[gs * j + e];
            if (!isfinite(v))
                return -EINVAL;
            lo[j] = fminf(lo[j], v);
            hi[j] = fmaxf(hi[j], v);
        }
        hi[j] = fmaxf(hi[j], lo[j]);
        mmax = fmaxf(mmax, -lo[j]);
    }
    float dmin = f16_up(mmax / (float)cmax, &k->hm);
    if (dmin < 0.0f)
        return -ERANGE;
    float start[16], need[16], dmax = 0.0f;
    for (int j = 0; j < ng; j++) {
        k->m[j] = ceil_code(-lo[j], dmin, cmax);
        start[j] = dmin * (float)k->m[j]; /* as the reader computes it */
        need[j] = (hi[j] + start[j]) / (float)top;
        dmax = fmaxf(dmax, need[j]);
    }
    float d = f16_up(dmax / (float)cmax, &k->hd);
    if (d < 0.0f)
        return -ERANGE;
    for (int j = 0; j < ng; j++) {
        k->sc[j] = ceil_code(need[j], d, cmax);
        float step = d * (float)k->sc[j];
        for (int e = 0; e < gs; e++) {
            float v = step > 0.0f ? nearbyintf((x[gs * j + e] + start[j]) / step) : 0.0f;
            q[gs * j + e] = (uint8_t)(v < 0.0f ? 0 : v > (float)top ? top : (int)v);
        }
    }
    return 0;
}

/* q4_K's and q5_K's d, dmin and packed scales (bytes 0..15). */
static void put_kmin(uint8_t *b, const struct kmin *k)
{
    put16(b + QT_Q4K_D, k->hd);
    put16(b + QT_Q4K_DMIN, k->hm);
    pack_scales(b + QT_Q4K_SCALES, k->sc, k->m);
}

/* Element e = 128h + 32j + l of q2_K and q3_K: bits 2j, 2j+1 of qs[32h + l]. */
static void put_2bit(uint8_t *qs, int e, int v)
{
    qs[32 * (e / 128) + e % 32] |= (uint8_t)((v & 3) << (2 * ((e % 128) / 32)));
}

static int quant_q2_K(const float *x, uint8_t *b, int nsb)
{
    uint8_t q[256];
    for (int i = 0; i < nsb; i++, x += 256, b += 84) {
        struct kmin k;
        int rc = kmin_block(x, 16, 2, 15, &k, q);
        if (rc)
            return rc;
        put16(b + QT_Q2K_D, k.hd);
        put16(b + QT_Q2K_DMIN, k.hm);
        for (int g = 0; g < 16; g++)
            b[QT_Q2K_SCALES + g] = (uint8_t)(k.sc[g] | k.m[g] << 4);
        memset(b + QT_Q2K_QS, 0, 64);
        for (int e = 0; e < 256; e++)
            put_2bit(b + QT_Q2K_QS, e, q[e]);
    }
    return 0;
}

/*
 * The signed step of each of 16 groups, as codes of d (magnitude up to
 * cmax) rounded up, for levels -below..above: q3_K (4, 3) and q6_K (31,
 * 31). With more levels below zero than above, the scale's sign is chosen
 * per group, whichever gives the smaller step: positive (positive max /
 * above, negative max / below) or negative (the other way round). d's f16
 * bits into *hd; -EINVAL for a non-finite element, -ERANGE when d is
 * beyond f16.
 */
static int signed_steps(const float *x, int below, int above, int cmax, uint16_t *hd, float *d,
                        int *sc)
{
    float want[16], wmax = 0.0f;
    bool neg[16];
    for (int g = 0; g < 16; g++) {
        float pmax = 0.0f, nmax = 0.0f;
        for (int e = 0; e < 16; e++) {
            float v = x[16 * g + e];
            if (!isfinite(v))
                return -EINVAL;
            pmax = fmaxf(pmax, v);
            nmax = fmaxf(nmax, -v);
        }
        float up = fmaxf(pmax / (float)above, nmax / (float)below); /* scale > 0 */
        float down = fmaxf(pmax / (float)below, nmax / (float)above); /* scale < 0 */
        neg[g] = down < up;
        want[g] = neg[g] ? down : up;
        wmax = fmaxf(wmax, want[g]);
    }
    *d = f16_up(wmax / (float)cmax, hd);
    if (*d < 0.0f)
        return -ERANGE;
    for (int g = 0; g < 16; g++)
        sc[g] = (neg[g] ? -1 : 1) * ceil_code(want[g], *d, cmax);
    return 0;
}

/* x / step (of either sign) rounded to the nearest level in [lo, hi]. */
static int level(float x, float step, int lo, int hi)
{
    float v = step != 0.0f ? nearbyintf(x / step) : 0.0f;
    return v < (float)lo ? lo : v > (float)hi ? hi : (int)v;
}

static int quant_q3_K(const float *x, uint8_t *b, int nsb)
{
    for (int i = 0; i < nsb; i++, x += 256, b += 110) {
        uint16_t hd;
        float d;
        int sc[16];
        int rc = signed_steps(x, 4, 3, 31, &hd, &d, sc);
        if (rc)
            return rc;
        put16(b + QT_Q3K_D, hd);
        uint8_t *s = b + QT_Q3K_SCALES; /* qt_q3k_scale_words' inverse */
        memset(s, 0, 12);
        for (int g = 0; g < 16; g++) {
            int c = sc[g] + 32;
            s[g % 8] |= (uint8_t)((c & 15) << (4 * (g / 8)));
            s[8 + g % 4] |= (uint8_t)((c >> 4) << (2 * (g / 4)));
        }
        memset(b + QT_Q3K_HMASK, 0, 32 + 64);
        for (int e = 0; e < 256; e++) {
            int u = level(x[e], d * (float)sc[e / 16], -4, 3) + 4; /* hmask bit: u >= 4 */
            put_2bit(b + QT_Q3K_QS, e, u);
            b[QT_Q3K_HMASK + e % 32] |= (uint8_t)((u >> 2) << ((e / 128) * 4 + (e % 128) / 32));
        }
    }
    return 0;
}

static int quant_q4_K(const float *x, uint8_t *b, int nsb)
{
    uint8_t q[256];
    for (int i = 0; i < nsb; i++, x += 256, b += 144) {
        struct kmin k;
        int rc = kmin_block(x, 8, 4, 63, &k, q);
        if (rc)
            return rc;
        put_kmin(b, &k);
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
        struct kmin k;
        int rc = kmin_block(x, 8, 5, 63, &k, q);
        if (rc)
            return rc;
        put_kmin(b, &k);
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
        uint16_t hd;
        float d;
        int sc[16];
        int rc = signed_steps(x, 31, 31, 127, &hd, &d, sc); /* the 64th level unused */
        if (rc)
            return rc;
        put16(b + QT_Q6K_D, hd);
        for (int g = 0; g < 16; g++)
            b[QT_Q6K_SCALES + g] = (uint8_t)sc[g];
        memset(b + QT_Q6K_QL, 0, 128 + 64);
        for (int e = 0; e < 256; e++) {
            int q = level(x[e], d * (float)sc[e / 16], -32, 31) + 32;
            int h = e / 128, k = (e % 128) / 32, l = e % 32;
            b[QT_Q6K_QL + 64 * h + 32 * (k & 1) + l] |= (uint8_t)((q & 15) << (4 * (k >> 1)));
            b[QT_Q6K_QH + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * k));
        }
    }
    return 0;
}

/* iq4_nl's levels, as quant_blocks.c reads them. */
static const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

/* The index of the level nearest to v (levels ascending). */
static int iq4_nearest(float v)
{
    int k = 0;
    while (k < 15 && v > 0.5f * (float)(IQ4_LEVELS[k] + IQ4_LEVELS[k + 1]))
        k++;
    return k;
}

static int quant_iq4_xs(const float *x, uint8_t *b, int nsb)
{
    for (int i = 0; i < nsb; i++, x += 256, b += QT_IQ4XS_BYTES) {
        float want[8], wmax = 0.0f;
        bool neg[8];
        for (int j = 0; j < 8; j++) {
            float top = 0.0f; /* the element of largest magnitude */
            for (int e = 0; e < 32; e++) {
                float v = x[32 * j + e];
                if (!isfinite(v))
                    return -EINVAL;
                if (fabsf(v) > fabsf(top))
                    top = v;
            }
            neg[j] = top > 0.0f; /* top / scale = -127 */
            want[j] = fabsf(top) / 127.0f;
            wmax = fmaxf(wmax, want[j]);
        }
        uint16_t hd;
        float d = f16_up(wmax / 31.0f, &hd);
        if (d < 0.0f)
            return -ERANGE;
        put16(b + QT_IQ4XS_D, hd);
        memset(b + QT_IQ4XS_SCALES_H, 0, QT_IQ4XS_QS - QT_IQ4XS_SCALES_H);
        unsigned scales_h = 0;
        for (int j = 0; j < 8; j++) {
            int s = (neg[j] ? -1 : 1) * ceil_code(want[j], d, 31), ls = s + 32;
            b[QT_IQ4XS_SCALES_L + j / 2] |= (uint8_t)((ls & 15) << (4 * (j & 1)));
            scales_h |= (unsigned)(ls >> 4) << (2 * j);
            float step = d * (float)s;
            uint8_t *qs = b + QT_IQ4XS_QS + 16 * j;
            for (int e = 0; e < 16; e++) { /* low nibbles: elements 0..15 */
                int lo = step != 0.0f ? iq4_nearest(x[32 * j + e] / step) : 8;
                int hi = step != 0.0f ? iq4_nearest(x[32 * j + 16 + e] / step) : 8;
                qs[e] = (uint8_t)(lo | hi << 4);
            }
        }
        put16(b + QT_IQ4XS_SCALES_H, (uint16_t)scales_h);
    }
    return 0;
}

int qt_quantize_k(enum ggml_type type, const float *src, void *dst, int n)
{
    if (n < 256 || n % 256)
        return -EINVAL;
    switch (type) {
    case GGML_TYPE_Q2_K:
        return quant_q2_K(src, dst, n / 256);
    case GGML_TYPE_Q3_K:
        return quant_q3_K(src, dst, n / 256);
    case GGML_TYPE_Q4_K:
        return quant_q4_K(src, dst, n / 256);
    case GGML_TYPE_Q5_K:
        return quant_q5_K(src, dst, n / 256);
    case GGML_TYPE_Q6_K:
        return quant_q6_K(src, dst, n / 256);
    case GGML_TYPE_IQ4_XS:
        return quant_iq4_xs(src, dst, n / 256);
    default:
        return -EINVAL;
    }
}
