/*
 * test_cache.c - the KV cache room: pool, sequences, eviction policies,
 * sessions, and three of the five invariants of the paged cache:
 *
 *   1. no rewrite: retained tokens' K/V bytes never change under eviction;
 *   5. policy none refuses cleanly; undersized budgets are rejected;
 *   and the budget (kv_policy_budget), stated once, over a grid.
 *
 * The other invariants (2: randomized accounting against a model of every
 * sequence; 3: equivalence at the kernel; 4: bounded memory over a long
 * stream) are test_cache_invariants.c's. The tests are white-box where it
 * helps (cache_internal.h for the free list and to force corner states);
 * the shared helpers and the model are in tests/cache_model.h.
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
#include <unistd.h>

#include <cmocka.h>

#include "attention/attention.h"
#include "cache/cache_internal.h"
#include "cache/kv_cache.h"
#include "tests/cache_model.h"

/* ------------------------------------------------------------------------
 * Types, layout, pool
 * ------------------------------------------------------------------------ */

static void test_types(void **state)
{
    (void)state;
    enum kv_type t = KV_F32;
    assert_int_equal(kv_type_size(KV_F32), 4);
    assert_int_equal(kv_type_size(KV_F16), 2);
    assert_int_equal(kv_type_size(KV_BF16), 2);
    assert_int_equal(kv_type_size((enum kv_type)7), 0);
    assert_int_equal(kv_type_parse("bf16", &t), 0);
    assert_int_equal(t, KV_BF16);
    assert_int_equal(kv_type_parse("f16", &t), 0);
    assert_int_equal(t, KV_F16);
    assert_int_equal(kv_type_parse("f32", &t), 0);
    assert_int_equal(t, KV_F32);
    assert_int_equal(kv_type_parse("q5_0", &t), -EINVAL);
    assert_int_equal(kv_type_parse("", &t), -EINVAL);
    assert_int_equal(kv_type_parse(NULL, &t), -EINVAL);
    assert_int_equal(t, KV_F32);
    assert_string_equal(kv_type_name(KV_F16), "f16");
    assert_string_equal(kv_type_name((enum kv_type)9), "unknown");
    /* The model room copies the type into attn_kv: same numbering. */
    assert_int_equal((int)KV_F32, (int)ATTN_F32);
    assert_int_equal((int)KV_F16, (int)ATTN_F16);
    assert_int_equal((int)KV_BF16, (int)ATTN_BF16);
    assert_int_equal((int)KV_Q8_0, (int)ATTN_Q8_0);
    assert_int_equal((int)KV_Q4_0, (int)ATTN_Q4_0);
    /* row sizes agree with the kernel's */
    const enum kv_type all[] = {KV_F32, KV_F16, KV_BF16, KV_Q8_0, KV_Q4_0};
    for (int i = 0; i < 5; i++) {
        enum kv_type parsed;
        assert_int_equal(kv_type_parse(kv_type_name(all[i]), &parsed), 0);
        assert_int_equal(parsed, all[i]);
        for (int d = 1; d <= 256; d++)
            assert_int_equal(kv_type_row_bytes(all[i], d),
                             attn_row_bytes((enum attn_type)all[i], d));
    }
    assert_int_equal(kv_type_row_bytes(KV_Q8_0, 64), 68);
    assert_int_equal(kv_type_row_bytes(KV_Q4_0, 64), 36);
    assert_int_equal(kv_type_row_bytes(KV_Q4_0, 48), 0);
    struct kv_cache_params tp = {
        .n_layer = 30, .n_kv_head = 3, .head_dim = 64, .k_type = KV_Q8_0, .v_type = KV_Q4_0};
    assert_int_equal(kv_cache_token_bytes(&tp), 30 * 3 * (68 + 36));
    tp.k_type = tp.v_type = KV_F16;
    assert_int_equal(kv_cache_token_bytes(&tp), 30 * 3 * 2 * 128);
    tp.head_dim = 40;
    tp.v_type = KV_Q8_0;
    assert_int_equal(kv_cache_token_bytes(&tp), 0);
}

static void test_create_rejects(void **state)
{
    (void)state;
    char err[256];
    struct kv_cache_params p = {.memory_bytes = 1 << 20,
                                .page_tokens = 16,
                                .n_layer = 2,
                                .n_kv_head = 2,
                                .head_dim = 8,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    assert_null(kv_cache_create(NULL, err, sizeof(err)));
    struct kv_cache_params q = p;
    q.page_tokens = 0;
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "page_tokens"));
    q = p;
    q.head_dim = 0;
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "head_dim"));
    q = p;
    q.v_type = (enum kv_type)7;
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "type"));
    q = p;
    q.k_type = KV_Q8_0; /* head_dim 8 is no multiple of a 32-element block */
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "K type q8_0"));
    assert_non_null(strstr(err, "head_dim 8"));
    q = p;
    q.v_type = KV_Q4_0;
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "V type q4_0"));
    q = p;
    q.memory_bytes = 1000; /* a page is 2*2*2*16*8*2 = 2048 bytes */
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "holds no page"));
    q = p;
    q.n_layer = 1 << 30;
    q.n_kv_head = 1 << 30;
    assert_null(kv_cache_create(&q, err, sizeof(err)));
    assert_non_null(strstr(err, "overflow"));

    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    assert_non_null(c);
    assert_string_equal(err, "");
    assert_int_equal(kv_cache_page_bytes(c), 2048);
    assert_int_equal(kv_cache_n_pages(c), (1 << 20) / 2048);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_total, 512);
    assert_int_equal(st.pages_free, 512);
    assert_int_equal(st.pages_used, 0);
    assert_int_equal(st.sequences, 0);
    kv_cache_destroy(c);
    kv_cache_destroy(NULL);
}

/* Every (slot, layer, head, K/V) row lies inside its page, rows never
 * overlap, and the accessor agrees with the layout struct attn_kv states. */
