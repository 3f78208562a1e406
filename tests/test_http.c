/*
 * test_http.c - the HTTP layer of `kvd serve` under hostile and careless
 * clients, end to end against the real binary ($KVD_BIN) on a free
 * loopback port, over plain sockets (tests/http_client.h).
 *
 * The bad-input matrix is data: every tests/cases/http/NAME.http is sent
 * raw and its answer checked (status, error type, message fragment,
 * headers; see that folder's README), and then the whole matrix is sent
 * again until 1,000 requests have gone by, after which the server's RSS,
 * open descriptors, free KV pages and queue depth must be back at their
 * baseline. The rest are the connection limits, each a regression test:
 * a body's overall deadline, idle connections shed for new ones, a reader
 * that stops reading closed and counted while the stream's generation
 * pauses, a large answer to a slow but steady reader sent whole, and an
 * Upgrade that does not swallow the next pipelined request.
 *
 * No assertion is on wall-clock speed: waits are for states, with
 * generous deadlines.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <dirent.h>
#include <jansson.h>

#include "model/mkmodel.h"
#include "model/model.h"
#include "tests/serve_fixture.h"

/* ------------------------------------------------------------------------
 * Helpers: raw connections
 * ------------------------------------------------------------------------ */

/* A connection to the server; rcvbuf > 0 shrinks the receive buffer first
 * (so a client that stops reading holds back little). */
static int raw_connect(int port, int rcvbuf)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    if (rcvbuf > 0)
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    struct timeval tv = {30, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    return fd;
}

/* Send a JSON POST on fd; headers: "" or lines ending in CRLF. */
static void send_post(int fd, const char *path, const char *headers, const char *body)
{
    char req[2048];
    int n = snprintf(req, sizeof(req),
                     "POST %s HTTP/1.1\r\nHost: kvd\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n%s\r\n%s",
                     path, strlen(body), headers, body);
    assert_true(n > 0 && (size_t)n < sizeof(req));
    assert_int_equal(send(fd, req, (size_t)n, 0), n);
}

/* Whether the peer has closed fd (EOF or reset) within `seconds`,
 * discarding whatever it sent before. */
static bool closed_within(int fd, double seconds)
{
    double deadline = su_now() + seconds;
    char buf[65536];
    while (su_now() < deadline) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 100) <= 0)
            continue;
        ssize_t n = recv(fd, buf, sizeof(buf), 0);
        if (n <= 0)
            return true;
    }
    return false;
}

/* ------------------------------------------------------------------------
 * The bad-input matrix
 * ------------------------------------------------------------------------ */

/* Expand a case file's request part (see tests/cases/http/README). */
static char *expand_case(const char *src, size_t *out_len)
{
    size_t cap = strlen(src) * 2 + 8192, n = 0;
    char *out = malloc(cap);
    for (const char *p = src; *p;) {
        if (n + 4096 > cap) {
            cap *= 2;
            out = realloc(out, cap);
        }
        if (*p == '\n') {
            out[n++] = '\r';
            out[n++] = '\n';
            p++;
        } else if (p[0] == '\\' && p[1] == 'x') {
            char hex[3] = {p[2], p[3], 0};
            out[n++] = (char)strtol(hex, NULL, 16);
            p += 4;
        } else if (p[0] == '\\' && p[1] == '\\') {
            out[n++] = '\\';
            p += 2;
        } else if (!strncmp(p, "{{REPEAT:", 9)) {
            int count = atoi(p + 9);
            const char *c = strchr(p + 9, ':');
            while (n + (size_t)count + 16 > cap) {
                cap *= 2;
                out = realloc(out, cap);
            }
            memset(out + n, c[1], (size_t)count);
            n += (size_t)count;
            p = strstr(p, "}}") + 2;
        } else {
            out[n++] = *p++;
        }
    }
    out[n] = '\0';
    /* {{LEN}}: the body's length */
    char *len = strstr(out, "{{LEN}}");
    if (len) {
        char *body = strstr(out, "\r\n\r\n");
        size_t bl = body ? n - (size_t)(body + 4 - out) : 0;
        char num[32];
        int k = snprintf(num, sizeof(num), "%zu", bl);
        memmove(len + k, len + 7, n - (size_t)(len + 7 - out) + 1);
        memcpy(len, num, (size_t)k);
        n = n - 7 + (size_t)k;
    }
    *out_len = n;
    return out;
}

