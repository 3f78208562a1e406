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
#include "server/chat_turns.h"

int srv_prompt_fits(const struct srv_api_limits *lim, int n_prompt, const char *qual,
                    struct srv_api_error *e)
{
    return srv_prompt_fits_turns(lim, n_prompt, 0, qual, e);
}

int srv_prompt_fits_turns(const struct srv_api_limits *lim, int n_prompt, int n_turns,
                          const char *qual, struct srv_api_error *e)
{
    if (n_prompt == 0)
        return srv_fail(e, "prompt", "invalid_value", "the prompt is empty");
    if (n_prompt > lim->max_prompt_tokens)
        return srv_fail(e, "prompt", "context_length_exceeded",
                        "the prompt has %s%d tokens; the limit (max_prompt_tokens) is %d", qual,
                        n_prompt, lim->max_prompt_tokens);
    /* (a chat prompt with turns makes room by dropping them in place) */
    if (lim->policy.kind == KV_EVICT_NONE && n_turns == 0 &&
        n_prompt > lim->policy.max_cache_tokens)
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
            if (take > 0)
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

static int render_error(struct tpl_error *te, struct srv_api_error *e)
{
    char msg[400];
    tpl_error_string(te, msg, sizeof(msg));
    return srv_fail(e, "messages", "invalid_value",
                    "the chat template cannot render these messages: %s", msg);
}

/*
 * A session under unit = turn: the whole conversation goes to the engine
 * with its turns' spans, and the cache drops turns in place as it needs
 * room, so the session's history keeps matching and only the new turn is
 * prefilled. What a session's first request could not fit is left out by
 * rendering (nothing is cached yet), and that decision stays. Returns 0
 * (done), -1 (error in e), or 1 (take the fitting path: the turns cannot
 * be dropped in place, the reason in fit->turn_fallback; or the pinned
 * part alone is over budget).
 */
static int chat_in_place(const struct srv_prepare_ctx *ctx, struct srv_completion *c, int budget,
                         struct srv_prepare_fit *fit, struct srv_api_error *e)
{
    struct tpl_error te;
    int drop = ctx->min_drop;
    time_t now = time(NULL);
    if (!ctx->sess_known) {
        char *text = NULL;
        size_t len = 0;
        struct tpl_fit f;
        if (tpl_chat_fit(ctx->chat, c->messages, c->tools, true, now, budget, budget, 0,
                         chat_count, (void *)ctx->m, &text, &len, &f, &te) < 0)
            return 1; /* the fitting path reports it (or cuts the last turn) */
        free(text);
        drop = f.dropped_turns;
    }
    struct srv_chat_in_place ip;
    char why[240] = "";
    int rc = srv_chat_in_place(ctx->m, ctx->chat, c->messages, c->tools, drop, now, budget,
                               ctx->lim.max_prompt_tokens, &ip, why, sizeof(why), &te);
    if (rc < 0)
        return render_error(&te, e);
    if (rc == 2)
        return 1;
    if (rc == 1) {
        snprintf(fit->turn_fallback, sizeof(fit->turn_fallback), "%s", why);
        return 1;
    }
    struct engine_req *r = c->req;
    r->prompt = ip.p.ids;
    r->n_prompt = ip.p.n_ids;
    r->turns = ip.p.turns;
    r->n_turns = ip.p.n_turns;
    r->turn_low_tokens = budget;
    fit->in_place = true;
    fit->turn_eviction = "in_place";
    fit->dropped_turns = drop;
    fit->dropped_messages = ip.dropped_messages;
    return 0;
}

/* The last turn alone is larger than the budget: cut it from its middle,
 * keeping its header (srv_chat_cut_last_turn). Returns 0 or -1 (e). */
static int chat_cut(const struct srv_prepare_ctx *ctx, struct srv_completion *c, int budget,
                    struct srv_prepare_fit *fit, struct srv_api_error *e)
{
    char why[300];
    struct tpl_error te;
    int32_t *ids = NULL;
    int n = 0, cut = 0;
    te.msg[0] = 0;
    if (srv_chat_cut_last_turn(ctx->m, ctx->chat, c->messages, c->tools, time(NULL), budget,
                               &ids, &n, &cut, why, sizeof(why), &te) < 0) {
        if (te.msg[0])
            return render_error(&te, e);
        return srv_fail(e, "messages", "context_length_exceeded", "%s", why);
    }
    c->req->prompt = ids;
    c->req->n_prompt = n;
    fit->cut_tokens = cut;
    return 0;
}

/*
 * The conversation as a prompt. With unit = turn: a session keeps its
 * turns in the cache and drops them in place (chat_in_place); otherwise,
 * or when the template does not allow it, the conversation is fitted by
 * rendering (tpl_chat_fit), recording the turns left out; a last turn
 * larger than the budget is cut (chat_cut). Returns 0 with r->prompt set
 * when it is done here (in place, cut), 1 with a new rendering in *text to
 * tokenize, or -1 (e).
 */
static int render_chat(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                       char **text, size_t *len, struct srv_prepare_fit *fit,
                       struct srv_api_error *e)
{
    struct tpl_error te;
    int rc;
    if (ctx->lim.chat_turns) {
        int budget = srv_chat_budget(&ctx->lim, c);
        if (c->req->session && (rc = chat_in_place(ctx, c, budget, fit, e)) <= 0)
            return rc;
        fit->turn_eviction = "rerender";
        struct tpl_fit f;
        rc = tpl_chat_fit(ctx->chat, c->messages, c->tools, true, time(NULL), budget, budget / 2,
                          ctx->min_drop, chat_count, (void *)ctx->m, text, len, &f, &te);
        if (rc == 0) {
            fit->fitted = true;
            fit->dropped_turns = f.dropped_turns;
            fit->dropped_messages = f.dropped_messages;
        } else if (strstr(te.msg, "with every earlier turn left out")) {
            return chat_cut(ctx, c, budget, fit, e);
        }
    } else {
        rc = tpl_chat_render(ctx->chat, c->messages, c->tools, true, time(NULL), text, len, &te);
    }
    if (rc < 0)
        return render_error(&te, e);
    return 1;
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
    struct engine_req *r = c->req;
    int limit = token_limit(&ctx->lim), rc = render_chat(ctx, c, &text, &len, fit, e);
    if (rc < 0)
        return -1;
    if (rc > 0) { /* a rendering to tokenize */
        int cap = 0;
        struct srv_api_error te = {0};
        rc = srv_tokenize_append(ctx->m, text, len, true, true, limit, &r->prompt, &r->n_prompt,
                                 &cap, "messages", &te);
        free(text);
        if (rc < 0 && te.status != 400) {
            *e = te;
            return -1;
        }
        if (rc < 0 || (rc == 0 && r->n_prompt == 0))
            return srv_fail(e, "messages", "invalid_value",
                            "the rendered conversation cannot be tokenized");
    }
    if (chat_stop(ctx, r, e))
        return -1;
    if (rc > 0)
        return srv_prompt_fits_turns(&ctx->lim, limit + 1, r->n_turns, "at least ", e);
    return srv_prompt_fits_turns(&ctx->lim, r->n_prompt, r->n_turns, "", e);
}

int srv_prepare(const struct srv_prepare_ctx *ctx, struct srv_completion *c,
                struct srv_prepare_fit *fit, struct srv_api_error *e)
{
    memset(fit, 0, sizeof(*fit));
    if (c->shape == SRV_SHAPE_CHAT)
        return prepare_chat(ctx, c, fit, e);
    return tokenize_parts(ctx, c, e);
}
