/*
 * cache_map.h - a session's cache as a map (cache_map.c builds it in the
 * engine, for an ENGINE_REQ_SESSION_MAP request; the daemon's
 * server/route_map.c renders it as GET /v1/sessions/{id}/map on the loop
 * thread).
 *
 * The map is the session's history, token 0 to now, cut into ranges: runs
 * of tokens the cache still holds (sinks, the middle, the recent window)
 * and runs it evicted, each with the position numbers its tokens carry now
 * and the text of its tokens. It is a plain value that crosses from the
 * engine thread to the loop thread inside a session event (struct
 * engine_event.map), built from the sequence's own arrays (kv_seq_hist_index,
 * kv_seq_positions, kv_seq_history), so what the page draws is exactly what
 * the cache holds.
 *
 * Everything is bounded before it is built: at most ENGINE_MAP_MAX_RANGES
 * ranges (a session with more runs, as h2o's scattered heavy hitters make,
 * is shown at a coarser grain: equal slices of its history, each saying how
 * many of its tokens are retained), at most ENGINE_MAP_TEXT_TOKENS tokens of
 * text from each end of a range, and ENGINE_MAP_TEXT_BUDGET bytes of text in
 * all; the daemon's srv_map_json_bound gives the response's largest size.
 */
#ifndef KVD_ENGINE_CACHE_MAP_H
#define KVD_ENGINE_CACHE_MAP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "model/model.h"

#define ENGINE_MAP_MAX_RANGES 4096          /* the most ranges a map may carry */
#define ENGINE_MAP_DEFAULT_RANGES 1024      /* when the request says none */
#define ENGINE_MAP_MIN_RANGES 16            /* the fewest a request may ask for */
#define ENGINE_MAP_TEXT_TOKENS 48           /* text of at most this many tokens from each end */
#define ENGINE_MAP_TEXT_RANGE_BYTES 1536    /* ... and at most this many bytes per range */
#define ENGINE_MAP_TEXT_BUDGET (256 * 1024) /* bytes of text in one map */
#define ENGINE_MAP_MAX_PAGE_IDS 4096    /* page ids listed (a longer page table is counted only) */
#define ENGINE_MAP_MAX_BYTES (8u << 20) /* the response's size limit (checked before rendering) */

/* What a range of the history is. */
enum engine_map_kind {
    ENGINE_MAP_EVICTED = 0, /* no longer in the cache */
    ENGINE_MAP_SINK,        /* the first tokens, never evicted */
    ENGINE_MAP_RETAINED,    /* retained between the sinks and the window, not yet
                            chosen by eviction (sink-window evicts these next;
                            policy none keeps everything here) */
    ENGINE_MAP_HEAVY,       /* a scored policy (h2o, tova, knorm, snapkv): retained
                               between the sinks and the window by its score */
    ENGINE_MAP_WINDOW,      /* the recent window */
    ENGINE_MAP_MIXED,       /* a coarse slice holding retained and evicted tokens */
};

/* "evicted", "sink", "retained", "heavy", "window", "mixed". */
const char *engine_map_kind_name(enum engine_map_kind k);

struct engine_map_range {
    int32_t start, end; /* history indices [start, end), start < end */
    enum engine_map_kind kind;
    int32_t retained;            /* of its tokens, how many the cache holds */
    int32_t first, last;         /* logical cache indices of its first and last retained
                                    tokens (pages: index / page_tokens); -1 when none */
    int32_t pos_first, pos_last; /* their position numbers now; -1 when none */
    const char *text;            /* UTF-8 (into the map's text buffer), or NULL when the
                                    text budget ran out or text was not asked for */
    uint32_t text_len;
    bool text_elided; /* long range: its first and last ENGINE_MAP_TEXT_TOKENS
                         tokens' text, joined by " … " */
};

struct engine_map_opts {
    int max_ranges; /* ENGINE_MAP_MIN_RANGES..ENGINE_MAP_MAX_RANGES */
    bool text;      /* decode range texts */
};

/* A session's cache as ranges (engine-built, loop-rendered; free with
 * engine_cache_map_free). */
struct engine_cache_map {
    bool dropped;            /* LRU dropped the session's cache (history gone) */
    int history_tokens;      /* tokens appended since creation (or drop, truncation) */
    int retained_tokens;     /* tokens in the cache */
    int page_tokens;         /* tokens per page */
    int n_pages;             /* pages the session holds */
    int32_t *page_ids;       /* [n_page_ids] its page table, or NULL */
    int n_page_ids;          /* n_pages, or 0 when above ENGINE_MAP_MAX_PAGE_IDS */
    int32_t next_pos;        /* position the next token gets */
    struct kv_policy policy; /* its eviction policy and budget */
    int sink_tokens;         /* retained tokens the policy keeps as sinks now */
    int window_tokens;       /* ... and as the recent window */
    bool coalesced;          /* more runs than max_ranges: ranges are equal slices */
    int n_runs;              /* exact runs before coalescing */
    int n_ranges;
    struct engine_map_range *ranges; /* [n_ranges] in history order, covering it */
    char *text_buf;                  /* the ranges' text */
    size_t text_bytes;
};

/*
 * Build the map of a session's sequence (engine thread: it reads the
 * sequence, and decodes text with the model). Returns the map, or NULL
 * when memory runs out (the caller answers 503).
 */
struct engine_cache_map *engine_cache_map_build(const kv_seq *seq, const model *m,
                                                const struct engine_map_opts *opts);
void engine_cache_map_free(struct engine_cache_map *map);

#endif /* KVD_ENGINE_CACHE_MAP_H */
