/*
 * seq.c - sequences and sessions: page tables, per-token positions and ids,
 * appends that make room first, and the LRU that drops idle sessions.
 *
 * A sequence is a page table plus, for every retained token, its position
 * number, token id, history index and accumulated attention mass. An append
 * is the only operation that needs memory, so it is planned in full before
 * it changes anything: how far the policy must evict to meet the budget,
 * which idle sessions must go if the pool is short, how much further this
 * sequence must shrink if that is still not enough, and whether the
 * bookkeeping arrays have room. Only when every step is known to succeed is
 * it carried out, so a refused append (-ENOSPC, -ENOMEM) leaves the cache as
 * it was.
 *
 * Sessions are sequences that outlive a request. They keep the id of every
 * token ever appended (the history, ids only) beside what is retained, so
 * the scheduler can match a new prompt against it and truncate where the
 * two diverge. An idle session (not pinned by a running request) is what
 * the pool gives up first: when pages run short, the session touched
 * longest ago is dropped whole before any running request loses a token.
 *
 * Shared pages (pool.c: reference counts). A fork lists its parent's pages
 * and an attached prefix lists pages another sequence wrote, so the pool's
 * part of an append is no longer "pages for keep + n minus pages held": it
 * is what the pool must hand out (pool_need): the new pages, plus a
 * private copy of every shared page that will be written (the partly full
 * last page the append fills; the pages a compacting eviction moves rows
 * into), minus the pages the eviction frees, which are only those no one
 * else holds. Dropping an idle session frees only its unshared pages, and
 * a session whose pages are all shared is passed over. The plan stays
 * exact for what it counts, so a planned append cannot run out of pages
 * halfway, and a refused one changes nothing, except that the reclaim hook
 * (kv_cache_set_reclaim) may already have given back cached pages no
 * sequence held.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * Bookkeeping arrays
 * ------------------------------------------------------------------------ */

/* realloc that keeps *p on failure. */
static bool grow(void **p, size_t bytes)
{
    void *q = realloc(*p, bytes ? bytes : 1);
    if (!q)
        return false;
    *p = q;
    return true;
}

/*
 * Make room for `extra` more tokens after the retained ones: slide the
 * arrays to the front when half the buffer would do, else grow to twice the
 * need. Logical content is unchanged either way. 0 or -ENOMEM (nothing
 * lost; the arrays may have grown).
 */
static int reserve_tokens(kv_seq *s, int64_t extra)
{
    int64_t need = (int64_t)s->n_tokens + extra;
    if ((int64_t)s->t_off + need <= s->t_cap)
        return 0;
    if (s->t_off > 0) {
        int n = s->n_tokens, o = s->t_off;
        memmove(s->pos, s->pos + o, sizeof(int32_t) * (size_t)n);
        memmove(s->ids, s->ids + o, sizeof(int32_t) * (size_t)n);
        memmove(s->hidx, s->hidx + o, sizeof(int32_t) * (size_t)n);
        memmove(s->mass, s->mass + o, sizeof(float) * (size_t)n);
        s->t_off = 0;
        if (need <= s->t_cap / 2)
            return 0; /* enough room left for the slide to pay for itself */
    }
    int64_t cap = need * 2 < 64 ? 64 : need * 2;
    if (cap > INT32_MAX)
        cap = need;
    if (cap > INT32_MAX)
        return -ENOMEM;
    size_t c = (size_t)cap;
    if (!grow((void **)&s->pos, c * sizeof(int32_t)) ||
        !grow((void **)&s->ids, c * sizeof(int32_t)) ||
        !grow((void **)&s->hidx, c * sizeof(int32_t)) ||
        !grow((void **)&s->mass, c * sizeof(float)) ||
        !grow((void **)&s->rank, c * sizeof(struct kv_rank)) || !grow((void **)&s->keep, c))
        return -ENOMEM;
    s->t_cap = (int)cap;
    return 0;
}

