/*
 * model_internal.h - the loaded model, shared by model.c (loading,
 * tokens) and forward.c (the batched forward). Never included from outside
 * the model room (tests excepted: they are white-box).
 *
 * Weight matrices stay in the file's mapping and in the file's formats
 * (struct mm_weight describes each); the small vectors (norm weights,
 * biases) are converted to f32 once at load time, into one allocation.
 */
#ifndef KVD_MODEL_INTERNAL_H
#define KVD_MODEL_INTERNAL_H

#include "model/gguf.h"
#include "model/model.h"
#include "model/quant.h"
#include "model/tokenizer.h"

enum model_arch {
    MODEL_ARCH_LLAMA = 0, /* RMSNorm, RoPE (adjacent pairs), GQA, SwiGLU */
    MODEL_ARCH_QWEN2,     /* llama + q/k/v biases, RoPE in NeoX halves */
};

struct model_layer {
    const float *attn_norm;        /* [n_embd] */
    struct mm_weight wq;           /* n_embd -> n_head * head_dim */
    struct mm_weight wk, wv;       /* n_embd -> n_kv_head * head_dim */
    const float *bq, *bk, *bv;     /* biases of q, k, v, or NULL (qwen2 has them) */
    struct mm_weight wo;           /* n_head * head_dim -> n_embd */
    const float *ffn_norm;         /* [n_embd] */
    struct mm_weight gate, up;     /* n_embd -> n_ff */
    struct mm_weight down;         /* n_ff -> n_embd */
};

struct model {
    gguf_file *file;  /* the mapping every mm_weight points into */
    tok_vocab *tok;
    enum model_arch arch;
    char arch_name[16];
    char *name;              /* general.name or the file's base name */
    const char *weight_type; /* dominant matrix type, static string */

    int n_vocab, n_embd, n_layer, n_head, n_kv_head, head_dim, n_ff, n_ctx_train;
    int q_dim, kv_dim;       /* n_head * head_dim, n_kv_head * head_dim */
    float rms_eps;
    struct pos_scheme pos;   /* RoPE: theta, rotated dims, pairing, linear scale */

    struct mm_weight tok_embd; /* n_vocab rows of n_embd: row id is token id's embedding */
    const float *output_norm;  /* [n_embd] */
    struct mm_weight output;   /* n_embd -> n_vocab; a copy of tok_embd when tied */
    bool tied;

    struct model_layer *layers; /* [n_layer] */
    float *vecs;                /* storage of every f32 vector above */
};

#endif /* KVD_MODEL_INTERNAL_H */
