/*
 * cpu.c - the kernel level: what the CPU has, what the build carries, and
 * the choice between them (see cpu.h).
 *
 * The CPU is asked directly (cpuid leaves 1, 7 and 0x80000001, and xgetbv
 * for the register state the OS saves) rather than through
 * __builtin_cpu_supports: clang's builtin does not know every feature a
 * level needs (f16c, movbe), and a feature the OS does not save the
 * registers of (AVX-512's zmm and mask registers under a kernel without
 * that support) must count as absent, which the builtin does not check on
 * every compiler. Each level lists its features once, with their names, so
 * a refusal can say what is missing.
 */
#include "cpu/cpu.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CPU_X86 1
#endif

static const char *const level_names[CPU_N_LEVELS] = {"scalar", "avx2", "avx512"};

/* ------------------------------------------------------------------------
 * What the CPU has
 * ------------------------------------------------------------------------ */

/* A feature: its name, and where cpuid reports it. */
struct feature {
    const char *name;
    int reg; /* index into the cpuid words below */
    int bit;
};

/* cpuid words: leaf 1 ecx, leaf 7 ebx, leaf 7 ecx, leaf 7.1 eax, leaf
 * 0x80000001 ecx, and the OS-saved state as a pseudo-word (bit 0: ymm,
 * bit 1: zmm + masks). */
enum { W1_ECX, W7_EBX, W7_ECX, W71_EAX, WX_ECX, W_OS, N_WORDS };

static const struct feature avx2_features[] = {
    {"avx", W1_ECX, 28},   {"fma", W1_ECX, 12},  {"f16c", W1_ECX, 29},   {"movbe", W1_ECX, 22},
    {"avx2", W7_EBX, 5},   {"bmi1", W7_EBX, 3},  {"bmi2", W7_EBX, 8},    {"lzcnt", WX_ECX, 5},
    {"os-ymm-state", W_OS, 0},
};
static const struct feature avx512_features[] = {
    {"avx512f", W7_EBX, 16},  {"avx512cd", W7_EBX, 28}, {"avx512bw", W7_EBX, 30},
    {"avx512dq", W7_EBX, 17}, {"avx512vl", W7_EBX, 31}, {"avx512vnni", W7_ECX, 11},
    {"os-zmm-state", W_OS, 1},
};
/* Within the avx512 level: the bf16 dot product (cpu.h, cpu_bf16). */
static const struct feature bf16_feature = {"avx512bf16", W71_EAX, 5};

static void read_cpuid(unsigned w[N_WORDS])
{
    memset(w, 0, sizeof(unsigned) * N_WORDS);
#ifdef CPU_X86
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d))
        w[W1_ECX] = c;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a, b, c, d);
        w[W7_EBX] = b;
        w[W7_ECX] = c;
        if (a >= 1) { /* sub-leaves of 7 */
            unsigned a1, b1, c1, d1;
            __cpuid_count(7, 1, a1, b1, c1, d1);
            w[W71_EAX] = a1;
        }
    }
    if (__get_cpuid(0x80000001u, &a, &b, &c, &d))
        w[WX_ECX] = c;
    /* OSXSAVE (leaf 1 ecx bit 27), then XCR0: sse+avx state (bits 1, 2);
     * opmask, zmm upper halves, zmm16-31 (bits 5, 6, 7) */
    if (w[W1_ECX] & (1u << 27)) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        (void)hi;
        if ((lo & 0x6u) == 0x6u)
            w[W_OS] |= 1u;
        if ((lo & 0xe6u) == 0xe6u)
            w[W_OS] |= 2u;
    }
#endif
}

/* Appends the names of the features of list the words lack; true if none. */
static bool check(const unsigned w[N_WORDS], const struct feature *list, size_t n, char *missing,
                  size_t len)
{
    bool ok = true;
    for (size_t i = 0; i < n; i++) {
        if (w[list[i].reg] & (1u << list[i].bit))
            continue;
        ok = false;
        if (missing && len) {
            size_t used = strlen(missing);
            snprintf(missing + used, len - used, "%s%s", used ? " " : "", list[i].name);
        }
    }
    return ok;
}

bool cpu_level_built(enum cpu_level l)
{
#if defined(KVD_KERNEL_LEVELS) && KVD_KERNEL_LEVELS > 1
    return l >= CPU_SCALAR && l < CPU_N_LEVELS;
#else
    return l == CPU_SCALAR;
#endif
}

bool cpu_level_supported(enum cpu_level l, char *missing, size_t missing_len)
{
    if (missing && missing_len)
        missing[0] = '\0';
    if (l == CPU_SCALAR)
        return true;
#ifdef CPU_X86
    unsigned w[N_WORDS];
    read_cpuid(w);
    bool ok = check(w, avx2_features, sizeof(avx2_features) / sizeof(avx2_features[0]), missing,
                    missing_len);
    if (l >= CPU_AVX512)
        ok &= check(w, avx512_features, sizeof(avx512_features) / sizeof(avx512_features[0]),
                    missing, missing_len);
    return ok;
#else
    if (missing && missing_len)
        snprintf(missing, missing_len, "x86-64");
    return false;
#endif
}

/* ------------------------------------------------------------------------
 * The choice
 * ------------------------------------------------------------------------ */

