/*
 * step.c - one engine step: cancel, admit, batch, reserve, forward, sample.
 *
 * Every step runs ONE model_forward over a batch that holds one decode
 * token for each running sequence that has finished its prompt, plus
 * prefill chunks of sequences still reading their prompt, oldest first, up
 * to step_tokens tokens in all. A long prompt is thus read a chunk per step
 * while the streams already running keep producing a token per step
 * (chunked prefill). With a step time budget (step_budget_ms, at most;
 * pace.c sets it to ~2.5 times the decodes' own timed step), while
 * decode tokens are in the batch the chunks are cut to what the budget
 * holds at the speed measured so far (pace.c), so a stream waits at most
 * about one budget for its next token; the oldest prompt still gets at
 * least a page's worth of tokens every step and, when the decodes alone
 * take most of the budget, a chunk large enough to be read near the speed
 * of whole ones (the step then takes up to twice the decodes' time, pace.c).
 * Admission is FIFO into at most max_running sequences.
 *
 * Before the forward, the batch's slots are reserved in the cache
 * (kv_reserve, all or nothing): the policies evict, idle sessions may be
 * dropped, or a sequence is refused; a refused sequence leaves the batch
 * and ends as its state says (fail_in_batch), the rest go on.
 *
 * Determinism. Each request has its own sampler seeded from the request;
 * what a sequence computes does not depend on what else is in the batch,
 * so the same request with the same seed gives the same text alone or
 * batched.
 *
 * Cancellation. A request's cancel flag is read at the start of every
 * step; its sequence is dropped (pages back to the pool) and its final
 * event posted.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

/* Unlink q from the waiting FIFO (prev is the one before it, or NULL). */
static void waiting_remove(engine *e, struct engine_req *prev, struct engine_req *q)
{
    if (prev)
        prev->next = q->next;
    else
        e->wait_head = q->next;
    if (e->wait_tail == q)
        e->wait_tail = prev;
    q->next = NULL;
    e->n_waiting--;
}

static enum engine_finish cancel_finish(int c)
{
    return c == ENGINE_CANCEL_CLIENT ? ENGINE_FINISH_CANCEL : ENGINE_FINISH_ABORT;
}

/* Drop cancelled requests, waiting or running. */
static void drop_cancelled(engine *e)
{
    struct engine_req *prev = NULL;
    for (struct engine_req *q = e->wait_head, *next; q; q = next) {
        next = q->next;
        int c = atomic_load(&q->cancel);
        if (!c) {
            prev = q;
            continue;
        }
        waiting_remove(e, prev, q);
        struct engine_event *ev = engine_final_event(q, ENGINE_EV_DONE);
        if (ev) {
            ev->finish = cancel_finish(c);
            ev->usage.prompt_tokens = q->n_prompt;
            engine_post(e, ev);
        }
    }
    for (struct run *r = e->runs, *next; r; r = next) {
        next = r->next;
        int c = atomic_load(&r->req->cancel);
        if (engine_choices_failed(r)) {
            engine_choices_fail(e, r, 0, NULL); /* a sibling failed: the request ends */
            continue;
        }
        if (!c)
            continue;
        if (c == ENGINE_CANCEL_ABORT && !engine_run_flush(e, r))
            continue; /* failed and freed */
        engine_run_finish(e, r, cancel_finish(c), -1);
    }
}

/*
 * Admission by free pages.
 *
 * A request is admitted when the pool can hold its prompt: the pages its
 * sequence needs for the prompt (within the policy's budget, plus a page
 * for the first decode token and an eviction's granularity) must be
 * covered by the free pages plus what idle sessions can give back (the
 * pool drops them, least recently used first, when it runs short), less
 * what the sequences already admitted will still take: the rest of their
 * prompts and the next decode token of each. Otherwise the request waits
 * in the queue, in order, until finished requests give pages back; the
 * host bounds the queue (the daemon answers 429 past queue_length). A
 * request that cannot fit even in an empty pool is refused at once (503).
 *
 * Generation beyond the prompt is not reserved ahead (a long max_tokens
 * would otherwise hold pages it may never use): when decoding outgrows the
 * pool, the youngest sequence yields (fail_in_batch), and one that has not
 * produced a token yet goes back to the head of the queue instead of
 * failing.
 */

/* Pool pages a sequence holding `tokens` tokens takes under pol: the
 * budget's per-sequence pages for min(tokens, the budget), the
 * sliding-window layers' own pages included (the cache's formula). */
static int pages_for(const engine *e, const struct kv_policy *pol, int tokens)
{
    return (int)kv_cache_pages_for(e->cache, pol, tokens, e->lim.step_tokens);
}

/* Pages the admitted sequences will still take: the rest of each prompt,
 * one page for each decode. */
