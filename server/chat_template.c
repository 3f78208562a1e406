/*
 * chat_template.c - which chat template a model is served with.
 *
 * One decision, one owner: the operator's file ([model] chat_template, or
 * `kvd chat-template --template`) wins; otherwise the model's own
 * tokenizer.chat_template; otherwise ChatML, the documented default. The
 * template is loaded (and so checked: an unsupported construct is refused
 * here with its line and column) once, at start, with the model's BOS and
 * EOS texts, and with BOS stripping when the tokenizer adds BOS itself.
 * The source is reported so the operator sees which template is in use.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"
#include "server/chat_template.h"

char *srv_read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (!buf) {
            snprintf(err, errlen, "%s: out of memory", path);
            break;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (ferror(f)) {
            snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
            free(buf);
            buf = NULL;
            break;
        }
        if (n < cap) {
            buf[n] = 0;
            *len = n;
            break;
        }
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb)
            free(buf);
        buf = nb;
    }
    fclose(f);
    return buf;
}

/* A special token's text, "" when the model has none. New string. */
static char *token_text(const model *m, int32_t id)
{
    size_t len = 0;
    const char *s = id >= 0 ? model_token_text(m, id, &len) : NULL;
    return s ? strndup(s, len) : strdup("");
}

tpl_chat *srv_chat_template_load(const model *m, const struct srv_chat_template_opts *o,
                                 char *source, size_t source_len, char *err, size_t errlen)
{
    char *bos = m ? token_text(m, model_bos(m)) : strdup(o->bos_token ? o->bos_token : "");
    char *eos = m ? token_text(m, model_eos(m)) : strdup(o->eos_token ? o->eos_token : "");
    if (o->bos_token) {
        free(bos);
        bos = strdup(o->bos_token);
    }
    if (o->eos_token) {
        free(eos);
        eos = strdup(o->eos_token);
    }
    char *owned = NULL;
    const char *src = NULL, *where = NULL;
    size_t len = 0;
    tpl_chat *c = NULL;
    if (o->path && *o->path) {
        owned = srv_read_file(o->path, &len, err, errlen);
        if (!owned)
            goto out;
        src = owned;
        where = o->path;
        snprintf(source, source_len, "file %s", o->path);
    } else if (m && (src = model_chat_template(m, o->name, &len))) {
        where = o->name ? "tokenizer.chat_template.<name>" : "tokenizer.chat_template";
        snprintf(source, source_len, "the model's %s%s%s", "tokenizer.chat_template",
                 o->name ? "." : "", o->name ? o->name : "");
    } else if (m && o->name) {
        snprintf(err, errlen, "the model has no chat template named '%s' "
                              "(tokenizer.chat_template.%s)", o->name, o->name);
        goto out;
    } else {
        src = tpl_chatml_source;
        len = strlen(src);
        where = "the default ChatML template";
        snprintf(source, source_len, "the default (ChatML: the model carries no template)");
    }
    struct tpl_chat_params p = {.bos_token = bos, .eos_token = eos,
                                .strip_bos = m && model_add_bos(m)};
    struct tpl_error te;
    c = tpl_chat_create(src, len, &p, &te);
    if (!c) {
        char msg[320];
        snprintf(err, errlen, "chat template (%s): %s", where,
                 tpl_error_string(&te, msg, sizeof msg));
    }
out:
    free(owned);
    free(bos);
    free(eos);
    return c;
}
