/*
 * filters.c - the builtins that work on data: length, default, items,
 * dict methods, list conversions, numbers, sorting (stable, as Python's),
 * and the higher-order filters select/reject, selectattr/rejectattr and
 * map, which run a test or filter by name over a list.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/builtins_internal.h"

/* --- data --- */

static int f_length(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)a;
    size_t n = 0;
    if (in->kind == V_UNDEF)
        n = 0;
    else if (val_is_string(in))
        n = utf8_len(json_string_value(in->j), json_string_length(in->j));
    else if (in->kind == V_JSON && json_is_array(in->j))
        n = json_array_size(in->j);
    else if (in->kind == V_JSON && json_is_object(in->j))
        n = json_object_size(in->j);
    else if (in->kind == V_LOOP)
        n = 0;
    else
        return rfail(r, at, "'length' needs a string, a list or a dict");
    *out = val_json(json_integer((long long)n));
    return 0;
}

static int f_default(struct render *r, const struct node *at, const struct val *in,
                     struct args *a, struct val *out)
{
    (void)r;
    (void)at;
    const struct val *d = arg(a, 0, "default_value"), *b = arg(a, 1, "boolean");
    bool use = in->kind == V_UNDEF || (b && val_truthy(b) && !val_truthy(in));
    if (!use)
        *out = val_copy(in);
    else if (d)
        *out = val_copy(d);
    else
        *out = make_str("", 0);
    return 0;
}

static int f_items(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    if (in->kind == V_UNDEF) {
        *out = val_json(json_array());
        return 0;
    }
    if (in->kind != V_JSON || !json_is_object(in->j))
        return rfail(r, at, "'items' needs a dict");
    json_t *res = json_array();
    const char *k;
    json_t *v;
    json_object_foreach(in->j, k, v) json_array_append_new(res, json_pack("[sO]", k, v));
    *out = val_json(res);
    return 0;
}

static int m_items(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    return f_items(r, at, in, a, out);
}

static int m_keys_values(struct render *r, const struct node *at, const struct val *in,
                         struct val *out, bool keys)
{
    (void)r;
    (void)at;
    json_t *res = json_array();
    const char *k;
    json_t *v;
    json_object_foreach(in->j, k, v)
        json_array_append_new(res, keys ? json_string(k) : json_incref(v));
    *out = val_json(res);
    return 0;
}
static int m_keys(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    (void)a;
    return m_keys_values(r, at, in, out, true);
}
static int m_values(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)a;
    return m_keys_values(r, at, in, out, false);
}

static int m_get(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    const struct val *k = arg(a, 0, NULL), *d = arg(a, 1, NULL);
    const char *key;
    size_t nk;
    if (!k || str_arg(r, at, k, "get's key", &key, &nk) < 0)
        return k ? -1 : rfail(r, at, "'get' needs a key");
    json_t *x = json_object_get(in->j, key);
    if (x)
        *out = val_json(json_incref(x));
    else
        *out = d ? val_copy(d) : val_json(json_null());
    return 0;
}

static int f_list(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    (void)a;
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    *out = val_json(json_is_array(in->j) && in->kind == V_JSON ? json_copy(items) : json_incref(items));
    json_decref(items);
    return 0;
}

static int first_last(struct render *r, const struct node *at, const struct val *in,
                      struct val *out, bool first)
{
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    size_t n = json_array_size(items);
    *out = n ? val_json(json_incref(json_array_get(items, first ? 0 : n - 1))) : val_undef();
    json_decref(items);
    return 0;
}
static int f_first(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return first_last(r, at, in, out, true);
}
static int f_last(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    (void)a;
    return first_last(r, at, in, out, false);
}

static int f_reverse(struct render *r, const struct node *at, const struct val *in,
                     struct args *a, struct val *out)
{
    (void)a;
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    json_t *res = json_array();
    for (size_t i = json_array_size(items); i > 0; i--)
        json_array_append(res, json_array_get(items, i - 1));
    json_decref(items);
    if (val_is_string(in)) {
        struct val s;
        int rc = tpl_join(r, at, res, "", 0, NULL, &s);
        json_decref(res);
        *out = s;
        return rc;
    }
    *out = val_json(res);
    return 0;
}

