/*
 * prefix.c - the automatic prefix cache: an index of full pages by the
 * tokens that lead up to them, and an LRU of the pages no sequence uses.
 *
 * ---------------------------------------------------------------------------
 * Why a page is reusable at all
 * ---------------------------------------------------------------------------
 *
 * A thousand requests that open with the same 2,000-token system prompt
 * compute the same K and V for those tokens a thousand times. The K and V of
 * token j depend on the model, on token j and on every token before it, and
 * on nothing else when the sequence has never evicted (kvd stores keys
 * unrotated, with a position number per token, so the bytes do not even
 * depend on the position a later eviction renumbers them to). A full page
 * computed by a sequence that never evicted before writing it is therefore
 * valid, byte for byte, in any sequence whose first tokens are the same, up
 * to and including the page's. The cache already counts references to
 * pages (pool.c); this file remembers which pages hold which prefixes so a
 * new sequence can take a reference instead of computing them again.
 *
 * ---------------------------------------------------------------------------
 * Why a hash chain, not a radix tree
 * ---------------------------------------------------------------------------
 *
 * SGLang keeps a radix tree over token ids: any two prompts share exactly
 * their longest common prefix, token for token. kvd can only share whole
 * pages (a partial page would be written by whoever appends next), so the
 * tree would be matched token by token only to be rounded down to a page
 * anyway. Keyed by page, a radix tree degenerates into a tree whose edges
 * are page-sized token runs; we store that tree as a hash table (vLLM's
 * block hashes): the key of page i is
 *
 *     h(i) = mix(h(i - 1), tokens of page i),  h(-1) = mix(fingerprint)
 *
 * so a key names the model (the fingerprint: its tensors, architecture and
 * KV types, passed in by the engine) and every token up to and including the
 * page. Finding the longest cached prefix is one hash and one bucket probe
 * per page, with no tree walking or node splitting, and removing a page is
 * removing one entry. Eviction of idle pages goes leaf first (below), so a
 * chain never loses a page in its middle.
 *
 * A hash is never trusted alone. Each entry also records its parent entry
 * (the page before it in the chain) with the parent's generation, and its
 * own page_tokens token ids. Matching page i requires an equal hash, the
 * parent to be exactly the entry matched for page i - 1 (same slot, same
 * generation), and equal token ids. By induction the matched chain holds
 * exactly the prompt's tokens, so a 64-bit collision costs one comparison,
 * never a wrong answer (test_prefix forces every hash into a few buckets to
 * show it).
 *
 * ---------------------------------------------------------------------------
 * Entries live in page slots; idle pages go back leaf first
 * ---------------------------------------------------------------------------
 *
 * A page is listed at most once, so entry arrays are indexed by page id
 * (n_pages of them, allocated once). The index holds one outside reference
 * (kv_page_ref) to every page it lists. A listed page whose only reference
 * is the index's is idle: cached but unused, and reclaimable. Entries sit on
 * one recency list, touched when a chain is published or attached; a page
 * becomes idle without the index hearing of it (a sequence let go), so
 * idleness is read from the page's reference count when a page is wanted.
 * The pool asks for idle pages (its reclaim hook) whenever it runs short,
 * before it drops any idle session or any running sequence evicts a token;
 * the engine trims them to the share cap ([cache] prefix_cache_share)
 * after each step. How many are idle, and how many are shared, is counted
 * by the pool itself at every reference change (its kept-page gauges): the
 * index is its only outside holder, so neither the trim nor /metrics walks
 * the index to count them.
 *
 * Only childless entries are taken back: removing a page from the middle of
 * a chain would leave the pages after it unreachable yet held. A chain is
 * touched from its last page to its first, so on the recency list the
 * leaf lies nearest the old end and the search from there usually stops at
 * its first idle entry.
 *
 * Threading: the index belongs to its cache and, like it, to one thread.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kv_prefix_entry {
    uint64_t hash;        /* chain key of this page (masked) */
    int32_t parent;       /* page of the previous page's entry; -1: the chain's first */
    uint32_t parent_gen;  /* the parent's generation when this entry was added */
    uint32_t gen;         /* bumped each time this slot's entry is removed */
    int32_t hnext;        /* next entry in the hash bucket, or -1 */
    int32_t lprev, lnext; /* recency links (lprev towards the recent end), or -1 */
    int32_t n_children;   /* entries whose parent is this one */
    bool live;            /* the slot holds an entry */
};

