/*
 * requantize.h - `kvd quantize`: rewrite a GGUF file's weight matrices in
 * another of the formats kvd reads and writes.
 *
 * Internal to kvd (cli/cmd_quantize.c, tests). See requantize.c for the
 * rules: which tensors, which type each gets in a mix, the fallbacks.
 */
#ifndef KVD_REQUANTIZE_H
#define KVD_REQUANTIZE_H

#include <stddef.h>

#include "model/gguf.h"

/* A target: one type for every matrix, or a mix (q4_K_M, q5_K_M). */
struct model_quant_target {
    const char *name;      /* "q8_0", "q4_0", "q4_K", "q5_K", "q6_K", "q4_K_M", "q5_K_M" */
    enum ggml_type base;   /* most matrices */
    enum ggml_type more;   /* attn_v / ffn_down of the mix's chosen layers, fused QKV;
                              == base for a single-type target */
    enum ggml_type output; /* output.weight (token_embd when tied) */
    unsigned ftype;        /* general.file_type written (llama.cpp's llama_ftype) */
};

/* The target called name, or NULL (the names are listed in cmd_quantize's usage). */
const struct model_quant_target *model_quant_target(const char *name);

struct model_quant_params {
    const char *in, *out; /* GGUF paths; out is written atomically */
    const struct model_quant_target *target;
    int n_threads;        /* 0 = the default count (cpu/pool.h) */
    /* Called once per tensor with what happened to it (may be NULL). note is
     * NULL, or why the tensor did not get the type the rule gives it. */
    void (*report)(void *ctx, const char *tensor, enum ggml_type from, enum ggml_type to,
                   const char *note);
    void *report_ctx;
};

/* The statistics of a run. */
struct model_quant_stats {
    int tensors, quantized, kept, fallbacks;
    size_t bytes_in, bytes_out; /* tensor data */
};

/*
 * Quantize in into out. Returns 0, or -EINVAL (a tensor of a type kvd
 * cannot decode, a value a format cannot hold: named in err), -ENOMEM, or
 * the writer's -errno. Nothing is left at out on failure.
 */
int model_quantize(const struct model_quant_params *p, struct model_quant_stats *st, char *err,
                   size_t errlen);

#endif /* KVD_REQUANTIZE_H */
