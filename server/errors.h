/*
 * errors.h - OpenAI-shaped error bodies (errors.c), for the HTTP layer and
 * the API alike.
 */
#ifndef KVD_SERVER_ERRORS_H
#define KVD_SERVER_ERRORS_H

#include <stddef.h>

/*
 * The body of an error answer (new, caller frees; *len its length):
 * {"error":{"message","type","param","code"}}. type follows from the status
 * (invalid_request_error, rate_limit_error, ...); code is `code` when given,
 * else follows from the status too. param may be NULL (JSON null). A
 * message that is not valid UTF-8 gives a generic server_error body; NULL
 * only when memory runs out.
 */
char *srv_error_json(int status, const char *message, const char *param, const char *code,
                     size_t *len);

/* The OpenAI error type of a status: "invalid_request_error",
 * "rate_limit_error", "unavailable_error", ... */
const char *srv_error_type(int status);

#endif /* KVD_SERVER_ERRORS_H */
