/*
 * eval.c - walking the syntax tree: statements write output, expressions
 * compute values.
 *
 * Scoping is Jinja's: a for-loop body and a macro body get their own
 * frame, so {% set %} inside a loop does not leak out of it (templates use
 * namespace() objects when they need that), while {% if %} has no scope.
 * A loop's frame is cleared at the start of every iteration, as Jinja's
 * generated code does. Names resolve innermost frame first, then the
 * render's context (messages, bos_token, ...), then builtin functions;
 * a macro body sees its own frame and the template's top level.
 *
 * Every statement and expression step enters through exec() or eval(),
 * which count depth against the template's max_depth: nesting, long
 * operator chains and macro recursion all end with an error there, far
 * from the C stack's limit. Output goes to a bounded buffer (the render's
 * max_output), and so does every string an operator builds.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

struct var {
    const char *name;
    struct val v;
};

struct frame {
    struct var *v;
    size_t n, cap;
    struct frame *parent;
};

struct loop_state {
    const json_t *items; /* the iterated values */
    size_t index0, length;
};

struct render {
    const tpl_template *t;
    const json_t *ctx;
    time_t now;
    struct sbuf *out;
    struct frame *frame; /* innermost */
    struct frame *root;  /* the template's top level */
    int depth;
    long iterations;
    json_t *namespaces; /* objects made by namespace(): the ones {% set x.y %} may change */
    enum { CTL_NONE, CTL_BREAK, CTL_CONTINUE } ctl;
    struct tpl_error *err;
};

static int exec(struct render *r, const struct node *n);
static int eval(struct render *r, const struct node *n, struct val *out);

/* --- errors and limits --- */

int rfail(struct render *r, const struct node *n, const char *fmt, ...)
{
    if (r->err->msg[0])
        return -1;
    r->err->line = n ? n->line : 0;
    r->err->col = n ? n->col : 0;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->err->msg, sizeof r->err->msg, fmt, ap);
    va_end(ap);
    return -1;
}

size_t rmax_string(const struct render *r)
{
    return r->t->limits.max_output;
}

time_t rnow(const struct render *r)
{
    return r->now;
}

int rcount_iterations(struct render *r, const struct node *n, long k)
{
    if (k < 0 || k > r->t->limits.max_iterations - r->iterations)
        return rfail(r, n, "loop iterations over the limit of %ld",
                     r->t->limits.max_iterations);
    r->iterations += k;
    return 0;
}

static int enter(struct render *r, const struct node *n)
{
    if (++r->depth > r->t->limits.max_depth)
        return rfail(r, n, "evaluation nested deeper than %d levels (recursion limit)",
                     r->t->limits.max_depth);
    return 0;
}

static int out_add(struct render *r, const struct node *n, const char *s, size_t len)
{
    if (sbuf_add(r->out, s, len) < 0)
        return rfail(r, n, "output larger than the limit of %zu bytes", r->out->max);
    return 0;
}

/* --- frames --- */

static void frame_clear(struct frame *f)
{
    for (size_t i = 0; i < f->n; i++)
        val_drop(&f->v[i].v);
    f->n = 0;
}

static void frame_free(struct frame *f)
{
    frame_clear(f);
    free(f->v);
}

/* Bind name in f; steals v. */
static void frame_set(struct frame *f, const char *name, struct val v)
{
    for (size_t i = 0; i < f->n; i++)
        if (!strcmp(f->v[i].name, name)) {
            val_drop(&f->v[i].v);
            f->v[i].v = v;
            return;
        }
    if (f->n == f->cap) {
        f->cap = f->cap ? f->cap * 2 : 8;
        f->v = realloc(f->v, f->cap * sizeof *f->v);
        if (!f->v)
            abort();
    }
    f->v[f->n].name = name;
    f->v[f->n++].v = v;
}

static struct val lookup(const struct render *r, const char *name)
{
    for (const struct frame *f = r->frame; f; f = f->parent)
        for (size_t i = 0; i < f->n; i++)
            if (!strcmp(f->v[i].name, name))
                return val_copy(&f->v[i].v);
    json_t *j = json_object_get(r->ctx, name);
    if (j)
        return val_json(json_incref(j));
    int fn = tpl_builtin_find(B_FUNC, name);
    if (fn >= 0) {
        struct val v = {.kind = V_FUNC, .fn = fn};
        return v;
    }
    return val_undef();
}

/* --- values the evaluator needs --- */

