/*
 * test_lifecycle.c - `kvd serve` end to end, around the requests: the
 * queue and cancellation, auth, reload (SIGHUP, also under load),
 * timeouts and connection limits, shutdown (SIGTERM finishes a stream; the
 * drain deadline cuts one, saying so), and the config room meeting the
 * cache and the running server (the budget, the memory rule, the defaults
 * against config/kvd.conf).
 *
 * Same fixture and rules as test_server.c (tests/serve_fixture.h): real
 * binary, loopback, every server stopped with SIGTERM and exit 0, no
 * wall-clock assertions.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli_internal.h"
#include "config/config.h"
#include "model/mkmodel.h"
#include "model/model.h"
#include "server/scheduler.h"
#include "tests/serve_fixture.h"

/* ------------------------------------------------------------------------
 * Tests: queue, cancellation, auth, reload, timeouts, shutdown
 * ------------------------------------------------------------------------ */

static void test_queue_full_and_cancel(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "limits.max_running=1",  "--set", "limits.step_tokens=16",
        "--set", "limits.queue_length=1", "--set", "limits.max_tokens=1000000",
        "--set", "cache.memory=2MiB",     "--set", "eviction.max_cache_tokens=128",
        "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    /* 1: a stream that will not end by itself */
    struct hc c1, c2;
    assert_int_equal(
        start_stream(&c1, s.port,
                     "{\"prompt\":\"forever\",\"max_tokens\":1000000,\"ignore_eos\":true,"
                     "\"stream\":true}"),
        0);
    assert_true(su_metric(s.port, "kvd_kv_pages_used") > 0);
    /* 2: waits in the queue */
    assert_int_equal(hc_open(&c2, s.port), 0);
    assert_int_equal(hc_request(&c2, "POST", "/v1/completions", NULL,
                                "{\"prompt\":\"queued\",\"max_tokens\":4}"),
                     0);
    assert_true(su_wait_metric(s.port, "kvd_queue_depth", 1));
    /* 3: the queue is full */
    struct resp r;
    assert_int_equal(http(s.port, "POST", "/v1/completions", NULL,
                          "{\"prompt\":\"one too many\",\"max_tokens\":4}", &r),
                     429);
    char ra[32];
    assert_non_null(resp_header(&r, "retry-after", ra, sizeof(ra)));
    assert_true(atoi(ra) >= 1);
    check_error_json(&r);
    resp_free(&r);
    /* Clients leave: the queued one, then the stream mid-way. Their
     * sequences are dropped and every page returns to the pool, or stays
     * in the prefix cache as an idle page the pool takes back first. */
    hc_close(&c2);
    hc_close(&c1);
    assert_true(su_wait_metric(s.port, "kvd_running_sequences", 0));
    assert_true(su_wait_metric(s.port, "kvd_queue_depth", 0));
    assert_true(su_wait_metric(s.port, "kvd_kv_pages_used",
                               su_metric(s.port, "kvd_prefix_cache_idle_pages")));
    assert_true(su_metric(s.port, "kvd_requests_cancelled_total") >= 1);
    /* and the server goes on */
    assert_int_equal(http(s.port, "POST", "/v1/completions", NULL,
                          "{\"prompt\":\"after\",\"max_tokens\":3}", &r),
                     200);
    resp_free(&r);
    server_stop(&s);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_auth_and_reload(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char conf[600], text[4096];
    snprintf(conf, sizeof(conf), "%s/kvd.conf", tmpdir);
    const char *fmt = "[server]\nlisten = 127.0.0.1:0\n[model]\npath = %s\n[cache]\nmemory = %s\n"
                      "[eviction]\nmax_cache_tokens = 128\n[limits]\nmax_tokens = %s\n"
                      "[auth]\napi_key = %s\n";
    snprintf(text, sizeof(text), fmt, model_path, "2MiB", "100", "sekret");
    write_file(conf, text);
    struct su_proc s;
    const char *args[] = {"--config", conf, "--set", "server.threads=1"};
    assert_int_equal(server_start(&s, args, 4), 0);
    const char *good = "Authorization: Bearer sekret\r\n";
    struct resp r;
    /* open routes */
    assert_int_equal(http_status_simple(s.port, "/metrics"), 200);
    /* closed ones */
    assert_int_equal(
        http(s.port, "POST", "/v1/completions", NULL, "{\"prompt\":\"hi\",\"max_tokens\":2}", &r),
        401);
    check_error_json(&r);
    resp_free(&r);
    assert_int_equal(http(s.port, "POST", "/v1/completions", "Authorization: Bearer nope\r\n",
                          "{\"prompt\":\"hi\",\"max_tokens\":2}", &r),
                     401);
    resp_free(&r);
    assert_int_equal(http(s.port, "GET", "/v1/models", NULL, NULL, &r), 401);
    resp_free(&r);
    assert_int_equal(
        http(s.port, "POST", "/v1/completions", good, "{\"prompt\":\"hi\",\"max_tokens\":80}", &r),
        200);
    resp_free(&r);
    assert_int_equal(su_metric(s.port, "kvd_config_generation"), 1);

    /* A good reload: the new limit and key apply, the restart-only cache
     * size is ignored. */
    snprintf(text, sizeof(text), fmt, model_path, "4MiB", "50", "sekret2");
    write_file(conf, text);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_generation", 2));
    assert_int_equal(su_metric(s.port, "kvd_config_last_reload_success"), 1);
    const char *good2 = "Authorization: Bearer sekret2\r\n";
    assert_int_equal(
        http(s.port, "POST", "/v1/completions", good2, "{\"prompt\":\"hi\",\"max_tokens\":80}", &r),
        400);
    assert_non_null(strstr(r.body, "50"));
    resp_free(&r);
    assert_int_equal(
        http(s.port, "POST", "/v1/completions", good, "{\"prompt\":\"hi\",\"max_tokens\":2}", &r),
        401);
    resp_free(&r);

    /* A bad file changes nothing. */
    snprintf(text, sizeof(text), fmt, model_path, "4MiB", "lots", "sekret3");
    write_file(conf, text);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(su_metric(s.port, "kvd_config_generation"), 2);
    assert_int_equal(
        http(s.port, "POST", "/v1/completions", good2, "{\"prompt\":\"hi\",\"max_tokens\":40}", &r),
        200);
    resp_free(&r);
    server_stop(&s);
}

static void test_timeouts_connections_sessions(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "limits.header_timeout=300ms",      "--set", "limits.idle_timeout=2s",
        "--set", "server.max_connections=3",         "--set", "cache.memory=2MiB",
        "--set", "eviction.max_cache_tokens=128",    "--set", "server.threads=1",
        "--set", "eviction.session_idle_timeout=1s", "--set", "eviction.max_sessions=2",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    /* Sessions: at most two are kept (the least recently used goes). */
    struct resp r;
    const char *names[] = {"one", "two", "three"};
    for (int i = 0; i < 3; i++) {
        char body[128];
        snprintf(body, sizeof(body), "{\"prompt\":\"hi\",\"max_tokens\":2,\"session\":\"%s\"}",
                 names[i]);
        assert_int_equal(http(s.port, "POST", "/v1/completions", NULL, body, &r), 200);
        resp_free(&r);
    }
    assert_int_equal(http_status_simple(s.port, "/v1/sessions/one"), 404);
    assert_int_equal(http_status_simple(s.port, "/v1/sessions/three"), 200);
    double t_sessions = su_now();

    /* Headers that never end: 408, then the connection closes. */
    struct hc c;
    assert_int_equal(hc_open(&c, s.port), 0);
    assert_int_equal(hc_send(&c, "GET /health HTTP/1.1\r\nHost: kvd\r\n", 33), 0);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 408);
    check_error_json(&r);
    resp_free(&r);
    hc_close(&c);
    /* More connections than allowed, none of them idle (each is waiting
     * for its body, which a 2 s idle_timeout allows): the extra one gets
     * 503. (Idle ones would be shed for it: test_http.c.) */
    struct hc k[3];
    static const char busy[] = "POST /tokenize HTTP/1.1\r\nHost: kvd\r\nContent-Length: 9\r\n\r\n";
    for (int i = 0; i < 3; i++) {
        assert_int_equal(hc_open(&k[i], s.port), 0);
        assert_int_equal(hc_send(&k[i], busy, sizeof(busy) - 1), 0);
    }
    su_sleep_ms(200); /* the server has read their headers */
    assert_int_equal(hc_open(&c, s.port), 0);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 503);
    check_error_json(&r);
    resp_free(&r);
    hc_close(&c);
    for (int i = 0; i < 3; i++)
        hc_close(&k[i]);
    /* An idle keep-alive connection is closed quietly. */
    double deadline = su_now() + 20;
    while (http_status_simple(s.port, "/health") != 200 && su_now() < deadline)
        su_sleep_ms(20);
    assert_int_equal(hc_open(&c, s.port), 0);
    char b;
    assert_int_equal(recv(c.fd, &b, 1, 0), 0);
    hc_close(&c);
    /* Once the server has seen those closes, it serves again. */
    deadline = su_now() + 20;
    while (http_status_simple(s.port, "/health") != 200 && su_now() < deadline)
        su_sleep_ms(20);
    assert_int_equal(http_status_simple(s.port, "/health"), 200);
    /* Sessions idle past session_idle_timeout (1 s) are freed. */
    while (su_now() < t_sessions + 1.0)
        su_sleep_ms(50);
    deadline = su_now() + 20;
    while (http_status_simple(s.port, "/v1/sessions/three") != 404 && su_now() < deadline)
        su_sleep_ms(50);
    assert_int_equal(http_status_simple(s.port, "/v1/sessions/three"), 404);
    assert_true(su_wait_metric(s.port, "kvd_sessions", 0));
    server_stop(&s);
}

