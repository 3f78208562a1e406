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
 *   - a randomized run whose every state keeps the rules;
 *   - the guarantee that matters to a chat client: a conversation cut at
 *     its turns (tpl_chat_turns, srv_chat_turns_tokenize), fed to a
 *     sequence that must evict, retains exactly the tokens of the
 *     template's rendering of the messages it kept, for every separable
 *     template of tests/cases/templates; the others are named unseparable
 *     with a reason (Llama 2 folds the system prompt into the first turn);
 *   - a last turn larger than the window is cut from its middle, its
 *     header and its end kept.
 *
 * White-box where it helps (cache_internal.h for kv_cache_check's partner
 * state).
 */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/cache_model.h"
#include "model/model.h"
#include "server/chat_turns.h"
#include "template/template.h"

/* ------------------------------------------------------------------------
 * Helpers (cache_model.h: token contents, constructors)
 * ------------------------------------------------------------------------ */

static kv_cache *turn_cache(int pt, int pages)
{
    struct kv_cache_params p = {.page_tokens = pt, .n_layer = 2, .n_kv_head = 2, .head_dim = 8,
                                .k_type = KV_F32, .v_type = KV_F16};
    return make_cache2(kv_cache_memory_for(&p, pages), pt, 2, 2, 8, KV_F32, KV_F16);
}

/* A session under a policy of `kind` (sinks 4, window 8). */
static kv_seq *turn_seq(kv_cache *c, enum kv_policy_kind kind, int max, bool renumber)
{
    struct kv_policy pol = kind == KV_EVICT_NONE ? none_policy(max)
                                                 : sink_window(max, 4, 8, renumber);
    pol.renumber = renumber;
    return make_seq(c, pol, true);
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
        fill_token(s, &l, i, (uint32_t)hidx[i]); /* the row's bytes follow its history index */
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
        if (!token_intact(s, &l, i, (uint32_t)hidx[i]))
            fail_msg("token %d (history %d): its K/V bytes changed", i, hidx[i]);
    }
    assert_cache_ok(kv_seq_cache(s));
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
    kv_cache *c = turn_cache(4, 64);
    kv_seq *s = turn_seq(c, KV_EVICT_SINK_WINDOW, 40, true);
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
    kv_cache *c = turn_cache(4, 64);
    kv_seq *s = turn_seq(c, KV_EVICT_SINK_WINDOW, 40, false);
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
    kv_cache *c = turn_cache(4, 64);
    kv_seq *s = turn_seq(c, KV_EVICT_NONE, 60, true);
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
    kv_cache *c = turn_cache(4, 64);
    kv_seq *s = turn_seq(c, KV_EVICT_SINK_WINDOW, 40, true);
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
    kv_seq *x = turn_seq(c, KV_EVICT_NONE, 40, true);
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
    kv_cache *c = turn_cache(4, 64);
    kv_seq *s = turn_seq(c, KV_EVICT_NONE, 40, true);
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
    kv_seq *big = turn_seq(c, KV_EVICT_NONE, 64 * 4, true);
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
    kv_cache *c = turn_cache(16, 40);
    kv_seq *s = turn_seq(c, KV_EVICT_SINK_WINDOW, 256, true);
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


/* ------------------------------------------------------------------------
 * The retained tokens are the rendering of the retained messages
 * ------------------------------------------------------------------------ */

static const char *shared_dir(void)
{
    const char *s = getenv("KVD_SHARED");
    return s && *s ? s : "../shared";
}

static char *read_text(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[n] = 0;
        *len = (size_t)n;
    }
    return buf;
}

/* A conversation: a system prompt, `turns` user/assistant pairs of varied
 * lengths, and a last user message. */
static json_t *conversation(int turns)
{
    json_t *msgs = json_array();
    json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "system", "content",
                                          "You are a terse assistant. Answer in one line."));
    static const char *const words[] = {"tell", "me", "about", "the", "sea", "and", "why",
                                        "ships", "float", "on", "it", "today"};
    for (int t = 0; t <= turns; t++) {
        char u[200] = "", a[240] = ""; /* "Answer N: " + u */
        for (int w = 0; w < 3 + (t * 7) % 11; w++) {
            strcat(u, words[(t + w) % 12]);
            strcat(u, " ");
        }
        snprintf(a, sizeof a, "Answer %d: %s", t, u);
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", u));
        if (t < turns)
            json_array_append_new(msgs,
                                  json_pack("{s:s,s:s}", "role", "assistant", "content", a));
    }
    return msgs;
}

/*
 * Feed the cut prompt to a session sequence whose budget forces turns out
 * (in chunks, as an engine prefills), then compare what it retains with the
 * tokenization of the rendering of the messages it kept. Returns the turns
 * evicted.
 */
