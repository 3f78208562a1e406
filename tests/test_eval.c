/*
 * test_eval.c - `kvd eval` end to end on a real model and real text.
 *
 * Runs the built binary (KVD_BIN, set by `make test`) on stories260K and
 * the TinyStories evaluation text from ../shared (KVD_SHARED), and checks
 * the claims operators rely on: sink+window with renumbered positions
 * scores like the expensive recompute baseline; preserved positions fall
 * apart past the training length; the chunked baseline is exactly a set of
 * independent forwards. Skips with a message when the binary or the shared
 * files are absent.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "tests/serve_util.h"

static char model_path[1024], text_path[1024];
static const char *kvd_bin;

static bool have_inputs(void)
{
    kvd_bin = getenv("KVD_BIN");
    const char *shared = getenv("KVD_SHARED");
    if (!shared)
        shared = "../shared";
    snprintf(model_path, sizeof(model_path), "%s/models/stories260K.gguf", shared);
    snprintf(text_path, sizeof(text_path), "%s/data/tinystories-eval-ascii.txt", shared);
    if (!kvd_bin) {
        print_message("skipped: KVD_BIN is not set (run through make test)\n");
        return false;
    }
    if (access(model_path, R_OK) || access(text_path, R_OK)) {
        print_message("skipped: %s or %s is absent\n", model_path, text_path);
        return false;
    }
    return true;
}

/* Run `kvd eval ARGS --json` and parse its output; exit status in *status. */
static json_t *run_eval(const char *args, int *status)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "%s eval --model %s --file %s --json %s 2>/dev/null", kvd_bin,
             model_path, text_path, args);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    json_error_t jerr;
    json_t *doc = json_loadf(p, 0, &jerr);
    int rc = pclose(p);
    *status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
    return doc;
}

static json_t *run_ok(const char *args)
{
    int status;
    json_t *doc = run_eval(args, &status);
    if (status != 0 || !doc)
        fail_msg("kvd eval %s: status %d, output %s", args, status, doc ? "parsed" : "unparsable");
    return doc;
}

static json_t *run_named(json_t *doc, const char *label_prefix)
{
    json_t *runs = json_object_get(doc, "runs");
    for (size_t i = 0; i < json_array_size(runs); i++) {
        json_t *r = json_array_get(runs, i);
        const char *label = json_string_value(json_object_get(r, "label"));
        if (label && !strncmp(label, label_prefix, strlen(label_prefix)))
            return r;
    }
    fail_msg("no run labelled %s", label_prefix);
    return NULL;
}

static double segment_ppl(json_t *run, int from)
{
    json_t *segs = json_object_get(run, "segments");
    for (size_t i = 0; i < json_array_size(segs); i++) {
        json_t *s = json_array_get(segs, i);
        if (json_integer_value(json_object_get(s, "from")) == from)
            return json_number_value(json_object_get(s, "perplexity"));
    }
    fail_msg("no segment from %d", from);
    return NAN;
}

/* Sink 4 + window 252, renumbered: within 2% of the recompute baseline. */
static void test_sink_window_matches_recompute(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    json_t *doc = run_ok("--tokens 2048 --train-len 512 --policy sink-window:4:252 "
                         "--baseline recompute --recompute-tokens 2048");
    double pol = json_number_value(json_object_get(run_named(doc, "sink-window"), "perplexity"));
    double rec = json_number_value(json_object_get(run_named(doc, "recompute"), "perplexity"));
    print_message("sink-window:4:252 %.4f, recompute %.4f\n", pol, rec);
    assert_true(pol > 1.0 && rec > 1.0);
    assert_true(fabs(pol / rec - 1.0) < 0.02);
    json_decref(doc);
}

/*
 * --kld-ref: the twin run in the reference type gives the KL divergence of
 * every prediction. Against itself it is exactly 0 (same kernel, same
 * bytes); f16 against f32 is small but not 0, and the perplexities stay
 * within 0.1%. stories260K's 8-dim heads cannot take q8_0 (blocks of 32):
 * refused with the type and head size named.
 */
