/*
 * keys.c - the key table and what reads it one key at a time: defaults,
 * one value parsed, formatted, compared and described, and the dump.
 *
 * One row of `cfg_keys[]` per setting, in the manner of Redis's
 * standardConfig: section, name, type, where the value lives in struct cfg,
 * the default as kvd.conf spells it, bounds, unit, one line of
 * documentation, and whether a running server may apply a change (live) or
 * needs a restart. Nothing else in the room knows a key by name except the
 * cross-key rules (rules.c), which are about specific keys by nature.
 * Reading files and --set overrides is config.c's; this file never sees a
 * line of text, only one key's value at a time.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "config/config.h"
#include "config/config_internal.h"

int cfg_fmt(char *buf, size_t len, const char *f, ...)
{
    va_list ap;
    va_start(ap, f);
    int n = vsnprintf(buf, len, f, ap);
    va_end(ap);
    return n;
}

/* --- the table ---------------------------------------------------------------- */

static const char *const kv_type_names[] = {"f16", "f32", "bf16", "q8_0", "q4_0", NULL};
/* k_type / v_type: the same spellings, and "kv_type" for the shorthand's value */
static const char *const kv_side_names[] = {"f16", "f32", "bf16", "q8_0", "q4_0", "kv_type", NULL};
_Static_assert(CFG_KV_SAME == 5, "kv_side_names spells CFG_KV_SAME last");
static const char *const policy_names[] = {"none", "sink-window", "h2o", "tova",
                                           "knorm", "snapkv", NULL};
static const char *const knorm_names[] = {"largest", "smallest", NULL};
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
                   sizeof(enum cfg_knorm_evict) == sizeof(int) &&
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
        s, k, CFG_T_INT, AT(f, int64_t), SZ(f), def, lo, hi, 0, 0, NULL, unit, doc, live, false,   \
            NULL                                                                                   \
    }
#define SIZE(s, k, f, def, lo, hi, live, doc)                                                      \
    {                                                                                              \
        s, k, CFG_T_SIZE, AT(f, uint64_t), SZ(f), def, lo, hi, 0, 0, NULL, NULL, doc, live, false, \
            NULL                                                                                   \
    }
#define DURATION(s, k, f, def, lo, hi, live, doc)                                                  \
    {                                                                                              \
        s, k, CFG_T_DURATION, AT(f, uint64_t), SZ(f), def, lo, hi, 0, 0, NULL, NULL, doc, live,    \
            false, NULL                                                                            \
    }
#define BOOL(s, k, f, def, live, doc)                                                              \
    {                                                                                              \
        s, k, CFG_T_BOOL, AT(f, bool), SZ(f), def, 0, 1, 0, 0, NULL, NULL, doc, live, false, NULL  \
    }
#define ENUM(s, k, f, def, names, live, doc)                                                       \
    {                                                                                              \
        s, k, CFG_T_ENUM, offsetof(struct cfg, f), SZ(f), def, 0, 0, 0, 0, names, NULL, doc, live, \
            false, NULL                                                                            \
    }
#define STRING(s, k, f, def, live, secret, check, doc)                                             \
    {                                                                                              \
        s, k, CFG_T_STRING, AT(f, char *), SZ(f), def, 0, 0, 0, 0, NULL, NULL, doc, live, secret,  \
            check                                                                                  \
    }
#define NUMBER(s, k, f, def, lo, hi, live, doc)                                                    \
    {                                                                                              \
        s, k, CFG_T_NUMBER, AT(f, double), SZ(f), def, 0, 0, lo, hi, NULL, NULL, doc, live, false, \
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
    cfg_fmt(err, errlen, "must not be empty");
    return -EINVAL;
}

/* A tokenizer.ggml.pre spelling: empty, or letters, digits and "-._" (the
 * model room checks the name itself when it loads the file). */
static int check_pre_name(const char *s, char *err, size_t errlen)
{
    for (const char *p = s; *p; p++) {
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ||
              *p == '-' || *p == '.' || *p == '_')) {
            cfg_fmt(err, errlen, "'%c' cannot be part of a pre-tokenizer name", *p);
            return -EINVAL;
        }
    }
    return 0;
}

