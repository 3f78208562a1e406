/*
 * rules.c - the cross-key rules a configuration must satisfy as a whole,
 * and the values derived from several keys (the automatic window, the
 * per-sequence pages, the K and V types, the memory one sequence needs).
 *
 * Each rule names every key involved, with where its value came from, and
 * is reported at the first key the operator set; a rule whose keys already
 * failed to parse is not checked, so one typo gives one error.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/config_internal.h"

/* --- cross-key rules -------------------------------------------------------------------- */

struct rules {
    const struct cfg *c;
    struct cfg_errors *errs;
    const bool *failed;
    int n_errors;
};

/* "sink_tokens 4 (line 9)", with the origin short since the file is known. */
static void term(const struct cfg *c, int k, char *buf, size_t len)
{
    char v[96], o[64];
    cfg_format_value(c, (enum cfg_key)k, v, sizeof(v));
    if (c->origin[k].kind == CFG_FROM_FILE)
        cfg_fmt(o, sizeof(o), "line %d", c->origin[k].line);
    else
        cfg_format_origin(c, (enum cfg_key)k, o, sizeof(o));
    cfg_fmt(buf, len, "%s %s (%s)", cfg_keys[k].name, cfg_keys[k].secret ? "(hidden)" : v, o);
}

/* True if any of the n keys had its value rejected: the rule is not checked. */
static bool skip_rule(const struct rules *r, const int *ks, int n)
{
    for (int i = 0; i < n; i++)
        if (r->failed && r->failed[ks[i]])
            return true;
    return false;
}

/*
 * Report a violation at the first of the n keys that the operator set
 * (file or command line), or at the first key if all are defaults:
 * "SOURCE:LINE: [section] key = value: MESSAGE".
 */
__attribute__((format(printf, 4, 5))) static void violation(struct rules *r, const int *ks, int n,
                                                            const char *format, ...)
{
    int k = ks[0];
    for (int i = 0; i < n; i++) {
        if (r->c->origin[ks[i]].kind != CFG_FROM_DEFAULT) {
            k = ks[i];
            break;
        }
    }
    char msg[320], v[96], key[96];
    va_list ap;
    va_start(ap, format);
    vsnprintf(msg, sizeof(msg), format, ap);
    va_end(ap);
    cfg_format_value(r->c, (enum cfg_key)k, v, sizeof(v));
    cfg_fmt(key, sizeof(key), "%s.%s", cfg_keys[k].section, cfg_keys[k].name);
    const struct cfg_origin *o = &r->c->origin[k];
    const char *source = o->kind == CFG_FROM_FILE      ? r->c->file
                         : o->kind == CFG_FROM_CMDLINE ? "command line"
                                                       : "defaults";
    cfg_add_error(r->errs, source, o->line, key, "[%s] %s = %s: %s", cfg_keys[k].section,
                  cfg_keys[k].name, cfg_keys[k].secret ? "(hidden)" : v, msg);
    r->n_errors++;
}

/*
 * The eviction budget is the cache's (kv_policy_budget, reached through the
 * hook the program wires: see config.h). The rules below compare its terms
 * with the keys and word each violation at the keys and lines involved:
 *
 *   kept + one page <= max_cache_tokens        (floor_tokens)
 *   kept + window + one page <= max_cache_tokens (need_tokens)
 *
 * Config asks a little more than the cache: the window, explicit or
 * automatic, is at least one page, and a scored policy (h2o, tova, knorm,
 * snapkv) keeps at least one heavy token.
 * Should the cache refuse a policy these rules let through, its own reason
 * is reported, so a config that passes here is one the cache accepts.
 */
static const struct cfg_hooks *hooks;

void cfg_set_hooks(const struct cfg_hooks *h)
{
    hooks = h;
}