struct hcase {
    char name[256];
    int expect;          /* status */
    char type[64];       /* error type, or "" */
    char message[256];   /* a fragment of the error message, or "" */
    char header[8][256]; /* "Name: value" the answer must carry */
    int n_header;
    bool no_body; /* a HEAD request: the answer has no body */
    char *req;    /* the raw request */
    size_t req_len;
};

static int load_case(const char *dir, const char *file, struct hcase *c)
{
    char path[1024];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    FILE *f = fopen(path, "rb");
    if (!f)
        return -1;
    static char text[65536];
    size_t tl = fread(text, 1, sizeof(text) - 1, f);
    fclose(f);
    text[tl] = '\0';
    char *sep = strstr(text, "----\n");
    if (!sep)
        fail_msg("%s: no ---- line", path);
    *sep = '\0';
    memset(c, 0, sizeof(*c));
    snprintf(c->name, sizeof(c->name), "%s", file);
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        if (!strncmp(line, "expect ", 7))
            c->expect = atoi(line + 7);
        else if (!strncmp(line, "type ", 5))
            snprintf(c->type, sizeof(c->type), "%s", line + 5);
        else if (!strncmp(line, "message ", 8))
            snprintf(c->message, sizeof(c->message), "%s", line + 8);
        else if (!strncmp(line, "header ", 7) && c->n_header < 8)
            snprintf(c->header[c->n_header++], sizeof(c->header[0]), "%s", line + 7);
        else if (!strcmp(line, "no-body"))
            c->no_body = true;
    }
    if (c->expect < 200)
        fail_msg("%s: no expect line", path);
    c->req = expand_case(sep + 5, &c->req_len);
    return 0;
}

/* Send one case on a fresh connection and check the answer. */
static void run_case(int port, const struct hcase *c)
{
    struct hc h;
    assert_int_equal(hc_open(&h, port), 0);
    assert_int_equal(hc_send(&h, c->req, c->req_len), 0);
    struct resp r;
    int rc = hc_read_head(&h, &r);
    if (rc == 0 && !c->no_body)
        rc = hc_read_body(&h, &r);
    if (rc != 0 || r.status != c->expect)
        print_message("case %s: got %d, want %d: %s\n", c->name, rc ? -1 : r.status, c->expect,
                      r.body ? r.body : "");
    assert_int_equal(rc, 0);
    assert_int_equal(r.status, c->expect);
    if (c->no_body) {
        /* Nothing may follow the head: the next bytes would be a body. */
        struct pollfd p = {h.fd, POLLIN, 0};
        assert_int_equal(h.len - h.off, 0);
        if (poll(&p, 1, 200) > 0) {
            char b;
            assert_true(recv(h.fd, &b, 1, MSG_DONTWAIT) <= 0);
        }
    }
    if (c->expect >= 400 && !c->no_body) {
        json_t *v = json_loads(r.body ? r.body : "", 0, NULL);
        if (!v)
            fail_msg("case %s: not JSON: %s", c->name, r.body ? r.body : "(none)");
        json_t *e = json_object_get(v, "error");
        assert_true(json_is_object(e));
        const char *msg = json_string_value(json_object_get(e, "message"));
        const char *type = json_string_value(json_object_get(e, "type"));
        assert_non_null(msg);
        assert_non_null(type);
        assert_non_null(json_object_get(e, "param"));
        assert_non_null(json_object_get(e, "code"));
        if (c->type[0] && strcmp(type, c->type))
            fail_msg("case %s: error type %s, want %s", c->name, type, c->type);
        if (c->message[0] && !strstr(msg, c->message))
            fail_msg("case %s: message '%s' lacks '%s'", c->name, msg, c->message);
        json_decref(v);
    }
    for (int i = 0; i < c->n_header; i++) {
        char name[128], v[256];
        const char *colon = strchr(c->header[i], ':');
        assert_non_null(colon);
        snprintf(name, sizeof(name), "%.*s", (int)(colon - c->header[i]), c->header[i]);
        if (!resp_header(&r, name, v, sizeof(v)))
            fail_msg("case %s: no %s header", c->name, name);
        assert_string_equal(v, colon + 2);
    }
    resp_free(&r);
    hc_close(&h);
}

struct baseline {
    long rss_kb;
    int fds;
    double pages_free, queue;
};

static struct baseline baseline_of(const struct su_proc *p)
{
    return (struct baseline){su_rss_kb(p->pid), su_fds(p->pid),
                             su_metric(p->port, "kvd_kv_pages_free"),
                             su_metric(p->port, "kvd_queue_depth")};
}

