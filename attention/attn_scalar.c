/*
 * attn_scalar.c - the portable tile operations of the fused kernel.
 *
 * Plain C for every operation of struct attn_ops (attention_internal.h):
 * the path on machines without AVX2 or AVX-512, and the one the tests run
 * beside the SIMD table (attn_params.force_scalar). Rows of any type are
 * converted to f32 one at a time (f16, bf16 exactly; q8_0, q4_0
 * dequantised), then everything is f32 arithmetic.
 */
#include "attention_internal.h"

#include <math.h>

static void row_to_f32(float *dst, const void *row, int off, int n, enum attn_type type)
{
    switch (type) {
    case ATTN_F32:
        memcpy(dst, (const float *)row + off, sizeof(float) * (size_t)n);
        return;
    case ATTN_F16:
        for (int i = 0; i < n; i++)
            dst[i] = attn_f16_to_f32(((const uint16_t *)row)[off + i]);
        return;
    case ATTN_BF16:
        for (int i = 0; i < n; i++)
            dst[i] = attn_bf16_to_f32(((const uint16_t *)row)[off + i]);
        return;
    case ATTN_Q8_0:
    case ATTN_Q4_0:
        for (int i = 0; i < n; i++)
            dst[i] = attn_load(row, off + i, type);
        return;
    }
}

/* Dot product with 8 interleaved partial sums (a compiler may map them to vector lanes). */
static float dot_f32(const float *a, const float *b, int n)
{
    float part[8] = {0};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int j = 0; j < 8; j++)
            part[j] += a[d + j] * b[d + j];
    for (; d < n; d++)
        part[0] += a[d] * b[d];
    return ((part[0] + part[4]) + (part[1] + part[5])) +
           ((part[2] + part[6]) + (part[3] + part[7]));
}

static void qk_scalar(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                      enum attn_type type, int D, const struct attn_prefetch *pf)
{
    (void)pf; /* the portable path leaves prefetching to the hardware */
    float k[1024];
    for (int t = 0; t < nt; t++) {
        row_to_f32(k, kp[t], 0, D, type);
        for (int r = 0; r < nrows; r++)
            S[(size_t)r * ATTN_TILE + t] = dot_f32(q[r], k, D);
    }
}

/* The score plus bias, or -inf when the key is hidden from the query. */
static float biased(float s, int t, int nt, const int32_t *kpos, int32_t pos_q,
                    const struct attn_bias *b)
{
    if (!kpos) /* every key visible, no bias (see attn_ops.softmax) */
        return s;
    if (t >= nt || kpos[t] > pos_q || kpos[t] <= attn_window_floor(pos_q, b->window))
        return -INFINITY;
    if (b->kind == POS_ALIBI)
        return s + b->slope * (float)(kpos[t] - pos_q);
    if (b->kind == POS_T5) {
        int32_t d = pos_q - kpos[t];
        return s + b->t5[d < b->t5_n ? d : b->t5_n];
    }
    return s;
}

static void softmax_scalar(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                           const struct attn_bias *b, float *m, float *l, float *acc, int D)
{
    float mx = -INFINITY;
    for (int t = 0; t < ATTN_TILE; t++) {
        s[t] = biased(s[t], t, nt, kpos, pos_q, b);
        mx = fmaxf(mx, s[t]);
    }
    float m_new = fmaxf(*m, mx);
    if (m_new == -INFINITY) {
        memset(s, 0, sizeof(float) * ATTN_TILE);
        return;
    }
    if (m_new > *m) {
        float alpha = expf(*m - m_new);
        *l *= alpha;
        for (int d = 0; d < D; d++)
            acc[d] *= alpha;
        *m = m_new;
    }
    float sum = 0.0f;
    for (int t = 0; t < ATTN_TILE; t++) {
        s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - m_new);
        sum += s[t];
    }
    *l += sum;
}

static void probs_scalar(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                         const struct attn_bias *b, float m, float inv_l)
{
    for (int t = 0; t < ATTN_TILE; t++) {
        float x = biased(s[t], t, nt, kpos, pos_q, b);
        s[t] = x == -INFINITY ? 0.0f : expf(x - m) * inv_l;
    }
}