/* Same for the page table: room for `extra` more page ids. */
static int reserve_pages(kv_seq *s, int64_t extra)
{
    int64_t need = (int64_t)s->n_pages + extra;
    if ((int64_t)s->p_off + need <= s->p_cap)
        return 0;
    if (s->p_off > 0) {
        memmove(s->ptab, s->ptab + s->p_off, sizeof(int32_t) * (size_t)s->n_pages);
        s->p_off = 0;
        if (need <= s->p_cap / 2)
            return 0;
    }
    int64_t cap = need * 2 < 16 ? 16 : need * 2;
    if (cap > INT32_MAX)
        return -ENOMEM;
    if (!grow((void **)&s->ptab, (size_t)cap * sizeof(int32_t)))
        return -ENOMEM;
    s->p_cap = (int)cap;
    return 0;
}

/* Session history: room for `extra` more ids. */
static int reserve_history(kv_seq *s, int64_t extra)
{
    if (!s->session)
        return 0;
    int64_t need = (int64_t)s->n_appended + extra;
    if (need <= s->h_cap)
        return 0;
    int64_t cap = need * 2 < 256 ? 256 : need * 2;
    if (cap > INT32_MAX)
        cap = need;
    if (!grow((void **)&s->hist, (size_t)cap * sizeof(int32_t)))
        return -ENOMEM;
    s->h_cap = (int)cap;
    return 0;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

kv_seq *kv_seq_create(kv_cache *c, const struct kv_policy *policy, bool session, char *err,
                      size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!c) {
        if (err)
            snprintf(err, errlen, "kv sequence: no cache");
        return NULL;
    }
    if (kv_policy_check(policy, c->layout.page_tokens, err, errlen) < 0)
        return NULL;
    kv_seq *s = calloc(1, sizeof(*s));
    if (!s) {
        if (err)
            snprintf(err, errlen, "kv sequence: out of memory");
        return NULL;
    }
    s->cache = c;
    s->policy = s->policy_set = *policy;
    s->session = session;
    s->uid = c->next_uid;
    s->birth = c->births++;
    c->next_uid = c->next_uid == INT32_MAX ? 0 : c->next_uid + 1;

    s->next = c->seqs;
    if (c->seqs)
        c->seqs->prev = s;
    c->seqs = s;
    c->n_seqs++;
    c->n_sessions += session;
    return s;
}

/* Record n appended tokens' ids, positions and history; the page table
 * already covers them and the arrays have room. */
static void record_tokens(kv_seq *s, const int32_t *tokens, int n)
{
    int at = s->t_off + s->n_tokens;
    assert(at + n <= s->t_cap);
    for (int i = 0; i < n; i++) {
        s->pos[at + i] = s->next_pos++;
        s->ids[at + i] = tokens[i];
        s->hidx[at + i] = s->n_appended + i;
        s->mass[at + i] = 0.0f;
    }
    if (s->session)
        memcpy(s->hist + s->n_appended, tokens, sizeof(int32_t) * (size_t)n);
    s->n_appended += n;
    s->n_tokens += n;
}

/*
 * The child holds what the parent holds, by reference for the pages and by
 * copy for everything a sequence changes on its own: positions, ids,
 * history indices, scores, the history of a session, the pins, the turn
 * table. The windowed layers' local pages are shared the same way
 * (window.c). Its first write into a page they share copies that page
 * (kv_seq_unshare, kv_window_append).
 */
