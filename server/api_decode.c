/*
 * api_decode.c - what every route's decoder shares: the request body as
 * JSON, the fields both completion shapes read the same way (sampling,
 * session, stop strings, log-probability asks, max_tokens), the prompt as
 * the request gave it, and the small routes' decoders (/tokenize,
 * /detokenize, /apply-template, a session path). The shapes' own fields
 * are in api_decode_openai.c, api_decode_llama.c and api_decode_chat.c.
 *
 * A decoder does only what is cheap and needs no model: types, ranges,
 * token ids against n_vocab, and the byte bound. The byte bound: no token
 * stands for more than lim->max_token_bytes bytes of text, so a text of
 * len bytes makes at least ceil(len / max_token_bytes) tokens; a prompt
 * whose texts already make more than max_prompt_tokens that way is
 * refused here, before anything is tokenized (an 8 MiB prompt is turned
 * away in the time it takes to parse it).
 */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"

/* ------------------------------------------------------------------------
 * The prompt as given
 * ------------------------------------------------------------------------ */

static int grow(void **p, int *cap, int need, size_t elem)
{
    if (need <= *cap)
        return 0;
    int c = *cap ? *cap : 8;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, elem * (size_t)c);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int add_text(struct srv_prompt *p, const char *text, size_t len, bool bos,
                    struct srv_api_error *e)
{
    if (grow((void **)&p->parts, &p->cap_parts, p->n_parts + 1, sizeof(*p->parts)))
        return srv_oom(e, "reading the prompt");
    p->parts[p->n_parts++] = (struct srv_prompt_part){.text = text, .len = len, .bos = bos};
    return 0;
}

/* Append one token id (checked against the vocabulary) to the prompt's
 * last run of ids, starting a run after a text. */
static int add_id(const struct srv_api_limits *lim, struct srv_prompt *p, const json_t *v,
                  const char *param, struct srv_api_error *e)
{
    if (!json_is_integer(v))
        return srv_fail(e, param, "invalid_type",
                        "'%s' must be a string or an array of token ids; found %s", param,
                        srv_json_type_name(v));
    long long id = json_integer_value(v);
    if (id < 0 || id >= lim->n_vocab)
        return srv_fail(e, param, "invalid_token",
                        "token id %lld is outside the vocabulary (0..%d)", id, lim->n_vocab - 1);
    if (p->n_parts == 0 || p->parts[p->n_parts - 1].text) {
        if (grow((void **)&p->parts, &p->cap_parts, p->n_parts + 1, sizeof(*p->parts)))
            return srv_oom(e, "reading the prompt");
        p->parts[p->n_parts++] = (struct srv_prompt_part){0};
    }
    if (grow((void **)&p->ids, &p->cap_ids, p->n_ids + 1, sizeof(*p->ids)))
        return srv_oom(e, "reading the prompt");
    p->ids[p->n_ids++] = (int32_t)id;
    p->parts[p->n_parts - 1].n_ids++;
    return 0;
}

/*
 * The prompt: a string, an array of token ids, or a one-element array of
 * either (a batch of prompts is refused: n > 1 is not supported). llama.cpp
 * style also allows a mixed array of strings and ids. Strings get the
 * model's BOS when it wants one; token arrays are taken as they are.
 */
static int decode_prompt(const struct srv_api_limits *lim, const json_t *body, bool mixed,
                         struct srv_prompt *out, struct srv_api_error *e)
{
    json_t *p = srv_field(body, "prompt");
    if (!p)
        return srv_fail(e, "prompt", "missing_field", "'prompt' is required");
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    if (json_is_string(p))
        return add_text(out, json_string_value(p), json_string_length(p), true, e);
    if (!json_is_array(p))
        return srv_fail(e, "prompt", "invalid_type",
                        "'prompt' must be a string or an array of token ids, not %s",
                        srv_json_type_name(p));
    size_t i;
    json_t *v;
    json_array_foreach(p, i, v)
    {
        if (json_is_string(v)) {
            if (!mixed)
                return srv_fail(e, "prompt", "unsupported",
                                "several prompts in one request are not supported (n > 1): "
                                "send one request per prompt");
            if (add_text(out, json_string_value(v), json_string_length(v), i == 0, e))
                return -1;
        } else if (json_is_array(v)) {
            return srv_fail(e, "prompt", "unsupported",
                            "several prompts in one request are not supported (n > 1): send "
                            "one request per prompt");
        } else if (add_id(lim, out, v, "prompt", e)) {
            return -1;
        }
    }
    return 0;
}

/* The byte bound (see the top of this file): refuse a prompt whose texts
 * alone make too many tokens, before any is tokenized. */
