/*
 * test_pool.c - the compute threads (cpu/pool.h): the static partition,
 * equal to OpenMP's own; the stealing for's fixed pieces, and a stalled
 * worker's share taken by the others; every index run once, index 0 on the caller;
 * nested and concurrent regions; many short regions; shutdown and restart;
 * a region after fork(); the environment's thread count and spin time,
 * bad values refused by name; and idle workers asleep (their CPU time over
 * a second, read from /proc: a resource check, not a clock assertion).
 */
#include <omp.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "cpu/pool.h"
#include "proc_ticks.h"

/* ------------------------------------------------------------------------
 * Partition
 * ------------------------------------------------------------------------ */

/* The chunks are what OpenMP's schedule(static) gives each thread, for
 * every n up to 300 and a few large ones, 1..9 threads. */
static void test_partition_is_openmps(void **state)
{
    (void)state;
    static int owner[100003];
    const size_t ns[] = {0, 1, 2, 3, 7, 8, 63, 64, 65, 100, 257, 4096, 100003};
    for (int nth = 1; nth <= 9; nth++) {
        for (size_t k = 0; k < sizeof(ns) / sizeof(ns[0]) + 300; k++) {
            size_t n = k < sizeof(ns) / sizeof(ns[0]) ? ns[k] : k - sizeof(ns) / sizeof(ns[0]);
            int team = 0;
#pragma omp parallel num_threads(nth)
            {
#pragma omp single
                team = omp_get_num_threads();
#pragma omp for schedule(static)
                for (size_t i = 0; i < n; i++)
                    owner[i] = omp_get_thread_num();
            }
            if (team != nth)
                skip(); /* OpenMP gave fewer threads: nothing to compare */
            size_t next = 0;
            for (int t = 0; t < nth; t++) {
                size_t i0, i1;
                cpu_pool_chunk(n, nth, t, &i0, &i1);
                assert_int_equal(i0, next); /* contiguous, in thread order */
                for (size_t i = i0; i < i1; i++)
                    assert_int_equal(owner[i], t);
                next = i1;
            }
            assert_int_equal(next, n);
        }
    }
}

struct cover {
    _Atomic int *hits;
    int *owner;
    int nth;
};

static void cover_range(void *arg, size_t i0, size_t i1, int t)
{
    struct cover *c = arg;
    assert_true(i0 < i1);
    for (size_t i = i0; i < i1; i++) {
        atomic_fetch_add(&c->hits[i], 1);
        c->owner[i] = t;
    }
}

/* cpu_pool_for runs every index once, on the thread its chunk names. */
static void test_for_covers(void **state)
{
    (void)state;
    enum { N = 1000 };
    _Atomic int hits[N];
    int owner[N];
    for (int nth = 1; nth <= 7; nth++) {
        for (size_t n = 0; n <= N; n += (n < 20 ? 1 : 331)) {
            for (size_t i = 0; i < N; i++)
                atomic_store(&hits[i], 0);
            struct cover c = {hits, owner, nth};
            cpu_pool_for(nth, n, cover_range, &c);
            int used = nth < (int)n ? nth : (int)n;
            for (size_t i = 0; i < N; i++) {
                assert_int_equal(atomic_load(&hits[i]), i < n);
                if (i < n) {
                    size_t i0, i1;
                    cpu_pool_chunk(n, used, owner[i], &i0, &i1);
                    assert_true(i0 <= i && i < i1);
                }
            }
        }
    }
}

/* cpu_pool_for_steal: every index once, every call one whole piece of
 * the fixed cut (a chunk's pieces of grain from its start, the last one
 * shorter), for 1..7 threads and several grains. */
struct pieces {
    _Atomic int hits[1000];
    _Atomic int bad_piece;
    size_t n, grain;
    int nth;
};

static void piece_range(void *arg, size_t i0, size_t i1, int t)
{
    struct pieces *p = arg;
    int c = 0;
    size_t lo, hi;
    for (;; c++) { /* the chunk holding i0 */
        cpu_pool_chunk(p->n, p->nth, c, &lo, &hi);
        if (i0 < hi)
            break;
    }
    size_t want1 = hi - i0 < p->grain ? hi : i0 + p->grain;
    if ((i0 - lo) % p->grain || i1 != want1 || t < 0 || t >= p->nth)
        atomic_fetch_add(&p->bad_piece, 1);
    for (size_t i = i0; i < i1; i++)
        atomic_fetch_add(&p->hits[i], 1);
}