int val_iterable(struct render *r, const struct node *at, const struct val *v, json_t **out)
{
    if (v->kind == V_UNDEF) {
        *out = json_array();
        return 0;
    }
    if (v->kind != V_JSON)
        return rfail(r, at, "value is not iterable");
    json_t *j = v->j;
    if (json_is_array(j)) {
        *out = json_incref(j);
        return 0;
    }
    json_t *a = json_array();
    if (json_is_object(j)) {
        const char *k;
        json_t *x;
        json_object_foreach(j, k, x) json_array_append_new(a, json_string(k));
    } else if (json_is_string(j)) {
        const char *s = json_string_value(j);
        size_t n = json_string_length(j);
        for (size_t i = 0; i < n;) {
            size_t e = i + utf8_offset(s + i, n - i, 1);
            json_array_append_new(a, json_stringn_nocheck(s + i, e - i));
            i = e;
        }
    } else {
        json_decref(a);
        return rfail(r, at, "%s is not iterable",
                     json_is_null(j) ? "none" : json_is_number(j) ? "a number" : "a boolean");
    }
    *out = a;
    return 0;
}

static const char *what(const struct node *n)
{
    return n->kind == N_NAME ? n->name : n->kind == N_ATTR ? n->name : "value";
}

int val_getattr(struct render *r, const struct node *at, const struct val *v, const char *name,
                struct val *out)
{
    *out = val_undef();
    if (v->kind == V_UNDEF)
        return rfail(r, at, "cannot read '%s' of an undefined value", name);
    if (v->kind == V_LOOP) {
        const struct loop_state *l = v->loop;
        long long k;
        if (!strcmp(name, "index"))
            k = (long long)l->index0 + 1;
        else if (!strcmp(name, "index0"))
            k = (long long)l->index0;
        else if (!strcmp(name, "revindex"))
            k = (long long)(l->length - l->index0);
        else if (!strcmp(name, "revindex0"))
            k = (long long)(l->length - l->index0 - 1);
        else if (!strcmp(name, "length"))
            k = (long long)l->length;
        else if (!strcmp(name, "depth"))
            k = 1;
        else if (!strcmp(name, "depth0"))
            k = 0;
        else if (!strcmp(name, "first")) {
            *out = val_json(json_boolean(l->index0 == 0));
            return 0;
        } else if (!strcmp(name, "last")) {
            *out = val_json(json_boolean(l->index0 + 1 == l->length));
            return 0;
        } else if (!strcmp(name, "previtem") || !strcmp(name, "nextitem")) {
            bool prev = name[0] == 'p';
            if (prev ? l->index0 > 0 : l->index0 + 1 < l->length)
                *out = val_json(json_incref(
                    json_array_get(l->items, prev ? l->index0 - 1 : l->index0 + 1)));
            return 0;
        } else {
            return rfail(r, at, "loop has no attribute '%s'", name);
        }
        *out = val_json(json_integer(k));
        return 0;
    }
    if (v->kind == V_JSON && json_is_object(v->j)) {
        json_t *x = json_object_get(v->j, name);
        if (x)
            *out = val_json(json_incref(x));
    }
    return 0;
}

/* Python's index normalisation for a sequence of n items */
static bool norm_index(long long i, size_t n, size_t *out)
{
    if (i < 0)
        i += (long long)n;
    if (i < 0 || (size_t)i >= n)
        return false;
    *out = (size_t)i;
    return true;
}

static int eval_index(struct render *r, const struct node *n, struct val *out)
{
    struct val obj, key;
    *out = val_undef();
    if (eval(r, n->a, &obj) < 0)
        return -1;
    if (eval(r, n->b, &key) < 0) {
        val_drop(&obj);
        return -1;
    }
    int rc = 0;
    if (obj.kind == V_UNDEF) {
        rc = rfail(r, n, "cannot index '%s': it is undefined", what(n->a));
    } else if (obj.kind == V_LOOP && val_is_string(&key)) {
        rc = val_getattr(r, n, &obj, json_string_value(key.j), out);
    } else if (obj.kind == V_JSON && key.kind == V_JSON) {
        json_t *o = obj.j, *k = key.j;
        size_t i;
        if (json_is_object(o) && json_is_string(k)) {
            json_t *x = json_object_get(o, json_string_value(k));
            if (x)
                *out = val_json(json_incref(x));
        } else if (json_is_array(o) && json_is_integer(k)) {
            if (norm_index(json_integer_value(k), json_array_size(o), &i))
                *out = val_json(json_incref(json_array_get(o, i)));
        } else if (json_is_string(o) && json_is_integer(k)) {
            const char *s = json_string_value(o);
            size_t len = json_string_length(o);
            if (norm_index(json_integer_value(k), utf8_len(s, len), &i)) {
                size_t a = utf8_offset(s, len, i);
                size_t b = a + utf8_offset(s + a, len - a, 1);
                *out = val_json(json_stringn_nocheck(s + a, b - a));
            }
        }
    }
    val_drop(&obj);
    val_drop(&key);
    return rc;
}

