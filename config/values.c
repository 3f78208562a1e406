/*
 * values.c - the syntax of configuration values: sizes, durations,
 * booleans, integers, numbers and listen addresses, read and written.
 *
 * Every value is exact or rejected. Sizes and durations are whole numbers
 * with units and are accumulated in 64-bit integers with overflow checks,
 * so "4GiB" is 4294967296 and "20000000TB" is an error instead of a wrap.
 * Formatting picks the largest unit that divides the value exactly, so a
 * formatted value parses back to the same number.
 *
 * Units: KiB/MiB/GiB/TiB are powers of 1024 and KB/MB/GB/TB powers of 1000,
 * as IEC and SI define them; "k", "M", "G" alone are not accepted because
 * they are ambiguous.
 */
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"
#include "config/config_internal.h"

struct unit {
    const char *name;
    uint64_t mult;
};

static const struct unit size_units[] = {
    {"B", 1},
    {"KiB", 1ull << 10},
    {"MiB", 1ull << 20},
    {"GiB", 1ull << 30},
    {"TiB", 1ull << 40},
    {"KB", 1000ull},
    {"MB", 1000ull * 1000},
    {"GB", 1000ull * 1000 * 1000},
    {"TB", 1000ull * 1000 * 1000 * 1000},
};

static const struct unit duration_units[] = {
    {"ms", 1}, {"s", 1000}, {"m", 60ull * 1000}, {"h", 3600ull * 1000}, {"d", 86400ull * 1000},
};

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

bool cfg_streq_ci(const char *a, const char *b)
{
    for (; *a && *b; a++, b++)
        if (tolower((unsigned char)*a) != tolower((unsigned char)*b))
            return false;
    return *a == *b;
}

/*
 * Read the digits at *p into *v (at least one), advancing *p.
 * Returns 0, -EINVAL (no digit) or -ERANGE (over 2^64-1).
 */
static int read_digits(const char **p, uint64_t *v)
{
    const char *s = *p;
    if (!isdigit((unsigned char)*s))
        return -EINVAL;
    uint64_t acc = 0;
    for (; isdigit((unsigned char)*s); s++) {
        if (__builtin_mul_overflow(acc, 10u, &acc) ||
            __builtin_add_overflow(acc, (uint64_t)(*s - '0'), &acc))
            return -ERANGE;
    }
    *p = s;
    *v = acc;
    return 0;
}

int cfg_parse_int(const char *s, int64_t *out)
{
    bool neg = *s == '-';
    if (neg)
        s++;
    uint64_t v;
    int rc = read_digits(&s, &v);
    if (rc == -EINVAL || (rc == 0 && *s))
        return -EINVAL;
    if (rc == -ERANGE || v > (uint64_t)INT64_MAX + (neg ? 1 : 0))
        return -ERANGE;
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

int cfg_parse_number(const char *s, double *out)
{
    /* strtod also takes hex, "inf" and "nan": allow only decimal syntax. */
    if (!*s || strspn(s, "0123456789.eE+-") != strlen(s))
        return -EINVAL;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v))
        return -EINVAL;
    *out = v;
    return 0;
}

int cfg_parse_size(const char *s, uint64_t *out, char *err, size_t errlen)
{
    const char *p = s;
    uint64_t v;
    int rc = read_digits(&p, &v);
    if (rc == -ERANGE) {
        snprintf(err, errlen, "too large (over 2^64 - 1)");
        return -ERANGE;
    }
    if (rc) {
        snprintf(err, errlen, "not a size (a whole number with an optional unit)");
        return -EINVAL;
    }
    if (*p == '.') {
        snprintf(err, errlen, "not a whole number (write 1536MiB, not 1.5GiB)");
        return -EINVAL;
    }
    while (*p == ' ')
        p++;
    uint64_t mult = 1;
    if (*p) {
        size_t i;
        for (i = 0; i < N_ELEMS(size_units); i++)
            if (cfg_streq_ci(p, size_units[i].name))
                break;
        if (i == N_ELEMS(size_units)) {
            snprintf(err, errlen,
                     "unknown size unit '%s' (B, KiB, MiB, GiB, TiB = powers of 1024; "
                     "KB, MB, GB, TB = powers of 1000)",
                     p);
            return -EINVAL;
        }
        mult = size_units[i].mult;
    }
    if (__builtin_mul_overflow(v, mult, &v)) {
        snprintf(err, errlen, "too large (over 2^64 - 1)");
        return -ERANGE;
    }
    *out = v;
    return 0;
}

