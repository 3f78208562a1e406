/*
 * test_model.c - the model runtime: loading, the batched forward, eviction
 * equivalence, the seeded model writer and the CLI around them.
 *
 * The centre is a plain reference forward (tests/arch_ref.h, shared with
 * test_arch.c), written separately from model/forward.c: its own RMSNorm,
 * RoPE that rotates keys when they are stored (and re-rotates them on
 * eviction, as llama.cpp's context shift does), matrix-vector products over weights dequantised to
 * f32, and a softmax over materialised scores, one token at a time. kvd's forward, with its batched
 * quantised products, unrotated keys and fused kernel, must agree with it on models of several
 * shapes and weight types.
 *
 * Real-model tests read ../shared/models (KVD_SHARED) and skip with a
 * message when it is absent; CLI tests run the binary named by KVD_BIN.
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

#include "cpu/cpu.h"
#include "model/mkmodel.h"
#include "model/model_internal.h"
#include "model/quant.h"
#include "tests/arch_ref.h"
#include "tests/serve_util.h"

/* ------------------------------------------------------------------------
 * Fixtures
 * ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    ref_rms_round_f32 = true; /* this program's reference norm, as it always was */
    return tmp_dir_create("model");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

static const char *shared_dir(void)
{
    const char *s = getenv("KVD_SHARED");
    return s && *s ? s : "../shared";
}

/* Path of a shared model, or NULL (after printing why) when absent. */
static const char *shared_model(const char *name, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s/models/%s", shared_dir(), name);
    if (access(buf, R_OK) != 0) {
        print_message("skipping: %s not found (set KVD_SHARED)\n", buf);
        return NULL;
    }
    return buf;
}

/* Small model shape used by many tests. */
static struct model_mk_params small_params(void)
{
    return su_small_model(96, 300, 7);
}

/* The small_params() model written as tmp_dir/name, loaded. */
static model *small_model(const char *name)
{
    struct model_mk_params p = small_params();
    char path[512];
    write_model(&p, name, path, sizeof(path));
    return load_model(path);
}

static int32_t argmax(const float *x, int n)
{
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

/* ------------------------------------------------------------------------
 * Forward vs reference on mkmodel models
 * ------------------------------------------------------------------------ */

struct shape_case {
    const char *name;
    const char *arch;
    int dim, heads, kv_heads, ff, rope_dims, layers;
    bool tied;
    float theta;
};

static const struct shape_case shapes[] = {
    /* GQA ratio 1, full RoPE, separate output. */
    {"mha", "llama", 64, 4, 4, 96, 0, 2, false, 10000.0f},
    /* GQA ratio 2, partial RoPE (8 of 16 dims), tied output. */
    {"gqa2-partial-tied", "llama", 64, 4, 2, 96, 8, 2, true, 10000.0f},
    /* qwen2: biases, NeoX pairs, GQA ratio 3. */
    {"qwen2-gqa3", "qwen2", 96, 6, 2, 64, 0, 2, false, 1000000.0f},
    /* MQA, head dim 32 with 24 rotated dims, big theta, one layer. */
    {"mqa-partial", "llama", 64, 2, 1, 64, 24, 1, false, 500000.0f},
};

static struct model_mk_params shape_params(const struct shape_case *c, enum ggml_type type)
{
    struct model_mk_params p = small_params();
    p.arch = c->arch;
    p.n_embd = c->dim;
    p.n_head = c->heads;
    p.n_kv_head = c->kv_heads;
    p.n_ff = c->ff;
    p.rope_dims = c->rope_dims;
    p.n_layer = c->layers;
    p.tied = c->tied;
    p.rope_theta = c->theta;
    p.type = type;
    return p;
}

static void test_forward_matches_reference_f32(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        struct model_mk_params p = shape_params(&shapes[i], GGML_TYPE_F32);
        char path[512], name[64];
        snprintf(name, sizeof(name), "ref-%s-f32.gguf", shapes[i].name);
        write_model(&p, name, path, sizeof(path));
        for (int threads = 1; threads <= 3; threads++) {
            float e = check_against_reference(path, KV_F32, threads);
            print_message("  %-18s f32 weights, f32 KV, %d threads: max rel diff %.2e\n",
                          shapes[i].name, threads, e);
            assert_true(e < 1e-4f);
        }
    }
}

/*
 * Each weight type against a reference over its own dequantised weights.
 * Quantised products round activations to 8 bits per block, which moves
 * the logits by a few percent of their range after a few layers. With the
 * reference rounding activations the same way, the two agree to float
 * precision, except after the rare activation that lies so close to a
 * rounding boundary that a float-order difference puts it one 8-bit level
 * apart (the sequence then keeps that difference in its cache): most
 * comparisons must be exact to 1e-4, all within the rounding's scale.
 */
static void test_forward_matches_reference_types(void **state)
{
    (void)state;
    const struct {
        enum ggml_type type;
        const char *name;
        int quant; /* how the products round activations: REF_ROUND_* */
    } types[] = {{GGML_TYPE_F16, "f16", REF_ROUND_NONE},
                 {GGML_TYPE_BF16, "bf16", mm_bf16_in_pairs() ? REF_ROUND_BF16 : REF_ROUND_NONE},
                 {GGML_TYPE_Q8_0, "q8_0", REF_ROUND_Q8},
                 {GGML_TYPE_Q4_0, "q4_0", REF_ROUND_Q8}};
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        for (size_t i = 1; i <= 2; i++) { /* the GQA/tied and the qwen2 shapes */
            struct model_mk_params p = shape_params(&shapes[i], types[t].type);
            char path[512], name[64];
            snprintf(name, sizeof(name), "ref-%s-%s.gguf", shapes[i].name, types[t].name);
            write_model(&p, name, path, sizeof(path));
            float e = check_against_reference(path, KV_F32, 2);
            if (!types[t].quant) {
                print_message("  %-18s %s weights: max rel diff %.2e\n", shapes[i].name,
                              types[t].name, e);
                assert_true(e < 1e-4f);
                continue;
            }
            ref_round_act = types[t].quant;
            float eq = check_against_reference(path, KV_F32, 2);
            ref_round_act = REF_ROUND_NONE;
            print_message("  %-18s %s weights: max rel diff %.2e (f32 activations); "
                          "activations rounded as the kernel does: %d of %d within 1e-4, "
                          "max %.2e\n",
                          shapes[i].name, types[t].name, e, n_tight, n_checks, eq);
            assert_true(e < 1e-1f);
            assert_true(eq < 5e-2f);
            assert_true(n_tight * 3 >= n_checks * 2);
        }
    }
}

/* f16 KV against a reference that rounds its (rotated) K/V to f16 too. */
static void test_forward_f16_kv(void **state)
{
    (void)state;
    struct model_mk_params p = shape_params(&shapes[1], GGML_TYPE_F32);
    char path[512];
    write_model(&p, "ref-f16kv.gguf", path, sizeof(path));
    float e = check_against_reference(path, KV_F16, 2);
    print_message("  f16 KV: max rel diff %.2e\n", e);
    assert_true(e < 1e-2f);
}

/*
 * Whatever the thread count, the same logits: bit for bit on a short
 * context (the matrix products promise thread-independent sums), and to
 * float precision on a long one, where the attention kernel may split
 * keys into more parts for more threads and combine them in another order.
 */
