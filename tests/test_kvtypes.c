/*
 * test_kvtypes.c - quantised KV caches (q8_0, q4_0) end to end.
 *
 * Starts the real `kvd serve` (KVD_BIN, set by `make test`) on small
 * seeded models and checks what an operator relies on: with
 * `--set cache.kv_type=q8_0` the OpenAI routes answer as usual (plain and
 * streamed, sessions continued) and greedy text equals what `kvd generate
 * --kv-type q8_0` prints; K and V types may differ; the pool's page size
 * follows the types, so the same cache.memory holds proportionally more
 * pages; /metrics and /v1/sessions/ID name the types; a head size the block
 * types cannot take is refused at start with the type and head size named.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "tests/serve_util.h"

static const char *kvd_bin;
static char tmpdir[256], model32[512], model16[512];
static const char *skip_reason;

/* A llama-shaped seeded model with heads of head_dim elements. */
static int write_model(const char *path, int head_dim)
{
    struct model_mk_params p = su_small_model(128, 512, 21);
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_embd = 4 * head_dim;
    char err[512];
    if (model_mk_write(&p, path, err, sizeof(err)) != 0) {
        fprintf(stderr, "model_mk_write: %s\n", err);
        return -1;
    }
    return 0;
}

static int group_setup(void **state)
{
    (void)state;
    kvd_bin = getenv("KVD_BIN");
    if (!kvd_bin || !*kvd_bin) {
        skip_reason = "KVD_BIN is not set (run through `make test`)";
        return 0;
    }
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvd-test-kvtypes-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(model32, sizeof(model32), "%s/head32.gguf", tmpdir);
    snprintf(model16, sizeof(model16), "%s/head16.gguf", tmpdir);
    return write_model(model32, 32) || write_model(model16, 16) ? -1 : 0;
}

static int group_teardown(void **state)
{
    (void)state;
    return tmpdir[0] && su_remove_dir(tmpdir) ? -1 : 0;
}

#define SKIP_WITHOUT_KVD()                                                                         \
    do {                                                                                           \
        if (skip_reason) {                                                                         \
            print_message("skipped: %s\n", skip_reason);                                           \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

/* `kvd generate ... --temp 0 --no-echo` on model32: the generated text. */
static char *generate(const char *kv_args, int n)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "%s generate --model '%s' --prompt 'Once upon a time' -n %d --temp 0 --no-echo %s "
             "2>/dev/null",
             kvd_bin, model32, n, kv_args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char *out = calloc(1, 65536);
    assert_non_null(out);
    size_t len = fread(out, 1, 65535, p);
    assert_int_equal(pclose(p), 0);
    if (len && out[len - 1] == '\n')
        out[len - 1] = '\0';
    return out;
}

static const char *choice_text(json_t *ans)
{
    return json_string_value(
        json_object_get(json_array_get(json_object_get(ans, "choices"), 0), "text"));
}

/* The value of a Prometheus sample line starting with `name` (name + labels). */
static double metric(const char *body, const char *name)
{
    size_t n = strlen(name);
    for (const char *l = body; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, name, n) && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    fail_msg("no metric %s", name);
    return 0;
}

/* A served q8_0 cache: completions, streaming, a continued session, types reported. */
static void check_server(const char *k, const char *v, const char *const *args, int n_args,
                         size_t page_bytes)
{
    struct su_proc srv = {0};
    snprintf(srv.log, sizeof(srv.log), "%s/serve-%s-%s.log", tmpdir, k, v);
    assert_int_equal(su_serve(&srv, kvd_bin, model32, args, n_args), 0);

    /* greedy text equals kvd generate's with the same KV types */
    char kv_args[64];
    snprintf(kv_args, sizeof(kv_args), "--k-type %s --v-type %s", k, v);
    char *want = generate(kv_args, 16);
    int status;
    json_t *ans = su_post(srv.port, "/v1/completions", NULL,
                          json_pack("{s:s, s:i, s:f, s:s}", "prompt", "Once upon a time",
                                    "max_tokens", 16, "temperature", 0.0, "session", "chat"),
                          &status);
    assert_int_equal(status, 200);
    assert_non_null(choice_text(ans));
    print_message("  K %s V %s: \"%s\"\n", k, v, choice_text(ans));
    assert_string_equal(choice_text(ans), want);
    json_t *fin = json_object_get(json_array_get(json_object_get(ans, "choices"), 0),
                                  "finish_reason");
    assert_string_equal(json_string_value(fin), "length");

    /* the session goes on (only the new part prefilled), streamed */
    char body[4096];
    snprintf(body, sizeof(body),
             "{\"prompt\": \"Once upon a time%s and then\", \"max_tokens\": 8, \"temperature\": 0, "
             "\"session\": \"chat\", \"stream\": true}",
             choice_text(ans));
    struct su_resp r;
    assert_int_equal(su_http(srv.port, "POST", "/v1/completions",
                             "Content-Type: application/json\r\n", body, &r),
                     200);
    assert_non_null(strstr(r.body, "data: [DONE]"));
    su_resp_free(&r);

    /* the session and /metrics name the types; pages follow them */
    assert_int_equal(su_http(srv.port, "GET", "/v1/sessions/chat", NULL, NULL, &r), 200);
    json_t *sess = json_loads(r.body, 0, NULL);
    su_resp_free(&r);
    json_t *kv = json_object_get(sess, "kv");
    assert_string_equal(json_string_value(json_object_get(kv, "k_type")), k);
    assert_string_equal(json_string_value(json_object_get(kv, "v_type")), v);
    assert_true(json_integer_value(json_object_get(kv, "pages")) > 0);
    assert_int_equal(json_integer_value(json_object_get(kv, "bytes")),
                     json_integer_value(json_object_get(kv, "pages")) * (json_int_t)page_bytes);
    assert_int_equal(su_http(srv.port, "GET", "/metrics", NULL, NULL, &r), 200);
    char label[128];
    snprintf(label, sizeof(label), "kvd_kv_type_info{k_type=\"%s\",v_type=\"%s\"}", k, v);
    assert_true(metric(r.body, label) == 1.0);
    assert_true(metric(r.body, "kvd_kv_page_bytes") == (double)page_bytes);
    /* cache.memory = 4MiB in whole pages of this size */
    assert_true(metric(r.body, "kvd_kv_pages_total") == (double)((4u << 20) / page_bytes));
    su_resp_free(&r);

    json_decref(sess);
    json_decref(ans);
    free(want);
    assert_int_equal(su_stop(&srv, SIGTERM, 30), 0);
}

/*
 * Page bytes of model32 (2 layers x 2 KV heads x 16-token pages, head 32):
 * f16 rows 64 bytes, q8_0 34, q4_0 18, so f16 pages are 8192 bytes and
 * q8_0 pages 4352 (1.9x the tokens in the same memory), q8_0/q4_0 3328.
 */
static void test_serve_q8_0(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "cache.kv_type=q8_0", "--set", "cache.memory=4MiB"};
    check_server("q8_0", "q8_0", args, 4, 4352);
}

