/*
 * test_arch_phi3.c - Phi-3/3.5/4 end to end: fused QKV and gate/up
 * matrices, LongRoPE's long and short factor tables and its amplitude.
 *
 * Random-weight files written by kvd mkmodel --arch phi3 (full and partial
 * rotation, MHA and GQA, LongRoPE with the long or the short table, a
 * sliding window) against tests/arch_ref.h's reference, written apart from
 * model/: it copies the fused matrices into separate ones, multiplies the
 * rotated values of q and k by the amplitude as Hugging Face's cos/sin do,
 * where kvd scales the rotated dims of q alone by its square. Each part is
 * shown to matter, eviction keeps the cache's promise, and every new key
 * and tensor is refused with its name when wrong.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "model/mkmodel.h"
#include "model/model_internal.h"
#include "model/quant.h"
#include "tests/arch_ref.h"
#include "tests/serve_util.h"

static int group_setup(void **state)
{
    (void)state;
    return tmp_dir_create("phi3");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

struct pcase {
    const char *name;
    int dim, heads, kv_heads, rope_dims, layers, window;
    bool longrope;
    int serve_ctx; /* model_params.n_ctx (0: the file's 8192) */
};

static const struct pcase cases[] = {
    {"phi3-plain", 128, 4, 4, 0, 2, 0, false, 0},
    {"phi3-longrope-long", 128, 4, 4, 0, 2, 0, true, 0},
    {"phi3-longrope-short", 128, 4, 4, 0, 2, 0, true, 48},
    {"phi4-partial-gqa", 96, 6, 2, 12, 3, 0, true, 0},
    {"phi3-window-7", 128, 4, 2, 0, 2, 7, false, 0},
};

static struct model_mk_params pcase_params(const struct pcase *c, enum ggml_type type)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = "phi3";
    p.n_embd = c->dim;
    p.n_head = c->heads;
    p.n_kv_head = c->kv_heads;
    p.rope_dims = c->rope_dims;
    p.n_layer = c->layers;
    p.n_ff = 96;
    p.n_vocab = 300;
    p.seed = 29;
    p.sliding_window = c->window;
    p.rope_scaling = c->longrope ? "longrope" : NULL;
    p.rope_orig_ctx = 64;
    p.n_ctx_train = 8192;
    p.type = type;
    return p;
}

static void test_forward_matches_reference(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ref_phi3_ctx = cases[i].serve_ctx;
        forward_vs_reference_types(cases[i].name, pcase_params(&cases[i], GGML_TYPE_F32));
    }
    ref_phi3_ctx = 0;
}

/* The loader picks the table by the context served, and scales q by the
 * amplitude squared. */
static void test_long_or_short(void **state)
{
    (void)state;
    char path[512];
    struct model_mk_params p = pcase_params(&cases[1], GGML_TYPE_F32);
    write_model(&p, "ls.gguf", path, sizeof(path));
    double amp = sqrt(1.0 + log(8192.0 / 64) / log(64.0));
    const int ctx[3] = {0, 65, 64};
    for (int k = 0; k < 3; k++) {
        ref_phi3_ctx = ctx[k];
        model *m = load_model(path);
        assert_int_equal(m->rope_long, k < 2);
        assert_true(m->pos.rope_freq_factors == m->rope_factors);
        assert_true(fabsf(m->rope_factors[m->pos.rope_dims / 2 - 1] - (k < 2 ? 30.0f : 1.1f)) <
                    1e-5f);
        assert_true(fabs(m->rope_q_mul - amp * amp) < 1e-5);
        model_free(m);
    }
    ref_phi3_ctx = 0;
    p = pcase_params(&cases[0], GGML_TYPE_F32);
    write_model(&p, "plain.gguf", path, sizeof(path));
    model *m = load_model(path);
    assert_true(m->rope_q_mul == 1.0f && !m->pos.rope_freq_factors && !m->rope_long);
    assert_null(gguf_find_tensor(m->file, "blk.0.ffn_gate.weight")); /* fused, as Phi-3 */
    assert_non_null(gguf_find_tensor(m->file, "blk.0.attn_qkv.weight"));
    model_free(m);
}

/* model_set_n_ctx re-picks the table after load (the commands know their
 * prompts only then), by the rule model_rope_long states for a model_info. */
