/*
 * test_arch_gemma.c - Gemma 2 and Gemma 3, end to end, and the attention
 * soft-cap inside the fused kernel.
 *
 * Kernel: fused = reference with a soft-cap (small caps, so tanh bends
 * every score), scalar and SIMD tables, windows, gapped positions, several
 * threads, the attention mass; the capped table names itself.
 *
 * Models: random-weight files written by kvd mkmodel --arch gemma2|gemma3
 * (head dims apart from dim / heads, local windows shorter than the
 * sequences, Gemma 3's linear scaling on its global layers and its own
 * local base) against tests/arch_ref.h's reference, written apart from
 * model/forward.c: it says which layers slide the way Hugging Face's
 * configs do (layer_idx % 2 == 0; (layer_idx + 1) % 6 != 0), caps in
 * double, and scales the embedding in double. Each Gemma part is shown to
 * matter (the reference without it moves the logits), eviction keeps the
 * cache's promise with windowed layers, and every new key and tensor is
 * refused with its name when wrong.
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

#include "attention/attention.h"
#include "model/mkmodel.h"
#include "model/model_internal.h"
#include "model/quant.h"
#include "tests/arch_ref.h"

static int group_setup(void **state)
{
    (void)state;
    return tmp_dir_create("gemma");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

/* ------------------------------------------------------------------------
 * The soft-cap in the fused kernel
 * ------------------------------------------------------------------------ */

