/*
 * api_answer.c - the engine's events become answers: a JSON body when the
 * request ends, or Server-Sent Events as they come for streams, in the
 * shape the request came in (OpenAI completions, chat, llama.cpp).
 *
 * Loop thread only. srv_api_pump takes every pending event; a call ends
 * at its final event (DONE or ERROR). A generation the server cut short
 * (drain deadline, pool out of pages, a reload to policy none) never ends
 * like a normal finish (on_cut).
 */
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "server/api_internal.h"
#include "server/errors.h"
#include "server/log.h"
#include "server/route_map.h"

static const char *openai_finish(enum engine_finish f)
{
    switch (f) {
    case ENGINE_FINISH_EOG:
    case ENGINE_FINISH_STOP:
        return "stop";
    default:
        return "length";
    }
}

static const char *llama_stop_type(enum engine_finish f)
{
    switch (f) {
    case ENGINE_FINISH_EOG:
        return "eos";
    case ENGINE_FINISH_STOP:
        return "word";
    case ENGINE_FINISH_LENGTH:
    case ENGINE_FINISH_CONTEXT:
        return "limit";
    default:
        return "none";
    }
}

static json_t *usage_json(const struct engine_usage *u)
{
    return json_pack("{s:i, s:i, s:i, s:{s:i}, s:{s:i, s:i, s:i}}", "prompt_tokens",
                     u->prompt_tokens, "completion_tokens", u->completion_tokens, "total_tokens",
                     u->prompt_tokens + u->completion_tokens, "prompt_tokens_details",
                     "cached_tokens", u->cached_tokens, "kvd", "cached_tokens", u->cached_tokens,
                     "evicted_tokens", u->evicted_tokens, "retained_tokens", u->retained_tokens);
}

/* A chat answer's usage: the completion's, with the messages left out. */
static json_t *chat_usage(struct call *call, const struct engine_usage *u)
{
    json_t *v = usage_json(u), *kvd = json_object_get(v, "kvd");
    json_object_set_new(kvd, "evicted_messages",
                        json_integer(call->evicted_messages + u->evicted_messages));
    if (call->turn_eviction)
        json_object_set_new(kvd, "turn_eviction", json_string(call->turn_eviction));
    if (call->turn_fallback[0])
        json_object_set_new(kvd, "turn_eviction_fallback", json_string(call->turn_fallback));
    if (call->cut_tokens)
        json_object_set_new(kvd, "cut_tokens", json_integer(call->cut_tokens));
    return v;
}

static json_t *timings_json(const struct engine_usage *u)
{
    int pn = u->prompt_tokens - u->cached_tokens;
    int gn = u->completion_tokens;
    return json_pack("{s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:f}", "prompt_n", pn, "prompt_ms",
                     u->prompt_ms, "prompt_per_token_ms", pn ? u->prompt_ms / pn : 0.0,
                     "prompt_per_second", u->prompt_ms > 0 ? pn * 1000.0 / u->prompt_ms : 0.0,
                     "predicted_n", gn, "predicted_ms", u->gen_ms, "predicted_per_token_ms",
                     gn ? u->gen_ms / gn : 0.0, "predicted_per_second",
                     u->gen_ms > 0 ? gn * 1000.0 / u->gen_ms : 0.0);
}

/* Write to the stream if the client is still there (a failed write
 * closes the connection, which clears call->conn). */
static void stream_raw(struct call *call, const char *data, size_t n)
{
    if (call->conn)
        srv_http_stream_write(call->conn, data, n);
}

/* One SSE event "data: <text>\n\n". */
static void sse_text(struct call *call, const char *s, size_t n)
{
    char *buf = malloc(n + 8);
    if (!buf)
        return;
    memcpy(buf, "data: ", 6);
    memcpy(buf + 6, s, n);
    memcpy(buf + 6 + n, "\n\n", 2);
    stream_raw(call, buf, n + 8);
    free(buf);
}

