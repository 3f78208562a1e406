/*
 * api.c - kvd's HTTP API: routes, JSON in and out, validation, the OpenAI
 * and llama.cpp shapes, OpenAI-shaped errors.
 *
 * Everything here runs on the loop thread, which owns every json_t. A
 * completion request is parsed and validated here, its prompt is
 * tokenized here (the model is immutable once loaded, and doing it on the
 * loop thread answers "prompt too long" and "token id outside the
 * vocabulary" before anything is queued, and keeps the engine's steps for
 * the model), and it leaves as a plain struct engine_req. The engine answers
 * with events; srv_api_pump turns them into a JSON body, or into Server-Sent
 * Events as they come for streams.
 *
 * Two request shapes share the engine:
 *   POST /v1/completions  OpenAI: prompt, max_tokens, temperature, top_p,
 *                         stop, stream, seed, ... ; choices[].text, usage
 *                         (plus usage.kvd: cached, evicted, retained tokens)
 *   POST /completion      llama.cpp: prompt, n_predict, ... ; content,
 *                         stop, tokens_predicted, tokens_evaluated, timings
 * Both report log-probabilities when asked (OpenAI logprobs, llama.cpp
 * n_probs): the engine sends each sampled token's numbers with its text
 * event, and they are shaped here as each API does.
 * Both accept kvd's own "session": a string id whose cache persists. The
 * same id may come in the X-Session-Id header instead, so a load balancer
 * can keep a session on one replica without parsing bodies; when both are
 * given they must agree (400 otherwise).
 *
 * Beside them, llama.cpp's token routes, which let a client build prompts
 * of an exact length (kvd load does):
 *   POST /tokenize    {"content", "add_special", "with_pieces"} -> {"tokens"}
 *   POST /detokenize  {"tokens"} -> {"content"}
 *
 * Errors are {"error":{"message","type","param","code"}} with the status
 * chosen in one place (api_error), whatever the route.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "server/api.h"
#include "server/chat_template.h"
#include "server/chat_turns.h"
#include "server/errors.h"
#include "server/log.h"
#include "server/route_map.h"
#include "server/web.h"

/* Compact output; 15 significant digits print 0.95f's double as 0.95. */
#define JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

#define MAX_STOP 16
#define MAX_STOP_BYTES 512

enum call_kind {
    CALL_OPENAI,
    CALL_LLAMA,
    CALL_CHAT,
    CALL_SESSION_GET,
    CALL_SESSION_DELETE,
    CALL_SESSION_MAP
};

/* One accepted request waiting for the engine (loop thread only). */
struct call {
    srv_api *a;
    srv_conn *conn;      /* NULL once the client left */
    struct engine_req *req; /* owned; freed at the final event */
    enum call_kind kind;
    bool stream;
    bool include_usage; /* OpenAI stream_options.include_usage */
    bool return_tokens; /* llama.cpp return_tokens */
    bool started;       /* stream headers sent */
    char id[48];
    int64_t created;
    char *text; /* non-streamed: the text so far */
    size_t len, cap;
    int32_t *toks; /* llama.cpp return_tokens */
    int n_toks, cap_toks;
    json_t *settings; /* llama.cpp generation_settings (owned) */
    bool logprobs;    /* OpenAI logprobs / llama.cpp n_probs asked for */
    bool id_tokens;   /* OpenAI return_tokens_as_token_ids: "token_id:ID" strings */
    json_t *lp;       /* non-streamed: the OpenAI logprobs object, or llama.cpp's
                         completion_probabilities array (owned) */
    size_t lp_chars;  /* OpenAI text_offset of the next token, in code points */
    bool role_sent;       /* chat stream: the first chunk (delta.role) went out */
    int evicted_messages; /* chat: messages of the conversation not in the prompt */
    const char *turn_eviction; /* chat, unit = turn: "in_place" or "rerender" */
    char turn_fallback[240];   /* chat on a session: why its turns were rendered
                                  again instead of evicted in place ("" if they were not) */
    int cut_tokens;            /* chat: tokens cut from the middle of a last turn larger
                                  than the window */
    bool max_tokens_given; /* chat: the request set max_tokens / max_completion_tokens */
    struct call *prev, *next;
};

/* What a chat session's earlier requests decided: how many of the
 * conversation's oldest turns (and messages) its prompt leaves out. */
struct chat_sess {
    char *id;
    int dropped_turns, dropped_messages;
    bool fallback_logged; /* its first fallback to rendering was logged */
    struct chat_sess *next;
};
#define MAX_CHAT_SESSIONS 4096

struct srv_api {
    srv_sched *sched;
    srv_metrics *metrics;
    struct srv_api_params p;
    char api_key[512];
    const model *m;
    struct model_info info;
    char model_name[256];
    int64_t ready_time;
    bool draining;
    int in_flight;
    uint64_t next_id;
    uint64_t seed_state;
    struct call *calls;
    /* For the text of a token on its own (alternatives in logprobs). */
    model_detok *piece_detok;
    char *piece_buf;
    size_t piece_cap;
    /* Chat: the template (loaded when the model is), or why there is none. */
    char chat_path[1024];
    tpl_chat *chat;
    char chat_err[700];
    int32_t eot_token;      /* the template's end of turn as a control token, or -1 */
    struct chat_sess *chat_sess; /* most recently used first */
    int n_chat_sess;
    char *config_json; /* GET /v1/config (owned), or NULL */
};

/* ------------------------------------------------------------------------
 * Errors and responses
 * ------------------------------------------------------------------------ */

/* Answer an error (logged at debug; the client made it). */
static void api_error_code(srv_conn *c, int status, const char *param, const char *code,
                           const char *extra, const char *fmt, ...)
    __attribute__((format(printf, 6, 7)));

static void api_error_code(srv_conn *c, int status, const char *param, const char *code,
                           const char *extra, const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *body = srv_error_json(status, msg, param, code, &len);
    srv_log(SRV_LOG_DEBUG, "api: %d %s", status, msg);
    srv_http_respond(c, status, "application/json", extra ? extra : "", body ? body : "",
                     body ? len : 0);
    free(body);
}

#define api_error(c, status, param, ...) api_error_code(c, status, param, NULL, NULL, __VA_ARGS__)

/* Answer a JSON value (stolen). */
static void respond_json(srv_conn *c, int status, json_t *v)
{
    char *s = v ? json_dumps(v, JSON_FLAGS) : NULL;
    json_decref(v);
    if (!s) {
        api_error(c, 500, NULL, "out of memory building the response");
        return;
    }
    srv_http_respond(c, status, "application/json", "", s, strlen(s));
    free(s);
}

/* A JSON string from bytes that should be UTF-8; invalid bytes become
 * U+FFFD so a model that emits garbage never breaks a response. */
static json_t *json_text(const char *s, size_t n)
{
    json_t *v = json_stringn(s, n);
    if (v)
        return v;
    char *fixed = malloc(n * 3 + 1);
    if (!fixed)
        return json_string("");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + (size_t)k] >> 6) == 2;
        if (ok && len > 1) {
            json_t *t = json_stringn(s + i, (size_t)len); /* overlong / surrogate check */
            ok = t != NULL;
            json_decref(t);
        }
        if (ok && c != 0) {
            memcpy(fixed + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(fixed + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    v = json_stringn(fixed, o);
    free(fixed);
    return v ? v : json_string("");
}

/* ------------------------------------------------------------------------
 * Field validation
 * ------------------------------------------------------------------------ */

/* A validation failure: the first one is reported. */
struct verr {
    int status;
    char param[64];
    const char *code;
    char msg[512];
};

__attribute__((format(printf, 4, 5))) static int fail(struct verr *e, const char *param,
                                                      const char *code, const char *fmt, ...)
{
    if (e->status)
        return -1;
    e->status = 400;
    snprintf(e->param, sizeof(e->param), "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    return -1;
}

/* Memory ran out while reading the request: 503, and the server lives on. */
static int oom(struct verr *e, const char *what)
{
    if (e->status)
        return -1;
    e->status = 503;
    e->param[0] = '\0';
    e->code = "out_of_memory";
    snprintf(e->msg, sizeof(e->msg), "out of memory %s; retry later", what);
    return -1;
}

static const char *json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        return "null";
    }
    return "?";
}

/* The field, or NULL when absent or null. */
static json_t *field(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

/* Integer field in [min, max]; returns 1 if present, 0 if absent, -1 bad. */
static int get_int(json_t *o, const char *key, long long min, long long max, long long *out,
                   struct verr *e)
{
    json_t *v = field(o, key);
    if (!v)
        return 0;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v);
    } else {
        return fail(e, key, "invalid_type", "'%s' must be an integer, not %s", key,
                    json_type_name(v));
    }
    if (x < min || x > max)
        return fail(e, key, "invalid_value", "'%s' must be between %lld and %lld (got %lld)", key,
                    min, max, x);
    *out = x;
    return 1;
}

