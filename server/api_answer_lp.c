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

/* An empty OpenAI logprobs object (new). */
json_t *srv_lp_openai_new(void)
{
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

/* Append one token to an OpenAI logprobs object. top_logprobs maps names
 * to log-probabilities; when two alternatives share a name, the more
 * likely one keeps it, and a U+0000 in a name is written U+FFFD there
 * (many JSON parsers refuse it in a key). text_offset counts code points
 * of the completion. */
void srv_lp_openai_add(struct call *call, json_t *obj, const struct srv_logprob *lp)
{
    json_array_append_new(json_object_get(obj, "tokens"),
                          token_name(call, lp->token, lp->piece, lp->piece_len));
    json_array_append_new(json_object_get(obj, "token_logprobs"), json_logprob(lp->logprob));
    json_t *top = json_object();
    for (int i = 0; i < lp->n_top; i++) {
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
    json_array_append_new(json_object_get(obj, "top_logprobs"), top);
    json_array_append_new(json_object_get(obj, "text_offset"),
                          json_integer((json_int_t)call->lp_chars));
    call->lp_chars += utf8_chars(lp->piece, lp->piece_len);
}

/* llama.cpp's completion_probabilities entry for one token (new). */
json_t *srv_lp_llama(struct call *call, const struct srv_logprob *lp)
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
json_t *srv_lp_chat(struct call *call, const struct srv_logprob *lp)
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
