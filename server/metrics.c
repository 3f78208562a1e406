/*
 * metrics.c - the daemon's counters, gauges and histograms, rendered as
 * Prometheus text for GET /metrics.
 *
 * Both threads record here: the loop thread counts responses by status,
 * the engine thread observes latencies, batch sizes and its gauges after
 * every step. One mutex guards everything; it is never held while taking
 * another lock and never across I/O. Histograms have fixed buckets
 * (cumulative counts are computed when rendering), so an observation is a
 * few comparisons and additions.
 */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/metrics.h"
#include "engine/engine.h" /* enum engine_finish */

#define MAX_BUCKETS 16
#define MAX_STATUS 600

struct hist_def {
    const char *name;
    const char *help;
    int n;                  /* finite buckets */
    double le[MAX_BUCKETS]; /* upper bounds, increasing */
};

static const struct hist_def hist_defs[SRV_HIST_COUNT] = {
    [SRV_HIST_TTFT] = {"kvd_time_to_first_token_seconds",
                       "Seconds from a request's arrival to its first generated token.",
                       14,
                       {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                        30}},
    [SRV_HIST_ITL] = {"kvd_inter_token_latency_seconds",
                      "Seconds between consecutive generated tokens of a request.",
                      13,
                      {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5}},
    [SRV_HIST_BATCH_SEQS] = {"kvd_batch_sequences",
                             "Sequences in one engine step (one forward pass).",
                             9,
                             {1, 2, 4, 8, 16, 32, 64, 128, 256}},
    [SRV_HIST_BATCH_TOKENS] = {"kvd_batch_tokens",
                               "Tokens in one engine step (decode tokens plus prefill chunks).",
                               13,
                               {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096}},
};

struct hist {
    uint64_t counts[MAX_BUCKETS + 1]; /* per bucket, last = +Inf */
    uint64_t count;
    double sum;
    double max;
};

struct srv_metrics {
    pthread_mutex_t mu;
    uint64_t status[MAX_STATUS];
    uint64_t prompt_tokens, cached_tokens, generated_tokens, cancelled;
    uint64_t evicted_in_place, evicted_rerender, turn_fallbacks;
    int api_jobs; /* requests being prepared off the loop thread */
    uint64_t conn_events[SRV_CONN_EVENT_COUNT];
    uint64_t cut_drain, cut_pool, cut_policy;
    struct hist hist[SRV_HIST_COUNT];
    struct srv_engine_gauges g;
    uint64_t config_generation;
    bool config_last_ok;
    int64_t config_last_time;
};

srv_metrics *srv_metrics_create(void)
{
    srv_metrics *m = calloc(1, sizeof(*m));
    if (!m) {
        fprintf(stderr, "kvd: out of memory (%zu bytes)\n", sizeof(*m));
        abort();
    }
    pthread_mutex_init(&m->mu, NULL);
    m->config_generation = 1;
    m->config_last_ok = true;
    return m;
}

void srv_metrics_destroy(srv_metrics *m)
{
    if (!m)
        return;
    pthread_mutex_destroy(&m->mu);
    free(m);
}

