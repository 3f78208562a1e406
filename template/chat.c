/*
 * chat.c - rendering a conversation with a model's chat template.
 *
 * The raw render is the template's business; this file does what servers
 * do around it so that clients see the behaviour they rely on:
 *
 *   - The variables are the ones transformers' apply_chat_template passes:
 *     messages, tools (None when absent), documents (None), bos_token,
 *     eos_token and add_generation_prompt.
 *   - Content given as an array of {"type": "text", "text": ...} parts is
 *     joined with "\n" before the template sees it: most templates index
 *     content as a string. Other part types (images, audio) are refused.
 *   - OpenAI's "developer" role is rendered as "system", the role every
 *     template knows.
 *   - Some templates have no system role: they raise on it (Gemma,
 *     Mistral v0.2) or silently skip it (Phi-3 mini, Orion). Whether a
 *     template prints a system message is found once, at load, by
 *     rendering a probe conversation and looking for the probe text: never
 *     by the template's name. For such a template, the system messages'
 *     text is prepended to the next user message with "\n" between, which
 *     is what llama.cpp's server and most clients do.
 *   - A rendering that starts with the BOS text loses it when the
 *     tokenizer adds BOS itself, or the prompt would start with two.
 *   - Generation must stop where the template ends an assistant turn. The
 *     marker is found by a probe too: what the template writes right after
 *     an assistant message's text.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template_internal.h"

const char tpl_chatml_source[] =
    "{%- for message in messages -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + "
    "'<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}\n";

struct tpl_chat {
    tpl_template *t;
    char *bos, *eos;
    bool strip_bos;
    bool supports_system;
    char *eot; /* the marker the template puts after an assistant turn; "" = none */
};

#define PROBE_SYSTEM "kvd-probe-system-7f3a"
#define PROBE_USER "kvd-probe-user-7f3a"
#define PROBE_ASSISTANT "kvd-probe-assistant-7f3a"

static int chat_fail(struct tpl_error *err, const char *fmt, const char *detail)
{
    memset(err, 0, sizeof *err);
    snprintf(err->msg, sizeof err->msg, fmt, detail);
    return -1;
}

/* content -> string: strings and null as they are, text parts joined */
static int flatten_content(json_t *msg, size_t index, struct tpl_error *err)
{
    json_t *c = json_object_get(msg, "content");
    if (!c || json_is_string(c) || json_is_null(c))
        return 0;
    char what[64];
    snprintf(what, sizeof what, "messages[%zu].content", index);
    if (!json_is_array(c))
        return chat_fail(err, "%s must be a string, null or an array of text parts", what);
    struct sbuf b = {.max = (size_t)-1};
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *part = json_array_get(c, i);
        const char *type = json_string_value(json_object_get(part, "type"));
        json_t *text = json_object_get(part, "text");
        if (!type || strcmp(type, "text") != 0 || !json_is_string(text)) {
            sbuf_free(&b);
            snprintf(what, sizeof what, "messages[%zu].content[%zu]", index, i);
            return chat_fail(err, "%s: only parts {\"type\": \"text\", \"text\": STRING} are "
                                  "supported",
                             what);
        }
        if (i)
            sbuf_addc(&b, '\n');
        sbuf_add(&b, json_string_value(text), json_string_length(text));
    }
    json_object_set_new(msg, "content", json_stringn_nocheck(b.p ? b.p : "", b.n));
    sbuf_free(&b);
    return 0;
}

static const char *content_of(const json_t *msg)
{
    const char *s = json_string_value(json_object_get(msg, "content"));
    return s ? s : "";
}

