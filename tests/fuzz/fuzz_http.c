/*
 * fuzz_http.c - libFuzzer target for the daemon's connection glue
 * (server/http.c): each input is the byte stream one client sends on one
 * connection, fed through a socketpair into the real srv_http (llhttp
 * parsing, limits, pipelining, HEAD, chunked bodies, answers, streams,
 * backpressure, error answers and lingering closes), then the client's
 * end is shut for writing. The connection must end (EOF is noticed in
 * every state) and everything it allocated must be freed.
 *
 * The handler stands in for the API and answers by the request's path, so
 * every kind of answer is reached: "/s..." streams three pieces, "/l..."
 * answers a loop turn later (the answer may find the client gone), "/n..."
 * never answers (only the client's leaving ends it), anything else gets a
 * JSON answer echoing the body's length. Limits are small so inputs reach
 * them. Built and run by `make fuzz` (see the Makefile).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <uv.h>

#include "server/http.h"
#include "server/log.h"
#include "server/metrics.h"

static uv_loop_t loop;
static srv_http *http;
static srv_metrics *metrics;

/* An answer due a loop turn later, or never. */
struct late {
    uv_timer_t timer;
    srv_conn *conn; /* NULL once the client left */
    bool never;
};

static void late_closed(uv_handle_t *h)
{
    free(h->data);
}

static void late_gone(void *owner)
{
    struct late *l = owner;
    l->conn = NULL;
    uv_timer_stop(&l->timer);
    uv_close((uv_handle_t *)&l->timer, late_closed);
}

static void late_fire(uv_timer_t *t)
{
    struct late *l = t->data;
    if (l->conn) {
        srv_conn_set_owner(l->conn, NULL, NULL, NULL);
        srv_http_respond(l->conn, 200, "application/json", "", "{\"late\":true}", 13);
    }
    uv_close((uv_handle_t *)&l->timer, late_closed);
}

static void on_pressure(void *owner, bool pause)
{
    (void)owner;
    (void)pause;
}

static void handler(void *ud, srv_conn *c, const struct srv_http_req *req)
{
    (void)ud;
    /* Every header is readable and the body is NUL-terminated. */
    size_t sum = strlen(req->method) + strlen(req->path) + strlen(req->query);
    for (int i = 0; i < req->n_headers; i++)
        sum += strlen(req->headers[i].name) + strlen(req->headers[i].value);
    if (req->body[req->body_len] != '\0')
        __builtin_trap();
    (void)srv_http_header(req, "content-type");

    char p = req->path[0] == '/' ? req->path[1] : '\0';
    if (p == 's') {
        if (srv_http_stream_begin(c, 200, "text/event-stream", "") == 0) {
            srv_conn_set_owner(c, NULL, NULL, on_pressure);
            srv_http_stream_write(c, "data: one\n\n", 11);
            srv_http_stream_write(c, req->body, req->body_len);
            srv_http_stream_end(c);
        }
        return;
    }
    if (p == 'l' || p == 'n') {
        struct late *l = calloc(1, sizeof(*l));
        if (!l)
            abort();
        l->conn = c;
        l->never = p == 'n';
        uv_timer_init(&loop, &l->timer);
        l->timer.data = l;
        srv_conn_set_owner(c, l, late_gone, NULL);
        if (!l->never)
            uv_timer_start(&l->timer, late_fire, 0, 0);
        return;
    }
    char body[128];
    int n = snprintf(body, sizeof(body), "{\"body_bytes\":%zu,\"seen\":%zu}", req->body_len, sum);
    srv_http_respond(c, 200, "application/json", "X-Fuzz: 1\r\n", body, (size_t)n);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    srv_log_setup(SRV_LOG_ERROR + 1, false); /* quiet: every input is an error */
    if (uv_loop_init(&loop))
        abort();
    metrics = srv_metrics_create();
    struct srv_http_params p = {
        .max_header_bytes = 2048,
        .max_headers = 16,
        .max_body_bytes = 4096,
        .header_timeout_ms = 1000,
        .idle_timeout_ms = 1000,
        .body_timeout_ms = 1000,
        .max_connections = 4,
        .write_buffer = 256,
        .max_write_queue = 1 << 20,
    };
    http = srv_http_create(&loop, &p, metrics, handler, NULL);
    if (!http)
        abort();
    return 0;
}

/* Read and drop what the server wrote (so its writes never block). */
static void drain(int fd)
{
    char buf[65536];
    while (read(fd, buf, sizeof(buf)) > 0)
        ;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv))
        abort();
    /* The client's bytes are all there before the server reads. */
    size_t off = 0;
    while (off < size) {
        ssize_t w = write(sv[1], data + off, size - off);
        if (w <= 0)
            break; /* longer than the socket buffer: the rest is cut */
        off += (size_t)w;
    }
    shutdown(sv[1], SHUT_WR);
    if (srv_http_open_fd(http, sv[0]) != 0)
        abort();
    /* Until the connection has ended (no input may keep it open: the
     * client's EOF is noticed in every state). */
    for (int turns = 0; srv_http_n_connections(http) > 0; turns++) {
        drain(sv[1]);
        uv_run(&loop, UV_RUN_NOWAIT);
        if (turns > 100000)
            __builtin_trap();
    }
    /* Close callbacks of handler timers. */
    uv_run(&loop, UV_RUN_NOWAIT);
    close(sv[1]);
    return 0;
}
