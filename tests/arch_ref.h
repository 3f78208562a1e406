/*
 * arch_ref.h - the plain reference forward of test_arch.c, and GGUF
 * surgery for its hostile files.
 *
 * The reference reads a BLOOM, MPT or llama-shaped ALiBi / T5-bias GGUF on
 * its own (metadata keys and tensor names, the fused QKV split by rows),
 * computes ALiBi slopes from the ALiBi paper's and MPT's formulas rather
 * than posenc's, and runs one token at a time in double precision with
 * every score and bias materialised from the position numbers (T5 buckets
 * by posenc's pos_t5_bucket, which test_attention checks against Hugging
 * Face's). Its cache holds K and V as produced; eviction only drops
 * entries and sets positions, since an offset-only bias needs nothing
 * else.
 *
 * Include after <cmocka.h> and model/model_internal.h; everything here is
 * static, for the one program that includes it.
 */
#ifndef KVD_TESTS_ARCH_REF_H
#define KVD_TESTS_ARCH_REF_H

/* ------------------------------------------------------------------------
 * ALiBi slopes, as the papers write them
 * ------------------------------------------------------------------------ */

/*
 * BLOOM's build_alibi_tensor / the ALiBi paper: with p the largest power of
 * two <= n, slopes (2^(-8/p))^k for k = 1..p, then for the remaining
 * n - p heads the odd powers of 2^(-4/p).
 */
static void bloom_slopes(double *s, int n)
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
static void mpt_slopes(double *s, int n, double max_bias)
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
};

enum ref_act { REF_SWIGLU, REF_GELU_TANH, REF_GELU_ERF };

struct ref_model {
    int n_vocab, d, n_layer, n_head, n_kv, hd, n_ff;
    bool layernorm;
    enum ref_act act;
    enum pos_kind pos;
    float eps, clamp;
    double *slopes; /* ALiBi [n_head] */
    float *t5;      /* T5 [n_head][nb] */
    int nb, md;
    float *embd, *tok_norm, *tok_norm_b, *out_norm, *out_norm_b, *out;
    struct ref_layer *L;
};

/* A whole tensor dequantised to f32 rows, or NULL when absent. */
static float *ref_tensor(const gguf_file *f, const char *name, int ne0, int ne1)
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

static float *rows_copy(const float *w, int row0, int n_rows, int n_in)
{
    float *o = malloc(sizeof(float) * (size_t)n_rows * n_in);
    assert_non_null(o);
    memcpy(o, w + (size_t)row0 * n_in, sizeof(float) * (size_t)n_rows * n_in);
    return o;
}

static int ref_meta_int(const gguf_file *f, const char *key, int def)
{
    int64_t v;
    return gguf_get_i64(f, key, &v) ? def : (int)v;
}

static float ref_meta_f32(const gguf_file *f, const char *key, float def)
{
    float v;
    return gguf_get_f32(f, key, &v) ? def : v;
}

static void ref_load(struct ref_model *r, const char *path)
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
    r->hd = r->d / r->n_head;
    r->layernorm = bloom || mpt;
    r->act = bloom ? REF_GELU_TANH : mpt ? REF_GELU_ERF : REF_SWIGLU;
    r->eps = r->layernorm ? ref_meta_f32(f, KEY("attention.layer_norm_epsilon"), -1.0f)
                          : ref_meta_f32(f, KEY("attention.layer_norm_rms_epsilon"), 1e-5f);
    assert_true(r->eps > 0.0f);
    r->clamp = ref_meta_f32(f, KEY("attention.clamp_kqv"), 0.0f);
    float max_bias = ref_meta_f32(f, KEY("attention.max_alibi_bias"), bloom ? 8.0f : -1.0f);
