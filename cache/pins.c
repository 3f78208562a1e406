/*
 * pins.c - pinned spans: token ranges of a sequence that no eviction
 * policy gives up, and what they cost the budget.
 *
 * ---------------------------------------------------------------------------
 * Why pins, and why in history indices
 * ---------------------------------------------------------------------------
 *
 * A policy decides what a long sequence forgets by a rule that knows
 * nothing of the text: sink-window keeps the start and the end, the scored
 * policies keep what attention (or a key's norm) favours. The client often
 * knows better. llama.cpp's n_keep says "never shift out the first n
 * prompt tokens" (the instructions), and an agent's prompt holds spans in
 * the middle (a tool schema, a task statement, a document the answer must
 * quote) that a scorer may well judge unimportant until the question
 * arrives. A pin is such a span: a run of tokens every policy keeps, the
 * sinks and the window aside.
 *
 * A pin is stated in history indices, [start, end): a token's place among
 * every token appended to the sequence (kv_seq_hist_index). They never
 * change while tokens leave, so a pin stays true through every eviction
 * and, in a session, through later requests: a session's prompt is the
 * whole conversation, matched against its history from index 0, so prompt
 * index i *is* history index i, and a pin a request gave over its prompt
 * refers to the same tokens in every later prompt that repeats them. A
 * retained token is pinned when its history index lies in a pin; retained
 * history indices increase, so a pin's retained tokens are one logical run
 * found by two binary searches (kv_pins_range), O(pins log n) per question.
 *
 * ---------------------------------------------------------------------------
 * What a pin costs, per policy
 * ---------------------------------------------------------------------------
 *
 * Pins are bounded by the budget before they are accepted: with them, the
 * sinks and the window, eviction must still be able to free a page when
 * the sequence is full (kv_policy_check's rule, with the pins added to the
 * kept tokens). The cost of a set of pins (kv_pins_fit) is:
 *
 *   scored      the pinned tokens past the first sink_tokens (the sinks
 *               are kept anyway): token-granular, like the heavy tokens;
 *   sink-window whole pages, since only whole pages leave and a page that
 *               holds a pinned token stays: a pin reaching past the sinks
 *               from inside them costs the pages from the sinks' end to
 *               the page holding its last token (its alignment is exact:
 *               nothing before it ever leaves); any other pin of L tokens
 *               touches at most (L + page - 2) / page + 1 pages, whatever
 *               the evictions before it did to its alignment;
 *   none        nothing: nothing is ever evicted.
 *
 * A pin in the window costs as much as one in the middle: the window moves
 * on and the pin stays. The bound is conservative for sink-window (an
 * aligned pin touches a page less), never short.
 *
 * When the operator's window is automatic (window_tokens = 0: the rest of
 * the budget, kv_policy.window_auto), pins take their room from the
 * window: the window in effect shrinks by their cost and must keep at
 * least one page. With a window the operator set, pins must fit beside it,
 * or they are refused, naming the sizes. kv_seq_set_pins and
 * kv_seq_set_policy recompute the policy in effect from the policy as set
 * and the pins, so a session's window grows back when its pins go.
 *
 * ---------------------------------------------------------------------------
 * How each eviction keeps them
 * ---------------------------------------------------------------------------
 *
 * scored (evict.c): the pinned middle tokens are kept without being
 * ranked, and the heavy_tokens best of the *unpinned* middle join them;
 * the floor is sinks + window + pinned middle + heavy. sink-window: a page
 * holding a pinned token is never evicted; whole pages of unpinned tokens
 * before the window leave oldest first, and everything before the last
 * freed page (sinks and pinned pages) slides forward over the gaps, page
 * ids and token metadata only: not a byte of K or V moves, as without
 * pins. turns (turns.c): a turn holding a pinned token is not evictable;
 * the others leave whole, and the policy's cut, when it comes, keeps the
 * pins too. Truncation (a session's prompt diverging) cuts the pins at the
 * cut; a drop (LRU) clears them with the history they indexed.
 */
#include "cache_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Span lists
 * ------------------------------------------------------------------------ */

