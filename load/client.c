/*
 * client.c - a blocking HTTP/1.1 client for `kvd load`.
 *
 * One connection per load thread, kept alive across requests. Responses
 * are parsed with llhttp (the same parser the server uses), and body bytes
 * are passed to a callback the moment they are read, so the caller can
 * stamp the arrival of each SSE event. Blocking sockets with a receive
 * timeout keep it simple: concurrency comes from threads, one per client.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <llhttp.h>

#include "load/client.h"

struct lc_conn {
    char host[256];
    int port;
    double timeout_s;
    int fd;
};

/* Parser state for one response. */
struct lc_parse {
    struct lc_response *resp;
    size_t cap;
    lc_body_cb cb;
    void *user;
    bool done;
    bool keep_alive;
    bool oom;
};

double lc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int lc_parse_url(const char *url, char *host, size_t hostlen, int *port)
{
    if (!strncmp(url, "http://", 7))
        url += 7;
    const char *colon = strrchr(url, ':');
    const char *end = url + strcspn(url, "/");
    if (!colon || colon > end)
        return -1;
    size_t n = (size_t)(colon - url);
    if (n > 2 && url[0] == '[' && url[n - 1] == ']') { /* [::1]:8080 */
        url++;
        n -= 2;
    }
    if (n == 0 || n >= hostlen)
        return -1;
    memcpy(host, url, n);
    host[n] = '\0';
    char *stop;
    long p = strtol(colon + 1, &stop, 10);
    if (stop != end || p < 1 || p > 65535)
        return -1;
    *port = (int)p;
    return 0;
}

bool lc_is_loopback(const char *host)
{
    if (!strcmp(host, "localhost") || !strcmp(host, "::1"))
        return true;
    struct in_addr a;
    if (inet_pton(AF_INET, host, &a) == 1)
        return (ntohl(a.s_addr) >> 24) == 127;
    return false;
}

/* Connect c->fd to c->host:c->port, trying each address the name has
 * ("localhost" may list ::1 before 127.0.0.1). Returns 0, or -1 with err. */
static int open_socket(struct lc_conn *c, char *err, size_t errlen)
{
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    char port[16];
    snprintf(port, sizeof(port), "%d", c->port);
    int rc = getaddrinfo(c->host, port, &hints, &res);
    if (rc) {
        snprintf(err, errlen, "cannot resolve %s: %s", c->host, gai_strerror(rc));
        return -1;
    }
    int fd = -1, saved = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) < 0) {
            saved = errno;
            close(fd);
            fd = -1;
        } else if (fd < 0) {
            saved = errno;
        }
    }
    freeaddrinfo(res);
    if (fd < 0) {
        snprintf(err, errlen, "cannot connect to %s:%d: %s", c->host, c->port, strerror(saved));
        return -1;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct timeval tv = {.tv_sec = (time_t)c->timeout_s,
                         .tv_usec =
                             (suseconds_t)((c->timeout_s - (double)(time_t)c->timeout_s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    c->fd = fd;
    return 0;
}

struct lc_conn *lc_connect(const char *host, int port, double timeout_s, char *err, size_t errlen)
{
    struct lc_conn *c = calloc(1, sizeof(*c));
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    snprintf(c->host, sizeof(c->host), "%s", host);
    c->port = port;
    c->timeout_s = timeout_s;
    if (open_socket(c, err, errlen)) {
        free(c);
        return NULL;
    }
    return c;
}

void lc_close(struct lc_conn *c)
{
    if (!c)
        return;
    if (c->fd >= 0)
        close(c->fd);
    free(c);
}

void lc_response_free(struct lc_response *resp)
{
    free(resp->body);
    resp->body = NULL;
    resp->len = 0;
}

static int on_body(llhttp_t *p, const char *at, size_t len)
{
    struct lc_parse *st = p->data;
    struct lc_response *r = st->resp;
    if (r->len + len + 1 > st->cap) {
        size_t cap = st->cap ? st->cap : 4096;
        while (cap < r->len + len + 1)
            cap *= 2;
        char *b = realloc(r->body, cap);
        if (!b) {
            st->oom = true;
            return -1;
        }
        r->body = b;
        st->cap = cap;
    }
    memcpy(r->body + r->len, at, len);
    r->len += len;
    r->body[r->len] = '\0';
    if (st->cb)
        st->cb(st->user, at, len);
    return 0;
}

static int on_complete(llhttp_t *p)
{
    struct lc_parse *st = p->data;
    st->done = true;
    st->keep_alive = llhttp_should_keep_alive(p);
    st->resp->status = llhttp_get_status_code(p);
    return HPE_PAUSED; /* stop at the end of this response */
}

static int send_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        buf += n;
        len -= (size_t)n;
    }
    return 0;
}

/* One attempt over the current socket; -2 means "connection was stale". */
static int exchange(struct lc_conn *c, const char *req, size_t req_len, struct lc_parse *st,
                    char *err, size_t errlen)
{
    llhttp_settings_t settings;
    llhttp_settings_init(&settings);
    settings.on_body = on_body;
    settings.on_message_complete = on_complete;
    llhttp_t parser;
    llhttp_init(&parser, HTTP_RESPONSE, &settings);
    parser.data = st;

    if (send_all(c->fd, req, req_len))
        return -2;
    char buf[16384];
    size_t total = 0;
    while (!st->done) {
        ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            snprintf(err, errlen, "receive failed: %s", strerror(errno));
            return -1;
        }
        if (n == 0) {
            if (total == 0)
                return -2; /* closed before answering: idle keep-alive timed out */
            if (llhttp_finish(&parser) == HPE_OK && st->done)
                break;
            snprintf(err, errlen, "connection closed mid-response");
            return -1;
        }
        total += (size_t)n;
        llhttp_errno_t e = llhttp_execute(&parser, buf, (size_t)n);
        if (e != HPE_OK && e != HPE_PAUSED) {
            snprintf(err, errlen, "bad response: %s",
                     st->oom ? "out of memory" : llhttp_errno_name(e));
            return -1;
        }
    }
    return 0;
}

