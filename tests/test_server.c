/*
 * test_server.c - `kvd serve` end to end: the real binary ($KVD_BIN) on a
 * free loopback port, serving a small model written by model_mk_write into
 * a temporary directory, driven over plain sockets by the tiny HTTP client
 * below (keep-alive, pipelining, chunked bodies, SSE).
 *
 * Each server is started with `--listen 127.0.0.1:0` and prints the port
 * it got; every socket has a timeout, and every server is stopped with
 * SIGTERM and must exit 0 (under ASan that also means leak-clean). Tests
 * never assert on wall-clock time: they wait for states (a metric, a
 * refused connection) with generous deadlines.
 *
 * The bad-request cases (tests/cases/http/NAME.http) run in test_http.c.
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
#include "tests/http_client.h"

/* ------------------------------------------------------------------------
 * Fixture: temp dir, model, servers
 * ------------------------------------------------------------------------ */

static const char *kvd_bin;
static char tmpdir[256];
static char model_path[512];
static model *lib_model; /* the same file, loaded in-process for tokens */

struct server {
    pid_t pid;
    int port;
    char log[600];
};

static struct server srv_main; /* shared by most tests, started on first use */

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (!kvd_bin) {                                                                            \
            print_message("KVD_BIN is not set (run through `make test`): skipped\n");              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static void dump_log(const struct server *s)
{
    FILE *f = fopen(s->log, "r");
    if (!f)
        return;
    char line[1024];
    int n = 0;
    print_message("---- server log %s ----\n", s->log);
    while (fgets(line, sizeof(line), f) && n++ < 200)
        print_message("%s", line);
    fclose(f);
}


/*
 * Start `kvd serve --model M --listen 127.0.0.1:0 ARGS...`; read the port
 * from its first stdout line; wait until /health says 200. Returns 0 or -1.
 */
static int server_start(struct server *s, const char *const *args, int n_args)
{
    static int seq;
    snprintf(s->log, sizeof(s->log), "%s/server-%d.log", tmpdir, ++seq);
    int out[2];
    if (pipe(out) != 0)
        return -1;
    const char *argv[64];
    int argc = 0;
    argv[argc++] = kvd_bin;
    argv[argc++] = "serve";
    bool has_config = false;
    for (int i = 0; i < n_args; i++)
        if (!strcmp(args[i], "--config"))
            has_config = true;
    if (!has_config) {
        argv[argc++] = "--model";
        argv[argc++] = model_path;
        argv[argc++] = "--listen";
        argv[argc++] = "127.0.0.1:0";
    }
    for (int i = 0; i < n_args && argc < 62; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        int logfd = open(s->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        dup2(out[1], 1);
        if (logfd >= 0)
            dup2(logfd, 2);
        close(out[0]);
        /* Keep ASan's quarantine small so RSS measures the server. */
        char asan[512];
        const char *old = getenv("ASAN_OPTIONS");
        snprintf(asan, sizeof(asan), "%s%squarantine_size_mb=8", old ? old : "",
                 old && *old ? ":" : "");
        setenv("ASAN_OPTIONS", asan, 1);
        /* Idle OpenMP workers would spin and starve the loop thread and the
         * test's clients on a small shared machine. */
        setenv("OMP_WAIT_POLICY", "passive", 0);
        execv(kvd_bin, (char *const *)argv);
        _exit(127);
    }
    close(out[1]);
    s->pid = pid;
    s->port = 0;
    /* The first stdout line names the port. */
    char line[256];
    size_t n = 0;
    double deadline = mono_s() + 30;
    while (mono_s() < deadline && n < sizeof(line) - 1) {
        struct pollfd pfd = {out[0], POLLIN, 0};
        if (poll(&pfd, 1, 200) <= 0)
            continue;
        ssize_t r = read(out[0], line + n, 1);
        if (r <= 0)
            break;
        if (line[n] == '\n')
            break;
        n++;
    }
    line[n] = '\0';
    close(out[0]);
    const char *p = strstr(line, "127.0.0.1:");
    if (!p) {
        print_message("server did not print its port (got '%s')\n", line);
        dump_log(s);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        s->pid = 0;
        return -1;
    }
    s->port = atoi(p + 10);
    while (mono_s() < deadline) {
        if (http_status_simple(s->port, "/health") == 200)
            return 0;
        sleep_ms(20);
    }
    print_message("server never became healthy\n");
    dump_log(s);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    s->pid = 0;
    return -1;
}

/* Wait for the process to exit (up to 30 s; then SIGKILL). Returns its
 * exit status, or -1 if it had to be killed or died of a signal. */
static int server_wait(struct server *s)
{
    double deadline = mono_s() + 30;
    int st = 0;
    for (;;) {
        pid_t r = waitpid(s->pid, &st, WNOHANG);
        if (r == s->pid)
            break;
        if (mono_s() > deadline) {
            kill(s->pid, SIGKILL);
            waitpid(s->pid, &st, 0);
            s->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    s->pid = 0;
    if (!WIFEXITED(st))
        return -1;
    return WEXITSTATUS(st);
}

/* SIGTERM; the server must exit 0. */
static void server_stop(struct server *s)
{
    if (!s->pid)
        return;
    kill(s->pid, SIGTERM);
    int rc = server_wait(s);
    if (rc != 0)
        dump_log(s);
    assert_int_equal(rc, 0);
}

static long server_rss_kb(const struct server *s)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)s->pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long kb = -1;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atol(line + 6);
    fclose(f);
    return kb;
}

/* POST a JSON body (stolen); returns the parsed answer (NULL if not JSON)
 * and the status in *status. */
static json_t *post(int port, const char *path, json_t *body, const char *headers, int *status)
{
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct resp r;
    *status = http(port, "POST", path, headers, s, &r);
    free(s);
    json_t *v = r.body ? json_loads(r.body, 0, NULL) : NULL;
    if (*status != 200 && *status != -1 && !v)
        print_message("non-JSON answer %d: %s\n", *status, r.body ? r.body : "");
    resp_free(&r);
    return v;
}

/* SSE body -> array of parsed events; *done set if it ended with [DONE]. */
static json_t *sse_events(const char *body, bool *done)
{
    json_t *arr = json_array();
    *done = false;
    const char *p = body;
    while (p && *p) {
        const char *end = strstr(p, "\n\n");
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n > 6 && !strncmp(p, "data: ", 6)) {
            if (n == 12 && !strncmp(p + 6, "[DONE]", 6)) {
                *done = true;
            } else {
                json_t *ev = json_loadb(p + 6, n - 6, JSON_ALLOW_NUL, NULL);
                if (!ev)
                    print_message("bad SSE event: '%.*s'\n", (int)n, p);
                assert_non_null(ev);
                json_array_append_new(arr, ev);
                *done = false; /* [DONE] must be last */
            }
        }
        p = end ? end + 2 : NULL;
    }
    return arr;
}

/* The /metrics text (new), or NULL. */
static char *metrics_text(int port)
{
    struct resp r;
    int st = http(port, "GET", "/metrics", NULL, NULL, &r);
    if (st != 200) {
        resp_free(&r);
        return NULL;
    }
    return r.body;
}

/* The value of a metric line "NAME VALUE" (first match), or -1. */
static double metric(int port, const char *name)
{
    char *text = metrics_text(port);
    if (!text)
        return -1;
    double v = -1;
    size_t nl = strlen(name);
    for (char *p = text; p && *p;) {
        if (!strncmp(p, name, nl) && p[nl] == ' ') {
            v = strtod(p + nl + 1, NULL);
            break;
        }
        p = strchr(p, '\n');
        if (p)
            p++;
    }
    free(text);
    return v;
}

/* Wait until metric(name) == want (up to 20 s). */
static bool wait_metric(int port, const char *name, double want)
{
    double deadline = mono_s() + 20;
    while (mono_s() < deadline) {
        if (metric(port, name) == want)
            return true;
        sleep_ms(20);
    }
    print_message("metric %s never reached %g (last %g)\n", name, want, metric(port, name));
    return false;
}

/* ------------------------------------------------------------------------
 * Helpers on the model and the main server
 * ------------------------------------------------------------------------ */

static struct server *main_server(void)
{
    if (srv_main.pid)
        return &srv_main;
    static const char *const args[] = {
        "--set", "cache.memory=4MiB",
        "--set", "eviction.max_cache_tokens=256",
        "--set", "eviction.sink_tokens=4",
        "--set", "limits.max_running=16",
        "--set", "limits.step_tokens=64",
        "--set", "limits.queue_length=64",
        "--set", "limits.max_prompt_tokens=8192",
        "--set", "limits.max_tokens=512",
        "--set", "server.threads=1",
        "--set", "log.level=debug",
    };
    assert_int_equal(server_start(&srv_main, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    return &srv_main;
}

static json_t *tokens_json(const char *text, bool bos)
{
    int32_t ids[4096];
    int n = model_tokenize(lib_model, text, strlen(text), bos, ids, 4096);
    assert_true(n > 0 && n <= 4096);
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

static const char *choice_text(json_t *v)
{
    json_t *t = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "text");
    assert_true(json_is_string(t));
    return json_string_value(t);
}

static const char *choice_finish(json_t *v)
{
    json_t *t = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "finish_reason");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

static int usage_int(json_t *v, const char *a, const char *b)
{
    json_t *u = json_object_get(v, "usage");
    json_t *x = b ? json_object_get(json_object_get(u, a), b) : json_object_get(u, a);
    assert_true(json_is_integer(x));
    return (int)json_integer_value(x);
}

/* A greedy OpenAI completion; returns the text (new string). */
static char *greedy(int port, const char *prompt, int max_tokens)
{
    int st;
    json_t *v = post(port, "/v1/completions",
                     json_pack("{s:s, s:i, s:f}", "prompt", prompt, "max_tokens", max_tokens,
                               "temperature", 0.0),
                     NULL, &st);
    assert_int_equal(st, 200);
    char *t = strdup(choice_text(v));
    json_decref(v);
    return t;
}

/* ------------------------------------------------------------------------
 * Tests: completions
 * ------------------------------------------------------------------------ */

static void test_completion(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    int st;
    json_t *v =
        post(s->port, "/v1/completions",
             json_pack("{s:s, s:s, s:i, s:f, s:s}", "model", "anything", "prompt",
                       "Once upon a time", "max_tokens", 12, "temperature", 0.0, "user", "tester"),
             NULL, &st);
    assert_int_equal(st, 200);
    assert_string_equal(json_string_value(json_object_get(v, "object")), "text_completion");
    assert_true(!strncmp(json_string_value(json_object_get(v, "id")), "cmpl-", 5));
    assert_true(json_is_integer(json_object_get(v, "created")));
    assert_true(json_is_string(json_object_get(v, "model")));
    json_t *c0 = json_array_get(json_object_get(v, "choices"), 0);
    assert_int_equal(json_integer_value(json_object_get(c0, "index")), 0);
    assert_true(json_is_null(json_object_get(c0, "logprobs")));
    int pt = usage_int(v, "prompt_tokens", NULL), ct = usage_int(v, "completion_tokens", NULL);
    assert_int_equal(usage_int(v, "total_tokens", NULL), pt + ct);
    assert_true(pt > 0 && ct > 0 && ct <= 12);
    if (ct < 12)
        assert_string_equal(choice_finish(v), "stop");
    else
        assert_string_equal(choice_finish(v), "length");
    assert_int_equal(usage_int(v, "kvd", "cached_tokens"), 0);
    assert_int_equal(usage_int(v, "kvd", "evicted_tokens"), 0);
    assert_true(usage_int(v, "kvd", "retained_tokens") >= pt);
    /* ignore_eos: exactly max_tokens tokens, whatever the model says. */
    json_t *w = post(s->port, "/v1/completions",
                     json_pack("{s:s, s:i, s:f, s:b}", "prompt", "The end.", "max_tokens", 40,
                               "temperature", 0.0, "ignore_eos", 1),
                     NULL, &st);
    assert_int_equal(st, 200);
    assert_int_equal(usage_int(w, "completion_tokens", NULL), 40);
    assert_string_equal(choice_finish(w), "length");
    json_decref(w);
    /* Greedy is deterministic. */
    char *again = greedy(s->port, "Once upon a time", 12);
    assert_string_equal(again, choice_text(v));
    free(again);
    json_decref(v);
}

static void test_completion_stream(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    char *want = greedy(s->port, "The sea was calm and", 16);
    struct resp r;
    int st = http(s->port, "POST", "/v1/completions", NULL,
                  "{\"prompt\":\"The sea was calm and\",\"max_tokens\":16,\"temperature\":0,"
                  "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
                  &r);
    assert_int_equal(st, 200);
    char ct[128];
    assert_non_null(resp_header(&r, "content-type", ct, sizeof(ct)));
    assert_string_equal(ct, "text/event-stream");
    bool done;
    json_t *evs = sse_events(r.body, &done);
    assert_true(done);
    assert_true(json_array_size(evs) >= 3);
    char text[4096] = "";
    size_t i;
    json_t *ev;
    int n_finish = 0;
    json_t *usage = NULL;
    json_array_foreach(evs, i, ev)
    {
        assert_string_equal(json_string_value(json_object_get(ev, "object")), "text_completion");
        json_t *ch = json_object_get(ev, "choices");
        if (json_array_size(ch) == 0) {
            usage = json_object_get(ev, "usage");
            continue;
        }
        assert_null(usage); /* the usage chunk comes last */
        strncat(text, json_string_value(json_object_get(json_array_get(ch, 0), "text")),
                sizeof(text) - strlen(text) - 1);
        if (json_is_string(json_object_get(json_array_get(ch, 0), "finish_reason")))
            n_finish++;
    }
    assert_int_equal(n_finish, 1);
    assert_non_null(usage);
    assert_true(json_integer_value(json_object_get(usage, "completion_tokens")) > 0);
    assert_string_equal(text, want);
    free(want);
    json_decref(evs);
    resp_free(&r);
}

static void test_llama_completion(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    char *want = greedy(s->port, "A tiny dragon", 10);
    int st;
    json_t *v = post(s->port, "/completion",
                     json_pack("{s:s, s:i, s:f, s:b}", "prompt", "A tiny dragon", "n_predict", 10,
                               "temperature", 0.0, "cache_prompt", 1),
                     NULL, &st);
    assert_int_equal(st, 200);
    assert_string_equal(json_string_value(json_object_get(v, "content")), want);
    assert_true(json_is_true(json_object_get(v, "stop")));
    int tp = (int)json_integer_value(json_object_get(v, "tokens_predicted"));
    assert_true(tp > 0 && tp <= 10);
    assert_true(json_integer_value(json_object_get(v, "tokens_evaluated")) > 0);
    json_t *tm = json_object_get(v, "timings");
    assert_true(json_is_object(tm));
    assert_int_equal(json_integer_value(json_object_get(tm, "predicted_n")), tp);
    assert_true(json_is_number(json_object_get(tm, "prompt_ms")));
    assert_true(json_is_string(json_object_get(v, "stop_type")));
    json_decref(v);

    /* Streamed, llama.cpp style: {"content", "stop": false} ... final stop: true. */
    struct resp r;
    st = http(s->port, "POST", "/completion", NULL,
              "{\"prompt\":\"A tiny dragon\",\"n_predict\":10,\"temperature\":0,\"stream\":true}",
              &r);
    assert_int_equal(st, 200);
    bool done;
    json_t *evs = sse_events(r.body, &done);
    assert_false(done); /* llama.cpp sends no [DONE] */
    char text[4096] = "";
    size_t i;
    json_t *ev;
    json_array_foreach(evs, i, ev)
    {
        bool last = i + 1 == json_array_size(evs);
        assert_int_equal(json_is_true(json_object_get(ev, "stop")), last);
        strncat(text, json_string_value(json_object_get(ev, "content")),
                sizeof(text) - strlen(text) - 1);
        if (last)
            assert_int_equal(json_integer_value(json_object_get(ev, "tokens_predicted")), tp);
    }
    assert_string_equal(text, want);
    json_decref(evs);
    resp_free(&r);
    free(want);

    /* n_keep sets the sinks of the request's sequence: too many leave
     * eviction no room (400); a few let a prompt longer than the cache
     * through, evicting from the middle. */
    v = post(s->port, "/completion",
             json_pack("{s:s, s:i, s:i}", "prompt", "hello", "n_predict", 2, "n_keep", 250), NULL,
             &st);
    assert_int_equal(st, 400);
    json_decref(v);
    json_t *ids = json_array();
    for (int k = 0; k < 400; k++)
        json_array_append_new(ids, json_integer(3 + (k * 37) % 500));
    v = post(s->port, "/completion",
             json_pack("{s:o, s:i, s:i, s:f}", "prompt", ids, "n_predict", 4, "n_keep", 20,
                       "temperature", 0.0),
             NULL, &st);
    assert_int_equal(st, 200);
    json_t *kvd = json_object_get(v, "kvd");
    assert_true(json_integer_value(json_object_get(kvd, "evicted_tokens")) > 0);
    assert_true(json_integer_value(json_object_get(kvd, "retained_tokens")) <= 256);
    json_decref(v);
}

static void test_token_array_prompt(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    const char *prompt = "Once upon a time there was a little robot";
    char *want = greedy(s->port, prompt, 12);
    json_t *ids = tokens_json(prompt, model_add_bos(lib_model));
    int n_ids = (int)json_array_size(ids);
    int st;
    json_t *v =
        post(s->port, "/v1/completions",
             json_pack("{s:o, s:i, s:f}", "prompt", ids, "max_tokens", 12, "temperature", 0.0),
             NULL, &st);
    assert_int_equal(st, 200);
    assert_string_equal(choice_text(v), want);
    assert_int_equal(usage_int(v, "prompt_tokens", NULL), n_ids);
    json_decref(v);
    /* An array holding one token array is the same prompt. */
    v = post(s->port, "/v1/completions",
             json_pack("{s:[o], s:i, s:f}", "prompt", tokens_json(prompt, model_add_bos(lib_model)),
                       "max_tokens", 12, "temperature", 0.0),
             NULL, &st);
    assert_int_equal(st, 200);
    assert_string_equal(choice_text(v), want);
    json_decref(v);
    free(want);
}

/* Cases for the stop-string matcher itself. */
static void test_stop_scan(void **state)
{
    (void)state;
    char *stops[] = {"END", "\n\n", "abc"};
    size_t at = 99, safe = 99;
    /* no stop: everything safe */
    assert_int_equal(srv_stop_scan("hello", 5, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    /* a tail that could start a stop string is held */
    assert_int_equal(srv_stop_scan("helloEN", 7, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    assert_int_equal(srv_stop_scan("hello\n", 6, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    assert_int_equal(srv_stop_scan("xab", 3, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 1);
    /* complete: the earliest one wins */
    assert_int_equal(srv_stop_scan("x\n\nyEND", 7, stops, 3, &at, &safe), 1);
    assert_int_equal(at, 1);
    assert_int_equal(srv_stop_scan("ENDabc", 6, stops, 3, &at, &safe), 0);
    assert_int_equal(at, 0);
    /* no stop strings at all */
    assert_int_equal(srv_stop_scan("abc", 3, NULL, 0, &at, &safe), -1);
    assert_int_equal(safe, 3);
}

static void test_stop_across_tokens(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    const char *prompts[] = {"Once upon a time", "The little robot said", "Hello there, friend",
                             "In the garden"};
    for (size_t pi = 0; pi < sizeof(prompts) / sizeof(prompts[0]); pi++) {
        int st;
        json_t *v = post(s->port, "/completion",
                         json_pack("{s:s, s:i, s:f, s:b}", "prompt", prompts[pi], "n_predict", 32,
                                   "temperature", 0.0, "return_tokens", 1),
                         NULL, &st);
        assert_int_equal(st, 200);
        const char *content = json_string_value(json_object_get(v, "content"));
        json_t *toks = json_object_get(v, "tokens");
        assert_true(json_is_array(toks));
        /* Each token's text, in-process. */
        model_detok *d = model_detok_create(lib_model);
        char pieces[64][64];
        size_t n = json_array_size(toks) < 64 ? json_array_size(toks) : 64;
        char joined[4096] = "";
        for (size_t i = 0; i < n; i++) {
            int k = model_detok_push(d, (int32_t)json_integer_value(json_array_get(toks, i)),
                                     pieces[i], sizeof(pieces[i]) - 1);
            pieces[i][k > 0 ? k : 0] = '\0';
            strcat(joined, pieces[i]);
        }
        model_detok_destroy(d);
        if (strncmp(joined, content, strlen(joined)) != 0) {
            json_decref(v);
            continue;
        }
        /* A stop string made of the last byte of one piece and the first
         * of the next, printable, first occurring at that boundary. */
        char stop[3] = "";
        size_t pos = 0, off = 0;
        for (size_t i = 0; i + 1 < n; i++) {
            off += strlen(pieces[i]);
            size_t li = strlen(pieces[i]);
            if (li == 0 || !pieces[i + 1][0])
                continue;
            char a = pieces[i][li - 1], b = pieces[i + 1][0];
            if (a < 0x21 || a > 0x7e || b < 0x21 || b > 0x7e)
                continue;
            char cand[3] = {a, b, 0};
            const char *first = strstr(content, cand);
            if (first && (size_t)(first - content) == off - 1) {
                memcpy(stop, cand, 3);
                pos = off - 1;
                break;
            }
        }
        if (!stop[0]) {
            json_decref(v);
            continue;
        }
        char want[4096];
        memcpy(want, content, pos);
        want[pos] = '\0';
        json_decref(v);

        /* Non-streamed: cut before the stop string, finish_reason stop. */
        v = post(s->port, "/v1/completions",
                 json_pack("{s:s, s:i, s:f, s:[s, s]}", "prompt", prompts[pi], "max_tokens", 32,
                           "temperature", 0.0, "stop", "zzqqzz", stop),
                 NULL, &st);
        assert_int_equal(st, 200);
        assert_string_equal(choice_text(v), want);
        assert_string_equal(choice_finish(v), "stop");
        json_decref(v);

        /* Streamed: the same text, and no chunk ever carries the stop. */
        json_t *bj = json_pack("{s:s, s:i, s:f, s:b, s:s}", "prompt", prompts[pi], "max_tokens", 32,
                               "temperature", 0.0, "stream", 1, "stop", stop);
        char *body = json_dumps(bj, JSON_COMPACT);
        json_decref(bj);
        struct resp r;
        st = http(s->port, "POST", "/v1/completions", NULL, body, &r);
        free(body);
        assert_int_equal(st, 200);
        bool done;
        json_t *evs = sse_events(r.body, &done);
        assert_true(done);
        char text[4096] = "";
        size_t i;
        json_t *ev;
        json_array_foreach(evs, i, ev)
        {
            const char *t = json_string_value(
                json_object_get(json_array_get(json_object_get(ev, "choices"), 0), "text"));
            assert_null(strstr(t, stop));
            strcat(text, t);
        }
        assert_string_equal(text, want);
        json_decref(evs);
        resp_free(&r);

        /* llama.cpp reports the word. */
        v = post(s->port, "/completion",
                 json_pack("{s:s, s:i, s:f, s:[s]}", "prompt", prompts[pi], "n_predict", 32,
                           "temperature", 0.0, "stop", stop),
                 NULL, &st);
        assert_int_equal(st, 200);
        assert_string_equal(json_string_value(json_object_get(v, "content")), want);
        assert_string_equal(json_string_value(json_object_get(v, "stopping_word")), stop);
        assert_string_equal(json_string_value(json_object_get(v, "stop_type")), "word");
        json_decref(v);
        return;
    }
    fail_msg("no generated text offered a stop string across a token boundary");
}

static void test_utf8_stream(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    /* Sampled text from a random model contains byte tokens; every event
     * must still be valid JSON (whole UTF-8 characters only). */
    struct resp r;
    int st = http(s->port, "POST", "/v1/completions", NULL,
                  "{\"prompt\":\"caf\\u00e9 \\u2603 na\\u00efve\",\"max_tokens\":48,"
                  "\"temperature\":1.5,\"seed\":7,\"stream\":true}",
                  &r);
    assert_int_equal(st, 200);
    bool done;
    json_t *evs = sse_events(r.body, &done); /* asserts every event parses */
    assert_true(done);
    json_decref(evs);
    resp_free(&r);
}

/* ------------------------------------------------------------------------
 * Tests: batching
 * ------------------------------------------------------------------------ */

#define N_CLIENTS 16

struct client_job {
    int port;
    char prompt[1024];
    bool sampled; /* temperature + seed instead of greedy */
    int seed;
    char *text;
    int status;
};

static void *client_thread(void *arg)
{
    struct client_job *j = arg;
    json_t *body = j->sampled ? json_pack("{s:s, s:i, s:f, s:i}", "prompt", j->prompt, "max_tokens",
                                          16, "temperature", 0.9, "seed", j->seed)
                              : json_pack("{s:s, s:i, s:f}", "prompt", j->prompt, "max_tokens", 16,
                                          "temperature", 0.0);
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct resp r;
    j->status = http(j->port, "POST", "/v1/completions", NULL, s, &r);
    free(s);
    json_t *v = r.body ? json_loads(r.body, 0, NULL) : NULL;
    json_t *t = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "text");
    j->text = json_is_string(t) ? strdup(json_string_value(t)) : NULL;
    json_decref(v);
    resp_free(&r);
    return NULL;
}

static void test_concurrent_clients(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    static struct client_job jobs[N_CLIENTS], solo[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++) {
        struct client_job *j = &jobs[i];
        j->port = s->port;
        /* Prompts of ~100 tokens: prefill takes several 64-token steps, so
         * requests sent together overlap in the engine. */
        int n = snprintf(j->prompt, sizeof(j->prompt), "Story %d.", i);
        for (int k = 0; k < 12; k++)
            n += snprintf(j->prompt + n, sizeof(j->prompt) - (size_t)n,
                          " The robot number %d walked to the %s.", i * 7 + k,
                          k % 2 ? "garden" : "river");
        j->sampled = i % 2 == 1;
        j->seed = 1000 + i;
        solo[i] = *j;
    }
    /* Each alone first. */
    for (int i = 0; i < N_CLIENTS; i++) {
        client_thread(&solo[i]);
        assert_int_equal(solo[i].status, 200);
    }
    /* Then all at once. */
    pthread_t th[N_CLIENTS];
    for (int i = 0; i < N_CLIENTS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, client_thread, &jobs[i]), 0);
    for (int i = 0; i < N_CLIENTS; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N_CLIENTS; i++) {
        assert_int_equal(jobs[i].status, 200);
        assert_non_null(jobs[i].text);
        if (strcmp(jobs[i].text, solo[i].text) != 0)
            print_message("client %d (%s): batched '%s' != alone '%s'\n", i,
                          jobs[i].sampled ? "seeded" : "greedy", jobs[i].text, solo[i].text);
        assert_string_equal(jobs[i].text, solo[i].text);
        free(jobs[i].text);
        free(solo[i].text);
    }
    assert_true(metric(s->port, "kvd_batch_sequences_max") > 1);
    assert_true(metric(s->port, "kvd_batch_sequences_count") > 0);
}

/* ------------------------------------------------------------------------
 * Tests: sessions
 * ------------------------------------------------------------------------ */

/* A /completion call on a session with a token-array prompt; appends the
 * generated tokens to *hist; returns the answer. */
static json_t *session_turn(int port, const char *session, json_t *prompt_ids, int n_predict)
{
    int st;
    json_t *v =
        post(port, "/completion",
             json_pack("{s:O, s:i, s:f, s:s, s:b}", "prompt", prompt_ids, "n_predict", n_predict,
                       "temperature", 0.0, "session", session, "return_tokens", 1),
             NULL, &st);
    if (st != 200)
        print_message("session turn: status %d\n", st);
    assert_int_equal(st, 200);
    return v;
}

/* Expected cached tokens for a prompt extending the last turn: the last
 * turn's prompt, plus its generated tokens except the last one unless the
 * model ended the text (then every sampled token was fed). */
static int expected_cached(json_t *last, int n_prompt_before)
{
    int n_gen = (int)json_array_size(json_object_get(last, "tokens"));
    bool eos = !strcmp(json_string_value(json_object_get(last, "stop_type")), "eos");
    return n_prompt_before + n_gen - (eos ? 0 : 1);
}

static void test_session_prefix(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    json_t *hist = tokens_json("The little robot walked into the garden and", true);
    int p1 = (int)json_array_size(hist);
    json_t *v = session_turn(s->port, "sess-a", hist, 8);
    json_t *kvd = json_object_get(v, "kvd");
    assert_int_equal(json_integer_value(json_object_get(kvd, "cached_tokens")), 0);
    int want_cached = expected_cached(v, p1);
    json_array_extend(hist, json_object_get(v, "tokens"));
    json_t *more = tokens_json(" Then it saw a cat.", false);
    int n_more = (int)json_array_size(more);
    json_array_extend(hist, more);
    json_decref(more);
    json_decref(v);

    v = session_turn(s->port, "sess-a", hist, 8);
    kvd = json_object_get(v, "kvd");
    int cached = (int)json_integer_value(json_object_get(kvd, "cached_tokens"));
    assert_true(cached > 0);
    assert_int_equal(cached, want_cached);
    /* Only the unmatched suffix was prefilled. */
    int prefilled =
        (int)json_integer_value(json_object_get(json_object_get(v, "timings"), "prompt_n"));
    assert_int_equal(prefilled, (int)json_array_size(hist) - cached);
    assert_true(prefilled <= n_more + 1);
    json_decref(v);

    /* The same through the OpenAI route reports usage.kvd.cached_tokens. */
    int st;
    v = post(s->port, "/v1/completions",
             json_pack("{s:O, s:i, s:f, s:s}", "prompt", hist, "max_tokens", 4, "temperature", 0.0,
                       "session", "sess-a"),
             NULL, &st);
    assert_int_equal(st, 200);
    assert_true(usage_int(v, "kvd", "cached_tokens") >= (int)json_array_size(hist) - 1);
    assert_int_equal(usage_int(v, "prompt_tokens_details", "cached_tokens"),
                     usage_int(v, "kvd", "cached_tokens"));
    json_decref(v);

    /* GET, DELETE, GET again. */
    struct resp r;
    assert_int_equal(http(s->port, "GET", "/v1/sessions/sess-a", NULL, NULL, &r), 200);
    v = json_loads(r.body, 0, NULL);
    resp_free(&r);
    assert_string_equal(json_string_value(json_object_get(v, "id")), "sess-a");
    assert_true(json_integer_value(json_object_get(v, "tokens")) >=
                (json_int_t)json_array_size(hist));
    assert_true(json_integer_value(json_object_get(v, "retained_tokens")) > 0);
    assert_string_equal(json_string_value(json_object_get(v, "positions")), "renumber");
    assert_true(json_is_number(json_object_get(v, "last_used")));
    json_decref(v);
    assert_int_equal(http(s->port, "DELETE", "/v1/sessions/sess-a", NULL, NULL, &r), 200);
    resp_free(&r);
    assert_int_equal(http(s->port, "GET", "/v1/sessions/sess-a", NULL, NULL, &r), 404);
    resp_free(&r);
    assert_int_equal(http(s->port, "DELETE", "/v1/sessions/sess-a", NULL, NULL, &r), 404);
    resp_free(&r);
    json_decref(hist);
}

static void test_session_long(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    /* max_cache_tokens is 256; feed about 2000 tokens. */
    json_t *hist = tokens_json("Chapter one.", true);
    long rss_early = 0, rss_late = 0;
    int rounds = 40;
    for (int k = 0; k < rounds; k++) {
        char text[256];
        snprintf(text, sizeof(text),
                 " Then on day %d the robot counted %d stones by the river and sang.", k, k * 13);
        json_t *more = tokens_json(text, false);
        int before = (int)json_array_size(hist);
        json_array_extend(hist, more);
        json_decref(more);
        json_t *v = session_turn(s->port, "long", hist, 8);
        json_t *kvd = json_object_get(v, "kvd");
        int retained = (int)json_integer_value(json_object_get(kvd, "retained_tokens"));
        int evicted = (int)json_integer_value(json_object_get(kvd, "evicted_tokens"));
        assert_true(retained <= 256);
        if ((int)json_array_size(hist) > 300)
            assert_true(evicted > 0);
        if (k > 0) {
            /* still continuing from the cache, not starting over */
            int cached = (int)json_integer_value(json_object_get(kvd, "cached_tokens"));
            assert_true(cached >= before - 1);
        }
        json_array_extend(hist, json_object_get(v, "tokens"));
        json_decref(v);
        if (k == 10)
            rss_early = server_rss_kb(s);
    }
    rss_late = server_rss_kb(s);
    print_message("session of %zu tokens: RSS %ld KiB after 10 turns, %ld KiB after %d\n",
                  json_array_size(hist), rss_early, rss_late, rounds);
    assert_true(rss_early > 0 && rss_late > 0);
    assert_true(rss_late - rss_early < 16 * 1024);
    struct resp r;
    assert_int_equal(http(s->port, "GET", "/v1/sessions/long", NULL, NULL, &r), 200);
    json_t *v = json_loads(r.body, 0, NULL);
    resp_free(&r);
    assert_true(json_integer_value(json_object_get(v, "tokens")) > 1000);
    assert_true(json_integer_value(json_object_get(v, "retained_tokens")) <= 256);
    assert_true(json_integer_value(json_object_get(v, "evicted_tokens")) > 0);
    json_decref(v);
    assert_true(metric(s->port, "kvd_kv_evicted_tokens_total") > 0);
    assert_true(metric(s->port, "kvd_sessions") >= 1);
    json_decref(hist);
}

static void test_metrics(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    free(greedy(s->port, "metrics please", 4));
    char *text = metrics_text(s->port);
    assert_non_null(text);
    static const char *const names[] = {
        "kvd_http_requests_total{code=\"200\"}",
        "kvd_prompt_tokens_total",
        "kvd_generated_tokens_total",
        "kvd_time_to_first_token_seconds_bucket{le=\"+Inf\"}",
        "kvd_inter_token_latency_seconds_count",
        "kvd_batch_sequences_bucket",
        "kvd_batch_tokens_sum",
        "kvd_queue_depth",
        "kvd_running_sequences",
        "kvd_kv_pages_used",
        "kvd_kv_pages_free",
        "kvd_kv_evictions_total",
        "kvd_kv_evicted_tokens_total",
        "kvd_sessions",
        "kvd_config_generation",
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (!strstr(text, names[i]))
            print_message("missing metric %s\n", names[i]);
        assert_non_null(strstr(text, names[i]));
    }
    free(text);
    assert_true(metric(s->port, "kvd_generated_tokens_total") >= 4);
    assert_true(metric(s->port, "kvd_kv_pages_total") > 0);
}

/* ------------------------------------------------------------------------
 * Tests: HTTP behaviour and errors
 * ------------------------------------------------------------------------ */

static struct server srv_err;

static struct server *err_server(void)
{
    if (srv_err.pid)
        return &srv_err;
    static const char *const args[] = {
        "--set", "limits.max_header_bytes=1KiB",  "--set", "limits.max_headers=16",
        "--set", "limits.max_body_bytes=2KiB",    "--set", "limits.max_prompt_tokens=64",
        "--set", "limits.max_tokens=256",         "--set", "cache.memory=2MiB",
        "--set", "eviction.max_cache_tokens=128", "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&srv_err, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    return &srv_err;
}

static void check_error_json(const struct resp *r)
{
    json_t *v = json_loads(r->body ? r->body : "", 0, NULL);
    if (!v)
        print_message("not JSON: %s\n", r->body ? r->body : "(none)");
    assert_non_null(v);
    json_t *e = json_object_get(v, "error");
    assert_true(json_is_object(e));
    assert_true(json_is_string(json_object_get(e, "message")));
    assert_true(strlen(json_string_value(json_object_get(e, "message"))) > 0);
    assert_true(json_is_string(json_object_get(e, "type")));
    assert_non_null(json_object_get(e, "param"));
    assert_non_null(json_object_get(e, "code"));
    json_decref(v);
}

static void test_keepalive_pipelining(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = err_server();
    struct hc c;
    assert_int_equal(hc_open(&c, s->port), 0);
    /* keep-alive: several requests, one connection */
    for (int i = 0; i < 4; i++) {
        assert_int_equal(hc_request(&c, "GET", "/health", NULL, NULL), 0);
        struct resp r;
        assert_int_equal(hc_read(&c, &r), 0);
        assert_int_equal(r.status, 200);
        resp_free(&r);
    }
    /* pipelining: three requests in one write, answered in order */
    const char *body = "{\"prompt\":\"pipelined\",\"max_tokens\":2}";
    char buf[1024];
    int n = snprintf(buf, sizeof(buf),
                     "GET /health HTTP/1.1\r\nHost: kvd\r\n\r\n"
                     "POST /v1/completions HTTP/1.1\r\nHost: kvd\r\nContent-Length: %zu\r\n\r\n%s"
                     "GET /v1/models HTTP/1.1\r\nHost: kvd\r\n\r\n",
                     strlen(body), body);
    assert_int_equal(hc_send(&c, buf, (size_t)n), 0);
    struct resp r;
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"status\""));
    resp_free(&r);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "text_completion"));
    resp_free(&r);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"list\""));
    resp_free(&r);
    /* Expect: 100-continue gets its interim answer before the body */
    n = snprintf(buf, sizeof(buf),
                 "POST /v1/completions HTTP/1.1\r\nHost: kvd\r\nExpect: 100-continue\r\n"
                 "Content-Length: %zu\r\n\r\n",
                 strlen(body));
    assert_int_equal(hc_send(&c, buf, (size_t)n), 0);
    char line[256];
    assert_int_equal(hc_line(&c, line, sizeof(line)), 0);
    assert_non_null(strstr(line, "100"));
    assert_int_equal(hc_line(&c, line, sizeof(line)), 0);
    assert_int_equal(hc_send(&c, body, strlen(body)), 0);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    /* models lists the one model */
    assert_int_equal(hc_request(&c, "GET", "/v1/models", NULL, NULL), 0);
    assert_int_equal(hc_read(&c, &r), 0);
    json_t *v = json_loads(r.body, 0, NULL);
    resp_free(&r);
    assert_int_equal(json_array_size(json_object_get(v, "data")), 1);
    assert_string_equal(
        json_string_value(json_object_get(json_array_get(json_object_get(v, "data"), 0), "object")),
        "model");
    json_decref(v);
    hc_close(&c);
}

/* ------------------------------------------------------------------------
 * Tests: queue, cancellation, auth, reload, timeouts, shutdown
 * ------------------------------------------------------------------------ */

/* Start a stream and read its head and first chunk. */
static int start_stream(struct hc *c, int port, const char *body)
{
    if (hc_open(c, port))
        return -1;
    if (hc_request(c, "POST", "/v1/completions", NULL, body))
        return -1;
    struct resp r;
    if (hc_read_head(c, &r) || r.status != 200)
        return -1;
    char *d;
    size_t n;
    if (hc_read_chunk(c, &d, &n) != 1)
        return -1;
    free(d);
    return 0;
}

static void test_queue_full_and_cancel(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server s;
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
    assert_true(metric(s.port, "kvd_kv_pages_used") > 0);
    /* 2: waits in the queue */
    assert_int_equal(hc_open(&c2, s.port), 0);
    assert_int_equal(hc_request(&c2, "POST", "/v1/completions", NULL,
                                "{\"prompt\":\"queued\",\"max_tokens\":4}"),
                     0);
    assert_true(wait_metric(s.port, "kvd_queue_depth", 1));
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
     * sequences are dropped and every page returns to the pool. */
    hc_close(&c2);
    hc_close(&c1);
    assert_true(wait_metric(s.port, "kvd_running_sequences", 0));
    assert_true(wait_metric(s.port, "kvd_queue_depth", 0));
    assert_true(wait_metric(s.port, "kvd_kv_pages_used", 0));
    assert_true(metric(s.port, "kvd_requests_cancelled_total") >= 1);
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
    struct server s;
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
    assert_int_equal(metric(s.port, "kvd_config_generation"), 1);

    /* A good reload: the new limit and key apply, the restart-only cache
     * size is ignored. */
    snprintf(text, sizeof(text), fmt, model_path, "4MiB", "50", "sekret2");
    write_file(conf, text);
    kill(s.pid, SIGHUP);
    assert_true(wait_metric(s.port, "kvd_config_generation", 2));
    assert_int_equal(metric(s.port, "kvd_config_last_reload_success"), 1);
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
    assert_true(wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(metric(s.port, "kvd_config_generation"), 2);
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
    struct server s;
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
    double t_sessions = mono_s();

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
    sleep_ms(200); /* the server has read their headers */
    assert_int_equal(hc_open(&c, s.port), 0);
    assert_int_equal(hc_read(&c, &r), 0);
    assert_int_equal(r.status, 503);
    check_error_json(&r);
    resp_free(&r);
    hc_close(&c);
    for (int i = 0; i < 3; i++)
        hc_close(&k[i]);
    /* An idle keep-alive connection is closed quietly. */
    double deadline = mono_s() + 20;
    while (http_status_simple(s.port, "/health") != 200 && mono_s() < deadline)
        sleep_ms(20);
    assert_int_equal(hc_open(&c, s.port), 0);
    char b;
    assert_int_equal(recv(c.fd, &b, 1, 0), 0);
    hc_close(&c);
    /* Once the server has seen those closes, it serves again. */
    deadline = mono_s() + 20;
    while (http_status_simple(s.port, "/health") != 200 && mono_s() < deadline)
        sleep_ms(20);
    assert_int_equal(http_status_simple(s.port, "/health"), 200);
    /* Sessions idle past session_idle_timeout (1 s) are freed. */
    while (mono_s() < t_sessions + 1.0)
        sleep_ms(50);
    deadline = mono_s() + 20;
    while (http_status_simple(s.port, "/v1/sessions/three") != 404 && mono_s() < deadline)
        sleep_ms(50);
    assert_int_equal(http_status_simple(s.port, "/v1/sessions/three"), 404);
    assert_true(wait_metric(s.port, "kvd_sessions", 0));
    server_stop(&s);
}

static void test_sigterm_finishes_stream(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server s;
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
        sleep_ms(5);
    }
    hc_close(&k);
    /* New connections are refused once the listener closes. */
    double deadline = mono_s() + 20;
    bool refused = false;
    while (!refused && mono_s() < deadline) {
        struct hc x;
        if (hc_open(&x, s.port) != 0)
            refused = true;
        else
            hc_close(&x);
        if (!refused)
            sleep_ms(10);
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
    struct server s;
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

/* Run `kvd ARGS...` to its exit with stdout and stderr in log; returns the
 * exit status, or -1 if it had to be killed or died of a signal. */
static int run_kvd(const char *const *args, int n_args, const char *log)
{
    const char *argv[32];
    int argc = 0;
    argv[argc++] = kvd_bin;
    for (int i = 0; i < n_args && argc < 31; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
        setenv("OMP_WAIT_POLICY", "passive", 0);
        execv(kvd_bin, (char *const *)argv);
        _exit(127);
    }
    struct server s = {.pid = pid};
    snprintf(s.log, sizeof(s.log), "%s", log);
    return server_wait(&s);
}

/* The server's log (stderr) contains `text`. */
static bool log_has(const char *log, const char *text)
{
    FILE *f = fopen(log, "r");
    if (!f)
        return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, text) != NULL;
    fclose(f);
    return found;
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
    assert_int_equal(run_kvd(args, 3, log), 2);
    snprintf(want, sizeof(want),
             "kvd serve: %s:7: [cache] memory = 1MiB: one sequence at its full budget needs "
             "1028KiB: 257 pages for max_cache_tokens 4096 (default) at page_tokens 16 (default), "
             "256 bytes per token",
             conf);
    if (!log_has(log, want)) {
        struct server s = {0};
        snprintf(s.log, sizeof(s.log), "%s", log);
        dump_log(&s);
    }
    assert_true(log_has(log, want));
    assert_false(log_has(log, "listening")); /* refused before it listened */
    /* The same from the command line, and with f32 keys twice as much. */
    const char *args2[] = {
        "serve",           "--model",           model_path, "--listen",          "127.0.0.1:0",
        "--set",           "cache.memory=2MiB", "--set",    "cache.kv_type=f32", "--set",
        "server.threads=1"};
    assert_int_equal(run_kvd(args2, 11, log), 2);
    assert_true(log_has(log, "command line: [cache] memory = 2MiB: one sequence at its full "
                             "budget needs 2056KiB"));
    /* One page less than 4096 tokens need is refused, exactly enough starts. */
    snprintf(text, sizeof(text),
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
             "[cache]\nmemory = 1028KiB\n",
             model_path);
    write_file(conf, text);
    struct server s;
    const char *args3[] = {"--config", conf};
    assert_int_equal(server_start(&s, args3, 2), 0);
    assert_true(wait_metric(s.port, "kvd_kv_pages_total", 257));
    /* Reload: a larger max_cache_tokens than the pool holds is refused. */
    snprintf(text, sizeof(text),
             "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
             "[cache]\nmemory = 1028KiB\n[eviction]\nmax_cache_tokens = 4097\n",
             model_path);
    write_file(conf, text);
    kill(s.pid, SIGHUP);
    assert_true(wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(metric(s.port, "kvd_config_generation"), 1);
    snprintf(want, sizeof(want),
             "config: %s:7: [cache] memory = 1028KiB: one sequence at its full budget needs "
             "1032KiB: 258 pages for max_cache_tokens 4097 (line 9)",
             conf);
    assert_true(log_has(s.log, want));
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
    struct server s;
    const char *args[] = {"--config", conf};
    assert_int_equal(server_start(&s, args, 2), 0);
    assert_int_equal(metric(s.port, "kvd_config_generation"), 1);
    double pages = (double)((4u << 20) / (16 * model_token_bytes(CFG_KV_F16)));
    assert_true(wait_metric(s.port, "kvd_kv_pages_total", pages));

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
    double deadline = mono_s() + 120;
    for (int i = 0; i < N_RELOAD_CLIENTS; i++)
        while (atomic_load(&cl[i].progress) < 1 && mono_s() < deadline)
            sleep_ms(10);
    for (int i = 0; i < 2; i++) {
        char id[32];
        snprintf(id, sizeof(id), "endless-%d", i);
        for (;;) {
            json_t *v = session_get(s.port, id);
            int hist = v ? (int)json_integer_value(json_object_get(v, "tokens")) : 0;
            json_decref(v);
            if (hist > 200)
                break;
            assert_true(mono_s() < deadline);
            sleep_ms(10);
        }
    }
    json_t *e = session_eviction(s.port, "endless-0");
    assert_string_equal(json_string_value(json_object_get(e, "policy")), "sink-window");
    assert_int_equal(ev_int(e, "window_tokens"), 64);
    json_decref(e);

    reload_conf(conf, "8MiB", "policy = h2o\nwindow_tokens = 32\nheavy_tokens = 16\n");
    atomic_store(&phase, 1);
    kill(s.pid, SIGHUP);
    assert_true(wait_metric(s.port, "kvd_config_generation", 2));
    atomic_store(&phase, 2);
    assert_int_equal(metric(s.port, "kvd_config_last_reload_success"), 1);

    /* The endless streams never stopped; their sequences now evict as h2o. */
    for (int i = 0; i < 2; i++) {
        char id[32];
        snprintf(id, sizeof(id), "endless-%d", i);
        int retained = 1 << 30;
        bool busy = false, h2o = false;
        deadline = mono_s() + 60;
        while (mono_s() < deadline) {
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
            sleep_ms(2);
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
    assert_int_equal(metric(s.port, "kvd_kv_pages_total"), pages);
    char want[1024];
    snprintf(want, sizeof(want),
             "config: cache.memory = 8MiB (%s:9): ignored until restart; still 4MiB", conf);
    assert_true(log_has(s.log, want));
    assert_true(log_has(s.log, "config reloaded"));
    assert_true(log_has(s.log, "eviction policy h2o, max_cache_tokens 128, sink_tokens 4, "
                               "window_tokens 32, heavy_tokens 16"));

    /* An invalid file: every error logged with file and line, nothing
     * changes, and the sessions keep their h2o budget. */
    reload_conf(conf, "8MiB", "policy = sink-window\nwindow_tokens = 200\nwindw_tokens = 8\n");
    kill(s.pid, SIGHUP);
    assert_true(wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_int_equal(metric(s.port, "kvd_config_generation"), 2);
    snprintf(want, sizeof(want),
             "config: %s:16: [eviction] windw_tokens: unknown key; did you mean window_tokens?",
             conf);
    assert_true(log_has(s.log, want));
    snprintf(want, sizeof(want),
             "config: %s:15: [eviction] window_tokens = 200: window_tokens 200 (line 15) + "
             "sink_tokens 4 (line 13) as whole pages (16) + one page",
             conf);
    assert_true(log_has(s.log, want));
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
    struct server s;
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
    assert_true(wait_metric(s.port, "kvd_kv_pages_total", (double)(ex->cache.memory / page_bytes)));
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
    assert_true(log_has(s.log, want));
    server_stop(&s);
    free(ex);
    free(errs);
}

/* ------------------------------------------------------------------------
 * Tests: log-probabilities (OpenAI logprobs, llama.cpp n_probs)
 * ------------------------------------------------------------------------ */

/* The largest value of an object of numbers (keys in *argmax_key). */
static double object_max(json_t *o, const char **argmax_key)
{
    double best = -INFINITY;
    const char *k;
    json_t *v;
    json_object_foreach(o, k, v)
    {
        assert_true(json_is_number(v));
        if (json_number_value(v) > best) {
            best = json_number_value(v);
            if (argmax_key)
                *argmax_key = k;
        }
    }
    return best;
}

/* post(), for answers whose strings may hold U+0000 (the text of byte
 * token 0x00 among the alternatives). */
static json_t *post_nul(int port, const char *path, json_t *body, int *status)
{
    char *b = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct resp r;
    *status = http(port, "POST", path, NULL, b, &r);
    free(b);
    json_t *v = r.body ? json_loads(r.body, JSON_ALLOW_NUL, NULL) : NULL;
    resp_free(&r);
    return v;
}

/* Code points in a UTF-8 string. */
static size_t utf8_len(const char *s)
{
    size_t n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xC0) != 0x80;
    return n;
}

/*
 * Check an OpenAI logprobs object of n tokens with at most n_top
 * alternatives each: four arrays of n; every logprob <= 0; the chosen
 * token's logprob is the best alternative's (greedy decoding); text_offset
 * counts the code points of the tokens before. Returns the tokens joined
 * (new).
 */
static char *check_openai_logprobs(json_t *lp, size_t n, size_t n_top, size_t offset0)
{
    assert_true(json_is_object(lp));
    json_t *toks = json_object_get(lp, "tokens"), *tlp = json_object_get(lp, "token_logprobs"),
           *top = json_object_get(lp, "top_logprobs"), *off = json_object_get(lp, "text_offset");
    assert_int_equal(json_array_size(toks), n);
    assert_int_equal(json_array_size(tlp), n);
    assert_int_equal(json_array_size(top), n);
    assert_int_equal(json_array_size(off), n);
    char *joined = calloc(1, 1);
    size_t chars = offset0;
    for (size_t i = 0; i < n; i++) {
        const char *t = json_string_value(json_array_get(toks, i));
        assert_non_null(t);
        double x = json_number_value(json_array_get(tlp, i));
        assert_true(json_is_number(json_array_get(tlp, i)) && x <= 0);
        json_t *alts = json_array_get(top, i);
        assert_true(json_is_object(alts));
        assert_true(json_object_size(alts) >= 1 && json_object_size(alts) <= n_top);
        assert_true(fabs(object_max(alts, NULL) - x) < 1e-9);
        assert_int_equal(json_integer_value(json_array_get(off, i)), chars);
        chars += utf8_len(t);
        joined = realloc(joined, strlen(joined) + strlen(t) + 1);
        strcat(joined, t);
    }
    return joined;
}

static void test_logprobs_openai(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    const char *prompt = "Once upon a time";
    int st;
    json_t *v = post(s->port, "/v1/completions",
                     json_pack("{s:s, s:i, s:f, s:i}", "prompt", prompt, "max_tokens", 12,
                               "temperature", 0.0, "logprobs", 5),
                     NULL, &st);
    assert_int_equal(st, 200);
    int ct = usage_int(v, "completion_tokens", NULL);
    /* every sampled token, the end-of-generation one too */
    size_t n = (size_t)ct + (!strcmp(choice_finish(v), "stop") ? 1 : 0);
    json_t *lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    char *joined = check_openai_logprobs(lp, n, 5, 0);
    assert_string_equal(joined, choice_text(v)); /* the tokens are the text */
    free(joined);
    /* The same text as without logprobs. */
    char *plain = greedy(s->port, prompt, 12);
    assert_string_equal(plain, choice_text(v));
    free(plain);

    /* Streamed: each chunk carries the logprobs of its token, the same ones. */
    struct resp r;
    st = http(s->port, "POST", "/v1/completions", NULL,
              "{\"prompt\":\"Once upon a time\",\"max_tokens\":12,\"temperature\":0,"
              "\"logprobs\":5,\"stream\":true}",
              &r);
    assert_int_equal(st, 200);
    bool done;
    json_t *evs = sse_events(r.body, &done);
    assert_true(done);
    size_t k = 0, chars = 0;
    char text[4096] = "", toks_text[4096] = "";
    size_t i;
    json_t *ev;
    json_array_foreach(evs, i, ev)
    {
        json_t *c0 = json_array_get(json_object_get(ev, "choices"), 0);
        strncat(text, json_string_value(json_object_get(c0, "text")),
                sizeof(text) - strlen(text) - 1);
        json_t *l = json_object_get(c0, "logprobs");
        if (json_is_null(l))
            continue;
        char *t = check_openai_logprobs(l, 1, 5, chars);
        chars += utf8_len(t);
        strncat(toks_text, t, sizeof(toks_text) - strlen(toks_text) - 1);
        free(t);
        double want = json_number_value(json_array_get(json_object_get(lp, "token_logprobs"), k));
        double got = json_number_value(json_array_get(json_object_get(l, "token_logprobs"), 0));
        assert_true(fabs(want - got) < 1e-12);
        k++;
    }
    assert_int_equal(k, n);
    assert_string_equal(text, choice_text(v));
    assert_string_equal(toks_text, text);
    json_decref(evs);
    resp_free(&r);
    json_decref(v);

    /* The whole vocabulary, named by id: the probabilities sum to 1. */
    v = post(s->port, "/v1/completions",
             json_pack("{s:s, s:i, s:f, s:i, s:b}", "prompt", prompt, "max_tokens", 3,
                       "temperature", 0.0, "logprobs", 512, "return_tokens_as_token_ids", 1),
             NULL, &st);
    assert_int_equal(st, 200);
    lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    json_t *tops = json_object_get(lp, "top_logprobs");
    assert_true(json_array_size(tops) >= 1);
    json_array_foreach(tops, i, ev)
    {
        assert_int_equal(json_object_size(ev), 512);
        double sum = 0;
        const char *key;
        json_t *x;
        json_object_foreach(ev, key, x)
        {
            assert_true(!strncmp(key, "token_id:", 9));
            sum += exp(json_number_value(x));
        }
        assert_true(fabs(sum - 1.0) < 1e-4);
        /* the chosen token, by id, has the best logprob */
        const char *best = NULL;
        object_max(ev, &best);
        assert_string_equal(best,
                            json_string_value(json_array_get(json_object_get(lp, "tokens"), i)));
    }
    json_decref(v);
    /* Named by text, alternatives that share a text keep the likelier one. */
    v = post_nul(s->port, "/v1/completions",
                 json_pack("{s:s, s:i, s:f, s:i}", "prompt", prompt, "max_tokens", 2, "temperature",
                           0.0, "logprobs", 512),
                 &st);
    assert_int_equal(st, 200);
    lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    json_t *alts = json_array_get(json_object_get(lp, "top_logprobs"), 0);
    print_message("%zu distinct texts among 512 tokens\n", json_object_size(alts));
    assert_true(json_object_size(alts) > 256 && json_object_size(alts) <= 512);
    double sum = 0;
    const char *key;
    json_object_foreach(alts, key, ev) sum += exp(json_number_value(ev));
    assert_true(sum > 0.5 && sum <= 1.0 + 1e-9);
    json_decref(v);

    /* A stop string: the text ends before it, the logprobs cover every
     * sampled token, through the one that completed it. */
    v = post(s->port, "/v1/completions",
             json_pack("{s:s, s:i, s:f, s:i}", "prompt", prompt, "max_tokens", 12, "temperature",
                       0.0, "logprobs", 1),
             NULL, &st);
    lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    const char *stop = NULL;
    for (i = 2; i < json_array_size(json_object_get(lp, "tokens")) && !stop; i++) {
        const char *t = json_string_value(json_array_get(json_object_get(lp, "tokens"), i));
        if (strlen(t) > 0)
            stop = t;
    }
    assert_non_null(stop);
    json_t *w = post(s->port, "/v1/completions",
                     json_pack("{s:s, s:i, s:f, s:i, s:s}", "prompt", prompt, "max_tokens", 12,
                               "temperature", 0.0, "logprobs", 1, "stop", stop),
                     NULL, &st);
    assert_int_equal(st, 200);
    assert_string_equal(choice_finish(w), "stop");
    json_t *wl = json_object_get(json_array_get(json_object_get(w, "choices"), 0), "logprobs");
    size_t wn = json_array_size(json_object_get(wl, "tokens"));
    joined = check_openai_logprobs(wl, wn, 1, 0);
    size_t tl = strlen(choice_text(w));
    assert_true(!strncmp(joined, choice_text(w), tl));
    assert_true(!strncmp(joined + tl, stop, strlen(stop)));
    free(joined);
    json_decref(w);
    json_decref(v);

    /* logprobs 0: the chosen tokens only. */
    v = post(s->port, "/v1/completions",
             json_pack("{s:s, s:i, s:f, s:i}", "prompt", prompt, "max_tokens", 2, "temperature",
                       0.0, "logprobs", 0),
             NULL, &st);
    assert_int_equal(st, 200);
    lp = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "logprobs");
    assert_true(json_array_size(json_object_get(lp, "token_logprobs")) >= 1);
    assert_int_equal(json_object_size(json_array_get(json_object_get(lp, "top_logprobs"), 0)), 0);
    json_decref(v);
}

/* Check one llama.cpp completion_probabilities entry with n_top alternatives. */
static void check_llama_prob(json_t *e, size_t n_top)
{
    assert_true(json_is_integer(json_object_get(e, "id")));
    assert_true(json_is_string(json_object_get(e, "token")));
    double x = json_number_value(json_object_get(e, "logprob"));
    assert_true(x <= 0);
    json_t *top = json_object_get(e, "top_logprobs");
    assert_int_equal(json_array_size(top), n_top);
    double prev = 0;
    for (size_t i = 0; i < n_top; i++) {
        json_t *t = json_array_get(top, i);
        assert_true(json_is_integer(json_object_get(t, "id")));
        assert_true(json_is_string(json_object_get(t, "token")));
        double y = json_number_value(json_object_get(t, "logprob"));
        assert_true(y <= prev); /* most likely first */
        prev = y;
    }
    /* greedy: the chosen token is the most likely one */
    assert_int_equal(json_integer_value(json_object_get(json_array_get(top, 0), "id")),
                     json_integer_value(json_object_get(e, "id")));
    assert_true(fabs(json_number_value(json_object_get(json_array_get(top, 0), "logprob")) - x) <
                1e-12);
}

static void test_logprobs_llama(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    int st;
    /* repeat_penalty 1: greedy picks the raw logits' best */
    json_t *v =
        post(s->port, "/completion",
             json_pack("{s:s, s:i, s:f, s:f, s:i, s:b}", "prompt", "A tiny dragon", "n_predict", 8,
                       "temperature", 0.0, "repeat_penalty", 1.0, "n_probs", 4, "return_tokens", 1),
             NULL, &st);
    assert_int_equal(st, 200);
    int tp = (int)json_integer_value(json_object_get(v, "tokens_predicted"));
    json_t *probs = json_object_get(v, "completion_probabilities");
    size_t n = (size_t)tp + (json_is_true(json_object_get(v, "stopped_eos")) ? 1 : 0);
    assert_int_equal(json_array_size(probs), n);
    json_t *ids = json_object_get(v, "tokens");
    assert_int_equal(json_array_size(ids), tp);
    char joined[4096] = "";
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(probs, i);
        check_llama_prob(e, 4);
        if (i < (size_t)tp)
            assert_int_equal(json_integer_value(json_object_get(e, "id")),
                             json_integer_value(json_array_get(ids, i)));
        strncat(joined, json_string_value(json_object_get(e, "token")),
                sizeof(joined) - strlen(joined) - 1);
    }
    assert_string_equal(joined, json_string_value(json_object_get(v, "content")));
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(v, "generation_settings"), "n_probs")),
        4);

    /* Streamed: each event carries its token's entry, the same ones. */
    struct resp r;
    st = http(s->port, "POST", "/completion", NULL,
              "{\"prompt\":\"A tiny dragon\",\"n_predict\":8,\"temperature\":0,"
              "\"repeat_penalty\":1,\"n_probs\":4,\"stream\":true}",
              &r);
    assert_int_equal(st, 200);
    bool done;
    json_t *evs = sse_events(r.body, &done);
    size_t k = 0, i;
    json_t *ev;
    json_array_foreach(evs, i, ev)
    {
        json_t *cp = json_object_get(ev, "completion_probabilities");
        if (!cp)
            continue;
        assert_int_equal(json_array_size(cp), 1);
        json_t *e = json_array_get(cp, 0);
        check_llama_prob(e, 4);
        assert_true(k < n);
        json_t *want = json_array_get(probs, k);
        assert_int_equal(json_integer_value(json_object_get(e, "id")),
                         json_integer_value(json_object_get(want, "id")));
        assert_true(fabs(json_number_value(json_object_get(e, "logprob")) -
                         json_number_value(json_object_get(want, "logprob"))) < 1e-12);
        k++;
    }
    assert_int_equal(k, n);
    json_decref(evs);
    resp_free(&r);
    json_decref(v);

    /* The whole vocabulary: every id once, probabilities summing to 1. */
    v = post_nul(s->port, "/completion",
                 json_pack("{s:s, s:i, s:f, s:i}", "prompt", "The sea", "n_predict", 2,
                           "temperature", 0.0, "n_probs", 512),
                 &st);
    assert_int_equal(st, 200);
    probs = json_object_get(v, "completion_probabilities");
    assert_true(json_array_size(probs) >= 1);
    json_array_foreach(probs, i, ev)
    {
        json_t *top = json_object_get(ev, "top_logprobs");
        assert_int_equal(json_array_size(top), 512);
        bool seen[512] = {false};
        double sum = 0;
        size_t j;
        json_t *t;
        json_array_foreach(top, j, t)
        {
            json_int_t id = json_integer_value(json_object_get(t, "id"));
            assert_true(id >= 0 && id < 512 && !seen[id]);
            seen[id] = true;
            sum += exp(json_number_value(json_object_get(t, "logprob")));
        }
        assert_true(fabs(sum - 1.0) < 1e-4);
    }
    json_decref(v);
    /* An end-of-generation token is reported too, as the last entry: hot
     * sampling over long outputs meets one within a few seeds. */
    bool eos = false;
    for (int seed = 1; seed <= 40 && !eos; seed++) {
        v = post_nul(s->port, "/completion",
                     json_pack("{s:s, s:i, s:f, s:i, s:f, s:f, s:i, s:i}", "prompt", "The end",
                               "n_predict", 500, "temperature", 50.0, "top_k", 0, "top_p", 1.0,
                               "min_p", 0.0, "seed", seed, "n_probs", 1),
                     &st);
        assert_int_equal(st, 200);
        probs = json_object_get(v, "completion_probabilities");
        tp = (int)json_integer_value(json_object_get(v, "tokens_predicted"));
        eos = json_is_true(json_object_get(v, "stopped_eos"));
        assert_int_equal(json_array_size(probs), (size_t)tp + (eos ? 1 : 0));
        if (eos) {
            json_t *last = json_array_get(probs, (size_t)tp);
            assert_true(
                model_is_eog(lib_model, (int32_t)json_integer_value(json_object_get(last, "id"))));
            assert_true(json_number_value(json_object_get(last, "logprob")) <= 0);
            print_message("seed %d: end of generation after %d tokens, logprob %g\n", seed, tp,
                          json_number_value(json_object_get(last, "logprob")));
        }
        json_decref(v);
    }
    assert_true(eos);
    /* n_probs 0 (the default): no probabilities. */
    v = post(s->port, "/completion",
             json_pack("{s:s, s:i, s:i}", "prompt", "The sea", "n_predict", 2, "n_probs", 0), NULL,
             &st);
    assert_int_equal(st, 200);
    assert_null(json_object_get(v, "completion_probabilities"));
    json_decref(v);
}

/* Bad logprobs / n_probs / echo values: 400, OpenAI-shaped, naming the field. */
static void test_logprobs_bad_values(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct server *s = main_server();
    static const struct {
        const char *path, *body, *param;
    } cases[] = {
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":-1}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":513}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":1000000000000}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":\"5\"}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":true}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":2.5}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":[5]}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"a\",\"logprobs\":1,\"echo\":true}", "echo"},
        {"/v1/completions", "{\"prompt\":\"a\",\"return_tokens_as_token_ids\":1}",
         "return_tokens_as_token_ids"},
        {"/completion", "{\"prompt\":\"a\",\"n_probs\":-1}", "n_probs"},
        {"/completion", "{\"prompt\":\"a\",\"n_probs\":513}", "n_probs"},
        {"/completion", "{\"prompt\":\"a\",\"n_probs\":\"x\"}", "n_probs"},
        {"/completion", "{\"prompt\":\"a\",\"n_probs\":{}}", "n_probs"},
        {"/completion", "{\"prompt\":\"a\",\"n_probs\":2,\"post_sampling_probs\":true}",
         "post_sampling_probs"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct resp r;
        int st = http(s->port, "POST", cases[i].path, NULL, cases[i].body, &r);
        if (st != 400)
            print_message("%s %s: %d %s\n", cases[i].path, cases[i].body, st, r.body);
        assert_int_equal(st, 400);
        check_error_json(&r);
        json_t *v = json_loads(r.body, 0, NULL);
        json_t *e = json_object_get(v, "error");
        assert_string_equal(json_string_value(json_object_get(e, "type")), "invalid_request_error");
        assert_string_equal(json_string_value(json_object_get(e, "param")), cases[i].param);
        json_decref(v);
        resp_free(&r);
    }
    /* The limit is the vocabulary (512 here): 512 is accepted. */
    int st;
    json_t *v = post(s->port, "/v1/completions",
                     json_pack("{s:s, s:i, s:i}", "prompt", "a", "max_tokens", 1, "logprobs", 512),
                     NULL, &st);
    assert_int_equal(st, 200);
    json_decref(v);
}

