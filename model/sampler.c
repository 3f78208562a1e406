/*
 * sampler.c - choosing the next token from logits.
 *
 * The chain follows llama.cpp's server order so that the same request
 * parameters behave as users expect there: penalties over the recent
 * history (repeat, presence, frequency), then greedy if temperature is 0,
 * else temperature scaling, top-k, softmax, top-p, min-p, and a draw from a
 * seeded generator. Everything the chain needs is allocated once per
 * sampler, so sampling a token allocates nothing.
 *
 * Determinism: the generator is splitmix64 seeded from the request's seed,
 * advanced exactly once per sampled token, so a request gives the same
 * text whether it runs alone or batched with others.
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

struct cand {
    int32_t id;
    float logit; /* scaled logit, then probability after softmax */
};

struct model_sampler {
    struct model_sampling s;
    int n_vocab;
    uint64_t rng;
    struct cand *cands; /* [n_vocab] working set */
    int32_t *counts;    /* [n_vocab] occurrences in the penalty window; zero between calls */
};

void model_sampling_defaults(struct model_sampling *s)
{
    *s = (struct model_sampling){
        .temperature = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repeat_penalty = 1.0f,
        .presence_penalty = 0.0f,
        .frequency_penalty = 0.0f,
        .penalty_last_n = 64,
        .seed = 0,
    };
}

model_sampler *model_sampler_create(const struct model_sampling *s, int n_vocab)
{
    if (n_vocab < 1)
        return NULL;
    model_sampler *smp = calloc(1, sizeof(*smp));
    if (!smp)
        return NULL;
    smp->s = *s;
    smp->n_vocab = n_vocab;
    smp->rng = s->seed;
    smp->cands = malloc(sizeof(*smp->cands) * (size_t)n_vocab);
    smp->counts = calloc((size_t)n_vocab, sizeof(*smp->counts));
    if (!smp->cands || !smp->counts) {
        model_sampler_destroy(smp);
        return NULL;
    }
    return smp;
}

void model_sampler_destroy(model_sampler *smp)
{
    if (!smp)
        return;
    free(smp->cands);
    free(smp->counts);
    free(smp);
}

/* splitmix64: tiny, fast, and good enough to draw one token. */
static uint64_t next_u64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 24 bits, exact in float. */
static float next_uniform(uint64_t *state)
{
    return (float)(next_u64(state) >> 40) * (1.0f / 16777216.0f);
}

/*
 * Penalties look at the last penalty_last_n history tokens. Counts are
 * accumulated into a zeroed array and cleared again afterwards, so the
 * cost is O(window), not O(vocab).
 */
static void apply_penalties(model_sampler *smp, float *logits, const int32_t *history, int n)
{
    const struct model_sampling *s = &smp->s;
    bool any = s->repeat_penalty != 1.0f || s->presence_penalty != 0.0f ||
               s->frequency_penalty != 0.0f;
    if (!any || !history || n <= 0 || s->penalty_last_n == 0)
        return;
    int window = s->penalty_last_n < 0 || s->penalty_last_n > n ? n : s->penalty_last_n;
    const int32_t *h = history + (n - window);
    for (int i = 0; i < window; i++)
        if (h[i] >= 0 && h[i] < smp->n_vocab)
            smp->counts[h[i]]++;
    for (int i = 0; i < window; i++) {
        int32_t t = h[i];
        if (t < 0 || t >= smp->n_vocab || smp->counts[t] == 0)
            continue; /* out of range, or already penalised */
        float c = (float)smp->counts[t];
        if (s->repeat_penalty != 1.0f)
            logits[t] = logits[t] > 0 ? logits[t] / s->repeat_penalty
                                      : logits[t] * s->repeat_penalty;
        logits[t] -= c * s->frequency_penalty + s->presence_penalty;
        smp->counts[t] = 0;
    }
}

static int32_t argmax(const float *logits, int n)
{
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (logits[i] > logits[best])
            best = i;
    return best;
}

static int cmp_desc(const void *a, const void *b)
{
    const struct cand *x = a, *y = b;
    if (x->logit != y->logit)
        return x->logit < y->logit ? 1 : -1;
    return x->id < y->id ? -1 : (x->id > y->id); /* stable order for equal logits */
}

