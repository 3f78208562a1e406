/*
 * query.h - a URL query string read as name=value pairs (query.c), for the
 * GET routes that take options: the session map (route_map.c) and the
 * session list (api_sessions.c). Loop thread; nothing is allocated.
 */
#ifndef KVD_SERVER_QUERY_H
#define KVD_SERVER_QUERY_H

#include <stdbool.h>
#include <stddef.h>

/*
 * One pair of a query: name[0..nlen) and its value val[0..vlen), neither
 * percent-decoded (srv_query_text does that). Returns 0, or -EINVAL with
 * the reason in msg (a bad value, a name it does not take).
 */
typedef int (*srv_query_fn)(void *ctx, const char *name, size_t nlen, const char *val, size_t vlen,
                            char *msg, size_t mlen);

/*
 * Call fn for each '&'-separated "name=value" of query (NULL or "" has
 * none; empty pieces are skipped). Returns 0, or -EINVAL with the name of
 * the pair at fault in param (cut to 48 bytes) and the reason in msg: a
 * pair without '=', or fn's refusal (the first one ends the walk).
 */
int srv_query_each(const char *query, srv_query_fn fn, void *ctx, char *param, size_t plen,
                   char *msg, size_t mlen);

/* Whether name[0..nlen) is key. */
bool srv_query_is(const char *name, size_t nlen, const char *key);

/*
 * val[0..vlen) as a decimal integer in [lo, hi]: 0 with *out set, or
 * -EINVAL (empty, not a number, out of range) with *out unchanged.
 */
int srv_query_int(const char *val, size_t vlen, long lo, long hi, long *out);

/*
 * val[0..vlen) percent-decoded ("%3A" is ':', '+' is a space, as HTML
 * forms and URLSearchParams send them) into out, NUL-terminated, at most
 * cap - 1 bytes. Returns the decoded length, or -EINVAL for a bad escape,
 * a NUL byte or a text that does not fit.
 */
int srv_query_text(const char *val, size_t vlen, char *out, size_t cap);

#endif /* KVD_SERVER_QUERY_H */
