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

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define CPU_X86 1
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <sys/syscall.h>
#include <unistd.h>
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

/* cpuid words: leaf 1 ecx, leaf 7 ebx, ecx and edx, leaf 7.1 eax, leaf
 * 0x80000001 ecx, and the OS-saved state as a pseudo-word (bit 0: ymm,
 * bit 1: zmm + masks, bit 2: AMX tile configuration and data). */
enum { W1_ECX, W7_EBX, W7_ECX, W7_EDX, W71_EAX, WX_ECX, W_OS, N_WORDS };

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
/* Within the avx512 level too: AMX's bf16 tiles (cpu.h, cpu_amx). */
static const struct feature amx_features[] = {
    {"amx-tile", W7_EDX, 24}, {"amx-bf16", W7_EDX, 22}, {"os-tile-state", W_OS, 2}};

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
        w[W7_EDX] = d;
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
        if ((lo & 0x60000u) == 0x60000u) /* XTILECFG, XTILEDATA (bits 17, 18) */
            w[W_OS] |= 4u;
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

/*
 * The answer probe gives, computed on first use and kept in *slot (-1 until
 * then). Threads racing on the first use compute the same answer; release
 * and acquire publish what a probe wrote beside it (amx_refused).
 */
static int ask_once(_Atomic int *slot, int (*probe)(void))
{
    int v = atomic_load_explicit(slot, memory_order_acquire);
    if (v < 0) {
        v = probe();
        atomic_store_explicit(slot, v, memory_order_release);
    }
    return v;
}

static int probe_bf16(void)
{
#ifdef CPU_X86
    unsigned w[N_WORDS];
    read_cpuid(w);
    return cpu_level_supported(CPU_AVX512, NULL, 0) && check(w, &bf16_feature, 1, NULL, 0);
#else
    return 0;
#endif
}

bool cpu_bf16_supported(void)
{
    return ask_once(&bf16_cpu, probe_bf16);
}

bool cpu_bf16(void)
{
    return cpu_level() == CPU_AVX512 && cpu_level_built(CPU_AVX512) &&
           !atomic_load_explicit(&bf16_off, memory_order_relaxed) && cpu_bf16_supported();
}

static int probe_bf16_dot_fast(void)
{
    int f = 1;
#ifdef CPU_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    /* "GenuineIntel" in ebx, edx, ecx */
    if (__get_cpuid(0, &a, &b, &c, &d))
        f = !(b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu);
#endif
    return f;
}

/* Asked once: under a hypervisor each cpuid is a trap (microseconds), and
 * loading a model asks for every matrix. */
bool cpu_bf16_dot_fast(void)
{
    static _Atomic int fast = -1;
    return ask_once(&fast, probe_bf16_dot_fast);
}

/* amx-bf16: -1 until asked, then whether it may run; whether forced off;
 * why not, when the CPU has it but Linux refused it */
static _Atomic int amx_cpu = -1;
static _Atomic int amx_off = 0;
static char amx_refused[96];

/*
 * Linux hands a process the tile registers' 8 KiB of state only on
 * request (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a tile
 * instruction without it is a SIGILL. The permission is the process's,
 * for every thread, and asked once. Returns 0, or errno.
 */
static int amx_permission(void)
{
#if defined(__linux__) && defined(__x86_64__)
    enum { ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 };
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? errno : 0;
#else
    return ENOSYS;
#endif
}

static int probe_amx(void)
{
#ifdef CPU_X86
    unsigned w[N_WORDS];
    read_cpuid(w);
    if (!cpu_bf16_supported() ||
        !check(w, amx_features, sizeof(amx_features) / sizeof(amx_features[0]), NULL, 0))
        return 0;
    int e = amx_permission(); /* threads racing here ask twice: harmless */
    if (e)
        snprintf(amx_refused, sizeof(amx_refused), "the OS refused amx-bf16: %s", strerror(e));
    return e == 0;
#else
    return 0;
#endif
}

