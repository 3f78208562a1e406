/*
 * test_cache_invariants.c - the paged KV cache's invariants that need a
 * long run or a second opinion:
 *
 *   2. accounting: a randomized stress run against a plain model of every
 *      sequence, with forks, attached prefixes and outside references
 *      sharing pages, agrees with the model on every return code, every
 *      byte and the sharing of every page, and ends with the pool free;
 *   3. equivalence at the kernel: attention over an evicted, renumbered
 *      cache equals attention over a fresh cache of exactly the survivors,
 *      for RoPE, ALiBi and T5;
 *   4. bounded memory over a 200,000-token stream;
 *   and, with 3., a fork at the kernel: parent and child, each evicting
 *   after the fork, each equal to a fresh cache of its retained tokens.
 *
 * The model (tests/cache_model.h) re-states the policies the slow, obvious
 * way. Invariants 1 and 5 and the unit tests are in test_cache.c.
 */
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

#include <cmocka.h>

#include "attention/attention.h"
#include "cache/cache_internal.h"
#include "cache/kv_cache.h"
#include "tests/cache_model.h"
#include "tests/kernel_eq.h"

/* ------------------------------------------------------------------------
 * Invariant 2: randomized accounting stress against the model
 * ------------------------------------------------------------------------ */

#define MAXS 12
#define MAXMP (1 << 17) /* model page ids handed out in one run */
#define MAXHELD 8

/*
 * Pages in the model. The cache's page ids are reused (LIFO); the model's
 * are not: every page the model allocates gets a new id, and a reference
 * count. The world then checks that the two agree up to renaming: the
 * same sharing structure (which sequences and outside holders hold the
 * same page), the same counts, the same pages in use.
 */
struct world {
    kv_cache *c;
    struct kv_layout l;
    int pt, n_pages;
    struct mseq m[MAXS];
    int next_order;
    uint32_t rng, next_seed;
    uint64_t clock;
    int32_t *mrefs; /* [MAXMP] references of each model page */
    int next_mp, used;
    /* Outside references (kv_page_ref), oldest first: the reclaim hook's
     * order. gone_r / gone_m: released by the cache's hook / by the model. */
    struct {
        int32_t real, mp;
    } held[MAXHELD];
    bool gone_r[MAXHELD], gone_m[MAXHELD];
    int n_held;
    /* coverage of the interesting paths */
    int n_enospc, n_enomem, n_drops, n_shrinks, n_evict_sw, n_evict_h2o, n_truncs;
    int n_forks, n_attaches, n_copies, n_reclaimed, n_passed_over, n_holds;
    uint64_t evictions, tokens_evicted; /* what the cache's counters must say */
};

static int32_t mp_new(struct world *w)
{
    assert_true(w->next_mp < MAXMP);
    w->mrefs[w->next_mp] = 1;
    w->used++;
    return w->next_mp++;
}

static void mp_unref(struct world *w, int32_t mp)
{
    assert_true(w->mrefs[mp] > 0);
    if (--w->mrefs[mp] == 0)
        w->used--;
}

static bool mp_shared(const struct world *w, int32_t mp)
{
    return w->mrefs[mp] > 1;
}

static void m_pg_reserve(struct mseq *m, int n)
{
    if (n > m->pg_cap) {
        m->pg_cap = n * 2 + 8;
        m->pg = realloc(m->pg, sizeof(int32_t) * (size_t)m->pg_cap);
        assert_non_null(m->pg);
    }
}

/* Copy-on-write of logical page j. */
static void m_unshare(struct world *w, struct mseq *m, int j)
{
    if (!mp_shared(w, m->pg[j]))
        return;
    mp_unref(w, m->pg[j]);
    m->pg[j] = mp_new(w);
    w->n_copies++;
}

/* Cut m's pages to those of its first n tokens. */
static void m_cut_pages(struct world *w, struct mseq *m, int n)
{
    for (int j = m_pages(n, w->pt); j < m_pages(m->n, w->pt); j++)
        mp_unref(w, m->pg[j]);
}

/* What evicting m down to keep does to its pages (kv_evict_effect,
 * restated): [*gl, *gh) leave, [*wl, *wh) may be written. */
static void m_effect(const struct mseq *m, int keep, int pt, int *gl, int *gh, int *wl, int *wh)
{
    int np = m_pages(m->n, pt), kp = m_pages(keep, pt);
    *wl = *wh = 0;
    *gl = *gh = np;
    if (keep >= m->n)
        return;
    if (m->pol.kind == KV_EVICT_SINK_WINDOW) {
        *gl = (m->pol.sink_tokens + pt - 1) / pt;
        *gh = *gl + (m->n - keep) / pt;
        return;
    }
    *gl = kp;
    int sinks = m->pol.sink_tokens < m->n ? m->pol.sink_tokens : m->n;
    *wl = sinks / pt;
    *wh = kp;
}

/* Pages the pool must hand out, at the peak, for m to evict to keep and
 * append n: new + copies of shared pages written - unshared pages freed. */
static int64_t m_need(const struct world *w, const struct mseq *m, int keep, int n)
{
    const int pt = w->pt;
    int gl, gh, wl, wh;
    m_effect(m, keep, pt, &gl, &gh, &wl, &wh);
    int64_t copies = 0, freed = 0;
    for (int j = wl; j < wh; j++)
        copies += mp_shared(w, m->pg[j]);
    int64_t during = copies;
    for (int j = gl; j < gh; j++)
        freed += !mp_shared(w, m->pg[j]);
    if (n > 0 && keep % pt != 0) {
        int last = (keep - 1) / pt;
        if (last >= gl)
            last += gh - gl;
        if (last < wl || last >= wh)
            copies += mp_shared(w, m->pg[last]);
    }
    int64_t total = m_pages(keep + n, pt) - m_pages(keep, pt) + copies - freed;
    return total > during ? total : during;
}

static int w_free_pages(const struct world *w)
{
    return w->n_pages - w->used;
}

