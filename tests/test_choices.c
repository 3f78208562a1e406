/*
 * test_choices.c - n choices per request (OpenAI `n`, engine/choices.c):
 * the engine stepped by hand (the prompt's pages held once, each choice its
 * own seeded sampler, the session continued by choice 0, cancel freeing
 * every fork, admission charging n answers), then `kvd serve` end to end
 * (/v1/completions and /v1/chat/completions, streamed and not, the limits'
 * 400s, a client leaving mid-stream).
 *
 * Same fixture and rules as test_engine.c (tests/serve_fixture.h).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>

#include "engine/engine.h"
#include "model/model.h"
#include "tests/serve_fixture.h"

/* ------------------------------------------------------------------------
 * In-process: the engine stepped by hand
 * ------------------------------------------------------------------------ */

#define MAXC 8
#define MAXT 64

/* An engine over the scratch model: f32 K/V in pages of 16 tokens, a pool
 * of `pages` pages, no eviction at the most tokens such a pool holds for
 * one sequence, no prefix cache. */
static engine *choices_engine(int pages)
{
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(lib_model, &shape);
    struct engine_params p = {
        .m = lib_model,
        .cache_memory = kv_cache_memory_for(&shape, pages),
        .page_tokens = 16,
        .k_type = KV_F32,
        .v_type = KV_F32,
        .n_threads = 1,
        .limits = {.policy = {.kind = KV_EVICT_NONE, .max_cache_tokens = (pages - 1) * 16},
                   .max_running = 8,
                   .step_tokens = 64,
                   .max_sessions = 4},
    };
    char err[512];
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    return e;
}

/* A completion of n_prompt ids generating max_tokens, n choices, sampled
 * at temperature 0.9 with seed (temperature 0: greedy). */
static struct engine_req *completion(int n_prompt, int max_tokens, int n, float temp, uint64_t seed)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    assert_non_null(r);
    r->prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    assert_non_null(r->prompt);
    for (int i = 0; i < n_prompt; i++)
        r->prompt[i] = 1 + (i * 7) % 200;
    r->n_prompt = n_prompt;
    r->max_tokens = max_tokens;
    r->n_choices = n;
    r->ignore_eos = true;
    r->want_tokens = true;
    model_sampling_defaults(&r->sampling);
    r->sampling.temperature = temp;
    r->sampling.seed = seed;
    return r;
}

/* What one request's events said. */
struct answer {
    int32_t ids[MAXC][MAXT]; /* each choice's sampled ids */
    int n_ids[MAXC];
    int choice_events[MAXC]; /* CHOICE events per choice */
    enum engine_finish finish[MAXC];
    int n_choice_events;
    bool done, error;
    int status;
    int last_choice; /* DONE's */
    struct engine_usage usage;
};

/* Take e's events into a (one request in flight). */
static void take(engine *e, struct answer *a)
{
    for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
        next = ev->next;
        assert_false(a->done || a->error); /* nothing after the final event */
        assert_true(ev->choice >= 0 && ev->choice < MAXC);
        int c = ev->choice;
        switch (ev->kind) {
        case ENGINE_EV_TEXT:
            for (int k = 0; k < ev->n_tokens && a->n_ids[c] < MAXT; k++)
                a->ids[c][a->n_ids[c]++] = ev->tokens[k];
            break;
        case ENGINE_EV_CHOICE:
            a->choice_events[c]++;
            a->n_choice_events++;
            a->finish[c] = ev->finish;
            break;
        case ENGINE_EV_DONE:
            a->done = true;
            a->finish[c] = ev->finish;
            a->last_choice = c;
            a->usage = ev->usage;
            break;
        case ENGINE_EV_ERROR:
            a->error = true;
            a->status = ev->status;
            break;
        default:
            fail_msg("unexpected event kind %d", (int)ev->kind);
        }
        engine_event_free(ev);
    }
}