static int pages_promised(const engine *e)
{
    int n = 0;
    for (const struct run *r = e->runs; r; r = r->next) {
        int have = kv_seq_pool_pages(r->seq);
        int need = r->phase == RUN_PREFILL
                       ? pages_for(e, kv_seq_policy(r->seq), r->req->n_prompt) - have +
                             engine_choices_pages(e, r->req)
                       : kv_cache_token_pages(e->cache);
        n += need > 0 ? need : 0;
    }
    return n;
}

/*
 * Whether q's prompt fits now (see above); *never when it cannot fit even
 * in an empty pool. x is q's session (NULL for none): its pages are its own
 * already and not the pool's to give back.
 */
static bool fits(engine *e, const struct engine_req *q, const struct engine_session *x,
                 bool *never)
{
    int own = x && !kv_seq_dropped(x->seq) ? kv_seq_pool_pages(x->seq) : 0;
    int shared, idle_cached; /* the prefix cache's part (engine/prefix.c) */
    engine_prefix_fit(e, q, own, &shared, &idle_cached);
    int need = pages_for(e, &e->lim.policy, q->n_prompt) - own - shared +
               engine_choices_pages(e, q);
    struct kv_stats st;
    kv_cache_stats(e->cache, &st);
    *never = need > st.pages_total - own - shared;
    int give_back = engine_sessions_idle_pages(&e->sessions) - own + idle_cached;
    return need <= st.pages_free + give_back - pages_promised(e);
}

/* Admission in order, up to max_running and the pages above; a request
 * whose session is busy keeps its place and lets later ones pass. */
static void admit(engine *e, uint64_t t)
{
    struct engine_req *prev = NULL;
    for (struct engine_req *q = e->wait_head, *next; q && e->n_running < e->lim.max_running;
         q = next) {
        next = q->next;
        struct engine_session *x =
            q->session ? engine_sessions_find(&e->sessions, q->session) : NULL;
        if (x && x->busy) {
            prev = q;
            continue;
        }
        int slots = engine_choices_n(q); /* n choices run as n sequences */
        if (e->n_running > 0 && e->n_running + slots > e->lim.max_running)
            break;
        bool never = false;
        if (!fits(e, q, x, &never) && !never)
            break; /* wait for pages, in order */
        waiting_remove(e, prev, q);
        if (never)
            engine_post_error(e, q, 503,
                              "the prompt (%d tokens)%s cannot fit the KV pool (%d pages of %d "
                              "tokens) even when empty",
                              q->n_prompt, slots > 1 ? " and its choices' answers" : "",
                              kv_cache_n_pages(e->cache), e->p.page_tokens);
        else
            engine_run_admit(e, q, t);
    }
}

/* Build the batch: decode tokens first (not for a request whose reader is
 * behind: it keeps its slot and its cache and resumes when `paused` is
 * cleared), then prefill chunks in admission order, within step_tokens.
 * Returns the number of entries. */
static int build_batch(engine *e)
{
    int n = 0, budget = e->lim.step_tokens;
    struct pace_work decode_work = {0};
    for (struct run *r = e->runs; r; r = r->next) {
        r->batch_slot = -1;
        if (r->phase == RUN_DECODE && budget > 0 && n < e->batch_cap &&
            !atomic_load(&r->req->paused)) {
            e->batch[n] = (struct model_batch_seq){
                .seq = r->seq, .tokens = &r->next_tok, .n_tokens = 1, .logits = r->logits};
            e->batch_runs[n] = r;
            r->batch_slot = n++;
            budget--;
            struct pace_work w = pace_chunk_work(1, kv_seq_n_tokens(r->seq));
            decode_work.tokens += w.tokens;
            decode_work.pairs += w.pairs;
        }
    }
    struct pace_plan plan; /* prompt chunks within the step's time budget (pace.h) */
    pace_plan_start(&plan, &e->pace, e->lim.step_budget_ms, n, &decode_work, e->p.page_tokens);
    for (struct run *r = e->runs; r && budget > 0; r = r->next) {
        if (r->phase != RUN_PREFILL || n >= e->batch_cap)
            continue;
        engine_prefix_attach(e, r); /* pages published since it last looked */
        int left = r->req->n_prompt - r->n_fed;
        int chunk = left < budget ? left : budget;
        bool each = r->req->logits == ENGINE_LOGITS_EACH;
        if (each)
            chunk = 1; /* logits after every prompt token */
        int room = kv_seq_max_append(r->seq);
        if (room < chunk)
            chunk = room;
        if (chunk <= 0)
            chunk = 1; /* let kv_reserve report -ENOSPC for this sequence */
        else if ((chunk = pace_plan_chunk(&plan, chunk, kv_seq_n_tokens(r->seq))) == 0)
            continue; /* the step is full in time: this prompt waits a step */
        bool final = chunk == left;
        e->batch[n] = (struct model_batch_seq){.seq = r->seq,
                                               .tokens = r->req->prompt + r->n_fed,
                                               .n_tokens = chunk,
                                               .logits = final || each ? r->logits : NULL};
        e->batch_runs[n] = r;
        r->batch_slot = n++;
        budget -= chunk;
    }
    return n;
}

