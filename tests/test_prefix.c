/*
 * test_prefix.c - the automatic prefix cache (cache/prefix.c): the index of
 * full pages by hash chain, its collision safety and its LRU of idle pages,
 * first on its own, then inside a real pool (shared pages, reclaim before
 * anything else gives way, the share cap).
 *
 * White-box: the index's calls are cache_internal.h's.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cache/cache_internal.h"
#include "cache/kv_cache.h"
#include "engine/engine.h"
#include "engine/spill.h"
#include "tests/cache_model.h"
#include "tests/serve_fixture.h"

#define PT 4 /* tokens per page in the index tests */

static uint32_t rng(uint32_t *s)
{
    return rng_next(s);
}

/* The bare index's idle pages, as the tests decide them. */
static bool idle_flag[64];
static bool test_idle(const kv_prefix *px, int32_t page)
{
    (void)px;
    return idle_flag[page];
}

static void check_ok(const kv_prefix *px)
{
    char err[256] = "";
    int rc = kv_prefix_check(px, err, sizeof(err));
    if (rc != 0)
        fail_msg("prefix index: %s", err);
}

/* List a whole chain: tokens[0 .. n_pages*PT) into pages[0 .. n_pages). */
static void add_chain(kv_prefix *px, const int32_t *tokens, const int32_t *pages, int n_pages)
{
    int32_t parent = -1;
    for (int i = 0; i < n_pages; i++) {
        assert_int_equal(kv_prefix_find(px, parent, tokens + i * PT), -1);
        kv_prefix_add(px, parent, tokens + i * PT, pages[i]);
        parent = pages[i];
    }
}

/* ------------------------------------------------------------------------
 * The index alone
 * ------------------------------------------------------------------------ */

static void test_match_longest(void **state)
{
    (void)state;
    kv_prefix *px = kv_prefix_new(16, PT, 42, 16);
    assert_non_null(px);
    int32_t t[16], out[8];
    for (int i = 0; i < 16; i++)
        t[i] = 100 + i;
    assert_int_equal(kv_prefix_match(px, t, 16, out, 8), 0);
    add_chain(px, t, (int32_t[]){7, 3, 9}, 3);
    check_ok(px);
    /* the whole chain, then less: whole pages only, max_pages, n_tokens */
    assert_int_equal(kv_prefix_match(px, t, 16, out, 8), 3);
    assert_int_equal(out[0], 7);
    assert_int_equal(out[1], 3);
    assert_int_equal(out[2], 9);
    assert_int_equal(kv_prefix_match(px, t, 11, out, 8), 2);
    assert_int_equal(kv_prefix_match(px, t, 16, out, 1), 1);
    /* a prompt that differs in page 1 shares page 0 only */
    int32_t u[16];
    memcpy(u, t, sizeof(u));
    u[6] = 5;
    assert_int_equal(kv_prefix_match(px, u, 16, out, 8), 1);
    /* the same tokens under another fingerprint match nothing */
    kv_prefix *other = kv_prefix_new(16, PT, 43, 16);
    assert_non_null(other);
    add_chain(other, t, (int32_t[]){1}, 1);
    assert_int_equal(kv_prefix_find(other, -1, t), 1);
    assert_int_equal(kv_prefix_find(px, 1, t + PT), -1); /* 1 is not in px */
    kv_prefix_destroy(other);
    /* a page's tokens at another place in a chain are not a match */
    assert_int_equal(kv_prefix_find(px, -1, t + PT), -1);
    kv_prefix_destroy(px);
}

/*
 * Every hash equal (the mask keeps no bit): lookups still return exactly
 * the entry whose parent and tokens match, because neither is taken on the
 * hash's word.
 */
static void test_collisions(void **state)
{
    (void)state;
    kv_prefix *px = kv_prefix_new(16, PT, 1, 16);
    assert_non_null(px);
    kv_prefix_set_hash_mask(px, 0);
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {9, 9, 9, 9, 5, 6, 7, 8}, out[4];
    add_chain(px, a, (int32_t[]){0, 1}, 2);
    add_chain(px, b, (int32_t[]){2, 3}, 2);
    check_ok(px);
    assert_int_equal(kv_prefix_match(px, a, 8, out, 4), 2);
    assert_int_equal(out[0], 0);
    assert_int_equal(out[1], 1);
    assert_int_equal(kv_prefix_match(px, b, 8, out, 4), 2);
    assert_int_equal(out[0], 2);
    assert_int_equal(out[1], 3); /* same second-page tokens, other parent */
    int32_t c[8] = {1, 2, 3, 5, 5, 6, 7, 8};
    assert_int_equal(kv_prefix_match(px, c, 8, out, 4), 0);
    kv_prefix_destroy(px);
}

