/*
 * test_arch.c - the offset-only-bias models: BLOOM and MPT (ALiBi) and the
 * T5-bias decoder (a llama-shaped model with a learned bias per T5 bucket),
 * end to end.
 *
 * The centre is a plain reference forward (tests/arch_ref.h), written
 * apart from model/forward.c: its own LayerNorm/RMSNorm, GELU and SwiGLU,
 * the fused QKV split by hand, ALiBi slopes from the papers' formulas (not
 * from posenc), and an attention that materialises every score and every
 * bias from the position numbers, one token at a time. kvd's forward, with
 * its batched products, paged cache and fused kernel that never builds a
 * bias matrix, must agree with it on several shapes and head counts.
 *
 * Then the design's promise for offset-only biases: evicting tokens and
 * renumbering (or preserving) positions needs no rewrite of any cached
 * byte, and the logits still equal
 *   (1) for one layer, a fresh forward over exactly the retained tokens
 *       (renumber: at 0..n-1; preserve: at their original positions);
 *   (2) for many layers, the reference holding the same retained K/V at the
 *       same positions;
 *   (3) and shifting every position by a constant changes nothing.
 * A sign test pins the offset convention through the whole model, a 32k
 * context shows no L x L bias is ever allocated, and hostile files are
 * rejected with the key or tensor named.
 *
 * CLI tests run the binary named by KVD_BIN (make test sets it): kvd
 * mkmodel and kvd generate for every kind, and kvd serve, whose
 * /v1/models names the architecture and position scheme and whose greedy
 * completion equals kvd generate's text.
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
#include <jansson.h>

#include "model/mkmodel.h"
#include "model/model_internal.h"
#include "model/quant.h"
#include "tests/arch_ref.h"
#include "tests/serve_util.h"

/* ------------------------------------------------------------------------
 * Fixtures (the shared ones are in tests/arch_ref.h)
 * ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return tmp_dir_create("arch");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

/* A small model of the given architecture and position scheme. */
static struct model_mk_params arch_params(const char *arch, const char *position, int dim,
                                          int heads, int kv_heads, int layers)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = arch;
    p.position = position;
    p.n_embd = dim;
    p.n_head = heads;
    p.n_kv_head = kv_heads;
    p.n_layer = layers;
    p.n_ff = 96;
    p.n_vocab = 300;
    p.seed = 11;
    p.t5_num_buckets = 8; /* exact range 4, logarithmic up to 12: saturates in the tests */
    p.t5_max_distance = 12;
    return p;
}

/* ------------------------------------------------------------------------
 * Forward vs reference
 * ------------------------------------------------------------------------ */

struct arch_case {
    const char *name;
    const char *arch, *position;
    int dim, heads, kv_heads, layers;
    float max_bias, clamp;
    bool tied;
};

static const struct arch_case cases[] = {
    /* ALiBi, head counts 8 and 12 (12: BLOOM's interleave for non-powers of two). */
    {"bloom-h8", "bloom", NULL, 64, 8, 8, 2, 0.0f, 0.0f, true},
    {"bloom-h12", "bloom", NULL, 96, 12, 12, 2, 0.0f, 0.0f, true},
    {"bloom-h12-gqa3", "bloom", NULL, 96, 12, 4, 1, 0.0f, 0.0f, true},
    {"mpt-h8-clamp", "mpt", NULL, 64, 8, 8, 2, 8.0f, 1.5f, false},
    {"mpt-h12-bias16-tied", "mpt", NULL, 96, 12, 12, 2, 16.0f, 0.0f, true},
    {"llama-alibi-h12-gqa2", "llama", "alibi", 96, 12, 6, 2, 8.0f, 0.0f, false},
    /* T5 bias decoder: llama-shaped, MHA and GQA; qwen2 (biases) too. */
    {"llama-t5-h8", "llama", "t5", 64, 8, 8, 2, 0.0f, 0.0f, false},
    {"llama-t5-h4-gqa2", "llama", "t5", 64, 4, 2, 3, 0.0f, 0.0f, true},
    {"qwen2-t5-h6-gqa3", "qwen2", "t5", 96, 6, 2, 2, 0.0f, 0.0f, false},
};

static struct model_mk_params case_params(const struct arch_case *c, enum ggml_type type)
{
    struct model_mk_params p =
        arch_params(c->arch, c->position, c->dim, c->heads, c->kv_heads, c->layers);
    p.alibi_max_bias = c->max_bias;
    p.clamp_kqv = c->clamp;
    p.tied = c->tied;
    p.type = type;
    return p;
}

static void test_forward_matches_reference(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct model_mk_params p = case_params(&cases[i], GGML_TYPE_F32);
        char path[512], name[96];
        snprintf(name, sizeof(name), "ref-%s.gguf", cases[i].name);
        write_model(&p, name, path, sizeof(path));
        for (int threads = 1; threads <= 3; threads += 2) {
            float e = check_against_reference(path, KV_F32, threads);
            print_message("  %-22s f32, %d threads: max rel diff %.2e\n", cases[i].name, threads,
                          e);
            assert_true(e < 1e-4f);
        }
    }
    /* f16 weights and f16 KV (the reference rounds its K/V the same way). */
    for (size_t i = 1; i < sizeof(cases) / sizeof(cases[0]); i += 3) {
        struct model_mk_params p = case_params(&cases[i], GGML_TYPE_F16);
        char path[512], name[96];
        snprintf(name, sizeof(name), "ref-%s-f16.gguf", cases[i].name);
        write_model(&p, name, path, sizeof(path));
        float e = check_against_reference(path, KV_F16, 2);
        print_message("  %-22s f16 weights, f16 KV: max rel diff %.2e\n", cases[i].name, e);
        assert_true(e < 1e-3f);
    }
}

/*
 * The parts of the architectures each matter: the same weights (mkmodel
 * seeds each tensor by its name) with the clamp, the max_bias or the T5
 * table changed give different logits, so a forward that ignored them
 * could not pass the reference test above.
 */
static void test_parts_matter(void **state)
{
    (void)state;
    struct {
        const char *what;
        struct model_mk_params a, b;
    } pairs[4];
    pairs[0].what = "mpt clamp 1.5 vs none";
    pairs[0].a = case_params(&cases[3], GGML_TYPE_F32);
    pairs[0].b = pairs[0].a;
    pairs[0].b.clamp_kqv = 0.0f;
    pairs[1].what = "mpt max_bias 16 vs 8";
    pairs[1].a = case_params(&cases[4], GGML_TYPE_F32);
    pairs[1].b = pairs[1].a;
    pairs[1].b.alibi_max_bias = 8.0f;
    pairs[2].what = "t5 table max_distance 12 vs 40";
    pairs[2].a = case_params(&cases[6], GGML_TYPE_F32);
    pairs[2].b = pairs[2].a;
    pairs[2].b.t5_max_distance = 40;
    pairs[3].what = "llama alibi vs t5";
    pairs[3].a = case_params(&cases[6], GGML_TYPE_F32);
    pairs[3].b = pairs[3].a;
    pairs[3].b.position = "alibi";
    for (int i = 0; i < 4; i++) {
        char pa[512], pb[512];
        write_model(&pairs[i].a, "parts-a.gguf", pa, sizeof(pa));
        write_model(&pairs[i].b, "parts-b.gguf", pb, sizeof(pb));
        float la[300], lb[300];
        float mx = forward_logits(pa, 24, 5, 2, la);
        forward_logits(pb, 24, 5, 2, lb);
        float e = max_abs_diff(la, lb, 300) / mx;
        print_message("  %-32s: logits differ by %.2e (relative)\n", pairs[i].what, e);
        assert_true(e > 1e-3f);
    }
}

