/*
 * test_build.c - `make run` and `make test` work as the first command on a
 * fresh machine.
 *
 * On a fresh machine the llhttp sources the build compiles in appear only
 * when `make deps` installs node-llhttp. GNU make reads a directory's
 * contents once per invocation, so a build that runs in the same invocation
 * as the install does not see them ("No rule to make target
 * build/llhttp/api.o"), and a second `make run` works. The Makefile
 * therefore installs in one make invocation and builds in another.
 *
 * These tests reproduce the fresh machine: a copy of the source tree
 * without build output, and an LLHTTP_DIR that does not exist until the
 * `make deps` step (DEPS_CMD, replaced here by a copy of Debian's llhttp
 * sources) creates it. `make run` must then build, write the default model
 * (the retrieval model) and answer a completion with the code it was given; `make test` must build
 * and pass the tests it is asked for. Each make runs in a clean environment (no MAKEFLAGS from the
 * make that runs this test) at -O0, so the build takes seconds.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "serve_util.h"

#define LLHTTP_SYSTEM "/usr/share/llhttp"

struct fresh {
    char dir[256];  /* scratch directory */
    char src[300];  /* the copied tree */
    char http[300]; /* the LLHTTP_DIR that appears during `make deps` */
};

static bool exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Copy the source tree (no build output, models, binary or git data) into
 * a scratch directory; the llhttp directory there does not exist yet.
 * Without Debian's llhttp sources to copy, *state is NULL (the test skips). */
static int fresh_setup(void **state)
{
    *state = NULL;
    if (!exists(LLHTTP_SYSTEM "/api.c")) {
        print_message("skip: no llhttp sources in %s (make deps installs node-llhttp)\n",
                      LLHTTP_SYSTEM);
        return 0;
    }
    struct fresh *f = calloc(1, sizeof(*f));
    snprintf(f->dir, sizeof(f->dir), "/tmp/kvd-build-XXXXXX");
    if (!mkdtemp(f->dir)) {
        free(f);
        return -1;
    }
    snprintf(f->src, sizeof(f->src), "%s/src", f->dir);
    snprintf(f->http, sizeof(f->http), "%s/llhttp", f->dir);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "mkdir -p '%s' && tar -cf - --exclude=./build --exclude='./build-*' --exclude=./kvd "
             "--exclude=./models --exclude=./.git . | tar -xf - -C '%s'",
             f->src, f->src);
    if (system(cmd) != 0) {
        su_remove_dir(f->dir);
        free(f);
        return -1;
    }
    *state = f;
    return 0;
}

static int fresh_teardown(void **state)
{
    struct fresh *f = *state;
    if (!f)
        return 0;
    su_remove_dir(f->dir);
    free(f);
    return 0;
}

/*
 * Start `make TARGET VARS...` in the copied tree, in a clean environment,
 * with `make deps` replaced by a copy of the llhttp sources into f->http.
 * Output goes to f->dir/make.log.
 */
static int start_make(struct fresh *f, struct su_proc *p, const char *target, const char *vars)
{
    assert_false(exists(f->http)); /* the fresh machine: no llhttp yet */
    char script[2048];
    snprintf(script, sizeof(script),
             "cd '%s' && exec env -i PATH=\"$PATH\" HOME=\"$HOME\" OMP_WAIT_POLICY=passive "
             "make %s OPT=-O0 LLHTTP_DIR='%s' DEPS_CMD=\"cp -r %s '%s'\" %s",
             f->src, target, f->http, LLHTTP_SYSTEM, f->http, vars);
    snprintf(p->log, sizeof(p->log), "%s/make.log", f->dir);
    char *argv[] = {"sh", "-c", script, NULL};
    return su_spawn(p, argv, NULL);
}

/* Whether the log at path contains needle. */
static bool log_has(const char *path, const char *needle)
{
    FILE *fp = fopen(path, "r");
    if (!fp)
        return false;
    char line[1024];
    bool found = false;
    while (!found && fgets(line, sizeof(line), fp))
        found = strstr(line, needle) != NULL;
    fclose(fp);
    return found;
}

/* `make run` builds, writes the default model and serves it. */
static void test_make_run_first(void **state)
{
    struct fresh *f = *state;
    if (!f)
        skip();
    int port = su_free_port();
    assert_true(port > 0);
    char vars[256];
    snprintf(vars, sizeof(vars), "RUN_ARGS='--config config/kvd.conf --listen 127.0.0.1:%d'", port);
    struct su_proc p = {0};
    assert_int_equal(start_make(f, &p, "run", vars), 0);

    /* Building takes a while on a busy machine; /health answers when done. */
    int status = -1;
    double deadline = su_now() + 600;
    while (status != 200 && su_now() < deadline) {
        if (waitpid(p.pid, NULL, WNOHANG) == p.pid) { /* make ended: it failed */
            p.pid = 0;
            break;
        }
        struct su_resp r;
        status = su_http(port, "GET", "/health", NULL, NULL, &r);
        su_resp_free(&r);
        if (status != 200)
            su_sleep_ms(250);
    }
    if (status != 200)
        su_dump_log(&p);
    assert_int_equal(status, 200);

    /* The default model is the retrieval model: it finds the code. */
    json_t *req = json_pack("{s:s, s:i, s:f}", "prompt",
                            "the secret code is 4 1 7. the dog sat by the river under the old "
                            "tree. the secret code is",
                            "max_tokens", 3, "temperature", 0.0);
    json_t *ans = su_post(port, "/v1/completions", NULL, req, &status);
    assert_int_equal(status, 200);
    json_t *choice = json_array_get(json_object_get(ans, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "text")), " 4 1 7");
    json_decref(ans);
    assert_int_equal(su_stop(&p, SIGTERM, 30) == -1, 0);

    char model[400];
    snprintf(model, sizeof(model), "%s/models/default.gguf", f->src);
    assert_true(exists(model));
}

/* `make test` installs, builds and runs the tests it is asked for. */
static void test_make_test_first(void **state)
{
    struct fresh *f = *state;
    if (!f)
        skip();
    struct su_proc p = {0};
    assert_int_equal(start_make(f, &p, "test", "TESTS=config"), 0);
    int rc = su_wait(&p, 600);
    if (rc != 0 || !log_has(p.log, ", 0 failed"))
        su_dump_log(&p);
    assert_int_equal(rc, 0);
    assert_true(log_has(p.log, "kvd tests: "));
    assert_true(log_has(p.log, ", 0 failed, 0 skipped in 1 programs"));
    assert_false(log_has(p.log, " 0 passed,"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_make_run_first, fresh_setup, fresh_teardown),
        cmocka_unit_test_setup_teardown(test_make_test_first, fresh_setup, fresh_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
