/*
 * api.h - routes, JSON, the OpenAI and llama.cpp shapes (api.c), on the
 * loop thread.
 */
#ifndef KVD_SERVER_API_H
#define KVD_SERVER_API_H

#include <stdbool.h>
#include <stddef.h>

#include "cache/kv_cache.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/scheduler.h"

typedef struct srv_api srv_api;

struct srv_api_params {
    int max_prompt_tokens;   /* 400 above this */
    int max_tokens;          /* the largest max_tokens / n_predict accepted */
    int default_max_tokens;  /* when the request says none */
    int max_choices;         /* the largest n (OpenAI choices per request) accepted */
    const char *api_key;     /* NULL or "" = no auth (copied) */
    struct kv_policy policy; /* to reject prompts that can never fit (policy none) */
    int page_tokens;         /* tokens per KV page (pinned spans' budget) */
    int max_session_id;      /* longest session id accepted */
    const char *chat_template; /* [model] chat_template, or NULL/"" (copied) */
    bool chat_turns;           /* [eviction] unit = turn: chat turns leave whole */
    const char *config_json;   /* GET /v1/config's answer: the effective config, each key
                                  with its origin (copied; NULL = 404) */
    uint64_t engine_stall_ms;  /* /health: 503 when an engine step runs longer (0 = never) */
};

struct uv_loop_s;
/* The API on loop (its work queue takes rendering and tokenizing off the
 * loop thread; NULL runs them inline, for tools and tests). */
srv_api *srv_api_create(struct uv_loop_s *loop, srv_sched *sched, srv_metrics *metrics,
                        const struct srv_api_params *p);
void srv_api_destroy(srv_api *a);
void srv_api_set_params(srv_api *a, const struct srv_api_params *p);
/* The srv_http_handler. */
void srv_api_handle(void *ud, srv_conn *conn, const struct srv_http_req *req);
/* Take the engine's events and answer the requests they belong to.
 * Returns false if a ENGINE_EV_FATAL arrived (message in err). */
bool srv_api_pump(srv_api *a, char *err, size_t errlen);
/* Draining: new completions get 503, /health says so. */
void srv_api_set_draining(srv_api *a, bool draining);
/* Completions accepted and not yet finished (the client may have left). */
int srv_api_in_flight(const srv_api *a);
/* Cut every in-flight completion short (drain deadline). */
void srv_api_abort_all(srv_api *a);
#endif /* KVD_SERVER_API_H */
