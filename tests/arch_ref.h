/*
 * arch_ref.h - the plain reference forward of test_model.c and test_arch.c,
 * their shared fixtures, and GGUF surgery for hostile files.
 *
 * The reference reads a llama/qwen2 (RoPE), BLOOM or MPT (ALiBi) or
 * llama-shaped ALiBi / T5-bias GGUF on its own (metadata keys and tensor
 * names, the fused QKV split by rows), computes ALiBi slopes from the ALiBi
 * paper's and MPT's formulas rather than posenc's, and runs one token at a
 * time in double precision over weights dequantised to f32, with every
 * score materialised. RoPE is applied llama.cpp style: keys are stored
 * rotated by the position they had when stored, and eviction re-rotates
 * the survivors by their position change (as llama.cpp's context shift
 * does). ALiBi and T5 biases are materialised from the position numbers
 * (T5 buckets by posenc's pos_t5_bucket, which test_attention checks
 * against Hugging Face's); for them eviction only drops entries and sets
 * positions, since an offset-only bias needs nothing else.
 *
 * Include after <cmocka.h> and model/model_internal.h, model/mkmodel.h and
 * model/quant.h; everything here is static, for the one program that
 * includes it, and may go unused in one of the two programs.
 */
#ifndef KVD_TESTS_ARCH_REF_H
#define KVD_TESTS_ARCH_REF_H

#define AR_FN static __attribute__((unused))

/* ------------------------------------------------------------------------
 * Fixtures
 * ------------------------------------------------------------------------ */

/* Phi-3: the context the reference serves (0: the file's context_length),
 * which picks the long or the short LongRoPE table as model_params.n_ctx
 * does for kvd. */
static int ref_phi3_ctx;

/* The program's scratch directory: tmp_dir_create in the group setup,
 * tmp_dir_remove in the teardown. */
static char tmp_dir[256];

/* mkdtemp TMPDIR/kvd-test-TAG-XXXXXX. Returns 0 or -1. */
AR_FN int tmp_dir_create(const char *tag)
{
    const char *t = getenv("TMPDIR");
    snprintf(tmp_dir, sizeof(tmp_dir), "%s/kvd-test-%s-XXXXXX", t && *t ? t : "/tmp", tag);
    return mkdtemp(tmp_dir) ? 0 : -1;
}

AR_FN int tmp_dir_remove(void)
{
    char cmd[400];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* Write a mkmodel model as tmp_dir/name; its path in path. */
AR_FN void write_model(const struct model_mk_params *p, const char *name, char *path, size_t cap)
{
    char err[512];
    snprintf(path, cap, "%s/%s", tmp_dir, name);
    int rc = model_mk_write(p, path, err, sizeof(err));
    if (rc)
        print_message("model_mk_write: %s\n", err);
    assert_int_equal(rc, 0);
}

AR_FN model *load_model(const char *path)
{
    char err[512];
    struct model_params mp = {.path = path, .n_ctx = ref_phi3_ctx};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m)
        print_message("model_load: %s\n", err);
    assert_non_null(m);
    return m;
}

/* A cache for model m with room for `tokens` tokens in total. */
AR_FN kv_cache *make_cache(const model *m, enum kv_type type, int page_tokens, int tokens)
{
    struct kv_cache_params cp = {.page_tokens = page_tokens, .k_type = type, .v_type = type};
    model_kv_shape(m, &cp);
    size_t page = kv_cache_token_bytes(&cp) * (size_t)page_tokens;
    page = (page + 63) / 64 * 64;
    cp.memory_bytes = page * (size_t)(tokens / page_tokens + 4);
    char err[256];
    kv_cache *c = kv_cache_create(&cp, err, sizeof(err));
    if (!c)
        print_message("kv_cache_create: %s\n", err);
    assert_non_null(c);
    return c;
}

AR_FN kv_seq *make_seq(kv_cache *c, const struct kv_policy *pol)
{
    char err[256];
    kv_seq *s = kv_seq_create(c, pol, false, err, sizeof(err));
    if (!s)
        print_message("kv_seq_create: %s\n", err);
    assert_non_null(s);
    return s;
}

AR_FN struct kv_policy policy_none(int max_tokens)
{
    return (struct kv_policy){
        .kind = KV_EVICT_NONE, .max_cache_tokens = max_tokens, .renumber = true};
}

AR_FN model_ctx *make_ctx(const model *m, int max_tokens, int threads)
{
    char err[256];
    model_ctx *c = model_ctx_create(m, max_tokens, threads, err, sizeof(err));
    if (!c)
        print_message("model_ctx_create: %s\n", err);
    assert_non_null(c);
    return c;
}

/* Deterministic pseudo-random token ids in [3, n_vocab) (no specials). */
AR_FN void fill_tokens(int32_t *t, int n, int n_vocab, uint32_t seed)
{
    uint32_t s = seed * 2654435761u + 1;
    for (int i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        t[i] = 3 + (int32_t)((s >> 8) % (uint32_t)(n_vocab - 3));
    }
}

AR_FN float max_abs_diff(const float *a, const float *b, int n)
{
    float d = 0.0f;
    for (int i = 0; i < n; i++) {
        float e = fabsf(a[i] - b[i]);
        if (!(e <= d)) /* NaN propagates as a failure */
            d = isnan(e) ? INFINITY : e;
    }
    return d;
}

AR_FN float max_abs(const float *a, int n)
{
    float d = 0.0f;
    for (int i = 0; i < n; i++)
        d = fabsf(a[i]) > d ? fabsf(a[i]) : d;
    return d;
}

/* The largest difference relative to the largest reference value. */
AR_FN float rel_diff(const float *a, const float *ref, int n)
{
    return max_abs_diff(a, ref, n) / max_abs(ref, n);
}

/*
 * The logits after a 64-token prompt of model `path` (seeded tokens), as a
 * healthy-model check reads them: all finite (asserted), their standard
 * deviation in *sd and the top token's softmax probability in *top.
 */
AR_FN void logit_health(const char *path, double *sd, double *top)
{
    model *m = load_model(path);
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, KV_F32, 16, 80);
    struct kv_policy pol = policy_none(80);
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, 64, 2);
    int32_t t[64];
    fill_tokens(t, 64, nv, 1);
    float *lg = malloc(sizeof(float) * nv);
    struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 64, .logits = lg};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    double s = 0, s2 = 0, mx = -1e30;
    for (int i = 0; i < nv; i++) {
        assert_true(isfinite(lg[i]));
        s += lg[i];
        s2 += (double)lg[i] * lg[i];
        mx = lg[i] > mx ? lg[i] : mx;
    }
    double mean = s / nv, z = 0;
    *sd = sqrt(s2 / nv - mean * mean);
    /* Softmax: the top token's probability. */
    for (int i = 0; i < nv; i++)
        z += exp(lg[i] - mx);
    *top = 1.0 / z;
    free(lg);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
}

/* ------------------------------------------------------------------------
 * ALiBi slopes, as the papers write them
 * ------------------------------------------------------------------------ */

/*
 * BLOOM's build_alibi_tensor / the ALiBi paper: with p the largest power of
 * two <= n, slopes (2^(-8/p))^k for k = 1..p, then for the remaining
 * n - p heads the odd powers of 2^(-4/p).
 */