/* Python slice bounds for n items */
static int slice_bounds(struct render *r, const struct node *n, size_t len, long long *start,
                        long long *stop, long long *step)
{
    struct val v[3];
    const struct node *parts[3] = {n->b, n->c, n->d};
    long long x[3] = {0, 0, 1};
    bool given[3] = {false, false, false};
    for (int k = 0; k < 3; k++) {
        if (!parts[k])
            continue;
        if (eval(r, parts[k], &v[k]) < 0)
            return -1;
        if (v[k].kind == V_JSON && json_is_null(v[k].j)) {
            val_drop(&v[k]);
            continue;
        }
        bool ok = v[k].kind == V_JSON && json_is_integer(v[k].j);
        if (ok)
            x[k] = json_integer_value(v[k].j);
        val_drop(&v[k]);
        if (!ok)
            return rfail(r, parts[k], "slice indices must be integers");
        given[k] = true;
    }
    long long L = (long long)len;
    *step = x[2];
    if (*step == 0)
        return rfail(r, n, "slice step cannot be zero");
    for (int k = 0; k < 2; k++) {
        long long *o = k == 0 ? start : stop;
        if (!given[k]) {
            if (k == 0)
                *o = *step > 0 ? 0 : L - 1;
            else
                *o = *step > 0 ? L : -1;
            continue;
        }
        long long i = x[k] < 0 ? x[k] + L : x[k];
        if (*step > 0)
            *o = i < 0 ? 0 : i > L ? L : i;
        else
            *o = i < -1 ? -1 : i > L - 1 ? L - 1 : i;
    }
    return 0;
}

static int eval_slice(struct render *r, const struct node *n, struct val *out)
{
    struct val obj;
    *out = val_undef();
    if (eval(r, n->a, &obj) < 0)
        return -1;
    int rc = 0;
    bool is_str = val_is_string(&obj);
    if (obj.kind != V_JSON || !(is_str || json_is_array(obj.j))) {
        rc = rfail(r, n, "only lists and strings can be sliced");
        goto out;
    }
    const char *s = is_str ? json_string_value(obj.j) : NULL;
    size_t slen = is_str ? json_string_length(obj.j) : 0;
    size_t len = is_str ? utf8_len(s, slen) : json_array_size(obj.j);
    long long a = 0, b = 0, step = 1;
    if (slice_bounds(r, n, len, &a, &b, &step) < 0) {
        rc = -1;
        goto out;
    }
    if (is_str && step == 1) {
        size_t oa = utf8_offset(s, slen, (size_t)a);
        size_t ob = b > a ? utf8_offset(s, slen, (size_t)b) : oa;
        *out = val_json(json_stringn_nocheck(s + oa, ob - oa));
        goto out;
    }
    json_t *items = NULL;
    if (is_str && val_iterable(r, n, &obj, &items) < 0) {
        rc = -1;
        goto out;
    }
    const json_t *src = is_str ? items : obj.j;
    json_t *res = json_array();
    for (long long i = a; step > 0 ? i < b : i > b; i += step)
        json_array_append(res, json_array_get(src, (size_t)i));
    if (is_str) {
        struct sbuf sb = {.max = (size_t)-1};
        for (size_t i = 0; i < json_array_size(res); i++)
            sbuf_add(&sb, json_string_value(json_array_get(res, i)),
                     json_string_length(json_array_get(res, i)));
        json_decref(res);
        res = json_stringn_nocheck(sb.p ? sb.p : "", sb.n);
        sbuf_free(&sb);
        json_decref(items);
    }
    *out = val_json(res);
out:
    val_drop(&obj);
    return rc;
}

/* --- operators --- */

static int contains(struct render *r, const struct node *n, const struct val *item,
                    const struct val *seq, bool *res)
{
    *res = false;
    if (seq->kind == V_UNDEF)
        return 0;
    if (seq->kind != V_JSON)
        return rfail(r, n, "'in' needs a list, a dict or a string on its right");
    const json_t *s = seq->j;
    if (json_is_string(s)) {
        if (!val_is_string(item))
            return rfail(r, n, "'in <string>' needs a string on its left");
        *res = memmem(json_string_value(s), json_string_length(s), json_string_value(item->j),
                      json_string_length(item->j)) != NULL;
    } else if (json_is_array(s)) {
        for (size_t i = 0; i < json_array_size(s) && !*res; i++) {
            struct val x = {.kind = V_JSON, .j = json_array_get(s, i)};
            *res = val_equal(item, &x);
        }
    } else if (json_is_object(s)) {
        *res = val_is_string(item) && json_object_get(s, json_string_value(item->j));
    } else {
        return rfail(r, n, "'in' needs a list, a dict or a string on its right");
    }
    return 0;
}

