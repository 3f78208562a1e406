/*
 * chat_turns.c - a conversation's rendering cut at its turns, and the
 * check that the template lets turns be dropped whole.
 *
 * A cache that evicts whole turns in place (cache/turns.c) keeps the
 * tokens of the system prompt, of the turns it keeps and of the last turn,
 * and drops the rest. That is the template's rendering of the kept
 * messages only when the template is *separable* for this conversation:
 * it renders the pinned head (system and developer messages, tools) the
 * same before every turn, and each turn the same whatever came before it.
 * Most templates are (ChatML, Llama 3, Phi-3, Mistral v7, ...). Some are
 * not, by design: Llama 2 folds the system prompt into the first user
 * message, so dropping that turn moves the system text; templates without
 * a system role get it joined to the first user message; Qwen 3 renders
 * the latest assistant message differently from older ones. For those the
 * only way to drop a turn and keep the structure is to render again.
 *
 * So this file does not assume; it renders the head alone, the head with
 * each turn alone, and the head with the last turn and the generation
 * prompt, and checks that together they are the whole rendering, byte for
 * byte, and that the rendering with the first turn left out is the same
 * text without that turn's bytes (the rendering with every turn left out
 * is the head-and-tail render already made). A conversation that fails
 * any of these is answered "not separable", with the reason, and the
 * caller falls back to rendering again. Cost: one render of the head per
 * turn plus three whole renders, so linear in the conversation when the
 * head is short. A long head (tools, a big system prompt) times many turns
 * is not: a request could make a worker render gigabytes. So the head
 * renders are bounded before the first one (TURNS_CHECK_BYTES); beyond it
 * the conversation is answered "not separable", naming the sizes, and the
 * caller renders again (O(log turns) whole renders, each capped).
 */
#include "template_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* New array: msgs[0..head) then msgs[a..b). */
static json_t *slice(const json_t *msgs, int head, int a, int b)
{
    json_t *out = json_array();
    if (!out)
        abort();
    for (int i = 0; i < head; i++)
        json_array_append(out, json_array_get(msgs, (size_t)i));
    for (int i = a; i < b; i++)
        json_array_append(out, json_array_get(msgs, (size_t)i));
    return out;
}

/* Render msgs[0..head) + msgs[a..b) (new string), or NULL with err. */
static char *render_slice(const tpl_chat *c, const json_t *msgs, const json_t *tools, int head,
                          int a, int b, bool agp, time_t now, size_t *len, struct tpl_error *err)
{
    json_t *part = slice(msgs, head, a, b);
    char *text = NULL;
    int rc = tpl_chat_render(c, part, tools, agp, now, &text, len, err);
    json_decref(part);
    return rc < 0 ? NULL : text;
}

/* The most bytes of head the per-turn check may render for one request. */
#define TURNS_CHECK_BYTES ((size_t)64 << 20)

static int not_separable(struct tpl_turns *out, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static int not_separable(struct tpl_turns *out, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->why, sizeof out->why, fmt, ap);
    va_end(ap);
    return 1;
}

/* One piece: the render of head + msgs[a..b) must be head_text followed by
 * exactly the bytes of the whole rendering at *off; *off moves past them. */
struct cut {
    const tpl_chat *c;
    const json_t *msgs, *tools;
    time_t now;
    int head;          /* head messages */
    const char *htext; /* their rendering */
    size_t hlen;
    struct tpl_turns *out;
};

static int piece(const struct cut *k, int a, int b, bool agp, const char *what, int index,
                 size_t *off)
{
    struct tpl_error e;
    size_t len = 0;
    char *t = render_slice(k->c, k->msgs, k->tools, k->head, a, b, agp, k->now, &len, &e);
    if (!t)
        return not_separable(k->out, "%s %d cannot be rendered after the system messages "
                             "alone (%.120s)", what, index, e.msg);
    int rc = 0;
    if (len < k->hlen || memcmp(t, k->htext, k->hlen) != 0)
        rc = not_separable(k->out, "the template renders the system messages differently "
                           "before %s %d (the system prompt is folded into the turns)",
                           what, index);
    else if (*off + (len - k->hlen) > k->out->len ||
             memcmp(k->out->text + *off, t + k->hlen, len - k->hlen) != 0)
        rc = not_separable(k->out, "%s %d renders differently inside the conversation than "
                           "after the system messages alone (at byte %zu)",
                           what, index, *off);
    else
        *off += len - k->hlen;
    free(t);
    return rc;
}

/* The rendering with the first turn left out must be the whole rendering
 * without that turn's bytes. */
