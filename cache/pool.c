/*
 * pool.c - the page pool: one mapping made at start, a free list of page
 * ids, and the accounting every other part of the cache trusts.
 *
 * All KV memory is one anonymous mapping of n_pages * page_bytes bytes made
 * by kv_cache_create; nothing is allocated per request. Free pages are an
 * int32 stack, so allocation and release are O(1) pushes and pops, and the
 * stack is LIFO on purpose: a page freed by an eviction is the next one
 * handed out, so a sequence that streams forever keeps reusing the same,
 * already resident memory.
 *
 * Pages are reference-counted. A page belongs to every sequence whose page
 * table lists it (a fork, kv_seq_fork, lists its parent's pages; a prefix
 * attached with kv_seq_attach lists pages another sequence wrote) and to
 * whoever took an outside reference (kv_page_ref: the prefix index). A page
 * goes back to the free list when its last reference goes, never before:
 * an eviction or a drop in one sequence takes away that sequence's
 * reference and no byte another holder reads. The pool counts a page once
 * however many hold it, so pages_used is the memory in use, exactly; every
 * sequence counts each of its retained tokens against its own
 * max_cache_tokens, shared or not (its attention reads them all). Bytes of
 * a shared page are never written: whoever must write into one (an append
 * into a shared partial last page, a compaction that moves rows into a
 * shared page) copies it first (kv_seq_unshare, seq.c). Beside the count,
 * each page records how many of its references are outside ones, so
 * kv_cache_check can verify every count in one pass: references = entries
 * in page tables + outside references, zero exactly for free pages.
 */
#include "cache_internal.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu/mem.h"

/* ------------------------------------------------------------------------
 * Element types
 * ------------------------------------------------------------------------ */

#define KV_QK 32 /* elements per q8_0 / q4_0 block */

size_t kv_type_size(enum kv_type type)
{
    switch (type) {
    case KV_F32:
        return 4;
    case KV_F16:
    case KV_BF16:
        return 2;
    case KV_Q8_0:
    case KV_Q4_0:
        break;
    }
    return 0;
}

size_t kv_type_row_bytes(enum kv_type type, int head_dim)
{
    if (head_dim < 1)
        return 0;
    switch (type) {
    case KV_Q8_0:
        return head_dim % KV_QK ? 0 : (size_t)(head_dim / KV_QK) * 34; /* f16 d + 32 x int8 */
    case KV_Q4_0:
        return head_dim % KV_QK ? 0 : (size_t)(head_dim / KV_QK) * 18; /* f16 d + 16 bytes */
    default:
        return (size_t)head_dim * kv_type_size(type);
    }
}

const char *kv_type_name(enum kv_type type)
{
    switch (type) {
    case KV_F32:
        return "f32";
    case KV_F16:
        return "f16";
    case KV_BF16:
        return "bf16";
    case KV_Q8_0:
        return "q8_0";
    case KV_Q4_0:
        return "q4_0";
    }
    return "unknown";
}

int kv_type_parse(const char *name, enum kv_type *out)
{
    static const enum kv_type all[] = {KV_F32, KV_F16, KV_BF16, KV_Q8_0, KV_Q4_0};
    if (!name)
        return -EINVAL;
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++) {
        if (strcmp(name, kv_type_name(all[i])) == 0) {
            *out = all[i];
            return 0;
        }
    }
    return -EINVAL;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

/* a * b into *out; false on size_t overflow. */
static bool mul_ok(size_t a, size_t b, size_t *out)
{
    if (a != 0 && b > SIZE_MAX / a)
        return false;
    *out = a * b;
    return true;
}

/*
 * The bytes of one page and of its parts: per layer a K block of
 * n_kv_head * page_tokens rows of krow bytes and a V block of vrow-byte
 * rows; page_bytes = n_layer * (K block + V block), rounded up to a cache
 * line, every product checked. False on overflow or a type that cannot
 * store head_dim. Shapes are validated by the caller.
 */
