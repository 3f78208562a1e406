/*
 * window.c - the per-layer budget of sliding-window layers: their own
 * pages, kept only while some query can still see them.
 *
 * ---------------------------------------------------------------------------
 * Why a second page class
 * ---------------------------------------------------------------------------
 *
 * A layer with a sliding window W (Mistral's every layer, Gemma 2's even
 * layers, Gemma 3's five in six) lets a query at position q see a key only
 * when q - W < pos_k <= q. Once every future query is past a key's window,
 * that layer will never read the key again, yet a page that holds every
 * layer keeps it for as long as the full-attention layers need the token.
 * At 32k tokens and W = 1024, Gemma 3's local layers would so keep 32
 * times what they can read. The cache therefore gives the windowed
 * layers pages of their own and drops those pages, whole, once no query
 * can see them.
 *
 * ---------------------------------------------------------------------------
 * Layout: one pool, two classes
 * ---------------------------------------------------------------------------
 *
 * A page holds page_layers layer slots (kv_layout.page_layers). Without
 * windowed layers page_layers = n_layer and nothing changes. With them,
 * the full-attention ("global") layers take slots 0..n_global-1 of the
 * sequence's page table as before, and the windowed ("local") layers are
 * cut into n_groups groups of page_layers layers: local layer j lives in
 * slot j % page_layers of its group j / page_layers. page_layers is
 * n_global (n_layer when every layer is windowed), so both classes draw
 * the same pages from the same pool: one free list, one currency, one
 * LRU; a local page of page_tokens tokens costs n_groups pool pages.
 *
 * ---------------------------------------------------------------------------
 * Local slots follow the history, not the page table
 * ---------------------------------------------------------------------------
 *
 * The local class of a sequence is a list of local pages, each with one
 * pool page per group; slot k (page k / page_tokens) holds the local
 * layers' K and V of one appended token, in append order, and records its
 * history index and its position. Eviction, compaction and renumbering
 * act on the main page table (evict.c, turns.c) and never move a local
 * byte: afterwards kv_window_sync gives each slot the position its token
 * now has, or WIN_GONE (INT32_MAX) when the token was evicted - a
 * position no query reaches, so the kernel's causal mask hides it. The
 * local layers therefore attend to exactly the retained tokens inside
 * their window, as a cache holding every layer would (invariant 3), and
 * no retained byte is ever rewritten (invariant 1).
 *
 * ---------------------------------------------------------------------------
 * When a local page may go
 * ---------------------------------------------------------------------------
 *
 * At the start of each append (the new queries are at next_pos or later)
 * a local page is dropped when every slot in it is gone: evicted, or
 * invisible now (pos <= next_pos - W) and never visible again. Whether a
 * retained token can come back into the window depends on the positions:
 *
 *   preserve  positions never change and queries only advance: never.
 *   renumber  the distance from a token to the newest one is the number of
 *             retained tokens after it; it shrinks when tokens after it
 *             are evicted while it stays. sink-window evicts the oldest
 *             pages after the sinks, so only the sinks can come back - and
 *             not when window_tokens >= W, because at least window_tokens
 *             tokens stay after them. Turn eviction (turns.c) removes the
 *             oldest turns, so tokens outside every turn with a turn after
 *             them (the system prompt) can come back. Scored policies
 *             evict any middle token: every retained token can come back.
 *
 * Those are kept ("stuck"); everything else leaves once invisible. The
 * decision is per slot, kept whole pages at a time. Truncating a session
 * back (kv_seq_truncate) moves next_pos back, which could need dropped
 * tokens again: it is refused (-ESTALE) when it would, and the engine
 * starts the session over. A policy or turn table that would make a
 * dropped token stuck is refused the same way (kv_window_accepts).
 *
 * ---------------------------------------------------------------------------
 * The budget
 * ---------------------------------------------------------------------------
 *
 * kv_seq_append plans local pages with the rest (seq.c's pool_need): what
 * the pool must hand out is the main class's part plus the local one's
 * (kv_window_need): the pages the new slots open, plus a private copy of
 * the page being filled where it is shared, minus the pages the drop
 * gives back. The LRU counts both classes when it weighs an idle session.
 * kv_cache_sequence_pages states what one sequence can occupy at its full
 * budget: the main pages of kv_policy_budget plus, per group, the window
 * and one append chunk (W + chunk tokens, rounded to pages, plus the partly
 * filled first and last pages) - or, when the policy makes every token
 * stuck or the budget is within the window, as many local pages as main
 * ones.
 *
 * ---------------------------------------------------------------------------
 * Shared pages
 * ---------------------------------------------------------------------------
 *
 * Local pages are reference-counted like main ones (pool.c). A fork
 * (kv_seq_fork) lists its parent's local pages and copies their slots'
 * history indices and positions; the first append into a shared page
 * being filled copies it (kv_window_append), dropped pages only lose a
 * reference, and a compaction of scattered dead slots waits while a page
 * it would write into is shared. What does not carry local pages is
 * refused rather than served wrong: kv_seq_attach (a cached prefix's pages
 * hold only the full-attention layers, so the prefix index is off for
 * such caches) and the session file (engine/spill.c holds every layer's
 * rows of every retained token).
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define WIN_GONE INT32_MAX /* position of a slot whose token was evicted */