static int check_drop_first(const struct cut *k, const int *starts)
{
    struct tpl_error e;
    size_t len = 0;
    json_t *part = slice(k->msgs, k->head, starts[1], (int)json_array_size(k->msgs));
    char *t = NULL;
    int rc = tpl_chat_render(k->c, part, k->tools, true, k->now, &t, &len, &e);
    json_decref(part);
    if (rc < 0)
        return not_separable(k->out, "the conversation without its first turn cannot be "
                             "rendered (%.120s)", e.msg);
    const struct tpl_turns *o = k->out;
    size_t gap = o->turn_end[0] - o->head_len;
    bool same = len + gap == o->len && memcmp(t, o->text, o->head_len) == 0 &&
                memcmp(t + o->head_len, o->text + o->turn_end[0], len - o->head_len) == 0;
    free(t);
    if (!same)
        return not_separable(k->out, "leaving out the first turn changes the rest of the "
                             "rendering");
    return 0;
}

/* Cut the kept conversation (turns found, whole text rendered). */
static int cut_turns(const struct cut *k, const int *starts, int n, int end)
{
    struct tpl_turns *out = k->out;
    int n_msgs = (int)json_array_size(k->msgs);
    for (int i = k->head; i < n_msgs; i++) {
        const char *role = json_string_value(json_object_get(json_array_get(k->msgs, i), "role"));
        if (tpl_chat_is_system(role))
            return not_separable(out, "messages[%d] is a %s message after the first turn", i,
                                 role);
    }
    if (out->len < k->hlen || memcmp(out->text, k->htext, k->hlen) != 0)
        return not_separable(out, "the conversation does not begin with the rendering of its "
                             "system messages alone");
    if (k->hlen > 0 && (size_t)n > TURNS_CHECK_BYTES / k->hlen)
        return not_separable(out, "checking %d turns after a %zu-byte system head would render "
                             "more than %zu bytes", n, k->hlen, TURNS_CHECK_BYTES);
    out->head_len = k->hlen;
    out->turn_end = malloc(sizeof(size_t) * (size_t)n);
    out->turn_messages = malloc(sizeof(int) * (size_t)n);
    if (!out->turn_end || !out->turn_messages)
        abort();
    size_t off = k->hlen;
    for (int i = 0; i < n; i++) {
        int b = i + 1 < n ? starts[i + 1] : end;
        if (piece(k, starts[i], b, false, "turn", i + 1, &off))
            return 1;
        out->turn_end[i] = off;
        out->turn_messages[i] = b - starts[i];
        out->n_turns = i + 1;
    }
    if (piece(k, end, n_msgs, true, "the last turn", 0, &off))
        return 1;
    if (off != out->len)
        return not_separable(out, "the rendering has %zu bytes after the last turn",
                             out->len - off);
    if (n >= 2 && check_drop_first(k, starts))
        return 1;
    return 0;
}

int tpl_chat_turns(const tpl_chat *c, const json_t *messages, const json_t *tools, int drop,
                   time_t now, struct tpl_turns *out, struct tpl_error *err)
{
    struct tpl_error scratch;
    if (!err)
        err = &scratch;
    memset(out, 0, sizeof *out);
    if (!json_is_array(messages)) {
        snprintf(err->msg, sizeof err->msg, "messages must be an array");
        err->line = err->col = 0;
        return -1;
    }
    int *starts = malloc(sizeof(int) * (json_array_size(messages) + 1));
    if (!starts)
        abort();
    int end, n = tpl_chat_find_turns(messages, starts, &end);
    drop = drop < 0 ? 0 : drop > n ? n : drop;
    json_t *kept = tpl_chat_without_turns(messages, starts, n, end, drop, &out->dropped_messages);
    int rc = -1;
    if (tpl_chat_render(c, kept, tools, true, now, &out->text, &out->len, err) < 0)
        goto out;
    rc = 0;
    n = tpl_chat_find_turns(kept, starts, &end);
    if (n == 0) { /* nothing droppable: the whole text is pinned */
        out->head_len = out->len;
        goto out;
    }
    struct cut k = {.c = c, .msgs = kept, .tools = tools, .now = now, .head = starts[0],
                    .out = out};
    struct tpl_error e;
    char *htext = render_slice(c, kept, tools, k.head, 0, 0, false, now, &k.hlen, &e);
    if (!htext && k.head > 0) {
        rc = not_separable(out, "the system messages cannot be rendered alone (%.120s)", e.msg);
        goto out;
    }
    k.htext = htext ? htext : "";
    if (!htext)
        k.hlen = 0; /* a template that needs a message to render: no head */
    rc = cut_turns(&k, starts, n, end);
    free(htext);
out:
    if (rc == 1) {
        free(out->turn_end);
        free(out->turn_messages);
        out->turn_end = NULL;
        out->turn_messages = NULL;
        out->n_turns = 0;
        out->head_len = 0;
    }
    json_decref(kept);
    free(starts);
    return rc;
}

void tpl_turns_free(struct tpl_turns *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->turn_end);
    free(t->turn_messages);
    memset(t, 0, sizeof *t);
}