static void test_bad_input_matrix(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *dir = "tests/cases/http";
    DIR *d = opendir(dir);
    if (!d) {
        print_message("%s not found (run from the repository root)\n", dir);
        skip();
    }
    static struct hcase cases[256];
    int n = 0;
    for (struct dirent *de; (de = readdir(d)) && n < 256;) {
        size_t nl = strlen(de->d_name);
        if (nl > 5 && !strcmp(de->d_name + nl - 5, ".http"))
            assert_int_equal(load_case(dir, de->d_name, &cases[n++]), 0);
    }
    closedir(d);
    assert_true(n >= 40);

    /* The limits the cases are written for (tests/cases/http/README). */
    static const char *const args[] = {
        "--set", "limits.max_header_bytes=1KiB",  "--set", "limits.max_headers=16",
        "--set", "limits.max_body_bytes=2KiB",    "--set", "limits.max_prompt_tokens=64",
        "--set", "limits.max_tokens=256",         "--set", "cache.memory=2MiB",
        "--set", "eviction.max_cache_tokens=128", "--set", "server.threads=1",
    };
    struct su_proc s = {0};
    serve(&s, "matrix", args, (int)(sizeof(args) / sizeof(args[0])));

    /* One pass: every case answered as written, the server still serving. */
    for (int i = 0; i < n; i++) {
        run_case(s.port, &cases[i]);
        assert_int_equal(http_status_simple(s.port, "/health"), 200);
    }
    print_message("%d HTTP cases\n", n);
    struct baseline b0 = baseline_of(&s);

    /* Then 1,000 more, and nothing may have stayed behind. */
    for (int k = 0; k < 1000; k++)
        run_case(s.port, &cases[k % n]);
    struct baseline b1 = baseline_of(&s);
    double deadline = su_now() + 15; /* lingering closes end within seconds */
    /* At most the baseline's: a connection of the first pass may still have
     * been closing when b0 was taken, so fewer is fine; more is a leak. */
    while (b1.fds > b0.fds && su_now() < deadline) {
        su_sleep_ms(100);
        b1 = baseline_of(&s);
    }
    print_message("after 1000 cases: RSS %ld -> %ld KiB, fds %d -> %d, free pages %g -> %g, "
                  "queue %g -> %g\n",
                  b0.rss_kb, b1.rss_kb, b0.fds, b1.fds, b0.pages_free, b1.pages_free, b0.queue,
                  b1.queue);
    assert_true(b1.fds <= b0.fds);
    assert_true(b1.pages_free == b0.pages_free);
    assert_true(b1.queue == 0);
    /* Allocator slack, not growth: 1,000 requests that leaked even 4 KiB
     * each would show as 4 MiB. Under ASan the server's 8 MiB quarantine
     * (su_spawn) fills first; its leak check at exit covers that case. */
    long slack_kb = getenv("ASAN_OPTIONS") ? 2048 + 8192 : 2048;
    assert_true(b1.rss_kb <= b0.rss_kb + slack_kb);
    server_stop(&s);
    for (int i = 0; i < n; i++)
        free(cases[i].req);
}

/* ------------------------------------------------------------------------
 * Connection limits
 * ------------------------------------------------------------------------ */

/* A body dribbled a byte at a time never completes within body_timeout:
 * 408 (and counted), though each byte comes well within idle_timeout. */
static void test_body_deadline(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "limits.body_timeout=1s",
                                       "--set", "limits.idle_timeout=5s",
                                       "--set", "server.threads=1"};
    struct su_proc s = {0};
    serve(&s, "body-deadline", args, 6);
    struct hc h;
    assert_int_equal(hc_open(&h, s.port), 0);
    const char *head = "POST /v1/completions HTTP/1.1\r\nHost: kvd\r\n"
                       "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n";
    assert_int_equal(hc_send(&h, head, strlen(head)), 0);
    double t0 = su_now();
    int status = -1;
    /* One byte every 200 ms, for up to 10 s (the old server waited forever). */
    for (int i = 0; i < 50; i++) {
        struct pollfd p = {h.fd, POLLIN, 0};
        if (poll(&p, 1, 200) > 0)
            break;
        if (hc_send(&h, " ", 1))
            break;
    }
    struct resp r;
    if (hc_read_head(&h, &r) == 0)
        status = r.status;
    print_message("dribbled body: %d after %.1f s\n", status, su_now() - t0);
    assert_int_equal(status, 408);
    hc_close(&h);
    assert_int_equal(
        su_metric(s.port, "kvd_http_connections_closed_total{reason=\"body_timeout\"}"), 1);
    server_stop(&s);
}

