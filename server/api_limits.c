/*
 * api_limits.c - what a request is checked against, taken from the API's
 * params and the loaded model at the moment it arrives (a reload changes
 * them between requests, never during one), and the seed a request that
 * names none samples with.
 */
#include <stdint.h>

#include "server/api_internal.h"

uint64_t srv_api_next_seed(srv_api *a)
{
    /* splitmix64 over a state seeded from the clock at start */
    uint64_t z = (a->seed_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (z ^ (z >> 31)) >> 1; /* 63 bits: prints as a positive JSON integer */
}

void srv_api_limits(srv_api *a, struct srv_api_limits *lim)
{
    *lim = (struct srv_api_limits){
        .n_vocab = a->info.n_vocab,
        .max_prompt_tokens = a->p.max_prompt_tokens,
        .max_tokens = a->p.max_tokens,
        .default_max_tokens = a->p.default_max_tokens,
        .max_choices = a->p.max_choices,
        .max_session_id = a->p.max_session_id,
        .policy = a->p.policy,
        .page_tokens = a->p.page_tokens,
        .chat_turns = a->p.chat_turns,
        .max_token_bytes = a->max_token_bytes,
        .chat_unavailable = a->chat ? NULL : a->chat_err,
        .seed = srv_api_next_seed(a),
    };
}