AR_FN void bloom_slopes(double *s, int n)
{
    int p = 1;
    while (p * 2 <= n)
        p *= 2;
    double base = pow(2.0, -8.0 / p);
    for (int k = 1; k <= p; k++)
        s[k - 1] = pow(base, k);
    double extra = pow(2.0, -4.0 / p);
    for (int i = 0; i < n - p; i++)
        s[p + i] = pow(extra, 2 * i + 1);
}

/*
 * MPT's build_mpt_alibi_tensor: q the smallest power of two >= n, slopes
 * 1 / 2^(k * max_bias / q) for k = 1..q; when q != n, the odd-indexed ones
 * then the even-indexed ones, cut to n.
 */
AR_FN void mpt_slopes(double *s, int n, double max_bias)
{
    int q = 1;
    while (q < n)
        q *= 2;
    double all[4096];
    assert_true(q <= 4096);
    for (int k = 1; k <= q; k++)
        all[k - 1] = 1.0 / pow(2.0, k * max_bias / q);
    if (q == n) {
        memcpy(s, all, sizeof(double) * (size_t)n);
        return;
    }
    int w = 0;
    for (int i = 1; i < q && w < n; i += 2)
        s[w++] = all[i];
    for (int i = 0; i < q && w < n; i += 2)
        s[w++] = all[i];
}

/* ------------------------------------------------------------------------
 * The reference forward
 * ------------------------------------------------------------------------ */

struct ref_layer {
    float *attn_norm, *attn_norm_b, *ffn_norm, *ffn_norm_b; /* [d] */
    float *wq, *wk, *wv, *wo;                               /* [out][in] */
    float *bq, *bk, *bv, *bo;                               /* or NULL */
    float *gate, *up, *down;                                /* gate: SwiGLU only */
    float *b_up, *b_down;
    float *q_norm, *k_norm; /* [hd] per-head RMSNorm of q and k (qwen3, gemma3), or NULL */
    float *post_attn, *post_ffn; /* [d] Gemma's norms of the attention / MLP outputs, or NULL */
    int window;             /* this layer's sliding window (0 = none) */
    bool local_rope;        /* gemma3 local layer: RoPE base theta_local, no scaling */
};

enum ref_act { REF_SWIGLU, REF_GELU_TANH, REF_GELU_ERF, REF_GEGLU };

struct ref_model {
    int n_vocab, d, n_layer, n_head, n_kv, hd, n_ff;
    bool layernorm;
    enum ref_act act;
    enum pos_kind pos; /* ROPE, ALIBI or T5 */
    float eps, clamp;
    int n_rot;          /* RoPE: rotated dims per head */
    bool neox;          /* RoPE: pairs (i, i + n_rot/2) (qwen2) rather than (2i, 2i+1) */
    float theta, fscale; /* RoPE: frequency base, linear position scale */
    float *rope_ff;      /* RoPE: rope_freqs.weight [n_rot/2] (pair i's frequency / ff[i]), or NULL */
    bool yarn;           /* RoPE: YaRN, ggml's rope_yarn: extrapolated and interpolated angles
                            mixed by a ramp over the pairs, rotated values times mscale */
    int yarn_orig;       /* its original context */
    int window;          /* sliding window: keys with pos_q - pos_k >= window unseen; 0 = none
                            (Gemma: of the local layers; each layer's own is ref_layer.window) */
    double emb_scale;    /* the embedding times this (Gemma: sqrt(d)); 1 otherwise */
    double attn_cap, final_cap; /* Gemma 2's soft-caps: c tanh(x / c); 0 = none */
    double theta_local;  /* gemma3: the local layers' RoPE base */
    double amp;          /* phi3 LongRoPE: rotated q and k values times this; 1 otherwise */
    double *slopes; /* ALiBi [n_head] */
    float *t5;      /* T5 [n_head][nb] */
    int nb, md;
    float *embd, *tok_norm, *tok_norm_b, *out_norm, *out_norm_b, *out;
    struct ref_layer *L;
};

/* A whole tensor dequantised to f32 rows, or NULL when absent. */
AR_FN float *ref_tensor(const gguf_file *f, const char *name, int ne0, int ne1)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        return NULL;
    assert_int_equal(t->ne[0], ne0);
    assert_int_equal(t->ne[1], ne1);
    float *w = malloc(sizeof(float) * (size_t)ne0 * ne1);
    assert_non_null(w);
    size_t rb = qt_row_bytes(t->type, ne0);
    for (int r = 0; r < ne1; r++)
        assert_int_equal(
            qt_dequantize_row(t->type, (const uint8_t *)t->data + rb * r, w + (size_t)r * ne0, ne0),
            0);
    return w;
}

AR_FN float *rows_copy(const float *w, int row0, int n_rows, int n_in)
{
    float *o = malloc(sizeof(float) * (size_t)n_rows * n_in);
    assert_non_null(o);
    memcpy(o, w + (size_t)row0 * n_in, sizeof(float) * (size_t)n_rows * n_in);
    return o;
}

AR_FN int ref_meta_int(const gguf_file *f, const char *key, int def)
{
    int64_t v;
    return gguf_get_i64(f, key, &v) ? def : (int)v;
}

AR_FN float ref_meta_f32(const gguf_file *f, const char *key, float def)
{
    float v;
    return gguf_get_f32(f, key, &v) ? def : v;
}

