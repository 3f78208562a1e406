/*
 * route_fuzz.h - what the per-route JSON fuzz targets (fuzz_route_*.c)
 * share: the real `kvd serve` run inside the fuzzer's process, and one
 * request per call over loopback, with the answer checked.
 *
 * The server is srv_cmd_serve itself (linked in), on a thread of this
 * process, serving a small model mkmodel writes into a scratch directory,
 * so every input takes the whole request path: the HTTP layer, auth,
 * routing, the route's JSON decoding and validation (the code under test),
 * tokenization, admission, the engine, and the answer's shaping, with
 * coverage counted in all of it. Limits are small (8 tokens out, 256-token
 * prompts, a 128-token cache) so a valid input finishes in milliseconds.
 *
 * What an answer must be, whatever the input (a violation traps, and
 * libFuzzer keeps the input):
 *   - there is one: a status line within 20 s, the server still running;
 *   - never 500: bad input is the client's error (4xx), not ours;
 *   - a 4xx/5xx body is JSON with an "error" object carrying a non-empty
 *     "message" (503/429 are allowed only with that body too);
 *   - a 200 JSON body parses, and every SSE "data:" line of a 200 stream is
 *     JSON or [DONE], and a stream ends with [DONE] (llama.cpp: an event
 *     with "stop": true) or an error event.
 * Include from exactly one fuzz_route_*.c: this header defines
 * LLVMFuzzerInitialize (the server starts there), the target defines
 * LLVMFuzzerTestOneInput with route_post()/route_request().
 */
#ifndef KVD_FUZZ_ROUTE_FUZZ_H
#define KVD_FUZZ_ROUTE_FUZZ_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/config.h"
#include "model/mkmodel.h"

static int route_port;
static char route_dir[64];
static char route_model[128];
static char route_listen[64];

static void *route_serve_main(void *arg)
{
    (void)arg;
    char *argv[] = {
        "serve",
        "--model",
        route_model,
        "--listen",
        route_listen,
        "--set",
        "cache.memory=2MiB",
        "--set",
        "eviction.max_cache_tokens=128",
        "--set",
        "limits.max_tokens=8",
        "--set",
        "limits.max_prompt_tokens=256",
        "--set",
        "limits.max_running=4",
        "--set",
        "server.threads=1",
        "--set",
        "log.level=error",
        NULL,
    };
    int argc = (int)(sizeof(argv) / sizeof(argv[0])) - 1;
    int rc = srv_cmd_serve(argc, argv);
    fprintf(stderr, "route fuzz: kvd serve returned %d\n", rc);
    __builtin_trap(); /* the server never ends while the fuzzer runs */
}

/* A loopback port that was free a moment ago. */
static int route_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = -1;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0)
        close(fd);
    return port;
}

static char route_why[128]; /* why route_exchange got no answer */

/* A connection to the server. A few hundred requests a second can run the
 * machine out of local ports for a moment (EADDRNOTAVAIL): that is retried
 * for up to 10 s, as is a full listen queue or a signal (libFuzzer's
 * timer). -1 when it cannot connect. */
