/*
 * serve_util.h - processes and plain HTTP for the tests that run the real
 * `kvd serve` (and HAProxy, and `kvd load`) as child processes:
 * test_cluster.c, test_load.c, test_arch.c, test_eval.c, and through
 * serve_fixture.h the server, lifecycle, logprobs, http and faults tests.
 *
 * Every child runs in its own process group, so a kill reaches whatever it
 * started too; every wait has a deadline; every socket has a timeout. The
 * HTTP client sends one request per connection ("Connection: close") and
 * reads to the end, which is all these tests need (http_client.h has the
 * client that tests keep-alive, pipelining and chunking).
 *
 * Include after <cmocka.h>. The functions are static and may go unused in
 * one of the programs (test_model.c takes only su_small_model).
 */
#ifndef KVD_TESTS_SERVE_UTIL_H
#define KVD_TESTS_SERVE_UTIL_H

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "model/mkmodel.h"

#define SU_FN static __attribute__((unused))

/*
 * The small model the tests start kvd with (and test_model's unit tests
 * run): mkmodel's defaults, 64 wide, 2 layers, 4 query heads over 2 KV
 * heads; feed-forward width, vocabulary and seed as given.
 */
SU_FN struct model_mk_params su_small_model(int n_ff, int n_vocab, uint64_t seed)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = 64;
    p.n_layer = 2;
    p.n_head = 4;
    p.n_kv_head = 2;
    p.n_ff = n_ff;
    p.n_vocab = n_vocab;
    p.seed = seed;
    return p;
}

SU_FN double su_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

SU_FN void su_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Whether an executable named `name` is on PATH. */
SU_FN bool su_on_path(const char *name)
{
    const char *path = getenv("PATH");
    if (!path)
        return false;
    char buf[4096];
    snprintf(buf, sizeof(buf), "%s", path);
    for (char *save = NULL, *dir = strtok_r(buf, ":", &save); dir;
         dir = strtok_r(NULL, ":", &save)) {
        char full[4200];
        snprintf(full, sizeof(full), "%s/%s", dir, name);
        if (access(full, X_OK) == 0)
            return true;
    }
    return false;
}

/* rm -rf dir (a scratch directory, if any: "" is none), then dir = "".
 * Returns 0, or -1 when the removal failed. */
SU_FN int su_remove_dir(char *dir)
{
    if (!dir[0])
        return 0;
    char cmd[600];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    int rc = system(cmd) == 0 ? 0 : -1;
    dir[0] = '\0';
    return rc;
}

/*
 * A scratch directory /tmp/kvd-test-NAME-XXXXXX (its path into dir, at
 * least 64 bytes) holding the small model su_small_model(128, 512, seed)
 * as tiny.gguf (its path into model_path, at least 128 bytes). Returns 0,
 * or -1 with the reason on stderr.
 */
SU_FN int su_scratch_model(const char *name, uint64_t seed, char *dir, size_t dirlen,
                           char *model_path, size_t pathlen)
{
    snprintf(dir, dirlen, "/tmp/kvd-test-%s-XXXXXX", name);
    if (!mkdtemp(dir)) {
        fprintf(stderr, "mkdtemp %s: %s\n", dir, strerror(errno));
        dir[0] = '\0';
        return -1;
    }
    snprintf(model_path, pathlen, "%s/tiny.gguf", dir);
    struct model_mk_params p = su_small_model(128, 512, seed);
    char err[512];
    if (model_mk_write(&p, model_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "model_mk_write: %s\n", err);
        return -1;
    }
    return 0;
}

/* A loopback port that was free a moment ago (bound to 0, then released). */
SU_FN int su_free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    int port = -1;
    if (bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0 &&
        getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    close(fd);
    return port;
}

/* --- HTTP ------------------------------------------------------------------ */

struct su_resp {
    int status; /* -1: no answer */
    char head[8192];
    char *body; /* NUL-terminated (owned; su_resp_free) */
    size_t len;
};

SU_FN void su_resp_free(struct su_resp *r)
{
    free(r->body);
    r->body = NULL;
}

/* Un-chunk a chunked body in place. */
static void su_unchunk(struct su_resp *r)
{
    char *in = r->body, *out = r->body, *end = r->body + r->len;
    while (in < end) {
        char *stop;
        unsigned long n = strtoul(in, &stop, 16);
        char *nl = strstr(stop, "\r\n");
        if (!nl || n == 0)
            break;
        in = nl + 2;
        if ((size_t)(end - in) < n)
            break;
        memmove(out, in, n);
        out += n;
        in += n + 2;
    }
    r->len = (size_t)(out - r->body);
    r->body[r->len] = '\0';
}

/*
 * One request to 127.0.0.1:port on a fresh connection; headers: "" or
 * lines ending in "\r\n". Returns the status (also in r->status), or -1
 * when no answer came (refused, reset, 120 s timeout). A non-streamed
 * answer sends nothing until it is whole: the timeout bounds a hung test,
 * and must leave a long generation on a busy machine room to finish.
 */
