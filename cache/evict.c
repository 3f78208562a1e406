/*
 * evict.c - eviction policies: which cached tokens a sequence gives up when
 * it has to, and how, without touching the bytes of the ones it keeps.
 *
 * ---------------------------------------------------------------------------
 * Why middle-token eviction, and why it is cheap here
 * ---------------------------------------------------------------------------
 *
 * A model attends over everything in its cache. When a conversation outgrows
 * the cache, something must go. Dropping the oldest tokens (a plain sliding
 * window) breaks models badly: the first few tokens of a sequence collect a
 * large share of every head's attention whatever they say ("attention
 * sinks"), and once they are gone the softmax has nowhere to put that mass.
 * StreamingLLM's observation is that keeping those first tokens plus a
 * window of recent ones is enough for the model to go on fluently; H2O's is
 * that among the middle tokens a few "heavy hitters" receive most of the
 * attention, and keeping those preserves more of what the middle said.
 * Both evict from the middle.
 *
 * The usual way to evict from the middle of a cache that holds *rotated*
 * keys (llama.cpp's context shift) is to drop the cells and then rotate
 * every retained key again by the position delta, so that the survivors
 * look as if they had always been at their new positions: O(retained tokens
 * x layers x heads x head_dim) arithmetic per shift, rewriting most of the
 * cache. kvd stores keys before rotation and lets the kernel rotate (or bias,
 * for ALiBi and T5) from a per-token position number. Moving a token to a
 * new position is then a change to one int32; the K and V bytes of a token
 * that stays are never rewritten. That is invariant 1, and every algorithm
 * below keeps it.
 *
 * ---------------------------------------------------------------------------
 * When eviction runs
 * ---------------------------------------------------------------------------
 *
 * Eviction is driven by appends (seq.c, kv_seq_append). Before an append of
 * n tokens the sequence must satisfy n_tokens + n <= max_cache_tokens, and
 * the pool must have the pages. The append asks kv_evict_plan how far the
 * policy would shrink the sequence to meet the budget, then, if the pool is
 * still short, first drops idle sessions (LRU, seq.c) and only then asks the
 * policy to shrink this sequence further, down to its floor: what the policy
 * never gives up. Everything is planned before anything changes, so a
 * refused append leaves the cache exactly as it was. kv_evict_apply then
 * carries out the plan and cannot fail.
 *
 * ---------------------------------------------------------------------------
 * sink-window (StreamingLLM), page-granular
 * ---------------------------------------------------------------------------
 *
 * The sequence is [sinks | middle | window]. Sinks round up to whole pages:
 * the first sp = ceil(sink_tokens / page_tokens) logical pages are never
 * evicted. A page after the sinks may be evicted only if all of its tokens
 * lie before the last window_tokens tokens, so at least window_tokens recent
 * tokens always survive. Eviction frees such pages oldest first, as many as
 * the budget (or the pool) needs, and nothing finer than a page: one step
 * costs O(sink pages + pages freed) of page-table work and O(sink tokens) of
 * token-array work (the short sinks slide forward over the gap instead of
 * the long window sliding back; see cache_internal.h), plus O(retained) to
 * renumber positions when the policy renumbers. Since every page but the
 * last is full and only whole pages leave, logical token i stays at page
 * i / page_tokens, slot i % page_tokens: no byte moves at all.
 *
 * When the sequence sits at its budget, each step frees the budget's step
 * (kv_budget.step_tokens) where the window leaves that many evictable
 * pages: a page below budgets of 512 pages, else 1/256 of the budget. The
 * renumber is O(retained), so a one-page step at 128k costs microseconds
 * per evicted token, more than a context shift's re-rotation per token;
 * freeing budget / 256 at once spreads it to about 256 position writes per
 * evicted token at every budget (bench_cache measures both). The automatic
 * window leaves exactly that slack; an explicit window bounds the step by
 * the slack it leaves, and the tokens kept are always the sinks and at
 * least the window. kv_policy_check demands
 * max_cache_tokens >= sp*page_tokens + window_tokens + page_tokens so that a
 * full sequence always has at least one evictable page.
 *
 * ---------------------------------------------------------------------------
 * h2o (heavy hitters), token-granular with compaction
 * ---------------------------------------------------------------------------
 *
 * The sequence is [sinks | middle | window] with exactly sink_tokens sinks
 * and window_tokens recent tokens. Each token carries the attention mass it
 * has accumulated (kv_seq_add_mass, fed from the kernel's optional output).
 * When the budget is exceeded, the step keeps the heavy_tokens middle tokens
 * with the largest mass (ties go to the more recent token) and evicts every
 * other middle token, in one step down to sinks + window + heavy, so that at
 * least a page's worth of tokens (kv_policy_check requires the slack) is
 * freed per step and its O(middle) selection (a quickselect of the heavy
 * best, not a sort) is amortised.
 *
 * Survivors are then compacted toward the front in order: a token that
 * moves from logical slot i to slot d < i has its K and V rows copied whole
 * (memcpy, every layer and KV head) and its position, id, history index and
 * mass moved with it; the bytes are never changed, only their address. The
 * pages past the new end go back to the pool. Copying is the step's cost
 * (O(retained x bytes per token) when the first evicted token is near the
 * front), and most of the survivors are usually the window, one run at
 * the end. When the step frees whole pages' worth of tokens - always so
 * for a decode step under an automatic window, which frees one page - that
 * run's tokens land on the same slots of other pages, so its whole pages
 * move down the page table instead, sink-window's way, and the pages they
 * land on (which held only tokens already moved or evicted) go back to the
 * pool: only the heavy survivors after the first gap and the run's first
 * partial page are copied.
 *
 * tova, knorm and snapkv have h2o's shape and step and differ only in the
 * score that ranks the middle: see evict_scored.c.
 *
 * ---------------------------------------------------------------------------
 * Pinned spans
 * ---------------------------------------------------------------------------
 *
 * A sequence may carry pins, history-index spans no policy evicts (pins.c
 * says why, and what they cost the budget). Both steps above keep them
 * with no change to their shape: the scored step keeps the pinned middle
 * tokens unranked and ranks the rest for the heavy_tokens places; the
 * sink-window step skips the pages that hold a pinned token and frees the
 * next unpinned ones, sliding what stays before the last freed page (the
 * sinks and the pinned pages) forward, page ids and token metadata only.
 * Without pins that is exactly the sink slide above.
 *
 * ---------------------------------------------------------------------------
 * Positions
 * ---------------------------------------------------------------------------
 *
 * renumber: after every eviction the survivors get positions 0..n-1 in
 * order, and the next token continues at n; the model never sees an offset
 * larger than its cache. With keys stored unrotated, attention over the
 * evicted cache equals attention over a fresh cache holding only the
 * survivors (invariant 3). preserve: a token keeps the position it was first
 * given, gaps and all; the next token continues after the last position
 * ever assigned.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Policy descriptions
 * ------------------------------------------------------------------------ */

