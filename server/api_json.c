/*
 * api_json.c - the API's answers and its JSON vocabulary: error answers
 * (bodies from errors.c), JSON answers, text that must become a valid
 * JSON string whatever the model emitted, and the typed field readers
 * every decoder uses, which record the first problem they meet.
 *
 * Loop thread for the answers; the readers and the error record are pure
 * and run wherever a decoder runs.
 */
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"
#include "server/errors.h"
#include "server/log.h"

/* ------------------------------------------------------------------------
 * Answers
 * ------------------------------------------------------------------------ */

void srv_api_error(srv_conn *c, int status, const char *param, const char *code,
                   const char *extra, const char *fmt, ...)
{
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *body = srv_error_json(status, msg, param, code, &len);
    srv_log(SRV_LOG_DEBUG, "api: %d %s", status, msg);
    srv_http_respond(c, status, "application/json", extra ? extra : "", body ? body : "",
                     body ? len : 0);
    free(body);
}

void srv_api_error_from(srv_conn *c, const struct srv_api_error *e)
{
    srv_api_error(c, e->status, e->param[0] ? e->param : NULL, e->code, NULL, "%s", e->msg);
}

void srv_respond_json(srv_conn *c, int status, json_t *v)
{
    char *s = v ? json_dumps(v, SRV_JSON_FLAGS) : NULL;
    json_decref(v);
    if (!s) {
        srv_api_error(c, 500, NULL, NULL, NULL, "out of memory building the response");
        return;
    }
    srv_http_respond(c, status, "application/json", "", s, strlen(s));
    free(s);
}

json_t *srv_json_text(const char *s, size_t n)
{
    json_t *v = json_stringn(s, n);
    if (v)
        return v;
    char *fixed = malloc(n * 3 + 1);
    if (!fixed)
        return json_string("");
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)s[i];
        int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        bool ok = len > 0 && i + (size_t)len <= n;
        for (int k = 1; ok && k < len; k++)
            ok = ((unsigned char)s[i + (size_t)k] >> 6) == 2;
        if (ok && len > 1) {
            json_t *t = json_stringn(s + i, (size_t)len); /* overlong / surrogate check */
            ok = t != NULL;
            json_decref(t);
        }
        if (ok && c != 0) {
            memcpy(fixed + o, s + i, (size_t)len);
            o += (size_t)len;
            i += (size_t)len;
        } else {
            memcpy(fixed + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    v = json_stringn(fixed, o);
    free(fixed);
    return v ? v : json_string("");
}

/* ------------------------------------------------------------------------
 * The first problem with a request
 * ------------------------------------------------------------------------ */

int srv_fail(struct srv_api_error *e, const char *param, const char *code, const char *fmt, ...)
{
    if (e->status)
        return -1;
    e->status = 400;
    snprintf(e->param, sizeof(e->param), "%s", param ? param : "");
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
    va_end(ap);
    return -1;
}

/* Memory ran out while reading the request: 503, and the server lives on. */
int srv_oom(struct srv_api_error *e, const char *what)
{
    if (e->status)
        return -1;
    e->status = 503;
    e->param[0] = '\0';
    e->code = "out_of_memory";
    snprintf(e->msg, sizeof(e->msg), "out of memory %s; retry later", what);
    return -1;
}

/* ------------------------------------------------------------------------
 * Field readers
 * ------------------------------------------------------------------------ */

const char *srv_json_type_name(const json_t *v)
{
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a number";
    case JSON_TRUE:
    case JSON_FALSE:
        return "a boolean";
    case JSON_NULL:
        return "null";
    }
    return "?";
}

json_t *srv_field(const json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return v && !json_is_null(v) ? v : NULL;
}

int srv_get_int(const json_t *o, const char *key, long long min, long long max, long long *out,
                struct srv_api_error *e)
{
    json_t *v = srv_field(o, key);
    if (!v)
        return 0;
    long long x;
    if (json_is_integer(v)) {
        x = json_integer_value(v);
    } else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
               fabs(json_real_value(v)) < 9e15) {
        x = (long long)json_real_value(v);
    } else {
        return srv_fail(e, key, "invalid_type", "'%s' must be an integer, not %s", key,
                        srv_json_type_name(v));
    }
    if (x < min || x > max)
        return srv_fail(e, key, "invalid_value", "'%s' must be between %lld and %lld (got %lld)",
                        key, min, max, x);
    *out = x;
    return 1;
}

int srv_get_num(const json_t *o, const char *key, double min, double max, double *out,
                struct srv_api_error *e)
{
    json_t *v = srv_field(o, key);
    if (!v)
        return 0;
    if (!json_is_number(v))
        return srv_fail(e, key, "invalid_type", "'%s' must be a number, not %s", key,
                        srv_json_type_name(v));
    double x = json_number_value(v);
    if (!(x >= min && x <= max))
        return srv_fail(e, key, "invalid_value", "'%s' must be between %g and %g (got %g)", key,
                        min, max, x);
    *out = x;
    return 1;
}

int srv_get_bool(const json_t *o, const char *key, bool *out, struct srv_api_error *e)
{
    json_t *v = srv_field(o, key);
    if (!v)
        return 0;
    if (!json_is_boolean(v))
        return srv_fail(e, key, "invalid_type", "'%s' must be a boolean, not %s", key,
                        srv_json_type_name(v));
    *out = json_is_true(v);
    return 1;
}

int srv_get_str(const json_t *o, const char *key, const char **out, struct srv_api_error *e)
{
    json_t *v = srv_field(o, key);
    if (!v)
        return 0;
    if (!json_is_string(v))
        return srv_fail(e, key, "invalid_type", "'%s' must be a string, not %s", key,
                        srv_json_type_name(v));
    *out = json_string_value(v);
    return 1;
}

bool srv_session_id_ok(const char *s, size_t max)
{
    size_t n = strlen(s);
    if (n == 0 || n > max)
        return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.' || c == ':'))
            return false;
    }
    return true;
}
