/*
 * chat_turns.c - a chat prompt as tokens with the spans of its turns.
 *
 * The template room cuts a conversation's rendering where its turns begin
 * and end and checks that the template renders each piece the same alone
 * as in the whole (tpl_chat_turns). Text cuts are not yet token cuts: a
 * tokenizer may merge across a cut, and SentencePiece puts a space before
 * the start of a text. So each piece is tokenized as what it is, the head
 * as the start of a prompt and the rest as continuations, and the pieces'
 * tokens must add up to the tokens of the whole rendering. When they do,
 * the prompt's turns are exact token spans, and a cache holding the head,
 * some of the turns and the tail holds the tokens of exactly those
 * messages' rendering; when they do not, the caller renders again instead
 * of pretending.
 */
#include "server/chat_turns.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tokens of text[0..len) appended to *ids (grown; *cap its room): the start
 * of a prompt when first, else a continuation. Returns the count or < 0. */
static int tokenize_piece(const model *m, const char *text, size_t len, bool first, int32_t **ids,
                          int *n, int *cap)
{
    int k = first ? model_tokenize_special(m, text, len, model_add_bos(m), NULL, 0)
                  : model_tokenize_continuation(m, text, len, NULL, 0);
    if (k < 0)
        return k;
    if (*n + k > *cap) {
        int c = (*n + k) * 2;
        int32_t *v = realloc(*ids, sizeof(int32_t) * (size_t)c);
        if (!v)
            return -1;
        *ids = v;
        *cap = c;
    }
    int got = first ? model_tokenize_special(m, text, len, model_add_bos(m), *ids + *n, k)
                    : model_tokenize_continuation(m, text, len, *ids + *n, k);
    if (got != k)
        return -1;
    *n += k;
    return k;
}

int srv_chat_turns_tokenize(const model *m, const struct tpl_turns *t, struct srv_chat_turns *out,
                            char *why, size_t whylen)
{
    memset(out, 0, sizeof *out);
    int32_t *ids = NULL, *whole = NULL;
    int n = 0, cap = 0, rc = -1;
    struct kv_turn *turns = t->n_turns ? calloc((size_t)t->n_turns, sizeof(*turns)) : NULL;
    if (t->n_turns && !turns)
        goto out;
    size_t at = 0;
    for (int i = 0; i <= t->n_turns + 1; i++) { /* head, turns, tail */
        size_t end = i == 0 ? t->head_len : i <= t->n_turns ? t->turn_end[i - 1] : t->len;
        int start = n;
        if (end > at || i == 0) {
            if (tokenize_piece(m, t->text + at, end - at, i == 0, &ids, &n, &cap) < 0)
                goto out;
        }
        if (i >= 1 && i <= t->n_turns) {
            if (n == start) {
                snprintf(why, whylen, "turn %d renders to no tokens", i);
                rc = 1;
                goto out;
            }
            turns[i - 1] = (struct kv_turn){.hist_start = start, .n_tokens = n - start,
                                            .n_messages = t->turn_messages[i - 1]};
        }
        at = end;
    }
    int k = model_tokenize_special(m, t->text, t->len, model_add_bos(m), NULL, 0);
    if (k < 0 || !(whole = malloc(sizeof(int32_t) * (size_t)(k > 0 ? k : 1))) ||
        model_tokenize_special(m, t->text, t->len, model_add_bos(m), whole, k) != k)
        goto out;
    if (k != n || memcmp(whole, ids, sizeof(int32_t) * (size_t)n) != 0) {
        int d = 0;
        while (d < n && d < k && whole[d] == ids[d])
            d++;
        snprintf(why, whylen,
                 "the turns' tokens are not the conversation's tokens (they part at token %d: "
                 "the tokenizer merges across a turn's edge)",
                 d);
        rc = 1;
        goto out;
    }
    out->ids = ids;
    out->n_ids = n;
    out->turns = turns;
    out->n_turns = t->n_turns;
    ids = NULL;
    turns = NULL;
    rc = 0;
out:
    if (rc < 0)
        snprintf(why, whylen, "the rendered conversation cannot be tokenized");
    free(ids);
    free(whole);
    free(turns);
    return rc;
}

void srv_chat_turns_free(struct srv_chat_turns *x)
{
    if (!x)
        return;
    free(x->ids);
    free(x->turns);
    memset(x, 0, sizeof *x);
}

/* ------------------------------------------------------------------------
 * The prompt of a session under unit = turn
 * ------------------------------------------------------------------------ */