/* Step e until r's final event. */
static void run_to_end(engine *e, struct answer *a)
{
    for (int steps = 0; !a->done && !a->error && steps < 2000; steps++) {
        engine_step(e, (uint64_t)(su_now() * 1e9));
        take(e, a);
    }
    assert_true(a->done || a->error);
}

static void one_answer(engine *e, struct engine_req *r, struct answer *a)
{
    memset(a, 0, sizeof(*a));
    assert_int_equal(engine_submit(e, r), 0);
    run_to_end(e, a);
    engine_req_free(r);
}

static struct kv_stats kv_stats_of(engine *e, int *running)
{
    struct engine_stats st;
    engine_get_stats(e, &st);
    if (running)
        *running = st.running;
    return st.kv;
}

/*
 * n = 4 over a 100-token prompt (6 full pages and one of 4 tokens): at the
 * step that reads the prompt's end, four runs hold the prompt's 7 pages
 * once (all 7 shared); at the next, each choice wrote its first token into
 * its own copy of the partly full page (6 + 4 pages). Then every choice
 * decodes to max_tokens: three CHOICE events and one DONE, usage summing
 * the choices' tokens; every page back at the end.
 */
static void test_engine_prompt_pages_once(void **state)
{
    (void)state;
    engine *e = choices_engine(64);
    struct engine_req *r = completion(100, 8, 4, 0.9f, 7);
    struct answer a = {0};
    assert_int_equal(engine_submit(e, r), 0);
    int running = 0, steps = 0;
    while (a.n_ids[0] == 0 && steps++ < 50) {
        engine_step(e, (uint64_t)(su_now() * 1e9));
        take(e, &a);
    }
    struct kv_stats kv = kv_stats_of(e, &running);
    assert_int_equal(running, 4);
    for (int c = 0; c < 4; c++)
        assert_int_equal(a.n_ids[c], 1); /* every choice sampled its first token */
    assert_int_equal(kv.pages_used, 7);
    assert_int_equal(kv.pages_shared, 7);
    engine_step(e, (uint64_t)(su_now() * 1e9));
    take(e, &a);
    kv = kv_stats_of(e, NULL);
    assert_int_equal(kv.pages_used, 6 + 4);
    assert_int_equal(kv.pages_shared, 6);
    run_to_end(e, &a);
    engine_req_free(r);
    assert_true(a.done);
    assert_int_equal(a.n_choice_events, 3);
    assert_int_equal(a.choice_events[a.last_choice], 0);
    for (int c = 0; c < 4; c++) {
        assert_int_equal(a.n_ids[c], 8);
        assert_int_equal(a.finish[c], ENGINE_FINISH_LENGTH);
        if (c != a.last_choice)
            assert_int_equal(a.choice_events[c], 1);
    }
    assert_int_equal(a.usage.completion_tokens, 4 * 8);
    assert_int_equal(a.usage.prompt_tokens, 100);
    kv = kv_stats_of(e, &running);
    assert_int_equal(running, 0);
    assert_int_equal(kv.pages_used, 0);
    engine_destroy(e);
}

/*
 * Sampling: choice i samples with seed + i, so a seeded request repeats
 * itself choice by choice, choice 0 is the answer of the same request with
 * n = 1, choice 1 that of n = 1 with seed + 1, and the choices differ. A
 * greedy request gives n equal answers, the n = 1 answer.
 */
