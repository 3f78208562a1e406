/*
 * model_ctx.c - the context a command tells the model it will run.
 *
 * Phi-3's 128k files carry two LongRoPE tables and the table is chosen once,
 * by the longest sequence the caller will run (model_set_n_ctx: the long
 * one past the file's original context, as llama.cpp chooses by its n_ctx).
 * What that length is depends on the command: `kvd serve` knows only its
 * policy (renumber never numbers past max_cache_tokens; preserve has no
 * bound, so the file's context_length stands), `kvd generate` and `kvd
 * eval` also know how many tokens they will feed. The choice is printed
 * by every command: a model whose rotation depends on the context never
 * picks a table silently.
 */
#include <stdio.h>

#include "cli/cli_internal.h"

int srv_run_positions(const struct kv_policy *p, int64_t n_tokens)
{
    int bound = kv_policy_position_bound(p);
    if (n_tokens <= 0)
        return bound;
    if (n_tokens > INT32_MAX)
        n_tokens = INT32_MAX;
    return bound > 0 && bound < n_tokens ? bound : (int)n_tokens;
}

void srv_rope_note(const struct model_info *info, int n_ctx, char *buf, size_t len)
{
    if (!info->rope_orig_ctx) {
        snprintf(buf, len, "%s", "");
        return;
    }
    if (n_ctx > 0)
        snprintf(buf, len, "LongRoPE %s factors (positions up to %d %s the original context %d)",
                 info->rope_long ? "long" : "short", n_ctx, info->rope_long ? ">" : "<=",
                 info->rope_orig_ctx);
    else
        snprintf(buf, len,
                 "LongRoPE %s factors (positions unbounded: the file's context_length %d %s the "
                 "original context %d)",
                 info->rope_long ? "long" : "short", info->n_ctx_train,
                 info->rope_long ? ">" : "<=", info->rope_orig_ctx);
}