void srv_metrics_status(srv_metrics *m, int status)
{
    if (status < 100 || status >= MAX_STATUS)
        return;
    pthread_mutex_lock(&m->mu);
    m->status[status]++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_tokens(srv_metrics *m, uint64_t prompt, uint64_t cached, uint64_t generated)
{
    pthread_mutex_lock(&m->mu);
    m->prompt_tokens += prompt;
    m->cached_tokens += cached;
    m->generated_tokens += generated;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_cancelled(srv_metrics *m)
{
    pthread_mutex_lock(&m->mu);
    m->cancelled++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_api_jobs(srv_metrics *m, int n)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->api_jobs = n;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_evicted_messages(srv_metrics *m, bool in_place, uint64_t n)
{
    if (!m || !n)
        return;
    pthread_mutex_lock(&m->mu);
    if (in_place)
        m->evicted_in_place += n;
    else
        m->evicted_rerender += n;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_turn_fallback(srv_metrics *m)
{
    if (!m)
        return;
    pthread_mutex_lock(&m->mu);
    m->turn_fallbacks++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_conn(srv_metrics *m, enum srv_conn_event e)
{
    pthread_mutex_lock(&m->mu);
    m->conn_events[e]++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_cut(srv_metrics *m, int f)
{
    pthread_mutex_lock(&m->mu);
    if (f == ENGINE_FINISH_ABORT)
        m->cut_drain++;
    else if (f == ENGINE_FINISH_POOL)
        m->cut_pool++;
    else
        m->cut_policy++;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_observe(srv_metrics *m, enum srv_hist h, double value)
{
    const struct hist_def *d = &hist_defs[h];
    int b = 0;
    while (b < d->n && value > d->le[b])
        b++;
    pthread_mutex_lock(&m->mu);
    struct hist *x = &m->hist[h];
    x->counts[b]++;
    x->count++;
    x->sum += value;
    if (value > x->max)
        x->max = value;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_engine(srv_metrics *m, const struct srv_engine_gauges *g)
{
    pthread_mutex_lock(&m->mu);
    m->g = *g;
    pthread_mutex_unlock(&m->mu);
}

void srv_metrics_config(srv_metrics *m, uint64_t generation, bool last_ok, int64_t when_unix_s)
{
    pthread_mutex_lock(&m->mu);
    m->config_generation = generation;
    m->config_last_ok = last_ok;
    m->config_last_time = when_unix_s;
    pthread_mutex_unlock(&m->mu);
}

/* A growing text buffer; on allocation failure it stops growing and
 * remembers the failure. */
struct tbuf {
    char *p;
    size_t len, cap;
    bool failed;
};

__attribute__((format(printf, 2, 3))) static void tb_printf(struct tbuf *b, const char *fmt, ...)
{
    if (b->failed)
        return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(b->p ? b->p + b->len : NULL, b->p ? b->cap - b->len : 0, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->failed = true;
            return;
        }
        if (b->p && b->len + (size_t)n < b->cap) {
            b->len += (size_t)n;
            return;
        }
        size_t cap = b->cap ? b->cap * 2 : 8192;
        while (cap < b->len + (size_t)n + 1)
            cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) {
            b->failed = true;
            return;
        }
        b->p = q;
        b->cap = cap;
    }
}

static void render_counter(struct tbuf *b, const char *name, const char *help, uint64_t v)
{
    tb_printf(b, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name,
              (unsigned long long)v);
}

static void render_gauge(struct tbuf *b, const char *name, const char *help, double v)
{
    tb_printf(b, "# HELP %s %s\n# TYPE %s gauge\n%s %.17g\n", name, help, name, name, v);
}

/* The prefix cache's figures (engine/prefix.c, cache/prefix.c). */
static void render_prefix(struct tbuf *b, const struct srv_engine_gauges *g)
{
    const struct kv_prefix_stats *p = &g->prefix;
    double page = (double)g->kv_page_bytes;
    render_counter(b, "kvd_prefix_cache_prompt_tokens_total",
                   "Prompt tokens of requests that could attach cached prefix pages.",
                   g->prefix_prompt_tokens);
    render_counter(b, "kvd_prefix_cache_hit_tokens_total",
                   "Of them, tokens attached from the prefix cache (not prefilled).",
                   g->prefix_hit_tokens);
    render_gauge(b, "kvd_prefix_cache_hit_ratio",
                 "Prefix cache hit tokens / prompt tokens of requests that could attach.",
                 g->prefix_prompt_tokens
                     ? (double)g->prefix_hit_tokens / (double)g->prefix_prompt_tokens
                     : 0.0);
    render_gauge(b, "kvd_prefix_cache_pages", "KV pages listed in the prefix cache.",
                 p->pages_listed);
    render_gauge(b, "kvd_prefix_cache_idle_pages",
                 "Listed pages no request uses (reclaimable, least recently used first).",
                 p->pages_idle);
    render_gauge(b, "kvd_prefix_cache_shared_bytes",
                 "Bytes of listed pages that two or more sequences read at once.",
                 (double)p->pages_shared * page);
    render_gauge(b, "kvd_prefix_cache_saved_bytes",
                 "Bytes sharing saves now: the copies sequences would otherwise hold.",
                 (double)p->page_refs_saved * page);
    render_counter(b, "kvd_prefix_cache_reclaimed_pages_total",
                   "Idle cached pages given back to the pool (pool short, or the share cap).",
                   p->pages_reclaimed);
}

/* Sessions on disk ([sessions] dir; engine/sessions_spill.c). */
static void render_spill(struct tbuf *b, const struct srv_engine_gauges *g)
{
    render_counter(b, "kvd_sessions_spilled_total",
                   "Sessions written to [sessions] dir instead of lost.", g->spill_saved);
    render_counter(b, "kvd_sessions_spill_failed_total",
                   "Sessions that could not be written to [sessions] dir, and were lost.",
                   g->spill_save_failed);
    render_counter(b, "kvd_sessions_restored_total", "Sessions read back from [sessions] dir.",
                   g->spill_restored);
    render_counter(b, "kvd_sessions_restore_refused_total",
                   "Session files refused when read (another model or format, corrupted, "
                   "truncated, no room): a cache miss.",
                   g->spill_refused);
    render_counter(b, "kvd_sessions_spilled_bytes_total",
                   "Bytes of session files written to [sessions] dir.", g->spill_bytes_saved);
    render_counter(b, "kvd_sessions_restored_bytes_total",
                   "Bytes of session files read back from [sessions] dir.",
                   g->spill_bytes_restored);
}

char *srv_metrics_render(srv_metrics *m, size_t *len)
{
    /* Copy under the lock, format outside it. */
    srv_metrics c;
    pthread_mutex_lock(&m->mu);
    memcpy(&c, m, sizeof(c));
    pthread_mutex_unlock(&m->mu);

    struct tbuf b = {0};
    tb_printf(&b, "# HELP kvd_http_requests_total HTTP responses sent, by status code.\n"
                  "# TYPE kvd_http_requests_total counter\n");
    for (int s = 100; s < MAX_STATUS; s++)
        if (c.status[s])
            tb_printf(&b, "kvd_http_requests_total{code=\"%d\"} %llu\n", s,
                      (unsigned long long)c.status[s]);
    render_counter(&b, "kvd_prompt_tokens_total",
                   "Prompt tokens prefilled (run through the model).", c.prompt_tokens);
    render_counter(&b, "kvd_prompt_tokens_cached_total",
                   "Prompt tokens found cached (a session's history or the prefix cache), not "
                   "prefilled.",
                   c.cached_tokens);
    render_counter(&b, "kvd_generated_tokens_total", "Tokens generated.", c.generated_tokens);
    render_counter(&b, "kvd_requests_cancelled_total",
                   "Requests whose client disconnected before the end.", c.cancelled);
    tb_printf(&b, "# HELP kvd_chat_evicted_messages_total Chat messages evicted whole turns at "
                  "a time ([eviction] unit = turn): in place from a session's cache, or left "
                  "out of a rendering.\n# TYPE kvd_chat_evicted_messages_total counter\n"
                  "kvd_chat_evicted_messages_total{how=\"in_place\"} %llu\n"
                  "kvd_chat_evicted_messages_total{how=\"rerender\"} %llu\n",
              (unsigned long long)c.evicted_in_place, (unsigned long long)c.evicted_rerender);
    render_counter(&b, "kvd_chat_turn_fallbacks_total",
                   "Chat requests on a session whose turns could not be evicted in place (the "
                   "template or tokenizer does not cut at turns, or the conversation passes "
                   "max_prompt_tokens): rendered again instead, the reason logged and in usage.",
                   c.turn_fallbacks);
    tb_printf(&b, "# HELP kvd_requests_cut_short_total Completions the server cut short "
                  "(answered as an error, never as a normal finish), by reason.\n"
                  "# TYPE kvd_requests_cut_short_total counter\n"
                  "kvd_requests_cut_short_total{reason=\"drain\"} %llu\n"
                  "kvd_requests_cut_short_total{reason=\"kv_pool_full\"} %llu\n"
                  "kvd_requests_cut_short_total{reason=\"policy_none\"} %llu\n",
              (unsigned long long)c.cut_drain, (unsigned long long)c.cut_pool,
              (unsigned long long)c.cut_policy);
    static const char *const conn_reason[SRV_CONN_EVENT_COUNT] = {
        [SRV_CONN_SLOW_READER] = "slow_reader",
        [SRV_CONN_SHED_IDLE] = "shed_idle",
        [SRV_CONN_BODY_TIMEOUT] = "body_timeout",
        [SRV_CONN_ACCEPT_FAILED] = "accept_failed",
    };
    tb_printf(&b, "# HELP kvd_http_connections_closed_total Connections the server ended or "
                  "could not take, by reason.\n"
                  "# TYPE kvd_http_connections_closed_total counter\n");
    for (int e = 0; e < SRV_CONN_EVENT_COUNT; e++)
        tb_printf(&b, "kvd_http_connections_closed_total{reason=\"%s\"} %llu\n", conn_reason[e],
                  (unsigned long long)c.conn_events[e]);
    for (int h = 0; h < SRV_HIST_COUNT; h++) {
        const struct hist_def *d = &hist_defs[h];
        const struct hist *x = &c.hist[h];
        tb_printf(&b, "# HELP %s %s\n# TYPE %s histogram\n", d->name, d->help, d->name);
        uint64_t cum = 0;
        for (int i = 0; i < d->n; i++) {
            cum += x->counts[i];
            tb_printf(&b, "%s_bucket{le=\"%g\"} %llu\n", d->name, d->le[i],
                      (unsigned long long)cum);
        }
        cum += x->counts[d->n];
        tb_printf(&b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", d->name,
                  (unsigned long long)cum, d->name, x->sum, d->name, (unsigned long long)x->count);
    }
    render_gauge(&b, "kvd_batch_sequences_max", "Most sequences seen in one engine step.",
                 c.hist[SRV_HIST_BATCH_SEQS].max);
    render_gauge(&b, "kvd_queue_depth", "Requests waiting for admission.", c.g.queue_depth);
    render_gauge(&b, "kvd_api_jobs",
                 "Requests being rendered, tokenized or decoded off the loop thread.", c.api_jobs);
    render_gauge(&b, "kvd_running_sequences", "Sequences being prefilled or decoded.", c.g.running);
    render_gauge(&b, "kvd_sessions", "Live sessions.", c.g.sessions);
    render_gauge(&b, "kvd_kv_pages_total", "KV cache pages in the pool.", c.g.kv_pages_total);
    render_gauge(&b, "kvd_kv_pages_used", "KV cache pages holding tokens.", c.g.kv_pages_used);
    render_gauge(&b, "kvd_kv_pages_free", "KV cache pages free.", c.g.kv_pages_free);
    tb_printf(&b,
              "# HELP kvd_kv_type_info Element types the KV cache stores keys and values in.\n"
              "# TYPE kvd_kv_type_info gauge\nkvd_kv_type_info{k_type=\"%s\",v_type=\"%s\"} 1\n",
              kv_type_name(c.g.kv_k_type), kv_type_name(c.g.kv_v_type));
    render_gauge(&b, "kvd_kv_page_bytes", "Bytes of one KV cache page (K and V of its tokens).",
                 (double)c.g.kv_page_bytes);
    render_counter(&b, "kvd_kv_evictions_total", "Eviction steps that removed tokens.",
                   c.g.evictions);
    render_counter(&b, "kvd_kv_evicted_tokens_total", "Tokens removed from caches by eviction.",
                   c.g.tokens_evicted);
    render_counter(&b, "kvd_sessions_dropped_total",
                   "Idle sessions dropped whole because the pool was short.", c.g.sessions_dropped);
    if (c.g.prefix_on)
        render_prefix(&b, &c.g);
    render_spill(&b, &c.g);
    render_gauge(&b, "kvd_config_generation",
                 "Config generation: 1 at start, +1 for each successful reload.",
                 (double)c.config_generation);
    render_gauge(&b, "kvd_config_last_reload_success",
                 "1 if the last reload succeeded (or none happened), else 0.",
                 c.config_last_ok ? 1 : 0);
    render_gauge(&b, "kvd_config_last_reload_timestamp_seconds",
                 "Unix time of the last reload attempt (0 = none).", (double)c.config_last_time);
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    *len = b.len;
    return b.p;
}
