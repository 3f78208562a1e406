/*
 * builtins.c - the filters, tests, methods and functions templates call.
 *
 * One table names every builtin with its kind; the parser looks names up
 * in it (refusing what is absent) and stores the index, and the evaluator
 * calls through it. What each one does follows Jinja2 and Python: filters
 * are Jinja's (trim, tojson, default, items, join, selectattr, ...), tests
 * are Jinja's (defined, none, string, mapping, equalto, ...), methods are
 * Python's str and dict methods that chat templates call (strip, split,
 * startswith, title, items, get, ...), and the functions are those
 * transformers puts in the environment (raise_exception, strftime_now) plus
 * Jinja's range, namespace and dict.

 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/builtins_internal.h"

/* --- tests --- */

static int tbool(struct val *out, bool b)
{
    *out = val_json(json_boolean(b));
    return 0;
}

#define TEST(fname, expr)                                                                          \
    static int fname(struct render *r, const struct node *at, const struct val *in,               \
                     struct args *a, struct val *out)                                              \
    {                                                                                              \
        (void)r;                                                                                   \
        (void)at;                                                                                  \
        (void)a;                                                                                   \
        const json_t *j = in->kind == V_JSON ? in->j : NULL;                                      \
        (void)j;                                                                                   \
        return tbool(out, (expr));                                                                 \
    }

TEST(t_defined, in->kind != V_UNDEF)
TEST(t_undefined, in->kind == V_UNDEF)
TEST(t_none, j && json_is_null(j))
TEST(t_boolean, j && json_is_boolean(j))
TEST(t_true, j && json_is_true(j))
TEST(t_false, j && json_is_false(j))
TEST(t_integer, j && json_is_integer(j))
TEST(t_float, j && json_is_real(j))
TEST(t_number, j && json_is_number(j))
TEST(t_string, j && json_is_string(j))
TEST(t_mapping, j && json_is_object(j))
TEST(t_iterable, j && (json_is_array(j) || json_is_object(j) || json_is_string(j)))
TEST(t_sequence, j && (json_is_array(j) || json_is_object(j) || json_is_string(j)))
TEST(t_callable, in->kind == V_MACRO || in->kind == V_FUNC)
TEST(t_odd, j && json_is_integer(j) && (json_integer_value(j) & 1))
TEST(t_even, j && json_is_integer(j) && !(json_integer_value(j) & 1))

static int t_case(struct render *r, const struct node *at, const struct val *in,
                  struct val *out, bool upper)
{
    (void)r;
    (void)at;
    bool ok = val_is_string(in);
    const char *s = ok ? json_string_value(in->j) : "";
    bool any = false;
    for (; *s && ok; s++) {
        if (isalpha((unsigned char)*s)) {
            any = true;
            ok = upper ? isupper((unsigned char)*s) : islower((unsigned char)*s);
        }
    }
    return tbool(out, ok && any);
}
static int t_lower(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return t_case(r, at, in, out, false);
}
static int t_upper(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return t_case(r, at, in, out, true);
}

static int t_divisibleby(struct render *r, const struct node *at, const struct val *in,
                         struct args *a, struct val *out)
{
    long long d;
    if (!val_is_number(in) || !json_is_integer(in->j) || !int_arg(arg(a, 0, "num"), &d) || !d)
        return rfail(r, at, "'divisibleby' needs integers and a non-zero divisor");
    return tbool(out, json_integer_value(in->j) % d == 0);
}

/* comparison tests: op as in the evaluator */
static int t_compare(struct render *r, const struct node *at, const struct val *in,
                     struct args *a, struct val *out, int op)
{
    const struct val *o = arg(a, 0, NULL);
    if (!o)
        return rfail(r, at, "this test needs a value to compare with");
    if (op == OP_EQ)
        return tbool(out, val_equal(in, o));
    if (op == OP_NE)
        return tbool(out, !val_equal(in, o));
    int cmp;
    if (in->kind != V_JSON || o->kind != V_JSON || json_compare_py(in->j, o->j, &cmp) < 0)
        return rfail(r, at, "these values cannot be ordered");
    return tbool(out, op == '<' ? cmp < 0 : op == '>' ? cmp > 0 : op == OP_LE ? cmp <= 0 : cmp >= 0);
}
#define CMP_TEST(fname, op)                                                                        \
    static int fname(struct render *r, const struct node *at, const struct val *in,               \
                     struct args *a, struct val *out)                                              \
    {                                                                                              \
        return t_compare(r, at, in, a, out, op);                                                   \
    }
CMP_TEST(t_eq, OP_EQ)
CMP_TEST(t_ne, OP_NE)
CMP_TEST(t_lt, '<')
CMP_TEST(t_le, OP_LE)
CMP_TEST(t_gt, '>')
CMP_TEST(t_ge, OP_GE)

