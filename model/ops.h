/*
 * ops.h - the forward pass's work outside the matrix products and
 * attention: the MLP's activations, the norms, and the exponential they
 * rest on, one copy per kernel level (ops.c is a KERNEL_SRC file, see
 * cpu/kernel.h), picked at each call by ops_kernels().
 *
 * Every function here computes each output from its own inputs alone, by
 * the same instructions wherever it sits in the array (the SIMD levels run
 * a short end through the same vector code, masked), so a result does not
 * depend on how a caller splits an array among threads or tokens among
 * batches: the forward stays batch- and thread-invariant.
 *
 * Levels. The scalar level is libm (expf, tanhf) and the plain loops the
 * forward always had; the AVX2 and AVX-512 levels share one vector
 * exponential (ops.c says how and how close) and give the same bits as
 * each other. test_ops bounds the exponential against libm over the whole
 * float range, overflow, underflow, infinities and NaN included.
 */
#ifndef KVD_MODEL_OPS_H
#define KVD_MODEL_OPS_H

#include <stddef.h>

#include "cpu/kernel.h"

struct ops_kernels {
    const char *name; /* "avx512", "avx2", "scalar (libm)" */

    /* y[i] = exp(x[i]); y may equal x. */
    void (*exp)(float *y, const float *x, size_t n);

    /* h[i] = silu(h[i]) * g[i] = h / (1 + exp(-h)) * g (SwiGLU). */
    void (*swiglu)(float *restrict h, const float *restrict g, size_t n);

    /* h[i] = gelu(h[i]) by the tanh approximation (BLOOM), times g[i]
     * when g is not NULL (Gemma's GEGLU). */
    void (*gelu_tanh)(float *restrict h, const float *restrict g, size_t n);

    /* out = x / rms(x) * w, the sum of squares in double; out may equal x. */
    void (*rmsnorm)(float *out, const float *x, const float *w, int n, float eps);

    /* out = (x - mean) / sqrt(var + eps) * w + b (b may be NULL), sums in
     * double; out may equal x. */
    void (*layernorm)(float *out, const float *x, const float *w, const float *b, int n,
                      float eps);
};

KERN_DECLARE(const struct ops_kernels, ops_kernels);

/* The copy of the level in use now (cpu_level()). */
static inline const struct ops_kernels *ops_kernels_now(void)
{
    static const struct ops_kernels *const table[CPU_N_LEVELS] = KERN_TABLE(ops_kernels);
    return table[cpu_level()];
}

#endif /* KVD_MODEL_OPS_H */
