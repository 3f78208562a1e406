/*
 * eval_retrieval.c - `kvd eval --task retrieval`: can the model still fetch
 * a fact from far back, under each eviction policy?
 *
 * Perplexity averages over every token, and most tokens are predictable
 * from the last few hundred; a policy that keeps only a recent window
 * scores nearly as well as no eviction at all. Whether the context is
 * *usable* at a length is a different question, asked here the classic
 * way (the "passkey" test): a key of N distinct digits is hidden in
 * filler at a chosen depth,
 *
 *     <s> filler ... the secret code is 8 3 1 4 7 . filler ... the secret code is
 *
 * and the model's greedy continuation must be exactly the key's tokens.
 * Prompts are swept over lengths that are multiples of the training length
 * (1x, 2x, 4x, 8x by default) and over insertion depths (0 = the key first,
 * 0.99 = just before the question), one key per (length, depth, trial),
 * all generated from --seed so every policy and baseline sees the same
 * prompts. The filler is the --file text (tokenized once; each prompt takes
 * a stretch of it from a seeded offset), or, without --file, the model's
 * own word tokens drawn at random (every token that decodes to a space and
 * two or more lowercase letters, minus those of the question and the key).
 *
 * Every policy and baseline of `kvd eval` runs, one row each:
 *   a policy   the prompt is prefilled through one sequence under the
 *              policy (evicting as it goes, as a session in kvd serve),
 *              then the answer is decoded greedily in the same sequence:
 *              one request to the engine kvd serve runs (engine/engine.h);
 *   dense      the same with no eviction;
 *   chunked    only the last training-length chunk of the prompt, after a
 *              fresh BOS (what a model limited to its training length sees);
 *   recompute  a fresh forward over exactly the tokens the first policy
 *              retained after the prompt, at positions 0..n-1, then greedy.
 *              The first policy's row prefills its prompt into a session
 *              and decodes the answer on a fork of it (fork_answer), dropped
 *              at the end: an answer's appends evict and cannot be undone,
 *              so without the fork the retained prompt would need a second
 *              prefill; with it, the session holds exactly what the prompt
 *              left, and the answer scored is the one the sequence gives.
 *
 * Output: accuracy per row and length (table or JSON, with every case's
 * distance), and with --plot a PNG of accuracy against the key's distance.
 * The attention path is printed first by cmd_eval.c, as for perplexity.
 */
#include "cli/eval_retrieval.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_internal.h"
#include "config/args.h"
#include "engine/engine.h"

#define QUESTION "the secret code is"

const char srv_eval_ret_usage[] =
    "  --task retrieval     the passkey task instead of perplexity (--file optional:\n"
    "                       the filler text; default the model's own words)\n"
    "  --lengths A,B,...    prompt lengths in training lengths (default 1,2,4,8)\n"
    "  --depths A,B,...     key positions in the filler, 0..1 (default 0,0.5,0.9,0.99)\n"
    "  --key-len N          distinct digits in the key, 1..10 (default 5)\n"
    "  --trials N           keys per length and depth (default 1)\n"
    "  --seed S             keys and filler (default 1)\n";

void srv_eval_ret_defaults(struct eval_ret_opts *r)
{
    *r = (struct eval_ret_opts){.mult = {1, 2, 4, 8},
                                .n_mult = 4,
                                .depth = {0, 0.5, 0.9, 0.99},
                                .n_depth = 4,
                                .key_len = 5,
                                .trials = 1,
                                .seed = 1};
}

/* A comma list of numbers in [lo, hi], at most EVAL_RET_MAX. -1 if bad. */
static int parse_list(const char *s, double lo, double hi, double *out)
{
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", s);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == EVAL_RET_MAX || srv_parse_double(t, lo, hi, &out[n]))
            return -1;
        n++;
    }
    return n ? n : -1;
}

