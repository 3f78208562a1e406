/*
 * test_engine.c - the engine (engine/engine.h) driven directly, as kvd
 * generate and kvd eval drive it, and through `kvd serve` where the
 * behaviour is the daemon's: admission by free pages, the stalled-engine
 * readiness check.
 *
 * In-process tests build a small model in a scratch folder and step an
 * engine by hand; the serve tests start the real binary (KVD_BIN, set by
 * `make test`) and skip without it.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <jansson.h>
#include <pthread.h>

#include "engine/engine.h"
#include "engine/engine_internal.h" /* white-box: the engine's pacing model */
#include "engine/pace.h"
#include "model/mkmodel.h"
#include "model/model.h"
#include "tests/serve_fixture.h"
#include "tests/kvd_run.h"

/* ------------------------------------------------------------------------
 * In-process: the engine stepped by hand
 * ------------------------------------------------------------------------ */

/* An engine over the scratch model: f32 K/V in pages of 16 tokens, a pool
 * of `pages` pages, policy pol (NULL: none at `budget` tokens). */
static engine *model_engine(const model *m, int pages, int budget, int max_running,
                           int step_tokens, const struct kv_policy *pol)
{
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(m, &shape);
    struct engine_params p = {
        .m = m,
        .cache_memory = kv_cache_memory_for(&shape, pages),
        .page_tokens = 16,
        .k_type = KV_F32,
        .v_type = KV_F32,
        .n_threads = 1,
        .limits = {.policy =
                       pol ? *pol
                           : (struct kv_policy){.kind = KV_EVICT_NONE, .max_cache_tokens = budget},
                   .max_running = max_running,
                   .step_tokens = step_tokens},
    };
    char err[512];
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    return e;
}

static engine *policy_engine(int pages, int budget, int max_running, int step_tokens,
                             const struct kv_policy *pol)
{
    return model_engine(lib_model, pages, budget, max_running, step_tokens, pol);
}

static engine *small_engine(int pages, int budget, int max_running, int step_tokens)
{
    return policy_engine(pages, budget, max_running, step_tokens, NULL);
}

/* A completion of n_prompt token ids (1, 2, ...) generating max_tokens. */
static struct engine_req *completion(int n_prompt, int max_tokens)
{
    struct engine_req *r = engine_req_new(ENGINE_REQ_COMPLETION);
    assert_non_null(r);
    r->prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    assert_non_null(r->prompt);
    for (int i = 0; i < n_prompt; i++)
        r->prompt[i] = 1 + i % 200;
    r->n_prompt = n_prompt;
    r->max_tokens = max_tokens;
    r->ignore_eos = true;
    model_sampling_defaults(&r->sampling);
    r->sampling.temperature = 0;
    return r;
}

/* What the events of a run said, per request (index = req->id). */
struct tally {
    int done[8], errors[8], texts[8], logits[8];
    int evicted_events[8], evicted_sum[8], evicted_last[8]; /* EVICTED: count, sum, running total */
    int usage_evicted[8];                                   /* DONE's usage.evicted_tokens */
    int status[8];
    enum engine_finish finish[8];
    int positions[8][64];
};

static void take(engine *e, struct tally *t)
{
    for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
        next = ev->next;
        int i = (int)ev->req->id;
        switch (ev->kind) {
        case ENGINE_EV_TEXT:
            t->texts[i]++;
            break;
        case ENGINE_EV_LOGITS:
            if (t->logits[i] < 64)
                t->positions[i][t->logits[i]] = ev->position;
            t->logits[i]++;
            break;
        case ENGINE_EV_EVICTED:
            t->evicted_events[i]++;
            t->evicted_sum[i] += ev->evicted;
            assert_true(ev->evicted > 0);
            assert_int_equal(ev->usage.evicted_tokens, t->evicted_last[i] + ev->evicted);
            t->evicted_last[i] = ev->usage.evicted_tokens;
            break;
        case ENGINE_EV_DONE:
            t->done[i]++;
            t->finish[i] = ev->finish;
            t->usage_evicted[i] = ev->usage.evicted_tokens;
            break;
        case ENGINE_EV_ERROR:
            t->errors[i]++;
            t->status[i] = ev->status;
            break;
        default:
            fail_msg("unexpected event kind %d", (int)ev->kind);
        }
        engine_event_free(ev);
    }
}

/*
 * Admission by free pages: a pool of 24 pages and three prompts of 150
 * tokens (11 pages each with the decode page) cannot all be admitted at
 * once. The third waits (never more than two run) and then runs to its
 * own finish; nobody gets 503.
 */
static void test_admission_waits_for_pages(void **state)
{
    (void)state;
    engine *e = small_engine(24, 256, 4, 512);
    struct engine_req *r[3];
    for (int i = 0; i < 3; i++) {
        r[i] = completion(150, 4);
        r[i]->id = (uint64_t)i;
        assert_int_equal(engine_submit(e, r[i]), 0);
    }
    struct tally t = {0};
    int most = 0, steps = 0;
    bool third_waited = false;
    while (t.done[0] + t.done[1] + t.done[2] + t.errors[0] + t.errors[1] + t.errors[2] < 3) {
        assert_true(engine_step(e, su_now() * 1e9));
        struct engine_stats st;
        engine_get_stats(e, &st);
        most = st.running > most ? st.running : most;
        if (steps == 0 && st.waiting == 1)
            third_waited = true;
        take(e, &t);
        assert_true(++steps < 1000);
    }
    for (int i = 0; i < 3; i++) {
        if (t.errors[i])
            fail_msg("request %d failed with %d", i, t.status[i]);
        assert_int_equal(t.done[i], 1);
        assert_int_equal(t.finish[i], ENGINE_FINISH_LENGTH);
    }
    print_message("at most %d running of 3, the third waited: %s, %d steps\n", most,
                  third_waited ? "yes" : "no", steps);
    assert_int_equal(most, 2);
    assert_true(third_waited);
    struct engine_stats st;
    engine_get_stats(e, &st);
    assert_int_equal(st.kv.pages_used, 0);
    for (int i = 0; i < 3; i++)
        engine_req_free(r[i]);
    engine_destroy(e);
}

/*
 * Logits for scoring: ENGINE_LOGITS_EACH posts the logits after every
 * prompt token, positions 0..n-1 in order, fed one token per step;
 * ENGINE_LOGITS_LAST posts one, after the last.
 */