static int str_concat(struct render *r, const struct node *n, const struct val *a,
                      const struct val *b, struct val *out)
{
    struct sbuf sb = {.max = rmax_string(r)};
    if (val_str(&sb, a) < 0 || val_str(&sb, b) < 0) {
        sbuf_free(&sb);
        return rfail(r, n, "string longer than the limit of %zu bytes", rmax_string(r));
    }
    *out = val_json(json_stringn_nocheck(sb.p ? sb.p : "", sb.n));
    sbuf_free(&sb);
    return 0;
}

static int repeat(struct render *r, const struct node *n, const json_t *seq, long long k,
                  struct val *out)
{
    if (k < 0)
        k = 0;
    size_t unit = json_is_string(seq) ? json_string_length(seq) : json_array_size(seq);
    if (unit && (unsigned long long)k > rmax_string(r) / unit)
        return rfail(r, n, "repetition larger than the limit of %zu", rmax_string(r));
    if (json_is_string(seq)) {
        struct sbuf sb = {.max = (size_t)-1};
        for (long long i = 0; i < k; i++)
            sbuf_add(&sb, json_string_value(seq), unit);
        *out = val_json(json_stringn_nocheck(sb.p ? sb.p : "", sb.n));
        sbuf_free(&sb);
        return 0;
    }
    json_t *res = json_array();
    for (long long i = 0; i < k; i++)
        json_array_extend(res, (json_t *)seq);
    *out = val_json(res);
    return 0;
}

static int arith(struct render *r, const struct node *n, int op, const struct val *a,
                 const struct val *b, struct val *out)
{
    const char *opname = op == '+' ? "+" : op == '-' ? "-" : op == '*' ? "*" : op == '/' ? "/"
                       : op == OP_FLOORDIV ? "//" : op == '%' ? "%" : "**";
    if (a->kind == V_JSON && b->kind == V_JSON) {
        json_t *x = a->j, *y = b->j;
        if (op == '+' && json_is_string(x) && json_is_string(y))
            return str_concat(r, n, a, b, out);
        if (op == '+' && json_is_array(x) && json_is_array(y)) {
            json_t *res = json_copy(x);
            json_array_extend(res, y);
            *out = val_json(res);
            return 0;
        }
        if (op == '*' && (json_is_string(x) || json_is_array(x)) && json_is_integer(y))
            return repeat(r, n, x, json_integer_value(y), out);
        if (op == '*' && (json_is_string(y) || json_is_array(y)) && json_is_integer(x))
            return repeat(r, n, y, json_integer_value(x), out);
        bool xi = json_is_integer(x) || json_is_boolean(x), yi = json_is_integer(y) || json_is_boolean(y);
        bool xn = xi || json_is_real(x), yn = yi || json_is_real(y);
        if (xn && yn) {
            long long p = json_is_boolean(x) ? json_is_true(x) : json_integer_value(x);
            long long q = json_is_boolean(y) ? json_is_true(y) : json_integer_value(y);
            double dp = xi ? (double)p : json_real_value(x), dq = yi ? (double)q : json_real_value(y);
            if ((op == '/' || op == OP_FLOORDIV || op == '%') && dq == 0)
                return rfail(r, n, "division by zero");
            if (xi && yi && op != '/' && op != OP_POW) {
                long long res = 0;
                bool ovf = false;
                switch (op) {
                case '+': ovf = __builtin_add_overflow(p, q, &res); break;
                case '-': ovf = __builtin_sub_overflow(p, q, &res); break;
                case '*': ovf = __builtin_mul_overflow(p, q, &res); break;
                case OP_FLOORDIV:
                    if (p == INT64_MIN && q == -1)
                        ovf = true;
                    else
                        res = p / q - ((p % q != 0) && ((p < 0) != (q < 0)));
                    break;
                case '%':
                    res = (q == -1) ? 0 : p % q;
                    if (res != 0 && ((res < 0) != (q < 0)))
                        res += q;
                    break;
                }
                if (ovf)
                    return rfail(r, n, "integer overflow in '%s'", opname);
                *out = val_json(json_integer(res));
                return 0;
            }
            double res = 0;
            switch (op) {
            case '+': res = dp + dq; break;
            case '-': res = dp - dq; break;
            case '*': res = dp * dq; break;
            case '/': res = dp / dq; break;
            case OP_FLOORDIV: res = floor(dp / dq); break;
            case '%': res = fmod(dp, dq); if (res != 0 && ((res < 0) != (dq < 0))) res += dq; break;
            case OP_POW:
                res = pow(dp, dq);
                if (xi && yi && q >= 0 && fabs(res) < 9.2e18) {
                    *out = val_json(json_integer((long long)llround(res)));
                    return 0;
                }
                break;
            }
            if (!isfinite(res)) /* JSON, the values' form, has no infinity or NaN */
                return rfail(r, n, "float result of '%s' out of range", opname);
            *out = val_json(json_real(res));
            return 0;
        }
    }
    return rfail(r, n, "unsupported operand types for '%s'", opname);
}