/* The model's reclaim: outside references nobody else holds go, oldest
 * first, up to n. Returns the pages freed. */
static int m_reclaim(struct world *w, int64_t n)
{
    int freed = 0;
    for (int i = 0; i < w->n_held && freed < n; i++) {
        if (w->gone_m[i] || w->mrefs[w->held[i].mp] != 1)
            continue;
        w->gone_m[i] = true;
        mp_unref(w, w->held[i].mp);
        freed++;
    }
    return freed;
}

/* The cache's reclaim hook: the same rule, on the cache's counts. */
static int world_reclaim(void *ctx, kv_cache *c, int n)
{
    struct world *w = ctx;
    int freed = 0;
    for (int i = 0; i < w->n_held && freed < n; i++) {
        if (w->gone_r[i] || kv_page_refs(c, w->held[i].real) != 1)
            continue;
        w->gone_r[i] = true;
        assert_int_equal(kv_page_unref(c, w->held[i].real), 0);
        freed++;
    }
    return freed;
}

/* After an operation: the cache's hook and the model released the same
 * outside references; drop them from the list. */
static void sync_held(struct world *w)
{
    int k = 0;
    for (int i = 0; i < w->n_held; i++) {
        assert_int_equal(w->gone_r[i], w->gone_m[i]);
        w->n_reclaimed += w->gone_r[i];
        if (!w->gone_r[i])
            w->held[k++] = w->held[i];
    }
    w->n_held = k;
    memset(w->gone_r, 0, sizeof(w->gone_r));
    memset(w->gone_m, 0, sizeof(w->gone_m));
}

/* Evict m down to keep, pages included: sink-window drops whole pages;
 * h2o copies the shared pages its compaction writes (from the first token
 * that moves) and drops the tail. */
static int w_evict(struct world *w, struct mseq *m, int keep)
{
    const int pt = w->pt, before = m->n, np = m_pages(before, pt);
    if (keep >= before)
        return 0;
    int gl, gh, wl, wh;
    m_effect(m, keep, pt, &gl, &gh, &wl, &wh);
    uint32_t *old = malloc(sizeof(uint32_t) * (size_t)before);
    for (int i = 0; i < before; i++)
        old[i] = m->t[i].seed;
    int k = m_evict(m, keep, pt);
    if (m->pol.kind == KV_EVICT_SINK_WINDOW) {
        for (int j = gl; j < gh; j++)
            mp_unref(w, m->pg[j]);
        memmove(m->pg + gl, m->pg + gh, sizeof(int32_t) * (size_t)(np - gh));
    } else {
        int d0 = 0; /* the first slot a moved token lands in */
        while (d0 < keep && m->t[d0].seed == old[d0])
            d0++;
        for (int j = d0 / pt; d0 < keep && j < m_pages(keep, pt); j++)
            m_unshare(w, m, j);
        for (int j = m_pages(keep, pt); j < np; j++)
            mp_unref(w, m->pg[j]);
    }
    free(old);
    if (k > 0) {
        w->evictions++;
        w->tokens_evicted += (uint64_t)k;
    }
    return k;
}

/* Drop (LRU) or destroy: every page reference goes. */
static void w_release_all(struct world *w, struct mseq *m)
{
    m_cut_pages(w, m, 0);
}

/* Pages dropping o would free. */
static int m_unshared(const struct world *w, const struct mseq *o)
{
    int n = 0;
    for (int j = 0; j < m_pages(o->n, w->pt); j++)
        n += !mp_shared(w, o->pg[j]);
    return n;
}

static struct kv_policy random_policy(uint32_t *rng, int pt)
{
    /* One draw per statement: argument evaluation order is unspecified. */
    int kind = (int)(rng_next(rng) % 3);
    int s = (int)(rng_next(rng) % 7), win = (int)(rng_next(rng) % 10);
    int hv = (int)(rng_next(rng) % 6), slack = (int)(rng_next(rng) % 20);
    bool renumber = rng_next(rng) % 2;
    switch (kind) {
    case 0:
        return none_policy(1 + slack * 2);
    case 1:
        return sink_window((s + pt - 1) / pt * pt + win + pt + slack, s, win, renumber);
    default:
        s %= 4, win %= 6;
        return h2o(s + win + hv + pt + slack, s, win, hv, renumber);
    }
}

/* The model's append: predicts the return code and, on success, applies. */
static int model_append(struct world *w, struct mseq *m, const int32_t *ids, int n)
{
    const int pt = w->pt, max = m->pol.max_cache_tokens;
    if (n > max)
        return -ENOSPC;
    int keep = m->n;
    if (m->n + n > max) {
        keep = m_plan(m, max - n, pt);
        if (keep < 0)
            return -ENOSPC;
    }
    int64_t need = m_need(w, m, keep, n), have = w_free_pages(w);
    if (need > have)
        have += m_reclaim(w, need - have);
    /* LRU: oldest idle session first; one whose pages are all shared is
     * passed over. */
    uint8_t plan[MAXS] = {0}; /* 1 victim, 2 passed over */
    while (need > have) {
        int best = -1;
        for (int i = 0; i < MAXS; i++) {
            const struct mseq *o = &w->m[i];
            if (!o->seq || o == m || !o->session || o->pinned || plan[i] || o->n == 0)
                continue;
            if (best < 0 || o->last_use < w->m[best].last_use ||
                (o->last_use == w->m[best].last_use && o->order < w->m[best].order))
                best = i;
        }
        if (best < 0)
            break;
        int gain = m_unshared(w, &w->m[best]);
        plan[best] = gain > 0 ? 1 : 2;
        w->n_passed_over += gain == 0;
        have += gain;
    }
    bool shrink = false;
    while (need > have) {
        int64_t target = keep - (need - have - 1) * pt - 1;
        int k = target >= 0 ? m_plan(m, (int)target, pt) : -1;
        if (k < 0)
            return -ENOMEM;
        keep = k;
        need = m_need(w, m, keep, n);
        shrink = true;
    }
    for (int i = 0; i < MAXS; i++)
        if (plan[i] == 1) {
            w_release_all(w, &w->m[i]);
            m_drop(&w->m[i]);
            w->n_drops++;
        }
    if (w_evict(w, m, keep) > 0) {
        if (m->pol.kind == KV_EVICT_H2O)
            w->n_evict_h2o++;
        else
            w->n_evict_sw++;
    }
    w->n_shrinks += shrink;
    if (keep % pt != 0)
        m_unshare(w, m, keep / pt);
    m_pg_reserve(m, m_pages(keep + n, pt));
    for (int j = m_pages(keep, pt); j < m_pages(keep + n, pt); j++)
        m->pg[j] = mp_new(w);
    mseq_reserve(m, m->n + n, m->n_hist + n);
    for (int i = 0; i < n; i++) {
        m->t[m->n + i] = (struct mtok){.id = ids[i],
                                       .pos = m->next_pos++,
                                       .hidx = m->n_hist + i,
                                       .mass = 0,
                                       .seed = w->next_seed++};
        m->hist[m->n_hist + i] = ids[i];
    }
    m->n += n;
    m->n_hist += n;
    return 0;
}

