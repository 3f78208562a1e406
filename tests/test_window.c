/*
 * test_window.c - the per-layer budget of sliding-window layers
 * (cache/window.c): the windowed layers' own pages, dropped once no query
 * can see them.
 *
 * The test of the whole design is equivalence: a cache with the windowed
 * class and a cache that keeps every layer for every token (the same
 * shape with layer_window = NULL) give the same logits, step after step,
 * through evictions under every policy and both position modes - while
 * the windowed one holds fewer pages. Beside it: kv_cache_check after
 * every step (every local page held once, every visible token with its
 * slot at its main position), the pages a sequence holds never above
 * kv_cache_sequence_pages, the edges (a window smaller than a page, one
 * larger than the whole context, every layer windowed), the refusals
 * (a truncation or a policy that would need a dropped token) and the
 * memory of real shapes at 32k tokens.
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
    return tmp_dir_create("window");
}

static int group_teardown(void **state)
{
    (void)state;
    return tmp_dir_remove();
}

/* A pool of `pages` pages for model m, windowed or dense (layer_window NULL). */
static kv_cache *cache_for(const model *m, bool windowed, int page_tokens, int pages)
{
    struct kv_cache_params cp = {.page_tokens = page_tokens, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(m, &cp);
    if (!windowed)
        cp.layer_window = NULL;
    cp.memory_bytes = kv_cache_memory_for(&cp, pages);
    char err[256];
    kv_cache *c = kv_cache_create(&cp, err, sizeof(err));
    if (!c)
        print_message("kv_cache_create: %s\n", err);
    assert_non_null(c);
    return c;
}

static void check_cache(const kv_cache *c)
{
    char err[256];
    int rc = kv_cache_check(c, err, sizeof(err));
    if (rc)
        print_message("kv_cache_check: %s\n", err);
    assert_int_equal(rc, 0);
}

struct shape {
    const char *name;
    const char *arch;
    int layers, window;
};

static const struct shape shapes[] = {
    {"gemma3 6 layers, W 6", "gemma3", 6, 6},       /* 5 local : 1 global: 5 groups */
    {"gemma2 4 layers, W 5", "gemma2", 4, 5},       /* alternating: 1 group */
    {"mistral 3 layers, W 7", "llama", 3, 7},       /* every layer windowed */
    {"gemma3 W 3 < page 4", "gemma3", 6, 3},        /* a window smaller than a page */
    {"mistral W 1000 > context", "llama", 2, 1000}, /* nothing ever leaves */
};

static struct model_mk_params shape_params(const struct shape *s)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = s->arch;
    p.n_embd = 64;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_layer = s->layers;
    p.n_ff = 96;
    p.n_vocab = 300;
    p.seed = 7;
    p.sliding_window = s->window;
    if (strncmp(s->arch, "gemma", 5) == 0)
        p.head_dim = 16;
    return p;
}

struct pcase {
    const char *name;
    struct kv_policy pol;
    bool exact; /* the policy lets out-of-window pages go (window.c's rule) */
};

static const struct pcase policies[] = {
    {"none", {.kind = KV_EVICT_NONE, .max_cache_tokens = 160, .renumber = true}, true},
    {"sink-window renumber",
     {.kind = KV_EVICT_SINK_WINDOW,
      .max_cache_tokens = 48,
      .sink_tokens = 4,
      .window_tokens = 36,
      .renumber = true},
     true},
    {"sink-window preserve",
     {.kind = KV_EVICT_SINK_WINDOW,
      .max_cache_tokens = 48,
      .sink_tokens = 4,
      .window_tokens = 36,
      .renumber = false},
     true},
    {"sink-window renumber, window 4 < W (sinks kept)",
     {.kind = KV_EVICT_SINK_WINDOW,
      .max_cache_tokens = 12,
      .sink_tokens = 4,
      .window_tokens = 4,
      .renumber = true},
     false},
    {"h2o renumber (all kept)",
     {.kind = KV_EVICT_H2O,
      .max_cache_tokens = 40,
      .sink_tokens = 2,
      .window_tokens = 12,
      .heavy_tokens = 8,
      .renumber = true},
     false},
    {"h2o preserve",
     {.kind = KV_EVICT_H2O,
      .max_cache_tokens = 40,
      .sink_tokens = 2,
      .window_tokens = 12,
      .heavy_tokens = 8,
      .renumber = false},
     true},
};

