/*
 * engine_internal.h - what the engine's files share (never included from
 * outside the room, except by white-box tests): the engine and run
 * structs, the session table (sessions.c), stop strings (stop.c),
 * log-probabilities (logprobs.c), and the calls between engine.c (lifecycle,
 * submission, events), run.c (one request's life) and step.c (one step).
 * Everything here runs on the engine's one thread.
 */
#ifndef KVD_ENGINE_INTERNAL_H
#define KVD_ENGINE_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "engine/pace.h"

/* ------------------------------------------------------------------------
 * Sessions (sessions.c)
 *
 * A session is a named sequence kept between requests. Which idle session
 * goes first, at max_sessions or under pool pressure, is the cache's one
 * LRU order (kv_seq_lru_before); when, is the engine's: max_sessions at
 * creation and the idle timeout in the sweep.
 * ------------------------------------------------------------------------ */

struct run;

struct engine_session {
    char *id;
    kv_seq *seq;
    struct run *busy; /* the run using it, or NULL */
    int64_t last_used_unix_ms;
    struct engine_session *next; /* hash chain */
};

/* An open hash table, grown by doubling (caller-provided storage). */
struct engine_sessions {
    struct engine_session **buckets;
    int n_buckets;
    int n;                            /* sessions */
    const struct engine_hooks *hooks; /* for the log lines of drops */
    struct spill_store *spill;        /* [sessions] dir (sessions_spill.c), or NULL */
    struct engine_spill_stats spill_stats; /* what it wrote and read */
};

/* 0, or -ENOMEM (nothing to free). */
int engine_sessions_init(struct engine_sessions *t, const struct engine_hooks *hooks);
/* Remove every session (their sequences are destroyed). */
void engine_sessions_deinit(struct engine_sessions *t);

struct engine_session *engine_sessions_find(const struct engine_sessions *t, const char *id);
/*
 * A new session with an empty sequence under `policy`. At max_sessions the
 * least recently used idle session is dropped first (logged). Returns NULL
 * with the reason in err when every session is busy, the cache cannot
 * create the sequence or memory runs out (nothing changed but the drops).
 */
struct engine_session *engine_sessions_create(struct engine_sessions *t, kv_cache *cache,
                                              const struct kv_policy *policy, int max_sessions,
                                              const char *id, char *err, size_t errlen);
/* Unlink x and destroy its sequence. */
void engine_sessions_remove(struct engine_sessions *t, struct engine_session *x);
/* Free sessions idle (untouched) for idle_ms or longer, never busy ones;
 * idle_ms 0 = never. */
void engine_sessions_sweep(struct engine_sessions *t, uint64_t now_ms, uint64_t idle_ms);
/* Every session follows `policy` from its next eviction (a reload). */
void engine_sessions_set_policy(struct engine_sessions *t, const struct kv_policy *policy);
/* Idle sessions (no request running on them): what the pool can take back. */
int engine_sessions_idle_pages(const struct engine_sessions *t);
/* What GET /v1/sessions/{id} reports. */
void engine_session_describe(const struct engine_session *x, struct engine_session_info *out);

/* ------------------------------------------------------------------------
 * Sessions on disk (sessions_spill.c, over spill.h's store)
 *
 * With [sessions] dir, a session is saved instead of lost wherever the
 * engine or the pool would end it idle (the pool's LRU through the cache's
 * drop hook, max_sessions, the idle timeout, the daemon's stop), and read
 * back when a request names it and it is not in memory. Without one, every
 * function here does nothing.
 * ------------------------------------------------------------------------ */

/* Set up t->spill over dir for this engine's model and cache (and the
 * cache's drop hook): 0, or -1 with the reason in err. */
int engine_spill_init(engine *e, const char *dir, uint64_t max_bytes, char *err, size_t errlen);
/* Save x (idle, with a history) before it leaves memory, `why` for the
 * log line; a failure is logged and the session is lost as before. */