static void test_logits_events(void **state)
{
    (void)state;
    engine *e = small_engine(16, 128, 2, 64);
    struct engine_req *each = completion(20, 0), *last = completion(20, 0);
    each->id = 0;
    each->logits = ENGINE_LOGITS_EACH;
    last->id = 1;
    last->logits = ENGINE_LOGITS_LAST;
    engine_submit(e, each);
    engine_submit(e, last);
    struct tally t = {0};
    int steps = 0;
    while (t.done[0] + t.done[1] < 2 && steps++ < 100) {
        engine_step(e, su_now() * 1e9);
        take(e, &t);
    }
    assert_int_equal(t.done[0], 1);
    assert_int_equal(t.done[1], 1);
    assert_int_equal(t.logits[0], 20);
    for (int i = 0; i < 20; i++)
        assert_int_equal(t.positions[0][i], i);
    assert_int_equal(t.logits[1], 1);
    assert_int_equal(t.positions[1][0], 19);
    assert_int_equal(steps, 20); /* one prompt token per step */
    engine_req_free(each);
    engine_req_free(last);
    engine_destroy(e);
}

/*
 * Eviction events: under sink-window (4 sinks, a 32-token window) a
 * 200-token prompt and 40 generated tokens evict as they go; each
 * ENGINE_EV_EVICTED says what that step evicted and the total so far, and
 * the totals add up to the final usage. A request that does not ask gets
 * none.
 */
static void test_eviction_events(void **state)
{
    (void)state;
    struct kv_policy pol = {
        .kind = KV_EVICT_SINK_WINDOW, .sink_tokens = 4, .window_tokens = 32, .renumber = true};
    struct kv_budget b;
    kv_policy_budget(&pol, 16, &b);
    pol.max_cache_tokens = (int)b.need_tokens;
    engine *e = policy_engine(32, 0, 2, 64, &pol);
    struct engine_req *want = completion(200, 40), *quiet = completion(200, 40);
    want->id = 0;
    want->want_evictions = true;
    quiet->id = 1;
    engine_submit(e, want);
    engine_submit(e, quiet);
    struct tally t = {0};
    for (int steps = 0; t.done[0] + t.done[1] < 2 && steps < 500; steps++) {
        engine_step(e, su_now() * 1e9);
        take(e, &t);
    }
    assert_int_equal(t.done[0], 1);
    assert_int_equal(t.done[1], 1);
    print_message("%d eviction events, %d tokens evicted (usage %d)\n", t.evicted_events[0],
                  t.evicted_sum[0], t.usage_evicted[0]);
    assert_true(t.evicted_events[0] > 1);
    assert_int_equal(t.evicted_sum[0], t.usage_evicted[0]);
    assert_true(t.usage_evicted[0] >= 200 + 40 - 1 - pol.max_cache_tokens);
    assert_int_equal(t.evicted_events[1], 0);
    assert_int_equal(t.usage_evicted[1], t.usage_evicted[0]); /* same work, same eviction */
    engine_req_free(want);
    engine_req_free(quiet);
    engine_destroy(e);
}

/* An engine for sessions (up to 4) under pol, 32 pages of 16 tokens. */
static engine *session_engine(const model *m, const struct kv_policy *pol)
{
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(m, &shape);
    int64_t pages = 2 * kv_cache_sequence_pages(&shape, pol, 64); /* two sequences' worth */
    struct engine_params p = {
        .m = m,
        .cache_memory = kv_cache_memory_for(&shape, pages > 32 ? pages : 32),
        .page_tokens = 16,
        .k_type = KV_F32,
        .v_type = KV_F32,
        .n_threads = 1,
        .limits = {.policy = *pol, .max_running = 2, .step_tokens = 64, .max_sessions = 4},
    };
    char err[512];
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    return e;
}

/* Submit r (100 prompt tokens, 40 generated, greedy) on session (NULL:
 * none), step e to its end; its generated ids into ids[40], its usage. */
static void run_answer(engine *e, const char *session, bool fork, int max_tokens, int32_t *ids,
                       struct engine_usage *u)
{
    struct engine_req *r = completion(100, max_tokens);
    r->session = session ? strdup(session) : NULL;
    r->fork_answer = fork;
    r->want_tokens = true;
    engine_submit(e, r);
    int n = 0;
    bool done = false;
    for (int steps = 0; !done && steps < 1000; steps++) {
        engine_step(e, su_now() * 1e9);
        for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
            next = ev->next;
            for (int k = 0; k < ev->n_tokens && n < 40; k++)
                ids[n++] = ev->tokens[k];
            if (ev->kind == ENGINE_EV_ERROR)
                fail_msg("request failed: %s", ev->message);
            if (ev->kind == ENGINE_EV_DONE) {
                *u = ev->usage;
                done = true;
            }
            engine_event_free(ev);
        }
    }
    assert_true(done);
    assert_int_equal(n, max_tokens);
    engine_req_free(r);
}

/*
 * fork_answer (kvd eval's exact scoring with generated tokens): the answer
 * decodes on a fork of the session's sequence and the fork is dropped, so
 * the session holds exactly what the prompt alone leaves, although the
 * answer's appends evicted; and the answer is the one the sequence itself
 * would have decoded.
 */
/* The checks on model m; returns the pool pages of sliding-window layers
 * the forking engine dropped (cache/window.c). */
