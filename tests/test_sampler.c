/*
 * test_sampler.c - the sampling chain: greedy, temperature, top-k, top-p,
 * min-p, penalties, and determinism for a seed; top-k with ties against
 * the plain chain (everything sorted).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "model/model.h"

#define NV 50

static void ramp(float *logits)
{
    /* token i has logit i/10: token 49 is the most likely */
    for (int i = 0; i < NV; i++)
        logits[i] = (float)i / 10.0f;
}

static int32_t sample_once(const struct model_sampling *s, const int32_t *hist, int nh)
{
    float logits[NV];
    ramp(logits);
    model_sampler *smp = model_sampler_create(s, NV);
    assert_non_null(smp);
    int32_t t = model_sample(smp, logits, hist, nh);
    model_sampler_destroy(smp);
    return t;
}

static void test_greedy(void **state)
{
    (void)state;
    struct model_sampling s;
    model_sampling_defaults(&s);
    s.temperature = 0;
    assert_int_equal(sample_once(&s, NULL, 0), NV - 1);
    /* top_k = 1 at any temperature is greedy too */
    s.temperature = 5.0f;
    s.top_k = 1;
    for (uint64_t seed = 0; seed < 20; seed++) {
        s.seed = seed;
        assert_int_equal(sample_once(&s, NULL, 0), NV - 1);
    }
}

static void test_seed_determinism(void **state)
{
    (void)state;
    struct model_sampling s;
    model_sampling_defaults(&s);
    s.temperature = 1.5f;
    s.top_k = 0;
    s.top_p = 1.0f;
    s.min_p = 0.0f;
    int32_t a[64], b[64], c[64];
    for (int run = 0; run < 3; run++) {
        s.seed = run == 2 ? 7 : 1234;
        model_sampler *smp = model_sampler_create(&s, NV);
        for (int i = 0; i < 64; i++) {
            float logits[NV];
            ramp(logits);
            int32_t t = model_sample(smp, logits, NULL, 0);
            (run == 0 ? a : run == 1 ? b : c)[i] = t;
        }
        model_sampler_destroy(smp);
    }
    assert_memory_equal(a, b, sizeof(a));
    assert_memory_not_equal(a, c, sizeof(a)); /* another seed, another text */
}

/* Sampled frequencies follow softmax(logits / T) over many draws. */
static void test_distribution(void **state)
{
    (void)state;
    struct model_sampling s;
    model_sampling_defaults(&s);
    s.temperature = 0.5f;
    s.top_k = 0;
    s.top_p = 1.0f;
    s.min_p = 0.0f;
    s.seed = 99;
    int hits[NV] = {0};
    const int draws = 20000;
    model_sampler *smp = model_sampler_create(&s, NV);
    for (int i = 0; i < draws; i++) {
        float logits[NV];
        ramp(logits);
        hits[model_sample(smp, logits, NULL, 0)]++;
    }
    model_sampler_destroy(smp);
    double z = 0;
    for (int i = 0; i < NV; i++)
        z += exp(((double)i / 10.0) / 0.5);
    for (int i = NV - 5; i < NV; i++) {
        double p = exp(((double)i / 10.0) / 0.5) / z;
        assert_float_equal((double)hits[i] / draws, p, 0.02);
    }
}

static void test_top_k_top_p_min_p(void **state)
{
    (void)state;
    struct model_sampling s;
    model_sampling_defaults(&s);
    s.temperature = 3.0f;
    s.top_p = 1.0f;
    s.min_p = 0.0f;
    s.top_k = 3;
    for (uint64_t seed = 0; seed < 200; seed++) {
        s.seed = seed;
        assert_true(sample_once(&s, NULL, 0) >= NV - 3);
    }
    /* top_p tiny: only the most likely token survives */
    s.top_k = 0;
    s.top_p = 0.01f;
    for (uint64_t seed = 0; seed < 50; seed++) {
        s.seed = seed;
        assert_int_equal(sample_once(&s, NULL, 0), NV - 1);
    }
    /* min_p 0.9 at temperature 1: logits step 0.1, so only tokens within
     * ln(1/0.9) = 0.105 of the top (the top two) survive */
    s.temperature = 1.0f;
    s.top_p = 1.0f;
    s.min_p = 0.9f;
    int seen[NV] = {0};
    for (uint64_t seed = 0; seed < 300; seed++) {
        s.seed = seed;
        seen[sample_once(&s, NULL, 0)]++;
    }
    assert_true(seen[NV - 1] > 0 && seen[NV - 2] > 0);
    for (int i = 0; i < NV - 2; i++)
        assert_int_equal(seen[i], 0);
}