/* Tie model page mp to cache page rp, or check they are tied to each
 * other already: the two agree up to renaming. */
static void link_page(int32_t *m2r, int32_t *r2m, int32_t mp, int32_t rp)
{
    if (m2r[mp] < 0 && r2m[rp] < 0) {
        m2r[mp] = rp;
        r2m[rp] = mp;
    }
    assert_int_equal(m2r[mp], rp);
    assert_int_equal(r2m[rp], mp);
}

/* Every live sequence holds exactly what the model says, bytes included;
 * the cache's pages and the model's agree up to renaming: same sharing,
 * same reference counts, every other page free. */
static void verify_world(struct world *w, bool bytes)
{
    int32_t *m2r = malloc(sizeof(int32_t) * (size_t)(w->next_mp + 1));
    int32_t *r2m = malloc(sizeof(int32_t) * (size_t)w->n_pages);
    for (int i = 0; i <= w->next_mp; i++)
        m2r[i] = -1;
    for (int p = 0; p < w->n_pages; p++)
        r2m[p] = -1;
    for (int i = 0; i < MAXS; i++) {
        struct mseq *m = &w->m[i];
        if (!m->seq)
            continue;
        kv_seq *s = m->seq;
        assert_int_equal(kv_seq_n_tokens(s), m->n);
        assert_int_equal(kv_seq_n_pages(s), m_pages(m->n, w->pt));
        assert_int_equal(kv_seq_next_pos(s), m->next_pos);
        assert_int_equal(kv_seq_dropped(s), m->dropped);
        for (int j = 0; j < m->n; j++) {
            assert_int_equal(kv_seq_tokens(s)[j], m->t[j].id);
            assert_int_equal(kv_seq_positions(s)[j], m->t[j].pos);
            assert_int_equal(kv_seq_hist_index(s)[j], m->t[j].hidx);
            assert_true(kv_seq_mass(s)[j] == m->t[j].mass);
            if (bytes)
                assert_true(token_intact(s, &w->l, j, m->t[j].seed));
        }
        const int32_t *hist;
        int nh = kv_seq_history(s, &hist);
        if (m->session) {
            assert_int_equal(nh, m->n_hist);
            if (nh > 0)
                assert_memory_equal(hist, m->hist, sizeof(int32_t) * (size_t)nh);
        } else {
            assert_int_equal(nh, 0);
        }
        for (int j = 0; j < kv_seq_n_pages(s); j++) {
            int32_t p = kv_seq_page_table(s)[j];
            assert_true(p >= 0 && p < w->n_pages);
            link_page(m2r, r2m, m->pg[j], p);
            assert_int_equal(kv_page_refs(w->c, p), w->mrefs[m->pg[j]]);
        }
    }
    for (int i = 0; i < w->n_held; i++) {
        link_page(m2r, r2m, w->held[i].mp, w->held[i].real);
        assert_int_equal(kv_page_refs(w->c, w->held[i].real), w->mrefs[w->held[i].mp]);
    }
    int used = 0, shared = 0;
    for (int p = 0; p < w->n_pages; p++) {
        if (r2m[p] < 0) {
            assert_int_equal(kv_page_refs(w->c, p), 0); /* not held: free */
            continue;
        }
        used++;
        shared += mp_shared(w, r2m[p]);
    }
    assert_int_equal(used, w->used); /* every model page in use is some cache page */
    free(m2r);
    free(r2m);
    struct kv_stats st;
    kv_cache_stats(w->c, &st);
    assert_int_equal(st.pages_used, used);
    assert_int_equal(st.pages_free, w->n_pages - used);
    assert_int_equal(st.pages_shared, shared);
    assert_int_equal(st.evictions, w->evictions);
    assert_int_equal(st.tokens_evicted, w->tokens_evicted);
    assert_int_equal(st.sessions_dropped, (uint64_t)w->n_drops);
    assert_cache_ok(w->c);
}

/* A random live slot other than `not` (-1 when none). */
static int live_slot(struct world *w, int not)
{
    int start = (int)(rng_next(&w->rng) % MAXS);
    for (int k = 0; k < MAXS; k++) {
        int i = (start + k) % MAXS;
        if (i != not && w->m[i].seq)
            return i;
    }
    return -1;
}

/* Fill the empty slot m with a new sequence of a random policy. */
static void op_create(struct world *w, struct mseq *m)
{
    struct kv_policy p = random_policy(&w->rng, w->pt);
    bool session = rng_next(&w->rng) % 2;
    char err[256];
    m->seq = kv_seq_create(w->c, &p, session, err, sizeof(err));
    assert_non_null(m->seq);
    m->order = w->next_order++;
    m->pol = p;
    m->session = session;
    m->last_use = w->clock;
    kv_seq_touch(m->seq, w->clock);
}

