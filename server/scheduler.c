/*
 * scheduler.c - the engine thread of `kvd serve`: the engine
 * (engine/engine.h) driven on a thread of its own.
 *
 * One thread owns the model, the engine, its cache and every sequence.
 * Requests arrive from the loop thread through an inbox (mutex + condition
 * variable); the thread moves them into the engine, runs engine_step, and
 * moves the step's events to an outbox (mutex), waking the loop only when
 * the outbox goes from empty to non-empty (uv_async_send coalesces
 * anyway). The two mutexes are never held together. What a step decides
 * (admission, batching, reservation, sampling, text) is the engine's; this
 * file decides only when to step: at once while the last step had work,
 * otherwise when a request, a reload, a resumed reader or the once-a-second
 * session sweep wakes it.
 *
 * Heartbeat. The thread stores the time before each wait for work and
 * after each step; the readiness route asks how long it has been busy
 * since (srv_sched_busy_ms) and says "not ready" when a step has run
 * longer than [limits] engine_stall_timeout, while the loop thread goes on
 * answering. KVD_FAULT_ENGINE_STALL_MS (for that test only, logged when
 * set) makes every step with work sleep that long.
 *
 * The queue limit is applied here, at submission on the loop thread
 * (beyond the free sequence slots, queue_length requests may wait; the API
 * answers 429 past that), from counts the engine thread publishes under
 * the inbox mutex after every pull and step.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/log.h"
#include "server/scheduler.h"

struct srv_sched {
    struct srv_sched_params p;
    pthread_t thread;
    bool thread_started;

    /* Inbox: guarded by in_mu. */
    pthread_mutex_t in_mu;
    pthread_cond_t in_cv;
    struct engine_req *in_head, *in_tail;
    int n_inbox; /* completions in the inbox */
    bool stop;
    bool woken; /* srv_sched_wake since the last pull */
    bool limits_dirty;
    struct engine_limits next_limits;
    int queue_length;    /* read by submit */
    int max_running_pub; /* read by submit */
    int waiting_pub;     /* published by the engine thread: waiting inside the engine */
    int running_pub;     /* ... and admitted, not yet ended */

    /* Outbox: guarded by out_mu. */
    pthread_mutex_t out_mu;
    struct engine_event *out_head, *out_tail;
    void (*notify)(void *ud);

    /* Published once by the engine thread before ENGINE_EV_READY. */
    _Atomic(const model *) ready_model;

    /* The heartbeat: the engine thread stores the monotonic time (ms) before
     * each wait for work and after each step; `idle` is set while it waits.
     * Read by the loop thread's readiness check (srv_sched_busy_ms). */
    _Atomic uint64_t beat_ms;
    atomic_bool idle;
    uint64_t fault_stall_ms; /* test hook: sleep this long in each busy step */

    /* Engine thread only. */
    model *m;
    engine *eng;
    uint64_t last_sweep_ms;
    srv_metrics *metrics;
};

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void beat(srv_sched *s)
{
    atomic_store(&s->beat_ms, now_ns() / 1000000u);
}

/* ------------------------------------------------------------------------
 * The outbox
 * ------------------------------------------------------------------------ */

/* Append a list of events. Lock rule: takes out_mu only. */
static void post_list(srv_sched *s, struct engine_event *head)
{
    if (!head)
        return;
    struct engine_event *tail = head;
    while (tail->next)
        tail = tail->next;
    pthread_mutex_lock(&s->out_mu);
    bool was_empty = s->out_head == NULL;
    if (s->out_tail)
        s->out_tail->next = head;
    else
        s->out_head = head;
    s->out_tail = tail;
    /* notify (uv_async_send) takes no lock; it is read under out_mu so
     * srv_sched_destroy can detach it before the loop's handle closes. */
    if (was_empty && s->notify)
        s->notify(s->p.notify_ud);
    pthread_mutex_unlock(&s->out_mu);
}

