/*
 * parser.c - tokens to a syntax tree, refusing what the evaluator lacks.
 *
 * A recursive-descent parser with Jinja2's grammar and precedence, lowest
 * first: conditional (a if c else b), or, and, not, comparisons and in,
 * + and -, ~, * / // %, **, unary minus, then a primary with its postfix
 * operators (.attr, [index or slice], (call)) and filters (| f) and tests
 * (is t), which bind tighter than any binary operator, as in Jinja.
 *
 * The parser is where "unsupported" is decided, once: statements outside
 * the subset (include, extends, block, import, call, with, filter blocks,
 * recursive loops...), filters, tests, methods and functions the builtins
 * table lacks are refused here with the construct's name and position, so
 * rendering never meets a name it cannot run. Calls to plain names must
 * name a builtin function or a macro the template defines (checked once
 * the whole template is read, since a macro may be defined after use).
 *
 * Recursion is bounded: every nested expression and block counts against
 * the template's max_depth, so a hostile "((((((..." fails with an error
 * instead of overflowing the C stack.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

struct parser {
    tpl_template *t;
    const struct token *tok;
    size_t n, i;
    int depth;
    int loops; /* for-loops around the current point (break/continue) */
    struct tpl_error *err;
    /* calls of plain names, checked after the parse */
    const struct node **calls;
    size_t n_calls, cap_calls;
    const char **macros;
    size_t n_macros, cap_macros;
};

/* A growable list of child nodes, copied into the arena when done. */
struct nvec {
    struct node **v;
    const char **kw;
    size_t n, cap;
};

static void nvec_push(struct nvec *l, struct node *n, const char *kw)
{
    if (l->n == l->cap) {
        l->cap = l->cap ? l->cap * 2 : 8;
        l->v = realloc(l->v, l->cap * sizeof *l->v);
        l->kw = realloc(l->kw, l->cap * sizeof *l->kw);
        if (!l->v || !l->kw)
            abort();
    }
    l->v[l->n] = n;
    l->kw[l->n++] = kw;
}

static void nvec_move(struct parser *p, struct nvec *l, struct node *to, bool with_kw)
{
    to->n_kids = l->n;
    if (l->n) {
        to->kids = tpl_arena_alloc(&p->t->arena, l->n * sizeof *to->kids);
        memcpy(to->kids, l->v, l->n * sizeof *to->kids);
        if (with_kw) {
            to->kw = tpl_arena_alloc(&p->t->arena, l->n * sizeof *to->kw);
            memcpy(to->kw, l->kw, l->n * sizeof *to->kw);
        }
    }
    free(l->v);
    free(l->kw);
    memset(l, 0, sizeof *l);
}

/* --- tokens --- */

static const struct token *cur(const struct parser *p)
{
    return &p->tok[p->i < p->n ? p->i : p->n - 1];
}

static void advance(struct parser *p)
{
    if (p->i < p->n - 1)
        p->i++;
}

