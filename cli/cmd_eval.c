/*
 * cmd_eval.c - `kvd eval`: what an eviction policy costs in quality.
 *
 * The text is tokenized once (BOS only at the start) and streamed token by
 * token through the engine `kvd serve` runs (engine/engine.h), exactly as
 * one growing session there is: a scoring request (ENGINE_LOGITS_EACH)
 * feeds one token per step to a session whose policy evicts from the
 * middle when the budget is full, and hands back the logits after each
 * token, which give the loss of the next one; perplexity is reported per
 * segment of positions and overall.
 *
 * Baselines run in the same process, over the same tokens:
 *   dense      no eviction at all (the model's own behaviour past its
 *              training length);
 *   chunked    independent chunks of the training length, each starting
 *              from BOS, the classic way to score long text;
 *   recompute  for every token, a fresh forward over exactly the tokens
 *              the first policy retains, at positions 0..n-1: the gold
 *              standard the cache approximates (expensive; length-limited).
 *
 * With --kld-ref T, every policy and the dense baseline also run a twin
 * sequence whose cache stores K and V in type T (f32: the unquantised
 * reference), fed the same tokens in lockstep under the same policy; the
 * KL divergence KL(P_ref || P) of the two next-token distributions is
 * averaged per segment and overall. It measures what a KV type costs
 * token by token, which perplexity (an average of one token's
 * probability) hides.
 *
 * At start it prints which attention path runs; a shape the fused kernel
 * cannot take fails model_ctx_create with the shape named, and eval stops:
 * there is no silent fallback to a slower kernel.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "cli/eval_policy.h"
#include "cli/eval_retrieval.h"
#include "config/args.h"
#include "cpu/pool.h"
#include "engine/engine.h"
#include "model/model.h"

#define MAX_POLICIES 8
#define MAX_SEGMENTS 32
#define MAX_BASELINES 3

enum baseline { BL_DENSE, BL_CHUNKED, BL_RECOMPUTE };
static const char *const baseline_names[] = {"dense", "chunked", "recompute"};

struct eval_policy {
    char label[64];
    struct kv_policy p;
};

struct eval_opts {
    const char *model_path, *file;
    int max_tokens;     /* 0 = whole file */
    int start;          /* first text token scored (after BOS); 1 = the beginning */
    int segments[MAX_SEGMENTS];
    int n_segments;
    struct eval_policy policies[MAX_POLICIES];
    int n_policies;
    bool baseline[MAX_BASELINES];
    int train_len;      /* 0 = from metadata */
    int recompute_max;  /* tokens the recompute baseline covers */
    int page_tokens;
    int budget;         /* --budget: max_cache_tokens of every --policy; 0 = each its smallest */
    enum kv_type k_type, v_type;
    bool kld;                      /* --kld-ref given */
    enum kv_type kld_type;         /* K and V type of the twin reference sequence */
    int threads;
    bool json;
    const char *losses, *plot;
    const char *config;            /* operator config whose [eviction] is the first policy */
    const char *sets[32];          /* --set section.key=value overrides */
    int n_sets;
    struct eval_ret_opts ret;      /* --task retrieval (eval_retrieval.c) */
};

/* One scored run: per-token losses (loss[t] predicts token t; loss[0] unused). */
struct eval_run {
    char label[96];
    double *loss;
    double *kld;        /* with --kld-ref: kld[t] = KL(P_ref || P) of token t's prediction */
    bool has_kld;
    int n;              /* tokens scored: loss[1..n) valid */
    double seconds;
    int pages_used;
    uint64_t evictions, evicted;
};

/* ------------------------------------------------------------------------
 * Options
 * ------------------------------------------------------------------------ */

static void eval_usage(FILE *f)
{
    fprintf(f,
            "usage: kvd eval --model F --file TEXT [options]\n"
            "  --config FILE        run the policy of FILE's [eviction] (and its [cache]\n"
            "                       page_tokens and K/V types) first\n"
            "  --set S.K=V          repeatable override of the config, as for kvd serve\n"
            "%s"
            "  --baseline NAME      repeatable: dense, chunked, recompute\n"
            "  --tokens N           score the first N tokens (default: all)\n"
            "  --start T            begin at the text's token T (a fresh BOS first)\n"
            "  --segments A,B,...   segment boundaries (default 512,2048,8192)\n"
            "  --train-len N        training length (default: from the model)\n"
            "  --recompute-tokens N limit of the recompute baseline (default 2048)\n"
            "  --page-tokens N      cache page size (default 4)\n"
            "  --kv-type T          K and V type: f32 | f16 | bf16 | q8_0 | q4_0 (default f32)\n"
            "  --k-type T, --v-type T   the K or the V type alone\n"
            "  --kld-ref T          also run each policy and dense with K/V in type T (e.g. f32)\n"
            "                       and report the mean KL divergence of the next-token\n"
            "                       distributions against it\n"
            "  --threads N          compute threads (default: OMP_NUM_THREADS, else all CPUs)\n"
            "  --json               print results as JSON\n"
            "  --losses OUT.npy|OUT.bin   per-token losses of the first policy\n"
            "  --plot OUT.png       per-segment perplexity against position (gnuplot),\n"
            "                       or retrieval accuracy against the key's distance\n"
            "%s",
            srv_eval_policy_usage, srv_eval_ret_usage);
}

static int bad_opt(const char *name, const char *v)
{
    fprintf(stderr, "kvd eval: invalid value for %s: '%s'\n", name, v ? v : "");
    return -1;
}

