/*
 * scheduler.h - the engine thread of `kvd serve` (scheduler.c): requests
 * cross to it from the loop thread, events cross back. Only the structs
 * below marked "crosses threads" are seen by both threads.
 */
#ifndef KVD_SERVER_SCHEDULER_H
#define KVD_SERVER_SCHEDULER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "model/model.h"
#include "server/cache_map.h"
#include "server/metrics.h"

typedef struct srv_sched srv_sched;

enum srv_req_kind {
    SRV_REQ_COMPLETION,     /* generate */
    SRV_REQ_SESSION_INFO,   /* describe req->session */
    SRV_REQ_SESSION_DELETE, /* free req->session */
    SRV_REQ_SESSION_MAP,    /* map req->session's cache (cache_map.h) */
};

/* Why a completion ended. */
enum srv_finish {
    SRV_FINISH_EOG = 0, /* the model ended it (EOS/EOT) */
    SRV_FINISH_STOP,    /* a stop string matched (never emitted) */
    SRV_FINISH_LENGTH,  /* max_tokens reached */
    SRV_FINISH_CONTEXT, /* the sequence's cache is full under policy none */
    SRV_FINISH_CANCEL,  /* the client left */
    /* Cut short by the server (never reported as a normal finish): */
    SRV_FINISH_ABORT,  /* the drain deadline or shutdown */
    SRV_FINISH_POOL,   /* the KV pool ran out of pages mid-generation */
    SRV_FINISH_POLICY, /* its cache filled after a reload switched it to policy none */
};
/* Whether f is one of the cut-short finishes. */
static inline bool srv_finish_cut(enum srv_finish f)
{
    return f == SRV_FINISH_ABORT || f == SRV_FINISH_POOL || f == SRV_FINISH_POLICY;
}

/* cancel values */
#define SRV_CANCEL_CLIENT 1 /* the client disconnected */
#define SRV_CANCEL_ABORT 2  /* shutdown deadline */

/*
 * A request, crossing from the loop thread to the engine thread. The loop
 * thread fills it completely before srv_sched_submit and does not change it
 * afterwards (except `cancel`); the engine reads it until it posts the
 * request's final event (SRV_EV_DONE or SRV_EV_ERROR) and never after. The
 * loop thread frees it after that final event (srv_req_free).
 */
struct srv_req {
    enum srv_req_kind kind;
    uint64_t id;     /* for logs */
    int32_t *prompt; /* [n_prompt] token ids, validated < n_vocab */
    int n_prompt;
    int max_tokens;                 /* tokens to generate at most (>= 0) */
    struct model_sampling sampling; /* seed included */
    char **stop;                    /* [n_stop] non-empty stop strings */
    int n_stop;
    char *session;        /* session id, or NULL */
    bool want_tokens;     /* report generated ids in text events */
    bool ignore_eos;      /* never sample an end-of-generation token */
    int32_t stop_token;   /* -1, or a token that ends generation like EOS (a chat
                             template's end-of-turn control token) */
    int n_keep;           /* llama.cpp n_keep: 0 = the configured sinks;
                             > 0 sink tokens; -1 the whole prompt */
    bool want_logprobs;   /* report every sampled token's log-probability
                             (struct srv_logprob in its TEXT event) */
    int n_top_logprobs;   /* ... with this many most likely tokens
                             (0..min(n_vocab, SRV_MAX_TOP_LOGPROBS)) */
    struct srv_map_opts map; /* SRV_REQ_SESSION_MAP: ranges and text */
    uint64_t t_submit_ns; /* monotonic, set by srv_sched_submit */
    atomic_int cancel;    /* 0, SRV_CANCEL_CLIENT or SRV_CANCEL_ABORT */
    atomic_bool paused;   /* its reader is behind: decode nothing for it until the
                             loop thread clears this (and calls srv_sched_wake) */
    void *owner;          /* loop thread's (api.c) */
    struct srv_req *next; /* queue link (owned by whoever queues it) */
};

struct srv_req *srv_req_new(enum srv_req_kind kind); /* zeroed; NULL on OOM */
void srv_req_free(struct srv_req *r);                /* frees its arrays too */

/* The most alternatives a request may ask for per sampled token. */
#define SRV_MAX_TOP_LOGPROBS 1000
/* The most log-probability entries, tokens x (alternatives + 1), of one
 * non-streamed answer (400 beyond). */
#define SRV_MAX_LOGPROB_ENTRIES (1 << 18)

/*
 * One sampled token's log-probabilities: log-softmax of the model's raw
 * logits for that step (before penalties, temperature and ignore_eos), in
 * double. One allocation holding the arrays (free the struct only).
 */
struct srv_logprob {
    int32_t token;  /* the token sampled */
    double logprob; /* its log-probability */
    int n_top;
    int32_t *top_ids;     /* [n_top] the most likely tokens, most likely first
                             (equal logits: the lower id first) */
    double *top_logprobs; /* [n_top] their log-probabilities */
    char *piece;          /* the text the token added to the completion, as the
                             streaming detokenizer gave it ("" for a byte that
                             starts a character; the held bytes' U+FFFD when it
                             ended the text); NUL-terminated */
    size_t piece_len;
};

enum srv_event_kind {
    SRV_EV_TEXT,  /* generated text (and ids) of a running request */
    SRV_EV_DONE,  /* final: finish reason, usage (or session info) */
    SRV_EV_ERROR, /* final: status + message, nothing (more) generated */
    SRV_EV_READY, /* the model is loaded; req NULL */
    SRV_EV_FATAL, /* loading failed; message says why; req NULL */
};

