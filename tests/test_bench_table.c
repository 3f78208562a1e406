/*
 * test_bench_table.c - `make bench`'s table driver (tests/bench/
 * bench_table.c) runs and prints a well-formed table.
 *
 * The driver reads `kvd generate`'s report lines ("prefill: N tokens in T s
 * (R tokens/s)", "decode: ..."), so a change to that report that the
 * driver no longer understands shows here, not first in a benchmark run.
 * Each test runs the driver on its tiny model (64 wide, 2 layers, contexts
 * of 64 to 1k tokens: seconds) against $KVD_BIN and checks the table's
 * shape: the machine and peak lines, one row per cell the plan runs, every
 * figure a positive number, every fraction a percentage, the cells not run
 * listed, each binary's kernels line; with --before, both columns and
 * their ratio; a binary that fails is a "failed" cell, a note saying why
 * and exit status 1; a bad option exit status 2. No figure is compared
 * with any speed: nothing here asserts a time.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/serve_util.h"

static const char *kvd_bin;
static char bench_bin[600];
static char tmpdir[256];
static char models[300];

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (!kvd_bin) {                                                                            \
            print_message("KVD_BIN is not set (run through `make test`): skipped\n");              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static int setup(void **state)
{
    (void)state;
    kvd_bin = getenv("KVD_BIN");
    if (!kvd_bin)
        return 0;
    /* the Makefile builds the driver beside the binary: BUILD/bench/ */
    const char *slash = strrchr(kvd_bin, '/');
    int dir_len = slash ? (int)(slash - kvd_bin) : 1;
    snprintf(bench_bin, sizeof bench_bin, "%.*s/bench/bench_table", dir_len,
             slash ? kvd_bin : ".");
    snprintf(tmpdir, sizeof tmpdir, "/tmp/kvd-test-bench-table-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(models, sizeof models, "%s/models", tmpdir);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return su_remove_dir(tmpdir);
}

/* Run the driver with args (NULL-terminated, after the program name);
 * its stdout into a malloc'd string, its exit status into *status. */
