/*
 * test_prefix.c - the automatic prefix cache (cache/prefix.c): the index of
 * full pages by hash chain, its collision safety and its LRU of idle pages,
 * first on its own, then inside a real pool (shared pages, reclaim before
 * anything else gives way, the share cap).
 *
 * White-box: the index's calls are cache_internal.h's.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cache/cache_internal.h"
#include "cache/kv_cache.h"

#define PT 4 /* tokens per page in the index tests */

static uint32_t rng(uint32_t *s)
{
    uint32_t x = *s;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *s = x;
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
    kv_prefix *px = kv_prefix_create(16, PT, 42, 16);
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
    kv_prefix *other = kv_prefix_create(16, PT, 43, 16);
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
    kv_prefix *px = kv_prefix_create(16, PT, 1, 16);
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
    kv_prefix *px = kv_prefix_create(8, PT, 7, 8);
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
    kv_prefix *px = kv_prefix_create(8, PT, 9, 8);
    assert_non_null(px);
    int32_t a[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    add_chain(px, a, (int32_t[]){0, 1, 2}, 3);
    assert_int_equal(kv_prefix_victim(px), -1); /* nothing idle */
    /* the root idles first (oldest), but has a child: the leaf goes first */
    kv_prefix_set_idle(px, 0, true);
    kv_prefix_set_idle(px, 1, true);
    assert_int_equal(kv_prefix_victim(px), -1); /* 2 is busy: 0 and 1 have children */
    kv_prefix_set_idle(px, 2, true);
    assert_int_equal(kv_prefix_n_idle(px), 3);
    check_ok(px);
    assert_int_equal(kv_prefix_victim(px), 2);
    kv_prefix_remove(px, 2);
    assert_int_equal(kv_prefix_victim(px), 1);
    kv_prefix_remove(px, 1);
    /* a busy entry is not on the LRU */
    kv_prefix_set_idle(px, 0, false);
    assert_int_equal(kv_prefix_victim(px), -1);
    assert_int_equal(kv_prefix_n_idle(px), 0);
    kv_prefix_set_idle(px, 0, true);
    assert_int_equal(kv_prefix_victim(px), 0);
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
    for (int mask_bits = 0; mask_bits <= 2; mask_bits += 2) {
        uint32_t seed = 12345u + (uint32_t)mask_bits;
        kv_prefix *px = kv_prefix_create(R_PAGES, PT, 5, R_PAGES);
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
                assert_memory_equal(prefix[got[k]], prompt, sizeof(int32_t) * (size_t)((k + 1) * PT));
            }
            /* list the rest of the chain while pages last, then take back
             * the oldest idle childless page when none is left */
            int32_t parent = n ? got[n - 1] : -1;
            for (int k = n; k < n_pages; k++) {
                int32_t p = free_slot(depth);
                if (p < 0)
                    break;
                kv_prefix_add(px, parent, prompt + k * PT, p);
                kv_prefix_set_idle(px, p, true);
                memcpy(prefix[p], prompt, sizeof(int32_t) * (size_t)((k + 1) * PT));
                depth[p] = k + 1;
                parent = p;
            }
            for (int k = 0; k < 2 && free_slot(depth) < 0; k++) {
                int32_t v = kv_prefix_victim(px);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_match_longest),
        cmocka_unit_test(test_collisions),
        cmocka_unit_test(test_generation),
        cmocka_unit_test(test_lru_leaf_first),
        cmocka_unit_test(test_random_against_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
