/*
 * pins.c - a request's pinned spans: llama.cpp's n_keep and kvd's keep
 * ranges, joined with what its session already pins, checked against the
 * budget before the request does any work (cache/pins.c keeps them).
 *
 * Coordinates. A request states its pins in prompt token indices: n_keep
 * pins [0, n_keep) (-1: the whole prompt), each keep range [start, end)
 * (end excluded, within the prompt). A session's prompt is the whole
 * conversation and is matched against the session's history from index 0,
 * so prompt index i is history index i: the pins a session holds are in
 * the same coordinates, and they stay in force for every later request
 * whose prompt repeats the tokens they cover. The pins of a later request
 * are added to them. Where a later prompt departs from the history, the
 * session's pins past the departure are dropped with the tokens they
 * covered (the history is truncated there).
 */
#include <stdio.h>
#include <string.h>

#include "engine/engine_internal.h"

int engine_history_match(const kv_seq *seq, const struct engine_req *req)
{
    const int32_t *h;
    int n_h = kv_seq_history(seq, &h), n = 0;
    while (n < n_h && n < req->n_prompt && h[n] == req->prompt[n])
        n++;
    return n;
}

int engine_pins_plan(const engine *e, const struct engine_req *req, const kv_seq *sess,
                     struct kv_span *out, char *err, size_t errlen)
{
    struct kv_span v[KV_MAX_PINS + ENGINE_MAX_KEEP + 1];
    int n = 0;
    if (sess) { /* the session's pins over the history this prompt repeats */
        int match = engine_history_match(sess, req);
        const struct kv_span *sp;
        int ns = kv_seq_pins(sess, &sp);
        for (int i = 0; i < ns && sp[i].start < match; i++)
            v[n++] = (struct kv_span){sp[i].start, sp[i].end < match ? sp[i].end : match};
    }
    if (req->n_keep != 0)
        v[n++] = (struct kv_span){0, req->n_keep < 0 ? req->n_prompt : req->n_keep};
    for (int i = 0; i < req->n_keep_ranges; i++) {
        const struct kv_span *k = &req->keep[i];
        if (k->end > req->n_prompt) {
            snprintf(err, errlen,
                     "keep range %d is [%d, %d), past the prompt's %d tokens: keep ranges are "
                     "prompt token indices, end excluded",
                     i, k->start, k->end, req->n_prompt);
            return -1;
        }
        v[n++] = *k;
    }
    n = kv_spans_normalize(v, n, err, errlen);
    if (n < 0)
        return -1;
    struct kv_policy eff;
    if (kv_pins_fit(&e->lim.policy, e->p.page_tokens, v, n, &eff, err, errlen) != 0)
        return -1;
    memcpy(out, v, sizeof(*v) * (size_t)n);
    return n;
}
