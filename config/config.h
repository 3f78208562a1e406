/*
 * config.h - kvd's operator configuration: one INI file, defaults, overrides,
 * validation and reload classification.
 *
 * The central idea is Redis's standardConfig: one table (keys.c) lists
 * every key with its section, type, default, bounds, unit, one line of
 * documentation and whether a running server may apply a change to it. That
 * table alone drives parsing, the built-in defaults, the dump that
 * `kvd check-config` prints, the check of the example file config/kvd.conf
 * and the classification of a reload into "applied now" and "ignored until
 * restart". Adding a key is one table row, one struct field and one
 * documented line in kvd.conf.
 *
 * Precedence: built-in defaults < the file < command-line overrides
 * (`--set section.key=value`, parsed by the same code). Every key remembers
 * where its value came from (struct cfg_origin).
 *
 * A struct cfg is a plain value: strings are fixed-size arrays, nothing is
 * allocated, so a config is copied with `=` and swapped by pointer, and
 * there is nothing to free.
 *
 * Errors are collected, never printed: every function that can fail appends
 * to a caller-owned struct cfg_errors (source, line, key, message), keeps
 * going, and returns -EINVAL at the end if anything was wrong, in the way
 * jansson fills a json_error_t. This room depends on libc and libinih only,
 * and has no global state but the hook table wired once at start
 * (cfg_set_hooks): calls on distinct structs may run on any thread.
 */
#ifndef KVD_CONFIG_H
#define KVD_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --- value types ---------------------------------------------------------- */

enum cfg_kv_type {
    CFG_KV_F16 = 0, /* IEEE half: 2 bytes per element (default) */
    CFG_KV_F32,     /* 4 bytes per element */
    CFG_KV_BF16,    /* bfloat16: 2 bytes per element */
    CFG_KV_Q8_0,    /* GGUF q8_0: blocks of 32, 34 bytes (8.5 bits per element) */
    CFG_KV_Q4_0,    /* GGUF q4_0: blocks of 32, 18 bytes (4.5 bits per element) */
    CFG_KV_SAME,    /* k_type / v_type only: whatever kv_type says */
    CFG_KV_TYPE_COUNT = CFG_KV_SAME /* element types proper (CFG_KV_SAME is none) */
};

enum cfg_policy {
    CFG_EVICT_NONE = 0,    /* never evict: a sequence ends at max_cache_tokens */
    CFG_EVICT_SINK_WINDOW, /* StreamingLLM: keep the first sink tokens and a recent window */
    CFG_EVICT_H2O,         /* sinks + heavy hitters by attention mass + recent window */
    CFG_EVICT_TOVA,        /* ... middle kept by the latest query's attention */
    CFG_EVICT_KNORM,       /* ... middle kept by key norm (the largest evicted) */
    CFG_EVICT_SNAPKV,      /* ... middle kept by a prompt's last queries, pooled */
    CFG_EVICT_COUNT
};

enum cfg_knorm_evict {
    CFG_KNORM_LARGEST = 0, /* evict the largest key norms (the paper's finding) */
    CFG_KNORM_SMALLEST,    /* evict the smallest */
};

/* Whether a policy keeps heavy_tokens middle tokens by a score (h2o, tova,
 * knorm, snapkv): the one list config, the wiring and the logs read. */
static inline bool cfg_policy_scored(enum cfg_policy p)
{
    return p == CFG_EVICT_H2O || p == CFG_EVICT_TOVA || p == CFG_EVICT_KNORM ||
           p == CFG_EVICT_SNAPKV;
}

enum cfg_positions {
    CFG_POS_RENUMBER = 0, /* retained tokens renumbered 0..n-1 after eviction */
    CFG_POS_PRESERVE,     /* each token keeps the position it was first given */
    CFG_POS_COUNT
};

enum cfg_evict_unit {
    CFG_UNIT_TURN = 0, /* chat: whole turns leave, oldest first (system, tools, last turn kept) */
    CFG_UNIT_TOKEN,    /* chat: the conversation is rendered whole; the policy evicts tokens */
};

enum cfg_log_level { CFG_LOG_DEBUG = 0, CFG_LOG_INFO, CFG_LOG_WARN, CFG_LOG_ERROR };
enum cfg_log_format { CFG_LOG_TEXT = 0, CFG_LOG_JSON };