static void test_forward_thread_invariant(void **state)
{
    (void)state;
    /* f32 weights: with quantised ones a last-bit difference can move an
     * activation to the next 8-bit level (see the types test). */
    struct model_mk_params p = shape_params(&shapes[2], GGML_TYPE_F32);
    char path[512];
    write_model(&p, "threads.gguf", path, sizeof(path));
    model *m = load_model(path);
    int nv = m->n_vocab;
    enum { LONG = 700 };
    int32_t *toks = malloc(sizeof(int32_t) * LONG);
    fill_tokens(toks, LONG, nv, 5);
    float *base[2], *lg = malloc(sizeof(float) * nv);
    base[0] = malloc(sizeof(float) * nv);
    base[1] = malloc(sizeof(float) * nv);
    for (int threads = 1; threads <= 3; threads++) {
        kv_cache *cache = make_cache(m, KV_F32, 16, LONG + 32);
        struct kv_policy pol = policy_none(LONG + 16);
        kv_seq *seq = make_seq(cache, &pol);
        model_ctx *ctx = make_ctx(m, 64, threads);
        for (int phase = 0; phase < 2; phase++) {
            /* phase 0: 40 tokens; phase 1: up to LONG, then one decode token */
            int from = phase ? 40 : 0, to = phase ? LONG : 40;
            for (int done = from; done < to;) {
                int n = to - done < 64 ? to - done : 64;
                struct model_batch_seq b = {.seq = seq,
                                            .tokens = toks + done,
                                            .n_tokens = n,
                                            .logits = threads == 1 ? base[phase] : lg};
                assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
                done += n;
            }
            if (threads == 1)
                continue;
            if (phase == 0)
                assert_memory_equal(base[0], lg, sizeof(float) * nv);
            else {
                float e = max_abs_diff(base[1], lg, nv) / max_abs(base[1], nv);
                print_message("  %d threads, %d tokens: max rel diff to 1 thread %.2e\n", threads,
                              LONG, e);
                assert_true(e <= 1e-5f);
            }
        }
        model_ctx_destroy(ctx);
        kv_seq_destroy(seq);
        kv_cache_destroy(cache);
    }
    free(base[0]);
    free(base[1]);
    free(lg);
    free(toks);
    model_free(m);
}

/* ------------------------------------------------------------------------
 * Batch contract: errors leave everything as it was
 * ------------------------------------------------------------------------ */

static void test_forward_errors(void **state)
{
    (void)state;
    model *m = small_model("errors.gguf");
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, KV_F32, 4, 64);
    struct kv_policy small = policy_none(8), big = policy_none(32);
    kv_seq *a = make_seq(cache, &big), *full = make_seq(cache, &small);
    model_ctx *ctx = make_ctx(m, 16, 1);
    int32_t t[16];
    fill_tokens(t, 16, nv, 9);
    float *lg = malloc(sizeof(float) * nv);

    struct model_batch_seq b[2] = {{.seq = a, .tokens = t, .n_tokens = 3, .logits = lg},
                                   {.seq = full, .tokens = t, .n_tokens = 6, .logits = NULL}};
    assert_int_equal(model_reserve_forward(ctx, b, 2, NULL), 0);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(full), 6);

    /* -ENOSPC: the second sequence would pass its budget of 8. */
    b[1].n_tokens = 3;
    int failed = -1;
    assert_int_equal(model_reserve_forward(ctx, b, 2, &failed), -ENOSPC);
    assert_int_equal(failed, 1);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(full), 6);

    /* -EINVAL: token outside the vocabulary; too many tokens; a sequence twice. */
    int32_t bad = nv;
    struct model_batch_seq e1 = {.seq = a, .tokens = &bad, .n_tokens = 1};
    assert_int_equal(model_reserve_forward(ctx, &e1, 1, NULL), -EINVAL);
    struct model_batch_seq e2 = {.seq = a, .tokens = t, .n_tokens = 17};
    assert_int_equal(model_reserve_forward(ctx, &e2, 1, NULL), -EINVAL);
    struct model_batch_seq e3[2] = {{.seq = a, .tokens = t, .n_tokens = 1},
                                    {.seq = a, .tokens = t, .n_tokens = 1}};
    assert_int_equal(model_reserve_forward(ctx, e3, 2, NULL), -EINVAL);
    struct model_batch_seq e4 = {.seq = a, .tokens = t, .n_tokens = 0};
    assert_int_equal(model_reserve_forward(ctx, &e4, 1, NULL), -EINVAL);
    assert_int_equal(kv_seq_n_tokens(a), 3);

    /* The pass itself writes only into reserved slots: slots that are not
     * these tokens' (never reserved, or another token's) are refused, and
     * nothing is appended. */
    struct model_batch_seq u = {.seq = a, .tokens = t, .n_tokens = 1, .first = 3};
    assert_int_equal(model_forward(ctx, &u, 1), -EINVAL);
    u.first = 0;
    u.tokens = &t[1]; /* slot 0 holds t[0] */
    assert_int_equal(model_forward(ctx, &u, 1), -EINVAL);
    assert_int_equal(kv_seq_n_tokens(a), 3);

    /* The sequence still continues exactly as a fresh one would. */
    b[0].tokens = t + 3;
    b[0].n_tokens = 2;
    assert_int_equal(model_reserve_forward(ctx, b, 1, NULL), 0);
    kv_seq *fresh = make_seq(cache, &big);
    float *lg2 = malloc(sizeof(float) * nv);
    struct model_batch_seq f = {.seq = fresh, .tokens = t, .n_tokens = 5, .logits = lg2};
    assert_int_equal(model_reserve_forward(ctx, &f, 1, NULL), 0);
    assert_true(max_abs_diff(lg, lg2, nv) < 1e-4f * max_abs(lg2, nv));

    /* A cache shaped for another model is refused. */
    struct model_mk_params p2 = small_params();
    p2.n_layer = 3;
    char path2[512];
    write_model(&p2, "errors3.gguf", path2, sizeof(path2));
    model *m3 = load_model(path2);
    model_ctx *ctx3 = make_ctx(m3, 4, 1);
    struct model_batch_seq g = {.seq = a, .tokens = t, .n_tokens = 1};
    assert_int_equal(model_reserve_forward(ctx3, &g, 1, NULL), -EINVAL);
    assert_int_equal(kv_seq_n_tokens(a), 5);
    model_ctx_destroy(ctx3);
    model_free(m3);

    char err[256];
    assert_int_equal(kv_cache_check(cache, err, sizeof(err)), 0);
    free(lg);
    free(lg2);
    model_ctx_destroy(ctx);
    kv_seq_destroy(a);
    kv_seq_destroy(full);
    kv_seq_destroy(fresh);
    kv_cache_destroy(cache);
    model_free(m);
}

/*
 * Sessions and LRU: an unpinned session in the batch that a later
 * sequence's append drops would lose what it just appended; the forward
 * fails with -ENOMEM and takes back the other appends. A session dropped
 * before a call starts over like a new sequence.
 */