/* One SSE event "data: <json>\n\n" (v stolen). */
static void sse_send(struct call *call, json_t *v)
{
    char *s = v ? json_dumps(v, SRV_JSON_FLAGS) : NULL;
    json_decref(v);
    if (!s)
        return;
    sse_text(call, s, strlen(s));
    free(s);
}

static void stream_start(struct call *call)
{
    if (call->started || !call->conn)
        return;
    call->started = true;
    srv_http_stream_begin(call->conn, 200, "text/event-stream", "X-Accel-Buffering: no\r\n");
}

/* One OpenAI completion object with choice `index`; logprobs (stolen) may
 * be NULL (null). */
static json_t *openai_chunk(struct call *call, int index, json_t *text, const char *finish,
                            json_t *logprobs)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:[{s:o, s:i, s:o, s:o}]}", "id", call->id, "object",
                     "text_completion", "created", (json_int_t)call->created, "model",
                     call->a->model_name, "choices", "text", text, "index", index, "logprobs",
                     logprobs ? logprobs : json_null(), "finish_reason",
                     finish ? json_string(finish) : json_null());
}

/* One chat.completion.chunk of choice `index`; delta and logprobs (may be
 * NULL: null) stolen. */
static json_t *chat_chunk(struct call *call, int index, json_t *delta, const char *finish,
                          json_t *logprobs)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:n, s:[{s:i, s:o, s:o, s:o}]}", "id", call->id,
                     "object", "chat.completion.chunk", "created", (json_int_t)call->created,
                     "model", call->a->model_name, "system_fingerprint", "choices", "index", index,
                     "delta", delta, "logprobs", logprobs ? logprobs : json_null(),
                     "finish_reason", finish ? json_string(finish) : json_null());
}

/* The first chunk of each choice of a chat stream says who speaks. */
static void chat_role_chunk(struct call *call, int index)
{
    if (call->ch[index].role_sent)
        return;
    call->ch[index].role_sent = true;
    sse_send(call, chat_chunk(call, index,
                              json_pack("{s:s, s:s}", "role", "assistant", "content", ""), NULL,
                              NULL));
}

/* The choice an event is about (an index out of range is the engine's bug:
 * choice 0 then). */
static int choice_of(const struct call *call, const struct engine_event *ev)
{
    return ev->choice >= 0 && ev->choice < call->n_choices ? ev->choice : 0;
}

static void on_text(struct call *call, const struct engine_event *ev)
{
    if (call->return_tokens && ev->n_tokens > 0) {
        if (call->n_toks + ev->n_tokens > call->cap_toks) {
            call->cap_toks = call->cap_toks ? call->cap_toks * 2 : 64;
            while (call->cap_toks < call->n_toks + ev->n_tokens)
                call->cap_toks *= 2;
            int32_t *nt = realloc(call->toks, sizeof(int32_t) * (size_t)call->cap_toks);
            if (!nt) {
                srv_call_out_of_memory(call);
                return;
            }
            call->toks = nt;
        }
        memcpy(call->toks + call->n_toks, ev->tokens, sizeof(int32_t) * (size_t)ev->n_tokens);
        call->n_toks += ev->n_tokens;
    }
    if (!call->conn)
        return;
    int ci = choice_of(call, ev);
    struct call_choice *ch = &call->ch[ci];
    if (!call->stream) {
        if (ch->len + ev->len + 1 > ch->cap) {
            size_t cap = ch->cap ? ch->cap * 2 : 256;
            while (cap < ch->len + ev->len + 1)
                cap *= 2;
            char *nt = realloc(ch->text, cap);
            if (!nt) {
                srv_call_out_of_memory(call);
                return;
            }
            ch->text = nt;
            ch->cap = cap;
        }
        memcpy(ch->text + ch->len, ev->text, ev->len);
        ch->len += ev->len;
        if (ev->lp && srv_lp_buf_add(call, ch, ev->lp))
            srv_call_out_of_memory(call);
        return;
    }
    if (ev->len == 0 && !(call->return_tokens && ev->n_tokens) && !ev->lp)
        return;
    stream_start(call);
    if (call->kind == CALL_CHAT) {
        chat_role_chunk(call, ci);
        json_t *lp = ev->lp ? srv_lp_stream_json(call, ch, ev->lp) : NULL;
        sse_send(call, chat_chunk(call, ci,
                                  json_pack("{s:o}", "content", srv_json_text(ev->text, ev->len)),
                                  NULL, lp));
    } else if (call->kind == CALL_OPENAI) {
        json_t *lp = ev->lp ? srv_lp_stream_json(call, ch, ev->lp) : NULL;
        sse_send(call, openai_chunk(call, ci, srv_json_text(ev->text, ev->len), NULL, lp));
    } else {
        json_t *v = json_pack("{s:o, s:b, s:i, s:i}", "content", srv_json_text(ev->text, ev->len),
                              "stop", 0, "id_slot", 0, "index", 0);
        if (call->return_tokens) {
            json_t *arr = json_array();
            for (int k = 0; k < ev->n_tokens; k++)
                json_array_append_new(arr, json_integer(ev->tokens[k]));
            json_object_set_new(v, "tokens", arr);
        }
        if (ev->lp)
            json_object_set_new(v, "completion_probabilities",
                                srv_lp_stream_json(call, ch, ev->lp));
        sse_send(call, v);
    }
}

