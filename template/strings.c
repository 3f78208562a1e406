/*
 * strings.c - the builtins that work on text: trim and strip, case,
 * startswith/endswith, split, replace, find and join, printing and JSON
 * (tojson, string, escape, indent). Python's str methods and Jinja's
 * filters of the same names share one implementation each.
 *
 * Text functions treat bytes of 0x80 and above as parts of letters and
 * change case only for ASCII, a deliberate subset: the case-changing calls
 * in chat templates work on role names and markers.
 */
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/builtins_internal.h"

/* --- strings --- */

/* strip / lstrip / rstrip with optional chars; how: 1 left, 2 right, 3 both */
static int strip_impl(struct render *r, const struct node *at, const struct val *in,
                      struct args *a, struct val *out, int how, const char *name)
{
    const char *s, *chars = NULL;
    size_t n, nc = 0;
    if (need_str(r, at, in, name, &s, &n) < 0)
        return -1;
    const struct val *c = arg(a, 0, "chars");
    if (c && !(c->kind == V_JSON && json_is_null(c->j)) &&
        str_arg(r, at, c, "the characters to strip", &chars, &nc) < 0)
        return -1;
    size_t b = 0, e = n;
#define STRIPPABLE(ch) (chars ? memchr(chars, (ch), nc) != NULL : py_space((unsigned char)(ch)))
    if (how & 1)
        while (b < e && STRIPPABLE(s[b]))
            b++;
    if (how & 2)
        while (e > b && STRIPPABLE(s[e - 1]))
            e--;
#undef STRIPPABLE
    *out = make_str(s + b, e - b);
    return 0;
}

static int f_trim(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    return strip_impl(r, at, in, a, out, 3, "trim");
}
static int m_strip(struct render *r, const struct node *at, const struct val *in, struct args *a,
                   struct val *out)
{
    return strip_impl(r, at, in, a, out, 3, "strip");
}
static int m_lstrip(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    return strip_impl(r, at, in, a, out, 1, "lstrip");
}
static int m_rstrip(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    return strip_impl(r, at, in, a, out, 2, "rstrip");
}

/* case: 'u' upper, 'l' lower, 'c' capitalize, 't' str.title, 'j' Jinja's title */
static int case_impl(struct render *r, const struct node *at, const struct val *in,
                     struct val *out, char how, const char *name)
{
    const char *s;
    size_t n;
    if (how != 'u' && how != 'l' && !val_is_string(in)) {
        return rfail(r, at, "'%s' needs a string", name);
    }
    struct sbuf b = {.max = (size_t)-1};
    if (!val_is_string(in)) { /* upper/lower of a non-string: its str() */
        if (val_str(&b, in) < 0)
            return rfail(r, at, "'%s' cannot print this value", name);
        s = b.p ? b.p : "";
        n = b.n;
    } else {
        s = json_string_value(in->j);
        n = json_string_length(in->j);
    }
    char *d = malloc(n + 1);
    if (!d)
        abort();
    bool prev_cased = false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        bool cased = isalpha(c) || c >= 0x80;
        switch (how) {
        case 'u': d[i] = (char)toupper(c); break;
        case 'l': d[i] = (char)tolower(c); break;
        case 'c': d[i] = (char)(i == 0 ? toupper(c) : tolower(c)); break;
        case 't': d[i] = (char)(prev_cased ? tolower(c) : toupper(c)); break;
        case 'j': {
            bool boundary = i == 0 || strchr("-({[<", s[i - 1]) || py_space((unsigned char)s[i - 1]);
            d[i] = (char)(boundary ? toupper(c) : tolower(c));
            break;
        }
        }
        prev_cased = cased;
    }
    *out = make_str(d, n);
    free(d);
    sbuf_free(&b);
    return 0;
}

static int f_upper(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return case_impl(r, at, in, out, 'u', "upper");
}
static int f_lower(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return case_impl(r, at, in, out, 'l', "lower");
}
static int f_capitalize(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    (void)a;
    return case_impl(r, at, in, out, 'c', "capitalize");
}
static int f_title(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return case_impl(r, at, in, out, 'j', "title");
}
static int m_title(struct render *r, const struct node *at, const struct val *in,
                   struct args *a, struct val *out)
{
    (void)a;
    return case_impl(r, at, in, out, 't', "title");
}

