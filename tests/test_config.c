/*
 * test_config.c - the config room: value syntax, the example file, every
 * error class, precedence and origins, cross-key rules, reload, and
 * `kvd check-config` end to end.
 *
 * Parser cases are data: tests/cases/config/NAME.conf with NAME.expect
 * holding every error cfg_load() must report (FILE:LINE: message, FILE as
 * its base name) and optionally NAME.args with --set overrides. Each error
 * class has its own named test over its case; test_all_cases_have_expect
 * runs every case in the directory so none is left unchecked.
 *
 * Run from the repository root (as `make test` does).
 */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include <cmocka.h>

#include "cli/cli_internal.h"
#include "config/config.h"

#define CASES "tests/cases/config"
#define EXAMPLE "config/kvd.conf"

/* ------------------------------------------------------------------------
 * helpers
 * ------------------------------------------------------------------------ */

/* The whole file as a string (new, caller frees), or NULL if unreadable. */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (n + 1024 > cap)
            buf = realloc(buf, cap *= 2);
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0)
            break;
    }
    fclose(f);
    buf[n] = '\0';
    return buf;
}

static struct cfg_errors *new_errors(void)
{
    struct cfg_errors *e = malloc(sizeof(*e));
    assert_non_null(e);
    cfg_errors_init(e);
    return e;
}

/* Every error as "FILE:LINE: message\n", FILE shortened to its base name. */
static char *format_errors(const struct cfg_errors *errs)
{
    size_t cap = 1 << 16, n = 0;
    char *out = calloc(1, cap);
    for (int i = 0; i < errs->count; i++) {
        struct cfg_error e = errs->list[i];
        const char *slash = strrchr(e.source, '/');
        if (slash)
            memmove(e.source, slash + 1, strlen(slash + 1) + 1);
        n += (size_t)cfg_error_format(&e, out + n, cap - n);
        n += (size_t)snprintf(out + n, cap - n, "\n");
    }
    return out;
}

/* Split text into non-empty lines (modifies text); returns the count. */
static int split_lines(char *text, const char **lines, int max)
{
    int n = 0;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l && n < max;
         l = strtok_r(NULL, "\n", &save))
        lines[n++] = l;
    return n;
}

/*
 * Load CASES/name.conf with name.args and compare every error with
 * name.expect, exactly and in order.
 */
static void run_case(const char *name)
{
    char conf[256], args[256], expect[256];
    snprintf(conf, sizeof(conf), CASES "/%s.conf", name);
    snprintf(args, sizeof(args), CASES "/%s.args", name);
    snprintf(expect, sizeof(expect), CASES "/%s.expect", name);
    char *want = read_text(expect);
    if (!want)
        fail_msg("missing %s", expect);
    char *argtext = read_text(args);
    const char *sets[32];
    int n_sets = argtext ? split_lines(argtext, sets, 32) : 0;

    struct cfg_errors *errs = new_errors();
    struct cfg c;
    int rc = cfg_load(&c, conf, sets, n_sets, errs);
    char *got = format_errors(errs);
    if (strcmp(got, want))
        print_message("case %s\n--- expected\n%s--- got\n%s", name, want, got);
    assert_string_equal(got, want);
    assert_int_equal(rc, *want ? -EINVAL : 0);
    assert_int_equal(errs->dropped, 0);
    free(got);
    free(errs);
    free(argtext);
    free(want);
}

#define CASE_TEST(name)                                                                            \
    static void test_case_##name(void **state)                                                     \
    {                                                                                              \
        (void)state;                                                                               \
        run_case(#name);                                                                           \
    }

CASE_TEST(unknown_key)
CASE_TEST(key_outside_section)
CASE_TEST(unknown_section)
CASE_TEST(bad_integer)
CASE_TEST(out_of_range)
CASE_TEST(overflow)
CASE_TEST(bad_size)
CASE_TEST(bad_duration)
CASE_TEST(bad_sessions)
CASE_TEST(bad_bool)
CASE_TEST(bad_enum)
CASE_TEST(duplicate_key)
CASE_TEST(cross_key)
CASE_TEST(cross_key_window)
CASE_TEST(cross_key_h2o)
CASE_TEST(scored_policies)
CASE_TEST(cross_key_once)
CASE_TEST(cross_key_sink_pages)
CASE_TEST(cross_key_auto_window)
CASE_TEST(cross_key_auto_window_h2o)
CASE_TEST(parse_failure_rules)
CASE_TEST(auth_both)
CASE_TEST(not_key_value)
CASE_TEST(long_line)
CASE_TEST(cli_errors)
CASE_TEST(syntax)

/* Every NAME.conf in the directory has a NAME.expect and passes it. */
static void test_all_cases_have_expect(void **state)
{
    (void)state;
    DIR *d = opendir(CASES);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".conf"))
            continue;
        char name[256];
        snprintf(name, sizeof(name), "%.*s", (int)(len - 5), e->d_name);
        run_case(name);
        n++;
    }
    closedir(d);
    assert_true(n >= 20);
}

/* ------------------------------------------------------------------------
 * errors carry file, line and key as fields, not only in the text
 * ------------------------------------------------------------------------ */