static int parse_segments(const char *s, struct eval_opts *o)
{
    o->n_segments = 0;
    char buf[512];
    snprintf(buf, sizeof(buf), "%s", s);
    long prev = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        long v;
        if (o->n_segments == MAX_SEGMENTS || srv_parse_long(t, 2, 1 << 28, &v) || v <= prev)
            return -1;
        o->segments[o->n_segments++] = (int)v;
        prev = v;
    }
    return o->n_segments ? 0 : -1;
}

/*
 * The operator's config, loaded exactly as `kvd serve` loads it (defaults <
 * file < --set, every rule checked), becomes the first policy, with the
 * config's page size and KV type: what eval measures is what serve runs.
 */
static int config_policy(struct eval_opts *o)
{
    struct cfg *c = malloc(sizeof(*c));
    struct cfg_errors *errs = malloc(sizeof(*errs));
    int rc = -1;
    if (!c || !errs)
        goto out;
    cfg_errors_init(errs);
    if (cfg_load(c, o->config, o->sets, o->n_sets, errs)) {
        for (int i = 0; i < errs->count; i++) {
            char line[1024];
            cfg_error_format(&errs->list[i], line, sizeof(line));
            fprintf(stderr, "kvd eval: %s\n", line);
        }
        goto out;
    }
    struct eval_policy *ep = &o->policies[o->n_policies++];
    srv_cfg_policy(c, &ep->p);
    o->page_tokens = (int)c->cache.page_tokens;
    o->k_type = srv_cfg_kv_type(cfg_k_type(c));
    o->v_type = srv_cfg_kv_type(cfg_v_type(c));
    snprintf(ep->label, sizeof(ep->label), "config (%s %d+%d%s, %s)",
             kv_policy_kind_name(ep->p.kind), ep->p.sink_tokens, ep->p.window_tokens,
             kv_policy_scored(ep->p.kind) ? "+heavy" : "",
             ep->p.renumber ? "renumber" : "preserve");
    rc = 0;
out:
    free(c);
    free(errs);
    return rc;
}

