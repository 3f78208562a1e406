/*
 * engine.h - the engine: requests in, events out, one step at a time.
 *
 * kvd has three front-ends that generate text: the daemon's compute thread
 * (server/scheduler.c), `kvd generate` and `kvd eval`. They all drive this
 * one engine, so admission, chunked prefill, reservation, decoding,
 * sampling, detokenization, stop strings, log-probabilities and sessions
 * are decided in one place and give the same tokens and the same text
 * whichever front-end asked.
 *
 * The engine is synchronous and owns no thread: a host creates it over a
 * loaded model, submits requests (engine_submit), calls engine_step in a
 * loop, and takes the events each step produced (engine_take_events). A
 * step admits waiting requests into running sequences, builds ONE batch (a
 * decode token for every sequence past its prompt, then prefill chunks of
 * the others, oldest first, within step_tokens and, while decodes wait,
 * within the step's time budget), reserves the batch's slots
 * in the cache (kv_reserve: the policies evict, idle sessions may be
 * dropped, or a sequence is refused), runs one forward pass, then samples,
 * detokenizes and scans for stop strings, posting text and finish events.
 *
 * Threading: every function but the request helpers at the end of this
 * header must be called from one thread at a time (the host's). The model
 * is borrowed and may be read by other threads meanwhile (tokenizing);
 * the cache and every sequence are the engine's. A request's `cancel` and
 * `paused` flags are the only state another thread may change while the
 * engine holds the request.
 *
 * Failure contracts follow the cache's: actions return 0 or a negative
 * errno-style code and fill a caller-owned err buffer; a request the engine
 * cannot serve (out of memory for its state, a prompt that can never fit,
 * the pool full before its first token) ends with an ENGINE_EV_ERROR event
 * carrying an HTTP-style status, and the engine lives on. Nothing here
 * prints or exits; what is worth a log line goes to the host's log hook.
 */
#ifndef KVD_ENGINE_H
#define KVD_ENGINE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "engine/cache_map.h"
#include "model/model.h"

typedef struct engine engine;

/* ------------------------------------------------------------------------
 * Requests
 * ------------------------------------------------------------------------ */

enum engine_req_kind {
    ENGINE_REQ_COMPLETION,     /* generate */
    ENGINE_REQ_SESSION_INFO,   /* describe req->session */
    ENGINE_REQ_SESSION_DELETE, /* free req->session */
    ENGINE_REQ_SESSION_MAP,    /* map req->session's cache (cache_map.h) */
    ENGINE_REQ_SESSION_LIST,   /* list one page of the sessions, in memory and on disk */
};

/* GET /v1/sessions: sessions per page when the request names no limit,
 * and at most (session_list.c). */
#define ENGINE_LIST_DEFAULT 100
#define ENGINE_LIST_MAX 1000

/* The page of sessions an ENGINE_REQ_SESSION_LIST asks for. */
struct engine_list_opts {
    int limit;   /* 1..ENGINE_LIST_MAX sessions (0: ENGINE_LIST_DEFAULT) */
    char *after; /* the ids after this one (bytewise order), or NULL: from the first
                    (owned by the request) */
};

/* Why a completion ended. */
enum engine_finish {
    ENGINE_FINISH_EOG = 0, /* the model ended it (EOS/EOT) */
    ENGINE_FINISH_STOP,    /* a stop string matched (never emitted) */
    ENGINE_FINISH_LENGTH,  /* max_tokens reached */
    ENGINE_FINISH_CONTEXT, /* the sequence's cache is full under policy none */
    ENGINE_FINISH_CANCEL,  /* the client left */
    /* Cut short by the engine or its host (never reported as a normal finish): */
    ENGINE_FINISH_ABORT,  /* the drain deadline or shutdown */
    ENGINE_FINISH_POOL,   /* the KV pool ran out of pages mid-generation */
    ENGINE_FINISH_POLICY, /* its cache filled after a reload switched it to policy none */
};
/* Whether f is one of the cut-short finishes. */
static inline bool engine_finish_cut(enum engine_finish f)
{
    return f == ENGINE_FINISH_ABORT || f == ENGINE_FINISH_POOL || f == ENGINE_FINISH_POLICY;
}

/* Which logits a request wants back as ENGINE_EV_LOGITS events (kvd eval
 * scores a text by them; the daemon never asks). */
enum engine_logits {
    ENGINE_LOGITS_NONE = 0, /* none */
    ENGINE_LOGITS_LAST,     /* after the prompt's last token (one event) */
    ENGINE_LOGITS_EACH,     /* after every prompt token: the prompt is fed one token
                               per step, as a session grown one token per request
                               would be, so eviction runs token by token */
};

