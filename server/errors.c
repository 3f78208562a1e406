/*
 * errors.c - the daemon's error bodies, in OpenAI's shape.
 *
 * Every error kvd answers, whether the HTTP layer refuses a request
 * (http.c: 408, 413, 431, ...) or the API does (api.c), carries the same
 * JSON body, {"error":{"message","type","param","code"}}, with type and
 * code following from the status unless the caller names a finer code.
 * One module owns that shape so that neither layer calls the other for it.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "server/errors.h"

const char *srv_error_type(int status)
{
    switch (status) {
    case 401:
        return "authentication_error";
    case 403:
        return "permission_error";
    case 404:
        return "not_found_error";
    case 408:
        return "timeout_error";
    case 409:
        return "conflict_error";
    case 429:
        return "rate_limit_error";
    case 500:
        return "server_error";
    case 503:
        return "unavailable_error";
    default:
        return status >= 500 ? "server_error" : "invalid_request_error";
    }
}

static const char *error_code(int status)
{
    switch (status) {
    case 400:
        return "invalid_request";
    case 401:
        return "invalid_api_key";
    case 404:
        return "not_found";
    case 405:
        return "method_not_allowed";
    case 408:
        return "request_timeout";
    case 409:
        return "session_busy";
    case 413:
        return "body_too_large";
    case 414:
        return "url_too_long";
    case 429:
        return "queue_full";
    case 431:
        return "headers_too_large";
    case 503:
        return "unavailable";
    default:
        return status >= 500 ? "server_error" : "invalid_request";
    }
}

char *srv_error_json(int status, const char *message, const char *param, const char *code,
                     size_t *len)
{
    json_t *e =
        json_pack("{s:{s:s, s:s, s:o, s:s}}", "error", "message", message ? message : "", "type",
                  srv_error_type(status), "param", param ? json_string(param) : json_null(), "code",
                  code ? code : error_code(status));
    char *s = e ? json_dumps(e, JSON_COMPACT) : NULL;
    json_decref(e);
    if (!s) {
        /* The message was not valid UTF-8 (or memory ran out). */
        static const char fallback[] =
            "{\"error\":{\"message\":\"error\",\"type\":\"server_error\",\"param\":null,"
            "\"code\":\"server_error\"}}";
        s = strdup(fallback);
    }
    *len = s ? strlen(s) : 0;
    return s;
}
