/*
 * arch_gemma.c - loading Gemma 2 and Gemma 3 files (llama.cpp's names).
 *
 * A Gemma layer is a Llama layer with four differences, each a field of
 * the shared layer description that forward.c applies when set:
 *
 *   - the embedding is multiplied by sqrt(n_embd) (model.emb_scale);
 *   - the MLP is GELU(tanh)-gated: down(gelu(gate x) * up x) (MODEL_ACT_GEGLU);
 *   - the attention output and the MLP output are RMS-normalised again
 *     before their residual adds (blk.N.post_attention_norm.weight,
 *     blk.N.post_ffw_norm.weight), beside the usual pre-norms;
 *   - queries are scaled by 1/sqrt(query_pre_attn_scalar): head_dim, but
 *     n_embd / n_head for the 27B models, which llama.cpp recognises by
 *     their layer count (46 for Gemma 2, 62 for Gemma 3) - so does kvd.
 *
 * Gemma's RMSNorm multiplies by (1 + w). llama.cpp's converter adds the 1
 * when it writes the file, so a GGUF norm weight is used as it stands: the
 * same RMSNorm as every other model here.
 *
 * Local and global layers. Layer l is local (sliding window W =
 * <arch>.attention.sliding_window) when l % P < P - 1, global otherwise:
 * P = 2 for Gemma 2 (even layers local), 6 for Gemma 3 (five local, then one
 * global), as llama.cpp fixes them. The window is masked inside the fused
 * kernel per layer (attn_kv.sliding_window). Gemma 3's local layers also
 * rotate with their own RoPE: base <arch>.rope.freq_base_swa (10000 when
 * absent, as llama.cpp), no scaling; its global layers take the file's
 * base and linear scaling. forward.c runs the two with two attention
 * contexts.
 *
 * Gemma 2 caps scores: attention scores to 50 tanh(s / 50) inside the
 * kernel's tile loop (attn_params.softcap), logits to 30 tanh(z / 30)
 * (<arch>.attn_logit_softcapping, <arch>.final_logit_softcapping; those
 * defaults when absent, as llama.cpp). Gemma 3 has neither.
 *
 * Refused with the key named: a window or cap that is not positive, a
 * rope_freqs tensor or YaRN (llama.cpp applies neither to Gemma).
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_internal.h"

/* A positive float key (absent: def; def 0 makes it required). */
static int positive_key(const model *m, const char *suffix, float def, float *out, char *err,
                        size_t errlen)
{
    bool found;
    int rc = model_meta_float(m->file, m->arch_name, suffix, def, out, &found, err, errlen);
    if (rc)
        return rc;
    if (!found && def == 0.0f) {
        snprintf(err, errlen, "missing metadata key %s.%s", m->arch_name, suffix);
        return -EINVAL;
    }
    if (!(*out > 0.0f)) {
        snprintf(err, errlen, "metadata key %s.%s = %g must be positive", m->arch_name, suffix,
                 *out);
        return -EINVAL;
    }
    return 0;
}

/* Global RoPE (the file's), and Gemma 3's local one. */
static int gemma_rope(model *m, char *err, size_t errlen)
{
    int rc = model_read_rope(m, POS_ROPE_NEOX, err, errlen);
    if (rc)
        return rc;
    if (m->pos.rope_freq_factors || m->attn_logit_mul != 1.0f) {
        snprintf(err, errlen, "%s: rope_freqs.weight and YaRN scaling are not supported for Gemma",
                 m->arch_name);
        return -EINVAL;
    }
    m->pos_local = m->pos;
    if (m->arch != MODEL_ARCH_GEMMA3)
        return 0;
    m->pos_local.rope_freq_scale = 1.0f;
    return positive_key(m, "rope.freq_base_swa", 10000.0f, &m->pos_local.rope_theta, err, errlen);
}

int model_gemma_hparams(model *m, char *err, size_t errlen)
{
    const char *a = m->arch_name;
    bool g2 = m->arch == MODEL_ARCH_GEMMA2;
    float eps;
    int rc = positive_key(m, "attention.layer_norm_rms_epsilon", 1e-6f, &eps, err, errlen);
    if (rc)
        return rc;
    m->norm = MODEL_NORM_RMS;
    m->norm_eps = eps;
    m->act = MODEL_ACT_GEGLU;
    m->emb_scale = sqrtf((float)m->n_embd);
    if ((rc = gemma_rope(m, err, errlen)))
        return rc;

    /* Gemma 2 defaults to a 4096 window; Gemma 3 files must say theirs. */
    rc = model_meta_int(m->file, a, "attention.sliding_window", !g2, 4096, 1, INT32_MAX,
                        &m->sliding_window, err, errlen);
    if (rc)
        return rc;
    if (g2 && ((rc = positive_key(m, "attn_logit_softcapping", 50.0f, &m->attn_softcap, err,
                                  errlen)) ||
               (rc = positive_key(m, "final_logit_softcapping", 30.0f, &m->final_softcap, err,
                                  errlen))))
        return rc;
    bool big = m->n_layer == (g2 ? 46 : 62); /* the 27B models */
    m->attn_scale = 1.0f / sqrtf(big ? (float)(m->n_embd / m->n_head) : (float)m->head_dim);
    return 0;
}

int model_gemma_layers(model *m, float *v, char *err, size_t errlen)
{
    int d = m->n_embd, hd = m->head_dim, rc = 0;
    bool g3 = m->arch == MODEL_ARCH_GEMMA3;
    int period = g3 ? 6 : 2;
    for (int l = 0; l < m->n_layer && !rc; l++) {
        struct model_layer *L = &m->layers[l];
        bool local = l % period < period - 1;
        L->sliding_window = local ? m->sliding_window : 0;
        L->local_rope = local && g3;
#define VEC(sfx, n, dst) (rc = rc ? rc : model_layer_vector(m, l, sfx, n, true, &v, dst, err, errlen))
        VEC("attn_norm.weight", d, &L->attn_norm);
        VEC("post_attention_norm.weight", d, &L->attn_post_norm);
        VEC("ffn_norm.weight", d, &L->ffn_norm);
        VEC("post_ffw_norm.weight", d, &L->ffn_post_norm);
        if (g3) {
            VEC("attn_q_norm.weight", hd, &L->q_norm);
            VEC("attn_k_norm.weight", hd, &L->k_norm);
        }
        rc = rc ? rc : model_llama_matrices(m, l, L, err, errlen);
#undef VEC
    }
    return rc;
}