static bool page_size(const struct kv_cache_params *p, size_t *krow, size_t *vrow, size_t *kblock,
                      size_t *vblock, size_t *page)
{
    *krow = kv_type_row_bytes(p->k_type, p->head_dim);
    *vrow = kv_type_row_bytes(p->v_type, p->head_dim);
    if (!*krow || !*vrow || !mul_ok(*krow, (size_t)p->page_tokens * (size_t)p->n_kv_head, kblock) ||
        !mul_ok(*vrow, (size_t)p->page_tokens * (size_t)p->n_kv_head, vblock) ||
        *kblock > SIZE_MAX - *vblock ||
        !mul_ok(*kblock + *vblock, (size_t)kv_window_page_layers(p, NULL), page) ||
        *page > SIZE_MAX - KV_PAGE_ALIGN)
        return false;
    *page = (*page + KV_PAGE_ALIGN - 1) / KV_PAGE_ALIGN * KV_PAGE_ALIGN;
    return true;
}

size_t kv_cache_memory_for(const struct kv_cache_params *p, int64_t n_pages)
{
    size_t krow, vrow, kblock, vblock, page, bytes;
    if (n_pages < 1 || p->page_tokens < 1 || p->page_tokens > 65536 || p->n_layer < 1 ||
        p->n_kv_head < 1 || p->head_dim < 1 ||
        !page_size(p, &krow, &vrow, &kblock, &vblock, &page) ||
        !mul_ok(page, (size_t)n_pages, &bytes))
        return 0;
    return bytes;
}

static void set_err(char *err, size_t errlen, const char *msg)
{
    if (err && errlen)
        snprintf(err, errlen, "%s", msg);
}

size_t kv_cache_token_bytes(const struct kv_cache_params *p)
{
    size_t krow = kv_type_row_bytes(p->k_type, p->head_dim);
    size_t vrow = kv_type_row_bytes(p->v_type, p->head_dim);
    size_t heads, out;
    if (!krow || !vrow || p->n_layer < 1 || p->n_kv_head < 1 ||
        !mul_ok((size_t)p->n_layer, (size_t)p->n_kv_head, &heads) ||
        !mul_ok(heads, krow + vrow, &out))
        return 0;
    return out;
}