/* The hook's budget for c; without a hook, verdict -ENOSYS and no terms. */
static void budget_of(const struct cfg *c, struct cfg_budget *b)
{
    if (hooks && hooks->budget) {
        hooks->budget(c, b);
        return;
    }
    *b = (struct cfg_budget){.window_tokens = c->eviction.window_tokens, .verdict = -ENOSYS};
    cfg_fmt(b->why, sizeof(b->why), "no eviction budget hook is wired (cfg_set_hooks)");
}

/* The kept tokens in words: "sink_tokens 4 (line 9) as whole pages (16)",
 * "sink_tokens 48 (line 9)", or "sink_tokens 4 (line 9) + heavy_tokens 64 (line 10)"
 * (in parentheses when `group`, for a subtraction). */
static void kept_words(const struct cfg *c, int64_t kept, bool group, char *buf, size_t len)
{
    char ts[128], th[128];
    term(c, CFG_EVICTION_SINK_TOKENS, ts, sizeof(ts));
    term(c, CFG_EVICTION_HEAVY_TOKENS, th, sizeof(th));
    if (cfg_policy_scored(c->eviction.policy))
        cfg_fmt(buf, len, group ? "(%s + %s)" : "%s + %s", ts, th);
    else if (kept != c->eviction.sink_tokens)
        cfg_fmt(buf, len, "%s as whole pages (%" PRId64 ")", ts, kept);
    else
        cfg_fmt(buf, len, "%s", ts);
}

/*
 * The cache's word on the policy in effect, when the rules above found
 * nothing: they state its formula, so this fires only if the two ever
 * drift apart, and then the operator still gets an error, not a server
 * that refuses to start (or a reload refused after check-config passed).
 */
static void cache_verdict(struct rules *r, const struct cfg_budget *b, int n_before)
{
    const int kp[] = {CFG_EVICTION_POLICY, CFG_EVICTION_MAX_CACHE_TOKENS};
    if (r->n_errors == n_before && b->verdict != 0 && !skip_rule(r, kp, 2))
        violation(r, kp, 2, "the cache refuses this policy: %s", b->why);
}