/* ------------------------------------------------------------------------
 * Shape
 * ------------------------------------------------------------------------ */

/* Global and local layer counts of params; W (the largest window) in *w. */
static void count_layers(const struct kv_cache_params *p, int *n_global, int *n_local, int *w)
{
    *n_global = *n_local = *w = 0;
    for (int l = 0; l < p->n_layer; l++) {
        int wl = p->layer_window ? p->layer_window[l] : 0;
        if (wl > 0) {
            (*n_local)++;
            *w = wl > *w ? wl : *w;
        } else {
            (*n_global)++;
        }
    }
}

int kv_window_page_layers(const struct kv_cache_params *p, int *n_groups)
{
    int ng, nl, w;
    count_layers(p, &ng, &nl, &w);
    int per = ng > 0 ? ng : nl;
    if (n_groups)
        *n_groups = nl > 0 ? (nl + per - 1) / per : 0;
    return per;
}

int kv_window_init(kv_cache *c, const struct kv_cache_params *p, char *err, size_t errlen)
{
    struct kv_window *w = &c->win;
    int nl;
    count_layers(p, &w->n_global, &nl, &w->window);
    for (int l = 0; p->layer_window && l < p->n_layer; l++) {
        if (p->layer_window[l] < 0) {
            if (err)
                snprintf(err, errlen, "kv cache: layer %d has a negative window (%d)", l,
                         p->layer_window[l]);
            return -EINVAL;
        }
    }
    int per = kv_window_page_layers(p, &w->n_groups);
    w->slot = malloc(sizeof(int16_t) * (size_t)p->n_layer);
    w->group = malloc(sizeof(int16_t) * (size_t)p->n_layer);
    if (!w->slot || !w->group) {
        if (err)
            snprintf(err, errlen, "kv cache: out of memory for the layer map");
        return -ENOMEM;
    }
    int gi = 0, li = 0;
    for (int l = 0; l < p->n_layer; l++) {
        bool local = p->layer_window && p->layer_window[l] > 0;
        w->group[l] = (int16_t)(local ? li / per : -1);
        w->slot[l] = (int16_t)(local ? li++ % per : gi++);
    }
    return 0;
}

void kv_window_deinit(kv_cache *c)
{
    free(c->win.slot);
    free(c->win.group);
}

int kv_cache_layer_slot(const kv_cache *c, int layer)
{
    return c->win.slot[layer];
}

int kv_cache_window(const kv_cache *c)
{
    return c->win.window;
}

/* ------------------------------------------------------------------------
 * Per-sequence arrays
 * ------------------------------------------------------------------------ */

static bool grow(void **p, size_t bytes)
{
    void *q = realloc(*p, bytes ? bytes : 1);
    if (!q)
        return false;
    *p = q;
    return true;
}