kv_seq *kv_seq_fork(kv_seq *parent, bool session, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!parent) {
        if (err)
            snprintf(err, errlen, "kv fork: no parent sequence");
        return NULL;
    }
    if (session && !parent->session) {
        if (err)
            snprintf(err, errlen, "kv fork: a session child needs a session parent (its history)");
        return NULL;
    }
    kv_seq *s = kv_seq_create(parent->cache, &parent->policy_set, session, err, errlen);
    if (!s)
        return NULL;
    memcpy(s->pins, parent->pins, sizeof(s->pins)); /* and the policy they put in effect */
    s->n_pins = parent->n_pins;
    s->policy = parent->policy;
    if (reserve_tokens(s, parent->n_tokens) < 0 || reserve_pages(s, parent->n_pages) < 0 ||
        reserve_history(s, parent->n_appended) < 0 ||
        kv_seq_set_turns(s, parent->turns, parent->n_turns, parent->turn_low, err, errlen) < 0) {
        kv_seq_destroy(s);
        if (err)
            snprintf(err, errlen, "kv fork: out of memory for %d tokens", parent->n_tokens);
        return NULL;
    }
    size_t n = (size_t)parent->n_tokens;
    int o = parent->t_off;
    if (n > 0) { /* an empty parent may have no arrays yet */
        memcpy(s->pos, parent->pos + o, n * sizeof(int32_t));
        memcpy(s->ids, parent->ids + o, n * sizeof(int32_t));
        memcpy(s->hidx, parent->hidx + o, n * sizeof(int32_t));
        memcpy(s->mass, parent->mass + o, n * sizeof(float));
    }
    if (session && parent->n_appended > 0)
        memcpy(s->hist, parent->hist, (size_t)parent->n_appended * sizeof(int32_t));
    for (int j = 0; j < parent->n_pages; j++) {
        int32_t page = parent->ptab[parent->p_off + j];
        kv_pool_ref(s->cache, page);
        s->ptab[j] = page;
    }
    s->n_pages = parent->n_pages;
    if (kv_window_fork(s, parent) < 0) { /* the windowed layers' pages, by reference */
        kv_seq_destroy(s);
        if (err)
            snprintf(err, errlen, "kv fork: out of memory for the sliding-window slots");
        return NULL;
    }
    s->n_tokens = parent->n_tokens;
    s->n_appended = parent->n_appended;
    s->next_pos = parent->next_pos;
    s->last_use = parent->last_use;
    return s;
}

int kv_seq_attach(kv_seq *s, const int32_t *pages, int n_pages, const int32_t *tokens)
{
    kv_cache *c = s->cache;
    const int pt = c->layout.page_tokens;
    if (n_pages < 0 || (n_pages > 0 && (!pages || !tokens)) || s->n_tokens % pt != 0)
        return -EINVAL;
    if (c->win.n_groups && n_pages > 0)
        return -EOPNOTSUPP; /* the pages hold no slot of the windowed layers (window.c) */
    for (int j = 0; j < n_pages; j++)
        if (pages[j] < 0 || pages[j] >= c->n_pages || c->refs[pages[j]] == 0 ||
            c->refs[pages[j]] == INT32_MAX)
            return -EINVAL;
    int64_t n = (int64_t)n_pages * pt;
    if (n == 0)
        return 0;
    if ((int64_t)s->next_pos + n > INT32_MAX || (int64_t)s->n_appended + n > INT32_MAX)
        return -EOVERFLOW;
    if ((int64_t)s->n_tokens + n > s->policy.max_cache_tokens)
        return -ENOSPC;
    if (reserve_tokens(s, n) < 0 || reserve_pages(s, n_pages) < 0 || reserve_history(s, n) < 0)
        return -ENOMEM;
    for (int j = 0; j < n_pages; j++) {
        kv_pool_ref(c, pages[j]);
        s->ptab[s->p_off + s->n_pages++] = pages[j];
    }
    record_tokens(s, tokens, (int)n);
    return 0;
}

void kv_seq_unshare(kv_seq *s, int j)
{
    kv_pool_unshare(s->cache, &s->ptab[s->p_off + j]);
}

void kv_seq_cut_to(kv_seq *s, int n)
{
    int pages = kv_pages_for(s->cache, n);
    for (int j = pages; j < s->n_pages; j++)
        kv_pool_unref(s->cache, s->ptab[s->p_off + j]);
    s->n_pages = pages;
    s->n_tokens = n;
}

