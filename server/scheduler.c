/*
 * scheduler.c - the engine thread: admission, continuous batching,
 * sessions, cancellation.
 *
 * One thread owns the model, the KV cache and every sequence. Requests
 * arrive from the loop thread through an inbox (mutex + condition
 * variable); results leave through an outbox (mutex), and the loop is woken
 * only when the outbox goes from empty to non-empty (uv_async_send
 * coalesces anyway). The two mutexes are never held together.
 *
 * Every step reserves the batch's slots in the cache (kv_reserve: the
 * policies evict, idle sessions may be dropped, or a sequence is refused)
 * and then runs ONE model_forward over a batch that holds one decode
 * token for each running sequence that has finished its prompt, plus
 * prefill chunks of sequences still reading their prompt, oldest first, up
 * to step_tokens tokens in all. A long prompt is thus read a chunk per step
 * while the streams already running keep producing a token per step
 * (chunked prefill). Admission is FIFO into at most max_running sequences;
 * the rest wait in a bounded queue (the loop thread answers 429 beyond it).
 *
 * Sessions. A request naming a session continues that session's sequence:
 * its prompt is compared with the session's token history, the matching
 * prefix is kept (cached_tokens), the rest of the history is truncated and
 * only the unmatched suffix is prefilled. At least the prompt's last token
 * is always fed so the step has logits to sample from. The cache's
 * eviction policy keeps the sequence within its budget however long the
 * session runs. Without a session, a request's sequence is freed at its
 * end. A session used by a running request is pinned (LRU never drops it)
 * and a second request on it waits until the first ends.
 *
 * Text. Sampled ids go through the model's streaming detokenizer, which
 * yields only whole UTF-8 characters, then through the stop-string
 * matcher, which holds back any tail that could still become a stop string
 * and cuts the text before a stop string when one completes. So stop
 * strings are found across token boundaries and never emitted.
 *
 * Log-probabilities. A request that asks for them gets, in the text event
 * of each sampled token, the token's log-probability and its n most likely
 * alternatives': log-softmax of the logits the step computed, taken before
 * ignore_eos and the sampler change them (see logprobs.c). A token sampled
 * last (max_tokens) is never fed, so with n_predict 1 a session's cache
 * holds exactly its prompt, as kvd eval's sequence does.
 *
 * Determinism. Each request has its own sampler seeded from the request;
 * what a sequence computes does not depend on what else is in the batch,
 * so the same request with the same seed gives the same text alone or
 * batched.
 *
 * Cancellation. The loop thread sets req->cancel; the engine looks at it at
 * the start of every step and drops the sequence (its pages return to the
 * pool), posting the request's final event.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/log.h"
#include "server/logprobs.h"
#include "server/scheduler.h"
#include "server/sessions.h"
#include "server/stop.h"

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

enum run_phase { RUN_PREFILL, RUN_DECODE };

/* One admitted request: a sequence being prefilled or decoded. */
struct run {
    struct srv_req *req;
    kv_seq *seq;
    struct srv_session *sess; /* NULL without a session */
    enum run_phase phase;
    int n_fed;        /* prompt tokens in the cache (cached + prefilled) */
    int n_cached;     /* prompt tokens matched in the session's history */
    int32_t next_tok; /* DECODE: the token to feed this step */
    int n_gen;        /* tokens sampled */
    int appended;     /* tokens appended to seq by this run (non-sessions) */
    int32_t *hist;    /* [n_prompt + max_tokens] prompt then generated ids */
    int n_hist;
    float *logits; /* [n_vocab] */
    struct srv_lp lp; /* with logprobs: the step's raw logits and top tokens */
    model_sampler *smp;
    model_detok *detok;
    char *hold; /* text not yet emitted (could start a stop string) */
    size_t hold_len, hold_cap;
    uint64_t t_admit_ns, t_first_ns, t_last_ns;
    int batch_slot; /* index in this step's batch, or -1 */
    bool admitted_evicting; /* admitted under a policy that evicts (a full cache
                               later means a reload switched it to none) */
    struct run *next;
};

struct srv_sched {
    struct srv_sched_params p;
    pthread_t thread;
    bool thread_started;

    /* Inbox: guarded by in_mu. */
    pthread_mutex_t in_mu;
    pthread_cond_t in_cv;
    struct srv_req *in_head, *in_tail;
    int n_waiting; /* submitted, not yet admitted or dropped */
    bool stop;
    bool woken; /* srv_sched_wake since the last pull */
    bool limits_dirty;
    struct srv_sched_limits next_limits;
    int queue_length;    /* read by submit */
    int max_running_pub; /* read by submit */
    int running_pub;     /* admitted and not yet ended */

    /* Outbox: guarded by out_mu. */
    pthread_mutex_t out_mu;
    struct srv_event *out_head, *out_tail;
    void (*notify)(void *ud);

    /* Published once by the engine thread before SRV_EV_READY. */
    _Atomic(const model *) ready_model;

    /* Engine thread only. */
    model *m;
    model_ctx *ctx;
    kv_cache *cache;
    int n_vocab;
    int32_t *eog; /* end-of-generation ids (for ignore_eos) */
    int n_eog;
    struct srv_sched_limits lim;
    struct srv_req *wait_head, *wait_tail; /* admitted FIFO */
    struct run *runs;                      /* admission order */
    int n_running;
    struct srv_sessions sessions; /* the session table (sessions.c) */
    struct model_batch_seq *batch; /* [max_running cap] */
    struct kv_reservation *res;    /* [max_running cap] the batch's slots */
    struct run **batch_runs;
    int batch_cap;
    uint64_t last_sweep_ms;
    srv_metrics *metrics;
};

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

