/*
 * attn_ref.c - the reference attention kernel: the obvious computation.
 *
 * For each query and head: rotate the query and every visible key with
 * posenc's exact angles, materialise all scores and biases (T5 through
 * pos_t5_bucket itself, no lookup table), softmax in double precision,
 * sum the values. Keys and values are converted or dequantised (and keys
 * rotated) once per sequence into f32 copies, O(n_kv x n_kv_head x
 * head_dim) memory; no tiling, no SIMD, no threads: the fused kernel is
 * checked against this in tests and timed against it in benchmarks.
 */
#include "attention_internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

/* The K (value = false) or V row of cached token i, KV head g. */
static const void *kv_row(const struct attn_kv *kv, const struct attn_seq *sq, int D, int g, int i,
                          bool value)
{
    size_t row = attn_row_bytes(value ? kv->v_type : kv->k_type, D);
    size_t page = (size_t)sq->page_table[i / kv->page_tokens];
    size_t off = page * kv->page_bytes + (value ? kv->v_offset : kv->k_offset) +
                 ((size_t)g * kv->page_tokens + (size_t)(i % kv->page_tokens)) * row;
    return kv->base + off;
}

static int check(const struct attn_params *p, const struct attn_kv *kv, const struct attn_seq *seqs,
                 int n_seqs)
{
    if (!p || !kv || n_seqs < 0 || (n_seqs && !seqs))
        return -EINVAL;
    if (p->n_head < 1 || p->n_kv_head < 1 || p->n_head % p->n_kv_head || p->head_dim < 1 ||
        kv->page_tokens < 1 || kv->sliding_window < 0 ||
        attn_type_check(kv->k_type, p->head_dim, NULL, 0) ||
        attn_type_check(kv->v_type, p->head_dim, NULL, 0))
        return -EINVAL;
    const struct pos_scheme *ps = &p->pos;
    if (ps->kind == POS_ROPE &&
        (ps->rope_dims < 2 || ps->rope_dims % 2 || ps->rope_dims > p->head_dim))
        return -EINVAL;
    if (ps->kind == POS_ALIBI && !ps->alibi_slopes)
        return -EINVAL;
    if (ps->kind == POS_T5 &&
        (!ps->t5_table ||
         pos_t5_check(ps->t5_num_buckets, ps->t5_max_distance, ps->t5_bidirectional, NULL, 0)))
        return -EINVAL;
    size_t heads = (size_t)p->n_kv_head * kv->page_tokens;
    size_t kblock = heads * attn_row_bytes(kv->k_type, p->head_dim);
    size_t vblock = heads * attn_row_bytes(kv->v_type, p->head_dim);
    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        if (sq->n_kv > 0 &&
            (kv->k_offset + kblock > kv->page_bytes || kv->v_offset + vblock > kv->page_bytes))
            return -EINVAL;
        if (sq->n_kv < 0 || sq->n_q < 0 || (sq->n_q && (!sq->q || !sq->out || !sq->q_pos)) ||
            (sq->n_kv && (!sq->pos || !sq->page_table || !kv->base)))
            return -EINVAL;
        for (int i = 0; i < (sq->n_kv + kv->page_tokens - 1) / kv->page_tokens; i++)
            if (sq->page_table[i] < 0 || (kv->n_pages > 0 && sq->page_table[i] >= kv->n_pages))
                return -EINVAL;
    }
    return 0;
}

