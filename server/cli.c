/*
 * cli.c - strict parsing of command-line values.
 *
 * atoi() turns "12abc" into 12 and "abc" into 0; an operator who mistypes
 * a flag deserves an error instead. Everything numeric on kvd's command
 * line goes through these.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/server_internal.h"

int srv_parse_long(const char *s, long min, long max, long *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || *end || v < min || v > max)
        return -1;
    *out = v;
    return 0;
}

int srv_parse_double(const char *s, double min, double max, double *out)
{
    if (!s || !*s)
        return -1;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || *end || !(v >= min && v <= max))
        return -1;
    *out = v;
    return 0;
}

bool srv_opt_value(int argc, char **argv, int *i, const char *cmd, const char *name,
                   const char **value, bool *bad)
{
    if (strcmp(argv[*i], name) != 0)
        return false;
    if (*i + 1 >= argc) {
        fprintf(stderr, "kvd %s: %s needs a value\n", cmd, name);
        *bad = true;
        *i += 1;
        return true;
    }
    *value = argv[*i + 1];
    *i += 2;
    return true;
}

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