/* String buffer sizes (including the terminating NUL). */
#define CFG_ADDR_MAX 128  /* [server] listen */
#define CFG_PATH_MAX 1024 /* file paths */
#define CFG_KEY_MAX 256   /* [auth] api_key */
/* The longest line a config file may have, trimmed: libinih reads lines
 * into a buffer of INI_MAX_LINE (200) bytes, newline and NUL included. */
#define CFG_LINE_MAX 198

/* --- the configuration ------------------------------------------------------ */

/*
 * Key identifiers, in table order (and the order of the dump and of
 * kvd.conf). cfg_key_section()/cfg_key_name() give the spelling.
 */
enum cfg_key {
    CFG_SERVER_LISTEN = 0,
    CFG_SERVER_THREADS,
    CFG_SERVER_DRAIN_TIMEOUT,
    CFG_SERVER_MAX_CONNECTIONS,
    CFG_MODEL_PATH,
    CFG_MODEL_ALIBI_MAX_BIAS,
    CFG_MODEL_T5_NUM_BUCKETS,
    CFG_MODEL_T5_MAX_DISTANCE,
    CFG_MODEL_TOKENIZER_PRE,
    CFG_MODEL_CHAT_TEMPLATE,
    CFG_MODEL_HUGE_PAGES,
    CFG_CACHE_MEMORY,
    CFG_CACHE_PAGE_TOKENS,
    CFG_CACHE_KV_TYPE,
    CFG_CACHE_K_TYPE,
    CFG_CACHE_V_TYPE,
    CFG_CACHE_MLOCK,
    CFG_CACHE_PREFIX_CACHE,
    CFG_CACHE_PREFIX_CACHE_SHARE,
    CFG_EVICTION_POLICY,
    CFG_EVICTION_MAX_CACHE_TOKENS,
    CFG_EVICTION_SINK_TOKENS,
    CFG_EVICTION_WINDOW_TOKENS,
    CFG_EVICTION_HEAVY_TOKENS,
    CFG_EVICTION_OBSERVE_TOKENS,
    CFG_EVICTION_POOL_TOKENS,
    CFG_EVICTION_KNORM_EVICT,
    CFG_EVICTION_POSITIONS,
    CFG_EVICTION_UNIT,
    CFG_EVICTION_SESSION_IDLE_TIMEOUT,
    CFG_EVICTION_MAX_SESSIONS,
    CFG_SESSIONS_DIR,
    CFG_SESSIONS_MAX_DISK,
    CFG_LIMITS_MAX_HEADER_BYTES,
    CFG_LIMITS_MAX_HEADERS,
    CFG_LIMITS_MAX_BODY_BYTES,
    CFG_LIMITS_HEADER_TIMEOUT,
    CFG_LIMITS_IDLE_TIMEOUT,
    CFG_LIMITS_BODY_TIMEOUT,
    CFG_LIMITS_WRITE_BUFFER,
    CFG_LIMITS_MAX_PROMPT_TOKENS,
    CFG_LIMITS_MAX_TOKENS,
    CFG_LIMITS_MAX_CHOICES,
    CFG_LIMITS_QUEUE_LENGTH,
    CFG_LIMITS_MAX_RUNNING,
    CFG_LIMITS_STEP_TOKENS,
    CFG_LIMITS_STEP_BUDGET,
    CFG_LIMITS_ENGINE_STALL_TIMEOUT,
    CFG_AUTH_API_KEY,
    CFG_AUTH_API_KEY_FILE,
    CFG_LOG_LEVEL,
    CFG_LOG_FORMAT,
    CFG_N_KEYS
};

/* Where a key's value came from. */
enum cfg_origin_kind {
    CFG_FROM_DEFAULT = 0, /* built-in default */
    CFG_FROM_FILE,        /* a line of cfg.file */
    CFG_FROM_CMDLINE,     /* a --set override */
};

struct cfg_origin {
    enum cfg_origin_kind kind;
    int line; /* CFG_FROM_FILE: 1-based line in cfg.file; otherwise 0 */
};

