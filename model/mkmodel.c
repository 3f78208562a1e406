/*
 * mkmodel.c - small seeded GGUF models (llama, qwen2, bloom, mpt; RoPE,
 * ALiBi or T5 bias): the default model and the test fixtures.
 *
 * Two parts. The vocabulary is SentencePiece-shaped like Llama's: <unk>,
 * <s>, </s>, the 256 byte-fallback tokens <0x00>..<0xFF> (so any UTF-8 text
 * tokenizes and decodes back), then normal pieces: "▁", letters, digits and
 * punctuation, common English words with every prefix of each word (SPM
 * merges pairs whose concatenation is a piece, so a word is reachable only
 * through a chain of pieces), and systematic letter n-grams to fill larger
 * vocabularies. Scores fall with the rank, so earlier pieces merge first.
 *
 * The weights are uniform random numbers from a generator seeded by the
 * seed and the tensor's name (a tensor does not depend on the order it is
 * written in), scaled so every activation stays near unit size: Q, K, V,
 * gate and up project normalised inputs with std 1/sqrt(fan_in) (attention
 * scores and gates of order 1), the output and down projections use
 * 2/sqrt(fan_in) so each layer adds about unit size to the residual stream,
 * and the embedding's std of 2.5/sqrt(n_embd) gives logits of std ~2.5.
 * The residual stream must outgrow the embedding: with a tied output a
 * token's own row would otherwise dominate its logits (x . e = |e|^2 /
 * rms(x) after the norm), and the model would only repeat its input.
 * Norm weights are 1 +- 0.2 so a forward that forgot them would differ
 * measurably; biases (bloom, qwen2) likewise are of order 0.1.
 *
 * BLOOM normalises the embedding first, which makes a token's own row a
 * unit-size part of the residual stream: its LayerNorm weights are 0.1 +-
 * 0.02 so that, with BLOOM's tied output, the model does not just repeat
 * its input. The T5 table is a recency preference that grows with the
 * head (bias -0.1 * (h+1)/n_head * bucket) plus uniform noise of +-0.5, so
 * heads differ and the bucket matters.
 */
#include "model/mkmodel.h"
#include "model/mkmodel_internal.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "model/quant.h"

void model_mk_defaults(struct model_mk_params *p)
{
    *p = (struct model_mk_params){
        .arch = "llama",
        .n_embd = 256,
        .n_layer = 4,
        .n_head = 8,
        .n_kv_head = 4,
        .n_ff = 768,
        .n_vocab = 1024,
        .rope_dims = 0,
        .rope_theta = 10000.0f,
        .rms_eps = 1e-5f,
        .alibi_max_bias = 0.0f,
        .clamp_kqv = 0.0f,
        .t5_num_buckets = 32,
        .t5_max_distance = 128,
        .n_ctx_train = 4096,
        .tied = false,
        .type = GGML_TYPE_F32,
        .seed = 1,
    };
}

int model_mk_parse_type(const char *name, enum ggml_type *out)
{
    static const struct {
        const char *name;
        enum ggml_type type;
    } names[] = {{"f32", GGML_TYPE_F32},
                 {"f16", GGML_TYPE_F16},
                 {"bf16", GGML_TYPE_BF16},
                 {"q8_0", GGML_TYPE_Q8_0},
                 {"q4_0", GGML_TYPE_Q4_0},
                 {"q2_K", GGML_TYPE_Q2_K},
                 {"q3_K", GGML_TYPE_Q3_K},
                 {"q4_K", GGML_TYPE_Q4_K},
                 {"q5_K", GGML_TYPE_Q5_K},
                 {"q6_K", GGML_TYPE_Q6_K}};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (!strcmp(name, names[i].name)) {
            *out = names[i].type;
            return 0;
        }
    }
    return -EINVAL;
}

static bool is_qwen2(const struct model_mk_params *p)
{
    return !strcmp(p->arch, "qwen2");
}

static bool is_qwen3(const struct model_mk_params *p)
{
    return !strcmp(p->arch, "qwen3");
}

static bool is_phi3(const struct model_mk_params *p)
{
    return !strcmp(p->arch, "phi3");
}

static bool is_longrope(const struct model_mk_params *p)
{
    return p->rope_scaling && !strcmp(p->rope_scaling, "longrope");
}

static bool is_gemma(const struct model_mk_params *p)
{
    return !strcmp(p->arch, "gemma2") || !strcmp(p->arch, "gemma3");
}

int model_mk_head_dim(const struct model_mk_params *p)
{
    return p->head_dim ? p->head_dim : p->n_embd / p->n_head;
}

/* BLOOM and MPT: LayerNorm, fused QKV, GELU MLP, ALiBi. */
static bool is_bloom_family(const struct model_mk_params *p)
{
    return !strcmp(p->arch, "bloom") || !strcmp(p->arch, "mpt");
}

const char *model_mk_position(const struct model_mk_params *p)
{
    if (p->position)
        return p->position;
    return p->arch && is_bloom_family(p) ? "alibi" : "rope";
}

static bool pos_is(const struct model_mk_params *p, const char *kind)
{
    return !strcmp(model_mk_position(p), kind);
}

static float alibi_max_bias(const struct model_mk_params *p)
{
    return p->alibi_max_bias > 0.0f ? p->alibi_max_bias : 8.0f;
}

