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
 * Entries live in page slots; idle pages are an LRU
 * ---------------------------------------------------------------------------
 *
 * A page is indexed at most once, so entry arrays are indexed by page id
 * (n_pages of them, allocated once). The index holds one reference to every
 * page it lists. A listed page no sequence holds is idle: cached but
 * unused, and reclaimable. Idle entries form an LRU list; when a page
 * becomes idle it goes to the most recent end. The pool takes idle pages
 * back, oldest first, whenever it runs short, before any idle session is
 * dropped or any running sequence evicts a token, and keeps at most
 * max_idle of them at all (the [cache] prefix_cache_share cap).
 *
 * Only childless entries are taken back: removing a page from the middle of
 * a chain would leave the pages after it unreachable yet held. A sequence
 * releases its pages last first (seq.c), so the leaf of a chain becomes
 * idle first and sits nearest the old end; the search from the old end
 * then usually stops at its first step.
 *
 * Threading: the index belongs to its cache and, like it, to one thread.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kv_prefix_entry {
    uint64_t hash;       /* chain key of this page (masked) */
    int32_t parent;      /* page of the previous page's entry; -1: the chain's first */
    uint32_t parent_gen; /* the parent's generation when this entry was added */
    uint32_t gen;        /* bumped each time this slot's entry is removed */
    int32_t hnext;       /* next entry in the hash bucket, or -1 */
    int32_t lprev, lnext; /* idle LRU links (lprev towards the recent end), or -1 */
    int32_t n_children;  /* entries whose parent is this one */
    bool live;           /* the slot holds an entry */
    bool idle;           /* ... that no sequence uses (on the LRU) */
};

