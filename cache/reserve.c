/*
 * reserve.c - room for one engine step, all or nothing.
 *
 * A step of the engine runs one forward pass over a batch: a prefill chunk
 * or a decode token from each of several sequences. Before the pass can
 * write the K and V of those tokens, each sequence needs slots for them,
 * and getting slots is where everything that can go wrong with the cache
 * goes wrong: the policy may have to evict (or, under policy none, refuse:
 * the context is full), the pool may be short of pages so that idle
 * sessions are dropped whole (LRU, seq.c), and even then it may come up
 * short. kv_reserve does that for the whole batch as one transaction, so
 * that the forward pass only ever writes into slots that exist and
 * computes (model/forward.c), and the engine decides what to do with a
 * refusal in one place.
 *
 * The order: first every sequence is checked against what its policy can
 * make room for (kv_seq_max_append) with nothing changed, so "context
 * full" never costs another sequence anything. Then the sequences append
 * in batch order; an append may drop idle sessions, and a session of this
 * very batch must not be among them (the engine pins running sessions, so
 * this is a guard, reported as -ENOMEM like any pool shortage). On a
 * failure every append this call made is cut back (kv_seq_truncate to the
 * history before), so the batch's sequences hold what they held; what a
 * policy evicted to make room stays evicted, as the next append would
 * have evicted it anyway.
 */
#include "cache_internal.h"

#include <errno.h>

/* Tokens appended to seq so far (its history length), for undoing. */
static int hist_len(const kv_seq *seq)
{
    int n = kv_seq_n_tokens(seq);
    return n > 0 ? kv_seq_hist_index(seq)[n - 1] + 1 : 0;
}

void kv_reserve_undo(struct kv_reservation *r, int n)
{
    for (int i = 0; i < n; i++) {
        if (r[i].made)
            kv_seq_truncate(r[i].seq, r[i].hist0);
        r[i].made = false;
    }
}

int kv_reserve(struct kv_reservation *r, int n, int *failed)
{
    if (!r || n < 1)
        return -EINVAL;
    for (int i = 0; i < n; i++) {
        r[i].made = false;
        if (!r[i].seq || !r[i].tokens || r[i].n_tokens < 1) {
            if (failed)
                *failed = i;
            return -EINVAL;
        }
    }
    /* Context full under the policy: refuse before changing anything. */
    for (int i = 0; i < n; i++) {
        if (r[i].n_tokens > kv_seq_max_append(r[i].seq)) {
            if (failed)
                *failed = i;
            return -ENOSPC;
        }
    }
    for (int i = 0; i < n; i++) {
        r[i].was_dropped = kv_seq_dropped(r[i].seq);
        r[i].hist0 = hist_len(r[i].seq);
    }
    for (int i = 0; i < n; i++) {
        int rc = kv_seq_append(r[i].seq, r[i].tokens, r[i].n_tokens, &r[i].first);
        if (rc) {
            kv_reserve_undo(r, n);
            if (failed)
                *failed = i;
            return rc;
        }
        r[i].made = true;
    }
    /* An append may drop idle sessions for pages; one of this batch would
     * have lost what it just reserved. A sequence dropped before this call
     * is a fresh one again, its flag notwithstanding. */
    for (int i = 0; i < n; i++) {
        if ((kv_seq_dropped(r[i].seq) && !r[i].was_dropped) ||
            kv_seq_n_tokens(r[i].seq) < r[i].first + r[i].n_tokens) {
            kv_reserve_undo(r, n);
            if (failed)
                *failed = i;
            return -ENOMEM;
        }
    }
    return 0;
}