bool srv_eval_ret_opt(int argc, char **argv, int *i, struct eval_ret_opts *r, bool *bad)
{
    const char *v = NULL;
    long n;
    double x[EVAL_RET_MAX];
    int k;
#define OPT(name) srv_opt_value(argc, argv, i, "eval", name, &v, bad)
#define FAIL(what)                                                                                 \
    do {                                                                                           \
        fprintf(stderr, "kvd eval: invalid value for %s: '%s'\n", what, v ? v : "");               \
        *bad = true;                                                                               \
        return true;                                                                               \
    } while (0)
    if (OPT("--task")) {
        if (!*bad && strcmp(v, "retrieval") && strcmp(v, "perplexity"))
            FAIL("--task (retrieval|perplexity)");
        r->on = !*bad && !strcmp(v, "retrieval");
    } else if (OPT("--lengths")) {
        if (*bad || (k = parse_list(v, 1, 1024, x)) < 0)
            FAIL("--lengths (multiples of the training length, e.g. 1,2,4,8)");
        for (r->n_mult = 0; r->n_mult < k; r->n_mult++) {
            r->mult[r->n_mult] = (int)x[r->n_mult];
            if (r->mult[r->n_mult] != x[r->n_mult])
                FAIL("--lengths (whole multiples)");
        }
    } else if (OPT("--depths")) {
        if (*bad || (k = parse_list(v, 0, 1, x)) < 0)
            FAIL("--depths (fractions in [0, 1], e.g. 0,0.5,0.9)");
        memcpy(r->depth, x, sizeof(double) * (size_t)k);
        r->n_depth = k;
    } else if (OPT("--key-len")) {
        if (*bad || srv_parse_long(v, 1, 10, &n))
            FAIL("--key-len (1..10)");
        r->key_len = (int)n;
    } else if (OPT("--trials")) {
        if (*bad || srv_parse_long(v, 1, 1000, &n))
            FAIL("--trials (1..1000)");
        r->trials = (int)n;
    } else if (OPT("--seed")) {
        char *end;
        if (*bad || !*v || *v == '-' || ((void)(r->seed = strtoull(v, &end, 10)), *end))
            FAIL("--seed (a non-negative integer)");
    } else {
        return false;
    }
    return true;
#undef OPT
#undef FAIL
}

/* ------------------------------------------------------------------------
 * Prompts
 * ------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

struct ids {
    int32_t *v;
    int n;
};

/* Tokenize text without BOS into a new array. 0 or -1. */
static int tokenize(const model *m, const char *text, struct ids *out)
{
    int n = model_tokenize(m, text, strlen(text), false, NULL, 0);
    out->v = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    out->n = out->v ? model_tokenize(m, text, strlen(text), false, out->v, n) : -1;
    return out->n > 0 ? 0 : -1;
}

static bool ids_has(const struct ids *a, int32_t t)
{
    for (int i = 0; i < a->n; i++)
        if (a->v[i] == t)
            return true;
    return false;
}

/* The model's word tokens: text " " + >= 2 lowercase letters, not in the
 * question or any digit key. */
static int own_words(const model *m, const struct ids *question, struct ids *out)
{
    struct model_info info;
    model_get_info(m, &info);
    out->v = malloc(sizeof(int32_t) * (size_t)info.n_vocab);
    out->n = 0;
    struct ids digits, lead;
    if (!out->v || tokenize(m, "0 1 2 3 4 5 6 7 8 9", &digits) || tokenize(m, "a", &lead))
        return -1;
    for (int32_t t = 0; t < info.n_vocab; t++) {
        /* after another token, so the detokenizer keeps a leading space */
        model_detok *d = model_detok_create(m);
        char s[64];
        int n = d ? model_detok_push(d, lead.v[0], s, sizeof(s) - 1) : -1;
        n = n >= 0 ? model_detok_push(d, t, s, sizeof(s) - 1) : -1;
        model_detok_destroy(d);
        bool word = n >= 3 && s[0] == ' ';
        for (int k = 1; word && k < n; k++)
            word = s[k] >= 'a' && s[k] <= 'z';
        if (word && !ids_has(question, t) && !ids_has(&digits, t))
            out->v[out->n++] = t;
    }
    free(digits.v);
    free(lead.v);
    return out->n ? 0 : -1;
}