static int parse_opts(int argc, char **argv, struct eval_opts *o, bool *help)
{
    *o = (struct eval_opts){.recompute_max = 2048, .page_tokens = 4, .k_type = KV_F32,
                            .v_type = KV_F32, .start = 1};
    parse_segments("512,2048,8192", o);
    srv_eval_ret_defaults(&o->ret);
    const char *specs[MAX_POLICIES];
    int n_specs = 0;
    bool bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        long n;
#define OPT(name) srv_opt_value(argc, argv, &i, "eval", name, &v, &bad)
        if (OPT("--model")) {
            o->model_path = v;
        } else if (OPT("--file")) {
            o->file = v;
        } else if (OPT("--config")) {
            o->config = v;
        } else if (OPT("--set")) {
            if (bad || o->n_sets == 32)
                return bad_opt("--set (at most 32)", v);
            o->sets[o->n_sets++] = v;
        } else if (OPT("--policy")) {
            if (bad || n_specs == MAX_POLICIES)
                return bad_opt("--policy (at most 8)", v);
            specs[n_specs++] = v;
        } else if (OPT("--baseline")) {
            int k = 0;
            while (!bad && k < MAX_BASELINES && strcmp(v, baseline_names[k]))
                k++;
            if (bad || k == MAX_BASELINES)
                return bad_opt("--baseline (dense|chunked|recompute)", v);
            o->baseline[k] = true;
        } else if (OPT("--tokens")) {
            if (bad || srv_parse_long(v, 2, 1 << 28, &n))
                return bad_opt("--tokens", v);
            o->max_tokens = (int)n;
        } else if (OPT("--start")) {
            if (bad || srv_parse_long(v, 1, 1 << 28, &n))
                return bad_opt("--start", v);
            o->start = (int)n;
        } else if (OPT("--segments")) {
            if (bad || parse_segments(v, o))
                return bad_opt("--segments (increasing, e.g. 512,2048,8192)", v);
        } else if (OPT("--train-len")) {
            if (bad || srv_parse_long(v, 2, 1 << 24, &n))
                return bad_opt("--train-len", v);
            o->train_len = (int)n;
        } else if (OPT("--recompute-tokens")) {
            if (bad || srv_parse_long(v, 2, 1 << 24, &n))
                return bad_opt("--recompute-tokens", v);
            o->recompute_max = (int)n;
        } else if (OPT("--budget")) {
            if (bad || srv_parse_long(v, 1, 1 << 24, &n))
                return bad_opt("--budget", v);
            o->budget = (int)n;
        } else if (OPT("--page-tokens")) {
            if (bad || srv_parse_long(v, 1, 4096, &n))
                return bad_opt("--page-tokens", v);
            o->page_tokens = (int)n;
        } else if (srv_opt_kv_types(argc, argv, &i, "eval", &o->k_type, &o->v_type, &bad)) {
            if (bad)
                return -1;
        } else if (OPT("--kld-ref")) {
            if (bad || kv_type_parse(v, &o->kld_type))
                return bad_opt("--kld-ref (f32|f16|bf16|q8_0|q4_0)", v);
            o->kld = true;
        } else if (OPT("--threads")) {
            if (bad || srv_parse_long(v, 1, 1024, &n))
                return bad_opt("--threads", v);
            o->threads = (int)n;
        } else if (OPT("--losses")) {
            o->losses = v;
        } else if (OPT("--plot")) {
            o->plot = v;
        } else if (srv_eval_ret_opt(argc, argv, &i, &o->ret, &bad)) {
            continue;
        } else if (!strcmp(argv[i], "--json")) {
            o->json = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help = true;
            return 0;
        } else {
            fprintf(stderr, "kvd eval: unknown option '%s'\n", argv[i]);
            return -1;
        }
#undef OPT
    }
    if (bad)
        return -1;
    if (!o->model_path || (!o->file && !o->ret.on)) {
        fprintf(stderr, "kvd eval: --model and --file are required (--file is optional with "
                        "--task retrieval)\n");
        return -1;
    }
    bool use_config = o->config || o->n_sets;
    if (use_config && config_policy(o))
        return -1;
    if (n_specs == 0 && !use_config)
        specs[n_specs++] = "sink-window:4:252";
    if (o->n_policies + n_specs > MAX_POLICIES)
        return bad_opt("--policy (at most 8 with the config's)", specs[0]);
    for (int k = 0; k < n_specs; k++) {
        struct eval_policy *ep = &o->policies[o->n_policies];
        char err[256];
        if (srv_eval_parse_policy(specs[k], o->page_tokens, o->budget, &ep->p, err, sizeof(err))) {
            fprintf(stderr, "kvd eval: policy %s: %s\n", specs[k], err);
            return -1;
        }
        snprintf(ep->label, sizeof(ep->label), "%s", specs[k]);
        o->n_policies++;
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Scoring
 * ------------------------------------------------------------------------ */

/* -log softmax(logits)[target], in double for a stable sum. */
static double token_loss(const float *logits, int n_vocab, int32_t target)
{
    float max = logits[0];
    for (int i = 1; i < n_vocab; i++)
        if (logits[i] > max)
            max = logits[i];
    double sum = 0;
    for (int i = 0; i < n_vocab; i++)
        sum += exp((double)logits[i] - max);
    return log(sum) + max - logits[target];
}

/* Everything one scoring pass needs. */
struct evaluator {
    const model *m;
    model_ctx *ctx; /* the up-front check that the kernel takes the model's shape */
    int n_vocab;
    const struct eval_opts *o;
};

static double seconds_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* KL(P || Q) of the softmaxes of two logit rows, in double. */
static double kl_divergence(const float *p_logits, const float *q_logits, int n)
{
    double pm = p_logits[0], qm = q_logits[0];
    for (int i = 1; i < n; i++) {
        pm = p_logits[i] > pm ? p_logits[i] : pm;
        qm = q_logits[i] > qm ? q_logits[i] : qm;
    }
    double ps = 0, qs = 0;
    for (int i = 0; i < n; i++) {
        ps += exp(p_logits[i] - pm);
        qs += exp(q_logits[i] - qm);
    }
    double lp = pm + log(ps), lq = qm + log(qs), kl = 0;
    for (int i = 0; i < n; i++) {
        double a = p_logits[i] - lp, b = q_logits[i] - lq; /* log-probabilities */
        kl += exp(a) * (a - b);
    }
    return kl > 0 ? kl : 0; /* rounding can leave -1e-17 for equal rows */
}

/* ------------------------------------------------------------------------
 * Scoring through the engine
 *
 * Every pass is a request to the engine `kvd serve` runs (engine/engine.h)
 * whose prompt is the text to score and which asks for the logits after
 * its prompt tokens (ENGINE_LOGITS_EACH: fed one token per step, so the
 * policy evicts token by token, as a session grown one token per request
 * does). A policy's pass is a session, as in the daemon; its pool holds
 * that one sequence at its budget.
 * ------------------------------------------------------------------------ */

/* The session id of a policy's pass. */
#define EVAL_SESSION "eval"

/* An engine whose pool holds one sequence at policy's budget, K/V in the
 * given types, forward capacity `step` tokens; NULL with the reason printed. */
static engine *eval_engine(const struct evaluator *ev, const struct kv_policy *policy,
                           enum kv_type k_type, enum kv_type v_type, int step, bool session)
{
    struct srv_one_engine_params p = {.m = ev->m,
                                      .policy = policy,
                                      .page_tokens = ev->o->page_tokens,
                                      .k_type = k_type,
                                      .v_type = v_type,
                                      .n_threads = ev->o->threads,
                                      .step_tokens = step,
                                      .session = session};
    char err[512];
    engine *e = srv_one_engine(&p, err, sizeof(err));
    if (!e)
        fprintf(stderr, "kvd eval: %s\n", err);
    return e;
}

/* One scoring request on its engine, with the events taken but not yet
 * handed out. */
struct scorer {
    engine *eng;
    struct engine_req *req;
    struct engine_event *pending; /* taken from the engine, in order */
    bool ended;
    char err[640]; /* why it ended early (an ERROR event, or the engine idle) */
    double seconds; /* spent in its engine's steps */
};

/*
 * Submit tokens[0..n) on eng as a scoring request (a session when session
 * is set), wanting the logits `want` says. Returns 0, or -1 with the
 * reason printed (nothing submitted).
 */
static int scorer_open(struct scorer *s, engine *eng, const int32_t *tokens, int n,
                       enum engine_logits want, bool session)
{
    *s = (struct scorer){.eng = eng};
    s->req = engine_req_new(ENGINE_REQ_COMPLETION);
    if (s->req) {
        s->req->prompt = malloc(sizeof(int32_t) * (size_t)n);
        s->req->session = session ? strdup(EVAL_SESSION) : NULL;
    }
    if (!s->req || !s->req->prompt || (session && !s->req->session)) {
        fprintf(stderr, "kvd eval: out of memory\n");
        engine_req_free(s->req);
        s->req = NULL;
        return -1;
    }
    memcpy(s->req->prompt, tokens, sizeof(int32_t) * (size_t)n);
    s->req->n_prompt = n;
    s->req->max_tokens = 0; /* score the prompt, generate nothing */
    s->req->logits = want;
    model_sampling_defaults(&s->req->sampling);
    engine_submit(eng, s->req);
    return 0;
}

/* The next LOGITS event of the request (new, caller frees), stepping its
 * engine as needed; NULL when the request ended first (s->err says why
 * if it failed). */
static struct engine_event *scorer_next(struct scorer *s)
{
    for (;;) {
        while (s->pending) {
            struct engine_event *ev = s->pending;
            s->pending = ev->next;
            ev->next = NULL;
            if (ev->kind == ENGINE_EV_LOGITS)
                return ev;
            if (ev->kind == ENGINE_EV_ERROR)
                snprintf(s->err, sizeof(s->err), "%s", ev->message);
            if (ev->kind == ENGINE_EV_DONE || ev->kind == ENGINE_EV_ERROR)
                s->ended = true;
            engine_event_free(ev);
        }
        if (s->ended)
            return NULL;
        double t0 = seconds_now();
        bool worked = engine_step(s->eng, (uint64_t)(t0 * 1e9));
        s->seconds += seconds_now() - t0;
        s->pending = engine_take_events(s->eng);
        if (!worked && !s->pending) {
            snprintf(s->err, sizeof(s->err), "the engine stopped with the request open");
            s->ended = true;
        }
    }
}

/* Step the request to its end and free it: 0, or -1 when it failed (the
 * reason printed, under `label`). */
static int scorer_close(struct scorer *s, const char *label)
{
    for (struct engine_event *ev; s->req && (ev = scorer_next(s));)
        engine_event_free(ev); /* logits nobody reads: a failed pass */
    int rc = s->err[0] ? -1 : 0;
    if (rc)
        fprintf(stderr, "kvd eval: %s under %s\n", s->err, label);
    engine_req_free(s->req);
    s->req = NULL;
    return rc;
}

/*
 * The logits after retained[0..k) fed fresh at positions 0..k-1 in one
 * forward (the gold standard a cache with eviction approximates), scored
 * for `next`. 0, or -1 (printed).
 */
static int recompute_loss(engine *rc_eng, const int32_t *retained, int k, int32_t next,
                          const struct evaluator *ev, double *loss, double *secs)
{
    struct scorer s;
    if (scorer_open(&s, rc_eng, retained, k, ENGINE_LOGITS_LAST, false))
        return -1;
    struct engine_event *lg = scorer_next(&s);
    if (lg)
        *loss = token_loss(lg->logits, ev->n_vocab, next);
    engine_event_free(lg);
    int rc = scorer_close(&s, "recompute");
    *secs += s.seconds;
    return lg ? rc : -1;
}

/*
 * Stream tokens[0..n) through one session under `policy`, scoring each
 * next token from the logits after it. With --kld-ref, a twin engine in
 * the reference K/V type runs the same request in lockstep and each
 * token's KL(P_ref || P) is kept. If recompute is non-NULL, each next
 * token is also scored by a fresh forward over exactly the tokens the
 * session retains (positions 0..k-1), up to o->recompute_max tokens.
 */
static int run_policy(struct evaluator *ev, const struct kv_policy *policy, const int32_t *tokens,
                      int n, struct eval_run *run, struct eval_run *recompute)
{
    const struct eval_opts *o = ev->o;
    int budget = policy->max_cache_tokens;
    struct kv_policy none = {.kind = KV_EVICT_NONE, .max_cache_tokens = budget};
    engine *main_eng = eval_engine(ev, policy, o->k_type, o->v_type, 1, true);
    engine *twin_eng =
        main_eng && o->kld ? eval_engine(ev, policy, o->kld_type, o->kld_type, 1, true) : NULL;
    engine *rc_eng =
        main_eng && recompute ? eval_engine(ev, &none, o->k_type, o->v_type, budget, false) : NULL;
    struct scorer s = {0}, tw = {0};
    int rc = !main_eng || (o->kld && !twin_eng) || (recompute && !rc_eng) ? -1 : 0;
    if (rc == 0)
        rc = scorer_open(&s, main_eng, tokens, n - 1, ENGINE_LOGITS_EACH, true);
    if (rc == 0 && twin_eng && scorer_open(&tw, twin_eng, tokens, n - 1, ENGINE_LOGITS_EACH, true))
        rc = -1;
    run->has_kld = twin_eng != NULL;
    double t_recompute = 0;
    for (int t = 0; rc == 0 && t < n - 1; t++) {
        struct engine_event *lg = scorer_next(&s);
        struct engine_event *ref = lg && tw.req ? scorer_next(&tw) : NULL;
        if (!lg || (tw.req && !ref)) {
            rc = -1;
        } else {
            run->loss[t + 1] = token_loss(lg->logits, ev->n_vocab, tokens[t + 1]);
            if (ref)
                run->kld[t + 1] = kl_divergence(ref->logits, lg->logits, ev->n_vocab);
        }
        engine_event_free(lg);
        engine_event_free(ref);
        if (rc || !recompute || t + 1 >= o->recompute_max)
            continue;
        int k;
        const int32_t *kept = engine_session_tokens(main_eng, EVAL_SESSION, &k);
        rc = kept ? recompute_loss(rc_eng, kept, k, tokens[t + 1], ev, &recompute->loss[t + 1],
                                   &t_recompute)
                  : -1;
        recompute->n = t + 2;
    }
    if (scorer_close(&s, run->label) || (tw.req && scorer_close(&tw, run->label)))
        rc = -1;
    run->seconds = s.seconds;
    if (recompute)
        recompute->seconds = t_recompute;
    run->n = n;
    if (main_eng) {
        struct engine_stats st;
        engine_get_stats(main_eng, &st);
        run->pages_used = st.kv.pages_used;
        run->evictions = st.kv.evictions;
        run->evicted = st.kv.tokens_evicted;
    }
    engine_destroy(rc_eng);
    engine_destroy(twin_eng);
    engine_destroy(main_eng);
    return rc;
}

/* Independent chunks of train_len tokens, each fed after a fresh BOS: one
 * request per chunk, prompt [BOS, chunk without its last token]. */
static int run_chunked(struct evaluator *ev, const int32_t *tokens, int n, int train_len,
                       struct eval_run *run)
{
    struct kv_policy none = {.kind = KV_EVICT_NONE, .max_cache_tokens = train_len + 1};
    engine *eng = eval_engine(ev, &none, ev->o->k_type, ev->o->v_type, 1, false);
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)(train_len + 1));
    int rc = eng && prompt ? 0 : -1;
    double secs = 0;
    for (int start = 1; rc == 0 && start < n; start += train_len) {
        int end = start + train_len < n ? start + train_len : n;
        prompt[0] = tokens[0];
        memcpy(prompt + 1, tokens + start, sizeof(int32_t) * (size_t)(end - 1 - start));
        struct scorer s;
        if (scorer_open(&s, eng, prompt, end - start, ENGINE_LOGITS_EACH, false)) {
            rc = -1;
            break;
        }
        /* the logits after prompt[p] predict tokens[start + p] */
        for (struct engine_event *lg; (lg = scorer_next(&s)); engine_event_free(lg))
            run->loss[start + lg->position] =
                token_loss(lg->logits, ev->n_vocab, tokens[start + lg->position]);
        rc = scorer_close(&s, run->label);
        secs += s.seconds;
    }
    run->seconds = secs;
    run->n = n;
    free(prompt);
    engine_destroy(eng);
    return rc;
}

