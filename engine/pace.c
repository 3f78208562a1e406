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
    double best = INFINITY, c[3];
    for (size_t i = 0; i < sizeof(SUBSETS) / sizeof(SUBSETS[0]); i++) {
        if (!solve_subset(&s, SUBSETS[i], c))
            continue;
        double r = residual(&s, c);
        if (r < best - 1e-9 * s.tt) {
            best = r;
            memcpy(p->coef, c, sizeof(c));
            p->known = true;
        }
    }
}

void engine_pace_observe(struct engine_pace *p, const struct pace_work *w, bool chunks,
                         double seconds)
{
    if (p->frozen || !(seconds >= 0) || w->tokens < 1)
        return;
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
    double x[3];
    features(w, x);
    return p->coef[0] * x[0] + p->coef[1] * x[1] + p->coef[2] * x[2];
}

void engine_pace_set(struct engine_pace *p, double c_step, double c_token, double c_pair)
{
    p->coef[0] = c_step;
    p->coef[1] = c_token * TOKEN_UNIT;
    p->coef[2] = c_pair * PAIR_UNIT;
    p->known = p->frozen = true;
}

void pace_plan_start(struct pace_plan *pl, const struct engine_pace *p, uint64_t budget_ms,
                     int decodes, const struct pace_work *w, int floor)
{
    *pl = (struct pace_plan){.pace = p,
                             .budget_s = (double)budget_ms / 1e3,
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

int pace_plan_chunk(struct pace_plan *pl, int most, int context)
{
    int n = most > 0 ? most : 0;
    if (n > 0 && pl->decodes > 0 && pl->budget_s > 0 && pl->pace->known) {
        /* the largest n within the budget: the prediction grows with n
         * (no coefficient is negative), so bisect */
        int lo = 0, hi = n;
        while (lo < hi) {
            int mid = lo + (hi - lo + 1) / 2;
            if (predict_with(pl, mid, context) <= pl->budget_s)
                lo = mid;
            else
                hi = mid - 1;
        }
        n = lo;
        int floor = pl->floor < most ? pl->floor : most;
        if (pl->chunks == 0 && n < floor)
            n = floor; /* the oldest prompt progresses every step */
    }
    if (n > 0) {
        struct pace_work c = pace_chunk_work(n, context);
        pl->work.tokens += c.tokens;
        pl->work.pairs += c.pairs;
        pl->chunks++;
    }
    return n;
}
