/*
 * api.c - kvd's HTTP API: its state and lifecycle. The API itself is
 * spread over files of one concern each (api_internal.h lists them and
 * who calls whom).
 *
 * A request's way through: the route table (api_routes.c) picks its
 * handler; a completion's body is parsed and decoded on the loop thread
 * (api_decode*.c: cheap checks, the byte bound); rendering, tokenizing and
 * the prompt-fit check run on libuv's work queue (api_prepare.c, started
 * from api_calls.c); the request then leaves as a plain struct engine_req for
 * the engine. The engine answers with events, which api_answer.c turns
 * into a JSON body, or into Server-Sent Events as they come for streams.
 *
 * Three request shapes share the engine:
 *   POST /v1/completions      OpenAI: prompt, max_tokens, temperature, top_p,
 *                             stop, stream, seed, ... ; choices[].text, usage
 *                             (plus usage.kvd: cached, evicted, retained tokens)
 *   POST /v1/chat/completions OpenAI chat: messages through the chat template
 *   POST /completion          llama.cpp: prompt, n_predict, ... ; content,
 *                             stop, tokens_predicted, tokens_evaluated, timings
 * All report log-probabilities when asked (OpenAI logprobs, llama.cpp
 * n_probs): the engine sends each sampled token's numbers with its text
 * event, and they are shaped as each API does (api_answer_lp.c).
 * All accept kvd's own "session": a string id whose cache persists. The
 * same id may come in the X-Session-Id header instead, so a load balancer
 * can keep a session on one replica without parsing bodies; when both are
 * given they must agree (400 otherwise).
 *
 * Errors are {"error":{"message","type","param","code"}} (errors.c), with
 * the status chosen where the problem is found (srv_api_error).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"

srv_api *srv_api_create(struct uv_loop_s *loop, srv_sched *sched, srv_metrics *metrics,
                        const struct srv_api_params *p)
{
    srv_api *a = calloc(1, sizeof(*a));
    if (!a)
        return NULL;
    a->loop = loop;
    a->sched = sched;
    a->metrics = metrics;
    a->eot_token = -1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    a->seed_state = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec;
    srv_api_set_params(a, p);
    return a;
}

void srv_api_set_params(srv_api *a, const struct srv_api_params *p)
{
    a->p = *p;
    snprintf(a->api_key, sizeof(a->api_key), "%s", p->api_key ? p->api_key : "");
    a->p.api_key = NULL;
    if (a->p.max_session_id <= 0)
        a->p.max_session_id = 128;
    if (!a->chat) /* the template is chosen at load: a reload changes it only on restart */
        snprintf(a->chat_path, sizeof(a->chat_path), "%s", p->chat_template ? p->chat_template : "");
    a->p.chat_template = NULL;
    char *cj = p->config_json ? strdup(p->config_json) : NULL;
    if (cj || !p->config_json) { /* out of memory: the old one stays */
        free(a->config_json);
        a->config_json = cj;
    }
    a->p.config_json = NULL;
}

void srv_api_destroy(srv_api *a)
{
    if (!a)
        return;
    while (a->calls) {
        struct call *call = a->calls;
        a->calls = call->next;
        srv_call_free(call);
    }
    model_detok_destroy(a->piece_detok);
    free(a->piece_buf);
    tpl_chat_destroy(a->chat);
    srv_chat_sess_free_all(a);
    free(a->config_json);
    free(a);
}

void srv_api_set_draining(srv_api *a, bool draining)
{
    a->draining = draining;
}

int srv_api_in_flight(const srv_api *a)
{
    return a->in_flight;
}

void srv_api_abort_all(srv_api *a)
{
    for (struct call *call = a->calls; call; call = call->next)
        if (call->req) {
            int expected = 0;
            atomic_compare_exchange_strong(&call->req->cancel, &expected, ENGINE_CANCEL_ABORT);
        }
}
