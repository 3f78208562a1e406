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
