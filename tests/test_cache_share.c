/*
 * test_cache_share.c - shared pages in the KV cache: reference counts,
 * copy-on-write, kv_seq_fork, kv_seq_attach, outside references and the
 * reclaim hook.
 *
 * Every test writes each token's K and V rows from a seed (cache_model.h)
 * and checks afterwards that every sequence still reads exactly the bytes
 * it wrote: a write into a page another sequence reads, a page freed while
 * held, or a reference lost shows up as a changed row or as
 * kv_cache_check failing. The randomized run with forks and shares is in
 * test_cache_invariants.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/cache_model.h"

enum { PT = 4 };

/* A cache of n_pages 2-layer, 2-head, head_dim 3 f16 pages (192 bytes). */
static kv_cache *small_cache(int n_pages, struct kv_layout *l)
{
    kv_cache *c = make_cache((size_t)n_pages * 192, PT, 2, 2, 3, KV_F16);
    assert_int_equal(kv_cache_n_pages(c), n_pages);
    kv_cache_layout(c, l);
    return c;
}

/* Append n tokens with ids id0.. and contents seeded by their ids. */
static void put(kv_seq *s, const struct kv_layout *l, int32_t id0, int n)
{
    int32_t ids[64];
    assert_true(n <= 64);
    for (int i = 0; i < n; i++)
        ids[i] = id0 + i;
    int first = -1;
    assert_int_equal(kv_seq_append(s, ids, n, &first), 0);
    for (int i = 0; i < n; i++)
        fill_token(s, l, first + i, (uint32_t)(id0 + i));
}

/* Every retained token of s holds the bytes its id seeded. */
static void assert_intact(kv_seq *s, const struct kv_layout *l)
{
    for (int i = 0; i < kv_seq_n_tokens(s); i++)
        assert_true(token_intact(s, l, i, (uint32_t)kv_seq_tokens(s)[i]));
}

static int used_pages(const kv_cache *c)
{
    struct kv_stats st;
    kv_cache_stats(c, &st);
    return st.pages_used;
}

static int shared_pages(const kv_cache *c)
{
    struct kv_stats st;
    kv_cache_stats(c, &st);
    return st.pages_shared;
}

/* A fork shares every page; each side's first write into the shared
 * partial page copies it; evicting in one leaves the other as it was. */