static json_t *llama_final(struct call *call, const struct engine_event *ev, json_t *content)
{
    const struct engine_usage *u = &ev->usage;
    const char *word =
        ev->finish == ENGINE_FINISH_STOP && ev->stop_index >= 0 ? call->req->stop[ev->stop_index] : "";
    json_t *v = json_pack(
        "{s:o, s:i, s:i, s:b, s:s, s:i, s:i, s:i, s:b, s:s, s:b, s:b, s:b, s:s, s:o, s:o, "
        "s:{s:i, s:i, s:i}}",
        "content", content, "id_slot", 0, "index", 0, "stop", 1, "model", call->a->model_name,
        "tokens_predicted", u->completion_tokens, "tokens_evaluated", u->prompt_tokens,
        "tokens_cached", u->cached_tokens, "truncated", 0, "stop_type", llama_stop_type(ev->finish),
        "stopped_eos", ev->finish == ENGINE_FINISH_EOG, "stopped_word", ev->finish == ENGINE_FINISH_STOP,
        "stopped_limit", ev->finish == ENGINE_FINISH_LENGTH || ev->finish == ENGINE_FINISH_CONTEXT,
        "stopping_word", word, "timings", timings_json(u), "generation_settings",
        call->settings ? json_incref(call->settings) : json_object(), "kvd", "cached_tokens",
        u->cached_tokens, "evicted_tokens", u->evicted_tokens, "retained_tokens",
        u->retained_tokens);
    if (v && call->return_tokens) {
        json_t *arr = json_array();
        for (int k = 0; k < call->n_toks; k++)
            json_array_append_new(arr, json_integer(call->toks[k]));
        json_object_set_new(v, "tokens", arr);
    }
    /* streamed, each event carried its own */
    if (v && call->logprobs && !call->stream)
        json_object_set_new(v, "completion_probabilities", srv_lp_marker(0));
    return v;
}

/* The choices of a non-streamed OpenAI or chat answer (new): each one's
 * text, finish and the marker where its log-probabilities go. */
static json_t *answer_choices(struct call *call)
{
    json_t *arr = json_array();
    for (int i = 0; arr && i < call->n_choices; i++) {
        const struct call_choice *ch = &call->ch[i];
        json_t *text = srv_json_text(ch->text ? ch->text : "", ch->len);
        json_t *lp = call->logprobs ? srv_lp_marker(i) : json_null();
        const char *finish = openai_finish(ch->finish);
        json_array_append_new(
            arr, call->kind == CALL_CHAT
                     ? json_pack("{s:i, s:{s:s, s:o, s:n}, s:o, s:s}", "index", i, "message",
                                 "role", "assistant", "content", text, "refusal", "logprobs", lp,
                                 "finish_reason", finish)
                     : json_pack("{s:o, s:i, s:o, s:s}", "text", text, "index", i, "logprobs", lp,
                                 "finish_reason", finish));
    }
    return arr;
}

