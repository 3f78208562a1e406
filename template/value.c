/*
 * value.c - the values templates compute with, and how Python prints them.
 *
 * Values are jansson values plus four kinds JSON lacks: undefined (a name
 * or key that does not exist, which Jinja prints as "" and treats as
 * false), macros, builtin functions and the running loop object. Printing
 * follows Python, because the rendering Hugging Face produces is Python's
 * str() of each value: None, True, 1.5, 1e+16, {'a': [1, 'x']}. tojson is
 * Python's json.dumps as transformers calls it (ensure_ascii off, ", " and
 * ": " separators, optional indent), written here rather than taken from
 * jansson, whose separators, float digits and escapes differ.
 *
 * Also here: the arena the syntax tree lives in, a bounded string buffer,
 * Python equality and ordering, and UTF-8 counting for lengths and slices
 * (Python indexes strings by code point, not byte).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

/* --- arena --- */

struct arena_block {
    struct arena_block *next;
    size_t used, cap;
    _Alignas(16) char data[];
};

void *tpl_arena_alloc(struct arena *a, size_t size)
{
    size = (size + 15) & ~(size_t)15;
    struct arena_block *b = a->head;
    if (!b || b->cap - b->used < size) {
        size_t cap = size > 16384 ? size : 16384;
        b = malloc(sizeof *b + cap);
        if (!b) {
            fprintf(stderr, "template: out of memory (%zu bytes)\n", cap);
            abort();
        }
        b->cap = cap;
        b->used = 0;
        b->next = a->head;
        a->head = b;
    }
    void *p = b->data + b->used;
    b->used += size;
    memset(p, 0, size);
    return p;
}