static void test_engine_seeded_choices(void **state)
{
    (void)state;
    engine *e = choices_engine(64);
    struct answer a, b, one, one1;
    one_answer(e, completion(40, 12, 3, 0.9f, 99), &a);
    one_answer(e, completion(40, 12, 3, 0.9f, 99), &b);
    one_answer(e, completion(40, 12, 1, 0.9f, 99), &one);
    one_answer(e, completion(40, 12, 1, 0.9f, 100), &one1);
    assert_memory_equal(a.ids, b.ids, sizeof(a.ids));
    assert_memory_equal(a.ids[0], one.ids[0], sizeof(a.ids[0]));
    assert_memory_equal(a.ids[1], one1.ids[0], sizeof(a.ids[0]));
    assert_memory_not_equal(a.ids[0], a.ids[1], sizeof(a.ids[0]));
    assert_memory_not_equal(a.ids[1], a.ids[2], sizeof(a.ids[0]));
    struct answer g, g1;
    one_answer(e, completion(40, 12, 3, 0.0f, 1), &g);
    one_answer(e, completion(40, 12, 1, 0.0f, 1), &g1);
    for (int c = 0; c < 3; c++)
        assert_memory_equal(g.ids[c], g1.ids[0], sizeof(g.ids[0]));
    engine_destroy(e);
}

/*
 * A session continues with choice 0: after an n = 3 request on session
 * "s", the session's cache holds what an n = 1 request with the same seed
 * leaves (its prompt and choice 0's answer but the last, unfed token); the
 * other choices' forks are gone.
 */
static void test_engine_session_keeps_choice0(void **state)
{
    (void)state;
    engine *e3 = choices_engine(64), *e1 = choices_engine(64);
    struct engine_req *r3 = completion(40, 10, 3, 0.9f, 5), *r1 = completion(40, 10, 1, 0.9f, 5);
    r3->session = strdup("s");
    r1->session = strdup("s");
    struct answer a3, a1;
    one_answer(e3, r3, &a3);
    one_answer(e1, r1, &a1);
    int n3 = 0, n1 = 0;
    const int32_t *t3 = engine_session_tokens(e3, "s", &n3);
    const int32_t *t1 = engine_session_tokens(e1, "s", &n1);
    assert_non_null(t3);
    assert_int_equal(n3, 40 + 10 - 1);
    assert_int_equal(n3, n1);
    assert_memory_equal(t3, t1, sizeof(int32_t) * (size_t)n1);
    assert_memory_equal(t3 + 40, a3.ids[0], sizeof(int32_t) * 9);
    int running = 0;
    struct kv_stats kv = kv_stats_of(e3, &running);
    assert_int_equal(running, 0);
    assert_int_equal(kv.pages_used, (n3 + 15) / 16); /* the session's alone */
    engine_destroy(e3);
    engine_destroy(e1);
}

/*
 * Cancel ends every choice: a long n = 3 request cancelled after a few
 * decode steps gets CHOICE events for two choices and one DONE, all
 * ENGINE_FINISH_CANCEL, and every fork's pages go back to the pool.
 */
static void test_engine_cancel_frees_forks(void **state)
{
    (void)state;
    engine *e = choices_engine(64);
    struct engine_req *r = completion(60, 200, 3, 0.9f, 3);
    struct answer a = {0};
    assert_int_equal(engine_submit(e, r), 0);
    for (int steps = 0; a.n_ids[2] < 20 && steps < 100; steps++) {
        engine_step(e, (uint64_t)(su_now() * 1e9));
        take(e, &a);
    }
    int running = 0;
    struct kv_stats kv = kv_stats_of(e, &running);
    assert_int_equal(running, 3);
    assert_true(kv.pages_used > 5); /* 3 pages of prompt, each fork's own pages */
    atomic_store(&r->cancel, ENGINE_CANCEL_CLIENT);
    engine_step(e, (uint64_t)(su_now() * 1e9));
    take(e, &a);
    assert_true(a.done);
    assert_int_equal(a.n_choice_events, 2);
    for (int c = 0; c < 3; c++)
        assert_int_equal(a.finish[c], ENGINE_FINISH_CANCEL);
    kv = kv_stats_of(e, &running);
    assert_int_equal(running, 0);
    assert_int_equal(kv.pages_used, 0);
    engine_req_free(r);
    engine_destroy(e);
}

/*
 * Admission charges the prompt once plus n answers: in a pool of 16 pages,
 * a 20-token prompt with 4 choices of 100 tokens (4 x 8 pages) can never
 * fit and is refused at once (503, naming the choices), while the same
 * request with n = 1 runs.
 */
