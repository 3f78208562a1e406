/*
 * api_internal.h - what the API's files share (never included from
 * outside server/api*.c): the API's state, an accepted request (a call),
 * and each file's functions the others use.
 *
 * The files, and who calls whom (no circle):
 *   api_routes.c      the route table, auth, the small routes
 *     -> api_calls.c    accepted requests: prepare (off the loop thread), submit
 *     -> api_tokens.c   /tokenize, /detokenize
 *     -> api_chat.c     chat sessions, the template, /apply-template
 *   api_answer.c      engine events -> JSON bodies and SSE (srv_api_pump)
 *     -> api_answer_lp.c  log-probabilities in each shape
 *     -> api_calls.c, api_chat.c
 *   api_work.c        jobs on libuv's work queue (called by calls, tokens, chat)
 *   api_limits.c      what requests are checked against; seeds
 *   api_chat_sess.c   what chat sessions decided (turns left out)
 *   api_prepare.c     render + tokenize + the prompt's fit (api_prepare.h)
 *   api_decode*.c     each route's JSON decoder (api_decode.h)
 *   api_json.c        error answers, JSON helpers, field readers
 *   api.c             lifecycle
 * Everything at the bottom (api_work.c, api_limits.c, api_chat_sess.c,
 * api_prepare.c, api_decode*.c, api_json.c) calls nothing above it.
 */
#ifndef KVD_SERVER_API_INTERNAL_H
#define KVD_SERVER_API_INTERNAL_H

#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "server/api.h"
#include "server/api_decode.h"
#include "server/api_prepare.h"

/* Compact output; 15 significant digits print 0.95f's double as 0.95. */
#define SRV_JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

#define SRV_MAX_STOP 16
#define SRV_MAX_STOP_BYTES 512

enum call_kind {
    CALL_OPENAI,
    CALL_LLAMA,
    CALL_CHAT,
    CALL_SESSION_GET,
    CALL_SESSION_DELETE,
    CALL_SESSION_MAP,
    CALL_SESSION_LIST
};

/* One choice's answer (a request has n_choices of them, OpenAI's n). */
struct call_choice {
    char *text; /* non-streamed: the text so far */
    size_t len, cap;
    struct srv_lp_buf *lp; /* non-streamed: the log-probabilities so far, as JSON text
                              (api_answer_lp.c; owned) */
    size_t lp_chars;       /* OpenAI text_offset of the next token, in code points */
    bool role_sent;        /* chat stream: the first chunk (delta.role) went out */
    enum engine_finish finish; /* its finish, once it ended (CHOICE or DONE event) */
};

/* One accepted request, from its decoding to its last answer byte (loop
 * thread only). */
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
    struct call_choice *ch; /* [n_choices] each choice's answer (OpenAI n; owned) */
    int n_choices;
    enum engine_finish cut; /* a choice was cut short (engine_finish_cut), else EOG */
    int32_t *toks; /* llama.cpp return_tokens */
    int n_toks, cap_toks;
    json_t *settings; /* llama.cpp generation_settings (owned) */
    bool logprobs;    /* OpenAI logprobs / llama.cpp n_probs asked for */
    bool id_tokens;   /* OpenAI return_tokens_as_token_ids: "token_id:ID" strings */
    int evicted_messages;  /* chat: messages of the conversation not in the prompt */
    const char *turn_eviction; /* chat, unit = turn: "in_place" or "rerender" (static) */
    char turn_fallback[240];   /* chat on a session: why its turns were rendered again
                                  instead of evicted in place ("" if they were not) */
    int cut_tokens;            /* chat: tokens cut from the middle of a last turn larger
                                  than the window */
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
    int max_token_bytes; /* model_max_token_bytes, for the byte bound */
    char model_name[256];
    int64_t ready_time;
    bool draining;
    int in_flight; /* calls submitted to the engine and not yet ended */
    int jobs;      /* jobs on the work queue (api_work.c) */
    uint64_t next_id;
    uint64_t seed_state;
    struct call *calls; /* submitted calls */
    struct uv_loop_s *loop; /* for the work queue (NULL: jobs run inline) */
    /* For the text of a token on its own (alternatives in logprobs). */
    model_detok *piece_detok;
    char *piece_buf;
    size_t piece_cap;
    /* Chat: the template (loaded when the model is), or why there is none. */
    char chat_path[1024];
    tpl_chat *chat;
    char chat_err[700];
    int32_t eot_token;           /* the template's end of turn as a control token, or -1 */
    struct chat_sess *chat_sess; /* most recently used first */
    int n_chat_sess;
    char *config_json; /* GET /v1/config (owned), or NULL */
};

/* --- api_work.c: jobs off the loop thread ------------------------------------- */

/*
 * A job: `run` on a worker thread (it reads only what the job owns and
 * what is immutable: the model, the chat template), then `done` on the
 * loop thread, which answers when conn is still set and frees the job.
 * Embed it in the job's own struct.
 */
