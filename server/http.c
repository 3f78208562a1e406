/*
 * http.c - HTTP/1.1 connections on the libuv loop: accepted, read, fed
 * to the request parser (http_request.c), timed, written to, closed. The
 * layer's lifecycle is in http_listen.c, answers in http_respond.c
 * (http_internal.h has the map).
 *
 * Everything here runs on the loop thread, which owns every handle and
 * parser. A connection reads continuously (so a client that leaves is
 * noticed at once, even mid-request) but parses one request at a time: when
 * llhttp completes a message the parser is paused, the bytes after it
 * (pipelined requests) wait in `pending`, and the handler runs. When the
 * handler's answer is complete the parser resumes on the pending bytes.
 * So pipelined requests are answered in order, and a request's answer may
 * arrive later (from the engine's events) without blocking the loop.
 *
 * Limits, each answered with an OpenAI-shaped JSON error:
 *   request line + headers over max_header_bytes, or more than max_headers
 *   headers: 431 (414 for the URL alone); body over max_body_bytes (by
 *   Content-Length or while reading a chunked body): 413; no complete
 *   headers within header_timeout, a body not complete within
 *   body_timeout of its headers, or a body stalled for idle_timeout: 408;
 *   a Transfer-Encoding other than `chunked` alone: 501; CONNECT: 405;
 *   a keep-alive connection idle for idle_timeout is closed quietly.
 *   Malformed HTTP: 400.
 * After an error the connection is closed gracefully (FIN after the
 * answer, further input discarded for a moment) so the client can read
 * the status before the socket goes away.
 *
 * Connection slots: when max_connections are open, a new connection takes
 * the slot of the connection that has been idle (between requests, nothing
 * queued) the longest; only when none is idle does it get 503. The slots
 * are also capped by the open-files limit (conn_cap), so the shedding
 * happens before accept() finds no descriptor left.
 *
 * Slow readers. An answer is judged by what the reader leaves untaken over
 * time, never by its size: while bytes wait in a connection's write queue,
 * the reader must take at least min(what waited, WRITE_MIN_PROGRESS) in
 * every idle_timeout, or it is closed and counted (a prompt reader of a
 * 200 MiB answer is never cut; one that stops reading is). A stream also
 * applies backpressure: once more than write_buffer bytes wait, the
 * request's owner is told to pause producing (srv_conn_set_owner's
 * on_pressure), and told to resume when the queue has drained to half.
 * max_write_queue stays as a hard cap for a stream whose producer does not
 * pause.
 *
 * Handles are freed only in their close callbacks.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "server/errors.h"
#include "server/http_internal.h"
#include "server/log.h"

static void conn_fail(srv_conn *c, int status, const char *msg);
static void conn_process(srv_conn *c);
static void idle_arm(srv_conn *c);
static void body_timer_arm(srv_conn *c);

/* ------------------------------------------------------------------------
 * Timers
 * ------------------------------------------------------------------------ */

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

static void on_timer(uv_timer_t *t)
{
    srv_conn *c = t->data;
    enum timer_kind k = c->timer_kind;
    c->timer_kind = TIMER_NONE;
    switch (k) {
    case TIMER_IDLE:
        /* Idle for reading, but an answer is still going out: the write
         * check judges the reader, so wait another period. */
        if (c->n_writes > 0 && c->state == CONN_READING && !c->in_message) {
            srv_conn_timer_arm(c, TIMER_IDLE, c->h->p.idle_timeout_ms);
            break;
        }
        srv_conn_close(c);
        break;
    case TIMER_LINGER:
        srv_conn_close(c);
        break;
    case TIMER_HEADER:
        conn_fail(c, 408, "the request headers did not arrive in time");
        break;
    case TIMER_BODY:
        if (uv_now(c->h->loop) >= c->body_deadline) {
            srv_metrics_conn(c->h->metrics, SRV_CONN_BODY_TIMEOUT);
            conn_fail(c, 408, "the request body did not arrive within body_timeout");
        } else {
            conn_fail(c, 408, "the request body stalled");
        }
        break;
    case TIMER_NONE:
        break;
    }
}