static void test_engine_admission_charges_answers(void **state)
{
    (void)state;
    engine *e = choices_engine(16);
    struct answer a;
    one_answer(e, completion(20, 100, 4, 0.9f, 1), &a);
    assert_true(a.error);
    assert_int_equal(a.status, 503);
    one_answer(e, completion(20, 100, 1, 0.9f, 1), &a);
    assert_true(a.done);
    assert_int_equal(a.usage.completion_tokens, 100);
    one_answer(e, completion(20, 20, 4, 0.9f, 1), &a); /* 4 x 3 pages fit */
    assert_true(a.done);
    assert_int_equal(a.usage.completion_tokens, 80);
    engine_destroy(e);
}

/* ------------------------------------------------------------------------
 * kvd serve
 * ------------------------------------------------------------------------ */

/* The choices array of an answer, checked: n entries, index i at i. */
static json_t *choices_of(json_t *v, int n)
{
    json_t *ch = json_object_get(v, "choices");
    assert_true(json_is_array(ch));
    assert_int_equal(json_array_size(ch), (size_t)n);
    for (int i = 0; i < n; i++)
        assert_int_equal(
            json_integer_value(json_object_get(json_array_get(ch, (size_t)i), "index")), i);
    return ch;
}

static const char *text_at(json_t *ch, int i)
{
    json_t *c = json_array_get(ch, (size_t)i);
    json_t *t = json_object_get(c, "text");
    if (!t)
        t = json_object_get(json_object_get(c, "message"), "content");
    assert_true(json_is_string(t));
    return json_string_value(t);
}

/* An OpenAI completion of n choices (seed; temperature 1 or greedy). */
static json_t *complete(int port, int n, int max_tokens, int seed, bool greedy_sampling)
{
    int st;
    json_t *body = json_pack("{s:s, s:i, s:i, s:i, s:b}", "prompt", "Once upon a time there was",
                             "n", n, "max_tokens", max_tokens, "seed", seed, "ignore_eos", 1);
    if (greedy_sampling)
        json_object_set_new(body, "temperature", json_real(0.0));
    json_t *v = post(port, "/v1/completions", body, NULL, &st);
    assert_int_equal(st, 200);
    return v;
}

/*
 * /v1/completions with n = 3, not streamed: three choices indexed 0..2,
 * each max_tokens long ("length"), usage.completion_tokens their sum; the
 * same seed gives the same three texts, which differ from each other;
 * choice 0 is the n = 1 answer; greedy choices are the greedy n = 1 answer.
 * Logprobs come per choice. Chat answers n choices too.
 */