/* ------------------------------------------------------------------------
 * Reporting
 * ------------------------------------------------------------------------ */

/* Perplexity over tokens [a, b) of a run (NAN if none scored). */
static double ppl(const struct eval_run *r, int a, int b)
{
    if (a < 1)
        a = 1;
    if (b > r->n)
        b = r->n;
    if (a >= b)
        return NAN;
    double s = 0;
    for (int t = a; t < b; t++)
        s += r->loss[t];
    return exp(s / (b - a));
}

/* Mean KL divergence over tokens [a, b) of a run (NAN without --kld-ref or tokens). */
static double mean_kld(const struct eval_run *r, int a, int b)
{
    if (!r->has_kld)
        return NAN;
    if (a < 1)
        a = 1;
    if (b > r->n)
        b = r->n;
    if (a >= b)
        return NAN;
    double s = 0;
    for (int t = a; t < b; t++)
        s += r->kld[t];
    return s / (b - a);
}

static void segment_bounds(const struct eval_opts *o, int n, int k, int *a, int *b)
{
    *a = k == 0 ? 1 : o->segments[k - 1];
    *b = k < o->n_segments ? o->segments[k] : n;
}

static int n_segments_used(const struct eval_opts *o, int n)
{
    int k = 0;
    while (k < o->n_segments && o->segments[k] < n)
        k++;
    return k + 1; /* the last one runs to n */
}

