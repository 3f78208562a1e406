/*
 * pace.c - step pacing: a step's time learned from the steps run, and
 * prompt chunks sized to a time budget (stall-free batching).
 *
 * Why a time budget. A step holds one decode token for every stream that
 * is generating and, in what is left of step_tokens, chunks of prompts
 * still being read. Every stream waits for the whole step before its next
 * token, so a step carrying a 512-token chunk of a long prompt stalls all
 * of them for as long as that chunk takes: ITL p99 many times its p50.
 * Sarathi-Serve's answer is to bound the step's time instead of (as well
 * as) its tokens: prompt chunks shrink to what fits the budget while
 * decodes wait, so a stream's next token comes at most one budget late;
 * and when nobody is decoding, chunks grow back to the token budget,
 * where the weight matmuls read a prompt fastest.
 *
 * Why a fitted model and not a fixed tokens-per-second. A chunk's cost is
 * not proportional to its tokens: the weight matmuls cost per token (once
 * the batch is compute-bound) while attention costs per query-key pair,
 * which grows with the context the chunk sits after; a chunk at 16k costs
 * several times one at 512. And a step of one decode token costs about
 * what reading the weights costs, whatever it holds. So a step is
 * c_step + c_token * tokens + c_pair * pairs (pace.h), fitted by least
 * squares over the steps run, on their measured times.
 *
 * The fit. Each step observed adds w*x*x' and w*x*t to decayed sums, x =
 * (1, tokens, pairs) scaled to similar magnitudes, t its seconds; older
 * steps weigh DECAY less per newer step of their kind (steps with prompt
 * chunks and decode-only steps decay separately, so a long run of decodes
 * keeps what prefill was seen to cost, and a machine whose speed changes,
 * because of load or context, is followed within tens of steps). The
 * coefficients are the least-squares solution with none below zero: with
 * three unknowns every subset of them is solved and the one with the least
 * residual kept (ties go to the earlier subset of SUBSETS). Early on, when
 * the steps seen cannot tell the terms apart (one step; only one chunk
 * size), the full system is singular and a smaller subset answers: one
 * step alone gives a cost proportional to tokens, the safe guess.
 *
 * Why chunks have a least size too. A step costs c_step whatever it holds
 * (the weights read once, the threads' fork and join), so a chunk cut to
 * fit the budget beside the decodes pays that fixed part over fewer
 * tokens; when the decodes alone take about the budget or more (many
 * streams, long contexts, a slow model, cores shared with other work) the
 * chunk is cut to the floor, prompts are read a page per step at a
 * fraction of their speed and throughput and time to first token fall
 * with them. So the step's first chunk is also at least the smallest one
 * that, charged with the step's fixed cost, reads its prompt at
 * PACE_EFFICIENCY of the rate of the whole chunk the token budget allows,
 * as far as the step stays within PACE_STRETCH times what its decodes
 * alone take: prefill then gets up to as much of the step as the decodes
 * do. While the decodes are cheap against the budget (under half of it)
 * that bound is below the budget and nothing changes: the budget alone
 * decides, and the decoding streams keep their preference. Decode work is
 * not charged to the chunk: it is done in every step whatever the chunk.
 *
 * Why not stretch steps past the budget when decodes are cheap, for the
 * same efficiency? Measured under kvd load (two streams, 4,096-token
 * prompts): a chunk step pays ~20-25 ms fixed beside ~18 ms decode-only
 * steps, and chunks stretched to 95% efficiency (steps of ~200 ms) read
 * the prompt in a third of the steps, so the decoding stream outlives it
 * and most of its tokens come from 18 ms decode-only steps: throughput
 * came back to the unbudgeted scheduler's, but ITL p99/p50 went to ~10.
 * Evenly spaced tokens need the prompt's reading to span the stream's
 * decoding, which is what the budget's chunks do.
 *
 * The fixed cost charged (and counted in the decodes' time for the
 * stretch) is c_step, but never more than decode-only steps were seen to
 * take, and nothing before any was seen: a run of equal chunks (a prompt
 * read alone, 512 at a time) cannot tell c_step from c_token, and the fit
 * then lays their whole cost on c_step (measured: 100 ms of a 225 ms
 * step), by which the decodes would look slow and only whole chunks
 * efficient, stretching steps for nothing.
 *
 * Why the budget follows the decodes. A fixed budget suits one machine
 * state only. On a quiet machine a 100 ms budget is ten decode-only steps
 * (one stream at 4k: ~10 ms): a prompt read beside a stream is done before
 * the stream is, the stream's later tokens come from decode-only steps,
 * and ITL p99 is the budget while p50 is a decode step (measured: p99/p50
 * 6.7-8.2); 50 ms gave 1.2-1.3. Under load decode steps slow down and a
 * 100 ms budget is what keeps chunks worth their step. So once decodes
 * have been timed alone, the budget is PACE_BUDGET_DECODES times what the
 * decode-only fit (their own least squares, a fixed part preferred: a few
 * decode tokens cost mostly the weights' one read) gives for the step's
 * decodes, never above the configured budget (the operator's bound) and
 * never below PACE_BUDGET_FLOOR_S.
 *
 * Why 2.5. A stream's ITL is a decode-only step at best and a budgeted
 * step at worst, so p99/p50 is at most about the factor times how far
 * steps overrun their prediction (1.2-1.3x at p90 measured at ~25 ms
 * steps). In itl_load at load 2-4, 2.5 gave p99/p50 1.4-3.2 (median 1.7
 * over 7 runs) and 3.0 gave 1.5-3.6, at throughputs within noise of each
 * other; a smaller factor leaves a prompt little more than the page floor
 * beside one decode at 4k (2.5 gives chunks of 16-40 tokens there). Why
 * the floor: below ~20 ms a step's fixed part outweighs the latency saved
 * (a chunk step costs ~5 ms more than its decodes alone), and tokens 20 ms
 * apart are not felt as waiting.
 *
 * Why probe. Decode-only steps are rare while prompts arrive: with two
 * streams, the first decode-only step came only after the second prompt
 * was read, the first ~40 steps ran at the configured budget and set ITL
 * p99 (p99/p50 5-7 in itl_load). So a step with decodes carries no prompt
 * chunk when the decodes have not been timed alone yet, or not for
 * PACE_PROBE_STEPS steps (load changes): it costs the waiting prompt one
 * decode step and gives the budget a measurement. A pace whose
 * coefficients were set (tests, benchmarks) never probes.
 *
 * Batch invariance. Chunk sizes change only how a prompt is cut across
 * steps; the forward pass gives the same bits for a token whatever its
 * chunk (test_engine checks a paced run against an unpaced one).
 */
