/*
 * http_internal.h - what the HTTP layer's files share (never included
 * from outside server/http*.c): a connection's and the layer's state, and
 * each file's functions the others call.
 *
 * The files, and who calls whom (no circle):
 *   http_listen.c   the public lifecycle: create, listen, drain, close
 *     -> http.c       connections: timers, reading, writing, closing
 *   http_respond.c  answers and streams (srv_http_respond, srv_http_stream_*)
 *     -> http.c
 *   http.c -> http_request.c  parsing one request with llhttp; it records
 *                             what the connection must do (timers, 100
 *                             Continue, an error status) and calls nothing
 *                             above it
 */
#ifndef KVD_SERVER_HTTP_INTERNAL_H
#define KVD_SERVER_HTTP_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include <llhttp.h>
#include <uv.h>

#include "server/http.h"

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

    enum timer_kind timer_want; /* set by the parser: arm this once llhttp returns */
    bool send_continue;         /* set by the parser: answer "100 Continue" then */

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

/* --- http_request.c: one request, parsed ------------------------------------ */

/* realloc that aborts with the size (the connection's bookkeeping). */
void *srv_http_xrealloc(void *p, size_t n);
/* Append to a growing buffer (kept NUL-terminated). */
void srv_http_buf_append(char **p, size_t *len, size_t *cap, const char *data, size_t n);
const char *srv_http_status_text(int status);
/* The llhttp callbacks that fill a connection's request. */
void srv_http_parser_settings(llhttp_settings_t *s);
/* Forget the request (and its answer's owner): ready for the next. */
void srv_http_request_reset(srv_conn *c);
/* The complete request as the handler sees it; hv has room for
 * c->n_hdrs headers. Points into c. */
void srv_http_request_view(srv_conn *c, struct srv_http_header *hv, struct srv_http_req *req);

/* --- http.c: connections ------------------------------------------------------ */

void srv_conn_close(srv_conn *c);
/* Queue bytes (copied; a then b). Returns 0 or -EPIPE. */
int srv_conn_write(srv_conn *c, const char *a, size_t alen, const char *b, size_t blen,
                   bool then_close);
/* A stream's piece is queued: pause the producer or cut the reader. */
int srv_conn_stream_judge(srv_conn *c);
/* The answer to the current request is complete. */
void srv_conn_response_done(srv_conn *c);
void srv_conn_timer_arm(srv_conn *c, enum timer_kind k, uint64_t ms);
srv_conn *srv_conn_new(srv_http *h);
void srv_conn_start(srv_conn *c);
void srv_http_on_connection(uv_stream_t *server, int status);

#endif /* KVD_SERVER_HTTP_INTERNAL_H */
