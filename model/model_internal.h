/*
 * model_internal.h - the loaded model, shared by model.c (loading,
 * tokens), arch_bloom.c (BLOOM and MPT), posbias.c (ALiBi slopes and the
 * T5 bias table) and forward.c (the batched forward). Never included from
 * outside the model room (tests and benchmarks excepted: they are
 * white-box).
 *
 * Weight matrices stay in the file's mapping and in the file's formats
 * (struct mm_weight describes each); the small vectors (norm weights,
 * biases) are converted to f32 once at load time, into one allocation.
 *
 * One layer description serves every architecture. A fused QKV matrix
 * (BLOOM, MPT: rows of Q, then K, then V) is described as three row views
 * wq, wk, wv into the one tensor, and its bias as three slices, so the
 * forward never knows whether the file fused them.
 */
#ifndef KVD_MODEL_INTERNAL_H
#define KVD_MODEL_INTERNAL_H

#include "model/gguf.h"
#include "model/model.h"
#include "model/quant.h"
#include "model/tokenizer.h"

enum model_arch {
    MODEL_ARCH_LLAMA = 0, /* RMSNorm, GQA, SwiGLU; RoPE (adjacent pairs), or ALiBi / T5
                             bias when kvd.position.kind says so */
    MODEL_ARCH_QWEN2,     /* llama + q/k/v biases, RoPE in NeoX halves */
    MODEL_ARCH_QWEN3,     /* llama + per-head RMSNorm of q and k before RoPE, NeoX halves */
    MODEL_ARCH_BLOOM,     /* embedding LayerNorm, LayerNorm with bias, fused QKV with
                             bias, GELU (tanh) MLP with biases, ALiBi (max_bias 8) */
    MODEL_ARCH_MPT,       /* LayerNorm (optional bias), fused QKV, optional QKV clamp,
                             GELU (erf) MLP, ALiBi with the file's max_bias */
    MODEL_ARCH_GEMMA2,    /* llama + embedding times sqrt(n_embd), GELU-gated MLP, norms after
                             attention and MLP, attention and final logit soft-capping, local
                             (windowed) and global layers alternating; NeoX pairs */
    MODEL_ARCH_GEMMA3,    /* gemma2 without soft-capping, + qwen3's q/k head norms; 5 local
                             layers to 1 global, the local ones with their own RoPE base */
    MODEL_ARCH_PHI3,      /* llama with fused QKV and gate/up, NeoX pairs, LongRoPE tables */
};

enum model_norm {
    MODEL_NORM_RMS = 0, /* x / rms(x) * w */
    MODEL_NORM_LAYER,   /* (x - mean) / std * w + b (b optional) */
};

enum model_act {
    MODEL_ACT_SWIGLU = 0, /* down(silu(gate x) * up x) */
    MODEL_ACT_GELU_TANH,  /* down(gelu(up x + b_up)) + b_down, tanh approximation (BLOOM) */
    MODEL_ACT_GELU_ERF,   /* the same with the exact erf GELU (MPT's nn.GELU) */
    MODEL_ACT_GEGLU,      /* down(gelu_tanh(gate x) * up x): Gemma */
};

struct model_layer {
    const float *attn_norm;    /* [n_embd] */
    const float *attn_norm_b;  /* [n_embd] LayerNorm bias, or NULL */
    struct mm_weight wq;       /* n_embd -> n_head * head_dim */
    struct mm_weight wk, wv;   /* n_embd -> n_kv_head * head_dim */
    const float *bq, *bk, *bv; /* biases of q, k, v, or NULL (qwen2, bloom have them) */
    const float *q_norm, *k_norm; /* [head_dim] RMSNorm weights of every q / k head, or NULL
                                     (qwen3) */
    struct mm_weight wo;       /* n_head * head_dim -> n_embd */
    const float *bo;           /* [n_embd] output projection bias, or NULL */
    const float *ffn_norm;     /* [n_embd] */
    const float *ffn_norm_b;   /* [n_embd] or NULL */
    struct mm_weight gate;     /* n_embd -> n_ff (SwiGLU only; zero otherwise) */
    struct mm_weight up;       /* n_embd -> n_ff */
    struct mm_weight down;     /* n_ff -> n_embd */
    const float *b_up;         /* [n_ff] or NULL */
    const float *b_down;       /* [n_embd] or NULL */
    const float *attn_post_norm; /* [n_embd] RMSNorm of the attention output before the
                                    residual (Gemma's post_attention_norm), or NULL */
    const float *ffn_post_norm;  /* [n_embd] the same after the MLP (post_ffw_norm), or NULL */
    int sliding_window;          /* 0, or this layer sees only keys with pos_q - pos_k < it */
    bool local_rope;             /* rotate with model.pos_local instead of model.pos (Gemma 3's
                                    local layers) */
};

