/*
 * test_load.c - `kvd load` against a real `kvd serve`, and the server
 * routes it (and a session-affine balancer) rely on: POST /tokenize and
 * /detokenize, the X-Session-Id header, the RSS gauge in /metrics.
 *
 * One server ($KVD_BIN serve, a small seeded model, a free loopback port)
 * serves every test. `kvd load` runs as a child process with tiny sizes for
 * each scenario (fixed, sweep, session on both endpoints, paced, bounded by
 * a duration, without streaming); the tests read its table, CSV and JSON
 * and check that they add up (every request counted once, exactly
 * max_tokens generated per request, percentiles ordered, the cache hits a
 * growing session must get), that --plot writes a PNG when gnuplot is
 * installed, and that any address but loopback is refused (exit 2) unless
 * --allow-remote is given. The URL parser and the loopback test are also
 * checked in-process.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>

#include "load/client.h"
#include "model/mkmodel.h"
#include "model/model.h"
#include "tests/serve_util.h"

#define N_VOCAB 512
#define MAX_PROMPT 4096

static const char *kvd_bin;
static char tmpdir[256];
static char model_path[512];
static model *lib_model;
static struct su_proc server;

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (!kvd_bin) {                                                                            \
            print_message("KVD_BIN is not set (run through `make test`): skipped\n");              \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    size_t got = fread(buf, 1, (size_t)n, f);
    buf[got] = '\0';
    fclose(f);
    return buf;
}

/*
 * Run `kvd load ARGS...` (NULL-terminated), --url pointing at the test
 * server unless ARGS has one. Returns its exit status (its output is shown
 * when that is not `want`); *out gets its stdout and stderr (new).
 */
static int run_load(int want, char **out, ...)
{
    static int seq;
    const char *argv[64];
    int argc = 0;
    argv[argc++] = kvd_bin;
    argv[argc++] = "load";
    bool has_url = false;
    va_list ap;
    va_start(ap, out);
    for (const char *a; (a = va_arg(ap, const char *)) != NULL && argc < 60;) {
        if (!strcmp(a, "--url"))
            has_url = true;
        argv[argc++] = a;
    }
    va_end(ap);
    char url[64];
    if (!has_url) {
        snprintf(url, sizeof(url), "http://127.0.0.1:%d", server.port);
        argv[argc++] = "--url";
        argv[argc++] = url;
    }
    argv[argc] = NULL;
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/load-%d.out", tmpdir, ++seq);
    assert_int_equal(su_spawn(&p, (char *const *)argv, NULL), 0);
    int rc = su_wait(&p, 120);
    *out = slurp(p.log);
    assert_non_null(*out);
    if (rc != want)
        print_message("kvd load exited %d:\n%s\n", rc, *out);
    return rc;
}

static char *tmp_path(const char *name)
{
    static char buf[8][600];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 600, "%s/%s", tmpdir, name);
    return p;
}