/* Removing an entry moves its slot's generation on: a page listed again in
 * the same slot is not mistaken for the chain it left. */
static void test_generation(void **state)
{
    (void)state;
    kv_prefix *px = kv_prefix_new(8, PT, 7, 8);
    assert_non_null(px);
    int32_t a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, out[4];
    add_chain(px, a, (int32_t[]){4, 5}, 2);
    kv_prefix_remove(px, 5);
    kv_prefix_remove(px, 4);
    check_ok(px);
    assert_int_equal(kv_prefix_n_entries(px), 0);
    int32_t z[4] = {0, 0, 0, 0};
    kv_prefix_add(px, -1, z, 4); /* slot 4 again, another page 0 */
    kv_prefix_add(px, -1, a, 6);
    assert_int_equal(kv_prefix_find(px, 4, a + PT), -1);
    assert_int_equal(kv_prefix_match(px, a, 8, out, 4), 1);
    assert_int_equal(out[0], 6);
    check_ok(px);
    kv_prefix_destroy(px);
}

/* Idle entries go back oldest first, never one with children. */
static void test_lru_leaf_first(void **state)
{
    (void)state;
    memset(idle_flag, 0, sizeof(idle_flag));
    kv_prefix *px = kv_prefix_new(8, PT, 9, 8);
    assert_non_null(px);
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    add_chain(px, a, (int32_t[]){0, 1, 2}, 3);
    assert_int_equal(kv_prefix_victim(px, test_idle), -1); /* nothing idle */
    idle_flag[0] = idle_flag[1] = true;
    assert_int_equal(kv_prefix_victim(px, test_idle), -1); /* 2 busy; 0 and 1 have children */
    idle_flag[2] = true;
    /* touched leaf first, root last: the leaf is the oldest */
    kv_prefix_touch(px, 2);
    kv_prefix_touch(px, 1);
    kv_prefix_touch(px, 0);
    assert_int_equal(kv_prefix_victim(px, test_idle), 2);
    kv_prefix_remove(px, 2);
    assert_int_equal(kv_prefix_victim(px, test_idle), 1);
    kv_prefix_remove(px, 1);
    /* another chain, used more recently, goes after the old one */
    int32_t b[4] = {7, 7, 7, 7};
    add_chain(px, b, (int32_t[]){5}, 1);
    idle_flag[5] = true;
    assert_int_equal(kv_prefix_victim(px, test_idle), 0);
    kv_prefix_touch(px, 0);
    assert_int_equal(kv_prefix_victim(px, test_idle), 5);
    idle_flag[5] = false;
    assert_int_equal(kv_prefix_victim(px, test_idle), 0);
    check_ok(px);
    kv_prefix_destroy(px);
}

/*
 * Random chains over a three-token alphabet (so prefixes share often) with
 * a hash of two bits (so buckets collide always), against the obvious
 * model: every listed page remembers the full token prefix it ends, and the
 * longest match is the longest run of pages whose prefixes equal the
 * prompt's.
 */
#define R_PAGES 64
#define R_MAXP 6
static int32_t free_slot(const int *depth)
{
    for (int p = 0; p < R_PAGES; p++)
        if (depth[p] == 0)
            return p;
    return -1;
}

