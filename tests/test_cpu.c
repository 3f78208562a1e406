/*
 * test_cpu.c - the kernel level (cpu/cpu.h): what the CPU is found to
 * have, forcing a level and refusing one, and the commands saying which
 * level runs.
 *
 * White-box: includes cpu/cpu.c to check the feature lists against made-up
 * cpuid words, so the refusal of a level the CPU lacks is tested on any
 * machine. The kernels of each level are compared with the references in
 * test_quant (matmul) and test_attention (attention), level by level.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "attention/attention.h"
#include "cpu/cpu.c"
#include "tests/kvd_run.h"

/* cpuid words with every feature of the lists set */
static void all_features(unsigned w[N_WORDS])
{
    memset(w, 0, sizeof(unsigned) * N_WORDS);
    for (size_t i = 0; i < sizeof(avx2_features) / sizeof(avx2_features[0]); i++)
        w[avx2_features[i].reg] |= 1u << avx2_features[i].bit;
    for (size_t i = 0; i < sizeof(avx512_features) / sizeof(avx512_features[0]); i++)
        w[avx512_features[i].reg] |= 1u << avx512_features[i].bit;
}

/* A CPU without VNNI (Skylake-SP) or without the OS saving zmm state: the
 * missing features are named, one by one. */
static void test_missing_named(void **state)
{
    (void)state;
    unsigned w[N_WORDS];
    char missing[160];
    all_features(w);
    missing[0] = '\0';
    assert_true(check(w, avx512_features, 7, missing, sizeof(missing)));
    assert_string_equal(missing, "");

    w[W7_ECX] &= ~(1u << 11); /* no avx512vnni */
    assert_false(check(w, avx512_features, 7, missing, sizeof(missing)));
    assert_string_equal(missing, "avx512vnni");

    all_features(w);
    w[W_OS] = 1u;             /* ymm state saved, zmm not */
    w[W1_ECX] &= ~(1u << 29); /* and no f16c */
    missing[0] = '\0';
    assert_false(check(w, avx2_features, 9, missing, sizeof(missing)));
    assert_false(check(w, avx512_features, 7, missing, sizeof(missing)));
    assert_string_equal(missing, "f16c os-zmm-state");
}

/* Forcing: unknown names refused with the list, every level the CPU runs
 * accepted (and followed by the attention kernels), "auto" returns to the
 * best; a level the CPU lacks is refused naming what it lacks. */
static void test_force(void **state)
{
    (void)state;
    char err[256];
    enum cpu_level best = cpu_best();
    assert_int_equal(cpu_level(), best);
    assert_false(cpu_forced());
    print_message("best level here: %s\n", cpu_level_name(best));

    assert_int_equal(cpu_force("avx9", err, sizeof(err)), -1);
    assert_non_null(strstr(err, "unknown kernel level 'avx9'"));
    assert_non_null(strstr(err, "scalar, avx2, avx512"));
    assert_int_equal(cpu_level(), best); /* unchanged */

    for (int l = CPU_SCALAR; l < CPU_N_LEVELS; l++) {
        char missing[160];
        bool can = cpu_level_built((enum cpu_level)l) &&
                   cpu_level_supported((enum cpu_level)l, missing, sizeof(missing));
        int rc = cpu_force(cpu_level_name((enum cpu_level)l), err, sizeof(err));
        if (can) {
            assert_int_equal(rc, 0);
            assert_int_equal(cpu_level(), l);
            assert_int_equal(cpu_forced(), l != (int)best);
            assert_string_equal(attn_simd_name(), cpu_level_name((enum cpu_level)l));
            char line[160];
            cpu_describe(line, sizeof(line));
            assert_non_null(strstr(line, cpu_level_name((enum cpu_level)l)));
            assert_true((strstr(line, "forced") != NULL) == (l != (int)best));
        } else {
            print_message("level %s refused here: %s\n", cpu_level_name((enum cpu_level)l), err);
            assert_int_equal(rc, -1);
            assert_int_equal(cpu_level(), best);
            if (cpu_level_built((enum cpu_level)l))
                assert_non_null(strstr(err, missing));
        }
    }
    assert_int_equal(cpu_force("auto", err, sizeof(err)), 0);
    assert_int_equal(cpu_level(), best);
    assert_null(cpu_level_name((enum cpu_level)CPU_N_LEVELS));
}

/* Whether /proc/cpuinfo lists flag for the first CPU (false without it). */
static bool cpuinfo_flag(const char *flag)
{
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[4096];
    bool has = false;
    if (!f)
        return false;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "flags", 5)) {
            char want[64];
            snprintf(want, sizeof want, " %s", flag);
            const char *p = strstr(line, want);
            has = p && (p[strlen(want)] == ' ' || p[strlen(want)] == '\n');
            break;
        }
    fclose(f);
    return has;
}

/* AMX's bf16 tiles: detected as the kernel lists them (or refused by it,
 * and then said why), on at avx512 where the CPU has them, off under
 * "avx512-noamx" (forced, where the CPU has them) and "avx512-nobf16";
 * the line says which. */