static int check_retained_is_rendering(const model *m, const tpl_chat *chat, const json_t *msgs,
                                       const struct srv_chat_turns *p, const char *name)
{
    int pinned = p->n_ids;
    for (int i = 0; i < p->n_turns; i++)
        pinned -= p->turns[i].n_tokens;
    kv_cache *c = turn_cache(16, (pinned + p->n_ids) / 16 + 8);
    kv_seq *s = turn_seq(c, KV_EVICT_SINK_WINDOW, pinned + (p->n_ids - pinned) / 3 + 32, true);
    char err[256];
    assert_int_equal(kv_seq_set_turns(s, p->turns, p->n_turns, 0, err, sizeof(err)), 0);
    for (int at = 0; at < p->n_ids;) {
        int chunk = p->n_ids - at < 13 ? p->n_ids - at : 13;
        if (chunk > kv_seq_max_append(s))
            chunk = kv_seq_max_append(s);
        assert_true(chunk > 0);
        assert_int_equal(kv_seq_append(s, p->ids + at, chunk, NULL), 0);
        at += chunk;
    }
    struct kv_turn_state st;
    kv_seq_turn_state(s, &st);
    assert_int_equal(st.turns_cut, 0);
    assert_true(st.turns_evicted > 0);

    /* the messages kept: all but the first turns_evicted turns */
    json_t *kept = json_array();
    int turn = -1;
    for (size_t i = 0; i < json_array_size(msgs); i++) {
        json_t *msg = json_array_get(msgs, i);
        if (!strcmp(json_string_value(json_object_get(msg, "role")), "user"))
            turn++;
        if (turn < 0 || turn >= st.turns_evicted)
            json_array_append(kept, msg);
    }
    char *text = NULL;
    size_t len = 0;
    struct tpl_error e;
    assert_int_equal(tpl_chat_render(chat, kept, NULL, true, 0, &text, &len, &e), 0);
    int n = model_tokenize_special(m, text, len, model_add_bos(m), NULL, 0);
    int32_t *want = malloc(sizeof(int32_t) * (size_t)n);
    assert_int_equal(model_tokenize_special(m, text, len, model_add_bos(m), want, n), n);
    if (kv_seq_n_tokens(s) != n)
        fail_msg("%s: %d tokens retained, the rendering of the %zu kept messages has %d", name,
                 kv_seq_n_tokens(s), json_array_size(kept), n);
    const int32_t *got = kv_seq_tokens(s);
    for (int i = 0; i < n; i++)
        if (got[i] != want[i])
            fail_msg("%s: retained token %d is %d, the rendering's is %d", name, i, got[i],
                     want[i]);
    free(want);
    free(text);
    json_decref(kept);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
    return st.turns_evicted;
}

/* The phi-3 vocabulary from the shared folder (skips the test without it). */
static model *phi3_vocab(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-phi-3.gguf", shared_dir());
    char err[512];
    struct model_params mp = {.path = path, .vocab_only = true};
    model *m = model_load(&mp, err, sizeof err);
    if (!m) {
        print_message("%s absent (%s): set KVD_SHARED to the shared data folder\n", path, err);
        skip();
    }
    return m;
}

