/*
 * bench_cache.c - the cost of an eviction step per evicted token against a
 * context shift.
 *
 * kvd evicts from the middle of a sequence by freeing whole pages and (in
 * renumber mode) rewriting the int32 position array; keys stay unrotated
 * and untouched. llama.cpp's context shift instead drops cells and then
 * re-rotates every retained key in place by the position delta, so that the
 * survivors look as if they had always sat at their new positions. This
 * benchmark measures both on the same cache, at 4k, 32k and 128k retained
 * tokens, on two shapes: 2 layers x 8 KV heads x 128 dims, and the 30
 * layers x 3 KV heads x 64 dims of SmolLM-135M, f16:
 *
 *   1 page    one sink-window step freeing one page (16 tokens), renumber
 *             and preserve modes: ns per step and per evicted token; the
 *             median of many steps. Renumbering rewrites every retained
 *             position, so this step costs O(retained) whatever it frees.
 *   step      the step the policy takes at its budget (automatic window):
 *             the budget's eviction step (kv_budget.step_tokens: a page,
 *             or 1/256 of the budget in whole pages when larger), so the
 *             O(retained) renumber is spread over that many tokens; ns per
 *             evicted token, renumber mode.
 *   shift     the baseline, implemented here only: for every retained
 *             token, layer and KV head, load the f16 key row, rotate each
 *             RoPE pair by the delta and store it back. cos/sin of the delta
 *             are computed once (the delta is the same for every cell) and
 *             the rotation is vectorised with F16C, both of which favour the
 *             baseline (ggml recomputes them per cell, in scalar code for
 *             f16). One thread, like our step. Its cost per retained token
 *             is its cost per evicted token when a shift discards as many
 *             tokens as it keeps (llama.cpp discards half by default).
 *
 * The ratio printed is shift ns per retained token / ours ns per evicted
 * token, both measured in this run: above 1, our eviction costs less per
 * evicted token than a shift.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#endif

#include "cache/kv_cache.h"

#define PT 16
#define SINKS 4
#define MAX_HEAD_DIM 128

struct shape {
    const char *name;
    int n_layer, n_kv_head, head_dim;
};

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

static void die(const char *what, const char *err)
{
    fprintf(stderr, "bench_cache: %s: %s\n", what, err);
    exit(1);
}

/* Rotate one f16 key row of head_dim elements (neox pairing) by the angles
 * in cos_t/sin_t: 8 pairs at a time with F16C conversions where the CPU
 * has them. */