static uint64_t fork_answer_case(const model *m)
{
    struct kv_policy pol = {
        .kind = KV_EVICT_SINK_WINDOW, .sink_tokens = 4, .window_tokens = 32, .renumber = true};
    struct kv_budget b;
    kv_policy_budget(&pol, 16, &b);
    pol.max_cache_tokens = (int)b.need_tokens; /* 64: the 100-token prompt evicts, so does the answer */
    int32_t forked[40], plain[40], alone[40], none[1];
    struct engine_usage uf, up, ua, u0;
    engine *ef = session_engine(m, &pol), *e0 = session_engine(m, &pol),
           *ep = session_engine(m, &pol);
    run_answer(ef, "s", true, 40, forked, &uf);
    run_answer(e0, "s", false, 0, none, &u0);   /* the prompt alone */
    run_answer(ep, "s", false, 40, plain, &up); /* the answer in the session itself */
    engine *ea = session_engine(m, &pol);
    run_answer(ea, NULL, false, 40, alone, &ua);
    engine_destroy(ea);

    /* The same answer as without the fork. */
    assert_memory_equal(forked, plain, sizeof(forked));
    assert_memory_equal(forked, alone, sizeof(forked));
    assert_true(uf.evicted_tokens > u0.evicted_tokens); /* the answer evicted, in the fork */
    assert_int_equal(uf.evicted_tokens, up.evicted_tokens);

    /* The session: exactly the prompt's cache; without the fork it differs. */
    int nf, n0, np;
    const int32_t *tf = engine_session_tokens(ef, "s", &nf);
    const int32_t *t0 = engine_session_tokens(e0, "s", &n0);
    const int32_t *tp = engine_session_tokens(ep, "s", &np);
    assert_non_null(tf);
    assert_non_null(t0);
    assert_int_equal(nf, n0);
    assert_memory_equal(tf, t0, sizeof(int32_t) * (size_t)nf);
    assert_false(np == n0 && memcmp(tp, t0, sizeof(int32_t) * (size_t)n0) == 0);
    struct engine_stats sf, s0;
    engine_get_stats(ef, &sf);
    engine_get_stats(e0, &s0);
    assert_int_equal(sf.kv.pages_used, s0.kv.pages_used); /* the fork's pages went back */
    assert_int_equal(sf.kv.pages_shared, 0);
    assert_int_equal(sf.kv.sequences, 1);
    engine_destroy(ef);
    engine_destroy(e0);
    engine_destroy(ep);
    return sf.kv.window_pages_dropped;
}

/* A model mkmodel writes from mp into the scratch folder as NAME.gguf,
 * loaded (the caller frees it). */
static model *scratch_model(const struct model_mk_params *mp, const char *name)
{
    char path[700], err[512];
    snprintf(path, sizeof(path), "%s/%s.gguf", tmpdir, name);
    assert_int_equal(model_mk_write(mp, path, err, sizeof(err)), 0);
    struct model_params lp = {.path = path};
    model *m = model_load(&lp, err, sizeof(err));
    assert_non_null(m);
    return m;
}

/* On the scratch model, and on a Gemma 3 shape whose five local layers in
 * six keep only their 16-token window (cache/window.c): the fork shares
 * those layers' pages too and copies the one it writes. */
static void test_fork_answer(void **state)
{
    (void)state;
    assert_int_equal(fork_answer_case(lib_model), 0);
    struct model_mk_params mp;
    model_mk_defaults(&mp);
    mp.arch = "gemma3";
    mp.n_embd = 64;
    mp.n_head = 4;
    mp.n_kv_head = 2;
    mp.head_dim = 16;
    mp.n_layer = 6;
    mp.n_ff = 96;
    mp.n_vocab = 300;
    mp.sliding_window = 16;
    model *m = scratch_model(&mp, "windowed");
    uint64_t dropped = fork_answer_case(m);
    print_message("windowed model: %llu pool pages of its local layers dropped\n",
                  (unsigned long long)dropped);
    assert_true(dropped > 0);
    model_free(m);
}

/* Run one request alone to its end on e: its generated ids into ids (at
 * most max), their count returned; *status the error's, or 0. */
static int run_alone(engine *e, struct engine_req *r, int32_t *ids, int max, int *status)
{
    r->want_tokens = true;
    assert_int_equal(engine_submit(e, r), 0);
    int n = 0, steps = 0;
    *status = 0;
    for (bool ended = false; !ended; assert_true(++steps < 1000)) {
        engine_step(e, su_now() * 1e9);
        for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
            next = ev->next;
            for (int i = 0; ev->kind == ENGINE_EV_TEXT && i < ev->n_tokens && n < max; i++)
                ids[n++] = ev->tokens[i];
            if (ev->kind == ENGINE_EV_ERROR)
                *status = ev->status;
            ended |= ev->kind == ENGINE_EV_DONE || ev->kind == ENGINE_EV_ERROR;
            engine_event_free(ev);
        }
    }
    return n;
}

/*
 * The benchmark fill (engine/fill.c): on a one-layer model, whose K and V
 * depend on their own token alone, a 20-token prompt filled to 100 tokens
 * holds exactly the cache of that prompt read five times over. Its first
 * token t1 comes from the real prompt's logits (after 20 tokens); fed at
 * position 100, it sees the filled cache, so the tokens after it are those
 * a real prompt of the five copies and t1 gives. A fill
 * that cannot hold is refused with 400: not above the prompt, or under a
 * policy that evicts.
 */
static void test_fill(void **state)
{
    (void)state;
    struct model_mk_params mp;
    model_mk_defaults(&mp);
    mp.n_layer = 1;
    model *m = scratch_model(&mp, "one_layer");
    engine *e = model_engine(m, 32, 256, 2, 64, NULL);

    int32_t filled[8], real[8];
    int status;
    struct engine_req *a = completion(20, 8);
    a->fill_tokens = 100;
    assert_int_equal(run_alone(e, a, filled, 8, &status), 8);
    assert_int_equal(status, 0);
    struct engine_req *b = completion(101, 7);
    for (int i = 0; i < 100; i++)
        b->prompt[i] = a->prompt[i % 20];
    b->prompt[100] = filled[0];
    assert_int_equal(run_alone(e, b, real, 7, &status), 7);
    assert_memory_equal(filled + 1, real, 7 * sizeof(int32_t));

    struct engine_req *c = completion(20, 8);
    c->fill_tokens = 20;
    assert_int_equal(run_alone(e, c, real, 8, &status), 0);
    assert_int_equal(status, 400);
    engine_req_free(a);
    engine_req_free(b);
    engine_req_free(c);
    engine_destroy(e);

    struct kv_policy sw = {.kind = KV_EVICT_SINK_WINDOW, .max_cache_tokens = 128,
                           .sink_tokens = 4, .window_tokens = 96, .renumber = true};
    e = model_engine(m, 32, 128, 2, 64, &sw);
    struct engine_req *d = completion(20, 8);
    d->fill_tokens = 100;
    assert_int_equal(run_alone(e, d, real, 8, &status), 0);
    assert_int_equal(status, 400);
    engine_req_free(d);
    engine_destroy(e);
    model_free(m);
}

/* `kvd generate --fill`: the report's fill line (decode reads the filled
 * length: the cache retains it), and a fill that cannot hold refused at
 * once with exit status 2 and why. */
