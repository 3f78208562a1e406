/*
 * mkmodel.h - write small seeded Llama-family GGUF models.
 *
 * `kvd mkmodel`, the default model of `make run` and the test fixtures all
 * come from here. A model is a function of its parameters and seed alone:
 * the same parameters write the same bytes. Files use llama.cpp's metadata
 * keys and tensor names, so any GGUF reader can open them, and carry an
 * SPM-style vocabulary (<unk>, <s>, </s>, the 256 byte-fallback tokens and a
 * few hundred common English pieces with scores) in which any text
 * tokenizes and decodes back.
 *
 * Internal to kvd (server/cmd_mkmodel.c, tests, benchmarks); not part of
 * the public model API in model.h.
 */
#ifndef KVD_MKMODEL_H
#define KVD_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

struct model_mk_params {
    const char *arch;    /* "llama" or "qwen2" (adds q/k/v biases, NeoX RoPE pairs) */
    int n_embd;          /* model width */
    int n_layer;         /* transformer blocks */
    int n_head;          /* query heads; head_dim = n_embd / n_head */
    int n_kv_head;       /* key/value heads; divides n_head */
    int n_ff;            /* SwiGLU hidden width */
    int n_vocab;         /* vocabulary size, >= 259 (specials + byte tokens + one piece) */
    int rope_dims;       /* rotated dims per head (even, <= head_dim); 0 = head_dim */
    float rope_theta;    /* RoPE base */
    float rms_eps;       /* RMSNorm epsilon */
    int n_ctx_train;     /* written as <arch>.context_length */
    bool tied;           /* no output.weight: logits use token_embd.weight */
    enum ggml_type type; /* 2-D weights: F32, F16, BF16, Q8_0 or Q4_0 (norms stay F32) */
    uint64_t seed;       /* every weight derives from it */
};

/* The default model: llama, dim 256, 4 layers, 8 heads, 4 KV heads, ff 768,
 * vocab 1024, f32, seed 1. */
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

/* Parse a weight type name ("f32", "f16", "bf16", "q8_0", "q4_0"). 0 or -EINVAL. */
int model_mk_parse_type(const char *name, enum ggml_type *out);

#endif /* KVD_MKMODEL_H */