static void test_random_against_model(void **state)
{
    (void)state;
    memset(idle_flag, 1, sizeof(idle_flag));
    for (int mask_bits = 0; mask_bits <= 2; mask_bits += 2) {
        uint32_t seed = 12345u + (uint32_t)mask_bits;
        kv_prefix *px = kv_prefix_new(R_PAGES, PT, 5, R_PAGES);
        assert_non_null(px);
        kv_prefix_set_hash_mask(px, mask_bits ? 3 : UINT64_MAX);
        int32_t prefix[R_PAGES][R_MAXP * PT]; /* model: page -> its full prefix */
        int depth[R_PAGES];                   /* pages in that prefix, 0 = unlisted */
        memset(depth, 0, sizeof(depth));
        for (int round = 0; round < 400; round++) {
            int32_t prompt[R_MAXP * PT];
            int n_pages = 1 + (int)(rng(&seed) % R_MAXP);
            for (int i = 0; i < n_pages * PT; i++)
                prompt[i] = (int32_t)(rng(&seed) % 3);
            /* model's answer */
            int want = 0;
            for (int k = 1; k <= n_pages; k++) {
                bool found = false;
                for (int p = 0; p < R_PAGES; p++)
                    found |= depth[p] == k &&
                             !memcmp(prefix[p], prompt, sizeof(int32_t) * (size_t)(k * PT));
                if (!found)
                    break;
                want = k;
            }
            int32_t got[R_MAXP];
            int n = kv_prefix_match(px, prompt, n_pages * PT, got, R_MAXP);
            assert_int_equal(n, want);
            for (int k = 0; k < n; k++) {
                assert_int_equal(depth[got[k]], k + 1);
                assert_memory_equal(prefix[got[k]], prompt,
                                    sizeof(int32_t) * (size_t)((k + 1) * PT));
            }
            /* list the rest of the chain while pages last, then take back
             * the oldest idle childless page when none is left */
            int32_t parent = n ? got[n - 1] : -1;
            for (int k = n; k < n_pages; k++) {
                int32_t p = free_slot(depth);
                if (p < 0)
                    break;
                kv_prefix_add(px, parent, prompt + k * PT, p);
                idle_flag[p] = true;
                memcpy(prefix[p], prompt, sizeof(int32_t) * (size_t)((k + 1) * PT));
                depth[p] = k + 1;
                parent = p;
            }
            for (int k = 0; k < 2 && free_slot(depth) < 0; k++) {
                int32_t v = kv_prefix_victim(px, test_idle);
                assert_true(v >= 0);
                assert_int_equal(kv_prefix_check(px, NULL, 0), 0);
                kv_prefix_remove(px, v);
                depth[v] = 0;
            }
            check_ok(px);
        }
        kv_prefix_destroy(px);
    }
}

/* ------------------------------------------------------------------------
 * Over a pool: attach, publish, share, reclaim
 * ------------------------------------------------------------------------ */

#define CPT 4 /* tokens per page in the pool tests */

/* Append n tokens (ids from ids) to s and write their K and V as
 * fill_token(seed = id) does: bytes that depend on the token only, so two
 * sequences holding the same token hold the same bytes. */
static void feed(kv_seq *s, const int32_t *ids, int n)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(s), &l);
    int first = 0;
    assert_int_equal(kv_seq_append(s, ids, n, &first), 0);
    for (int i = 0; i < n; i++)
        fill_token(s, &l, first + i, (uint32_t)ids[i]);
}

static void pool_ok(const kv_cache *c, const kv_prefix *px)
{
    assert_cache_ok(c);
    check_ok(px);
}

static kv_prefix *make_prefix(kv_cache *c, int max_idle)
{
    char err[256] = "";
    kv_prefix *px = kv_prefix_create(c, 99, max_idle, err, sizeof(err));
    if (!px)
        fail_msg("kv_prefix_create: %s", err);
    return px;
}

/*
 * A second sequence with the same first tokens takes the first one's full
 * pages (the same page ids, no new page), stops at the first page that
 * differs, and reads exactly the bytes the first wrote; the partial last
 * page is never shared.
 */
static void test_attach_shares_pages(void **state)
{
    (void)state;
    kv_cache *c = make_cache(64 * 1024, CPT, 2, 2, 8, KV_F32);
    kv_prefix *px = make_prefix(c, 64);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    int32_t a[14], b[14];
    for (int i = 0; i < 14; i++)
        a[i] = b[i] = 10 + i;
    b[9] = 77; /* b differs in page 2 */
    kv_seq *sa = make_seq(c, none_policy(64), false);
    feed(sa, a, 14);
    assert_int_equal(kv_prefix_publish(px, sa), 3); /* 3 full pages; the 4th is partial */
    assert_int_equal(kv_prefix_publish(px, sa), 0); /* already listed */
    pool_ok(c, px);
    struct kv_stats st0;
    kv_cache_stats(c, &st0);

    kv_seq *sb = make_seq(c, none_policy(64), true);
    assert_int_equal(kv_prefix_attach(px, sb, b, 13), 2 * CPT);
    struct kv_stats st1;
    kv_cache_stats(c, &st1);
    assert_int_equal(st1.pages_used, st0.pages_used); /* nothing allocated */
    assert_int_equal(kv_seq_page_table(sb)[0], kv_seq_page_table(sa)[0]);
    assert_int_equal(kv_seq_page_table(sb)[1], kv_seq_page_table(sa)[1]);
    for (int i = 0; i < 2 * CPT; i++) {
        assert_true(token_intact(sb, &l, i, (uint32_t)b[i]));
        assert_int_equal(kv_seq_positions(sb)[i], i);
        assert_int_equal(kv_seq_tokens(sb)[i], b[i]);
    }
    const int32_t *hist;
    assert_int_equal(kv_seq_history(sb, &hist), 2 * CPT); /* a session records them */
    assert_memory_equal(hist, b, sizeof(int32_t) * 2 * CPT);
    /* nothing more to attach; then b's own tokens go on, and publish */
    assert_int_equal(kv_prefix_attach(px, sb, b, 13), 0);
    feed(sb, b + 8, 5);
    assert_int_equal(kv_prefix_publish(px, sb), 1); /* its page 2 (b's own) */
    pool_ok(c, px);
    /* a sequence whose own first page differs from the chain's, or that
     * evicted, takes nothing */
    kv_seq *sc = make_seq(c, none_policy(64), false);
    int32_t z[4] = {1, 2, 3, 4};
    feed(sc, z, 4);
    assert_int_equal(kv_prefix_attach(px, sc, a, 13), 0);
    kv_seq_destroy(sc);
    kv_seq_destroy(sa);
    kv_seq_destroy(sb);
    pool_ok(c, px);
    kv_prefix_destroy(px);
    assert_cache_ok(c);
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_int_equal(st.pages_used, 0); /* the index let go of everything */
    kv_cache_destroy(c);
}