static void test_error_fields(void **state)
{
    (void)state;
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    assert_int_equal(cfg_load(&c, CASES "/out_of_range.conf", NULL, 0, errs), -EINVAL);
    assert_int_equal(errs->count, 5);
    const struct cfg_error *e = &errs->list[1];
    assert_string_equal(e->source, CASES "/out_of_range.conf");
    assert_int_equal(e->line, 3);
    assert_string_equal(e->key, "cache.page_tokens");
    assert_string_equal(e->message, "[cache] page_tokens = 0: must be an integer in [1, 4096]");
    char line[2048];
    cfg_error_format(e, line, sizeof(line));
    assert_string_equal(line, CASES "/out_of_range.conf:3: [cache] page_tokens = 0: must be an "
                                    "integer in [1, 4096]");
    /* A rejected value leaves the default in place, with its origin. */
    assert_int_equal(c.cache.page_tokens, 16);
    assert_int_equal(c.origin[CFG_CACHE_PAGE_TOKENS].kind, CFG_FROM_DEFAULT);

    cfg_errors_init(errs);
    cfg_load(&c, CASES "/cross_key.conf", NULL, 0, errs);
    assert_int_equal(errs->count, 4);
    assert_string_equal(errs->list[0].key, "eviction.sink_tokens");
    assert_string_equal(errs->list[1].key, "eviction.window_tokens");
    assert_string_equal(errs->list[2].key, "model.t5_max_distance");
    assert_string_equal(errs->list[3].key, "limits.step_tokens");
    assert_int_equal(errs->list[3].line, 13);

    cfg_errors_init(errs);
    cfg_load(&c, CASES "/duplicate_key.conf", NULL, 0, errs);
    assert_int_equal(errs->count, 1);
    assert_int_equal(errs->list[0].line, 9);
    assert_non_null(strstr(errs->list[0].message, "first set on line 2"));
    /* The first value stands. */
    assert_int_equal(c.cache.memory, 1ull << 30);
    free(errs);
}

static void test_missing_file(void **state)
{
    (void)state;
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    cfg_defaults(&c);
    assert_int_equal(cfg_load_file(&c, CASES "/no_such_file.conf", errs), -ENOENT);
    assert_int_equal(errs->count, 1);
    assert_int_equal(errs->list[0].line, 0);
    assert_non_null(strstr(errs->list[0].message, "cannot open"));
    free(errs);
}

/* More errors than the list holds: the rest are counted, nothing overflows. */
static void test_error_list_full(void **state)
{
    (void)state;
    char *text = malloc(1 << 14);
    size_t n = (size_t)sprintf(text, "[limits]\n");
    for (int i = 0; i < CFG_MAX_ERRORS + 6; i++)
        n += (size_t)sprintf(text + n, "bogus_%d = 1\n", i);
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    cfg_defaults(&c);
    assert_int_equal(cfg_load_string(&c, text, "many.conf", errs), -EINVAL);
    assert_int_equal(errs->count, CFG_MAX_ERRORS);
    assert_int_equal(errs->dropped, 6);
    assert_int_equal(errs->list[CFG_MAX_ERRORS - 1].line, CFG_MAX_ERRORS + 1);
    free(errs);
    free(text);
}

/* ------------------------------------------------------------------------
 * value syntax
 * ------------------------------------------------------------------------ */

static void test_sizes(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        uint64_t v;
    } ok[] = {
        {"4GiB", 4294967296ull},
        {"512MiB", 536870912ull},
        {"64KiB", 65536},
        {"1000", 1000},
        {"0", 0},
        {"7B", 7},
        {"1KB", 1000},
        {"3MB", 3000000},
        {"2GB", 2000000000ull},
        {"1TB", 1000000000000ull},
        {"1TiB", 1ull << 40},
        {"4gib", 4294967296ull},
        {"16 KiB", 16384},
        {"16777215TiB", 16777215ull << 40},
        {"18446744073709551615", UINT64_MAX},
    };
    char err[256];
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        uint64_t v = 1;
        if (cfg_parse_size(ok[i].s, &v, err, sizeof(err)))
            fail_msg("%s: %s", ok[i].s, err);
        assert_int_equal(v, ok[i].v);
    }
    static const char *const bad[] = {"", "GiB", "-1", "4GiX", "1.5GiB", "4 G", "4k", "0x10", " 4"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t v = 1;
        assert_int_equal(cfg_parse_size(bad[i], &v, err, sizeof(err)), -EINVAL);
        assert_int_equal(v, 1);
    }
    uint64_t v;
    assert_int_equal(cfg_parse_size("18446744073709551616", &v, err, sizeof(err)), -ERANGE);
    assert_int_equal(cfg_parse_size("16777216TiB", &v, err, sizeof(err)), -ERANGE);
    assert_int_equal(cfg_parse_size("17179869184GiB", &v, err, sizeof(err)), -ERANGE);
    assert_int_equal(cfg_parse_size("4GiX", &v, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "unknown size unit 'GiX'"));

    char buf[32];
    cfg_format_size(4294967296ull, buf, sizeof(buf));
    assert_string_equal(buf, "4GiB");
    cfg_format_size(1536ull << 20, buf, sizeof(buf));
    assert_string_equal(buf, "1536MiB");
    cfg_format_size(1000, buf, sizeof(buf));
    assert_string_equal(buf, "1000");
    cfg_format_size(0, buf, sizeof(buf));
    assert_string_equal(buf, "0");
}

static void test_durations(void **state)
{
    (void)state;
    static const struct {
        const char *s;
        uint64_t ms;
    } ok[] = {
        {"250ms", 250},  {"30s", 30000},     {"5m", 300000},
        {"1h", 3600000}, {"1h30m", 5400000}, {"2d", 172800000},
        {"0", 0},        {"1m1ms", 60001},   {"213503982334d", 213503982334ull * 86400000ull},
    };
    char err[256];
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        uint64_t ms = 1;
        if (cfg_parse_duration(ok[i].s, &ms, err, sizeof(err)))
            fail_msg("%s: %s", ok[i].s, err);
        assert_int_equal(ms, ok[i].ms);
    }
    static const char *const bad[] = {"", "30", "30sec", "1.5h", "h", "-5s", "5 s", "5S", "1h30"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t ms = 1;
        if (cfg_parse_duration(bad[i], &ms, err, sizeof(err)) != -EINVAL)
            fail_msg("'%s' accepted", bad[i]);
        assert_int_equal(ms, 1);
    }
    uint64_t ms;
    assert_int_equal(cfg_parse_duration("213503982335d", &ms, err, sizeof(err)), -ERANGE);
    assert_int_equal(cfg_parse_duration("213503982334d1d", &ms, err, sizeof(err)), -ERANGE);
    assert_int_equal(cfg_parse_duration("99999999999999999999ms", &ms, err, sizeof(err)), -ERANGE);

    char buf[32];
    cfg_format_duration(90000, buf, sizeof(buf));
    assert_string_equal(buf, "90s");
    cfg_format_duration(5400000, buf, sizeof(buf));
    assert_string_equal(buf, "90m");
    cfg_format_duration(1, buf, sizeof(buf));
    assert_string_equal(buf, "1ms");
    cfg_format_duration(86400000, buf, sizeof(buf));
    assert_string_equal(buf, "1d");
}

