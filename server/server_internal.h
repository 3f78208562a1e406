/*
 * server_internal.h - helpers shared inside the server room only.
 */
#ifndef KVD_SERVER_INTERNAL_H
#define KVD_SERVER_INTERNAL_H

#include <stdbool.h>

/*
 * Parse a whole decimal integer in [min, max]. Returns 0, or -1 if s is
 * empty, has trailing characters, or is out of range (*out untouched).
 */
int srv_parse_long(const char *s, long min, long max, long *out);

/* Parse a whole floating-point number in [min, max]; same contract. */
int srv_parse_double(const char *s, double min, double max, double *out);

/*
 * Option scanning for subcommands: if argv[*i] is `name`, store the next
 * argument in *value, advance *i past both and return true. A missing
 * value prints "kvd CMD: NAME needs a value" and sets *bad.
 */
bool srv_opt_value(int argc, char **argv, int *i, const char *cmd, const char *name,
                   const char **value, bool *bad);

/* --- chat_template.c: the chat template a model is served with ----------- */

#include "template/template.h"

/* A whole file (new, NUL-terminated; *len its length), or NULL with the
 * reason (path and errno) in err. */
char *srv_read_file(const char *path, size_t *len, char *err, size_t errlen);

struct model;
struct srv_chat_template_opts {
    const char *path;      /* operator's template file, or NULL/"": the model's */
    const char *name;      /* NULL, or the variant tokenizer.chat_template.NAME */
    const char *bos_token; /* NULL, or the BOS text instead of the model's */
    const char *eos_token; /* NULL, or the EOS text instead of the model's */
};

/*
 * Load the chat template for m (NULL: no model, only o->path or ChatML):
 * the operator's file, else the model's, else ChatML. Writes where it came
 * from into source. Returns a new chat template, or NULL with the reason in
 * err (an unreadable file; a template refused, with line:column).
 */
tpl_chat *srv_chat_template_load(const struct model *m, const struct srv_chat_template_opts *o,
                                 char *source, size_t source_len, char *err, size_t errlen);

/* ======================================================================
 * The daemon (kvd serve). Threads: the loop thread (libuv: http.c, api.c,
 * daemon.c) and the engine thread (scheduler.c). Only the structs below
 * marked "crosses threads" are seen by both; metrics.c and log.c lock.
 * ====================================================================== */

#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "config/config.h"
#include "model/model.h"

/*
 * The KV type options of generate and eval: --kv-type T (K and V),
 * --k-type T, --v-type T, T one of f32, f16, bf16, q8_0, q4_0. Same
 * contract as srv_opt_value; a bad type prints what is accepted and sets *bad.
 */
bool srv_opt_kv_types(int argc, char **argv, int *i, const char *cmd, enum kv_type *k_type,
                      enum kv_type *v_type, bool *bad);

/* --- log.c: one line per event on stderr, text or JSON ------------------ */

enum srv_log_level { SRV_LOG_DEBUG = 0, SRV_LOG_INFO, SRV_LOG_WARN, SRV_LOG_ERROR };

/* Set the threshold and the format (json: one JSON object per line). */
void srv_log_setup(enum srv_log_level level, bool json);
/* "debug" | "info" | "warn" | "error". Returns 0, or -1 with *out unchanged. */
int srv_log_parse_level(const char *s, enum srv_log_level *out);
/* Thread-safe: each call writes one whole line. */
void srv_log(enum srv_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* --- metrics.c: counters, gauges, histograms; Prometheus text ----------- */

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
};

/* Every function is thread-safe (one mutex, never held with another). */
srv_metrics *srv_metrics_create(void);
void srv_metrics_destroy(srv_metrics *m);
void srv_metrics_status(srv_metrics *m, int status);
void srv_metrics_tokens(srv_metrics *m, uint64_t prompt, uint64_t cached, uint64_t generated);
void srv_metrics_observe(srv_metrics *m, enum srv_hist h, double value);
void srv_metrics_engine(srv_metrics *m, const struct srv_engine_gauges *g);
void srv_metrics_cancelled(srv_metrics *m);
/* Chat messages left out of prompts by turn-aware fitting. */
void srv_metrics_evicted_messages(srv_metrics *m, uint64_t n);

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
 * f is one of the srv_finish_cut finishes. */