/* Slopes: BLOOM's formula for 8 and 12 heads (and more), MPT's for other
 * max_bias values, as loaded from mkmodel files and from llama.cpp-style
 * metadata. */
static void test_alibi_slopes(void **state)
{
    (void)state;
    static const int heads[] = {1, 2, 3, 5, 6, 8, 12, 16, 20, 24, 32, 40};
    for (size_t i = 0; i < sizeof(heads) / sizeof(heads[0]); i++) {
        int H = heads[i];
        struct model_mk_params p = arch_params("bloom", NULL, 8 * H, H, H, 1);
        p.n_ff = 32;
        char path[512];
        write_model(&p, "slopes.gguf", path, sizeof(path));
        model *m = load_model(path);
        assert_int_equal(m->pos.kind, POS_ALIBI);
        double want[64];
        bloom_slopes(want, H);
        for (int h = 0; h < H; h++)
            assert_true(fabs(m->pos.alibi_slopes[h] - want[h]) <= 1e-6 * want[h]);
        model_free(m);

        /* MPT with max_bias 16 (and 8): MPT's own rule. */
        for (int k = 0; k < 2; k++) {
            double mb = k ? 16.0 : 8.0;
            p.arch = "mpt";
            p.alibi_max_bias = (float)mb;
            write_model(&p, "slopes-mpt.gguf", path, sizeof(path));
            m = load_model(path);
            mpt_slopes(want, H, mb);
            double bl[64];
            bloom_slopes(bl, H);
            for (int h = 0; h < H; h++) {
                assert_true(fabs(m->pos.alibi_slopes[h] - want[h]) <= 1e-6 * want[h]);
                if (mb == 8.0) /* the two rules agree at 8 */
                    assert_true(fabs(want[h] - bl[h]) <= 1e-12);
            }
            model_free(m);
        }
        p.alibi_max_bias = 0.0f;
    }
    /* 12 heads, spelled out: 2^-1 .. 2^-8, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5. */
    double w12[12];
    bloom_slopes(w12, 12);
    assert_true(fabs(w12[7] - pow(2.0, -8)) < 1e-15);
    assert_true(fabs(w12[8] - pow(2.0, -0.5)) < 1e-15);
    assert_true(fabs(w12[11] - pow(2.0, -3.5)) < 1e-15);
}

/* ------------------------------------------------------------------------
 * Eviction equivalence (ARCHITECTURE.md Invariant 3) for offset-only biases
 * ------------------------------------------------------------------------ */

struct evict1 {
    int checks;
    float worst_fresh; /* kvd vs a fresh kvd forward over the retained tokens */
    float worst_ref;   /* kvd vs a fresh reference forward at the retained positions */
    float min_other;   /* preserve: smallest difference to the renumbered fresh forward */
    int max_gap;       /* preserve: largest position minus the retained count */
};

/*
 * A fresh kvd forward over toks[0..n) at positions 0..s-1 (the sinks) and
 * then p, p+1, ... (the window), logits of the last: forward the sinks,
 * append placeholders (no forward) until eviction has taken every page
 * after the sinks up to past p, then cut the history at p, which removes
 * the placeholders and leaves the next position at p (preserve), and
 * forward the rest.
 */
static void fresh_with_gap(model_ctx *ctx, kv_cache *cache, const int32_t *toks, int s, int p,
                           int n, float *logits)
{
    struct kv_policy pol = sink_window(false);
    kv_seq *seq = make_seq(cache, &pol);
    struct model_batch_seq b = {.seq = seq, .tokens = toks, .n_tokens = s};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    int32_t ids[16];
    for (int i = 0; i < 16; i++)
        ids[i] = 3 + i;
    for (int appended = s; appended < p + pol.max_cache_tokens;) {
        int k = kv_seq_max_append(seq) < 16 ? kv_seq_max_append(seq) : 16;
        assert_int_equal(kv_seq_append(seq, ids, k, NULL), 0);
        appended += k;
    }
    assert_true(kv_seq_hist_index(seq)[s] >= p); /* every placeholder before p is gone */
    assert_int_equal(kv_seq_truncate(seq, p), 0);
    assert_int_equal(kv_seq_n_tokens(seq), s);
    assert_int_equal(kv_seq_next_pos(seq), p);
    b = (struct model_batch_seq){
        .seq = seq, .tokens = toks + s, .n_tokens = n - s, .logits = logits};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    const int32_t *pos = kv_seq_positions(seq);
    for (int j = 0; j < n; j++)
        assert_int_equal(pos[j], j < s ? j : p + j - s);
    kv_seq_destroy(seq);
}

/*
 * (1) One layer: a token's K/V depend on that token only, so after
 * sink-window eviction the next-token logits must equal a fresh forward
 * over exactly the retained tokens: at 0..n-1 when renumbering, at their
 * original positions (sinks, a gap, the window) when preserving; both as
 * a fresh kvd sequence and through the reference.
 */
static struct evict1 evict_one_layer(const char *path, bool renumber)
{
    model *m = load_model(path);
    struct ref_model r;
    ref_load(&r, path);
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, KV_F32, 4, 256);
    struct kv_policy pol = sink_window(renumber);
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, 32, 2);
    int32_t t[100];
    fill_tokens(t, 100, nv, 11);
    float *lg = malloc(sizeof(float) * nv), *fr = malloc(sizeof(float) * nv);
    float *ref = malloc(sizeof(float) * nv);
    struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 20, .logits = lg};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    struct evict1 e = {.min_other = INFINITY};
    int32_t pos0[32];
    for (int j = 0; j < 32; j++)
        pos0[j] = j;
    for (int i = 20; i < 100; i++) {
        b.tokens = t + i;
        b.n_tokens = 1;
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        int n = kv_seq_n_tokens(seq);
        const int32_t *pos = kv_seq_positions(seq);
        const int32_t *toks = kv_seq_tokens(seq);
        if (kv_seq_hist_index(seq)[n - 1] == n - 1)
            continue; /* nothing evicted yet */
        if (renumber) {
            for (int j = 0; j < n; j++)
                assert_int_equal(pos[j], j);
            kv_seq *fresh = make_seq(cache, &(struct kv_policy){.kind = KV_EVICT_NONE,
                                                                .max_cache_tokens = 32,
                                                                .renumber = true});
            struct model_batch_seq f = {.seq = fresh, .tokens = toks, .n_tokens = n, .logits = fr};
            assert_int_equal(model_reserve_forward(ctx, &f, 1, NULL), 0);
            float d = rel_diff(lg, fr, nv);
            e.worst_fresh = d > e.worst_fresh ? d : e.worst_fresh;
            kv_seq_destroy(fresh);
        } else {
            /* Sinks at 0..3, then a contiguous window after the gap. */
            int sinks = pol.sink_tokens;
            for (int j = 0; j < n; j++)
                assert_int_equal(pos[j], j < sinks ? j : pos[sinks] + j - sinks);
            fresh_with_gap(ctx, cache, toks, sinks, pos[sinks], n, fr);
            float d = rel_diff(lg, fr, nv);
            e.worst_fresh = d > e.worst_fresh ? d : e.worst_fresh;
            e.max_gap = pos[n - 1] - (n - 1) > e.max_gap ? pos[n - 1] - (n - 1) : e.max_gap;
            /* Non-vacuous: the same tokens at 0..n-1 give other logits. */
            ref_fresh(&r, toks, pos0, n, ref);
            d = rel_diff(lg, ref, nv);
            e.min_other = d < e.min_other ? d : e.min_other;
        }
        ref_fresh(&r, toks, pos, n, ref);
        float d = rel_diff(lg, ref, nv);
        e.worst_ref = d > e.worst_ref ? d : e.worst_ref;
        e.checks++;
    }
    free(lg);
    free(fr);
    free(ref);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    ref_free(&r);
    model_free(m);
    return e;
}