static void test_layout(void **state)
{
    (void)state;
    const int pt = 5, n_layer = 3, n_kv_head = 2, head_dim = 3;
    kv_cache *c = make_cache(1 << 16, pt, n_layer, n_kv_head, head_dim, KV_F16);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    size_t pb = kv_cache_page_bytes(c);
    assert_int_equal(pb % 64, 0);
    assert_true(pb >= (size_t)2 * n_layer * n_kv_head * pt * head_dim * 2);
    assert_int_equal(l.k_row_bytes, head_dim * 2);
    assert_int_equal(l.v_row_bytes, head_dim * 2);
    assert_ptr_equal(l.base, kv_cache_base(c));
    assert_int_equal(kv_cache_page_tokens(c), pt);

    uint8_t *cover = calloc(pb, 1);
    for (int layer = 0; layer < n_layer; layer++) {
        /* What the kernel computes from struct attn_kv for this layer. */
        struct attn_kv akv = {.base = kv_cache_base(c),
                              .page_bytes = pb,
                              .k_offset = kv_cache_k_offset(c, layer),
                              .v_offset = kv_cache_v_offset(c, layer),
                              .page_tokens = kv_cache_page_tokens(c),
                              .k_type = (enum attn_type)l.k_type,
                              .v_type = (enum attn_type)l.v_type};
        for (int h = 0; h < n_kv_head; h++)
            for (int s = 0; s < pt; s++)
                for (int v = 0; v < 2; v++) {
                    for (int page = 0; page < 3; page++) {
                        const uint8_t *want =
                            akv.base + (size_t)page * akv.page_bytes +
                            (v ? akv.v_offset : akv.k_offset) +
                            ((size_t)h * (size_t)pt + (size_t)s) * (size_t)head_dim * 2;
                        assert_ptr_equal(kv_layout_elem(&l, page, s, layer, h, v), want);
                    }
                    size_t off =
                        (size_t)((uint8_t *)kv_layout_elem(&l, 0, s, layer, h, v) - l.base);
                    for (size_t b = 0; b < row_len(&l, v); b++) {
                        assert_true(off + b < pb);
                        assert_int_equal(cover[off + b], 0);
                        cover[off + b] = 1;
                    }
                }
    }
    free(cover);
    kv_cache_destroy(c);
}

static void test_pool_lifo_and_check(void **state)
{
    (void)state;
    kv_cache *c = make_cache(8 * 2048, 4, 1, 1, 64, KV_F32); /* 2048-byte pages: 8 */
    assert_int_equal(kv_cache_n_pages(c), 8);
    kv_seq *a = make_seq(c, none_policy(64), false);
    kv_seq *b = make_seq(c, none_policy(64), false);
    int32_t ids[12] = {0};
    assert_int_equal(kv_seq_append(a, ids, 12, NULL), 0);
    assert_int_equal(kv_seq_n_pages(a), 3);
    const int32_t *pt_a = kv_seq_page_table(a);
    assert_int_equal(pt_a[0], 0); /* a fresh pool hands out 0, 1, 2, ... */
    assert_int_equal(pt_a[1], 1);
    assert_int_equal(pt_a[2], 2);
    int32_t last = pt_a[2];
    assert_int_equal(kv_seq_truncate(a, 8), 0); /* frees the third page */
    assert_int_equal(kv_seq_append(b, ids, 1, NULL), 0);
    assert_int_equal(kv_seq_page_table(b)[0], last); /* LIFO: reused first */
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_used, 3);
    assert_int_equal(st.pages_free, 5);
    assert_int_equal(st.sequences, 2);
    assert_cache_ok(c);

    /* The checker catches a page owned twice and a leaked page. */
    char err[256];
    int32_t saved = b->ptab[b->p_off];
    b->ptab[b->p_off] = a->ptab[a->p_off];
    assert_int_equal(kv_cache_check(c, err, sizeof(err)), -EFAULT);
    assert_non_null(strstr(err, "page 0 "));
    b->ptab[b->p_off] = saved;
    c->n_free--;
    assert_int_equal(kv_cache_check(c, err, sizeof(err)), -EFAULT);
    c->n_free++;
    assert_cache_ok(c);

    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_free, 8);
    assert_int_equal(st.sequences, 0);
    kv_cache_destroy(c);
}

static void test_mlock_optional(void **state)
{
    (void)state;
    struct kv_cache_params p = {.memory_bytes = 64 * 1024,
                                .page_tokens = 16,
                                .n_layer = 1,
                                .n_kv_head = 1,
                                .head_dim = 16,
                                .k_type = KV_F32,
                                .v_type = KV_F32,
                                .mlock = true};
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    assert_non_null(c); /* a failed mlock is a warning, never fatal */
    if (kv_cache_mlocked(c))
        assert_string_equal(err, "");
    else
        assert_non_null(strstr(err, "mlock"));
    kv_seq *s = make_seq(c, none_policy(32), false);
    int32_t ids[3] = {1, 2, 3};
    assert_int_equal(kv_seq_append(s, ids, 3, NULL), 0);
    kv_cache_destroy(c); /* also destroys s */
}

/* The pool starts on a 2 MiB boundary, advised as huge pages wherever the
 * kernel has transparent huge pages (the advice is then accepted, whatever
 * the enabled mode); every byte of it stays writable. */
static void test_pool_huge_pages(void **state)
{
    (void)state;
    struct kv_cache_params p = {.memory_bytes = 5u << 20,
                                .page_tokens = 16,
                                .n_layer = 3,
                                .n_kv_head = 3,
                                .head_dim = 64,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    assert_non_null(c);
    assert_int_equal((uintptr_t)kv_cache_base(c) % ((uintptr_t)2 << 20), 0);
    bool thp = access("/sys/kernel/mm/transparent_hugepage/enabled", F_OK) == 0;
    if (thp)
        assert_true(kv_cache_huge_pages(c));
    size_t bytes = (size_t)kv_cache_n_pages(c) * kv_cache_page_bytes(c);
    memset(kv_cache_base(c), 0x5a, bytes);
    assert_int_equal(kv_cache_base(c)[bytes - 1], 0x5a);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------
 * Policies
 * ------------------------------------------------------------------------ */

static void test_policy_check(void **state)
{
    (void)state;
    char err[512];
    enum kv_policy_kind k = KV_EVICT_NONE;
    assert_int_equal(kv_policy_parse_kind("sink-window", &k), 0);
    assert_int_equal(k, KV_EVICT_SINK_WINDOW);
    assert_int_equal(kv_policy_parse_kind("h2o", &k), 0);
    assert_int_equal(k, KV_EVICT_H2O);
    assert_int_equal(kv_policy_parse_kind("none", &k), 0);
    assert_int_equal(k, KV_EVICT_NONE);
    assert_int_equal(kv_policy_parse_kind("lru", &k), -EINVAL);
    assert_int_equal(kv_policy_parse_kind(NULL, &k), -EINVAL);
    assert_string_equal(kv_policy_kind_name(KV_EVICT_SINK_WINDOW), "sink-window");
    assert_string_equal(kv_policy_kind_name((enum kv_policy_kind)42), "unknown");

    /* Invariant 5: a budget smaller than sinks + one page is rejected. 20
     * sinks in 16-token pages round up to 32 tokens; + one page = 48. */
    struct kv_policy p = sink_window(40, 20, 0, true);
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "max_cache_tokens 40"));
    assert_non_null(strstr(err, "sinks"));
    assert_non_null(strstr(err, "need at least 48"));
    p.max_cache_tokens = 47;
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    p.max_cache_tokens = 48;
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), 0);
    /* The window counts too: 32 + 100 + 16. */
    p = sink_window(147, 20, 100, true);
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "need at least 148"));
    p.max_cache_tokens = 148;
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), 0);

    p = h2o(4 + 8 + 8 + 16 - 1, 4, 8, 8, true);
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "heavy_tokens"));
    p.max_cache_tokens++;
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), 0);

    p = none_policy(0);
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "max_cache_tokens"));
    p = sink_window(100, -1, 4, true);
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    p = none_policy(10);
    p.kind = (enum kv_policy_kind)9;
    assert_int_equal(kv_policy_check(&p, 16, err, sizeof(err)), -EINVAL);
    assert_int_equal(kv_policy_check(NULL, 16, err, sizeof(err)), -EINVAL);

    /* Sequences refuse a bad policy with the same reason. */
    kv_cache *c = make_cache(1 << 16, 16, 1, 1, 8, KV_F32);
    p = sink_window(40, 20, 0, true);
    assert_null(kv_seq_create(c, &p, false, err, sizeof(err)));
    assert_non_null(strstr(err, "need at least 48"));
    kv_seq *s = make_seq(c, sink_window(48, 20, 0, true), false);
    assert_int_equal(kv_seq_set_policy(s, &p), -EINVAL);
    assert_int_equal(kv_seq_policy(s)->max_cache_tokens, 48);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------
 * Sequences
 * ------------------------------------------------------------------------ */