static int f_int(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    (void)r;
    (void)at;
    const struct val *d = arg(a, 0, "default");
    long long v = 0;
    bool ok = false;
    if (in->kind == V_JSON) {
        if (json_is_integer(in->j)) {
            v = json_integer_value(in->j);
            ok = true;
        } else if (json_is_real(in->j) && fabs(json_real_value(in->j)) < 9.2e18) {
            v = (long long)json_real_value(in->j);
            ok = true;
        } else if (json_is_boolean(in->j)) {
            v = json_is_true(in->j);
            ok = true;
        } else if (json_is_string(in->j)) {
            char *end;
            const char *s = json_string_value(in->j);
            errno = 0;
            v = strtoll(s, &end, 10);
            while (py_space((unsigned char)*end))
                end++;
            ok = end != s && !*end && !errno;
            if (!ok) {
                double dv = strtod(s, &end);
                while (py_space((unsigned char)*end))
                    end++;
                ok = end != s && !*end && fabs(dv) < 9.2e18;
                v = (long long)dv;
            }
        }
    }
    *out = ok ? val_json(json_integer(v)) : d ? val_copy(d) : val_json(json_integer(0));
    return 0;
}

static int f_float(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)r;
    (void)at;
    const struct val *d = arg(a, 0, "default");
    double v = 0;
    bool ok = false;
    if (in->kind == V_JSON && json_is_number(in->j)) {
        v = json_number_value(in->j);
        ok = true;
    } else if (val_is_string(in)) {
        char *end;
        const char *s = json_string_value(in->j);
        v = strtod(s, &end);
        while (py_space((unsigned char)*end))
            end++;
        ok = end != s && !*end && isfinite(v); /* "inf", "1e999": not a JSON number */
    }
    *out = ok ? val_json(json_real(v)) : d ? val_copy(d) : val_json(json_real(0));
    return 0;
}

static int f_abs(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    (void)a;
    if (!val_is_number(in))
        return rfail(r, at, "'abs' needs a number");
    if (json_is_integer(in->j)) {
        long long v = json_integer_value(in->j);
        if (v == INT64_MIN)
            return rfail(r, at, "integer overflow in 'abs'");
        *out = val_json(json_integer(v < 0 ? -v : v));
    } else {
        *out = val_json(json_real(fabs(json_real_value(in->j))));
    }
    return 0;
}

static int f_round(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    long long prec = 0;
    const struct val *p = arg(a, 0, "precision"), *m = arg(a, 1, "method");
    if (p && !int_arg(p, &prec))
        return rfail(r, at, "round: precision must be an integer");
    if (!val_is_number(in) || prec < 0 || prec > 15)
        return rfail(r, at, "'round' needs a number and a precision of 0..15");
    const char *method = m && val_is_string(m) ? json_string_value(m->j) : "common";
    double scale = pow(10, (double)prec), v = json_number_value(in->j) * scale;
    if (!strcmp(method, "floor"))
        v = floor(v);
    else if (!strcmp(method, "ceil"))
        v = ceil(v);
    else if (!strcmp(method, "common"))
        v = round(v);
    else
        return rfail(r, at, "round: method must be common, ceil or floor");
    *out = val_json(json_real(v / scale));
    return 0;
}

/* Stable merge sort of items by cmp (attribute optional); -1 on an
 * unorderable pair. */
struct sort_ctx {
    const char *attribute;
    bool fold_case;
    bool bad;
};

static int sort_cmp(const json_t *x, const json_t *y, struct sort_ctx *c)
{
    if (c->attribute) {
        x = json_is_object(x) ? json_object_get(x, c->attribute) : NULL;
        y = json_is_object(y) ? json_object_get(y, c->attribute) : NULL;
        if (!x || !y) {
            c->bad = true;
            return 0;
        }
    }
    int cmp;
    if (c->fold_case && json_is_string(x) && json_is_string(y)) {
        cmp = strcasecmp(json_string_value(x), json_string_value(y));
        return cmp < 0 ? -1 : cmp > 0;
    }
    if (json_compare_py(x, y, &cmp) < 0)
        c->bad = true;
    return cmp;
}

static void merge_sort(json_t **v, json_t **tmp, size_t n, struct sort_ctx *c)
{
    if (n < 2)
        return;
    size_t h = n / 2;
    merge_sort(v, tmp, h, c);
    merge_sort(v + h, tmp, n - h, c);
    size_t i = 0, j = h, k = 0;
    while (i < h && j < n)
        tmp[k++] = sort_cmp(v[j], v[i], c) < 0 ? v[j++] : v[i++];
    while (i < h)
        tmp[k++] = v[i++];
    while (j < n)
        tmp[k++] = v[j++];
    memcpy(v, tmp, n * sizeof *v);
}