static char *run_driver(const char *const *args, int *status)
{
    const char *argv[32] = {bench_bin};
    int n = 1;
    for (; args[n - 1] && n < 31; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    struct su_proc p = {0};
    snprintf(p.log, sizeof p.log, "%s/driver.log", tmpdir);
    int fd = -1;
    assert_int_equal(su_spawn(&p, (char *const *)argv, &fd), 0);
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    for (ssize_t k; (k = read(fd, out + len, cap - 1 - len)) > 0;) {
        len += (size_t)k;
        if (len + 1 == cap) {
            cap *= 2;
            out = realloc(out, cap);
            assert_non_null(out);
        }
    }
    out[len] = '\0';
    close(fd);
    *status = su_wait(&p, 300);
    if (*status != 0 && *status != 1)
        su_dump_log(&p);
    return out;
}

/* The cells of a table row "| a | b | ... |", trimmed, into cells (each
 * at most 63 bytes); the count, or -1 when the line is not a row. */
static int row_cells(const char *line, char cells[][64], int max)
{
    if (line[0] != '|')
        return -1;
    int n = 0;
    const char *p = line + 1;
    for (const char *bar; (bar = strchr(p, '|')) && n < max; p = bar + 1) {
        while (*p == ' ')
            p++;
        int len = (int)(bar - p);
        while (len > 0 && p[len - 1] == ' ')
            len--;
        snprintf(cells[n++], 64, "%.*s", len, p);
    }
    return n;
}

/* The table's row for type/kv/ctx (e.g. "q8_0", "f16", "64"), or NULL. */
static const char *find_kv_row(const char *out, const char *type, const char *kv, const char *ctx,
                               char *line, size_t len)
{
    char want[64];
    snprintf(want, sizeof want, "| %s | %s | %s |", type, kv, ctx);
    const char *at = strstr(out, want);
    if (!at)
        return NULL;
    size_t n = strcspn(at, "\n");
    snprintf(line, len, "%.*s", (int)n, at);
    return line;
}

/* ... with f16 K/V. */
static const char *find_row(const char *out, const char *type, const char *ctx, char *line,
                            size_t len)
{
    return find_kv_row(out, type, "f16", ctx, line, len);
}

static void assert_positive(const char *cell)
{
    char *end;
    double v = strtod(cell, &end);
    if (end == cell || *end || !(v > 0)) {
        print_message("not a positive number: '%s'\n", cell);
        fail();
    }
}

static void assert_percent(const char *cell)
{
    char *end;
    double v = strtod(cell, &end);
    if (end == cell || strcmp(end, "%") || v < 0) {
        print_message("not a percentage: '%s'\n", cell);
        fail();
    }
}

/* "12% → 15%": the before and after fractions. */
static void assert_two_percents(const char *cell)
{
    char a[64], b[64];
    const char *arrow = strstr(cell, " → ");
    assert_non_null(arrow);
    snprintf(a, sizeof a, "%.*s", (int)(arrow - cell), cell);
    snprintf(b, sizeof b, "%s", arrow + strlen(" → "));
    assert_percent(a);
    assert_percent(b);
}

static void test_one_binary(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *args[] = {"--tiny", "--kvd", kvd_bin, "--models", models, "--types",
                          "f32,q8_0", NULL};
    int status;
    char *out = run_driver(args, &status);
    print_message("%s", out);
    assert_int_equal(status, 0);
    assert_non_null(strstr(out, "machine: "));
    assert_non_null(strstr(out, "peaks of one core, measured now"));
    /* the read-only stream beside the bus: measured, not a constant */
    const char *rd = strstr(out, "read-only stream on ");
    assert_non_null(rd);
    int rth = 0;
    double rgbs = 0, rfrac = 0;
    assert_int_equal(sscanf(rd, "read-only stream on %d threads: %lf GB/s = %lf of the bus",
                            &rth, &rgbs, &rfrac),
                     3);
    assert_true(rth >= 1 && rgbs > 0.0 && rfrac > 0.05 && rfrac < 5.0);
    assert_non_null(strstr(out, "| weights | KV | context | bus GB/s | decode tok/s | "
                                "decode roofline | of roofline | prefill tok/s | "
                                "prefill roofline | of roofline | load |"));
    /* the default plan: every type at 64 and 256, q8_0 also at 1k */
    const char *cells_run[][2] = {{"f32", "64"}, {"f32", "256"}, {"q8_0", "64"},
                                  {"q8_0", "256"}, {"q8_0", "1k"}};
    for (size_t i = 0; i < sizeof cells_run / sizeof *cells_run; i++) {
        char line[512], c[16][64];
        assert_non_null(find_row(out, cells_run[i][0], cells_run[i][1], line, sizeof line));
        assert_int_equal(row_cells(line, c, 16), 11);
        for (int k = 3; k < 10; k++)
            if (k == 6 || k == 9)
                assert_percent(c[k]);
            else
                assert_positive(c[k]);
    }
    char line[512];
    assert_null(find_row(out, "f32", "1k", line, sizeof line));
    assert_non_null(strstr(out, "not run (--full, or --ctx"));
    assert_non_null(strstr(out, " f32 1k"));
    assert_non_null(strstr(out, " q8_0 2k"));
    assert_non_null(strstr(out, "kvd = "));
    assert_non_null(strstr(out, ": kernels "));
    free(out);
}

static void test_before_after(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *args[] = {"--tiny", "--kvd", kvd_bin, "--before", kvd_bin, "--models", models,
                          "--types", "q8_0", "--ctx", "64", "--rounds", "2", NULL};
    int status;
    char *out = run_driver(args, &status);
    print_message("%s", out);
    assert_int_equal(status, 0);
    assert_non_null(strstr(out, "| decode before | decode after | × |"));
    char line[512], c[20][64];
    assert_non_null(find_row(out, "q8_0", "64", line, sizeof line));
    assert_int_equal(row_cells(line, c, 20), 15);
    const int positive[] = {3, 4, 5, 6, 7, 9, 10, 11, 12};
    for (size_t i = 0; i < sizeof positive / sizeof *positive; i++)
        assert_positive(c[positive[i]]);
    assert_two_percents(c[8]);
    assert_two_percents(c[13]);
    assert_null(find_row(out, "q8_0", "256", line, sizeof line)); /* --ctx: only 64 */
    assert_non_null(strstr(out, "before = "));
    assert_non_null(strstr(out, "after = "));
    free(out);
}

/* f16-bf16 rows (the f16 model under KVD_F16=bf16) are held to the
 * vdpbf16ps peak (tdpbf16ps's where the CPU has AMX's bf16 tiles, which
 * then run them): their prefill roofline is above the f16 rows' wherever
 * that peak was measured (equal where the CPU lacks it); q8_0 K/V rows run,
 * their decode roofline above f16 K/V's (fewer bytes per position). */
static void test_f16_bf16_and_q8_kv(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *args[] = {"--tiny", "--kvd", kvd_bin, "--models", models, "--types",
                          "f16,f16-bf16", "--kv", "f16,q8_0", "--ctx", "64,1k", NULL};
    int status;
    char *out = run_driver(args, &status);
    print_message("%s", out);
    assert_int_equal(status, 0);
    /* [type f16, f16-bf16][kv f16, q8_0][ctx 64, 1k] */
    char line[512], c[2][2][2][16][64];
    const char *types[] = {"f16", "f16-bf16"}, *kvs[] = {"f16", "q8_0"}, *ctxs[] = {"64", "1k"};
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 2; k++)
            for (int x = 0; x < 2; x++) {
                assert_non_null(find_kv_row(out, types[t], kvs[k], ctxs[x], line, sizeof line));
                assert_int_equal(row_cells(line, c[t][k][x], 16), 11);
                for (int i = 3; i < 10; i++)
                    if (i == 6 || i == 9)
                        assert_percent(c[t][k][x][i]);
                    else
                        assert_positive(c[t][k][x][i]);
            }
    /* at 64 tokens the weights dominate prefill: the f16-bf16 row is held
     * to vdpbf16ps's peak, the f16 row to the FMA's, so the rooflines
     * differ as the measured peaks do (above the FMA's on an AVX-512 EPYC,
     * half of it on an AMX Xeon: no CPU's ratio is assumed) */
    double f16_roof = atof(c[0][0][0][8]), bf16_roof = atof(c[1][0][0][8]);
    if (strstr(out, "vdpbf16ps not measured")) {
        assert_true(bf16_roof == f16_roof);
    } else {
        /* the pairs' yardstick: tdpbf16ps's where measured (AMX), else vdpbf16ps's */
        const char *pf = strstr(out, "f32 FMA ("), *pb = strstr(out, "vdpbf16ps "),
                   *pt = strstr(out, "tdpbf16ps ");
        assert_non_null(pf);
        assert_non_null(pb);
        assert_non_null(pt);
        const bool amx = !strstr(out, "tdpbf16ps not measured");
        double fma = atof(strchr(pf, ')') + 1), /* "f32 FMA (512-bit) N GFLOPS" */
               bf = amx ? atof(pt + strlen("tdpbf16ps ")) : atof(pb + strlen("vdpbf16ps "));
        print_message("peaks: FMA %.0f, %s %.0f GFLOPS\n", fma, amx ? "tdpbf16ps" : "vdpbf16ps",
                      bf);
        if (bf > 1.2 * fma)
            assert_true(bf16_roof > 1.1 * f16_roof);
        else if (bf < fma / 1.2)
            assert_true(bf16_roof < f16_roof / 1.1);
    }
    /* at 1k the K/V bytes do decode's: roofline / bus = 1 / bytes */
    char(*f16kv)[64] = c[0][0][1], (*q8kv)[64] = c[0][1][1];
    assert_true(atof(q8kv[5]) / atof(q8kv[3]) > 1.1 * atof(f16kv[5]) / atof(f16kv[3]));
    assert_non_null(strstr(out, "KVD_F16=bf16"));
    free(out);
}