int lc_request(struct lc_conn *c, const char *method, const char *path, const char *headers,
               const char *body, lc_body_cb cb, void *user, struct lc_response *resp, char *err,
               size_t errlen)
{
    *resp = (struct lc_response){0};
    size_t blen = body ? strlen(body) : 0;
    size_t cap = strlen(method) + strlen(path) + strlen(c->host) + (headers ? strlen(headers) : 0) +
                 blen + 256;
    char *req = malloc(cap);
    if (!req) {
        snprintf(err, errlen, "out of memory");
        return -1;
    }
    /* An IPv6 literal goes in brackets in the Host header. */
    bool v6 = strchr(c->host, ':') != NULL;
    int n = snprintf(
        req, cap, "%s %s HTTP/1.1\r\nHost: %s%s%s:%d\r\n%s%sContent-Length: %zu\r\n\r\n%s", method,
        path, v6 ? "[" : "", c->host, v6 ? "]" : "", c->port, headers ? headers : "",
        body ? "Content-Type: application/json\r\n" : "", blen, body ? body : "");
    if (n < 0 || (size_t)n >= cap) { /* cannot happen with the sizes above */
        free(req);
        snprintf(err, errlen, "request too large");
        return -1;
    }
    int rc = -1;
    if (c->fd < 0 && open_socket(c, err, errlen)) {
        free(req);
        resp->status = 0;
        return -1;
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        *resp = (struct lc_response){0};
        struct lc_parse st = {.resp = resp, .cb = cb, .user = user};
        rc = exchange(c, req, (size_t)n, &st, err, errlen);
        if (rc == 0 && !st.keep_alive) { /* server will close: reopen on the next request */
            close(c->fd);
            c->fd = -1;
        }
        if (rc != -2)
            break;
        lc_response_free(resp);
        close(c->fd);
        c->fd = -1;
        if (open_socket(c, err, errlen)) {
            rc = -1;
            break;
        }
        snprintf(err, errlen, "server closed the connection");
    }
    free(req);
    if (rc != 0) {
        /* The connection's state is unknown (half a response may be
         * unread): the next request starts on a fresh one. */
        if (c->fd >= 0)
            close(c->fd);
        c->fd = -1;
        resp->status = 0;
        return -1;
    }
    return 0;
}