/* Pool pages the sequences hold (both classes). */
static int held(const kv_cache *c)
{
    struct kv_stats st;
    kv_cache_stats(c, &st);
    return st.pages_used;
}

/* ... and their bytes (a windowed cache's pages are smaller). */
static long held_bytes(const kv_cache *c)
{
    return (long)held(c) * (long)kv_cache_page_bytes(c);
}

/* A model run side by side over a windowed cache and a dense one (the same
 * shape with layer_window NULL), f32 K/V: the worst logit difference so
 * far. */
struct pair {
    model *m;
    model_ctx *ctx;
    kv_cache *cw, *cd;
    float *lw, *ld;
    float worst;
};

static void pair_open(struct pair *p, const char *path, int page_tokens, int pages, int batch)
{
    p->m = load_model(path);
    p->cw = cache_for(p->m, true, page_tokens, pages);
    p->cd = cache_for(p->m, false, page_tokens, pages);
    p->ctx = make_ctx(p->m, batch, 1);
    p->lw = malloc(sizeof(float) * (size_t)p->m->n_vocab);
    p->ld = malloc(sizeof(float) * (size_t)p->m->n_vocab);
    p->worst = 0.0f;
}

/* Feed tok[0..n) to the windowed sequence sw and its dense twin sd; the
 * difference joins worst, and the windowed cache is checked. */
static void pair_step(struct pair *p, kv_seq *sw, kv_seq *sd, const int32_t *tok, int n)
{
    struct model_batch_seq bw = {.seq = sw, .tokens = tok, .n_tokens = n, .logits = p->lw};
    struct model_batch_seq bd = {.seq = sd, .tokens = tok, .n_tokens = n, .logits = p->ld};
    assert_int_equal(model_reserve_forward(p->ctx, &bw, 1, NULL), 0);
    assert_int_equal(model_reserve_forward(p->ctx, &bd, 1, NULL), 0);
    float e = rel_diff(p->lw, p->ld, p->m->n_vocab);
    p->worst = e > p->worst ? e : p->worst;
    check_cache(p->cw);
}

static void pair_close(struct pair *p)
{
    free(p->lw);
    free(p->ld);
    model_ctx_destroy(p->ctx);
    kv_cache_destroy(p->cw);
    kv_cache_destroy(p->cd);
    model_free(p->m);
}

/*
 * One shape under one policy: a 10-token prompt then 140 decode steps in
 * the windowed and the dense cache side by side. Returns the worst
 * relative logit difference; *saved the bytes the dense cache holds at
 * the end beyond the windowed one, *dropped the pool pages of local pages
 * dropped.
 */
static float windowed_vs_dense(const char *path, const struct kv_policy *pol, long *saved,
                               uint64_t *dropped)
{
    const int pt = 4, steps = 140, n0 = 10;
    struct pair p;
    pair_open(&p, path, pt, 400, n0);
    kv_seq *sw = make_seq(p.cw, pol), *sd = make_seq(p.cd, pol);
    int32_t toks[200];
    fill_tokens(toks, n0 + steps, p.m->n_vocab, 11);
    struct kv_cache_params cp = {.page_tokens = pt, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(p.m, &cp);
    int64_t bound = kv_cache_sequence_pages(&cp, pol, n0);
    for (int at = 0; at < n0 + steps;) {
        int n = at == 0 ? n0 : 1;
        pair_step(&p, sw, sd, toks + at, n);
        at += n;
        assert_true(held(p.cw) <= bound);
        assert_true(kv_seq_n_tokens(sw) == kv_seq_n_tokens(sd));
    }
    *saved = held_bytes(p.cd) - held_bytes(p.cw);
    struct kv_stats st;
    kv_cache_stats(p.cw, &st);
    *dropped = st.window_pages_dropped;
    kv_seq_destroy(sw);
    kv_seq_destroy(sd);
    float worst = p.worst;
    pair_close(&p);
    return worst;
}

static void test_windowed_equals_dense(void **state)
{
    (void)state;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        struct model_mk_params p = shape_params(&shapes[s]);
        char path[512];
        write_model(&p, "w.gguf", path, sizeof(path));
        for (size_t k = 0; k < sizeof(policies) / sizeof(policies[0]); k++) {
            long saved;
            uint64_t dropped;
            float e = windowed_vs_dense(path, &policies[k].pol, &saved, &dropped);
            print_message("  %-26s %-46s max rel diff %.1e, %6ld bytes saved, %3llu pages "
                          "dropped\n",
                          shapes[s].name, policies[k].name, e, saved, (unsigned long long)dropped);
            assert_true(e < 1e-5f);
            bool big = shapes[s].window >= 1000;
            if (policies[k].exact && !big) {
                assert_true(dropped > 0);
                assert_true(saved > 0);
            }
            if (big) /* only what the policy evicted left: nothing beyond the dense cache */
                assert_true(saved <= 0 && (policies[k].pol.kind != KV_EVICT_NONE || !dropped));
        }
    }
}