/* cancel values */
#define ENGINE_CANCEL_CLIENT 1 /* the client disconnected */
#define ENGINE_CANCEL_ABORT 2  /* shutdown deadline */

/* The most keep ranges one request may pin. */
#define ENGINE_MAX_KEEP 32

/* The most choices one completion may ask for (OpenAI `n`; the host's
 * configured limit is at most this). */
#define ENGINE_MAX_CHOICES 128

/* The most alternatives a request may ask for per sampled token. */
#define ENGINE_MAX_TOP_LOGPROBS 1000
/* The most log-probability entries, tokens x (alternatives + 1), of one
 * non-streamed answer (the server refuses with 400 beyond). */
#define ENGINE_MAX_LOGPROB_ENTRIES (1 << 18)

/*
 * A request. The submitter fills it completely before engine_submit and
 * does not change it afterwards (except `cancel` and `paused`, from any
 * thread); the engine reads it until it posts the request's final event
 * (ENGINE_EV_DONE or ENGINE_EV_ERROR) and never after. The submitter frees
 * it after that final event (engine_req_free). Input is validated before
 * it reaches the engine: token ids < n_vocab, n_top_logprobs within the
 * vocabulary, stop strings non-empty.
 */
struct engine_req {
    enum engine_req_kind kind;
    uint64_t id;     /* for logs */
    int32_t *prompt; /* [n_prompt] token ids, validated < n_vocab */
    int n_prompt;
    int max_tokens;                 /* tokens to generate at most (>= 0) */
    struct model_sampling sampling; /* seed included */
    char **stop;                    /* [n_stop] non-empty stop strings */
    int n_stop;
    char *session;                 /* session id, or NULL */
    bool want_tokens;              /* report generated ids in text events */
    bool want_evictions;           /* report ENGINE_EV_EVICTED after each step in which
                                      the request's sequence lost tokens to eviction */
    bool ignore_eos;               /* never sample an end-of-generation token */
    int32_t stop_token;            /* -1, or a token that ends generation like EOS (a chat
                                      template's end-of-turn control token) */
    int n_keep;                    /* llama.cpp n_keep: pin prompt tokens [0, n_keep)
                                      (0 none, -1 the whole prompt; engine/pins.c) */
    struct kv_span *keep;          /* [n_keep_ranges] pinned prompt token ranges [start,
                                      end), each 0 <= start < end (owned; pins.c) */
    int n_keep_ranges;             /* 0..ENGINE_MAX_KEEP */
    struct kv_turn *turns;         /* a chat on a session under [eviction] unit = turn: the
                                      prompt's droppable turns as spans of prompt indices,
                                      given to the session's sequence (kv_seq_set_turns)
                                      so that whole turns leave it in place (owned; NULL:
                                      the sequence evicts tokens) */
    int n_turns;
    int turn_low_tokens;           /* kv_seq_set_turns's low-water mark */
    bool want_logprobs;            /* report every sampled token's log-probability
                                      (struct engine_logprob in its TEXT event) */
    int n_top_logprobs;            /* ... with this many most likely tokens
                                      (0..min(n_vocab, ENGINE_MAX_TOP_LOGPROBS)) */
    struct engine_map_opts map;    /* ENGINE_REQ_SESSION_MAP: ranges and text */
    struct engine_list_opts list;  /* ENGINE_REQ_SESSION_LIST: the page */
    enum engine_logits logits;     /* forced-continuation scoring (ENGINE_EV_LOGITS) */
    bool fork_answer;              /* decode the answer on a fork of the sequence (kv_seq_fork)
                                      and drop the fork at the end: the sequence, a session's,
                                      keeps exactly what the prompt left in it, whatever the
                                      answer's appends evicted (kvd eval scores a generated
                                      answer, then reads the prompt's cache) */
    int n_choices;                 /* answers to generate (OpenAI n), 0 or 1 = one; more are
                                      decoded on forks sharing the prompt's pages, choice i
                                      seeded sampling.seed + i (engine/choices.c);
                                      1..ENGINE_MAX_CHOICES */
    int fill_tokens;               /* benchmarks (kvd generate --fill): 0, or once the prompt
                                      is read its K/V rows are copied, repeating, until the
                                      sequence holds this many tokens (> n_prompt; a plain
                                      request under policy none: engine/fill.c) */
    uint64_t t_submit_ns;          /* monotonic; the host's submission time (TTFT) */
    atomic_int cancel;             /* 0, ENGINE_CANCEL_CLIENT or ENGINE_CANCEL_ABORT: set by
                                      any thread, acted on at the start of the next step */
    atomic_bool paused;            /* its reader is behind: decode nothing for it until
                                      this is cleared (the host then wakes its engine
                                      thread); the sequence keeps its slot and cache */
    void *owner;                   /* the submitter's */
    struct engine_req *next;       /* queue link (owned by whoever queues it) */
    struct engine_event *final_ev; /* the engine's: its final event, allocated with
                                      the request so that it can always end */
};

