/*
 * api_chat.c - the chat side of the API on the loop thread: the template
 * (loaded when the model is), what each chat session's earlier requests
 * decided, and POST /apply-template.
 *
 * POST /v1/chat/completions renders "messages" (and "tools") with the chat
 * template chosen at load (chat_template.c), tokenizes the result with its
 * control tokens recognised, and runs it as a completion that also stops
 * at the template's end-of-turn marker (srv_prepare, off the loop thread).
 * With [eviction] unit = turn the conversation is fitted first
 * (tpl_chat_fit): whole oldest turns leave until the prompt and max_tokens
 * fit max_cache_tokens, so the cache never has to cut a turn; a session
 * remembers how many turns its prompt leaves out (api_chat_sess.c), so the
 * next request renders the same prefix and only its new turn is prefilled.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"
#include "server/chat_template.h"
#include "server/log.h"

void srv_chat_load(srv_api *a)
{
    struct srv_chat_template_opts o = {.path = a->chat_path};
    char source[1200];
    a->eot_token = -1;
    a->chat = srv_chat_template_load(a->m, &o, source, sizeof(source), a->chat_err,
                                     sizeof(a->chat_err));
    if (!a->chat) {
        srv_log(SRV_LOG_ERROR, "chat template: %s; /v1/chat/completions answers 500",
                a->chat_err);
        return;
    }
    const char *eot = tpl_chat_end_of_turn(a->chat);
    int32_t ids[4];
    if (*eot && model_tokenize_special(a->m, eot, strlen(eot), false, ids, 4) == 1)
        a->eot_token = ids[0];
    srv_log(SRV_LOG_INFO, "chat template: %s; system messages %s; turns end at %s%s%s", source,
            tpl_chat_supports_system(a->chat) ? "rendered"
                                              : "joined to the first user message (the template "
                                                "has no system role)",
            *eot ? "'" : "", *eot ? eot : "EOS",
            *eot ? (a->eot_token >= 0 ? "' (one token)" : "' (text)") : "");
}

/* /apply-template's job: the conversation in, the rendering out. */
struct render_job {
    struct srv_api_job job;
    const tpl_chat *chat;
    struct srv_apply_template_req t;
    char *text; /* out: the rendering (new) */
    size_t len;
    struct srv_api_error e; /* out: when text is NULL */
};

static void render_run(struct srv_api_job *j)
{
    struct render_job *r = (struct render_job *)j;
    struct tpl_error te;
    if (tpl_chat_render(r->chat, r->t.messages, r->t.tools, r->t.add_generation_prompt,
                        time(NULL), &r->text, &r->len, &te) < 0) {
        char msg[400];
        srv_fail(&r->e, "messages", "invalid_value",
                 "the chat template cannot render these messages: %s",
                 tpl_error_string(&te, msg, sizeof(msg)));
    }
}

static void render_done(struct srv_api_job *j)
{
    struct render_job *r = (struct render_job *)j;
    srv_apply_template_req_clear(&r->t);
    if (j->conn && r->e.status)
        srv_api_error_from(j->conn, &r->e);
    else if (j->conn)
        srv_respond_json(j->conn, 200,
                         json_pack("{s:o}", "prompt", srv_json_text(r->text, r->len)));
    free(r->text);
    free(r);
}

/* POST /apply-template (llama.cpp): {"messages", "tools"?,
 * "add_generation_prompt"? (default true)} -> {"prompt"}. */
void srv_route_apply_template(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    struct srv_api_error e = {0};
    struct srv_api_limits lim;
    srv_api_limits(a, &lim);
    json_t *body = srv_decode_body(req->body, req->body_len, &e);
    struct render_job *r = body ? calloc(1, sizeof(*r)) : NULL;
    if (body && !r)
        srv_oom(&e, "accepting the request");
    if (!r || srv_decode_apply_template(&lim, body, &r->t, &e)) {
        json_decref(body);
        free(r);
        srv_api_error_from(c, &e);
        return;
    }
    json_decref(body);
    r->chat = a->chat;
    r->job.run = render_run;
    r->job.done = render_done;
    srv_api_job_start(a, c, &r->job);
}