void kv_seq_release_all(kv_seq *s)
{
    for (int j = 0; j < s->n_pages; j++)
        kv_pool_unref(s->cache, s->ptab[s->p_off + j]);
    kv_window_release(s);
    s->n_pages = s->p_off = 0;
    s->n_tokens = s->t_off = 0;
    s->n_appended = 0;
    s->next_pos = 0;
    kv_turns_clear(s);
    s->n_pins = 0; /* the history they indexed is gone */
    s->policy = s->policy_set;
}

void kv_seq_destroy(kv_seq *s)
{
    if (!s)
        return;
    kv_cache *c = s->cache;
    kv_seq_release_all(s);
    if (s->prev)
        s->prev->next = s->next;
    else
        c->seqs = s->next;
    if (s->next)
        s->next->prev = s->prev;
    c->n_seqs--;
    c->n_sessions -= s->session;
    free(s->ptab);
    free(s->pos);
    free(s->ids);
    free(s->hidx);
    free(s->mass);
    free(s->rank);
    free(s->keep);
    free(s->hist);
    kv_window_free_seq(s);
    free(s);
}

int kv_seq_set_policy(kv_seq *s, const struct kv_policy *policy)
{
    if (kv_policy_check(policy, s->cache->layout.page_tokens, NULL, 0) < 0)
        return -EINVAL;
    struct kv_policy eff;
    if (kv_pins_fit(policy, s->cache->layout.page_tokens, s->pins, s->n_pins, &eff, NULL, 0))
        return -E2BIG;
    if (!kv_window_accepts(s, &eff, s->turns, s->n_turns))
        return -ESTALE;
    /* Key norms and attention masses do not mix: moving to or from knorm
     * starts the scores afresh (evict_scored.c). */
    bool knorm_was = s->policy.kind == KV_EVICT_KNORM, knorm_is = policy->kind == KV_EVICT_KNORM;
    if (knorm_was != knorm_is && s->n_tokens > 0)
        memset(s->mass + s->t_off, 0, sizeof(float) * (size_t)s->n_tokens);
    s->policy_set = *policy;
    s->policy = eff;
    return 0;
}

/* ------------------------------------------------------------------------
 * Accessors
 * ------------------------------------------------------------------------ */

const struct kv_policy *kv_seq_policy(const kv_seq *s)
{
    return &s->policy;
}
kv_cache *kv_seq_cache(const kv_seq *s)
{
    return s->cache;
}
int kv_seq_n_tokens(const kv_seq *s)
{
    return s->n_tokens;
}
int kv_seq_n_pages(const kv_seq *s)
{
    return s->n_pages;
}
const int32_t *kv_seq_page_table(const kv_seq *s)
{
    return s->ptab ? s->ptab + s->p_off : NULL;
}
const int32_t *kv_seq_positions(const kv_seq *s)
{
    return s->pos ? s->pos + s->t_off : NULL;
}
const int32_t *kv_seq_tokens(const kv_seq *s)
{
    return s->ids ? s->ids + s->t_off : NULL;
}
const int32_t *kv_seq_hist_index(const kv_seq *s)
{
    return s->hidx ? s->hidx + s->t_off : NULL;
}
const float *kv_seq_mass(const kv_seq *s)
{
    return s->mass ? s->mass + s->t_off : NULL;
}
int32_t kv_seq_next_pos(const kv_seq *s)
{
    return s->next_pos;
}
bool kv_seq_is_session(const kv_seq *s)
{
    return s->session;
}
bool kv_seq_dropped(const kv_seq *s)
{
    return s->dropped;
}
void kv_seq_touch(kv_seq *s, uint64_t now_ms)
{
    s->last_use = now_ms;
}
uint64_t kv_seq_last_touch(const kv_seq *s)
{
    return s->last_use;
}
bool kv_seq_lru_before(const kv_seq *a, const kv_seq *b)
{
    return a->last_use < b->last_use || (a->last_use == b->last_use && a->birth < b->birth);
}
void kv_seq_pin(kv_seq *s, bool busy)
{
    s->pinned = busy;
}