int attn_reference(const struct attn_params *p, const struct attn_kv *kv,
                   const struct attn_seq *seqs, int n_seqs)
{
    int rc = check(p, kv, seqs, n_seqs);
    if (rc)
        return rc;
    const int H = p->n_head, G = p->n_kv_head, D = p->head_dim, group = H / G;
    const struct pos_scheme *ps = &p->pos;
    const bool rope = ps->kind == POS_ROPE;
    const int rot = rope ? ps->rope_dims : 0;

    int max_kv = 0;
    for (int s = 0; s < n_seqs; s++)
        max_kv = seqs[s].n_kv > max_kv ? seqs[s].n_kv : max_kv;
    size_t kv_elts = ((size_t)max_kv + 1) * G * D;
    double *score = malloc(sizeof(double) * ((size_t)max_kv + 1));
    float *kr = malloc(sizeof(float) * kv_elts); /* [n_kv][G][D] rotated keys */
    float *vr = malloc(sizeof(float) * kv_elts); /* [n_kv][G][D] values */
    float *cs = malloc(sizeof(float) * ((size_t)rot + 1));
    double *inv_freq = malloc(sizeof(double) * ((size_t)rot + 1));
    float *qr = malloc(sizeof(float) * (size_t)D);
    double *acc = malloc(sizeof(double) * (size_t)D);
    if (!score || !kr || !vr || !cs || !inv_freq || !qr || !acc) {
        rc = -ENOMEM;
        goto out_free;
    }
    if (rope)
        pos_rope_freqs(inv_freq, ps);

    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        if (sq->mass)
            for (int i = 0; i < sq->n_kv; i++)
                sq->mass[i] = 0.0f;
        /* every key converted and rotated by its position number, every value converted */
        for (int i = 0; i < sq->n_kv; i++) {
            if (rope)
                pos_rope_cos_sin(cs, inv_freq, rot, (double)ps->rope_freq_scale, sq->pos[i]);
            for (int g = 0; g < G; g++) {
                float *k = kr + ((size_t)i * G + g) * D, *v = vr + ((size_t)i * G + g) * D;
                const void *ks = kv_row(kv, sq, D, g, i, false),
                           *vs = kv_row(kv, sq, D, g, i, true);
                for (int d = 0; d < D; d++) {
                    k[d] = attn_load(ks, d, kv->k_type);
                    v[d] = attn_load(vs, d, kv->v_type);
                }
                if (rope)
                    pos_rope_apply(k, cs, rot, ps->rope_pairing);
            }
        }
        for (int qi = 0; qi < sq->n_q; qi++) {
            const int32_t pos_q = sq->q_pos[qi];
            if (rope)
                pos_rope_cos_sin(cs, inv_freq, rot, (double)ps->rope_freq_scale, pos_q);
            for (int h = 0; h < H; h++) {
                const int g = h / group;
                memcpy(qr, sq->q + ((size_t)qi * H + h) * D, sizeof(float) * (size_t)D);
                if (rope)
                    pos_rope_apply(qr, cs, rot, ps->rope_pairing);

                /* scores and biases, materialised; -inf where the key is in the future */
                double mx = -INFINITY;
                for (int i = 0; i < sq->n_kv; i++) {
                    const int32_t pos_k = sq->pos[i];
                    if (pos_k > pos_q ||
                        (kv->sliding_window > 0 && (int64_t)pos_q - pos_k >= kv->sliding_window)) {
                        score[i] = -INFINITY;
                        continue;
                    }
                    const float *k = kr + ((size_t)i * G + g) * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qr[d] * k[d];
                    double bias = 0;
                    int64_t offset = (int64_t)pos_k - pos_q;
                    if (ps->kind == POS_ALIBI)
                        bias = (double)ps->alibi_slopes[h] * (double)offset;
                    else if (ps->kind == POS_T5)
                        bias = ps->t5_table[(size_t)h * ps->t5_num_buckets +
                                            pos_t5_bucket(offset, ps->t5_bidirectional,
                                                          ps->t5_num_buckets, ps->t5_max_distance)];
                    double sc = dot * p->scale;
                    if (p->softcap > 0.0f) /* Gemma 2: the score capped before the bias */
                        sc = p->softcap * tanh(sc / p->softcap);
                    score[i] = sc + bias;
                    mx = score[i] > mx ? score[i] : mx;
                }

                /* softmax and the weighted sum of values */
                double sum = 0;
                for (int d = 0; d < D; d++)
                    acc[d] = 0;
                if (mx != -INFINITY) {
                    for (int i = 0; i < sq->n_kv; i++) {
                        score[i] = score[i] == -INFINITY ? 0.0 : exp(score[i] - mx);
                        sum += score[i];
                    }
                    for (int i = 0; i < sq->n_kv; i++) {
                        if (score[i] == 0.0)
                            continue;
                        const float *v = vr + ((size_t)i * G + g) * D;
                        for (int d = 0; d < D; d++)
                            acc[d] += score[i] * v[d];
                        if (sq->mass)
                            sq->mass[i] += (float)(score[i] / sum);
                    }
                }
                float *o = sq->out + ((size_t)qi * H + h) * D;
                for (int d = 0; d < D; d++)
                    o[d] = sum > 0 ? (float)(acc[d] / sum) : 0.0f;
            }
        }
    }
    rc = 0;
out_free:
    free(score);
    free(kr);
    free(vr);
    free(cs);
    free(inv_freq);
    free(qr);
    free(acc);
    return rc;
}
