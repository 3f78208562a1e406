/*
 * test_pages.c - the pages asked for the weights' repacked copy
 * (model/model_pack.c) and for the KV pool (cache/pool.c), one switch for
 * both (cpu/mem.h): 2 MiB pages advised by default, 4 KiB asked for when
 * the caller says small_pages (kvd serve's [model] huge_pages = false; the
 * pool takes the model's through model_kv_shape) or KVD_HUGE_PAGES=off,
 * KVD_HUGE_PAGES winning over the caller; what the load and start lines
 * say; and a bad value refused, in the config (file, line and key named)
 * and in the environment (the variable named).
 *
 * The advice itself is read back from the kernel: /proc/self/smaps lists
 * each mapping's VmFlags, "hg" for MADV_HUGEPAGE and "nh" for
 * MADV_NOHUGEPAGE. On a level with no repacked kernels for the small
 * model's type there is no copy, and the weights' cases are skipped (the
 * pool's still run).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "cache/kv_cache.h"
#include "cpu/mem.h"
#include "model/model_internal.h"
#include "tests/kvd_run.h"
#include "tests/serve_util.h"

static char dir[128], model_path[256];

static int setup(void **state)
{
    (void)state;
    return su_scratch_model("pages", 7, dir, sizeof dir, model_path, sizeof model_path);
}

static int teardown(void **state)
{
    (void)state;
    return su_remove_dir(dir);
}

/* The VmFlags of the mapping that holds address a ("" if none), into flags. */
static void vm_flags(const void *a, char *flags, size_t len)
{
    FILE *f = fopen("/proc/self/smaps", "r");
    assert_non_null(f);
    char line[512];
    bool in = false;
    flags[0] = '\0';
    while (fgets(line, sizeof line, f)) {
        uintptr_t lo, hi;
        if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' '))
            in = (uintptr_t)a >= lo && (uintptr_t)a < hi;
        else if (in && !strncmp(line, "VmFlags:", 8)) {
            snprintf(flags, len, "%.200s", line + 8);
            break;
        }
    }
    fclose(f);
}

/* The VmFlags at a must hold want ("hg" or "nh"), and line say says. */
static void expect_flags(const char *what, bool small_pages, const void *a, const char *want,
                         const char *line, const char *says)
{
    char flags[256];
    vm_flags(a, flags, sizeof flags);
    if (!strstr(flags, want))
        fail_msg("%s, small_pages %d, KVD_HUGE_PAGES '%s': VmFlags '%s' lack '%s'", what,
                 small_pages, getenv("KVD_HUGE_PAGES") ? getenv("KVD_HUGE_PAGES") : "", flags,
                 want);
    if (!strstr(line, says))
        fail_msg("%s: line '%s' does not say '%s'", what, line, says);
}

/* Load the small model with small_pages, and make a KV pool of its shape
 * (model_kv_shape: the model's small_pages with it); the copy's and the
 * pool's VmFlags must hold want and their lines say says. With no copy at
 * this level, the pool alone. */
static void expect_pages(bool small_pages, const char *want, const char *says)
{
    struct model_params mp = {.path = model_path, .small_pages = small_pages};
    char err[512], line[512];
    model *m = model_load(&mp, err, sizeof err);
    if (!m)
        fail_msg("load: %s", err);
    if (mm_pack_kernel_name()) {
        assert_non_null(m->pack_mem);
        model_pack_describe(m, line, sizeof line);
        expect_flags("weights", small_pages, m->pack_mem, want, line, says);
    }
    struct kv_cache_params cp = {.memory_bytes = 4u << 20,
                                 .page_tokens = 16,
                                 .k_type = KV_F16,
                                 .v_type = KV_F16};
    model_kv_shape(m, &cp);
    kv_cache *c = kv_cache_create(&cp, err, sizeof err);
    if (!c)
        fail_msg("kv cache: %s", err);
    snprintf(line, sizeof line, "(%s)", kv_cache_pages(c)->says);
    expect_flags("kv pool", small_pages, kv_cache_base(c), want, line, says);
    assert_false(kv_cache_pages(c)->refused);
    kv_cache_destroy(c);
    model_free(m);
}

