/*
 * test_chat.c - POST /v1/chat/completions and /apply-template end to end:
 * `kvd serve` on the shared stories260K model with a chat template, the
 * answers checked field by field against OpenAI's shapes (plain, streamed,
 * usage, logprobs, errors), a session whose second turn prefills only what
 * is new, and a 200-turn conversation under a small budget where whole
 * turns leave, the system prompt stays and the prompt is always the
 * template's rendering of the messages kept.
 *
 * Skips with a message when ../shared (KVD_SHARED) or KVD_BIN is absent.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/serve_util.h"

static struct su_proc srv;
static char tmpl_path[600];

static const char chatml[] =
    "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor -%}{%- if add_generation_prompt -%}"
    "{{ '<|im_start|>assistant\\n' }}{%- endif -%}";

static int setup(void **state)
{
    (void)state;
    const char *bin = getenv("KVD_BIN"), *shared = getenv("KVD_SHARED");
    char model[600];
    snprintf(model, sizeof model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    if (!bin || access(model, R_OK) != 0) {
        print_message("KVD_BIN or %s absent: skipping the chat tests\n", model);
        return 0;
    }
    snprintf(tmpl_path, sizeof tmpl_path, "/tmp/kvd-test-chat-%d.jinja", (int)getpid());
    FILE *f = fopen(tmpl_path, "w");
    assert_non_null(f);
    fputs(chatml, f);
    fclose(f);
    char set_tmpl[700];
    snprintf(set_tmpl, sizeof set_tmpl, "model.chat_template=%s", tmpl_path);
    const char *args[] = {"--set", set_tmpl, "--set", "eviction.max_cache_tokens=1024",
                          "--set", "limits.max_tokens=64", "--set", "server.threads=1",
                          "--set", "cache.memory=16MiB"};
    if (su_serve(&srv, bin, model, args, (int)(sizeof args / sizeof args[0])) != 0)
        fail_msg("kvd serve did not start");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (srv.pid)
        su_stop(&srv, SIGTERM, 10);
    if (tmpl_path[0])
        unlink(tmpl_path);
    return 0;
}

#define NEED_SERVER()                                                                              \
    do {                                                                                           \
        if (!srv.pid)                                                                              \
            skip();                                                                                \
    } while (0)

static json_t *chat(json_t *body, int *status)
{
    return su_post(srv.port, "/v1/chat/completions", "Content-Type: application/json\r\n", body,
                   status);
}

static json_t *msg(const char *role, const char *content)
{
    return json_pack("{s:s,s:s}", "role", role, "content", content);
}

static void need_string(const json_t *o, const char *key)
{
    if (!json_is_string(json_object_get(o, key)))
        fail_msg("'%s' is not a string", key);
}

static void check_usage(const json_t *u)
{
    assert_true(json_is_object(u));
    int p = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
    int c = (int)json_integer_value(json_object_get(u, "completion_tokens"));
    assert_true(p > 0);
    assert_int_equal(json_integer_value(json_object_get(u, "total_tokens")), p + c);
    json_t *kvd = json_object_get(u, "kvd");
    assert_true(json_is_integer(json_object_get(kvd, "evicted_messages")));
    assert_true(json_is_integer(json_object_get(kvd, "cached_tokens")));
    assert_true(json_is_integer(json_object_get(kvd, "retained_tokens")));
}

/* Non-streamed: chat.completion, field by field. */
static void test_shape(void **state)
{
    (void)state;
    NEED_SERVER();
    int st;
    json_t *v = chat(json_pack("{s:[o,o],s:i,s:f,s:i,s:s}", "messages", msg("system", "Be brief."),
                               msg("user", "Once upon a time"), "max_tokens", 8, "temperature",
                               0.0, "seed", 7, "user", "tester"),
                     &st);
    assert_int_equal(st, 200);
    need_string(v, "id");
    assert_true(!strncmp(json_string_value(json_object_get(v, "id")), "chatcmpl-", 9));
    assert_string_equal(json_string_value(json_object_get(v, "object")), "chat.completion");
    assert_true(json_is_integer(json_object_get(v, "created")));
    need_string(v, "model");
    json_t *choices = json_object_get(v, "choices");
    assert_int_equal(json_array_size(choices), 1);
    json_t *c0 = json_array_get(choices, 0);
    assert_int_equal(json_integer_value(json_object_get(c0, "index")), 0);
    json_t *m = json_object_get(c0, "message");
    assert_string_equal(json_string_value(json_object_get(m, "role")), "assistant");
    need_string(m, "content");
    assert_true(json_is_null(json_object_get(c0, "logprobs")));
    const char *fin = json_string_value(json_object_get(c0, "finish_reason"));
    assert_true(fin && (!strcmp(fin, "stop") || !strcmp(fin, "length")));
    check_usage(json_object_get(v, "usage"));
    json_decref(v);
}