static void test_forward_lru_drop(void **state)
{
    (void)state;
    model *m = small_model("lru.gguf");
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, KV_F32, 4, 8); /* 6 pages of 4 tokens */
    assert_int_equal(kv_cache_n_pages(cache), 6);
    struct kv_policy pol = policy_none(64);
    char err[256];
    kv_seq *a = kv_seq_create(cache, &pol, true, err, sizeof(err));
    kv_seq *b = make_seq(cache, &pol);
    assert_non_null(a);
    model_ctx *ctx = make_ctx(m, 32, 1);
    int32_t t[32];
    fill_tokens(t, 32, nv, 13);
    float *lg = malloc(sizeof(float) * nv), *fr = malloc(sizeof(float) * nv);
    struct model_batch_seq one = {.seq = a, .tokens = t, .n_tokens = 4};
    assert_int_equal(model_reserve_forward(ctx, &one, 1, NULL), 0);

    /* A takes a second page, then B's 20 tokens need the pages A holds. */
    struct model_batch_seq batch[2] = {{.seq = a, .tokens = t + 4, .n_tokens = 1},
                                       {.seq = b, .tokens = t, .n_tokens = 20}};
    int failed = -1;
    assert_int_equal(model_reserve_forward(ctx, batch, 2, &failed), -ENOMEM);
    assert_int_equal(failed, 0);
    assert_true(kv_seq_dropped(a));
    assert_int_equal(kv_seq_n_tokens(b), 0);
    assert_int_equal(kv_cache_check(cache, err, sizeof(err)), 0);

    /* The dropped session starts over and computes what a fresh one does. */
    one = (struct model_batch_seq){.seq = a, .tokens = t, .n_tokens = 6, .logits = lg};
    assert_int_equal(model_reserve_forward(ctx, &one, 1, NULL), 0);
    assert_int_equal(kv_seq_n_tokens(a), 6);
    one = (struct model_batch_seq){.seq = b, .tokens = t, .n_tokens = 6, .logits = fr};
    assert_int_equal(model_reserve_forward(ctx, &one, 1, NULL), 0);
    assert_memory_equal(lg, fr, sizeof(float) * nv);
    free(lg);
    free(fr);
    model_ctx_destroy(ctx);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_cache_destroy(cache);
    model_free(m);
}

/* H2O: the forward accumulates, per key, the attention mass of every head
 * and layer into the sequence. */
static void test_forward_h2o_mass(void **state)
{
    (void)state;
    model *m = small_model("h2o.gguf");
    kv_cache *cache = make_cache(m, KV_F32, 4, 64);
    struct kv_policy pol = {.kind = KV_EVICT_H2O,
                            .max_cache_tokens = 32,
                            .sink_tokens = 2,
                            .window_tokens = 8,
                            .heavy_tokens = 8,
                            .renumber = true};
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, 16, 2);
    int32_t t[48];
    fill_tokens(t, 48, m->n_vocab, 3);
    struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 10};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    /* Each query's probabilities sum to 1 per head and layer. */
    const float *mass = kv_seq_mass(seq);
    double sum = 0;
    for (int i = 0; i < 10; i++)
        sum += mass[i];
    assert_true(fabs(sum - 10.0 * m->n_head * m->n_layer) < 1e-3);
    /* The first token is seen by all ten queries, the last by one. */
    assert_true(mass[0] > mass[9]);
    /* Past the budget, h2o evicts and the forward keeps going. */
    for (int i = 10; i < 48; i++) {
        b.tokens = t + i;
        b.n_tokens = 1;
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    }
    assert_true(kv_seq_n_tokens(seq) <= 32);

    /* Logits of an H2O sequence (whose last layer runs over every query,
     * for the mass) equal those of a sequence without a policy. */
    kv_seq *h = make_seq(cache, &pol);
    struct kv_policy none = policy_none(32);
    kv_seq *plain = make_seq(cache, &none);
    float *l1 = malloc(sizeof(float) * m->n_vocab), *l2 = malloc(sizeof(float) * m->n_vocab);
    struct model_batch_seq hb[2] = {{.seq = h, .tokens = t, .n_tokens = 12, .logits = l1},
                                    {.seq = plain, .tokens = t, .n_tokens = 12, .logits = l2}};
    assert_int_equal(model_reserve_forward(ctx, hb, 1, NULL), 0);
    assert_int_equal(model_reserve_forward(ctx, hb + 1, 1, NULL), 0);
    assert_true(max_abs_diff(l1, l2, m->n_vocab) <= 1e-5f * max_abs(l2, m->n_vocab));
    free(l1);
    free(l2);
    kv_seq_destroy(h);
    kv_seq_destroy(plain);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
}

/* ------------------------------------------------------------------------
 * Eviction equivalence (ARCHITECTURE.md Invariant 3)
 * ------------------------------------------------------------------------ */

/*
 * (1) One layer: a token's K/V depend on that token only, so after
 * sink-window eviction with renumbered positions the next-token logits
 * must equal a fresh forward over exactly the retained tokens.
 */
static void test_evict_one_layer_equals_fresh(void **state)
{
    (void)state;
    struct model_mk_params p = small_params();
    p.n_layer = 1;
    char path[512];
    write_model(&p, "evict1.gguf", path, sizeof(path));
    model *m = load_model(path);
    int nv = m->n_vocab;
    kv_cache *cache = make_cache(m, KV_F32, 4, 256);
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = 28,
                            .sink_tokens = 4,
                            .window_tokens = 16,
                            .renumber = true};
    kv_seq *seq = make_seq(cache, &pol);
    model_ctx *ctx = make_ctx(m, 32, 2);
    int32_t t[120];
    fill_tokens(t, 120, nv, 11);
    float *lg = malloc(sizeof(float) * nv), *fr = malloc(sizeof(float) * nv);
    struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 20, .logits = lg};
    assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    int checks = 0;
    float worst = 0;
    for (int i = 20; i < 120; i++) {
        b.tokens = t + i;
        b.n_tokens = 1;
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        int n = kv_seq_n_tokens(seq);
        const int32_t *pos = kv_seq_positions(seq);
        for (int j = 0; j < n; j++)
            assert_int_equal(pos[j], j); /* renumbered */
        if (kv_seq_hist_index(seq)[n - 1] == n - 1)
            continue; /* nothing evicted yet */
        /* Fresh forward over exactly the retained tokens. */
        kv_seq *fresh = make_seq(
            cache,
            &(struct kv_policy){.kind = KV_EVICT_NONE, .max_cache_tokens = 32, .renumber = true});
        struct model_batch_seq f = {
            .seq = fresh, .tokens = kv_seq_tokens(seq), .n_tokens = n, .logits = fr};
        assert_int_equal(model_reserve_forward(ctx, &f, 1, NULL), 0);
        float e = max_abs_diff(lg, fr, nv) / max_abs(fr, nv);
        worst = e > worst ? e : worst;
        kv_seq_destroy(fresh);
        checks++;
    }
    struct kv_stats st;
    kv_cache_stats(cache, &st);
    print_message("  %llu evictions, %d checks, max rel diff %.2e\n",
                  (unsigned long long)st.evictions, checks, worst);
    assert_true(st.evictions >= 10);
    assert_true(checks >= 50);
    assert_true(worst < 1e-5f);
    free(lg);
    free(fr);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
}

struct drift {
    float first_diff;   /* max rel logit diff at the first eviction */
    float last_diff;    /* ... at the last check */
    float worst_diff;   /* over all checks */
    double ref_key_err; /* layer-0 keys: reference's stored vs exact rotation (max rel L2) */
    double kvd_key_err; /* layer-0 keys: kvd's stored (rotated exactly) vs exact */
    int evictions, max_rerot;
};