struct model {
    gguf_file *file; /* the mapping every mm_weight points into */
    tok_vocab *tok;
    enum model_arch arch;
    char arch_name[16];
    char *name;              /* general.name or the file's base name */
    const char *weight_type; /* dominant matrix type, static string */

    int n_vocab, n_embd, n_layer, n_head, n_kv_head, head_dim, n_ff, n_ctx_train;
    int q_dim, kv_dim;     /* n_head * head_dim, n_kv_head * head_dim */
    enum model_norm norm;  /* every norm of the model */
    float norm_eps;        /* its epsilon */
    enum model_act act;    /* feed-forward shape */
    float clamp_kqv;       /* > 0: q, k, v clamped to [-clamp, clamp] (MPT); 0 = off */
    float alibi_max_bias;  /* ALiBi: the max_bias the slopes come from */
    struct pos_scheme pos; /* RoPE parameters, or ALiBi slopes / T5 table (pointing
                              into pos_data) */
    float *rope_factors;   /* [rope_dims/2] RoPE per-pair divisors (rope_freqs, YaRN), or
                              NULL; pos.rope_freq_factors points here when they apply */
    float attn_logit_mul;  /* attention logits times this beyond 1/sqrt(head_dim) (YaRN's
                              mscale^2); 1 otherwise */
    int sliding_window;    /* 0, or the window of the windowed layers (every layer for
                              Mistral, the local ones for Gemma): <arch>.attention.sliding_window;
                              each layer's own is model_layer.sliding_window */
    float attn_scale;      /* queries times this (1/sqrt(head_dim); Gemma's 27B models
                              1/sqrt(n_embd / n_head)), before attn_logit_mul */
    float emb_scale;       /* the embedding times this before the first layer (Gemma:
                              sqrt(n_embd)); 1 otherwise */
    float attn_softcap;    /* 0, or attention scores capped to c * tanh(s / c) (Gemma 2) */
    float rope_q_mul;      /* the rotated dims of every q head times this before attention
                              (Phi-3's LongRoPE amplitude squared); 1 otherwise */
    bool rope_long;        /* Phi-3: the long factor table was chosen (else short or none) */
    float *rope_tables;    /* Phi-3 LongRoPE: [rope_dims] the long then the short table, or
                              NULL; the chosen one is copied into rope_factors */
    int rope_orig_ctx;     /* Phi-3 LongRoPE: rope.scaling.original_context_length, or 0 */
    int32_t *kv_windows;   /* [n_layer] each layer's sliding window for the cache, or NULL
                              without windowed layers (model_kv_shape) */
    float final_softcap;   /* 0, or the logits capped the same way (Gemma 2) */
    struct pos_scheme pos_local; /* RoPE of the layers with local_rope (Gemma 3: base
                                    rope.freq_base_swa or 10000, no scaling) */

    struct mm_weight tok_embd;  /* n_vocab rows of n_embd: row id is token id's embedding */
    const float *tok_norm;      /* [n_embd] LayerNorm of the embedding (BLOOM), or NULL */
    const float *tok_norm_b;    /* [n_embd] or NULL */
    const float *output_norm;   /* [n_embd] */
    const float *output_norm_b; /* [n_embd] or NULL */
    struct mm_weight output;    /* n_embd -> n_vocab; a copy of tok_embd when tied */
    bool tied;

