/*
 * api_decode_llama.c - POST /completion (llama.cpp): prompt (a string, ids,
 * or a mixed array), n_predict, repeat_penalty, repeat_last_n,
 * n_probs, return_tokens, ... into a plain request, with the
 * generation_settings object llama.cpp echoes in its final answer.
 */
#include <jansson.h>
#include <math.h>
#include <string.h>

#include "server/api_internal.h"

/* generation_settings as llama.cpp reports them (new; NULL on OOM). */
static json_t *settings_json(const struct engine_req *r, bool stream)
{
    json_t *stops = json_array();
#define R6(x) (round((double)(x)*1e6) / 1e6)
    for (int k = 0; stops && k < r->n_stop; k++)
        json_array_append_new(stops, json_string(r->stop[k]));
    return json_pack(
        "{s:i, s:f, s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:I, s:o, s:b, s:b, s:i}", "n_predict",
        r->max_tokens, "temperature", R6(r->sampling.temperature), "top_k", r->sampling.top_k,
        "top_p", R6(r->sampling.top_p), "min_p", R6(r->sampling.min_p), "repeat_penalty",
        R6(r->sampling.repeat_penalty), "repeat_last_n", r->sampling.penalty_last_n,
        "presence_penalty", R6(r->sampling.presence_penalty), "frequency_penalty",
        R6(r->sampling.frequency_penalty), "seed", (json_int_t)r->sampling.seed, "stop", stops,
        "stream", stream, "ignore_eos", r->ignore_eos, "n_probs", r->n_top_logprobs);
#undef R6
}

int srv_decode_llama(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                     struct srv_completion *out, struct srv_api_error *e)
{
    if (srv_decode_start(SRV_SHAPE_LLAMA, body, out, e))
        goto out;
    struct engine_req *r = out->req;
    model_sampling_defaults(&r->sampling); /* llama.cpp's defaults */
    r->sampling.seed = lim->seed;
    long long i;
    double d;
    bool b;
    r->max_tokens = lim->max_tokens;
    json_t *np = srv_field(body, "n_predict");
    if (np && json_is_integer(np) && json_integer_value(np) > lim->max_tokens &&
        json_integer_value(np) <= (1ll << 40)) {
        srv_fail(e, "n_predict", "invalid_value", "n_predict (%lld) exceeds the limit of %d",
                 (long long)json_integer_value(np), lim->max_tokens);
        goto out;
    }
    if (srv_get_int(body, "n_predict", -1, lim->max_tokens, &i, e) > 0 && i >= 0)
        r->max_tokens = (int)i;
    if (srv_get_num(body, "repeat_penalty", 0, 10, &d, e) > 0)
        r->sampling.repeat_penalty = (float)d;
    if (srv_get_int(body, "repeat_last_n", -1, 1 << 20, &i, e) > 0)
        r->sampling.penalty_last_n = i < 0 ? 1 << 20 : (int)i;
    if (srv_get_int(body, "seed", -1, INT64_MAX, &i, e) > 0 && i >= 0)
        r->sampling.seed = (uint64_t)i;
    json_t *sv = srv_field(body, "seed");
    if (sv && json_is_integer(sv) && json_integer_value(sv) < -1)
        srv_fail(e, "seed", "invalid_value",
                 "'seed' must be -1 (random) or a non-negative integer");
    srv_get_bool(body, "stream", &out->stream, e);
    srv_get_bool(body, "cache_prompt", &b, e);
    srv_get_bool(body, "return_tokens", &out->return_tokens, e);
    int top = 0;
    if (srv_decode_top_n(lim, body, "n_probs", &top, e) > 0 && top > 0) {
        r->want_logprobs = out->logprobs = true;
        r->n_top_logprobs = top;
    }
    srv_decode_logprob_work(r, out->stream, "n_probs", e);
    if (srv_get_bool(body, "post_sampling_probs", &b, e) > 0 && b)
        srv_fail(e, "post_sampling_probs", "unsupported",
                 "post_sampling_probs is not supported: kvd reports the probabilities of the "
                 "model's raw logits (before penalties and temperature)");
    srv_decode_common(lim, body, hdr_session, r, e);
    if (!e->status)
        srv_decode_prompt(lim, body, true, &out->prompt, e);
    if (!e->status) {
        r->want_tokens = out->return_tokens;
        if (!(out->settings = settings_json(r, out->stream)))
            srv_oom(e, "accepting the request");
    }
out:
    if (e->status) {
        srv_completion_clear(out);
        return -1;
    }
    return 0;
}