static int affix_impl(struct render *r, const struct node *at, const struct val *in,
                      struct args *a, struct val *out, bool start)
{
    const char *s;
    size_t n;
    const char *name = start ? "startswith" : "endswith";
    if (need_str(r, at, in, name, &s, &n) < 0)
        return -1;
    const struct val *p = arg(a, 0, NULL);
    if (!p)
        return rfail(r, at, "'%s' needs an argument", name);
    /* a string, or a tuple/list of strings (any matches) */
    size_t k = p->kind == V_JSON && json_is_array(p->j) ? json_array_size(p->j) : 1;
    bool hit = false;
    for (size_t i = 0; i < k && !hit; i++) {
        struct val one = *p;
        if (json_is_array(p->j))
            one.j = json_array_get(p->j, i);
        const char *x;
        size_t nx;
        if (str_arg(r, at, &one, "the prefix or suffix", &x, &nx) < 0)
            return -1;
        hit = nx <= n && memcmp(start ? s : s + n - nx, x, nx) == 0;
    }
    *out = val_json(json_boolean(hit));
    return 0;
}
static int m_startswith(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    return affix_impl(r, at, in, a, out, true);
}
static int m_endswith(struct render *r, const struct node *at, const struct val *in,
                      struct args *a, struct val *out)
{
    return affix_impl(r, at, in, a, out, false);
}

static int m_split(struct render *r, const struct node *at, const struct val *in, struct args *a,
                   struct val *out)
{
    const char *s, *sep = NULL;
    size_t n, ns = 0;
    long long maxsplit = -1;
    if (need_str(r, at, in, "split", &s, &n) < 0)
        return -1;
    const struct val *sv = arg(a, 0, "sep");
    if (sv && !(sv->kind == V_JSON && json_is_null(sv->j)) &&
        str_arg(r, at, sv, "the separator", &sep, &ns) < 0)
        return -1;
    if (sep && ns == 0)
        return rfail(r, at, "split: empty separator");
    const struct val *mv = arg(a, 1, "maxsplit");
    if (mv && !int_arg(mv, &maxsplit))
        return rfail(r, at, "split: maxsplit must be an integer");
    json_t *res = json_array();
    size_t i = 0;
    if (!sep) {
        for (;;) {
            while (i < n && py_space((unsigned char)s[i]))
                i++;
            if (i >= n)
                break;
            size_t b = i;
            if (maxsplit >= 0 && (long long)json_array_size(res) >= maxsplit) {
                size_t e = n;
                while (e > b && py_space((unsigned char)s[e - 1]))
                    e--;
                json_array_append_new(res, json_stringn_nocheck(s + b, e - b));
                break;
            }
            while (i < n && !py_space((unsigned char)s[i]))
                i++;
            json_array_append_new(res, json_stringn_nocheck(s + b, i - b));
        }
    } else {
        for (;;) {
            const char *hit = (maxsplit < 0 || (long long)json_array_size(res) < maxsplit)
                                  ? memmem(s + i, n - i, sep, ns)
                                  : NULL;
            size_t e = hit ? (size_t)(hit - s) : n;
            json_array_append_new(res, json_stringn_nocheck(s + i, e - i));
            if (!hit)
                break;
            i = e + ns;
        }
    }
    *out = val_json(res);
    return 0;
}

static int m_splitlines(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    const char *s;
    size_t n;
    (void)a;
    if (need_str(r, at, in, "splitlines", &s, &n) < 0)
        return -1;
    json_t *res = json_array();
    size_t b = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\n' && s[i] != '\r')
            continue;
        json_array_append_new(res, json_stringn_nocheck(s + b, i - b));
        if (s[i] == '\r' && i + 1 < n && s[i + 1] == '\n')
            i++;
        b = i + 1;
    }
    if (b < n)
        json_array_append_new(res, json_stringn_nocheck(s + b, n - b));
    *out = val_json(res);
    return 0;
}

