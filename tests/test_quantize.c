/*
 * test_quantize.c - the K-quant writers (q2_K to q6_K), iq4_xs's and
 * `kvd quantize`.
 *
 * Writers: rows of several distributions (uniform, all positive, all
 * negative, Gaussian with outliers, zeros, tiny and large magnitudes) are
 * encoded and decoded by the readers (qt_dequantize_row, quant.c /
 * quant_blocks.c): every element must be within half a step of its block's
 * decoded scale (iq4_xs, with uneven levels: 14 times it; the bounds
 * quant_k.c promises), and the RMS error against
 * the RMS of the row below each format's ceiling. Non-finite input and
 * scales beyond f16 are refused.
 *
 * The tool: a mkmodel model (rows of 256) quantised to every target (q4_1,
 * q5_0 and q5_1 too, whose writers test_quant checks) loads,
 * carries every metadata key of the input unchanged but general.file_type,
 * gives each tensor the type the rule names (q4_K_M: output q6_K, attn_v
 * and ffn_down q6_K on the first/last eighth and every third layer, the
 * rest q4_K, vectors as they were), and its logits stay near the f32
 * model's; stories260K (rows of 64 and 172) takes the fallbacks; hostile
 * inputs are refused with their names.
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
#include "model/requantize.h"
#include "tests/arch_ref.h"

static int group_setup(void **state)
{
    (void)state;
    return tmp_dir_create("quantize");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

/* ------------------------------------------------------------------------
 * The writers
 * ------------------------------------------------------------------------ */

static double gauss(uint32_t *s)
{
    double u = 0;
    for (int i = 0; i < 12; i++) {
        *s = *s * 1664525u + 1013904223u;
        u += (double)(*s >> 8) / 16777216.0;
    }
    return u - 6.0;
}

/* Row r of kind k (n elements). */
static void fill_row(float *x, int n, int kind, uint32_t seed)
{
    uint32_t s = seed * 2654435761u + 7;
    for (int i = 0; i < n; i++) {
        double g = gauss(&s);
        switch (kind) {
        case 0: x[i] = (float)(g * 0.02); break;                     /* weights */
        case 1: x[i] = (float)fabs(g) + 0.5f; break;                 /* all positive */
        case 2: x[i] = -(float)fabs(g) - 2.0f; break;                /* all negative */
        case 3: x[i] = (float)(i % 97 == 5 ? g * 40.0 : g); break;   /* outliers */
        case 4: x[i] = i < n / 2 ? 0.0f : (float)g; break;           /* half zeros */
        case 5: x[i] = (float)(g * 1e-6); break;                     /* tiny */
        default: x[i] = (float)(g * 3000.0); break;                  /* large */
        }
    }
}

/* Half the step of the block holding element e of a decoded row, read from
 * the block's own scales (iq4_xs: 14 steps, the widest of its uneven
 * levels' half gaps and the room above its top level). */
static double half_step(enum ggml_type t, const uint8_t *row, int e)
{
    const int g = (e % 256) / 16; /* the group of 16 */
    if (t == GGML_TYPE_IQ4_XS) {
        const uint8_t *b = row + 136 * (size_t)(e / 256);
        return 14.0 * qt_f16_to_f32(qt_rd16(b)) * abs(qt_iq4xs_scale(b, (e % 256) / 32));
    }
    if (t == GGML_TYPE_Q2_K) {
        const uint8_t *b = row + 84 * (size_t)(e / 256);
        return 0.5 * qt_f16_to_f32(qt_rd16(b + QT_Q2K_D)) * (b[QT_Q2K_SCALES + g] & 15);
    }
    if (t == GGML_TYPE_Q3_K) {
        const uint8_t *b = row + 110 * (size_t)(e / 256);
        uint32_t w[4];
        qt_q3k_scale_words(b + QT_Q3K_SCALES, w);
        int sc = (int)(w[g / 4] >> (8 * (g % 4)) & 0xff) - 32;
        return 0.5 * qt_f16_to_f32(qt_rd16(b + QT_Q3K_D)) * abs(sc);
    }
    if (t == GGML_TYPE_Q6_K) {
        const uint8_t *b = row + 210 * (size_t)(e / 256);
        double d = qt_f16_to_f32(qt_rd16(b + QT_Q6K_D));
        return 0.5 * d * abs(((const int8_t *)(b + QT_Q6K_SCALES))[(e % 256) / 16]);
    }
    size_t bytes = t == GGML_TYPE_Q4_K ? 144 : 176;
    const uint8_t *b = row + bytes * (size_t)(e / 256);
    int sc, m;
    qt_q4k_scale_min(b + QT_Q4K_SCALES, (e % 256) / 32, &sc, &m);
    return 0.5 * qt_f16_to_f32(qt_rd16(b + QT_Q4K_D)) * sc;
}

