/*
 * http.c - HTTP/1.1 connections on the libuv loop: accept, parse with
 * llhttp, enforce limits and timeouts, write responses and streams.
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
#include <strings.h>
#include <sys/resource.h>

#include <llhttp.h>
#include <uv.h>

#include "server/errors.h"
#include "server/http.h"
#include "server/log.h"

#define READ_CHUNK 65536
#define LINGER_MS 2000
/* Descriptors kept for the daemon's own use (listener, loop, model, log,
 * signals, spill files) when the open-files limit caps connections. */
#define FD_RESERVE 24
/* A reader with bytes waiting must take at least this much (or all that
 * waited) in every idle_timeout. */
#define WRITE_MIN_PROGRESS 65536

enum conn_state {
    CONN_READING,   /* reading (and parsing) a request */
    CONN_HANDLING,  /* the handler owns the request; no answer sent yet */
    CONN_STREAMING, /* a streamed answer is being sent */
    CONN_LINGER,    /* answered with close: output shut down, input discarded */
    CONN_CLOSING,   /* uv_close issued */
};

enum timer_kind { TIMER_NONE, TIMER_IDLE, TIMER_HEADER, TIMER_BODY, TIMER_LINGER };

struct hdr {
    char *name, *value;
    size_t nlen, vlen;
};

struct srv_conn {
    uv_tcp_t tcp;
    uv_timer_t timer;  /* idle, header, body and linger deadlines */
    uv_timer_t wtimer; /* the slow-reader check, while bytes wait to be sent */
    uv_shutdown_t shutdown_req;
    int handles_open;
    srv_http *h;
    llhttp_t parser;
    struct srv_conn *prev, *next;
    enum conn_state state;
    enum timer_kind timer_kind;

    /* the request being read */
    bool in_message;
    bool headers_done;
    bool last_was_value;
    int err_status; /* set by a callback that rejects the request */
    const char *err_msg;
    char *url;
    size_t url_len, url_cap;
    struct hdr *hdrs;
    int n_hdrs, hdr_cap;
    size_t header_bytes;
    char *body;
    size_t body_len, body_cap;
    bool keep_alive;
    int http_minor;
    bool head_only;         /* HEAD: the answer's head without its body */
    uint64_t body_deadline; /* uv_now() by which the body must be complete */
    uint64_t idle_since;    /* uv_now() when it last became idle (for shedding) */

    /* bytes received but not parsed yet */
    char *pending;
    size_t pending_len, pending_cap;
    bool in_process;
    bool reading;

    /* the answer */
    int n_writes;          /* uv_write requests in flight */
    uint64_t queued_total; /* bytes ever handed to uv_write */
    uint64_t taken_mark;   /* bytes taken by the reader at the last check */
    uint64_t waiting_mark; /* bytes waiting at the last check */
    bool pressured;        /* on_pressure(owner, true) was the last call */
    bool flush_close; /* close once n_writes reaches 0 (server closing) */
    bool chunked;
    bool close_after;
    void *owner;
    void (*on_gone)(void *owner);
    void (*on_pressure)(void *owner, bool pause);
};

struct srv_http {
    uv_loop_t *loop;
    uv_tcp_t listener;
    bool listener_open;
    struct srv_http_params p;
    srv_metrics *metrics;
    srv_http_handler handler;
    void *ud;
    llhttp_settings_t settings;
    srv_conn *conns;
    int n_conns;   /* allocated (closing ones until their close callbacks) */
    int n_closing; /* of those, closing */
    bool draining, closing;
    void (*done)(void *ud);
    void *done_ud;
};

struct wreq {
    uv_write_t w;
    srv_conn *c;
    bool then_close;
    char data[];
};

static void conn_close(srv_conn *c);
static void conn_process(srv_conn *c);
static void conn_fail(srv_conn *c, int status, const char *msg);
static void timer_arm(srv_conn *c, enum timer_kind k, uint64_t ms);
static void idle_arm(srv_conn *c);

static void *xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "kvd: out of memory (%zu bytes)\n", n);
        abort();
    }
    return q;
}