int model_mk_check(const struct model_mk_params *p, char *err, size_t errlen)
{
#define BAD(...)                                                                                   \
    do {                                                                                           \
        snprintf(err, errlen, __VA_ARGS__);                                                        \
        return -EINVAL;                                                                            \
    } while (0)
    if (!p->arch || (strcmp(p->arch, "llama") && strcmp(p->arch, "qwen2") &&
                     strcmp(p->arch, "qwen3") && strcmp(p->arch, "bloom") &&
                     strcmp(p->arch, "mpt") && !is_gemma(p) && !is_phi3(p)))
        BAD("arch must be llama, qwen2, qwen3, bloom, mpt, gemma2, gemma3 or phi3 (got '%s')",
            p->arch ? p->arch : "(null)");
    if (is_gemma(p) && (strcmp(model_mk_position(p), "rope") || p->rope_freqs ||
                        (p->rope_scaling && !strcmp(p->rope_scaling, "yarn"))))
        BAD("%s is RoPE without rope_freqs or YaRN", p->arch);
    if (!strcmp(p->arch, "gemma3") && p->sliding_window < 1)
        BAD("gemma3 needs a sliding window (got %d)", p->sliding_window);
    if ((p->attn_softcap != 0.0f || p->final_softcap != 0.0f) && strcmp(p->arch, "gemma2"))
        BAD("soft-caps are gemma2 options (arch %s)", p->arch);
    if (!(p->attn_softcap >= 0.0f && p->final_softcap >= 0.0f && p->rope_theta_swa >= 0.0f) ||
        !isfinite(p->attn_softcap) || !isfinite(p->final_softcap) || !isfinite(p->rope_theta_swa))
        BAD("soft-caps and the local rope base are >= 0");
    if (p->rope_theta_swa != 0.0f && strcmp(p->arch, "gemma3"))
        BAD("a local rope base is a gemma3 option (arch %s)", p->arch);
    if (p->head_dim < 0 || p->head_dim > 1024 || (p->head_dim && is_bloom_family(p)))
        BAD("head dim must be in [0, 1024], and 0 for bloom/mpt (got %d)", p->head_dim);
    if (p->preset && strcmp(p->preset, "retrieval"))
        BAD("preset must be retrieval (got '%s')", p->preset);
    if (p->preset && mk_retrieval_check(p, err, errlen))
        return -EINVAL;
    const char *pos = model_mk_position(p);
    if (strcmp(pos, "rope") && strcmp(pos, "alibi") && strcmp(pos, "t5"))
        BAD("position must be rope, alibi or t5 (got '%s')", pos);
    if (is_bloom_family(p) && strcmp(pos, "alibi"))
        BAD("%s attention is alibi (got position %s)", p->arch, pos);
    bool scaled = p->rope_scaling && strcmp(p->rope_scaling, "none") && !is_longrope(p);
    if (scaled && strcmp(p->rope_scaling, "linear") && strcmp(p->rope_scaling, "yarn"))
        BAD("rope scaling must be none, linear, yarn or longrope (got '%s')", p->rope_scaling);
    if (is_longrope(p) && (!is_phi3(p) || p->rope_orig_ctx < 1 || p->rope_freqs))
        BAD("longrope is phi3's, with the original context and without rope_freqs (arch %s, "
            "original context %d)", p->arch, p->rope_orig_ctx);
    if ((scaled || p->rope_freqs) && strcmp(pos, "rope"))
        BAD("rope scaling and rope_freqs need position rope (got %s)", pos);
    if (scaled && !(p->rope_scale_factor > 0.0f && isfinite(p->rope_scale_factor)))
        BAD("rope scale factor must be positive (got %g)", p->rope_scale_factor);
    if (scaled && !strcmp(p->rope_scaling, "yarn") && p->rope_orig_ctx < 1)
        BAD("yarn needs the original context length (got %d)", p->rope_orig_ctx);
    if (p->sliding_window < 0 || (p->sliding_window > 0 && is_bloom_family(p)))
        BAD("a sliding window is >= 0 and not for bloom or mpt (got %d, arch %s)",
            p->sliding_window, p->arch);
    if (!(p->alibi_max_bias >= 0.0f) || !isfinite(p->alibi_max_bias))
        BAD("alibi max bias must be a positive number, or 0 for 8 (got %g)", p->alibi_max_bias);
    if (!strcmp(p->arch, "bloom") && p->alibi_max_bias != 0.0f && p->alibi_max_bias != 8.0f)
        BAD("bloom's ALiBi slopes are fixed (max bias 8); got %g", p->alibi_max_bias);
    if (!(p->clamp_kqv >= 0.0f) || !isfinite(p->clamp_kqv))
        BAD("clamp kqv must be >= 0 (got %g)", p->clamp_kqv);
    if (p->clamp_kqv > 0.0f && strcmp(p->arch, "mpt"))
        BAD("clamp kqv is an mpt option (arch %s)", p->arch);
    if (!strcmp(pos, "t5")) {
        char why[200];
        if (p->t5_num_buckets < 4 || p->t5_num_buckets > 4096)
            BAD("t5 buckets must be in [4, 4096] (got %d)", p->t5_num_buckets);
        if (p->t5_max_distance > (1 << 20))
            BAD("t5 max distance must be at most 1048576 (got %d)", p->t5_max_distance);
        if (pos_t5_check(p->t5_num_buckets, p->t5_max_distance, false, why, sizeof(why)))
            BAD("t5: %s", why);
    }
    if (p->n_embd < 2 || p->n_embd > 65536)
        BAD("dim must be in [2, 65536] (got %d)", p->n_embd);
    if (p->n_layer < 1 || p->n_layer > 1024)
        BAD("layers must be in [1, 1024] (got %d)", p->n_layer);
    if (p->n_head < 1 || (p->n_embd % p->n_head && !p->head_dim))
        BAD("heads (%d) must be >= 1 and divide dim (%d), or give the head dim", p->n_head,
            p->n_embd);
    if (p->n_kv_head < 1 || p->n_head % p->n_kv_head)
        BAD("kv-heads (%d) must be >= 1 and divide heads (%d)", p->n_kv_head, p->n_head);
    int head_dim = model_mk_head_dim(p);
    if (head_dim % 2 && !strcmp(pos, "rope"))
        BAD("head dim dim/heads = %d must be even for RoPE", head_dim);
    int rope_dims = p->rope_dims ? p->rope_dims : head_dim;
    if (!strcmp(pos, "rope") && (rope_dims < 2 || rope_dims > head_dim || rope_dims % 2))
        BAD("rope dims must be even and in [2, head dim %d] (got %d)", head_dim, rope_dims);
    if (strcmp(pos, "rope") && p->rope_dims)
        BAD("rope dims apply to position rope only (position %s)", pos);
    if (p->n_ff < 1 || p->n_ff > (1 << 20))
        BAD("ff must be in [1, 1048576] (got %d)", p->n_ff);
    if (!p->preset && (p->n_vocab < 259 + 1 || p->n_vocab > (1 << 20)))
        BAD("vocab must be in [260, 1048576] (3 specials + 256 byte tokens + pieces; got %d)",
            p->n_vocab);
    if (!(p->rope_theta > 0.0f) || !(p->rms_eps > 0.0f))
        BAD("rope theta and rms eps must be positive");
    if (p->n_ctx_train < 1)
        BAD("context length must be positive (got %d)", p->n_ctx_train);
    if (p->type != GGML_TYPE_F32 && p->type != GGML_TYPE_F16 && p->type != GGML_TYPE_BF16 &&
        p->type != GGML_TYPE_Q8_0 && p->type != GGML_TYPE_Q4_0 && p->type != GGML_TYPE_Q2_K &&
        p->type != GGML_TYPE_Q3_K && p->type != GGML_TYPE_Q4_K && p->type != GGML_TYPE_Q5_K &&
        p->type != GGML_TYPE_Q6_K)
        BAD("type must be f32, f16, bf16, q8_0, q4_0, q2_K, q3_K, q4_K, q5_K or q6_K");
    int blk = qt_block_elems(p->type);
    if (blk > 1 && (p->n_embd % blk || p->n_ff % blk || (p->n_head * head_dim) % blk))
        BAD("type %s needs dim (%d) and ff (%d) to be multiples of %d", qt_type_name(p->type),
            p->n_embd, p->n_ff, blk);
    return 0;
#undef BAD
}

