/*
 * model.c - loading a model from GGUF, and its tokens.
 *
 * Loading is validation: the architecture is one kvd runs (llama, qwen2,
 * qwen3, bloom, mpt, gemma2, gemma3, phi3), every hyper-parameter comes from the
 * `<arch>.*` metadata keys llama.cpp writes (with llama.cpp's defaults where
 * a key is optional), and every tensor the forward reads is looked up by its
 * llama.cpp name and checked against the shape those parameters imply
 * before anything uses it. A file that fails any check is rejected with the
 * key or tensor named; after model_load succeeds the forward indexes
 * weights without further checks.
 *
 * This file holds what every architecture shares (metadata and tensor
 * helpers, the shape, the lifecycle) and the Llama family itself;
 * arch_bloom.c loads BLOOM and MPT, arch_gemma.c Gemma 2 and 3,
 * arch_phi3.c Phi-3/3.5/4, posbias.c the offset-only position biases (ALiBi
 * slopes, the T5 table).
 *
 * Weight matrices stay in the file mapping in their own formats; norm
 * weights and biases are converted to f32 once. The tokenizer is built from
 * the same file (tokenizer.ggml.*).
 *
 * Position schemes of the Llama family: RoPE by default, or an offset-only
 * bias when kvd.position.kind says "alibi" (slopes from
 * <arch>.attention.max_alibi_bias) or "t5" (a learned per-head bias by T5
 * bucket, causal, one table for the stack: see posbias.c). The attention
 * scale stays 1/sqrt(head_dim) whatever the scheme.
 *
 * RoPE pairing: llama.cpp's converter permutes Q and K of Llama checkpoints
 * so that rotation pairs are adjacent elements (ggml's "normal" rope), and
 * llama2.c-derived files use that layout natively; qwen2 keeps the Hugging
 * Face layout, pairs (i, i + n_rot/2) ("neox").
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* ------------------------------------------------------------------------
 * Metadata
 * ------------------------------------------------------------------------ */

static void meta_key(char *key, size_t cap, const char *arch, const char *suffix)
{
    if (arch)
        snprintf(key, cap, "%s.%s", arch, suffix);
    else
        snprintf(key, cap, "%s", suffix);
}

int model_meta_int(const gguf_file *f, const char *arch, const char *suffix, bool required,
                   long def, long lo, long hi, int *out, char *err, size_t errlen)
{
    char key[128];
    meta_key(key, sizeof(key), arch, suffix);
    int64_t v;
    int rc = gguf_get_i64(f, key, &v);
    if (rc == -ENOENT && !required) {
        *out = (int)def;
        return 0;
    }
    if (rc == -ENOENT) {
        snprintf(err, errlen, "missing metadata key %s", key);
        return -EINVAL;
    }
    if (rc) {
        snprintf(err, errlen, "metadata key %s is not an integer", key);
        return -EINVAL;
    }
    if (v < lo || v > hi) {
        snprintf(err, errlen, "metadata key %s = %lld is outside [%ld, %ld]", key, (long long)v, lo,
                 hi);
        return -EINVAL;
    }
    *out = (int)v;
    return 0;
}

int model_meta_float(const gguf_file *f, const char *arch, const char *suffix, float def,
                     float *out, bool *found, char *err, size_t errlen)
{
    char key[128];
    meta_key(key, sizeof(key), arch, suffix);
    float v;
    int rc = gguf_get_f32(f, key, &v);
    if (found)
        *found = rc != -ENOENT;
    if (rc == -ENOENT) {
        *out = def;
        return 0;
    }
    if (rc || !isfinite(v)) {
        snprintf(err, errlen, "metadata key %s is not a finite number", key);
        return -EINVAL;
    }
    *out = v;
    return 0;
}

