/*
 * bench_peak.h - the multiply-add peaks of one core, measured: what a
 * compute-bound kernel's "fraction of peak" divides by.
 *
 * Each peak is a loop of twelve independent chains of one instruction and
 * nothing else (enough chains to cover the instruction's latency on every
 * core kvd meets), timed by the thread's own CPU time: on a machine shared
 * with other work the wall clock counts the neighbours, the thread's CPU
 * time only the cycles it ran. Callers take the best of a few calls (a
 * clock slowed for a moment would lower the peak and flatter the
 * fractions) and multiply by the threads they run on.
 *
 *   vpdpbusd   (AVX-512 VNNI) 64 int8 multiply-adds per instruction
 *   vfmadd     (AVX-512 F)    16 f32 multiply-adds
 *              (AVX2 + FMA)   8, on a CPU without AVX-512
 *   vpmaddubsw + vpmaddwd + vpaddd  (AVX2) 32 int8 multiply-adds into
 *              i32 lanes per three instructions: what an int8 product
 *              costs where there is no VNNI (model/matmul.c's AVX2 path),
 *              the integer peak on such a CPU
 *   vdpbf16ps  (AVX-512 BF16) 32 bf16 multiply-adds into f32
 *   tdpbf16ps  (AMX-BF16)     8,192 bf16 multiply-adds into a tile of f32:
 *              four independent C tiles (what model/matmul_amx.c keeps),
 *              A and B loaded once; the caller must hold the tile
 *              permission first (cpu/cpu.h's cpu_amx_supported)
 *
 * Each returns operations per second in units of 1e9 (2 per multiply-add),
 * or 0 when the CPU lacks the instruction: a caller prints "not measured",
 * never a guess.
 */
#ifndef KVD_BENCH_PEAK_H
#define KVD_BENCH_PEAK_H

#include <stdint.h>

#include "tests/bench/bench_util.h"

#if defined(__x86_64__)
#include <immintrin.h>

#define BENCH_PEAK_ITERS 2000000

__attribute__((target("avx512f,avx512vnni"))) static inline double bench_peak_vnni_run(void)
{
    __m512i a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_epi32(i);
    const __m512i u = _mm512_set1_epi8(1), s = _mm512_set1_epi8(-1);
    double t0 = bench_thread_cpu();
    for (int n = 0; n < BENCH_PEAK_ITERS; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_dpbusd_epi32(a[i], u, s);
    for (int i = 1; i < 12; i++)
        a[0] = _mm512_add_epi32(a[0], a[i]);
    double dt = bench_thread_cpu() - t0;
    int32_t sink[16];
    _mm512_storeu_si512(sink, a[0]);
    volatile int32_t keep = sink[0];
    (void)keep;
    return 2.0 * 64 * 12 * (double)BENCH_PEAK_ITERS / dt / 1e9;
}

__attribute__((target("avx512f"))) static inline double bench_peak_fma_run(void)
{
    __m512 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_ps((float)i);
    const __m512 m = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    double t0 = bench_thread_cpu();
    for (int n = 0; n < BENCH_PEAK_ITERS; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_fmadd_ps(a[i], m, c);
    for (int i = 1; i < 12; i++)
        a[0] = _mm512_add_ps(a[0], a[i]);
    double dt = bench_thread_cpu() - t0;
    float sink[16];
    _mm512_storeu_ps(sink, a[0]);
    volatile float keep = sink[0];
    (void)keep;
    return 2.0 * 16 * 12 * (double)BENCH_PEAK_ITERS / dt / 1e9;
}

__attribute__((target("avx2,fma"))) static inline double bench_peak_fma256_run(void)
{
    __m256 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm256_set1_ps((float)i);
    const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
    double t0 = bench_thread_cpu();
    for (int n = 0; n < BENCH_PEAK_ITERS; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm256_fmadd_ps(a[i], m, c);
    for (int i = 1; i < 12; i++)
        a[0] = _mm256_add_ps(a[0], a[i]);
    double dt = bench_thread_cpu() - t0;
    float sink[8];
    _mm256_storeu_ps(sink, a[0]);
    volatile float keep = sink[0];
    (void)keep;
    return 2.0 * 8 * 12 * (double)BENCH_PEAK_ITERS / dt / 1e9;
}

/* Twelve chains of the three instructions; the chains' operands are
 * registers varied per chain so that no instruction is hoisted. */
__attribute__((target("avx2"))) static inline double bench_peak_maddubs_run(void)
{
    __m256i a[12], u[12];
    for (int i = 0; i < 12; i++) {
        a[i] = _mm256_set1_epi32(i);
        u[i] = _mm256_set1_epi8((char)(i + 1));
    }
    const __m256i s = _mm256_set1_epi8(-1), ones = _mm256_set1_epi16(1);
    double t0 = bench_thread_cpu();
    for (int n = 0; n < BENCH_PEAK_ITERS; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++) {
            a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(u[i], s), ones));
            __asm__("" : "+x"(u[i])); /* a new operand each time, as far as the compiler knows */
        }
    for (int i = 1; i < 12; i++)
        a[0] = _mm256_add_epi32(a[0], a[i]);
    double dt = bench_thread_cpu() - t0;
    int32_t sink[8];
    _mm256_storeu_si256((__m256i *)sink, a[0]);
    volatile int32_t keep = sink[0];
    (void)keep;
    return 2.0 * 32 * 12 * (double)BENCH_PEAK_ITERS / dt / 1e9;
}

__attribute__((target("avx512f,avx512bf16"))) static inline double bench_peak_bf16_run(void)
{
    __m512 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_ps((float)i);
    const __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), /* 1.0 */
        y = (__m512bh)_mm512_set1_epi16((short)0xb380);    /* -6e-8 */
    double t0 = bench_thread_cpu();
    for (int n = 0; n < BENCH_PEAK_ITERS; n++)
#pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            a[i] = _mm512_dpbf16_ps(a[i], x, y);
    for (int i = 1; i < 12; i++)
        a[0] = _mm512_add_ps(a[0], a[i]);
    double dt = bench_thread_cpu() - t0;
    float sink[16];
    _mm512_storeu_ps(sink, a[0]);
    volatile float keep = sink[0];
    (void)keep;
    return 2.0 * 32 * 12 * (double)BENCH_PEAK_ITERS / dt / 1e9;
}