kv_cache *kv_cache_create(const struct kv_cache_params *p, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!p) {
        set_err(err, errlen, "kv cache: no parameters");
        return NULL;
    }
    if (p->page_tokens < 1 || p->page_tokens > 65536) {
        if (err)
            snprintf(err, errlen, "kv cache: page_tokens must be in 1..65536 (got %d)",
                     p->page_tokens);
        return NULL;
    }
    if (p->n_layer < 1 || p->n_kv_head < 1 || p->head_dim < 1) {
        if (err)
            snprintf(err, errlen,
                     "kv cache: n_layer, n_kv_head and head_dim must be >= 1 (got %d, %d, %d)",
                     p->n_layer, p->n_kv_head, p->head_dim);
        return NULL;
    }
    for (int v = 0; v < 2; v++) {
        enum kv_type t = v ? p->v_type : p->k_type;
        if (!kv_type_row_bytes(t, p->head_dim)) {
            if (err && kv_type_size(t) == 0 && t != KV_Q8_0 && t != KV_Q4_0)
                snprintf(err, errlen, "kv cache: unknown %s type %d", v ? "V" : "K", (int)t);
            else if (err)
                snprintf(err, errlen,
                         "kv cache: %s type %s stores blocks of 32 elements; head_dim %d is not "
                         "a multiple of 32 (use f16, bf16 or f32 for this model)",
                         v ? "V" : "K", kv_type_name(t), p->head_dim);
            return NULL;
        }
    }

    size_t krow, vrow, kblock, vblock, page;
    if (!page_size(p, &krow, &vrow, &kblock, &vblock, &page)) {
        set_err(err, errlen, "kv cache: page size overflows");
        return NULL;
    }

    size_t n_pages = p->memory_bytes / page;
    if (n_pages < 1) {
        if (err)
            snprintf(err, errlen,
                     "kv cache: memory budget of %zu bytes holds no page of %zu bytes "
                     "(%d tokens x %d layers x %d KV heads x %d dims, K in %s, V in %s)",
                     p->memory_bytes, page, p->page_tokens, p->n_layer, p->n_kv_head, p->head_dim,
                     kv_type_name(p->k_type), kv_type_name(p->v_type));
        return NULL;
    }
    if (n_pages > INT32_MAX) {
        if (err)
            snprintf(err, errlen, "kv cache: %zu pages exceed the page id range; raise page_tokens",
                     n_pages);
        return NULL;
    }

    kv_cache *c = calloc(1, sizeof(*c));
    if (!c) {
        set_err(err, errlen, "kv cache: out of memory for the pool header");
        return NULL;
    }
    c->n_pages = (int)n_pages;
    if (kv_window_init(c, p, err, errlen))
        goto out_free;
    c->free_stack = malloc(sizeof(int32_t) * n_pages);
    c->refs = calloc(n_pages, sizeof(int32_t));
    c->outside = calloc(n_pages, sizeof(int32_t));
    if (!c->free_stack || !c->refs || !c->outside) {
        set_err(err, errlen, "kv cache: out of memory for the free list");
        goto out_free;
    }

    c->map_bytes = n_pages * page;
    /* On a 2 MiB boundary, advised as huge pages (cpu/mem.h): a decoding
     * step reads a few KiB of every page of the sequence per layer, and in
     * 4 KiB pages each run is a TLB miss. bench_decode measured a 16k-token
     * layer's attention at ~0.75x the time of one thread with it. Unless
     * small_pages or KVD_HUGE_PAGES=off asks for 4 KiB: the one switch the
     * repacked weights follow too. */
    void *base = cpu_map_pages(c->map_bytes, p->small_pages, &c->pages);
    if (!base) {
        if (err)
            snprintf(err, errlen, "kv cache: cannot map %zu bytes for %zu pages: %s", c->map_bytes,
                     n_pages, strerror(errno));
        goto out_free;
    }
    if (p->mlock) {
        if (mlock(base, c->map_bytes) == 0) {
            c->mlocked = true;
        } else if (err) {
            snprintf(err, errlen,
                     "kv cache: mlock of %zu bytes failed (%s); continuing unlocked "
                     "(raise RLIMIT_MEMLOCK to lock)",
                     c->map_bytes, strerror(errno));
        }
    }

    c->layout = (struct kv_layout){
        .base = base,
        .page_bytes = page,
        .k_block_bytes = kblock,
        .v_block_bytes = vblock,
        .k_row_bytes = krow,
        .v_row_bytes = vrow,
        .page_tokens = p->page_tokens,
        .n_layer = p->n_layer,
        .page_layers = kv_window_page_layers(p, NULL),
        .n_kv_head = p->n_kv_head,
        .head_dim = p->head_dim,
        .k_type = p->k_type,
        .v_type = p->v_type,
    };
    /* Stack with page 0 on top: a fresh pool hands out pages 0, 1, 2, ... */
    for (size_t i = 0; i < n_pages; i++)
        c->free_stack[i] = (int32_t)(n_pages - 1 - i);
    c->n_free = (int)n_pages;
    return c;

out_free:
    kv_window_deinit(c);
    free(c->free_stack);
    free(c->refs);
    free(c->outside);
    free(c);
    return NULL;
}

void kv_cache_destroy(kv_cache *c)
{
    if (!c)
        return;
    while (c->seqs)
        kv_seq_destroy(c->seqs);
    if (c->mlocked)
        munlock(c->layout.base, c->map_bytes);
    cpu_unmap(c->layout.base, c->map_bytes);
    kv_window_deinit(c);
    free(c->free_stack);
    free(c->refs);
    free(c->outside);
    free(c);
}

/* ------------------------------------------------------------------------
 * Layout and stats
 * ------------------------------------------------------------------------ */

bool kv_cache_huge_pages(const kv_cache *c)
{
    return c->pages.huge;
}