static void print_table(const struct eval_opts *o, const struct eval_run *runs, int n_runs,
                        int n, int train_len, int ref)
{
    int ns = n_segments_used(o, n);
    printf("\n%-40s", "policy / baseline");
    for (int k = 0; k < ns; k++) {
        int a, b;
        segment_bounds(o, n, k, &a, &b);
        char h[40];
        snprintf(h, sizeof(h), "%s[%d,%d)", a >= 4 * train_len ? ">4x " : a >= 2 * train_len ? ">2x " : "",
                 a, b);
        printf(" %15s", h);
    }
    printf(" %10s %9s %8s %7s %10s", "overall", "tok/s", "vs ref", "pages", "evicted");
    if (o->kld)
        printf(" %12s", "mean KLD");
    printf("\n");
    printf("(>2x, >4x: segments starting at 2 or 4 times the training length, %d)\n", train_len);
    for (int r = 0; r < n_runs; r++) {
        const struct eval_run *run = &runs[r];
        printf("%-40s", run->label);
        for (int k = 0; k < ns; k++) {
            int a, b;
            segment_bounds(o, n, k, &a, &b);
            printf(" %15.3f", ppl(run, a, b));
        }
        double all = ppl(run, 1, run->n);
        /* compare over the tokens both scored (recompute may stop early) */
        int common = ref >= 0 && runs[ref].n < run->n ? runs[ref].n : run->n;
        double ratio = ref >= 0 ? ppl(run, 1, common) / ppl(&runs[ref], 1, common) : NAN;
        printf(" %10.3f %9.1f %8.3f %7d %10llu", all,
               run->seconds > 0 ? (run->n - 1) / run->seconds : 0.0, ratio, run->pages_used,
               (unsigned long long)run->evicted);
        if (o->kld && run->has_kld)
            printf(" %12.3e", mean_kld(run, 1, run->n));
        else if (o->kld)
            printf(" %12s", "-");
        printf("\n");
    }
    if (o->kld)
        printf("mean KLD: KL(P_ref || P) of the next-token distributions against the same run "
               "with K/V in %s (not computed for chunked and recompute)\n",
               kv_type_name(o->kld_type));
    if (ref >= 0)
        printf("vs ref: overall perplexity / that of '%s' over the same tokens\n",
               runs[ref].label);
}

