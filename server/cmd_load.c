/*
 * cmd_load.c - `kvd load`: how latency and throughput change with context.
 *
 * Scenarios, each a series of steps:
 *   fixed    one step: prompts of exactly --prompt-tokens tokens
 *   sweep    one step per length in --contexts (e.g. 512,2048,8192,...)
 *   session  every client keeps a session; each turn (step) appends
 *            --turn-tokens new tokens, the long-chat case the cache is for
 * Prompts are sent as arrays of token ids taken from the server's own
 * /tokenize of a text, so every prompt has an exact length.
 *
 * Each step runs --requests requests (or for --duration) at --concurrency
 * clients (one thread and keep-alive connection each), optionally paced to
 * --rate requests/s, and reports what vLLM's and llama.cpp's benchmarks
 * report: requests/s, output tokens/s, time to first token, inter-token
 * latency and end-to-end latency (mean, p50, p90, p99), errors by status,
 * and the server's RSS and KV pages used from /metrics.
 *
 * It targets only the address it is given and refuses anything but
 * loopback unless --allow-remote is passed: a load tester should never be
 * one typo away from loading someone else's server.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <jansson.h>

#include "server/load.h"
#include "server/server.h"
#include "server/server_internal.h"

#define MAX_STEPS 64
#define MAX_STATUS 8

enum scenario { SC_FIXED, SC_SWEEP, SC_SESSION };

struct load_opts {
    char host[256];
    int port;
    enum scenario scenario;
    int prompt_tokens;
    int contexts[MAX_STEPS];
    int n_contexts;
    int turns, turn_tokens;
    int concurrency;
    double rate;          /* requests/s; 0 = as fast as the clients go */
    int requests;         /* per step */
    double duration;      /* per step, seconds; 0 = use requests */
    int max_tokens;
    bool stream;
    const char *endpoint; /* /v1/completions or /completion */
    const char *file;     /* text to tokenize for prompts */
    const char *csv, *json, *plot;
    const char *api_key;
    double timeout;
};

/* One request's measurements. */
struct sample {
    int status;
    double ttft, e2e;
    int out_tokens;
    double itl_sum; /* sum of gaps between tokens */
    int itl_n;
};

struct step_result {
    int context;             /* prompt (or session) tokens at this step */
    int n_ok, n_err;
    int status_code[MAX_STATUS], status_count[MAX_STATUS];
    double wall;
    double rps, out_tps;
    double ttft[4], itl[4], e2e[4]; /* mean, p50, p90, p99 (seconds) */
    double rss_mb;
    double pages_used;
};

struct load_run;

struct client {
    struct load_run *run;
    int idx;
    struct lc_conn *conn;
    char session[64];
    int session_tokens; /* tokens this client's session already holds */
};

struct load_run {
    const struct load_opts *o;
    const int32_t *corpus;
    int n_corpus;
    int step_tokens;  /* prompt tokens for this step (new tokens for session turns) */
    int step;
    atomic_int next;  /* next request index of the step */
    double t0;
    struct sample *samples;
    int max_samples;
    atomic_int n_samples;
};

/* ------------------------------------------------------------------------ */

static void load_usage(FILE *f)
{
    fprintf(f,
            "usage: kvd load [--url http://127.0.0.1:8080] [--scenario fixed|sweep|session]\n"
            "  --prompt-tokens N     fixed: prompt length (default 512)\n"
            "  --contexts A,B,...    sweep: prompt lengths (default 512,1024,2048,4096)\n"
            "  --turns T             session: turns per client (default 8)\n"
            "  --turn-tokens N       session: tokens each turn adds (default 256)\n"
            "  --concurrency C       clients in parallel (default 4)\n"
            "  --rate R              pace to R requests/s (default: unpaced)\n"
            "  --requests N          requests per step (default 16)\n"
            "  --duration SECONDS    per step, instead of a request count\n"
            "  --max-tokens M        tokens generated per request (default 16)\n"
            "  --no-stream           non-streamed responses (no TTFT/ITL)\n"
            "  --endpoint PATH       /v1/completions (default) or /completion\n"
            "  --file TEXT           text whose tokens make the prompts\n"
            "  --csv F --json F --plot F.png   write results (plot needs gnuplot)\n"
            "  --api-key KEY         sent as Authorization: Bearer KEY\n"
            "  --allow-remote        allow a non-loopback address\n");
}

