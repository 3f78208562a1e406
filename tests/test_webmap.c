/*
 * test_webmap.c - the web page's server side: GET /v1/sessions/{id}/map,
 * GET /v1/config and the embedded files at / and /web/.
 *
 * In process: the map built from a real cache (a session pushed past its
 * budget) against the sequence's own arrays, its rendered size against the
 * bound the route checks, and the query parser's limits. End to end:
 * `kvd serve` on a small scratch model with an API key, a session pushed
 * past its sink-window budget and checked range by range against
 * GET /v1/sessions/{id}; an h2o server whose scattered heavy hitters make
 * more runs than a request allows (the map then comes in equal slices);
 * auth, 404, 400 and 405 answers; the files' types, ETags and 304s; the
 * config with its origins and without the key's value.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "server/route_map.h"
#include "tests/serve_util.h"

#define KEY "web-test-key"
#define AUTH "Authorization: Bearer " KEY "\r\n"

static char dir[128], model_path[256];
static struct su_proc sw, h2o; /* sink-window and h2o servers */

static int setup(void **state)
{
    (void)state;
    if (su_scratch_model("webmap", 7, dir, sizeof dir, model_path, sizeof model_path) != 0)
        fail_msg("no scratch model");
    const char *bin = getenv("KVD_BIN");
    if (!bin) {
        print_message("KVD_BIN unset: skipping the end-to-end map tests\n");
        return 0;
    }
    const char *common[] = {"--set", ("auth.api_key=" KEY), "--set", "server.threads=1",
                            "--set", "cache.memory=8MiB", "--set", "cache.page_tokens=16"};
    const char *a[24], *b[24];
    int n = 0;
    for (size_t i = 0; i < sizeof common / sizeof common[0]; i++)
        a[n] = b[n] = common[i], n++;
    const char *sa[] = {
        "--set", "eviction.policy=sink-window", "--set", "eviction.max_cache_tokens=64",
        "--set", "eviction.sink_tokens=4",      "--set", "eviction.window_tokens=16"};
    const char *sb[] = {
        "--set", "eviction.policy=h2o",     "--set", "eviction.max_cache_tokens=128",
        "--set", "eviction.sink_tokens=4",  "--set", "eviction.window_tokens=16",
        "--set", "eviction.heavy_tokens=64"};
    for (int i = 0; i < 8; i++)
        a[n + i] = sa[i];
    for (int i = 0; i < 10; i++)
        b[n + i] = sb[i];
    snprintf(sw.log, sizeof sw.log, "%s/sw.log", dir);
    snprintf(h2o.log, sizeof h2o.log, "%s/h2o.log", dir);
    if (su_serve(&sw, bin, model_path, a, n + 8) != 0 ||
        su_serve(&h2o, bin, model_path, b, n + 10) != 0)
        fail_msg("kvd serve did not start");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (sw.pid)
        su_stop(&sw, SIGTERM, 10);
    if (h2o.pid)
        su_stop(&h2o, SIGTERM, 10);
    su_remove_dir(dir);
    return 0;
}

#define NEED(p)                                                                                    \
    do {                                                                                           \
        if (!(p).pid)                                                                              \
            skip();                                                                                \
    } while (0)

/* n token ids (seeded, inside the 512-token vocabulary) into a session,
 * generating 2 more. */
static void feed(int port, const char *session, int n, unsigned seed)
{
    json_t *ids = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(ids,
                              json_integer(3 + (int)((seed + (unsigned)i * 2654435761u) % 500)));
    int st = 0;
    json_t *v = su_post(port, "/v1/completions", "Content-Type: application/json\r\n" AUTH,
                        json_pack("{s:o, s:i, s:f, s:s, s:b}", "prompt", ids, "max_tokens", 2,
                                  "temperature", 0.0, "session", session, "ignore_eos", 1),
                        &st);
    assert_int_equal(st, 200);
    json_decref(v);
}