static void test_sigterm_finishes_stream(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "server.drain_timeout=60s",      "--set", "cache.memory=2MiB",
        "--set", "eviction.max_cache_tokens=128", "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    /* a keep-alive connection opened before the signal */
    struct hc k;
    assert_int_equal(hc_open(&k, s.port), 0);
    struct resp r;
    assert_int_equal(hc_request(&k, "GET", "/health", NULL, NULL), 0);
    assert_int_equal(hc_read(&k, &r), 0);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    struct hc c;
    assert_int_equal(start_stream(&c, s.port,
                                  "{\"prompt\":\"keep going\",\"max_tokens\":2000,\"ignore_eos\":"
                                  "true,\"stream\":true,\"stream_options\":{\"include_"
                                  "usage\":true}}"),
                     0);
    kill(s.pid, SIGTERM);
    /* Draining: a request on the open connection gets 503 and the
     * connection closes after it. */
    for (;;) {
        assert_int_equal(hc_request(&k, "GET", "/health", NULL, NULL), 0);
        assert_int_equal(hc_read(&k, &r), 0);
        int status = r.status;
        char conn_hdr[32] = "";
        resp_header(&r, "connection", conn_hdr, sizeof(conn_hdr));
        if (status == 503)
            check_error_json(&r);
        resp_free(&r);
        if (status == 503) {
            assert_string_equal(conn_hdr, "close");
            break;
        }
        assert_int_equal(status, 200);
        su_sleep_ms(5);
    }
    hc_close(&k);
    /* New connections are refused once the listener closes. */
    double deadline = su_now() + 20;
    bool refused = false;
    while (!refused && su_now() < deadline) {
        struct hc x;
        if (hc_open(&x, s.port) != 0)
            refused = true;
        else
            hc_close(&x);
        if (!refused)
            su_sleep_ms(10);
    }
    assert_true(refused);
    /* The stream runs to its end. */
    memset(&r, 0, sizeof(r));
    body_append(&r, "", 0);
    for (;;) {
        char *d;
        size_t n;
        int got = hc_read_chunk(&c, &d, &n);
        assert_true(got >= 0);
        if (got == 0)
            break;
        body_append(&r, d, n);
        free(d);
    }
    bool done;
    json_t *evs = sse_events(r.body, &done);
    assert_true(done);
    json_t *usage = json_object_get(json_array_get(evs, json_array_size(evs) - 1), "usage");
    assert_true(json_is_object(usage));
    json_t *fin = json_array_get(evs, json_array_size(evs) - 2);
    const char *fr = json_string_value(
        json_object_get(json_array_get(json_object_get(fin, "choices"), 0), "finish_reason"));
    assert_non_null(fr);
    assert_string_equal(fr, "length");
    assert_int_equal(json_integer_value(json_object_get(usage, "completion_tokens")), 2000);
    json_decref(evs);
    resp_free(&r);
    hc_close(&c);
    assert_int_equal(server_wait(&s), 0);
}