static float urand(uint32_t *s)
{
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/*
 * One layer's f32 K/V in shuffled pages, two sequences (a 9-query chunk
 * over 150 keys with gapped positions; one decode query over 40), scored
 * with the cap by the fused kernel (scalar or SIMD) and with ref_cap by the
 * reference. Returns the largest output difference; with equal caps the
 * masses must agree too.
 */
static double softcap_case(float cap, float ref_cap, int window, enum pos_kind kind, bool scalar,
                           int threads)
{
    enum { H = 4, G = 2, D = 64, PT = 16, NP = 16 };
    const int n_kv[2] = {150, 40}, n_q[2] = {9, 1};
    size_t krow = sizeof(float) * D, page = 2 * (size_t)G * PT * krow;
    uint8_t *base = aligned_alloc(64, page * NP);
    assert_non_null(base);
    uint32_t s = 7;
    for (size_t i = 0; i < page * NP / sizeof(float); i++)
        ((float *)base)[i] = 3.0f * urand(&s); /* scores of tens: the cap bends them */
    int32_t table[2][10], pos[2][150], qpos[2][9];
    int next = NP - 1;
    for (int q = 0; q < 2; q++) {
        for (int p = 0; p < (n_kv[q] + PT - 1) / PT; p++)
            table[q][p] = next--; /* pages in reverse order */
        for (int i = 0; i < n_kv[q]; i++)
            pos[q][i] = i + (i > 60 ? 13 : 0); /* a hole after eviction */
        for (int i = 0; i < n_q[q]; i++)
            qpos[q][i] = pos[q][n_kv[q] - n_q[q] + i];
    }
    float *q = malloc(sizeof(float) * 10 * H * D), *o1 = calloc(10 * H * D, sizeof(float));
    float *o2 = calloc(10 * H * D, sizeof(float)), *m1 = calloc(200, sizeof(float));
    float *m2 = calloc(200, sizeof(float));
    for (int i = 0; i < 10 * H * D; i++)
        q[i] = urand(&s);
    float slopes[H] = {0.5f, 0.25f, 0.125f, 0.0625f};
    struct attn_params ap = {.n_head = H,
                             .n_kv_head = G,
                             .head_dim = D,
                             .scale = 0.125f,
                             .softcap = cap,
                             .n_threads = threads,
                             .force_scalar = scalar};
    if (kind == POS_ROPE)
        ap.pos = (struct pos_scheme){.kind = POS_ROPE, .rope_theta = 10000, .rope_dims = D,
                                     .rope_pairing = POS_ROPE_NEOX, .rope_freq_scale = 1};
    else if (kind == POS_ALIBI)
        ap.pos = (struct pos_scheme){.kind = POS_ALIBI, .alibi_slopes = slopes};
    struct attn_kv kv = {.base = base, .page_bytes = page, .k_offset = 0,
                         .v_offset = (size_t)G * PT * krow, .page_tokens = PT,
                         .k_type = ATTN_F32, .v_type = ATTN_F32, .n_pages = NP,
                         .sliding_window = window};
    struct attn_seq sq[2][2];
    float *outs[2] = {o1, o2}, *mass[2] = {m1, m2};
    for (int v = 0; v < 2; v++)
        for (int k = 0; k < 2; k++)
            sq[v][k] = (struct attn_seq){.page_table = table[k], .pos = pos[k], .n_kv = n_kv[k],
                                         .n_q = n_q[k], .q_pos = qpos[k],
                                         .q = q + (size_t)k * 9 * H * D,
                                         .out = outs[v] + (size_t)k * 9 * H * D,
                                         .mass = mass[v] + k * 160};
    char err[200];
    attn_ctx *ctx = attn_create(&ap, err, sizeof(err));
    assert_non_null(ctx);
    assert_int_equal(attn_run(ctx, &kv, sq[0], 2), 0);
    struct attn_params rp = ap;
    rp.softcap = ref_cap;
    assert_int_equal(attn_reference(&rp, &kv, sq[1], 2), 0);
    double worst = 0;
    for (int i = 0; i < 10 * H * D; i++)
        worst = fmax(worst, fabs((double)o1[i] - o2[i]));
    for (int i = 0; i < 200 && cap == ref_cap; i++)
        assert_true(fabs((double)m1[i] - m2[i]) < 1e-4);
    attn_destroy(ctx);
    free(base);
    free(q);
    free(o1);
    free(o2);
    free(m1);
    free(m2);
    return worst;
}

static void test_kernel_softcap(void **state)
{
    (void)state;
    const float caps[3] = {0.5f, 5.0f, 50.0f};
    const enum pos_kind kinds[3] = {POS_NONE, POS_ROPE, POS_ALIBI};
    for (int c = 0; c < 3; c++)
        for (int k = 0; k < 3; k++)
            for (int scalar = 0; scalar < 2; scalar++) {
                int window = c == 1 ? 17 : 0, threads = 1 + (c + k + scalar) % 3;
                double e = softcap_case(caps[c], caps[c], window, kinds[k], scalar, threads);
                print_message("  cap %-4g %s window %2d %s, %d threads: max |fused - ref| %.2e\n",
                              caps[c], pos_kind_name(kinds[k]), window,
                              scalar ? "scalar" : attn_simd_name(), threads, e);
                assert_true(e < 2e-5);
            }
    /* The cap is not ignored: against an uncapped reference the outputs move. */
    double moved = softcap_case(5.0f, 0.0f, 0, POS_NONE, false, 1);
    print_message("  cap 5 against no cap: outputs move by %.2e\n", moved);
    assert_true(moved > 1e-2);
    /* The path names itself; a bad cap is refused. */
    assert_string_equal(attn_path_name(0.0f), attn_simd_name());
    char want[64];
    snprintf(want, sizeof(want), "%s+softcap", attn_simd_name());
    assert_string_equal(attn_path_name(30.0f), want);
    struct attn_params bad = {.n_head = 1, .n_kv_head = 1, .head_dim = 32, .scale = 1,
                              .softcap = -1};
    char err[200];
    assert_null(attn_create(&bad, err, sizeof(err)));
    assert_non_null(strstr(err, "softcap"));
    bad.softcap = NAN;
    assert_null(attn_create(&bad, err, sizeof(err)));
    bad.softcap = INFINITY;
    assert_null(attn_create(&bad, err, sizeof(err)));
}

/* ------------------------------------------------------------------------
 * Models
 * ------------------------------------------------------------------------ */

struct gcase {
    const char *name;
    const char *arch;
    int dim, heads, kv_heads, head_dim, layers, window;
    float attn_cap, final_cap; /* gemma2; 0 = the loader's defaults */
    float theta_swa;           /* gemma3; 0 = 10000 */
    const char *scaling;       /* gemma3 global layers: linear */
};

static const struct gcase cases[] = {
    {"gemma2-caps-2/3", "gemma2", 128, 4, 2, 48, 4, 5, 2.0f, 3.0f, 0, NULL},
    {"gemma2-defaults", "gemma2", 96, 6, 3, 32, 3, 7, 0, 0, 0, NULL},
    {"gemma3-linear-x8", "gemma3", 96, 4, 1, 64, 7, 6, 0, 0, 0, "linear"},
    {"gemma3-swa-base", "gemma3", 128, 4, 2, 32, 8, 4, 0, 0, 20000.0f, NULL},
};

static struct model_mk_params gcase_params(const struct gcase *c, enum ggml_type type)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = c->arch;
    p.n_embd = c->dim;
    p.n_head = c->heads;
    p.n_kv_head = c->kv_heads;
    p.head_dim = c->head_dim;
    p.n_layer = c->layers;
    p.n_ff = 96;
    p.n_vocab = 300;
    p.seed = 23;
    p.rope_theta = !strcmp(c->arch, "gemma3") ? 1000000.0f : 10000.0f;
    p.sliding_window = c->window;
    p.attn_softcap = c->attn_cap;
    p.final_softcap = c->final_cap;
    p.rope_theta_swa = c->theta_swa;
    p.rope_scaling = c->scaling;
    p.rope_scale_factor = c->scaling ? 8.0f : 0.0f;
    p.type = type;
    return p;
}