static void test_set_n_ctx(void **state)
{
    (void)state;
    char path[512];
    struct model_mk_params p = pcase_params(&cases[1], GGML_TYPE_F32);
    write_model(&p, "set.gguf", path, sizeof(path));
    model *m = load_model(path);
    struct model_info info;
    const int ctx[5] = {64, 65, 0, 1, 64};
    for (int k = 0; k < 5; k++) {
        model_set_n_ctx(m, ctx[k]);
        model_get_info(m, &info);
        bool want = ctx[k] != 64 && ctx[k] != 1; /* 0 = the file's 8192 */
        assert_int_equal(info.rope_long, want);
        assert_int_equal(model_rope_long(&info, ctx[k]), want);
        assert_int_equal(info.rope_orig_ctx, 64);
        assert_true(fabsf(m->rope_factors[m->pos.rope_dims / 2 - 1] - (want ? 30.0f : 1.1f)) <
                    1e-5f);
    }
    model_free(m);
    p = pcase_params(&cases[0], GGML_TYPE_F32); /* no tables: nothing to pick */
    write_model(&p, "set-plain.gguf", path, sizeof(path));
    m = load_model(path);
    model_set_n_ctx(m, 100000);
    model_get_info(m, &info);
    assert_true(!info.rope_long && info.rope_orig_ctx == 0 && !model_rope_long(&info, 100000));
    assert_null(m->pos.rope_freq_factors);
    model_free(m);
}

