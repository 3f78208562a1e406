/*
 * args.c - strict parsing of command-line values.
 *
 * atoi() turns "12abc" into 12 and "abc" into 0; an operator who mistypes
 * a flag deserves an error instead. Everything numeric on kvd's command
 * line goes through these.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/args.h"

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
