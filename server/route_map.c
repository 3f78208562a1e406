/*
 * route_map.c - GET /v1/sessions/{id}/map: a session's cache as ranges of
 * its history, for the web page's cache map (loop thread).
 *
 *   GET /v1/sessions/ID/map?ranges=N&text=0|1
 *
 * The request crosses to the engine like GET /v1/sessions/ID (the engine
 * owns the sequences) and comes back with a struct engine_cache_map, built
 * there from the cache's own arrays (cache_map.c). This file reads the
 * query, and turns the map into the answer:
 *
 *   {"object": "session.map", "id", "tokens", "retained_tokens",
 *    "evicted_tokens", "positions", "next_position", "busy", "dropped",
 *    "eviction": {policy, max_cache_tokens, sink_tokens, window_tokens,
 *                 heavy_tokens},
 *    "sinks", "window",                    retained tokens in each part now
 *    "pages": {"count", "page_tokens", "ids"},
 *    "runs", "coalesced",
 *    "ranges": [{"start", "end", "kind", "retained", "positions": [first,
 *                last] | null, "cache": [first, last] | null, "pages":
 *                [first, last] | null, "text": string | null,
 *                "text_elided"}, ...]}
 *
 * Ranges cover the history [0, tokens) in order: start and end are the
 * tokens' original places, positions the numbers the retained ones carry
 * now, cache their logical indices in the cache and pages the logical
 * pages those fall in. The size is bounded before anything is rendered
 * (srv_map_json_bound against ENGINE_MAP_MAX_BYTES).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/errors.h"
#include "server/log.h"
#include "server/query.h"
#include "server/route_map.h"

#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

/* Bytes of one range's JSON besides its text: keys, eleven integers of at
 * most 11 characters, a kind, two booleans. */
#define RANGE_JSON_BYTES 320
/* The object's fields besides the ranges, the page ids and the id. */
#define HEAD_JSON_BYTES 1024

bool srv_map_path(const char *path, char *id, size_t idlen)
{
    static const char pre[] = "/v1/sessions/", suf[] = "/map";
    size_t n = strlen(path), np = sizeof(pre) - 1, ns = sizeof(suf) - 1;
    if (n <= np + ns || strncmp(path, pre, np) != 0 || strcmp(path + n - ns, suf) != 0)
        return false;
    size_t len = n - np - ns;
    if (len >= idlen)
        len = idlen - 1;
    memcpy(id, path + np, len);
    id[len] = '\0';
    return true;
}

/* One "name=value" of the query (srv_query_fn); ctx: the options. */
static int query_param(void *ctx, const char *name, size_t nlen, const char *val, size_t vlen,
                       char *msg, size_t mlen)
{
    struct engine_map_opts *o = ctx;
    if (srv_query_is(name, nlen, "ranges")) {
        long n;
        if (srv_query_int(val, vlen, ENGINE_MAP_MIN_RANGES, ENGINE_MAP_MAX_RANGES, &n) != 0) {
            snprintf(msg, mlen, "ranges must be an integer in [%d, %d], not '%.*s'",
                     ENGINE_MAP_MIN_RANGES, ENGINE_MAP_MAX_RANGES, (int)(vlen < 32 ? vlen : 32),
                     val);
            return -EINVAL;
        }
        o->max_ranges = (int)n;
        return 0;
    }
    if (srv_query_is(name, nlen, "text")) {
        if (vlen != 1 || (val[0] != '0' && val[0] != '1')) {
            snprintf(msg, mlen, "text must be 0 or 1, not '%.*s'", (int)(vlen < 32 ? vlen : 32),
                     val);
            return -EINVAL;
        }
        o->text = val[0] == '1';
        return 0;
    }
    snprintf(msg, mlen, "unknown parameter; the map takes ranges=N and text=0|1");
    return -EINVAL;
}

int srv_map_parse_query(const char *query, struct engine_map_opts *out, char *param, size_t plen,
                        char *msg, size_t mlen)
{
    out->max_ranges = ENGINE_MAP_DEFAULT_RANGES;
    out->text = true;
    return srv_query_each(query, query_param, out, param, plen, msg, mlen);
}

size_t srv_map_json_bound(const struct engine_cache_map *map)
{
    return HEAD_JSON_BYTES + 6 * 256 /* the id, escaped */ +
           (size_t)map->n_ranges * RANGE_JSON_BYTES + 6 * map->text_bytes +
           (size_t)map->n_page_ids * 12;
}

static json_t *pair_or_null(int32_t a, int32_t b)
{
    return a < 0 ? json_null() : json_pack("[i, i]", a, b);
}

/* A range's text as a JSON string: a NUL byte (a byte token's text)
 * becomes U+FFFD, as in the completion routes, since many JSON readers
 * refuse \u0000; NULL when it is not valid UTF-8. */