static void rules_eviction(struct rules *r)
{
    const struct cfg *c = r->c;
    if (c->eviction.policy == CFG_EVICT_NONE)
        return;
    bool scored = cfg_policy_scored(c->eviction.policy);
    int64_t max = c->eviction.max_cache_tokens, page = c->cache.page_tokens;
    int64_t window = c->eviction.window_tokens;
    struct cfg_budget b;
    budget_of(c, &b);
    if (b.verdict == -ENOSYS) {
        const int kp[] = {CFG_EVICTION_POLICY};
        violation(r, kp, 1, "%s", b.why);
        return;
    }
    int n_before = r->n_errors;
    char tk[300], tkg[304], tp[128], tm[128], tw[128];
    kept_words(c, b.kept_tokens, false, tk, sizeof(tk));
    kept_words(c, b.kept_tokens, true, tkg, sizeof(tkg));
    term(c, CFG_CACHE_PAGE_TOKENS, tp, sizeof(tp));
    term(c, CFG_EVICTION_MAX_CACHE_TOKENS, tm, sizeof(tm));
    term(c, CFG_EVICTION_WINDOW_TOKENS, tw, sizeof(tw));

    /* A scored policy without heavy tokens is sink-window under another name. */
    const int kh[] = {CFG_EVICTION_HEAVY_TOKENS, CFG_EVICTION_POLICY};
    if (scored && c->eviction.heavy_tokens == 0 && !skip_rule(r, kh, 2)) {
        char tpol[64];
        cfg_format_value(c, CFG_EVICTION_POLICY, tpol, sizeof(tpol));
        violation(r, kh, 2, "policy %s needs heavy_tokens >= 1 (or use policy sink-window)",
                  tpol);
    }

    /* The kept tokens must leave at least one page for eviction to free. */
    const int ka[] = {CFG_EVICTION_SINK_TOKENS, CFG_EVICTION_HEAVY_TOKENS,
                      CFG_EVICTION_MAX_CACHE_TOKENS, CFG_CACHE_PAGE_TOKENS, CFG_EVICTION_POLICY};
    bool a_checked = !skip_rule(r, ka, 5), a_ok = a_checked && b.floor_tokens <= max;
    if (a_checked && !a_ok)
        violation(r, ka, 5, "%s + one page: %s = %" PRId64 " exceeds %s", tk, tp, b.floor_tokens,
                  tm);

    if (window == 0) {
        /* Automatic: the window is what the rest leaves (cfg_window_tokens). */
        const int kw[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_EVICTION_MAX_CACHE_TOKENS,
                          CFG_EVICTION_SINK_TOKENS,   CFG_EVICTION_HEAVY_TOKENS,
                          CFG_CACHE_PAGE_TOKENS,      CFG_EVICTION_POLICY};
        if (a_ok && !skip_rule(r, kw, 6) && b.window_room < page)
            violation(r, kw, 6,
                      "window_tokens 0 (automatic) leaves %s - %s - one page: %s = %" PRId64
                      " tokens, less than one page",
                      tm, tkg, tp, b.window_room);
        cache_verdict(r, &b, n_before);
        return;
    }

    const int kb[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_CACHE_PAGE_TOKENS};
    if (!skip_rule(r, kb, 2) && window < page)
        violation(r, kb, 2, "window_tokens %" PRId64 " is less than one page: %s", window, tp);

    const int kc[] = {CFG_EVICTION_WINDOW_TOKENS, CFG_EVICTION_SINK_TOKENS,
                      CFG_EVICTION_HEAVY_TOKENS,  CFG_EVICTION_MAX_CACHE_TOKENS,
                      CFG_CACHE_PAGE_TOKENS,      CFG_EVICTION_POLICY};
    if (a_ok && !skip_rule(r, kc, 6) && b.need_tokens > max)
        violation(r, kc, 6, "%s + %s + one page: %s = %" PRId64 " exceeds %s", tw, tk, tp,
                  b.need_tokens, tm);
    cache_verdict(r, &b, n_before);
}

static void rules_t5(struct rules *r)
{
    const struct cfg *c = r->c;
    int64_t nb = c->model.t5_num_buckets, md = c->model.t5_max_distance;
    const int k[] = {CFG_MODEL_T5_NUM_BUCKETS, CFG_MODEL_T5_MAX_DISTANCE};
    const int k_md[] = {CFG_MODEL_T5_MAX_DISTANCE, CFG_MODEL_T5_NUM_BUCKETS};
    if ((nb == 0 && md == 0) || skip_rule(r, k, 2))
        return;
    char tnb[128], tmd[128];
    term(c, CFG_MODEL_T5_NUM_BUCKETS, tnb, sizeof(tnb));
    term(c, CFG_MODEL_T5_MAX_DISTANCE, tmd, sizeof(tmd));
    if (nb == 0) {
        violation(r, k_md, 2, "set together with t5_num_buckets, which is 0 (set both or neither)");
        return;
    }
    if (md == 0) {
        violation(r, k, 2, "set together with t5_max_distance, which is 0 (set both or neither)");
        return;
    }
    if (nb < 4) {
        violation(r, k, 2, "T5 needs at least 4 buckets");
        return;
    }
    /* Causal buckets: the first nb/2 distances are exact, the rest logarithmic up to md. */
    if (md <= nb / 2)
        violation(r, k_md, 2,
                  "must exceed t5_num_buckets/2 = %" PRId64
                  ", the exact range of causal buckets, with %s",
                  nb / 2, tnb);
}