/* ------------------------------------------------------------------------
 * Vocabulary
 * ------------------------------------------------------------------------ */

/* Common English words, story words first; each is added with "▁" and with
 * every prefix, so SPM can merge its way up to the whole word. */
static const char *const words[] = {
    "the",     "a",       "and",    "to",      "was",      "he",      "she",     "it",      "of",
    "in",      "they",    "her",    "his",     "you",      "said",    "with",    "on",      "that",
    "for",     "day",     "I",      "is",      "one",      "big",     "had",     "time",    "Once",
    "upon",    "The",     "He",     "She",     "They",     "It",      "One",     "little",  "girl",
    "boy",     "named",   "Lily",   "Tom",     "Tim",      "Sue",     "Ben",     "Mia",     "Max",
    "mom",     "dad",     "friend", "friends", "play",     "played",  "happy",   "sad",     "very",
    "so",      "but",     "not",    "saw",     "went",     "go",      "wanted",  "want",    "were",
    "are",     "be",      "have",   "has",     "can",      "could",   "would",   "will",    "do",
    "did",     "all",     "what",   "when",    "where",    "who",     "how",     "why",     "up",
    "down",    "out",     "over",   "into",    "new",      "good",    "great",   "make",    "made",
    "see",     "look",    "looked", "get",     "got",      "come",    "came",    "know",    "think",
    "long",    "old",     "there",  "then",    "than",     "this",    "them",    "their",   "we",
    "me",      "my",      "your",   "at",      "by",       "from",    "as",      "an",      "or",
    "if",      "no",      "yes",    "like",    "liked",    "love",    "loved",   "dog",     "cat",
    "bird",    "ball",    "tree",   "sun",     "park",     "house",   "home",    "toy",     "toys",
    "car",     "box",     "red",    "blue",    "green",    "small",   "fun",     "nice",    "help",
    "helped",  "found",   "find",   "run",     "ran",      "jump",    "smiled",  "laughed", "felt",
    "feel",    "thought", "asked",  "took",    "gave",     "back",    "away",    "again",   "too",
    "some",    "many",    "every",  "after",   "before",   "because", "about",   "just",    "now",
    "each",    "other",   "more",   "most",    "man",      "woman",   "people",  "world",   "water",
    "food",    "tree",    "sky",    "night",   "morning",  "sleep",   "eat",     "ate",     "walk",
    "walked",  "talk",    "talked", "tell",    "told",     "began",   "start",   "started", "end",
    "learned", "best",    "always", "never",   "together", "careful", "scared",  "brave",   "kind",
    "hug",     "outside", "inside", "school",  "garden",   "flower",  "flowers", "ing",     "ed",
    "er",      "ly",      "tion",   "es",      "est",      "ful",     "ness",    "ment",    "able",
    "less",
};

/* Single characters that are pieces of their own. */
static const char *const chars =
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'\"-:;()";

#define SPM_SPACE "\xe2\x96\x81" /* U+2581, SentencePiece's word boundary */

static bool vocab_has(const struct mk_vocab *v, const char *s)
{
    /* Linear search is fine for the explicit pieces (a few hundred); the
     * n-gram fill below cannot collide with them except where checked. */
    for (int i = 0; i < v->n; i++)
        if (!strcmp(v->tok[i], s))
            return true;
    return false;
}

/* Add a piece if there is room and it is new. Returns -ENOMEM or 0. */
static int vocab_add(struct mk_vocab *v, const char *s, int type, bool check_dup)
{
    if (v->n >= v->cap || (check_dup && vocab_has(v, s)))
        return 0;
    char *c = strdup(s);
    if (!c)
        return -ENOMEM;
    v->tok[v->n] = c;
    v->type[v->n] = type;
    v->score[v->n] = 0.0f;
    v->n++;
    return 0;
}

static void vocab_free(struct mk_vocab *v)
{
    for (int i = 0; i < v->n; i++)
        free(v->tok[i]);
    free(v->tok);
    free(v->score);
    free(v->type);
}

