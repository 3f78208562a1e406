/*
 * test_faults.c - kvd under faults and hostile local input, end to end
 * with the real binary ($KVD_BIN): commands fed files that never end or
 * keys that do not fit, and a daemon that runs out of file descriptors.
 * generations the server has to cut short (the KV pool runs out of pages,
 * a reload takes eviction away). Each test is the regression test of a
 * defect that was found that way.
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
#include <pthread.h>
#include <sys/resource.h>

#include "model/mkmodel.h"
#include "tests/serve_fixture.h"

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
    const char *const dev[] = {"tokenize", "--model", model_path, "--file", "/dev/zero"};
    assert_int_equal(run_kvd(dev, (int)(sizeof(dev) / sizeof(dev[0])), log, 20), 1);
    assert_true(su_file_has(log, "/dev/zero is not a regular file"));
    const char *const dir[] = {"tokenize", "--model", model_path, "--file", tmpdir};
    assert_int_equal(run_kvd(dir, (int)(sizeof(dir) / sizeof(dir[0])), log, 20), 1);
    assert_true(su_file_has(log, "is not a regular file"));
    /* A regular file is still tokenized. */
    char text[600];
    snprintf(text, sizeof(text), "%s/text.txt", tmpdir);
    FILE *f = fopen(text, "w");
    assert_non_null(f);
    fputs("Once upon a time", f);
    fclose(f);
    const char *const ok[] = {"tokenize", "--model", model_path, "--file", text};
    assert_int_equal(run_kvd(ok, (int)(sizeof(ok) / sizeof(ok[0])), log, 20), 0);
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
    const char *const args[] = {"serve",       "--model", model_path, "--listen",
                                "127.0.0.1:0", "--set",   set};
    int rc = run_kvd(args, (int)(sizeof(args) / sizeof(args[0])), log, 30);
    assert_true(rc != 0 && rc != -1);
    assert_true(su_file_has(log, "the key is longer than 255 bytes"));

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

/* ------------------------------------------------------------------------
 * Generations the server cuts short say so
 * ------------------------------------------------------------------------ */

struct gen_arg {
    int port;
    const char *path, *body;
    int status;
    json_t *answer;
};

static void *gen_thread(void *p)
{
    struct gen_arg *g = p;
    g->answer = su_post(g->port, g->path, NULL, json_loads(g->body, 0, NULL), &g->status);
    return NULL;
}

/*
 * A pool far too small for four long generations at once: the engine
 * makes the youngest yield when a step finds no page. Such a request used
 * to end with finish_reason "length" (its own limit, as if nothing had
 * happened); now OpenAI's shape gets a 503 naming the cut and llama.cpp's
 * stop_type "none" with an error, and each is counted.
 */
static void test_cut_short_pool_full(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* f32 K/V: 512 bytes a token, so the 1 MiB pool holds 2048 tokens;
     * four sequences of up to 1024 need twice that. */
    static const char *const args[] = {"--set", "cache.memory=1MiB",
                                       "--set", "cache.kv_type=f32",
                                       "--set", "eviction.max_cache_tokens=1024",
                                       "--set", "server.threads=1"};
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/pool.log", tmpdir);
    assert_int_equal(su_serve(&p, kvd_bin, model_path, args, 8), 0);
    struct gen_arg g[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        bool llama = i % 2;
        g[i] = (struct gen_arg){
            .port = p.port,
            .path = llama ? "/completion" : "/v1/completions",
            .body = llama ? "{\"prompt\":\"Once\",\"n_predict\":900,\"ignore_eos\":true}"
                          : "{\"prompt\":\"Once\",\"max_tokens\":900,\"ignore_eos\":true}",
        };
        assert_int_equal(pthread_create(&th[i], NULL, gen_thread, &g[i]), 0);
    }
    int cut = 0, whole = 0, refused = 0;
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        if (!g[i].answer)
            print_message("request %d: status %d, no JSON answer\n", i, g[i].status);
        assert_non_null(g[i].answer);
        json_t *err = json_object_get(g[i].answer, "error");
        const char *code = json_string_value(json_object_get(err, "code"));
        if (g[i].status == 503 && code && !strcmp(code, "unavailable")) {
            /* Admitted when the pool was already full: refused before its
             * first token (nothing was cut; see admission by pages). */
            refused++;
        } else if (i % 2 == 0 && g[i].status == 503) {
            assert_string_equal(json_string_value(json_object_get(err, "code")),
                                "cut_short_kv_cache_full");
            cut++;
        } else if (i % 2 == 1 && err) {
            assert_int_equal(g[i].status, 200);
            assert_string_equal(json_string_value(json_object_get(g[i].answer, "stop_type")),
                                "none");
            assert_string_equal(json_string_value(json_object_get(err, "code")),
                                "cut_short_kv_cache_full");
            cut++;
        } else {
            /* A whole answer is a normal finish of its own limit. */
            assert_int_equal(g[i].status, 200);
            json_t *ch = json_array_get(json_object_get(g[i].answer, "choices"), 0);
            const char *fin = ch ? json_string_value(json_object_get(ch, "finish_reason"))
                                 : json_string_value(json_object_get(g[i].answer, "stop_type"));
            assert_true(!strcmp(fin, "length") || !strcmp(fin, "limit"));
            whole++;
        }
        json_decref(g[i].answer);
    }
    print_message("%d cut short, %d whole, %d refused before their first token\n", cut, whole,
                  refused);
    assert_true(cut >= 1);
    assert_int_equal(su_metric(p.port, "kvd_requests_cut_short_total{reason=\"kv_pool_full\"}"),
                     cut);
    assert_int_equal(su_stop(&p, SIGTERM, 30), 0);
}