/*
 * (2) Many layers: kvd against the re-rotating reference, decode token by
 * token through `target` sink-window evictions. kv_seq_hist_index tells
 * which entries survived each step; the reference drops the others and
 * turns each survivor's rotated key by its position change.
 */
static struct drift evict_vs_rerotating(const char *path, enum kv_type kvt, int page_tokens,
                                        int sink, int window, int target, uint32_t seed)
{
    model *m = load_model(path);
    struct ref_model r;
    ref_load(&r, path);
    int nv = m->n_vocab;
    int sink_pages = (sink + page_tokens - 1) / page_tokens;
    int budget = sink_pages * page_tokens + window + page_tokens;
    kv_cache *cache = make_cache(m, kvt, page_tokens, budget + 2 * page_tokens);
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = budget,
                            .sink_tokens = sink,
                            .window_tokens = window,
                            .renumber = true};
    kv_seq *seq = make_seq(cache, &pol);
    struct ref_seq rs;
    ref_seq_init(&rs, &r, budget + 1, kvt == KV_F16);
    model_ctx *ctx = make_ctx(m, 4, 2);
    float *lg = malloc(sizeof(float) * nv), *ref = malloc(sizeof(float) * nv);
    struct drift d = {0};
    int32_t tok = 1; /* BOS, then tokens from a fixed stream */
    uint32_t st = seed;
    int fed = 0;
    struct kv_stats ks = {0};
    while ((int)ks.evictions < target) {
        struct model_batch_seq b = {.seq = seq, .tokens = &tok, .n_tokens = 1, .logits = lg};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        int n = kv_seq_n_tokens(seq);
        const int32_t *hidx = kv_seq_hist_index(seq);
        const int32_t *pos = kv_seq_positions(seq);
        assert_int_equal(hidx[n - 1], fed);
        int rr = ref_seq_evict(&r, &rs, hidx, pos, n - 1);
        d.max_rerot = rr > d.max_rerot ? rr : d.max_rerot;
        ref_step(&r, &rs, tok, pos[n - 1], fed, ref);
        fed++;
        kv_cache_stats(cache, &ks);
        if (ks.evictions > 0) {
            float e = max_abs_diff(lg, ref, nv) / max_abs(ref, nv);
            if (d.evictions == 0)
                d.first_diff = e;
            d.last_diff = e;
            d.worst_diff = e > d.worst_diff ? e : d.worst_diff;
        }
        d.evictions = (int)ks.evictions;
        /* Next token: a stream of pseudo-random ids mixed with the argmax,
         * so the text is neither constant nor pure noise. */
        st = st * 1664525u + 1013904223u;
        tok = (st >> 28) < 8 ? argmax(lg, nv) : 3 + (int32_t)((st >> 8) % (uint32_t)(nv - 3));
    }
    /* Key drift: each stored key against the exact rotation of the
     * unrotated key to its current position. Layer 0 only: its keys depend
     * on the token alone, so both engines start from the same key there;
     * deeper keys also carry the differences of the layers below. */
    int n = kv_seq_n_tokens(seq), hd = r.hd;
    const int32_t *pos = kv_seq_positions(seq);
    float *kx = malloc(sizeof(float) * hd);
    for (int l = 0; l < 1; l++) {
        for (int i = 0; i < n; i++) {
            for (int h = 0; h < r.n_kv; h++) {
                const float *u = ref_kv(&r, &rs, rs.unrot, l, i) + h * hd;
                const float *rk = ref_kv(&r, &rs, rs.k, l, i) + h * hd;
                /* Exact: rotate the f64-faithful unrotated key (in f32 storage). */
                memcpy(kx, u, sizeof(float) * hd);
                ref_rope(&r, kx, pos[i]);
                /* kvd's: its stored (unrotated) key, rotated exactly. */
                float kv[1024];
                const void *src = kv_seq_k(seq, l, h, i);
                if (kvt == KV_F32)
                    memcpy(kv, src, sizeof(float) * hd);
                else
                    qt_f16_to_f32_row(src, kv, (size_t)hd);
                ref_rope(&r, kv, pos[i]);
                double nrm = 0, er = 0, ek = 0;
                for (int e = 0; e < hd; e++) {
                    nrm += (double)kx[e] * kx[e];
                    er += ((double)rk[e] - kx[e]) * ((double)rk[e] - kx[e]);
                    ek += ((double)kv[e] - kx[e]) * ((double)kv[e] - kx[e]);
                }
                if (nrm > 0) {
                    d.ref_key_err = fmax(d.ref_key_err, sqrt(er / nrm));
                    d.kvd_key_err = fmax(d.kvd_key_err, sqrt(ek / nrm));
                }
            }
        }
    }
    free(kx);
    free(lg);
    free(ref);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    ref_seq_free(&rs);
    ref_free(&r);
    model_free(m);
    return d;
}

static void test_evict_multilayer_equals_rerotating_reference(void **state)
{
    (void)state;
    struct model_mk_params p = small_params();
    p.n_layer = 3;
    char path[512];
    write_model(&p, "evict3.gguf", path, sizeof(path));
    struct drift d = evict_vs_rerotating(path, KV_F32, 4, 4, 16, 20, 21);
    print_message("  3-layer mkmodel, f32 KV: %d evictions, max rel logit diff %.2e\n", d.evictions,
                  d.worst_diff);
    assert_true(d.worst_diff < 1e-4f);

    /* qwen2 (NeoX pairs, biases on keys) too. */
    p = shape_params(&shapes[2], GGML_TYPE_F32);
    p.n_layer = 2;
    write_model(&p, "evict-qwen2.gguf", path, sizeof(path));
    d = evict_vs_rerotating(path, KV_F32, 2, 2, 10, 20, 22);
    print_message("  qwen2 mkmodel, f32 KV: %d evictions, max rel logit diff %.2e\n", d.evictions,
                  d.worst_diff);
    assert_true(d.worst_diff < 1e-4f);
}

/*
 * stories260K: equality with the re-rotating reference, then the drift
 * report: with one-token pages and a 100-token window, each eviction
 * removes one token and renumbers the window, so a surviving key is
 * re-rotated at every one of 100 successive evictions.
 */
static void test_evict_stories_drift(void **state)
{
    (void)state;
    char buf[1024];
    const char *path = shared_model("stories260K.gguf", buf, sizeof(buf));
    if (!path) {
        skip();
        return;
    }
    struct drift d = evict_vs_rerotating(path, KV_F32, 16, 4, 48, 6, 31);
    print_message("  stories260K, 16-token pages, f32 KV: %d evictions, max rel logit diff %.2e\n",
                  d.evictions, d.worst_diff);
    assert_true(d.worst_diff < 1e-4f);

    static const enum kv_type kvts[] = {KV_F32, KV_F16};
    for (int i = 0; i < 2; i++) {
        d = evict_vs_rerotating(path, kvts[i], 1, 4, 100, 100, 41);
        print_message("  stories260K, %s KV, %d evictions (one token each), up to %d keys "
                      "re-rotated per eviction:\n"
                      "    re-rotating reference vs kvd: logits max rel diff %.2e at the first "
                      "eviction, %.2e after the last (worst %.2e)\n"
                      "    layer-0 keys vs exact rotation: reference %.2e, kvd %.2e (max rel L2)\n",
                      kv_type_name(kvts[i]), d.evictions, d.max_rerot, d.first_diff, d.last_diff,
                      d.worst_diff, d.ref_key_err, d.kvd_key_err);
        assert_int_equal(d.evictions, 100);
        /* kvd's keys carry one rounding; the reference's carry up to 100. */
        assert_true(d.kvd_key_err <= (kvts[i] == KV_F32 ? 1e-5 : 1e-3));
        if (kvts[i] == KV_F16)
            assert_true(d.ref_key_err > d.kvd_key_err);
        assert_true(d.worst_diff < (kvts[i] == KV_F32 ? 1e-3f : 5e-2f));
    }
}

