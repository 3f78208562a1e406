/*
 * fuzz_route_sessions.c - libFuzzer target for sessions: how a session id
 * is read (the body's "session" field, the X-Session-Id header, the
 * /v1/sessions/ID path) and what the session routes answer. Each input is
 * "ID\nBODY": BODY is posted to /completion with ID in X-Session-Id (when
 * ID fits in a header line), then GET and DELETE /v1/sessions/ID follow,
 * with ID percent-escaped where a request target cannot carry it, and GET
 * /v1/sessions with ID as its cursor and as its query. All on
 * the real `kvd serve` in this process (tests/fuzz/route_fuzz.h says how,
 * and what every answer must be). Seeds in corpus/route_sessions/, tokens
 * in route_sessions.dict. Built and run by `make fuzz`.
 */
#include "tests/fuzz/route_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const uint8_t *nl = memchr(data, '\n', size);
    size_t id_len = nl ? (size_t)(nl - data) : size;
    if (id_len > 1024)
        return 0; /* longer than any request line the server takes */
    const uint8_t *body = nl ? nl + 1 : data + size;
    size_t body_len = (size_t)(data + size - body);

    /* The header carries the id when it has no line break or NUL. */
    char header[1100] = "";
    if (!memchr(data, '\r', id_len) && !memchr(data, '\0', id_len))
        snprintf(header, sizeof(header), "X-Session-Id: %.*s\r\n", (int)id_len, (const char *)data);
    route_request("POST", "/completion", header, body, body_len);

    /* The path: printable bytes as they are, others escaped. */
    char path[16 + 3 * 1024 + 1] = "/v1/sessions/";
    size_t p = strlen(path);
    for (size_t i = 0; i < id_len; i++) {
        uint8_t c = data[i];
        if (c > 0x20 && c < 0x7f && c != '%' && c != '?' && c != '#')
            path[p++] = (char)c;
        else
            p += (size_t)snprintf(path + p, 4, "%%%02X", c);
    }
    path[p] = '\0';
    route_request("GET", path, "", (const uint8_t *)"", 0);
    route_request("DELETE", path, "", (const uint8_t *)"", 0);

    /* The list: the id as its cursor, then the bytes as a query of their
     * own (printable ones as they are). */
    char list[32 + 3 * 1024 + 1];
    snprintf(list, sizeof(list), "/v1/sessions?limit=2&after=%s", path + strlen("/v1/sessions/"));
    route_request("GET", list, "", (const uint8_t *)"", 0);
    p = (size_t)snprintf(list, sizeof(list), "/v1/sessions?");
    for (size_t i = 0; i < id_len; i++)
        if (data[i] > 0x20 && data[i] < 0x7f && data[i] != '#')
            list[p++] = (char)data[i];
    list[p] = '\0';
    route_request("GET", list, "", (const uint8_t *)"", 0);
    return 0;
}
