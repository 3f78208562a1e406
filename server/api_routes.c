/*
 * api_routes.c - the API's one route table and its dispatch: a request's
 * path picks a row (404 when none), the row's methods admit it (405 with
 * an Allow header built from the row), its auth column asks for the bearer
 * key (401), its readiness column for a loaded model or a server not
 * draining (503); then its handler runs. The small routes (/health,
 * /metrics, /v1/models, sessions) are here too; the others live with what
 * they do (completions in api_calls.c, tokens in api_tokens.c, the chat
 * template in api_chat.c).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "cpu/cpu.h"
#include "cpu/pool.h"
#include "model/quant.h"
#include "server/api_internal.h"
#include "server/log.h"
#include "server/route_map.h"
#include "server/web.h"

/* Methods a route accepts; HEAD goes wherever GET does (the HTTP layer
 * drops the body). M_ANY: the handler answers methods itself. */
enum { M_GET = 1, M_POST = 2, M_DELETE = 4, M_OTHER = 8, M_ANY = 15 };

/* What a route needs before its handler runs. */
enum need {
    NEED_NOTHING, /* probes, scrapers; or the handler checks itself */
    NEED_MODEL,   /* a loaded model: 503 "loading" before */
    NEED_SERVING, /* not draining (503), and a loaded model (503 "loading") */
};

typedef void route_fn(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest);

struct route {
    const char *path; /* the whole path, or (prefix) what starts it */
    bool prefix;      /* path is a prefix; the rest (non-empty) goes to the handler */
    bool (*match)(const char *path); /* instead of path, when set */
    unsigned methods; /* M_* */
    bool auth;        /* the bearer key is required (when one is configured) */
    enum need need;
    route_fn *handle;
};

/* ------------------------------------------------------------------------
 * Handlers
 * ------------------------------------------------------------------------ */

static void route_completion(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                             srv_completion_decoder *decode)
{
    struct srv_api_error e = {0};
    json_t *body = srv_decode_body(req->body, req->body_len, &e);
    if (!body) {
        srv_api_error_from(c, &e);
        return;
    }
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    struct srv_completion comp;
    int rc = decode(&lim, body, srv_http_header(req, "X-Session-Id"), &comp, &e);
    json_decref(body);
    if (rc) {
        srv_api_error_from(c, &e);
        return;
    }
    srv_call_start(a, c, &comp);
}

static void route_openai(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest)
{
    (void)rest;
    route_completion(a, c, req, srv_decode_openai);
}

static void route_llama(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest)
{
    (void)rest;
    route_completion(a, c, req, srv_decode_llama);
}

static void route_chat(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest)
{
    (void)rest;
    route_completion(a, c, req, srv_decode_chat);
}

/* GET/DELETE /v1/sessions/ID and GET /v1/sessions/ID/map (map: its
 * options, already read). */
static void session_call(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *id,
                         enum call_kind kind, const struct engine_map_opts *map)
{
    struct srv_api_error e = {0};
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    if (srv_decode_session_path(&lim, id, srv_http_header(req, "X-Session-Id"), &e)) {
        srv_api_error_from(c, &e);
        return;
    }
    if (!a->m) {
        srv_api_error(c, 503, NULL, NULL, NULL, "the model is loading");
        return;
    }
    srv_call_session(a, c, id, kind, map);
}

static void route_session(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *id)
{
    session_call(a, c, req, id,
                 !strcmp(req->method, "DELETE") ? CALL_SESSION_DELETE : CALL_SESSION_GET, NULL);
}

/* GET /v1/sessions?limit=N&after=ID: a page of the sessions, in memory
 * and saved on disk (api_sessions.c). */