static void test_evict_one_layer_equals_fresh(void **state)
{
    (void)state;
    static const struct arch_case one[] = {
        {"bloom-h12", "bloom", NULL, 96, 12, 12, 1, 0.0f, 0.0f, true},
        {"mpt-h8-clamp", "mpt", NULL, 64, 8, 8, 1, 8.0f, 1.5f, false},
        {"llama-t5-h8", "llama", "t5", 64, 8, 4, 1, 0.0f, 0.0f, false},
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(one[0]); i++) {
        struct model_mk_params p = case_params(&one[i], GGML_TYPE_F32);
        /* Buckets that tell distances apart up to 128, past the 80 tokens
         * of the test: with fewer, preserved and renumbered positions
         * could fall in the same saturated bucket and agree. */
        p.t5_num_buckets = 32;
        p.t5_max_distance = 128;
        char path[512];
        write_model(&p, "evict1.gguf", path, sizeof(path));
        struct evict1 rn = evict_one_layer(path, true);
        struct evict1 pr = evict_one_layer(path, false);
        print_message("  %-13s renumber: %d checks, vs fresh kvd at 0..n-1 %.2e, vs fresh "
                      "reference %.2e\n"
                      "  %-13s preserve: %d checks (positions up to %d past the count), vs "
                      "fresh kvd at the same positions %.2e, vs fresh reference %.2e (at "
                      "0..n-1 it differs by >= %.2e)\n",
                      one[i].name, rn.checks, rn.worst_fresh, rn.worst_ref, "", pr.checks,
                      pr.max_gap, pr.worst_fresh, pr.worst_ref, pr.min_other);
        assert_true(rn.checks >= 50 && pr.checks >= 50);
        assert_true(rn.worst_fresh < 1e-5f);
        assert_true(pr.worst_fresh < 1e-5f);
        assert_true(rn.worst_ref < 1e-4f);
        assert_true(pr.worst_ref < 1e-4f);
        assert_true(pr.max_gap >= 40);
        assert_true(pr.min_other > 1e-3f);
    }
}

/* (2) Many layers: evict_vs_reference (tests/arch_ref.h). */
static void test_evict_multilayer_equals_reference(void **state)
{
    (void)state;
    static const struct arch_case deep[] = {
        {"bloom-h12", "bloom", NULL, 96, 12, 12, 3, 0.0f, 0.0f, true},
        {"mpt-h8-clamp", "mpt", NULL, 64, 8, 8, 3, 8.0f, 1.5f, false},
        {"llama-t5-h4", "llama", "t5", 64, 4, 2, 3, 0.0f, 0.0f, false},
    };
    for (size_t i = 0; i < sizeof(deep) / sizeof(deep[0]); i++) {
        struct model_mk_params p = case_params(&deep[i], GGML_TYPE_F32);
        char path[512];
        write_model(&p, "evict3.gguf", path, sizeof(path));
        for (int k = 0; k < 3; k++) {
            bool renumber = k != 1;
            enum kv_type kvt = k == 2 ? KV_F16 : KV_F32;
            int ev = 0;
            float e = evict_vs_reference(path, renumber, kvt, 90, 21 + (uint32_t)i, &ev);
            print_message("  %-13s %s, %s KV: %d evictions, max rel logit diff %.2e\n",
                          deep[i].name, renumber ? "renumber" : "preserve", kv_type_name(kvt), ev,
                          e);
            assert_true(ev >= 15);
            assert_true(e < (kvt == KV_F32 ? 1e-4f : 1e-3f));
        }
    }
}

/*
 * An empty sequence whose next position is about `shift`: append shift
 * placeholder tokens under preserve sink-window without sinks (no forward:
 * their K/V are never read), then truncate the history at the first one
 * still retained, which removes them all and leaves the next position at
 * that token's position (shift minus what the window kept).
 */
static kv_seq *shifted_seq(kv_cache *cache, int shift)
{
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = 48,
                            .sink_tokens = 0,
                            .window_tokens = 8,
                            .renumber = false};
    kv_seq *s = make_seq(cache, &pol);
    int32_t ids[16];
    for (int i = 0; i < 16; i++)
        ids[i] = 3 + i;
    int appended = 0;
    while (appended < shift) {
        int n = shift - appended < 16 ? shift - appended : 16;
        int room = kv_seq_max_append(s);
        n = n < room ? n : room;
        assert_true(n > 0);
        assert_int_equal(kv_seq_append(s, ids, n, NULL), 0);
        appended += n;
    }
    int32_t first = kv_seq_hist_index(s)[0];
    assert_int_equal(kv_seq_truncate(s, first), 0);
    assert_int_equal(kv_seq_n_tokens(s), 0);
    assert_int_equal(kv_seq_next_pos(s), first); /* preserve: positions are history indices */
    return s;
}

/*
 * (3) Translation invariance through the whole model: the same tokens
 * starting at position c instead of 0 give the same logits, prefill and
 * every decode step, for every layer count.
 */
static void test_translation_invariance(void **state)
{
    (void)state;
    static const struct arch_case tr[] = {
        {"bloom-h12", "bloom", NULL, 96, 12, 12, 3, 0.0f, 0.0f, true},
        {"mpt-h8-clamp", "mpt", NULL, 64, 8, 8, 2, 8.0f, 1.5f, false},
        {"llama-t5-h4", "llama", "t5", 64, 4, 2, 3, 0.0f, 0.0f, false},
    };
    static const int shifts[] = {1000, 70001};
    for (size_t i = 0; i < sizeof(tr) / sizeof(tr[0]); i++) {
        struct model_mk_params p = case_params(&tr[i], GGML_TYPE_F32);
        char path[512];
        write_model(&p, "shift.gguf", path, sizeof(path));
        model *m = load_model(path);
        int nv = m->n_vocab;
        kv_cache *cache = make_cache(m, KV_F32, 4, 256);
        model_ctx *ctx = make_ctx(m, 32, 2);
        int32_t t[40];
        fill_tokens(t, 40, nv, 3);
        float *l0 = malloc(sizeof(float) * nv), *l1 = malloc(sizeof(float) * nv);
        for (size_t k = 0; k < sizeof(shifts) / sizeof(shifts[0]); k++) {
            struct kv_policy none = policy_none(64);
            kv_seq *a = make_seq(cache, &none);
            kv_seq *b = shifted_seq(cache, shifts[k]);
            int32_t c = kv_seq_next_pos(b);
            float worst = 0.0f;
            bool exact = true;
            for (int step = 0; step < 12; step++) {
                int from = step ? 20 + step - 1 : 0, n = step ? 1 : 20;
                struct model_batch_seq ba = {
                    .seq = a, .tokens = t + from, .n_tokens = n, .logits = l0};
                struct model_batch_seq bb = {
                    .seq = b, .tokens = t + from, .n_tokens = n, .logits = l1};
                assert_int_equal(model_reserve_forward(ctx, &ba, 1, NULL), 0);
                assert_int_equal(model_reserve_forward(ctx, &bb, 1, NULL), 0);
                int nb = kv_seq_n_tokens(b);
                assert_int_equal(kv_seq_positions(b)[0], c);
                assert_int_equal(kv_seq_positions(b)[nb - 1], c + nb - 1);
                float e = rel_diff(l1, l0, nv);
                worst = e > worst ? e : worst;
                exact = exact && !memcmp(l0, l1, sizeof(float) * nv);
            }
            print_message("  %-13s positions +%d: max rel logit diff %.2e%s\n", tr[i].name, c,
                          worst, exact ? " (bit for bit)" : "");
            assert_true(c >= shifts[k] - 48);
            assert_true(worst <= 1e-6f);
            kv_seq_destroy(a);
            kv_seq_destroy(b);
        }
        free(l0);
        free(l1);
        model_ctx_destroy(ctx);
        kv_cache_destroy(cache);
        model_free(m);
    }
}

