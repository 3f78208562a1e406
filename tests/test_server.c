/*
 * test_server.c - `kvd serve` end to end: the real binary ($KVD_BIN) on a
 * free loopback port, serving a small model written by model_mk_write into
 * a temporary directory, driven over plain sockets (tests/http_client.h:
 * keep-alive, pipelining, chunked bodies, SSE): completions (OpenAI and
 * llama.cpp), streaming, stop strings, batching, sessions, pinned spans,
 * metrics.
 *
 * Each server is started with `--listen 127.0.0.1:0` and prints the port
 * it got; every socket has a timeout, and every server is stopped with
 * SIGTERM and must exit 0 (under ASan that also means leak-clean). Tests
 * never assert on wall-clock time: they wait for states (a metric, a
 * refused connection) with generous deadlines. The fixture is
 * tests/serve_fixture.h.
 *
 * The server's lifecycle (queue, auth, reload, timeouts, shutdown, the
 * config meeting the cache) is tested in test_lifecycle.c, log-probabilities
 * in test_logprobs.c, the bad-request cases (tests/cases/http/NAME.http)
 * and connection limits in test_http.c.
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
#include "engine/engine_internal.h" /* engine_stop_scan */
#include "tests/serve_fixture.h"

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

/* ------------------------------------------------------------------------
 * Tests: completions
 * ------------------------------------------------------------------------ */