/* Append to a growing buffer (kept NUL-terminated). */
static void buf_append(char **p, size_t *len, size_t *cap, const char *data, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        *p = xrealloc(*p, c);
        *cap = c;
    }
    memcpy(*p + *len, data, n);
    *len += n;
    (*p)[*len] = '\0';
}

static const char *status_text(int status)
{
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 304:
        return "Not Modified";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 414:
        return "URI Too Long";
    case 415:
        return "Unsupported Media Type";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 503:
        return "Service Unavailable";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Unknown";
    }
}

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
            timer_arm(c, TIMER_IDLE, c->h->p.idle_timeout_ms);
            break;
        }
        conn_close(c);
        break;
    case TIMER_LINGER:
        conn_close(c);
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

static void timer_arm(srv_conn *c, enum timer_kind k, uint64_t ms)
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
    conn_close(c);
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
        conn_close(c);
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
            conn_close(c);
            return;
        }
        timer_arm(c, TIMER_LINGER, LINGER_MS);
    }
}

/* Queue bytes (copied). Returns 0 or -EPIPE. */
static int conn_write(srv_conn *c, const char *a, size_t alen, const char *b, size_t blen,
                      bool then_close)
{
    if (c->state == CONN_CLOSING)
        return -EPIPE;
    struct wreq *wr = malloc(sizeof(*wr) + alen + blen);
    if (!wr) {
        conn_close(c);
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
        conn_close(c);
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
static int stream_judge(srv_conn *c)
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
 * Request state
 * ------------------------------------------------------------------------ */

static void request_reset(srv_conn *c)
{
    c->in_message = false;
    c->headers_done = false;
    c->last_was_value = false;
    c->err_status = 0;
    c->err_msg = NULL;
    c->url_len = 0;
    for (int i = 0; i < c->n_hdrs; i++) {
        free(c->hdrs[i].name);
        free(c->hdrs[i].value);
    }
    c->n_hdrs = 0;
    c->header_bytes = 0;
    c->body_len = 0;
    if (c->body_cap > (1u << 20)) {
        free(c->body);
        c->body = NULL;
        c->body_cap = 0;
    }
    c->chunked = false;
    c->head_only = false;
    c->owner = NULL;
    c->on_gone = NULL;
    c->on_pressure = NULL;
    c->pressured = false;
}

static srv_conn *parser_conn(llhttp_t *p)
{
    return p->data;
}

/* The body timer: the next read within idle_timeout, the whole body by
 * body_deadline, whichever comes first. */
static void body_timer_arm(srv_conn *c)
{
    uint64_t now = uv_now(c->h->loop);
    uint64_t left = c->body_deadline > now ? c->body_deadline - now : 0;
    timer_arm(c, TIMER_BODY, min_u64(c->h->p.idle_timeout_ms, left));
}

static int reject(srv_conn *c, int status, const char *msg)
{
    c->err_status = status;
    c->err_msg = msg;
    return HPE_USER;
}

static int on_message_begin(llhttp_t *p)
{
    srv_conn *c = parser_conn(p);
    request_reset(c);
    c->in_message = true;
    timer_arm(c, TIMER_HEADER, c->h->p.header_timeout_ms);
    return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    c->header_bytes += n;
    if (c->header_bytes > c->h->p.max_header_bytes)
        return reject(c, 414, "the request URL is too long");
    buf_append(&c->url, &c->url_len, &c->url_cap, at, n);
    return 0;
}

static int on_header_field(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    c->header_bytes += n + 4; /* ": " and CRLF count too */
    if (c->header_bytes > c->h->p.max_header_bytes)
        return reject(c, 431, "the request headers are too large");
    if (c->n_hdrs == 0 || c->last_was_value) {
        if (c->n_hdrs >= c->h->p.max_headers)
            return reject(c, 431, "the request has too many headers");
        if (c->n_hdrs == c->hdr_cap) {
            c->hdr_cap = c->hdr_cap ? c->hdr_cap * 2 : 16;
            c->hdrs = xrealloc(c->hdrs, sizeof(*c->hdrs) * (size_t)c->hdr_cap);
        }
        c->hdrs[c->n_hdrs++] = (struct hdr){0};
        c->last_was_value = false;
    }
    struct hdr *x = &c->hdrs[c->n_hdrs - 1];
    size_t cap = x->name ? x->nlen + 1 : 0;
    buf_append(&x->name, &x->nlen, &cap, at, n);
    return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    c->header_bytes += n;
    if (c->header_bytes > c->h->p.max_header_bytes)
        return reject(c, 431, "the request headers are too large");
    if (c->n_hdrs == 0)
        return 0;
    c->last_was_value = true;
    struct hdr *x = &c->hdrs[c->n_hdrs - 1];
    size_t cap = x->value ? x->vlen + 1 : 0;
    buf_append(&x->value, &x->vlen, &cap, at, n);
    return 0;
}

/* Whether a header value is one token equal to `want` (case-insensitive,
 * surrounding spaces and tabs ignored). */
static bool value_is(const char *v, size_t n, const char *want)
{
    while (n > 0 && (*v == ' ' || *v == '\t'))
        v++, n--;
    while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    return n == strlen(want) && !strncasecmp(v, want, n);
}

/*
 * Framing and protocol switches are settled here, before any body byte:
 * a body coded other than `chunked` alone (gzip, chunked; chunked, chunked;
 * two Transfer-Encoding fields) would reach a handler undecoded, so it is
 * refused (501, as RFC 9112 asks for a coding the server does not know).
 * kvd speaks no protocol but HTTP/1.x: an Upgrade is ignored (the client
 * stays on HTTP and the next pipelined request is parsed as one), CONNECT
 * is refused.
 */
static int check_framing(srv_conn *c, llhttp_t *p)
{
    if (llhttp_get_method(p) == HTTP_CONNECT)
        return reject(c, 405, "CONNECT is not supported");
    p->upgrade = 0;
    int n_te = 0;
    for (int i = 0; i < c->n_hdrs; i++) {
        const struct hdr *x = &c->hdrs[i];
        if (!x->name || strcasecmp(x->name, "transfer-encoding"))
            continue;
        if (++n_te > 1 || !x->value || !value_is(x->value, x->vlen, "chunked"))
            return reject(c, 501, "only 'Transfer-Encoding: chunked' is accepted");
    }
    return 0;
}

static int on_headers_complete(llhttp_t *p)
{
    srv_conn *c = parser_conn(p);
    c->headers_done = true;
    if (check_framing(c, p))
        return -1;
    if ((p->flags & F_CONTENT_LENGTH) && p->content_length > c->h->p.max_body_bytes) {
        c->err_status = 413;
        c->err_msg = "the request body is too large";
        return -1;
    }
    for (int i = 0; i < c->n_hdrs; i++) {
        if (c->hdrs[i].name && !strcasecmp(c->hdrs[i].name, "expect") && c->hdrs[i].value &&
            !strncasecmp(c->hdrs[i].value, "100-continue", 12)) {
            static const char cont[] = "HTTP/1.1 100 Continue\r\n\r\n";
            conn_write(c, cont, sizeof(cont) - 1, NULL, 0, false);
        }
    }
    c->body_deadline = uv_now(c->h->loop) + c->h->p.body_timeout_ms;
    body_timer_arm(c);
    return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    if (c->body_len + n > c->h->p.max_body_bytes)
        return reject(c, 413, "the request body is too large");
    buf_append(&c->body, &c->body_len, &c->body_cap, at, n);
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    srv_conn *c = parser_conn(p);
    c->keep_alive = llhttp_should_keep_alive(p);
    c->http_minor = llhttp_get_http_minor(p);
    if (llhttp_get_http_major(p) != 1)
        return reject(c, 505, "only HTTP/1.x is spoken here");
    return HPE_PAUSED;
}

/* Trim spaces and tabs at both ends, in place. */
static char *trim(char *s)
{
    if (!s)
        return (char *)"";
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = '\0';
    return s;
}

/*
 * The path of a request target: origin-form as it is; absolute-form
 * ("http://host:port/path", which HTTP/1.1 servers must accept, RFC 9112
 * 3.2.2) without its scheme and authority ("/" when it has no path). The
 * query has been cut off already.
 */
static const char *origin_path(const char *url)
{
    const char *rest = NULL;
    if (!strncasecmp(url, "http://", 7))
        rest = url + 7;
    else if (!strncasecmp(url, "https://", 8))
        rest = url + 8;
    if (!rest)
        return url;
    const char *slash = strchr(rest, '/');
    return slash ? slash : "/";
}

/* Hand the complete request to the handler. */
static void dispatch(srv_conn *c)
{
    timer_stop(c);
    c->state = CONN_HANDLING;
    if (!c->url)
        buf_append(&c->url, &c->url_len, &c->url_cap, "/", 1);
    /* The body buffer is kept across keep-alive requests: a request
     * without a body must not see the previous one's bytes. */
    buf_append(&c->body, &c->body_len, &c->body_cap, "", 0);
    char *q = strchr(c->url, '?');
    const char *query = "";
    if (q) {
        *q = '\0';
        query = q + 1;
    }
    const char *path = origin_path(c->url);
    llhttp_method_t method = (llhttp_method_t)llhttp_get_method(&c->parser);
    c->head_only = method == HTTP_HEAD;
    struct srv_http_header hv[c->n_hdrs > 0 ? c->n_hdrs : 1];
    for (int i = 0; i < c->n_hdrs; i++)
        hv[i] = (struct srv_http_header){trim(c->hdrs[i].name), trim(c->hdrs[i].value)};
    struct srv_http_req req = {
        .method = llhttp_method_name(method),
        .path = path,
        .query = query,
        .headers = hv,
        .n_headers = c->n_hdrs,
        .body = c->body,
        .body_len = c->body_len,
    };
    c->h->handler(c->h->ud, c, &req);
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
    request_reset(c);
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

static void conn_close(srv_conn *c)
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
        conn_close(c);
        return;
    }
    if (c->state == CONN_HANDLING) {
        /* The handler owns the request; it learns the client is gone. */
        conn_close(c);
        return;
    }
    c->close_after = true;
    size_t blen = 0;
    char *body = srv_error_json(status, msg, NULL, NULL, &blen);
    char head[512];
    int n = snprintf(head, sizeof(head),
                     "HTTP/1.1 %d %s\r\nServer: kvd\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                     status, status_text(status), blen);
    srv_metrics_status(c->h->metrics, status);
    srv_log(SRV_LOG_DEBUG, "http: %d %s", status, msg);
    c->state = CONN_LINGER;
    timer_stop(c);
    free(c->pending);
    c->pending = NULL;
    c->pending_len = c->pending_cap = 0;
    conn_write(c, head, (size_t)n, body ? body : "", body ? blen : 0, true);
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
        conn_close(c);
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
        buf_append(&c->pending, &c->pending_len, &c->pending_cap, buf->base, (size_t)nread);
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
        conn_close(c);
        return;
    }
    c->reading = true;
}

/* The answer to the current request is complete. */
static void response_done(srv_conn *c)
{
    c->owner = NULL;
    c->on_gone = NULL;
    c->on_pressure = NULL;
    if (c->close_after) {
        c->state = CONN_LINGER;
        return;
    }
    c->state = CONN_READING;
    request_reset(c);
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
    conn_close(victim);
    return true;
}

/* Idle from now: the keep-alive timer, and the age shedding goes by. */
static void idle_arm(srv_conn *c)
{
    c->idle_since = uv_now(c->h->loop);
    timer_arm(c, TIMER_IDLE, c->h->p.idle_timeout_ms);
}

/* A connection object with its handles initialised and linked into h's
 * list (the socket still closed). NULL when out of memory. */
static srv_conn *conn_new(srv_http *h)
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
static void conn_start(srv_conn *c)
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

static void on_connection(uv_stream_t *server, int status)
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
    srv_conn *c = conn_new(h);
    if (!c)
        return;
    int rc = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (rc < 0) {
        srv_log(SRV_LOG_WARN, "http: uv_accept: %s", uv_strerror(rc));
        conn_close(c);
        return;
    }
    conn_start(c);
}