static void test_steal_pieces(void **state)
{
    (void)state;
    static struct pieces p;
    const size_t grains[] = {1, 2, 3, 4, 7, 100};
    for (int nth = 1; nth <= 7; nth++)
        for (size_t g = 0; g < sizeof(grains) / sizeof(grains[0]); g++)
            for (size_t n = 0; n <= 1000; n += (n < 30 ? 1 : 97)) {
                for (size_t i = 0; i < 1000; i++)
                    atomic_store(&p.hits[i], 0);
                p.n = n;
                p.grain = grains[g];
                p.nth = nth < (int)n ? nth : (int)n;
                cpu_pool_for_steal(nth, n, grains[g], piece_range, &p);
                for (size_t i = 0; i < 1000; i++)
                    assert_int_equal(atomic_load(&p.hits[i]), i < n);
            }
    assert_int_equal(atomic_load(&p.bad_piece), 0);
}

/* A worker stalled in its first piece (it waits, deliberately against the
 * rule, until every other piece is done, at most 30 s): the other threads
 * take the rest of its chunk, so the region ends. A static split would
 * leave the rest of the chunk to the stalled worker and time out. */
struct stall {
    pthread_t caller;
    _Atomic int blocker; /* 1 once a worker's piece has chosen to stall */
    _Atomic int done;    /* pieces finished */
    _Atomic int timed_out;
    _Atomic int hits[64];
    int pieces;
};

static void stall_range(void *arg, size_t i0, size_t i1, int t)
{
    (void)t;
    struct stall *s = arg;
    if (!pthread_equal(pthread_self(), s->caller) && !atomic_exchange(&s->blocker, 1))
        for (int ms = 0; atomic_load(&s->done) < s->pieces - 1; ms++) {
            if (ms == 30000) {
                atomic_store(&s->timed_out, 1);
                break;
            }
            usleep(1000);
        }
    for (size_t i = i0; i < i1; i++)
        atomic_fetch_add(&s->hits[i], 1);
    atomic_fetch_add(&s->done, 1);
}

static void test_steal_takes_a_stalled_share(void **state)
{
    (void)state;
    for (int nth = 2; nth <= 4; nth++) {
        struct stall s = {.caller = pthread_self(), .pieces = 64};
        cpu_pool_for_steal(nth, 64, 1, stall_range, &s);
        assert_int_equal(atomic_load(&s.timed_out), 0);
        assert_int_equal(atomic_load(&s.done), 64);
        for (int i = 0; i < 64; i++)
            assert_int_equal(atomic_load(&s.hits[i]), 1);
    }
}

/* ------------------------------------------------------------------------
 * Regions
 * ------------------------------------------------------------------------ */

struct who {
    pthread_t caller;
    pthread_t th[16];
    _Atomic int runs[16];
    _Atomic int bad_nth;
    int nth;
};

static void record(void *arg, int t, int nth)
{
    struct who *w = arg;
    if (nth != w->nth)
        atomic_fetch_add(&w->bad_nth, 1);
    w->th[t] = pthread_self();
    atomic_fetch_add(&w->runs[t], 1);
}

/* Each index once, 0 on the caller; more threads than cores is fine (the
 * pool grows). */
static void test_run_indices(void **state)
{
    (void)state;
    for (int nth = 1; nth <= 16; nth++) {
        struct who w = {.caller = pthread_self(), .nth = nth};
        cpu_pool_run(nth, record, &w);
        assert_int_equal(atomic_load(&w.bad_nth), 0);
        for (int t = 0; t < 16; t++)
            assert_int_equal(atomic_load(&w.runs[t]), t < nth);
        assert_true(pthread_equal(w.th[0], w.caller));
    }
#ifndef KVD_THREADS_OMP
    assert_true(cpu_pool_workers() >= 15);
#endif
}

/* The workers do run indices: index 0 waits (at most 30 s, deliberately
 * against the rule that bodies do not wait for each other) until every
 * other index has started, which only workers can then do. */
struct meet {
    pthread_t caller;
    _Atomic int started;
    _Atomic int on_caller;
    _Atomic int timed_out;
};

