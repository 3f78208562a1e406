/*
 * posenc.c - position schemes: T5 relative buckets, ALiBi slopes, RoPE.
 *
 * Each function is a transcription of the formula the reference
 * implementation computes, including its arithmetic precision: the T5
 * bucket uses a float32 logarithm and truncation toward zero like Hugging
 * Face's T5Attention._relative_position_bucket, because a model learned its
 * table against exactly those bucket boundaries. RoPE angles are evaluated
 * in double so that a rotation at position 10^5 is as exact as at position 1:
 * kvd rotates keys by their *current* position number in the kernel, and
 * position numbers grow without bound in a long session.
 */
#include "attention.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

const char *pos_kind_name(enum pos_kind kind)
{
    switch (kind) {
    case POS_NONE: return "none";
    case POS_ROPE: return "rope";
    case POS_ALIBI: return "alibi";
    case POS_T5: return "t5";
    }
    return "unknown";
}

/* ------------------------------------------------------------------------
 * T5 buckets
 * ------------------------------------------------------------------------ */

/* Buckets available to one direction, and the exact range inside them. */
static void t5_split(bool bidirectional, int num_buckets, int *slots, int *max_exact)
{
    *slots = bidirectional ? num_buckets / 2 : num_buckets;
    *max_exact = *slots / 2;
}

int pos_t5_check(int num_buckets, int max_distance, bool bidirectional, char *err,
                 size_t errlen)
{
    if (num_buckets < 4) {
        snprintf(err, errlen, "num_buckets must be at least 4 (got %d)", num_buckets);
        return -EINVAL;
    }
    int slots, max_exact;
    t5_split(bidirectional, num_buckets, &slots, &max_exact);
    if (max_distance <= max_exact) {
        snprintf(err, errlen,
                 "max_distance %d must exceed the exact range %d of %d %s buckets "
                 "(the logarithmic buckets would be empty or negative)",
                 max_distance, max_exact, num_buckets,
                 bidirectional ? "bidirectional" : "causal");
        return -EINVAL;
    }
    return 0;
}

int pos_t5_bucket(int64_t offset, bool bidirectional, int num_buckets, int max_distance)
{
    int slots, max_exact;
    t5_split(bidirectional, num_buckets, &slots, &max_exact);

    int base = 0;
    int64_t dist;
    if (bidirectional) {
        if (offset > 0)
            base = slots; /* key to the right of the query */
        dist = offset < 0 ? -offset : offset;
    } else {
        dist = offset < 0 ? -offset : 0; /* causal: only looking back counts */
    }
    if (dist < max_exact)
        return base + (int)dist;

    /* log(d / max_exact) / log(max_distance / max_exact) * (slots - max_exact),
     * evaluated left to right in float32 as torch does; the divisor is a
     * Python float (double) rounded to float32 by the tensor op. */
    float ratio = (float)dist / (float)max_exact;
    float denom = (float)log((double)max_distance / (double)max_exact);
    float scaled = logf(ratio) / denom * (float)(slots - max_exact);
    int64_t large = max_exact + (int64_t)scaled; /* truncation toward zero */
    if (large > slots - 1)
        large = slots - 1;
    return base + (int)large;
}

int pos_t5_saturation(bool forward, bool bidirectional, int num_buckets, int max_distance)
{
    if (forward && !bidirectional)
        return 1;
    int slots, max_exact;
    t5_split(bidirectional, num_buckets, &slots, &max_exact);
    int sign = forward ? 1 : -1;
    int last = pos_t5_bucket(sign * (int64_t)INT32_MAX, bidirectional, num_buckets, max_distance);
    /* Buckets are non-decreasing in distance, so the first distance that
     * reaches the last bucket starts saturation. It lies near max_distance. */
    int d = max_exact;
    while (pos_t5_bucket(sign * (int64_t)d, bidirectional, num_buckets, max_distance) != last)
        d++;
    return d;
}