static void write_conf(const char *path, const char *policy)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fprintf(f,
            "[cache]\nmemory = 2MiB\n[eviction]\npolicy = %s\nmax_cache_tokens = 128\n"
            "[limits]\nmax_tokens = 100000\n[server]\nthreads = 1\n",
            policy);
    fclose(f);
}

/*
 * A stream admitted under sink-window eviction, then a reload to policy
 * none: its cache fills and the generation must stop, but as a cut (an
 * error event, no finish_reason), not as a normal "length" finish.
 */
static void test_cut_short_reload_policy_none(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char conf[600];
    snprintf(conf, sizeof(conf), "%s/reload.conf", tmpdir);
    write_conf(conf, "sink-window");
    const char *const args[] = {"--config", conf};
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/reload.log", tmpdir);
    assert_int_equal(su_serve(&p, kvd_bin, model_path, args, 2), 0);
    struct hc c;
    assert_int_equal(hc_open(&c, p.port), 0);
    assert_int_equal(hc_request(&c, "POST", "/v1/completions", NULL,
                                "{\"prompt\":\"Once\",\"max_tokens\":100000,"
                                "\"ignore_eos\":true,\"stream\":true}"),
                     0);
    struct resp r;
    assert_int_equal(hc_read_head(&c, &r), 0);
    assert_int_equal(r.status, 200);
    /* Past the budget (evicting), then the reload. */
    char *d;
    size_t n;
    size_t got = 0;
    while (got < 300 && hc_read_chunk(&c, &d, &n) == 1) {
        got += strstr(d, "\"text\"") != NULL;
        free(d);
    }
    write_conf(conf, "none");
    kill(p.pid, SIGHUP);
    /* To the end of the stream: the last event before [DONE] is an error. */
    char last[8192] = "";
    bool done = false;
    while (hc_read_chunk(&c, &d, &n) == 1) {
        if (strstr(d, "[DONE]"))
            done = true;
        else
            snprintf(last, sizeof(last), "%s", d);
        assert_null(strstr(d, "\"finish_reason\":\"length\""));
        free(d);
    }
    hc_close(&c);
    assert_true(done);
    assert_non_null(strstr(last, "cut_short_policy_none"));
    assert_int_equal(su_metric(p.port, "kvd_requests_cut_short_total{reason=\"policy_none\"}"), 1);
    assert_int_equal(su_stop(&p, SIGTERM, 30), 0);
}

/* ------------------------------------------------------------------------
 * Out of file descriptors
 * ------------------------------------------------------------------------ */

/* CPU seconds (user + system) the process has used. */
static double cpu_seconds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char buf[2048];
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')'); /* after the command name */
    unsigned long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2)
        return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static int connect_port(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

/*
 * `ulimit -n 64` (set on the running server) and 80 idle clients, more
 * than the descriptors allow. The server must not spin, must keep
 * answering, and must recover fully once the clients leave. Before, libuv
 * met EMFILE and closed every newcomer itself, /health included, until an
 * idle timeout freed a descriptor; now the open-files limit caps the
 * connection slots, and an idle connection is shed for each newcomer.
 */
static void test_fd_exhaustion(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "server.threads=1", "--set",
                                       "server.max_connections=1000"};
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/fds.log", tmpdir);
    assert_int_equal(su_serve(&p, kvd_bin, model_path, args, 4), 0);
    struct rlimit lim = {64, 64};
    assert_int_equal(prlimit(p.pid, RLIMIT_NOFILE, &lim, NULL), 0);
    int fds[80];
    for (int i = 0; i < 80; i++)
        fds[i] = connect_port(p.port); /* the kernel's backlog accepts them all */
    su_sleep_ms(500);
    /* No busy loop: an idle server uses a few milliseconds of CPU in 2 s,
     * one spinning on EMFILE all of it. */
    double c0 = cpu_seconds(p.pid);
    su_sleep_ms(2000);
    double used = cpu_seconds(p.pid) - c0;
    print_message("CPU while out of descriptors: %.2f s in 2 s\n", used);
    assert_true(c0 >= 0 && used < 0.5);
    /* Still answering meanwhile. */
    struct su_resp r;
    assert_int_equal(su_http(p.port, "GET", "/health", NULL, NULL, &r), 200);
    su_resp_free(&r);
    for (int i = 0; i < 80; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    /* Recovered: requests served, and both effects counted. */
    for (int i = 0; i < 20; i++) {
        assert_int_equal(su_http(p.port, "GET", "/health", NULL, NULL, &r), 200);
        su_resp_free(&r);
    }
    assert_true(su_metric(p.port, "kvd_http_connections_closed_total{reason=\"shed_idle\"}") > 0);
    print_message("accept failures: %g, idle connections shed: %g\n",
                  su_metric(p.port, "kvd_http_connections_closed_total{reason=\"accept_failed\"}"),
                  su_metric(p.port, "kvd_http_connections_closed_total{reason=\"shed_idle\"}"));
    assert_int_equal(su_stop(&p, SIGTERM, 30), 0);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("faults", 11, false);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tokenize_file_not_regular),
        cmocka_unit_test(test_api_key_file_too_long),
        cmocka_unit_test(test_cut_short_pool_full),
        cmocka_unit_test(test_cut_short_reload_policy_none),
        cmocka_unit_test(test_fd_exhaustion),
    };
    return cmocka_run_group_tests_name("faults", tests, group_setup, group_teardown);
}
