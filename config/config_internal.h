/*
 * config_internal.h - helpers shared inside the config room only.
 */
#ifndef KVD_CONFIG_INTERNAL_H
#define KVD_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/*
 * A whole decimal integer ("-12", "4096"; no spaces, no '+', no hex).
 * Returns 0, -EINVAL (not an integer) or -ERANGE (outside int64).
 */
int cfg_parse_int(const char *s, int64_t *out);

/*
 * A finite decimal number ("8", "0.5", "1e-3"; no hex, inf or nan).
 * Returns 0 or -EINVAL.
 */
int cfg_parse_number(const char *s, double *out);

/*
 * HOST:PORT where HOST is a dotted IPv4 address, a bracketed IPv6 address
 * or a host name, and PORT is in [0, 65535]. Returns 0, or -EINVAL with
 * the reason in err.
 */
int cfg_check_listen(const char *s, char *err, size_t errlen);

/* Case-insensitive ASCII string equality. */
bool cfg_streq_ci(const char *a, const char *b);

#endif /* KVD_CONFIG_INTERNAL_H */