/* A READY or FATAL event (bookkeeping: running out here aborts). */
static void post_state(srv_sched *s, enum engine_event_kind kind, const char *message)
{
    struct engine_event *ev = engine_event_new(kind, NULL);
    if (!ev) {
        fprintf(stderr, "kvd: out of memory (%zu bytes)\n", sizeof(*ev));
        abort();
    }
    snprintf(ev->message, sizeof(ev->message), "%s", message);
    post_list(s, ev);
}

struct engine_event *srv_sched_take_events(srv_sched *s)
{
    pthread_mutex_lock(&s->out_mu);
    struct engine_event *head = s->out_head;
    s->out_head = s->out_tail = NULL;
    pthread_mutex_unlock(&s->out_mu);
    return head;
}

/* ------------------------------------------------------------------------
 * The engine's hooks: metrics and log
 * ------------------------------------------------------------------------ */

static void hook_observe(void *ud, enum engine_obs what, double v)
{
    srv_sched *s = ud;
    static const enum srv_hist hist[] = {
        [ENGINE_OBS_TTFT] = SRV_HIST_TTFT,
        [ENGINE_OBS_ITL] = SRV_HIST_ITL,
        [ENGINE_OBS_BATCH_SEQS] = SRV_HIST_BATCH_SEQS,
        [ENGINE_OBS_BATCH_TOKENS] = SRV_HIST_BATCH_TOKENS,
    };
    if (s->metrics)
        srv_metrics_observe(s->metrics, hist[what], v);
}

static void hook_finished(void *ud, enum engine_finish f, uint64_t prefilled, uint64_t cached,
                          uint64_t generated)
{
    srv_sched *s = ud;
    if (!s->metrics)
        return;
    srv_metrics_tokens(s->metrics, prefilled, cached, generated);
    if (f == ENGINE_FINISH_CANCEL)
        srv_metrics_cancelled(s->metrics);
}

static void hook_log(void *ud, enum engine_log_level level, const char *line)
{
    (void)ud;
    srv_log(level == ENGINE_LOG_DEBUG  ? SRV_LOG_DEBUG
            : level == ENGINE_LOG_INFO ? SRV_LOG_INFO
                                       : SRV_LOG_WARN,
            "%s", line);
}

/* Lock rule: takes in_mu, releases it, then the metrics lock (never both). */
static void publish(srv_sched *s)
{
    struct engine_stats st;
    engine_get_stats(s->eng, &st);
    pthread_mutex_lock(&s->in_mu);
    s->waiting_pub = st.waiting;
    s->running_pub = st.running;
    int queue_depth = s->n_inbox + st.waiting;
    pthread_mutex_unlock(&s->in_mu);
    if (!s->metrics)
        return;
    struct srv_engine_gauges g = {
        .queue_depth = queue_depth,
        .running = st.running,
        .sessions = st.sessions,
        .kv_pages_total = st.kv.pages_total,
        .kv_pages_used = st.kv.pages_used,
        .kv_pages_free = st.kv.pages_free,
        .evictions = st.kv.evictions,
        .tokens_evicted = st.kv.tokens_evicted,
        .sessions_dropped = st.kv.sessions_dropped,
        .kv_k_type = s->p.k_type,
        .kv_v_type = s->p.v_type,
        .kv_page_bytes = st.kv_page_bytes,
        .prefix_on = st.prefix_on,
        .prefix = st.prefix,
        .prefix_prompt_tokens = st.prefix_prompt_tokens,
        .prefix_hit_tokens = st.prefix_hit_tokens,
        .spill_saved = st.spill.saved,
        .spill_save_failed = st.spill.save_failed,
        .spill_restored = st.spill.restored,
        .spill_refused = st.spill.refused,
        .spill_bytes_saved = st.spill.bytes_saved,
        .spill_bytes_restored = st.spill.bytes_restored,
    };
    srv_metrics_engine(s->metrics, &g);
}

/* ------------------------------------------------------------------------
 * The engine thread
 * ------------------------------------------------------------------------ */

/* Lock rule: takes in_mu only. Waits (when block) for work, then moves the
 * inbox into the engine and applies new limits. Returns false when the
 * engine must stop. */
