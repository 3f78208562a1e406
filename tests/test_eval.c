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
    };
    return cmocka_run_group_tests_name("eval", tests, NULL, NULL);
}
