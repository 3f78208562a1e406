/*
 * attn_softcap.c - attention logit soft-capping (Gemma 2) inside the fused
 * kernel's tile loop.
 *
 * Gemma 2 squashes every attention score before the softmax:
 *
 *   s = cap * tanh(q.k * scale / cap)        (cap = attn_logit_softcapping, 50)
 *
 * then adds the position bias and the causal and window masks as any
 * model. The cap is a function of one score alone, so it fits the tile
 * loop exactly where the bias does: after a tile's scores are computed
 * (qk, qk_rope or the int8 path - every one of them ends in the same score
 * rows), before the online-softmax update. Nothing of size L x L is
 * written; the cap costs one tanh per visible score.
 *
 * How: a capped kernel runs the base table's operations (scalar or SIMD)
 * unchanged, except that the two that consume scores - softmax (the online
 * update) and probs (the attention-mass pass) - first cap the row in
 * place. The cap travels in the row's struct attn_bias (set once per row
 * by the planner), so the wrappers need no state of their own; a context
 * without a cap gets the base table itself, and pays nothing. The table's
 * name says which path runs ("avx2+softcap"), for the dispatch line.
 */
#include "attention_internal.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>

/* s[t] = cap * tanh(s[t] / cap) for the tile's nt scores; masked and padded
 * columns are left to the base operation (it overwrites them). */
static void cap_row(float *s, int nt, float cap)
{
    const float inv = 1.0f / cap;
    for (int t = 0; t < nt; t++)
        s[t] = cap * tanhf(s[t] * inv);
}

static void softmax_capped_scalar(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                                  const struct attn_bias *b, float *m, float *l, float *acc, int D)
{
    cap_row(s, nt, b->softcap);
    attn_scalar_ops.softmax(s, nt, kpos, pos_q, b, m, l, acc, D);
}

static void probs_capped_scalar(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                                const struct attn_bias *b, float m, float inv_l)
{
    cap_row(s, nt, b->softcap);
    attn_scalar_ops.probs(s, nt, kpos, pos_q, b, m, inv_l);
}

static void softmax_capped_simd(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                                const struct attn_bias *b, float *m, float *l, float *acc, int D)
{
    cap_row(s, nt, b->softcap);
    attn_simd_ops()->softmax(s, nt, kpos, pos_q, b, m, l, acc, D);
}

static void probs_capped_simd(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                              const struct attn_bias *b, float m, float inv_l)
{
    cap_row(s, nt, b->softcap);
    attn_simd_ops()->probs(s, nt, kpos, pos_q, b, m, inv_l);
}

/* The base table with its score consumers capped (built once per base). */
static struct attn_ops capped_scalar, capped_simd;
static char capped_simd_name[48];

static void build_tables(void)
{
    capped_scalar = attn_scalar_ops;
    capped_scalar.name = "scalar+softcap";
    capped_scalar.softmax = softmax_capped_scalar;
    capped_scalar.probs = probs_capped_scalar;
    const struct attn_ops *simd = attn_simd_ops();
    if (simd) {
        capped_simd = *simd;
        snprintf(capped_simd_name, sizeof(capped_simd_name), "%s+softcap", simd->name);
        capped_simd.name = capped_simd_name;
        capped_simd.softmax = softmax_capped_simd;
        capped_simd.probs = probs_capped_simd;
    }
}

const struct attn_ops *attn_softcap_ops(const struct attn_ops *base, float softcap)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (!(softcap > 0.0f))
        return base;
    /* Contexts may be created from several threads: build the tables once. */
    pthread_once(&once, build_tables);
    return base == &attn_scalar_ops ? &capped_scalar : &capped_simd;
}

const char *attn_path_name(float softcap)
{
    const struct attn_ops *simd = attn_simd_ops();
    return attn_softcap_ops(simd ? simd : &attn_scalar_ops, softcap)->name;
}