#include <math.h>
#include <string.h>

#include "engine/pace.h"

/* Weight of an observation per newer step of its kind. */
#define DECAY 0.9
/* Feature scales: tokens and pairs in units that keep the normal
 * equations well conditioned at every batch size and context. */
#define TOKEN_UNIT 256.0
#define PAIR_UNIT 1048576.0

struct pace_work pace_chunk_work(int n, int context)
{
    double dn = n, dl = context;
    return (struct pace_work){.tokens = dn, .pairs = dn * dl + dn * (dn + 1) / 2};
}

static void features(const struct pace_work *w, double x[3])
{
    x[0] = 1.0;
    x[1] = w->tokens / TOKEN_UNIT;
    x[2] = w->pairs / PAIR_UNIT;
}

/* Dot product of coefficients and a work's features: predicted seconds. */
static double predict_by(const double coef[3], const struct pace_work *w)
{
    double x[3];
    features(w, x);
    return coef[0] * x[0] + coef[1] * x[1] + coef[2] * x[2];
}

/* Solve the normal equations restricted to the features in mask (bit i =
 * feature i) by Gaussian elimination with partial pivoting. False when
 * singular (a pivot below 1e-12 of the diagonal's largest) or a
 * coefficient comes out negative. c[i] = 0 outside the mask. */
static bool solve_subset(const struct pace_sums *s, unsigned mask, double c[3])
{
    int idx[3], k = 0;
    for (int i = 0; i < 3; i++)
        if (mask & (1u << i))
            idx[k++] = i;
    double a[3][4], big = 0;
    for (int i = 0; i < k; i++) {
        for (int j = 0; j < k; j++)
            a[i][j] = s->xx[idx[i]][idx[j]];
        a[i][k] = s->xt[idx[i]];
        big = fmax(big, fabs(a[i][i]));
    }
    if (big <= 0)
        return false;
    for (int col = 0; col < k; col++) {
        int piv = col;
        for (int i = col + 1; i < k; i++)
            if (fabs(a[i][col]) > fabs(a[piv][col]))
                piv = i;
        if (fabs(a[piv][col]) <= 1e-12 * big)
            return false;
        for (int j = 0; j <= k; j++) {
            double tmp = a[col][j];
            a[col][j] = a[piv][j];
            a[piv][j] = tmp;
        }
        for (int i = 0; i < k; i++) {
            if (i == col)
                continue;
            double f = a[i][col] / a[col][col];
            for (int j = col; j <= k; j++)
                a[i][j] -= f * a[col][j];
        }
    }
    memset(c, 0, 3 * sizeof(double));
    for (int i = 0; i < k; i++) {
        c[idx[i]] = a[i][k] / a[i][i];
        if (c[idx[i]] < 0)
            return false;
    }
    return true;
}

