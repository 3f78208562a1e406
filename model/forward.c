/*
 * forward.c - the batched forward pass of a model (Llama family, BLOOM,
 * MPT) over the paged KV cache.
 *
 * One call takes tokens from several sequences at once (prefill chunks and
 * single decode tokens together) and runs every matrix product over all of
 * them as one matrix-times-matrix: the weights, which dominate memory
 * traffic, are read once per call instead of once per token. Per layer:
 *
 *   xb = Norm(x)                                       [T][n_embd]
 *        (RMSNorm * w for the Llama family; LayerNorm * w + b for BLOOM, MPT)
 *   q, k, v = xb Wq^T (+bq), xb Wk^T (+bk), xb Wv^T (+bv)
 *        (a fused QKV matrix is three row views: model_internal.h)
 *        MPT only: q, k, v clamped to [-clamp_kqv, clamp_kqv]
 *   K and V of every new token -> its sequence's pages (k unrotated)
 *   att = attention over each sequence's cache        [T][n_head*head_dim]
 *         (the fused kernel rotates q and cached k by their positions, or
 *         adds the ALiBi / T5 bias of pos_k - pos_q)
 *   x += att Wo^T (+bo)                   (Gemma: RMSNorm'd first, post_attention_norm)
 *   xb = Norm(x)
 *   x += (silu(xb Wgate^T) * (xb Wup^T)) Wdown^T               SwiGLU, or
 *   x += gelu(xb Wup^T + b_up) Wdown^T + b_down                 GELU MLP, or
 *   x += RMSNorm((gelu(xb Wgate^T) * (xb Wup^T)) Wdown^T)       Gemma (post_ffw_norm)
 *
 * BLOOM also normalises the embedding (LayerNorm) before the first layer;
 * Gemma scales it by sqrt(n_embd). Then the final norm and the output
 * matrix for only the tokens whose logits were asked for (Gemma 2 caps
 * them: 30 tanh(z / 30)). Each layer has its own sliding window (0: none)
 * and, for Gemma 3's local layers, its own RoPE: those run on a second
 * attention context; Gemma 2's attention soft-cap is the context's.
 *
 * Keys go into the cache before rotation (ARCHITECTURE.md Invariant 2), so
 * evicting and renumbering positions never touches them: the kernel rotates
 * by whatever position a key has now. Queries are rotated by the positions
 * the cache assigned to the new tokens. Offset-only biases (ALiBi, T5) need
 * not even that: nothing of them is stored, and nothing of size L x L is
 * ever built; the kernel computes each bias from two position numbers.
 *
 * Memory: every activation buffer is sized for max_batch_tokens in
 * model_ctx_create; model_forward allocates nothing, except that an H2O
 * sequence longer than any seen before grows the attention-mass scratch.
 * Threading: a model_ctx belongs to the engine thread; parallelism is the
 * thread pool (cpu/pool.h) inside the matrix products, the attention kernel
 * and the MLP's element-wise activations.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/pool.h"
#include "model/model_internal.h"
#include "model/ops.h"

/* Rows of logits computed per output-matrix pass. */
#define LOGIT_ROWS 32

struct model_ctx {
    const model *m;
    int max_tokens; /* tokens per call, all sequences together */
    int n_threads;  /* threads of matmuls and attention (0 = default, cpu/pool.h) */
    attn_ctx *attn;       /* every layer's kernel context, but ... */
    attn_ctx *attn_local; /* ... the local_rope layers' (their own RoPE), or NULL */

    /* Activations; T = tokens of the current call. */
    float *x;      /* [T][n_embd] residual stream */
    float *xb;     /* [T][n_embd] normalised input of a sub-layer / its output */
    float *q;      /* [T][q_dim] queries, unrotated */
    float *k;      /* [T][kv_dim] new keys, unrotated */
    float *v;      /* [T][kv_dim] new values */
    float *att;    /* [T][q_dim] attention output */
    float *hb;     /* [T][n_ff] gate, then silu(gate) * up (SwiGLU); up, then gelu(up) */
    float *hb2;    /* [T][n_ff] up (SwiGLU) */
    float *xo;     /* [LOGIT_ROWS][n_embd] final-normed rows that need logits */
    float *lg;     /* [LOGIT_ROWS][n_vocab] logits of those rows */
    void *scratch; /* activation quantisation for mm_matmul_scratch */
    size_t scratch_bytes;