static void test_completion(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    assert_int_equal(engine_stop_scan("hello", 5, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    /* a tail that could start a stop string is held */
    assert_int_equal(engine_stop_scan("helloEN", 7, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    assert_int_equal(engine_stop_scan("hello\n", 6, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 5);
    assert_int_equal(engine_stop_scan("xab", 3, stops, 3, &at, &safe), -1);
    assert_int_equal(safe, 1);
    /* complete: the earliest one wins */
    assert_int_equal(engine_stop_scan("x\n\nyEND", 7, stops, 3, &at, &safe), 1);
    assert_int_equal(at, 1);
    assert_int_equal(engine_stop_scan("ENDabc", 6, stops, 3, &at, &safe), 0);
    assert_int_equal(at, 0);
    /* no stop strings at all */
    assert_int_equal(engine_stop_scan("abc", 3, NULL, 0, &at, &safe), -1);
    assert_int_equal(safe, 3);
}

static void test_stop_across_tokens(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    assert_true(su_metric(s->port, "kvd_batch_sequences_max") > 1);
    assert_true(su_metric(s->port, "kvd_batch_sequences_count") > 0);
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
            rss_early = su_rss_kb(s->pid);
    }
    rss_late = su_rss_kb(s->pid);
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
    assert_true(su_metric(s->port, "kvd_kv_evicted_tokens_total") > 0);
    assert_true(su_metric(s->port, "kvd_sessions") >= 1);
    json_decref(hist);
}

/* A /completion with a pin request on token-id prompt ids (borrowed);
 * returns the status, and the error message in msg when not 200. */
static int pin_post(int port, json_t *ids, const char *session, json_t *pins, int n_keep,
                    char *msg, size_t msglen)
{
    json_t *body = json_pack("{s:O, s:i, s:f}", "prompt", ids, "n_predict", 4, "temperature", 0.0);
    if (pins)
        json_object_set_new(body, "keep", pins);
    if (n_keep)
        json_object_set_new(body, "n_keep", json_integer(n_keep));
    if (session)
        json_object_set_new(body, "session", json_string(session));
    int st;
    json_t *v = post(port, "/completion", body, NULL, &st);
    char *dump = v ? json_dumps(v, JSON_COMPACT) : NULL;
    snprintf(msg, msglen, "%s", dump ? dump : "");
    free(dump);
    json_decref(v);
    return st;
}

/* GET path (printf-style) and parse the answer, which must be 200. */
static json_t *get_json(int port, const char *fmt, const char *id)
{
    struct resp r;
    char path[160];
    snprintf(path, sizeof(path), fmt, id);
    assert_int_equal(http(port, "GET", path, NULL, NULL, &r), 200);
    json_t *v = json_loads(r.body, 0, NULL);
    resp_free(&r);
    return v;
}

/* The session's pinned ranges as "[[a,b],...]" (GET /v1/sessions/ID), and
 * its window in effect. */
static void session_pins(int port, const char *id, char *out, size_t len, int *window)
{
    json_t *v = get_json(port, "/v1/sessions/%s", id);
    char *d = json_dumps(json_object_get(v, "pinned"), JSON_COMPACT);
    snprintf(out, len, "%s", d ? d : "(none)");
    free(d);
    *window = (int)json_integer_value(
        json_object_get(json_object_get(v, "eviction"), "window_tokens"));
    json_decref(v);
}

/* Whether every history token in [a, b) is retained, by the session map. */
static bool map_retains(int port, const char *id, int a, int b)
{
    json_t *v = get_json(port, "/v1/sessions/%s/map?ranges=4096&text=0", id);
    size_t i;
    json_t *rg;
    bool ok = true, evicted_elsewhere = false;
    json_array_foreach(json_object_get(v, "ranges"), i, rg)
    {
        int s = (int)json_integer_value(json_object_get(rg, "start"));
        int e = (int)json_integer_value(json_object_get(rg, "end"));
        bool kept = json_integer_value(json_object_get(rg, "retained")) == e - s;
        if (s < b && a < e && !kept)
            ok = false;
        if (json_integer_value(json_object_get(rg, "retained")) < e - s && (e <= a || s >= b))
            evicted_elsewhere = true;
        if (getenv("KVD_TEST_VERBOSE"))
            print_message("map [%d, %d) %s\n", s, e, kept ? "retained" : "evicted");
    }
    json_decref(v);
    return ok && evicted_elsewhere; /* the pin held where others went */
}

/*
 * Pinned spans through the API: sizes beyond the budget are refused with
 * 400 naming them (from the numbers, and at admission for what needs the
 * prompt), and a session's pins hold through eviction and later requests
 * and show in /v1/sessions/{id}. The main server: sink-window, 256 tokens,
 * 4 sinks in 16-token pages, automatic window (224).
 */
static void test_pins(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc *s = main_server();
    char msg[2048], pins[512];
    json_t *ids = json_array();
    for (int k = 0; k < 400; k++)
        json_array_append_new(ids, json_integer(3 + (k * 53) % 500));
    json_t *few = json_pack("[i, i, i, i, i]", 5, 6, 7, 8, 9);

    /* Refused from the numbers: 300 pinned tokens cannot fit in 256. */
    assert_int_equal(pin_post(s->port, ids, NULL, json_pack("[[i, i]]", 0, 300), 0, msg,
                              sizeof(msg)),
                     400);
    print_message("400: %s\n", msg);
    assert_non_null(strstr(msg, "pinned spans hold 300 tokens"));
    assert_non_null(strstr(msg, "max_cache_tokens 256"));
    /* Two ranges that fit alone but not together. */
    assert_int_equal(pin_post(s->port, ids, NULL, json_pack("[[i, i], [i, i]]", 20, 120, 200, 330),
                              0, msg, sizeof(msg)),
                     400);
    assert_non_null(strstr(msg, "pinned spans hold 230 tokens"));
    assert_int_equal(pin_post(s->port, ids, NULL, NULL, 250, msg, sizeof(msg)), 400);
    assert_non_null(strstr(msg, "n_keep"));
    /* Malformed ranges. */
    assert_int_equal(pin_post(s->port, few, NULL, json_pack("[[i, i]]", 3, 3), 0, msg,
                              sizeof(msg)),
                     400);
    assert_int_equal(pin_post(s->port, few, NULL, json_pack("[i, i]", 1, 2), 0, msg, sizeof(msg)),
                     400);
    assert_int_equal(pin_post(s->port, few, NULL, json_string("all"), 0, msg, sizeof(msg)), 400);
    /* Refused at admission: past the prompt; n_keep -1 over a long prompt. */
    assert_int_equal(pin_post(s->port, few, NULL, json_pack("[[i, i]]", 2, 9), 0, msg,
                              sizeof(msg)),
                     400);
    assert_non_null(strstr(msg, "past the prompt's 5 tokens"));
    assert_int_equal(pin_post(s->port, ids, NULL, NULL, -1, msg, sizeof(msg)), 400);
    assert_non_null(strstr(msg, "pinned spans hold 400 tokens"));
    assert_int_equal(pin_post(s->port, few, NULL, NULL, -1, msg, sizeof(msg)), 200);

    /* A session pins [100, 140) of a 400-token prompt: it holds while the
     * prompt overflows the budget, shows, and stays for the next request. */
    assert_int_equal(pin_post(s->port, ids, "pinned", json_pack("[[i, i]]", 100, 140), 0, msg,
                              sizeof(msg)),
                     200);
    int window;
    session_pins(s->port, "pinned", pins, sizeof(pins), &window);
    assert_string_equal(pins, "[[100,140]]");
    assert_int_equal(window, 224 - 64); /* 40 tokens touch at most 4 pages */
    assert_true(map_retains(s->port, "pinned", 100, 140));
    for (int k = 0; k < 200; k++)
        json_array_append_new(ids, json_integer(7 + (k * 31) % 400));
    assert_int_equal(pin_post(s->port, ids, "pinned", NULL, 0, msg, sizeof(msg)), 200);
    session_pins(s->port, "pinned", pins, sizeof(pins), &window);
    assert_string_equal(pins, "[[100,140]]");
    assert_true(map_retains(s->port, "pinned", 100, 140));
    /* A later pin joins them; a prompt departing before a pin drops it. */
    assert_int_equal(pin_post(s->port, ids, "pinned", json_pack("[[i, i]]", 10, 20), 0, msg,
                              sizeof(msg)),
                     200);
    session_pins(s->port, "pinned", pins, sizeof(pins), &window);
    assert_string_equal(pins, "[[10,20],[100,140]]");
    json_array_set_new(ids, 50, json_integer(1));
    assert_int_equal(pin_post(s->port, ids, "pinned", NULL, 0, msg, sizeof(msg)), 200);
    session_pins(s->port, "pinned", pins, sizeof(pins), &window);
    assert_string_equal(pins, "[[10,20]]");
    assert_int_equal(window, 224 - 16);
    struct resp r;
    assert_int_equal(http(s->port, "DELETE", "/v1/sessions/pinned", NULL, NULL, &r), 200);
    resp_free(&r);
    json_decref(ids);
    json_decref(few);
}

static void test_metrics(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc *s = main_server();
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
    assert_true(su_metric(s->port, "kvd_generated_tokens_total") >= 4);
    assert_true(su_metric(s->port, "kvd_kv_pages_total") > 0);
}

/* ------------------------------------------------------------------------
 * Tests: HTTP behaviour and errors
 * ------------------------------------------------------------------------ */

static struct su_proc srv_err;

static struct su_proc *err_server(void)
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

static void test_keepalive_pipelining(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc *s = err_server();
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

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("server", 7, true);
}

static int group_teardown(void **state)
{
    (void)state;
    int bad = sf_stop_quietly(&srv_err) != 0;
    return sf_teardown() || bad ? -1 : 0;
}

int main(void)
{
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
        cmocka_unit_test(test_pins),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_keepalive_pipelining),
    };
    /* KVD_TEST_FILTER=test_name (wildcards allowed) runs a subset. */
    if (getenv("KVD_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests_name("server", tests, group_setup, group_teardown);
}