static int sort_items(struct render *r, const struct node *at, json_t *items,
                      struct sort_ctx *c, bool reverse, json_t **out)
{
    size_t n = json_array_size(items);
    json_t **v = malloc((n + 1) * sizeof *v), **tmp = malloc((n + 1) * sizeof *v);
    if (!v || !tmp)
        abort();
    for (size_t i = 0; i < n; i++)
        v[i] = json_array_get(items, i);
    merge_sort(v, tmp, n, c);
    json_t *res = json_array();
    for (size_t i = 0; i < n; i++)
        json_array_append(res, v[reverse ? n - 1 - i : i]);
    free(v);
    free(tmp);
    if (c->bad) {
        json_decref(res);
        return rfail(r, at, "sort: these values cannot be ordered");
    }
    *out = res;
    return 0;
}

static int f_sort(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    const struct val *rev = arg(a, 0, "reverse"), *cs = arg(a, 1, "case_sensitive"),
                     *attr = arg(a, 2, "attribute");
    struct sort_ctx c = {.fold_case = !(cs && val_truthy(cs))};
    size_t na;
    if (attr && str_arg(r, at, attr, "sort's attribute", &c.attribute, &na) < 0)
        return -1;
    json_t *items, *res;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    int rc = sort_items(r, at, items, &c, rev && val_truthy(rev), &res);
    json_decref(items);
    if (rc == 0)
        *out = val_json(res);
    return rc;
}

static int f_dictsort(struct render *r, const struct node *at, const struct val *in,
                      struct args *a, struct val *out)
{
    const struct val *cs = arg(a, 0, "case_sensitive"), *by = arg(a, 1, "by"),
                     *rev = arg(a, 2, "reverse");
    if (by && !(val_is_string(by) && !strcmp(json_string_value(by->j), "key")))
        return rfail(r, at, "dictsort: only by='key' is supported");
    struct val items;
    if (f_items(r, at, in, a, &items) < 0)
        return -1;
    /* sort the pairs by their first element */
    json_t *keys = json_array();
    for (size_t i = 0; i < json_array_size(items.j); i++)
        json_array_append(keys, json_array_get(items.j, i));
    struct sort_ctx c = {.fold_case = !(cs && val_truthy(cs))};
    json_t *res;
    int rc = sort_items(r, at, keys, &c, rev && val_truthy(rev), &res);
    json_decref(keys);
    val_drop(&items);
    if (rc == 0)
        *out = val_json(res);
    return rc;
}

static int f_unique(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)a;
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    json_t *res = json_array();
    for (size_t i = 0; i < json_array_size(items); i++) {
        json_t *x = json_array_get(items, i);
        bool seen = false;
        for (size_t k = 0; k < json_array_size(res) && !seen; k++)
            seen = json_equal_py(x, json_array_get(res, k));
        if (!seen)
            json_array_append(res, x);
    }
    json_decref(items);
    *out = val_json(res);
    return 0;
}

static int f_sum(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    const struct val *attr = arg(a, 0, "attribute"), *start = arg(a, 1, "start");
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    long long si = 0;
    double sd = 0;
    bool is_real = false;
    if (start && !val_is_number(start)) {
        json_decref(items);
        return rfail(r, at, "sum: start must be a number");
    }
    if (start) {
        is_real = json_is_real(start->j);
        si = is_real ? 0 : json_integer_value(start->j);
        sd = json_number_value(start->j);
    }
    for (size_t i = 0; i < json_array_size(items); i++) {
        json_t *x = json_array_get(items, i);
        if (attr && val_is_string(attr))
            x = json_is_object(x) ? json_object_get(x, json_string_value(attr->j)) : NULL;
        if (!x || !json_is_number(x)) {
            json_decref(items);
            return rfail(r, at, "sum: items must be numbers");
        }
        if (json_is_real(x))
            is_real = true;
        if (json_is_integer(x) && __builtin_add_overflow(si, json_integer_value(x), &si)) {
            json_decref(items);
            return rfail(r, at, "integer overflow in 'sum'");
        }
        sd += json_number_value(x);
    }
    json_decref(items);
    if (is_real && !isfinite(sd)) /* as eval.c's arithmetic */
        return rfail(r, at, "float result of 'sum' out of range");
    *out = val_json(is_real ? json_real(sd) : json_integer(si));
    return 0;
}