/* A session grown by `turns` requests of `step` more tokens each (the
 * prompt repeats the history, so only the new part is prefilled; one token
 * is generated and not kept), so its policy evicts many times. */
static void grow(int port, const char *session, int turns, int step)
{
    json_t *ids = json_array();
    for (int t = 0; t < turns; t++) {
        for (int i = 0; i < step; i++)
            json_array_append_new(ids, json_integer(3 + (t * 131 + i * 17) % 500));
        int st = 0;
        json_t *v = su_post(port, "/completion", "Content-Type: application/json\r\n" AUTH,
                            json_pack("{s:O, s:i, s:f, s:s}", "prompt", ids, "n_predict", 1,
                                      "temperature", 0.0, "session", session),
                            &st);
        assert_int_equal(st, 200);
        json_decref(v);
    }
    json_decref(ids);
}

static json_t *get_json(int port, const char *path, const char *headers, int *status)
{
    struct su_resp r;
    *status = su_http(port, "GET", path, headers, NULL, &r);
    json_error_t je;
    json_t *v = r.body ? json_loads(r.body, 0, &je) : NULL;
    if (!v)
        fail_msg("GET %s: %d, not JSON (%s): %.300s", path, *status, je.text, r.body ? r.body : "");
    su_resp_free(&r);
    return v;
}

#define I(o, k) json_integer_value(json_object_get((o), (k)))

/* Ranges cover [0, tokens) in order; returns the evicted and retained sums. */
static void check_cover(json_t *map, int *evicted, int *retained)
{
    json_t *ranges = json_object_get(map, "ranges");
    assert_true(json_is_array(ranges));
    int at = 0;
    *evicted = *retained = 0;
    size_t i;
    json_t *r;
    json_array_foreach(ranges, i, r)
    {
        assert_int_equal(I(r, "start"), at);
        assert_true(I(r, "end") > at);
        int len = (int)(I(r, "end") - at);
        const char *kind = json_string_value(json_object_get(r, "kind"));
        if (!strcmp(kind, "evicted")) {
            *evicted += len;
            assert_int_equal(I(r, "retained"), 0);
            assert_true(json_is_null(json_object_get(r, "positions")));
        } else {
            assert_true(I(r, "retained") > 0);
        }
        *retained += (int)I(r, "retained");
        at = (int)I(r, "end");
    }
    assert_int_equal(at, I(map, "tokens"));
}

