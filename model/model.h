/*
 * model.h - a decoder-only transformer loaded from GGUF, run over the paged
 * KV cache.
 *
 * A model is immutable after model_load: weights are mmap'd, the tokenizer
 * and position scheme are built once. All mutable state of a forward pass
 * lives in a model_ctx (activation buffers sized for the largest batch,
 * the attention kernel's workspace), owned by the one engine thread that
 * also owns the kv_cache. Parallelism is the thread pool (cpu/pool.h) inside
 * model_forward.
 *
 * One model_forward call processes a batch of tokens drawn from several
 * sequences: prefill chunks and single decode tokens together. For each
 * sequence it appends the new tokens to the sequence's pages (keys stored
 * before rotation, so eviction and renumbering never rewrite them), runs the
 * fused attention kernel over each sequence's cache, and produces logits
 * only for the tokens that asked for them.
 */
#ifndef KVD_MODEL_H
#define KVD_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attention/attention.h"
#include "cache/kv_cache.h"

typedef struct model model;
typedef struct model_ctx model_ctx;

struct model_params {
    const char *path;        /* GGUF file */
    bool vocab_only;         /* load the tokenizer alone: a vocabulary-only file (no
                                tensors) loads, and model_ctx_create refuses the model */
    const char *tokenizer_pre; /* NULL, or the pre-tokenizer to use instead of the file's
                                  tokenizer.ggml.pre (the operator's explicit choice) */
    /* Used only where the file lacks them (0 = no override). */
    float alibi_max_bias;
    int t5_num_buckets;
    int t5_max_distance;
    int n_ctx; /* the longest sequence the caller will run, 0 = the file's context_length:
                  Phi-3 takes its long RoPE factors when it exceeds the original context */
    bool small_pages; /* the repacked weights, and the KV pool of a cache shaped by
                         model_kv_shape, in 4 KiB pages, not advised as 2 MiB
                         (cpu/mem.h's switch; KVD_HUGE_PAGES overrides either way) */
};

/* What a loaded model is, for logs, /v1/models and cache sizing. */
struct model_info {
    const char *arch;        /* "llama", "qwen2", "bloom", "mpt", ... (borrowed) */
    const char *name;        /* general.name or the file's base name (borrowed) */
    enum pos_kind pos;       /* position scheme of attention */
    const char *weight_type; /* dominant tensor type, e.g. "q8_0" (borrowed) */
    int n_vocab;
    int n_ctx_train;         /* training context length from metadata (0 if absent) */
    int n_embd, n_layer, n_head, n_kv_head, head_dim, n_ff; /* 0 when vocab_only */
    float attn_softcap;      /* 0, or the attention logit soft-cap the kernel applies (Gemma 2) */
    int rope_orig_ctx;       /* Phi-3 LongRoPE: the original context the two factor tables
                                are chosen by, 0 when the file has no such tables */
    bool rope_long;          /* ... and the long table is the one in use (else the short) */
    const char *tokenizer;      /* pre-tokenizer family ("llama3", ...; "spm") (borrowed) */
    const char *tokenizer_note; /* NULL, or what the caller should print about the
                                   tokenizer (missing or overridden pre-tokenizer) */
};

/* Load and validate a model. NULL with the reason (file, tensor, key) in err. */
model *model_load(const struct model_params *params, char *err, size_t errlen);
void model_free(model *m);
void model_get_info(const model *m, struct model_info *info);
/*
 * The longest sequence the caller will run, once its prompts are known
 * (model_params.n_ctx at load time is the same choice made earlier; 0 =
 * the file's context_length). It decides Phi-3's LongRoPE table: the long
 * one when n_ctx exceeds the original context. Call it before the first
 * model_ctx_create: contexts take the frequencies when they are created.
 * No effect on a model without the two tables.
 */
void model_set_n_ctx(model *m, int n_ctx);
/* The rule of that choice, for callers holding only a model_info (a config
 * reload checks a new budget against the table in use): whether n_ctx (0 =
 * n_ctx_train) takes the long table of a file whose original context is
 * rope_orig_ctx. False when rope_orig_ctx is 0 (no tables). */
bool model_rope_long(const struct model_info *info, int n_ctx);

/* Fill the shape fields of cache params (n_layer, n_kv_head, head_dim). */
void model_kv_shape(const model *m, struct kv_cache_params *p);
/* A 64-bit name for the model as loaded (fingerprint.c: metadata, tensors'
 * metadata and edges, operator overrides): equal for the same file loaded
 * the same way, different otherwise with near certainty. */
uint64_t model_fingerprint(const model *m);

/* --- tokens -------------------------------------------------------------- */

/*
 * Encode text. Writes at most max ids; returns the full encoding's length
 * (call again with a bigger buffer if it exceeds max), or < 0 on error.
 */
int model_tokenize(const model *m, const char *text, size_t len, bool add_bos, int32_t *out,
                   int max);
/* model_tokenize, but control tokens written in the text ("<|im_start|>",
 * "<|eot_id|>") become those tokens: for prompts rendered by a chat
 * template, never for user text. */
int model_tokenize_special(const model *m, const char *text, size_t len, bool add_bos,
                           int32_t *out, int max);
/* model_tokenize_special for text that continues earlier text (no BOS, no
 * space prefix at its start; see tok_encode_continuation). */
int model_tokenize_continuation(const model *m, const char *text, size_t len, int32_t *out,
                                int max);
/* model_tokenize (special: model_tokenize_special) that may stop once the
 * encoding has more than max ids: a return above max means only "more". */
int model_tokenize_upto(const model *m, const char *text, size_t len, bool add_bos, bool special,
                        int32_t *out, int max);