/* Add "▁"+word's prefixes (2 chars up) and the word's own prefixes. */
static int add_word(struct mk_vocab *v, const char *w)
{
    char buf[64];
    size_t n = strlen(w);
    for (size_t k = 1; k <= n && k + 4 < sizeof(buf); k++) {
        snprintf(buf, sizeof(buf), SPM_SPACE "%.*s", (int)k, w);
        if (vocab_add(v, buf, 1, true))
            return -ENOMEM;
    }
    for (size_t k = 2; k <= n && k < sizeof(buf); k++) {
        snprintf(buf, sizeof(buf), "%.*s", (int)k, w);
        if (vocab_add(v, buf, 1, true))
            return -ENOMEM;
    }
    return 0;
}

/*
 * Fill with lowercase n-grams of growing length, each with and without the
 * boundary mark, until the vocabulary is full. An n-gram of length >= 2 can
 * equal an explicit piece; vocabularies big enough to reach the n-grams
 * are checked against a small set of explicit pieces only, so the check
 * costs O(explicit) per candidate.
 */
static int fill_ngrams(struct mk_vocab *v)
{
    int n_explicit = v->n;
    char gram[16], buf[24];
    for (int len = 2; len <= 6 && v->n < v->cap; len++) {
        long total = 1;
        for (int i = 0; i < len; i++)
            total *= 26;
        for (long k = 0; k < total && v->n < v->cap; k++) {
            long r = k;
            for (int i = len - 1; i >= 0; i--) {
                gram[i] = (char)('a' + r % 26);
                r /= 26;
            }
            gram[len] = '\0';
            for (int sp = 1; sp >= 0 && v->n < v->cap; sp--) {
                snprintf(buf, sizeof(buf), "%s%s", sp ? SPM_SPACE : "", gram);
                bool dup = false;
                for (int i = 0; i < n_explicit && !dup; i++)
                    dup = !strcmp(v->tok[i], buf);
                if (!dup && vocab_add(v, buf, 1, false))
                    return -ENOMEM;
            }
        }
    }
    return 0;
}

/*
 * The vocabulary: specials, byte tokens, characters, then list[0..n_list)
 * with their prefixes; then n-grams up to n_vocab when fill is set (the
 * seeded models), or nothing more (the retrieval preset, whose vocabulary is
 * exactly its words: v->n says how many pieces that is).
 */
static int vocab_build(struct mk_vocab *v, int n_vocab, const char *const *list, size_t n_list,
                       bool fill)
{
    memset(v, 0, sizeof(*v));
    v->cap = n_vocab;
    v->tok = calloc((size_t)n_vocab, sizeof(*v->tok));
    v->score = calloc((size_t)n_vocab, sizeof(*v->score));
    v->type = calloc((size_t)n_vocab, sizeof(*v->type));
    if (!v->tok || !v->score || !v->type)
        return -ENOMEM;
    int rc = 0;
    rc |= vocab_add(v, "<unk>", 2, false);
    rc |= vocab_add(v, "<s>", 3, false);
    rc |= vocab_add(v, "</s>", 3, false);
    for (int b = 0; b < 256 && !rc; b++) {
        char buf[8];
        snprintf(buf, sizeof(buf), "<0x%02X>", b);
        rc = vocab_add(v, buf, 6, false);
    }
    int first_normal = v->n;
    rc |= vocab_add(v, SPM_SPACE, 1, false);
    for (const char *c = chars; *c && !rc; c++) {
        char buf[2] = {*c, 0};
        rc = vocab_add(v, buf, 1, false);
    }
    for (size_t i = 0; i < n_list && !rc; i++)
        rc = add_word(v, list[i]);
    if (!rc && fill)
        rc = fill_ngrams(v);
    if (rc)
        return rc;
    /* Whatever the n-grams could not fill (vocabularies beyond ~10^8). */
    for (int i = v->n; fill && i < v->cap; i++) {
        char buf[32];
        snprintf(buf, sizeof(buf), "<extra_%d>", i);
        if (vocab_add(v, buf, 4, false))
            return -ENOMEM;
    }
    for (int i = first_normal; i < v->n; i++)
        v->score[i] = -(float)(i - first_normal);
    return 0;
}

/* ------------------------------------------------------------------------
 * Weights
 * ------------------------------------------------------------------------ */

