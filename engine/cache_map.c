/*
 * cache_map.c - a session's cache as ranges of its history (engine thread).
 *
 * A session's sequence knows, for each token it still holds, the token's
 * place in the history (kv_seq_hist_index, increasing), its position number
 * (kv_seq_positions) and, for the whole history, every token id ever
 * appended (kv_seq_history). The map walks those arrays once and cuts the
 * history into runs: a run of retained tokens continues while the history
 * indices and the position numbers both go up by one and the tokens play
 * the same part (sink, middle, window); every gap in the history indices is
 * an evicted run. So a range's position numbers are exactly pos_first ..
 * pos_last, and the strip the page draws is the cache's own account.
 *
 * The part a retained token plays comes from the budget the cache states
 * for its policy (kv_policy_budget): sink-window keeps its sinks as whole
 * pages, so the first kept_tokens logical tokens are sinks; the scored
 * policies (h2o, tova, knorm, snapkv: kv_policy_scored) keep exactly
 * sink_tokens; the last window_tokens (the window in effect) are the
 * window. What lies between is, under sink-window, what eviction takes next
 * ("retained"), and under a scored policy what eviction kept for its score,
 * along with tokens that left the window since the last eviction and have
 * not been ranked against the others yet ("heavy").
 *
 * Bounds. The runs are counted before anything is allocated; a session
 * with more than opts->max_ranges of them (a scored policy's scattered keeps)
 * is cut instead into max_ranges equal slices of its history, each saying
 * how many of its tokens are retained ("mixed" when some are and some are
 * not). Text is decoded from both ends of a range, at most
 * ENGINE_MAP_TEXT_TOKENS tokens and ENGINE_MAP_TEXT_RANGE_BYTES bytes each, into
 * one buffer of at most ENGINE_MAP_TEXT_BUDGET bytes; ranges past the budget
 * carry no text. The work is O(retained tokens + ranges x text tokens),
 * whatever the session's length.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "engine/cache_map.h"

const char *engine_map_kind_name(enum engine_map_kind k)
{
    switch (k) {
    case ENGINE_MAP_EVICTED:
        return "evicted";
    case ENGINE_MAP_SINK:
        return "sink";
    case ENGINE_MAP_RETAINED:
        return "retained";
    case ENGINE_MAP_HEAVY:
        return "heavy";
    case ENGINE_MAP_WINDOW:
        return "window";
    case ENGINE_MAP_MIXED:
        return "mixed";
    }
    return "unknown";
}

/* The sequence's arrays, borrowed for one build. */
struct walk {
    const int32_t *hist; /* [n] history index of each retained token */
    const int32_t *pos;  /* [n] its position number */
    int n;               /* retained tokens */
    int history;         /* history length */
    int sinks, window;   /* logical [0, sinks) are sinks, [n - window, n) the window */
    enum engine_map_kind middle;
};

static enum engine_map_kind kind_at(const struct walk *w, int i)
{
    if (i < w->sinks)
        return ENGINE_MAP_SINK;
    if (i >= w->n - w->window)
        return ENGINE_MAP_WINDOW;
    return w->middle;
}

/*
 * The run starting at history index *h, whose first retained token at or
 * after it is logical index *i; advances both past it. Returns false at
 * the end of the history.
 */
static bool next_run(const struct walk *w, int *h, int *i, struct engine_map_range *out)
{
    if (*h >= w->history)
        return false;
    memset(out, 0, sizeof(*out));
    out->start = *h;
    if (*i < w->n && w->hist[*i] == *h) {
        int a = *i, b = a;
        enum engine_map_kind k = kind_at(w, a);
        while (b + 1 < w->n && w->hist[b + 1] == w->hist[b] + 1 && w->pos[b + 1] == w->pos[b] + 1 &&
               kind_at(w, b + 1) == k)
            b++;
        out->end = w->hist[b] + 1;
        out->kind = k;
        out->retained = b - a + 1;
        out->first = a;
        out->last = b;
        out->pos_first = w->pos[a];
        out->pos_last = w->pos[b];
        *i = b + 1;
    } else {
        out->end = *i < w->n ? w->hist[*i] : w->history;
        out->kind = ENGINE_MAP_EVICTED;
        out->first = out->last = out->pos_first = out->pos_last = -1;
    }
    *h = out->end;
    return true;
}