/* Fill the empty slot m as a fork of slot src (sometimes a refused one:
 * a session child of a non-session parent). */
static void op_fork(struct world *w, struct mseq *m, const struct mseq *src)
{
    char err[256];
    bool session = rng_next(&w->rng) % 2;
    m->seq = kv_seq_fork(src->seq, session, err, sizeof(err));
    if (session && !src->session) {
        assert_null(m->seq);
        return;
    }
    assert_non_null(m->seq);
    m->order = w->next_order++;
    m->pol = src->pol;
    m->session = session;
    m->last_use = src->last_use;
    m->next_pos = src->next_pos;
    m->n = src->n;
    m->n_hist = src->n_hist;
    mseq_reserve(m, src->n + 1, src->n_hist + 1);
    if (src->n > 0)
        memcpy(m->t, src->t, sizeof(*m->t) * (size_t)src->n);
    if (src->n_hist > 0)
        memcpy(m->hist, src->hist, sizeof(*m->hist) * (size_t)src->n_hist);
    m_pg_reserve(m, m_pages(src->n, w->pt));
    for (int j = 0; j < m_pages(src->n, w->pt); j++) {
        m->pg[j] = src->pg[j];
        w->mrefs[m->pg[j]]++;
    }
    w->n_forks++;
}

/* Fill the empty slot m with a new sequence attaching the first full
 * pages of src (a cached prefix); refused past the new policy's budget. */
static void op_attach(struct world *w, struct mseq *m, const struct mseq *src)
{
    const int pt = w->pt;
    int full = src->n / pt;
    if (full == 0)
        return;
    int k = 1 + (int)(rng_next(&w->rng) % (uint32_t)full);
    op_create(w, m);
    const struct kv_policy p = m->pol;
    int32_t pages[64], ids[256];
    assert_true(k <= 64 && k * pt <= 256);
    for (int j = 0; j < k; j++)
        pages[j] = kv_seq_page_table(src->seq)[j];
    for (int i = 0; i < k * pt; i++)
        ids[i] = src->t[i].id;
    int want = k * pt > p.max_cache_tokens ? -ENOSPC : 0;
    assert_int_equal(kv_seq_attach(m->seq, pages, k, ids), want);
    if (want)
        return;
    mseq_reserve(m, k * pt, k * pt);
    m_pg_reserve(m, k);
    for (int i = 0; i < k * pt; i++) {
        m->t[i] = (struct mtok){.id = ids[i], .pos = i, .hidx = i, .seed = src->t[i].seed};
        m->hist[i] = ids[i];
    }
    for (int j = 0; j < k; j++) {
        m->pg[j] = src->pg[j];
        w->mrefs[m->pg[j]]++;
    }
    m->n = m->n_hist = m->next_pos = k * pt;
    w->n_attaches++;
}

/* An outside reference to one of m's pages, or one let go. */
static void op_outside(struct world *w, struct mseq *m)
{
    if (w->n_held > 0 && (w->n_held == MAXHELD || rng_next(&w->rng) % 2)) {
        int i = (int)(rng_next(&w->rng) % (uint32_t)w->n_held);
        assert_int_equal(kv_page_unref(w->c, w->held[i].real), 0);
        mp_unref(w, w->held[i].mp);
        memmove(&w->held[i], &w->held[i + 1], sizeof(w->held[0]) * (size_t)(w->n_held - i - 1));
        w->n_held--;
        return;
    }
    int np = m_pages(m->n, w->pt);
    if (np == 0)
        return;
    int j = (int)(rng_next(&w->rng) % (uint32_t)np);
    int32_t real = kv_seq_page_table(m->seq)[j];
    assert_int_equal(kv_page_ref(w->c, real), 0);
    w->mrefs[m->pg[j]]++;
    w->held[w->n_held].real = real;
    w->held[w->n_held].mp = m->pg[j];
    w->n_held++;
    w->n_holds++;
}