int model_read_shape(model *m, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    const char *a = m->arch_name;
    const long big = 1L << 20;
    int rc = 0;
    rc = rc ? rc
            : model_meta_int(f, a, "embedding_length", true, 0, 1, big, &m->n_embd, err, errlen);
    rc = rc ? rc : model_meta_int(f, a, "block_count", true, 0, 1, 4096, &m->n_layer, err, errlen);
    rc = rc ? rc
            : model_meta_int(f, a, "attention.head_count", true, 0, 1, 4096, &m->n_head, err,
                             errlen);
    rc = rc ? rc
            : model_meta_int(f, a, "feed_forward_length", true, 0, 1, big, &m->n_ff, err, errlen);
    if (rc)
        return rc;
    rc = model_meta_int(f, a, "attention.head_count_kv", false, m->n_head, 1, m->n_head,
                        &m->n_kv_head, err, errlen);
    if (rc)
        return rc;
    if (m->n_head % m->n_kv_head) {
        snprintf(err, errlen, "%s.attention.head_count_kv = %d does not divide head_count = %d", a,
                 m->n_kv_head, m->n_head);
        return -EINVAL;
    }
    int def_hd = m->n_embd % m->n_head ? 0 : m->n_embd / m->n_head;
    rc = model_meta_int(f, a, "attention.key_length", false, def_hd, 1, 1024, &m->head_dim, err,
                        errlen);
    if (rc)
        return rc;
    if (m->head_dim == 0) {
        snprintf(err, errlen, "%s.embedding_length %d is not a multiple of head_count %d", a,
                 m->n_embd, m->n_head);
        return -EINVAL;
    }
    int v_len;
    rc = model_meta_int(f, a, "attention.value_length", false, m->head_dim, 1, 1024, &v_len, err,
                        errlen);
    if (rc)
        return rc;
    if (v_len != m->head_dim) {
        snprintf(err, errlen, "%s.attention.value_length %d differs from key_length %d", a, v_len,
                 m->head_dim);
        return -EINVAL;
    }
    m->q_dim = m->n_head * m->head_dim;
    m->kv_dim = m->n_kv_head * m->head_dim;
    return model_meta_int(f, a, "context_length", false, 0, 0, INT32_MAX, &m->n_ctx_train, err,
                          errlen);
}

/* The Llama family's norm and position scheme. The ALiBi slopes and the T5
 * table are built after the tensors (model_load). */
