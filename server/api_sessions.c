/*
 * api_sessions.c - GET /v1/sessions: the engine's list of sessions as
 * JSON, those in memory and those saved to [sessions] dir alike.
 *
 *   {"object": "list", "data": [{"id", "object": "session", "state":
 *    "memory" | "saved", "busy", "tokens", "retained_tokens", "last_used",
 *    "bytes"}, ...]}
 *
 * "bytes" is the KV memory a session holds in memory, or its file's size
 * when saved. The engine builds the list on its thread (the store reads
 * the directory's headers the first time); this file only shapes it, on
 * the loop thread.
 */
#include "server/api_internal.h"

void srv_sessions_respond(srv_conn *conn, const struct engine_event *ev)
{
    const struct engine_session_list *l = ev->list;
    json_t *data = l ? json_array() : NULL;
    for (int i = 0; data && l && i < l->n; i++) {
        const struct engine_session_item *it = &l->items[i];
        json_t *o = json_pack(
            "{s:s, s:s, s:s, s:b, s:i, s:i, s:f, s:I}", "id", it->id, "object", "session", "state",
            it->saved ? "saved" : "memory", "busy", it->busy, "tokens", it->history_tokens,
            "retained_tokens", it->retained_tokens, "last_used", (double)it->last_used_ms / 1000.0,
            "bytes", (json_int_t)it->bytes);
        if (!o || json_array_append_new(data, o) != 0) {
            json_decref(data);
            data = NULL;
        }
    }
    json_t *v = data ? json_pack("{s:s, s:o}", "object", "list", "data", data) : NULL;
    if (!v) {
        srv_api_error(conn, 500, NULL, NULL, NULL, "out of memory listing the sessions");
        return;
    }
    srv_respond_json(conn, 200, v);
}
