/*
 * config.c - the key table and everything it drives: defaults, parsing of
 * the file and of --set overrides, cross-key rules, the dump and reload.
 *
 * One row of `keys[]` per setting, in the manner of Redis's standardConfig:
 * section, name, type, where the value lives in struct cfg, the default as
 * kvd.conf spells it, bounds, unit, one line of documentation, and whether
 * a running server may apply a change (live) or needs a restart. Nothing
 * else in this file knows a key by name except the cross-key rules, which
 * are about specific keys by nature.
 *
 * The file is read by libinih. Debian's libinih is built without
 * INI_HANDLER_LINENO, so the handler is not told the line number. We feed
 * inih through ini_parse_stream() with our own reader (read_line below):
 * it hands inih one physical line per call and counts them, and inih calls
 * the handler for a line before asking for the next one, so the count is
 * the line of the key being handled. The reader also sees every line first,
 * which is how lines inih would only count as "first error at line N" get
 * their own messages: lines without '=', unclosed or unknown section
 * headers, over-long lines. It strips leading whitespace, so inih never
 * treats an indented line as a continuation of the previous value.
 *
 * Every error is collected; nothing stops at the first.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <ini.h>

#include "config/config.h"
#include "config/config_internal.h"

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

/*
 * snprintf for messages that may be cut short on purpose (a long value or
 * path in a bounded error field); the return value is still the full length.
 */
__attribute__((format(printf, 3, 4))) static int fmt(char *buf, size_t len, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    int n = vsnprintf(buf, len, f, ap);
    va_end(ap);
    return n;
}

/* --- the table ---------------------------------------------------------------- */

enum ktype { T_INT, T_SIZE, T_DURATION, T_BOOL, T_ENUM, T_STRING, T_NUMBER };

struct key_def {
    const char *section;
    const char *name;
    enum ktype type;
    size_t offset;            /* of the value in struct cfg */
    size_t size;              /* bytes of the value (T_STRING: the buffer) */
    const char *def;          /* default, spelled as in kvd.conf */
    int64_t min, max;         /* T_INT; T_SIZE in bytes; T_DURATION in ms */
    double fmin, fmax;        /* T_NUMBER */
    const char *const *names; /* T_ENUM: spellings, NULL-terminated; index = value */
    const char *unit;         /* what a T_INT counts ("tokens"); NULL if nothing */
    const char *doc;          /* one line: what the key changes */
    bool live;                /* a running server applies changes on reload */
    bool secret;              /* never echoed in errors or dumps */
    int (*check)(const char *s, char *err, size_t errlen); /* T_STRING: extra syntax */
};

static const char *const kv_type_names[] = {"f16", "f32", "bf16", "q8_0", "q4_0", NULL};
/* k_type / v_type: the same spellings, and "kv_type" for the shorthand's value */
static const char *const kv_side_names[] = {"f16", "f32", "bf16", "q8_0", "q4_0", "kv_type", NULL};
_Static_assert(CFG_KV_SAME == 5, "kv_side_names spells CFG_KV_SAME last");
static const char *const policy_names[] = {"none", "sink-window", "h2o", NULL};
static const char *const positions_names[] = {"renumber", "preserve", NULL};
static const char *const unit_names[] = {"turn", "token", NULL};
_Static_assert(sizeof(kv_type_names) / sizeof(kv_type_names[0]) == CFG_KV_TYPE_COUNT + 1 &&
                   sizeof(policy_names) / sizeof(policy_names[0]) == CFG_EVICT_COUNT + 1 &&
                   sizeof(positions_names) / sizeof(positions_names[0]) == CFG_POS_COUNT + 1,
               "one spelling per enum value");
static const char *const level_names[] = {"debug", "info", "warn", "error", NULL};
static const char *const format_names[] = {"text", "json", NULL};

_Static_assert(sizeof(enum cfg_kv_type) == sizeof(int) && sizeof(enum cfg_policy) == sizeof(int) &&
                   sizeof(enum cfg_positions) == sizeof(int) &&
                   sizeof(enum cfg_evict_unit) == sizeof(int) &&
                   sizeof(enum cfg_log_level) == sizeof(int) &&
                   sizeof(enum cfg_log_format) == sizeof(int),
               "enum fields are stored as int");

/* offsetof that fails to compile unless the field has type T. */
#define AT(f, T) (offsetof(struct cfg, f) + 0 * sizeof(_Generic(((struct cfg *)0)->f, T : 1)))
#define SZ(f) sizeof(((struct cfg *)0)->f)

#define LIVE true
#define RESTART false
#define MiB (1ll << 20)
#define GiB (1ll << 30)
#define TiB (1ll << 40)
#define SEC 1000ll
#define MIN (60 * SEC)
#define HOUR (60 * MIN)
#define DAY (24 * HOUR)

#define INT(s, k, f, def, lo, hi, unit, live, doc)                                                 \
    {                                                                                              \
        s, k, T_INT, AT(f, int64_t), SZ(f), def, lo, hi, 0, 0, NULL, unit, doc, live, false, NULL  \
    }
#define SIZE(s, k, f, def, lo, hi, live, doc)                                                      \
    {                                                                                              \
        s, k, T_SIZE, AT(f, uint64_t), SZ(f), def, lo, hi, 0, 0, NULL, NULL, doc, live, false,     \
            NULL                                                                                   \
    }
#define DURATION(s, k, f, def, lo, hi, live, doc)                                                  \
    {                                                                                              \
        s, k, T_DURATION, AT(f, uint64_t), SZ(f), def, lo, hi, 0, 0, NULL, NULL, doc, live, false, \
            NULL                                                                                   \
    }
#define BOOL(s, k, f, def, live, doc)                                                              \
    {                                                                                              \
        s, k, T_BOOL, AT(f, bool), SZ(f), def, 0, 1, 0, 0, NULL, NULL, doc, live, false, NULL      \
    }
#define ENUM(s, k, f, def, names, live, doc)                                                       \
    {                                                                                              \
        s, k, T_ENUM, offsetof(struct cfg, f), SZ(f), def, 0, 0, 0, 0, names, NULL, doc, live,     \
            false, NULL                                                                            \
    }
#define STRING(s, k, f, def, live, secret, check, doc)                                             \
    {                                                                                              \
        s, k, T_STRING, AT(f, char *), SZ(f), def, 0, 0, 0, 0, NULL, NULL, doc, live, secret,      \
            check                                                                                  \
    }
#define NUMBER(s, k, f, def, lo, hi, live, doc)                                                    \
    {                                                                                              \
        s, k, T_NUMBER, AT(f, double), SZ(f), def, 0, 0, lo, hi, NULL, NULL, doc, live, false,     \
            NULL                                                                                   \
    }

static int check_listen(const char *s, char *err, size_t errlen)
{
    return cfg_check_listen(s, err, errlen);
}

static int check_nonempty(const char *s, char *err, size_t errlen)
{
    if (*s)
        return 0;
    fmt(err, errlen, "must not be empty");
    return -EINVAL;
}

/* A tokenizer.ggml.pre spelling: empty, or letters, digits and "-._" (the
 * model room checks the name itself when it loads the file). */
static int check_pre_name(const char *s, char *err, size_t errlen)
{
    for (const char *p = s; *p; p++) {
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '.' || *p == '_')) {
            fmt(err, errlen, "'%c' cannot be part of a pre-tokenizer name", *p);
            return -EINVAL;
        }
    }
    return 0;
}