static void test_drain_deadline(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "server.drain_timeout=200ms", "--set", "limits.max_tokens=1000000",
        "--set", "cache.memory=2MiB",          "--set", "eviction.max_cache_tokens=128",
        "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    struct hc c;
    assert_int_equal(
        start_stream(&c, s.port,
                     "{\"prompt\":\"endless\",\"max_tokens\":1000000,\"ignore_eos\":true,"
                     "\"stream\":true}"),
        0);
    kill(s.pid, SIGTERM);
    struct resp r = {0};
    body_append(&r, "", 0);
    for (;;) {
        char *d;
        size_t n;
        int k = hc_read_chunk(&c, &d, &n);
        assert_true(k >= 0);
        if (k == 0)
            break;
        body_append(&r, d, n);
        free(d);
    }
    bool done;
    json_t *evs = sse_events(r.body, &done);
    assert_true(done); /* the stream is complete ... */
    /* ... but says it was cut short: its last event is an error, and no
     * event carries a finish_reason (it used to end with "length"). */
    json_t *fin = json_array_get(evs, json_array_size(evs) - 1);
    json_t *err = json_object_get(fin, "error");
    assert_non_null(err);
    assert_string_equal(json_string_value(json_object_get(err, "code")), "cut_short_shutdown");
    for (size_t i = 0; i < json_array_size(evs); i++) {
        json_t *ch = json_array_get(json_object_get(json_array_get(evs, i), "choices"), 0);
        assert_true(!ch || json_is_null(json_object_get(ch, "finish_reason")));
    }
    json_decref(evs);
    resp_free(&r);
    hc_close(&c);
    assert_int_equal(server_wait(&s), 0);
}

/* ------------------------------------------------------------------------
 * Tests: the config room meets the cache and the running server
 * ------------------------------------------------------------------------ */

