/*
 * quant_blocks.c - the other weight formats a common GGUF file holds:
 * q4_1, q5_0, q5_1, iq4_nl (blocks of 32) and q2_K, q3_K, q5_K, iq4_xs
 * (super-blocks of 256). The mainstream quantiser's K mixes fall back to the
 * first four for rows that are not a multiple of 256, its Q2_K, Q3_K_M
 * and Q5_K_M files use the next three, and IQ4_XS files the last.
 *
 * The central idea: every one of these formats, seen 32 elements at a time,
 * is an integer per element, a scale per half of 16 and a min per half:
 *
 *     value[k] = s[k / 16] * w[k] - mn[k / 16],    w[k] a small integer
 *
 * (q4_1/q5_1 add their min: mn = -m; the formats without mins have mn = 0;
 * only q2_K and q3_K have two different scales in a block of 32, and only
 * q2_K two different mins). qt_block32_decode gives exactly that, and
 * matmul_blocks.c multiplies the blocks of 32 with it against the 8-bit
 * activations (the K formats have matmul_k.c's kernels). The row
 * decoders (qt_blocks_dequantize) are written per format, element by
 * element as the format is described below, and are the reference the
 * products are tested against.
 *
 * Layouts (little-endian, f16 scales "d", "m", "dmin"; no padding), as ggml
 * defines them:
 *   q4_1   20 B: d, m, qs[16]           w = d*q + m; q: low nibbles of qs are
 *                                       elements 0..15, high nibbles 16..31
 *   q5_0   22 B: d, qh[4], qs[16]       w = d*(q - 16); q = nibble | bit e of
 *                                       the u32 qh as bit 4
 *   q5_1   24 B: d, m, qh[4], qs[16]    w = d*q + m; q as in q5_0
 *   iq4_nl 18 B: d, qs[16]              w = d*K[nibble], K the 16 fixed levels
 *   q2_K   84 B: scales[16], qs[64], d, dmin. Element 128h + 32j + l
 *                (h < 2, j < 4, l < 32): q = bits 2j..2j+1 of qs[32h + l];
 *                group g = 8h + 2j + l/16: w = d*(scales[g] & 15)*q
 *                - dmin*(scales[g] >> 4)
 *   q3_K  110 B: hmask[32], qs[64], scales[12], d. Element 128h + 32j + l:
 *                q = bits 2j..2j+1 of qs[32h + l], minus 4 unless bit 4h+j
 *                of hmask[l] is set; group g as in q2_K has a 6-bit scale
 *                (low four bits: g < 8 ? scales[g] & 15 : scales[g-8] >> 4;
 *                top two: bits 2(g/4).. of scales[8 + g%4]), used as
 *                scale - 32: w = d*(scale - 32)*q
 *   q5_K  176 B: d, dmin, scales[12] (q4_K's packing), qh[32], qs[128].
 *                Sub-block j of 32 (j < 8), element l: low four bits are
 *                nibble (j odd: high) of qs[32(j/2) + l], bit 4 is bit j of
 *                qh[l]: w = d*sc_j*q - dmin*m_j
 *   iq4_xs 136 B: d, scales_h (u16), scales_l[4], qs[128]. Sub-block j of
 *                32 has a 6-bit scale ls_j: low four bits the nibble (j odd:
 *                high) of scales_l[j/2], top two bits 2j..2j+1 of scales_h;
 *                element l of it is iq4_nl's w = d*(ls_j - 32)*K[nibble],
 *                the nibble taken from qs[16j..16j+15] as in iq4_nl
 *
 * Everything here is thread-safe and allocates nothing.
 */
#include <errno.h>
#include <string.h>

#include "model/quant.h"

/* iq4_nl's 16 levels (ggml's kvalues_iq4nl): denser near zero. */
static const int8_t IQ4NL_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};

static float f16_at(const uint8_t *p)
{
    return qt_f16_to_f32(qt_rd16(p));
}

static uint32_t rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

bool qt_is_block_type(enum ggml_type type)
{
    switch (type) {
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_Q5_1:
    case GGML_TYPE_IQ4_NL:
    case GGML_TYPE_Q2_K:
    case GGML_TYPE_Q3_K:
    case GGML_TYPE_Q5_K:
    case GGML_TYPE_IQ4_XS:
        return true;
    default:
        return false;
    }
}

/* The 6-bit scale of q3_K group g (0..15), before the -32 (quant.h unpacks them). */
static int q3k_scale(const uint8_t *sc, int g)
{
    uint32_t w[4];
    qt_q3k_scale_words(sc, w);
    return (int)(w[g / 4] >> (8 * (g % 4)) & 0xff);
}

/* ------------------------------------------------------------------------
 * Blocks of 32 as integers, scales and mins
 * ------------------------------------------------------------------------ */

/* iq4_nl's 32 levels of the nibbles of qs[16] (low: elements 0..15). */
static void iq4_levels(const uint8_t *qs, int8_t *w)
{
    for (int k = 0; k < 16; k++) {
        w[k] = IQ4NL_LEVELS[qs[k] & 15];
        w[k + 16] = IQ4NL_LEVELS[qs[k] >> 4];
    }
}