static const char *const kind_names[] = {
    [KV_EVICT_NONE] = "none",
    [KV_EVICT_SINK_WINDOW] = "sink-window",
    [KV_EVICT_H2O] = "h2o",
    [KV_EVICT_TOVA] = "tova",
    [KV_EVICT_KNORM] = "knorm",
    [KV_EVICT_SNAPKV] = "snapkv",
};

const char *kv_policy_kind_name(enum kv_policy_kind kind)
{
    if ((unsigned)kind < sizeof(kind_names) / sizeof(kind_names[0]))
        return kind_names[kind];
    return "unknown";
}

int kv_policy_parse_kind(const char *name, enum kv_policy_kind *out)
{
    if (!name)
        return -EINVAL;
    for (size_t k = 0; k < sizeof(kind_names) / sizeof(kind_names[0]); k++) {
        if (strcmp(name, kind_names[k]) == 0) {
            *out = (enum kv_policy_kind)k;
            return 0;
        }
    }
    return -EINVAL;
}

/* Budget / STEP_DIVISOR, in whole pages, is sink-window's eviction step. */
#define STEP_DIVISOR 256

/* sink-window: the step (kv_cache.h's budget terms): budget / STEP_DIVISOR
 * in whole pages, at least one, within the slack an explicit window leaves
 * (at the budget only the pages before the window may go) and, for the
 * automatic window, the room (the window keeps at least a page). */
