/*
 * cache_internal.h - the cache room's private structs and helpers, shared
 * by pool.c (pages), seq.c (sequences, append, sessions) and evict.c
 * (policies). Never included from outside cache/ (tests excepted: they are
 * white-box).
 *
 * Token arrays with a front offset. A sequence's per-token arrays (pos, ids,
 * hidx, mass) and its page table each live in a buffer with a start offset:
 * logical token i is buf[off + i]. sink-window eviction removes a run right
 * after the sinks; instead of moving the (long) window back over the gap it
 * moves the (short) sinks forward and advances the offset, so the page table
 * changes in O(sink pages + pages freed) and the token arrays in O(sink
 * tokens). Appends compact a buffer to the front when its tail runs out,
 * which costs O(n) once per O(n) appended tokens.
 */
#ifndef KVD_CACHE_INTERNAL_H
#define KVD_CACHE_INTERNAL_H

#include "kv_cache.h"

#define KV_PAGE_ALIGN 64 /* page_bytes is a multiple of this */

/* The layer map of sliding-window layers (window.c). */
struct kv_window {
    int window;     /* W: the largest window of the windowed layers, 0 = none */
    int n_global;   /* full-attention layers (their slots: the main page table) */
    int n_groups;   /* pool pages per local page (0 without windowed layers) */
    int16_t *slot;  /* [n_layer] the layer's slot in a page */
    int16_t *group; /* [n_layer] -1: full attention; else its local group */
};

struct kv_cache {
    struct kv_layout layout; /* base, sizes, shape */
    struct kv_window win;    /* windowed layers (window.c) */
    size_t map_bytes;        /* bytes mapped at base */
    int n_pages;
    bool mlocked;
    struct cpu_pages pages;  /* the pages asked for the mapping and what the kernel did */

    int32_t *free_stack; /* [n_pages] free page ids; top at free_stack[n_free - 1] */
    int n_free;
    int32_t *refs;    /* [n_pages] references: page-table entries + outside ones; 0 = free */
    int32_t *outside; /* [n_pages] of them, taken with kv_page_ref */
    int n_shared;     /* pages with refs >= 2 */
    /* Pages with outside references, by the sequences holding them too
     * (refs - outside), exact at every reference change (pool.c,
     * kept_account): */
    int kept_idle;           /* no sequence */
    int kept_shared;         /* two or more sequences */
    int64_t kept_refs_saved; /* sum of (sequences - 1) over the kept_shared pages */

    /* kv_cache_set_reclaim: gives back pages only an outside holder keeps. */
    int (*reclaim)(void *ctx, kv_cache *cache, int n_pages);
    void *reclaim_ctx;

    struct kv_seq *seqs; /* doubly linked list of live sequences, newest first */
    int n_seqs, n_sessions;
    int32_t next_uid;
    uint64_t births; /* sequences created so far (kv_seq.birth) */

    uint64_t evictions, tokens_evicted, sessions_dropped;
    uint64_t turns_evicted, turn_cuts; /* turns.c */
    uint64_t window_pages_dropped;     /* window.c: pool pages of local pages dropped */

    kv_drop_hook drop_hook; /* seq_state.c: told of each LRU drop, or NULL */
    void *drop_ud;
};

/* One scratch entry of h2o's selection. */
struct kv_rank {
    float mass;
    int32_t idx;
};

/* A sequence's local pages (window.c): slot k holds the windowed layers'
 * K and V of one appended token, in append order, in local page k /
 * page_tokens; each local page is one pool page per group. */
struct kv_wseq {
    int32_t *ptab;  /* group g's pool page of local page p at ptab[g * lp_cap + p] */
    int n_lp, lp_cap;
    int32_t *hidx;  /* [n_slots] history index of the slot's token */
    int32_t *pos;   /* [n_slots] its position, INT32_MAX once evicted */
    int n_slots, s_cap;
    uint8_t *keep;  /* [lp_cap] scratch of the drop plan */
    uint8_t *dead;  /* [s_cap] scratch of the drop */
};

struct kv_seq {
    kv_cache *cache;
    struct kv_seq *prev, *next; /* in cache->seqs */
    int32_t uid;                /* unique among live sequences (kv_cache_check) */
    struct kv_policy policy;     /* in effect: policy_set with the pins (pins.c) */
    struct kv_policy policy_set; /* as given (kv_seq_create, kv_seq_set_policy) */
    bool session, pinned, dropped;
    uint8_t drop_plan; /* the append being planned: 1 drops it (LRU victim), 2 passed
                          it over (dropping it would free no page) */
    uint64_t last_use; /* ms, from kv_seq_touch */
    uint64_t birth;    /* creation order in the cache: the LRU's tie-break */