/* Everything fixed across prompts. */
struct task {
    const struct eval_ret_in *in;
    struct ids question, sep, words; /* words: own filler (when no text) */
    int32_t bos;
    struct ids kept; /* the tokens row 0's policy retained after this prompt (kept.v
                        NULL: not known yet), for the recompute row */
};

/* n filler tokens into out: a stretch of the text from a seeded offset
 * (wrapping), or seeded draws from the model's words. */
static void filler(const struct task *tk, int32_t *out, int n, uint64_t *rng)
{
    const struct eval_ret_in *in = tk->in;
    if (in->text) {
        int at = (int)(rng_next(rng) % (uint64_t)in->n_text);
        for (int i = 0; i < n; i++)
            out[i] = in->text[(at + i) % in->n_text];
    } else {
        for (int i = 0; i < n; i++)
            out[i] = tk->words.v[rng_next(rng) % (uint64_t)tk->words.n];
    }
}

/* One case: the prompt, the key's tokens, the key's distance from the end. */
struct prompt {
    int32_t *tok;
    int n;
    struct ids key;
    int distance;
};

/*
 * The prompt of `len` tokens with the key at `depth` of the filler, from
 * the case's own seed. 0, or -1 (out of memory, or len too short to hold
 * the question twice and the key).
 */
static int make_prompt(const struct task *tk, int len, double depth, uint64_t seed,
                       struct prompt *p)
{
    const struct eval_ret_in *in = tk->in;
    uint64_t rng = seed;
    char text[32];
    int used = 0, o = 0;
    for (int k = 0; k < in->r->key_len; k++) {
        int d;
        do
            d = (int)(rng_next(&rng) % 10);
        while (used & (1 << d));
        used |= 1 << d;
        o += snprintf(text + o, sizeof(text) - (size_t)o, "%s%d", k ? " " : "", d);
    }
    memset(p, 0, sizeof(*p));
    if (tokenize(in->m, text, &p->key))
        return -1;
    int fixed = 1 + 2 * tk->question.n + p->key.n + tk->sep.n;
    int room = len - fixed;
    p->tok = room >= 0 ? malloc(sizeof(int32_t) * (size_t)len) : NULL;
    if (!p->tok)
        return -1;
    int fa = (int)lround(depth * room), n = 0;
    p->tok[n++] = tk->bos;
    filler(tk, p->tok + n, fa, &rng);
    n += fa;
    memcpy(p->tok + n, tk->question.v, sizeof(int32_t) * (size_t)tk->question.n);
    n += tk->question.n;
    p->distance = len - n;
    memcpy(p->tok + n, p->key.v, sizeof(int32_t) * (size_t)p->key.n);
    n += p->key.n;
    memcpy(p->tok + n, tk->sep.v, sizeof(int32_t) * (size_t)tk->sep.n);
    n += tk->sep.n;
    filler(tk, p->tok + n, room - fa, &rng);
    n += room - fa;
    memcpy(p->tok + n, tk->question.v, sizeof(int32_t) * (size_t)tk->question.n);
    p->n = n + tk->question.n;
    return 0;
}

/* ------------------------------------------------------------------------
 * Runs: each case is a request to the engine `kvd serve` runs
 * (engine/engine.h), on an engine whose pool holds one sequence at the
 * row's budget and whose steps take up to max_batch tokens (the prompt is
 * prefilled in chunks, evicting as it goes, as a session's would be)
 * ------------------------------------------------------------------------ */

/* What one request on an engine gave: its generated ids, its usage, the
 * tokens its session retains (when it ran as a session). */
struct outcome {
    int32_t ids[16]; /* generated (the key is at most 10 digits) */
    int n_ids;
    struct engine_usage usage;
};