char *tpl_arena_strndup(struct arena *a, const char *s, size_t n)
{
    char *d = tpl_arena_alloc(a, n + 1);
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

void tpl_arena_free(struct arena *a)
{
    while (a->head) {
        struct arena_block *next = a->head->next;
        free(a->head);
        a->head = next;
    }
}

/* --- buffers --- */

int sbuf_add(struct sbuf *b, const char *s, size_t n)
{
    if (n > b->max - b->n)
        return -1;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            fprintf(stderr, "template: out of memory (%zu bytes)\n", cap);
            abort();
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

int sbuf_addc(struct sbuf *b, char c)
{
    return sbuf_add(b, &c, 1);
}

int sbuf_printf(struct sbuf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp)
        return -1;
    return sbuf_add(b, tmp, (size_t)n);
}

void sbuf_free(struct sbuf *b)
{
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
}

/* --- values --- */

void val_drop(struct val *v)
{
    if (v->kind == V_JSON)
        json_decref(v->j);
    *v = val_undef();
}

struct val val_copy(const struct val *v)
{
    struct val c = *v;
    if (c.kind == V_JSON)
        json_incref(c.j);
    return c;
}

bool val_truthy(const struct val *v)
{
    if (v->kind == V_UNDEF)
        return false;
    if (v->kind != V_JSON)
        return true;
    const json_t *j = v->j;
    switch (json_typeof(j)) {
    case JSON_NULL:
    case JSON_FALSE: return false;
    case JSON_TRUE: return true;
    case JSON_INTEGER: return json_integer_value(j) != 0;
    case JSON_REAL: return json_real_value(j) != 0.0;
    case JSON_STRING: return json_string_length(j) > 0;
    case JSON_ARRAY: return json_array_size(j) > 0;
    case JSON_OBJECT: return json_object_size(j) > 0;
    }
    return false;
}

bool val_is_string(const struct val *v)
{
    return v->kind == V_JSON && json_is_string(v->j);
}

bool val_is_number(const struct val *v)
{
    return v->kind == V_JSON && json_is_number(v->j);
}

/* --- printing --- */

void fmt_float(char *out, size_t len, double d)
{
    if (isnan(d)) {
        snprintf(out, len, "nan");
        return;
    }
    if (isinf(d)) {
        snprintf(out, len, d < 0 ? "-inf" : "inf");
        return;
    }
    /* shortest digits that read back as d (Python's repr) */
    char e[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(e, sizeof e, "%.*e", prec - 1, d);
        if (strtod(e, NULL) == d)
            break;
    }
    char *ep = strchr(e, 'e');
    int exp10 = atoi(ep + 1);
    *ep = 0;
    char digits[24];
    size_t nd = 0;
    bool neg = e[0] == '-';
    for (char *c = e; *c; c++)
        if (*c >= '0' && *c <= '9')
            digits[nd++] = *c;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = 0;
    char *o = out;
    size_t left = len;
#define PUT(...)                                                                                   \
    do {                                                                                           \
        int k_ = snprintf(o, left, __VA_ARGS__);                                                   \
        if (k_ < 0 || (size_t)k_ >= left)                                                          \
            return;                                                                                \
        o += k_;                                                                                   \
        left -= (size_t)k_;                                                                        \
    } while (0)
    if (neg)
        PUT("-");
    if (exp10 >= 16 || exp10 < -4) {
        PUT("%c", digits[0]);
        if (nd > 1)
            PUT(".%s", digits + 1);
        PUT("e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    } else if (exp10 < 0) {
        PUT("0.");
        for (int i = 0; i < -exp10 - 1; i++)
            PUT("0");
        PUT("%s", digits);
    } else {
        for (int i = 0; i <= exp10; i++)
            PUT("%c", (size_t)i < nd ? digits[i] : '0');
        PUT(".");
        if ((size_t)exp10 + 1 < nd)
            PUT("%s", digits + exp10 + 1);
        else
            PUT("0");
    }
#undef PUT
}

/* Python's repr of a string: single quotes unless it has ' and no " */
static int repr_string(struct sbuf *b, const char *s, size_t n)
{
    char q = memchr(s, '\'', n) && !memchr(s, '"', n) ? '"' : '\'';
    int rc = sbuf_addc(b, q);
    for (size_t i = 0; i < n && rc == 0; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\\' || c == (unsigned char)q) {
            char e[2] = {'\\', (char)c};
            rc = sbuf_add(b, e, 2);
        } else if (c == '\n') {
            rc = sbuf_add(b, "\\n", 2);
        } else if (c == '\r') {
            rc = sbuf_add(b, "\\r", 2);
        } else if (c == '\t') {
            rc = sbuf_add(b, "\\t", 2);
        } else if (c < 0x20 || c == 0x7f) {
            rc = sbuf_printf(b, "\\x%02x", c);
        } else {
            rc = sbuf_addc(b, (char)c);
        }
    }
    return rc ? rc : sbuf_addc(b, q);
}

int json_str(struct sbuf *b, const json_t *j, bool repr)
{
    char num[48];
    switch (json_typeof(j)) {
    case JSON_NULL: return sbuf_add(b, "None", 4);
    case JSON_TRUE: return sbuf_add(b, "True", 4);
    case JSON_FALSE: return sbuf_add(b, "False", 5);
    case JSON_INTEGER: return sbuf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(j));
    case JSON_REAL:
        fmt_float(num, sizeof num, json_real_value(j));
        return sbuf_add(b, num, strlen(num));
    case JSON_STRING:
        if (repr)
            return repr_string(b, json_string_value(j), json_string_length(j));
        return sbuf_add(b, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        int rc = sbuf_addc(b, '[');
        for (size_t i = 0; i < json_array_size(j) && rc == 0; i++) {
            if (i)
                rc = sbuf_add(b, ", ", 2);
            if (rc == 0)
                rc = json_str(b, json_array_get(j, i), true);
        }
        return rc ? rc : sbuf_addc(b, ']');
    }
    case JSON_OBJECT: {
        int rc = sbuf_addc(b, '{');
        const char *k;
        json_t *v;
        bool first = true;
        json_object_foreach((json_t *)j, k, v)
        {
            if (rc == 0 && !first)
                rc = sbuf_add(b, ", ", 2);
            first = false;
            if (rc == 0)
                rc = repr_string(b, k, strlen(k));
            if (rc == 0)
                rc = sbuf_add(b, ": ", 2);
            if (rc == 0)
                rc = json_str(b, v, true);
        }
        return rc ? rc : sbuf_addc(b, '}');
    }
    }
    return -1;
}