/*
 * Eviction in one sequence drops its references only: a sink-window
 * sequence that attached a prefix evicts shared pages from its middle and
 * the other sequence, and the index, keep every byte.
 */
static void test_evict_drops_reference(void **state)
{
    (void)state;
    kv_cache *c = make_cache(64 * 1024, CPT, 2, 2, 8, KV_F32);
    kv_prefix *px = make_prefix(c, 64);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    int32_t a[40];
    for (int i = 0; i < 40; i++)
        a[i] = 200 + i;
    kv_seq *sa = make_seq(c, none_policy(64), false);
    feed(sa, a, 24);
    assert_int_equal(kv_prefix_publish(px, sa), 6);
    kv_seq *sb = make_seq(c, sink_window(16, 4, 8, true), false);
    assert_int_equal(kv_prefix_attach(px, sb, a, 12), 12);
    feed(sb, a + 12, 4); /* full: 16 */
    feed(sb, a + 16, 4); /* evicts a shared middle page */
    assert_true(kv_seq_n_tokens(sb) <= 16);
    pool_ok(c, px);
    for (int i = 0; i < 24; i++)
        assert_true(token_intact(sa, &l, i, (uint32_t)a[i]));
    /* sb evicted: it publishes nothing, and attaches nothing */
    assert_int_equal(kv_prefix_publish(px, sb), 0);
    assert_int_equal(kv_prefix_attach(px, sb, a, 40), 0);
    kv_seq_destroy(sa);
    kv_seq_destroy(sb);
    pool_ok(c, px);
    kv_prefix_destroy(px);
    kv_cache_destroy(c);
}

/*
 * Idle pages go back before anything else: a pool short of pages takes the
 * index's idle pages (the leaf first) before it drops an idle session, and
 * kv_prefix_trim keeps at most the cap.
 */