/* splitmix64: tiny, seedable, and good enough for weights. */
uint64_t mk_rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float rng_unit(uint64_t *s)
{
    return (float)((double)(mk_rng_next(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
}

static uint64_t name_seed(uint64_t seed, const char *name)
{
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (const char *c = name; *c; c++)
        h = (h ^ (uint8_t)*c) * 1099511628211ULL;
    uint64_t s = seed ^ h;
    mk_rng_next(&s);
    return s;
}

struct writer_ctx {
    gguf_writer *w;
    const struct model_mk_params *p;
    const struct mk_vocab *v;
    float *buf;   /* scratch for the largest tensor in f32 */
    uint8_t *enc; /* scratch for the largest tensor encoded */
    char *err;
    size_t errlen;
};

/*
 * Add one tensor of ne0 x ne1 elements: centre + U(-1,1) * std * sqrt(3)
 * (uniform with the given standard deviation), encoded as type.
 */
static int add_tensor(struct writer_ctx *c, const char *name, enum ggml_type type, int ne0, int ne1,
                      float centre, float std, bool vocab_rows)
{
    uint64_t s = name_seed(c->p->seed, name);
    size_t n = (size_t)ne0 * (size_t)ne1;
    float a = std * 1.7320508f;
    for (size_t i = 0; i < n; i++)
        c->buf[i] = centre + a * rng_unit(&s);
    /* Rows of tokens that are not word pieces (byte fallback, controls)
     * get a quarter of the scale: their logits stay low, so sampling from
     * the untrained model gives word pieces rather than stray bytes that
     * decode to U+FFFD, and EOS rarely cuts a demo short. */
    for (int r = 0; vocab_rows && r < ne1; r++)
        if (c->v->type[r] != 1)
            for (int i = 0; i < ne0; i++)
                c->buf[(size_t)r * ne0 + i] *= 0.25f;
    size_t row = qt_row_bytes(type, ne0);
    for (int r = 0; r < ne1; r++) {
        int rc = qt_quantize_row(type, c->buf + (size_t)r * ne0, c->enc + (size_t)r * row, ne0);
        if (rc) {
            snprintf(c->err, c->errlen, "encoding %s as %s failed (%d)", name, qt_type_name(type),
                     rc);
            return rc;
        }
    }
    uint64_t ne[2] = {(uint64_t)ne0, (uint64_t)ne1};
    int rc =
        gguf_writer_add_tensor(c->w, name, type, ne1 > 1 ? 2 : 1, ne, c->enc, row * (size_t)ne1);
    if (rc)
        snprintf(c->err, c->errlen, "adding tensor %s failed (%d)", name, rc);
    return rc;
}

static int write_metadata(gguf_writer *w, const struct model_mk_params *p, const struct mk_vocab *v)
{
    char key[96];
    int head_dim = model_mk_head_dim(p);
    int rope_dims = p->rope_dims ? p->rope_dims : head_dim;
    const char *a = p->arch;
    const char *pos = model_mk_position(p);
    bool natural = !strcmp(pos, is_bloom_family(p) ? "alibi" : "rope");
    int rc = 0;
    char name[96];
    if (p->preset)
        snprintf(name, sizeof(name), "kvd-%s-%s", p->preset, pos);
    else
        snprintf(name, sizeof(name), "kvd-mkmodel-%s%s%s-%dx%d-seed%llu", a, natural ? "" : "-",
                 natural ? "" : pos, p->n_embd, p->n_layer, (unsigned long long)p->seed);
    rc |= gguf_writer_set_str(w, "general.architecture", a);
    rc |= gguf_writer_set_str(w, "general.name", name);
    /* llama.cpp's llama_ftype: all f32, mostly f16, q4_0, q8_0, bf16. */
    uint32_t ftype = p->type == GGML_TYPE_F16    ? 1
                     : p->type == GGML_TYPE_Q4_0 ? 2
                     : p->type == GGML_TYPE_Q8_0 ? 7
                     : p->type == GGML_TYPE_BF16 ? 32
                     : p->type == GGML_TYPE_Q2_K ? 10
                     : p->type == GGML_TYPE_Q3_K ? 11 /* the pure K types: llama.cpp's _S */
                     : p->type == GGML_TYPE_Q4_K ? 14
                     : p->type == GGML_TYPE_Q5_K ? 16
                     : p->type == GGML_TYPE_Q6_K ? 18
                                                 : 0;
    rc |= gguf_writer_set_u32(w, "general.file_type", ftype);
#define KEY(suffix) (snprintf(key, sizeof(key), "%s.%s", a, suffix), key)
    rc |= gguf_writer_set_u32(w, KEY("context_length"), (uint32_t)p->n_ctx_train);
    rc |= gguf_writer_set_u32(w, KEY("embedding_length"), (uint32_t)p->n_embd);
    rc |= gguf_writer_set_u32(w, KEY("block_count"), (uint32_t)p->n_layer);
    rc |= gguf_writer_set_u32(w, KEY("feed_forward_length"), (uint32_t)p->n_ff);
    rc |= gguf_writer_set_u32(w, KEY("attention.head_count"), (uint32_t)p->n_head);
    rc |= gguf_writer_set_u32(w, KEY("attention.head_count_kv"), (uint32_t)p->n_kv_head);
    if (p->head_dim) {
        rc |= gguf_writer_set_u32(w, KEY("attention.key_length"), (uint32_t)p->head_dim);
        rc |= gguf_writer_set_u32(w, KEY("attention.value_length"), (uint32_t)p->head_dim);
    }
    if (p->attn_softcap > 0.0f)
        rc |= gguf_writer_set_f32(w, KEY("attn_logit_softcapping"), p->attn_softcap);
    if (p->final_softcap > 0.0f)
        rc |= gguf_writer_set_f32(w, KEY("final_logit_softcapping"), p->final_softcap);
    if (p->rope_theta_swa > 0.0f)
        rc |= gguf_writer_set_f32(w, KEY("rope.freq_base_swa"), p->rope_theta_swa);
    if (!strcmp(pos, "rope")) {
        rc |= gguf_writer_set_u32(w, KEY("rope.dimension_count"), (uint32_t)rope_dims);
        rc |= gguf_writer_set_f32(w, KEY("rope.freq_base"), p->rope_theta);
    }
    if (is_longrope(p)) { /* as Phi-3's converter: no scaling type, an amplitude */
        double s = (double)p->n_ctx_train / p->rope_orig_ctx;
        double amp = s > 1.0 ? sqrt(1.0 + log(s) / log((double)p->rope_orig_ctx)) : 1.0;
        rc |= gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"),
                                  (uint32_t)p->rope_orig_ctx);
        rc |= gguf_writer_set_f32(w, KEY("rope.scaling.attn_factor"), (float)amp);
    } else if (p->rope_scaling && strcmp(p->rope_scaling, "none")) {
        rc |= gguf_writer_set_str(w, KEY("rope.scaling.type"), p->rope_scaling);
        rc |= gguf_writer_set_f32(w, KEY("rope.scaling.factor"), p->rope_scale_factor);
        if (!strcmp(p->rope_scaling, "yarn"))
            rc |= gguf_writer_set_u32(w, KEY("rope.scaling.original_context_length"),
                                      (uint32_t)p->rope_orig_ctx);
    }
    if (is_bloom_family(p))
        rc |= gguf_writer_set_f32(w, KEY("attention.layer_norm_epsilon"), p->rms_eps);
    else
        rc |= gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), p->rms_eps);
    /* ALiBi max_bias: mpt's key (llama.cpp reads it), and the same key for a
     * llama-shaped ALiBi model; bloom's is implied (8). */
    if (!strcmp(pos, "alibi") && strcmp(a, "bloom"))
        rc |= gguf_writer_set_f32(w, KEY("attention.max_alibi_bias"), alibi_max_bias(p));
    if (p->clamp_kqv > 0.0f)
        rc |= gguf_writer_set_f32(w, KEY("attention.clamp_kqv"), p->clamp_kqv);
    if (p->sliding_window > 0)
        rc |= gguf_writer_set_u32(w, KEY("attention.sliding_window"), (uint32_t)p->sliding_window);
    rc |= gguf_writer_set_u32(w, KEY("vocab_size"), (uint32_t)p->n_vocab);
#undef KEY
    if (!natural)
        rc |= gguf_writer_set_str(w, "kvd.position.kind", pos);
    if (!strcmp(pos, "t5")) {
        rc |= gguf_writer_set_u32(w, "kvd.t5.num_buckets", (uint32_t)p->t5_num_buckets);
        rc |= gguf_writer_set_u32(w, "kvd.t5.max_distance", (uint32_t)p->t5_max_distance);
    }
    rc |= gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    rc |= gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)v->tok,
                                  (uint64_t)v->n);
    rc |= gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", v->score, (uint64_t)v->n);
    rc |= gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", v->type, (uint64_t)v->n);
    rc |= gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1);
    rc |= gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2);
    rc |= gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", 0);
    rc |= gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true);
    rc |= gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", false);
    return rc ? -ENOMEM : 0;
}