/* An engine for a sequence under policy, room for its budget. */
static engine *case_engine(const struct eval_ret_in *in, const struct kv_policy *policy,
                           bool session)
{
    struct srv_one_engine_params p = {.m = in->m,
                                      .policy = policy,
                                      .page_tokens = in->page_tokens,
                                      .k_type = in->k_type,
                                      .v_type = in->v_type,
                                      .n_threads = in->n_threads,
                                      .step_tokens = in->max_batch,
                                      .session = session};
    char err[512];
    engine *e = srv_one_engine(&p, err, sizeof(err));
    if (!e)
        fprintf(stderr, "kvd eval: %s\n", err);
    return e;
}

/*
 * Prefill tok[0..n) on eng and generate up to max_tokens greedily (a
 * session when `session`); what came back in out. 0, or -1 with the reason
 * printed.
 */
static int run_request(engine *eng, const int32_t *tok, int n, int max_tokens, bool session,
                       bool fork, struct outcome *out)
{
    *out = (struct outcome){0};
    struct engine_req *req = engine_req_new(ENGINE_REQ_COMPLETION);
    if (req) {
        req->prompt = malloc(sizeof(int32_t) * (size_t)n);
        req->session = session ? strdup("retrieval") : NULL;
    }
    if (!req || !req->prompt || (session && !req->session)) {
        fprintf(stderr, "kvd eval: out of memory\n");
        engine_req_free(req);
        return -1;
    }
    memcpy(req->prompt, tok, sizeof(int32_t) * (size_t)n);
    req->n_prompt = n;
    req->max_tokens = max_tokens;
    req->want_tokens = true;
    req->fork_answer = fork;
    model_sampling_defaults(&req->sampling);
    req->sampling.temperature = 0; /* greedy: the most likely token, the lower id on ties */
    engine_submit(eng, req);
    int rc = 1; /* until the final event */
    while (rc == 1) {
        bool worked = engine_step(eng, 0);
        struct engine_event *ev = engine_take_events(eng), *next;
        if (!worked && !ev) {
            fprintf(stderr, "kvd eval: the engine stopped with the request open\n");
            rc = -1;
        }
        for (; ev; ev = next) {
            next = ev->next;
            for (int i = 0; i < ev->n_tokens && out->n_ids < 16; i++)
                out->ids[out->n_ids++] = ev->tokens[i];
            if (ev->kind == ENGINE_EV_DONE) {
                out->usage = ev->usage;
                rc = 0;
            } else if (ev->kind == ENGINE_EV_ERROR) {
                fprintf(stderr, "kvd eval: %s\n", ev->message);
                rc = -1;
            }
            engine_event_free(ev);
        }
    }
    engine_req_free(req);
    return rc;
}

/*
 * Prefill tok[0..n) under policy (none: dense), answer greedily: whether
 * the continuation is exactly the key. With kept (row 0, when the recompute
 * row follows), the prompt goes into a session and the answer is decoded
 * on a fork of it (fork_answer), dropped at the end: the answer is the one
 * the sequence itself gives, and the session then holds exactly what the
 * prompt left, whatever the answer evicted; its tokens go to *kept (new).
 */
static int run_tokens(const struct eval_ret_in *in, const struct kv_policy *policy,
                      const int32_t *tok, int n, const struct ids *key, bool *correct,
                      uint64_t *evicted, struct ids *kept)
{
    struct kv_policy dense = {.kind = KV_EVICT_NONE, .max_cache_tokens = n + key->n + 1};
    const struct kv_policy *p = policy->kind == KV_EVICT_NONE ? &dense : policy;
    engine *eng = case_engine(in, p, kept != NULL);
    struct outcome out;
    int rc = eng ? run_request(eng, tok, n, key->n, kept != NULL, kept != NULL, &out) : -1;
    if (!rc && kept) {
        int n_kept = 0;
        const int32_t *t = engine_session_tokens(eng, "retrieval", &n_kept);
        kept->v = t ? malloc(sizeof(int32_t) * (size_t)(n_kept > 0 ? n_kept : 1)) : NULL;
        if (!kept->v)
            rc = -1;
        else
            memcpy(kept->v, t, sizeof(int32_t) * (size_t)n_kept);
        kept->n = n_kept;
    }
    engine_destroy(eng);
    if (rc)
        return rc;
    *correct = out.n_ids == key->n && !memcmp(out.ids, key->v, sizeof(int32_t) * (size_t)key->n);
    *evicted += (uint64_t)out.usage.evicted_tokens;
    return 0;
}

