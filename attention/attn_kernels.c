/*
 * attn_kernels.c - which copy of the SIMD tile operations runs.
 *
 * attn_simd.c is compiled once per kernel level (cpu/kernel.h); this file
 * is the one place that maps cpu_level() to a table: AVX-512 or AVX2, or
 * NULL at the scalar level, where attn_create uses attn_scalar.c's table;
 * and the same for attn_rope.c's copies of the RoPE angles.
 */
#include "attention_internal.h"
#include "cpu/kernel.h"

#if KVD_KERNEL_LEVELS > 1
KERN_DECLARE(const struct attn_ops, attn_simd);
#endif
KERN_DECLARE(const attn_rope_fn, attn_rope_angles);

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

attn_rope_fn attn_rope_select(bool scalar, const char **name)
{
    const attn_rope_fn *const table[CPU_N_LEVELS] = KERN_TABLE(attn_rope_angles);
    enum cpu_level lv = scalar ? CPU_SCALAR : cpu_level();
    if (!table[lv])
        lv = CPU_SCALAR;
    if (name)
        *name = cpu_level_name(lv);
    return *table[lv];
}

attn_rope_fn attn_rope_path(const char *name)
{
    const attn_rope_fn *const table[CPU_N_LEVELS] = KERN_TABLE(attn_rope_angles);
    for (int lv = 0; lv < CPU_N_LEVELS; lv++)
        if (!strcmp(name, cpu_level_name((enum cpu_level)lv)))
            return table[lv] && cpu_level_supported((enum cpu_level)lv, NULL, 0) ? *table[lv]
                                                                                 : NULL;
    return NULL;
}
