/*
 * logprobs.c - the log-probabilities a completion reports per token.
 *
 * Reported for the logits the step computed anyway: before the sampler
 * changes them, engine_lp_prepare copies them, takes their log-sum-exp in double
 * (as kvd eval scores a token, so both give the same numbers) and picks the
 * most likely tokens with a min-heap of n_top entries: O(n_vocab log n_top)
 * per token, no allocation. After sampling, engine_lp_make turns the sampled token
 * and the heap into the event's engine_logprob (one allocation).
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

int engine_lp_init(struct engine_lp *lp, int n_top, int n_vocab)
{
    /* (the loop thread has bounded n_top_logprobs by the vocabulary) */
    lp->n_top = n_top < n_vocab ? n_top : n_vocab;
    if (lp->n_top < 0)
        lp->n_top = 0;
    lp->raw = malloc(sizeof(float) * (size_t)n_vocab);
    lp->top = malloc(sizeof(int32_t) * (size_t)(lp->n_top + 1));
    return lp->raw && lp->top ? 0 : -ENOMEM;
}

void engine_lp_free(struct engine_lp *lp)
{
    free(lp->raw);
    free(lp->top);
    lp->raw = NULL;
    lp->top = NULL;
}

/* Whether token a ranks above token b: the larger logit, then the lower id. */
static inline bool ranks_above(const float *x, int32_t a, int32_t b)
{
    return x[a] > x[b] || (x[a] == x[b] && a < b);
}

/* Restore the min-heap (the lowest-ranked token at h[0]) below node i. */
static void heap_down(const float *x, int32_t *h, int n, int i)
{
    for (;;) {
        int l = 2 * i + 1, low = i;
        if (l < n && ranks_above(x, h[low], h[l]))
            low = l;
        if (l + 1 < n && ranks_above(x, h[low], h[l + 1]))
            low = l + 1;
        if (low == i)
            return;
        int32_t t = h[i];
        h[i] = h[low];
        h[low] = t;
        i = low;
    }
}

void engine_lp_prepare(struct engine_lp *lp, const float *logits, int n_vocab)
{
    const int nv = n_vocab, k = lp->n_top;
    float *x = lp->raw;
    memcpy(x, logits, sizeof(float) * (size_t)nv);
    /* log-sum-exp, shifted by the max */
    float max = x[0];
    for (int i = 1; i < nv; i++)
        if (x[i] > max)
            max = x[i];
    double sum = 0;
    for (int i = 0; i < nv; i++)
        sum += exp((double)x[i] - max);
    lp->raw_lse = (double)max + log(sum);
    /* top k: a min-heap of the best seen so far, then sorted in place
     * (popping the lowest to the end leaves the best first) */
    int32_t *h = lp->top;
    int n = 0;
    for (int32_t i = 0; i < nv && k > 0; i++) {
        if (n < k) {
            h[n++] = i;
            for (int c = n - 1; c > 0 && ranks_above(x, h[(c - 1) / 2], h[c]); c = (c - 1) / 2) {
                int32_t t = h[c];
                h[c] = h[(c - 1) / 2];
                h[(c - 1) / 2] = t;
            }
        } else if (ranks_above(x, i, h[0])) {
            h[0] = i;
            heap_down(x, h, n, 0);
        }
    }
    for (int m = n; m > 1; m--) {
        int32_t t = h[0];
        h[0] = h[m - 1];
        h[m - 1] = t;
        heap_down(x, h, m - 1, 0);
    }
}

struct engine_logprob *engine_lp_make(const struct engine_lp *st, int32_t tok, const char *piece,
                                      size_t n)
{
    int k = st->n_top;
    struct engine_logprob *lp =
        malloc(sizeof(*lp) + (sizeof(double) + sizeof(int32_t)) * (size_t)k + n + 1);
    if (!lp)
        return NULL;
    lp->top_logprobs = (double *)(lp + 1);
    lp->top_ids = (int32_t *)(lp->top_logprobs + k);
    lp->piece = (char *)(lp->top_ids + k);
    lp->token = tok;
    lp->logprob = (double)st->raw[tok] - st->raw_lse;
    lp->n_top = k;
    for (int i = 0; i < k; i++) {
        lp->top_ids[i] = st->top[i];
        lp->top_logprobs[i] = (double)st->raw[st->top[i]] - st->raw_lse;
    }
    if (n)
        memcpy(lp->piece, piece, n);
    lp->piece[n] = '\0';
    lp->piece_len = n;
    return lp;
}