/*
 * The budget, stated once by kv_policy_budget, over a grid: its terms are
 * the formulas of kv_cache.h, kv_policy_check accepts exactly the budgets
 * of at least need_tokens, and the window in effect for window_tokens = 0
 * is the largest explicit window the check accepts.
 */
static void test_policy_budget(void **state)
{
    (void)state;
    static const enum kv_policy_kind kinds[] = {KV_EVICT_NONE, KV_EVICT_SINK_WINDOW, KV_EVICT_H2O};
    static const int pages[] = {1, 3, 16};
    static const int sinks[] = {0, 1, 4, 16, 17};
    static const int windows[] = {0, 1, 16, 40};
    static const int heavies[] = {0, 5};
    static const int maxes[] = {1, 16, 33, 64, 100};
#define N_OF(a) (int)(sizeof(a) / sizeof((a)[0]))
    char err[256];
    for (int a = 0; a < N_OF(kinds); a++)
        for (int g = 0; g < N_OF(pages); g++)
            for (int si = 0; si < N_OF(sinks); si++)
                for (int w = 0; w < N_OF(windows); w++)
                    for (int h = 0; h < N_OF(heavies); h++)
                        for (int m = 0; m < N_OF(maxes); m++) {
                            int page = pages[g], max = maxes[m], sink = sinks[si];
                            struct kv_policy p = {.kind = kinds[a],
                                                  .max_cache_tokens = max,
                                                  .sink_tokens = sink,
                                                  .window_tokens = windows[w],
                                                  .heavy_tokens = heavies[h]};
                            struct kv_budget b;
                            kv_policy_budget(&p, page, &b);
                            assert_int_equal(b.sequence_pages, (max + page - 1) / page + 1);
                            bool ok = kv_policy_check(&p, page, err, sizeof(err)) == 0;
                            if (kinds[a] == KV_EVICT_NONE) {
                                assert_int_equal(b.need_tokens, 1);
                                assert_true(ok);
                                continue;
                            }
                            int64_t kept = kinds[a] == KV_EVICT_H2O
                                               ? sink + heavies[h]
                                               : (sink + page - 1) / page * page;
                            assert_int_equal(b.kept_tokens, kept);
                            assert_int_equal(b.floor_tokens, kept + page);
                            assert_int_equal(b.window_room, max - kept - page);
                            assert_int_equal(b.need_tokens, kept + page + windows[w]);
                            assert_int_equal(ok, max >= b.need_tokens);
                            if (windows[w] > 0) {
                                assert_int_equal(b.window_tokens, windows[w]);
                                continue;
                            }
                            /* automatic: the largest window accepted */
                            int64_t room = max - kept - page;
                            assert_int_equal(b.window_tokens, room > 0 ? room : 0);
                            if (room < 1)
                                continue;
                            p.window_tokens = (int)room;
                            assert_int_equal(kv_policy_check(&p, page, err, sizeof(err)), 0);
                            p.window_tokens = (int)room + 1;
                            assert_int_equal(kv_policy_check(&p, page, err, sizeof(err)), -EINVAL);
                        }
#undef N_OF
}

/* kv_cache_memory_for: exactly the bytes of n pages of the shape. */
static void test_memory_for(void **state)
{
    (void)state;
    struct kv_cache_params p = {.page_tokens = 16,
                                .n_layer = 2,
                                .n_kv_head = 3,
                                .head_dim = 32,
                                .k_type = KV_Q8_0,
                                .v_type = KV_F16};
    char err[256];
    for (int n = 1; n <= 9; n += 4) {
        p.memory_bytes = kv_cache_memory_for(&p, n);
        assert_true(p.memory_bytes > 0);
        kv_cache *c = kv_cache_create(&p, err, sizeof(err));
        assert_non_null(c);
        assert_int_equal(kv_cache_n_pages(c), n);
        assert_int_equal(p.memory_bytes, (size_t)n * kv_cache_page_bytes(c));
        kv_cache_destroy(c);
        p.memory_bytes -= 1; /* one byte short: a page less */
        if (n > 1) {
            c = kv_cache_create(&p, err, sizeof(err));
            assert_non_null(c);
            assert_int_equal(kv_cache_n_pages(c), n - 1);
            kv_cache_destroy(c);
        }
    }
    assert_int_equal(kv_cache_memory_for(&p, 0), 0);
    p.head_dim = 20; /* q8_0 needs a multiple of 32 */
    assert_int_equal(kv_cache_memory_for(&p, 4), 0);
    p.head_dim = 32;
    assert_int_equal(kv_cache_memory_for(&p, INT64_MAX / 2), 0);
}

/*
 * kv_reserve: one step's slots for a batch, all or nothing. A full context
 * is found before anything changes; a pool shortage takes back what the
 * earlier sequences of the batch reserved; undo takes back a success.
 */