    struct model_layer *layers; /* [n_layer] */
    float *vecs;                /* storage of every f32 vector above */
    float *pos_data;            /* ALiBi slopes [n_head] or T5 table [n_head][buckets] */

    /* The repacked copies of the matrices (model_pack.c), or NULL. */
    void *pack_mem;
    size_t pack_bytes; /* its size */
    int pack_count;    /* matrices repacked */
    int pack_copied;   /* matrices copied as stored (no repacked kernels for their type) */
    char pack_copied_types[64]; /* their types' names, space-separated */
    int pack_bf16;     /* of them in bf16 pairs for avx512bf16 (model/matmul_bf16.h) */
    double pack_ms;    /* time it took at load */
    const char *pack_pages; /* the pages asked for the copy, for the load line (constant) */
    bool small_pages;       /* model_params.small_pages, for the KV pool (model_kv_shape) */
};

/* ------------------------------------------------------------------------
 * Loading helpers (model.c), for the architecture files
 * ------------------------------------------------------------------------ */

/*
 * Integer metadata <arch>.<suffix> (arch NULL: the key is suffix itself)
 * into *out, checked against [lo, hi]. Absent and not required: *out = def.
 * Returns 0 or -EINVAL with the key named in err.
 */
int model_meta_int(const gguf_file *f, const char *arch, const char *suffix, bool required,
                   long def, long lo, long hi, int *out, char *err, size_t errlen);

/*
 * Float metadata <arch>.<suffix> (arch NULL: the key is suffix). Absent:
 * *out = def and *found (if non-NULL) = false. Returns 0, or -EINVAL when
 * the value is not a finite number.
 */
int model_meta_float(const gguf_file *f, const char *arch, const char *suffix, float def,
                     float *out, bool *found, char *err, size_t errlen);

/*
 * A matrix of n_out rows of n_in elements by name, shape-checked. Absent
 * and optional: returns 0 with *found = false (found may be NULL). 0 or
 * -EINVAL with the tensor named in err.
 */
int model_load_matrix(const gguf_file *f, const char *name, int n_in, int n_out, bool required,
                      struct mm_weight *w, bool *found, char *err, size_t errlen);

/*
 * Repack every matrix a product reads for the kernel level in use, if it
 * has kernels for the type (model_pack.c); nothing to do is not an error.
 * 0, or -ENOMEM with err saying so. model_pack_free gives the copy back.
 */
int model_pack_weights(model *m, bool small_pages, char *err, size_t errlen);
void model_pack_free(model *m);

/*
 * A vector of n elements by name, converted to f32 at dst and checked
 * finite; *out = dst, or NULL when absent and optional. 0 or -EINVAL.
 */
int model_load_vector(const gguf_file *f, const char *name, int n, bool required, float *dst,
                      const float **out, char *err, size_t errlen);

/*
 * A fused matrix w (tensor name, for errors) as n row views: parts[i] gets
 * the next rows[i] rows (BLOOM's Q/K/V, Phi-3's Q/K/V and gate/up). The
 * rows must add up to w's. 0 or -EINVAL.
 */
int model_split_rows(const struct mm_weight *w, const char *name, struct mm_weight *const *parts,
                     const int *rows, int n, char *err, size_t errlen);

/*
 * Per-layer shorthands: tensor blk.<l>.<suffix>. model_layer_vector loads
 * n floats at *v and advances *v by n (found or not).
 */
int model_layer_vector(const model *m, int l, const char *suffix, int n, bool required, float **v,
                       const float **out, char *err, size_t errlen);
int model_layer_matrix(const model *m, int l, const char *suffix, int n_in, int n_out,
                       bool required, struct mm_weight *w, char *err, size_t errlen);

/* Layer l's seven matrices of a Llama-shaped layer (attn_q/k/v/output,
 * ffn_gate/up/down), shape-checked into L. 0 or -EINVAL. */
int model_llama_matrices(const model *m, int l, struct model_layer *L, char *err, size_t errlen);

/* Read the shared hyper-parameters (sizes, heads, context length) of any
 * architecture. 0 or -EINVAL. */