AR_FN void ref_load(struct ref_model *r, const char *path)
{
    char err[256];
    gguf_file *f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    const char *a;
    size_t alen;
    assert_int_equal(gguf_get_str(f, "general.architecture", &a, &alen), 0);
    char arch[16], k[128];
    snprintf(arch, sizeof(arch), "%.*s", (int)alen, a);
    bool bloom = !strcmp(arch, "bloom"), mpt = !strcmp(arch, "mpt");
    memset(r, 0, sizeof(*r));
#define KEY(s) (snprintf(k, sizeof(k), "%s.%s", arch, s), k)
    r->d = ref_meta_int(f, KEY("embedding_length"), 0);
    r->n_layer = ref_meta_int(f, KEY("block_count"), 0);
    r->n_head = ref_meta_int(f, KEY("attention.head_count"), 0);
    r->n_kv = ref_meta_int(f, KEY("attention.head_count_kv"), r->n_head);
    r->n_ff = ref_meta_int(f, KEY("feed_forward_length"), 0);
    r->hd = ref_meta_int(f, KEY("attention.key_length"), r->d / r->n_head);
    bool gemma = !strncmp(arch, "gemma", 5), gemma3 = !strcmp(arch, "gemma3");
    r->layernorm = bloom || mpt;
    r->act = bloom ? REF_GELU_TANH : mpt ? REF_GELU_ERF : gemma ? REF_GEGLU : REF_SWIGLU;
    r->emb_scale = gemma ? sqrt((double)r->d) : 1.0;
    if (gemma && !gemma3) {
        r->attn_cap = ref_meta_f32(f, KEY("attn_logit_softcapping"), 50.0f);
        r->final_cap = ref_meta_f32(f, KEY("final_logit_softcapping"), 30.0f);
    }
    r->theta_local = ref_meta_f32(f, KEY("rope.freq_base_swa"), 10000.0f);
    r->amp = 1.0;
    r->eps = r->layernorm ? ref_meta_f32(f, KEY("attention.layer_norm_epsilon"), -1.0f)
                          : ref_meta_f32(f, KEY("attention.layer_norm_rms_epsilon"),
                                         gemma ? 1e-6f : 1e-5f);
    assert_true(r->eps > 0.0f);
    r->clamp = ref_meta_f32(f, KEY("attention.clamp_kqv"), 0.0f);
    float max_bias = ref_meta_f32(f, KEY("attention.max_alibi_bias"), bloom ? 8.0f : -1.0f);
    /* BLOOM and MPT are ALiBi; a llama-shaped model is RoPE unless
     * kvd.position.kind says otherwise. */
    const char *kind = "alibi";
    size_t kn = 5;
    if (!bloom && !mpt && gguf_get_str(f, "kvd.position.kind", &kind, &kn)) {
        kind = "rope";
        kn = 4;
    }
    r->pos = kn == 2 && !memcmp(kind, "t5", 2)      ? POS_T5
             : kn == 4 && !memcmp(kind, "rope", 4)  ? POS_ROPE
             : kn == 5 && !memcmp(kind, "alibi", 5) ? POS_ALIBI
                                                    : POS_NONE;
    assert_true(r->pos != POS_NONE);
    if (r->pos == POS_ROPE) {
        r->neox = !strcmp(arch, "qwen2") || !strcmp(arch, "qwen3") || gemma ||
                  !strcmp(arch, "phi3");
        r->n_rot = ref_meta_int(f, KEY("rope.dimension_count"), r->hd);
        r->theta = ref_meta_f32(f, KEY("rope.freq_base"), 10000.0f);
        r->fscale = 1.0f;
        const char *st;
        size_t stn;
        if (!gguf_get_str(f, KEY("rope.scaling.type"), &st, &stn)) {
            r->fscale = 1.0f / ref_meta_f32(f, KEY("rope.scaling.factor"), 1.0f);
            r->yarn = stn == 4 && !memcmp(st, "yarn", 4);
            r->yarn_orig = ref_meta_int(f, KEY("rope.scaling.original_context_length"), 0);
        }
        r->rope_ff = ref_tensor(f, "rope_freqs.weight", r->n_rot / 2, 1);
        /* Phi-3's LongRoPE: the long table when the context served
         * (ref_phi3_ctx, else the file's) passes the original one. */
        float *lf = ref_tensor(f, "rope_factors_long.weight", r->n_rot / 2, 1);
        float *sf = ref_tensor(f, "rope_factors_short.weight", r->n_rot / 2, 1);
        if (lf && sf) {
            int ctx = ref_phi3_ctx ? ref_phi3_ctx : ref_meta_int(f, KEY("context_length"), 0);
            bool use_long = ctx > ref_meta_int(f, KEY("rope.scaling.original_context_length"), 0);
            r->rope_ff = use_long ? lf : sf;
            free(use_long ? sf : lf);
            r->amp = ref_meta_f32(f, KEY("rope.scaling.attn_factor"), 1.0f);
        }
        r->window = ref_meta_int(f, KEY("attention.sliding_window"), gemma && !gemma3 ? 4096 : 0);
    } else if (r->pos == POS_ALIBI) {
        assert_true(max_bias > 0.0f);
        r->slopes = malloc(sizeof(double) * (size_t)r->n_head);
        mpt_slopes(r->slopes, r->n_head, max_bias);
    } else {
        r->nb = ref_meta_int(f, "kvd.t5.num_buckets", 0);
        r->md = ref_meta_int(f, "kvd.t5.max_distance", 0);
        float *tab = ref_tensor(f, "blk.0.attn_rel_b.weight", r->n_head, r->nb);
        assert_non_null(tab);
        r->t5 = malloc(sizeof(float) * (size_t)r->n_head * r->nb);
        for (int b = 0; b < r->nb; b++)
            for (int h = 0; h < r->n_head; h++)
                r->t5[(size_t)h * r->nb + b] = tab[(size_t)b * r->n_head + h];
        free(tab);
    }
#undef KEY

    uint64_t nv;
    enum gguf_type et;
    const void *data;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &nv, &data), 0);
    r->n_vocab = (int)nv;
    int d = r->d, qd = r->n_head * r->hd, kvd = r->n_kv * r->hd;
    r->embd = ref_tensor(f, "token_embd.weight", d, r->n_vocab);
    r->tok_norm = ref_tensor(f, "token_embd_norm.weight", d, 1);
    r->tok_norm_b = ref_tensor(f, "token_embd_norm.bias", d, 1);
    r->out = ref_tensor(f, "output.weight", d, r->n_vocab);
    if (!r->out) { /* tied */
        r->out = malloc(sizeof(float) * (size_t)d * r->n_vocab);
        memcpy(r->out, r->embd, sizeof(float) * (size_t)d * r->n_vocab);
    }
    r->out_norm = ref_tensor(f, "output_norm.weight", d, 1);
    r->out_norm_b = ref_tensor(f, "output_norm.bias", d, 1);
    r->L = calloc((size_t)r->n_layer, sizeof(*r->L));
    for (int l = 0; l < r->n_layer; l++) {
        struct ref_layer *L = &r->L[l];
        char n[64];
#define T(s, a0, a1) (snprintf(n, sizeof(n), "blk.%d.%s", l, s), ref_tensor(f, n, a0, a1))
        L->attn_norm = T("attn_norm.weight", d, 1);
        L->attn_norm_b = T("attn_norm.bias", d, 1);
        L->ffn_norm = T("ffn_norm.weight", d, 1);
        L->ffn_norm_b = T("ffn_norm.bias", d, 1);
        float *qkv = T("attn_qkv.weight", d, qd + 2 * kvd);
        if (qkv) {
            /* The fused matrix, split by rows: Q, then K, then V. */
            float *b = T("attn_qkv.bias", qd + 2 * kvd, 1);
            L->wq = rows_copy(qkv, 0, qd, d);
            L->wk = rows_copy(qkv, qd, kvd, d);
            L->wv = rows_copy(qkv, qd + kvd, kvd, d);
            if (b) {
                L->bq = rows_copy(b, 0, qd, 1);
                L->bk = rows_copy(b, qd, kvd, 1);
                L->bv = rows_copy(b, qd + kvd, kvd, 1);
            }
            free(qkv);
            free(b);
        } else {
            L->wq = T("attn_q.weight", d, qd);
            L->wk = T("attn_k.weight", d, kvd);
            L->wv = T("attn_v.weight", d, kvd);
            L->bq = T("attn_q.bias", qd, 1);
            L->bk = T("attn_k.bias", kvd, 1);
            L->bv = T("attn_v.bias", kvd, 1);
            L->gate = T("ffn_gate.weight", d, r->n_ff);
            L->q_norm = T("attn_q_norm.weight", r->hd, 1);
            L->k_norm = T("attn_k_norm.weight", r->hd, 1);
        }
        L->post_attn = T("post_attention_norm.weight", d, 1);
        L->post_ffn = T("post_ffw_norm.weight", d, 1);
        /* Which layers slide, as Hugging Face's configs say it: Gemma 2's
         * even layers; Gemma 3's all but every sixth (layer_idx + 1) % 6. */
        bool sliding = !gemma || (gemma3 ? (l + 1) % 6 != 0 : l % 2 == 0);
        L->window = sliding ? r->window : 0;
        L->local_rope = gemma3 && sliding;
        L->wo = T("attn_output.weight", qd, d);
        L->bo = T("attn_output.bias", d, 1);
        if (r->act == REF_SWIGLU && !L->gate) { /* phi3: [gate rows; up rows] in ffn_up */
            float *gu = T("ffn_up.weight", d, 2 * r->n_ff);
            assert_non_null(gu);
            L->gate = rows_copy(gu, 0, r->n_ff, d);
            L->up = rows_copy(gu, r->n_ff, r->n_ff, d);
            free(gu);
        } else {
            L->up = T("ffn_up.weight", d, r->n_ff);
        }
        assert_true(r->act != REF_SWIGLU || L->gate);
        L->b_up = T("ffn_up.bias", r->n_ff, 1);
        L->down = T("ffn_down.weight", r->n_ff, d);
        L->b_down = T("ffn_down.bias", d, 1);
#undef T
        assert_non_null(L->wq);
        assert_non_null(L->wo);
        assert_non_null(L->down);
    }
    gguf_close(f);
}

