/*
 * test_spill.c - sessions saved to disk ([sessions] dir) and read back:
 * engine/spill.c (the file), engine/spill_store.c (the directory),
 * engine/sessions_spill.c (when), cache/seq_state.c (the state).
 *
 * In-process, an engine is stepped by hand over the scratch model: a
 * session saved by one engine and continued by a second, fresh one gives
 * the same tokens and the same cached_tokens as the first engine
 * continuing it (sink-window and h2o, whose scores must come back too); the
 * pool's LRU and max_sessions save instead of losing; and every bad file
 * (corrupted, truncated, another model, another KV type) or unwritable
 * directory (read-only, full) is a log line and a cache miss whose answer
 * is a fresh session's. Through the real daemon ($KVD_BIN): a session of
 * 10,000 tokens on stories260K survives SIGTERM and a restart with the
 * output of a daemon that never stopped; a daemon killed halfway through
 * writing leaves no file that is read; GET and DELETE /v1/sessions, the
 * list in pages (limit, after, has_more) in-process and through the route.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>

#include "engine/engine.h"
#include "model/mkmodel.h"
#include "model/model.h"
#include "tests/serve_fixture.h"

/* ------------------------------------------------------------------------
 * In-process harness
 * ------------------------------------------------------------------------ */

static char logs[1 << 16]; /* the engines' log lines, appended */

static void hook_log(void *ud, enum engine_log_level level, const char *line)
{
    (void)ud;
    (void)level;
    size_t n = strlen(logs);
    snprintf(logs + n, sizeof(logs) - n, "%s\n", line);
}

static bool logged(const char *text)
{
    return strstr(logs, text) != NULL;
}

struct setup {
    const model *m;
    const char *dir; /* NULL: no [sessions] dir */
    enum kv_type kv;
    struct kv_policy pol;
    int pages;
    int max_sessions;
    bool prefix_cache;
};

static engine *make_engine(const struct setup *s)
{
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = s->kv, .v_type = s->kv};
    model_kv_shape(s->m, &shape);
    struct engine_params p = {
        .m = s->m,
        .cache_memory = kv_cache_memory_for(&shape, s->pages),
        .page_tokens = 16,
        .k_type = s->kv,
        .v_type = s->kv,
        .n_threads = 1,
        .limits = {.policy = s->pol,
                   .max_running = 2,
                   .step_tokens = 64,
                   .max_sessions = s->max_sessions ? s->max_sessions : 8},
        .hooks = {.log = hook_log},
        .spill_dir = s->dir,
        .prefix_cache = s->prefix_cache,
        .spill_max_bytes = 0,
    };
    char err[512];
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    return e;
}

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* What one greedy completion gave. */
struct answer {
    int32_t toks[64];
    int n;
    int cached;
};

/* Run prompt[0..n) on session sess (max_tokens tokens, greedy, EOS
 * ignored) to its end, pinning prompt tokens [keep_start, keep_end) (none
 * when equal). */
static struct answer run_keep(engine *e, const char *sess, const int32_t *prompt, int n,
                              int max_tokens, int keep_start, int keep_end)
{
    struct answer a = {0};
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    assert_non_null(r);
    r->prompt = malloc(sizeof(int32_t) * (size_t)n);
    assert_non_null(r->prompt);
    memcpy(r->prompt, prompt, sizeof(int32_t) * (size_t)n);
    r->n_prompt = n;
    r->max_tokens = max_tokens;
    r->ignore_eos = true;
    r->want_tokens = true;
    r->session = sess ? strdup(sess) : NULL;
    if (keep_end > keep_start) {
        r->keep = malloc(sizeof(*r->keep));
        assert_non_null(r->keep);
        r->keep[0] = (struct kv_span){keep_start, keep_end};
        r->n_keep_ranges = 1;
    }
    model_sampling_defaults(&r->sampling);
    r->sampling.temperature = 0;
    assert_int_equal(engine_submit(e, r), 0);
    bool done = false;
    for (int steps = 0; !done && steps < 100000; steps++) {
        engine_step(e, mono_ns());
        for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
            next = ev->next;
            if (ev->kind == ENGINE_EV_TEXT)
                for (int i = 0; i < ev->n_tokens && a.n < 64; i++)
                    a.toks[a.n++] = ev->tokens[i];
            if (ev->kind == ENGINE_EV_DONE) {
                a.cached = ev->usage.cached_tokens;
                done = true;
            }
            if (ev->kind == ENGINE_EV_ERROR)
                fail_msg("request failed: %d %s", ev->status, ev->message);
            engine_event_free(ev);
        }
    }
    assert_true(done);
    engine_req_free(r);
    return a;
}

static struct answer run(engine *e, const char *sess, const int32_t *prompt, int n, int max_tokens)
{
    return run_keep(e, sess, prompt, n, max_tokens, 0, 0);
}

/* The engine's counters of [sessions] dir. */
static struct engine_spill_stats spill_stats(const engine *e)
{
    struct engine_stats st;
    engine_get_stats(e, &st);
    return st.spill;
}

/* Session id's pinned spans (GET /v1/sessions/ID's) into sp; the count. */
static int session_pins(engine *e, const char *id, struct kv_span sp[KV_MAX_PINS])
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_SESSION_INFO);
    assert_non_null(r);
    r->session = strdup(id);
    assert_int_equal(engine_submit(e, r), 0);
    int n = -1;
    for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
        next = ev->next;
        if (ev->kind == ENGINE_EV_DONE && ev->req == r) {
            assert_true(ev->session.found);
            n = ev->session.n_pins;
            memcpy(sp, ev->session.pins, sizeof(*sp) * (size_t)n);
        }
        engine_event_free(ev);
    }
    engine_req_free(r);
    return n;
}

