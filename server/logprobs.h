/*
 * logprobs.h - a request's per-token log-probabilities (logprobs.c), on the
 * engine thread: the step's logits before the sampler changes them, their
 * log-sum-exp and the most likely tokens, turned into each TEXT event's
 * struct srv_logprob.
 */
#ifndef KVD_SERVER_LOGPROBS_H
#define KVD_SERVER_LOGPROBS_H

#include <stddef.h>
#include <stdint.h>

#include "server/scheduler.h"

/* One request's state (zeroed = none asked for). */
struct srv_lp {
    float *raw;     /* [n_vocab] the step's logits as the model gave them */
    int32_t *top;   /* [n_top + 1] the most likely ids, most likely first */
    int n_top;      /* alternatives asked for, at most n_vocab */
    double raw_lse; /* log(sum(exp(raw))) */
};

/* Room for n_top alternatives over n_vocab logits: 0, or -ENOMEM (free with
 * srv_lp_free either way). */
int srv_lp_init(struct srv_lp *lp, int n_top, int n_vocab);
void srv_lp_free(struct srv_lp *lp);

/* Take the step's logits (copied, before ignore_eos and the sampler change
 * them): their log-sum-exp in double and the top n_top, O(n_vocab log n_top). */
void srv_lp_prepare(struct srv_lp *lp, const float *logits, int n_vocab);

/* The TEXT event's record of the sampled token tok, whose text was
 * piece[0..n) (new; one allocation, free the struct only). */
struct srv_logprob *srv_lp_make(const struct srv_lp *lp, int32_t tok, const char *piece, size_t n);

#endif /* KVD_SERVER_LOGPROBS_H */