AR_FN void ref_free(struct ref_model *r)
{
    for (int l = 0; l < r->n_layer; l++) {
        struct ref_layer *L = &r->L[l];
        float *ps[] = {L->attn_norm, L->attn_norm_b, L->ffn_norm, L->ffn_norm_b, L->wq,    L->wk,
                       L->wv,        L->wo,          L->bq,       L->bk,         L->bv,    L->bo,
                       L->gate,      L->up,          L->down,     L->b_up,       L->b_down,
                       L->q_norm,    L->k_norm,      L->post_attn, L->post_ffn};
        for (size_t i = 0; i < sizeof(ps) / sizeof(ps[0]); i++)
            free(ps[i]);
    }
    free(r->L);
    free(r->embd);
    free(r->tok_norm);
    free(r->tok_norm_b);
    free(r->out);
    free(r->out_norm);
    free(r->out_norm_b);
    free(r->slopes);
    free(r->t5);
    free(r->rope_ff);
}

/*
 * When set, RMSNorm rounds x / rms to f32 before the weight multiplies it
 * (two f32 steps, as ggml's rms_norm then mul), the way test_model's
 * reference always has; unset (test_arch's), the whole norm stays in
 * double. LayerNorm is always in double.
 */
static bool ref_rms_round_f32;

/* The model's norm, in double: RMSNorm * w, or LayerNorm * w + b. */
AR_FN void ref_norm(const struct ref_model *r, float *o, const float *x, const float *w,
                     const float *b)
{
    int n = r->d;
    double mean = 0.0, var = 0.0;
    if (r->layernorm) {
        for (int i = 0; i < n; i++)
            mean += x[i];
        mean /= n;
    }
    for (int i = 0; i < n; i++)
        var += ((double)x[i] - mean) * ((double)x[i] - mean);
    double s = 1.0 / sqrt(var / n + r->eps);
    if (ref_rms_round_f32 && !r->layernorm && !b) {
        for (int i = 0; i < n; i++)
            o[i] = (float)(x[i] * s) * w[i];
        return;
    }
    for (int i = 0; i < n; i++)
        o[i] = (float)(((double)x[i] - mean) * s * w[i] + (b ? b[i] : 0.0));
}

/*
 * When set, ref_matvec first rounds its input as the products do, so the
 * reference differs from kvd only by summation order: REF_ROUND_Q8 to 8
 * bits per block of 32 (scale max|x|/127, round to nearest) as quant.h
 * says quantised products do; REF_ROUND_BF16 each value to bf16, as the
 * avx512bf16 products over bf16 weights do (model/matmul_bf16.c).
 */
enum { REF_ROUND_NONE, REF_ROUND_Q8, REF_ROUND_BF16 };
static int ref_round_act;

/* o[n_out] = W[n_out][n_in] x + b, accumulated in double. */
AR_FN void ref_matvec(float *o, const float *W, const float *b, const float *x, int n_out,
                       int n_in)
{
    float *xq = NULL;
    if (ref_round_act) {
        xq = malloc(sizeof(float) * (size_t)n_in);
        assert_non_null(xq);
        memcpy(xq, x, sizeof(float) * (size_t)n_in);
        for (int i = 0; ref_round_act == REF_ROUND_BF16 && i < n_in; i++)
            xq[i] = qt_bf16_to_f32(qt_f32_to_bf16(xq[i]));
        for (int i0 = 0; ref_round_act == REF_ROUND_Q8 && i0 < n_in; i0 += 32) {
            float amax = 0.0f;
            for (int i = i0; i < i0 + 32; i++)
                amax = fabsf(xq[i]) > amax ? fabsf(xq[i]) : amax;
            float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
            for (int i = i0; i < i0 + 32; i++)
                xq[i] = rintf(xq[i] * id) * d;
        }
        x = xq;
    }
    for (int r = 0; r < n_out; r++) {
        double s = b ? b[r] : 0.0;
        for (int i = 0; i < n_in; i++)
            s += (double)W[(size_t)r * n_in + i] * x[i];
        o[r] = (float)s;
    }
    free(xq);
}

/*
 * Rotate one head's vector by position delta (may be negative). Pair i
 * turns by delta * f_i, f_i = theta^(-2i/n_rot) / rope_freqs[i]; linear
 * scaling takes fscale * that. YaRN, as ggml's rope_yarn: the
 * interpolated angle fscale * a and the extrapolated angle a are mixed by
 * a ramp that is 1 below pair lo (turning more than 32 times over the
 * original context) and 0 above pair hi (fewer than once), and with
 * mscale the rotated values are multiplied by 1 + 0.1 ln(1 / fscale): done
 * once, when a vector is first rotated, never when a stored key is turned
 * again.
 */
AR_FN void ref_rope_base(const struct ref_model *r, float *x, double delta, bool mscale,
                          double theta, double fscale)
{
    int half = r->n_rot / 2;
    double lo = 0, hi = 0, ms = 1;
    if (r->yarn) {
        double b = log(theta), n = r->n_rot;
        lo = floor(n * log(r->yarn_orig / (32 * 2 * M_PI)) / (2 * b));
        hi = ceil(n * log(r->yarn_orig / (1 * 2 * M_PI)) / (2 * b));
        lo = fmax(0, lo);
        hi = fmin(n - 1, hi);
        ms = mscale ? 1 + 0.1 * log(1.0 / r->fscale) : 1;
    }
    if (mscale)
        ms *= r->amp;
    for (int i = 0; i < half; i++) {
        double freq = pow(theta, -2.0 * i / r->n_rot);
        if (r->rope_ff)
            freq /= r->rope_ff[i];
        double extrap = delta * freq, ang = fscale * extrap;
        if (r->yarn) {
            double y = (i - lo) / fmax(0.001, hi - lo);
            double mix = 1 - fmin(1, fmax(0, y));
            ang = ang * (1 - mix) + extrap * mix;
        }
        double c = cos(ang) * ms, s = sin(ang) * ms;
        int a = r->neox ? i : 2 * i, b = r->neox ? i + half : 2 * i + 1;
        double x0 = x[a], x1 = x[b];
        x[a] = (float)(x0 * c - x1 * s);
        x[b] = (float)(x0 * s + x1 * c);
    }
}