static void assert_same(const struct answer *a, const struct answer *b)
{
    assert_int_equal(a->n, b->n);
    for (int i = 0; i < a->n; i++)
        if (a->toks[i] != b->toks[i])
            fail_msg("token %d: %d != %d", i, a->toks[i], b->toks[i]);
}

/* Prompt ids 1 + (i * 7 + seed) % 500: n of them into p. */
static void fill_prompt(int32_t *p, int n, int seed)
{
    for (int i = 0; i < n; i++)
        p[i] = 1 + (i * 7 + seed) % 500;
}

static char spill_dir[600];

/* A fresh, empty session directory in the scratch folder. */
static const char *fresh_dir(const char *name)
{
    snprintf(spill_dir, sizeof(spill_dir), "%s/%s", tmpdir, name);
    mkdir(spill_dir, 0700);
    return spill_dir;
}

/* The one .kvs file in dir (path into out): true if there is exactly one;
 * *tmp_files counts the .tmp ones. */
static int count_files(const char *dir, const char *suffix, char *out, size_t outlen)
{
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *de; (de = readdir(d)) != NULL;) {
        size_t len = strlen(de->d_name), k = strlen(suffix);
        if (len > k && !strcmp(de->d_name + len - k, suffix)) {
            n++;
            if (out)
                snprintf(out, outlen, "%s/%s", dir, de->d_name);
        }
    }
    closedir(d);
    return n;
}

static const struct kv_policy sink_window = {.kind = KV_EVICT_SINK_WINDOW,
                                             .max_cache_tokens = 128,
                                             .sink_tokens = 4,
                                             .window_tokens = 96,
                                             .renumber = true};
static const struct kv_policy h2o = {.kind = KV_EVICT_H2O,
                                     .max_cache_tokens = 128,
                                     .sink_tokens = 4,
                                     .window_tokens = 32,
                                     .heavy_tokens = 64,
                                     .renumber = true};

#define N1 300 /* first prompt: well past max_cache_tokens, so it evicts */
#define G1 12  /* tokens generated by the first request */
#define N2 (N1 + G1 - 1 + 20)

/* The second prompt: the first, what it generated (the last sampled token
 * was never fed), 20 more. */
static void second_prompt(int32_t *p2, const int32_t *p1, const struct answer *a1)
{
    memcpy(p2, p1, sizeof(int32_t) * N1);
    memcpy(p2 + N1, a1->toks, sizeof(int32_t) * (G1 - 1));
    fill_prompt(p2 + N1 + G1 - 1, 20, 3);
}

/*
 * Engine A serves a session, saves it (as at SIGTERM) and goes on; engine B
 * starts over the same directory and continues the session from the file.
 * Both must report the same cached tokens and give the same tokens, and
 * keep the same retained ids (the same eviction decisions after).
 */