/* The kv_policy `kvd serve` builds from a config (as cmd_serve.c does). */
static struct kv_policy policy_of(const struct cfg *c)
{
    static const enum kv_policy_kind kinds[] = {
        [CFG_EVICT_NONE] = KV_EVICT_NONE,
        [CFG_EVICT_SINK_WINDOW] = KV_EVICT_SINK_WINDOW,
        [CFG_EVICT_H2O] = KV_EVICT_H2O,
    };
    return (struct kv_policy){
        .kind = kinds[c->eviction.policy],
        .max_cache_tokens = (int)c->eviction.max_cache_tokens,
        .sink_tokens = (int)c->eviction.sink_tokens,
        .window_tokens = (int)cfg_window_tokens(c),
        .heavy_tokens = c->eviction.policy == CFG_EVICT_H2O ? (int)c->eviction.heavy_tokens : 0,
        .renumber = c->eviction.positions == CFG_POS_RENUMBER,
    };
}

/*
 * Over a grid of (policy, page_tokens, max_cache_tokens, sink, window,
 * heavy): every config cfg_validate accepts, `kvd serve` can hand to the
 * cache (kv_policy_check accepts its policy), so check-config never passes
 * a file that serve then refuses. And config is stricter than the cache
 * only where it says so: the window is at least one page and h2o keeps a
 * heavy token.
 */
static void test_config_budget_is_cache_budget(void **state)
{
    (void)state;
    static const enum cfg_policy policies[] = {CFG_EVICT_NONE, CFG_EVICT_SINK_WINDOW,
                                               CFG_EVICT_H2O};
    static const int64_t pages[] = {1, 3, 16, 64};
    static const int64_t maxes[] = {1, 16, 31, 32, 33, 48, 64, 100, 1000};
    static const int64_t sinks[] = {0, 1, 4, 16, 17, 33};
    static const int64_t windows[] = {0, 1, 15, 16, 17, 32, 64, 500};
    static const int64_t heavies[] = {0, 1, 8, 64};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))
    struct cfg base, c;
    cfg_defaults(&base);
    struct cfg_errors *errs = malloc(sizeof(*errs));
    assert_non_null(errs);
    int accepted = 0, refused = 0;
    for (size_t a = 0; a < N_OF(policies); a++)
        for (size_t b = 0; b < N_OF(pages); b++)
            for (size_t m = 0; m < N_OF(maxes); m++)
                for (size_t s = 0; s < N_OF(sinks); s++)
                    for (size_t w = 0; w < N_OF(windows); w++)
                        for (size_t h = 0; h < N_OF(heavies); h++) {
                            c = base;
                            c.eviction.policy = policies[a];
                            c.cache.page_tokens = pages[b];
                            c.eviction.max_cache_tokens = maxes[m];
                            c.eviction.sink_tokens = sinks[s];
                            c.eviction.window_tokens = windows[w];
                            c.eviction.heavy_tokens = heavies[h];
                            cfg_errors_init(errs);
                            bool cfg_ok = cfg_validate(&c, errs) == 0;
                            struct kv_policy p = policy_of(&c);
                            char why[256] = "";
                            bool kv_ok = kv_policy_check(&p, (int)pages[b], why, sizeof(why)) == 0;
                            bool extra = policies[a] == CFG_EVICT_NONE ||
                                         (p.window_tokens >= pages[b] &&
                                          (policies[a] != CFG_EVICT_H2O || heavies[h] >= 1));
                            if (cfg_ok != (kv_ok && extra)) {
                                char line[1024] = "";
                                if (errs->count)
                                    cfg_error_format(&errs->list[0], line, sizeof(line));
                                print_message("policy %d page %lld max %lld sink %lld window %lld "
                                              "heavy %lld: config %s (%s), cache %s (%s)\n",
                                              (int)policies[a], (long long)pages[b],
                                              (long long)maxes[m], (long long)sinks[s],
                                              (long long)windows[w], (long long)heavies[h],
                                              cfg_ok ? "accepts" : "refuses", line,
                                              kv_ok ? "accepts" : "refuses", why);
                            }
                            assert_int_equal(cfg_ok, kv_ok && extra);
                            if (cfg_ok)
                                accepted++;
                            else
                                refused++;
                        }
#undef N_OF
    print_message("budget grid: %d configs accepted (all accepted by the cache), %d refused\n",
                  accepted, refused);
    assert_true(accepted > 1000 && refused > 1000);
    free(errs);
}

/* GET /v1/sessions/ID: its "eviction" object (new reference). */
static json_t *session_eviction(int port, const char *id)
{
    char path[160];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    struct resp r;
    int st = http(port, "GET", path, NULL, NULL, &r);
    if (st != 200)
        print_message("GET %s: %d %s\n", path, st, r.body ? r.body : "");
    assert_int_equal(st, 200);
    json_t *v = json_loads(r.body, 0, NULL);
    resp_free(&r);
    assert_non_null(v);
    json_t *e = json_incref(json_object_get(v, "eviction"));
    json_decref(v);
    assert_true(json_is_object(e));
    return e;
}