static void test_generate_fill(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    char args[900], dir[200], *err;
    snprintf(dir, sizeof(dir), "%.190s", tmpdir); /* a short scratch path */
    snprintf(args, sizeof(args),
             "generate --model '%s' --prompt 'one two three four' -n 4 --temp 0 --threads 1 "
             "--ctx 200 --fill 150 --no-echo", model_path);
    assert_int_equal(kvd_run("", args, dir, &err), 0);
    assert_non_null(strstr(err, "  fill:    "));
    assert_non_null(strstr(err, "tokens: not a prefill; decode reads 150 tokens of K/V)"));
    assert_non_null(strstr(err, "  cache: 153 tokens retained"));
    free(err);
    snprintf(args, sizeof(args),
             "generate --model '%s' --prompt 'one two three four' -n 4 --ctx 200 --fill 198",
             model_path);
    assert_int_equal(kvd_run("", args, dir, &err), 2);
    assert_non_null(strstr(err, "kvd generate: --fill 198 wants more tokens than the prompt's"));
    free(err);
}

/* ------------------------------------------------------------------------
 * Step pacing (pace.c): prompt chunks sized to a step's time budget
 * ------------------------------------------------------------------------ */

/* The largest chunk after `context` tokens that a step holding one decode
 * at decode_ctx fits into budget_s, by brute force over the model's
 * formula (what pace_plan_chunk must find by bisection). */
static int brute_chunk(double c0, double c1, double c2, double budget_s, int decode_ctx,
                       int context, int most)
{
    int best = 0;
    for (int n = 1; n <= most; n++) {
        double dn = n, dl = context;
        double tokens = 1 + dn, pairs = decode_ctx + 1 + dn * dl + dn * (dn + 1) / 2;
        if (c0 + c1 * tokens + c2 * pairs <= budget_s)
            best = n;
    }
    return best;
}

/* The chunk pace_plan_chunk must give the first prompt of a step holding
 * one decode at decode_ctx, by brute force over the model's formula: the
 * largest within the budget, raised to the least whose prompt rate (the
 * step's fixed cost c0 charged) is PACE_EFFICIENCY of the rate of `most`,
 * but then no further than a step of PACE_STRETCH times the decode's own
 * time holds; never below the floor. */
static int brute_first_chunk(double c0, double c1, double c2, double budget_s, int decode_ctx,
                             int context, int most, int floor)
{
    int n = brute_chunk(c0, c1, c2, budget_s, decode_ctx, context, most);
    double dl = context, full = c0 + c1 * most + c2 * (most * dl + most * (most + 1.0) / 2);
    int least = most;
    for (int k = most; k >= 1; k--) {
        double own = c0 + c1 * k + c2 * (k * dl + k * (k + 1.0) / 2);
        if (k / own >= PACE_EFFICIENCY * most / full)
            least = k;
        else
            break;
    }
    if (least > n) {
        double decode_s = c0 + c1 + c2 * (decode_ctx + 1);
        int cap = brute_chunk(c0, c1, c2, PACE_STRETCH * decode_s, decode_ctx, context, least);
        least = cap > n ? cap : n;
    }
    if (least < floor)
        least = floor < most ? floor : most;
    return n > least ? n : least;
}

/*
 * Chunk sizing with a known speed (no clock): the chunk is the largest
 * whose predicted step fits the budget (or the least that reads the
 * prompt near full speed, test_pace_chunk_efficiency), it shrinks as the context it sits
 * after grows (attention's pairs), a step without decodes or without a
 * budget keeps the token budget, the first chunk never goes below the
 * floor, and a second prompt gets only what the first left.
 */
static void test_pace_chunk_sizing(void **state)
{
    (void)state;
    const double c0 = 0.020, c1 = 0.0005, c2 = 2e-8; /* 20 ms a step, 0.5 ms a token */
    struct engine_pace p = {0};
    engine_pace_set(&p, c0, c1, c2);
    struct pace_work dec = pace_chunk_work(1, 4096);
    assert_true(fabs(dec.pairs - 4097) < 1e-9);

    int last = 1 << 20;
    const int contexts[] = {0, 512, 4096, 16384, 65536};
    for (int i = 0; i < 5; i++) {
        struct pace_plan pl;
        pace_plan_start(&pl, &p, 100, 1, &dec, 16);
        int got = pace_plan_chunk(&pl, 512, contexts[i]);
        int want = brute_first_chunk(c0, c1, c2, 0.100, 4096, contexts[i], 512, 16);
        print_message("context %6d: chunk %3d tokens (predicted step %.1f ms)\n", contexts[i], got,
                      1e3 * engine_pace_predict(&p, &pl.work));
        assert_int_equal(got, want);
        assert_true(got < 512);
        assert_true(got <= last);
        assert_true(engine_pace_predict(&p, &pl.work) <= 0.100 || got == 16);
        last = got;
    }
    assert_true(last < 100); /* at 64k the pairs dominate */

    struct pace_plan pl;
    /* nobody decoding: the token budget only */
    struct pace_work none = {0};
    pace_plan_start(&pl, &p, 100, 0, &none, 16);
    assert_int_equal(pace_plan_chunk(&pl, 512, 4096), 512);
    /* no time budget: the token budget only */
    pace_plan_start(&pl, &p, 0, 1, &dec, 16);
    assert_int_equal(pace_plan_chunk(&pl, 512, 4096), 512);
    /* a budget below one decode step: the oldest prompt gets the least
     * chunk (test_pace_chunk_efficiency) or what it has left, the next one
     * nothing this step */
    pace_plan_start(&pl, &p, 10, 1, &dec, 16);
    assert_int_equal(pace_plan_chunk(&pl, 512, 4096),
                     brute_first_chunk(c0, c1, c2, 0.010, 4096, 4096, 512, 16));
    assert_int_equal(pace_plan_chunk(&pl, 512, 0), 0);
    pace_plan_start(&pl, &p, 10, 1, &dec, 16);
    assert_int_equal(pace_plan_chunk(&pl, 5, 4096), 5);
    /* two prompts share one budget: the second gets what the first left */
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    int a = pace_plan_chunk(&pl, 40, 0);
    int b = pace_plan_chunk(&pl, 512, 0);
    assert_int_equal(a, 40);
    assert_true(b > 0 && b < brute_chunk(c0, c1, c2, 0.100, 4096, 0, 512));
    assert_true(engine_pace_predict(&p, &pl.work) <= 0.100);
}

/* The prompt rate of a chunk of n after context, the step's fixed cost
 * charged (what efficient_chunk compares). */