static void pv_scalar(float *acc, int nrows, const float *P, const void *const *vp, int nt,
                      enum attn_type type, int D, const struct attn_prefetch *pf)
{
    (void)pf; /* as in qk_scalar */
    float v[1024];
    for (int t = 0; t < nt; t++) {
        row_to_f32(v, vp[t], 0, D, type);
        for (int r = 0; r < nrows; r++) {
            float p = P[(size_t)r * ATTN_TILE + t];
            float *a = acc + (size_t)r * D;
            for (int d = 0; d < D; d++)
                a[d] += p * v[d];
        }
    }
}

static void stage_k_scalar(float *out, const void *const *kp, int nt, enum attn_type type, int D,
                           int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                           int ld_cs)
{
    int half = rot / 2;
    float k[1024];
    for (int t = 0; t < nt; t++) {
        float *o = out + (size_t)t * D;
        const float *c = cs + (size_t)t * ld_cs, *s = sn + (size_t)t * ld_cs;
        row_to_f32(k, kp[t], 0, D, type);
        for (int i = 0; i < half; i++) {
            int p = attn_pair_at(pairs, i);
            float lo = pairs == ATTN_PAIRS_NEOX ? k[i] : k[2 * p];
            float hi = pairs == ATTN_PAIRS_NEOX ? k[half + i] : k[2 * p + 1];
            o[i] = lo * c[i] - hi * s[i];
            o[half + i] = lo * s[i] + hi * c[i];
        }
        memcpy(o + rot, k + rot, sizeof(float) * (size_t)(D - rot));
    }
}

static void qk_rope_scalar(float *S, const float *const *q, int nrows, const void *const *kp,
                           int nt, enum attn_type type, int D, int rot, enum attn_pairs pairs,
                           const float *cs, const float *sn, int ld_cs,
                           const struct attn_prefetch *pf)
{
    (void)pf;
    float k[1024];
    for (int t = 0; t < nt; t++) {
        const void *one[1] = {kp[t]};
        stage_k_scalar(k, one, 1, type, D, rot, pairs, cs + (size_t)t * ld_cs,
                       sn + (size_t)t * ld_cs, ld_cs);
        for (int r = 0; r < nrows; r++)
            S[(size_t)r * ATTN_TILE + t] = dot_f32(q[r], k, D);
    }
}

static void dequant_scalar(float *out, const void *const *rows, int nt, enum attn_type type, int D)
{
    for (int t = 0; t < nt; t++)
        row_to_f32(out + (size_t)t * D, rows[t], 0, D, type);
}

static void stage_kt_scalar(float *kt, const void *const *kp, int nt, enum attn_type type, int D,
                            int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                            int ld_cs)
{
    float k[1024];
    for (int t = 0; t < ATTN_TILE; t++) {
        if (t < nt)
            stage_k_scalar(k, kp + t, 1, attn_type_blocked(type) ? ATTN_F32 : type, D, rot, pairs,
                           cs + (size_t)t * ld_cs, sn + (size_t)t * ld_cs, ld_cs);
        for (int d = 0; d < D; d++)
            kt[(size_t)d * ATTN_TILE + t] = t < nt ? k[d] : 0.0f;
    }
}

static void qk_t_scalar(float *S, const float *const *q, int nrows, const float *kt, int D)
{
    for (int r = 0; r < nrows; r++)
        for (int t = 0; t < ATTN_TILE; t++) {
            float sum = 0.0f;
            for (int d = 0; d < D; d++)
                sum += q[r][d] * kt[(size_t)d * ATTN_TILE + t];
            S[(size_t)r * ATTN_TILE + t] = sum;
        }
}

const struct attn_ops attn_scalar_ops = {
    .name = "scalar",
    .shuf8_pairs = false,
    .pf_scores = ATTN_PF_NONE,
    .qk = qk_scalar,
    .qk_rope = qk_rope_scalar,
    .softmax = softmax_scalar,
    .probs = probs_scalar,
    .pv = pv_scalar,
    .stage_k = stage_k_scalar,
    .dequant = dequant_scalar,
    .stage_kt = stage_kt_scalar,
    .qk_t = qk_t_scalar,
};
