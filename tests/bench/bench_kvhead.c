/*
 * bench_kvhead.c - per-KV-head token sets against the shared set: what the
 * kernel pays when each KV head of a sequence keeps its own tokens.
 *
 * kvd's pages hold every KV head of their tokens (cache/kv_cache.h), so a
 * sequence has one page table and one position array and the kernel's
 * decode unit computes a tile's page addresses and RoPE angles once for all
 * of its KV heads. Per-head token sets that actually save memory need
 * pages per (sequence, KV head): n_kv_head page tables and position arrays,
 * and the kernel then runs n_kv_head units of one KV head each, every one
 * computing its own addresses and angles. (A per-head mask over shared
 * pages saves no memory at all: a token's page is freed only when every
 * head has dropped it.) This benchmark builds both layouts with the same
 * bytes of K/V and the same tokens per head, and times attn_run on them:
 *
 *   shared    S decode sequences, 32 query heads over 8 KV heads, one page
 *             table each (pages of 8 heads);
 *   per-head  the same data as S x 8 sequences of one KV head (4 query
 *             heads), each with its own page table and positions (pages of
 *             one head), as pages per (sequence, KV head) would give.
 *
 * Both are f16 K/V, RoPE, 16-token pages, 2 threads, best of 15 calls
 * (interleaved); the K/V
 * stay warm between calls (the ratio, not the bandwidth, is the point).
 * Printed, never asserted.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "tests/bench/bench_util.h"

#define THREADS 2
#define H 32
#define KVH 8
#define G (H / KVH)
#define D 128
#define PT 16
#define S 4
#define ROW (D * 2) /* bytes of one f16 row */
#define TRIALS 15

static void *xalloc(size_t n)
{
    void *p = aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "bench_kvhead: out of memory for %zu bytes\n", n);
        exit(1);
    }
    return p;
}

/* Fill n f16 values with small pseudo-random numbers. */
static void fill_f16(_Float16 *x, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        x[i] = (_Float16)((float)(seed >> 9) / 4194304.0f - 1.0f);
    }
}

static attn_ctx *make_ctx(int n_head, int n_kv_head)
{
    struct attn_params p = {.n_head = n_head,
                            .n_kv_head = n_kv_head,
                            .head_dim = D,
                            .scale = 1.0f / sqrtf((float)D),
                            .pos = {.kind = POS_ROPE,
                                    .rope_theta = 10000.0f,
                                    .rope_dims = D,
                                    .rope_pairing = POS_ROPE_NEOX,
                                    .rope_freq_scale = 1.0f},
                            .n_threads = THREADS};
    char err[256];
    attn_ctx *c = attn_create(&p, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "bench_kvhead: attn_create: %s\n", err);
        exit(1);
    }
    return c;
}

/* Best of TRIALS calls of each layout, the two interleaved so that a burst
 * of load on a shared machine hits both alike. */
static void best_of_both(attn_ctx *c1, const struct attn_kv *kv1, const struct attn_seq *s1, int n1,
                         attn_ctx *c2, const struct attn_kv *kv2, const struct attn_seq *s2, int n2,
                         double *t1, double *t2)
{
    *t1 = *t2 = 1e30;
    for (int t = 0; t < TRIALS; t++)
        for (int which = 0; which < 2; which++) {
            double t0 = bench_now();
            attn_ctx *c = which ? c2 : c1;
            if (attn_run(c, which ? kv2 : kv1, which ? s2 : s1, which ? n2 : n1)) {
                fprintf(stderr, "bench_kvhead: attn_run: %s\n", attn_error(c));
                exit(1);
            }
            double dt = bench_now() - t0, *best = which ? t2 : t1;
            *best = dt < *best ? dt : *best;
        }
}