static void test_kld_ref(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    json_t *self = run_ok("--tokens 700 --kv-type f16 --kld-ref f16 --baseline dense");
    json_t *half = run_ok("--tokens 700 --kv-type f16 --kld-ref f32 --baseline dense");
    json_t *full = run_ok("--tokens 700 --kv-type f32 --baseline dense");
    for (int i = 0; i < 2; i++) {
        const char *which = i ? "dense" : "sink-window";
        json_t *s = run_named(self, which), *h = run_named(half, which), *f = run_named(full, which);
        double k_self = json_number_value(json_object_get(s, "kld_mean"));
        double k_half = json_number_value(json_object_get(h, "kld_mean"));
        double p_half = json_number_value(json_object_get(h, "perplexity"));
        double p_full = json_number_value(json_object_get(f, "perplexity"));
        print_message("%s: KLD f16|f16 %.3g, f16|f32 %.3g; ppl f16 %.5f, f32 %.5f\n", which,
                      k_self, k_half, p_half, p_full);
        assert_string_equal(json_string_value(json_object_get(h, "kld_ref")), "f32");
        assert_true(k_self == 0.0);
        assert_true(k_half > 0.0 && k_half < 1e-3);
        assert_true(fabs(p_half / p_full - 1.0) < 1e-3);
        assert_null(json_object_get(f, "kld_mean")); /* no --kld-ref, no KLD */
        json_t *seg = json_array_get(json_object_get(h, "segments"), 0);
        assert_true(json_number_value(json_object_get(seg, "kld")) > 0.0);
    }
    json_decref(self);
    json_decref(half);
    json_decref(full);

    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "%s eval --model %s --file %s --tokens 100 --kv-type q8_0 2>&1 >/dev/null", kvd_bin,
             model_path, text_path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char msg[1024] = {0};
    size_t n = fread(msg, 1, sizeof(msg) - 1, p);
    msg[n] = '\0';
    assert_int_equal(WEXITSTATUS(pclose(p)), 2);
    assert_non_null(strstr(msg, "q8_0"));
    assert_non_null(strstr(msg, "head_dim 8"));
}

/* Preserved positions run RoPE far past 512: at least 3x worse there. */
static void test_preserve_worse_than_renumber(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    json_t *doc = run_ok("--tokens 8192 --train-len 512 --segments 2048 "
                         "--policy sink-window:4:252 --policy sink-window:4:252:preserve");
    double ren = segment_ppl(run_named(doc, "sink-window:4:252"), 2048);
    double pre = segment_ppl(run_named(doc, "sink-window:4:252:preserve"), 2048);
    print_message("[2048, 8192): renumber %.3f, preserve %.3f\n", ren, pre);
    assert_true(ren > 1.0);
    assert_true(pre >= 3.0 * ren);
    json_decref(doc);
}

/* The chunked baseline equals independent 512-token forwards, chunk by chunk. */
static void test_chunked_equals_independent(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    json_t *doc = run_ok("--tokens 2049 --train-len 512 --policy window:64 --baseline chunked");
    double chunked = json_number_value(json_object_get(run_named(doc, "chunked"), "perplexity"));
    json_decref(doc);
    double log_sum = 0;
    for (int k = 0; k < 4; k++) {
        char args[256];
        snprintf(args, sizeof(args),
                 "--start %d --tokens 513 --train-len 512 --policy window:64 --baseline dense",
                 1 + 512 * k);
        json_t *one = run_ok(args);
        log_sum += 512 * log(json_number_value(json_object_get(run_named(one, "dense"),
                                                               "perplexity")));
        json_decref(one);
    }
    double independent = exp(log_sum / 2048);
    print_message("chunked %.6f, independent %.6f\n", chunked, independent);
    assert_true(fabs(chunked / independent - 1.0) < 1e-5);
}