static void route_sessions(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                           const char *rest)
{
    (void)rest;
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    struct engine_list_opts list;
    char param[64], msg[256];
    int rc = srv_sessions_parse_query(req->query, lim.max_session_id, &list, param, sizeof(param),
                                      msg, sizeof(msg));
    if (rc != 0) {
        if (rc == -ENOMEM)
            srv_api_error(c, 503, NULL, NULL, NULL, "%s", msg);
        else
            srv_api_error(c, 400, param, NULL, NULL, "%s: %s", param, msg);
        return;
    }
    if (!a->m) {
        free(list.after);
        srv_api_error(c, 503, NULL, NULL, NULL, "the model is loading");
        return;
    }
    srv_call_sessions(a, c, &list);
}

static bool map_match(const char *path)
{
    char id[256];
    return srv_map_path(path, id, sizeof(id));
}

/* GET /v1/sessions/ID/map (route_map.c shapes the answer). */
static void route_session_map(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                              const char *rest)
{
    (void)rest;
    char id[256], param[64], msg[256];
    srv_map_path(req->path, id, sizeof(id));
    struct engine_map_opts map = {0};
    if (srv_map_parse_query(req->query, &map, param, sizeof(param), msg, sizeof(msg)) != 0) {
        srv_api_error(c, 400, param, NULL, NULL, "%s: %s", param, msg);
        return;
    }
    session_call(a, c, req, id, CALL_SESSION_MAP, &map);
}

static bool web_match(const char *path)
{
    return srv_web_find(path) != NULL;
}

/* The page's files (web.c answers their methods and ETags). */
static void route_web(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest)
{
    (void)a, (void)rest;
    srv_web_respond(c, req, srv_web_find(req->path));
}

/* GET /v1/config: the effective config with each key's origin, as `kvd
 * check-config` prints it (the daemon's program renders it at start and on
 * each reload; the API key's value never appears). */
static void route_config(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *rest)
{
    (void)req, (void)rest;
    if (!a->config_json) {
        srv_api_error(c, 404, NULL, NULL, NULL, "this server was started without a config to show");
        return;
    }
    srv_http_respond(c, 200, "application/json", "Cache-Control: no-store\r\n", a->config_json,
                     strlen(a->config_json));
}

static void route_tokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                           const char *rest)
{
    (void)rest;
    srv_route_tokenize(a, c, req);
}

static void route_detokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                             const char *rest)
{
    (void)rest;
    srv_route_detokenize(a, c, req);
}

static void route_apply_template(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                                 const char *rest)
{
    (void)rest;
    srv_route_apply_template(a, c, req);
}

/* Which kernels run (cpu/cpu.h, model_kernels_describe) and on which threads
 * (cpu/pool.h): "kernels" in /health and in /v1/models' meta. */
static json_t *kernels_json(void)
{
    char line[MODEL_KERNELS_LINE], threads[160];
    return json_pack("{s:s, s:s, s:b, s:s, s:s, s:s, s:s}", "level", cpu_level_name(cpu_level()),
                     "best", cpu_level_name(cpu_best()), "forced", cpu_forced(), "matmul",
                     mm_kernel_name(), "attention", attn_simd_name(), "threads",
                     cpu_pool_describe(threads, sizeof(threads)), "description",
                     model_kernels_describe(line, sizeof(line)));
}