/*
 * The T5 bias table blk.0.attn_rel_b.weight, [n_head, num_buckets] in GGUF
 * order (row = bucket, n_head values): a recency preference per head plus
 * noise.
 */
static int add_t5_table(struct writer_ctx *c)
{
    const char *name = "blk.0.attn_rel_b.weight";
    const struct model_mk_params *p = c->p;
    int H = p->n_head, nb = p->t5_num_buckets;
    uint64_t s = name_seed(p->seed, name);
    for (int b = 0; b < nb; b++)
        for (int h = 0; h < H; h++)
            c->buf[(size_t)b * H + h] =
                -0.1f * (float)(h + 1) / (float)H * (float)b + 0.5f * rng_unit(&s);
    uint64_t ne[2] = {(uint64_t)H, (uint64_t)nb};
    int rc = gguf_writer_add_tensor(c->w, name, GGML_TYPE_F32, 2, ne, c->buf,
                                    sizeof(float) * (size_t)H * (size_t)nb);
    if (rc)
        snprintf(c->err, c->errlen, "adding tensor %s failed (%d)", name, rc);
    return rc;
}

/*
 * BLOOM and MPT, in llama.cpp's names: a fused QKV matrix (rows of Q, K,
 * V), a GELU MLP, LayerNorms; BLOOM adds every bias and the embedding
 * LayerNorm, and is always tied.
 */
static int write_bloom_tensors(struct writer_ctx *c)
{
    const struct model_mk_params *p = c->p;
    bool bloom = !strcmp(p->arch, "bloom");
    int d = p->n_embd, hd = d / p->n_head;
    int q_dim = p->n_head * hd, kv_dim = p->n_kv_head * hd;
    float s_in = 1.0f / sqrtf((float)d);
    float s_emb = 2.5f / sqrtf((float)d);
    const float norm_std = 0.2f / 1.7320508f;
    enum ggml_type t = p->type;
    char name[64];
    int rc;
#define ADD(type, ne0, ne1, centre, std)                                                           \
    do {                                                                                           \
        if ((rc = add_tensor(c, name, type, ne0, ne1, centre, std, false)))                        \
            return rc;                                                                             \
    } while (0)
#define NAME(...) snprintf(name, sizeof(name), __VA_ARGS__)

    NAME("token_embd.weight");
    if ((rc = add_tensor(c, name, t, d, p->n_vocab, 0.0f, s_emb, true)))
        return rc;
    if (bloom) {
        NAME("token_embd_norm.weight");
        ADD(GGML_TYPE_F32, d, 1, 0.1f, 0.1f * norm_std);
        NAME("token_embd_norm.bias");
        ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.02f);
    }
    for (int l = 0; l < p->n_layer; l++) {
        NAME("blk.%d.attn_norm.weight", l);
        ADD(GGML_TYPE_F32, d, 1, 1.0f, norm_std);
        if (bloom) {
            NAME("blk.%d.attn_norm.bias", l);
            ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.1f);
        }
        NAME("blk.%d.attn_qkv.weight", l);
        ADD(t, d, q_dim + 2 * kv_dim, 0.0f, 1.2f * s_in);
        if (bloom) {
            NAME("blk.%d.attn_qkv.bias", l);
            ADD(GGML_TYPE_F32, q_dim + 2 * kv_dim, 1, 0.0f, 0.2f);
        }
        NAME("blk.%d.attn_output.weight", l);
        ADD(t, q_dim, d, 0.0f, 2.0f / sqrtf((float)q_dim));
        if (bloom) {
            NAME("blk.%d.attn_output.bias", l);
            ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.1f);
        }
        NAME("blk.%d.ffn_norm.weight", l);
        ADD(GGML_TYPE_F32, d, 1, 1.0f, norm_std);
        if (bloom) {
            NAME("blk.%d.ffn_norm.bias", l);
            ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.1f);
        }
        NAME("blk.%d.ffn_up.weight", l);
        ADD(t, d, p->n_ff, 0.0f, s_in);
        if (bloom) {
            NAME("blk.%d.ffn_up.bias", l);
            ADD(GGML_TYPE_F32, p->n_ff, 1, 0.0f, 0.2f);
        }
        NAME("blk.%d.ffn_down.weight", l);
        ADD(t, p->n_ff, d, 0.0f, 2.0f / sqrtf((float)p->n_ff));
        if (bloom) {
            NAME("blk.%d.ffn_down.bias", l);
            ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.1f);
        }
    }
    NAME("output_norm.weight");
    ADD(GGML_TYPE_F32, d, 1, 1.0f, norm_std);
    if (bloom) {
        NAME("output_norm.bias");
        ADD(GGML_TYPE_F32, d, 1, 0.0f, 0.1f);
    } else if (!p->tied) {
        NAME("output.weight");
        if ((rc = add_tensor(c, name, t, d, p->n_vocab, 0.0f, s_emb, true)))
            return rc;
    }
