/*
 * sessions.h - the engine's session table (sessions.c): session ids to
 * their sequences, engine thread only.
 *
 * A session is a named sequence kept between requests. Which idle session
 * goes first, at max_sessions or under pool pressure, is the cache's one
 * LRU order (kv_seq_lru_before); when, is the engine's: max_sessions at
 * creation and the idle timeout in the sweep.
 */
#ifndef KVD_SERVER_SESSIONS_H
#define KVD_SERVER_SESSIONS_H

#include <stdint.h>

#include "cache/kv_cache.h"
#include "server/scheduler.h"

struct run; /* the engine's (scheduler.c) */

struct srv_session {
    char *id;
    kv_seq *seq;
    struct run *busy; /* the run using it, or NULL */
    int64_t last_used_unix_ms;
    struct srv_session *next; /* hash chain */
};

/* An open hash table, grown by doubling (caller-provided storage). */
struct srv_sessions {
    struct srv_session **buckets;
    int n_buckets;
    int n; /* sessions */
};

void srv_sessions_init(struct srv_sessions *t);
/* Remove every session (their sequences are destroyed). */
void srv_sessions_deinit(struct srv_sessions *t);

struct srv_session *srv_sessions_find(const struct srv_sessions *t, const char *id);
/*
 * A new session with an empty sequence under `policy`. At max_sessions the
 * least recently used idle session is dropped first (logged). Returns NULL
 * with the reason in err when every session is busy or the cache cannot
 * create the sequence.
 */
struct srv_session *srv_sessions_create(struct srv_sessions *t, kv_cache *cache,
                                        const struct kv_policy *policy, int max_sessions,
                                        const char *id, char *err, size_t errlen);
/* Unlink x and destroy its sequence. */
void srv_sessions_remove(struct srv_sessions *t, struct srv_session *x);
/* Free sessions idle (untouched) for idle_ms or longer, never busy ones;
 * idle_ms 0 = never. */
void srv_sessions_sweep(struct srv_sessions *t, uint64_t now_ms, uint64_t idle_ms);
/* Every session follows `policy` from its next eviction (a reload). */
void srv_sessions_set_policy(struct srv_sessions *t, const struct kv_policy *policy);
/* What GET /v1/sessions/{id} reports. */
void srv_session_describe(const struct srv_session *x, struct srv_session_info *out);

#endif /* KVD_SERVER_SESSIONS_H */
