/*
 * bench_spill.c - what saving a session to disk and reading it back cost,
 * per MiB of file ([sessions] dir; engine/spill.c).
 *
 * A session sequence of n retained tokens (2 layers x 8 KV heads x 128
 * dims in f16: 8 KiB of K and V per token, so the file is about n * 8 KiB)
 * is written with spill_write, which includes the checksum, the fsync and
 * the rename, then read back into a fresh session sequence with spill_read
 * (header checks, the state import, the rows into pages, the checksum),
 * and the restored rows are compared with the originals. The read comes
 * from the page cache (the file was just written): it measures kvd's work,
 * not the disk; the write's fsync does wait for the disk. Best of a few
 * runs; ms per MiB and MiB/s for both. The files go to $TMPDIR (or /tmp).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache/kv_cache.h"
#include "engine/spill.h"
#include "tests/bench/bench_util.h"

#define RUNS 3

static kv_cache *make_cache(int tokens)
{
    struct kv_cache_params p = {.page_tokens = 16,
                                .n_layer = 2,
                                .n_kv_head = 8,
                                .head_dim = 128,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    p.memory_bytes = kv_cache_memory_for(&p, 2 * (tokens / 16 + 2));
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        fprintf(stderr, "bench_spill: %s\n", err);
    return c;
}

/* A session of n tokens with random rows. */
static kv_seq *make_session(kv_cache *c, int n, const struct kv_policy *pol)
{
    char err[256];
    kv_seq *s = kv_seq_create(c, pol, true, err, sizeof(err));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    if (!s || !ids)
        return NULL;
    for (int i = 0; i < n; i++)
        ids[i] = (i * 7919) % 32000;
    if (kv_seq_append(s, ids, n, NULL) != 0)
        return NULL;
    free(ids);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    uint32_t x = 12345;
    for (int layer = 0; layer < l.n_layer; layer++)
        for (int h = 0; h < l.n_kv_head; h++)
            for (int i = 0; i < n; i++) {
                uint8_t *k = kv_seq_k(s, layer, h, i), *v = kv_seq_v(s, layer, h, i);
                for (size_t b = 0; b < l.k_row_bytes; b++) {
                    x = x * 1664525u + 1013904223u;
                    k[b] = (uint8_t)(x >> 24);
                    v[b] = (uint8_t)(x >> 16);
                }
            }
    return s;
}

static bool same_rows(kv_seq *a, kv_seq *b, const struct kv_layout *l)
{
    int n = kv_seq_n_tokens(a);
    if (n != kv_seq_n_tokens(b))
        return false;
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int h = 0; h < l->n_kv_head; h++)
            for (int i = 0; i < n; i++)
                if (memcmp(kv_seq_k(a, layer, h, i), kv_seq_k(b, layer, h, i), l->k_row_bytes) ||
                    memcmp(kv_seq_v(a, layer, h, i), kv_seq_v(b, layer, h, i), l->v_row_bytes))
                    return false;
    return true;
}

static int bench(const char *dir, int n)
{
    kv_cache *c = make_cache(n);
    struct kv_policy pol = {.kind = KV_EVICT_NONE, .max_cache_tokens = n, .renumber = true};
    kv_seq *s = c ? make_session(c, n, &pol) : NULL;
    if (!s)
        return 1;
    struct kv_layout l;
    kv_cache_layout(c, &l);
    char path[600], err[512];
    snprintf(path, sizeof(path), "%s/bench.kvs", dir);
    double best_w = 1e30, best_r = 1e30;
    uint64_t bytes = 0;
    for (int run = 0; run < RUNS; run++) {
        double t0 = bench_now();
        if (spill_write(dir, path, "bench", s, 42, 0, &bytes, err, sizeof(err)) != 0) {
            fprintf(stderr, "bench_spill: %s\n", err);
            return 1;
        }
        double t1 = bench_now();
        kv_seq *r = kv_seq_create(c, &pol, true, err, sizeof(err));
        if (!r || spill_read(path, "bench", 42, r, NULL, err, sizeof(err)) != 0) {
            fprintf(stderr, "bench_spill: %s\n", r ? err : "no sequence");
            return 1;
        }
        double t2 = bench_now();
        if (!same_rows(s, r, &l)) {
            fprintf(stderr, "bench_spill: the restored rows differ\n");
            return 1;
        }
        kv_seq_destroy(r);
        best_w = t1 - t0 < best_w ? t1 - t0 : best_w;
        best_r = t2 - t1 < best_r ? t2 - t1 : best_r;
    }
    unlink(path);
    double mib = (double)bytes / (1 << 20);
    printf("%7d tokens  %8.1f MiB   save %7.2f ms/MiB (%7.0f MiB/s)   restore %7.2f ms/MiB "
           "(%7.0f MiB/s)\n",
           n, mib, best_w * 1e3 / mib, mib / best_w, best_r * 1e3 / mib, mib / best_r);
    kv_seq_destroy(s);
    kv_cache_destroy(c);
    return 0;
}

int main(void)
{
    const char *base = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/kvd-bench-spill-XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(dir)) {
        perror("bench_spill: mkdtemp");
        return 1;
    }
    printf("session save (write, checksum, fsync, rename) and restore (read, checks, rows into "
           "pages; page cache), best of %d; 8 KiB of K+V per token\n",
           RUNS);
    int rc = 0;
    int sizes[] = {512, 4096};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]) && !rc; i++)
        rc = bench(dir, sizes[i]);
    rmdir(dir);
    return rc;
}