/* Contexts above --fill-above decode after `kvd generate --fill`: decode
 * figures as any row, "fill" for prefill, the note that says how; --real
 * reads the whole prompt there instead. */
static void test_fill_rows(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *args[] = {"--tiny", "--kvd", kvd_bin, "--models", models, "--types", "q8_0",
                          "--ctx", "1k,2k", NULL};
    int status;
    char *out = run_driver(args, &status);
    print_message("%s", out);
    assert_int_equal(status, 0);
    char line[512], c[16][64];
    assert_non_null(find_row(out, "q8_0", "2k", line, sizeof line));
    assert_int_equal(row_cells(line, c, 16), 11);
    for (int k = 3; k < 6; k++)
        assert_positive(c[k]);
    assert_percent(c[6]);
    assert_string_equal(c[7], "fill");
    assert_string_equal(c[8], "-");
    assert_non_null(find_row(out, "q8_0", "1k", line, sizeof line)); /* 1k: read for real */
    assert_int_equal(row_cells(line, c, 16), 11);
    assert_positive(c[7]);
    assert_non_null(strstr(out, "fill rows (contexts above 1k; --real reads every prompt): the "
                                "prompt is 256 real tokens"));
    free(out);

    const char *real[] = {"--tiny", "--kvd", kvd_bin, "--models", models, "--types", "q8_0",
                          "--ctx", "2k", "--real", NULL};
    out = run_driver(real, &status);
    assert_int_equal(status, 0);
    assert_non_null(find_row(out, "q8_0", "2k", line, sizeof line));
    assert_int_equal(row_cells(line, c, 16), 11);
    assert_positive(c[7]);
    assert_null(strstr(out, "fill rows"));
    free(out);
}

static void test_failing_binary(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *args[] = {"--tiny", "--kvd", "/bin/false", "--models", models, "--types",
                          "q8_0", "--ctx", "64", NULL};
    int status;
    char *out = run_driver(args, &status);
    print_message("%s", out);
    assert_int_equal(status, 1);
    char line[512], c[16][64];
    assert_non_null(find_row(out, "q8_0", "64", line, sizeof line));
    assert_int_equal(row_cells(line, c, 16), 11);
    assert_string_equal(c[4], "failed");
    assert_string_equal(c[7], "failed");
    assert_non_null(strstr(out, "note: q8_0 f16-KV 64 kvd: "));
    free(out);
}

static void test_bad_options(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *bad[][4] = {{"--kvd", kvd_bin, "--ctx", "5"},
                            {"--kvd", kvd_bin, "--types", "q4_0"},
                            {"--kvd", kvd_bin, "--kv", "f32"},
                            {"--ctx", "512", "--full", "--tiny"}};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        const char *args[] = {bad[i][0], bad[i][1], bad[i][2], bad[i][3], NULL};
        int status;
        free(run_driver(args, &status));
        assert_int_equal(status, 2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_binary),
        cmocka_unit_test(test_before_after),
        cmocka_unit_test(test_f16_bf16_and_q8_kv),
        cmocka_unit_test(test_fill_rows),
        cmocka_unit_test(test_failing_binary),
        cmocka_unit_test(test_bad_options),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