    /* Page table: page ids of logical pages 0..n_pages-1 at ptab[p_off..]. */
    int32_t *ptab;
    int p_off, n_pages, p_cap;

    /* Per retained token, logical i at [t_off + i]; capacity t_cap. */
    int32_t *pos;  /* position number */
    int32_t *ids;  /* token id */
    int32_t *hidx; /* history index */
    float *mass;   /* score of a scored policy (kv_seq_mass; evict_scored.c) */
    int t_off, n_tokens, t_cap;

    /* h2o scratch, capacity t_cap. */
    struct kv_rank *rank;
    uint8_t *keep;

    int32_t next_pos;   /* position of the next appended token */
    int32_t n_appended; /* tokens appended since creation/drop/truncate: next history index */

    /* Sessions: every appended id, [n_appended] (capacity h_cap). */
    int32_t *hist;
    int h_cap;

    /* Pinned spans (pins.c): history indices no policy evicts, normalized. */
    struct kv_span pins[KV_MAX_PINS];
    int n_pins;

    /* Turn table (turns.c): evictable turns in history order. */
    struct kv_turn *turns;
    int n_turns, turns_cap;
    int turn_low; /* leave down to this many tokens once turns must go */

    struct kv_wseq win; /* the windowed layers' pages (window.c) */
};

/* --- pool.c ------------------------------------------------------------ */

/* Pop a free page with one reference (the caller's). The caller checked
 * n_free > 0. */
int32_t kv_pool_alloc(kv_cache *cache);
/* One more reference to a page in use. */
void kv_pool_ref(kv_cache *cache, int32_t page);
/* Drop one reference; the last one puts the page back on the free list
 * (returns true then). Asserts the page had a reference. */
bool kv_pool_unref(kv_cache *cache, int32_t page);
/* Copy-on-write of one page-table entry: when *slot is shared, point it at
 * a fresh page holding a copy of every byte and drop the reference to the
 * shared one. The caller checked that a page is free (its plan counted
 * it). */
void kv_pool_unshare(kv_cache *cache, int32_t *slot);
/* kv_cache_check's count of the page-table entries it has seen. */
struct kv_check_tally {
    int32_t *held;           /* [n_pages] entries in page tables */
    int32_t *last;           /* [n_pages] uid of the last sequence that listed it */
    const uint8_t *free_seen; /* [n_pages] on the free list */
};
/* Count entry p of sequence uid: NULL, or what is wrong with it (out of
 * range, free, listed twice by the sequence, in either page class). */
const char *kv_check_entry(const kv_cache *c, struct kv_check_tally *t, int32_t uid, int32_t p);
/* Ask the reclaim hook (kv_cache_set_reclaim) for up to n pages; returns
 * how many reached the free list (0 without a hook). */
int kv_pool_reclaim(kv_cache *cache, int64_t n_pages);
/* Whether page is shared: another table or an outside holder reads it. */
static inline bool kv_pool_shared(const kv_cache *cache, int32_t page)
{
    return page >= 0 && cache->refs[page] > 1; /* -1: no page (window.c) */
}
/* Pages needed to hold n tokens. */
static inline int kv_pages_for(const kv_cache *cache, int64_t n)
{
    int pt = cache->layout.page_tokens;
    return (int)((n + pt - 1) / pt);
}

/* --- evict.c ----------------------------------------------------------- */

/*
 * Tokens the policy must keep of the sequence as it is now: the floor an
 * eviction can reach. n_tokens for none.
 */
int kv_evict_floor(const kv_seq *seq);
/*
 * Plan: the smallest number of tokens the policy would leave (>= floor) so
 * that `target` or fewer remain, or -1 if even the floor is above target.
 * Pure; for sink-window the answer is n_tokens minus whole pages.
 */
int kv_evict_plan(const kv_seq *seq, int target);
/*
 * Execute: evict so that at most `keep` tokens remain, where keep came from
 * kv_evict_plan (or is >= n_tokens: nothing happens). Frees pages, renumbers
 * in renumber mode, counts. Cannot fail. Returns tokens evicted.
 */
int kv_evict_apply(kv_seq *seq, int keep);

/*
 * What applying `keep` (a count kv_evict_plan returned, or n_tokens) does
 * to the current page table, for the pool's arithmetic (seq.c): `freed`
 * pages leave it that no one else holds (they return to the pool);
 * compaction may write rows into the pages [write_lo, write_hi) (empty when
 * it moves no bytes); the last token kept is in page `last` (-1: none
 * kept), indices before the eviction. For the scored policies the written
 * range is a bound (from the first middle token on), since which token
 * moves first depends on the scores.
 */