/* A sink-window session past its budget: the map agrees with the session. */
static void test_map_sink_window(void **state)
{
    (void)state;
    NEED(sw);
    feed(sw.port, "sw1", 150, 1);
    int st;
    json_t *s = get_json(sw.port, "/v1/sessions/sw1", AUTH, &st);
    assert_int_equal(st, 200);
    json_t *m = get_json(sw.port, "/v1/sessions/sw1/map", AUTH, &st);
    assert_int_equal(st, 200);
    assert_string_equal(json_string_value(json_object_get(m, "object")), "session.map");
    assert_int_equal(I(m, "tokens"), I(s, "tokens"));
    assert_int_equal(I(m, "retained_tokens"), I(s, "retained_tokens"));
    assert_int_equal(I(m, "evicted_tokens"), I(s, "evicted_tokens"));
    assert_true(I(m, "evicted_tokens") > 0);
    int ev, ret;
    check_cover(m, &ev, &ret);
    assert_int_equal(ev, I(s, "evicted_tokens"));
    assert_int_equal(ret, I(s, "retained_tokens"));
    assert_int_equal(I(json_object_get(m, "pages"), "count"), I(json_object_get(s, "kv"), "pages"));
    assert_int_equal(json_array_size(json_object_get(json_object_get(m, "pages"), "ids")),
                     I(json_object_get(s, "kv"), "pages"));
    /* sinks: the first page whole; then one evicted run; the window last */
    json_t *ranges = json_object_get(m, "ranges");
    json_t *r0 = json_array_get(ranges, 0), *r1 = json_array_get(ranges, 1);
    json_t *rl = json_array_get(ranges, json_array_size(ranges) - 1);
    assert_string_equal(json_string_value(json_object_get(r0, "kind")), "sink");
    assert_int_equal(I(r0, "end"), 16);
    assert_string_equal(json_string_value(json_object_get(r1, "kind")), "evicted");
    assert_int_equal(I(r1, "start"), 16);
    assert_string_equal(json_string_value(json_object_get(rl, "kind")), "window");
    assert_int_equal(I(rl, "end"), I(m, "tokens"));
    assert_int_equal(I(m, "sinks"), 16);
    /* renumbered: a retained range's positions are its cache slots, and as
     * many as its tokens; its text is there */
    size_t i;
    json_t *r;
    json_array_foreach(ranges, i, r)
    {
        json_t *pos = json_object_get(r, "positions"), *cache = json_object_get(r, "cache");
        assert_true(json_is_string(json_object_get(r, "text")));
        if (json_is_null(pos))
            continue;
        int p0 = (int)json_integer_value(json_array_get(pos, 0));
        int p1 = (int)json_integer_value(json_array_get(pos, 1));
        assert_int_equal(p1 - p0 + 1, I(r, "end") - I(r, "start"));
        assert_int_equal(p0, json_integer_value(json_array_get(cache, 0)));
        assert_int_equal(json_integer_value(json_array_get(json_object_get(r, "pages"), 0)),
                         json_integer_value(json_array_get(cache, 0)) / 16);
    }
    assert_int_equal(I(m, "next_position"), I(m, "retained_tokens"));
    json_decref(m);
    /* text=0: no text at all */
    m = get_json(sw.port, "/v1/sessions/sw1/map?text=0&ranges=16", AUTH, &st);
    assert_int_equal(st, 200);
    json_array_foreach(json_object_get(m, "ranges"), i, r)
        assert_true(json_is_null(json_object_get(r, "text")));
    json_decref(m);
    json_decref(s);
}

/* An h2o session: heavy hitters kept between the sinks and the window,
 * the ranges still covering the history exactly. */
static void test_map_h2o(void **state)
{
    (void)state;
    NEED(h2o);
    grow(h2o.port, "h1", 30, 12);
    int st;
    json_t *s = get_json(h2o.port, "/v1/sessions/h1", AUTH, &st);
    json_t *m = get_json(h2o.port, "/v1/sessions/h1/map?ranges=4096", AUTH, &st);
    assert_int_equal(st, 200);
    assert_false(json_is_true(json_object_get(m, "coalesced")));
    assert_int_equal((int)json_array_size(json_object_get(m, "ranges")), I(m, "runs"));
    int ev, ret;
    check_cover(m, &ev, &ret);
    assert_int_equal(ret, I(s, "retained_tokens"));
    assert_int_equal(ev, I(s, "evicted_tokens"));
    assert_true(ev > 0);
    assert_int_equal(I(m, "sinks"), 4);
    assert_int_equal(I(m, "window"), 16);
    int heavy = 0;
    size_t i;
    json_t *r;
    json_array_foreach(json_object_get(m, "ranges"), i,
                       r) if (!strcmp(json_string_value(json_object_get(r, "kind")), "heavy"))
        heavy += (int)I(r, "retained");
    assert_int_equal(heavy, I(m, "retained_tokens") - 4 - 16);
    json_decref(m);
    json_decref(s);
}