static void stress_op(struct world *w)
{
    uint32_t r = rng_next(&w->rng) % 100;
    int slot = (int)(rng_next(&w->rng) % MAXS);
    struct mseq *m = &w->m[slot];

    if (!m->seq) { /* create, fork or attach */
        int src = live_slot(w, slot);
        if (src >= 0 && r < 30) {
            op_fork(w, m, &w->m[src]);
            return;
        }
        if (src >= 0 && r < 40) {
            op_attach(w, m, &w->m[src]);
            return;
        }
        op_create(w, m);
        return;
    }
    if (r < 6) { /* free */
        kv_seq_destroy(m->seq);
        w_release_all(w, m);
        mseq_free(m);
    } else if (r < 55) { /* append */
        int big = rng_next(&w->rng) % 8 == 0;
        int n = 1 + (int)(rng_next(&w->rng) % (big ? 30 : 6));
        int32_t ids[32];
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)(rng_next(&w->rng) % 50000);
        int n0 = m->n, first = -1;
        int want = model_append(w, m, ids, n);
        int got = kv_seq_append(m->seq, ids, n, &first);
        assert_int_equal(got, want);
        w->n_enospc += got == -ENOSPC;
        w->n_enomem += got == -ENOMEM;
        if (got == 0) {
            assert_int_equal(first, m->n - n);
            for (int i = 0; i < n; i++)
                fill_token(m->seq, &w->l, first + i, m->t[first + i].seed);
        } else {
            assert_int_equal(m->n, n0);
        }
    } else if (r < 65) { /* attention mass */
        float mass[256];
        for (int i = 0; i < m->n; i++) {
            mass[i] = (float)(rng_next(&w->rng) % 64) / 8.0f;
            m->t[i].mass += mass[i];
        }
        kv_seq_add_mass(m->seq, mass);
    } else if (r < 70) { /* explicit eviction */
        int need = (int)(rng_next(&w->rng) % 12);
        int target = m->pol.max_cache_tokens - need, want;
        if (m->n <= target) {
            want = 0;
        } else {
            int keep = m_plan(m, target, w->pt);
            int64_t pool = keep < 0 ? 0 : m_need(w, m, keep, 0);
            if (pool > w_free_pages(w))
                m_reclaim(w, pool - w_free_pages(w));
            want = keep < 0                      ? -ENOSPC
                   : pool > w_free_pages(w) ? -ENOMEM
                                                 : w_evict(w, m, keep);
        }
        assert_int_equal(kv_seq_evict(m->seq, need), want);
        w->n_enomem += want == -ENOMEM;
    } else if (r < 76) { /* truncate (sometimes out of range) */
        int nh = (int)(rng_next(&w->rng) % (uint32_t)(m->n_hist + 2));
        int want = nh > m->n_hist ? -EINVAL : 0;
        assert_int_equal(kv_seq_truncate(m->seq, nh), want);
        if (want == 0) {
            int keep = 0;
            while (keep < m->n && m->t[keep].hidx < nh)
                keep++;
            if (m->pol.renumber)
                m->next_pos = keep > 0 ? m->t[keep - 1].pos + 1 : 0;
            else
                m->next_pos = keep > 0 ? m->t[keep - 1].pos + (nh - m->t[keep - 1].hidx) : nh;
            m_cut_pages(w, m, keep);
            m->n = keep;
            m->n_hist = nh;
            w->n_truncs++;
        }
    } else if (r < 80) { /* an outside reference taken or let go */
        op_outside(w, m);
    } else if (r < 86) { /* touch, sometimes at the same time as another */
        w->clock += rng_next(&w->rng) % 3;
        m->last_use = w->clock;
        kv_seq_touch(m->seq, w->clock);
    } else if (r < 92) { /* pin / unpin */
        m->pinned = !m->pinned;
        kv_seq_pin(m->seq, m->pinned);
    } else if (r < 96) { /* reload the policy (sometimes an invalid one) */
        struct kv_policy p = random_policy(&w->rng, w->pt);
        if (rng_next(&w->rng) % 4 == 0) {
            p.max_cache_tokens = 0;
            assert_int_equal(kv_seq_set_policy(m->seq, &p), -EINVAL);
        } else {
            assert_int_equal(kv_seq_set_policy(m->seq, &p), 0);
            m->pol = p;
        }
    } else { /* predicates */
        int k = (int)(rng_next(&w->rng) % 10);
        bool fits = m->n + k <= m->pol.max_cache_tokens && m_need(w, m, m->n, k) <= w_free_pages(w);
        assert_int_equal(kv_seq_has_room(m->seq, k), fits);
        int room = m->pol.max_cache_tokens - m_floor(m, w->pt);
        assert_int_equal(kv_seq_max_append(m->seq), room > 0 ? room : 0);
    }
}

static void test_stress_accounting(void **state)
{
    (void)state;
    struct world *w = calloc(1, sizeof(*w));
    w->mrefs = calloc(MAXMP, sizeof(int32_t));
    w->pt = 4;
    w->c = make_cache(28 * 192, w->pt, 2, 2, 3, KV_F16); /* 192-byte pages: 28 */
    kv_cache_layout(w->c, &w->l);
    kv_cache_set_reclaim(w->c, world_reclaim, w);
    w->n_pages = kv_cache_n_pages(w->c);
    assert_int_equal(w->n_pages, 28);
    w->rng = 0xC0FFEEu;
    for (int op = 0; op < 6000; op++) {
        stress_op(w);
        sync_held(w);
        verify_world(w, op % 4 == 0);
    }
    verify_world(w, true);
    print_message("stress: %d enospc, %d enomem, %d sessions dropped (%d passed over), %d shrinks, "
                  "%d sink-window and %d h2o evictions, %d truncations, %d forks, %d attaches, "
                  "%d page copies, %d outside references (%d reclaimed)\n",
                  w->n_enospc, w->n_enomem, w->n_drops, w->n_passed_over, w->n_shrinks,
                  w->n_evict_sw, w->n_evict_h2o, w->n_truncs, w->n_forks, w->n_attaches,
                  w->n_copies, w->n_holds, w->n_reclaimed);
    /* The run must have gone through every path it is meant to check. */
    assert_true(w->n_enospc > 10 && w->n_enomem > 10 && w->n_drops > 10);
    assert_true(w->n_shrinks > 5 && w->n_evict_sw > 50 && w->n_evict_h2o > 50);
    assert_true(w->n_truncs > 50);
    assert_true(w->n_forks > 50 && w->n_attaches > 10 && w->n_copies > 50);
    assert_true(w->n_holds > 50 && w->n_reclaimed > 5 && w->n_passed_over > 5);
    struct kv_stats st;
    kv_cache_stats(w->c, &st);
    assert_int_equal(st.sessions_dropped, (uint64_t)w->n_drops);

    for (int i = 0; i < MAXS; i++)
        if (w->m[i].seq) {
            kv_seq_destroy(w->m[i].seq);
            w_release_all(w, &w->m[i]);
            mseq_free(&w->m[i]);
        }
    for (int i = 0; i < w->n_held; i++)
        assert_int_equal(kv_page_unref(w->c, w->held[i].real), 0);
    kv_cache_stats(w->c, &st);
    assert_int_equal(st.pages_free, st.pages_total); /* completely free */
    assert_int_equal(st.pages_shared, 0);
    assert_int_equal(st.sequences, 0);
    assert_cache_ok(w->c);
    kv_cache_destroy(w->c);
    free(w->mrefs);
    free(w);
}

/* ------------------------------------------------------------------------
 * Invariant 3: equivalence at the kernel
 * ------------------------------------------------------------------------ */

/*
 * The plain reference, written here from the formulas as a third opinion
 * beside the attention room's two kernels: for each query head, rotate q and
 * every visible key by their positions (RoPE), add the bias from
 * pos_k - pos_q (ALiBi, T5), softmax, weighted sum of V. Reads K and V
 * through struct attn_kv exactly as the kernel must. f32 only.
 */