void srv_conn_timer_arm(srv_conn *c, enum timer_kind k, uint64_t ms)
{
    if (c->state == CONN_CLOSING)
        return;
    c->timer_kind = k;
    int rc = uv_timer_start(&c->timer, on_timer, ms ? ms : 1, 0);
    if (rc < 0)
        srv_log(SRV_LOG_ERROR, "http: uv_timer_start: %s", uv_strerror(rc));
}

static void timer_stop(srv_conn *c)
{
    c->timer_kind = TIMER_NONE;
    if (c->state != CONN_CLOSING)
        uv_timer_stop(&c->timer);
}

/* The body timer: the next read within idle_timeout, the whole body by
 * body_deadline, whichever comes first. */
static void body_timer_arm(srv_conn *c)
{
    uint64_t now = uv_now(c->h->loop);
    uint64_t left = c->body_deadline > now ? c->body_deadline - now : 0;
    srv_conn_timer_arm(c, TIMER_BODY, min_u64(c->h->p.idle_timeout_ms, left));
}

/* ------------------------------------------------------------------------
 * Writing
 * ------------------------------------------------------------------------ */

static void on_close_handle(uv_handle_t *hd);

/* Bytes handed to uv_write that the reader has not taken yet. */
static size_t write_waiting(srv_conn *c)
{
    return uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp);
}

static void pressure(srv_conn *c, bool pause)
{
    if (c->pressured == pause)
        return;
    c->pressured = pause;
    if (c->on_pressure)
        c->on_pressure(c->owner, pause);
}

/* A reader that takes too little is closed and counted. */
static void close_slow_reader(srv_conn *c, const char *why)
{
    srv_log(SRV_LOG_WARN, "http: closing a connection that does not read its answer (%s)", why);
    srv_metrics_conn(c->h->metrics, SRV_CONN_SLOW_READER);
    srv_conn_close(c);
}

static void write_check_arm(srv_conn *c);

/* The slow-reader check, once per idle_timeout while bytes wait. */
static void on_write_check(uv_timer_t *t)
{
    srv_conn *c = t->data;
    if (c->state == CONN_CLOSING)
        return;
    size_t waiting = write_waiting(c);
    uint64_t taken = c->queued_total - waiting;
    uint64_t need = min_u64(c->waiting_mark, WRITE_MIN_PROGRESS);
    if (waiting > 0 && taken - c->taken_mark < need) {
        close_slow_reader(c, "too little taken within idle_timeout");
        return;
    }
    write_check_arm(c);
}

/* Start a check period from what waits now (or stop when nothing does). */
static void write_check_arm(srv_conn *c)
{
    size_t waiting = write_waiting(c);
    if (waiting == 0 || c->state == CONN_CLOSING) {
        if (c->state != CONN_CLOSING)
            uv_timer_stop(&c->wtimer);
        return;
    }
    c->taken_mark = c->queued_total - waiting;
    c->waiting_mark = waiting;
    int rc = uv_timer_start(&c->wtimer, on_write_check, c->h->p.idle_timeout_ms, 0);
    if (rc < 0)
        srv_log(SRV_LOG_ERROR, "http: uv_timer_start: %s", uv_strerror(rc));
}

static void on_write(uv_write_t *w, int status)
{
    struct wreq *wr = (struct wreq *)w;
    srv_conn *c = wr->c;
    bool then_close = wr->then_close;
    free(wr);
    c->n_writes--;
    if (c->state == CONN_CLOSING)
        return;
    if (status < 0 || (c->flush_close && c->n_writes == 0)) {
        srv_conn_close(c);
        return;
    }
    if (c->n_writes == 0)
        uv_timer_stop(&c->wtimer);
    if (c->pressured && write_waiting(c) <= c->h->p.write_buffer / 2)
        pressure(c, false);
    if (then_close && c->state == CONN_LINGER) {
        /* Answer sent: FIN our side, discard input for a moment. */
        int rc = uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, NULL);
        if (rc < 0) {
            srv_conn_close(c);
            return;
        }
        srv_conn_timer_arm(c, TIMER_LINGER, LINGER_MS);
    }
}