static void test_bools(void **state)
{
    (void)state;
    static const char *const yes[] = {"true", "yes", "on", "1", "TRUE", "Yes", "ON"};
    static const char *const no[] = {"false", "no", "off", "0", "False", "NO", "Off"};
    for (size_t i = 0; i < sizeof(yes) / sizeof(yes[0]); i++) {
        bool t = false, f = true;
        assert_int_equal(cfg_parse_bool(yes[i], &t), 0);
        assert_true(t);
        assert_int_equal(cfg_parse_bool(no[i], &f), 0);
        assert_false(f);
    }
    bool b;
    assert_int_equal(cfg_parse_bool("maybe", &b), -EINVAL);
    assert_int_equal(cfg_parse_bool("", &b), -EINVAL);
    assert_int_equal(cfg_parse_bool("2", &b), -EINVAL);
    assert_int_equal(cfg_parse_bool("truex", &b), -EINVAL);
}

static void test_listen_and_strings(void **state)
{
    (void)state;
    static const char *const ok[] = {"127.0.0.1:8080", "0.0.0.0:0",    "localhost:65535",
                                     "[::1]:8080",     "[fe80::1]:80", "kvd-1.internal:443"};
    static const char *const bad[] = {"127.0.0.1",  ":8080",     "host:65536", "host:-1",
                                      "::1:8080",   "[::1]8080", "a b:80",     "host:http",
                                      "[zz::1]:80", "127.0.0.1:"};
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    cfg_defaults(&c);
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        char a[128];
        snprintf(a, sizeof(a), "server.listen=%s", ok[i]);
        assert_int_equal(cfg_set(&c, a, errs), 0);
        assert_string_equal(c.server.listen, ok[i]);
    }
    assert_int_equal(errs->count, 0);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char a[128];
        snprintf(a, sizeof(a), "server.listen=%s", bad[i]);
        if (cfg_set(&c, a, errs) != -EINVAL)
            fail_msg("listen '%s' accepted", bad[i]);
    }
    assert_int_equal(errs->count, (int)(sizeof(bad) / sizeof(bad[0])));
    assert_string_equal(c.server.listen, "kvd-1.internal:443");

    /* Strings: an empty model path is rejected; the size limit holds. */
    cfg_errors_init(errs);
    assert_int_equal(cfg_set(&c, "model.path=", errs), -EINVAL);
    char big[400];
    memset(big, 'k', sizeof(big));
    memcpy(big, "auth.api_key=", 13);
    big[sizeof(big) - 1] = '\0';
    assert_int_equal(cfg_set(&c, big, errs), -EINVAL);
    assert_int_equal(errs->count, 2);
    assert_non_null(strstr(errs->list[1].message, "longer than 255 bytes"));
    /* The secret itself is never echoed. */
    assert_null(strstr(errs->list[1].message, "kkkk"));
    free(errs);
}

/* ------------------------------------------------------------------------
 * the example file and the table
 * ------------------------------------------------------------------------ */

static void test_example_is_defaults(void **state)
{
    (void)state;
    struct cfg_errors *errs = new_errors();
    struct cfg c, d;
    int rc = cfg_load(&c, EXAMPLE, NULL, 0, errs);
    char *got = format_errors(errs);
    if (rc)
        print_message("%s", got);
    assert_int_equal(rc, 0);
    assert_int_equal(errs->count, 0);
    free(got);
    cfg_defaults(&d);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        if (!cfg_value_equal(&c, &d, (enum cfg_key)k))
            fail_msg("%s.%s in " EXAMPLE " is not the default", cfg_key_section(k),
                     cfg_key_name(k));
        if (c.origin[k].kind != CFG_FROM_FILE)
            fail_msg("%s.%s is missing from " EXAMPLE, cfg_key_section(k), cfg_key_name(k));
    }
    free(errs);
}

/*
 * Read kvd.conf as text: every key line is a table key, each table key has
 * exactly one line, and the two comment lines above it are the table's doc
 * line and its type/range/default line.
 */
static void test_example_documents_every_key(void **state)
{
    (void)state;
    char *text = read_text(EXAMPLE);
    assert_non_null(text);
    const char *lines[1024];
    int n = 0;
    for (char *p = text; *p && n < 1024;) {
        lines[n++] = p;
        char *nl = strchr(p, '\n');
        if (!nl)
            break;
        *nl = '\0';
        p = nl + 1;
    }
    int seen[CFG_N_KEYS] = {0};
    char section[64] = "";
    for (int i = 0; i < n; i++) {
        const char *l = lines[i];
        if (!*l || *l == '#' || *l == ';')
            continue;
        if (*l == '[') {
            snprintf(section, sizeof(section), "%.*s", (int)strcspn(l + 1, "]"), l + 1);
            continue;
        }
        char name[64];
        snprintf(name, sizeof(name), "%.*s", (int)strcspn(l, " ="), l);
        int k = cfg_key_find(section, name);
        if (k < 0)
            fail_msg(EXAMPLE ":%d: [%s] %s is not in the table", i + 1, section, name);
        seen[k]++;
        char want[512], desc[256];
        cfg_key_describe((enum cfg_key)k, desc, sizeof(desc));
        assert_true(i >= 2);
        snprintf(want, sizeof(want), "# %s", desc);
        if (strcmp(lines[i - 1], want))
            fail_msg(EXAMPLE ":%d: expected '%s' above %s", i, want, name);
        snprintf(want, sizeof(want), "# %s", cfg_key_doc(k));
        if (strcmp(lines[i - 2], want))
            fail_msg(EXAMPLE ":%d: expected '%s' above %s", i - 1, want, name);
    }
    for (int k = 0; k < CFG_N_KEYS; k++)
        if (seen[k] != 1)
            fail_msg("[%s] %s appears %d times in " EXAMPLE, cfg_key_section(k), cfg_key_name(k),
                     seen[k]);
    free(text);
}

