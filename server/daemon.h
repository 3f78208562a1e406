/*
 * daemon.h - the serve loop (daemon.c): the libuv loop thread, the engine
 * thread, signals, reload and drain. Threads: the loop thread (http.c,
 * api.c, daemon.c) and the engine thread (scheduler.c); metrics.c and
 * log.c lock.
 */
#ifndef KVD_SERVER_DAEMON_H
#define KVD_SERVER_DAEMON_H

#include <stdbool.h>
#include <stdint.h>

#include "server/api.h"
#include "server/http.h"
#include "server/scheduler.h"

struct srv_serve_config {
    char host[256];
    int port;
    struct srv_http_params http;
    struct srv_api_params api;
    struct srv_sched_params sched;
    uint64_t drain_timeout_ms;
    char config_path[4096]; /* "" when none: SIGHUP then only logs */
    /* Optional: re-read the config for SIGHUP into *out (which holds the
     * current config on entry). Returns 0, or -1 having logged every error.
     * reload_commit then says whether the server switched to it (the
     * engine may still refuse what the file allows). */
    int (*reload)(const char *path, struct srv_serve_config *out, void *ud);
    void (*reload_commit)(void *ud, bool applied);
    void *reload_ud;
};

/* Run the daemon until SIGTERM/SIGINT. Returns the exit status. */
int srv_serve_run(struct srv_serve_config *cfg);

#endif /* KVD_SERVER_DAEMON_H */