/* The most bytes of text one token stands for (tok_max_token_bytes): a text
 * of n bytes has at least ceil(n / this) tokens. */
int model_max_token_bytes(const model *m);
bool model_add_bos(const model *m);   /* whether prompts start with BOS */
int32_t model_bos(const model *m);
bool model_is_eog(const model *m, int32_t token); /* end of generation (EOS, EOT) */
int32_t model_eos(const model *m);   /* -1 if the vocabulary has none */
int32_t model_unk(const model *m);   /* the unknown token, -1 if none */
/* A token's text as the vocabulary stores it ("<s>", "<|im_end|>"), borrowed;
 * NULL outside the vocabulary. For control tokens this is the text chat
 * templates write as bos_token / eos_token. */
const char *model_token_text(const model *m, int32_t id, size_t *len);

/*
 * The chat template the file carries: tokenizer.chat_template, or with name
 * given tokenizer.chat_template.NAME. Borrowed from the model's mapping (not
 * NUL-terminated; *len is its length); NULL when the file has none.
 */
const char *model_chat_template(const model *m, const char *name, size_t *len);

/*
 * Streaming detokeniser: push token ids one at a time, get back only
 * complete UTF-8 characters; partial bytes are held until completed.
 */
typedef struct model_detok model_detok;
model_detok *model_detok_create(const model *m);
void model_detok_destroy(model_detok *d);
/* Append the text of `token` to out (cap bytes); returns bytes written or < 0. */
int model_detok_push(model_detok *d, int32_t token, char *out, size_t cap);
/* Emit what is held back (invalid leftovers become U+FFFD). */
int model_detok_flush(model_detok *d, char *out, size_t cap);

/* --- forward ------------------------------------------------------------- */

/*
 * Per-engine forward state. max_batch_tokens bounds the tokens of one
 * model_forward call (all sequences together). n_threads: compute threads
 * (0 = the default count, cpu/pool.h). Returns NULL with the reason in err.
 */
model_ctx *model_ctx_create(const model *m, int max_batch_tokens, int n_threads, char *err,
                            size_t errlen);
void model_ctx_destroy(model_ctx *ctx);

/* One sequence's part of a batch. */
struct model_batch_seq {
    kv_seq *seq;            /* the sequence the tokens belong to */
    const int32_t *tokens;  /* [n_tokens] new tokens */
    int n_tokens;
    int first;              /* logical index of the slot kv_reserve gave the first one */
    float *logits;          /* NULL, or [n_vocab]: logits after the last new token */
};

/*
 * Run the model over a batch whose slots are reserved (kv_reserve, by the
 * engine): for every sequence, write the K and V of its new tokens into
 * slots first .. first + n_tokens - 1, attend over its cache, and compute
 * the logits requested. The cache is not otherwise touched: no append, no
 * eviction (H2O sequences accumulate attention mass). Returns 0, or
 * -EINVAL for a bad batch (token id outside the vocabulary, too many
 * tokens, slots that are not these tokens' reserved ones, another cache's
 * shape), -ENOMEM for scratch, or a kernel error; the caller then takes
 * the reservation back (kv_reserve_undo).
 */
int model_forward(model_ctx *ctx, const struct model_batch_seq *seqs, int n_seqs);

/*
 * The one-call form for tools and tests that drive a model without the
 * engine: kv_reserve for the batch (filling each entry's `first`), then
 * model_forward, and kv_reserve_undo if that fails. Returns 0 or the code
 * of the step that failed; *failed_seq (may be NULL) as kv_reserve sets
 * it. A refused reservation leaves every sequence of the batch as it was.
 */
int model_reserve_forward(model_ctx *ctx, const struct model_batch_seq *seqs, int n_seqs,
                          int *failed_seq);

/* --- sampling ------------------------------------------------------------ */

struct model_sampling {
    float temperature;       /* 0 = greedy */
    int top_k;               /* 0 = off */
    float top_p;             /* 1 = off */
    float min_p;             /* 0 = off */
    float repeat_penalty;    /* 1 = off; llama.cpp style: divide positive logits */
    float presence_penalty;  /* 0 = off; OpenAI style */
    float frequency_penalty; /* 0 = off; OpenAI style */
    int penalty_last_n;      /* tokens of history the penalties look at */
    uint64_t seed;
};

void model_sampling_defaults(struct model_sampling *s);

typedef struct model_sampler model_sampler;
model_sampler *model_sampler_create(const struct model_sampling *s, int n_vocab);
void model_sampler_destroy(model_sampler *smp);
/*
 * Pick the next token from logits (modified in place). history: the
 * tokens generated so far (and the prompt), for penalties. Deterministic
 * for a given seed and call sequence.
 */
int32_t model_sample(model_sampler *smp, float *logits, const int32_t *history, int n_history);

/*
 * The kernels a forward pass runs on, in one line for logs and answers:
 * the kernel level (cpu/cpu.h) and whether it was forced, then each
 * module's path, e.g. "avx512 (the best this CPU and build have): matmul
 * avx512-vnni, K formats avx512-vnni, read-only formats avx2, attention
 * avx512, q8_0 keys avx512-vnni" (model/kernels.c). Returns buf; a
 * buffer of MODEL_KERNELS_LINE bytes holds the longest line.
 */
#define MODEL_KERNELS_LINE 768
const char *model_kernels_describe(char *buf, size_t len);

/* What loading did to m's weights for the prefill kernels: how many
 * matrices were repacked, for which kernels, in how long, the memory owned
 * ("30 matrices repacked for avx512-vnni 16-row in 80 ms: 12.3 MiB owned,
 * the mapped rows released"), or that they are used as stored. Returns buf. */
const char *model_pack_describe(const model *m, char *buf, size_t len);

#endif /* KVD_MODEL_H */