static void ref_attention(const struct attn_params *P, const struct attn_kv *kv,
                          const struct attn_seq *sq)
{
    const int hd = P->head_dim, group = P->n_head / P->n_kv_head;
    double inv[256];
    float cs[512], qr[256], kr[256];
    double *score = malloc(sizeof(double) * (size_t)(sq->n_kv > 0 ? sq->n_kv : 1));
    if (P->pos.kind == POS_ROPE)
        pos_rope_inv_freq(inv, P->pos.rope_dims, P->pos.rope_theta);
    for (int qi = 0; qi < sq->n_q; qi++) {
        int32_t pq = sq->q_pos[qi];
        for (int h = 0; h < P->n_head; h++) {
            int kvh = h / group;
            memcpy(qr, sq->q + ((size_t)qi * P->n_head + h) * hd, sizeof(float) * (size_t)hd);
            if (P->pos.kind == POS_ROPE) {
                pos_rope_cos_sin(cs, inv, P->pos.rope_dims, P->pos.rope_freq_scale, pq);
                pos_rope_apply(qr, cs, P->pos.rope_dims, P->pos.rope_pairing);
            }
            double mx = -INFINITY;
            for (int i = 0; i < sq->n_kv; i++) {
                int32_t pk = sq->pos[i];
                if (pk > pq) {
                    score[i] = -INFINITY;
                    continue;
                }
                size_t row = (size_t)sq->page_table[i / kv->page_tokens] * kv->page_bytes +
                             ((size_t)kvh * kv->page_tokens + (size_t)(i % kv->page_tokens)) *
                                 (size_t)hd * sizeof(float);
                memcpy(kr, kv->base + kv->k_offset + row, sizeof(float) * (size_t)hd);
                if (P->pos.kind == POS_ROPE) {
                    pos_rope_cos_sin(cs, inv, P->pos.rope_dims, P->pos.rope_freq_scale, pk);
                    pos_rope_apply(kr, cs, P->pos.rope_dims, P->pos.rope_pairing);
                }
                double dot = 0;
                for (int d = 0; d < hd; d++)
                    dot += (double)qr[d] * kr[d];
                double s = dot * P->scale;
                if (P->pos.kind == POS_ALIBI)
                    s += (double)P->pos.alibi_slopes[h] * (double)(pk - pq);
                else if (P->pos.kind == POS_T5)
                    s += P->pos.t5_table[(size_t)h * P->pos.t5_num_buckets +
                                         (size_t)pos_t5_bucket(pk - pq, P->pos.t5_bidirectional,
                                                               P->pos.t5_num_buckets,
                                                               P->pos.t5_max_distance)];
                score[i] = s;
                if (s > mx)
                    mx = s;
            }
            double sum = 0;
            for (int i = 0; i < sq->n_kv; i++) {
                score[i] = score[i] == -INFINITY ? 0 : exp(score[i] - mx);
                sum += score[i];
            }
            float *out = sq->out + ((size_t)qi * P->n_head + h) * hd;
            for (int d = 0; d < hd; d++) {
                double acc = 0;
                for (int i = 0; i < sq->n_kv; i++) {
                    if (score[i] == 0)
                        continue;
                    size_t row = (size_t)sq->page_table[i / kv->page_tokens] * kv->page_bytes +
                                 ((size_t)kvh * kv->page_tokens + (size_t)(i % kv->page_tokens)) *
                                     (size_t)hd * sizeof(float);
                    float v;
                    memcpy(&v, kv->base + kv->v_offset + row + (size_t)d * sizeof(float),
                           sizeof(v));
                    acc += score[i] * v;
                }
                out[d] = sum > 0 ? (float)(acc / sum) : 0.0f;
            }
        }
    }
    free(score);
}

/*
 * Stream tokens through an evicting sequence in renumber mode, then compare
 * the last query's attention with a fresh cache holding exactly the tokens
 * the model says must survive, at positions 0..n-1.
 */