/* ------------------------------------------------------------------------
 * The sign of the offset, through the whole model
 * ------------------------------------------------------------------------ */

/*
 * A T5 table that rewards only the bucket of offset -1 (the previous
 * token) by +30 and punishes every other bucket by -30: the attention of a
 * two-token sequence's second token must go to the first, in every head
 * and layer. kvd's forward reports it through H2O's attention mass. With
 * the convention flipped (offset = pos_q - pos_k), the previous token would
 * have offset +1, which a causal table maps to bucket 0 like the token
 * itself: both keys would get -30 and share the attention.
 */
static void test_t5_sign(void **state)
{
    (void)state;
    struct model_mk_params p = arch_params("llama", "t5", 64, 4, 2, 2);
    p.t5_num_buckets = 32;
    p.t5_max_distance = 128;
    char base[512], path[600];
    write_model(&p, "sign-base.gguf", base, sizeof(base));
    int H = p.n_head, nb = p.t5_num_buckets;
    int want_bucket = pos_t5_bucket(-1, false, nb, p.t5_max_distance);
    assert_int_equal(want_bucket, 1);
    assert_int_equal(pos_t5_bucket(+1, false, nb, p.t5_max_distance), 0);
    float *table = malloc(sizeof(float) * (size_t)H * nb); /* GGUF order: [bucket][head] */
    for (int b = 0; b < nb; b++)
        for (int h = 0; h < H; h++)
            table[(size_t)b * H + h] = b == want_bucket ? 30.0f : -30.0f;
    snprintf(path, sizeof(path), "%s/sign.gguf", tmp_dir);
    mutate(base, path,
           &(struct mutation){.replace_tensor = "blk.0.attn_rel_b.weight", .replace_data = table});
    free(table);

    model *m = load_model(path);
    kv_cache *cache = make_cache(m, KV_F32, 4, 64);
    struct kv_policy h2o = {.kind = KV_EVICT_H2O,
                            .max_cache_tokens = 16,
                            .sink_tokens = 0,
                            .window_tokens = 4,
                            .heavy_tokens = 0,
                            .renumber = true};
    model_ctx *ctx = make_ctx(m, 8, 2);
    double HL = (double)m->n_head * m->n_layer;
    int32_t t[2] = {17, 42};
    for (int way = 0; way < 2; way++) {
        /* way 0: both tokens in one prefill call; way 1: a prefill then a decode step. */
        kv_seq *seq = make_seq(cache, &h2o);
        if (way == 0) {
            struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 2};
            assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        } else {
            for (int i = 0; i < 2; i++) {
                struct model_batch_seq b = {.seq = seq, .tokens = t + i, .n_tokens = 1};
                assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
            }
        }
        const float *mass = kv_seq_mass(seq);
        /* Token 0 holds all of its own query's attention and all of token
         * 1's; token 1 gets almost nothing. */
        print_message("  %s: attention mass of the first token %.6f, of the second %.2e "
                      "(of %g query-heads x layers each)\n",
                      way ? "prefill + decode" : "one prefill", mass[0], mass[1], HL);
        assert_true(mass[0] > 2.0 * HL * (1.0 - 1e-6));
        assert_true(mass[1] < 1e-6 * HL);
        kv_seq_destroy(seq);
    }
    model_ctx_destroy(ctx);
    kv_cache_destroy(cache);
    model_free(m);
}

/* ------------------------------------------------------------------------
 * No materialised bias
 * ------------------------------------------------------------------------ */

/* A /proc/self/status field in kB, or -1. */
static long proc_status_kb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, field, n) && line[n] == ':')
            v = strtol(line + n + 1, NULL, 10);
    fclose(f);
    return v;
}

/* Reset the peak RSS (VmHWM) to the current RSS; false if not possible. */
static bool reset_peak_rss(void)
{
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f)
        return false;
    bool ok = fputs("5", f) >= 0;
    return fclose(f) == 0 && ok;
}

/*
 * 16 heads, 32k cached tokens, then a 64-token prefill chunk and a decode
 * step on top. A bias materialised as heads x L x L f32 would be 64 GiB at
 * L = 32768 (17 GB at 16k); even one row per query of the chunk, heads x
 * 64 x L, would be 128 MiB. The kernel's workspace and the process's peak
 * resident memory during the forward must stay far below either.
 */
static void test_no_materialised_bias(void **state)
{
    (void)state;
    enum { H = 16, CTX = 32768, CHUNK = 64 };
    const char *kinds[][2] = {{"bloom", NULL}, {"llama", "t5"}};
    for (int k = 0; k < 2; k++) {
        struct model_mk_params p = arch_params(kinds[k][0], kinds[k][1], 128, H, H, 1);
        p.t5_num_buckets = 32;
        p.t5_max_distance = 128;
        char path[512];
        write_model(&p, "ctx32k.gguf", path, sizeof(path));
        model *m = load_model(path);
        kv_cache *cache = make_cache(m, KV_F16, 16, CTX + 2 * CHUNK);
        struct kv_policy pol = policy_none(CTX + 2 * CHUNK);
        kv_seq *seq = make_seq(cache, &pol);
        model_ctx *ctx = make_ctx(m, CHUNK, 2);
        size_t attn0 = model_ctx_attn_bytes(ctx);

        /* 32k cached tokens of small pseudo-random K/V (no forward: a real
         * 32k prefill would take minutes here). */
        int32_t ids[256];
        float row[64];
        uint32_t s = 99;
        for (int done = 0; done < CTX;) {
            int n = CTX - done < 256 ? CTX - done : 256;
            fill_tokens(ids, n, m->n_vocab, (uint32_t)done);
            int first;
            assert_int_equal(kv_seq_append(seq, ids, n, &first), 0);
            for (int i = 0; i < n; i++)
                for (int h = 0; h < m->n_kv_head; h++)
                    for (int v = 0; v < 2; v++) {
                        for (int e = 0; e < m->head_dim; e++) {
                            s = s * 1664525u + 1013904223u;
                            row[e] = (float)((int)(s >> 20) - 2048) / 2048.0f;
                        }
                        void *dst =
                            v ? kv_seq_v(seq, 0, h, first + i) : kv_seq_k(seq, 0, h, first + i);
                        qt_f32_to_f16_row(row, dst, (size_t)m->head_dim);
                    }
            done += n;
        }
        int32_t chunk[CHUNK];
        fill_tokens(chunk, CHUNK, m->n_vocab, 8);
        float *lg = malloc(sizeof(float) * m->n_vocab);
        bool peak_ok = reset_peak_rss();
        long rss0 = proc_status_kb("VmRSS");
        struct model_batch_seq b = {.seq = seq, .tokens = chunk, .n_tokens = CHUNK, .logits = lg};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        b = (struct model_batch_seq){.seq = seq, .tokens = chunk, .n_tokens = 1, .logits = lg};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        long hwm = proc_status_kb("VmHWM");
        size_t attn1 = model_ctx_attn_bytes(ctx), all = model_ctx_bytes(ctx);
        for (int i = 0; i < m->n_vocab; i++)
            assert_true(isfinite(lg[i]));
        double per_chunk = (double)H * CHUNK * (CTX + CHUNK) * 4.0;
        double full = (double)H * (CTX + CHUNK) * (CTX + CHUNK) * 4.0;
        print_message("  %-5s %d heads, %d cached + %d: attention workspace %zu -> %zu bytes, "
                      "model ctx %zu bytes; peak RSS growth during the forward %s%ld kB "
                      "(a heads x chunk x L bias: %.0f MiB; heads x L x L: %.0f GiB)\n",
                      pos_kind_name(m->pos.kind), H, kv_seq_n_tokens(seq) - CHUNK - 1, CHUNK, attn0,
                      attn1, all, peak_ok ? "" : "(not measurable) ", peak_ok ? hwm - rss0 : 0L,
                      per_chunk / 1048576.0, full / 1073741824.0);
        assert_int_equal(kv_seq_n_tokens(seq), CTX + CHUNK + 1);
        assert_true((double)attn1 < per_chunk / 64.0); /* under 2 MiB */
        assert_true((double)all < per_chunk / 16.0);
        if (peak_ok && rss0 > 0 && hwm > 0)
            assert_true((double)(hwm - rss0) * 1024.0 < per_chunk / 4.0); /* under 32 MiB */
        free(lg);
        model_ctx_destroy(ctx);
        kv_seq_destroy(seq);
        kv_cache_destroy(cache);
        model_free(m);
    }
}