static void *xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "kvd: out of memory (%zu bytes)\n", n * size);
        abort();
    }
    return p;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct srv_req *srv_req_new(enum srv_req_kind kind)
{
    struct srv_req *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->kind = kind;
    r->stop_token = -1;
    atomic_init(&r->cancel, 0);
    return r;
}

void srv_req_free(struct srv_req *r)
{
    if (!r)
        return;
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->session);
    free(r);
}

void srv_event_free(struct srv_event *ev)
{
    if (!ev)
        return;
    free(ev->text);
    free(ev->tokens);
    free(ev->lp);
    srv_cache_map_free(ev->map);
    free(ev);
}

/* ------------------------------------------------------------------------
 * Events
 * ------------------------------------------------------------------------ */

/* Lock rule: takes out_mu only. */
static void post(srv_sched *s, struct srv_event *ev)
{
    ev->next = NULL;
    pthread_mutex_lock(&s->out_mu);
    bool was_empty = s->out_head == NULL;
    if (s->out_tail)
        s->out_tail->next = ev;
    else
        s->out_head = ev;
    s->out_tail = ev;
    /* notify (uv_async_send) takes no lock; it is read under out_mu so
     * srv_sched_destroy can detach it before the loop's handle closes. */
    if (was_empty && s->notify)
        s->notify(s->p.notify_ud);
    pthread_mutex_unlock(&s->out_mu);
}

static struct srv_event *event_new(enum srv_event_kind kind, struct srv_req *req)
{
    struct srv_event *ev = xcalloc(1, sizeof(*ev));
    ev->kind = kind;
    ev->req = req;
    return ev;
}

__attribute__((format(printf, 4, 5))) static void post_error(srv_sched *s, struct srv_req *req,
                                                             int status, const char *fmt, ...)
{
    struct srv_event *ev = event_new(SRV_EV_ERROR, req);
    ev->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev->message, sizeof(ev->message), fmt, ap);
    va_end(ap);
    post(s, ev);
}

struct srv_event *srv_sched_take_events(srv_sched *s)
{
    pthread_mutex_lock(&s->out_mu);
    struct srv_event *head = s->out_head;
    s->out_head = s->out_tail = NULL;
    pthread_mutex_unlock(&s->out_mu);
    return head;
}

/* ------------------------------------------------------------------------
 * Session requests (the table is sessions.c)
 * ------------------------------------------------------------------------ */

static void handle_session_request(srv_sched *s, struct srv_req *r)
{
    struct srv_event *ev = event_new(SRV_EV_DONE, r);
    struct srv_session *x = srv_sessions_find(&s->sessions, r->session);
    if (x)
        srv_session_describe(x, &ev->session);
    if (x && r->kind == SRV_REQ_SESSION_MAP)
        ev->map = srv_cache_map_build(x->seq, s->m, &r->map);
    if (x && r->kind == SRV_REQ_SESSION_DELETE) {
        if (x->busy) {
            free(ev);
            post_error(s, r, 409, "session '%s' has a request running; retry when it ends",
                       r->session);
            return;
        }
        srv_sessions_remove(&s->sessions, x);
    }
    post(s, ev);
}

/* ------------------------------------------------------------------------
 * Runs
 * ------------------------------------------------------------------------ */

/* Lock rule: takes in_mu, releases it, then the metrics lock (never both). */
static void publish_gauges(srv_sched *s)
{
    if (!s->metrics)
        return;
    struct srv_engine_gauges g = {0};
    pthread_mutex_lock(&s->in_mu);
    g.queue_depth = s->n_waiting;
    pthread_mutex_unlock(&s->in_mu);
    g.running = s->n_running;
    g.sessions = s->sessions.n;
    if (s->cache) {
        struct kv_stats st;
        kv_cache_stats(s->cache, &st);
        g.kv_pages_total = st.pages_total;
        g.kv_pages_used = st.pages_used;
        g.kv_pages_free = st.pages_free;
        g.evictions = st.evictions;
        g.tokens_evicted = st.tokens_evicted;
        g.sessions_dropped = st.sessions_dropped;
        g.kv_k_type = s->p.k_type;
        g.kv_v_type = s->p.v_type;
        g.kv_page_bytes = kv_cache_page_bytes(s->cache);
    }
    srv_metrics_engine(s->metrics, &g);
}

static void run_usage(const struct run *r, struct srv_usage *u, uint64_t t_end)
{
    u->prompt_tokens = r->req->n_prompt;
    u->completion_tokens = r->n_gen;
    u->cached_tokens = r->n_cached;
    u->retained_tokens = r->seq ? kv_seq_n_tokens(r->seq) : 0;
    int seen = r->sess ? kv_seq_history(r->seq, NULL) : r->appended;
    u->evicted_tokens = seen > u->retained_tokens ? seen - u->retained_tokens : 0;
    uint64_t t_first = r->t_first_ns ? r->t_first_ns : t_end;
    u->prompt_ms = (double)(t_first - r->t_admit_ns) / 1e6;
    u->gen_ms = (double)(t_end - t_first) / 1e6;
}

/* Remove r from the running list and free it: its sequence goes back to
 * the pool unless it belongs to a session. Lock rule: takes in_mu only
 * (for the count submit reads). */
static void run_free(srv_sched *s, struct run *r)
{
    struct run **pp = &s->runs;
    while (*pp && *pp != r)
        pp = &(*pp)->next;
    if (*pp)
        *pp = r->next;
    s->n_running--;
    pthread_mutex_lock(&s->in_mu);
    s->running_pub--;
    pthread_mutex_unlock(&s->in_mu);
    if (r->sess) {
        uint64_t now = now_ns() / 1000000u;
        r->sess->busy = NULL;
        r->sess->last_used_unix_ms = unix_ms();
        kv_seq_touch(r->seq, now); /* the one LRU: the cache's */
        kv_seq_pin(r->seq, false);
    } else {
        kv_seq_destroy(r->seq);
    }
    model_sampler_destroy(r->smp);
    model_detok_destroy(r->detok);
    free(r->hist);
    free(r->logits);
    srv_lp_free(&r->lp);
    free(r->hold);
    free(r);
}

