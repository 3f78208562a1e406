/*
 * test_api.c - the API room: its decoders called directly (no model, no
 * connection: what a fuzzer does), and, end to end against the real
 * binary ($KVD_BIN), what keeps the loop thread free: a huge prompt
 * refused by its byte length before it is tokenized, tokenizing done off
 * the loop thread and stopped at the token limit, and a client that
 * leaves while its prompt is being prepared.
 *
 * No assertion is on wall-clock time: liveness is shown by order (a
 * /health sent while a big request is being prepared is answered before
 * that request), with generous deadlines.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <poll.h>

#include "server/api_decode.h"
#include "tests/proc_ticks.h"
#include "tests/serve_fixture.h"

/* {"prompt": "hello world hello world ..."} of about `bytes` bytes (new). */
static char *big_prompt_body(const char *key, size_t bytes)
{
    static const char word[] = "hello world ";
    size_t n = bytes / (sizeof(word) - 1);
    char *s = malloc(n * (sizeof(word) - 1) + 64);
    size_t o = (size_t)sprintf(s, "{\"%s\":\"", key);
    for (size_t i = 0; i < n; i++, o += sizeof(word) - 1)
        memcpy(s + o, word, sizeof(word) - 1);
    strcpy(s + o, "\"}");
    return s;
}

/* Whether the connection has bytes (or its end) to read right now. */
static bool readable_now(const struct hc *c)
{
    if (c->off < c->len)
        return true;
    struct pollfd pfd = {c->fd, POLLIN, 0};
    return poll(&pfd, 1, 0) > 0;
}

/* ------------------------------------------------------------------------
 * Decoders, without a model
 * ------------------------------------------------------------------------ */

static const struct srv_api_limits limits = {
    .n_vocab = 512,
    .max_prompt_tokens = 1000,
    .max_tokens = 256,
    .default_max_tokens = 16,
    .max_session_id = 64,
    .policy = {.kind = KV_EVICT_NONE, .max_cache_tokens = 2000},
    .max_token_bytes = 10,
    .seed = 42,
};

static int decode(enum srv_api_shape shape, const char *json, struct srv_completion *c,
                  struct srv_api_error *e)
{
    memset(e, 0, sizeof(*e));
    json_t *body = srv_decode_body(json, strlen(json), e);
    if (!body)
        return -1;
    srv_completion_decoder *d = shape == SRV_SHAPE_LLAMA  ? srv_decode_llama
                                : shape == SRV_SHAPE_CHAT ? srv_decode_chat
                                                          : srv_decode_openai;
    int rc = d(&limits, body, NULL, c, e);
    json_decref(body);
    return rc;
}