static double chunk_rate(double c0, double c1, double c2, int n, int context)
{
    double dn = n, dl = context;
    return dn / (c0 + c1 * dn + c2 * (dn * dl + dn * (dn + 1) / 2));
}

/*
 * The least chunk (pace.c): when the decodes alone take the budget (here
 * eight streams at 4k, 20 ms of fixed cost, a 20 ms budget), the budget
 * leaves a prompt nothing and the old pacing gave it the floor, 16 tokens
 * a step, read at a fraction of a whole chunk's rate. The first chunk is
 * now the least that keeps PACE_EFFICIENCY of a whole chunk's rate, as far
 * as the step stays within PACE_STRETCH times the decodes' own time; a
 * second prompt still waits. While the decodes are cheap against the
 * budget (one stream), the budget alone decides, however slowly its chunk
 * reads: decoding streams keep their preference.
 */
static void test_pace_chunk_efficiency(void **state)
{
    (void)state;
    const double c0 = 0.020, c1 = 0.0005, c2 = 2e-8;
    struct engine_pace p = {0};
    engine_pace_set(&p, c0, c1, c2);
    struct pace_work dec = {0};
    for (int i = 0; i < 8; i++) {
        struct pace_work w = pace_chunk_work(1, 4096);
        dec.tokens += w.tokens;
        dec.pairs += w.pairs;
    }
    double decode_s = engine_pace_predict(&p, &dec);
    assert_true(decode_s > 0.020);

    struct pace_plan pl;
    pace_plan_start(&pl, &p, 20, 8, &dec, 16);
    int got = pace_plan_chunk(&pl, 512, 0);
    double step = engine_pace_predict(&p, &pl.work);
    double full = chunk_rate(c0, c1, c2, 512, 0);
    print_message("8 decodes (%.1f ms) beside a 20 ms budget: chunk %d (the old pacing's 16), "
                  "%.0f%% of a whole chunk's rate (16: %.0f%%), step %.1f ms\n",
                  1e3 * decode_s, got, 100 * chunk_rate(c0, c1, c2, got, 0) / full,
                  100 * chunk_rate(c0, c1, c2, 16, 0) / full, 1e3 * step);
    assert_true(got > 16);
    assert_true(step <= PACE_STRETCH * decode_s + 1e-12);
    /* the least chunk would be larger: the stretch stops it */
    assert_true(chunk_rate(c0, c1, c2, got, 0) < PACE_EFFICIENCY * full);
    struct pace_work more = pace_chunk_work(got + 1, 0);
    more.tokens += dec.tokens;
    more.pairs += dec.pairs;
    assert_true(engine_pace_predict(&p, &more) > PACE_STRETCH * decode_s);
    assert_int_equal(pace_plan_chunk(&pl, 512, 0), 0); /* a second prompt waits */

    /* a cheap step (1.2 ms fixed) beside sixteen decodes at 64k (their
     * attention takes the budget): the least chunk is small and taken whole */
    engine_pace_set(&p, 0.0012, c1, c2);
    struct pace_work far = {0};
    for (int i = 0; i < 16; i++) {
        struct pace_work w = pace_chunk_work(1, 65536);
        far.tokens += w.tokens;
        far.pairs += w.pairs;
    }
    decode_s = engine_pace_predict(&p, &far);
    pace_plan_start(&pl, &p, 20, 16, &far, 16);
    got = pace_plan_chunk(&pl, 512, 0);
    full = chunk_rate(0.0012, c1, c2, 512, 0);
    print_message("16 decodes at 64k (%.1f ms), 1.2 ms fixed, 20 ms budget: chunk %d, step %.1f ms\n",
                  1e3 * decode_s, got, 1e3 * engine_pace_predict(&p, &pl.work));
    assert_true(decode_s > 0.020);
    assert_true(got > 16);
    assert_true(chunk_rate(0.0012, c1, c2, got, 0) >= PACE_EFFICIENCY * full);
    assert_true(chunk_rate(0.0012, c1, c2, got - 1, 0) < PACE_EFFICIENCY * full);
    assert_true(engine_pace_predict(&p, &pl.work) <= PACE_STRETCH * decode_s);

    /* one decode, 20 ms fixed, 100 ms budget: the budget's chunk reads at
     * ~90% of a whole chunk's rate, and no more is taken */
    engine_pace_set(&p, c0, c1, c2);
    struct pace_work one = pace_chunk_work(1, 4096);
    pace_plan_start(&pl, &p, 100, 1, &one, 16);
    got = pace_plan_chunk(&pl, 512, 0);
    assert_int_equal(got, brute_chunk(c0, c1, c2, 0.100, 4096, 0, 512));
    assert_true(chunk_rate(c0, c1, c2, got, 0) < PACE_EFFICIENCY * chunk_rate(c0, c1, c2, 512, 0));

    /* the fixed cost charged: the fit's c_step, no more than decode-only
     * steps were seen to take, nothing before any was seen */
    p = (struct engine_pace){0};
    for (int i = 0; i < 20; i++) { /* chunks timed by 60 ms + per token + per pair */
        struct pace_work w = pace_chunk_work(32 + (i * 53) % 480, (i * 331) % 4096);
        engine_pace_observe(&p, &w, true, 0.060 + c1 * w.tokens + c2 * w.pairs);
    }
    assert_true(fabs(p.coef[0] - 0.060) < 1e-6);
    assert_true(p.fixed_s == 0);
    struct pace_work one4k = pace_chunk_work(1, 4096);
    pace_plan_start(&pl, &p, 20, 1, &one4k, 16); /* the fit's decode: 60.6 ms */
    /* no stretch by the fixed cost (the step is a probe: no chunk at all) */
    assert_true(fabs(pl.stretch_s - PACE_STRETCH * (engine_pace_predict(&p, &one4k) - p.coef[0])) <
                1e-12);
    for (int i = 0; i < 3; i++) { /* decode-only steps, faster than that */
        struct pace_work w = pace_chunk_work(1, 4096);
        engine_pace_observe(&p, &w, false, 0.010);
    }
    assert_true(p.fixed_s <= 0.010 + 1e-12);
    assert_true(p.fixed_s <= p.coef[0]);
}

/* Observe decode-only steps of 1-3 decodes at various contexts, timed by
 * c0 + c1 per token + c2 per pair scaled by `slow`. */