static void set_env(const char *v)
{
    char err[256] = "";
    if (v)
        setenv("KVD_HUGE_PAGES", v, 1);
    else
        unsetenv("KVD_HUGE_PAGES");
    if (cpu_pages_init_env(err, sizeof err))
        fail_msg("KVD_HUGE_PAGES=%s refused: %s", v ? v : "(unset)", err);
}

/* The caller's choice, then KVD_HUGE_PAGES over it both ways, then a bad
 * value refused (and the setting before it kept). */
static void test_advice(void **state)
{
    (void)state;
    if (access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK)) {
        print_message("skipping: no transparent huge pages in this kernel\n");
        skip();
        return;
    }
    if (!mm_pack_kernel_name())
        print_message("no repacked kernels at this level: the KV pool alone\n");
    set_env(NULL);
    expect_pages(false, "hg", "(2 MiB pages advised)");
    expect_pages(true, "nh", "(4 KiB pages, huge pages off)");
    set_env("on");
    expect_pages(true, "hg", "(2 MiB pages advised, KVD_HUGE_PAGES=on)");
    set_env("off");
    expect_pages(false, "nh", "(4 KiB pages, KVD_HUGE_PAGES=off)");

    char err[256] = "";
    setenv("KVD_HUGE_PAGES", "yes", 1);
    assert_int_equal(cpu_pages_init_env(err, sizeof err), -1);
    assert_string_equal(err, "KVD_HUGE_PAGES: unknown value 'yes' (on, off)");
    expect_pages(false, "nh", "KVD_HUGE_PAGES=off");
    set_env("");
    expect_pages(false, "hg", "(2 MiB pages advised)");
    set_env(NULL);
}

/* The binary: kvd serve reads [model] huge_pages into its load line and
 * its KV pool's start line, a bad value stops it with the key named, and
 * KVD_HUGE_PAGES reaches kvd generate's weights and KV pool or stops it. */
static void test_binary(void **state)
{
    (void)state;
    const char *kvd = getenv("KVD_BIN");
    assert_non_null(kvd);
    struct su_proc p = {0};
    snprintf(p.log, sizeof p.log, "%s/serve.log", dir);
    const char *args[] = {"--set", "model.huge_pages=false"};
    assert_int_equal(su_serve(&p, kvd, model_path, args, 2), 0);
    assert_int_equal(su_stop(&p, SIGTERM, 10), 0); /* the log is complete once it exits */
    bool said = (su_file_has(p.log, "(4 KiB pages, huge pages off), the mapped") ||
                 su_file_has(p.log, "as stored")) &&
                su_file_has(p.log, "tokens (4 KiB pages, huge pages off)");
    if (!said)
        su_dump_log(&p);
    assert_true(said);

    char cmd[700], *err;
    snprintf(cmd, sizeof cmd,
             "serve --model '%s' --listen 127.0.0.1:0 --set model.huge_pages=sometimes",
             model_path);
    int rc = kvd_run("", cmd, dir, &err);
    if (rc == 0 || !strstr(err, "[model] huge_pages = sometimes: must be a boolean"))
        fail_msg("exit %d:\n%s", rc, err);
    free(err);

    snprintf(cmd, sizeof cmd, "generate --model '%s' --prompt hi -n 1 --temp 0", model_path);
    rc = kvd_run("KVD_HUGE_PAGES=off", cmd, dir, &err);
    if (rc != 0 ||
        !(strstr(err, "(4 KiB pages, KVD_HUGE_PAGES=off), the mapped") ||
          strstr(err, "as stored")) ||
        !strstr(err, "tokens (4 KiB pages, KVD_HUGE_PAGES=off)"))
        fail_msg("exit %d:\n%s", rc, err);
    free(err);
    rc = kvd_run("KVD_HUGE_PAGES=2m", cmd, dir, &err);
    if (rc != 2 || !strstr(err, "kvd: KVD_HUGE_PAGES: unknown value '2m' (on, off)"))
        fail_msg("exit %d:\n%s", rc, err);
    free(err);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_advice),
        cmocka_unit_test(test_binary),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