/* -1 until decided; then the level in use. best is -1 until computed. */
static _Atomic int current_level = -1;
static _Atomic int best_level = -1;
/* avx512bf16: -1 until asked, then whether the CPU has it; whether forced off */
static _Atomic int bf16_cpu = -1;
static _Atomic int bf16_off = 0;

bool cpu_bf16_supported(void)
{
    int h = atomic_load_explicit(&bf16_cpu, memory_order_relaxed);
    if (h < 0) {
        h = 0;
#ifdef CPU_X86
        unsigned w[N_WORDS];
        read_cpuid(w);
        h = cpu_level_supported(CPU_AVX512, NULL, 0) && check(w, &bf16_feature, 1, NULL, 0);
#endif
        atomic_store_explicit(&bf16_cpu, h, memory_order_relaxed);
    }
    return h;
}

bool cpu_bf16(void)
{
    return cpu_level() == CPU_AVX512 && cpu_level_built(CPU_AVX512) &&
           !atomic_load_explicit(&bf16_off, memory_order_relaxed) && cpu_bf16_supported();
}

bool cpu_bf16_dot_fast(void)
{
#ifdef CPU_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d))
        return true;
    /* "GenuineIntel" in ebx, edx, ecx */
    return !(b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu);
#else
    return true;
#endif
}

enum cpu_level cpu_best(void)
{
    int b = atomic_load_explicit(&best_level, memory_order_relaxed);
    if (b < 0) {
        /* threads racing here compute the same value */
        b = CPU_SCALAR;
        for (int l = CPU_N_LEVELS - 1; l > CPU_SCALAR; l--)
            if (cpu_level_built((enum cpu_level)l) &&
                cpu_level_supported((enum cpu_level)l, NULL, 0)) {
                b = l;
                break;
            }
        atomic_store_explicit(&best_level, b, memory_order_relaxed);
    }
    return (enum cpu_level)b;
}

enum cpu_level cpu_level(void)
{
    int l = atomic_load_explicit(&current_level, memory_order_relaxed);
    if (l < 0) {
        l = (int)cpu_best();
        atomic_store_explicit(&current_level, l, memory_order_relaxed);
    }
    return (enum cpu_level)l;
}

const char *cpu_level_name(enum cpu_level l)
{
    return l >= CPU_SCALAR && l < CPU_N_LEVELS ? level_names[l] : NULL;
}

int cpu_force(const char *name, char *err, size_t errlen)
{
    if (!strcmp(name, "auto")) {
        atomic_store_explicit(&current_level, (int)cpu_best(), memory_order_relaxed);
        atomic_store_explicit(&bf16_off, 0, memory_order_relaxed);
        return 0;
    }
    /* the avx512 level with its avx512bf16 kernels turned off */
    const bool nobf16 = !strcmp(name, "avx512-nobf16");
    int l = nobf16 ? CPU_AVX512 : -1;
    for (int i = 0; i < CPU_N_LEVELS; i++)
        if (!strcmp(name, level_names[i]))
            l = i;
    if (l < 0) {
        snprintf(err, errlen,
                 "unknown kernel level '%s' (auto, scalar, avx2, avx512, avx512-nobf16)", name);
        return -1;
    }
    if (!cpu_level_built((enum cpu_level)l)) {
        snprintf(err, errlen, "kernel level %s is not in this build (it carries scalar only)",
                 name);
        return -1;
    }
    char missing[160];
    if (!cpu_level_supported((enum cpu_level)l, missing, sizeof(missing))) {
        snprintf(err, errlen, "kernel level %s needs %s, which this CPU lacks (its best is %s)",
                 name, missing, level_names[cpu_best()]);
        return -1;
    }
    atomic_store_explicit(&current_level, l, memory_order_relaxed);
    atomic_store_explicit(&bf16_off, nobf16, memory_order_relaxed);
    return 0;
}

int cpu_init_env(char *err, size_t errlen)
{
    const char *v = getenv("KVD_CPU");
    if (!v || !*v)
        return 0;
    char why[200];
    if (cpu_force(v, why, sizeof(why))) {
        snprintf(err, errlen, "KVD_CPU: %s", why);
        return -1;
    }
    return 0;
}

bool cpu_forced(void)
{
    return cpu_level() != cpu_best() ||
           (atomic_load_explicit(&bf16_off, memory_order_relaxed) && cpu_bf16_supported());
}

const char *cpu_describe(char *buf, size_t len)
{
    enum cpu_level l = cpu_level(), b = cpu_best();
    /* at avx512, whether its avx512bf16 kernels run, and why not */
    const bool has = cpu_bf16_supported();
    const char *bf = l != CPU_AVX512 ? ""
                     : cpu_bf16()    ? "; with avx512bf16"
                     : has           ? " without avx512bf16"
                                     : "; no avx512bf16 on this CPU";
    const char *best_bf = b == CPU_AVX512 && has ? " with avx512bf16" : "";
    if (!cpu_forced())
        snprintf(buf, len, "%s (the best this CPU and build have%s)", level_names[l], bf);
    else
        snprintf(buf, len, "%s (forced%s; this CPU's best is %s%s)", level_names[l], bf,
                 level_names[b], best_bf);
    return buf;
}