static void roundtrip(const struct kv_policy *pol, enum kv_type kv)
{
    struct setup s = {.m = lib_model,
                      .dir = fresh_dir(pol->kind == KV_EVICT_H2O ? "rt-h2o" : "rt"),
                      .kv = kv,
                      .pol = *pol,
                      .pages = 64};
    engine *a = make_engine(&s);
    int32_t p1[N1], p2[N2];
    fill_prompt(p1, N1, 0);
    struct answer a1 = run(a, "s", p1, N1, G1);
    assert_int_equal(a1.cached, 0);
    engine_save_sessions(a);
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 1);
    assert_true(logged("session s saved to disk (shutdown)"));

    engine *b = make_engine(&s);
    second_prompt(p2, p1, &a1);
    struct answer b2 = run(b, "s", p2, N2, G1);
    assert_true(logged("session s restored from disk"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 0); /* back in memory */
    struct answer a2 = run(a, "s", p2, N2, G1);
    print_message("%s/%s: cached %d (restored) vs %d (never stopped)\n",
                  kv_policy_kind_name(pol->kind), kv_type_name(kv), b2.cached, a2.cached);
    assert_int_equal(a2.cached, N1 + G1 - 1);
    assert_int_equal(b2.cached, a2.cached);
    assert_same(&b2, &a2);
    int na, nb;
    const int32_t *ta = engine_session_tokens(a, "s", &na);
    const int32_t *tb = engine_session_tokens(b, "s", &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(ta, tb, sizeof(int32_t) * (size_t)na);
    engine_destroy(a);
    engine_destroy(b);
}

static void test_roundtrip_sink_window(void **state)
{
    (void)state;
    roundtrip(&sink_window, KV_F16);
}

static void test_roundtrip_h2o(void **state)
{
    (void)state;
    roundtrip(&h2o, KV_F32);
}

/* max_sessions and the pool's LRU save the session they end; it comes
 * back as if it had stayed. The reference engine has room for all. */
static void test_lru_saves(void **state)
{
    (void)state;
    struct setup ref_s = {.m = lib_model, .kv = KV_F16, .pol = sink_window, .pages = 64};
    engine *ref = make_engine(&ref_s);
    /* max_sessions = 1: the second session ends the first. */
    struct setup s = ref_s;
    s.dir = fresh_dir("lru");
    s.max_sessions = 1;
    engine *e = make_engine(&s);
    int32_t p1[N1], p2[N2], q[N1];
    fill_prompt(p1, N1, 0);
    fill_prompt(q, N1, 5);
    struct answer a1 = run(e, "one", p1, N1, G1);
    struct answer r1 = run(ref, "one", p1, N1, G1);
    assert_same(&a1, &r1);
    run(e, "two", q, N1, 4);
    assert_true(logged("session one saved to disk (max_sessions)"));
    struct engine_spill_stats ss = spill_stats(e);
    assert_int_equal(ss.saved, 1);
    assert_true(ss.bytes_saved > 0);
    assert_int_equal(ss.restored, 0);
    second_prompt(p2, p1, &a1);
    struct answer a2 = run(e, "one", p2, N2, G1);
    /* "two" went to disk for "one" to come back, whose file was as long */
    ss = spill_stats(e);
    assert_int_equal(ss.saved, 2);
    assert_int_equal(ss.restored, 1);
    assert_true(ss.bytes_restored > 0 && ss.bytes_restored < ss.bytes_saved);
    assert_int_equal(ss.refused, 0);
    struct answer r2 = run(ref, "one", p2, N2, G1);
    assert_int_equal(a2.cached, r2.cached);
    assert_same(&a2, &r2);
    engine_destroy(e);

    /* A pool of 12 pages holds one session of 128 tokens (9 pages): the
     * second session's prompt makes the pool drop the first. */
    s.dir = fresh_dir("pool");
    s.max_sessions = 8;
    s.pages = 12;
    e = make_engine(&s);
    a1 = run(e, "one", p1, N1, G1);
    run(e, "two", q, N1, 4);
    assert_true(logged("session one saved to disk (the pool needed its pages)"));
    a2 = run(e, "one", p2, N2, G1);
    assert_int_equal(a2.cached, r2.cached);
    assert_same(&a2, &r2);
    engine_destroy(e);
    engine_destroy(ref);
}

/*
 * Pinned spans travel in the file (format 2): a session whose first request
 * pinned prompt tokens [100, 120) is saved and read back by another engine
 * with the same pins, keeps those tokens through the evictions of its next
 * request, and ends exactly as the session that never left (the same
 * tokens, the same retained ids; without its pins it would have evicted
 * them).
 */
static void test_pins_saved(void **state)
{
    (void)state;
    struct kv_policy pol = sink_window;
    pol.window_auto = true; /* the pins take their room from the window */
    struct setup s = {.m = lib_model, .dir = fresh_dir("pins"), .kv = KV_F16, .pol = pol,
                      .pages = 64};
    engine *a = make_engine(&s);
    int32_t p1[N1], p2[N2];
    fill_prompt(p1, N1, 0);
    struct answer a1 = run_keep(a, "s", p1, N1, G1, 100, 120);
    struct kv_span sp[KV_MAX_PINS];
    assert_int_equal(session_pins(a, "s", sp), 1);
    engine_save_sessions(a);
    engine *b = make_engine(&s);
    second_prompt(p2, p1, &a1);
    logs[0] = '\0';
    struct answer b2 = run(b, "s", p2, N2, G1);
    assert_true(logged("session s restored from disk"));
    assert_int_equal(session_pins(b, "s", sp), 1);
    assert_int_equal(sp[0].start, 100);
    assert_int_equal(sp[0].end, 120);
    struct answer a2 = run(a, "s", p2, N2, G1);
    assert_int_equal(b2.cached, a2.cached);
    assert_same(&b2, &a2);
    int na, nb;
    const int32_t *ta = engine_session_tokens(a, "s", &na);
    const int32_t *tb = engine_session_tokens(b, "s", &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(ta, tb, sizeof(int32_t) * (size_t)na);
    bool kept = false; /* the pinned tokens, in a row, among the few retained */
    for (int i = 0; i + 20 <= nb && !kept; i++)
        kept = memcmp(tb + i, p1 + 100, sizeof(int32_t) * 20) == 0;
    assert_true(kept);
    assert_true(nb < N2 - 100);
    engine_destroy(a);
    engine_destroy(b);
}

/* ------------------------------------------------------------------------
 * GET /v1/sessions in pages
 * ------------------------------------------------------------------------ */

/* One page of the session list from the engine (limit 0: the default;
 * after NULL: from the first). */
static struct engine_session_list *list_page(engine *e, int limit, const char *after)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_SESSION_LIST);
    assert_non_null(r);
    r->list.limit = limit;
    r->list.after = after ? strdup(after) : NULL;
    assert_int_equal(engine_submit(e, r), 0);
    struct engine_session_list *l = NULL;
    for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
        next = ev->next;
        if (ev->kind == ENGINE_EV_DONE) {
            l = ev->list;
            ev->list = NULL;
        }
        engine_event_free(ev);
    }
    engine_req_free(r);
    assert_non_null(l);
    return l;
}

#define N_LIST 130 /* sessions: more than a default page */

/*
 * 130 sessions, created out of id order, all but the 4 max_sessions keeps
 * saved to disk: the default page is the first 100 ids in order with
 * has_more, the page after its last id the other 30 without; together
 * they hold every session exactly once, memory and disk alike. A cursor
 * between two ids, before the first or at the last, and a page that ends
 * exactly at the last id, list what they should.
 */
