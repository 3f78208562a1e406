/*
 * metrics.h - counters, gauges and histograms of the daemon (metrics.c),
 * rendered as Prometheus text. Every function is thread-safe.
 */
#ifndef KVD_SERVER_METRICS_H
#define KVD_SERVER_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"

typedef struct srv_metrics srv_metrics;

enum srv_hist {
    SRV_HIST_TTFT,         /* seconds from submission to the first token */
    SRV_HIST_ITL,          /* seconds between consecutive tokens of a request */
    SRV_HIST_BATCH_SEQS,   /* sequences in one engine step */
    SRV_HIST_BATCH_TOKENS, /* tokens in one engine step */
    SRV_HIST_COUNT
};

/* What the engine publishes after every step (crosses threads by copy). */
struct srv_engine_gauges {
    int queue_depth; /* requests waiting for admission */
    int running;     /* sequences being prefilled or decoded */
    int sessions;    /* live sessions */
    int kv_pages_total, kv_pages_used, kv_pages_free;
    uint64_t evictions, tokens_evicted, sessions_dropped;
    enum kv_type kv_k_type, kv_v_type; /* element types of the pool's K and V */
    uint64_t kv_page_bytes;            /* bytes of one page (page_tokens tokens) */
    bool prefix_on;                    /* the prefix cache ([cache] prefix_cache) */
    struct kv_prefix_stats prefix;     /* its index */
    uint64_t prefix_prompt_tokens;     /* prompt tokens of requests that could attach */
    uint64_t prefix_hit_tokens;        /* ... of them attached from the prefix cache */
    /* [sessions] dir (engine_spill_stats): sessions written, lost for a failed
     * write, read back, files refused on reading; file bytes written, read */
    uint64_t spill_saved, spill_save_failed, spill_restored, spill_refused;
    uint64_t spill_bytes_saved, spill_bytes_restored;
};

/* Every function is thread-safe (one mutex, never held with another). */
srv_metrics *srv_metrics_create(void);
void srv_metrics_destroy(srv_metrics *m);
void srv_metrics_status(srv_metrics *m, int status);
void srv_metrics_tokens(srv_metrics *m, uint64_t prompt, uint64_t cached, uint64_t generated);
void srv_metrics_observe(srv_metrics *m, enum srv_hist h, double value);
void srv_metrics_engine(srv_metrics *m, const struct srv_engine_gauges *g);
void srv_metrics_cancelled(srv_metrics *m);
/* Chat messages evicted whole turns at a time: in place from a session's
 * cache (the engine), or left out of a rendering (turn-aware fitting). */
void srv_metrics_evicted_messages(srv_metrics *m, bool in_place, uint64_t n);
/* A chat request on a session rendered again instead of evicting in place. */
void srv_metrics_turn_fallback(srv_metrics *m);
/* Requests being prepared (rendered, tokenized) off the loop thread. */
void srv_metrics_api_jobs(srv_metrics *m, int n);

/* Connections the HTTP layer ended or could not take, by reason
 * (kvd_http_connections_closed_total{reason}). */
enum srv_conn_event {
    SRV_CONN_SLOW_READER,   /* left its answer untaken (idle_timeout / max_write_queue) */
    SRV_CONN_SHED_IDLE,     /* idle keep-alive closed to make room for a new one */
    SRV_CONN_BODY_TIMEOUT,  /* body not complete within body_timeout */
    SRV_CONN_ACCEPT_FAILED, /* accept() failed (out of descriptors) */
    SRV_CONN_EVENT_COUNT
};
void srv_metrics_conn(srv_metrics *m, enum srv_conn_event e);
/* A completion the server cut short (kvd_requests_cut_short_total{reason});
 * f is one of the engine_finish_cut finishes. */
void srv_metrics_cut(srv_metrics *m, int f);
void srv_metrics_config(srv_metrics *m, uint64_t generation, bool last_ok, int64_t when_unix_s);
/* The exposition text (new, caller frees); NULL when out of memory. */
char *srv_metrics_render(srv_metrics *m, size_t *len);

#endif /* KVD_SERVER_METRICS_H */
