/*
 * client.h - the HTTP client of `kvd load` (client.c).
 *
 * client.c is a small blocking HTTP/1.1 client over one keep-alive
 * connection, parsing responses with llhttp and handing body bytes to a
 * callback as they arrive, so streamed (SSE) completions can be timed token
 * by token. cmd_load.c drives scenarios with one thread per concurrent
 * client and reports latency and throughput per step.
 */
#ifndef KVD_LOAD_CLIENT_H
#define KVD_LOAD_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct lc_conn;

/* Called with each piece of the response body as it arrives. */
typedef void (*lc_body_cb)(void *user, const char *data, size_t len);

struct lc_response {
    int status; /* HTTP status, or 0 when the exchange failed */
    char *body; /* whole body, NUL-terminated (owned: free with lc_response_free) */
    size_t len;
};

/* Connect to host:port (numeric IPv4/IPv6). NULL with err filled on failure. */
struct lc_conn *lc_connect(const char *host, int port, double timeout_s, char *err, size_t errlen);
void lc_close(struct lc_conn *c);

/*
 * Send one request and read its response. cb (may be NULL) sees body bytes
 * as they arrive; the whole body is also collected in resp. Reconnects once
 * if the server closed an idle keep-alive connection. Returns 0, or -1 with
 * err filled (resp->status is then 0).
 */
int lc_request(struct lc_conn *c, const char *method, const char *path, const char *headers,
               const char *body, lc_body_cb cb, void *user, struct lc_response *resp, char *err,
               size_t errlen);
void lc_response_free(struct lc_response *resp);

/* Split "http://HOST:PORT" (or "HOST:PORT"); 0 or -1. host gets a copy. */
int lc_parse_url(const char *url, char *host, size_t hostlen, int *port);

/* Whether a numeric host address is loopback (127.0.0.0/8, ::1, localhost). */
bool lc_is_loopback(const char *host);

/* Monotonic seconds. */
double lc_now(void);

#endif /* KVD_LOAD_CLIENT_H */