static void route_models(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                         const char *rest)
{
    (void)req, (void)rest;
    json_t *data = json_array();
    if (a->m)
        json_array_append_new(
            data,
            json_pack("{s:s, s:s, s:I, s:s, s:{s:s, s:i, s:i, s:i, s:s, s:o}}", "id", a->model_name,
                      "object", "model", "created", (json_int_t)a->ready_time, "owned_by", "kvd",
                      "meta", "arch", a->info.arch, "n_vocab", a->info.n_vocab, "n_ctx_train",
                      a->info.n_ctx_train, "n_layer", a->info.n_layer, "positions",
                      pos_kind_name(a->info.pos), "kernels", kernels_json()));
    srv_respond_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* Whether the engine thread has been in one step longer than the
 * configured engine_stall_timeout (the reason in msg). */
static bool engine_stalled(srv_api *a, char *msg, size_t len)
{
    uint64_t busy = srv_sched_busy_ms(a->sched);
    if (!a->p.engine_stall_ms || busy <= a->p.engine_stall_ms)
        return false;
    snprintf(msg, len,
             "the engine has been in one step for %" PRIu64 " ms (engine_stall_timeout %" PRIu64
             " ms)",
             busy, a->p.engine_stall_ms);
    return true;
}

static void route_health(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                         const char *rest)
{
    (void)req, (void)rest;
    char msg[160];
    if (a->draining)
        srv_api_error(c, 503, NULL, "draining", NULL, "the server is shutting down");
    else if (!a->m)
        srv_api_error(c, 503, NULL, "loading", NULL, "the model is loading");
    else if (engine_stalled(a, msg, sizeof(msg)))
        srv_api_error(c, 503, NULL, "engine_stalled", NULL, "%s", msg);
    else
        srv_respond_json(c, 200, json_pack("{s:s, s:o}", "status", "ok", "kernels", kernels_json()));
}

/* The process's resident set in bytes (/proc/self/statm), or -1. */
static long long process_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    long long size = 0, resident = -1;
    if (fscanf(f, "%lld %lld", &size, &resident) != 2)
        resident = -1;
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return resident < 0 || page <= 0 ? -1 : resident * page;
}

/* The metrics, plus the standard process_resident_memory_bytes gauge
 * (what load tests read beside the KV pages used). */
static void route_metrics(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                          const char *rest)
{
    (void)req, (void)rest;
    size_t len = 0;
    char *text = srv_metrics_render(a->metrics, &len);
    long long rss = process_rss_bytes();
    char extra[256] = "";
    int n = rss < 0 ? 0
                    : snprintf(extra, sizeof(extra),
                               "# HELP process_resident_memory_bytes Resident memory size in "
                               "bytes.\n# TYPE process_resident_memory_bytes gauge\n"
                               "process_resident_memory_bytes %lld\n",
                               rss);
    char *all = text ? realloc(text, len + (size_t)n + 1) : NULL;
    if (!all) {
        free(text);
        srv_api_error(c, 500, NULL, NULL, NULL, "out of memory rendering metrics");
        return;
    }
    memcpy(all + len, extra, (size_t)n + 1);
    srv_http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", "", all, len + (size_t)n);
    free(all);
}

/* ------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------ */

static const struct route routes[] = {
    /* path, prefix, match, methods, auth, need, handler; the first row that matches */
    /* the page's files: no data in them, so no key (web.h) */
    {NULL, false, web_match, M_ANY, false, NEED_NOTHING, route_web},
    {"/v1/config", false, NULL, M_GET, true, NEED_NOTHING, route_config},
    {NULL, false, map_match, M_GET, true, NEED_NOTHING, route_session_map},
    {"/health", false, NULL, M_GET, false, NEED_NOTHING, route_health},
    {"/metrics", false, NULL, M_GET, false, NEED_NOTHING, route_metrics},
    {"/v1/completions", false, NULL, M_POST, true, NEED_SERVING, route_openai},
    {"/completions", false, NULL, M_POST, true, NEED_SERVING, route_openai},
    {"/completion", false, NULL, M_POST, true, NEED_SERVING, route_llama},
    {"/v1/chat/completions", false, NULL, M_POST, true, NEED_SERVING, route_chat},
    {"/chat/completions", false, NULL, M_POST, true, NEED_SERVING, route_chat},
    {"/apply-template", false, NULL, M_POST, true, NEED_SERVING, route_apply_template},
    {"/v1/models", false, NULL, M_GET, true, NEED_NOTHING, route_models},
    {"/models", false, NULL, M_GET, true, NEED_NOTHING, route_models},
    {"/tokenize", false, NULL, M_POST, true, NEED_MODEL, route_tokenize},
    {"/detokenize", false, NULL, M_POST, true, NEED_MODEL, route_detokenize},
    {"/v1/sessions", false, NULL, M_GET, true, NEED_NOTHING, route_sessions},
    {"/v1/sessions/", true, NULL, M_GET | M_DELETE, true, NEED_NOTHING, route_session},
};

