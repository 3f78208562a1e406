/*
 * kv_cache.h - the paged KV cache: page pool, sequences, eviction policies.
 *
 * kvd keeps sessions alive past the model's window and past memory. The
 * cache is where that happens: keys and values live in fixed-size pages of
 * one pool allocated at start, a sequence is a page table plus, per cached
 * token, a position number and a token id, and an eviction policy removes
 * tokens from the middle of a sequence without ever rewriting the bytes of
 * a token that stays. Keys are stored as the model produced them, before any
 * rotation; the attention kernel rotates or biases them from the position
 * numbers, so renumbering after an eviction touches only an int32 array.
 *
 * Page layout, stated once (the attention kernel reads it through
 * struct attn_kv, field for field):
 *
 *   page p starts at base + p * page_bytes (page_bytes is a multiple of 64);
 *   inside a page, layer l has a K block at k_offset(l) = l*(kblock+vblock)
 *   and a V block at v_offset(l) = k_offset(l) + kblock, where
 *   kblock = n_kv_head * page_tokens * krow and krow is the bytes of one
 *   head_dim row in k_type (vblock, vrow likewise in v_type); a block
 *   holds, per KV head h, page_tokens rows contiguous: head h at
 *   +h*page_tokens*row, token slot s of that head at +s*row.
 *
 *   K and V have their own types: f32, f16, bf16, or GGUF's q8_0 / q4_0
 *   blocks (32 elements and one f16 scale: 34 / 18 bytes, so head_dim must be
 *   a multiple of 32 for them). A row is written once, when its token is
 *   appended, and its bytes never change after: eviction frees or moves
 *   whole rows, renumbering touches positions only, so a quantised row is
 *   never requantised.
 *
 * Logical token i of a sequence lives in page page_table[i / page_tokens],
 * slot i % page_tokens. Every page of a page table is full except the last.
 *
 * Shared pages. A page may be listed by several page tables (kv_seq_fork,
 * kv_seq_attach) and held by outside references (kv_page_ref: the prefix
 * index); it is reference-counted and freed when its last holder lets go.
 * A page another holder reads is never written: an append into a shared
 * partly-full last page, or an eviction that compacts rows into a shared
 * page, first gives the sequence a private copy (copy-on-write). Eviction
 * and drops take away one sequence's references, never bytes another
 * holder uses. Keys are stored unrotated, so a page is valid in any
 * sequence whose tokens before it are the same, whatever positions they
 * are later given. Accounting: the pool counts a page once however many
 * hold it (pages_used is memory in use); each sequence counts every token
 * it retains against its own max_cache_tokens, shared or not.
 *
 * Sinks and pages. sink-window keeps sinks as whole pages: the first
 * ceil(sink_tokens / page_tokens) pages of a sequence are never evicted (with
 * sink_tokens = 4 and 16-token pages the first page stays whole, i.e. 16
 * sink tokens are kept). It then frees whole pages after the sinks, oldest
 * first, and only pages that lie entirely before the last window_tokens
 * tokens, so at least window_tokens recent tokens survive every eviction.
 * h2o is token-granular: it keeps exactly the first sink_tokens tokens, the
 * last window_tokens tokens and the heavy_tokens middle tokens with the
 * largest accumulated attention mass (tova, knorm and snapkv likewise, by
 * their own scores), compacting the survivors towards the
 * front of the sequence (their bytes are copied whole, never changed).
 *
 * Threading: one engine thread owns a kv_cache and every sequence in it. No
 * function here takes a lock, prints or exits; actions return 0 or a
 * negative errno-style code and, where they can fail on input, fill a
 * caller-owned err buffer with the reason.
 */
#ifndef KVD_KV_CACHE_H
#define KVD_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu/mem.h"

/* ------------------------------------------------------------------------
 * Element types
 * ------------------------------------------------------------------------ */

/* Same numbering as attn_type (the model room passes them through). */
enum kv_type { KV_F32 = 0, KV_F16, KV_BF16, KV_Q8_0, KV_Q4_0 };

/* Bytes per element of a float type (4, 2, 2); 0 for q8_0, q4_0 (use
 * kv_type_row_bytes) and for a value outside the enum. */
size_t kv_type_size(enum kv_type type);
/* Bytes of one row of head_dim elements: head_dim * size for the float
 * types, head_dim / 32 blocks of 34 (q8_0) or 18 (q4_0) bytes; 0 for a value
 * outside the enum or a head_dim the type cannot store (< 1, or not a
 * multiple of 32 for q8_0 and q4_0). */
size_t kv_type_row_bytes(enum kv_type type, int head_dim);
/* "f32", "f16", "bf16", "q8_0", "q4_0"; "unknown" for a value outside the enum. */
const char *kv_type_name(enum kv_type type);
/* Parse one of those names. Returns 0, or -EINVAL with *out unchanged. */
int kv_type_parse(const char *name, enum kv_type *out);

/* ------------------------------------------------------------------------
 * The pool
 * ------------------------------------------------------------------------ */

struct kv_cache_params {
    size_t memory_bytes; /* budget for pages; n_pages = memory_bytes / page_bytes */
    int page_tokens;     /* tokens per page (default 16), 1..65536 */
    int n_layer;         /* layers, >= 1 */
    int n_kv_head;       /* key/value heads per layer, >= 1 */
    int head_dim;        /* elements per head, >= 1 (a multiple of 32 for q8_0, q4_0) */
    enum kv_type k_type; /* element type of K */
    enum kv_type v_type; /* element type of V */
    bool mlock;          /* try to lock the pages in RAM (see kv_cache_create) */
    bool small_pages;    /* the pool in 4 KiB pages, not advised as 2 MiB (cpu/mem.h's
                            switch, KVD_HUGE_PAGES over it; model_kv_shape sets it from
                            the model's params, so one setting governs both) */
    const int32_t *layer_window; /* NULL, or [n_layer] (copied): > 0, the layer's sliding
                                    window W; those layers get their own pages, dropped
                                    once no query can see them (window.c); 0 = full */
};