static void test_reserve_all_or_nothing(void **state)
{
    (void)state;
    /* 4 pages of 4 tokens. */
    kv_cache *c = make_cache(4 * 4 * 2 * 1 * 1 * 8 * 4, 4, 1, 1, 8, KV_F32);
    assert_int_equal(kv_cache_n_pages(c), 4);
    struct kv_policy big = none_policy(64), small = none_policy(8);
    char err[256];
    kv_seq *a = kv_seq_create(c, &big, false, err, sizeof(err));
    kv_seq *b = kv_seq_create(c, &small, false, err, sizeof(err));
    assert_non_null(a);
    assert_non_null(b);
    int32_t t[16] = {0};
    for (int i = 0; i < 16; i++)
        t[i] = i;

    struct kv_reservation r[2] = {{.seq = a, .tokens = t, .n_tokens = 3},
                                  {.seq = b, .tokens = t, .n_tokens = 2}};
    assert_int_equal(kv_reserve(r, 2, NULL), 0);
    assert_int_equal(r[0].first, 0);
    assert_int_equal(r[1].first, 0);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(b), 2);

    /* b's context (8 under none) cannot take 7 more: refused first, a untouched. */
    int failed = -1;
    r[0].n_tokens = 1;
    r[1].n_tokens = 7;
    assert_int_equal(kv_reserve(r, 2, &failed), -ENOSPC);
    assert_int_equal(failed, 1);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(b), 2);

    /* The pool: a takes 9 more (3 pages in all), b then needs a 3rd page
     * that is not there: a's 9 are taken back. */
    r[0].n_tokens = 9;
    r[1].n_tokens = 3;
    failed = -1;
    assert_int_equal(kv_reserve(r, 2, &failed), -ENOMEM);
    assert_int_equal(failed, 1);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(b), 2);
    assert_int_equal(kv_cache_check(c, err, sizeof(err)), 0);

    /* Undo after a success (the forward pass failed). */
    r[0].n_tokens = 2;
    r[1].n_tokens = 1;
    assert_int_equal(kv_reserve(r, 2, NULL), 0);
    assert_int_equal(r[0].first, 3);
    assert_int_equal(r[1].first, 2);
    kv_reserve_undo(r, 2);
    assert_int_equal(kv_seq_n_tokens(a), 3);
    assert_int_equal(kv_seq_n_tokens(b), 2);
    assert_int_equal(kv_cache_check(c, err, sizeof(err)), 0);

    r[1].n_tokens = 0;
    assert_int_equal(kv_reserve(r, 2, &failed), -EINVAL);
    assert_int_equal(failed, 1);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_cache_destroy(c);
}

static void test_append_basic(void **state)
{
    (void)state;
    kv_cache *c = make_cache(64 * 1024, 4, 2, 2, 8, KV_F32); /* 1 KiB pages: 64 */
    struct kv_layout l;
    kv_cache_layout(c, &l);
    kv_seq *s = make_seq(c, none_policy(100), false);
    assert_ptr_equal(kv_seq_cache(s), c);
    assert_int_equal(kv_seq_n_tokens(s), 0);
    assert_int_equal(kv_seq_next_pos(s), 0);
    int first = -1;
    int32_t ids[10];
    for (int i = 0; i < 10; i++)
        ids[i] = 1000 + i;
    assert_int_equal(kv_seq_append(s, ids, 0, &first), 0);
    assert_int_equal(first, 0);
    assert_int_equal(kv_seq_append(s, ids, 7, &first), 0);
    assert_int_equal(first, 0);
    assert_int_equal(kv_seq_append(s, ids + 7, 3, &first), 0);
    assert_int_equal(first, 7);
    assert_int_equal(kv_seq_n_tokens(s), 10);
    assert_int_equal(kv_seq_n_pages(s), 3);
    assert_int_equal(kv_seq_next_pos(s), 10);
    for (int i = 0; i < 10; i++) {
        assert_int_equal(kv_seq_positions(s)[i], i);
        assert_int_equal(kv_seq_tokens(s)[i], 1000 + i);
        assert_int_equal(kv_seq_hist_index(s)[i], i);
        assert_float_equal(kv_seq_mass(s)[i], 0.0f, 0);
        fill_token(s, &l, i, (uint32_t)i);
    }
    /* Rows of different tokens are different memory and hold their bytes. */
    for (int i = 0; i < 10; i++)
        assert_true(token_intact(s, &l, i, (uint32_t)i));
    assert_ptr_not_equal(kv_seq_k(s, 0, 0, 3), kv_seq_k(s, 0, 0, 4));
    assert_ptr_not_equal(kv_seq_k(s, 1, 1, 3), kv_seq_v(s, 1, 1, 3));
    /* Token 5 sits in the second page, slot 1. */
    assert_ptr_equal(kv_seq_k(s, 1, 1, 5),
                     kv_layout_elem(&l, kv_seq_page_table(s)[1], 1, 1, 1, false));

    assert_int_equal(kv_seq_append(s, NULL, 1, NULL), -EINVAL);
    assert_int_equal(kv_seq_append(s, ids, -1, NULL), -EINVAL);
    assert_true(kv_seq_has_room(s, 90));
    assert_false(kv_seq_has_room(s, 91));
    assert_false(kv_seq_has_room(s, -1));
    assert_int_equal(kv_seq_max_append(s), 90);

    float mass[10];
    for (int i = 0; i < 10; i++)
        mass[i] = (float)i * 0.5f;
    kv_seq_add_mass(s, mass);
    kv_seq_add_mass(s, mass);
    assert_float_equal(kv_seq_mass(s)[9], 9.0f, 0);

    /* Positions and history indices overflow cleanly, not silently. */
    s->next_pos = INT32_MAX - 1;
    assert_int_equal(kv_seq_append(s, ids, 2, NULL), -EOVERFLOW);
    assert_int_equal(kv_seq_n_tokens(s), 10);
    assert_cache_ok(c);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/* Invariant 5, first half: policy none refuses at the limit, nothing changed. */
static void test_none_refuses(void **state)
{
    (void)state;
    kv_cache *c = make_cache(64 * 1024, 4, 2, 2, 8, KV_F32);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    kv_seq *s = make_seq(c, none_policy(10), false);
    int32_t ids[12] = {0};
    assert_int_equal(kv_seq_append(s, ids, 11, NULL), -ENOSPC);
    assert_int_equal(kv_seq_n_tokens(s), 0);
    assert_int_equal(kv_seq_append(s, ids, 10, NULL), 0);
    for (int i = 0; i < 10; i++)
        fill_token(s, &l, i, 77u + (uint32_t)i);
    int32_t table[3];
    memcpy(table, kv_seq_page_table(s), sizeof(table));
    struct kv_stats before, after;
    kv_cache_stats(c, &before);

    assert_false(kv_seq_has_room(s, 1));
    assert_int_equal(kv_seq_max_append(s), 0);
    assert_int_equal(kv_seq_append(s, ids, 1, NULL), -ENOSPC);
    assert_int_equal(kv_seq_evict(s, 1), -ENOSPC);
    assert_int_equal(kv_seq_evict(s, 0), 0);

    kv_cache_stats(c, &after);
    assert_int_equal(after.pages_used, before.pages_used);
    assert_int_equal(after.pages_free, before.pages_free);
    assert_int_equal(after.tokens_evicted, before.tokens_evicted);
    assert_int_equal(kv_seq_n_tokens(s), 10);
    assert_int_equal(kv_seq_next_pos(s), 10);
    assert_memory_equal(table, kv_seq_page_table(s), sizeof(table));
    for (int i = 0; i < 10; i++) {
        assert_int_equal(kv_seq_positions(s)[i], i);
        assert_true(token_intact(s, &l, i, 77u + (uint32_t)i));
    }
    assert_int_equal(after.evictions, 0);
    kv_cache_destroy(c);
}

/* sink-window: sinks round up to whole pages, whole middle pages leave,
 * oldest first, and at least window_tokens recent tokens survive. */
static void test_sink_window_pages(void **state)
{
    (void)state;
    const int pt = 16;
    kv_cache *c = make_cache(256 * 1024, pt, 1, 1, 4, KV_F16);
    /* sink 4 -> the first page (16 tokens) stays whole; min budget 16+20+16 = 52. */
    kv_seq *s = make_seq(c, sink_window(64, 4, 20, true), false);
    int32_t id;
    for (id = 0; id < 64; id++)
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 0);

    /* Token 64 does not fit: page 1 (tokens 16..31) goes. Page 2 (32..47)
     * may not: 48..63 plus 32..47 hold the 20-token window. */
    assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.tokens_evicted, 16);
    assert_int_equal(kv_seq_n_tokens(s), 49);
    assert_int_equal(kv_seq_n_pages(s), 4);
    const int32_t *ids = kv_seq_tokens(s), *pos = kv_seq_positions(s);
    for (int i = 0; i < 16; i++)
        assert_int_equal(ids[i], i);
    for (int i = 16; i < 49; i++)
        assert_int_equal(ids[i], i + 16);
    for (int i = 0; i < 49; i++)
        assert_int_equal(pos[i], i); /* renumbered */
    assert_int_equal(kv_seq_next_pos(s), 49);
    assert_int_equal(kv_seq_page_table(s)[0], 0); /* the sink page itself */

    /* Keep streaming: after every append the rule holds. */
    for (id = 65; id < 400; id++) {
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
        int n = kv_seq_n_tokens(s);
        ids = kv_seq_tokens(s);
        assert_true(n <= 64);
        for (int i = 0; i < 16; i++)
            assert_int_equal(ids[i], i);
        assert_true(n - 16 >= 20);   /* the window survives */
        for (int i = 16; i < n; i++) /* a contiguous tail */
            assert_int_equal(ids[i], id - (n - 1 - i));
        assert_int_equal((ids[16] - 16) % pt, 0); /* cut at a page boundary */
        assert_int_equal(kv_seq_positions(s)[n - 1], n - 1);
    }
    kv_cache_stats(c, &st);
    assert_int_equal(st.tokens_evicted, st.evictions * (uint64_t)pt);
    assert_int_equal(st.pages_used, kv_seq_n_pages(s));
    assert_cache_ok(c);

    /* No sinks at all: the plain sliding window in whole pages. */
    kv_seq *w = make_seq(c, sink_window(48, 0, 16, true), false);
    for (id = 0; id < 49; id++)
        assert_int_equal(kv_seq_append(w, &id, 1, NULL), 0);
    assert_int_equal(kv_seq_n_tokens(w), 33);
    assert_int_equal(kv_seq_tokens(w)[0], 16);
    kv_cache_destroy(c);
}

