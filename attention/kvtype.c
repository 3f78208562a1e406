/*
 * kvtype.c - the element types of cached keys and values: sizes, names, and
 * the one place a row is converted or quantised into a cache slot.
 *
 * The float types (f32, f16, bf16) store every element alone. The block
 * types are GGUF's q8_0 and q4_0: 32 elements share one f16 scale, so a
 * 64-dim head row takes 68 bytes in q8_0 and 36 in q4_0, against 128 in f16.
 * A row is quantised once, when its token is appended, and never rewritten:
 * eviction moves or frees whole rows, and RoPE is applied by the kernel to
 * the dequantised values, so no requantisation error can pile up however
 * often a session is evicted or renumbered.
 *
 * Rounding: the scale is rounded to f16 first and each element to the
 * nearest level of that stored scale, so the stored row is the best one the
 * format allows for that scale (ggml rounds against the unrounded scale).
 */
#include "attention_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>

size_t attn_type_size(enum attn_type type)
{
    switch (type) {
    case ATTN_F32:
        return 4;
    case ATTN_F16:
    case ATTN_BF16:
        return 2;
    case ATTN_Q8_0:
    case ATTN_Q4_0:
        break;
    }
    return 0;
}

const char *attn_type_name(enum attn_type type)
{
    switch (type) {
    case ATTN_F32:
        return "f32";
    case ATTN_F16:
        return "f16";
    case ATTN_BF16:
        return "bf16";
    case ATTN_Q8_0:
        return "q8_0";
    case ATTN_Q4_0:
        return "q4_0";
    }
    return "unknown";
}

int attn_type_block(enum attn_type type)
{
    if (attn_type_blocked(type))
        return ATTN_QK;
    return attn_type_size(type) ? 1 : 0;
}

size_t attn_row_bytes(enum attn_type type, int n)
{
    int blk = attn_type_block(type);
    if (!blk || n < 1 || n % blk)
        return 0;
    switch (type) {
    case ATTN_Q8_0:
        return (size_t)(n / ATTN_QK) * ATTN_Q8_0_BYTES;
    case ATTN_Q4_0:
        return (size_t)(n / ATTN_QK) * ATTN_Q4_0_BYTES;
    default:
        return (size_t)n * attn_type_size(type);
    }
}

int attn_type_check(enum attn_type type, int head_dim, char *err, size_t errlen)
{
    int blk = attn_type_block(type);
    if (!blk) {
        if (err && errlen)
            snprintf(err, errlen, "unknown KV type %d", (int)type);
        return -EINVAL;
    }
    if (head_dim < 1 || head_dim % blk) {
        if (err && errlen)
            snprintf(err, errlen,
                     "KV type %s stores blocks of %d elements: head_dim %d is not a multiple "
                     "of %d (use f16, bf16 or f32 for this model)",
                     attn_type_name(type), blk, head_dim, blk);
        return -EINVAL;
    }
    return 0;
}

/* Write the f16 scale of a block. */
static void put_scale(uint8_t *blk, uint16_t h)
{
    blk[0] = (uint8_t)(h & 0xff);
    blk[1] = (uint8_t)(h >> 8);
}

/*
 * The stored scale for a block whose levels must reach `want` (d = want /
 * levels), as f16 bits and as the float it reads back as. Non-finite input
 * gives a NaN scale; a scale past f16's range is clamped to its largest
 * finite value.
 */
static float block_scale(float want, uint16_t *bits)
{
    if (!isfinite(want)) {
        *bits = 0x7e00u; /* quiet NaN */
        return NAN;
    }
    if (fabsf(want) > 65504.0f)
        want = copysignf(65504.0f, want);
    *bits = attn_f32_to_f16(want);
    return attn_f16_to_f32(*bits);
}

/* Nearest integer of x / d, clamped to [lo, hi]; 0 when d is 0 or NaN. */
static int level(float x, float d, int lo, int hi)
{
    if (!(d != 0.0f) || isnan(d))
        return 0;
    float r = nearbyintf(x / d);
    return r < (float)lo ? lo : r > (float)hi ? hi : (int)r;
}

static void quantize_q8_0(uint8_t *dst, const float *x)
{
    float amax = 0.0f;
    bool finite = true;
    for (int i = 0; i < ATTN_QK; i++) {
        finite = finite && isfinite(x[i]);
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    uint16_t bits;
    float d = block_scale(finite ? amax / 127.0f : NAN, &bits);
    put_scale(dst, bits);
    for (int i = 0; i < ATTN_QK; i++)
        dst[2 + i] = (uint8_t)(int8_t)level(x[i], d, -127, 127);
}

static void quantize_q4_0(uint8_t *dst, const float *x)
{
    float amax = 0.0f, vmax = 0.0f;
    bool finite = true;
    for (int i = 0; i < ATTN_QK; i++) {
        finite = finite && isfinite(x[i]);
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    }
    uint16_t bits;
    float d = block_scale(finite ? vmax / -8.0f : NAN, &bits);
    put_scale(dst, bits);
    for (int i = 0; i < ATTN_QK / 2; i++) {
        int lo = level(x[i], d, -8, 7) + 8, hi = level(x[i + ATTN_QK / 2], d, -8, 7) + 8;
        dst[2 + i] = (uint8_t)(lo | (hi << 4));
    }
}

void attn_store_row(void *dst, const float *src, int n, enum attn_type type)
{
    uint8_t *b = dst;
    switch (type) {
    case ATTN_F32:
        memcpy(dst, src, sizeof(float) * (size_t)n);
        return;
    case ATTN_F16:
    case ATTN_BF16:
        for (int i = 0; i < n; i++) {
            uint16_t h = type == ATTN_F16 ? attn_f32_to_f16(src[i]) : attn_f32_to_bf16(src[i]);
            memcpy(b + 2 * (size_t)i, &h, 2);
        }
        return;
    case ATTN_Q8_0:
        for (int i = 0; i + ATTN_QK <= n; i += ATTN_QK, b += ATTN_Q8_0_BYTES)
            quantize_q8_0(b, src + i);
        return;
    case ATTN_Q4_0:
        for (int i = 0; i + ATTN_QK <= n; i += ATTN_QK, b += ATTN_Q4_0_BYTES)
            quantize_q4_0(b, src + i);
        return;
    }
}

void attn_load_row(float *dst, const void *src, int n, enum attn_type type)
{
    for (int i = 0; i < n; i++)
        dst[i] = attn_load(src, i, type);
}