static void test_fork_shares_then_copies(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(16, &l);
    kv_seq *a = make_seq(c, sink_window(24, 4, 4, true), true);
    put(a, &l, 100, 10); /* pages: full, full, 2 of 4 */
    assert_int_equal(used_pages(c), 3);

    char err[256];
    kv_seq *b = kv_seq_fork(a, true, err, sizeof(err));
    assert_non_null(b);
    assert_int_equal(used_pages(c), 3); /* nothing copied, nothing allocated */
    assert_int_equal(shared_pages(c), 3);
    assert_int_equal(kv_seq_n_tokens(b), 10);
    assert_memory_equal(kv_seq_page_table(b), kv_seq_page_table(a), 3 * sizeof(int32_t));
    assert_memory_equal(kv_seq_positions(b), kv_seq_positions(a), 10 * sizeof(int32_t));
    assert_memory_equal(kv_seq_tokens(b), kv_seq_tokens(a), 10 * sizeof(int32_t));
    assert_int_equal(kv_seq_next_pos(b), kv_seq_next_pos(a));
    const int32_t *hist;
    assert_int_equal(kv_seq_history(b, &hist), 10);
    assert_int_equal(hist[9], 109);
    for (int j = 0; j < 3; j++)
        assert_int_equal(kv_page_refs(c, kv_seq_page_table(a)[j]), 2);
    assert_cache_ok(c);

    /* Different tokens into each: the shared last page is copied once. */
    int32_t a_last = kv_seq_page_table(a)[2];
    put(b, &l, 200, 1);
    assert_int_not_equal(kv_seq_page_table(b)[2], a_last);
    assert_int_equal(kv_seq_page_table(a)[2], a_last);
    assert_int_equal(used_pages(c), 4);
    assert_int_equal(shared_pages(c), 2);
    put(a, &l, 300, 3); /* now a alone holds its last page: no copy */
    assert_int_equal(kv_seq_page_table(a)[2], a_last);
    assert_int_equal(used_pages(c), 5);
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_int_equal(kv_seq_tokens(a)[10], 300);
    assert_int_equal(kv_seq_tokens(b)[10], 200);
    assert_cache_ok(c);

    /* Evict in b: its shared middle pages lose b's reference only. */
    int32_t a_before[16], b_pos[32];
    int na = kv_seq_n_tokens(a);
    memcpy(a_before, kv_seq_page_table(a), sizeof(int32_t) * (size_t)kv_seq_n_pages(a));
    put(b, &l, 400, 13); /* 24 tokens: at the budget */
    put(b, &l, 500, 2);  /* evicts whole pages after the sink page */
    assert_true(kv_seq_n_tokens(b) < 26);
    memcpy(b_pos, kv_seq_positions(b), sizeof(int32_t) * (size_t)kv_seq_n_tokens(b));
    assert_int_equal(kv_seq_n_tokens(a), na);
    assert_memory_equal(kv_seq_page_table(a), a_before, sizeof(int32_t) * (size_t)kv_seq_n_pages(a));
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_int_equal(kv_seq_page_table(b)[0], kv_seq_page_table(a)[0]); /* the sink page */
    assert_cache_ok(c);

    /* Destroying the parent leaves the child whole, and the reverse. */
    kv_seq_destroy(a);
    assert_intact(b, &l);
    assert_memory_equal(kv_seq_positions(b), b_pos, sizeof(int32_t) * (size_t)kv_seq_n_tokens(b));
    assert_int_equal(shared_pages(c), 0);
    assert_cache_ok(c);
    kv_seq_destroy(b);
    assert_int_equal(used_pages(c), 0);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* A scored policy compacts rows into the pages it keeps: shared ones are
 * copied first, so the other holder's bytes never move. */
static void test_fork_h2o_compaction_copies(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(24, &l);
    kv_seq *a = make_seq(c, h2o(16, 2, 4, 4, true), false);
    put(a, &l, 100, 16);
    float mass[16]; /* tokens 2 and 3 heavy: the first one to go is token 4 */
    for (int i = 0; i < 16; i++)
        mass[i] = i < 4 ? 10.0f : (float)((i * 7) % 5);
    kv_seq_add_mass(a, mass);
    char err[256];
    kv_seq *b = kv_seq_fork(a, false, err, sizeof(err));
    assert_non_null(b);
    assert_true(kv_seq_mass(b)[3] == kv_seq_mass(a)[3]); /* scores copied */
    int32_t a_pages[4];
    memcpy(a_pages, kv_seq_page_table(a), sizeof(a_pages));

    put(b, &l, 200, 4); /* evicts 6 middle tokens, compacts the rest */
    assert_int_equal(kv_seq_n_tokens(b), 14);
    assert_int_equal(kv_seq_n_tokens(a), 16);
    assert_memory_equal(kv_seq_page_table(a), a_pages, sizeof(a_pages));
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_int_equal(kv_seq_page_table(b)[0], a_pages[0]); /* page 0 is not written */
    assert_int_not_equal(kv_seq_page_table(b)[1], a_pages[1]); /* page 1 is, so copied */
    assert_cache_ok(c);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    assert_int_equal(used_pages(c), 0);
    kv_cache_destroy(c);
}

/* The pool counts a fork's copy before it makes it: an append that would
 * need a copy of a shared page and finds no free page is refused whole. */
static void test_fork_copy_is_counted(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(3, &l);
    kv_seq *a = make_seq(c, none_policy(12), false);
    put(a, &l, 100, 6); /* 2 pages, the second half full */
    char err[256];
    kv_seq *b = kv_seq_fork(a, false, err, sizeof(err));
    assert_non_null(b);
    kv_seq *other = make_seq(c, none_policy(12), false);
    put(other, &l, 900, 1); /* the last free page */
    assert_false(kv_seq_has_room(b, 1)); /* a page for the copy is needed */
    int32_t t = 7;
    assert_int_equal(kv_seq_append(b, &t, 1, NULL), -ENOMEM);
    assert_int_equal(kv_seq_n_tokens(b), 6);
    assert_cache_ok(c);
    kv_seq_destroy(other);
    assert_true(kv_seq_has_room(b, 1));
    assert_true(kv_seq_has_room(b, 2)); /* still one copy, no new page */
    assert_false(kv_seq_has_room(b, 3)); /* a copy and a new page */
    put(b, &l, 200, 2);
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_cache_ok(c);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    kv_cache_destroy(c);
}

/* Dropping an idle session frees only the pages no one else holds; a
 * session whose pages are all shared is passed over. */
static void test_lru_counts_only_unshared(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(6, &l);
    kv_seq *old = make_seq(c, none_policy(64), true);
    put(old, &l, 100, 8); /* 2 full pages */
    char err[256];
    kv_seq *twin = kv_seq_fork(old, true, err, sizeof(err)); /* shares both */
    assert_non_null(twin);
    kv_seq_touch(old, 1);
    kv_seq_touch(twin, 2);
    kv_seq *mid = make_seq(c, none_policy(64), true);
    put(mid, &l, 300, 4);
    kv_seq_touch(mid, 3);
    kv_seq *run = make_seq(c, none_policy(64), false);
    put(run, &l, 400, 12); /* 3 pages: the pool is full */
    assert_int_equal(used_pages(c), 6);

    /* One more page: old and twin free nothing alone; mid goes. */
    put(run, &l, 500, 1);
    assert_false(kv_seq_dropped(old));
    assert_false(kv_seq_dropped(twin));
    assert_true(kv_seq_dropped(mid));
    assert_intact(old, &l);
    assert_intact(run, &l);
    assert_cache_ok(c);
    kv_seq_destroy(old);
    kv_seq_destroy(twin);
    kv_seq_destroy(mid);
    kv_seq_destroy(run);
    kv_cache_destroy(c);
}

/* Outside references keep pages alive past their sequence; attach puts
 * them into another sequence without a copy. */
static void test_outside_refs_and_attach(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(8, &l);
    kv_seq *a = make_seq(c, none_policy(32), false);
    put(a, &l, 100, 10);
    int32_t pages[3];
    memcpy(pages, kv_seq_page_table(a), sizeof(pages));
    int32_t ids[8];
    memcpy(ids, kv_seq_tokens(a), sizeof(ids));

    assert_int_equal(kv_page_ref(c, -1), -EINVAL);
    assert_int_equal(kv_page_ref(c, 8), -EINVAL);
    assert_int_equal(kv_page_ref(c, 7), -EINVAL); /* free */
    assert_int_equal(kv_page_unref(c, pages[0]), -EINVAL); /* no outside reference */
    assert_int_equal(kv_page_refs(c, 7), 0);
    assert_int_equal(kv_page_refs(c, 99), -EINVAL);
    assert_int_equal(kv_page_ref(c, pages[0]), 0);
    assert_int_equal(kv_page_ref(c, pages[1]), 0);
    assert_int_equal(kv_page_refs(c, pages[0]), 2);
    assert_cache_ok(c);
    kv_seq_destroy(a); /* the two full pages stay, the partial one goes */
    assert_int_equal(used_pages(c), 2);
    assert_int_equal(kv_page_refs(c, pages[0]), 1);
    assert_cache_ok(c);

    kv_seq *b = make_seq(c, none_policy(32), true);
    assert_int_equal(kv_seq_attach(b, pages, 2, ids), 0);
    assert_int_equal(kv_seq_n_tokens(b), 8);
    assert_int_equal(used_pages(c), 2);
    assert_memory_equal(kv_seq_page_table(b), pages, 2 * sizeof(int32_t));
    assert_int_equal(kv_seq_positions(b)[7], 7);
    const int32_t *hist;
    assert_int_equal(kv_seq_history(b, &hist), 8);
    assert_memory_equal(hist, ids, sizeof(ids));
    assert_intact(b, &l);
    put(b, &l, 200, 3); /* a page of its own */
    assert_int_equal(used_pages(c), 3);
    assert_cache_ok(c);

    /* Refused, nothing changed: a partial last page, a free page, the budget. */
    kv_seq *d = make_seq(c, none_policy(6), false);
    assert_int_equal(kv_seq_attach(b, pages, 1, ids), -EINVAL);
    int32_t bad[2] = {pages[0], 7};
    assert_int_equal(kv_seq_attach(d, bad, 2, ids), -EINVAL);
    assert_int_equal(kv_seq_attach(d, pages, 2, ids), -ENOSPC);
    assert_int_equal(kv_seq_attach(d, NULL, 1, ids), -EINVAL);
    assert_int_equal(kv_seq_n_tokens(d), 0);
    assert_int_equal(kv_page_refs(c, pages[0]), 2);
    assert_cache_ok(c);

    assert_int_equal(kv_page_unref(c, pages[0]), 0);
    assert_int_equal(kv_page_unref(c, pages[1]), 0);
    assert_int_equal(kv_page_unref(c, pages[1]), -EINVAL);
    assert_intact(b, &l);
    kv_seq_destroy(b);
    kv_seq_destroy(d);
    assert_int_equal(used_pages(c), 0);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

struct holder {
    int32_t pages[8];
    int n, calls, asked;
};

/* The reclaim hook of the test's outside holder: let go of pages no
 * sequence holds, oldest first. */
static int holder_reclaim(void *ctx, kv_cache *c, int n_pages)
{
    struct holder *h = ctx;
    h->calls++;
    h->asked = n_pages;
    int freed = 0, k = 0;
    for (int i = 0; i < h->n; i++) {
        if (freed < n_pages && kv_page_refs(c, h->pages[i]) == 1) {
            assert_int_equal(kv_page_unref(c, h->pages[i]), 0);
            freed++;
        } else {
            h->pages[k++] = h->pages[i];
        }
    }
    h->n = k;
    return freed;
}

/* A short pool asks the outside holder before it drops an idle session. */
static void test_reclaim_before_lru(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(6, &l);
    struct holder h = {0};
    kv_cache_set_reclaim(c, holder_reclaim, &h);
    kv_seq *a = make_seq(c, none_policy(64), false);
    put(a, &l, 100, 12);
    for (int j = 0; j < 3; j++) {
        h.pages[h.n++] = kv_seq_page_table(a)[j];
        assert_int_equal(kv_page_ref(c, kv_seq_page_table(a)[j]), 0);
    }
    kv_seq_destroy(a); /* three cached pages no sequence holds */
    kv_seq *idle = make_seq(c, none_policy(64), true);
    put(idle, &l, 200, 8);
    kv_seq_touch(idle, 1);
    assert_int_equal(used_pages(c), 5);

    kv_seq *run = make_seq(c, none_policy(64), false);
    put(run, &l, 300, 8); /* needs 2 pages, 1 is free: one cached page goes */
    assert_int_equal(h.calls, 1);
    assert_int_equal(h.asked, 1);
    assert_int_equal(h.n, 2);
    assert_false(kv_seq_dropped(idle));
    put(run, &l, 400, 8); /* 2 more: the other two cached pages */
    assert_int_equal(h.n, 0);
    assert_false(kv_seq_dropped(idle));
    put(run, &l, 500, 1); /* nothing cached is left: now the session goes */
    assert_true(kv_seq_dropped(idle));
    assert_intact(run, &l);
    assert_cache_ok(c);
    kv_seq_destroy(idle);
    kv_seq_destroy(run);
    kv_cache_destroy(c);
}

/* A sink-window eviction that keeps a pinned page in the middle frees the
 * pages around it: in a fork, only the child's references go, and the
 * child keeps its parent's pins. */
static void test_fork_keeps_pins(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(24, &l);
    struct kv_policy pol = sink_window(32, 4, 8, true);
    kv_seq *a = make_seq(c, pol, true);
    const struct kv_span pin[1] = {{9, 11}}; /* in the third page */
    char err[256];
    assert_int_equal(kv_seq_set_pins(a, pin, 1, err, sizeof(err)), 0);
    put(a, &l, 100, 30);
    kv_seq *b = kv_seq_fork(a, true, err, sizeof(err));
    assert_non_null(b);
    const struct kv_span *ps;
    assert_int_equal(kv_seq_pins(b, &ps), 1);
    assert_true(ps[0].start == 9 && ps[0].end == 11);
    assert_int_equal(kv_seq_policy(b)->window_tokens, kv_seq_policy(a)->window_tokens);
    int32_t a_pages[8];
    memcpy(a_pages, kv_seq_page_table(a), sizeof(int32_t) * (size_t)kv_seq_n_pages(a));
    put(b, &l, 200, 8); /* past the budget: pages around the pinned one go */
    bool held = false;
    for (int i = 0; i < kv_seq_n_tokens(b); i++)
        held |= kv_seq_tokens(b)[i] == 109;
    assert_true(held);
    assert_int_equal(kv_seq_n_tokens(a), 30);
    assert_memory_equal(kv_seq_page_table(a), a_pages, sizeof(int32_t) * (size_t)kv_seq_n_pages(a));
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_cache_ok(c);
    kv_seq_destroy(a);
    kv_seq_destroy(b);
    assert_int_equal(used_pages(c), 0);
    kv_cache_destroy(c);
}

static void test_fork_refusals(void **state)
{
    (void)state;
    struct kv_layout l;
    kv_cache *c = small_cache(4, &l);
    char err[256];
    assert_null(kv_seq_fork(NULL, false, err, sizeof(err)));
    kv_seq *a = make_seq(c, none_policy(8), false);
    put(a, &l, 1, 3);
    assert_null(kv_seq_fork(a, true, err, sizeof(err)));
    assert_non_null(strstr(err, "session"));
    assert_cache_ok(c);
    /* A fork of a fork, and of an empty sequence. */
    kv_seq *b = kv_seq_fork(a, false, err, sizeof(err));
    kv_seq *g = kv_seq_fork(b, false, err, sizeof(err));
    kv_seq *e0 = make_seq(c, none_policy(8), false);
    kv_seq *e1 = kv_seq_fork(e0, false, err, sizeof(err));
    assert_non_null(g);
    assert_non_null(e1);
    assert_int_equal(kv_page_refs(c, kv_seq_page_table(a)[0]), 3);
    assert_int_equal(kv_seq_n_tokens(e1), 0);
    put(e1, &l, 50, 2);
    put(g, &l, 60, 2);
    assert_intact(a, &l);
    assert_intact(b, &l);
    assert_intact(g, &l);
    assert_cache_ok(c);
    kv_seq_destroy(b);
    kv_seq_destroy(a);
    kv_seq_destroy(e0);
    assert_intact(g, &l);
    kv_seq_destroy(g);
    kv_seq_destroy(e1);
    assert_int_equal(used_pages(c), 0);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fork_shares_then_copies),
        cmocka_unit_test(test_fork_h2o_compaction_copies),
        cmocka_unit_test(test_fork_copy_is_counted),
        cmocka_unit_test(test_lru_counts_only_unshared),
        cmocka_unit_test(test_outside_refs_and_attach),
        cmocka_unit_test(test_reclaim_before_lru),
        cmocka_unit_test(test_fork_keeps_pins),
        cmocka_unit_test(test_fork_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