__attribute__((target("amx-tile,amx-bf16"))) static inline double bench_peak_amx_bf16_run(void)
{
    static const struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) cfg = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64},
                                          {16, 16, 16, 16, 16, 16, 16, 16}};
    static uint16_t ones[16][32] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++)
        ones[i / 32][i % 32] = 0x3f80; /* 1.0 */
    __asm__ volatile("" ::: "memory");
    _tile_loadconfig(&cfg);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int iters = BENCH_PEAK_ITERS / 16; /* ~16 cycles each */
    double t0 = bench_thread_cpu();
    for (int n = 0; n < iters; n++) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
    }
    float sink[16][16] __attribute__((aligned(64)));
    _tile_stored(0, sink, 64);
    double dt = bench_thread_cpu() - t0;
    _tile_release();
    volatile float keep = sink[0][0];
    (void)keep;
    return 2.0 * 16 * 16 * 32 * 4 * (double)iters / dt / 1e9;
}
#endif

/* One measurement each, or 0 when the CPU lacks the instruction. */

/* The f32 FMA's peak at the CPU's widest vectors: 512 bits, else 256. */
static inline double bench_peak_fma(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f"))
        return bench_peak_fma_run();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return bench_peak_fma256_run();
#endif
    return 0.0;
}

static inline const char *bench_peak_fma_name(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f"))
        return "f32 FMA (512-bit)";
#endif
    return "f32 FMA (256-bit)";
}

/* The int8 multiply-add's peak the CPU offers kvd: vpdpbusd with AVX-512
 * VNNI, else AVX2's three-instruction sequence. */
static inline double bench_peak_int8(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"))
        return bench_peak_vnni_run();
    if (__builtin_cpu_supports("avx2"))
        return bench_peak_maddubs_run();
#endif
    return 0.0;
}

static inline const char *bench_peak_int8_name(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni"))
        return "vpdpbusd";
#endif
    return "vpmaddubsw+vpmaddwd";
}

static inline double bench_peak_bf16(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"))
        return bench_peak_bf16_run();
#endif
    return 0.0;
}

/* Only once the process holds the tile permission (cpu_amx_supported()). */
static inline double bench_peak_amx_bf16(void)
{
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f"))
        return bench_peak_amx_bf16_run();
#endif
    return 0.0;
}

#endif /* KVD_BENCH_PEAK_H */
