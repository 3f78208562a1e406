/*
 * sessions_spill.c - the session table's side of [sessions] dir: when a
 * session goes to disk, when it comes back, and what the session routes
 * see of the sessions on disk.
 *
 * A session leaves memory idle in four ways, and with a directory each one
 * writes it first: the pool's LRU drops it for pages (the cache calls the
 * drop hook before the pages go), max_sessions makes room for a new one,
 * the idle timeout ends it, and the daemon stops (engine_save_sessions
 * after the drain). It comes back when a request names it and it is not
 * in memory (or only its dropped husk is): the file is read into a new
 * session, checked whole, and removed; the request then matches its prompt
 * against the restored history exactly as if the session had never left,
 * so cached_tokens and every token that follows are those of a daemon
 * that never stopped. A file that cannot be used (another model, cut
 * short, corrupted, no room) is a log line and a cache miss.
 *
 * Only idle sessions with a history are written: a running request pins
 * its session, and a husk the pool already dropped (saved then) has
 * nothing left to save over its file. Engine thread only.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "engine/spill.h"

static void on_drop(void *ud, kv_seq *seq)
{
    struct engine_sessions *t = ud;
    for (int i = 0; i < t->n_buckets; i++)
        for (struct engine_session *x = t->buckets[i]; x; x = x->next)
            if (x->seq == seq) {
                engine_session_save(t, x, "the pool needed its pages");
                return;
            }
}

int engine_spill_init(engine *e, const char *dir, uint64_t max_bytes, char *err, size_t errlen)
{
    uint64_t fp = spill_fingerprint(model_fingerprint(e->m), e->p.k_type, e->p.v_type);
    e->sessions.spill = spill_store_create(dir, max_bytes, fp, &e->p.hooks, err, errlen);
    if (!e->sessions.spill)
        return -1;
    kv_cache_set_drop_hook(e->cache, on_drop, &e->sessions);
    engine_log(&e->p.hooks, ENGINE_LOG_INFO,
               "sessions: saved to %s when they leave memory (max_disk %" PRIu64
               " bytes; model fingerprint %016" PRIx64 ")",
               dir, max_bytes, fp);
    if (kv_cache_window(e->cache) > 0) /* spill_write refuses them */
        engine_log(&e->p.hooks, ENGINE_LOG_WARN,
                   "sessions: not saved to disk after all: the model has sliding-window layers, "
                   "which keep per-sequence pages a session file does not hold; a session "
                   "leaving memory is lost (its next request is a cache miss)");
    return 0;
}

void engine_session_save(struct engine_sessions *t, struct engine_session *x, const char *why)
{
    if (!t->spill || x->busy || kv_seq_dropped(x->seq) || kv_seq_history(x->seq, NULL) == 0)
        return;
    char err[512] = "";
    uint64_t t0 = engine_now_ns();
    int rc = spill_store_save(t->spill, x->id, x->seq, x->last_used_unix_ms, err, sizeof(err));
    if (rc) {
        t->spill_stats.save_failed++;
        engine_log(t->hooks, ENGINE_LOG_WARN, "session %s lost: cannot save it (%s): %s", x->id,
                   why, err);
        return;
    }
    struct spill_entry se;
    t->spill_stats.saved++;
    if (spill_store_find(t->spill, x->id, &se))
        t->spill_stats.bytes_saved += se.bytes;
    engine_log(t->hooks, ENGINE_LOG_INFO,
               "session %s saved to disk (%s): %d tokens of a history of %d in %.1f ms", x->id,
               why, kv_seq_n_tokens(x->seq), kv_seq_history(x->seq, NULL),
               (double)(engine_now_ns() - t0) / 1e6);
}

void engine_save_sessions(engine *e)
{
    struct engine_sessions *t = &e->sessions;
    if (!t->spill)
        return;
    for (int i = 0; i < t->n_buckets; i++)
        for (struct engine_session *x = t->buckets[i]; x; x = x->next)
            engine_session_save(t, x, "shutdown");
}

/* Read session x's file into its (new, empty) sequence. */
static void restore(engine *e, struct engine_session *x)
{
    struct engine_sessions *t = &e->sessions;
    struct spill_entry se;
    char err[512] = "";
    uint64_t t0 = engine_now_ns();
    int rc = spill_store_load(t->spill, x->id, x->seq, &se, err, sizeof(err));
    if (rc == -ENOENT)
        return; /* never saved: a new session */
    if (rc) {
        t->spill_stats.refused++;
        engine_log(t->hooks, ENGINE_LOG_WARN,
                   "session %s: its file is refused (%s): starting it afresh (a cache miss)%s",
                   x->id, err, rc == -EBADMSG ? "; the file is removed" : "");
        return;
    }
    x->last_used_unix_ms = se.last_used_ms;
    t->spill_stats.restored++;
    t->spill_stats.bytes_restored += se.bytes;
    engine_log(t->hooks, ENGINE_LOG_INFO,
               "session %s restored from disk: %d tokens of a history of %d, %" PRIu64
               " bytes in %.1f ms",
               x->id, se.n_tokens, se.n_hist, se.bytes, (double)(engine_now_ns() - t0) / 1e6);
}

struct engine_session *engine_session_open(engine *e, const char *id, char *err, size_t errlen)
{
    struct engine_sessions *t = &e->sessions;
    struct engine_session *x = engine_sessions_find(t, id);
    if (x && !(t->spill && kv_seq_dropped(x->seq)))
        return x;
    if (x) /* the pool dropped it (and saved it then): its file is the session now */
        engine_sessions_remove(t, x);
    x = engine_sessions_create(t, e->cache, &e->lim.policy, e->lim.max_sessions, id, err, errlen);
    if (x && t->spill)
        restore(e, x);
    return x;
}

static void describe_entry(const engine *e, const struct spill_entry *se,
                           struct engine_session_info *out)
{
    struct kv_layout l;
    kv_cache_layout(e->cache, &l);
    *out = (struct engine_session_info){
        .found = true,
        .saved = true,
        .history_tokens = se->n_hist,
        .retained_tokens = se->n_tokens,
        .renumber = e->lim.policy.renumber,
        .last_used_ms = se->last_used_ms,
        .policy = e->lim.policy,
        .k_type = l.k_type,
        .v_type = l.v_type,
        .disk_bytes = se->bytes,
    };
}

bool engine_session_describe_saved(engine *e, const char *id, struct engine_session_info *out)
{
    struct spill_entry se;
    if (!e->sessions.spill || !spill_store_find(e->sessions.spill, id, &se))
        return false;
    describe_entry(e, &se, out);
    return true;
}

bool engine_session_forget_saved(engine *e, const char *id)
{
    return e->sessions.spill && spill_store_remove(e->sessions.spill, id) == 0;
}