static int64_t eviction_step(const struct kv_policy *p, int64_t page, const struct kv_budget *b)
{
    int64_t step = p->max_cache_tokens / (STEP_DIVISOR * page) * page;
    int64_t slack = p->window_tokens > 0 ? p->max_cache_tokens - b->kept_tokens - p->window_tokens
                                         : b->window_room;
    slack = slack / page * page;
    if (step > slack)
        step = slack;
    return step > page ? step : page;
}

void kv_policy_budget(const struct kv_policy *p, int page_tokens, struct kv_budget *out)
{
    int64_t page = page_tokens > 0 ? page_tokens : 1;
    int64_t max = p->max_cache_tokens, sinks = p->sink_tokens > 0 ? p->sink_tokens : 0;
    *out = (struct kv_budget){
        .window_room = max,
        .window_tokens = p->window_tokens,
        .need_tokens = 1,
        .sequence_pages = (max > 0 ? (max + page - 1) / page : 0) + 1,
    };
    out->step_tokens = page;
    switch (p->kind) {
    case KV_EVICT_SINK_WINDOW:
        out->kept_tokens = (sinks + page - 1) / page * page; /* sinks are whole pages */
        break;
    default:
        if (!kv_policy_scored(p->kind))
            return; /* none: nothing kept, nothing evicted */
        out->kept_tokens = sinks + p->heavy_tokens; /* token-granular */
    }
    out->floor_tokens = out->kept_tokens + page;
    out->window_room = max - out->floor_tokens;
    if (p->kind == KV_EVICT_SINK_WINDOW)
        out->step_tokens = eviction_step(p, page, out);
    if (p->window_tokens <= 0) {
        int64_t w = out->window_room - (out->step_tokens - page);
        out->window_tokens = w > 0 ? w : 0;
    }
    out->need_tokens = out->floor_tokens + p->window_tokens;
}

int kv_policy_position_bound(const struct kv_policy *p)
{
    return p->renumber ? p->max_cache_tokens : 0;
}

int kv_policy_check(const struct kv_policy *p, int page_tokens, char *err, size_t errlen)
{
#define REJECT(...)                                                                                \
    do {                                                                                           \
        if (err)                                                                                   \
            snprintf(err, errlen, __VA_ARGS__);                                                    \
        return -EINVAL;                                                                            \
    } while (0)
    if (!p)
        REJECT("eviction: no policy");
    if (page_tokens < 1)
        REJECT("eviction: page_tokens must be >= 1 (got %d)", page_tokens);
    if ((unsigned)p->kind >= sizeof(kind_names) / sizeof(kind_names[0]))
        REJECT("eviction: unknown policy kind %d", (int)p->kind);
    const char *name = kv_policy_kind_name(p->kind);
    if (p->max_cache_tokens < 1)
        REJECT("eviction %s: max_cache_tokens must be >= 1 (got %d)", name, p->max_cache_tokens);
    if (p->sink_tokens < 0 || p->window_tokens < 0 || p->heavy_tokens < 0)
        REJECT("eviction %s: sink_tokens, window_tokens and heavy_tokens must be >= 0 "
               "(got %d, %d, %d)",
               name, p->sink_tokens, p->window_tokens, p->heavy_tokens);
    if (p->kind == KV_EVICT_SNAPKV && (p->observe_tokens < 1 || p->pool_tokens < 1))
        REJECT("eviction snapkv: observe_tokens and pool_tokens must be >= 1 (got %d, %d)",
               p->observe_tokens, p->pool_tokens);

    struct kv_budget b;
    kv_policy_budget(p, page_tokens, &b);
    if (p->max_cache_tokens >= b.need_tokens)
        return 0;
    if (p->kind == KV_EVICT_SINK_WINDOW)
        REJECT("eviction sink-window: max_cache_tokens %d is smaller than the sinks "
               "(%d tokens round up to %lld, whole %d-token pages) + window_tokens %d + "
               "one page %d: eviction could never free a page; need at least %lld",
               p->max_cache_tokens, p->sink_tokens, (long long)b.kept_tokens, page_tokens,
               p->window_tokens, page_tokens, (long long)b.need_tokens);
    REJECT("eviction %s: max_cache_tokens %d is smaller than sink_tokens %d + "
           "window_tokens %d + heavy_tokens %d + one page %d: an eviction step "
           "would free less than a page; need at least %lld",
           name, p->max_cache_tokens, p->sink_tokens, p->window_tokens, p->heavy_tokens, page_tokens,
           (long long)b.need_tokens);
#undef REJECT
}

