/*
 * mkmodel_retrieval.c - a model that retrieves, with weights computed, not
 * trained (`kvd mkmodel --preset retrieval [--position rope|alibi|t5]`).
 *
 * Why it exists. Perplexity says little about whether a long context is
 * usable: a model can predict the next word well from the last few hundred
 * tokens and still be unable to fetch a fact from ten thousand tokens back.
 * The shared test models cannot retrieve at all, so nothing showed what
 * eviction does to retrieval. This model does exactly one thing, and does
 * it at any distance the cache holds: given
 *
 *     ... the secret code is 8 3 1 4 7 ... (pages of text) ... the secret code is
 *
 * it continues " 8 3 1 4 7". It is the two-layer "induction head" circuit
 * of transformer interpretability, written down instead of learned:
 *
 *   layer 1  previous-token heads: at every position i, copy the token code
 *            of position i-1 (and, for RoPE and T5, of i-2) into the
 *            residual stream beside token i's own code;
 *   layer 2  an induction head: the query of the last position t is its own
 *            code (and that of t-1); the key of every position j is what
 *            layer 1 put there, the codes of j-1 (and j-2). The best match
 *            is the position right after an earlier occurrence of the
 *            current context, and the head copies that position's token
 *            code into the residual stream, where the output matrix turns
 *            it into that token's logit.
 *
 * The match uses token codes only, never positions, so it works from
 * however far back, until the key leaves the cache. That is what makes the
 * model a probe of eviction: sink + window retrieves exactly while the key
 * is inside the window, and renumbered or preserved positions change
 * nothing for the induction head (only layer 1 cares about offsets, and
 * only offsets of 1 and 2 between tokens that are both still cached).
 *
 * The residual stream (n_embd = 144, of which 65 dims are used):
 *
 *   dim 0        C   a constant, RES_C, in every token's embedding; layer 1
 *                    builds its RoPE queries and keys from it, and it keeps
 *                    the RMS norm of every row nearly the same (so the norms
 *                    before each layer are a known scale, not a nonlinearity)
 *   dims 1..16   E   the token's code: 16 signs +-1/4 (unit length)
 *   dims 17..32  S1  layer 1's output: the code of token i-1 (RoPE, T5), or
 *                    the ALiBi history (below)
 *   dims 33..48  S2  layer 1's output: the code of token i-2 (RoPE, T5)
 *   dims 49..64  O   layer 2's output: the code of the token to copy
 *
 * Token codes. The codewords of the second-order Reed-Muller code RM(2,4)
 * without the constant term: 1024 sign vectors of length 16, any two at
 * Hamming distance 4..12, so two different codes have |dot| <= 1/2. The 16
 * of degree 1 are exactly orthogonal (the rows of a 16x16 Hadamard matrix);
 * they go to the tokens the retrieval prompt is made of (the ten digit
 * words and the words of "the secret code is"). Every other word piece gets
 * a degree-2 codeword, in an order shuffled by the seed; byte tokens reuse
 * codewords (the induction head cannot tell them apart, which is why their
 * output rows are scaled down: they never win a copy). The control tokens
 * (<unk>, <s>, </s>) have no code at all: BOS is the first token of every
 * prompt, and in the ALiBi construction its key (the history of a position
 * that has none) would be its own code scaled up, matching any query that
 * its code happens to correlate with.
 *
 * Weight blocks (W[r][c]: output r, input c; everything not named is 0;
 * k1, k2, k3 are the known RMS-norm scales before layer 1, layer 2 and the
 * output, from RES_C and the unit codes):
 *
 *   token_embd      row v = [RES_C, code(v), 0...]
 *   norms           all weights 1 (the scale is folded into the matrices)
 *   ffn_*           0: the model needs no MLP (n_ff = 16 zeros)
 *   output          row v reads O: Z * code(v) / k3 (x 1/4 for byte and
 *                   control tokens), so the copied code's token has logit
 *                   ~Z = 20 and any other at most ~Z/2
 *
 *   RoPE (3 heads of 48, 1 KV head; rope.dimension_count 16, freq_base 64):
 *     Partial rotation (kvd rotates the first rope.dimension_count dims of
 *     each head, as llama.cpp does) splits every head into 16 rotated dims
 *     for position and 32 unrotated dims for content.
 *     layer 1 q  heads 0 and 1 (offsets D = 1, 2): pair i of the rotated
 *                dims reads C: A (cos(theta_i D), -sin(theta_i D)) / (RES_C k1)
 *     layer 1 k  pair i: (1, 0) / (RES_C k1). Rotated by their positions,
 *                q.k = A sum_i cos(theta_i (pos_q - pos_k - D)), which peaks
 *                at offset D. With theta_i = 64^(-i/8) the peak beats every
 *                other offset in [-2, 140000] by 0.727 of one pair's
 *                amplitude (checked numerically; the nearest rival is the
 *                neighbouring offset), and A = 40 sqrt(48) makes that gap 29
 *                in the softmax: everything but offset D gets < 1e-12 of the
 *                weight, even summed over 32k keys.
 *     layer 1 v  dims 0..15 = E / k1 (the key token's code)
 *     layer 1 o  head 0 -> S1, head 1 -> S2
 *     layer 2 q  head 0, unrotated dims: [16..32) = Q E / k2,
 *                [32..48) = Q/2 S1 / k2; rotated dims 0, so no position
 *     layer 2 k  unrotated dims: [16..32) = S1 / k2, [32..48) = S2 / k2
 *                score = Q (code(t).code(j-1) + code(t-1).code(j-2) / 2) / sqrt(48):
 *                1.5 Q' for the true position, at most 1.25 Q' for one
 *                that matches only the current token, at most 1 Q' for the
 *                rest (Q' = Q / sqrt(48) = 120: a gap of 30)
 *     layer 2 v  dims 0..15 = E / k2;  o: head 0 -> O
 *
 *   T5 (3 heads of 48, 1 KV head; 32 buckets, max distance 128):
 *     The one bias table (blk.0.attn_rel_b, shared by both layers) does
 *     layer 1's work: head 0 has 0 at the bucket of offset -1 and -40
 *     elsewhere, head 1 the same for offset -2, head 2 is 0 everywhere.
 *     The causal buckets are exact up to offset 15, so buckets 1 and 2 are
 *     offsets 1 and 2 alone. Layer 1 q and k are 0 (the bias alone
 *     decides); v and o as for RoPE. Layer 2's induction head is head 2,
 *     the one with the flat row (the table is shared, so heads 0 and 1 of
 *     layer 2 would see layer 1's preference): q, k, v, o as for RoPE, in
 *     head 2's first 32 dims.
 *
 *   ALiBi (9 heads of 16, 1 KV head; max_bias 12):
 *     The slopes are fixed by max_bias (llama.cpp's formula): with 9 heads,
 *     n2 = 8, slope_h = 2^(-12(h+1)/8) for h < 8 and 2^(-12/16) for h = 8.
 *     How close they get: the steepest slope is 2^(-max_bias/(2 n2)) < 1
 *     for any max_bias > 0, so one step of distance costs at most a factor
 *     e in attention weight; no head can look at offset 1 alone. And the
 *     flattest head, which the induction head must be (it looks 32k tokens
 *     back), has slope 2^(-max_bias): the two are tied, and 9 heads with
 *     max_bias 12 give the steep head 0.595 (weight ratio r = e^-0.595 =
 *     0.55 per step) and the flat one 2^-12 (a penalty of 8 at 32k, small
 *     beside the induction scores of ~170).
 *     The content trick that completes it: the steep head (h = 8), with
 *     q = 0, averages the codes of all earlier tokens with weights
 *     (1-r) r^d, d = 0, 1, 2, ...: a geometric history h_i that includes
 *     token i itself. Token i's own code is in the residual stream, so a
 *     linear map recovers the history that ends at i-1 exactly:
 *     u_i = (h_i/(1-r) - E_i)/r = code(i-1) + r code(i-2) + r^2 code(i-3)...
 *     Layer 2's key is u_j and its query the history ending at t,
 *     g_t = h_t/(1-r) = code(t) + r code(t-1) + ...: the induction head
 *     compares the recent past of t with the recent past before j, most
 *     recent token first. Identical histories (the place the query text
 *     occurred before) score highest; a one-token match ("is" after other
 *     words) scores ~1 against ~1/(1-r^2) = 1.44.
 *     layer 1  q, k = 0; v = E / k1; o: head 8 -> S1
 *     layer 2  head 7: q = Q S1 / ((1-r) k2); k = (S1/(1-r) - E) / (r k2);
 *              v = E / k2; o: head 7 -> O. Q' = Q/4 = 120.
 *     This is approximate where RoPE and T5 are exact: a history shares
 *     weight between tokens, so two contexts that differ only far back, or
 *     that hold the same tokens in another order, are close; kvd eval
 *     measures what that costs.
 *
 * What it cannot do. The RoPE and T5 constructions match a context of two
 * tokens: in "... is 3 3 8 ... 3 3 1" the pair "3 3" is followed by 8 and by
 * 1, and the copy forks (kvd eval's keys are distinct digits, and the
 * tests' codes share no digit pair, for this reason). ALiBi's histories
 * reach further back but blur (a match four tokens back is worth r^8 of
 * one at the last token). Byte tokens share codes with words. Text the
 * vocabulary lacks falls back to bytes and single letters, which still
 * copy, but less reliably than whole words.
 *
 * Training length. A constructed model has none; context_length is written
 * as 2048, the length kvd eval takes multiples of by default.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "model/mkmodel_internal.h"

/* Shape and scales of the construction (see the comment above). */
#define RES_DIM 144       /* n_embd (RoPE, T5) */
#define RES_DIM_ALIBI 153 /* n_embd (ALiBi: 9 heads of 17) */
#define CODE 16           /* token code length */
#define RES_C 6.0f        /* the constant dimension's value */
#define SLOT_E 1
#define SLOT_S1 17
#define SLOT_S2 33
#define SLOT_O 49
#define SLOT_N 65 /* ALiBi: NORM_EPS |u|^2, the squared length of the key history */
#define NORM_EPS 0.1f
#define GATE_ON 20.0f /* silu(z) = z (1 - 2e-9) at z = 20: SwiGLU as a product */
#define ROPE_DIMS 16
#define ROPE_BASE 64.0f
#define ROPE_GAIN 40.0f  /* softmax units per unit of sum cos (layer 1, RoPE) */
#define T5_MISS (-40.0f) /* T5 bias of every bucket but the one a head wants */
#define ALIBI_BIAS 12.0f /* max_bias with 9 heads: steep 2^-0.75, flat 2^-12 */
#define INDUCTION 120.0f /* softmax units per unit of code match (layer 2) */
#define LOGIT 20.0f      /* logit of a fully copied code */
#define N_CTX 2048

