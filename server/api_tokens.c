/*
 * api_tokens.c - llama.cpp's token routes, which let a client build
 * prompts of an exact length (kvd load does), and the streaming decode
 * every answer's text goes through:
 *   POST /tokenize    {"content", "add_special", "with_pieces"} -> {"tokens"}
 *   POST /detokenize  {"tokens"} -> {"content"}
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"

int srv_detok_step(model_detok *d, const int32_t *id, char **buf, size_t *cap, size_t len)
{
    for (;;) {
        char *out = *buf ? *buf + len : NULL;
        size_t room = *buf ? *cap - len : 0;
        int w = id ? model_detok_push(d, *id, out, room) : model_detok_flush(d, out, room);
        if (w != -ENOSPC)
            return w < 0 ? -1 : w;
        size_t ncap = *cap ? *cap * 2 : 256;
        char *nb = realloc(*buf, ncap);
        if (!nb)
            return -1;
        *buf = nb;
        *cap = ncap;
    }
}

/*
 * The text of ids[0..n) as a completion streams it, into *buf as in
 * srv_detok_step. Returns the byte count, or -1 when memory runs out.
 */
static int decode(const model *m, const int32_t *ids, int n, char **buf, size_t *cap)
{
    model_detok *d = model_detok_create(m);
    if (!d)
        return -1;
    size_t len = 0;
    int w = 0;
    for (int i = 0; i <= n && w >= 0; i++) {
        w = srv_detok_step(d, i < n ? &ids[i] : NULL, buf, cap, len);
        if (w >= 0)
            len += (size_t)w;
    }
    model_detok_destroy(d);
    return w < 0 || len > INT32_MAX ? -1 : (int)len;
}

/* [{"id", "piece"}, ...] for ids (new), or NULL when memory runs out. */
static json_t *pieces_json(const model *m, const int32_t *ids, int n)
{
    json_t *arr = json_array();
    model_detok *d = model_detok_create(m);
    char *piece = NULL;
    size_t cap = 0;
    for (int i = 0; i < n && arr && d; i++) {
        /* the last piece also takes what the stream still holds */
        int w = srv_detok_step(d, &ids[i], &piece, &cap, 0);
        int h = w >= 0 && i == n - 1 ? srv_detok_step(d, NULL, &piece, &cap, (size_t)w) : 0;
        if (w < 0 || h < 0) {
            json_decref(arr);
            arr = NULL;
            break;
        }
        json_array_append_new(arr, json_pack("{s:i, s:o}", "id", ids[i], "piece",
                                             srv_json_text(piece, (size_t)(w + h))));
    }
    if (!d) {
        json_decref(arr);
        arr = NULL;
    }
    model_detok_destroy(d);
    free(piece);
    return arr;
}

/* A token route's job: the request in, a JSON body (or an error) out. */
struct tok_job {
    struct srv_api_job job;
    const model *m;
    struct srv_tokenize_req tok;     /* /tokenize */
    struct srv_detokenize_req detok; /* /detokenize */
    char *body;                      /* out: the answer (new), or NULL */
    struct srv_api_error e;          /* out: when body is NULL */
};

/* Answer body, or e, then free the job. */
static void tok_done(struct srv_api_job *j)
{
    struct tok_job *t = (struct tok_job *)j;
    if (j->conn && t->body)
        srv_http_respond(j->conn, 200, "application/json", "", t->body, strlen(t->body));
    else if (j->conn)
        srv_api_error_from(j->conn, &t->e);
    srv_tokenize_req_clear(&t->tok);
    srv_detokenize_req_clear(&t->detok);
    free(t->body);
    free(t);
}

/* v (stolen) dumped into t->body; a 500 naming `what` when memory runs out. */
static void tok_body(struct tok_job *t, json_t *v, const char *what)
{
    t->body = v ? json_dumps(v, SRV_JSON_FLAGS) : NULL;
    json_decref(v);
    if (!t->body) {
        t->e.status = 500;
        snprintf(t->e.msg, sizeof(t->e.msg), "out of memory %s", what);
    }
}

/* On a worker: the ids, or with pieces the ids and their texts. */
static void tokenize_run(struct srv_api_job *j)
{
    struct tok_job *t = (struct tok_job *)j;
    int32_t *ids = NULL;
    int n = 0, cap = 0;
    if (srv_tokenize_append(t->m, t->tok.text, t->tok.len, t->tok.add_special, false, INT_MAX - 1,
                            &ids, &n, &cap, "content", &t->e)) {
        free(ids);
        return;
    }
    json_t *arr = json_array();
    if (t->tok.with_pieces) {
        json_decref(arr);
        arr = pieces_json(t->m, ids, n);
    } else {
        for (int i = 0; i < n && arr; i++)
            json_array_append_new(arr, json_integer(ids[i]));
    }
    free(ids);
    tok_body(t, arr ? json_pack("{s:o}", "tokens", arr) : NULL, "decoding the pieces");
}

/* On a worker: the text of the ids. */
static void detokenize_run(struct srv_api_job *j)
{
    struct tok_job *t = (struct tok_job *)j;
    char *text = NULL;
    size_t cap = 0;
    int n = decode(t->m, t->detok.ids, t->detok.n, &text, &cap);
    json_t *v = n < 0 ? NULL
                      : json_pack("{s:o}", "content", srv_json_text(text ? text : "", (size_t)n));
    free(text);
    tok_body(t, v, "decoding the tokens");
}

/* Decode a token route's request and queue its job (or answer why not). */
static void tok_route(srv_api *a, srv_conn *c, const struct srv_http_req *req, bool detok)
{
    struct srv_api_error e = {0};
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    json_t *body = srv_decode_body(req->body, req->body_len, &e);
    struct tok_job *t = body ? calloc(1, sizeof(*t)) : NULL;
    if (body && !t)
        srv_oom(&e, "accepting the request");
    else if (t && detok)
        srv_decode_detokenize(&lim, body, &t->detok, &e);
    else if (t)
        srv_decode_tokenize(&lim, body, &t->tok, &e);
    json_decref(body);
    if (e.status) {
        free(t);
        srv_api_error_from(c, &e);
        return;
    }
    t->m = a->m;
    t->job.run = detok ? detokenize_run : tokenize_run;
    t->job.done = tok_done;
    srv_api_job_start(a, c, &t->job);
}

/*
 * POST /tokenize: {"content": text, "add_special": bool (BOS when the
 * model wants one; default false), "with_pieces": bool} -> {"tokens":
 * [id, ...]} or, with pieces, [{"id", "piece"}, ...]. A piece is the text
 * its token adds when the tokens are decoded in order, so the pieces
 * concatenated are exactly what /detokenize returns; a byte token that
 * starts a character has "" and the token completing it the character.
 */
void srv_route_tokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    tok_route(a, c, req, false);
}

/* POST /detokenize: {"tokens": [id, ...]} -> {"content": text}. */
void srv_route_detokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    tok_route(a, c, req, true);
}