/* Residual sum of squares of coefficients c over the sums. */
static double residual(const struct pace_sums *s, const double c[3])
{
    double r = s->tt;
    for (int i = 0; i < 3; i++) {
        r -= 2 * c[i] * s->xt[i];
        for (int j = 0; j < 3; j++)
            r += c[i] * s->xx[i][j] * c[j];
    }
    return r;
}

/* Subsets in order of preference on equal residuals: all three, then
 * those proportional to work before those with a fixed part. */
static const unsigned SUBSETS[] = {07, 06, 03, 02, 05, 04, 01};
/* For decode-only steps, those with a fixed part first: a step of a few
 * decode tokens costs mostly the weights' one read, so when their token
 * counts do not vary (two streams decoding, step after step) the fixed
 * part explains them, not a cost per token that would halve one stream's
 * step. */
static const unsigned DECODE_SUBSETS[] = {07, 05, 03, 01, 06, 04, 02};
#define N_SUBSETS (sizeof(SUBSETS) / sizeof(SUBSETS[0]))

/* The least-squares coefficients over the sums s, none below zero, into
 * coef (order: subsets by preference). False when no subset solves. */
static bool fit(const struct pace_sums *s, const unsigned order[N_SUBSETS], double coef[3])
{
    double best = INFINITY, c[3];
    bool found = false;
    for (size_t i = 0; i < N_SUBSETS; i++) {
        if (!solve_subset(s, order[i], c))
            continue;
        double r = residual(s, c);
        if (r < best - 1e-9 * s->tt) {
            best = r;
            memcpy(coef, c, sizeof(c));
            found = true;
        }
    }
    return found;
}

/* Refit over both kinds of steps; then the fixed cost a chunk is charged
 * with (pace.h): c_step bounded by the decode-only steps' decayed mean,
 * none before there are some; then the decode-only steps' own fit. */
static void refit(struct engine_pace *p)
{
    struct pace_sums s = p->sums[0];
    const struct pace_sums *d = &p->sums[1];
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++)
            s.xx[i][j] += d->xx[i][j];
        s.xt[i] += d->xt[i];
    }
    s.tt += d->tt;
    if (fit(&s, SUBSETS, p->coef))
        p->known = true;
    p->fixed_s = d->xx[0][0] > 0 ? fmin(p->coef[0], d->xt[0] / d->xx[0][0]) : 0;
    if (d->xx[0][0] > 0 && fit(d, DECODE_SUBSETS, p->decode_coef))
        p->decodes_timed = true;
}

void engine_pace_observe(struct engine_pace *p, const struct pace_work *w, bool chunks,
                         double seconds)
{
    if (p->frozen || !(seconds >= 0) || w->tokens < 1)
        return;
    p->since_decodes = chunks ? p->since_decodes + 1 : 0;
    struct pace_sums *s = &p->sums[chunks ? 0 : 1];
    double x[3];
    features(w, x);
    for (int i = 0; i < 3; i++) {
        for (int j = 0; j < 3; j++)
            s->xx[i][j] = DECAY * s->xx[i][j] + x[i] * x[j];
        s->xt[i] = DECAY * s->xt[i] + x[i] * seconds;
    }
    s->tt = DECAY * s->tt + seconds * seconds;
    refit(p);
}

double engine_pace_predict(const struct engine_pace *p, const struct pace_work *w)
{
    return predict_by(p->coef, w);
}

void engine_pace_set(struct engine_pace *p, double c_step, double c_token, double c_pair)
{
    p->coef[0] = c_step;
    p->coef[1] = c_token * TOKEN_UNIT;
    p->coef[2] = c_pair * PAIR_UNIT;
    p->fixed_s = c_step;
    p->known = p->frozen = true;
}