void engine_session_save(struct engine_sessions *t, struct engine_session *x, const char *why);
/* The session a request names: in memory, else read back from disk into
 * a new one, else new (max_sessions may end another first). NULL with the
 * reason in err as engine_sessions_create. */
struct engine_session *engine_session_open(engine *e, const char *id, char *err, size_t errlen);
/* Fill *out for session id found only on disk: true if there is one. */
bool engine_session_describe_saved(engine *e, const char *id, struct engine_session_info *out);
/* DELETE's part: remove id's file; true if there was one. */
bool engine_session_forget_saved(engine *e, const char *id);
/* GET /v1/sessions: one page of the sessions, in memory and on disk, in id
 * order (session_list.c; new; NULL when out of memory). */
struct engine_session_list *engine_session_list_build(engine *e,
                                                      const struct engine_list_opts *opts);

/* ------------------------------------------------------------------------
 * Stop strings (stop.c)
 * ------------------------------------------------------------------------ */

/*
 * Given the text held back so far, find the earliest stop string occurring
 * in it: returns its index and sets *at to its offset. Otherwise returns -1
 * and sets *safe to the number of leading bytes that no stop string can
 * still start in (the rest is a proper prefix of some stop string and must
 * be held).
 */
int engine_stop_scan(const char *text, size_t len, char *const *stop, int n_stop, size_t *at,
                     size_t *safe);

/* ------------------------------------------------------------------------
 * Log-probabilities (logprobs.c)
 * ------------------------------------------------------------------------ */

/* One request's state (zeroed = none asked for). */
struct engine_lp {
    float *raw;     /* [n_vocab] the step's logits as the model gave them */
    int32_t *top;   /* [n_top + 1] the most likely ids, most likely first */
    int n_top;      /* alternatives asked for, at most n_vocab */
    double raw_lse; /* log(sum(exp(raw))) */
};

/* Room for n_top alternatives over n_vocab logits: 0, or -ENOMEM (free with
 * engine_lp_free either way). */
int engine_lp_init(struct engine_lp *lp, int n_top, int n_vocab);
void engine_lp_free(struct engine_lp *lp);
/* Take the step's logits (copied, before ignore_eos and the sampler change
 * them): their log-sum-exp in double and the top n_top, O(n_vocab log n_top). */
void engine_lp_prepare(struct engine_lp *lp, const float *logits, int n_vocab);
/* The TEXT event's record of the sampled token tok, whose text was
 * piece[0..n) (new; one allocation, free the struct only); NULL when out
 * of memory. */
struct engine_logprob *engine_lp_make(const struct engine_lp *lp, int32_t tok, const char *piece,
                                      size_t n);

/* ------------------------------------------------------------------------
 * The engine and its runs
 * ------------------------------------------------------------------------ */

enum run_phase { RUN_PREFILL, RUN_DECODE };

/* One admitted request: a sequence being prefilled or decoded. */
struct run {
    struct engine_req *req;
    kv_seq *seq;
    struct engine_session *sess; /* NULL without a session */
    enum run_phase phase;
    int n_fed;        /* prompt tokens in the cache (cached + prefilled) */
    int n_cached;     /* prompt tokens matched in the session's history */
    int32_t next_tok; /* DECODE: the token to feed this step */
    int n_gen;        /* tokens sampled */
    int appended;     /* tokens appended to seq by this run (non-sessions) */
    int evicted;      /* tokens of its history evicted so far (want_evictions) */
    int32_t *hist;    /* [n_prompt + max_tokens] prompt then generated ids */
    int n_hist;
    float *logits;       /* [n_vocab] */
    struct engine_lp lp; /* with logprobs: the step's raw logits and top tokens */
    model_sampler *smp;
    model_detok *detok;
    char *hold; /* text not yet emitted (could start a stop string) */
    size_t hold_len, hold_cap;
    uint64_t t_admit_ns, t_first_ns, t_last_ns;
    uint64_t fill_ns;       /* the fill's time (req->fill_tokens; fill.c) */
    int batch_slot;         /* index in this step's batch, or -1 */
    bool admitted_evicting; /* admitted under a policy that evicts (a full cache
                               later means a reload switched it to none) */
    int turn_msgs0; /* with turns: messages already evicted in place at admission */
    int n_prefix;   /* of n_cached, tokens attached from the prefix cache (prefix.c) */
    int prefix_full; /* full pages of seq when it last published */
    bool prefix_counted; /* may attach: counted in the engine's prefix figures */
    int choice;              /* which of the request's choices this run decodes (0: the
                                first, the one that read the prompt) */
    struct run_group *group; /* n_choices > 1, once the prompt is read: its siblings
                                (choices.c); NULL before and for one choice */
    kv_seq *prompt_seq; /* fork_answer: the prompt's sequence, kept as the prompt left it
                           while the answer decodes on seq, its fork (NULL before) */
    struct run *next;
};