/* Answer a non-streamed request's final JSON (stolen), with its
 * log-probabilities spliced in where srv_lp_marker stands. */
static void respond_answer(struct call *call, json_t *v)
{
    if (!call->logprobs) {
        srv_respond_json(call->conn, 200, v);
        return;
    }
    if (srv_lp_respond(call, 200, v) < 0)
        srv_call_out_of_memory(call);
}

/*
 * The server cut the generation short: the drain deadline, the KV pool out
 * of pages mid-generation, or a reload that took away the eviction the
 * request was admitted under. What was generated has been sent (streamed)
 * or is kept (llama.cpp's content), but the end never looks like a normal
 * finish: OpenAI shapes get an error body (503) or, mid-stream, an error
 * event where the finish chunk would be; llama.cpp's gets stop_type "none"
 * with an "error" object. Counted in kvd_requests_cut_short_total.
 */
static void on_cut(struct call *call, const struct engine_event *ev)
{
    srv_metrics_cut(call->a->metrics, (int)ev->finish);
    const char *code = ev->finish == ENGINE_FINISH_ABORT  ? "cut_short_shutdown"
                       : ev->finish == ENGINE_FINISH_POOL ? "cut_short_kv_cache_full"
                                                       : "cut_short_policy_none";
    char msg[400];
    snprintf(msg, sizeof(msg), "the answer was cut short after %d tokens: %s",
             ev->usage.completion_tokens,
             ev->finish == ENGINE_FINISH_ABORT
                 ? "the server is shutting down and its drain deadline passed"
             : ev->finish == ENGINE_FINISH_POOL
                 ? "the KV cache ran out of pages (eviction and idle sessions gave none back)"
                 : "a reload switched eviction to policy none and the sequence's cache is full");
    if (call->kind == CALL_LLAMA) { /* one choice */
        const struct call_choice *ch = &call->ch[0];
        json_t *v = llama_final(call, ev,
                                call->stream ? json_string("")
                                             : srv_json_text(ch->text ? ch->text : "", ch->len));
        json_object_set_new(v, "error",
                            json_pack("{s:s, s:s, s:n, s:s}", "message", msg, "type",
                                      srv_error_type(503), "param", "code", code));
        if (!call->stream) {
            respond_answer(call, v);
            return;
        }
        stream_start(call);
        sse_send(call, v);
    } else if (!call->stream) {
        srv_api_error(call->conn, 503, NULL, code, NULL, "%s", msg);
        return;
    } else {
        size_t len = 0;
        char *body = srv_error_json(503, msg, NULL, code, &len);
        stream_start(call);
        if (body)
            sse_text(call, body, len);
        free(body);
        stream_raw(call, "data: [DONE]\n\n", 14);
    }
    if (call->conn)
        srv_http_stream_end(call->conn);
}