static void run_equivalence(const struct attn_params *P, struct kv_policy pol)
{
    kv_cache *c = make_cache(1 << 20, EQ_PT, 1, EQ_KV_HEADS, EQ_DIM, KV_F32);
    kv_seq *s = make_seq(c, pol, false);
    struct mseq m = {.pol = pol};
    uint32_t rng = 99;
    int32_t orig_pos[256];
    for (int32_t id = 1000; id < 1090; id++) {
        int first;
        assert_int_equal(kv_seq_append(s, &id, 1, &first), 0);
        eq_write_token(s, first, id);
        /* The model: evict as the policy says, then append. */
        if (m.n + 1 > pol.max_cache_tokens)
            m_evict(&m, m_plan(&m, pol.max_cache_tokens - 1, EQ_PT), EQ_PT);
        mseq_reserve(&m, m.n + 1, m.n_hist + 1);
        m.t[m.n++] = (struct mtok){.id = id, .pos = m.next_pos++, .hidx = m.n_hist++};
        if (pol.kind == KV_EVICT_H2O) {
            float mass[256];
            for (int i = 0; i < m.n; i++) {
                mass[i] = (float)(rng_next(&rng) % 100) / 50.0f;
                m.t[i].mass += mass[i];
            }
            kv_seq_add_mass(s, mass);
        }
    }
    struct kv_stats st;
    kv_cache_stats(c, &st);
    assert_true(st.evictions >= 3);
    int n = kv_seq_n_tokens(s);
    assert_int_equal(n, m.n);
    for (int i = 0; i < n; i++) {
        assert_int_equal(kv_seq_tokens(s)[i], m.t[i].id);
        assert_int_equal(kv_seq_positions(s)[i], i);
        orig_pos[i] = kv_seq_hist_index(s)[i]; /* what preserve would have kept */
    }

    /* The fresh cache: exactly the survivors, appended in order. */
    kv_cache *fc = make_cache(1 << 20, EQ_PT, 1, EQ_KV_HEADS, EQ_DIM, KV_F32);
    kv_seq *f = make_seq(fc, none_policy(1000), false);
    int32_t pad = -1; /* shift the fresh cache's page ids away from the evicted one's */
    kv_seq *padding = make_seq(fc, none_policy(1000), false);
    assert_int_equal(kv_seq_append(padding, &pad, 1, NULL), 0);
    for (int i = 0; i < n; i++) {
        int first;
        assert_int_equal(kv_seq_append(f, &m.t[i].id, 1, &first), 0);
        eq_write_token(f, first, m.t[i].id);
    }

    float q[EQ_HEADS * EQ_DIM];
    for (int i = 0; i < EQ_HEADS * EQ_DIM; i++)
        q[i] = (float)(rng_next(&rng) % 2001) / 1000.0f - 1.0f;
    float out_e[3][EQ_HEADS * EQ_DIM], out_f[3][EQ_HEADS * EQ_DIM], out_p[3][EQ_HEADS * EQ_DIM];
    eq_attend_last(P, c, s, NULL, q, ref_attention, out_e);
    eq_attend_last(P, fc, f, NULL, q, ref_attention, out_f);
    /* And the check can fail: the same cache read at its original
     * positions (with gaps) gives a different answer. */
    eq_attend_last(P, c, s, orig_pos, q, ref_attention, out_p);
    for (int k = 0; k < 3; k++) {
        assert_true(eq_max_diff(out_e[k], out_f[k], EQ_HEADS * EQ_DIM) <= 1e-6);
        assert_true(eq_max_diff(out_p[k], out_f[k], EQ_HEADS * EQ_DIM) > 1e-4);
        /* The attention room's kernels agree with the plain reference. */
        assert_true(eq_max_diff(out_e[k], out_e[2], EQ_HEADS * EQ_DIM) <= 1e-4);
    }

    kv_cache_destroy(fc);
    kv_cache_destroy(c);
    mseq_free(&m);
}

static void run_fork_equivalence(const struct attn_params *P, struct kv_policy pol);

static void run_equivalence_all_policies(const struct attn_params *P)
{
    run_equivalence(P, sink_window(32, 3, 10, true));
    run_equivalence(P, h2o(30, 2, 8, 6, true));
    run_fork_equivalence(P, sink_window(32, 3, 10, true));
    run_fork_equivalence(P, h2o(30, 2, 8, 6, true));
}

static void test_equivalence_rope(void **state)
{
    (void)state;
    struct attn_params P = eq_params();
    P.pos = (struct pos_scheme){.kind = POS_ROPE,
                                .rope_theta = 10000.0f,
                                .rope_dims = EQ_DIM,
                                .rope_pairing = POS_ROPE_NEOX,
                                .rope_freq_scale = 1.0f};
    run_equivalence_all_policies(&P);
    P.pos.rope_pairing = POS_ROPE_ADJACENT;
    P.pos.rope_dims = EQ_DIM / 2; /* partial rotation */
    run_equivalence_all_policies(&P);
}

static void test_equivalence_alibi(void **state)
{
    (void)state;
    struct attn_params P = eq_params();
    float slopes[EQ_HEADS];
    assert_int_equal(pos_alibi_slopes(slopes, EQ_HEADS, 8.0f), 0);
    P.pos = (struct pos_scheme){.kind = POS_ALIBI, .alibi_slopes = slopes};
    run_equivalence_all_policies(&P);
}

static void test_equivalence_t5(void **state)
{
    (void)state;
    struct attn_params P = eq_params();
    const int nb = 32;
    float table[EQ_HEADS * 32];
    uint32_t r = 7;
    for (int i = 0; i < EQ_HEADS * nb; i++)
        table[i] = (float)(rng_next(&r) % 4001) / 1000.0f - 2.0f;
    P.pos = (struct pos_scheme){.kind = POS_T5,
                                .t5_table = table,
                                .t5_num_buckets = nb,
                                .t5_max_distance = 64,
                                .t5_bidirectional = false};
    run_equivalence_all_policies(&P);
}

/* Attention of the last query over a fresh cache holding exactly ids[0..n)
 * at positions 0..n-1 (one none-policy sequence, contents from the ids). */
static void attend_fresh(const struct attn_params *P, const int32_t *ids, int n, const float *q,
                         float out[3][EQ_HEADS * EQ_DIM])
{
    kv_cache *fc = make_cache(1 << 20, EQ_PT, 1, EQ_KV_HEADS, EQ_DIM, KV_F32);
    kv_seq *f = make_seq(fc, none_policy(1000), false);
    for (int i = 0; i < n; i++) {
        int first;
        assert_int_equal(kv_seq_append(f, &ids[i], 1, &first), 0);
        eq_write_token(f, first, ids[i]);
    }
    eq_attend_last(P, fc, f, NULL, q, ref_attention, out);
    kv_cache_destroy(fc);
}

/* Append id to s and write its K and V. */
static void append_written(kv_seq *s, int32_t id)
{
    int first;
    assert_int_equal(kv_seq_append(s, &id, 1, &first), 0);
    eq_write_token(s, first, id);
}

/*
 * A fork at the kernel: parent and child share 21 tokens' pages, then each
 * appends its own tokens past the budget and evicts. Each must attend
 * exactly like a fresh cache of its retained tokens at 0..n-1: a write
 * into a page the other still reads, or a page freed under it, would show.
 */
