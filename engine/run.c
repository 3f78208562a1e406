/*
 * run.c - one request's life in the engine: admitted into a sequence,
 * fed, sampled, turned into text, ended.
 *
 * Admission gives a request its sequence. A request naming a session
 * continues that session's sequence: its prompt is compared with the
 * session's token history, the matching prefix is kept (cached_tokens),
 * the rest of the history is truncated and only the unmatched suffix is
 * prefilled. At least the prompt's last token is always fed so the step
 * has logits to sample from. Without a session the sequence is the
 * request's own and is freed at its end. A session used by a running
 * request is pinned (the pool's LRU never drops it).
 *
 * Text. Sampled ids go through the model's streaming detokenizer, which
 * yields only whole UTF-8 characters, then through the stop-string
 * matcher (stop.c), which holds back any tail that could still become a
 * stop string and cuts the text before a stop string when one completes.
 * So stop strings are found across token boundaries and never emitted.
 *
 * Log-probabilities. A request that asks for them gets, in the text event
 * of each sampled token, the token's log-probability and its n most likely
 * alternatives' (logprobs.c). A token sampled last (max_tokens) is never
 * fed, so with max_tokens 1 a session's cache holds exactly its prompt, as
 * kvd eval's sequence does.
 *
 * Memory. Everything a run needs is allocated at admission except its
 * text: when the held text, an event or a log-probability record cannot
 * be allocated, that request fails with 503 (what it already received
 * stays sent) and every other request goes on.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine_internal.h"

static int64_t unix_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void observe(engine *e, enum engine_obs what, double v)
{
    if (e->p.hooks.observe)
        e->p.hooks.observe(e->p.hooks.ud, what, v);
}

/* ------------------------------------------------------------------------
 * The end of a run
 * ------------------------------------------------------------------------ */

void engine_run_usage(const struct run *r, struct engine_usage *u, uint64_t t_end)
{
    u->prompt_tokens = r->req->n_prompt;
    u->completion_tokens = r->n_gen;
    u->cached_tokens = r->n_cached;
    u->retained_tokens = r->seq ? kv_seq_n_tokens(r->seq) : 0;
    int seen = r->sess ? kv_seq_history(r->seq, NULL) : r->appended;
    u->evicted_tokens = seen > u->retained_tokens ? seen - u->retained_tokens : 0;
    if (r->seq && r->req->n_turns > 0) {
        struct kv_turn_state ts;
        kv_seq_turn_state(r->seq, &ts);
        u->evicted_messages = ts.messages_evicted;
        u->evicted_messages_now = ts.messages_evicted - r->turn_msgs0;
        u->turns_cut = ts.turns_cut;
    }
    uint64_t t_first = r->t_first_ns ? r->t_first_ns : t_end;
    u->prompt_ms = (double)(t_first - r->t_admit_ns) / 1e6;
    u->gen_ms = (double)(t_end - t_first) / 1e6;
    u->fill_ms = (double)r->fill_ns / 1e6;
}

/* Free a run's own state (not its sequence or session). */
void engine_run_state_free(struct run *r)
{
    model_sampler_destroy(r->smp);
    model_detok_destroy(r->detok);
    free(r->hist);
    free(r->logits);
    engine_lp_free(&r->lp);
    free(r->hold);
    free(r);
}

/* Remove r from the running list and free it: its sequence goes back to
 * the pool unless it belongs to a session. */
void engine_run_free(engine *e, struct run *r)
{
    if (r->group)
        engine_choices_leave(r);
    if (r->prompt_seq) { /* the answer's fork goes; the prompt's sequence is as it was */
        kv_seq_destroy(r->seq);
        r->seq = r->prompt_seq;
        r->prompt_seq = NULL;
    }
    struct run **pp = &e->runs;
    while (*pp && *pp != r)
        pp = &(*pp)->next;
    if (*pp)
        *pp = r->next;
    e->n_running--;
    if (r->sess) {
        r->sess->busy = NULL;
        r->sess->last_used_unix_ms = unix_ms();
        kv_seq_touch(r->seq, engine_now_ns() / 1000000u); /* the one LRU: the cache's */
        kv_seq_pin(r->seq, false);
    } else {
        kv_seq_destroy(r->seq);
    }
    engine_run_state_free(r);
}