/* New array: messages as the template will see them. */
static json_t *prepare(const struct tpl_chat *c, const json_t *messages,
                       struct tpl_error *err)
{
    if (!json_is_array(messages)) {
        chat_fail(err, "%s must be an array", "messages");
        return NULL;
    }
    json_t *out = json_array();
    struct sbuf pending = {.max = (size_t)-1}; /* system text waiting for a user turn */
    bool have_pending = false;
    for (size_t i = 0; i < json_array_size(messages); i++) {
        json_t *m = json_array_get(messages, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!json_is_object(m) || !role) {
            char what[48];
            snprintf(what, sizeof what, "messages[%zu]", i);
            chat_fail(err, "%s must be an object with a string \"role\"", what);
            goto fail;
        }
        json_t *copy = json_copy(m);
        if (flatten_content(copy, i, err) < 0) {
            json_decref(copy);
            goto fail;
        }
        bool is_system = !strcmp(role, "system") || !strcmp(role, "developer");
        if (is_system)
            json_object_set_new(copy, "role", json_string("system"));
        if (is_system && !c->supports_system) {
            if (have_pending)
                sbuf_addc(&pending, '\n');
            sbuf_add(&pending, content_of(copy), strlen(content_of(copy)));
            have_pending = true;
            json_decref(copy);
            continue;
        }
        if (have_pending && !strcmp(role, "user")) {
            const char *u = content_of(copy);
            if (*u) {
                sbuf_addc(&pending, '\n');
                sbuf_add(&pending, u, strlen(u));
            }
            json_object_set_new(copy, "content",
                                json_stringn_nocheck(pending.p ? pending.p : "", pending.n));
            pending.n = 0;
            have_pending = false;
        }
        json_array_append_new(out, copy);
    }
    if (have_pending) /* system text and no user turn after it: give it one */
        json_array_append_new(out, json_pack("{s:s,s:s%}", "role", "user", "content",
                                             pending.p ? pending.p : "", pending.n));
    sbuf_free(&pending);
    return out;
fail:
    sbuf_free(&pending);
    json_decref(out);
    return NULL;
}

static int render_raw(const struct tpl_chat *c, json_t *messages, const json_t *tools,
                      bool add_generation_prompt, time_t now, char **out, size_t *out_len,
                      struct tpl_error *err)
{
    json_t *ctx = json_pack("{s:O,s:O,s:n,s:s,s:s,s:b}", "messages", messages, "tools",
                            tools ? (json_t *)tools : json_null(), "documents", "bos_token",
                            c->bos, "eos_token", c->eos, "add_generation_prompt",
                            add_generation_prompt);
    if (!ctx)
        return chat_fail(err, "%s", "out of memory building the template context");
    int rc = tpl_render(c->t, ctx, now, out, out_len, err);
    json_decref(ctx);
    return rc;
}

static bool probe_system(struct tpl_chat *c)
{
    json_t *msgs = json_pack("[{s:s,s:s},{s:s,s:s}]", "role", "system", "content", PROBE_SYSTEM,
                             "role", "user", "content", PROBE_USER);
    char *out = NULL;
    size_t n = 0;
    struct tpl_error err;
    bool ok = render_raw(c, msgs, NULL, true, 0, &out, &n, &err) == 0 &&
              strstr(out, PROBE_SYSTEM) != NULL;
    free(out);
    json_decref(msgs);
    return ok;
}

/*
 * The end-of-turn marker: render user, assistant, user and look at what
 * follows the assistant's text. Past spaces and newlines, a marker in angle
 * brackets ("<|im_end|>", "<end_of_turn>", "</s>", "<|eot_id|>") is the
 * end of the turn; anything else (a template that closes turns with plain
 * text, or one that fails on the probe) gives none. New string.
 */
static char *probe_end_of_turn(struct tpl_chat *c)
{
    json_t *msgs = json_pack("[{s:s,s:s},{s:s,s:s},{s:s,s:s}]", "role", "user", "content",
                             PROBE_USER, "role", "assistant", "content", PROBE_ASSISTANT, "role",
                             "user", "content", PROBE_USER);
    char *out = NULL, *eot = NULL;
    size_t n = 0;
    struct tpl_error err;
    if (render_raw(c, msgs, NULL, false, 0, &out, &n, &err) == 0) {
        const char *p = strstr(out, PROBE_ASSISTANT);
        if (p) {
            p += strlen(PROBE_ASSISTANT);
            while (*p == ' ' || *p == '\n')
                p++;
            const char *close = *p == '<' ? strchr(p, '>') : NULL;
            if (close && !memchr(p, '\n', (size_t)(close - p)))
                eot = strndup(p, (size_t)(close - p + 1));
        }
    }
    free(out);
    json_decref(msgs);
    return eot ? eot : strdup("");
}