/* Fill s to n tokens, ids 0.. in order. */
static void fill_to(kv_seq *s, int n)
{
    static int32_t ids[1024];
    while (kv_seq_n_tokens(s) < n) {
        int m = n - kv_seq_n_tokens(s) < 1024 ? n - kv_seq_n_tokens(s) : 1024;
        for (int i = 0; i < m; i++)
            ids[i] = kv_seq_n_tokens(s) + i;
        assert_int_equal(kv_seq_append(s, ids, m, NULL), 0);
    }
}

/*
 * Multi-page steps: at a budget of 8192 tokens (16-token pages) the
 * sink-window step is 1/256 of it, 32 tokens: the automatic window leaves
 * them, and each eviction at the budget frees both pages at once, the
 * window intact, positions renumbered. An explicit window that leaves only
 * one page of slack keeps one-page steps. At 128k the step is 512 tokens.
 */
static void test_sink_window_step(void **state)
{
    (void)state;
    const int pt = 16;
    struct kv_budget b;
    struct kv_policy pol = sink_window(8192, 4, 0, true);
    kv_policy_budget(&pol, pt, &b);
    assert_int_equal(b.step_tokens, 32);
    assert_int_equal(b.window_tokens, 8192 - 16 - 32);
    assert_int_equal(b.window_room, 8192 - 16 - 16); /* the largest explicit window */
    pol.window_tokens = (int)b.window_tokens;
    kv_policy_budget(&pol, pt, &b);
    assert_int_equal(b.step_tokens, 32); /* resolved, the same step */

    kv_cache *c = make_cache(2u << 20, pt, 1, 1, 4, KV_F16);
    kv_seq *s = make_seq(c, pol, false);
    fill_to(s, 8192);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 0);
    int32_t id = 8192;
    for (int k = 1; k <= 40; k++, id++) {
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
        int n = kv_seq_n_tokens(s);
        const int32_t *ids = kv_seq_tokens(s);
        for (int i = 0; i < 16; i++)
            assert_int_equal(ids[i], i);
        assert_true(n - 16 >= pol.window_tokens); /* the window survives */
        for (int i = 16; i < n; i++)
            assert_int_equal(ids[i], id - (n - 1 - i));
        assert_int_equal(kv_seq_positions(s)[n - 1], n - 1);
    }
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 2); /* 40 tokens past the budget: two steps */
    assert_int_equal(st.tokens_evicted, 64);
    kv_seq_destroy(s);

    /* an explicit window with one page of slack: one page a step */
    pol = sink_window(8192, 4, 8192 - 16 - 16, true);
    kv_policy_budget(&pol, pt, &b);
    assert_int_equal(b.step_tokens, 16);
    s = make_seq(c, pol, false);
    fill_to(s, 8192);
    assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    kv_cache_stats(c, &st);
    assert_int_equal(st.tokens_evicted, 64 + 16);
    assert_int_equal(kv_seq_n_tokens(s), 8193 - 16);
    kv_seq_destroy(s);
    assert_cache_ok(c);
    kv_cache_destroy(c);

    pol = sink_window(131072, 4, 0, true);
    kv_policy_budget(&pol, pt, &b);
    assert_int_equal(b.step_tokens, 512);
    assert_int_equal(b.window_tokens, 131072 - 16 - 512);
}