/* Room for `extra` more slots and the pages they may open. 0 or -ENOMEM
 * (nothing lost; arrays may have grown). */
int kv_window_reserve(kv_seq *s, int64_t extra)
{
    const struct kv_window *w = &s->cache->win;
    if (!w->n_groups || extra < 0)
        return 0;
    struct kv_wseq *q = &s->win;
    int pt = s->cache->layout.page_tokens;
    int64_t need = (int64_t)q->n_slots + extra;
    if (need > q->s_cap) {
        int64_t cap = need * 2 < 64 ? 64 : need * 2;
        if (cap > INT32_MAX)
            return -ENOMEM;
        if (!grow((void **)&q->hidx, (size_t)cap * sizeof(int32_t)) ||
            !grow((void **)&q->pos, (size_t)cap * sizeof(int32_t)) ||
            !grow((void **)&q->dead, (size_t)cap))
            return -ENOMEM;
        q->s_cap = (int)cap;
    }
    int64_t pages = (need + pt - 1) / pt;
    if (pages > q->lp_cap) {
        int64_t cap = pages * 2 < 8 ? 8 : pages * 2;
        int32_t *nt = malloc((size_t)cap * (size_t)w->n_groups * sizeof(int32_t));
        if (!nt || !grow((void **)&q->keep, (size_t)cap)) {
            free(nt);
            return -ENOMEM;
        }
        for (int g = 0; g < w->n_groups && q->n_lp > 0; g++)
            memcpy(nt + (size_t)g * (size_t)cap, q->ptab + (size_t)g * (size_t)q->lp_cap,
                   sizeof(int32_t) * (size_t)q->n_lp);
        free(q->ptab);
        q->ptab = nt;
        q->lp_cap = (int)cap;
    }
    return 0;
}

void kv_window_free_seq(kv_seq *s)
{
    free(s->win.ptab);
    free(s->win.hidx);
    free(s->win.pos);
    free(s->win.keep);
    free(s->win.dead);
    memset(&s->win, 0, sizeof(s->win));
}

static int32_t *group_table(const kv_seq *s, int g)
{
    return s->win.ptab + (size_t)g * (size_t)s->win.lp_cap;
}

int kv_window_pages_held(const kv_seq *s)
{
    return s->win.n_lp * s->cache->win.n_groups;
}

/* Give local pages [from, n_lp) back and cut the slots to `slots`. */
static void release_from(kv_seq *s, int from, int slots)
{
    for (int g = 0; g < s->cache->win.n_groups; g++)
        for (int p = from; p < s->win.n_lp; p++)
            kv_pool_unref(s->cache, group_table(s, g)[p]);
    s->win.n_lp = from;
    s->win.n_slots = slots;
}

void kv_window_release(kv_seq *s)
{
    release_from(s, 0, 0);
}

int64_t kv_window_unshared(const kv_seq *s)
{
    int64_t n = 0;
    for (int g = 0; g < s->cache->win.n_groups; g++)
        for (int p = 0; p < s->win.n_lp; p++)
            n += !kv_pool_shared(s->cache, group_table(s, g)[p]);
    return n;
}

/* Whether local pages [from, n_lp) are the sequence's alone in every group. */
static bool unshared_from(const kv_seq *s, int from)
{
    for (int g = 0; g < s->cache->win.n_groups; g++)
        for (int p = from; p < s->win.n_lp; p++)
            if (kv_pool_shared(s->cache, group_table(s, g)[p]))
                return false;
    return true;
}

int kv_window_fork(kv_seq *child, const kv_seq *parent)
{
    const struct kv_wseq *pq = &parent->win;
    struct kv_wseq *q = &child->win;
    if (!child->cache->win.n_groups || pq->n_slots == 0)
        return 0;
    if (kv_window_reserve(child, pq->n_slots) < 0)
        return -ENOMEM;
    memcpy(q->hidx, pq->hidx, sizeof(int32_t) * (size_t)pq->n_slots);
    memcpy(q->pos, pq->pos, sizeof(int32_t) * (size_t)pq->n_slots);
    for (int g = 0; g < child->cache->win.n_groups; g++)
        for (int p = 0; p < pq->n_lp; p++) {
            int32_t page = group_table(parent, g)[p];
            kv_pool_ref(child->cache, page);
            group_table(child, g)[p] = page;
        }
    q->n_slots = pq->n_slots;
    q->n_lp = pq->n_lp;
    return 0;
}

