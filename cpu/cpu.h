/*
 * cpu.h - which instruction-set level the SIMD kernels run at.
 *
 * One binary carries every kernel file compiled once per level (the
 * Makefile's KERNEL_SRC and KERNEL_LEVELS; cpu/kernel.h names each copy's
 * symbols), and each kernel module picks its copy through cpu_level(). The
 * level is decided once, at start, from what the CPU reports (cpuid, and
 * the OS's saved register state for the wide registers): the best level the
 * CPU has and the build carries. For tests and comparisons a LOWER level
 * can be forced by name (cpu_force, or the environment variable KVD_CPU
 * through cpu_init_env); a level the CPU lacks is refused, naming the
 * features it lacks. Nothing falls back silently: cpu_describe() says the
 * level in use and why, and the commands print it.
 *
 * The levels (each includes the ones before it):
 *   scalar  plain C, compiled for the build's base architecture (ARCH)
 *   avx2    x86-64-v3: AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE
 *   avx512  x86-64-v4 (AVX-512 F, CD, BW, DQ, VL) and AVX-512 VNNI
 *
 * Within the avx512 level, AVX-512 BF16 (vdpbf16ps, two bf16 products per
 * f32 lane) is an optional feature, not a level of its own: only the
 * kernels over bf16 weights use it (model/matmul_bf16.c), and they ask
 * cpu_bf16() at each call. The name "avx512-nobf16" forces the avx512
 * level with it off (what a CPU without it runs), for tests and
 * comparisons. So are AMX's bf16 tiles (tdpbf16ps: 16 x 16 x 32 products
 * per instruction), used by the products over bf16 pairs (model/matmul_amx.c)
 * while cpu_amx(); "avx512-noamx" turns them off, as on an AVX-512 CPU
 * without AMX. cpu_describe says which.
 *
 * Threads: cpu_level() may be called from any thread at any time; the
 * level is fixed by the first call. cpu_force and cpu_init_env change it
 * and must not run while kernels run (tests call them between cases).
 */
#ifndef KVD_CPU_H
#define KVD_CPU_H

#include <stdbool.h>
#include <stddef.h>

enum cpu_level {
    CPU_SCALAR = 0,
    CPU_AVX2 = 1,
    CPU_AVX512 = 2,
};
#define CPU_N_LEVELS 3

/* The level kernels use now (decided at the first call: cpu_best()). */
enum cpu_level cpu_level(void);

/* The best level this CPU has and this build carries. */
enum cpu_level cpu_best(void);

/* "scalar", "avx2", "avx512"; NULL for a value out of range. */
const char *cpu_level_name(enum cpu_level l);

/* Whether this build compiled the kernels for level l (x86-64 builds carry
 * all three; other targets only scalar). */
bool cpu_level_built(enum cpu_level l);

/*
 * Whether the CPU can run level l. When it cannot and missing is not NULL,
 * the features it lacks are written there, space-separated ("avx512vnni").
 */
bool cpu_level_supported(enum cpu_level l, char *missing, size_t missing_len);

/*
 * Use the level named name from now on: one of the names above,
 * "avx512-noamx", "avx512-nobf16", or "auto" (the best). Returns 0, or -1 with err saying why: an unknown name (the
 * names are listed), a level this build does not carry, or one the CPU
 * lacks (the missing features named). On failure the level is unchanged.
 */
int cpu_force(const char *name, char *err, size_t errlen);

/* cpu_force(getenv("KVD_CPU")) when that variable is set and not empty;
 * 0 when it is not set. The error names the variable. */
int cpu_init_env(char *err, size_t errlen);

/*
 * One line for logs and answers: the level in use (at avx512, with or
 * without avx512bf16), and either "the best this CPU and build have" or
 * "forced; this CPU's best is avx512 with avx512bf16". Returns buf.
 */
const char *cpu_describe(char *buf, size_t len);

/* Whether the level in use was forced below the best (or avx512bf16 off). */
bool cpu_forced(void);

/* Whether the CPU has AVX-512 BF16 (and the avx512 level it belongs to). */
bool cpu_bf16_supported(void);

/* Whether kernels may use AVX-512 BF16 now: the level in use is avx512,
 * the CPU has it, and it was not forced off ("avx512-nobf16"). */
bool cpu_bf16(void);

/*
 * Whether the CPU's vdpbf16ps (32 bf16 multiply-adds) outruns its f32 FMA
 * (16) per instruction issued, as on AMD's Zen 4 and 5: everywhere but on
 * Intel's cores, where one core's vdpbf16ps measures half the FMA's flops
 * (an AMX Xeon: 115-120 against 230-243 GFLOPS, tests/bench/bench_peak.h),
 * so that bf16 weights multiply faster widened to f32 (model/quant.h's
 * mm_bf16_in_pairs). A property of the CPU's make, not measured at start:
 * the same CPU always takes the same path, and the same bits.
 */
bool cpu_bf16_dot_fast(void);

/*
 * Whether the CPU has AMX's bf16 tiles (amx-tile, amx-bf16, the OS saving
 * their state) and Linux granted this process their state; asked once,
 * the grant with it (it is the process's, for every thread). A CPU with
 * AMX but a kernel that refuses it counts as without, and cpu_describe
 * says why.
 */
bool cpu_amx_supported(void);

/* Whether kernels may use the AMX bf16 tiles now: cpu_bf16() (every CPU
 * with AMX has avx512bf16, and "avx512-nobf16" stands for a CPU with
 * neither), the CPU has them, and they were not forced off
 * ("avx512-noamx": an AVX-512 CPU without AMX). */
bool cpu_amx(void);

#endif /* KVD_CPU_H */