/* ------------------------------------------------------------------------
 * Public API
 * ------------------------------------------------------------------------ */

srv_http *srv_http_create(uv_loop_t *loop, const struct srv_http_params *p, srv_metrics *metrics,
                          srv_http_handler handler, void *ud)
{
    srv_http *h = calloc(1, sizeof(*h));
    if (!h)
        return NULL;
    h->loop = loop;
    h->p = *p;
    h->metrics = metrics;
    h->handler = handler;
    h->ud = ud;
    llhttp_settings_init(&h->settings);
    h->settings.on_message_begin = on_message_begin;
    h->settings.on_url = on_url;
    h->settings.on_header_field = on_header_field;
    h->settings.on_header_value = on_header_value;
    h->settings.on_headers_complete = on_headers_complete;
    h->settings.on_body = on_body;
    h->settings.on_message_complete = on_message_complete;
    return h;
}

int srv_http_listen(srv_http *h, const char *host, int port, int *bound_port, char *err,
                    size_t errlen)
{
    struct sockaddr_storage ss;
    int rc = strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss)
                               : uv_ip4_addr(host, port, (struct sockaddr_in *)&ss);
    if (rc < 0) {
        snprintf(err, errlen, "bad listen address '%s': %s", host, uv_strerror(rc));
        return rc;
    }
    rc = uv_tcp_init(h->loop, &h->listener);
    if (rc < 0) {
        snprintf(err, errlen, "uv_tcp_init: %s", uv_strerror(rc));
        return rc;
    }
    h->listener.data = h;
    h->listener_open = true;
    rc = uv_tcp_bind(&h->listener, (const struct sockaddr *)&ss, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&h->listener, 511, on_connection);
    if (rc < 0) {
        snprintf(err, errlen, "cannot listen on %s:%d: %s", host, port, uv_strerror(rc));
        return rc;
    }
    struct sockaddr_storage got;
    int len = sizeof(got);
    rc = uv_tcp_getsockname(&h->listener, (struct sockaddr *)&got, &len);
    if (rc < 0) {
        snprintf(err, errlen, "uv_tcp_getsockname: %s", uv_strerror(rc));
        return rc;
    }
    *bound_port = got.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&got)->sin6_port)
                                            : ntohs(((struct sockaddr_in *)&got)->sin_port);
    return 0;
}