/* Emit the text held back (whatever no stop string can claim any more),
 * with the sampled ids and the sampled token's log-probabilities (lp, new
 * or NULL; the event takes it). */
static void emit_text(srv_sched *s, struct run *r, size_t n, const int32_t *toks, int n_toks,
                      struct srv_logprob *lp)
{
    if (n == 0 && n_toks == 0 && !lp)
        return;
    struct srv_event *ev = event_new(SRV_EV_TEXT, r->req);
    ev->lp = lp;
    ev->text = malloc(n + 1);
    if (!ev->text)
        abort();
    if (n > 0) /* with logprobs, an event may carry no text (and hold be NULL) */
        memcpy(ev->text, r->hold, n);
    ev->text[n] = '\0';
    ev->len = n;
    if (n_toks > 0) {
        ev->tokens = malloc(sizeof(int32_t) * (size_t)n_toks);
        if (!ev->tokens)
            abort();
        memcpy(ev->tokens, toks, sizeof(int32_t) * (size_t)n_toks);
        ev->n_tokens = n_toks;
    }
    if (n > 0) {
        memmove(r->hold, r->hold + n, r->hold_len - n);
        r->hold_len -= n;
    }
    post(s, ev);
}

/* Post the final event and free the run. */
static void run_finish(srv_sched *s, struct run *r, enum srv_finish finish, int stop_index)
{
    uint64_t t = now_ns();
    struct srv_event *ev = event_new(SRV_EV_DONE, r->req);
    ev->finish = finish;
    ev->stop_index = stop_index;
    run_usage(r, &ev->usage, t);
    if (s->metrics) {
        srv_metrics_tokens(s->metrics, (uint64_t)(r->n_fed - r->n_cached), (uint64_t)r->n_cached,
                           (uint64_t)r->n_gen);
        if (finish == SRV_FINISH_CANCEL)
            srv_metrics_cancelled(s->metrics);
    }
    srv_log(SRV_LOG_DEBUG,
            "request %" PRIu64 " done: %d prompt (%d cached), %d generated, finish %d", r->req->id,
            r->req->n_prompt, r->n_cached, r->n_gen, (int)finish);
    post(s, ev);
    run_free(s, r);
}

/* Fail a run with an HTTP status (nothing more is sent for it). */
__attribute__((format(printf, 4, 5))) static void run_fail(srv_sched *s, struct run *r, int status,
                                                           const char *fmt, ...)
{
    struct srv_event *ev = event_new(SRV_EV_ERROR, r->req);
    ev->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ev->message, sizeof(ev->message), fmt, ap);
    va_end(ap);
    post(s, ev);
    run_free(s, r);
}

/* Ensure hold has room for n more bytes. */
static void hold_reserve(struct run *r, size_t n)
{
    if (r->hold_len + n + 1 <= r->hold_cap)
        return;
    size_t cap = r->hold_cap ? r->hold_cap * 2 : 256;
    while (cap < r->hold_len + n + 1)
        cap *= 2;
    char *p = realloc(r->hold, cap);
    if (!p)
        abort();
    r->hold = p;
    r->hold_cap = cap;
}

/*
 * The policy of a request: the configured one, with llama.cpp's n_keep as
 * the sinks when given (the window shrinks to leave eviction a page).
 * Returns 0, or -EINVAL with the reason in err.
 */
static int request_policy(const srv_sched *s, const struct srv_req *req, struct kv_policy *pol,
                          char *err, size_t errlen)
{
    *pol = s->lim.policy;
    if (req->n_keep == 0 || pol->kind == KV_EVICT_NONE)
        return 0;
    int page = s->p.page_tokens;
    pol->sink_tokens = req->n_keep < 0 ? req->n_prompt : req->n_keep;
    struct kv_budget b;
    kv_policy_budget(pol, page, &b);
    if (pol->window_tokens > b.window_room)
        pol->window_tokens = (int)(b.window_room > 0 ? b.window_room : 0);
    if (pol->window_tokens < 1 || kv_policy_check(pol, page, err, errlen) != 0) {
        snprintf(err, errlen,
                 "n_keep = %d leaves no room to evict within max_cache_tokens = %d (pages of %d "
                 "tokens)",
                 pol->sink_tokens, pol->max_cache_tokens, page);
        return -EINVAL;
    }
    return 0;
}

/*
 * Admit the request at the head of the line into a new run. Returns the
 * run, or NULL after posting the request's error (it is then done).
 * Lock rule: takes in_mu, then (separately) out_mu to post.
 */
static struct run *run_admit(srv_sched *s, struct srv_req *req, uint64_t t)
{
    char err[256] = "";
    struct run *r = calloc(1, sizeof(*r));
    if (!r)
        goto out_nomem;
    r->req = req;
    r->t_admit_ns = t;
    r->batch_slot = -1;
    r->hist = malloc(sizeof(int32_t) * ((size_t)req->n_prompt + (size_t)req->max_tokens + 1));
    r->logits = malloc(sizeof(float) * (size_t)s->n_vocab);
    r->smp = model_sampler_create(&req->sampling, s->n_vocab);
    r->detok = model_detok_create(s->m);
    if (!r->hist || !r->logits || !r->smp || !r->detok ||
        (req->want_logprobs && srv_lp_init(&r->lp, req->n_top_logprobs, s->n_vocab) != 0))
        goto out_free;
    memcpy(r->hist, req->prompt, sizeof(int32_t) * (size_t)req->n_prompt);
    r->n_hist = req->n_prompt;
    struct kv_policy pol;
    if (request_policy(s, req, &pol, err, sizeof(err)) != 0) {
        model_sampler_destroy(r->smp);
        model_detok_destroy(r->detok);
        free(r->hist);
        free(r->logits);
        srv_lp_free(&r->lp);
        free(r);
        post_error(s, req, 400, "%s", err);
        return NULL;
    }

