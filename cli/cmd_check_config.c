/*
 * cmd_check_config.c - `kvd check-config FILE [--set section.key=value ...]`.
 *
 * Loads the file exactly as `kvd serve` will (defaults < file < --set) and
 * either prints the effective configuration, each key with where its value
 * came from, and exits 0, or prints every error, one per line as
 * FILE:LINE: message, and exits 2. The output of a valid configuration is
 * itself a config file that loads to the same values. It ends with the
 * layout the eviction policy gives one session and what a session costs:
 * in pages always, in bytes when [model] path names a model that loads.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/kv_cache.h"
#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/args.h"
#include "config/config.h"
#include "model/model.h"

/* K and V bytes of one token for the config's model and KV types; 0 with
 * the reason in why when there is no model to ask. With sliding-window
 * layers, what one session takes when they keep only their window goes
 * to window_note ("" otherwise). */
static uint64_t model_token_bytes(const struct cfg *c, char *why, size_t len, char *window_note,
                                  size_t note_len)
{
    window_note[0] = '\0';
    if (!c->model.path[0]) {
        snprintf(why, len, "set [model] path to see it in bytes");
        return 0;
    }
    struct model_params mp = {.path = c->model.path};
    model *m = model_load(&mp, why, len);
    if (!m)
        return 0;
    struct kv_cache_params shape = {.k_type = srv_cfg_kv_type(cfg_k_type(c)),
                                    .v_type = srv_cfg_kv_type(cfg_v_type(c))};
    model_kv_shape(m, &shape);
    srv_cfg_session_note(c, &shape, window_note, note_len); /* before the model goes */
    model_free(m);
    uint64_t bytes = kv_cache_token_bytes(&shape);
    if (!bytes)
        snprintf(why, len, "the KV types cannot store the model's head_dim %d", shape.head_dim);
    return bytes;
}

/*
 * What the policy keeps of one sequence, in the cache's own terms (the
 * budget is kv_policy_budget's, through the same policy serve builds), e.g.
 * [4 sinks | up to 3840 middle by h2o | 252 window], then one session's
 * pages and, with a model, its bytes.
 */
static void print_layout(const struct cfg *c)
{
    struct kv_policy p;
    srv_cfg_policy(c, &p);
    struct kv_budget b;
    kv_policy_budget(&p, (int)c->cache.page_tokens, &b);
    const char *name = kv_policy_kind_name(p.kind);
    if (p.kind == KV_EVICT_NONE)
        printf("\n# retained layout (none): [every token up to %d; nothing is evicted]\n",
               p.max_cache_tokens);
    else if (kv_policy_scored(p.kind))
        printf("\n# retained layout (%s): [%d sinks | up to %d middle by %s | %d window]\n", name,
               p.sink_tokens, p.heavy_tokens, name, p.window_tokens);
    else
        printf("\n# retained layout (%s): [%d sinks, kept as %lld tokens of whole pages | "
               "%d window]\n",
               name, p.sink_tokens, (long long)b.kept_tokens, p.window_tokens);
    long long pages = (long long)b.sequence_pages, page = (long long)c->cache.page_tokens;
    char why[512], note[400];
    uint64_t bytes = model_token_bytes(c, why, sizeof(why), note, sizeof(note));
    if (bytes)
        printf("# one session: at most %d tokens in %lld pages of %lld tokens = %.2f MiB "
               "(%llu bytes a token)\n",
               p.max_cache_tokens, pages, page, (double)bytes * page * pages / (1 << 20),
               (unsigned long long)bytes);
    else
        printf("# one session: at most %d tokens in %lld pages of %lld tokens (bytes: %s)\n",
               p.max_cache_tokens, pages, page, why);
    if (!note[0])
        return;
    /* the windowed layers' own budget (cache/window.c), and what such a
     * model runs without (engine/prefix.c, engine/spill.c say so at start) */
    printf("# %s\n", note);
    if (c->cache.prefix_cache)
        printf("# prefix cache: off for this model (sliding-window layers keep per-sequence "
               "pages)\n");
    if (c->sessions.dir[0])
        printf("# [sessions] dir: this model's sessions are not saved (its sliding-window "
               "layers drop rows a session file holds)\n");
}

static void check_config_usage(FILE *f)
{
    fprintf(f, "usage: kvd check-config FILE [--set section.key=value ...]\n"
               "  FILE                       the INI config file (see config/kvd.conf)\n"
               "  --set section.key=value    override one key, as `kvd serve` does\n"
               "Prints the effective configuration and where each value came from\n"
               "(exit 0), or every error as FILE:LINE: message (exit 2).\n");
}

int srv_cmd_check_config(int argc, char **argv)
{
    const char *path = NULL;
    const char **sets = calloc((size_t)argc + 1, sizeof(*sets));
    struct cfg_errors *errs = malloc(sizeof(*errs));
    struct cfg *c = malloc(sizeof(*c));
    char *dump = NULL;
    int n_sets = 0, status = 2;
    if (!sets || !errs || !c) {
        fprintf(stderr, "kvd check-config: out of memory\n");
        status = 1;
        goto out_free;
    }

    bool bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        if (srv_opt_value(argc, argv, &i, "check-config", "--set", &v, &bad)) {
            if (!bad)
                sets[n_sets++] = v;
        } else if (!strncmp(argv[i], "--set=", 6)) {
            sets[n_sets++] = argv[i++] + 6;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            check_config_usage(stdout);
            status = 0;
            goto out_free;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            fprintf(stderr, "kvd check-config: unknown option '%s'\n", argv[i]);
            bad = true;
        } else if (path) {
            fprintf(stderr, "kvd check-config: one FILE only (got '%s' and '%s')\n", path, argv[i]);
            bad = true;
        } else {
            path = argv[i++];
        }
    }
    if (!bad && !path) {
        fprintf(stderr, "kvd check-config: which FILE?\n");
        bad = true;
    }
    if (bad) {
        check_config_usage(stderr);
        goto out_free;
    }

    cfg_errors_init(errs);
    if (cfg_load(c, path, sets, n_sets, errs)) {
        char line[CFG_PATH_MAX + 512];
        for (int i = 0; i < errs->count; i++) {
            cfg_error_format(&errs->list[i], line, sizeof(line));
            fprintf(stderr, "%s\n", line);
        }
        if (errs->dropped)
            fprintf(stderr, "kvd check-config: %d more errors not shown\n", errs->dropped);
        goto out_free;
    }

    int n = cfg_dump(c, NULL, 0);
    dump = malloc((size_t)n + 1);
    if (!dump) {
        fprintf(stderr, "kvd check-config: out of memory\n");
        status = 1;
        goto out_free;
    }
    cfg_dump(c, dump, (size_t)n + 1);
    printf("# %s is valid; the effective configuration, each key with its origin:\n\n%s", path,
           dump);
    if (c->eviction.policy != CFG_EVICT_NONE)
        printf("\n# eviction window in effect: %lld tokens%s\n", (long long)cfg_window_tokens(c),
               c->eviction.window_tokens ? "" : " (window_tokens = 0: the rest of the budget)");
    print_layout(c);
    status = 0;

out_free:
    free(dump);
    free(c);
    free(errs);
    free(sets);
    return status;
}