/* Queue bytes (copied). Returns 0 or -EPIPE. */
int srv_conn_write(srv_conn *c, const char *a, size_t alen, const char *b, size_t blen,
                      bool then_close)
{
    if (c->state == CONN_CLOSING)
        return -EPIPE;
    struct wreq *wr = malloc(sizeof(*wr) + alen + blen);
    if (!wr) {
        srv_conn_close(c);
        return -EPIPE;
    }
    wr->c = c;
    wr->then_close = then_close;
    memcpy(wr->data, a, alen);
    if (blen)
        memcpy(wr->data + alen, b, blen);
    uv_buf_t buf = uv_buf_init(wr->data, (unsigned)(alen + blen));
    int rc = uv_write(&wr->w, (uv_stream_t *)&c->tcp, &buf, 1, on_write);
    if (rc < 0) {
        free(wr);
        srv_conn_close(c);
        return -EPIPE;
    }
    c->n_writes++;
    c->queued_total += alen + blen;
    if (write_waiting(c) > 0 && !uv_is_active((uv_handle_t *)&c->wtimer))
        write_check_arm(c);
    return 0;
}

/* A stream's piece is queued: past write_buffer the producer pauses; past
 * max_write_queue (a producer that does not pause) the reader is cut. */
int srv_conn_stream_judge(srv_conn *c)
{
    size_t waiting = write_waiting(c);
    if (waiting > c->h->p.max_write_queue) {
        close_slow_reader(c, "max_write_queue reached");
        return -EPIPE;
    }
    if (waiting > c->h->p.write_buffer)
        pressure(c, true);
    return 0;
}

/* ------------------------------------------------------------------------
 * Parsing
 * ------------------------------------------------------------------------ */

/* Hand the complete request to the handler. */
static void dispatch(srv_conn *c)
{
    timer_stop(c);
    c->state = CONN_HANDLING;
    struct srv_http_header hv[c->n_hdrs > 0 ? c->n_hdrs : 1];
    struct srv_http_req req;
    srv_http_request_view(c, hv, &req);
    c->h->handler(c->h->ud, c, &req);
}

/* What the parser asked for while llhttp ran: the header or body timer,
 * and "100 Continue" (before any answer to the request). */
static void parse_effects(srv_conn *c)
{
    enum timer_kind k = c->timer_want;
    c->timer_want = TIMER_NONE;
    if (c->send_continue) {
        static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
        c->send_continue = false;
        srv_conn_write(c, cont, sizeof(cont) - 1, NULL, 0, false);
    }
    if (k == TIMER_HEADER)
        srv_conn_timer_arm(c, TIMER_HEADER, c->h->p.header_timeout_ms);
    else if (k == TIMER_BODY)
        body_timer_arm(c);
}

/* Parse what is pending, dispatching each complete request in turn. */
static void conn_process(srv_conn *c)
{
    if (c->in_process)
        return;
    c->in_process = true;
    while (c->state == CONN_READING && c->pending_len > 0) {
        char *buf = c->pending;
        size_t len = c->pending_len;
        c->pending = NULL;
        c->pending_len = c->pending_cap = 0;
        llhttp_errno_t e = llhttp_execute(&c->parser, buf, len);
        parse_effects(c);
        if (e == HPE_OK) {
            free(buf);
            continue;
        }
        if (e == HPE_PAUSED) {
            /* One request is complete; keep the rest for later. */
            size_t off = (size_t)(llhttp_get_error_pos(&c->parser) - buf);
            if (off < len) {
                memmove(buf, buf + off, len - off);
                c->pending = buf;
                c->pending_len = len - off;
                c->pending_cap = len;
            } else {
                free(buf);
            }
            dispatch(c);
            continue;
        }
        free(buf);
        if (c->err_status)
            conn_fail(c, c->err_status, c->err_msg);
        else
            conn_fail(c, 400,
                      llhttp_get_error_reason(&c->parser) ? llhttp_get_error_reason(&c->parser)
                                                          : "malformed HTTP request");
        break;
    }
    if (c->state == CONN_READING && !c->in_message && c->timer_kind == TIMER_NONE)
        idle_arm(c);
    c->in_process = false;
}

/* ------------------------------------------------------------------------
 * Connections
 * ------------------------------------------------------------------------ */

static void conn_free(srv_conn *c)
{
    srv_http *h = c->h;
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->n_conns--;
    h->n_closing--;
    srv_http_request_reset(c);
    free(c->hdrs);
    free(c->url);
    free(c->body);
    free(c->pending);
    free(c);
    if (h->closing && h->n_conns == 0 && !h->listener_open && h->done) {
        void (*done)(void *) = h->done;
        h->done = NULL;
        done(h->done_ud);
    }
}