static void *token_row(kv_seq *s, int layer, int kv_head, int idx, bool v)
{
    const struct kv_layout *l = &s->cache->layout;
    assert(idx >= 0 && idx < s->n_tokens);
    assert(layer >= 0 && layer < l->n_layer && kv_head >= 0 && kv_head < l->n_kv_head);
    if (s->cache->win.group[layer] >= 0)
        return kv_window_row(s, layer, kv_head, idx, v);
    int pt = l->page_tokens;
    return kv_layout_elem(l, s->ptab[s->p_off + idx / pt], idx % pt, s->cache->win.slot[layer],
                          kv_head, v);
}

void *kv_seq_k(kv_seq *s, int layer, int kv_head, int idx)
{
    return token_row(s, layer, kv_head, idx, false);
}

void *kv_seq_v(kv_seq *s, int layer, int kv_head, int idx)
{
    return token_row(s, layer, kv_head, idx, true);
}

/*
 * What the pool must supply, at its peak, for s to go from n_tokens to
 * `keep` retained (a count kv_room_plan returned, or n_tokens) plus n new
 * tokens: new pages, plus a private copy of every shared page that will be
 * written, minus the pages the eviction frees (only those no one else
 * holds). The copies a compaction makes come before it frees the tail it
 * read from, so the peak is the larger of those copies and the total.
 * An append (append true) also drops the windowed layers' pages no query
 * can see before anything else and fills their local pages after it
 * (kv_window_need): its part joins the total. A cache whose every layer is
 * windowed has no main pages: their part is nothing.
 */
static int64_t pool_need(const kv_seq *s, int keep, int n, bool append)
{
    const kv_cache *c = s->cache;
    const int32_t *ptab = s->ptab ? s->ptab + s->p_off : NULL; /* NULL before any page */
    const int pt = c->layout.page_tokens;
    struct kv_effect e;
    kv_room_effect(s, keep, &e);
    int64_t copies = 0;
    for (int j = e.write_lo; j < e.write_hi; j++)
        copies += kv_pool_shared(c, ptab[j]);
    int64_t during = copies;
    /* The append writes into the last kept page when it is partly full. */
    if (n > 0 && keep % pt != 0 && (e.last < e.write_lo || e.last >= e.write_hi))
        copies += kv_pool_shared(c, ptab[e.last]);
    int64_t total = kv_pages_for(c, (int64_t)keep + n) - kv_pages_for(c, keep) + copies - e.freed;
    if (!c->win.n_global)
        total = during = 0;
    if (append)
        total += kv_window_need(s, n);
    return total > during ? total : during;
}

bool kv_seq_has_room(const kv_seq *s, int n)
{
    if (n < 0)
        return false;
    int64_t total = (int64_t)s->n_tokens + n;
    if (total > s->policy.max_cache_tokens)
        return false;
    return pool_need(s, s->n_tokens, n, true) <= s->cache->n_free;
}

int kv_seq_max_append(const kv_seq *s)
{
    return kv_room_max_append(s);
}

/* ------------------------------------------------------------------------
 * Eviction entry points
 * ------------------------------------------------------------------------ */

int kv_seq_evict(kv_seq *s, int n_needed)
{
    if (n_needed < 0)
        return -EINVAL;
    int target = s->policy.max_cache_tokens - n_needed;
    if (s->n_tokens <= target)
        return 0;
    int keep = kv_room_plan(s, target);
    if (keep < 0)
        return -ENOSPC;
    /* A compaction over shared pages copies them first. */
    int64_t need = pool_need(s, keep, 0, false);
    if (need > s->cache->n_free)
        kv_pool_reclaim(s->cache, need - s->cache->n_free);
    if (need > s->cache->n_free)
        return -ENOMEM;
    int gone = kv_room_apply(s, keep);
    kv_window_sync(s);
    kv_window_drop(s, true);
    return gone;
}

