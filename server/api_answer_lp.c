/*
 * api_answer_lp.c - log-probabilities as each API shapes them (OpenAI
 * logprobs, chat logprobs.content, llama.cpp n_probs).
 *
 * The engine sends, with each sampled token, its log-probability, the most
 * likely tokens with theirs, and the text the token added. The sampled
 * token is named by that text (so the names join to the completion's
 * text); an alternative by the text it stands for on its own, decoded here
 * with one detokenizer kept for the purpose (a byte token that only starts
 * a character shows U+FFFD). OpenAI's return_tokens_as_token_ids names
 * every token "token_id:ID" instead.
 *
 * A non-streamed answer holds every token's numbers until it ends (up to
 * ENGINE_MAX_LOGPROB_ENTRIES entries). They are kept as JSON text, each
 * token's entry serialised when its event arrives, never as one JSON tree
 * (a jansson object costs a hundred-odd bytes per number, and serialising
 * a quarter-million-entry tree at the end held the loop thread for
 * seconds). The answer's own small tree carries a marker where the
 * log-probabilities go, and srv_lp_respond splices the text in.
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"

/* A log-probability as JSON: null if it is not finite (a -inf logit). */
static json_t *json_logprob(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

/* The text token id stands for on its own (new JSON string). */
static json_t *alt_piece(srv_api *a, int32_t id)
{
    if (!a->piece_detok && !(a->piece_detok = model_detok_create(a->m)))
        return json_string("");
    int n = srv_detok_step(a->piece_detok, &id, &a->piece_buf, &a->piece_cap, 0);
    int m = n >= 0 ? srv_detok_step(a->piece_detok, NULL, &a->piece_buf, &a->piece_cap, (size_t)n) : -1;
    if (n < 0 || m < 0) { /* out of memory: start a clean stream next time */
        model_detok_destroy(a->piece_detok);
        a->piece_detok = NULL;
        return json_string("");
    }
    return srv_json_text(a->piece_buf ? a->piece_buf : "", (size_t)(n + m));
}

/* How a token is named: piece (the sampled token's text) or, when NULL,
 * the token's own text; "token_id:ID" with return_tokens_as_token_ids. */
static json_t *token_name(struct call *call, int32_t id, const char *piece, size_t n)
{
    if (call->id_tokens) {
        char b[32];
        snprintf(b, sizeof(b), "token_id:%d", (int)id);
        return json_string(b);
    }
    return piece ? srv_json_text(piece, n) : alt_piece(call->a, id);
}

static size_t utf8_chars(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* The four values one token adds to an OpenAI logprobs object (new):
 * tokens, token_logprobs, top_logprobs, text_offset. top_logprobs maps
 * names to log-probabilities; when two alternatives share a name, the more
 * likely one keeps it, and a U+0000 in a name is written U+FFFD there
 * (many JSON parsers refuse it in a key). text_offset counts code points
 * of the completion. */
static void openai_parts(struct call *call, struct call_choice *ch, const struct engine_logprob *lp,
                         json_t *out[4])
{
    out[0] = token_name(call, lp->token, lp->piece, lp->piece_len);
    out[1] = json_logprob(lp->logprob);
    json_t *top = json_object();
    for (int i = 0; top && i < lp->n_top; i++) {
        json_t *k = token_name(call, lp->top_ids[i], NULL, 0);
        const char *key = json_string_value(k);
        size_t kl = json_string_length(k);
        if (key && memchr(key, 0, kl)) {
            char *t = malloc(kl * 3 + 1);
            size_t o = 0;
            for (size_t j = 0; t && j < kl; j++) {
                if (key[j]) {
                    t[o++] = key[j];
                } else {
                    memcpy(t + o, "\xEF\xBF\xBD", 3);
                    o += 3;
                }
            }
            json_decref(k);
            k = t ? json_stringn(t, o) : NULL;
            free(t);
            key = json_string_value(k);
            kl = json_string_length(k);
        }
        if (key && !json_object_getn(top, key, kl))
            json_object_setn_new(top, key, kl, json_logprob(lp->top_logprobs[i]));
        json_decref(k);
    }
    out[2] = top;
    out[3] = json_integer((json_int_t)ch->lp_chars);
    ch->lp_chars += utf8_chars(lp->piece, lp->piece_len);
}

/* llama.cpp's completion_probabilities entry for one token (new). */
static json_t *llama_entry(struct call *call, const struct engine_logprob *lp)
{
    json_t *top = json_array();
    for (int i = 0; i < lp->n_top; i++)
        json_array_append_new(top, json_pack("{s:i, s:o, s:o}", "id", (int)lp->top_ids[i], "token",
                                             token_name(call, lp->top_ids[i], NULL, 0), "logprob",
                                             json_logprob(lp->top_logprobs[i])));
    return json_pack("{s:i, s:o, s:o, s:o}", "id", (int)lp->token, "token",
                     token_name(call, lp->token, lp->piece, lp->piece_len), "logprob",
                     json_logprob(lp->logprob), "top_logprobs", top);
}


/* The UTF-8 bytes of a token name, as OpenAI's chat logprobs list them. */
static json_t *name_bytes(const json_t *name)
{
    json_t *b = json_array();
    const unsigned char *p = (const unsigned char *)json_string_value(name);
    for (size_t i = 0; p && i < json_string_length(name); i++)
        json_array_append_new(b, json_integer(p[i]));
    return b;
}

/* One entry of a chat completion's logprobs.content (new): the sampled
 * token and the top_logprobs alternatives, each with token, logprob and
 * bytes. */
static json_t *chat_entry(struct call *call, const struct engine_logprob *lp)
{
    json_t *top = json_array();
    for (int i = 0; i < lp->n_top; i++) {
        json_t *k = token_name(call, lp->top_ids[i], NULL, 0);
        json_array_append_new(top, json_pack("{s:O, s:o, s:o}", "token", k, "logprob",
                                             json_logprob(lp->top_logprobs[i]), "bytes",
                                             name_bytes(k)));
        json_decref(k);
    }
    json_t *k = token_name(call, lp->token, lp->piece, lp->piece_len);
    json_t *v = json_pack("{s:O, s:o, s:o, s:o}", "token", k, "logprob", json_logprob(lp->logprob),
                          "bytes", name_bytes(k), "top_logprobs", top);
    json_decref(k);
    return v;
}

json_t *srv_lp_stream_json(struct call *call, struct call_choice *ch,
                           const struct engine_logprob *lp)
{
    if (call->kind == CALL_CHAT)
        return json_pack("{s:[o]}", "content", chat_entry(call, lp));
    if (call->kind == CALL_LLAMA)
        return json_pack("[o]", llama_entry(call, lp));
    json_t *v[4];
    openai_parts(call, ch, lp, v);
    return json_pack("{s:[o], s:[o], s:[o], s:[o]}", "tokens", v[0], "token_logprobs", v[1],
                     "top_logprobs", v[2], "text_offset", v[3]);
}

/* ------------------------------------------------------------------------
 * A non-streamed answer's log-probabilities, as JSON text
 * ------------------------------------------------------------------------ */

/* A JSON array's elements as text, comma-separated, without the brackets. */
struct lp_list {
    char *s;
    size_t len, cap;
};

/* OpenAI: the four lists of its logprobs object; the others: list[0]. */
struct srv_lp_buf {
    struct lp_list list[4];
};

static int list_grow(struct lp_list *l, size_t more)
{
    if (l->len + more <= l->cap)
        return 0;
    size_t cap = l->cap ? l->cap : 4096;
    while (cap < l->len + more)
        cap *= 2;
    char *p = realloc(l->s, cap);
    if (!p)
        return -1;
    l->s = p;
    l->cap = cap;
    return 0;
}

/* Append v (stolen) to the list as text. 0, or -1 when memory runs out. */
static int list_add(struct lp_list *l, json_t *v)
{
    char *t = v ? json_dumps(v, SRV_JSON_FLAGS | JSON_ENCODE_ANY) : NULL;
    json_decref(v);
    size_t n = t ? strlen(t) : 0;
    if (!t || list_grow(l, n + 1)) {
        free(t);
        return -1;
    }
    if (l->len)
        l->s[l->len++] = ',';
    memcpy(l->s + l->len, t, n);
    l->len += n;
    free(t);
    return 0;
}

int srv_lp_buf_add(struct call *call, struct call_choice *ch, const struct engine_logprob *lp)
{
    if (!ch->lp && !(ch->lp = calloc(1, sizeof(*ch->lp))))
        return -1;
    struct lp_list *l = ch->lp->list;
    if (call->kind == CALL_CHAT)
        return list_add(&l[0], chat_entry(call, lp));
    if (call->kind == CALL_LLAMA)
        return list_add(&l[0], llama_entry(call, lp));
    json_t *v[4];
    openai_parts(call, ch, lp, v);
    int rc = 0;
    for (int i = 0; i < 4; i++)
        rc |= list_add(&l[i], v[i]);
    return rc ? -1 : 0;
}

void srv_lp_buf_free(struct srv_lp_buf *b)
{
    for (int i = 0; b && i < 4; i++)
        free(b->list[i].s);
    free(b);
}

/* Where choice i's log-probabilities go in an answer's tree: a string no
 * text can produce next to a key (a quote inside a JSON string is escaped,
 * so `":"` followed by this never occurs within one). */
#define LP_MARKER "\x01kvd-logprobs-%d\x01"
#define LP_MARKER_DUMPED "\":\"\\u0001kvd-logprobs-%d\\u0001\""

json_t *srv_lp_marker(int i)
{
    char b[64];
    snprintf(b, sizeof(b), LP_MARKER, i);
    return json_string(b);
}

/* The text that stands for choice ch's log-probabilities: up to 9 pieces
 * into piece/plen. Returns their count. */
static int lp_pieces(const struct call *call, const struct call_choice *ch, const char *piece[9],
                     size_t plen[9])
{
    static const struct lp_list none[4];
    const struct lp_list *l = ch->lp ? ch->lp->list : none;
    int n = 0;
#define PIECE(s, len) (piece[n] = (s), plen[n++] = (len))
    if (call->kind == CALL_OPENAI) {
        static const char *const open[4] = {"{\"tokens\":[", "],\"token_logprobs\":[",
                                            "],\"top_logprobs\":[", "],\"text_offset\":["};
        for (int i = 0; i < 4; i++) {
            PIECE(open[i], strlen(open[i]));
            PIECE(l[i].s, l[i].len);
        }
        PIECE("]}", 2);
    } else {
        const char *open = call->kind == CALL_CHAT ? "{\"content\":[" : "[";
        PIECE(open, strlen(open));
        PIECE(l[0].s, l[0].len);
        PIECE(call->kind == CALL_CHAT ? "]}" : "]", call->kind == CALL_CHAT ? 2 : 1);
    }
#undef PIECE
    return n;
}

/* Append n bytes to out (grown): 0, or -1 when memory runs out. */
static int out_add(struct lp_list *out, const char *s, size_t n)
{
    if (n == 0)
        return 0;
    if (list_grow(out, n))
        return -1;
    memcpy(out->s + out->len, s, n);
    out->len += n;
    return 0;
}

/*
 * Answer v (stolen; each choice's log-probabilities replaced by
 * srv_lp_marker(i)) with every choice's log-probabilities spliced in as
 * text: OpenAI's logprobs object, chat's {"content": [...]}, llama.cpp's
 * array. Returns 0, or -1 (nothing sent) when memory runs out or a marker
 * is missing.
 */
int srv_lp_respond(struct call *call, int status, json_t *v)
{
    char *d = v ? json_dumps(v, SRV_JSON_FLAGS) : NULL;
    json_decref(v);
    struct lp_list out = {0};
    const char *at = d;
    int rc = d ? 0 : -1;
    for (int i = 0; rc == 0 && i < call->n_choices; i++) {
        char mark[80];
        snprintf(mark, sizeof(mark), LP_MARKER_DUMPED, i);
        const char *m = strstr(at, mark);
        if (!m) {
            rc = -1;
            break;
        }
        const char *piece[9];
        size_t plen[9];
        int n = lp_pieces(call, &call->ch[i], piece, plen);
        rc = out_add(&out, at, (size_t)(m - at) + 2); /* up to and with the ":" */
        for (int k = 0; rc == 0 && k < n; k++)
            rc = out_add(&out, piece[k], plen[k]);
        at = m + strlen(mark) - 1; /* from the marker's closing quote on */
        at++;
    }
    if (rc == 0)
        rc = out_add(&out, at, strlen(at));
    if (rc == 0 && call->conn)
        srv_http_respond(call->conn, status, "application/json", "", out.s, out.len);
    free(out.s);
    free(d);
    return rc;
}