static int check_prompt_bytes(const struct srv_api_limits *lim, const struct srv_prompt *p,
                              struct srv_api_error *e)
{
    if (lim->max_token_bytes <= 0)
        return 0;
    long long least = p->n_ids;
    for (int i = 0; i < p->n_parts; i++)
        if (p->parts[i].text)
            least += (long long)((p->parts[i].len + (size_t)lim->max_token_bytes - 1) /
                                 (size_t)lim->max_token_bytes);
    if (least <= lim->max_prompt_tokens &&
        (lim->policy.kind != KV_EVICT_NONE || least <= lim->policy.max_cache_tokens))
        return 0;
    return srv_prompt_fits(lim, least > INT32_MAX ? INT32_MAX : (int)least, "at least ", e);
}

/* stop: a string or an array of strings. */
static int decode_stop(const json_t *body, struct engine_req *r, struct srv_api_error *e)
{
    json_t *s = srv_field(body, "stop");
    if (!s)
        return 0;
    json_t *one = json_is_string(s) ? s : NULL;
    if (!one && !json_is_array(s))
        return srv_fail(e, "stop", "invalid_type",
                        "'stop' must be a string or an array of strings");
    size_t n = one ? 1 : json_array_size(s);
    if (n > SRV_MAX_STOP)
        return srv_fail(e, "stop", "invalid_value",
                        "'stop' has %zu strings; at most %d are allowed", n, SRV_MAX_STOP);
    r->stop = calloc(n ? n : 1, sizeof(char *));
    if (!r->stop)
        return srv_oom(e, "reading 'stop'");
    for (size_t i = 0; i < n; i++) {
        json_t *v = one ? one : json_array_get(s, i);
        if (!json_is_string(v))
            return srv_fail(e, "stop", "invalid_type", "'stop' must contain only strings");
        size_t len = json_string_length(v);
        if (len == 0)
            continue; /* an empty stop string can never match: ignore it */
        if (len > SRV_MAX_STOP_BYTES || strlen(json_string_value(v)) != len)
            return srv_fail(e, "stop", "invalid_value",
                            "stop strings must be 1..%d bytes without NUL characters",
                            SRV_MAX_STOP_BYTES);
        r->stop[r->n_stop] = strdup(json_string_value(v));
        if (!r->stop[r->n_stop])
            return srv_oom(e, "reading 'stop'");
        r->n_stop++;
    }
    return 0;
}

/*
 * The session id: the "session" field, or the X-Session-Id header (hdr,
 * NULL when absent), or both when they agree. Sets r->session (new) or
 * records the first problem in e.
 */
static void decode_session(const struct srv_api_limits *lim, const json_t *body, const char *hdr,
                           struct engine_req *r, struct srv_api_error *e)
{
    const char *sess = NULL;
    size_t max = (size_t)lim->max_session_id;
    if (srv_get_str(body, "session", &sess, e) > 0 && !srv_session_id_ok(sess, max)) {
        srv_fail(e, "session", "invalid_value",
                 "'session' must be 1..%d characters of A-Z a-z 0-9 . _ : -", lim->max_session_id);
        return;
    }
    if (hdr) {
        if (!srv_session_id_ok(hdr, max)) {
            srv_fail(e, "X-Session-Id", "invalid_value",
                     "the X-Session-Id header must be 1..%d characters of A-Z a-z 0-9 . _ : -",
                     lim->max_session_id);
            return;
        }
        if (sess && strcmp(sess, hdr) != 0) {
            srv_fail(e, "session", "session_mismatch",
                     "the X-Session-Id header ('%s') and the 'session' field ('%s') name "
                     "different sessions; send one id, or the same in both",
                     hdr, sess);
            return;
        }
        sess = hdr;
    }
    if (sess && !e->status && (r->session = strdup(sess)) == NULL)
        srv_oom(e, "reading the session id");
}

/*
 * Pinned spans: llama.cpp's n_keep (pin the first n prompt tokens; -1 the
 * whole prompt) and kvd's "keep": [[start, end], ...], prompt token indices
 * with end excluded (engine/pins.c says what they refer to in a session).
 * The pins' sizes are checked against the budget here, from the numbers
 * alone (kv_pins_fit, the cache's own rule); what needs the prompt (n_keep
 * -1, a range past its end) and the session's earlier pins is checked at
 * admission, still before any work.
 */