/* Keys, ids, queries, methods. */
static void test_map_errors(void **state)
{
    (void)state;
    NEED(sw);
    feed(sw.port, "sw2", 20, 3);
    struct {
        const char *method, *path, *headers;
        int status;
        const char *param;
    } cases[] = {
        {"GET", "/v1/sessions/sw2/map", "", 401, NULL},
        {"GET", "/v1/sessions/sw2/map", "Authorization: Bearer nope\r\n", 401, NULL},
        {"GET", "/v1/sessions/absent/map", AUTH, 404, "session"},
        {"GET", "/v1/sessions/bad*id/map", AUTH, 400, "session"},
        {"GET", "/v1/sessions/sw2/map?ranges=3", AUTH, 400, "ranges"},
        {"GET", "/v1/sessions/sw2/map?ranges=4097", AUTH, 400, "ranges"},
        {"GET", "/v1/sessions/sw2/map?ranges=1x", AUTH, 400, "ranges"},
        {"GET", "/v1/sessions/sw2/map?text=yes", AUTH, 400, "text"},
        {"GET", "/v1/sessions/sw2/map?colour=1", AUTH, 400, "colour"},
        {"POST", "/v1/sessions/sw2/map", AUTH, 405, NULL},
        {"GET", "/v1/config", "", 401, NULL},
        {"GET", "/v1/sessions/sw2/map?ranges=16&text=1", AUTH, 200, NULL},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        struct su_resp r;
        int st = su_http(sw.port, cases[k].method, cases[k].path, cases[k].headers, NULL, &r);
        if (st != cases[k].status)
            fail_msg("%s %s: %d, expected %d: %s", cases[k].method, cases[k].path, st,
                     cases[k].status, r.body ? r.body : "");
        json_t *v = json_loads(r.body, 0, NULL);
        su_resp_free(&r);
        assert_non_null(v);
        if (cases[k].param)
            assert_string_equal(
                json_string_value(json_object_get(json_object_get(v, "error"), "param")),
                cases[k].param);
        json_decref(v);
    }
}

/* The page's files: types, ETag, 304, methods, no key needed. */
static void test_assets(void **state)
{
    (void)state;
    NEED(sw);
    struct su_resp r;
    assert_int_equal(su_http(sw.port, "GET", "/", "", NULL, &r), 200);
    assert_non_null(strcasestr(r.head, "content-type: text/html; charset=utf-8"));
    assert_non_null(strcasestr(r.head, "content-security-policy: default-src 'none'"));
    assert_non_null(strcasestr(r.head, "cache-control: no-cache"));
    assert_non_null(strstr(r.body, "/web/app.js"));
    assert_null(strstr(r.body, "http://"));
    assert_null(strstr(r.body, "https://"));
    const char *e = strcasestr(r.head, "etag: ");
    assert_non_null(e);
    char etag[64], hdr[128];
    snprintf(etag, sizeof etag, "%.*s", (int)strcspn(e + 6, "\r"), e + 6);
    su_resp_free(&r);
    snprintf(hdr, sizeof hdr, "If-None-Match: %s\r\n", etag);
    assert_int_equal(su_http(sw.port, "GET", "/", hdr, NULL, &r), 304);
    assert_int_equal(r.len, 0);
    su_resp_free(&r);
    assert_int_equal(su_http(sw.port, "GET", "/", "If-None-Match: \"other\"\r\n", NULL, &r), 200);
    su_resp_free(&r);
    static const struct {
        const char *path, *type;
    } files[] = {{"/web/app.js", "text/javascript"},
                 {"/web/app.css", "text/css"},
                 {"/web/cachemap.js", "text/javascript"},
                 {"/index.html", "text/html"}};
    for (size_t k = 0; k < sizeof files / sizeof files[0]; k++) {
        assert_int_equal(su_http(sw.port, "GET", files[k].path, "", NULL, &r), 200);
        char want[64];
        snprintf(want, sizeof want, "content-type: %s", files[k].type);
        assert_non_null(strcasestr(r.head, want));
        assert_true(r.len > 100);
        su_resp_free(&r);
    }
    assert_int_equal(su_http(sw.port, "HEAD", "/", "", NULL, &r), 200);
    assert_int_equal(r.len, 0);
    su_resp_free(&r);
    assert_int_equal(su_http(sw.port, "POST", "/", "", "x", &r), 405);
    assert_non_null(strcasestr(r.head, "allow: GET, HEAD"));
    su_resp_free(&r);
    assert_int_equal(su_http(sw.port, "GET", "/web/absent.js", "", NULL, &r), 404);
    su_resp_free(&r);
    assert_int_equal(su_http(sw.port, "GET", "/web/absent.js", AUTH, NULL, &r), 404);
    su_resp_free(&r);
}

