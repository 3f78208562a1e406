/*
 * cache_model.h - what the KV cache's test programs (test_cache.c,
 * test_cache_invariants.c) share: deterministic token contents and their
 * checks, cache and policy constructors, and the model of a sequence, the
 * policies restated the slow, obvious way, against which the stress and
 * equivalence tests compare the real cache.
 *
 * Include after <cmocka.h>; white-box (cache_internal.h). The functions
 * are static and may go unused in one of the programs.
 */
#ifndef KVD_TESTS_CACHE_MODEL_H
#define KVD_TESTS_CACHE_MODEL_H

#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "attention/attention.h"
#include "cache/cache_internal.h"
#include "cache/kv_cache.h"

#define CM_FN static __attribute__((unused))

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

CM_FN uint32_t rng_next(uint32_t *s)
{
    uint32_t x = *s;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return *s = x;
}

CM_FN uint32_t mix(uint32_t a, uint32_t b)
{
    uint32_t h = a * 0x9e3779b1u ^ (b + 0x7f4a7c15u + (a << 6) + (a >> 2));
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    return h ^ (h >> 16);
}

/* The byte pattern of one token's row: a function of seed, layer, head, K/V. */
CM_FN uint8_t row_byte(uint32_t seed, int layer, int head, int v, size_t b)
{
    return (uint8_t)(mix(mix(seed, (uint32_t)(layer * 131 + head * 7 + v)), (uint32_t)b) >> 24);
}

/* Bytes of a K (v = 0) or V (v = 1) row. */
CM_FN size_t row_len(const struct kv_layout *l, int v)
{
    return v ? l->v_row_bytes : l->k_row_bytes;
}

CM_FN void fill_token(kv_seq *s, const struct kv_layout *l, int idx, uint32_t seed)
{
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int h = 0; h < l->n_kv_head; h++)
            for (int v = 0; v < 2; v++) {
                uint8_t *row = v ? kv_seq_v(s, layer, h, idx) : kv_seq_k(s, layer, h, idx);
                for (size_t b = 0; b < row_len(l, v); b++)
                    row[b] = row_byte(seed, layer, h, v, b);
            }
}

/* Whether token idx still holds exactly the bytes fill_token wrote. */
CM_FN bool token_intact(kv_seq *s, const struct kv_layout *l, int idx, uint32_t seed)
{
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int h = 0; h < l->n_kv_head; h++)
            for (int v = 0; v < 2; v++) {
                const uint8_t *row = v ? kv_seq_v(s, layer, h, idx) : kv_seq_k(s, layer, h, idx);
                for (size_t b = 0; b < row_len(l, v); b++)
                    if (row[b] != row_byte(seed, layer, h, v, b))
                        return false;
            }
    return true;
}

/* FNV-1a over every K and V byte of one token. */
CM_FN uint64_t token_checksum(kv_seq *s, const struct kv_layout *l, int idx)
{
    uint64_t h = 1469598103934665603ull;
    for (int layer = 0; layer < l->n_layer; layer++)
        for (int hd = 0; hd < l->n_kv_head; hd++)
            for (int v = 0; v < 2; v++) {
                const uint8_t *row = v ? kv_seq_v(s, layer, hd, idx) : kv_seq_k(s, layer, hd, idx);
                for (size_t b = 0; b < row_len(l, v); b++)
                    h = (h ^ row[b]) * 1099511628211ull;
            }
    return h;
}

CM_FN kv_cache *make_cache2(size_t mem, int pt, int n_layer, int n_kv_head, int head_dim,
                            enum kv_type k_type, enum kv_type v_type)
{
    struct kv_cache_params p = {.memory_bytes = mem,
                                .page_tokens = pt,
                                .n_layer = n_layer,
                                .n_kv_head = n_kv_head,
                                .head_dim = head_dim,
                                .k_type = k_type,
                                .v_type = v_type};
    char err[256];
    kv_cache *c = kv_cache_create(&p, err, sizeof(err));
    if (!c)
        print_message("kv_cache_create: %s\n", err);
    assert_non_null(c);
    return c;
}

CM_FN kv_cache *make_cache(size_t mem, int pt, int n_layer, int n_kv_head, int head_dim,
                           enum kv_type type)
{
    return make_cache2(mem, pt, n_layer, n_kv_head, head_dim, type, type);
}

CM_FN kv_seq *make_seq(kv_cache *c, struct kv_policy pol, bool session)
{
    char err[256];
    kv_seq *s = kv_seq_create(c, &pol, session, err, sizeof(err));
    if (!s)
        print_message("kv_seq_create: %s\n", err);
    assert_non_null(s);
    return s;
}

CM_FN void assert_cache_ok(const kv_cache *c)
{
    char err[256];
    int rc = kv_cache_check(c, err, sizeof(err));
    if (rc != 0)
        print_message("kv_cache_check: %s\n", err);
    assert_int_equal(rc, 0);
}

CM_FN struct kv_policy sink_window(int max, int sink, int window, bool renumber)
{
    return (struct kv_policy){.kind = KV_EVICT_SINK_WINDOW,
                              .max_cache_tokens = max,
                              .sink_tokens = sink,
                              .window_tokens = window,
                              .renumber = renumber};
}

CM_FN struct kv_policy h2o(int max, int sink, int window, int heavy, bool renumber)
{
    return (struct kv_policy){.kind = KV_EVICT_H2O,
                              .max_cache_tokens = max,
                              .sink_tokens = sink,
                              .window_tokens = window,
                              .heavy_tokens = heavy,
                              .renumber = renumber};
}