static void test_penalties(void **state)
{
    (void)state;
    struct model_sampling s;
    model_sampling_defaults(&s);
    s.temperature = 0;
    int32_t hist[] = {49, 49, 48};
    /* presence: the two top tokens lose 1.0 each; 47 wins */
    s.presence_penalty = 1.0f;
    assert_int_equal(sample_once(&s, hist, 3), 47);
    /* frequency: 49 seen twice loses 0.4, 48 loses 0.2: 47 (4.7) beats 48 (4.6) */
    s.presence_penalty = 0;
    s.frequency_penalty = 0.2f;
    assert_int_equal(sample_once(&s, hist, 3), 47);
    /* repeat: positive logits divided by 1.5 */
    s.frequency_penalty = 0;
    s.repeat_penalty = 1.5f;
    assert_int_equal(sample_once(&s, hist, 3), 47);
    /* window of 1: only 48 is penalised, 49 stays best */
    s.penalty_last_n = 1;
    assert_int_equal(sample_once(&s, hist, 3), 49);
    /* penalties off: greedy */
    s.repeat_penalty = 1.0f;
    assert_int_equal(sample_once(&s, hist, 3), 49);
}

/* ------------------------------------------------------------------------
 * The chain written out the plain way (every logit scaled, all sorted,
 * the first top_k kept), to check the sampler's one-pass top-k against.
 * ------------------------------------------------------------------------ */

struct ref_cand {
    int32_t id;
    float p;
};

static int ref_cmp(const void *a, const void *b)
{
    const struct ref_cand *x = a, *y = b;
    if (x->p != y->p)
        return x->p < y->p ? 1 : -1;
    return x->id < y->id ? -1 : (x->id > y->id);
}

static uint64_t ref_next(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static int32_t ref_sample(const struct model_sampling *s, const float *logits, int nv,
                          uint64_t *rng)
{
    static struct ref_cand c[4096];
    for (int i = 0; i < nv; i++)
        c[i] = (struct ref_cand){i, logits[i] / s->temperature};
    qsort(c, (size_t)nv, sizeof(*c), ref_cmp);
    int n = s->top_k > 0 && s->top_k < nv ? s->top_k : nv;
    float max = c[0].p, sum = 0.0f;
    for (int i = 0; i < n; i++) {
        c[i].p = expf(c[i].p - max);
        sum += c[i].p;
    }
    for (int i = 0; i < n; i++)
        c[i].p /= sum;
    if (s->top_p < 1.0f) {
        float cum = 0.0f;
        for (int i = 0; i < n; i++) {
            cum += c[i].p;
            if (cum >= s->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (s->min_p > 0.0f) {
        int keep = 1;
        while (keep < n && c[keep].p >= s->min_p * c[0].p)
            keep++;
        n = keep;
    }
    float total = 0.0f;
    for (int i = 0; i < n; i++)
        total += c[i].p;
    float r = (float)(ref_next(rng) >> 40) * (1.0f / 16777216.0f) * total;
    for (int i = 0; i < n; i++) {
        r -= c[i].p;
        if (r < 0.0f)
            return c[i].id;
    }
    return c[n - 1].id;
}

/* Top-k over logits full of ties, exact ones (few distinct values) and
 * ones made by the temperature (neighbouring floats that divide to the
 * same value), with k cutting through a run of equals: the same token as
 * the plain chain, draw after draw. A top-k that broke ties to the higher
 * id, or kept the wrong one of two logits equal after scaling, differs. */
static void test_top_k_ties_as_full_sort(void **state)
{
    (void)state;
    enum { V = 3000 };
    static float logits[V];
    const int ks[] = {1, 2, 3, 7, 40, 41, 100, V - 1};
    const float temps[] = {0.7f, 1.0f, 3.0f};
    uint64_t gen = 42;
    for (int trial = 0; trial < 60; trial++) {
        for (int i = 0; i < V; i++) {
            uint64_t u = ref_next(&gen);
            logits[i] = trial % 2 ? (float)(u % 9) / 4.0f /* exact ties */
                                  : nextafterf(2.0f, 3.0f) + (float)(u % 7) * 2.4e-7f; /* near */
        }
        for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
            struct model_sampling s;
            model_sampling_defaults(&s);
            s.top_k = ks[ki];
            s.top_p = trial % 3 ? 1.0f : 0.9f;
            s.min_p = trial % 5 ? 0.0f : 0.05f;
            s.temperature = temps[trial % 3];
            s.seed = (uint64_t)trial * 977 + ki;
            model_sampler *smp = model_sampler_create(&s, V);
            assert_non_null(smp);
            uint64_t rng = s.seed;
            for (int d = 0; d < 8; d++) {
                float work[V];
                memcpy(work, logits, sizeof(work));
                assert_int_equal(model_sample(smp, work, NULL, 0), ref_sample(&s, logits, V, &rng));
            }
            model_sampler_destroy(smp);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_seed_determinism),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_top_k_top_p_min_p),
        cmocka_unit_test(test_penalties),
        cmocka_unit_test(test_top_k_ties_as_full_sort),
    };
    return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