static void run_fork_equivalence(const struct attn_params *P, struct kv_policy pol)
{
    kv_cache *c = make_cache(1 << 20, EQ_PT, 1, EQ_KV_HEADS, EQ_DIM, KV_F32);
    kv_seq *a = make_seq(c, pol, false);
    for (int32_t id = 1000; id < 1021; id++)
        append_written(a, id);
    char err[256];
    kv_seq *b = kv_seq_fork(a, false, err, sizeof(err));
    assert_non_null(b);
    for (int i = 0; i < 40; i++) {
        append_written(a, 2000 + i);
        if (i % 3 != 2) /* the child appends fewer: the two evict at different times */
            append_written(b, 3000 + i);
    }
    assert_cache_ok(c);
    uint32_t rng = 5;
    float q[EQ_HEADS * EQ_DIM];
    for (int i = 0; i < EQ_HEADS * EQ_DIM; i++)
        q[i] = (float)(rng_next(&rng) % 2001) / 1000.0f - 1.0f;
    float out[2][3][EQ_HEADS * EQ_DIM], fresh[2][3][EQ_HEADS * EQ_DIM];
    kv_seq *both[2] = {a, b};
    for (int k = 0; k < 2; k++) {
        kv_seq *s = both[k];
        assert_true(kv_seq_tokens(s)[0] == 1000); /* the shared prefix's first page stays */
        eq_attend_last(P, c, s, NULL, q, ref_attention, out[k]);
        attend_fresh(P, kv_seq_tokens(s), kv_seq_n_tokens(s), q, fresh[k]);
        for (int r = 0; r < 3; r++)
            assert_true(eq_max_diff(out[k][r], fresh[k][r], EQ_HEADS * EQ_DIM) <= 1e-6);
    }
    /* The two did diverge: the check compares different caches. */
    assert_true(eq_max_diff(out[0][0], out[1][0], EQ_HEADS * EQ_DIM) > 1e-4);
    kv_seq_destroy(a); /* the child reads the same after its parent goes */
    float again[3][EQ_HEADS * EQ_DIM];
    eq_attend_last(P, c, b, NULL, q, ref_attention, again);
    assert_true(eq_max_diff(again[0], out[1][0], EQ_HEADS * EQ_DIM) == 0);
    assert_cache_ok(c);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------
 * Invariant 4: bounded memory over a long stream
 * ------------------------------------------------------------------------ */

static long rss_bytes(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    if (!f)
        return -1;
    long size = 0, resident = 0;
    int got = fscanf(f, "%ld %ld", &size, &resident);
    fclose(f);
    return got == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}

static void test_bounded_memory(void **state)
{
    (void)state;
    const int pt = 16, max = 2048;
    /* 8 KiB pages; a 16 MiB pool, 8x what the sequence may hold, so a
     * leaked or unrecycled page would show in RSS. */
    kv_cache *c = make_cache(16u << 20, pt, 2, 2, 16, KV_F32);
    struct kv_layout l;
    kv_cache_layout(c, &l);
    kv_seq *s = make_seq(c, sink_window(max, 4, 1024, true), false);
    const int budget_pages = (max + pt - 1) / pt;
    int32_t ids[64];
    long rss_full = -1, fed = 0;
    uint32_t rng = 5;
    struct kv_stats st;
    while (fed < 200000) {
        int n = 1 + (int)(rng_next(&rng) % 48);
        if (n > 200000 - fed)
            n = (int)(200000 - fed);
        if (n > kv_seq_max_append(s))
            n = kv_seq_max_append(s);
        for (int i = 0; i < n; i++)
            ids[i] = (int32_t)(fed + i);
        int first;
        assert_int_equal(kv_seq_append(s, ids, n, &first), 0);
        for (int i = 0; i < n; i++)
            for (int layer = 0; layer < 2; layer++)
                for (int h = 0; h < 2; h++) {
                    memset(kv_seq_k(s, layer, h, first + i), (int)(fed + i) & 0xff, l.k_row_bytes);
                    memset(kv_seq_v(s, layer, h, first + i), (int)(fed + i) & 0x7f, l.v_row_bytes);
                }
        fed += n;
        assert_true(kv_seq_n_tokens(s) <= max);
        assert_true(kv_seq_n_pages(s) <= budget_pages);
        assert_true(s->t_cap <= 4 * max && s->p_cap <= 4 * budget_pages); /* bookkeeping */
        kv_cache_stats(c, &st);
        assert_true(st.pages_used <= budget_pages);
        if (rss_full < 0 && st.evictions > 0)
            rss_full = rss_bytes(); /* the first window has filled */
    }
    long rss_end = rss_bytes();
    assert_true(rss_full > 0 && rss_end > 0);
    print_message("200000 tokens: %d retained, %llu evictions, RSS %ld KiB at the first "
                  "eviction, %ld KiB at the end\n",
                  kv_seq_n_tokens(s), (unsigned long long)st.evictions, rss_full / 1024,
                  rss_end / 1024);
    assert_true(st.evictions > 5000);
    assert_int_equal(kv_seq_tokens(s)[kv_seq_n_tokens(s) - 1], 199999);
    /* Growth allowance: 1 MiB, far under the 14 MiB of pool the stream would
     * touch if pages were not recycled, and under the 1.2 MiB a leak of 6
     * bytes per token would add. The bookkeeping arrays settle at twice the
     * budget once after the first eviction; the rest is the process, not the
     * cache: the same stream measured 64-284 KiB from run to run (the
     * allocation sequence is fixed; the spread came with the load of the
     * machine), so a tighter bound failed on noise. AddressSanitizer's own
     * bookkeeping creeps by a few KiB per thousand tokens: 2 MiB there. */
#if defined(__SANITIZE_ADDRESS__)
    const long allowance = 2L << 20;
#else
    const long allowance = 1L << 20;
#endif
    assert_true(rss_end - rss_full <= allowance);
    kv_cache_destroy(c);
}

/* ------------------------------------------------------------------------ */

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stress_accounting), cmocka_unit_test(test_equivalence_rope),
        cmocka_unit_test(test_equivalence_alibi), cmocka_unit_test(test_equivalence_t5),
        cmocka_unit_test(test_bounded_memory),
    };
    return cmocka_run_group_tests_name("cache_invariants", tests, NULL, NULL);
}
