/*
 * api_decode_openai.c - POST /v1/completions (OpenAI): prompt, max_tokens,
 * temperature, top_p, stop, stream, seed, logprobs, ... into a plain
 * request. Features kvd does not have (best_of, echo, suffix,
 * logit_bias) are refused by name rather than ignored.
 */
#include <jansson.h>
#include <string.h>

#include "server/api_internal.h"

int srv_decode_openai(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                      struct srv_completion *out, struct srv_api_error *e)
{
    if (srv_decode_start(SRV_SHAPE_OPENAI, body, out, e))
        goto out;
    struct engine_req *r = out->req;
    srv_decode_openai_sampling(lim, r);
    const char *s;
    long long i;
    r->max_tokens = lim->default_max_tokens;
    if (srv_decode_max_tokens(lim, body, "max_tokens", r, e) < 0)
        goto out;
    srv_decode_openai_shared(body, r, out, e);
    srv_decode_choices(lim, body, srv_field(body, "max_tokens") != NULL, r, e);
    if (srv_get_int(body, "best_of", 1, 1 << 30, &i, e) > 0 && i != 1)
        srv_fail(e, "best_of", "unsupported", "best_of > 1 is not supported");
    bool b = false;
    if (srv_get_bool(body, "echo", &b, e) > 0 && b)
        srv_fail(e, "echo", "unsupported",
                 "echo is not supported: kvd returns neither the prompt nor its "
                 "log-probabilities (logprobs covers generated tokens only)");
    int top = 0;
    if (srv_decode_top_n(lim, body, "logprobs", &top, e) > 0) {
        r->want_logprobs = out->logprobs = true;
        r->n_top_logprobs = top;
    }
    srv_decode_logprob_work(r, out->stream, "logprobs", e);
    srv_get_bool(body, "return_tokens_as_token_ids", &out->id_tokens, e);
    if (srv_get_str(body, "suffix", &s, e) > 0 && s[0])
        srv_fail(e, "suffix", "unsupported", "suffix is not supported");
    srv_decode_no_logit_bias(body, e);
    srv_decode_common(lim, body, hdr_session, r, e);
    if (!e->status)
        srv_decode_prompt(lim, body, false, &out->prompt, e);
out:
    if (e->status) {
        srv_completion_clear(out);
        return -1;
    }
    return 0;
}
