/*
 * bench_cache.c - the cost of one eviction step against a context shift.
 *
 * kvd evicts from the middle of a sequence by freeing whole pages and (in
 * renumber mode) rewriting the int32 position array; keys stay unrotated
 * and untouched. llama.cpp's context shift instead drops cells and then
 * re-rotates every retained key in place by the position delta, so that the
 * survivors look as if they had always sat at their new positions. This
 * benchmark measures both on the same cache, at 4k, 32k and 128k retained
 * tokens:
 *
 *   ours      one sink-window eviction step freeing one page (16 tokens),
 *             renumber and preserve modes: ns per step (= per evicted page)
 *             and ns per retained token; the median of many steps.
 *   shift     the baseline, implemented here only: for every retained
 *             token, layer and KV head, load the f16 key row, rotate each
 *             RoPE pair by the delta and store it back. cos/sin of the delta
 *             are computed once (the delta is the same for every cell) and
 *             the rotation is vectorised with F16C, both of which favour the
 *             baseline (ggml recomputes them per cell, in scalar code for
 *             f16). One thread, like our step.
 *
 * The shape is 2 layers x 8 KV heads x 128 dims in f16 (8 KiB of K+V per
 * token) so that 128k tokens fit a small machine. The baseline's cost grows
 * with layers x heads x dims; ours does not depend on them at all, so on a
 * 32-layer model the ratio would be 16 times larger. The ratio printed is
 * shift / ours, measured in this run.
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
#define N_LAYER 2
#define N_KV_HEAD 8
#define HEAD_DIM 128
#define SINKS 4

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

/* Rotate one f16 key row (neox pairing) by the angles in cos_t/sin_t:
 * 8 pairs at a time with F16C conversions where the CPU has them. */
static void rotate_row(_Float16 *restrict k, const float *restrict cos_t,
                       const float *restrict sin_t)
{
    const int half = HEAD_DIM / 2;
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
static void context_shift(kv_seq *s, int32_t delta)
{
    float cos_t[HEAD_DIM / 2], sin_t[HEAD_DIM / 2];
    for (int i = 0; i < HEAD_DIM / 2; i++) {
        double theta = (double)delta * pow(10000.0, -2.0 * i / HEAD_DIM);
        cos_t[i] = (float)cos(theta);
        sin_t[i] = (float)sin(theta);
    }
    struct kv_layout l;
    kv_cache_layout(kv_seq_cache(s), &l);
    const int n = kv_seq_n_tokens(s);
    const int32_t *table = kv_seq_page_table(s);
    for (int j = 0; j < kv_seq_n_pages(s); j++) {
        int slots = n - j * PT < PT ? n - j * PT : PT;
        for (int layer = 0; layer < N_LAYER; layer++)
            for (int h = 0; h < N_KV_HEAD; h++)
                for (int slot = 0; slot < slots; slot++)
                    rotate_row(kv_layout_elem(&l, table[j], slot, layer, h, false), cos_t, sin_t);
    }
}

struct result {
    double step_ns, step_preserve_ns, shift_ns;
};

static struct result run(int retained)
{
    char err[256];
    size_t page_bytes = (size_t)2 * N_LAYER * N_KV_HEAD * PT * HEAD_DIM * 2;
    struct kv_cache_params p = {.memory_bytes = page_bytes * (size_t)(retained / PT + 8),
                                .page_tokens = PT,
                                .n_layer = N_LAYER,
                                .n_kv_head = N_KV_HEAD,
                                .head_dim = HEAD_DIM,
                                .k_type = KV_F16,
                                .v_type = KV_F16};
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        die("kv_cache_create", err);
    /* Budget: retained + one page; the window keeps all but the first
     * middle page, so each step frees exactly one page. */
    struct kv_policy pol = {.kind = KV_EVICT_SINK_WINDOW,
                            .max_cache_tokens = retained + PT,
                            .sink_tokens = SINKS,
                            .window_tokens = retained - 2 * PT,
                            .renumber = true};
    kv_seq *s = kv_seq_create(c, &pol, false, err, sizeof(err));
    if (!s)
        die("kv_seq_create", err);

    /* Fill to the budget with keys that look like keys. */
    int32_t ids[4096];
    uint32_t rng = 1;
    while (kv_seq_n_tokens(s) < retained + PT) {
        int n = retained + PT - kv_seq_n_tokens(s);
        if (n > 4096)
            n = 4096;
        for (int i = 0; i < n; i++)
            ids[i] = i;
        int first;
        if (kv_seq_append(s, ids, n, &first) != 0)
            die("fill", "append failed");
        for (int t = first; t < first + n; t++)
            for (int layer = 0; layer < N_LAYER; layer++)
                for (int h = 0; h < N_KV_HEAD; h++) {
                    _Float16 *k = kv_seq_k(s, layer, h, t);
                    for (int d = 0; d < HEAD_DIM; d++) {
                        rng = rng * 1664525u + 1013904223u;
                        k[d] = (_Float16)((float)(rng >> 16) / 32768.0f - 1.0f);
                    }
                }
    }

    /* Ours: one step from retained + PT down to retained, then refill the
     * page (not timed); median of many. Both position modes. */
    struct result r;
    enum { STEPS = 301 };
    static double t[STEPS];
    for (int mode = 0; mode < 2; mode++) {
        pol.renumber = mode == 0;
        kv_seq_set_policy(s, &pol);
        for (int i = 0; i < STEPS; i++) {
            double t0 = now();
            int ev = kv_seq_evict(s, PT);
            t[i] = now() - t0;
            if (ev != PT || kv_seq_n_tokens(s) != retained)
                die("eviction step", "evicted something other than one page");
            if (kv_seq_append(s, ids, PT, NULL) != 0)
                die("refill", "append failed");
        }
        double ns = median(t, STEPS) * 1e9;
        if (mode == 0)
            r.step_ns = ns;
        else
            r.step_preserve_ns = ns;
    }

    /* The baseline on the same cache, at the same retained count. */
    if (kv_seq_evict(s, PT) != PT)
        die("eviction step", "setup");
    double ts[5];
    for (int i = 0; i < 5; i++) {
        double t0 = now();
        context_shift(s, -PT);
        ts[i] = now() - t0;
    }
    r.shift_ns = median(ts, 5) * 1e9;
    kv_cache_destroy(c);
    return r;
}

int main(void)
{
    const int sizes[] = {4096, 32768, 131072};
    printf("eviction step vs context shift: %d layers x %d KV heads x %d dims, f16, "
           "%d-token pages, 1 thread\n",
           N_LAYER, N_KV_HEAD, HEAD_DIM, PT);
    printf("%9s | %13s %12s %13s | %13s %12s | %14s %14s\n", "retained", "ours ns/page",
           "ns/retained", "preserve ns", "shift ns", "ns/retained", "shift/ours", "shift/preserve");
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        struct result r = run(sizes[i]);
        printf("%9d | %13.0f %12.3f %13.0f | %13.0f %12.1f | %13.0fx %13.0fx\n", sizes[i],
               r.step_ns, r.step_ns / sizes[i], r.step_preserve_ns, r.shift_ns,
               r.shift_ns / sizes[i], r.shift_ns / r.step_ns, r.shift_ns / r.step_preserve_ns);
    }
    printf("(ours: one sink-window step freeing one %d-token page, renumber and preserve "
           "modes; shift: re-rotate every retained key in place, cos/sin precomputed)\n",
           PT);
    return 0;
}