AR_FN void ref_rope_ex(const struct ref_model *r, float *x, double delta, bool mscale)
{
    ref_rope_base(r, x, delta, mscale, r->theta, r->fscale);
}

AR_FN void ref_rope(const struct ref_model *r, float *x, double delta)
{
    ref_rope_ex(r, x, delta, false);
}

/* Layer l's rotation: Gemma 3's local layers turn with their own base. */
AR_FN void ref_rope_layer(const struct ref_model *r, int l, float *x, double delta, bool mscale)
{
    if (r->L[l].local_rope)
        ref_rope_base(r, x, delta, mscale, r->theta_local, 1.0);
    else
        ref_rope_ex(r, x, delta, mscale);
}

/* Qwen3: RMSNorm of each head of x (n_heads of hd) with the shared weight w. */
AR_FN void ref_head_norm(const struct ref_model *r, float *x, const float *w, int n_heads)
{
    for (int h = 0; w && h < n_heads; h++) {
        float *v = x + (size_t)h * r->hd;
        double ss = 0;
        for (int e = 0; e < r->hd; e++)
            ss += (double)v[e] * v[e];
        double inv = 1.0 / sqrt(ss / r->hd + r->eps);
        for (int e = 0; e < r->hd; e++)
            v[e] = (float)(v[e] * inv * w[e]);
    }
}

AR_FN void ref_clamp(float *x, int n, float c)
{
    for (int i = 0; c > 0.0f && i < n; i++)
        x[i] = x[i] < -c ? -c : x[i] > c ? c : x[i];
}

AR_FN float round_f16(float x)
{
    return qt_f16_to_f32(qt_f32_to_f16(x));
}

/* The bias of key position pk for a query at pq, head h, materialised
 * (none with RoPE, which rotates q and k instead). */
AR_FN double ref_bias(const struct ref_model *r, int h, int32_t pk, int32_t pq)
{
    int64_t offset = (int64_t)pk - pq; /* key - query: negative looks back */
    if (r->pos == POS_ROPE)
        return 0.0;
    if (r->pos == POS_ALIBI)
        return r->slopes[h] * (double)offset;
    return r->t5[(size_t)h * r->nb + pos_t5_bucket(offset, false, r->nb, r->md)];
}

/*
 * The reference's cache of one sequence: K and V as produced, rounded to
 * f16 when f16, and a position per entry. With RoPE, llama.cpp style:
 * keys are stored rotated by the position they had when stored, and
 * eviction re-rotates the survivors in place by their position change.
 */
struct ref_seq {
    int n, cap;
    bool f16;
    int32_t *pos, *hidx;
    float *k, *v; /* [n_layer][cap][kv_dim] */
    float *unrot; /* [n_layer][cap][kv_dim] the keys before rotation, exact (drift) */
};

AR_FN void ref_seq_init(struct ref_seq *s, const struct ref_model *r, int cap, bool f16)
{
    memset(s, 0, sizeof(*s));
    s->cap = cap;
    s->f16 = f16;
    size_t kv = (size_t)r->n_layer * cap * r->n_kv * r->hd;
    s->pos = calloc((size_t)cap, sizeof(int32_t));
    s->hidx = calloc((size_t)cap, sizeof(int32_t));
    s->k = calloc(kv, sizeof(float));
    s->v = calloc(kv, sizeof(float));
    s->unrot = calloc(kv, sizeof(float));
    assert_true(s->pos && s->hidx && s->k && s->v && s->unrot);
}

AR_FN void ref_seq_free(struct ref_seq *s)
{
    free(s->pos);
    free(s->hidx);
    free(s->k);
    free(s->v);
    free(s->unrot);
}

AR_FN float *ref_kv(const struct ref_model *r, const struct ref_seq *s, float *base, int l, int i)
{
    return base + ((size_t)l * s->cap + i) * (size_t)r->n_kv * r->hd;
}

/*
 * Keep the entries whose history index is in keep_hidx (ascending) and give
 * them the positions new_pos. With RoPE the rotated keys turn by the
 * position change (rounded to f16 again when f16); with an offset-only
 * bias nothing else changes. Returns how many entries were re-rotated.
 */
AR_FN int ref_seq_evict(const struct ref_model *r, struct ref_seq *s, const int32_t *keep_hidx,
                         const int32_t *new_pos, int n_keep)
{
    int w = 0, j = 0, rerot = 0, kvd = r->n_kv * r->hd;
    bool rope = r->pos == POS_ROPE;
    for (int i = 0; i < s->n && j < n_keep; i++) {
        if (s->hidx[i] != keep_hidx[j])
            continue;
        int delta = new_pos[j] - s->pos[i];
        for (int l = 0; l < r->n_layer; l++) {
            float *k = ref_kv(r, s, s->k, l, i);
            for (int h = 0; rope && delta != 0 && h < r->n_kv; h++) {
                ref_rope_layer(r, l, k + h * r->hd, delta, false);
                if (s->f16)
                    for (int e = 0; e < r->hd; e++)
                        k[h * r->hd + e] = round_f16(k[h * r->hd + e]);
            }
            if (w != i) {
                memcpy(ref_kv(r, s, s->k, l, w), k, sizeof(float) * kvd);
                memcpy(ref_kv(r, s, s->v, l, w), ref_kv(r, s, s->v, l, i), sizeof(float) * kvd);
                memcpy(ref_kv(r, s, s->unrot, l, w), ref_kv(r, s, s->unrot, l, i),
                       sizeof(float) * kvd);
            }
        }
        rerot += rope && delta != 0;
        s->pos[w] = new_pos[j];
        s->hidx[w] = s->hidx[i];
        w++;
        j++;
    }
    assert_int_equal(j, n_keep);
    s->n = w;
    return rerot;
}

/*
 * One token through the reference: stores its K/V at pos and, if logits is
 * non-NULL, writes the next-token logits.
 */