struct kv_prefix {
    int n_pages, page_tokens;
    uint64_t root;      /* h(-1): the fingerprint, mixed */
    uint64_t hash_mask; /* all ones; tests narrow it to force collisions */
    int max_idle;       /* idle entries kept at most */
    struct kv_prefix_entry *e; /* [n_pages], by page id */
    int32_t *tokens;           /* [n_pages * page_tokens] each entry's token ids */
    int32_t *bucket;           /* [n_buckets] first entry, or -1 */
    uint32_t n_buckets;        /* a power of two */
    int32_t lru_new, lru_old;  /* idle LRU ends, or -1 */
    int n_entries, n_idle;
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

kv_prefix *kv_prefix_create(int n_pages, int page_tokens, uint64_t fingerprint, int max_idle)
{
    if (n_pages < 1 || page_tokens < 1)
        return NULL;
    kv_prefix *px = calloc(1, sizeof(*px));
    if (!px)
        return NULL;
    px->n_pages = n_pages;
    px->page_tokens = page_tokens;
    px->root = mix64(fingerprint ^ 0x6b76642d70726566ull); /* "kvd-pref" */
    px->hash_mask = UINT64_MAX;
    px->max_idle = max_idle < 0 ? 0 : max_idle > n_pages ? n_pages : max_idle;
    px->n_buckets = 1;
    while (px->n_buckets < (uint32_t)n_pages && px->n_buckets < (1u << 30))
        px->n_buckets <<= 1;
    px->e = calloc((size_t)n_pages, sizeof(*px->e));
    px->tokens = malloc(sizeof(int32_t) * (size_t)n_pages * (size_t)page_tokens);
    px->bucket = malloc(sizeof(int32_t) * px->n_buckets);
    if (!px->e || !px->tokens || !px->bucket) {
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

void kv_prefix_destroy(kv_prefix *px)
{
    if (!px)
        return;
    free(px->e);
    free(px->tokens);
    free(px->bucket);
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

/* Whether p's parent link still names the entry `parent` (-1: p is a
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

bool kv_prefix_idle(const kv_prefix *px, int32_t page)
{
    return kv_prefix_listed(px, page) && px->e[page].idle;
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
    x->idle = false;
    x->lprev = x->lnext = -1;
    memcpy(px->tokens + (size_t)page * (size_t)px->page_tokens, tokens,
           sizeof(int32_t) * (size_t)px->page_tokens);
    uint32_t b = bucket_of(px, x->hash);
    x->hnext = px->bucket[b];
    px->bucket[b] = page;
    if (parent >= 0)
        px->e[parent].n_children++;
    px->n_entries++;
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

void kv_prefix_set_idle(kv_prefix *px, int32_t page, bool idle)
{
    struct kv_prefix_entry *x = &px->e[page];
    assert(x->live);
    if (x->idle == idle)
        return;
    x->idle = idle;
    if (!idle) {
        lru_unlink(px, page);
        px->n_idle--;
        return;
    }
    x->lprev = -1;
    x->lnext = px->lru_new;
    if (px->lru_new >= 0)
        px->e[px->lru_new].lprev = page;
    else
        px->lru_old = page;
    px->lru_new = page;
    px->n_idle++;
}

void kv_prefix_remove(kv_prefix *px, int32_t page)
{
    struct kv_prefix_entry *x = &px->e[page];
    assert(x->live && x->n_children == 0);
    if (x->idle) {
        lru_unlink(px, page);
        px->n_idle--;
    }
    int32_t *pp = &px->bucket[bucket_of(px, x->hash)];
    while (*pp != page)
        pp = &px->e[*pp].hnext;
    *pp = x->hnext;
    if (parent_is(px, x, x->parent) && x->parent >= 0)
        px->e[x->parent].n_children--;
    x->live = x->idle = false;
    x->hnext = -1;
    x->parent = -1;
    x->gen++;
    px->n_entries--;
}

int32_t kv_prefix_victim(const kv_prefix *px)
{
    for (int32_t p = px->lru_old; p >= 0; p = px->e[p].lprev)
        if (px->e[p].n_children == 0)
            return p;
    return -1;
}

int kv_prefix_n_entries(const kv_prefix *px)
{
    return px->n_entries;
}

int kv_prefix_n_idle(const kv_prefix *px)
{
    return px->n_idle;
}

int kv_prefix_max_idle(const kv_prefix *px)
{
    return px->max_idle;
}

int kv_prefix_page_tokens(const kv_prefix *px)
{
    return px->page_tokens;
}

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (err)                                                                                   \
            snprintf(err, errlen, __VA_ARGS__);                                                    \
        rc = -EFAULT;                                                                              \
        goto out;                                                                                  \
    } while (0)

int kv_prefix_check(const kv_prefix *px, char *err, size_t errlen)
{
    int rc = 0, entries = 0, idle = 0, on_lru = 0;
    int32_t *children = calloc((size_t)px->n_pages, sizeof(int32_t));
    if (!children)
        return -ENOMEM;
    for (int p = 0; p < px->n_pages; p++) {
        const struct kv_prefix_entry *x = &px->e[p];
        if (!x->live)
            continue;
        entries++;
        idle += x->idle;
        if (x->parent >= 0 && !parent_is(px, x, x->parent))
            FAIL("prefix entry %d has lost its parent %d", p, x->parent);
        if (x->parent >= 0)
            children[x->parent]++;
    }
    for (int p = 0; p < px->n_pages; p++)
        if (px->e[p].live && children[p] != px->e[p].n_children)
            FAIL("prefix entry %d counts %d children, has %d", p, px->e[p].n_children,
                 children[p]);
    for (int32_t p = px->lru_new; p >= 0 && on_lru <= px->n_pages; p = px->e[p].lnext)
        on_lru += px->e[p].live && px->e[p].idle;
    if (entries != px->n_entries || idle != px->n_idle || on_lru != idle)
        FAIL("prefix index counts %d entries / %d idle, found %d / %d (%d on the LRU)",
             px->n_entries, px->n_idle, entries, idle, on_lru);
out:
    free(children);
    return rc;
}