/* ------------------------------------------------------------------------
 * Planning
 * ------------------------------------------------------------------------ */

/* sink-window: the whole pages the sinks occupy (the budget's kept tokens). */
static int sink_pages(const struct kv_policy *p, int page_tokens)
{
    struct kv_budget b;
    kv_policy_budget(p, page_tokens, &b);
    return (int)(b.kept_tokens / page_tokens);
}

/* sink-window: pages among [p0, p1) holding a pinned token (pins.c). With
 * mark, also set mark[p] = 2 for each of them. */
static int pinned_pages(const kv_seq *s, int p0, int p1, uint8_t *mark)
{
    int pt = s->cache->layout.page_tokens, n = 0, next = p0;
    for (int k = 0; k < s->n_pins; k++) {
        int lo, hi;
        kv_pins_range(s, k, &lo, &hi);
        if (hi == lo)
            continue;
        int a = lo / pt > next ? lo / pt : next, b = (hi - 1) / pt + 1 < p1 ? (hi - 1) / pt + 1 : p1;
        for (int p = a; mark && p < b; p++)
            mark[p] = 2;
        if (b > a) {
            n += b - a;
            next = b;
        }
    }
    return n;
}

/* sink-window: the end of the pages lying wholly before the window. */
static int window_page(const kv_seq *s)
{
    int before_window = s->n_tokens - s->policy.window_tokens;
    return before_window > 0 ? before_window / s->cache->layout.page_tokens : 0;
}

/* sink-window: pages after the sinks lying wholly before the window and
 * holding no pinned token. */
static int evictable_pages(const kv_seq *s)
{
    int sp = sink_pages(&s->policy, s->cache->layout.page_tokens), bw = window_page(s);
    if (bw <= sp)
        return 0;
    return bw - sp - pinned_pages(s, sp, bw, NULL);
}

/* Scored policies: the sinks and the window of the sequence as it is. */
static void scored_ends(const kv_seq *s, int *sinks, int *window)
{
    int n = s->n_tokens;
    *sinks = s->policy.sink_tokens < n ? s->policy.sink_tokens : n;
    *window = s->policy.window_tokens < n - *sinks ? s->policy.window_tokens : n - *sinks;
}

/* Scored policies: tokens kept when they evict (the pinned middle ones
 * beside the heavy). */
static int h2o_keep(const kv_seq *s)
{
    int sinks, window;
    scored_ends(s, &sinks, &window);
    int64_t keep = (int64_t)sinks + window + s->policy.heavy_tokens +
                   kv_pins_count(s, sinks, s->n_tokens - window);
    return keep < s->n_tokens ? (int)keep : s->n_tokens;
}

int kv_evict_floor(const kv_seq *s)
{
    if (kv_policy_scored(s->policy.kind))
        return h2o_keep(s);
    switch (s->policy.kind) {
    case KV_EVICT_SINK_WINDOW:
        return s->n_tokens - evictable_pages(s) * s->cache->layout.page_tokens;
    default:
        break;
    }
    return s->n_tokens;
}

int kv_evict_plan(const kv_seq *s, int target)
{
    if (s->n_tokens <= target)
        return s->n_tokens;
    if (target < 0 || kv_evict_floor(s) > target)
        return -1;
    if (kv_policy_scored(s->policy.kind))
        return h2o_keep(s); /* one step down to the floor */
    switch (s->policy.kind) {
    case KV_EVICT_SINK_WINDOW: {
        /* the fewest whole pages, or the budget's step where the window
         * leaves that many evictable: the step's O(retained) renumber is
         * spread over at least step_tokens tokens */
        int pt = s->cache->layout.page_tokens;
        int pages = (s->n_tokens - target + pt - 1) / pt;
        struct kv_budget b;
        kv_policy_budget(&s->policy, pt, &b);
        int step = (int)(b.step_tokens / pt), ev = evictable_pages(s);
        if (pages < step)
            pages = step < ev ? step : ev;
        return s->n_tokens - pages * pt;
    }
    default:
        break;
    }
    return -1;
}

/* ------------------------------------------------------------------------
 * Execution
 * ------------------------------------------------------------------------ */

