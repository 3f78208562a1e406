/*
 * mkmodel.h - write small seeded GGUF models of every architecture and
 * position scheme kvd runs.
 *
 * `kvd mkmodel`, the default model of `make run` and the test fixtures all
 * come from here. A model is a function of its parameters and seed alone:
 * the same parameters write the same bytes. Files use llama.cpp's metadata
 * keys and tensor names (llama, qwen2, bloom, mpt), so any GGUF reader can
 * open them, and carry an SPM-style vocabulary (<unk>, <s>, </s>, the 256
 * byte-fallback tokens and a few hundred common English pieces with scores)
 * in which any text tokenizes and decodes back.
 *
 * Architectures and position schemes:
 *   llama, qwen2, qwen3  RoPE (default; linear or YaRN scaling and Llama
 *                  3.1's rope_freqs.weight on request); or an offset-only bias, kvd's own
 *                  metadata: kvd.position.kind = "alibi" (with
 *                  <arch>.attention.max_alibi_bias) or "t5" (kvd.t5.num_buckets,
 *                  kvd.t5.max_distance and the one table
 *                  blk.0.attn_rel_b.weight);
 *   bloom          ALiBi with BLOOM's slopes (max_bias 8), every bias, the
 *                  embedding LayerNorm, tied output (as BLOOM checkpoints are);
 *   mpt            ALiBi with mpt.attention.max_alibi_bias, no biases,
 *                  optional mpt.attention.clamp_kqv;
 *   gemma2, gemma3 RoPE (NeoX pairs; linear scaling on request), post-norms
 *                  after attention and MLP, a GELU-gated MLP, tied output,
 *                  local and global layers (attention.sliding_window);
 *                  gemma2 the two soft-caps when asked, gemma3 the q/k head
 *                  norms and rope.freq_base_swa when asked;
 *   phi3           llama with fused attn_qkv and ffn_up (gate rows, then up),
 *                  NeoX pairs; "longrope" writes Phi-3's two factor tables,
 *                  the original context and the amplitude, no scaling type.
 *
 * Internal to kvd (cli/cmd_mkmodel.c, tests, benchmarks); not part of
 * the public model API in model.h.
 */
#ifndef KVD_MKMODEL_H
#define KVD_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

struct model_mk_params {
    const char *preset;   /* NULL, or "retrieval": computed weights, not seeded ones
                             (model_mk_preset fills the rest; mkmodel_retrieval.c) */
    const char *arch;     /* "llama", "qwen2" (adds q/k/v biases, NeoX RoPE pairs),
                             "qwen3" (per-head q/k RMSNorm, NeoX pairs), "bloom", "mpt",
                             "gemma2", "gemma3" or "phi3" */
    const char *position; /* "rope", "alibi" or "t5"; NULL = the architecture's own
                             (rope for llama/qwen2, alibi for bloom/mpt) */
    int n_embd;           /* model width */
    int n_layer;          /* transformer blocks */
    int n_head;           /* query heads */
    int head_dim;         /* 0: n_embd / n_head; else written as attention.key_length and
                             value_length (Gemma's 256 whatever the width) */
    int n_kv_head;        /* key/value heads; divides n_head */
    int n_ff;             /* feed-forward hidden width (SwiGLU, or GELU for bloom/mpt) */
    int n_vocab;          /* vocabulary size, >= 259 (specials + byte tokens + one piece);
                             a preset's is its words' (0 here) */
    int rope_dims;        /* rotated dims per head (even, <= head_dim); 0 = head_dim */
    float rope_theta;     /* RoPE base */
    const char *rope_scaling; /* NULL or "none", "linear", "yarn": <arch>.rope.scaling.type;
                                 "longrope" (phi3): rope_factors_long/short.weight */
    float rope_scale_factor;  /* rope.scaling.factor (linear, yarn), > 0 */
    int rope_orig_ctx;        /* yarn, longrope: rope.scaling.original_context_length */
    int sliding_window;       /* > 0: <arch>.attention.sliding_window (Mistral: every layer;
                                 Gemma: the local layers; gemma3 needs one); 0 = none */
    float attn_softcap;       /* gemma2, > 0: <arch>.attn_logit_softcapping; 0 = not written */
    float final_softcap;      /* gemma2, > 0: <arch>.final_logit_softcapping; 0 = not written */
    float rope_theta_swa;     /* gemma3, > 0: <arch>.rope.freq_base_swa; 0 = not written */
    bool rope_freqs;          /* write rope_freqs.weight with Llama 3.1's factors (the
                                 "llama3" scaling: factor 8, low 1, high 4, 8192 tokens) */
    float rms_eps;        /* norm epsilon: RMSNorm's, or LayerNorm's for bloom/mpt */
    float alibi_max_bias; /* ALiBi slopes' max_bias (mpt, llama/qwen2 with alibi);
                             0 = 8; bloom's is always 8 */
    float clamp_kqv;      /* mpt: q/k/v clamp written when > 0; 0 = none */
    int t5_num_buckets;   /* t5: buckets of the bias table, 4..4096 */
    int t5_max_distance;  /* t5: distance where the last bucket saturates */
    int n_ctx_train;      /* written as <arch>.context_length */
    bool tied;            /* no output.weight: logits use token_embd.weight (bloom: always) */
    enum ggml_type type;  /* 2-D weights: F32, F16, BF16, Q8_0, Q4_0, or Q4_K / Q5_K / Q6_K
                             (rows of a multiple of 256) (norms stay F32) */
    uint64_t seed;        /* every weight derives from it */
};

/*
 * The parameters of a preset: "retrieval" (a two-layer model whose weights
 * are computed so that it copies what followed an earlier occurrence of
 * its current context: `... the secret code is 8 3 1 4 7 ... the secret code
 * is` continues ` 8 3 1 4 7`) with position "rope", "alibi" or "t5" (NULL:
 * rope). 0, or -EINVAL with the reason in err.
 */
int model_mk_preset(struct model_mk_params *p, const char *preset, const char *position, char *err,
                    size_t errlen);

/* The default model: llama with RoPE, dim 256, 4 layers, 8 heads, 4 KV heads,
 * ff 768, vocab 1024, f32, seed 1 (T5 fields: 32 buckets, max_distance 128). */
void model_mk_defaults(struct model_mk_params *p);

/*
 * Validate the parameters. Returns 0, or -EINVAL with the reason in err
 * (which field, which constraint).
 */
int model_mk_check(const struct model_mk_params *p, char *err, size_t errlen);

/*
 * Build the model and write it to path (atomically). Returns 0, -EINVAL
 * (bad parameters), -ENOMEM, or the writer's -errno; err says why. Nothing
 * is left at path on failure.
 */
int model_mk_write(const struct model_mk_params *p, const char *path, char *err, size_t errlen);

/* Parse a weight type name ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_K", "q5_K",
 * "q6_K"). 0 or -EINVAL. */
int model_mk_parse_type(const char *name, enum ggml_type *out);

/* The head dim p writes: head_dim, or n_embd / n_head. */
int model_mk_head_dim(const struct model_mk_params *p);

/* The position scheme p writes: p->position, or the architecture's own. */
const char *model_mk_position(const struct model_mk_params *p);

#endif /* KVD_MKMODEL_H */