/* The integers of q4_1, q5_0, q5_1, iq4_nl blocks (u: the block). */
static void decode_small(enum ggml_type type, const uint8_t *u, int8_t *w)
{
    const uint8_t *qs;
    uint32_t qh = 0;
    int off = 0; /* subtracted from every q */
    switch (type) {
    case GGML_TYPE_Q4_1:
        qs = u + 4;
        break;
    case GGML_TYPE_Q5_0:
        qh = rd32(u + 2);
        qs = u + 6;
        off = 16;
        break;
    case GGML_TYPE_Q5_1:
        qh = rd32(u + 4);
        qs = u + 8;
        break;
    default: /* IQ4_NL */
        iq4_levels(u + 2, w);
        return;
    }
    for (int k = 0; k < 16; k++) {
        int lo = (qs[k] & 15) | (int)((qh >> k) & 1) << 4;
        int hi = (qs[k] >> 4) | (int)((qh >> (k + 16)) & 1) << 4;
        w[k] = (int8_t)(lo - off);
        w[k + 16] = (int8_t)(hi - off);
    }
}

void qt_block32_scales(enum ggml_type type, const uint8_t *row, int b, float *s, float *mn)
{
    int j = b % 8; /* the 32-element block inside a K super-block */
    const uint8_t *u;
    switch (type) {
    case GGML_TYPE_Q2_K:
        u = row + 84 * (size_t)(b / 8);
        for (int half = 0; half < 2; half++) {
            uint8_t sc = u[2 * j + half];
            s[half] = f16_at(u + 80) * (float)(sc & 15);
            mn[half] = f16_at(u + 82) * (float)(sc >> 4);
        }
        return;
    case GGML_TYPE_Q3_K:
        u = row + 110 * (size_t)(b / 8);
        for (int half = 0; half < 2; half++) {
            s[half] = f16_at(u + 108) * (float)(q3k_scale(u + 96, 2 * j + half) - 32);
            mn[half] = 0.0f;
        }
        return;
    case GGML_TYPE_IQ4_XS:
        u = qt_iq4xs_sb(row, b);
        s[0] = s[1] = f16_at(u + QT_IQ4XS_D) * (float)qt_iq4xs_scale(u, j);
        mn[0] = mn[1] = 0.0f;
        return;
    case GGML_TYPE_Q5_K: {
        u = row + 176 * (size_t)(b / 8);
        int sc, m;
        qt_q4k_scale_min(u + 4, j, &sc, &m);
        s[0] = s[1] = f16_at(u) * (float)sc;
        mn[0] = mn[1] = f16_at(u + 2) * (float)m;
        return;
    }
    default:
        u = row + qt_block_bytes(type) * (size_t)b;
        s[0] = s[1] = f16_at(u);
        /* q4_1 and q5_1 add their min */
        mn[0] = mn[1] = type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1 ? -f16_at(u + 2) : 0.0f;
        return;
    }
}

void qt_block32_decode(enum ggml_type type, const uint8_t *row, int b, int8_t *w, float *s,
                       float *mn)
{
    int j = b % 8; /* the 32-element block inside a K super-block */
    qt_block32_scales(type, row, b, s, mn);
    switch (type) {
    case GGML_TYPE_Q2_K: {
        const uint8_t *q = row + 84 * (size_t)(b / 8) + 16 + 32 * (j / 4);
        int shift = 2 * (j % 4);
        for (int l = 0; l < 32; l++)
            w[l] = (int8_t)((q[l] >> shift) & 3);
        return;
    }
    case GGML_TYPE_Q3_K: {
        const uint8_t *u = row + 110 * (size_t)(b / 8);
        const uint8_t *hm = u, *q = u + 32 + 32 * (j / 4);
        int shift = 2 * (j % 4), bit = j; /* bit 4h + j' of hmask is bit j here */
        for (int l = 0; l < 32; l++)
            w[l] = (int8_t)(((q[l] >> shift) & 3) - ((hm[l] >> bit) & 1 ? 0 : 4));
        return;
    }
    case GGML_TYPE_Q5_K: {
        const uint8_t *u = row + 176 * (size_t)(b / 8);
        const uint8_t *qh = u + 16, *q = u + 48 + 32 * (j / 2);
        int nib = 4 * (j & 1);
        for (int l = 0; l < 32; l++)
            w[l] = (int8_t)(((q[l] >> nib) & 15) | ((qh[l] >> j) & 1) << 4);
        return;
    }
    case GGML_TYPE_IQ4_XS:
        iq4_levels(qt_iq4xs_qs(row, b), w);
        return;
    default:
        decode_small(type, row + qt_block_bytes(type) * (size_t)b, w);
        return;
    }
}

/* ------------------------------------------------------------------------
 * Rows to f32
 * ------------------------------------------------------------------------ */

int qt_blocks_dequantize(enum ggml_type type, const uint8_t *src, float *dst, int n)
{
    if (!qt_is_block_type(type) || qt_row_bytes(type, n) == 0)
        return -EINVAL;
    int8_t w[32];
    float s[2], mn[2];
    for (int b = 0; b < n / 32; b++, dst += 32) {
        qt_block32_decode(type, src, b, w, s, mn);
        for (int k = 0; k < 32; k++)
            dst[k] = s[k / 16] * (float)w[k] - mn[k / 16];
    }
    return 0;
}