static void test_k_writers_round_trip(void **state)
{
    (void)state;
    const enum ggml_type types[6] = {GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K,
                                     GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_IQ4_XS};
    /* RMS error / RMS, Gaussian rows */
    const double ceiling[6] = {0.40, 0.18, 0.09, 0.045, 0.022, 0.12};
    enum { N = 1024, KINDS = 7 };
    float x[N], y[N];
    uint8_t row[N];
    for (int ti = 0; ti < 6; ti++) {
        enum ggml_type t = types[ti];
        for (int kind = 0; kind < KINDS; kind++) {
            double worst_ratio = 0, se = 0, sx = 0;
            for (int r = 0; r < 8; r++) {
                fill_row(x, N, kind, (uint32_t)(100 * kind + r));
                assert_int_equal(qt_quantize_row(t, x, row, N), 0);
                assert_int_equal(qt_dequantize_row(t, row, y, N), 0);
                for (int e = 0; e < N; e++) {
                    double err = fabs((double)x[e] - y[e]);
                    double bound = half_step(t, row, e) * (1 + 1e-5) + 1e-7 * fabs(x[e]);
                    if (!(err <= bound))
                        fail_msg("%s kind %d row %d element %d: |%g - %g| = %g > half step %g",
                                 qt_type_name(t), kind, r, e, x[e], y[e], err, bound);
                    worst_ratio = fmax(worst_ratio, bound > 0 ? err / bound : 0);
                    se += err * err;
                    sx += (double)x[e] * x[e];
                }
            }
            double rel = sx > 0 ? sqrt(se / sx) : 0;
            print_message("  %-5s kind %d: rms err / rms %.4f, worst err / half step %.3f\n",
                          qt_type_name(t), kind, rel, worst_ratio);
            if (kind == 0) /* Gaussian weights: the format's average error */
                assert_true(rel < ceiling[ti]);
        }
        /* refused: non-finite, a scale beyond f16, rows not of 256 */
        fill_row(x, N, 0, 1);
        x[300] = NAN;
        assert_int_equal(qt_quantize_row(t, x, row, N), -EINVAL);
        x[300] = INFINITY;
        assert_int_equal(qt_quantize_row(t, x, row, N), -EINVAL);
        x[300] = 1e9f;
        assert_int_equal(qt_quantize_row(t, x, row, N), -ERANGE);
        assert_int_equal(qt_quantize_row(t, x, row, 128), -EINVAL);
    }
}

/* ------------------------------------------------------------------------
 * kvd quantize
 * ------------------------------------------------------------------------ */

static int run_quantize(const char *in, const char *out, const char *type, char *err, size_t cap)
{
    struct model_quant_params p = {
        .in = in, .out = out, .target = model_quant_target(type), .n_threads = 2};
    struct model_quant_stats st;
    err[0] = '\0';
    return model_quantize(&p, &st, err, cap);
}

/* Logits of the first 16 tokens' last one. */
static void last_logits(const char *path, float *out)
{
    model *m = load_model(path);
    kv_cache *cache = make_cache(m, KV_F32, 16, 32);
    struct kv_policy pol = policy_none(32);
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, 16, 2);
    int32_t toks[16];
    fill_tokens(toks, 16, m->n_vocab, 4);
    struct model_batch_seq b = {.seq = seq, .tokens = toks, .n_tokens = 16, .logits = out};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
}

