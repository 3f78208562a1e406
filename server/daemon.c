/*
 * daemon.c - the serve loop: wires HTTP, API, engine and metrics together
 * and runs the process's life: start, reload, drain, exit.
 *
 * The main thread runs the libuv loop (I/O only). The engine thread is
 * started after the socket listens, so /health answers 503 while the model
 * loads. The engine wakes the loop with uv_async_send; the async callback
 * pumps every pending event at once (sends coalesce).
 *
 * Signals:
 *   SIGTERM, SIGINT  drain: stop accepting, close idle connections, let
 *                    running requests finish up to drain_timeout, then cut
 *                    the rest short (each still gets its final event) and
 *                    exit 0. A second one exits at once (status 1).
 *   SIGHUP           reload the config file: eviction and limit settings
 *                    swap atomically before the next engine step;
 *                    restart-only keys are reported and ignored; an invalid
 *                    file changes nothing. /metrics shows the config
 *                    generation and the last reload's result.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <uv.h>

#include "model/model.h"
#include "server/daemon.h"
#include "server/log.h"
#include "server/metrics.h"

struct daemon {
    uv_loop_t loop;
    uv_async_t wake;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t drain_timer;
    struct srv_serve_config *cfg;
    srv_metrics *metrics;
    srv_sched *sched;
    srv_api *api;
    srv_http *http;
    bool draining, closed, aborted;
    int exit_status;
    uint64_t generation;
};

static void on_handle_closed(uv_handle_t *h)
{
    (void)h;
}

/* Close a handle that was initialised (uv_*_init sets ->loop). */
static void close_handle(uv_handle_t *h)
{
    if (h->loop && !uv_is_closing(h))
        uv_close(h, on_handle_closed);
}

static void on_http_closed(void *ud)
{
    struct daemon *d = ud;
    close_handle((uv_handle_t *)&d->wake);
}

/* Close everything; the loop ends when the last handle is closed. */
static void shutdown_all(struct daemon *d)
{
    if (d->closed)
        return;
    d->closed = true;
    close_handle((uv_handle_t *)&d->sig_term);
    close_handle((uv_handle_t *)&d->sig_int);
    close_handle((uv_handle_t *)&d->sig_hup);
    close_handle((uv_handle_t *)&d->drain_timer);
    srv_http_close(d->http, on_http_closed, d);
}

static void maybe_finish_drain(struct daemon *d)
{
    if (d->draining && srv_api_in_flight(d->api) == 0) {
        srv_log(SRV_LOG_INFO, "drained: exiting");
        shutdown_all(d);
    }
}

static void on_wake(uv_async_t *a)
{
    struct daemon *d = a->data;
    char err[600];
    if (!srv_api_pump(d->api, err, sizeof(err))) {
        srv_log(SRV_LOG_ERROR, "cannot serve: %s", err);
        fprintf(stderr, "kvd serve: %s\n", err);
        d->exit_status = 1;
        shutdown_all(d);
        return;
    }
    maybe_finish_drain(d);
}

/* The engine's wake-up (engine thread): uv_async_send is the one libuv
 * call that may cross threads. */
static void notify(void *ud)
{
    struct daemon *d = ud;
    int rc = uv_async_send(&d->wake);
    if (rc < 0)
        srv_log(SRV_LOG_ERROR, "uv_async_send: %s", uv_strerror(rc));
}

static void on_drain_deadline(uv_timer_t *t)
{
    struct daemon *d = t->data;
    int n = srv_api_in_flight(d->api);
    srv_log(SRV_LOG_WARN, "drain deadline: cutting %d running request(s) short", n);
    d->aborted = true;
    srv_api_abort_all(d->api);
}

static void start_drain(struct daemon *d, const char *why)
{
    d->draining = true;
    srv_log(SRV_LOG_INFO, "%s: draining (%d request(s) running, deadline %llu ms)", why,
            srv_api_in_flight(d->api), (unsigned long long)d->cfg->drain_timeout_ms);
    srv_api_set_draining(d->api, true);
    srv_http_drain(d->http);
    int rc = uv_timer_start(&d->drain_timer, on_drain_deadline, d->cfg->drain_timeout_ms, 0);
    if (rc < 0) {
        srv_log(SRV_LOG_ERROR, "uv_timer_start: %s", uv_strerror(rc));
        srv_api_abort_all(d->api);
    }
    maybe_finish_drain(d);
}

static void reload(struct daemon *d)
{
    struct srv_serve_config *cur = d->cfg;
    if (!cur->reload || !cur->config_path[0]) {
        srv_log(SRV_LOG_WARN, "SIGHUP: no config file to reload (started without --config)");
        return;
    }
    struct srv_serve_config *next = malloc(sizeof(*next));
    if (!next) {
        srv_log(SRV_LOG_ERROR, "SIGHUP: out of memory");
        return;
    }
    *next = *cur;
    int64_t now = (int64_t)time(NULL);
    if (cur->reload(cur->config_path, next, cur->reload_ud) != 0) {
        srv_log(SRV_LOG_ERROR, "SIGHUP: %s rejected; the running configuration is kept",
                cur->config_path);
        if (cur->reload_commit)
            cur->reload_commit(cur->reload_ud, false);
        srv_metrics_config(d->metrics, d->generation, false, now);
        free(next);
        return;
    }
    char err[512];
    if (srv_sched_set_limits(d->sched, &next->sched.limits, err, sizeof(err)) != 0) {
        srv_log(SRV_LOG_ERROR, "SIGHUP: %s rejected: %s; the running configuration is kept",
                cur->config_path, err);
        if (cur->reload_commit)
            cur->reload_commit(cur->reload_ud, false);
        srv_metrics_config(d->metrics, d->generation, false, now);
        free(next);
        return;
    }
    srv_http_set_params(d->http, &next->http);
    srv_api_set_params(d->api, &next->api);
    /* Keep the strings the API params point to alive: copy over. */
    cur->http = next->http;
    cur->api = next->api;
    cur->sched.limits = next->sched.limits;
    cur->drain_timeout_ms = next->drain_timeout_ms;
    free(next);
    if (cur->reload_commit)
        cur->reload_commit(cur->reload_ud, true);
    d->generation++;
    srv_metrics_config(d->metrics, d->generation, true, now);
    srv_log(SRV_LOG_INFO, "SIGHUP: %s reloaded (config generation %llu)", cur->config_path,
            (unsigned long long)d->generation);
}

