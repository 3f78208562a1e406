/*
 * wiring.c - what the program ties together: the operator's config, in
 * config/'s terms, onto the cache's.
 *
 * config/ and cache/ do not know each other (config.h, "hooks"). The
 * eviction budget is the cache's arithmetic, so the config rules reach it
 * through the hook table here, wired by main before anything else runs:
 * `kvd check-config`, `kvd serve` at start and on SIGHUP, and `kvd eval
 * --config` all read one answer. The enum mappings exist only here, each
 * a table indexed by the config value and checked at compile time to
 * cover every value.
 */
#include <stdio.h>

#include "cli/cli_internal.h"

static const enum kv_type kv_types[] = {
    [CFG_KV_F16] = KV_F16,   [CFG_KV_F32] = KV_F32,   [CFG_KV_BF16] = KV_BF16,
    [CFG_KV_Q8_0] = KV_Q8_0, [CFG_KV_Q4_0] = KV_Q4_0,
};
static const enum kv_policy_kind policy_kinds[] = {
    [CFG_EVICT_NONE] = KV_EVICT_NONE,
    [CFG_EVICT_SINK_WINDOW] = KV_EVICT_SINK_WINDOW,
    [CFG_EVICT_H2O] = KV_EVICT_H2O,
    [CFG_EVICT_TOVA] = KV_EVICT_TOVA,
    [CFG_EVICT_KNORM] = KV_EVICT_KNORM,
    [CFG_EVICT_SNAPKV] = KV_EVICT_SNAPKV,
};
_Static_assert(sizeof(kv_types) / sizeof(kv_types[0]) == CFG_KV_TYPE_COUNT,
               "every config KV type maps to a cache KV type");
_Static_assert(sizeof(policy_kinds) / sizeof(policy_kinds[0]) == CFG_EVICT_COUNT,
               "every config eviction policy maps to a cache policy");
_Static_assert(CFG_POS_COUNT == 2, "positions map onto kv_policy.renumber (a bool)");

/* t is an element type proper: cfg_k_type / cfg_v_type resolve CFG_KV_SAME. */
enum kv_type srv_cfg_kv_type(enum cfg_kv_type t)
{
    return (unsigned)t < CFG_KV_TYPE_COUNT ? kv_types[t] : KV_F16;
}

/* The policy with window_tokens as the operator set it (0 = automatic). */
static struct kv_policy policy_as_set(const struct cfg *c)
{
    return (struct kv_policy){
        .kind = policy_kinds[c->eviction.policy],
        .max_cache_tokens = (int)c->eviction.max_cache_tokens,
        .sink_tokens = (int)c->eviction.sink_tokens,
        .window_tokens = (int)c->eviction.window_tokens,
        .heavy_tokens = cfg_policy_scored(c->eviction.policy) ? (int)c->eviction.heavy_tokens : 0,
        .observe_tokens = (int)c->eviction.observe_tokens,
        .pool_tokens = (int)c->eviction.pool_tokens,
        .knorm_smallest = c->eviction.knorm_evict == CFG_KNORM_SMALLEST,
        .renumber = c->eviction.positions == CFG_POS_RENUMBER,
    };
}

void srv_cfg_policy(const struct cfg *c, struct kv_policy *out)
{
    /* cfg_validate has had the cache check this very policy (the hook
     * below); window_tokens = 0 is resolved by the cache's budget. */
    *out = policy_as_set(c);
    if (c->eviction.policy != CFG_EVICT_NONE) {
        out->window_tokens = (int)cfg_window_tokens(c);
        out->window_auto = c->eviction.window_tokens == 0; /* pins may take from it */
    }
}

/* The config hook: the cache's budget terms and its verdict on the policy
 * `kvd serve` would hand it (window resolved). */
static void budget_hook(const struct cfg *c, struct cfg_budget *out)
{
    struct kv_policy p = policy_as_set(c);
    int page = (int)c->cache.page_tokens;
    struct kv_budget b;
    kv_policy_budget(&p, page, &b);
    *out = (struct cfg_budget){
        .kept_tokens = b.kept_tokens,
        .floor_tokens = b.floor_tokens,
        .window_room = b.window_room,
        .window_tokens = b.window_tokens,
        .need_tokens = b.need_tokens,
        .sequence_pages = b.sequence_pages,
    };
    if (p.kind != KV_EVICT_NONE)
        p.window_tokens = (int)b.window_tokens;
    out->verdict = kv_policy_check(&p, page, out->why, sizeof(out->why));
}

const struct cfg_hooks srv_cfg_hooks = {.budget = budget_hook};

uint64_t srv_cfg_window_bytes(const struct cfg *c, const struct kv_cache_params *shape)
{
    if (!shape->layer_window || !kv_cache_token_bytes(shape))
        return 0;
    struct kv_cache_params p = *shape;
    p.page_tokens = (int)c->cache.page_tokens;
    bool any = false;
    for (int l = 0; l < p.n_layer; l++)
        any = any || p.layer_window[l] > 0;
    if (!any)
        return 0;
    struct kv_policy pol;
    srv_cfg_policy(c, &pol);
    int64_t pages = kv_cache_sequence_pages(&p, &pol, (int)c->limits.step_tokens);
    uint64_t bytes = kv_cache_memory_for(&p, pages);
    return bytes ? bytes : UINT64_MAX; /* overflow: more than any memory */
}

void srv_cfg_session_note(const struct cfg *c, const struct kv_cache_params *shape, char *buf,
                          size_t len)
{
    uint64_t w = srv_cfg_window_bytes(c, shape);
    if (!w) {
        snprintf(buf, len, "%s", "");
        return;
    }
    struct kv_policy pol;
    srv_cfg_policy(c, &pol);
    struct kv_budget b;
    kv_policy_budget(&pol, (int)c->cache.page_tokens, &b);
    double dense = (double)kv_cache_token_bytes(shape) * (double)b.sequence_pages *
                   (double)c->cache.page_tokens;
    int n_win = 0, win = 0;
    for (int l = 0; l < shape->n_layer; l++) {
        n_win += shape->layer_window[l] > 0;
        win = shape->layer_window[l] > win ? shape->layer_window[l] : win;
    }
    snprintf(buf, len,
             "one session at max_cache_tokens %d: %.1f MiB with the %d sliding-window layers "
             "(of %d, window %d) keeping only their window, %.1f MiB with every layer keeping "
             "every token (%.1f%% saved)",
             pol.max_cache_tokens, (double)w / (1 << 20), n_win, shape->n_layer, win,
             dense / (1 << 20), dense > 0 ? 100.0 * (dense - (double)w) / dense : 0.0);
}