int srv_http_open_fd(srv_http *h, int fd)
{
    srv_conn *c = conn_new(h);
    if (!c)
        return -ENOMEM;
    int rc = uv_tcp_open(&c->tcp, fd);
    if (rc < 0) {
        conn_close(c);
        return rc;
    }
    conn_start(c);
    return 0;
}

void srv_http_set_params(srv_http *h, const struct srv_http_params *p)
{
    h->p = *p;
}

static void on_listener_closed(uv_handle_t *hd)
{
    srv_http *h = hd->data;
    h->listener_open = false;
    if (h->closing && h->n_conns == 0 && h->done) {
        void (*done)(void *) = h->done;
        h->done = NULL;
        done(h->done_ud);
    }
}

static void close_listener(srv_http *h)
{
    if (h->listener_open && !uv_is_closing((uv_handle_t *)&h->listener))
        uv_close((uv_handle_t *)&h->listener, on_listener_closed);
}

void srv_http_drain(srv_http *h)
{
    /* Open connections stay: a request on one gets its answer (503 from
     * the API while draining) with Connection: close. */
    h->draining = true;
    close_listener(h);
}

void srv_http_close(srv_http *h, void (*done)(void *ud), void *ud)
{
    h->closing = true;
    h->done = done;
    h->done_ud = ud;
    close_listener(h);
    for (srv_conn *c = h->conns, *next; c; c = next) {
        next = c->next;
        if (c->n_writes > 0 && c->state != CONN_CLOSING) {
            /* Let the last answer reach the client first (bounded). */
            c->flush_close = true;
            timer_arm(c, TIMER_LINGER, LINGER_MS);
        } else {
            conn_close(c);
        }
    }
    if (h->n_conns == 0 && !h->listener_open && h->done) {
        h->done = NULL;
        done(ud);
    }
}

