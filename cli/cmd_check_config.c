/*
 * cmd_check_config.c - `kvd check-config FILE [--set section.key=value ...]`.
 *
 * Loads the file exactly as `kvd serve` will (defaults < file < --set) and
 * either prints the effective configuration, each key with where its value
 * came from, and exits 0, or prints every error, one per line as
 * FILE:LINE: message, and exits 2. The output of a valid configuration is
 * itself a config file that loads to the same values.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "config/args.h"
#include "config/config.h"

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
    status = 0;

out_free:
    free(dump);
    free(c);
    free(errs);
    free(sets);
    return status;
}
