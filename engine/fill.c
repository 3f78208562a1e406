/*
 * fill.c - a long cache for a decode benchmark without its prefill: once a
 * request's prompt is read, its own K/V rows are repeated until the
 * sequence holds req->fill_tokens tokens (kvd generate --fill).
 *
 * Why. Decode speed at 64k tokens of context is what a long-context server
 * lives on, but reading a real 64k prompt costs tens of minutes on a small
 * machine (attention over a prompt grows with its square), far more than
 * the decode being measured. A decode step reads every K and V row of the
 * sequence whatever they hold: its time depends on how many rows there are
 * and their type, not on their values. So the rows the model wrote for a
 * real prompt of P tokens are copied, in order and again, into new slots
 * until the sequence is fill_tokens long, with positions continuing (keys
 * are stored before rotation, so a copied key at a new position is rotated
 * there like any other) and token ids repeating the prompt's. Every row
 * lives in its own slot of its own page, as after a real prefill: the
 * decode reads fill_tokens rows from memory, never one cached row twice.
 *
 * What it is not. The copies are not what the model would have written for
 * the repeated text (a deeper layer's K/V remember their context), so the
 * text decoded after a fill is not the text a real prompt gives; only its
 * speed is meant to be read. For a one-layer model, whose K and V depend on
 * their token alone, it is the same: test_engine checks that equivalence.
 *
 * Scope. The request must be alone on its sequence and keep every token:
 * no session, one choice, no forked answer, policy none, no prefix cache,
 * no sliding-window layers; anything else is refused with 400, never
 * filled differently.
 */
#include <errno.h>
#include <string.h>

#include "engine/engine_internal.h"

/* Why r cannot be filled, or NULL. */
static const char *fill_refusal(const engine *e, const struct run *r)
{
    const struct engine_req *q = r->req;
    if (q->fill_tokens <= q->n_prompt)
        return "fill_tokens must exceed the prompt's tokens";
    if (r->sess || q->n_choices > 1 || q->fork_answer)
        return "a fill is for a plain request (no session, one choice, no forked answer)";
    if (kv_seq_policy(r->seq)->kind != KV_EVICT_NONE)
        return "a fill needs eviction policy none (every token kept)";
    if (e->prefix)
        return "a fill needs the prefix cache off (its copies must not be shared)";
    if (kv_cache_window(e->cache) > 0)
        return "a fill cannot copy sliding-window layers (their rows leave the window)";
    if (r->n_fed != kv_seq_n_tokens(r->seq))
        return "the prompt is not all in the cache";
    return NULL;
}

/* Copy K and V of token src to token dst, every layer and KV head. */
static void copy_rows(kv_seq *seq, const struct kv_layout *l, int dst, int src)
{
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int h = 0; h < l->n_kv_head; h++) {
            memcpy(kv_seq_k(seq, layer, h, dst), kv_seq_k(seq, layer, h, src), l->k_row_bytes);
            memcpy(kv_seq_v(seq, layer, h, dst), kv_seq_v(seq, layer, h, src), l->v_row_bytes);
        }
}

bool engine_run_fill(engine *e, struct run *r)
{
    const char *why = fill_refusal(e, r);
    if (why) {
        engine_run_fail(e, r, 400, "fill to %d tokens: %s", r->req->fill_tokens, why);
        return false;
    }
    uint64_t t0 = engine_now_ns();
    struct kv_layout l;
    kv_cache_layout(e->cache, &l);
    int n0 = kv_seq_n_tokens(r->seq);
    for (int n = n0; n < r->req->fill_tokens;) {
        /* a copy of the prompt at most per append: its ids are the source's */
        int k = r->req->fill_tokens - n < n0 ? r->req->fill_tokens - n : n0;
        int first = 0, rc = kv_seq_append(r->seq, r->req->prompt, k, &first);
        if (rc) {
            engine_run_fail(e, r, rc == -ENOMEM ? 503 : 400,
                            "fill to %d tokens: the cache holds %d (%s)", r->req->fill_tokens, n,
                            rc == -ENOMEM   ? "the KV pool ran out of pages"
                            : rc == -ENOSPC ? "past the sequence's context"
                                            : "append failed");
            return false;
        }
        for (int i = 0; i < k; i++)
            copy_rows(r->seq, &l, first + i, i);
        n += k;
        r->appended += k;
    }
    r->fill_ns = engine_now_ns() - t0;
    return true;
}