struct engine {
    struct engine_params p; /* p.limits is the configured limits at creation */
    struct engine_limits lim;
    const model *m;
    model_ctx *ctx;
    kv_cache *cache;
    int n_vocab;
    int32_t *eog; /* end-of-generation ids (for ignore_eos) */
    int n_eog;
    struct engine_req *wait_head, *wait_tail; /* submitted completions, FIFO */
    int n_waiting;
    struct run *runs; /* admission order */
    int n_running;
    struct engine_sessions sessions;
    struct model_batch_seq *batch; /* [batch_cap] */
    struct kv_reservation *res;    /* [batch_cap] the batch's slots */
    struct run **batch_runs;       /* [batch_cap] */
    int batch_cap;
    struct engine_event *ev_head, *ev_tail; /* posted, not yet taken */
    struct engine_pace pace; /* what a step costs, measured (pace.c) */
    kv_prefix *prefix; /* the prefix cache, or NULL when off (prefix.c) */
    uint64_t prefix_prompt_tokens, prefix_hit_tokens; /* runs that may attach: prompt
                                                          tokens, and those attached */
};

/* engine.c: events. post takes ev (NULL is ignored). */
void engine_post(engine *e, struct engine_event *ev);
/* The request's final event, taken from its reserve (engine_req_new):
 * never NULL for a request that has not ended yet. */