void kv_evict_renumber(kv_seq *s)
{
    int32_t *pos = s->pos + s->t_off;
    for (int i = 0; i < s->n_tokens; i++)
        pos[i] = i;
    s->next_pos = s->n_tokens;
}

/* Move n entries of every per-token array from logical index src to dst. */
static void move_token_meta(kv_seq *s, int dst, int src, int n)
{
    int d = s->t_off + dst, o = s->t_off + src;
    memmove(s->pos + d, s->pos + o, sizeof(int32_t) * (size_t)n);
    memmove(s->ids + d, s->ids + o, sizeof(int32_t) * (size_t)n);
    memmove(s->hidx + d, s->hidx + o, sizeof(int32_t) * (size_t)n);
    memmove(s->mass + d, s->mass + o, sizeof(float) * (size_t)n);
}

/* Mark in mark[0..*scan) the pages evict_pages(s, k) frees (1), those it
 * keeps for their pins (2) and the rest (0); returns the last one freed.
 * Pages from *scan on are not looked at (kept). */
static int mark_gone(const kv_seq *s, int k, uint8_t *mark, int *scan)
{
    int sp = sink_pages(&s->policy, s->cache->layout.page_tokens);
    assert(k > 0 && k <= evictable_pages(s));
    *scan = s->n_pins > 0 ? window_page(s) : sp + k;
    memset(mark, 0, (size_t)*scan);
    pinned_pages(s, sp, *scan, mark);
    int last = -1;
    for (int p = sp, left = k; left > 0; p++)
        if (mark[p] == 0) {
            mark[p] = 1;
            last = p;
            left--;
        }
    return last;
}

/*
 * Free the k oldest evictable pages: after the sinks, wholly before the
 * window, holding no pinned token. Without pins they are the k pages right
 * after the sinks. Everything before the last freed page that stays (the
 * sinks, pinned pages) slides forward over the gaps, page ids and token
 * metadata only; the offsets advance past the k pages.
 */
static void evict_pages(kv_seq *s, int k)
{
    kv_cache *c = s->cache;
    int pt = c->layout.page_tokens, scan;
    uint8_t *mark = s->keep; /* 2 pinned, 1 freed, 0 kept */
    int last = mark_gone(s, k, mark, &scan);

    int32_t *ptab = s->ptab + s->p_off;
    int d = last;
    for (int p = last; p >= 0; p--) {
        if (mark[p] == 1) {
            kv_pool_unref(c, ptab[p]); /* freed unless another holder reads it */
            continue;
        }
        if (d != p) {
            ptab[d] = ptab[p];
            move_token_meta(s, d * pt, p * pt, pt);
        }
        d--;
    }
    assert(d == k - 1);
    s->p_off += k;
    s->n_pages -= k;
    s->t_off += k * pt;
    s->n_tokens -= k * pt;
}

/* Rank order for h2o: larger mass first, NaN last, ties to the later token. */
static int rank_cmp(const void *a, const void *b)
{
    const struct kv_rank *x = a, *y = b;
    bool xn = isnan(x->mass), yn = isnan(y->mass);
    if (xn != yn)
        return xn ? 1 : -1;
    if (!xn && x->mass != y->mass)
        return x->mass > y->mass ? -1 : 1;
    return x->idx > y->idx ? -1 : (x->idx < y->idx);
}

/* Copy token src's K and V rows (every layer, every KV head) to slot dst.
 * A shared destination page is copied first (the pool's plan counted it in
 * kv_evict_effect's written range): the other holders keep their bytes. */
static void move_token_bytes(kv_seq *s, int dst, int src)
{
    const struct kv_layout *l = &s->cache->layout;
    int pt = l->page_tokens;
    kv_seq_unshare(s, dst / pt);
    const int32_t *ptab = s->ptab + s->p_off;
    int dp = ptab[dst / pt], ds = dst % pt, sp = ptab[src / pt], ss = src % pt;
    /* every slot of the main pages (the windowed layers' own pages follow
     * the history and never move: window.c) */
    int slots = s->cache->win.n_global ? l->page_layers : 0;
    for (int layer = 0; layer < slots; layer++)
        for (int h = 0; h < l->n_kv_head; h++) {
            memcpy(kv_layout_elem(l, dp, ds, layer, h, false),
                   kv_layout_elem(l, sp, ss, layer, h, false), l->k_row_bytes);
            memcpy(kv_layout_elem(l, dp, ds, layer, h, true),
                   kv_layout_elem(l, sp, ss, layer, h, true), l->v_row_bytes);
        }
}

