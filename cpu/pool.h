/*
 * pool.h - kvd's compute threads: one persistent pool that every parallel
 * kernel runs on (the matmuls, attention, the element-wise loops of the
 * forward pass, requantizing).
 *
 * A region is a function run once per thread index t = 0..nth-1: index 0
 * on the calling thread, the others on the pool's workers, which are
 * started once (the first region that needs them) and then live until
 * cpu_pool_shutdown; an index whose worker has not started by the time the
 * caller is done with index 0 runs on the caller instead. A worker that finishes a region
 * spins for a short while (KVD_SPIN_US, 50 microseconds by default) watching
 * for the next one, then sleeps on a futex; the caller waits for the last
 * worker the same way. So the regions of one forward pass, microseconds
 * apart, hand over without a system call, and an idle daemon's workers
 * sleep and leave the cores to the loop thread: no wait policy to choose.
 *
 * Partition. cpu_pool_for splits [0, n) exactly as OpenMP's
 * `schedule(static)` does: nth contiguous chunks in index order, the first
 * n % nth of them one element longer (cpu_pool_chunk says which). The
 * chunks depend only on n and nth, never on timing or on which thread runs
 * them, so a kernel whose chunks are independent gives the same bits at any thread
 * count and in any batch.
 *
 * Threads, the rules in full:
 *  - Regions from different threads run one at a time: a caller holds the
 *    pool's one lock for its whole region, so a second engine's region
 *    waits for the first to end (two engines in one process share the
 *    cores by turns, which on a machine with as many threads as cores is
 *    what they would get anyway).
 *  - A region started from inside a region (a body that calls cpu_pool_run
 *    or cpu_pool_for, on any of its threads) runs all its nth indices one
 *    after another on that thread, in index order, with the same nth: the
 *    partition, and so the results, are those of a parallel run.
 *  - Bodies must not wait for one another (no barriers, no spinning on
 *    another index's progress): an index may run after another has
 *    returned, on another thread than its own (the caller runs the indices
 *    of workers that have not started when it is done with index 0; never
 *    two threads the same index at once). Work that needs a barrier is two
 *    regions.
 *  - The pool grows to the largest nth asked for (up to CPU_POOL_MAX) and
 *    never shrinks until cpu_pool_shutdown. If the system refuses a thread,
 *    the indices that thread would have run run on the caller after its
 *    own (the same results, later), and cpu_pool_describe says so.
 *  - After fork() the child has no workers; its first region starts them
 *    (not in the OpenMP build: libgomp's team does not survive a fork).
 *
 * Thread count. Callers pass the count they were configured with
 * (`--threads`, [server] threads); 0 means cpu_pool_threads(0): the
 * OMP_NUM_THREADS environment variable when set (the knob operators
 * already used with the OpenMP build; its first value), else the number of
 * CPUs this process may run on.
 *
 * Build option: `make THREADS=omp` runs the same regions on OpenMP's team
 * instead (same partition, same rules); the default is this pool.
 *
 * Nothing here prints or exits.
 */
#ifndef KVD_CPU_POOL_H
#define KVD_CPU_POOL_H

#include <stdbool.h>
#include <stddef.h>

/* The most threads a region may ask for (the config's bound). */
#define CPU_POOL_MAX 1024

/* A region's body: thread index t of nth. */
typedef void (*cpu_pool_fn)(void *arg, int t, int nth);

/* A parallel-for body: the indices [i0, i1) of chunk t (never empty). */
typedef void (*cpu_pool_range_fn)(void *arg, size_t i0, size_t i1, int t);

/*
 * Run fn(arg, t, nth) once for every t in 0..nth-1, t = 0 on the calling
 * thread, each other t on a worker or, if it is late, on the caller;
 * return when all have returned. nth <= 1 runs fn(arg, 0, 1) inline, with
 * no lock and no worker. nth above CPU_POOL_MAX is cut to it. May block
 * while another thread's region runs (see the rules above).
 */
void cpu_pool_run(int nth, cpu_pool_fn fn, void *arg);

/*
 * Split [0, n) into nth static chunks (cpu_pool_chunk) and run fn on each
 * non-empty one, chunk t as region index t. nth is first cut to n (the chunks of
 * threads past n would be empty), so nth >= n costs n threads at most.
 */
