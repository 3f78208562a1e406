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
 * writing leaves no file that is read; GET and DELETE /v1/sessions.
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
 * ignored) to its end. */
static struct answer run(engine *e, const char *sess, const int32_t *prompt, int n, int max_tokens)
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

static const struct kv_policy sink_window = {
    .kind = KV_EVICT_SINK_WINDOW, .max_cache_tokens = 128, .sink_tokens = 4,
    .window_tokens = 96, .renumber = true};
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
    struct setup s = {.m = lib_model, .dir = fresh_dir(pol->kind == KV_EVICT_H2O ? "rt-h2o" : "rt"),
                      .kv = kv, .pol = *pol, .pages = 64};
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
    second_prompt(p2, p1, &a1);
    struct answer a2 = run(e, "one", p2, N2, G1);
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
 * as a fresh session does. */
static void expect_miss(const struct setup *s, const int32_t *p2)
{
    engine *b = make_engine(s);
    struct answer b2 = run(b, "s", p2, N2, G1);
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

static void test_fault_corrupted(void **state)
{
    (void)state;
    struct setup s = {.m = lib_model, .dir = fresh_dir("corrupt"), .kv = KV_F16,
                      .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    /* One flipped bit in a K/V row near the end, then one in the header. */
    long at[2] = {0, 30};
    for (int k = 0; k < 2; k++) {
        save_one(&s, p1, &a1, path, sizeof(path));
        at[0] = file_size(path) - 40;
        flip_byte(path, at[k]);
        logs[0] = '\0';
        second_prompt(p2, p1, &a1);
        expect_miss(&s, p2);
        assert_true(logged("its file is refused"));
        assert_true(logged(k == 0 ? "payload checksum mismatch" : "header checksum mismatch"));
        assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 0); /* removed */
    }
}

static void test_fault_truncated(void **state)
{
    (void)state;
    struct setup s = {.m = lib_model, .dir = fresh_dir("trunc"), .kv = KV_F16,
                      .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    long cut[3] = {0, 100, 0}; /* half, inside the header, one byte short */
    for (int k = 0; k < 3; k++) {
        save_one(&s, p1, &a1, path, sizeof(path));
        long size = file_size(path);
        assert_int_equal(truncate(path, k == 0 ? size / 2 : k == 2 ? size - 1 : cut[k]), 0);
        logs[0] = '\0';
        second_prompt(p2, p1, &a1);
        expect_miss(&s, p2);
        assert_true(logged("truncated"));
        assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 0);
    }
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
    struct setup s = {.m = other, .dir = fresh_dir("foreign"), .kv = KV_F16,
                      .pol = sink_window, .pages = 64};
    int32_t p1[N1], p2[N2];
    struct answer a1;
    char path[700];
    save_one(&s, p1, &a1, path, sizeof(path));
    second_prompt(p2, p1, &a1);
    s.m = lib_model; /* the same shapes, another model */
    logs[0] = '\0';
    expect_miss(&s, p2);
    assert_true(logged("written for another model"));
    /* The fresh session was saved nowhere yet; the foreign file stays. */
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0), 1);
    /* The same model with K/V stored in another type: refused too. */
    s.m = other;
    s.kv = KV_F32;
    logs[0] = '\0';
    expect_miss(&s, p2);
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
    struct setup s = {.m = lib_model, .dir = fresh_dir("ro"), .kv = KV_F16, .pol = sink_window,
                      .pages = 64};
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
    engine_destroy(a);
    make_readonly(s.dir, false);
    assert_true(logged("session s lost: cannot save it (shutdown)"));
    assert_int_equal(count_files(s.dir, ".kvs", NULL, 0) + count_files(s.dir, ".tmp", NULL, 0), 0);
    second_prompt(p2, p1, &a1);
    expect_miss(&s, p2);
}

/* A full disk, as the file-size limit makes one (EFBIG where ENOSPC would
 * be): the write fails with a log line, no .tmp is left behind, and the
 * engine goes on (the session was restored from its earlier file, which
 * went then, so nothing is on disk). */
static void test_fault_disk_full(void **state)
{
    (void)state;
    struct setup s = {.m = lib_model, .dir = fresh_dir("full"), .kv = KV_F16,
                      .pol = sink_window, .pages = 64};
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
        cmocka_unit_test(test_fault_corrupted),
        cmocka_unit_test(test_fault_truncated),
        cmocka_unit_test(test_fault_foreign),
        cmocka_unit_test(test_fault_readonly_dir),
        cmocka_unit_test(test_fault_disk_full),
    };
    return cmocka_run_group_tests_name("spill", tests, group_setup, group_teardown);
}