static void test_reclaim_before_sessions(void **state)
{
    (void)state;
    kv_cache *c = make_cache(64 * 1024, CPT, 2, 2, 8, KV_F32);
    int n_pages = kv_cache_n_pages(c);
    kv_prefix *px = make_prefix(c, n_pages);
    int32_t a[64];
    for (int i = 0; i < 64; i++)
        a[i] = 300 + i;
    /* an idle session holding 2 pages */
    kv_seq *sess = make_seq(c, none_policy(1 << 20), true);
    feed(sess, a, 8);
    kv_seq_touch(sess, 1);
    /* a finished request's 6 pages stay listed, idle */
    kv_seq *done = make_seq(c, none_policy(1 << 20), false);
    feed(done, a + 8, 24);
    assert_int_equal(kv_prefix_publish(px, done), 6);
    kv_seq_destroy(done);
    struct kv_prefix_stats ps;
    assert_int_equal(kv_prefix_trim(px), 0); /* under the cap; takes the gauges */
    kv_prefix_get_stats(px, &ps);
    assert_int_equal(ps.pages_idle, 6);
    assert_int_equal(kv_prefix_idle_pages(px), 6);
    /* a sequence that needs every page but the session's and 3 */
    struct kv_stats st;
    kv_cache_stats(c, &st);
    int want = (st.pages_free + 3) * CPT;
    int32_t *big = malloc(sizeof(int32_t) * (size_t)want);
    for (int i = 0; i < want; i++)
        big[i] = 5000 + i;
    kv_seq *s = make_seq(c, none_policy(1 << 20), false);
    feed(s, big, want);
    assert_false(kv_seq_dropped(sess)); /* the session kept its pages */
    kv_prefix_get_stats(px, &ps);
    assert_int_equal(ps.pages_listed, 3);
    assert_int_equal(ps.pages_reclaimed, 3);
    pool_ok(c, px);
    /* the three left are the chain's first (leaf first went) */
    int32_t got[8];
    assert_int_equal(kv_prefix_match(px, a + 8, 24, got, 8), 3);
    /* the cap: trim keeps one */
    kv_prefix_destroy(px);
    kv_seq_destroy(s);
    px = make_prefix(c, 1);
    kv_seq *t = make_seq(c, none_policy(1 << 20), false);
    feed(t, a, 16);
    assert_int_equal(kv_prefix_publish(px, t), 4);
    assert_int_equal(kv_prefix_trim(px), 0); /* in use: none idle */
    kv_seq_destroy(t);
    assert_int_equal(kv_prefix_trim(px), 3);
    assert_int_equal(kv_prefix_idle_pages(px), 1);
    assert_int_equal(kv_prefix_match(px, a, 16, got, 8), 1);
    pool_ok(c, px);
    free(big);
    kv_seq_destroy(sess);
    kv_prefix_destroy(px);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* The gauges the obvious way: every listed page's reference count read. */
static void gauges_ok(kv_cache *c, const kv_prefix *px)
{
    int idle = 0, shared = 0, listed = 0;
    uint64_t saved = 0;
    for (int32_t p = 0; p < kv_cache_n_pages(c); p++) {
        if (!kv_prefix_listed(px, p))
            continue;
        int refs = kv_page_refs(c, p); /* the index's + the sequences' */
        listed++;
        idle += refs == 1;
        shared += refs >= 3;
        saved += refs >= 3 ? (uint64_t)(refs - 2) : 0;
    }
    struct kv_prefix_stats ps;
    kv_prefix_get_stats(px, &ps);
    assert_int_equal(ps.pages_listed, listed);
    assert_int_equal(ps.pages_idle, idle);
    assert_int_equal(ps.pages_shared, shared);
    assert_int_equal(ps.page_refs_saved, saved);
    assert_int_equal(kv_prefix_idle_pages(px), idle);
    pool_ok(c, px); /* kv_cache_check recounts the pool's gauges too */
}

/*
 * The gauges (idle, shared, references saved) are kept by the pool at
 * every reference change, never surveyed: through random publishes,
 * attaches, forks, evictions, session drops, reclaims and trims on a pool
 * too small for everything, they equal a count over the listed pages after
 * every operation, and a trim leaves at most the cap idle.
 */
#define G_LIVE 6
static void test_gauges_stay_exact(void **state)
{
    (void)state;
    kv_cache *c = make_cache(24 * 1024, CPT, 2, 2, 8, KV_F32); /* 24 pages */
    const int cap = 3;
    kv_prefix *px = make_prefix(c, cap);
    kv_seq *live[G_LIVE] = {0};
    uint32_t seed = 77;
    int n_attached = 0, n_forks = 0, n_trimmed = 0;
    for (int step = 0; step < 3000; step++) {
        int slot = (int)(rng(&seed) % G_LIVE), op = (int)(rng(&seed) % 6);
        kv_seq *s = live[slot];
        if (s && (op == 0 || kv_seq_dropped(s))) { /* a request ends */
            kv_seq_destroy(s);
            live[slot] = NULL;
        } else if (!s && op <= 2) { /* a request: one of 3 system prompts + its own */
            int32_t prompt[28];
            int sys = (int)(rng(&seed) % 3), n = 12 + (int)(rng(&seed) % 17);
            for (int i = 0; i < n; i++)
                prompt[i] = i < 12 ? 1000 * (sys + 1) + i : (int32_t)(rng(&seed) % 50);
            bool evicts = rng(&seed) % 4 == 0;
            s = make_seq(c, evicts ? sink_window(16, 4, 8, true) : none_policy(64),
                         rng(&seed) % 2 == 0);
            int got = kv_prefix_attach(px, s, prompt, n - 1);
            assert_true(got >= 0);
            n_attached += got > 0;
            gauges_ok(c, px);
            int first = 0;
            if (kv_seq_append(s, prompt + got, n - got, &first) != 0) { /* pool short */
                kv_seq_destroy(s);
                gauges_ok(c, px);
                continue;
            }
            kv_seq_touch(s, (uint64_t)step);
            kv_prefix_publish(px, s);
            live[slot] = s;
        } else if (s && op == 3) { /* fork: every page one more holder */
            kv_seq *f = kv_seq_fork(s, false, NULL, 0);
            assert_non_null(f);
            int other = (slot + 1) % G_LIVE;
            kv_seq_destroy(live[other]);
            live[other] = f;
            n_forks++;
        } else if (s && op == 4) { /* decode a few tokens (may evict, may reclaim) */
            int32_t more[6];
            for (int i = 0; i < 6; i++)
                more[i] = (int32_t)(rng(&seed) % 50);
            int first = 0;
            if (kv_seq_append(s, more, 1 + (int)(rng(&seed) % 6), &first) == 0)
                kv_prefix_publish(px, s);
        } else if (op == 5) {
            int idle = kv_prefix_idle_pages(px);
            int done = kv_prefix_trim(px);
            n_trimmed += done;
            assert_int_equal(done, idle > cap ? idle - cap : 0);
            assert_true(kv_prefix_idle_pages(px) <= cap);
        }
        gauges_ok(c, px);
    }
    struct kv_prefix_stats ps;
    kv_prefix_get_stats(px, &ps);
    print_message("gauges: %d attaches, %d forks, %d trimmed, %" PRIu64 " reclaimed\n", n_attached,
                  n_forks, n_trimmed, ps.pages_reclaimed);
    /* the walk reached every path it is meant to */
    assert_true(n_attached > 0 && n_forks > 0 && n_trimmed > 0 && ps.pages_reclaimed > 0);
    for (int i = 0; i < G_LIVE; i++)
        kv_seq_destroy(live[i]);
    gauges_ok(c, px);
    kv_prefix_destroy(px);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------
 * Through the daemon: 64 requests sharing a 2,000-token prefix
 * ------------------------------------------------------------------------ */

#define N_REQ 64
#define PREFIX 2000 /* 125 pages of 16 tokens */
#define SUFFIX 8
#define GEN 8

struct shared_req {
    int port;
    int id;
    bool session;
    char text[512]; /* the answer */
    int cached;     /* usage.kvd.cached_tokens */
    int status;
};

/* The prompt of request id: the shared prefix, then SUFFIX ids of its own. */
static json_t *prompt_of(int id)
{
    json_t *a = json_array();
    uint32_t seed = 4242;
    for (int i = 0; i < PREFIX; i++)
        json_array_append_new(a, json_integer(1 + (int)(rng(&seed) % 500)));
    for (int i = 0; i < SUFFIX; i++)
        json_array_append_new(a, json_integer(1 + (id * 7 + i * 13) % 500));
    return a;
}

static void *send_one(void *arg)
{
    struct shared_req *q = arg;
    json_t *body = json_pack("{s:o, s:i, s:f, s:b}", "prompt", prompt_of(q->id), "max_tokens", GEN,
                             "temperature", 0.0, "ignore_eos", 1);
    if (q->session) {
        char sid[32];
        snprintf(sid, sizeof(sid), "shared-%d", q->id);
        json_object_set_new(body, "session", json_string(sid));
    }
    json_t *r = su_post(q->port, "/v1/completions", NULL, body, &q->status);
    json_t *text = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "text");
    snprintf(q->text, sizeof(q->text), "%s",
             json_string_value(text) ? json_string_value(text) : "");
    q->cached = (int)json_integer_value(
        json_object_get(json_object_get(json_object_get(r, "usage"), "kvd"), "cached_tokens"));
    json_decref(r);
    return NULL;
}

static int start(struct su_proc *p, const char *name, const char *prefix_cache)
{
    snprintf(p->log, sizeof(p->log), "%s/%s.log", tmpdir, name);
    char set[64];
    snprintf(set, sizeof(set), "cache.prefix_cache=%s", prefix_cache);
    const char *args[] = {"--set", set,
                          "--set", "cache.memory=64MiB",
                          "--set", "eviction.policy=none",
                          "--set", "eviction.max_cache_tokens=4096"};
    return su_serve(p, kvd_bin, model_path, args, 8);
}

/*
 * The test. One server with the prefix cache, one without, each
 * answering 64 session requests whose prompts share their first 2,000
 * tokens: the first alone, then 63 at once. With the cache, every request
 * after the first attaches the 2,000 tokens (usage.kvd.cached_tokens), the
 * server prefilled exactly that much less (kvd_prompt_tokens_total), the
 * greedy answers are those of the server without it, sent one at a time,
 * and the 64 sessions hold one copy of the prefix's 125 pages between
 * them, where the other server holds 64.
 */
static void test_64_share_a_prefix(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc on = {0}, off = {0};
    assert_int_equal(start(&on, "on", "on"), 0);
    assert_int_equal(start(&off, "off", "off"), 0);
    static struct shared_req a[N_REQ], b[N_REQ];
    pthread_t th[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        a[i] = (struct shared_req){.port = on.port, .id = i, .session = true};
        b[i] = (struct shared_req){.port = off.port, .id = i, .session = true};
    }
    send_one(&a[0]);
    for (int i = 1; i < N_REQ; i++)
        assert_int_equal(pthread_create(&th[i], NULL, send_one, &a[i]), 0);
    for (int i = 1; i < N_REQ; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < N_REQ; i++) /* each alone */
        send_one(&b[i]);

    for (int i = 0; i < N_REQ; i++) {
        assert_int_equal(a[i].status, 200);
        assert_int_equal(b[i].status, 200);
        assert_int_equal(a[i].cached, i == 0 ? 0 : PREFIX);
        assert_int_equal(b[i].cached, 0);
        if (strcmp(a[i].text, b[i].text) != 0)
            fail_msg("request %d: '%s' with the prefix cache, '%s' without", i, a[i].text,
                     b[i].text);
    }
    double pf_on = su_metric(on.port, "kvd_prompt_tokens_total");
    double pf_off = su_metric(off.port, "kvd_prompt_tokens_total");
    print_message("prefilled tokens: %.0f with the prefix cache, %.0f without\n", pf_on, pf_off);
    assert_true(pf_off == (double)N_REQ * (PREFIX + SUFFIX));
    assert_true(pf_on == pf_off - (double)(N_REQ - 1) * PREFIX);
    assert_true(su_metric(on.port, "kvd_prefix_cache_hit_tokens_total") ==
                (double)(N_REQ - 1) * PREFIX);

    /* memory: one copy of the prefix among 64 sessions, 64 without */
    double used_on = su_metric(on.port, "kvd_kv_pages_used");
    double used_off = su_metric(off.port, "kvd_kv_pages_used");
    double page = su_metric(on.port, "kvd_kv_page_bytes");
    print_message("pages used by 64 sessions: %.0f with the prefix cache, %.0f without\n", used_on,
                  used_off);
    int prefix_pages = PREFIX / 16, tail = (SUFFIX + GEN + 15) / 16 + 1;
    assert_true(used_off >= (double)N_REQ * prefix_pages);
    assert_true(used_on <= (double)(prefix_pages + N_REQ * tail));
    assert_true(su_metric(on.port, "kvd_prefix_cache_saved_bytes") ==
                (double)(N_REQ - 1) * prefix_pages * page);

    /* without a session, too: the same answers, the prefix attached */
    for (int i = 0; i < 4; i++) {
        struct shared_req x = {.port = on.port, .id = 100 + i},
                          y = {.port = off.port, .id = 100 + i};
        send_one(&x);
        send_one(&y);
        assert_int_equal(x.status, 200);
        assert_int_equal(x.cached, PREFIX);
        assert_string_equal(x.text, y.text);
    }
    assert_int_equal(su_stop(&on, SIGTERM, 30), 0);
    assert_int_equal(su_stop(&off, SIGTERM, 30), 0);
}

/* With prefix_cache_share = 0 nothing is kept once no request uses it; a
 * share past 100 is refused. */
static void test_share_cap_zero(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc p = {0};
    snprintf(p.log, sizeof(p.log), "%s/cap0.log", tmpdir);
    const char *args[] = {"--set", "cache.prefix_cache_share=0"};
    assert_int_equal(su_serve(&p, kvd_bin, model_path, args, 2), 0);
    for (int i = 0; i < 2; i++) {
        struct shared_req x = {.port = p.port, .id = i};
        send_one(&x);
        assert_int_equal(x.status, 200);
        assert_int_equal(x.cached, 0);
    }
    assert_true(su_metric(p.port, "kvd_prefix_cache_pages") == 0);
    assert_true(su_metric(p.port, "kvd_kv_pages_used") == 0);
    assert_true(su_metric(p.port, "kvd_prefix_cache_reclaimed_pages_total") > 0);
    assert_int_equal(su_stop(&p, SIGTERM, 30), 0);
    assert_true(su_file_has(p.log, "up to 0 idle pages"));

    /* the keys are validated, naming file, line and key */
    char conf[600], cmd[1400], out[600] = "";
    snprintf(conf, sizeof(conf), "%s/bad.conf", tmpdir);
    FILE *f = fopen(conf, "w");
    assert_non_null(f);
    fprintf(f, "[cache]\nprefix_cache = on\nprefix_cache_share = 101\n");
    fclose(f);
    snprintf(cmd, sizeof(cmd), "%s check-config %s 2>&1", kvd_bin, conf);
    FILE *pp = popen(cmd, "r");
    assert_non_null(pp);
    size_t n = fread(out, 1, sizeof(out) - 1, pp);
    out[n] = '\0';
    assert_int_not_equal(pclose(pp), 0);
    assert_non_null(strstr(out, "bad.conf:3"));
    assert_non_null(strstr(out, "prefix_cache_share"));
}

/* ------------------------------------------------------------------------
 * The chains' root is the model's fingerprint
 * ------------------------------------------------------------------------ */

/* The fingerprint an engine with the prefix cache roots its chains at,
 * over the model file at path with K and V in kv_type. */
static uint64_t engine_root(const char *path, enum kv_type kv_type)
{
    char err[512];
    struct model_params mp = {.path = path};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m)
        fail_msg("model_load %s: %s", path, err);
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = kv_type, .v_type = kv_type};
    model_kv_shape(m, &shape);
    struct engine_params p = {
        .m = m,
        .cache_memory = kv_cache_memory_for(&shape, 32),
        .page_tokens = 16,
        .k_type = kv_type,
        .v_type = kv_type,
        .n_threads = 1,
        .prefix_cache = true,
        .prefix_cache_share = 50,
        .limits = {.policy = none_policy(256), .max_running = 2, .step_tokens = 64},
    };
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    struct engine_stats st;
    engine_get_stats(e, &st);
    assert_true(st.prefix_on);
    /* one owner: the model's fingerprint with the K and V types, as a
     * saved session carries it */
    assert_true(st.prefix.fingerprint == spill_fingerprint(model_fingerprint(m), kv_type, kv_type));
    engine_destroy(e);
    model_free(m);
    return st.prefix.fingerprint;
}