void cpu_pool_for(int nth, size_t n, cpu_pool_range_fn fn, void *arg);

/*
 * cpu_pool_for's chunks, each cut from its start into pieces of grain
 * indices (0 counts as 1; the last piece of a chunk may be shorter), and
 * each piece run once by fn, by whichever thread claims it first: thread t
 * claims the pieces of its own chunk in order, then what is left of the
 * others'. So a thread that is descheduled mid-region (more runnable
 * threads than cores) delays the region by at most one piece, where
 * cpu_pool_for would wait for its whole chunk. The pieces depend only on
 * n, nth and grain; which thread runs one (the t fn sees) depends on
 * timing, so fn's results must not depend on t. nth is cut to n and to
 * CPU_POOL_STEAL_MAX.
 */
#define CPU_POOL_STEAL_MAX 64
void cpu_pool_for_steal(int nth, size_t n, size_t grain, cpu_pool_range_fn fn, void *arg);

/* Thread t's chunk [*i0, *i1) of [0, n) split nth ways, as OpenMP's
 * schedule(static) without a chunk size gives it. */
void cpu_pool_chunk(size_t n, int nth, int t, size_t *i0, size_t *i1);

/* requested > 0: requested (cut to CPU_POOL_MAX); else the default count
 * (OMP_NUM_THREADS, else the CPUs this process may use). Always >= 1. */
int cpu_pool_threads(int requested);

/*
 * Read OMP_NUM_THREADS and KVD_SPIN_US (microseconds a waiting thread
 * spins before it sleeps, 0..100000) now, and refuse bad values: returns 0,
 * or -1 with err naming the variable and what it wants. `kvd` calls it at
 * start; without the call the variables are read at the first region and a
 * bad value is ignored (cpu_pool_describe then says so).
 */
int cpu_pool_init_env(char *err, size_t errlen);

/*
 * One line for logs: "kvd pool, 2 threads by default (2 CPUs), spin 50 us"
 * or "OpenMP, 2 threads by default, OMP_WAIT_POLICY=passive" (the count a
 * caller's 0 means; --threads and [server] threads choose their own).
 * Returns buf.
 */
const char *cpu_pool_describe(char *buf, size_t len);

/*
 * A run of regions close together (one forward pass). Between
 * cpu_pool_hold and cpu_pool_release, a thread waiting for the next region
 * (a worker) or for a region's end (the caller) that has spun KVD_SPIN_US
 * without news does not go to sleep at once: it keeps looking, giving the
 * CPU away (sched_yield) between looks, for up to CPU_POOL_HOLD_US more,
 * or until a yield comes back late (another thread wanted the core: then it
 * sleeps as without a hold). So on cores of its own the regions of a
 * forward pass hand over without a futex wake even across the caller's
 * serial stretches between them (quantising a prompt's activations takes
 * hundreds of microseconds), and on a crowded machine nothing changes.
 * Holds nest (a
 * count, any thread may hold); the last release shortens the waits at once.
 * With KVD_SPIN_US=0 a hold changes nothing (no waiting thread looks). In
 * the OpenMP build both do nothing.
 */
#define CPU_POOL_HOLD_US 2000
void cpu_pool_hold(void);
void cpu_pool_release(void);

/* Times a waiting thread of the pool went to sleep on its futex since the
 * start, and (each may be NULL) how many held waits ended because a yield
 * came back late (late_yields) or because the wait outlasted
 * CPU_POOL_HOLD_US (held_out): the two ways a held wait still sleeps, both
 * signs of a crowded machine or a long gap (for tests and measurements; 0
 * in the OpenMP build). */
long cpu_pool_sleeps(long *late_yields, long *held_out);

/* Workers running now (0 before the first parallel region and after
 * cpu_pool_shutdown; always 0 in the OpenMP build). */
int cpu_pool_workers(void);

/*
 * Stop and join every worker. Must not be called from inside a region;
 * waits for another thread's region to end first. The next region starts
 * the workers again.
 */
void cpu_pool_shutdown(void);

#endif /* KVD_CPU_POOL_H */