    /* Batch bookkeeping, indexed by token (T) or sequence (<= T). */
    int32_t *tok;          /* [T] token ids in batch order */
    int32_t *qpos;         /* [T] position of each new token */
    int *first;            /* [S] cache index of the sequence's first new token */
    struct kv_reservation *res;    /* [S] model_reserve_forward's reservation */
    struct model_batch_seq *batch; /* [S] ... and its batch with the slots filled in */
    int *sel_seq;          /* [S] sequences that want logits, in batch order */
    int *sel_tok;          /* [S] the token index of each one's last token */
    int *mass_off;         /* [S] offset of the sequence's mass scratch, or -1 */
    int *mass_q;           /* [S] its last queries the mass counts (kv_seq_mass_queries) */
    struct attn_seq *aseq; /* [S] */

    float *mass;     /* attention mass per key, per sequence whose policy scores by it */
    size_t mass_cap; /* floats */
};

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

static void *alloc_floats(size_t n, bool *ok)
{
    void *p = malloc(n * sizeof(float) + 64);
    if (!p)
        *ok = false;
    return p;
}

static void start_threads(void *arg, int t, int nth)
{
    (void)arg;
    (void)t;
    (void)nth;
}

model_ctx *model_ctx_create(const model *m, int max_batch_tokens, int n_threads, char *err,
                            size_t errlen)
{
    if (m->n_layer == 0) {
        snprintf(err, errlen, "the model was loaded vocabulary-only: it has no weights to run");
        return NULL;
    }
    if (max_batch_tokens < 1 || max_batch_tokens > (1 << 20)) {
        snprintf(err, errlen, "max batch tokens must be in [1, 1048576] (got %d)",
                 max_batch_tokens);
        return NULL;
    }
    if (n_threads < 0) {
        snprintf(err, errlen, "threads must be >= 0 (got %d)", n_threads);
        return NULL;
    }
    model_ctx *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    c->m = m;
    c->max_tokens = max_batch_tokens;
    c->n_threads = n_threads;

    struct attn_params ap = {
        .n_head = m->n_head,
        .n_kv_head = m->n_kv_head,
        .head_dim = m->head_dim,
        .scale = m->attn_logit_mul * m->attn_scale,
        .pos = m->pos,
        .softcap = m->attn_softcap,
        .n_threads = n_threads,
    };
    char why[256];
    c->attn = attn_create(&ap, why, sizeof(why));
    bool local = false;
    for (int l = 0; l < m->n_layer; l++)
        local = local || m->layers[l].local_rope;
    ap.pos = m->pos_local;
    if (c->attn && local)
        c->attn_local = attn_create(&ap, why, sizeof(why));
    if (!c->attn || (local && !c->attn_local)) {
        snprintf(err, errlen, "attention: %s", why);
        goto fail;
    }

    size_t T = (size_t)max_batch_tokens;
    size_t rows = T < LOGIT_ROWS ? T : LOGIT_ROWS;
    bool ok = true;
    c->x = alloc_floats(T * m->n_embd, &ok);
    c->xb = alloc_floats(T * m->n_embd, &ok);
    c->q = alloc_floats(T * m->q_dim, &ok);
    c->k = alloc_floats(T * m->kv_dim, &ok);
    c->v = alloc_floats(T * m->kv_dim, &ok);
    c->att = alloc_floats(T * m->q_dim, &ok);
    c->hb = alloc_floats(T * m->n_ff, &ok);
    c->hb2 = alloc_floats(T * m->n_ff, &ok);
    c->xo = alloc_floats(rows * m->n_embd, &ok);
    c->lg = alloc_floats(rows * m->n_vocab, &ok);
    c->tok = malloc(T * sizeof(*c->tok));
    c->qpos = malloc(T * sizeof(*c->qpos));
    c->first = malloc(T * sizeof(*c->first));
    c->res = malloc(T * sizeof(*c->res));
    c->batch = malloc(T * sizeof(*c->batch));
    c->sel_seq = malloc(T * sizeof(*c->sel_seq));
    c->sel_tok = malloc(T * sizeof(*c->sel_tok));
    c->mass_off = malloc(T * sizeof(*c->mass_off));
    c->mass_q = malloc(T * sizeof(*c->mass_q));
    c->aseq = malloc(T * sizeof(*c->aseq));
    if (!ok || !c->tok || !c->qpos || !c->first || !c->res || !c->batch ||
        !c->sel_seq || !c->sel_tok || !c->mass_off || !c->mass_q || !c->aseq) {
        snprintf(err, errlen, "out of memory for a %d-token batch", max_batch_tokens);
        goto fail;
    }

    /* Scratch for quantising activations: the largest any product needs. */
    size_t sb = mm_scratch_bytes(&m->output, (int)rows, n_threads);
    for (int l = 0; l < m->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        const struct mm_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++) {
            size_t b = mm_scratch_bytes(ws[i], max_batch_tokens, n_threads);
            if (b > sb)
                sb = b;
        }
    }
    sb = (sb + 63) / 64 * 64;
    c->scratch_bytes = sb ? sb : 64;
    c->scratch = aligned_alloc(64, c->scratch_bytes);
    if (!c->scratch) {
        snprintf(err, errlen, "out of memory for %zu bytes of matmul scratch", sb);
        goto fail;
    }
    /* Start the threads now, so the first forward is not the one that pays
     * for creating them. */
    cpu_pool_run(cpu_pool_threads(n_threads), start_threads, NULL);
    return c;