static int replace_impl(struct render *r, const struct node *at, const struct val *in,
                        struct args *a, struct val *out)
{
    const char *s, *old, *new_;
    size_t n, no, nn;
    long long count = -1;
    if (need_str(r, at, in, "replace", &s, &n) < 0)
        return -1;
    const struct val *o = arg(a, 0, "old"), *w = arg(a, 1, "new"), *c = arg(a, 2, "count");
    if (!o || !w)
        return rfail(r, at, "'replace' needs two arguments");
    if (str_arg(r, at, o, "replace's first argument", &old, &no) < 0 ||
        str_arg(r, at, w, "replace's second argument", &new_, &nn) < 0)
        return -1;
    if (c && !int_arg(c, &count))
        return rfail(r, at, "replace: count must be an integer");
    struct sbuf b = {.max = rmax_string(r)};
    size_t i = 0;
    long long done = 0;
    int rc = 0;
    while (i <= n && rc == 0) {
        if (count >= 0 && done >= count) {
            rc = sbuf_add(&b, s + i, n - i);
            break;
        }
        const char *hit;
        if (no == 0) { /* Python inserts new between every character */
            rc = sbuf_add(&b, new_, nn);
            done++;
            if (i == n)
                break;
            size_t step = utf8_offset(s + i, n - i, 1);
            if (rc == 0)
                rc = sbuf_add(&b, s + i, step);
            i += step;
            continue;
        }
        hit = memmem(s + i, n - i, old, no);
        if (!hit) {
            rc = sbuf_add(&b, s + i, n - i);
            break;
        }
        rc = sbuf_add(&b, s + i, (size_t)(hit - (s + i)));
        if (rc == 0)
            rc = sbuf_add(&b, new_, nn);
        i = (size_t)(hit - s) + no;
        done++;
    }
    return sbuf_result(r, at, &b, rc, out);
}

static int m_find(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    const char *s, *x;
    size_t n, nx;
    if (need_str(r, at, in, "find", &s, &n) < 0)
        return -1;
    const struct val *p = arg(a, 0, NULL);
    if (!p || str_arg(r, at, p, "find's argument", &x, &nx) < 0)
        return p ? -1 : rfail(r, at, "'find' needs an argument");
    const char *hit = memmem(s, n, x, nx);
    *out = val_json(json_integer(hit ? (long long)utf8_len(s, (size_t)(hit - s)) : -1));
    return 0;
}

/* --- printing and JSON --- */

int tpl_join(struct render *r, const struct node *at, const json_t *items,
                     const char *sep, size_t ns, const char *attribute, struct val *out)
{
    struct sbuf b = {.max = rmax_string(r)};
    int rc = 0;
    for (size_t i = 0; i < json_array_size(items) && rc == 0; i++) {
        if (i)
            rc = sbuf_add(&b, sep, ns);
        const json_t *x = json_array_get(items, i);
        if (attribute)
            x = json_is_object(x) ? json_object_get(x, attribute) : NULL;
        if (rc == 0 && x)
            rc = json_str(&b, x, false);
    }
    return sbuf_result(r, at, &b, rc, out);
}

static int f_join(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    const char *sep = "", *attribute = NULL;
    size_t ns = 0, na;
    const struct val *s = arg(a, 0, "d"), *at_v = arg(a, 1, "attribute");
    if (s && str_arg(r, at, s, "join's separator", &sep, &ns) < 0)
        return -1;
    if (at_v && str_arg(r, at, at_v, "join's attribute", &attribute, &na) < 0)
        return -1;
    json_t *items;
    if (val_iterable(r, at, in, &items) < 0)
        return -1;
    int rc = tpl_join(r, at, items, sep, ns, attribute, out);
    json_decref(items);
    return rc;
}

static int m_join(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    const char *sep;
    size_t ns;
    if (need_str(r, at, in, "join", &sep, &ns) < 0)
        return -1;
    const struct val *p = arg(a, 0, NULL);
    if (!p)
        return rfail(r, at, "'join' needs an argument");
    json_t *items;
    if (val_iterable(r, at, p, &items) < 0)
        return -1;
    int rc = tpl_join(r, at, items, sep, ns, NULL, out);
    json_decref(items);
    return rc;
}

static int f_tojson(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    long long indent = -1;
    const struct val *iv = arg(a, 0, "indent"), *sk = arg(a, 1, "sort_keys");
    if (iv && !(iv->kind == V_JSON && json_is_null(iv->j)) && !int_arg(iv, &indent))
        return rfail(r, at, "tojson: indent must be an integer");
    if (indent > 64)
        return rfail(r, at, "tojson: indent above 64");
    if (in->kind != V_JSON)
        return rfail(r, at, "tojson: %s is not JSON data",
                     in->kind == V_UNDEF ? "an undefined value" : "this value");
    struct sbuf b = {.max = rmax_string(r)};
    return sbuf_result(r, at, &b, json_dump_py(&b, in->j, (int)indent, sk && val_truthy(sk), 0), out);
}

