/*
 * evict_scored.c - the scores that rank a sequence's middle tokens under
 * the scored policies (h2o, tova, knorm, snapkv), and where they come from.
 *
 * ---------------------------------------------------------------------------
 * One shape, one step, four scores
 * ---------------------------------------------------------------------------
 *
 * Every scored policy keeps [sinks | heavy_tokens middle tokens | window]
 * and evicts exactly as h2o does (evict.c): when the budget is exceeded, one
 * step keeps the heavy_tokens middle tokens of the highest score (ties to
 * the more recent token, NaN last), compacts the survivors and frees the
 * pages past the end. The floor, the plan, the compaction, the accounting
 * and the equivalence with a fresh cache of the survivors are therefore
 * h2o's, proved once. What differs is one float per retained token, the
 * score (kv_seq_mass), and who writes it:
 *
 *   h2o     attention mass summed over every query that ever saw the token;
 *   tova    attention mass from the latest query alone;
 *   knorm   minus the L2 norm of the token's key (or plus: knorm_smallest);
 *   snapkv  attention mass from the last observe_tokens queries of the
 *           latest prompt chunk, max-pooled over pool_tokens neighbours.
 *
 * A reload that changes the policy keeps the scores (the next observation
 * of tova or snapkv replaces them, h2o adds to them), except that moving to
 * or from knorm resets them: a norm and a mass do not compare.
 *
 * The token set is shared by every layer and KV head, so every score is
 * summed (mass) or averaged (norm) over layers and heads. A page holds all
 * layers and KV heads of its tokens (kv_cache.h), so a token a single head
 * gave up would free nothing until every head gave it up; per-head sets
 * are a different page layout, discussed where the policies are measured.
 *
 * ---------------------------------------------------------------------------
 * tova: the latest query decides
 * ---------------------------------------------------------------------------
 *
 * H2O's accumulated mass favours old tokens: a token that has been in the
 * cache for a thousand steps has collected a thousand queries' worth of
 * attention, a recent one a handful, whatever they say now. TOVA (Oren et
 * al., "Transformers are Multi-State RNNs") ranks by the attention of the
 * latest query only, averaged over heads: what the model looks at now is
 * what it keeps. At the start of every forward call the score is forgotten
 * (kv_seq_mass_queries) and the kernel reports the mass of the call's last
 * query alone (the forward hands that query to the kernel as a sequence of
 * its own, so the mass pass reads the keys once per layer for one query);
 * the call's layers add up the new score. An eviction step, which runs
 * before the next append, ranks by the step just taken: during decode the
 * last generated token's query, during a chunked prefill the chunk's last
 * query. Cost: one extra pass over the keys (scores only, no V) per layer
 * and step, and the O(retained log retained) ranking per eviction step.
 *
 * ---------------------------------------------------------------------------
 * knorm: the key's norm, once, at append
 * ---------------------------------------------------------------------------
 *
 * Devoto et al. ("A Simple and Effective L2 Norm-Based Strategy for KV
 * Cache Compression") found a key's L2 norm anti-correlated with the
 * attention it later draws: keys of small norm are the ones queries align
 * with (sinks among them), large-norm keys are mostly ignored. So knorm
 * evicts the largest norms: the score is minus the norm, averaged over
 * layers and KV heads. knorm_smallest flips the sign, for an operator who
 * wants to measure the other end on their own text (one branch, no cost).
 * The forward reports each new key as it writes it (kv_seq_add_key_norm),
 * unrotated and before any K quantisation: RoPE is a rotation and ALiBi
 * and T5 leave keys alone, so the norm of the stored key is the norm the
 * kernel sees, computed once and never again. It is the only scored
 * policy that needs no attention mass, so the kernel runs no mass pass
 * and the last layer of a prefill chunk stays compacted to the logits row.
 *
 * ---------------------------------------------------------------------------
 * snapkv: the end of the prompt decides, decoding slides
 * ---------------------------------------------------------------------------
 *
 * SnapKV (Li et al.) observes that what a prompt's last queries (the
 * question after a long document) attend to predicts what generation will
 * need, and compresses the prompt once, at the end of the prefill, by that
 * observation, pooled so that a selected token brings its neighbours (a
 * fact is a phrase, not a token). kvd cannot hold a prompt longer than the
 * budget at once - the prefill arrives in chunks bounded by
 * kv_seq_max_append and evicts between them - so every multi-token forward
 * call is an observation: it forgets the old scores and the kernel reports
 * the mass of the call's last min(observe_tokens, n_q) queries, and the
 * eviction before the next chunk ranks the middle by it, max-pooled over
 * pool_tokens neighbours in the text (kv_evict_score; a token across an
 * evicted gap is no neighbour). The last chunk's observation is
 * the end of the prompt, and it stays in force while decoding: single-token
 * calls observe nothing, so tokens appended while decoding keep score 0;
 * once past the window they lose to every observed prompt token, and among
 * themselves (ties go to the later token) leave oldest first - sink-window
 * over the answer, the prompt's selection fixed. When a later request
 * appends to the session, its prompt chunks observe again: the previous
 * selection, the previous answer and the new prompt are all rescored by the
 * new prompt's last queries, and the next eviction reselects among them.
 * A prompt chunk of one token counts as decoding. The selection is shared
 * by all KV heads (SnapKV selects per head; see above). Cost: the mass
 * pass over observe_tokens queries per prefill chunk, none while decoding,
 * and O(middle x pool_tokens) pooling per eviction step.
 */