fail:
    model_ctx_destroy(c);
    return NULL;
}

void model_ctx_destroy(model_ctx *c)
{
    if (!c)
        return;
    attn_destroy(c->attn);
    attn_destroy(c->attn_local);
    free(c->x);
    free(c->xb);
    free(c->q);
    free(c->k);
    free(c->v);
    free(c->att);
    free(c->hb);
    free(c->hb2);
    free(c->xo);
    free(c->lg);
    free(c->scratch);
    free(c->tok);
    free(c->qpos);
    free(c->first);
    free(c->res);
    free(c->batch);
    free(c->sel_seq);
    free(c->sel_tok);
    free(c->mass_off);
    free(c->mass_q);
    free(c->aseq);
    free(c->mass);
    free(c);
}

size_t model_ctx_bytes(const model_ctx *c)
{
    const model *m = c->m;
    size_t T = (size_t)c->max_tokens;
    size_t rows = T < LOGIT_ROWS ? T : LOGIT_ROWS;
    size_t floats = T * (2 * (size_t)m->n_embd + 2 * (size_t)m->q_dim + 2 * (size_t)m->kv_dim +
                         2 * (size_t)m->n_ff) +
                    rows * ((size_t)m->n_embd + (size_t)m->n_vocab) + c->mass_cap;
    size_t ints = T * 9 * sizeof(int32_t) + T * 2 * sizeof(bool) + T * sizeof(struct attn_seq);
    return floats * sizeof(float) + ints + c->scratch_bytes + model_ctx_attn_bytes(c);
}

size_t model_ctx_attn_bytes(const model_ctx *c)
{
    return attn_workspace_bytes(c->attn) + attn_workspace_bytes(c->attn_local);
}

/* ------------------------------------------------------------------------
 * Kernels of the forward (the matrix products are in matmul.c)
 * ------------------------------------------------------------------------ */

/* The model's norm of one row of n_embd: RMSNorm or LayerNorm (ops.c). */
static void norm_row(const model *m, float *out, const float *x, const float *w, const float *b)
{
    const struct ops_kernels *k = ops_kernels_now();
    if (m->norm == MODEL_NORM_LAYER)
        k->layernorm(out, x, w, b, m->n_embd, m->norm_eps);
    else
        k->rmsnorm(out, x, w, m->n_embd, m->norm_eps);
}

static void norm_rows(const model *m, float *out, const float *x, const float *w, const float *b,
                      int n_rows)
{
    size_t d = (size_t)m->n_embd;
    for (int t = 0; t < n_rows; t++)
        norm_row(m, out + (size_t)t * d, x + (size_t)t * d, w, b);
}

static void add_bias(float *x, const float *b, int n_rows, int n)
{
    if (!b)
        return;
    for (int t = 0; t < n_rows; t++)
        for (int i = 0; i < n; i++)
            x[(size_t)t * n + i] += b[i];
}

static void add_rows(float *restrict x, const float *restrict y, size_t n)
{
    for (size_t i = 0; i < n; i++)
        x[i] += y[i];
}

/* Qwen3: RMSNorm of each of n_heads head vectors of x in place, with the
 * one weight w shared by the heads; w = NULL: nothing. */
static void head_norm_rows(const model *m, float *x, const float *w, int n_heads)
{
    if (!w)
        return;
    int hd = m->head_dim;
    const struct ops_kernels *k = ops_kernels_now();
    for (int h = 0; h < n_heads; h++)
        k->rmsnorm(x + (size_t)h * hd, x + (size_t)h * hd, w, hd, m->norm_eps);
}

