/*
 * bench_attn.h - the attention context the attention benchmarks of the
 * SmolLM-135M shape share (bench_decode, bench_prefill_attn): RoPE (theta
 * 10000, every dimension rotated) with the pairing the caller names, ALiBi
 * (max_bias 8, BLOOM's slopes), or no position term; scale 1/8 (head dim
 * 64). A llama GGUF file (the bench models) pairs adjacent elements -
 * kvd's loader reads llama so (model.c) - and NeoX pairs (i, i + half)
 * belong to other architectures. The kernels de-interleave adjacent pairs
 * as they read keys; in one process, a 16k f16 decode layer costs the same
 * with either pairing (alternated calls).
 */
#ifndef KVD_BENCH_ATTN_H
#define KVD_BENCH_ATTN_H

#include <stdio.h>
#include <stdlib.h>

#include "attention/attention.h"

/* A context for n_head query heads over n_kv_head KV heads (pairing: RoPE only); exits naming
 * bench on failure. */
static inline attn_ctx *bench_attn_ctx(const char *bench, int n_head, int n_kv_head, int head_dim,
                                       enum pos_kind kind, enum pos_rope_pairing pairing,
                                       int threads)
{
    struct attn_params p = {.n_head = n_head,
                            .n_kv_head = n_kv_head,
                            .head_dim = head_dim,
                            .scale = 0.125f,
                            .n_threads = threads};
    p.pos.kind = kind;
    static float slopes[1024]; /* ALiBi's, per query head: read by the context, kept */
    if (kind == POS_ALIBI) {
        if (n_head > 1024 || pos_alibi_slopes(slopes, n_head, 8.0f)) {
            fprintf(stderr, "%s: no ALiBi slopes for %d heads\n", bench, n_head);
            exit(1);
        }
        p.pos.alibi_slopes = slopes;
    }
    if (kind == POS_ROPE) {
        p.pos.rope_theta = 10000.0f;
        p.pos.rope_dims = head_dim;
        p.pos.rope_pairing = pairing;
        p.pos.rope_freq_scale = 1.0f;
    }
    char err[256];
    attn_ctx *c = attn_create(&p, err, sizeof(err));
    if (!c) {
        fprintf(stderr, "%s: attn_create: %s\n", bench, err);
        exit(1);
    }
    return c;
}

#endif /* KVD_BENCH_ATTN_H */
