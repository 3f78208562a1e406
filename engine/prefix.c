/*
 * prefix.c - the engine's use of the prefix cache (cache/prefix.c): which
 * runs attach cached pages, when pages are published, what admission may
 * count on, and the figures the host reports.
 *
 * A request, with or without a session, is given the longest chain of
 * cached pages its prompt starts with, so only the rest is prefilled; the
 * prompt's last token is always fed, for the logits to sample from. A run
 * tries at admission and again each time it is about to read a prompt
 * chunk (it must hold whole pages, all its own or all attached), so
 * requests admitted together behind one that is still reading the shared
 * part pick up its pages as soon as they are published: with prefill
 * chunks granted oldest first, the younger ones wait for the budget, and
 * by then the prefix is listed. After every forward pass each sequence of
 * the batch publishes the pages it filled (prompt or generated text: a
 * chat resent with its answers finds them), and the idle pages are trimmed
 * to the share cap.
 *
 * Who attaches. Answers with a cached prefix are the answers without it
 * only if nothing but the K and V bytes carries over from reading a
 * prompt. Under none and sink-window that holds; the scored policies
 * (h2o, tova, knorm, snapkv) gather each token's score while the prompt is
 * read, which attached tokens would lack, so their runs never attach (they
 * still publish: a page written before any eviction is valid for anyone).
 * Scoring runs that want logits after every prompt token (kvd eval) never
 * attach either. The decision is logged once at start. (A prompt longer
 * than max_cache_tokens is evicted from while it is read; where the
 * evictions fall then depends on the chunks it is read in, with or without
 * a cached prefix, as it already depends on what else shares the step.)
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "engine/engine_internal.h"
#include "engine/spill.h"

/* The chains' root: what computed the pages, named as a saved session
 * names it (spill_fingerprint over model_fingerprint, the model's one
 * fingerprint owner: its metadata, tensors and load settings, then the K
 * and V types). One index serves one engine, so this separates nothing in
 * a running process; it keeps keys honest should an index ever outlive its
 * model, and two models of one shape never name a page alike. */
static uint64_t fingerprint(const engine *e)
{
    return spill_fingerprint(model_fingerprint(e->m), e->p.k_type, e->p.v_type);
}

int engine_prefix_init(engine *e, char *err, size_t errlen)
{
    if (!e->p.prefix_cache) {
        engine_log(&e->p.hooks, ENGINE_LOG_INFO, "prefix cache: off");
        return 0;
    }
    if (kv_cache_window(e->cache) > 0) { /* kv_seq_attach refuses such caches */
        engine_log(&e->p.hooks, ENGINE_LOG_INFO,
                   "prefix cache: off (sliding-window layers keep per-sequence pages)");
        return 0;
    }
    int share = e->p.prefix_cache_share < 0     ? 0
                : e->p.prefix_cache_share > 100 ? 100
                                                : e->p.prefix_cache_share;
    int pages = kv_cache_n_pages(e->cache);
    int max_idle = (int)((int64_t)pages * share / 100);
    uint64_t fp = fingerprint(e);
    e->prefix = kv_prefix_create(e->cache, fp, max_idle, err, errlen);
    if (!e->prefix)
        return -1;
    enum kv_policy_kind k = e->lim.policy.kind;
    engine_log(&e->p.hooks, ENGINE_LOG_INFO,
               "prefix cache: on, full pages of %d tokens shared by prompt prefix (model "
               "fingerprint %016" PRIx64 "); up to %d idle pages kept (%d%% of %d); policy %s %s",
               e->p.page_tokens, fp, max_idle, share, pages, kv_policy_kind_name(k),
               kv_policy_scored(k) ? "gathers scores while reading a prompt: its requests publish "
                                     "pages but never attach them"
                                   : "attaches cached prefixes");
    return 0;
}

void engine_prefix_deinit(engine *e)
{
    kv_prefix_destroy(e->prefix);
    e->prefix = NULL;
}

/* Whether r may take cached pages (see the comment at the top). */
static bool may_attach(const engine *e, const struct run *r)
{
    return e->prefix && r->phase == RUN_PREFILL && r->req->logits != ENGINE_LOGITS_EACH &&
           !kv_policy_scored(kv_seq_policy(r->seq)->kind);
}

void engine_prefix_admitted(engine *e, struct run *r)
{
    if (!may_attach(e, r))
        return;
    e->prefix_prompt_tokens += (uint64_t)r->req->n_prompt;
    r->prefix_counted = true;
    engine_prefix_attach(e, r);
}

void engine_prefix_attach(engine *e, struct run *r)
{
    if (!r->prefix_counted || !may_attach(e, r) || r->n_fed >= r->req->n_prompt - 1)
        return;
    int got = kv_prefix_attach(e->prefix, r->seq, r->req->prompt, r->req->n_prompt - 1);
    if (got <= 0) {
        if (got < 0)
            engine_log(&e->p.hooks, ENGINE_LOG_DEBUG,
                       "request %" PRIu64 ": prefix cache: attach failed (%d); prefilling",
                       r->req->id, got);
        return;
    }
    r->n_fed += got;
    r->n_cached += got;
    r->n_prefix += got;
    if (!r->sess)
        r->appended += got;
    e->prefix_hit_tokens += (uint64_t)got;
}

void engine_prefix_publish(engine *e, int n)
{
    if (!e->prefix)
        return;
    for (int i = 0; i < n; i++) {
        struct run *r = e->batch_runs[i];
        int full = kv_seq_n_tokens(r->seq) / e->p.page_tokens;
        if (full == r->prefix_full)
            continue; /* no page filled since the last look */
        r->prefix_full = full;
        kv_prefix_publish(e->prefix, r->seq);
    }
}

void engine_prefix_trim(engine *e)
{
    if (e->prefix)
        kv_prefix_trim(e->prefix);
}

void engine_prefix_fit(engine *e, const struct engine_req *q, int own, int *shared, int *idle)
{
    *shared = *idle = 0;
    if (!e->prefix)
        return;
    int idle_all = kv_prefix_idle_pages(e->prefix), idle_matched = 0;
    if (own == 0 && q->logits != ENGINE_LOGITS_EACH && !kv_policy_scored(e->lim.policy.kind))
        *shared = kv_prefix_lookup(e->prefix, q->prompt, q->n_prompt - 1, &idle_matched);
    *idle = idle_all - idle_matched; /* the matched ones will be in use, not reclaimable */
}

void engine_prefix_stats(const engine *e, struct engine_stats *st)
{
    st->prefix_on = e->prefix != NULL;
    if (e->prefix)
        kv_prefix_get_stats(e->prefix, &st->prefix);
    st->prefix_prompt_tokens = e->prefix_prompt_tokens;
    st->prefix_hit_tokens = e->prefix_hit_tokens;
}