/* The prompt's words first (digits and "the secret code is", which get the
 * orthogonal codes), then words for text around it. */
const char *const mk_retrieval_words[] = {
    "0",     "1",       "2",      "3",      "4",     "5",        "6",      "7",      "8",
    "9",     "the",     "secret", "code",   "is",    "a",        "and",    "was",    "to",
    "of",    "in",      "it",     "on",     "at",    "my",       "your",   "her",    "his",
    "their", "old",     "new",    "little", "big",   "red",      "blue",   "green",  "day",
    "night", "morning", "sun",    "rain",   "wind",  "river",    "tree",   "house",  "garden",
    "door",  "road",    "hill",   "bird",   "dog",   "cat",      "fox",    "walked", "sat",
    "saw",   "ran",     "found",  "kept",   "said",  "remember", "number", "key",    "box",
    "there", "here",    "then",   "very",   "quiet", "long",     "story",  "once",   "upon",
    "time",  "lived",   "who",    "near",   "with",  "by",       "under",  "over",   "bright",
    "cold",  "warm",    "small",  "came",   "went",  "back",     "home",   "friend", "Once",
    "The",   "It",      "She",    "He",
};
const size_t mk_retrieval_n_words = sizeof(mk_retrieval_words) / sizeof(mk_retrieval_words[0]);