/*
 * Bytes one token takes in the pool: K and V rows of every layer and KV
 * head, in their types (the page adds at most 63 bytes of alignment per
 * page_tokens tokens). 0 when a type cannot store head_dim or the product
 * overflows. The one formula every budget check uses.
 */
size_t kv_cache_token_bytes(const struct kv_cache_params *params);

typedef struct kv_cache kv_cache; /* the pool + all sequences; one owner thread */

/*
 * Create the pool: validates the params (a quantised type with a head_dim
 * that is not a multiple of 32 is refused, naming both), maps n_pages * page_bytes bytes
 * once (anonymous mmap on a 2 MiB boundary, advised as huge pages unless
 * small_pages or KVD_HUGE_PAGES=off says 4 KiB (cpu_map_pages); pages are
 * touched, and so resident, only when a sequence first writes them unless
 * mlock is set) and builds the free list.
 * Returns the cache, or NULL with the reason in err (bad shape, a budget
 * that holds no page, more than INT32_MAX pages, mmap failure).
 *
 * mlock failure is not fatal: the cache is created unlocked,
 * kv_cache_mlocked() returns false and err holds a one-line warning (err is
 * the empty string on a clean success), so the caller can log it.
 */
kv_cache *kv_cache_create(const struct kv_cache_params *params, char *err, size_t errlen);
/*
 * The memory_bytes that give a pool of exactly n_pages pages of this shape
 * (page_bytes * n_pages), for callers that size a pool by pages (`kvd
 * eval`, `kvd generate`). Returns 0 for an invalid shape, n_pages < 1 or
 * overflow.
 */
size_t kv_cache_memory_for(const struct kv_cache_params *params, int64_t n_pages);
/* Unmap the pool. Sequences still alive are destroyed with it (their handles
 * become invalid). NULL is a no-op. */
void kv_cache_destroy(kv_cache *cache);

bool kv_cache_mlocked(const kv_cache *cache);
/* Whether the pool's mapping was advised as 2 MiB pages (the kernel took
 * MADV_HUGEPAGE; speed only, nothing depends on it). */
bool kv_cache_huge_pages(const kv_cache *cache);
/* The pages asked for the pool, whether the kernel refused the advice, and
 * what the start line says of them ("2 MiB pages advised", "4 KiB pages,
 * KVD_HUGE_PAGES=off", ...). */
const struct cpu_pages *kv_cache_pages(const kv_cache *cache);
int kv_cache_n_pages(const kv_cache *cache);
int kv_cache_page_tokens(const kv_cache *cache);
uint8_t *kv_cache_base(kv_cache *cache);
size_t kv_cache_page_bytes(const kv_cache *cache);
size_t kv_cache_k_offset(const kv_cache *cache, int layer);
size_t kv_cache_v_offset(const kv_cache *cache, int layer);

/*
 * The layout as a plain description, for the inline accessor below and for
 * filling struct attn_kv (base, page_bytes, kv_layout_k_offset(l),
 * kv_layout_v_offset(l), page_tokens, type).
 */
struct kv_layout {
    uint8_t *base;                    /* first byte of page 0 */
    size_t page_bytes;                /* bytes from one page to the next */
    size_t k_block_bytes;             /* bytes of one layer's K block in a page */
    size_t v_block_bytes;             /* ... and of its V block */
    size_t k_row_bytes, v_row_bytes;  /* one token of one head: kv_type_row_bytes */
    int page_tokens;                  /* tokens per page */
    int n_layer, n_kv_head, head_dim;
    int page_layers;                  /* layer slots in a page: n_layer, or with windowed
                                         layers the full-attention ones (all when none is:
                                         window.c); kv_cache_layer_slot maps a layer */
    enum kv_type k_type, v_type;
};

void kv_cache_layout(kv_cache *cache, struct kv_layout *out);

/* Offsets of a layer slot's K and V blocks (the slot is the layer itself
 * without windowed layers; kv_cache_layer_slot in general). */
static inline size_t kv_layout_k_offset(const struct kv_layout *l, int layer_slot)
{
    return (size_t)layer_slot * (l->k_block_bytes + l->v_block_bytes);
}

static inline size_t kv_layout_v_offset(const struct kv_layout *l, int layer_slot)
{
    return kv_layout_k_offset(l, layer_slot) + l->k_block_bytes;
}

/* First byte of token slot `slot` of page `page`, layer slot `layer`, KV
 * head `head`: the K row when v is false, the V row when true. */
static inline void *kv_layout_elem(const struct kv_layout *l, int page, int slot, int layer,
                                   int head, bool v)
{
    size_t off = (size_t)page * l->page_bytes +
                 (v ? kv_layout_v_offset(l, layer) : kv_layout_k_offset(l, layer)) +
                 ((size_t)head * (size_t)l->page_tokens + (size_t)slot) *
                     (v ? l->v_row_bytes : l->k_row_bytes);
    return l->base + off;
}

/* ------------------------------------------------------------------------
 * Sliding-window layers (window.c: the essay)
 * ------------------------------------------------------------------------ */

/* The page slot of layer l (k_offset = kv_layout_k_offset(layout, slot)). */
int kv_cache_layer_slot(const kv_cache *cache, int layer);
/* W, the largest window of the windowed layers; 0 when no layer has one. */
int kv_cache_window(const kv_cache *cache);

struct kv_stats {
    int pages_total, pages_used, pages_free;
    uint64_t evictions;        /* eviction steps that removed at least one token */
    uint64_t tokens_evicted;   /* tokens removed by eviction (not by free, drop or truncate) */
    uint64_t sessions_dropped; /* sessions dropped whole by LRU */
    uint64_t turns_evicted;    /* whole turns evicted in place (turns.c) */
    uint64_t turn_cuts;        /* evictions that had to cut into turns (turns.c) */
    int pages_shared;          /* pages with two or more holders (counted once in pages_used) */
    uint64_t window_pages_dropped; /* pool pages of windowed layers dropped (window.c) */
    int sequences;             /* live sequences, sessions included */
    int sessions;              /* live sequences created as sessions */
    /* Pages an outside holder keeps (kv_page_ref: the prefix index), by the
     * sequences that hold them besides; exact at any moment, O(1) to read: */
    int kept_idle;             /* no sequence: only the outside holder (reclaimable) */
    int kept_shared;           /* two or more sequences */
    uint64_t kept_refs_saved;  /* sequences' references beyond the first, over kept pages */
};

