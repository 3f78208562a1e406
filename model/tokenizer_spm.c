/*
 * tokenizer_spm.c - SentencePiece-style encoding by best-score merges, as
 * llama.cpp's llm_tokenizer_spm does it.
 *
 * The text (spaces already written as "▁") starts as one symbol per UTF-8
 * character, in a doubly linked list. Every adjacent pair whose joined text
 * is a token goes into a priority queue keyed by that token's score (ties:
 * the leftmost pair first). Popping the best pair merges its right symbol
 * into the left one and offers the two new neighbour pairs. Queue entries
 * made stale by an earlier merge are recognised by their size: a pair is
 * live only while its two symbols still exist and still add up to the
 * length it was queued with. Each merge costs O(log n), so a text of n
 * characters encodes in O(n log n).
 *
 * A final symbol that is not a token (only a single character can be one:
 * merges always make tokens) falls back to one byte token per byte, or to
 * <unk> when the vocabulary has no byte tokens.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer_internal.h"

struct sym {
    int32_t prev, next; /* neighbours in the list, -1 at the ends */
    uint32_t start, n;  /* bytes of the escaped text; n = 0 once merged away */
};

struct bigram {
    float score;         /* score of the joined token */
    int32_t left, right; /* symbols */
    uint32_t size;       /* bytes of the pair when queued */
};

struct heap {
    struct bigram *a;
    size_t n, cap;
};

/* Pops the best first: higher score, then smaller left index. */
static bool better(const struct bigram *x, const struct bigram *y)
{
    return x->score > y->score || (x->score == y->score && x->left < y->left);
}

static int heap_push(struct heap *h, struct bigram b)
{
    if (h->n == h->cap) {
        size_t cap = h->cap ? h->cap * 2 : 64;
        struct bigram *a = realloc(h->a, sizeof *a * cap);
        if (!a)
            return -ENOMEM;
        h->a = a;
        h->cap = cap;
    }
    size_t i = h->n++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!better(&b, &h->a[p]))
            break;
        h->a[i] = h->a[p];
        i = p;
    }
    h->a[i] = b;
    return 0;
}

static struct bigram heap_pop(struct heap *h)
{
    struct bigram top = h->a[0], last = h->a[--h->n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && better(&h->a[c + 1], &h->a[c]))
            c++;
        if (!better(&h->a[c], &last))
            break;
        h->a[i] = h->a[c];
        i = c;
    }
    if (h->n > 0)
        h->a[i] = last;
    return top;
}

/* Queue the pair (left, right) if their joined text is a token. */
static int try_pair(const tok_vocab *v, const char *buf, const struct sym *sy, int32_t left,
                    int32_t right, struct heap *h)
{
    if (left < 0 || right < 0)
        return 0;
    uint32_t size = sy[left].n + sy[right].n;
    int32_t id = tok_lookup(v, buf + sy[left].start, size);
    if (id < 0)
        return 0;
    return heap_push(h, (struct bigram){v->score[id], left, right, size});
}

/* Output one final symbol: its token, else its bytes, else <unk>. */
static int emit(const tok_vocab *v, const char *s, size_t n, struct tok_out *o)
{
    int32_t id = tok_lookup(v, s, n);
    if (id >= 0) {
        tok_out_push(o, id);
        return 0;
    }
    bool bytes = true;
    for (size_t i = 0; i < n; i++)
        bytes = bytes && v->byte_id[(unsigned char)s[i]] >= 0;
    if (bytes) {
        for (size_t i = 0; i < n; i++)
            tok_out_push(o, v->byte_id[(unsigned char)s[i]]);
        return 0;
    }
    if (v->unk < 0)
        return -EILSEQ;
    tok_out_push(o, v->unk);
    return 0;
}

int tok_spm_encode(const tok_vocab *v, const char *text, size_t len, bool space_prefix,
                   struct tok_out *out)
{
    /* Escape: optional leading "▁", every ' ' -> "▁" (3 bytes). */
    size_t spaces = 0;
    for (size_t i = 0; i < len; i++)
        spaces += text[i] == ' ';
    size_t blen = len + 2 * spaces + (space_prefix ? 3 : 0);
    if (blen == 0)
        return 0;
    char *buf = malloc(blen);
    struct sym *sy = malloc(sizeof *sy * blen);
    struct heap h = {0};
    int rc = -ENOMEM;
    if (!buf || !sy)
        goto out_free;
    size_t b = 0;
    if (space_prefix) {
        memcpy(buf, "\xe2\x96\x81", 3);
        b = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(buf + b, "\xe2\x96\x81", 3);
            b += 3;
        } else {
            buf[b++] = text[i];
        }
    }

    /* One symbol per UTF-8 character. A lead byte without its continuation
     * bytes is a symbol of its own (llama.cpp would take the next bytes
     * along, and could swallow part of a "▁" that way). */
    int32_t ns = 0;
    for (size_t i = 0; i < blen;) {
        size_t cl = tok_utf8_len((unsigned char)buf[i]);
        if (cl > blen - i)
            cl = blen - i;
        for (size_t k = 1; k < cl; k++)
            if (((unsigned char)buf[i + k] & 0xC0) != 0x80) {
                cl = 1;
                break;
            }
        sy[ns] = (struct sym){ns - 1, ns + 1, (uint32_t)i, (uint32_t)cl};
        ns++;
        i += cl;
    }
    sy[ns - 1].next = -1;

    for (int32_t i = 1; i < ns; i++)
        if ((rc = try_pair(v, buf, sy, i - 1, i, &h)) < 0)
            goto out_free;

    /* Merge the best pair until none is left. */
    while (h.n > 0) {
        struct bigram bg = heap_pop(&h);
        struct sym *l = &sy[bg.left], *r = &sy[bg.right];
        if (l->n == 0 || r->n == 0 || l->n + r->n != bg.size)
            continue; /* stale */
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            sy[r->next].prev = bg.left;
        if ((rc = try_pair(v, buf, sy, l->prev, bg.left, &h)) < 0 ||
            (rc = try_pair(v, buf, sy, bg.left, l->next, &h)) < 0)
            goto out_free;
    }

    rc = 0;
    for (int32_t i = 0; i >= 0 && rc == 0; i = sy[i].next)
        rc = emit(v, buf + sy[i].start, sy[i].n, out);

out_free:
    free(h.a);
    free(sy);
    free(buf);
    return rc;
}