static void rotate_row(_Float16 *restrict k, const float *restrict cos_t,
                       const float *restrict sin_t, int head_dim)
{
    const int half = head_dim / 2;
    int i = 0;
#if defined(__F16C__) && defined(__AVX__)
    for (; i + 8 <= half; i += 8) {
        __m256 x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i)));
        __m256 x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i + half)));
        __m256 c = _mm256_loadu_ps(cos_t + i), sn = _mm256_loadu_ps(sin_t + i);
        __m256 y0 = _mm256_sub_ps(_mm256_mul_ps(x0, c), _mm256_mul_ps(x1, sn));
        __m256 y1 = _mm256_add_ps(_mm256_mul_ps(x0, sn), _mm256_mul_ps(x1, c));
        _mm_storeu_si128((__m128i *)(k + i), _mm256_cvtps_ph(y0, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128((__m128i *)(k + i + half), _mm256_cvtps_ph(y1, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < half; i++) {
        float x0 = (float)k[i], x1 = (float)k[i + half];
        k[i] = (_Float16)(x0 * cos_t[i] - x1 * sin_t[i]);
        k[i + half] = (_Float16)(x0 * sin_t[i] + x1 * cos_t[i]);
    }
}

/* The baseline: rotate every retained key by delta, walking the pages in
 * memory order (page, layer, head, slot) so it streams. */
static void context_shift(kv_seq *s, const struct shape *sh, int32_t delta)
{
    float cos_t[MAX_HEAD_DIM / 2], sin_t[MAX_HEAD_DIM / 2];
    for (int i = 0; i < sh->head_dim / 2; i++) {
        double theta = (double)delta * pow(10000.0, -2.0 * i / sh->head_dim);
        cos_t[i] = (float)cos(theta);
        sin_t[i] = (float)sin(theta);
    }
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(s), &l);
    const int n = kv_seq_n_tokens(s);
    const int32_t *table = kv_seq_page_table(s);
    for (int j = 0; j < kv_seq_n_pages(s); j++) {
        int slots = n - j * PT < PT ? n - j * PT : PT;
        for (int layer = 0; layer < sh->n_layer; layer++)
            for (int h = 0; h < sh->n_kv_head; h++)
                for (int slot = 0; slot < slots; slot++)
                    rotate_row(kv_layout_elem(&l, table[j], slot, layer, h, false), cos_t, sin_t,
                               sh->head_dim);
    }
}

/* Append tokens until s holds n, writing keys that look like keys when
 * keys is set (the shift reads them; eviction never does). */
static void fill(kv_seq *s, const struct shape *sh, int n, bool keys)
{
    static int32_t ids[4096];
    uint32_t rng = 1;
    while (kv_seq_n_tokens(s) < n) {
        int m = n - kv_seq_n_tokens(s);
        if (m > 4096)
            m = 4096;
        for (int i = 0; i < m; i++)
            ids[i] = i;
        int first;
        if (kv_seq_append(s, ids, m, &first) != 0)
            die("fill", "append failed");
        for (int t = first; keys && t < first + m; t++)
            for (int layer = 0; layer < sh->n_layer; layer++)
                for (int h = 0; h < sh->n_kv_head; h++) {
                    _Float16 *k = kv_seq_k(s, layer, h, t);
                    for (int d = 0; d < sh->head_dim; d++) {
                        rng = rng * 1664525u + 1013904223u;
                        k[d] = (_Float16)((float)(rng >> 16) / 32768.0f - 1.0f);
                    }
                }
    }
}

struct result {
    double page_ns, page_preserve_ns; /* one-page step */
    int step_tokens;                  /* the policy's step at its budget */
    double step_ns;                   /* that step, renumber */
    double shift_ns;
};

/* Steps of `step` tokens from `top` tokens (the budget) down, each refilled
 * untimed; the median step in ns. */
static double time_steps(kv_seq *s, const struct shape *sh, int top, int need, int step, int n)
{
    static double t[301];
    for (int i = 0; i < n; i++) {
        double t0 = now();
        int ev = kv_seq_evict(s, need);
        t[i] = now() - t0;
        if (ev != step || kv_seq_n_tokens(s) != top - step)
            die("eviction step", "evicted something other than the step");
        fill(s, sh, top, false);
    }
    return median(t, n) * 1e9;
}

static struct result run(const struct shape *sh, int retained)
{
    char err[256];
    struct kv_cache_params p = {.page_tokens = PT,
                                .n_layer = sh->n_layer,
                                .n_kv_head = sh->n_kv_head,
                                .head_dim = sh->head_dim,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    p.memory_bytes = kv_cache_memory_for(&p, retained / PT + 8);
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        die("kv_cache_create", err);
    struct result r;

    /* One page a step: budget retained + one page, a window that leaves
     * one page of slack after the sink page. Both position modes. */
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = retained + PT,
                            .sink_tokens = SINKS,
                            .window_tokens = retained - PT,
                            .renumber = true};
    kv_seq *s = kv_seq_create(c, &pol, false, err, sizeof(err));
    if (!s)
        die("kv_seq_create", err);
    fill(s, sh, retained + PT, false);
    r.page_ns = time_steps(s, sh, retained + PT, PT, PT, 301);
    pol.renumber = false;
    kv_seq_set_policy(s, &pol);
    r.page_preserve_ns = time_steps(s, sh, retained + PT, PT, PT, 301);
    kv_seq_destroy(s);

    /* The policy's own step: budget `retained`, the automatic window (as
     * the config resolves window_tokens = 0), one token to make room for. */
    pol = (struct kv_policy){.kind = KV_EVICT_SINK_WINDOW,
                             .max_cache_tokens = retained,
                             .sink_tokens = SINKS,
                             .renumber = true};
    struct kv_budget b;
    kv_policy_budget(&pol, PT, &b);
    pol.window_tokens = (int)b.window_tokens;
    pol.window_auto = true;
    r.step_tokens = (int)b.step_tokens;
    s = kv_seq_create(c, &pol, false, err, sizeof(err));
    if (!s)
        die("kv_seq_create", err);
    fill(s, sh, retained, true);
    r.step_ns = time_steps(s, sh, retained, 1, r.step_tokens, 101);

    /* The baseline on the same cache and keys. */
    double ts[3];
    for (int i = 0; i < 3; i++) {
        double t0 = now();
        context_shift(s, sh, -PT);
        ts[i] = now() - t0;
    }
    r.shift_ns = median(ts, 3) * 1e9;
    kv_seq_destroy(s);
    kv_cache_destroy(c);
    return r;
}

int main(void)
{
    const struct shape shapes[] = {{"2x8x128", 2, 8, 128}, {"30x3x64", 30, 3, 64}};
    const int sizes[] = {4096, 32768, 131072};
    printf("eviction step vs context shift per token: layers x KV heads x dims, f16, %d-token "
           "pages, 1 thread\n",
           PT);
    printf("%8s %9s | %10s %9s %11s | %6s %10s %9s | %11s | %10s %10s\n", "shape", "retained",
           "1 page ns", "ns/token", "preserve ns", "step", "step ns", "ns/token", "shift ns/tok",
           "shift/page", "shift/step");
    for (size_t k = 0; k < sizeof(shapes) / sizeof(shapes[0]); k++)
        for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
            struct result r = run(&shapes[k], sizes[i]);
            double page_tok = r.page_ns / PT, step_tok = r.step_ns / r.step_tokens;
            double shift_tok = r.shift_ns / sizes[i];
            printf("%8s %9d | %10.0f %9.1f %11.0f | %6d %10.0f %9.1f | %11.1f | %9.2fx %9.2fx\n",
                   shapes[k].name, sizes[i], r.page_ns, page_tok, r.page_preserve_ns, r.step_tokens,
                   r.step_ns, step_tok, shift_tok, shift_tok / page_tok, shift_tok / step_tok);
            fflush(stdout);
        }
    printf("(1 page: one sink-window step freeing one %d-token page, renumber (and preserve); "
           "step: the policy's step at its budget, renumber; shift: re-rotate every retained "
           "key in place, cos/sin precomputed, per retained token; ratios: shift per retained "
           "token / ours per evicted token)\n",
           PT);
    return 0;
}