static void test_serve_n_completions(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    int port = main_server()->port;
    json_t *a = complete(port, 3, 10, 42, false), *b = complete(port, 3, 10, 42, false);
    json_t *one = complete(port, 1, 10, 42, false);
    json_t *ca = choices_of(a, 3), *cb = choices_of(b, 3);
    for (int i = 0; i < 3; i++) {
        assert_string_equal(text_at(ca, i), text_at(cb, i));
        assert_string_equal(
            json_string_value(json_object_get(json_array_get(ca, (size_t)i), "finish_reason")),
            "length");
    }
    assert_string_not_equal(text_at(ca, 0), text_at(ca, 1));
    assert_string_not_equal(text_at(ca, 1), text_at(ca, 2));
    assert_string_equal(text_at(ca, 0), text_at(choices_of(one, 1), 0));
    assert_int_equal(usage_int(a, "completion_tokens", NULL), 30);
    assert_int_equal(usage_int(a, "total_tokens", NULL), 30 + usage_int(a, "prompt_tokens", NULL));
    json_decref(a);
    json_decref(b);
    json_decref(one);

    json_t *g = complete(port, 3, 10, 1, true), *g1 = complete(port, 1, 10, 1, true);
    json_t *cg = choices_of(g, 3);
    for (int i = 0; i < 3; i++)
        assert_string_equal(text_at(cg, i), text_at(choices_of(g1, 1), 0));
    json_decref(g);
    json_decref(g1);

    int st;
    json_t *lp = post(port, "/v1/completions",
                      json_pack("{s:s, s:i, s:i, s:i, s:i, s:b}", "prompt", "Hello", "n", 2,
                                "max_tokens", 5, "seed", 3, "logprobs", 2, "ignore_eos", 1),
                      NULL, &st);
    assert_int_equal(st, 200);
    json_t *cl = choices_of(lp, 2);
    for (int i = 0; i < 2; i++) {
        json_t *l = json_object_get(json_array_get(cl, (size_t)i), "logprobs");
        assert_int_equal(json_array_size(json_object_get(l, "tokens")), 5);
        assert_int_equal(json_array_size(json_object_get(l, "text_offset")), 5);
        /* the tokens' names join to the choice's text */
        char joined[512] = "";
        for (size_t k = 0; k < 5; k++)
            strncat(joined, json_string_value(json_array_get(json_object_get(l, "tokens"), k)),
                    sizeof(joined) - strlen(joined) - 1);
        assert_string_equal(joined, text_at(cl, i));
    }
    json_decref(lp);

    json_t *chat = post(port, "/v1/chat/completions",
                        json_pack("{s:[{s:s, s:s}], s:i, s:i, s:i}", "messages", "role", "user",
                                  "content", "Hi", "n", 2, "max_tokens", 6, "seed", 9),
                        NULL, &st);
    assert_int_equal(st, 200);
    json_t *cc = choices_of(chat, 2);
    for (int i = 0; i < 2; i++)
        assert_string_equal(json_string_value(json_object_get(
                                json_object_get(json_array_get(cc, (size_t)i), "message"), "role")),
                            "assistant");
    json_decref(chat);
}

/* Stream body of an n-choice request: per choice, its text and the count
 * of its finish chunks; the usage chunk's completion_tokens (-1: none). */
struct streamed {
    char text[MAXC][512];
    int finishes[MAXC];
    int roles[MAXC];
    int usage_completion;
    bool done;
};

static void read_stream(int port, const char *path, json_t *body, int n, struct streamed *s)
{
    memset(s, 0, sizeof(*s));
    s->usage_completion = -1;
    char *b = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct resp r;
    assert_int_equal(http(port, "POST", path, NULL, b, &r), 200);
    free(b);
    json_t *evs = sse_events(r.body, &s->done);
    resp_free(&r);
    size_t i;
    json_t *ev;
    json_array_foreach(evs, i, ev)
    {
        json_t *ch = json_object_get(ev, "choices");
        if (json_array_size(ch) == 0) {
            s->usage_completion = usage_int(ev, "completion_tokens", NULL);
            continue;
        }
        assert_int_equal(json_array_size(ch), 1);
        json_t *c = json_array_get(ch, 0);
        int k = (int)json_integer_value(json_object_get(c, "index"));
        assert_true(k >= 0 && k < n);
        json_t *t = json_object_get(c, "text");
        json_t *d = json_object_get(c, "delta");
        if (d && json_object_get(d, "role"))
            s->roles[k]++;
        if (d)
            t = json_object_get(d, "content");
        if (json_is_string(t))
            strncat(s->text[k], json_string_value(t), sizeof(s->text[k]) - strlen(s->text[k]) - 1);
        if (json_is_string(json_object_get(c, "finish_reason")))
            s->finishes[k]++;
    }
    json_decref(evs);
}

/*
 * Streamed n = 3: every chunk names its choice; each choice's text equals
 * the non-streamed answer's, each has one finish chunk; the usage chunk
 * sums the choices; [DONE] last. Chat: one role chunk per choice.
 */