int val_str(struct sbuf *b, const struct val *v)
{
    switch (v->kind) {
    case V_UNDEF: return 0;
    case V_JSON: return json_str(b, v->j, false);
    case V_MACRO: return sbuf_printf(b, "<macro %s>", v->macro->name);
    case V_FUNC: return sbuf_add(b, "<function>", 10);
    case V_LOOP: return sbuf_add(b, "<LoopContext>", 13);
    }
    return -1;
}

static int dump_string(struct sbuf *b, const char *s, size_t n)
{
    int rc = sbuf_addc(b, '"');
    for (size_t i = 0; i < n && rc == 0; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': rc = sbuf_add(b, "\\\"", 2); break;
        case '\\': rc = sbuf_add(b, "\\\\", 2); break;
        case '\n': rc = sbuf_add(b, "\\n", 2); break;
        case '\r': rc = sbuf_add(b, "\\r", 2); break;
        case '\t': rc = sbuf_add(b, "\\t", 2); break;
        case '\b': rc = sbuf_add(b, "\\b", 2); break;
        case '\f': rc = sbuf_add(b, "\\f", 2); break;
        default:
            rc = c < 0x20 ? sbuf_printf(b, "\\u%04x", c) : sbuf_addc(b, (char)c);
        }
    }
    return rc ? rc : sbuf_addc(b, '"');
}

static int newline_indent(struct sbuf *b, int indent, int level)
{
    int rc = sbuf_addc(b, '\n');
    for (int i = 0; i < indent * level && rc == 0; i++)
        rc = sbuf_addc(b, ' ');
    return rc;
}

static int key_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int json_dump_py(struct sbuf *b, const json_t *j, int indent, bool sort, int level)
{
    char num[48];
    const char *item_sep = indent >= 0 ? "," : ", ";
    switch (json_typeof(j)) {
    case JSON_NULL: return sbuf_add(b, "null", 4);
    case JSON_TRUE: return sbuf_add(b, "true", 4);
    case JSON_FALSE: return sbuf_add(b, "false", 5);
    case JSON_INTEGER: return sbuf_printf(b, "%" JSON_INTEGER_FORMAT, json_integer_value(j));
    case JSON_REAL:
        if (isnan(json_real_value(j)))
            return sbuf_add(b, "NaN", 3);
        if (isinf(json_real_value(j)))
            return sbuf_add(b, json_real_value(j) < 0 ? "-Infinity" : "Infinity",
                            json_real_value(j) < 0 ? 9 : 8);
        fmt_float(num, sizeof num, json_real_value(j));
        return sbuf_add(b, num, strlen(num));
    case JSON_STRING: return dump_string(b, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        if (n == 0)
            return sbuf_add(b, "[]", 2);
        int rc = sbuf_addc(b, '[');
        for (size_t i = 0; i < n && rc == 0; i++) {
            if (i)
                rc = sbuf_add(b, item_sep, strlen(item_sep));
            if (rc == 0 && indent >= 0)
                rc = newline_indent(b, indent, level + 1);
            if (rc == 0)
                rc = json_dump_py(b, json_array_get(j, i), indent, sort, level + 1);
        }
        if (rc == 0 && indent >= 0)
            rc = newline_indent(b, indent, level);
        return rc ? rc : sbuf_addc(b, ']');
    }
    case JSON_OBJECT: {
        size_t n = json_object_size(j);
        if (n == 0)
            return sbuf_add(b, "{}", 2);
        const char **keys = malloc(n * sizeof *keys);
        if (!keys)
            abort();
        size_t k = 0;
        const char *key;
        json_t *v;
        json_object_foreach((json_t *)j, key, v) keys[k++] = key;
        if (sort)
            qsort(keys, n, sizeof *keys, key_cmp);
        int rc = sbuf_addc(b, '{');
        for (size_t i = 0; i < n && rc == 0; i++) {
            if (i)
                rc = sbuf_add(b, item_sep, strlen(item_sep));
            if (rc == 0 && indent >= 0)
                rc = newline_indent(b, indent, level + 1);
            if (rc == 0)
                rc = dump_string(b, keys[i], strlen(keys[i]));
            if (rc == 0)
                rc = sbuf_add(b, ": ", 2);
            if (rc == 0)
                rc = json_dump_py(b, json_object_get(j, keys[i]), indent, sort, level + 1);
        }
        free(keys);
        if (rc == 0 && indent >= 0)
            rc = newline_indent(b, indent, level);
        return rc ? rc : sbuf_addc(b, '}');
    }
    }
    return -1;
}