static void batch_remove(engine *e, int *n, int i)
{
    for (int j = i; j + 1 < *n; j++) {
        e->batch[j] = e->batch[j + 1];
        e->batch_runs[j] = e->batch_runs[j + 1];
        e->batch_runs[j]->batch_slot = j;
    }
    (*n)--;
}

/*
 * A sequence of the batch cannot go on: end it as its state says. What it
 * generated is sent, but a generation the engine cut (the pool ran out of
 * pages; a reload took away the eviction it was admitted under) ends with
 * a finish that says so, never as if the request's own limit was reached.
 */
static void fail_in_batch(engine *e, struct run *r, int err)
{
    if (err == -ENOSPC) {
        if (r->phase == RUN_DECODE) {
            if (engine_run_flush(e, r))
                engine_run_finish(
                    e, r, r->admitted_evicting ? ENGINE_FINISH_POLICY : ENGINE_FINISH_CONTEXT, -1);
        } else {
            engine_run_fail(e, r, 400,
                            "the prompt (%d tokens) does not fit the context: %d tokens are kept "
                            "per sequence under eviction policy none",
                            r->req->n_prompt, kv_seq_policy(r->seq)->max_cache_tokens);
        }
    } else if (err == -ENOMEM) {
        if (r->n_gen > 0) {
            if (engine_run_flush(e, r))
                engine_run_finish(e, r, ENGINE_FINISH_POOL, -1);
        } else if (e->n_running > 1) {
            engine_run_requeue(e, r); /* nothing sent yet: wait for pages again */
        } else {
            engine_run_fail(e, r, 503, "the KV cache is full; retry later");
        }
    } else {
        engine_run_fail(e, r, 500, "model error %d", err);
    }
}

/* Take every entry out of the batch and fail it with err. */
static void fail_batch(engine *e, int *n, int err)
{
    while (*n > 0) {
        struct run *x = e->batch_runs[*n - 1];
        batch_remove(e, n, *n - 1);
        fail_in_batch(e, x, err);
    }
}

/*
 * Reserve the batch's slots, taking out the sequences that cannot have
 * theirs: the one whose context is full (or whose batch entry is bad), or,
 * when the pool is short, the most recently admitted sequence, which
 * yields to the older ones; each is failed or finished as fail_in_batch
 * says. Fills each entry's `first`. Returns false when nothing is left.
 */
static bool reserve_batch(engine *e, int *n)
{
    for (;;) {
        for (int i = 0; i < *n; i++)
            e->res[i] = (struct kv_reservation){.seq = e->batch[i].seq,
                                                .tokens = e->batch[i].tokens,
                                                .n_tokens = e->batch[i].n_tokens};
        int failed = -1;
        int rc = kv_reserve(e->res, *n, &failed);
        if (rc == 0)
            break;
        int victim = failed >= 0 && failed < *n ? failed : *n - 1;
        if (rc == -ENOMEM) {
            /* the most recently admitted sequence of the batch yields */
            victim = 0;
            for (int i = 1; i < *n; i++)
                if (e->batch_runs[i]->t_admit_ns >= e->batch_runs[victim]->t_admit_ns)
                    victim = i;
        }
        struct run *r = e->batch_runs[victim];
        engine_log(&e->p.hooks, ENGINE_LOG_WARN, "request %" PRIu64 ": no room in the cache (%s)",
                   r->req->id,
                   rc == -ENOSPC   ? "context full"
                   : rc == -ENOMEM ? "KV pool exhausted"
                                   : "error");
        batch_remove(e, n, victim);
        fail_in_batch(e, r, rc);
        if (rc != -ENOSPC && rc != -ENOMEM)
            fail_batch(e, n, rc); /* a bad batch is a bug in the engine */
        if (*n == 0)
            return false;
    }
    for (int i = 0; i < *n; i++)
        e->batch[i].first = e->res[i].first;
    return true;
}

/* Post the logits a scoring request asked for (after prompt[n_fed - 1]).
 * False when out of memory: r was failed (503) and freed. */
static bool post_logits(engine *e, struct run *r)
{
    enum engine_logits want = r->req->logits;
    if (want == ENGINE_LOGITS_NONE || (want == ENGINE_LOGITS_LAST && r->n_fed < r->req->n_prompt))
        return true;
    struct engine_event *ev = engine_event_new(ENGINE_EV_LOGITS, r->req);
    float *x = malloc(sizeof(float) * (size_t)e->n_vocab);
    if (!ev || !x) {
        free(ev);
        free(x);
        engine_run_fail(e, r, 503, "out of memory for the request's logits; retry later");
        return false;
    }
    memcpy(x, r->logits, sizeof(float) * (size_t)e->n_vocab);
    ev->logits = x;
    ev->position = r->n_fed - 1;
    engine_post(e, ev);
    return true;
}

