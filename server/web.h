/*
 * web.h - the web page's files, embedded in the binary at build time
 * (web.c serves them; server/web/mkassets.c writes the table below from
 * the files in server/web/ when kvd is built).
 */
#ifndef KVD_SERVER_WEB_H
#define KVD_SERVER_WEB_H

#include <stdbool.h>
#include <stddef.h>

#include "server/http.h"

/* One embedded file (generated: build/gen/web_assets.c). */
struct srv_web_asset {
    const char *path;         /* "/" for index.html, else "/web/NAME" */
    const char *content_type; /* from the file's extension */
    const unsigned char *data;
    size_t len;
    const char *etag; /* quoted: a hash of the content */
};

extern const struct srv_web_asset srv_web_assets[];
extern const int srv_web_n_assets;

/* The asset served at path, or NULL. */
const struct srv_web_asset *srv_web_find(const char *path);

/*
 * Answer a request for an embedded file: GET and HEAD (405 otherwise),
 * 304 when If-None-Match names its ETag, else 200 with the file,
 * "Cache-Control: no-cache" (revalidate: the files change with the
 * binary) and a Content-Security-Policy that allows this origin only.
 * The files hold no data, so they are served without the API key; every
 * route the page reads data from takes the key (the page asks for it).
 */
void srv_web_respond(srv_conn *c, const struct srv_http_req *req, const struct srv_web_asset *a);

#endif /* KVD_SERVER_WEB_H */
