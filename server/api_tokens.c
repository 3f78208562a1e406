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
    struct srv_api_error e = {0};
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    json_t *body = srv_decode_body(req->body, req->body_len, &e);
    struct srv_tokenize_req t;
    if (!body || srv_decode_tokenize(&lim, body, &t, &e)) {
        json_decref(body);
        srv_api_error_from(c, &e);
        return;
    }
    json_decref(body);
    int32_t *ids = NULL;
    int n = 0, cap = 0;
    int rc = srv_tokenize_append(a->m, t.text, t.len, t.add_special, false, INT_MAX - 1, &ids, &n,
                                 &cap, "content", &e);
    bool with_pieces = t.with_pieces;
    srv_tokenize_req_clear(&t);
    if (rc) {
        free(ids);
        srv_api_error_from(c, &e);
        return;
    }
    json_t *arr = json_array();
    if (with_pieces) {
        json_decref(arr);
        arr = pieces_json(a->m, ids, n);
    } else {
        for (int i = 0; i < n && arr; i++)
            json_array_append_new(arr, json_integer(ids[i]));
    }
    free(ids);
    if (!arr) {
        srv_api_error(c, 500, NULL, NULL, NULL, "out of memory decoding the pieces");
        return;
    }
    srv_respond_json(c, 200, json_pack("{s:o}", "tokens", arr));
}

/* POST /detokenize: {"tokens": [id, ...]} -> {"content": text}. */
void srv_route_detokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    struct srv_api_error e = {0};
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    json_t *body = srv_decode_body(req->body, req->body_len, &e);
    struct srv_detokenize_req t = {0};
    if (!body || srv_decode_detokenize(&lim, body, &t, &e)) {
        json_decref(body);
        srv_api_error_from(c, &e);
        return;
    }
    json_decref(body);
    char *text = NULL;
    size_t cap = 0;
    int n = decode(a->m, t.ids, t.n, &text, &cap);
    srv_detokenize_req_clear(&t);
    if (n < 0) {
        free(text);
        srv_api_error(c, 500, NULL, NULL, NULL, "out of memory decoding the tokens");
        return;
    }
    srv_respond_json(c, 200,
                     json_pack("{s:o}", "content", srv_json_text(text ? text : "", (size_t)n)));
    free(text);
}
