/*
 * web.c - serves the web page (index.html at "/", the rest under "/web/")
 * from the files the build embedded (build/gen/web_assets.c, written by
 * server/web/mkassets.c from server/web/).
 *
 * Nothing is read from disk at run time, so the page always matches the
 * binary that serves it, and nothing is fetched from elsewhere: the
 * Content-Security-Policy below lets the page load scripts, styles and
 * connections from this origin only. Each file carries an ETag (a hash of
 * its bytes, computed at build time) and "Cache-Control: no-cache", so a
 * browser revalidates and gets 304 until the binary changes.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/errors.h"
#include "server/web.h"

#define WEB_HEADERS                                                                                \
    "Cache-Control: no-cache\r\n"                                                                  \
    "X-Content-Type-Options: nosniff\r\n"                                                          \
    "Referrer-Policy: no-referrer\r\n"                                                             \
    "Content-Security-Policy: default-src 'none'; script-src 'self'; style-src 'self'; "           \
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "              \
    "frame-ancestors 'none'\r\n"

const struct srv_web_asset *srv_web_find(const char *path)
{
    if (!strcmp(path, "/index.html"))
        path = "/";
    for (int i = 0; i < srv_web_n_assets; i++)
        if (!strcmp(srv_web_assets[i].path, path))
            return &srv_web_assets[i];
    return NULL;
}

/* Whether an If-None-Match list names etag (or is "*"). */
static bool etag_matches(const char *inm, const char *etag)
{
    size_t n = strlen(etag);
    for (const char *p = inm; *p;) {
        p += strspn(p, " ,\t");
        if (!strncmp(p, "W/", 2))
            p += 2;
        if (*p == '*' || (!strncmp(p, etag, n) && (p[n] == '\0' || p[n] == ',' || p[n] == ' ')))
            return true;
        p += strcspn(p, ",");
    }
    return false;
}

void srv_web_respond(srv_conn *c, const struct srv_http_req *req, const struct srv_web_asset *a)
{
    if (strcmp(req->method, "GET") != 0 && strcmp(req->method, "HEAD") != 0) {
        size_t len = 0;
        char *body = srv_error_json(405, "only GET and HEAD are allowed on the page's files", NULL,
                                    NULL, &len);
        srv_http_respond(c, 405, "application/json", "Allow: GET, HEAD\r\n", body ? body : "",
                         body ? len : 0);
        free(body);
        return;
    }
    char headers[1024];
    snprintf(headers, sizeof(headers), "ETag: %s\r\n" WEB_HEADERS, a->etag);
    const char *inm = srv_http_header(req, "If-None-Match");
    if (inm && etag_matches(inm, a->etag)) {
        srv_http_respond(c, 304, a->content_type, headers, "", 0);
        return;
    }
    srv_http_respond(c, 200, a->content_type, headers, (const char *)a->data, a->len);
}