static void meet_body(void *arg, int t, int nth)
{
    struct meet *m = arg;
    if (t > 0) {
        atomic_fetch_add(&m->on_caller, pthread_equal(pthread_self(), m->caller));
        atomic_fetch_add(&m->started, 1);
        return;
    }
    for (int ms = 0; atomic_load(&m->started) < nth - 1; ms++) {
        if (ms == 30000) {
            atomic_store(&m->timed_out, 1);
            return;
        }
        usleep(1000);
    }
}

static void test_workers_run_indices(void **state)
{
    (void)state;
    for (int nth = 2; nth <= 5; nth++) {
        struct meet m = {.caller = pthread_self()};
        cpu_pool_run(nth, meet_body, &m);
        assert_int_equal(atomic_load(&m.timed_out), 0);
        assert_int_equal(atomic_load(&m.started), nth - 1);
        assert_int_equal(atomic_load(&m.on_caller), 0);
    }
}

/* A body that starts a region: the inner one runs inline on that thread,
 * with the same partition. */
struct nest {
    _Atomic int hits[4][100];
    _Atomic int off_thread; /* inner chunks run on another thread */
    _Atomic int bad_owner;
};

struct nest_inner {
    struct nest *n;
    int outer;
    pthread_t self;
};

static void nest_inner_range(void *arg, size_t i0, size_t i1, int t)
{
    struct nest_inner *in = arg;
    size_t c0, c1;
    cpu_pool_chunk(100, 3, t, &c0, &c1);
    if (c0 != i0 || c1 != i1)
        atomic_fetch_add(&in->n->bad_owner, 1);
    if (!pthread_equal(pthread_self(), in->self))
        atomic_fetch_add(&in->n->off_thread, 1);
    for (size_t i = i0; i < i1; i++)
        atomic_fetch_add(&in->n->hits[in->outer][i], 1);
}

static void nest_outer(void *arg, int t, int nth)
{
    (void)nth;
    struct nest_inner in = {arg, t, pthread_self()};
    cpu_pool_for(3, 100, nest_inner_range, &in);
}

static void test_nested(void **state)
{
    (void)state;
    struct nest *n = calloc(1, sizeof(*n));
    assert_non_null(n);
    cpu_pool_run(4, nest_outer, n);
    for (int t = 0; t < 4; t++)
        for (int i = 0; i < 100; i++)
            assert_int_equal(atomic_load(&n->hits[t][i]), 1);
    assert_int_equal(atomic_load(&n->off_thread), 0);
    assert_int_equal(atomic_load(&n->bad_owner), 0);
    free(n);
}

/* Sum of i*i over [0, n) in per-chunk partial sums, added in chunk order:
 * the same bits whenever the partition is the same. */
struct sum {
    double part[8];
};

static void sum_range(void *arg, size_t i0, size_t i1, int t)
{
    struct sum *s = arg;
    double acc = 0;
    for (size_t i = i0; i < i1; i++)
        acc += 1.0 / (double)(i + 1);
    s->part[t] = acc;
}

static double chunked_sum(int nth, size_t n)
{
    struct sum s = {{0}};
    cpu_pool_for(nth, n, sum_range, &s);
    double total = 0;
    for (int t = 0; t < nth; t++)
        total += s.part[t];
    return total;
}

/* Two threads (two engines) run regions at once: each gets its own
 * answers, region after region; many short regions hand off cleanly. */
struct hammer {
    int nth;
    int rounds;
    int wrong;
};

static void *hammer_main(void *p)
{
    struct hammer *h = p;
    const double want = chunked_sum(h->nth, 5000);
    for (int r = 0; r < h->rounds; r++) {
        struct who w = {.caller = pthread_self(), .nth = h->nth};
        cpu_pool_run(h->nth, record, &w);
        for (int t = 0; t < h->nth; t++)
            h->wrong += atomic_load(&w.runs[t]) != 1;
        h->wrong += !pthread_equal(w.th[0], pthread_self());
        if (r % 50 == 0)
            h->wrong += chunked_sum(h->nth, 5000) != want;
    }
    return NULL;
}

