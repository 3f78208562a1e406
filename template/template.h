/*
 * template.h - chat templates: a Jinja-subset interpreter in C.
 *
 * A GGUF model carries the prompt format it was trained on as Jinja source
 * text (tokenizer.chat_template). Hugging Face renders it with Python's
 * Jinja2 (trim_blocks and lstrip_blocks on, keep_trailing_newline off) and
 * the variables messages, tools, bos_token, eos_token and
 * add_generation_prompt. This room renders the same text to the same bytes
 * without Python: a lexer cuts the source into text and tags (applying the
 * whitespace rules there, once), a parser builds a tree, and an evaluator
 * walks it over jansson values.
 *
 * The central promise is "the same prompt or an error, never a different
 * prompt". Everything a template names that this interpreter does not
 * implement (a statement such as {% include %}, a filter, a test, a string
 * method, a function) is refused by tpl_load with the line and column and
 * the construct's name, so a model whose template cannot be rendered
 * faithfully is found at load, not by a model answering a malformed prompt.
 *
 * Render cost is bounded by tpl_limits, counted on every step: nesting
 * depth (expression and statement recursion, macro calls) never reaches the
 * C stack's limit, loop iterations and produced bytes are capped, and every
 * string an expression builds counts against the output cap before it is
 * allocated. A template that hits a limit fails with the limit named.
 *
 * The chat layer (tpl_chat_*) adds what servers do around the raw render:
 * content given as an array of text parts is joined, a template that
 * refuses or drops the system role (found by rendering probe conversations,
 * never by its name) gets the system text prepended to the first user
 * message, and a leading BOS text is stripped when the tokenizer adds BOS.
 *
 * Ownership: tpl_load returns a new template; tpl_render returns a new
 * malloc'd string. Context values are borrowed for the call. A template is
 * immutable after load and may be rendered by several threads at once.
 * Nothing here prints or exits; errors fill a caller-owned tpl_error.
 */
#ifndef KVD_TEMPLATE_H
#define KVD_TEMPLATE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <time.h>

typedef struct tpl_template tpl_template;

/* Where and why loading or rendering failed. line and col are 1-based
 * positions in the template source (0 when the error has no place, e.g. a
 * bad context value). */
struct tpl_error {
    int line;
    int col;
    char msg[256];
};

/* Bounds on one render. Zero fields take the defaults below. */
struct tpl_limits {
    int max_depth;         /* nested evaluation steps incl. macro calls (default 200) */
    long max_iterations;   /* loop iterations of one render, all loops (default 1000000) */
    size_t max_output;     /* bytes of output and of any one string built (default 16 MiB) */
};

#define TPL_DEFAULT_MAX_DEPTH 200
#define TPL_DEFAULT_MAX_ITERATIONS 1000000L
#define TPL_DEFAULT_MAX_OUTPUT ((size_t)16 << 20)

/*
 * Parse src (len bytes, UTF-8; it need not be NUL-terminated). Returns a
 * new template, or NULL with err filled: a syntax error, or an unsupported
 * statement, filter, test, method or function, named, at its line:column.
 * limits may be NULL (defaults).
 */
tpl_template *tpl_load(const char *src, size_t len, const struct tpl_limits *limits,
                       struct tpl_error *err);

/* Free a template (NULL is fine). */
void tpl_free(tpl_template *t);

/*
 * Render with the variables of ctx (a JSON object, borrowed), plus the
 * functions raise_exception, range, namespace, dict and strftime_now, whose
 * clock is `now`, read as UTC (a parameter so renders are reproducible). Returns 0 and a
 * new NUL-terminated string in *out (its length in *out_len), or -1 with
 * *out NULL and err filled (raise_exception's message, a type error, a
 * limit), at the line:column of the expression that failed.
 */
int tpl_render(const tpl_template *t, const json_t *ctx, time_t now, char **out,
               size_t *out_len, struct tpl_error *err);

/*
 * Load and render in one call, for fuzzers and one-off tools: src as in
 * tpl_load, ctx as in tpl_render, default limits, now = 0.
 */
int tpl_render_source(const char *src, size_t len, const json_t *ctx, char **out,
                      size_t *out_len, struct tpl_error *err);

/* ------------------------------------------------------------------------
 * Chat rendering
 * ------------------------------------------------------------------------ */

typedef struct tpl_chat tpl_chat;

/* ChatML, the template used when a model carries none. */
extern const char tpl_chatml_source[];

struct tpl_chat_params {
    const char *bos_token;      /* text of BOS ("" when the model has none) */
    const char *eos_token;      /* text of EOS ("" when none) */
    bool strip_bos;             /* the tokenizer adds BOS: drop a leading bos_token */
    struct tpl_limits limits;   /* zeros: defaults */
};

/*
 * Load a chat template and probe it: renders a conversation with a system
 * message and one without, and records whether the system text appears.
 * Returns a new chat template, or NULL with err filled as tpl_load does.
 */