struct kv_effect {
    int freed;
    int write_lo, write_hi;
    int last;
};
void kv_evict_effect(const kv_seq *seq, int keep, struct kv_effect *out);

/* Renumber the retained tokens 0..n-1 and continue at n (renumber mode). */
void kv_evict_renumber(kv_seq *seq);
/* Copy retained token src (its K and V rows, every layer and head, and its
 * position, id, history index and mass) to logical slot dst < src. */
void kv_evict_move_token(kv_seq *seq, int dst, int src);

/* --- evict_scored.c ---------------------------------------------------- */

/*
 * The score that ranks middle token i (logical index, lo <= i < hi, the
 * middle) in a scored policy's eviction step: larger is kept. snapkv
 * max-pools its observation over pool_tokens neighbours inside [lo, hi).
 */
float kv_evict_score(const kv_seq *seq, int i, int lo, int hi);

/* --- pins.c ------------------------------------------------------------ */

/* The first index in [lo, hi) of the increasing array a whose value is
 * >= h (hi when there is none): the one binary search over history
 * indices (retained tokens, the windowed layers' slots). */
int kv_lower_bound(const int32_t *a, int lo, int hi, int64_t h);
/* The first retained index >= from whose history index is >= h (n_tokens
 * when none): retained history indices increase. */
int kv_hidx_lower(const kv_seq *seq, int from, int64_t h);
/* Pin k's retained tokens are logical [*lo, *hi). */
void kv_pins_range(const kv_seq *seq, int k, int *lo, int *hi);
/* Pinned retained tokens among logical [a, b). */
int kv_pins_count(const kv_seq *seq, int a, int b);
/* Whether a pin meets history indices [h0, h1). */
bool kv_pins_hit(const kv_seq *seq, int64_t h0, int64_t h1);
/* kv_seq_truncate's part: cut the pins at n_hist (the policy in effect
 * follows). */
void kv_pins_truncate(kv_seq *seq, int n_hist);

/* --- turns.c ----------------------------------------------------------- */

/*
 * The questions kv_seq_append, kv_seq_evict and kv_seq_max_append ask
 * before they make room, answered for a sequence with a turn table (whole
 * turns first, the policy's tokens when turns cannot do it) and passed
 * straight to the kv_evict_* functions for one without. plan and apply
 * have kv_evict_plan's and kv_evict_apply's contracts; max_append is the
 * largest append whole turns can make room for, or, when they can make
 * none, the policy's.
 */
int kv_room_plan(const kv_seq *seq, int target);
int kv_room_apply(kv_seq *seq, int keep);
int kv_room_max_append(const kv_seq *seq);
/* kv_evict_effect's answer for what kv_room_apply(seq, keep) will do. */
void kv_room_effect(const kv_seq *seq, int keep, struct kv_effect *out);
/* kv_seq_truncate's part: drop the turns reaching past n_hist. */
void kv_turns_truncate(kv_seq *seq, int n_hist);
/* Remove the table and its memory (drop, destroy). */
void kv_turns_clear(kv_seq *seq);

/* --- prefix.c ---------------------------------------------------------- */

/*
 * The index's own books (prefix.c: the essay), for prefix.c's pool side
 * and white-box tests. Entries are keyed by page id; a page is listed at
 * most once. None of these touch the pool.
 */

/* A bare index (no pool) for n_pages pages of page_tokens tokens, chains
 * rooted at fingerprint. NULL when out of memory or a size is below 1. */
kv_prefix *kv_prefix_new(int n_pages, int page_tokens, uint64_t fingerprint, int max_idle);
/* Tests: narrow the hash to force collisions (only on an empty index). */
void kv_prefix_set_hash_mask(kv_prefix *px, uint64_t mask);
/* The entry (page id) for the page that follows entry `parent` (-1: a
 * chain's first page) and holds tokens[0..page_tokens), or -1. Checks
 * parent and tokens, never the hash alone. */
int32_t kv_prefix_find(const kv_prefix *px, int32_t parent, const int32_t *tokens);
/* The longest chain of listed pages holding tokens[0..n_tokens), whole
 * pages only, at most max_pages: page ids into pages[], returns the count. */
int kv_prefix_match(const kv_prefix *px, const int32_t *tokens, int n_tokens, int32_t *pages,
                    int max_pages);
/* List page (not listed yet) as the page after `parent` holding tokens
 * (copied), as the most recently used. */
void kv_prefix_add(kv_prefix *px, int32_t parent, const int32_t *tokens, int32_t page);
/* Unlist a page with no children. Its slot's generation moves on, so no
 * stale parent link can match it again. */
