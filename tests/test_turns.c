/*
 * test_turns.c - turn-aware eviction (cache/turns.c): a sequence with a
 * turn table gives up whole turns, oldest first, in place.
 *
 *   - the survivors are exactly the pinned tokens and the newest turns, in
 *     order, and their K/V bytes are the bytes written at append (nothing
 *     is recomputed or rewritten, only moved);
 *   - positions renumber or stay as the policy says;
 *   - the low-water mark, open turns (not yet appended whole), the cut
 *     fallback (counted), truncation, drops and a bad table;
 *   - a randomized run whose every state keeps the rules.
 *
 * White-box where it helps (cache_internal.h for kv_cache_check's partner
 * state).
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

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static uint32_t mix(uint32_t a, uint32_t b)
{
    uint32_t h = a * 0x9e3779b1u ^ (b + 0x7f4a7c15u + (a << 6) + (a >> 2));
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    return h;
}

/* The byte a token with history index hidx has at byte b of a row. */
static uint8_t row_byte(int32_t hidx, int layer, int head, int v, size_t b)
{
    return (uint8_t)(mix(mix((uint32_t)hidx, (uint32_t)(layer * 31 + head * 7 + v)),
                         (uint32_t)b) >> 24);
}

static kv_cache *make_cache(int pt, int pages)
{
    struct kv_cache_params p = {
        .page_tokens = pt, .n_layer = 2, .n_kv_head = 2, .head_dim = 8, .k_type = KV_F32,
        .v_type = KV_F16};
    p.memory_bytes = kv_cache_memory_for(&p, pages);
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        print_message("kv_cache_create: %s\n", err);
    assert_non_null(c);
    return c;
}

static kv_seq *make_seq(kv_cache *c, enum kv_policy_kind kind, int max, bool renumber)
{
    struct kv_policy pol = {.kind = kind, .max_cache_tokens = max, .sink_tokens = 4,
                            .window_tokens = 8, .renumber = renumber};
    char err[256];
    kv_seq *s = kv_seq_create(c, &pol, true, err, sizeof(err));
    if (!s)
        print_message("kv_seq_create: %s\n", err);
    assert_non_null(s);
    return s;
}

/* Append n tokens (ids 1000 + history index) and write their rows. */
static int append(kv_seq *s, int n)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(s), &l);
    int32_t ids[512];
    assert_true(n <= 512);
    int h0 = kv_seq_history(s, NULL);
    for (int i = 0; i < n; i++)
        ids[i] = 1000 + h0 + i;
    int first, rc = kv_seq_append(s, ids, n, &first);
    if (rc)
        return rc;
    const int32_t *hidx = kv_seq_hist_index(s);
    for (int i = first; i < first + n; i++)
        for (int layer = 0; layer < l.n_layer; layer++)
            for (int h = 0; h < l.n_kv_head; h++)
                for (int v = 0; v < 2; v++) {
                    uint8_t *row = v ? kv_seq_v(s, layer, h, i) : kv_seq_k(s, layer, h, i);
                    size_t len = v ? l.v_row_bytes : l.k_row_bytes;
                    for (size_t b = 0; b < len; b++)
                        row[b] = row_byte(hidx[i], layer, h, v, b);
                }
    return 0;
}

/* Every retained token: id and bytes as written at its append; the cache
 * consistent. */
static void check_bytes(kv_seq *s)
{
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(s), &l);
    const int32_t *hidx = kv_seq_hist_index(s), *ids = kv_seq_tokens(s);
    for (int i = 0; i < kv_seq_n_tokens(s); i++) {
        assert_int_equal(ids[i], 1000 + hidx[i]);
        for (int layer = 0; layer < l.n_layer; layer++)
            for (int h = 0; h < l.n_kv_head; h++)
                for (int v = 0; v < 2; v++) {
                    const uint8_t *row = v ? kv_seq_v(s, layer, h, i) : kv_seq_k(s, layer, h, i);
                    size_t len = v ? l.v_row_bytes : l.k_row_bytes;
                    for (size_t b = 0; b < len; b++)
                        if (row[b] != row_byte(hidx[i], layer, h, v, b))
                            fail_msg("token %d (history %d) layer %d head %d %s byte %zu "
                                     "changed",
                                     i, hidx[i], layer, h, v ? "V" : "K", b);
                }
    }
    char err[256];
    if (kv_cache_check(kv_seq_cache(s), err, sizeof(err)) != 0)
        fail_msg("kv_cache_check: %s", err);
}

