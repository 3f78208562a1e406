/*
 * bench_server.c - the daemon under load: requests per second for 16-token
 * completions at concurrency 1, 4 and 16, time to first token and
 * inter-token latency (p50, p99), through /v1/completions and llama.cpp's
 * /completion.
 *
 * The server is the real `kvd serve` code (srv_cmd_serve, linked in) run in
 * a forked child on a free loopback port, serving mkmodel's default model
 * (the one `make run` serves) from a temporary directory. Clients are
 * threads with one keep-alive connection each, sending streamed requests
 * with ignore_eos so every request yields exactly 16 tokens; latencies are
 * measured at the client from the SSE events as they arrive. Ratios printed
 * at the end compare rows of this same run.
 *
 * Then the prefix cache: time to first token when every request opens with
 * the same 2,000 tokens (a system prompt), on a server with [cache]
 * prefix_cache on and on one with it off, same load.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/config.h"
#include "model/mkmodel.h"

#define TOKENS 16

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* --- a minimal keep-alive client for chunked SSE answers ------------------ */

struct conn {
    int fd;
    char buf[1 << 16];
    size_t len, off;
    double t_recv; /* when the last bytes arrived */
};

static int conn_open(struct conn *c, int port)
{
    c->len = c->off = 0;
    c->fd = socket(AF_INET, SOCK_STREAM, 0);
    struct timeval tv = {60, 0};
    setsockopt(c->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return connect(c->fd, (struct sockaddr *)&a, sizeof(a));
}

static int conn_line(struct conn *c, char *out, size_t cap)
{
    for (;;) {
        char *nl = memmem(c->buf + c->off, c->len - c->off, "\r\n", 2);
        if (nl) {
            size_t n = (size_t)(nl - (c->buf + c->off));
            if (n >= cap)
                n = cap - 1;
            memcpy(out, c->buf + c->off, n);
            out[n] = '\0';
            c->off = (size_t)(nl - c->buf) + 2;
            return 0;
        }
        if (c->off > 0) {
            memmove(c->buf, c->buf + c->off, c->len - c->off);
            c->len -= c->off;
            c->off = 0;
        }
        ssize_t r = recv(c->fd, c->buf + c->len, sizeof(c->buf) - c->len, 0);
        if (r <= 0)
            return -1;
        c->t_recv = now_s();
        c->len += (size_t)r;
    }
}

static int conn_skip(struct conn *c, size_t n)
{
    while (c->len - c->off < n) {
        n -= c->len - c->off;
        c->off = c->len = 0;
        ssize_t r = recv(c->fd, c->buf, sizeof(c->buf), 0);
        if (r <= 0)
            return -1;
        c->t_recv = now_s();
        c->len = (size_t)r;
    }
    c->off += n;
    return 0;
}

/* One streamed request; fills the arrival time of each event. Returns the
 * number of content events, or -1. */
static int stream_request(struct conn *c, const char *path, const char *body, double *t_send,
                          double *t_ev, int max_ev)
{
    char head[512];
    int n = snprintf(head, sizeof(head),
                     "POST %s HTTP/1.1\r\nHost: bench\r\nContent-Length: %zu\r\n\r\n", path,
                     strlen(body));
    *t_send = now_s();
    if (send(c->fd, head, (size_t)n, MSG_NOSIGNAL) != n ||
        send(c->fd, body, strlen(body), MSG_NOSIGNAL) != (ssize_t)strlen(body))
        return -1;
    char line[1024];
    if (conn_line(c, line, sizeof(line)) || !strstr(line, " 200 "))
        return -1;
    while (line[0])
        if (conn_line(c, line, sizeof(line)))
            return -1;
    int k = 0;
    for (;;) {
        if (conn_line(c, line, sizeof(line)))
            return -1;
        size_t sz = strtoul(line, NULL, 16);
        if (sz == 0) {
            conn_line(c, line, sizeof(line));
            return k;
        }
        /* one chunk = one SSE event; the final ones carry no text */
        bool text = false;
        size_t avail = c->len - c->off;
        const char *p = c->buf + c->off;
        if (avail >= sz)
            text = (memmem(p, sz, "\"text\":\"", 8) && !memmem(p, sz, "\"text\":\"\"", 9)) ||
                   (memmem(p, sz, "\"content\":\"", 11) && !memmem(p, sz, "\"content\":\"\"", 12));
        if (conn_skip(c, sz + 2))
            return -1;
        double t = c->t_recv; /* the event's last byte came with this read */
        if (text && k < max_ev)
            t_ev[k++] = t;
    }
}

/* --- load ------------------------------------------------------------------ */

#define PREFIX_TOKENS 2000

/* A /v1/completions body whose prompt is the shared prefix's ids, then a
 * few of the request's own (new; NULL when out of memory). */
static char *prefix_body(const char *prefix, int id, int i)
{
    size_t n = strlen(prefix) + 256;
    char *b = malloc(n);
    if (b)
        snprintf(b, n,
                 "{\"prompt\":[%s%d,%d,%d,%d],\"max_tokens\":%d,\"temperature\":0,"
                 "\"ignore_eos\":true,\"stream\":true}",
                 prefix, 3 + id, 5 + i, 7 + id, 11 + i, TOKENS);
    return b;
}

struct worker {
    int port;
    const char *path;
    bool llama;
    const char *prefix; /* NULL, or token ids "a,b,...," every prompt starts with */
    int id, n_req;
    double *ttft, *itl; /* [n_req], [n_req * TOKENS] */
    int n_ttft, n_itl;
    int failed;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct conn *c = malloc(sizeof(*c));
    if (conn_open(c, w->port) != 0) {
        w->failed = w->n_req;
        free(c);
        return NULL;
    }
    for (int i = 0; i < w->n_req; i++) {
        char body[512];
        char *big = w->prefix ? prefix_body(w->prefix, w->id, i) : NULL;
        if (w->prefix && !big) {
            w->failed++;
            continue;
        }
        if (big)
            body[0] = '\0'; /* the prefix body is sent instead */
        else if (w->llama)
            snprintf(body, sizeof(body),
                     "{\"prompt\":\"Client %d request %d: once upon a time there was\","
                     "\"n_predict\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}",
                     w->id, i, TOKENS);
        else
            snprintf(body, sizeof(body),
                     "{\"prompt\":\"Client %d request %d: once upon a time there was\","
                     "\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true,\"stream\":true}",
                     w->id, i, TOKENS);
        double t0, t[TOKENS + 8];
        int k = stream_request(c, w->path, big ? big : body, &t0, t, TOKENS + 8);
        free(big);
        if (k <= 0) {
            w->failed++;
            continue;
        }
        w->ttft[w->n_ttft++] = t[0] - t0;
        for (int j = 1; j < k; j++)
            w->itl[w->n_itl++] = t[j] - t[j - 1];
    }
    close(c->fd);
    free(c);
    return NULL;
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p)
{
    if (n == 0)
        return 0;
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    int i = (int)(p * (n - 1) + 0.5);
    return v[i];
}

struct row {
    double rps, tps, ttft50, ttft99, itl50, itl99;
    int failed;
};

static struct row run_level_prefix(int port, const char *path, bool llama, int conc,
                                   int per_client, const char *prefix)
{
    struct worker w[16];
    pthread_t th[16];
    double t0 = now_s();
    for (int i = 0; i < conc; i++) {
        w[i] = (struct worker){.port = port,
                               .path = path,
                               .llama = llama,
                               .prefix = prefix,
                               .id = i,
                               .n_req = per_client};
        w[i].ttft = calloc((size_t)per_client, sizeof(double));
        w[i].itl = calloc((size_t)per_client * (TOKENS + 8), sizeof(double));
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    for (int i = 0; i < conc; i++)
        pthread_join(th[i], NULL);
    double wall = now_s() - t0;
    int total = conc * per_client, failed = 0, nt = 0, ni = 0;
    double *ttft = calloc((size_t)total, sizeof(double));
    double *itl = calloc((size_t)total * (TOKENS + 8), sizeof(double));
    for (int i = 0; i < conc; i++) {
        failed += w[i].failed;
        memcpy(ttft + nt, w[i].ttft, sizeof(double) * (size_t)w[i].n_ttft);
        nt += w[i].n_ttft;
        memcpy(itl + ni, w[i].itl, sizeof(double) * (size_t)w[i].n_itl);
        ni += w[i].n_itl;
        free(w[i].ttft);
        free(w[i].itl);
    }
    struct row r = {
        .rps = (total - failed) / wall,
        .tps = (double)(total - failed) * TOKENS / wall,
        .ttft50 = pct(ttft, nt, 0.50) * 1e3,
        .ttft99 = pct(ttft, nt, 0.99) * 1e3,
        .itl50 = pct(itl, ni, 0.50) * 1e3,
        .itl99 = pct(itl, ni, 0.99) * 1e3,
        .failed = failed,
    };
    free(ttft);
    free(itl);
    return r;
}

static struct row run_level(int port, const char *path, bool llama, int conc, int per_client)
{
    return run_level_prefix(port, path, llama, conc, per_client, NULL);
}

/* --- the server ---------------------------------------------------------------- */

/* A server on a free port; `set` is one more --set (or NULL). */
static pid_t start_server(const char *model_path, int *port, const char *set)
{
    int out[2];
    if (pipe(out) != 0)
        return -1;
    fflush(stdout); /* the child's stdout is the pipe: nothing of ours may go there */
    pid_t pid = fork();
    if (pid == 0) {
        dup2(out[1], 1);
        close(out[0]);
        char *argv[] = {"serve",
                        "--model",
                        (char *)model_path,
                        "--listen",
                        "127.0.0.1:0",
                        "--set",
                        "limits.max_running=16",
                        "--set",
                        "limits.step_tokens=512",
                        "--set",
                        "cache.memory=256MiB",
                        "--set",
                        "log.level=warn",
                        set ? "--set" : NULL,
                        (char *)set,
                        NULL};
        _exit(srv_cmd_serve(set ? 15 : 13, argv));
    }
    close(out[1]);
    char line[256];
    size_t n = 0;
    while (n < sizeof(line) - 1) {
        struct pollfd pfd = {out[0], POLLIN, 0};
        if (poll(&pfd, 1, 30000) <= 0 || read(out[0], line + n, 1) != 1)
            break;
        if (line[n] == '\n')
            break;
        n++;
    }
    line[n] = '\0';
    close(out[0]);
    const char *p = strstr(line, "127.0.0.1:");
    if (!p) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    *port = atoi(p + 10);
    /* wait for the model */
    for (int i = 0; i < 3000; i++) {
        struct conn c;
        if (conn_open(&c, *port) == 0) {
            const char *req = "GET /health HTTP/1.1\r\nHost: b\r\n\r\n";
            char l[256] = "";
            if (send(c.fd, req, strlen(req), MSG_NOSIGNAL) > 0 &&
                conn_line(&c, l, sizeof(l)) == 0 && strstr(l, " 200 ")) {
                close(c.fd);
                return pid;
            }
            close(c.fd);
        }
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
}

static void stop_server(pid_t pid)
{
    kill(pid, SIGTERM);
    int st = 0;
    waitpid(pid, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
        fprintf(stderr, "bench_server: the server exited with status %d\n", st);
}

/*
 * Time to first token with a 2,000-token prefix shared by every request,
 * prefix cache off, then on (a fresh server each; one request first, so
 * the prefix is cached before the measured ones arrive).
 */
static void bench_prefix(const char *model_path, int n_vocab)
{
    size_t cap = (size_t)PREFIX_TOKENS * 8 + 1, len = 0;
    char *prefix = malloc(cap);
    if (!prefix)
        return;
    for (int i = 0; i < PREFIX_TOKENS; i++)
        len += (size_t)snprintf(prefix + len, cap - len, "%d,", 1 + (i * 7919) % (n_vocab - 1));
    printf("\nshared prefix: every prompt = the same %d token ids + 4 of its own; "
           "%d-token streamed completions, greedy\n\n",
           PREFIX_TOKENS, TOKENS);
    printf("%-14s %5s %8s %10s %10s %6s\n", "prefix_cache", "conc", "req/s", "TTFT p50",
           "TTFT p99", "failed");
    struct row r[2][2] = {{{0}}};
    static const int conc[] = {1, 4};
    for (int on = 0; on < 2; on++) {
        int port = 0;
        pid_t pid = start_server(model_path, &port,
                                 on ? "cache.prefix_cache=on" : "cache.prefix_cache=off");
        if (pid < 0) {
            fprintf(stderr, "bench_server: the server did not start\n");
            break;
        }
        run_level_prefix(port, "/v1/completions", false, 1, 1, prefix); /* warm */
        for (int l = 0; l < 2; l++) {
            r[on][l] = run_level_prefix(port, "/v1/completions", false, conc[l], 8 / conc[l] * 2,
                                        prefix);
            printf("%-14s %5d %8.2f %10.2f %10.2f %6d\n", on ? "on" : "off", conc[l], r[on][l].rps,
                   r[on][l].ttft50, r[on][l].ttft99, r[on][l].failed);
        }
        stop_server(pid);
    }
    printf("\nratios (same run): TTFT p50 off / on, concurrency 1: %.2f, concurrency 4: %.2f\n",
           r[0][0].ttft50 / r[1][0].ttft50, r[0][1].ttft50 / r[1][1].ttft50);
    free(prefix);
}

int main(int argc, char **argv)
{
    /* Idle OpenMP workers spin after each parallel region unless told
     * otherwise; on a machine with few cores that spin starves the loop
     * thread and the clients, and the figures measure the scheduler of the
     * OS. The policy is read when libgomp loads, so set it and start again
     * (OMP_WAIT_POLICY=active in the environment measures spinning). */
    if (argc > 0 && !getenv("OMP_WAIT_POLICY")) {
        setenv("OMP_WAIT_POLICY", "passive", 1);
        execv("/proc/self/exe", argv); /* on failure, carry on */
    }
    signal(SIGPIPE, SIG_IGN);
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    char dir[] = "/tmp/kvd-bench-server-XXXXXX";
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    char model_path[256], err[512];
    snprintf(model_path, sizeof(model_path), "%s/default.gguf", dir);
    struct model_mk_params mp;
    model_mk_defaults(&mp);
    if (model_mk_write(&mp, model_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "bench_server: %s\n", err);
        return 1;
    }
    int port = 0;
    pid_t pid = start_server(model_path, &port, NULL);
    if (pid < 0) {
        fprintf(stderr, "bench_server: the server did not start\n");
        return 1;
    }
    printf("kvd serve, mkmodel default model (llama, dim %d, %d layers, vocab %d), "
           "%d-token streamed completions, ignore_eos, greedy; client-side latencies; "
           "OMP_WAIT_POLICY=%s\n\n",
           mp.n_embd, mp.n_layer, mp.n_vocab, TOKENS,
           getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "(unset)");
    printf("%-16s %5s %8s %9s %10s %10s %10s %10s %6s\n", "endpoint", "conc", "req/s", "tok/s",
           "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "failed");
    printf("%-16s %5s %8s %9s %10s %10s %10s %10s %6s\n", "", "", "", "", "(ms)", "(ms)", "(ms)",
           "(ms)", "");
    static const int levels[] = {1, 4, 16};
    static const int per_client[] = {16, 8, 4};
    struct row rows[2][3];
    const char *paths[] = {"/v1/completions", "/completion"};
    run_level(port, paths[0], false, 2, 2); /* warm-up */
    for (int e = 0; e < 2; e++) {
        for (int l = 0; l < 3; l++) {
            struct row r = run_level(port, paths[e], e == 1, levels[l], per_client[l]);
            rows[e][l] = r;
            printf("%-16s %5d %8.1f %9.1f %10.2f %10.2f %10.2f %10.2f %6d\n", paths[e], levels[l],
                   r.rps, r.tps, r.ttft50, r.ttft99, r.itl50, r.itl99, r.failed);
        }
    }
    printf("\nratios (same run):\n");
    printf("  /v1/completions req/s, concurrency 4 / 1:   %.2f\n", rows[0][1].rps / rows[0][0].rps);
    printf("  /v1/completions req/s, concurrency 16 / 1:  %.2f\n", rows[0][2].rps / rows[0][0].rps);
    printf("  ITL p50, concurrency 16 / 1:               %.2f\n",
           rows[0][2].itl50 / rows[0][0].itl50);
    printf("  /completion / /v1/completions req/s at 16: %.2f\n", rows[1][2].rps / rows[0][2].rps);

    stop_server(pid);
    bench_prefix(model_path, mp.n_vocab);
    unlink(model_path);
    rmdir(dir);
    return 0;
}
