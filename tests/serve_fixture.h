/*
 * serve_fixture.h - the fixture of the test programs that run the real
 * `kvd serve` ($KVD_BIN) on a scratch model: test_server.c,
 * test_lifecycle.c, test_logprobs.c, test_http.c and test_faults.c.
 *
 * One program is one cmocka group: sf_setup() writes the small model
 * (su_small_model(128, 512, seed)) into a scratch directory, optionally
 * loads it in-process (lib_model, for token ids), and sf_teardown() stops
 * the shared main server if a test started it and removes the directory.
 * Servers are processes from serve_util.h (struct su_proc), each with its
 * log in the scratch directory; server_stop() requires exit status 0,
 * which under ASan also means leak-clean. Requests go through
 * http_client.h (keep-alive, pipelining, chunking, SSE) or serve_util.h's
 * one-shot su_http.
 *
 * Include after <cmocka.h>, once per program: the fixture's state is
 * static here. Unused helpers are fine (SU_FN).
 */
#ifndef KVD_TESTS_SERVE_FIXTURE_H
#define KVD_TESTS_SERVE_FIXTURE_H

#include <jansson.h>

#include "model/model.h"
#include "tests/http_client.h"
#include "tests/serve_util.h"

static const char *kvd_bin;     /* $KVD_BIN, or NULL: tests that need it skip */
static char tmpdir[256];        /* the scratch directory */
static char model_path[512];    /* the scratch model in it */
static model *lib_model;        /* the same file loaded in-process, if asked */
static struct su_proc srv_main; /* shared by most server tests, started on first use */

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (!kvd_bin) {                                                                            \
            print_message("KVD_BIN is not set (run through `make test`): skipped\n");              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

/* The group setup: SIGPIPE ignored, $KVD_BIN read, the scratch model
 * written (and loaded when load_model). Returns 0 or -1. */
SU_FN int sf_setup(const char *name, uint64_t seed, bool load_model)
{
    signal(SIGPIPE, SIG_IGN);
    kvd_bin = getenv("KVD_BIN");
    if (kvd_bin && !*kvd_bin)
        kvd_bin = NULL;
    if (su_scratch_model(name, seed, tmpdir, sizeof(tmpdir), model_path, sizeof(model_path)))
        return -1;
    if (!load_model)
        return 0;
    char err[512];
    struct model_params mp = {.path = model_path};
    lib_model = model_load(&mp, err, sizeof(err));
    if (!lib_model) {
        fprintf(stderr, "model_load: %s\n", err);
        return -1;
    }
    return 0;
}

/* SIGTERM to a server that is still running; 0 if it was not, or it
 * exited 0 (its log is shown otherwise). For group teardowns, which may
 * not assert. */
SU_FN int sf_stop_quietly(struct su_proc *s)
{
    if (!s->pid)
        return 0;
    int rc = su_stop(s, SIGTERM, 30);
    if (rc != 0) {
        su_dump_log(s);
        fprintf(stderr, "server exited with %d\n", rc);
    }
    return rc;
}

/* The group teardown: the main server stopped (it must exit 0), the
 * in-process model freed, the scratch directory removed. */
SU_FN int sf_teardown(void)
{
    int bad = sf_stop_quietly(&srv_main) != 0;
    model_free(lib_model);
    lib_model = NULL;
    if (su_remove_dir(tmpdir))
        bad = 1;
    return bad ? -1 : 0;
}

/*
 * Start `kvd serve` with ARGS on the scratch model (see su_serve), its log
 * in the scratch directory as NAME.log, or server-N.log when name is NULL.
 * With --config in ARGS, the file names the model and the listen address
 * (which must be 127.0.0.1:0), so neither is added. Returns 0 or -1.
 */
SU_FN int server_start_named(struct su_proc *s, const char *name, const char *const *args,
                             int n_args)
{
    static int seq;
    memset(s, 0, sizeof(*s));
    if (name)
        snprintf(s->log, sizeof(s->log), "%s/%s.log", tmpdir, name);
    else
        snprintf(s->log, sizeof(s->log), "%s/server-%d.log", tmpdir, ++seq);
    bool has_config = false;
    for (int i = 0; i < n_args; i++)
        has_config = has_config || !strcmp(args[i], "--config");
    if (!has_config)
        return su_serve(s, kvd_bin, model_path, args, n_args);
    const char *argv[64] = {kvd_bin, "serve"};
    int argc = 2;
    for (int i = 0; i < n_args && argc < 63; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    return su_serve_argv(s, argv);
}

SU_FN int server_start(struct su_proc *s, const char *const *args, int n_args)
{
    return server_start_named(s, NULL, args, n_args);
}

/* server_start_named, which must succeed. */
SU_FN void serve(struct su_proc *s, const char *name, const char *const *args, int n_args)
{
    assert_int_equal(server_start_named(s, name, args, n_args), 0);
}

/* Wait for the process to exit (30 s; then SIGKILL). Returns its exit
 * status, nonzero if it had to be killed or died of a signal. */
SU_FN int server_wait(struct su_proc *s)
{
    return su_wait(s, 30);
}

/* SIGTERM; the server must exit 0. */
SU_FN void server_stop(struct su_proc *s)
{
    if (!s->pid)
        return;
    int rc = su_stop(s, SIGTERM, 30);
    if (rc != 0)
        su_dump_log(s);
    assert_int_equal(rc, 0);
}

/*
 * Run `kvd ARGS...` (n_args of them) to its exit, stdout and stderr in
 * log. Returns the exit status, nonzero if it had to be killed after
 * timeout_s or died of a signal.
 */
SU_FN int run_kvd(const char *const *args, int n_args, const char *log, double timeout_s)
{
    const char *argv[32];
    int argc = 0;
    argv[argc++] = kvd_bin;
    for (int i = 0; i < n_args && argc < 31; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s", log);
    assert_int_equal(su_spawn(&p, (char *const *)argv, NULL), 0);
    return su_wait(&p, timeout_s);
}

/* --- the main server and its answers --------------------------------------- */

/* The server most tests share: 4 MiB of cache, 256-token budget, debug log. */
SU_FN struct su_proc *main_server(void)
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

/* POST a JSON body (stolen); returns the parsed answer (NULL if not JSON)
 * and the status in *status. */
SU_FN json_t *post(int port, const char *path, json_t *body, const char *headers, int *status)
{
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct resp r;
    *status = http(port, "POST", path, headers, s, &r);
    free(s);
    json_t *v = r.body ? json_loads(r.body, JSON_ALLOW_NUL, NULL) : NULL; /* U+0000: see su_post */
    if (*status != 200 && *status != -1 && !v)
        print_message("non-JSON answer %d: %s\n", *status, r.body ? r.body : "");
    resp_free(&r);
    return v;
}

/* SSE body -> array of parsed events; *done set if it ended with [DONE]. */
SU_FN json_t *sse_events(const char *body, bool *done)
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

/* An OpenAI error body: {"error": {message (non-empty), type, param, code}}. */
SU_FN void check_error_json(const struct resp *r)
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

/* POST body to /v1/completions as a stream on c (open; the caller closes
 * it) and read its head and first chunk: 0, or -1. */
SU_FN int start_stream(struct hc *c, int port, const char *body)
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

/* The prompt's token ids (the in-process model's tokenizer) as a JSON array. */
SU_FN json_t *tokens_json(const char *text, bool bos)
{
    int32_t ids[4096];
    int n = model_tokenize(lib_model, text, strlen(text), bos, ids, 4096);
    assert_true(n > 0 && n <= 4096);
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

SU_FN const char *choice_text(json_t *v)
{
    json_t *t = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "text");
    assert_true(json_is_string(t));
    return json_string_value(t);
}

SU_FN const char *choice_finish(json_t *v)
{
    json_t *t = json_object_get(json_array_get(json_object_get(v, "choices"), 0), "finish_reason");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

SU_FN int usage_int(json_t *v, const char *a, const char *b)
{
    json_t *u = json_object_get(v, "usage");
    json_t *x = b ? json_object_get(json_object_get(u, a), b) : json_object_get(u, a);
    assert_true(json_is_integer(x));
    return (int)json_integer_value(x);
}

/* A greedy OpenAI completion; returns the text (new string). */
SU_FN char *greedy(int port, const char *prompt, int max_tokens)
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

#endif /* KVD_TESTS_SERVE_FIXTURE_H */