const struct cpu_pages *kv_cache_pages(const kv_cache *c)
{
    return &c->pages;
}

bool kv_cache_mlocked(const kv_cache *c)
{
    return c->mlocked;
}
int kv_cache_n_pages(const kv_cache *c)
{
    return c->n_pages;
}
int kv_cache_page_tokens(const kv_cache *c)
{
    return c->layout.page_tokens;
}
uint8_t *kv_cache_base(kv_cache *c)
{
    return c->layout.base;
}
size_t kv_cache_page_bytes(const kv_cache *c)
{
    return c->layout.page_bytes;
}

size_t kv_cache_k_offset(const kv_cache *c, int layer)
{
    return kv_layout_k_offset(&c->layout, layer);
}

size_t kv_cache_v_offset(const kv_cache *c, int layer)
{
    return kv_layout_v_offset(&c->layout, layer);
}

void kv_cache_layout(kv_cache *c, struct kv_layout *out)
{
    *out = c->layout;
}

void kv_cache_stats(const kv_cache *c, struct kv_stats *out)
{
    *out = (struct kv_stats){
        .pages_total = c->n_pages,
        .pages_used = c->n_pages - c->n_free,
        .pages_free = c->n_free,
        .evictions = c->evictions,
        .tokens_evicted = c->tokens_evicted,
        .sessions_dropped = c->sessions_dropped,
        .turns_evicted = c->turns_evicted,
        .turn_cuts = c->turn_cuts,
        .pages_shared = c->n_shared,
        .window_pages_dropped = c->window_pages_dropped,
        .kept_idle = c->kept_idle,
        .kept_shared = c->kept_shared,
        .kept_refs_saved = (uint64_t)c->kept_refs_saved,
        .sequences = c->n_seqs,
        .sessions = c->n_sessions,
    };
}

/* ------------------------------------------------------------------------
 * Pages
 * ------------------------------------------------------------------------ */

int32_t kv_pool_alloc(kv_cache *c)
{
    assert(c->n_free > 0);
    int32_t page = c->free_stack[--c->n_free];
    assert(c->refs[page] == 0);
    c->refs[page] = 1;
    return page;
}

/* A main page-table entry of -1 is no page: every layer is windowed, so
 * main tables hold only placeholders (window.c). Taking or dropping a
 * reference to one does nothing. */
static bool no_page(const kv_cache *c, int32_t page)
{
    assert(page >= 0 || (page == -1 && !c->win.n_global));
    return page < 0;
}

/*
 * The kept-page gauges (struct kv_stats: kept_*) count the pages an
 * outside holder keeps by how many sequences hold them besides. They are
 * kept exact at every change of a kept page's counts, the page's share
 * taken away before (sign -1) and put back after (sign +1), so reading
 * them costs nothing: the prefix cache's gauges and its idle count used to
 * be a walk over every listed page, once per engine step.
 */
static void kept_account(kv_cache *c, int32_t page, int sign)
{
    if (page < 0 || c->outside[page] == 0)
        return;
    int32_t seqs = c->refs[page] - c->outside[page];
    c->kept_idle += sign * (seqs == 0);
    c->kept_shared += sign * (seqs >= 2);
    c->kept_refs_saved += sign * (int64_t)(seqs >= 2 ? seqs - 1 : 0);
}

/* The bare count changes, gauges aside. */
static void count_ref(kv_cache *c, int32_t page)
{
    if (no_page(c, page))
        return;
    assert(page < c->n_pages && c->refs[page] > 0);
    if (++c->refs[page] == 2)
        c->n_shared++;
}

static bool count_unref(kv_cache *c, int32_t page)
{
    if (no_page(c, page))
        return false;
    assert(page < c->n_pages && c->refs[page] > 0);
    int32_t left = --c->refs[page];
    if (left == 1)
        c->n_shared--;
    if (left > 0)
        return false;
    c->free_stack[c->n_free++] = page;
    return true;
}