/* [sessions] dir: empty (off), or an existing directory. Whether it can be
 * written is the daemon's to find out (a read-only one is a warning, and
 * every save then fails with a log line). */
static int check_dir(const char *s, char *err, size_t errlen)
{
    struct stat sb;
    if (!*s)
        return 0;
    if (stat(s, &sb) != 0) {
        cfg_fmt(err, errlen, "%s", strerror(errno));
        return -EINVAL;
    }
    if (!S_ISDIR(sb.st_mode)) {
        cfg_fmt(err, errlen, "not a directory");
        return -EINVAL;
    }
    return 0;
}

const struct cfg_key_def cfg_keys[CFG_N_KEYS] = {
    /* [server] */
    [CFG_SERVER_LISTEN] = STRING(
        "server", "listen", server.listen, "127.0.0.1:8080", RESTART, false, check_listen,
        "address and port to accept HTTP on (HOST:PORT, [IPv6]:PORT; port 0 = any free port)"),
    [CFG_SERVER_THREADS] = INT("server", "threads", server.threads, "0", 0, 1024, "threads",
                               RESTART,
                               "compute threads of the engine; 0 = OMP_NUM_THREADS if set, "
                               "else one per CPU"),
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
    [CFG_MODEL_HUGE_PAGES] =
        BOOL("model", "huge_pages", model.huge_pages, "true", RESTART,
             "advise the weights' copy and the KV pool as 2 MiB pages; false = 4 KiB "
             "pages (KVD_HUGE_PAGES=on|off overrides)"),
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
    [CFG_CACHE_PREFIX_CACHE] =
        BOOL("cache", "prefix_cache", cache.prefix_cache, "true", RESTART,
             "reuse the cached pages of an equal prompt prefix instead of computing them again"),
    [CFG_CACHE_PREFIX_CACHE_SHARE] =
        INT("cache", "prefix_cache_share", cache.prefix_cache_share, "50", 0, 100, "percent",
            RESTART,
            "most of the pool that cached prefix pages no request uses may keep; 0 = share only "
            "between requests running together"),
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
            "most recent tokens kept; 0 = what the budget leaves after the sinks (scored policies: "
            "and heavy tokens) and one eviction step"),
    [CFG_EVICTION_HEAVY_TOKENS] =
        INT("eviction", "heavy_tokens", eviction.heavy_tokens, "1024", 0, 1 << 24, "tokens", LIVE,
            "h2o, tova, knorm, snapkv: middle tokens kept by the policy's score"),
    [CFG_EVICTION_OBSERVE_TOKENS] =
        INT("eviction", "observe_tokens", eviction.observe_tokens, "32", 1, 1 << 20, "tokens",
            LIVE, "snapkv only: last queries of a prompt chunk whose attention scores the middle"),
    [CFG_EVICTION_POOL_TOKENS] =
        INT("eviction", "pool_tokens", eviction.pool_tokens, "7", 1, 1024, "tokens", LIVE,
            "snapkv only: a token's score is the max over this many neighbours (1 = none)"),
    [CFG_EVICTION_KNORM_EVICT] =
        ENUM("eviction", "knorm_evict", eviction.knorm_evict, "largest", knorm_names, LIVE,
             "knorm only: which keys leave first, those of the largest or the smallest L2 norm"),
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
    /* [sessions] */
    [CFG_SESSIONS_DIR] =
        STRING("sessions", "dir", sessions.dir, "", RESTART, false, check_dir,
               "directory idle sessions are saved to instead of lost (LRU, max_sessions, idle "
               "timeout, shutdown) and read back from at their next request, across restarts; "
               "empty = off"),
    [CFG_SESSIONS_MAX_DISK] =
        SIZE("sessions", "max_disk", sessions.max_disk, "4GiB", MiB, 64 * TiB, RESTART,
             "bytes of session files kept in dir; the least recently used files go first"),
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
            "cap on a request's max_tokens (times its n choices), and its value when the request "
            "omits it"),
    /* at most ENGINE_MAX_CHOICES (engine/engine.h) */
    [CFG_LIMITS_MAX_CHOICES] =
        INT("limits", "max_choices", limits.max_choices, "8", 1, 128, "choices", LIVE,
            "cap on a request's n (OpenAI choices per request; 400 above)"),
    [CFG_LIMITS_QUEUE_LENGTH] =
        INT("limits", "queue_length", limits.queue_length, "64", 0, 65536, "requests", LIVE,
            "requests waiting for a batch slot; beyond it, 429 with Retry-After; 0 = no waiting"),
    [CFG_LIMITS_MAX_RUNNING] =
        INT("limits", "max_running", limits.max_running, "8", 1, 1024, "sequences", LIVE,
            "sequences decoded together in one engine batch"),
    [CFG_LIMITS_STEP_TOKENS] =
        INT("limits", "step_tokens", limits.step_tokens, "512", 1, 1 << 20, "tokens", LIVE,
            "tokens per engine step: decodes first, prompts fill the rest in chunks"),
    [CFG_LIMITS_STEP_BUDGET] =
        DURATION("limits", "step_budget", limits.step_budget_ms, "100ms", 0, MIN, LIVE,
                 "while streams decode, a step's most time: prompt chunks are cut to ~2.5x the "
                 "decodes' own step, within 20ms and this, at the measured speed; 0 = step_tokens "
                 "only"),
    [CFG_LIMITS_ENGINE_STALL_TIMEOUT] =
        DURATION("limits", "engine_stall_timeout", limits.engine_stall_timeout_ms, "2m", 0, DAY,
                 LIVE,
                 "an engine step running longer than this makes /health answer 503 (stalled) "
                 "while the server still answers; 0 = never"),
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