/* Copy src to dst with the file's last byte changed: the last tensor's
 * last weight, when (as in the scratch model) no padding follows it. */
static void copy_with_last_byte_changed(const char *src, const char *dst)
{
    FILE *in = fopen(src, "rb"), *out = fopen(dst, "wb");
    assert_non_null(in);
    assert_non_null(out);
    char buf[1 << 16];
    size_t n, total = 0;
    while ((n = fread(buf, 1, sizeof(buf), in)) > 0) {
        assert_int_equal(fwrite(buf, 1, n, out), n);
        total += n;
    }
    fclose(in);
    assert_true(total > 0);
    assert_int_equal(fseek(out, -1, SEEK_END), 0);
    long at = ftell(out);
    FILE *again = fopen(src, "rb");
    assert_non_null(again);
    assert_int_equal(fseek(again, at, SEEK_SET), 0);
    int last = fgetc(again);
    fclose(again);
    fputc(last ^ 0x40, out);
    assert_int_equal(fclose(out), 0);
}

/*
 * Two models alike in architecture, name, weight type and every shape,
 * whose weights differ in one byte, root their chains apart, so no page one
 * computed can match a prompt of the other (test_match_longest: the same
 * tokens under another root match nothing); the same file loaded twice
 * roots them alike, and the K and V type counts.
 */