struct srv_api_job {
    uv_work_t work;
    srv_api *a;
    srv_conn *conn; /* NULL once the client left (then done only frees) */
    void (*run)(struct srv_api_job *j);
    void (*done)(struct srv_api_job *j);
};
/* Queue j (run and done set). The job owns the connection's answer until
 * done; without a loop, or if libuv refuses, it runs here. */
void srv_api_job_start(srv_api *a, srv_conn *conn, struct srv_api_job *j);

/* --- api_json.c: answers, JSON helpers, field readers ----------------------- */

/* Answer an error (logged at debug; the client made it). extra: NULL or
 * header lines each ending in "\r\n". */
void srv_api_error(srv_conn *c, int status, const char *param, const char *code,
                   const char *extra, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* Answer the first problem a decoder found. */
void srv_api_error_from(srv_conn *c, const struct srv_api_error *e);
/* Answer a JSON value (stolen); 500 when it is NULL or cannot be dumped. */
void srv_respond_json(srv_conn *c, int status, json_t *v);
/* A JSON string from bytes that should be UTF-8; invalid bytes become
 * U+FFFD so a model that emits garbage never breaks a response. */
json_t *srv_json_text(const char *s, size_t n);
/* Record a 400 (only the first problem is kept); returns -1. */
int srv_fail(struct srv_api_error *e, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* Record a 503 for memory that ran out `what` ("reading 'stop'"); -1. */
int srv_oom(struct srv_api_error *e, const char *what);
/* "an object", "a string", ... */
const char *srv_json_type_name(const json_t *v);
/* The field, or NULL when absent or null. */
json_t *srv_field(const json_t *o, const char *key);
/* Typed fields: 1 if present (and valid), 0 if absent or null, -1 bad
 * (recorded in e). Integers in [min, max]; numbers in [min, max]. */
int srv_get_int(const json_t *o, const char *key, long long min, long long max, long long *out,
                struct srv_api_error *e);
int srv_get_num(const json_t *o, const char *key, double min, double max, double *out,
                struct srv_api_error *e);
int srv_get_bool(const json_t *o, const char *key, bool *out, struct srv_api_error *e);
int srv_get_str(const json_t *o, const char *key, const char **out, struct srv_api_error *e);
/* Whether s is a session id of 1..max characters of A-Z a-z 0-9 . _ : - */
bool srv_session_id_ok(const char *s, size_t max);

/* --- api_decode.c: what the shapes' decoders share ---------------------------- */

/* Zero out, take a reference to body and a new request; -1 (503) on OOM. */
int srv_decode_start(enum srv_api_shape shape, json_t *body, struct srv_completion *out,
                     struct srv_api_error *e);
/* Sampling fields, session (hdr_session: X-Session-Id or NULL), stop, ignore_eos. */
void srv_decode_common(const struct srv_api_limits *lim, const json_t *body,
                       const char *hdr_session, struct engine_req *r, struct srv_api_error *e);
/* Alternatives per token (OpenAI logprobs, llama.cpp n_probs) in
 * 0..min(n_vocab, ENGINE_MAX_TOP_LOGPROBS): 1 present, 0 absent, -1 bad. */
int srv_decode_top_n(const struct srv_api_limits *lim, const json_t *body, const char *key,
                     int *out, struct srv_api_error *e);
/*
 * A non-streamed answer with log-probabilities holds tokens x
 * (alternatives + 1) entries until it is sent; ENGINE_MAX_LOGPROB_ENTRIES
 * bounds that before any work is done (a stream sends each token's
 * entries as it goes and is not bounded here).
 */
void srv_decode_logprob_work(const struct engine_req *r, bool stream, const char *param,
                             struct srv_api_error *e);
/* The prompt as given (mixed: llama.cpp's arrays of strings and ids), and
 * the byte bound. */
int srv_decode_prompt(const struct srv_api_limits *lim, const json_t *body, bool mixed,
                      struct srv_prompt *out, struct srv_api_error *e);
/* r->max_tokens from body[key] (left as is when absent). */
int srv_decode_max_tokens(const struct srv_api_limits *lim, const json_t *body, const char *key,
                          struct engine_req *r, struct srv_api_error *e);
/* OpenAI's n (1..lim->max_choices) into r->n_choices, and n x max_tokens
 * within lim->max_tokens (a request that names no max_tokens gets its
 * share; max_given: it named one). */
void srv_decode_choices(const struct srv_api_limits *lim, const json_t *body, bool max_given,
                        struct engine_req *r, struct srv_api_error *e);
/* OpenAI's defaults: plain sampling at temperature 1, lim->seed. */
void srv_decode_openai_sampling(const struct srv_api_limits *lim, struct engine_req *r);
/* What OpenAI's completion and chat routes share: n, seed, stream,
 * stream_options, user, model. */
void srv_decode_openai_shared(const json_t *body, struct engine_req *r, struct srv_completion *c,
                              struct srv_api_error *e);
/* logit_bias: only an empty object is accepted. */
void srv_decode_no_logit_bias(const json_t *body, struct srv_api_error *e);
/* "messages" (a non-empty array of objects with a known role) and "tools"
 * (an array) of a chat or /apply-template request. */
int srv_decode_messages(const json_t *body, const json_t **msgs, const json_t **tools,
                        struct srv_api_error *e);

/* --- api_tokens.c: token routes, streaming decode --------------------------- */

/*
 * One step of a streaming decode: the text of token *id (or, with id NULL,
 * what the stream still holds) appended at (*buf)[len], growing *buf
 * (caller frees; *cap its size). Returns the bytes appended, or -1 when
 * memory runs out (ids are checked against the vocabulary before).
 */
int srv_detok_step(model_detok *d, const int32_t *id, char **buf, size_t *cap, size_t len);
void srv_route_tokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req);
void srv_route_detokenize(srv_api *a, srv_conn *c, const struct srv_http_req *req);

/* --- api_chat.c, api_chat_sess.c: the template, /apply-template, sessions ---- */

/* Load the chat template once the model is loaded (logs which, or why none). */
void srv_chat_load(srv_api *a);
/* The session's recorded decision (turns/messages left out), or NULL. */
const struct chat_sess *srv_chat_sess_get(srv_api *a, const char *id);
/* Record it; -1 (nothing recorded) when memory runs out. */
int srv_chat_sess_set(srv_api *a, const char *id, int turns, int messages);
void srv_chat_sess_forget(srv_api *a, const char *id);
/* Its fallback to rendering has been logged (no-op for an unknown id). */
void srv_chat_sess_fallback_logged(srv_api *a, const char *id);
void srv_chat_sess_free_all(srv_api *a);
void srv_route_apply_template(srv_api *a, srv_conn *c, const struct srv_http_req *req);

/* --- api_limits.c ------------------------------------------------------------- */

/* A fresh sampling seed (splitmix64 over the clock-seeded state). */
uint64_t srv_api_next_seed(srv_api *a);
/* The limits the decoders check against, as the API's params now say. */
void srv_api_limits(srv_api *a, struct srv_api_limits *lim);

/* --- api_calls.c: accepted requests ------------------------------------------ */
/* Take a decoded completion (its contents move into the call, c is
 * cleared), prepare its prompt off the loop thread, then submit it. Every
 * outcome is answered. */
void srv_call_start(srv_api *a, srv_conn *conn, struct srv_completion *c);
/* Submit a session request (GET/DELETE /v1/sessions/ID, GET .../ID/map
 * with its options). */
void srv_call_session(srv_api *a, srv_conn *conn, const char *id, enum call_kind kind,
                      const struct engine_map_opts *map);
/* Submit GET /v1/sessions for the page list asks for (list->after moves
 * into the request: NULL after the call). */
void srv_call_sessions(srv_api *a, srv_conn *conn, struct engine_list_opts *list);
/* --- api_sessions.c: GET /v1/sessions ---------------------------------------- */
/* The list's query (limit=N, after=ID; api_sessions.c says what they may
 * be): 0 with *out set (out->after new, or NULL), or -EINVAL / -ENOMEM
 * with the parameter's name in param and the reason in msg. */
int srv_sessions_parse_query(const char *query, int max_session_id, struct engine_list_opts *out,
                             char *param, size_t plen, char *msg, size_t mlen);
/* Answer the page (ev->list; 500 when it is NULL). */
void srv_sessions_respond(srv_conn *conn, const struct engine_event *ev);

/* Memory ran out assembling a non-streamed answer: 500 now (never a cut
 * answer passed off as whole), and the generation is stopped. */
void srv_call_out_of_memory(struct call *call);
/* The call's final event was handled: detach and free it. */
void srv_call_end(srv_api *a, struct call *call);
void srv_call_free(struct call *call);

/* --- api_answer_lp.c: log-probabilities in each shape ------------------------- */

/* One token's log-probabilities as a stream event carries them (new):
 * OpenAI's logprobs object, chat's {"content": [entry]}, llama.cpp's
 * [entry]. */
json_t *srv_lp_stream_json(struct call *call, struct call_choice *ch,
                           const struct engine_logprob *lp);
/* Add one token's to a non-streamed answer's (serialised now, kept as
 * text). -1 when memory runs out. */
int srv_lp_buf_add(struct call *call, struct call_choice *ch, const struct engine_logprob *lp);
void srv_lp_buf_free(struct srv_lp_buf *b);
/* The placeholder to put in an answer's tree where choice i's
 * log-probabilities go (new), then answer with srv_lp_respond. */
json_t *srv_lp_marker(int i);
int srv_lp_respond(struct call *call, int status, json_t *v);

#endif /* KVD_SERVER_API_INTERNAL_H */