/* Durations are milliseconds, sizes are bytes; *_ms fields are durations. */
struct cfg_server {
    char listen[CFG_ADDR_MAX]; /* HOST:PORT to accept HTTP on; port 0 = any free port */
    int64_t threads;           /* compute threads for the engine; 0 = all cores */
    uint64_t drain_timeout_ms; /* on shutdown, wait this long for running requests */
    int64_t max_connections;   /* open client connections beyond this are refused */
};

struct cfg_model {
    char path[CFG_PATH_MAX]; /* GGUF file to serve */
    double alibi_max_bias;   /* ALiBi max_bias when the model lacks it; 0 = none */
    int64_t t5_num_buckets;  /* T5 bucket count when the model lacks it; 0 = none */
    int64_t t5_max_distance; /* T5 max distance when the model lacks it; 0 = none */
    char tokenizer_pre[64];  /* pre-tokenizer forced over the file's; "" = the file's */
    char chat_template[CFG_PATH_MAX]; /* Jinja file used over the model's template; "" = none */
    bool huge_pages; /* advise the repacked weights as 2 MiB pages (else ask for 4 KiB) */
};

struct cfg_cache {
    uint64_t memory;          /* bytes of KV pages in the pool */
    int64_t page_tokens;      /* tokens per page */
    enum cfg_kv_type kv_type; /* element type of stored K and V (shorthand for both) */
    enum cfg_kv_type k_type;  /* of K; CFG_KV_SAME = kv_type (see cfg_k_type()) */
    enum cfg_kv_type v_type;  /* of V; CFG_KV_SAME = kv_type (see cfg_v_type()) */
    bool mlock;               /* lock the pool in RAM */
    bool prefix_cache;        /* share full pages of equal prompt prefixes */
    int64_t prefix_cache_share; /* percent of the pool idle cached pages may hold */
};

struct cfg_eviction {
    enum cfg_policy policy;
    int64_t max_cache_tokens; /* tokens one sequence may hold in the cache */
    int64_t sink_tokens;      /* first tokens never evicted */
    int64_t window_tokens;    /* recent tokens kept; 0 = fill the budget, see cfg_window_tokens() */
    int64_t heavy_tokens;     /* scored policies: middle tokens kept by score */
    int64_t observe_tokens;   /* snapkv: a prompt chunk's last queries observed */
    int64_t pool_tokens;      /* snapkv: max-pool width over neighbours */
    enum cfg_knorm_evict knorm_evict; /* knorm: which end of the norms leaves */
    enum cfg_positions positions;     /* position numbers after eviction */
    enum cfg_evict_unit unit;         /* what leaves first in chat requests */
    uint64_t session_idle_timeout_ms; /* drop a session idle this long; 0 = only when the pool is
                                         short */
    int64_t max_sessions;             /* sessions kept between requests; 0 = none */
};

struct cfg_sessions {
    char dir[CFG_PATH_MAX]; /* sessions saved here instead of lost; "" = off */
    uint64_t max_disk;      /* bytes of session files kept there; least recently used go */
};

struct cfg_limits {
    uint64_t max_header_bytes;  /* request line + headers */
    int64_t max_headers;        /* header fields per request */
    uint64_t max_body_bytes;    /* request body */
    uint64_t header_timeout_ms; /* time to receive the whole header block */
    uint64_t idle_timeout_ms;   /* a connection silent this long is closed */
    uint64_t body_timeout_ms;   /* time to receive a whole body after its headers */
    uint64_t write_buffer;      /* stream bytes left unread before generation pauses */
    int64_t max_prompt_tokens;  /* prompts longer than this are rejected (400) */
    int64_t max_tokens;         /* cap on a request's max_tokens */
    int64_t max_choices;        /* cap on a request's n (OpenAI choices) */
    int64_t queue_length;       /* requests waiting for a slot; beyond it, 429 */
    int64_t max_running;        /* sequences in one engine batch */
    int64_t step_tokens;        /* tokens per engine step (prefill chunks + decodes) */
    uint64_t step_budget_ms;    /* while decodes wait, a step's most time: prefill chunks are
                                   cut to ~2.5x the decodes' own step within it (pace.c);
                                   0 = step_tokens only */
    uint64_t engine_stall_timeout_ms; /* a step longer than this: /health says 503; 0 = never */
};

struct cfg_auth {
    char api_key[CFG_KEY_MAX];       /* bearer token clients must send; "" = none */
    char api_key_file[CFG_PATH_MAX]; /* file whose first line is the token; "" = none */
};