/* Phi-3's LongRoPE amplitude: the rotated dims of every q head of n_rows
 * rows times rope_q_mul (the keys' share is folded in: see arch_phi3.c). */
static void rope_amplitude(const model *m, float *q, int n_rows)
{
    if (m->rope_q_mul == 1.0f)
        return;
    for (size_t h = 0; h < (size_t)n_rows * m->n_head; h++)
        for (int i = 0; i < m->pos.rope_dims; i++)
            q[h * m->head_dim + i] *= m->rope_q_mul;
}

/* x = clamp(x, -c, c) over n values (MPT's clip_qkv); c = 0: nothing. */
static void clamp_rows(float *x, size_t n, float c)
{
    if (c <= 0.0f)
        return;
    for (size_t i = 0; i < n; i++)
        x[i] = x[i] < -c ? -c : x[i] > c ? c : x[i];
}

/* The MLP's element-wise activations, on hb in place (hb2: the gated
 * products' second operand):
 *   EW_GELU_TANH  hb = gelu(hb), BLOOM's tanh approximation
 *   EW_GELU_ERF   hb = gelu(hb), the exact erf form (MPT)
 *   EW_GEGLU      hb = gelu_tanh(hb) * hb2 (Gemma's gated MLP)
 *   EW_SWIGLU     hb = silu(hb) * hb2 */
enum ew_op { EW_GELU_TANH, EW_GELU_ERF, EW_GEGLU, EW_SWIGLU };

struct ew_job {
    enum ew_op op;
    float *hb;
    const float *hb2;
};

static void ew_range(void *arg, size_t i0, size_t i1, int t)
{
    (void)t;
    const struct ew_job *j = arg;
    const struct ops_kernels *k = ops_kernels_now();
    float *restrict hb = j->hb + i0;
    const float *restrict hb2 = j->hb2 ? j->hb2 + i0 : NULL;
    size_t n = i1 - i0;
    switch (j->op) {
    case EW_GELU_TANH:
        k->gelu_tanh(hb, NULL, n);
        break;
    case EW_GEGLU:
        k->gelu_tanh(hb, hb2, n);
        break;
    case EW_SWIGLU:
        k->swiglu(hb, hb2, n);
        break;
    case EW_GELU_ERF: /* MPT: libm's erff at every level */
        for (size_t i = 0; i < n; i++)
            hb[i] = 0.5f * hb[i] * (1.0f + erff(hb[i] * 0.70710678f));
        break;
    }
}

/* The gated activation over rows [r0, r1) of tokens [t0, t1): the tail of
 * gate and up's region (mm_matmul_many), run as soon as a thread has that
 * block of both. */
struct act_job {
    struct ew_job ew;
    int n_ff;
};

static void act_rows(void *arg, int r0, int r1, int t0, int t1)
{
    const struct act_job *a = arg;
    for (int t = t0; t < t1; t++) {
        size_t o = (size_t)t * a->n_ff + (size_t)r0;
        ew_range((void *)&a->ew, o, o + (size_t)(r1 - r0), 0);
    }
}

/* Apply op over n values; threads only past 64k values (fewer are not
 * worth a hand-off). */
static void elementwise(enum ew_op op, float *hb, const float *hb2, size_t n, int n_threads)
{
    struct ew_job j = {op, hb, hb2};
    cpu_pool_for(n >= 65536 ? cpu_pool_threads(n_threads) : 1, n, ew_range, &j);
}

/* x = c * tanh(x / c) over n values: Gemma 2's final logit soft-cap; c = 0: nothing. */
static void softcap_rows(float *x, size_t n, float c)
{
    for (size_t i = 0; c > 0.0f && i < n; i++)
        x[i] = c * tanhf(x[i] / c);
}

/* The cache's and the kernel's type enums are passed through by value. */
_Static_assert(KV_F32 == (int)ATTN_F32 && KV_F16 == (int)ATTN_F16 && KV_BF16 == (int)ATTN_BF16 &&
                   KV_Q8_0 == (int)ATTN_Q8_0 && KV_Q4_0 == (int)ATTN_Q4_0,
               "enum kv_type and enum attn_type must number alike");

/* Store head_dim floats into a cache slot of the cache's element type
 * (q8_0 and q4_0: quantised here, once; the bytes are never rewritten). */