static json_t *ids_json(const int32_t *ids, int n)
{
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/* The in-process reference for /detokenize: the model's streaming decoder. */
static char *decode_local(const int32_t *ids, int n)
{
    model_detok *d = model_detok_create(lib_model);
    size_t cap = 4096 * (size_t)(n + 1), len = 0;
    char *out = malloc(cap);
    for (int i = 0; i < n; i++) {
        int w = model_detok_push(d, ids[i], out + len, cap - len);
        assert_true(w >= 0);
        len += (size_t)w;
    }
    int w = model_detok_flush(d, out + len, cap - len);
    assert_true(w >= 0);
    len += (size_t)w;
    out[len] = '\0';
    model_detok_destroy(d);
    return out;
}

static const char *err_code(json_t *v)
{
    return json_string_value(json_object_get(json_object_get(v, "error"), "code"));
}

static const char *err_param(json_t *v)
{
    return json_string_value(json_object_get(json_object_get(v, "error"), "param"));
}

static const char *err_message(json_t *v)
{
    const char *m = json_string_value(json_object_get(json_object_get(v, "error"), "message"));
    return m ? m : "";
}

/* A step of kvd load's JSON report. */
static json_t *step_of(json_t *doc, int i)
{
    json_t *s = json_array_get(json_object_get(doc, "steps"), (size_t)i);
    assert_non_null(s);
    return s;
}

static double num(json_t *o, const char *a, const char *b)
{
    json_t *v = b ? json_object_get(json_object_get(o, a), b) : json_object_get(o, a);
    assert_true(json_is_number(v));
    return json_number_value(v);
}

/* A step that went fully right: n_ok answers, each of max_tokens tokens,
 * throughput and latencies positive, percentiles in order. */
static void check_step(json_t *s, int context, int n_ok, int max_tokens, bool stream)
{
    assert_int_equal((int)num(s, "context", NULL), context);
    assert_int_equal((int)num(s, "ok", NULL), n_ok);
    assert_int_equal((int)num(s, "errors", NULL), 0);
    assert_int_equal(json_object_size(json_object_get(s, "errors_by_status")), 0);
    assert_int_equal((int)num(s, "output_tokens", NULL), n_ok * max_tokens);
    assert_true(num(s, "requests_per_s", NULL) > 0);
    assert_true(num(s, "output_tokens_per_s", NULL) > 0);
    static const char *const groups[] = {"ttft_ms", "itl_ms", "e2e_ms"};
    for (int g = 0; g < 3; g++) {
        if (g == 1 && !stream)
            continue;
        double p50 = num(s, groups[g], "p50"), p90 = num(s, groups[g], "p90"),
               p99 = num(s, groups[g], "p99"), mean = num(s, groups[g], "mean");
        assert_true(p50 >= 0 && p50 <= p90 && p90 <= p99);
        assert_true(mean >= 0 && mean <= p99 + 1e-9);
    }
    assert_true(num(s, "ttft_ms", "p50") > 0);
    assert_true(num(s, "e2e_ms", "p50") >= num(s, "ttft_ms", "p50"));
    assert_true(num(s, "rss_mib", NULL) > 0); /* read from /metrics */
    assert_true(num(s, "kv_pages_used", NULL) >= 0);
}

/* ------------------------------------------------------------------------
 * /tokenize and /detokenize
 * ------------------------------------------------------------------------ */

static void test_tokenize_matches_model(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *text = "Hello world, h\xc3\xa9llo: the robot's 3 gears turned \xe2\x80\x94 twice.";
    int32_t ids[512];
    int n = model_tokenize(lib_model, text, strlen(text), false, ids, 512);
    assert_true(n > 0 && n < 512);

    int st;
    json_t *v = su_post(server.port, "/tokenize", NULL, json_pack("{s:s}", "content", text), &st);
    assert_int_equal(st, 200);
    json_t *want = ids_json(ids, n);
    assert_true(json_equal(json_object_get(v, "tokens"), want));
    json_decref(want);
    json_decref(v);

    /* add_special: BOS first exactly when the model wants one. */
    int32_t ids_bos[512];
    int nb = model_tokenize(lib_model, text, strlen(text), model_add_bos(lib_model), ids_bos, 512);
    v = su_post(server.port, "/tokenize", NULL,
                json_pack("{s:s, s:b}", "content", text, "add_special", 1), &st);
    assert_int_equal(st, 200);
    want = ids_json(ids_bos, nb);
    assert_true(json_equal(json_object_get(v, "tokens"), want));
    json_decref(want);
    json_decref(v);

    /* with_pieces: the same ids; the pieces concatenated are the text
     * /detokenize gives, which is the model's own decoding. */
    v = su_post(server.port, "/tokenize", NULL,
                json_pack("{s:s, s:b}", "content", text, "with_pieces", 1), &st);
    assert_int_equal(st, 200);
    json_t *toks = json_object_get(v, "tokens");
    assert_int_equal((int)json_array_size(toks), n);
    char joined[4096] = "";
    for (int i = 0; i < n; i++) {
        json_t *t = json_array_get(toks, (size_t)i);
        assert_int_equal((int)json_integer_value(json_object_get(t, "id")), ids[i]);
        assert_true(json_is_string(json_object_get(t, "piece")));
        strncat(joined, json_string_value(json_object_get(t, "piece")),
                sizeof(joined) - strlen(joined) - 1);
    }
    json_decref(v);
    v = su_post(server.port, "/detokenize", NULL, json_pack("{s:o}", "tokens", ids_json(ids, n)),
                &st);
    assert_int_equal(st, 200);
    const char *content = json_string_value(json_object_get(v, "content"));
    assert_non_null(content);
    char *local = decode_local(ids, n);
    assert_string_equal(content, local);
    assert_string_equal(joined, content);
    /* The round trip keeps the text (a tokenizer may add a leading space). */
    size_t cl = strlen(content), tl = strlen(text);
    assert_true(cl >= tl && !strcmp(content + cl - tl, text));
    free(local);
    json_decref(v);

    /* No tokens, no text. */
    v = su_post(server.port, "/detokenize", NULL, json_pack("{s:[]}", "tokens"), &st);
    assert_int_equal(st, 200);
    assert_string_equal(json_string_value(json_object_get(v, "content")), "");
    json_decref(v);
}

static void test_token_routes_bad_input(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const struct {
        const char *path, *body, *code, *param;
    } cases[] = {
        {"/tokenize", "{}", "missing_field", "content"},
        {"/tokenize", "{\"content\":5}", "invalid_type", "content"},
        {"/tokenize", "{\"content\":\"x\",\"add_special\":\"yes\"}", "invalid_type", "add_special"},
        {"/tokenize", "{\"content\":\"x\",\"with_pieces\":1}", "invalid_type", "with_pieces"},
        {"/tokenize", "not json", "invalid_json", NULL},
        {"/tokenize", "[1,2]", "invalid_json", NULL},
        {"/tokenize", "", "invalid_json", NULL},
        {"/detokenize", "{}", "missing_field", "tokens"},
        {"/detokenize", "{\"tokens\":\"abc\"}", "invalid_type", "tokens"},
        {"/detokenize", "{\"tokens\":[1,\"a\"]}", "invalid_type", "tokens"},
        {"/detokenize", "{\"tokens\":[1.5]}", "invalid_type", "tokens"},
        {"/detokenize", "{\"tokens\":[512]}", "invalid_token", "tokens"},
        {"/detokenize", "{\"tokens\":[3,-1]}", "invalid_token", "tokens"},
        {"/detokenize", "{\"tokens\":[99999999999]}", "invalid_token", "tokens"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct su_resp r;
        int st = su_http(server.port, "POST", cases[i].path, NULL, cases[i].body, &r);
        json_t *v = json_loads(r.body ? r.body : "", 0, NULL);
        if (st != 400 || !v || strcmp(err_code(v) ? err_code(v) : "", cases[i].code))
            print_message("%s %s -> %d %s\n", cases[i].path, cases[i].body, st,
                          r.body ? r.body : "");
        assert_int_equal(st, 400);
        assert_non_null(v);
        assert_string_equal(err_code(v), cases[i].code);
        if (cases[i].param)
            assert_string_equal(err_param(v), cases[i].param);
        assert_string_equal(json_string_value(json_object_get(json_object_get(v, "error"), "type")),
                            "invalid_request_error");
        assert_true(strlen(err_message(v)) > 0);
        json_decref(v);
        su_resp_free(&r);
    }
    /* The vocabulary's last id is fine; the message says the range. */
    int st;
    json_t *v = su_post(server.port, "/detokenize", NULL, json_pack("{s:[i]}", "tokens", 511), &st);
    assert_int_equal(st, 200);
    json_decref(v);
    v = su_post(server.port, "/detokenize", NULL, json_pack("{s:[i]}", "tokens", 512), &st);
    assert_non_null(strstr(err_message(v), "0..511"));
    json_decref(v);
    /* Only POST. */
    struct su_resp r;
    assert_int_equal(su_http(server.port, "GET", "/tokenize", NULL, NULL, &r), 405);
    assert_non_null(strcasestr(r.head, "\r\nAllow: POST"));
    su_resp_free(&r);
    assert_int_equal(su_http(server.port, "DELETE", "/detokenize", NULL, NULL, &r), 405);
    su_resp_free(&r);
}

/* ------------------------------------------------------------------------
 * X-Session-Id and /metrics
 * ------------------------------------------------------------------------ */

static int session_status(const char *id, const char *headers)
{
    char path[256];
    snprintf(path, sizeof(path), "/v1/sessions/%s", id);
    struct su_resp r;
    int st = su_http(server.port, "GET", path, headers, NULL, &r);
    su_resp_free(&r);
    return st;
}

static void test_session_header(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const routes[] = {"/v1/completions", "/completion"};
    for (int k = 0; k < 2; k++) {
        const char *route = routes[k];
        char id[32], other[32], hdr[96];
        snprintf(id, sizeof(id), "hdr-%d", k);
        snprintf(other, sizeof(other), "field-%d", k);
        snprintf(hdr, sizeof(hdr), "X-Session-Id: %s\r\n", id);
        assert_int_equal(session_status(id, NULL), 404);

        /* The header alone names the session, as the field would. */
        int st;
        json_t *v = su_post(server.port, route, hdr,
                            json_pack("{s:s, s:i, s:i, s:f}", "prompt", "A header session starts",
                                      "max_tokens", 3, "n_predict", 3, "temperature", 0.0),
                            &st);
        assert_int_equal(st, 200);
        json_decref(v);
        assert_int_equal(session_status(id, NULL), 200);

        /* Header and field agreeing: the same session, now cached. */
        v = su_post(server.port, route, hdr,
                    json_pack("{s:s, s:i, s:i, s:f, s:s}", "prompt", "A header session starts",
                              "max_tokens", 3, "n_predict", 3, "temperature", 0.0, "session", id),
                    &st);
        assert_int_equal(st, 200);
        json_t *cached = k == 0
                             ? json_object_get(json_object_get(json_object_get(v, "usage"), "kvd"),
                                               "cached_tokens")
                             : json_object_get(v, "tokens_cached");
        assert_true(json_integer_value(cached) > 0);
        json_decref(v);

        /* Disagreeing: 400 naming both, and nothing is created. */
        v = su_post(server.port, route, hdr,
                    json_pack("{s:s, s:i, s:s}", "prompt", "x", "max_tokens", 2, "session", other),
                    &st);
        assert_int_equal(st, 400);
        assert_string_equal(err_code(v), "session_mismatch");
        assert_string_equal(err_param(v), "session");
        assert_non_null(strstr(err_message(v), id));
        assert_non_null(strstr(err_message(v), other));
        json_decref(v);
        assert_int_equal(session_status(other, NULL), 404);

        /* A header that is no session id. */
        static const char *const bad[] = {"X-Session-Id: a b\r\n", "X-Session-Id: caf\xc3\xa9\r\n",
                                          "X-Session-Id: \r\n"};
        for (int b = 0; b < 3; b++) {
            v = su_post(server.port, route, bad[b], json_pack("{s:s}", "prompt", "x"), &st);
            assert_int_equal(st, 400);
            assert_string_equal(err_param(v), "X-Session-Id");
            json_decref(v);
        }
        char longhdr[400];
        snprintf(longhdr, sizeof(longhdr), "X-Session-Id: %0200d\r\n", 7);
        v = su_post(server.port, route, longhdr, json_pack("{s:s}", "prompt", "x"), &st);
        assert_int_equal(st, 400);
        json_decref(v);
    }
    /* The session routes: a header naming another session is refused. */
    assert_int_equal(session_status("hdr-0", "X-Session-Id: hdr-0\r\n"), 200);
    assert_int_equal(session_status("hdr-0", "X-Session-Id: hdr-1\r\n"), 400);
}

static void test_metrics_rss(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_resp r;
    assert_int_equal(su_http(server.port, "GET", "/metrics", NULL, NULL, &r), 200);
    const char *line = strstr(r.body, "\nprocess_resident_memory_bytes ");
    assert_non_null(line);
    double rss = strtod(line + 31, NULL);
    assert_true(rss > 1024 * 1024); /* a served model takes more than a MiB */
    assert_non_null(strstr(r.body, "# TYPE process_resident_memory_bytes gauge"));
    assert_non_null(strstr(r.body, "\nkvd_kv_pages_used "));
    su_resp_free(&r);
}

/* ------------------------------------------------------------------------
 * kvd load
 * ------------------------------------------------------------------------ */

static void test_load_sweep(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char *csv = tmp_path("sweep.csv"), *js = tmp_path("sweep.json"), *png = tmp_path("sweep.png");
    bool gnuplot = su_on_path("gnuplot");
    char *out;
    int rc = run_load(0, &out, "--scenario", "sweep", "--contexts", "8,32,96", "--requests", "6",
                      "--concurrency", "2", "--max-tokens", "4", "--csv", csv, "--json", js,
                      gnuplot ? "--plot" : NULL, png, NULL);
    assert_int_equal(rc, 0);
    print_message("%s", out);

    json_t *doc = json_load_file(js, 0, NULL);
    assert_non_null(doc);
    assert_string_equal(json_string_value(json_object_get(doc, "scenario")), "sweep");
    assert_int_equal(json_array_size(json_object_get(doc, "steps")), 3);
    static const int ctx[3] = {8, 32, 96};
    for (int i = 0; i < 3; i++)
        check_step(step_of(doc, i), ctx[i], 6, 4, true);
    json_decref(doc);

    /* The table: a row per step, starting with its context and ok count. */
    for (int i = 0; i < 3; i++) {
        char row[64];
        snprintf(row, sizeof(row), "\n%8d ", ctx[i]);
        const char *at = strstr(out, row);
        assert_non_null(at);
        int c, ok, errs;
        char cached[16];
        assert_int_equal(sscanf(at + 1, "%d %15s %d %d", &c, cached, &ok, &errs), 4);
        assert_int_equal(ok, 6);
        assert_int_equal(errs, 0);
    }
    assert_non_null(strstr(out, "time to first token"));

    /* The CSV: a header and one row per step, every row as wide. */
    char *text = slurp(csv);
    assert_non_null(text);
    int lines = 0, commas_header = -1;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        int commas = 0;
        for (char *p = l; *p; p++)
            commas += *p == ',';
        if (lines == 0) {
            assert_true(!strncmp(l, "context,", 8));
            commas_header = commas;
        } else {
            assert_int_equal(commas, commas_header);
            assert_int_equal(atoi(l), ctx[lines - 1]);
        }
        lines++;
    }
    assert_int_equal(lines, 4);
    free(text);

    if (gnuplot) {
        FILE *f = fopen(png, "rb");
        assert_non_null(f);
        unsigned char magic[8] = {0};
        assert_int_equal(fread(magic, 1, 8, f), 8);
        fclose(f);
        assert_memory_equal(magic, "\x89PNG\r\n\x1a\n", 8);
        char say[700];
        snprintf(say, sizeof(say), "plot: %s", png);
        assert_non_null(strstr(out, say));
    } else {
        print_message("gnuplot is not installed: --plot not checked\n");
    }
    free(out);
}

static void test_load_sessions(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* /completion returns the answer's ids: each turn's prompt is the whole
     * conversation, and everything but the newest tokens (and the last
     * sampled one, never fed) is found cached. */
    char *js = tmp_path("session.json");
    char *out;
    assert_int_equal(run_load(0, &out, "--scenario", "session", "--endpoint", "/completion",
                              "--turns", "3", "--turn-tokens", "16", "--concurrency", "2",
                              "--max-tokens", "4", "--json", js, NULL),
                     0);
    print_message("%s", out);
    free(out);
    json_t *doc = json_load_file(js, 0, NULL);
    assert_non_null(doc);
    assert_string_equal(json_string_value(json_object_get(doc, "scenario")), "session");
    assert_int_equal(json_array_size(json_object_get(doc, "steps")), 3);
    for (int t = 0; t < 3; t++) {
        json_t *s = step_of(doc, t);
        check_step(s, 16 + t * 20, 2, 4, true);
        assert_int_equal((int)num(s, "cached_tokens", NULL), t == 0 ? 0 : 16 + (t - 1) * 20 + 3);
    }
    json_decref(doc);

    /* /v1/completions: no ids come back, so the next prompt is the previous
     * one plus new tokens, all of the previous prompt cached. */
    js = tmp_path("session-openai.json");
    assert_int_equal(run_load(0, &out, "--scenario", "session", "--turns", "2", "--turn-tokens",
                              "16", "--concurrency", "3", "--max-tokens", "2", "--json", js, NULL),
                     0);
    assert_non_null(strstr(out, "not fed back"));
    free(out);
    doc = json_load_file(js, 0, NULL);
    assert_non_null(doc);
    check_step(step_of(doc, 0), 16, 3, 2, true);
    check_step(step_of(doc, 1), 32, 3, 2, true);
    assert_true(num(step_of(doc, 1), "cached_tokens", NULL) >= 16);
    json_decref(doc);
}

static void test_load_fixed_variants(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char *js = tmp_path("fixed.json");
    char *out;
    /* Not streamed: whole answers, no inter-token figures. */
    assert_int_equal(run_load(0, &out, "--prompt-tokens", "24", "--requests", "5", "--concurrency",
                              "2", "--max-tokens", "3", "--no-stream", "--endpoint", "/completion",
                              "--json", js, NULL),
                     0);
    free(out);
    json_t *doc = json_load_file(js, 0, NULL);
    assert_non_null(doc);
    assert_true(json_is_false(json_object_get(doc, "stream")));
    check_step(step_of(doc, 0), 24, 5, 3, false);
    json_decref(doc);

    /* Paced: every request still made. */
    assert_int_equal(run_load(0, &out, "--prompt-tokens", "8", "--requests", "4", "--rate", "40",
                              "--max-tokens", "2", "--json", js, NULL),
                     0);
    free(out);
    doc = json_load_file(js, 0, NULL);
    check_step(step_of(doc, 0), 8, 4, 2, true);
    json_decref(doc);

    /* Bounded by a duration alone: it stops by itself, having done some. */
    assert_int_equal(run_load(0, &out, "--prompt-tokens", "8", "--duration", "0.3", "--concurrency",
                              "1", "--max-tokens", "2", "--json", js, NULL),
                     0);
    free(out);
    doc = json_load_file(js, 0, NULL);
    json_t *s = step_of(doc, 0);
    assert_true(num(s, "ok", NULL) >= 1);
    assert_int_equal((int)num(s, "errors", NULL), 0);
    assert_int_equal((int)num(s, "output_tokens", NULL), 2 * (int)num(s, "ok", NULL));
    json_decref(doc);
}

static void test_load_counts_errors(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* A context over the server's max_prompt_tokens: every request of that
     * step is a 400, counted by status; the other step is unharmed. */
    char *js = tmp_path("errors.json"), *csv = tmp_path("errors.csv");
    char big[16];
    snprintf(big, sizeof(big), "8,%d", MAX_PROMPT + 1);
    char *out;
    assert_int_equal(run_load(0, &out, "--scenario", "sweep", "--contexts", big, "--requests", "3",
                              "--max-tokens", "2", "--json", js, "--csv", csv, NULL),
                     0);
    assert_non_null(strstr(out, "errors: status 400 x 3"));
    free(out);
    json_t *doc = json_load_file(js, 0, NULL);
    check_step(step_of(doc, 0), 8, 3, 2, true);
    json_t *s = step_of(doc, 1);
    assert_int_equal((int)num(s, "ok", NULL), 0);
    assert_int_equal((int)num(s, "errors", NULL), 3);
    assert_int_equal((int)num(s, "errors_by_status", "400"), 3);
    json_decref(doc);
    char *text = slurp(csv);
    assert_non_null(strstr(text, ",400:3\n"));
    free(text);

    /* Nothing succeeded at all: exit 1. */
    snprintf(big, sizeof(big), "%d", MAX_PROMPT + 1);
    assert_int_equal(
        run_load(1, &out, "--scenario", "sweep", "--contexts", big, "--requests", "2", NULL), 1);
    assert_non_null(strstr(out, "no request succeeded"));
    free(out);
}

static void test_load_refuses_remote_and_bad_options(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char *out;
    /* Not loopback: refused before any connection, exit 2. */
    assert_int_equal(run_load(2, &out, "--url", "http://10.1.2.3:8080", NULL), 2);
    assert_non_null(strstr(out, "refusing non-loopback address 10.1.2.3"));
    assert_non_null(strstr(out, "--allow-remote"));
    free(out);
    char url[64];
    /* 0.0.0.0 reaches this machine but is not a loopback address: refused,
     * and allowed with --allow-remote (so the flag is what lets it by). */
    snprintf(url, sizeof(url), "http://0.0.0.0:%d", server.port);
    assert_int_equal(
        run_load(2, &out, "--url", url, "--prompt-tokens", "8", "--requests", "2", NULL), 2);
    assert_non_null(strstr(out, "refusing"));
    free(out);
    assert_int_equal(run_load(0, &out, "--url", url, "--allow-remote", "--prompt-tokens", "8",
                              "--requests", "2", "--max-tokens", "2", NULL),
                     0);
    free(out);
    /* localhost is loopback. */
    snprintf(url, sizeof(url), "localhost:%d", server.port);
    assert_int_equal(run_load(0, &out, "--url", url, "--prompt-tokens", "8", "--requests", "2",
                              "--max-tokens", "2", NULL),
                     0);
    free(out);

    /* Bad options: exit 2 with the reason. */
    static const char *const bad[][3] = {
        {"--requests", "0", "--requests"},        {"--scenario", "bogus", "--scenario"},
        {"--contexts", "8,x", "--contexts"},      {"--concurrency", "2000", "--concurrency"},
        {"--plot", "/tmp/it's.png", "--plot"},    {"--endpoint", "/v1/chat", "--endpoint"},
        {"--url", "http://127.0.0.1", "--url"},   {"--duration", "-1", "--duration"},
        {"--frobnicate", NULL, "unknown option"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(run_load(2, &out, bad[i][0], bad[i][1], NULL), 2);
        assert_non_null(strstr(out, bad[i][2]));
        free(out);
    }
    /* Nothing listening: exit 1, saying so. */
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", su_free_port());
    assert_int_equal(run_load(1, &out, "--url", url, NULL), 1);
    assert_non_null(strstr(out, "cannot connect"));
    free(out);
    /* --help prints the usage and succeeds. */
    assert_int_equal(run_load(0, &out, "--help", NULL), 0);
    assert_non_null(strstr(out, "--allow-remote"));
    free(out);
}

/* ------------------------------------------------------------------------
 * In-process: the client's URL parsing and loopback test
 * ------------------------------------------------------------------------ */

static void test_url_and_loopback(void **state)
{
    (void)state;
    char host[64];
    int port = 0;
    assert_int_equal(lc_parse_url("http://127.0.0.1:8080", host, sizeof(host), &port), 0);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 8080);
    assert_int_equal(lc_parse_url("localhost:1/", host, sizeof(host), &port), 0);
    assert_string_equal(host, "localhost");
    assert_int_equal(port, 1);
    assert_int_equal(lc_parse_url("http://[::1]:65535", host, sizeof(host), &port), 0);
    assert_string_equal(host, "::1");
    assert_int_equal(port, 65535);
    static const char *const bad[] = {"http://127.0.0.1",
                                      "127.0.0.1:0",
                                      "127.0.0.1:65536",
                                      "127.0.0.1:80x",
                                      ":80",
                                      "http://h:-1",
                                      "127.0.0.1:8080:1x",
                                      ""};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(lc_parse_url(bad[i], host, sizeof(host), &port), -1);
    char tiny[4];
    assert_int_equal(lc_parse_url("localhost:80", tiny, sizeof(tiny), &port), -1);

    static const char *const loop[] = {"127.0.0.1", "127.255.0.9", "::1", "localhost"};
    static const char *const remote[] = {"10.0.0.1",   "0.0.0.0",         "128.0.0.1",
                                         "::",         "::ffff:10.0.0.1", "localhost.example.com",
                                         "example.com"};
    for (size_t i = 0; i < sizeof(loop) / sizeof(loop[0]); i++)
        assert_true(lc_is_loopback(loop[i]));
    for (size_t i = 0; i < sizeof(remote) / sizeof(remote[0]); i++)
        assert_false(lc_is_loopback(remote[i]));
}

/* ------------------------------------------------------------------------
 * Fixture
 * ------------------------------------------------------------------------ */

static int group_teardown(void **state)
{
    (void)state;
    int bad = 0;
    if (server.pid) {
        int rc = su_stop(&server, SIGTERM, 30);
        if (rc != 0) {
            su_dump_log(&server);
            fprintf(stderr, "kvd serve exited with %d\n", rc);
            bad = 1;
        }
    }
    if (lib_model)
        model_free(lib_model);
    lib_model = NULL;
    if (su_remove_dir(tmpdir) != 0)
        bad = 1;
    return bad ? -1 : 0;
}

static int group_setup(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    kvd_bin = getenv("KVD_BIN");
    if (kvd_bin && !*kvd_bin)
        kvd_bin = NULL;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvd-test-load-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(model_path, sizeof(model_path), "%s/tiny.gguf", tmpdir);
    struct model_mk_params p = su_small_model(128, N_VOCAB, 5);
    char err[512];
    struct model_params mp = {.path = model_path};
    if (model_mk_write(&p, model_path, err, sizeof(err)) != 0 ||
        !(lib_model = model_load(&mp, err, sizeof(err)))) {
        fprintf(stderr, "test model: %s\n", err);
        group_teardown(NULL);
        return -1;
    }
    if (!kvd_bin)
        return 0;
    char max_prompt[64];
    snprintf(max_prompt, sizeof(max_prompt), "limits.max_prompt_tokens=%d", MAX_PROMPT);
    const char *const args[] = {
        "--set", "cache.memory=8MiB",      "--set", "limits.max_running=8",
        "--set", "server.threads=1",       "--set", max_prompt,
        "--set", "limits.queue_length=64",
    };
    snprintf(server.log, sizeof(server.log), "%s/server.log", tmpdir);
    if (su_serve(&server, kvd_bin, model_path, args, (int)(sizeof(args) / sizeof(*args)))) {
        group_teardown(NULL);
        return -1;
    }
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_url_and_loopback),
        cmocka_unit_test(test_tokenize_matches_model),
        cmocka_unit_test(test_token_routes_bad_input),
        cmocka_unit_test(test_session_header),
        cmocka_unit_test(test_metrics_rss),
        cmocka_unit_test(test_load_sweep),
        cmocka_unit_test(test_load_sessions),
        cmocka_unit_test(test_load_fixed_variants),
        cmocka_unit_test(test_load_counts_errors),
        cmocka_unit_test(test_load_refuses_remote_and_bad_options),
    };
    return cmocka_run_group_tests_name("load", tests, group_setup, group_teardown);
}