static long long ev_int(json_t *e, const char *key)
{
    json_t *x = json_object_get(e, key);
    assert_true(json_is_integer(x));
    return (long long)json_integer_value(x);
}

/* KV bytes of one token of the test model in the given cache type. */
static uint64_t model_token_bytes(enum cfg_kv_type t)
{
    struct kv_cache_params shape = {.k_type = srv_cfg_kv_type(t), .v_type = srv_cfg_kv_type(t)};
    model_kv_shape(lib_model, &shape);
    return kv_cache_token_bytes(&shape);
}

/*
 * The memory rule with the model's real size per token: at start a pool
 * that cannot hold one full sequence is a startup error naming the file,
 * line and cache.memory; on reload a max_cache_tokens the running pool
 * cannot hold is refused (max_cache_tokens applies live, memory does not).
 */
static void test_memory_budget(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* The test model: 2 layers x 2 KV heads x 16 dims x K,V in f16 = 256
     * bytes per token; 4096 tokens need 257 pages of 16 = 1028 KiB. */
    assert_int_equal(model_token_bytes(CFG_KV_F16), 256);
    char conf[600], log[600], text[2048], want[1024];
    snprintf(conf, sizeof(conf), "%s/memory.conf", tmpdir);
    snprintf(log, sizeof(log), "%s/memory.log", tmpdir);
    snprintf(text, sizeof(text),
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
             "[cache]\nmemory = 1MiB\n",
             model_path);
    write_file(conf, text);
    const char *args[] = {"serve", "--config", conf};
    assert_int_equal(run_kvd(args, 3, log, 30), 2);
    snprintf(want, sizeof(want),
             "kvd serve: %s:7: [cache] memory = 1MiB: one sequence at its full budget needs "
             "1028KiB: 257 pages for max_cache_tokens 4096 (default) at page_tokens 16 (default), "
             "256 bytes per token",
             conf);
    if (!su_file_has(log, want)) {
        struct su_proc s = {0};
        snprintf(s.log, sizeof(s.log), "%s", log);
        su_dump_log(&s);
    }
    assert_true(su_file_has(log, want));
    assert_false(su_file_has(log, "listening")); /* refused before it listened */
    /* The same from the command line, and with f32 keys twice as much. */
    const char *args2[] = {
        "serve",           "--model",           model_path, "--listen",          "127.0.0.1:0",
        "--set",           "cache.memory=2MiB", "--set",    "cache.kv_type=f32", "--set",
        "server.threads=1"};
    assert_int_equal(run_kvd(args2, 11, log, 30), 2);
    assert_true(su_file_has(log, "command line: [cache] memory = 2MiB: one sequence at its full "
                                 "budget needs 2056KiB"));
    /* One page less than 4096 tokens need is refused, exactly enough starts. */
    snprintf(text, sizeof(text),
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
             "[cache]\nmemory = 1028KiB\n",
             model_path);
    write_file(conf, text);
    struct su_proc s;
    const char *args3[] = {"--config", conf};
    assert_int_equal(server_start(&s, args3, 2), 0);
    assert_true(su_wait_metric(s.port, "kvd_kv_pages_total", 257));
    /* Reload: a larger max_cache_tokens than the pool holds is refused. */
    snprintf(text, sizeof(text),
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
             "[cache]\nmemory = 1028KiB\n[eviction]\nmax_cache_tokens = 4097\n",
             model_path);
    write_file(conf, text);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(su_metric(s.port, "kvd_config_generation"), 1);
    snprintf(want, sizeof(want),
             "config: %s:7: [cache] memory = 1028KiB: one sequence at its full budget needs "
             "1032KiB: 258 pages for max_cache_tokens 4097 (line 9)",
             conf);
    assert_true(su_file_has(s.log, want));
    server_stop(&s);
}

/* A session-friendly config for the reload test. */
static void reload_conf(const char *path, const char *memory, const char *eviction)
{
    char text[4096];
    snprintf(text, sizeof(text),
             "# reload under load\n"
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\ndrain_timeout = 1s\n"
             "[model]\npath = %s\n"
             "[cache]\nmemory = %s\npage_tokens = 16\n"
             "[eviction]\nmax_cache_tokens = 128\nsink_tokens = 4\n%s"
             "[limits]\nmax_running = 8\nstep_tokens = 64\nmax_tokens = 1000000\n",
             model_path, memory, eviction);
    write_file(path, text);
}

#define N_RELOAD_CLIENTS 4

struct reload_client {
    int port;
    int id;
    atomic_int *phase;   /* 0 before SIGHUP, 1 sent, 2 reload seen in /metrics */
    int streams;         /* streams completed */
    int crossed;         /* streams started before SIGHUP, ended after the reload */
    int failures;        /* streams without status 200 or [DONE] */
    int after;           /* streams started after the reload was seen */
    atomic_int progress; /* streams completed, for the main thread */
};