static void test_serve_split_types(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "cache.k_type=q8_0", "--set", "cache.v_type=q4_0",
                                       "--set", "cache.memory=4MiB"};
    check_server("q8_0", "q4_0", args, 6, 3328);
    static const char *const f16[] = {"--set", "cache.memory=4MiB"};
    check_server("f16", "f16", f16, 2, 8192);
}

/* `kvd eval --json ARGS` on model32 over text_path: the parsed output. */
static char text_path[512];

static json_t *eval_json(const char *args)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd),
             "%s eval --model '%s' --file '%s' --train-len 256 --tokens 600 --threads 1 --json %s "
             "2>/dev/null",
             kvd_bin, model32, text_path, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    json_t *doc = json_loadf(p, 0, NULL);
    assert_int_equal(pclose(p), 0);
    assert_non_null(doc);
    return doc;
}

static double run_field(json_t *doc, int run, const char *key)
{
    json_t *r = json_array_get(json_object_get(doc, "runs"), (size_t)run);
    assert_non_null(json_object_get(r, key));
    return json_number_value(json_object_get(r, key));
}

/*
 * kvd eval --kld-ref f32 over quantised caches (sink-window and dense):
 * every type moves the next-token distributions, f16 least, then q8_0,
 * q8_0 keys with q4_0 values, q4_0. (A seeded random model: the order is
 * what is checked, the sizes are not those of a trained model.)
 */
static void test_eval_kld_types(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    snprintf(text_path, sizeof(text_path), "%s/text.txt", tmpdir);
    FILE *f = fopen(text_path, "w");
    assert_non_null(f);
    for (int i = 0; i < 60; i++)
        fprintf(f, "Lily found a red ball %d times in the garden and her dog ran after it. ", i);
    fclose(f);
    static const char *const types[4] = {"--kv-type f16", "--kv-type q8_0",
                                         "--k-type q8_0 --v-type q4_0", "--kv-type q4_0"};
    double kld[4][2];
    for (int t = 0; t < 4; t++) {
        char args[256];
        snprintf(args, sizeof(args), "%s --kld-ref f32 --policy sink-window:4:60 --baseline dense",
                 types[t]);
        json_t *doc = eval_json(args);
        for (int r = 0; r < 2; r++) {
            kld[t][r] = run_field(doc, r, "kld_mean");
            assert_true(run_field(doc, r, "perplexity") > 1.0);
        }
        print_message("  %-28s mean KLD vs f32: sink-window %.3e, dense %.3e\n", types[t], kld[t][0],
                      kld[t][1]);
        json_decref(doc);
    }
    for (int r = 0; r < 2; r++) {
        assert_true(kld[0][r] > 0.0);
        assert_true(kld[1][r] > kld[0][r]); /* q8_0 rounds more than f16 */
        assert_true(kld[3][r] > kld[1][r]); /* q4_0 more than q8_0 */
        assert_true(kld[2][r] > kld[1][r] && kld[2][r] < kld[3][r]);
    }
}

/* q4_0 on 16-dim heads: kvd serve refuses to start and says why. */
static void test_serve_refuses_head_dim(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/refuse.log", tmpdir);
    const char *argv[] = {kvd_bin,   "serve", "--model", model16, "--listen",
                          "127.0.0.1:0", "--set", "cache.v_type=q4_0", NULL};
    assert_int_equal(su_spawn(&p, (char *const *)argv, NULL), 0);
    assert_int_equal(su_wait(&p, 30), 2);
    FILE *f = fopen(p.log, "r");
    assert_non_null(f);
    char log[4096] = {0};
    size_t n = fread(log, 1, sizeof(log) - 1, f);
    fclose(f);
    log[n] = '\0';
    print_message("  %s", log);
    assert_non_null(strstr(log, "q4_0"));
    assert_non_null(strstr(log, "head_dim 16"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_serve_q8_0),
        cmocka_unit_test(test_serve_split_types),
        cmocka_unit_test(test_serve_refuses_head_dim),
        cmocka_unit_test(test_eval_kld_types),
    };
    return cmocka_run_group_tests_name("kvtypes", tests, group_setup, group_teardown);
}