static void test_serve_n_stream(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    int port = main_server()->port;
    json_t *whole = complete(port, 3, 8, 77, false);
    json_t *cw = choices_of(whole, 3);
    struct streamed s;
    read_stream(port, "/v1/completions",
                json_pack("{s:s, s:i, s:i, s:i, s:b, s:b, s:{s:b}}", "prompt",
                          "Once upon a time there was", "n", 3, "max_tokens", 8, "seed", 77,
                          "ignore_eos", 1, "stream", 1, "stream_options", "include_usage", 1),
                3, &s);
    assert_true(s.done);
    for (int i = 0; i < 3; i++) {
        assert_string_equal(s.text[i], text_at(cw, i));
        assert_int_equal(s.finishes[i], 1);
    }
    assert_int_equal(s.usage_completion, 24);
    json_decref(whole);

    read_stream(port, "/v1/chat/completions",
                json_pack("{s:[{s:s, s:s}], s:i, s:i, s:i, s:b, s:b, s:{s:b}}", "messages", "role",
                          "user", "content", "Hi", "n", 2, "max_tokens", 6, "seed", 4, "ignore_eos",
                          1, "stream", 1, "stream_options", "include_usage", 1),
                2, &s);
    assert_true(s.done);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(s.roles[i], 1);
        assert_int_equal(s.finishes[i], 1);
    }
    assert_int_equal(s.usage_completion, 12);
}

/* POST body; expect 400 naming param, with `needle` in the message. */
static void expect_400(int port, const char *path, json_t *body, const char *param,
                       const char *needle)
{
    int st;
    json_t *v = post(port, path, body, NULL, &st);
    assert_int_equal(st, 400);
    json_t *e = json_object_get(v, "error");
    assert_string_equal(json_string_value(json_object_get(e, "param")), param);
    const char *msg = json_string_value(json_object_get(e, "message"));
    if (!strstr(msg, needle))
        fail_msg("'%s' not in '%s'", needle, msg);
    json_decref(v);
}

/*
 * The bounds: n in 1..[limits] max_choices; n x max_tokens within
 * [limits] max_tokens (a request naming no max_tokens gets its share);
 * best_of refused; a non-streamed answer's log-probability entries count
 * every choice.
 */
static void test_serve_n_limits(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    int port = main_server()->port; /* max_tokens 512, max_choices 8 */
    expect_400(port, "/v1/completions", json_pack("{s:s, s:i}", "prompt", "x", "n", 0), "n",
               "between");
    expect_400(port, "/v1/completions", json_pack("{s:s, s:i}", "prompt", "x", "n", 9), "n",
               "max_choices");
    expect_400(
        port, "/v1/chat/completions",
        json_pack("{s:[{s:s, s:s}], s:i}", "messages", "role", "user", "content", "x", "n", 9), "n",
        "max_choices");
    expect_400(port, "/v1/completions",
               json_pack("{s:s, s:i, s:i}", "prompt", "x", "n", 3, "max_tokens", 200), "n",
               "[limits] max_tokens");
    expect_400(port, "/v1/chat/completions",
               json_pack("{s:[{s:s, s:s}], s:i, s:i}", "messages", "role", "user", "content", "x",
                         "n", 2, "max_completion_tokens", 300),
               "n", "[limits] max_tokens");
    expect_400(port, "/v1/completions",
               json_pack("{s:s, s:i, s:i}", "prompt", "x", "n", 2, "best_of", 3), "best_of",
               "best_of");
    /* 8 x 64 tokens x (512 + 1) entries > 2^18; one choice would fit */
    expect_400(
        port, "/v1/completions",
        json_pack("{s:s, s:i, s:i, s:i}", "prompt", "x", "n", 8, "max_tokens", 64, "logprobs", 512),
        "logprobs", "choices");
    /* no max_tokens: 512 / 4 = 128 each (ignore_eos: all of them) */
    int st;
    json_t *v =
        post(port, "/v1/completions",
             json_pack("{s:s, s:i, s:b}", "prompt", "x", "n", 4, "ignore_eos", 1), NULL, &st);
    assert_int_equal(st, 200);
    assert_int_equal(usage_int(v, "completion_tokens", NULL), 4 * 128);
    json_decref(v);
}