static void decode_pins(const struct srv_api_limits *lim, const json_t *body,
                        struct engine_req *r, struct srv_api_error *e)
{
    long long n;
    if (srv_get_int(body, "n_keep", -1, 1 << 30, &n, e) > 0)
        r->n_keep = (int)n;
    const json_t *keep = srv_field(body, "keep");
    if (e->status || (!keep && r->n_keep <= 0))
        return;
    if (keep && (!json_is_array(keep) || json_array_size(keep) > ENGINE_MAX_KEEP)) {
        srv_fail(e, "keep", "invalid_value",
                 "'keep' must be an array of at most %d [start, end] pairs of prompt token "
                 "indices (end excluded)",
                 ENGINE_MAX_KEEP);
        return;
    }
    size_t k = keep ? json_array_size(keep) : 0;
    struct kv_span v[ENGINE_MAX_KEEP + 1];
    for (size_t i = 0; i < k; i++) {
        const json_t *p = json_array_get(keep, i);
        const json_t *a = json_array_get(p, 0), *b = json_array_get(p, 1);
        if (!json_is_array(p) || json_array_size(p) != 2 || !json_is_integer(a) ||
            !json_is_integer(b) || json_integer_value(a) < 0 ||
            json_integer_value(b) <= json_integer_value(a) || json_integer_value(b) > (1 << 30)) {
            srv_fail(e, "keep", "invalid_value",
                     "keep[%zu] must be [start, end] with 0 <= start < end <= %d (prompt token "
                     "indices, end excluded)",
                     i, 1 << 30);
            return;
        }
        v[i] = (struct kv_span){(int32_t)json_integer_value(a), (int32_t)json_integer_value(b)};
    }
    if (k > 0 && !(r->keep = malloc(sizeof(*v) * k))) {
        srv_oom(e, "reading 'keep'");
        return;
    }
    if (k > 0)
        memcpy(r->keep, v, sizeof(*v) * k);
    r->n_keep_ranges = (int)k;
    if (r->n_keep > 0)
        v[k++] = (struct kv_span){0, r->n_keep};
    char why[400];
    struct kv_policy eff;
    int m = kv_spans_normalize(v, (int)k, why, sizeof(why));
    if (m >= 0 && kv_pins_fit(&lim->policy, lim->page_tokens, v, m, &eff, why, sizeof(why)) == 0)
        return;
    srv_fail(e, keep ? "keep" : "n_keep", "pins_exceed_budget", "%s", why);
}

/* ------------------------------------------------------------------------
 * Fields the shapes share (api_decode_internal.h)
 * ------------------------------------------------------------------------ */

void srv_decode_common(const struct srv_api_limits *lim, const json_t *body,
                       const char *hdr_session, struct engine_req *r, struct srv_api_error *e)
{
    double d;
    long long i;
    if (srv_get_num(body, "temperature", 0, 100, &d, e) > 0)
        r->sampling.temperature = (float)d;
    if (srv_get_num(body, "top_p", 0, 1, &d, e) > 0)
        r->sampling.top_p = (float)d;
    if (srv_get_int(body, "top_k", 0, 1 << 30, &i, e) > 0)
        r->sampling.top_k = (int)i;
    if (srv_get_num(body, "min_p", 0, 1, &d, e) > 0)
        r->sampling.min_p = (float)d;
    if (srv_get_num(body, "presence_penalty", -2, 2, &d, e) > 0)
        r->sampling.presence_penalty = (float)d;
    if (srv_get_num(body, "frequency_penalty", -2, 2, &d, e) > 0)
        r->sampling.frequency_penalty = (float)d;
    decode_session(lim, body, hdr_session, r, e);
    decode_stop(body, r, e);
    decode_pins(lim, body, r, e);
    srv_get_bool(body, "ignore_eos", &r->ignore_eos, e);
}

int srv_decode_top_n(const struct srv_api_limits *lim, const json_t *body, const char *key,
                     int *out, struct srv_api_error *e)
{
    long long n;
    int rc = srv_get_int(body, key, INT64_MIN, INT64_MAX, &n, e);
    if (rc <= 0)
        return rc;
    int lim_n = lim->n_vocab < ENGINE_MAX_TOP_LOGPROBS ? lim->n_vocab : ENGINE_MAX_TOP_LOGPROBS;
    if (n < 0 || n > lim_n)
        return srv_fail(e, key, "invalid_value",
                        "'%s' must be between 0 and %d (the vocabulary has %d tokens; kvd returns "
                        "at most %d alternatives per token) (got %lld)",
                        key, lim_n, lim->n_vocab, ENGINE_MAX_TOP_LOGPROBS, n);
    *out = (int)n;
    return 1;
}