/* ------------------------------------------------------------------------
 * stories260K: a real model
 * ------------------------------------------------------------------------ */

/* Greedy continuation of prompt on n_batch identical sequences in one
 * batch; prefill_chunk 0 = the whole prompt in one call. Writes the
 * generated ids of sequence 0 to out; all sequences must agree. */
static void greedy(model *m, const char *prompt, int n_gen, int n_batch, int prefill_chunk,
                   int32_t *out)
{
    int nv = m->n_vocab;
    int32_t ptoks[64];
    int np = model_tokenize(m, prompt, strlen(prompt), true, ptoks, 64);
    assert_true(np > 1 && np < 64);
    kv_cache *cache = make_cache(m, KV_F32, 16, n_batch * (np + n_gen + 16));
    struct kv_policy pol = policy_none(np + n_gen + 1);
    kv_seq *seq[8];
    struct model_batch_seq b[8];
    float *lg = malloc(sizeof(float) * nv * n_batch);
    int32_t cur[8];
    int32_t gen[8][128];
    model_ctx *ctx = make_ctx(m, n_batch * np, 2);
    for (int s = 0; s < n_batch; s++)
        seq[s] = make_seq(cache, &pol);
    int chunk = prefill_chunk ? prefill_chunk : np;
    for (int done = 0; done < np; done += chunk) {
        int n = np - done < chunk ? np - done : chunk;
        for (int s = 0; s < n_batch; s++)
            b[s] = (struct model_batch_seq){
                .seq = seq[s], .tokens = ptoks + done, .n_tokens = n, .logits = lg + s * nv};
        assert_int_equal(model_reserve_forward(ctx, b, n_batch, NULL), 0);
    }
    for (int g = 0; g < n_gen; g++) {
        for (int s = 0; s < n_batch; s++) {
            cur[s] = argmax(lg + s * nv, nv);
            gen[s][g] = cur[s];
            b[s] = (struct model_batch_seq){
                .seq = seq[s], .tokens = &cur[s], .n_tokens = 1, .logits = lg + s * nv};
        }
        assert_int_equal(model_reserve_forward(ctx, b, n_batch, NULL), 0);
    }
    for (int s = 1; s < n_batch; s++)
        assert_memory_equal(gen[0], gen[s], sizeof(int32_t) * n_gen);
    memcpy(out, gen[0], sizeof(int32_t) * n_gen);
    for (int s = 0; s < n_batch; s++)
        kv_seq_destroy(seq[s]);
    model_ctx_destroy(ctx);
    kv_cache_destroy(cache);
    free(lg);
}