/* A stream that cannot end by itself (ignore_eos, a million tokens) on
 * session endless-ID: it runs across the reload for certain, and the drain
 * at the end cuts it short, with its final event. */
struct endless_client {
    int port;
    int id;
    int status;
    bool done;
    char finish[32];
};

static void *endless_client_thread(void *arg)
{
    struct endless_client *c = arg;
    char body[256];
    snprintf(body, sizeof(body),
             "{\"prompt\":\"Endless %d.\",\"max_tokens\":1000000,\"ignore_eos\":true,"
             "\"stream\":true,\"temperature\":0,\"session\":\"endless-%d\"}",
             c->id, c->id);
    struct resp r;
    c->status = http(c->port, "POST", "/v1/completions", NULL, body, &r);
    if (c->status == 200) {
        json_t *evs = sse_events(r.body, &c->done);
        json_t *fin = json_array_get(evs, json_array_size(evs) - 1);
        json_t *f =
            json_object_get(json_array_get(json_object_get(fin, "choices"), 0), "finish_reason");
        /* A stream the server cut ends with an error event instead. */
        json_t *code = json_object_get(json_object_get(fin, "error"), "code");
        if (json_is_string(code))
            f = code;
        snprintf(c->finish, sizeof(c->finish), "%s", json_is_string(f) ? json_string_value(f) : "");
        json_decref(evs);
    }
    resp_free(&r);
    return NULL;
}

/* GET /v1/sessions/ID: the whole answer (new), or NULL unless 200. */
static json_t *session_get(int port, const char *id)
{
    char path[160];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    struct resp r;
    int st = http(port, "GET", path, NULL, NULL, &r);
    json_t *v = st == 200 && r.body ? json_loads(r.body, 0, NULL) : NULL;
    resp_free(&r);
    return v;
}

/* Stream on session reload-ID, again and again, until two streams have
 * started after the reload was seen. */
static void *reload_client_thread(void *arg)
{
    struct reload_client *c = arg;
    char body[256], sess[32];
    snprintf(sess, sizeof(sess), "reload-%d", c->id);
    for (int k = 0; c->after < 2 && k < 10000; k++) {
        int phase0 = atomic_load(c->phase);
        snprintf(body, sizeof(body),
                 "{\"prompt\":\"Client %d, turn %d: the robot walked on.\",\"max_tokens\":160,"
                 "\"ignore_eos\":true,\"stream\":true,\"temperature\":0,\"session\":\"%s\"}",
                 c->id, k, sess);
        struct resp r;
        int st = http(c->port, "POST", "/v1/completions", NULL, body, &r);
        bool done = false;
        if (st == 200) {
            json_t *evs = sse_events(r.body, &done);
            json_decref(evs);
        }
        if (st != 200 || !done) {
            print_message("client %d turn %d: status %d, [DONE] %d\n", c->id, k, st, done);
            c->failures++;
        }
        resp_free(&r);
        c->streams++;
        if (phase0 == 0 && atomic_load(c->phase) == 2)
            c->crossed++;
        if (phase0 == 2)
            c->after++;
        atomic_fetch_add(&c->progress, 1);
    }
    return NULL;
}

/*
 * SIGHUP under load. Two streams that cannot end by themselves and four
 * clients streaming turn after turn, each on its own session, while the
 * file switches sink-window (window 64) to h2o (window 32, 16 heavy).
 * With 4 sinks (one page) and max_cache_tokens 128, sink-window never
 * keeps fewer than 16 + 64 = 80 tokens (it frees whole pages before the
 * window), h2o evicts down to 4 + 32 + 16 = 52: a running stream's session
 * holding fewer than 80 tokens after the reload shows it adopted the new
 * budget at its next eviction. No request fails; every session reports the
 * new policy and budget; the restart-only memory change is logged and
 * ignored; the generation counts one reload. Then an invalid file: every
 * error logged with its line, nothing changes, the server goes on serving
 * the h2o sessions. The drain at the end ends the endless streams, each
 * with [DONE].
 */
