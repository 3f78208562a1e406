/*
 * pool.c - the compute threads (see pool.h for the contract).
 *
 * Why not OpenMP's team. libgomp makes the same kind of pool, but how its
 * idle threads wait is one process-wide choice made from the environment
 * before main: spin (the default: the tools' speed, but a daemon's idle
 * workers then burn the cores its loop thread needs) or sleep at once
 * (OMP_WAIT_POLICY=passive, which `kvd serve` had to re-exec itself to get,
 * and which pays a futex wake per region: several per layer per token). A
 * pool of our own can do both: spin for a bounded time, then sleep.
 *
 * The hand-off. Each worker has its own sequence word, on its own cache
 * line. To hand out a region the caller writes the region (body, argument,
 * nth) into the pool, sets `pending` to the number of workers taking part,
 * and bumps the sequence word of each of them; a worker that sees its word
 * change runs its index and decrements `pending`. Only the workers a region
 * needs are touched, so a 1-thread step wakes nobody. Waiting, on either
 * side, is wait_word(): spin on the word for spin_ns, then announce
 * "sleeping" and futex-wait on the word. The waker bumps the word first and
 * then looks at the flag; the sleeper sets the flag first and then looks at
 * the word (both sequentially consistent), so at least one of them sees
 * the other and no wake is lost, while a waker facing a spinning waiter
 * makes no system call at all. The caller waits for `pending` to reach 0 in
 * the same way, woken by the worker whose decrement reaches 0.
 *
 * Holds. A forward pass is a few hundred regions, mostly microseconds
 * apart, but its caller also has serial stretches between some of them
 * (quantising a prompt's activations for the next product: hundreds of
 * microseconds), longer than the spin; a worker then sleeps, and the next
 * region pays a futex wake and the worker's wake-up latency, which on a
 * virtual machine can be tens of microseconds, a share of every product.
 * While the pool is held (cpu_pool_hold: the forward pass holds it), a
 * waiter whose spin ran out keeps looking for up to CPU_POOL_HOLD_US more,
 * with sched_yield between looks instead of pause: on an idle core that is
 * still a fast loop. On a crowded one a yield runs another thread for a
 * while; one that comes back later than YIELD_LATE_NS ends the wait in a
 * futex sleep, as without the hold: there a sleeper, woken, is run at once
 * (the scheduler credits sleepers), where a thread that kept yielding
 * waits its turn behind the others and the region with it. Outside holds
 * an idle daemon's workers sleep after the spin exactly as before.
 *
 * Late workers. On a machine with more runnable threads than cores a
 * worker may not run for milliseconds after its hand-out, and a region
 * that waited for it would take that long. So each index is claimed, once,
 * by an exchange on its worker's `taken` flag: the worker claims its own
 * when it wakes, and the caller, done with index 0, claims and runs every
 * index whose worker has not started yet. The partition is the same
 * whoever runs a chunk (chunk t is chunk t on any thread), so the results
 * are too; only the timing changes.
 *
 * Where a decoding step's threads wait. Timed inside the pool (a q8_0
 * 576x30 model decoding from 97 to 397 keys on 2 threads, 222-241
 * tokens/s, an AMX Xeon): ~150 regions per token; a matmul region took
 * 28-30 us of each thread, and the worker then waited 4.4-5.5 us before
 * the next, the caller 0.7-0.9 us at its end. Of the worker's wait, 1.6-1.7
 * us is the caller's own work between regions (norms, rotation, cache
 * writes, the activations' quantisation), ~2 us on average the attention
 * that follows a short context's one item on the caller (attn.c,
 * split_range), and ~1 us the hand-off itself. Together ~15% of the
 * worker's time at this length; none of it is one thing to remove.
 *
 * One region at a time: the caller holds `lock` from hand-out to the last
 * decrement, so the region fields are never rewritten while a worker reads
 * them, and a worker reads them only after its claim succeeded (acquire),
 * on a flag the caller reset after writing them (release).
 */
#include "cpu/pool.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef KVD_THREADS_OMP
#include <omp.h>
#else
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define SPIN_US_DEFAULT 50
/* A sched_yield that returns later than this ran someone else: a held
 * waiter then sleeps (see Holds). */
#define YIELD_LATE_NS 100000
#define SPIN_US_MAX 100000

/* ------------------------------------------------------------------------
 * Settings: thread count and spin time, from the environment once
 * ------------------------------------------------------------------------ */