/* The retained history indices equal want[0..n). */
static void check_retained(kv_seq *s, const int32_t *want, int n)
{
    assert_int_equal(kv_seq_n_tokens(s), n);
    const int32_t *hidx = kv_seq_hist_index(s);
    for (int i = 0; i < n; i++)
        if (hidx[i] != want[i])
            fail_msg("retained[%d]: history %d, want %d", i, hidx[i], want[i]);
}

/* Fill out with history indices [a, b); returns the new count. */
static int range(int32_t *out, int n, int a, int b)
{
    for (int h = a; h < b; h++)
        out[n++] = h;
    return n;
}

static void set_turns(kv_seq *s, const struct kv_turn *t, int n, int low)
{
    char err[256];
    int rc = kv_seq_set_turns(s, t, n, low, err, sizeof(err));
    if (rc)
        fail_msg("kv_seq_set_turns: %s", err);
}

/* ------------------------------------------------------------------------
 * Tests
 * ------------------------------------------------------------------------ */

/*
 * A conversation: system 6 tokens [0,6), turns [6,13) [13,22) [22,27), the
 * last user turn [27,35). Budget 40. Appending 10 more tokens must take
 * the oldest turn whole and nothing else; then 9 more the next one.
 */
static void test_oldest_turn_leaves_whole(void **state)
{
    (void)state;
    kv_cache *c = make_cache(4, 64);
    kv_seq *s = make_seq(c, KV_EVICT_SINK_WINDOW, 40, true);
    struct kv_turn t[] = {{6, 7, 2}, {13, 9, 2}, {22, 5, 3}};
    assert_int_equal(append(s, 35), 0);
    set_turns(s, t, 3, 0);
    assert_int_equal(kv_seq_max_append(s), 40 - 35 + 7 + 9 + 5);

    assert_int_equal(append(s, 10), 0); /* 45 > 40: turn 0 (7 tokens) leaves */
    int32_t want[64];
    int n = range(want, 0, 0, 6);
    n = range(want, n, 13, 45);
    check_retained(s, want, n);
    check_bytes(s);
    const int32_t *pos = kv_seq_positions(s);
    for (int i = 0; i < n; i++)
        assert_int_equal(pos[i], i); /* renumbered */
    assert_int_equal(kv_seq_next_pos(s), n);

    struct kv_turn_state st;
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns, 3);
    assert_int_equal(st.turns_evicted, 1);
    assert_int_equal(st.messages_evicted, 2);
    assert_int_equal(st.turns_cut, 0);

    assert_int_equal(append(s, 9), 0); /* 47 > 40: turn 1 (9 tokens) leaves */
    n = range(want, 0, 0, 6);
    n = range(want, n, 22, 54);
    check_retained(s, want, n);
    check_bytes(s);
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns_evicted, 2);
    assert_int_equal(st.messages_evicted, 4);

    struct kv_stats ks;
    kv_cache_stats(c, &ks);
    assert_int_equal(ks.turns_evicted, 2);
    assert_int_equal(ks.turn_cuts, 0);
    assert_int_equal(ks.tokens_evicted, 16);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/* preserve: survivors keep their first positions; the next continues. */
