/*
 * test_arch_modern.c - the RoPE models people run today: Llama 3.x (the
 * per-pair rope_freqs.weight factors its converter writes), RoPE scaled
 * linearly or by YaRN, Qwen 3 (an RMSNorm over every q and k head before
 * the rotation) and Mistral's sliding window (attention.sliding_window,
 * masked inside the fused kernel), end to end.
 *
 * Each is a random-weight model written by kvd mkmodel and checked against
 * the reference forward of tests/arch_ref.h, written apart from
 * model/forward.c and model/rope.c: its RoPE computes each pair's angle
 * the way ggml's rope_yarn does (an interpolated and an extrapolated angle
 * mixed by a ramp, the rotated values times mscale), where kvd turns the
 * same scaling into per-pair divisors and an attention scale. Then the
 * cache's promise under eviction (the logits equal the reference holding
 * the same retained K/V at the same renumbered or preserved positions), and
 * hostile files: every new key and tensor wrong in turn, refused with its
 * name.
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

static int group_setup(void **state)
{
    (void)state;
    return tmp_dir_create("archm");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

struct rope_case {
    const char *name;
    const char *arch;
    const char *scaling; /* NULL, "linear", "yarn" */
    float factor;
    bool freqs; /* rope_freqs.weight */
    int dim, heads, kv_heads, layers;
    int window; /* attention.sliding_window */
};

static const struct rope_case cases[] = {
    {"llama3-rope-freqs", "llama", NULL, 0, true, 128, 4, 2, 2, 0},
    {"llama-linear-x4", "llama", "linear", 4, false, 96, 6, 2, 2, 0},
    {"llama-yarn-x8", "llama", "yarn", 8, false, 128, 4, 1, 2, 0},
    {"llama3-freqs+yarn", "llama", "yarn", 4, true, 128, 4, 2, 2, 0},
    {"qwen3", "qwen3", NULL, 0, false, 128, 4, 2, 2, 0},
    {"qwen3-yarn-x4", "qwen3", "yarn", 4, false, 96, 6, 3, 2, 0},
    {"mistral-window-6", "llama", NULL, 0, false, 128, 4, 1, 2, 6},
    {"qwen2-window-11", "qwen2", NULL, 0, false, 96, 6, 2, 2, 11},
};

static struct model_mk_params case_params(const struct rope_case *c, enum ggml_type type)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = c->arch;
    p.n_embd = c->dim;
    p.n_head = c->heads;
    p.n_kv_head = c->kv_heads;
    p.n_layer = c->layers;
    p.n_ff = 96;
    p.n_vocab = 300;
    p.seed = 17;
    p.rope_theta = 500000.0f; /* Llama 3's base: wavelengths past the original context */
    p.rope_scaling = c->scaling;
    p.rope_scale_factor = c->factor;
    p.rope_orig_ctx = 64; /* short: the test positions cross YaRN's whole ramp */
    p.rope_freqs = c->freqs;
    p.sliding_window = c->window;
    p.type = type;
    return p;
}

/* ------------------------------------------------------------------------
 * Forward vs reference
 * ------------------------------------------------------------------------ */

static void test_forward_matches_reference(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        forward_vs_reference_types(cases[i].name, case_params(&cases[i], GGML_TYPE_F32));
}

/* The reference without Qwen3's q/k norms (ref_part_effect). */
static void drop_qk_norms(struct ref_model *r, const char *path, void *ctx)
{
    (void)path;
    (void)ctx;
    for (int l = 0; l < r->n_layer; l++) {
        free(r->L[l].q_norm);
        free(r->L[l].k_norm);
        r->L[l].q_norm = r->L[l].k_norm = NULL;
    }
}

/*
 * Every part matters: the model with rope_freqs, YaRN or the q/k norms
 * differs from the same weights without them (else the tests above could
 * pass with the feature ignored).
 */