/* Pieces with degree-1 (orthogonal) codes: the tokens of the prompt. */
#define N_ORTHO 16
#define SP "\xe2\x96\x81" /* U+2581, SentencePiece's word boundary */
static const char *const ortho_pieces[N_ORTHO] = {
    SP "0", SP "1", SP "2",   SP "3",      SP "4",    SP "5",  SP "6", SP "7",
    SP "8", SP "9", SP "the", SP "secret", SP "code", SP "is", ".",    SP,
};

static int n_heads_for(const char *pos)
{
    return !strcmp(pos, "alibi") ? 9 : 3;
}

int model_mk_preset(struct model_mk_params *p, const char *preset, const char *position, char *err,
                    size_t errlen)
{
    if (!preset || strcmp(preset, "retrieval")) {
        snprintf(err, errlen, "preset must be retrieval (got '%s')", preset ? preset : "(null)");
        return -EINVAL;
    }
    const char *pos = position ? position : "rope";
    if (strcmp(pos, "rope") && strcmp(pos, "alibi") && strcmp(pos, "t5")) {
        snprintf(err, errlen, "position must be rope, alibi or t5 (got '%s')", pos);
        return -EINVAL;
    }
    model_mk_defaults(p);
    p->preset = "retrieval";
    p->arch = "llama";
    p->position = !strcmp(pos, "rope") ? NULL : pos;
    bool alibi = !strcmp(pos, "alibi");
    p->n_embd = alibi ? RES_DIM_ALIBI : RES_DIM;
    p->n_layer = 2;
    p->n_head = n_heads_for(pos);
    p->n_kv_head = 1;
    p->n_ff = alibi ? 2 * CODE : 16;
    p->n_vocab = 0;
    p->rope_dims = !strcmp(pos, "rope") ? ROPE_DIMS : 0;
    p->rope_theta = ROPE_BASE;
    p->alibi_max_bias = ALIBI_BIAS;
    p->t5_num_buckets = 32;
    p->t5_max_distance = 128;
    p->n_ctx_train = N_CTX;
    return 0;
}