static int eval_binary(struct render *r, const struct node *n, struct val *out)
{
    struct val a, b;
    *out = val_undef();
    if (eval(r, n->a, &a) < 0)
        return -1;
    if (n->op == OP_AND || n->op == OP_OR) {
        bool t = val_truthy(&a);
        if ((n->op == OP_AND) != t) {
            *out = a; /* Python returns the deciding operand */
            return 0;
        }
        val_drop(&a);
        return eval(r, n->b, out);
    }
    if (eval(r, n->b, &b) < 0) {
        val_drop(&a);
        return -1;
    }
    int rc = 0;
    bool res;
    int cmp;
    switch (n->op) {
    case OP_IN:
    case OP_NOT_IN:
        rc = contains(r, n, &a, &b, &res);
        if (rc == 0)
            *out = val_json(json_boolean(res == (n->op == OP_IN)));
        break;
    case OP_EQ:
    case OP_NE: *out = val_json(json_boolean(val_equal(&a, &b) == (n->op == OP_EQ))); break;
    case '<':
    case '>':
    case OP_LE:
    case OP_GE:
        if (a.kind != V_JSON || b.kind != V_JSON || json_compare_py(a.j, b.j, &cmp) < 0) {
            rc = rfail(r, n, "these values cannot be ordered");
            break;
        }
        res = n->op == '<' ? cmp < 0 : n->op == '>' ? cmp > 0 : n->op == OP_LE ? cmp <= 0 : cmp >= 0;
        *out = val_json(json_boolean(res));
        break;
    case '~': rc = str_concat(r, n, &a, &b, out); break;
    default: rc = arith(r, n, n->op, &a, &b, out);
    }
    val_drop(&a);
    val_drop(&b);
    return rc;
}

static int eval_unary(struct render *r, const struct node *n, struct val *out)
{
    struct val a;
    if (eval(r, n->a, &a) < 0)
        return -1;
    int rc = 0;
    if (n->op == OP_NOT) {
        *out = val_json(json_boolean(!val_truthy(&a)));
    } else if (!val_is_number(&a)) {
        rc = rfail(r, n, "unary '%c' needs a number", n->op == OP_NEG ? '-' : '+');
    } else if (n->op == OP_POS) {
        *out = val_copy(&a);
    } else if (json_is_integer(a.j)) {
        if (json_integer_value(a.j) == INT64_MIN)
            rc = rfail(r, n, "integer overflow in '-'");
        else
            *out = val_json(json_integer(-json_integer_value(a.j)));
    } else {
        *out = val_json(json_real(-json_real_value(a.j)));
    }
    val_drop(&a);
    return rc;
}

/* --- calls --- */

static void args_free(struct args *a)
{
    for (size_t i = 0; i < a->n; i++)
        val_drop(&a->v[i]);
    free(a->v);
}

static int eval_args(struct render *r, const struct node *n, struct args *a)
{
    a->n = 0;
    a->kw = n->kw;
    a->v = calloc(n->n_kids ? n->n_kids : 1, sizeof *a->v);
    if (!a->v)
        abort();
    for (size_t i = 0; i < n->n_kids; i++) {
        if (eval(r, n->kids[i], &a->v[i]) < 0) {
            args_free(a);
            return -1;
        }
        a->n++;
    }
    return 0;
}

