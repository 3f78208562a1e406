/*
 * turns.c - turn-aware eviction: a conversation gives up whole turns,
 * oldest first, in place, and keeps its structure.
 *
 * ---------------------------------------------------------------------------
 * Why turns, and why in place
 * ---------------------------------------------------------------------------
 *
 * A chat prompt is the template's rendering of a conversation: a system
 * prompt and tool definitions, then turns (a user message and the
 * assistant and tool messages answering it), each wrapped in the
 * template's role headers and end-of-turn markers. Token eviction cuts
 * through that structure: half a turn, a role header without its text, a
 * system prompt gone. The text the model then sees is no rendering of any
 * conversation, which is why popular servers turn their context shift off
 * for chat. A sequence that knows where its turns lie can give up whole
 * turns instead: what stays is then the template's rendering of the
 * messages kept (the engine checks that the template renders that way;
 * the cache only keeps the spans whole).
 *
 * The cheap way to drop turns is to re-render the kept messages and
 * prefill them again, a forward pass over everything kept. Here the turns
 * leave in place: the retained tokens after the gap move down over it, K
 * and V rows copied whole (invariant 1: bytes move, never change), with
 * their positions, ids and history indices; positions then renumber or
 * stay as the policy says, and with keys stored unrotated that is all the
 * model needs. A compaction moves O(tokens after the gap) rows, a memcpy
 * per row, where a re-prefill computes the model over all of them; and
 * once turns must go they go down to a low-water mark (kv_seq_set_turns),
 * so one compaction serves the many appends that follow it.
 *
 * Why compact and not free whole pages, as sink-window does: a turn ends
 * wherever its text ends, not at a page boundary, and every page of a
 * page table but the last must be full. Sliding the short pinned head
 * forward over the gap, as sink-window slides its sinks, works only when
 * the gap is a whole number of pages, which turns rarely are.
 *
 * ---------------------------------------------------------------------------
 * The table and the rules
 * ---------------------------------------------------------------------------
 *
 * The engine gives a sequence the history-index span of each turn it may
 * give up. History indices never change under eviction, so the table stays
 * true while tokens leave; a turn's retained tokens are found by binary
 * search over the retained history indices, which increase. A turn is
 * evictable once all its tokens have been appended and some are retained.
 * Tokens in no turn are pinned: the system prompt, the tool definitions,
 * the last user turn (the engine leaves it out of the table) and the
 * answer being written; so is a turn holding a token of a pinned span
 * (pins.c). Making room then goes:
 *
 *   1. whole evictable turns, oldest first, until the room is made and at
 *      most the low-water mark is left (or the turns run out);
 *   2. if even every evictable turn is not enough (a turn, or an answer,
 *      larger than what the pinned tokens leave of the budget), the
 *      policy evicts tokens as it would without a table. That cuts into a
 *      turn; kv_stats.turn_cuts counts it and kv_seq_turn_state reports
 *      the cut turns, so the engine can say so.
 *
 * Plan and apply keep seq.c's contract: kv_room_plan is pure and returns
 * how many tokens remain, kv_room_apply carries out exactly that and
 * cannot fail. The two agree without remembering anything: turns reach
 * any count >= their floor (the tokens left with every evictable turn
 * gone) by a prefix of the oldest-first order, and the policy is asked
 * only for counts below that floor.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Finding a turn's retained tokens
 * ------------------------------------------------------------------------ */

static int64_t turn_end(const struct kv_turn *t)
{
    return (int64_t)t->hist_start + t->n_tokens;
}

/* Turn t's retained tokens are logical [*lo, *hi), searched from `from`. */
static void turn_range(const kv_seq *s, const struct kv_turn *t, int from, int *lo, int *hi)
{
    *lo = kv_hidx_lower(s, from, t->hist_start);
    *hi = kv_hidx_lower(s, *lo, turn_end(t));
}

/* Appended whole: no token of it is still to come. */
static bool turn_complete(const kv_seq *s, const struct kv_turn *t)
{
    return turn_end(t) <= s->n_appended;
}

/* Holds a pinned token (pins.c): it stays whole, as the tokens in no turn
 * do. */
