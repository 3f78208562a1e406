/*
 * http_listen.c - the HTTP layer's life: created with its limits and
 * handler, listening (or fed an already connected socket), drained (no
 * new connections; answers close theirs) and closed (every handle, with a
 * bounded wait for answers still being written).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/http_internal.h"

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
    srv_http_parser_settings(&h->settings);
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
        rc = uv_listen((uv_stream_t *)&h->listener, 511, srv_http_on_connection);
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
    srv_conn *c = srv_conn_new(h);
    if (!c)
        return -ENOMEM;
    int rc = uv_tcp_open(&c->tcp, fd);
    if (rc < 0) {
        srv_conn_close(c);
        return rc;
    }
    srv_conn_start(c);
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
            srv_conn_timer_arm(c, TIMER_LINGER, LINGER_MS);
        } else {
            srv_conn_close(c);
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
