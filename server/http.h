/*
 * http.h - the daemon's HTTP/1.1 connections (http.c): accepting, llhttp
 * parsing, limits, timeouts, responses and streams, on the libuv loop thread.
 */
#ifndef KVD_SERVER_HTTP_H
#define KVD_SERVER_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "server/metrics.h"

typedef struct srv_http srv_http;
typedef struct srv_conn srv_conn;
struct uv_loop_s;

struct srv_http_params {
    size_t max_header_bytes;    /* request line + headers (431) */
    int max_headers;            /* header count (431) */
    size_t max_body_bytes;      /* body (413) */
    uint64_t header_timeout_ms; /* from a request's first byte to its headers' end (408) */
    uint64_t idle_timeout_ms;   /* keep-alive idle, and between body reads (408) */
    uint64_t body_timeout_ms;   /* from a request's headers to its body's end (408) */
    int max_connections;        /* open connections; beyond, the longest idle one is
                                   closed, or (none idle) the new one gets 503 */
    size_t write_buffer;        /* bytes a stream may have waiting before its owner is
                                   told to pause (on_pressure) */
    size_t max_write_queue;     /* bytes a stream may have waiting at all; beyond, the
                                   reader is closed (a producer that does not pause) */
};

struct srv_http_header {
    const char *name;  /* as sent (compare case-insensitively) */
    const char *value; /* surrounding whitespace trimmed */
};

/* A parsed request, borrowed for the duration of the handler call. */
struct srv_http_req {
    const char *method; /* "GET", "POST", ... */
    const char *path;   /* URL path, percent-decoding not applied */
    const char *query;  /* after '?', or "" */
    const struct srv_http_header *headers;
    int n_headers;
    const char *body; /* NUL-terminated copy of the body */
    size_t body_len;
};

/* The request handler: must answer with srv_http_respond or
 * srv_http_stream_begin, now or later (on the loop thread). */
typedef void (*srv_http_handler)(void *ud, srv_conn *conn, const struct srv_http_req *req);

srv_http *srv_http_create(struct uv_loop_s *loop, const struct srv_http_params *p,
                          srv_metrics *metrics, srv_http_handler handler, void *ud);
/* Bind and listen. *bound_port gets the port (useful with port 0).
 * Returns 0, or a negative uv error with the reason in err. */
int srv_http_listen(srv_http *h, const char *host, int port, int *bound_port, char *err,
                    size_t errlen);
void srv_http_set_params(srv_http *h, const struct srv_http_params *p);
/* Stop accepting; every later answer closes its connection (idle ones
 * close at their idle timeout or when the server closes). */
void srv_http_drain(srv_http *h);
/* Close every handle; `done` runs once all are closed. */
void srv_http_close(srv_http *h, void (*done)(void *ud), void *ud);
void srv_http_destroy(srv_http *h); /* after done */
/* Open connections (the HTTP fuzzer waits for them to close). */
int srv_http_n_connections(const srv_http *h);

/* Case-insensitive header lookup; NULL when absent. */
const char *srv_http_header(const struct srv_http_req *req, const char *name);

/*
 * Answer the current request in one go. extra_headers: "" or lines each
 * ending in "\r\n". Returns 0, or -EPIPE when the connection is gone.
 */
int srv_http_respond(srv_conn *c, int status, const char *content_type, const char *extra_headers,
                     const char *body, size_t len);
/* A streamed answer: chunked (HTTP/1.1) or close-delimited (1.0). */
int srv_http_stream_begin(srv_conn *c, int status, const char *content_type,
                          const char *extra_headers);
int srv_http_stream_write(srv_conn *c, const char *data, size_t len);
int srv_http_stream_end(srv_conn *c);
/*
 * Attach the handler's state to the connection's current request: if the
 * connection closes before the answer ends, on_gone(owner) runs once (on
 * the loop thread) and the connection must not be used again. on_pressure
 * (may be NULL) is called with pause = true when more than write_buffer
 * bytes of a stream wait for the reader, and with false once half of that
 * has drained: a producer that pauses keeps the connection's memory
 * bounded.
 */
void srv_conn_set_owner(srv_conn *c, void *owner, void (*on_gone)(void *owner),
                        void (*on_pressure)(void *owner, bool pause));
/* Serve an already connected stream socket as if accepted (the fuzzer feeds
 * one end of a socketpair). Returns 0 or a negative uv error. */
int srv_http_open_fd(srv_http *h, int fd);

#endif /* KVD_SERVER_HTTP_H */