void srv_decode_logprob_work(const struct engine_req *r, bool stream, const char *param,
                             struct srv_api_error *e)
{
    if (!r->want_logprobs || stream)
        return;
    int n = r->n_choices > 1 ? r->n_choices : 1;
    long long entries = (long long)n * r->max_tokens * (r->n_top_logprobs + 1);
    if (entries > ENGINE_MAX_LOGPROB_ENTRIES)
        srv_fail(e, param, "invalid_value",
                 "%d choices of %d tokens with %d alternatives each make %lld log-probability "
                 "entries; a non-streamed answer may have at most %d (choices x tokens x "
                 "(alternatives + 1)): ask for fewer choices, tokens or alternatives, or stream",
                 n, r->max_tokens, r->n_top_logprobs, entries, ENGINE_MAX_LOGPROB_ENTRIES);
}

int srv_decode_prompt(const struct srv_api_limits *lim, const json_t *body, bool mixed,
                      struct srv_prompt *out, struct srv_api_error *e)
{
    if (decode_prompt(lim, body, mixed, out, e))
        return -1;
    return check_prompt_bytes(lim, out, e);
}

int srv_decode_max_tokens(const struct srv_api_limits *lim, const json_t *body, const char *key,
                          struct engine_req *r, struct srv_api_error *e)
{
    long long i = 0;
    json_t *mt = srv_field(body, key);
    if (mt && json_is_integer(mt) && json_integer_value(mt) > lim->max_tokens &&
        json_integer_value(mt) <= (1ll << 40))
        return srv_fail(e, key, "invalid_value", "%s (%lld) exceeds the limit of %d", key,
                        (long long)json_integer_value(mt), lim->max_tokens);
    if (srv_get_int(body, key, 0, lim->max_tokens, &i, e) > 0)
        r->max_tokens = (int)i;
    return e->status ? -1 : 0;
}

void srv_decode_choices(const struct srv_api_limits *lim, const json_t *body, bool max_given,
                        struct engine_req *r, struct srv_api_error *e)
{
    long long i = 0;
    json_t *v = srv_field(body, "n");
    if (v && json_is_integer(v) && json_integer_value(v) > lim->max_choices) {
        srv_fail(e, "n", "invalid_value",
                 "n (%lld) exceeds the limit of %d choices per request ([limits] max_choices)",
                 (long long)json_integer_value(v), lim->max_choices);
        return;
    }
    if (srv_get_int(body, "n", 1, lim->max_choices > 1 ? lim->max_choices : 1, &i, e) <= 0 ||
        i == 1)
        return;
    r->n_choices = (int)i;
    /* Every choice generates up to max_tokens: the request's work is n x that. */
    if (!max_given) {
        int share = lim->max_tokens / r->n_choices;
        if (r->max_tokens > share)
            r->max_tokens = share > 0 ? share : 1;
    } else if (i * r->max_tokens > lim->max_tokens) {
        srv_fail(e, "n", "invalid_value",
                 "n (%d) x max_tokens (%d) = %lld tokens exceeds the limit of %d tokens one "
                 "request may generate ([limits] max_tokens)",
                 r->n_choices, r->max_tokens, i * r->max_tokens, lim->max_tokens);
    }
}

void srv_decode_openai_sampling(const struct srv_api_limits *lim, struct engine_req *r)
{
    model_sampling_defaults(&r->sampling);
    r->sampling.temperature = 1.0f;
    r->sampling.top_k = 0;
    r->sampling.top_p = 1.0f;
    r->sampling.min_p = 0.0f;
    r->sampling.repeat_penalty = 1.0f;
    r->sampling.seed = lim->seed;
}

void srv_decode_openai_shared(const json_t *body, struct engine_req *r, struct srv_completion *c,
                              struct srv_api_error *e)
{
    long long i;
    const char *s;
    if (srv_get_int(body, "seed", INT64_MIN, INT64_MAX, &i, e) > 0)
        r->sampling.seed = (uint64_t)i;
    srv_get_bool(body, "stream", &c->stream, e);
    json_t *so = srv_field(body, "stream_options");
    if (so) {
        if (!json_is_object(so))
            srv_fail(e, "stream_options", "invalid_type", "'stream_options' must be an object");
        else
            srv_get_bool(so, "include_usage", &c->include_usage, e);
    }
    if (srv_get_str(body, "user", &s, e) > 0 && strlen(s) > 256)
        srv_fail(e, "user", "invalid_value", "'user' is longer than 256 bytes");
    srv_get_str(body, "model", &s, e);
}

void srv_decode_no_logit_bias(const json_t *body, struct srv_api_error *e)
{
    json_t *lb = srv_field(body, "logit_bias");
    if (lb && (!json_is_object(lb) || json_object_size(lb) > 0))
        srv_fail(e, "logit_bias", "unsupported", "logit_bias is not supported");
}

