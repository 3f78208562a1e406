/*
 * args.h - strict parsing of command-line values, for every subcommand
 * (args.c). atoi() turns "12abc" into 12; these refuse it.
 */
#ifndef KVD_CONFIG_ARGS_H
#define KVD_CONFIG_ARGS_H

#include <stdbool.h>

/*
 * Parse a whole decimal integer in [min, max]. Returns 0, or -1 if s is
 * empty, has trailing characters, or is out of range (*out untouched).
 */
int srv_parse_long(const char *s, long min, long max, long *out);

/* Parse a whole floating-point number in [min, max]; same contract. */
int srv_parse_double(const char *s, double min, double max, double *out);

/*
 * Option scanning for subcommands: if argv[*i] is `name`, store the next
 * argument in *value, advance *i past both and return true. A missing
 * value prints "kvd CMD: NAME needs a value" and sets *bad.
 */
bool srv_opt_value(int argc, char **argv, int *i, const char *cmd, const char *name,
                   const char **value, bool *bad);

#endif /* KVD_CONFIG_ARGS_H */