static void test_reload_under_load(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char conf[600];
    snprintf(conf, sizeof(conf), "%s/reload.conf", tmpdir);
    reload_conf(conf, "4MiB", "policy = sink-window\nwindow_tokens = 64\n");
    struct su_proc s;
    const char *args[] = {"--config", conf};
    assert_int_equal(server_start(&s, args, 2), 0);
    assert_int_equal(su_metric(s.port, "kvd_config_generation"), 1);
    double pages = (double)((4u << 20) / (16 * model_token_bytes(CFG_KV_F16)));
    assert_true(su_wait_metric(s.port, "kvd_kv_pages_total", pages));

    static struct endless_client en[2];
    pthread_t eth[2];
    for (int i = 0; i < 2; i++) {
        en[i] = (struct endless_client){.port = s.port, .id = i};
        assert_int_equal(pthread_create(&eth[i], NULL, endless_client_thread, &en[i]), 0);
    }
    static struct reload_client cl[N_RELOAD_CLIENTS];
    static atomic_int phase;
    atomic_store(&phase, 0);
    pthread_t th[N_RELOAD_CLIENTS];
    for (int i = 0; i < N_RELOAD_CLIENTS; i++) {
        cl[i] = (struct reload_client){.port = s.port, .id = i, .phase = &phase};
        atomic_store(&cl[i].progress, 0);
        assert_int_equal(pthread_create(&th[i], NULL, reload_client_thread, &cl[i]), 0);
    }
    /* Steady load: every client has finished a stream (160 tokens > 128:
     * evicted under sink-window) and the endless streams have evicted. */
    double deadline = su_now() + 120;
    for (int i = 0; i < N_RELOAD_CLIENTS; i++)
        while (atomic_load(&cl[i].progress) < 1 && su_now() < deadline)
            su_sleep_ms(10);
    for (int i = 0; i < 2; i++) {
        char id[32];
        snprintf(id, sizeof(id), "endless-%d", i);
        for (;;) {
            json_t *v = session_get(s.port, id);
            int hist = v ? (int)json_integer_value(json_object_get(v, "tokens")) : 0;
            json_decref(v);
            if (hist > 200)
                break;
            assert_true(su_now() < deadline);
            su_sleep_ms(10);
        }
    }
    json_t *e = session_eviction(s.port, "endless-0");
    assert_string_equal(json_string_value(json_object_get(e, "policy")), "sink-window");
    assert_int_equal(ev_int(e, "window_tokens"), 64);
    json_decref(e);

    reload_conf(conf, "8MiB", "policy = h2o\nwindow_tokens = 32\nheavy_tokens = 16\n");
    atomic_store(&phase, 1);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_generation", 2));
    atomic_store(&phase, 2);
    assert_int_equal(su_metric(s.port, "kvd_config_last_reload_success"), 1);

    /* The endless streams never stopped; their sequences now evict as h2o. */
    for (int i = 0; i < 2; i++) {
        char id[32];
        snprintf(id, sizeof(id), "endless-%d", i);
        int retained = 1 << 30;
        bool busy = false, h2o = false;
        deadline = su_now() + 60;
        while (su_now() < deadline) {
            json_t *v = session_get(s.port, id);
            assert_non_null(v);
            busy = json_is_true(json_object_get(v, "busy"));
            retained = (int)json_integer_value(json_object_get(v, "retained_tokens"));
            h2o = !strcmp(
                json_string_value(json_object_get(json_object_get(v, "eviction"), "policy")),
                "h2o");
            json_decref(v);
            if (h2o && retained < 80)
                break;
            su_sleep_ms(2);
        }
        print_message("%s: busy %d, policy h2o %d, retained %d\n", id, busy, h2o, retained);
        assert_true(busy && h2o && retained < 80);
    }

    int crossed = 0;
    for (int i = 0; i < N_RELOAD_CLIENTS; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(cl[i].failures, 0);
        assert_true(cl[i].after >= 2);
        crossed += cl[i].crossed;
    }
    print_message("reload under load: %d turn streams (besides the 2 endless ones) ran across "
                  "the reload\n",
                  crossed);

    /* Every session follows the new policy and budget. */
    for (int i = 0; i < N_RELOAD_CLIENTS + 2; i++) {
        char id[32];
        if (i < N_RELOAD_CLIENTS)
            snprintf(id, sizeof(id), "reload-%d", i);
        else
            snprintf(id, sizeof(id), "endless-%d", i - N_RELOAD_CLIENTS);
        e = session_eviction(s.port, id);
        assert_string_equal(json_string_value(json_object_get(e, "policy")), "h2o");
        assert_int_equal(ev_int(e, "max_cache_tokens"), 128);
        assert_int_equal(ev_int(e, "sink_tokens"), 4);
        assert_int_equal(ev_int(e, "window_tokens"), 32);
        assert_int_equal(ev_int(e, "heavy_tokens"), 16);
        json_decref(e);
    }
    /* The memory change waits for a restart: logged, pool unchanged. */
    assert_int_equal(su_metric(s.port, "kvd_kv_pages_total"), pages);
    char want[1024];
    snprintf(want, sizeof(want),
             "config: cache.memory = 8MiB (%s:9): ignored until restart; still 4MiB", conf);
    assert_true(su_file_has(s.log, want));
    assert_true(su_file_has(s.log, "config reloaded"));
    assert_true(su_file_has(s.log, "eviction policy h2o, max_cache_tokens 128, sink_tokens 4, "
                                   "window_tokens 32, heavy_tokens 16"));

    /* An invalid file: every error logged with file and line, nothing
     * changes, and the sessions keep their h2o budget. */
    reload_conf(conf, "8MiB", "policy = sink-window\nwindow_tokens = 200\nwindw_tokens = 8\n");
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(su_metric(s.port, "kvd_config_generation"), 2);
    snprintf(want, sizeof(want),
             "config: %s:16: [eviction] windw_tokens: unknown key; did you mean window_tokens?",
             conf);
    assert_true(su_file_has(s.log, want));
    snprintf(want, sizeof(want),
             "config: %s:15: [eviction] window_tokens = 200: window_tokens 200 (line 15) + "
             "sink_tokens 4 (line 13) as whole pages (16) + one page",
             conf);
    assert_true(su_file_has(s.log, want));
    struct reload_client again = {.port = s.port, .id = 0, .phase = &phase};
    atomic_store(&again.progress, 0);
    again.after = 1; /* one more stream */
    reload_client_thread(&again);
    assert_int_equal(again.failures, 0);
    e = session_eviction(s.port, "reload-0");
    assert_string_equal(json_string_value(json_object_get(e, "policy")), "h2o");
    assert_int_equal(ev_int(e, "window_tokens"), 32);
    json_decref(e);

    /* SIGTERM: the drain deadline (1 s) ends the endless streams whole,
     * saying they were cut short. */
    server_stop(&s);
    for (int i = 0; i < 2; i++) {
        pthread_join(eth[i], NULL);
        assert_int_equal(en[i].status, 200);
        assert_true(en[i].done);
        assert_string_equal(en[i].finish, "cut_short_shutdown");
    }
}