int srv_chat_in_place(const model *m, const tpl_chat *c, const json_t *msgs,
                      const json_t *tools, int drop, time_t now, int budget, int max_prompt,
                      struct srv_chat_in_place *out, char *why, size_t whylen,
                      struct tpl_error *err)
{
    memset(out, 0, sizeof *out);
    struct tpl_turns t;
    int rc = tpl_chat_turns(c, msgs, tools, drop, now, &t, err);
    if (rc < 0)
        goto out;
    if (rc == 1) {
        snprintf(why, whylen, "%s", t.why);
        goto out;
    }
    rc = srv_chat_turns_tokenize(m, &t, &out->p, why, whylen);
    if (rc != 0) {
        if (rc < 0) { /* as a render error: the text cannot be a prompt */
            snprintf(err->msg, sizeof err->msg, "%s", why);
            err->line = err->col = 0;
        }
        goto out;
    }
    out->dropped_messages = t.dropped_messages;
    out->pinned_tokens = out->p.n_ids;
    for (int i = 0; i < out->p.n_turns; i++)
        out->pinned_tokens -= out->p.turns[i].n_tokens;
    if (out->pinned_tokens > budget) {
        rc = 2;
    } else if (out->p.n_ids > max_prompt) {
        snprintf(why, whylen,
                 "the conversation has %d tokens, more than max_prompt_tokens (%d): its oldest "
                 "turns are left out of the rendering",
                 out->p.n_ids, max_prompt);
        rc = 1;
    }
out:
    if (rc != 0)
        srv_chat_turns_free(&out->p);
    tpl_turns_free(&t);
    return rc;
}

/* ------------------------------------------------------------------------
 * A last turn larger than the window
 * ------------------------------------------------------------------------ */

/* The last user message's text as the template sees it (text parts joined
 * with "\n"); new, or NULL when there is none. */
static char *last_user_text(const json_t *msgs)
{
    for (size_t i = json_array_size(msgs); i-- > 0;) {
        const json_t *msg = json_array_get(msgs, i);
        const char *role = json_string_value(json_object_get(msg, "role"));
        if (!role || strcmp(role, "user"))
            continue;
        const json_t *content = json_object_get(msg, "content");
        if (json_is_string(content))
            return strdup(json_string_value(content));
        if (!json_is_array(content))
            return NULL;
        size_t n = 0;
        char *s = NULL;
        for (size_t k = 0; k < json_array_size(content); k++) {
            const char *part = json_string_value(json_object_get(json_array_get(content, k), "text"));
            size_t pl = part ? strlen(part) : 0;
            char *v = realloc(s, n + pl + 2);
            if (!v) {
                free(s);
                return NULL;
            }
            s = v;
            if (k > 0)
                s[n++] = '\n';
            memcpy(s + n, part ? part : "", pl);
            n += pl;
            s[n] = 0;
        }
        return s;
    }
    return NULL;
}

/* The last occurrence of needle[0..nl) in hay[0..hl), or NULL. */
static const char *find_last(const char *hay, size_t hl, const char *needle, size_t nl)
{
    if (nl == 0 || nl > hl)
        return NULL;
    for (size_t i = hl - nl + 1; i-- > 0;)
        if (memcmp(hay + i, needle, nl) == 0)
            return hay + i;
    return NULL;
}

int srv_chat_cut_last_turn(const model *m, const tpl_chat *c, const json_t *msgs,
                           const json_t *tools, time_t now, int budget, int32_t **ids,
                           int *n_ids, int *cut, char *why, size_t whylen, struct tpl_error *err)
{
    *ids = NULL;
    struct tpl_turns t;
    /* every droppable turn out: what is left is pinned */
    if (tpl_chat_turns(c, msgs, tools, (int)json_array_size(msgs), now, &t, err) < 0)
        return -1;
    int rc = -1;
    int32_t *v = NULL;
    char *text = last_user_text(msgs);
    size_t tl = text ? strlen(text) : 0;
    /* the template may trim it */
    const char *s = text;
    while (tl > 0 && (*s == ' ' || *s == '\n' || *s == '\t' || *s == '\r'))
        s++, tl--;
    while (tl > 0 && (s[tl - 1] == ' ' || s[tl - 1] == '\n' || s[tl - 1] == '\t' ||
                      s[tl - 1] == '\r'))
        tl--;
    const char *at = s ? find_last(t.text, t.len, s, tl) : NULL;
    if (!at) {
        snprintf(why, whylen, "the last user message is larger than the window and its text "
                              "is not found in the rendering to cut it");
        goto out;
    }
    size_t a = (size_t)(at - t.text), b = a + tl;
    int n = 0, cap = 0, pre, mid, post;
    if ((pre = tokenize_piece(m, t.text, a, true, &v, &n, &cap)) < 0 ||
        (mid = tokenize_piece(m, t.text + a, tl, false, &v, &n, &cap)) < 0 ||
        (post = tokenize_piece(m, t.text + b, t.len - b, false, &v, &n, &cap)) < 0) {
        snprintf(why, whylen, "the rendered conversation cannot be tokenized");
        goto out;
    }
    if (pre + post >= budget) {
        snprintf(why, whylen,
                 "the prompt needs %d tokens without the last user message's text (the "
                 "system messages, the tools and the turn's header are kept whole); the "
                 "budget is %d",
                 pre + post, budget);
        goto out;
    }
    int keep = budget - pre - post < mid ? budget - pre - post : mid;
    int head = (keep + 1) / 2, tail = keep - head;
    /* [pre | mid head ... mid tail | post]: slide the tail and post down */
    memmove(v + pre + head, v + pre + mid - tail, sizeof(int32_t) * (size_t)(tail + post));
    *n_ids = pre + keep + post;
    *cut = mid - keep;
    *ids = v;
    v = NULL;
    rc = 0;
out:
    free(v);
    free(text);
    tpl_turns_free(&t);
    return rc;
}
