/*
 * api_decode_chat.c - POST /v1/chat/completions (OpenAI chat) and POST
 * /apply-template (llama.cpp): the conversation ("messages", "tools") and
 * the chat's own fields (max_completion_tokens, logprobs + top_logprobs).
 * The conversation is rendered and tokenized later, off the loop thread
 * (srv_prepare); here it is only checked for shape.
 */
#include <jansson.h>
#include <stdio.h>
#include <string.h>

#include "server/api_internal.h"

static const char *const chat_roles[] = {"system", "developer", "user", "assistant", "tool",
                                         NULL};

int srv_decode_messages(const json_t *body, const json_t **msgs_out, const json_t **tools_out,
                        struct srv_api_error *e)
{
    const json_t *msgs = srv_field(body, "messages"), *tools = srv_field(body, "tools");
    *msgs_out = msgs;
    *tools_out = tools;
    if (!msgs)
        return srv_fail(e, "messages", "missing_field", "'messages' is required");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return srv_fail(e, "messages", "invalid_value",
                        "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
    size_t i;
    const json_t *m;
    json_array_foreach(msgs, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        bool known = false;
        for (int k = 0; role && chat_roles[k]; k++)
            known |= !strcmp(role, chat_roles[k]);
        if (!json_is_object(m) || !known)
            return srv_fail(e, "messages", "invalid_value",
                            "messages[%zu] needs a \"role\" of system, developer, user, assistant "
                            "or tool",
                            i);
    }
    if (tools && !json_is_array(tools))
        return srv_fail(e, "tools", "invalid_type", "'tools' must be an array");
    return 0;
}

/* With [eviction] unit = turn: the answer's room must leave some for the
 * conversation (see srv_prepare for how the room is chosen). */
static void check_turn_budget(const struct srv_api_limits *lim, const struct srv_completion *c,
                              struct srv_api_error *e)
{
    if (!lim->chat_turns || srv_chat_budget(lim, c) >= 1)
        return;
    srv_fail(e, "max_tokens", "context_length_exceeded",
             "max_tokens (%d) leaves no room for the conversation in max_cache_tokens (%d)",
             c->req->max_tokens, lim->policy.max_cache_tokens);
}

int srv_decode_chat(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                    struct srv_completion *out, struct srv_api_error *e)
{
    if (srv_decode_start(SRV_SHAPE_CHAT, body, out, e))
        goto out;
    struct engine_req *r = out->req;
    srv_decode_openai_sampling(lim, r);
    r->max_tokens = lim->default_max_tokens;
    out->max_tokens_given =
        srv_field(body, "max_completion_tokens") || srv_field(body, "max_tokens");
    const char *key = srv_field(body, "max_completion_tokens") ? "max_completion_tokens"
                                                                : "max_tokens";
    if (srv_decode_max_tokens(lim, body, key, r, e) < 0)
        goto out;
    srv_decode_openai_shared(body, r, out, e);
    srv_decode_choices(lim, body, out->max_tokens_given, r, e);
    bool lp = false;
    srv_get_bool(body, "logprobs", &lp, e);
    int top = 0;
    if (srv_decode_top_n(lim, body, "top_logprobs", &top, e) > 0 && !lp)
        srv_fail(e, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    if (lp) {
        r->want_logprobs = out->logprobs = true;
        r->n_top_logprobs = top;
    }
    srv_decode_logprob_work(r, out->stream, "top_logprobs", e);
    srv_decode_no_logit_bias(body, e);
    srv_decode_common(lim, body, hdr_session, r, e);
    if (e->status)
        goto out;
    if (lim->chat_unavailable) {
        e->status = 500;
        e->code = "chat_template_unavailable";
        snprintf(e->msg, sizeof(e->msg),
                 "no chat template can be used: %.400s (set [model] chat_template to a template "
                 "file)",
                 lim->chat_unavailable);
        goto out;
    }
    if (srv_decode_messages(body, &out->messages, &out->tools, e) == 0)
        check_turn_budget(lim, out, e);
out:
    if (e->status) {
        srv_completion_clear(out);
        return -1;
    }
    return 0;
}

int srv_decode_apply_template(const struct srv_api_limits *lim, json_t *body,
                              struct srv_apply_template_req *out, struct srv_api_error *e)
{
    memset(out, 0, sizeof(*out));
    out->add_generation_prompt = true;
    srv_decode_messages(body, &out->messages, &out->tools, e);
    srv_get_bool(body, "add_generation_prompt", &out->add_generation_prompt, e);
    if (!e->status && lim->chat_unavailable) {
        e->status = 500;
        e->code = "chat_template_unavailable";
        snprintf(e->msg, sizeof(e->msg), "no chat template can be used: %.400s",
                 lim->chat_unavailable);
    }
    if (e->status) {
        memset(out, 0, sizeof(*out));
        return -1;
    }
    out->body = json_incref(body);
    return 0;
}

void srv_apply_template_req_clear(struct srv_apply_template_req *t)
{
    json_decref(t->body);
    memset(t, 0, sizeof(*t));
}
