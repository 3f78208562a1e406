/*
 * scheduler.h - the engine thread of `kvd serve` (scheduler.c): the
 * engine (engine/engine.h) on a thread of its own, requests crossing to it
 * from the loop thread through an inbox, events crossing back through an
 * outbox. Requests and events are the engine's types (struct engine_req,
 * struct engine_event); the loop thread fills a request completely before
 * srv_sched_submit and frees it after its final event.
 */
#ifndef KVD_SERVER_SCHEDULER_H
#define KVD_SERVER_SCHEDULER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/engine.h"
#include "server/metrics.h"

typedef struct srv_sched srv_sched;

struct srv_sched_params {
    struct model_params model;
    model *loaded;       /* NULL, or the model already loaded from `model` (kvd serve
                            loads it once, to check the memory rule): the engine
                            takes it (srv_sched_create frees it on failure) and
                            does not load it again */
    size_t cache_memory; /* bytes of KV pages */
    int page_tokens;
    enum kv_type k_type, v_type; /* element types of K and V */
    bool mlock;
    bool prefix_cache;      /* share the pages of equal prompt prefixes */
    int prefix_cache_share; /* percent of the pool idle cached pages may keep */
    int n_threads;       /* compute threads of a step (0 = default, cpu/pool.h) */
    int max_step_tokens; /* forward capacity (>= limits.step_tokens) */
    struct engine_limits limits;
    const char *spill_dir;    /* [sessions] dir (borrowed; "" = none) */
    uint64_t spill_max_bytes; /* [sessions] max_disk */
    /* Called (from the engine thread) when the event queue goes from
     * empty to non-empty: wakes the loop (uv_async_send). */
    void (*notify)(void *ud);
    void *notify_ud;
};

/*
 * Create the engine thread's state (validating the params; NULL with the
 * reason in err). Once started, its thread loads the model and creates the
 * engine, then posts ENGINE_EV_READY (or ENGINE_EV_FATAL).
 */
srv_sched *srv_sched_create(const struct srv_sched_params *p, char *err, size_t errlen);
/* Start the engine thread; it records into metrics (may be NULL).
 * Returns 0, or a negative errno with the reason in err. */
int srv_sched_start(srv_sched *s, srv_metrics *metrics, char *err, size_t errlen);
/* Stop the engine (requests still inside end with ABORT) and free it,
 * with any events not yet taken. */
void srv_sched_destroy(srv_sched *s);
/* Queue a request (ownership stays with the caller; see struct engine_req).
 * Returns 0, -EAGAIN when the queue is full, -ESHUTDOWN when stopping.
 * Session requests are never refused for a full queue. */
int srv_sched_submit(srv_sched *s, struct engine_req *r);
/* Move out every pending event, oldest first (caller frees each). */
struct engine_event *srv_sched_take_events(srv_sched *s);
/* The loaded model (after ENGINE_EV_READY; immutable, safe to read from the
 * loop thread for tokenizing), else NULL. */
const model *srv_sched_model(srv_sched *s);
/* Swap the limits for the next step. Returns 0, or -EINVAL with the reason
 * in err (nothing changed). */
int srv_sched_set_limits(srv_sched *s, const struct engine_limits *l, char *err, size_t errlen);
/* Wake the engine for a request whose `paused` was just cleared. */
void srv_sched_wake(srv_sched *s);
/* How long (ms) the engine thread has been in its current step since its
 * last heartbeat; 0 while it waits for work. Thread-safe (atomics). */
uint64_t srv_sched_busy_ms(srv_sched *s);
/* Requests waiting for admission (for Retry-After and tests). */
int srv_sched_queue_depth(srv_sched *s);

#endif /* KVD_SERVER_SCHEDULER_H */