/* Slice s of k equal slices of the history: its retained tokens counted,
 * its kind the part most of them play (mixed when some were evicted). */
static void slice(const struct walk *w, int s, int k, int *i, struct engine_map_range *out)
{
    memset(out, 0, sizeof(*out));
    out->start = (int32_t)((int64_t)w->history * s / k);
    out->end = (int32_t)((int64_t)w->history * (s + 1) / k);
    out->first = out->last = out->pos_first = out->pos_last = -1;
    int count[ENGINE_MAP_MIXED + 1] = {0};
    while (*i < w->n && w->hist[*i] < out->end) {
        if (out->first < 0) {
            out->first = *i;
            out->pos_first = w->pos[*i];
        }
        out->last = *i;
        out->pos_last = w->pos[*i];
        count[kind_at(w, *i)]++;
        out->retained++;
        (*i)++;
    }
    out->kind = ENGINE_MAP_EVICTED;
    if (out->retained == out->end - out->start) {
        out->kind = ENGINE_MAP_SINK;
        for (int c = ENGINE_MAP_SINK; c <= ENGINE_MAP_WINDOW; c++)
            if (count[c] > count[out->kind])
                out->kind = (enum engine_map_kind)c;
    } else if (out->retained > 0) {
        out->kind = ENGINE_MAP_MIXED;
    }
}

/* The text buffer being filled (capacity fixed up front). */
struct textbuf {
    char *buf;
    size_t len, cap;
};

/*
 * Append the text of ids[0..n), at most `limit` bytes of it (whole
 * characters: a piece that does not fit ends the part). Returns 0, or
 * -ENOMEM.
 */
static int decode_part(const model *m, const int32_t *ids, int n, size_t limit, struct textbuf *t)
{
    model_detok *d = model_detok_create(m);
    if (!d)
        return -ENOMEM;
    size_t end = t->len + limit < t->cap ? t->len + limit : t->cap;
    for (int i = 0; i <= n; i++) {
        int w = i < n ? model_detok_push(d, ids[i], t->buf + t->len, end - t->len)
                      : model_detok_flush(d, t->buf + t->len, end - t->len);
        if (w < 0)
            break; /* -ENOSPC: the part is full */
        t->len += (size_t)w;
    }
    model_detok_destroy(d);
    return 0;
}

static void append(struct textbuf *t, const char *s)
{
    size_t n = strlen(s);
    if (t->len + n <= t->cap) {
        memcpy(t->buf + t->len, s, n);
        t->len += n;
    }
}

/* The text of range r from the history ids, into t (nothing once t is
 * nearly full). Returns 0 or -ENOMEM. */
static int range_text(const model *m, const int32_t *ids, struct engine_map_range *r,
                      struct textbuf *t)
{
    if (t->cap - t->len < ENGINE_MAP_TEXT_RANGE_BYTES)
        return 0;
    size_t at = t->len;
    int n = r->end - r->start, T = ENGINE_MAP_TEXT_TOKENS;
    int rc;
    if (n <= 2 * T) {
        rc = decode_part(m, ids + r->start, n, ENGINE_MAP_TEXT_RANGE_BYTES, t);
    } else {
        size_t half = (ENGINE_MAP_TEXT_RANGE_BYTES - 8) / 2;
        rc = decode_part(m, ids + r->start, T, half, t);
        append(t, " \xE2\x80\xA6 "); /* " … " */
        if (rc == 0)
            rc = decode_part(m, ids + r->end - T, T, half, t);
        r->text_elided = true;
    }
    r->text = t->buf + at; /* the buffer never moves: its size is fixed up front */
    r->text_len = (uint32_t)(t->len - at);
    return rc;
}