static void test_amx(void **state)
{
    (void)state;
    char err[256], line[256];
    const bool has = cpu_amx_supported();
    const bool listed = cpuinfo_flag("amx_tile") && cpuinfo_flag("amx_bf16");
    print_message("amx-bf16 here: %s (cpuinfo: %s)\n", has ? "yes" : "no", listed ? "yes" : "no");
    if (!listed)
        assert_false(has);
    else if (!has && cpu_bf16_supported())
        assert_non_null(strstr(cpu_describe(line, sizeof line), "the OS refused amx-bf16"));
    assert_int_equal(cpu_amx(), has && cpu_level() == CPU_AVX512);
    if (cpu_force("avx512-noamx", err, sizeof err)) {
        print_message("avx512-noamx refused here: %s\n", err);
        assert_false(has);
        return;
    }
    assert_false(cpu_amx());
    assert_int_equal(cpu_bf16(), cpu_bf16_supported());
    assert_int_equal(cpu_forced(), has);
    cpu_describe(line, sizeof line);
    print_message("avx512-noamx: %s\n", line);
    if (has)
        assert_non_null(strstr(line, "with avx512bf16 without amx-bf16"));
    assert_int_equal(cpu_force("avx512-nobf16", err, sizeof err), 0);
    assert_false(cpu_amx());
    assert_false(cpu_bf16());
    assert_int_equal(cpu_force("auto", err, sizeof err), 0);
    assert_int_equal(cpu_amx(), has);
    if (has)
        assert_non_null(strstr(cpu_describe(line, sizeof line), "with avx512bf16, amx-bf16)"));
}

/* KVD_CPU through cpu_init_env: unset or empty leaves the level alone. */
static void test_env(void **state)
{
    (void)state;
    char err[256];
    unsetenv("KVD_CPU");
    assert_int_equal(cpu_init_env(err, sizeof(err)), 0);
    setenv("KVD_CPU", "", 1);
    assert_int_equal(cpu_init_env(err, sizeof(err)), 0);
    setenv("KVD_CPU", "sse9", 1);
    assert_int_equal(cpu_init_env(err, sizeof(err)), -1);
    assert_non_null(strstr(err, "KVD_CPU: unknown kernel level 'sse9'"));
    setenv("KVD_CPU", "scalar", 1);
    assert_int_equal(cpu_init_env(err, sizeof(err)), 0);
    assert_int_equal(cpu_level(), CPU_SCALAR);
    unsetenv("KVD_CPU");
    assert_int_equal(cpu_force("auto", err, sizeof(err)), 0);
}

/* ------------------------------------------------------------------------
 * The kvd binary says which level runs, and refuses a bad KVD_CPU
 * ------------------------------------------------------------------------ */

static char dir[] = "/tmp/kvd-test-cpu-XXXXXX";

/* Run `env KVD_CPU=level kvd args`, stderr into *err (malloc'd). Exit status. */
static int run_kvd(const char *level, const char *args, char **err)
{
    char vars[100];
    snprintf(vars, sizeof(vars), "KVD_CPU='%s'", level);
    return kvd_run(vars, args, dir, err);
}

static void test_binary(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN") || !*getenv("KVD_BIN")) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    assert_non_null(mkdtemp(dir));
    char args[600], *err;
    snprintf(args, sizeof(args),
             "mkmodel --out '%s/m.gguf' --dim 64 --layers 2 --heads 4 --kv-heads 2 --ff 64 "
             "--vocab 300 --type q8_0",
             dir);
    assert_int_equal(run_kvd("", args, &err), 0);
    free(err);

    assert_int_equal(run_kvd("avx9", "version", &err), 2);
    assert_non_null(strstr(err, "kvd: KVD_CPU: unknown kernel level 'avx9'"));
    free(err);

    snprintf(args, sizeof(args), "generate --model '%s/m.gguf' --prompt hello -n 4", dir);
    enum cpu_level best = cpu_best();
    for (int l = CPU_SCALAR; l < CPU_N_LEVELS; l++) {
        const char *name = cpu_level_name((enum cpu_level)l);
        int rc = run_kvd(name, args, &err);
        char want[80];
        if (l <= (int)best) {
            assert_int_equal(rc, 0);
            snprintf(want, sizeof(want), "kvd generate: kernels %s (%s", name,
                     l == (int)best ? "the best" : "forced");
            if (!strstr(err, want))
                fail_msg("KVD_CPU=%s: no '%s' in:\n%s", name, want, err);
        } else {
            assert_int_equal(rc, 2);
            snprintf(want, sizeof(want), "kernel level %s ", name);
            assert_non_null(strstr(err, want));
        }
        free(err);
    }
    snprintf(args, sizeof(args), "rm -rf '%s'", dir);
    assert_int_equal(system(args), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_missing_named),
        cmocka_unit_test(test_force),
        cmocka_unit_test(test_amx),
        cmocka_unit_test(test_env),
        cmocka_unit_test(test_binary),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