struct srv_usage {
    int prompt_tokens;     /* tokens in the prompt */
    int completion_tokens; /* tokens generated */
    int cached_tokens;     /* prompt tokens found in the session's history, not prefilled */
    int evicted_tokens;    /* tokens of this sequence's history no longer in the cache */
    int retained_tokens;   /* tokens in the cache at the end */
    double prompt_ms;      /* admission to first token (prefill) */
    double gen_ms;         /* first token to the end */
};

struct srv_session_info {
    bool found;
    bool busy;            /* a request is running on it */
    bool dropped;         /* LRU dropped its cache (history gone) */
    int history_tokens;   /* tokens in its history */
    int retained_tokens;  /* tokens in its cache */
    bool renumber;        /* positions mode */
    int64_t last_used_ms; /* unix time in ms */
    struct kv_policy policy; /* its eviction policy and budget (kv_seq_policy) */
    enum kv_type k_type, v_type; /* element types its K and V are stored in */
    int kv_pages;                /* pages it holds */
    uint64_t kv_bytes;           /* ... and their bytes */
};

/* An event, crossing from the engine thread to the loop thread (owned by
 * the receiver once taken: srv_event_free). */
struct srv_event {
    enum srv_event_kind kind;
    struct srv_req *req; /* borrowed; NULL for READY and FATAL */
    char *text;          /* TEXT: new text (may be ""), NUL-terminated */
    size_t len;
    int32_t *tokens; /* TEXT with want_tokens: ids sampled */
    int n_tokens;
    struct srv_logprob *lp;          /* TEXT with want_logprobs: the token sampled
                                        (an end-of-generation one too), else NULL */
    enum srv_finish finish;          /* DONE */
    int stop_index;                  /* DONE with SRV_FINISH_STOP: which stop string */
    struct srv_usage usage;          /* DONE */
    struct srv_session_info session; /* DONE for session requests */
    struct srv_cache_map *map;       /* DONE for a found session's map (owned), NULL
                                        when memory ran out */
    int status;                      /* ERROR: HTTP status */
    char message[600];               /* ERROR, FATAL */
    struct srv_event *next;
};

void srv_event_free(struct srv_event *ev);

/* Engine settings that a reload may change between steps. */
struct srv_sched_limits {
    struct kv_policy policy;  /* for new sequences and every session */
    int max_running;          /* sequences in flight */
    int step_tokens;          /* tokens per forward (decode + prefill chunks) */
    int queue_length;         /* waiting requests before 429 */
    uint64_t session_idle_ms; /* free sessions idle this long (0 = never) */
    int max_sessions;         /* sessions kept; the least recently used idle one goes */
};

struct srv_sched_params {
    struct model_params model;
    model *loaded; /* NULL, or the model already loaded from `model` (kvd serve
                      loads it once, to check the memory rule): the engine
                      takes it (srv_sched_create frees it on failure) and
                      does not load it again */
    size_t cache_memory; /* bytes of KV pages */
    int page_tokens;
    enum kv_type k_type, v_type; /* element types of K and V */
    bool mlock;
    int n_threads;       /* OpenMP threads of a step (0 = default) */
    int max_step_tokens; /* forward capacity (>= limits.step_tokens) */
    struct srv_sched_limits limits;
    /* Called (from the engine thread) when the event queue goes from
     * empty to non-empty: wakes the loop (uv_async_send). */
    void (*notify)(void *ud);
    void *notify_ud;
};

/*
 * Create the engine (validating the params; NULL with the reason in err).
 * Once started, its thread loads the model and creates the cache, then
 * posts SRV_EV_READY (or SRV_EV_FATAL).
 */
srv_sched *srv_sched_create(const struct srv_sched_params *p, char *err, size_t errlen);
/* Start the engine thread; it records into metrics (may be NULL).
 * Returns 0, or a negative errno with the reason in err. */
int srv_sched_start(srv_sched *s, srv_metrics *metrics, char *err, size_t errlen);
/* Stop the engine (requests still inside end with ABORT) and free it,
 * with any events not yet taken. */
void srv_sched_destroy(srv_sched *s);
/* Queue a request (ownership stays with the caller; see struct srv_req).
 * Returns 0, -EAGAIN when the queue is full, -ESHUTDOWN when stopping.
 * Session requests are never refused for a full queue. */
int srv_sched_submit(srv_sched *s, struct srv_req *r);
/* Move out every pending event, oldest first (caller frees each). */
struct srv_event *srv_sched_take_events(srv_sched *s);
/* The loaded model (after SRV_EV_READY; immutable, safe to read from the
 * loop thread for tokenizing), else NULL. */
const model *srv_sched_model(srv_sched *s);
/* Swap the limits for the next step. Returns 0, or -EINVAL with the reason
 * in err (nothing changed). */
int srv_sched_set_limits(srv_sched *s, const struct srv_sched_limits *l, char *err, size_t errlen);
/* Wake the engine for a request whose `paused` was just cleared. */
void srv_sched_wake(srv_sched *s);
/* Requests waiting for admission (for Retry-After and tests). */
int srv_sched_queue_depth(srv_sched *s);

#include "server/stop.h" /* srv_stop_scan, for the tests that include this header */

#endif /* KVD_SERVER_SCHEDULER_H */