    if (req->session && s->lim.max_sessions > 0) {
        struct srv_session *x = srv_sessions_find(&s->sessions, req->session);
        if (!x)
            x = srv_sessions_create(&s->sessions, s->cache, &s->lim.policy, s->lim.max_sessions,
                                    req->session, err, sizeof(err));
        if (!x)
            goto out_free;
        /* Match the prompt against the history; keep the common prefix,
         * but always leave the last prompt token to feed. */
        const int32_t *h;
        int n_h = kv_seq_history(x->seq, &h);
        int n = 0;
        while (n < n_h && n < req->n_prompt && h[n] == req->prompt[n])
            n++;
        if (n == req->n_prompt)
            n--;
        if (n < n_h && kv_seq_truncate(x->seq, n) != 0) {
            /* Cannot cut there: start the session over. */
            kv_seq_truncate(x->seq, 0);
            n = 0;
        }
        kv_seq_set_policy(x->seq, &pol); /* n_keep, or back to the configured policy */
        r->sess = x;
        r->seq = x->seq;
        r->n_cached = n;
        r->n_fed = n;
        x->busy = r;
        kv_seq_pin(x->seq, true);
    } else {
        r->seq = kv_seq_create(s->cache, &pol, false, err, sizeof(err));
        if (!r->seq)
            goto out_free;
    }
    r->admitted_evicting = pol.kind != KV_EVICT_NONE;
    r->phase = RUN_PREFILL;
    r->next = NULL;
    struct run **pp = &s->runs;
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    s->n_running++;
    pthread_mutex_lock(&s->in_mu);
    s->running_pub++;
    pthread_mutex_unlock(&s->in_mu);
    return r;

out_free:
    if (r) {
        model_sampler_destroy(r->smp);
        model_detok_destroy(r->detok);
        free(r->hist);
        free(r->logits);
        srv_lp_free(&r->lp);
        free(r);
    }
out_nomem:
    post_error(s, req, 503, "cannot start the request: %s",
               err[0] ? err : "out of memory for per-request state");
    return NULL;
}

/*
 * A token was sampled for r: record it, turn it into text, look for stop
 * strings, and decide whether r goes on. Returns true if r was finished
 * (and freed).
 */
static bool run_take_token(srv_sched *s, struct run *r, int32_t tok, uint64_t t)
{
    if (s->metrics) {
        if (r->n_gen == 0)
            srv_metrics_observe(s->metrics, SRV_HIST_TTFT, (double)(t - r->req->t_submit_ns) / 1e9);
        else
            srv_metrics_observe(s->metrics, SRV_HIST_ITL, (double)(t - r->t_last_ns) / 1e9);
    }
    if (r->n_gen == 0)
        r->t_first_ns = t;
    r->t_last_ns = t;

    if (model_is_eog(s->m, tok) || tok == r->req->stop_token) {
        /* End of generation: flush what is held (it cannot complete a stop
         * string any more) and finish. */
        char tail[64];
        int n = model_detok_flush(r->detok, tail, sizeof(tail));
        if (n > 0) {
            hold_reserve(r, (size_t)n);
            memcpy(r->hold + r->hold_len, tail, (size_t)n);
            r->hold_len += (size_t)n;
        }
        struct srv_logprob *lp =
            r->req->want_logprobs ? srv_lp_make(&r->lp, tok, tail, n > 0 ? (size_t)n : 0) : NULL;
        size_t at = 0, safe = 0;
        int k = srv_stop_scan(r->hold, r->hold_len, r->req->stop, r->req->n_stop, &at, &safe);
        if (k >= 0) {
            emit_text(s, r, at, NULL, 0, lp);
            run_finish(s, r, SRV_FINISH_STOP, k);
        } else {
            emit_text(s, r, r->hold_len, NULL, 0, lp);
            run_finish(s, r, SRV_FINISH_EOG, -1);
        }
        return true;
    }

    r->n_gen++;
    r->hist[r->n_hist++] = tok;
    size_t hold_before = r->hold_len; /* the token's text starts here */
    char piece[1024];
    int n = model_detok_push(r->detok, tok, piece, sizeof(piece));
    if (n > 0) {
        hold_reserve(r, (size_t)n);
        memcpy(r->hold + r->hold_len, piece, (size_t)n);
        r->hold_len += (size_t)n;
    }
    bool last = r->n_gen >= r->req->max_tokens;
    if (last) {
        n = model_detok_flush(r->detok, piece, sizeof(piece));
        if (n > 0) {
            hold_reserve(r, (size_t)n);
            memcpy(r->hold + r->hold_len, piece, (size_t)n);
            r->hold_len += (size_t)n;
        }
    }
    struct srv_logprob *lp =
        r->req->want_logprobs
            ? srv_lp_make(&r->lp, tok, r->hold ? r->hold + hold_before : "", r->hold_len - hold_before)
            : NULL;
    size_t at = 0, safe = 0;
    int k = srv_stop_scan(r->hold, r->hold_len, r->req->stop, r->req->n_stop, &at, &safe);
    const int32_t *toks = r->req->want_tokens ? &tok : NULL;
    int n_toks = r->req->want_tokens ? 1 : 0;
    if (k >= 0) {
        emit_text(s, r, at, toks, n_toks, lp);
        run_finish(s, r, SRV_FINISH_STOP, k);
        return true;
    }
    emit_text(s, r, last ? r->hold_len : safe, toks, n_toks, lp);
    if (last) {
        run_finish(s, r, SRV_FINISH_LENGTH, -1);
        return true;
    }
    r->phase = RUN_DECODE;
    r->next_tok = tok;
    return false;
}