static void observe_decodes(struct engine_pace *p, double c0, double c1, double c2, double slow)
{
    for (int i = 0; i < 12; i++) {
        struct pace_work w = {0};
        for (int d = 0; d <= i % 3; d++) {
            struct pace_work one = pace_chunk_work(1, 1000 + (i * 577 + d * 211) % 6000);
            w.tokens += one.tokens;
            w.pairs += one.pairs;
        }
        engine_pace_observe(p, &w, false, slow * (c0 + c1 * w.tokens + c2 * w.pairs));
    }
}

/*
 * The budget follows the decodes (pace.c): a learning pace whose steps are
 * timed by a known law (no clock). Before any decode-only step a step with
 * decodes is a probe (no chunk), and the configured budget stands; once
 * decodes were timed alone, the budget is PACE_BUDGET_DECODES times their
 * time for the step's decodes: on a quiet machine well under the
 * configured 100 ms (a fixed budget made steps 10x a decode step, ITL p99
 * ~7x p50), capped by it when decodes are slow (a loaded machine), never
 * below PACE_BUDGET_FLOOR_S when they are cheap. A pace that has not timed
 * decodes alone for PACE_PROBE_STEPS steps probes again.
 */
static void test_pace_budget_follows_decodes(void **state)
{
    (void)state;
    const double c0 = 0.010, c1 = 0.0004, c2 = 2e-8; /* 10 ms a step */
    struct engine_pace p = {0};
    for (int i = 0; i < 20; i++) { /* prompt chunks, beside a decode or alone */
        struct pace_work w = pace_chunk_work(16 + (i * 53) % 480, (i * 331) % 4096);
        if (i % 2) {
            struct pace_work one = pace_chunk_work(1, 2000 + i * 100);
            w.tokens += one.tokens;
            w.pairs += one.pairs;
        }
        engine_pace_observe(&p, &w, true, c0 + c1 * w.tokens + c2 * w.pairs);
    }
    struct pace_work dec = pace_chunk_work(1, 4096);
    double decode_s = c0 + c1 * dec.tokens + c2 * dec.pairs; /* 10.5 ms */
    struct pace_plan pl;
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    assert_true(pl.probe);
    assert_true(pl.budget_s == 0.100); /* nothing timed: the configured budget */
    assert_int_equal(pace_plan_chunk(&pl, 512, 0), 0);
    struct pace_plan alone; /* without decodes, no probe: whole chunks */
    struct pace_work none = {0};
    pace_plan_start(&alone, &p, 100, 0, &none, 16);
    assert_int_equal(pace_plan_chunk(&alone, 512, 0), 512);

    /* quiet: decodes timed by the same law */
    observe_decodes(&p, c0, c1, c2, 1.0);
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    assert_false(pl.probe);
    print_message("decode %.1f ms: budget %.1f ms (configured 100)\n", 1e3 * decode_s,
                  1e3 * pl.budget_s);
    assert_true(fabs(pl.budget_s - PACE_BUDGET_DECODES * decode_s) < 1e-6 * decode_s);
    int got = pace_plan_chunk(&pl, 512, 0);
    double step = engine_pace_predict(&p, &pl.work);
    assert_true(got > 16);
    assert_true(step <= pl.budget_s);
    struct pace_work more = pace_chunk_work(got + 1, 0);
    more.tokens += dec.tokens;
    more.pairs += dec.pairs;
    assert_true(engine_pace_predict(&p, &more) > pl.budget_s);
    int fixed = brute_chunk(c0, c1, c2, 0.100, 4096, 0, 512); /* what 100 ms held */
    print_message("chunk %d tokens, step %.1f ms (100 ms: %d)\n", got, 1e3 * step, fixed);
    assert_true(got < fixed / 2);

    /* loaded: decodes four times slower; the budget stops at 100 ms */
    struct engine_pace slow = {0};
    observe_decodes(&slow, c0, c1, c2, 4.0);
    pace_plan_start(&pl, &slow, 100, 1, &dec, 16);
    assert_true(pl.budget_s == 0.100);
    /* cheap decodes: the floor */
    struct engine_pace fast = {0};
    observe_decodes(&fast, c0, c1, c2, 0.5);
    pace_plan_start(&pl, &fast, 100, 1, &dec, 16);
    assert_true(pl.budget_s == PACE_BUDGET_FLOOR_S);
    /* a configured budget below the floor still binds; none means none */
    pace_plan_start(&pl, &fast, 10, 1, &dec, 16);
    assert_true(pl.budget_s == 0.010);
    pace_plan_start(&pl, &fast, 0, 1, &dec, 16);
    assert_true(pl.budget_s == 0 && !pl.probe);
    assert_int_equal(pace_plan_chunk(&pl, 512, 0), 512);

    /* the decodes' timing goes stale: a probe every PACE_PROBE_STEPS */
    for (int i = 0; i < PACE_PROBE_STEPS; i++) {
        pace_plan_start(&pl, &p, 100, 1, &dec, 16);
        assert_false(pl.probe);
        struct pace_work w = pace_chunk_work(32, 0);
        engine_pace_observe(&p, &w, true, c0 + c1 * w.tokens + c2 * w.pairs);
    }
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    assert_true(pl.probe);
    engine_pace_observe(&p, &dec, false, decode_s);
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    assert_false(pl.probe);
    /* a pace with set coefficients never probes (its speed is given) */
    engine_pace_set(&p, c0, c1, c2);
    p.since_decodes = PACE_PROBE_STEPS;
    pace_plan_start(&pl, &p, 100, 1, &dec, 16);
    assert_false(pl.probe);
}

/*
 * The fit: steps timed by a known linear law (a fixed part, per token,
 * per pair) are predicted back from the observations alone; a single
 * observation predicts in proportion to tokens; what prefill costs
 * survives a long run of decode-only steps.
 */