int call_macro(struct render *r, const struct node *at, const struct val *m, struct val *args,
               const char **kw, size_t n, struct val *out)
{
    const struct node *def = m->macro;
    struct frame f = {.parent = r->root};
    size_t pos = 0;
    for (size_t i = 0; i < n; i++) {
        if (kw && kw[i]) {
            size_t k = 0;
            while (k < def->n_names && strcmp(def->names[k], kw[i]))
                k++;
            if (k == def->n_names) {
                frame_free(&f);
                return rfail(r, at, "macro '%s' has no parameter '%s'", def->name, kw[i]);
            }
            frame_set(&f, def->names[k], val_copy(&args[i]));
        } else {
            if (pos >= def->n_names) {
                frame_free(&f);
                return rfail(r, at, "macro '%s' takes %zu arguments", def->name, def->n_names);
            }
            frame_set(&f, def->names[pos++], val_copy(&args[i]));
        }
    }
    struct frame *saved_frame = r->frame;
    struct sbuf *saved_out = r->out;
    struct sbuf buf = {.max = r->out->max};
    r->frame = &f;
    int rc = 0;
    /* parameters not given take their defaults, evaluated in the macro's frame */
    for (size_t k = 0; k < def->n_names && rc == 0; k++) {
        bool bound = false;
        for (size_t i = 0; i < f.n; i++)
            bound |= !strcmp(f.v[i].name, def->names[k]);
        if (bound)
            continue;
        struct val v = val_undef();
        if (def->kids && def->kids[k])
            rc = eval(r, def->kids[k], &v);
        frame_set(&f, def->names[k], v);
    }
    r->out = &buf;
    if (rc == 0)
        rc = exec(r, def->c);
    r->out = saved_out;
    r->frame = saved_frame;
    r->ctl = CTL_NONE;
    if (rc == 0)
        *out = val_json(json_stringn_nocheck(buf.p ? buf.p : "", buf.n));
    sbuf_free(&buf);
    frame_free(&f);
    return rc;
}

static int eval_call(struct render *r, const struct node *n, struct val *out)
{
    struct args a;
    struct val callee = val_undef();
    *out = val_undef();
    int rc;
    if (n->a->kind == N_ATTR) {
        struct val recv;
        if (eval(r, n->a->a, &recv) < 0)
            return -1;
        if (eval_args(r, n, &a) < 0) {
            val_drop(&recv);
            return -1;
        }
        if (recv.kind == V_UNDEF)
            rc = rfail(r, n, "cannot call '%s' on an undefined value", n->a->name);
        else
            rc = tpl_method_call(r, n, n->a->name, &recv, &a, out);
        if (rc == 1) {
            rc = val_getattr(r, n, &recv, n->a->name, &callee);
            if (rc == 0 && callee.kind == V_MACRO)
                rc = call_macro(r, n, &callee, a.v, a.kw, a.n, out);
            else if (rc == 0)
                rc = rfail(r, n, "this value has no method '%s'", n->a->name);
        }
        val_drop(&recv);
    } else {
        callee = lookup(r, n->a->name);
        if (eval_args(r, n, &a) < 0) {
            val_drop(&callee);
            return -1;
        }
        if (callee.kind == V_MACRO)
            rc = call_macro(r, n, &callee, a.v, a.kw, a.n, out);
        else if (callee.kind == V_FUNC)
            rc = tpl_builtin_call(r, n, B_FUNC, callee.fn, NULL, &a, out);
        else
            rc = rfail(r, n, "'%s' is %s, not a function", n->a->name,
                       callee.kind == V_UNDEF ? "undefined" : "a value");
    }
    val_drop(&callee);
    args_free(&a);
    return rc;
}

static int eval_builtin(struct render *r, const struct node *n, struct val *out)
{
    struct val in;
    struct args a;
    *out = val_undef();
    if (eval(r, n->a, &in) < 0)
        return -1;
    if (eval_args(r, n, &a) < 0) {
        val_drop(&in);
        return -1;
    }
    int rc = tpl_builtin_call(r, n, n->kind == N_FILTER ? B_FILTER : B_TEST, n->fn, &in, &a, out);
    if (rc == 0 && n->kind == N_TEST && n->op) {
        bool t = val_truthy(out);
        val_drop(out);
        *out = val_json(json_boolean(!t));
    }
    val_drop(&in);
    args_free(&a);
    return rc;
}

static int eval_collection(struct render *r, const struct node *n, struct val *out)
{
    json_t *res = n->kind == N_DICT ? json_object() : json_array();
    for (size_t i = 0; i < n->n_kids; i++) {
        struct val v;
        if (eval(r, n->kids[i], &v) < 0) {
            json_decref(res);
            return -1;
        }
        bool ok = v.kind == V_JSON || v.kind == V_UNDEF;
        if (n->kind == N_DICT && i % 2 == 0) {
            if (!val_is_string(&v)) {
                val_drop(&v);
                json_decref(res);
                return rfail(r, n->kids[i], "dict keys must be strings");
            }
            struct val x;
            if (eval(r, n->kids[i + 1], &x) < 0 || (x.kind != V_JSON && x.kind != V_UNDEF)) {
                val_drop(&v);
                val_drop(&x);
                json_decref(res);
                return rfail(r, n->kids[i + 1], "only data can be stored in a dict");
            }
            json_object_set_new(res, json_string_value(v.j), x.kind == V_JSON ? json_incref(x.j) : json_null());
            val_drop(&x);
            val_drop(&v);
            i++;
            continue;
        }
        if (!ok) {
            val_drop(&v);
            json_decref(res);
            return rfail(r, n->kids[i], "only data can be stored in a list");
        }
        json_array_append_new(res, v.kind == V_JSON ? json_incref(v.j) : json_null());
        val_drop(&v);
    }
    *out = val_json(res);
    return 0;
}

