/*
 * matmul_internal.h - between mm_matmul's entry (matmul_run.c) and its
 * kernels (matmul.c, compiled once per kernel level, see cpu/kernel.h).
 *
 * The entry validates, lays out the scratch, and splits the output rows
 * into groups of MM_GROUP among the threads; the kernel level in use
 * (cpu_level()) supplies the two operations that touch data: quantising a
 * token's activations, and computing one group of rows for every token.
 */
#ifndef KVD_MATMUL_INTERNAL_H
#define KVD_MATMUL_INTERNAL_H

#include "cpu/kernel.h"
#include "model/quant.h"

/* Output rows per unit of thread work (16 floats: one cache line of out). */
#define MM_GROUP 16

/* The work of one call, shared read-only by its threads. */
struct mm_job {
    const struct mm_weight *w;
    const float *x; /* [n_tok][n_in] */
    float *out;     /* [n_tok][n_out] */
    int n_tok;
    struct mm_xq xa; /* quantised activations (quantised types only) */
};

/* One kernel level's operations. */
struct mm_kernels {
    const char *name; /* "avx512-vnni", "avx2", "scalar" */
    /* One token's activations x[n_in] into n_in / 32 blocks: q, d, s as in struct mm_xq. */
    void (*quantize_x)(const float *x, int n_in, int8_t *q, float *d, float *s);
    /* Output rows [g * MM_GROUP, +MM_GROUP) of every token of the job. */
    void (*run_group)(const struct mm_job *jb, int g);
};

KERN_DECLARE(const struct mm_kernels, mm_kernels);

static inline bool mm_is_float_type(enum ggml_type t)
{
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

#endif /* KVD_MATMUL_INTERNAL_H */