static const struct key_def keys[CFG_N_KEYS] = {
    /* [server] */
    [CFG_SERVER_LISTEN] = STRING(
        "server", "listen", server.listen, "127.0.0.1:8080", RESTART, false, check_listen,
        "address and port to accept HTTP on (HOST:PORT, [IPv6]:PORT; port 0 = any free port)"),
    [CFG_SERVER_THREADS] = INT("server", "threads", server.threads, "0", 0, 1024, "threads",
                               RESTART, "compute threads of the engine; 0 = one per core"),
    [CFG_SERVER_DRAIN_TIMEOUT] =
        DURATION("server", "drain_timeout", server.drain_timeout_ms, "30s", 0, HOUR, LIVE,
                 "on SIGTERM, how long running requests may finish before they are cut"),
    [CFG_SERVER_MAX_CONNECTIONS] =
        INT("server", "max_connections", server.max_connections, "512", 1, 65536, "connections",
            LIVE, "open client connections; further ones are closed at accept"),
    /* [model] */
    [CFG_MODEL_PATH] = STRING("model", "path", model.path, "models/default.gguf", RESTART, false,
                              check_nonempty, "GGUF model file to serve"),
    [CFG_MODEL_ALIBI_MAX_BIAS] =
        NUMBER("model", "alibi_max_bias", model.alibi_max_bias, "0", 0, 64, RESTART,
               "ALiBi max_bias for ALiBi models whose file lacks it; 0 = none"),
    [CFG_MODEL_T5_NUM_BUCKETS] =
        INT("model", "t5_num_buckets", model.t5_num_buckets, "0", 0, 1024, "buckets", RESTART,
            "T5 relative-position buckets for T5-bias models whose file lacks them; 0 = none"),
    [CFG_MODEL_T5_MAX_DISTANCE] =
        INT("model", "t5_max_distance", model.t5_max_distance, "0", 0, 1 << 20, "tokens", RESTART,
            "T5 distance where the last bucket saturates, with t5_num_buckets; 0 = none"),
    [CFG_MODEL_TOKENIZER_PRE] =
        STRING("model", "tokenizer_pre", model.tokenizer_pre, "", RESTART, false, check_pre_name,
               "pre-tokenizer used instead of the file's tokenizer.ggml.pre (llama-bpe, qwen2, "
               "deepseek-llm, tekken, ...); empty = the file's"),
    [CFG_MODEL_CHAT_TEMPLATE] =
        STRING("model", "chat_template", model.chat_template, "", RESTART, false, NULL,
               "Jinja chat template file used instead of the model's own; empty = the model's "
               "tokenizer.chat_template, or ChatML when it has none"),
    /* [cache] */
    [CFG_CACHE_MEMORY] = SIZE("cache", "memory", cache.memory, "512MiB", MiB, TiB, RESTART,
                              "bytes of KV cache pages, shared by all sequences"),
    [CFG_CACHE_PAGE_TOKENS] =
        INT("cache", "page_tokens", cache.page_tokens, "16", 1, 4096, "tokens", RESTART,
            "tokens per cache page: the unit of allocation and eviction"),
    [CFG_CACHE_KV_TYPE] = ENUM("cache", "kv_type", cache.kv_type, "f16", kv_type_names, RESTART,
                               "element type keys and values are stored in (both)"),
    [CFG_CACHE_K_TYPE] = ENUM("cache", "k_type", cache.k_type, "kv_type", kv_side_names, RESTART,
                              "element type of keys; kv_type = as kv_type says"),
    [CFG_CACHE_V_TYPE] = ENUM("cache", "v_type", cache.v_type, "kv_type", kv_side_names, RESTART,
                              "element type of values; kv_type = as kv_type says"),
    [CFG_CACHE_MLOCK] = BOOL("cache", "mlock", cache.mlock, "false", RESTART,
                             "lock the cache pool in RAM so it is never swapped out"),
    /* [eviction] */
    [CFG_EVICTION_POLICY] = ENUM("eviction", "policy", eviction.policy, "sink-window", policy_names,
                                 LIVE, "what happens when a sequence reaches max_cache_tokens"),
    [CFG_EVICTION_MAX_CACHE_TOKENS] =
        INT("eviction", "max_cache_tokens", eviction.max_cache_tokens, "4096", 1, 1 << 24, "tokens",
            LIVE, "tokens one sequence may hold in the cache"),
    [CFG_EVICTION_SINK_TOKENS] =
        INT("eviction", "sink_tokens", eviction.sink_tokens, "4", 0, 1 << 20, "tokens", LIVE,
            "first tokens of a sequence that are never evicted"),
    [CFG_EVICTION_WINDOW_TOKENS] =
        INT("eviction", "window_tokens", eviction.window_tokens, "0", 0, 1 << 24, "tokens", LIVE,
            "most recent tokens kept; 0 = what the budget leaves after the sinks (h2o: and heavy "
            "tokens) and one page"),
    [CFG_EVICTION_HEAVY_TOKENS] =
        INT("eviction", "heavy_tokens", eviction.heavy_tokens, "1024", 0, 1 << 24, "tokens", LIVE,
            "h2o only: tokens kept for their accumulated attention mass"),
    [CFG_EVICTION_POSITIONS] =
        ENUM("eviction", "positions", eviction.positions, "renumber", positions_names, LIVE,
             "position numbers after eviction: renumber 0..n-1, or preserve the first ones"),
    [CFG_EVICTION_UNIT] =
        ENUM("eviction", "unit", eviction.unit, "turn", unit_names, LIVE,
             "chat requests: turn = whole oldest turns leave (system, tools, last user turn "
             "kept); token = the policy evicts tokens"),
    [CFG_EVICTION_SESSION_IDLE_TIMEOUT] = DURATION(
        "eviction", "session_idle_timeout", eviction.session_idle_timeout_ms, "30m", 0, 30 * DAY,
        LIVE, "drop a session unused this long; 0 = only when the pool is short"),
    [CFG_EVICTION_MAX_SESSIONS] =
        INT("eviction", "max_sessions", eviction.max_sessions, "64", 0, 1 << 20, "sessions", LIVE,
            "sessions kept between requests, least recently used dropped first; 0 = none"),
    /* [limits] */
    [CFG_LIMITS_MAX_HEADER_BYTES] =
        SIZE("limits", "max_header_bytes", limits.max_header_bytes, "16KiB", 1024, MiB, LIVE,
             "request line and headers; larger requests get 431"),
    [CFG_LIMITS_MAX_HEADERS] = INT("limits", "max_headers", limits.max_headers, "64", 1, 1024,
                                   "headers", LIVE, "header fields per request; more get 431"),
    [CFG_LIMITS_MAX_BODY_BYTES] = SIZE("limits", "max_body_bytes", limits.max_body_bytes, "8MiB",
                                       1024, GiB, LIVE, "request body; larger bodies get 413"),
    [CFG_LIMITS_HEADER_TIMEOUT] =
        DURATION("limits", "header_timeout", limits.header_timeout_ms, "10s", 100, HOUR, LIVE,
                 "time a client has to send the whole header block (slow clients get 408)"),
    [CFG_LIMITS_IDLE_TIMEOUT] =
        DURATION("limits", "idle_timeout", limits.idle_timeout_ms, "1m", 100, DAY, LIVE,
                 "a connection silent this long between requests, or whose reader takes less "
                 "than 64KiB of a waiting answer in this time, is closed"),
    [CFG_LIMITS_BODY_TIMEOUT] =
        DURATION("limits", "body_timeout", limits.body_timeout_ms, "1m", 100, HOUR, LIVE,
                 "time a client has to send the whole body once its headers are in (408)"),
    [CFG_LIMITS_WRITE_BUFFER] =
        SIZE("limits", "write_buffer", limits.write_buffer, "1MiB", 65536, GiB, LIVE,
             "streamed answer bytes a reader may leave untaken before its generation pauses"),
    [CFG_LIMITS_MAX_PROMPT_TOKENS] =
        INT("limits", "max_prompt_tokens", limits.max_prompt_tokens, "32768", 1, 1 << 24, "tokens",
            LIVE, "prompts longer than this are rejected with 400"),
    [CFG_LIMITS_MAX_TOKENS] =
        INT("limits", "max_tokens", limits.max_tokens, "4096", 1, 1 << 24, "tokens", LIVE,
            "cap on a request's max_tokens, and its value when the request omits it"),
    [CFG_LIMITS_QUEUE_LENGTH] =
        INT("limits", "queue_length", limits.queue_length, "64", 0, 65536, "requests", LIVE,
            "requests waiting for a batch slot; beyond it, 429 with Retry-After; 0 = no waiting"),
    [CFG_LIMITS_MAX_RUNNING] =
        INT("limits", "max_running", limits.max_running, "8", 1, 1024, "sequences", LIVE,
            "sequences decoded together in one engine batch"),
    [CFG_LIMITS_STEP_TOKENS] =
        INT("limits", "step_tokens", limits.step_tokens, "512", 1, 1 << 20, "tokens", LIVE,
            "tokens per engine step: decodes first, prompts fill the rest in chunks"),
    /* [auth] */
    [CFG_AUTH_API_KEY] =
        STRING("auth", "api_key", auth.api_key, "", LIVE, true, NULL,
               "bearer token clients must send (Authorization: Bearer ...); empty = no auth"),
    [CFG_AUTH_API_KEY_FILE] =
        STRING("auth", "api_key_file", auth.api_key_file, "", LIVE, false, NULL,
               "file whose first line is the token (instead of api_key); empty = none"),
    /* [log] */
    [CFG_LOG_LEVEL] =
        ENUM("log", "level", log.level, "info", level_names, LIVE, "least severe messages logged"),
    [CFG_LOG_FORMAT] = ENUM("log", "format", log.format, "text", format_names, LIVE,
                            "log lines as plain text or one JSON object each"),
};