/* ------------------------------------------------------------------------
 * Hostile files
 * ------------------------------------------------------------------------ */

static void test_load_errors(void **state)
{
    (void)state;
    char path[512], bad[600];
    snprintf(bad, sizeof(bad), "%s/bad.gguf", tmp_dir);

    /* MPT: max_bias missing (and no override), non-positive, not finite;
     * an override fills in for a file without one, and only then. */
    struct model_mk_params p = arch_params("mpt", NULL, 64, 8, 8, 2);
    p.alibi_max_bias = 16.0f;
    write_model(&p, "h-mpt.gguf", path, sizeof(path));
    mutate(path, bad, &(struct mutation){.drop_key = "mpt.attention.max_alibi_bias"});
    expect_load_error(bad, "missing metadata key mpt.attention.max_alibi_bias");
    struct model_params over = {.alibi_max_bias = 16.0f};
    over.path = bad;
    char err[512];
    model *m = model_load(&over, err, sizeof(err));
    assert_non_null(m);
    model *m0 = load_model(path);
    assert_memory_equal(m->pos.alibi_slopes, m0->pos.alibi_slopes, sizeof(float) * 8);
    model_free(m);
    over.path = path; /* the file's own value wins over an override */
    over.alibi_max_bias = 2.0f;
    m = model_load(&over, err, sizeof(err));
    assert_non_null(m);
    assert_memory_equal(m->pos.alibi_slopes, m0->pos.alibi_slopes, sizeof(float) * 8);
    model_free(m);
    model_free(m0);
    mutate(path, bad,
           &(struct mutation){
               .set = {{"mpt.attention.max_alibi_bias", GGUF_TYPE_FLOAT32, NULL, -1.0f, 0}}});
    expect_load_error(bad, "mpt.attention.max_alibi_bias = -1 must be positive");
    mutate(path, bad,
           &(struct mutation){
               .set = {{"mpt.attention.max_alibi_bias", GGUF_TYPE_FLOAT32, NULL, NAN, 0}}});
    expect_load_error(bad, "mpt.attention.max_alibi_bias is not a finite number");
    mutate(path, bad,
           &(struct mutation){
               .set = {{"mpt.attention.clamp_kqv", GGUF_TYPE_FLOAT32, NULL, -2.0f, 0}}});
    expect_load_error(bad, "mpt.attention.clamp_kqv = -2 must be >= 0");
    mutate(path, bad, &(struct mutation){.drop_key = "mpt.attention.layer_norm_epsilon"});
    expect_load_error(bad, "missing metadata key mpt.attention.layer_norm_epsilon");
    mutate(path, bad,
           &(struct mutation){.clone_tensor = "token_embd.weight",
                              .clone_as = "position_embd.weight"});
    expect_load_error(bad, "tensor position_embd.weight (learned absolute positions) is not "
                           "supported");
    mutate(path, bad,
           &(struct mutation){.clone_tensor = "blk.1.attn_norm.weight",
                              .clone_as = "blk.1.attn_q_norm.weight"});
    expect_load_error(bad, "blk.1.attn_q_norm.weight");

    /* BLOOM: a missing bias, a wrong fused shape, a position kind that is not alibi. */
    p = arch_params("bloom", NULL, 96, 12, 12, 2);
    write_model(&p, "h-bloom.gguf", path, sizeof(path));
    mutate(path, bad, &(struct mutation){.drop_tensor = "blk.1.attn_qkv.bias"});
    expect_load_error(bad, "missing tensor blk.1.attn_qkv.bias");
    mutate(path, bad, &(struct mutation){.drop_tensor = "token_embd_norm.weight"});
    expect_load_error(bad, "missing tensor token_embd_norm.weight");
    mutate(path, bad,
           &(struct mutation){
               .reshape_tensor = "blk.0.attn_qkv.weight", .reshape_ne0 = 288, .reshape_ne1 = 96});
    expect_load_error(bad, "tensor blk.0.attn_qkv.weight has shape [288, 96");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.position.kind", GGUF_TYPE_STRING, "t5", 0, 0}}});
    expect_load_error(bad, "kvd.position.kind = t5, but bloom attention is alibi");
    mutate(path, bad,
           &(struct mutation){
               .set = {{"bloom.attention.max_alibi_bias", GGUF_TYPE_FLOAT32, NULL, 0.0f, 0}}});
    expect_load_error(bad, "bloom.attention.max_alibi_bias = 0 must be positive");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.position.kind", GGUF_TYPE_FLOAT32, NULL, 1.0f, 0}}});
    expect_load_error(bad, "kvd.position.kind is not a string");

    /* A llama-shaped ALiBi model needs its max_bias. */
    p = arch_params("llama", "alibi", 64, 8, 4, 1);
    write_model(&p, "h-alibi.gguf", path, sizeof(path));
    mutate(path, bad, &(struct mutation){.drop_key = "llama.attention.max_alibi_bias"});
    expect_load_error(bad, "llama.attention.max_alibi_bias is missing");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.position.kind", GGUF_TYPE_STRING, "xpos", 0, 0}}});
    expect_load_error(bad, "kvd.position.kind = 'xpos' is not supported");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.position.kind", GGUF_TYPE_UINT32, NULL, 0, 2}}});
    expect_load_error(bad, "kvd.position.kind is not a string");

    /* T5: keys missing, a bucket count the table does not have, degenerate
     * or absurd max_distance, a table per layer, no table, a table with the
     * wrong head count or a non-finite entry. */
    p = arch_params("llama", "t5", 64, 8, 4, 3);
    p.t5_num_buckets = 32;
    p.t5_max_distance = 128;
    write_model(&p, "h-t5.gguf", path, sizeof(path));
    model_free(load_model(path));
    mutate(path, bad, &(struct mutation){.drop_key = "kvd.t5.num_buckets"});
    expect_load_error(bad, "metadata key kvd.t5.num_buckets is missing");
    struct model_params t5o = {.t5_num_buckets = 32};
    t5o.path = bad;
    m = model_load(&t5o, err, sizeof(err));
    assert_non_null(m);
    assert_int_equal(m->pos.t5_num_buckets, 32);
    model_free(m);
    t5o.t5_num_buckets = 16;
    expect_load_error_p(bad, &t5o, "has 32 buckets (shape [8, 32]) but kvd.t5.num_buckets = 16");
    mutate(path, bad, &(struct mutation){.drop_key = "kvd.t5.max_distance"});
    expect_load_error(bad, "metadata key kvd.t5.max_distance is missing");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.t5.num_buckets", GGUF_TYPE_UINT32, NULL, 0, 16}}});
    expect_load_error(bad, "has 32 buckets (shape [8, 32]) but kvd.t5.num_buckets = 16");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.t5.max_distance", GGUF_TYPE_UINT32, NULL, 0, 16}}});
    expect_load_error(bad, "max_distance 16 must exceed the exact range 16");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.t5.max_distance", GGUF_TYPE_UINT32, NULL, 0, 0}}});
    expect_load_error(bad, "kvd.t5.max_distance = 0 is outside");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.t5.max_distance", GGUF_TYPE_INT32, NULL, 0, -5}}});
    expect_load_error(bad, "kvd.t5.max_distance = -5 is outside");
    mutate(
        path, bad,
        &(struct mutation){.set = {{"kvd.t5.max_distance", GGUF_TYPE_UINT32, NULL, 0, 1 << 30}}});
    expect_load_error(bad, "kvd.t5.max_distance = 1073741824 is outside");
    mutate(path, bad,
           &(struct mutation){.set = {{"kvd.t5.num_buckets", GGUF_TYPE_UINT32, NULL, 0, 2}}});
    expect_load_error(bad, "kvd.t5.num_buckets = 2 is outside");
    mutate(path, bad,
           &(struct mutation){.clone_tensor = "blk.0.attn_rel_b.weight",
                              .clone_as = "blk.2.attn_rel_b.weight"});
    expect_load_error(bad, "unexpected tensor blk.2.attn_rel_b.weight: a T5-bias decoder has one "
                           "bias table, blk.0.attn_rel_b.weight, shared by every layer");
    mutate(path, bad,
           &(struct mutation){.drop_tensor = "blk.0.attn_rel_b.weight",
                              .clone_tensor = "blk.0.attn_rel_b.weight",
                              .clone_as = "blk.1.attn_rel_b.weight"});
    expect_load_error(bad, "unexpected tensor blk.1.attn_rel_b.weight");
    mutate(path, bad, &(struct mutation){.drop_tensor = "blk.0.attn_rel_b.weight"});
    expect_load_error(bad, "missing tensor blk.0.attn_rel_b.weight");
    mutate(path, bad,
           &(struct mutation){
               .reshape_tensor = "blk.0.attn_rel_b.weight", .reshape_ne0 = 16, .reshape_ne1 = 16});
    expect_load_error(bad, "tensor blk.0.attn_rel_b.weight has shape [16, 16, 1, 1]: expected "
                           "[n_head 8, num_buckets 32]");
    float nan_table[8 * 32];
    for (int i = 0; i < 8 * 32; i++)
        nan_table[i] = i == 77 ? NAN : 0.5f;
    mutate(
        path, bad,
        &(struct mutation){.replace_tensor = "blk.0.attn_rel_b.weight", .replace_data = nan_table});
    expect_load_error(bad, "blk.0.attn_rel_b.weight: bucket 9, head 5 is not finite");

    /* A table in a file whose scheme is not T5 is a mistake, not a no-op. */
    mutate(path, bad,
           &(struct mutation){
               .set = {{"kvd.position.kind", GGUF_TYPE_STRING, "alibi", 0, 0},
                       {"llama.attention.max_alibi_bias", GGUF_TYPE_FLOAT32, NULL, 8.0f, 0}}});
    expect_load_error(bad, "unexpected tensor blk.0.attn_rel_b.weight: T5 bias tables, but the "
                           "position scheme is alibi");

    /* The untouched copy loads: the surgery itself is faithful. */
    mutate(path, bad, &(struct mutation){0});
    model_free(load_model(bad));
}