static void test_positions_preserved(void **state)
{
    (void)state;
    kv_cache *c = make_cache(4, 64);
    kv_seq *s = make_seq(c, KV_EVICT_SINK_WINDOW, 40, false);
    struct kv_turn t[] = {{6, 7, 2}, {13, 9, 2}};
    assert_int_equal(append(s, 30), 0);
    set_turns(s, t, 2, 0);
    assert_int_equal(append(s, 15), 0);
    const int32_t *pos = kv_seq_positions(s), *hidx = kv_seq_hist_index(s);
    assert_int_equal(kv_seq_n_tokens(s), 45 - 7);
    for (int i = 0; i < kv_seq_n_tokens(s); i++)
        assert_int_equal(pos[i], hidx[i]);
    assert_int_equal(kv_seq_next_pos(s), 45);
    check_bytes(s);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/* Once turns must go they go down to the low-water mark; a turn whose
 * tokens are not all appended yet stays. */
static void test_low_water_and_open_turns(void **state)
{
    (void)state;
    kv_cache *c = make_cache(4, 64);
    kv_seq *s = make_seq(c, KV_EVICT_NONE, 60, true);
    struct kv_turn t[] = {{4, 10, 2}, {14, 10, 2}, {24, 10, 2}, {34, 10, 2}, {50, 20, 2}};
    assert_int_equal(append(s, 44), 0);
    set_turns(s, t, 5, 30);
    assert_int_equal(append(s, 10), 0); /* 54 <= 60: nothing leaves */
    assert_int_equal(kv_seq_n_tokens(s), 54);
    assert_int_equal(append(s, 8), 0); /* 62 > 60: down to <= 30, then 8 more */
    int32_t want[80];
    int n = range(want, 0, 0, 4);
    n = range(want, n, 34, 62);
    check_retained(s, want, n);
    check_bytes(s);
    /* turn 4 [50,70) is open: only 62 appended; not evictable, so the room
     * whole turns can make is what is left beside it */
    assert_int_equal(kv_seq_max_append(s), 60 - (n - 10));
    assert_int_equal(append(s, 8), 0); /* 40 + 8 = 48 */
    assert_int_equal(kv_seq_n_tokens(s), 40);
    struct kv_turn_state st;
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns_evicted, 3);
    assert_int_equal(st.turns_cut, 0);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/* When whole turns cannot make the room, the policy cuts, and says so. */
static void test_cut_is_counted(void **state)
{
    (void)state;
    kv_cache *c = make_cache(4, 64);
    kv_seq *s = make_seq(c, KV_EVICT_SINK_WINDOW, 40, true);
    struct kv_turn t[] = {{8, 6, 2}};
    assert_int_equal(append(s, 36), 0);
    set_turns(s, t, 1, 0);
    /* 36 + 12 > 40 and the turn frees only 6: sink-window evicts pages */
    assert_int_equal(append(s, 12), 0);
    assert_true(kv_seq_n_tokens(s) <= 40);
    struct kv_stats ks;
    kv_cache_stats(c, &ks);
    assert_int_equal(ks.turn_cuts, 1);
    assert_int_equal(ks.turns_evicted, 0);
    struct kv_turn_state st;
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns_cut + st.turns_evicted, 1);
    check_bytes(s);

    /* policy none cannot cut: the append is refused, nothing changed */
    kv_seq *x = make_seq(c, KV_EVICT_NONE, 40, true);
    assert_int_equal(append(x, 36), 0);
    set_turns(x, t, 1, 0);
    assert_int_equal(append(x, 12), -ENOSPC);
    assert_int_equal(kv_seq_n_tokens(x), 36);
    assert_int_equal(append(x, 10), 0); /* the turn (6) makes room for 10 */
    assert_int_equal(kv_seq_n_tokens(x), 40);
    kv_seq_destroy(x);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/* Bad tables are refused with the old one kept; truncation and drops. */
static void test_table_rules(void **state)
{
    (void)state;
    kv_cache *c = make_cache(4, 64);
    kv_seq *s = make_seq(c, KV_EVICT_NONE, 40, true);
    char err[256];
    struct kv_turn good[] = {{4, 6, 2}, {10, 6, 2}};
    set_turns(s, good, 2, 0);
    struct kv_turn overlap[] = {{4, 6, 2}, {9, 6, 2}};
    assert_int_equal(kv_seq_set_turns(s, overlap, 2, 0, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "turns[1]"));
    struct kv_turn empty[] = {{4, 0, 2}};
    assert_int_equal(kv_seq_set_turns(s, empty, 1, 0, err, sizeof(err)), -EINVAL);
    struct kv_turn neg[] = {{-1, 3, 2}};
    assert_int_equal(kv_seq_set_turns(s, neg, 1, 0, err, sizeof(err)), -EINVAL);
    assert_int_equal(kv_seq_set_turns(s, NULL, 2, 0, err, sizeof(err)), -EINVAL);
    struct kv_turn_state st;
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns, 2);

    /* truncation inside turn 1 drops it; turn 0 stays */
    assert_int_equal(append(s, 20), 0);
    assert_int_equal(kv_seq_truncate(s, 12), 0);
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns, 1);
    /* n = 0 clears: policy none refuses again */
    set_turns(s, NULL, 0, 0);
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns, 0);
    assert_int_equal(kv_seq_max_append(s), 40 - 12);

    /* an LRU drop takes the table with the pages */
    set_turns(s, good, 2, 0);
    kv_seq_pin(s, false);
    kv_seq *big = make_seq(c, KV_EVICT_NONE, 64 * 4, true);
    assert_int_equal(append(big, 64 * 4 - 4), 0);
    assert_true(kv_seq_dropped(s));
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns, 0);
    kv_seq_destroy(big);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