static int minmax(struct render *r, const struct node *at, const struct val *in,
                  struct args *a, struct val *out, bool max)
{
    const struct val *cs = arg(a, 0, "case_sensitive"), *attr = arg(a, 1, "attribute");
    struct sort_ctx c = {.fold_case = !(cs && val_truthy(cs))};
    size_t na;
    if (attr && str_arg(r, at, attr, "the attribute", &c.attribute, &na) < 0)
        return -1;
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    json_t *best = NULL;
    for (size_t i = 0; i < json_array_size(items); i++) {
        json_t *x = json_array_get(items, i);
        if (!best || (max ? sort_cmp(x, best, &c) > 0 : sort_cmp(x, best, &c) < 0))
            best = x;
    }
    *out = best ? val_json(json_incref(best)) : val_undef();
    json_decref(items);
    return c.bad ? (val_drop(out), rfail(r, at, "these values cannot be ordered")) : 0;
}
static int f_min(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    return minmax(r, at, in, a, out, false);
}
static int f_max(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    return minmax(r, at, in, a, out, true);
}

static int f_attr(struct render *r, const struct node *at, const struct val *in,
                  struct args *a, struct val *out)
{
    const struct val *name = arg(a, 0, NULL);
    const char *s;
    size_t n;
    if (!name || str_arg(r, at, name, "attr's name", &s, &n) < 0)
        return name ? -1 : rfail(r, at, "'attr' needs a name");
    if (in->kind == V_UNDEF) {
        *out = val_undef();
        return 0;
    }
    return val_getattr(r, at, in, s, out);
}

/* --- higher-order filters --- */

/* Run test `name` on x with extra args a->v[from..]; *res its truth. */
static int run_test(struct render *r, const struct node *at, const char *name, const json_t *x,
                    const struct args *a, size_t from, bool *res)
{
    int fn = tpl_builtin_find(B_TEST, name);
    if (fn < 0)
        return rfail(r, at, "unsupported test '%s'", name);
    struct args rest = {.v = a->v + from, .kw = a->kw ? a->kw + from : NULL,
                        .n = a->n > from ? a->n - from : 0};
    struct val in = {.kind = V_JSON, .j = (json_t *)x}, out;
    if (tpl_builtin_call(r, at, B_TEST, fn, &in, &rest, &out) < 0)
        return -1;
    *res = val_truthy(&out);
    val_drop(&out);
    return 0;
}

/* select / reject (by_attr false) and selectattr / rejectattr (true) */
static int select_impl(struct render *r, const struct node *at, const struct val *in,
                       struct args *a, struct val *out, bool keep, bool by_attr)
{
    const char *attr = NULL, *test = NULL;
    size_t n, k = 0;
    if (by_attr) {
        const struct val *av = arg(a, k++, NULL);
        if (!av || str_arg(r, at, av, "the attribute", &attr, &n) < 0)
            return av ? -1 : rfail(r, at, "selectattr/rejectattr need an attribute");
    }
    const struct val *tv = arg(a, k, NULL);
    if (tv) {
        if (str_arg(r, at, tv, "the test name", &test, &n) < 0)
            return -1;
        k++;
    }
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    json_t *res = json_array();
    int rc = 0;
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        json_t *x = json_array_get(items, i), *subject = x;
        if (attr)
            subject = json_is_object(x) ? json_object_get(x, attr) : NULL;
        bool t = false;
        if (!subject) {
            struct val u = val_undef();
            if (test) {
                int fn = tpl_builtin_find(B_TEST, test);
                struct args rest = {.v = a->v + k, .kw = a->kw ? a->kw + k : NULL,
                                    .n = a->n > k ? a->n - k : 0};
                struct val o;
                rc = fn < 0 ? rfail(r, at, "unsupported test '%s'", test)
                            : tpl_builtin_call(r, at, B_TEST, fn, &u, &rest, &o);
                t = rc == 0 && val_truthy(&o);
                if (rc == 0)
                    val_drop(&o);
            } else {
                t = false;
            }
        } else if (test) {
            rc = run_test(r, at, test, subject, a, k, &t);
        } else {
            struct val sv = {.kind = V_JSON, .j = subject};
            t = val_truthy(&sv);
        }
        if (rc == 0 && t == keep)
            json_array_append(res, x);
    }
    json_decref(items);
    if (rc < 0) {
        json_decref(res);
        return -1;
    }
    *out = val_json(res);
    return 0;
}