/* Run `kvd CMD` through the shell; the exit status. */
static int shell(const char *fmt, ...)
{
    char cmd[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof(cmd), fmt, ap);
    va_end(ap);
    int rc = system(cmd);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/*
 * ALiBi (bloom, mpt, llama+alibi) and T5-bias models from kvd mkmodel run
 * through eval under every policy, renumbered and preserved, and the
 * scores are finite.
 */
static void test_alibi_t5_models_every_policy(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    char dir[] = "/tmp/kvd-eval-XXXXXX";
    assert_non_null(mkdtemp(dir));
    const char *models[][2] = {{"bloom", "--arch bloom --heads 12 --kv-heads 12 --dim 192"},
                               {"mpt", "--arch mpt --alibi-max-bias 8"},
                               {"llama-alibi", "--arch llama --position alibi"},
                               {"llama-t5", "--arch llama --position t5 --t5-buckets 32"}};
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++) {
        char path[256];
        snprintf(path, sizeof(path), "%s/%s.gguf", dir, models[i][0]);
        assert_int_equal(shell("%s mkmodel --out %s --layers 2 --vocab 512 %s >/dev/null", kvd_bin,
                               path, models[i][1]),
                         0);
        char cmd[4096];
        snprintf(cmd, sizeof(cmd),
                 "%s eval --model %s --file %s --json --tokens 400 --train-len 128 "
                 "--segments 128 --policy sink-window:4:60 --policy sink-window:4:60:preserve "
                 "--policy window:64 --policy h2o:4:32:16 --baseline dense --baseline chunked "
                 "--baseline recompute --recompute-tokens 200 2>/dev/null",
                 kvd_bin, path, text_path);
        FILE *p = popen(cmd, "r");
        assert_non_null(p);
        json_t *doc = json_loadf(p, 0, NULL);
        int rc = pclose(p);
        assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
        json_t *runs = json_object_get(doc, "runs");
        assert_int_equal(json_array_size(runs), 7);
        for (size_t r = 0; r < json_array_size(runs); r++) {
            double ppl = json_number_value(json_object_get(json_array_get(runs, r), "perplexity"));
            assert_true(isfinite(ppl) && ppl > 1.0);
        }
        print_message("%s: %zu runs scored\n", models[i][0], json_array_size(runs));
        json_decref(doc);
        unlink(path);
    }
    rmdir(dir);
}

/* --config/--set: the operator's eviction settings, loaded as serve loads them. */
static void test_config_policy(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    json_t *doc = run_ok("--tokens 600 --train-len 512 --config config/kvd.conf "
                         "--set eviction.max_cache_tokens=256");
    /* 4 sinks keep one 16-token page; the automatic window is 256 - 16 - 16 */
    json_t *run = run_named(doc, "config (sink-window 4+224, renumber)");
    assert_true(json_integer_value(json_object_get(run, "tokens_evicted")) > 0);
    json_decref(doc);
    int status;
    doc = run_eval("--config config/kvd.conf --set eviction.sink_tokens=abc", &status);
    assert_int_equal(status, 2);
    json_decref(doc);
}

static void test_bad_input(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    int status;
    json_t *doc = run_eval("--policy sink-window:4", &status);
    assert_int_equal(status, 2);
    json_decref(doc);
    doc = run_eval("--policy h2o:4:8", &status); /* h2o needs SINK:WINDOW:HEAVY */
    assert_int_equal(status, 2);
    json_decref(doc);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s eval --model /nonexistent.gguf --file %s 2>/dev/null",
             kvd_bin, text_path);
    int rc = system(cmd);
    assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 1);
}

/*
 * kvd eval and kvd serve score a text identically. eval streams the first
 * 300 tokens of a text through one sequence under sink-window 4+60 (pages
 * of 8 tokens, f32 keys and values) and writes every token's loss; serve,
 * configured with the same policy, budget, page size and KV type, gets the
 * same token ids through ONE session, one more token per request (prompt =
 * tokens[0..k], n_predict 1, greedy, n_probs = the whole vocabulary): it
 * matches the session's history, prefills only tokens[k], and the answer's
 * log-probability of tokens[k+1] must be -loss[k+1] within 1e-4 nats, for
 * every k. After each request the session holds the prompt only (the
 * generated token is never written to the cache), and in the end serve
 * has evicted exactly as many tokens as eval.
 */