/* ------------------------------------------------------------------------
 * mkmodel: llama.cpp's names and keys, and every combination checked
 * ------------------------------------------------------------------------ */

static void expect_tensor(const gguf_file *f, const char *name, uint64_t ne0, uint64_t ne1)
{
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t)
        print_message("missing %s\n", name);
    assert_non_null(t);
    assert_int_equal(t->ne[0], ne0);
    assert_int_equal(t->ne[1], ne1);
}

static void test_mkmodel_files(void **state)
{
    (void)state;
    char path[512], err[256];
    float v;
    int64_t iv;
    const char *s;
    size_t n;

    /* BLOOM: llama.cpp's LLM_ARCH_BLOOM tensors and keys; tied. */
    struct model_mk_params p = arch_params("bloom", NULL, 96, 12, 12, 2);
    write_model(&p, "f-bloom.gguf", path, sizeof(path));
    gguf_file *f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &n), 0);
    assert_int_equal(n, 5);
    assert_memory_equal(s, "bloom", 5);
    assert_int_equal(gguf_get_i64(f, "bloom.embedding_length", &iv), 0);
    assert_int_equal(iv, 96);
    assert_int_equal(gguf_get_i64(f, "bloom.block_count", &iv), 0);
    assert_int_equal(gguf_get_i64(f, "bloom.attention.head_count", &iv), 0);
    assert_int_equal(iv, 12);
    assert_int_equal(gguf_get_i64(f, "bloom.feed_forward_length", &iv), 0);
    assert_int_equal(gguf_get_f32(f, "bloom.attention.layer_norm_epsilon", &v), 0);
    assert_int_equal(gguf_find_key(f, "kvd.position.kind"), -1);
    expect_tensor(f, "token_embd.weight", 96, 300);
    expect_tensor(f, "token_embd_norm.weight", 96, 1);
    expect_tensor(f, "token_embd_norm.bias", 96, 1);
    static const char *bloom_layer[] = {"attn_norm.weight", "attn_norm.bias", "attn_output.bias",
                                        "ffn_norm.weight",  "ffn_norm.bias",  "ffn_down.bias"};
    for (int l = 0; l < 2; l++) {
        char nm[64];
        for (size_t i = 0; i < sizeof(bloom_layer) / sizeof(bloom_layer[0]); i++) {
            snprintf(nm, sizeof(nm), "blk.%d.%s", l, bloom_layer[i]);
            expect_tensor(f, nm, 96, 1);
        }
        snprintf(nm, sizeof(nm), "blk.%d.attn_qkv.weight", l);
        expect_tensor(f, nm, 96, 3 * 96);
        snprintf(nm, sizeof(nm), "blk.%d.attn_qkv.bias", l);
        expect_tensor(f, nm, 3 * 96, 1);
        snprintf(nm, sizeof(nm), "blk.%d.attn_output.weight", l);
        expect_tensor(f, nm, 96, 96);
        snprintf(nm, sizeof(nm), "blk.%d.ffn_up.weight", l);
        expect_tensor(f, nm, 96, 96);
        snprintf(nm, sizeof(nm), "blk.%d.ffn_up.bias", l);
        expect_tensor(f, nm, 96, 1);
        snprintf(nm, sizeof(nm), "blk.%d.ffn_down.weight", l);
        expect_tensor(f, nm, 96, 96);
    }
    expect_tensor(f, "output_norm.weight", 96, 1);
    expect_tensor(f, "output_norm.bias", 96, 1);
    assert_null(gguf_find_tensor(f, "output.weight"));
    gguf_close(f);
    model *m = load_model(path);
    struct model_info info;
    model_get_info(m, &info);
    assert_string_equal(info.arch, "bloom");
    assert_int_equal(info.pos, POS_ALIBI);
    assert_true(m->tied);
    model_free(m);

    /* MPT: no biases, max_alibi_bias and clamp_kqv keys. */
    p = arch_params("mpt", NULL, 64, 8, 8, 2);
    p.alibi_max_bias = 16.0f;
    p.clamp_kqv = 6.0f;
    write_model(&p, "f-mpt.gguf", path, sizeof(path));
    f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    assert_int_equal(gguf_get_f32(f, "mpt.attention.max_alibi_bias", &v), 0);
    assert_true(v == 16.0f);
    assert_int_equal(gguf_get_f32(f, "mpt.attention.clamp_kqv", &v), 0);
    assert_true(v == 6.0f);
    assert_int_equal(gguf_get_f32(f, "mpt.attention.layer_norm_epsilon", &v), 0);
    expect_tensor(f, "blk.1.attn_qkv.weight", 64, 3 * 64);
    expect_tensor(f, "output.weight", 64, 300);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++)
        assert_null(strstr(gguf_tensor_at(f, i)->name, ".bias"));
    gguf_close(f);
    m = load_model(path);
    model_get_info(m, &info);
    assert_string_equal(info.arch, "mpt");
    assert_int_equal(info.pos, POS_ALIBI);
    assert_true(m->clamp_kqv == 6.0f);
    model_free(m);

    /* T5-bias decoder: kvd's keys and the one table of layer 0. */
    p = arch_params("llama", "t5", 64, 8, 4, 3);
    p.t5_num_buckets = 32;
    p.t5_max_distance = 128;
    write_model(&p, "f-t5.gguf", path, sizeof(path));
    f = gguf_open(path, err, sizeof(err));
    assert_non_null(f);
    assert_int_equal(gguf_get_str(f, "kvd.position.kind", &s, &n), 0);
    assert_int_equal(n, 2);
    assert_memory_equal(s, "t5", 2);
    assert_int_equal(gguf_get_i64(f, "kvd.t5.num_buckets", &iv), 0);
    assert_int_equal(iv, 32);
    assert_int_equal(gguf_get_i64(f, "kvd.t5.max_distance", &iv), 0);
    assert_int_equal(iv, 128);
    assert_int_equal(gguf_find_key(f, "llama.rope.freq_base"), -1);
    expect_tensor(f, "blk.0.attn_rel_b.weight", 8, 32);
    assert_null(gguf_find_tensor(f, "blk.1.attn_rel_b.weight"));
    assert_null(gguf_find_tensor(f, "blk.2.attn_rel_b.weight"));
    gguf_close(f);
    m = load_model(path);
    model_get_info(m, &info);
    assert_string_equal(info.arch, "llama");
    assert_int_equal(info.pos, POS_T5);
    assert_int_equal(m->pos.t5_num_buckets, 32);
    assert_int_equal(m->pos.t5_max_distance, 128);
    assert_false(m->pos.t5_bidirectional);
    model_free(m);

    /* The default is still a llama with RoPE and no kvd keys. */
    model_mk_defaults(&p);
    assert_string_equal(model_mk_position(&p), "rope");
    p.n_embd = 64;
    p.n_ff = 64;
    p.n_layer = 1;
    p.n_vocab = 300;
    write_model(&p, "f-default.gguf", path, sizeof(path));
    f = gguf_open(path, err, sizeof(err));
    assert_int_equal(gguf_find_key(f, "kvd.position.kind"), -1);
    assert_true(gguf_find_key(f, "llama.rope.freq_base") >= 0);
    gguf_close(f);
    m = load_model(path);
    assert_int_equal(m->pos.kind, POS_ROPE);
    model_free(m);

    /* Combinations that do not exist are refused with the reason. */
    static const struct {
        const char *arch, *position;
        float max_bias, clamp;
        int buckets, dist;
        const char *want;
    } bad[] = {
        {"bloom", "rope", 0, 0, 32, 128, "bloom attention is alibi"},
        {"mpt", "t5", 0, 0, 32, 128, "mpt attention is alibi"},
        {"gptj", NULL, 0, 0, 32, 128, "arch must be llama, qwen2, qwen3, bloom, mpt, gemma2, gemma3 or phi3"},
        {"llama", "xpos", 0, 0, 32, 128, "position must be rope, alibi or t5"},
        {"bloom", NULL, 4, 0, 32, 128, "bloom's ALiBi slopes are fixed"},
        {"llama", "alibi", 0, 2, 32, 128, "clamp kqv is an mpt option"},
        {"llama", "t5", 0, 0, 32, 16, "max_distance 16 must exceed the exact range 16"},
        {"llama", "t5", 0, 0, 2, 16, "t5 buckets must be in [4, 4096]"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        p = arch_params(bad[i].arch, bad[i].position, 64, 8, 8, 1);
        p.alibi_max_bias = bad[i].max_bias;
        p.clamp_kqv = bad[i].clamp;
        p.t5_num_buckets = bad[i].buckets;
        p.t5_max_distance = bad[i].dist;
        char why[256] = "";
        assert_int_equal(model_mk_check(&p, why, sizeof(why)), -EINVAL);
        if (!strstr(why, bad[i].want))
            print_message("mkmodel check: got '%s', want '%s'\n", why, bad[i].want);
        assert_non_null(strstr(why, bad[i].want));
    }
    /* Odd head dims are fine without RoPE. */
    p = arch_params("bloom", NULL, 36, 12, 12, 1);
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), 0);
}