static void store_kv(void *dst, const float *src, int n, enum kv_type type)
{
    switch (type) {
    case KV_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        break;
    case KV_F16:
        qt_f32_to_f16_row(src, dst, (size_t)n);
        break;
    case KV_BF16:
        qt_f32_to_bf16_row(src, dst, (size_t)n);
        break;
    case KV_Q8_0:
    case KV_Q4_0:
        attn_store_row(dst, src, n, (enum attn_type)type);
        break;
    }
}

/* ------------------------------------------------------------------------
 * The forward
 * ------------------------------------------------------------------------ */

/* Validate the batch without touching anything. 0 or -EINVAL. */
static int check_batch(const model_ctx *c, const struct model_batch_seq *seqs, int n_seqs,
                       bool reserved, kv_cache **cache_out)
{
    const model *m = c->m;
    if (!seqs || n_seqs < 1)
        return -EINVAL;
    long total = 0;
    kv_cache *cache = NULL;
    for (int s = 0; s < n_seqs; s++) {
        const struct model_batch_seq *b = &seqs[s];
        if (!b->seq || !b->tokens || b->n_tokens < 1)
            return -EINVAL;
        total += b->n_tokens;
        if (total > c->max_tokens)
            return -EINVAL;
        for (int i = 0; i < b->n_tokens; i++)
            if (b->tokens[i] < 0 || b->tokens[i] >= m->n_vocab)
                return -EINVAL;
        kv_cache *sc = kv_seq_cache(b->seq);
        if (cache && sc != cache)
            return -EINVAL; /* one batch, one cache */
        cache = sc;
        for (int r = 0; r < s; r++)
            if (seqs[r].seq == b->seq)
                return -EINVAL; /* a sequence appears once per batch */
        /* The slots must be these tokens' reserved ones. */
        if (reserved && (b->first < 0 || b->first > kv_seq_n_tokens(b->seq) - b->n_tokens ||
            memcmp(kv_seq_tokens(b->seq) + b->first, b->tokens,
                   sizeof(int32_t) * (size_t)b->n_tokens) != 0))
            return -EINVAL;
    }
    struct kv_layout L;
    kv_cache_layout(cache, &L);
    if (L.n_layer != m->n_layer || L.n_kv_head != m->n_kv_head || L.head_dim != m->head_dim)
        return -EINVAL; /* the cache was shaped for another model */
    *cache_out = cache;
    return 0;
}

/* Ask each sequence's policy which of its queries' attention mass it wants
 * (the cache decides: kv_seq_mass_queries) and make sure the mass scratch
 * holds the keys of every sequence that wants some. */
static int prepare_mass(model_ctx *c, const struct model_batch_seq *seqs, int n_seqs)
{
    size_t need = 0;
    for (int s = 0; s < n_seqs; s++) {
        c->mass_off[s] = -1;
        c->mass_q[s] = kv_seq_mass_queries(seqs[s].seq, seqs[s].n_tokens);
        if (c->mass_q[s] > 0) { /* room for the main table's or the window's keys */
            int n_main = kv_seq_n_tokens(seqs[s].seq), n_win = kv_seq_window_slots(seqs[s].seq);
            c->mass_off[s] = (int)need;
            need += (size_t)(n_main > n_win ? n_main : n_win);
        }
    }
    if (need > c->mass_cap) {
        float *nm = realloc(c->mass, need * sizeof(float));
        if (!nm)
            return -ENOMEM;
        c->mass = nm;
        c->mass_cap = need;
    }
    return 0;
}

/*
 * The rows that matter after the last layer's K/V: the last token of each
 * sequence that asked for logits. Fills sel_seq[r] (its sequence) and
 * sel_tok[r] (its token index, increasing); returns how many.
 */
static int select_rows(model_ctx *c, const struct model_batch_seq *seqs, int n_seqs)
{
    int r = 0, t_end = 0;
    for (int s = 0; s < n_seqs; s++) {
        t_end += seqs[s].n_tokens;
        if (seqs[s].logits) {
            c->sel_seq[r] = s;
            c->sel_tok[r] = t_end - 1;
            r++;
        }
    }
    return r;
}

/* Move rows sel_tok[0..R) of a [T][n] buffer to rows 0..R-1, in place
 * (sel_tok[r] >= r and increasing, so no source is overwritten first). */