static void test_forward_matches_reference(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        forward_vs_reference_types(cases[i].name, gcase_params(&cases[i], GGML_TYPE_F32));
}

/* The reference without Gemma part *(int *)ctx, numbered as in
 * test_parts_matter (ref_part_effect). */
static void gemma_cut(struct ref_model *r, const char *path, void *ctx)
{
    (void)path;
    int part = *(const int *)ctx;
    for (int l = 0; l < r->n_layer; l++) {
        struct ref_layer *L = &r->L[l];
        if (part == 2 || part == 3) {
            float **pp = part == 2 ? &L->post_attn : &L->post_ffn;
            free(*pp);
            *pp = NULL;
        }
        if (part == 5)
            L->window = 0;
    }
    if (part == 0)
        r->attn_cap = 0;
    if (part == 1)
        r->final_cap = 0;
    if (part == 4)
        r->emb_scale = 1;
    if (part == 6)
        r->theta_local = r->theta;
}

/*
 * Every Gemma part matters: the reference (which the forward matches to
 * 1e-5) gives other logits with the part left out, by far more than 1e-5.
 */
static void test_parts_matter(void **state)
{
    (void)state;
    enum { PARTS = 7 };
    const char *what[PARTS] = {"attention soft-cap", "final soft-cap", "post-attention norm",
                               "post-MLP norm",      "embedding scale", "local windows",
                               "local RoPE base"};
    for (int part = 0; part < PARTS; part++) {
        struct model_mk_params p = gcase_params(&cases[part < 6 ? 0 : 3], GGML_TYPE_F32);
        assert_true(ref_part_effect(&p, what[part], 24, 9, gemma_cut, &part) > 1e-3f);
    }
}

/* Eviction through windowed layers: the cache's promise holds. */
static void test_evict_equals_reference(void **state)
{
    (void)state;
    for (int c = 0; c < 4; c += 2) {
        struct model_mk_params p = gcase_params(&cases[c], GGML_TYPE_F32);
        evict_both_ways(cases[c].name, &p, 41 + (uint32_t)c);
    }
}

/* ------------------------------------------------------------------------
 * Files
 * ------------------------------------------------------------------------ */