static int get_num(json_t *o, const char *key, double min, double max, double *out, struct verr *e)
{
    json_t *v = field(o, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return fail(e, key, "invalid_type", "'%s' must be a number, not %s", key,
                    json_type_name(v));
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return fail(e, key, "invalid_value", "'%s' must be between %g and %g (got %g)", key, min,
                    max, x);
    *out = x;
    return 1;
}

static int get_bool(json_t *o, const char *key, bool *out, struct verr *e)
{
    json_t *v = field(o, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return fail(e, key, "invalid_type", "'%s' must be a boolean, not %s", key,
                    json_type_name(v));
    *out = json_is_true(v);
    return 1;
}

static int get_str(json_t *o, const char *key, const char **out, struct verr *e)
{
    json_t *v = field(o, key);
    if (!v)
        return 0;
    if (!json_is_string(v))
        return fail(e, key, "invalid_type", "'%s' must be a string, not %s", key,
                    json_type_name(v));
    *out = json_string_value(v);
    return 1;
}

/* ------------------------------------------------------------------------
 * Prompts
 * ------------------------------------------------------------------------ */

struct toks {
    int32_t *v;
    int n, cap;
};

/* Append ids; -1 (nothing appended) when memory runs out. Nothing to
 * append is done at once: t->v may still be NULL (an empty /tokenize
 * content), and NULL + 0 is undefined. */
static int toks_push(struct toks *t, const int32_t *ids, int n)
{
    if (n == 0)
        return 0;
    if (t->n + n > t->cap) {
        int cap = t->cap ? t->cap : 64;
        while (cap < t->n + n)
            cap *= 2;
        int32_t *p = realloc(t->v, sizeof(int32_t) * (size_t)cap);
        if (!p)
            return -1;
        t->v = p;
        t->cap = cap;
    }
    memcpy(t->v + t->n, ids, sizeof(int32_t) * (size_t)n);
    t->n += n;
    return 0;
}

static int tokenize_into(srv_api *a, const char *text, size_t len, bool bos, struct toks *t,
                         struct verr *e)
{
    int cap = (int)(len < 64 ? 64 : len + 8);
    int32_t *buf = malloc(sizeof(int32_t) * (size_t)cap);
    if (!buf)
        return oom(e, "tokenizing the prompt");
    int n = model_tokenize(a->m, text, len, bos, buf, cap);
    if (n > cap) {
        int32_t *b2 = realloc(buf, sizeof(int32_t) * (size_t)n);
        if (!b2) {
            free(buf);
            return oom(e, "tokenizing the prompt");
        }
        buf = b2;
        n = model_tokenize(a->m, text, len, bos, buf, n);
    }
    if (n < 0) {
        free(buf);
        return fail(e, "prompt", "invalid_value", "the prompt cannot be tokenized (error %d)", n);
    }
    int rc = toks_push(t, buf, n);
    free(buf);
    return rc ? oom(e, "reading the prompt") : 0;
}

static int push_token(srv_api *a, json_t *v, const char *param, struct toks *t, struct verr *e)
{
    if (!json_is_integer(v))
        return fail(e, param, "invalid_type",
                    "'%s' must be a string or an array of token ids; found %s", param,
                    json_type_name(v));
    long long id = json_integer_value(v);
    if (id < 0 || id >= a->info.n_vocab)
        return fail(e, param, "invalid_token", "token id %lld is outside the vocabulary (0..%d)",
                    id, a->info.n_vocab - 1);
    int32_t x = (int32_t)id;
    return toks_push(t, &x, 1) ? oom(e, "reading the prompt") : 0;
}

/*
 * One step of a streaming decode: the text of token *id (or, with id NULL,
 * what the stream still holds) appended at (*buf)[len], growing *buf (caller
 * frees; *cap its size). Returns the bytes appended, or -1 when memory runs
 * out (ids are checked against the vocabulary before they get here).
 */
static int detok_step(model_detok *d, const int32_t *id, char **buf, size_t *cap, size_t len)
{
    for (;;) {
        char *out = *buf ? *buf + len : NULL;
        size_t room = *buf ? *cap - len : 0;
        int w = id ? model_detok_push(d, *id, out, room) : model_detok_flush(d, out, room);
        if (w != -ENOSPC)
            return w < 0 ? -1 : w;
        size_t ncap = *cap ? *cap * 2 : 256;
        char *nb = realloc(*buf, ncap);
        if (!nb)
            return -1;
        *buf = nb;
        *cap = ncap;
    }
}

/*
 * The text of ids[0..n) as a completion streams it, into *buf as in
 * detok_step. Returns the byte count, or -1 when memory runs out.
 */
static int decode(srv_api *a, const int32_t *ids, int n, char **buf, size_t *cap)
{
    model_detok *d = model_detok_create(a->m);
    if (!d)
        return -1;
    size_t len = 0;
    int w = 0;
    for (int i = 0; i <= n && w >= 0; i++) {
        w = detok_step(d, i < n ? &ids[i] : NULL, buf, cap, len);
        if (w >= 0)
            len += (size_t)w;
    }
    model_detok_destroy(d);
    return w < 0 || len > INT32_MAX ? -1 : (int)len;
}

/*
 * The prompt: a string, an array of token ids, or a one-element array of
 * either (a batch of prompts is refused: n > 1 is not supported). llama.cpp
 * style also allows a mixed array of strings and ids. Strings get the
 * model's BOS when it wants one; token arrays are taken as they are.
 */
static int parse_prompt(srv_api *a, json_t *body, bool mixed, struct toks *t, struct verr *e)
{
    json_t *p = field(body, "prompt");
    if (!p)
        return fail(e, "prompt", "missing_field", "'prompt' is required");
    if (json_is_array(p) && json_array_size(p) == 1 &&
        (json_is_string(json_array_get(p, 0)) || json_is_array(json_array_get(p, 0))))
        p = json_array_get(p, 0);
    if (json_is_string(p))
        return tokenize_into(a, json_string_value(p), json_string_length(p), model_add_bos(a->m), t,
                             e);
    if (!json_is_array(p))
        return fail(e, "prompt", "invalid_type",
                    "'prompt' must be a string or an array of token ids, not %s",
                    json_type_name(p));
    size_t i;
    json_t *v;
    json_array_foreach(p, i, v)
    {
        if (json_is_string(v)) {
            if (!mixed)
                return fail(e, "prompt", "unsupported",
                            "several prompts in one request are not supported (n > 1): send "
                            "one request per prompt");
            if (tokenize_into(a, json_string_value(v), json_string_length(v),
                              i == 0 && model_add_bos(a->m), t, e))
                return -1;
        } else if (json_is_array(v)) {
            return fail(e, "prompt", "unsupported",
                        "several prompts in one request are not supported (n > 1): send one "
                        "request per prompt");
        } else if (push_token(a, v, "prompt", t, e)) {
            return -1;
        }
    }
    return 0;
}

/* stop: a string or an array of strings. */
static int parse_stop(json_t *body, struct engine_req *r, struct verr *e)
{
    json_t *s = field(body, "stop");
    if (!s)
        return 0;
    json_t *one = json_is_string(s) ? s : NULL;
    if (!one && !json_is_array(s))
        return fail(e, "stop", "invalid_type", "'stop' must be a string or an array of strings");
    size_t n = one ? 1 : json_array_size(s);
    if (n > MAX_STOP)
        return fail(e, "stop", "invalid_value", "'stop' has %zu strings; at most %d are allowed", n,
                    MAX_STOP);
    r->stop = calloc(n ? n : 1, sizeof(char *));
    if (!r->stop)
        return oom(e, "reading 'stop'");
    for (size_t i = 0; i < n; i++) {
        json_t *v = one ? one : json_array_get(s, i);
        if (!json_is_string(v))
            return fail(e, "stop", "invalid_type", "'stop' must contain only strings");
        size_t len = json_string_length(v);
        if (len == 0)
            continue; /* an empty stop string can never match: ignore it */
        if (len > MAX_STOP_BYTES || strlen(json_string_value(v)) != len)
            return fail(e, "stop", "invalid_value",
                        "stop strings must be 1..%d bytes without NUL characters", MAX_STOP_BYTES);
        r->stop[r->n_stop] = strdup(json_string_value(v));
        if (!r->stop[r->n_stop])
            return oom(e, "reading 'stop'");
        r->n_stop++;
    }
    return 0;
}

static bool session_id_ok(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n == 0 || n > max)
        return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.' || c == ':'))
            return false;
    }
    return true;
}

static uint64_t next_seed(srv_api *a)
{
    /* splitmix64 over a state seeded from the clock at start */
    uint64_t z = (a->seed_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) >> 1; /* 63 bits: prints as a positive JSON integer */
}

/* ------------------------------------------------------------------------
 * Building a completion request
 * ------------------------------------------------------------------------ */

/*
 * The session id: the "session" field, or the X-Session-Id header (hdr,
 * NULL when absent), or both when they agree. Sets r->session (new) or
 * records the first problem in e.
 */
static void parse_session(srv_api *a, json_t *body, const char *hdr, struct engine_req *r,
                          struct verr *e)
{
    const char *sess = NULL;
    if (get_str(body, "session", &sess, e) > 0 &&
        !session_id_ok(sess, (size_t)a->p.max_session_id)) {
        fail(e, "session", "invalid_value",
             "'session' must be 1..%d characters of A-Z a-z 0-9 . _ : -", a->p.max_session_id);
        return;
    }
    if (hdr) {
        if (!session_id_ok(hdr, (size_t)a->p.max_session_id)) {
            fail(e, "X-Session-Id", "invalid_value",
                 "the X-Session-Id header must be 1..%d characters of A-Z a-z 0-9 . _ : -",
                 a->p.max_session_id);
            return;
        }
        if (sess && strcmp(sess, hdr) != 0) {
            fail(e, "session", "session_mismatch",
                 "the X-Session-Id header ('%s') and the 'session' field ('%s') name different "
                 "sessions; send one id, or the same in both",
                 hdr, sess);
            return;
        }
        sess = hdr;
    }
    if (sess && !e->status && (r->session = strdup(sess)) == NULL)
        oom(e, "reading the session id");
}

/* Fields both shapes read the same way (hdr_session: the X-Session-Id
 * header or NULL). */
static void parse_common(srv_api *a, json_t *body, const char *hdr_session, struct engine_req *r,
                         struct verr *e)
{
    double d;
    long long i;
    if (get_num(body, "temperature", 0, 100, &d, e) > 0)
        r->sampling.temperature = (float)d;
    if (get_num(body, "top_p", 0, 1, &d, e) > 0)
        r->sampling.top_p = (float)d;
    if (get_int(body, "top_k", 0, 1 << 30, &i, e) > 0)
        r->sampling.top_k = (int)i;
    if (get_num(body, "min_p", 0, 1, &d, e) > 0)
        r->sampling.min_p = (float)d;
    if (get_num(body, "presence_penalty", -2, 2, &d, e) > 0)
        r->sampling.presence_penalty = (float)d;
    if (get_num(body, "frequency_penalty", -2, 2, &d, e) > 0)
        r->sampling.frequency_penalty = (float)d;
    parse_session(a, body, hdr_session, r, e);
    parse_stop(body, r, e);
    get_bool(body, "ignore_eos", &r->ignore_eos, e);
}

/*
 * How many alternatives per token (OpenAI logprobs, llama.cpp n_probs): an
 * integer in 0..min(n_vocab, ENGINE_MAX_TOP_LOGPROBS). Returns 1 if present, 0
 * if absent or null, -1 bad.
 */
static int get_top_n(srv_api *a, json_t *body, const char *key, int *out, struct verr *e)
{
    long long n;
    int rc = get_int(body, key, INT64_MIN, INT64_MAX, &n, e);
    if (rc <= 0)
        return rc;
    int lim = a->info.n_vocab < ENGINE_MAX_TOP_LOGPROBS ? a->info.n_vocab : ENGINE_MAX_TOP_LOGPROBS;
    if (n < 0 || n > lim)
        return fail(e, key, "invalid_value",
                    "'%s' must be between 0 and %d (the vocabulary has %d tokens; kvd returns at "
                    "most %d alternatives per token) (got %lld)",
                    key, lim, a->info.n_vocab, ENGINE_MAX_TOP_LOGPROBS, n);
    *out = (int)n;
    return 1;
}

