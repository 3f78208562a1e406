/*
 * seq_state.c - a session sequence's state out and back in: what saving a
 * session to disk and restoring it need from the cache.
 *
 * A session that continues after a restart must be the same sequence it
 * was: the same history (the prompt matcher compares new prompts with it),
 * the same retained tokens with the same position numbers (the kernel
 * rotates keys from them), the same history indices (truncation and turns
 * work on them), the same scores (h2o's accumulated mass decides the next
 * eviction), the same pinned spans and the same next position.
 * kv_seq_get_state lends all of it; kv_seq_import puts it back into an
 * empty session sequence and leaves the K and V rows to the caller, who
 * writes them through kv_seq_k / kv_seq_v exactly as the forward pass
 * writes new tokens. The rows travel in their
 * stored type, byte for byte, so a restored token is the token that was
 * saved (invariant 1 holds across the restart too).
 *
 * Import takes its pages the way an append does (kv_seq_append: it is
 * one): the pool's free pages, then idle sessions dropped least recently
 * used first, which is where the drop hook comes in: the pool tells the
 * sequence's owner before an idle session's pages go, so the owner can
 * save it instead of losing it. The hook runs inside another sequence's
 * append, after everything was planned; it reads the dropped sequence and
 * must not change the cache.
 *
 * The state comes from outside the process (a file), so import checks it
 * before anything changes: a state that breaks an invariant of seq.c would
 * otherwise give wrong answers later instead of an error now.
 */
#include "cache_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kv_cache_set_drop_hook(kv_cache *c, kv_drop_hook fn, void *ud)
{
    c->drop_hook = fn;
    c->drop_ud = fn ? ud : NULL;
}

void kv_seq_get_state(const kv_seq *s, struct kv_seq_state *out)
{
    *out = (struct kv_seq_state){
        .n_hist = s->session ? s->n_appended : 0,
        .hist = s->session ? s->hist : NULL,
        .n_tokens = s->n_tokens,
        .ids = kv_seq_tokens(s),
        .pos = kv_seq_positions(s),
        .hidx = kv_seq_hist_index(s),
        .mass = kv_seq_mass(s),
        .next_pos = s->next_pos,
        .n_turns = s->n_turns,
        .turns = s->turns,
        .turn_low = s->turn_low,
    };
    out->n_pins = kv_seq_pins(s, &out->pins);
}

/* Fill err and return -EINVAL: kv_seq_import's refusal. */
__attribute__((format(printf, 3, 4))) static int refuse(char *err, size_t errlen,
                                                        const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return -EINVAL;
}

/* The checks of kv_seq_import, before anything changes: 0, or -EINVAL
 * with the first broken rule in err. */
static int check_state(const kv_seq *s, const struct kv_seq_state *st, char *err, size_t errlen)
{
    if (!s->session || s->n_appended != 0 || s->n_tokens != 0)
        return refuse(err, errlen, "import: the sequence is not an empty session");
    if (st->n_hist < 0 || st->n_tokens < 0 || st->n_tokens > st->n_hist)
        return refuse(err, errlen, "import: %d retained tokens of a history of %d",
                      st->n_tokens, st->n_hist);
    if ((st->n_hist > 0 && !st->hist) ||
        (st->n_tokens > 0 && (!st->ids || !st->pos || !st->hidx || !st->mass)))
        return refuse(err, errlen, "import: missing arrays");
    for (int i = 0; i < st->n_tokens; i++) {
        int32_t h = st->hidx[i], p = st->pos[i];
        if (h < 0 || h >= st->n_hist || (i > 0 && h <= st->hidx[i - 1]))
            return refuse(err, errlen,
                          "import: token %d has history index %d (need increasing, < %d)", i, h,
                          st->n_hist);
        if (st->hist[h] != st->ids[i])
            return refuse(err, errlen, "import: token %d is id %d, the history says %d", i,
                          st->ids[i], st->hist[h]);
        if (p < 0 || (i > 0 && p <= st->pos[i - 1]))
            return refuse(err, errlen, "import: token %d has position %d (need increasing, >= 0)",
                          i, p);
        if (!isfinite(st->mass[i]))
            return refuse(err, errlen, "import: token %d has a score that is not finite", i);
    }
    int32_t last = st->n_tokens > 0 ? st->pos[st->n_tokens - 1] : -1;
    if (st->next_pos <= last)
        return refuse(err, errlen, "import: next position %d is not past the last one (%d)",
                      st->next_pos, last);
    return 0;
}

int kv_seq_import(kv_seq *s, const struct kv_seq_state *st, char *err, size_t errlen)
{
    int rc = check_state(s, st, err, errlen);
    if (rc)
        return rc;
    if (st->n_tokens > s->policy.max_cache_tokens) {
        if (err)
            snprintf(err, errlen, "import: %d retained tokens exceed max_cache_tokens = %d",
                     st->n_tokens, s->policy.max_cache_tokens);
        return -ENOSPC;
    }
    /* The pages and the token arrays, as an append makes them (positions,
     * history indices and scores are then overwritten). */
    rc = kv_seq_append(s, st->ids, st->n_tokens, NULL);
    if (rc) {
        if (err)
            snprintf(err, errlen, "import: no room for %d tokens in the pool", st->n_tokens);
        kv_seq_release_all(s);
        return rc == -ENOSPC ? -ENOSPC : -ENOMEM;
    }
    if (st->n_hist > s->h_cap) {
        int32_t *h = realloc(s->hist, sizeof(int32_t) * (size_t)st->n_hist);
        if (!h) {
            if (err)
                snprintf(err, errlen, "import: out of memory for a history of %d", st->n_hist);
            kv_seq_release_all(s);
            return -ENOMEM;
        }
        s->hist = h;
        s->h_cap = st->n_hist;
    }
    if (st->n_hist > 0)
        memcpy(s->hist, st->hist, sizeof(int32_t) * (size_t)st->n_hist);
    size_t n = (size_t)st->n_tokens;
    if (n > 0) {
        memcpy(s->pos + s->t_off, st->pos, sizeof(int32_t) * n);
        memcpy(s->hidx + s->t_off, st->hidx, sizeof(int32_t) * n);
        memcpy(s->mass + s->t_off, st->mass, sizeof(float) * n);
    }
    s->n_appended = st->n_hist;
    s->next_pos = st->next_pos;
    kv_window_sync(s); /* the windowed layers' slots take the positions too */
    rc = kv_seq_set_turns(s, st->turns, st->n_turns, st->turn_low, err, errlen);
    if (rc == 0)
        rc = kv_seq_set_pins(s, st->pins, st->n_pins, err, errlen);
    if (rc) {
        kv_seq_release_all(s);
        return rc;
    }
    return 0;
}