static void test_list_pages(void **state)
{
    (void)state;
    struct setup s = {.m = lib_model, .kv = KV_F32, .pol = sink_window, .pages = 64};
    s.dir = fresh_dir("list");
    s.max_sessions = 4;
    engine *e = make_engine(&s);
    char id[16];
    for (int k = 0; k < N_LIST; k++) {
        int i = (k * 37) % N_LIST; /* 37 is prime to 130: every id once, shuffled */
        int32_t p[4];
        fill_prompt(p, 4, i);
        snprintf(id, sizeof(id), "s%03d", i);
        run(e, id, p, 4, 1);
    }
    struct engine_session_list *a = list_page(e, 0, NULL);
    assert_int_equal(a->n, ENGINE_LIST_DEFAULT);
    assert_true(a->has_more);
    struct engine_session_list *b = list_page(e, 0, a->items[a->n - 1].id);
    assert_int_equal(b->n, N_LIST - ENGINE_LIST_DEFAULT);
    assert_false(b->has_more);
    int saved = 0;
    for (int i = 0; i < N_LIST; i++) {
        const struct engine_session_item *it = i < a->n ? &a->items[i] : &b->items[i - a->n];
        snprintf(id, sizeof(id), "s%03d", i);
        assert_string_equal(it->id, id);
        assert_int_equal(it->history_tokens, 4);
        saved += it->saved;
    }
    assert_int_equal(saved, N_LIST - 4);
    engine_session_list_free(a);
    engine_session_list_free(b);

    a = list_page(e, ENGINE_LIST_MAX, NULL); /* all of them */
    assert_int_equal(a->n, N_LIST);
    assert_false(a->has_more);
    engine_session_list_free(a);
    a = list_page(e, 3, "s0505"); /* between s050 and s051 */
    assert_int_equal(a->n, 3);
    assert_string_equal(a->items[0].id, "s051");
    assert_true(a->has_more);
    engine_session_list_free(a);
    a = list_page(e, 7, "s122"); /* s123 .. s129: the page ends at the last */
    assert_int_equal(a->n, 7);
    assert_string_equal(a->items[6].id, "s129");
    assert_false(a->has_more);
    engine_session_list_free(a);
    a = list_page(e, 5, "a"); /* before every id */
    assert_string_equal(a->items[0].id, "s000");
    engine_session_list_free(a);
    a = list_page(e, 5, "s129"); /* after every id */
    assert_int_equal(a->n, 0);
    assert_false(a->has_more);
    engine_session_list_free(a);
    engine_destroy(e);
}

/* ------------------------------------------------------------------------
 * Faults: every bad file or directory is a log line and a miss
 * ------------------------------------------------------------------------ */

/* A session saved to a fresh dir by an engine of setup s; *a1 what its
 * first request gave. Returns the file's path in path. */
static void save_one(const struct setup *s, int32_t *p1, struct answer *a1, char *path,
                     size_t pathlen)
{
    engine *a = make_engine(s);
    fill_prompt(p1, N1, 0);
    *a1 = run(a, "s", p1, N1, G1);
    engine_save_sessions(a);
    engine_destroy(a);
    assert_int_equal(count_files(s->dir, ".kvs", path, pathlen), 1);
}

/* The second request on an engine of setup s must be a miss that answers
 * as a fresh session does; `refused` files were refused on the way (the
 * engine's counters: nothing restored). */
static void expect_miss(const struct setup *s, const int32_t *p2, int refused)
{
    engine *b = make_engine(s);
    struct answer b2 = run(b, "s", p2, N2, G1);
    struct engine_spill_stats ss = spill_stats(b);
    assert_int_equal(ss.refused, refused);
    assert_int_equal(ss.restored, 0);
    assert_int_equal(ss.bytes_restored, 0);
    engine_destroy(b);
    struct setup plain = *s;
    plain.dir = NULL;
    engine *f = make_engine(&plain);
    struct answer f2 = run(f, "s", p2, N2, G1);
    engine_destroy(f);
    assert_int_equal(b2.cached, 0);
    assert_int_equal(f2.cached, 0);
    assert_same(&b2, &f2);
}

static void flip_byte(const char *path, long at)
{
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, at, SEEK_SET), 0);
    int c = fgetc(f);
    assert_int_equal(fseek(f, at, SEEK_SET), 0);
    fputc(c ^ 0x10, f);
    fclose(f);
}

static long file_size(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return (long)sb.st_size;
}

/* Save a session, damage its file (damage(path, k)), and expect the next
 * request to be a miss that logs `want` and removes the file. */