/*
 * kv_seq_fork of a windowed sequence: the child takes the parent's local
 * pages by reference and copies the one it writes. Parent and child then
 * decode different tokens, interleaved, each beside its dense twin (the
 * same fork in a cache keeping every layer): logits equal step after step
 * means neither one's writes reached the other's pages. Returns the worst
 * difference; the shared pages are asserted.
 */
static float fork_vs_dense(const char *path, const struct kv_policy *pol)
{
    const int pt = 4, n0 = 10, before = 29, after = 60; /* a partly full page at the fork */
    struct pair p;
    pair_open(&p, path, pt, 600, n0);
    kv_seq *pw = make_seq(p.cw, pol), *pd = make_seq(p.cd, pol);
    int32_t a[200], b[200];
    fill_tokens(a, n0 + before + after, p.m->n_vocab, 21);
    fill_tokens(b, after, p.m->n_vocab, 22);
    pair_step(&p, pw, pd, a, n0);
    for (int i = n0; i < n0 + before; i++)
        pair_step(&p, pw, pd, a + i, 1);
    char err[256];
    kv_seq *fw = kv_seq_fork(pw, false, err, sizeof(err)), *fd = kv_seq_fork(pd, false, err, 256);
    assert_non_null(fw);
    assert_non_null(fd);
    check_cache(p.cw);
    struct kv_stats st;
    kv_cache_stats(p.cw, &st);
    assert_true(st.pages_shared > 0);
    for (int i = 0; i < after; i++) {
        pair_step(&p, fw, fd, b + i, 1);               /* the child */
        pair_step(&p, pw, pd, a + n0 + before + i, 1); /* the parent */
    }
    kv_seq_destroy(fw);
    kv_seq_destroy(fd);
    check_cache(p.cw);
    kv_cache_stats(p.cw, &st);
    assert_int_equal(st.pages_shared, 0);
    kv_seq_destroy(pw);
    kv_seq_destroy(pd);
    kv_cache_stats(p.cw, &st);
    assert_int_equal(st.pages_used, 0);
    float worst = p.worst;
    pair_close(&p);
    return worst;
}

static void test_fork_equals_dense(void **state)
{
    (void)state;
    static const int pick[] = {0, 2, 3}; /* 5:1 groups, every layer windowed, W < page */
    for (size_t s = 0; s < sizeof(pick) / sizeof(pick[0]); s++) {
        const struct shape *sh = &shapes[pick[s]];
        struct model_mk_params p = shape_params(sh);
        char path[512];
        write_model(&p, "f.gguf", path, sizeof(path));
        for (size_t k = 0; k < sizeof(policies) / sizeof(policies[0]); k++) {
            float e = fork_vs_dense(path, &policies[k].pol);
            print_message("  fork: %-26s %-46s max rel diff %.1e\n", sh->name, policies[k].name, e);
            assert_true(e < 1e-5f);
        }
    }
}

/*
 * What the windowed class does not share: a cached prefix's pages hold
 * only the full-attention layers, so kv_seq_attach and the prefix index
 * refuse a windowed cache by name; a session state put back with
 * kv_seq_import gives the windowed slots its positions (kv_cache_check
 * compares them with the main table's).
 */