/* The config as check-config prints it, with origins, without the key. */
static void test_config(void **state)
{
    (void)state;
    NEED(sw);
    struct su_resp r;
    assert_int_equal(su_http(sw.port, "GET", "/v1/config", AUTH, NULL, &r), 200);
    assert_null(strstr(r.body, KEY));
    json_t *v = json_loads(r.body, 0, NULL);
    su_resp_free(&r);
    assert_non_null(v);
    assert_non_null(strstr(json_string_value(json_object_get(v, "text")), "max_cache_tokens = 64"));
    bool seen_budget = false, seen_key = false, seen_default = false;
    size_t i;
    json_t *k;
    json_array_foreach(json_object_get(v, "keys"), i, k)
    {
        const char *name = json_string_value(json_object_get(k, "key"));
        const char *origin = json_string_value(json_object_get(k, "origin"));
        const char *value = json_string_value(json_object_get(k, "value"));
        if (!strcmp(name, "max_cache_tokens")) {
            seen_budget = true;
            assert_string_equal(value, "64");
            assert_string_equal(origin, "command line");
        } else if (!strcmp(name, "api_key")) {
            seen_key = true;
            assert_string_equal(value, "(set, hidden)");
        } else if (!strcmp(name, "max_headers")) {
            seen_default = !strcmp(origin, "default");
        }
    }
    assert_true(seen_budget && seen_key && seen_default);
    assert_int_equal(I(json_object_get(v, "eviction_window"), "tokens"), 16);
    json_decref(v);
}

/* In process: the map of a real cache against the sequence's arrays, and
 * its rendered size against the bound. */