static void rules_other(struct rules *r)
{
    const struct cfg *c = r->c;
    const int ka[] = {CFG_AUTH_API_KEY_FILE, CFG_AUTH_API_KEY};
    if (!skip_rule(r, ka, 2) && c->auth.api_key[0] && c->auth.api_key_file[0]) {
        char o[CFG_PATH_MAX + 32];
        if (c->origin[CFG_AUTH_API_KEY].kind == CFG_FROM_FILE)
            cfg_fmt(o, sizeof(o), "line %d", c->origin[CFG_AUTH_API_KEY].line);
        else
            cfg_format_origin(c, CFG_AUTH_API_KEY, o, sizeof(o));
        violation(r, ka, 2, "api_key is set too (%s); set only one of them", o);
    }
    const int ks[] = {CFG_LIMITS_STEP_TOKENS, CFG_LIMITS_MAX_RUNNING};
    if (!skip_rule(r, ks, 2) && c->limits.step_tokens < c->limits.max_running) {
        char t[128];
        term(c, CFG_LIMITS_MAX_RUNNING, t, sizeof(t));
        violation(r, ks, 2, "less than %s: every running sequence decodes one token per step", t);
    }
}

int cfg_validate_failed(const struct cfg *c, struct cfg_errors *errs, const bool *failed)
{
    struct rules r = {.c = c, .errs = errs, .failed = failed};
    rules_eviction(&r);
    rules_t5(&r);
    rules_other(&r);
    return r.n_errors ? -EINVAL : 0;
}

int cfg_validate(const struct cfg *c, struct cfg_errors *errs)
{
    return cfg_validate_failed(c, errs, NULL);
}

/* --- derived values ---------------------------------------------------------------------- */

int64_t cfg_window_tokens(const struct cfg *c)
{
    if (c->eviction.policy == CFG_EVICT_NONE)
        return c->eviction.window_tokens; /* unused: policy none never evicts */
    struct cfg_budget b;
    budget_of(c, &b);
    return b.window_tokens;
}

enum cfg_kv_type cfg_k_type(const struct cfg *c)
{
    return c->cache.k_type == CFG_KV_SAME ? c->cache.kv_type : c->cache.k_type;
}

enum cfg_kv_type cfg_v_type(const struct cfg *c)
{
    return c->cache.v_type == CFG_KV_SAME ? c->cache.kv_type : c->cache.v_type;
}

int64_t cfg_sequence_pages(const struct cfg *c)
{
    struct cfg_budget b;
    budget_of(c, &b);
    return b.sequence_pages;
}

int cfg_check_memory(const struct cfg *c, uint64_t kv_bytes_per_token, uint64_t window_bytes,
                     struct cfg_errors *errs)
{
    uint64_t pages = (uint64_t)cfg_sequence_pages(c), need = window_bytes;
    bool overflow = !window_bytes &&
                    (__builtin_mul_overflow(pages, (uint64_t)c->cache.page_tokens, &need) ||
                     __builtin_mul_overflow(need, kv_bytes_per_token, &need));
    if (!overflow && c->cache.memory >= need)
        return 0;
    char mem[32], needed[32], tm[128], tp[128];
    cfg_format_size(c->cache.memory, mem, sizeof(mem));
    if (overflow)
        cfg_fmt(needed, sizeof(needed), "more than 2^64 bytes");
    else
        cfg_format_size(need, needed, sizeof(needed));
    term(c, CFG_EVICTION_MAX_CACHE_TOKENS, tm, sizeof(tm));
    term(c, CFG_CACHE_PAGE_TOKENS, tp, sizeof(tp));
    struct rules r = {.c = c, .errs = errs};
    const int k[] = {CFG_CACHE_MEMORY};
    if (window_bytes)
        violation(&r, k, 1,
                  "one sequence at its full budget needs %s for %s at %s (the model's "
                  "sliding-window layers keeping only their window); raise memory or lower "
                  "max_cache_tokens",
                  needed, tm, tp);
    else
        violation(&r, k, 1,
                  "one sequence at its full budget needs %s: %" PRIu64 " pages for %s at %s, "
                  "%" PRIu64 " bytes per token; raise memory or lower max_cache_tokens",
                  needed, pages, tm, tp, kv_bytes_per_token);
    return -EINVAL;
}