/* Seeded models of every kind are numerically healthy: finite logits with
 * a useful spread, not one token dominating. */
static void test_mkmodel_healthy(void **state)
{
    (void)state;
    static const struct arch_case h[] = {
        {"bloom", "bloom", NULL, 256, 8, 8, 4, 0.0f, 0.0f, true},
        {"mpt", "mpt", NULL, 256, 8, 8, 4, 8.0f, 6.0f, false},
        {"llama-t5", "llama", "t5", 256, 8, 4, 4, 0.0f, 0.0f, false},
        {"llama-alibi", "llama", "alibi", 256, 8, 4, 4, 8.0f, 0.0f, true},
    };
    for (size_t k = 0; k < sizeof(h) / sizeof(h[0]); k++) {
        struct model_mk_params p = case_params(&h[k], GGML_TYPE_F32);
        p.n_ff = 512;
        p.n_vocab = 1024;
        p.t5_num_buckets = 32;
        p.t5_max_distance = 128;
        char path[512];
        write_model(&p, "healthy.gguf", path, sizeof(path));
        double sd, top;
        logit_health(path, &sd, &top);
        print_message("  %-12s logit std %.2f, top probability %.3f\n", h[k].name, sd, top);
        assert_true(sd > 0.5 && sd < 10.0);
        assert_true(top < 0.9);
    }
}

/* ------------------------------------------------------------------------
 * The kvd binary: mkmodel and generate for every kind
 * ------------------------------------------------------------------------ */

static char *slurp(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    b[n] = '\0';
    return b;
}

/* Run kvd with args; stdout and stderr go to files in tmp_dir. Returns the
 * exit status. */
