/*
 * api_calls.c - accepted requests ("calls") from their decoding to their
 * last event: the prompt prepared (api_prepare.c), the request handed to
 * the engine, the connection's departure and backpressure relayed to it.
 *
 * A call is owned by the loop thread. Once submitted it sits on the API's
 * list until its final event (srv_api_pump -> srv_call_end); its request
 * belongs to the engine in between (see struct engine_req).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"
#include "server/log.h"

/* ------------------------------------------------------------------------
 * A call's life
 * ------------------------------------------------------------------------ */

static void call_gone(void *owner)
{
    struct call *call = owner;
    call->conn = NULL;
    if (call->req)
        atomic_store(&call->req->cancel, ENGINE_CANCEL_CLIENT);
}

void srv_call_out_of_memory(struct call *call)
{
    call->return_tokens = false;
    if (call->req)
        atomic_store(&call->req->cancel, ENGINE_CANCEL_CLIENT);
    if (call->conn) {
        srv_conn *c = call->conn;
        call->conn = NULL;
        srv_api_error(c, 500, NULL, "out_of_memory", NULL, "out of memory assembling the answer");
    }
}

/* Backpressure from the connection: a reader that is behind pauses its
 * request's generation (the engine keeps its slot and cache). */
static void call_pressure(void *owner, bool pause)
{
    struct call *call = owner;
    if (!call->req)
        return;
    atomic_store(&call->req->paused, pause);
    if (!pause)
        srv_sched_wake(call->a->sched);
}

static struct call *call_new(srv_api *a, srv_conn *c, enum call_kind kind)
{
    struct call *call = calloc(1, sizeof(*call));
    if (!call)
        return NULL;
    call->a = a;
    call->conn = c;
    call->kind = kind;
    call->created = (int64_t)time(NULL);
    uint64_t x = srv_api_next_seed(a);
    snprintf(call->id, sizeof(call->id), "%s-%016" PRIx64 "%08" PRIx64,
             kind == CALL_CHAT ? "chatcmpl" : "cmpl", x, ++a->next_id);
    return call;
}

void srv_call_free(struct call *call)
{
    engine_req_free(call->req);
    for (int i = 0; call->ch && i < call->n_choices; i++) {
        free(call->ch[i].text);
        srv_lp_buf_free(call->ch[i].lp);
    }
    free(call->ch);
    free(call->toks);
    json_decref(call->settings);
    free(call);
}

/* Queue the call's request; answers the error itself on refusal. */
static void call_submit(srv_api *a, struct call *call)
{
    call->req->owner = call;
    call->req->id = a->next_id;
    int rc = srv_sched_submit(a->sched, call->req);
    if (rc == -EAGAIN) {
        srv_api_error(call->conn, 429, NULL, "queue_full", "Retry-After: 1\r\n",
                      "the request queue is full (%d waiting); retry later",
                      srv_sched_queue_depth(a->sched));
        srv_call_free(call);
        return;
    }
    if (rc < 0) {
        srv_api_error(call->conn, 503, NULL, NULL, NULL, "the server is shutting down");
        srv_call_free(call);
        return;
    }
    srv_conn_set_owner(call->conn, call, call_gone, call_pressure);
    call->next = a->calls;
    if (a->calls)
        a->calls->prev = call;
    a->calls = call;
    a->in_flight++;
}

void srv_call_end(srv_api *a, struct call *call)
{
    if (call->conn)
        srv_conn_set_owner(call->conn, NULL, NULL, NULL);
    if (call->prev)
        call->prev->next = call->next;
    else
        a->calls = call->next;
    if (call->next)
        call->next->prev = call->prev;
    a->in_flight--;
    srv_call_free(call);
}

static void answer_oom(srv_conn *c)
{
    srv_api_error(c, 503, NULL, "out_of_memory", "Retry-After: 1\r\n",
                  "out of memory accepting the request; retry later");
}

/* ------------------------------------------------------------------------
 * Completions: prepare, then submit
 * ------------------------------------------------------------------------ */

static const enum call_kind kind_of_shape[] = {
    [SRV_SHAPE_OPENAI] = CALL_OPENAI,
    [SRV_SHAPE_LLAMA] = CALL_LLAMA,
    [SRV_SHAPE_CHAT] = CALL_CHAT,
};

/* A completion whose prompt is being prepared off the loop thread. */
struct prep_job {
    struct srv_api_job job;
    struct call *call;          /* not yet submitted: call->req is NULL */
    struct srv_completion comp; /* the decoded request (the worker's meanwhile) */
    struct srv_prepare_ctx ctx; /* what the worker reads besides comp */
    int before;                 /* chat session: messages its prompts left out */
    bool fallback_logged;       /* chat session: its fallback to rendering was logged */
    struct srv_prepare_fit fit; /* out */
    struct srv_api_error e;     /* out */
    int rc;                     /* out: srv_prepare's */
};

static void prep_run(struct srv_api_job *j)
{
    struct prep_job *p = (struct prep_job *)j;
    p->rc = srv_prepare(&p->ctx, &p->comp, &p->fit, &p->e);
}

/*
 * What preparing a chat decided, recorded on the loop thread: the session
 * table (turns left out; its fallback logged once), the metrics, the
 * answer's usage.kvd fields. Returns 0, or -1 (e) when memory runs out.
 */
