/*
 * builtins_internal.h - shared by the files that implement builtins
 * (builtins.c, strings.c, filters.c): the table row type and the argument
 * helpers. Internal to the template room.
 */
#ifndef KVD_TEMPLATE_BUILTINS_INTERNAL_H
#define KVD_TEMPLATE_BUILTINS_INTERNAL_H

#include <string.h>

#include "template/template_internal.h"

typedef int (*builtin_fn)(struct render *r, const struct node *at, const struct val *in,
                          struct args *a, struct val *out);

/* receivers a method applies to */
enum { R_STR = 1, R_DICT = 2, R_LOOP = 4 };

struct builtin {
    enum builtin_kind kind;
    const char *name;
    builtin_fn fn;
    int recv; /* methods: R_* mask */
};

/* --- argument helpers --- */

/* positional argument pos, or the keyword argument kw; NULL when absent */
static inline const struct val *arg(const struct args *a, size_t pos, const char *kw)
{
    size_t k = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw && a->kw[i]) {
            if (kw && !strcmp(a->kw[i], kw))
                return &a->v[i];
        } else if (k++ == pos) {
            return &a->v[i];
        }
    }
    return NULL;
}

static inline int str_arg(struct render *r, const struct node *at, const struct val *v,
                   const char *what, const char **s, size_t *n)
{
    *s = "";
    *n = 0;
    if (!val_is_string(v))
        return rfail(r, at, "%s must be a string", what);
    *s = json_string_value(v->j);
    *n = json_string_length(v->j);
    return 0;
}

static inline bool int_arg(const struct val *v, long long *out)
{
    if (!v || v->kind != V_JSON || !json_is_integer(v->j))
        return false;
    *out = json_integer_value(v->j);
    return true;
}

static inline int need_str(struct render *r, const struct node *at, const struct val *in,
                    const char *name, const char **s, size_t *n)
{
    *s = "";
    *n = 0;
    if (!val_is_string(in))
        return rfail(r, at, "'%s' needs a string", name);
    *s = json_string_value(in->j);
    *n = json_string_length(in->j);
    return 0;
}

static inline struct val make_str(const char *s, size_t n)
{
    return val_json(json_stringn_nocheck(n ? s : "", n));
}

static inline struct val from_sbuf(struct sbuf *b)
{
    struct val v = make_str(b->p, b->n);
    sbuf_free(b);
    return v;
}

/* Python's str.isspace for ASCII */
static inline bool py_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

/* Finish a string built in b: the new string in out when rc is 0, else
 * b freed and the limit error. */
static inline int sbuf_result(struct render *r, const struct node *at, struct sbuf *b, int rc,
                              struct val *out)
{
    if (rc < 0) {
        sbuf_free(b);
        return rfail(r, at, "string longer than the limit of %zu bytes", rmax_string(r));
    }
    *out = from_sbuf(b);
    return 0;
}

/* str() of each item of items (of its attribute when attribute is not
 * NULL) joined with sep: a new string in out (strings.c). */
int tpl_join(struct render *r, const struct node *at, const json_t *items, const char *sep,
             size_t ns, const char *attribute, struct val *out);

/* Each file's rows; a builtin's index counts through strings.c's rows,
 * then filters.c's, then builtins.c's (tests and functions). */
extern const struct builtin tpl_string_builtins[];
extern const size_t tpl_n_string_builtins;
extern const struct builtin tpl_data_builtins[];
extern const size_t tpl_n_data_builtins;

#endif