tpl_chat *tpl_chat_create(const char *src, size_t len, const struct tpl_chat_params *p,
                          struct tpl_error *err)
{
    tpl_template *t = tpl_load(src, len, &p->limits, err);
    if (!t)
        return NULL;
    struct tpl_chat *c = calloc(1, sizeof *c);
    if (!c)
        abort();
    c->t = t;
    c->bos = strdup(p->bos_token ? p->bos_token : "");
    c->eos = strdup(p->eos_token ? p->eos_token : "");
    if (!c->bos || !c->eos)
        abort();
    c->strip_bos = p->strip_bos;
    c->supports_system = probe_system(c);
    c->eot = probe_end_of_turn(c);
    if (!c->eot)
        abort();
    return c;
}

void tpl_chat_destroy(tpl_chat *c)
{
    if (!c)
        return;
    tpl_free(c->t);
    free(c->bos);
    free(c->eos);
    free(c->eot);
    free(c);
}

bool tpl_chat_supports_system(const tpl_chat *c)
{
    return c->supports_system;
}

const char *tpl_chat_end_of_turn(const tpl_chat *c)
{
    return c->eot;
}

int tpl_chat_render(const tpl_chat *c, const json_t *messages, const json_t *tools,
                    bool add_generation_prompt, time_t now, char **out, size_t *out_len,
                    struct tpl_error *err)
{
    struct tpl_error scratch;
    if (!err)
        err = &scratch;
    *out = NULL;
    if (tools && !json_is_array(tools) && !json_is_null(tools))
        return chat_fail(err, "%s must be an array", "tools");
    json_t *msgs = prepare(c, messages, err);
    if (!msgs)
        return -1;
    size_t n = 0;
    int rc = render_raw(c, msgs, tools, add_generation_prompt, now, out, &n, err);
    json_decref(msgs);
    if (rc < 0)
        return -1;
    size_t nb = strlen(c->bos);
    if (c->strip_bos && nb && n >= nb && memcmp(*out, c->bos, nb) == 0) {
        memmove(*out, *out + nb, n - nb + 1);
        n -= nb;
    }
    if (out_len)
        *out_len = n;
    return 0;
}

/* --- turn-aware fitting --- */

bool tpl_chat_is_system(const char *role)
{
    return role && (!strcmp(role, "system") || !strcmp(role, "developer"));
}

int tpl_chat_find_turns(const json_t *msgs, int *starts, int *end)
{
    int n_msgs = (int)json_array_size(msgs), last_user = -1, n = 0;
    for (int i = 0; i < n_msgs; i++) {
        const char *role = json_string_value(json_object_get(json_array_get(msgs, i), "role"));
        if (role && !strcmp(role, "user"))
            last_user = i;
    }
    *end = last_user < 0 ? n_msgs : last_user;
    for (int i = 0; i < *end; i++) {
        const char *role = json_string_value(json_object_get(json_array_get(msgs, i), "role"));
        if (role && !strcmp(role, "user"))
            starts[n++] = i;
    }
    return n;
}