struct kv_prefix {
    kv_cache *cache; /* NULL for a bare index (tests) */
    int n_pages, page_tokens;
    uint64_t fingerprint;      /* as given */
    uint64_t root;             /* h(-1): the fingerprint, mixed */
    uint64_t hash_mask;        /* all ones; tests narrow it to force collisions */
    int max_idle;              /* idle pages kept at most (kv_prefix_trim) */
    struct kv_prefix_entry *e; /* [n_pages], by page id */
    int32_t *tokens;           /* [n_pages * page_tokens] each entry's token ids */
    int32_t *bucket;           /* [n_buckets] first entry, or -1 */
    uint32_t n_buckets;        /* a power of two */
    int32_t lru_new, lru_old;  /* recency list ends, or -1 */
    int32_t *scratch;          /* [n_pages] matched pages (attach, lookup) */
    int n_entries;
    struct kv_prefix_stats st; /* counters (the gauges are the pool's) */
};

/* ------------------------------------------------------------------------
 * Hashing
 * ------------------------------------------------------------------------ */

/* splitmix64's finaliser: every input bit reaches every output bit. */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* h(i) from h(i - 1) and page i's tokens. */
static uint64_t chain_hash(const kv_prefix *px, uint64_t prev, const int32_t *tokens)
{
    uint64_t h = prev;
    for (int i = 0; i < px->page_tokens; i++)
        h = mix64(h ^ ((uint64_t)(uint32_t)tokens[i] + 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1)));
    return h & px->hash_mask;
}