static void test_attach_refused_import_synced(void **state)
{
    (void)state;
    struct shape sh = {"gemma3", "gemma3", 6, 6};
    struct model_mk_params p = shape_params(&sh);
    char path[512];
    write_model(&p, "a.gguf", path, sizeof(path));
    model *m = load_model(path);
    kv_cache *c = cache_for(m, true, 4, 100);
    struct kv_policy pol = {.kind = KV_EVICT_NONE, .max_cache_tokens = 64, .renumber = false};
    kv_seq *a = make_seq(c, &pol), *b = make_seq(c, &pol);
    int32_t toks[8];
    fill_tokens(toks, 8, m->n_vocab, 5);
    assert_int_equal(kv_seq_append(a, toks, 8, NULL), 0);
    const int32_t *pages = kv_seq_page_table(a);
    assert_int_equal(kv_seq_attach(b, pages, 2, toks), -EOPNOTSUPP);
    assert_int_equal(kv_seq_n_tokens(b), 0);
    char err[256];
    assert_null(kv_prefix_create(c, 1, 10, err, sizeof(err)));
    assert_non_null(strstr(err, "sliding-window"));
    /* a session's state with positions 10, 12, 14, ... */
    char serr[256];
    kv_seq *s = kv_seq_create(c, &pol, true, serr, sizeof(serr));
    assert_non_null(s);
    int32_t pos[8], hidx[8], hist[20];
    float mass[8] = {0};
    fill_tokens(hist, 20, m->n_vocab, 6);
    for (int i = 0; i < 8; i++) {
        hidx[i] = 2 * i + 3;
        pos[i] = 10 + 2 * i;
        toks[i] = hist[hidx[i]];
    }
    struct kv_seq_state st = {.n_hist = 20,
                              .hist = hist,
                              .n_tokens = 8,
                              .ids = toks,
                              .pos = pos,
                              .hidx = hidx,
                              .mass = mass,
                              .next_pos = 30};
    assert_int_equal(kv_seq_import(s, &st, serr, sizeof(serr)), 0);
    check_cache(c);
    kv_seq_destroy(s);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_cache_destroy(c);
    model_free(m);
}

/* A tiny deterministic generator for the random walk below. */
static uint32_t walk_next(uint32_t *st)
{
    *st = *st * 1664525u + 1013904223u;
    return *st >> 8;
}

/* One random step on the sequences of a walk: append, fork, destroy,
 * truncate or evict; a refused append or truncation leaves the pool and the
 * sequence as they were. */
static void walk_step(kv_cache *c, kv_seq **seqs, int n_seqs, uint32_t *st, int *forks,
                      int *short_pool)
{
    int i = (int)(walk_next(st) % (uint32_t)n_seqs), op = (int)(walk_next(st) % 10);
    const struct kv_policy *pol = &policies[walk_next(st) % 6].pol;
    struct kv_stats before, after;
    kv_cache_stats(c, &before);
    char err[256];
    if (!seqs[i]) {
        seqs[i] = kv_seq_create(c, pol, walk_next(st) % 2, err, sizeof(err));
        assert_non_null(seqs[i]);
        return;
    }
    kv_seq *s = seqs[i];
    int n_before = kv_seq_n_tokens(s);
    if (op < 6) {
        int32_t toks[24];
        int n = 1 + (int)(walk_next(st) % 24);
        fill_tokens(toks, n, 300, walk_next(st));
        kv_seq_touch(s, walk_next(st) % 1000);
        int rc = kv_seq_append(s, toks, n, NULL);
        kv_cache_stats(c, &after);
        if (rc) {
            assert_true(rc == -ENOMEM || rc == -ENOSPC);
            *short_pool += rc == -ENOMEM;
            assert_int_equal(after.pages_used, before.pages_used);
            assert_int_equal(kv_seq_n_tokens(s), n_before);
        }
    } else if (op == 6) {
        for (int j = 0; j < n_seqs; j++)
            if (!seqs[j]) {
                seqs[j] = kv_seq_fork(s, kv_seq_is_session(s), err, sizeof(err));
                assert_non_null(seqs[j]);
                (*forks)++;
                break;
            }
    } else if (op == 7) {
        kv_seq_destroy(s);
        seqs[i] = NULL;
    } else if (op == 8 && kv_seq_is_session(s)) {
        int n_hist = kv_seq_history(s, NULL);
        int to = n_hist > 0 ? (int)(walk_next(st) % (uint32_t)(n_hist + 1)) : 0;
        int rc = kv_seq_truncate(s, to);
        kv_cache_stats(c, &after);
        if (rc) {
            assert_int_equal(rc, -ESTALE);
            assert_int_equal(after.pages_used, before.pages_used);
            assert_int_equal(kv_seq_n_tokens(s), n_before);
        }
    } else {
        int rc = kv_seq_evict(s, (int)(walk_next(st) % 16));
        assert_true(rc >= 0 || rc == -ENOSPC || rc == -ENOMEM);
    }
}