/*
 * A non-streamed answer with log-probabilities is built whole before it is
 * sent: tokens x (alternatives + 1) entries, each a JSON object of about a
 * hundred bytes in memory. ENGINE_MAX_LOGPROB_ENTRIES bounds that before any
 * work is done (4,096 tokens x 512 alternatives took 1.5 GB); a stream
 * sends each token's entries as it goes and is not bounded here.
 */
static void check_logprob_work(const struct engine_req *r, bool stream, const char *param,
                               struct verr *e)
{
    if (!r->want_logprobs || stream)
        return;
    long long entries = (long long)r->max_tokens * (r->n_top_logprobs + 1);
    if (entries > ENGINE_MAX_LOGPROB_ENTRIES)
        fail(e, param, "invalid_value",
             "%d tokens with %d alternatives each make %lld log-probability entries; a "
             "non-streamed answer may have at most %d (tokens x (alternatives + 1)): ask for "
             "fewer tokens or alternatives, or stream",
             r->max_tokens, r->n_top_logprobs, entries, ENGINE_MAX_LOGPROB_ENTRIES);
}

/* Check the prompt's size against the limits. */
static void check_prompt(srv_api *a, struct engine_req *r, struct verr *e)
{
    if (r->n_prompt == 0) {
        fail(e, "prompt", "invalid_value", "the prompt is empty");
        return;
    }
    if (r->n_prompt > a->p.max_prompt_tokens) {
        fail(e, "prompt", "context_length_exceeded",
             "the prompt has %d tokens; the limit (max_prompt_tokens) is %d", r->n_prompt,
             a->p.max_prompt_tokens);
        return;
    }
    /* (a chat prompt with turns makes room by dropping them in place) */
    if (a->p.policy.kind == KV_EVICT_NONE && r->n_turns == 0 &&
        r->n_prompt > a->p.policy.max_cache_tokens)
        fail(e, "prompt", "context_length_exceeded",
             "the prompt has %d tokens; a sequence holds at most %d (max_cache_tokens) under "
             "eviction policy none",
             r->n_prompt, a->p.policy.max_cache_tokens);
}

/*
 * What both completion routes read after their own fields: the shared
 * fields, then the prompt (tokenized here, on the loop thread) and its
 * limits; `mixed` is parse_prompt's (llama.cpp's prompt forms). Failures
 * are recorded in e.
 */
static void parse_tail(srv_api *a, json_t *body, const char *hdr_session, bool mixed,
                       struct engine_req *r, struct verr *e)
{
    parse_common(a, body, hdr_session, r, e);
    if (e->status)
        return;
    struct toks t = {0};
    if (parse_prompt(a, body, mixed, &t, e)) {
        free(t.v);
        return;
    }
    r->prompt = t.v;
    r->n_prompt = t.n;
    check_prompt(a, r, e);
}

/* OpenAI's defaults: plain sampling at temperature 1, a fresh seed. */
static void openai_sampling(srv_api *a, struct engine_req *r)
{
    model_sampling_defaults(&r->sampling);
    r->sampling.temperature = 1.0f;
    r->sampling.top_k = 0;
    r->sampling.top_p = 1.0f;
    r->sampling.min_p = 0.0f;
    r->sampling.repeat_penalty = 1.0f;
    r->sampling.seed = next_seed(a);
}

/* r->max_tokens from body[key] (the configured default when absent). */
static int parse_max_tokens(srv_api *a, json_t *body, const char *key, struct engine_req *r,
                            struct verr *e)
{
    long long i = 0;
    json_t *mt = field(body, key);
    if (mt && json_is_integer(mt) && json_integer_value(mt) > a->p.max_tokens &&
        json_integer_value(mt) <= (1ll << 40))
        return fail(e, key, "invalid_value", "%s (%lld) exceeds the limit of %d", key,
                    (long long)json_integer_value(mt), a->p.max_tokens);
    if (get_int(body, key, 0, a->p.max_tokens, &i, e) > 0)
        r->max_tokens = (int)i;
    return e->status ? -1 : 0;
}

/* The fields OpenAI's completion and chat routes share: n, seed, stream,
 * stream_options, user. */
static void parse_openai_shared(json_t *body, struct engine_req *r, struct call *call,
                                struct verr *e)
{
    long long i;
    const char *s;
    if (get_int(body, "n", 1, 1 << 30, &i, e) > 0 && i != 1)
        fail(e, "n", "unsupported",
             "n = %lld is not supported: kvd returns one choice per request; send %lld requests "
             "(with different seeds)",
             i, i);
    if (get_int(body, "seed", INT64_MIN, INT64_MAX, &i, e) > 0)
        r->sampling.seed = (uint64_t)i;
    get_bool(body, "stream", &call->stream, e);
    json_t *so = field(body, "stream_options");
    if (so) {
        if (!json_is_object(so))
            fail(e, "stream_options", "invalid_type", "'stream_options' must be an object");
        else
            get_bool(so, "include_usage", &call->include_usage, e);
    }
    if (get_str(body, "user", &s, e) > 0 && strlen(s) > 256)
        fail(e, "user", "invalid_value", "'user' is longer than 256 bytes");
    if (get_str(body, "model", &s, e) < 0)
        return;
}

static struct engine_req *parse_openai(srv_api *a, json_t *body, const char *hdr_session,
                                    struct call *call, struct verr *e)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    if (!r) {
        oom(e, "accepting the request");
        return NULL;
    }
    openai_sampling(a, r);
    const char *s;
    long long i;
    r->max_tokens = a->p.default_max_tokens;
    if (parse_max_tokens(a, body, "max_tokens", r, e) < 0)
        goto out;
    parse_openai_shared(body, r, call, e);
    if (get_int(body, "best_of", 1, 1 << 30, &i, e) > 0 && i != 1)
        fail(e, "best_of", "unsupported", "best_of > 1 is not supported");
    bool b = false;
    if (get_bool(body, "echo", &b, e) > 0 && b)
        fail(e, "echo", "unsupported",
             "echo is not supported: kvd returns neither the prompt nor its log-probabilities "
             "(logprobs covers generated tokens only)");
    int top = 0;
    if (get_top_n(a, body, "logprobs", &top, e) > 0) {
        r->want_logprobs = call->logprobs = true;
        r->n_top_logprobs = top;
    }
    check_logprob_work(r, call->stream, "logprobs", e);
    get_bool(body, "return_tokens_as_token_ids", &call->id_tokens, e);
    if (get_str(body, "suffix", &s, e) > 0 && s[0])
        fail(e, "suffix", "unsupported", "suffix is not supported");
    json_t *lb = field(body, "logit_bias");
    if (lb && (!json_is_object(lb) || json_object_size(lb) > 0))
        fail(e, "logit_bias", "unsupported", "logit_bias is not supported");
    parse_tail(a, body, hdr_session, false, r, e);
out:
    if (e->status) {
        engine_req_free(r);
        return NULL;
    }
    return r;
}

static struct engine_req *parse_llama(srv_api *a, json_t *body, const char *hdr_session,
                                   struct call *call, struct verr *e)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    if (!r) {
        oom(e, "accepting the request");
        return NULL;
    }
    model_sampling_defaults(&r->sampling); /* llama.cpp's defaults */
    r->sampling.seed = next_seed(a);
    long long i;
    double d;
    bool b;
    r->max_tokens = a->p.max_tokens;
    json_t *np = field(body, "n_predict");
    if (np && json_is_integer(np) && json_integer_value(np) > a->p.max_tokens &&
        json_integer_value(np) <= (1ll << 40)) {
        fail(e, "n_predict", "invalid_value", "n_predict (%lld) exceeds the limit of %d",
             (long long)json_integer_value(np), a->p.max_tokens);
        goto out;
    }
    if (get_int(body, "n_predict", -1, a->p.max_tokens, &i, e) > 0 && i >= 0)
        r->max_tokens = (int)i;
    if (get_num(body, "repeat_penalty", 0, 10, &d, e) > 0)
        r->sampling.repeat_penalty = (float)d;
    if (get_int(body, "repeat_last_n", -1, 1 << 20, &i, e) > 0)
        r->sampling.penalty_last_n = i < 0 ? 1 << 20 : (int)i;
    if (get_int(body, "seed", -1, INT64_MAX, &i, e) > 0 && i >= 0)
        r->sampling.seed = (uint64_t)i;
    json_t *sv = field(body, "seed");
    if (sv && json_is_integer(sv) && json_integer_value(sv) < -1)
        fail(e, "seed", "invalid_value", "'seed' must be -1 (random) or a non-negative integer");
    get_bool(body, "stream", &call->stream, e);
    get_bool(body, "cache_prompt", &b, e);
    get_bool(body, "return_tokens", &call->return_tokens, e);
    if (get_int(body, "n_keep", -1, 1 << 30, &i, e) > 0)
        r->n_keep = (int)i;
    int top = 0;
    if (get_top_n(a, body, "n_probs", &top, e) > 0 && top > 0) {
        r->want_logprobs = call->logprobs = true;
        r->n_top_logprobs = top;
    }
    check_logprob_work(r, call->stream, "n_probs", e);
    if (get_bool(body, "post_sampling_probs", &b, e) > 0 && b)
        fail(e, "post_sampling_probs", "unsupported",
             "post_sampling_probs is not supported: kvd reports the probabilities of the model's "
             "raw logits (before penalties and temperature)");
    parse_tail(a, body, hdr_session, true, r, e);
out:
    if (e->status) {
        engine_req_free(r);
        return NULL;
    }
    r->want_tokens = call->return_tokens;
    json_t *stops = json_array();
#define R6(x) (round((double)(x)*1e6) / 1e6)
    for (int k = 0; k < r->n_stop; k++)
        json_array_append_new(stops, json_string(r->stop[k]));
    call->settings = json_pack(
        "{s:i, s:f, s:i, s:f, s:f, s:f, s:i, s:f, s:f, s:I, s:o, s:b, s:b, s:i}", "n_predict",
        r->max_tokens, "temperature", R6(r->sampling.temperature), "top_k", r->sampling.top_k,
        "top_p", R6(r->sampling.top_p), "min_p", R6(r->sampling.min_p), "repeat_penalty",
        R6(r->sampling.repeat_penalty), "repeat_last_n", r->sampling.penalty_last_n,
        "presence_penalty", R6(r->sampling.presence_penalty), "frequency_penalty",
        R6(r->sampling.frequency_penalty), "seed", (json_int_t)r->sampling.seed, "stop", stops,
        "stream", call->stream, "ignore_eos", r->ignore_eos, "n_probs", r->n_top_logprobs);
    return r;
}