void engine_run_requeue(engine *e, struct run *r)
{
    struct engine_req *req = r->req;
    engine_log(&e->p.hooks, ENGINE_LOG_DEBUG,
               "request %" PRIu64 ": no pages for its prompt yet; back to the queue", req->id);
    engine_run_free(e, r);
    req->next = e->wait_head;
    e->wait_head = req;
    if (!e->wait_tail)
        e->wait_tail = req;
    e->n_waiting++;
}

void engine_run_finish(engine *e, struct run *r, enum engine_finish finish, int stop_index)
{
    if (r->group && engine_choices_end(e, r, finish, stop_index))
        return; /* one choice of several: its siblings go on */
    uint64_t t = engine_now_ns();
    uint64_t prefilled = (uint64_t)(r->n_fed - r->n_cached), cached = (uint64_t)r->n_cached,
             generated = (uint64_t)r->n_gen;
    struct engine_event *ev = engine_final_event(r->req, ENGINE_EV_DONE);
    if (ev) {
        ev->finish = finish;
        ev->stop_index = stop_index;
        engine_run_usage(r, &ev->usage, t);
        ev->choice = r->choice;
        if (r->group)
            engine_choices_usage(r, &ev->usage, &prefilled, &cached, &generated);
        if (ev->usage.turns_cut > 0)
            engine_log(&e->p.hooks, ENGINE_LOG_WARN,
                       "request %" PRIu64 ": whole turns could not make room (the answer "
                       "outgrew what the pinned messages leave of max_cache_tokens); the "
                       "eviction policy cut %d turn(s)",
                       r->req->id, ev->usage.turns_cut);
    }
    if (e->p.hooks.finished)
        e->p.hooks.finished(e->p.hooks.ud, finish, prefilled, cached, generated);
    engine_log(&e->p.hooks, ENGINE_LOG_DEBUG,
               "request %" PRIu64 " done: %d prompt (%d cached), %d generated, finish %d",
               r->req->id, r->req->n_prompt, r->n_cached, r->n_gen, (int)finish);
    engine_post(e, ev);
    engine_run_free(e, r);
}

void engine_run_fail(engine *e, struct run *r, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    if (r->group) { /* the request's error waits for the last sibling */
        char msg[sizeof(r->req->final_ev->message)];
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        engine_choices_fail(e, r, status, msg);
        return;
    }
    engine_post_verror(e, r->req, status, fmt, ap);
    va_end(ap);
    engine_run_free(e, r);
}

/* ------------------------------------------------------------------------
 * Text
 * ------------------------------------------------------------------------ */

/* Append n bytes to the held text: 0, or -ENOMEM (nothing changed). */
static int hold_append(struct run *r, const char *bytes, size_t n)
{
    if (n == 0)
        return 0;
    if (r->hold_len + n + 1 > r->hold_cap) {
        size_t cap = r->hold_cap ? r->hold_cap * 2 : 256;
        while (cap < r->hold_len + n + 1)
            cap *= 2;
        char *p = realloc(r->hold, cap);
        if (!p)
            return -ENOMEM;
        r->hold = p;
        r->hold_cap = cap;
    }
    memcpy(r->hold + r->hold_len, bytes, n);
    r->hold_len += n;
    return 0;
}

/* Out of memory for r's text: fail it (what it already received stays
 * sent; the client sees the error, never a cut answer as a finish). */
static void fail_nomem(engine *e, struct run *r)
{
    engine_log(&e->p.hooks, ENGINE_LOG_WARN, "request %" PRIu64 ": out of memory for its text",
               r->req->id);
    engine_run_fail(e, r, 503, "out of memory for the request's text; retry later");
}

/*
 * Emit the first n held bytes (whatever no stop string can claim any
 * more), with the sampled ids and the sampled token's log-probabilities (lp,
 * new or NULL; taken either way). Returns false when out of memory: r was
 * failed and freed.
 */