void srv_http_destroy(srv_http *h)
{
    free(h);
}

int srv_http_n_connections(const srv_http *h)
{
    return h->n_conns;
}

const char *srv_http_header(const struct srv_http_req *req, const char *name)
{
    for (int i = 0; i < req->n_headers; i++)
        if (!strcasecmp(req->headers[i].name, name))
            return req->headers[i].value;
    return NULL;
}

void srv_conn_set_owner(srv_conn *c, void *owner, void (*on_gone)(void *owner),
                        void (*on_pressure)(void *owner, bool pause))
{
    c->owner = owner;
    c->on_gone = on_gone;
    c->on_pressure = on_pressure;
}

/* The status line and common headers; returns the length. */
static int head_format(srv_conn *c, char *out, size_t cap, int status, const char *ctype,
                       const char *extra, const char *framing)
{
    bool keep = c->keep_alive && !c->h->draining && !c->close_after;
    if (!keep)
        c->close_after = true;
    int n =
        snprintf(out, cap,
                 "HTTP/1.%d %d %s\r\nServer: kvd\r\nContent-Type: %s\r\n%s%sConnection: %s\r\n\r\n",
                 c->http_minor ? 1 : 0, status, status_text(status), ctype, framing,
                 extra ? extra : "", keep ? "keep-alive" : "close");
    return n < 0 || (size_t)n >= cap ? -1 : n;
}