static int run_kvd(const char *args, const char *want_err)
{
    char cmd[2048], pe[400];
    snprintf(pe, sizeof(pe), "%s/cli.err", tmp_dir);
    snprintf(cmd, sizeof(cmd), "%s %s >/dev/null 2>'%s' </dev/null", getenv("KVD_BIN"), args, pe);
    int st = system(cmd);
    if (want_err && !su_file_has(pe, want_err)) {
        char line[600];
        FILE *f = fopen(pe, "r");
        while (f && fgets(line, sizeof(line), f))
            print_message("  stderr: %s", line);
        if (f)
            fclose(f);
        fail_msg("kvd %s: stderr lacks '%s'", args, want_err);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/*
 * The commands tell the model the positions they will run: kvd generate
 * min(--ctx, prompt + -n) under renumber and prompt + -n under preserve,
 * kvd eval its longest run, kvd serve max_cache_tokens under renumber;
 * each prints the table. A reload whose budget needs the other table is
 * refused (the old config stays).
 */
static void test_context_from_commands(void **state)
{
    (void)state;
    const char *kvd = getenv("KVD_BIN");
    if (!kvd || !*kvd) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    char path[512], args[1400];
    struct model_mk_params p = pcase_params(&cases[1], GGML_TYPE_F32);
    write_model(&p, "cmd.gguf", path, sizeof(path));
    const char *gen = "generate --threads 1 --temp 0 --no-echo --prompt 'one two three'";
    snprintf(args, sizeof(args), "%s --model %s -n 100 --ctx 48", gen, path);
    assert_int_equal(run_kvd(args, "LongRoPE short factors (positions up to 48 <= the original "
                                   "context 64)"), 0);
    snprintf(args, sizeof(args), "%s --model %s -n 100 --ctx 256", gen, path);
    assert_int_equal(run_kvd(args, "LongRoPE long factors (positions up to 1"), 0);
    snprintf(args, sizeof(args), "%s --model %s -n 20 --ctx 256", gen, path);
    assert_int_equal(run_kvd(args, "LongRoPE short factors"), 0);
    snprintf(args, sizeof(args), "%s --model %s -n 60 --ctx 48 --policy sink-window --preserve",
             gen, path);
    assert_int_equal(run_kvd(args, "LongRoPE long factors"), 0);

    /* eval: window:32 renumbers within 36 (a page of 4 beside the window);
     * the dense baseline and a preserve policy run all 200 positions */
    char text[512];
    snprintf(text, sizeof(text), "%s/text.txt", tmp_dir);
    FILE *f = fopen(text, "w");
    for (int i = 0; i < 400; i++)
        fputs(i % 2 ? "b" : "a ", f);
    fclose(f);
    const char *ev = "eval --threads 1 --tokens 200";
    snprintf(args, sizeof(args), "%s --model %s --file %s --policy window:32", ev, path, text);
    assert_int_equal(run_kvd(args, "LongRoPE short factors (positions up to 36 <="), 0);
    snprintf(args, sizeof(args), "%s --model %s --file %s --policy window:32 --baseline dense",
             ev, path, text);
    assert_int_equal(run_kvd(args, "LongRoPE long factors (positions up to 20"), 0);
    snprintf(args, sizeof(args), "%s --model %s --file %s --policy window:32:preserve", ev, path,
             text);
    assert_int_equal(run_kvd(args, "LongRoPE long factors (positions up to 20"), 0);

    /* serve: the table at start; a reload that needs the other one is refused */
    char conf[600], body[1400];
    snprintf(conf, sizeof(conf), "%s/phi3.conf", tmp_dir);
    const char *fmt = "[server]\nlisten = 127.0.0.1:0\nthreads = 1\n[model]\npath = %s\n"
                      "[cache]\nmemory = 2MiB\n[eviction]\nmax_cache_tokens = %d\n";
    snprintf(body, sizeof(body), fmt, path, 48);
    f = fopen(conf, "w");
    fputs(body, f);
    fclose(f);
    struct su_proc s = {0};
    snprintf(s.log, sizeof(s.log), "%s/serve.log", tmp_dir);
    const char *argv[] = {kvd, "serve", "--config", conf, NULL};
    assert_int_equal(su_serve_argv(&s, argv), 0);
    assert_true(su_file_has(s.log, "LongRoPE short factors (positions up to 48"));
    snprintf(body, sizeof(body), fmt, path, 100);
    f = fopen(conf, "w");
    fputs(body, f);
    fclose(f);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_last_reload_success", 0));
    assert_true(su_file_has(s.log, "max_cache_tokens 100 needs the model's long LongRoPE "
                                   "factors (original context 64); it runs the short ones"));
    snprintf(body, sizeof(body), fmt, path, 60); /* still short: applies */
    f = fopen(conf, "w");
    fputs(body, f);
    fclose(f);
    kill(s.pid, SIGHUP);
    assert_true(su_wait_metric(s.port, "kvd_config_last_reload_success", 1));
    assert_int_equal(su_stop(&s, SIGTERM, 30), 0);
}

/* The reference without Phi-3 part *(int *)ctx, numbered as in
 * test_parts_matter (ref_part_effect; path: the model's file). */
static void phi3_cut(struct ref_model *r, const char *path, void *ctx)
{
    int part = *(const int *)ctx;
    if (part == 0)
        r->amp = 1.0;
    if (part == 1) { /* the short table where the long one belongs */
        ref_phi3_ctx = 48;
        struct ref_model rs;
        ref_load(&rs, path);
        ref_phi3_ctx = 0;
        memcpy(r->rope_ff, rs.rope_ff, sizeof(float) * (size_t)r->n_rot / 2);
        ref_free(&rs);
    }
    for (int l = 0; l < r->n_layer; l++) {
        struct ref_layer *L = &r->L[l];
        if (part == 2) {
            float *t = L->gate;
            L->gate = L->up;
            L->up = t;
        }
        if (part == 3) { /* Q's first kv rows swapped with K's */
            size_t n = (size_t)r->n_kv * r->hd * r->d;
            float *tmp = malloc(sizeof(float) * n);
            assert_non_null(tmp);
            memcpy(tmp, L->wq, sizeof(float) * n);
            memcpy(L->wq, L->wk, sizeof(float) * n);
            memcpy(L->wk, tmp, sizeof(float) * n);
            free(tmp);
        }
    }
}

/* Each part matters: the reference (which kvd matches) moves without it. */
static void test_parts_matter(void **state)
{
    (void)state;
    const char *what[4] = {"amplitude", "long table (short instead)", "gate/up order",
                           "QKV order (K before Q)"};
    for (int part = 0; part < 4; part++) {
        struct model_mk_params p = pcase_params(&cases[3], GGML_TYPE_F32);
        assert_true(ref_part_effect(&p, what[part], 24, 3, phi3_cut, &part) > 1e-3f);
    }
}

static void test_evict_equals_reference(void **state)
{
    (void)state;
    const int which[2] = {3, 4};
    for (int c = 0; c < 2; c++) {
        struct model_mk_params p = pcase_params(&cases[which[c]], GGML_TYPE_F32);
        evict_both_ways(cases[which[c]].name, &p, 53 + (uint32_t)c);
    }
}

static void test_load_errors(void **state)
{
    (void)state;
    char lr[512], bad[512];
    struct model_mk_params p = pcase_params(&cases[1], GGML_TYPE_F32);
    write_model(&p, "bad-lr.gguf", lr, sizeof(lr));
    snprintf(bad, sizeof(bad), "%s/bad.gguf", tmp_dir);

    struct {
        struct kv_set set;
        const char *drop, *want;
    } keys[] = {
        {{NULL, 0, NULL, 0, 0}, "phi3.rope.scaling.original_context_length",
         "missing metadata key phi3.rope.scaling.original_context_length"},
        {{"phi3.rope.scaling.original_context_length", GGUF_TYPE_STRING, "4096", 0, 0}, NULL,
         "phi3.rope.scaling.original_context_length is not an integer"},
        {{"phi3.rope.scaling.attn_factor", GGUF_TYPE_FLOAT32, NULL, -1.2f, 0}, NULL,
         "phi3.rope.scaling.attn_factor = -1.2 must be positive"},
        {{"phi3.rope.scaling.attn_factor", GGUF_TYPE_FLOAT32, NULL, NAN, 0}, NULL,
         "phi3.rope.scaling.attn_factor is not a finite number"},
        {{"phi3.rope.scaling.type", GGUF_TYPE_STRING, "longrope", 0, 0}, NULL,
         "phi3.rope.scaling.type = 'longrope' is not supported"},
        {{"phi3.attention.sliding_window", GGUF_TYPE_INT32, NULL, 0, -3}, NULL,
         "phi3.attention.sliding_window = -3"},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        mutate(lr, bad, &(struct mutation){.drop_key = keys[i].drop, .set = {keys[i].set}});
        expect_load_error(bad, keys[i].want);
    }

    /* the tables: one without the other, wrong length, a bad factor, beside rope_freqs */
    mutate(lr, bad, &(struct mutation){.drop_tensor = "rope_factors_short.weight"});
    expect_load_error(bad, "tensor rope_factors_short.weight is missing");
    mutate(lr, bad,
           &(struct mutation){.drop_tensor = "rope_factors_long.weight",
                              .clone_tensor = "blk.0.attn_norm.weight",
                              .clone_as = "rope_factors_long.weight"});
    expect_load_error(bad, "tensor rope_factors_long.weight has shape [128");
    float f[16];
    for (int i = 0; i < 16; i++)
        f[i] = i == 4 ? 0.0f : 1.0f;
    mutate(lr, bad,
           &(struct mutation){.replace_tensor = "rope_factors_long.weight", .replace_data = f});
    expect_load_error(bad, "rope_factors_long.weight: factor 4 (0) must be positive");
    f[4] = INFINITY;
    mutate(lr, bad,
           &(struct mutation){.replace_tensor = "rope_factors_short.weight", .replace_data = f});
    expect_load_error(bad, "rope_factors_short.weight: element 4 is not finite");
    mutate(lr, bad,
           &(struct mutation){.clone_tensor = "rope_factors_long.weight",
                              .clone_as = "rope_freqs.weight"});
    expect_load_error(bad, "beside rope_freqs.weight");

    /* the fused matrices: wrong shapes; without attn_qkv the separate ones are required */
    mutate(lr, bad,
           &(struct mutation){.drop_tensor = "blk.1.ffn_up.weight",
                              .clone_tensor = "blk.1.ffn_down.weight",
                              .clone_as = "blk.1.ffn_up.weight"});
    expect_load_error(bad, "tensor blk.1.ffn_up.weight has shape [96, 128");
    mutate(lr, bad,
           &(struct mutation){.drop_tensor = "blk.0.attn_qkv.weight",
                              .clone_tensor = "blk.0.attn_output.weight",
                              .clone_as = "blk.0.attn_qkv.weight"});
    expect_load_error(bad, "tensor blk.0.attn_qkv.weight has shape [128, 128");
    mutate(lr, bad, &(struct mutation){.drop_tensor = "blk.0.attn_qkv.weight"});
    expect_load_error(bad, "missing tensor blk.0.attn_q.weight");

    /* mkmodel: longrope is phi3's, with an original context */
    char err[256];
    p.arch = "llama";
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "longrope is phi3's"));
    p = pcase_params(&cases[1], GGML_TYPE_F32);
    p.rope_orig_ctx = 0;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_long_or_short),
        cmocka_unit_test(test_set_n_ctx),
        cmocka_unit_test(test_context_from_commands),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_forward_matches_reference),
        cmocka_unit_test(test_parts_matter),
        cmocka_unit_test(test_evict_equals_reference),
    };
    return cmocka_run_group_tests_name("arch_phi3", tests, group_setup, group_teardown);
}
