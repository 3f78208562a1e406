/*
 * kernels.c - the one description of which kernels run, for `kvd generate`,
 * `kvd serve`'s start line, /health and the benchmarks: the kernel level
 * chosen at start (cpu/cpu.h), then the path each kernel module takes at
 * that level, so that a slow path is never taken silently; and the threads
 * they run on (cpu/pool.h).
 */
#include "model/model.h"

#include <stdio.h>

#include "attention/attention.h"
#include "cpu/cpu.h"
#include "cpu/pool.h"
#include "model/ops.h"
#include "model/quant.h"

const char *model_kernels_describe(char *buf, size_t len)
{
    char level[160], threads[160], bf16[200];
    const char *pack = mm_pack_kernel_name();
    snprintf(buf, len,
             "%s: matmul %s (repacked: %s; %s), K formats %s, read-only formats %s, attention %s, "
             "q8_0 keys %s, element-wise and norms %s; threads: %s",
             cpu_describe(level, sizeof(level)), mm_kernel_name(), pack ? pack : "none",
             mm_bf16_describe(bf16, sizeof(bf16)), mm_k_kernel_name(), mm_blocks_kernel_name(),
             attn_simd_name(), attn_q8_name(), ops_kernels_now()->name,
             cpu_pool_describe(threads, sizeof(threads)));
    return buf;
}
