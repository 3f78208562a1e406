/*
 * api_prepare.h - a decoded completion's prompt made ready for the engine
 * (api_prepare.c): a chat rendered through its template, the text
 * tokenized, and the one check that the prompt fits.
 *
 * This is the expensive part of accepting a request, so it runs on
 * libuv's work queue, never on the loop thread. It reads only what
 * struct srv_prepare_ctx holds (the model and the chat template are
 * immutable once loaded) and the completion it is given, whose JSON the
 * loop thread does not touch until the work is done.
 */
#ifndef KVD_SERVER_API_PREPARE_H
#define KVD_SERVER_API_PREPARE_H

#include <stdint.h>

#include "model/model.h"
#include "server/api_decode.h"
#include "template/template.h"

struct srv_prepare_ctx {
    const model *m;             /* the tokenizer (borrowed) */
    const tpl_chat *chat;       /* the chat template, or NULL (borrowed) */
    int32_t eot_token;          /* the template's end of turn as one control token, or -1 */
    struct srv_api_limits lim;  /* chat_unavailable is not read here */
    int min_drop;               /* chat session: turns its earlier prompts left out */
    bool sess_known;            /* chat session: an earlier request recorded min_drop */
};

/* What fitting a chat by whole turns decided (chat_turns only), for the
 * loop thread to record (the session table, metrics, the answer's usage). */
struct srv_prepare_fit {
    bool fitted;          /* left out by rendering (tpl_chat_fit ran) */
    bool in_place;        /* a session's turns go to the engine, to leave in place */
    int dropped_turns;    /* the conversation's oldest turns left out */
    int dropped_messages; /* ... and their messages */
    const char *turn_eviction; /* "in_place", "rerender", or NULL (static) */
    char turn_fallback[240];   /* why a session's turns are rendered again, or "" */
    int cut_tokens;            /* tokens cut from the middle of a too-large last turn */
};

/*
 * Make c's prompt: render (CHAT) and tokenize into c->req->prompt, add the
 * chat's end-of-turn stop, and check the prompt against the limits. The
 * byte bound refuses a text before it is tokenized, and tokenizing stops
 * at the token limit. Returns 0, or -1 with e filled (400, or 503 when
 * memory ran out); c->req's prompt is then unspecified (free c as usual).
 */
int srv_prepare(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                struct srv_prepare_fit *fit, struct srv_api_error *e);

/*
 * The one prompt-fit check: empty, over max_prompt_tokens, or (policy
 * none) over what a sequence holds. qual words n_prompt in the message:
 * "" (the count), "at least " (a bound). Returns 0 or -1 with e filled.
 */
int srv_prompt_fits(const struct srv_api_limits *lim, int n_prompt, const char *qual,
                    struct srv_api_error *e);

/* srv_prompt_fits for a chat prompt with n_turns droppable turns: under
 * policy none those make room in place, so it may pass max_cache_tokens. */
int srv_prompt_fits_turns(const struct srv_api_limits *lim, int n_prompt, int n_turns,
                          const char *qual, struct srv_api_error *e);

/* With [eviction] unit = turn, the tokens a chat's conversation may take:
 * max_cache_tokens less the answer's room (max_tokens when the request set
 * it, else at most a quarter), at most max_prompt_tokens. */
int srv_chat_budget(const struct srv_api_limits *lim, const struct srv_completion *c);

/*
 * Tokenize text (BOS first when bos and the model wants one; special:
 * control tokens written in the text become those tokens) and append at
 * most `limit - *n` ids to (*ids)[*n..], growing *ids (*cap its size).
 * Returns 0; 1 when the text has more tokens than fit under limit (what
 * fits was appended); or -1 with e filled (param names the text).
 */
int srv_tokenize_append(const model *m, const char *text, size_t len, bool bos, bool special,
                        int limit, int32_t **ids, int *n, int *cap, const char *param,
                        struct srv_api_error *e);

#endif /* KVD_SERVER_API_PREPARE_H */