static int read_llama_hparams(model *m, const struct model_params *params, char *err, size_t errlen)
{
    const char *a = m->arch_name;
    float eps;
    int rc = model_meta_float(m->file, a, "attention.layer_norm_rms_epsilon", 1e-5f, &eps, NULL,
                              err, errlen);
    if (rc)
        return rc;
    if (!(eps > 0.0f)) {
        snprintf(err, errlen, "%s.attention.layer_norm_rms_epsilon (%g) must be positive", a, eps);
        return -EINVAL;
    }
    m->norm = MODEL_NORM_RMS;
    m->norm_eps = eps;
    m->act = MODEL_ACT_SWIGLU;
    /* Mistral's sliding window: every layer attends to the last W positions
     * (0 or absent: no window). */
    rc = model_meta_int(m->file, a, "attention.sliding_window", false, 0, 0, INT32_MAX,
                        &m->sliding_window, err, errlen);
    if (rc)
        return rc;

    enum pos_kind kind;
    rc = model_pos_kind(m->file, &kind, err, errlen);
    if (rc)
        return rc;
    if (kind == POS_ROPE)
        return model_read_rope(m, m->arch == MODEL_ARCH_LLAMA ? POS_ROPE_ADJACENT : POS_ROPE_NEOX,
                               err, errlen);
    m->pos = (struct pos_scheme){.kind = kind};
    if (kind == POS_ALIBI) {
        bool found;
        rc = model_meta_float(m->file, a, "attention.max_alibi_bias", 0.0f, &m->alibi_max_bias,
                              &found, err, errlen);
        if (rc)
            return rc;
        if (found && !(m->alibi_max_bias > 0.0f)) {
            snprintf(err, errlen, "metadata key %s.attention.max_alibi_bias = %g must be positive",
                     a, m->alibi_max_bias);
            return -EINVAL;
        }
        if (!found && params->alibi_max_bias > 0.0f)
            m->alibi_max_bias = params->alibi_max_bias;
        else if (!found) {
            snprintf(err, errlen,
                     "kvd.position.kind = alibi but metadata key "
                     "%s.attention.max_alibi_bias is missing (and no alibi_max_bias was given)",
                     a);
            return -EINVAL;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Tensors
 * ------------------------------------------------------------------------ */

/*
 * Find a tensor and check its shape is [ne0, ne1] (ne1 = 1 for vectors).
 * NULL when absent (err filled only if required) or on a wrong shape
 * (err filled, *bad set).
 */
static const struct gguf_tensor *find_checked(const gguf_file *f, const char *name, int ne0,
                                              int ne1, bool required, bool *bad, char *err,
                                              size_t errlen)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) {
        if (required) {
            snprintf(err, errlen, "missing tensor %s", name);
            *bad = true;
        }
        return NULL;
    }
    if (t->ne[0] != (uint64_t)ne0 || t->ne[1] != (uint64_t)ne1 || t->ne[2] != 1 || t->ne[3] != 1) {
        snprintf(err, errlen, "tensor %s has shape [%llu, %llu, %llu, %llu], expected [%d, %d]",
                 name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                 (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], ne0, ne1);
        *bad = true;
        return NULL;
    }
    return t;
}

int model_load_matrix(const gguf_file *f, const char *name, int n_in, int n_out, bool required,
                      struct mm_weight *w, bool *found, char *err, size_t errlen)
{
    bool bad = false;
    const struct gguf_tensor *t = find_checked(f, name, n_in, n_out, required, &bad, err, errlen);
    if (found)
        *found = t != NULL;
    if (bad)
        return -EINVAL;
    if (!t)
        return 0;
    char why[160];
    if (mm_weight_init(w, t->type, n_in, n_out, t->data, why, sizeof(why))) {
        snprintf(err, errlen, "tensor %s: %s", name, why);
        return -EINVAL;
    }
    return 0;
}

int model_load_vector(const gguf_file *f, const char *name, int n, bool required, float *dst,
                      const float **out, char *err, size_t errlen)
{
    bool bad = false;
    const struct gguf_tensor *t = find_checked(f, name, n, 1, required, &bad, err, errlen);
    *out = NULL;
    if (bad)
        return -EINVAL;
    if (!t)
        return 0;
    if (qt_dequantize_row(t->type, t->data, dst, n)) {
        snprintf(err, errlen, "tensor %s: type %s is not supported for a vector of %d", name,
                 gguf_ggml_type_name(t->type) ? gguf_ggml_type_name(t->type) : "unknown", n);
        return -EINVAL;
    }
    for (int i = 0; i < n; i++) {
        if (!isfinite(dst[i])) {
            snprintf(err, errlen, "tensor %s: element %d is not finite", name, i);
            return -EINVAL;
        }
    }
    *out = dst;
    return 0;
}

/* The matrix type holding most bytes: what "a q8_0 model" means. */
static const char *dominant_type(const model *m)
{
    size_t bytes[GGML_TYPE_COUNT] = {0};
    const struct mm_weight *ws[] = {&m->tok_embd, &m->output};
    for (int i = 0; i < (m->tied ? 1 : 2); i++)
        bytes[ws[i]->type] += ws[i]->row_bytes * (size_t)ws[i]->n_out;
    for (int l = 0; l < m->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        const struct mm_weight *lw[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++)
            if (lw[i]->data) /* gate: SwiGLU only */
                bytes[lw[i]->type] += lw[i]->row_bytes * (size_t)lw[i]->n_out;
    }
    int best = 0;
    for (int t = 1; t < GGML_TYPE_COUNT; t++)
        if (bytes[t] > bytes[best])
            best = t;
    const char *n = qt_type_name((enum ggml_type)best);
    return n ? n : "unknown";
}

/* The f32 vectors any architecture may need: per layer 2 norms and their
 * biases, q/k/v biases, the output projection's and the MLP's biases; the
 * embedding and output norms with biases. */
static size_t vec_floats(const model *m)
{
    size_t d = (size_t)m->n_embd;
    size_t per_layer = 4 * d + (size_t)m->q_dim + 2 * (size_t)m->kv_dim + d + (size_t)m->n_ff + d +
                       2 * (size_t)m->head_dim;
    return per_layer * (size_t)m->n_layer + 4 * d;
}

int model_split_rows(const struct mm_weight *w, const char *name, struct mm_weight *const *parts,
                     const int *rows, int n, char *err, size_t errlen)
{
    const uint8_t *base = w->data;
    char why[160];
    for (int i = 0; i < n; i++) {
        if (mm_weight_init(parts[i], w->type, w->n_in, rows[i], base, why, sizeof(why))) {
            snprintf(err, errlen, "tensor %s: %s", name, why);
            return -EINVAL;
        }
        base += w->row_bytes * (size_t)rows[i];
    }
    return 0;
}

int model_layer_vector(const model *m, int l, const char *suffix, int n, bool required, float **v,
                       const float **out, char *err, size_t errlen)
{
    char name[96];
    snprintf(name, sizeof(name), "blk.%d.%s", l, suffix);
    int rc = model_load_vector(m->file, name, n, required, *v, out, err, errlen);
    *v += n;
    return rc;
}

int model_layer_matrix(const model *m, int l, const char *suffix, int n_in, int n_out,
                       bool required, struct mm_weight *w, char *err, size_t errlen)
{
    char name[96];
    snprintf(name, sizeof(name), "blk.%d.%s", l, suffix);
    return model_load_matrix(m->file, name, n_in, n_out, required, w, NULL, err, errlen);
}

int model_llama_matrices(const model *m, int l, struct model_layer *L, char *err, size_t errlen)
{
    int d = m->n_embd, q = m->q_dim, kv = m->kv_dim, ff = m->n_ff, rc = 0;
#define MAT(sfx, n_in, n_out, dst)                                                                 \
    (rc = rc ? rc : model_layer_matrix(m, l, sfx, n_in, n_out, true, dst, err, errlen))
    MAT("attn_q.weight", d, q, &L->wq);
    MAT("attn_k.weight", d, kv, &L->wk);
    MAT("attn_v.weight", d, kv, &L->wv);
    MAT("attn_output.weight", q, d, &L->wo);
    MAT("ffn_gate.weight", d, ff, &L->gate);
    MAT("ffn_up.weight", d, ff, &L->up);
    MAT("ffn_down.weight", ff, d, &L->down);
#undef MAT
    return rc;
}

/* Llama and qwen2 layers; the output, its norm and the embedding are
 * already loaded (load_tensors). v: free f32 storage. */
static int load_llama_layers(model *m, float *v, char *err, size_t errlen)
{
    int d = m->n_embd, q = m->q_dim, kv = m->kv_dim, rc = 0;
    /* Biases: qwen2 has them; llama.cpp accepts them on llama too. Qwen3
     * normalises each q and k head instead. */
    bool bias = m->arch == MODEL_ARCH_QWEN2, qk_norm = m->arch == MODEL_ARCH_QWEN3;
    int hd = m->head_dim;
    for (int l = 0; l < m->n_layer && !rc; l++) {
        struct model_layer *L = &m->layers[l];
        L->sliding_window = m->sliding_window; /* Mistral: every layer */
#define VEC(sfx, n, req, dst)                                                                      \
    (rc = rc ? rc : model_layer_vector(m, l, sfx, n, req, &v, dst, err, errlen))
        VEC("attn_norm.weight", d, true, &L->attn_norm);
        VEC("ffn_norm.weight", d, true, &L->ffn_norm);
        VEC("attn_q.bias", q, bias, &L->bq);
        VEC("attn_k.bias", kv, bias, &L->bk);
        VEC("attn_v.bias", kv, bias, &L->bv);
        if (qk_norm) {
            VEC("attn_q_norm.weight", hd, true, &L->q_norm);
            VEC("attn_k_norm.weight", hd, true, &L->k_norm);
        }
        rc = rc ? rc : model_llama_matrices(m, l, L, err, errlen);
#undef VEC
    }
    return rc;
}

static int load_tensors(model *m, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    int d = m->n_embd;
    m->vecs = malloc(sizeof(float) * vec_floats(m));
    m->layers = calloc((size_t)m->n_layer, sizeof(*m->layers));
    if (!m->vecs || !m->layers) {
        snprintf(err, errlen, "out of memory for %d layers", m->n_layer);
        return -ENOMEM;
    }
    int rc = model_load_matrix(f, "token_embd.weight", d, m->n_vocab, true, &m->tok_embd, NULL, err,
                               errlen);
    if (rc)
        return rc;
    bool has_output;
    rc = model_load_matrix(f, "output.weight", d, m->n_vocab, false, &m->output, &has_output, err,
                           errlen);
    if (rc)
        return rc;
    m->tied = !has_output;
    if (m->tied)
        m->output = m->tok_embd;
    float *v = m->vecs;
    rc = model_load_vector(f, "output_norm.weight", d, true, v, &m->output_norm, err, errlen);
    v += d;
    if (rc)
        return rc;
    if (m->arch == MODEL_ARCH_BLOOM || m->arch == MODEL_ARCH_MPT)
        rc = model_bloom_tensors(m, v, err, errlen);
    else if (m->arch == MODEL_ARCH_GEMMA2 || m->arch == MODEL_ARCH_GEMMA3)
        rc = model_gemma_layers(m, v, err, errlen);
    else if (m->arch == MODEL_ARCH_PHI3)
        rc = model_phi3_layers(m, v, err, errlen);
    else
        rc = load_llama_layers(m, v, err, errlen);
    if (rc)
        return rc;
    m->weight_type = dominant_type(m);
    return 0;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

static const struct {
    const char *name;
    enum model_arch arch;
} arches[] = {
    {"llama", MODEL_ARCH_LLAMA},
    {"qwen2", MODEL_ARCH_QWEN2},
    {"qwen3", MODEL_ARCH_QWEN3},
    {"bloom", MODEL_ARCH_BLOOM},
    {"mpt", MODEL_ARCH_MPT},
    {"gemma2", MODEL_ARCH_GEMMA2},
    {"gemma3", MODEL_ARCH_GEMMA3},
    {"phi3", MODEL_ARCH_PHI3},
};

/* The tokenizer (with the operator's pre-tokenizer, if any); its size is
 * the vocabulary the output layer must cover. */
static int load_tokenizer(model *m, const struct model_params *params, char *err, size_t errlen)
{
    char why[400];
    m->tok = tok_load_forced(m->file, params->tokenizer_pre, why, sizeof(why));
    if (!m->tok) {
        snprintf(err, errlen, "tokenizer: %s", why);
        return -EINVAL;
    }
    m->n_vocab = tok_n_vocab(m->tok);
    return 0;
}

/* The tokenizer alone (vocab_only): architecture and tensors are not read. */
static int load_vocab(model *m, const struct model_params *params, char *err, size_t errlen)
{
    int rc = load_tokenizer(m, params, err, errlen);
    if (rc)
        return rc;
    snprintf(m->arch_name, sizeof(m->arch_name), "vocab");
    m->weight_type = "none";
    return 0;
}

/* Each layer's sliding window as the cache takes it (kv_cache_params.layer_window). */
static int layer_windows(model *m, char *err, size_t errlen)
{
    m->kv_windows = malloc(sizeof(int32_t) * (size_t)m->n_layer);
    if (!m->kv_windows) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    for (int l = 0; l < m->n_layer; l++)
        m->kv_windows[l] = m->layers[l].sliding_window;
    return 0;
}

/* Architecture, hyper-parameters, tokenizer and every tensor. */
static int load_weights(model *m, const struct model_params *params, char *err, size_t errlen)
{
    const char *arch;
    size_t alen;
    if (gguf_get_str(m->file, "general.architecture", &arch, &alen)) {
        snprintf(err, errlen, "missing metadata key general.architecture");
        return -EINVAL;
    }
    size_t k = 0;
    while (k < sizeof(arches) / sizeof(arches[0]) &&
           !(alen == strlen(arches[k].name) && !memcmp(arch, arches[k].name, alen)))
        k++;
    if (k == sizeof(arches) / sizeof(arches[0])) {
        snprintf(err, errlen,
                 "architecture '%.*s' is not supported (kvd runs llama, qwen2, qwen3, bloom, mpt, "
                 "gemma2, gemma3, phi3)",
                 (int)(alen > 64 ? 64 : alen), arch);
        return -EINVAL;
    }
    m->arch = arches[k].arch;
    memcpy(m->arch_name, arch, alen);
    m->arch_name[alen] = '\0';
    m->attn_logit_mul = 1.0f;

    int rc = model_read_shape(m, err, errlen);
    m->attn_scale = 1.0f / sqrtf((float)m->head_dim);
    m->emb_scale = 1.0f;
    m->rope_q_mul = 1.0f;
    if (!rc && (m->arch == MODEL_ARCH_BLOOM || m->arch == MODEL_ARCH_MPT))
        rc = model_bloom_hparams(m, params, err, errlen);
    else if (!rc && (m->arch == MODEL_ARCH_GEMMA2 || m->arch == MODEL_ARCH_GEMMA3))
        rc = model_gemma_hparams(m, err, errlen);
    else if (!rc)
        rc = read_llama_hparams(m, params, err, errlen);
    if (!rc && m->arch == MODEL_ARCH_PHI3 && m->pos.kind == POS_ROPE)
        rc = model_phi3_rope(m, params, err, errlen);
    if (rc)
        return rc;

    rc = load_tokenizer(m, params, err, errlen);
    if (!rc)
        rc = load_tensors(m, err, errlen);
    if (!rc && m->sliding_window > 0)
        rc = layer_windows(m, err, errlen);

    /* Offset-only biases: slopes from max_bias, or the shared T5 table. */
    if (!rc && m->pos.kind == POS_ALIBI)
        rc = model_pos_alibi(m, m->alibi_max_bias, err, errlen);
    else if (!rc && m->pos.kind == POS_T5)
        rc = model_pos_t5(m, params, err, errlen);
    if (!rc && m->pos.kind != POS_T5)
        rc = model_pos_no_t5_tables(m, err, errlen);
    m->small_pages = params->small_pages;
    if (!rc)
        rc = model_pack_weights(m, params->small_pages, err, errlen);
    return rc;
}

model *model_load(const struct model_params *params, char *err, size_t errlen)
{
    if (!params || !params->path) {
        snprintf(err, errlen, "no model path given");
        return NULL;
    }
    model *m = calloc(1, sizeof(*m));
    if (!m) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    char why[512];
    m->file = gguf_open(params->path, why, sizeof(why));
    if (!m->file) {
        /* The reader's message names the file already. */
        snprintf(err, errlen, "%s", why);
        goto fail;
    }

    int rc = params->vocab_only ? load_vocab(m, params, why, sizeof(why))
                                : load_weights(m, params, why, sizeof(why));
    if (rc) {
        snprintf(err, errlen, "%s: %s", params->path, why);
        goto fail;
    }

    /* Name: general.name, or the file's base name. */
    const char *nm;
    size_t nlen;
    if (gguf_get_str(m->file, "general.name", &nm, &nlen) || nlen == 0) {
        const char *slash = strrchr(params->path, '/');
        nm = slash ? slash + 1 : params->path;
        nlen = strlen(nm);
    }
    m->name = strndup(nm, nlen);
    if (!m->name) {
        snprintf(err, errlen, "out of memory");
        goto fail;
    }
    return m;

fail:
    model_free(m);
    return NULL;
}

void model_free(model *m)
{
    if (!m)
        return;
    tok_free(m->tok);
    model_pack_free(m);
    gguf_close(m->file);
    free(m->layers);
    free(m->vecs);
    free(m->pos_data);
    free(m->rope_factors);
    free(m->rope_tables);
    free(m->kv_windows);
    free(m->name);
    free(m);
}

void model_get_info(const model *m, struct model_info *info)
{
    *info = (struct model_info){
        .arch = m->arch_name,
        .name = m->name,
        .pos = m->pos.kind,
        .weight_type = m->weight_type,
        .n_vocab = m->n_vocab,
        .n_ctx_train = m->n_ctx_train,
        .n_embd = m->n_embd,
        .n_layer = m->n_layer,
        .n_head = m->n_head,
        .n_kv_head = m->n_kv_head,
        .head_dim = m->head_dim,
        .n_ff = m->n_ff,
        .attn_softcap = m->attn_softcap,
        .rope_orig_ctx = m->rope_orig_ctx,
        .rope_long = m->rope_long,
        .tokenizer = tok_pre_name(m->tok),
        .tokenizer_note = tok_warning(m->tok),
    };
}

void model_set_n_ctx(model *m, int n_ctx)
{
    model_phi3_pick(m, n_ctx);
}

void model_kv_shape(const model *m, struct kv_cache_params *p)
{
    p->n_layer = m->n_layer;
    p->n_kv_head = m->n_kv_head;
    p->head_dim = m->head_dim;
    p->layer_window = m->kv_windows;
    p->small_pages = m->small_pages;
}

/* ------------------------------------------------------------------------
 * Tokens
 * ------------------------------------------------------------------------ */

int model_tokenize(const model *m, const char *text, size_t len, bool add_bos, int32_t *out,
                   int max)
{
    return tok_encode(m->tok, text, len, add_bos, out, max);
}

int model_tokenize_special(const model *m, const char *text, size_t len, bool add_bos,
                           int32_t *out, int max)
{
    return tok_encode_special(m->tok, text, len, add_bos, out, max);
}

int model_tokenize_continuation(const model *m, const char *text, size_t len, int32_t *out,
                                int max)
{
    return tok_encode_continuation(m->tok, text, len, out, max);
}

int model_tokenize_upto(const model *m, const char *text, size_t len, bool add_bos, bool special,
                        int32_t *out, int max)
{
    return tok_encode_upto(m->tok, text, len, add_bos, special, out, max);
}

int model_max_token_bytes(const model *m)
{
    size_t n = tok_max_token_bytes(m->tok);
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

bool model_add_bos(const model *m)
{
    return tok_add_bos(m->tok);
}

int32_t model_bos(const model *m)
{
    return tok_bos(m->tok);
}

bool model_is_eog(const model *m, int32_t token)
{
    return tok_is_eog(m->tok, token);
}

int32_t model_eos(const model *m)
{
    return tok_eos(m->tok);
}

int32_t model_unk(const model *m)
{
    return tok_unk(m->tok);
}

const char *model_token_text(const model *m, int32_t id, size_t *len)
{
    return tok_token_text(m->tok, id, len);
}

const char *model_chat_template(const model *m, const char *name, size_t *len)
{
    char key[256];
    if (name && snprintf(key, sizeof key, "tokenizer.chat_template.%s", name) >= (int)sizeof key)
        return NULL;
    const char *s;
    if (gguf_get_str(m->file, name ? key : "tokenizer.chat_template", &s, len) < 0)
        return NULL;
    return s;
}

/*
 * The detokeniser continues a text: it is meant for generated tokens that
 * follow a prompt, so a word-initial "▁" always shows as a space.
 */
struct model_detok {
    const model *m;
    struct tok_stream s;
};

model_detok *model_detok_create(const model *m)
{
    model_detok *d = malloc(sizeof(*d));
    if (!d)
        return NULL;
    d->m = m;
    tok_stream_init(&d->s, m->tok, false);
    return d;
}

void model_detok_destroy(model_detok *d)
{
    free(d);
}

int model_detok_push(model_detok *d, int32_t token, char *out, size_t cap)
{
    return tok_stream_push(&d->s, d->m->tok, token, out, cap);
}

int model_detok_flush(model_detok *d, char *out, size_t cap)
{
    return tok_stream_flush(&d->s, out, cap);
}