/* ------------------------------------------------------------------------
 * Completions
 * ------------------------------------------------------------------------ */

int srv_decode_start(enum srv_api_shape shape, json_t *body, struct srv_completion *out,
                     struct srv_api_error *e)
{
    memset(out, 0, sizeof(*out));
    out->shape = shape;
    out->body = json_incref(body);
    out->req = engine_req_new(ENGINE_REQ_COMPLETION);
    return out->req ? 0 : srv_oom(e, "accepting the request");
}

void srv_completion_clear(struct srv_completion *c)
{
    engine_req_free(c->req);
    free(c->prompt.parts);
    free(c->prompt.ids);
    json_decref(c->body);
    json_decref(c->settings);
    memset(c, 0, sizeof(*c));
}

/* ------------------------------------------------------------------------
 * The small routes
 * ------------------------------------------------------------------------ */

json_t *srv_decode_body(const char *data, size_t len, struct srv_api_error *e)
{
    json_error_t je;
    json_t *body = json_loadb(data, len, JSON_REJECT_DUPLICATES, &je);
    if (!body) {
        if (len == 0)
            srv_fail(e, NULL, "invalid_json", "the request body is empty; send a JSON object");
        else if (json_error_code(&je) == json_error_invalid_utf8)
            srv_fail(e, NULL, "invalid_utf8", "the request body is not valid UTF-8 (byte %d)",
                     je.position);
        else
            srv_fail(e, NULL, "invalid_json",
                     "the request body is not valid JSON: %s (line %d, column %d)", je.text,
                     je.line, je.column);
        return NULL;
    }
    if (!json_is_object(body)) {
        srv_fail(e, NULL, "invalid_json", "the request body must be a JSON object, not %s",
                 srv_json_type_name(body));
        json_decref(body);
        return NULL;
    }
    return body;
}

int srv_decode_tokenize(const struct srv_api_limits *lim, json_t *body,
                        struct srv_tokenize_req *out, struct srv_api_error *e)
{
    (void)lim;
    memset(out, 0, sizeof(*out));
    if (srv_get_str(body, "content", &out->text, e) == 0)
        srv_fail(e, "content", "missing_field", "'content' (the text to tokenize) is required");
    srv_get_bool(body, "add_special", &out->add_special, e);
    srv_get_bool(body, "with_pieces", &out->with_pieces, e);
    if (e->status) {
        memset(out, 0, sizeof(*out));
        return -1;
    }
    out->len = json_string_length(json_object_get(body, "content"));
    out->body = json_incref(body);
    return 0;
}

void srv_tokenize_req_clear(struct srv_tokenize_req *t)
{
    json_decref(t->body);
    memset(t, 0, sizeof(*t));
}

int srv_decode_detokenize(const struct srv_api_limits *lim, json_t *body,
                          struct srv_detokenize_req *out, struct srv_api_error *e)
{
    memset(out, 0, sizeof(*out));
    json_t *arr = srv_field(body, "tokens");
    if (!arr)
        return srv_fail(e, "tokens", "missing_field",
                        "'tokens' (an array of token ids) is required");
    if (!json_is_array(arr))
        return srv_fail(e, "tokens", "invalid_type",
                        "'tokens' must be an array of token ids, not %s", srv_json_type_name(arr));
    struct srv_prompt p = {0};
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v)
    {
        if (!json_is_integer(v)) {
            srv_fail(e, "tokens", "invalid_type",
                     "'tokens' must contain only token ids (integers); element %zu is %s", i,
                     srv_json_type_name(v));
            break;
        }
        if (add_id(lim, &p, v, "tokens", e))
            break;
    }
    free(p.parts);
    if (e->status) {
        free(p.ids);
        return -1;
    }
    out->ids = p.ids;
    out->n = p.n_ids;
    out->cap = p.cap_ids;
    return 0;
}

void srv_detokenize_req_clear(struct srv_detokenize_req *t)
{
    free(t->ids);
    memset(t, 0, sizeof(*t));
}

int srv_decode_session_path(const struct srv_api_limits *lim, const char *id, const char *hdr,
                            struct srv_api_error *e)
{
    if (!srv_session_id_ok(id, (size_t)lim->max_session_id))
        return srv_fail(e, "session", NULL,
                        "bad session id: 1..%d characters of A-Z a-z 0-9 . _ : -",
                        lim->max_session_id);
    if (hdr && strcmp(hdr, id) != 0)
        return srv_fail(e, "session", "session_mismatch",
                        "the X-Session-Id header names another session than the path");
    return 0;
}