/* Streamed: chat.completion.chunk events, delta.role first, then
 * delta.content, a finish_reason, a usage chunk, [DONE]. */
static void test_stream(void **state)
{
    (void)state;
    NEED_SERVER();
    json_t *b = json_pack("{s:[o],s:i,s:f,s:b,s:{s:b}}", "messages", msg("user", "Once upon a time"),
                          "max_tokens", 6, "temperature", 0.0, "stream", 1, "stream_options",
                          "include_usage", 1);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    struct su_resp r;
    assert_int_equal(su_http(srv.port, "POST", "/v1/chat/completions", "", s, &r), 200);
    free(s);
    assert_non_null(strcasestr(r.head, "content-type: text/event-stream"));
    int n = 0, content = 0, finishes = 0, usage = 0;
    bool done = false;
    char *save = NULL;
    for (char *line = strtok_r(r.body, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (strncmp(line, "data: ", 6) != 0)
            continue;
        if (!strcmp(line + 6, "[DONE]")) {
            done = true;
            continue;
        }
        assert_false(done);
        json_t *ev = json_loads(line + 6, 0, NULL);
        assert_non_null(ev);
        assert_string_equal(json_string_value(json_object_get(ev, "object")),
                            "chat.completion.chunk");
        json_t *choices = json_object_get(ev, "choices");
        if (json_array_size(choices) == 0) { /* the usage chunk, last */
            check_usage(json_object_get(ev, "usage"));
            usage++;
            json_decref(ev);
            continue;
        }
        json_t *c0 = json_array_get(choices, 0), *delta = json_object_get(c0, "delta");
        assert_true(json_is_object(delta));
        if (n == 0) {
            assert_string_equal(json_string_value(json_object_get(delta, "role")), "assistant");
        } else {
            assert_null(json_object_get(delta, "role"));
        }
        if (json_is_string(json_object_get(delta, "content")) && n > 0)
            content++;
        if (!json_is_null(json_object_get(c0, "finish_reason"))) {
            finishes++;
            assert_int_equal(json_object_size(delta), 0);
        }
        n++;
        json_decref(ev);
    }
    su_resp_free(&r);
    assert_true(done);
    assert_int_equal(finishes, 1);
    assert_int_equal(usage, 1);
    assert_true(content >= 1);
}

/* logprobs + top_logprobs: choices[0].logprobs.content, one entry per
 * token, each with token, logprob, bytes and top_logprobs. */
static void test_logprobs(void **state)
{
    (void)state;
    NEED_SERVER();
    int st;
    json_t *v = chat(json_pack("{s:[o],s:i,s:f,s:b,s:i}", "messages", msg("user", "Once upon"),
                               "max_tokens", 4, "temperature", 0.0, "logprobs", 1, "top_logprobs",
                               3),
                     &st);
    assert_int_equal(st, 200);
    json_t *c0 = json_array_get(json_object_get(v, "choices"), 0);
    json_t *lc = json_object_get(json_object_get(c0, "logprobs"), "content");
    assert_true(json_array_size(lc) >= 1);
    size_t i;
    json_t *e;
    json_array_foreach(lc, i, e)
    {
        need_string(e, "token");
        assert_true(json_is_number(json_object_get(e, "logprob")));
        assert_true(json_is_array(json_object_get(e, "bytes")));
        json_t *top = json_object_get(e, "top_logprobs");
        assert_int_equal(json_array_size(top), 3);
        need_string(json_array_get(top, 0), "token");
        assert_true(json_is_array(json_object_get(json_array_get(top, 0), "bytes")));
    }
    json_decref(v);
}

static void expect_error(json_t *body, int status, const char *param, const char *text)
{
    int st;
    char *s = json_dumps(body, JSON_COMPACT);
    json_t *v = chat(body, &st);
    if (st != status)
        fail_msg("%s: status %d, want %d", s, st, status);
    json_t *err = json_object_get(v, "error");
    need_string(err, "message");
    need_string(err, "type");
    if (param)
        assert_string_equal(json_string_value(json_object_get(err, "param")), param);
    if (!strstr(json_string_value(json_object_get(err, "message")), text))
        fail_msg("%s: message '%s' lacks '%s'", s, json_string_value(json_object_get(err, "message")),
                 text);
    free(s);
    json_decref(v);
}

static void test_errors(void **state)
{
    (void)state;
    NEED_SERVER();
    expect_error(json_pack("{s:[o],s:i}", "messages", msg("user", "x"), "n", 1000), 400, "n",
                 "[limits] max_choices");
    expect_error(json_pack("{s:i}", "max_tokens", 3), 400, "messages", "'messages' is required");
    expect_error(json_pack("{s:[]}", "messages"), 400, "messages", "non-empty array");
    expect_error(json_pack("{s:[o]}", "messages", msg("wizard", "x")), 400, "messages",
                 "messages[0] needs a \"role\"");
    expect_error(json_pack("{s:[{s:s,s:[{s:s,s:{}}]}]}", "messages", "role", "user", "content",
                           "type", "image_url", "image_url"),
                 400, "messages", "only parts");
    expect_error(json_pack("{s:[o],s:i}", "messages", msg("user", "x"), "top_logprobs", 2), 400,
                 "top_logprobs", "needs 'logprobs': true");
    expect_error(json_pack("{s:[o],s:s}", "messages", msg("user", "x"), "tools", "none"), 400,
                 "tools", "'tools' must be an array");
    expect_error(json_pack("{s:[o],s:i}", "messages", msg("user", "x"), "max_completion_tokens",
                           100000),
                 400, "max_completion_tokens", "exceeds the limit");
    expect_error(json_pack("{s:[o],s:i}", "messages", msg("user", "x"), "stream", 3), 400, "stream",
                 "");
    /* a conversation whose pinned part cannot fit even with the last user
     * message's text cut away (here a huge system prompt; a huge user turn
     * alone is cut: test_huge_turn_cut) */
    char big[12000];
    memset(big, 'a', sizeof big - 1);
    for (size_t i = 0; i + 1 < sizeof big; i += 2)
        big[i] = ' ';
    big[sizeof big - 1] = 0;
    expect_error(json_pack("{s:[o,o]}", "messages", msg("system", big), msg("user", "hi")), 400,
                 "messages", "without the last user message's text");
}

static void test_apply_template(void **state)
{
    (void)state;
    NEED_SERVER();
    int st;
    json_t *v = su_post(srv.port, "/apply-template", "",
                        json_pack("{s:[o,o]}", "messages", msg("system", "S"), msg("user", "U")),
                        &st);
    assert_int_equal(st, 200);
    assert_string_equal(json_string_value(json_object_get(v, "prompt")),
                        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
                        "<|im_start|>assistant\n");
    json_decref(v);
    v = su_post(srv.port, "/apply-template", "",
                json_pack("{s:[o],s:b}", "messages", msg("user", "U"), "add_generation_prompt", 0),
                &st);
    assert_string_equal(json_string_value(json_object_get(v, "prompt")),
                        "<|im_start|>user\nU<|im_end|>\n");
    json_decref(v);
    v = su_post(srv.port, "/apply-template", "", json_pack("{s:s}", "messages", "x"), &st);
    assert_int_equal(st, 400);
    json_decref(v);
}

/* Two turns through one session: the second prefills only the new turn;
 * a client that rewrites the last assistant answer keeps the prefix
 * before it. */
static void test_session(void **state)
{
    (void)state;
    NEED_SERVER();
    int st;
    json_t *msgs = json_pack("[o,o]", msg("system", "You tell stories."), msg("user", "Once upon"));
    json_t *v = chat(json_pack("{s:O,s:i,s:f,s:s}", "messages", msgs, "max_tokens", 8,
                               "temperature", 0.0, "session", "chat-s1"),
                     &st);
    assert_int_equal(st, 200);
    json_t *u1 = json_object_get(v, "usage");
    int p1 = (int)json_integer_value(json_object_get(u1, "prompt_tokens"));
    int c1 = (int)json_integer_value(json_object_get(u1, "completion_tokens"));
    const char *answer =
        json_string_value(json_object_get(json_object_get(
            json_array_get(json_object_get(v, "choices"), 0), "message"), "content"));
    json_array_append_new(msgs, msg("assistant", answer));
    json_array_append_new(msgs, msg("user", "Then what?"));
    json_decref(v);
    v = chat(json_pack("{s:O,s:i,s:f,s:s}", "messages", msgs, "max_tokens", 8, "temperature", 0.0,
                       "session", "chat-s1"),
             &st);
    assert_int_equal(st, 200);
    json_t *u2 = json_object_get(v, "usage");
    int p2 = (int)json_integer_value(json_object_get(u2, "prompt_tokens"));
    int cached2 = (int)json_integer_value(json_object_get(json_object_get(u2, "kvd"), "cached_tokens"));
    /* everything the first request saw (prompt and the fed answer) was reused */
    if (cached2 < p1 + c1 - 2 || cached2 >= p2)
        fail_msg("second turn: cached %d of %d prompt tokens; the first had %d + %d", cached2, p2,
                 p1, c1);
    json_decref(v);
    /* the client rewrote the answer: the system and first user turn stay cached */
    json_array_set_new(msgs, 2, msg("assistant", "A different answer."));
    v = chat(json_pack("{s:O,s:i,s:f,s:s}", "messages", msgs, "max_tokens", 4, "temperature", 0.0,
                       "session", "chat-s1"),
             &st);
    assert_int_equal(st, 200);
    int cached3 = (int)json_integer_value(
        json_object_get(json_object_get(json_object_get(v, "usage"), "kvd"), "cached_tokens"));
    if (cached3 < p1 - 4)
        fail_msg("after a rewritten answer only %d tokens were reused (the prefix has ~%d)",
                 cached3, p1);
    json_decref(v);
    json_decref(msgs);
}

/* A gauge's value from /metrics (-1 when absent). */
static double metric(const char *name)
{
    struct su_resp r;
    double v = -1;
    if (su_http(srv.port, "GET", "/metrics", NULL, NULL, &r) == 200) {
        char key[128];
        snprintf(key, sizeof key, "\n%s ", name);
        const char *m = strstr(r.body, key);
        if (m)
            v = atof(m + strlen(key));
    }
    su_resp_free(&r);
    return v;
}

/* Tokens of the template's rendering of msgs (with the generation prompt). */
static int rendered_tokens(json_t *msgs)
{
    int st;
    json_t *v = su_post(srv.port, "/apply-template", "", json_pack("{s:O}", "messages", msgs), &st);
    assert_int_equal(st, 200);
    json_t *t = su_post(srv.port, "/tokenize", "",
                        json_pack("{s:O,s:b}", "content", json_object_get(v, "prompt"),
                                  "add_special", 1),
                        &st);
    assert_int_equal(st, 200);
    int n = (int)json_array_size(json_object_get(t, "tokens"));
    json_decref(t);
    json_decref(v);
    return n;
}

/*
 * 200 turns through one session with a 1024-token budget: whole turns
 * leave the cache in place (turn_eviction "in_place"), the system prompt
 * stays, no request re-prefills what the session had cached (each one's
 * cached tokens cover the whole previous request), and what the session
 * retains is the template's rendering of the messages kept plus the
 * answer fed so far.
 */
static void test_long_chat(void **state)
{
    (void)state;
    NEED_SERVER();
    const char *sys = "You are a storyteller. Keep every answer short.";
    json_t *msgs = json_pack("[o]", msg("system", sys));
    int last_evicted = 0, steps = 0, max_retained = 0, reprefills = 0, prev_prompt = 0;
    for (int turn = 0; turn < 200; turn++) {
        char q[64];
        snprintf(q, sizeof q, "Tell me part %d of the story.", turn);
        json_array_append_new(msgs, msg("user", q));
        int st;
        json_t *v = chat(json_pack("{s:O,s:i,s:f,s:s}", "messages", msgs, "max_tokens", 12,
                                   "temperature", 0.0, "session", "chat-long"),
                         &st);
        if (st != 200)
            fail_msg("turn %d: status %d", turn, st);
        json_t *u = json_object_get(v, "usage"), *kvd = json_object_get(u, "kvd");
        int evicted = (int)json_integer_value(json_object_get(kvd, "evicted_messages"));
        int prompt = (int)json_integer_value(json_object_get(u, "prompt_tokens"));
        int cached = (int)json_integer_value(json_object_get(kvd, "cached_tokens"));
        int retained = (int)json_integer_value(json_object_get(kvd, "retained_tokens"));
        int completion = (int)json_integer_value(json_object_get(u, "completion_tokens"));
        const char *how = json_string_value(json_object_get(kvd, "turn_eviction"));
        if (!how || strcmp(how, "in_place"))
            fail_msg("turn %d: turn_eviction %s (%s)", turn, how ? how : "absent",
                     json_string_value(json_object_get(kvd, "turn_eviction_fallback")));
        assert_true(evicted >= last_evicted);
        assert_true(evicted % 2 == 0); /* user + assistant: whole turns */
        if (evicted > last_evicted)
            steps++;
        if (cached < prev_prompt) /* the session's cache was not reused whole */
            reprefills++;
        prev_prompt = prompt;
        last_evicted = evicted;
        if (retained > max_retained)
            max_retained = retained;
        /* the cache holds the rendering of: the system prompt + the turns
         * kept, then the answer's tokens fed (all but the last sampled) */
        if (turn % 25 == 24 || turn == 199) {
            json_t *kept = json_pack("[o]", msg("system", sys));
            for (size_t i = 1 + (size_t)evicted; i < json_array_size(msgs); i++)
                json_array_append(kept, json_array_get(msgs, i));
            int want = rendered_tokens(kept) + completion - 1;
            if (want != retained)
                fail_msg("turn %d: %d tokens retained; the rendering of the %zu kept messages "
                         "and the answer fed make %d",
                         turn, retained, json_array_size(kept), want);
            json_decref(kept);
        }
        const char *answer =
            json_string_value(json_object_get(json_object_get(
                json_array_get(json_object_get(v, "choices"), 0), "message"), "content"));
        json_array_append_new(msgs, msg("assistant", answer));
        json_decref(v);
        if (turn % 50 == 49) /* memory stays flat: printed, not asserted */
            print_message("turn %3d: conversation %zu messages, %d evicted; KV pages used %.0f; "
                          "RSS %.1f MiB\n",
                          turn + 1, json_array_size(msgs), evicted, metric("kvd_kv_pages_used"),
                          metric("process_resident_memory_bytes") / 1048576.0);
    }
    print_message("200 turns: %d messages evicted in place in %d steps; %d re-prefills; at "
                  "most %d tokens cached (budget 1024)\n",
                  last_evicted, steps, reprefills, max_retained);
    assert_true(last_evicted > 300);
    assert_true(max_retained <= 1024);
    assert_int_equal(reprefills, 0);
    json_decref(msgs);
    /* the metric counted them */
    double in_place = metric("kvd_chat_evicted_messages_total{how=\"in_place\"}");
    assert_true(in_place >= last_evicted);
}

/*
 * A last user turn larger than the whole window is cut from its middle:
 * the prompt is exactly the budget (max_cache_tokens less max_tokens), the
 * tokens cut are reported, and the answer is a normal one.
 */
static void test_huge_turn_cut(void **state)
{
    (void)state;
    NEED_SERVER();
    char big[12000] = "";
    for (int i = 0; i < 300; i++)
        strcat(big, "a cat sat. ");
    json_t *msgs = json_pack("[o,o]", msg("system", "You are a storyteller."), msg("user", big));
    int full = rendered_tokens(msgs);
    assert_true(full > 1024);
    int st;
    json_t *v = chat(json_pack("{s:O,s:i,s:f}", "messages", msgs, "max_tokens", 12,
                               "temperature", 0.0),
                     &st);
    assert_int_equal(st, 200);
    json_t *u = json_object_get(v, "usage"), *kvd = json_object_get(u, "kvd");
    assert_int_equal(json_integer_value(json_object_get(u, "prompt_tokens")), 1024 - 12);
    int cut = (int)json_integer_value(json_object_get(kvd, "cut_tokens"));
    /* the pieces are tokenized apart (header, text, end), so the count may
     * differ from the whole rendering's by a token at each edge */
    assert_true(cut >= full - (1024 - 12) - 2 && cut <= full - (1024 - 12) + 2);
    json_decref(v);
    json_decref(msgs);
}

/*
 * A template that folds the system prompt into the first user turn cannot
 * drop turns in place: a session falls back to rendering again, loudly
 * (usage names why; the fallback metric counts it), and still answers.
 */
static void test_turn_fallback(void **state)
{
    (void)state;
    NEED_SERVER();
    static const char folded[] =
        "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- if loop.index0 == 1 -%}"
        "{{ '[INST] <<SYS>>' + messages[0]['content'] + '<</SYS>> ' + m['content'] + "
        "' [/INST]' }}{%- else -%}{{ '[INST] ' + m['content'] + ' [/INST]' }}{%- endif -%}"
        "{%- elif m['role'] == 'assistant' -%}{{ ' ' + m['content'] + ' </s>' }}{%- endif -%}"
        "{%- endfor -%}";
    char path[600], model[600], set_tmpl[700];
    snprintf(path, sizeof path, "/tmp/kvd-test-chat-fold-%d.jinja", (int)getpid());
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(folded, f);
    fclose(f);
    const char *shared = getenv("KVD_SHARED");
    snprintf(model, sizeof model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    snprintf(set_tmpl, sizeof set_tmpl, "model.chat_template=%s", path);
    const char *args[] = {"--set", set_tmpl, "--set", "eviction.max_cache_tokens=256",
                          "--set", "server.threads=1", "--set", "cache.memory=4MiB",
                          "--set", "limits.max_tokens=16"};
    struct su_proc fb;
    memset(&fb, 0, sizeof fb);
    assert_int_equal(su_serve(&fb, getenv("KVD_BIN"), model, args,
                              (int)(sizeof args / sizeof args[0])),
                     0);
    json_t *msgs = json_pack("[o]", msg("system", "You are a storyteller."));
    for (int i = 0; i < 3; i++) {
        json_array_append_new(msgs, msg("user", "Tell me more of the story, please."));
        json_array_append_new(msgs, msg("assistant", "Once upon a time there was a cat."));
    }
    json_array_append_new(msgs, msg("user", "And then?"));
    int st;
    json_t *v = su_post(fb.port, "/v1/chat/completions", "",
                        json_pack("{s:O,s:i,s:f,s:s}", "messages", msgs, "max_tokens", 4,
                                  "temperature", 0.0, "session", "fold"),
                        &st);
    assert_int_equal(st, 200);
    json_t *kvd = json_object_get(json_object_get(v, "usage"), "kvd");
    assert_string_equal(json_string_value(json_object_get(kvd, "turn_eviction")), "rerender");
    const char *why = json_string_value(json_object_get(kvd, "turn_eviction_fallback"));
    assert_non_null(why);
    assert_non_null(strstr(why, "system"));
    json_decref(v);
    struct su_resp r;
    assert_int_equal(su_http(fb.port, "GET", "/metrics", NULL, NULL, &r), 200);
    const char *m = strstr(r.body, "\nkvd_chat_turn_fallbacks_total ");
    assert_non_null(m);
    assert_int_equal(atoi(m + strlen("\nkvd_chat_turn_fallbacks_total ")), 1);
    su_resp_free(&r);
    json_decref(msgs);
    su_stop(&fb, SIGTERM, 10);
    unlink(path);
}

/* An operator's template that cannot be rendered stops kvd serve at start,
 * with the file, line and column. */
static void test_bad_template_refused(void **state)
{
    (void)state;
    NEED_SERVER();
    char bad[600], cmd[2000], model[600];
    const char *shared = getenv("KVD_SHARED");
    snprintf(model, sizeof model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    snprintf(bad, sizeof bad, "/tmp/kvd-test-chat-bad-%d.jinja", (int)getpid());
    FILE *f = fopen(bad, "w");
    assert_non_null(f);
    fputs("{% for m in messages %}\n{{ m.content | nope }}{% endfor %}", f);
    fclose(f);
    snprintf(cmd, sizeof cmd,
             "%s serve --model %s --listen 127.0.0.1:0 --set model.chat_template=%s 2>&1",
             getenv("KVD_BIN"), model, bad);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char out[4096];
    size_t n = fread(out, 1, sizeof out - 1, p);
    out[n] = 0;
    int st = pclose(p);
    unlink(bad);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    if (!strstr(out, "[model] chat_template: chat template (") ||
        !strstr(out, "2:16: unsupported filter 'nope'"))
        fail_msg("output: %s", out);
}

/* [eviction] unit = token: the conversation is rendered whole and the
 * policy (sink-window) evicts tokens; no message is left out. */
static void test_unit_token(void **state)
{
    (void)state;
    NEED_SERVER();
    char model[600], set_tmpl[700];
    const char *shared = getenv("KVD_SHARED");
    snprintf(model, sizeof model, "%s/models/stories260K.gguf", shared ? shared : "../shared");
    snprintf(set_tmpl, sizeof set_tmpl, "model.chat_template=%s", tmpl_path);
    const char *args[] = {"--set", set_tmpl, "--set", "eviction.max_cache_tokens=128",
                          "--set", "eviction.unit=token", "--set", "server.threads=1",
                          "--set", "cache.memory=4MiB", "--set", "limits.max_tokens=16"};
    struct su_proc tok;
    memset(&tok, 0, sizeof tok);
    assert_int_equal(su_serve(&tok, getenv("KVD_BIN"), model, args,
                              (int)(sizeof args / sizeof args[0])),
                     0);
    json_t *msgs = json_pack("[o]", msg("system", "You are a storyteller."));
    for (int i = 0; i < 12; i++) {
        json_array_append_new(msgs, msg("user", "Tell me more of the story, please."));
        json_array_append_new(msgs, msg("assistant", "Once upon a time there was a cat."));
    }
    json_array_append_new(msgs, msg("user", "And then?"));
    int st;
    json_t *v = su_post(tok.port, "/v1/chat/completions", "",
                        json_pack("{s:O,s:i,s:f}", "messages", msgs, "max_tokens", 4,
                                  "temperature", 0.0),
                        &st);
    assert_int_equal(st, 200);
    json_t *kvd = json_object_get(json_object_get(v, "usage"), "kvd");
    assert_int_equal(json_integer_value(json_object_get(kvd, "evicted_messages")), 0);
    assert_true(json_integer_value(json_object_get(kvd, "evicted_tokens")) > 0);
    assert_true(json_integer_value(json_object_get(kvd, "retained_tokens")) <= 128);
    json_decref(v);
    json_decref(msgs);
    su_stop(&tok, SIGTERM, 10);
}

/* Run cmd (a shell command line), its stdout into out (NUL-terminated,
 * truncated to n - 1 bytes); returns its exit status or -1. */
static int run(const char *cmd, char *out, size_t n)
{
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t k = fread(out, 1, n - 1, p);
    out[k] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/*
 * Done means: the Node `openai` client, unchanged, plain and streaming,
 * against kvd serve with a template set by config. npm installs the client
 * into a scratch directory; without node, npm or the registry the test
 * says so and skips.
 */
static void test_openai_node(void **state)
{
    (void)state;
    NEED_SERVER();
    if (!su_on_path("node") || !su_on_path("npm")) {
        print_message("node or npm not on PATH: skipping the openai client test\n");
        skip();
    }
    char dir[] = "/tmp/kvd-test-npm-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char cmd[2048], out[16384];
    snprintf(cmd, sizeof cmd,
             "timeout 240 npm install --prefix %s openai --no-audit --no-fund --loglevel=error "
             ">/dev/null 2>&1",
             dir);
    if (run(cmd, out, sizeof out) != 0) {
        su_remove_dir(dir);
        print_message("npm could not install 'openai' (offline?): skipping the client test\n");
        skip();
    }
    snprintf(cmd, sizeof cmd,
             "NODE_PATH=%s/node_modules timeout 60 node tests/cases/chat/openai_client.cjs "
             "http://127.0.0.1:%d/v1 2>&1",
             dir, srv.port);
    int st = run(cmd, out, sizeof out);
    snprintf(cmd, sizeof cmd, "%s/node_modules/openai/package.json", dir);
    json_t *pkg = json_load_file(cmd, 0, NULL);
    print_message("openai %s (npm): %s\n", json_string_value(json_object_get(pkg, "version")), out);
    json_decref(pkg);
    su_remove_dir(dir);
    if (st != 0)
        fail_msg("the openai client failed: %s", out);
    json_t *v = json_loads(out, 0, NULL);
    assert_non_null(v);
    json_t *plain = json_object_get(v, "plain"), *stream = json_object_get(v, "stream");
    assert_string_equal(json_string_value(json_object_get(plain, "object")), "chat.completion");
    assert_string_equal(json_string_value(json_object_get(plain, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(stream, "role")), "assistant");
    const char *a = json_string_value(json_object_get(plain, "content")),
               *b = json_string_value(json_object_get(stream, "content"));
    assert_non_null(a);
    assert_non_null(b);
    assert_true(strlen(a) > 0);
    assert_string_equal(a, b); /* temperature 0: the same answer, streamed */
    assert_string_equal(json_string_value(json_object_get(plain, "finish")),
                        json_string_value(json_object_get(stream, "finish")));
    assert_true(json_integer_value(
                    json_object_get(json_object_get(plain, "usage"), "prompt_tokens")) > 0);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(stream, "usage"), "completion_tokens")),
        json_integer_value(json_object_get(json_object_get(plain, "usage"), "completion_tokens")));
    json_decref(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape),          cmocka_unit_test(test_stream),
        cmocka_unit_test(test_logprobs),       cmocka_unit_test(test_errors),
        cmocka_unit_test(test_apply_template), cmocka_unit_test(test_session),
        cmocka_unit_test(test_long_chat),      cmocka_unit_test(test_huge_turn_cut),
        cmocka_unit_test(test_turn_fallback),  cmocka_unit_test(test_bad_template_refused),
        cmocka_unit_test(test_unit_token),     cmocka_unit_test(test_openai_node),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