static int t_sameas(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    const struct val *o = arg(a, 0, NULL);
    if (!o)
        return rfail(r, at, "'sameas' needs a value");
    /* identity for the singletons Python has (None, True, False), equality otherwise */
    if (in->kind == V_JSON && o->kind == V_JSON &&
        (json_is_null(o->j) || json_is_boolean(o->j)))
        return tbool(out, json_typeof(in->j) == json_typeof(o->j));
    return tbool(out, val_equal(in, o) && in->kind == o->kind &&
                          (in->kind != V_JSON || json_typeof(in->j) == json_typeof(o->j)));
}

static int t_in(struct render *r, const struct node *at, const struct val *in, struct args *a,
                struct val *out)
{
    const struct val *seq = arg(a, 0, NULL);
    if (!seq || seq->kind != V_JSON)
        return rfail(r, at, "'in' test needs a list, dict or string");
    if (json_is_string(seq->j)) {
        if (!val_is_string(in))
            return rfail(r, at, "'in <string>' needs a string");
        return tbool(out, memmem(json_string_value(seq->j), json_string_length(seq->j),
                                 json_string_value(in->j), json_string_length(in->j)) != NULL);
    }
    if (json_is_object(seq->j))
        return tbool(out, val_is_string(in) && json_object_get(seq->j, json_string_value(in->j)));
    if (!json_is_array(seq->j))
        return rfail(r, at, "'in' test needs a list, dict or string");
    for (size_t i = 0; i < json_array_size(seq->j); i++) {
        struct val x = {.kind = V_JSON, .j = json_array_get(seq->j, i)};
        if (val_equal(in, &x))
            return tbool(out, true);
    }
    return tbool(out, false);
}

/* --- functions --- */

static int fn_raise(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)in;
    (void)out;
    struct sbuf b = {.max = 200};
    const struct val *m = arg(a, 0, NULL);
    if (m)
        val_str(&b, m);
    int rc = rfail(r, at, "template raised an exception: %s", b.p ? b.p : "");
    sbuf_free(&b);
    return rc;
}

static int fn_range(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)in;
    long long x[3] = {0, 0, 1};
    if (a->n < 1 || a->n > 3)
        return rfail(r, at, "range takes 1 to 3 integers");
    for (size_t i = 0; i < a->n; i++)
        if (!int_arg(&a->v[i], &x[a->n == 1 ? 1 : i]))
            return rfail(r, at, "range takes integers");
    if (x[2] == 0)
        return rfail(r, at, "range step cannot be zero");
    long double count = x[2] > 0 ? ((long double)x[1] - x[0]) / x[2]
                                 : ((long double)x[0] - x[1]) / -x[2];
    long k = count <= 0 ? 0 : (long)ceill(count);
    if (count > (long double)LONG_MAX / 2)
        return rfail(r, at, "range of %.0Lf items is over the iteration limit", count);
    if (rcount_iterations(r, at, k) < 0)
        return -1;
    json_t *res = json_array();
    for (long i = 0; i < k; i++)
        json_array_append_new(res, json_integer(x[0] + (long long)i * x[2]));
    *out = val_json(res);
    return 0;
}

static int kw_object(struct render *r, const struct node *at, struct args *a, json_t **out)
{
    json_t *o = json_object();
    for (size_t i = 0; i < a->n; i++) {
        if (!a->kw || !a->kw[i]) {
            /* dict(d) / namespace(d): copy a mapping's items */
            if (a->v[i].kind == V_JSON && json_is_object(a->v[i].j)) {
                json_object_update(o, a->v[i].j);
                continue;
            }
            json_decref(o);
            return rfail(r, at, "expected keyword arguments (name=value)");
        }
        if (a->v[i].kind != V_JSON && a->v[i].kind != V_UNDEF) {
            json_decref(o);
            return rfail(r, at, "only data can be stored in a dict or namespace");
        }
        json_object_set(o, a->kw[i], a->v[i].kind == V_JSON ? a->v[i].j : json_null());
    }
    *out = o;
    return 0;
}

static int fn_namespace(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    (void)in;
    json_t *o;
    if (kw_object(r, at, a, &o) < 0)
        return -1;
    tpl_register_namespace(r, o);
    *out = val_json(o);
    return 0;
}

static int fn_dict(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)in;
    json_t *o;
    if (kw_object(r, at, a, &o) < 0)
        return -1;
    *out = val_json(o);
    return 0;
}

static int fn_strftime_now(struct render *r, const struct node *at, const struct val *in,
                           struct args *a, struct val *out)
{
    (void)in;
    const char *fmt;
    size_t n;
    const struct val *f = arg(a, 0, NULL);
    if (!f || str_arg(r, at, f, "the format", &fmt, &n) < 0)
        return f ? -1 : rfail(r, at, "strftime_now needs a format");
    time_t now = rnow(r);
    struct tm tm;
    gmtime_r(&now, &tm);
    char buf[256];
    size_t k = strftime(buf, sizeof buf, fmt, &tm);
    if (k == 0 && n > 0)
        return rfail(r, at, "strftime_now: format gives nothing or more than 255 bytes");
    *out = make_str(buf, k);
    return 0;
}