#undef ADD
#undef NAME
    return 0;
}

/*
 * rope_freqs.weight as Llama 3.1's converter writes it from the "llama3"
 * scaling (factor 8, low_freq_factor 1, high_freq_factor 4, 8192 original
 * tokens): 1 for pairs whose wavelength is under 8192/4 tokens, 8 for those
 * over 8192, a smooth blend between.
 */
static int add_rope_freqs(struct writer_ctx *c)
{
    const struct model_mk_params *p = c->p;
    int hd = model_mk_head_dim(p), dims = p->rope_dims ? p->rope_dims : hd;
    const double factor = 8, lo = 1, hi = 4, old_ctx = 8192;
    for (int i = 0; i < dims / 2; i++) {
        double freq = pow(p->rope_theta, -2.0 * i / dims), wavelen = 2 * M_PI / freq;
        double f = 1;
        if (wavelen > old_ctx / lo) {
            f = factor;
        } else if (wavelen >= old_ctx / hi) {
            double smooth = (old_ctx / wavelen - lo) / (hi - lo);
            f = 1 / ((1 - smooth) / factor + smooth);
        }
        c->buf[i] = (float)f;
    }
    uint64_t ne[1] = {(uint64_t)(dims / 2)};
    int rc = gguf_writer_add_tensor(c->w, "rope_freqs.weight", GGML_TYPE_F32, 1, ne, c->buf,
                                    sizeof(float) * (size_t)(dims / 2));
    if (rc)
        snprintf(c->err, c->errlen, "adding tensor rope_freqs.weight failed (%d)", rc);
    return rc;
}

/*
 * Phi-3's LongRoPE tables, shaped as the 128k checkpoints' are: short
 * factors near 1, long ones growing from 1 to 30 over the pairs (the
 * slowest pairs stretched most).
 */
static int add_longrope(struct writer_ctx *c)
{
    const struct model_mk_params *p = c->p;
    int hd = model_mk_head_dim(p), half = (p->rope_dims ? p->rope_dims : hd) / 2;
    static const char *const names[2] = {"rope_factors_long.weight", "rope_factors_short.weight"};
    for (int k = 0; k < 2; k++) {
        for (int i = 0; i < half; i++) {
            double x = half > 1 ? (double)i / (half - 1) : 0.0;
            c->buf[i] = (float)(k == 0 ? 1.0 + 29.0 * x * x : 1.0 + 0.1 * x);
        }
        uint64_t ne[1] = {(uint64_t)half};
        int rc = gguf_writer_add_tensor(c->w, names[k], GGML_TYPE_F32, 1, ne, c->buf,
                                        sizeof(float) * (size_t)half);
        if (rc) {
            snprintf(c->err, c->errlen, "adding tensor %s failed (%d)", names[k], rc);
            return rc;
        }
    }
    return 0;
}