#include "cache_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool kv_policy_scored(enum kv_policy_kind kind)
{
    return kind == KV_EVICT_H2O || kind == KV_EVICT_TOVA || kind == KV_EVICT_KNORM ||
           kind == KV_EVICT_SNAPKV;
}

/* Forget every retained token's score (the policies that score the latest
 * queries alone). */
static void forget_scores(kv_seq *s)
{
    if (s->n_tokens > 0)
        memset(s->mass + s->t_off, 0, sizeof(float) * (size_t)s->n_tokens);
}

int kv_seq_mass_queries(kv_seq *s, int n_q)
{
    if (n_q < 1)
        return 0;
    switch (s->policy.kind) {
    case KV_EVICT_H2O:
        return n_q;
    case KV_EVICT_TOVA:
        forget_scores(s);
        return 1;
    case KV_EVICT_SNAPKV:
        if (n_q < 2)
            return 0; /* decoding: the prompt's observation stays */
        forget_scores(s);
        return n_q < s->policy.observe_tokens ? n_q : s->policy.observe_tokens;
    default:
        return 0;
    }
}

void kv_seq_add_mass(kv_seq *s, const float *mass)
{
    if (s->n_tokens == 0)
        return;
    float *acc = s->mass + s->t_off;
    for (int i = 0; i < s->n_tokens; i++)
        acc[i] += mass[i];
}

bool kv_seq_wants_key_norms(const kv_seq *s)
{
    return s->policy.kind == KV_EVICT_KNORM;
}

void kv_seq_add_key_norm(kv_seq *s, int idx, const float *k, int head_dim)
{
    if (s->policy.kind != KV_EVICT_KNORM || idx < 0 || idx >= s->n_tokens)
        return;
    double ss = 0;
    for (int d = 0; d < head_dim; d++)
        ss += (double)k[d] * k[d];
    const struct kv_layout *l = &s->cache->layout;
    double norm = sqrt(ss) / ((double)l->n_layer * l->n_kv_head);
    s->mass[s->t_off + idx] += (float)(s->policy.knorm_smallest ? norm : -norm);
}

float kv_evict_score(const kv_seq *s, int i, int lo, int hi)
{
    const float *score = s->mass + s->t_off;
    if (s->policy.kind != KV_EVICT_SNAPKV || s->policy.pool_tokens <= 1)
        return score[i];
    /* Max-pool over the retained middle tokens within r of i in the text
     * (history index): a token on the far side of an evicted gap is no
     * neighbour, however close its logical slot. */
    const int32_t *hidx = s->hidx + s->t_off;
    int r = s->policy.pool_tokens / 2;
    int a = i - r > lo ? i - r : lo, b = i + r < hi - 1 ? i + r : hi - 1;
    float best = score[i];
    for (int j = a; j <= b; j++)
        if (score[j] > best && abs(hidx[j] - hidx[i]) <= r)
            best = score[j];
    return best;
}