#undef KEY
    const char *kind = "alibi";
    size_t kn = 5;
    if (!bloom && !mpt)
        assert_int_equal(gguf_get_str(f, "kvd.position.kind", &kind, &kn), 0);
    r->pos = kn == 2 && !memcmp(kind, "t5", 2) ? POS_T5 : POS_ALIBI;
    assert_true(r->pos == POS_T5 || (kn == 5 && !memcmp(kind, "alibi", 5)));
    if (r->pos == POS_ALIBI) {
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
        if (r->layernorm) {
            /* The fused matrix, split by rows: Q, then K, then V. */
            float *qkv = T("attn_qkv.weight", d, qd + 2 * kvd);
            float *b = T("attn_qkv.bias", qd + 2 * kvd, 1);
            assert_non_null(qkv);
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
            assert_non_null(L->gate);
        }
        L->wo = T("attn_output.weight", qd, d);
        L->bo = T("attn_output.bias", d, 1);
        L->up = T("ffn_up.weight", d, r->n_ff);
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

static void ref_free(struct ref_model *r)
{
    for (int l = 0; l < r->n_layer; l++) {
        struct ref_layer *L = &r->L[l];
        float *ps[] = {L->attn_norm, L->attn_norm_b, L->ffn_norm, L->ffn_norm_b, L->wq,    L->wk,
                       L->wv,        L->wo,          L->bq,       L->bk,         L->bv,    L->bo,
                       L->gate,      L->up,          L->down,     L->b_up,       L->b_down};
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
}

/* The model's norm, in double: RMSNorm * w, or LayerNorm * w + b. */
static void ref_norm(const struct ref_model *r, float *o, const float *x, const float *w,
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
    for (int i = 0; i < n; i++)
        o[i] = (float)(((double)x[i] - mean) * s * w[i] + (b ? b[i] : 0.0));
}

/* o[n_out] = W[n_out][n_in] x + b, accumulated in double. */
static void ref_matvec(float *o, const float *W, const float *b, const float *x, int n_out,
                       int n_in)
{
    for (int r = 0; r < n_out; r++) {
        double s = b ? b[r] : 0.0;
        for (int i = 0; i < n_in; i++)
            s += (double)W[(size_t)r * n_in + i] * x[i];
        o[r] = (float)s;
    }
}

static void ref_clamp(float *x, int n, float c)
{
    for (int i = 0; c > 0.0f && i < n; i++)
        x[i] = x[i] < -c ? -c : x[i] > c ? c : x[i];
}

static float round_f16(float x)
{
    return qt_f16_to_f32(qt_f32_to_f16(x));
}

/* The bias of key position pk for a query at pq, head h, materialised. */
static double ref_bias(const struct ref_model *r, int h, int32_t pk, int32_t pq)
{
    int64_t offset = (int64_t)pk - pq; /* key - query: negative looks back */
    if (r->pos == POS_ALIBI)
        return r->slopes[h] * (double)offset;
    return r->t5[(size_t)h * r->nb + pos_t5_bucket(offset, false, r->nb, r->md)];
}

/* The reference's cache of one sequence: K and V exactly as produced (no
 * positions baked in), rounded to f16 when f16; a position per entry. */
struct ref_seq {
    int n, cap;
    bool f16;
    int32_t *pos, *hidx;
    float *k, *v; /* [n_layer][cap][kv_dim] */
};

static void ref_seq_init(struct ref_seq *s, const struct ref_model *r, int cap, bool f16)
{
    memset(s, 0, sizeof(*s));
    s->cap = cap;
    s->f16 = f16;
    size_t kv = (size_t)r->n_layer * cap * r->n_kv * r->hd;
    s->pos = calloc((size_t)cap, sizeof(int32_t));
    s->hidx = calloc((size_t)cap, sizeof(int32_t));
    s->k = calloc(kv, sizeof(float));
    s->v = calloc(kv, sizeof(float));
    assert_true(s->pos && s->hidx && s->k && s->v);
}

static void ref_seq_free(struct ref_seq *s)
{
    free(s->pos);
    free(s->hidx);
    free(s->k);
    free(s->v);
}

static float *ref_kv(const struct ref_model *r, const struct ref_seq *s, float *base, int l, int i)
{
    return base + ((size_t)l * s->cap + i) * (size_t)r->n_kv * r->hd;
}

/*
 * Keep the entries whose history index is in keep_hidx (ascending) and give
 * them the positions new_pos: with an offset-only bias nothing else
 * changes.
 */
static void ref_seq_evict(const struct ref_model *r, struct ref_seq *s, const int32_t *keep_hidx,
                          const int32_t *new_pos, int n_keep)
{
    int w = 0, j = 0, kvd = r->n_kv * r->hd;
    for (int i = 0; i < s->n && j < n_keep; i++) {
        if (s->hidx[i] != keep_hidx[j])
            continue;
        for (int l = 0; l < r->n_layer && w != i; l++) {
            memcpy(ref_kv(r, s, s->k, l, w), ref_kv(r, s, s->k, l, i), sizeof(float) * kvd);
            memcpy(ref_kv(r, s, s->v, l, w), ref_kv(r, s, s->v, l, i), sizeof(float) * kvd);
        }
        s->pos[w] = new_pos[j];
        s->hidx[w] = s->hidx[i];
        w++;
        j++;
    }
    assert_int_equal(j, n_keep);
    s->n = w;
}

/*
 * One token through the reference: stores its K/V at pos and, if logits is
 * non-NULL, writes the next-token logits.
 */
static void ref_step(const struct ref_model *r, struct ref_seq *s, int32_t token, int32_t pos,
                     int32_t hidx, float *logits)
{
    int d = r->d, hd = r->hd, qd = r->n_head * hd, kvd = r->n_kv * hd, ff = r->n_ff;
    assert_true(s->n < s->cap);
    float *x = malloc(sizeof(float) * d), *xb = malloc(sizeof(float) * d);
    float *q = malloc(sizeof(float) * qd), *att = malloc(sizeof(float) * qd);
    float *hb = malloc(sizeof(float) * ff), *hb2 = malloc(sizeof(float) * ff);
    double *sc = malloc(sizeof(double) * (size_t)(s->n + 1));
    memcpy(x, r->embd + (size_t)token * d, sizeof(float) * d);
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
                if (s->pos[j] > pos)
                    continue;
                const float *kj = ref_kv(r, s, s->k, l, j) + kh * hd;
                double dot = 0;
                for (int e = 0; e < hd; e++)
                    dot += (double)q[h * hd + e] * kj[e];
                sc[j] = dot / sqrt((double)hd) + ref_bias(r, h, s->pos[j], pos);
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
        for (int i = 0; i < d; i++)
            x[i] += xb[i];
        ref_norm(r, xb, x, L->ffn_norm, L->ffn_norm_b);
        if (r->act == REF_SWIGLU) {
            ref_matvec(hb, L->gate, NULL, xb, ff, d);
            ref_matvec(hb2, L->up, NULL, xb, ff, d);
            for (int i = 0; i < ff; i++)
                hb[i] = (float)(hb[i] / (1.0 + exp(-(double)hb[i])) * hb2[i]);
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
        for (int i = 0; i < d; i++)
            x[i] += xb[i];
    }
    if (logits) {
        ref_norm(r, xb, x, r->out_norm, r->out_norm_b);
        ref_matvec(logits, r->out, NULL, xb, r->n_vocab, d);
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
static void ref_fresh(const struct ref_model *r, const int32_t *toks, const int32_t *pos, int n,
                      float *logits)
{
    struct ref_seq s;
    ref_seq_init(&s, r, n, false);
    for (int i = 0; i < n; i++)
        ref_step(r, &s, toks[i], pos[i], i, i == n - 1 ? logits : NULL);
    ref_seq_free(&s);
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
static void mutate(const char *src, const char *dst, const struct mutation *mu)
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
static void expect_load_error_p(const char *path, const struct model_params *over, const char *want)
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

static void expect_load_error(const char *path, const char *want)
{
    expect_load_error_p(path, NULL, want);
}

#endif /* KVD_TESTS_ARCH_REF_H */
