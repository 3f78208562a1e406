/*
 * route_map.h - GET /v1/sessions/{id}/map (route_map.c): the query it
 * takes and the JSON it answers, on the loop thread. The map itself is
 * built on the engine thread (cache_map.h).
 */
#ifndef KVD_SERVER_ROUTE_MAP_H
#define KVD_SERVER_ROUTE_MAP_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "engine/cache_map.h"
#include "server/http.h"
#include "server/scheduler.h"

/*
 * If path is "/v1/sessions/ID/map", copy ID (at most idlen - 1 bytes; a
 * longer one is copied cut, and fails the id check after) and return true.
 */
bool srv_map_path(const char *path, char *id, size_t idlen);

/*
 * The query of a map request: "ranges=N" (ENGINE_MAP_MIN_RANGES ..
 * ENGINE_MAP_MAX_RANGES, default ENGINE_MAP_DEFAULT_RANGES) and "text=0|1"
 * (default 1), joined by '&'. Returns 0, or -EINVAL with the parameter's
 * name in param and the reason in msg (an unknown parameter is refused).
 */
int srv_map_parse_query(const char *query, struct engine_map_opts *out, char *param, size_t plen,
                        char *msg, size_t mlen);

/* The most bytes srv_map_json can dump to for this map (compact, with
 * every control character of the text escaped as \u00XX). */
size_t srv_map_json_bound(const struct engine_cache_map *map);

/* The map as the route answers it (new reference; NULL when memory runs
 * out). info is the session's description from the same engine step. */
json_t *srv_map_json(const struct engine_cache_map *map, const struct engine_session_info *info,
                     const char *id);

/*
 * Answer a map request from its final event: 404 when the session does
 * not exist, 503 when the engine could not build the map, 500 when the
 * bound exceeds ENGINE_MAP_MAX_BYTES (checked before rendering), else 200.
 */
void srv_map_respond(srv_conn *c, const struct engine_event *ev, const char *id);

#endif /* KVD_SERVER_ROUTE_MAP_H */