struct cfg_log {
    enum cfg_log_level level;
    enum cfg_log_format format;
};

struct cfg {
    struct cfg_server server;
    struct cfg_model model;
    struct cfg_cache cache;
    struct cfg_eviction eviction;
    struct cfg_sessions sessions;
    struct cfg_limits limits;
    struct cfg_auth auth;
    struct cfg_log log;
    char file[CFG_PATH_MAX];              /* the file loaded, as given; "" if none */
    struct cfg_origin origin[CFG_N_KEYS]; /* where each key's value came from */
};

/* --- errors ------------------------------------------------------------------ */

#define CFG_MAX_ERRORS 64

struct cfg_error {
    char source[CFG_PATH_MAX]; /* file path as given, "command line", or "defaults" */
    int line;                  /* 1-based line in source; 0 when not from a file line */
    char key[96];              /* "section.key" as written, "[section]", or "" */
    char message[384];         /* e.g. "[cache] page_tokens = 0: must be an integer in [1, 4096]" */
};

/*
 * A caller-owned list of errors (about 100 KB: keep it off small stacks).
 * Functions append; when the list is full further errors only count in
 * `dropped`.
 */
struct cfg_errors {
    int count;
    int dropped;
    struct cfg_error list[CFG_MAX_ERRORS];
};

void cfg_errors_init(struct cfg_errors *errs);

/*
 * "source:line: message", or "source: message" when line is 0, into buf
 * (always NUL-terminated when len > 0). Returns the length snprintf would
 * have written.
 */
int cfg_error_format(const struct cfg_error *e, char *buf, size_t len);

/* --- loading -------------------------------------------------------------------- */

/* Set every key to its built-in default, origins to CFG_FROM_DEFAULT. */
void cfg_defaults(struct cfg *c);

/*
 * The whole sequence `kvd serve` and `kvd check-config` use: defaults, then
 * the file at `path` (skipped when NULL), then each of the n_sets
 * "section.key=value" overrides in order, then the cross-key rules
 * (cfg_validate). Every error of every stage is appended to errs; a rule
 * involving a key whose own value was rejected is not checked, so one
 * mistake is reported once. Returns 0, or -EINVAL when anything was wrong
 * (*c then holds what did parse and must not be used to serve).
 */
int cfg_load(struct cfg *c, const char *path, const char *const *sets, int n_sets,
             struct cfg_errors *errs);

/*
 * Parse the INI file at `path` on top of *c (keys it sets override). File
 * format: `[section]` headers, `key = value` lines, comments on lines
 * starting with '#' or ';', inline comments after " ;". Each key may appear
 * once. Returns 0, -EINVAL if any line was wrong (each one reported; a
 * rejected value leaves the key as it was), or the negative errno of
 * opening/reading the file (also reported, with source = path, line 0).
 * Does not apply the cross-key rules.
 */
int cfg_load_file(struct cfg *c, const char *path, struct cfg_errors *errs);

/*
 * Same as cfg_load_file for INI text in memory; `name` is the source named
 * in errors and recorded in c->file. Returns 0 or -EINVAL.
 */
int cfg_load_string(struct cfg *c, const char *text, const char *name, struct cfg_errors *errs);

/*
 * Apply one command-line override "section.key=value" (spaces around the
 * key and the value are ignored). Errors name "command line" instead of a
 * file and line. Returns 0 or -EINVAL (*c unchanged).
 */
int cfg_set(struct cfg *c, const char *assignment, struct cfg_errors *errs);

/*
 * The cross-key rules, all checked, every violation reported (at the
 * origin of the key the message is about):
 *   - with eviction on, the budget as the cache counts it (struct
 *     cfg_budget, from the hook the program wires): kept + window + one
 *     page <= max_cache_tokens, where kept is the sinks rounded up to whole
 *     pages (sink-window) or sink_tokens + heavy_tokens (scored) and window is
 *     cfg_window_tokens(); kept + one page <= max_cache_tokens is reported
 *     first on its own; the window, explicit or automatic, is at least one
 *     page; and should the cache still refuse the policy, its own reason;
 *   - a scored policy (h2o, tova, knorm, snapkv) keeps at least one heavy token;
 *   - T5 overrides: both or neither of t5_num_buckets and t5_max_distance,
 *     num_buckets >= 4, max_distance > num_buckets/2 (the exact range of
 *     causal buckets: Hugging Face's formula is undefined otherwise);
 *   - api_key and api_key_file are not both set;
 *   - step_tokens >= max_running (every running sequence decodes one token
 *     per step).
 * Returns 0 or -EINVAL.
 */