/* Each key's described default is its formatted default value. */
static void test_table_defaults_canonical(void **state)
{
    (void)state;
    struct cfg d;
    cfg_defaults(&d);
    struct cfg_errors *errs = new_errors();
    assert_int_equal(cfg_validate(&d, errs), 0);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        char v[CFG_PATH_MAX], desc[256], tail[CFG_PATH_MAX + 16];
        cfg_format_value(&d, (enum cfg_key)k, v, sizeof(v));
        cfg_key_describe((enum cfg_key)k, desc, sizeof(desc));
        snprintf(tail, sizeof(tail), "; default %s", *v ? v : "empty");
        size_t dl = strlen(desc), tl = strlen(tail);
        if (dl < tl || strcmp(desc + dl - tl, tail))
            fail_msg("%s: '%s' does not end in '%s'", cfg_key_name(k), desc, tail);
        assert_int_equal(cfg_key_find(cfg_key_section(k), cfg_key_name(k)), k);
    }
    assert_int_equal(cfg_key_find("cache", "nope"), -1);
    assert_int_equal(cfg_key_find("nope", "memory"), -1);
    free(errs);
}

/*
 * syntax.conf: BOM, CRLF, indentation, inline comments, spaced section
 * name. An indented line is a key of its own, never a continuation of the
 * previous value (inih's multi-line mode would make it one).
 */
static void test_syntax_values(void **state)
{
    (void)state;
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    assert_int_equal(cfg_load(&c, CASES "/syntax.conf", NULL, 0, errs), 0);
    assert_int_equal(c.cache.memory, 4294967296ull);
    assert_int_equal(c.origin[CFG_CACHE_MEMORY].line, 4);
    assert_int_equal(c.cache.page_tokens, 32);
    assert_int_equal(c.origin[CFG_CACHE_PAGE_TOKENS].line, 5);
    assert_int_equal(c.eviction.policy, CFG_EVICT_H2O);
    assert_int_equal(c.eviction.sink_tokens, 8);
    assert_int_equal(c.origin[CFG_EVICTION_SINK_TOKENS].line, 8);
    assert_string_equal(c.auth.api_key, "abc#def");

    /* Line numbers stay right past comments, blanks and bad lines. */
    cfg_defaults(&c);
    assert_int_equal(
        cfg_load_string(&c, "# one\n\n[log]\n\n; five\nnot a pair\n  level = warn\n", "mem", errs),
        -EINVAL);
    assert_int_equal(errs->count, 1);
    assert_int_equal(errs->list[0].line, 6);
    assert_int_equal(c.log.level, CFG_LOG_WARN);
    assert_int_equal(c.origin[CFG_LOG_LEVEL].line, 7);
    free(errs);
}

/* ------------------------------------------------------------------------
 * precedence, origins, --set
 * ------------------------------------------------------------------------ */

static void test_precedence_and_origins(void **state)
{
    (void)state;
    const char *sets[] = {"cache.page_tokens=64", " eviction.policy = h2o "};
    struct cfg_errors *errs = new_errors();
    struct cfg c;
    assert_int_equal(cfg_load(&c, CASES "/precedence.conf", sets, 2, errs), 0);
    /* command line beats the file */
    assert_int_equal(c.cache.page_tokens, 64);
    assert_int_equal(c.origin[CFG_CACHE_PAGE_TOKENS].kind, CFG_FROM_CMDLINE);
    assert_int_equal(c.eviction.policy, CFG_EVICT_H2O);
    /* the file beats the defaults */
    assert_int_equal(c.eviction.sink_tokens, 8);
    assert_int_equal(c.origin[CFG_EVICTION_SINK_TOKENS].kind, CFG_FROM_FILE);
    assert_int_equal(c.origin[CFG_EVICTION_SINK_TOKENS].line, 5);
    /* untouched keys keep their defaults */
    assert_int_equal(c.cache.memory, 512ull << 20);
    assert_int_equal(c.origin[CFG_CACHE_MEMORY].kind, CFG_FROM_DEFAULT);

    char o[CFG_PATH_MAX + 32];
    cfg_format_origin(&c, CFG_EVICTION_SINK_TOKENS, o, sizeof(o));
    assert_string_equal(o, CASES "/precedence.conf:5");
    cfg_format_origin(&c, CFG_CACHE_PAGE_TOKENS, o, sizeof(o));
    assert_string_equal(o, "command line");
    cfg_format_origin(&c, CFG_CACHE_MEMORY, o, sizeof(o));
    assert_string_equal(o, "default");

    /* Without the override, the file's value and line. */
    assert_int_equal(cfg_load(&c, CASES "/precedence.conf", NULL, 0, errs), 0);
    assert_int_equal(c.cache.page_tokens, 32);
    assert_int_equal(c.origin[CFG_CACHE_PAGE_TOKENS].line, 2);

    /* Later --set of the same key wins; no file at all is fine. */
    const char *twice[] = {"limits.max_running=4", "limits.max_running=6"};
    assert_int_equal(cfg_load(&c, NULL, twice, 2, errs), 0);
    assert_int_equal(c.limits.max_running, 6);
    assert_int_equal(errs->count, 0);
    free(errs);
}