static void test_parts_matter(void **state)
{
    (void)state;
    struct {
        struct model_mk_params with, without;
    } pairs[3];
    pairs[0].with = case_params(&cases[0], GGML_TYPE_F32);
    pairs[0].without = pairs[0].with;
    pairs[0].without.rope_freqs = false;
    pairs[1].with = case_params(&cases[2], GGML_TYPE_F32);
    pairs[1].without = pairs[1].with;
    pairs[1].without.rope_scaling = NULL;
    pairs[2].with = case_params(&cases[6], GGML_TYPE_F32);
    pairs[2].without = pairs[2].with;
    pairs[2].without.sliding_window = 0;
    for (int k = 0; k < 3; k++) {
        char a[512], b[512];
        write_model(&pairs[k].with, "with.gguf", a, sizeof(a));
        write_model(&pairs[k].without, "without.gguf", b, sizeof(b));
        float la[300], lb[300];
        forward_logits(a, 40, 5, 1, la);
        forward_logits(b, 40, 5, 1, lb);
        float e = rel_diff(la, lb, 300);
        print_message("  case %d: logits with and without the part differ by %.2e\n", k, e);
        assert_true(e > 1e-3f);
    }
    /* Qwen3's norms: the reference (which the forward matches) computes
     * other logits when they are left out of it. */
    struct model_mk_params q3 = case_params(&cases[4], GGML_TYPE_F32);
    assert_true(ref_part_effect(&q3, "qwen3 q/k norms", 12, 9, drop_qk_norms, NULL) > 1e-3f);
}

/* ------------------------------------------------------------------------
 * Eviction: kvd's unrotated keys vs the reference's re-rotated ones
 * ------------------------------------------------------------------------ */

static void test_evict_equals_reference(void **state)
{
    (void)state;
    const int which[4] = {0, 2, 5, 6}; /* rope_freqs, YaRN, Qwen3 + YaRN, a sliding window */
    for (int c = 0; c < 4; c++) {
        struct model_mk_params p = case_params(&cases[which[c]], GGML_TYPE_F32);
        evict_both_ways(cases[which[c]].name, &p, 31 + (uint32_t)c);
    }
}

/* ------------------------------------------------------------------------
 * Hostile files
 * ------------------------------------------------------------------------ */

static void test_load_errors(void **state)
{
    (void)state;
    char l3[512], yarn[512], q3[512], bad[512];
    struct model_mk_params p = case_params(&cases[0], GGML_TYPE_F32);
    write_model(&p, "bad-l3.gguf", l3, sizeof(l3));
    p = case_params(&cases[2], GGML_TYPE_F32);
    write_model(&p, "bad-yarn.gguf", yarn, sizeof(yarn));
    p = case_params(&cases[4], GGML_TYPE_F32);
    write_model(&p, "bad-q3.gguf", q3, sizeof(q3));
    snprintf(bad, sizeof(bad), "%s/bad.gguf", tmp_dir);

    /* rope_freqs.weight: wrong length, a factor that is not positive */
    mutate(l3, bad,
           &(struct mutation){.drop_tensor = "rope_freqs.weight",
                              .clone_tensor = "blk.0.attn_norm.weight",
                              .clone_as = "rope_freqs.weight"});
    expect_load_error(bad, "tensor rope_freqs.weight has shape [128");
    float f[16];
    for (int i = 0; i < 16; i++)
        f[i] = i == 5 ? -1.0f : 1.0f;
    mutate(l3, bad, &(struct mutation){.replace_tensor = "rope_freqs.weight", .replace_data = f});
    expect_load_error(bad, "rope_freqs.weight: factor 5");
    f[5] = NAN;
    mutate(l3, bad, &(struct mutation){.replace_tensor = "rope_freqs.weight", .replace_data = f});
    expect_load_error(bad, "rope_freqs.weight");

    /* scaling keys */
    struct {
        struct kv_set set;
        const char *drop, *want;
    } keys[] = {
        {{"llama.rope.scaling.type", GGUF_TYPE_STRING, "longrope", 0, 0},
         NULL,
         "llama.rope.scaling.type = 'longrope' is not supported"},
        {{"llama.rope.scaling.factor", GGUF_TYPE_FLOAT32, NULL, -2.0f, 0},
         NULL,
         "llama.rope.scaling.factor"},
        {{"llama.rope.scaling.factor", GGUF_TYPE_STRING, "eight", 0, 0},
         NULL,
         "llama.rope.scaling.factor"},
        {{NULL, 0, NULL, 0, 0},
         "llama.rope.scaling.original_context_length",
         "llama.rope.scaling.original_context_length"},
        {{"llama.rope.scaling.original_context_length", GGUF_TYPE_INT32, NULL, 0, -5},
         NULL,
         "llama.rope.scaling.original_context_length"},
        {{"llama.rope.scaling.yarn_ext_factor", GGUF_TYPE_FLOAT32, NULL, 3.0f, 0},
         NULL,
         "yarn_ext_factor"},
        {{"llama.rope.scaling.yarn_beta_fast", GGUF_TYPE_FLOAT32, NULL, -1.0f, 0},
         NULL,
         "yarn_beta_fast"},
        {{"llama.rope.scaling.attn_factor", GGUF_TYPE_FLOAT32, NULL, INFINITY, 0},
         NULL,
         "llama.rope.scaling.attn_factor"},
        {{"llama.rope.scaling.yarn_log_multiplier", GGUF_TYPE_FLOAT32, NULL, 0.1f, 0},
         NULL,
         "yarn_log_multiplier"},
        {{"llama.rope.dimension_count", GGUF_TYPE_UINT32, NULL, 0, 16},
         NULL,
         "yarn with attention scaling on 16 of 32 dims"},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        mutate(yarn, bad, &(struct mutation){.drop_key = keys[i].drop, .set = {keys[i].set}});
        expect_load_error(bad, keys[i].want);
    }

    /* the sliding window: not an integer, negative */
    char mi[512];
    p = case_params(&cases[6], GGML_TYPE_F32);
    write_model(&p, "bad-mistral.gguf", mi, sizeof(mi));
    mutate(mi, bad,
           &(struct mutation){.set = {{"llama.attention.sliding_window", GGUF_TYPE_STRING, "6"}}});
    expect_load_error(bad, "llama.attention.sliding_window is not an integer");
    mutate(mi, bad,
           &(struct mutation){
               .set = {{"llama.attention.sliding_window", GGUF_TYPE_INT32, NULL, 0, -6}}});
    expect_load_error(bad, "llama.attention.sliding_window = -6");

    /* Qwen3's norms: missing, wrong shape, not finite */
    mutate(q3, bad, &(struct mutation){.drop_tensor = "blk.1.attn_k_norm.weight"});
    expect_load_error(bad, "missing tensor blk.1.attn_k_norm.weight");
    mutate(q3, bad,
           &(struct mutation){.drop_tensor = "blk.0.attn_q_norm.weight",
                              .clone_tensor = "blk.0.attn_norm.weight",
                              .clone_as = "blk.0.attn_q_norm.weight"});
    expect_load_error(bad, "blk.0.attn_q_norm.weight has shape");
    float qn[32];
    for (int i = 0; i < 32; i++)
        qn[i] = i == 3 ? INFINITY : 1.0f;
    mutate(q3, bad,
           &(struct mutation){.replace_tensor = "blk.0.attn_q_norm.weight", .replace_data = qn});
    expect_load_error(bad, "blk.0.attn_q_norm.weight: element 3 is not finite");
}

