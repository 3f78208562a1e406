/*
 * http_request.c - one HTTP/1.1 request read with llhttp: the request
 * line, headers and body gathered into the connection, each limit
 * checked as its bytes arrive (414, 431, 413), framing settled before any
 * body byte (501 for codings other than chunked alone, 405 for CONNECT,
 * an Upgrade ignored), and the handler's view of the complete request.
 *
 * The callbacks only record: an error status (the connection answers it
 * when llhttp returns), the timer the connection should now run (headers,
 * then body), and whether the client waits for "100 Continue". So this
 * file calls nothing of the connection's, and a request is parsed the
 * same whoever feeds the bytes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "server/http_internal.h"

void *srv_http_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "kvd: out of memory (%zu bytes)\n", n);
        abort();
    }
    return q;
}

/* Append to a growing buffer (kept NUL-terminated). */
void srv_http_buf_append(char **p, size_t *len, size_t *cap, const char *data, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = *cap ? *cap : 256;
        while (c < *len + n + 1)
            c *= 2;
        *p = srv_http_xrealloc(*p, c);
        *cap = c;
    }
    memcpy(*p + *len, data, n);
    *len += n;
    (*p)[*len] = '\0';
}

const char *srv_http_status_text(int status)
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
 * Request state
 * ------------------------------------------------------------------------ */

void srv_http_request_reset(srv_conn *c)
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
    c->timer_want = TIMER_NONE;
    c->send_continue = false;
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
    srv_http_request_reset(c);
    c->in_message = true;
    c->timer_want = TIMER_HEADER;
    return 0;
}

static int on_url(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    c->header_bytes += n;
    if (c->header_bytes > c->h->p.max_header_bytes)
        return reject(c, 414, "the request URL is too long");
    srv_http_buf_append(&c->url, &c->url_len, &c->url_cap, at, n);
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
            c->hdrs = srv_http_xrealloc(c->hdrs, sizeof(*c->hdrs) * (size_t)c->hdr_cap);
        }
        c->hdrs[c->n_hdrs++] = (struct hdr){0};
        c->last_was_value = false;
    }
    struct hdr *x = &c->hdrs[c->n_hdrs - 1];
    size_t cap = x->name ? x->nlen + 1 : 0;
    srv_http_buf_append(&x->name, &x->nlen, &cap, at, n);
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
    srv_http_buf_append(&x->value, &x->vlen, &cap, at, n);
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
            c->send_continue = true;
        }
    }
    c->body_deadline = uv_now(c->h->loop) + c->h->p.body_timeout_ms;
    c->timer_want = TIMER_BODY;
    return 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n)
{
    srv_conn *c = parser_conn(p);
    if (c->body_len + n > c->h->p.max_body_bytes)
        return reject(c, 413, "the request body is too large");
    srv_http_buf_append(&c->body, &c->body_len, &c->body_cap, at, n);
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

void srv_http_request_view(srv_conn *c, struct srv_http_header *hv, struct srv_http_req *req)
{
    if (!c->url)
        srv_http_buf_append(&c->url, &c->url_len, &c->url_cap, "/", 1);
    /* The body buffer is kept across keep-alive requests: a request
     * without a body must not see the previous one's bytes. */
    srv_http_buf_append(&c->body, &c->body_len, &c->body_cap, "", 0);
    char *q = strchr(c->url, '?');
    const char *query = "";
    if (q) {
        *q = '\0';
        query = q + 1;
    }
    llhttp_method_t method = (llhttp_method_t)llhttp_get_method(&c->parser);
    c->head_only = method == HTTP_HEAD;
    for (int i = 0; i < c->n_hdrs; i++)
        hv[i] = (struct srv_http_header){trim(c->hdrs[i].name), trim(c->hdrs[i].value)};
    *req = (struct srv_http_req){
        .method = llhttp_method_name(method),
        .path = origin_path(c->url),
        .query = query,
        .headers = hv,
        .n_headers = c->n_hdrs,
        .body = c->body,
        .body_len = c->body_len,
    };
}

void srv_http_parser_settings(llhttp_settings_t *s)
{
    llhttp_settings_init(s);
    s->on_message_begin = on_message_begin;
    s->on_url = on_url;
    s->on_header_field = on_header_field;
    s->on_header_value = on_header_value;
    s->on_headers_complete = on_headers_complete;
    s->on_body = on_body;
    s->on_message_complete = on_message_complete;
}