static uint32_t bucket_of(const kv_prefix *px, uint64_t hash)
{
    return (uint32_t)(hash ^ (hash >> 32)) & (px->n_buckets - 1);
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

kv_prefix *kv_prefix_new(int n_pages, int page_tokens, uint64_t fingerprint, int max_idle)
{
    if (n_pages < 1 || page_tokens < 1)
        return NULL;
    kv_prefix *px = calloc(1, sizeof(*px));
    if (!px)
        return NULL;
    px->n_pages = n_pages;
    px->page_tokens = page_tokens;
    px->fingerprint = fingerprint;
    px->root = mix64(fingerprint ^ 0x6b76642d70726566ull); /* "kvd-pref" */
    px->hash_mask = UINT64_MAX;
    px->max_idle = max_idle < 0 ? 0 : max_idle > n_pages ? n_pages : max_idle;
    px->n_buckets = 1;
    while (px->n_buckets < (uint32_t)n_pages && px->n_buckets < (1u << 30))
        px->n_buckets <<= 1;
    px->e = calloc((size_t)n_pages, sizeof(*px->e));
    px->tokens = malloc(sizeof(int32_t) * (size_t)n_pages * (size_t)page_tokens);
    px->bucket = malloc(sizeof(int32_t) * px->n_buckets);
    px->scratch = malloc(sizeof(int32_t) * (size_t)n_pages);
    if (!px->e || !px->tokens || !px->bucket || !px->scratch) {
        kv_prefix_destroy(px);
        return NULL;
    }
    for (uint32_t b = 0; b < px->n_buckets; b++)
        px->bucket[b] = -1;
    for (int p = 0; p < n_pages; p++)
        px->e[p] = (struct kv_prefix_entry){.parent = -1, .hnext = -1, .lprev = -1, .lnext = -1};
    px->lru_new = px->lru_old = -1;
    return px;
}

static int reclaim_hook(void *ctx, kv_cache *cache, int n_pages);

kv_prefix *kv_prefix_create(kv_cache *cache, uint64_t fingerprint, int max_idle_pages, char *err,
                            size_t errlen)
{
    if (!cache || max_idle_pages < 0) {
        if (err)
            snprintf(err, errlen, "prefix cache: no cache, or a negative idle cap (%d)",
                     max_idle_pages);
        return NULL;
    }
    if (kv_cache_window(cache) > 0) {
        if (err)
            snprintf(err, errlen, "prefix cache: the cache has sliding-window layers, whose "
                                  "pages are per sequence (kv_seq_attach cannot share them)");
        return NULL;
    }
    kv_prefix *px = kv_prefix_new(kv_cache_n_pages(cache), kv_cache_page_tokens(cache), fingerprint,
                                  max_idle_pages);
    if (!px) {
        if (err)
            snprintf(err, errlen, "prefix cache: out of memory for an index of %d pages",
                     kv_cache_n_pages(cache));
        return NULL;
    }
    px->cache = cache;
    kv_cache_set_reclaim(cache, reclaim_hook, px);
    return px;
}

void kv_prefix_destroy(kv_prefix *px)
{
    if (!px)
        return;
    if (px->cache) {
        kv_cache_set_reclaim(px->cache, NULL, NULL);
        for (int p = 0; p < px->n_pages; p++)
            if (px->e[p].live)
                kv_page_unref(px->cache, p);
    }
    free(px->e);
    free(px->tokens);
    free(px->bucket);
    free(px->scratch);
    free(px);
}

void kv_prefix_set_hash_mask(kv_prefix *px, uint64_t mask)
{
    assert(px->n_entries == 0);
    px->hash_mask = mask;
}

/* ------------------------------------------------------------------------
 * Lookup
 * ------------------------------------------------------------------------ */

/* Whether x's parent link still names the entry `parent` (-1: x is a
 * chain's first page). */
static bool parent_is(const kv_prefix *px, const struct kv_prefix_entry *x, int32_t parent)
{
    if (x->parent != parent)
        return false;
    return parent < 0 || (px->e[parent].live && px->e[parent].gen == x->parent_gen);
}

int32_t kv_prefix_find(const kv_prefix *px, int32_t parent, const int32_t *tokens)
{
    uint64_t prev = parent < 0 ? px->root : px->e[parent].hash;
    uint64_t h = chain_hash(px, prev, tokens);
    size_t bytes = sizeof(int32_t) * (size_t)px->page_tokens;
    for (int32_t p = px->bucket[bucket_of(px, h)]; p >= 0; p = px->e[p].hnext) {
        const struct kv_prefix_entry *x = &px->e[p];
        if (x->hash == h && parent_is(px, x, parent) &&
            memcmp(px->tokens + (size_t)p * (size_t)px->page_tokens, tokens, bytes) == 0)
            return p;
    }
    return -1;
}

int kv_prefix_match(const kv_prefix *px, const int32_t *tokens, int n_tokens, int32_t *pages,
                    int max_pages)
{
    int n = 0, pt = px->page_tokens;
    int32_t parent = -1;
    while (n < max_pages && (int64_t)(n + 1) * pt <= n_tokens) {
        int32_t p = kv_prefix_find(px, parent, tokens + (size_t)n * (size_t)pt);
        if (p < 0)
            break;
        pages[n++] = p;
        parent = p;
    }
    return n;
}

/* ------------------------------------------------------------------------
 * Entries
 * ------------------------------------------------------------------------ */

bool kv_prefix_listed(const kv_prefix *px, int32_t page)
{
    return page >= 0 && page < px->n_pages && px->e[page].live;
}

static void lru_unlink(kv_prefix *px, int32_t p)
{
    struct kv_prefix_entry *x = &px->e[p];
    if (x->lprev >= 0)
        px->e[x->lprev].lnext = x->lnext;
    else
        px->lru_new = x->lnext;
    if (x->lnext >= 0)
        px->e[x->lnext].lprev = x->lprev;
    else
        px->lru_old = x->lprev;
    x->lprev = x->lnext = -1;
}

static void lru_push_new(kv_prefix *px, int32_t p)
{
    struct kv_prefix_entry *x = &px->e[p];
    x->lprev = -1;
    x->lnext = px->lru_new;
    if (px->lru_new >= 0)
        px->e[px->lru_new].lprev = p;
    else
        px->lru_old = p;
    px->lru_new = p;
}

void kv_prefix_touch(kv_prefix *px, int32_t page)
{
    assert(px->e[page].live);
    if (px->lru_new == page)
        return;
    lru_unlink(px, page);
    lru_push_new(px, page);
}

void kv_prefix_add(kv_prefix *px, int32_t parent, const int32_t *tokens, int32_t page)
{
    assert(page >= 0 && page < px->n_pages && !px->e[page].live);
    assert(parent < 0 || px->e[parent].live);
    struct kv_prefix_entry *x = &px->e[page];
    uint64_t prev = parent < 0 ? px->root : px->e[parent].hash;
    x->hash = chain_hash(px, prev, tokens);
    x->parent = parent;
    x->parent_gen = parent < 0 ? 0 : px->e[parent].gen;
    x->n_children = 0;
    x->live = true;
    memcpy(px->tokens + (size_t)page * (size_t)px->page_tokens, tokens,
           sizeof(int32_t) * (size_t)px->page_tokens);
    uint32_t b = bucket_of(px, x->hash);
    x->hnext = px->bucket[b];
    px->bucket[b] = page;
    if (parent >= 0)
        px->e[parent].n_children++;
    lru_push_new(px, page);
    px->n_entries++;
}

void kv_prefix_remove(kv_prefix *px, int32_t page)
{
    struct kv_prefix_entry *x = &px->e[page];
    assert(x->live && x->n_children == 0);
    lru_unlink(px, page);
    int32_t *pp = &px->bucket[bucket_of(px, x->hash)];
    while (*pp != page)
        pp = &px->e[*pp].hnext;
    *pp = x->hnext;
    if (x->parent >= 0 && parent_is(px, x, x->parent))
        px->e[x->parent].n_children--;
    x->live = false;
    x->hnext = -1;
    x->parent = -1;
    x->gen++;
    px->n_entries--;
}

int32_t kv_prefix_victim(const kv_prefix *px, bool (*idle)(const kv_prefix *, int32_t))
{
    for (int32_t p = px->lru_old; p >= 0; p = px->e[p].lprev)
        if (px->e[p].n_children == 0 && idle(px, p))
            return p;
    return -1;
}

int kv_prefix_n_entries(const kv_prefix *px)
{
    return px->n_entries;
}

/* Put a broken invariant into err; returns -EFAULT. */
static int broken(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int broken(char *err, size_t errlen, const char *fmt, ...)
{
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -EFAULT;
}

int kv_prefix_check(const kv_prefix *px, char *err, size_t errlen)
{
    int rc = 0, entries = 0, on_lru = 0;
    int32_t *children = calloc((size_t)px->n_pages, sizeof(int32_t));
    if (!children)
        return -ENOMEM;
    for (int p = 0; p < px->n_pages && rc == 0; p++) {
        const struct kv_prefix_entry *x = &px->e[p];
        if (!x->live)
            continue;
        entries++;
        if (x->parent >= 0 && !parent_is(px, x, x->parent))
            rc = broken(err, errlen, "prefix entry %d has lost its parent %d", p, x->parent);
        else if (px->cache && kv_page_refs(px->cache, p) < 1)
            rc = broken(err, errlen, "prefix entry %d lists a free page", p);
        else if (x->parent >= 0)
            children[x->parent]++;
    }
    for (int p = 0; p < px->n_pages && rc == 0; p++)
        if (px->e[p].live && children[p] != px->e[p].n_children)
            rc = broken(err, errlen, "prefix entry %d counts %d children, has %d", p,
                        px->e[p].n_children, children[p]);
    for (int32_t p = px->lru_new; p >= 0 && on_lru <= px->n_pages; p = px->e[p].lnext)
        on_lru += px->e[p].live;
    if (rc == 0 && (entries != px->n_entries || on_lru != entries))
        rc =
            broken(err, errlen, "prefix index counts %d entries, found %d (%d on the recency list)",
                   px->n_entries, entries, on_lru);
    free(children);
    return rc;
}

/* ------------------------------------------------------------------------
 * The index over a pool: idle pages, reclaim, trim
 * ------------------------------------------------------------------------ */

/* A listed page only the index holds. */
static bool page_idle(const kv_prefix *px, int32_t page)
{
    return kv_page_refs(px->cache, page) == 1;
}

/* Unlist page and let go of the index's reference (the page is free after
 * it when it was idle). */
static void drop_entry(kv_prefix *px, int32_t page)
{
    kv_prefix_remove(px, page);
    kv_page_unref(px->cache, page);
}

/* Give back up to n idle pages, oldest first; returns how many. */
static int release_idle(kv_prefix *px, int n)
{
    int done = 0;
    while (done < n) {
        int32_t v = kv_prefix_victim(px, page_idle);
        if (v < 0)
            break;
        drop_entry(px, v);
        done++;
    }
    px->st.pages_reclaimed += (uint64_t)done;
    return done;
}

/* The pool's hook (kv_cache_set_reclaim): it is short of n pages. */
static int reclaim_hook(void *ctx, kv_cache *cache, int n_pages)
{
    kv_prefix *px = ctx;
    assert(cache == px->cache);
    (void)cache;
    return release_idle(px, n_pages);
}

/* The index is the cache's only outside holder and lists a page once, so
 * the pool's kept pages are the listed ones and its gauges are the
 * index's, kept exact at every reference change (pool.c): nothing here
 * walks the index to count them. */
int kv_prefix_idle_pages(const kv_prefix *px)
{
    if (!px->cache)
        return 0;
    struct kv_stats st;
    kv_cache_stats(px->cache, &st);
    return st.kept_idle;
}

int kv_prefix_trim(kv_prefix *px)
{
    int idle = kv_prefix_idle_pages(px);
    return idle > px->max_idle ? release_idle(px, idle - px->max_idle) : 0;
}

/* ------------------------------------------------------------------------
 * Sequences: attach and publish
 * ------------------------------------------------------------------------ */

/* Whether every retained token of seq was computed with every token before
 * it present: positions and history indices are exactly 0..n-1 (both
 * increase strictly, so checking the last suffices). */
static bool seq_whole(const kv_seq *seq)
{
    int n = kv_seq_n_tokens(seq);
    return n == 0 ||
           (kv_seq_hist_index(seq)[n - 1] == n - 1 && kv_seq_positions(seq)[n - 1] == n - 1);
}

/* Touch a chain from its last page to its first (the leaf nearest the old
 * end, see the essay). */
static void touch_chain(kv_prefix *px, const int32_t *pages, int n)
{
    for (int i = n - 1; i >= 0; i--)
        kv_prefix_touch(px, pages[i]);
}

int kv_prefix_attach(kv_prefix *px, kv_seq *seq, const int32_t *tokens, int n_tokens)
{
    if (!px || !seq || (n_tokens > 0 && !tokens))
        return -EINVAL;
    int pt = px->page_tokens, have = kv_seq_n_tokens(seq);
    if (!seq_whole(seq) || have % pt != 0 || n_tokens <= have)
        return 0;
    /* the sequence's tokens must be the first of `tokens` (the caller's
     * promise; checked, since a wrong page would be a wrong answer) */
    if (have > 0 && memcmp(kv_seq_tokens(seq), tokens, sizeof(int32_t) * (size_t)have) != 0)
        return 0;
    int room = kv_seq_policy(seq)->max_cache_tokens - have;
    int limit = n_tokens < have + room ? n_tokens : have + room;
    int n = kv_prefix_match(px, tokens, limit, px->scratch, px->n_pages);
    int first = have / pt;
    if (n <= first)
        return 0;
    /* the sequence's own pages must be the chain's (they are, unless it
     * computed its copy while another sequence listed the same tokens) */
    const int32_t *ptab = kv_seq_page_table(seq);
    int same = 0;
    while (same < first && ptab[same] == px->scratch[same])
        same++;
    if (same < first)
        return 0;
    int rc = kv_seq_attach(seq, px->scratch + first, n - first, tokens + (size_t)have);
    if (rc < 0)
        return rc;
    touch_chain(px, px->scratch, n);
    px->st.pages_attached += (uint64_t)(n - first);
    return (n - first) * pt;
}

int kv_prefix_lookup(kv_prefix *px, const int32_t *tokens, int n_tokens, int *idle_pages)
{
    int n = kv_prefix_match(px, tokens, n_tokens, px->scratch, px->n_pages);
    if (idle_pages) {
        *idle_pages = 0;
        for (int i = 0; i < n; i++)
            *idle_pages += page_idle(px, px->scratch[i]);
    }
    return n;
}

int kv_prefix_publish(kv_prefix *px, kv_seq *seq)
{
    if (!px || !seq || !seq_whole(seq))
        return 0;
    int pt = px->page_tokens, full = kv_seq_n_tokens(seq) / pt;
    const int32_t *ptab = kv_seq_page_table(seq), *ids = kv_seq_tokens(seq);
    /* the pages already listed as this chain: no hashing needed */
    int i = 0;
    int32_t parent = -1;
    while (i < full && kv_prefix_listed(px, ptab[i]) && px->e[ptab[i]].parent == parent) {
        parent = ptab[i];
        i++;
    }
    int added = 0;
    for (; i < full; i++) {
        const int32_t *t = ids + (size_t)i * (size_t)pt;
        int32_t p = kv_prefix_find(px, parent, t);
        if (p < 0) {
            if (kv_prefix_listed(px, ptab[i]) || kv_page_ref(px->cache, ptab[i]) != 0)
                break; /* listed elsewhere in another chain: cannot be this one */
            kv_prefix_add(px, parent, t, ptab[i]);
            p = ptab[i];
            added++;
        }
        /* else: another sequence listed these tokens first; ours stays
         * private and the chain goes on from the listed page */
        parent = p;
    }
    if (i > 0) {
        /* touch what we listed or walked, leaf first */
        for (int32_t q = parent; q >= 0; q = px->e[q].parent)
            kv_prefix_touch(px, q);
    }
    px->st.pages_published += (uint64_t)added;
    return added;
}

/* ------------------------------------------------------------------------
 * Statistics
 * ------------------------------------------------------------------------ */

void kv_prefix_get_stats(const kv_prefix *px, struct kv_prefix_stats *out)
{
    *out = px->st;
    out->fingerprint = px->fingerprint;
    out->pages_listed = px->n_entries;
    if (px->cache) {
        struct kv_stats st;
        kv_cache_stats(px->cache, &st);
        out->pages_idle = st.kept_idle;
        out->pages_shared = st.kept_shared;
        out->page_refs_saved = st.kept_refs_saved;
    }
}
