/*
 * kernel_eq.h - the fixture of the equivalence tests at the kernel
 * (ARCHITECTURE.md, Invariant 3) that test_cache_invariants.c (the cache's
 * policies, forks) and test_policies.c (the scored policies, pins) share:
 * a one-layer cache whose K and V are a function of the token id alone,
 * the kernel's view of it, and the last query's attention over a sequence
 * by the fused kernel and by attn_reference. A sequence that evicted, read
 * at its renumbered positions, must attend exactly as a fresh sequence
 * holding only its survivors does.
 *
 * Include after <cmocka.h>. Unused helpers are fine (EQ_FN).
 */
#ifndef KVD_TESTS_KERNEL_EQ_H
#define KVD_TESTS_KERNEL_EQ_H

#include <math.h>
#include <stdint.h>

#include "attention/attention.h"
#include "cache/kv_cache.h"

#define EQ_FN static __attribute__((unused))

/* The shape: 4 query heads over 2 KV heads of 16 dims, pages of 4 tokens. */
enum { EQ_HEADS = 4, EQ_KV_HEADS = 2, EQ_DIM = 16, EQ_PT = 4 };

EQ_FN struct attn_params eq_params(void)
{
    return (struct attn_params){.n_head = EQ_HEADS,
                                .n_kv_head = EQ_KV_HEADS,
                                .head_dim = EQ_DIM,
                                .scale = 1.0f / 4.0f,
                                .n_threads = 1};
}

/* A value in [-1, 1] in steps of 1/1000 from the LCG state *r. */
EQ_FN float eq_unit(uint32_t *r)
{
    *r = *r * 1664525u + 1013904223u;
    return (float)((*r >> 8) % 2001) / 1000.0f - 1.0f;
}

/* Write K and V of token `id` at logical index idx of s (layer 0): a
 * function of the id alone, so two sequences holding one token hold the
 * same bytes. The key is reported to knorm as the forward reports it. */
EQ_FN void eq_write_token(kv_seq *s, int idx, int32_t id)
{
    for (int h = 0; h < EQ_KV_HEADS; h++) {
        float *k = kv_seq_k(s, 0, h, idx), *v = kv_seq_v(s, 0, h, idx);
        uint32_t r = (uint32_t)id * 2654435761u + (uint32_t)h * 40503u + 1u;
        for (int d = 0; d < EQ_DIM; d++) {
            k[d] = eq_unit(&r);
            v[d] = eq_unit(&r);
        }
        kv_seq_add_key_norm(s, idx, k, EQ_DIM);
    }
}

/* The kernel's view of layer 0 of c. */
EQ_FN struct attn_kv eq_attn_kv(kv_cache *c)
{
    struct kv_layout l;
    kv_cache_layout(c, &l);
    return (struct attn_kv){.base = l.base,
                            .page_bytes = l.page_bytes,
                            .k_offset = kv_layout_k_offset(&l, 0),
                            .v_offset = kv_layout_v_offset(&l, 0),
                            .page_tokens = l.page_tokens,
                            .k_type = (enum attn_type)l.k_type,
                            .v_type = (enum attn_type)l.v_type};
}

EQ_FN double eq_max_diff(const float *a, const float *b, int n)
{
    double m = 0;
    for (int i = 0; i < n; i++) {
        double d = fabs((double)a[i] - b[i]);
        if (d > m)
            m = d;
    }
    return m;
}

/* A reference a test brings of its own, called as attn_reference is. */
typedef void (*eq_ref_fn)(const struct attn_params *P, const struct attn_kv *kv,
                          const struct attn_seq *sq);

/*
 * The attention of query q (the last token's) over s at positions pos
 * (NULL: the sequence's own): by the fused kernel into out[0], by
 * attn_reference into out[1] and, when own is not NULL, by own into
 * out[2].
 */
EQ_FN void eq_attend_last(const struct attn_params *P, kv_cache *c, kv_seq *s, const int32_t *pos,
                          const float *q, eq_ref_fn own, float out[][EQ_HEADS * EQ_DIM])
{
    struct attn_kv kv = eq_attn_kv(c);
    int n = kv_seq_n_tokens(s);
    if (!pos)
        pos = kv_seq_positions(s);
    int32_t q_pos = pos[n - 1];
    struct attn_seq sq = {.page_table = kv_seq_page_table(s),
                          .pos = pos,
                          .n_kv = n,
                          .n_q = 1,
                          .q_pos = &q_pos,
                          .q = q,
                          .out = out[0]};
    char err[256];
    attn_ctx *ctx = attn_create(P, err, sizeof(err));
    if (!ctx)
        print_message("attn_create: %s\n", err);
    assert_non_null(ctx);
    assert_int_equal(attn_run(ctx, &kv, &sq, 1), 0);
    attn_destroy(ctx);
    sq.out = out[1];
    assert_int_equal(attn_reference(P, &kv, &sq, 1), 0);
    if (own) {
        sq.out = out[2];
        own(P, &kv, &sq);
    }
}

#endif /* KVD_TESTS_KERNEL_EQ_H */