static void test_retained_tokens_are_the_rendering(void **state)
{
    (void)state;
    model *m = phi3_vocab();
    /* With the phi-3 vocabulary, whose control tokens are phi-3's: other
     * families' markers are plain text to it, and a cut between two of
     * them may not be a token boundary (counted as not separable, with
     * the token where the two tokenizations part). */
    static const char *const separable[] = {"chatml-openhermes", "qwen2.5", "zephyr",
                                            "granite-3.0", "vicuna", "deepseek-coder",
                                            "openchat", NULL};
    /* the system prompt folded into the first turn (llama-2, mistral-v0.2,
     * and the system-less gemma and phi-3-mini); the latest assistant
     * message rendered apart (qwen3); a generation header written whatever
     * add_generation_prompt says (this llama-3 variant) */
    static const char *const not_separable[] = {"llama-2", "mistral-v0.2", "gemma",
                                                "phi-3-mini", "qwen3", "llama-3", NULL};
    json_t *msgs = conversation(12);
    const char *path = "tests/cases/templates/models";
    DIR *d = opendir(path);
    assert_non_null(d);
    struct dirent *de;
    int n_sep = 0, n_not = 0;
    while ((de = readdir(d))) {
        size_t nl = strlen(de->d_name);
        if (nl < 7 || strcmp(de->d_name + nl - 6, ".jinja"))
            continue;
        char name[256], file[1300];
        snprintf(name, sizeof name, "%.*s", (int)(nl - 6), de->d_name);
        snprintf(file, sizeof file, "%s/%s", path, de->d_name);
        size_t len = 0;
        char *src = read_text(file, &len);
        assert_non_null(src);
        size_t bl = 0, el = 0;
        const char *bos = model_token_text(m, model_bos(m), &bl);
        const char *eos = model_token_text(m, model_eos(m), &el);
        char bb[64], eb[64];
        snprintf(bb, sizeof bb, "%.*s", (int)bl, bos ? bos : "");
        snprintf(eb, sizeof eb, "%.*s", (int)el, eos ? eos : "");
        struct tpl_chat_params cp = {.bos_token = bb, .eos_token = eb,
                                     .strip_bos = model_add_bos(m)};
        struct tpl_error e;
        tpl_chat *chat = tpl_chat_create(src, len, &cp, &e);
        free(src);
        if (!chat)
            fail_msg("%s: %s", name, e.msg);
        struct tpl_turns t;
        int rc = tpl_chat_turns(chat, msgs, NULL, 0, 0, &t, &e);
        char why[300] = "";
        struct srv_chat_turns p = {0};
        if (rc == 0 && t.n_turns > 0)
            rc = srv_chat_turns_tokenize(m, &t, &p, why, sizeof why);
        else if (rc == 1)
            snprintf(why, sizeof why, "%s", t.why);
        bool want_sep = false, want_not = false;
        for (int i = 0; separable[i]; i++)
            want_sep |= !strcmp(name, separable[i]);
        for (int i = 0; not_separable[i]; i++)
            want_not |= !strcmp(name, not_separable[i]);
        if (rc == 0 && t.n_turns > 0) {
            assert_int_equal(t.n_turns, 12);
            int gone = check_retained_is_rendering(m, chat, msgs, &p, name);
            print_message("%-20s separable: %d of 12 turns evicted in place, the rest is its "
                          "rendering\n",
                          name, gone);
            n_sep++;
            if (want_not)
                fail_msg("%s was expected not to be separable", name);
        } else {
            if (rc < 0)
                fail_msg("%s: cannot render: %s", name, e.msg);
            print_message("%-20s not separable: %s\n", name, why);
            assert_true(why[0] != 0);
            n_not++;
            if (want_sep)
                fail_msg("%s was expected to be separable", name);
        }
        srv_chat_turns_free(&p);
        tpl_turns_free(&t);
        tpl_chat_destroy(chat);
    }
    closedir(d);
    print_message("%d templates separable, %d not\n", n_sep, n_not);
    assert_true(n_sep >= 7 && n_not >= 6);
    json_decref(msgs);
    model_free(m);
}

/* Tokens of text[0..len) as a prompt start (first) or a continuation (new). */
static int32_t *tokens_of(const model *m, const char *text, size_t len, bool first, int *n)
{
    *n = first ? model_tokenize_special(m, text, len, model_add_bos(m), NULL, 0)
               : model_tokenize_continuation(m, text, len, NULL, 0);
    int32_t *v = malloc(sizeof(int32_t) * (size_t)(*n + 1));
    assert_int_equal(first ? model_tokenize_special(m, text, len, model_add_bos(m), v, *n)
                           : model_tokenize_continuation(m, text, len, v, *n),
                     *n);
    return v;
}

/*
 * A last user turn larger than the window is cut from the middle of its
 * text: the prompt is the budget exactly, and begins with the tokens of
 * everything before the text (the system prompt, the turn's role header)
 * and ends with everything after it (the end of the turn, the generation
 * prompt). A system prompt alone over the budget is refused, naming both.
 */