void kv_evict_move_token(kv_seq *s, int dst, int src)
{
    move_token_bytes(s, dst, src);
    move_token_meta(s, dst, src, 1);
}

/*
 * Reorder r[0..m) so that its first k entries are the first k in rank
 * order (in some order): quickselect, O(m) on average, where a sort was
 * O(m log m). rank_cmp is a total order (history indices are distinct),
 * so the set is the one a sort would put first. After 64 rounds without
 * settling (an adversarial order) the rest is sorted.
 */
static void rank_select(struct kv_rank *r, int m, int k)
{
    int lo = 0, hi = m, rounds = 64;
    while (k > lo && k < hi && hi - lo > 16 && rounds-- > 0) {
        struct kv_rank a = r[lo], b = r[lo + (hi - lo) / 2], c = r[hi - 1], p;
        if (rank_cmp(&a, &b) < 0)
            p = rank_cmp(&b, &c) < 0 ? b : rank_cmp(&a, &c) < 0 ? c : a;
        else
            p = rank_cmp(&a, &c) < 0 ? a : rank_cmp(&b, &c) < 0 ? c : b;
        int i = lo, j = hi - 1; /* Hoare: [lo, j] before p, [i, hi) after */
        while (i <= j) {
            while (rank_cmp(&r[i], &p) < 0)
                i++;
            while (rank_cmp(&r[j], &p) > 0)
                j--;
            if (i <= j) {
                struct kv_rank t = r[i];
                r[i++] = r[j];
                r[j--] = t;
            }
        }
        if (k <= j)
            hi = j + 1;
        else if (k >= i)
            lo = i;
        else
            return; /* the boundary falls on p: settled */
    }
    if (k > lo && k < hi)
        qsort(r + lo, (size_t)(hi - lo), sizeof(*r), rank_cmp);
}

/* Whether logical pages [a, b) of s are held by s alone. The page-table
 * move below frees other pages than the tail kv_evict_effect counted for
 * the pool's plan; the counts agree when none of them is shared. */
static bool pages_unshared(const kv_seq *s, int a, int b)
{
    const int32_t *ptab = s->ptab + s->p_off;
    for (int p = a < 0 ? 0 : a; p < b; p++)
        if (kv_pool_shared(s->cache, ptab[p]))
            return false;
    return true;
}

/*
 * Compact the survivors marked in s->keep toward the front, in order, so
 * that `keep` remain, and give back the pages past the end. When the gap
 * is whole pages (always so for a decode step under an automatic window,
 * which frees exactly one page), the run of survivors at the end (the
 * window, at least) keeps its slots: its whole pages move down the page
 * table and the pages they replace go back to the pool, so only the
 * survivors before that run (the heavy middle tokens after the first
 * evicted one, and the run's partial first page) have their K/V copied.
 * Pages shared with another holder (kv_seq_fork, a cached prefix) take
 * the copying way, which the pool's plan (kv_evict_effect) counts.
 */
static void compact_survivors(kv_seq *s, int keep)
{
    kv_cache *c = s->cache;
    const uint8_t *kp = s->keep;
    int n = s->n_tokens, pt = c->layout.page_tokens, gap = n - keep;
    int tail = n; /* survivors [tail, n) */
    while (tail > 0 && kp[tail - 1])
        tail--;
    int p0 = (tail + pt - 1) / pt; /* the run's first whole page */
    int stop = gap % pt == 0 && p0 < s->n_pages && pages_unshared(s, p0 - gap / pt, s->n_pages)
                   ? p0 * pt
                   : n;
    int d = 0;
    for (int i = 0; i < stop; i++) {
        if (!kp[i])
            continue;
        if (i != d)
            kv_evict_move_token(s, d, i);
        d++;
    }
    if (stop == n) {
        assert(d == keep);
        kv_seq_cut_to(s, d); /* give back the pages past the new end */
        return;
    }
    /* Pages [p0, n_pages) move down by gap / pt; the ones they land on held
     * only tokens already copied or evicted. */
    int down = gap / pt;
    int32_t *ptab = s->ptab + s->p_off;
    assert(d == stop - gap && p0 - down >= 0);
    for (int p = p0 - down; p < p0; p++)
        kv_pool_unref(c, ptab[p]);
    memmove(ptab + p0 - down, ptab + p0, sizeof(int32_t) * (size_t)(s->n_pages - p0));
    move_token_meta(s, d, stop, n - stop);
    s->n_pages -= down;
    s->n_tokens = keep;
}