/* Whether the rows have the recompute baseline. */
static bool has_recompute(const struct eval_ret_in *in)
{
    for (int row = 0; row < in->n_rows; row++)
        if (in->rows[row].baseline == 3)
            return true;
    return false;
}

/* Row `row` on prompt p (rows in order: row 0 first). */
static int run_case(struct task *tk, int row, const struct prompt *p, bool *correct,
                    uint64_t *evicted)
{
    const struct eval_ret_in *in = tk->in;
    const struct eval_ret_row *rw = &in->rows[row];
    if (rw->baseline == 2) { /* chunked: BOS + the last train_len - 1 tokens */
        int keep = p->n < in->train_len ? p->n - 1 : in->train_len - 1;
        int32_t *t = malloc(sizeof(int32_t) * (size_t)(keep + 1));
        if (!t)
            return -1;
        t[0] = tk->bos;
        memcpy(t + 1, p->tok + p->n - keep, sizeof(int32_t) * (size_t)keep);
        struct kv_policy none = {.kind = KV_EVICT_NONE};
        int rc = run_tokens(in, &none, t, keep + 1, &p->key, correct, evicted, NULL);
        free(t);
        return rc;
    }
    if (rw->baseline == 3) { /* recompute: what row 0's policy retained, fresh */
        struct kv_policy none = {.kind = KV_EVICT_NONE};
        if (tk->kept.v) /* row 0 left it (its answer on a fork) */
            return run_tokens(in, &none, tk->kept.v, tk->kept.n, &p->key, correct, evicted, NULL);
        engine *eng = case_engine(in, &in->rows[0].policy, true); /* row 0 is a baseline */
        struct outcome out;
        int rc = eng ? run_request(eng, p->tok, p->n, 0, true, false, &out) : -1;
        int n_kept = 0;
        const int32_t *kept = rc ? NULL : engine_session_tokens(eng, "retrieval", &n_kept);
        if (kept)
            rc = run_tokens(in, &none, kept, n_kept, &p->key, correct, evicted, NULL);
        engine_destroy(eng);
        return kept ? rc : -1;
    }
    bool keep = row == 0 && has_recompute(in);
    return run_tokens(in, &rw->policy, p->tok, p->n, &p->key, correct, evicted,
                      keep ? &tk->kept : NULL);
}

/* ------------------------------------------------------------------------
 * Results
 * ------------------------------------------------------------------------ */

struct results {
    int n_rows, n_mult, n_depth, trials;
    int *correct;      /* [row][mult][depth] keys retrieved */
    int *distance;     /* [mult][depth] mean distance of the key from the end */
    int *len;          /* [mult] prompt tokens */
    uint64_t *evicted; /* [row] tokens evicted, all cases */
};

static int *cell(const struct results *s, int row, int mi, int di)
{
    return &s->correct[(row * s->n_mult + mi) * s->n_depth + di];
}