static void compact_rows(float *buf, const int *sel_tok, int R, int n)
{
    for (int r = 0; r < R; r++)
        if (sel_tok[r] != r)
            memcpy(buf + (size_t)r * n, buf + (size_t)sel_tok[r] * n, sizeof(float) * (size_t)n);
}

/*
 * One layer over the T tokens of the batch. With R >= 0 (the last layer,
 * when no sequence needs H2O mass) only K and V are computed for every
 * token; then the rows of x are compacted to the R rows that need logits
 * and the rest of the layer runs over those alone. 0, or attn_run's error.
 */
static int layer_forward(model_ctx *c, int l, const struct model_batch_seq *seqs, int n_seqs, int T,
                         int R, kv_cache *cache, const struct kv_layout *kl)
{
    const model *m = c->m;
    const struct model_layer *L = &m->layers[l];
    int d = m->n_embd, hd = m->head_dim, nt = c->n_threads;

    /* Attention: norm, k/v (and q) for all tokens at once. */
    norm_rows(m, c->xb, c->x, L->attn_norm, L->attn_norm_b, T);
    /* Q with K and V in one region, but in the last layer (R >= 0), where
     * only the rows kept need a query: see below. */
    float *outs[3] = {c->k, c->v, c->q};
    const struct mm_weight *ws[3] = {&L->wk, &L->wv, &L->wq};
    mm_matmul_many(outs, ws, R < 0 ? 3 : 2, c->xb, T, nt, c->scratch, NULL);
    add_bias(c->k, L->bk, T, m->kv_dim);
    add_bias(c->v, L->bv, T, m->kv_dim);
    head_norm_rows(m, c->k, L->k_norm, T * m->n_kv_head);
    clamp_rows(c->k, (size_t)T * m->kv_dim, m->clamp_kqv);
    clamp_rows(c->v, (size_t)T * m->kv_dim, m->clamp_kqv);

    /* New tokens' K (unrotated) and V into their sequences' pages. */
    int t = 0;
    for (int s = 0; s < n_seqs; s++) {
        kv_seq *seq = seqs[s].seq;
        for (int i = 0; i < seqs[s].n_tokens; i++, t++) {
            for (int h = 0; h < m->n_kv_head; h++) {
                const float *k = c->k + (size_t)t * m->kv_dim + (size_t)h * hd;
                store_kv(kv_seq_k(seq, l, h, c->first[s] + i), k, hd, kl->k_type);
                if (kv_seq_wants_key_norms(seq))
                    kv_seq_add_key_norm(seq, c->first[s] + i, k, hd);
                store_kv(kv_seq_v(seq, l, h, c->first[s] + i),
                         c->v + (size_t)t * m->kv_dim + (size_t)h * hd, hd, kl->v_type);
            }
        }
    }

    /* Queries: of every token, or (last layer) of the R rows kept. */
    int rows = T;
    if (R >= 0) {
        if (R == 0)
            return 0; /* nobody wants logits: the K/V were the point */
        compact_rows(c->xb, c->sel_tok, R, d);
        compact_rows(c->x, c->sel_tok, R, d);
        rows = R;
        mm_matmul_scratch(c->q, &L->wq, c->xb, rows, nt, c->scratch);
    }
    add_bias(c->q, L->bq, rows, m->q_dim);
    head_norm_rows(m, c->q, L->q_norm, rows * m->n_head);
    rope_amplitude(m, c->q, rows);
    clamp_rows(c->q, (size_t)rows * m->q_dim, m->clamp_kqv);

    /* The fused kernel over each sequence's cache. */
    struct attn_kv kv = {
        .base = kl->base,
        .page_bytes = kl->page_bytes,
        .k_offset = kv_layout_k_offset(kl, kv_cache_layer_slot(cache, l)),
        .v_offset = kv_layout_v_offset(kl, kv_cache_layer_slot(cache, l)),
        .page_tokens = kl->page_tokens,
        .k_type = (enum attn_type)kl->k_type,
        .v_type = (enum attn_type)kl->v_type,
        .n_pages = kv_cache_n_pages(cache),
        .sliding_window = L->sliding_window,
    };
    int n_aseq = 0;
    t = 0;
    for (int s = 0; s < n_seqs && R < 0; s++) {
        kv_seq *seq = seqs[s].seq;
        /* A policy that wants the mass of the last mass_q queries only gets
         * them as a sequence of their own (the earlier queries, without
         * mass, as another): causality is by position, so the split
         * changes no output. */
        int n_q = seqs[s].n_tokens, n_mass = c->mass_q[s] > 0 ? c->mass_q[s] : n_q;
        struct kv_seq_view view; /* a windowed layer reads its own pages */
        kv_seq_layer_view(seq, l, &view);
        for (int part = n_mass < n_q ? 0 : 1; part < 2; part++) {
            int q0 = part ? n_q - n_mass : 0, nq = part ? n_mass : n_q - n_mass;
            c->aseq[n_aseq++] = (struct attn_seq){
                .page_table = view.page_table,
                .pos = view.pos,
                .n_kv = view.n_kv,
                .n_q = nq,
                .q_pos = c->qpos + t + q0,
                .q = c->q + (size_t)(t + q0) * m->q_dim,
                .out = c->att + (size_t)(t + q0) * m->q_dim,
                .mass = part && c->mass_off[s] >= 0 ? c->mass + c->mass_off[s] : NULL,
            };
        }
        t += n_q;
    }
    for (int r = 0; r < R; r++) {
        kv_seq *seq = seqs[c->sel_seq[r]].seq;
        struct kv_seq_view view;
        kv_seq_layer_view(seq, l, &view);
        c->aseq[n_aseq++] = (struct attn_seq){
            .page_table = view.page_table,
            .pos = view.pos,
            .n_kv = view.n_kv,
            .n_q = 1,
            .q_pos = c->qpos + c->sel_tok[r],
            .q = c->q + (size_t)r * m->q_dim,
            .out = c->att + (size_t)r * m->q_dim,
        };
    }
    int rc = attn_run(L->local_rope ? c->attn_local : c->attn, &kv, c->aseq, n_aseq);
    if (rc)
        return rc;
    for (int s = 0; s < n_seqs && R < 0; s++) {
        if (c->mass_off[s] < 0)
            continue;
        struct kv_seq_view view;
        kv_seq_layer_view(seqs[s].seq, l, &view);
        if (view.local) /* the mass of the windowed layer's own slots */
            kv_seq_add_window_mass(seqs[s].seq, c->mass + c->mass_off[s]);
        else
            kv_seq_add_mass(seqs[s].seq, c->mass + c->mass_off[s]);
    }

    /* Output projection and residual. */
    mm_matmul_scratch(c->xb, &L->wo, c->att, rows, nt, c->scratch);
    add_bias(c->xb, L->bo, rows, d);
    if (L->attn_post_norm) /* Gemma: the attention output normalised before the residual */
        norm_rows(m, c->xb, c->xb, L->attn_post_norm, NULL, rows);
    add_rows(c->x, c->xb, (size_t)rows * d);

    /* Feed-forward: SwiGLU, GELU-gated (Gemma), or a GELU MLP with biases. */
    norm_rows(m, c->xb, c->x, L->ffn_norm, L->ffn_norm_b, rows);
    if (m->act == MODEL_ACT_SWIGLU || m->act == MODEL_ACT_GEGLU) {
        /* gate and up in one region, the activation in its tail */
        float *gu[2] = {c->hb, c->hb2};
        const struct mm_weight *wgu[2] = {&L->gate, &L->up};
        struct act_job a = {{m->act == MODEL_ACT_SWIGLU ? EW_SWIGLU : EW_GEGLU, c->hb, c->hb2},
                            m->n_ff};
        mm_matmul_many(gu, wgu, 2, c->xb, rows, nt, c->scratch, &(struct mm_tail){act_rows, &a});
    } else {
        mm_matmul_scratch(c->hb, &L->up, c->xb, rows, nt, c->scratch);
        add_bias(c->hb, L->b_up, rows, m->n_ff);
        elementwise(m->act == MODEL_ACT_GELU_TANH ? EW_GELU_TANH : EW_GELU_ERF, c->hb, NULL,
                    (size_t)rows * m->n_ff, nt);
    }
    mm_matmul_scratch(c->xb, &L->down, c->hb, rows, nt, c->scratch);
    add_bias(c->xb, L->b_down, rows, d);
    if (L->ffn_post_norm)
        norm_rows(m, c->xb, c->xb, L->ffn_post_norm, NULL, rows);
    add_rows(c->x, c->xb, (size_t)rows * d);
    return 0;
}