static void test_concurrent_callers(void **state)
{
    (void)state;
    struct hammer a = {2, 3000, 0}, b = {3, 3000, 0};
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, hammer_main, &a), 0);
    assert_int_equal(pthread_create(&tb, NULL, hammer_main, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_int_equal(a.wrong, 0);
    assert_int_equal(b.wrong, 0);
}

static void count_one(void *arg, int t, int nth)
{
    (void)t;
    (void)nth;
    atomic_fetch_add((_Atomic long *)arg, 1);
}

/* Many regions of almost nothing, with the default spin and with none
 * (workers asleep at every hand-out, so the caller often runs their
 * indices itself): every index runs exactly once all the same. */
static void test_many_short_regions(void **state)
{
    (void)state;
    char err[160];
    for (int spin0 = 0; spin0 < 2; spin0++) {
        if (spin0)
            setenv("KVD_SPIN_US", "0", 1);
        assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
        _Atomic long n = 0;
        for (int r = 0; r < 50000; r++)
            cpu_pool_run(2 + r % 3, count_one, &n);
        long want = 0;
        for (int r = 0; r < 50000; r++)
            want += 2 + r % 3;
        assert_int_equal(atomic_load(&n), want);
    }
    unsetenv("KVD_SPIN_US");
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
}

static void test_shutdown_restart(void **state)
{
    (void)state;
    struct who w = {.caller = pthread_self(), .nth = 3};
    cpu_pool_run(3, record, &w);
    cpu_pool_shutdown();
    assert_int_equal(cpu_pool_workers(), 0);
    cpu_pool_shutdown(); /* twice is fine */
    struct who w2 = {.caller = pthread_self(), .nth = 3};
    cpu_pool_run(3, record, &w2);
    for (int t = 0; t < 3; t++)
        assert_int_equal(atomic_load(&w2.runs[t]), 1);
#ifndef KVD_THREADS_OMP
    assert_int_equal(cpu_pool_workers(), 2);
#endif
    cpu_pool_shutdown();
}

/* The child of a fork has no workers; its regions start new ones. */
static void test_after_fork(void **state)
{
    (void)state;
#ifdef KVD_THREADS_OMP
    skip(); /* libgomp's team does not survive a fork: the child would hang */
#endif
    double want = chunked_sum(3, 9999);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        double got = chunked_sum(3, 9999);
        struct who w = {.caller = pthread_self(), .nth = 4};
        cpu_pool_run(4, record, &w);
        int ok = got == want;
        for (int t = 0; t < 4; t++)
            ok = ok && atomic_load(&w.runs[t]) == 1;
        _exit(ok ? 0 : 1);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 0);
}

/* ------------------------------------------------------------------------
 * Settings
 * ------------------------------------------------------------------------ */

static void test_env(void **state)
{
    (void)state;
    char err[200];
    char *saved = getenv("OMP_NUM_THREADS") ? strdup(getenv("OMP_NUM_THREADS")) : NULL;

    setenv("OMP_NUM_THREADS", "3", 1);
    setenv("KVD_SPIN_US", "7", 1);
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
    assert_int_equal(cpu_pool_threads(0), 3);
    assert_int_equal(cpu_pool_threads(5), 5);
    assert_int_equal(cpu_pool_threads(100000), CPU_POOL_MAX);
    char line[200];
    cpu_pool_describe(line, sizeof(line));
#ifndef KVD_THREADS_OMP
    assert_non_null(strstr(line, "kvd pool, 3 threads by default (OMP_NUM_THREADS), spin 7 us"));
#else
    assert_non_null(strstr(line, "OpenMP"));
#endif

    setenv("OMP_NUM_THREADS", "4,2", 1); /* OpenMP's nested list: the first */
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
#ifndef KVD_THREADS_OMP
    assert_int_equal(cpu_pool_threads(0), 4);
#endif

    setenv("OMP_NUM_THREADS", "many", 1);
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), -1);
    assert_non_null(strstr(err, "OMP_NUM_THREADS=\"many\""));
    setenv("OMP_NUM_THREADS", "0", 1);
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), -1);
    unsetenv("OMP_NUM_THREADS");
    setenv("KVD_SPIN_US", "-1", 1);
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), -1);
    assert_non_null(strstr(err, "KVD_SPIN_US=\"-1\""));
    setenv("KVD_SPIN_US", "100001", 1);
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), -1);

    /* unset: one thread per CPU this process may use, the default spin */
    unsetenv("KVD_SPIN_US");
    assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
    assert_true(cpu_pool_threads(0) >= 1);