/* ------------------------------------------------------------------------
 * Positions from the main table
 * ------------------------------------------------------------------------ */

/* First retained (main) index whose history index is >= h. */
static int main_lower_bound(const kv_seq *s, int32_t h)
{
    return kv_hidx_lower(s, 0, h);
}

/* The slot of history index h, or -1 when it has none. */
static int slot_of(const kv_seq *s, int32_t h)
{
    int k = kv_lower_bound(s->win.hidx, 0, s->win.n_slots, h);
    return k < s->win.n_slots && s->win.hidx[k] == h ? k : -1;
}

/*
 * Walk the slots beside the main table (both in history order): fn(k, i)
 * for every slot k, with i its token's main index or -1 once evicted.
 */
#define FOR_SLOTS(s, k, i, body)                                                                   \
    do {                                                                                           \
        const int32_t *mh_ = (s)->hidx + (s)->t_off;                                               \
        int i_ = (s)->win.n_slots ? main_lower_bound((s), (s)->win.hidx[0]) : 0;                   \
        for (int k = 0; k < (s)->win.n_slots; k++) {                                               \
            while (i_ < (s)->n_tokens && mh_[i_] < (s)->win.hidx[k])                               \
                i_++;                                                                              \
            int i = i_ < (s)->n_tokens && mh_[i_] == (s)->win.hidx[k] ? i_ : -1;                    \
            body;                                                                                  \
        }                                                                                          \
    } while (0)

void kv_window_sync(kv_seq *s)
{
    if (!s->cache->win.n_groups)
        return;
    const int32_t *pos = s->pos + s->t_off;
    FOR_SLOTS(s, k, i, s->win.pos[k] = i >= 0 ? pos[i] : WIN_GONE);
}

/* ------------------------------------------------------------------------
 * What may go
 * ------------------------------------------------------------------------ */

/* Whether a retained token that turn eviction keeps (outside every turn,
 * or in a turn a pin holds) has an evictable turn after it. */
static bool pinned_before_a_turn(const kv_seq *s, int32_t h)
{
    if (s->n_turns == 0)
        return false;
    const struct kv_turn *last = &s->turns[s->n_turns - 1];
    if (h >= last->hist_start)
        return false; /* nothing evictable after it */
    for (int t = 0; t < s->n_turns; t++) { /* inside a turn: it leaves before later turns, */
        const struct kv_turn *u = &s->turns[t];
        if (h >= u->hist_start && h < u->hist_start + u->n_tokens) /* unless a pin holds it */
            return kv_pins_hit(s, u->hist_start, (int64_t)u->hist_start + u->n_tokens);
    }
    return true;
}

/*
 * Whether retained token i (main index, history index h) could be seen by
 * a query at next_pos or later again, although it is invisible now: the
 * "stuck" tokens of the essay above, under policy p.
 */
static bool could_return(const kv_seq *s, const struct kv_policy *p, int i, int32_t h)
{
    if (!p->renumber)
        return false;
    (void)i;
    if (kv_policy_scored(p->kind))
        return true;
    /* sink-window keeps its sinks and pinned spans while later pages leave;
     * at least window_tokens tokens stay after them, so with a window of W
     * or more they cannot come back - with less, anything kept could */
    if (p->kind == KV_EVICT_SINK_WINDOW && p->window_tokens < s->cache->win.window)
        return true;
    return pinned_before_a_turn(s, h);
}

