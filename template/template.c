/*
 * template.c - loading, freeing and the one-call render of a template.
 *
 * tpl_load runs the lexer and the parser once; everything a render needs
 * afterwards (the tree, its names and constants) lives in the template's
 * arena and constant list, so a loaded template is immutable and renders
 * share it freely.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

static void set_limits(struct tpl_limits *l, const struct tpl_limits *in)
{
    *l = in ? *in : (struct tpl_limits){0};
    if (l->max_depth <= 0)
        l->max_depth = TPL_DEFAULT_MAX_DEPTH;
    if (l->max_iterations <= 0)
        l->max_iterations = TPL_DEFAULT_MAX_ITERATIONS;
    if (l->max_output == 0)
        l->max_output = TPL_DEFAULT_MAX_OUTPUT;
}

tpl_template *tpl_load(const char *src, size_t len, const struct tpl_limits *limits,
                       struct tpl_error *err)
{
    struct tpl_error scratch;
    if (!err)
        err = &scratch;
    memset(err, 0, sizeof *err);
    tpl_template *t = calloc(1, sizeof *t);
    if (!t)
        abort();
    set_limits(&t->limits, limits);
    t->consts = json_array();
    struct token_list toks = {0};
    if (tpl_lex(src, len, &t->arena, &toks, err) < 0 || tpl_parse(t, &toks, err) < 0) {
        free(toks.v);
        tpl_free(t);
        return NULL;
    }
    free(toks.v);
    return t;
}

void tpl_free(tpl_template *t)
{
    if (!t)
        return;
    tpl_arena_free(&t->arena);
    json_decref(t->consts);
    free(t);
}

int tpl_render_source(const char *src, size_t len, const json_t *ctx, char **out,
                      size_t *out_len, struct tpl_error *err)
{
    *out = NULL;
    tpl_template *t = tpl_load(src, len, NULL, err);
    if (!t)
        return -1;
    int rc = tpl_render(t, ctx, 0, out, out_len, err);
    tpl_free(t);
    return rc;
}

const char *tpl_error_string(const struct tpl_error *err, char *buf, size_t len)
{
    if (err->line > 0)
        snprintf(buf, len, "%d:%d: %s", err->line, err->col, err->msg);
    else
        snprintf(buf, len, "%s", err->msg);
    return buf;
}