static void test_load_errors(void **state)
{
    (void)state;
    char g2[512], g3[512], bad[512];
    struct model_mk_params p = gcase_params(&cases[0], GGML_TYPE_F32);
    write_model(&p, "bad-g2.gguf", g2, sizeof(g2));
    p = gcase_params(&cases[2], GGML_TYPE_F32);
    write_model(&p, "bad-g3.gguf", g3, sizeof(g3));
    snprintf(bad, sizeof(bad), "%s/bad.gguf", tmp_dir);

    struct {
        const char *src;
        struct kv_set set;
        const char *drop, *want;
    } keys[] = {
        {g2, {"gemma2.attn_logit_softcapping", GGUF_TYPE_FLOAT32, NULL, -50.0f, 0}, NULL,
         "gemma2.attn_logit_softcapping = -50 must be positive"},
        {g2, {"gemma2.attn_logit_softcapping", GGUF_TYPE_FLOAT32, NULL, 0.0f, 0}, NULL,
         "gemma2.attn_logit_softcapping = 0 must be positive"},
        {g2, {"gemma2.attn_logit_softcapping", GGUF_TYPE_STRING, "50", 0, 0}, NULL,
         "gemma2.attn_logit_softcapping is not a finite number"},
        {g2, {"gemma2.final_logit_softcapping", GGUF_TYPE_FLOAT32, NULL, INFINITY, 0}, NULL,
         "gemma2.final_logit_softcapping is not a finite number"},
        {g2, {"gemma2.final_logit_softcapping", GGUF_TYPE_FLOAT32, NULL, -1.0f, 0}, NULL,
         "gemma2.final_logit_softcapping = -1"},
        {g2, {"gemma2.attention.sliding_window", GGUF_TYPE_INT32, NULL, 0, 0}, NULL,
         "gemma2.attention.sliding_window = 0 is outside"},
        {g2, {"gemma2.attention.sliding_window", GGUF_TYPE_STRING, "5", 0, 0}, NULL,
         "gemma2.attention.sliding_window is not an integer"},
        {g2, {"gemma2.attention.layer_norm_rms_epsilon", GGUF_TYPE_FLOAT32, NULL, -1e-6f, 0},
         NULL, "gemma2.attention.layer_norm_rms_epsilon"},
        {g3, {NULL, 0, NULL, 0, 0}, "gemma3.attention.sliding_window",
         "missing metadata key gemma3.attention.sliding_window"},
        {g3, {"gemma3.rope.freq_base_swa", GGUF_TYPE_FLOAT32, NULL, -10000.0f, 0}, NULL,
         "gemma3.rope.freq_base_swa = -10000 must be positive"},
        {g3, {"gemma3.rope.freq_base_swa", GGUF_TYPE_FLOAT32, NULL, NAN, 0}, NULL,
         "gemma3.rope.freq_base_swa is not a finite number"},
        {g3, {"gemma3.rope.scaling.type", GGUF_TYPE_STRING, "yarn", 0, 0}, NULL,
         "gemma3.rope.scaling.original_context_length"},
        {g3, {"gemma3.attention.key_length", GGUF_TYPE_UINT32, NULL, 0, 2000}, NULL,
         "gemma3.attention.key_length = 2000 is outside"},
    };
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        mutate(keys[i].src, bad, &(struct mutation){.drop_key = keys[i].drop, .set = {keys[i].set}});
        expect_load_error(bad, keys[i].want);
    }
    /* YaRN (complete) and rope_freqs are not Gemma's */
    mutate(g3, bad,
           &(struct mutation){
               .set = {{"gemma3.rope.scaling.type", GGUF_TYPE_STRING, "yarn", 0, 0},
                       {"gemma3.rope.scaling.original_context_length", GGUF_TYPE_UINT32, NULL, 0,
                        4096}}});
    expect_load_error(bad, "YaRN scaling are not supported for Gemma");
    char narrow[512]; /* dim 32 = head_dim / 2: its norm has rope_freqs' length */
    p = gcase_params(&cases[2], GGML_TYPE_F32);
    p.n_embd = 32;
    p.n_layer = 1;
    write_model(&p, "narrow-g3.gguf", narrow, sizeof(narrow));
    mutate(narrow, bad,
           &(struct mutation){.clone_tensor = "blk.0.attn_norm.weight",
                              .clone_as = "rope_freqs.weight"});
    expect_load_error(bad, "rope_freqs.weight and YaRN scaling are not supported for Gemma");

    /* the tensors Gemma adds: missing, wrong shape, not finite */
    mutate(g2, bad, &(struct mutation){.drop_tensor = "blk.1.post_attention_norm.weight"});
    expect_load_error(bad, "missing tensor blk.1.post_attention_norm.weight");
    mutate(g2, bad, &(struct mutation){.drop_tensor = "blk.3.post_ffw_norm.weight"});
    expect_load_error(bad, "missing tensor blk.3.post_ffw_norm.weight");
    mutate(g2, bad,
           &(struct mutation){.drop_tensor = "blk.0.post_ffw_norm.weight",
                              .clone_tensor = "blk.0.attn_output.weight",
                              .clone_as = "blk.0.post_ffw_norm.weight"});
    expect_load_error(bad, "blk.0.post_ffw_norm.weight has shape [192, 128");
    float w[128];
    for (int i = 0; i < 128; i++)
        w[i] = i == 9 ? NAN : 1.0f;
    mutate(g2, bad,
           &(struct mutation){.replace_tensor = "blk.2.post_attention_norm.weight",
                              .replace_data = w});
    expect_load_error(bad, "blk.2.post_attention_norm.weight: element 9 is not finite");
    mutate(g2, bad, &(struct mutation){.drop_tensor = "blk.0.ffn_gate.weight"});
    expect_load_error(bad, "missing tensor blk.0.ffn_gate.weight");
    mutate(g3, bad, &(struct mutation){.drop_tensor = "blk.5.attn_k_norm.weight"});
    expect_load_error(bad, "missing tensor blk.5.attn_k_norm.weight");
    float qn[64];
    for (int i = 0; i < 64; i++)
        qn[i] = i == 2 ? -INFINITY : 1.0f;
    mutate(g3, bad,
           &(struct mutation){.replace_tensor = "blk.6.attn_q_norm.weight", .replace_data = qn});
    expect_load_error(bad, "blk.6.attn_q_norm.weight: element 2 is not finite");
}