static int route_connect(void)
{
    for (int tries = 0;; tries++) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (fd < 0)
            abort();
        struct timeval tv = {20, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)route_port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        if (connect(fd, (struct sockaddr *)&a, sizeof(a)) == 0)
            return fd;
        int err = errno;
        close(fd);
        snprintf(route_why, sizeof(route_why), "connect: %s", strerror(err));
        if ((err != EADDRNOTAVAIL && err != EAGAIN && err != ECONNREFUSED && err != EINTR) ||
            tries >= 1000)
            return -1;
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

/* One raw request; the whole answer (new, NUL-terminated) or NULL when
 * none came (route_why says why: refused, reset, 20 s without a byte). */
static char *route_exchange(const char *req, size_t req_len, size_t *out_len)
{
    int fd = route_connect();
    if (fd < 0)
        return NULL;
    size_t off = 0;
    while (off < req_len) {
        ssize_t w = send(fd, req + off, req_len - off, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) /* libFuzzer's timer signal */
            continue;
        if (w <= 0)
            break; /* the server may answer (413, 400) before the whole body */
        off += (size_t)w;
    }
    size_t len = 0, cap = 1 << 16;
    char *buf = malloc(cap);
    if (!buf)
        abort();
    for (;;) {
        if (len + 4096 > cap && !(buf = realloc(buf, cap *= 2)))
            abort();
        ssize_t k = recv(fd, buf + len, cap - len - 1, 0);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            snprintf(route_why, sizeof(route_why), "recv after %zu bytes: %s", len,
                     strerror(errno));
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = '\0';
    *out_len = len;
    return buf;
}

static bool route_started;

/* Start the server once (LLVMFuzzerInitialize). */
static void route_start(void)
{
    setenv("OMP_NUM_THREADS", "1", 0);
    setenv("OMP_WAIT_POLICY", "passive", 0);
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    snprintf(route_dir, sizeof(route_dir), "/tmp/kvd-fuzz-route-XXXXXX");
    if (!mkdtemp(route_dir))
        abort();
    snprintf(route_model, sizeof(route_model), "%s/tiny.gguf", route_dir);
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 64;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_ff = 128;
    p.n_vocab = 512;
    p.seed = 7;
    char err[256];
    if (model_mk_write(&p, route_model, err, sizeof(err)) != 0) {
        fprintf(stderr, "route fuzz: %s\n", err);
        abort();
    }
    route_port = route_free_port();
    snprintf(route_listen, sizeof(route_listen), "127.0.0.1:%d", route_port);
    pthread_t th;
    if (pthread_create(&th, NULL, route_serve_main, NULL))
        abort();
    pthread_detach(th);
    const char health[] = "GET /health HTTP/1.1\r\nHost: f\r\nConnection: close\r\n\r\n";
    for (int i = 0; i < 3000; i++) {
        size_t n;
        char *r = route_exchange(health, sizeof(health) - 1, &n);
        bool up = r && !strncmp(r, "HTTP/1.1 200", 12);
        free(r);
        if (up) { /* the model is loaded (mapped): its file can go now */
            unlink(route_model);
            rmdir(route_dir);
            route_started = true;
            return;
        }
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "route fuzz: kvd serve did not become healthy on %s\n", route_listen);
    abort();
}

/* Un-chunk a chunked body in place; returns its new length. */
static size_t route_unchunk(char *b, size_t len)
{
    char *in = b, *out = b, *end = b + len;
    while (in < end) {
        char *stop;
        unsigned long n = strtoul(in, &stop, 16);
        char *nl = strstr(stop, "\r\n");
        if (!nl || n == 0 || (size_t)(end - nl - 2) < n)
            break;
        memmove(out, nl + 2, n);
        out += n;
        in = nl + 2 + n + 2;
    }
    *out = '\0';
    return (size_t)(out - b);
}

static void route_fail(const char *why, const char *answer)
{
    fprintf(stderr, "route fuzz: %s\n---- answer ----\n%.4000s\n", why, answer ? answer : "(none)");
    __builtin_trap();
}

/* The checks above, on one whole answer. Returns the status. */
static int route_check(char *ans, size_t len)
{
    int status = 0;
    if (!ans || sscanf(ans, "HTTP/1.%*d %d", &status) != 1) {
        fprintf(stderr, "route fuzz: %s\n", route_why);
        route_fail("no answer", ans);
    }
    char *sep = strstr(ans, "\r\n\r\n");
    if (!sep)
        route_fail("no end of head", ans);
    *sep = '\0';
    char *body = sep + 4;
    size_t blen = len - (size_t)(body - ans);
    if (strcasestr(ans, "transfer-encoding: chunked"))
        blen = route_unchunk(body, blen);
    bool sse = strcasestr(ans, "content-type: text/event-stream") != NULL;
    bool json = strcasestr(ans, "content-type: application/json") != NULL;
    if (status == 500)
        route_fail("500 for a client's input", body);
    if (status >= 400) {
        json_t *v = json_loadb(body, blen, 0, NULL);
        json_t *m = json_object_get(json_object_get(v, "error"), "message");
        if (!json_is_string(m) || !*json_string_value(m))
            route_fail("error answer without a JSON error message", body);
        json_decref(v);
    } else if (status == 200 && sse) {
        bool done = false, error = false; /* [DONE], or llama.cpp's "stop": true */
        char *whole = strdup(body);       /* for the message: the loop cuts body up */
        for (char *l = body; l && *l;) {
            char *nl = strstr(l, "\n\n");
            if (nl)
                *nl = '\0';
            if (!strncmp(l, "data: ", 6)) {
                if (!strcmp(l + 6, "[DONE]")) {
                    done = true;
                } else {
                    json_t *v = json_loads(l + 6, JSON_ALLOW_NUL, NULL);
                    if (!v)
                        route_fail("an SSE event that is not JSON", l);
                    error = error || json_object_get(v, "error") != NULL;
                    done = done || json_is_true(json_object_get(v, "stop"));
                    json_decref(v);
                }
            }
            l = nl ? nl + 2 : NULL;
        }
        if (!done && !error)
            route_fail("a stream without [DONE] or an error event", whole);
        free(whole);
    } else if (status == 200 && json) {
        json_t *v = json_loadb(body, blen, JSON_ALLOW_NUL, NULL);
        if (!v)
            route_fail("a 200 JSON answer that does not parse", body);
        json_decref(v);
    }
    return status;
}

/*
 * METHOD PATH with extra header lines (each ending in CRLF, or "") and
 * the body; the answer checked. Returns the status.
 */
static int route_request(const char *method, const char *path, const char *headers,
                         const uint8_t *body, size_t n)
{
    if (!route_started)
        abort();
    size_t cap = n + strlen(path) + strlen(headers) + 256;
    char *req = malloc(cap);
    if (!req)
        abort();
    int h = snprintf(req, cap,
                     "%s %s HTTP/1.1\r\nHost: f\r\nConnection: close\r\n%s"
                     "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n",
                     method, path, headers, n);
    memcpy(req + h, body, n);
    size_t alen = 0;
    char *ans = route_exchange(req, (size_t)h + n, &alen);
    free(req);
    int status = route_check(ans, alen);
    free(ans);
    return status;
}

/* POST the input as a route's JSON body. */
static __attribute__((unused)) int route_post(const char *path, const uint8_t *body, size_t n)
{
    return route_request("POST", path, "", body, n);
}

/* libFuzzer's start: the server, once. */
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    route_start();
    return 0;
}

#endif /* KVD_FUZZ_ROUTE_FUZZ_H */