void kv_cache_stats(const kv_cache *cache, struct kv_stats *out);

/*
 * Consistency check, O(pages + tokens): every page is either on the free
 * list exactly once with no reference, or held: its reference count equals
 * the page tables listing it plus its outside references (kv_page_ref),
 * and no page table lists it twice; the shared-page count and the kept-page
 * gauges agree; every
 * sequence holds ceil(n_tokens / page_tokens) pages; history indices and
 * positions increase. Returns 0, -ENOMEM, or -EFAULT with the first broken
 * invariant in err. For tests and debug builds.
 */
int kv_cache_check(const kv_cache *cache, char *err, size_t errlen);

/*
 * Outside references: a holder that is not a sequence (the prefix index)
 * keeps a page alive with kv_page_ref and lets go with kv_page_unref; the
 * page returns to the pool with its last reference, sequence or outside.
 * A page can be referenced only while in use (a sequence or an outside
 * holder has it): its bytes are whatever the sequence that wrote it wrote.
 * kv_page_ref returns 0, or -EINVAL for a page id out of range or free;
 * kv_page_unref returns 0, or -EINVAL when the page holds no outside
 * reference (nothing changes). kv_page_refs is the page's count of
 * references (0: free), or -EINVAL for an id out of range.
 */
int kv_page_ref(kv_cache *cache, int32_t page);
int kv_page_unref(kv_cache *cache, int32_t page);
int kv_page_refs(const kv_cache *cache, int32_t page);

/*
 * The reclaim hook: when an append finds the pool short, before it drops
 * any idle session, it calls reclaim(ctx, cache, n) once, asking the outside
 * holder to kv_page_unref pages no sequence holds, up to n of them, least
 * useful first; what reaches the free list counts toward the append. The
 * hook runs on the cache's thread, inside the append: it may call
 * kv_page_unref and the const getters, nothing else of the cache. Its
 * return value is not trusted (the pool counts its free list). A refused
 * append keeps the pages reclaimed. NULL removes the hook.
 */
void kv_cache_set_reclaim(kv_cache *cache, int (*reclaim)(void *ctx, kv_cache *cache, int n_pages),
                          void *ctx);

/* ------------------------------------------------------------------------
 * Eviction policies
 * ------------------------------------------------------------------------ */

/*
 * The scored policies (h2o, tova, knorm, snapkv) share one shape, [sinks |
 * heavy_tokens middle tokens by score | window], and one eviction step;
 * they differ in the per-token score (evict_scored.c: the essay).
 */
enum kv_policy_kind {
    KV_EVICT_NONE = 0,
    KV_EVICT_SINK_WINDOW,
    KV_EVICT_H2O,    /* score: attention mass accumulated over every query */
    KV_EVICT_TOVA,   /* score: attention mass from the latest query only */
    KV_EVICT_KNORM,  /* score: the key's L2 norm, from the unrotated key at append */
    KV_EVICT_SNAPKV, /* score: mass from a prompt chunk's last observe_tokens queries,
                        max-pooled over pool_tokens neighbours; decode keeps it */
};

struct kv_policy {
    enum kv_policy_kind kind;
    int max_cache_tokens; /* retained-token budget of one sequence, >= 1 */
    int sink_tokens;      /* kept at the start (sink-window rounds up to pages) */
    int window_tokens;    /* recent tokens kept */
    int heavy_tokens;     /* scored policies only: middle tokens kept by score */
    int observe_tokens;   /* snapkv only: last queries of a prompt chunk observed, >= 1 */
    int pool_tokens;      /* snapkv only: max-pool width over neighbours, >= 1 (1 = none) */
    bool knorm_smallest;  /* knorm only: evict the smallest norms (default: the largest) */
    bool renumber;        /* true: positions = renumber; false: preserve */
    bool window_auto;     /* window_tokens was resolved from 0 (the rest of the budget):
                             pinned spans take their room from it (pins.c) */
};

/* Whether kind ranks middle tokens by a score (h2o, tova, knorm, snapkv). */
bool kv_policy_scored(enum kv_policy_kind kind);

/*
 * The budget a policy implies for a page size, worked out in one place:
 * kv_policy_budget is the only function that does this arithmetic, and
 * kv_policy_check, the config rules (through the hook the program wires,
 * see config.h), the scheduler's n_keep, `kvd eval` and `kvd generate`
 * all read it from there.
 *
 *   kept     what the policy keeps besides the window: the sinks rounded
 *            up to whole pages (sink-window), sink + heavy tokens (scored);
 *   floor    kept + one page: a full sequence needs one page eviction
 *            can free;
 *   room     max_cache_tokens - floor: the largest window that fits;
 *   step     sink-window: what one eviction step frees at the budget. A
 *            step renumbers every retained position (O(retained)), so a
 *            step of one page costs per evicted token in proportion to
 *            the budget; the step is 1/256 of the budget in whole pages
 *            (one page up to 4,096 tokens of 16-token pages), which keeps
 *            that cost near 256 position writes per evicted token at
 *            every budget. An explicit window bounds it by the slack it
 *            leaves; the automatic window is room less the step's extra
 *            pages, so at the budget the step's pages are evictable;
 *   need     floor + window_tokens: the smallest max_cache_tokens the
 *            policy accepts (kv_policy_check's rule).
 *
 * "window_tokens = 0 fills the budget" is the convention of the operator's
 * config and of `kvd generate`: window_tokens below is the window in effect
 * under it. The cache itself takes a policy's window_tokens literally.
 */