/* With every slot held by idle keep-alive connections, a new one takes the
 * slot of the longest idle (which is closed) instead of getting 503. */
static void test_idle_connections_shed(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "server.max_connections=4",
                                       "--set", "limits.idle_timeout=1h",
                                       "--set", "server.threads=1"};
    struct su_proc s = {0};
    serve(&s, "shed", args, 6);
    int idle[4];
    for (int i = 0; i < 4; i++) {
        idle[i] = raw_connect(s.port, 0);
        su_sleep_ms(20); /* so their ages differ */
    }
    su_sleep_ms(200);
    /* A fifth: served, and the oldest idle connection is the one closed. */
    assert_int_equal(http_status_simple(s.port, "/health"), 200);
    assert_true(closed_within(idle[0], 5));
    for (int i = 1; i < 4; i++) {
        struct pollfd p = {idle[i], POLLIN, 0};
        assert_int_equal(poll(&p, 1, 0), 0);
    }
    assert_true(su_metric(s.port, "kvd_http_connections_closed_total{reason=\"shed_idle\"}") >= 1);
    /* A busy connection (mid-request) is never shed: with three idle and
     * one busy, new connections go on being served. */
    for (int i = 0; i < 4; i++)
        close(idle[i]);
    server_stop(&s);
}

/*
 * A streaming client that stops reading: the stream's generation pauses
 * once write_buffer bytes wait (the server holds little), and after
 * idle_timeout with nothing taken the connection is closed and counted as
 * a slow reader, while other clients are served all along.
 */
static void test_slow_reader_closed(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {
        "--set", "limits.write_buffer=64KiB", "--set", "limits.idle_timeout=2s",
        "--set", "limits.max_tokens=4096",    "--set", "server.threads=1"};
    struct su_proc s = {0};
    serve(&s, "slow-reader", args, 8);
    long rss0 = su_rss_kb(s.pid);
    int fd = raw_connect(s.port, 4096);
    /* Every token with 200 alternatives: ~10 KiB of SSE per token. */
    const char *body = "{\"prompt\":\"Once upon a time\",\"max_tokens\":4000,\"logprobs\":200,"
                       "\"ignore_eos\":true,\"stream\":true,\"temperature\":0}";
    send_post(fd, "/v1/completions", "", body);
    /* Never read. The server stays responsive meanwhile. */
    assert_int_equal(http_status_simple(s.port, "/health"), 200);
    assert_true(su_wait_metric_at_least(
        s.port, "kvd_http_connections_closed_total{reason=\"slow_reader\"}", 1, 30));
    long rss1 = su_rss_kb(s.pid);
    print_message("RSS %ld -> %ld KiB while the stream was stalled\n", rss0, rss1);
    assert_true(closed_within(fd, 10));
    close(fd);
    /* Its request ended (cancelled), so the slot is free again. */
    assert_true(su_wait_metric_at_least(s.port, "kvd_requests_cancelled_total", 1, 10));
    assert_int_equal(http_status_simple(s.port, "/health"), 200);
    server_stop(&s);
}

/*
 * A non-streamed answer far larger than write_buffer and max_write_queue
 * (8 x write_buffer) reaches a reader that takes it slowly but steadily,
 * whole and with a normal finish: a large answer is not a slow reader.
 */
static void test_large_answer_slow_steady_reader(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "limits.write_buffer=64KiB",
                                       "--set", "limits.idle_timeout=2s",
                                       "--set", "server.threads=1"};
    struct su_proc s = {0};
    serve(&s, "large-answer", args, 6);
    int fd = raw_connect(s.port, 16384);
    const char *body = "{\"prompt\":\"Once upon a time\",\"n_predict\":512,\"n_probs\":100,"
                       "\"ignore_eos\":true,\"temperature\":0}";
    send_post(fd, "/completion", "Connection: close\r\n", body);
    /* Read 64 KiB, then pause 100 ms, to the end. */
    size_t cap = 1 << 20, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 65536 + 1 > cap)
            buf = realloc(buf, cap *= 2);
        size_t want = 65536, got = 0;
        ssize_t k = 1;
        while (got < want && (k = recv(fd, buf + len + got, want - got, 0)) > 0)
            got += (size_t)k;
        len += got;
        if (k <= 0)
            break;
        su_sleep_ms(100);
    }
    buf[len] = '\0';
    close(fd);
    char *json = strstr(buf, "\r\n\r\n");
    assert_non_null(json);
    print_message("answer: %zu bytes\n", len);
    assert_true(len > 8 * 65536 * 2);
    json_error_t jerr;
    json_t *v = json_loads(json + 4, JSON_ALLOW_NUL, &jerr);
    if (!v)
        print_message("not JSON: %s at %d\n", jerr.text, jerr.position);
    assert_non_null(v);
    assert_int_equal(json_array_size(json_object_get(v, "completion_probabilities")), 512);
    assert_string_equal(json_string_value(json_object_get(v, "stop_type")), "limit");
    json_decref(v);
    free(buf);
    assert_int_equal(su_metric(s.port, "kvd_http_connections_closed_total{reason=\"slow_reader\"}"),
                     0);
    server_stop(&s);
}