tpl_chat *tpl_chat_create(const char *src, size_t len, const struct tpl_chat_params *p,
                          struct tpl_error *err);

void tpl_chat_destroy(tpl_chat *c);

/* Whether the template renders a system message itself (probed at load). */
bool tpl_chat_supports_system(const tpl_chat *c);

/* The marker the template writes right after an assistant message's text
 * ("<|im_end|>", "<end_of_turn>", "</s>", ...; probed at load), where
 * generation should stop; "" when the template writes none in angle
 * brackets. Borrowed. */
const char *tpl_chat_end_of_turn(const tpl_chat *c);

/*
 * Render messages (a JSON array of {"role", "content", ...}, borrowed) and
 * tools (array or NULL). Content may be a string, null, or an array of
 * {"type": "text", "text": S} parts (joined with "\n"); other part types
 * are refused. A template without system support gets leading system and
 * developer messages joined into the first user message ("SYSTEM\nUSER").
 * Returns 0 and a new string, or -1 with err filled.
 */
int tpl_chat_render(const tpl_chat *c, const json_t *messages, const json_t *tools,
                    bool add_generation_prompt, time_t now, char **out, size_t *out_len,
                    struct tpl_error *err);

/*
 * Turn-aware fitting: render the conversation with as many of its oldest
 * turns left out as it takes for the prompt to fit a token budget.
 *
 * A turn is a user message with the messages that answer it, up to the
 * next user message. Pinned, never left out: the system (and developer)
 * messages, the tool definitions, and the last turn that starts with a
 * user message (with what follows it). The rest leave whole, oldest first,
 * so the prompt is always exactly the template's rendering of the
 * messages kept: no turn is ever cut, and the template's structure holds.
 *
 * count(text, len, ctx) gives the tokens text takes (-1 on failure).
 * Turns before min_drop are left out whatever happens (a session's earlier
 * decision, so its cached prefix stays valid). If the prompt with min_drop
 * turns out fits budget, that is the answer; otherwise as few further turns
 * go as bring it within low_water (<= budget; a margin so that the next
 * requests append to the cache instead of dropping again). Costs
 * O(log turns) renders.
 */
struct tpl_fit {
    int dropped_turns;    /* turns left out, min_drop included */
    int dropped_messages; /* messages left out */
    int prompt_tokens;    /* count() of the rendering returned */
    int pinned_tokens;    /* count() of the rendering with every droppable turn out */
};

int tpl_chat_fit(const tpl_chat *c, const json_t *messages, const json_t *tools,
                 bool add_generation_prompt, time_t now, int budget, int low_water, int min_drop,
                 int (*count)(const char *text, size_t len, void *ctx), void *count_ctx,
                 char **out, size_t *out_len, struct tpl_fit *fit, struct tpl_error *err);

/*
 * A conversation's rendering cut at its turns (chat_turns.c), for a cache
 * that drops whole turns in place and must still hold what the template
 * renders for the messages it keeps.
 *
 * The messages are taken with their `drop` oldest turns left out (turns
 * and pinned messages as tpl_chat_fit defines them) and rendered with the
 * generation prompt as
 *
 *     head | turn 1 | ... | turn n | tail
 *
 * head: what the template writes for the system and developer messages
 * (and the tools) before the first droppable turn; turn i: the i-th
 * droppable turn; tail: the last user turn, what follows it and the
 * generation prompt. The cut is checked, never assumed: the head rendered
 * alone, the head with each turn alone and the head with the tail must
 * give exactly these bytes, and leaving out the first turn must give the
 * same text without it. A template that folds the system prompt into a
 * turn, renders a turn differently by its place, or puts a system message
 * inside the conversation is not separable.
 *
 * Returns 0: separable, out filled (a conversation without droppable
 * turns has n_turns 0 and head_len = len); 1: rendered but not
 * separable, out->text holds the whole rendering, n_turns is 0 and
 * out->why says why; -1: the conversation cannot be rendered (err
 * filled, out empty). Free out with tpl_turns_free in every case.
 */
struct tpl_turns {
    char *text;           /* the whole rendering, NUL-terminated (new) */
    size_t len;           /* its bytes */
    size_t head_len;      /* bytes of the head */
    int n_turns;          /* droppable turns */
    size_t *turn_end;     /* [n_turns] byte offset just past each turn (new) */
    int *turn_messages;   /* [n_turns] messages in each turn (new) */
    int dropped_messages; /* messages of the `drop` turns left out */
    char why[240];        /* not separable: why */
};

int tpl_chat_turns(const tpl_chat *c, const json_t *messages, const json_t *tools, int drop,
                   time_t now, struct tpl_turns *out, struct tpl_error *err);
void tpl_turns_free(struct tpl_turns *t);

/* Format err as "LINE:COL: MESSAGE" (or MESSAGE when it has no place) into
 * buf; returns buf. */
const char *tpl_error_string(const struct tpl_error *err, char *buf, size_t len);

#endif