/* positions = preserve keeps first positions; new tokens continue after. */
static void test_preserve_positions(void **state)
{
    (void)state;
    kv_cache *c = make_cache(256 * 1024, 4, 1, 1, 4, KV_F32);
    kv_seq *s = make_seq(c, sink_window(16, 2, 4, false), false);
    int32_t id;
    for (id = 0; id < 17; id++)
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    /* sinks 0..3 (a whole page), then page 4..7 went, 8..16 stay. */
    int n = kv_seq_n_tokens(s);
    assert_int_equal(n, 13);
    const int32_t want[13] = {0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16};
    for (int i = 0; i < n; i++) {
        assert_int_equal(kv_seq_positions(s)[i], want[i]);
        assert_int_equal(kv_seq_tokens(s)[i], want[i]);
    }
    assert_int_equal(kv_seq_next_pos(s), 17);

    /* Switching to renumber takes effect at the next eviction only. */
    struct kv_policy p = sink_window(16, 2, 4, true);
    assert_int_equal(kv_seq_set_policy(s, &p), 0);
    id = 17;
    assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    assert_int_equal(kv_seq_positions(s)[13], 17);
    for (id = 18; id < 21; id++) /* the last one evicts */
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    n = kv_seq_n_tokens(s);
    for (int i = 0; i < n; i++)
        assert_int_equal(kv_seq_positions(s)[i], i);
    assert_int_equal(kv_seq_tokens(s)[4], 12);
    assert_int_equal(kv_seq_next_pos(s), n);
    kv_cache_destroy(c);
}

/* Invariant 1 for both policies and both position modes: the K and V bytes
 * of every retained token are identical before and after every eviction. */
