/*
 * api_prepare.c - the expensive half of accepting a completion: render a
 * chat through its template, tokenize, and check that the prompt fits.
 *
 * It runs on libuv's work queue (api_calls.c), so a long prompt or a
 * template with many turns never holds the loop thread. Everything it
 * reads is immutable while it runs: the model and the chat template are
 * fixed once loaded, the limits are a copy, and the request's JSON is
 * left alone by the loop thread until the work is done.
 *
 * Bounding the work: the decoder has already refused a text whose bytes
 * alone make too many tokens (the byte bound, api_decode.c); here
 * tokenizing stops at the token limit, so a prompt just under the byte
 * bound costs at most one pass over its text.
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"

int srv_prompt_fits(const struct srv_api_limits *lim, int n_prompt, const char *qual,
                    struct srv_api_error *e)
{
    if (n_prompt == 0)
        return srv_fail(e, "prompt", "invalid_value", "the prompt is empty");
    if (n_prompt > lim->max_prompt_tokens)
        return srv_fail(e, "prompt", "context_length_exceeded",
                        "the prompt has %s%d tokens; the limit (max_prompt_tokens) is %d", qual,
                        n_prompt, lim->max_prompt_tokens);
    if (lim->policy.kind == KV_EVICT_NONE && n_prompt > lim->policy.max_cache_tokens)
        return srv_fail(e, "prompt", "context_length_exceeded",
                        "the prompt has %s%d tokens; a sequence holds at most %d "
                        "(max_cache_tokens) under eviction policy none",
                        qual, n_prompt, lim->policy.max_cache_tokens);
    return 0;
}

/* The most tokens a prompt may have under lim (srv_prompt_fits' rules). */
static int token_limit(const struct srv_api_limits *lim)
{
    int limit = lim->max_prompt_tokens;
    if (lim->policy.kind == KV_EVICT_NONE && lim->policy.max_cache_tokens < limit)
        limit = lim->policy.max_cache_tokens;
    return limit;
}

int srv_chat_budget(const struct srv_api_limits *lim, const struct srv_completion *c)
{
    /* Room for the answer: what the request asked for; without a limit a
     * quarter of the budget (a longer answer goes on, and the eviction
     * policy makes room as for any sequence). */
    int max_tokens = c->req->max_tokens, quarter = lim->policy.max_cache_tokens / 4;
    int reserve = c->max_tokens_given ? max_tokens : max_tokens < quarter ? max_tokens : quarter;
    int budget = lim->policy.max_cache_tokens - reserve;
    return budget > lim->max_prompt_tokens ? lim->max_prompt_tokens : budget;
}

/* Make room for `more` ids after the first n; -1 when memory runs out. */
static int reserve_ids(int32_t **ids, int n, int *cap, int more)
{
    if (n + more <= *cap)
        return 0;
    int32_t *p = realloc(*ids, sizeof(int32_t) * (size_t)(n + more));
    if (!p)
        return -1;
    *ids = p;
    *cap = n + more;
    return 0;
}

int srv_tokenize_append(const model *m, const char *text, size_t len, bool bos, bool special,
                        int limit, int32_t **ids, int *n, int *cap, const char *param,
                        struct srv_api_error *e)
{
    bool add_bos = bos && model_add_bos(m);
    int room = limit - *n;
    if (room < 0)
        return 1;
    /* A text has at most a token per byte, plus BOS and SPM's leading
     * space; ask for no more than the limit allows, so the tokenizer stops
     * soon after it. */
    int want = len + 2 < (size_t)room ? (int)len + 2 : room;
    for (;;) {
        if (reserve_ids(ids, *n, cap, want))
            return srv_oom(e, "tokenizing the prompt");
        int got = model_tokenize_upto(m, text, len, add_bos, special, *ids + *n, want);
        if (got < 0)
            return srv_fail(e, param, "invalid_value",
                            "the prompt cannot be tokenized (error %d)", got);
        if (got <= want) {
            *n += got;
            return 0;
        }
        if (want == room) { /* more than the limit: keep what fits */
            *n += room;
            return 1;
        }
        want = room; /* more tokens than the guess: once more, up to the limit */
    }
}