/* ------------------------------------------------------------------------
 * One step
 * ------------------------------------------------------------------------ */

/* Lock rule: takes in_mu only. Moves the inbox to the waiting FIFO and
 * applies new limits. Returns false when the engine must stop. */
static bool pull_inbox(srv_sched *s, bool block, uint64_t wait_ms)
{
    pthread_mutex_lock(&s->in_mu);
    if (block && !s->in_head && !s->stop && !s->limits_dirty && !s->woken) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += (time_t)(wait_ms / 1000);
        ts.tv_nsec += (long)(wait_ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->in_cv, &s->in_mu, &ts);
    }
    struct srv_req *head = s->in_head;
    s->in_head = s->in_tail = NULL;
    s->woken = false;
    bool stop = s->stop;
    bool dirty = s->limits_dirty;
    struct srv_sched_limits l = s->next_limits;
    s->limits_dirty = false;
    pthread_mutex_unlock(&s->in_mu);

    if (dirty) {
        s->lim = l;
        /* Every session follows the new policy from its next eviction. */
        srv_sessions_set_policy(&s->sessions, &l.policy);
        for (struct run *r = s->runs; r; r = r->next)
            if (!r->sess)
                kv_seq_set_policy(r->seq, &l.policy);
        srv_log(SRV_LOG_INFO, "engine: new limits applied (max_running %d, step_tokens %d)",
                l.max_running, l.step_tokens);
    }
    while (head) {
        struct srv_req *r = head;
        head = head->next;
        r->next = NULL;
        if (r->kind != SRV_REQ_COMPLETION) {
            /* Control requests are answered at once. */
            pthread_mutex_lock(&s->in_mu);
            s->n_waiting--;
            pthread_mutex_unlock(&s->in_mu);
            handle_session_request(s, r);
            continue;
        }
        if (s->wait_tail)
            s->wait_tail->next = r;
        else
            s->wait_head = r;
        s->wait_tail = r;
    }
    return !stop;
}

/* Unlink r from the waiting FIFO. Lock rule: takes in_mu only. */
static void waiting_remove(srv_sched *s, struct srv_req *prev, struct srv_req *r)
{
    if (prev)
        prev->next = r->next;
    else
        s->wait_head = r->next;
    if (s->wait_tail == r)
        s->wait_tail = prev;
    r->next = NULL;
    pthread_mutex_lock(&s->in_mu);
    s->n_waiting--;
    pthread_mutex_unlock(&s->in_mu);
}

/* Drop cancelled requests, waiting or running. */
static void drop_cancelled(srv_sched *s)
{
    struct srv_req *prev = NULL;
    for (struct srv_req *q = s->wait_head, *next; q; q = next) {
        next = q->next;
        int c = atomic_load(&q->cancel);
        if (c) {
            waiting_remove(s, prev, q);
            struct srv_event *ev = event_new(SRV_EV_DONE, q);
            ev->finish = c == SRV_CANCEL_CLIENT ? SRV_FINISH_CANCEL : SRV_FINISH_ABORT;
            ev->usage.prompt_tokens = q->n_prompt;
            post(s, ev);
        } else {
            prev = q;
        }
    }
    for (struct run *r = s->runs, *next; r; r = next) {
        next = r->next;
        int c = atomic_load(&r->req->cancel);
        if (c) {
            if (c == SRV_CANCEL_ABORT)
                emit_text(s, r, r->hold_len, NULL, 0, NULL);
            run_finish(s, r, c == SRV_CANCEL_CLIENT ? SRV_FINISH_CANCEL : SRV_FINISH_ABORT, -1);
        }
    }
}

/* FIFO admission up to max_running; a request whose session is busy keeps
 * its place and lets later ones pass. */
static void admit(srv_sched *s, uint64_t t)
{
    struct srv_req *prev = NULL;
    for (struct srv_req *q = s->wait_head, *next; q && s->n_running < s->lim.max_running;
         q = next) {
        next = q->next;
        if (q->session) {
            struct srv_session *x = srv_sessions_find(&s->sessions, q->session);
            if (x && x->busy) {
                prev = q;
                continue;
            }
        }
        waiting_remove(s, prev, q);
        run_admit(s, q, t);
    }
}

/* Build the batch: decode tokens first (not for a request whose reader is
 * behind: it keeps its slot and its cache and resumes when the loop thread
 * clears `paused`), then prefill chunks in admission
 * order, within step_tokens. Returns the number of entries. */
static int build_batch(srv_sched *s)
{
    int n = 0, budget = s->lim.step_tokens;
    for (struct run *r = s->runs; r; r = r->next) {
        r->batch_slot = -1;
        if (r->phase == RUN_DECODE && budget > 0 && n < s->batch_cap &&
            !atomic_load(&r->req->paused)) {
            s->batch[n] = (struct model_batch_seq){
                .seq = r->seq, .tokens = &r->next_tok, .n_tokens = 1, .logits = r->logits};
            s->batch_runs[n] = r;
            r->batch_slot = n++;
            budget--;
        }
    }
    for (struct run *r = s->runs; r && budget > 0; r = r->next) {
        if (r->phase != RUN_PREFILL || n >= s->batch_cap)
            continue;
        int left = r->req->n_prompt - r->n_fed;
        int chunk = left < budget ? left : budget;
        int room = kv_seq_max_append(r->seq);
        if (room < chunk)
            chunk = room;
        if (chunk <= 0)
            chunk = 1; /* let kv_reserve report -ENOSPC for this sequence */
        bool final = chunk == left;
        s->batch[n] = (struct model_batch_seq){.seq = r->seq,
                                               .tokens = r->req->prompt + r->n_fed,
                                               .n_tokens = chunk,
                                               .logits = final ? r->logits : NULL};
        s->batch_runs[n] = r;
        r->batch_slot = n++;
        budget -= chunk;
    }
    return n;
}

