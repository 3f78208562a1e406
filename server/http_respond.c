/*
 * http_respond.c - answering the handler's request: a whole answer
 * (Content-Length), or a stream (chunked on HTTP/1.1, close-delimited on
 * 1.0) written piece by piece under the connection's backpressure; HEAD
 * gets the head alone. Keep-alive unless the client, a drain or an
 * earlier error says close.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/http_internal.h"
#include "server/metrics.h"

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
                 c->http_minor ? 1 : 0, status, srv_http_status_text(status), ctype, framing,
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
    int rc = srv_conn_write(c, head, (size_t)n, body, c->head_only ? 0 : len, c->close_after);
    if (rc < 0)
        return rc;
    srv_conn_response_done(c);
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
    return srv_conn_write(c, head, (size_t)n, NULL, 0, false);
}

int srv_http_stream_write(srv_conn *c, const char *data, size_t len)
{
    if (c->state != CONN_STREAMING)
        return -EPIPE;
    if (len == 0 || c->head_only)
        return 0;
    if (!c->chunked) {
        int rc = srv_conn_write(c, data, len, NULL, 0, false);
        return rc < 0 ? rc : srv_conn_stream_judge(c);
    }
    char size[32];
    int n = snprintf(size, sizeof(size), "%zx\r\n", len);
    /* one write: size line, data, CRLF */
    struct wreq *wr = malloc(sizeof(*wr) + (size_t)n + len + 2);
    if (!wr) {
        srv_conn_close(c);
        return -EPIPE;
    }
    memcpy(wr->data, size, (size_t)n);
    memcpy(wr->data + n, data, len);
    memcpy(wr->data + n + len, "\r\n", 2);
    int rc = srv_conn_write(c, wr->data, (size_t)n + len + 2, NULL, 0, false);
    free(wr);
    return rc < 0 ? rc : srv_conn_stream_judge(c);
}

int srv_http_stream_end(srv_conn *c)
{
    if (c->state != CONN_STREAMING)
        return -EPIPE;
    int rc = 0;
    bool close = c->close_after;
    if (c->head_only) {
        if (close)
            rc = srv_conn_write(c, "", 0, NULL, 0, true);
    } else if (c->chunked)
        rc = srv_conn_write(c, "0\r\n\r\n", 5, NULL, 0, close);
    else if (close) {
        /* close-delimited: the end is the FIN */
        c->state = CONN_LINGER;
        int r2 = uv_shutdown(&c->shutdown_req, (uv_stream_t *)&c->tcp, NULL);
        if (r2 < 0)
            srv_conn_close(c);
        else
            srv_conn_timer_arm(c, TIMER_LINGER, LINGER_MS);
        c->owner = NULL;
        c->on_gone = NULL;
        c->on_pressure = NULL;
        return 0;
    }
    if (rc < 0)
        return rc;
    c->state = CONN_HANDLING; /* so srv_conn_response_done sees a finished answer */
    srv_conn_response_done(c);
    return 0;
}