int mk_retrieval_check(const struct model_mk_params *p, char *err, size_t errlen)
{
    const char *pos = model_mk_position(p);
    struct model_mk_params want;
    if (model_mk_preset(&want, "retrieval", pos, err, errlen))
        return -EINVAL;
    if (strcmp(p->arch, want.arch) || p->n_embd != want.n_embd || p->n_layer != want.n_layer ||
        p->n_head != want.n_head || p->n_kv_head != want.n_kv_head || p->n_ff != want.n_ff ||
        p->rope_dims != want.rope_dims || p->rope_theta != want.rope_theta ||
        p->alibi_max_bias != want.alibi_max_bias || p->t5_num_buckets != want.t5_num_buckets ||
        p->t5_max_distance != want.t5_max_distance || p->type != GGML_TYPE_F32 || p->tied) {
        snprintf(err, errlen,
                 "the retrieval preset's weights are computed for one shape: llama, dim %d, "
                 "%d layers, %d heads, 1 kv head, ff %d, f32, untied (%s positions); "
                 "only --position, --ctx and --seed may change",
                 want.n_embd, want.n_layer, want.n_head, want.n_ff, pos);
        return -EINVAL;
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Token codes
 * ------------------------------------------------------------------------ */

/*
 * The RM(2,4) codeword with linear part lin (4 bits: x0..x3) and quadratic
 * part quad (6 bits: x0x1, x0x2, x0x3, x1x2, x1x3, x2x3), as 16 bits: bit i
 * is the polynomial at the point whose coordinates are the bits of i.
 */
static unsigned rm_codeword(unsigned lin, unsigned quad)
{
    static const int qa[6] = {0, 0, 0, 1, 1, 2}, qb[6] = {1, 2, 3, 2, 3, 3};
    unsigned word = 0;
    for (unsigned i = 0; i < 16; i++) {
        unsigned bit = 0;
        for (int a = 0; a < 4; a++)
            bit ^= (lin >> a) & (i >> a) & 1u;
        for (int q = 0; q < 6; q++)
            bit ^= (quad >> q) & (i >> qa[q]) & (i >> qb[q]) & 1u;
        word |= bit << i;
    }
    return word;
}

static void code_from_word(float *code, unsigned word)
{
    for (int i = 0; i < CODE; i++)
        code[i] = ((word >> i) & 1u) ? -0.25f : 0.25f;
}

/*
 * codes[v][CODE] for every token of v: the prompt's pieces get the 16
 * degree-1 codewords, other normal pieces the degree-2 ones (1008, shuffled
 * by seed), byte tokens reuse those from the end, control tokens get zeros.
 * weak[v] says whether v is not a normal piece (its output row is scaled
 * down).
 */
static void assign_codes(float *codes, bool *weak, const struct mk_vocab *v, uint64_t seed)
{
    unsigned quad_words[1008];
    int nq = 0;
    for (unsigned quad = 1; quad < 64; quad++)
        for (unsigned lin = 0; lin < 16; lin++)
            quad_words[nq++] = rm_codeword(lin, quad);
    uint64_t s = seed ^ 0x5eed5eedULL;
    for (int i = nq - 1; i > 0; i--) {
        int j = (int)(mk_rng_next(&s) % (uint64_t)(i + 1));
        unsigned t = quad_words[i];
        quad_words[i] = quad_words[j];
        quad_words[j] = t;
    }
    int next_q = 0, next_weak = nq - 1;
    for (int t = 0; t < v->n; t++) {
        float *code = codes + (size_t)t * CODE;
        int o = 0;
        while (o < N_ORTHO && strcmp(v->tok[t], ortho_pieces[o]))
            o++;
        weak[t] = v->type[t] != 1;
        if (v->type[t] == 2 || v->type[t] == 3) {
            memset(code, 0, sizeof(float) * CODE); /* <unk>, <s>, </s>: no code */
        } else if (o < N_ORTHO) {
            code_from_word(code, rm_codeword((unsigned)o, 0));
        } else if (!weak[t] && next_q < nq) {
            code_from_word(code, quad_words[next_q++]);
        } else {
            weak[t] = true;
            code_from_word(code, quad_words[next_weak]);
            next_weak = next_weak > next_q ? next_weak - 1 : nq - 1;
        }
    }
}

/* ------------------------------------------------------------------------
 * Tensors
 * ------------------------------------------------------------------------ */

struct build {
    gguf_writer *w;
    const struct model_mk_params *p;
    const float *codes; /* [n_vocab][CODE] */
    const bool *weak;   /* [n_vocab] */
    float *buf;         /* scratch, the largest tensor */
    int D, H, hd;       /* residual width, heads, head dim */
    float k1, k2, k3;   /* RMS-norm scales before layer 1, layer 2, the output */
    float r;            /* ALiBi: the steep head's weight ratio per step */
    char *err;
    size_t errlen;
};

/* Zero the scratch for an ne1 x ne0 tensor and return it. */
static float *zeroed(struct build *b, int ne0, int ne1)
{
    memset(b->buf, 0, sizeof(float) * (size_t)ne0 * (size_t)ne1);
    return b->buf;
}

/* Add the scratch as an F32 tensor [ne1][ne0] (1-D when ne1 == 1). */
static int put(struct build *b, const char *name, int ne0, int ne1)
{
    uint64_t ne[2] = {(uint64_t)ne0, (uint64_t)ne1};
    int rc = gguf_writer_add_tensor(b->w, name, GGML_TYPE_F32, ne1 > 1 ? 2 : 1, ne, b->buf,
                                    sizeof(float) * (size_t)ne0 * (size_t)ne1);
    if (rc)
        snprintf(b->err, b->errlen, "adding tensor %s failed (%d)", name, rc);
    return rc;
}

static int put_ones(struct build *b, const char *name)
{
    float *x = zeroed(b, b->D, 1);
    for (int i = 0; i < b->D; i++)
        x[i] = 1.0f;
    return put(b, name, b->D, 1);
}

/* W[row0 + j][col0 + j] = g for j < CODE, in a matrix of `cols` columns. */
static void diag(float *W, int cols, int row0, int col0, float g)
{
    for (int j = 0; j < CODE; j++)
        W[(size_t)(row0 + j) * cols + col0 + j] = g;
}

/* The layer-2 induction head and the layer-1 previous-token heads, per
 * scheme: which head does what (see the comment at the top). */
static bool is_pos(const struct build *b, const char *kind)
{
    return !strcmp(model_mk_position(b->p), kind);
}

static int induction_head(const struct build *b)
{
    return is_pos(b, "rope") ? 0 : is_pos(b, "t5") ? 2 : 7;
}

/* First query/key dim of the content part of a head (after rotated dims). */
static int content_dim(const struct build *b)
{
    return is_pos(b, "rope") ? ROPE_DIMS : 0;
}

static int layer_q(struct build *b, int l, const char *name)
{
    int rows = b->H * b->hd;
    float *W = zeroed(b, b->D, rows);
    if (l == 0 && is_pos(b, "rope")) {
        double inv[ROPE_DIMS / 2];
        pos_rope_inv_freq(inv, ROPE_DIMS, ROPE_BASE);
        float A = ROPE_GAIN * sqrtf((float)b->hd);
        for (int h = 0; h < 2; h++) { /* head h peaks at offset h + 1 */
            for (int i = 0; i < ROPE_DIMS / 2; i++) {
                double ang = inv[i] * (h + 1);
                W[(size_t)(h * b->hd + 2 * i) * b->D] = A * (float)cos(ang) / (RES_C * b->k1);
                W[(size_t)(h * b->hd + 2 * i + 1) * b->D] = -A * (float)sin(ang) / (RES_C * b->k1);
            }
        }
    } else if (l == 1) {
        int r0 = induction_head(b) * b->hd + content_dim(b);
        float Q = INDUCTION * sqrtf((float)b->hd) / b->k2;
        if (is_pos(b, "alibi")) {
            diag(W, b->D, r0, SLOT_S1, Q / (1.0f - b->r));
            W[(size_t)(r0 + CODE) * b->D] = Q / RES_C; /* the constant, against -|u|^2/2 */
        } else {
            diag(W, b->D, r0, SLOT_E, Q);
            diag(W, b->D, r0 + CODE, SLOT_S1, 0.5f * Q);
        }
    }
    return put(b, name, b->D, rows);
}

static int layer_k(struct build *b, int l, const char *name)
{
    float *W = zeroed(b, b->D, b->hd);
    if (l == 0 && is_pos(b, "rope")) {
        for (int i = 0; i < ROPE_DIMS / 2; i++)
            W[(size_t)(2 * i) * b->D] = 1.0f / (RES_C * b->k1);
    } else if (l == 1) {
        int r0 = content_dim(b);
        if (is_pos(b, "alibi")) {
            diag(W, b->D, r0, SLOT_S1, 1.0f / ((1.0f - b->r) * b->r * b->k2));
            diag(W, b->D, r0, SLOT_E, -1.0f / (b->r * b->k2));
            W[(size_t)(r0 + CODE) * b->D + SLOT_N] = -0.5f / (NORM_EPS * b->k2);
        } else {
            diag(W, b->D, r0, SLOT_S1, 1.0f / b->k2);
            diag(W, b->D, r0 + CODE, SLOT_S2, 1.0f / b->k2);
        }
    }
    return put(b, name, b->D, b->hd);
}

static int layer_v(struct build *b, int l, const char *name)
{
    float *W = zeroed(b, b->D, b->hd);
    diag(W, b->D, 0, SLOT_E, 1.0f / (l == 0 ? b->k1 : b->k2));
    return put(b, name, b->D, b->hd);
}

/* Output projection [b->D][H * hd]: head outputs into their slots. */
static int layer_o(struct build *b, int l, const char *name)
{
    int cols = b->H * b->hd;
    float *W = zeroed(b, cols, b->D);
    if (l == 0 && is_pos(b, "alibi")) {
        diag(W, cols, SLOT_S1, 8 * b->hd, 1.0f);
    } else if (l == 0) {
        diag(W, cols, SLOT_S1, 0, 1.0f);
        diag(W, cols, SLOT_S2, b->hd, 1.0f);
    } else {
        diag(W, cols, SLOT_O, induction_head(b) * b->hd, 1.0f);
    }
    return put(b, name, cols, b->D);
}

/*
 * The feed-forward matrices (which: 0 gate, 1 up, 2 down). Zero, except in
 * layer 1 of ALiBi, where SwiGLU computes |u|^2 of the key history u (see
 * the top): unit k has gate GATE_ON + u_k and up u_k, unit CODE+k gate
 * GATE_ON and up -u_k; silu is the identity at GATE_ON, so the two add to
 * u_k^2, and down sums them into SLOT_N (times NORM_EPS).
 */
static int ffn(struct build *b, int l, const char *name, int which)
{
    int F = b->p->n_ff;
    bool on = l == 0 && is_pos(b, "alibi");
    float *W = which == 2 ? zeroed(b, F, b->D) : zeroed(b, b->D, F);
    float kf = b->k2; /* the FFN sees the residual layer 2 will see, less SLOT_N */
    float a = 1.0f / ((1.0f - b->r) * b->r * kf), e = -1.0f / (b->r * kf);
    for (int k = 0; on && k < CODE; k++) {
        float *u0 = W + (size_t)k * b->D, *u1 = W + (size_t)(CODE + k) * b->D;
        if (which == 0) {
            u0[0] = u1[0] = GATE_ON / (RES_C * kf);
            u0[SLOT_S1 + k] = a;
            u0[SLOT_E + k] = e;
        } else if (which == 1) {
            u0[SLOT_S1 + k] = a;
            u0[SLOT_E + k] = e;
            u1[SLOT_S1 + k] = -a;
            u1[SLOT_E + k] = -e;
        } else {
            W[(size_t)SLOT_N * F + k] = NORM_EPS;
            W[(size_t)SLOT_N * F + CODE + k] = NORM_EPS;
        }
    }
    return which == 2 ? put(b, name, F, b->D) : put(b, name, b->D, F);
}

/* blk.0.attn_rel_b.weight [num_buckets][H]: offsets -1 and -2 for heads 0
 * and 1, flat for head 2. */
static int t5_table(struct build *b)
{
    const struct model_mk_params *p = b->p;
    int nb = p->t5_num_buckets;
    float *T = zeroed(b, b->H, nb);
    for (int h = 0; h < 2; h++) {
        int want = pos_t5_bucket(-(h + 1), false, nb, p->t5_max_distance);
        for (int k = 0; k < nb; k++)
            T[(size_t)k * b->H + h] = k == want ? 0.0f : T5_MISS;
    }
    return put(b, "blk.0.attn_rel_b.weight", b->H, nb);
}

static int embeddings(struct build *b, bool output)
{
    int V = b->p->n_vocab;
    float *W = zeroed(b, b->D, V);
    for (int t = 0; t < V; t++) {
        const float *code = b->codes + (size_t)t * CODE;
        float *row = W + (size_t)t * b->D;
        if (output) {
            float g = LOGIT / b->k3 * (b->weak[t] ? 0.25f : 1.0f);
            for (int j = 0; j < CODE; j++)
                row[SLOT_O + j] = g * code[j];
        } else {
            row[0] = RES_C;
            for (int j = 0; j < CODE; j++)
                row[SLOT_E + j] = code[j];
        }
    }
    return put(b, output ? "output.weight" : "token_embd.weight", b->D, V);
}

static int all_tensors(struct build *b)
{
    const struct model_mk_params *p = b->p;
    char name[64];
    int rc = embeddings(b, false);
    for (int l = 0; l < p->n_layer && !rc; l++) {
#define NAME(what) (snprintf(name, sizeof(name), "blk.%d.%s", l, what), name)
        rc = put_ones(b, NAME("attn_norm.weight"));
        rc = rc ? rc : layer_q(b, l, NAME("attn_q.weight"));
        rc = rc ? rc : layer_k(b, l, NAME("attn_k.weight"));
        rc = rc ? rc : layer_v(b, l, NAME("attn_v.weight"));
        rc = rc ? rc : layer_o(b, l, NAME("attn_output.weight"));
        rc = rc ? rc : put_ones(b, NAME("ffn_norm.weight"));
        rc = rc ? rc : ffn(b, l, NAME("ffn_gate.weight"), 0);
        rc = rc ? rc : ffn(b, l, NAME("ffn_up.weight"), 1);
        rc = rc ? rc : ffn(b, l, NAME("ffn_down.weight"), 2);
        if (!rc && l == 0 && is_pos(b, "t5"))
            rc = t5_table(b);
#undef NAME
    }
    rc = rc ? rc : put_ones(b, "output_norm.weight");
    return rc ? rc : embeddings(b, true);
}

int mk_retrieval_tensors(gguf_writer *w, const struct model_mk_params *p, const struct mk_vocab *v,
                         char *err, size_t errlen)
{
    struct build b = {.w = w,
                      .p = p,
                      .D = p->n_embd,
                      .H = p->n_head,
                      .hd = p->n_embd / p->n_head,
                      .err = err,
                      .errlen = errlen};
    /* RMS norms: 1/rms of [RES_C, unit code] (layer 1); plus the unit codes
     * of S1 and S2 (layer 2, RoPE and T5) or the ALiBi history, whose
     * squared length (1-r)/(1+r) is taken for distinct tokens; plus O. */
    float slopes[16];
    pos_alibi_slopes(slopes, 9, ALIBI_BIAS);
    b.r = expf(-slopes[8]);
    float s2 = is_pos(&b, "alibi") ? 1.0f + (1.0f - b.r) / (1.0f + b.r) : 3.0f;
    float eps = p->rms_eps;
    b.k1 = 1.0f / sqrtf((RES_C * RES_C + 1.0f) / b.D + eps);
    b.k2 = 1.0f / sqrtf((RES_C * RES_C + s2) / b.D + eps);
    b.k3 = 1.0f / sqrtf((RES_C * RES_C + s2 + 1.0f) / b.D + eps);

    size_t big = (size_t)b.D * (size_t)(p->n_vocab > b.D ? p->n_vocab : b.D);
    float *codes = malloc(sizeof(float) * (size_t)p->n_vocab * CODE);
    bool *weak = malloc(sizeof(bool) * (size_t)p->n_vocab);
    b.buf = malloc(sizeof(float) * big);
    int rc = -ENOMEM;
    if (!codes || !weak || !b.buf) {
        snprintf(err, errlen, "out of memory for the retrieval model's tensors");
        goto out;
    }
    assign_codes(codes, weak, v, p->seed);
    b.codes = codes;
    b.weak = weak;
    rc = all_tensors(&b);
out:
    free(codes);
    free(weak);
    free(b.buf);
    return rc;
}