static void print_json(const struct eval_opts *o, const struct eval_run *runs, int n_runs, int n,
                       int train_len)
{
    int ns = n_segments_used(o, n);
    printf("{\"tokens\": %d, \"train_len\": %d, \"runs\": [", n, train_len);
    for (int r = 0; r < n_runs; r++) {
        const struct eval_run *run = &runs[r];
        printf("%s\n  {\"label\": \"%s\", \"perplexity\": %.6f, \"seconds\": %.3f, "
               "\"pages_used\": %d, \"evictions\": %llu, \"tokens_evicted\": %llu, ",
               r ? "," : "", run->label, ppl(run, 1, run->n), run->seconds, run->pages_used,
               (unsigned long long)run->evictions, (unsigned long long)run->evicted);
        if (run->has_kld)
            printf("\"kld_ref\": \"%s\", \"kld_mean\": %.9g, ", kv_type_name(o->kld_type),
                   mean_kld(run, 1, run->n));
        printf("\"segments\": [");
        for (int k = 0; k < ns; k++) {
            int a, b;
            segment_bounds(o, n, k, &a, &b);
            double p = ppl(run, a, b);
            printf("%s{\"from\": %d, \"to\": %d, \"perplexity\": ", k ? ", " : "", a, b);
            printf(isnan(p) ? "null" : "%.6f", p);
            if (run->has_kld) {
                double kl = mean_kld(run, a, b);
                printf(isnan(kl) ? ", \"kld\": null" : ", \"kld\": %.9g", kl);
            }
            printf("}");
        }
        printf("]}");
    }
    printf("\n]}\n");
}

/* Per-token losses: .npy (float32, shape (n,)) or raw little-endian float32. */
static int write_losses(const char *path, const struct eval_run *run)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t plen = strlen(path);
    if (plen > 4 && !strcmp(path + plen - 4, ".npy")) {
        char header[128];
        int hl = snprintf(header, sizeof(header),
                          "{'descr': '<f4', 'fortran_order': False, 'shape': (%d,), }", run->n);
        int total = 10 + hl + 1;
        int pad = (64 - total % 64) % 64;
        fwrite("\x93NUMPY\x01\x00", 1, 8, f);
        unsigned short len = (unsigned short)(hl + pad + 1);
        fputc(len & 0xff, f);
        fputc(len >> 8, f);
        fwrite(header, 1, (size_t)hl, f);
        for (int i = 0; i < pad; i++)
            fputc(' ', f);
        fputc('\n', f);
    }
    for (int t = 0; t < run->n; t++) {
        float v = t == 0 ? NAN : (float)run->loss[t]; /* token 0 (BOS) has no loss */
        fwrite(&v, sizeof(v), 1, f);
    }
    return fclose(f);
}

/* Perplexity of windows of `step` tokens against position, one line each. */
static int write_plot(const char *path, const struct eval_run *runs, int n_runs, int n,
                      int train_len)
{
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g)
        return -1;
    int step = n / 64 > 32 ? n / 64 : 32;
    fprintf(g, "set terminal pngcairo size 1000,600 noenhanced\nset output '%s'\n"
               "set title 'kvd eval: perplexity per %d-token window'\nset xlabel 'position'\n"
               "set ylabel 'perplexity'\nset logscale y\nset grid\nset key left top\n",
            path, step);
    for (int m = 1; m <= 4; m *= 2)
        fprintf(g, "set arrow from %d, graph 0 to %d, graph 1 nohead dt 2\n", m * train_len,
                m * train_len);
    fprintf(g, "plot ");
    for (int r = 0; r < n_runs; r++)
        fprintf(g, "%s'-' using 1:2 with lines title '%s'", r ? ", " : "", runs[r].label);
    fprintf(g, "\n");
    for (int r = 0; r < n_runs; r++) {
        for (int a = 1; a + step <= runs[r].n; a += step)
            fprintf(g, "%d %f\n", a + step / 2, ppl(&runs[r], a, a + step));
        fprintf(g, "e\n");
    }
    return pclose(g) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------ */

/*
 * The scored stream: BOS, then the text's tokens from `start` on (token 0
 * of the encoding is the BOS itself), at most max_tokens in all.
 */