int cfg_validate(const struct cfg *c, struct cfg_errors *errs);

/* --- derived values and server-side checks ------------------------------------- */

/*
 * The recent window the eviction policy keeps: window_tokens if set,
 * otherwise what fills the budget (the cache's window_room: the largest
 * window cfg_validate allows); 0 if that is negative (cfg_validate rejects
 * it). Policy none: window_tokens as set (unused). `kvd serve` hands this
 * value to the cache.
 */
int64_t cfg_window_tokens(const struct cfg *c);

/* The element types K and V are stored in: k_type / v_type, or kv_type
 * where they say "kv_type". Never CFG_KV_SAME. */
enum cfg_kv_type cfg_k_type(const struct cfg *c);
enum cfg_kv_type cfg_v_type(const struct cfg *c);

/* Pages one sequence can occupy at its full budget (the cache's
 * sequence_pages: whole-page eviction may leave the first and the last page
 * partly empty). */
int64_t cfg_sequence_pages(const struct cfg *c);

/*
 * The server's check once the model's dimensions are known: the pool must
 * hold one sequence at its full budget, cfg_sequence_pages() pages of
 * page_tokens tokens of kv_bytes_per_token bytes (K and V, every layer and
 * KV head, in cache.kv_type) - or, when window_bytes is not 0, window_bytes:
 * what the cache says one sequence takes when the model's sliding-window
 * layers keep only their window (kv_cache_sequence_pages). Appends an error
 * at [cache] memory's origin naming the bytes needed. Returns 0 or -EINVAL
 * (also when the product overflows).
 */
int cfg_check_memory(const struct cfg *c, uint64_t kv_bytes_per_token, uint64_t window_bytes,
                     struct cfg_errors *errs);

/* --- hooks: rules another room owns ------------------------------------------- */

/*
 * The eviction budget is the cache's arithmetic (cache/kv_cache.h,
 * kv_policy_budget and kv_policy_check), and this room may not include the
 * cache. As Redis's config table calls a key's validate hook, the rules and
 * derived values above call one hook that the program wires in at start
 * (cli/wiring.c, from main): given a config, it states the budget of its
 * [eviction] keys and [cache] page_tokens in the cache's own terms, and the
 * cache's verdict on the policy `kvd serve` would hand it. Config only
 * words the violations, at the keys and lines involved; so `kvd
 * check-config`, `kvd serve` and a SIGHUP reload give one answer from one
 * computation.
 */
struct cfg_budget {
    int64_t kept_tokens;    /* kept besides the window: sinks as whole pages, or sinks + heavy */
    int64_t floor_tokens;   /* kept + one page */
    int64_t window_room;    /* max_cache_tokens - floor_tokens: the largest window that fits */
    int64_t window_tokens;  /* the window in effect (window_tokens, or 0 = window_room) */
    int64_t need_tokens;    /* floor + window_tokens as set */
    int64_t sequence_pages; /* pages of one sequence at its full budget */
    int verdict;            /* 0 if the cache accepts the policy in effect, else < 0 */
    char why[256];          /* the cache's reason when it refuses */
};

struct cfg_hooks {
    /* Fill *out for c (policy none included). Called from any thread. */
    void (*budget)(const struct cfg *c, struct cfg_budget *out);
};

/*
 * Wire the hooks (the table is borrowed, and must outlive every config
 * call). Set once, before any thread starts: the only state this room
 * keeps. Without a budget hook cfg_validate refuses every config with
 * eviction on, naming the missing hook.
 */
void cfg_set_hooks(const struct cfg_hooks *hooks);

/* --- the key table --------------------------------------------------------------- */

const char *cfg_key_section(enum cfg_key k); /* "cache" */
const char *cfg_key_name(enum cfg_key k);    /* "page_tokens" */
const char *cfg_key_doc(enum cfg_key k);     /* one line on what it changes */

