/*
 * bench_policies.c - what one eviction step costs under each policy.
 *
 * A sequence sits at its budget (4k and 32k retained tokens) and appends
 * one page of tokens; the append's eviction step is timed (median of many
 * steps, one thread). sink-window frees one whole page after the sinks and
 * moves nothing. The scored policies (h2o, tova, knorm, snapkv) rank the
 * middle by score, keep heavy_tokens of it and compact the survivors: the
 * heavy survivors after the first evicted one have their K/V rows copied
 * to their new slots (the window's whole pages move by page table, since
 * the step frees exactly one page), so a step costs O(heavy x bytes per
 * token) of memcpy in the worst case, spread over the page_tokens tokens
 * the step frees. The
 * scores are random (the worst case: the first evicted token sits near the
 * front of the middle); snapkv also pools over 7 neighbours.
 *
 * The shape is bench_cache's: 2 layers x 8 KV heads x 128 dims in f16
 * (8 KiB of K+V per token), 16-token pages, 4 sinks, heavy_tokens half of
 * the budget and the window the rest less one page.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/kv_cache.h"
#include "tests/bench/bench_util.h"

#define PT 16
#define STEPS 40

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void die(const char *what, const char *err)
{
    fprintf(stderr, "bench_policies: %s: %s\n", what, err);
    exit(1);
}

/* Median ns of one eviction step (an append of one page at the budget). */
static double step_ns(kv_cache *c, enum kv_policy_kind kind, int budget)
{
    int heavy = kind == KV_EVICT_SINK_WINDOW ? 0 : budget / 2;
    struct kv_policy pol = {.kind = kind,
                            .max_cache_tokens = budget,
                            .sink_tokens = 4,
                            .heavy_tokens = heavy,
                            .observe_tokens = 32,
                            .pool_tokens = 7,
                            .renumber = true};
    struct kv_budget b;
    kv_policy_budget(&pol, PT, &b);
    pol.window_tokens = (int)b.window_room;
    char err[256];
    kv_seq *s = kv_seq_create(c, &pol, false, err, sizeof(err));
    if (!s)
        die("kv_seq_create", err);
    int32_t ids[PT] = {0};
    uint32_t rng = 1;
    float *mass = malloc(sizeof(float) * (size_t)budget);
    double t[STEPS];
    for (int k = -1; k < STEPS;) {
        int n = kv_seq_n_tokens(s);
        bool full = n + PT > budget;
        if (full) { /* fresh random scores, as after a forward step */
            for (int i = 0; i < n; i++) {
                rng = rng * 1664525u + 1013904223u;
                mass[i] = (float)(rng >> 8);
            }
            if (kv_seq_mass_queries(s, 2) > 0 || kind == KV_EVICT_KNORM)
                kv_seq_add_mass(s, mass);
        }
        double t0 = bench_now();
        if (kv_seq_append(s, ids, PT, NULL))
            die("append", "refused");
        double dt = bench_now() - t0;
        if (full && k++ >= 0)
            t[k - 1] = dt;
    }
    kv_seq_destroy(s);
    free(mass);
    qsort(t, STEPS, sizeof(double), cmp_double);
    return t[STEPS / 2] * 1e9;
}

int main(void)
{
    struct kv_cache_params p = {.page_tokens = PT,
                                .n_layer = 2,
                                .n_kv_head = 8,
                                .head_dim = 128,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    const int budgets[] = {4096, 32768};
    p.memory_bytes = kv_cache_memory_for(&p, 32768 / PT + 8);
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        die("kv_cache_create", err);
    const enum kv_policy_kind kinds[] = {KV_EVICT_SINK_WINDOW, KV_EVICT_H2O, KV_EVICT_TOVA,
                                         KV_EVICT_KNORM, KV_EVICT_SNAPKV};
    printf("eviction step at the budget, one page (%d tokens) appended; 2x8x128 f16, "
           "8 KiB/token\n",
           PT);
    printf("%-12s %10s %14s %14s\n", "policy", "retained", "us/step", "ns/evicted tok");
    for (size_t bi = 0; bi < sizeof(budgets) / sizeof(budgets[0]); bi++)
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
            double ns = step_ns(c, kinds[k], budgets[bi]);
            printf("%-12s %10d %14.1f %14.0f\n", kv_policy_kind_name(kinds[k]), budgets[bi],
                   ns / 1e3, ns / PT);
        }
    kv_cache_destroy(c);
    return 0;
}
