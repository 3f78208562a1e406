/*
 * template_internal.h - shared inside the template room: tokens, the syntax
 * tree, values, and the helpers the lexer, parser, evaluator and builtins
 * call in one another. Never included from outside template/.
 */
#ifndef KVD_TEMPLATE_INTERNAL_H
#define KVD_TEMPLATE_INTERNAL_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "template/template.h"

/* ------------------------------------------------------------------------
 * Arena: every node, name and decoded string of a template lives in one
 * arena freed with the template, so the tree needs no per-node frees.
 * ------------------------------------------------------------------------ */

struct arena_block;
struct arena {
    struct arena_block *head;
};

void *tpl_arena_alloc(struct arena *a, size_t size); /* zeroed; aborts on OOM */
char *tpl_arena_strndup(struct arena *a, const char *s, size_t n);
void tpl_arena_free(struct arena *a);

/* ------------------------------------------------------------------------
 * Tokens (lexer.c)
 * ------------------------------------------------------------------------ */

enum tk_kind {
    TK_EOF = 0,
    TK_TEXT,        /* template data, whitespace rules already applied */
    TK_VAR_BEGIN,   /* {{ */
    TK_VAR_END,     /* }} */
    TK_BLOCK_BEGIN, /* {% */
    TK_BLOCK_END,   /* %} */
    TK_NAME,
    TK_STRING, /* decoded literal */
    TK_INT,
    TK_FLOAT,
    TK_OP,
};

/* Operators of two characters; one-character operators use their char. */
enum {
    OP_EQ = 256, /* == */
    OP_NE,       /* != */
    OP_LE,       /* <= */
    OP_GE,       /* >= */
    OP_FLOORDIV, /* // */
    OP_POW,      /* ** */
    /* not tokens: operators the parser makes from names */
    OP_AND,
    OP_OR,
    OP_NOT,
    OP_IN,
    OP_NOT_IN,
    OP_NEG,
    OP_POS,
};

struct token {
    enum tk_kind kind;
    int line, col;
    int op;          /* TK_OP */
    const char *s;   /* TK_TEXT, TK_NAME, TK_STRING: arena bytes */
    size_t len;
    long long ival;  /* TK_INT */
    double fval;     /* TK_FLOAT */
};

struct token_list {
    struct token *v;
    size_t n, cap;
};

/* Cut src into tokens (new array in *out; strings in the arena). Returns 0
 * or -1 with err filled. */
int tpl_lex(const char *src, size_t len, struct arena *a, struct token_list *out,
            struct tpl_error *err);

/* ------------------------------------------------------------------------
 * Syntax tree (parser.c)
 * ------------------------------------------------------------------------ */

enum node_kind {
    /* statements */
    N_BLOCK = 1, /* kids: statements */
    N_TEXT,      /* str */
    N_OUTPUT,    /* a: expression */
    N_IF,        /* a: cond, b: then (block), c: else (block or N_IF for elif) */
    N_FOR,       /* names: targets, a: iterable, b: filter, c: body, d: else */
    N_SET,       /* name or (a: namespace expr, name: attr) or names; b: value */
    N_SET_BLOCK, /* name, c: body captured as a string */
    N_MACRO,     /* name, names: params, kids: defaults (NULL = none), c: body */
    N_BREAK,
    N_CONTINUE,
    /* expressions */
    N_CONST,  /* value */
    N_NAME,   /* name */
    N_LIST,   /* kids */
    N_TUPLE,  /* kids */
    N_DICT,   /* kids: key, value, key, value ... */
    N_ATTR,   /* a: object, name */
    N_INDEX,  /* a: object, b: key */
    N_SLICE,  /* a: object, b: start, c: stop, d: step (each may be NULL) */
    N_CALL,   /* a: callee, kids: args, kw: keyword names (NULL: positional) */
    N_FILTER, /* name, a: input, kids/kw: args; fn: the builtin */
    N_TEST,   /* name, a: operand, kids: args, op: 1 when negated; fn: the builtin */
    N_UNARY,  /* op (OP_NOT, OP_NEG, OP_POS), a */
    N_BINARY, /* op, a, b */
    N_COND,   /* a: value, b: condition, c: else value (may be NULL) */
};

struct node {
    enum node_kind kind;
    int line, col;
    int op;
    const char *name;
    json_t *value; /* N_CONST (owned by the template's constant list), N_TEXT as string */
    const char *str;
    size_t str_len;
    struct node *a, *b, *c, *d;
    struct node **kids;
    const char **kw;
    size_t n_kids;
    const char **names;
    size_t n_names;
    int fn; /* index into the builtin table of N_FILTER / N_TEST / method calls */
};

struct tpl_template {
    struct arena arena;
    struct node *root;
    json_t *consts; /* array holding every constant's reference */
    struct tpl_limits limits;
};

/* Parse tokens into t->root. Returns 0 or -1 with err filled. */
int tpl_parse(tpl_template *t, const struct token_list *toks, struct tpl_error *err);

/* ------------------------------------------------------------------------
 * Values (value.c)
 * ------------------------------------------------------------------------ */

enum val_kind {
    V_UNDEF = 0, /* a name or key that does not exist */
    V_JSON,      /* j: a JSON value (one reference owned by the val) */
    V_MACRO,     /* macro: the N_MACRO node */
    V_FUNC,      /* fn: index into the global function table */
    V_LOOP,      /* loop: the running for-loop's state */
};