static bool pull_inbox(srv_sched *s, bool block, uint64_t wait_ms)
{
    beat(s);
    pthread_mutex_lock(&s->in_mu);
    if (block && !s->in_head && !s->stop && !s->limits_dirty && !s->woken) {
        atomic_store(&s->idle, true);
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
    struct engine_req *head = s->in_head;
    s->in_head = s->in_tail = NULL;
    s->waiting_pub += s->n_inbox; /* in the engine from here on */
    s->n_inbox = 0;
    s->woken = false;
    bool stop = s->stop;
    bool dirty = s->limits_dirty;
    struct engine_limits l = s->next_limits;
    s->limits_dirty = false;
    pthread_mutex_unlock(&s->in_mu);
    beat(s); /* busy from here until the next beat */
    atomic_store(&s->idle, false);

    char err[256];
    if (dirty && engine_set_limits(s->eng, &l, err, sizeof(err)) != 0)
        srv_log(SRV_LOG_ERROR, "engine: new limits refused: %s", err); /* checked before */
    while (head) {
        struct engine_req *r = head;
        head = head->next;
        if (engine_submit(s->eng, r) != 0)
            srv_log(SRV_LOG_ERROR, "request %" PRIu64 ": kind %d refused", r->id, (int)r->kind);
    }
    return !stop;
}

/* Load the model and create the engine; post READY or FATAL. */
static bool engine_load(srv_sched *s)
{
    char err[512] = "";
    s->m = s->p.loaded ? s->p.loaded : model_load(&s->p.model, err, sizeof(err));
    s->p.loaded = NULL;
    if (!s->m)
        goto out_fail;
    struct engine_params ep = {
        .m = s->m,
        .cache_memory = s->p.cache_memory,
        .page_tokens = s->p.page_tokens,
        .k_type = s->p.k_type,
        .v_type = s->p.v_type,
        .mlock = s->p.mlock,
        .prefix_cache = s->p.prefix_cache,
        .prefix_cache_share = s->p.prefix_cache_share,
        .n_threads = s->p.n_threads,
        .max_step_tokens = s->p.max_step_tokens,
        .limits = s->p.limits,
        .spill_dir = s->p.spill_dir,
        .spill_max_bytes = s->p.spill_max_bytes,
        .hooks = {.observe = hook_observe, .finished = hook_finished, .log = hook_log, .ud = s},
    };
    s->eng = engine_create(&ep, err, sizeof(err));
    if (!s->eng)
        goto out_model;
    struct model_info info;
    model_get_info(s->m, &info);
    const kv_cache *c = engine_cache(s->eng);
    srv_log(SRV_LOG_INFO,
            "model %s (%s, %d layers, vocab %d, pre-tokenizer %s) loaded; KV pool %d pages of %d "
            "tokens (%s)",
            info.name, info.arch, info.n_layer, info.n_vocab, info.tokenizer, kv_cache_n_pages(c),
            s->p.page_tokens, kv_cache_pages(c)->says);
    if (info.tokenizer_note)
        srv_log(SRV_LOG_WARN, "tokenizer: %s", info.tokenizer_note);
    atomic_store(&s->ready_model, (const model *)s->m);
    post_state(s, ENGINE_EV_READY, "");
    return true;

out_model:
    model_free(s->m);
    s->m = NULL;
out_fail:
    post_state(s, ENGINE_EV_FATAL, err);
    return false;
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
            engine_sweep(s->eng, t_ms);
            s->last_sweep_ms = t_ms;
        }
        busy = engine_step(s->eng, t);
        if (busy && s->fault_stall_ms) {
            struct timespec ts = {(time_t)(s->fault_stall_ms / 1000),
                                  (long)(s->fault_stall_ms % 1000) * 1000000L};
            nanosleep(&ts, NULL); /* a step that hangs (KVD_FAULT_ENGINE_STALL_MS) */
        }
        beat(s);
        post_list(s, engine_take_events(s->eng));
        publish(s);
    }

    /* Stopping: end what is left, and what arrived after the last pull. */
    if (ok) {
        pull_inbox(s, false, 0);
        engine_shutdown(s->eng, "the server is shutting down", true);
        engine_save_sessions(s->eng); /* [sessions] dir: every session outlives us */
        post_list(s, engine_take_events(s->eng));
        publish(s);
        return NULL;
    }
    pthread_mutex_lock(&s->in_mu);
    struct engine_req *head = s->in_head;
    s->in_head = s->in_tail = NULL;
    pthread_mutex_unlock(&s->in_mu);
    for (struct engine_req *q = head, *next; q; q = next) {
        next = q->next;
        q->next = NULL;
        post_list(s, engine_req_error(q, 503, "the server is shutting down"));
    }
    return NULL;
}