AR_FN void ref_step(const struct ref_model *r, struct ref_seq *s, int32_t token, int32_t pos,
                     int32_t hidx, float *logits)
{
    int d = r->d, hd = r->hd, qd = r->n_head * hd, kvd = r->n_kv * hd, ff = r->n_ff;
    assert_true(s->n < s->cap);
    float *x = malloc(sizeof(float) * d), *xb = malloc(sizeof(float) * d);
    float *q = malloc(sizeof(float) * qd), *att = malloc(sizeof(float) * qd);
    float *hb = malloc(sizeof(float) * ff), *hb2 = malloc(sizeof(float) * ff);
    double *sc = malloc(sizeof(double) * (size_t)(s->n + 1));
    for (int i = 0; i < d; i++)
        x[i] = (float)(r->embd[(size_t)token * d + i] * r->emb_scale);
    if (r->tok_norm)
        ref_norm(r, x, x, r->tok_norm, r->tok_norm_b);
    int me = s->n++;
    s->pos[me] = pos;
    s->hidx[me] = hidx;
    for (int l = 0; l < r->n_layer; l++) {
        const struct ref_layer *L = &r->L[l];
        ref_norm(r, xb, x, L->attn_norm, L->attn_norm_b);
        ref_matvec(q, L->wq, L->bq, xb, qd, d);
        float *k = ref_kv(r, s, s->k, l, me), *v = ref_kv(r, s, s->v, l, me);
        ref_matvec(k, L->wk, L->bk, xb, kvd, d);
        ref_matvec(v, L->wv, L->bv, xb, kvd, d);
        ref_clamp(q, qd, r->clamp);
        ref_clamp(k, kvd, r->clamp);
        ref_clamp(v, kvd, r->clamp);
        ref_head_norm(r, q, L->q_norm, r->n_head);
        ref_head_norm(r, k, L->k_norm, r->n_kv);
        memcpy(ref_kv(r, s, s->unrot, l, me), k, sizeof(float) * kvd);
        for (int h = 0; r->pos == POS_ROPE && h < r->n_head; h++)
            ref_rope_layer(r, l, q + h * hd, pos, true);
        for (int h = 0; r->pos == POS_ROPE && h < r->n_kv; h++)
            ref_rope_layer(r, l, k + h * hd, pos, true);
        if (s->f16)
            for (int e = 0; e < kvd; e++) {
                k[e] = round_f16(k[e]);
                v[e] = round_f16(v[e]);
            }
        /* Attention: scores and biases materialised, causal by position. */
        int group = r->n_head / r->n_kv;
        for (int h = 0; h < r->n_head; h++) {
            int kh = h / group;
            double mx = -INFINITY;
            for (int j = 0; j < s->n; j++) {
                sc[j] = -INFINITY;
                if (s->pos[j] > pos || (L->window && pos - s->pos[j] >= L->window))
                    continue;
                const float *kj = ref_kv(r, s, s->k, l, j) + kh * hd;
                double dot = 0;
                for (int e = 0; e < hd; e++)
                    dot += (double)q[h * hd + e] * kj[e];
                double z = dot / sqrt((double)hd);
                if (r->attn_cap > 0) /* Gemma 2: logits squashed before the softmax */
                    z = tanh(z / r->attn_cap) * r->attn_cap;
                sc[j] = z + ref_bias(r, h, s->pos[j], pos);
                mx = sc[j] > mx ? sc[j] : mx;
            }
            double sum = 0;
            for (int j = 0; j < s->n; j++) {
                sc[j] = sc[j] == -INFINITY ? 0.0 : exp(sc[j] - mx);
                sum += sc[j];
            }
            for (int e = 0; e < hd; e++) {
                double o = 0;
                for (int j = 0; j < s->n; j++)
                    o += sc[j] * ref_kv(r, s, s->v, l, j)[kh * hd + e];
                att[h * hd + e] = (float)(o / sum);
            }
        }
        ref_matvec(xb, L->wo, L->bo, att, d, qd);
        if (L->post_attn)
            ref_norm(r, xb, xb, L->post_attn, NULL);
        for (int i = 0; i < d; i++)
            x[i] += xb[i];
        ref_norm(r, xb, x, L->ffn_norm, L->ffn_norm_b);
        if (r->act == REF_SWIGLU) {
            ref_matvec(hb, L->gate, NULL, xb, ff, d);
            ref_matvec(hb2, L->up, NULL, xb, ff, d);
            for (int i = 0; i < ff; i++)
                hb[i] = (float)(hb[i] / (1.0 + exp(-(double)hb[i])) * hb2[i]);
        } else if (r->act == REF_GEGLU) { /* gelu_pytorch_tanh(gate) * up */
            ref_matvec(hb, L->gate, NULL, xb, ff, d);
            ref_matvec(hb2, L->up, NULL, xb, ff, d);
            for (int i = 0; i < ff; i++) {
                double g = hb[i], c = sqrt(2.0 / M_PI) * (g + 0.044715 * g * g * g);
                hb[i] = (float)(0.5 * g * (1.0 + tanh(c)) * hb2[i]);
            }
        } else {
            ref_matvec(hb, L->up, L->b_up, xb, ff, d);
            for (int i = 0; i < ff; i++) {
                double u = hb[i];
                hb[i] = r->act == REF_GELU_ERF
                            ? (float)(0.5 * u * (1.0 + erf(u / sqrt(2.0))))
                            : (float)(0.5 * u *
                                      (1.0 + tanh(sqrt(2.0 / M_PI) * (u + 0.044715 * u * u * u))));
            }
        }
        ref_matvec(xb, L->down, L->b_down, hb, d, ff);
        if (L->post_ffn)
            ref_norm(r, xb, xb, L->post_ffn, NULL);
        for (int i = 0; i < d; i++)
            x[i] += xb[i];
    }
    if (logits) {
        ref_norm(r, xb, x, r->out_norm, r->out_norm_b);
        ref_matvec(logits, r->out, NULL, xb, r->n_vocab, d);
        for (int i = 0; r->final_cap > 0 && i < r->n_vocab; i++)
            logits[i] = (float)(tanh(logits[i] / r->final_cap) * r->final_cap);
    }
    free(x);
    free(xb);
    free(q);
    free(att);
    free(hb);
    free(hb2);
    free(sc);
}

/* Logits of a fresh reference sequence fed toks[i] at pos[i]. */
AR_FN void ref_fresh(const struct ref_model *r, const int32_t *toks, const int32_t *pos, int n,
                      float *logits)
{
    struct ref_seq s;
    ref_seq_init(&s, r, n, false);
    for (int i = 0; i < n; i++)
        ref_step(r, &s, toks[i], pos[i], i, i == n - 1 ? logits : NULL);
    ref_seq_free(&s);
}

/* Comparisons of the last check_against_reference: all, and within 1e-4. */
static int n_checks, n_tight;

/*
 * Three sequences fed in mixed batches (prefill chunks beside single decode
 * tokens), each step's logits compared with the reference fed the same
 * tokens one at a time. Returns the largest difference relative to the
 * largest reference logit.
 */
