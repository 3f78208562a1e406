/*
 * cmd_load.c - `kvd load`: how latency and throughput change with context.
 *
 * Scenarios, each a series of steps:
 *   fixed    one step: prompts of exactly --prompt-tokens tokens
 *   sweep    one step per length in --contexts (e.g. 512,2048,8192,...)
 *   session  every client keeps a session; each turn (step) appends
 *            --turn-tokens new tokens, the long-chat case the cache is for
 * Prompts are sent as arrays of token ids taken from the server's own
 * /tokenize of a text, so every prompt has an exact length. In the session
 * scenario the conversation is the previous prompt, the answer's tokens
 * (when the server returns them: /completion with return_tokens) and the
 * new tokens, so the server finds everything but the new tokens in its
 * cache; the session id travels in the body and in X-Session-Id, so a
 * session-affine balancer keeps each session on one replica.
 *
 * Each step runs --requests requests (or for --duration, whichever ends
 * first when both are given) at --concurrency clients (one thread and one
 * keep-alive connection each), optionally paced to --rate requests/s; a
 * session step is one turn of every client. Requests ask for exactly
 * --max-tokens tokens (ignore_eos). Per step it reports what vLLM's and
 * llama.cpp's benchmarks report: requests/s, output tokens/s, time to first
 * token, inter-token latency (the gaps between streamed token events) and
 * end-to-end latency (mean, p50, p90, p99), errors by status, and the
 * server's RSS and KV pages used, read from /metrics while the step runs
 * (the peak is reported). A table goes to stdout (a progress line to
 * stderr during long steps); --csv, --json and --plot write files.
 *
 * It targets only the address it is given and refuses anything but
 * loopback unless --allow-remote is passed: a load tester should never be
 * one typo away from loading someone else's server.
 *
 * This file runs the steps: prompts, client threads, reading answers and
 * aggregating them; the options are options.c's, the table and the output
 * files report.c's.
 */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "load/client.h"
#include "load/load.h"
#include "load/load_internal.h"

/* One request's measurements. */
struct sample {
    int status;     /* HTTP status; 0: no answer; STATUS_STREAM_ERROR */
    int sent;       /* prompt tokens sent */
    double ttft;    /* seconds to the first token event (e2e when not streamed) */
    double e2e;     /* seconds to the end of the answer */
    int out_tokens; /* completion tokens (usage; else token events) */
    int cached;     /* prompt tokens the server had cached, or -1 */
    float *gaps;    /* [n_gaps] seconds between token events (owned) */
    int n_gaps, cap_gaps;
};

struct load_run;

struct client {
    struct load_run *run;
    int idx;
    struct lc_conn *conn;
    char session[64];
    int32_t *conv; /* session scenario: the conversation so far */
    int n_conv, cap_conv;
    long fed; /* corpus tokens this client has appended */
};

struct load_run {
    const struct load_opts *o;
    const int32_t *corpus;
    int n_corpus;
    int step_tokens; /* prompt tokens for this step (new tokens for session turns) */
    atomic_int next; /* next request index of the step */
    atomic_int done_clients;
    double t0;
    double t_end;       /* when the last client finished (under mu) */
    pthread_mutex_t mu; /* guards samples */
    struct sample *samples;
    int n_samples, cap_samples;
};

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