struct kv_budget {
    int64_t kept_tokens;    /* kept besides the window (0 for none) */
    int64_t floor_tokens;   /* kept + one page (0 for none) */
    int64_t window_room;    /* max_cache_tokens - floor_tokens; negative when the
                               kept tokens alone leave no page to free */
    int64_t window_tokens;  /* the window in effect: window_tokens when > 0, else
                               window_room less step_tokens' pages beyond the
                               first (0 if negative); none: as set */
    int64_t step_tokens;    /* sink-window: the most one eviction step frees at the
                               budget, whole pages: 1/256 of max_cache_tokens (at
                               least one page) within the slack the window leaves;
                               other kinds: one page */
    int64_t need_tokens;    /* floor + window_tokens as set (1 for none) */
    int64_t sequence_pages; /* pages one sequence can occupy at its full budget:
                               ceil(max_cache_tokens / page_tokens) + 1 (eviction
                               frees whole pages, so the first page, the sinks, and
                               the last, being filled, may each be partly empty) */
};

/*
 * Work out the budget of *p for pages of page_tokens tokens (values below
 * 1 count as 1; kinds outside the enum as none). Never fails; the terms
 * are exact in int64 for any int inputs.
 */
void kv_policy_budget(const struct kv_policy *p, int page_tokens, struct kv_budget *out);

/*
 * The positions a sequence under *p can reach: max_cache_tokens under
 * renumber (the retained tokens are numbered 0..n-1 and n never passes
 * the budget), 0 = no bound under preserve (a kept position is never
 * lowered, so a session's numbers grow past every eviction, turn
 * evictions included). What a model whose RoPE depends on the context it
 * serves (Phi-3's LongRoPE tables) is told.
 */
int kv_policy_position_bound(const struct kv_policy *p);

/*
 * Validate a policy for a given page size. Returns 0, or -EINVAL with the
 * reason in err. Budgets must leave eviction something to free:
 *   none:        max_cache_tokens >= 1 (sinks, window and heavy are unused);
 *   sink-window: max_cache_tokens >= ceil(sink/page)*page + window + page;
 *   scored:      max_cache_tokens >= sink + window + heavy + page
 *                (snapkv also: observe_tokens >= 1, pool_tokens >= 1);
 * that is, need_tokens of kv_policy_budget (the one statement of the rule).
 */
int kv_policy_check(const struct kv_policy *policy, int page_tokens, char *err, size_t errlen);
/* "none" | "sink-window" | "h2o" | "tova" | "knorm" | "snapkv". Returns 0, or
 * -EINVAL with *out unchanged. */
int kv_policy_parse_kind(const char *name, enum kv_policy_kind *out);
const char *kv_policy_kind_name(enum kv_policy_kind kind);

/*
 * Pool pages one sequence can occupy at its full budget in a cache of this
 * shape (layer_window included) under policy pol, with appends of at most
 * chunk_tokens tokens: kv_policy_budget's sequence_pages without windowed
 * layers; with them, the main pages (none when every layer is windowed)
 * plus the local class's - the window and a chunk, rounded to pages, plus
 * two partly filled pages, per group - unless the policy can bring any
 * dropped token back (scored policies under renumber; sink-window under
 * renumber with window_tokens < W keeps its sinks) or the budget is within
 * the window: then as many as the main ones. The one formula of the
 * windowed budget: pool sizing, check-config and the serve start line
 * read it. A chat's pinned head under renumber is kept beyond it.
 */
int64_t kv_cache_sequence_pages(const struct kv_cache_params *params, const struct kv_policy *pol,
                                int chunk_tokens);
/* The same for a sequence of `tokens` tokens (at most pol's budget) in this
 * cache: the engine's admission counts pages with it. */
int64_t kv_cache_pages_for(const kv_cache *cache, const struct kv_policy *pol, int tokens,
                           int chunk_tokens);
/* Pool pages one more token can open: 1, or with windowed layers one per
 * group beside the main page (none when every layer is windowed). */
int kv_cache_token_pages(const kv_cache *cache);

/* ------------------------------------------------------------------------
 * Sequences and sessions
 * ------------------------------------------------------------------------ */

typedef struct kv_seq kv_seq;

/*
 * A new empty sequence in the cache (no pages yet). A session also records
 * the id of every token ever appended (its history) so a later prompt can be
 * matched against it. The policy is copied. Returns NULL with the reason in
 * err when the policy fails kv_policy_check or memory runs out.
 */
kv_seq *kv_seq_create(kv_cache *cache, const struct kv_policy *policy, bool session, char *err,
                      size_t errlen);
/* Drop the sequence's references to its pages (a page no one else holds
 * goes back to the pool) and free it. NULL is a no-op. */
void kv_seq_destroy(kv_seq *seq);

/*
 * A new sequence sharing every page of parent: the page table by reference
 * (no page is copied or allocated), positions, token ids, history indices,
 * scores, the policy, the pins, the turn table and, for a session child,
 * the history by copy; with sliding-window layers, their local pages by
 * reference and their slots by copy (window.c). From then on the two are independent: each appends, evicts and
 * is destroyed on its own, and the first write either makes into a page
 * they still share copies it (so a fork costs at most one page at its next
 * append: the partly full last page, and one per local group of a cache
 * with sliding-window layers). A session child needs a session
 * parent. The child is not pinned. Returns the child, or NULL with the
 * reason in err (no parent, a session child of a non-session parent,
 * out of memory for the bookkeeping); the parent is unchanged either way.
 */
kv_seq *kv_seq_fork(kv_seq *parent, bool session, char *err, size_t errlen);

