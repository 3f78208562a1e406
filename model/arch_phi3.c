/*
 * arch_phi3.c - loading Phi-3, Phi-3.5 and Phi-4 files ("phi3" in
 * llama.cpp's names).
 *
 * A Phi-3 layer is a Llama layer (RMSNorm, SwiGLU, RoPE in NeoX halves)
 * stored fused:
 *
 *   blk.N.attn_qkv.weight  [n_embd, q + 2 kv]: rows of Q, then K, then V
 *                          (or, as llama.cpp also accepts, attn_q/k/v apart)
 *   blk.N.ffn_up.weight    [n_embd, 2 n_ff]: rows of the gate, then of up -
 *                          silu(first half) * second half, as Hugging Face's
 *                          Phi3MLP chunks it
 *
 * Both are cut into row views (model_split_rows), so the forward runs them
 * as separate products without copying a byte.
 *
 * LongRoPE ("su"/"longrope" scaling, the 128k models). The converter
 * writes two tables of per-pair frequency divisors, rope_factors_long.weight
 * and rope_factors_short.weight ([rope_dims / 2] each), the original
 * context (rope.scaling.original_context_length) and an amplitude
 * rope.scaling.attn_factor = sqrt(1 + ln(s) / ln(orig)), s = context /
 * orig - and no rope.scaling.type. Hugging Face picks the long table when
 * the sequence outgrows the original context, which would re-rotate every
 * cached key the moment it does; llama.cpp picks once, by the context it
 * serves. kvd does the same: the long table when the caller's context
 * (model_params.n_ctx; 0 = the file's context_length) exceeds the original
 * one, the short table otherwise. The table becomes the scheme's
 * rope_freq_factors; the amplitude multiplies rotated q and k alike, so
 * their product gains attn_factor^2 on the rotated dims only - kvd scales
 * those dims of q by it (model.rope_q_mul) and leaves the keys as stored,
 * which is exact for partial rotations too (Phi-4-mini rotates 3/4 of each
 * head).
 *
 * Refused with the name: one table without the other, a table of the
 * wrong length or with a factor that is not positive, tables without the
 * original context, a non-positive attn_factor, tables beside
 * rope_freqs.weight. The sliding window key is Mistral's
 * (attention.sliding_window, every layer): llama.cpp turns it off for
 * Phi-3 with a warning; kvd masks it, as the Hugging Face model does.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* rope_factors_<which>.weight into dst ([half]); *found says whether it exists. */
static int factor_table(model *m, const char *which, float *dst, bool *found, char *err,
                        size_t errlen)
{
    char name[64];
    snprintf(name, sizeof(name), "rope_factors_%s.weight", which);
    int half = m->pos.rope_dims / 2;
    const float *got;
    int rc = model_load_vector(m->file, name, half, false, dst, &got, err, errlen);
    if (rc)
        return rc;
    *found = got != NULL;
    for (int i = 0; *found && i < half; i++) {
        if (!(dst[i] > 0.0f)) {
            snprintf(err, errlen, "tensor %s: factor %d (%g) must be positive", name, i, dst[i]);
            return -EINVAL;
        }
    }
    return 0;
}