/*
 * Final norm and output matrix for the R selected rows, LOGIT_ROWS rows
 * per pass over the output matrix. compact: row r of x holds selection r
 * (the last layer ran compacted); else row sel_tok[r] does.
 */
static void output_logits(model_ctx *c, const struct model_batch_seq *seqs, int R, bool compact)
{
    const model *m = c->m;
    int d = m->n_embd;
    int rows_max = c->max_tokens < LOGIT_ROWS ? c->max_tokens : LOGIT_ROWS;
    for (int r0 = 0; r0 < R; r0 += rows_max) {
        int n = R - r0 < rows_max ? R - r0 : rows_max;
        for (int i = 0; i < n; i++) {
            int row = compact ? r0 + i : c->sel_tok[r0 + i];
            norm_row(m, c->xo + (size_t)i * d, c->x + (size_t)row * d, m->output_norm,
                     m->output_norm_b);
        }
        mm_matmul_scratch(c->lg, &m->output, c->xo, n, c->n_threads, c->scratch);
        softcap_rows(c->lg, (size_t)n * m->n_vocab, m->final_softcap);
        for (int i = 0; i < n; i++)
            memcpy(seqs[c->sel_seq[r0 + i]].logits, c->lg + (size_t)i * m->n_vocab,
                   sizeof(float) * (size_t)m->n_vocab);
    }
}