static bool emit_text(engine *e, struct run *r, size_t n, const int32_t *toks, int n_toks,
                      struct engine_logprob *lp)
{
    if (n == 0 && n_toks == 0 && !lp)
        return true;
    struct engine_event *ev = engine_event_new(ENGINE_EV_TEXT, r->req);
    if (!ev)
        goto out_nomem;
    ev->choice = r->choice;
    ev->lp = lp;
    lp = NULL;
    ev->text = malloc(n + 1);
    if (!ev->text)
        goto out_nomem;
    if (n > 0) /* with logprobs, an event may carry no text (and hold be NULL) */
        memcpy(ev->text, r->hold, n);
    ev->text[n] = '\0';
    ev->len = n;
    if (n_toks > 0) {
        ev->tokens = malloc(sizeof(int32_t) * (size_t)n_toks);
        if (!ev->tokens)
            goto out_nomem;
        memcpy(ev->tokens, toks, sizeof(int32_t) * (size_t)n_toks);
        ev->n_tokens = n_toks;
    }
    if (n > 0) {
        memmove(r->hold, r->hold + n, r->hold_len - n);
        r->hold_len -= n;
    }
    engine_post(e, ev);
    return true;

out_nomem:
    free(lp);
    engine_event_free(ev);
    fail_nomem(e, r);
    return false;
}

bool engine_run_flush(engine *e, struct run *r)
{
    return emit_text(e, r, r->hold_len, NULL, 0, NULL);
}

/* ------------------------------------------------------------------------
 * Admission
 * ------------------------------------------------------------------------ */

/* The sequence's policy (the configured one, a reload's included) and the
 * request's pins (engine_pins_plan checked them): the old pins go first so
 * that the policy is judged alone. Returns 0, or -1 with the reason in err. */
static int set_policy_pins(const engine *e, kv_seq *seq, const struct kv_span *pins, int n_pins,
                           char *err, size_t errlen)
{
    kv_seq_set_pins(seq, NULL, 0, NULL, 0);
    kv_seq_set_policy(seq, &e->lim.policy);
    return kv_seq_set_pins(seq, pins, n_pins, err, errlen);
}

/* Continue the session x: keep the history's prefix that matches the
 * prompt (never the whole prompt: its last token is fed for logits), and
 * give its sequence the request's pins and turns (or none: a completion
 * evicts tokens). Returns 0, or -1 with the reason in err and x left
 * unused. */
static int attach_session(engine *e, struct run *r, struct engine_session *x,
                          const struct kv_span *pins, int n_pins, char *err, size_t errlen)
{
    const struct engine_req *req = r->req;
    int n_h = kv_seq_history(x->seq, NULL);
    int n = engine_history_match(x->seq, req);
    if (n == req->n_prompt)
        n--;
    if (n < n_h && kv_seq_truncate(x->seq, n) != 0) {
        /* Cannot cut there (or the sliding-window layers dropped what that
         * point needs): start the session over. */
        kv_seq_truncate(x->seq, 0);
        n = 0;
    }
    /* The configured policy may be refused only when the sliding-window
     * layers dropped tokens it could bring back into their window: then
     * the session starts over (so may the turn table below). */
    if (kv_seq_set_policy(x->seq, &e->lim.policy) == -ESTALE) {
        kv_seq_truncate(x->seq, 0);
        n = 0;
    }
    int rc = set_policy_pins(e, x->seq, pins, n_pins, err, errlen);
    if (rc == -ESTALE) {
        kv_seq_truncate(x->seq, 0);
        n = 0;
        rc = set_policy_pins(e, x->seq, pins, n_pins, err, errlen);
    }
    if (rc)
        return -1;
    rc = kv_seq_set_turns(x->seq, req->turns, req->n_turns, req->turn_low_tokens, err, errlen);
    if (rc == -ESTALE) {
        kv_seq_truncate(x->seq, 0);
        n = 0;
        rc = kv_seq_set_turns(x->seq, req->turns, req->n_turns, req->turn_low_tokens, err, errlen);
    }
    if (rc)
        return -1;
    struct kv_turn_state ts;
    kv_seq_turn_state(x->seq, &ts);
    r->turn_msgs0 = ts.messages_evicted;
    r->sess = x;
    r->seq = x->seq;
    r->n_cached = n;
    r->n_fed = n;
    x->busy = r;
    kv_seq_pin(x->seq, true);
    return 0;
}