int model_phi3_rope(model *m, const struct model_params *params, char *err, size_t errlen)
{
    int half = m->pos.rope_dims / 2;
    float *tab = malloc(sizeof(float) * 2 * (size_t)half);
    if (!tab) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    bool has_long, has_short;
    int rc = factor_table(m, "long", tab, &has_long, err, errlen);
    rc = rc ? rc : factor_table(m, "short", tab + half, &has_short, err, errlen);
    if (!rc && has_long != has_short) {
        snprintf(err, errlen, "tensor rope_factors_%s.weight is missing (rope_factors_%s.weight "
                 "is present)", has_long ? "short" : "long", has_long ? "long" : "short");
        rc = -EINVAL;
    }
    if (!rc && has_long && m->pos.rope_freq_factors) {
        snprintf(err, errlen, "rope_factors_long/short.weight beside rope_freqs.weight or YaRN: which "
                 "frequencies apply is not defined");
        rc = -EINVAL;
    }
    int orig = 0;
    float attn_factor = 1.0f;
    if (!rc && has_long)
        rc = model_meta_int(m->file, m->arch_name, "rope.scaling.original_context_length", true,
                            0, 1, INT32_MAX, &orig, err, errlen);
    if (!rc && has_long)
        rc = model_meta_float(m->file, m->arch_name, "rope.scaling.attn_factor", 1.0f,
                              &attn_factor, NULL, err, errlen);
    if (!rc && !(attn_factor > 0.0f)) {
        snprintf(err, errlen, "metadata key %s.rope.scaling.attn_factor = %g must be positive",
                 m->arch_name, attn_factor);
        rc = -EINVAL;
    }
    if (!rc && has_long) {
        m->rope_tables = tab;
        m->rope_orig_ctx = orig;
        model_phi3_pick(m, params->n_ctx);
        m->pos.rope_freq_factors = m->rope_factors;
        m->rope_q_mul = attn_factor * attn_factor;
        return 0;
    }
    free(tab);
    return rc;
}

bool model_rope_long(const struct model_info *info, int n_ctx)
{
    return info->rope_orig_ctx > 0 && (n_ctx > 0 ? n_ctx : info->n_ctx_train) > info->rope_orig_ctx;
}

void model_phi3_pick(model *m, int n_ctx)
{
    if (!m->rope_tables)
        return;
    int half = m->pos.rope_dims / 2;
    struct model_info info = {.n_ctx_train = m->n_ctx_train, .rope_orig_ctx = m->rope_orig_ctx};
    m->rope_long = model_rope_long(&info, n_ctx);
    memcpy(m->rope_factors, m->rope_tables + (m->rope_long ? 0 : half),
           sizeof(float) * (size_t)half);
}

int model_phi3_layers(model *m, float *v, char *err, size_t errlen)
{
    int d = m->n_embd, ff = m->n_ff, rc = 0;
    for (int l = 0; l < m->n_layer && !rc; l++) {
        struct model_layer *L = &m->layers[l];
        L->sliding_window = m->sliding_window;
        char name[96];
        struct mm_weight w;
        bool fused;
        rc = model_layer_vector(m, l, "attn_norm.weight", d, true, &v, &L->attn_norm, err, errlen);
        rc = rc ? rc
                : model_layer_vector(m, l, "ffn_norm.weight", d, true, &v, &L->ffn_norm, err,
                                     errlen);
        snprintf(name, sizeof(name), "blk.%d.attn_qkv.weight", l);
        rc = rc ? rc
                : model_load_matrix(m->file, name, d, m->q_dim + 2 * m->kv_dim, false, &w, &fused,
                                    err, errlen);
        if (!rc && fused)
            rc = model_split_rows(&w, name, (struct mm_weight *const[]){&L->wq, &L->wk, &L->wv},
                                  (const int[]){m->q_dim, m->kv_dim, m->kv_dim}, 3, err, errlen);
        if (!rc && !fused) {
            rc = model_layer_matrix(m, l, "attn_q.weight", d, m->q_dim, true, &L->wq, err, errlen);
            rc = rc ? rc
                    : model_layer_matrix(m, l, "attn_k.weight", d, m->kv_dim, true, &L->wk, err,
                                         errlen);
            rc = rc ? rc
                    : model_layer_matrix(m, l, "attn_v.weight", d, m->kv_dim, true, &L->wv, err,
                                         errlen);
        }
        rc = rc ? rc
                : model_layer_matrix(m, l, "attn_output.weight", m->q_dim, d, true, &L->wo, err,
                                     errlen);
        snprintf(name, sizeof(name), "blk.%d.ffn_up.weight", l);
        rc = rc ? rc : model_load_matrix(m->file, name, d, 2 * ff, true, &w, NULL, err, errlen);
        rc = rc ? rc
                : model_split_rows(&w, name, (struct mm_weight *const[]){&L->gate, &L->up},
                                   (const int[]){ff, ff}, 2, err, errlen);
        rc = rc ? rc
                : model_layer_matrix(m, l, "ffn_down.weight", ff, d, true, &L->down, err, errlen);
    }
    return rc;
}