const char *const cfg_sections[CFG_N_SECTIONS] = {"server",   "model",  "cache", "eviction",
                                                  "sessions", "limits", "auth",  "log"};

/* --- the table's accessors ----------------------------------------------------------- */

const char *cfg_key_section(enum cfg_key k)
{
    return cfg_keys[k].section;
}

const char *cfg_key_name(enum cfg_key k)
{
    return cfg_keys[k].name;
}

const char *cfg_key_doc(enum cfg_key k)
{
    return cfg_keys[k].doc;
}

bool cfg_key_live(enum cfg_key k)
{
    return cfg_keys[k].live;
}

int cfg_key_find(const char *section, const char *name)
{
    for (int k = 0; k < CFG_N_KEYS; k++)
        if (!strcmp(cfg_keys[k].section, section) && !strcmp(cfg_keys[k].name, name))
            return k;
    return -1;
}

bool cfg_section_known(const char *s)
{
    for (size_t i = 0; i < CFG_N_SECTIONS; i++)
        if (!strcmp(cfg_sections[i], s))
            return true;
    return false;
}

/* "an integer in [1, 4096]", "a size in [1MiB, 1TiB]", "one of: a, b". */
static int describe_accepted(const struct cfg_key_def *d, char *buf, size_t len)
{
    char lo[32], hi[32];
    switch (d->type) {
    case CFG_T_INT:
        return cfg_fmt(buf, len, "an integer in [%" PRId64 ", %" PRId64 "]", d->min, d->max);
    case CFG_T_SIZE:
        cfg_format_size((uint64_t)d->min, lo, sizeof(lo));
        cfg_format_size((uint64_t)d->max, hi, sizeof(hi));
        return cfg_fmt(buf, len, "a size in [%s, %s]", lo, hi);
    case CFG_T_DURATION:
        cfg_format_duration((uint64_t)d->min, lo, sizeof(lo));
        cfg_format_duration((uint64_t)d->max, hi, sizeof(hi));
        return cfg_fmt(buf, len, "a duration in [%s, %s]", lo, hi);
    case CFG_T_NUMBER:
        return cfg_fmt(buf, len, "a number in [%g, %g]", d->fmin, d->fmax);
    case CFG_T_BOOL:
        return cfg_fmt(buf, len, "a boolean (true/false, yes/no, on/off, 1/0)");
    case CFG_T_ENUM: {
        int n = cfg_fmt(buf, len, "one of:");
        for (int i = 0; d->names[i]; i++) {
            size_t at = (size_t)n < len ? (size_t)n : len;
            n += cfg_fmt(buf + at, len - at, "%s %s", i ? "," : "", d->names[i]);
        }
        return n;
    }
    case CFG_T_STRING:
        return cfg_fmt(buf, len, "a string of at most %zu bytes", d->size - 1);
    }
    return 0;
}

