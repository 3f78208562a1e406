/*
 * http_client.h - a tiny HTTP/1.1 client over plain sockets for the tests
 * that talk to a live `kvd serve` byte by byte (through serve_fixture.h):
 * keep-alive, pipelining, chunked and close-delimited bodies, HEAD. Every
 * socket has a 60 s timeout. The functions are static and may go unused.
 */
#ifndef KVD_TESTS_HTTP_CLIENT_H
#define KVD_TESTS_HTTP_CLIENT_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#define HC_FN static __attribute__((unused))

struct hc {
    int fd;
    char *buf;
    size_t len, off, cap;
};

struct resp {
    int status;
    char head[8192];
    char *body;
    size_t body_len;
};

HC_FN int hc_open(struct hc *c, int port)
{
    memset(c, 0, sizeof(*c));
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    if (c->fd < 0)
        return -1;
    struct timeval tv = {60, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(c->fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(c->fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(c->fd);
        c->fd = -1;
        return -1;
    }
    return 0;
}

HC_FN void hc_close(struct hc *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    free(c->buf);
    c->buf = NULL;
}

HC_FN int hc_send(struct hc *c, const void *data, size_t n)
{
    const char *p = data;
    while (n > 0) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Read more bytes; returns the count, 0 at EOF, -1 on error/timeout. */
HC_FN int hc_fill(struct hc *c)
{
    if (c->off > 0 && c->off == c->len)
        c->off = c->len = 0;
    if (c->len + 65536 > c->cap) {
        c->cap = (c->len + 65536) * 2;
        c->buf = realloc(c->buf, c->cap);
    }
    ssize_t r = recv(c->fd, c->buf + c->len, c->cap - c->len - 1, 0);
    if (r < 0)
        return -1;
    c->len += (size_t)r;
    c->buf[c->len] = '\0';
    return (int)r;
}

/* A line ending in CRLF (returned without it, in out). */
HC_FN int hc_line(struct hc *c, char *out, size_t cap)
{
    for (;;) {
        char *nl = c->buf ? memmem(c->buf + c->off, c->len - c->off, "\r\n", 2) : NULL;
        if (nl) {
            size_t n = (size_t)(nl - (c->buf + c->off));
            if (n >= cap)
                n = cap - 1;
            memcpy(out, c->buf + c->off, n);
            out[n] = '\0';
            c->off = (size_t)(nl - c->buf) + 2;
            return 0;
        }
        if (hc_fill(c) <= 0)
            return -1;
    }
}

HC_FN int hc_bytes(struct hc *c, char *out, size_t n)
{
    while (c->len - c->off < n)
        if (hc_fill(c) <= 0)
            return -1;
    memcpy(out, c->buf + c->off, n);
    c->off += n;
    return 0;
}

HC_FN const char *resp_header(const struct resp *r, const char *name, char *out, size_t cap)
{
    size_t nl = strlen(name);
    for (const char *p = strstr(r->head, "\r\n"); p && p[2]; p = strstr(p + 2, "\r\n")) {
        const char *line = p + 2;
        if (!strncasecmp(line, name, nl) && line[nl] == ':') {
            const char *v = line + nl + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            size_t n = e ? (size_t)(e - v) : strlen(v);
            if (n >= cap)
                n = cap - 1;
            memcpy(out, v, n);
            out[n] = '\0';
            return out;
        }
    }
    return NULL;
}

/* Status line and headers (skipping 1xx answers). */
HC_FN int hc_read_head(struct hc *c, struct resp *r)
{
    for (;;) {
        memset(r, 0, sizeof(*r));
        char line[8192];
        if (hc_line(c, line, sizeof(line)))
            return -1;
        if (sscanf(line, "HTTP/1.%*d %d", &r->status) != 1)
            return -1;
        size_t hl = (size_t)snprintf(r->head, sizeof(r->head), "%s", line);
        for (;;) {
            if (hc_line(c, line, sizeof(line)))
                return -1;
            if (!line[0])
                break;
            hl += (size_t)snprintf(r->head + hl, sizeof(r->head) - hl, "\r\n%s", line);
            if (hl >= sizeof(r->head))
                hl = sizeof(r->head) - 1;
        }
        snprintf(r->head + hl, sizeof(r->head) - hl, "\r\n");
        if (r->status >= 200)
            return 0;
    }
}

HC_FN bool resp_chunked(const struct resp *r)
{
    char v[64];
    return resp_header(r, "transfer-encoding", v, sizeof(v)) && !strcasecmp(v, "chunked");
}

/* One chunk of a chunked body: 1 with data, 0 at the last chunk, -1 error. */
HC_FN int hc_read_chunk(struct hc *c, char **data, size_t *n)
{
    char line[64];
    if (hc_line(c, line, sizeof(line)))
        return -1;
    size_t sz = strtoul(line, NULL, 16);
    if (sz == 0) {
        hc_line(c, line, sizeof(line)); /* the empty line after the last chunk */
        return 0;
    }
    *data = malloc(sz + 1);
    if (hc_bytes(c, *data, sz) || hc_line(c, line, sizeof(line))) {
        free(*data);
        return -1;
    }
    (*data)[sz] = '\0';
    *n = sz;
    return 1;
}

HC_FN void body_append(struct resp *r, const char *d, size_t n)
{
    r->body = realloc(r->body, r->body_len + n + 1);
    memcpy(r->body + r->body_len, d, n);
    r->body_len += n;
    r->body[r->body_len] = '\0';
}

HC_FN int hc_read_body(struct hc *c, struct resp *r)
{
    char v[64];
    body_append(r, "", 0);
    if (resp_chunked(r)) {
        for (;;) {
            char *d;
            size_t n;
            int k = hc_read_chunk(c, &d, &n);
            if (k < 0)
                return -1;
            if (k == 0)
                return 0;
            body_append(r, d, n);
            free(d);
        }
    }
    if (resp_header(r, "content-length", v, sizeof(v))) {
        size_t n = strtoul(v, NULL, 10);
        char *d = malloc(n + 1);
        if (hc_bytes(c, d, n)) {
            free(d);
            return -1;
        }
        body_append(r, d, n);
        free(d);
        return 0;
    }
    /* close-delimited */
    for (;;) {
        int k = hc_fill(c);
        if (k < 0)
            return -1;
        if (k == 0)
            break;
    }
    body_append(r, c->buf + c->off, c->len - c->off);
    c->off = c->len;
    return 0;
}

HC_FN int hc_read(struct hc *c, struct resp *r)
{
    if (hc_read_head(c, r))
        return -1;
    return hc_read_body(c, r);
}

HC_FN void resp_free(struct resp *r)
{
    free(r->body);
    r->body = NULL;
}

HC_FN int hc_request(struct hc *c, const char *method, const char *path, const char *headers,
                      const char *body)
{
    char head[4096];
    size_t bl = body ? strlen(body) : 0;
    int n = snprintf(head, sizeof(head), "%s %s HTTP/1.1\r\nHost: kvd\r\n%s", method, path,
                     headers ? headers : "");
    if (body)
        n += snprintf(head + n, sizeof(head) - (size_t)n,
                      "Content-Type: application/json\r\nContent-Length: %zu\r\n", bl);
    n += snprintf(head + n, sizeof(head) - (size_t)n, "\r\n");
    if (hc_send(c, head, (size_t)n))
        return -1;
    return body ? hc_send(c, body, bl) : 0;
}

/* One request on a fresh connection. Returns the status (or -1). */
HC_FN int http(int port, const char *method, const char *path, const char *headers,
                const char *body, struct resp *r)
{
    struct hc c;
    memset(r, 0, sizeof(*r));
    if (hc_open(&c, port))
        return -1;
    int rc = hc_request(&c, method, path, headers, body);
    if (rc == 0)
        rc = hc_read(&c, r);
    hc_close(&c);
    return rc ? -1 : r->status;
}

HC_FN int http_status_simple(int port, const char *path)
{
    struct resp r;
    int st = http(port, "GET", path, NULL, NULL, &r);
    resp_free(&r);
    return st;
}

#endif /* KVD_TESTS_HTTP_CLIENT_H */
