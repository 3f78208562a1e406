/*
 * eval_policy.h - `kvd eval --policy SPEC`: a policy spelled on the command
 * line (eval_policy.c), so every policy the cache has can be measured side
 * by side on the operator's own text.
 */
#ifndef KVD_EVAL_POLICY_H
#define KVD_EVAL_POLICY_H

#include <stddef.h>

#include "cache/kv_cache.h"

/* The grammar, for kvd eval's usage. */
extern const char srv_eval_policy_usage[];

/*
 * Parse SPEC into *out for pages of page_tokens tokens. budget > 0 sets
 * max_cache_tokens (every policy of a comparison at the same budget) and
 * lets WINDOW be 0 = what the budget leaves (kv_policy_budget's room);
 * budget 0 takes the smallest max_cache_tokens the policy accepts. The
 * label is SPEC. Returns 0, or -1 with the reason in err (the grammar, or
 * the cache's kv_policy_check); *out is then unspecified.
 */
int srv_eval_parse_policy(const char *spec, int page_tokens, int budget, struct kv_policy *out,
                          char *err, size_t errlen);

#endif /* KVD_EVAL_POLICY_H */