/* Slot k (its token at main index i, -1 if evicted) can be dropped. */
static bool slot_gone(const kv_seq *s, int k, int i)
{
    if (i < 0)
        return true;
    int64_t floor = (int64_t)s->next_pos - s->cache->win.window;
    if ((int64_t)s->win.pos[k] > floor)
        return false; /* visible to the next query */
    return !could_return(s, &s->policy, i, s->win.hidx[k]);
}

/* Mark in keep[p] (n_lp entries) the local pages that must stay; returns
 * how many may go. The page being filled always stays. */
static int plan_drop(const kv_seq *s, uint8_t *keep)
{
    int pt = s->cache->layout.page_tokens, n_lp = s->win.n_lp;
    if (n_lp == 0)
        return 0;
    memset(keep, 0, (size_t)n_lp);
    keep[n_lp - 1] = 1;
    FOR_SLOTS(s, k, i, {
        if (!keep[k / pt] && !slot_gone(s, k, i))
            keep[k / pt] = 1;
    });
    int gone = 0;
    for (int p = 0; p < n_lp; p++)
        gone += !keep[p];
    return gone;
}

/*
 * The drop before an append frees the dropped pages no one else holds; the
 * append then opens pages for the slots past the kept ones and writes into
 * the page being filled (the last one, always kept), which costs a private
 * copy per group where a fork shares it. A compaction of scattered dead
 * slots (drop_dead) only ever needs fewer pages than this counts.
 */
int64_t kv_window_need(const kv_seq *s, int n)
{
    const struct kv_window *w = &s->cache->win;
    if (!w->n_groups)
        return 0;
    const kv_cache *c = s->cache;
    int pt = c->layout.page_tokens, n_lp = s->win.n_lp;
    uint8_t *keep = s->win.keep; /* scratch (kv_window_reserve sized it) */
    int gone = plan_drop(s, keep);
    int kept = n_lp - gone;
    /* slots in the kept pages (the last one may be partial), then n more */
    int used = kept > 0 ? (kept - 1) * pt + (s->win.n_slots - (n_lp - 1) * pt) : 0;
    int64_t need = (((int64_t)used + n + pt - 1) / pt - kept) * w->n_groups;
    for (int g = 0; g < w->n_groups; g++) {
        for (int p = 0; p < n_lp; p++)
            need -= !keep[p] && !kv_pool_shared(c, group_table(s, g)[p]);
        if (n > 0 && used % pt != 0)
            need += kv_pool_shared(c, group_table(s, g)[n_lp - 1]);
    }
    return need;
}

/* Copy slot src's rows (every windowed layer, every KV head) to slot dst. */
static void move_slot(kv_seq *s, int dst, int src)
{
    const struct kv_layout *l = &s->cache->layout;
    int pt = l->page_tokens;
    for (int g = 0; g < s->cache->win.n_groups; g++) {
        int dp = group_table(s, g)[dst / pt], sp = group_table(s, g)[src / pt];
        for (int layer = 0; layer < l->page_layers; layer++)
            for (int h = 0; h < l->n_kv_head; h++) {
                memcpy(kv_layout_elem(l, dp, dst % pt, layer, h, false),
                       kv_layout_elem(l, sp, src % pt, layer, h, false), l->k_row_bytes);
                memcpy(kv_layout_elem(l, dp, dst % pt, layer, h, true),
                       kv_layout_elem(l, sp, src % pt, layer, h, true), l->v_row_bytes);
            }
    }
    s->win.hidx[dst] = s->win.hidx[src];
    s->win.pos[dst] = s->win.pos[src];
}

/*
 * Let the dead slots go: evicted ones, and with evicted_only false those
 * slot_gone lets go too. Whole local pages of dead slots first (the
 * page being filled excepted), which moves no byte; then, when a page's
 * worth of dead slots is still scattered among the live ones (scored
 * policies and turns evict from the middle), the live slots are compacted
 * over them, their rows copied whole, never changed, and the pages past
 * the new end given back - unless a page they would write into is shared
 * (a fork): then the dead slots stay until the pages are the sequence's
 * own or whole pages of them go.
 */