static enum ggml_type type_of(const gguf_file *f, const char *name)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    assert_non_null(t);
    return t->type;
}

static void test_quantize_model(void **state)
{
    (void)state;
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 256;
    p.n_layer = 16;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_ff = 512;
    p.n_vocab = 512;
    p.seed = 5;
    char in[512], out[512], err[512];
    write_model(&p, "f32.gguf", in, sizeof(in));
    snprintf(out, sizeof(out), "%s/q.gguf", tmp_dir);
    int nv = 512;
    float *ref = malloc(sizeof(float) * nv), *lg = malloc(sizeof(float) * nv);
    last_logits(in, ref);
    const char *types[13] = {"q8_0",   "q4_0",   "q4_K", "q5_K", "q6_K", "q4_K_M", "q5_K_M",
                             "q3_K",   "q2_K",   "iq4_xs", "q4_1", "q5_0", "q5_1"};
    /* Ceilings about 1.5x what was measured (a 16-layer random model
     * amplifies weight error; the activations of quantised products are
     * 8-bit too), and the order the bits promise, checked below. */
    const float bound[13] = {0.06f, 0.5f, 0.55f, 0.28f, 0.1f, 0.5f, 0.25f,
                             0.85f, 2.4f, 0.63f, 0.45f, 0.3f, 0.3f};
    float got[13];
    for (int i = 0; i < 13; i++) {
        assert_int_equal(run_quantize(in, out, types[i], err, sizeof(err)), 0);
        last_logits(out, lg);
        float e = rel_diff(lg, ref, nv);
        print_message("  %-6s: logits differ from f32 by %.4f (relative to the largest)\n",
                      types[i], e);
        assert_true(e < bound[i]);
        assert_true(e > 0.0f);
        got[i] = e;

        gguf_file *fi = gguf_open(in, err, sizeof(err)), *fo = gguf_open(out, err, sizeof(err));
        assert_non_null(fi);
        assert_non_null(fo);
        /* every key kept, in order, with its value; general.file_type the mix's */
        assert_int_equal(gguf_n_kv(fi), gguf_n_kv(fo));
        for (int64_t k = 0; k < gguf_n_kv(fi); k++) {
            assert_string_equal(gguf_kv_key(fi, k), gguf_kv_key(fo, k));
            assert_int_equal(gguf_kv_type(fi, k), gguf_kv_type(fo, k));
        }
        uint32_t ft;
        assert_int_equal(gguf_get_u32(fo, "general.file_type", &ft), 0);
        assert_int_equal(ft, model_quant_target(types[i])->ftype);
        const char *s1, *s2;
        size_t n1, n2;
        assert_int_equal(gguf_get_str(fi, "general.name", &s1, &n1), 0);
        assert_int_equal(gguf_get_str(fo, "general.name", &s2, &n2), 0);
        assert_true(n1 == n2 && !memcmp(s1, s2, n1));
        /* the rule's types */
        const struct model_quant_target *tg = model_quant_target(types[i]);
        assert_int_equal(type_of(fo, "output.weight"), tg->output);
        assert_int_equal(type_of(fo, "blk.0.attn_q.weight"), tg->base);
        assert_int_equal(type_of(fo, "blk.0.attn_v.weight"), tg->more);   /* first eighth */
        assert_int_equal(type_of(fo, "blk.15.ffn_down.weight"), tg->more); /* last eighth */
        assert_int_equal(type_of(fo, "blk.4.attn_v.weight"), tg->more);   /* (4 - 2) % 3 == 2 */
        assert_int_equal(type_of(fo, "blk.5.attn_v.weight"), tg->base);
        assert_int_equal(type_of(fo, "blk.5.ffn_norm.weight"), GGML_TYPE_F32);
        gguf_close(fi);
        gguf_close(fo);
    }
    assert_true(got[4] < got[3] && got[3] < got[2]); /* q6_K < q5_K < q4_K */
    assert_true(got[5] < got[2] && got[6] < got[3]); /* a mix beats its base type */
    assert_true(got[0] < got[4]);                    /* q8_0 beats them all */
    assert_true(got[2] < got[7] && got[7] < got[8]); /* q4_K < q3_K < q2_K */
    assert_true(got[9] < got[7]);                    /* iq4_xs's 4 bits beat q3_K */
    assert_true(got[11] < got[1] && got[12] < got[10]); /* a fifth bit beats four */
    free(ref);
    free(lg);
}