/* ------------------------------------------------------------------------
 * Fixture
 * ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    kvd_bin = getenv("KVD_BIN");
    if (kvd_bin && !*kvd_bin)
        kvd_bin = NULL;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvd-test-server-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(model_path, sizeof(model_path), "%s/tiny.gguf", tmpdir);
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 64;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_ff = 128;
    p.n_vocab = 512;
    p.seed = 7;
    char err[512];
    if (model_mk_write(&p, model_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "model_mk_write: %s\n", err);
        return -1;
    }
    struct model_params mp = {.path = model_path};
    lib_model = model_load(&mp, err, sizeof(err));
    if (!lib_model) {
        fprintf(stderr, "model_load: %s\n", err);
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    int bad = 0;
    struct server *all[] = {&srv_main, &srv_err};
    for (int i = 0; i < 2; i++) {
        if (!all[i]->pid)
            continue;
        kill(all[i]->pid, SIGTERM);
        int rc = server_wait(all[i]);
        if (rc != 0) {
            dump_log(all[i]);
            fprintf(stderr, "server exited with %d\n", rc);
            bad = 1;
        }
    }
    model_free(lib_model);
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    if (system(cmd) != 0)
        bad = 1;
    return bad ? -1 : 0;
}

int main(void)
{
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stop_scan),
        cmocka_unit_test(test_completion),
        cmocka_unit_test(test_completion_stream),
        cmocka_unit_test(test_llama_completion),
        cmocka_unit_test(test_token_array_prompt),
        cmocka_unit_test(test_stop_across_tokens),
        cmocka_unit_test(test_utf8_stream),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_session_prefix),
        cmocka_unit_test(test_session_long),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_keepalive_pipelining),
        cmocka_unit_test(test_queue_full_and_cancel),
        cmocka_unit_test(test_auth_and_reload),
        cmocka_unit_test(test_timeouts_connections_sessions),
        cmocka_unit_test(test_sigterm_finishes_stream),
        cmocka_unit_test(test_drain_deadline),
        cmocka_unit_test(test_config_budget_is_cache_budget),
        cmocka_unit_test(test_memory_budget),
        cmocka_unit_test(test_reload_under_load),
        cmocka_unit_test(test_defaults_are_example_file),
        cmocka_unit_test(test_logprobs_openai),
        cmocka_unit_test(test_logprobs_llama),
        cmocka_unit_test(test_logprobs_bad_values),
    };
    /* KVD_TEST_FILTER=test_name (wildcards allowed) runs a subset. */
    if (getenv("KVD_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests_name("server", tests, group_setup, group_teardown);
}