/* Pages dropping o would give back: those no one else holds. */
static int64_t unshared_pages(const kv_seq *o)
{
    int64_t n = 0;
    for (int j = 0; j < kv_main_pages(o->cache, o->n_pages); j++)
        n += !kv_pool_shared(o->cache, o->ptab[o->p_off + j]);
    return n + kv_window_unshared(o);
}

/*
 * LRU: mark idle sessions for dropping, least recently touched first (ties:
 * the older sequence), until `have` pages reach `need`. Only sessions that
 * are not pinned, not `self` and hold pages are candidates; one whose pages
 * are all shared is passed over (dropping it would free none). Returns the
 * pages the marked ones give back; marks stay until drop_marked/unmark.
 */
static int64_t plan_drops(kv_cache *c, const kv_seq *self, int64_t have, int64_t need)
{
    int64_t got = 0;
    while (have + got < need) {
        kv_seq *best = NULL;
        for (kv_seq *o = c->seqs; o; o = o->next) {
            if (o == self || !o->session || o->pinned || o->drop_plan ||
                (o->n_pages == 0 && kv_window_pages_held(o) == 0))
                continue;
            if (!best || kv_seq_lru_before(o, best))
                best = o;
        }
        if (!best)
            break;
        int64_t gain = unshared_pages(best);
        best->drop_plan = gain > 0 ? 1 : 2;
        got += gain;
    }
    return got;
}

static void unmark_drops(kv_cache *c)
{
    for (kv_seq *o = c->seqs; o; o = o->next)
        o->drop_plan = 0;
}

static void drop_marked(kv_cache *c)
{
    for (kv_seq *o = c->seqs; o; o = o->next) {
        bool drop = o->drop_plan == 1;
        o->drop_plan = 0;
        if (!drop)
            continue;
        if (c->drop_hook)
            c->drop_hook(c->drop_ud, o); /* its owner may save it first */
        kv_seq_release_all(o);
        free(o->hist);
        o->hist = NULL;
        o->h_cap = 0;
        o->dropped = true;
        c->sessions_dropped++;
    }
}

/* ------------------------------------------------------------------------
 * Append
 * ------------------------------------------------------------------------ */