/*
 * The pool's arithmetic over both page classes, on random walks: appends
 * of 1..24 tokens, forks, destroys, truncations and evictions of up to 8
 * sequences (half of them sessions the LRU may drop) under every policy
 * above, in pools small enough to run short. kv_cache_check after every
 * step (references, local pages, slots), and an append whose plan came up
 * short would trip kv_pool_alloc's assert. No model: the bytes are not
 * the point here, test_fork_equals_dense reads them.
 */
static void test_random_walk_accounting(void **state)
{
    (void)state;
    int32_t g3[6] = {6, 6, 6, 6, 6, 0}, all[3] = {7, 7, 7}, g2[4] = {5, 0, 5, 0};
    struct {
        int n_layer;
        const int32_t *win;
    } shapes_w[3] = {{6, g3}, {3, all}, {4, g2}};
    int forks = 0, short_pool = 0;
    for (int k = 0; k < 3; k++) {
        struct kv_cache_params cp = {.page_tokens = 4,
                                     .n_layer = shapes_w[k].n_layer,
                                     .n_kv_head = 1,
                                     .head_dim = 16,
                                     .k_type = KV_F16,
                                     .v_type = KV_F16,
                                     .layer_window = shapes_w[k].win};
        cp.memory_bytes = kv_cache_memory_for(&cp, 90);
        char err[256];
        kv_cache *c = kv_cache_create(&cp, err, sizeof(err));
        assert_non_null(c);
        kv_seq *seqs[8] = {0};
        uint32_t st = 1234u + (uint32_t)k;
        for (int step = 0; step < 3000; step++) {
            walk_step(c, seqs, 8, &st, &forks, &short_pool);
            check_cache(c);
        }
        for (int j = 0; j < 8; j++)
            kv_seq_destroy(seqs[j]);
        struct kv_stats fin;
        kv_cache_stats(c, &fin);
        assert_int_equal(fin.pages_used, 0);
        print_message("  walk %d: %llu sessions dropped, %llu window pages dropped\n", k,
                      (unsigned long long)fin.sessions_dropped,
                      (unsigned long long)fin.window_pages_dropped);
        kv_cache_destroy(c);
    }
    print_message("  %d forks, %d appends refused for pages\n", forks, short_pool);
    assert_true(forks > 0 && short_pool > 0);
}

/* A session cut back past what the windowed layers still hold is refused
 * (-ESTALE, nothing changed); a cut they can serve, and a cut to nothing,
 * work. A policy that could bring a dropped token back is refused. */