/* The loader reads what mkmodel writes: windows on the right layers, caps,
 * scales, the local base; mkmodel refuses what Gemma is not. */
static void test_loaded_shape(void **state)
{
    (void)state;
    char path[512], err[256];
    struct model_mk_params p = gcase_params(&cases[1], GGML_TYPE_F32);
    write_model(&p, "shape-g2.gguf", path, sizeof(path));
    gguf_file *f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    assert_null(gguf_find_tensor(f, "output.weight")); /* tied, as Gemma */
    assert_non_null(gguf_find_tensor(f, "blk.2.post_ffw_norm.weight"));
    float x;
    assert_int_equal(gguf_get_f32(f, "gemma2.attn_logit_softcapping", &x), -ENOENT);
    gguf_close(f);
    model *m = load_model(path);
    assert_true(m->attn_softcap == 50.0f && m->final_softcap == 30.0f); /* llama.cpp's defaults */
    assert_true(m->tied && m->head_dim == 32 && m->q_dim == 192);
    assert_true(fabsf(m->emb_scale - sqrtf(96.0f)) < 1e-6f);
    assert_true(fabsf(m->attn_scale - 1.0f / sqrtf(32.0f)) < 1e-7f);
    for (int l = 0; l < 3; l++)
        assert_int_equal(m->layers[l].sliding_window, l % 2 ? 0 : 7);
    struct model_info info;
    model_get_info(m, &info);
    assert_true(info.attn_softcap == 50.0f);
    model_free(m);

    p = gcase_params(&cases[3], GGML_TYPE_F32);
    write_model(&p, "shape-g3.gguf", path, sizeof(path));
    m = load_model(path);
    for (int l = 0; l < 8; l++) {
        bool global = l == 5;
        assert_int_equal(m->layers[l].sliding_window, global ? 0 : 4);
        assert_int_equal(m->layers[l].local_rope, !global);
    }
    assert_true(m->pos.rope_theta == 1000000.0f && m->pos_local.rope_theta == 20000.0f);
    assert_true(m->attn_softcap == 0.0f && m->final_softcap == 0.0f);
    model_free(m);
    p = gcase_params(&cases[2], GGML_TYPE_F32);
    write_model(&p, "shape-g3l.gguf", path, sizeof(path));
    m = load_model(path);
    assert_true(m->pos.rope_freq_scale == 0.125f && m->pos_local.rope_freq_scale == 1.0f);
    assert_true(m->pos_local.rope_theta == 10000.0f);
    model_free(m);

    p = gcase_params(&cases[2], GGML_TYPE_F32);
    p.sliding_window = 0;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "gemma3 needs a sliding window"));
    p = gcase_params(&cases[2], GGML_TYPE_F32);
    p.attn_softcap = 50;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "soft-caps are gemma2 options"));
    p = gcase_params(&cases[0], GGML_TYPE_F32);
    p.rope_freqs = true;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "without rope_freqs or YaRN"));
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel_softcap),
        cmocka_unit_test(test_loaded_shape),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_forward_matches_reference),
        cmocka_unit_test(test_parts_matter),
        cmocka_unit_test(test_evict_equals_reference),
    };
    return cmocka_run_group_tests_name("arch_gemma", tests, group_setup, group_teardown);
}
