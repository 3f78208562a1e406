/*
 * eval_retrieval.h - `kvd eval --task retrieval`: the passkey task, run by
 * cmd_eval.c's policies and baselines (eval_retrieval.c).
 */
#ifndef KVD_EVAL_RETRIEVAL_H
#define KVD_EVAL_RETRIEVAL_H

#include <stdbool.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "model/model.h"

#define EVAL_RET_MAX 8 /* lengths, depths */

/* The task's own options (the rest are kvd eval's). */
struct eval_ret_opts {
    bool on;                /* --task retrieval */
    int mult[EVAL_RET_MAX]; /* prompt lengths, multiples of the training length */
    int n_mult;
    double depth[EVAL_RET_MAX]; /* where the key sits: 0 = start, 1 = end of the filler */
    int n_depth;
    int key_len;   /* distinct digits in the key */
    int trials;    /* keys per (length, depth) */
    uint64_t seed; /* keys and filler */
};

void srv_eval_ret_defaults(struct eval_ret_opts *r);

/*
 * If argv[*i] is one of the task's options (--task, --lengths, --depths,
 * --key-len, --trials, --seed), consume it (and its value) and return
 * true; a bad value prints why and sets *bad.
 */
bool srv_eval_ret_opt(int argc, char **argv, int *i, struct eval_ret_opts *r, bool *bad);

/* The usage lines of those options. */
extern const char srv_eval_ret_usage[];

/* One row of the result: a policy, or a baseline (kind NONE: dense). */
struct eval_ret_row {
    const char *label;
    struct kv_policy policy; /* for policies and dense */
    int baseline;            /* 0 policy, 1 dense, 2 chunked, 3 recompute (of row 0's policy) */
};

/* What the task runs on (borrowed). */
struct eval_ret_in {
    const model *m;
    int n_threads; /* compute threads of a step (0 = default, cpu/pool.h) */
    int max_batch; /* tokens per engine step (prefill chunk) */
    const struct eval_ret_opts *r;
    const struct eval_ret_row *rows;
    int n_rows;
    int train_len;
    int page_tokens;
    enum kv_type k_type, v_type;
    const int32_t *text; /* filler text tokens (no BOS), or NULL: the model's own words */
    int n_text;
    bool json;
    const char *plot; /* PNG path or NULL */
};

/* Run every row over every (length, depth, trial); print the table (or
 * JSON) and write the plot. 0, or 1 after printing what failed. */
int srv_eval_retrieval(const struct eval_ret_in *in);

#endif /* KVD_EVAL_RETRIEVAL_H */
