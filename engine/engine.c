/*
 * engine.c - the engine's lifecycle, its request and event queues, its
 * limits and statistics.
 *
 * The engine is the one place a request becomes tokens (engine.h says
 * what it decides). This file holds what surrounds a step: creating the
 * cache and the forward context over a borrowed model, taking requests
 * (completions wait in a FIFO for admission; session requests are answered
 * at once), the event list the host drains after each step, and the
 * limits a reload may swap. run.c is one request's life, step.c one step.
 *
 * Events are posted in the order things happen and taken whole. A
 * request's final event (DONE or ERROR) is allocated with the request
 * (engine_req_new), so every request submitted gets exactly one final
 * event however short memory runs: running out on the way (text, ids,
 * log-probabilities) fails that request with 503 and the engine lives on.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"
#include "engine/spill.h"

uint64_t engine_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ------------------------------------------------------------------------
 * Requests and events
 * ------------------------------------------------------------------------ */

struct engine_req *engine_req_new(enum engine_req_kind kind)
{
    struct engine_req *r = calloc(1, sizeof(*r));
    if (!r)
        return NULL;
    r->final_ev = calloc(1, sizeof(*r->final_ev));
    if (!r->final_ev) {
        free(r);
        return NULL;
    }
    r->kind = kind;
    r->stop_token = -1;
    atomic_init(&r->cancel, 0);
    atomic_init(&r->paused, false);
    return r;
}

void engine_req_free(struct engine_req *r)
{
    if (!r)
        return;
    free(r->prompt);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->session);
    free(r->list.after);
    free(r->turns);
    free(r->keep);
    free(r->final_ev);
    free(r);
}

struct engine_event *engine_event_new(enum engine_event_kind kind, struct engine_req *req)
{
    struct engine_event *ev = calloc(1, sizeof(*ev));
    if (!ev)
        return NULL;
    ev->kind = kind;
    ev->req = req;
    return ev;
}

void engine_event_free(struct engine_event *ev)
{
    if (!ev)
        return;
    free(ev->text);
    free(ev->tokens);
    free(ev->lp);
    engine_cache_map_free(ev->map);
    engine_session_list_free(ev->list);
    free(ev->logits);
    free(ev);
}

void engine_post(engine *e, struct engine_event *ev)
{
    if (!ev)
        return;
    ev->next = NULL;
    if (e->ev_tail)
        e->ev_tail->next = ev;
    else
        e->ev_head = ev;
    e->ev_tail = ev;
}

struct engine_event *engine_final_event(struct engine_req *req, enum engine_event_kind kind)
{
    struct engine_event *ev = req->final_ev;
    req->final_ev = NULL;
    if (!ev)
        return NULL; /* a second final event: a bug, never posted */
    ev->kind = kind;
    ev->req = req;
    return ev;
}

struct engine_event *engine_req_error(struct engine_req *r, int status, const char *message)
{
    struct engine_event *ev = engine_final_event(r, ENGINE_EV_ERROR);
    if (ev) {
        ev->status = status;
        snprintf(ev->message, sizeof(ev->message), "%s", message);
    }
    return ev;
}

void engine_post_verror(engine *e, struct engine_req *req, int status, const char *fmt, va_list ap)
{
    struct engine_event *ev = engine_final_event(req, ENGINE_EV_ERROR);
    if (!ev)
        return;
    ev->status = status;
    vsnprintf(ev->message, sizeof(ev->message), fmt, ap);
    engine_post(e, ev);
}

void engine_post_error(engine *e, struct engine_req *req, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    engine_post_verror(e, req, status, fmt, ap);
    va_end(ap);
}

void engine_log(const struct engine_hooks *h, enum engine_log_level level, const char *fmt, ...)
{
    if (!h || !h->log)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    h->log(h->ud, level, line);
}