/*
 * Admit req (already out of the waiting FIFO) into a new run at the end of
 * the running list. Returns the run, or NULL after posting the request's
 * error (400 for pins that do not fit the budget or the prompt, 503 out of
 * memory or sessions): it is then done.
 */
struct run *engine_run_admit(engine *e, struct engine_req *req, uint64_t t)
{
    char err[256] = "";
    int status = 503;
    struct run *r = calloc(1, sizeof(*r));
    if (!r)
        goto out_fail;
    r->req = req;
    r->t_admit_ns = t;
    r->batch_slot = -1;
    r->hist = malloc(sizeof(int32_t) * ((size_t)req->n_prompt + (size_t)req->max_tokens + 1));
    r->logits = malloc(sizeof(float) * (size_t)e->n_vocab);
    r->smp = model_sampler_create(&req->sampling, e->n_vocab);
    r->detok = model_detok_create(e->m);
    if (!r->hist || !r->logits || !r->smp || !r->detok ||
        (req->want_logprobs && engine_lp_init(&r->lp, req->n_top_logprobs, e->n_vocab) != 0))
        goto out_free;
    memcpy(r->hist, req->prompt, sizeof(int32_t) * (size_t)req->n_prompt);
    r->n_hist = req->n_prompt;
    bool in_session = req->session && e->lim.max_sessions > 0;
    struct engine_session *x = in_session ? engine_sessions_find(&e->sessions, req->session) : NULL;
    bool live = x && !kv_seq_dropped(x->seq); /* else it may come back from disk */
    struct kv_span pins[KV_MAX_PINS];
    int n_pins = engine_pins_plan(e, req, x ? x->seq : NULL, pins, err, sizeof(err));
    if (n_pins < 0) {
        status = 400; /* before any work: nothing has changed */
        goto out_free;
    }
    if (in_session) {
        /* in memory, else read back from [sessions] dir, else new */
        x = engine_session_open(e, req->session, err, sizeof(err));
        if (!x)
            goto out_free;
        /* read back from [sessions] dir: plan again with the pins it kept */
        if (!live && (n_pins = engine_pins_plan(e, req, x->seq, pins, err, sizeof(err))) < 0) {
            status = 400;
            goto out_free;
        }
        if (attach_session(e, r, x, pins, n_pins, err, sizeof(err)) != 0)
            goto out_free;
    } else {
        r->seq = kv_seq_create(e->cache, &e->lim.policy, false, err, sizeof(err));
        if (!r->seq)
            goto out_free;
        if (set_policy_pins(e, r->seq, pins, n_pins, err, sizeof(err))) {
            kv_seq_destroy(r->seq);
            goto out_free;
        }
    }
    r->admitted_evicting = e->lim.policy.kind != KV_EVICT_NONE;
    r->phase = RUN_PREFILL;
    struct run **pp = &e->runs;
    while (*pp)
        pp = &(*pp)->next;
    *pp = r;
    e->n_running++;
    engine_prefix_admitted(e, r);
    return r;

out_free:
    engine_run_state_free(r);
out_fail:
    if (status == 400)
        engine_post_error(e, req, 400, "%s", err);
    else
        engine_post_error(e, req, 503, "cannot start the request: %s",
                          err[0] ? err : "out of memory for per-request state");
    return NULL;
}

/*
 * Answer on a fork. An append that evicts cannot be undone, so a sequence
 * that decodes an answer no longer holds what its prompt left. With
 * fork_answer the answer decodes on a child sharing every page of the
 * prompt's sequence (kv_seq_fork: nothing copied until the child writes
 * into a shared page); the child is dropped when the run ends (run_free)
 * and the prompt's sequence, a session's, is then exactly as the prompt
 * left it. The child is pinned like the session it came from.
 */
bool engine_run_fork_answer(engine *e, struct run *r)
{
    if (!r->req->fork_answer || r->prompt_seq)
        return true;
    char err[256];
    kv_seq *child = kv_seq_fork(r->seq, kv_seq_is_session(r->seq), err, sizeof(err));
    if (!child) {
        engine_run_fail(e, r, 503, "cannot fork the sequence for the answer: %s", err);
        return false;
    }
    kv_seq_pin(child, true);
    r->prompt_seq = r->seq;
    r->seq = child;
    return true;
}