void srv_metrics_cut(srv_metrics *m, int f);
void srv_metrics_config(srv_metrics *m, uint64_t generation, bool last_ok, int64_t when_unix_s);
/* The exposition text (new, caller frees); NULL when out of memory. */
char *srv_metrics_render(srv_metrics *m, size_t *len);

/* --- scheduler.c: the engine thread ---------------------------------------- */

typedef struct srv_sched srv_sched;

enum srv_req_kind {
    SRV_REQ_COMPLETION,     /* generate */
    SRV_REQ_SESSION_INFO,   /* describe req->session */
    SRV_REQ_SESSION_DELETE, /* free req->session */
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
    uint64_t t_submit_ns; /* monotonic, set by srv_sched_submit */
    atomic_int cancel;    /* 0, SRV_CANCEL_CLIENT or SRV_CANCEL_ABORT */
    atomic_bool paused;   /* its reader is behind: decode nothing for it until the
                             loop thread clears this (and calls srv_sched_wake) */
    void *owner;          /* loop thread's (api.c) */
    struct srv_req *next; /* queue link (owned by whoever queues it) */
};

struct srv_req *srv_req_new(enum srv_req_kind kind); /* zeroed; aborts on OOM */
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

/*
 * Stop strings (scheduler.c, exposed for tests). Given the text held back
 * so far, find the earliest stop string occurring in it: returns its index
 * and sets *at to its offset. Otherwise returns -1 and sets *safe to the
 * number of leading bytes that no stop string can still start in (the rest
 * is a proper prefix of some stop string and must be held).
 */
int srv_stop_scan(const char *text, size_t len, char *const *stop, int n_stop, size_t *at,
                  size_t *safe);

/* --- http.c: connections, parsing, limits, responses ------------------------ */

typedef struct srv_http srv_http;
typedef struct srv_conn srv_conn;
struct uv_loop_s;

struct srv_http_params {
    size_t max_header_bytes;    /* request line + headers (431) */
    int max_headers;            /* header count (431) */
    size_t max_body_bytes;      /* body (413) */
    uint64_t header_timeout_ms; /* from a request's first byte to its headers' end (408) */
    uint64_t idle_timeout_ms;   /* keep-alive idle, and between body reads (408) */
    uint64_t body_timeout_ms;   /* from a request's headers to its body's end (408) */
    int max_connections;        /* open connections; beyond, the longest idle one is
                                   closed, or (none idle) the new one gets 503 */
    size_t write_buffer;        /* bytes a stream may have waiting before its owner is
                                   told to pause (on_pressure) */
    size_t max_write_queue;     /* bytes a stream may have waiting at all; beyond, the
                                   reader is closed (a producer that does not pause) */
};

struct srv_http_header {
    const char *name;  /* as sent (compare case-insensitively) */
    const char *value; /* surrounding whitespace trimmed */
};

/* A parsed request, borrowed for the duration of the handler call. */
struct srv_http_req {
    const char *method; /* "GET", "POST", ... */
    const char *path;   /* URL path, percent-decoding not applied */
    const char *query;  /* after '?', or "" */
    const struct srv_http_header *headers;
    int n_headers;
    const char *body; /* NUL-terminated copy of the body */
    size_t body_len;
};

/* The request handler: must answer with srv_http_respond or
 * srv_http_stream_begin, now or later (on the loop thread). */
typedef void (*srv_http_handler)(void *ud, srv_conn *conn, const struct srv_http_req *req);

srv_http *srv_http_create(struct uv_loop_s *loop, const struct srv_http_params *p,
                          srv_metrics *metrics, srv_http_handler handler, void *ud);
/* Bind and listen. *bound_port gets the port (useful with port 0).
 * Returns 0, or a negative uv error with the reason in err. */
int srv_http_listen(srv_http *h, const char *host, int port, int *bound_port, char *err,
                    size_t errlen);
void srv_http_set_params(srv_http *h, const struct srv_http_params *p);
/* Stop accepting; every later answer closes its connection (idle ones
 * close at their idle timeout or when the server closes). */
void srv_http_drain(srv_http *h);
/* Close every handle; `done` runs once all are closed. */
void srv_http_close(srv_http *h, void (*done)(void *ud), void *ud);
void srv_http_destroy(srv_http *h); /* after done */
int srv_http_n_connections(const srv_http *h);

/* Case-insensitive header lookup; NULL when absent. */
const char *srv_http_header(const struct srv_http_req *req, const char *name);