void kv_prefix_remove(kv_prefix *px, int32_t page);
bool kv_prefix_listed(const kv_prefix *px, int32_t page);
/* Make a listed page the most recently used. */
void kv_prefix_touch(kv_prefix *px, int32_t page);
/* The page to take back first: the least recently used one without
 * children for which idle(px, page) holds; -1 when there is none. */
int32_t kv_prefix_victim(const kv_prefix *px, bool (*idle)(const kv_prefix *, int32_t));
int kv_prefix_n_entries(const kv_prefix *px);
/* The index's own invariants (parent links, child counts, the recency
 * list; with a pool, no listed page free), O(pages): 0, -EFAULT with the
 * first broken one in err, or -ENOMEM. */
int kv_prefix_check(const kv_prefix *px, char *err, size_t errlen);

/* --- window.c --------------------------------------------------------- */

/* Layer slots a page holds for params (n_layer without windowed layers);
 * the pool pages of one local page in *n_groups (may be NULL). */
int kv_window_page_layers(const struct kv_cache_params *p, int *n_groups);
/* The layer map of the cache (kv_cache_create); 0, or an error in err. */
int kv_window_init(kv_cache *c, const struct kv_cache_params *p, char *err, size_t errlen);
void kv_window_deinit(kv_cache *c);
/* Main pages a sequence of n_pages logical pages holds: none when every
 * layer is windowed (its page table then holds -1s). */
static inline int kv_main_pages(const kv_cache *c, int n_pages)
{
    return c->win.n_global > 0 ? n_pages : 0;
}
/* Bookkeeping room for `extra` more slots; 0 or -ENOMEM, nothing lost. */
int kv_window_reserve(kv_seq *s, int64_t extra);
/* What an append of n tokens asks of the pool for the local class: the
 * pages it opens, plus a private copy of the page being filled where a
 * fork shares it, minus the pages the drop before it (kv_window_drop)
 * gives back to the pool (those no one else holds). May be negative. */
int64_t kv_window_need(const kv_seq *s, int n);
/* Local pool pages dropping s would give back: those no one else holds. */
int64_t kv_window_unshared(const kv_seq *s);
/* kv_seq_fork's part: child (empty, just created) takes parent's slots
 * and a reference to each of its local pages. 0 or -ENOMEM (the child
 * then holds none). */
int kv_window_fork(kv_seq *child, const kv_seq *parent);
/* Let go of the slots no query can see again (evicted_only: only those
 * whose token was evicted - safe after an append, which a reservation may
 * still undo). Cannot fail after kv_window_reserve. */
void kv_window_drop(kv_seq *s, bool evicted_only);
/* Slots for the sequence's last n tokens (just appended): pages allocated
 * (planned by the caller), history and positions recorded. */
void kv_window_append(kv_seq *s, int n);
/* Every slot's position from the main table (after eviction, renumber). */
void kv_window_sync(kv_seq *s);
/* kv_seq_truncate's questions: 0, or -ESTALE when a query at next_pos
 * over the first keep tokens would need a dropped token; then the cut. */
int kv_window_truncate_ok(const kv_seq *s, int keep, int32_t next_pos);
void kv_window_truncate(kv_seq *s, int n_hist);
/* Whether the sequence may take this policy and turn table (window.c). */
bool kv_window_accepts(const kv_seq *s, const struct kv_policy *p, const struct kv_turn *turns,
                       int n);
int kv_window_pages_held(const kv_seq *s);
void kv_window_release(kv_seq *s);
void kv_window_free_seq(kv_seq *s);
/* The row of a windowed layer for retained token idx (kv_seq_k/_v). */
void *kv_window_row(kv_seq *s, int layer, int kv_head, int idx, bool v);
/* kv_cache_check's part: the local pages counted in the tally, the slots'
 * order, completeness and positions. 0, or -EFAULT with err. */
int kv_window_check(const kv_seq *s, struct kv_check_tally *t, char *err, size_t errlen);

/* Every pool page the sequence holds, both classes. */
static inline int kv_seq_pages_held(const kv_seq *s)
{
    return kv_main_pages(s->cache, s->n_pages) + kv_window_pages_held(s);
}

/* --- seq.c ------------------------------------------------------------- */

/* Keep the first n retained tokens: n_tokens = n and the pages past them
 * go back to the pool. */
void kv_seq_cut_to(kv_seq *seq, int n);
/* Release every page and token of seq (drop, destroy); keeps capacity. */
void kv_seq_release_all(kv_seq *seq);
/* Copy-on-write: if logical page j of seq is shared, give seq a private
 * copy (a fresh page, every byte copied) and drop its reference to the
 * shared one. The caller checked that a page is free (the pool's plan
 * counted it). */
void kv_seq_unshare(kv_seq *seq, int j);

#endif /* KVD_CACHE_INTERNAL_H */