struct engine_event *engine_final_event(struct engine_req *req, enum engine_event_kind kind);
/* Post the request's final error event. */
void engine_post_error(engine *e, struct engine_req *req, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void engine_post_verror(engine *e, struct engine_req *req, int status, const char *fmt, va_list ap);
/* A log line through the host's hook (nothing without one). */
void engine_log(const struct engine_hooks *h, enum engine_log_level level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
uint64_t engine_now_ns(void);

/* run.c: one request's life. */
struct run *engine_run_admit(engine *e, struct engine_req *req, uint64_t t);

/* pins.c: the length of the prefix req's prompt shares with seq's history. */
int engine_history_match(const kv_seq *seq, const struct engine_req *req);
/* pins.c: req's pins (n_keep, keep ranges) with the pins of its session's
 * sequence sess (may be NULL) over the history its prompt repeats,
 * normalized into out[KV_MAX_PINS] and checked against the configured
 * budget. Returns the count, or -1 with the reason (a 400) in err. */
int engine_pins_plan(const engine *e, const struct engine_req *req, const kv_seq *sess,
                     struct kv_span *out, char *err, size_t errlen);
/* The prompt is read: with fork_answer, the answer goes on in a fork of
 * the sequence from here. False when the fork failed: the run was failed
 * (503) and freed. */
bool engine_run_fork_answer(engine *e, struct run *r);
/* Sample the next token from r->logits (its log-probabilities first) and
 * take it: true if the run ended (and was freed). */
bool engine_run_sample(engine *e, struct run *r, uint64_t t);
/* Remove r from the running list and free it (its sequence goes back to
 * the pool unless a session holds it); engine_run_state_free frees only
 * what the run allocated, for a run never put on the list. */
void engine_run_free(engine *e, struct run *r);
void engine_run_state_free(struct run *r);
/* A token was sampled: true if the run ended (and was freed). */
bool engine_run_take_token(engine *e, struct run *r, int32_t tok, uint64_t t);
/* Give the run's pages back and put its request at the head of the queue
 * (it has sent nothing yet: it is admitted again when pages allow). */
void engine_run_requeue(engine *e, struct run *r);
/* r's usage so far (its own tokens; t_end the time it ends). */
void engine_run_usage(const struct run *r, struct engine_usage *u, uint64_t t_end);
/* Post the final DONE event and free the run. */
void engine_run_finish(engine *e, struct run *r, enum engine_finish finish, int stop_index);
/* Post a final error and free the run. */
void engine_run_fail(engine *e, struct run *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* fill.c: the prompt of r is read; copy its K/V rows until the sequence
 * holds req->fill_tokens tokens. False when refused or out of room: r was
 * failed (400 or 503, saying why) and freed. */
bool engine_run_fill(engine *e, struct run *r);
/* Send whatever text is held back (no stop string can end it any more);
 * false when that failed (out of memory) and the run was failed with 503. */
bool engine_run_flush(engine *e, struct run *r);

/* prefix.c: the prefix cache. init creates the index when the params say
 * so (0, or -1 with the reason in err); deinit lets go of it. */
int engine_prefix_init(engine *e, char *err, size_t errlen);
void engine_prefix_deinit(engine *e);
/* A run was admitted: count it and attach what is cached. */
void engine_prefix_admitted(engine *e, struct run *r);
/* Before r reads a prompt chunk: attach what was published since. */
void engine_prefix_attach(engine *e, struct run *r);
/* After the forward pass: the batch's n sequences publish their full pages. */
void engine_prefix_publish(engine *e, int n);
/* After a step: idle pages down to the share cap. */
void engine_prefix_trim(engine *e);
/* Admission: pages of q's prompt the index will share (when q's sequence
 * holds `own` = 0 pages) and idle pages the pool can take back besides. */
void engine_prefix_fit(engine *e, const struct engine_req *q, int own, int *shared, int *idle);
void engine_prefix_stats(const engine *e, struct engine_stats *st);

/* choices.c: n choices of one prompt (n_choices > 1). */
/* Pages admission charges for q's answers besides its prompt: n_choices x
 * an answer's pages when it asks for more than one, else 0. */
int engine_choices_pages(const engine *e, const struct engine_req *q);
/* Sequence slots q takes once its prompt is read (n_choices, at least 1). */
int engine_choices_n(const struct engine_req *q);
/* r read its prompt: fork the other choices (each samples its first token
 * from r's logits here; r samples its own after). False when that failed:
 * r was failed (503) and freed. */
bool engine_choices_fork(engine *e, struct run *r, uint64_t t);
/* r (one of a group) ends with finish: true if this was handled here
 * (another choice is still running: a CHOICE event; or a sibling failed:
 * its error) and r freed; false for the last choice, whose DONE the caller
 * posts with engine_choices_usage applied. */
bool engine_choices_end(engine *e, struct run *r, enum engine_finish finish, int stop_index);
/* The last choice's DONE: usage summed over the group, and the counts for
 * the finished hook (prefilled, cached: the prompt's, once). */
void engine_choices_usage(const struct run *r, struct engine_usage *u, uint64_t *prefilled,
                          uint64_t *cached, uint64_t *generated);
/* r (one of a group) failed: the first failure's error is the request's,
 * posted when the last sibling is gone; r is freed. */
void engine_choices_fail(engine *e, struct run *r, int status, const char *message);
/* Whether a sibling of r failed (r is to end at the next step). */
bool engine_choices_failed(const struct run *r);
/* engine_run_free's part: r leaves its group (freed with its last run). */
void engine_choices_leave(struct run *r);

/* step.c: one step. */
bool engine_do_step(engine *e, uint64_t t);

#endif /* KVD_ENGINE_INTERNAL_H */
