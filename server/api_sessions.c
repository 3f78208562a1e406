/*
 * api_sessions.c - GET /v1/sessions: one page of the engine's sessions as
 * JSON, those in memory and those saved to [sessions] dir alike, in the
 * shape of the OpenAI list APIs.
 *
 *   GET /v1/sessions?limit=N&after=ID
 *
 *   {"object": "list", "data": [{"id", "object": "session", "state":
 *    "memory" | "saved", "busy", "tokens", "retained_tokens", "last_used",
 *    "bytes"}, ...], "first_id", "last_id", "has_more"}
 *
 * Sessions come in id order (bytewise); a page holds the first `limit`
 * (1..ENGINE_LIST_MAX, default ENGINE_LIST_DEFAULT) after `after` (a
 * session id, percent-decoded; absent: from the first), and has_more says
 * whether another page follows, which `after=<last_id>` asks for. first_id
 * and last_id are null on an empty page. "bytes" is the KV memory a session
 * holds in memory, or its file's size when saved. The engine builds only
 * the page on its thread (the store reads the directory's headers the first
 * time); this file reads the query and shapes the page, on the loop thread.
 */
#include <errno.h>

#include "server/api_internal.h"
#include "server/query.h"

/* What the query asks for, as it is read. */
struct list_query {
    int max_id;  /* longest session id accepted */
    long limit;  /* 0: not given */
    char *after; /* [max_id + 1], "" when not given */
};

/* One "name=value" of the query (srv_query_fn). */
static int list_param(void *ctx, const char *name, size_t nlen, const char *val, size_t vlen,
                      char *msg, size_t mlen)
{
    struct list_query *q = ctx;
    int cut = (int)(vlen < 64 ? vlen : 64);
    if (srv_query_is(name, nlen, "limit")) {
        if (srv_query_int(val, vlen, 1, ENGINE_LIST_MAX, &q->limit) != 0) {
            snprintf(msg, mlen, "limit must be an integer in [1, %d], not '%.*s'", ENGINE_LIST_MAX,
                     cut, val);
            return -EINVAL;
        }
        return 0;
    }
    if (srv_query_is(name, nlen, "after")) {
        if (srv_query_text(val, vlen, q->after, (size_t)q->max_id + 1) < 0 ||
            !srv_session_id_ok(q->after, (size_t)q->max_id)) {
            snprintf(msg, mlen,
                     "after must be a session id (1..%d characters of A-Z a-z 0-9 . _ : -), "
                     "not '%.*s'",
                     q->max_id, cut, val);
            return -EINVAL;
        }
        return 0;
    }
    snprintf(msg, mlen, "unknown parameter; the list takes limit=N and after=ID");
    return -EINVAL;
}

int srv_sessions_parse_query(const char *query, int max_session_id, struct engine_list_opts *out,
                             char *param, size_t plen, char *msg, size_t mlen)
{
    *out = (struct engine_list_opts){.limit = ENGINE_LIST_DEFAULT};
    struct list_query q = {.max_id = max_session_id,
                           .after = calloc(1, (size_t)max_session_id + 1)};
    if (!q.after) {
        snprintf(param, plen, "after");
        snprintf(msg, mlen, "out of memory reading the query");
        return -ENOMEM;
    }
    int rc = srv_query_each(query, list_param, &q, param, plen, msg, mlen);
    if (rc != 0 || !q.after[0]) {
        free(q.after);
        q.after = NULL;
    }
    if (rc == 0) {
        out->limit = q.limit ? (int)q.limit : ENGINE_LIST_DEFAULT;
        out->after = q.after;
    }
    return rc;
}

/* One session of the page (new reference; NULL when out of memory). */
static json_t *item_json(const struct engine_session_item *it)
{
    return json_pack("{s:s, s:s, s:s, s:b, s:i, s:i, s:f, s:I}", "id", it->id, "object", "session",
                     "state", it->saved ? "saved" : "memory", "busy", it->busy, "tokens",
                     it->history_tokens, "retained_tokens", it->retained_tokens, "last_used",
                     (double)it->last_used_ms / 1000.0, "bytes", (json_int_t)it->bytes);
}

static json_t *id_or_null(const struct engine_session_list *l, int i)
{
    return l->n > 0 ? json_string(l->items[i].id) : json_null();
}

void srv_sessions_respond(srv_conn *conn, const struct engine_event *ev)
{
    const struct engine_session_list *l = ev->list;
    json_t *data = l ? json_array() : NULL;
    for (int i = 0; data && l && i < l->n; i++) {
        json_t *o = item_json(&l->items[i]);
        if (!o || json_array_append_new(data, o) != 0) {
            json_decref(data);
            data = NULL;
        }
    }
    json_t *v = data ? json_pack("{s:s, s:o, s:o*, s:o*, s:b}", "object", "list", "data", data,
                                 "first_id", id_or_null(l, 0), "last_id", id_or_null(l, l->n - 1),
                                 "has_more", l->has_more)
                     : NULL;
    if (!v) {
        srv_api_error(conn, 500, NULL, NULL, NULL, "out of memory listing the sessions");
        return;
    }
    srv_respond_json(conn, 200, v);
}