static void test_decoders(void **state)
{
    (void)state;
    struct srv_completion c;
    struct srv_api_error e;

    /* llama.cpp's mixed prompt: parts in order, BOS only on the first text */
    assert_int_equal(decode(SRV_SHAPE_LLAMA, "{\"prompt\":[\"a\",1,2,\"b\",3],\"n_predict\":5}",
                            &c, &e),
                     0);
    assert_int_equal(c.prompt.n_parts, 4);
    assert_true(c.prompt.parts[0].text && c.prompt.parts[0].bos);
    assert_int_equal(c.prompt.parts[1].n_ids, 2);
    assert_true(c.prompt.parts[2].text && !c.prompt.parts[2].bos);
    assert_int_equal(c.prompt.n_ids, 3);
    assert_int_equal(c.req->max_tokens, 5);
    assert_int_equal(c.req->sampling.seed, 42);
    assert_non_null(c.settings);
    srv_completion_clear(&c);

    /* the first problem is reported, with its field */
    assert_int_equal(decode(SRV_SHAPE_OPENAI, "{\"prompt\":[1,600]}", &c, &e), -1);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.param, "prompt");
    assert_string_equal(e.code, "invalid_token");
    assert_null(c.req);
    assert_int_equal(decode(SRV_SHAPE_OPENAI, "{\"prompt\":\"x\",\"max_tokens\":999}", &c, &e),
                     -1);
    assert_string_equal(e.param, "max_tokens");
    assert_int_equal(decode(SRV_SHAPE_OPENAI, "[1]", &c, &e), -1);
    assert_string_equal(e.code, "invalid_json");

    /* the byte bound: 10,001 bytes make at least 1,001 tokens > 1,000 */
    char *big = big_prompt_body("prompt", 10008);
    assert_int_equal(decode(SRV_SHAPE_OPENAI, big, &c, &e), -1);
    assert_string_equal(e.code, "context_length_exceeded");
    assert_non_null(strstr(e.msg, "at least 1001 tokens"));
    free(big);
    big = big_prompt_body("prompt", 9996); /* within the bound: left to the tokenizer */
    assert_int_equal(decode(SRV_SHAPE_OPENAI, big, &c, &e), 0);
    srv_completion_clear(&c);
    free(big);

    /* chat: no template loaded is the server's fault (500) */
    struct srv_api_limits nochat = limits;
    nochat.chat_unavailable = "no template";
    json_t *body = json_pack("{s:[{s:s, s:s}]}", "messages", "role", "user", "content", "hi");
    memset(&e, 0, sizeof(e));
    assert_int_equal(srv_decode_chat(&nochat, body, NULL, &c, &e), -1);
    assert_int_equal(e.status, 500);
    memset(&e, 0, sizeof(e));
    assert_int_equal(srv_decode_chat(&limits, body, "sess-1", &c, &e), 0);
    assert_string_equal(c.req->session, "sess-1");
    assert_int_equal(json_array_size(c.messages), 1);
    srv_completion_clear(&c);
    json_decref(body);

    /* the small routes */
    struct srv_detokenize_req d;
    body = json_loads("{\"tokens\":[1,2,3]}", 0, NULL);
    memset(&e, 0, sizeof(e));
    assert_int_equal(srv_decode_detokenize(&limits, body, &d, &e), 0);
    assert_int_equal(d.n, 3);
    srv_detokenize_req_clear(&d);
    json_decref(body);
    memset(&e, 0, sizeof(e));
    assert_int_equal(srv_decode_session_path(&limits, "a b", NULL, &e), -1);
    assert_int_equal(e.status, 400);
}

/* ------------------------------------------------------------------------
 * Live
 * ------------------------------------------------------------------------ */

/*
 * An 8 MiB prompt is refused by its byte length, untokenized (the message
 * says "at least"), and a /health sent while its body is still arriving is
 * answered before it.
 */
static void test_huge_prompt_refused_untokenized(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "limits.max_body_bytes=9MiB"};
    struct su_proc p = {0};
    serve(&p, "huge", args, 2);
    char *body = big_prompt_body("prompt", 8u << 20);
    size_t len = strlen(body), half = len / 2;
    struct hc a;
    assert_int_equal(hc_open(&a, p.port), 0);
    char head[256];
    int n = snprintf(head, sizeof(head),
                     "POST /v1/completions HTTP/1.1\r\nHost: kvd\r\nContent-Type: "
                     "application/json\r\nContent-Length: %zu\r\n\r\n",
                     len);
    assert_int_equal(hc_send(&a, head, (size_t)n), 0);
    assert_int_equal(hc_send(&a, body, half), 0);
    assert_int_equal(http_status_simple(p.port, "/health"), 200);
    assert_false(readable_now(&a));
    assert_int_equal(hc_send(&a, body + half, len - half), 0);
    struct resp r;
    assert_int_equal(hc_read(&a, &r), 0);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "context_length_exceeded"));
    assert_non_null(strstr(r.body, "at least"));
    assert_non_null(strstr(r.body, "(max_prompt_tokens) is"));
    resp_free(&r);
    hc_close(&a);
    free(body);
    server_stop(&p);
}

/*
 * A prompt within the byte bound but over the token limit is tokenized
 * off the loop thread, up to the limit: while its job runs (the
 * kvd_api_jobs gauge says so, which a blocked loop could not answer), a
 * /health is answered before the big request, whose refusal names the
 * limit + 1.
 */