static int32_t *tokenize_file(const model *m, const char *path, int start, int max_tokens,
                              int *n_out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvd eval: cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)size + 1);
    if (!text || fread(text, 1, (size_t)size, f) != (size_t)size) {
        fprintf(stderr, "kvd eval: cannot read %s\n", path);
        free(text);
        fclose(f);
        return NULL;
    }
    fclose(f);
    int n = model_tokenize(m, text, (size_t)size, true, NULL, 0);
    int32_t *tokens = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (tokens)
        n = model_tokenize(m, text, (size_t)size, true, tokens, n);
    free(text);
    if (tokens && start > 1 && start < n) { /* drop text tokens [1, start), keep BOS */
        memmove(tokens + 1, tokens + start, sizeof(int32_t) * (size_t)(n - start));
        n -= start - 1;
    } else if (start >= n) {
        n = 1;
    }
    if (!tokens || n < 2) {
        fprintf(stderr, "kvd eval: %s holds too little text to score\n", path);
        free(tokens);
        return NULL;
    }
    *n_out = max_tokens > 0 && max_tokens < n ? max_tokens : n;
    return tokens;
}

static void describe_path(const struct eval_opts *o, const struct model_info *info, int n,
                          int train_len)
{
    fprintf(stderr,
            "kvd eval: %s (%s, %d layers, %d heads / %d kv heads, head dim %d)\n"
            "attention: fused paged kernel, %s, %d threads, K %s, V %s, position %s, page %d "
            "tokens%s%s%s%s\n"
            "tokens: %d; training length %d (2x = %d, 4x = %d)\n",
            info->name, info->arch, info->n_layer, info->n_head, info->n_kv_head, info->head_dim,
            attn_path_name(info->attn_softcap), cpu_pool_threads(o->threads),
            kv_type_name(o->k_type), kv_type_name(o->v_type), pos_kind_name(info->pos),
            o->page_tokens,
            o->k_type == KV_Q8_0 && info->pos != POS_ROPE ? "; q8_0 key scores: int8 " : "",
            o->k_type == KV_Q8_0 && info->pos != POS_ROPE ? attn_q8_name() : "",
            o->kld ? "; KLD against K/V in " : "", o->kld ? kv_type_name(o->kld_type) : "", n, train_len, 2 * train_len, 4 * train_len);
}

/*
 * --task retrieval: the policies and baselines as rows of the passkey task
 * (eval_retrieval.c), over the --file text's tokens as filler if given.
 */
static int run_retrieval(const struct eval_opts *o, const struct evaluator *ev,
                         const struct model_info *info, const int32_t *tokens, int n,
                         int train_len, int budget)
{
    if (o->kld) {
        fprintf(stderr, "kvd eval: --kld-ref measures perplexity runs; it does not apply to "
                        "--task retrieval\n");
        return 2;
    }
    struct eval_ret_row rows[MAX_POLICIES + MAX_BASELINES];
    char labels[MAX_BASELINES][96];
    int n_rows = 0;
    for (int k = 0; k < o->n_policies; k++)
        rows[n_rows++] = (struct eval_ret_row){o->policies[k].label, o->policies[k].p, 0};
    snprintf(labels[0], sizeof(labels[0]), "chunked (%d)", train_len);
    snprintf(labels[1], sizeof(labels[1]), "recompute (%s)", o->policies[0].label);
    if (o->baseline[BL_DENSE])
        rows[n_rows++] = (struct eval_ret_row){"dense (no eviction)", {.kind = KV_EVICT_NONE}, 1};
    if (o->baseline[BL_CHUNKED])
        rows[n_rows++] = (struct eval_ret_row){labels[0], {.kind = KV_EVICT_NONE}, 2};
    if (o->baseline[BL_RECOMPUTE])
        rows[n_rows++] = (struct eval_ret_row){labels[1], {.kind = KV_EVICT_NONE}, 3};
    int longest = 0;
    for (int k = 0; k < o->ret.n_mult; k++)
        longest = o->ret.mult[k] > longest ? o->ret.mult[k] : longest;
    describe_path(o, info, longest * train_len, train_len);
    struct eval_ret_in in = {
        .m = ev->m, .n_threads = o->threads, .max_batch = budget, .r = &o->ret, .rows = rows,
        .n_rows = n_rows, .train_len = train_len, .page_tokens = o->page_tokens,
        .k_type = o->k_type, .v_type = o->v_type, .text = tokens ? tokens + 1 : NULL, .n_text = tokens ? n - 1 : 0,
        .json = o->json, .plot = o->plot,
    };
    return srv_eval_retrieval(&in);
}

/* The positions the longest run of this evaluation reaches (0 = no bound
 * known): Phi-3's LongRoPE table is chosen by it, once, for every run. */
static int eval_positions(const struct eval_opts *o, int n, int train_len)
{
    int most = o->baseline[BL_DENSE] ? n : 0;
    if (o->baseline[BL_CHUNKED] && (train_len < n ? train_len : n) > most)
        most = train_len < n ? train_len : n;
    for (int k = 0; k < o->n_policies; k++) {
        int b = srv_run_positions(&o->policies[k].p, n);
        if (b == 0)
            return 0;
        most = b > most ? b : most;
    }
    return most;
}