/* Keep sinks, window, the pinned middle tokens and the `keep - sinks -
 * window - pinned` other middle tokens of the highest score
 * (kv_evict_score: h2o's mass, or another policy's score); compact. */
static void evict_h2o(kv_seq *s, int keep)
{
    int n = s->n_tokens, sinks, window;
    scored_ends(s, &sinks, &window);
    int mid_lo = sinks, mid_hi = n - window, heavy = keep - sinks - window;

    /* The pinned middle tokens stay unranked; the heavy hitters of the
     * rest join them. */
    uint8_t *kp = s->keep;
    memset(kp, 1, (size_t)n);
    memset(kp + mid_lo, 0, (size_t)(mid_hi - mid_lo));
    for (int k = 0; k < s->n_pins; k++) {
        int lo, hi;
        kv_pins_range(s, k, &lo, &hi);
        for (int i = lo > mid_lo ? lo : mid_lo; i < hi && i < mid_hi; i++, heavy--)
            kp[i] = 1;
    }
    assert(heavy >= 0);
    int m = 0;
    for (int i = mid_lo; i < mid_hi; i++)
        if (!kp[i])
            s->rank[m++] = (struct kv_rank){.mass = kv_evict_score(s, i, mid_lo, mid_hi), .idx = i};
    assert(heavy <= m);
    rank_select(s->rank, m, heavy);
    for (int r = 0; r < heavy; r++)
        kp[s->rank[r].idx] = 1;
    compact_survivors(s, keep);
}

void kv_evict_effect(const kv_seq *s, int keep, struct kv_effect *out)
{
    const kv_cache *c = s->cache;
    const int32_t *ptab = s->ptab ? s->ptab + s->p_off : NULL;
    int pt = c->layout.page_tokens, kept_pages = kv_pages_for(c, keep);
    *out = (struct kv_effect){.last = kept_pages - 1};
    if (keep >= s->n_tokens) {
        out->last = s->n_pages - 1;
        return;
    }
    if (s->policy.kind == KV_EVICT_SINK_WINDOW) {
        /* Whole pages after the sinks (and the pinned ones); nothing is
         * written. The scratch marks are evict_pages' own, recomputed there. */
        int scan;
        mark_gone(s, (s->n_tokens - keep) / pt, s->keep, &scan);
        for (int p = 0; p < scan; p++)
            out->freed += s->keep[p] == 1 && !kv_pool_shared(c, ptab[p]);
        out->last = s->n_pages - 1;
        while (out->last >= 0 && out->last < scan && s->keep[out->last] == 1)
            out->last--;
        return;
    }
    for (int j = kept_pages; j < s->n_pages; j++) /* the tail goes */
        out->freed += !kv_pool_shared(c, ptab[j]);
    if (kv_policy_scored(s->policy.kind)) {
        /* The first token that may move is the first middle one. */
        int sinks = s->policy.sink_tokens < s->n_tokens ? s->policy.sink_tokens : s->n_tokens;
        out->write_lo = sinks / pt;
        out->write_hi = kept_pages;
    }
}

int kv_evict_apply(kv_seq *s, int keep)
{
    int before = s->n_tokens;
    if (keep >= before)
        return 0;
    switch (s->policy.kind) {
    case KV_EVICT_SINK_WINDOW: {
        int pt = s->cache->layout.page_tokens;
        assert((before - keep) % pt == 0);
        evict_pages(s, (before - keep) / pt);
        break;
    }
    case KV_EVICT_NONE:
        assert(!"policy none never evicts");
        return 0;
    default:
        assert(kv_policy_scored(s->policy.kind));
        evict_h2o(s, keep);
        break;
    }
    if (s->policy.renumber)
        kv_evict_renumber(s);
    s->cache->evictions++;
    s->cache->tokens_evicted += (uint64_t)(before - s->n_tokens);
    return before - s->n_tokens;
}