/* ------------------------------------------------------------------------
 * Chat: the conversation through the model's chat template
 *
 * POST /v1/chat/completions renders "messages" (and "tools") with the chat
 * template chosen at load (chat_template.c), tokenizes the result with its
 * control tokens recognised, and runs it as a completion that also stops
 * at the template's end-of-turn marker. With [eviction] unit = turn the
 * conversation is fitted first (tpl_chat_fit): whole oldest turns leave
 * until the prompt and max_tokens fit max_cache_tokens, so the cache never
 * has to cut a turn; a session remembers how many turns its prompt leaves
 * out, so the next request renders the same prefix and only its new turn
 * is prefilled. POST /apply-template (llama.cpp) answers the rendering.
 * ------------------------------------------------------------------------ */

static json_t *parse_body(srv_conn *c, const struct srv_http_req *req);
static bool not_ready(srv_api *a, srv_conn *c);

static struct chat_sess *chat_sess_find(srv_api *a, const char *id)
{
    for (struct chat_sess **pp = &a->chat_sess; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->id, id)) {
            struct chat_sess *x = *pp; /* move to the front: most recent first */
            *pp = x->next;
            x->next = a->chat_sess;
            a->chat_sess = x;
            return x;
        }
    return NULL;
}

static void chat_sess_free(struct chat_sess *x)
{
    free(x->id);
    free(x);
}

/* Record a session's decision; the least recently used entry goes past
 * MAX_CHAT_SESSIONS (the engine drops idle sessions too). */
static void chat_sess_set(srv_api *a, const char *id, int turns, int messages)
{
    struct chat_sess *x = chat_sess_find(a, id);
    if (!x) {
        x = calloc(1, sizeof(*x));
        if (!x || !(x->id = strdup(id)))
            abort();
        x->next = a->chat_sess;
        a->chat_sess = x;
        if (++a->n_chat_sess > MAX_CHAT_SESSIONS) {
            struct chat_sess **pp = &a->chat_sess;
            while ((*pp)->next)
                pp = &(*pp)->next;
            chat_sess_free(*pp);
            *pp = NULL;
            a->n_chat_sess--;
        }
    }
    x->dropped_turns = turns;
    x->dropped_messages = messages;
}

static void chat_sess_forget(srv_api *a, const char *id)
{
    for (struct chat_sess **pp = &a->chat_sess; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->id, id)) {
            struct chat_sess *x = *pp;
            *pp = x->next;
            chat_sess_free(x);
            a->n_chat_sess--;
            return;
        }
}

/* Load the chat template once the model is: logs which one, or why none. */
static void chat_load(srv_api *a)
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
    srv_log(SRV_LOG_INFO, "chat template: %s; system messages %s; turns end at %s%s%s",
            source, tpl_chat_supports_system(a->chat) ? "rendered" : "joined to the first user "
            "message (the template has no system role)", *eot ? "'" : "", *eot ? eot : "EOS",
            *eot ? (a->eot_token >= 0 ? "' (one token)" : "' (text)") : "");
}

/* tpl_chat_fit's token counter: the prompt as it will be tokenized. */
static int chat_count(const char *text, size_t len, void *ctx)
{
    srv_api *a = ctx;
    return model_tokenize_special(a->m, text, len, model_add_bos(a->m), NULL, 0);
}

static const char *const chat_roles[] = {"system", "developer", "user", "assistant", "tool",
                                         NULL};

/* "messages": a non-empty array of objects with a known role. */
static int check_messages(json_t *msgs, struct verr *e)
{
    if (!msgs)
        return fail(e, "messages", "missing_field", "'messages' is required");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0)
        return fail(e, "messages", "invalid_value",
                    "'messages' must be a non-empty array of {\"role\", \"content\"} objects");
    size_t i;
    json_t *m;
    json_array_foreach(msgs, i, m)
    {
        const char *role = json_string_value(json_object_get(m, "role"));
        bool known = false;
        for (int k = 0; role && chat_roles[k]; k++)
            known |= !strcmp(role, chat_roles[k]);
        if (!json_is_object(m) || !known)
            return fail(e, "messages", "invalid_value",
                        "messages[%zu] needs a \"role\" of system, developer, user, assistant or "
                        "tool",
                        i);
    }
    return 0;
}

/* Tokenize a rendering into r->prompt (control tokens parsed). */
static int chat_tokenize(srv_api *a, const char *text, size_t len, struct engine_req *r,
                         struct verr *e)
{
    int n = model_tokenize_special(a->m, text, len, model_add_bos(a->m), NULL, 0);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (n <= 0 || !ids ||
        model_tokenize_special(a->m, text, len, model_add_bos(a->m), ids, n) != n) {
        free(ids);
        return fail(e, "messages", "invalid_value", "the rendered conversation cannot be tokenized");
    }
    r->prompt = ids;
    r->n_prompt = n;
    return 0;
}

static int chat_render_error(struct tpl_error *te, struct verr *e)
{
    char msg[400];
    tpl_error_string(te, msg, sizeof(msg));
    return fail(e, "messages", "invalid_value",
                "the chat template cannot render these messages: %s", msg);
}

/*
 * A session under unit = turn: the whole conversation goes to the engine
 * with its turns' spans, and the cache drops turns in place as it needs
 * room, so the session's history keeps matching and only the new turn is
 * prefilled. What a session's first request could not fit is left out by
 * rendering (nothing is cached yet), and that decision stays. Returns 0
 * (done), -1 (error in e), or 1 (take the fitting path: the turns cannot
 * be dropped in place, the reason recorded in the call and logged once
 * per session; or the pinned part alone is over budget).
 */
static int chat_in_place(srv_api *a, json_t *msgs, json_t *tools, struct engine_req *r,
                         struct call *call, int budget, struct verr *e)
{
    struct chat_sess *x = chat_sess_find(a, r->session);
    struct tpl_error te;
    int drop = x ? x->dropped_turns : 0;
    time_t now = time(NULL);
    if (!x) {
        char *text = NULL;
        size_t len = 0;
        struct tpl_fit fit;
        if (tpl_chat_fit(a->chat, msgs, tools, true, now, budget, budget, 0, chat_count, a,
                         &text, &len, &fit, &te) < 0)
            return 1; /* the fitting path reports it (or cuts the last turn) */
        free(text);
        drop = fit.dropped_turns;
    }
    struct srv_chat_in_place ip;
    char why[240] = "";
    int rc = srv_chat_in_place(a->m, a->chat, msgs, tools, drop, now, budget,
                               a->p.max_prompt_tokens, &ip, why, sizeof(why), &te);
    if (rc < 0)
        return chat_render_error(&te, e);
    if (rc == 2)
        return 1;
    if (rc == 1) {
        snprintf(call->turn_fallback, sizeof(call->turn_fallback), "%s", why);
        srv_metrics_turn_fallback(a->metrics);
        if (!x || !x->fallback_logged)
            srv_log(SRV_LOG_WARN,
                    "chat session '%s': turns are rendered again, not evicted in place: %s",
                    r->session, why);
        return 1;
    }
    r->prompt = ip.p.ids;
    r->n_prompt = ip.p.n_ids;
    r->turns = ip.p.turns;
    r->n_turns = ip.p.n_turns;
    r->turn_low_tokens = budget;
    call->turn_eviction = "in_place";
    call->evicted_messages = ip.dropped_messages;
    if (!x)
        srv_metrics_evicted_messages(a->metrics, false, (uint64_t)ip.dropped_messages);
    chat_sess_set(a, r->session, drop, ip.dropped_messages);
    return 0;
}

/*
 * The last turn alone is larger than the budget: cut it from its middle,
 * keeping its header (srv_chat_cut_last_turn). Returns 0 or -1 (e).
 */
static int chat_cut(srv_api *a, json_t *msgs, json_t *tools, struct engine_req *r,
                    struct call *call, int budget, struct verr *e)
{
    char why[300];
    struct tpl_error te;
    int32_t *ids = NULL;
    int n = 0, cut = 0;
    te.msg[0] = 0;
    if (srv_chat_cut_last_turn(a->m, a->chat, msgs, tools, time(NULL), budget, &ids, &n, &cut,
                               why, sizeof(why), &te) < 0) {
        if (te.msg[0])
            return chat_render_error(&te, e);
        return fail(e, "messages", "context_length_exceeded", "%s", why);
    }
    srv_log(SRV_LOG_INFO,
            "chat request: the last user message is larger than the window; %d tokens cut "
            "from its middle (its header and the system prompt kept)",
            cut);
    r->prompt = ids;
    r->n_prompt = n;
    call->cut_tokens = cut;
    return 0;
}

/*
 * Render the request's conversation into r->prompt (tokenized with its
 * control tokens). With unit = turn: a session keeps its turns in the
 * cache and drops them in place (chat_in_place); otherwise, or when the
 * template does not allow it, the conversation is fitted by rendering
 * (tpl_chat_fit), recording the turns left out (and, for a session,
 * remembering them); a last turn larger than the budget is cut.
 */
static int chat_prompt(srv_api *a, json_t *body, struct engine_req *r, struct call *call,
                       struct verr *e)
{
    json_t *msgs = field(body, "messages"), *tools = field(body, "tools");
    if (check_messages(msgs, e) < 0)
        return -1;
    if (tools && !json_is_array(tools))
        return fail(e, "tools", "invalid_type", "'tools' must be an array");
    char *text = NULL;
    size_t len = 0;
    struct tpl_error te;
    int rc;
    if (a->p.chat_turns) {
        /* Room for the answer: what the request asked for; without a limit
         * a quarter of the budget (a longer answer goes on, and the
         * eviction policy makes room as for any sequence). */
        int reserve = call->max_tokens_given ? r->max_tokens
                      : r->max_tokens < a->p.policy.max_cache_tokens / 4
                          ? r->max_tokens
                          : a->p.policy.max_cache_tokens / 4;
        int budget = a->p.policy.max_cache_tokens - reserve;
        if (budget > a->p.max_prompt_tokens)
            budget = a->p.max_prompt_tokens;
        if (budget < 1)
            return fail(e, "max_tokens", "context_length_exceeded",
                        "max_tokens (%d) leaves no room for the conversation in "
                        "max_cache_tokens (%d)",
                        r->max_tokens, a->p.policy.max_cache_tokens);
        if (r->session && (rc = chat_in_place(a, msgs, tools, r, call, budget, e)) <= 0)
            return rc;
        call->turn_eviction = "rerender";
        struct chat_sess *x = r->session ? chat_sess_find(a, r->session) : NULL;
        int min_drop = x ? x->dropped_turns : 0, before = x ? x->dropped_messages : 0;
        if (x && call->turn_fallback[0])
            x->fallback_logged = true;
        struct tpl_fit fit;
        rc = tpl_chat_fit(a->chat, msgs, tools, true, time(NULL), budget, budget / 2, min_drop,
                          chat_count, a, &text, &len, &fit, &te);
        if (rc == 0) {
            call->evicted_messages = fit.dropped_messages;
            if (fit.dropped_turns > min_drop || !r->session)
                srv_metrics_evicted_messages(a->metrics, false,
                                             (uint64_t)(fit.dropped_messages -
                                                        (r->session ? before : 0)));
            if (r->session) {
                chat_sess_set(a, r->session, fit.dropped_turns, fit.dropped_messages);
                if (call->turn_fallback[0])
                    chat_sess_find(a, r->session)->fallback_logged = true;
            }
        } else if (strstr(te.msg, "with every earlier turn left out")) {
            return chat_cut(a, msgs, tools, r, call, budget, e);
        }
    } else {
        rc = tpl_chat_render(a->chat, msgs, tools, true, time(NULL), &text, &len, &te);
    }
    if (rc < 0)
        return chat_render_error(&te, e);
    rc = chat_tokenize(a, text, len, r, e);
    free(text);
    return rc;
}