static void test_tokenizing_off_loop(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* 8 MiB of "hello world " at most 10 bytes a token: at least 838,861
     * tokens by the bound, under 2,000,000; it has about 4,194,304 */
    static const char *const args[] = {"--set", "limits.max_prompt_tokens=2000000", "--set",
                                       "limits.max_body_bytes=9MiB"};
    struct su_proc p = {0};
    serve(&p, "tokenize", args, 4);
    char *body = big_prompt_body("prompt", 8u << 20);
    struct hc a;
    assert_int_equal(hc_open(&a, p.port), 0);
    assert_int_equal(hc_request(&a, "POST", "/v1/completions", NULL, body), 0);
    double deadline = su_now() + 60;
    while (su_metric(p.port, "kvd_api_jobs") < 1 && !readable_now(&a) && su_now() < deadline)
        su_sleep_ms(5);
    assert_false(readable_now(&a)); /* answered before its job was seen running */
    struct resp r;
    assert_int_equal(http(p.port, "GET", "/health", NULL, NULL, &r), 200);
    bool early = readable_now(&a);
    /* /health names the CPU kernels in use (cpu/cpu.h) */
    json_t *h = json_loads(r.body, 0, NULL);
    assert_non_null(h);
    const char *level = json_string_value(json_object_get(json_object_get(h, "kernels"), "level"));
    assert_non_null(level);
    assert_true(!strcmp(level, "scalar") || !strcmp(level, "avx2") || !strcmp(level, "avx512"));
    assert_non_null(json_string_value(json_object_get(json_object_get(h, "kernels"), "matmul")));
    resp_free(&r);
    /* so does /v1/models, the same object */
    assert_int_equal(http(p.port, "GET", "/v1/models", NULL, NULL, &r), 200);
    json_t *models = json_loads(r.body, 0, NULL);
    json_t *meta = json_object_get(json_array_get(json_object_get(models, "data"), 0), "meta");
    assert_true(json_equal(json_object_get(meta, "kernels"), json_object_get(h, "kernels")));
    json_decref(models);
    json_decref(h);
    resp_free(&r);
    if (early)
        print_message("the big request was answered before /health\n");
    assert_false(early);
    assert_int_equal(hc_read(&a, &r), 0);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "at least 2000001 tokens"));
    resp_free(&r);
    hc_close(&a);
    free(body);
    assert_true(su_metric(p.port, "kvd_api_jobs") == 0);
    server_stop(&p);
}

/*
 * Clients that leave while their prompt (or /tokenize text) is being
 * prepared: nothing is answered to them, nothing leaks (the ASan build
 * exits non-zero on a leak), and the server goes on serving.
 */
static void test_client_leaves_during_prepare(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "limits.max_prompt_tokens=300000"};
    struct su_proc p = {0};
    serve(&p, "leave", args, 2);
    char *prompt = big_prompt_body("prompt", 1u << 20);
    char *content = big_prompt_body("content", 1u << 20);
    for (int i = 0; i < 4; i++) {
        struct hc a;
        assert_int_equal(hc_open(&a, p.port), 0);
        assert_int_equal(hc_request(&a, "POST", i % 2 ? "/tokenize" : "/v1/completions", NULL,
                                    i % 2 ? content : prompt),
                         0);
        hc_close(&a);
    }
    assert_int_equal(http_status_simple(p.port, "/health"), 200);
    int status = 0;
    json_t *v = su_post(p.port, "/v1/completions", NULL,
                        json_pack("{s:s, s:i}", "prompt", "Once", "max_tokens", 4), &status);
    assert_int_equal(status, 200);
    json_decref(v);
    free(prompt);
    free(content);
    server_stop(&p);
}

/*
 * Non-streamed answers with as many log-probabilities as allowed (512
 * tokens x 512 entries = the cap, 262,144), in all three shapes: each is
 * whole and parses, and afterwards the server's memory is back near where
 * it was before the first (the entries are kept as text as they come,
 * never as one JSON tree; issue 14 defect 1: with the tree, RSS stayed
 * about 200 MiB higher).
 */