/*
 * Append n_pages whole pages that are already in use (written by another
 * sequence, kept by the prefix index) with their tokens'
 * ids tokens[0 .. n_pages * page_tokens): the sequence takes a reference
 * to each page, no byte is copied, and positions, ids and history are
 * recorded as kv_seq_append records them. The caller vouches that the
 * pages hold the K and V of exactly these tokens after exactly the tokens
 * the sequence already holds, and that none of them is in its table yet.
 * No eviction: the tokens must fit within max_cache_tokens as they are.
 * Returns 0; -EINVAL (n_pages < 0, NULL arrays, a page id out of range or
 * free, a sequence whose last page is not full); -ENOSPC (past
 * max_cache_tokens); -EOVERFLOW (positions or history past INT32_MAX);
 * -ENOMEM (bookkeeping); -EOPNOTSUPP (a cache with sliding-window
 * layers: the pages hold only the full-attention layers, so there is no
 * slot for the windowed ones - no prefix cache there). On error nothing
 * changed.
 */
int kv_seq_attach(kv_seq *seq, const int32_t *pages, int n_pages, const int32_t *tokens);

/*
 * Replace the policy (config reload). It takes effect at the next eviction:
 * positions already assigned stay until then. Scores stay, except that
 * moving to or from knorm (norms, not masses) resets them to 0. Returns 0, or -EINVAL with
 * nothing changed if the policy fails kv_policy_check, or -E2BIG with nothing
 * changed if the sequence's pins do not fit it (kv_pins_fit). kv_seq_policy
 * then returns the policy in effect: an automatic window less the pins' cost.
 */
int kv_seq_set_policy(kv_seq *seq, const struct kv_policy *policy);
const struct kv_policy *kv_seq_policy(const kv_seq *seq);
/* The cache the sequence lives in (borrowed). */
kv_cache *kv_seq_cache(const kv_seq *seq);

int kv_seq_n_tokens(const kv_seq *seq);              /* retained tokens */
const int32_t *kv_seq_page_table(const kv_seq *seq); /* [kv_seq_n_pages] page ids */
int kv_seq_n_pages(const kv_seq *seq);              /* page table entries (logical pages) */
/* Pool pages the sequence holds, both classes: kv_seq_n_pages without
 * windowed layers; with them the main pages (none when every layer is
 * windowed) and the windowed layers' own. What admission counts. */
int kv_seq_pool_pages(const kv_seq *seq);
const int32_t *kv_seq_positions(const kv_seq *seq); /* [n_tokens] */
const int32_t *kv_seq_tokens(const kv_seq *seq);    /* [n_tokens] ids of retained tokens */
/* [n_tokens] history index of each retained token (its place among all
 * tokens ever appended since creation, drop or truncation). */
const int32_t *kv_seq_hist_index(const kv_seq *seq);
const float *kv_seq_mass(const kv_seq *seq); /* [n_tokens] accumulated attention mass */
/* Position the next appended token gets: renumber mode, n_tokens after an
 * eviction; preserve mode, one past the last position ever assigned. */
int32_t kv_seq_next_pos(const kv_seq *seq);

/*
 * Make room for and append n tokens (ids in tokens[0..n)). In order:
 *   1. if n_tokens + n > max_cache_tokens, the policy evicts (whole pages
 *      for sink-window, down to sinks + window + heavy for the scored ones);
 *   2. if the pool is still short of pages, the reclaim hook gives back
 *      pages only an outside holder keeps (kv_cache_set_reclaim), then idle
 *      sessions are dropped whole, least recently touched first (never
 *      pinned ones, never non-session sequences, never this one, never one
 *      whose every page another holder keeps: that frees nothing);
 *   3. if it is still short, the policy evicts further from this sequence,
 *      down to what it must keep.
 * The pool's part counts shared pages exactly: pages the eviction frees are
 * those no one else holds, and every shared page the step will write (the
 * partly full last page; pages a compaction moves rows into) costs a copy.
 * Every step is planned before anything changes. Then positions are
 * assigned, pages allocated and ids (and history for sessions) recorded; on
 * success *first (may be NULL) is the logical index of the first new token
 * and the caller writes K and V of every new token through kv_seq_k /
 * kv_seq_v for every layer and KV head.
 *
 * Returns 0; -EINVAL (n < 0, tokens NULL with n > 0); -ENOSPC "context
 * full": the policy cannot make room for n tokens within max_cache_tokens
 * (always so for policy none once the budget is full; for the others when n
 * exceeds kv_seq_max_append); -ENOMEM: the pool cannot supply the pages even
 * after eviction and LRU, or bookkeeping memory ran out; -EOVERFLOW:
 * positions or history would pass INT32_MAX. On every error nothing changed.
 * Appending to a sequence that LRU dropped works as on a new one.
 */
int kv_seq_append(kv_seq *seq, const int32_t *tokens, int n, int *first);

/*
 * Reservation (reserve.c): slots for one engine step's new tokens, for
 * every sequence of the batch, all or nothing. Each sequence appends its
 * tokens (kv_seq_append: its policy evicts first, idle sessions may be
 * dropped for pages); the forward pass then writes K and V into exactly
 * these slots (logical indices first .. first + n_tokens - 1) and computes.
 *
 * Returns 0, or with *failed (may be NULL) the index of the sequence that
 * could not be served: -EINVAL (a NULL sequence or tokens, n_tokens < 1);
 * -ENOSPC its context is full under its policy (checked for every sequence
 * before anything changes); -ENOMEM the pool cannot supply the pages, or a
 * sequence of the batch lost its pages to another's append (running
 * sessions should be pinned); -EOVERFLOW positions or history would pass
 * INT32_MAX. On every error no sequence holds a token reserved by this
 * call; what a policy evicted to make room stays evicted.
 */
struct kv_reservation {
    kv_seq *seq;           /* in: the sequence */
    const int32_t *tokens; /* in: [n_tokens] the new token ids (borrowed) */
    int n_tokens;          /* in: >= 1 */
    int first;             /* out: logical index of the first reserved slot */
    /* private to reserve.c */
    int hist0;
    bool made, was_dropped;
};

int kv_reserve(struct kv_reservation *r, int n, int *failed);