static int f_select(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    return select_impl(r, at, in, a, out, true, false);
}
static int f_reject(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    return select_impl(r, at, in, a, out, false, false);
}
static int f_selectattr(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    return select_impl(r, at, in, a, out, true, true);
}
static int f_rejectattr(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    return select_impl(r, at, in, a, out, false, true);
}

static int f_map(struct render *r, const struct node *at, const struct val *in, struct args *a,
                 struct val *out)
{
    const struct val *attr = arg(a, 99, "attribute"), *dflt = arg(a, 99, "default");
    const struct val *fname = arg(a, 0, NULL);
    int fn = -1;
    if (!attr) {
        const char *s;
        size_t n;
        if (!fname || str_arg(r, at, fname, "map's filter name", &s, &n) < 0)
            return fname ? -1 : rfail(r, at, "'map' needs a filter name or attribute=");
        fn = tpl_builtin_find(B_FILTER, s);
        if (fn < 0)
            return rfail(r, at, "unsupported filter '%s'", s);
    } else if (!val_is_string(attr)) {
        return rfail(r, at, "map: attribute must be a string");
    }
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    json_t *res = json_array();
    int rc = 0;
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        json_t *x = json_array_get(items, i);
        struct val xv = {.kind = V_JSON, .j = x}, o = val_undef();
        if (attr) {
            json_t *y = json_is_object(x) ? json_object_get(x, json_string_value(attr->j)) : NULL;
            if (y)
                o = val_json(json_incref(y));
            else if (dflt)
                o = val_copy(dflt);
        } else {
            struct args rest = {.v = a->v + 1, .kw = a->kw ? a->kw + 1 : NULL, .n = a->n - 1};
            rc = tpl_builtin_call(r, at, B_FILTER, fn, &xv, &rest, &o);
        }
        if (rc == 0 && o.kind != V_JSON && o.kind != V_UNDEF)
            rc = rfail(r, at, "map produced a value that is not data");
        if (rc == 0)
            json_array_append_new(res, o.kind == V_JSON ? json_incref(o.j) : json_null());
        val_drop(&o);
    }
    json_decref(items);
    if (rc < 0) {
        json_decref(res);
        return -1;
    }
    *out = val_json(res);
    return 0;
}

/* --- this file's rows of the builtin table --- */

const struct builtin tpl_data_builtins[] = {
    {B_FILTER, "length", f_length, 0},
    {B_FILTER, "count", f_length, 0},
    {B_FILTER, "default", f_default, 0},
    {B_FILTER, "d", f_default, 0},
    {B_FILTER, "items", f_items, 0},
    {B_FILTER, "dictsort", f_dictsort, 0},
    {B_FILTER, "first", f_first, 0},
    {B_FILTER, "last", f_last, 0},
    {B_FILTER, "list", f_list, 0},
    {B_FILTER, "int", f_int, 0},
    {B_FILTER, "float", f_float, 0},
    {B_FILTER, "abs", f_abs, 0},
    {B_FILTER, "round", f_round, 0},
    {B_FILTER, "reverse", f_reverse, 0},
    {B_FILTER, "sort", f_sort, 0},
    {B_FILTER, "unique", f_unique, 0},
    {B_FILTER, "sum", f_sum, 0},
    {B_FILTER, "min", f_min, 0},
    {B_FILTER, "max", f_max, 0},
    {B_FILTER, "map", f_map, 0},
    {B_FILTER, "select", f_select, 0},
    {B_FILTER, "reject", f_reject, 0},
    {B_FILTER, "selectattr", f_selectattr, 0},
    {B_FILTER, "rejectattr", f_rejectattr, 0},
    {B_FILTER, "attr", f_attr, 0},
    {B_METHOD, "items", m_items, R_DICT},
    {B_METHOD, "keys", m_keys, R_DICT},
    {B_METHOD, "values", m_values, R_DICT},
    {B_METHOD, "get", m_get, R_DICT},
};
const size_t tpl_n_data_builtins = sizeof tpl_data_builtins / sizeof tpl_data_builtins[0];