static void test_logprob_answers_memory(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "server.threads=1"};
    struct su_proc p = {0};
    serve(&p, "lp", args, 2);
    static const struct {
        const char *path, *body, *key;
    } req[] = {
        {"/completion",
         "{\"prompt\":\"Once\",\"n_predict\":512,\"n_probs\":511,\"ignore_eos\":true}",
         "completion_probabilities"},
        {"/v1/completions",
         "{\"prompt\":\"Once\",\"max_tokens\":512,\"logprobs\":511,\"ignore_eos\":true}",
         "choices"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"Once\"}],\"max_tokens\":512,"
         "\"logprobs\":true,\"top_logprobs\":511,\"ignore_eos\":true}",
         "choices"},
    };
    /* The baseline: the server warmed up by a small answer in each shape. */
    static const struct {
        const char *body;
    } small[] = {
        {"{\"prompt\":\"Once\",\"n_predict\":4,\"n_probs\":2}"},
        {"{\"prompt\":\"Once\",\"max_tokens\":4,\"logprobs\":2}"},
        {"{\"messages\":[{\"role\":\"user\",\"content\":\"Once\"}],\"max_tokens\":4,"
         "\"logprobs\":true,\"top_logprobs\":2}"},
    };
    for (int k = 0; k < 3; k++) {
        struct su_resp r;
        assert_int_equal(su_http(p.port, "POST", req[k].path, NULL, small[k].body, &r), 200);
        su_resp_free(&r);
    }
    long rss0 = su_rss_kb(p.pid);
    for (int round = 0; round < 3; round++) {
        for (int k = 0; k < 3; k++) {
            struct resp r; /* http_client.h: a 60 s timeout, for ASan on a busy machine */
            assert_int_equal(http(p.port, "POST", req[k].path, NULL, req[k].body, &r), 200);
            /* a byte token's text may hold U+0000 */
            json_t *v = json_loads(r.body, JSON_ALLOW_NUL, NULL);
            resp_free(&r);
            assert_non_null(v);
            json_t *lp = json_object_get(v, req[k].key);
            if (k == 0) {
                assert_int_equal(json_array_size(lp), 512);
                assert_int_equal(json_array_size(json_object_get(json_array_get(lp, 511),
                                                                 "top_logprobs")),
                                 511);
            } else {
                lp = json_object_get(json_array_get(lp, 0), "logprobs");
                json_t *arr = k == 1 ? json_object_get(lp, "token_logprobs")
                                     : json_object_get(lp, "content");
                assert_int_equal(json_array_size(arr), 512);
                if (k == 1)
                    assert_int_equal(json_array_size(json_object_get(lp, "text_offset")), 512);
            }
            json_decref(v);
        }
    }
    long rss1 = su_rss_kb(p.pid);
    print_message("RSS before %ld KiB, after three rounds %ld KiB\n", rss0, rss1);
    /* Under ASan freed memory stays in the allocator's size classes and its
     * 8 MiB quarantine (about 33 MiB here; the tree kept far more); its
     * leak check at exit covers leaks. */
    long slack_kb = getenv("ASAN_OPTIONS") ? 65536 : 16384;
    assert_true(rss1 <= rss0 + slack_kb);
    server_stop(&p);
}

/*
 * The compute threads (cpu/pool.h) of a served model sleep when the server
 * is idle: after answers have woken them, their CPU time over one second
 * stays at a tick or two (spinning workers would take a whole core each),
 * so the loop thread keeps the cores. /health names the pool.
 */
static void test_idle_workers_sleep(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "server.threads=3"};
    struct su_proc p = {0};
    serve(&p, "idle", args, 2);
    for (int k = 0; k < 3; k++) {
        struct su_resp r;
        assert_int_equal(su_http(p.port, "POST", "/v1/completions", NULL,
                                 "{\"prompt\":\"Once\",\"max_tokens\":8}", &r),
                         200);
        su_resp_free(&r);
    }
    struct resp r;
    assert_int_equal(http(p.port, "GET", "/health", NULL, NULL, &r), 200);
    json_t *h = json_loads(r.body, 0, NULL);
    resp_free(&r);
    assert_non_null(h);
    const char *threads =
        json_string_value(json_object_get(json_object_get(h, "kernels"), "threads"));
    assert_non_null(threads);
    print_message("threads: %s\n", threads);
    bool pool = !strncmp(threads, "kvd pool", 8);
    json_decref(h);
    if (pool) {
        su_sleep_ms(200); /* well past the spin time */
        int n0 = 0, n1 = 0;
        long t0 = pt_thread_ticks(p.pid, "kvd-pool-", &n0);
        su_sleep_ms(1000);
        long t1 = pt_thread_ticks(p.pid, "kvd-pool-", &n1);
        print_message("%d workers: %ld clock ticks in 1 s (%ld a second of one core)\n", n1,
                      t1 - t0, sysconf(_SC_CLK_TCK));
        assert_true(t0 >= 0 && n0 == 2 && n1 == 2);
        assert_true(t1 - t0 <= 2);
    }
    server_stop(&p);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("api", 7, false);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decoders),
        cmocka_unit_test(test_huge_prompt_refused_untokenized),
        cmocka_unit_test(test_tokenizing_off_loop),
        cmocka_unit_test(test_client_leaves_during_prepare),
        cmocka_unit_test(test_logprob_answers_memory),
        cmocka_unit_test(test_idle_workers_sleep),
    };
    return cmocka_run_group_tests_name("api", tests, group_setup, group_teardown);
}