/* Stop at the template's end of turn: as a token when it is one (control
 * tokens print no text), else as a stop string. */
static void chat_stop(srv_api *a, struct engine_req *r)
{
    const char *eot = tpl_chat_end_of_turn(a->chat);
    if (a->eot_token >= 0) {
        r->stop_token = a->eot_token;
    } else if (*eot && r->n_stop < MAX_STOP) {
        char **v = realloc(r->stop, sizeof(char *) * (size_t)(r->n_stop + 1));
        if (!v || !(v[r->n_stop] = strdup(eot)))
            abort();
        r->stop = v;
        r->n_stop++;
    }
}

static struct engine_req *parse_chat(srv_api *a, json_t *body, const char *hdr_session,
                                  struct call *call, struct verr *e)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    if (!r) {
        oom(e, "accepting the request");
        return NULL;
    }
    openai_sampling(a, r);
    r->max_tokens = a->p.default_max_tokens;
    call->max_tokens_given = field(body, "max_completion_tokens") || field(body, "max_tokens");
    if (field(body, "max_completion_tokens")) {
        if (parse_max_tokens(a, body, "max_completion_tokens", r, e) < 0)
            goto out;
    } else if (parse_max_tokens(a, body, "max_tokens", r, e) < 0) {
        goto out;
    }
    parse_openai_shared(body, r, call, e);
    bool lp = false;
    get_bool(body, "logprobs", &lp, e);
    int top = 0;
    if (get_top_n(a, body, "top_logprobs", &top, e) > 0 && !lp)
        fail(e, "top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    if (lp) {
        r->want_logprobs = call->logprobs = true;
        r->n_top_logprobs = top;
    }
    check_logprob_work(r, call->stream, "top_logprobs", e);
    json_t *lb = field(body, "logit_bias");
    if (lb && (!json_is_object(lb) || json_object_size(lb) > 0))
        fail(e, "logit_bias", "unsupported", "logit_bias is not supported");
    parse_common(a, body, hdr_session, r, e);
    if (e->status)
        goto out;
    if (!a->chat) {
        e->status = 500;
        e->code = "chat_template_unavailable";
        snprintf(e->msg, sizeof(e->msg), "no chat template can be used: %.400s (set [model] "
                 "chat_template to a template file)", a->chat_err);
        goto out;
    }
    if (chat_prompt(a, body, r, call, e) < 0)
        goto out;
    chat_stop(a, r);
    check_prompt(a, r, e);
out:
    if (e->status) {
        engine_req_free(r);
        return NULL;
    }
    return r;
}

/* POST /apply-template (llama.cpp): {"messages", "tools"?,
 * "add_generation_prompt"? (default true)} -> {"prompt"}. */
static void route_apply_template(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    if (not_ready(a, c))
        return;
    json_t *body = parse_body(c, req);
    if (!body)
        return;
    struct verr e = {0};
    bool agp = true;
    json_t *msgs = field(body, "messages"), *tools = field(body, "tools");
    check_messages(msgs, &e);
    if (tools && !json_is_array(tools))
        fail(&e, "tools", "invalid_type", "'tools' must be an array");
    get_bool(body, "add_generation_prompt", &agp, &e);
    if (!e.status && !a->chat) {
        api_error_code(c, 500, NULL, "chat_template_unavailable", NULL,
                       "no chat template can be used: %s", a->chat_err);
        json_decref(body);
        return;
    }
    char *text = NULL;
    size_t len = 0;
    struct tpl_error te;
    if (!e.status && tpl_chat_render(a->chat, msgs, tools, agp, time(NULL), &text, &len, &te) < 0) {
        char msg[400];
        fail(&e, "messages", "invalid_value", "the chat template cannot render these messages: %s",
             tpl_error_string(&te, msg, sizeof(msg)));
    }
    json_decref(body);
    if (e.status) {
        api_error_code(c, e.status, e.param[0] ? e.param : NULL, e.code, NULL, "%s", e.msg);
        return;
    }
    respond_json(c, 200, json_pack("{s:o}", "prompt", json_text(text, len)));
    free(text);
}

/* ------------------------------------------------------------------------
 * Calls (accepted requests)
 * ------------------------------------------------------------------------ */

static void call_gone(void *owner)
{
    struct call *call = owner;
    call->conn = NULL;
    if (call->req)
        atomic_store(&call->req->cancel, ENGINE_CANCEL_CLIENT);
}

/*
 * Memory ran out assembling a non-streamed answer: answer 500 now (never a
 * cut answer passed off as whole), stop the generation (the engine drops
 * it at its next step, as for a client that left) and take no more text.
 */
static void call_out_of_memory(struct call *call)
{
    call->return_tokens = false;
    if (call->req)
        atomic_store(&call->req->cancel, ENGINE_CANCEL_CLIENT);
    if (call->conn) {
        srv_conn *c = call->conn;
        call->conn = NULL;
        api_error_code(c, 500, NULL, "out_of_memory", NULL, "out of memory assembling the answer");
    }
}

/* Backpressure from the connection: a reader that is behind pauses its
 * request's generation (the engine keeps its slot and cache). */
static void call_pressure(void *owner, bool pause)
{
    struct call *call = owner;
    if (!call->req)
        return;
    atomic_store(&call->req->paused, pause);
    if (!pause)
        srv_sched_wake(call->a->sched);
}

static struct call *call_new(srv_api *a, srv_conn *c, enum call_kind kind)
{
    struct call *call = calloc(1, sizeof(*call));
    if (!call)
        return NULL;
    call->a = a;
    call->conn = c;
    call->kind = kind;
    call->created = (int64_t)time(NULL);
    uint64_t x = next_seed(a);
    snprintf(call->id, sizeof(call->id), "%s-%016" PRIx64 "%08" PRIx64,
             kind == CALL_CHAT ? "chatcmpl" : "cmpl", x, ++a->next_id);
    return call;
}

static void call_free(struct call *call)
{
    engine_req_free(call->req);
    free(call->text);
    free(call->toks);
    json_decref(call->settings);
    json_decref(call->lp);
    free(call);
}

/* Queue the call's request; answers the error itself on refusal. */
static void call_submit(srv_api *a, struct call *call)
{
    call->req->owner = call;
    call->req->id = a->next_id;
    int rc = srv_sched_submit(a->sched, call->req);
    if (rc == -EAGAIN) {
        api_error_code(call->conn, 429, NULL, "queue_full", "Retry-After: 1\r\n",
                       "the request queue is full (%d waiting); retry later",
                       srv_sched_queue_depth(a->sched));
        call_free(call);
        return;
    }
    if (rc < 0) {
        api_error(call->conn, 503, NULL, "the server is shutting down");
        call_free(call);
        return;
    }
    srv_conn_set_owner(call->conn, call, call_gone, call_pressure);
    call->next = a->calls;
    if (a->calls)
        a->calls->prev = call;
    a->calls = call;
    a->in_flight++;
}

static void call_end(srv_api *a, struct call *call)
{
    if (call->conn)
        srv_conn_set_owner(call->conn, NULL, NULL, NULL);
    if (call->prev)
        call->prev->next = call->next;
    else
        a->calls = call->next;
    if (call->next)
        call->next->prev = call->prev;
    a->in_flight--;
    call_free(call);
}

/* ------------------------------------------------------------------------
 * Answers
 * ------------------------------------------------------------------------ */

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
    char *s = v ? json_dumps(v, JSON_FLAGS) : NULL;
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

/* One OpenAI choice object; logprobs (stolen) may be NULL (null). */
static json_t *openai_chunk(struct call *call, json_t *text, const char *finish, json_t *logprobs)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:[{s:o, s:i, s:o, s:o}]}", "id", call->id, "object",
                     "text_completion", "created", (json_int_t)call->created, "model",
                     call->a->model_name, "choices", "text", text, "index", 0, "logprobs",
                     logprobs ? logprobs : json_null(), "finish_reason",
                     finish ? json_string(finish) : json_null());
}

/* ------------------------------------------------------------------------
 * Log-probabilities (OpenAI logprobs, llama.cpp n_probs)
 *
 * The engine sends, with each sampled token, its log-probability, the most
 * likely tokens with theirs, and the text the token added. The sampled
 * token is named by that text (so the names join to the completion's
 * text); an alternative by the text it stands for on its own, decoded here
 * with one detokenizer kept for the purpose (a byte token that only starts
 * a character shows U+FFFD). OpenAI's return_tokens_as_token_ids names
 * every token "token_id:ID" instead.
 * ------------------------------------------------------------------------ */

/* A log-probability as JSON: null if it is not finite (a -inf logit). */
static json_t *json_logprob(double v)
{
    return isfinite(v) ? json_real(v) : json_null();
}

/* The text token id stands for on its own (new JSON string). */
static json_t *alt_piece(srv_api *a, int32_t id)
{
    if (!a->piece_detok && !(a->piece_detok = model_detok_create(a->m)))
        return json_string("");
    int n = detok_step(a->piece_detok, &id, &a->piece_buf, &a->piece_cap, 0);
    int m = n >= 0 ? detok_step(a->piece_detok, NULL, &a->piece_buf, &a->piece_cap, (size_t)n) : -1;
    if (n < 0 || m < 0) { /* out of memory: start a clean stream next time */
        model_detok_destroy(a->piece_detok);
        a->piece_detok = NULL;
        return json_string("");
    }
    return json_text(a->piece_buf ? a->piece_buf : "", (size_t)(n + m));
}