static void test_truncate_and_policy_refused(void **state)
{
    (void)state;
    struct shape sh = {"gemma3", "gemma3", 6, 6};
    struct model_mk_params p = shape_params(&sh);
    char path[512];
    write_model(&p, "t.gguf", path, sizeof(path));
    model *m = load_model(path);
    kv_cache *c = cache_for(m, true, 4, 200);
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = 400,
                            .sink_tokens = 4,
                            .window_tokens = 100,
                            .renumber = false};
    char err[256];
    kv_seq *s = kv_seq_create(c, &pol, true, err, sizeof(err));
    assert_non_null(s);
    model_ctx *ctx = make_ctx(m, 8, 1);
    int32_t toks[64];
    fill_tokens(toks, 64, m->n_vocab, 3);
    for (int at = 0; at < 64; at += 8) {
        struct model_batch_seq b = {.seq = s, .tokens = toks + at, .n_tokens = 8};
        assert_int_equal(model_reserve_forward(ctx, &b, 1, NULL), 0);
    }
    check_cache(c);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_true(st.window_pages_dropped > 0);
    int used = st.pages_used;
    /* back to 20 tokens: a query at 20 sees 15..19, long dropped */
    assert_int_equal(kv_seq_truncate(s, 20), -ESTALE);
    assert_int_equal(kv_seq_n_tokens(s), 64);
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_used, used);
    check_cache(c);
    /* back to 62: the window (57..61) is still there */
    assert_int_equal(kv_seq_truncate(s, 62), 0);
    check_cache(c);
    /* sinks dropped under preserve: renumber with a window below W could
     * bring them back; a window of W or more cannot */
    struct kv_policy back = pol;
    back.renumber = true;
    back.window_tokens = 2;
    back.max_cache_tokens = 12;
    assert_int_equal(kv_seq_set_policy(s, &back), -ESTALE);
    assert_int_equal(kv_seq_policy(s)->renumber, false);
    back.window_tokens = 100;
    back.max_cache_tokens = 400;
    assert_int_equal(kv_seq_set_policy(s, &back), 0);
    /* a turn table that pins dropped tokens before a turn is refused */
    struct kv_turn t = {.hist_start = 40, .n_tokens = 10, .n_messages = 2};
    assert_int_equal(kv_seq_set_turns(s, &t, 1, 0, err, sizeof(err)), -ESTALE);
    assert_non_null(strstr(err, "sliding-window"));
    assert_int_equal(kv_seq_truncate(s, 0), 0);
    assert_int_equal(kv_seq_n_tokens(s), 0);
    check_cache(c);
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_used, 0);
    model_ctx_destroy(ctx);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
    model_free(m);
}

/* A negative window is refused by name; layer slots follow the map. */
static void test_shape(void **state)
{
    (void)state;
    int32_t win[6] = {4, 4, 4, 4, 4, 0};
    struct kv_cache_params cp = {.memory_bytes = 1 << 20,
                                 .page_tokens = 4,
                                 .n_layer = 6,
                                 .n_kv_head = 2,
                                 .head_dim = 16,
                                 .k_type = KV_F16,
                                 .v_type = KV_F16,
                                 .layer_window = win};
    char err[256];
    kv_cache *c = kv_cache_create(&cp, err, sizeof(err));
    assert_non_null(c);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    assert_int_equal(l.page_layers, 1); /* one global layer: pages of one slot */
    assert_int_equal(kv_cache_layer_slot(c, 5), 0);
    assert_int_equal(kv_cache_window(c), 4);
    kv_cache_destroy(c);
    win[2] = -1;
    assert_null(kv_cache_create(&cp, err, sizeof(err)));
    assert_non_null(strstr(err, "layer 2 has a negative window"));
}

/*
 * The memory at 32k tokens of two published shapes, f16 K/V, 16-token
 * pages, policy none (every token kept by the full-attention layers),
 * appends of 512 tokens: the one formula kv_cache_sequence_pages.
 */
static double session_mib(int n_layer, const int32_t *win, int kv_heads, int head_dim,
                          int64_t *pages)
{
    struct kv_cache_params cp = {.page_tokens = 16,
                                 .n_layer = n_layer,
                                 .n_kv_head = kv_heads,
                                 .head_dim = head_dim,
                                 .k_type = KV_F16,
                                 .v_type = KV_F16,
                                 .layer_window = win};
    struct kv_policy pol = {.kind = KV_EVICT_NONE, .max_cache_tokens = 32768, .renumber = true};
    *pages = kv_cache_sequence_pages(&cp, &pol, 512);
    return (double)kv_cache_memory_for(&cp, *pages) / (1 << 20);
}

