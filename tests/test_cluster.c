/*
 * test_cluster.c - three `kvd serve` replicas behind HAProxy, on loopback.
 *
 * HAProxy runs the shipped deploy/haproxy/kvd.cfg itself, with the test's
 * ports passed through the environment variables that file reads, so what
 * is tested is what is deployed. The claims of that file are checked end
 * to end:
 *   - a session's requests (routed by the X-Session-Id header alone) land
 *     on one replica: each turn finds all of its history cached;
 *   - sessions spread over all three replicas (asked directly which
 *     sessions each holds);
 *   - GET /v1/sessions/ID through the proxy reaches the replica holding it;
 *   - after `kill -9` of one replica, the very next request of each of its
 *     sessions succeeds with a cache miss, the turn after finds the moved
 *     session cached (it stays on one survivor), and the other sessions
 *     keep their caches as if nothing happened.
 * Skips with a message without haproxy on PATH or KVD_BIN. Every process
 * runs in its own process group and is stopped in the group teardown,
 * whatever failed; the surviving replicas must exit 0 on SIGTERM.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>

#include "model/mkmodel.h"
#include "model/model.h"
#include "tests/serve_util.h"

#define N_REPLICAS 3
#define N_SESSIONS 10 /* not a multiple of N_REPLICAS: round-robin would move them */
#define N_GEN 4       /* tokens generated per turn (ignore_eos: exactly) */

static const char haproxy_cfg[] = "deploy/haproxy/kvd.cfg";

static const char *kvd_bin;
static const char *skip_reason; /* set when the cluster cannot run here */
static char tmpdir[256];
static char model_path[512];
static model *lib_model;
static struct su_proc replicas[N_REPLICAS];
static struct su_proc proxy;

/* The test's view of each session. */
struct chat {
    char id[32];
    json_t *hist; /* the conversation's token ids so far */
    int expect;   /* cached_tokens the next turn must report (-1: a miss) */
    int owner;    /* replica index holding it, -1 unknown */
};
static struct chat chats[N_SESSIONS];
static bool owners_known;