static void drop_dead(kv_seq *s, bool evicted_only)
{
    const struct kv_window *w = &s->cache->win;
    struct kv_wseq *q = &s->win;
    int pt = s->cache->layout.page_tokens;
    int n_dead = 0;
    FOR_SLOTS(s, k, i, {
        q->dead[k] = (uint8_t)(evicted_only ? i < 0 : slot_gone(s, k, i));
        n_dead += q->dead[k];
    });
    if (n_dead == 0)
        return;
    int d = 0, slots = 0, n_lp = q->n_lp;
    for (int p = 0; p < n_lp; p++) {
        int n_in = p < n_lp - 1 ? pt : q->n_slots - p * pt;
        bool all = p < n_lp - 1;
        for (int k = p * pt; all && k < p * pt + n_in; k++)
            all = q->dead[k];
        if (all) {
            for (int g = 0; g < w->n_groups; g++)
                kv_pool_unref(s->cache, group_table(s, g)[p]);
            n_dead -= n_in;
            continue;
        }
        for (int g = 0; g < w->n_groups; g++)
            group_table(s, g)[d] = group_table(s, g)[p];
        memmove(q->hidx + slots, q->hidx + p * pt, sizeof(int32_t) * (size_t)n_in);
        memmove(q->pos + slots, q->pos + p * pt, sizeof(int32_t) * (size_t)n_in);
        memmove(q->dead + slots, q->dead + p * pt, (size_t)n_in);
        slots += n_in;
        d++;
    }
    s->cache->window_pages_dropped += (uint64_t)(n_lp - d) * (uint64_t)w->n_groups;
    q->n_lp = d;
    q->n_slots = slots;
    int first = 0;
    while (first < q->n_slots && !q->dead[first])
        first++;
    /* Not a page's worth, the moves would not pay; over pages a fork
     * shares, they would cost copies the append's plan did not count. */
    if (n_dead < pt || !unshared_from(s, first / pt))
        return;
    int live = 0;
    for (int k = 0; k < q->n_slots; k++) {
        if (q->dead[k])
            continue;
        if (k != live)
            move_slot(s, live, k);
        live++;
    }
    int pages = (live + pt - 1) / pt;
    s->cache->window_pages_dropped += (uint64_t)(q->n_lp - pages) * (uint64_t)w->n_groups;
    release_from(s, pages, live);
}

void kv_window_drop(kv_seq *s, bool evicted_only)
{
    if (s->cache->win.n_groups && s->win.n_slots > 0)
        drop_dead(s, evicted_only);
}

/* ------------------------------------------------------------------------
 * Append, truncate
 * ------------------------------------------------------------------------ */

void kv_window_append(kv_seq *s, int n)
{
    const struct kv_window *w = &s->cache->win;
    struct kv_wseq *q = &s->win;
    if (!w->n_groups)
        return;
    int pt = s->cache->layout.page_tokens;
    int pages = (q->n_slots + n + pt - 1) / pt;
    assert(q->n_slots + n <= q->s_cap && pages <= q->lp_cap);
    if (q->n_slots % pt != 0) /* the page being filled: a fork's copy first */
        for (int g = 0; g < w->n_groups; g++)
            kv_pool_unshare(s->cache, &group_table(s, g)[q->n_lp - 1]);
    for (int p = q->n_lp; p < pages; p++)
        for (int g = 0; g < w->n_groups; g++)
            group_table(s, g)[p] = kv_pool_alloc(s->cache);
    q->n_lp = pages;
    const int32_t *pos = s->pos + s->t_off, *hidx = s->hidx + s->t_off;
    for (int j = 0; j < n; j++) {
        int i = s->n_tokens - n + j;
        q->hidx[q->n_slots] = hidx[i];
        q->pos[q->n_slots++] = pos[i];
    }
}

/*
 * Whether the local class still holds every token a query at next_pos
 * can see, with the main table cut to its first `keep` tokens: no
 * retained token missing from the slots is inside the window.
 */