static void test_pace_fit(void **state)
{
    (void)state;
    const double c0 = 0.015, c1 = 0.0004, c2 = 3e-9;
    struct engine_pace p = {0};
    struct pace_work chunk = pace_chunk_work(512, 1000);
    assert_false(p.known);
    engine_pace_observe(&p, &chunk, true, 0.5);
    assert_true(p.known);
    struct pace_work half = pace_chunk_work(256, 1000);
    assert_true(fabs(engine_pace_predict(&p, &half) - 0.25) < 1e-9);

    p = (struct engine_pace){0};
    for (int i = 0; i < 40; i++) {
        int n = 1 + (i * 37) % 512, ctx = (i * 997) % 8192;
        bool chunks = i % 3 != 0;
        struct pace_work w = chunks ? pace_chunk_work(n, ctx) : pace_chunk_work(1, ctx);
        engine_pace_observe(&p, &w, chunks, c0 + c1 * w.tokens + c2 * w.pairs);
    }
    for (int i = 0; i < 300; i++) { /* decodes only, at one context */
        struct pace_work w = pace_chunk_work(1, 3000);
        engine_pace_observe(&p, &w, false, c0 + c1 * w.tokens + c2 * w.pairs);
    }
    const int ns[] = {1, 16, 100, 512}, ctxs[] = {0, 4096, 16384};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) {
            struct pace_work w = pace_chunk_work(ns[i], ctxs[j]);
            double want = c0 + c1 * w.tokens + c2 * w.pairs;
            double got = engine_pace_predict(&p, &w);
            if (fabs(got - want) > 1e-6 * want)
                fail_msg("chunk %d at %d: predicted %g s, law %g s", ns[i], ctxs[j], got, want);
        }
    /* observations are ignored once the coefficients are set */
    engine_pace_set(&p, 1, 0, 0);
    engine_pace_observe(&p, &chunk, true, 5);
    assert_true(fabs(engine_pace_predict(&p, &chunk) - 1) < 1e-12);
}

/* Record each step's batch: sequences and tokens (the observe hook). */
struct step_log {
    int seqs[512], tokens[512];
    int n;
};

static void log_step(void *ud, enum engine_obs what, double value)
{
    struct step_log *l = ud;
    if (what == ENGINE_OBS_BATCH_SEQS && l->n < 512)
        l->seqs[l->n] = (int)value;
    if (what == ENGINE_OBS_BATCH_TOKENS && l->n < 512)
        l->tokens[l->n++] = (int)value;
}

/* An engine of step_tokens 64 whose steps cost a known 1.2 ms + 0.25 ms a
 * token (frozen: the clock is not read), budget_ms a step. */
static engine *paced_engine(uint64_t budget_ms, struct step_log *log)
{
    struct kv_cache_params shape = {.page_tokens = 16, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(lib_model, &shape);
    struct engine_params p = {
        .m = lib_model,
        .cache_memory = kv_cache_memory_for(&shape, 64),
        .page_tokens = 16,
        .k_type = KV_F32,
        .v_type = KV_F32,
        .n_threads = 1,
        .limits = {.policy = {.kind = KV_EVICT_NONE, .max_cache_tokens = 400},
                   .max_running = 2,
                   .step_tokens = 64,
                   .step_budget_ms = budget_ms},
        .hooks = {.observe = log_step, .ud = log},
    };
    char err[512];
    engine *e = engine_create(&p, err, sizeof(err));
    if (!e)
        fail_msg("engine_create: %s", err);
    engine_pace_set(&e->pace, 0.0012, 0.00025, 0);
    return e;
}

/* Step e until requests 0..n-1 are done; their generated ids into ids. */
static void run_paced(engine *e, int n, int32_t ids[][32])
{
    int got[2] = {0}, done = 0;
    for (int steps = 0; done < n && steps < 500; steps++) {
        engine_step(e, su_now() * 1e9);
        for (struct engine_event *ev = engine_take_events(e), *next; ev; ev = next) {
            next = ev->next;
            int i = (int)ev->req->id;
            for (int k = 0; k < ev->n_tokens && got[i] < 32; k++)
                ids[i][got[i]++] = ev->tokens[k];
            if (ev->kind == ENGINE_EV_ERROR)
                fail_msg("request %d failed: %s", i, ev->message);
            done += ev->kind == ENGINE_EV_DONE;
            engine_event_free(ev);
        }
    }
    assert_int_equal(done, n);
}

/*
 * Stall-free batching through the engine's own step loop, with a known
 * speed: request 0 (a 100-token prompt) alone reads its prompt in chunks
 * of the whole token budget (64, 36); while it decodes, request 1's prompt
 * (300 tokens) is cut to what a 10 ms step holds beside the decode (1.2 ms
 * + 0.25 ms * (1 + 34) = 9.95 ms: chunks of 34; the decode alone, 1.45
 * ms, is far below the budget, so no least chunk raises them); once
 * request 0 is done, request 1's chunks grow back to 64. The generated
 * tokens are those of a run without a time budget (chunking never changes
 * the numbers).
 */
static void test_pace_served_chunks(void **state)
{
    (void)state;
    int32_t paced[2][32], plain[2][32];
    struct step_log lp = {0}, l0 = {0};
    for (int pass = 0; pass < 2; pass++) {
        struct step_log *log = pass ? &l0 : &lp;
        engine *e = paced_engine(pass ? 0 : 10, log);
        struct engine_req *r[2] = {completion(100, 6), completion(300, 4)};
        for (int i = 0; i < 2; i++) {
            r[i]->id = (uint64_t)i;
            r[i]->want_tokens = true;
        }
        engine_submit(e, r[0]);
        /* request 0 alone: two prefill steps, then it decodes */
        for (int i = 0; i < 3; i++)
            engine_step(e, su_now() * 1e9);
        engine_submit(e, r[1]);
        memset(pass ? plain : paced, 0, sizeof(paced));
        run_paced(e, 2, pass ? plain : paced);
        for (int i = 0; i < 2; i++)
            engine_req_free(r[i]);
        engine_destroy(e);
    }
    /* alone: the token budget */
    assert_true(lp.n > 3);
    assert_int_equal(lp.tokens[0], 64);
    assert_int_equal(lp.tokens[1], 36);
    assert_int_equal(lp.tokens[2], 1);
    int shrunk = 0, grown = 0, fed = 0;
    for (int i = 3; i < lp.n && fed < 300; i++) {
        bool beside = lp.seqs[i] == 2; /* request 0's decode + request 1's chunk */
        int chunk = lp.tokens[i] - (beside ? 1 : 0), most = beside ? 34 : 64;
        assert_int_equal(chunk, 300 - fed < most ? 300 - fed : most);
        shrunk += beside;
        grown += !beside;
        fed += chunk;
    }
    print_message("paced: %d steps with chunks of 34 beside a decode, %d alone with up to 64; "
                  "unpaced: %d steps\n",
                  shrunk, grown, l0.n);
    assert_int_equal(shrunk, 4);
    assert_int_equal(grown, 3); /* 300 - 4 * 34 = 164 = 64 + 64 + 36 */
    assert_int_equal(fed, 300);
    /* without a budget request 1's first chunk takes the rest of the step */
    assert_int_equal(l0.tokens[3], 64);
    assert_memory_equal(paced, plain, sizeof(paced));
}

/* ------------------------------------------------------------------------
 * Through kvd serve
 * ------------------------------------------------------------------------ */

struct gen_arg {
    int port;
    json_t *body; /* stolen by the thread */
    int status;
    json_t *answer;
};

static void *gen_thread(void *p)
{
    struct gen_arg *g = p;
    g->answer = su_post(g->port, "/completion", NULL, g->body, &g->status);
    return NULL;
}

/* A prompt of about n tokens for the scratch model. */
static char *long_prompt(int words)
{
    char *s = malloc((size_t)words * 6 + 1);
    assert_non_null(s);
    s[0] = '\0';
    for (int i = 0; i < words; i++)
        strcat(s, i % 2 ? " time" : " once");
    return s;
}

/*
 * Issue 14, defect 4: with a pool that holds about three of eight
 * concurrent long prompts, every request used to be admitted at once and
 * the youngest ones were refused with 503 "the KV cache is full". Now they
 * wait in the queue for pages and all eight answer 200 with their own
 * finish.
 */
static void test_serve_full_pool_queues(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    /* f32 K/V of the scratch model: 512 bytes a token, so 1 MiB holds
     * 2048 tokens (128 pages of 16). */
    static const char *const args[] = {"--set", "cache.memory=1MiB",
                                       "--set", "cache.kv_type=f32",
                                       "--set", "eviction.max_cache_tokens=1024",
                                       "--set", "limits.max_running=8",
                                       "--set", "server.threads=1"};
    struct su_proc p;
    serve(&p, "pool", args, 10);
    char *prompt = long_prompt(400);
    enum { N = 8 };
    struct gen_arg g[N];
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        g[i] = (struct gen_arg){
            .port = p.port,
            .body = json_pack("{s:s, s:i, s:b}", "prompt", prompt, "n_predict", 8, "ignore_eos", 1),
        };
        assert_int_equal(pthread_create(&th[i], NULL, gen_thread, &g[i]), 0);
    }
    int ok = 0;
    for (int i = 0; i < N; i++) {
        pthread_join(th[i], NULL);
        if (g[i].status != 200)
            print_message("request %d: status %d: %s\n", i, g[i].status,
                          json_string_value(
                              json_object_get(json_object_get(g[i].answer, "error"), "message")));
        ok += g[i].status == 200;
        if (g[i].status == 200)
            assert_int_equal(json_integer_value(json_object_get(g[i].answer, "tokens_predicted")),
                             8);
        json_decref(g[i].answer);
    }
    print_message("%d of %d long prompts answered 200 through a pool of ~3\n", ok, N);
    assert_int_equal(ok, N);
    free(prompt);
    server_stop(&p);
}