void kv_pool_ref(kv_cache *c, int32_t page)
{
    kept_account(c, page, -1);
    count_ref(c, page);
    kept_account(c, page, +1);
}

bool kv_pool_unref(kv_cache *c, int32_t page)
{
    kept_account(c, page, -1);
    bool freed = count_unref(c, page);
    kept_account(c, page, +1); /* a freed page has no outside reference: no-op */
    return freed;
}

void kv_pool_unshare(kv_cache *c, int32_t *slot)
{
    if (!kv_pool_shared(c, *slot))
        return;
    int32_t fresh = kv_pool_alloc(c);
    size_t pb = c->layout.page_bytes;
    memcpy(c->layout.base + (size_t)fresh * pb, c->layout.base + (size_t)*slot * pb, pb);
    kv_pool_unref(c, *slot);
    *slot = fresh;
}

int kv_page_ref(kv_cache *c, int32_t page)
{
    if (!c || page < 0 || page >= c->n_pages || c->refs[page] == 0 || c->refs[page] == INT32_MAX)
        return -EINVAL;
    kept_account(c, page, -1);
    count_ref(c, page);
    c->outside[page]++;
    kept_account(c, page, +1);
    return 0;
}

int kv_page_unref(kv_cache *c, int32_t page)
{
    if (!c || page < 0 || page >= c->n_pages || c->outside[page] == 0)
        return -EINVAL;
    kept_account(c, page, -1);
    c->outside[page]--;
    count_unref(c, page);
    kept_account(c, page, +1);
    return 0;
}

int kv_page_refs(const kv_cache *c, int32_t page)
{
    if (!c || page < 0 || page >= c->n_pages)
        return -EINVAL;
    return c->refs[page];
}

void kv_cache_set_reclaim(kv_cache *c, int (*reclaim)(void *ctx, kv_cache *cache, int n_pages),
                          void *ctx)
{
    c->reclaim = reclaim;
    c->reclaim_ctx = ctx;
}

int kv_pool_reclaim(kv_cache *c, int64_t n_pages)
{
    if (!c->reclaim || n_pages <= 0)
        return 0;
    int before = c->n_free;
    c->reclaim(c->reclaim_ctx, c, n_pages > INT32_MAX ? INT32_MAX : (int)n_pages);
    return c->n_free - before;
}

/* ------------------------------------------------------------------------
 * Consistency check
 * ------------------------------------------------------------------------ */

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        if (err)                                                                                   \
            snprintf(err, errlen, __VA_ARGS__);                                                    \
        rc = -EFAULT;                                                                              \
        goto out;                                                                                  \
    } while (0)

const char *kv_check_entry(const kv_cache *c, struct kv_check_tally *t, int32_t uid, int32_t p)
{
    if (p < 0 || p >= c->n_pages)
        return "is out of range";
    if (t->free_seen[p])
        return "is also on the free list";
    if (t->last[p] == uid)
        return "is held twice by the sequence";
    t->last[p] = uid;
    t->held[p]++;
    return NULL;
}

/*
 * One pass over the free list and one over every page table, counting per
 * page: on the free list (must be once, with no reference) or referenced
 * (entries in page tables + outside references = its count; never twice
 * in one page table, which would let a sequence write a page it reads
 * elsewhere).
 */