/* A whole file (new, NUL-terminated); NULL when it cannot be read. */
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
    bool failed = ferror(f);
    fclose(f);
    if (failed) {
        free(buf);
        return NULL;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Ask the server to tokenize the corpus text (*out new). Returns the token
 * count, or -1 having said why. */
static int fetch_corpus(struct lc_conn *c, const struct load_opts *o, const char *auth,
                        int32_t **out)
{
    size_t len = strlen(default_text);
    char *text = o->file ? read_file(o->file, &len) : strdup(default_text);
    if (!text) {
        fprintf(stderr, "kvd load: cannot read %s\n", o->file ? o->file : "(built-in text)");
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
    for (int i = 0; i < n; i++) {
        json_t *t = json_array_get(toks, (size_t)i);
        if (!json_is_integer(t)) {
            fprintf(stderr, "kvd load: /tokenize returned a token that is not an integer\n");
            free(*out);
            *out = NULL;
            json_decref(resp);
            return -1;
        }
        (*out)[i] = (int32_t)json_integer_value(t);
    }
    json_decref(resp);
    return n;
}

/* The request body (new): prompt ids[0..n), or `n` corpus tokens from
 * `from` when ids is NULL. NULL when memory runs out. */
static char *make_body(const struct load_run *run, const int32_t *ids, int from, int n,
                       const char *session)
{
    const struct load_opts *o = run->o;
    json_t *prompt = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(prompt,
                              json_integer(ids ? ids[i] : run->corpus[(from + i) % run->n_corpus]));
    json_t *req = json_object();
    json_object_set_new(req, "prompt", prompt);
    json_object_set_new(req, "stream", json_boolean(o->stream));
    json_object_set_new(req, "temperature", json_real(0.0));
    json_object_set_new(req, "ignore_eos", json_true());
    if (!strcmp(o->endpoint, "/completion")) {
        json_object_set_new(req, "n_predict", json_integer(o->max_tokens));
        json_object_set_new(req, "cache_prompt", json_boolean(session != NULL));
        if (session) /* the answer's ids continue the conversation */
            json_object_set_new(req, "return_tokens", json_true());
    } else {
        json_object_set_new(req, "max_tokens", json_integer(o->max_tokens));
        if (o->stream)
            json_object_set_new(req, "stream_options", json_pack("{s:b}", "include_usage", 1));
    }
    if (session)
        json_object_set_new(req, "session", json_string(session));
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    return body;
}

/* ------------------------------------------------------------------------
 * Reading answers
 * ------------------------------------------------------------------------ */

/* What one answer said, streamed or not. */
struct answer {
    double start, first, last; /* monotonic seconds; first/last token events */
    int n_events;              /* token events seen */
    struct sample *s;
    char *pend; /* SSE bytes not yet split into events */
    size_t n_pend, cap_pend;
    bool oom;
    bool error_event;
    int usage_out, usage_cached; /* -1 when the answer did not say */
    int32_t *gen;                /* the answer's token ids, if returned */
    int n_gen;
};

static void push_gap(struct sample *s, double gap, bool *oom)
{
    if (s->n_gaps == s->cap_gaps) {
        int cap = s->cap_gaps ? s->cap_gaps * 2 : 64;
        float *g = realloc(s->gaps, sizeof(float) * (size_t)cap);
        if (!g) {
            *oom = true;
            return;
        }
        s->gaps = g;
        s->cap_gaps = cap;
    }
    s->gaps[s->n_gaps++] = (float)gap;
}

/* Usage figures of an OpenAI body or chunk, or of llama.cpp's final object. */
static void read_usage(struct answer *a, json_t *v)
{
    json_t *u = json_object_get(v, "usage");
    if (json_is_object(u)) {
        json_t *ct = json_object_get(u, "completion_tokens");
        json_t *cached =
            json_object_get(json_object_get(u, "prompt_tokens_details"), "cached_tokens");
        if (json_is_integer(ct))
            a->usage_out = (int)json_integer_value(ct);
        if (json_is_integer(cached))
            a->usage_cached = (int)json_integer_value(cached);
        return;
    }
    if (!json_is_true(json_object_get(v, "stop")))
        return;
    json_t *tp = json_object_get(v, "tokens_predicted");
    json_t *tc = json_object_get(v, "tokens_cached");
    if (json_is_integer(tp))
        a->usage_out = (int)json_integer_value(tp);
    if (json_is_integer(tc))
        a->usage_cached = (int)json_integer_value(tc);
    json_t *toks = json_object_get(v, "tokens");
    size_t n = json_is_array(toks) ? json_array_size(toks) : 0;
    if (n > 0 && (a->gen = malloc(sizeof(int32_t) * n)) != NULL) {
        a->n_gen = (int)n;
        for (size_t i = 0; i < n; i++)
            a->gen[i] = (int32_t)json_integer_value(json_array_get(toks, i));
    }
}

/* One SSE event's data: stamp it if it carries a token, keep its usage. */
static void on_event(struct answer *a, const char *data, size_t n, double now)
{
    if (n == 6 && !memcmp(data, "[DONE]", 6))
        return;
    json_t *v = json_loadb(data, n, 0, NULL);
    if (!v || json_object_get(v, "error")) {
        a->error_event = true;
        json_decref(v);
        return;
    }
    json_t *ch = json_array_get(json_object_get(v, "choices"), 0);
    const char *text = json_string_value(json_object_get(ch ? ch : v, ch ? "text" : "content"));
    bool final = json_is_true(json_object_get(v, "stop"));
    json_t *toks = json_object_get(v, "tokens");
    bool token = (text && *text) || (!final && json_array_size(toks) > 0);
    if (token) {
        if (a->n_events == 0)
            a->first = now;
        else
            push_gap(a->s, now - a->last, &a->oom);
        a->last = now;
        a->n_events++;
    }
    read_usage(a, v);
    json_decref(v);
}

/* Body bytes of a streamed answer as they arrive: split into events. */
static void on_sse(void *user, const char *data, size_t len)
{
    struct answer *a = user;
    double now = lc_now();
    if (a->n_pend + len + 1 > a->cap_pend) {
        size_t cap = a->cap_pend ? a->cap_pend : 4096;
        while (cap < a->n_pend + len + 1)
            cap *= 2;
        char *p = realloc(a->pend, cap);
        if (!p) {
            a->oom = true;
            return;
        }
        a->pend = p;
        a->cap_pend = cap;
    }
    memcpy(a->pend + a->n_pend, data, len);
    a->n_pend += len;
    size_t off = 0;
    for (;;) {
        char *end = memmem(a->pend + off, a->n_pend - off, "\n\n", 2);
        if (!end)
            break;
        const char *ev = a->pend + off;
        size_t n = (size_t)(end - ev);
        if (n >= 6 && !memcmp(ev, "data: ", 6))
            on_event(a, ev + 6, n - 6, now);
        off = (size_t)(end - a->pend) + 2;
    }
    memmove(a->pend, a->pend + off, a->n_pend - off);
    a->n_pend -= off;
}

/* ------------------------------------------------------------------------
 * Running a step
 * ------------------------------------------------------------------------ */

static void record(struct load_run *run, struct sample *s)
{
    pthread_mutex_lock(&run->mu);
    if (run->n_samples == run->cap_samples) {
        int cap = run->cap_samples ? run->cap_samples * 2 : 256;
        struct sample *p = realloc(run->samples, sizeof(*p) * (size_t)cap);
        if (!p) {
            pthread_mutex_unlock(&run->mu);
            free(s->gaps);
            return;
        }
        run->samples = p;
        run->cap_samples = cap;
    }
    run->samples[run->n_samples++] = *s;
    pthread_mutex_unlock(&run->mu);
}

/* Append n ids to the client's conversation; false when memory runs out. */
static bool conv_push(struct client *cl, const int32_t *ids, int n)
{
    if (cl->n_conv + n > cl->cap_conv) {
        int cap = cl->cap_conv ? cl->cap_conv : 1024;
        while (cap < cl->n_conv + n)
            cap *= 2;
        int32_t *p = realloc(cl->conv, sizeof(int32_t) * (size_t)cap);
        if (!p)
            return false;
        cl->conv = p;
        cl->cap_conv = cap;
    }
    memcpy(cl->conv + cl->n_conv, ids, sizeof(int32_t) * (size_t)n);
    cl->n_conv += n;
    return true;
}

/* One request of client cl (request index req_idx of the step). */
static void one_request(struct client *cl, int req_idx, const char *auth)
{
    struct load_run *run = cl->run;
    const struct load_opts *o = run->o;
    struct sample s = {.cached = -1};
    char *body;
    char headers[512];
    snprintf(headers, sizeof(headers), "%s", auth);
    if (o->scenario == SC_SESSION) {
        /* this turn's new tokens, from the client's own place in the corpus */
        bool ok = true;
        for (int i = 0; i < run->step_tokens && ok; i++) {
            int32_t t = run->corpus[(cl->idx * 104729L + cl->fed++) % run->n_corpus];
            ok = conv_push(cl, &t, 1);
        }
        body = ok ? make_body(run, cl->conv, 0, cl->n_conv, cl->session) : NULL;
        s.sent = cl->n_conv;
        size_t hl = strlen(headers);
        snprintf(headers + hl, sizeof(headers) - hl, "X-Session-Id: %s\r\n", cl->session);
    } else {
        int from = (int)((req_idx * 7919L + cl->idx * 104729L) % run->n_corpus);
        body = make_body(run, NULL, from, run->step_tokens, NULL);
        s.sent = run->step_tokens;
    }
    if (!body) {
        record(run, &s); /* status 0: could not even be sent */
        return;
    }
    struct answer a = {.start = lc_now(), .s = &s, .usage_out = -1, .usage_cached = -1};
    struct lc_response r;
    char err[256];
    int rc = lc_request(cl->conn, "POST", o->endpoint, headers, body, o->stream ? on_sse : NULL, &a,
                        &r, err, sizeof(err));
    free(body);
    double end = lc_now();
    s.e2e = end - a.start;
    s.status = rc ? 0 : r.status;
    if (s.status == 200 && !o->stream) {
        json_t *v = json_loads(r.body ? r.body : "", 0, NULL);
        if (v)
            read_usage(&a, v);
        else
            a.error_event = true;
        json_decref(v);
        a.n_events = a.usage_out > 0 ? 1 : 0;
        a.first = end;
    }
    lc_response_free(&r);
    if (s.status == 200 && (a.error_event || a.oom))
        s.status = STATUS_STREAM_ERROR;
    s.ttft = a.n_events > 0 ? a.first - a.start : 0;
    s.out_tokens = a.usage_out >= 0 ? a.usage_out : a.n_events;
    s.cached = a.usage_cached;
    if (o->scenario == SC_SESSION && s.status == 200 && a.n_gen > 0)
        conv_push(cl, a.gen, a.n_gen);
    free(a.gen);
    free(a.pend);
    record(run, &s);
}

static void client_done(struct load_run *run)
{
    double now = lc_now();
    pthread_mutex_lock(&run->mu);
    if (now > run->t_end)
        run->t_end = now;
    pthread_mutex_unlock(&run->mu);
    atomic_fetch_add(&run->done_clients, 1);
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
        one_request(cl, 0, auth); /* one turn per client per step */
        client_done(run);
        return NULL;
    }
    for (;;) {
        int i = atomic_fetch_add(&run->next, 1);
        double now = lc_now();
        if ((o->requests > 0 && i >= o->requests) ||
            (o->duration > 0 && now - run->t0 >= o->duration))
            break;
        if (o->rate > 0) { /* request i is due at t0 + i / rate */
            double due = run->t0 + i / o->rate;
            if (o->duration > 0 && due - run->t0 >= o->duration)
                break;
            if (due > now) {
                double w = due - now;
                struct timespec ts = {.tv_sec = (time_t)w,
                                      .tv_nsec = (long)((w - (double)(time_t)w) * 1e9)};
                nanosleep(&ts, NULL);
            }
        }
        one_request(cl, i, auth);
    }
    client_done(run);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* mean, p50, p90, p99 of v[0..n) (sorted in place; nearest rank). */
static void summarize(double *v, long n, double out[4])
{
    memset(out, 0, sizeof(double) * 4);
    if (n == 0)
        return;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    double sum = 0;
    for (long i = 0; i < n; i++)
        sum += v[i];
    out[0] = sum / (double)n;
    const double q[3] = {0.5, 0.9, 0.99};
    for (int k = 0; k < 3; k++) {
        long idx = (long)ceil(q[k] * (double)n) - 1;
        out[k + 1] = v[idx < 0 ? 0 : idx];
    }
}

/* Sum of the values of metric lines whose name (labels included) contains
 * `needle`; NaN when none does. */
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

static double nan_max(double a, double b)
{
    return isnan(a) ? b : isnan(b) ? a : (a > b ? a : b);
}

/* Read RSS and KV pages used from /metrics; keep the larger in res. */
static void read_server_metrics(struct lc_conn *c, const char *auth, struct step_result *res)
{
    struct lc_response r;
    char err[256];
    if (lc_request(c, "GET", "/metrics", auth, NULL, NULL, NULL, &r, err, sizeof(err)) == 0 &&
        r.status == 200 && r.body) {
        res->rss_mb =
            nan_max(res->rss_mb, metric_value(r.body, "resident_memory_bytes") / (1024.0 * 1024.0));
        res->pages_used = nan_max(res->pages_used, metric_value(r.body, "kv_pages_used"));
    }
    lc_response_free(&r);
}

static void aggregate(struct load_run *run, struct step_result *res)
{
    int n = run->n_samples;
    long n_gaps = 0;
    for (int i = 0; i < n; i++)
        n_gaps += run->samples[i].status == 200 ? run->samples[i].n_gaps : 0;
    double *ttft = calloc((size_t)n + 1, sizeof(double));
    double *e2e = calloc((size_t)n + 1, sizeof(double));
    double *itl = calloc((size_t)n_gaps + 1, sizeof(double));
    long nt = 0, ni = 0, ne = 0, n_cached = 0, sent = 0;
    double cached = 0;
    for (int i = 0; i < n && ttft && itl && e2e; i++) {
        struct sample *s = &run->samples[i];
        sent += s->sent;
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
        res->out_tokens += s->out_tokens;
        e2e[ne++] = s->e2e;
        if (s->out_tokens > 0)
            ttft[nt++] = s->ttft;
        for (int g = 0; g < s->n_gaps; g++)
            itl[ni++] = s->gaps[g];
        if (s->cached >= 0) {
            cached += s->cached;
            n_cached++;
        }
    }
    summarize(ttft, nt, res->ttft);
    summarize(itl, ni, res->itl);
    res->n_ttft = nt;
    res->n_itl = ni;
    summarize(e2e, ne, res->e2e);
    res->rps = res->wall > 0 ? res->n_ok / res->wall : 0;
    res->out_tps = res->wall > 0 ? (double)res->out_tokens / res->wall : 0;
    res->cached = n_cached ? cached / (double)n_cached : -1;
    if (run->o->scenario == SC_SESSION && n > 0)
        res->context = (int)((sent + n / 2) / n);
    free(ttft);
    free(itl);
    free(e2e);
    for (int i = 0; i < n; i++)
        free(run->samples[i].gaps);
    run->n_samples = 0;
}

static void sleep_s(double s)
{
    struct timespec ts = {.tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/*
 * Run one step: the clients' threads, while this thread samples /metrics
 * (peak RSS and KV pages) and shows progress on stderr: a line rewritten in
 * place on a terminal, a plain line every 10 s otherwise.
 */
static int run_step(struct load_run *run, struct client *clients, struct lc_conn *ctl,
                    const char *auth, const char *label, struct step_result *res)
{
    const struct load_opts *o = run->o;
    int n_clients = o->concurrency;
    atomic_store(&run->next, 0);
    atomic_store(&run->done_clients, 0);
    res->rss_mb = res->pages_used = NAN;
    run->t0 = run->t_end = lc_now();
    pthread_t th[MAX_CLIENTS];
    int started = 0;
    for (int i = 0; i < n_clients; i++) {
        if (pthread_create(&th[i], NULL, client_main, &clients[i]))
            break;
        started++;
    }
    bool tty = isatty(2);
    double last_metrics = 0, last_progress = run->t0, shown = 0;
    while (atomic_load(&run->done_clients) < started) {
        sleep_s(0.05);
        double now = lc_now();
        if (now - last_metrics >= 0.25) {
            read_server_metrics(ctl, auth, res);
            last_metrics = now;
        }
        if (now - last_progress >= (tty ? 0.5 : 10.0)) {
            pthread_mutex_lock(&run->mu);
            int done = run->n_samples;
            pthread_mutex_unlock(&run->mu);
            char line[200];
            int total = o->scenario == SC_SESSION ? started : o->requests;
            if (total > 0)
                snprintf(line, sizeof(line), "  %s: %d/%d requests, %.1f s", label, done, total,
                         now - run->t0);
            else
                snprintf(line, sizeof(line), "  %s: %d requests, %.1f of %.1f s", label, done,
                         now - run->t0, o->duration);
            fprintf(stderr, tty ? "\r%-70s" : "%s\n", line);
            fflush(stderr);
            shown = 1;
            last_progress = now;
        }
    }
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    res->wall = run->t_end - run->t0; /* not the monitor's last nap */
    if (shown && tty)
        fprintf(stderr, "\r%70s\r", "");
    read_server_metrics(ctl, auth, res);
    aggregate(run, res);
    return started == n_clients ? 0 : -1;
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

int srv_cmd_load(int argc, char **argv)
{
    struct load_opts o;
    bool help = false;
    if (load_parse_opts(argc, argv, &o, &help))
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
    pthread_mutex_init(&run.mu, NULL);
    int32_t *corpus = NULL;
    run.n_corpus = fetch_corpus(ctl, &o, auth[0] ? auth : NULL, &corpus);
    run.corpus = corpus;
    int ctx[MAX_STEPS];
    int n_steps = steps_of(&o, ctx);
    struct client *clients = calloc((size_t)o.concurrency, sizeof(struct client));
    struct step_result res[MAX_STEPS];
    memset(res, 0, sizeof(res));
    int rc = 0, done = 0;
    if (run.n_corpus <= 0 || !clients) {
        rc = 1;
        goto out;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    for (int i = 0; i < o.concurrency; i++) {
        clients[i] = (struct client){.run = &run, .idx = i};
        snprintf(clients[i].session, sizeof(clients[i].session), "load-%ld-%ld-%d", (long)getpid(),
                 (long)now.tv_sec, i);
        clients[i].conn = lc_connect(o.host, o.port, o.timeout, err, sizeof(err));
        if (!clients[i].conn) {
            fprintf(stderr, "kvd load: %s\n", err);
            rc = 1;
            goto out;
        }
    }
    printf("kvd load: %s:%d %s, scenario %s, %d clients, ", o.host, o.port, o.endpoint,
           load_scenario_name(o.scenario), o.concurrency);
    if (o.scenario == SC_SESSION)
        printf("%d turns of +%d tokens", o.turns, o.turn_tokens);
    else if (o.requests > 0 && o.duration > 0)
        printf("%d requests or %.1f s per step", o.requests, o.duration);
    else if (o.requests > 0)
        printf("%d requests per step", o.requests);
    else
        printf("%.1f s per step", o.duration);
    if (o.rate > 0 && o.scenario != SC_SESSION)
        printf(" at %.2f req/s", o.rate);
    printf(", %d tokens out%s\n", o.max_tokens, o.stream ? ", streamed" : "");
    if (o.scenario == SC_SESSION && strcmp(o.endpoint, "/completion") != 0)
        printf("note: %s returns no token ids, so answers are not fed back into the "
               "conversation (use --endpoint /completion for that)\n",
               o.endpoint);
    load_print_header();
    fflush(stdout);
    long total_ok = 0;
    for (int s = 0; s < n_steps; s++) {
        char label[64];
        snprintf(label, sizeof(label), "step %d/%d, context %d", s + 1, n_steps, ctx[s]);
        run.step_tokens = o.scenario == SC_SESSION ? o.turn_tokens : ctx[s];
        res[s].context = ctx[s];
        if (run_step(&run, clients, ctl, auth[0] ? auth : NULL, label, &res[s]))
            fprintf(stderr, "kvd load: could not start every client thread\n");
        load_print_row(&res[s]);
        fflush(stdout);
        total_ok += res[s].n_ok;
        done++;
    }
    rc = load_write_outputs(&o, res, done);
    if (total_ok == 0) {
        fprintf(stderr, "kvd load: no request succeeded\n");
        rc = 1;
    }
out:
    for (int i = 0; clients && i < o.concurrency; i++) {
        lc_close(clients[i].conn);
        free(clients[i].conv);
    }
    free(clients);
    free(run.samples);
    free(corpus);
    pthread_mutex_destroy(&run.mu);
    lc_close(ctl);
    return rc;
}