static const char *const sections[] = {"server", "model", "cache", "eviction",
                                       "limits", "auth",  "log"};

/* --- errors ----------------------------------------------------------------------- */

void cfg_errors_init(struct cfg_errors *errs)
{
    errs->count = 0;
    errs->dropped = 0;
}

static void copy_str(char *dst, size_t size, const char *src)
{
    fmt(dst, size, "%s", src ? src : "");
}

__attribute__((format(printf, 5, 6))) static void add_error(struct cfg_errors *errs,
                                                            const char *source, int line,
                                                            const char *key, const char *format,
                                                            ...)
{
    if (errs->count >= CFG_MAX_ERRORS) {
        errs->dropped++;
        return;
    }
    struct cfg_error *e = &errs->list[errs->count++];
    copy_str(e->source, sizeof(e->source), source);
    e->line = line;
    copy_str(e->key, sizeof(e->key), key);
    va_list ap;
    va_start(ap, format);
    vsnprintf(e->message, sizeof(e->message), format, ap);
    va_end(ap);
}

int cfg_error_format(const struct cfg_error *e, char *buf, size_t len)
{
    if (e->line > 0)
        return fmt(buf, len, "%s:%d: %s", e->source, e->line, e->message);
    return fmt(buf, len, "%s: %s", e->source, e->message);
}

/* --- the table's accessors ----------------------------------------------------------- */

static void *field(struct cfg *c, int k)
{
    return (char *)c + keys[k].offset;
}

static const void *cfield(const struct cfg *c, int k)
{
    return (const char *)c + keys[k].offset;
}

const char *cfg_key_section(enum cfg_key k)
{
    return keys[k].section;
}

const char *cfg_key_name(enum cfg_key k)
{
    return keys[k].name;
}

const char *cfg_key_doc(enum cfg_key k)
{
    return keys[k].doc;
}

bool cfg_key_live(enum cfg_key k)
{
    return keys[k].live;
}

int cfg_key_find(const char *section, const char *name)
{
    for (int k = 0; k < CFG_N_KEYS; k++)
        if (!strcmp(keys[k].section, section) && !strcmp(keys[k].name, name))
            return k;
    return -1;
}

static bool section_known(const char *s)
{
    for (size_t i = 0; i < N_ELEMS(sections); i++)
        if (!strcmp(sections[i], s))
            return true;
    return false;
}

/* "an integer in [1, 4096]", "a size in [1MiB, 1TiB]", "one of: a, b". */
static int describe_accepted(const struct key_def *d, char *buf, size_t len)
{
    char lo[32], hi[32];
    switch (d->type) {
    case T_INT:
        return fmt(buf, len, "an integer in [%" PRId64 ", %" PRId64 "]", d->min, d->max);
    case T_SIZE:
        cfg_format_size((uint64_t)d->min, lo, sizeof(lo));
        cfg_format_size((uint64_t)d->max, hi, sizeof(hi));
        return fmt(buf, len, "a size in [%s, %s]", lo, hi);
    case T_DURATION:
        cfg_format_duration((uint64_t)d->min, lo, sizeof(lo));
        cfg_format_duration((uint64_t)d->max, hi, sizeof(hi));
        return fmt(buf, len, "a duration in [%s, %s]", lo, hi);
    case T_NUMBER:
        return fmt(buf, len, "a number in [%g, %g]", d->fmin, d->fmax);
    case T_BOOL:
        return fmt(buf, len, "a boolean (true/false, yes/no, on/off, 1/0)");
    case T_ENUM: {
        int n = fmt(buf, len, "one of:");
        for (int i = 0; d->names[i]; i++) {
            size_t at = (size_t)n < len ? (size_t)n : len;
            n += fmt(buf + at, len - at, "%s %s", i ? "," : "", d->names[i]);
        }
        return n;
    }
    case T_STRING:
        return fmt(buf, len, "a string of at most %zu bytes", d->size - 1);
    }
    return 0;
}

int cfg_key_describe(enum cfg_key k, char *buf, size_t len)
{
    const struct key_def *d = &keys[k];
    char acc[160];
    describe_accepted(d, acc, sizeof(acc));
    /* Drop the article: "integer in [1, 4096]" reads better in a list. */
    const char *a = acc;
    if (!strncmp(a, "a ", 2))
        a += 2;
    else if (!strncmp(a, "an ", 3))
        a += 3;
    if (d->type == T_INT && d->unit) {
        /* "integer (tokens) in [1, 4096]" */
        const char *in = strstr(a, " in ");
        return fmt(buf, len, "%.*s (%s)%s; default %s", (int)(in - a), a, d->unit, in, d->def);
    }
    return fmt(buf, len, "%s; default %s", a, *d->def ? d->def : "empty");
}

/* --- parsing one value ---------------------------------------------------------------- */