static void test_map_bound(void **state)
{
    (void)state;
    char err[512];
    struct model_params mp = {.path = model_path};
    model *m = model_load(&mp, err, sizeof err);
    assert_non_null(m);
    struct kv_cache_params cp = {
        .memory_bytes = 4 << 20, .page_tokens = 4, .k_type = KV_F16, .v_type = KV_F16};
    model_kv_shape(m, &cp);
    kv_cache *cache = kv_cache_create(&cp, err, sizeof err);
    assert_non_null(cache);
    struct kv_policy pol = {.kind = KV_EVICT_H2O,
                            .max_cache_tokens = 64,
                            .sink_tokens = 2,
                            .window_tokens = 8,
                            .heavy_tokens = 40,
                            .renumber = false};
    kv_seq *seq = kv_seq_create(cache, &pol, true, err, sizeof err);
    assert_non_null(seq);
    /* odd history tokens draw the attention: the heavy hitters scatter */
    float mass[64];
    for (int t = 0; t < 400; t++) {
        int32_t id = 3 + (t * 7919) % 500;
        assert_int_equal(kv_seq_append(seq, &id, 1, NULL), 0);
        int n = kv_seq_n_tokens(seq);
        for (int i = 0; i < n; i++)
            mass[i] = (float)(kv_seq_hist_index(seq)[i] % 2);
        kv_seq_add_mass(seq, mass);
    }
    struct engine_map_opts o = {.max_ranges = ENGINE_MAP_MAX_RANGES, .text = true};
    struct engine_cache_map *map = engine_cache_map_build(seq, m, &o);
    assert_non_null(map);
    /* every retained token is in a range with its own position */
    const int32_t *hist = kv_seq_hist_index(seq), *pos = kv_seq_positions(seq);
    int n = kv_seq_n_tokens(seq), seen = 0;
    for (int k = 0; k < map->n_ranges; k++) {
        const struct engine_map_range *r = &map->ranges[k];
        for (int i = r->first; r->first >= 0 && i <= r->last; i++, seen++) {
            assert_true(hist[i] >= r->start && hist[i] < r->end);
            assert_int_equal(pos[i], r->pos_first + (i - r->first));
        }
    }
    assert_int_equal(seen, n);
    assert_false(map->coalesced);
    assert_true(map->n_runs > 40);
    struct engine_session_info info = {0};
    json_t *v = srv_map_json(map, &info, "bound");
    char *s = json_dumps(v, JSON_COMPACT);
    assert_true(strlen(s) <= srv_map_json_bound(map));
    assert_true(srv_map_json_bound(map) <= ENGINE_MAP_MAX_BYTES);
    free(s);
    json_decref(v);
    int runs = map->n_runs;
    engine_cache_map_free(map);
    /* more runs than asked for: equal slices, covering the history, the
     * retained tokens counted */
    o.max_ranges = 16;
    map = engine_cache_map_build(seq, m, &o);
    assert_non_null(map);
    assert_true(map->coalesced);
    assert_int_equal(map->n_runs, runs);
    assert_int_equal(map->n_ranges, 16);
    int at = 0, kept = 0, mixed = 0;
    for (int k = 0; k < map->n_ranges; k++) {
        const struct engine_map_range *r = &map->ranges[k];
        assert_int_equal(r->start, at);
        at = r->end;
        kept += r->retained;
        mixed += r->kind == ENGINE_MAP_MIXED;
        assert_true(r->kind != ENGINE_MAP_MIXED ||
                    (r->retained > 0 && r->retained < r->end - r->start));
        assert_non_null(r->text);
    }
    assert_int_equal(at, kv_seq_history(seq, NULL));
    assert_int_equal(kept, n);
    assert_true(mixed > 0);
    engine_cache_map_free(map);
    /* the largest map a request can ask for stays under the limit */
    struct engine_cache_map worst = {.n_ranges = ENGINE_MAP_MAX_RANGES,
                                  .text_bytes = ENGINE_MAP_TEXT_BUDGET,
                                  .n_page_ids = ENGINE_MAP_MAX_PAGE_IDS};
    assert_true(srv_map_json_bound(&worst) <= ENGINE_MAP_MAX_BYTES);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    model_free(m);
}

static void test_query(void **state)
{
    (void)state;
    struct engine_map_opts o;
    char param[64], msg[256];
    assert_int_equal(srv_map_parse_query("", &o, param, sizeof param, msg, sizeof msg), 0);
    assert_int_equal(o.max_ranges, ENGINE_MAP_DEFAULT_RANGES);
    assert_true(o.text);
    assert_int_equal(srv_map_parse_query("ranges=16&text=0", &o, param, 64, msg, 256), 0);
    assert_int_equal(o.max_ranges, 16);
    assert_false(o.text);
    assert_int_equal(srv_map_parse_query("ranges=4096&", &o, param, 64, msg, 256), 0);
    const char *bad[] = {"ranges=15",
                         "ranges=",
                         "ranges=-20",
                         "text",
                         "text=01",
                         "x=1",
                         "ranges=99999999999999999999"};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++)
        assert_int_equal(srv_map_parse_query(bad[k], &o, param, 64, msg, 256), -EINVAL);
    char id[16];
    assert_true(srv_map_path("/v1/sessions/abc/map", id, sizeof id));
    assert_string_equal(id, "abc");
    assert_false(srv_map_path("/v1/sessions//map", id, sizeof id) && id[0]);
    assert_false(srv_map_path("/v1/sessions/abc", id, sizeof id));
    assert_false(srv_map_path("/v1/sessions/map", id, sizeof id));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_query),           cmocka_unit_test(test_map_bound),
        cmocka_unit_test(test_map_sink_window), cmocka_unit_test(test_map_h2o),
        cmocka_unit_test(test_map_errors),      cmocka_unit_test(test_assets),
        cmocka_unit_test(test_config),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