/* Whether candidate a comes after b in cmp_desc's order (a worse). */
static bool worse(struct cand a, struct cand b)
{
    return a.logit != b.logit ? a.logit < b.logit : a.id > b.id;
}

/* Restore the heap below slot i of h[0..k): every parent no better than
 * its children, so h[0] is the worst kept. */
static void sift_down(struct cand *h, int k, int i)
{
    for (;;) {
        int l = 2 * i + 1, r = l + 1, w = i;
        if (l < k && worse(h[l], h[w]))
            w = l;
        if (r < k && worse(h[r], h[w]))
            w = r;
        if (w == i)
            return;
        struct cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/*
 * The k best of logits[0..nv) / temp in cmp_desc's order (by scaled logit,
 * ties to the lower id) into c[0..k), unordered: a heap of the k best so
 * far with the worst on top. One pass that mostly compares a raw logit
 * with the worst kept one's, where scaling every logit and partitioning
 * them (quickselect) cost ~6% of a decoding step over a 49k vocabulary.
 * The set is the same: ids come in increasing order, so a newcomer beats
 * the worst kept only with a strictly larger scaled logit; and dividing by
 * temp > 0 is monotonic (a <= b gives a / temp <= b / temp), so a raw
 * logit no larger than the worst kept one's cannot get in.
 */
static void select_top(struct cand *c, const float *logits, int nv, int k, float temp)
{
    for (int i = 0; i < k; i++)
        c[i] = (struct cand){.id = i, .logit = logits[i] / temp};
    for (int i = k / 2 - 1; i >= 0; i--)
        sift_down(c, k, i);
    float floor_raw = logits[c[0].id];
    for (int i = k; i < nv; i++) {
        if (!(logits[i] > floor_raw))
            continue;
        float v = logits[i] / temp;
        if (v > c[0].logit) {
            c[0] = (struct cand){.id = i, .logit = v};
            sift_down(c, k, 0);
            floor_raw = logits[c[0].id];
        }
    }
}

/* Softmax over c[0..n) in place (c sorted descending, so c[0] is the max). */
static void softmax_sorted(struct cand *c, int n)
{
    float max = c[0].logit, sum = 0.0f;
    for (int i = 0; i < n; i++) {
        c[i].logit = expf(c[i].logit - max);
        sum += c[i].logit;
    }
    for (int i = 0; i < n; i++)
        c[i].logit /= sum;
}

/* Keep the smallest prefix whose mass reaches top_p, and the tokens with
 * at least min_p times the top probability; returns the new count. */
static int truncate_probs(const struct model_sampling *s, struct cand *c, int n)
{
    if (s->top_p < 1.0f) {
        float cum = 0.0f;
        for (int i = 0; i < n; i++) {
            cum += c[i].logit;
            if (cum >= s->top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (s->min_p > 0.0f) {
        float floor_p = s->min_p * c[0].logit;
        int keep = 1;
        while (keep < n && c[keep].logit >= floor_p)
            keep++;
        n = keep;
    }
    return n;
}

int32_t model_sample(model_sampler *smp, float *logits, const int32_t *history, int n_history)
{
    const struct model_sampling *s = &smp->s;
    int nv = smp->n_vocab;
    apply_penalties(smp, logits, history, n_history);
    if (s->temperature <= 0.0f)
        return argmax(logits, nv);

    struct cand *c = smp->cands;
    int n = nv;
    if (s->top_k > 0 && s->top_k < n) {
        n = s->top_k;
        select_top(c, logits, nv, n, s->temperature);
    } else {
        for (int i = 0; i < nv; i++)
            c[i] = (struct cand){.id = i, .logit = logits[i] / s->temperature};
    }
    qsort(c, (size_t)n, sizeof(*c), cmp_desc);
    softmax_sorted(c, n);
    n = truncate_probs(s, c, n);

    float total = 0.0f;
    for (int i = 0; i < n; i++)
        total += c[i].logit;
    float r = next_uniform(&smp->rng) * total;
    for (int i = 0; i < n; i++) {
        r -= c[i].logit;
        if (r < 0.0f)
            return c[i].id;
    }
    return c[n - 1].id; /* rounding left a sliver of mass: take the last kept */
}