static int get_status(int port, const char *path, char *code, size_t len)
{
    struct su_resp r;
    int st = su_http(port, "GET", path, NULL, NULL, &r);
    json_t *v = r.body ? json_loads(r.body, 0, NULL) : NULL;
    const char *c = json_string_value(json_object_get(json_object_get(v, "error"), "code"));
    snprintf(code, len, "%s", c ? c : "");
    json_decref(v);
    su_resp_free(&r);
    return st;
}

/*
 * Issue 14's stalled engine: with every step made to hang 3 s
 * (KVD_FAULT_ENGINE_STALL_MS) and engine_stall_timeout 1s, /health says
 * 503 engine_stalled while a request is inside the step, yet the loop
 * keeps answering (/metrics 200 meanwhile); when the step ends the request
 * completes and /health is 200 again.
 */
static void test_serve_stalled_engine_not_ready(void **state)
{
    (void)state;
    SKIP_WITHOUT_KVD();
    static const char *const args[] = {"--set", "limits.engine_stall_timeout=1s"};
    struct su_proc p;
    setenv("KVD_FAULT_ENGINE_STALL_MS", "3000", 1);
    int rc = server_start_named(&p, "stall", args, 2);
    unsetenv("KVD_FAULT_ENGINE_STALL_MS");
    assert_int_equal(rc, 0);
    char code[64];
    assert_int_equal(get_status(p.port, "/health", code, sizeof(code)), 200);

    struct gen_arg g = {.port = p.port,
                        .body = json_pack("{s:s, s:i}", "prompt", "Once upon", "n_predict", 1)};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, gen_thread, &g), 0);
    bool stalled = false;
    double t0 = su_now();
    while (!stalled && su_now() - t0 < 10) {
        stalled = get_status(p.port, "/health", code, sizeof(code)) == 503 &&
                  !strcmp(code, "engine_stalled");
        if (stalled) {
            /* the loop thread answers meanwhile */
            assert_int_equal(get_status(p.port, "/metrics", code, sizeof(code)), 200);
        }
        su_sleep_ms(100);
    }
    print_message("stalled seen after %.1f s\n", su_now() - t0);
    assert_true(stalled);
    pthread_join(th, NULL);
    assert_int_equal(g.status, 200);
    json_decref(g.answer);
    assert_int_equal(get_status(p.port, "/health", code, sizeof(code)), 200);
    server_stop(&p);
}

/* ------------------------------------------------------------------------ */

static int group_setup(void **state)
{
    (void)state;
    return sf_setup("engine", 11, true);
}

static int group_teardown(void **state)
{
    (void)state;
    return sf_teardown();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_admission_waits_for_pages),
        cmocka_unit_test(test_logits_events),
        cmocka_unit_test(test_eviction_events),
        cmocka_unit_test(test_fork_answer),
        cmocka_unit_test(test_fill),
        cmocka_unit_test(test_generate_fill),
        cmocka_unit_test(test_pace_chunk_sizing),
        cmocka_unit_test(test_pace_chunk_efficiency),
        cmocka_unit_test(test_pace_budget_follows_decodes),
        cmocka_unit_test(test_pace_fit),
        cmocka_unit_test(test_pace_served_chunks),
        cmocka_unit_test(test_serve_full_pool_queues),
        cmocka_unit_test(test_serve_stalled_engine_not_ready),
    };
    return cmocka_run_group_tests_name("engine", tests, group_setup, group_teardown);
}