/* ------------------------------------------------------------------------
 * derived values and the server-side memory check
 * ------------------------------------------------------------------------ */

/* The budget is the cache's, reached through the hook main wires: without
 * it, a config with eviction on is refused, the missing hook named. */
static void test_budget_hook_required(void **state)
{
    (void)state;
    struct cfg c;
    cfg_defaults(&c);
    struct cfg_errors *errs = new_errors();
    cfg_set_hooks(NULL);
    assert_int_equal(cfg_validate(&c, errs), -EINVAL);
    assert_int_equal(errs->count, 1);
    assert_non_null(strstr(errs->list[0].message, "hook"));
    c.eviction.policy = CFG_EVICT_NONE;
    cfg_errors_init(errs);
    assert_int_equal(cfg_validate(&c, errs), 0);
    cfg_set_hooks(&srv_cfg_hooks);
    cfg_defaults(&c);
    cfg_errors_init(errs);
    assert_int_equal(cfg_validate(&c, errs), 0);
    free(errs);
}

static void test_window_and_memory(void **state)
{
    (void)state;
    struct cfg c;
    cfg_defaults(&c);
    /* Automatic: the budget less the sinks as the policy keeps them (4
     * sinks are one whole 16-token page for sink-window) less the page
     * eviction frees; explicit: as set. */
    assert_int_equal(cfg_window_tokens(&c), 4096 - 16 - 16);
    c.eviction.policy = CFG_EVICT_H2O;
    assert_int_equal(cfg_window_tokens(&c), 4096 - 4 - 1024 - 16);
    c.eviction.window_tokens = 100;
    assert_int_equal(cfg_window_tokens(&c), 100);
    c.eviction.window_tokens = 0;
    c.eviction.max_cache_tokens = 1000; /* less than the heavy hitters: nothing left */
    assert_int_equal(cfg_window_tokens(&c), 0);

    cfg_defaults(&c);
    assert_int_equal(cfg_sequence_pages(&c), 4096 / 16 + 1);
    c.eviction.max_cache_tokens = 4097;
    assert_int_equal(cfg_sequence_pages(&c), 257 + 1);
    cfg_defaults(&c);
    /* k_type / v_type follow kv_type unless set */
    assert_int_equal(cfg_k_type(&c), CFG_KV_F16);
    assert_int_equal(cfg_v_type(&c), CFG_KV_F16);
    c.cache.kv_type = CFG_KV_Q8_0;
    assert_int_equal(cfg_k_type(&c), CFG_KV_Q8_0);
    assert_int_equal(cfg_v_type(&c), CFG_KV_Q8_0);
    c.cache.v_type = CFG_KV_Q4_0;
    assert_int_equal(cfg_k_type(&c), CFG_KV_Q8_0);
    assert_int_equal(cfg_v_type(&c), CFG_KV_Q4_0);
    cfg_defaults(&c);

    struct cfg_errors *errs = new_errors();
    /* 512MiB / (257 pages * 16 tokens) = 130560 bytes per token, rounded down. */
    uint64_t fits = (512ull << 20) / (257 * 16);
    assert_int_equal(cfg_check_memory(&c, fits, 0, errs), 0);
    assert_int_equal(cfg_check_memory(&c, fits + 1, 0, errs), -EINVAL);
    assert_int_equal(cfg_check_memory(&c, UINT64_MAX / 2, 0, errs), -EINVAL);
    /* a windowed model: the cache's bytes for one sequence decide alone */
    assert_int_equal(cfg_check_memory(&c, UINT64_MAX / 2, 512ull << 20, errs), 0);
    assert_int_equal(cfg_check_memory(&c, 1, (512ull << 20) + 1, errs), -EINVAL);
    assert_int_equal(errs->count, 3);
    assert_string_equal(errs->list[0].key, "cache.memory");
    assert_non_null(strstr(errs->list[0].message, "needs"));
    assert_non_null(strstr(errs->list[1].message, "more than 2^64 bytes"));
    assert_non_null(strstr(errs->list[2].message, "sliding-window layers keeping only their"));
    free(errs);
}

/*
 * The eviction rule over a grid, against the cache's formula restated here
 * (kv_policy_check: sink-window keeps ceil(sink/page) whole pages of sinks,
 * h2o sink + heavy tokens; both need window + one page more): a window is
 * accepted iff it is at least a page and fits, and the automatic window
 * (window_tokens = 0) is the largest explicit window accepted (for
 * sink-window, less its eviction step's pages beyond the first), so
 * config, `kvd serve` and the cache agree on what 0 means.
 */
