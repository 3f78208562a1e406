/*
 * api_decode.h - each route's JSON decoder (api_decode*.c): a request
 * body, already parsed by jansson, in; a plain C request or the first
 * problem with it out. Nothing here touches a connection, the model or
 * the engine, so a fuzzer (or a test) can drive every decoder with
 * nothing but a struct srv_api_limits.
 *
 * Decoders do the cheap checks: field types and ranges, limits that
 * follow from numbers alone, token ids against the vocabulary, and the
 * prompt's byte length against the longest text one token can stand for.
 * The expensive work (rendering a chat template, tokenizing, the prompt's
 * fit) is srv_prepare's (api_prepare.h), which runs off the loop thread.
 *
 * Ownership: every decoder fills a caller-provided struct; what it
 * allocates is released by that struct's _clear function, which is safe
 * on a zeroed struct and after a failed decode. Texts and JSON values
 * marked "borrowed from body" live as long as the struct's `body`
 * reference (taken by the decoder, dropped by _clear).
 */
#ifndef KVD_SERVER_API_DECODE_H
#define KVD_SERVER_API_DECODE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "server/scheduler.h"

/* What decoders check a request against. */
struct srv_api_limits {
    int n_vocab;            /* token ids must be below this (the model's vocabulary) */
    int max_prompt_tokens;  /* 400 above this */
    int max_tokens;         /* the largest max_tokens / n_predict accepted */
    int default_max_tokens; /* OpenAI shapes, when the request says none */
    int max_choices;        /* the largest n (OpenAI choices per request) accepted */
    int max_session_id;     /* longest session id accepted */
    struct kv_policy policy; /* prompts that can never fit (policy none), chat turns,
                                pinned spans against the budget */
    int page_tokens;         /* tokens per KV page (pinned spans' budget) */
    bool chat_turns;         /* [eviction] unit = turn: a chat is fitted by whole turns */
    int max_token_bytes;     /* the most bytes of text one token can stand for
                                (model_max_token_bytes); 0 = no byte bound */
    const char *chat_unavailable; /* NULL when a chat template is loaded, else why
                                     none is (borrowed; chat answers 500) */
    uint64_t seed;                /* the sampling seed of a request that names none */
};

/* The first problem found with a request (status 0: none). */
struct srv_api_error {
    int status;       /* HTTP status: 400, or 503 when memory ran out */
    char param[64];   /* the field at fault, or "" */
    const char *code; /* OpenAI error code (static), or NULL */
    char msg[512];
};

/*
 * A prompt as the request gave it, not yet tokenized: parts in order,
 * each a text (borrowed from the body) or a run of token ids (from ids,
 * consecutively, already checked against the vocabulary).
 */
struct srv_prompt_part {
    const char *text; /* text to tokenize, or NULL: n_ids ids */
    size_t len;
    bool bos; /* text: starts the prompt (BOS first if the model wants one) */
    int n_ids;
};
struct srv_prompt {
    struct srv_prompt_part *parts;
    int n_parts, cap_parts;
    int32_t *ids;
    int n_ids, cap_ids;
};

/* The three completion shapes. */
enum srv_api_shape {
    SRV_SHAPE_OPENAI, /* POST /v1/completions */
    SRV_SHAPE_LLAMA,  /* POST /completion (llama.cpp) */
    SRV_SHAPE_CHAT,   /* POST /v1/chat/completions */
};

/* A decoded completion request. */
struct srv_completion {
    enum srv_api_shape shape;
    struct engine_req *req;      /* every engine field but the prompt (owned) */
    struct srv_prompt prompt; /* OPENAI, LLAMA */
    json_t *body;             /* the request (a reference, owned) */
    const json_t *messages;   /* CHAT (borrowed from body) */
    const json_t *tools;      /* CHAT, or NULL (borrowed from body) */
    bool stream;              /* answer as Server-Sent Events */
    bool include_usage;       /* OpenAI stream_options.include_usage */
    bool return_tokens;       /* llama.cpp return_tokens */
    bool logprobs;            /* log-probabilities asked for */
    bool id_tokens;           /* OpenAI return_tokens_as_token_ids */
    bool max_tokens_given;    /* CHAT: the request set max_tokens / max_completion_tokens */
    json_t *settings;         /* LLAMA: generation_settings to echo (owned) */
};

/*
 * Decode a completion request, one decoder per shape. hdr_session: the
 * X-Session-Id header, or NULL. Returns 0, or -1 with e filled (out is
 * then cleared). body is borrowed; on success out holds a reference.
 */
typedef int srv_completion_decoder(const struct srv_api_limits *lim, json_t *body,
                                   const char *hdr_session, struct srv_completion *out,
                                   struct srv_api_error *e);
int srv_decode_openai(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                      struct srv_completion *out, struct srv_api_error *e);
int srv_decode_llama(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                     struct srv_completion *out, struct srv_api_error *e);
int srv_decode_chat(const struct srv_api_limits *lim, json_t *body, const char *hdr_session,
                    struct srv_completion *out, struct srv_api_error *e);
void srv_completion_clear(struct srv_completion *c);

/* POST /tokenize: {"content", "add_special", "with_pieces"}. */
struct srv_tokenize_req {
    const char *text; /* borrowed from body */
    size_t len;
    bool add_special, with_pieces;
    json_t *body; /* a reference (owned) */
};
int srv_decode_tokenize(const struct srv_api_limits *lim, json_t *body,
                        struct srv_tokenize_req *out, struct srv_api_error *e);
void srv_tokenize_req_clear(struct srv_tokenize_req *t);

/* POST /detokenize: {"tokens": [id, ...]}. */
struct srv_detokenize_req {
    int32_t *ids; /* [n] checked against the vocabulary (owned) */
    int n, cap;
};
int srv_decode_detokenize(const struct srv_api_limits *lim, json_t *body,
                          struct srv_detokenize_req *out, struct srv_api_error *e);
void srv_detokenize_req_clear(struct srv_detokenize_req *t);

/* POST /apply-template: {"messages", "tools"?, "add_generation_prompt"?}. */
struct srv_apply_template_req {
    const json_t *messages, *tools; /* borrowed from body; tools may be NULL */
    bool add_generation_prompt;
    json_t *body; /* a reference (owned) */
};
int srv_decode_apply_template(const struct srv_api_limits *lim, json_t *body,
                              struct srv_apply_template_req *out, struct srv_api_error *e);
void srv_apply_template_req_clear(struct srv_apply_template_req *t);

/* GET/DELETE /v1/sessions/ID: the id in the path against the X-Session-Id
 * header (hdr, or NULL). Returns 0 or -1 with e filled. */
int srv_decode_session_path(const struct srv_api_limits *lim, const char *id, const char *hdr,
                            struct srv_api_error *e);

/*
 * A request body as JSON: a new object, or NULL with e filled (empty
 * body, invalid UTF-8 with its byte, invalid JSON with line and column,
 * not an object). Duplicate keys are refused.
 */
json_t *srv_decode_body(const char *body, size_t len, struct srv_api_error *e);

#endif /* KVD_SERVER_API_DECODE_H */
