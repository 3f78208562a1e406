/*
 * test_sampler.c - the sampling chain: greedy, temperature, top-k, top-p,
 * min-p, penalties, and determinism for a seed.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_seed_determinism),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_top_k_top_p_min_p),
        cmocka_unit_test(test_penalties),
    };
    return cmocka_run_group_tests_name("sampler", tests, NULL, NULL);
}