/*
 * Parse `s` as key d's type and store it in c. On failure *c is unchanged
 * and `why` says what is accepted.
 */
static int parse_value(const struct key_def *d, const char *s, struct cfg *c, int k, char *why,
                       size_t whylen)
{
    char acc[160], detail[200];
    describe_accepted(d, acc, sizeof(acc));
    void *dst = field(c, k);
    switch (d->type) {
    case T_INT: {
        int64_t v;
        if (cfg_parse_int(s, &v) || v < d->min || v > d->max)
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case T_SIZE:
    case T_DURATION: {
        uint64_t v;
        int rc = d->type == T_SIZE ? cfg_parse_size(s, &v, detail, sizeof(detail))
                                   : cfg_parse_duration(s, &v, detail, sizeof(detail));
        if (rc) { /* bad syntax, unknown unit, or over 2^64 - 1 */
            fmt(why, whylen, "%s; must be %s", detail, acc);
            return -EINVAL;
        }
        if (v < (uint64_t)d->min || v > (uint64_t)d->max)
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case T_NUMBER: {
        double v;
        if (cfg_parse_number(s, &v) || !(v >= d->fmin && v <= d->fmax))
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case T_BOOL: {
        bool v;
        if (cfg_parse_bool(s, &v))
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case T_ENUM:
        for (int i = 0; d->names[i]; i++) {
            if (!strcmp(s, d->names[i])) {
                memcpy(dst, &i, sizeof(i));
                return 0;
            }
        }
        goto out_range;
    case T_STRING:
        if (strlen(s) >= d->size) {
            fmt(why, whylen, "longer than %zu bytes", d->size - 1);
            return -EINVAL;
        }
        if (d->check && d->check(s, detail, sizeof(detail))) {
            fmt(why, whylen, "%s", detail);
            return -EINVAL;
        }
        memcpy(dst, s, strlen(s) + 1);
        return 0;
    }
out_range:
    fmt(why, whylen, "must be %s", acc);
    return -EINVAL;
}

int cfg_format_value(const struct cfg *c, enum cfg_key k, char *buf, size_t len)
{
    const struct key_def *d = &keys[k];
    const void *src = cfield(c, k);
    int64_t i;
    uint64_t u;
    double f;
    int e;
    switch (d->type) {
    case T_INT:
        memcpy(&i, src, sizeof(i));
        return fmt(buf, len, "%" PRId64, i);
    case T_SIZE:
        memcpy(&u, src, sizeof(u));
        return cfg_format_size(u, buf, len);
    case T_DURATION:
        memcpy(&u, src, sizeof(u));
        return cfg_format_duration(u, buf, len);
    case T_NUMBER:
        memcpy(&f, src, sizeof(f));
        return fmt(buf, len, "%.17g", f);
    case T_BOOL:
        return fmt(buf, len, "%s", *(const bool *)src ? "true" : "false");
    case T_ENUM:
        memcpy(&e, src, sizeof(e));
        return fmt(buf, len, "%s", d->names[e]);
    case T_STRING:
        return fmt(buf, len, "%s", (const char *)src);
    }
    return 0;
}

int cfg_format_origin(const struct cfg *c, enum cfg_key k, char *buf, size_t len)
{
    switch (c->origin[k].kind) {
    case CFG_FROM_FILE:
        return fmt(buf, len, "%s:%d", c->file, c->origin[k].line);
    case CFG_FROM_CMDLINE:
        return fmt(buf, len, "command line");
    case CFG_FROM_DEFAULT:
        break;
    }
    return fmt(buf, len, "default");
}

bool cfg_value_equal(const struct cfg *a, const struct cfg *b, enum cfg_key k)
{
    const struct key_def *d = &keys[k];
    if (d->type == T_STRING)
        return !strcmp(cfield(a, k), cfield(b, k));
    if (d->type == T_NUMBER) {
        double x, y;
        memcpy(&x, cfield(a, k), sizeof(x));
        memcpy(&y, cfield(b, k), sizeof(y));
        return x == y;
    }
    return !memcmp(cfield(a, k), cfield(b, k), d->size);
}

void cfg_defaults(struct cfg *c)
{
    memset(c, 0, sizeof(*c));
    for (int k = 0; k < CFG_N_KEYS; k++) {
        char why[256];
        int rc = parse_value(&keys[k], keys[k].def, c, k, why, sizeof(why));
        /* The table's defaults are constants; test_config checks each parses. */
        if (rc)
            abort();
        c->origin[k] = (struct cfg_origin){CFG_FROM_DEFAULT, 0};
    }
}

/* --- suggestions -------------------------------------------------------------------- */

/* Folded for comparison: case-insensitive, '-' and '_' alike. */
static int fold(int ch)
{
    if (ch == '-')
        return '_';
    return ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch;
}

/* Levenshtein distance of two short strings (inputs beyond 63 bytes: far). */
static int edit_distance(const char *a, const char *b)
{
    size_t n = strlen(a), m = strlen(b);
    if (n > 63 || m > 63)
        return 1000;
    int row[64];
    for (size_t j = 0; j <= m; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= n; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= m; j++) {
            int up = row[j];
            int cost = fold((unsigned char)a[i - 1]) != fold((unsigned char)b[j - 1]);
            int best = diag + cost;
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[m];
}

/* How far a misspelling may be from a name to be suggested. */
static int max_distance(const char *s)
{
    int n = (int)strlen(s) / 3;
    return n < 1 ? 1 : n > 3 ? 3 : n;
}

/*
 * The key closest to `name`: keys of `section` first, then a key of that
 * spelling in another section. Returns the key or -1 if nothing is close.
 */
static int suggest_key(const char *section, const char *name)
{
    int best = -1, best_score = 1 << 30, limit = max_distance(name);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        int d = edit_distance(name, keys[k].name);
        if (d > limit)
            continue;
        int score = 2 * d + (strcmp(keys[k].section, section) ? 1 : 0);
        if (score < best_score) {
            best_score = score;
            best = k;
        }
    }
    return best;
}

static const char *suggest_section(const char *name)
{
    const char *best = NULL;
    int best_d = max_distance(name) + 1;
    for (size_t i = 0; i < N_ELEMS(sections); i++) {
        int d = edit_distance(name, sections[i]);
        if (d < best_d) {
            best_d = d;
            best = sections[i];
        }
    }
    return best;
}

/* --- applying one key = value ------------------------------------------------------------ */

/* State of one parse: a file, a string, or the command line. */
struct load_ctx {
    struct cfg *c;
    struct cfg_errors *errs;
    const char *source;   /* file name as given, or "command line" */
    bool cli;             /* --set: origins CFG_FROM_CMDLINE, suggestions as section.key */
    int line;             /* file: the line being handled */
    bool *failed;         /* [CFG_N_KEYS]: keys whose value was rejected; may be NULL */
    int seen[CFG_N_KEYS]; /* file: the line that set each key, 0 = not yet */

    /* The reader's position in the text (files and strings). */
    const char *text;
    size_t len, pos;
    bool bad_section; /* the current section header was rejected: skip its keys */
};

/* A value for an error message: secrets hidden, long values shortened. */
static void echo(const struct key_def *d, const char *value, char *buf, size_t len)
{
    if (d && d->secret)
        fmt(buf, len, "(hidden)");
    else if (strlen(value) > 60)
        fmt(buf, len, "%.57s...", value);
    else
        fmt(buf, len, "%s", value);
}

static void report_unknown_key(struct load_ctx *x, const char *section, const char *name)
{
    char key[96], hint[160] = "";
    fmt(key, sizeof(key), "%s.%s", section, name);
    int s = suggest_key(section, name);
    if (s >= 0 && (x->cli || strcmp(keys[s].section, section)))
        fmt(hint, sizeof(hint), x->cli ? "; did you mean %s.%s?" : "; did you mean [%s] %s?",
            keys[s].section, keys[s].name);
    else if (s >= 0)
        fmt(hint, sizeof(hint), "; did you mean %s?", keys[s].name);
    else {
        /* Nothing close: list the section's keys. */
        int n = fmt(hint, sizeof(hint), " (keys in [%s]:", section);
        bool first = true;
        for (int k = 0; k < CFG_N_KEYS && n < (int)sizeof(hint); k++) {
            if (strcmp(keys[k].section, section))
                continue;
            n += fmt(hint + n, sizeof(hint) - (size_t)n, "%s %s", first ? "" : ",", keys[k].name);
            first = false;
        }
        if (n < (int)sizeof(hint))
            fmt(hint + n, sizeof(hint) - (size_t)n, ")");
    }
    if (!*section)
        add_error(x->errs, x->source, x->line, key, "%s: key outside any section%s", name,
                  s >= 0 ? hint : "");
    else
        add_error(x->errs, x->source, x->line, key, "[%s] %s: unknown key%s", section, name, hint);
}

static void report_unknown_section(struct load_ctx *x, const char *section)
{
    const char *s = suggest_section(section);
    char hint[128];
    if (s)
        fmt(hint, sizeof(hint), "; did you mean %s%s%s?", x->cli ? "" : "[", s, x->cli ? "" : "]");
    else
        fmt(hint, sizeof(hint), " (sections: server, model, cache, eviction, limits, auth, log)");
    char key[96];
    fmt(key, sizeof(key), "[%s]", section);
    add_error(x->errs, x->source, x->line, key, "[%s]: unknown section%s", section, hint);
}

/* Set one key from text: the common path of the file and of --set. */
static int apply(struct load_ctx *x, const char *section, const char *name, const char *value)
{
    int k = cfg_key_find(section, name);
    if (k < 0) {
        if (*section && !section_known(section))
            report_unknown_section(x, section);
        else
            report_unknown_key(x, section, name);
        return -EINVAL;
    }
    const struct key_def *d = &keys[k];
    char key[96], shown[80], why[320];
    fmt(key, sizeof(key), "%s.%s", d->section, d->name);
    echo(d, value, shown, sizeof(shown));
    if (!x->cli && x->seen[k]) {
        add_error(x->errs, x->source, x->line, key,
                  "[%s] %s = %s: duplicate key, first set on line %d", d->section, d->name, shown,
                  x->seen[k]);
        return -EINVAL;
    }
    if (!x->cli)
        x->seen[k] = x->line;
    if (parse_value(d, value, x->c, k, why, sizeof(why))) {
        add_error(x->errs, x->source, x->line, key, "[%s] %s = %s: %s", d->section, d->name, shown,
                  why);
        if (x->failed)
            x->failed[k] = true;
        return -EINVAL;
    }
    if (x->failed)
        x->failed[k] = false;
    x->c->origin[k] = x->cli ? (struct cfg_origin){CFG_FROM_CMDLINE, 0}
                             : (struct cfg_origin){CFG_FROM_FILE, x->line};
    return 0;
}

/* --- reading INI text through libinih ------------------------------------------------------ */

static bool is_space(char ch)
{
    return ch == ' ' || ch == '\t' || ch == '\r' || ch == '\f' || ch == '\v';
}

/*
 * Where inih would end a key: at the first of '=' or ':', or at an inline
 * comment (';' after whitespace). Mirrors inih's find_chars_or_comment().
 */
static size_t key_end(const char *t, size_t n)
{
    bool was_space = false;
    for (size_t i = 0; i < n; i++) {
        if (t[i] == '=' || t[i] == ':' || (was_space && t[i] == ';'))
            return i;
        was_space = is_space(t[i]);
    }
    return n;
}

/*
 * The ini_reader: hands inih the next physical line, normalised, and counts
 * lines in x->line. Lines that inih would reject or misread are reported
 * here with their own message and handed over as blank lines; comments are
 * blanked too. Section headers are checked here (inih has no hook for
 * them) and passed on as "[name]".
 */
static char *read_line(char *str, int num, void *stream)
{
    struct load_ctx *x = stream;
    if (x->pos >= x->len)
        return NULL;
    const char *t = x->text + x->pos;
    const char *nl = memchr(t, '\n', x->len - x->pos);
    size_t n = nl ? (size_t)(nl - t) : x->len - x->pos;
    x->pos += n + (nl ? 1 : 0);
    x->line++;

    if (x->line == 1 && n >= 3 && !memcmp(t, "\xEF\xBB\xBF", 3)) { /* UTF-8 byte order mark */
        t += 3;
        n -= 3;
    }
    while (n && is_space(*t))
        t++, n--;
    while (n && is_space(t[n - 1]))
        n--;

    fmt(str, (size_t)num, "\n");
    if (n == 0 || *t == '#' || *t == ';')
        return str;
    if (memchr(t, '\0', n)) {
        add_error(x->errs, x->source, x->line, "", "line contains a NUL byte");
        return str;
    }
    if (n + 2 > (size_t)num) {
        add_error(x->errs, x->source, x->line, "", "line longer than %d characters", num - 2);
        return str;
    }
    if (*t == '[') {
        const char *close = memchr(t, ']', n);
        x->bad_section = true;
        if (!close) {
            add_error(x->errs, x->source, x->line, "", "section header without a closing ']'");
            return str;
        }
        const char *rest = close + 1, *end = t + n;
        while (rest < end && is_space(*rest))
            rest++;
        if (rest < end && *rest != ';' && *rest != '#') {
            add_error(x->errs, x->source, x->line, "", "text after the section header: '%.*s'",
                      (int)(end - rest), rest);
            return str;
        }
        /* The name, trimmed. */
        const char *a = t + 1, *b = close;
        while (a < b && is_space(*a))
            a++;
        while (b > a && is_space(b[-1]))
            b--;
        char name[64];
        fmt(name, sizeof(name), "%.*s", (int)(b - a), a);
        if (!section_known(name)) {
            report_unknown_section(x, name);
            return str;
        }
        x->bad_section = false;
        fmt(str, (size_t)num, "[%s]\n", name);
        return str;
    }
    size_t e = key_end(t, n);
    if (e == n || t[e] != '=') {
        add_error(x->errs, x->source, x->line, "", "not a 'key = value' line: '%.*s'",
                  n > 60 ? 60 : (int)n, t);
        return str;
    }
    if (e == 0 || is_space(*t)) {
        add_error(x->errs, x->source, x->line, "", "missing key before '='");
        return str;
    }
    fmt(str, (size_t)num, "%.*s\n", (int)n, t);
    return str;
}

/* The ini_handler: one key = value of the line x->line. */
static int on_pair(void *user, const char *section, const char *name, const char *value)
{
    struct load_ctx *x = user;
    if (!x->bad_section)
        apply(x, section, name, value);
    return 1; /* keep going: errors are ours to collect, not inih's */
}

static bool has_error_at(const struct cfg_errors *errs, int first, int line)
{
    for (int i = first; i < errs->count; i++)
        if (errs->list[i].line == line)
            return true;
    return errs->dropped > 0;
}

/* Parse INI text of len bytes as the file `name`. */
static int parse_text(struct cfg *c, const char *text, size_t len, const char *name,
                      struct cfg_errors *errs, bool *failed)
{
    struct load_ctx *x = calloc(1, sizeof(*x));
    if (!x) {
        add_error(errs, name, 0, "", "out of memory");
        return -ENOMEM;
    }
    *x = (struct load_ctx){
        .c = c, .errs = errs, .source = name, .failed = failed, .text = text, .len = len};
    copy_str(c->file, sizeof(c->file), name);
    int before = errs->count + errs->dropped, first = errs->count;
    int rc = ini_parse_stream(read_line, x, on_pair, x);
    if (rc == -2)
        add_error(errs, name, 0, "", "out of memory while parsing");
    else if (rc > 0 && !has_error_at(errs, first, rc))
        add_error(errs, name, rc, "", "malformed line");
    free(x);
    return errs->count + errs->dropped > before ? -EINVAL : 0;
}

int cfg_load_string(struct cfg *c, const char *text, const char *name, struct cfg_errors *errs)
{
    return parse_text(c, text, strlen(text), name, errs, NULL);
}

#define FILE_MAX (1 << 20)

/* Read the file whole (at most FILE_MAX bytes). 0 or -errno, reported. */
static int read_file(const char *path, char **text, size_t *len, struct cfg_errors *errs)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        int err = errno ? errno : EIO;
        add_error(errs, path, 0, "", "cannot open: %s", strerror(err));
        return -err;
    }
    char *buf = malloc(FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        add_error(errs, path, 0, "", "out of memory");
        return -ENOMEM;
    }
    size_t n = fread(buf, 1, FILE_MAX + 1, f);
    int err = ferror(f) ? (errno ? errno : EIO) : 0;
    fclose(f);
    if (err) {
        free(buf);
        add_error(errs, path, 0, "", "cannot read: %s", strerror(err));
        return -err;
    }
    if (n > FILE_MAX) {
        free(buf);
        add_error(errs, path, 0, "", "larger than %d bytes; not a config file?", FILE_MAX);
        return -EFBIG;
    }
    *text = buf;
    *len = n;
    return 0;
}

static int load_file(struct cfg *c, const char *path, struct cfg_errors *errs, bool *failed)
{
    char *text = NULL;
    size_t len = 0;
    int rc = read_file(path, &text, &len, errs);
    if (rc)
        return rc;
    rc = parse_text(c, text, len, path, errs, failed);
    free(text);
    return rc;
}

int cfg_load_file(struct cfg *c, const char *path, struct cfg_errors *errs)
{
    return load_file(c, path, errs, NULL);
}

/* --- command-line overrides ------------------------------------------------------------- */

/* Copy s[0..n) trimmed into buf. */
static void trimmed(char *buf, size_t size, const char *s, size_t n)
{
    while (n && is_space(*s))
        s++, n--;
    while (n && is_space(s[n - 1]))
        n--;
    fmt(buf, size, "%.*s", (int)n, s);
}

static int set_one(struct cfg *c, const char *assignment, struct cfg_errors *errs, bool *failed)
{
    struct load_ctx x = {
        .c = c, .errs = errs, .source = "command line", .cli = true, .failed = failed};
    const char *eq = strchr(assignment, '=');
    char key[128], section[64], value[CFG_PATH_MAX];
    if (!eq) {
        add_error(errs, x.source, 0, "", "--set %s: expected section.key=value", assignment);
        return -EINVAL;
    }
    trimmed(key, sizeof(key), assignment, (size_t)(eq - assignment));
    trimmed(value, sizeof(value), eq + 1, strlen(eq + 1));
    if (strlen(eq + 1) >= sizeof(value)) {
        add_error(errs, x.source, 0, key, "--set %s: value longer than %zu bytes", key,
                  sizeof(value) - 1);
        return -EINVAL;
    }
    const char *dot = strchr(key, '.');
    if (!dot) {
        /* No section: find the key anywhere to suggest section.key. */
        int s = suggest_key("", key);
        if (s >= 0)
            add_error(errs, x.source, 0, key, "--set %s: missing section; did you mean %s.%s?", key,
                      keys[s].section, keys[s].name);
        else
            add_error(errs, x.source, 0, key, "--set %s: expected section.key=value", key);
        return -EINVAL;
    }
    fmt(section, sizeof(section), "%.*s", (int)(dot - key), key);
    return apply(&x, section, dot + 1, value);
}

int cfg_set(struct cfg *c, const char *assignment, struct cfg_errors *errs)
{
    return set_one(c, assignment, errs, NULL);
}

/* --- cross-key rules -------------------------------------------------------------------- */

struct rules {
    const struct cfg *c;
    struct cfg_errors *errs;
    const bool *failed;
    int n_errors;
};

/* "sink_tokens 4 (line 9)", with the origin short since the file is known. */
static void term(const struct cfg *c, int k, char *buf, size_t len)
{
    char v[96], o[64];
    cfg_format_value(c, (enum cfg_key)k, v, sizeof(v));
    if (c->origin[k].kind == CFG_FROM_FILE)
        fmt(o, sizeof(o), "line %d", c->origin[k].line);
    else
        cfg_format_origin(c, (enum cfg_key)k, o, sizeof(o));
    fmt(buf, len, "%s %s (%s)", keys[k].name, keys[k].secret ? "(hidden)" : v, o);
}

/* True if any of the n keys had its value rejected: the rule is not checked. */
static bool skip_rule(const struct rules *r, const int *ks, int n)
{
    for (int i = 0; i < n; i++)
        if (r->failed && r->failed[ks[i]])
            return true;
    return false;
}

/*
 * Report a violation at the first of the n keys that the operator set
 * (file or command line), or at the first key if all are defaults:
 * "SOURCE:LINE: [section] key = value: MESSAGE".
 */
__attribute__((format(printf, 4, 5))) static void violation(struct rules *r, const int *ks, int n,
                                                            const char *format, ...)
{
    int k = ks[0];
    for (int i = 0; i < n; i++) {
        if (r->c->origin[ks[i]].kind != CFG_FROM_DEFAULT) {
            k = ks[i];
            break;
        }
    }
    char msg[320], v[96], key[96];
    va_list ap;
    va_start(ap, format);
    vsnprintf(msg, sizeof(msg), format, ap);
    va_end(ap);
    cfg_format_value(r->c, (enum cfg_key)k, v, sizeof(v));
    fmt(key, sizeof(key), "%s.%s", keys[k].section, keys[k].name);
    const struct cfg_origin *o = &r->c->origin[k];
    const char *source = o->kind == CFG_FROM_FILE      ? r->c->file
                         : o->kind == CFG_FROM_CMDLINE ? "command line"
                                                       : "defaults";
    add_error(r->errs, source, o->line, key, "[%s] %s = %s: %s", keys[k].section, keys[k].name,
              keys[k].secret ? "(hidden)" : v, msg);
    r->n_errors++;
}

/*
 * The eviction budget is the cache's (kv_policy_budget, reached through the
 * hook the program wires: see config.h). The rules below compare its terms
 * with the keys and word each violation at the keys and lines involved:
 *
 *   kept + one page <= max_cache_tokens        (floor_tokens)
 *   kept + window + one page <= max_cache_tokens (need_tokens)
 *
 * Config asks a little more than the cache: the window, explicit or
 * automatic, is at least one page, and h2o keeps at least one heavy token.
 * Should the cache refuse a policy these rules let through, its own reason
 * is reported, so a config that passes here is one the cache accepts.
 */
static const struct cfg_hooks *hooks;

void cfg_set_hooks(const struct cfg_hooks *h)
{
    hooks = h;
}

/* The hook's budget for c; without a hook, verdict -ENOSYS and no terms. */
static void budget_of(const struct cfg *c, struct cfg_budget *b)
{
    if (hooks && hooks->budget) {
        hooks->budget(c, b);
        return;
    }
    *b = (struct cfg_budget){.window_tokens = c->eviction.window_tokens, .verdict = -ENOSYS};
    fmt(b->why, sizeof(b->why), "no eviction budget hook is wired (cfg_set_hooks)");
}

/* The kept tokens in words: "sink_tokens 4 (line 9) as whole pages (16)",
 * "sink_tokens 48 (line 9)", or "sink_tokens 4 (line 9) + heavy_tokens 64 (line 10)"
 * (in parentheses when `group`, for a subtraction). */
static void kept_words(const struct cfg *c, int64_t kept, bool group, char *buf, size_t len)
{
    char ts[128], th[128];
    term(c, CFG_EVICTION_SINK_TOKENS, ts, sizeof(ts));
    term(c, CFG_EVICTION_HEAVY_TOKENS, th, sizeof(th));
    if (c->eviction.policy == CFG_EVICT_H2O)
        fmt(buf, len, group ? "(%s + %s)" : "%s + %s", ts, th);
    else if (kept != c->eviction.sink_tokens)
        fmt(buf, len, "%s as whole pages (%" PRId64 ")", ts, kept);
    else
        fmt(buf, len, "%s", ts);
}

/*
 * The cache's word on the policy in effect, when the rules above found
 * nothing: they state its formula, so this fires only if the two ever
 * drift apart, and then the operator still gets an error, not a server
 * that refuses to start (or a reload refused after check-config passed).
 */
static void cache_verdict(struct rules *r, const struct cfg_budget *b, int n_before)
{
    const int kp[] = {CFG_EVICTION_POLICY, CFG_EVICTION_MAX_CACHE_TOKENS};
    if (r->n_errors == n_before && b->verdict != 0 && !skip_rule(r, kp, 2))
        violation(r, kp, 2, "the cache refuses this policy: %s", b->why);
}

static void rules_eviction(struct rules *r)
{
    const struct cfg *c = r->c;
    if (c->eviction.policy == CFG_EVICT_NONE)
        return;
    bool h2o = c->eviction.policy == CFG_EVICT_H2O;
    int64_t max = c->eviction.max_cache_tokens, page = c->cache.page_tokens;
    int64_t window = c->eviction.window_tokens;
    struct cfg_budget b;
    budget_of(c, &b);
    if (b.verdict == -ENOSYS) {
        const int kp[] = {CFG_EVICTION_POLICY};
        violation(r, kp, 1, "%s", b.why);
        return;
    }
    int n_before = r->n_errors;
    char tk[300], tkg[304], tp[128], tm[128], tw[128];
    kept_words(c, b.kept_tokens, false, tk, sizeof(tk));
    kept_words(c, b.kept_tokens, true, tkg, sizeof(tkg));
    term(c, CFG_CACHE_PAGE_TOKENS, tp, sizeof(tp));
    term(c, CFG_EVICTION_MAX_CACHE_TOKENS, tm, sizeof(tm));
    term(c, CFG_EVICTION_WINDOW_TOKENS, tw, sizeof(tw));

    /* h2o without heavy hitters is sink-window under another name. */
    const int kh[] = {CFG_EVICTION_HEAVY_TOKENS, CFG_EVICTION_POLICY};
    if (h2o && c->eviction.heavy_tokens == 0 && !skip_rule(r, kh, 2))
        violation(r, kh, 2, "policy h2o needs heavy_tokens >= 1 (or use policy sink-window)");

    /* The kept tokens must leave at least one page for eviction to free. */
    const int ka[] = {CFG_EVICTION_SINK_TOKENS, CFG_EVICTION_HEAVY_TOKENS,
                      CFG_EVICTION_MAX_CACHE_TOKENS, CFG_CACHE_PAGE_TOKENS, CFG_EVICTION_POLICY};
    bool a_checked = !skip_rule(r, ka, 5), a_ok = a_checked && b.floor_tokens <= max;
    if (a_checked && !a_ok)
        violation(r, ka, 5, "%s + one page: %s = %" PRId64 " exceeds %s", tk, tp, b.floor_tokens,
                  tm);

    if (window == 0) {
        /* Automatic: the window is what the rest leaves (cfg_window_tokens). */
        const int kw[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_EVICTION_MAX_CACHE_TOKENS,
                          CFG_EVICTION_SINK_TOKENS,   CFG_EVICTION_HEAVY_TOKENS,
                          CFG_CACHE_PAGE_TOKENS,      CFG_EVICTION_POLICY};
        if (a_ok && !skip_rule(r, kw, 6) && b.window_room < page)
            violation(r, kw, 6,
                      "window_tokens 0 (automatic) leaves %s - %s - one page: %s = %" PRId64
                      " tokens, less than one page",
                      tm, tkg, tp, b.window_room);
        cache_verdict(r, &b, n_before);
        return;
    }

    const int kb[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_CACHE_PAGE_TOKENS};
    if (!skip_rule(r, kb, 2) && window < page)
        violation(r, kb, 2, "window_tokens %" PRId64 " is less than one page: %s", window, tp);

    const int kc[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_EVICTION_SINK_TOKENS,
                      CFG_EVICTION_HEAVY_TOKENS,  CFG_EVICTION_MAX_CACHE_TOKENS,
                      CFG_CACHE_PAGE_TOKENS,      CFG_EVICTION_POLICY};
    if (a_ok && !skip_rule(r, kc, 6) && b.need_tokens > max)
        violation(r, kc, 6, "%s + %s + one page: %s = %" PRId64 " exceeds %s", tw, tk, tp,
                  b.need_tokens, tm);
    cache_verdict(r, &b, n_before);
}

static void rules_t5(struct rules *r)
{
    const struct cfg *c = r->c;
    int64_t nb = c->model.t5_num_buckets, md = c->model.t5_max_distance;
    const int k[] = {CFG_MODEL_T5_NUM_BUCKETS, CFG_MODEL_T5_MAX_DISTANCE};
    const int k_md[] = {CFG_MODEL_T5_MAX_DISTANCE, CFG_MODEL_T5_NUM_BUCKETS};
    if ((nb == 0 && md == 0) || skip_rule(r, k, 2))
        return;
    char tnb[128], tmd[128];
    term(c, CFG_MODEL_T5_NUM_BUCKETS, tnb, sizeof(tnb));
    term(c, CFG_MODEL_T5_MAX_DISTANCE, tmd, sizeof(tmd));
    if (nb == 0) {
        violation(r, k_md, 2, "set together with t5_num_buckets, which is 0 (set both or neither)");
        return;
    }
    if (md == 0) {
        violation(r, k, 2, "set together with t5_max_distance, which is 0 (set both or neither)");
        return;
    }
    if (nb < 4) {
        violation(r, k, 2, "T5 needs at least 4 buckets");
        return;
    }
    /* Causal buckets: the first nb/2 distances are exact, the rest logarithmic up to md. */
    if (md <= nb / 2)
        violation(r, k_md, 2,
                  "must exceed t5_num_buckets/2 = %" PRId64
                  ", the exact range of causal buckets, with %s",
                  nb / 2, tnb);
}

static void rules_other(struct rules *r)
{
    const struct cfg *c = r->c;
    const int ka[] = {CFG_AUTH_API_KEY_FILE, CFG_AUTH_API_KEY};
    if (!skip_rule(r, ka, 2) && c->auth.api_key[0] && c->auth.api_key_file[0]) {
        char o[CFG_PATH_MAX + 32];
        if (c->origin[CFG_AUTH_API_KEY].kind == CFG_FROM_FILE)
            fmt(o, sizeof(o), "line %d", c->origin[CFG_AUTH_API_KEY].line);
        else
            cfg_format_origin(c, CFG_AUTH_API_KEY, o, sizeof(o));
        violation(r, ka, 2, "api_key is set too (%s); set only one of them", o);
    }
    const int ks[] = {CFG_LIMITS_STEP_TOKENS, CFG_LIMITS_MAX_RUNNING};
    if (!skip_rule(r, ks, 2) && c->limits.step_tokens < c->limits.max_running) {
        char t[128];
        term(c, CFG_LIMITS_MAX_RUNNING, t, sizeof(t));
        violation(r, ks, 2, "less than %s: every running sequence decodes one token per step", t);
    }
}

static int validate(const struct cfg *c, struct cfg_errors *errs, const bool *failed)
{
    struct rules r = {.c = c, .errs = errs, .failed = failed};
    rules_eviction(&r);
    rules_t5(&r);
    rules_other(&r);
    return r.n_errors ? -EINVAL : 0;
}

int cfg_validate(const struct cfg *c, struct cfg_errors *errs)
{
    return validate(c, errs, NULL);
}

int cfg_load(struct cfg *c, const char *path, const char *const *sets, int n_sets,
             struct cfg_errors *errs)
{
    bool failed[CFG_N_KEYS] = {false};
    int before = errs->count + errs->dropped;
    cfg_defaults(c);
    if (path)
        load_file(c, path, errs, failed);
    for (int i = 0; i < n_sets; i++)
        set_one(c, sets[i], errs, failed);
    validate(c, errs, failed);
    return errs->count + errs->dropped > before ? -EINVAL : 0;
}

/* --- derived values ---------------------------------------------------------------------- */

int64_t cfg_window_tokens(const struct cfg *c)
{
    if (c->eviction.policy == CFG_EVICT_NONE)
        return c->eviction.window_tokens; /* unused: policy none never evicts */
    struct cfg_budget b;
    budget_of(c, &b);
    return b.window_tokens;
}

enum cfg_kv_type cfg_k_type(const struct cfg *c)
{
    return c->cache.k_type == CFG_KV_SAME ? c->cache.kv_type : c->cache.k_type;
}

enum cfg_kv_type cfg_v_type(const struct cfg *c)
{
    return c->cache.v_type == CFG_KV_SAME ? c->cache.kv_type : c->cache.v_type;
}

int64_t cfg_sequence_pages(const struct cfg *c)
{
    struct cfg_budget b;
    budget_of(c, &b);
    return b.sequence_pages;
}

int cfg_check_memory(const struct cfg *c, uint64_t kv_bytes_per_token, struct cfg_errors *errs)
{
    uint64_t pages = (uint64_t)cfg_sequence_pages(c), need;
    bool overflow = __builtin_mul_overflow(pages, (uint64_t)c->cache.page_tokens, &need) ||
                    __builtin_mul_overflow(need, kv_bytes_per_token, &need);
    if (!overflow && c->cache.memory >= need)
        return 0;
    char mem[32], needed[32], tm[128], tp[128];
    cfg_format_size(c->cache.memory, mem, sizeof(mem));
    if (overflow)
        fmt(needed, sizeof(needed), "more than 2^64 bytes");
    else
        cfg_format_size(need, needed, sizeof(needed));
    term(c, CFG_EVICTION_MAX_CACHE_TOKENS, tm, sizeof(tm));
    term(c, CFG_CACHE_PAGE_TOKENS, tp, sizeof(tp));
    struct rules r = {.c = c, .errs = errs};
    const int k[] = {CFG_CACHE_MEMORY};
    violation(&r, k, 1,
              "one sequence at its full budget needs %s: %" PRIu64 " pages for %s at %s, "
              "%" PRIu64 " bytes per token; raise memory or lower max_cache_tokens",
              needed, pages, tm, tp, kv_bytes_per_token);
    return -EINVAL;
}

/* --- dump ---------------------------------------------------------------------------- */

int cfg_dump(const struct cfg *c, char *buf, size_t len)
{
    size_t n = 0;
#define OUT(...)                                                                                   \
    do {                                                                                           \
        int w_ = fmt(n < len ? buf + n : NULL, n < len ? len - n : 0, __VA_ARGS__);                \
        n += w_ > 0 ? (size_t)w_ : 0;                                                              \
    } while (0)
    if (len)
        buf[0] = '\0';
    const char *section = "";
    for (int k = 0; k < CFG_N_KEYS; k++) {
        const struct key_def *d = &keys[k];
        if (strcmp(d->section, section)) {
            OUT("%s[%s]\n", k ? "\n" : "", d->section);
            section = d->section;
        }
        char value[CFG_PATH_MAX], line[CFG_PATH_MAX + 96], origin[CFG_PATH_MAX + 32];
        cfg_format_value(c, (enum cfg_key)k, value, sizeof(value));
        cfg_format_origin(c, (enum cfg_key)k, origin, sizeof(origin));
        if (d->secret && *value)
            fmt(line, sizeof(line), "# %s = (set, %zu bytes, hidden)", d->name, strlen(value));
        else
            fmt(line, sizeof(line), "%s = %s", d->name, value);
        OUT("%-40s ; %s\n", line, origin);
    }
#undef OUT
    return (int)n;
}

/* --- reload ---------------------------------------------------------------------------- */

void cfg_reload_diff(const struct cfg *old, const struct cfg *new_cfg, struct cfg_diff *diff)
{
    diff->n_live = diff->n_restart = 0;
    for (int k = 0; k < CFG_N_KEYS; k++) {
        if (cfg_value_equal(old, new_cfg, (enum cfg_key)k))
            continue;
        if (keys[k].live)
            diff->live[diff->n_live++] = (enum cfg_key)k;
        else
            diff->restart[diff->n_restart++] = (enum cfg_key)k;
    }
}

int cfg_reload(const struct cfg *running, const struct cfg *loaded, struct cfg *next,
               struct cfg_diff *diff, struct cfg_errors *errs)
{
    cfg_reload_diff(running, loaded, diff);
    *next = *running;
    copy_str(next->file, sizeof(next->file), loaded->file);
    for (int k = 0; k < CFG_N_KEYS; k++) {
        if (!keys[k].live)
            continue;
        memcpy(field(next, k), cfield(loaded, k), keys[k].size);
        next->origin[k] = loaded->origin[k];
    }
    return cfg_validate(next, errs);
}