/* kvd mkmodel writes the llama.cpp names the loader and the reference read. */
static void test_mkmodel_names(void **state)
{
    (void)state;
    struct model_mk_params p = case_params(&cases[3], GGML_TYPE_F32);
    char path[512], err[256];
    write_model(&p, "names.gguf", path, sizeof(path));
    gguf_file *f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    const struct gguf_tensor *t = gguf_find_tensor(f, "rope_freqs.weight");
    assert_non_null(t);
    assert_int_equal(t->ne[0], 16);
    float ff[16];
    memcpy(ff, t->data, sizeof(ff));
    assert_true(ff[0] == 1.0f && ff[15] == 8.0f); /* short wavelengths kept, long ones x8 */
    const char *s;
    size_t n;
    assert_int_equal(gguf_get_str(f, "llama.rope.scaling.type", &s, &n), 0);
    assert_true(n == 4 && !memcmp(s, "yarn", 4));
    int64_t v;
    assert_int_equal(gguf_get_i64(f, "llama.rope.scaling.original_context_length", &v), 0);
    assert_int_equal(v, 64);
    gguf_close(f);

    p = case_params(&cases[4], GGML_TYPE_F32);
    write_model(&p, "names-q3.gguf", path, sizeof(path));
    f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    assert_non_null(gguf_find_tensor(f, "blk.0.attn_q_norm.weight"));
    assert_non_null(gguf_find_tensor(f, "blk.1.attn_k_norm.weight"));
    assert_null(gguf_find_tensor(f, "blk.0.attn_q.bias"));
    gguf_close(f);
    model *m = load_model(path);
    struct model_info info;
    model_get_info(m, &info);
    assert_string_equal(info.arch, "qwen3");
    model_free(m);

    p.rope_scaling = "ntk";
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "rope scaling"));
    p.rope_scaling = "yarn";
    p.rope_scale_factor = 2;
    p.rope_orig_ctx = 0;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "original context"));
}

int main(int argc, char **argv)
{
    /* As test_model: passive OpenMP waiting on a shared two-core machine. */
    if (argc > 0 && !getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execv("/proc/self/exe", argv);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mkmodel_names),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_forward_matches_reference),
        cmocka_unit_test(test_parts_matter),
        cmocka_unit_test(test_evict_equals_reference),
    };
    return cmocka_run_group_tests_name("arch_modern", tests, group_setup, group_teardown);
}