/* Take back the slots a successful kv_reserve made (the forward pass failed):
 * each sequence is cut back to the history it had before. */
void kv_reserve_undo(struct kv_reservation *r, int n);

/* The K (V) row of retained token idx: head_dim elements in k_type (v_type),
 * kv_type_row_bytes of them. idx < n_tokens; for a windowed layer the
 * token must still have its slot (the tokens just reserved always do). */
void *kv_seq_k(kv_seq *seq, int layer, int kv_head, int idx);
void *kv_seq_v(kv_seq *seq, int layer, int kv_head, int idx);

/*
 * What layer `layer` of the sequence attends to: the page table,
 * positions and count of the main table for a full-attention layer; for a
 * windowed one its local pages, whose slots hold every retained token a
 * query can still see (evicted ones kept in a live page carry position
 * INT32_MAX, which the causal mask hides). Borrowed until the sequence
 * next changes.
 */
struct kv_seq_view {
    const int32_t *page_table;
    const int32_t *pos;
    int n_kv;
    bool local; /* the windowed class: attention mass goes to kv_seq_add_window_mass */
};
void kv_seq_layer_view(const kv_seq *seq, int layer, struct kv_seq_view *out);
/* Slots of the windowed layers (0 without them): a windowed layer's n_kv. */
int kv_seq_window_slots(const kv_seq *seq);
/* kv_seq_add_mass for a windowed layer's mass ([kv_seq_window_slots]). */
void kv_seq_add_window_mass(kv_seq *seq, const float *mass);

/* Whether n more tokens fit without evicting: within max_cache_tokens and
 * with enough free pages in the pool (counting the copy of a shared, partly
 * full last page). */
bool kv_seq_has_room(const kv_seq *seq, int n);
/* The largest n kv_seq_append can accept under the policy now (evicting as
 * the policy allows), the pool aside. The scheduler's prefill chunk bound.
 * With a turn table (kv_seq_set_turns): the largest n whole turns can make
 * room for, or the policy's when they can make none. */
int kv_seq_max_append(const kv_seq *seq);

/*
 * Explicit eviction step (the scheduler may call it ahead of an append):
 * evict as the policy does so that n_needed more tokens fit within
 * max_cache_tokens. Returns the number of tokens evicted (0 when they
 * already fit), -EINVAL for n_needed < 0, or, with nothing changed, -ENOSPC
 * when the policy cannot make that much room, -ENOMEM when the eviction
 * would compact rows into shared pages and the pool has no page for their
 * copies (the reclaim hook is asked first).
 */
int kv_seq_evict(kv_seq *seq, int n_needed);

/*
 * Scores (evict_scored.c). kv_seq_mass returns each retained token's score:
 * attention mass (h2o: accumulated; tova: the latest step's; snapkv: the
 * latest prompt chunk's observation) or the signed key norm (knorm).
 *
 * The forward pass, at the start of a call that computes n_q new queries of
 * the sequence, asks kv_seq_mass_queries how many of the call's LAST queries
 * the kernel should report mass for (0: none; h2o: n_q; tova: 1; snapkv:
 * min(observe_tokens, n_q) when n_q >= 2, else 0). The policies that score
 * by the latest queries alone (tova, snapkv) forget the previous scores
 * here, so the call's layers then add up a fresh score. Returns 0 for
 * n_q < 1.
 */
int kv_seq_mass_queries(kv_seq *seq, int n_q);
/* Add the attention mass the kernel reported for each retained token
 * (mass[0..n_tokens)) to its score (once per layer). */
void kv_seq_add_mass(kv_seq *seq, const float *mass);
/* Whether the policy scores keys by their norm (knorm): the forward then
 * reports every new key through kv_seq_add_key_norm. */
bool kv_seq_wants_key_norms(const kv_seq *seq);
/* knorm: add the L2 norm of k[0..head_dim) (one layer and KV head of
 * retained token idx, unrotated, as the model produced it) to the token's
 * score, averaged over layers and KV heads; no-op for other policies. */
void kv_seq_add_key_norm(kv_seq *seq, int idx, const float *k, int head_dim);

/* Sessions: the ids of every token appended (evicted ones included) since
 * creation, a drop or a truncation; *ids may be NULL. Returns the length;
 * 0 with *ids = NULL for a sequence that is not a session. */
int kv_seq_history(const kv_seq *seq, const int32_t **ids);
/*
 * Truncate to the first n_hist history tokens: retained tokens whose history
 * index is >= n_hist are removed (their pages go back to the pool) and the
 * history is cut to n_hist. Used when a new prompt diverges from the
 * history. The next position continues after the last kept position
 * (renumber) or at the cut's own position (preserve). Returns 0, or -EINVAL
 * with nothing changed for n_hist outside [0, tokens appended].
 */
int kv_seq_truncate(kv_seq *seq, int n_hist);
bool kv_seq_is_session(const kv_seq *seq);
void kv_seq_touch(kv_seq *seq, uint64_t now_ms); /* last use time, passed in */
uint64_t kv_seq_last_touch(const kv_seq *seq);   /* the time last touched (0: never) */
/* The session LRU's one order, for the pool (idle sessions dropped for
 * pages) and for the engine (max_sessions, the idle timeout) alike: a was
 * touched before b, or at the same time and created before it. */
bool kv_seq_lru_before(const kv_seq *a, const kv_seq *b);
void kv_seq_pin(kv_seq *seq, bool busy);         /* pinned sessions are never dropped */
/* True once LRU dropped this session: its pages, tokens and history are
 * gone. The flag stays until kv_seq_destroy. */
bool kv_seq_dropped(const kv_seq *seq);

/* ------------------------------------------------------------------------
 * Pinned spans (pins.c): tokens no policy evicts
 * ------------------------------------------------------------------------ */

/* A run of history indices [start, end) (kv_seq_hist_index): in a session
 * these are the prompt's token indices, in this and every later request. */
struct kv_span {
    int32_t start, end;
};

#define KV_MAX_PINS 64 /* pinned spans of one sequence, after merging */