#define SKIP_UNLESS_CLUSTER()                                                                      \
    do {                                                                                           \
        if (skip_reason) {                                                                         \
            print_message("%s: skipped\n", skip_reason);                                           \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static json_t *tokens_json(const char *text)
{
    int32_t ids[1024];
    int n = model_tokenize(lib_model, text, strlen(text), false, ids, 1024);
    assert_true(n > 0 && n <= 1024);
    json_t *a = json_array();
    for (int i = 0; i < n; i++)
        json_array_append_new(a, json_integer(ids[i]));
    return a;
}

/*
 * One turn of chat c through the proxy: the history as the prompt, the
 * session named only by the X-Session-Id header. Checks the answer and the
 * cached tokens it reports, then extends the history by the answer and a
 * new sentence, and sets what the next turn must find cached: everything
 * but the last generated token, which is sampled but never fed.
 */
static void turn(struct chat *c, int k)
{
    char hdr[96];
    snprintf(hdr, sizeof(hdr), "X-Session-Id: %s\r\n", c->id);
    int st;
    json_t *v = su_post(proxy.port, "/completion", hdr,
                        json_pack("{s:O, s:i, s:f, s:b, s:b}", "prompt", c->hist, "n_predict",
                                  N_GEN, "temperature", 0.0, "ignore_eos", 1, "return_tokens", 1),
                        &st);
    if (st != 200)
        print_message("%s turn %d: status %d\n", c->id, k, st);
    assert_int_equal(st, 200);
    int cached = (int)json_integer_value(json_object_get(v, "tokens_cached"));
    int n_prompt = (int)json_array_size(c->hist);
    if (cached != (c->expect < 0 ? 0 : c->expect))
        print_message("%s turn %d: cached %d, expected %d\n", c->id, k, cached,
                      c->expect < 0 ? 0 : c->expect);
    assert_int_equal(cached, c->expect < 0 ? 0 : c->expect);
    json_t *gen = json_object_get(v, "tokens");
    assert_int_equal((int)json_array_size(gen), N_GEN);
    json_array_extend(c->hist, gen);
    json_decref(v);
    char more[64];
    snprintf(more, sizeof(more), " Then %s said %d more words.", c->id, k);
    json_t *m = tokens_json(more);
    json_array_extend(c->hist, m);
    json_decref(m);
    c->expect = n_prompt + N_GEN - 1;
}

/* Which replica (of those not excluded) holds the session: asks each one
 * directly. Fails unless exactly one does. */
static int owner_of(const struct chat *c, int excluded)
{
    int owner = -1, found = 0;
    char path[96];
    snprintf(path, sizeof(path), "/v1/sessions/%.31s", c->id);
    for (int r = 0; r < N_REPLICAS; r++) {
        if (r == excluded)
            continue;
        struct su_resp resp;
        int st = su_http(replicas[r].port, "GET", path, NULL, NULL, &resp);
        su_resp_free(&resp);
        assert_true(st == 200 || st == 404);
        if (st == 200) {
            owner = r;
            found++;
        }
    }
    if (found != 1)
        print_message("session %s is held by %d replicas\n", c->id, found);
    assert_int_equal(found, 1);
    return owner;
}

/* Whether the proxy's log has a line containing both a and b. */
static bool log_has(const char *a, const char *b)
{
    FILE *f = fopen(proxy.log, "r");
    if (!f)
        return false;
    char line[2048];
    bool found = false;
    while (!found && fgets(line, sizeof(line), f))
        found = strstr(line, a) && strstr(line, b);
    fclose(f);
    return found;
}

/* ------------------------------------------------------------------------ */

static void test_sessions_stay_and_spread(void **state)
{
    (void)state;
    SKIP_UNLESS_CLUSTER();
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < N_SESSIONS; i++)
            turn(&chats[i], t);
    int per_replica[N_REPLICAS] = {0};
    for (int i = 0; i < N_SESSIONS; i++) {
        chats[i].owner = owner_of(&chats[i], -1);
        per_replica[chats[i].owner]++;
    }
    print_message("sessions per replica: %d %d %d\n", per_replica[0], per_replica[1],
                  per_replica[2]);
    for (int r = 0; r < N_REPLICAS; r++)
        assert_true(per_replica[r] > 0);
    owners_known = true;

    /* The session routes carry the id in the path; the proxy routes them
     * to the holder too (else most would answer 404). */
    for (int i = 0; i < N_SESSIONS; i++) {
        char path[96];
        snprintf(path, sizeof(path), "/v1/sessions/%.31s", chats[i].id);
        struct su_resp r;
        assert_int_equal(su_http(proxy.port, "GET", path, NULL, NULL, &r), 200);
        json_t *v = json_loads(r.body, 0, NULL);
        su_resp_free(&r);
        assert_int_equal((int)json_integer_value(json_object_get(v, "tokens")), chats[i].expect);
        json_decref(v);
    }
}

static void test_header_and_field_disagree(void **state)
{
    (void)state;
    SKIP_UNLESS_CLUSTER();
    int st;
    json_t *v = su_post(
        proxy.port, "/v1/completions", "X-Session-Id: chat-0\r\n",
        json_pack("{s:s, s:i, s:s}", "prompt", "hello", "max_tokens", 2, "session", "chat-1"), &st);
    assert_int_equal(st, 400);
    json_t *e = json_object_get(v, "error");
    assert_string_equal(json_string_value(json_object_get(e, "code")), "session_mismatch");
    assert_non_null(strstr(json_string_value(json_object_get(e, "message")), "chat-0"));
    assert_non_null(strstr(json_string_value(json_object_get(e, "message")), "chat-1"));
    json_decref(v);
}

static void test_kill_one_replica(void **state)
{
    (void)state;
    SKIP_UNLESS_CLUSTER();
    assert_true(owners_known); /* set by test_sessions_stay_and_spread */
    int victim = chats[0].owner;
    int n_moved = 0;
    for (int i = 0; i < N_SESSIONS; i++)
        if (chats[i].owner == victim) {
            chats[i].expect = -1; /* its cache is gone with the replica */
            n_moved++;
        }
    print_message("kill -9 replica %d (%d of %d sessions)\n", victim, n_moved, N_SESSIONS);
    assert_int_equal(su_stop(&replicas[victim], SIGKILL, 10), 128 + SIGKILL);

    /* The next request of every session succeeds: a miss for the moved
     * ones, the full history for the others. */
    for (int i = 0; i < N_SESSIONS; i++)
        turn(&chats[i], 3);
    /* Once the proxy has marked the replica down (at the first refused
     * connection with the shipped config, else after its health checks),
     * the moved sessions are still cached where they landed: the ring
     * without the dead server is where the retries went. */
    char name[16];
    snprintf(name, sizeof(name), "kvd%d ", victim + 1);
    double deadline = su_now() + 20;
    while (!log_has(name, "is DOWN") && su_now() < deadline)
        su_sleep_ms(50);
    assert_true(log_has(name, "is DOWN"));
    for (int t = 4; t < 6; t++)
        for (int i = 0; i < N_SESSIONS; i++)
            turn(&chats[i], t);
    for (int i = 0; i < N_SESSIONS; i++) {
        int now = owner_of(&chats[i], victim);
        if (chats[i].owner != victim)
            assert_int_equal(now, chats[i].owner); /* not disturbed */
        chats[i].owner = now;
    }
}

/* ------------------------------------------------------------------------
 * Fixture
 * ------------------------------------------------------------------------ */

static int start_proxy(void)
{
    for (int attempt = 0; attempt < 3; attempt++) {
        snprintf(proxy.log, sizeof(proxy.log), "%s/haproxy.log", tmpdir);
        int port = su_free_port();
        char front[64], addr[N_REPLICAS][64];
        snprintf(front, sizeof(front), "127.0.0.1:%d", port);
        setenv("KVD_FRONT", front, 1);
        for (int r = 0; r < N_REPLICAS; r++) {
            char name[32];
            snprintf(name, sizeof(name), "KVD_REPLICA%d", r + 1);
            snprintf(addr[r], sizeof(addr[r]), "127.0.0.1:%d", replicas[r].port);
            setenv(name, addr[r], 1);
        }
        setenv("KVD_CHECK_INTER", "1s", 1);
        char *const argv[] = {"haproxy", "-db", "-f", (char *)haproxy_cfg, NULL};
        if (su_spawn(&proxy, argv, NULL))
            return -1;
        proxy.port = port;
        double deadline = su_now() + 10;
        while (su_now() < deadline) {
            struct su_resp r;
            int st = su_http(port, "GET", "/health", NULL, NULL, &r);
            su_resp_free(&r);
            if (st == 200)
                return 0;
            if (waitpid(proxy.pid, NULL, WNOHANG) == proxy.pid) { /* e.g. the port was taken */
                proxy.pid = 0;
                break;
            }
            su_sleep_ms(20);
        }
        su_dump_log(&proxy);
        su_stop(&proxy, SIGKILL, 5);
    }
    return -1;
}

static int group_teardown(void **state);

/* Setup that fails stops what it started (cmocka skips the teardown then). */
static int setup_failed(void)
{
    group_teardown(NULL);
    return -1;
}

static int group_setup(void **state)
{
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    kvd_bin = getenv("KVD_BIN");
    if (!kvd_bin || !*kvd_bin) {
        skip_reason = "KVD_BIN is not set (run through `make test`)";
        return 0;
    }
    if (!su_on_path("haproxy")) {
        skip_reason = "haproxy is not installed (make deploy-deps)";
        return 0;
    }
    if (access(haproxy_cfg, R_OK) != 0) {
        skip_reason = "deploy/haproxy/kvd.cfg not found (run from the repository root)";
        return 0;
    }
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/kvd-test-cluster-XXXXXX");
    if (!mkdtemp(tmpdir))
        return -1;
    snprintf(model_path, sizeof(model_path), "%s/tiny.gguf", tmpdir);
    struct model_mk_params p = su_small_model(128, 512, 11);
    char err[512];
    if (model_mk_write(&p, model_path, err, sizeof(err)) != 0) {
        fprintf(stderr, "model_mk_write: %s\n", err);
        return setup_failed();
    }
    struct model_params mp = {.path = model_path};
    lib_model = model_load(&mp, err, sizeof(err));
    if (!lib_model) {
        fprintf(stderr, "model_load: %s\n", err);
        return setup_failed();
    }
    static const char *const args[] = {
        "--set", "cache.memory=4MiB", "--set", "limits.max_running=8",
        "--set", "server.threads=1",  "--set", "limits.max_prompt_tokens=4096",
        "--set", "log.level=info",
    };
    for (int r = 0; r < N_REPLICAS; r++) {
        snprintf(replicas[r].log, sizeof(replicas[r].log), "%s/replica-%d.log", tmpdir, r + 1);
        if (su_serve(&replicas[r], kvd_bin, model_path, args, (int)(sizeof(args) / sizeof(*args))))
            return setup_failed();
    }
    if (start_proxy())
        return setup_failed();
    for (int i = 0; i < N_SESSIONS; i++) {
        snprintf(chats[i].id, sizeof(chats[i].id), "chat-%d", i);
        char text[96];
        snprintf(text, sizeof(text), "Chat %d begins: the robot walked into garden %d.", i, i);
        chats[i].hist = tokens_json(text);
        chats[i].expect = 0;
        chats[i].owner = -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    int bad = 0;
    su_stop(&proxy, SIGTERM, 10);
    for (int r = 0; r < N_REPLICAS; r++) {
        if (!replicas[r].pid)
            continue;
        int rc = su_stop(&replicas[r], SIGTERM, 30);
        if (rc != 0) {
            su_dump_log(&replicas[r]);
            fprintf(stderr, "replica %d exited with %d\n", r + 1, rc);
            bad = 1;
        }
    }
    for (int i = 0; i < N_SESSIONS; i++) {
        json_decref(chats[i].hist);
        chats[i].hist = NULL;
    }
    if (lib_model)
        model_free(lib_model);
    lib_model = NULL;
    if (su_remove_dir(tmpdir) != 0)
        bad = 1;
    return bad ? -1 : 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sessions_stay_and_spread),
        cmocka_unit_test(test_header_and_field_disagree),
        cmocka_unit_test(test_kill_one_replica),
    };
    return cmocka_run_group_tests_name("cluster", tests, group_setup, group_teardown);
}