int model_read_shape(model *m, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * RoPE (rope.c)
 * ------------------------------------------------------------------------ */

/*
 * The RoPE scheme of a file into m->pos (and m->rope_factors,
 * m->attn_logit_mul): base, dims, the given pairing, linear or YaRN
 * scaling and rope_freqs.weight. Needs the shape (model_read_shape).
 * 0, -EINVAL with the key or tensor named, or -ENOMEM.
 */
int model_read_rope(model *m, enum pos_rope_pairing pairing, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * BLOOM and MPT (arch_bloom.c)
 * ------------------------------------------------------------------------ */

/* Hyper-parameters beyond the shape: norm epsilon, clamp, ALiBi max_bias
 * (from the file, else params, else BLOOM's 8; MPT without one fails). */
int model_bloom_hparams(model *m, const struct model_params *params, char *err, size_t errlen);

/* Every tensor of a BLOOM or MPT file, into m->layers and m->vecs. */
int model_bloom_tensors(model *m, float *vecs, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * Gemma 2 and 3 (arch_gemma.c)
 * ------------------------------------------------------------------------ */

/* Norm epsilon, RoPE of the global and the local layers, window and its
 * layer pattern, soft-caps, query and embedding scales. 0 or -EINVAL. */
int model_gemma_hparams(model *m, char *err, size_t errlen);

/* Every layer tensor of a Gemma file into m->layers (v: free f32 storage). */
int model_gemma_layers(model *m, float *v, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * Phi-3 (arch_phi3.c)
 * ------------------------------------------------------------------------ */

/* LongRoPE after model_read_rope: the long or short factor table by the
 * caller's context, its amplitude. 0, -EINVAL or -ENOMEM. */
int model_phi3_rope(model *m, const struct model_params *params, char *err, size_t errlen);
/* Phi-3 LongRoPE: the table for a caller running positions below n_ctx (0 = the
 * file's context_length) into rope_factors; nothing without the two tables. */
void model_phi3_pick(model *m, int n_ctx);

/* Every layer tensor of a Phi-3 file (fused QKV or apart, fused gate/up). */
int model_phi3_layers(model *m, float *v, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * Offset-only position biases (posbias.c)
 * ------------------------------------------------------------------------ */

/*
 * The position scheme a llama-family file asks for in kvd.position.kind:
 * "rope" (or absent), "alibi" or "t5". *kind gets it. 0 or -EINVAL.
 */
int model_pos_kind(const gguf_file *f, enum pos_kind *kind, char *err, size_t errlen);

/*
 * ALiBi: slopes for m->n_head heads from max_bias (pos_alibi_slopes) into
 * m->pos_data, and m->pos pointing at them. 0, -EINVAL or -ENOMEM.
 */
int model_pos_alibi(model *m, float max_bias, char *err, size_t errlen);

/*
 * T5 bias decoder: kvd.t5.num_buckets and kvd.t5.max_distance (params fill
 * in only what the file lacks), the one table blk.0.attn_rel_b.weight
 * ([n_head, num_buckets] in GGUF order, every bucket's n_head values
 * contiguous) transposed into m->pos_data as [n_head][num_buckets], and no
 * table in any other layer. 0, -EINVAL (key or tensor named) or -ENOMEM.
 */
int model_pos_t5(model *m, const struct model_params *params, char *err, size_t errlen);

/*
 * A file whose position scheme is not T5 must carry no T5 table:
 * -EINVAL naming the first blk.N.attn_rel_b.weight found, else 0.
 */
int model_pos_no_t5_tables(const model *m, char *err, size_t errlen);

/* ------------------------------------------------------------------------
 * Forward (forward.c)
 * ------------------------------------------------------------------------ */

/* Bytes a model_ctx holds: activations, scratch and the attention kernel's
 * workspace. For memory checks in tests. */
size_t model_ctx_bytes(const model_ctx *ctx);
/* The attention kernel's part of it (attn_workspace_bytes). */
size_t model_ctx_attn_bytes(const model_ctx *ctx);

#endif /* KVD_MODEL_INTERNAL_H */