struct engine_event *engine_take_events(engine *e)
{
    struct engine_event *head = e->ev_head;
    e->ev_head = e->ev_tail = NULL;
    return head;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

int engine_check_limits(const struct engine_limits *l, int page_tokens, int max_step_tokens,
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

/* The cache and its check: the pool must hold one sequence at its full
 * budget. 0, or -1 with the reason in err. */
static int create_cache(engine *e, char *err, size_t errlen)
{
    const struct engine_params *p = &e->p;
    struct kv_cache_params cp = {.memory_bytes = p->cache_memory,
                                 .page_tokens = p->page_tokens,
                                 .k_type = p->k_type,
                                 .v_type = p->v_type,
                                 .mlock = p->mlock};
    model_kv_shape(e->m, &cp);
    char warn[512] = "";
    e->cache = kv_cache_create(&cp, warn, sizeof(warn));
    if (!e->cache) {
        snprintf(err, errlen, "%s", warn);
        return -1;
    }
    if (warn[0])
        engine_log(&e->p.hooks, ENGINE_LOG_WARN, "kv cache: %s", warn);
    if (kv_cache_pages(e->cache)->refused)
        engine_log(&e->p.hooks, ENGINE_LOG_WARN,
                   "kv cache: the kernel refused the pool's 2 MiB page advice (transparent huge "
                   "pages off?); 4 KiB pages, decode attention at long context runs slower");
    long need = (long)kv_cache_pages_for(e->cache, &e->lim.policy,
                                         e->lim.policy.max_cache_tokens, e->lim.step_tokens);
    if (kv_cache_n_pages(e->cache) < need) {
        snprintf(err, errlen,
                 "[cache] memory holds %d pages of %d tokens (%zu bytes each); one sequence at "
                 "max_cache_tokens = %d needs %ld pages (%zu bytes)",
                 kv_cache_n_pages(e->cache), p->page_tokens, kv_cache_page_bytes(e->cache),
                 e->lim.policy.max_cache_tokens, need,
                 (size_t)need * kv_cache_page_bytes(e->cache));
        return -1;
    }
    return 0;
}

engine *engine_create(const struct engine_params *p, char *err, size_t errlen)
{
    int max_step = p->max_step_tokens > 0 ? p->max_step_tokens : p->limits.step_tokens;
    if (engine_check_limits(&p->limits, p->page_tokens, max_step, err, errlen) != 0)
        return NULL;
    engine *e = calloc(1, sizeof(*e));
    if (!e)
        goto out_nomem;
    e->p = *p;
    e->p.max_step_tokens = max_step;
    e->lim = p->limits;
    e->m = p->m;
    if (engine_sessions_init(&e->sessions, &e->p.hooks) != 0)
        goto out_nomem;
    struct model_info info;
    model_get_info(e->m, &info);
    e->n_vocab = info.n_vocab;
    e->eog = malloc(sizeof(int32_t) * (size_t)info.n_vocab);
    /* The batch holds at most one entry per running sequence; size it for
     * the most any reload may allow (step_tokens bounds max_running). */
    e->batch_cap = max_step;
    e->batch = calloc((size_t)e->batch_cap, sizeof(*e->batch));
    e->res = calloc((size_t)e->batch_cap, sizeof(*e->res));
    e->batch_runs = calloc((size_t)e->batch_cap, sizeof(*e->batch_runs));
    if (!e->eog || !e->batch || !e->res || !e->batch_runs)
        goto out_nomem;
    for (int32_t t = 0; t < info.n_vocab; t++)
        if (model_is_eog(e->m, t))
            e->eog[e->n_eog++] = t;
    if (create_cache(e, err, errlen) != 0 || engine_prefix_init(e, err, errlen) != 0)
        goto out_free;
    e->ctx = model_ctx_create(e->m, max_step, p->n_threads, err, errlen);
    if (!e->ctx)
        goto out_free;
    if (p->spill_dir && p->spill_dir[0] &&
        engine_spill_init(e, p->spill_dir, p->spill_max_bytes, err, errlen) != 0)
        goto out_free;
    return e;

out_nomem:
    snprintf(err, errlen, "out of memory for the engine");
out_free:
    engine_destroy(e);
    return NULL;
}

void engine_destroy(engine *e)
{
    if (!e)
        return;
    while (e->runs) /* requests still running: their sequences go back */
        engine_run_finish(e, e->runs, ENGINE_FINISH_ABORT, -1);
    engine_sessions_deinit(&e->sessions);
    spill_store_destroy(e->sessions.spill);
    model_ctx_destroy(e->ctx);
    engine_prefix_deinit(e);
    kv_cache_destroy(e->cache);
    for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
        next = ev->next;
        engine_event_free(ev);
    }
    free(e->batch);
    free(e->res);
    free(e->batch_runs);
    free(e->eog);
    free(e);
}

void engine_shutdown(engine *e, const char *why, bool flush_text)
{
    for (struct engine_req *q = e->wait_head, *next; q; q = next) {
        next = q->next;
        q->next = NULL;
        engine_post_error(e, q, 503, "%s", why);
    }
    e->wait_head = e->wait_tail = NULL;
    e->n_waiting = 0;
    while (e->runs) {
        struct run *r = e->runs;
        if (flush_text && !engine_run_flush(e, r))
            continue; /* failed (503) and freed */
        engine_run_finish(e, r, ENGINE_FINISH_ABORT, -1);
    }
}

/* ------------------------------------------------------------------------
 * Requests
 * ------------------------------------------------------------------------ */

static void answer_session_request(engine *e, struct engine_req *r)
{
    struct engine_session *x = engine_sessions_find(&e->sessions, r->session);
    if (x && r->kind == ENGINE_REQ_SESSION_DELETE && x->busy) {
        engine_post_error(e, r, 409, "session '%s' has a request running; retry when it ends",
                          r->session);
        return;
    }
    struct engine_event *ev = engine_final_event(r, ENGINE_EV_DONE);
    if (!ev)
        return;
    /* With [sessions] dir, a session the pool dropped lives on in its file:
     * the husk in the table is not what the routes describe. */
    bool husk = x && e->sessions.spill && kv_seq_dropped(x->seq);
    if (x && !husk)
        engine_session_describe(x, &ev->session);
    else if (r->kind != ENGINE_REQ_SESSION_MAP)
        engine_session_describe_saved(e, r->session, &ev->session);
    if (x && !husk && r->kind == ENGINE_REQ_SESSION_MAP)
        ev->map = engine_cache_map_build(x->seq, e->m, &r->map);
    if (r->kind == ENGINE_REQ_SESSION_DELETE) {
        if (x)
            engine_sessions_remove(&e->sessions, x);
        engine_session_forget_saved(e, r->session);
        if (husk) /* gone from memory and disk alike: still "found" */
            ev->session.found = true;
    }
    engine_post(e, ev);
}

int engine_submit(engine *e, struct engine_req *r)
{
    r->next = NULL;
    switch (r->kind) {
    case ENGINE_REQ_SESSION_INFO:
    case ENGINE_REQ_SESSION_DELETE:
    case ENGINE_REQ_SESSION_MAP:
        answer_session_request(e, r);
        return 0;
    case ENGINE_REQ_SESSION_LIST: {
        struct engine_event *ev = engine_final_event(r, ENGINE_EV_DONE);
        if (ev)
            ev->list = engine_session_list_build(e, &r->list);
        engine_post(e, ev);
        return 0;
    }
    case ENGINE_REQ_COMPLETION:
        if (e->wait_tail)
            e->wait_tail->next = r;
        else
            e->wait_head = r;
        e->wait_tail = r;
        e->n_waiting++;
        return 0;
    }
    return -EINVAL;
}

bool engine_step(engine *e, uint64_t now_ns)
{
    return engine_do_step(e, now_ns);
}

const int32_t *engine_session_tokens(const engine *e, const char *id, int *n)
{
    struct engine_session *x = engine_sessions_find(&e->sessions, id);
    *n = x ? kv_seq_n_tokens(x->seq) : 0;
    return x ? kv_seq_tokens(x->seq) : NULL;
}

void engine_sweep(engine *e, uint64_t now_ms)
{
    engine_sessions_sweep(&e->sessions, now_ms, e->lim.session_idle_ms);
}

/* ------------------------------------------------------------------------
 * Limits and statistics
 * ------------------------------------------------------------------------ */

int engine_set_limits(engine *e, const struct engine_limits *l, char *err, size_t errlen)
{
    if (engine_check_limits(l, e->p.page_tokens, e->p.max_step_tokens, err, errlen) != 0)
        return -EINVAL;
    e->lim = *l;
    /* Every session follows the new policy from its next eviction. */
    engine_sessions_set_policy(&e->sessions, &l->policy);
    for (struct run *r = e->runs; r; r = r->next)
        if (!r->sess)
            kv_seq_set_policy(r->seq, &l->policy);
    engine_log(&e->p.hooks, ENGINE_LOG_INFO,
               "engine: new limits applied (max_running %d, step_tokens %d, step_budget %" PRIu64
               " ms)",
               l->max_running, l->step_tokens, l->step_budget_ms);
    return 0;
}

void engine_get_stats(const engine *e, struct engine_stats *st)
{
    *st = (struct engine_stats){
        .waiting = e->n_waiting, .running = e->n_running, .sessions = e->sessions.n};
    kv_cache_stats(e->cache, &st->kv);
    st->kv_page_bytes = kv_cache_page_bytes(e->cache);
    engine_prefix_stats(e, st);
    st->spill = e->sessions.spill_stats;
}

const kv_cache *engine_cache(const engine *e)
{
    return e->cache;
}
