/*
 * test_web.c - the web page in a real browser: Debian's chromium, headless,
 * driven by puppeteer-core from npm (pointed at the system browser; it
 * downloads none), against `kvd serve` on the shared stories260K model
 * with an API key and a small eviction budget.
 *
 * tests/cases/web/browser.cjs does the browsing and prints one line per
 * check; each check here is one of those lines: without the key the page
 * shows the prompt and fetches no data; a chat turn streams in pieces;
 * the cache map of a session pushed past its budget draws the evicted
 * range where GET /v1/sessions/{id} puts it, and follows a new eviction;
 * the server view's charts take new samples under `kvd load` and show the
 * config with origins; the layout fits a phone; every control has an
 * accessible name and the tabs and the map's ranges work from the
 * keyboard; nothing is fetched from elsewhere. Screenshots of each view go to KVD_ARTEFACTS
 * (build/artefacts under `make test`).
 *
 * Skips with a message when chromium, node or npm is absent, when npm
 * cannot reach its registry, or when ../shared (KVD_SHARED) or KVD_BIN is
 * absent. puppeteer-core is installed once into KVD_ARTEFACTS/npm.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/serve_util.h"

#define KEY "web-browser-key"

static struct su_proc srv;
static char artefacts[512];
static char *output;        /* what browser.cjs printed (owned) */
static char why_skip[1024]; /* set when the browser tests cannot run */

/* Run a shell command, its output into out (NUL-terminated). Returns the
 * exit status, or -1. */
static int run(const char *cmd, char *out, size_t cap)
{
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = 0, got;
    while (n + 1 < cap && (got = fread(out + n, 1, cap - n - 1, p)) > 0)
        n += got;
    out[n] = '\0';
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const char *chromium(void)
{
    static const char *const names[] = {"chromium", "chromium-browser"};
    static char path[256];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "command -v %s 2>/dev/null", names[i]);
        if (run(cmd, path, sizeof path) == 0 && path[0]) {
            path[strcspn(path, "\n")] = '\0';
            return path;
        }
    }
    return NULL;
}

/* puppeteer-core in artefacts/npm, installed unless already there.
 * Returns 0, or -1 with why_skip set. */
static int install_puppeteer(void)
{
    char probe[700], cmd[1200], out[4096];
    snprintf(probe, sizeof probe, "%s/npm/node_modules/puppeteer-core/package.json", artefacts);
    if (access(probe, R_OK) == 0)
        return 0;
    snprintf(cmd, sizeof cmd,
             "mkdir -p '%s/npm' && PUPPETEER_SKIP_DOWNLOAD=1 timeout 300 npm install --prefix "
             "'%s/npm' puppeteer-core --no-audit --no-fund --loglevel=error 2>&1",
             artefacts, artefacts);
    if (run(cmd, out, sizeof out) != 0 || access(probe, R_OK) != 0) {
        snprintf(why_skip, sizeof why_skip,
                 "npm could not install puppeteer-core (offline?): %.300s", out);
        return -1;
    }
    return 0;
}

static int setup(void **state)
{
    (void)state;
    const char *bin = getenv("KVD_BIN"), *shared = getenv("KVD_SHARED");
    const char *art = getenv("KVD_ARTEFACTS");
    snprintf(artefacts, sizeof artefacts, "%s", art && art[0] ? art : "/tmp/kvd-web-artefacts");
    char model[600];
    snprintf(model, sizeof model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    const char *browser = chromium();
    if (!browser || !su_on_path("node") || !su_on_path("npm")) {
        snprintf(why_skip, sizeof why_skip,
                 "chromium, node or npm not on PATH (make deps installs them)");
        return 0;
    }
    if (!bin || access(model, R_OK) != 0) {
        snprintf(why_skip, sizeof why_skip, "KVD_BIN or %s absent", model);
        return 0;
    }
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", artefacts);
    if (system(cmd) != 0 || install_puppeteer() != 0)
        return 0;
    snprintf(srv.log, sizeof srv.log, "%s/web-serve.log", artefacts);
    const char *args[] = {
        "--set", ("auth.api_key=" KEY),    "--set", "eviction.max_cache_tokens=256",
        "--set", "eviction.sink_tokens=4", "--set", "eviction.window_tokens=96",
        "--set", "eviction.unit=token",    "--set", "server.threads=1",
        "--set", "cache.memory=16MiB",     "--set", "limits.max_tokens=64"};
    if (su_serve(&srv, bin, model, args, (int)(sizeof args / sizeof args[0])) != 0)
        fail_msg("kvd serve did not start");
    /* the script runs in its folder: the paths it gets are absolute */
    char cwd[512], abs_bin[1024], abs_art[1024];
    if (!getcwd(cwd, sizeof cwd))
        fail_msg("getcwd: %s", strerror(errno));
    snprintf(abs_bin, sizeof abs_bin, "%s%s%s", bin[0] == '/' ? "" : cwd, bin[0] == '/' ? "" : "/",
             bin);
    snprintf(abs_art, sizeof abs_art, "%s%s%s", artefacts[0] == '/' ? "" : cwd,
             artefacts[0] == '/' ? "" : "/", artefacts);
    snprintf(cmd, sizeof cmd,
             "cd tests/cases/web && NODE_PATH='%s/npm/node_modules' "
             "KVD_URL=http://127.0.0.1:%d/ KVD_KEY=" KEY " KVD_BIN='%s' CHROMIUM='%s' "
             "ARTEFACTS='%s' timeout 600 node browser.cjs 2>&1",
             abs_art, srv.port, abs_bin, browser, abs_art);
    output = calloc(1, 1 << 16);
    assert_non_null(output);
    int st = run(cmd, output, 1 << 16);
    print_message("browser.cjs (exit %d), screenshots in %s:\n%s", st, artefacts, output);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (srv.pid)
        su_stop(&srv, SIGTERM, 10);
    free(output);
    return 0;
}

/* The check's line: "ok NAME" passes, "not ok NAME: why" fails, none fails. */
static void expect(const char *name)
{
    if (why_skip[0]) {
        print_message("%s: skipping the browser tests\n", why_skip);
        skip();
    }
    if (!output)
        fail_msg("the browser did not run");
    char ok[128], bad[128];
    snprintf(ok, sizeof ok, "ok %s\n", name);
    snprintf(bad, sizeof bad, "not ok %s:", name);
    const char *b = strstr(output, bad);
    if (b)
        fail_msg("%.*s", (int)strcspn(b, "\n"), b);
    for (const char *p = output; (p = strstr(p, ok)) != NULL; p++)
        if (p == output || p[-1] == '\n')
            return;
    fail_msg("browser.cjs never reported '%s'", name);
}

static void test_auth_prompt(void **state)
{
    (void)state;
    expect("auth_prompt_without_key");
}

static void test_chat_streams(void **state)
{
    (void)state;
    expect("chat_streams");
}

static void test_cache_map(void **state)
{
    (void)state;
    expect("cache_map_after_eviction");
}

static void test_server_view(void **state)
{
    (void)state;
    expect("server_view_charts_update");
}

static void test_phone(void **state)
{
    (void)state;
    expect("phone_layout");
}

static void test_accessible(void **state)
{
    (void)state;
    expect("accessible_names_and_keys");
}

static void test_same_origin(void **state)
{
    (void)state;
    expect("same_origin_only");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_auth_prompt), cmocka_unit_test(test_chat_streams),
        cmocka_unit_test(test_cache_map),   cmocka_unit_test(test_server_view),
        cmocka_unit_test(test_phone),       cmocka_unit_test(test_accessible),
        cmocka_unit_test(test_same_origin),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