enum { BAD_THREADS = 1, BAD_SPIN = 2 };

static struct {
    _Atomic int n_default; /* 0 until read */
    _Atomic int from_env;  /* 1: OMP_NUM_THREADS gave n_default */
    _Atomic long spin_ns;
    _Atomic int bad; /* BAD_* of variables ignored (lazy read only) */
} S;

static int cpus_usable(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

/* An integer in [lo, hi] at the start of s, ending at '\0' or at stop. */
static int parse_bounded(const char *s, char stop, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || (*end && *end != stop) || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

/* Read both variables; on a bad one fill err, and fall back to the default
 * for it only when lazy (the caller chose not to refuse). */
static int read_env(bool lazy, char *err, size_t errlen)
{
    const char *t = getenv("OMP_NUM_THREADS"), *s = getenv("KVD_SPIN_US");
    long n = 0, us = SPIN_US_DEFAULT;
    int bad = 0;
    if (t && *t && parse_bounded(t, ',', 1, CPU_POOL_MAX, &n)) {
        snprintf(err, errlen, "OMP_NUM_THREADS=\"%s\": want a thread count in [1, %d]", t,
                 CPU_POOL_MAX);
        bad |= BAD_THREADS;
        n = 0;
    }
    if (s && *s && parse_bounded(s, '\0', 0, SPIN_US_MAX, &us)) {
        snprintf(err, errlen, "KVD_SPIN_US=\"%s\": want microseconds in [0, %d]", s, SPIN_US_MAX);
        bad |= BAD_SPIN;
        us = SPIN_US_DEFAULT;
    }
    if (bad && !lazy)
        return -1;
    atomic_store(&S.from_env, n > 0);
    atomic_store(&S.spin_ns, us * 1000);
    atomic_store(&S.bad, bad);
    atomic_store(&S.n_default, n > 0 ? (int)n : cpus_usable());
    return 0;
}

#ifndef KVD_THREADS_OMP
static void settings(void)
{
    char err[160];
    if (!atomic_load(&S.n_default))
        read_env(true, err, sizeof(err));
}
#endif

int cpu_pool_init_env(char *err, size_t errlen)
{
    return read_env(false, err, errlen);
}

int cpu_pool_threads(int requested)
{
    if (requested > 0)
        return requested < CPU_POOL_MAX ? requested : CPU_POOL_MAX;
#ifdef KVD_THREADS_OMP
    int n = omp_get_max_threads();
    return n < 1 ? 1 : n < CPU_POOL_MAX ? n : CPU_POOL_MAX;
#else
    settings();
    return atomic_load(&S.n_default);
#endif
}

void cpu_pool_chunk(size_t n, int nth, int t, size_t *i0, size_t *i1)
{
    size_t q = n / (size_t)nth, r = n % (size_t)nth;
    size_t lo = (size_t)t < r ? (size_t)t * (q + 1) : (size_t)t * q + r;
    *i0 = lo;
    *i1 = lo + q + ((size_t)t < r);
}

/* A thread inside a region (a worker always; a caller during its region):
 * regions it starts run inline. */
static _Thread_local bool in_region;

static void run_inline(int nth, cpu_pool_fn fn, void *arg)
{
    for (int t = 0; t < nth; t++)
        fn(arg, t, nth);
}

/* ------------------------------------------------------------------------
 * The pool
 * ------------------------------------------------------------------------ */

#ifndef KVD_THREADS_OMP

struct worker {
    _Alignas(64) _Atomic uint32_t seq; /* bumped to hand this worker a region */
    _Atomic uint32_t sleeping;         /* 1 while it may be in futex wait on seq */
    _Atomic uint32_t taken;            /* 0: its index of this region is still unclaimed */
    pthread_t th;
    int id; /* its thread index in every region */
};

static struct {
    pthread_mutex_t lock; /* held for a whole region, a growth, a shutdown */
    _Atomic int n;        /* workers started: w[1..n] (written under lock) */
    struct worker *w[CPU_POOL_MAX];
    _Atomic int refused; /* pthread_create errors seen (indices ran on the caller) */
    /* the region being run: written under lock, before the hand-off */
    cpu_pool_fn fn;
    void *arg;
    int nth;
    _Atomic bool stop;
    _Atomic uint32_t pending; /* workers of this region still running */
    _Atomic uint32_t caller_sleeping;
    _Atomic int held;         /* cpu_pool_hold count */
    _Atomic long sleeps;      /* futex waits entered */
    _Atomic long late_yields; /* held waits ended by a late yield */
    _Atomic long held_out;    /* held waits that outlasted CPU_POOL_HOLD_US */
} P = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void futex_wait(_Atomic uint32_t *word, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake(_Atomic uint32_t *word)
{
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000L + ts.tv_nsec;
}

/* Wait until *word != seen (until_zero: until *word == 0) and return its
 * value: spin for spin_ns; while the pool is held, keep looking with
 * sched_yield between looks up to CPU_POOL_HOLD_US more, unless a yield
 * came back late (the core is wanted: see the opening comment); then
 * sleep, announcing it in *sleeping. */
static uint32_t wait_word(_Atomic uint32_t *word, uint32_t seen, bool until_zero,
                          _Atomic uint32_t *sleeping)
{
#define DONE(v) (until_zero ? (v) == 0 : (v) != seen)
    uint32_t v;
    long limit = atomic_load_explicit(&S.spin_ns, memory_order_relaxed), t0 = 0, t_prev = 0;
    bool yielding = false;
    for (unsigned i = 0; limit > 0; i++) {
        v = atomic_load_explicit(word, memory_order_acquire);
        if (DONE(v))
            return v;
        if ((i & 63) == 0 || yielding) {
            long t = now_ns();
            if (!t0)
                t0 = t;
            else if (t - t0 >= limit) {
                if (!atomic_load_explicit(&P.held, memory_order_relaxed))
                    break;
                if (t - t0 >= limit + CPU_POOL_HOLD_US * 1000L) {
                    atomic_fetch_add_explicit(&P.held_out, 1, memory_order_relaxed);
                    break;
                }
                if (yielding && t - t_prev > YIELD_LATE_NS) {
                    atomic_fetch_add_explicit(&P.late_yields, 1, memory_order_relaxed);
                    break;
                }
                yielding = true;
            }
            t_prev = t;
        }
        if (yielding)
            sched_yield();
        else
            cpu_relax();
    }
    for (;;) {
        atomic_store(sleeping, 1);
        v = atomic_load(word);
        if (!DONE(v)) {
            atomic_fetch_add_explicit(&P.sleeps, 1, memory_order_relaxed);
            futex_wait(word, v);
        }
        atomic_store(sleeping, 0);
        v = atomic_load_explicit(word, memory_order_acquire);
        if (DONE(v))
            return v;
    }
#undef DONE
}

static void *worker_main(void *p)
{
    struct worker *w = p;
    in_region = true;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_word(&w->seq, seen, false, &w->sleeping);
        if (atomic_load(&P.stop))
            return NULL;
        if (atomic_exchange(&w->taken, 1)) /* the caller ran it already */
            continue;
        P.fn(P.arg, w->id, P.nth);
        if (atomic_fetch_sub(&P.pending, 1) == 1 && atomic_load(&P.caller_sleeping))
            futex_wake(&P.pending);
    }
}

static void hand_to(struct worker *w)
{
    atomic_fetch_add(&w->seq, 1);
    if (atomic_load(&w->sleeping))
        futex_wake(&w->seq);
}

/* The child of a fork has the memory but not the threads. */
static void after_fork_child(void)
{
    pthread_mutex_init(&P.lock, NULL);
    for (int i = 1; i <= P.n; i++)
        free(P.w[i]);
    P.n = 0;
}

/* Start workers up to index want (under lock). Returns how many run. */
static int grow(int want)
{
    settings();
    static bool atfork;
    if (!atfork)
        atfork = !pthread_atfork(NULL, NULL, after_fork_child);
    while (P.n < want) {
        struct worker *w = aligned_alloc(64, sizeof(*w));
        if (!w)
            break;
        memset(w, 0, sizeof(*w));
        atomic_store(&w->taken, 1); /* nothing to run until a region says so */
        int id = P.n + 1;
        w->id = id;
        if (pthread_create(&w->th, NULL, worker_main, w)) {
            free(w);
            P.refused++;
            break;
        }
        char name[16];
        snprintf(name, sizeof(name), "kvd-pool-%d", id % 10000);
        pthread_setname_np(w->th, name);
        P.w[id] = w;
        P.n = id; /* after w[id]: a lock-free reader of n may look */
    }
    return P.n < want ? P.n : want;
}

/* Lock rule: P.lock only, held from the hand-out until every worker of the
 * region has decremented pending; bodies run under it and take no lock of
 * the pool's (their nested regions run inline). */
void cpu_pool_run(int nth, cpu_pool_fn fn, void *arg)
{
    nth = nth < CPU_POOL_MAX ? nth : CPU_POOL_MAX;
    if (nth <= 1 || in_region) {
        run_inline(nth < 1 ? 1 : nth, fn, arg);
        return;
    }
    pthread_mutex_lock(&P.lock);
    int live = grow(nth - 1);
    P.fn = fn;
    P.arg = arg;
    P.nth = nth;
    atomic_store(&P.pending, (uint32_t)live);
    for (int i = 1; i <= live; i++) {
        atomic_store(&P.w[i]->taken, 0); /* after the fields: a claim sees them */
        hand_to(P.w[i]);
    }
    in_region = true;
    fn(arg, 0, nth);
    for (int t = live + 1; t < nth; t++) /* indices no worker could take */
        fn(arg, t, nth);
    /* indices whose workers have not started yet (asleep, or descheduled on
     * a busy machine) run here rather than be waited for */
    uint32_t stolen = 0;
    for (int i = live; i >= 1; i--)
        if (!atomic_exchange(&P.w[i]->taken, 1)) {
            fn(arg, i, nth);
            stolen++;
        }
    in_region = false;
    if (stolen)
        atomic_fetch_sub(&P.pending, stolen);
    wait_word(&P.pending, 0, true, &P.caller_sleeping);
    pthread_mutex_unlock(&P.lock);
}

int cpu_pool_workers(void)
{
    return atomic_load(&P.n);
}

void cpu_pool_hold(void)
{
    atomic_fetch_add(&P.held, 1);
}

void cpu_pool_release(void)
{
    atomic_fetch_sub(&P.held, 1);
}

long cpu_pool_sleeps(long *late_yields, long *held_out)
{
    if (late_yields)
        *late_yields = atomic_load_explicit(&P.late_yields, memory_order_relaxed);
    if (held_out)
        *held_out = atomic_load_explicit(&P.held_out, memory_order_relaxed);
    return atomic_load_explicit(&P.sleeps, memory_order_relaxed);
}

void cpu_pool_shutdown(void)
{
    pthread_mutex_lock(&P.lock);
    atomic_store(&P.stop, true);
    for (int i = 1; i <= P.n; i++)
        hand_to(P.w[i]);
    for (int i = 1; i <= P.n; i++) {
        pthread_join(P.w[i]->th, NULL);
        free(P.w[i]);
    }
    P.n = 0;
    atomic_store(&P.stop, false);
    pthread_mutex_unlock(&P.lock);
}

const char *cpu_pool_describe(char *buf, size_t len)
{
    settings();
    int n = atomic_load(&S.n_default), bad = atomic_load(&S.bad);
    char src[48];
    if (atomic_load(&S.from_env))
        snprintf(src, sizeof(src), "OMP_NUM_THREADS");
    else
        snprintf(src, sizeof(src), "%d CPUs", cpus_usable());
    int refused = atomic_load(&P.refused);
    snprintf(buf, len, "kvd pool, %d threads by default (%s), spin %ld us%s%s%s", n, src,
             atomic_load(&S.spin_ns) / 1000,
             bad & BAD_THREADS ? ", bad OMP_NUM_THREADS ignored" : "",
             bad & BAD_SPIN ? ", bad KVD_SPIN_US ignored" : "",
             refused ? ", threads refused by the system: their indices ran on the caller" : "");
    return buf;
}

#else /* KVD_THREADS_OMP: the same regions on OpenMP's team */

void cpu_pool_run(int nth, cpu_pool_fn fn, void *arg)
{
    nth = nth < CPU_POOL_MAX ? nth : CPU_POOL_MAX;
    if (nth <= 1 || in_region) {
        run_inline(nth < 1 ? 1 : nth, fn, arg);
        return;
    }
    /* libgomp may give fewer threads than asked (thread limits): the
     * indices past the team's size run on the team's thread 0 */
#pragma omp parallel num_threads(nth)
    {
        int t = omp_get_thread_num(), got = omp_get_num_threads();
        in_region = true;
        fn(arg, t, nth);
        for (int u = got + t; t == 0 && u < nth; u++)
            fn(arg, u, nth);
        in_region = false;
    }
}

int cpu_pool_workers(void)
{
    return 0;
}

void cpu_pool_hold(void)
{
}

void cpu_pool_release(void)
{
}

long cpu_pool_sleeps(long *late_yields, long *held_out)
{
    if (late_yields)
        *late_yields = 0;
    if (held_out)
        *held_out = 0;
    return 0;
}

void cpu_pool_shutdown(void)
{
}

const char *cpu_pool_describe(char *buf, size_t len)
{
    const char *policy = getenv("OMP_WAIT_POLICY");
    snprintf(buf, len, "OpenMP, %d threads by default, OMP_WAIT_POLICY=%s", cpu_pool_threads(0),
             policy ? policy : "(unset)");
    return buf;
}

#endif

/* ------------------------------------------------------------------------
 * Parallel for
 * ------------------------------------------------------------------------ */

struct for_job {
    cpu_pool_range_fn fn;
    void *arg;
    size_t n;
};

static void for_body(void *p, int t, int nth)
{
    const struct for_job *j = p;
    size_t i0, i1;
    cpu_pool_chunk(j->n, nth, t, &i0, &i1);
    if (i0 < i1)
        j->fn(j->arg, i0, i1, t);
}

void cpu_pool_for(int nth, size_t n, cpu_pool_range_fn fn, void *arg)
{
    if (n == 0)
        return;
    if ((size_t)nth > n)
        nth = (int)n;
    struct for_job j = {fn, arg, n};
    cpu_pool_run(nth, for_body, &j);
}

/* ------------------------------------------------------------------------
 * Parallel for with stealing
 *
 * A static split waits for its slowest thread: on a machine with more
 * runnable threads than cores, a worker preempted halfway through its
 * chunk holds the whole region (and the next) for a scheduler time slice,
 * while the caller, done, spins. Here each chunk t is cut into pieces of
 * `grain` from its start, claimed one at a time by a fetch-add on the
 * chunk's own counter (its own cache line): thread t claims its chunk's
 * pieces in order, then the other chunks' remaining pieces, t + 1, t + 2,
 * ... So a preempted thread holds at most the piece it is in, and on cores
 * of their own each thread runs its own chunk exactly as cpu_pool_for
 * would, at the cost of one uncontended atomic per piece. The pieces are
 * fixed by (n, nth, grain) alone; only which thread runs one depends on
 * timing.
 * ------------------------------------------------------------------------ */

struct steal_job {
    cpu_pool_range_fn fn;
    void *arg;
    size_t n, grain;
    struct {
        _Alignas(64) _Atomic size_t next; /* pieces of chunk t handed out */
    } cur[CPU_POOL_STEAL_MAX];
};

/* The next piece [*i0, *i1) of chunk c, or false when none is left. */
static bool claim_piece(struct steal_job *j, int c, int nth, size_t *i0, size_t *i1)
{
    size_t lo, hi;
    cpu_pool_chunk(j->n, nth, c, &lo, &hi);
    if (atomic_load_explicit(&j->cur[c].next, memory_order_relaxed) * j->grain >= hi - lo)
        return false; /* spent: no need to bump (and bounce) its line */
    size_t k = atomic_fetch_add_explicit(&j->cur[c].next, 1, memory_order_relaxed);
    if (k * j->grain >= hi - lo)
        return false;
    *i0 = lo + k * j->grain;
    *i1 = hi - *i0 < j->grain ? hi : *i0 + j->grain;
    return true;
}

static void steal_body(void *p, int t, int nth)
{
    struct steal_job *j = p;
    size_t i0, i1;
    for (int d = 0; d < nth; d++)
        for (int c = (t + d) % nth; claim_piece(j, c, nth, &i0, &i1);)
            j->fn(j->arg, i0, i1, t);
}

void cpu_pool_for_steal(int nth, size_t n, size_t grain, cpu_pool_range_fn fn, void *arg)
{
    if (n == 0)
        return;
    if ((size_t)nth > n)
        nth = (int)n;
    if (nth > CPU_POOL_STEAL_MAX)
        nth = CPU_POOL_STEAL_MAX;
    struct steal_job j = {.fn = fn, .arg = arg, .n = n, .grain = grain ? grain : 1};
    for (int c = 0; c < nth; c++)
        atomic_init(&j.cur[c].next, 0);
    cpu_pool_run(nth, steal_body, &j);
}