static void run(int L)
{
    int pages = L / PT;
    /* shared: pages of all KVH heads; per-head: pages of one head. */
    size_t sh_page = (size_t)KVH * PT * ROW * 2, ph_page = (size_t)PT * ROW * 2;
    uint8_t *sh = xalloc(sh_page * (size_t)S * pages);
    uint8_t *ph = xalloc(ph_page * (size_t)S * KVH * pages);
    fill_f16((_Float16 *)sh, sh_page * (size_t)S * pages / 2, 1);
    fill_f16((_Float16 *)ph, ph_page * (size_t)S * KVH * pages / 2, 2);
    int32_t *sh_tab = xalloc(sizeof(int32_t) * (size_t)S * pages);
    int32_t *ph_tab = xalloc(sizeof(int32_t) * (size_t)S * KVH * pages);
    for (int i = 0; i < S * pages; i++)
        sh_tab[i] = i;
    for (int i = 0; i < S * KVH * pages; i++)
        ph_tab[i] = i;
    int32_t *pos = xalloc(sizeof(int32_t) * (size_t)S * KVH * L); /* one array per head */
    for (int i = 0; i < S * KVH * L; i++)
        pos[i] = i % L;
    float *q = xalloc(sizeof(float) * S * H * D), *out = xalloc(sizeof(float) * S * H * D);
    for (int i = 0; i < S * H * D; i++)
        q[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    int32_t q_pos = L - 1;

    struct attn_kv kv_sh = {.base = sh, .page_bytes = sh_page, .k_offset = 0,
                            .v_offset = (size_t)KVH * PT * ROW, .page_tokens = PT,
                            .k_type = ATTN_F16, .v_type = ATTN_F16};
    struct attn_kv kv_ph = {.base = ph, .page_bytes = ph_page, .k_offset = 0,
                            .v_offset = (size_t)PT * ROW, .page_tokens = PT,
                            .k_type = ATTN_F16, .v_type = ATTN_F16};
    struct attn_seq seq_sh[S], seq_ph[S * KVH];
    for (int s = 0; s < S; s++) {
        seq_sh[s] = (struct attn_seq){.page_table = sh_tab + (size_t)s * pages, .pos = pos,
                                      .n_kv = L, .n_q = 1, .q_pos = &q_pos,
                                      .q = q + (size_t)s * H * D, .out = out + (size_t)s * H * D};
        for (int h = 0; h < KVH; h++) {
            int k = s * KVH + h;
            seq_ph[k] = (struct attn_seq){.page_table = ph_tab + (size_t)k * pages,
                                          .pos = pos + (size_t)k * L, .n_kv = L, .n_q = 1,
                                          .q_pos = &q_pos,
                                          .q = q + ((size_t)s * H + (size_t)h * G) * D,
                                          .out = out + ((size_t)s * H + (size_t)h * G) * D};
        }
    }
    attn_ctx *c_sh = make_ctx(H, KVH), *c_ph = make_ctx(G, 1);
    double t_sh, t_ph;
    best_of_both(c_sh, &kv_sh, seq_sh, S, c_ph, &kv_ph, seq_ph, S * KVH, &t_sh, &t_ph);
    /* Bookkeeping per sequence: page table ids and pos/id/hidx/score per token. */
    double meta_sh = 4.0 * pages + 16.0 * L, meta_ph = KVH * (4.0 * pages + 12.0 * L) + 4.0 * L;
    printf("%8d %12.1f %12.1f %8.2f %14.0f %14.0f\n", L, t_sh * 1e6, t_ph * 1e6, t_ph / t_sh,
           meta_sh, meta_ph);
    attn_destroy(c_sh);
    attn_destroy(c_ph);
    free(sh);
    free(ph);
    free(sh_tab);
    free(ph_tab);
    free(pos);
    free(q);
    free(out);
}

int main(void)
{
    printf("decode, %d sequences, %d q heads / %d kv heads x %d, f16, RoPE, %d threads\n", S, H,
           KVH, D, THREADS);
    printf("%8s %12s %12s %8s %14s %14s\n", "tokens", "shared us", "per-head us", "ratio",
           "meta B shared", "meta B per-hd");
    const int Ls[] = {1024, 4096, 16384};
    for (size_t i = 0; i < sizeof(Ls) / sizeof(Ls[0]); i++)
        run(Ls[i]);
    return 0;
}
