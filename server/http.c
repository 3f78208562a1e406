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
 *   headers within header_timeout, or a body stalled for idle_timeout: 408;
 *   a keep-alive connection idle for idle_timeout is closed quietly; more
 *   than max_connections open: 503; a reader that lets more than
 *   max_write_queue bytes pile up is closed. Malformed HTTP: 400.
 * After an error the connection is closed gracefully (FIN after the
 * answer, further input discarded for a moment) so the client can read
 * the status before the socket goes away.
 *
 * Handles are freed only in their close callbacks.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <llhttp.h>
#include <uv.h>

#include "server/server_internal.h"

#define READ_CHUNK 65536
#define LINGER_MS 2000

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
    uv_timer_t timer;
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

    /* bytes received but not parsed yet */
    char *pending;
    size_t pending_len, pending_cap;
    bool in_process;
    bool reading;

    /* the answer */
    int n_writes;     /* uv_write requests in flight */
    bool flush_close; /* close once n_writes reaches 0 (server closing) */
    bool chunked;
    bool close_after;
    void *owner;
    void (*on_gone)(void *owner);
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
    int n_conns;
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

static void on_timer(uv_timer_t *t)
{
    srv_conn *c = t->data;
    enum timer_kind k = c->timer_kind;
    c->timer_kind = TIMER_NONE;
    switch (k) {
    case TIMER_IDLE:
    case TIMER_LINGER:
        conn_close(c);
        break;
    case TIMER_HEADER:
        conn_fail(c, 408, "the request headers did not arrive in time");
        break;
    case TIMER_BODY:
        conn_fail(c, 408, "the request body stalled");
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
    if (uv_stream_get_write_queue_size((uv_stream_t *)&c->tcp) > c->h->p.max_write_queue) {
        srv_log(SRV_LOG_WARN, "http: closing a connection that does not read its answer");
        conn_close(c);
        return -EPIPE;
    }
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
    c->owner = NULL;
    c->on_gone = NULL;
}

static srv_conn *parser_conn(llhttp_t *p)
{
    return p->data;
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

static int on_headers_complete(llhttp_t *p)
{
    srv_conn *c = parser_conn(p);
    c->headers_done = true;
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
    timer_arm(c, TIMER_BODY, c->h->p.idle_timeout_ms);
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

/* Hand the complete request to the handler. */
static void dispatch(srv_conn *c)
{
    timer_stop(c);
    c->state = CONN_HANDLING;
    if (!c->url)
        buf_append(&c->url, &c->url_len, &c->url_cap, "/", 1);
    if (!c->body)
        buf_append(&c->body, &c->body_len, &c->body_cap, "", 0);
    char *q = strchr(c->url, '?');
    const char *query = "";
    if (q) {
        *q = '\0';
        query = q + 1;
    }
    struct srv_http_header hv[c->n_hdrs > 0 ? c->n_hdrs : 1];
    for (int i = 0; i < c->n_hdrs; i++)
        hv[i] = (struct srv_http_header){trim(c->hdrs[i].name), trim(c->hdrs[i].value)};
    struct srv_http_req req = {
        .method = llhttp_method_name((llhttp_method_t)llhttp_get_method(&c->parser)),
        .path = c->url,
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
        timer_arm(c, TIMER_IDLE, c->h->p.idle_timeout_ms);
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
    if (c->on_gone) {
        void (*gone)(void *) = c->on_gone;
        void *owner = c->owner;
        c->on_gone = NULL;
        c->owner = NULL;
        gone(owner);
    }
    uv_timer_stop(&c->timer);
    uv_read_stop((uv_stream_t *)&c->tcp);
    uv_close((uv_handle_t *)&c->tcp, on_close_handle);
    uv_close((uv_handle_t *)&c->timer, on_close_handle);
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
    char *body = srv_api_error_json(status, msg, NULL, &blen);
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
    if (c->headers_done && c->state == CONN_READING)
        timer_arm(c, TIMER_BODY, c->h->p.idle_timeout_ms);
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

static void on_connection(uv_stream_t *server, int status)
{
    srv_http *h = server->data;
    if (status < 0) {
        srv_log(SRV_LOG_WARN, "http: accept: %s", uv_strerror(status));
        return;
    }
    srv_conn *c = calloc(1, sizeof(*c));
    if (!c)
        return;
    c->h = h;
    int rc = uv_tcp_init(h->loop, &c->tcp);
    if (rc < 0) {
        srv_log(SRV_LOG_ERROR, "http: uv_tcp_init: %s", uv_strerror(rc));
        free(c);
        return;
    }
    c->tcp.data = c;
    c->handles_open = 1;
    rc = uv_timer_init(h->loop, &c->timer);
    if (rc < 0) {
        srv_log(SRV_LOG_ERROR, "http: uv_timer_init: %s", uv_strerror(rc));
        c->state = CONN_CLOSING;
        uv_close((uv_handle_t *)&c->tcp, on_close_handle);
        /* counted below so conn_free's bookkeeping balances */
    } else {
        c->timer.data = c;
        c->handles_open = 2;
    }
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    if (c->state == CONN_CLOSING)
        return;
    rc = uv_accept(server, (uv_stream_t *)&c->tcp);
    if (rc < 0) {
        srv_log(SRV_LOG_WARN, "http: uv_accept: %s", uv_strerror(rc));
        conn_close(c);
        return;
    }
    rc = uv_tcp_nodelay(&c->tcp, 1); /* tokens go out as they come */
    if (rc < 0)
        srv_log(SRV_LOG_DEBUG, "http: uv_tcp_nodelay: %s", uv_strerror(rc));
    llhttp_init(&c->parser, HTTP_REQUEST, &h->settings);
    c->parser.data = c;
    c->state = CONN_READING;
    start_reading(c);
    if (h->n_conns > h->p.max_connections) {
        conn_fail(c, 503, "too many open connections; retry later");
        return;
    }
    timer_arm(c, TIMER_IDLE, h->p.idle_timeout_ms);
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

void srv_conn_set_owner(srv_conn *c, void *owner, void (*on_gone)(void *owner))
{
    c->owner = owner;
    c->on_gone = on_gone;
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
    int rc = conn_write(c, head, (size_t)n, body, len, c->close_after);
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
    if (!c->chunked)
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
    if (len == 0)
        return 0;
    if (!c->chunked)
        return conn_write(c, data, len, NULL, 0, false);
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
    return rc;
}

int srv_http_stream_end(srv_conn *c)
{
    if (c->state != CONN_STREAMING)
        return -EPIPE;
    int rc = 0;
    bool close = c->close_after;
    if (c->chunked)
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
        return 0;
    }
    if (rc < 0)
        return rc;
    c->state = CONN_HANDLING; /* so response_done sees a finished answer */
    response_done(c);
    return 0;
}