/* How a token is named: piece (the sampled token's text) or, when NULL,
 * the token's own text; "token_id:ID" with return_tokens_as_token_ids. */
static json_t *token_name(struct call *call, int32_t id, const char *piece, size_t n)
{
    if (call->id_tokens) {
        char b[32];
        snprintf(b, sizeof(b), "token_id:%d", (int)id);
        return json_string(b);
    }
    return piece ? json_text(piece, n) : alt_piece(call->a, id);
}

static size_t utf8_chars(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* An empty OpenAI logprobs object (new). */
static json_t *openai_lp_new(void)
{
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs",
                     "text_offset");
}

/* Append one token to an OpenAI logprobs object. top_logprobs maps names
 * to log-probabilities; when two alternatives share a name, the more
 * likely one keeps it, and a U+0000 in a name is written U+FFFD there
 * (many JSON parsers refuse it in a key). text_offset counts code points
 * of the completion. */
static void openai_lp_add(struct call *call, json_t *obj, const struct engine_logprob *lp)
{
    json_array_append_new(json_object_get(obj, "tokens"),
                          token_name(call, lp->token, lp->piece, lp->piece_len));
    json_array_append_new(json_object_get(obj, "token_logprobs"), json_logprob(lp->logprob));
    json_t *top = json_object();
    for (int i = 0; i < lp->n_top; i++) {
        json_t *k = token_name(call, lp->top_ids[i], NULL, 0);
        const char *key = json_string_value(k);
        size_t kl = json_string_length(k);
        if (key && memchr(key, 0, kl)) {
            char *t = malloc(kl * 3 + 1);
            size_t o = 0;
            for (size_t j = 0; t && j < kl; j++) {
                if (key[j]) {
                    t[o++] = key[j];
                } else {
                    memcpy(t + o, "\xEF\xBF\xBD", 3);
                    o += 3;
                }
            }
            json_decref(k);
            k = t ? json_stringn(t, o) : NULL;
            free(t);
            key = json_string_value(k);
            kl = json_string_length(k);
        }
        if (key && !json_object_getn(top, key, kl))
            json_object_setn_new(top, key, kl, json_logprob(lp->top_logprobs[i]));
        json_decref(k);
    }
    json_array_append_new(json_object_get(obj, "top_logprobs"), top);
    json_array_append_new(json_object_get(obj, "text_offset"),
                          json_integer((json_int_t)call->lp_chars));
    call->lp_chars += utf8_chars(lp->piece, lp->piece_len);
}

/* llama.cpp's completion_probabilities entry for one token (new). */
static json_t *llama_prob(struct call *call, const struct engine_logprob *lp)
{
    json_t *top = json_array();
    for (int i = 0; i < lp->n_top; i++)
        json_array_append_new(top, json_pack("{s:i, s:o, s:o}", "id", (int)lp->top_ids[i], "token",
                                             token_name(call, lp->top_ids[i], NULL, 0), "logprob",
                                             json_logprob(lp->top_logprobs[i])));
    return json_pack("{s:i, s:o, s:o, s:o}", "id", (int)lp->token, "token",
                     token_name(call, lp->token, lp->piece, lp->piece_len), "logprob",
                     json_logprob(lp->logprob), "top_logprobs", top);
}

/* One chat.completion.chunk; delta and logprobs (may be NULL: null) stolen. */
static json_t *chat_chunk(struct call *call, json_t *delta, const char *finish, json_t *logprobs)
{
    return json_pack("{s:s, s:s, s:I, s:s, s:n, s:[{s:i, s:o, s:o, s:o}]}", "id", call->id,
                     "object", "chat.completion.chunk", "created", (json_int_t)call->created,
                     "model", call->a->model_name, "system_fingerprint", "choices", "index", 0,
                     "delta", delta, "logprobs", logprobs ? logprobs : json_null(),
                     "finish_reason", finish ? json_string(finish) : json_null());
}

/* The UTF-8 bytes of a token name, as OpenAI's chat logprobs list them. */
static json_t *name_bytes(const json_t *name)
{
    json_t *b = json_array();
    const unsigned char *p = (const unsigned char *)json_string_value(name);
    for (size_t i = 0; p && i < json_string_length(name); i++)
        json_array_append_new(b, json_integer(p[i]));
    return b;
}

/* One entry of a chat completion's logprobs.content (new): the sampled
 * token and the top_logprobs alternatives, each with token, logprob and
 * bytes. */
static json_t *chat_lp_entry(struct call *call, const struct engine_logprob *lp)
{
    json_t *top = json_array();
    for (int i = 0; i < lp->n_top; i++) {
        json_t *k = token_name(call, lp->top_ids[i], NULL, 0);
        json_array_append_new(top, json_pack("{s:O, s:o, s:o}", "token", k, "logprob",
                                             json_logprob(lp->top_logprobs[i]), "bytes",
                                             name_bytes(k)));
        json_decref(k);
    }
    json_t *k = token_name(call, lp->token, lp->piece, lp->piece_len);
    json_t *v = json_pack("{s:O, s:o, s:o, s:o}", "token", k, "logprob", json_logprob(lp->logprob),
                          "bytes", name_bytes(k), "top_logprobs", top);
    json_decref(k);
    return v;
}