/* ------------------------------------------------------------------------
 * Tokens
 * ------------------------------------------------------------------------ */

/* The run sampled an end-of-generation token: flush what is held (it
 * cannot complete a stop string any more) and finish. */
static void take_eog(engine *e, struct run *r, int32_t tok)
{
    char tail[64];
    int n = model_detok_flush(r->detok, tail, sizeof(tail));
    if (n > 0 && hold_append(r, tail, (size_t)n) != 0) {
        fail_nomem(e, r);
        return;
    }
    struct engine_logprob *lp = NULL;
    if (r->req->want_logprobs && !(lp = engine_lp_make(&r->lp, tok, tail, n > 0 ? (size_t)n : 0))) {
        fail_nomem(e, r);
        return;
    }
    size_t at = 0, safe = 0;
    int k = engine_stop_scan(r->hold, r->hold_len, r->req->stop, r->req->n_stop, &at, &safe);
    if (!emit_text(e, r, k >= 0 ? at : r->hold_len, NULL, 0, lp))
        return;
    engine_run_finish(e, r, k >= 0 ? ENGINE_FINISH_STOP : ENGINE_FINISH_EOG, k);
}

bool engine_run_sample(engine *e, struct run *r, uint64_t t)
{
    /* before ignore_eos and the sampler change the logits */
    if (r->req->want_logprobs)
        engine_lp_prepare(&r->lp, r->logits, e->n_vocab);
    if (r->req->ignore_eos)
        for (int k = 0; k < e->n_eog; k++)
            r->logits[e->eog[k]] = -INFINITY;
    int32_t tok = model_sample(r->smp, r->logits, r->hist, r->n_hist);
    return engine_run_take_token(e, r, tok, t);
}

/*
 * A token was sampled for r: record it, turn it into text, look for stop
 * strings, and decide whether r goes on. Returns true if r ended (and was
 * freed).
 */
bool engine_run_take_token(engine *e, struct run *r, int32_t tok, uint64_t t)
{
    if (r->n_gen == 0) {
        if (r->choice == 0) /* the request's first token; its siblings' come with it */
            observe(e, ENGINE_OBS_TTFT, (double)(t - r->req->t_submit_ns) / 1e9);
    } else
        observe(e, ENGINE_OBS_ITL, (double)(t - r->t_last_ns) / 1e9);
    if (r->n_gen == 0)
        r->t_first_ns = t;
    r->t_last_ns = t;

    if (model_is_eog(e->m, tok) || tok == r->req->stop_token) {
        take_eog(e, r, tok);
        return true;
    }

    r->n_gen++;
    r->hist[r->n_hist++] = tok;
    size_t hold_before = r->hold_len; /* the token's text starts here */
    char piece[1024];
    int n = model_detok_push(r->detok, tok, piece, sizeof(piece));
    bool last = r->n_gen >= r->req->max_tokens;
    int rc = n > 0 ? hold_append(r, piece, (size_t)n) : 0;
    if (rc == 0 && last) {
        n = model_detok_flush(r->detok, piece, sizeof(piece));
        rc = n > 0 ? hold_append(r, piece, (size_t)n) : 0;
    }
    struct engine_logprob *lp = NULL;
    if (rc == 0 && r->req->want_logprobs &&
        !(lp = engine_lp_make(&r->lp, tok, r->hold ? r->hold + hold_before : "",
                              r->hold_len - hold_before)))
        rc = -ENOMEM;
    if (rc != 0) {
        fail_nomem(e, r);
        return true;
    }
    size_t at = 0, safe = 0;
    int k = engine_stop_scan(r->hold, r->hold_len, r->req->stop, r->req->n_stop, &at, &safe);
    const int32_t *toks = r->req->want_tokens ? &tok : NULL;
    int n_toks = r->req->want_tokens ? 1 : 0;
    if (!emit_text(e, r, k >= 0 ? at : last ? r->hold_len : safe, toks, n_toks, lp))
        return true;
    if (k >= 0 || last) {
        engine_run_finish(e, r, k >= 0 ? ENGINE_FINISH_STOP : ENGINE_FINISH_LENGTH, k);
        return true;
    }
    r->phase = RUN_DECODE;
    r->next_tok = tok;
    return false;
}