int cfg_key_describe(enum cfg_key k, char *buf, size_t len)
{
    const struct cfg_key_def *d = &cfg_keys[k];
    char acc[160];
    describe_accepted(d, acc, sizeof(acc));
    /* Drop the article: "integer in [1, 4096]" reads better in a list. */
    const char *a = acc;
    if (!strncmp(a, "a ", 2))
        a += 2;
    else if (!strncmp(a, "an ", 3))
        a += 3;
    if (d->type == CFG_T_INT && d->unit) {
        /* "integer (tokens) in [1, 4096]" */
        const char *in = strstr(a, " in ");
        return cfg_fmt(buf, len, "%.*s (%s)%s; default %s", (int)(in - a), a, d->unit, in, d->def);
    }
    return cfg_fmt(buf, len, "%s; default %s", a, *d->def ? d->def : "empty");
}

/* --- parsing one value ---------------------------------------------------------------- */

int cfg_key_parse(int k, const char *s, struct cfg *c, char *why, size_t whylen)
{
    const struct cfg_key_def *d = &cfg_keys[k];
    char acc[160], detail[200];
    describe_accepted(d, acc, sizeof(acc));
    void *dst = cfg_field(c, k);
    switch (d->type) {
    case CFG_T_INT: {
        int64_t v;
        if (cfg_parse_int(s, &v) || v < d->min || v > d->max)
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case CFG_T_SIZE:
    case CFG_T_DURATION: {
        uint64_t v;
        int rc = d->type == CFG_T_SIZE ? cfg_parse_size(s, &v, detail, sizeof(detail))
                                       : cfg_parse_duration(s, &v, detail, sizeof(detail));
        if (rc) { /* bad syntax, unknown unit, or over 2^64 - 1 */
            cfg_fmt(why, whylen, "%s; must be %s", detail, acc);
            return -EINVAL;
        }
        if (v < (uint64_t)d->min || v > (uint64_t)d->max)
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case CFG_T_NUMBER: {
        double v;
        if (cfg_parse_number(s, &v) || !(v >= d->fmin && v <= d->fmax))
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case CFG_T_BOOL: {
        bool v;
        if (cfg_parse_bool(s, &v))
            goto out_range;
        memcpy(dst, &v, sizeof(v));
        return 0;
    }
    case CFG_T_ENUM:
        for (int i = 0; d->names[i]; i++) {
            if (!strcmp(s, d->names[i])) {
                memcpy(dst, &i, sizeof(i));
                return 0;
            }
        }
        goto out_range;
    case CFG_T_STRING:
        if (strlen(s) >= d->size) {
            cfg_fmt(why, whylen, "longer than %zu bytes", d->size - 1);
            return -EINVAL;
        }
        if (d->check && d->check(s, detail, sizeof(detail))) {
            cfg_fmt(why, whylen, "%s", detail);
            return -EINVAL;
        }
        memcpy(dst, s, strlen(s) + 1);
        return 0;
    }
out_range:
    cfg_fmt(why, whylen, "must be %s", acc);
    return -EINVAL;
}

int cfg_format_value(const struct cfg *c, enum cfg_key k, char *buf, size_t len)
{
    const struct cfg_key_def *d = &cfg_keys[k];
    const void *src = cfg_cfield(c, k);
    int64_t i;
    uint64_t u;
    double f;
    int e;
    switch (d->type) {
    case CFG_T_INT:
        memcpy(&i, src, sizeof(i));
        return cfg_fmt(buf, len, "%" PRId64, i);
    case CFG_T_SIZE:
        memcpy(&u, src, sizeof(u));
        return cfg_format_size(u, buf, len);
    case CFG_T_DURATION:
        memcpy(&u, src, sizeof(u));
        return cfg_format_duration(u, buf, len);
    case CFG_T_NUMBER:
        memcpy(&f, src, sizeof(f));
        return cfg_fmt(buf, len, "%.17g", f);
    case CFG_T_BOOL:
        return cfg_fmt(buf, len, "%s", *(const bool *)src ? "true" : "false");
    case CFG_T_ENUM:
        memcpy(&e, src, sizeof(e));
        return cfg_fmt(buf, len, "%s", d->names[e]);
    case CFG_T_STRING:
        return cfg_fmt(buf, len, "%s", (const char *)src);
    }
    return 0;
}

int cfg_format_origin(const struct cfg *c, enum cfg_key k, char *buf, size_t len)
{
    switch (c->origin[k].kind) {
    case CFG_FROM_FILE:
        return cfg_fmt(buf, len, "%s:%d", c->file, c->origin[k].line);
    case CFG_FROM_CMDLINE:
        return cfg_fmt(buf, len, "command line");
    case CFG_FROM_DEFAULT:
        break;
    }
    return cfg_fmt(buf, len, "default");
}

bool cfg_value_equal(const struct cfg *a, const struct cfg *b, enum cfg_key k)
{
    const struct cfg_key_def *d = &cfg_keys[k];
    if (d->type == CFG_T_STRING)
        return !strcmp(cfg_cfield(a, k), cfg_cfield(b, k));
    if (d->type == CFG_T_NUMBER) {
        double x, y;
        memcpy(&x, cfg_cfield(a, k), sizeof(x));
        memcpy(&y, cfg_cfield(b, k), sizeof(y));
        return x == y;
    }
    return !memcmp(cfg_cfield(a, k), cfg_cfield(b, k), d->size);
}

void cfg_defaults(struct cfg *c)
{
    memset(c, 0, sizeof(*c));
    for (int k = 0; k < CFG_N_KEYS; k++) {
        char why[256];
        int rc = cfg_key_parse(k, cfg_keys[k].def, c, why, sizeof(why));
        /* The table's defaults are constants; test_config checks each parses. */
        if (rc)
            abort();
        c->origin[k] = (struct cfg_origin){CFG_FROM_DEFAULT, 0};
    }
}

/* --- dump ---------------------------------------------------------------------------- */

int cfg_dump(const struct cfg *c, char *buf, size_t len)
{
    size_t n = 0;
#define OUT(...)                                                                                   \
    do {                                                                                           \
        int w_ = cfg_fmt(n < len ? buf + n : NULL, n < len ? len - n : 0, __VA_ARGS__);            \
        n += w_ > 0 ? (size_t)w_ : 0;                                                              \
    } while (0)
    if (len)
        buf[0] = '\0';
    const char *section = "";
    for (int k = 0; k < CFG_N_KEYS; k++) {
        const struct cfg_key_def *d = &cfg_keys[k];
        if (strcmp(d->section, section)) {
            OUT("%s[%s]\n", k ? "\n" : "", d->section);
            section = d->section;
        }
        char value[CFG_PATH_MAX], line[CFG_PATH_MAX + 96], origin[CFG_PATH_MAX + 32];
        cfg_format_value(c, (enum cfg_key)k, value, sizeof(value));
        cfg_format_origin(c, (enum cfg_key)k, origin, sizeof(origin));
        if (d->secret && *value)
            cfg_fmt(line, sizeof(line), "# %s = (set, %zu bytes, hidden)", d->name, strlen(value));
        else if (cfg_fmt(line, sizeof(line), "%s = %s", d->name, value) > CFG_LINE_MAX)
            cfg_fmt(line, sizeof(line), "%s=%s", d->name, value);
        int w = (int)strlen(line);
        if ((w < 40 ? 40 : w) + 3 + (int)strlen(origin) <= CFG_LINE_MAX)
            OUT("%-40s ; %s\n", line, origin);
        else
            OUT("; %s\n%s\n", origin, line);
    }
#undef OUT
    return (int)n;
}