static int m_cycle(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    if (a->n == 0)
        return rfail(r, at, "loop.cycle needs at least one value");
    struct val idx;
    if (val_getattr(r, at, in, "index0", &idx) < 0)
        return -1;
    *out = val_copy(&a->v[json_integer_value(idx.j) % (long long)a->n]);
    val_drop(&idx);
    return 0;
}

/* --- the table: strings.c's rows, filters.c's, then these --- */

static const struct builtin own_builtins[] = {
    {B_TEST, "defined", t_defined, 0},
    {B_TEST, "undefined", t_undefined, 0},
    {B_TEST, "none", t_none, 0},
    {B_TEST, "boolean", t_boolean, 0},
    {B_TEST, "true", t_true, 0},
    {B_TEST, "false", t_false, 0},
    {B_TEST, "integer", t_integer, 0},
    {B_TEST, "float", t_float, 0},
    {B_TEST, "number", t_number, 0},
    {B_TEST, "string", t_string, 0},
    {B_TEST, "mapping", t_mapping, 0},
    {B_TEST, "iterable", t_iterable, 0},
    {B_TEST, "sequence", t_sequence, 0},
    {B_TEST, "callable", t_callable, 0},
    {B_TEST, "odd", t_odd, 0},
    {B_TEST, "even", t_even, 0},
    {B_TEST, "lower", t_lower, 0},
    {B_TEST, "upper", t_upper, 0},
    {B_TEST, "divisibleby", t_divisibleby, 0},
    {B_TEST, "eq", t_eq, 0},
    {B_TEST, "equalto", t_eq, 0},
    {B_TEST, "==", t_eq, 0},
    {B_TEST, "ne", t_ne, 0},
    {B_TEST, "lt", t_lt, 0},
    {B_TEST, "lessthan", t_lt, 0},
    {B_TEST, "le", t_le, 0},
    {B_TEST, "gt", t_gt, 0},
    {B_TEST, "greaterthan", t_gt, 0},
    {B_TEST, "ge", t_ge, 0},
    {B_TEST, "sameas", t_sameas, 0},
    {B_TEST, "in", t_in, 0},
    {B_METHOD, "cycle", m_cycle, R_LOOP},
    {B_FUNC, "raise_exception", fn_raise, 0},
    {B_FUNC, "range", fn_range, 0},
    {B_FUNC, "namespace", fn_namespace, 0},
    {B_FUNC, "dict", fn_dict, 0},
    {B_FUNC, "strftime_now", fn_strftime_now, 0},
};

/* The builtin with global index i (see builtins_internal.h), or NULL. */
static const struct builtin *builtin_at(int i)
{
    if (i < 0)
        return NULL;
    size_t k = (size_t)i;
    if (k < tpl_n_string_builtins)
        return &tpl_string_builtins[k];
    k -= tpl_n_string_builtins;
    if (k < tpl_n_data_builtins)
        return &tpl_data_builtins[k];
    k -= tpl_n_data_builtins;
    if (k < sizeof own_builtins / sizeof own_builtins[0])
        return &own_builtins[k];
    return NULL;
}

int tpl_builtin_find(enum builtin_kind kind, const char *name)
{
    const struct builtin *b;
    for (int i = 0; (b = builtin_at(i)); i++)
        if (b->kind == kind && !strcmp(b->name, name))
            return i;
    return -1;
}

bool tpl_method_exists(const char *name)
{
    return tpl_builtin_find(B_METHOD, name) >= 0;
}

int tpl_builtin_call(struct render *r, const struct node *at, enum builtin_kind kind, int fn,
                     const struct val *input, struct args *args, struct val *out)
{
    static const struct val none = {0};
    const struct builtin *b = builtin_at(fn);
    *out = val_undef();
    if (!b || b->kind != kind)
        return rfail(r, at, "internal error: bad builtin index");
    return b->fn(r, at, input ? input : &none, args, out);
}

int tpl_method_call(struct render *r, const struct node *at, const char *name,
                    const struct val *recv, struct args *args, struct val *out)
{
    int mask = recv->kind == V_LOOP                              ? R_LOOP
               : val_is_string(recv)                             ? R_STR
               : recv->kind == V_JSON && json_is_object(recv->j) ? R_DICT
                                                                 : 0;
    const struct builtin *b;
    *out = val_undef();
    for (int i = 0; (b = builtin_at(i)); i++)
        if (b->kind == B_METHOD && (b->recv & mask) && !strcmp(b->name, name))
            return b->fn(r, at, recv, args, out);
    return 1;
}