static void test_stories_greedy(void **state)
{
    (void)state;
    char buf[1024];
    const char *path = shared_model("stories260K.gguf", buf, sizeof(buf));
    if (!path) {
        skip();
        return;
    }
    model *m = load_model(path);
    struct model_info info;
    model_get_info(m, &info);
    assert_string_equal(info.arch, "llama");
    assert_int_equal(info.n_embd, 64);
    assert_int_equal(info.n_layer, 5);
    assert_int_equal(info.n_head, 8);
    assert_int_equal(info.n_kv_head, 4);
    assert_int_equal(info.n_vocab, 512);
    assert_int_equal(info.n_ctx_train, 2048);
    assert_string_equal(info.weight_type, "f32");

    enum { N = 64 };
    int32_t one[N], eight[N], tbt[N];
    greedy(m, "Once upon a time", N, 1, 0, one);
    greedy(m, "Once upon a time", N, 8, 0, eight);
    greedy(m, "Once upon a time", N, 1, 1, tbt);

    /* Decode and judge the text. */
    model_detok *d = model_detok_create(m);
    char text[4096];
    int len = 0;
    for (int i = 0; i < N; i++) {
        int w = model_detok_push(d, one[i], text + len, sizeof(text) - (size_t)len - 64);
        assert_true(w >= 0);
        len += w;
    }
    len += model_detok_flush(d, text + len, sizeof(text) - (size_t)len);
    text[len] = '\0';
    model_detok_destroy(d);
    print_message("  \"Once upon a time\" ->%s\n", text);
    int letters = 0;
    for (int i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        assert_true(c < 128 && (c >= 32 || c == '\n'));
        letters += (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    }
    assert_true(letters > len / 2);
    static const char *common[] = {" the ", " was ", " a ",    " and ", " to ",   " She ", " He ",
                                   " her ", " his ", " they ", " day",  " happy", " play"};
    int found = 0;
    for (size_t i = 0; i < sizeof(common) / sizeof(common[0]); i++)
        found += strstr(text, common[i]) != NULL;
    assert_true(found >= 3);

    /* Batch of 8 and token-by-token prefill: the same story. */
    assert_memory_equal(one, eight, sizeof(one));
    assert_memory_equal(one, tbt, sizeof(one));
    model_free(m);
}

/* Forward vs reference on the real model (adjacent RoPE pairs, GQA 2). */
static void test_stories_matches_reference(void **state)
{
    (void)state;
    char buf[1024];
    const char *path = shared_model("stories260K.gguf", buf, sizeof(buf));
    if (!path) {
        skip();
        return;
    }
    float e = check_against_reference(path, KV_F32, 2);
    print_message("  stories260K: max rel diff %.2e\n", e);
    assert_true(e < 1e-4f);
}

/* The ctx128 conversion differs only in context_length: identical logits,
 * also past 128 tokens (the training context is metadata, not a limit). */
static void test_stories_ctx128_identical(void **state)
{
    (void)state;
    char b1[1024], b2[1024];
    const char *p1 = shared_model("stories260K.gguf", b1, sizeof(b1));
    const char *p2 = shared_model("stories260K-ctx128.gguf", b2, sizeof(b2));
    if (!p1 || !p2) {
        skip();
        return;
    }
    model *m[2] = {load_model(p1), load_model(p2)};
    struct model_info info;
    model_get_info(m[1], &info);
    assert_int_equal(info.n_ctx_train, 128);
    int nv = m[0]->n_vocab;
    int32_t t[200];
    fill_tokens(t, 200, nv, 77);
    float *lg[2][2];
    for (int k = 0; k < 2; k++) {
        kv_cache *cache = make_cache(m[k], KV_F16, 16, 220);
        struct kv_policy pol = policy_none(210);
        kv_seq *seq = make_seq(cache, &pol);
        model_ctx *ctx = make_ctx(m[k], 190, 2);
        lg[k][0] = malloc(sizeof(float) * nv);
        lg[k][1] = malloc(sizeof(float) * nv);
        struct model_batch_seq b = {.seq = seq, .tokens = t, .n_tokens = 190, .logits = lg[k][0]};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        for (int i = 190; i < 200; i++) {
            b = (struct model_batch_seq){
                .seq = seq, .tokens = t + i, .n_tokens = 1, .logits = lg[k][1]};
            assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
        }
        model_ctx_destroy(ctx);
        kv_seq_destroy(seq);
        kv_cache_destroy(cache);
    }
    assert_memory_equal(lg[0][0], lg[1][0], sizeof(float) * nv);
    assert_memory_equal(lg[0][1], lg[1][1], sizeof(float) * nv);
    for (int k = 0; k < 2; k++) {
        free(lg[k][0]);
        free(lg[k][1]);
        model_free(m[k]);
    }
}

/* ------------------------------------------------------------------------
 * Loading
 * ------------------------------------------------------------------------ */

/* A GGUF built from a mkmodel file by mutate(): every metadata key and
 * tensor copied, except that `drop` (key or tensor) is left out, `reshape`
 * gets its rows and columns swapped in the shape (same bytes), and `arch`,
 * when given, replaces general.architecture. */
static void write_mutant(const char *src, const char *dst, const char *drop, const char *reshape,
                         const char *arch)
{
    struct mutation mu = {.drop_key = drop, .drop_tensor = drop};
    if (arch)
        mu.set[0] =
            (struct kv_set){.key = "general.architecture", .type = GGUF_TYPE_STRING, .s = arch};
    if (reshape) {
        char err[256];
        gguf_file *f = gguf_open(src, err, sizeof(err));
        assert_non_null(f);
        const struct gguf_tensor *rt = gguf_find_tensor(f, reshape);
        assert_non_null(rt);
        mu.reshape_tensor = reshape;
        mu.reshape_ne0 = rt->ne[1];
        mu.reshape_ne1 = rt->ne[0];
        gguf_close(f);
    }
    mutate(src, dst, &mu);
}

static void test_load_errors(void **state)
{
    (void)state;
    char path[512], bad[600];
    expect_load_error("/nonexistent/model.gguf", "/nonexistent/model.gguf");

    snprintf(bad, sizeof(bad), "%s/garbage.gguf", tmp_dir);
    FILE *f = fopen(bad, "wb");
    fputs("this is not a GGUF file at all, just text", f);
    fclose(f);
    expect_load_error(bad, "garbage.gguf");

    struct model_mk_params p = small_params();
    write_model(&p, "good.gguf", path, sizeof(path));
    snprintf(bad, sizeof(bad), "%s/m1.gguf", tmp_dir);
    write_mutant(path, bad, "blk.1.ffn_up.weight", NULL, NULL);
    expect_load_error(bad, "missing tensor blk.1.ffn_up.weight");
    write_mutant(path, bad, NULL, "blk.0.attn_k.weight", NULL);
    expect_load_error(bad, "tensor blk.0.attn_k.weight has shape [32, 64");
    write_mutant(path, bad, "llama.embedding_length", NULL, NULL);
    expect_load_error(bad, "missing metadata key llama.embedding_length");
    write_mutant(path, bad, NULL, NULL, "gptj");
    expect_load_error(bad, "architecture 'gptj' is not supported");
    write_mutant(path, bad, "tokenizer.ggml.tokens", NULL, NULL);
    expect_load_error(bad, "tokenizer");

    /* The untouched copy loads: the mutant writer itself is faithful. */
    write_mutant(path, bad, NULL, NULL, NULL);
    model_free(load_model(bad));

    /* qwen2 without its biases is incomplete. */
    p.arch = "qwen2";
    write_model(&p, "qwen2.gguf", path, sizeof(path));
    write_mutant(path, bad, "blk.0.attn_v.bias", NULL, NULL);
    expect_load_error(bad, "missing tensor blk.0.attn_v.bias");
}

static void test_load_info(void **state)
{
    (void)state;
    struct model_mk_params p = small_params();
    p.type = GGML_TYPE_Q8_0;
    p.tied = true;
    p.rope_dims = 8;
    p.n_ctx_train = 777;
    char path[512];
    write_model(&p, "info.gguf", path, sizeof(path));
    model *m = load_model(path);
    struct model_info i;
    model_get_info(m, &i);
    assert_string_equal(i.arch, "llama");
    assert_int_equal(i.pos, POS_ROPE);
    assert_string_equal(i.weight_type, "q8_0");
    assert_int_equal(i.n_vocab, 300);
    assert_int_equal(i.n_ctx_train, 777);
    assert_int_equal(i.n_embd, 64);
    assert_int_equal(i.n_layer, 2);
    assert_int_equal(i.n_head, 4);
    assert_int_equal(i.n_kv_head, 2);
    assert_int_equal(i.head_dim, 16);
    assert_int_equal(i.n_ff, 96);
    assert_true(m->tied);
    assert_int_equal(m->pos.rope_dims, 8);
    assert_int_equal(m->pos.rope_pairing, POS_ROPE_ADJACENT);
    struct kv_cache_params cp = {0};
    model_kv_shape(m, &cp);
    assert_int_equal(cp.n_layer, 2);
    assert_int_equal(cp.n_kv_head, 2);
    assert_int_equal(cp.head_dim, 16);
    assert_true(model_add_bos(m));
    assert_int_equal(model_bos(m), 1);
    assert_true(model_is_eog(m, 2));
    assert_false(model_is_eog(m, 100));

    /* repacked at load when the level has kernels for q8_0 (model_pack.c):
     * 2 layers x 7 matrices + the (tied) output, each with its copy */
    char line[256];
    model_pack_describe(m, line, sizeof line);
    print_message("  weights: %s\n", line);
    struct mm_weight *ws[] = {&m->layers[0].wq, &m->layers[1].down, &m->output};
    const size_t q8_bytes = m->pack_bytes;
    if (mm_pack_has(GGML_TYPE_Q8_0)) {
        assert_int_equal(m->pack_count, 15);
        assert_true(m->pack_bytes >= 15 * 16 * 34 * 2); /* at least the rows' bytes */
        assert_non_null(strstr(line, "15 matrices repacked"));
        for (int k = 0; k < 3; k++)
            assert_true(ws[k]->packed && mm_pack_ready(ws[k]));
        assert_null(m->tok_embd.packed); /* read row by row, never repacked */
    } else {                             /* copied as stored, into the same pages */
        assert_int_equal(m->pack_count, 0);
        assert_int_equal(m->pack_copied, 15);
        assert_non_null(strstr(line, "15 copied as stored"));
    }
    model_free(m);

    /* q4_0: repacked as its nibbles where the level has repacked kernels:
     * 18 bytes per block of 32 as stored, against q8_0's 34 */
    p.type = GGML_TYPE_Q4_0;
    write_model(&p, "info_q4_0.gguf", path, sizeof(path));
    m = load_model(path);
    model_pack_describe(m, line, sizeof line);
    print_message("  weights: %s\n", line);
    if (mm_pack_has(GGML_TYPE_Q4_0)) {
        assert_int_equal(m->pack_count, 15);
        assert_int_equal(m->pack_bytes * 34, q8_bytes * 18);
        assert_true(m->output.packed && mm_pack_ready(&m->output));
    }
    model_free(m);

    /* at a level without repacked kernels (scalar): every product matrix
     * copied row for row into the owned pages, the embedding left as mapped */
    assert_int_equal(cpu_force("scalar", NULL, 0), 0);
    m = load_model(path);
    model_pack_describe(m, line, sizeof line);
    print_message("  weights: %s\n", line);
    assert_int_equal(m->pack_count, 0);
    assert_int_equal(m->pack_copied, 15);
    assert_non_null(strstr(line, "15 copied as stored (no repacked kernels for q4_0"));
    const uint8_t *lo = m->pack_mem, *hi = lo + m->pack_bytes;
    struct mm_weight *wq4[] = {&m->layers[0].wq, &m->layers[1].down, &m->output};
    for (int k = 0; k < 3; k++) {
        const uint8_t *d = wq4[k]->data;
        assert_null(wq4[k]->packed);
        assert_true(d >= lo && d + wq4[k]->row_bytes * (size_t)wq4[k]->n_out <= hi);
    }
    const uint8_t *e = m->tok_embd.data;
    assert_true(e < lo || e >= hi);
    model_free(m);
    assert_int_equal(cpu_force("auto", NULL, 0), 0);
}

/* ------------------------------------------------------------------------
 * mkmodel
 * ------------------------------------------------------------------------ */

static char *slurp(const char *path, size_t *len)
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
    *len = (size_t)n;
    return b;
}