static int span_cmp(const void *a, const void *b)
{
    const struct kv_span *x = a, *y = b;
    return x->start != y->start ? (x->start < y->start ? -1 : 1)
                                : (x->end < y->end ? -1 : x->end > y->end);
}

int kv_spans_normalize(struct kv_span *spans, int n, char *err, size_t errlen)
{
    if (n < 0 || (n > 0 && !spans)) {
        if (err)
            snprintf(err, errlen, "pinned spans: %d spans%s", n, n > 0 ? " and no list" : "");
        return -EINVAL;
    }
    for (int i = 0; i < n; i++)
        if (spans[i].start < 0 || spans[i].end <= spans[i].start) {
            if (err)
                snprintf(err, errlen,
                         "pinned span %d is [%d, %d): need 0 <= start < end (end excluded)", i,
                         spans[i].start, spans[i].end);
            return -EINVAL;
        }
    qsort(spans, (size_t)n, sizeof(*spans), span_cmp);
    int m = 0;
    for (int i = 0; i < n; i++) {
        if (m > 0 && spans[i].start <= spans[m - 1].end) { /* overlapping or touching */
            if (spans[i].end > spans[m - 1].end)
                spans[m - 1].end = spans[i].end;
            continue;
        }
        spans[m++] = spans[i];
    }
    if (m > KV_MAX_PINS) {
        if (err)
            snprintf(err, errlen, "%d pinned spans (after merging); at most %d are allowed", m,
                     KV_MAX_PINS);
        return -E2BIG;
    }
    return m;
}

/* ------------------------------------------------------------------------
 * The budget
 * ------------------------------------------------------------------------ */

int64_t kv_pins_cost(const struct kv_policy *p, int page_tokens, const struct kv_span *spans,
                     int n)
{
    int64_t pt = page_tokens > 0 ? page_tokens : 1, cost = 0;
    if (p->kind == KV_EVICT_NONE)
        return 0;
    struct kv_budget b;
    kv_policy_budget(p, (int)pt, &b);
    int64_t sinks = p->kind == KV_EVICT_SINK_WINDOW ? b.kept_tokens : p->sink_tokens;
    for (int i = 0; i < n; i++) {
        int64_t s = spans[i].start, e = spans[i].end;
        if (e <= sinks)
            continue;
        if (p->kind != KV_EVICT_SINK_WINDOW)
            cost += e - (s > sinks ? s : sinks);
        else if (s <= sinks) /* from inside the sink pages: exact whole pages */
            cost += (e + pt - 1) / pt * pt - sinks;
        else
            cost += ((e - s + pt - 2) / pt + 1) * pt;
    }
    return cost;
}

int kv_pins_fit(const struct kv_policy *p, int page_tokens, const struct kv_span *spans, int n,
                struct kv_policy *out, char *err, size_t errlen)
{
    *out = *p;
    int64_t cost = kv_pins_cost(p, page_tokens, spans, n);
    if (cost == 0)
        return 0;
    int64_t pinned = 0;
    for (int i = 0; i < n; i++)
        pinned += (int64_t)spans[i].end - spans[i].start;
    struct kv_budget b;
    kv_policy_budget(p, page_tokens, &b);
    int64_t room = b.window_room - cost; /* the largest window the pins leave */
    if (p->window_auto && room - (b.step_tokens - page_tokens) >= page_tokens) {
        out->window_tokens = (int)(room - (b.step_tokens - page_tokens)); /* as budget's */
        return 0;
    }
    if (!p->window_auto && p->window_tokens <= room)
        return 0;
    if (!err)
        return -E2BIG;
    int len = snprintf(err, errlen,
                       "pinned spans hold %lld tokens, costing %lld under %s%s; with %lld kept "
                       "tokens (sinks%s), ",
                       (long long)pinned, (long long)cost, kv_policy_kind_name(p->kind),
                       p->kind == KV_EVICT_SINK_WINDOW ? " as whole pages" : "",
                       (long long)b.kept_tokens, kv_policy_scored(p->kind) ? " + heavy" : "");
    size_t at = len > 0 && (size_t)len < errlen ? (size_t)len : 0;
    if (p->window_auto)
        snprintf(err + at, errlen - at,
                 "one page (%d) and max_cache_tokens %d they leave an automatic window of %lld "
                 "tokens, less than one page: pins may cost at most %lld",
                 page_tokens, p->max_cache_tokens, (long long)room,
                 (long long)(b.window_room - page_tokens));
    else
        snprintf(err + at, errlen - at,
                 "window_tokens %d and one page (%d) that needs max_cache_tokens >= %lld, but it "
                 "is %d",
                 p->window_tokens, page_tokens, (long long)(b.need_tokens + cost),
                 p->max_cache_tokens);
    return -E2BIG;
}