static int parse_contexts(const char *s, struct load_opts *o)
{
    o->n_contexts = 0;
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        long v;
        if (o->n_contexts == MAX_STEPS || srv_parse_long(tok, 1, 1 << 24, &v))
            return -1;
        o->contexts[o->n_contexts++] = (int)v;
    }
    return o->n_contexts ? 0 : -1;
}

static int bad_value(const char *name, const char *v)
{
    fprintf(stderr, "kvd load: invalid value for %s: '%s'\n", name, v ? v : "");
    return -1;
}

static int parse_opts(int argc, char **argv, struct load_opts *o, bool *help)
{
    const char *url = "http://127.0.0.1:8080";
    bool allow_remote = false, bad = false;
    *o = (struct load_opts){.scenario = SC_FIXED, .prompt_tokens = 512, .turns = 8,
                            .turn_tokens = 256, .concurrency = 4, .requests = 16,
                            .max_tokens = 16, .stream = true, .endpoint = "/v1/completions",
                            .timeout = 600};
    parse_contexts("512,1024,2048,4096", o);
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        long n;
        double d;
#define OPT(name) srv_opt_value(argc, argv, &i, "load", name, &v, &bad)
        if (OPT("--url")) {
            url = v;
        } else if (OPT("--scenario")) {
            if (bad)
                break;
            if (!strcmp(v, "fixed"))
                o->scenario = SC_FIXED;
            else if (!strcmp(v, "sweep"))
                o->scenario = SC_SWEEP;
            else if (!strcmp(v, "session"))
                o->scenario = SC_SESSION;
            else
                return bad_value("--scenario (fixed|sweep|session)", v);
        } else if (OPT("--prompt-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 24, &n))
                return bad_value("--prompt-tokens", v);
            o->prompt_tokens = (int)n;
        } else if (OPT("--contexts")) {
            if (bad || parse_contexts(v, o))
                return bad_value("--contexts", v);
        } else if (OPT("--turns")) {
            if (bad || srv_parse_long(v, 1, MAX_STEPS, &n))
                return bad_value("--turns (1..64)", v);
            o->turns = (int)n;
        } else if (OPT("--turn-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 20, &n))
                return bad_value("--turn-tokens", v);
            o->turn_tokens = (int)n;
        } else if (OPT("--concurrency")) {
            if (bad || srv_parse_long(v, 1, 1024, &n))
                return bad_value("--concurrency (1..1024)", v);
            o->concurrency = (int)n;
        } else if (OPT("--rate")) {
            if (bad || srv_parse_double(v, 0.001, 1e6, &d))
                return bad_value("--rate", v);
            o->rate = d;
        } else if (OPT("--requests")) {
            if (bad || srv_parse_long(v, 1, 1000000, &n))
                return bad_value("--requests", v);
            o->requests = (int)n;
        } else if (OPT("--duration")) {
            if (bad || srv_parse_double(v, 0.1, 86400, &d))
                return bad_value("--duration (seconds)", v);
            o->duration = d;
        } else if (OPT("--max-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 20, &n))
                return bad_value("--max-tokens", v);
            o->max_tokens = (int)n;
        } else if (OPT("--endpoint")) {
            if (bad || (strcmp(v, "/v1/completions") && strcmp(v, "/completion")))
                return bad_value("--endpoint (/v1/completions or /completion)", v);
            o->endpoint = v;
        } else if (OPT("--file")) {
            o->file = v;
        } else if (OPT("--csv")) {
            o->csv = v;
        } else if (OPT("--json")) {
            o->json = v;
        } else if (OPT("--plot")) {
            o->plot = v;
        } else if (OPT("--api-key")) {
            o->api_key = v;
        } else if (!strcmp(argv[i], "--no-stream")) {
            o->stream = false;
            i++;
        } else if (!strcmp(argv[i], "--allow-remote")) {
            allow_remote = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help = true;
            return 0;
        } else {
            fprintf(stderr, "kvd load: unknown option '%s'\n", argv[i]);
            return -1;
        }
#undef OPT
    }
    if (bad)
        return -1;
    if (lc_parse_url(url, o->host, sizeof(o->host), &o->port))
        return bad_value("--url (http://HOST:PORT)", url);
    if (!allow_remote && !lc_is_loopback(o->host)) {
        fprintf(stderr, "kvd load: refusing non-loopback address %s (pass --allow-remote)\n",
                o->host);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Prompts
 * ------------------------------------------------------------------------ */

/* Built-in text when no --file is given: plain English, so any vocabulary
 * turns it into a realistic mix of tokens. */
static const char default_text[] =
    "Once upon a time, in a small town by the sea, there lived a girl named Lily. "
    "Every morning she walked to the harbour to watch the boats come in. The fishermen "
    "waved to her and told her stories about the storms they had seen and the strange "
    "fish they had caught. One day an old sailor gave her a map of an island nobody had "
    "visited for a hundred years. Lily asked her brother Tom to help her build a boat, "
    "and together they worked every evening until the sun went down. ";

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    char *buf = NULL;
    size_t cap = 0, n = 0;
    for (;;) {
        if (n + 65536 + 1 > cap) {
            cap = cap ? cap * 2 : 1 << 17;
            char *b = realloc(buf, cap);
            if (!b) {
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = b;
        }
        size_t r = fread(buf + n, 1, 65536, f);
        n += r;
        if (r < 65536)
            break;
    }
    fclose(f);
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Ask the server to tokenize the corpus text; returns the token count or -1. */
static int fetch_corpus(struct lc_conn *c, const struct load_opts *o, const char *auth,
                        int32_t **out)
{
    size_t len = strlen(default_text);
    char *text = o->file ? read_file(o->file, &len) : strdup(default_text);
    if (!text) {
        fprintf(stderr, "kvd load: cannot read %s\n", o->file);
        return -1;
    }
    json_t *req = json_pack("{s:s%}", "content", text, len);
    free(text);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    if (!body) {
        fprintf(stderr, "kvd load: the text is not valid UTF-8\n");
        return -1;
    }
    struct lc_response r;
    char err[256];
    int rc = lc_request(c, "POST", "/tokenize", auth, body, NULL, NULL, &r, err, sizeof(err));
    free(body);
    if (rc || r.status != 200) {
        fprintf(stderr, "kvd load: POST /tokenize failed: %s\n",
                rc ? err : (r.body ? r.body : "no body"));
        lc_response_free(&r);
        return -1;
    }
    json_t *resp = json_loads(r.body, 0, NULL);
    lc_response_free(&r);
    json_t *toks = json_object_get(resp, "tokens");
    int n = json_is_array(toks) ? (int)json_array_size(toks) : 0;
    if (n == 0) {
        fprintf(stderr, "kvd load: /tokenize returned no tokens\n");
        json_decref(resp);
        return -1;
    }
    *out = malloc(sizeof(int32_t) * (size_t)n);
    if (!*out) {
        json_decref(resp);
        return -1;
    }
    for (int i = 0; i < n; i++)
        (*out)[i] = (int32_t)json_integer_value(json_array_get(toks, (size_t)i));
    json_decref(resp);
    return n;
}

/* The request body: `n` prompt tokens from the corpus, starting at `from`. */
static char *make_body(const struct load_run *run, int from, int n, const char *session)
{
    const struct load_opts *o = run->o;
    json_t *prompt = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(prompt, json_integer(run->corpus[(from + i) % run->n_corpus]));
    json_t *req = json_object();
    json_object_set_new(req, "prompt", prompt);
    json_object_set_new(req, "stream", json_boolean(o->stream));
    json_object_set_new(req, "temperature", json_real(0.0));
    if (!strcmp(o->endpoint, "/completion")) {
        json_object_set_new(req, "n_predict", json_integer(o->max_tokens));
        json_object_set_new(req, "cache_prompt", json_boolean(session != NULL));
    } else {
        json_object_set_new(req, "max_tokens", json_integer(o->max_tokens));
    }
    if (session)
        json_object_set_new(req, "session", json_string(session));
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    return body;
}

/* ------------------------------------------------------------------------
 * Running a step
 * ------------------------------------------------------------------------ */

/* SSE timing: each "data: {...}" event that carries text is one token. */
struct sse_timer {
    double start, last;
    struct sample *s;
    char tail[8];
    size_t tail_len;
};

static void on_sse(void *user, const char *data, size_t len)
{
    struct sse_timer *t = user;
    double now = lc_now();
    /* Count occurrences of "data: {" across chunk boundaries. */
    static const char pat[] = "data: {";
    const size_t pl = sizeof(pat) - 1;
    char joined[8 + 16384];
    size_t n = 0;
    memcpy(joined, t->tail, t->tail_len);
    n = t->tail_len;
    size_t take = len < sizeof(joined) - n ? len : sizeof(joined) - n;
    memcpy(joined + n, data, take);
    n += take;
    for (size_t i = 0; i + pl <= n; i++) {
        if (memcmp(joined + i, pat, pl) != 0)
            continue;
        struct sample *s = t->s;
        if (s->out_tokens == 0) {
            s->ttft = now - t->start;
        } else {
            s->itl_sum += now - t->last;
            s->itl_n++;
        }
        s->out_tokens++;
        t->last = now;
    }
    t->tail_len = n < pl - 1 ? n : pl - 1;
    memcpy(t->tail, joined + n - t->tail_len, t->tail_len);
}

static void record(struct load_run *run, const struct sample *s)
{
    int i = atomic_fetch_add(&run->n_samples, 1);
    if (i < run->max_samples)
        run->samples[i] = *s;
}

/* Count completion tokens of a non-streamed response from its usage. */
static int usage_tokens(const char *body)
{
    json_t *j = json_loads(body, 0, NULL);
    json_t *u = json_object_get(json_object_get(j, "usage"), "completion_tokens");
    if (!u)
        u = json_object_get(j, "tokens_predicted");
    int n = json_is_integer(u) ? (int)json_integer_value(u) : 0;
    json_decref(j);
    return n;
}

static void one_request(struct client *cl, int req_idx, const char *auth)
{
    struct load_run *run = cl->run;
    const struct load_opts *o = run->o;
    int from = (req_idx * 7919 + cl->idx * 104729) % run->n_corpus;
    char *body;
    if (o->scenario == SC_SESSION) {
        cl->session_tokens += run->step_tokens;
        /* the whole conversation so far: the server matches its history */
        body = make_body(run, cl->idx * 1000, cl->session_tokens, cl->session);
    } else {
        body = make_body(run, from, run->step_tokens, NULL);
    }
    struct sample s = {0};
    struct sse_timer timer = {.start = lc_now(), .s = &s};
    struct lc_response r;
    char err[256];
    int rc = lc_request(cl->conn, "POST", o->endpoint, auth, body, o->stream ? on_sse : NULL,
                        &timer, &r, err, sizeof(err));
    free(body);
    s.e2e = lc_now() - timer.start;
    s.status = rc ? 0 : r.status;
    if (!rc && r.status == 200 && !o->stream) {
        s.out_tokens = usage_tokens(r.body);
        s.ttft = s.e2e;
    }
    if (!rc && o->stream && s.out_tokens > 0)
        s.out_tokens--; /* the last event is the finish event, not a token */
    lc_response_free(&r);
    record(run, &s);
}

static void *client_main(void *arg)
{
    struct client *cl = arg;
    struct load_run *run = cl->run;
    const struct load_opts *o = run->o;
    char auth[300] = "";
    if (o->api_key)
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s\r\n", o->api_key);
    if (o->scenario == SC_SESSION) {
        one_request(cl, run->step, auth); /* one turn per client per step */
        return NULL;
    }
    for (;;) {
        int i = atomic_fetch_add(&run->next, 1);
        double now = lc_now();
        if (o->duration > 0 ? now - run->t0 >= o->duration : i >= o->requests)
            break;
        if (o->rate > 0) { /* request i is due at t0 + i / rate */
            double due = run->t0 + i / o->rate;
            if (due > now) {
                struct timespec ts = {.tv_sec = (time_t)(due - now),
                                      .tv_nsec = (long)(((due - now) - (double)(time_t)(due - now)) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
        one_request(cl, i, auth);
    }
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* mean, p50, p90, p99 of v[0..n) (sorted in place). */
static void summarize(double *v, int n, double out[4])
{
    memset(out, 0, sizeof(double) * 4);
    if (n == 0)
        return;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (int i = 0; i < n; i++)
        sum += v[i];
    out[0] = sum / n;
    const double q[3] = {0.5, 0.9, 0.99};
    for (int k = 0; k < 3; k++) {
        int idx = (int)ceil(q[k] * n) - 1;
        out[k + 1] = v[idx < 0 ? 0 : idx];
    }
}

/* Sum of the values of metric lines whose name contains `needle`. */
static double metric_value(const char *text, const char *needle)
{
    double total = 0;
    bool found = false;
    for (const char *line = text; line && *line;) {
        const char *nl = strchr(line, '\n');
        if (*line != '#') {
            const char *sp = strchr(line, ' ');
            if (sp && (!nl || sp < nl)) {
                size_t name_len = (size_t)(sp - line);
                char name[256];
                if (name_len < sizeof(name)) {
                    memcpy(name, line, name_len);
                    name[name_len] = '\0';
                    if (strstr(name, needle)) {
                        total += strtod(sp + 1, NULL);
                        found = true;
                    }
                }
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    return found ? total : NAN;
}

static void read_server_metrics(struct lc_conn *c, struct step_result *res)
{
    struct lc_response r;
    char err[256];
    res->rss_mb = res->pages_used = NAN;
    if (lc_request(c, "GET", "/metrics", NULL, NULL, NULL, NULL, &r, err, sizeof(err)) == 0 &&
        r.status == 200 && r.body) {
        res->rss_mb = metric_value(r.body, "resident_memory_bytes") / (1024.0 * 1024.0);
        res->pages_used = metric_value(r.body, "pages_used");
    }
    lc_response_free(&r);
}

static void aggregate(struct load_run *run, struct step_result *res)
{
    int n = atomic_load(&run->n_samples);
    if (n > run->max_samples)
        n = run->max_samples;
    double *ttft = calloc((size_t)n + 1, sizeof(double));
    double *itl = calloc((size_t)n + 1, sizeof(double));
    double *e2e = calloc((size_t)n + 1, sizeof(double));
    int nt = 0, ni = 0, ne = 0;
    long out_tokens = 0;
    for (int i = 0; i < n && ttft && itl && e2e; i++) {
        struct sample *s = &run->samples[i];
        if (s->status != 200) {
            res->n_err++;
            int k = 0;
            while (k < MAX_STATUS - 1 && res->status_count[k] && res->status_code[k] != s->status)
                k++;
            res->status_code[k] = s->status;
            res->status_count[k]++;
            continue;
        }
        res->n_ok++;
        out_tokens += s->out_tokens;
        e2e[ne++] = s->e2e;
        if (s->out_tokens > 0)
            ttft[nt++] = s->ttft;
        if (s->itl_n > 0)
            itl[ni++] = s->itl_sum / s->itl_n;
    }
    summarize(ttft, nt, res->ttft);
    summarize(itl, ni, res->itl);
    summarize(e2e, ne, res->e2e);
    res->rps = res->wall > 0 ? res->n_ok / res->wall : 0;
    res->out_tps = res->wall > 0 ? (double)out_tokens / res->wall : 0;
    free(ttft);
    free(itl);
    free(e2e);
}

static int run_step(struct load_run *run, struct client *clients, struct step_result *res)
{
    const struct load_opts *o = run->o;
    int n_clients = o->concurrency;
    atomic_store(&run->next, 0);
    atomic_store(&run->n_samples, 0);
    run->t0 = lc_now();
    pthread_t th[1024];
    int started = 0;
    for (int i = 0; i < n_clients; i++) {
        if (pthread_create(&th[i], NULL, client_main, &clients[i]))
            break;
        started++;
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    res->wall = lc_now() - run->t0;
    aggregate(run, res);
    return started == n_clients ? 0 : -1;
}

/* ------------------------------------------------------------------------
 * Output
 * ------------------------------------------------------------------------ */

static void print_header(void)
{
    printf("%8s %5s %4s %8s %9s %9s %9s %9s %9s %9s %9s %9s %8s %8s\n", "context", "ok", "err",
           "req/s", "out tok/s", "ttft p50", "ttft p99", "itl p50", "itl p99", "e2e mean",
           "e2e p50", "e2e p99", "rss MiB", "pages");
}

static void print_row(const struct step_result *r)
{
    printf("%8d %5d %4d %8.2f %9.1f %8.1fms %8.1fms %8.2fms %8.2fms %8.1fms %8.1fms %8.1fms "
           "%8.1f %8.0f\n",
           r->context, r->n_ok, r->n_err, r->rps, r->out_tps, r->ttft[1] * 1e3,
           r->ttft[3] * 1e3, r->itl[1] * 1e3, r->itl[3] * 1e3, r->e2e[0] * 1e3,
           r->e2e[1] * 1e3, r->e2e[3] * 1e3, r->rss_mb, r->pages_used);
    for (int k = 0; k < MAX_STATUS && r->status_count[k]; k++)
        printf("         errors: status %d x %d%s\n", r->status_code[k], r->status_count[k],
               r->status_code[k] == 0 ? " (connection failed)" : "");
}

static int write_csv(const char *path, const struct step_result *res, int n)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fprintf(f, "context,ok,errors,wall_s,req_per_s,out_tok_per_s,ttft_mean_ms,ttft_p50_ms,"
               "ttft_p90_ms,ttft_p99_ms,itl_mean_ms,itl_p50_ms,itl_p90_ms,itl_p99_ms,"
               "e2e_mean_ms,e2e_p50_ms,e2e_p90_ms,e2e_p99_ms,rss_mib,kv_pages_used\n");
    for (int i = 0; i < n; i++) {
        const struct step_result *r = &res[i];
        fprintf(f, "%d,%d,%d,%.3f,%.3f,%.2f", r->context, r->n_ok, r->n_err, r->wall, r->rps,
                r->out_tps);
        const double *groups[3] = {r->ttft, r->itl, r->e2e};
        for (int g = 0; g < 3; g++)
            for (int k = 0; k < 4; k++)
                fprintf(f, ",%.3f", groups[g][k] * 1e3);
        fprintf(f, ",%.1f,%.0f\n", r->rss_mb, r->pages_used);
    }
    return fclose(f);
}

static json_t *stats_json(const double v[4])
{
    return json_pack("{s:f,s:f,s:f,s:f}", "mean", v[0] * 1e3, "p50", v[1] * 1e3, "p90",
                     v[2] * 1e3, "p99", v[3] * 1e3);
}

static int write_json(const char *path, const struct load_opts *o, const struct step_result *res,
                      int n)
{
    json_t *steps = json_array();
    for (int i = 0; i < n; i++) {
        const struct step_result *r = &res[i];
        json_t *errs = json_object();
        for (int k = 0; k < MAX_STATUS && r->status_count[k]; k++) {
            char code[16];
            snprintf(code, sizeof(code), "%d", r->status_code[k]);
            json_object_set_new(errs, code, json_integer(r->status_count[k]));
        }
        json_array_append_new(
            steps, json_pack("{s:i,s:i,s:i,s:f,s:f,s:f,s:o,s:o,s:o,s:o,s:f,s:f}", "context",
                             r->context, "ok", r->n_ok, "errors", r->n_err, "wall_s", r->wall,
                             "requests_per_s", r->rps, "output_tokens_per_s", r->out_tps,
                             "ttft_ms", stats_json(r->ttft), "itl_ms", stats_json(r->itl),
                             "e2e_ms", stats_json(r->e2e), "errors_by_status", errs,
                             "rss_mib", isnan(r->rss_mb) ? -1.0 : r->rss_mb, "kv_pages_used",
                             isnan(r->pages_used) ? -1.0 : r->pages_used));
    }
    const char *sc[] = {"fixed", "sweep", "session"};
    json_t *doc = json_pack("{s:s,s:s,s:i,s:f,s:i,s:b,s:o}", "scenario", sc[o->scenario],
                            "endpoint", o->endpoint, "concurrency", o->concurrency, "rate",
                            o->rate, "max_tokens", o->max_tokens, "stream", o->stream, "steps",
                            steps);
    int rc = json_dump_file(doc, path, JSON_INDENT(2));
    json_decref(doc);
    return rc;
}

/* Latency and throughput against context length, drawn by gnuplot. */
static int write_plot(const char *path, const struct step_result *res, int n)
{
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g)
        return -1;
    fprintf(g, "set terminal pngcairo size 1000,700 noenhanced\nset output '%s'\n", path);
    fprintf(g, "set multiplot layout 2,1 title 'kvd load'\nset logscale x 2\n"
               "set xlabel 'context (tokens)'\nset grid\nset key left top\n"
               "set ylabel 'latency (ms)'\n");
    fprintf(g, "plot '-' using 1:2 with linespoints title 'ttft p50', "
               "'-' using 1:2 with linespoints title 'itl p50', "
               "'-' using 1:2 with linespoints title 'e2e p99'\n");
    for (int s = 0; s < 3; s++) {
        for (int i = 0; i < n; i++) {
            double v = s == 0 ? res[i].ttft[1] : s == 1 ? res[i].itl[1] : res[i].e2e[3];
            fprintf(g, "%d %f\n", res[i].context, v * 1e3);
        }
        fprintf(g, "e\n");
    }
    fprintf(g, "set ylabel 'output tokens/s'\nplot '-' using 1:2 with linespoints "
               "title 'output tokens/s'\n");
    for (int i = 0; i < n; i++)
        fprintf(g, "%d %f\n", res[i].context, res[i].out_tps);
    fprintf(g, "e\nunset multiplot\n");
    return pclose(g) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------ */

static int steps_of(const struct load_opts *o, int *ctx)
{
    switch (o->scenario) {
    case SC_FIXED:
        ctx[0] = o->prompt_tokens;
        return 1;
    case SC_SWEEP:
        memcpy(ctx, o->contexts, sizeof(int) * (size_t)o->n_contexts);
        return o->n_contexts;
    case SC_SESSION:
        for (int t = 0; t < o->turns; t++)
            ctx[t] = (t + 1) * o->turn_tokens;
        return o->turns;
    }
    return 0;
}

static int write_outputs(const struct load_opts *o, const struct step_result *res, int n)
{
    int rc = 0;
    if (o->csv && write_csv(o->csv, res, n)) {
        fprintf(stderr, "kvd load: cannot write %s\n", o->csv);
        rc = 1;
    }
    if (o->json && write_json(o->json, o, res, n)) {
        fprintf(stderr, "kvd load: cannot write %s\n", o->json);
        rc = 1;
    }
    if (o->plot) {
        if (write_plot(o->plot, res, n)) {
            fprintf(stderr, "kvd load: gnuplot failed (is gnuplot-nox installed?)\n");
            rc = 1;
        } else {
            printf("plot: %s\n", o->plot);
        }
    }
    return rc;
}

int srv_cmd_load(int argc, char **argv)
{
    struct load_opts o;
    bool help = false;
    if (parse_opts(argc, argv, &o, &help))
        return 2;
    if (help) {
        load_usage(stdout);
        return 0;
    }
    char err[256], auth[300] = "";
    if (o.api_key)
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s\r\n", o.api_key);
    struct lc_conn *ctl = lc_connect(o.host, o.port, o.timeout, err, sizeof(err));
    if (!ctl) {
        fprintf(stderr, "kvd load: %s\n", err);
        return 1;
    }
    struct load_run run = {.o = &o};
    run.n_corpus = fetch_corpus(ctl, &o, auth[0] ? auth : NULL, (int32_t **)&run.corpus);
    int ctx[MAX_STEPS];
    int n_steps = steps_of(&o, ctx);
    run.max_samples = o.duration > 0 ? 1 << 20 : (o.requests > o.concurrency ? o.requests
                                                                             : o.concurrency);
    run.samples = calloc((size_t)run.max_samples, sizeof(struct sample));
    struct client *clients = calloc((size_t)o.concurrency, sizeof(struct client));
    struct step_result res[MAX_STEPS];
    memset(res, 0, sizeof(res));
    int rc = 0, done = 0;
    if (run.n_corpus <= 0 || !run.samples || !clients) {
        rc = 1;
        goto out;
    }
    for (int i = 0; i < o.concurrency; i++) {
        clients[i] = (struct client){.run = &run, .idx = i};
        snprintf(clients[i].session, sizeof(clients[i].session), "load-%d-%ld", i,
                 (long)time(NULL));
        clients[i].conn = lc_connect(o.host, o.port, o.timeout, err, sizeof(err));
        if (!clients[i].conn) {
            fprintf(stderr, "kvd load: %s\n", err);
            rc = 1;
            goto out;
        }
    }
    printf("kvd load: %s:%d %s, %d clients%s, %d tokens out per request\n", o.host, o.port,
           o.endpoint, o.concurrency, o.stream ? ", streaming" : "", o.max_tokens);
    print_header();
    for (int s = 0; s < n_steps; s++) {
        fprintf(stderr, "\r  step %d/%d: context %d ...", s + 1, n_steps, ctx[s]);
        run.step = s;
        run.step_tokens = o.scenario == SC_SESSION ? o.turn_tokens : ctx[s];
        res[s].context = ctx[s];
        run_step(&run, clients, &res[s]);
        read_server_metrics(ctl, &res[s]);
        fprintf(stderr, "\r%60s\r", "");
        print_row(&res[s]);
        fflush(stdout);
        done++;
    }
    rc = write_outputs(&o, res, done);
out:
    for (int i = 0; clients && i < o.concurrency; i++)
        lc_close(clients[i].conn);
    free(clients);
    free(run.samples);
    free((void *)run.corpus);
    lc_close(ctl);
    return rc;
}