/*
 * Log-probabilities amplified: 4,096 tokens with 512 alternatives each,
 * non-streamed, took 1.5 GB (the whole answer as one JSON tree). Beyond
 * ENGINE_MAX_LOGPROB_ENTRIES the request is refused before any work, naming
 * the cap, and the server's memory stays where it was; streamed, the same
 * request is served (each event carries its own entries).
 */
static void test_logprob_answer_capped(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "server.threads=1"};
    struct su_proc s = {0};
    serve(&s, "logprob-cap", args, 2);
    long rss0 = su_rss_kb(s.pid);
    static const char *const bodies[][2] = {
        {"/completion", "{\"prompt\":\"Once upon a time\",\"n_predict\":4096,\"n_probs\":512,"
                        "\"ignore_eos\":true}"},
        {"/v1/completions", "{\"prompt\":\"Once\",\"max_tokens\":4096,\"logprobs\":100}"},
        {"/v1/chat/completions", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                                 "\"max_tokens\":4096,\"logprobs\":true,\"top_logprobs\":100}"},
    };
    for (int i = 0; i < 3; i++) {
        struct resp r;
        int st = http(s.port, "POST", bodies[i][0], NULL, bodies[i][1], &r);
        if (st != 400)
            print_message("%s: %d %s\n", bodies[i][0], st, r.body ? r.body : "");
        assert_int_equal(st, 400);
        assert_non_null(strstr(r.body, "at most 262144"));
        resp_free(&r);
    }
    long rss1 = su_rss_kb(s.pid);
    print_message("RSS %ld -> %ld KiB\n", rss0, rss1);
    assert_true(rss1 < rss0 + 16384);
    /* Streamed, the same request is served. */
    int fd = raw_connect(s.port, 0);
    send_post(fd, "/completion", "",
              "{\"prompt\":\"Once\",\"n_predict\":4096,\"n_probs\":512,\"stream\":true}");
    char head[64] = "";
    assert_true(recv(fd, head, sizeof(head) - 1, MSG_WAITALL) > 12);
    assert_int_equal(strncmp(head, "HTTP/1.1 200", 12), 0);
    close(fd);
    server_stop(&s);
}

/* ------------------------------------------------------------------------
 * Conformance that a single-request case cannot show
 * ------------------------------------------------------------------------ */

/* Connection: Upgrade is ignored (kvd speaks only HTTP/1.x), so a request
 * pipelined after it is parsed and answered as a request. */
static void test_upgrade_then_pipelined(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc s = {0};
    static const char *const args[] = {"--set", "server.threads=1"};
    serve(&s, "upgrade", args, 2);
    struct hc h;
    assert_int_equal(hc_open(&h, s.port), 0);
    const char *two = "GET /health HTTP/1.1\r\nHost: kvd\r\nConnection: Upgrade\r\n"
                      "Upgrade: websocket\r\n\r\n"
                      "GET /v1/models HTTP/1.1\r\nHost: kvd\r\n\r\n";
    assert_int_equal(hc_send(&h, two, strlen(two)), 0);
    struct resp r;
    assert_int_equal(hc_read(&h, &r), 0);
    assert_int_equal(r.status, 200);
    resp_free(&r);
    assert_int_equal(hc_read(&h, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body, "\"data\""));
    resp_free(&r);
    hc_close(&h);
    server_stop(&s);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("http", 7, false);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_input_matrix),
        cmocka_unit_test(test_body_deadline),
        cmocka_unit_test(test_idle_connections_shed),
        cmocka_unit_test(test_slow_reader_closed),
        cmocka_unit_test(test_large_answer_slow_steady_reader),
        cmocka_unit_test(test_logprob_answer_capped),
        cmocka_unit_test(test_upgrade_then_pipelined),
    };
    return cmocka_run_group_tests_name("http", tests, group_setup, group_teardown);
}