static bool complete_for(const kv_seq *s, int keep, int32_t next_pos)
{
    const int32_t *pos = s->pos + s->t_off, *hidx = s->hidx + s->t_off;
    int64_t floor = (int64_t)next_pos - s->cache->win.window;
    for (int i = keep - 1; i >= 0 && pos[i] > floor; i--)
        if (slot_of(s, hidx[i]) < 0)
            return false;
    return true;
}

int kv_window_truncate_ok(const kv_seq *s, int keep, int32_t next_pos)
{
    if (!s->cache->win.n_groups)
        return 0;
    return complete_for(s, keep, next_pos) ? 0 : -ESTALE;
}

void kv_window_truncate(kv_seq *s, int n_hist)
{
    struct kv_wseq *q = &s->win;
    if (!s->cache->win.n_groups)
        return;
    int pt = s->cache->layout.page_tokens, k = q->n_slots;
    while (k > 0 && q->hidx[k - 1] >= n_hist)
        k--;
    release_from(s, (k + pt - 1) / pt, k);
    kv_window_sync(s);
}

/*
 * Whether the sequence may take policy p and turn table (turns, n): every
 * slot already dropped stays unreachable under them. A dropped token is
 * retained but has no slot; it must be invisible and unable to return.
 */
bool kv_window_accepts(const kv_seq *s, const struct kv_policy *p, const struct kv_turn *turns,
                       int n)
{
    if (!s->cache->win.n_groups)
        return true;
    kv_seq probe = *s; /* the same state, asked with the new rules */
    probe.policy = *p;
    probe.turns = (struct kv_turn *)turns;
    probe.n_turns = n;
    const int32_t *hidx = s->hidx + s->t_off;
    int k = 0;
    for (int i = 0; i < s->n_tokens; i++) {
        while (k < s->win.n_slots && s->win.hidx[k] < hidx[i])
            k++;
        if (k < s->win.n_slots && s->win.hidx[k] == hidx[i])
            continue;
        if (could_return(&probe, p, i, hidx[i]))
            return false;
    }
    return true;
}

/* ------------------------------------------------------------------------
 * Views for the kernel, rows for the forward pass
 * ------------------------------------------------------------------------ */

void kv_seq_layer_view(const kv_seq *s, int layer, struct kv_seq_view *out)
{
    int g = s->cache->win.group[layer];
    if (g < 0) {
        *out = (struct kv_seq_view){.page_table = kv_seq_page_table(s),
                                    .pos = kv_seq_positions(s),
                                    .n_kv = s->n_tokens};
        return;
    }
    *out = (struct kv_seq_view){.page_table = s->win.ptab ? group_table(s, g) : NULL,
                                .pos = s->win.pos,
                                .n_kv = s->win.n_slots,
                                .local = true};
}

int kv_seq_window_slots(const kv_seq *s)
{
    return s->win.n_slots;
}

void *kv_window_row(kv_seq *s, int layer, int kv_head, int idx, bool v)
{
    const struct kv_layout *l = &s->cache->layout;
    int32_t h = s->hidx[s->t_off + idx];
    /* new tokens are the last slots: look there first */
    int k = s->win.n_slots - (s->n_tokens - idx);
    if (k < 0 || s->win.hidx[k] != h)
        k = slot_of(s, h);
    assert(k >= 0);
    int pt = l->page_tokens, g = s->cache->win.group[layer];
    return kv_layout_elem(l, group_table(s, g)[k / pt], k % pt, s->cache->win.slot[layer],
                          kv_head, v);
}

void kv_seq_add_window_mass(kv_seq *s, const float *mass)
{
    float *m = s->mass + s->t_off;
    FOR_SLOTS(s, k, i, {
        if (i >= 0)
            m[i] += mass[k];
    });
}

/* ------------------------------------------------------------------------
 * Accounting
 * ------------------------------------------------------------------------ */