/*
 * Answer the current request in one go. extra_headers: "" or lines each
 * ending in "\r\n". Returns 0, or -EPIPE when the connection is gone.
 */
int srv_http_respond(srv_conn *c, int status, const char *content_type, const char *extra_headers,
                     const char *body, size_t len);
/* A streamed answer: chunked (HTTP/1.1) or close-delimited (1.0). */
int srv_http_stream_begin(srv_conn *c, int status, const char *content_type,
                          const char *extra_headers);
int srv_http_stream_write(srv_conn *c, const char *data, size_t len);
int srv_http_stream_end(srv_conn *c);
/*
 * Attach the handler's state to the connection's current request: if the
 * connection closes before the answer ends, on_gone(owner) runs once (on
 * the loop thread) and the connection must not be used again. on_pressure
 * (may be NULL) is called with pause = true when more than write_buffer
 * bytes of a stream wait for the reader, and with false once half of that
 * has drained: a producer that pauses keeps the connection's memory
 * bounded.
 */
void srv_conn_set_owner(srv_conn *c, void *owner, void (*on_gone)(void *owner),
                        void (*on_pressure)(void *owner, bool pause));
/* Serve an already connected stream socket as if accepted (the fuzzer feeds
 * one end of a socketpair). Returns 0 or a negative uv error. */
int srv_http_open_fd(srv_http *h, int fd);

/* --- api.c: routes, JSON, the OpenAI and llama.cpp shapes -------------------- */

typedef struct srv_api srv_api;

struct srv_api_params {
    int max_prompt_tokens;   /* 400 above this */
    int max_tokens;          /* the largest max_tokens / n_predict accepted */
    int default_max_tokens;  /* when the request says none */
    const char *api_key;     /* NULL or "" = no auth (copied) */
    struct kv_policy policy; /* to reject prompts that can never fit (policy none) */
    int max_session_id;      /* longest session id accepted */
    const char *chat_template; /* [model] chat_template, or NULL/"" (copied) */
    bool chat_turns;           /* [eviction] unit = turn: chat turns leave whole */
};

srv_api *srv_api_create(srv_sched *sched, srv_metrics *metrics, const struct srv_api_params *p);
void srv_api_destroy(srv_api *a);
void srv_api_set_params(srv_api *a, const struct srv_api_params *p);
/* The srv_http_handler. */
void srv_api_handle(void *ud, srv_conn *conn, const struct srv_http_req *req);
/* Take the engine's events and answer the requests they belong to.
 * Returns false if a SRV_EV_FATAL arrived (message in err). */
bool srv_api_pump(srv_api *a, char *err, size_t errlen);
/* Draining: new completions get 503, /health says so. */
void srv_api_set_draining(srv_api *a, bool draining);
/* Completions accepted and not yet finished (the client may have left). */
int srv_api_in_flight(const srv_api *a);
/* Cut every in-flight completion short (drain deadline). */
void srv_api_abort_all(srv_api *a);
/* An OpenAI-shaped error body (new, caller frees): {"error":{"message",
 * "type","param","code"}}; type and code follow from the status. */
char *srv_api_error_json(int status, const char *message, const char *param, size_t *len);

/* --- daemon.c: the serve loop ------------------------------------------------- */

struct srv_serve_config {
    char host[256];
    int port;
    struct srv_http_params http;
    struct srv_api_params api;
    struct srv_sched_params sched;
    uint64_t drain_timeout_ms;
    char config_path[4096]; /* "" when none: SIGHUP then only logs */
    /* Optional: re-read the config for SIGHUP into *out (which holds the
     * current config on entry). Returns 0, or -1 having logged every error.
     * reload_commit then says whether the server switched to it (the
     * engine may still refuse what the file allows). */
    int (*reload)(const char *path, struct srv_serve_config *out, void *ud);
    void (*reload_commit)(void *ud, bool applied);
    void *reload_ud;
};

/* Run the daemon until SIGTERM/SIGINT. Returns the exit status. */
int srv_serve_run(struct srv_serve_config *cfg);

/* The operator config mapped onto the cache's terms (cmd_serve.c); shared by
 * `kvd serve` and `kvd eval` so both run exactly the configured policy. */
enum kv_type srv_cfg_kv_type(enum cfg_kv_type t);
void srv_cfg_policy(const struct cfg *c, struct kv_policy *out);

#endif /* KVD_SERVER_INTERNAL_H */