/* True if a running server applies a change to this key on reload. */
bool cfg_key_live(enum cfg_key k);

/* Find a key by section and name; returns the key or -1. */
int cfg_key_find(const char *section, const char *name);

/*
 * The type, range, unit and default of a key as one line, e.g.
 * "integer (tokens) in [1, 4096]; default 16" — the exact line kvd.conf
 * carries above each key. Returns the snprintf length.
 */
int cfg_key_describe(enum cfg_key k, char *buf, size_t len);

/* The key's value in c as kvd.conf would spell it (sizes as 512MiB, ...). */
int cfg_format_value(const struct cfg *c, enum cfg_key k, char *buf, size_t len);

/* "default", "FILE:LINE" or "command line". */
int cfg_format_origin(const struct cfg *c, enum cfg_key k, char *buf, size_t len);

/* True if a and b hold the same value for key k. */
bool cfg_value_equal(const struct cfg *a, const struct cfg *b, enum cfg_key k);

/*
 * The effective configuration as INI text that parses back to the same
 * values, each key followed by "; <origin>"; a set api_key is shown only as
 * a comment saying it is set. A key whose line would pass CFG_LINE_MAX
 * with its origin gets the origin on a comment line above it, and is
 * written "name=value" if "name = value" alone is too long, so that every
 * value a file could set dumps to a line a file can hold (a longer value,
 * possible only from --set, is written whole; loading it names the line).
 * Returns the snprintf length (call with len 0 to size the buffer).
 */
int cfg_dump(const struct cfg *c, char *buf, size_t len);

/* --- reload ------------------------------------------------------------------------ */

/* The keys whose values differ between two configs, split by reload class. */
struct cfg_diff {
    int n_live; /* changed and applied by a running server */
    enum cfg_key live[CFG_N_KEYS];
    int n_restart; /* changed but ignored until restart */
    enum cfg_key restart[CFG_N_KEYS];
};

/*
 * Classify what changed from `old` to `new`: eviction, limits, log, auth
 * and the [server] drain_timeout / max_connections apply live; listen,
 * threads, [model] and [cache] need a restart.
 */
void cfg_reload_diff(const struct cfg *old, const struct cfg *new_cfg, struct cfg_diff *diff);

/*
 * What a running server switches to on reload: *next = running with every
 * live key (value and origin) taken from `loaded`, restart-only keys kept
 * as running has them. *diff says which changes were applied and which are
 * ignored until restart. The merged result is checked with cfg_validate,
 * since a live key may now meet an old restart-only one (a new
 * max_cache_tokens with the old page_tokens). Returns 0, or -EINVAL with the
 * errors appended; then the server keeps `running`. *next may not alias the
 * inputs.
 */
int cfg_reload(const struct cfg *running, const struct cfg *loaded, struct cfg *next,
               struct cfg_diff *diff, struct cfg_errors *errs);

/* --- value syntax, for command-line flags that take the same units ------------- */

/*
 * Sizes: a whole number with an optional unit, case-insensitive: B, KiB,
 * MiB, GiB, TiB (powers of 1024) or KB, MB, GB, TB (powers of 1000, as the
 * SI prefixes say); no unit means bytes. "4GiB" = 4294967296. Returns 0,
 * -EINVAL (bad number or unit; err says which) or -ERANGE (over 2^64-1).
 */
int cfg_parse_size(const char *s, uint64_t *out, char *err, size_t errlen);

/*
 * Durations: one or more <whole number><unit> terms, units ms, s, m, h, d
 * ("250ms", "30s", "1h30m"); "0" needs no unit. Result in milliseconds.
 * Returns 0, -EINVAL or -ERANGE, like cfg_parse_size.
 */
int cfg_parse_duration(const char *s, uint64_t *ms, char *err, size_t errlen);

/* true/false, yes/no, on/off, 1/0 (case-insensitive). Returns 0 or -EINVAL. */
int cfg_parse_bool(const char *s, bool *out);

/* Bytes in the largest binary unit that divides them exactly ("512MiB", "1000"). */
int cfg_format_size(uint64_t bytes, char *buf, size_t len);

/* Milliseconds in the largest unit that divides them exactly ("30s", "90s", "0"). */
int cfg_format_duration(uint64_t ms, char *buf, size_t len);

#endif /* KVD_CONFIG_H */