static void test_mkmodel_deterministic(void **state)
{
    (void)state;
    struct model_mk_params p = small_params();
    char a[512], b[512], c[512];
    write_model(&p, "det-a.gguf", a, sizeof(a));
    write_model(&p, "det-b.gguf", b, sizeof(b));
    p.seed++;
    write_model(&p, "det-c.gguf", c, sizeof(c));
    size_t na, nb, nc;
    char *fa = slurp(a, &na), *fb = slurp(b, &nb), *fc = slurp(c, &nc);
    assert_int_equal(na, nb);
    assert_memory_equal(fa, fb, na);
    assert_int_equal(na, nc);
    assert_true(memcmp(fa, fc, na) != 0);
    free(fa);
    free(fb);
    free(fc);

    char err[256];
    p = small_params();
    p.n_kv_head = 3;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "kv-heads"));
    p = small_params();
    p.type = GGML_TYPE_Q8_0;
    p.n_ff = 100;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "multiples of 32"));
    p = small_params();
    p.n_vocab = 100;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    p = small_params();
    p.rope_dims = 5;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    enum ggml_type t;
    assert_int_equal(model_mk_parse_type("q4_0", &t), 0);
    assert_int_equal(t, GGML_TYPE_Q4_0);
    assert_int_equal(model_mk_parse_type("q5_1", &t), -EINVAL);
}

/* The vocabulary: any text round-trips, common words are single pieces. */
static void test_mkmodel_vocab(void **state)
{
    (void)state;
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 32;
    p.n_head = 2;
    p.n_kv_head = 1;
    p.n_ff = 32;
    p.n_layer = 1;
    char path[512];
    write_model(&p, "vocab.gguf", path, sizeof(path));
    model *m = load_model(path);
    static const char *texts[] = {
        "Once upon a time, there was a little girl named Lily.",
        "  Spaces,\ttabs\nand newlines; punctuation!? (yes) \"quotes\" 'too' - 42",
        "Unicode: na\xc3\xafve caf\xc3\xa9, \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e, "
        "\xf0\x9f\x99\x82 and \xc3\x9f",
        "zzzqqqxxx",
    };
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        int32_t ids[512];
        int n = model_tokenize(m, texts[i], strlen(texts[i]), false, ids, 512);
        assert_true(n > 0 && n <= 512);
        for (int k = 0; k < n; k++)
            assert_true(ids[k] > 2 && ids[k] < m->n_vocab);
        /* Decode as a text from its start: a fresh stream strips the one
         * space the encoder put in front. */
        char out[2048];
        int len = tok_decode(m->tok, ids, n, true, out, sizeof(out));
        assert_int_equal(len, (int)strlen(texts[i]));
        assert_memory_equal(out, texts[i], (size_t)len);
    }
    /* Common words are pieces of their own. */
    int32_t ids[16];
    assert_int_equal(model_tokenize(m, "the", 3, false, ids, 16), 1);
    assert_int_equal(model_tokenize(m, "Once upon a time", 16, false, ids, 16), 4);
    assert_int_equal(model_tokenize(m, "hi", 2, true, ids, 16) >= 2, true);
    assert_int_equal(ids[0], 1); /* BOS */
    model_free(m);
}

/* Seeded init is numerically healthy: finite logits with a useful spread,
 * on the default shape and deep/wide ones. */
static void test_mkmodel_healthy(void **state)
{
    (void)state;
    struct model_mk_params ps[3];
    model_mk_defaults(&ps[0]);
    ps[1] = small_params();
    ps[1].n_layer = 24;
    ps[2] = small_params();
    ps[2].n_embd = 512;
    ps[2].n_head = 8;
    ps[2].n_kv_head = 2;
    ps[2].n_ff = 1024;
    ps[2].n_layer = 2;
    ps[2].tied = true;
    for (int k = 0; k < 3; k++) {
        char path[512], name[32];
        snprintf(name, sizeof(name), "healthy%d.gguf", k);
        write_model(&ps[k], name, path, sizeof(path));
        double sd, top;
        logit_health(path, &sd, &top);
        print_message("  dim %d, %d layers%s: logit std %.2f, top probability %.3f\n", ps[k].n_embd,
                      ps[k].n_layer, ps[k].tied ? " (tied)" : "", sd, top);
        assert_true(sd > 0.5 && sd < 10.0);
        assert_true(top < 0.9);
    }
}

/* ------------------------------------------------------------------------
 * The kvd binary
 * ------------------------------------------------------------------------ */

/* Run a shell command; stdout and stderr go to files in tmp_dir. Returns
 * the exit status. */
