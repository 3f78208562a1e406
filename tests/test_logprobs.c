/*
 * test_logprobs.c - log-probabilities end to end against `kvd serve`:
 * OpenAI `logprobs` (completions, streamed and not), llama.cpp `n_probs`,
 * and the values both refuse.
 *
 * Same fixture and rules as test_server.c (tests/serve_fixture.h).
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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
    struct su_proc *s = main_server();
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

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("logprobs", 7, true);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_logprobs_openai),
        cmocka_unit_test(test_logprobs_llama),
        cmocka_unit_test(test_logprobs_bad_values),
    };
    /* KVD_TEST_FILTER=test_name (wildcards allowed) runs a subset. */
    if (getenv("KVD_TEST_FILTER"))
        cmocka_set_test_filter(getenv("KVD_TEST_FILTER"));
    return cmocka_run_group_tests_name("logprobs", tests, group_setup, group_teardown);
}