static void test_window_matches_budget_rule(void **state)
{
    (void)state;
    static const enum cfg_policy policies[] = {CFG_EVICT_SINK_WINDOW, CFG_EVICT_H2O};
    static const int64_t pages[] = {1, 3, 16, 64};
    static const int64_t sinks[] = {0, 1, 4, 15, 16, 17, 40};
    static const int64_t heavies[] = {1, 5, 64};
    static const int64_t maxes[] = {1, 2, 16, 31, 32, 33, 48, 63, 64, 100, 256, 4096, 131072};
    struct cfg_errors *errs = new_errors();
    int n_auto_ok = 0, n_auto_bad = 0;
    for (size_t pi = 0; pi < 2; pi++)
        for (size_t gi = 0; gi < sizeof(pages) / sizeof(pages[0]); gi++)
            for (size_t si = 0; si < sizeof(sinks) / sizeof(sinks[0]); si++)
                for (size_t hi = 0; hi < sizeof(heavies) / sizeof(heavies[0]); hi++)
                    for (size_t mi = 0; mi < sizeof(maxes) / sizeof(maxes[0]); mi++) {
                        struct cfg c;
                        cfg_defaults(&c);
                        int64_t page = pages[gi], sink = sinks[si], max = maxes[mi];
                        c.eviction.policy = policies[pi];
                        c.cache.page_tokens = page;
                        c.eviction.sink_tokens = sink;
                        c.eviction.heavy_tokens = heavies[hi];
                        c.eviction.max_cache_tokens = max;
                        bool h2o = policies[pi] == CFG_EVICT_H2O;
                        int64_t kept = h2o ? sink + heavies[hi] : (sink + page - 1) / page * page;
                        int64_t room = max - kept - page; /* the largest window that fits */

                        cfg_errors_init(errs);
                        bool auto_ok = cfg_validate(&c, errs) == 0;
                        assert_int_equal(auto_ok, room >= page);
                        if (!auto_ok) {
                            n_auto_bad++;
                            /* No explicit window is accepted either. */
                            c.eviction.window_tokens = page;
                            cfg_errors_init(errs);
                            assert_int_equal(cfg_validate(&c, errs), -EINVAL);
                            continue;
                        }
                        n_auto_ok++;
                        /* sink-window's automatic window leaves its eviction
                         * step: budget / 256 in whole pages, within the room */
                        int64_t step = page;
                        if (!h2o) {
                            step = max / (256 * page) * page;
                            step = step > room / page * page ? room / page * page : step;
                            step = step < page ? page : step;
                        }
                        assert_int_equal(cfg_window_tokens(&c), room - (step - page));
                        c.eviction.window_tokens = room;
                        cfg_errors_init(errs);
                        assert_int_equal(cfg_validate(&c, errs), 0);
                        c.eviction.window_tokens = room + 1;
                        cfg_errors_init(errs);
                        assert_int_equal(cfg_validate(&c, errs), -EINVAL);
                        assert_int_equal(errs->count, 1);
                        assert_string_equal(errs->list[0].key, "eviction.window_tokens");
                        if (page > 1) {
                            c.eviction.window_tokens = page - 1;
                            cfg_errors_init(errs);
                            assert_int_equal(cfg_validate(&c, errs), -EINVAL);
                        }
                    }
    /* The grid has both kinds of case. */
    assert_true(n_auto_ok > 100 && n_auto_bad > 100);
    free(errs);
}

/* ------------------------------------------------------------------------
 * reload
 * ------------------------------------------------------------------------ */

static void test_reload_classes(void **state)
{
    (void)state;
    for (int k = 0; k < CFG_N_KEYS; k++) {
        const char *s = cfg_key_section(k), *n = cfg_key_name(k);
        bool want;
        if (!strcmp(s, "eviction") || !strcmp(s, "limits") || !strcmp(s, "log") ||
            !strcmp(s, "auth"))
            want = true;
        else if (!strcmp(s, "model") || !strcmp(s, "cache"))
            want = false;
        else
            want = !strcmp(n, "drain_timeout") || !strcmp(n, "max_connections");
        if (cfg_key_live(k) != want)
            fail_msg("[%s] %s should %s", s, n, want ? "apply live" : "need a restart");
    }
}

static void test_reload_diff_and_merge(void **state)
{
    (void)state;
    struct cfg running, loaded, next;
    struct cfg_errors *errs = new_errors();
    assert_int_equal(cfg_load(&running, NULL, NULL, 0, errs), 0);
    const char *sets[] = {"eviction.policy=h2o",   "limits.max_running=4",
                          "log.level=debug",       "auth.api_key=tok",
                          "cache.page_tokens=32",  "server.listen=0.0.0.0:9000",
                          "model.path=other.gguf", "server.drain_timeout=5s"};
    assert_int_equal(cfg_load(&loaded, NULL, sets, 8, errs), 0);

    struct cfg_diff diff;
    cfg_reload_diff(&running, &loaded, &diff);
    const enum cfg_key live[] = {CFG_SERVER_DRAIN_TIMEOUT, CFG_EVICTION_POLICY,
                                 CFG_LIMITS_MAX_RUNNING, CFG_AUTH_API_KEY, CFG_LOG_LEVEL};
    const enum cfg_key restart[] = {CFG_SERVER_LISTEN, CFG_MODEL_PATH, CFG_CACHE_PAGE_TOKENS};
    assert_int_equal(diff.n_live, 5);
    assert_int_equal(diff.n_restart, 3);
    for (int i = 0; i < 5; i++)
        assert_int_equal(diff.live[i], live[i]);
    for (int i = 0; i < 3; i++)
        assert_int_equal(diff.restart[i], restart[i]);

    /* Same config: nothing changed. */
    cfg_reload_diff(&running, &running, &diff);
    assert_int_equal(diff.n_live + diff.n_restart, 0);

    /* The merge takes live keys from the new file, keeps the rest. */
    assert_int_equal(cfg_reload(&running, &loaded, &next, &diff, errs), 0);
    assert_int_equal(next.eviction.policy, CFG_EVICT_H2O);
    assert_int_equal(next.limits.max_running, 4);
    assert_string_equal(next.auth.api_key, "tok");
    assert_int_equal(next.origin[CFG_LIMITS_MAX_RUNNING].kind, CFG_FROM_CMDLINE);
    assert_int_equal(next.cache.page_tokens, 16);
    assert_int_equal(next.origin[CFG_CACHE_PAGE_TOKENS].kind, CFG_FROM_DEFAULT);
    assert_string_equal(next.server.listen, "127.0.0.1:8080");
    assert_string_equal(next.model.path, "models/default.gguf");
    assert_int_equal(errs->count, 0);

    /*
     * A file valid on its own can be invalid merged: with page_tokens 8,
     * 4 sinks (one page) + a one-page window + one page fit in 24 tokens;
     * with the running 16-token pages the sinks and one page alone do not.
     */
    const char *small[] = {"cache.page_tokens=8", "eviction.max_cache_tokens=24"};
    assert_int_equal(cfg_load(&loaded, NULL, small, 2, errs), 0);
    assert_int_equal(cfg_reload(&running, &loaded, &next, &diff, errs), -EINVAL);
    assert_int_equal(errs->count, 1);
    assert_string_equal(errs->list[0].key, "eviction.max_cache_tokens");
    assert_int_equal(diff.n_live, 1);
    assert_int_equal(diff.n_restart, 1);
    free(errs);
}