int srv_cmd_eval(int argc, char **argv)
{
    struct eval_opts o;
    bool help = false;
    if (parse_opts(argc, argv, &o, &help))
        return 2;
    if (help) {
        eval_usage(stdout);
        return 0;
    }
    char err[512];
    struct model_params mp = {.path = o.model_path};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "kvd eval: %s\n", err);
        return 1;
    }
    struct model_info info;
    model_get_info(m, &info);
    int train_len = o.train_len ? o.train_len : info.n_ctx_train;
    if (train_len <= 0) {
        fprintf(stderr, "kvd eval: the model has no training length in its metadata; pass "
                        "--train-len\n");
        model_free(m);
        return 2;
    }
    int n = 0;
    int32_t *tokens = o.file ? tokenize_file(m, o.file, o.start, o.max_tokens, &n) : NULL;
    int budget = train_len + 1;
    for (int k = 0; k < o.n_policies; k++)
        if (o.policies[k].p.max_cache_tokens > budget)
            budget = o.policies[k].p.max_cache_tokens;
    struct evaluator ev = {.m = m, .n_vocab = info.n_vocab, .o = &o};
    struct kv_cache_params shape = {.k_type = o.k_type, .v_type = o.v_type};
    model_kv_shape(m, &shape);
    struct kv_cache_params ref_shape = shape;
    ref_shape.k_type = ref_shape.v_type = o.kld ? o.kld_type : KV_F32;
    if (!kv_cache_token_bytes(&shape) || !kv_cache_token_bytes(&ref_shape)) {
        fprintf(stderr,
                "kvd eval: K type %s / V type %s%s%s cannot store head_dim %d (q8_0 and q4_0 "
                "need a multiple of 32)\n",
                kv_type_name(o.k_type), kv_type_name(o.v_type), o.kld ? " / --kld-ref " : "",
                o.kld ? kv_type_name(o.kld_type) : "", info.head_dim);
        free(tokens);
        model_free(m);
        return 2;
    }
    bool text_ok = tokens || (o.ret.on && !o.file);
    int n_ctx = eval_positions(&o, n, train_len);
    model_set_n_ctx(m, n_ctx);
    model_get_info(m, &info);
    srv_rope_note(&info, n_ctx, err, sizeof(err));
    if (err[0])
        fprintf(stderr, "kvd eval: %s\n", err);
    /* A shape the fused kernel cannot take is refused here, once, with the
     * shape named (each pass's engine would refuse it too). */
    ev.ctx = text_ok ? model_ctx_create(m, 1, o.threads, err, sizeof(err)) : NULL;
    struct eval_run runs[MAX_POLICIES + MAX_BASELINES];
    memset(runs, 0, sizeof(runs));
    int n_runs = 0, rc = 0, ref = -1;
    if (!text_ok || !ev.ctx) {
        if (text_ok && !ev.ctx)
            fprintf(stderr, "kvd eval: %s\n", err);
        rc = 1;
        goto out;
    }
    if (o.ret.on) {
        rc = run_retrieval(&o, &ev, &info, tokens, n, train_len, budget);
        goto out;
    }
    describe_path(&o, &info, n, train_len);
    for (int k = 0; k < o.n_policies + MAX_BASELINES; k++) {
        runs[k].loss = calloc((size_t)n, sizeof(double));
        runs[k].kld = calloc((size_t)n, sizeof(double));
        if (!runs[k].loss || !runs[k].kld) {
            rc = 1;
            goto out;
        }
    }
    struct eval_run *rec = NULL;
    for (int k = 0; k < o.n_policies && rc == 0; k++) {
        snprintf(runs[n_runs].label, sizeof(runs[0].label), "%s", o.policies[k].label);
        if (k == 0 && o.baseline[BL_RECOMPUTE]) {
            rec = &runs[o.n_policies];
            snprintf(rec->label, sizeof(rec->label), "recompute (%s)", o.policies[0].label);
        }
        fprintf(stderr, "running %s ...\n", runs[n_runs].label);
        rc = run_policy(&ev, &o.policies[k].p, tokens, n, &runs[n_runs], k == 0 ? rec : NULL);
        n_runs++;
    }
    if (rec) {
        ref = n_runs;
        n_runs++;
    }
    if (rc == 0 && o.baseline[BL_DENSE]) {
        struct kv_policy none = {.kind = KV_EVICT_NONE, .max_cache_tokens = n};
        snprintf(runs[n_runs].label, sizeof(runs[0].label), "dense (no eviction)");
        fprintf(stderr, "running dense ...\n");
        rc = run_policy(&ev, &none, tokens, n, &runs[n_runs++], NULL);
    }
    if (rc == 0 && o.baseline[BL_CHUNKED]) {
        snprintf(runs[n_runs].label, sizeof(runs[0].label), "chunked (%d)", train_len);
        fprintf(stderr, "running chunked ...\n");
        rc = run_chunked(&ev, tokens, n, train_len, &runs[n_runs++]);
    }
    if (rc) {
        rc = 1;
        goto out;
    }
    if (o.json)
        print_json(&o, runs, n_runs, n, train_len);
    else
        print_table(&o, runs, n_runs, n, train_len, ref);
    if (o.losses && write_losses(o.losses, &runs[0])) {
        fprintf(stderr, "kvd eval: cannot write %s\n", o.losses);
        rc = 1;
    }
    if (o.plot) {
        if (write_plot(o.plot, runs, n_runs, n, train_len)) {
            fprintf(stderr, "kvd eval: gnuplot failed (is gnuplot-nox installed?)\n");
            rc = 1;
        } else if (!o.json) {
            printf("plot: %s\n", o.plot);
        }
    }
out:
    for (int k = 0; k < o.n_policies + MAX_BASELINES; k++)
    {
        free(runs[k].loss);
        free(runs[k].kld);
    }
    model_ctx_destroy(ev.ctx);
    free(tokens);
    model_free(m);
    return rc;
}