/* The cache transaction is the engine's (kv_reserve); this pass only
 * writes K/V into the reserved slots and computes. */
int model_forward(model_ctx *c, const struct model_batch_seq *seqs, int n_seqs)
{
    const model *m = c->m;
    kv_cache *cache = NULL;
    int rc = check_batch(c, seqs, n_seqs, true, &cache);
    if (rc)
        return rc;
    for (int s = 0; s < n_seqs; s++)
        c->first[s] = seqs[s].first;
    rc = prepare_mass(c, seqs, n_seqs);
    if (rc)
        return rc;

    /* Token ids, positions and embeddings in batch order. */
    int T = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int32_t *pos = kv_seq_positions(seqs[s].seq);
        for (int i = 0; i < seqs[s].n_tokens; i++, T++) {
            c->tok[T] = seqs[s].tokens[i];
            c->qpos[T] = pos[c->first[s] + i];
        }
    }
    const uint8_t *emb = m->tok_embd.data;
    for (int t = 0; t < T; t++)
        qt_dequantize_row(m->tok_embd.type, emb + (size_t)c->tok[t] * m->tok_embd.row_bytes,
                          c->x + (size_t)t * m->n_embd, m->n_embd);
    for (size_t i = 0; m->emb_scale != 1.0f && i < (size_t)T * m->n_embd; i++)
        c->x[i] *= m->emb_scale; /* Gemma: times sqrt(n_embd) */
    if (m->tok_norm) /* BLOOM's word_embeddings_layernorm */
        norm_rows(m, c->x, c->x, m->tok_norm, m->tok_norm_b, T);

    /* The last layer runs compacted to the rows that need logits, unless a
     * sequence collects attention mass (h2o counts every query). */
    int R = select_rows(c, seqs, n_seqs);
    bool compact = true;
    for (int s = 0; s < n_seqs; s++)
        compact = compact && c->mass_off[s] < 0;

    struct kv_layout kl;
    kv_cache_layout(cache, &kl);
    cpu_pool_hold(); /* the pass's regions follow one another: keep the workers up */
    for (int l = 0; l < m->n_layer && !rc; l++) {
        int rows = l == m->n_layer - 1 && compact ? R : -1;
        rc = layer_forward(c, l, seqs, n_seqs, T, rows, cache, &kl);
    }
    if (!rc)
        output_logits(c, seqs, R, compact);
    cpu_pool_release();
    return rc;
}

int model_reserve_forward(model_ctx *c, const struct model_batch_seq *seqs, int n_seqs,
                          int *failed_seq)
{
    kv_cache *cache;
    int rc = check_batch(c, seqs, n_seqs, false, &cache); /* nothing reserved for a bad batch */
    if (rc)
        return rc;
    for (int s = 0; s < n_seqs; s++)
        c->res[s] = (struct kv_reservation){
            .seq = seqs[s].seq, .tokens = seqs[s].tokens, .n_tokens = seqs[s].n_tokens};
    rc = kv_reserve(c->res, n_seqs, failed_seq);
    if (rc)
        return rc;
    for (int s = 0; s < n_seqs; s++) {
        c->batch[s] = seqs[s];
        c->batch[s].first = c->res[s].first;
    }
    rc = model_forward(c, c->batch, n_seqs);
    if (rc)
        kv_reserve_undo(c->res, n_seqs);
    return rc;
}
