/*
 * options.c - command-line options the subcommands share that speak the
 * cache's terms (config/args.c has the plain values).
 */
#include <stdio.h>

#include "cli/cli_internal.h"
#include "config/args.h"

bool srv_opt_kv_types(int argc, char **argv, int *i, const char *cmd, enum kv_type *k_type,
                      enum kv_type *v_type, bool *bad)
{
    static const char *const names[] = {"--kv-type", "--k-type", "--v-type"};
    for (int n = 0; n < 3; n++) {
        const char *v = NULL;
        if (!srv_opt_value(argc, argv, i, cmd, names[n], &v, bad))
            continue;
        enum kv_type t;
        if (*bad)
            return true;
        if (kv_type_parse(v, &t)) {
            fprintf(stderr, "kvd %s: %s wants f32, f16, bf16, q8_0 or q4_0, got '%s'\n", cmd,
                    names[n], v);
            *bad = true;
            return true;
        }
        if (n != 2)
            *k_type = t;
        if (n != 1)
            *v_type = t;
        return true;
    }
    return false;
}