static bool turn_pinned(const kv_seq *s, const struct kv_turn *t)
{
    return kv_pins_hit(s, t->hist_start, turn_end(t));
}

/* Tokens left with every evictable turn gone. */
static int turn_floor(const kv_seq *s)
{
    int n = s->n_tokens, from = 0;
    for (int i = 0; i < s->n_turns && turn_complete(s, &s->turns[i]); i++) {
        int lo, hi;
        if (turn_pinned(s, &s->turns[i]))
            continue;
        turn_range(s, &s->turns[i], from, &lo, &hi);
        n -= hi - lo;
        from = hi;
    }
    return n;
}

/* ------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------ */

void kv_turns_clear(kv_seq *s)
{
    free(s->turns);
    s->turns = NULL;
    s->n_turns = s->turns_cap = 0;
}

int kv_seq_set_turns(kv_seq *s, const struct kv_turn *turns, int n, int low_tokens, char *err,
                     size_t errlen)
{
#define REJECT(...)                                                                                \
    do {                                                                                           \
        if (err)                                                                                   \
            snprintf(err, errlen, __VA_ARGS__);                                                    \
        return -EINVAL;                                                                            \
    } while (0)
    if (n < 0 || (n > 0 && !turns))
        REJECT("turns: %d turns%s", n, n > 0 ? " and no table" : "");
    int64_t prev_end = 0;
    for (int i = 0; i < n; i++) {
        const struct kv_turn *t = &turns[i];
        if (t->hist_start < 0 || t->n_tokens < 1 || t->n_messages < 0 ||
            turn_end(t) > INT32_MAX)
            REJECT("turns[%d]: start %d, %d tokens, %d messages: need start >= 0, tokens >= 1, "
                   "messages >= 0",
                   i, t->hist_start, t->n_tokens, t->n_messages);
        if (t->hist_start < prev_end)
            REJECT("turns[%d] starts at %d, inside or before the turn before it (which ends at "
                   "%lld)",
                   i, t->hist_start, (long long)prev_end);
        prev_end = turn_end(t);
    }
#undef REJECT
    if (!kv_window_accepts(s, &s->policy, turns, n)) {
        if (err)
            snprintf(err, errlen, "turns: the sliding-window layers dropped tokens this table "
                                  "could bring back into their window (start the session over)");
        return -ESTALE;
    }
    if (n == 0) {
        kv_turns_clear(s);
        return 0;
    }
    if (n > s->turns_cap) {
        struct kv_turn *v = realloc(s->turns, sizeof(*v) * (size_t)n);
        if (!v) {
            if (err)
                snprintf(err, errlen, "turns: out of memory for %d turns", n);
            return -ENOMEM;
        }
        s->turns = v;
        s->turns_cap = n;
    }
    memcpy(s->turns, turns, sizeof(*turns) * (size_t)n);
    s->n_turns = n;
    s->turn_low = low_tokens;
    return 0;
}

void kv_turns_truncate(kv_seq *s, int n_hist)
{
    while (s->n_turns > 0 && turn_end(&s->turns[s->n_turns - 1]) > n_hist)
        s->n_turns--;
}

void kv_seq_turn_state(const kv_seq *s, struct kv_turn_state *out)
{
    *out = (struct kv_turn_state){.turns = s->n_turns};
    int from = 0;
    for (int i = 0; i < s->n_turns; i++) {
        const struct kv_turn *t = &s->turns[i];
        int64_t appended = s->n_appended - (int64_t)t->hist_start;
        if (appended <= 0)
            break; /* this turn and the ones after it are still to come */
        if (appended > t->n_tokens)
            appended = t->n_tokens;
        int lo, hi;
        turn_range(s, t, from, &lo, &hi);
        from = hi;
        if (hi == lo && appended == t->n_tokens) {
            out->turns_evicted++;
            out->messages_evicted += t->n_messages;
        } else if (hi - lo < appended) {
            out->turns_cut++;
        }
    }
}

/* ------------------------------------------------------------------------
 * Making room
 * ------------------------------------------------------------------------ */

