/*
 * one_engine.c - the engine of a command that runs one sequence at a time
 * (kvd generate, each pass of kvd eval): the daemon's engine with a pool
 * that holds exactly one sequence at its policy's budget (the cache's own
 * page count, kv_policy_budget), so what the command computes is what one
 * request or session computes in `kvd serve`.
 */
#include <stdio.h>

#include "cli/cli_internal.h"

engine *srv_one_engine(const struct srv_one_engine_params *p, char *err, size_t errlen)
{
    struct kv_cache_params shape = {
        .page_tokens = p->page_tokens, .k_type = p->k_type, .v_type = p->v_type};
    model_kv_shape(p->m, &shape);
    /* the windowed layers' pages beside the main ones (window.c) */
    int64_t pages = kv_cache_sequence_pages(&shape, p->policy, p->step_tokens);
    struct engine_params ep = {
        .m = p->m,
        .cache_memory = kv_cache_memory_for(&shape, pages),
        .page_tokens = shape.page_tokens,
        .k_type = p->k_type,
        .v_type = p->v_type,
        .n_threads = p->n_threads,
        .limits = {.policy = *p->policy,
                   .max_running = 1,
                   .step_tokens = p->step_tokens,
                   .max_sessions = p->session ? 1 : 0},
    };
    return engine_create(&ep, err, errlen);
}