static int eval(struct render *r, const struct node *n, struct val *out)
{
    *out = val_undef();
    if (enter(r, n) < 0)
        return -1;
    int rc = 0;
    switch (n->kind) {
    case N_CONST: *out = val_json(json_incref(n->value)); break;
    case N_NAME: *out = lookup(r, n->name); break;
    case N_LIST:
    case N_TUPLE:
    case N_DICT: rc = eval_collection(r, n, out); break;
    case N_ATTR: {
        struct val obj;
        rc = eval(r, n->a, &obj);
        if (rc == 0)
            rc = val_getattr(r, n, &obj, n->name, out);
        val_drop(&obj);
        break;
    }
    case N_INDEX: rc = eval_index(r, n, out); break;
    case N_SLICE: rc = eval_slice(r, n, out); break;
    case N_CALL: rc = eval_call(r, n, out); break;
    case N_FILTER:
    case N_TEST: rc = eval_builtin(r, n, out); break;
    case N_UNARY: rc = eval_unary(r, n, out); break;
    case N_BINARY: rc = eval_binary(r, n, out); break;
    case N_COND: {
        struct val c;
        rc = eval(r, n->b, &c);
        if (rc == 0) {
            bool t = val_truthy(&c);
            val_drop(&c);
            if (t)
                rc = eval(r, n->a, out);
            else if (n->c)
                rc = eval(r, n->c, out);
        }
        break;
    }
    default: rc = rfail(r, n, "statement used as an expression");
    }
    if (rc == 0 && out->kind == V_JSON && !out->j)
        rc = rfail(r, n, "out of memory");
    r->depth--;
    return rc;
}

/* --- statements --- */

/* Bind a loop or set target list to value v (borrowed). */
static int bind_targets(struct render *r, const struct node *n, struct frame *f,
                        const struct val *v)
{
    if (n->n_names == 1) {
        frame_set(f, n->names[0], val_copy(v));
        return 0;
    }
    if (v->kind != V_JSON || !json_is_array(v->j) || json_array_size(v->j) != n->n_names)
        return rfail(r, n, "cannot unpack this value into %zu names", n->n_names);
    for (size_t i = 0; i < n->n_names; i++)
        frame_set(f, n->names[i], val_json(json_incref(json_array_get(v->j, i))));
    return 0;
}

static int exec_for(struct render *r, const struct node *n)
{
    struct val seq;
    json_t *items;
    if (eval(r, n->a, &seq) < 0)
        return -1;
    int rc = val_iterable(r, n->a, &seq, &items);
    val_drop(&seq);
    if (rc < 0)
        return -1;
    struct frame f = {.parent = r->frame};
    r->frame = &f;
    if (n->b) { /* for x in xs if cond: the filter decides loop.length */
        json_t *kept = json_array();
        for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
            struct val item = {.kind = V_JSON, .j = json_array_get(items, i)}, c;
            frame_clear(&f);
            rc = rcount_iterations(r, n, 1);
            if (rc == 0)
                rc = bind_targets(r, n, &f, &item);
            if (rc == 0 && (rc = eval(r, n->b, &c)) == 0) {
                if (val_truthy(&c))
                    json_array_append(kept, item.j);
                val_drop(&c);
            }
        }
        json_decref(items);
        items = kept;
    }
    struct loop_state ls = {.items = items, .length = json_array_size(items)};
    for (size_t i = 0; i < ls.length && rc == 0; i++) {
        struct val item = {.kind = V_JSON, .j = json_array_get(items, i)};
        struct val loop = {.kind = V_LOOP, .loop = &ls};
        ls.index0 = i;
        frame_clear(&f);
        rc = rcount_iterations(r, n, 1);
        if (rc == 0)
            rc = bind_targets(r, n, &f, &item);
        if (rc < 0)
            break;
        frame_set(&f, "loop", loop);
        rc = exec(r, n->c);
        if (r->ctl == CTL_BREAK) {
            r->ctl = CTL_NONE;
            break;
        }
        r->ctl = CTL_NONE;
    }
    r->frame = f.parent;
    frame_free(&f);
    if (rc == 0 && ls.length == 0 && n->d)
        rc = exec(r, n->d);
    json_decref(items);
    return rc;
}

static bool is_namespace(const struct render *r, const json_t *j)
{
    for (size_t i = 0; i < json_array_size(r->namespaces); i++)
        if (json_array_get(r->namespaces, i) == j)
            return true;
    return false;
}