static void batch_remove(srv_sched *s, int *n, int i)
{
    for (int j = i; j + 1 < *n; j++) {
        s->batch[j] = s->batch[j + 1];
        s->batch_runs[j] = s->batch_runs[j + 1];
        s->batch_runs[j]->batch_slot = j;
    }
    (*n)--;
}

/*
 * A sequence of the batch cannot go on: end it as its state says. What it
 * generated is sent, but a generation the server cut (the pool ran out of
 * pages; a reload took away the eviction it was admitted under) ends with
 * a finish that says so, never as if the request's own limit was reached.
 */
static void fail_in_batch(srv_sched *s, struct run *r, int err)
{
    if (err == -ENOSPC) {
        if (r->phase == RUN_DECODE) {
            emit_text(s, r, r->hold_len, NULL, 0, NULL);
            run_finish(s, r, r->admitted_evicting ? SRV_FINISH_POLICY : SRV_FINISH_CONTEXT, -1);
        } else {
            run_fail(s, r, 400,
                     "the prompt (%d tokens) does not fit the context: %d tokens are kept "
                     "per sequence under eviction policy none",
                     r->req->n_prompt, kv_seq_policy(r->seq)->max_cache_tokens);
        }
    } else if (err == -ENOMEM) {
        if (r->n_gen > 0) {
            emit_text(s, r, r->hold_len, NULL, 0, NULL);
            run_finish(s, r, SRV_FINISH_POOL, -1);
        } else {
            run_fail(s, r, 503, "the KV cache is full; retry later");
        }
    } else {
        run_fail(s, r, 500, "model error %d", err);
    }
}

/*
 * Reserve the batch's slots, taking out the sequences that cannot have
 * theirs: the one whose context is full (or whose batch entry is bad), or,
 * when the pool is short, the most recently admitted sequence, which
 * yields to the older ones; each is failed or finished as fail_in_batch
 * says. Fills each entry's `first`. Returns false when nothing is left.
 */
static bool reserve_batch(srv_sched *s, int *n)
{
    for (;;) {
        for (int i = 0; i < *n; i++)
            s->res[i] = (struct kv_reservation){.seq = s->batch[i].seq,
                                                .tokens = s->batch[i].tokens,
                                                .n_tokens = s->batch[i].n_tokens};
        int failed = -1;
        int rc = kv_reserve(s->res, *n, &failed);
        if (rc == 0)
            break;
        int victim = failed >= 0 && failed < *n ? failed : *n - 1;
        if (rc == -ENOMEM) {
            /* the most recently admitted sequence of the batch yields */
            victim = 0;
            for (int i = 1; i < *n; i++)
                if (s->batch_runs[i]->t_admit_ns >= s->batch_runs[victim]->t_admit_ns)
                    victim = i;
        }
        struct run *r = s->batch_runs[victim];
        srv_log(SRV_LOG_WARN, "request %" PRIu64 ": no room in the cache (%s)", r->req->id,
                rc == -ENOSPC   ? "context full"
                : rc == -ENOMEM ? "KV pool exhausted"
                                : "error");
        batch_remove(s, n, victim);
        fail_in_batch(s, r, rc);
        if (rc != -ENOSPC && rc != -ENOMEM) {
            /* A bad batch is a bug in the engine: fail the whole batch. */
            while (*n > 0) {
                struct run *x = s->batch_runs[*n - 1];
                batch_remove(s, n, *n - 1);
                fail_in_batch(s, x, rc);
            }
        }
        if (*n == 0)
            return false;
    }
    for (int i = 0; i < *n; i++)
        s->batch[i].first = s->res[i].first;
    return true;
}

/* One engine step. Returns false when there was nothing to run. */
static bool step(srv_sched *s, uint64_t t)
{
    drop_cancelled(s);
    admit(s, t);
    int n = build_batch(s);
    if (n == 0)
        return false;

    if (!reserve_batch(s, &n))
        return true;
    int rc = model_forward(s->ctx, s->batch, n);
    if (rc) {
        /* A failed pass is a bug or a kernel error: take the slots back
         * and fail the whole batch. */
        kv_reserve_undo(s->res, n);
        srv_log(SRV_LOG_WARN, "forward failed (%d): failing the batch", rc);
        while (n > 0) {
            struct run *x = s->batch_runs[n - 1];
            batch_remove(s, &n, n - 1);
            fail_in_batch(s, x, rc);
        }
        return true;
    }

    int batch_tokens = 0;
    for (int i = 0; i < n; i++)
        batch_tokens += s->batch[i].n_tokens;
    if (s->metrics) {
        srv_metrics_observe(s->metrics, SRV_HIST_BATCH_SEQS, n);
        srv_metrics_observe(s->metrics, SRV_HIST_BATCH_TOKENS, batch_tokens);
    }

    uint64_t t_done = now_ns();
    /* Sample in batch order; a run may be freed, so copy the list first. */
    int n_done = n;
    for (int i = 0; i < n_done; i++) {
        struct run *r = s->batch_runs[i];
        const struct model_batch_seq *b = &s->batch[i];
        if (r->phase == RUN_PREFILL) {
            r->n_fed += b->n_tokens;
            if (!r->sess)
                r->appended += b->n_tokens;
            if (r->n_fed < r->req->n_prompt)
                continue;
            if (r->req->max_tokens == 0) {
                run_finish(s, r, SRV_FINISH_LENGTH, -1);
                continue;
            }
        } else if (!r->sess) {
            r->appended += 1;
        }
        /* before ignore_eos and the sampler change the logits */
        if (r->req->want_logprobs)
            srv_lp_prepare(&r->lp, r->logits, s->n_vocab);
        if (r->req->ignore_eos)
            for (int k = 0; k < s->n_eog; k++)
                r->logits[s->eog[k]] = -INFINITY;
        int32_t tok = model_sample(r->smp, r->logits, r->hist, r->n_hist);
        run_take_token(s, r, tok, t_done);
    }
    return true;
}