/* A request (zeroed, stop_token -1), with room for its final event; NULL
 * when out of memory. Every request submitted comes from here. */
struct engine_req *engine_req_new(enum engine_req_kind kind);
void engine_req_free(struct engine_req *r); /* frees its arrays too */
/* The final ERROR event of a request no engine will see (its host is
 * stopping), from the request's reserve: new, never NULL for a request
 * that has not ended yet. */
struct engine_event *engine_req_error(struct engine_req *r, int status, const char *message);

/* ------------------------------------------------------------------------
 * Events
 * ------------------------------------------------------------------------ */

/*
 * One sampled token's log-probabilities: log-softmax of the model's raw
 * logits for that step (before penalties, temperature and ignore_eos), in
 * double. One allocation holding the arrays (free the struct only).
 */
struct engine_logprob {
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

enum engine_event_kind {
    ENGINE_EV_TEXT,    /* generated text (and ids) of a running request */
    ENGINE_EV_LOGITS,  /* a request's logits after prompt[position] (req->logits) */
    ENGINE_EV_EVICTED, /* the request's sequence lost tokens this step (want_evictions) */
    ENGINE_EV_CHOICE,  /* one choice of several ended (not final): its finish,
                          stop_index and usage (completion_tokens its own) */
    ENGINE_EV_DONE,    /* final: finish reason, usage (or session info); with n_choices
                          > 1 the last choice's finish, completion_tokens summed over
                          every choice, the rest choice 0's */
    ENGINE_EV_ERROR,   /* final: status + message, nothing (more) generated */
    /* Posted by a host that loads the model itself (the daemon's engine
     * thread), never by the engine: */
    ENGINE_EV_READY, /* the model is loaded; req NULL */
    ENGINE_EV_FATAL, /* loading failed; message says why; req NULL */
};

struct engine_usage {
    int prompt_tokens;     /* tokens in the prompt */
    int completion_tokens; /* tokens generated */
    int cached_tokens;     /* prompt tokens found cached, not prefilled: in the session's
                              history or in the prefix cache */
    int evicted_tokens;    /* tokens of this sequence's history no longer in the cache */
    int retained_tokens;   /* tokens in the cache at the end */
    int evicted_messages;  /* with turns: messages of the request's turns the cache
                              evicted in place (whole turns), this request or before */
    int evicted_messages_now; /* ... of them, during this request */
    int turns_cut;         /* with turns: turns the policy had to cut (the answer
                              outgrew what whole turns could make room for) */
    double prompt_ms;      /* admission to first token (prefill) */
    double fill_ms;        /* of prompt_ms, the fill's (fill_tokens), 0 without */
    double gen_ms;         /* first token to the end */
};

struct engine_session_info {
    bool found;
    bool busy;                   /* a request is running on it */
    bool dropped;                /* LRU dropped its cache (history gone) */
    int history_tokens;          /* tokens in its history */
    int retained_tokens;         /* tokens in its cache */
    bool renumber;               /* positions mode */
    int64_t last_used_ms;        /* unix time in ms */
    struct kv_policy policy;     /* its eviction policy and budget (kv_seq_policy) */
    enum kv_type k_type, v_type; /* element types its K and V are stored in */
    int kv_pages;                /* pages it holds */
    uint64_t kv_bytes;           /* ... and their bytes */
    struct kv_span pins[KV_MAX_PINS]; /* its pinned spans, history indices [start, end) */
    int n_pins;
    bool saved;                  /* on disk only ([sessions] dir): read back at its next
                                    request; kv_* are then 0 */
    uint64_t disk_bytes;         /* saved: its file's bytes */
};

/* One session of GET /v1/sessions. */
struct engine_session_item {
    char *id;             /* owned by the list */
    bool saved;           /* on disk only (else in memory) */
    bool busy;            /* a request is running on it */
    int history_tokens;   /* tokens in its history */
    int retained_tokens;  /* tokens in its cache */
    int64_t last_used_ms; /* unix time in ms */
    uint64_t bytes;       /* KV bytes in memory, or its file's bytes */
};

struct engine_session_list {
    int n;
    struct engine_session_item *items; /* [n], by id (bytewise), after the cursor */
    bool has_more;                     /* more sessions follow the last item */
};
void engine_session_list_free(struct engine_session_list *l);

/* An event (owned by whoever takes it: engine_event_free). */
struct engine_event {
    enum engine_event_kind kind;
    struct engine_req *req; /* borrowed; NULL for READY and FATAL */
    int choice;             /* TEXT, EVICTED, CHOICE, DONE: which choice (0..n_choices-1) */
    char *text;             /* TEXT: new text (may be ""), NUL-terminated */
    size_t len;
    int32_t *tokens; /* TEXT with want_tokens: ids sampled */
    int n_tokens;
    struct engine_logprob *lp;          /* TEXT with want_logprobs: the token sampled
                                           (an end-of-generation one too), else NULL */
    float *logits;                      /* LOGITS: [n_vocab] the model's raw logits */
    int position;                       /* LOGITS: the prompt index they follow */
    int evicted;                        /* EVICTED: tokens evicted by this step;
                                           usage.evicted_tokens and .retained_tokens: so far */
    enum engine_finish finish;          /* DONE */
    int stop_index;                     /* DONE with ENGINE_FINISH_STOP: which stop string */
    struct engine_usage usage;          /* DONE */
    struct engine_session_info session; /* DONE for session requests */
    struct engine_cache_map *map;       /* DONE for a found session's map (owned), NULL
                                           when memory ran out */
    struct engine_session_list *list;   /* DONE for ENGINE_REQ_SESSION_LIST (owned), NULL
                                           when memory ran out */
    int status;                         /* ERROR: HTTP status */
    char message[600];                  /* ERROR, FATAL */
    struct engine_event *next;
};

/* A new event of that kind for req (zeroed otherwise); NULL when out of
 * memory. For hosts that post their own (READY, FATAL). */
struct engine_event *engine_event_new(enum engine_event_kind kind, struct engine_req *req);
void engine_event_free(struct engine_event *ev);

/* ------------------------------------------------------------------------
 * Settings and hooks
 * ------------------------------------------------------------------------ */

/* Settings a reload may change between steps. */
struct engine_limits {
    struct kv_policy policy;  /* for new sequences and every session */
    int max_running;          /* sequences in flight */
    int step_tokens;          /* tokens per forward (decode + prefill chunks) */
    uint64_t step_budget_ms;  /* while decodes wait, the most a step takes: prefill
                                 chunks are cut to ~2.5x the decodes' own timed step
                                 within it (pace.h); 0 = the token budget only */
    int queue_length;         /* waiting requests beyond the free sequence slots
                                 (the host refuses more: the daemon answers 429) */
    uint64_t session_idle_ms; /* free sessions idle this long (0 = never) */
    int max_sessions;         /* sessions kept; the least recently used idle one goes */
};

enum engine_obs {
    ENGINE_OBS_TTFT,         /* seconds from submission to a request's first token */
    ENGINE_OBS_ITL,          /* seconds between consecutive tokens of a request */
    ENGINE_OBS_BATCH_SEQS,   /* sequences in one step */
    ENGINE_OBS_BATCH_TOKENS, /* tokens in one step */
};

enum engine_log_level { ENGINE_LOG_DEBUG, ENGINE_LOG_INFO, ENGINE_LOG_WARN };

/* What the engine tells its host as it works (every member may be NULL).
 * Called on the engine's thread, from inside engine_* calls. */
struct engine_hooks {
    void (*observe)(void *ud, enum engine_obs what, double value);
    /* A running request ended: tokens prefilled, found cached, generated. */
    void (*finished)(void *ud, enum engine_finish finish, uint64_t prefilled, uint64_t cached,
                     uint64_t generated);
    void (*log)(void *ud, enum engine_log_level level, const char *line);
    void *ud;
};

struct engine_params {
    const model *m;      /* borrowed: loaded, outlives the engine */
    size_t cache_memory; /* bytes of KV pages */
    int page_tokens;
    enum kv_type k_type, v_type; /* element types of K and V */
    bool mlock;
    bool prefix_cache;      /* share the pages of equal prompt prefixes (prefix.c) */
    int prefix_cache_share; /* percent of the pool idle cached pages may keep, 0..100 */
    int n_threads;       /* compute threads of a step (0 = default, cpu/pool.h) */
    int max_step_tokens; /* forward capacity (>= limits.step_tokens; 0 = that) */
    struct engine_limits limits;
    struct engine_hooks hooks;
    const char *spill_dir;    /* [sessions] dir: sessions saved there instead of lost
                                 (borrowed; NULL or "" = none) */
    uint64_t spill_max_bytes; /* the directory's cap in bytes (0 = none) */
};

/* ------------------------------------------------------------------------
 * Lifecycle and operations (the host's thread)
 * ------------------------------------------------------------------------ */

/*
 * An engine over p->m: the KV pool (p->cache_memory bytes of pages), the
 * forward context. Refused (NULL, the reason in err) when the limits are
 * invalid, the pool cannot hold one sequence at the policy's full budget,
 * or memory runs out. A pool created smaller than asked is a warning, in
 * err with a non-NULL result.
 */
engine *engine_create(const struct engine_params *p, char *err, size_t errlen);
/* Free the engine, its cache and its sessions. Requests still inside get no
 * event: end them first (engine_shutdown). NULL is fine. */
void engine_destroy(engine *e);

/*
 * Take a request. A completion waits for admission (FIFO; a request whose
 * session is busy lets later ones pass); a session request is answered at
 * once with its final event. Returns 0 (its events will follow), or
 * -EINVAL for a request the engine cannot take (kind unknown; nothing is
 * posted).
 */
int engine_submit(engine *e, struct engine_req *r);
/*
 * One step: drop cancelled requests, admit, build and reserve one batch,
 * run the forward pass, sample and post events. now_ns is the monotonic
 * time (admission and token timestamps). Returns true if the step had
 * work (call again at once), false when every running request is paused
 * or nothing is waiting.
 */
bool engine_step(engine *e, uint64_t now_ns);
/* The token ids retained in session id's cache, oldest first (borrowed,
 * valid until the next engine call), or NULL when there is no such session;
 * *n their count. */
const int32_t *engine_session_tokens(const engine *e, const char *id, int *n);
/* Free sessions idle longer than limits.session_idle_ms (now in ms on
 * the cache's touch clock, the monotonic one). */
void engine_sweep(engine *e, uint64_t now_ms);
/* Move out the events posted so far, oldest first (the caller frees each). */
struct engine_event *engine_take_events(engine *e);
/*
 * End every request inside: waiting ones with a 503 error (reason `why`),
 * running ones with ENGINE_FINISH_ABORT after the text held back for stop
 * strings (flush_text) or without it.
 */
void engine_shutdown(engine *e, const char *why, bool flush_text);
/* Save every idle session to [sessions] dir (the daemon's stop, after
 * engine_shutdown); logged. Nothing without a directory. */
void engine_save_sessions(engine *e);

/* Check limits for an engine of page_tokens pages and max_step_tokens
 * forward capacity (0 = any): 0, or -EINVAL with the reason in err. */
int engine_check_limits(const struct engine_limits *l, int page_tokens, int max_step_tokens,
                        char *err, size_t errlen);
/* Apply new limits from the next step (every session and running sequence
 * follows the new policy from its next eviction): 0, or -EINVAL with the
 * reason in err and nothing changed. */
int engine_set_limits(engine *e, const struct engine_limits *l, char *err, size_t errlen);

/* Sessions written to and read from [sessions] dir (engine/sessions_spill.c). */
struct engine_spill_stats {
    uint64_t saved;          /* sessions written (instead of lost) */
    uint64_t save_failed;    /* ... that could not be written, and were lost */
    uint64_t restored;       /* sessions read back */
    uint64_t refused;        /* files refused when read (another model or format, corrupted,
                                truncated, no room): a cache miss */
    uint64_t bytes_saved;    /* file bytes written */
    uint64_t bytes_restored; /* file bytes read back */
};

struct engine_stats {
    int waiting;  /* submitted completions not yet admitted */
    int running;  /* admitted, not yet ended */
    int sessions; /* live sessions */
    struct kv_stats kv;
    size_t kv_page_bytes;
    bool prefix_on;                /* [cache] prefix_cache */
    struct kv_prefix_stats prefix; /* the index (zeros when off) */
    uint64_t prefix_prompt_tokens; /* prompt tokens of requests that could attach */
    uint64_t prefix_hit_tokens;    /* ... of them attached from the prefix cache */
    struct engine_spill_stats spill; /* zeros without [sessions] dir */
};
void engine_get_stats(const engine *e, struct engine_stats *st);
/* The engine's cache (for hosts that report on it; never change it). */
const kv_cache *engine_cache(const engine *e);

#endif /* KVD_ENGINE_H */