int kv_cache_check(const kv_cache *c, char *err, size_t errlen)
{
    int rc = 0;
    /* held[p]: entries in page tables; last[p]: uid of the last table seen. */
    int32_t *held = calloc((size_t)c->n_pages, sizeof(int32_t));
    int32_t *last = malloc((size_t)c->n_pages * sizeof(int32_t));
    uint8_t *free_seen = calloc((size_t)c->n_pages, 1);
    if (!held || !last || !free_seen) {
        if (err)
            snprintf(err, errlen, "kv cache check: out of memory");
        free(held);
        free(last);
        free(free_seen);
        return -ENOMEM;
    }
    for (int p = 0; p < c->n_pages; p++)
        last[p] = -1;
    if (c->n_free < 0 || c->n_free > c->n_pages)
        FAIL("free count %d outside 0..%d", c->n_free, c->n_pages);
    for (int i = 0; i < c->n_free; i++) {
        int32_t p = c->free_stack[i];
        if (p < 0 || p >= c->n_pages)
            FAIL("free list entry %d holds page id %d out of range", i, p);
        if (free_seen[p])
            FAIL("page %d is on the free list twice", p);
        if (c->refs[p] != 0 || c->outside[p] != 0)
            FAIL("free page %d has %d references (%d outside)", p, c->refs[p], c->outside[p]);
        free_seen[p] = 1;
    }
    int n_seqs = 0, n_sessions = 0;
    for (const kv_seq *s = c->seqs; s; s = s->next) {
        n_seqs++;
        n_sessions += s->session;
        if (s->n_pages != kv_pages_for(c, s->n_tokens))
            FAIL("sequence %d holds %d pages for %d tokens", s->uid, s->n_pages, s->n_tokens);
        if (s->p_off + s->n_pages > s->p_cap || s->t_off + s->n_tokens > s->t_cap)
            FAIL("sequence %d arrays overrun their capacity", s->uid);
        struct kv_check_tally tally = {.held = held, .last = last, .free_seen = free_seen};
        for (int j = 0; j < s->n_pages; j++) {
            int32_t p = s->ptab[s->p_off + j];
            if (p == -1 && !c->win.n_global)
                continue; /* every layer windowed: no main pages */
            const char *why = kv_check_entry(c, &tally, s->uid, p);
            if (why)
                FAIL("sequence %d page %d (id %d) %s", s->uid, j, p, why);
        }
        if ((rc = kv_window_check(s, &tally, err, errlen)))
            goto out;
        for (int i = 1; i < s->n_tokens; i++) {
            const int32_t *pos = s->pos + s->t_off, *h = s->hidx + s->t_off;
            if (pos[i] <= pos[i - 1] || h[i] <= h[i - 1])
                FAIL("sequence %d: positions or history indices not increasing at %d", s->uid, i);
        }
        if (s->n_tokens > 0 && s->hidx[s->t_off + s->n_tokens - 1] >= s->n_appended)
            FAIL("sequence %d: history index beyond the %d tokens appended", s->uid, s->n_appended);
    }
    int used = 0, shared = 0, kept_idle = 0, kept_shared = 0;
    int64_t kept_saved = 0;
    for (int p = 0; p < c->n_pages; p++) {
        if (free_seen[p])
            continue;
        if (c->refs[p] == 0)
            FAIL("page %d is neither free nor held (leaked)", p);
        if (c->outside[p] < 0 || c->refs[p] != held[p] + c->outside[p])
            FAIL("page %d counts %d references, but %d page tables and %d outside references "
                 "hold it",
                 p, c->refs[p], held[p], c->outside[p]);
        used++;
        shared += c->refs[p] > 1;
        if (c->outside[p] > 0) {
            kept_idle += held[p] == 0;
            kept_shared += held[p] >= 2;
            kept_saved += held[p] >= 2 ? held[p] - 1 : 0;
        }
    }
    if (used + c->n_free != c->n_pages)
        FAIL("%d used + %d free != %d pages", used, c->n_free, c->n_pages);
    if (shared != c->n_shared)
        FAIL("%d pages are shared, the count says %d", shared, c->n_shared);
    if (kept_idle != c->kept_idle || kept_shared != c->kept_shared ||
        kept_saved != c->kept_refs_saved)
        FAIL("kept pages: %d idle, %d shared, %" PRId64 " references saved; the gauges say %d, %d, "
             "%" PRId64,
             kept_idle, kept_shared, kept_saved, c->kept_idle, c->kept_shared, c->kept_refs_saved);
    if (n_seqs != c->n_seqs || n_sessions != c->n_sessions)
        FAIL("sequence counts %d/%d disagree with the list %d/%d", c->n_seqs, c->n_sessions, n_seqs,
             n_sessions);
out:
    free(held);
    free(last);
    free(free_seen);
    return rc;
}