/* The first chunk of a chat stream says who speaks. */
static void chat_role_chunk(struct call *call)
{
    if (call->role_sent)
        return;
    call->role_sent = true;
    sse_send(call, chat_chunk(call, json_pack("{s:s, s:s}", "role", "assistant", "content", ""),
                              NULL, NULL));
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
                call_out_of_memory(call);
                return;
            }
            call->toks = nt;
        }
        memcpy(call->toks + call->n_toks, ev->tokens, sizeof(int32_t) * (size_t)ev->n_tokens);
        call->n_toks += ev->n_tokens;
    }
    if (!call->conn)
        return;
    if (!call->stream) {
        if (call->len + ev->len + 1 > call->cap) {
            size_t cap = call->cap ? call->cap * 2 : 256;
            while (cap < call->len + ev->len + 1)
                cap *= 2;
            char *nt = realloc(call->text, cap);
            if (!nt) {
                call_out_of_memory(call);
                return;
            }
            call->text = nt;
            call->cap = cap;
        }
        memcpy(call->text + call->len, ev->text, ev->len);
        call->len += ev->len;
        if (ev->lp && call->kind == CALL_OPENAI) {
            if (!call->lp)
                call->lp = openai_lp_new();
            openai_lp_add(call, call->lp, ev->lp);
        } else if (ev->lp && call->kind == CALL_CHAT) {
            if (!call->lp)
                call->lp = json_array();
            json_array_append_new(call->lp, chat_lp_entry(call, ev->lp));
        } else if (ev->lp) {
            if (!call->lp)
                call->lp = json_array();
            json_array_append_new(call->lp, llama_prob(call, ev->lp));
        }
        return;
    }
    if (ev->len == 0 && !(call->return_tokens && ev->n_tokens) && !ev->lp)
        return;
    stream_start(call);
    if (call->kind == CALL_CHAT) {
        chat_role_chunk(call);
        json_t *lp = ev->lp ? json_pack("{s:[o]}", "content", chat_lp_entry(call, ev->lp)) : NULL;
        sse_send(call, chat_chunk(call, json_pack("{s:o}", "content", json_text(ev->text, ev->len)),
                                  NULL, lp));
    } else if (call->kind == CALL_OPENAI) {
        json_t *lp = NULL;
        if (ev->lp) {
            lp = openai_lp_new();
            openai_lp_add(call, lp, ev->lp);
        }
        sse_send(call, openai_chunk(call, json_text(ev->text, ev->len), NULL, lp));
    } else {
        json_t *v = json_pack("{s:o, s:b, s:i, s:i}", "content", json_text(ev->text, ev->len),
                              "stop", 0, "id_slot", 0, "index", 0);
        if (call->return_tokens) {
            json_t *arr = json_array();
            for (int k = 0; k < ev->n_tokens; k++)
                json_array_append_new(arr, json_integer(ev->tokens[k]));
            json_object_set_new(v, "tokens", arr);
        }
        if (ev->lp)
            json_object_set_new(v, "completion_probabilities",
                                json_pack("[o]", llama_prob(call, ev->lp)));
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
        json_object_set_new(v, "completion_probabilities",
                            call->lp ? json_incref(call->lp) : json_array());
    return v;
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
    if (call->kind == CALL_LLAMA) {
        json_t *v = llama_final(call, ev,
                                call->stream ? json_string("")
                                             : json_text(call->text ? call->text : "", call->len));
        json_object_set_new(v, "error",
                            json_pack("{s:s, s:s, s:n, s:s}", "message", msg, "type",
                                      srv_error_type(503), "param", "code", code));
        if (!call->stream) {
            respond_json(call->conn, 200, v);
            return;
        }
        stream_start(call);
        sse_send(call, v);
    } else if (!call->stream) {
        api_error_code(call->conn, 503, NULL, code, NULL, "%s", msg);
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
    if (call->kind == CALL_SESSION_GET || call->kind == CALL_SESSION_DELETE) {
        const struct engine_session_info *si = &ev->session;
        if (!si->found) {
            api_error(call->conn, 404, "session", "no session '%s'", call->req->session);
            return;
        }
        if (call->kind == CALL_SESSION_DELETE) {
            respond_json(call->conn, 200,
                         json_pack("{s:s, s:s, s:b}", "id", call->req->session, "object",
                                   "session.deleted", "deleted", 1));
            return;
        }
        respond_json(
            call->conn, 200,
            json_pack("{s:s, s:s, s:i, s:i, s:i, s:s, s:f, s:b, s:b, s:{s:s, s:i, s:i, s:i, s:i}, "
                      "s:{s:s, s:s, s:i, s:I}}",
                      "id", call->req->session,
                      "object", "session", "tokens", si->history_tokens, "retained_tokens",
                      si->retained_tokens, "evicted_tokens",
                      si->history_tokens > si->retained_tokens
                          ? si->history_tokens - si->retained_tokens
                          : 0,
                      "positions", si->renumber ? "renumber" : "preserve", "last_used",
                      (double)si->last_used_ms / 1000.0, "busy", si->busy, "dropped", si->dropped,
                      "eviction", "policy", kv_policy_kind_name(si->policy.kind),
                      "max_cache_tokens", si->policy.max_cache_tokens, "sink_tokens",
                      si->policy.sink_tokens, "window_tokens", si->policy.window_tokens,
                      "heavy_tokens", si->policy.heavy_tokens, "kv", "k_type",
                      kv_type_name(si->k_type), "v_type", kv_type_name(si->v_type), "pages",
                      si->kv_pages, "bytes", (json_int_t)si->kv_bytes));
        return;
    }
    if (ev->finish == ENGINE_FINISH_CANCEL)
        return;
    if (engine_finish_cut(ev->finish)) {
        on_cut(call, ev);
        return;
    }
    const struct engine_usage *u = &ev->usage;
    if (call->stream && call->kind == CALL_CHAT) {
        stream_start(call);
        chat_role_chunk(call);
        sse_send(call, chat_chunk(call, json_object(), openai_finish(ev->finish), NULL));
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
            sse_send(call, openai_chunk(call, json_string(""), openai_finish(ev->finish), NULL));
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
    json_t *text = json_text(call->text ? call->text : "", call->len);
    if (call->kind == CALL_CHAT) {
        json_t *lp = NULL;
        if (call->logprobs)
            lp = json_pack("{s:O}", "content", call->lp ? call->lp : json_array());
        if (lp && !call->lp)
            json_decref(json_object_get(lp, "content"));
        respond_json(call->conn, 200,
                     json_pack("{s:s, s:s, s:I, s:s, s:n, s:[{s:i, s:{s:s, s:o, s:n}, s:o, s:s}], "
                               "s:o}",
                               "id", call->id, "object", "chat.completion", "created",
                               (json_int_t)call->created, "model", call->a->model_name,
                               "system_fingerprint", "choices", "index", 0, "message", "role",
                               "assistant", "content", text, "refusal", "logprobs",
                               lp ? lp : json_null(), "finish_reason", openai_finish(ev->finish),
                               "usage", chat_usage(call, u)));
        return;
    }
    if (call->kind == CALL_OPENAI) {
        json_t *lp = NULL;
        if (call->logprobs)
            lp = call->lp ? json_incref(call->lp) : openai_lp_new();
        json_t *v = openai_chunk(call, text, openai_finish(ev->finish), lp);
        json_object_set_new(v, "usage", usage_json(u));
        respond_json(call->conn, 200, v);
    } else {
        respond_json(call->conn, 200, llama_final(call, ev, text));
    }
}

static void on_error(struct call *call, const struct engine_event *ev)
{
    if (!call->conn)
        return;
    if (!call->started) {
        api_error_code(call->conn, ev->status, ev->status == 400 ? "prompt" : NULL,
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
            snprintf(a->model_name, sizeof(a->model_name), "%s", a->info.name);
            chat_load(a);
            a->ready_time = (int64_t)time(NULL);
            srv_log(SRV_LOG_INFO, "ready: serving model '%s'", a->model_name);
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
        case ENGINE_EV_DONE:
            /* whole turns a session's cache evicted in place */
            srv_metrics_evicted_messages(a->metrics, true,
                                         (uint64_t)ev->usage.evicted_messages_now);
            on_done(ev->req->owner, ev);
            call_end(a, ev->req->owner);
            break;
        case ENGINE_EV_ERROR:
            on_error(ev->req->owner, ev);
            call_end(a, ev->req->owner);
            break;
        }
        engine_event_free(ev);
    }
    return ok;
}

/* ------------------------------------------------------------------------
 * Routes
 * ------------------------------------------------------------------------ */

static json_t *parse_body(srv_conn *c, const struct srv_http_req *req)
{
    json_error_t je;
    json_t *body = json_loadb(req->body, req->body_len, JSON_REJECT_DUPLICATES, &je);
    if (!body) {
        if (req->body_len == 0)
            api_error_code(c, 400, NULL, "invalid_json", NULL,
                           "the request body is empty; send a JSON object");
        else if (json_error_code(&je) == json_error_invalid_utf8)
            api_error_code(c, 400, NULL, "invalid_utf8", NULL,
                           "the request body is not valid UTF-8 (byte %d)", je.position);
        else
            api_error_code(c, 400, NULL, "invalid_json", NULL,
                           "the request body is not valid JSON: %s (line %d, column %d)", je.text,
                           je.line, je.column);
        return NULL;
    }
    if (!json_is_object(body)) {
        api_error_code(c, 400, NULL, "invalid_json", NULL,
                       "the request body must be a JSON object, not %s", json_type_name(body));
        json_decref(body);
        return NULL;
    }
    return body;
}

static bool not_ready(srv_api *a, srv_conn *c)
{
    if (a->draining) {
        api_error(c, 503, NULL, "the server is shutting down");
        return true;
    }
    if (!a->m) {
        api_error_code(c, 503, NULL, "loading", "Retry-After: 1\r\n", "the model is loading");
        return true;
    }
    return false;
}

static void route_completion(srv_api *a, srv_conn *c, const struct srv_http_req *req,
                             enum call_kind kind)
{
    if (not_ready(a, c))
        return;
    json_t *body = parse_body(c, req);
    if (!body)
        return;
    struct call *call = call_new(a, c, kind);
    if (!call) {
        json_decref(body);
        api_error_code(c, 503, NULL, "out_of_memory", "Retry-After: 1\r\n",
                       "out of memory accepting the request; retry later");
        return;
    }
    struct verr e = {0};
    const char *hdr = srv_http_header(req, "X-Session-Id");
    call->req = kind == CALL_LLAMA  ? parse_llama(a, body, hdr, call, &e)
                : kind == CALL_CHAT ? parse_chat(a, body, hdr, call, &e)
                                    : parse_openai(a, body, hdr, call, &e);
    json_decref(body);
    if (!call->req) {
        api_error_code(c, e.status, e.param[0] ? e.param : NULL, e.code, NULL, "%s", e.msg);
        call_free(call);
        return;
    }
    call_submit(a, call);
}

static void route_session(srv_api *a, srv_conn *c, const struct srv_http_req *req, const char *id,
                          enum call_kind kind)
{
    bool del = kind == CALL_SESSION_DELETE;
    struct engine_map_opts map = {0};
    char param[64], msg[256];
    if (kind == CALL_SESSION_MAP &&
        srv_map_parse_query(req->query, &map, param, sizeof(param), msg, sizeof(msg)) != 0) {
        api_error(c, 400, param, "%s: %s", param, msg);
        return;
    }
    if (!session_id_ok(id, (size_t)a->p.max_session_id)) {
        api_error(c, 400, "session", "bad session id: 1..%d characters of A-Z a-z 0-9 . _ : -",
                  a->p.max_session_id);
        return;
    }
    const char *hdr = srv_http_header(req, "X-Session-Id");
    if (hdr && strcmp(hdr, id) != 0) {
        api_error_code(c, 400, "session", "session_mismatch", NULL,
                       "the X-Session-Id header names another session than the path");
        return;
    }
    if (!a->m) {
        api_error(c, 503, NULL, "the model is loading");
        return;
    }
    struct call *call = call_new(a, c, kind);
    if (call)
        call->req = engine_req_new(del                        ? ENGINE_REQ_SESSION_DELETE
                                : kind == CALL_SESSION_MAP ? ENGINE_REQ_SESSION_MAP
                                                           : ENGINE_REQ_SESSION_INFO);
    if (call && call->req) {
        call->req->session = strdup(id);
        call->req->map = map;
    }
    if (call && call->req && del)
        chat_sess_forget(a, id);
    if (!call || !call->req || !call->req->session) {
        if (call)
            call_free(call);
        api_error_code(c, 503, NULL, "out_of_memory", "Retry-After: 1\r\n",
                       "out of memory accepting the request; retry later");
        return;
    }
    call_submit(a, call);
}

/*
 * POST /tokenize: {"content": text, "add_special": bool (BOS when the
 * model wants one; default false), "with_pieces": bool} -> {"tokens":
 * [id, ...]} or, with pieces, [{"id", "piece"}, ...]. A piece is the text
 * its token adds when the tokens are decoded in order, so the pieces
 * concatenated are exactly what /detokenize returns; a byte token that
 * starts a character has "" and the token completing it the character.
 */
static void route_tokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    if (!a->m) {
        api_error_code(c, 503, NULL, "loading", "Retry-After: 1\r\n", "the model is loading");
        return;
    }
    json_t *body = parse_body(c, req);
    if (!body)
        return;
    struct verr e = {0};
    const char *text = NULL;
    bool add_special = false, with_pieces = false;
    if (get_str(body, "content", &text, &e) == 0)
        fail(&e, "content", "missing_field", "'content' (the text to tokenize) is required");
    get_bool(body, "add_special", &add_special, &e);
    get_bool(body, "with_pieces", &with_pieces, &e);
    struct toks t = {0};
    if (!e.status)
        tokenize_into(a, text, json_string_length(json_object_get(body, "content")),
                      add_special && model_add_bos(a->m), &t, &e);
    json_decref(body);
    if (e.status) {
        if (!strcmp(e.param, "prompt")) /* tokenize_into's name for the text */
            snprintf(e.param, sizeof(e.param), "content");
        api_error_code(c, e.status, e.param[0] ? e.param : NULL, e.code, NULL, "%s", e.msg);
        free(t.v);
        return;
    }
    json_t *arr = json_array();
    model_detok *d = with_pieces ? model_detok_create(a->m) : NULL;
    if (with_pieces && !d) {
        json_decref(arr);
        arr = NULL;
    }
    char *piece = NULL;
    size_t cap = 0;
    for (int i = 0; i < t.n && arr; i++) {
        if (!with_pieces) {
            json_array_append_new(arr, json_integer(t.v[i]));
            continue;
        }
        /* the last piece also takes what the stream still holds */
        int n = detok_step(d, &t.v[i], &piece, &cap, 0);
        int m = n >= 0 && i == t.n - 1 ? detok_step(d, NULL, &piece, &cap, (size_t)n) : 0;
        if (n < 0 || m < 0) {
            json_decref(arr);
            arr = NULL;
            break;
        }
        json_array_append_new(
            arr, json_pack("{s:i, s:o}", "id", t.v[i], "piece", json_text(piece, (size_t)(n + m))));
    }
    model_detok_destroy(d);
    free(piece);
    free(t.v);
    if (!arr) {
        api_error(c, 500, NULL, "out of memory decoding the pieces");
        return;
    }
    respond_json(c, 200, json_pack("{s:o}", "tokens", arr));
}

/* POST /detokenize: {"tokens": [id, ...]} -> {"content": text}. */
static void route_detokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req)
{
    if (!a->m) {
        api_error_code(c, 503, NULL, "loading", "Retry-After: 1\r\n", "the model is loading");
        return;
    }
    json_t *body = parse_body(c, req);
    if (!body)
        return;
    struct verr e = {0};
    struct toks t = {0};
    json_t *arr = field(body, "tokens");
    if (!arr) {
        fail(&e, "tokens", "missing_field", "'tokens' (an array of token ids) is required");
    } else if (!json_is_array(arr)) {
        fail(&e, "tokens", "invalid_type", "'tokens' must be an array of token ids, not %s",
             json_type_name(arr));
    } else {
        size_t i;
        json_t *v;
        json_array_foreach(arr, i, v)
        {
            if (!json_is_integer(v)) {
                fail(&e, "tokens", "invalid_type",
                     "'tokens' must contain only token ids (integers); element %zu is %s", i,
                     json_type_name(v));
                break;
            }
            if (push_token(a, v, "tokens", &t, &e))
                break;
        }
    }
    json_decref(body);
    if (e.status) {
        api_error_code(c, e.status, e.param, e.code, NULL, "%s", e.msg);
        free(t.v);
        return;
    }
    char *text = NULL;
    size_t cap = 0;
    int n = decode(a, t.v, t.n, &text, &cap);
    free(t.v);
    if (n < 0) {
        free(text);
        api_error(c, 500, NULL, "out of memory decoding the tokens");
        return;
    }
    respond_json(c, 200, json_pack("{s:o}", "content", json_text(text ? text : "", (size_t)n)));
    free(text);
}