json_t *tpl_chat_without_turns(const json_t *msgs, const int *starts, int n_turns, int end,
                               int d, int *dropped)
{
    json_t *kept = json_array();
    int from = d > 0 ? starts[0] : 0, to = d == 0 ? 0 : d < n_turns ? starts[d] : end;
    *dropped = 0;
    for (int i = 0; i < (int)json_array_size(msgs); i++) {
        json_t *m = json_array_get(msgs, i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (i >= from && i < to && !tpl_chat_is_system(role)) {
            (*dropped)++;
            continue;
        }
        json_array_append(kept, m);
    }
    return kept;
}

struct fit_try {
    const tpl_chat *c;
    const json_t *msgs, *tools;
    bool agp;
    time_t now;
    const int *starts;
    int n_turns, end;
    int (*count)(const char *, size_t, void *);
    void *ctx;
    struct tpl_error *err;
};

/* Render with d turns out: tokens, or -1 (err set). Keeps the text in
 * *text (freed first) when keep is set. */
static int fit_try(const struct fit_try *f, int d, char **text, size_t *len, int *dropped)
{
    json_t *kept = tpl_chat_without_turns(f->msgs, f->starts, f->n_turns, f->end, d, dropped);
    char *out = NULL;
    size_t n = 0;
    int rc = render_raw(f->c, kept, f->tools, f->agp, f->now, &out, &n, f->err);
    json_decref(kept);
    if (rc < 0)
        return -1;
    size_t nb = strlen(f->c->bos);
    if (f->c->strip_bos && nb && n >= nb && memcmp(out, f->c->bos, nb) == 0) {
        memmove(out, out + nb, n - nb + 1);
        n -= nb;
    }
    int tokens = f->count(out, n, f->ctx);
    if (tokens < 0) {
        free(out);
        return chat_fail(f->err, "%s", "counting the prompt's tokens failed");
    }
    free(*text);
    *text = out;
    *len = n;
    return tokens;
}

int tpl_chat_fit(const tpl_chat *c, const json_t *messages, const json_t *tools,
                 bool add_generation_prompt, time_t now, int budget, int low_water, int min_drop,
                 int (*count)(const char *text, size_t len, void *ctx), void *count_ctx,
                 char **out, size_t *out_len, struct tpl_fit *fit, struct tpl_error *err)
{
    struct tpl_error scratch;
    if (!err)
        err = &scratch;
    *out = NULL;
    memset(fit, 0, sizeof *fit);
    if (tools && !json_is_array(tools) && !json_is_null(tools))
        return chat_fail(err, "%s must be an array", "tools");
    json_t *msgs = prepare(c, messages, err);
    if (!msgs)
        return -1;
    int *starts = malloc((json_array_size(msgs) + 1) * sizeof *starts);
    if (!starts)
        abort();
    struct fit_try f = {.c = c, .msgs = msgs, .tools = tools, .agp = add_generation_prompt,
                        .now = now, .starts = starts, .count = count, .ctx = count_ctx,
                        .err = err};
    f.n_turns = tpl_chat_find_turns(msgs, starts, &f.end);
    if (min_drop > f.n_turns)
        min_drop = f.n_turns; /* a shorter conversation than the session's */
    if (min_drop < 0)
        min_drop = 0;
    if (low_water > budget)
        low_water = budget;
    char *text = NULL;
    size_t len = 0;
    int dropped = 0, d = min_drop, rc = -1;
    int tokens = fit_try(&f, d, &text, &len, &dropped);
    if (tokens >= 0 && tokens > budget) {
        /* the smallest d in (min_drop, n_turns] whose prompt fits low_water;
         * the count falls as d grows */
        int lo = min_drop + 1, hi = f.n_turns;
        char *t2 = NULL;
        size_t l2 = 0;
        int all = fit_try(&f, hi, &t2, &l2, &dropped);
        if (all < 0)
            goto out;
        fit->pinned_tokens = all;
        int best = hi, best_tokens = all;
        while (lo < hi) {
            int mid = lo + (hi - lo) / 2, dm;
            char *tm = NULL;
            size_t lm = 0;
            int k = fit_try(&f, mid, &tm, &lm, &dm);
            free(tm);
            if (k < 0) {
                free(t2);
                goto out;
            }
            if (k <= low_water) {
                best = hi = mid;
                best_tokens = k;
            } else {
                lo = mid + 1;
            }
        }
        free(t2);
        d = best;
        tokens = fit_try(&f, d, &text, &len, &dropped);
        if (tokens >= 0 && tokens != best_tokens) {
            chat_fail(err, "%s", "the template rendered differently twice");
            tokens = -1;
        }
        if (tokens >= 0 && tokens > budget) {
            char msg[200];
            snprintf(msg, sizeof msg,
                     "the prompt needs %d tokens with every earlier turn left out (the system "
                     "messages, the tools and the last user turn are kept whole); the budget is "
                     "%d",
                     tokens, budget);
            chat_fail(err, "%s", msg);
            goto out;
        }
    } else if (tokens >= 0 && d == f.n_turns) {
        fit->pinned_tokens = tokens;
    }
    if (tokens < 0)
        goto out;
    fit->dropped_turns = d;
    fit->dropped_messages = dropped;
    fit->prompt_tokens = tokens;
    *out = text;
    text = NULL;
    if (out_len)
        *out_len = len;
    rc = 0;
out:
    free(text);
    free(starts);
    json_decref(msgs);
    return rc;
}