static int exec_set(struct render *r, const struct node *n)
{
    struct val v;
    if (eval(r, n->b, &v) < 0)
        return -1;
    int rc = 0;
    if (n->a) {
        struct val ns = lookup(r, n->a->name);
        if (ns.kind != V_JSON || !is_namespace(r, ns.j))
            rc = rfail(r, n, "'%s' is not a namespace: only namespace() objects take "
                             "attribute assignment", n->a->name);
        else if (v.kind != V_JSON && v.kind != V_UNDEF)
            rc = rfail(r, n, "only data can be stored in a namespace");
        else
            json_object_set_new(ns.j, n->name, v.kind == V_JSON ? json_incref(v.j) : json_null());
        val_drop(&ns);
        val_drop(&v);
        return rc;
    }
    if (n->n_names > 1) {
        rc = bind_targets(r, n, r->frame, &v);
        val_drop(&v);
        return rc;
    }
    frame_set(r->frame, n->name, v);
    return 0;
}

static int exec(struct render *r, const struct node *n)
{
    if (enter(r, n) < 0)
        return -1;
    int rc = 0;
    struct val v;
    switch (n->kind) {
    case N_BLOCK:
        for (size_t i = 0; i < n->n_kids && rc == 0 && r->ctl == CTL_NONE; i++)
            rc = exec(r, n->kids[i]);
        break;
    case N_TEXT: rc = out_add(r, n, n->str, n->str_len); break;
    case N_OUTPUT:
        rc = eval(r, n->a, &v);
        if (rc == 0 && val_str(r->out, &v) < 0)
            rc = rfail(r, n, "output larger than the limit of %zu bytes", r->out->max);
        val_drop(&v);
        break;
    case N_IF:
        rc = eval(r, n->a, &v);
        if (rc == 0) {
            bool t = val_truthy(&v);
            val_drop(&v);
            if (t)
                rc = exec(r, n->b);
            else if (n->c)
                rc = exec(r, n->c);
        }
        break;
    case N_FOR: rc = exec_for(r, n); break;
    case N_SET: rc = exec_set(r, n); break;
    case N_SET_BLOCK: {
        struct sbuf *saved = r->out;
        struct sbuf buf = {.max = saved->max};
        r->out = &buf;
        rc = exec(r, n->c);
        r->out = saved;
        if (rc == 0)
            frame_set(r->frame, n->name, val_json(json_stringn_nocheck(buf.p ? buf.p : "", buf.n)));
        sbuf_free(&buf);
        break;
    }
    case N_MACRO: {
        struct val m = {.kind = V_MACRO, .macro = n};
        frame_set(r->frame, n->name, m);
        break;
    }
    case N_BREAK: r->ctl = CTL_BREAK; break;
    case N_CONTINUE: r->ctl = CTL_CONTINUE; break;
    default: rc = rfail(r, n, "expression used as a statement");
    }
    r->depth--;
    return rc;
}

/* --- entry points --- */

int tpl_render(const tpl_template *t, const json_t *ctx, time_t now, char **out,
               size_t *out_len, struct tpl_error *err)
{
    struct tpl_error scratch;
    if (!err)
        err = &scratch;
    memset(err, 0, sizeof *err);
    *out = NULL;
    if (out_len)
        *out_len = 0;
    if (ctx && !json_is_object(ctx)) {
        snprintf(err->msg, sizeof err->msg, "the render context must be a JSON object");
        return -1;
    }
    json_t *empty = ctx ? NULL : json_object();
    struct sbuf buf = {.max = t->limits.max_output};
    struct frame root = {0};
    struct render r = {.t = t, .ctx = ctx ? ctx : empty, .now = now, .out = &buf,
                       .frame = &root, .root = &root, .namespaces = json_array(), .err = err};
    int rc = exec(&r, t->root);
    frame_free(&root);
    /* namespaces may refer to one another; clear them before the last reference goes */
    for (size_t i = 0; i < json_array_size(r.namespaces); i++)
        json_object_clear(json_array_get(r.namespaces, i));
    json_decref(r.namespaces);
    json_decref(empty);
    if (rc < 0) {
        sbuf_free(&buf);
        return -1;
    }
    if (!buf.p)
        sbuf_add(&buf, "", 0);
    if (!buf.p) {
        buf.p = malloc(1);
        if (!buf.p)
            abort();
        buf.p[0] = 0;
    }
    *out = buf.p;
    if (out_len)
        *out_len = buf.n;
    return 0;
}

void tpl_register_namespace(struct render *r, json_t *ns)
{
    json_array_append(r->namespaces, ns);
}