static void test_huge_last_turn_is_cut(void **state)
{
    (void)state;
    model *m = phi3_vocab();
    size_t len = 0;
    char *src = read_text("tests/cases/templates/models/chatml-openhermes.jinja", &len);
    assert_non_null(src);
    struct tpl_chat_params cp = {.bos_token = "<s>", .eos_token = "</s>",
                                 .strip_bos = model_add_bos(m)};
    struct tpl_error e;
    tpl_chat *chat = tpl_chat_create(src, len, &cp, &e);
    free(src);
    assert_non_null(chat);
    char big[6000] = "";
    for (int i = 0; i < 400; i++)
        strcat(big, i % 2 ? "sea " : "ship ");
    json_t *msgs = json_pack("[{s:s,s:s},{s:s,s:s},{s:s,s:s},{s:s,s:s}]", "role", "system",
                             "content", "Be brief.", "role", "user", "content", "hello",
                             "role", "assistant", "content", "hi", "role", "user", "content",
                             big);
    int32_t *ids = NULL;
    int n = 0, cut = 0;
    char why[300];
    assert_int_equal(srv_chat_cut_last_turn(m, chat, msgs, NULL, 0, 120, &ids, &n, &cut, why,
                                            sizeof why, &e),
                     0);
    assert_int_equal(n, 120);
    /* the pinned rendering: the earlier turn left out */
    json_t *pinned = json_pack("[O,O]", json_array_get(msgs, 0), json_array_get(msgs, 3));
    char *text = NULL;
    assert_int_equal(tpl_chat_render(chat, pinned, NULL, true, 0, &text, &len, &e), 0);
    const char *at = strstr(text, "ship sea");
    assert_non_null(at);
    size_t a = (size_t)(at - text), b = a + strlen(big) - 1; /* the template trims */
    int n_pre, n_mid, n_post;
    int32_t *pre = tokens_of(m, text, a, true, &n_pre);
    int32_t *mid = tokens_of(m, text + a, b - a, false, &n_mid);
    int32_t *post = tokens_of(m, text + b, len - b, false, &n_post);
    assert_int_equal(cut, n_mid - (120 - n_pre - n_post));
    assert_memory_equal(ids, pre, sizeof(int32_t) * (size_t)n_pre);
    assert_memory_equal(ids + n - n_post, post, sizeof(int32_t) * (size_t)n_post);
    int head = (120 - n_pre - n_post + 1) / 2;
    assert_memory_equal(ids + n_pre, mid, sizeof(int32_t) * (size_t)head); /* the text's start */
    assert_memory_equal(ids + n - n_post - (120 - n_pre - n_post - head),
                        mid + n_mid - (120 - n_pre - n_post - head),
                        sizeof(int32_t) * (size_t)(120 - n_pre - n_post - head)); /* its end */
    free(pre);
    free(mid);
    free(post);
    free(text);
    free(ids);
    json_decref(pinned);

    /* the system prompt alone is over the budget: refused, naming both */
    json_t *sysbig = json_pack("[{s:s,s:s},{s:s,s:s}]", "role", "system", "content", big, "role",
                               "user", "content", "hi");
    assert_int_equal(srv_chat_cut_last_turn(m, chat, sysbig, NULL, 0, 120, &ids, &n, &cut, why,
                                            sizeof why, &e),
                     -1);
    assert_non_null(strstr(why, "the budget is 120"));
    json_decref(sysbig);
    json_decref(msgs);
    tpl_chat_destroy(chat);
    model_free(m);
}

/*
 * A long system head times many turns is bounded before the per-turn
 * check renders it: such a conversation is not separable, naming the
 * sizes (the caller renders again instead). The same turns after a short
 * head are separable.
 */
static void test_turn_check_bounded(void **state)
{
    (void)state;
    size_t len = 0;
    char *src = read_text("tests/cases/templates/models/chatml-openhermes.jinja", &len);
    assert_non_null(src);
    struct tpl_chat_params cp = {.bos_token = "<s>", .eos_token = "</s>"};
    struct tpl_error e;
    tpl_chat *chat = tpl_chat_create(src, len, &cp, &e);
    free(src);
    assert_non_null(chat);
    size_t big_len = 256 << 10;
    char *big = malloc(big_len + 1);
    assert_non_null(big);
    memset(big, 'x', big_len);
    big[big_len] = '\0';
    for (int pass = 0; pass < 2; pass++) {
        json_t *msgs = json_pack("[{s:s,s:s}]", "role", "system", "content",
                                 pass ? "Be brief." : big);
        for (int i = 0; i < 600; i++) /* 300 turns: 300 x 256 KiB > 64 MiB */
            json_array_append_new(msgs, json_pack("{s:s,s:s}", "role",
                                                  i % 2 ? "assistant" : "user", "content", "hi"));
        json_array_append_new(msgs, json_pack("{s:s,s:s}", "role", "user", "content", "bye"));
        struct tpl_turns t;
        /* 1: rendered, not separable; 0: rendered and cut at its turns */
        assert_int_equal(tpl_chat_turns(chat, msgs, NULL, 0, 0, &t, &e), pass ? 0 : 1);
        if (pass == 0) {
            assert_int_equal(t.n_turns, 0);
            assert_non_null(strstr(t.why, "would render more than"));
        } else {
            assert_int_equal(t.n_turns, 300);
        }
        tpl_turns_free(&t);
        json_decref(msgs);
    }
    free(big);
    tpl_chat_destroy(chat);
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
        cmocka_unit_test(test_retained_tokens_are_the_rendering),
        cmocka_unit_test(test_huge_last_turn_is_cut),
        cmocka_unit_test(test_turn_check_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