static void print_table(const struct eval_ret_in *in, const struct results *s)
{
    const struct eval_ret_opts *r = in->r;
    printf("\nretrieval: %d-digit keys, %d per length (%d depths x %d trials); exact match of "
           "the greedy continuation\n",
           r->key_len, r->trials * r->n_depth, r->n_depth, r->trials);
    printf("%-40s", "policy / baseline");
    for (int mi = 0; mi < s->n_mult; mi++) {
        char h[32];
        snprintf(h, sizeof(h), "%dx (%d)", r->mult[mi], s->len[mi]);
        printf(" %14s", h);
    }
    printf(" %9s %10s\n", "overall", "evicted");
    for (int row = 0; row < s->n_rows; row++) {
        printf("%-40s", in->rows[row].label);
        int all = 0;
        for (int mi = 0; mi < s->n_mult; mi++) {
            int c = 0;
            for (int di = 0; di < s->n_depth; di++)
                c += *cell(s, row, mi, di);
            all += c;
            char h[32];
            snprintf(h, sizeof(h), "%d/%d", c, s->n_depth * s->trials);
            printf(" %14s", h);
        }
        printf(" %8.0f%% %10llu\n", 100.0 * all / (s->n_mult * s->n_depth * s->trials),
               (unsigned long long)s->evicted[row]);
    }
    printf("by depth (key distance from the end, tokens), 1 = retrieved:\n");
    for (int row = 0; row < s->n_rows; row++) {
        printf("  %-38s", in->rows[row].label);
        for (int mi = 0; mi < s->n_mult; mi++) {
            printf(" ");
            for (int di = 0; di < s->n_depth; di++)
                printf("%d", *cell(s, row, mi, di));
        }
        printf("\n");
    }
    printf("  %-38s", "depths");
    for (int di = 0; di < s->n_depth; di++)
        printf(" %g", r->depth[di]);
    printf("; distances");
    for (int mi = 0; mi < s->n_mult; mi++) {
        printf(" %dx:", r->mult[mi]);
        for (int di = 0; di < s->n_depth; di++)
            printf("%s%d", di ? "," : "", s->distance[mi * s->n_depth + di]);
    }
    printf("\n");
}

static void print_json(const struct eval_ret_in *in, const struct results *s)
{
    const struct eval_ret_opts *r = in->r;
    printf("{\"task\": \"retrieval\", \"train_len\": %d, \"key_len\": %d, \"trials\": %d, "
           "\"seed\": %llu, \"runs\": [",
           in->train_len, r->key_len, r->trials, (unsigned long long)r->seed);
    for (int row = 0; row < s->n_rows; row++) {
        int all = 0;
        for (int mi = 0; mi < s->n_mult; mi++)
            for (int di = 0; di < s->n_depth; di++)
                all += *cell(s, row, mi, di);
        printf("%s\n  {\"label\": \"%s\", \"accuracy\": %.4f, \"tokens_evicted\": %llu, "
               "\"cases\": [",
               row ? "," : "", in->rows[row].label,
               (double)all / (s->n_mult * s->n_depth * s->trials),
               (unsigned long long)s->evicted[row]);
        for (int mi = 0; mi < s->n_mult; mi++)
            for (int di = 0; di < s->n_depth; di++)
                printf("%s{\"multiple\": %d, \"tokens\": %d, \"depth\": %g, \"distance\": %d, "
                       "\"correct\": %d, \"trials\": %d}",
                       mi || di ? ", " : "", r->mult[mi], s->len[mi], r->depth[di],
                       s->distance[mi * s->n_depth + di], *cell(s, row, mi, di), s->trials);
        printf("]}");
    }
    printf("\n]}\n");
}

/* Accuracy against distance, one line per row, points sorted by distance. */
static int write_plot(const struct eval_ret_in *in, const struct results *s)
{
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g)
        return -1;
    fprintf(g,
            "set terminal pngcairo size 1000,600 noenhanced\nset output '%s'\n"
            "set title 'kvd eval --task retrieval: %d-digit key, exact match'\n"
            "set xlabel 'distance of the key from the question (tokens)'\n"
            "set ylabel 'accuracy (%%)'\nset logscale x\nset yrange [-5:105]\nset grid\n"
            "set key outside right\n",
            in->plot, in->r->key_len);
    for (int mi = 0; mi < s->n_mult; mi++)
        fprintf(g, "set arrow from %d, graph 0 to %d, graph 1 nohead dt 2\n",
                in->r->mult[mi] * in->train_len, in->r->mult[mi] * in->train_len);
    fprintf(g, "plot ");
    for (int row = 0; row < s->n_rows; row++)
        fprintf(g, "%s'-' using 1:2 with linespoints title '%s'", row ? ", " : "",
                in->rows[row].label);
    fprintf(g, "\n");
    int n = s->n_mult * s->n_depth;
    for (int row = 0; row < s->n_rows; row++) {
        int last = 0;
        for (int k = 0; k < n; k++) { /* ascending distance, selection by minimum */
            int best = -1;
            for (int j = 0; j < n; j++)
                if (s->distance[j] > last && (best < 0 || s->distance[j] < s->distance[best]))
                    best = j;
            if (best < 0)
                break;
            last = s->distance[best];
            fprintf(g, "%d %.1f\n", last,
                    100.0 * *cell(s, row, best / s->n_depth, best % s->n_depth) / s->trials);
        }
        fprintf(g, "e\n");
    }
    return pclose(g) == 0 ? 0 : -1;
}