/* --- equality and order --- */

static bool num_of(const json_t *j, double *d, long long *i, bool *is_int)
{
    switch (json_typeof(j)) {
    case JSON_TRUE: *i = 1; *is_int = true; break;
    case JSON_FALSE: *i = 0; *is_int = true; break;
    case JSON_INTEGER: *i = json_integer_value(j); *is_int = true; break;
    case JSON_REAL: *d = json_real_value(j); *is_int = false; return true;
    default: return false;
    }
    *d = (double)*i;
    return true;
}

bool json_equal_py(const json_t *a, const json_t *b)
{
    double da, db;
    long long ia, ib;
    bool inta, intb;
    if (num_of(a, &da, &ia, &inta) && num_of(b, &db, &ib, &intb))
        return inta && intb ? ia == ib : da == db;
    if (json_typeof(a) != json_typeof(b))
        return false;
    switch (json_typeof(a)) {
    case JSON_NULL: return true;
    case JSON_STRING:
        return json_string_length(a) == json_string_length(b) &&
               memcmp(json_string_value(a), json_string_value(b), json_string_length(a)) == 0;
    case JSON_ARRAY:
        if (json_array_size(a) != json_array_size(b))
            return false;
        for (size_t i = 0; i < json_array_size(a); i++)
            if (!json_equal_py(json_array_get(a, i), json_array_get(b, i)))
                return false;
        return true;
    case JSON_OBJECT: {
        if (json_object_size(a) != json_object_size(b))
            return false;
        const char *k;
        json_t *v;
        json_object_foreach((json_t *)a, k, v)
        {
            json_t *w = json_object_get(b, k);
            if (!w || !json_equal_py(v, w))
                return false;
        }
        return true;
    }
    default: return false;
    }
}

bool val_equal(const struct val *a, const struct val *b)
{
    if (a->kind != b->kind)
        return false;
    switch (a->kind) {
    case V_UNDEF: return true;
    case V_JSON: return json_equal_py(a->j, b->j);
    case V_MACRO: return a->macro == b->macro;
    case V_FUNC: return a->fn == b->fn;
    case V_LOOP: return a->loop == b->loop;
    }
    return false;
}

int json_compare_py(const json_t *a, const json_t *b, int *cmp)
{
    double da, db;
    long long ia, ib;
    bool inta, intb;
    if (num_of(a, &da, &ia, &inta) && num_of(b, &db, &ib, &intb)) {
        if (inta && intb)
            *cmp = ia < ib ? -1 : ia > ib;
        else
            *cmp = da < db ? -1 : da > db;
        return 0;
    }
    if (json_is_string(a) && json_is_string(b)) {
        size_t na = json_string_length(a), nb = json_string_length(b);
        int c = memcmp(json_string_value(a), json_string_value(b), na < nb ? na : nb);
        *cmp = c < 0 ? -1 : c > 0 ? 1 : na < nb ? -1 : na > nb;
        return 0;
    }
    if (json_is_array(a) && json_is_array(b)) {
        size_t na = json_array_size(a), nb = json_array_size(b);
        for (size_t i = 0; i < na && i < nb; i++) {
            json_t *x = json_array_get(a, i), *y = json_array_get(b, i);
            if (json_equal_py(x, y))
                continue;
            return json_compare_py(x, y, cmp);
        }
        *cmp = na < nb ? -1 : na > nb;
        return 0;
    }
    return -1;
}

/* --- UTF-8 --- */

size_t utf8_len(const char *s, size_t n)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

size_t utf8_offset(const char *s, size_t n, size_t i)
{
    size_t pos = 0;
    while (pos < n && i > 0) {
        pos++;
        while (pos < n && ((unsigned char)s[pos] & 0xC0) == 0x80)
            pos++;
        i--;
    }
    return pos;
}