/* The walk's parts from the sequence's policy and the cache's budget. */
static void walk_init(struct walk *w, const kv_seq *seq, struct engine_cache_map *map)
{
    const struct kv_policy *p = kv_seq_policy(seq);
    struct kv_budget b;
    kv_policy_budget(p, map->page_tokens, &b);
    w->hist = kv_seq_hist_index(seq);
    w->pos = kv_seq_positions(seq);
    w->n = kv_seq_n_tokens(seq);
    w->history = kv_seq_history(seq, NULL);
    bool scored = kv_policy_scored(p->kind);
    int64_t sinks = p->kind == KV_EVICT_SINK_WINDOW ? b.kept_tokens : scored ? p->sink_tokens : 0;
    int64_t window = p->kind == KV_EVICT_NONE ? 0 : b.window_tokens;
    w->sinks = (int)(sinks < w->n ? sinks : w->n);
    w->window = (int)(window < w->n - w->sinks ? window : w->n - w->sinks);
    w->middle = scored ? ENGINE_MAP_HEAVY : ENGINE_MAP_RETAINED;
    map->sink_tokens = w->sinks;
    map->window_tokens = w->window;
}

struct engine_cache_map *engine_cache_map_build(const kv_seq *seq, const model *m,
                                                const struct engine_map_opts *opts)
{
    struct engine_cache_map *map = calloc(1, sizeof(*map));
    if (!map)
        return NULL;
    kv_cache *cache = kv_seq_cache(seq);
    map->dropped = kv_seq_dropped(seq);
    map->page_tokens = kv_cache_page_tokens(cache);
    map->policy = *kv_seq_policy(seq);
    map->next_pos = kv_seq_next_pos(seq);
    map->n_pages = kv_seq_n_pages(seq);
    struct walk w;
    walk_init(&w, seq, map);
    map->history_tokens = w.history;
    map->retained_tokens = w.n;

    if (map->n_pages > 0 && map->n_pages <= ENGINE_MAP_MAX_PAGE_IDS) {
        map->page_ids = malloc((size_t)map->n_pages * sizeof(int32_t));
        if (!map->page_ids)
            goto out_free;
        memcpy(map->page_ids, kv_seq_page_table(seq), (size_t)map->n_pages * sizeof(int32_t));
        map->n_page_ids = map->n_pages;
    }

    /* Count the runs, then keep them or slice the history. */
    struct engine_map_range r;
    int h = 0, i = 0;
    while (next_run(&w, &h, &i, &r))
        map->n_runs++;
    int max = opts->max_ranges;
    map->coalesced = map->n_runs > max;
    map->n_ranges = map->coalesced ? max : map->n_runs;
    map->ranges = calloc((size_t)(map->n_ranges ? map->n_ranges : 1), sizeof(*map->ranges));
    if (!map->ranges)
        goto out_free;
    h = i = 0;
    for (int k = 0; k < map->n_ranges; k++) {
        if (map->coalesced)
            slice(&w, k, max, &i, &map->ranges[k]);
        else
            next_run(&w, &h, &i, &map->ranges[k]);
    }

    /* Text, from the history's ids, within the budget. */
    const int32_t *ids = NULL;
    kv_seq_history(seq, &ids);
    if (opts->text && ids && map->n_ranges > 0) {
        size_t need = (size_t)map->n_ranges * ENGINE_MAP_TEXT_RANGE_BYTES;
        struct textbuf t = {.cap = need < ENGINE_MAP_TEXT_BUDGET ? need : ENGINE_MAP_TEXT_BUDGET};
        t.buf = malloc(t.cap);
        if (!t.buf)
            goto out_free;
        map->text_buf = t.buf;
        for (int k = 0; k < map->n_ranges; k++)
            if (range_text(m, ids, &map->ranges[k], &t) != 0)
                goto out_free;
        map->text_bytes = t.len;
    }
    return map;

out_free:
    engine_cache_map_free(map);
    return NULL;
}

void engine_cache_map_free(struct engine_cache_map *map)
{
    if (!map)
        return;
    free(map->page_ids);
    free(map->ranges);
    free(map->text_buf);
    free(map);
}
