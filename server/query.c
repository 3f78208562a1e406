/*
 * query.c - URL query strings as name=value pairs (query.h): one walk over
 * the pairs, the integer and text readers the routes share, so each route
 * states only which names it takes and what their values may be.
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/query.h"

int srv_query_each(const char *query, srv_query_fn fn, void *ctx, char *param, size_t plen,
                   char *msg, size_t mlen)
{
    for (const char *p = query ? query : ""; *p;) {
        size_t len = strcspn(p, "&");
        const char *eq = memchr(p, '=', len);
        size_t nlen = eq ? (size_t)(eq - p) : len;
        if (len > 0) {
            snprintf(param, plen, "%.*s", (int)(nlen < 48 ? nlen : 48), p);
            if (!eq) {
                snprintf(msg, mlen, "expected name=value");
                return -EINVAL;
            }
            if (fn(ctx, p, nlen, eq + 1, len - nlen - 1, msg, mlen) != 0)
                return -EINVAL;
        }
        p += len + (p[len] == '&');
    }
    if (plen)
        param[0] = '\0';
    return 0;
}

bool srv_query_is(const char *name, size_t nlen, const char *key)
{
    return strlen(key) == nlen && memcmp(name, key, nlen) == 0;
}

int srv_query_int(const char *val, size_t vlen, long lo, long hi, long *out)
{
    char v[24];
    if (vlen == 0 || vlen >= sizeof(v))
        return -EINVAL;
    memcpy(v, val, vlen);
    v[vlen] = '\0';
    char *end;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (*end || errno || n < lo || n > hi)
        return -EINVAL;
    *out = n;
    return 0;
}

int srv_query_text(const char *val, size_t vlen, char *out, size_t cap)
{
    if (cap == 0)
        return -EINVAL;
    size_t o = 0;
    for (size_t i = 0; i < vlen; i++) {
        int c = (unsigned char)val[i];
        if (c == '+') {
            c = ' ';
        } else if (c == '%') {
            char hex[3] = {i + 2 < vlen ? val[i + 1] : 0, i + 2 < vlen ? val[i + 2] : 0, 0};
            if (!isxdigit((unsigned char)hex[0]) || !isxdigit((unsigned char)hex[1]))
                return -EINVAL;
            c = (int)strtol(hex, NULL, 16);
            i += 2;
        }
        if (c == 0 || o + 1 >= cap)
            return -EINVAL;
        out[o++] = (char)c;
    }
    out[o] = '\0';
    return (int)o;
}