static void on_close_handle(uv_handle_t *hd)
{
    srv_conn *c = hd->data;
    if (--c->handles_open == 0)
        conn_free(c);
}

void srv_conn_close(srv_conn *c)
{
    if (c->state == CONN_CLOSING)
        return;
    c->state = CONN_CLOSING;
    c->h->n_closing++;
    if (c->on_gone) {
        void (*gone)(void *) = c->on_gone;
        void *owner = c->owner;
        c->on_gone = NULL;
        c->owner = NULL;
        gone(owner);
    }
    uv_timer_stop(&c->timer);
    uv_timer_stop(&c->wtimer);
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_close((uv_handle_t *)&c->tcp, on_close_handle);
    uv_close((uv_handle_t *)&c->timer, on_close_handle);
    uv_close((uv_handle_t *)&c->wtimer, on_close_handle);
}

/* Answer an error from the HTTP layer itself and close. */
static void conn_fail(srv_conn *c, int status, const char *msg)
{
    if (c->state == CONN_CLOSING || c->state == CONN_LINGER)
        return;
    if (c->state == CONN_STREAMING) {
        srv_conn_close(c);
        return;
    }
    if (c->state == CONN_HANDLING) {
        /* The handler owns the request; it learns the client is gone. */
        srv_conn_close(c);
        return;
    }
    c->close_after = true;
    size_t blen = 0;
    char *body = srv_error_json(status, msg, NULL, NULL, &blen);
    char head[512];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nServer: kvd\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, srv_http_status_text(status), blen);
    srv_metrics_status(c->h->metrics, status);
    srv_log(SRV_LOG_DEBUG, "http: %d %s", status, msg);
    c->state = CONN_LINGER;
    timer_stop(c);
    free(c->pending);
    c->pending = NULL;
    c->pending_len = c->pending_cap = 0;
    srv_conn_write(c, head, (size_t)n, body ? body : "", body ? blen : 0, true);
    free(body);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    (void)hd;
    (void)suggested;
    char *p = malloc(READ_CHUNK);
    *buf = uv_buf_init(p, p ? READ_CHUNK : 0);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    srv_conn *c = st->data;
    if (nread < 0) {
        free(buf->base);
        srv_conn_close(c);
        return;
    }
    if (nread == 0 || c->state == CONN_CLOSING || c->state == CONN_LINGER) {
        free(buf->base);
        return;
    }
    if (c->headers_done && c->state == CONN_READING && c->in_message)
        body_timer_arm(c);
    if (!c->pending) {
        c->pending = buf->base;
        c->pending_len = (size_t)nread;
        c->pending_cap = READ_CHUNK;
    } else {
        srv_http_buf_append(&c->pending, &c->pending_len, &c->pending_cap, buf->base, (size_t)nread);
        free(buf->base);
    }
    /* A client that piles up input while its answer is pending is read no
     * further until the answer is done (its disconnect is then noticed at
     * the next write). */
    size_t cap = c->h->p.max_header_bytes + c->h->p.max_body_bytes + READ_CHUNK;
    if (c->state != CONN_READING && c->pending_len > cap && c->reading) {
        int rc = uv_read_stop((uv_stream_t *)&c->tcp);
        if (rc < 0)
            srv_log(SRV_LOG_WARN, "http: uv_read_stop: %s", uv_strerror(rc));
        c->reading = false;
    }
    if (c->state == CONN_READING)
        conn_process(c);
}

static void start_reading(srv_conn *c)
{
    if (c->reading || c->state == CONN_CLOSING)
        return;
    int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (rc < 0) {
        srv_log(SRV_LOG_ERROR, "http: uv_read_start: %s", uv_strerror(rc));
        srv_conn_close(c);
        return;
    }
    c->reading = true;
}

/* The answer to the current request is complete. */
void srv_conn_response_done(srv_conn *c)
{
    c->owner = NULL;
    c->on_gone = NULL;
    c->on_pressure = NULL;
    if (c->close_after) {
        c->state = CONN_LINGER;
        return;
    }
    c->state = CONN_READING;
    srv_http_request_reset(c);
    llhttp_resume(&c->parser);
    start_reading(c);
    conn_process(c);
}