static int record_fit(srv_api *a, struct prep_job *p, struct call *call, struct srv_api_error *e)
{
    const struct srv_prepare_fit *f = &p->fit;
    const char *sess = p->comp.req->session;
    call->turn_eviction = f->turn_eviction;
    call->cut_tokens = f->cut_tokens;
    snprintf(call->turn_fallback, sizeof(call->turn_fallback), "%s", f->turn_fallback);
    if (f->turn_fallback[0]) {
        srv_metrics_turn_fallback(a->metrics);
        if (!p->fallback_logged)
            srv_log(SRV_LOG_WARN,
                    "chat session '%s': turns are rendered again, not evicted in place: %s", sess,
                    f->turn_fallback);
    }
    if (f->cut_tokens)
        srv_log(SRV_LOG_INFO,
                "chat request: the last user message is larger than the window; %d tokens cut "
                "from its middle (its header and the system prompt kept)",
                f->cut_tokens);
    if (!f->fitted && !f->in_place)
        return 0;
    call->evicted_messages = f->dropped_messages;
    if (f->in_place ? !p->ctx.sess_known : f->dropped_turns > p->ctx.min_drop || !sess)
        srv_metrics_evicted_messages(
            a->metrics, false,
            (uint64_t)(f->dropped_messages - (sess && !f->in_place ? p->before : 0)));
    if (sess && srv_chat_sess_set(a, sess, f->dropped_turns, f->dropped_messages))
        return srv_oom(e, "recording the chat session");
    if (sess && f->turn_fallback[0])
        srv_chat_sess_fallback_logged(a, sess);
    return 0;
}

/* Back on the loop thread: record what fitting the chat decided, then
 * submit (or answer the refusal). */
static void prep_done(struct srv_api_job *j)
{
    struct prep_job *p = (struct prep_job *)j;
    srv_api *a = j->a;
    struct call *call = p->call;
    struct srv_completion *c = &p->comp;
    call->conn = j->conn;
    if (p->rc == 0)
        p->rc = record_fit(a, p, call, &p->e);
    call->req = c->req;
    c->req = NULL;
    srv_completion_clear(c);
    if (!call->conn) { /* the client left meanwhile */
        srv_call_free(call);
    } else if (p->rc) {
        srv_api_error_from(call->conn, &p->e);
        srv_call_free(call);
    } else if (a->draining) { /* started before the drain; the engine takes no more */
        srv_api_error(call->conn, 503, NULL, NULL, NULL, "the server is shutting down");
        srv_call_free(call);
    } else {
        call_submit(a, call);
    }
    free(p);
}

void srv_call_start(srv_api *a, srv_conn *conn, struct srv_completion *c)
{
    struct prep_job *p = calloc(1, sizeof(*p));
    struct call *call = p ? call_new(a, conn, kind_of_shape[c->shape]) : NULL;
    int n = c->req->n_choices > 1 ? c->req->n_choices : 1;
    if (call && !(call->ch = calloc((size_t)n, sizeof(*call->ch)))) {
        srv_call_free(call);
        call = NULL;
    }
    if (!call) {
        free(p);
        srv_completion_clear(c);
        answer_oom(conn);
        return;
    }
    call->n_choices = n;
    for (int i = 0; i < n; i++) /* what max_tokens 0 ends with before any choice forks */
        call->ch[i].finish = ENGINE_FINISH_LENGTH;
    call->stream = c->stream;
    call->include_usage = c->include_usage;
    call->return_tokens = c->return_tokens;
    call->logprobs = c->logprobs;
    call->id_tokens = c->id_tokens;
    call->settings = c->settings;
    c->settings = NULL;
    p->call = call;
    p->comp = *c; /* the request moves into the job */
    memset(c, 0, sizeof(*c));
    p->ctx = (struct srv_prepare_ctx){.m = a->m, .chat = a->chat, .eot_token = a->eot_token};
    srv_api_limits(a, &p->ctx.lim);
    const struct chat_sess *x = p->comp.shape == SRV_SHAPE_CHAT && a->p.chat_turns
                                    ? srv_chat_sess_get(a, p->comp.req->session)
                                    : NULL;
    if (x) {
        p->ctx.sess_known = true;
        p->ctx.min_drop = x->dropped_turns;
        p->before = x->dropped_messages;
        p->fallback_logged = x->fallback_logged;
    }
    p->job.run = prep_run;
    p->job.done = prep_done;
    srv_api_job_start(a, conn, &p->job);
}

void srv_call_session(srv_api *a, srv_conn *conn, const char *id, enum call_kind kind,
                      const struct engine_map_opts *map)
{
    bool del = kind == CALL_SESSION_DELETE;
    struct call *call = call_new(a, conn, kind);
    if (call)
        call->req = engine_req_new(del                        ? ENGINE_REQ_SESSION_DELETE
                                   : kind == CALL_SESSION_MAP ? ENGINE_REQ_SESSION_MAP
                                                              : ENGINE_REQ_SESSION_INFO);
    if (call && call->req) {
        call->req->session = strdup(id);
        if (map)
            call->req->map = *map;
    }
    if (call && call->req && call->req->session && del)
        srv_chat_sess_forget(a, id);
    if (!call || !call->req || !call->req->session) {
        if (call)
            srv_call_free(call);
        answer_oom(conn);
        return;
    }
    call_submit(a, call);
}

void srv_call_sessions(srv_api *a, srv_conn *conn, struct engine_list_opts *list)
{
    struct call *call = call_new(a, conn, CALL_SESSION_LIST);
    if (call)
        call->req = engine_req_new(ENGINE_REQ_SESSION_LIST);
    if (!call || !call->req) {
        if (call)
            srv_call_free(call);
        free(list->after);
        list->after = NULL;
        answer_oom(conn);
        return;
    }
    call->req->list = *list;
    list->after = NULL;
    call_submit(a, call);
}