static int fail_at(struct parser *p, const struct token *t, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int fail_at(struct parser *p, const struct token *t, const char *fmt, ...)
{
    if (p->err->msg[0])
        return -1; /* keep the first error */
    p->err->line = t->line;
    p->err->col = t->col;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(p->err->msg, sizeof p->err->msg, fmt, ap);
    va_end(ap);
    return -1;
}

static const char *describe(const struct token *t, char *buf, size_t len)
{
    switch (t->kind) {
    case TK_EOF: return "end of template";
    case TK_TEXT: return "template data";
    case TK_VAR_BEGIN: return "'{{'";
    case TK_VAR_END: return "'}}'";
    case TK_BLOCK_BEGIN: return "'{%'";
    case TK_BLOCK_END: return "'%}'";
    case TK_NAME: snprintf(buf, len, "'%.40s'", t->s); return buf;
    case TK_STRING: return "a string";
    case TK_INT:
    case TK_FLOAT: return "a number";
    case TK_OP:
        if (t->op < 256)
            snprintf(buf, len, "'%c'", t->op);
        else
            snprintf(buf, len, "operator");
        return buf;
    }
    return "?";
}

static int unexpected(struct parser *p, const char *wanted)
{
    char b[64];
    return fail_at(p, cur(p), "expected %s, found %s", wanted, describe(cur(p), b, sizeof b));
}

static bool is_op(const struct parser *p, int op)
{
    return cur(p)->kind == TK_OP && cur(p)->op == op;
}

static bool is_name(const struct parser *p, const char *name)
{
    return cur(p)->kind == TK_NAME && strcmp(cur(p)->s, name) == 0;
}

static bool accept_op(struct parser *p, int op)
{
    if (!is_op(p, op))
        return false;
    advance(p);
    return true;
}

static bool accept_name(struct parser *p, const char *name)
{
    if (!is_name(p, name))
        return false;
    advance(p);
    return true;
}

static int expect_op(struct parser *p, int op)
{
    if (accept_op(p, op))
        return 0;
    char w[8];
    snprintf(w, sizeof w, "'%c'", op);
    return unexpected(p, w);
}

static struct node *mk(struct parser *p, enum node_kind kind, const struct token *at)
{
    struct node *n = tpl_arena_alloc(&p->t->arena, sizeof *n);
    n->kind = kind;
    n->line = at->line;
    n->col = at->col;
    n->fn = -1;
    return n;
}

static struct node *mk_const(struct parser *p, const struct token *at, json_t *v)
{
    if (!v)
        abort();
    struct node *n = mk(p, N_CONST, at);
    json_array_append_new(p->t->consts, v);
    n->value = v;
    return n;
}

static int enter(struct parser *p)
{
    if (++p->depth > p->t->limits.max_depth)
        return fail_at(p, cur(p), "nesting deeper than %d levels", p->t->limits.max_depth);
    return 0;
}

/* --- expressions --- */

static struct node *parse_expr(struct parser *p, bool allow_cond);
static struct node *parse_unary(struct parser *p, bool with_filter);
static struct node *parse_or(struct parser *p);

static int parse_args(struct parser *p, struct node *call)
{
    struct nvec args = {0};
    bool kw_seen = false;
    while (!is_op(p, ')')) {
        if (args.n && expect_op(p, ',') < 0)
            goto fail;
        if (is_op(p, ')'))
            break; /* trailing comma */
        if (is_op(p, '*') || is_op(p, OP_POW)) {
            fail_at(p, cur(p), "unsupported construct: *args / **kwargs in a call");
            goto fail;
        }
        const char *kw = NULL;
        if (cur(p)->kind == TK_NAME && p->i + 1 < p->n && p->tok[p->i + 1].kind == TK_OP &&
            p->tok[p->i + 1].op == '=') {
            kw = cur(p)->s;
            advance(p);
            advance(p);
            kw_seen = true;
        } else if (kw_seen) {
            fail_at(p, cur(p), "positional argument after a keyword argument");
            goto fail;
        }
        struct node *e = parse_expr(p, true);
        if (!e)
            goto fail;
        nvec_push(&args, e, kw);
    }
    advance(p); /* ')' */
    nvec_move(p, &args, call, true);
    return 0;
fail:
    free(args.v);
    free(args.kw);
    return -1;
}

/* [ ... ] after an expression: an index or a slice */
static struct node *parse_subscript(struct parser *p, struct node *obj, const struct token *at)
{
    struct node *parts[3] = {NULL, NULL, NULL};
    int k = 0;
    bool slice = false;
    for (;;) {
        if (is_op(p, ':')) {
            if (k == 2)
                return unexpected(p, "']'"), NULL;
            slice = true;
            advance(p);
            k++;
            continue;
        }
        if (is_op(p, ']'))
            break;
        if (parts[k])
            return unexpected(p, "':' or ']'"), NULL;
        parts[k] = parse_expr(p, true);
        if (!parts[k])
            return NULL;
    }
    advance(p);
    if (!slice) {
        if (!parts[0])
            return fail_at(p, at, "empty subscript"), NULL;
        struct node *n = mk(p, N_INDEX, at);
        n->a = obj;
        n->b = parts[0];
        return n;
    }
    struct node *n = mk(p, N_SLICE, at);
    n->a = obj;
    n->b = parts[0];
    n->c = parts[1];
    n->d = parts[2];
    return n;
}

static int note_call(struct parser *p, const struct node *call)
{
    if (p->n_calls == p->cap_calls) {
        p->cap_calls = p->cap_calls ? p->cap_calls * 2 : 16;
        p->calls = realloc(p->calls, p->cap_calls * sizeof *p->calls);
        if (!p->calls)
            abort();
    }
    p->calls[p->n_calls++] = call;
    return 0;
}

static struct node *parse_postfix(struct parser *p, struct node *n)
{
    for (;;) {
        const struct token *at = cur(p);
        if (accept_op(p, '.')) {
            if (cur(p)->kind == TK_INT) {
                struct node *idx = mk(p, N_INDEX, at);
                idx->a = n;
                idx->b = mk_const(p, cur(p), json_integer(cur(p)->ival));
                advance(p);
                n = idx;
                continue;
            }
            if (cur(p)->kind != TK_NAME)
                return unexpected(p, "an attribute name"), NULL;
            struct node *a = mk(p, N_ATTR, at);
            a->a = n;
            a->name = cur(p)->s;
            advance(p);
            n = a;
        } else if (accept_op(p, '[')) {
            n = parse_subscript(p, n, at);
            if (!n)
                return NULL;
        } else if (accept_op(p, '(')) {
            struct node *c = mk(p, N_CALL, at);
            c->a = n;
            c->line = n->line; /* errors point at the callee's name */
            c->col = n->col;
            if (parse_args(p, c) < 0)
                return NULL;
            if (n->kind == N_ATTR) {
                if (!tpl_method_exists(n->name)) {
                    p->err->line = n->line;
                    p->err->col = n->col + 1;
                    snprintf(p->err->msg, sizeof p->err->msg, "unsupported method '%s'", n->name);
                    return NULL;
                }
            } else if (n->kind == N_NAME) {
                note_call(p, c);
            } else {
                return fail_at(p, at, "unsupported construct: calling the result of an "
                                      "expression"),
                       NULL;
            }
            n = c;
        } else {
            return n;
        }
    }
}

static struct node *parse_list_like(struct parser *p, const struct token *at, int close,
                                    enum node_kind kind)
{
    struct nvec items = {0};
    struct node *n = mk(p, kind, at);
    while (!is_op(p, close)) {
        if (items.n && expect_op(p, ',') < 0)
            goto fail;
        if (is_op(p, close))
            break;
        struct node *e = parse_expr(p, true);
        if (!e)
            goto fail;
        nvec_push(&items, e, NULL);
        if (kind == N_DICT) {
            if (expect_op(p, ':') < 0)
                goto fail;
            struct node *v = parse_expr(p, true);
            if (!v)
                goto fail;
            nvec_push(&items, v, NULL);
        }
    }
    advance(p);
    nvec_move(p, &items, n, false);
    return n;
fail:
    free(items.v);
    free(items.kw);
    return NULL;
}

static struct node *parse_primary(struct parser *p)
{
    const struct token *t = cur(p);
    if (enter(p) < 0)
        return NULL;
    struct node *n = NULL;
    switch (t->kind) {
    case TK_NAME: {
        const char *s = t->s;
        advance(p);
        if (!strcmp(s, "true") || !strcmp(s, "True"))
            n = mk_const(p, t, json_true());
        else if (!strcmp(s, "false") || !strcmp(s, "False"))
            n = mk_const(p, t, json_false());
        else if (!strcmp(s, "none") || !strcmp(s, "None"))
            n = mk_const(p, t, json_null());
        else {
            n = mk(p, N_NAME, t);
            n->name = s;
        }
        break;
    }
    case TK_STRING: {
        /* adjacent literals concatenate, as in Python */
        struct sbuf b = {.max = (size_t)-1};
        while (cur(p)->kind == TK_STRING) {
            sbuf_add(&b, cur(p)->s, cur(p)->len);
            advance(p);
        }
        n = mk_const(p, t, json_stringn_nocheck(b.p ? b.p : "", b.n));
        sbuf_free(&b);
        break;
    }
    case TK_INT:
        advance(p);
        n = mk_const(p, t, json_integer(t->ival));
        break;
    case TK_FLOAT:
        advance(p);
        n = mk_const(p, t, json_real(t->fval));
        break;
    case TK_OP:
        advance(p);
        if (t->op == '(') {
            if (accept_op(p, ')')) {
                n = mk(p, N_TUPLE, t);
                break;
            }
            struct node *e = parse_expr(p, true);
            if (!e)
                return NULL;
            if (is_op(p, ',')) {
                struct nvec items = {0};
                nvec_push(&items, e, NULL);
                while (accept_op(p, ',') && !is_op(p, ')')) {
                    struct node *x = parse_expr(p, true);
                    if (!x) {
                        free(items.v);
                        free(items.kw);
                        return NULL;
                    }
                    nvec_push(&items, x, NULL);
                }
                n = mk(p, N_TUPLE, t);
                nvec_move(p, &items, n, false);
            } else {
                n = e;
            }
            if (expect_op(p, ')') < 0)
                return NULL;
        } else if (t->op == '[') {
            n = parse_list_like(p, t, ']', N_LIST);
        } else if (t->op == '{') {
            n = parse_list_like(p, t, '}', N_DICT);
        } else {
            p->i--;
            unexpected(p, "an expression");
        }
        break;
    default:
        unexpected(p, "an expression");
    }
    p->depth--;
    return n;
}

static struct node *parse_filter(struct parser *p, struct node *in)
{
    const struct token *at = cur(p);
    if (cur(p)->kind != TK_NAME)
        return unexpected(p, "a filter name"), NULL;
    struct node *f = mk(p, N_FILTER, at);
    f->name = cur(p)->s;
    advance(p);
    if (is_op(p, '.'))
        return fail_at(p, at, "unsupported filter '%s.'", f->name), NULL;
    f->fn = tpl_builtin_find(B_FILTER, f->name);
    if (f->fn < 0)
        return fail_at(p, at, "unsupported filter '%s'", f->name), NULL;
    f->a = in;
    if (accept_op(p, '(') && parse_args(p, f) < 0)
        return NULL;
    return f;
}

static struct node *parse_test(struct parser *p, struct node *in)
{
    const struct token *at = cur(p);
    struct node *t = mk(p, N_TEST, at);
    t->a = in;
    if (accept_name(p, "not"))
        t->op = 1;
    if (cur(p)->kind != TK_NAME)
        return unexpected(p, "a test name"), NULL;
    t->name = cur(p)->s;
    const struct token *name_tok = cur(p);
    advance(p);
    t->fn = tpl_builtin_find(B_TEST, t->name);
    if (t->fn < 0)
        return fail_at(p, name_tok, "unsupported test '%s'", t->name), NULL;
    if (accept_op(p, '(')) {
        if (parse_args(p, t) < 0)
            return NULL;
    } else {
        const struct token *c = cur(p);
        bool starts = c->kind == TK_NAME || c->kind == TK_STRING || c->kind == TK_INT ||
                      c->kind == TK_FLOAT || (c->kind == TK_OP && (c->op == '[' || c->op == '{'));
        if (starts && !is_name(p, "else") && !is_name(p, "or") && !is_name(p, "and") &&
            !is_name(p, "if")) {
            if (is_name(p, "is"))
                return fail_at(p, c, "tests cannot be chained with 'is'"), NULL;
            struct node *arg = parse_primary(p);
            if (!arg || !(arg = parse_postfix(p, arg)))
                return NULL;
            struct nvec one = {0};
            nvec_push(&one, arg, NULL);
            nvec_move(p, &one, t, true);
        }
    }
    return t;
}

static struct node *parse_unary(struct parser *p, bool with_filter)
{
    const struct token *at = cur(p);
    if (enter(p) < 0)
        return NULL;
    struct node *n;
    if (is_op(p, '-') || is_op(p, '+')) {
        int op = cur(p)->op == '-' ? OP_NEG : OP_POS;
        advance(p);
        struct node *x = parse_unary(p, false);
        if (!x)
            return NULL;
        n = mk(p, N_UNARY, at);
        n->op = op;
        n->a = x;
    } else {
        n = parse_primary(p);
    }
    if (n)
        n = parse_postfix(p, n);
    while (n && with_filter) {
        if (accept_op(p, '|'))
            n = parse_filter(p, n);
        else if (accept_name(p, "is"))
            n = parse_test(p, n);
        else
            break;
    }
    p->depth--;
    return n;
}

static struct node *binary(struct parser *p, const struct token *at, int op, struct node *a,
                           struct node *b)
{
    if (!b)
        return NULL;
    struct node *n = mk(p, N_BINARY, at);
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

/* The arithmetic levels, lowest precedence first, as Jinja orders them:
 * + -, then ~, then * / // %, then **; each is left-associative. */
static const int arith_levels[][5] = {
    {'+', '-'}, {'~'}, {'*', '/', OP_FLOORDIV, '%'}, {OP_POW}};
#define N_ARITH_LEVELS (int)(sizeof arith_levels / sizeof arith_levels[0])

static bool at_level(const struct parser *p, int level)
{
    for (int k = 0; k < 5 && arith_levels[level][k]; k++)
        if (is_op(p, arith_levels[level][k]))
            return true;
    return false;
}

static struct node *parse_arith(struct parser *p, int level)
{
    if (level == N_ARITH_LEVELS)
        return parse_unary(p, true);
    struct node *n = parse_arith(p, level + 1);
    while (n && at_level(p, level)) {
        const struct token *at = cur(p);
        advance(p);
        n = binary(p, at, at->op, n, parse_arith(p, level + 1));
    }
    return n;
}

static struct node *parse_compare(struct parser *p)
{
    struct node *n = parse_arith(p, 0);
    for (;;) {
        if (!n)
            return NULL;
        const struct token *at = cur(p);
        int op = 0;
        if (at->kind == TK_OP && (at->op == OP_EQ || at->op == OP_NE || at->op == '<' ||
                                  at->op == '>' || at->op == OP_LE || at->op == OP_GE))
            op = at->op;
        else if (is_name(p, "in"))
            op = OP_IN;
        else if (is_name(p, "not") && p->i + 1 < p->n && p->tok[p->i + 1].kind == TK_NAME &&
                 !strcmp(p->tok[p->i + 1].s, "in")) {
            op = OP_NOT_IN;
            advance(p);
        }
        if (!op)
            return n;
        advance(p);
        /* a < b < c chains as (a < b) and (b < c) in Jinja; kvd's subset
         * has no chains: refuse instead of guessing */
        struct node *rhs = parse_arith(p, 0);
        n = binary(p, at, op, n, rhs);
        if (n && cur(p)->kind == TK_OP &&
            (cur(p)->op == OP_EQ || cur(p)->op == OP_NE || cur(p)->op == '<' ||
             cur(p)->op == '>' || cur(p)->op == OP_LE || cur(p)->op == OP_GE))
            return fail_at(p, cur(p), "unsupported construct: chained comparison"), NULL;
    }
}

static struct node *parse_not(struct parser *p)
{
    const struct token *at = cur(p);
    if (accept_name(p, "not")) {
        if (enter(p) < 0)
            return NULL;
        struct node *x = parse_not(p);
        p->depth--;
        if (!x)
            return NULL;
        struct node *n = mk(p, N_UNARY, at);
        n->op = OP_NOT;
        n->a = x;
        return n;
    }
    return parse_compare(p);
}

static struct node *parse_and(struct parser *p)
{
    struct node *n = parse_not(p);
    while (n && is_name(p, "and")) {
        const struct token *at = cur(p);
        advance(p);
        n = binary(p, at, OP_AND, n, parse_not(p));
    }
    return n;
}

static struct node *parse_or(struct parser *p)
{
    struct node *n = parse_and(p);
    while (n && is_name(p, "or")) {
        const struct token *at = cur(p);
        advance(p);
        n = binary(p, at, OP_OR, n, parse_and(p));
    }
    return n;
}

/* allow_cond: whether "x if c else y" is accepted (not in a for's iterable) */
static struct node *parse_expr(struct parser *p, bool allow_cond)
{
    if (enter(p) < 0)
        return NULL;
    struct node *n = parse_or(p);
    while (n && allow_cond && is_name(p, "if")) {
        const struct token *at = cur(p);
        advance(p);
        struct node *c = mk(p, N_COND, at);
        c->a = n;
        c->b = parse_or(p);
        if (!c->b)
            return NULL;
        if (accept_name(p, "else")) {
            c->c = parse_expr(p, true);
            if (!c->c)
                return NULL;
        }
        n = c;
    }
    p->depth--;
    return n;
}

/* --- statements --- */

static struct node *parse_body(struct parser *p, const char *const *ends);

static int end_tag(struct parser *p)
{
    if (cur(p)->kind != TK_BLOCK_END)
        return unexpected(p, "'%}'");
    advance(p);
    return 0;
}

/* NAME (',' NAME)* or '(' ... ')' */
static int parse_targets(struct parser *p, struct node *n)
{
    const char *names[16];
    size_t k = 0;
    bool paren = accept_op(p, '(');
    do {
        if (cur(p)->kind != TK_NAME)
            return unexpected(p, "a variable name");
        if (k == 16)
            return fail_at(p, cur(p), "more than 16 loop variables");
        names[k++] = cur(p)->s;
        advance(p);
    } while (accept_op(p, ','));
    if (paren && expect_op(p, ')') < 0)
        return -1;
    n->names = tpl_arena_alloc(&p->t->arena, k * sizeof *n->names);
    memcpy(n->names, names, k * sizeof *names);
    n->n_names = k;
    return 0;
}

static struct node *parse_if(struct parser *p, const struct token *at)
{
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    struct node *n = mk(p, N_IF, at);
    if (!(n->a = parse_expr(p, true)) || end_tag(p) < 0 || !(n->b = parse_body(p, ends)))
        return NULL;
    const struct token *t = cur(p);
    if (accept_name(p, "elif")) {
        n->c = parse_if(p, t);
        return n->c ? n : NULL;
    }
    if (accept_name(p, "else")) {
        static const char *const endif[] = {"endif", NULL};
        if (end_tag(p) < 0 || !(n->c = parse_body(p, endif)))
            return NULL;
    }
    if (!accept_name(p, "endif") || end_tag(p) < 0)
        return NULL;
    return n;
}

static struct node *parse_for(struct parser *p, const struct token *at)
{
    static const char *const ends[] = {"else", "endfor", NULL};
    static const char *const endfor[] = {"endfor", NULL};
    struct node *n = mk(p, N_FOR, at);
    if (parse_targets(p, n) < 0)
        return NULL;
    if (!accept_name(p, "in"))
        return unexpected(p, "'in'"), NULL;
    if (!(n->a = parse_expr(p, false)))
        return NULL;
    if (accept_name(p, "if") && !(n->b = parse_expr(p, false)))
        return NULL;
    if (is_name(p, "recursive"))
        return fail_at(p, cur(p), "unsupported construct: recursive for-loop"), NULL;
    if (end_tag(p) < 0)
        return NULL;
    p->loops++;
    n->c = parse_body(p, ends);
    p->loops--;
    if (!n->c)
        return NULL;
    if (accept_name(p, "else") && (end_tag(p) < 0 || !(n->d = parse_body(p, endfor))))
        return NULL;
    if (!accept_name(p, "endfor") || end_tag(p) < 0)
        return NULL;
    return n;
}

static struct node *parse_set(struct parser *p, const struct token *at)
{
    struct node *n = mk(p, N_SET, at);
    if (cur(p)->kind != TK_NAME)
        return unexpected(p, "a variable name"), NULL;
    if (p->i + 1 < p->n && p->tok[p->i + 1].kind == TK_OP && p->tok[p->i + 1].op == '.') {
        n->a = mk(p, N_NAME, cur(p));
        n->a->name = cur(p)->s;
        advance(p);
        advance(p);
        if (cur(p)->kind != TK_NAME)
            return unexpected(p, "an attribute name"), NULL;
        n->name = cur(p)->s;
        advance(p);
    } else if (parse_targets(p, n) < 0) {
        return NULL;
    } else if (n->n_names == 1) {
        n->name = n->names[0];
    }
    if (cur(p)->kind == TK_BLOCK_END) {
        static const char *const ends[] = {"endset", NULL};
        if (!n->name || n->a)
            return fail_at(p, at, "a {%% set %%} block assigns one plain name"), NULL;
        n->kind = N_SET_BLOCK;
        advance(p);
        if (!(n->c = parse_body(p, ends)) || !accept_name(p, "endset") || end_tag(p) < 0)
            return NULL;
        return n;
    }
    if (expect_op(p, '=') < 0 || !(n->b = parse_expr(p, true)))
        return NULL;
    if (is_op(p, ',')) {
        struct nvec items = {0};
        nvec_push(&items, n->b, NULL);
        while (accept_op(p, ',')) {
            struct node *x = parse_expr(p, true);
            if (!x) {
                free(items.v);
                free(items.kw);
                return NULL;
            }
            nvec_push(&items, x, NULL);
        }
        n->b = mk(p, N_TUPLE, at);
        nvec_move(p, &items, n->b, false);
    }
    return end_tag(p) < 0 ? NULL : n;
}

static struct node *parse_macro(struct parser *p, const struct token *at)
{
    static const char *const ends[] = {"endmacro", NULL};
    struct node *n = mk(p, N_MACRO, at);
    if (cur(p)->kind != TK_NAME)
        return unexpected(p, "a macro name"), NULL;
    n->name = cur(p)->s;
    advance(p);
    if (expect_op(p, '(') < 0)
        return NULL;
    struct nvec params = {0}, defaults = {0};
    while (!is_op(p, ')')) {
        if (params.n && expect_op(p, ',') < 0)
            goto fail;
        if (cur(p)->kind != TK_NAME) {
            unexpected(p, "a parameter name");
            goto fail;
        }
        struct node *name = mk(p, N_NAME, cur(p));
        name->name = cur(p)->s;
        advance(p);
        struct node *def = NULL;
        if (accept_op(p, '=') && !(def = parse_expr(p, true)))
            goto fail;
        nvec_push(&params, name, NULL);
        nvec_push(&defaults, def, NULL);
    }
    advance(p);
    n->n_names = params.n;
    n->names = tpl_arena_alloc(&p->t->arena, (params.n + 1) * sizeof *n->names);
    for (size_t i = 0; i < params.n; i++)
        n->names[i] = params.v[i]->name;
    free(params.v);
    free(params.kw);
    nvec_move(p, &defaults, n, false);
    if (end_tag(p) < 0)
        return NULL;
    int loops = p->loops;
    p->loops = 0;
    n->c = parse_body(p, ends);
    p->loops = loops;
    if (!n->c || !accept_name(p, "endmacro"))
        return NULL;
    if (cur(p)->kind == TK_NAME && !strcmp(cur(p)->s, n->name))
        advance(p);
    if (end_tag(p) < 0)
        return NULL;
    if (p->n_macros == p->cap_macros) {
        p->cap_macros = p->cap_macros ? p->cap_macros * 2 : 8;
        p->macros = realloc(p->macros, p->cap_macros * sizeof *p->macros);
        if (!p->macros)
            abort();
    }
    p->macros[p->n_macros++] = n->name;
    return n;
fail:
    free(params.v);
    free(params.kw);
    free(defaults.v);
    free(defaults.kw);
    return NULL;
}

static struct node *parse_statement(struct parser *p)
{
    const struct token *at = cur(p);
    if (at->kind != TK_NAME)
        return unexpected(p, "a statement name"), NULL;
    const char *s = at->s;
    advance(p);
    if (!strcmp(s, "if"))
        return parse_if(p, at);
    if (!strcmp(s, "for"))
        return parse_for(p, at);
    if (!strcmp(s, "set"))
        return parse_set(p, at);
    if (!strcmp(s, "macro"))
        return parse_macro(p, at);
    if (!strcmp(s, "break") || !strcmp(s, "continue")) {
        if (!p->loops)
            return fail_at(p, at, "'%s' outside a for-loop", s), NULL;
        struct node *n = mk(p, s[0] == 'b' ? N_BREAK : N_CONTINUE, at);
        return end_tag(p) < 0 ? NULL : n;
    }
    if (!strcmp(s, "generation")) {
        /* Hugging Face's assistant-mask marker: renders its body as is */
        static const char *const ends[] = {"endgeneration", NULL};
        if (end_tag(p) < 0)
            return NULL;
        struct node *body = parse_body(p, ends);
        if (!body || !accept_name(p, "endgeneration") || end_tag(p) < 0)
            return NULL;
        return body;
    }
    static const char *const unsupported[] = {
        "include", "extends", "block",  "import",     "from", "call",  "with",
        "filter",  "do",      "macro_", "autoescape", "trans", "raw", NULL};
    for (int i = 0; unsupported[i]; i++)
        if (!strcmp(s, unsupported[i]))
            return fail_at(p, at, "unsupported statement '{%% %s %%}'", s), NULL;
    return fail_at(p, at, "unknown or misplaced statement '%s'", s), NULL;
}

/* The tag that closes a block whose body ends at one of ends. */
static const char *closer(const char *const *ends)
{
    for (; *ends; ends++)
        if (!strncmp(*ends, "end", 3))
            return *ends;
    return "end";
}

static bool in_list(const char *s, const char *const *list)
{
    for (; list && *list; list++)
        if (!strcmp(s, *list))
            return true;
    return false;
}

/* Statements until a block tag named in ends (left current, after its
 * '{%'), or the end of the template when ends is NULL. */
static struct node *parse_body(struct parser *p, const char *const *ends)
{
    const struct token *start = cur(p);
    if (enter(p) < 0)
        return NULL;
    struct nvec kids = {0};
    struct node *blk = mk(p, N_BLOCK, start);
    for (;;) {
        const struct token *t = cur(p);
        struct node *n = NULL;
        if (t->kind == TK_EOF) {
            if (ends) {
                fail_at(p, start, "missing {%% %s %%}: the template ends inside this block",
                        closer(ends));
                goto fail;
            }
            break;
        }
        if (t->kind == TK_TEXT) {
            n = mk(p, N_TEXT, t);
            n->str = t->s;
            n->str_len = t->len;
            advance(p);
        } else if (t->kind == TK_VAR_BEGIN) {
            advance(p);
            n = mk(p, N_OUTPUT, t);
            n->a = parse_expr(p, true);
            if (!n->a)
                goto fail;
            if (cur(p)->kind != TK_VAR_END) {
                unexpected(p, "'}}'");
                goto fail;
            }
            advance(p);
        } else if (t->kind == TK_BLOCK_BEGIN) {
            advance(p);
            if (cur(p)->kind == TK_NAME && in_list(cur(p)->s, ends))
                break;
            if (cur(p)->kind == TK_NAME && (!strncmp(cur(p)->s, "end", 3) ||
                                            !strcmp(cur(p)->s, "elif") ||
                                            !strcmp(cur(p)->s, "else"))) {
                if (ends)
                    fail_at(p, cur(p), "unexpected {%% %s %%}: the open block ends with "
                                       "{%% %s %%}",
                            cur(p)->s, closer(ends));
                else
                    fail_at(p, cur(p), "unexpected {%% %s %%}: no block is open", cur(p)->s);
                goto fail;
            }
            n = parse_statement(p);
            if (!n)
                goto fail;
        } else {
            unexpected(p, "template data or a tag");
            goto fail;
        }
        nvec_push(&kids, n, NULL);
    }
    nvec_move(p, &kids, blk, false);
    p->depth--;
    return blk;
fail:
    free(kids.v);
    free(kids.kw);
    return NULL;
}

static int check_calls(struct parser *p)
{
    for (size_t i = 0; i < p->n_calls; i++) {
        const struct node *c = p->calls[i];
        const char *name = c->a->name;
        bool ok = tpl_builtin_find(B_FUNC, name) >= 0;
        for (size_t k = 0; !ok && k < p->n_macros; k++)
            ok = !strcmp(p->macros[k], name);
        if (!ok) {
            p->err->line = c->a->line;
            p->err->col = c->a->col;
            snprintf(p->err->msg, sizeof p->err->msg,
                     "unsupported function '%s' (not a builtin and no macro of that name)",
                     name);
            return -1;
        }
    }
    return 0;
}

int tpl_parse(tpl_template *t, const struct token_list *toks, struct tpl_error *err)
{
    struct parser p = {.t = t, .tok = toks->v, .n = toks->n, .err = err};
    err->msg[0] = 0;
    t->root = parse_body(&p, NULL);
    int rc = t->root && check_calls(&p) == 0 ? 0 : -1;
    if (rc < 0 && !err->msg[0]) {
        err->line = cur(&p)->line;
        err->col = cur(&p)->col;
        snprintf(err->msg, sizeof err->msg, "syntax error");
    }
    free(p.calls);
    free(p.macros);
    return rc;
}
