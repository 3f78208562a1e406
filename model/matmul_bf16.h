/*
 * matmul_bf16.h - products over bf16 weights with AVX-512 BF16 (vdpbf16ps),
 * between the entry (matmul_bf16_run.c: the layout written at load, the
 * activations, the thread split) and the kernels (matmul_bf16.c, a kernel
 * file compiled once per level, cpu/kernel.h; only the avx512 copy has
 * them, and they run only where cpu_bf16() says the CPU has the feature).
 *
 * Which weights take this path (matmul_bf16_run.c decides, at load):
 *   bf16  always where cpu_bf16(): the weights are multiplied as stored;
 *         only the activations are rounded to bf16 (as llama.cpp does);
 *   f16   only when asked (KVD_F16=bf16, mm_f16_set_bf16): each weight is
 *         rounded to bf16 at load, losing 3 of its 11 significant bits;
 *         by default f16 stays exact (matmul_pack.c's f32 FMA tile).
 * Elsewhere (another level, "avx512-nobf16", a CPU without the feature)
 * the stored rows or matmul_pack.c's exactly widened copy run, and the
 * kernels line says so (mm_bf16_describe).
 *
 * Layout, per group of MM_PACK_ROWS (16) rows, the last padded with zero
 * rows; np = (n_in + 1) / 2 pairs of inputs (an odd n_in padded with a
 * zero weight): for pair p, 64 bytes, row r's elements 2p (low half) and
 * 2p + 1 (high half) as bf16 in 32-bit lane r, which is the pairing
 * vdpbf16ps multiplies against a token's (x[2p], x[2p + 1]) broadcast to
 * every lane. Group stride: np x 64 bytes.
 *
 * Activations, rounded to bf16 (round to nearest even, as qt_f32_to_bf16)
 * and stored by tiles of MM_BF16_NT tokens: tile j, pair p, token t of the
 * tile at x + (j * np + p) * MM_BF16_NT + t, one 32-bit pair (element 2p
 * low); a last tile of fewer tokens leaves its other slots unused.
 */
#ifndef KVD_MATMUL_BF16_H
#define KVD_MATMUL_BF16_H

#include "model/matmul_internal.h"

#define MM_BF16_NT 12 /* tokens per tile */

/* The work of one product over bf16 pairs. */
struct mm_bf16_job {
    const struct mm_weight *w; /* w->packed holds bf16 pairs */
    const uint32_t *x;         /* the activations by tiles, as above */
    float *out;                /* [n_tok][n_out] */
    int n_tok;
};

struct mm_bf16_kernels {
    const char *name; /* NULL: the level has no bf16 kernels */
    /* One token's activations x[n_in], rounded to bf16 pairs, into
     * dst[p * MM_BF16_NT] for p < np (its column of its tile). */
    void (*round_x)(const float *x, int n_in, uint32_t *dst);
    /* Row groups [g0, g1) x token tiles [j0, j1) of the job. */
    void (*groups)(const struct mm_bf16_job *jb, int g0, int g1, int j0, int j1);
};

KERN_DECLARE(const struct mm_bf16_kernels, mm_bf16_kernels);

/* Pairs of inputs of a row of w. */
static inline int mm_bf16_pairs(const struct mm_weight *w)
{
    return (w->n_in + 1) / 2;
}

/* Bytes of one group of 16 rows in pairs. */
static inline size_t mm_bf16_group_bytes(const struct mm_weight *w)
{
    return (size_t)mm_bf16_pairs(w) * 64;
}

/* The entry (matmul_bf16_run.c), for matmul_pack_run.c's hooks. */

/* Whether w, not yet packed, is to be packed in bf16 pairs now. */
bool mm_bf16_wants(const struct mm_weight *w);
/* Whether the bf16 kernels can run now (a copy in pairs is usable). */
bool mm_bf16_ready(void);
size_t mm_bf16_pack_bytes(const struct mm_weight *w);
/* Writes the pairs to dst (64-byte aligned) and sets w->packed, w->packed_bf16. */
void mm_bf16_pack_weight(struct mm_weight *w, void *dst);
size_t mm_bf16_scratch_bytes(const struct mm_weight *w, int n_tok);
/* n products of one x (mm_matmul_many): the activations rounded once,
 * one parallel region; each output as it would be alone. */
void mm_bf16_matmul_many(float *const *out, const struct mm_weight *const *ws, int n,
                         const float *x, int n_tok, int n_threads, void *scratch);

#endif /* KVD_MATMUL_BF16_H */