static json_t *text_json(const char *s, size_t n)
{
    if (!memchr(s, '\0', n))
        return json_stringn(s, n);
    char *fixed = malloc(n * 3 + 1);
    if (!fixed)
        return NULL;
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i]) {
            fixed[o++] = s[i];
        } else {
            memcpy(fixed + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
    }
    json_t *v = json_stringn(fixed, o);
    free(fixed);
    return v;
}

static json_t *range_json(const struct engine_cache_map *map, const struct engine_map_range *r)
{
    json_t *text = r->text ? text_json(r->text, r->text_len) : NULL;
    int pt = map->page_tokens > 0 ? map->page_tokens : 1;
    return json_pack("{s:i, s:i, s:s, s:i, s:o, s:o, s:o, s:o, s:b}", "start", r->start, "end",
                     r->end, "kind", engine_map_kind_name(r->kind), "retained", r->retained,
                     "positions", pair_or_null(r->pos_first, r->pos_last), "cache",
                     pair_or_null(r->first, r->last), "pages",
                     pair_or_null(r->first < 0 ? -1 : r->first / pt, r->last / pt), "text",
                     text ? text : json_null(), "text_elided", r->text_elided);
}

json_t *srv_map_json(const struct engine_cache_map *map, const struct engine_session_info *info,
                     const char *id)
{
    json_t *ranges = json_array();
    for (int k = 0; ranges && k < map->n_ranges; k++)
        if (json_array_append_new(ranges, range_json(map, &map->ranges[k])) != 0) {
            json_decref(ranges);
            ranges = NULL;
        }
    json_t *ids = json_null();
    if (map->n_page_ids > 0) {
        ids = json_array();
        for (int k = 0; ids && k < map->n_page_ids; k++)
            json_array_append_new(ids, json_integer(map->page_ids[k]));
    }
    if (!ranges || !ids) {
        json_decref(ranges);
        json_decref(ids);
        return NULL;
    }
    const struct kv_policy *p = &map->policy;
    int evicted = map->history_tokens - map->retained_tokens;
    return json_pack(
        "{s:s, s:s, s:i, s:i, s:i, s:s, s:i, s:b, s:b, s:{s:s, s:i, s:i, s:i, s:i}, s:i, s:i, "
        "s:{s:i, s:i, s:o}, s:i, s:b, s:o}",
        "object", "session.map", "id", id, "tokens", map->history_tokens, "retained_tokens",
        map->retained_tokens, "evicted_tokens", evicted > 0 ? evicted : 0, "positions",
        p->renumber ? "renumber" : "preserve", "next_position", map->next_pos, "busy", info->busy,
        "dropped", map->dropped, "eviction", "policy", kv_policy_kind_name(p->kind),
        "max_cache_tokens", p->max_cache_tokens, "sink_tokens", p->sink_tokens, "window_tokens",
        p->window_tokens, "heavy_tokens", p->heavy_tokens, "sinks", map->sink_tokens, "window",
        map->window_tokens, "pages", "count", map->n_pages, "page_tokens", map->page_tokens, "ids",
        ids, "runs", map->n_runs, "coalesced", map->coalesced, "ranges", ranges);
}

static void respond_error(srv_conn *c, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void respond_error(srv_conn *c, int status, const char *param, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *body = srv_error_json(status, msg, param, NULL, &len);
    srv_log(status >= 500 ? SRV_LOG_WARN : SRV_LOG_DEBUG, "api: %d %s", status, msg);
    srv_http_respond(c, status, "application/json", "", body ? body : "", body ? len : 0);
    free(body);
}

void srv_map_respond(srv_conn *c, const struct engine_event *ev, const char *id)
{
    if (!ev->session.found) {
        respond_error(c, 404, "session", "no session '%s'", id);
        return;
    }
    if (!ev->map) {
        respond_error(c, 503, NULL, "out of memory building the map; retry later");
        return;
    }
    size_t bound = srv_map_json_bound(ev->map);
    if (bound > ENGINE_MAP_MAX_BYTES) {
        respond_error(c, 500, NULL, "the map of '%s' could reach %zu bytes, over the %u limit", id,
                      bound, ENGINE_MAP_MAX_BYTES);
        return;
    }
    json_t *v = srv_map_json(ev->map, &ev->session, id);
    char *s = v ? json_dumps(v, JSON_FLAGS) : NULL;
    json_decref(v);
    if (!s) {
        respond_error(c, 503, NULL, "out of memory rendering the map; retry later");
        return;
    }
    srv_http_respond(c, 200, "application/json", "Cache-Control: no-store\r\n", s, strlen(s));
    free(s);
}