static void run_no_rewrite(struct kv_policy pol, enum kv_type k_type, enum kv_type v_type)
{
    /* head_dim 32: one block of q8_0 / q4_0; to the cache a row is only bytes,
     * the scale included, and every one of them must survive unchanged */
    kv_cache *c = make_cache2(1 << 20, 8, 3, 2, 32, k_type, v_type);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    kv_seq *s = make_seq(c, pol, false);
    uint64_t sums[4096]; /* by history index */
    uint32_t rng = 12345;
    struct kv_stats st;
    int checked = 0;
    for (int32_t id = 0; id < 3000; id++) {
        int n_before = kv_seq_n_tokens(s);
        /* Snapshot checksums of every retained token before the append. */
        uint64_t before[512];
        int32_t hid[512];
        assert_true(n_before <= 512);
        for (int i = 0; i < n_before; i++) {
            before[i] = token_checksum(s, &l, i);
            hid[i] = kv_seq_hist_index(s)[i];
        }
        int first;
        assert_int_equal(kv_seq_append(s, &id, 1, &first), 0);
        /* Random bytes for the new token (not a pattern of its index). */
        for (int layer = 0; layer < l.n_layer; layer++)
            for (int h = 0; h < l.n_kv_head; h++) {
                uint8_t *k = kv_seq_k(s, layer, h, first), *v = kv_seq_v(s, layer, h, first);
                for (size_t b = 0; b < l.k_row_bytes; b++)
                    k[b] = (uint8_t)rng_next(&rng);
                for (size_t b = 0; b < l.v_row_bytes; b++)
                    v[b] = (uint8_t)rng_next(&rng);
            }
        sums[id] = token_checksum(s, &l, first);
        if (kv_seq_n_tokens(s) != n_before + 1) {
            /* An eviction happened: every survivor matches its snapshot. */
            int n = kv_seq_n_tokens(s), j = 0;
            for (int i = 0; i < n - 1; i++) {
                int32_t h = kv_seq_hist_index(s)[i];
                while (j < n_before && hid[j] != h)
                    j++;
                assert_true(j < n_before);
                assert_true(token_checksum(s, &l, i) == before[j]);
                checked++;
            }
        }
        for (int i = 0; i < kv_seq_n_tokens(s); i++)
            assert_true(token_checksum(s, &l, i) == sums[kv_seq_hist_index(s)[i]]);
        if (pol.kind == KV_EVICT_H2O) { /* give the middle uneven mass */
            float mass[512];
            for (int i = 0; i < kv_seq_n_tokens(s); i++)
                mass[i] = (float)(rng_next(&rng) % 1000) / 1000.0f;
            kv_seq_add_mass(s, mass);
        }
    }
    kv_cache_stats(c, &st);
    assert_true(st.evictions > 50);
    assert_true(checked > 1000);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

static void test_no_rewrite_sink_window(void **state)
{
    (void)state;
    run_no_rewrite(sink_window(200, 5, 60, true), KV_F16, KV_F16);
    run_no_rewrite(sink_window(200, 5, 60, false), KV_F32, KV_F32);
    run_no_rewrite(sink_window(200, 5, 60, true), KV_BF16, KV_BF16);
    run_no_rewrite(sink_window(200, 5, 60, true), KV_Q8_0, KV_Q8_0);
    run_no_rewrite(sink_window(200, 5, 60, false), KV_Q8_0, KV_Q4_0);
    run_no_rewrite(sink_window(200, 5, 60, true), KV_Q4_0, KV_Q4_0);
}

static void test_no_rewrite_h2o(void **state)
{
    (void)state;
    run_no_rewrite(h2o(120, 4, 30, 40, true), KV_BF16, KV_BF16);
    run_no_rewrite(h2o(120, 4, 30, 40, false), KV_F32, KV_F32);
    run_no_rewrite(h2o(120, 4, 30, 40, true), KV_F16, KV_F16);
    run_no_rewrite(h2o(120, 4, 30, 40, true), KV_Q8_0, KV_Q8_0);
    run_no_rewrite(h2o(120, 4, 30, 40, false), KV_Q8_0, KV_Q4_0);
    run_no_rewrite(h2o(120, 4, 30, 40, true), KV_Q4_0, KV_Q4_0);
}

/* h2o keeps sinks, window and the heaviest middle tokens; ids, positions
 * and mass move with their bytes. */
static void test_h2o_selection(void **state)
{
    (void)state;
    kv_cache *c = make_cache(1 << 16, 4, 2, 1, 4, KV_F32);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    kv_seq *s = make_seq(c, h2o(11, 2, 3, 2, true), false); /* 2+3+2+4 = 11 */
    int32_t ids[11];
    for (int i = 0; i < 11; i++)
        ids[i] = 100 + i;
    assert_int_equal(kv_seq_append(s, ids, 11, NULL), 0);
    for (int i = 0; i < 11; i++)
        fill_token(s, &l, i, 500u + (uint32_t)i);
    /* Middle is 2..7. Heavy: 5 (0.9) and 3 (0.7); 6 ties 3 on the first
     * call but 3 gets more on the second. Sinks' and window's mass is large
     * or zero: it must not matter. */
    const float m1[11] = {9, 9, 0.1f, 0.5f, 0.2f, 0.9f, 0.5f, 0.3f, 0, 0, 0};
    const float m2[11] = {0, 0, 0, 0.2f, 0, 0, 0, 0, 5, 5, 5};
    kv_seq_add_mass(s, m1);
    kv_seq_add_mass(s, m2);
    int32_t next = 111;
    int first;
    assert_int_equal(kv_seq_append(s, &next, 1, &first), 0);
    assert_int_equal(first, 7);
    const int keep[7] = {0, 1, 3, 5, 8, 9, 10};
    assert_int_equal(kv_seq_n_tokens(s), 8);
    assert_int_equal(kv_seq_n_pages(s), 2);
    for (int i = 0; i < 7; i++) {
        assert_int_equal(kv_seq_tokens(s)[i], 100 + keep[i]);
        assert_int_equal(kv_seq_positions(s)[i], i);
        assert_int_equal(kv_seq_hist_index(s)[i], keep[i]);
        assert_float_equal(kv_seq_mass(s)[i], m1[keep[i]] + m2[keep[i]], 0);
        assert_true(token_intact(s, &l, i, 500u + (uint32_t)keep[i]));
    }
    assert_int_equal(kv_seq_positions(s)[7], 7);
    assert_float_equal(kv_seq_mass(s)[7], 0, 0);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.tokens_evicted, 4);
    assert_int_equal(st.pages_used, 2);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

static void test_explicit_evict_and_max_append(void **state)
{
    (void)state;
    kv_cache *c = make_cache(1 << 16, 4, 1, 1, 4, KV_F32);
    kv_seq *s = make_seq(c, sink_window(20, 1, 5, true), false); /* 4+5+4=13 <= 20 */
    int32_t ids[20] = {0};
    assert_int_equal(kv_seq_max_append(s), 20);
    assert_int_equal(kv_seq_append(s, ids, 20, NULL), 0);
    /* floor: sink page 0..3, window 15..19 needs pages 3 (12..15) and 4:
     * pages 1 and 2 can go -> floor 12. */
    assert_int_equal(kv_seq_max_append(s), 8);
    assert_int_equal(kv_seq_append(s, ids, 9, NULL), -ENOSPC);
    assert_int_equal(kv_seq_n_tokens(s), 20);
    assert_int_equal(kv_seq_evict(s, -1), -EINVAL);
    assert_int_equal(kv_seq_evict(s, 0), 0);
    assert_int_equal(kv_seq_evict(s, 9), -ENOSPC);
    assert_int_equal(kv_seq_evict(s, 3), 4); /* one page is enough */
    assert_int_equal(kv_seq_n_tokens(s), 16);
    assert_true(kv_seq_has_room(s, 4));
    assert_int_equal(kv_seq_evict(s, 8), 4);
    assert_int_equal(kv_seq_n_tokens(s), 12);
    assert_int_equal(kv_seq_append(s, ids, 8, NULL), 0);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------
 * Sessions and LRU
 * ------------------------------------------------------------------------ */

static void test_session_history_truncate(void **state)
{
    (void)state;
    kv_cache *c = make_cache(1 << 16, 4, 1, 1, 4, KV_F32);
    kv_seq *s = make_seq(c, sink_window(12, 1, 3, true), true);
    assert_true(kv_seq_is_session(s));
    int32_t id;
    for (id = 0; id < 14; id++)
        assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    /* 13th token evicted page 1: retained 0..3, 8..13. */
    assert_int_equal(kv_seq_n_tokens(s), 10);
    const int32_t *hist;
    assert_int_equal(kv_seq_history(s, &hist), 14);
    for (int i = 0; i < 14; i++)
        assert_int_equal(hist[i], i); /* evicted ones stay in the history */

    /* A new prompt diverges at history index 10. */
    assert_int_equal(kv_seq_truncate(s, 15), -EINVAL);
    assert_int_equal(kv_seq_truncate(s, -1), -EINVAL);
    assert_int_equal(kv_seq_truncate(s, 10), 0);
    assert_int_equal(kv_seq_history(s, NULL), 10);
    assert_int_equal(kv_seq_n_tokens(s), 6); /* 0..3, 8, 9 */
    assert_int_equal(kv_seq_tokens(s)[5], 9);
    assert_int_equal(kv_seq_n_pages(s), 2);
    assert_int_equal(kv_seq_next_pos(s), 6);
    id = 99;
    assert_int_equal(kv_seq_append(s, &id, 1, NULL), 0);
    assert_int_equal(kv_seq_history(s, &hist), 11);
    assert_int_equal(hist[10], 99);
    assert_int_equal(kv_seq_hist_index(s)[6], 10);
    assert_cache_ok(c);

    /* Truncating into the evicted gap keeps the sinks only (preserve mode:
     * the next position is the cut's own). */
    struct kv_policy p = sink_window(12, 1, 3, false);
    kv_seq *q = make_seq(c, p, true);
    for (id = 0; id < 14; id++)
        assert_int_equal(kv_seq_append(q, &id, 1, NULL), 0);
    assert_int_equal(kv_seq_truncate(q, 6), 0);
    assert_int_equal(kv_seq_n_tokens(q), 4);
    assert_int_equal(kv_seq_next_pos(q), 6);
    assert_int_equal(kv_seq_truncate(q, 0), 0);
    assert_int_equal(kv_seq_n_pages(q), 0);
    assert_int_equal(kv_seq_next_pos(q), 0);

    /* A plain sequence keeps no history. */
    kv_seq *r = make_seq(c, none_policy(10), false);
    assert_int_equal(kv_seq_append(r, &id, 1, NULL), 0);
    assert_int_equal(kv_seq_history(r, &hist), 0);
    assert_null(hist);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.sequences, 3);
    assert_int_equal(st.sessions, 2);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* When the pool is short, the session idle longest goes first, whole;
 * pinned sessions and running (non-session) sequences are never dropped. */
static void test_lru_drops_idle_sessions(void **state)
{
    (void)state;
    kv_cache *c = make_cache(10 * 128, 4, 1, 1, 4, KV_F32); /* 128-byte pages: 10 */
    assert_int_equal(kv_cache_n_pages(c), 10);
    int32_t ids[40] = {0};
    kv_seq *a = make_seq(c, none_policy(40), true);
    kv_seq *b = make_seq(c, none_policy(40), true);
    kv_seq *p = make_seq(c, none_policy(40), true);
    kv_seq *run = make_seq(c, none_policy(40), false);
    kv_seq *r = make_seq(c, none_policy(40), false);
    assert_int_equal(kv_seq_append(a, ids, 8, NULL), 0);   /* 2 pages */
    assert_int_equal(kv_seq_append(b, ids, 8, NULL), 0);   /* 2 pages */
    assert_int_equal(kv_seq_append(p, ids, 8, NULL), 0);   /* 2 pages */
    assert_int_equal(kv_seq_append(run, ids, 8, NULL), 0); /* 2 pages */
    kv_seq_touch(a, 300);
    kv_seq_touch(b, 100); /* idle longest */
    kv_seq_touch(p, 50);  /* older still, but pinned by a running request */
    kv_seq_pin(p, true);
    struct kv_stats st;

    /* 2 free pages; r needs 4: exactly b goes. */
    assert_int_equal(kv_seq_append(r, ids, 16, NULL), 0);
    assert_true(kv_seq_dropped(b));
    assert_false(kv_seq_dropped(a));
    assert_false(kv_seq_dropped(p));
    assert_int_equal(kv_seq_n_tokens(b), 0);
    assert_int_equal(kv_seq_history(b, NULL), 0);
    kv_cache_stats(c, &st);
    assert_int_equal(st.sessions_dropped, 1);
    assert_int_equal(st.pages_free, 0);
    assert_int_equal(st.sessions, 3); /* dropped, not destroyed */

    /* r needs 5 more pages: a (2) is all LRU can give: refused, nothing
     * changed, a not dropped. */
    assert_int_equal(kv_seq_append(r, ids, 17, NULL), -ENOMEM);
    assert_false(kv_seq_dropped(a));
    assert_int_equal(kv_seq_n_tokens(a), 8);
    assert_int_equal(kv_seq_n_tokens(r), 16);
    kv_cache_stats(c, &st);
    assert_int_equal(st.sessions_dropped, 1);

    /* Unpinned, p is now the idle-longest. */
    kv_seq_pin(p, false);
    assert_int_equal(kv_seq_append(r, ids, 8, NULL), 0);
    assert_true(kv_seq_dropped(p));
    assert_false(kv_seq_dropped(a));
    assert_cache_ok(c);

    /* A dropped session works as a new one (and stays flagged). */
    kv_seq_destroy(r);
    assert_int_equal(kv_seq_append(b, ids, 3, NULL), 0);
    assert_int_equal(kv_seq_positions(b)[0], 0);
    assert_int_equal(kv_seq_history(b, NULL), 3);
    assert_true(kv_seq_dropped(b));

    /* Ties on last use go to the older session. */
    kv_seq *x = make_seq(c, none_policy(40), true);
    kv_seq *y = make_seq(c, none_policy(40), true);
    kv_seq_destroy(b);
    assert_int_equal(kv_seq_append(x, ids, 12, NULL), 0);
    assert_int_equal(kv_seq_append(y, ids, 12, NULL), 0);
    kv_seq_touch(x, 7);
    kv_seq_touch(y, 7);
    kv_seq_touch(a, 9);
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_free, 0);
    assert_int_equal(kv_seq_append(run, ids, 1, NULL), 0);
    assert_true(kv_seq_dropped(x));
    assert_false(kv_seq_dropped(y));
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* A pool short of pages: LRU first, then the running sequence's own policy
 * evicts below its budget; with nothing to drop and policy none, -ENOMEM. */
static void test_pool_pressure_order(void **state)
{
    (void)state;
    kv_cache *c = make_cache(8 * 128, 4, 1, 1, 4, KV_F32); /* 128-byte pages: 8 */
    int32_t ids[32] = {0};
    kv_seq *idle = make_seq(c, none_policy(40), true);
    kv_seq *s = make_seq(c, sink_window(32, 1, 4, true), false); /* 4+4+4 <= 32 */
    assert_int_equal(kv_seq_append(idle, ids, 4, NULL), 0);      /* 1 page */
    assert_int_equal(kv_seq_append(s, ids, 28, NULL), 0);        /* 7 pages */
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_free, 0);

    /* s is under its budget, but the pool is full: the idle session goes
     * before s loses anything. */
    assert_int_equal(kv_seq_append(s, ids, 4, NULL), 0);
    assert_true(kv_seq_dropped(idle));
    assert_int_equal(kv_seq_n_tokens(s), 32);
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, 0);

    /* Now the pool and the budget are both exhausted; a running sequence
     * with policy none holds a page the stream cannot take. */
    kv_seq_destroy(idle);
    kv_seq *other = make_seq(c, none_policy(8), false);
    assert_int_equal(kv_seq_evict(s, 4), 4);
    assert_int_equal(kv_seq_append(other, ids, 4, NULL), 0);
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_free, 0);
    assert_int_equal(kv_seq_append(other, ids, 1, NULL), -ENOMEM);
    assert_int_equal(kv_seq_n_tokens(other), 4);

    /* s at 28 of 32 could append 4 within budget but the pool has no page:
     * nobody to drop, so s's own policy evicts one more page. */
    uint64_t ev = st.evictions;
    assert_int_equal(kv_seq_append(s, ids, 4, NULL), 0);
    assert_int_equal(kv_seq_n_tokens(s), 28);
    kv_cache_stats(c, &st);
    assert_int_equal(st.evictions, ev + 1);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------ */

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_types),
        cmocka_unit_test(test_create_rejects),
        cmocka_unit_test(test_layout),
        cmocka_unit_test(test_pool_lifo_and_check),
        cmocka_unit_test(test_mlock_optional),
        cmocka_unit_test(test_pool_huge_pages),
        cmocka_unit_test(test_policy_check),
        cmocka_unit_test(test_policy_budget),
        cmocka_unit_test(test_memory_for),
        cmocka_unit_test(test_reserve_all_or_nothing),
        cmocka_unit_test(test_append_basic),
        cmocka_unit_test(test_none_refuses),
        cmocka_unit_test(test_sink_window_pages),
        cmocka_unit_test(test_sink_window_step),
        cmocka_unit_test(test_preserve_positions),
        cmocka_unit_test(test_no_rewrite_sink_window),
        cmocka_unit_test(test_no_rewrite_h2o),
        cmocka_unit_test(test_h2o_selection),
        cmocka_unit_test(test_explicit_evict_and_max_append),
        cmocka_unit_test(test_session_history_truncate),
        cmocka_unit_test(test_lru_drops_idle_sessions),
        cmocka_unit_test(test_pool_pressure_order),
    };
    return cmocka_run_group_tests_name("cache", tests, NULL, NULL);
}