/* ------------------------------------------------------------------------ */

static int setup(const struct eval_ret_in *in, struct task *tk)
{
    memset(tk, 0, sizeof(*tk));
    tk->in = in;
    tk->bos = model_bos(in->m);
    if (tokenize(in->m, QUESTION, &tk->question) || tokenize(in->m, ".", &tk->sep)) {
        fprintf(stderr, "kvd eval: the model cannot tokenize the question '%s'\n", QUESTION);
        return -1;
    }
    if (!in->text && own_words(in->m, &tk->question, &tk->words)) {
        fprintf(stderr, "kvd eval: the model has no word tokens for filler; pass --file\n");
        return -1;
    }
    return 0;
}

int srv_eval_retrieval(const struct eval_ret_in *in)
{
    const struct eval_ret_opts *r = in->r;
    struct model_info info;
    model_get_info(in->m, &info);
    struct task tk;
    struct results s = {
        .n_rows = in->n_rows, .n_mult = r->n_mult, .n_depth = r->n_depth, .trials = r->trials};
    s.correct = calloc((size_t)(s.n_rows * s.n_mult * s.n_depth), sizeof(int));
    s.distance = calloc((size_t)(s.n_mult * s.n_depth), sizeof(int));
    s.len = calloc((size_t)s.n_mult, sizeof(int));
    s.evicted = calloc((size_t)s.n_rows, sizeof(uint64_t));
    int rc = setup(in, &tk);
    if (!s.correct || !s.distance || !s.len || !s.evicted)
        rc = -1;
    for (int mi = 0; mi < r->n_mult && !rc; mi++) {
        s.len[mi] = r->mult[mi] * in->train_len;
        for (int di = 0; di < r->n_depth && !rc; di++) {
            double dist = 0;
            for (int t = 0; t < r->trials && !rc; t++) {
                struct prompt p;
                uint64_t seed = r->seed * 1000003ULL + (uint64_t)((mi * 64 + di) * 4096 + t);
                if (make_prompt(&tk, s.len[mi], r->depth[di], seed, &p)) {
                    fprintf(stderr, "kvd eval: cannot build a %d-token prompt\n", s.len[mi]);
                    rc = -1;
                    break;
                }
                dist += p.distance;
                for (int row = 0; row < in->n_rows && !rc; row++) {
                    bool ok = false;
                    rc = run_case(&tk, row, &p, &ok, &s.evicted[row]);
                    *cell(&s, row, mi, di) += ok;
                }
                free(p.tok);
                free(p.key.v);
                free(tk.kept.v);
                tk.kept = (struct ids){0};
            }
            s.distance[mi * r->n_depth + di] = (int)lround(dist / r->trials);
            fprintf(stderr, "retrieval: %dx (%d tokens), depth %g done\n", r->mult[mi], s.len[mi],
                    r->depth[di]);
        }
    }
    if (!rc) {
        if (in->json)
            print_json(in, &s);
        else
            print_table(in, &s);
        if (in->plot && write_plot(in, &s)) {
            fprintf(stderr, "kvd eval: gnuplot failed (is gnuplot-nox installed?)\n");
            rc = -1;
        } else if (in->plot && !in->json) {
            printf("plot: %s\n", in->plot);
        }
    }
    free(tk.question.v);
    free(tk.sep.v);
    free(tk.words.v);
    free(s.correct);
    free(s.distance);
    free(s.len);
    free(s.evicted);
    return rc ? 1 : 0;
}