CM_FN struct kv_policy none_policy(int max)
{
    return (struct kv_policy){.kind = KV_EVICT_NONE, .max_cache_tokens = max, .renumber = true};
}

/* ------------------------------------------------------------------------
 * The model: what a sequence must hold, stated the slow, obvious way
 * ------------------------------------------------------------------------ */

struct mtok {
    int32_t id, pos, hidx;
    float mass;
    uint32_t seed; /* content written for this token */
};

struct mseq {
    kv_seq *seq; /* NULL: slot unused */
    int order;   /* creation order (LRU tie-break: older first) */
    struct kv_policy pol;
    bool session, pinned, dropped;
    uint64_t last_use;
    struct mtok *t;
    int n, cap;
    int32_t *hist;
    int n_hist, hcap; /* n_hist: tokens appended since creation/drop/truncate */
    int32_t next_pos;
    int32_t *pg; /* shared-page worlds: the model's page ids of its pages */
    int pg_cap;
};

CM_FN void mseq_reserve(struct mseq *m, int n_tok, int n_hist)
{
    if (n_tok > m->cap) {
        m->cap = n_tok * 2 + 16;
        m->t = realloc(m->t, sizeof(*m->t) * (size_t)m->cap);
        assert_non_null(m->t);
    }
    if (n_hist > m->hcap) {
        m->hcap = n_hist * 2 + 16;
        m->hist = realloc(m->hist, sizeof(*m->hist) * (size_t)m->hcap);
        assert_non_null(m->hist);
    }
}

CM_FN void mseq_free(struct mseq *m)
{
    free(m->t);
    free(m->hist);
    free(m->pg);
    memset(m, 0, sizeof(*m));
}

CM_FN int m_pages(int n, int pt)
{
    return (n + pt - 1) / pt;
}

/* sink-window: count whole pages after the sinks that end before the window. */
CM_FN int m_evictable_pages(const struct mseq *m, int pt)
{
    int sp = (m->pol.sink_tokens + pt - 1) / pt, count = 0;
    for (int j = sp; (j + 1) * pt <= m->n - m->pol.window_tokens; j++)
        count++;
    return count;
}

CM_FN int m_floor(const struct mseq *m, int pt)
{
    switch (m->pol.kind) {
    case KV_EVICT_SINK_WINDOW:
        return m->n - m_evictable_pages(m, pt) * pt;
    case KV_EVICT_H2O: {
        int k = m->pol.sink_tokens + m->pol.window_tokens + m->pol.heavy_tokens;
        return k < m->n ? k : m->n;
    }
    default:
        return m->n;
    }
}

/* Tokens left after the policy makes `target` or fewer remain; -1 if it can't. */
CM_FN int m_plan(const struct mseq *m, int target, int pt)
{
    if (m->n <= target)
        return m->n;
    if (target < 0 || m_floor(m, pt) > target)
        return -1;
    if (m->pol.kind == KV_EVICT_SINK_WINDOW) {
        int keep = m->n;
        while (keep > target)
            keep -= pt; /* one whole page at a time */
        return keep;
    }
    return m_floor(m, pt);
}

/* Whether token a outranks token b for h2o (more mass, or later on a tie). */
CM_FN bool m_outranks(const struct mtok *t, int a, int b)
{
    if (t[a].mass != t[b].mass)
        return t[a].mass > t[b].mass;
    return a > b;
}

CM_FN void m_renumber(struct mseq *m)
{
    for (int i = 0; i < m->n; i++)
        m->t[i].pos = i;
    m->next_pos = m->n;
}

/* Evict down to `keep` tokens, as the policy says. Returns tokens evicted. */
CM_FN int m_evict(struct mseq *m, int keep, int pt)
{
    int before = m->n;
    if (keep >= before)
        return 0;
    if (m->pol.kind == KV_EVICT_SINK_WINDOW) {
        int lo = (m->pol.sink_tokens + pt - 1) / pt * pt, gap = before - keep;
        memmove(m->t + lo, m->t + lo + gap, sizeof(*m->t) * (size_t)(before - lo - gap));
    } else {
        int sinks = m->pol.sink_tokens < before ? m->pol.sink_tokens : before;
        int window = m->pol.window_tokens < before - sinks ? m->pol.window_tokens : before - sinks;
        int heavy = keep - sinks - window;
        bool *kp = calloc((size_t)before, 1);
        for (int i = 0; i < sinks; i++)
            kp[i] = true;
        for (int i = before - window; i < before; i++)
            kp[i] = true;
        for (int r = 0; r < heavy; r++) { /* pick the best not yet picked, H times */
            int best = -1;
            for (int i = sinks; i < before - window; i++)
                if (!kp[i] && (best < 0 || m_outranks(m->t, i, best)))
                    best = i;
            kp[best] = true;
        }
        int d = 0;
        for (int i = 0; i < before; i++)
            if (kp[i])
                m->t[d++] = m->t[i];
        free(kp);
    }
    m->n = keep;
    if (m->pol.renumber)
        m_renumber(m);
    return before - keep;
}

CM_FN void m_drop(struct mseq *m)
{
    m->n = 0;
    m->n_hist = 0;
    m->next_pos = 0;
    m->dropped = true;
}

#endif /* KVD_TESTS_CACHE_MODEL_H */