static int f_string(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    (void)a;
    struct sbuf b = {.max = rmax_string(r)};
    return sbuf_result(r, at, &b, val_str(&b, in), out);
}

static int f_safe(struct render *r, const struct node *at, const struct val *in, struct args *a,
                  struct val *out)
{
    (void)r;
    (void)at;
    (void)a;
    *out = val_copy(in);
    return 0;
}

static int f_escape(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    struct val s;
    if (f_string(r, at, in, a, &s) < 0)
        return -1;
    struct sbuf b = {.max = rmax_string(r)};
    const char *p = json_string_value(s.j);
    int rc = 0;
    for (size_t i = 0; i < json_string_length(s.j) && rc == 0; i++) {
        switch (p[i]) {
        case '&': rc = sbuf_add(&b, "&amp;", 5); break;
        case '<': rc = sbuf_add(&b, "&lt;", 4); break;
        case '>': rc = sbuf_add(&b, "&gt;", 4); break;
        case '"': rc = sbuf_add(&b, "&#34;", 5); break;
        case '\'': rc = sbuf_add(&b, "&#39;", 5); break;
        default: rc = sbuf_addc(&b, p[i]);
        }
    }
    val_drop(&s);
    return sbuf_result(r, at, &b, rc, out);
}

static int f_indent(struct render *r, const struct node *at, const struct val *in,
                    struct args *a, struct val *out)
{
    const char *s, *pad = "    ";
    size_t n, np = 4;
    char spaces[65];
    if (need_str(r, at, in, "indent", &s, &n) < 0)
        return -1;
    const struct val *w = arg(a, 0, "width"), *first = arg(a, 1, "first"),
                     *blank = arg(a, 2, "blank");
    long long width;
    if (w && int_arg(w, &width)) {
        if (width < 0 || width > 64)
            return rfail(r, at, "indent: width outside 0..64");
        memset(spaces, ' ', (size_t)width);
        spaces[width] = 0;
        pad = spaces;
        np = (size_t)width;
    } else if (w && str_arg(r, at, w, "indent's width", &pad, &np) < 0) {
        return -1;
    }
    struct sbuf b = {.max = rmax_string(r)};
    int rc = 0;
    bool line_start = first && val_truthy(first);
    for (size_t i = 0; i < n && rc == 0; i++) {
        bool blank_line = s[i] == '\n';
        if (line_start && (!blank_line || (blank && val_truthy(blank))))
            rc = sbuf_add(&b, pad, np);
        if (rc == 0)
            rc = sbuf_addc(&b, s[i]);
        line_start = s[i] == '\n';
    }
    return sbuf_result(r, at, &b, rc, out);
}

/* --- this file's rows of the builtin table --- */

const struct builtin tpl_string_builtins[] = {
    {B_FILTER, "trim", f_trim, 0},
    {B_FILTER, "tojson", f_tojson, 0},
    {B_FILTER, "upper", f_upper, 0},
    {B_FILTER, "lower", f_lower, 0},
    {B_FILTER, "capitalize", f_capitalize, 0},
    {B_FILTER, "title", f_title, 0},
    {B_FILTER, "join", f_join, 0},
    {B_FILTER, "replace", replace_impl, 0},
    {B_FILTER, "string", f_string, 0},
    {B_FILTER, "safe", f_safe, 0},
    {B_FILTER, "escape", f_escape, 0},
    {B_FILTER, "e", f_escape, 0},
    {B_FILTER, "indent", f_indent, 0},
    {B_METHOD, "strip", m_strip, R_STR},
    {B_METHOD, "lstrip", m_lstrip, R_STR},
    {B_METHOD, "rstrip", m_rstrip, R_STR},
    {B_METHOD, "startswith", m_startswith, R_STR},
    {B_METHOD, "endswith", m_endswith, R_STR},
    {B_METHOD, "split", m_split, R_STR},
    {B_METHOD, "splitlines", m_splitlines, R_STR},
    {B_METHOD, "title", m_title, R_STR},
    {B_METHOD, "upper", f_upper, R_STR},
    {B_METHOD, "lower", f_lower, R_STR},
    {B_METHOD, "capitalize", f_capitalize, R_STR},
    {B_METHOD, "replace", replace_impl, R_STR},
    {B_METHOD, "find", m_find, R_STR},
    {B_METHOD, "join", m_join, R_STR},
};
const size_t tpl_n_string_builtins = sizeof tpl_string_builtins / sizeof tpl_string_builtins[0];