static void on_done(struct call *call, const struct engine_event *ev)
{
    if (!call->conn)
        return;
    if (call->kind == CALL_SESSION_MAP) {
        srv_map_respond(call->conn, ev, call->req->session);
        return;
    }
    if (call->kind == CALL_SESSION_LIST) {
        srv_sessions_respond(call->conn, ev);
        return;
    }
    if (call->kind == CALL_SESSION_GET || call->kind == CALL_SESSION_DELETE) {
        const struct engine_session_info *si = &ev->session;
        if (!si->found) {
            srv_api_error(call->conn, 404, "session", NULL, NULL, "no session '%s'", call->req->session);
            return;
        }
        if (call->kind == CALL_SESSION_DELETE) {
            srv_respond_json(call->conn, 200,
                         json_pack("{s:s, s:s, s:b}", "id", call->req->session, "object",
                                   "session.deleted", "deleted", 1));
            return;
        }
        json_t *pinned = json_array(); /* [[start, end), ...] history indices */
        for (int k = 0; pinned && k < si->n_pins; k++)
            json_array_append_new(pinned, json_pack("[i, i]", si->pins[k].start, si->pins[k].end));
        srv_respond_json(
            call->conn, 200,
            json_pack("{s:s, s:s, s:i, s:i, s:i, s:s, s:f, s:b, s:b, s:b, s:I, "
                      "s:{s:s, s:i, s:i, s:i, s:i}, s:{s:s, s:s, s:i, s:I}, s:o*}",
                      "id", call->req->session,
                      "object", "session", "tokens", si->history_tokens, "retained_tokens",
                      si->retained_tokens, "evicted_tokens",
                      si->history_tokens > si->retained_tokens
                          ? si->history_tokens - si->retained_tokens
                          : 0,
                      "positions", si->renumber ? "renumber" : "preserve", "last_used",
                      (double)si->last_used_ms / 1000.0, "busy", si->busy, "dropped", si->dropped,
                      "saved", si->saved, "disk_bytes", (json_int_t)si->disk_bytes,
                      "eviction", "policy", kv_policy_kind_name(si->policy.kind),
                      "max_cache_tokens", si->policy.max_cache_tokens, "sink_tokens",
                      si->policy.sink_tokens, "window_tokens", si->policy.window_tokens,
                      "heavy_tokens", si->policy.heavy_tokens, "kv", "k_type",
                      kv_type_name(si->k_type), "v_type", kv_type_name(si->v_type), "pages",
                      si->kv_pages, "bytes", (json_int_t)si->kv_bytes, "pinned", pinned));
        return;
    }
    struct engine_event cut;
    if (engine_finish_cut(call->cut) && !engine_finish_cut(ev->finish)) {
        cut = *ev; /* a choice was cut short: so is the answer */
        cut.finish = call->cut;
        ev = &cut;
    }
    if (ev->finish == ENGINE_FINISH_CANCEL)
        return;
    if (engine_finish_cut(ev->finish)) {
        on_cut(call, ev);
        return;
    }
    int ci = choice_of(call, ev);
    call->ch[ci].finish = ev->finish;
    const struct engine_usage *u = &ev->usage;
    if (call->stream && call->kind == CALL_CHAT) {
        stream_start(call);
        chat_role_chunk(call, ci);
        sse_send(call, chat_chunk(call, ci, json_object(), openai_finish(ev->finish), NULL));
        if (call->include_usage)
            sse_send(call, json_pack("{s:s, s:s, s:I, s:s, s:n, s:[], s:o}", "id", call->id,
                                     "object", "chat.completion.chunk", "created",
                                     (json_int_t)call->created, "model", call->a->model_name,
                                     "system_fingerprint", "choices", "usage",
                                     chat_usage(call, u)));
        stream_raw(call, "data: [DONE]\n\n", 14);
        if (call->conn)
            srv_http_stream_end(call->conn);
        return;
    }
    if (call->stream) {
        stream_start(call);
        if (call->kind == CALL_OPENAI) {
            sse_send(call,
                     openai_chunk(call, ci, json_string(""), openai_finish(ev->finish), NULL));
            if (call->include_usage) {
                sse_send(call,
                         json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", call->id, "object",
                                   "text_completion", "created", (json_int_t)call->created, "model",
                                   call->a->model_name, "choices", "usage", usage_json(u)));
            }
            static const char done[] = "data: [DONE]\n\n";
            stream_raw(call, done, sizeof(done) - 1);
        } else {
            sse_send(call, llama_final(call, ev, json_string("")));
        }
        if (call->conn)
            srv_http_stream_end(call->conn);
        return;
    }
    if (call->kind == CALL_CHAT) {
        respond_answer(call, json_pack("{s:s, s:s, s:I, s:s, s:n, s:o, s:o}", "id", call->id,
                                       "object", "chat.completion", "created",
                                       (json_int_t)call->created, "model", call->a->model_name,
                                       "system_fingerprint", "choices", answer_choices(call),
                                       "usage", chat_usage(call, u)));
    } else if (call->kind == CALL_OPENAI) {
        respond_answer(call, json_pack("{s:s, s:s, s:I, s:s, s:o, s:o}", "id", call->id, "object",
                                       "text_completion", "created", (json_int_t)call->created,
                                       "model", call->a->model_name, "choices",
                                       answer_choices(call), "usage", usage_json(u)));
    } else {
        const struct call_choice *ch = &call->ch[0];
        respond_answer(call, llama_final(call, ev, srv_json_text(ch->text ? ch->text : "", ch->len)));
    }
}

