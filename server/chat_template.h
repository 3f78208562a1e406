/*
 * chat_template.h - the chat template a model is served with
 * (chat_template.c).
 */
#ifndef KVD_SERVER_CHAT_TEMPLATE_H
#define KVD_SERVER_CHAT_TEMPLATE_H

#include <stddef.h>

#include "template/template.h"

/* A whole file (new, NUL-terminated; *len its length), or NULL with the
 * reason (path and errno) in err. */
char *srv_read_file(const char *path, size_t *len, char *err, size_t errlen);

struct model;
struct srv_chat_template_opts {
    const char *path;      /* operator's template file, or NULL/"": the model's */
    const char *name;      /* NULL, or the variant tokenizer.chat_template.NAME */
    const char *bos_token; /* NULL, or the BOS text instead of the model's */
    const char *eos_token; /* NULL, or the EOS text instead of the model's */
};

/*
 * Load the chat template for m (NULL: no model, only o->path or ChatML):
 * the operator's file, else the model's, else ChatML. Writes where it came
 * from into source. Returns a new chat template, or NULL with the reason in
 * err (an unreadable file; a template refused, with line:column).
 */
tpl_chat *srv_chat_template_load(const struct model *m, const struct srv_chat_template_opts *o,
                                 char *source, size_t source_len, char *err, size_t errlen);

#endif /* KVD_SERVER_CHAT_TEMPLATE_H */