static void test_memory_at_32k(void **state)
{
    (void)state;
    int32_t g3[34], mi[32];
    for (int l = 0; l < 34; l++)
        g3[l] = l % 6 < 5 ? 1024 : 0; /* Gemma 3 4B: 5 local : 1 global, W 1024 */
    for (int l = 0; l < 32; l++)
        mi[l] = 4096; /* Mistral 7B v0.1: every layer, W 4096 */
    struct {
        const char *name;
        int layers, heads, dim;
        const int32_t *win;
    } rows[2] = {{"Gemma 3 4B (34 layers, 4 KV heads x 256, W 1024 on 29)", 34, 4, 256, g3},
                 {"Mistral 7B (32 layers, 8 KV heads x 128, W 4096 on all)", 32, 8, 128, mi}};
    for (int r = 0; r < 2; r++) {
        int64_t pw, pd;
        double w = session_mib(rows[r].layers, rows[r].win, rows[r].heads, rows[r].dim, &pw);
        double d = session_mib(rows[r].layers, NULL, rows[r].heads, rows[r].dim, &pd);
        print_message("  %s: one 32k session %.0f MiB dense, %.0f MiB windowed (%.1f%% saved)\n",
                      rows[r].name, d, w, 100.0 * (d - w) / d);
        assert_true(w < d * 0.3);
    }
}

/* Run `$KVD_BIN args`; its stderr (or stdout) into a file whose path goes
 * to out. Returns the exit status. */
static int run_kvd(const char *args, bool want_stdout, char *out, size_t cap)
{
    snprintf(out, cap, "%s/cli.txt", tmp_dir);
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "%s %s %s'%s' </dev/null", getenv("KVD_BIN"), args,
             want_stdout ? "2>/dev/null >" : ">/dev/null 2>", out);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

/*
 * End to end: kvd generate sizes its pool by the windowed budget (one
 * sequence, kv_cache_sequence_pages), so a run far longer than the window
 * completes only if the accounting and the drops agree; kvd check-config
 * prints one session both ways.
 */
static void test_commands(void **state)
{
    (void)state;
    if (!getenv("KVD_BIN") || !*getenv("KVD_BIN")) {
        print_message("skipping: KVD_BIN not set (make test sets it)\n");
        skip();
        return;
    }
    struct shape sh = {"gemma3", "gemma3", 6, 16};
    struct model_mk_params p = shape_params(&sh);
    p.n_ctx_train = 4096;
    char path[512], out[600], args[2400];
    write_model(&p, "cmd.gguf", path, sizeof(path));
    char prompt[1200];
    int n = 0;
    for (int i = 0; i < 100; i++)
        n += snprintf(prompt + n, sizeof(prompt) - (size_t)n, "w%d ", i);
    snprintf(args, sizeof(args),
             "generate --model %s --threads 1 --temp 0 --no-echo --ctx 1024 --batch 32 -n 300 "
             "--prompt '%s'",
             path, prompt);
    assert_int_equal(run_kvd(args, false, out, sizeof(out)), 0);
    assert_true(su_file_has(out, "decode:  300 tokens"));
    char conf[600];
    snprintf(conf, sizeof(conf), "%s/w.conf", tmp_dir);
    FILE *f = fopen(conf, "w");
    fprintf(f,
            "[model]\npath = %s\n[cache]\nmemory = 64MiB\n[eviction]\nmax_cache_tokens = "
            "4096\n[sessions]\ndir = %s\n",
            path, tmp_dir);
    fclose(f);
    snprintf(args, sizeof(args), "check-config %s", conf);
    assert_int_equal(run_kvd(args, true, out, sizeof(out)), 0);
    assert_true(su_file_has(out, "with the 5 sliding-window layers (of 6, window 16) keeping only "
                                 "their window"));
    assert_true(su_file_has(out, "prefix cache: off for this model (sliding-window layers"));
    assert_true(su_file_has(out, "[sessions] dir: this model's sessions are not saved"));
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shape),
        cmocka_unit_test(test_memory_at_32k),
        cmocka_unit_test(test_truncate_and_policy_refused),
        cmocka_unit_test(test_windowed_equals_dense),
        cmocka_unit_test(test_fork_equals_dense),
        cmocka_unit_test(test_attach_refused_import_synced),
        cmocka_unit_test(test_random_walk_accounting),
        cmocka_unit_test(test_commands),
    };
    return cmocka_run_group_tests_name("window", tests, group_setup, group_teardown);
}