/* The largest append whole turns can make room for (0 when none). */
static int turn_room(const kv_seq *s)
{
    int room = s->policy.max_cache_tokens - turn_floor(s);
    return room > 0 ? room : 0;
}

int kv_room_plan(const kv_seq *s, int target)
{
    if (s->n_turns == 0)
        return kv_evict_plan(s, target);
    if (s->n_tokens <= target)
        return s->n_tokens;
    if (target < 0)
        return -1;
    int max = s->policy.max_cache_tokens;
    int low = s->turn_low >= 1 && s->turn_low < max ? s->turn_low : max;
    if (low > target)
        low = target;
    int n = s->n_tokens, from = 0;
    for (int i = 0; i < s->n_turns && n > low && turn_complete(s, &s->turns[i]); i++) {
        int lo, hi;
        if (turn_pinned(s, &s->turns[i]))
            continue;
        turn_range(s, &s->turns[i], from, &lo, &hi);
        n -= hi - lo;
        from = hi;
    }
    if (n <= target)
        return n;
    return kv_evict_plan(s, target); /* turns cannot: the policy cuts */
}

/*
 * Evict the oldest whole turns until `keep` tokens remain (keep is a count
 * kv_room_plan reached by turns). One pass: the runs between the gaps and
 * the tail after the last one move down, token by token, in order.
 */
static int evict_turns(kv_seq *s, int keep)
{
    kv_cache *c = s->cache;
    int before = s->n_tokens, left = before, d = -1, src = 0, gone = 0;
    for (int i = 0; i < s->n_turns && left > keep; i++) {
        assert(turn_complete(s, &s->turns[i]));
        int lo, hi;
        if (turn_pinned(s, &s->turns[i]))
            continue; /* its tokens move with the run after it */
        turn_range(s, &s->turns[i], src, &lo, &hi);
        if (hi == lo)
            continue;
        if (d < 0) {
            d = lo;
        } else {
            for (int j = src; j < lo; j++)
                kv_evict_move_token(s, d++, j);
        }
        src = hi;
        left -= hi - lo;
        gone++;
    }
    assert(left == keep && d >= 0);
    for (int j = src; j < before; j++)
        kv_evict_move_token(s, d++, j);
    assert(d == keep);
    kv_seq_cut_to(s, keep);
    if (s->policy.renumber)
        kv_evict_renumber(s);
    c->evictions++;
    c->tokens_evicted += (uint64_t)(before - keep);
    c->turns_evicted += (uint64_t)gone;
    return before - keep;
}

int kv_room_apply(kv_seq *s, int keep)
{
    if (s->n_turns == 0 || keep >= s->n_tokens)
        return kv_evict_apply(s, keep);
    if (keep < turn_floor(s)) {
        s->cache->turn_cuts++;
        return kv_evict_apply(s, keep);
    }
    return evict_turns(s, keep);
}

void kv_room_effect(const kv_seq *s, int keep, struct kv_effect *out)
{
    if (s->n_turns == 0 || keep >= s->n_tokens || keep < turn_floor(s)) {
        kv_evict_effect(s, keep, out);
        return;
    }
    /* Turns compact in place from the first evicted turn's first token. */
    int pt = s->cache->layout.page_tokens, first = s->n_tokens;
    for (int i = 0; i < s->n_turns && first == s->n_tokens; i++) {
        int lo, hi;
        turn_range(s, &s->turns[i], 0, &lo, &hi);
        if (hi > lo)
            first = lo;
    }
    int kept_pages = kv_pages_for(s->cache, keep);
    *out = (struct kv_effect){.write_lo = first / pt, .write_hi = kept_pages, .last = kept_pages - 1};
    for (int j = kept_pages; j < s->n_pages; j++) /* the tail goes */
        out->freed += !kv_pool_shared(s->cache, s->ptab[s->p_off + j]);
}

int kv_room_max_append(const kv_seq *s)
{
    if (s->n_turns > 0) {
        int room = turn_room(s);
        if (room > 0)
            return room;
    }
    int room = s->policy.max_cache_tokens - kv_evict_floor(s);
    return room > 0 ? room : 0;
}