/* Report the tokens r's sequence lost in this step (want_evictions). False
 * when out of memory: r was failed (503) and freed. */
static bool post_evicted(engine *e, struct run *r)
{
    int retained = kv_seq_n_tokens(r->seq);
    int seen = r->sess ? kv_seq_history(r->seq, NULL) : r->appended;
    int evicted = seen > retained ? seen - retained : 0;
    if (!r->req->want_evictions || evicted <= r->evicted)
        return true;
    struct engine_event *ev = engine_event_new(ENGINE_EV_EVICTED, r->req);
    if (!ev) {
        engine_run_fail(e, r, 503, "out of memory for the request's events; retry later");
        return false;
    }
    ev->choice = r->choice;
    ev->evicted = evicted - r->evicted;
    ev->usage.evicted_tokens = evicted;
    ev->usage.retained_tokens = retained;
    r->evicted = evicted;
    engine_post(e, ev);
    return true;
}

/* After the forward: advance each entry, sample where the prompt is read. */
static void sample_batch(engine *e, int n, uint64_t t_done)
{
    /* Sample in batch order; a run may be freed meanwhile, but the batch
     * arrays hold each entry until the next step. */
    for (int i = 0; i < n; i++) {
        struct run *r = e->batch_runs[i];
        const struct model_batch_seq *b = &e->batch[i];
        uint64_t t = t_done;
        if (r->phase == RUN_PREFILL) {
            r->n_fed += b->n_tokens;
            if (!r->sess)
                r->appended += b->n_tokens;
            if (!post_evicted(e, r) || (b->logits && !post_logits(e, r)))
                continue;
            if (r->n_fed < r->req->n_prompt)
                continue;
            if (r->req->fill_tokens > 0) {
                if (!engine_run_fill(e, r))
                    continue;
                t = engine_now_ns(); /* the fill is the prompt's time, not the answer's */
            }
            if (r->req->max_tokens == 0) {
                engine_run_finish(e, r, ENGINE_FINISH_LENGTH, -1);
                continue;
            }
            if (!engine_run_fork_answer(e, r) || !engine_choices_fork(e, r, t_done))
                continue;
        } else {
            if (!r->sess)
                r->appended += 1;
            if (!post_evicted(e, r))
                continue;
        }
        engine_run_sample(e, r, t);
    }
}

/* Teach the pacing model what this step's forward pass cost. */
static void observe_pace(engine *e, int n, uint64_t ns)
{
    struct pace_work w = {0};
    bool chunks = false;
    for (int i = 0; i < n; i++) {
        struct pace_work c = pace_chunk_work(e->batch[i].n_tokens, e->batch[i].first);
        w.tokens += c.tokens;
        w.pairs += c.pairs;
        chunks |= e->batch_runs[i]->phase == RUN_PREFILL;
    }
    engine_pace_observe(&e->pace, &w, chunks, (double)ns / 1e9);
}

static bool one_step(engine *e, uint64_t t)
{
    drop_cancelled(e);
    admit(e, t);
    int n = build_batch(e);
    if (n == 0)
        return false;
    if (!reserve_batch(e, &n))
        return true;
    uint64_t t0 = engine_now_ns();
    int rc = model_forward(e->ctx, e->batch, n);
    if (!rc)
        observe_pace(e, n, engine_now_ns() - t0);
    if (rc) {
        /* A failed pass is a bug or a kernel error: take the slots back
         * and fail the whole batch. */
        kv_reserve_undo(e->res, n);
        engine_log(&e->p.hooks, ENGINE_LOG_WARN, "forward failed (%d): failing the batch", rc);
        fail_batch(e, &n, rc);
        return true;
    }
    engine_prefix_publish(e, n);
    int batch_tokens = 0;
    for (int i = 0; i < n; i++)
        batch_tokens += e->batch[i].n_tokens;
    if (e->p.hooks.observe) {
        e->p.hooks.observe(e->p.hooks.ud, ENGINE_OBS_BATCH_SEQS, n);
        e->p.hooks.observe(e->p.hooks.ud, ENGINE_OBS_BATCH_TOKENS, batch_tokens);
    }
    sample_batch(e, n, engine_now_ns());
    return true;
}

bool engine_do_step(engine *e, uint64_t t)
{
    bool worked = one_step(e, t);
    engine_prefix_trim(e); /* whatever the step freed: idle pages to the cap */
    return worked;
}