#ifndef KVD_THREADS_OMP
    cpu_pool_describe(line, sizeof(line));
    assert_non_null(strstr(line, "CPUs), spin 50 us"));
#endif
    if (saved) {
        setenv("OMP_NUM_THREADS", saved, 1);
        free(saved);
        assert_int_equal(cpu_pool_init_env(err, sizeof(err)), 0);
    }
}

/* ------------------------------------------------------------------------
 * Holds: workers stay up across gaps longer than the spin
 * ------------------------------------------------------------------------ */

/* 20 regions of 3 threads, each after a 300 us gap of the caller's (six
 * times the default spin), without and with a hold: without, each gap
 * puts the workers to sleep; held, they wait it out, and a held wait ends
 * in a sleep only when a yield came back late or the gap outlasted the
 * hold (a crowded machine: a 300 us sleep of the caller's can take
 * milliseconds). The hold starts before the region that opens the run,
 * so no worker is still on its way to an unheld sleep when counting
 * starts. */
_Static_assert(CPU_POOL_HOLD_US >= 4 * 300, "the gaps below lie well within a hold");
static void test_hold(void **state)
{
    (void)state;
#ifdef KVD_THREADS_OMP
    skip(); /* OpenMP's team: its wait policy decides */
#else
    _Atomic long n = 0;
    long slept[2], late[2], out[2];
    for (int held = 0; held < 2; held++) {
        if (held)
            cpu_pool_hold();
        cpu_pool_run(3, count_one, &n);
        long l0, l1, o0, o1, s0 = cpu_pool_sleeps(&l0, &o0);
        for (int r = 0; r < 20; r++) {
            usleep(300);
            cpu_pool_run(3, count_one, &n);
        }
        slept[held] = cpu_pool_sleeps(&l1, &o1) - s0;
        late[held] = l1 - l0;
        out[held] = o1 - o0;
        if (held)
            cpu_pool_release();
    }
    fprintf(stderr,
            "futex sleeps over 20 gaps of 300 us: %ld without a hold, %ld held (%ld late yields, "
            "%ld waits past the hold)\n",
            slept[0], slept[1], late[1], out[1]);
    assert_int_equal(n, 2 * 21 * 3);
    assert_true(slept[0] >= 10);
    assert_int_equal(late[0] + out[0], 0);
    assert_true(slept[1] <= late[1] + out[1]);
#endif
}

/* ------------------------------------------------------------------------
 * Idle workers sleep
 * ------------------------------------------------------------------------ */

static void test_idle_workers_sleep(void **state)
{
    (void)state;
#ifdef KVD_THREADS_OMP
    skip(); /* OpenMP's team: its wait policy decides */
#else
    _Atomic long n = 0;
    for (int r = 0; r < 1000; r++) /* busy, then idle */
        cpu_pool_run(3, count_one, &n);
    usleep(100 * 1000); /* well past the spin time */
    int nw = 0;
    long t0 = pt_thread_ticks(0, "kvd-pool-", &nw);
    if (t0 < 0)
        skip();
    assert_true(nw >= 2);
    sleep(1);
    long t1 = pt_thread_ticks(0, "kvd-pool-", &nw);
    long hz = sysconf(_SC_CLK_TCK);
    /* two spinning workers would take ~2 * hz ticks in that second */
    fprintf(stderr, "idle workers: %d, %ld ticks of CPU in 1 s (%ld per second of one core)\n", nw,
            t1 - t0, hz);
    assert_true(t1 - t0 <= 2);
#endif
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_partition_is_openmps),
        cmocka_unit_test(test_for_covers),
        cmocka_unit_test(test_steal_pieces),
        cmocka_unit_test(test_steal_takes_a_stalled_share),
        cmocka_unit_test(test_run_indices),
        cmocka_unit_test(test_workers_run_indices),
        cmocka_unit_test(test_nested),
        cmocka_unit_test(test_concurrent_callers),
        cmocka_unit_test(test_many_short_regions),
        cmocka_unit_test(test_shutdown_restart),
        cmocka_unit_test(test_after_fork),
        cmocka_unit_test(test_env),
        cmocka_unit_test(test_hold),
        cmocka_unit_test(test_idle_workers_sleep),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    cpu_pool_shutdown();
    return rc;
}