SU_FN int su_http(int port, const char *method, const char *path, const char *headers,
                  const char *body, struct su_resp *r)
{
    memset(r, 0, sizeof(*r));
    r->status = -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct timeval tv = {120, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    size_t bl = body ? strlen(body) : 0;
    size_t cap = bl + strlen(path) + (headers ? strlen(headers) : 0) + 256;
    char *req = malloc(cap);
    int n = snprintf(req, cap,
                     "%s %s HTTP/1.1\r\nHost: kvd\r\nConnection: close\r\n%s%s"
                     "Content-Length: %zu\r\n\r\n%s",
                     method, path, headers ? headers : "",
                     body ? "Content-Type: application/json\r\n" : "", bl, body ? body : "");
    bool sent = send(fd, req, (size_t)n, MSG_NOSIGNAL) == n;
    free(req);
    size_t len = 0, bcap = 65536;
    char *buf = malloc(bcap);
    while (sent) {
        if (len + 4096 > bcap)
            buf = realloc(buf, bcap *= 2);
        ssize_t k = recv(fd, buf + len, bcap - len - 1, 0);
        if (k <= 0)
            break;
        len += (size_t)k;
    }
    close(fd);
    buf[len] = '\0';
    char *sep = strstr(buf, "\r\n\r\n");
    if (!sep || sscanf(buf, "HTTP/1.%*d %d", &r->status) != 1) {
        free(buf);
        r->status = -1;
        return -1;
    }
    size_t hl = (size_t)(sep - buf);
    snprintf(r->head, sizeof(r->head), "%.*s", (int)(hl < sizeof(r->head) ? hl : 8191), buf);
    r->len = len - hl - 4;
    r->body = malloc(r->len + 1);
    memcpy(r->body, sep + 4, r->len);
    r->body[r->len] = '\0';
    free(buf);
    if (strcasestr(r->head, "transfer-encoding: chunked"))
        su_unchunk(r);
    return r->status;
}

/* POST a JSON body (stolen): the parsed answer (NULL if not JSON), status in *status. */
SU_FN json_t *su_post(int port, const char *path, const char *headers, json_t *body, int *status)
{
    char *s = json_dumps(body, JSON_COMPACT);
    json_decref(body);
    struct su_resp r;
    *status = su_http(port, "POST", path, headers, s, &r);
    free(s);
    /* a generated text may hold U+0000 (a byte token 0x00), which JSON allows */
    json_t *v = r.body ? json_loads(r.body, JSON_ALLOW_NUL, NULL) : NULL;
    su_resp_free(&r);
    return v;
}

/* --- metrics and process state ---------------------------------------------- */

/* A metric's value: the first /metrics sample whose name, labels included,
 * is exactly `name` ("NAME VALUE"), or -1 when absent or unreachable. */
SU_FN double su_metric(int port, const char *name)
{
    struct su_resp r;
    double v = -1;
    if (su_http(port, "GET", "/metrics", NULL, NULL, &r) == 200) {
        size_t nl = strlen(name);
        for (const char *l = r.body; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
            if (!strncmp(l, name, nl) && l[nl] == ' ') {
                v = strtod(l + nl + 1, NULL);
                break;
            }
    }
    su_resp_free(&r);
    return v;
}

/* Wait until su_metric(name) == want (up to 20 s); says so when it never does. */
SU_FN bool su_wait_metric(int port, const char *name, double want)
{
    double deadline = su_now() + 20;
    while (su_now() < deadline) {
        if (su_metric(port, name) == want)
            return true;
        su_sleep_ms(20);
    }
    print_message("metric %s never reached %g (last %g)\n", name, want, su_metric(port, name));
    return false;
}

/* Wait until su_metric(name) >= want (up to `seconds`). */
SU_FN bool su_wait_metric_at_least(int port, const char *name, double want, double seconds)
{
    double deadline = su_now() + seconds;
    while (su_now() < deadline) {
        if (su_metric(port, name) >= want)
            return true;
        su_sleep_ms(50);
    }
    print_message("%s stayed below %g (now %g)\n", name, want, su_metric(port, name));
    return false;
}

/* A process's resident set (VmRSS) in KiB, or -1. */
SU_FN long su_rss_kb(pid_t pid)
{
    char path[64], line[256];
    snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    long kb = -1;
    while (fgets(line, sizeof(line), f))
        if (!strncmp(line, "VmRSS:", 6))
            kb = atol(line + 6);
    fclose(f);
    return kb;
}

/* A process's open file descriptors, or -1. */
SU_FN int su_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (!d)
        return -1;
    int n = 0;
    for (struct dirent *de; (de = readdir(d));)
        n += de->d_name[0] != '.';
    closedir(d);
    return n;
}

/* Some line of the file at `path` (a log) contains `text`. */
SU_FN bool su_file_has(const char *path, const char *text)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char line[4096];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, text) != NULL;
    fclose(f);
    return found;
}

/* --- processes --------------------------------------------------------------- */

struct su_proc {
    pid_t pid; /* 0 when not running */
    int port;  /* where it listens */
    char log[600];
};