/*
 * A long conversation: turns of random sizes appended one after another,
 * each new turn entering the table once appended (as a chat engine does
 * request by request). In every state: the pinned system prompt is whole,
 * every turn is either wholly retained or wholly gone, the gone ones are
 * the oldest, the budget holds, the bytes are the appended ones, and the
 * pool's pages stay bounded.
 */
static void test_long_conversation(void **state)
{
    (void)state;
    kv_cache *c = make_cache(16, 40);
    kv_seq *s = make_seq(c, KV_EVICT_SINK_WINDOW, 256, true);
    uint32_t rng = 12345;
    enum { TURNS = 400 };
    struct kv_turn *t = calloc(TURNS, sizeof(*t));
    assert_int_equal(append(s, 20), 0); /* system prompt */
    int max_pages = 0;
    for (int k = 0; k < TURNS; k++) {
        rng = mix(rng, (uint32_t)k);
        int len = 5 + (int)(rng % 60);
        t[k] = (struct kv_turn){.hist_start = kv_seq_history(s, NULL), .n_tokens = len,
                                .n_messages = 2};
        /* the new turn arrives as the pinned last turn (not in the table);
         * the turns before it become evictable */
        set_turns(s, t, k, k % 2 ? 200 : 0);
        int rc = append(s, len);
        if (rc)
            fail_msg("turn %d (%d tokens): append failed %d", k, len, rc);
        assert_true(kv_seq_n_tokens(s) <= 256);
        /* system whole, each turn whole or gone, gone ones oldest */
        const int32_t *hidx = kv_seq_hist_index(s);
        for (int i = 0; i < 20; i++)
            assert_int_equal(hidx[i], i);
        struct kv_turn_state st;
        kv_seq_turn_state(s, &st);
        assert_int_equal(st.turns_cut, 0);
        int retained = 20 + len;
        for (int j = st.turns_evicted; j < k; j++)
            retained += t[j].n_tokens;
        assert_int_equal(kv_seq_n_tokens(s), retained);
        if (kv_seq_n_pages(s) > max_pages)
            max_pages = kv_seq_n_pages(s);
        if (k % 50 == 0)
            check_bytes(s);
    }
    check_bytes(s);
    struct kv_stats ks;
    kv_cache_stats(c, &ks);
    assert_int_equal(ks.turn_cuts, 0);
    assert_true(ks.turns_evicted > 300);
    assert_true(max_pages <= 256 / 16 + 1);
    print_message("%d turns: %llu evicted in place in %llu steps; at most %d pages\n", TURNS,
                  (unsigned long long)ks.turns_evicted, (unsigned long long)ks.evictions,
                  max_pages);
    free(t);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_oldest_turn_leaves_whole),
        cmocka_unit_test(test_positions_preserved),
        cmocka_unit_test(test_low_water_and_open_turns),
        cmocka_unit_test(test_cut_is_counted),
        cmocka_unit_test(test_table_rules),
        cmocka_unit_test(test_long_conversation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