static int run_kvd(const char *args, char **out, char **err)
{
    char cmd[2048], po[400], pe[400];
    snprintf(po, sizeof(po), "%s/cli.out", tmp_dir);
    snprintf(pe, sizeof(pe), "%s/cli.err", tmp_dir);
    snprintf(cmd, sizeof(cmd), "%s %s >'%s' 2>'%s' </dev/null", getenv("KVD_BIN"), args, po, pe);
    int st = system(cmd);
    *out = slurp(po);
    *err = slurp(pe);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static void test_cli(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN") || !*getenv("KVD_BIN")) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    static const struct {
        const char *opts, *arch, *pos;
    } kinds[] = {
        {"--arch bloom --heads 12 --kv-heads 12 --dim 96", "bloom", "alibi"},
        {"--arch mpt --heads 8 --kv-heads 8 --dim 64 --alibi-max-bias 8 --clamp-kqv 6", "mpt",
         "alibi"},
        {"--arch llama --position t5 --t5-buckets 32 --t5-max-distance 128", "llama", "t5"},
        {"--arch llama --position alibi", "llama", "alibi"},
        {"", "llama", "rope"},
    };
    char args[1400], *out, *err;
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        char path[512];
        snprintf(path, sizeof(path), "%s/cli-%zu.gguf", tmp_dir, i);
        snprintf(args, sizeof(args), "mkmodel --out '%s' --layers 2 --ff 64 --vocab 400 %s", path,
                 kinds[i].opts);
        int rc = run_kvd(args, &out, &err);
        if (rc)
            print_message("mkmodel %s: %s", kinds[i].opts, err);
        assert_int_equal(rc, 0);
        char want[96];
        snprintf(want, sizeof(want), "%s, %s positions", kinds[i].arch, kinds[i].pos);
        assert_non_null(strstr(out, want));
        free(out);
        free(err);

        /* Generate with eviction, renumbered and preserved: same engine,
         * every architecture; the load line names arch and positions. */
        for (int pr = 0; pr < 2; pr++) {
            snprintf(args, sizeof(args),
                     "generate --model '%s' --prompt 'Once upon a time' -n 60 --temp 0 --ctx 48 "
                     "--policy sink-window --sink 4 --window 16 --no-echo%s",
                     path, pr ? " --preserve" : "");
            assert_int_equal(run_kvd(args, &out, &err), 0);
            snprintf(want, sizeof(want), "arch %s, positions %s", kinds[i].arch, kinds[i].pos);
            if (!strstr(err, want))
                print_message("generate stderr: %s", err);
            assert_non_null(strstr(err, want));
            assert_non_null(strstr(err, "decode:"));
            assert_null(strstr(err, " 0 evictions"));
            assert_true(strlen(out) > 20);
            if (pr == 0)
                print_message("  %-6s %-5s: %.60s...\n", kinds[i].arch, kinds[i].pos, out);
            char *first = out;
            free(err);
            assert_int_equal(run_kvd(args, &out, &err), 0); /* greedy: deterministic */
            assert_string_equal(first, out);
            free(first);
            free(out);
            free(err);
        }
    }

    /* Refused combinations exit 2 with the reason. */
    char path[512];
    snprintf(path, sizeof(path), "%s/cli-bad.gguf", tmp_dir);
    snprintf(args, sizeof(args), "mkmodel --out '%s' --arch bloom --position rope", path);
    assert_int_equal(run_kvd(args, &out, &err), 2);
    assert_non_null(strstr(err, "bloom attention is alibi"));
    free(out);
    free(err);
    snprintf(args, sizeof(args), "mkmodel --out '%s' --position t5 --t5-max-distance 8", path);
    assert_int_equal(run_kvd(args, &out, &err), 2);
    assert_non_null(strstr(err, "must exceed the exact range"));
    free(out);
    free(err);

    /* A T5 file without its bucket count loads only with --t5-buckets. */
    char src[512];
    snprintf(src, sizeof(src), "%s/cli-2.gguf", tmp_dir);
    mutate(src, path, &(struct mutation){.drop_key = "kvd.t5.num_buckets"});
    snprintf(args, sizeof(args), "generate --model '%s' --prompt hi -n 4 --temp 0", path);
    assert_int_equal(run_kvd(args, &out, &err), 1);
    assert_non_null(strstr(err, "kvd.t5.num_buckets"));
    free(out);
    free(err);
    snprintf(args, sizeof(args), "generate --model '%s' --prompt hi -n 4 --temp 0 --t5-buckets 32",
             path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_non_null(strstr(err, "positions t5"));
    free(out);
    free(err);
}

/*
 * kvd serve runs every kind as kvd generate does: /v1/models reports the
 * architecture and position scheme, and a greedy completion is the text
 * kvd generate prints for the same prompt (same defaults: f16 KV, all
 * cores).
 */
static void test_serve(void **state)
{
    (void)state;
    const char *kvd = getenv("KVD_BIN");
    if (!kvd || !*kvd) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    static const struct {
        const char *arch, *position, *pos_name;
        int heads;
    } kinds[] = {
        {"bloom", NULL, "alibi", 12},
        {"mpt", NULL, "alibi", 8},
        {"llama", "t5", "t5", 8},
    };
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        struct model_mk_params p =
            arch_params(kinds[k].arch, kinds[k].position, 96, kinds[k].heads, 4, 2);
        p.n_vocab = 600;
        p.t5_num_buckets = 32;
        p.t5_max_distance = 128;
        char path[512];
        write_model(&p, "serve.gguf", path, sizeof(path));

        /* kvd generate's text. */
        char args[1200], *out, *err;
        snprintf(args, sizeof(args),
                 "generate --model '%s' --prompt 'Once upon a time' -n 16 --temp 0 --no-echo",
                 path);
        assert_int_equal(run_kvd(args, &out, &err), 0);
        size_t n = strlen(out);
        if (n && out[n - 1] == '\n')
            out[n - 1] = '\0';
        free(err);

        struct su_proc srv = {0};
        snprintf(srv.log, sizeof(srv.log), "%s/serve-%zu.log", tmp_dir, k);
        assert_int_equal(su_serve(&srv, kvd, path, NULL, 0), 0);
        struct su_resp r;
        assert_int_equal(su_http(srv.port, "GET", "/v1/models", NULL, NULL, &r), 200);
        json_t *models = json_loads(r.body, 0, NULL);
        su_resp_free(&r);
        json_t *meta = json_object_get(json_array_get(json_object_get(models, "data"), 0), "meta");
        const char *arch = json_string_value(json_object_get(meta, "arch"));
        const char *pos = json_string_value(json_object_get(meta, "positions"));
        assert_non_null(arch);
        assert_non_null(pos);
        assert_string_equal(arch, kinds[k].arch);
        assert_string_equal(pos, kinds[k].pos_name);

        int status;
        json_t *ans = su_post(srv.port, "/v1/completions", NULL,
                              json_pack("{s:s, s:i, s:f}", "prompt", "Once upon a time",
                                        "max_tokens", 16, "temperature", 0.0),
                              &status);
        assert_int_equal(status, 200);
        const char *text = json_string_value(
            json_object_get(json_array_get(json_object_get(ans, "choices"), 0), "text"));
        assert_non_null(text);
        print_message("  serve %-5s (/v1/models: %s, %s): \"%s\"\n", kinds[k].arch, arch, pos,
                      text);
        if (strcmp(text, out))
            print_message("  generate printed \"%s\"\n", out);
        assert_string_equal(text, out);
        json_decref(ans);
        json_decref(models);
        free(out);
        assert_int_equal(su_stop(&srv, SIGTERM, 30), 0);
    }
}

int main(int argc, char **argv)
{
    /* OpenMP workers spin after each parallel region unless told otherwise,
     * starving the single-threaded reference that runs between forwards on
     * a two-core machine. libgomp reads the policy when it loads: set it
     * and start again. */
    if (argc > 0 && !getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execv("/proc/self/exe", argv); /* on failure, carry on spinning */
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mkmodel_files),
        cmocka_unit_test(test_alibi_slopes),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_forward_matches_reference),
        cmocka_unit_test(test_parts_matter),
        cmocka_unit_test(test_t5_sign),
        cmocka_unit_test(test_evict_one_layer_equals_fresh),
        cmocka_unit_test(test_evict_multilayer_equals_reference),
        cmocka_unit_test(test_translation_invariance),
        cmocka_unit_test(test_no_materialised_bias),
        cmocka_unit_test(test_mkmodel_healthy),
        cmocka_unit_test(test_cli),
        cmocka_unit_test(test_serve),
    };
    return cmocka_run_group_tests_name("arch", tests, group_setup, group_teardown);
}