AR_FN float check_against_reference(const char *path, enum kv_type kvt, int threads)
{
    n_checks = n_tight = 0;
    model *m = load_model(path);
    struct ref_model r;
    ref_load(&r, path);
    assert_int_equal(r.n_vocab, m->n_vocab);
    int nv = m->n_vocab;

    enum { NS = 3, NSTEP = 4 };
    /* Tokens per sequence per step: prefill chunks, then decode tokens. */
    static const int plan[NSTEP][NS] = {{7, 13, 1}, {1, 5, 1}, {1, 1, 9}, {3, 1, 1}};
    kv_cache *cache = make_cache(m, kvt, 16, 200);
    struct kv_policy pol = policy_none(64);
    kv_seq *seq[NS];
    struct ref_seq rs[NS];
    int32_t toks[NS][64];
    int fed[NS] = {0};
    for (int s = 0; s < NS; s++) {
        seq[s] = make_seq(cache, &pol);
        ref_seq_init(&rs[s], &r, 64, kvt == KV_F16);
        fill_tokens(toks[s], 64, nv, 100 + (uint32_t)s);
    }
    model_ctx *ctx = make_ctx(m, 32, threads);
    float *lg = malloc(sizeof(float) * NS * nv), *ref = malloc(sizeof(float) * nv);
    float worst = 0.0f;
    for (int step = 0; step < NSTEP; step++) {
        struct model_batch_seq b[NS];
        /* Step 1 asks no logits of the middle sequence (a prefill chunk
         * mid-prompt): the last layer then runs for the other rows only. */
        for (int s = 0; s < NS; s++)
            b[s] = (struct model_batch_seq){.seq = seq[s],
                                            .tokens = toks[s] + fed[s],
                                            .n_tokens = plan[step][s],
                                            .logits = step == 1 && s == 1 ? NULL : lg + s * nv};
        assert_int_equal(model_reserve_forward(ctx, b, NS, NULL), 0);
        for (int s = 0; s < NS; s++) {
            const int32_t *pos = kv_seq_positions(seq[s]);
            for (int i = 0; i < plan[step][s]; i++) {
                int idx = fed[s] + i;
                ref_step(&r, &rs[s], toks[s][idx], pos[idx], idx,
                         i == plan[step][s] - 1 ? ref : NULL);
            }
            fed[s] += plan[step][s];
            assert_int_equal(kv_seq_n_tokens(seq[s]), fed[s]);
            if (!b[s].logits)
                continue;
            float e = rel_diff(lg + s * nv, ref, nv);
            n_tight += e < 1e-4f;
            n_checks++;
            worst = e > worst ? e : worst;
        }
    }
    free(lg);
    free(ref);
    model_ctx_destroy(ctx);
    for (int s = 0; s < NS; s++) {
        kv_seq_destroy(seq[s]);
        ref_seq_free(&rs[s]);
    }
    kv_cache_destroy(cache);
    ref_free(&r);
    model_free(m);
    return worst;
}

/*
 * The model p describes, with f32 and with f16 weights (p.type is set), by
 * 1 and 3 threads: check_against_reference within 1e-5, each line printed
 * under name.
 */
AR_FN void forward_vs_reference_types(const char *name, struct model_mk_params p)
{
    for (int t = 0; t < 2; t++) {
        p.type = t ? GGML_TYPE_F16 : GGML_TYPE_F32;
        char path[512];
        write_model(&p, "ref.gguf", path, sizeof(path));
        for (int threads = 1; threads <= 3; threads += 2) {
            float e = check_against_reference(path, KV_F32, threads);
            print_message("  %-18s %s weights, %d threads: max rel diff %.2e (%d/%d within "
                          "1e-4)\n",
                          name, t ? "f16" : "f32", threads, e, n_tight, n_checks);
            assert_true(e < 1e-5f);
        }
    }
}

/* ------------------------------------------------------------------------
 * Eviction against the reference (ARCHITECTURE.md Invariant 3)
 * ------------------------------------------------------------------------ */

AR_FN struct kv_policy sink_window(bool renumber)
{
    /* 4-token pages: 4 sinks (one page), a 16-token window, budget 24. */
    return (struct kv_policy){.kind = KV_EVICT_SINK_WINDOW,
                              .max_cache_tokens = 24,
                              .sink_tokens = 4,
                              .window_tokens = 16,
                              .renumber = renumber};
}

/*
 * (2) Many layers: kvd against the reference, decode token by token through
 * sink-window evictions. kv_seq_hist_index tells which entries survived;
 * the reference drops the others and takes the new positions (renumbered
 * or preserved) - it never touches a K or V, and neither does kvd.
 */
AR_FN float evict_vs_reference(const char *path, bool renumber, enum kv_type kvt, int steps,
                                uint32_t seed, int *evictions)
{
    model *m = load_model(path);
    struct ref_model r;
    ref_load(&r, path);
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, kvt, 4, 64);
    struct kv_policy pol = sink_window(renumber);
    kv_seq *seq = make_seq(cache, &pol);
    struct ref_seq rs;
    ref_seq_init(&rs, &r, pol.max_cache_tokens + 1, kvt == KV_F16);
    model_ctx *ctx = make_ctx(m, 4, 2);
    float *lg = malloc(sizeof(float) * nv), *ref = malloc(sizeof(float) * nv);
    float worst = 0.0f;
    int32_t tok = 1;
    uint32_t st = seed;
    for (int fed = 0; fed < steps; fed++) {
        struct model_batch_seq b = {.seq = seq, .tokens = &tok, .n_tokens = 1, .logits = lg};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        int n = kv_seq_n_tokens(seq);
        const int32_t *hidx = kv_seq_hist_index(seq);
        const int32_t *pos = kv_seq_positions(seq);
        assert_int_equal(hidx[n - 1], fed);
        ref_seq_evict(&r, &rs, hidx, pos, n - 1);
        ref_step(&r, &rs, tok, pos[n - 1], fed, ref);
        float e = rel_diff(lg, ref, nv);
        worst = e > worst ? e : worst;
        st = st * 1664525u + 1013904223u;
        tok = 3 + (int32_t)((st >> 8) % (uint32_t)(nv - 3));
    }
    struct kv_stats ks;
    kv_cache_stats(cache, &ks);
    *evictions = (int)ks.evictions;
    free(lg);
    free(ref);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    ref_seq_free(&rs);
    ref_free(&r);
    model_free(m);
    return worst;
}

/*
 * The model p describes, written as name, through 90 decode steps of
 * sink-window evictions with renumbered and with preserved positions (f32
 * K/V: with f16 the reference rounds its re-rotated keys again, a drift
 * of its own): at least 15 evictions, logits within 1e-5 of the reference.
 */
AR_FN void evict_both_ways(const char *name, const struct model_mk_params *p, uint32_t seed)
{
    char path[512];
    write_model(p, "evict.gguf", path, sizeof(path));
    for (int k = 0; k < 2; k++) {
        int ev = 0;
        float e = evict_vs_reference(path, k == 0, KV_F32, 90, seed, &ev);
        print_message("  %-18s %s, f32 KV: %d evictions, max rel logit diff %.2e\n", name,
                      k == 0 ? "renumber" : "preserve", ev, e);
        assert_true(ev >= 15);
        assert_true(e < 1e-5f);
    }
}

/* Logits of the reference fed n (<= 64) seeded tokens at positions 0..n-1. */
AR_FN void ref_logits_seeded(const struct ref_model *r, int n, uint32_t seed, float *out)
{
    int32_t toks[64], pos[64];
    assert_true(n <= 64);
    fill_tokens(toks, n, r->n_vocab, seed);
    for (int i = 0; i < n; i++)
        pos[i] = i;
    ref_fresh(r, toks, pos, n, out);
}

/*
 * Whether a part of an architecture matters: how far the reference's
 * logits for n seeded tokens move when cut(r, path, ctx) takes the part
 * out of the reference of the model p describes (written to path): the
 * relative difference, printed under `what`. A test asserts it is well
 * above the forward's tolerance against the reference, so a forward that
 * ignored the part could not pass.
 */
