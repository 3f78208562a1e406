/*
 * arch_bloom.c - loading BLOOM and MPT: the LayerNorm, fused-QKV, GELU
 * family with ALiBi attention.
 *
 * Both follow llama.cpp's GGUF conventions (its converter's tensor names
 * and metadata keys), so a file llama.cpp's converter wrote loads here and a
 * file `kvd mkmodel --arch bloom|mpt` wrote loads there:
 *
 *   token_embd.weight                       [n_embd, n_vocab]
 *   token_embd_norm.{weight,bias}           BLOOM: LayerNorm of the embedding
 *   blk.N.attn_norm.{weight,bias}           LayerNorm before attention
 *   blk.N.attn_qkv.{weight,bias}            fused [n_embd, q + 2 kv]: rows of Q,
 *                                           then K, then V (the converter
 *                                           de-interleaves BLOOM's per-head
 *                                           q/k/v rows into these blocks)
 *   blk.N.attn_output.{weight,bias}
 *   blk.N.ffn_norm.{weight,bias}
 *   blk.N.ffn_up.{weight,bias}, blk.N.ffn_down.{weight,bias}
 *   output_norm.{weight,bias}, output.weight (absent: tied to the embedding)
 *
 * BLOOM has every bias; MPT (no_bias) usually has none, and llama.cpp
 * treats each as optional there. Keys: <arch>.attention.layer_norm_epsilon
 * (required, as llama.cpp requires it), mpt.attention.clamp_kqv (optional:
 * q, k and v clamped to +-clamp), <arch>.attention.max_alibi_bias.
 *
 * ALiBi slopes. llama.cpp fixes BLOOM's max_bias at 8 (the ALiBi paper's
 * slopes, which pos_alibi_slopes reproduces for every head count, including
 * BLOOM's interleave for counts that are not powers of two); kvd takes a
 * bloom.attention.max_alibi_bias when a file has one. MPT's comes from the
 * file (its config's alibi_bias_max); MPT's own slope rule (next power of
 * two, odd/even interleave) gives the same slopes as that formula for any
 * max_bias. A file without it, and no model_params.alibi_max_bias, is
 * rejected: guessing would silently change the model.
 *
 * GELU: BLOOM was trained with the tanh approximation (bloom_gelu_forward),
 * MPT with the exact erf form (torch's nn.GELU default); each runs its own.
 * llama.cpp runs the tanh form for both, a difference of at most ~1e-3 per
 * activation for MPT.
 *
 * Not supported (rejected with the tensor named): MPT's learned absolute
 * positions (position_embd.weight), its q/k LayerNorm (attn_q_norm,
 * attn_k_norm) and AWQ activation scales (ffn_act).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "model/model_internal.h"

int model_bloom_hparams(model *m, const struct model_params *params, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    const char *a = m->arch_name;
    bool is_mpt = m->arch == MODEL_ARCH_MPT;
    float eps;
    bool found;
    int rc =
        model_meta_float(f, a, "attention.layer_norm_epsilon", 0.0f, &eps, &found, err, errlen);
    if (rc)
        return rc;
    if (!found) {
        snprintf(err, errlen, "missing metadata key %s.attention.layer_norm_epsilon", a);
        return -EINVAL;
    }
    if (!(eps > 0.0f)) {
        snprintf(err, errlen, "metadata key %s.attention.layer_norm_epsilon = %g must be positive",
                 a, eps);
        return -EINVAL;
    }
    m->norm = MODEL_NORM_LAYER;
    m->norm_eps = eps;
    m->act = is_mpt ? MODEL_ACT_GELU_ERF : MODEL_ACT_GELU_TANH;

    /* A kvd.position.kind, if any, must agree: these architectures are ALiBi. */
    enum pos_kind kind;
    if (gguf_find_key(f, "kvd.position.kind") >= 0) {
        rc = model_pos_kind(f, &kind, err, errlen);
        if (rc)
            return rc;
        if (kind != POS_ALIBI) {
            snprintf(err, errlen, "kvd.position.kind = %s, but %s attention is alibi",
                     pos_kind_name(kind), a);
            return -EINVAL;
        }
    }

    if (is_mpt) {
        rc = model_meta_float(f, a, "attention.clamp_kqv", 0.0f, &m->clamp_kqv, NULL, err, errlen);
        if (rc)
            return rc;
        if (m->clamp_kqv < 0.0f) {
            snprintf(err, errlen, "metadata key %s.attention.clamp_kqv = %g must be >= 0 (0 = off)",
                     a, m->clamp_kqv);
            return -EINVAL;
        }
    }

    rc = model_meta_float(f, a, "attention.max_alibi_bias", 0.0f, &m->alibi_max_bias, &found, err,
                          errlen);
    if (rc)
        return rc;
    if (found && !(m->alibi_max_bias > 0.0f)) {
        snprintf(err, errlen, "metadata key %s.attention.max_alibi_bias = %g must be positive", a,
                 m->alibi_max_bias);
        return -EINVAL;
    }
    if (!found) {
        if (params->alibi_max_bias > 0.0f) {
            m->alibi_max_bias = params->alibi_max_bias;
        } else if (!is_mpt) {
            m->alibi_max_bias = 8.0f; /* BLOOM's slopes: the ALiBi paper's */
        } else {
            snprintf(err, errlen,
                     "missing metadata key %s.attention.max_alibi_bias (the ALiBi "
                     "slopes depend on it; no alibi_max_bias was given either)",
                     a);
            return -EINVAL;
        }
    }
    m->pos = (struct pos_scheme){.kind = POS_ALIBI};
    return 0;
}

