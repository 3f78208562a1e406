/*
 * cli_internal.h - helpers shared by the subcommands only.
 */
#ifndef KVD_CLI_INTERNAL_H
#define KVD_CLI_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "config/config.h"
#include "engine/engine.h"

/* The operator config mapped onto the cache's terms (wiring.c); shared by
 * `kvd serve` and `kvd eval` so both run exactly the configured policy. */
enum kv_type srv_cfg_kv_type(enum cfg_kv_type t);
void srv_cfg_policy(const struct cfg *c, struct kv_policy *out);

/*
 * The bytes one sequence takes at the config's full budget when the
 * model's sliding-window layers keep only their window (the cache's
 * kv_cache_sequence_pages, appends of limits.step_tokens), for
 * cfg_check_memory; 0 when shape has no windowed layer. shape: the
 * model's (model_kv_shape) with the config's K/V types. srv_cfg_session_note
 * says it beside the bytes with every layer kept, for check-config and
 * the serve start line ("" without windowed layers).
 */
uint64_t srv_cfg_window_bytes(const struct cfg *c, const struct kv_cache_params *shape);
void srv_cfg_session_note(const struct cfg *c, const struct kv_cache_params *shape, char *buf,
                          size_t len);

/*
 * The KV type options of generate and eval: --kv-type T (K and V),
 * --k-type T, --v-type T, T one of f32, f16, bf16, q8_0, q4_0. Same
 * contract as srv_opt_value; a bad type prints what is accepted and sets *bad.
 */
bool srv_opt_kv_types(int argc, char **argv, int *i, const char *cmd, enum kv_type *k_type,
                      enum kv_type *v_type, bool *bad);

/* The effective config with each key's origin as JSON, what `kvd
 * check-config` prints (config_view.c; new string, NULL when memory runs
 * out). The API key's value is never in it. */
char *srv_config_view_json(const struct cfg *c);

/* An engine for one sequence at a time (one_engine.c): a pool that holds
 * one sequence at policy's budget, K/V in the given types, steps of
 * step_tokens, room for one session when `session`. NULL with the reason
 * in err. */
struct srv_one_engine_params {
    const model *m;
    const struct kv_policy *policy;
    int page_tokens;
    enum kv_type k_type, v_type;
    int n_threads;   /* 0 = default */
    int step_tokens; /* prefill chunk (1: one token per step) */
    bool session;    /* the request runs as a session (it outlives the request) */
};
engine *srv_one_engine(const struct srv_one_engine_params *p, char *err, size_t errlen);

/*
 * The context a command tells the model (model_ctx.c). srv_run_positions:
 * the longest position count a run of n_tokens tokens under *p reaches
 * (n_tokens <= 0: unknown, the policy's bound alone; 0 = unbounded), for
 * model_params.n_ctx / model_set_n_ctx. srv_rope_note: the LongRoPE table
 * the model took for n_ctx, as one phrase in buf ("" for a model without
 * the two tables).
 */
int srv_run_positions(const struct kv_policy *p, int64_t n_tokens);
void srv_rope_note(const struct model_info *info, int n_ctx, char *buf, size_t len);

/* The config hooks (wiring.c): main wires them before any subcommand runs,
 * tests that call config/ before they call anything else. */
extern const struct cfg_hooks srv_cfg_hooks;

#endif /* KVD_CLI_INTERNAL_H */