static void test_models_never_share(void **state)
{
    (void)state;
    char other[600];
    snprintf(other, sizeof(other), "%s/other.gguf", tmpdir);
    copy_with_last_byte_changed(model_path, other);
    uint64_t a = engine_root(model_path, KV_F32), a2 = engine_root(model_path, KV_F32);
    uint64_t b = engine_root(other, KV_F32), a16 = engine_root(model_path, KV_F16);
    assert_true(a == a2);
    assert_true(a != b);
    assert_true(a != a16);
}

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("prefix", 19, false);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_match_longest),
        cmocka_unit_test(test_collisions),
        cmocka_unit_test(test_generation),
        cmocka_unit_test(test_lru_leaf_first),
        cmocka_unit_test(test_random_against_model),
        cmocka_unit_test(test_attach_shares_pages),
        cmocka_unit_test(test_evict_drops_reference),
        cmocka_unit_test(test_reclaim_before_sessions),
        cmocka_unit_test(test_gauges_stay_exact),
    };
    const struct CMUnitTest served[] = {
        cmocka_unit_test(test_64_share_a_prefix),
        cmocka_unit_test(test_share_cap_zero),
        cmocka_unit_test(test_models_never_share),
    };
    int bad = cmocka_run_group_tests(tests, NULL, NULL);
    return bad + cmocka_run_group_tests(served, group_setup, group_teardown);
}
