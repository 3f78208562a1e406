/*
 * sessions.c - the engine's session table: ids to sequences.
 *
 * A request that names a session continues that session's sequence; the
 * table finds it by id (FNV-1a into a power-of-two bucket array that
 * doubles as sessions are added). Sessions leave three ways: DELETE, the
 * idle timeout (the sweep), and max_sessions, where the least recently
 * used idle session makes room for a new one. Recency is the cache's own
 * order (kv_seq_lru_before on the time the engine last touched the
 * sequence), the same order in which the pool drops idle sessions when it
 * runs short of pages: one LRU, owned by the cache. Engine thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

static uint32_t hash_str(const char *s)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (uint8_t)*s) * 16777619u;
    return h;
}

int engine_sessions_init(struct engine_sessions *t, const struct engine_hooks *hooks)
{
    t->n = 0;
    t->n_buckets = 64;
    t->hooks = hooks;
    t->buckets = calloc((size_t)t->n_buckets, sizeof(*t->buckets));
    return t->buckets ? 0 : -ENOMEM;
}

void engine_sessions_deinit(struct engine_sessions *t)
{
    if (!t->buckets)
        return;
    for (int i = 0; i < t->n_buckets; i++)
        while (t->buckets[i])
            engine_sessions_remove(t, t->buckets[i]);
    free(t->buckets);
    t->buckets = NULL;
}

struct engine_session *engine_sessions_find(const struct engine_sessions *t, const char *id)
{
    for (struct engine_session *x = t->buckets[hash_str(id) & (uint32_t)(t->n_buckets - 1)]; x;
         x = x->next)
        if (!strcmp(x->id, id))
            return x;
    return NULL;
}

/* Double the buckets; out of memory, the table stays as it is (longer
 * chains, still correct). */
static void rehash(struct engine_sessions *t)
{
    int nb = t->n_buckets * 2;
    struct engine_session **b = calloc((size_t)nb, sizeof(*b));
    if (!b)
        return;
    for (int i = 0; i < t->n_buckets; i++) {
        struct engine_session *x = t->buckets[i], *next;
        for (; x; x = next) {
            next = x->next;
            uint32_t k = hash_str(x->id) & (uint32_t)(nb - 1);
            x->next = b[k];
            b[k] = x;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = nb;
}

struct engine_session *engine_sessions_create(struct engine_sessions *t, kv_cache *cache,
                                              const struct kv_policy *policy, int max_sessions,
                                              const char *id, char *err, size_t errlen)
{
    /* At the session limit, the least recently used idle session goes. */
    while (t->n >= max_sessions) {
        struct engine_session *lru = NULL;
        for (int i = 0; i < t->n_buckets; i++)
            for (struct engine_session *x = t->buckets[i]; x; x = x->next)
                if (!x->busy && (!lru || kv_seq_lru_before(x->seq, lru->seq)))
                    lru = x;
        if (!lru) {
            snprintf(err, errlen, "all %d sessions (max_sessions) are busy", t->n);
            return NULL;
        }
        engine_log(t->hooks, ENGINE_LOG_INFO, "session %s dropped: max_sessions (%d) reached",
                   lru->id, max_sessions);
        engine_session_save(t, lru, "max_sessions");
        engine_sessions_remove(t, lru);
    }
    kv_seq *seq = kv_seq_create(cache, policy, true, err, errlen);
    if (!seq)
        return NULL;
    if (t->n + 1 > t->n_buckets)
        rehash(t);
    struct engine_session *x = calloc(1, sizeof(*x));
    if (x)
        x->id = strdup(id);
    if (!x || !x->id) {
        free(x);
        kv_seq_destroy(seq);
        snprintf(err, errlen, "out of memory for the session");
        return NULL;
    }
    x->seq = seq;
    uint32_t k = hash_str(id) & (uint32_t)(t->n_buckets - 1);
    x->next = t->buckets[k];
    t->buckets[k] = x;
    t->n++;
    return x;
}

void engine_sessions_remove(struct engine_sessions *t, struct engine_session *x)
{
    struct engine_session **pp = &t->buckets[hash_str(x->id) & (uint32_t)(t->n_buckets - 1)];
    while (*pp != x)
        pp = &(*pp)->next;
    *pp = x->next;
    kv_seq_destroy(x->seq);
    free(x->id);
    free(x);
    t->n--;
}

void engine_sessions_sweep(struct engine_sessions *t, uint64_t now_ms, uint64_t idle_ms)
{
    if (!idle_ms)
        return;
    for (int i = 0; i < t->n_buckets; i++) {
        struct engine_session *x = t->buckets[i], *next;
        for (; x; x = next) {
            next = x->next;
            uint64_t idle = now_ms - kv_seq_last_touch(x->seq);
            if (!x->busy && idle >= idle_ms) {
                engine_log(t->hooks, ENGINE_LOG_INFO, "session %s idle for %" PRIu64 " ms: freed",
                           x->id, idle);
                engine_session_save(t, x, "idle timeout");
                engine_sessions_remove(t, x);
            }
        }
    }
}

void engine_sessions_set_policy(struct engine_sessions *t, const struct kv_policy *policy)
{
    for (int i = 0; i < t->n_buckets; i++)
        for (struct engine_session *x = t->buckets[i]; x; x = x->next)
            kv_seq_set_policy(x->seq, policy);
}

int engine_sessions_idle_pages(const struct engine_sessions *t)
{
    int n = 0;
    for (int i = 0; i < t->n_buckets; i++)
        for (struct engine_session *x = t->buckets[i]; x; x = x->next)
            if (!x->busy)
                n += kv_seq_pool_pages(x->seq);
    return n;
}

void engine_session_describe(const struct engine_session *x, struct engine_session_info *out)
{
    out->found = true;
    out->busy = x->busy != NULL;
    out->dropped = kv_seq_dropped(x->seq);
    out->history_tokens = kv_seq_history(x->seq, NULL);
    out->retained_tokens = kv_seq_n_tokens(x->seq);
    out->renumber = kv_seq_policy(x->seq)->renumber;
    out->last_used_ms = x->last_used_unix_ms;
    out->policy = *kv_seq_policy(x->seq);
    kv_cache *c = kv_seq_cache(x->seq);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    out->k_type = l.k_type;
    out->v_type = l.v_type;
    out->kv_pages = kv_seq_pool_pages(x->seq); /* both page classes (cache/window.c) */
    out->kv_bytes = (uint64_t)out->kv_pages * l.page_bytes;
    const struct kv_span *pins;
    out->n_pins = kv_seq_pins(x->seq, &pins);
    if (out->n_pins > 0)
        memcpy(out->pins, pins, sizeof(*pins) * (size_t)out->n_pins);
}