static void route_models(srv_api *a, srv_conn *c)
{
    json_t *data = json_array();
    if (a->m)
        json_array_append_new(
            data, json_pack("{s:s, s:s, s:I, s:s, s:{s:s, s:i, s:i, s:i, s:s}}", "id",
                            a->model_name, "object", "model", "created", (json_int_t)a->ready_time,
                            "owned_by", "kvd", "meta", "arch", a->info.arch, "n_vocab",
                            a->info.n_vocab, "n_ctx_train", a->info.n_ctx_train, "n_layer",
                            a->info.n_layer, "positions", pos_kind_name(a->info.pos)));
    respond_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

/* Whether the engine thread has been in one step longer than the
 * configured engine_stall_timeout (the reason in msg). */
static bool engine_stalled(srv_api *a, char *msg, size_t len)
{
    uint64_t busy = srv_sched_busy_ms(a->sched);
    if (!a->p.engine_stall_ms || busy <= a->p.engine_stall_ms)
        return false;
    snprintf(msg, len, "the engine has been in one step for %" PRIu64 " ms (engine_stall_timeout %" PRIu64 " ms)",
             busy, a->p.engine_stall_ms);
    return true;
}

static void route_health(srv_api *a, srv_conn *c)
{
    char msg[160];
    if (a->draining)
        api_error_code(c, 503, NULL, "draining", NULL, "the server is shutting down");
    else if (!a->m)
        api_error_code(c, 503, NULL, "loading", NULL, "the model is loading");
    else if (engine_stalled(a, msg, sizeof(msg)))
        api_error_code(c, 503, NULL, "engine_stalled", NULL, "%s", msg);
    else
        respond_json(c, 200, json_pack("{s:s}", "status", "ok"));
}

/* The process's resident set in bytes (/proc/self/statm), or -1. */
static long long process_rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    long long size = 0, resident = -1;
    if (fscanf(f, "%lld %lld", &size, &resident) != 2)
        resident = -1;
    fclose(f);
    long page = sysconf(_SC_PAGESIZE);
    return resident < 0 || page <= 0 ? -1 : resident * page;
}

/* The metrics, plus the standard process_resident_memory_bytes gauge
 * (what load tests read beside the KV pages used). */
static void route_metrics(srv_api *a, srv_conn *c)
{
    size_t len = 0;
    char *text = srv_metrics_render(a->metrics, &len);
    long long rss = process_rss_bytes();
    char extra[256] = "";
    int n = rss < 0 ? 0
                    : snprintf(extra, sizeof(extra),
                               "# HELP process_resident_memory_bytes Resident memory size in "
                               "bytes.\n# TYPE process_resident_memory_bytes gauge\n"
                               "process_resident_memory_bytes %lld\n",
                               rss);
    char *all = text ? realloc(text, len + (size_t)n + 1) : NULL;
    if (!all) {
        free(text);
        api_error(c, 500, NULL, "out of memory rendering metrics");
        return;
    }
    memcpy(all + len, extra, (size_t)n + 1);
    srv_http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", "", all, len + (size_t)n);
    free(all);
}

/* GET /v1/config: the effective config with each key's origin, as `kvd
 * check-config` prints it (the daemon's program renders it at start and on
 * each reload; the API key's value never appears). */
static void route_config(srv_api *a, srv_conn *c)
{
    if (!a->config_json) {
        api_error(c, 404, NULL, "this server was started without a config to show");
        return;
    }
    srv_http_respond(c, 200, "application/json", "Cache-Control: no-store\r\n", a->config_json,
                     strlen(a->config_json));
}

/* Constant-time comparison of the bearer token. */
static bool auth_ok(srv_api *a, const struct srv_http_req *req)
{
    if (!a->api_key[0])
        return true;
    const char *h = srv_http_header(req, "authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    const char *tok = h + 7;
    while (*tok == ' ')
        tok++;
    size_t n = strlen(tok), m = strlen(a->api_key);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < m; i++)
        diff |=
            (unsigned)(unsigned char)a->api_key[i] ^ (unsigned)(unsigned char)(i < n ? tok[i] : 0);
    return diff == 0;
}

void srv_api_handle(void *ud, srv_conn *c, const struct srv_http_req *req)
{
    srv_api *a = ud;
    const char *path = req->path;
    const char *m = req->method;
    /* HEAD is GET without the body (the HTTP layer drops it). */
    bool get = !strcmp(m, "GET") || !strcmp(m, "HEAD"), post = !strcmp(m, "POST"),
         del = !strcmp(m, "DELETE");

    enum {
        R_NONE,
        R_HEALTH,
        R_METRICS,
        R_OPENAI,
        R_LLAMA,
        R_MODELS,
        R_SESSION,
        R_TOKENIZE,
        R_DETOKENIZE,
        R_CHAT,
        R_APPLY_TEMPLATE,
        R_SESSION_MAP,
        R_CONFIG
    } r = R_NONE;
    const char *allow = NULL;
    const char *sess = NULL;
    char map_id[256];
    /* The page's files: no data in them, so no key (web.h). */
    const struct srv_web_asset *asset = srv_web_find(path);
    if (asset) {
        srv_web_respond(c, req, asset);
        return;
    }
    if (!strcmp(path, "/v1/config")) {
        r = R_CONFIG;
        allow = "GET, HEAD";
    } else if (srv_map_path(path, map_id, sizeof(map_id))) {
        r = R_SESSION_MAP;
        allow = "GET, HEAD";
        sess = map_id;
    } else if (!strcmp(path, "/health")) {
        r = R_HEALTH;
        allow = "GET, HEAD";
    } else if (!strcmp(path, "/metrics")) {
        r = R_METRICS;
        allow = "GET, HEAD";
    } else if (!strcmp(path, "/v1/completions") || !strcmp(path, "/completions")) {
        r = R_OPENAI;
        allow = "POST";
    } else if (!strcmp(path, "/completion")) {
        r = R_LLAMA;
        allow = "POST";
    } else if (!strcmp(path, "/v1/chat/completions") || !strcmp(path, "/chat/completions")) {
        r = R_CHAT;
        allow = "POST";
    } else if (!strcmp(path, "/apply-template")) {
        r = R_APPLY_TEMPLATE;
        allow = "POST";
    } else if (!strcmp(path, "/v1/models") || !strcmp(path, "/models")) {
        r = R_MODELS;
        allow = "GET, HEAD";
    } else if (!strcmp(path, "/tokenize")) {
        r = R_TOKENIZE;
        allow = "POST";
    } else if (!strcmp(path, "/detokenize")) {
        r = R_DETOKENIZE;
        allow = "POST";
    } else if (!strncmp(path, "/v1/sessions/", 13) && path[13]) {
        r = R_SESSION;
        allow = "GET, HEAD, DELETE";
        sess = path + 13;
    }
    if (r == R_NONE) {
        api_error(c, 404, NULL, "no route for %s %s", m, path);
        return;
    }
    bool allowed = r == R_OPENAI || r == R_LLAMA || r == R_TOKENIZE || r == R_DETOKENIZE ||
                           r == R_CHAT || r == R_APPLY_TEMPLATE
                       ? post
                   : r == R_SESSION ? get || del
                                    : get;
    if (!allowed) {
        char hdr[64];
        snprintf(hdr, sizeof(hdr), "Allow: %s\r\n", allow);
        api_error_code(c, 405, NULL, NULL, hdr, "%s is not allowed on %s; use %s", m, path, allow);
        return;
    }
    /* /health and /metrics stay open for probes and scrapers. */
    if (r != R_HEALTH && r != R_METRICS && !auth_ok(a, req)) {
        api_error_code(c, 401, NULL, NULL, "WWW-Authenticate: Bearer\r\n",
                       "a valid API key is required: send 'Authorization: Bearer KEY'");
        return;
    }
    switch (r) {
    case R_HEALTH:
        route_health(a, c);
        break;
    case R_METRICS:
        route_metrics(a, c);
        break;
    case R_OPENAI:
        route_completion(a, c, req, CALL_OPENAI);
        break;
    case R_LLAMA:
        route_completion(a, c, req, CALL_LLAMA);
        break;
    case R_CHAT:
        route_completion(a, c, req, CALL_CHAT);
        break;
    case R_APPLY_TEMPLATE:
        route_apply_template(a, c, req);
        break;
    case R_MODELS:
        route_models(a, c);
        break;
    case R_SESSION:
        route_session(a, c, req, sess, del ? CALL_SESSION_DELETE : CALL_SESSION_GET);
        break;
    case R_SESSION_MAP:
        route_session(a, c, req, sess, CALL_SESSION_MAP);
        break;
    case R_CONFIG:
        route_config(a, c);
        break;
    case R_TOKENIZE:
        route_tokenize(a, c, req);
        break;
    case R_DETOKENIZE:
        route_detokenize(a, c, req);
        break;
    case R_NONE:
        break;
    }
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

srv_api *srv_api_create(srv_sched *sched, srv_metrics *metrics, const struct srv_api_params *p)
{
    srv_api *a = calloc(1, sizeof(*a));
    if (!a)
        return NULL;
    a->sched = sched;
    a->metrics = metrics;
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
        call_free(call);
    }
    model_detok_destroy(a->piece_detok);
    free(a->piece_buf);
    tpl_chat_destroy(a->chat);
    free(a->config_json);
    while (a->chat_sess) {
        struct chat_sess *x = a->chat_sess;
        a->chat_sess = x->next;
        chat_sess_free(x);
    }
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
