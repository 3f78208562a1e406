/*
 * pace.h - the engine's step pacing: how long a step will take, learned
 * from the steps already run, and how large a prompt chunk fits a step's
 * time budget (engine room only; step.c is the one caller).
 *
 * The model. A step's forward pass costs
 *
 *     seconds = c_step + c_token * tokens + c_pair * pairs
 *
 * where tokens is the batch's token count (the weight matmuls: per token
 * once the batch is large enough to be compute-bound) and pairs the
 * query-key pairs its attention scores (a chunk of n tokens after L cached
 * ones scores n*L + n*(n+1)/2 pairs; a decode token, L + 1). c_step is
 * what a step costs whatever it holds: reading the weights once, when
 * decodes alone cannot keep the cores busy. The three coefficients are
 * fitted by least squares over recent steps, each weighing less by a
 * constant factor per newer step of its kind, with no coefficient below
 * zero (pace.c says how). Timing is the host's: the engine measures its own
 * forward passes and reports them here.
 *
 * Everything here runs on the engine's thread; no allocation.
 */
#ifndef KVD_ENGINE_PACE_H
#define KVD_ENGINE_PACE_H

#include <stdbool.h>
#include <stdint.h>

/* The least share of a whole chunk's prompt reading rate that a step's
 * first chunk keeps, the step's fixed cost counted (pace.c). */
#define PACE_EFFICIENCY 0.95
/* How long a step may take for that, in times what its decodes alone are
 * predicted to take (when that is more than the budget): prefill gets at
 * most as much of a step as the decodes. */
#define PACE_STRETCH 2.0
/* While decodes wait, a step's time budget in times what its decodes alone
 * were timed to take in decode-only steps (pace.c says why this factor),
 * within [PACE_BUDGET_FLOOR_S, the configured budget]. */
#define PACE_BUDGET_DECODES 2.5
/* The least budget the decodes' timing may give a step, seconds (pace.c). */
#define PACE_BUDGET_FLOOR_S 0.020
/* A step with decodes carries no prompt chunk (a probe: its decodes are
 * timed alone) when no decode-only step has been seen in this many steps,
 * or ever, so the budget follows the decodes' present speed (pace.c). */
#define PACE_PROBE_STEPS 32

/* What a step computes: its size in the model's terms. */
struct pace_work {
    double tokens; /* tokens in the batch (decode + prefill) */
    double pairs;  /* query-key pairs attention scores */
};

/* Decayed normal equations of the fit: sums of w*x*x', w*x*t, w*t*t over
 * observed steps, x = (1, tokens, pairs) scaled (pace.c). */
struct pace_sums {
    double xx[3][3];
    double xt[3];
    double tt;
};

struct engine_pace {
    /* [0]: steps with prompt chunks, [1]: decode-only steps. Each kind is
     * forgotten only as steps of its own kind come, so a long run of
     * decodes does not erase what prefill costs. */
    struct pace_sums sums[2];
    double coef[3]; /* seconds per step, per token, per pair (the fit) */
    /* The same fit over decode-only steps alone, a fixed part preferred
     * (pace.c): what the current decodes would take in a step of their
     * own, which the step's time budget follows. */
    double decode_coef[3];
    bool decodes_timed; /* at least one decode-only step observed */
    int since_decodes;  /* steps with chunks observed since the last decode-only one */
    /* The fixed cost a chunk is charged with when its least size is
     * chosen (pace.c): coef[0], but never more than decode-only steps were
     * seen to take (their decayed mean) and 0 before any was seen, because
     * the fit can lay all of a run of equal chunks' cost on coef[0]. */
    double fixed_s;
    bool known;  /* at least one step observed (or coefficients set) */
    bool frozen; /* coefficients set by engine_pace_set: observations ignored */
};

/* The work of a chunk of n tokens after `context` cached ones. */
struct pace_work pace_chunk_work(int n, int context);

/* Record that a step of work w took `seconds` (chunks: it held prompt
 * chunks, not only decodes), and refit. */
void engine_pace_observe(struct engine_pace *p, const struct pace_work *w, bool chunks,
                         double seconds);
/* Predicted seconds for a step of work w (0 before any observation). */
double engine_pace_predict(const struct engine_pace *p, const struct pace_work *w);
/* Fix the coefficients (seconds per step, per token, per pair) and ignore
 * observations from now on: for tests and benchmarks that need a known
 * speed instead of the clock. */
void engine_pace_set(struct engine_pace *p, double c_step, double c_token, double c_pair);

/*
 * One step's plan: its decode work first, then prompt chunks one at a
 * time (oldest first), each as large as the time budget allows.
 */
struct pace_plan {
    const struct engine_pace *pace;
    /* seconds a step may take (0 = no time limit): the configured budget,
     * or less when decode-only steps were timed (pace.c: step_budget) */
    double budget_s;
    /* seconds the least chunk may stretch a step to: PACE_STRETCH times
     * the decodes' predicted time, the fixed cost as charged */
    double stretch_s;
    bool probe;            /* no prompt chunk this step: its decodes are timed alone */
    struct pace_work work; /* planned so far */
    int decodes;           /* decode tokens in the step */
    int chunks;            /* prompt chunks planned so far */
    int floor;             /* the least the first chunk gets, tokens */
};

/* Start a plan for a step of `decodes` decode tokens whose work is w,
 * under at most budget_ms (0 = none; once decode-only steps have been
 * timed, the budget is PACE_BUDGET_DECODES times what these decodes took
 * there, within [PACE_BUDGET_FLOOR_S, budget_ms]); the first chunk gets at
 * least `floor` tokens (a prompt progresses every step whatever the
 * budget), except in a probe step (PACE_PROBE_STEPS), which gets none. */
void pace_plan_start(struct pace_plan *pl, const struct engine_pace *p, uint64_t budget_ms,
                     int decodes, const struct pace_work *w, int floor);
/*
 * The size of the next prompt chunk: at most `most` tokens (what the
 * prompt has left, the token budget and the sequence's room already
 * applied) after `context` cached tokens, cut so that the step's predicted
 * time stays within the budget when decodes are waiting. The step's first
 * chunk is never cut below the floor, nor below the least chunk that reads
 * its prompt at nearly the rate of `most` tokens once the step's fixed
 * cost is counted, as far as the step takes at most PACE_STRETCH times its
 * decodes' own time (pace.c: when decodes alone take over half the budget,
 * the step may outlast it). A step
 * without decode tokens keeps the token budget only: nobody waits on it,
 * and large chunks read a prompt fastest. A probe step takes no chunk.
 * The chunk is added to the plan. Returns 0..most.
 */
int pace_plan_chunk(struct pace_plan *pl, int most, int context);

#endif /* KVD_ENGINE_PACE_H */