static int run_kvd(const char *args, char **out, char **err)
{
    char cmd[2048], po[400], pe[400];
    snprintf(po, sizeof(po), "%s/cli.out", tmp_dir);
    snprintf(pe, sizeof(pe), "%s/cli.err", tmp_dir);
    snprintf(cmd, sizeof(cmd), "%s %s >'%s' 2>'%s' </dev/null", getenv("KVD_BIN"), args, po, pe);
    int st = system(cmd);
    size_t n;
    *out = slurp(po, &n);
    *err = slurp(pe, &n);
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
    char args[1400], *out, *err;

    /* A bad model file: non-zero exit with the loader's message. */
    char bad[512];
    snprintf(bad, sizeof(bad), "%s/not-a-model.gguf", tmp_dir);
    FILE *f = fopen(bad, "wb");
    fputs("GGUF but not really", f);
    fclose(f);
    snprintf(args, sizeof(args), "generate --model '%s' --prompt hi", bad);
    int rc = run_kvd(args, &out, &err);
    print_message("  generate --model BAD: exit %d, stderr: %s", rc, err);
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(err, "kvd generate: "));
    assert_non_null(strstr(err, "not-a-model.gguf"));
    free(out);
    free(err);
    snprintf(args, sizeof(args), "generate --model '%s/missing.gguf' --prompt hi", tmp_dir);
    assert_int_not_equal(run_kvd(args, &out, &err), 0);
    assert_non_null(strstr(err, "missing.gguf"));
    free(out);
    free(err);

    /* mkmodel, then tokenize and generate with it. */
    char path[512];
    snprintf(path, sizeof(path), "%s/cli.gguf", tmp_dir);
    snprintf(args, sizeof(args),
             "mkmodel --out '%s' --dim 64 --layers 2 --heads 4 --kv-heads 2 --ff 64 --vocab 700 "
             "--type q8_0 --seed 3",
             path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_non_null(strstr(out, "wrote"));
    free(out);
    free(err);
    snprintf(args, sizeof(args), "mkmodel --out '%s' --heads 5", path);
    assert_int_equal(run_kvd(args, &out, &err), 2);
    assert_non_null(strstr(err, "heads"));
    free(out);
    free(err);

    snprintf(args, sizeof(args), "tokenize --model '%s' 'Once upon a time'", path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    model *m = load_model(path);
    int32_t ids[16];
    int n = model_tokenize(m, "Once upon a time", 16, false, ids, 16);
    char want[256] = "";
    for (int i = 0; i < n; i++)
        snprintf(want + strlen(want), sizeof(want) - strlen(want), i ? " %d" : "%d", ids[i]);
    strcat(want, "\n");
    assert_string_equal(out, want);
    free(out);
    free(err);
    snprintf(args, sizeof(args), "tokenize --model '%s' --pieces 'the girl'", path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_non_null(strstr(out, "\t' the'\n"));
    assert_non_null(strstr(out, "\t' girl'\n"));
    free(out);
    free(err);

    snprintf(args, sizeof(args),
             "generate --model '%s' --prompt 'Once upon a time' -n 80 --temp 0 --ctx 48 "
             "--policy sink-window --sink 4 --window 12 --no-echo",
             path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    print_message("  generate with eviction: %zu bytes of text; stderr:\n%s", strlen(out), err);
    assert_true(strlen(out) > 20);
    assert_non_null(strstr(err, "prefill:"));
    assert_non_null(strstr(err, "decode:"));
    assert_non_null(strstr(err, "tokens/s"));
    assert_null(strstr(err, " 0 evictions"));
    char *first = strdup(out);
    free(out);
    free(err);
    /* Greedy is deterministic; the same run gives the same text. */
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_string_equal(first, out);
    free(first);
    free(out);
    free(err);

    /* Policy none stops at the context with a reason, still exit 0. */
    snprintf(args, sizeof(args),
             "generate --model '%s' --prompt 'Once upon a time' -n 100 --temp 0 --ctx 20", path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_non_null(strstr(err, "context full"));
    free(out);
    free(err);
    model_free(m);
}

/*
 * Vocabulary-only files (a tokenizer and no tensors, as the converter's
 * --vocab-only writes them): model_load with vocab_only loads them, runs no
 * forward, and `kvd tokenize` gives the reference ids of their test strings.
 * A tokenizer.ggml.pre kvd does not know is refused with the value named,
 * unless --tokenizer-pre names a known one.
 */
static void test_vocab_only(void **state)
{
    (void)state;
    static const char *const names[] = {"gpt-2", "llama-spm", "phi-3", "falcon", "starcoder"};
    bool have_bin = getenv("KVD_BIN") && *getenv("KVD_BIN");
    char path[1024], args[2800], *out, *err;
    int checked = 0;
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++) {
        snprintf(path, sizeof(path), "%s/vocab/ggml-vocab-%s.gguf", shared_dir(), names[k]);
        if (access(path, R_OK) != 0) {
            print_message("  %s absent: skipped\n", path);
            continue;
        }
        char e[512];
        assert_null(model_load(&(struct model_params){.path = path}, e, sizeof(e)));
        struct model_params mp = {.path = path, .vocab_only = true};
        model *m = model_load(&mp, e, sizeof(e));
        if (!m)
            fail_msg("vocab-only %s: %s", path, e);
        assert_null(model_ctx_create(m, 8, 1, e, sizeof(e)));
        assert_non_null(strstr(e, "vocabulary-only"));
        model_free(m);
        if (!have_bin)
            continue;
        /* The first string of the .inp file that is a plain line, through the CLI. */
        char ip[1100], op[1100], tp[512];
        snprintf(ip, sizeof(ip), "%s.inp", path);
        snprintf(op, sizeof(op), "%s.out", path);
        size_t n;
        char *inp = slurp(ip, &n), *outp = slurp(op, &n);
        assert_true(inp && outp);
        char *sep = strstr(inp, "\n__ggml_vocab_test__\n"), *eol = strchr(outp, '\n');
        assert_true(sep && eol);
        snprintf(tp, sizeof(tp), "%s/vocab-text", tmp_dir);
        FILE *f = fopen(tp, "wb");
        fwrite(inp, 1, (size_t)(sep - inp), f);
        fclose(f);
        snprintf(args, sizeof(args), "tokenize --model '%s' --file '%s'", path, tp);
        assert_int_equal(run_kvd(args, &out, &err), 0);
        char *want = outp[0] == ' ' ? outp + 1 : outp; /* the .out lines start with a space */
        eol[1] = '\0';
        assert_string_equal(out, want);
        checked++;
        free(out);
        free(err);
        free(inp);
        free(outp);
    }
    print_message("  %d vocabulary-only files tokenized through kvd tokenize\n", checked);
    if (!have_bin)
        return;

    /* An unknown pre-tokenizer, refused by name; forced, it runs with a note. */
    gguf_writer *w = gguf_writer_create();
    static const char *const toks[] = {"a", "b", "c"};
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", toks, 0);
    gguf_writer_set_str(w, "tokenizer.ggml.pre", "no-such-pre");
    snprintf(path, sizeof(path), "%s/vocab-unknown.gguf", tmp_dir);
    assert_int_equal(gguf_writer_write(w, path, NULL, 0), 0);
    gguf_writer_destroy(w);
    snprintf(args, sizeof(args), "tokenize --model '%s' abc", path);
    assert_int_equal(run_kvd(args, &out, &err), 1);
    assert_non_null(strstr(err, "tokenizer.ggml.pre 'no-such-pre' is not supported"));
    free(out);
    free(err);
    snprintf(args, sizeof(args), "tokenize --model '%s' --tokenizer-pre gpt-2 abc", path);
    assert_int_equal(run_kvd(args, &out, &err), 0);
    assert_string_equal(out, "0 1 2\n");
    assert_non_null(strstr(err, "overridden"));
    free(out);
    free(err);
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
        cmocka_unit_test(test_mkmodel_deterministic),
        cmocka_unit_test(test_mkmodel_vocab),
        cmocka_unit_test(test_load_info),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_forward_matches_reference_f32),
        cmocka_unit_test(test_forward_matches_reference_types),
        cmocka_unit_test(test_forward_f16_kv),
        cmocka_unit_test(test_forward_thread_invariant),
        cmocka_unit_test(test_forward_errors),
        cmocka_unit_test(test_forward_lru_drop),
        cmocka_unit_test(test_forward_h2o_mass),
        cmocka_unit_test(test_mkmodel_healthy),
        cmocka_unit_test(test_evict_one_layer_equals_fresh),
        cmocka_unit_test(test_evict_multilayer_equals_rerotating_reference),
        cmocka_unit_test(test_stories_matches_reference),
        cmocka_unit_test(test_stories_greedy),
        cmocka_unit_test(test_stories_ctx128_identical),
        cmocka_unit_test(test_evict_stories_drift),
        cmocka_unit_test(test_cli),
        cmocka_unit_test(test_vocab_only),
    };
    return cmocka_run_group_tests_name("model", tests, group_setup, group_teardown);
}
