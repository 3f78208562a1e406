/*
 * attn_params.c - the checks attn_create makes of its parameters, and the
 * error-message helper of the room's creators.
 */
#include "attention_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>

void attn_fail(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

int attn_check_params(const struct attn_params *p, char *err, size_t errlen)
{
    if (p->n_head < 1 || p->n_kv_head < 1 || p->n_head % p->n_kv_head) {
        attn_fail(err, errlen, "n_head %d must be a positive multiple of n_kv_head %d", p->n_head,
                  p->n_kv_head);
        return -EINVAL;
    }
    if (p->head_dim < 1 || p->head_dim > 1024) {
        attn_fail(err, errlen, "head_dim %d is outside 1..1024", p->head_dim);
        return -EINVAL;
    }
    if (!(p->scale > 0.0f) || !isfinite(p->scale) || !(p->softcap >= 0.0f) ||
        !isfinite(p->softcap)) {
        attn_fail(err, errlen, "scale %g must be positive, softcap %g >= 0", (double)p->scale,
                  (double)p->softcap);
        return -EINVAL;
    }
    if (p->n_threads < 0 || p->n_threads > 1024) {
        attn_fail(err, errlen, "n_threads %d is outside 0..1024", p->n_threads);
        return -EINVAL;
    }
    const struct pos_scheme *ps = &p->pos;
    switch (ps->kind) {
    case POS_NONE:
        return 0;
    case POS_ROPE:
        if (ps->rope_dims < 2 || ps->rope_dims % 2 || ps->rope_dims > p->head_dim) {
            attn_fail(err, errlen, "rope_dims %d must be even, >= 2 and <= head_dim %d",
                      ps->rope_dims, p->head_dim);
            return -EINVAL;
        }
        if (!(ps->rope_theta > 0.0f) || !isfinite(ps->rope_theta)) {
            attn_fail(err, errlen, "rope_theta %g must be positive", (double)ps->rope_theta);
            return -EINVAL;
        }
        if (!(ps->rope_freq_scale > 0.0f) || !isfinite(ps->rope_freq_scale)) {
            attn_fail(err, errlen, "rope_freq_scale %g must be positive (1 = no scaling)",
                      (double)ps->rope_freq_scale);
            return -EINVAL;
        }
        for (int i = 0; ps->rope_freq_factors && i < ps->rope_dims / 2; i++) {
            if (!(ps->rope_freq_factors[i] > 0.0f) || !isfinite(ps->rope_freq_factors[i])) {
                attn_fail(err, errlen, "rope frequency factor %d (%g) must be positive", i,
                          (double)ps->rope_freq_factors[i]);
                return -EINVAL;
            }
        }
        if (ps->rope_pairing != POS_ROPE_ADJACENT && ps->rope_pairing != POS_ROPE_NEOX) {
            attn_fail(err, errlen, "unknown rope pairing %d", (int)ps->rope_pairing);
            return -EINVAL;
        }
        return 0;
    case POS_ALIBI:
        if (!ps->alibi_slopes) {
            attn_fail(err, errlen, "alibi needs alibi_slopes[n_head]");
            return -EINVAL;
        }
        return 0;
    case POS_T5:
        if (!ps->t5_table) {
            attn_fail(err, errlen, "t5 needs t5_table[n_head][t5_num_buckets]");
            return -EINVAL;
        }
        return pos_t5_check(ps->t5_num_buckets, ps->t5_max_distance, ps->t5_bidirectional, err,
                            errlen);
    }
    attn_fail(err, errlen, "unknown position scheme %d", (int)ps->kind);
    return -EINVAL;
}