/* A copy is a plain struct copy: no shared pointers. */
static void test_copy_is_plain(void **state)
{
    (void)state;
    struct cfg a, b;
    cfg_defaults(&a);
    b = a;
    snprintf(a.model.path, sizeof(a.model.path), "changed.gguf");
    assert_string_equal(b.model.path, "models/default.gguf");
    assert_false(cfg_value_equal(&a, &b, CFG_MODEL_PATH));
}

/* ------------------------------------------------------------------------
 * the dump
 * ------------------------------------------------------------------------ */

static void test_dump_round_trip(void **state)
{
    (void)state;
    const char *sets[] = {
        "cache.memory=1536MiB",     "eviction.policy=none",     "limits.header_timeout=1500ms",
        "model.alibi_max_bias=0.5", "cache.mlock=yes",          "auth.api_key_file=/run/key",
        "model.t5_num_buckets=32",  "model.t5_max_distance=128"};
    struct cfg_errors *errs = new_errors();
    struct cfg c, back;
    assert_int_equal(cfg_load(&c, NULL, sets, 8, errs), 0);
    int n = cfg_dump(&c, NULL, 0);
    assert_true(n > 0);
    char *dump = malloc((size_t)n + 1);
    assert_int_equal(cfg_dump(&c, dump, (size_t)n + 1), n);
    assert_int_equal((int)strlen(dump), n);
    assert_non_null(strstr(dump, "memory = 1536MiB"));
    assert_non_null(strstr(dump, "; command line"));
    assert_non_null(strstr(dump, "; default"));

    cfg_defaults(&back);
    assert_int_equal(cfg_load_string(&back, dump, "dump", errs), 0);
    for (int k = 0; k < CFG_N_KEYS; k++)
        if (!cfg_value_equal(&c, &back, (enum cfg_key)k))
            fail_msg("%s did not survive the dump", cfg_key_name(k));

    /* A short buffer is cut, terminated, and the length still told. */
    char small[16];
    assert_int_equal(cfg_dump(&c, small, sizeof(small)), n);
    assert_int_equal(strlen(small), sizeof(small) - 1);

    /* A set api_key is shown as set, never its value. */
    assert_int_equal(cfg_set(&c, "auth.api_key_file=", errs), 0);
    assert_int_equal(cfg_set(&c, "auth.api_key=very-secret", errs), 0);
    free(dump);
    n = cfg_dump(&c, NULL, 0);
    dump = malloc((size_t)n + 1);
    cfg_dump(&c, dump, (size_t)n + 1);
    assert_null(strstr(dump, "very-secret"));
    assert_non_null(strstr(dump, "# api_key = (set, 11 bytes, hidden)"));
    free(dump);
    free(errs);
}

/*
 * The longest lines a file may hold dump to lines a file can hold: the
 * origin comment moves above a key it would push past CFG_LINE_MAX, and a
 * value written "path=..." (no spaces) stays that way. Before, such a file
 * loaded and its dump did not (the fuzzer found it).
 */
static void test_dump_long_lines(void **state)
{
    (void)state;
    char text[2 * CFG_LINE_MAX + 64], value[CFG_LINE_MAX + 1];
    memset(value, 'p', sizeof(value));
    value[CFG_LINE_MAX - 5] = '\0'; /* "path=" + value: exactly CFG_LINE_MAX */
    snprintf(text, sizeof(text), "[model]\npath=%s\nchat_template = %.*s\n", value,
             CFG_LINE_MAX - 40, value);
    struct cfg_errors *errs = new_errors();
    struct cfg c, back;
    cfg_defaults(&c);
    assert_int_equal(cfg_load_string(&c, text, "a-config-file-with-a-long-name.conf", errs), 0);
    int n = cfg_dump(&c, NULL, 0);
    char *dump = malloc((size_t)n + 1);
    cfg_dump(&c, dump, (size_t)n + 1);
    for (char *line = dump, *end; *line; line = end + 1) {
        end = strchr(line, '\n');
        assert_non_null(end);
        assert_true(end - line <= CFG_LINE_MAX);
    }
    assert_non_null(strstr(dump, "; a-config-file-with-a-long-name.conf:2\npath=ppp"));
    cfg_defaults(&back);
    if (cfg_load_string(&back, dump, "dump", errs) != 0)
        fail_msg("the dump did not load: %s", errs->list[0].message);
    assert_string_equal(back.model.path, c.model.path);
    assert_string_equal(back.model.chat_template, c.model.chat_template);

    /* One character more is refused with its line, as before. */
    value[CFG_LINE_MAX - 5] = 'p';
    value[CFG_LINE_MAX - 4] = '\0';
    snprintf(text, sizeof(text), "[model]\npath=%s\n", value);
    cfg_defaults(&c);
    cfg_errors_init(errs);
    assert_int_not_equal(cfg_load_string(&c, text, "f.conf", errs), 0);
    assert_int_equal(errs->list[0].line, 2);
    assert_non_null(strstr(errs->list[0].message, "line longer than 198 characters"));
    free(dump);
    free(errs);
}

/* ------------------------------------------------------------------------
 * `kvd check-config`, the built binary
 * ------------------------------------------------------------------------ */