int pos_t5_lut_init(struct pos_t5_lut *lut, bool bidirectional, int num_buckets,
                    int max_distance)
{
    int nb = pos_t5_saturation(false, bidirectional, num_buckets, max_distance);
    int nf = pos_t5_saturation(true, bidirectional, num_buckets, max_distance);
    int n = nb > nf ? nb : nf;
    lut->n = n;
    lut->back = malloc(sizeof(int32_t) * (size_t)n);
    lut->fwd = malloc(sizeof(int32_t) * (size_t)n);
    if (!lut->back || !lut->fwd) {
        pos_t5_lut_deinit(lut);
        return -ENOMEM;
    }
    for (int d = 0; d < n; d++) {
        lut->back[d] = pos_t5_bucket(-(int64_t)d, bidirectional, num_buckets, max_distance);
        lut->fwd[d] = pos_t5_bucket((int64_t)d, bidirectional, num_buckets, max_distance);
    }
    lut->back_last = pos_t5_bucket(-(int64_t)n, bidirectional, num_buckets, max_distance);
    lut->fwd_last = pos_t5_bucket((int64_t)n, bidirectional, num_buckets, max_distance);
    return 0;
}

void pos_t5_lut_deinit(struct pos_t5_lut *lut)
{
    free(lut->back);
    free(lut->fwd);
    lut->back = lut->fwd = NULL;
    lut->n = 0;
}

/* ------------------------------------------------------------------------
 * ALiBi
 * ------------------------------------------------------------------------ */

int pos_alibi_slopes(float *slopes, int n_head, float max_bias)
{
    if (n_head < 1 || !(max_bias > 0.0f))
        return -EINVAL;
    int n2 = 1;
    while (n2 * 2 <= n_head)
        n2 *= 2;
    /* Same float arithmetic as llama.cpp's soft_max, so GGUF models see the
     * slopes they were converted with. */
    float m0 = powf(2.0f, -max_bias / (float)n2);
    float m1 = powf(2.0f, -(max_bias / 2.0f) / (float)n2);
    for (int h = 0; h < n_head; h++)
        slopes[h] = h < n2 ? powf(m0, (float)(h + 1)) : powf(m1, (float)(2 * (h - n2) + 1));
    return 0;
}

/* ------------------------------------------------------------------------
 * RoPE
 * ------------------------------------------------------------------------ */

void pos_rope_inv_freq(double *inv_freq, int rope_dims, double theta)
{
    for (int i = 0; i < rope_dims / 2; i++)
        inv_freq[i] = pow(theta, -2.0 * i / rope_dims);
}

void pos_rope_freqs(double *inv_freq, const struct pos_scheme *ps)
{
    pos_rope_inv_freq(inv_freq, ps->rope_dims, (double)ps->rope_theta);
    for (int i = 0; ps->rope_freq_factors && i < ps->rope_dims / 2; i++)
        inv_freq[i] /= (double)ps->rope_freq_factors[i];
}

void pos_rope_cos_sin(float *cs, const double *inv_freq, int rope_dims, double freq_scale,
                      int64_t pos)
{
    for (int i = 0; i < rope_dims / 2; i++) {
        double angle = (double)pos * freq_scale * inv_freq[i];
        cs[2 * i] = (float)cos(angle);
        cs[2 * i + 1] = (float)sin(angle);
    }
}

void pos_rope_apply(float *x, const float *cs, int rope_dims, enum pos_rope_pairing pairing)
{
    int half = rope_dims / 2;
    for (int i = 0; i < half; i++) {
        int a = pairing == POS_ROPE_NEOX ? i : 2 * i;
        int b = pairing == POS_ROPE_NEOX ? i + half : 2 * i + 1;
        float c = cs[2 * i], s = cs[2 * i + 1];
        float x0 = x[a], x1 = x[b];
        x[a] = x0 * c - x1 * s;
        x[b] = x0 * s + x1 * c;
    }
}