/* The prompt's parts, tokenized in order into r->prompt. */
static int tokenize_parts(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                          struct srv_api_error *e)
{
    struct engine_req *r = c->req;
    int limit = token_limit(&ctx->lim), cap = 0;
    const int32_t *ids = c->prompt.ids;
    for (int i = 0; i < c->prompt.n_parts; i++) {
        const struct srv_prompt_part *p = &c->prompt.parts[i];
        int rc;
        if (p->text) {
            rc = srv_tokenize_append(ctx->m, p->text, p->len, p->bos, false, limit, &r->prompt,
                                     &r->n_prompt, &cap, "prompt", e);
        } else {
            rc = r->n_prompt + p->n_ids > limit;
            int take = rc ? limit - r->n_prompt : p->n_ids;
            if (reserve_ids(&r->prompt, r->n_prompt, &cap, take))
                return srv_oom(e, "reading the prompt");
            memcpy(r->prompt + r->n_prompt, ids, sizeof(int32_t) * (size_t)take);
            r->n_prompt += take;
            ids += p->n_ids;
        }
        if (rc < 0)
            return -1;
        if (rc > 0)
            return srv_prompt_fits(&ctx->lim, limit + 1, "at least ", e);
    }
    return srv_prompt_fits(&ctx->lim, r->n_prompt, "", e);
}

/* tpl_chat_fit's token counter: the prompt as it will be tokenized. */
static int chat_count(const char *text, size_t len, void *ud)
{
    const model *m = ud;
    return model_tokenize_special(m, text, len, model_add_bos(m), NULL, 0);
}

/* Render the conversation (fitting it by whole turns with chat_turns)
 * into a new text. */
static int render_chat(const struct srv_prepare_ctx *ctx, const struct srv_completion *c,
                       char **text, size_t *len, struct srv_prepare_fit *fit,
                       struct srv_api_error *e)
{
    struct tpl_error te;
    int rc;
    if (ctx->lim.chat_turns) {
        int budget = srv_chat_budget(&ctx->lim, c);
        struct tpl_fit f;
        rc = tpl_chat_fit(ctx->chat, c->messages, c->tools, true, time(NULL), budget, budget / 2,
                          ctx->min_drop, chat_count, (void *)ctx->m, text, len, &f, &te);
        if (rc == 0) {
            fit->fitted = true;
            fit->dropped_turns = f.dropped_turns;
            fit->dropped_messages = f.dropped_messages;
        }
    } else {
        rc = tpl_chat_render(ctx->chat, c->messages, c->tools, true, time(NULL), text, len, &te);
    }
    if (rc == 0)
        return 0;
    char msg[400];
    tpl_error_string(&te, msg, sizeof(msg));
    bool budget = strstr(msg, "with every earlier turn left out") != NULL;
    return srv_fail(e, "messages", budget ? "context_length_exceeded" : "invalid_value", "%s%s",
                    budget ? "" : "the chat template cannot render these messages: ", msg);
}

/* Stop at the template's end of turn: as a token when it is one (control
 * tokens print no text), else as a stop string. */
static int chat_stop(const struct srv_prepare_ctx *ctx, struct engine_req *r,
                     struct srv_api_error *e)
{
    const char *eot = tpl_chat_end_of_turn(ctx->chat);
    if (ctx->eot_token >= 0) {
        r->stop_token = ctx->eot_token;
    } else if (*eot && r->n_stop < SRV_MAX_STOP) {
        char **v = realloc(r->stop, sizeof(char *) * (size_t)(r->n_stop + 1));
        if (!v)
            return srv_oom(e, "adding the end-of-turn stop");
        r->stop = v;
        if (!(v[r->n_stop] = strdup(eot)))
            return srv_oom(e, "adding the end-of-turn stop");
        r->n_stop++;
    }
    return 0;
}

static int prepare_chat(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                        struct srv_prepare_fit *fit, struct srv_api_error *e)
{
    if (!ctx->chat)
        return srv_fail(e, NULL, "chat_template_unavailable", "no chat template is loaded");
    char *text = NULL;
    size_t len = 0;
    if (render_chat(ctx, c, &text, &len, fit, e))
        return -1;
    struct engine_req *r = c->req;
    int limit = token_limit(&ctx->lim), cap = 0;
    struct srv_api_error te = {0};
    int rc = srv_tokenize_append(ctx->m, text, len, true, true, limit, &r->prompt, &r->n_prompt,
                                 &cap, "messages", &te);
    free(text);
    if (rc < 0 && te.status != 400) {
        *e = te;
        return -1;
    }
    if (rc < 0 || (rc == 0 && r->n_prompt == 0))
        return srv_fail(e, "messages", "invalid_value",
                        "the rendered conversation cannot be tokenized");
    if (chat_stop(ctx, r, e))
        return -1;
    if (rc > 0)
        return srv_prompt_fits(&ctx->lim, limit + 1, "at least ", e);
    return srv_prompt_fits(&ctx->lim, r->n_prompt, "", e);
}

int srv_prepare(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                struct srv_prepare_fit *fit, struct srv_api_error *e)
{
    memset(fit, 0, sizeof(*fit));
    if (c->shape == SRV_SHAPE_CHAT)
        return prepare_chat(ctx, c, fit, e);
    return tokenize_parts(ctx, c, e);
}
