/*
 * session_list.c - GET /v1/sessions, one page at a time (engine thread).
 *
 * The sessions are those in memory and those saved to [sessions] dir, and
 * a directory of many small saved sessions can hold tens of thousands: one
 * answer lists at most ENGINE_LIST_MAX of them. Pages follow the ids in
 * bytewise order, so a page is named by the id it starts after, the cursor
 * of the OpenAI list APIs (`after`, `has_more`): a client that walks the
 * pages sees every session that lived through the walk exactly once,
 * whatever came and went meanwhile, with no state kept between requests.
 *
 * Building a page looks at every session's id once, keeping the `limit`
 * smallest ids after the cursor in a max-heap of `limit` entries (the
 * largest on top, replaced by anything smaller): O(n log limit)
 * comparisons, no allocation per session. Only the chosen ones are then
 * described and copied; the others are only counted, for has_more.
 *
 * A session is listed once: in memory, unless the pool dropped it and only
 * its husk is left (its file, if any, is the session then), and on disk
 * unless it is in memory as well.
 */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "engine/spill.h"

/* A session that may be listed: one of mem and disk is set (borrowed). */
struct cand {
    const char *id;
    const struct engine_session *mem;
    const struct spill_entry *disk;
};

/* The page being chosen: a max-heap by id of at most limit candidates. */
struct page {
    const char *after; /* NULL: from the first id */
    int limit;
    struct cand *heap; /* [limit] */
    int n;
    int64_t seen; /* candidates after the cursor, chosen or not */
};

static bool id_less(const struct cand *a, const struct cand *b)
{
    return strcmp(a->id, b->id) < 0;
}

static void sift_down(struct page *pg, int i)
{
    for (;;) {
        int big = i, l = 2 * i + 1, r = l + 1;
        if (l < pg->n && id_less(&pg->heap[big], &pg->heap[l]))
            big = l;
        if (r < pg->n && id_less(&pg->heap[big], &pg->heap[r]))
            big = r;
        if (big == i)
            return;
        struct cand t = pg->heap[i];
        pg->heap[i] = pg->heap[big];
        pg->heap[big] = t;
        i = big;
    }
}

/* Consider c for the page: kept if it is among the limit smallest ids
 * after the cursor seen so far. */
static void offer(struct page *pg, struct cand c)
{
    if (pg->after && strcmp(c.id, pg->after) <= 0)
        return;
    pg->seen++;
    if (pg->n < pg->limit) {
        int i = pg->n++;
        pg->heap[i] = c;
        while (i > 0 && id_less(&pg->heap[(i - 1) / 2], &pg->heap[i])) {
            struct cand t = pg->heap[i];
            pg->heap[i] = pg->heap[(i - 1) / 2];
            pg->heap[(i - 1) / 2] = t;
            i = (i - 1) / 2;
        }
    } else if (id_less(&c, &pg->heap[0])) {
        pg->heap[0] = c;
        sift_down(pg, 0);
    }
}

static int cand_cmp(const void *a, const void *b)
{
    return strcmp(((const struct cand *)a)->id, ((const struct cand *)b)->id);
}

/* Every session that is listed, offered to the page. */
static void offer_all(const struct engine_sessions *t, struct page *pg)
{
    for (int i = 0; i < t->n_buckets; i++)
        for (const struct engine_session *x = t->buckets[i]; x; x = x->next)
            if (!(t->spill && kv_seq_dropped(x->seq))) /* a husk: its file is the session */
                offer(pg, (struct cand){.id = x->id, .mem = x});
    int n_disk = 0;
    const struct spill_entry *disk = t->spill ? spill_store_list(t->spill, &n_disk) : NULL;
    for (int i = 0; i < n_disk; i++) {
        const struct engine_session *x = engine_sessions_find(t, disk[i].id);
        if (!x || kv_seq_dropped(x->seq)) /* else in memory: offered above */
            offer(pg, (struct cand){.id = disk[i].id, .disk = &disk[i]});
    }
}

/* The list item of a chosen candidate (id borrowed). */
static struct engine_session_item item_of(const struct cand *c)
{
    if (c->disk)
        return (struct engine_session_item){.id = (char *)c->id,
                                            .saved = true,
                                            .history_tokens = c->disk->n_hist,
                                            .retained_tokens = c->disk->n_tokens,
                                            .last_used_ms = c->disk->last_used_ms,
                                            .bytes = c->disk->bytes};
    struct engine_session_info si;
    engine_session_describe(c->mem, &si);
    return (struct engine_session_item){.id = (char *)c->id,
                                        .busy = si.busy,
                                        .history_tokens = si.history_tokens,
                                        .retained_tokens = si.retained_tokens,
                                        .last_used_ms = si.last_used_ms,
                                        .bytes = si.kv_bytes};
}

void engine_session_list_free(struct engine_session_list *l)
{
    if (!l)
        return;
    for (int i = 0; i < l->n; i++)
        free(l->items[i].id);
    free(l->items);
    free(l);
}

struct engine_session_list *engine_session_list_build(engine *e,
                                                      const struct engine_list_opts *opts)
{
    int limit = opts->limit <= 0                ? ENGINE_LIST_DEFAULT
                : opts->limit > ENGINE_LIST_MAX ? ENGINE_LIST_MAX
                                                : opts->limit;
    struct page pg = {.after = opts->after, .limit = limit};
    struct engine_session_list *l = calloc(1, sizeof(*l));
    pg.heap = malloc(sizeof(*pg.heap) * (size_t)limit);
    if (!l || !pg.heap)
        goto out_nomem;
    offer_all(&e->sessions, &pg);
    qsort(pg.heap, (size_t)pg.n, sizeof(*pg.heap), cand_cmp);
    l->items = calloc((size_t)pg.n + 1, sizeof(*l->items));
    if (!l->items)
        goto out_nomem;
    for (int i = 0; i < pg.n; i++) {
        l->items[i] = item_of(&pg.heap[i]);
        if (!(l->items[i].id = strdup(pg.heap[i].id)))
            goto out_nomem;
        l->n++;
    }
    l->has_more = pg.seen > pg.n;
    free(pg.heap);
    return l;

out_nomem:
    free(pg.heap);
    engine_session_list_free(l);
    return NULL;
}