/*
 * Sort spans[0..n) and merge the overlapping and touching ones, in place.
 * Returns the count left, or -EINVAL (a span with start < 0 or end <=
 * start; n < 0) or -E2BIG (more than KV_MAX_PINS left), the reason in err.
 */
int kv_spans_normalize(struct kv_span *spans, int n, char *err, size_t errlen);
/*
 * What normalized spans cost the budget of p, in tokens kept besides the
 * sinks and the window (see pins.c: token-granular for the scored
 * policies, whole pages for sink-window, 0 for none).
 */
int64_t kv_pins_cost(const struct kv_policy *p, int page_tokens, const struct kv_span *spans,
                     int n);
/*
 * Whether normalized spans fit p's budget: *out is p in effect with them
 * (an automatic window shrinks by their cost and must keep a page; a set
 * window must fit beside them). Returns 0, or -E2BIG with the sizes in
 * err (*out is then p). Pure: the server's early check and the sequence's
 * own (kv_seq_set_pins) are this one function.
 */
int kv_pins_fit(const struct kv_policy *p, int page_tokens, const struct kv_span *spans, int n,
                struct kv_policy *out, char *err, size_t errlen);
/*
 * Replace the sequence's pins (copied, normalized; n = 0 clears them).
 * Every policy, the turns and the LRU's partial evictions keep a retained
 * pinned token; the policy in effect (kv_seq_policy) becomes the policy as
 * set with the pins (kv_pins_fit). Returns 0, or -EINVAL / -E2BIG with the
 * reason in err and nothing changed. kv_seq_truncate cuts the pins at the
 * cut; a drop (LRU) clears them.
 */
int kv_seq_set_pins(kv_seq *seq, const struct kv_span *spans, int n, char *err, size_t errlen);
/* The sequence's pins, normalized (*spans borrowed, may be NULL); the count. */
int kv_seq_pins(const kv_seq *seq, const struct kv_span **spans);

/* ------------------------------------------------------------------------
 * Turns (turns.c): eviction that keeps a conversation's structure
 * ------------------------------------------------------------------------ */

/*
 * One turn of a conversation a sequence holds: a user message and the
 * messages that answer it, as a run of history indices. A chat engine
 * tells the cache where its turns lie; the cache then evicts whole turns
 * instead of tokens (see turns.c).
 */
struct kv_turn {
    int32_t hist_start; /* history index of the turn's first token, >= 0 */
    int32_t n_tokens;   /* its tokens: history indices hist_start .. hist_start+n_tokens-1, >= 1 */
    int32_t n_messages; /* messages the turn holds (for the caller's accounting), >= 0 */
};

/*
 * Give the sequence a turn table (copied): the turns it may give up, in
 * history order, not overlapping. Tokens outside every turn (the system
 * prompt, the tool definitions, the last user turn, the generation prompt,
 * the answer being written) are pinned. A turn may lie beyond the tokens
 * appended so far; it becomes evictable once all of its tokens have been
 * appended. n = 0 (turns may then be NULL) removes the table: the policy
 * evicts tokens again.
 *
 * While a sequence has a table, making room (kv_seq_append, kv_seq_evict,
 * kv_reserve) evicts whole turns oldest first, whatever the policy's kind
 * (under none the table is the only eviction), in place: the survivors'
 * K and V bytes move down over the gap, never change; positions renumber
 * or stay as the policy says. Once turns must leave, they leave until at
 * most low_tokens tokens remain (when the turns allow; values outside
 * 1..max_cache_tokens mean max_cache_tokens: only what is needed), so the
 * compaction's cost is spread over the tokens appended after it. When
 * evicting every evictable turn still would not make the room, the policy
 * evicts tokens as it would without a table and kv_stats.turn_cuts counts
 * it: the one case where a turn is cut, never a silent one.
 *
 * kv_seq_truncate drops the turns that reach past the cut; a drop (LRU)
 * or kv_seq_destroy removes the table.
 *
 * Returns 0; -EINVAL with the reason in err and the old table kept (a
 * negative start, a turn of no tokens, a negative message count, turns out
 * of order or overlapping, n < 0, turns NULL with n > 0); -ENOMEM with the
 * old table kept.
 */
int kv_seq_set_turns(kv_seq *seq, const struct kv_turn *turns, int n, int low_tokens, char *err,
                     size_t errlen);

/* What became of a sequence's turn table, counted from the cache. */
struct kv_turn_state {
    int turns;            /* turns in the table */
    int turns_evicted;    /* of them, appended whole and now wholly gone */
    int messages_evicted; /* the messages of those */
    int turns_cut;        /* partly gone: the policy cut them (kv_stats.turn_cuts) */
};

/* Fill *out, O(turns log tokens). A sequence without a table reports zeros. */
void kv_seq_turn_state(const kv_seq *seq, struct kv_turn_state *out);

/* ------------------------------------------------------------------------
 * Sequence state for saving and restoring sessions (seq_state.c)
 * ------------------------------------------------------------------------ */

/*
 * Everything a session sequence holds besides its K and V rows: what a
 * saved session must carry to continue exactly where it stopped. Arrays
 * are borrowed (from the sequence by kv_seq_get_state; from the caller by
 * kv_seq_import).
 */
struct kv_seq_state {
    int n_hist;            /* tokens appended since creation, drop or truncation */
    const int32_t *hist;   /* [n_hist] their ids (the session's history) */
    int n_tokens;          /* retained tokens */
    const int32_t *ids;    /* [n_tokens] retained ids */
    const int32_t *pos;    /* [n_tokens] their position numbers, increasing */
    const int32_t *hidx;   /* [n_tokens] their history indices, increasing, < n_hist */
    const float *mass;     /* [n_tokens] their scores (kv_seq_mass) */
    int32_t next_pos;      /* kv_seq_next_pos */
    int n_turns;           /* the turn table (kv_seq_set_turns), 0 for none */
    const struct kv_turn *turns;
    int turn_low;          /* its low-water mark */
    int n_pins;            /* pinned spans (kv_seq_pins), 0..KV_MAX_PINS */
    const struct kv_span *pins; /* [n_pins] history indices, normalized */
};