/* The row for path (and *rest, what follows a prefix), or NULL. */
static const struct route *route_find(const char *path, const char **rest)
{
    for (size_t i = 0; i < sizeof(routes) / sizeof(routes[0]); i++) {
        const struct route *r = &routes[i];
        size_t n = r->path ? strlen(r->path) : 0;
        bool hit = r->match    ? r->match(path)
                   : r->prefix ? !strncmp(path, r->path, n) && path[n]
                               : !strcmp(path, r->path);
        if (hit) {
            *rest = path + (r->prefix ? n : strlen(path));
            return r;
        }
    }
    return NULL;
}

static unsigned method_bit(const char *m)
{
    if (!strcmp(m, "GET") || !strcmp(m, "HEAD"))
        return M_GET;
    if (!strcmp(m, "POST"))
        return M_POST;
    if (!strcmp(m, "DELETE"))
        return M_DELETE;
    return M_OTHER;
}

/* "GET, HEAD, DELETE": what methods allows, for Allow and the message. */
static void allow_list(unsigned methods, char *out, size_t len)
{
    snprintf(out, len, "%s%s%s%s%s", methods & M_GET ? "GET, HEAD" : "",
             methods & M_GET && methods & ~M_GET ? ", " : "", methods & M_POST ? "POST" : "",
             methods & M_POST && methods & M_DELETE ? ", " : "",
             methods & M_DELETE ? "DELETE" : "");
}

/* Constant-time comparison of the bearer token. */
static bool auth_ok(srv_api *a, const struct srv_http_req *req)
{
    if (!a->api_key[0])
        return true;
    const char *h = srv_http_header(req, "authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    const char *tok = h + 7;
    while (*tok == ' ')
        tok++;
    size_t n = strlen(tok), m = strlen(a->api_key);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < m; i++)
        diff |=
            (unsigned)(unsigned char)a->api_key[i] ^ (unsigned)(unsigned char)(i < n ? tok[i] : 0);
    return diff == 0;
}

/* Whether the route's readiness holds; answers 503 when it does not. */
static bool ready(srv_api *a, srv_conn *c, enum need need)
{
    if (need == NEED_SERVING && a->draining) {
        srv_api_error(c, 503, NULL, NULL, NULL, "the server is shutting down");
        return false;
    }
    if (need != NEED_NOTHING && !a->m) {
        srv_api_error(c, 503, NULL, "loading", "Retry-After: 1\r\n", "the model is loading");
        return false;
    }
    return true;
}

void srv_api_handle(void *ud, srv_conn *c, const struct srv_http_req *req)
{
    srv_api *a = ud;
    const char *rest = NULL;
    const struct route *r = route_find(req->path, &rest);
    if (!r) {
        srv_api_error(c, 404, NULL, NULL, NULL, "no route for %s %s", req->method, req->path);
        return;
    }
    if (!(method_bit(req->method) & r->methods)) {
        char allow[48], hdr[64];
        allow_list(r->methods, allow, sizeof(allow));
        snprintf(hdr, sizeof(hdr), "Allow: %s\r\n", allow);
        srv_api_error(c, 405, NULL, NULL, hdr, "%s is not allowed on %s; use %s", req->method,
                      req->path, allow);
        return;
    }
    if (r->auth && !auth_ok(a, req)) {
        srv_api_error(c, 401, NULL, NULL, "WWW-Authenticate: Bearer\r\n",
                      "a valid API key is required: send 'Authorization: Bearer KEY'");
        return;
    }
    if (ready(a, c, r->need))
        r->handle(a, c, req, rest);
}
