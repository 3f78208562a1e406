/*
 * attn_kernels.c - which copy of the SIMD tile operations runs.
 *
 * attn_simd.c is compiled once per kernel level (cpu/kernel.h); this file
 * is the one place that maps cpu_level() to a table: AVX-512 or AVX2, or
 * NULL at the scalar level, where attn_create uses attn_scalar.c's table.
 */
#include "attention_internal.h"
#include "cpu/kernel.h"

#if KVD_KERNEL_LEVELS > 1
KERN_DECLARE(const struct attn_ops, attn_simd);
#endif

const struct attn_ops *attn_simd_ops(void)
{
#if KVD_KERNEL_LEVELS > 1
    switch (cpu_level()) {
    case CPU_AVX512:
        return &attn_simd_avx512;
    case CPU_AVX2:
        return &attn_simd_avx2;
    case CPU_SCALAR:
        break;
    }
#endif
    return NULL;
}

const char *attn_simd_name(void)
{
    const struct attn_ops *ops = attn_simd_ops();
    return ops ? ops->name : "scalar";
}