/* The state of a session sequence (borrowed: valid until the sequence
 * next changes). A sequence that is not a session reports n_hist 0. */
void kv_seq_get_state(const kv_seq *seq, struct kv_seq_state *out);

/*
 * Give an empty session sequence (no tokens, no history: new, or truncated
 * to 0) the state st, then the caller writes the K and V rows of every
 * retained token through kv_seq_k / kv_seq_v, as the forward pass would.
 * Pages come as for an append (kv_seq_append's order: idle sessions may be
 * dropped for them, through the drop hook). The state is checked first,
 * since it comes from outside the process: every history index in
 * [0, n_hist) and increasing, hist[hidx[i]] == ids[i], positions >= 0 and
 * increasing, next_pos past the last one, scores finite, the turn table
 * valid (kv_seq_set_turns), the pins valid and within the sequence's
 * policy (kv_seq_set_pins).
 *
 * Returns 0; -EINVAL with the reason in err (a state that fails those
 * checks, a sequence that is not an empty session); -E2BIG: pins the
 * sequence's policy has no room for (a reload shrank it); -ENOSPC: more retained
 * tokens than the policy's max_cache_tokens; -ENOMEM: the pool cannot
 * supply the pages, or bookkeeping memory ran out. On every error the
 * sequence is empty again.
 */
int kv_seq_import(kv_seq *seq, const struct kv_seq_state *st, char *err, size_t errlen);

/*
 * The drop hook: called with each idle session the pool drops (LRU, inside
 * an append or a reservation of another sequence), before its pages go
 * back, so that its owner may save it (read it; never change the cache
 * from the hook). fn NULL removes the hook.
 */
typedef void (*kv_drop_hook)(void *ud, kv_seq *seq);
void kv_cache_set_drop_hook(kv_cache *cache, kv_drop_hook fn, void *ud);

/* ------------------------------------------------------------------------
 * The prefix cache (prefix.c)
 * ------------------------------------------------------------------------ */

/*
 * An index of full pages by the tokens up to and including them (a hash
 * chain rooted at the model's fingerprint; prefix.c: the essay). A new
 * sequence attaches the longest chain its prompt starts with instead of
 * computing it; a sequence publishes its full pages for others. The index
 * holds one outside reference (kv_page_ref) to each page it lists and is
 * the pool's reclaim hook: pages only it holds (idle) go back oldest first
 * when the pool runs short, before any idle session is dropped. Owned by
 * whoever created it, on the cache's thread; destroy it before the cache.
 */
typedef struct kv_prefix kv_prefix;

struct kv_prefix_stats {
    uint64_t fingerprint;       /* the chains' root, as given to kv_prefix_create */
    int pages_listed;           /* pages in the index */
    /* exact when read (the pool's kept-page gauges, struct kv_stats): */
    int pages_idle;             /* listed pages no sequence holds (reclaimable) */
    int pages_shared;           /* ... held by two or more sequences */
    uint64_t page_refs_saved;   /* sequences' references to listed pages beyond the
                                   first: copies that sharing saves, in pages */
    /* counters: */
    uint64_t pages_attached;    /* pages sequences took from the index (hits) */
    uint64_t pages_published;   /* pages listed so far */
    uint64_t pages_reclaimed;   /* idle pages given back (pool short, or the cap) */
};

/*
 * An index over cache, chains rooted at fingerprint (the model and KV
 * types), keeping at most max_idle_pages idle pages after kv_prefix_trim.
 * Installs itself as the cache's reclaim hook. NULL with the reason in
 * err (out of memory, a negative cap).
 */
kv_prefix *kv_prefix_create(kv_cache *cache, uint64_t fingerprint, int max_idle_pages, char *err,
                            size_t errlen);
/* Let go of every listed page (idle ones return to the pool) and remove
 * the hook. NULL is a no-op. */
void kv_prefix_destroy(kv_prefix *px);

/*
 * Attach to seq the longest listed chain that tokens[0..n_tokens) starts
 * with, beyond the tokens seq holds. seq must hold exactly
 * tokens[0..kv_seq_n_tokens(seq)), whole pages, never evicted (positions
 * and history 0..n-1), and its own pages must be the chain's; otherwise, or
 * when nothing longer is listed, nothing happens. At most what fits within
 * max_cache_tokens is attached. Returns the tokens attached (a multiple of
 * page_tokens, >= 0), or kv_seq_attach's negative error with nothing
 * changed. The caller keeps at least one token of a prompt out of
 * n_tokens if it needs logits after it.
 */
int kv_prefix_attach(kv_prefix *px, kv_seq *seq, const int32_t *tokens, int n_tokens);
/*
 * List seq's full pages that are not listed yet, if seq never evicted:
 * pages whose tokens another sequence listed first stay seq's own (the
 * chain goes on from the listed copy). Call after the forward pass wrote
 * them. Returns the pages listed (0 when seq evicted).
 */
int kv_prefix_publish(kv_prefix *px, kv_seq *seq);
/* Listed pages tokens[0..n_tokens) starts with (whole pages), and in
 * *idle_pages (may be NULL) how many of them are idle: admission's
 * arithmetic. Changes nothing but a scratch buffer. */
int kv_prefix_lookup(kv_prefix *px, const int32_t *tokens, int n_tokens, int *idle_pages);
/* Idle pages (reclaimable), O(1). */
int kv_prefix_idle_pages(const kv_prefix *px);
/* Give back idle pages, oldest first, down to the cap; returns the pages
 * given back. O(1) when under the cap (once per engine step), else a walk
 * from the old end of the recency list. */
int kv_prefix_trim(kv_prefix *px);
void kv_prefix_get_stats(const kv_prefix *px, struct kv_prefix_stats *out);

#endif /* KVD_KV_CACHE_H */