/* Run a shell command, capture its stdout (at most len-1 bytes), return its exit status. */
static int run(const char *cmd, char *out, size_t len)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, len - 1, p);
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void test_check_config_command(void **state)
{
    (void)state;
    const char *bin = getenv("KVD_BIN");
    if (!bin || !*bin) {
        print_message("KVD_BIN not set (run through `make test`): skipping\n");
        skip();
    }
    static char out[1 << 16];
    char cmd[1024];

    /* Valid: exit 0, effective values with their origins on stdout. */
    snprintf(cmd, sizeof(cmd), "'%s' check-config " EXAMPLE " --set cache.page_tokens=32 2>&1",
             bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 0);
    assert_non_null(strstr(out, "page_tokens = 32"));
    assert_non_null(strstr(out, "; command line"));
    assert_non_null(strstr(out, "; " EXAMPLE ":"));
    assert_non_null(strstr(out, "memory = 512MiB"));
    /* The layout the policy gives a session, in the cache's terms. */
    assert_non_null(strstr(out, "# retained layout (sink-window): [4 sinks, kept as 32 tokens"));
    assert_non_null(strstr(out, "# one session: at most 4096 tokens in 129 pages of 32 tokens"));
    snprintf(cmd, sizeof(cmd),
             "'%s' check-config " EXAMPLE " --set eviction.policy=h2o "
             "--set eviction.heavy_tokens=512 2>&1",
             bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 0);
    assert_non_null(strstr(out, "# retained layout (h2o): [4 sinks | up to 512 middle by h2o | "
                                "3564 window]"));
    /* With a model, what a session costs in bytes (stories260K: 5 layers,
     * 4 KV heads of 16, f16 K and V: 640 bytes a token). */
    const char *shared = getenv("KVD_SHARED");
    if (shared && *shared) {
        snprintf(cmd, sizeof(cmd),
                 "'%s' check-config " EXAMPLE " --set model.path='%s/models/stories260K.gguf' "
                 "2>&1",
                 bin, shared);
        if (run(cmd, out, sizeof(out)) == 0 && !strstr(out, "cannot open"))
            assert_non_null(strstr(out, "in 257 pages of 16 tokens = 2.51 MiB (640 bytes a token)"));
        else
            print_message("%s/models/stories260K.gguf absent: the bytes line is not checked\n",
                          shared);
    }

    /* Invalid: exit 2, every error on stderr, one per line. */
    snprintf(cmd, sizeof(cmd), "'%s' check-config " CASES "/cross_key.conf 2>&1 >/dev/null", bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 2);
    char *want = read_text(CASES "/cross_key.expect");
    assert_non_null(want);
    /* The binary names the file as given; the .expect has its base name. */
    char expected[4096] = "";
    const char *lines[16];
    int n = split_lines(want, lines, 16);
    assert_int_equal(n, 4);
    for (int i = 0; i < n; i++)
        snprintf(expected + strlen(expected), sizeof(expected) - strlen(expected), CASES "/%s\n",
                 lines[i]);
    assert_string_equal(out, expected);
    free(want);

    /* A bad --set is an error too; so are a missing file and no file. */
    snprintf(cmd, sizeof(cmd), "'%s' check-config " EXAMPLE " --set cache.page_tokens=0 2>&1", bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 2);
    assert_string_equal(out,
                        "command line: [cache] page_tokens = 0: must be an integer in [1, 4096]\n");
    snprintf(cmd, sizeof(cmd), "'%s' check-config " CASES "/no_such.conf 2>&1", bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 2);
    assert_non_null(strstr(out, "cannot open"));
    snprintf(cmd, sizeof(cmd), "'%s' check-config 2>&1", bin);
    assert_int_equal(run(cmd, out, sizeof(out)), 2);
    assert_non_null(strstr(out, "usage: kvd check-config"));
}

int main(void)
{
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sizes),
        cmocka_unit_test(test_durations),
        cmocka_unit_test(test_bools),
        cmocka_unit_test(test_listen_and_strings),
        cmocka_unit_test(test_case_unknown_key),
        cmocka_unit_test(test_case_key_outside_section),
        cmocka_unit_test(test_case_unknown_section),
        cmocka_unit_test(test_case_bad_integer),
        cmocka_unit_test(test_case_out_of_range),
        cmocka_unit_test(test_case_overflow),
        cmocka_unit_test(test_case_bad_size),
        cmocka_unit_test(test_case_bad_duration),
        cmocka_unit_test(test_case_bad_bool),
        cmocka_unit_test(test_case_bad_enum),
        cmocka_unit_test(test_case_bad_sessions),
        cmocka_unit_test(test_case_duplicate_key),
        cmocka_unit_test(test_case_cross_key),
        cmocka_unit_test(test_case_cross_key_window),
        cmocka_unit_test(test_case_cross_key_h2o),
        cmocka_unit_test(test_case_scored_policies),
        cmocka_unit_test(test_case_cross_key_once),
        cmocka_unit_test(test_case_cross_key_sink_pages),
        cmocka_unit_test(test_case_cross_key_auto_window),
        cmocka_unit_test(test_case_cross_key_auto_window_h2o),
        cmocka_unit_test(test_case_parse_failure_rules),
        cmocka_unit_test(test_case_auth_both),
        cmocka_unit_test(test_case_not_key_value),
        cmocka_unit_test(test_case_long_line),
        cmocka_unit_test(test_case_cli_errors),
        cmocka_unit_test(test_case_syntax),
        cmocka_unit_test(test_all_cases_have_expect),
        cmocka_unit_test(test_syntax_values),
        cmocka_unit_test(test_error_fields),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_error_list_full),
        cmocka_unit_test(test_example_is_defaults),
        cmocka_unit_test(test_example_documents_every_key),
        cmocka_unit_test(test_table_defaults_canonical),
        cmocka_unit_test(test_precedence_and_origins),
        cmocka_unit_test(test_budget_hook_required),
        cmocka_unit_test(test_window_and_memory),
        cmocka_unit_test(test_window_matches_budget_rule),
        cmocka_unit_test(test_reload_classes),
        cmocka_unit_test(test_reload_diff_and_merge),
        cmocka_unit_test(test_copy_is_plain),
        cmocka_unit_test(test_dump_round_trip),
        cmocka_unit_test(test_dump_long_lines),
        cmocka_unit_test(test_check_config_command),
    };
    return cmocka_run_group_tests_name("config", tests, NULL, NULL);
}