/* ------------------------------------------------------------------------
 * The engine thread
 * ------------------------------------------------------------------------ */

static bool engine_load(srv_sched *s)
{
    char err[512] = "";
    s->m = s->p.loaded ? s->p.loaded : model_load(&s->p.model, err, sizeof(err));
    s->p.loaded = NULL;
    if (!s->m)
        goto out_fail;
    struct model_info info;
    model_get_info(s->m, &info);
    s->n_vocab = info.n_vocab;
    s->eog = malloc(sizeof(int32_t) * (size_t)info.n_vocab);
    if (!s->eog)
        abort();
    for (int32_t t = 0; t < info.n_vocab; t++)
        if (model_is_eog(s->m, t))
            s->eog[s->n_eog++] = t;

    struct kv_cache_params cp = {.memory_bytes = s->p.cache_memory,
                                 .page_tokens = s->p.page_tokens,
                                 .k_type = s->p.k_type,
                                 .v_type = s->p.v_type,
                                 .mlock = s->p.mlock};
    model_kv_shape(s->m, &cp);
    s->cache = kv_cache_create(&cp, err, sizeof(err));
    if (!s->cache)
        goto out_model;
    if (err[0])
        srv_log(SRV_LOG_WARN, "kv cache: %s", err);
    if (kv_policy_check(&s->lim.policy, s->p.page_tokens, err, sizeof(err)) != 0)
        goto out_cache;
    /* The pool must hold one sequence at its full budget. */
    struct kv_budget budget;
    kv_policy_budget(&s->lim.policy, s->p.page_tokens, &budget);
    long need = (long)budget.sequence_pages;
    if (kv_cache_n_pages(s->cache) < need) {
        snprintf(err, sizeof(err),
                 "[cache] memory holds %d pages of %d tokens (%zu bytes each); one sequence at "
                 "max_cache_tokens = %d needs %ld pages (%zu bytes)",
                 kv_cache_n_pages(s->cache), s->p.page_tokens, kv_cache_page_bytes(s->cache),
                 s->lim.policy.max_cache_tokens, need,
                 (size_t)need * kv_cache_page_bytes(s->cache));
        goto out_cache;
    }
    s->ctx = model_ctx_create(s->m, s->p.max_step_tokens, s->p.n_threads, err, sizeof(err));
    if (!s->ctx)
        goto out_cache;
    srv_log(SRV_LOG_INFO,
            "model %s (%s, %d layers, vocab %d, pre-tokenizer %s) loaded; KV pool %d pages of %d "
            "tokens",
            info.name, info.arch, info.n_layer, info.n_vocab, info.tokenizer,
            kv_cache_n_pages(s->cache), s->p.page_tokens);
    if (info.tokenizer_note)
        srv_log(SRV_LOG_WARN, "tokenizer: %s", info.tokenizer_note);
    atomic_store(&s->ready_model, (const model *)s->m);
    post(s, event_new(SRV_EV_READY, NULL));
    return true;

out_cache:
    kv_cache_destroy(s->cache);
    s->cache = NULL;
out_model:
    model_free(s->m);
    model_free(s->p.loaded); /* the engine thread never started */
    s->m = NULL;
out_fail : {
    struct srv_event *ev = event_new(SRV_EV_FATAL, NULL);
    snprintf(ev->message, sizeof(ev->message), "%s", err);
    post(s, ev);
    return false;
}
}

static void *engine_main(void *arg)
{
    srv_sched *s = arg;
    bool ok = engine_load(s);
    bool busy = false;
    while (ok) {
        /* Wait for work only when the last step had none; wake at least
         * once a second for the session idle sweep. */
        if (!pull_inbox(s, !busy, 1000))
            break;
        uint64_t t = now_ns();
        uint64_t t_ms = t / 1000000u;
        if (t_ms - s->last_sweep_ms >= 1000) {
            srv_sessions_sweep(&s->sessions, t_ms, s->lim.session_idle_ms);
            s->last_sweep_ms = t_ms;
        }
        busy = step(s, t);
        publish_gauges(s);
    }

    /* Stopping: end what is left. */
    for (struct srv_req *q = s->wait_head, *next; q; q = next) {
        next = q->next;
        waiting_remove(s, NULL, q);
        post_error(s, q, 503, "the server is shutting down");
    }
    while (s->runs) {
        struct run *r = s->runs;
        if (ok)
            emit_text(s, r, r->hold_len, NULL, 0, NULL);
        run_finish(s, r, SRV_FINISH_ABORT, -1);
    }
    /* Requests that arrived after the last pull. */
    pthread_mutex_lock(&s->in_mu);
    struct srv_req *head = s->in_head;
    s->in_head = s->in_tail = NULL;
    pthread_mutex_unlock(&s->in_mu);
    for (struct srv_req *q = head, *next; q; q = next) {
        next = q->next;
        post_error(s, q, 503, "the server is shutting down");
    }
    return NULL;
}

/* ------------------------------------------------------------------------
 * Lifecycle and the loop thread's side
 * ------------------------------------------------------------------------ */