static int write_tensors(struct writer_ctx *c)
{
    if (is_bloom_family(c->p))
        return write_bloom_tensors(c);

    const struct model_mk_params *p = c->p;
    int d = p->n_embd, hd = model_mk_head_dim(p);
    int q_dim = p->n_head * hd, kv_dim = p->n_kv_head * hd;
    float s_in = 1.0f / sqrtf((float)d);
    /* Gemma multiplies the embedding by sqrt(d): rows of scale 1/sqrt(d) keep
     * its activations where the others' are. */
    float s_emb = (is_gemma(p) ? 1.0f : 2.5f) / sqrtf((float)d);
    enum ggml_type t = p->type;
    char name[64];
    int rc;

#define ADD(type, ne0, ne1, centre, std)                                                           \
    do {                                                                                           \
        if ((rc = add_tensor(c, name, type, ne0, ne1, centre, std, false)))                        \
            return rc;                                                                             \
    } while (0)
#define NAME(...) snprintf(name, sizeof(name), __VA_ARGS__)

    NAME("token_embd.weight");
    if ((rc = add_tensor(c, name, t, d, p->n_vocab, 0.0f, s_emb, true)))
        return rc;
    if (p->rope_freqs && (rc = add_rope_freqs(c)))
        return rc;
    if (is_longrope(p) && (rc = add_longrope(c)))
        return rc;
    for (int l = 0; l < p->n_layer; l++) {
        NAME("blk.%d.attn_norm.weight", l);
        ADD(GGML_TYPE_F32, d, 1, 1.0f, 0.2f / 1.7320508f);
        if (is_phi3(p)) { /* fused: rows of Q, K, V */
            NAME("blk.%d.attn_qkv.weight", l);
            ADD(t, d, q_dim + 2 * kv_dim, 0.0f, 1.2f * s_in);
        } else {
            NAME("blk.%d.attn_q.weight", l);
            ADD(t, d, q_dim, 0.0f, 1.2f * s_in);
            NAME("blk.%d.attn_k.weight", l);
            ADD(t, d, kv_dim, 0.0f, 1.2f * s_in);
            NAME("blk.%d.attn_v.weight", l);
            ADD(t, d, kv_dim, 0.0f, s_in);
        }
        if (is_qwen2(p)) {
            NAME("blk.%d.attn_q.bias", l);
            ADD(GGML_TYPE_F32, q_dim, 1, 0.0f, 0.2f);
            NAME("blk.%d.attn_k.bias", l);
            ADD(GGML_TYPE_F32, kv_dim, 1, 0.0f, 0.2f);
            NAME("blk.%d.attn_v.bias", l);
            ADD(GGML_TYPE_F32, kv_dim, 1, 0.0f, 0.2f);
        }
        if (is_qwen3(p) || !strcmp(p->arch, "gemma3")) {
            NAME("blk.%d.attn_q_norm.weight", l);
            ADD(GGML_TYPE_F32, hd, 1, 1.0f, 0.2f / 1.7320508f);
            NAME("blk.%d.attn_k_norm.weight", l);
            ADD(GGML_TYPE_F32, hd, 1, 1.0f, 0.2f / 1.7320508f);
        }
        NAME("blk.%d.attn_output.weight", l);
        ADD(t, q_dim, d, 0.0f, 2.0f / sqrtf((float)q_dim));
        if (is_gemma(p)) { /* the post-norms, (1 + w) as the converter writes them */
            NAME("blk.%d.post_attention_norm.weight", l);
            ADD(GGML_TYPE_F32, d, 1, 0.5f, 0.2f / 1.7320508f);
            NAME("blk.%d.post_ffw_norm.weight", l);
            ADD(GGML_TYPE_F32, d, 1, 0.5f, 0.2f / 1.7320508f);
        }
        NAME("blk.%d.ffn_norm.weight", l);
        ADD(GGML_TYPE_F32, d, 1, 1.0f, 0.2f / 1.7320508f);
        if (is_phi3(p)) { /* fused: the gate's rows, then up's */
            NAME("blk.%d.ffn_up.weight", l);
            ADD(t, d, 2 * p->n_ff, 0.0f, s_in);
        } else {
            NAME("blk.%d.ffn_gate.weight", l);
            ADD(t, d, p->n_ff, 0.0f, s_in);
            NAME("blk.%d.ffn_up.weight", l);
            ADD(t, d, p->n_ff, 0.0f, s_in);
        }
        NAME("blk.%d.ffn_down.weight", l);
        ADD(t, p->n_ff, d, 0.0f, 2.0f / sqrtf((float)p->n_ff));
        if (l == 0 && pos_is(p, "t5") && (rc = add_t5_table(c)))
            return rc;
    }
    NAME("output_norm.weight");
    ADD(GGML_TYPE_F32, d, 1, 1.0f, 0.2f / 1.7320508f);
    if (!p->tied && !is_gemma(p)) { /* Gemma's output is the embedding */
        NAME("output.weight");
        if ((rc = add_tensor(c, name, t, d, p->n_vocab, 0.0f, s_emb, true)))
            return rc;
    }
#undef ADD
#undef NAME
    return 0;
}

/* A preset: its own words as the vocabulary (n_vocab is however many
 * pieces they make), the metadata as for any model, computed tensors. */
static int write_preset(const struct model_mk_params *p, const char *path, char *err,
                        size_t errlen)
{
    struct mk_vocab v;
    gguf_writer *w = NULL;
    int rc = vocab_build(&v, 1 << 16, mk_retrieval_words, mk_retrieval_n_words, false);
    if (rc) {
        snprintf(err, errlen, "out of memory building the vocabulary");
        goto out;
    }
    struct model_mk_params q = *p;
    q.n_vocab = v.n;
    w = gguf_writer_create();
    rc = w ? write_metadata(w, &q, &v) : -ENOMEM;
    if (rc) {
        snprintf(err, errlen, "out of memory writing metadata");
        goto out;
    }
    rc = mk_retrieval_tensors(w, &q, &v, err, errlen);
    if (rc == 0)
        rc = gguf_writer_write(w, path, err, errlen);
out:
    gguf_writer_destroy(w);
    vocab_free(&v);
    return rc;
}

int model_mk_write(const struct model_mk_params *p, const char *path, char *err, size_t errlen)
{
    int rc = model_mk_check(p, err, errlen);
    if (rc)
        return rc;
    if (p->preset)
        return write_preset(p, path, err, errlen);
    struct mk_vocab v;
    struct writer_ctx c = {.p = p, .v = &v, .err = err, .errlen = errlen};
    rc = vocab_build(&v, p->n_vocab, words, sizeof(words) / sizeof(words[0]), true);
    if (rc) {
        snprintf(err, errlen, "out of memory building the vocabulary");
        goto out_vocab;
    }

    /* Scratch for the largest tensor: the embedding/output or an FFN matrix. */
    int hd = model_mk_head_dim(p);
    size_t big = (size_t)p->n_embd * (size_t)p->n_vocab;
    size_t ffn = 2 * (size_t)p->n_embd * (size_t)p->n_ff; /* phi3's fused gate/up */
    size_t attn = (size_t)p->n_embd * (size_t)((p->n_head + 2 * p->n_kv_head) * hd);
    size_t t5 = (size_t)p->n_head * (size_t)p->t5_num_buckets;
    if (ffn > big)
        big = ffn;
    if (attn > big)
        big = attn;
    if (t5 > big)
        big = t5;
    c.buf = malloc(big * sizeof(float));
    c.enc = malloc(big * sizeof(float)); /* every written type is at most 4 bytes/element */
    c.w = gguf_writer_create();
    if (!c.buf || !c.enc || !c.w) {
        snprintf(err, errlen, "out of memory (%zu-element scratch)", big);
        rc = -ENOMEM;
        goto out_buf;
    }
    rc = write_metadata(c.w, p, &v);
    if (rc) {
        snprintf(err, errlen, "out of memory writing metadata");
        goto out_buf;
    }
    rc = write_tensors(&c);
    if (rc)
        goto out_buf;
    rc = gguf_writer_write(c.w, path, err, errlen);

out_buf:
    gguf_writer_destroy(c.w);
    free(c.buf);
    free(c.enc);
out_vocab:
    vocab_free(&v);
    return rc;
}