/*
 * One choice of several ended (the request goes on with the others). A
 * stream gets that choice's finish chunk now. A choice the server cut short
 * makes the whole answer cut: the other choices are ended (they would be
 * thrown away) and the final event answers as on_cut says.
 */
static void on_choice(struct call *call, const struct engine_event *ev)
{
    int ci = choice_of(call, ev);
    call->ch[ci].finish = ev->finish;
    if (engine_finish_cut(ev->finish)) {
        if (!engine_finish_cut(call->cut))
            call->cut = ev->finish;
        atomic_store(&call->req->cancel, ENGINE_CANCEL_CLIENT);
        return;
    }
    if (ev->finish == ENGINE_FINISH_CANCEL || !call->conn || !call->stream)
        return;
    stream_start(call);
    if (call->kind == CALL_CHAT) {
        chat_role_chunk(call, ci);
        sse_send(call, chat_chunk(call, ci, json_object(), openai_finish(ev->finish), NULL));
    } else if (call->kind == CALL_OPENAI) {
        sse_send(call, openai_chunk(call, ci, json_string(""), openai_finish(ev->finish), NULL));
    }
}

static void on_error(struct call *call, const struct engine_event *ev)
{
    if (!call->conn)
        return;
    if (!call->started) {
        srv_api_error(call->conn, ev->status, ev->status == 400 ? "prompt" : NULL,
                       ev->status == 400 ? "context_length_exceeded" : NULL, NULL, "%s",
                       ev->message);
        return;
    }
    /* The stream has begun: the error is its last event. */
    size_t len = 0;
    char *body = srv_error_json(ev->status, ev->message, NULL, NULL, &len);
    if (body)
        sse_text(call, body, len);
    free(body);
    if (call->kind == CALL_OPENAI || call->kind == CALL_CHAT)
        stream_raw(call, "data: [DONE]\n\n", 14);
    if (call->conn)
        srv_http_stream_end(call->conn);
}

bool srv_api_pump(srv_api *a, char *err, size_t errlen)
{
    bool ok = true;
    for (struct engine_event *ev = srv_sched_take_events(a->sched), *next; ev; ev = next) {
        next = ev->next;
        switch (ev->kind) {
        case ENGINE_EV_READY:
            a->m = srv_sched_model(a->sched);
            model_get_info(a->m, &a->info);
            a->max_token_bytes = model_max_token_bytes(a->m);
            snprintf(a->model_name, sizeof(a->model_name), "%s", a->info.name);
            srv_chat_load(a);
            a->ready_time = (int64_t)time(NULL);
            srv_log(SRV_LOG_INFO,
                    "ready: serving model '%s'; a token stands for at most %d bytes of text "
                    "(prompts longer than that many bytes per allowed token are refused "
                    "untokenized)",
                    a->model_name, a->max_token_bytes);
            break;
        case ENGINE_EV_FATAL:
            snprintf(err, errlen, "%s", ev->message);
            ok = false;
            break;
        case ENGINE_EV_TEXT:
            on_text(ev->req->owner, ev);
            break;
        case ENGINE_EV_LOGITS: /* never asked for by the API */
        case ENGINE_EV_EVICTED:
            break;
        case ENGINE_EV_CHOICE:
            on_choice(ev->req->owner, ev);
            break;
        case ENGINE_EV_DONE:
            /* whole turns a session's cache evicted in place */
            srv_metrics_evicted_messages(a->metrics, true,
                                         (uint64_t)ev->usage.evicted_messages_now);
            on_done(ev->req->owner, ev);
            srv_call_end(a, ev->req->owner);
            break;
        case ENGINE_EV_ERROR:
            on_error(ev->req->owner, ev);
            srv_call_end(a, ev->req->owner);
            break;
        }
        engine_event_free(ev);
    }
    return ok;
}