/* A model of width 96 (rows of 96: no super-block of 256) and feed-forward
 * 256: its matrices of 96 take the mainstream tool's formats of 32 (q4_K
 * -> q5_0, q5_K -> q5_1, q6_K -> q8_0, the smaller types -> q4_0), its
 * ffn_down (rows of 256) the target's own type; the file loads. */
static void test_quantize_fallback_types(void **state)
{
    (void)state;
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 96;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_ff = 256;
    char in[512], out[512], err[512];
    write_model(&p, "w96.gguf", in, sizeof(in));
    snprintf(out, sizeof(out), "%s/w96q.gguf", tmp_dir);
    const struct {
        const char *target;
        enum ggml_type narrow, wide; /* rows of 96; ffn_down's rows of 256 */
    } cases[] = {
        {"q4_K", GGML_TYPE_Q5_0, GGML_TYPE_Q4_K}, {"q5_K", GGML_TYPE_Q5_1, GGML_TYPE_Q5_K},
        {"q6_K", GGML_TYPE_Q8_0, GGML_TYPE_Q6_K}, {"q3_K", GGML_TYPE_Q4_0, GGML_TYPE_Q3_K},
        {"q2_K", GGML_TYPE_Q4_0, GGML_TYPE_Q2_K}, {"iq4_xs", GGML_TYPE_Q4_0, GGML_TYPE_IQ4_XS},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        assert_int_equal(run_quantize(in, out, cases[i].target, err, sizeof(err)), 0);
        gguf_file *f = gguf_open(out, err, sizeof(err));
        assert_non_null(f);
        assert_int_equal(type_of(f, "blk.0.attn_q.weight"), cases[i].narrow);
        assert_int_equal(type_of(f, "blk.1.ffn_up.weight"), cases[i].narrow);
        assert_int_equal(type_of(f, "blk.1.ffn_down.weight"), cases[i].wide);
        gguf_close(f);
        model_free(load_model(out));
    }
}

/* stories260K: rows of 64 (q4_K falls back to q5_0) and of 172 (kept). */
static void test_quantize_fallbacks(void **state)
{
    (void)state;
    char in[512], out[512], err[512];
    const char *dir = getenv("KVD_SHARED");
    snprintf(in, sizeof(in), "%s/models/stories260K.gguf", dir && *dir ? dir : "../shared");
    if (access(in, R_OK)) {
        print_message("skipping: %s not found (set KVD_SHARED)\n", in);
        skip();
        return;
    }
    snprintf(out, sizeof(out), "%s/s.gguf", tmp_dir);
    assert_int_equal(run_quantize(in, out, "q4_K_M", err, sizeof(err)), 0);
    gguf_file *f = gguf_open(out, err, sizeof(err));
    assert_non_null(f);
    assert_int_equal(type_of(f, "blk.0.attn_q.weight"), GGML_TYPE_Q5_0);
    assert_int_equal(type_of(f, "blk.0.ffn_down.weight"), GGML_TYPE_F32);
    gguf_close(f);
    model *m = load_model(out);
    model_free(m);
}