/* Reject a tensor kvd's BLOOM/MPT forward would silently ignore. */
static int reject_present(const gguf_file *f, const char *name, const char *what, char *err,
                          size_t errlen)
{
    if (!gguf_find_tensor(f, name))
        return 0;
    snprintf(err, errlen, "tensor %s (%s) is not supported", name, what);
    return -EINVAL;
}

/*
 * The fused QKV matrix as three row views (Q rows, then K, then V), and its
 * bias as three slices.
 */
static int load_qkv(const model *m, int l, bool need_bias, float *v, struct model_layer *L,
                    char *err, size_t errlen)
{
    char name[96];
    int n_qkv = m->q_dim + 2 * m->kv_dim;
    struct mm_weight w;
    snprintf(name, sizeof(name), "blk.%d.attn_qkv.weight", l);
    int rc = model_load_matrix(m->file, name, m->n_embd, n_qkv, true, &w, NULL, err, errlen);
    if (rc)
        return rc;
    rc = model_split_rows(&w, name, (struct mm_weight *const[]){&L->wq, &L->wk, &L->wv},
                          (const int[]){m->q_dim, m->kv_dim, m->kv_dim}, 3, err, errlen);
    if (rc)
        return rc;
    const float *b;
    snprintf(name, sizeof(name), "blk.%d.attn_qkv.bias", l);
    rc = model_load_vector(m->file, name, n_qkv, need_bias, v, &b, err, errlen);
    if (rc)
        return rc;
    L->bq = b;
    L->bk = b ? b + m->q_dim : NULL;
    L->bv = b ? b + m->q_dim + m->kv_dim : NULL;
    return 0;
}

int model_bloom_tensors(model *m, float *v, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    int d = m->n_embd, ff = m->n_ff, rc = 0;
    bool bloom = m->arch == MODEL_ARCH_BLOOM; /* every bias and the embedding norm required */

    if (bloom) {
        rc = model_load_vector(f, "token_embd_norm.weight", d, true, v, &m->tok_norm, err, errlen);
        v += d;
        rc = rc ? rc
                : model_load_vector(f, "token_embd_norm.bias", d, true, v, &m->tok_norm_b, err,
                                    errlen);
        v += d;
    } else {
        rc = reject_present(f, "position_embd.weight", "learned absolute positions", err, errlen);
    }
    rc = rc ? rc
            : model_load_vector(f, "output_norm.bias", d, bloom, v, &m->output_norm_b, err, errlen);
    v += d;

    int q = m->q_dim, kv = m->kv_dim;
    for (int l = 0; l < m->n_layer && !rc; l++) {
        struct model_layer *L = &m->layers[l];
#define VEC(sfx, n, req, dst)                                                                      \
    (rc = rc ? rc : model_layer_vector(m, l, sfx, n, req, &v, dst, err, errlen))
#define MAT(sfx, n_in, n_out, dst)                                                                 \
    (rc = rc ? rc : model_layer_matrix(m, l, sfx, n_in, n_out, true, dst, err, errlen))
        VEC("attn_norm.weight", d, true, &L->attn_norm);
        VEC("attn_norm.bias", d, bloom, &L->attn_norm_b);
        rc = rc ? rc : load_qkv(m, l, bloom, v, L, err, errlen);
        v += q + 2 * kv;
        MAT("attn_output.weight", q, d, &L->wo);
        VEC("attn_output.bias", d, bloom, &L->bo);
        VEC("ffn_norm.weight", d, true, &L->ffn_norm);
        VEC("ffn_norm.bias", d, bloom, &L->ffn_norm_b);
        MAT("ffn_up.weight", d, ff, &L->up);
        VEC("ffn_up.bias", ff, bloom, &L->b_up);
        MAT("ffn_down.weight", ff, d, &L->down);
        VEC("ffn_down.bias", d, bloom, &L->b_down);
#undef VEC
#undef MAT
        static const struct {
            const char *suffix, *what;
        } unsupported[] = {
            {"attn_q_norm.weight", "q/k LayerNorm"},
            {"attn_k_norm.weight", "q/k LayerNorm"},
            {"ffn_act.scales", "AWQ activation scales"},
            {"ffn_gate.weight", "a gated MLP"},
        };
        for (size_t i = 0; i < sizeof(unsupported) / sizeof(unsupported[0]) && !rc; i++) {
            char name[96];
            snprintf(name, sizeof(name), "blk.%d.%s", l, unsupported[i].suffix);
            rc = reject_present(f, name, unsupported[i].what, err, errlen);
        }
    }
    return rc;
}