static void damaged_is_miss(const char *name, void (*damage)(const char *path, int k), int k,
                            const char *want)
{
    struct setup s = {
        .m = lib_model, .dir = fresh_dir(name), .kv = KV_F16, .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    save_one(&s, p1, &a1, path, sizeof(path));
    damage(path, k);
    logs[0] = '\0';
    second_prompt(p2, p1, &a1);
    expect_miss(&s, p2, 1);
    if (!logged(want))
        fail_msg("no log line with '%s' in:\n%s", want, logs);
    assert_true(logged("its file is refused"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 0); /* removed */
}

/* k = 0: one flipped bit in a K/V row near the end; 1: in the header. */
static void corrupt(const char *path, int k)
{
    flip_byte(path, k == 0 ? file_size(path) - 40 : 30);
}

/* k = 0: cut in half; 1: inside the header; 2: one byte short. */
static void cut(const char *path, int k)
{
    long size = file_size(path);
    assert_int_equal(truncate(path, k == 0 ? size / 2 : k == 1 ? 100 : size - 1), 0);
}

static void test_fault_corrupted(void **state)
{
    (void)state;
    damaged_is_miss("corrupt", corrupt, 0, "payload checksum mismatch");
    damaged_is_miss("corrupt", corrupt, 1, "header checksum mismatch");
}

static void test_fault_truncated(void **state)
{
    (void)state;
    for (int k = 0; k < 3; k++)
        damaged_is_miss("trunc", cut, k, "truncated");
}

/* A file of format version 1 (before pinned spans) is refused and left
 * alone, a miss like another model's file; the session's next save writes
 * over it. */
static void test_fault_old_version(void **state)
{
    (void)state;
    struct setup s = {.m = lib_model, .dir = fresh_dir("v1"), .kv = KV_F16, .pol = sink_window,
                      .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    save_one(&s, p1, &a1, path, sizeof(path));
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    uint32_t v1 = 1;
    assert_int_equal(fseek(f, 12, SEEK_SET), 0);
    assert_int_equal(fwrite(&v1, 4, 1, f), 1);
    fclose(f);
    second_prompt(p2, p1, &a1);
    logs[0] = '\0';
    expect_miss(&s, p2, 1);
    assert_true(logged("format version (1)"));
    assert_true(logged("its file is refused"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 1);
}

/* A file written for another model (or another KV type) is refused and
 * left alone: it may be another daemon's. */
static void test_fault_foreign(void **state)
{
    (void)state;
    char dir2[256], path2[512], err[512];
    assert_int_equal(su_scratch_model("spill-other", 99, dir2, sizeof(dir2), path2, sizeof(path2)),
                     0);
    struct model_params mp = {.path = path2};
    model *other = model_load(&mp, err, sizeof(err));
    assert_non_null(other);
    struct setup s = {
        .m = other, .dir = fresh_dir("foreign"), .kv = KV_F16, .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    save_one(&s, p1, &a1, path, sizeof(path));
    second_prompt(p2, p1, &a1);
    s.m = lib_model; /* the same shapes, another model */
    logs[0] = '\0';
    expect_miss(&s, p2, 1);
    assert_true(logged("written for another model"));
    /* The fresh session was saved nowhere yet; the foreign file stays. */
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 1);
    /* The same model with K/V stored in another type: refused too. */
    s.m = other;
    s.kv = KV_F32;
    logs[0] = '\0';
    expect_miss(&s, p2, 1);
    assert_true(logged("written for another model or KV type"));
    model_free(other);
    su_remove_dir(dir2);
}

/* Make dir unwritable: chmod for a user, the immutable flag for root
 * (whom modes do not stop). False when neither works here. */
static bool make_readonly(const char *dir, bool on)
{
    if (geteuid() != 0)
        return chmod(dir, on ? 0500 : 0700) == 0;
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0)
        return false;
    int flags = 0;
    bool ok = ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0;
    flags = on ? flags | FS_IMMUTABLE_FL : flags & ~FS_IMMUTABLE_FL;
    ok = ok && ioctl(fd, FS_IOC_SETFLAGS, &flags) == 0;
    close(fd);
    return ok;
}

static void test_fault_readonly_dir(void **state)
{
    (void)state;
    struct setup s = {
        .m = lib_model, .dir = fresh_dir("ro"), .kv = KV_F16, .pol = sink_window, .pages = 64};
    if (!make_readonly(s.dir, true)) {
        print_message("cannot make a directory read-only here (mode or immutable flag): skipped\n");
        skip();
    }
    char probe[700];
    snprintf(probe, sizeof(probe), "%s/probe", s.dir);
    int fd = open(probe, O_WRONLY | O_CREAT, 0600);
    if (fd >= 0) {
        close(fd);
        unlink(probe);
        make_readonly(s.dir, false);
        print_message("the read-only directory can still be written here: skipped\n");
        skip();
    }
    logs[0] = '\0';
    engine *a = make_engine(&s);
    assert_true(logged("is not writable"));
    int32_t p1[N1], p2[N2];
    fill_prompt(p1, N1, 0);
    struct answer a1 = run(a, "s", p1, N1, G1);
    engine_save_sessions(a); /* fails, says so, and the engine goes on */
    struct engine_spill_stats ss = spill_stats(a);
    assert_int_equal(ss.save_failed, 1);
    assert_int_equal(ss.saved, 0);
    engine_destroy(a);
    make_readonly(s.dir, false);
    assert_true(logged("session s lost: cannot save it (shutdown)"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0) + count_files(s.dir, ".tmp", NULL, 0), 0);
    second_prompt(p2, p1, &a1);
    expect_miss(&s, p2, 0);
}

/* A full disk, as the file-size limit makes one (EFBIG where ENOSPC would
 * be): the write fails with a log line, no .tmp is left behind, and the
 * engine goes on (the session was restored from its earlier file, which
 * went then, so nothing is on disk). */
static void test_fault_disk_full(void **state)
{
    (void)state;
    struct setup s = {
        .m = lib_model, .dir = fresh_dir("full"), .kv = KV_F16, .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    save_one(&s, p1, &a1, path, sizeof(path));
    long size = file_size(path);
    /* Continue the session, then save it again with room for half a file. */
    engine *a = make_engine(&s);
    second_prompt(p2, p1, &a1);
    struct answer a2 = run(a, "s", p2, N2, G1);
    assert_int_equal(a2.cached, N1 + G1 - 1);
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = (rlim_t)size / 2;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    logs[0] = '\0';
    assert_int_equal(setrlimit(RLIMIT_FSIZE, &lim), 0);
    engine_save_sessions(a);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    engine_destroy(a);
    assert_true(logged("session s lost: cannot save it"));
    assert_int_equal(count_files(s.dir, ".tmp", NULL, 0), 0);
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 0);
}

/*
 * A model with sliding-window layers (cache/window.c): a session file holds
 * every layer's rows of every retained token, and those layers dropped the
 * rows past their window, so its sessions are not saved. The start says
 * so, the save is a log line with the reason, and the next engine's answer
 * is a fresh session's (a cache miss, never a wrong answer); the prefix
 * cache is off with its reason too.
 */
static void test_windowed_not_saved(void **state)
{
    (void)state;
    struct model_mk_params mp;
    model_mk_defaults(&mp);
    mp.arch = "gemma3";
    mp.n_embd = 64;
    mp.n_head = 4;
    mp.n_kv_head = 2;
    mp.head_dim = 16;
    mp.n_layer = 6;
    mp.n_ff = 96;
    mp.n_vocab = 600;
    mp.sliding_window = 16;
    mp.seed = 3;
    char path[700], err[512];
    snprintf(path, sizeof(path), "%s/windowed.gguf", tmpdir);
    assert_int_equal(model_mk_write(&mp, path, err, sizeof(err)), 0);
    struct model_params lp = {.path = path};
    model *m = model_load(&lp, err, sizeof(err));
    assert_non_null(m);
    struct setup s = {.m = m, .dir = fresh_dir("windowed"), .kv = KV_F16, .pol = sink_window,
                      .pages = 64, .prefix_cache = true};
    logs[0] = '\0';
    engine *a = make_engine(&s);
    assert_true(logged("prefix cache: off (sliding-window layers keep per-sequence pages)"));
    assert_true(logged("sessions: not saved to disk after all"));
    int32_t p1[N1], p2[N2];
    fill_prompt(p1, N1, 0);
    struct answer a1 = run(a, "s", p1, N1, G1);
    engine_save_sessions(a);
    engine_destroy(a);
    assert_true(logged("session s lost: cannot save it (shutdown)"));
    assert_true(logged("sliding-window layers"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0) + count_files(s.dir, ".tmp", NULL, 0), 0);
    second_prompt(p2, p1, &a1);
    expect_miss(&s, p2, 0);
    model_free(m);
}

/* ------------------------------------------------------------------------
 * Through the daemon: restart, kill -9 while writing, the routes
 * ------------------------------------------------------------------------ */

/* Start `kvd serve` on model_file with ARGS, its log in the scratch folder
 * as NAME.log. */
static void start(struct su_proc *p, const char *name, const char *model_file,
                  const char *const *args, int n_args)
{
    memset(p, 0, sizeof(*p));
    snprintf(p->log, sizeof(p->log), "%s/%s.log", tmpdir, name);
    if (su_serve(p, kvd_bin, model_file, args, n_args) != 0)
        fail_msg("kvd serve (%s) did not start", name);
}

static void stop(struct su_proc *p)
{
    int rc = su_stop(p, SIGTERM, 60);
    if (rc != 0)
        su_dump_log(p);
    assert_int_equal(rc, 0);
}

/* A /completion on a session with a token-array prompt, greedy. */
static json_t *turn(int port, const char *session, json_t *ids, int n_predict)
{
    int st;
    json_t *v =
        su_post(port, "/completion", NULL,
                json_pack("{s:O, s:i, s:f, s:s, s:b}", "prompt", ids, "n_predict", n_predict,
                          "temperature", 0.0, "session", session, "return_tokens", 1),
                &st);
    if (st != 200)
        print_message("turn: status %d\n", st);
    assert_int_equal(st, 200);
    return v;
}

static int kvd_int(json_t *v, const char *key)
{
    return (int)json_integer_value(json_object_get(json_object_get(v, "kvd"), key));
}

/* GET path: the status, the body parsed into *out (may be NULL). */
static int get_json(int port, const char *method, const char *path, json_t **out)
{
    struct su_resp r;
    int st = su_http(port, method, path, NULL, NULL, &r);
    if (out)
        *out = r.body ? json_loads(r.body, 0, NULL) : NULL;
    su_resp_free(&r);
    return st;
}

/* Token ids of a story of at least n tokens (tokenized in-process). */
static json_t *story_ids(const model *m, int n)
{
    size_t cap = (size_t)n * 16 + 256, len = 0;
    char *text = malloc(cap);
    assert_non_null(text);
    len += (size_t)snprintf(text, cap, "Once upon a time, there was a little girl named Lily.");
    for (int k = 0; len + 128 < cap; k++)
        len += (size_t)snprintf(text + len, cap - len,
                                " On day %d she saw %d birds by the river and sang to them.", k,
                                k * 7 % 31);
    int32_t *ids = malloc(sizeof(int32_t) * cap);
    assert_non_null(ids);
    int got = model_tokenize(m, text, len, true, ids, (int)cap);
    assert_true(got >= n);
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    free(ids);
    free(text);
    return a;
}

/*
 * A session of 10,000 tokens on stories260K, max_cache_tokens 512 (so it
 * evicted most of them), is saved at SIGTERM; a restarted daemon lists it,
 * continues it with cached_tokens equal to its whole matched history and
 * gives the tokens of a daemon that never stopped; DELETE removes its file.
 */
static void test_restart_continues(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *shared = getenv("KVD_SHARED");
    char stories[600];
    snprintf(stories, sizeof(stories), "%s/models/stories260K.gguf", shared ? shared : "../shared");
    if (access(stories, R_OK) != 0) {
        print_message("%s is absent: skipped\n", stories);
        skip();
    }
    char err[512];
    struct model_params mp = {.path = stories};
    model *m = model_load(&mp, err, sizeof(err));
    assert_non_null(m);
    json_t *p1 = story_ids(m, 10000);
    json_t *more = story_ids(m, 30); /* the next user text (a story start again) */
    model_free(m);

    const char *dir = fresh_dir("restart");
    char set_dir[700];
    snprintf(set_dir, sizeof(set_dir), "sessions.dir=%s", dir);
    const char *with_dir[] = {"--set", set_dir,           "--set", "eviction.max_cache_tokens=512",
                              "--set", "server.threads=1"};
    const char *plain[] = {"--set", "eviction.max_cache_tokens=512", "--set", "server.threads=1"};
    struct su_proc a, ref;
    start(&a, "restart-a", stories, with_dir, 6);
    start(&ref, "restart-ref", stories, plain, 4);

    json_t *va = turn(a.port, "long", p1, 16), *vr = turn(ref.port, "long", p1, 16);
    assert_true(json_equal(json_object_get(va, "tokens"), json_object_get(vr, "tokens")));
    assert_true(kvd_int(va, "retained_tokens") <= 512);
    assert_true(kvd_int(va, "evicted_tokens") > 9000);
    int n_gen = (int)json_array_size(json_object_get(va, "tokens"));
    assert_int_equal(n_gen, 16);
    int n_hist = 10000 + n_gen - 1; /* the last sampled token was never fed */
    json_t *p2 = json_deep_copy(p1);
    for (int i = 0; i < n_gen - 1; i++)
        json_array_append(p2, json_array_get(json_object_get(va, "tokens"), (size_t)i));
    json_array_extend(p2, more);
    json_decref(va);
    json_decref(vr);

    /* SIGTERM: the session goes to disk. */
    stop(&a);
    assert_true(su_file_has(a.log, "session long saved to disk (shutdown)"));
    assert_int_equal(count_files(dir, ".kvs", NULL, 0), 1);

    /* A new daemon lists it, then continues it. */
    start(&a, "restart-b", stories, with_dir, 6);
    json_t *list;
    assert_int_equal(get_json(a.port, "GET", "/v1/sessions", &list), 200);
    json_t *item = json_array_get(json_object_get(list, "data"), 0);
    assert_string_equal(json_string_value(json_object_get(item, "id")), "long");
    assert_string_equal(json_string_value(json_object_get(item, "state")), "saved");
    assert_int_equal(json_integer_value(json_object_get(item, "tokens")), n_hist);
    double file_bytes = (double)json_integer_value(json_object_get(item, "bytes"));
    assert_true(file_bytes > 0);
    json_decref(list);
    va = turn(a.port, "long", p2, 16);
    vr = turn(ref.port, "long", p2, 16);
    print_message("after the restart: cached_tokens %d (never stopped: %d), %d retained\n",
                  kvd_int(va, "cached_tokens"), kvd_int(vr, "cached_tokens"),
                  kvd_int(va, "retained_tokens"));
    assert_int_equal(kvd_int(va, "cached_tokens"), n_hist);
    assert_int_equal(kvd_int(vr, "cached_tokens"), n_hist);
    assert_true(json_equal(json_object_get(va, "tokens"), json_object_get(vr, "tokens")));
    assert_int_equal(kvd_int(va, "retained_tokens"), kvd_int(vr, "retained_tokens"));
    assert_true(su_file_has(a.log, "session long restored from disk"));
    assert_true(su_metric(a.port, "kvd_sessions_restored_total") == 1);
    assert_true(su_metric(a.port, "kvd_sessions_restored_bytes_total") == file_bytes);
    assert_true(su_metric(a.port, "kvd_sessions_restore_refused_total") == 0);
    assert_true(su_metric(a.port, "kvd_sessions_spilled_total") == 0);
    json_decref(va);
    json_decref(vr);

    /* Saved again at the next stop; DELETE on a third daemon removes the
     * file, and the session is gone. */
    stop(&a);
    assert_int_equal(count_files(dir, ".kvs", NULL, 0), 1);
    start(&a, "restart-c", stories, with_dir, 6);
    json_t *info;
    assert_int_equal(get_json(a.port, "GET", "/v1/sessions/long", &info), 200);
    assert_true(json_is_true(json_object_get(info, "saved")));
    json_decref(info);
    assert_int_equal(get_json(a.port, "DELETE", "/v1/sessions/long", NULL), 200);
    assert_int_equal(count_files(dir, ".kvs", NULL, 0), 0);
    assert_int_equal(get_json(a.port, "GET", "/v1/sessions/long", NULL), 404);
    stop(&a);
    stop(&ref);
    json_decref(p1);
    json_decref(p2);
    json_decref(more);
}

/*
 * kill -9 while a session is being written (KVD_FAULT_SPILL_STALL_MS holds
 * the write halfway): only a .tmp is left; the next daemon removes it,
 * lists nothing and serves the session as a new one, answering as a fresh
 * session does.
 */
static void test_kill_during_write(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    const char *dir = fresh_dir("kill9");
    char set_dir[700];
    snprintf(set_dir, sizeof(set_dir), "sessions.dir=%s", dir);
    const char *args[] = {"--set", set_dir, "--set", "eviction.max_cache_tokens=128"};
    int32_t p1[N1];
    fill_prompt(p1, N1, 0);
    json_t *ids = json_array();
    for (int i = 0; i < N1; i++)
        json_array_append_new(ids, json_integer(p1[i]));
    struct su_proc s;
    setenv("KVD_FAULT_SPILL_STALL_MS", "20000", 1);
    start(&s, "kill9-a", model_path, args, 4);
    unsetenv("KVD_FAULT_SPILL_STALL_MS");
    json_t *v = turn(s.port, "k", ids, G1);
    json_array_extend(ids, json_object_get(v, "tokens"));
    json_decref(v);
    kill(-s.pid, SIGTERM);
    double deadline = su_now() + 30;
    while (count_files(dir, ".tmp", NULL, 0) == 0 && su_now() < deadline)
        su_sleep_ms(20);
    assert_int_equal(count_files(dir, ".tmp", NULL, 0), 1);
    su_stop(&s, SIGKILL, 10);
    assert_int_equal(count_files(dir, ".kvs", NULL, 0), 0);

    start(&s, "kill9-b", model_path, args, 4);
    json_t *list;
    assert_int_equal(get_json(s.port, "GET", "/v1/sessions", &list), 200);
    assert_int_equal(json_array_size(json_object_get(list, "data")), 0);
    json_decref(list);
    assert_int_equal(count_files(dir, ".tmp", NULL, 0), 0);
    assert_true(su_file_has(s.log, "a write cut short"));
    v = turn(s.port, "k", ids, G1);
    json_t *fresh = turn(s.port, "fresh", ids, G1);
    assert_int_equal(kvd_int(v, "cached_tokens"), 0);
    assert_true(json_equal(json_object_get(v, "tokens"), json_object_get(fresh, "tokens")));
    json_decref(v);
    json_decref(fresh);
    json_decref(ids);
    stop(&s);
}

/* GET path, which must answer status; its "error.param" when it is not
 * 200, else its body (new). */
static json_t *list_get(int port, const char *path, int status)
{
    json_t *v = NULL;
    int st = get_json(port, "GET", path, &v);
    if (st != status)
        fail_msg("GET %s: %d, expected %d", path, st, status);
    assert_non_null(v);
    return v;
}

/*
 * Through the daemon: pages of limit=2 follow the ids in order, each
 * naming its first and last id, the next asked for with after=<last_id>
 * (percent-encoded as URLSearchParams sends ':'); a bad limit, cursor or
 * parameter is a 400 naming it.
 */
static void test_list_route(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    struct su_proc srv;
    start(&srv, "list", model_path, NULL, 0);
    const char *ids[] = {"b", "a:1", "d", "a.2", "c"}; /* in order: a.2 a:1 b c d */
    json_t *prompt = json_pack("[i, i, i, i]", 5, 6, 7, 8);
    for (int i = 0; i < 5; i++)
        json_decref(turn(srv.port, ids[i], prompt, 1));
    json_decref(prompt);

    static const struct {
        const char *path, *first, *last;
        int n;
        bool more;
    } pages[] = {
        {"/v1/sessions?limit=2", "a.2", "a:1", 2, true},
        {"/v1/sessions?limit=2&after=a%3A1", "b", "c", 2, true},
        {"/v1/sessions?after=c&limit=2", "d", "d", 1, false},
        {"/v1/sessions", "a.2", "d", 5, false},
    };
    for (size_t k = 0; k < sizeof(pages) / sizeof(pages[0]); k++) {
        json_t *v = list_get(srv.port, pages[k].path, 200);
        assert_string_equal(json_string_value(json_object_get(v, "object")), "list");
        assert_int_equal(json_array_size(json_object_get(v, "data")), pages[k].n);
        assert_string_equal(json_string_value(json_object_get(v, "first_id")), pages[k].first);
        assert_string_equal(json_string_value(json_object_get(v, "last_id")), pages[k].last);
        assert_true(json_is_true(json_object_get(v, "has_more")) == pages[k].more);
        json_t *first = json_array_get(json_object_get(v, "data"), 0);
        assert_string_equal(json_string_value(json_object_get(first, "id")), pages[k].first);
        assert_string_equal(json_string_value(json_object_get(first, "state")), "memory");
        json_decref(v);
    }
    json_t *v = list_get(srv.port, "/v1/sessions?after=d", 200); /* past the last */
    assert_int_equal(json_array_size(json_object_get(v, "data")), 0);
    assert_true(json_is_null(json_object_get(v, "first_id")));
    assert_true(json_is_null(json_object_get(v, "last_id")));
    assert_true(json_is_false(json_object_get(v, "has_more")));
    json_decref(v);

    static const struct {
        const char *query, *param;
    } bad[] = {
        {"limit=0", "limit"},     {"limit=1001", "limit"}, {"limit=ten", "limit"},
        {"limit=", "limit"},      {"limit", "limit"},      {"after=", "after"},
        {"after=a%20b", "after"}, {"after=%zz", "after"},  {"after=a%3", "after"},
        {"order=asc", "order"},
    };
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        char path[128];
        snprintf(path, sizeof(path), "/v1/sessions?%s", bad[k].query);
        v = list_get(srv.port, path, 400);
        json_t *err = json_object_get(v, "error");
        assert_string_equal(json_string_value(json_object_get(err, "param")), bad[k].param);
        assert_non_null(strstr(json_string_value(json_object_get(err, "message")), bad[k].param));
        json_decref(v);
    }
    stop(&srv);
}

/* ------------------------------------------------------------------------
 * The program
 * ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("spill", 7, true);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_sink_window),
        cmocka_unit_test(test_roundtrip_h2o),
        cmocka_unit_test(test_lru_saves),
        cmocka_unit_test(test_pins_saved),
        cmocka_unit_test(test_fault_old_version),
        cmocka_unit_test(test_fault_corrupted),
        cmocka_unit_test(test_fault_truncated),
        cmocka_unit_test(test_fault_foreign),
        cmocka_unit_test(test_fault_readonly_dir),
        cmocka_unit_test(test_fault_disk_full),
        cmocka_unit_test(test_windowed_not_saved),
        cmocka_unit_test(test_restart_continues),
        cmocka_unit_test(test_kill_during_write),
        cmocka_unit_test(test_list_pages),
        cmocka_unit_test(test_list_route),
    };
    return cmocka_run_group_tests_name("spill", tests, group_setup, group_teardown);
}