static void test_quantize_refused(void **state)
{
    (void)state;
    char in[512], out[512], bad[512], err[512];
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_layer = 1;
    write_model(&p, "small.gguf", in, sizeof(in));
    snprintf(out, sizeof(out), "%s/o.gguf", tmp_dir);
    snprintf(bad, sizeof(bad), "%s/bad.gguf", tmp_dir);
    assert_null(model_quant_target("q3_K_M"));
    assert_null(model_quant_target(NULL));
    struct model_quant_params qp = {.in = in, .out = out, .target = NULL};
    struct model_quant_stats st;
    assert_int_equal(model_quantize(&qp, &st, err, sizeof(err)), -EINVAL);
    /* a missing input, an output that cannot be written */
    assert_int_equal(run_quantize("/nonexistent/x.gguf", out, "q8_0", err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "/nonexistent/x.gguf"));
    assert_true(run_quantize(in, "/nonexistent/dir/o.gguf", "q8_0", err, sizeof(err)) < 0);
    assert_int_equal(access("/nonexistent/dir/o.gguf", F_OK), -1);
    /* a weight that is not finite: refused with the tensor and row named */
    float *nanrow = malloc(sizeof(float) * 256 * 256);
    gguf_file *f = gguf_open(in, err, sizeof(err));
    const struct gguf_tensor *t = gguf_find_tensor(f, "blk.0.attn_q.weight");
    memcpy(nanrow, t->data, t->size);
    gguf_close(f);
    nanrow[256 * 7 + 3] = NAN;
    mutate(in, bad,
           &(struct mutation){.replace_tensor = "blk.0.attn_q.weight", .replace_data = nanrow});
    assert_int_equal(run_quantize(bad, out, "q4_K", err, sizeof(err)), -EINVAL);
    print_message("  refused: %s\n", err);
    assert_non_null(strstr(err, "tensor blk.0.attn_q.weight: row 7 cannot be written as q4_K"));
    assert_int_equal(access(out, F_OK), -1); /* nothing written */
    free(nanrow);
}

/* The command line: a bad type, a missing argument, a summary. */
static void test_quantize_cli(void **state)
{
    (void)state;
    char in[512], cmd[2048];
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_layer = 2;
    write_model(&p, "cli.gguf", in, sizeof(in));
    const char *kvd = getenv("KVD_BIN");
    if (!kvd) {
        skip();
        return;
    }
    snprintf(cmd, sizeof(cmd), "%s quantize %s %s/c.gguf --type q7_K 2>/dev/null", kvd, in,
             tmp_dir);
    int rc = system(cmd);
    assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
    snprintf(cmd, sizeof(cmd), "%s quantize %s --type q8_0 2>/dev/null", kvd, in);
    rc = system(cmd);
    assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 2);
    snprintf(cmd, sizeof(cmd), "%s quantize %s %s/c.gguf --type q6_K | grep -q 'wrote .*q6_K'",
             kvd, in, tmp_dir);
    rc = system(cmd);
    assert_true(WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
}

/* kvd mkmodel writes the K types directly (rows of 256), and refuses rows that are not. */
static void test_mkmodel_k_types(void **state)
{
    (void)state;
    const enum ggml_type types[5] = {GGML_TYPE_Q2_K, GGML_TYPE_Q3_K, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K,
                                     GGML_TYPE_Q6_K};
    for (int i = 0; i < 5; i++) {
        struct model_mk_params p;
        model_mk_defaults(&p);
        p.n_embd = 256;
        p.n_layer = 1;
        p.n_ff = 512;
        p.type = types[i];
        char path[512], err[256];
        write_model(&p, "mk-k.gguf", path, sizeof(path));
        model *m = load_model(path);
        assert_string_equal(m->weight_type, qt_type_name(types[i]));
        assert_int_equal(m->layers[0].down.type, types[i]);
        model_free(m);
        p.n_ff = 320;
        assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
        assert_non_null(strstr(err, "multiples of 256"));
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_k_writers_round_trip),
        cmocka_unit_test(test_quantize_model),
        cmocka_unit_test(test_quantize_fallback_types),
        cmocka_unit_test(test_quantize_fallbacks),
        cmocka_unit_test(test_quantize_refused),
        cmocka_unit_test(test_quantize_cli),
        cmocka_unit_test(test_mkmodel_k_types),
    };
    return cmocka_run_group_tests_name("quantize", tests, group_setup, group_teardown);
}