bool cpu_amx_supported(void)
{
    return ask_once(&amx_cpu, probe_amx);
}

bool cpu_amx(void)
{
    return cpu_bf16() && !atomic_load_explicit(&amx_off, memory_order_relaxed) &&
           cpu_amx_supported();
}

static int probe_best(void)
{
    for (int l = CPU_N_LEVELS - 1; l > CPU_SCALAR; l--)
        if (cpu_level_built((enum cpu_level)l) && cpu_level_supported((enum cpu_level)l, NULL, 0))
            return l;
    return CPU_SCALAR;
}

enum cpu_level cpu_best(void)
{
    return (enum cpu_level)ask_once(&best_level, probe_best);
}

static int probe_current(void)
{
    return (int)cpu_best();
}

enum cpu_level cpu_level(void)
{
    return (enum cpu_level)ask_once(&current_level, probe_current);
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
        atomic_store_explicit(&amx_off, 0, memory_order_relaxed);
        return 0;
    }
    /* the avx512 level with its AMX tiles turned off (an AVX-512 CPU
     * without AMX), or with both them and avx512bf16 (one without either:
     * every CPU with AMX has avx512bf16) */
    const bool nobf16 = !strcmp(name, "avx512-nobf16"), noamx = !strcmp(name, "avx512-noamx");
    int l = nobf16 || noamx ? CPU_AVX512 : -1;
    for (int i = 0; i < CPU_N_LEVELS; i++)
        if (!strcmp(name, level_names[i]))
            l = i;
    if (l < 0) {
        snprintf(err, errlen,
                 "unknown kernel level '%s' (auto, scalar, avx2, avx512, avx512-noamx, "
                 "avx512-nobf16)", name);
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
    atomic_store_explicit(&amx_off, nobf16 || noamx, memory_order_relaxed);
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
           (atomic_load_explicit(&bf16_off, memory_order_relaxed) && cpu_bf16_supported()) ||
           (atomic_load_explicit(&amx_off, memory_order_relaxed) && cpu_amx_supported());
}

/* At avx512: its optional features in use (", with avx512bf16, amx-bf16"),
 * or which are off and why (" without amx-bf16", "; no amx-bf16 on this
 * CPU", "; the OS refused amx-bf16: ..."). */
static void describe_features(char *buf, size_t len)
{
    const bool has_bf = cpu_bf16_supported(), has_amx = cpu_amx_supported();
    const char *no_amx = amx_refused[0] ? amx_refused : "no amx-bf16 on this CPU";
    if (!has_bf) /* and so no AMX either */
        snprintf(buf, len, "; no avx512bf16 on this CPU");
    else if (!cpu_bf16()) /* forced off, and AMX with it */
        snprintf(buf, len, " without avx512bf16%s", has_amx ? ", amx-bf16" : "");
    else if (cpu_amx())
        snprintf(buf, len, "; with avx512bf16, amx-bf16");
    else if (has_amx) /* forced off */
        snprintf(buf, len, "; with avx512bf16 without amx-bf16");
    else
        snprintf(buf, len, "; with avx512bf16; %s", no_amx);
}

const char *cpu_describe(char *buf, size_t len)
{
    enum cpu_level l = cpu_level(), b = cpu_best();
    char feat[128] = "", best_feat[48] = "";
    if (l == CPU_AVX512)
        describe_features(feat, sizeof(feat));
    if (b == CPU_AVX512 && cpu_bf16_supported())
        snprintf(best_feat, sizeof(best_feat), " with avx512bf16%s",
                 cpu_amx_supported() ? ", amx-bf16" : "");
    if (!cpu_forced())
        snprintf(buf, len, "%s (the best this CPU and build have%s)", level_names[l], feat);
    else
        snprintf(buf, len, "%s (forced%s; this CPU's best is %s%s)", level_names[l], feat,
                 level_names[b], best_feat);
    return buf;
}