/* A connection waiting for its next request, with nothing queued. */
static bool conn_idle(const srv_conn *c)
{
    return c->state == CONN_READING && !c->in_message && c->pending_len == 0 && c->n_writes == 0;
}

/*
 * Close the connection idle the longest to make room for a new one
 * (`except` is the newcomer). Returns whether one was closed. O(open
 * connections), and only when the slots or the descriptors are full.
 */
static bool shed_idle(srv_http *h, const srv_conn *except)
{
    srv_conn *victim = NULL;
    for (srv_conn *c = h->conns; c; c = c->next)
        if (c != except && conn_idle(c) && (!victim || c->idle_since < victim->idle_since))
            victim = c;
    if (!victim)
        return false;
    srv_metrics_conn(h->metrics, SRV_CONN_SHED_IDLE);
    srv_conn_close(victim);
    return true;
}

/* Idle from now: the keep-alive timer, and the age shedding goes by. */
static void idle_arm(srv_conn *c)
{
    c->idle_since = uv_now(c->h->loop);
    srv_conn_timer_arm(c, TIMER_IDLE, c->h->p.idle_timeout_ms);
}

/* A connection object with its handles initialised and linked into h's
 * list (the socket still closed). NULL when out of memory. */
srv_conn *srv_conn_new(srv_http *h)
{
    srv_conn *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->h = h;
    /* None of these can fail for a valid loop (they create no socket). */
    if (uv_tcp_init(h->loop, &c->tcp) || uv_timer_init(h->loop, &c->timer) ||
        uv_timer_init(h->loop, &c->wtimer)) {
        fprintf(stderr, "kvd: uv handle init failed\n");
        abort();
    }
    c->tcp.data = c->timer.data = c->wtimer.data = c;
    c->handles_open = 3;
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    return c;
}

/*
 * Connections that fit: max_connections, and no more than the open-files
 * limit leaves after FD_RESERVE descriptors for the daemon itself. So a
 * full house sheds an idle connection for a newcomer before accept() can
 * fail with EMFILE (libuv then accepts and closes newcomers itself, and
 * the server could answer nobody until an idle timeout freed a
 * descriptor). The limit is read at each accept: it may be changed under
 * a running process (prlimit).
 */
static int conn_cap(const srv_http *h)
{
    int cap = h->p.max_connections;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur < (rlim_t)cap + FD_RESERVE)
        cap = rl.rlim_cur > FD_RESERVE + 1 ? (int)(rl.rlim_cur - FD_RESERVE) : 1;
    return cap;
}

/* The socket is open: start parsing, or refuse when every slot is busy. */
void srv_conn_start(srv_conn *c)
{
    srv_http *h = c->h;
    int rc = uv_tcp_nodelay(&c->tcp, 1); /* tokens go out as they come */
    if (rc < 0)
        srv_log(SRV_LOG_DEBUG, "http: uv_tcp_nodelay: %s", uv_strerror(rc));
    llhttp_init(&c->parser, HTTP_REQUEST, &h->settings);
    c->parser.data = c;
    c->state = CONN_READING;
    start_reading(c);
    if (h->n_conns - h->n_closing > conn_cap(h) && !shed_idle(h, c)) {
        conn_fail(c, 503, "too many open connections; retry later");
        return;
    }
    idle_arm(c);
}

void srv_http_on_connection(uv_stream_t *server, int status)
{
    srv_http *h = server->data;
    if (status < 0) {
        /* Out of descriptors: libuv has closed the waiting connection;
         * give an idle one's descriptor back so the next accept works. */
        bool shed = (status == UV_EMFILE || status == UV_ENFILE) && shed_idle(h, NULL);
        srv_metrics_conn(h->metrics, SRV_CONN_ACCEPT_FAILED);
        srv_log(SRV_LOG_WARN, "http: accept: %s%s", uv_strerror(status),
                shed ? " (closed the longest idle connection)" : "");
        return;
    }
    srv_conn *c = srv_conn_new(h);
    if (!c)
        return;
    int rc = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (rc < 0) {
        srv_log(SRV_LOG_WARN, "http: uv_accept: %s", uv_strerror(rc));
        srv_conn_close(c);
        return;
    }
    srv_conn_start(c);
}