int srv_http_respond(srv_conn *c, int status, const char *content_type, const char *extra_headers,
                     const char *body, size_t len)
{
    if (c->state != CONN_HANDLING)
        return -EPIPE;
    char framing[64], head[2048];
    snprintf(framing, sizeof(framing), "Content-Length: %zu\r\n", len);
    int n = head_format(c, head, sizeof(head), status, content_type, extra_headers, framing);
    if (n < 0)
        return -EINVAL;
    srv_metrics_status(c->h->metrics, status);
    int rc = conn_write(c, head, (size_t)n, body, c->head_only ? 0 : len, c->close_after);
    if (rc < 0)
        return rc;
    response_done(c);
    return 0;
}

int srv_http_stream_begin(srv_conn *c, int status, const char *content_type,
                          const char *extra_headers)
{
    if (c->state != CONN_HANDLING)
        return -EPIPE;
    char head[2048];
    c->chunked = c->http_minor >= 1;
    if (!c->chunked && !c->head_only)
        c->close_after = true;
    int n = head_format(c, head, sizeof(head), status, content_type, extra_headers,
                        c->chunked ? "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n"
                                   : "Cache-Control: no-cache\r\n");
    if (n < 0)
        return -EINVAL;
    srv_metrics_status(c->h->metrics, status);
    c->state = CONN_STREAMING;
    return conn_write(c, head, (size_t)n, NULL, 0, false);
}

int srv_http_stream_write(srv_conn *c, const char *data, size_t len)
{
    if (c->state != CONN_STREAMING)
        return -EPIPE;
    if (len == 0 || c->head_only)
        return 0;
    if (!c->chunked) {
        int rc = conn_write(c, data, len, NULL, 0, false);
        return rc < 0 ? rc : stream_judge(c);
    }
    char size[32];
    int n = snprintf(size, sizeof(size), "%zx\r\n", len);
    /* one write: size line, data, CRLF */
    struct wreq *wr = malloc(sizeof(*wr) + (size_t)n + len + 2);
    if (!wr) {
        conn_close(c);
        return -EPIPE;
    }
    memcpy(wr->data, size, (size_t)n);
    memcpy(wr->data + n, data, len);
    memcpy(wr->data + n + len, "\r\n", 2);
    int rc = conn_write(c, wr->data, (size_t)n + len + 2, NULL, 0, false);
    free(wr);
    return rc < 0 ? rc : stream_judge(c);
}

int srv_http_stream_end(srv_conn *c)
{
    if (c->state != CONN_STREAMING)
        return -EPIPE;
    int rc = 0;
    bool close = c->close_after;
    if (c->head_only) {
        if (close)
            rc = conn_write(c, "", 0, NULL, 0, true);
    } else if (c->chunked)
        rc = conn_write(c, "0\r\n\r\n", 5, NULL, 0, close);
    else if (close) {
        /* close-delimited: the end is the FIN */
        c->state = CONN_LINGER;
        int r2 = uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, NULL);
        if (r2 < 0)
            conn_close(c);
        else
            timer_arm(c, TIMER_LINGER, LINGER_MS);
        c->owner = NULL;
        c->on_gone = NULL;
        c->on_pressure = NULL;
        return 0;
    }
    if (rc < 0)
        return rc;
    c->state = CONN_HANDLING; /* so response_done sees a finished answer */
    response_done(c);
    return 0;
}