struct loop_state;

struct val {
    enum val_kind kind;
    json_t *j;
    const struct node *macro;
    const struct loop_state *loop;
    int fn;
};

static inline struct val val_undef(void)
{
    struct val v = {0};
    return v;
}
/* Steals j (a new reference; NULL means allocation failure, callers check). */
static inline struct val val_json(json_t *j)
{
    struct val v = {0};
    v.kind = V_JSON;
    v.j = j;
    return v;
}
void val_drop(struct val *v);
struct val val_copy(const struct val *v); /* another reference */

bool val_truthy(const struct val *v);
bool val_is_string(const struct val *v);
bool val_is_number(const struct val *v);

/* Growable byte buffer. Appends fail (-1) past `max` bytes. */
struct sbuf {
    char *p;
    size_t n, cap, max;
};
int sbuf_add(struct sbuf *b, const char *s, size_t n);
int sbuf_addc(struct sbuf *b, char c);
int sbuf_printf(struct sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void sbuf_free(struct sbuf *b);

/* Python's str() of a value appended to b (None, True, 1.5, {'a': 1}). */
int val_str(struct sbuf *b, const struct val *v);
int json_str(struct sbuf *b, const json_t *j, bool repr);
/* Python's json.dumps(j, ensure_ascii=False, indent=indent (<0: none),
 * sort_keys=sort) appended to b: ", " and ": " separators as Python's. */
int json_dump_py(struct sbuf *b, const json_t *j, int indent, bool sort, int level);
/* Python's repr of a float ("0.1", "1e+16", "2.0"). */
void fmt_float(char *out, size_t len, double d);

/* Python ==, with 1 == 1.0 == True. */
bool val_equal(const struct val *a, const struct val *b);
bool json_equal_py(const json_t *a, const json_t *b);
/* Python ordering; returns 0 and *cmp in {-1,0,1}, or -1 when the types do
 * not order (strings with numbers, dicts...). */
int json_compare_py(const json_t *a, const json_t *b, int *cmp);

/* UTF-8: the number of code points, and the byte offset of code point i
 * (clamped to the string's end). */
size_t utf8_len(const char *s, size_t n);
size_t utf8_offset(const char *s, size_t n, size_t i);

/* ------------------------------------------------------------------------
 * Evaluation (eval.c) and builtins (builtins.c)
 * ------------------------------------------------------------------------ */

struct frame;
struct render;

/* Fail the render at node n (n may be NULL) with a formatted message.
 * Always returns -1. */
int rfail(struct render *r, const struct node *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Bytes one string may have (the render's output limit). */
size_t rmax_string(const struct render *r);
/* Count loop iterations against the limit; -1 (with the error) past it. */
int rcount_iterations(struct render *r, const struct node *n, long k);

/* Call a macro value with evaluated arguments; the result is a string. */
int call_macro(struct render *r, const struct node *at, const struct val *m,
               struct val *args, const char **kw, size_t n, struct val *out);
/* Iterate a value as a Jinja for-loop does: a new JSON array of the items
 * (lists as they are, dict keys, string characters), or -1 (error set). */
int val_iterable(struct render *r, const struct node *at, const struct val *v, json_t **out);
/* The value of v.name / v[key] (Jinja tries attribute then item). */
int val_getattr(struct render *r, const struct node *at, const struct val *v,
                const char *name, struct val *out);

/* Arguments of a builtin call, evaluated. */
struct args {
    struct val *v;
    const char **kw;
    size_t n;
};

/* The kinds of builtins, looked up by name at parse time. */
enum builtin_kind { B_FILTER, B_TEST, B_METHOD, B_FUNC };

/* Index of name among builtins of kind, or -1. */
int tpl_builtin_find(enum builtin_kind kind, const char *name);
/* Whether some method of any receiver type has this name. */
bool tpl_method_exists(const char *name);

/* Run builtin fn of kind on input (the piped value, the tested value, the
 * receiver, or NULL for functions). out receives a new value (for tests, a
 * JSON boolean). Returns 0 or -1 with the render's error set. */
int tpl_builtin_call(struct render *r, const struct node *at, enum builtin_kind kind, int fn,
                     const struct val *input, struct args *args, struct val *out);
/* Call a method by name on a receiver; returns 1 when the receiver's type
 * has no such method (the caller then tries attribute lookup). */
int tpl_method_call(struct render *r, const struct node *at, const char *name,
                    const struct val *recv, struct args *args, struct val *out);

/* namespace() objects: the only ones {% set x.attr %} may change */
void tpl_register_namespace(struct render *r, json_t *ns);

/* time of the current render (strftime_now) */
time_t rnow(const struct render *r);

/* ------------------------------------------------------------------------
 * Chat turns (chat.c), shared with chat_turns.c
 * ------------------------------------------------------------------------ */

/* A system or developer role (NULL is neither). */
bool tpl_chat_is_system(const char *role);
/* The droppable turns of msgs: indices of their first messages in
 * starts[0..n) (room for one per message), each turn running to the next
 * start (or to `end`, where the pinned last user turn begins). Returns n. */
int tpl_chat_find_turns(const json_t *msgs, int *starts, int *end);
/* msgs without the messages of turns [0, d) (system and developer
 * messages inside them stay: they are pinned). New array; *dropped counts
 * what left. */
json_t *tpl_chat_without_turns(const json_t *msgs, const int *starts, int n_turns, int end,
                               int d, int *dropped);
#endif