int kv_seq_append(kv_seq *s, const int32_t *tokens, int n, int *first)
{
    kv_cache *c = s->cache;
    const int pt = c->layout.page_tokens;
    const int max = s->policy.max_cache_tokens;

    if (n < 0 || (n > 0 && !tokens))
        return -EINVAL;
    if (n == 0) {
        if (first)
            *first = s->n_tokens;
        return 0;
    }
    if ((int64_t)s->next_pos + n > INT32_MAX || (int64_t)s->n_appended + n > INT32_MAX)
        return -EOVERFLOW;
    if (n > max)
        return -ENOSPC;
    if (kv_window_reserve(s, n) < 0)
        return -ENOMEM;

    /* 1. The budget: how far must the policy shrink us? */
    int keep = s->n_tokens;
    if ((int64_t)s->n_tokens + n > max) {
        keep = kv_room_plan(s, max - n);
        if (keep < 0)
            return -ENOSPC;
    }

    /* 2. The pool: what it must hand out against what is free (both page
     * classes: the windowed layers' pages no query can see go first,
     * window.c). If that is short, pages only an outside holder keeps (the
     * prefix index) go first, then idle sessions (LRU)... */
    int64_t need = pool_need(s, keep, n, true);
    int64_t have = c->n_free;
    if (need > have)
        have += kv_pool_reclaim(c, need - have);
    if (need > have)
        have += plan_drops(c, s, have, need);

    /* 3. ...and only then does this sequence shrink below its budget: by
     * the fewest tokens that could cover the shortfall, and again while
     * shared pages it gives up free nothing. A cache whose every layer is
     * windowed has no main pages to give up: the local pages of evicted
     * tokens go only after the append. */
    while (need > have) {
        int64_t target = c->win.n_global ? keep - (need - have - 1) * pt - 1 : -1;
        int shrunk = target >= 0 ? kv_room_plan(s, (int)target) : -1;
        if (shrunk < 0) {
            unmark_drops(c);
            return -ENOMEM;
        }
        keep = shrunk;
        need = pool_need(s, keep, n, true);
    }

    /* 4. Bookkeeping room, sized for the state before eviction (eviction
     * never moves the end of the arrays further out). */
    if (reserve_tokens(s, n) < 0 || reserve_pages(s, kv_pages_for(c, n) + 1) < 0 ||
        reserve_history(s, n) < 0) {
        unmark_drops(c);
        return -ENOMEM;
    }

    /* Nothing can fail from here on. */
    drop_marked(c);
    kv_window_drop(s, false);
    kv_room_apply(s, keep);
    assert(s->n_tokens == keep);
    if (keep % pt != 0)
        kv_seq_unshare(s, s->n_pages - 1); /* the append writes into it */

    int new_pages = kv_pages_for(c, (int64_t)keep + n) - s->n_pages;
    assert(kv_main_pages(c, new_pages) <= c->n_free);
    assert(s->p_off + s->n_pages + new_pages <= s->p_cap);
    for (int j = 0; j < new_pages; j++)
        s->ptab[s->p_off + s->n_pages++] = c->win.n_global ? kv_pool_alloc(c) : -1;

    if (first)
        *first = s->n_tokens;
    record_tokens(s, tokens, n);
    kv_window_append(s, n);
    kv_window_sync(s);
    kv_window_drop(s, true); /* what this append's eviction took */
    return 0;
}

/* ------------------------------------------------------------------------
 * Sessions
 * ------------------------------------------------------------------------ */

int kv_seq_history(const kv_seq *s, const int32_t **ids)
{
    if (!s->session) {
        if (ids)
            *ids = NULL;
        return 0;
    }
    if (ids)
        *ids = s->hist;
    return s->n_appended;
}

int kv_seq_truncate(kv_seq *s, int n_hist)
{
    if (n_hist < 0 || n_hist > s->n_appended)
        return -EINVAL;
    if (s->n_tokens == 0) { /* nothing retained: only the history moves */
        s->next_pos = s->policy.renumber ? 0 : n_hist;
        s->n_appended = n_hist;
        kv_turns_truncate(s, n_hist);
        kv_pins_truncate(s, n_hist);
        kv_window_truncate(s, n_hist);
        return 0;
    }
    const int32_t *hidx = s->hidx + s->t_off, *pos = s->pos + s->t_off;

    int keep = kv_hidx_lower(s, 0, n_hist); /* the first history index >= n_hist */

    /* Where the next token goes: right after the kept ones (renumber), or
     * at the position the cut token would have had (preserve: the gap of
     * evicted tokens between the last kept one and the cut stays). */
    int32_t next = s->policy.renumber ? (keep > 0 ? pos[keep - 1] + 1 : 0)
                   : keep > 0         ? pos[keep - 1] + (n_hist - hidx[keep - 1])
                                      : n_hist;
    if (kv_window_truncate_ok(s, keep, next))
        return -ESTALE; /* the windowed layers dropped what that point needs */
    s->next_pos = next;
    kv_seq_cut_to(s, keep);
    s->n_appended = n_hist;
    kv_turns_truncate(s, n_hist);
    kv_pins_truncate(s, n_hist);
    kv_window_truncate(s, n_hist);
    return 0;
}