static struct su_proc eq_srv; /* stopped by eq_teardown, also when a check fails */

static int eq_teardown(void **state)
{
    (void)state;
    if (eq_srv.pid)
        su_stop(&eq_srv, SIGKILL, 10);
    return 0;
}

/* POST a JSON body (stolen) and parse the answer, allowing U+0000 in
 * strings (the text of byte token 0x00 among the alternatives). */
static json_t *post_json(int port, const char *path, json_t *body, int *status)
{
    char *b = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct su_resp r;
    *status = su_http(port, "POST", path, NULL, b, &r);
    free(b);
    json_t *v = r.body ? json_loads(r.body, JSON_ALLOW_NUL, NULL) : NULL;
    su_resp_free(&r);
    return v;
}

static void test_serve_scores_like_eval(void **state)
{
    (void)state;
    if (!have_inputs())
        skip();
    enum { N = 300, PAGE = 8, SINK = 4, WINDOW = 60, VOCAB = 512 };
    /* cmd_eval.c's parse_policy: the smallest budget the policy accepts,
     * sinks as whole pages + window + one page */
    const int budget = (SINK + PAGE - 1) / PAGE * PAGE + WINDOW + PAGE;
    char dir[] = "/tmp/kvd-eval-serve-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char text_file[128], loss_file[128];
    snprintf(text_file, sizeof(text_file), "%s/text.txt", dir);
    snprintf(loss_file, sizeof(loss_file), "%s/losses.bin", dir);

    /* The text both score: the shared file's first 4000 bytes (well over
     * N tokens), so both tokenize exactly the same string. */
    static char text[4001];
    FILE *f = fopen(text_path, "rb");
    assert_non_null(f);
    size_t tl = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[tl] = '\0';
    f = fopen(text_file, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, tl, f), tl);
    fclose(f);

    /* 1. kvd eval */
    char cmd[4096];
    snprintf(cmd, sizeof(cmd),
             "%s eval --model %s --file %s --json --tokens %d --policy sink-window:%d:%d "
             "--page-tokens %d --kv-type f32 --train-len 512 --losses %s 2>/dev/null",
             kvd_bin, model_path, text_file, N, SINK, WINDOW, PAGE, loss_file);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    json_t *doc = json_loadf(p, 0, NULL);
    int rc = pclose(p);
    assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
    json_t *run = run_named(doc, "sink-window");
    long long eval_evicted = json_integer_value(json_object_get(run, "tokens_evicted"));
    assert_true(eval_evicted > 0);
    json_decref(doc);
    static float loss[N];
    f = fopen(loss_file, "rb");
    assert_non_null(f);
    assert_int_equal(fread(loss, sizeof(float), N, f), N);
    fclose(f);
    assert_true(isnan(loss[0])); /* BOS */

    /* 2. kvd serve, the same settings */
    char set_budget[64], set_page[64], set_sink[64], set_window[64];
    snprintf(set_budget, sizeof(set_budget), "eviction.max_cache_tokens=%d", budget);
    snprintf(set_page, sizeof(set_page), "cache.page_tokens=%d", PAGE);
    snprintf(set_sink, sizeof(set_sink), "eviction.sink_tokens=%d", SINK);
    snprintf(set_window, sizeof(set_window), "eviction.window_tokens=%d", WINDOW);
    const char *args[] = {"--set", "eviction.policy=sink-window",
                          "--set", set_sink,
                          "--set", set_window,
                          "--set", set_budget,
                          "--set", set_page,
                          "--set", "cache.kv_type=f32",
                          "--set", "eviction.positions=renumber"};
    struct su_proc *srv = &eq_srv;
    snprintf(srv->log, sizeof(srv->log), "%s/serve.log", dir);
    assert_int_equal(
        su_serve(srv, kvd_bin, model_path, args, (int)(sizeof(args) / sizeof(args[0]))), 0);

    /* the token ids, BOS included, from the server's own tokenizer */
    int st;
    json_t *tk = post_json(srv->port, "/tokenize",
                           json_pack("{s:s, s:b}", "content", text, "add_special", 1), &st);
    assert_int_equal(st, 200);
    json_t *ids = json_object_get(tk, "tokens");
    assert_true(json_array_size(ids) >= N);
    static int32_t tok[N];
    for (int i = 0; i < N; i++)
        tok[i] = (int32_t)json_integer_value(json_array_get(ids, (size_t)i));
    json_decref(tk);

    double worst = 0;
    for (int k = 0; k + 1 < N; k++) {
        json_t *prompt = json_array();
        for (int i = 0; i <= k; i++)
            json_array_append_new(prompt, json_integer(tok[i]));
        json_t *v = post_json(srv->port, "/completion",
                              json_pack("{s:o, s:s, s:i, s:f, s:i}", "prompt", prompt, "session",
                                        "eq", "n_predict", 1, "temperature", 0.0, "n_probs", VOCAB),
                              &st);
        if (st != 200 || !v)
            su_dump_log(srv);
        assert_int_equal(st, 200);
        assert_non_null(v);
        /* only the new token was prefilled */
        assert_int_equal(json_integer_value(json_object_get(v, "tokens_cached")), k);
        json_t *top = json_object_get(
            json_array_get(json_object_get(v, "completion_probabilities"), 0), "top_logprobs");
        assert_int_equal(json_array_size(top), VOCAB);
        double lp = NAN;
        for (size_t j = 0; j < VOCAB; j++) {
            json_t *t = json_array_get(top, j);
            if (json_integer_value(json_object_get(t, "id")) == tok[k + 1])
                lp = json_number_value(json_object_get(t, "logprob"));
        }
        json_decref(v);
        double d = fabs(-lp - (double)loss[k + 1]);
        if (!(d <= 1e-4))
            print_message("token %d: serve %.6f, eval %.6f nats\n", k + 1, -lp, loss[k + 1]);
        assert_true(d <= 1e-4);
        if (d > worst)
            worst = d;
        /* the session holds the prompt, not the token generated */
        struct su_resp r;
        assert_int_equal(su_http(srv->port, "GET", "/v1/sessions/eq", NULL, NULL, &r), 200);
        json_t *info = json_loads(r.body, 0, NULL);
        su_resp_free(&r);
        assert_int_equal(json_integer_value(json_object_get(info, "tokens")), k + 1);
        if (k + 2 == N)
            assert_int_equal(json_integer_value(json_object_get(info, "evicted_tokens")),
                             eval_evicted);
        json_decref(info);
    }
    print_message("%d tokens: serve and eval agree within %.2g nats; %lld tokens evicted by both\n",
                  N - 1, worst, eval_evicted);
    assert_int_equal(su_stop(srv, SIGTERM, 30), 0);
    unlink(text_file);
    unlink(loss_file);
    unlink(srv->log);
    rmdir(dir);
}

int main(void)
{
    /* the kvd processes share two cores with whatever else runs: idle
     * OpenMP workers must sleep, not spin */
    setenv("OMP_WAIT_POLICY", "passive", 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_config_policy),
        cmocka_unit_test(test_alibi_t5_models_every_policy),
        cmocka_unit_test(test_chunked_equals_independent),
        cmocka_unit_test(test_preserve_worse_than_renumber),
        cmocka_unit_test(test_sink_window_matches_recompute),
        cmocka_unit_test(test_kld_ref),
        cmocka_unit_test_teardown(test_serve_scores_like_eval, eq_teardown),
    };
    return cmocka_run_group_tests_name("eval", tests, NULL, NULL);
}