/* ------------------------------------------------------------------------
 * A sequence's pins
 * ------------------------------------------------------------------------ */

int kv_seq_pins(const kv_seq *s, const struct kv_span **spans)
{
    if (spans)
        *spans = s->n_pins > 0 ? s->pins : NULL;
    return s->n_pins;
}

int kv_seq_set_pins(kv_seq *s, const struct kv_span *spans, int n, char *err, size_t errlen)
{
    struct kv_span v[KV_MAX_PINS];
    if (n > KV_MAX_PINS) {
        if (err)
            snprintf(err, errlen, "%d pinned spans; at most %d are allowed", n, KV_MAX_PINS);
        return -E2BIG;
    }
    if (n > 0 && spans)
        memcpy(v, spans, sizeof(*v) * (size_t)n);
    int m = kv_spans_normalize(v, n, err, errlen);
    if (m < 0)
        return m;
    struct kv_policy eff;
    int rc = kv_pins_fit(&s->policy_set, s->cache->layout.page_tokens, v, m, &eff, err, errlen);
    if (rc)
        return rc;
    if (!kv_window_accepts(s, &eff, s->turns, s->n_turns)) { /* window.c */
        if (err)
            snprintf(err, errlen, "pins: the window they leave could bring tokens the "
                                  "sliding-window layers dropped back into sight (start over)");
        return -ESTALE;
    }
    memcpy(s->pins, v, sizeof(*v) * (size_t)m);
    s->n_pins = m;
    s->policy = eff;
    return 0;
}

void kv_pins_truncate(kv_seq *s, int n_hist)
{
    int m = 0;
    for (int i = 0; i < s->n_pins; i++) {
        if (s->pins[i].start >= n_hist)
            break;
        s->pins[m] = s->pins[i];
        if (s->pins[m].end > n_hist)
            s->pins[m].end = n_hist;
        m++;
    }
    s->n_pins = m;
    kv_pins_fit(&s->policy_set, s->cache->layout.page_tokens, s->pins, m, &s->policy, NULL, 0);
}

/* ------------------------------------------------------------------------
 * Pinned retained tokens
 * ------------------------------------------------------------------------ */

int kv_lower_bound(const int32_t *a, int lo, int hi, int64_t h)
{
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (a[mid] < h)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int kv_hidx_lower(const kv_seq *s, int from, int64_t h)
{
    return kv_lower_bound(s->hidx + s->t_off, from, s->n_tokens, h);
}

void kv_pins_range(const kv_seq *s, int k, int *lo, int *hi)
{
    *lo = kv_hidx_lower(s, 0, s->pins[k].start);
    *hi = kv_hidx_lower(s, *lo, s->pins[k].end);
}

int kv_pins_count(const kv_seq *s, int a, int b)
{
    int n = 0;
    for (int k = 0; k < s->n_pins && a < b; k++) {
        int lo, hi;
        kv_pins_range(s, k, &lo, &hi);
        lo = lo > a ? lo : a;
        hi = hi < b ? hi : b;
        if (hi > lo)
            n += hi - lo;
    }
    return n;
}

bool kv_pins_hit(const kv_seq *s, int64_t h0, int64_t h1)
{
    for (int k = 0; k < s->n_pins; k++)
        if (s->pins[k].start < h1 && h0 < s->pins[k].end)
            return true;
    return false;
}