/*
 * `kvd serve` with no --config runs on the built-in defaults, and those are
 * config/kvd.conf's values: the eviction settings a session reports, the
 * pool's size (cache.memory, page_tokens, kv_type) and the settings line
 * logged at start.
 */
static void test_defaults_are_example_file(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct cfg *ex = malloc(sizeof(*ex));
    struct cfg_errors *errs = malloc(sizeof(*errs));
    assert_non_null(ex);
    assert_non_null(errs);
    cfg_errors_init(errs);
    assert_int_equal(cfg_load(ex, "config/kvd.conf", NULL, 0, errs), 0);
    struct su_proc s;
    assert_int_equal(server_start(&s, NULL, 0), 0); /* --model and --listen only */
    struct resp r;
    assert_int_equal(http(s.port, "POST", "/v1/completions", NULL,
                          "{\"prompt\":\"defaults\",\"max_tokens\":2,\"session\":\"defaults\"}",
                          &r),
                     200);
    resp_free(&r);
    json_t *e = session_eviction(s.port, "defaults");
    char policy[32];
    cfg_format_value(ex, CFG_EVICTION_POLICY, policy, sizeof(policy));
    assert_string_equal(json_string_value(json_object_get(e, "policy")), policy);
    assert_int_equal(ev_int(e, "max_cache_tokens"), ex->eviction.max_cache_tokens);
    assert_int_equal(ev_int(e, "sink_tokens"), ex->eviction.sink_tokens);
    assert_int_equal(ev_int(e, "window_tokens"), cfg_window_tokens(ex));
    assert_int_equal(ev_int(e, "heavy_tokens"),
                     ex->eviction.policy == CFG_EVICT_H2O ? ex->eviction.heavy_tokens : 0);
    json_decref(e);
    uint64_t page_bytes = (uint64_t)ex->cache.page_tokens * model_token_bytes(ex->cache.kv_type);
    assert_true(
        su_wait_metric(s.port, "kvd_kv_pages_total", (double)(ex->cache.memory / page_bytes)));
    char want[512], positions[32];
    cfg_format_value(ex, CFG_EVICTION_POSITIONS, positions, sizeof(positions));
    snprintf(want, sizeof(want),
             "config in effect (no file: built-in defaults): eviction policy %s, max_cache_tokens "
             "%lld, sink_tokens %lld, window_tokens %lld (automatic), heavy_tokens %lld, "
             "positions %s",
             policy, (long long)ex->eviction.max_cache_tokens, (long long)ex->eviction.sink_tokens,
             (long long)cfg_window_tokens(ex),
             (long long)(ex->eviction.policy == CFG_EVICT_H2O ? ex->eviction.heavy_tokens : 0),
             positions);
    assert_true(su_file_has(s.log, want));
    server_stop(&s);
    free(ex);
    free(errs);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("lifecycle", 7, true);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_queue_full_and_cancel),
        cmocka_unit_test(test_auth_and_reload),
        cmocka_unit_test(test_timeouts_connections_sessions),
        cmocka_unit_test(test_sigterm_finishes_stream),
        cmocka_unit_test(test_drain_deadline),
        cmocka_unit_test(test_config_budget_is_cache_budget),
        cmocka_unit_test(test_memory_budget),
        cmocka_unit_test(test_reload_under_load),
        cmocka_unit_test(test_defaults_are_example_file),
    };
    /* KVD_TEST_FILTER=test_name (wildcards allowed) runs a subset. */
    if (getenv("KVD_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests_name("lifecycle", tests, group_setup, group_teardown);
}