SU_FN void su_dump_log(const struct su_proc *p)
{
    FILE *f = fopen(p->log, "r");
    if (!f)
        return;
    char line[1024];
    int n = 0;
    print_message("---- log %s ----\n", p->log);
    while (fgets(line, sizeof(line), f) && n++ < 100)
        print_message("%s", line);
    fclose(f);
}

/*
 * Start argv[0] (argv NULL-terminated) in its own process group, stdout to
 * *out_fd when out_fd is not NULL (a pipe's read end) or else to the log,
 * stderr to p->log. The child gets OMP_WAIT_POLICY=passive (idle OpenMP
 * workers would spin on a small machine) and a small ASan quarantine.
 * Returns 0 or -1.
 */
SU_FN int su_spawn(struct su_proc *p, char *const *argv, int *out_fd)
{
    int out[2] = {-1, -1};
    if (out_fd && pipe(out) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        setpgid(0, 0);
        int logfd = open(p->log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (logfd >= 0) {
            dup2(logfd, 2);
            if (!out_fd)
                dup2(logfd, 1);
        }
        if (out_fd) {
            dup2(out[1], 1);
            close(out[0]);
        }
        char asan[512];
        const char *old = getenv("ASAN_OPTIONS");
        snprintf(asan, sizeof(asan), "%s%squarantine_size_mb=8", old ? old : "",
                 old && *old ? ":" : "");
        setenv("ASAN_OPTIONS", asan, 1);
        setenv("OMP_WAIT_POLICY", "passive", 0);
        execvp(argv[0], argv);
        _exit(127);
    }
    setpgid(pid, pid); /* also here: no race with the first kill */
    p->pid = pid;
    if (out_fd) {
        close(out[1]);
        *out_fd = out[0];
    }
    return 0;
}

/* Wait up to timeout_s for the process to end; then SIGKILL its group.
 * Returns its exit status, 128+signal if a signal ended it, -1 if it had
 * to be killed. */
SU_FN int su_wait(struct su_proc *p, double timeout_s)
{
    if (!p->pid)
        return 0;
    double deadline = su_now() + timeout_s;
    int st = 0;
    for (;;) {
        pid_t r = waitpid(p->pid, &st, WNOHANG);
        if (r == p->pid)
            break;
        if (r < 0) { /* not our child any more */
            p->pid = 0;
            return -1;
        }
        if (su_now() > deadline) {
            kill(-p->pid, SIGKILL);
            waitpid(p->pid, &st, 0);
            p->pid = 0;
            return -1;
        }
        su_sleep_ms(10);
    }
    p->pid = 0;
    return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Send sig to the process group and wait (SIGKILL after timeout_s). */
SU_FN int su_stop(struct su_proc *p, int sig, double timeout_s)
{
    if (!p->pid)
        return 0;
    kill(-p->pid, sig);
    return su_wait(p, timeout_s);
}

/*
 * Start a `kvd serve` command line (argv NULL-terminated, listening on
 * 127.0.0.1:0): reads the port from its first stdout line and waits until
 * /health answers 200 (30 s at most). Returns 0, or -1 with the log shown
 * and the process gone.
 */
SU_FN int su_serve_argv(struct su_proc *p, const char *const *argv)
{
    int fd;
    if (su_spawn(p, (char *const *)argv, &fd))
        return -1;
    char line[256];
    size_t n = 0;
    double deadline = su_now() + 30;
    while (su_now() < deadline && n < sizeof(line) - 1) {
        struct pollfd pfd = {fd, POLLIN, 0};
        if (poll(&pfd, 1, 200) <= 0)
            continue;
        if (read(fd, line + n, 1) <= 0 || line[n] == '\n')
            break;
        n++;
    }
    line[n] = '\0';
    close(fd);
    const char *at = strstr(line, "127.0.0.1:");
    p->port = at ? atoi(at + 10) : 0;
    while (p->port > 0 && su_now() < deadline) {
        struct su_resp r;
        int st = su_http(p->port, "GET", "/health", NULL, NULL, &r);
        su_resp_free(&r);
        if (st == 200)
            return 0;
        su_sleep_ms(20);
    }
    print_message("kvd serve did not become healthy (first line '%s')\n", line);
    su_dump_log(p);
    su_stop(p, SIGKILL, 5);
    return -1;
}

/* `kvd serve --model M --listen 127.0.0.1:0 ARGS...`, as su_serve_argv. */
SU_FN int su_serve(struct su_proc *p, const char *kvd_bin, const char *model_path,
                   const char *const *args, int n_args)
{
    const char *argv[64];
    int argc = 0;
    argv[argc++] = kvd_bin;
    argv[argc++] = "serve";
    argv[argc++] = "--model";
    argv[argc++] = model_path;
    argv[argc++] = "--listen";
    argv[argc++] = "127.0.0.1:0";
    for (int i = 0; i < n_args && argc < 63; i++)
        argv[argc++] = args[i];
    argv[argc] = NULL;
    return su_serve_argv(p, argv);
}

#endif /* KVD_TESTS_SERVE_UTIL_H */