int cfg_parse_duration(const char *s, uint64_t *ms, char *err, size_t errlen)
{
    if (!strcmp(s, "0")) {
        *ms = 0;
        return 0;
    }
    const char *p = s;
    uint64_t total = 0;
    do {
        uint64_t v;
        int rc = read_digits(&p, &v);
        if (rc == -ERANGE) {
            snprintf(err, errlen, "too large (over 2^64 - 1)");
            return -ERANGE;
        }
        if (rc) {
            snprintf(err, errlen, "not a duration (like 250ms, 30s, 5m, 1h, 1h30m)");
            return -EINVAL;
        }
        if (*p == '.') {
            snprintf(err, errlen, "not a whole number (write 1500ms, not 1.5s)");
            return -EINVAL;
        }
        /* The unit: the letters up to the next digit. */
        const char *u = p;
        while (*p && !isdigit((unsigned char)*p))
            p++;
        size_t n = (size_t)(p - u), i;
        for (i = 0; i < N_ELEMS(duration_units); i++)
            if (strlen(duration_units[i].name) == n && !strncmp(u, duration_units[i].name, n))
                break;
        if (n == 0) {
            snprintf(err, errlen, "needs a unit (ms, s, m, h, d)");
            return -EINVAL;
        }
        if (i == N_ELEMS(duration_units)) {
            snprintf(err, errlen, "unknown duration unit '%.*s' (ms, s, m, h, d)", (int)n, u);
            return -EINVAL;
        }
        if (__builtin_mul_overflow(v, duration_units[i].mult, &v) ||
            __builtin_add_overflow(total, v, &total)) {
            snprintf(err, errlen, "too large (over 2^64 - 1)");
            return -ERANGE;
        }
    } while (*p);
    *ms = total;
    return 0;
}

int cfg_parse_bool(const char *s, bool *out)
{
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < N_ELEMS(yes); i++) {
        if (cfg_streq_ci(s, yes[i])) {
            *out = true;
            return 0;
        }
        if (cfg_streq_ci(s, no[i])) {
            *out = false;
            return 0;
        }
    }
    return -EINVAL;
}

/* v in the largest unit of the table (first entry = 1) that divides it. */
static int format_units(uint64_t v, const struct unit *units, size_t n, char *buf, size_t len)
{
    if (v == 0)
        return snprintf(buf, len, "0");
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (v % units[i].mult == 0 && units[i].mult > units[best].mult)
            best = i;
    return snprintf(buf, len, "%" PRIu64 "%s", v / units[best].mult,
                    units[best].mult == 1 && units == size_units ? "" : units[best].name);
}

int cfg_format_size(uint64_t bytes, char *buf, size_t len)
{
    /* Binary units only: the first five entries. */
    return format_units(bytes, size_units, 5, buf, len);
}

int cfg_format_duration(uint64_t ms, char *buf, size_t len)
{
    return format_units(ms, duration_units, N_ELEMS(duration_units), buf, len);
}

int cfg_check_listen(const char *s, char *err, size_t errlen)
{
    const char *colon;
    if (*s == '[') {
        /* [IPv6]:PORT */
        const char *close = strchr(s, ']');
        if (!close || close == s + 1 || close[1] != ':') {
            snprintf(err, errlen, "must be HOST:PORT ([IPv6]:PORT for IPv6)");
            return -EINVAL;
        }
        if ((size_t)strspn(s + 1, "0123456789abcdefABCDEF:.") != (size_t)(close - s - 1)) {
            snprintf(err, errlen, "'%.*s' is not an IPv6 address", (int)(close - s - 1), s + 1);
            return -EINVAL;
        }
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon || colon == s) {
            snprintf(err, errlen, "must be HOST:PORT, e.g. 127.0.0.1:8080");
            return -EINVAL;
        }
        if (memchr(s, ':', (size_t)(colon - s))) {
            snprintf(err, errlen, "an IPv6 address must be in brackets: [::1]:8080");
            return -EINVAL;
        }
        size_t n = (size_t)(colon - s);
        if (strspn(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-") != n) {
            snprintf(err, errlen, "'%.*s' is not a host name or IPv4 address", (int)n, s);
            return -EINVAL;
        }
    }
    int64_t port;
    if (cfg_parse_int(colon + 1, &port) || port < 0 || port > 65535 || colon[1] == '-') {
        snprintf(err, errlen, "port must be an integer in [0, 65535]");
        return -EINVAL;
    }
    return 0;
}
