/*
 * eval_policy.c - parse `kvd eval --policy SPEC` into a kv_policy.
 *
 * A spec is the policy's name and its sizes separated by colons, in the
 * order of the config keys, with an optional positions mode last:
 *
 *   sink-window:SINK:WINDOW   window:WINDOW (no sinks)
 *   h2o:SINK:WINDOW:HEAVY     tova:SINK:WINDOW:HEAVY
 *   knorm:SINK:WINDOW:HEAVY[:largest|:smallest]
 *   snapkv:SINK:WINDOW:HEAVY[:OBSERVE[:POOL]]
 *   ...[:preserve|:renumber]
 *
 * The budget is either the smallest the policy accepts (so a spec alone
 * says exactly what is kept) or, with --budget, the same for every policy,
 * WINDOW 0 then meaning "what the budget leaves", as window_tokens = 0 does
 * in the config. The cache has the last word (kv_policy_check).
 */
#include "cli/eval_policy.h"

#include <stdio.h>
#include <string.h>

#include "config/args.h"

#define MAX_FIELDS 8
#define LIM (1L << 24)

const char srv_eval_policy_usage[] =
    "  --policy SPEC        repeatable; SPEC is one of\n"
    "                         sink-window:SINK:WINDOW     window:WINDOW (no sinks)\n"
    "                         h2o:SINK:WINDOW:HEAVY       tova:SINK:WINDOW:HEAVY\n"
    "                         knorm:SINK:WINDOW:HEAVY[:largest|:smallest]\n"
    "                         snapkv:SINK:WINDOW:HEAVY[:OBSERVE[:POOL]] (default 32, 7)\n"
    "                       each optionally ending :preserve (default sink-window:4:252)\n"
    "  --budget N           max_cache_tokens of every --policy (default: the smallest\n"
    "                       each accepts); WINDOW 0 = what the budget leaves\n";

/* fields[i] as an int in [lo, LIM], or -1 with *ok cleared. */
static int field(char *const *fields, int i, long lo, bool *ok)
{
    long v;
    if (srv_parse_long(fields[i], lo, LIM, &v)) {
        *ok = false;
        return -1;
    }
    return (int)v;
}

int srv_eval_parse_policy(const char *spec, int page_tokens, int budget, struct kv_policy *out,
                          char *err, size_t errlen)
{
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", spec);
    char *f[MAX_FIELDS];
    int nf = 0;
    for (char *save = NULL, *t = strtok_r(buf, ":", &save); t && nf < MAX_FIELDS;
         t = strtok_r(NULL, ":", &save))
        f[nf++] = t;
    if (nf == 0)
        goto bad;
    *out = (struct kv_policy){.renumber = true, .observe_tokens = 32, .pool_tokens = 7};
    if (!strcmp(f[nf - 1], "preserve") || !strcmp(f[nf - 1], "renumber")) {
        out->renumber = !strcmp(f[nf - 1], "renumber");
        nf--;
    }
    if (nf == 0 || kv_policy_parse_kind(f[0], &out->kind) || out->kind == KV_EVICT_NONE) {
        if (nf != 2 || strcmp(f[0], "window"))
            goto bad;
        out->kind = KV_EVICT_SINK_WINDOW; /* window:WINDOW */
        f[2] = f[1];
        f[1] = "0";
        nf = 3;
    }
    bool ok = true, scored = kv_policy_scored(out->kind);
    int base = scored ? 4 : 3; /* name, sinks, window (, heavy) */
    if (nf < base)
        goto bad;
    out->sink_tokens = field(f, 1, 0, &ok);
    out->window_tokens = field(f, 2, budget > 0 ? 0 : 1, &ok);
    if (scored)
        out->heavy_tokens = field(f, 3, 1, &ok);
    int extra = nf - base;
    if (out->kind == KV_EVICT_KNORM && extra == 1) {
        out->knorm_smallest = !strcmp(f[4], "smallest");
        ok = ok && (out->knorm_smallest || !strcmp(f[4], "largest"));
    } else if (out->kind == KV_EVICT_SNAPKV && extra <= 2) {
        if (extra >= 1)
            out->observe_tokens = field(f, 4, 1, &ok);
        if (extra == 2)
            out->pool_tokens = field(f, 5, 1, &ok);
    } else if (extra != 0) {
        ok = false;
    }
    if (!ok)
        goto bad;

    struct kv_budget b;
    kv_policy_budget(out, page_tokens, &b);
    if (budget > 0) {
        out->max_cache_tokens = budget;
        kv_policy_budget(out, page_tokens, &b);
        out->window_tokens = (int)b.window_tokens; /* 0 = what the budget leaves */
    } else {
        out->max_cache_tokens = (int)b.need_tokens; /* the smallest the policy accepts */
    }
    return kv_policy_check(out, page_tokens, err, errlen) ? -1 : 0;
bad:
    snprintf(err, errlen, "'%s' does not parse (see kvd eval --help)", spec);
    return -1;
}