AR_FN float ref_part_effect(const struct model_mk_params *p, const char *what, int n, uint32_t seed,
                            void (*cut)(struct ref_model *r, const char *path, void *ctx),
                            void *ctx)
{
    char path[512];
    write_model(p, "parts.gguf", path, sizeof(path));
    struct ref_model r;
    ref_load(&r, path);
    float *a = malloc(sizeof(float) * r.n_vocab), *b = malloc(sizeof(float) * r.n_vocab);
    assert_non_null(a);
    assert_non_null(b);
    ref_logits_seeded(&r, n, seed, a);
    cut(&r, path, ctx);
    ref_logits_seeded(&r, n, seed, b);
    float e = rel_diff(a, b, r.n_vocab);
    print_message("  without the %-26s the logits move by %.2e\n", what, e);
    free(a);
    free(b);
    ref_free(&r);
    return e;
}

/*
 * kvd's logits (into out, [n_vocab]) after n (<= 64) seeded tokens read in
 * one forward pass of the model file at path, f32 KV, `threads` threads;
 * returns the largest of them in magnitude.
 */
AR_FN float forward_logits(const char *path, int n, uint32_t seed, int threads, float *out)
{
    model *m = load_model(path);
    kv_cache *cache = make_cache(m, KV_F32, 16, 64);
    struct kv_policy pol = policy_none(64);
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, n, threads);
    int32_t t[64];
    assert_true(n <= 64);
    fill_tokens(t, n, m->n_vocab, seed);
    struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = n, .logits = out};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    float mx = max_abs(out, m->n_vocab);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
    return mx;
}

/* ------------------------------------------------------------------------
 * GGUF surgery for hostile files and hand-set tables
 * ------------------------------------------------------------------------ */

struct kv_set {
    const char *key;     /* NULL: unused */
    enum gguf_type type; /* STRING, FLOAT32, UINT32 or INT32 */
    const char *s;
    float f;
    int64_t i;
};

struct mutation {
    const char *drop_key;       /* metadata key left out */
    const char *drop_tensor;    /* tensor left out */
    struct kv_set set[3];       /* keys set (added or replaced) after copying */
    const char *clone_tensor;   /* add a copy of this tensor ... */
    const char *clone_as;       /* ... under this name */
    const char *replace_tensor; /* an f32 tensor whose data becomes replace_data */
    const float *replace_data;
    const char *reshape_tensor; /* same bytes, shape [reshape_ne0, reshape_ne1] */
    uint64_t reshape_ne0, reshape_ne1;
};

/* Copy src to dst with the mutation applied. */
AR_FN void mutate(const char *src, const char *dst, const struct mutation *mu)
{
    char err[256];
    gguf_file *f = gguf_open(src, err, sizeof(err));
    assert_non_null(f);
    gguf_writer *w = gguf_writer_create();
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        const char *key = gguf_kv_key(f, i);
        enum gguf_type t = gguf_kv_type(f, i);
        if (mu->drop_key && !strcmp(key, mu->drop_key))
            continue;
        if (t == GGUF_TYPE_STRING) {
            const char *s;
            size_t n;
            assert_int_equal(gguf_get_str(f, key, &s, &n), 0);
            char *c = strndup(s, n);
            assert_int_equal(gguf_writer_set_str(w, key, c), 0);
            free(c);
        } else if (t == GGUF_TYPE_ARRAY) {
            enum gguf_type et;
            uint64_t n;
            const void *data;
            assert_int_equal(gguf_get_arr(f, key, &et, &n, &data), 0);
            if (et == GGUF_TYPE_STRING) {
                char **v = calloc(n, sizeof(char *));
                for (uint64_t j = 0; j < n; j++) {
                    const char *s;
                    size_t len;
                    assert_int_equal(gguf_get_arr_str(f, key, j, &s, &len), 0);
                    v[j] = strndup(s, len);
                }
                assert_int_equal(gguf_writer_set_arr_str(w, key, (const char *const *)v, n), 0);
                for (uint64_t j = 0; j < n; j++)
                    free(v[j]);
                free(v);
            } else {
                assert_int_equal(gguf_writer_set_arr(w, key, et, data, n), 0);
            }
        } else if (t == GGUF_TYPE_FLOAT32) {
            float v;
            assert_int_equal(gguf_get_f32(f, key, &v), 0);
            assert_int_equal(gguf_writer_set_f32(w, key, v), 0);
        } else if (t == GGUF_TYPE_BOOL) {
            bool v;
            assert_int_equal(gguf_get_bool(f, key, &v), 0);
            assert_int_equal(gguf_writer_set_bool(w, key, v), 0);
        } else {
            int64_t v;
            assert_int_equal(gguf_get_i64(f, key, &v), 0);
            assert_int_equal(gguf_writer_set_u32(w, key, (uint32_t)v), 0);
        }
    }
    for (int k = 0; k < 3; k++) {
        const struct kv_set *s = &mu->set[k];
        if (!s->key)
            continue;
        int rc = s->type == GGUF_TYPE_STRING    ? gguf_writer_set_str(w, s->key, s->s)
                 : s->type == GGUF_TYPE_FLOAT32 ? gguf_writer_set_f32(w, s->key, s->f)
                 : s->type == GGUF_TYPE_INT32   ? gguf_writer_set_i32(w, s->key, (int32_t)s->i)
                                                : gguf_writer_set_u32(w, s->key, (uint32_t)s->i);
        assert_int_equal(rc, 0);
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        uint64_t ne[4] = {t->ne[0], t->ne[1], t->ne[2], t->ne[3]};
        const void *data = t->data;
        if (mu->replace_tensor && !strcmp(t->name, mu->replace_tensor)) {
            assert_int_equal(t->type, GGML_TYPE_F32);
            data = mu->replace_data;
        }
        if (mu->reshape_tensor && !strcmp(t->name, mu->reshape_tensor)) {
            ne[0] = mu->reshape_ne0;
            ne[1] = mu->reshape_ne1;
        }
        if (mu->clone_tensor && !strcmp(t->name, mu->clone_tensor))
            assert_int_equal(
                gguf_writer_add_tensor(w, mu->clone_as, t->type, t->n_dims, ne, data, t->size), 0);
        if (mu->drop_tensor && !strcmp(t->name, mu->drop_tensor))
            continue;
        assert_int_equal(gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, ne, data, t->size),
                         0);
    }
    assert_int_equal(gguf_writer_write(w, dst, err, sizeof(err)), 0);
    gguf_writer_destroy(w);
    gguf_close(f);
}

/* Load must fail with a message containing `want` (and the override
 * params, when given). */
AR_FN void expect_load_error_p(const char *path, const struct model_params *over, const char *want)
{
    char err[512] = "";
    struct model_params mp = over ? *over : (struct model_params){0};
    mp.path = path;
    model *m = model_load(&mp, err, sizeof(err));
    if (m || !strstr(err, want))
        print_message("load of %s: got '%s', want '%s'\n", path, err, want);
    else
        print_message("  rejected: %s\n", strstr(err, ": ") ? strstr(err, ": ") + 2 : err);
    model_free(m);
    assert_null(m);
    assert_non_null(strstr(err, want));
}

AR_FN void expect_load_error(const char *path, const char *want)
{
    expect_load_error_p(path, NULL, want);
}

#endif /* KVD_TESTS_ARCH_REF_H */