/*
 * The step's time budget while decodes wait (the essay above): the
 * configured budget_s until a decode-only step has been timed; then
 * PACE_BUDGET_DECODES times what the decode-only fit gives for these
 * decodes, never below PACE_BUDGET_FLOOR_S nor above budget_s. This is the
 * one place the budget is decided; the least chunk's stretch (stretch_s)
 * may still take a step past it, by its own bound.
 */
static double step_budget(const struct engine_pace *p, double budget_s, const struct pace_work *w)
{
    if (!p->decodes_timed)
        return budget_s;
    double s = PACE_BUDGET_DECODES * predict_by(p->decode_coef, w);
    return fmin(budget_s, fmax(s, PACE_BUDGET_FLOOR_S));
}

void pace_plan_start(struct pace_plan *pl, const struct engine_pace *p, uint64_t budget_ms,
                     int decodes, const struct pace_work *w, int floor)
{
    /* the decodes' time with the fixed cost as charged (pace.h: fixed_s) */
    double decodes_s = engine_pace_predict(p, w) - p->coef[0] + p->fixed_s;
    /* a learning pace times decodes alone when it has not for a while */
    bool stale = !p->decodes_timed || p->since_decodes >= PACE_PROBE_STEPS;
    *pl = (struct pace_plan){.pace = p,
                             .budget_s = step_budget(p, (double)budget_ms / 1e3, w),
                             .stretch_s = PACE_STRETCH * decodes_s,
                             .probe = decodes > 0 && budget_ms > 0 && !p->frozen && stale,
                             .work = *w,
                             .decodes = decodes,
                             .floor = floor};
}

/* The plan's work with a chunk of n tokens after context more. */
static double predict_with(const struct pace_plan *pl, int n, int context)
{
    struct pace_work c = pace_chunk_work(n, context);
    struct pace_work w = {.tokens = pl->work.tokens + c.tokens, .pairs = pl->work.pairs + c.pairs};
    return engine_pace_predict(pl->pace, &w);
}

/* The chunk's own predicted seconds in the plan: what n tokens after
 * context add to the step (the decodes' and earlier chunks' work is the
 * step's anyway). */
static double chunk_seconds(const struct pace_plan *pl, int n, int context)
{
    return predict_with(pl, n, context) - engine_pace_predict(pl->pace, &pl->work);
}

/* The largest n in 0..most that keeps the step within budget_s seconds:
 * the prediction grows with n (no coefficient is negative), so bisect. */
static int budget_chunk(const struct pace_plan *pl, int most, int context, double budget_s)
{
    int lo = 0, hi = most;
    while (lo < hi) {
        int mid = lo + (hi - lo + 1) / 2;
        if (predict_with(pl, mid, context) <= budget_s)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/*
 * The smallest n in 1..most whose prompt rate, n tokens over the step's
 * fixed cost plus the chunk's own seconds, is at least PACE_EFFICIENCY of the
 * rate of `most` tokens. The rate n / (c + a n + b n^2) rises to one peak
 * and falls; the target is at most the rate at `most`, so "rate(n) >=
 * target" is false then true over 1..most and bisection finds its edge.
 */
static int efficient_chunk(const struct pace_plan *pl, int most, int context)
{
    double fixed = pl->pace->fixed_s;
    double full = fixed + chunk_seconds(pl, most, context);
    if (!(full > 0))
        return 1;
    double target = PACE_EFFICIENCY * most / full;
    int lo = 1, hi = most;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (mid >= target * (fixed + chunk_seconds(pl, mid, context)))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

int pace_plan_chunk(struct pace_plan *pl, int most, int context)
{
    if (pl->probe)
        return 0;
    int n = most > 0 ? most : 0;
    if (n > 0 && pl->decodes > 0 && pl->budget_s > 0 && pl->pace->known) {
        n = budget_chunk(pl, most, context, pl->budget_s);
        if (pl->chunks == 0) {
            /* the oldest prompt progresses every step, by at least the
             * floor and by a chunk that reads it near full speed, as far
             * as a step of PACE_STRETCH times the decodes' own time */
            int least = efficient_chunk(pl, most, context);
            if (least > n) {
                int cap = budget_chunk(pl, least, context, pl->stretch_s);
                least = cap > n ? cap : n;
            }
            if (least < pl->floor)
                least = pl->floor < most ? pl->floor : most;
            if (n < least)
                n = least;
        }
    }
    if (n > 0) {
        struct pace_work c = pace_chunk_work(n, context);
        pl->work.tokens += c.tokens;
        pl->work.pairs += c.pairs;
        pl->chunks++;
    }
    return n;
}