/* ------------------------------------------------------------------------
 * Lifecycle and the loop thread's side
 * ------------------------------------------------------------------------ */

srv_sched *srv_sched_create(const struct srv_sched_params *p, char *err, size_t errlen)
{
    int max_step = p->max_step_tokens > 0 ? p->max_step_tokens : p->limits.step_tokens;
    if (engine_check_limits(&p->limits, p->page_tokens, max_step, err, errlen) != 0) {
        model_free(p->loaded);
        return NULL;
    }
    srv_sched *s = calloc(1, sizeof(*s));
    if (!s) {
        snprintf(err, errlen, "out of memory for the engine thread");
        model_free(p->loaded);
        return NULL;
    }
    s->p = *p;
    s->p.max_step_tokens = max_step;
    s->notify = p->notify;
    s->queue_length = p->limits.queue_length;
    s->max_running_pub = p->limits.max_running;
    atomic_init(&s->ready_model, NULL);
    atomic_init(&s->beat_ms, now_ns() / 1000000u);
    atomic_init(&s->idle, true);
    /* Fault injection for the stalled-engine test: never silent. */
    const char *stall = getenv("KVD_FAULT_ENGINE_STALL_MS");
    if (stall && *stall) {
        s->fault_stall_ms = strtoull(stall, NULL, 10);
        srv_log(SRV_LOG_WARN,
                "fault injection: every engine step with work stalls %" PRIu64
                " ms (KVD_FAULT_ENGINE_STALL_MS)",
                s->fault_stall_ms);
    }
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
    engine_destroy(s->eng);
    model_free(s->m);
    model_free(s->p.loaded); /* the engine thread never started */
    for (struct engine_event *ev = srv_sched_take_events(s), *next; ev; ev = next) {
        next = ev->next;
        engine_event_free(ev);
    }
    pthread_mutex_destroy(&s->in_mu);
    pthread_cond_destroy(&s->in_cv);
    pthread_mutex_destroy(&s->out_mu);
    free(s);
}

/* Lock rule: takes in_mu only. */
int srv_sched_submit(srv_sched *s, struct engine_req *r)
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
    int waiting = s->n_inbox + s->waiting_pub;
    if (r->kind == ENGINE_REQ_COMPLETION &&
        waiting >= s->queue_length + (free_slots > 0 ? free_slots : 0)) {
        pthread_mutex_unlock(&s->in_mu);
        return -EAGAIN;
    }
    if (r->kind == ENGINE_REQ_COMPLETION)
        s->n_inbox++;
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
int srv_sched_set_limits(srv_sched *s, const struct engine_limits *l, char *err, size_t errlen)
{
    if (engine_check_limits(l, s->p.page_tokens, s->p.max_step_tokens, err, errlen) != 0)
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

uint64_t srv_sched_busy_ms(srv_sched *s)
{
    if (atomic_load(&s->idle))
        return 0;
    uint64_t now = now_ns() / 1000000u, b = atomic_load(&s->beat_ms);
    return now > b ? now - b : 0;
}

/* Lock rule: takes in_mu only. */
int srv_sched_queue_depth(srv_sched *s)
{
    pthread_mutex_lock(&s->in_mu);
    int n = s->n_inbox + s->waiting_pub;
    pthread_mutex_unlock(&s->in_mu);
    return n;
}