static void on_signal(uv_signal_t *s, int signum)
{
    struct daemon *d = s->data;
    if (signum == SIGHUP) {
        reload(d);
        return;
    }
    if (d->draining) {
        /* Second signal: leave now. */
        static const char msg[] = "kvd: second signal, exiting at once\n";
        ssize_t w = write(2, msg, sizeof(msg) - 1);
        (void)w;
        _exit(1);
    }
    start_drain(d, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

static int signal_start(struct daemon *d, uv_signal_t *s, int signum)
{
    int rc = uv_signal_init(&d->loop, s);
    if (rc < 0)
        return rc;
    s->data = d;
    return uv_signal_start(s, on_signal, signum);
}

int srv_serve_run(struct srv_serve_config *cfg)
{
    struct daemon d = {.cfg = cfg, .generation = 1};
    char err[600] = "";
    int rc;

    signal(SIGPIPE, SIG_IGN); /* a client gone mid-write is EPIPE, not death */

    rc = uv_loop_init(&d.loop);
    if (rc < 0) {
        fprintf(stderr, "kvd serve: uv_loop_init: %s\n", uv_strerror(rc));
        model_free(cfg->sched.loaded);
        return 1;
    }
    d.metrics = srv_metrics_create();
    cfg->sched.notify = notify;
    cfg->sched.notify_ud = &d;
    d.sched = srv_sched_create(&cfg->sched, err, sizeof(err));
    if (!d.sched) {
        fprintf(stderr, "kvd serve: %s\n", err);
        srv_metrics_destroy(d.metrics);
        uv_loop_close(&d.loop);
        return 2;
    }
    d.api = srv_api_create(&d.loop, d.sched, d.metrics, &cfg->api);
    d.http = srv_http_create(&d.loop, &cfg->http, d.metrics, srv_api_handle, d.api);
    if (!d.api || !d.http) {
        fprintf(stderr, "kvd serve: out of memory\n");
        abort();
    }

    rc = uv_async_init(&d.loop, &d.wake, on_wake);
    if (rc < 0)
        goto out_uv;
    d.wake.data = &d;
    rc = uv_timer_init(&d.loop, &d.drain_timer);
    if (rc < 0)
        goto out_uv;
    d.drain_timer.data = &d;
    if ((rc = signal_start(&d, &d.sig_term, SIGTERM)) < 0 ||
        (rc = signal_start(&d, &d.sig_int, SIGINT)) < 0 ||
        (rc = signal_start(&d, &d.sig_hup, SIGHUP)) < 0)
        goto out_uv;

    int port = 0;
    rc = srv_http_listen(d.http, cfg->host, cfg->port, &port, err, sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "kvd serve: %s\n", err);
        d.exit_status = 1;
        shutdown_all(&d);
        uv_run(&d.loop, UV_RUN_DEFAULT);
        goto out_free;
    }
    bool v6 = strchr(cfg->host, ':') != NULL;
    printf("kvd: listening on http://%s%s%s:%d\n", v6 ? "[" : "", cfg->host, v6 ? "]" : "", port);
    fflush(stdout);
    char kern[MODEL_KERNELS_LINE];
    srv_log(SRV_LOG_INFO, "listening on %s:%d; loading %s; kernels %s", cfg->host, port,
            cfg->sched.model.path, model_kernels_describe(kern, sizeof(kern)));

    rc = srv_sched_start(d.sched, d.metrics, err, sizeof(err));
    if (rc < 0) {
        fprintf(stderr, "kvd serve: %s\n", err);
        d.exit_status = 1;
        shutdown_all(&d);
    }
    uv_run(&d.loop, UV_RUN_DEFAULT);
    goto out_free;

out_uv:
    fprintf(stderr, "kvd serve: libuv: %s\n", uv_strerror(rc));
    d.exit_status = 1;
    shutdown_all(&d);
    uv_run(&d.loop, UV_RUN_DEFAULT);
out_free:
    srv_sched_destroy(d.sched);
    /* Events posted while the engine stopped belong to calls the API
     * frees now. */
    srv_api_destroy(d.api);
    srv_http_destroy(d.http);
    srv_metrics_destroy(d.metrics);
    rc = uv_loop_close(&d.loop);
    if (rc < 0)
        srv_log(SRV_LOG_WARN, "uv_loop_close: %s", uv_strerror(rc));
    if (d.exit_status == 0)
        srv_log(SRV_LOG_INFO, "bye");
    return d.exit_status;
}