static int check_limits(const struct srv_sched_limits *l, int page_tokens, int max_step_tokens,
                        char *err, size_t errlen)
{
    if (l->max_running < 1) {
        snprintf(err, errlen, "max_running must be at least 1 (got %d)", l->max_running);
        return -EINVAL;
    }
    if (l->step_tokens < l->max_running) {
        snprintf(err, errlen,
                 "step_tokens (%d) must be at least max_running (%d): every running sequence "
                 "needs its decode token in a step",
                 l->step_tokens, l->max_running);
        return -EINVAL;
    }
    if (max_step_tokens > 0 && l->step_tokens > max_step_tokens) {
        snprintf(err, errlen, "step_tokens (%d) exceeds the engine's capacity (%d) set at start",
                 l->step_tokens, max_step_tokens);
        return -EINVAL;
    }
    if (l->queue_length < 0) {
        snprintf(err, errlen, "queue_length must be >= 0");
        return -EINVAL;
    }
    return kv_policy_check(&l->policy, page_tokens, err, errlen);
}

srv_sched *srv_sched_create(const struct srv_sched_params *p, char *err, size_t errlen)
{
    int max_step = p->max_step_tokens > 0 ? p->max_step_tokens : p->limits.step_tokens;
    if (check_limits(&p->limits, p->page_tokens, max_step, err, errlen) != 0) {
        model_free(p->loaded);
        return NULL;
    }
    srv_sched *s = xcalloc(1, sizeof(*s));
    s->p = *p;
    s->p.max_step_tokens = max_step;
    s->notify = p->notify;
    s->lim = p->limits;
    s->queue_length = p->limits.queue_length;
    s->max_running_pub = p->limits.max_running;
    srv_sessions_init(&s->sessions);
    /* The batch holds at most one entry per running sequence; size it for
     * the most any reload may allow (step_tokens bounds max_running). */
    s->batch_cap = max_step;
    s->batch = xcalloc((size_t)s->batch_cap, sizeof(*s->batch));
    s->res = xcalloc((size_t)s->batch_cap, sizeof(*s->res));
    s->batch_runs = xcalloc((size_t)s->batch_cap, sizeof(*s->batch_runs));
    atomic_init(&s->ready_model, NULL);
    pthread_mutex_init(&s->in_mu, NULL);
    pthread_cond_init(&s->in_cv, NULL);
    pthread_mutex_init(&s->out_mu, NULL);
    return s;
}

/* Start the engine thread (separate from create so the metrics sink can be
 * attached first). */
int srv_sched_start(srv_sched *s, srv_metrics *metrics, char *err, size_t errlen)
{
    s->metrics = metrics;
    int rc = pthread_create(&s->thread, NULL, engine_main, s);
    if (rc != 0) {
        snprintf(err, errlen, "cannot start the engine thread: %s", strerror(rc));
        return -rc;
    }
    s->thread_started = true;
    return 0;
}

void srv_sched_destroy(srv_sched *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->out_mu);
    s->notify = NULL; /* the loop may be gone: wake it no more */
    pthread_mutex_unlock(&s->out_mu);
    if (s->thread_started) {
        pthread_mutex_lock(&s->in_mu);
        s->stop = true;
        pthread_cond_signal(&s->in_cv);
        pthread_mutex_unlock(&s->in_mu);
        pthread_join(s->thread, NULL);
    }
    srv_sessions_deinit(&s->sessions);
    model_ctx_destroy(s->ctx);
    kv_cache_destroy(s->cache);
    model_free(s->m);
    for (struct srv_event *ev = srv_sched_take_events(s), *next; ev; ev = next) {
        next = ev->next;
        srv_event_free(ev);
    }
    free(s->batch);
    free(s->res);
    free(s->batch_runs);
    free(s->eog);
    pthread_mutex_destroy(&s->in_mu);
    pthread_cond_destroy(&s->in_cv);
    pthread_mutex_destroy(&s->out_mu);
    free(s);
}

/* Lock rule: takes in_mu only. */
int srv_sched_submit(srv_sched *s, struct srv_req *r)
{
    r->t_submit_ns = now_ns();
    r->next = NULL;
    pthread_mutex_lock(&s->in_mu);
    if (s->stop) {
        pthread_mutex_unlock(&s->in_mu);
        return -ESHUTDOWN;
    }
    /* Beyond the free sequence slots, queue_length requests may wait. */
    int free_slots = s->max_running_pub - s->running_pub;
    if (r->kind == SRV_REQ_COMPLETION &&
        s->n_waiting >= s->queue_length + (free_slots > 0 ? free_slots : 0)) {
        pthread_mutex_unlock(&s->in_mu);
        return -EAGAIN;
    }
    s->n_waiting++;
    if (s->in_tail)
        s->in_tail->next = r;
    else
        s->in_head = r;
    s->in_tail = r;
    pthread_cond_signal(&s->in_cv);
    pthread_mutex_unlock(&s->in_mu);
    return 0;
}

/* Lock rule: takes in_mu only. */
void srv_sched_wake(srv_sched *s)
{
    pthread_mutex_lock(&s->in_mu);
    s->woken = true;
    pthread_cond_signal(&s->in_cv);
    pthread_mutex_unlock(&s->in_mu);
}

const model *srv_sched_model(srv_sched *s)
{
    return atomic_load(&s->ready_model);
}

/* Lock rule: takes in_mu only. */
int srv_sched_set_limits(srv_sched *s, const struct srv_sched_limits *l, char *err, size_t errlen)
{
    if (check_limits(l, s->p.page_tokens, s->p.max_step_tokens, err, errlen) != 0)
        return -EINVAL;
    pthread_mutex_lock(&s->in_mu);
    s->next_limits = *l;
    s->limits_dirty = true;
    s->queue_length = l->queue_length;
    s->max_running_pub = l->max_running;
    pthread_cond_signal(&s->in_cv);
    pthread_mutex_unlock(&s->in_mu);
    return 0;
}

/* Lock rule: takes in_mu only. */
int srv_sched_queue_depth(srv_sched *s)
{
    pthread_mutex_lock(&s->in_mu);
    int n = s->n_waiting;
    pthread_mutex_unlock(&s->in_mu);
    return n;
}