/*
 * A client leaving mid-stream ends every choice: three sequences run while
 * it reads; when it goes, none does, and every page is back in the pool
 * (or idle in the prefix cache, which the pool takes back first).
 */
static void test_serve_n_cancel(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "limits.max_running=4", "--set", "limits.max_tokens=1000000",
        "--set", "cache.memory=4MiB",    "--set", "eviction.max_cache_tokens=128",
        "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    struct hc c;
    assert_int_equal(start_stream(&c, s.port,
                                  "{\"prompt\":\"forever and ever\",\"n\":3,\"max_tokens\":300000,"
                                  "\"ignore_eos\":true,\"stream\":true}"),
                     0);
    assert_true(su_wait_metric(s.port, "kvd_running_sequences", 3));
    assert_true(su_metric(s.port, "kvd_kv_pages_used") > 0);
    hc_close(&c);
    assert_true(su_wait_metric(s.port, "kvd_running_sequences", 0));
    assert_true(su_wait_metric(s.port, "kvd_kv_pages_used",
                               su_metric(s.port, "kvd_prefix_cache_idle_pages")));
    assert_true(su_metric(s.port, "kvd_requests_cancelled_total") >= 1);
    server_stop(&s);
}

/*
 * A choice cut short cuts the answer: an n = 3 stream running at a drain
 * whose deadline passes sees its choices end ENGINE_FINISH_ABORT one by
 * one; the stream ends with one error event (cut_short_shutdown) and
 * [DONE], and no chunk of any choice carries a finish_reason.
 */
static void test_serve_n_cut_short(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s;
    static const char *const args[] = {
        "--set", "server.drain_timeout=200ms", "--set", "limits.max_tokens=1000000",
        "--set", "cache.memory=4MiB",          "--set", "eviction.max_cache_tokens=128",
        "--set", "server.threads=1",
    };
    assert_int_equal(server_start(&s, args, (int)(sizeof(args) / sizeof(args[0]))), 0);
    struct hc c;
    assert_int_equal(start_stream(&c, s.port,
                                  "{\"prompt\":\"endless\",\"n\":3,\"max_tokens\":300000,"
                                  "\"ignore_eos\":true,\"stream\":true}"),
                     0);
    assert_true(su_wait_metric(s.port, "kvd_running_sequences", 3));
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
    assert_true(done);
    int errors = 0;
    for (size_t i = 0; i < json_array_size(evs); i++) {
        json_t *ev = json_array_get(evs, i);
        json_t *err = json_object_get(ev, "error");
        if (err) {
            errors++;
            assert_int_equal(i, json_array_size(evs) - 1);
            assert_string_equal(json_string_value(json_object_get(err, "code")),
                                "cut_short_shutdown");
        }
        json_t *ch = json_array_get(json_object_get(ev, "choices"), 0);
        assert_true(!ch || json_is_null(json_object_get(ch, "finish_reason")));
    }
    assert_int_equal(errors, 1);
    json_decref(evs);
    resp_free(&r);
    hc_close(&c);
    assert_int_equal(server_wait(&s), 0);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("choices", 13, true);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_engine_prompt_pages_once),
        cmocka_unit_test(test_engine_seeded_choices),
        cmocka_unit_test(test_engine_session_keeps_choice0),
        cmocka_unit_test(test_engine_cancel_frees_forks),
        cmocka_unit_test(test_engine_admission_charges_answers),
        cmocka_unit_test(test_serve_n_completions),
        cmocka_unit_test(test_serve_n_stream),
        cmocka_unit_test(test_serve_n_limits),
        cmocka_unit_test(test_serve_n_cancel),
        cmocka_unit_test(test_serve_n_cut_short),
    };
    return cmocka_run_group_tests_name("choices", tests, group_setup, group_teardown);
}