/* The formula of kv_cache_sequence_pages, from the layer counts. */
static int64_t sequence_pages(int n_global, int groups, int w, int pt, const struct kv_policy *pol,
                              int chunk_tokens)
{
    struct kv_budget b;
    kv_policy_budget(pol, pt, &b);
    if (!groups)
        return b.sequence_pages;
    int64_t main_pages = n_global > 0 ? b.sequence_pages : 0;
    int64_t local = b.sequence_pages;
    bool stuck = pol->renumber && (kv_policy_scored(pol->kind) ||
                                   (pol->kind == KV_EVICT_SINK_WINDOW && pol->window_tokens < w));
    /* live slots (the window and a chunk, or every retained token), fewer
     * than a page of dead ones left scattered, the page being filled */
    int64_t chunk = chunk_tokens > 0 ? chunk_tokens : 1;
    int64_t win = ((int64_t)w + chunk + pt - 1) / pt + 2;
    local = stuck || win > local + 1 ? local + 1 : win;
    return main_pages + local * groups;
}

int64_t kv_cache_sequence_pages(const struct kv_cache_params *p, const struct kv_policy *pol,
                                int chunk_tokens)
{
    int groups, ng, nl, w;
    kv_window_page_layers(p, &groups);
    count_layers(p, &ng, &nl, &w);
    return sequence_pages(ng, groups, w, p->page_tokens > 0 ? p->page_tokens : 1, pol,
                          chunk_tokens);
}

int64_t kv_cache_pages_for(const kv_cache *c, const struct kv_policy *pol, int tokens,
                           int chunk_tokens)
{
    struct kv_policy p = *pol;
    p.max_cache_tokens = tokens < pol->max_cache_tokens ? tokens : pol->max_cache_tokens;
    return sequence_pages(c->win.n_global, c->win.n_groups, c->win.window,
                          c->layout.page_tokens, &p, chunk_tokens);
}

int kv_cache_token_pages(const kv_cache *c)
{
    return (c->win.n_global > 0 || !c->win.n_groups ? 1 : 0) + c->win.n_groups;
}

int kv_seq_pool_pages(const kv_seq *s)
{
    return kv_seq_pages_held(s);
}

int kv_window_check(const kv_seq *s, struct kv_check_tally *t, char *err, size_t errlen)
{
    const kv_cache *c = s->cache;
    const struct kv_wseq *q = &s->win;
    int pt = c->layout.page_tokens;
    if (!c->win.n_groups)
        return 0;
    if (!err)
        errlen = 0; /* snprintf(NULL, 0, ...) only measures */
    if (q->n_lp != (q->n_slots + pt - 1) / pt) {
        snprintf(err, errlen, "sequence %d holds %d local pages for %d window slots", s->uid,
                 q->n_lp, q->n_slots);
        return -EFAULT;
    }
    for (int k = 1; k < q->n_slots; k++) {
        if (q->hidx[k] <= q->hidx[k - 1]) {
            snprintf(err, errlen, "sequence %d: window slot history not increasing at %d", s->uid,
                     k);
            return -EFAULT;
        }
    }
    for (int g = 0; g < c->win.n_groups; g++) {
        for (int p = 0; p < q->n_lp; p++) {
            int32_t id = group_table(s, g)[p];
            const char *why = kv_check_entry(c, t, s->uid, id);
            if (why) {
                snprintf(err, errlen, "sequence %d local page %d of group %d (id %d) %s",
                         s->uid, p, g, id, why);
                return -EFAULT;
            }
        }
    }
    /* every retained token a query at next_pos can see has its slot, with
     * the position the main table gives it */
    if (!complete_for(s, s->n_tokens, s->next_pos)) {
        snprintf(err, errlen, "sequence %d: a token inside the window has no window slot", s->uid);
        return -EFAULT;
    }
    const int32_t *pos = s->pos + s->t_off;
    int bad = -1;
    FOR_SLOTS(s, k, i, {
        if (bad < 0 && q->pos[k] != (i >= 0 ? pos[i] : WIN_GONE))
            bad = k;
    });
    if (bad >= 0) {
        snprintf(err, errlen, "sequence %d: window slot %d has position %d, not its token's",
                 s->uid, bad, q->pos[bad]);
        return -EFAULT;
    }
    return 0;
}
