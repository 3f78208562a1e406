/*
 * matmul_bf16.h - products over bf16 weights with AVX-512 BF16 (vdpbf16ps),
 * one variant of the repacked weights: matmul_pack_run.c writes the copy at
 * load, prepares each token's activations through the kernels' round, and
 * splits the work among threads as for every repacked weight; the kernels
 * are matmul_bf16.c's, a kernel file compiled once per level (cpu/kernel.h)
 * of which only the avx512 copy has code, run only while cpu_bf16().
 *
 * Which weights take this path (matmul_pack_run.c decides, at load):
 *   bf16  where cpu_bf16() and vdpbf16ps outruns the FMA or AMX's bf16
 *         tiles run the pairs (matmul_amx.c, below), or where
 *         KVD_BF16=pairs asks: the weights are
 *         multiplied as stored; only the activations are rounded to bf16
 *         (as llama.cpp does);
 *   f16   only when asked (KVD_F16=bf16, mm_f16_set_bf16): each weight is
 *         rounded to bf16 at load, losing 3 of its 11 significant bits;
 *         by default f16 stays exact (matmul_pack.c's f32 FMA tile).
 * Elsewhere (another level, "avx512-nobf16", a CPU without the feature)
 * the stored rows or matmul_pack.c's exactly widened copy run, and the
 * kernels line says so (mm_bf16_describe).
 *
 * Layout, per pair of groups of MM_PACK_ROWS (16) rows (the kernels' tile
 * height), the last group padded with zero rows and an odd count with a
 * zero group; np = (n_in + 1) / 2 pairs of inputs (an odd n_in padded with
 * a zero weight): for input pair p, 128 bytes, the first group's line then
 * the second's; in a group's line, row r's elements 2p (low half) and
 * 2p + 1 (high half) as bf16 in 32-bit lane r, which is the pairing
 * vdpbf16ps multiplies against a token's (x[2p], x[2p + 1]) broadcast to
 * every lane. A tile of the pair reads its bytes in address order: one
 * sequential stream per thread when decoding (matmul_pack.c's "Decoding").
 * Pair stride: np x 128 bytes.
 *
 * Activations, rounded to bf16 (round to nearest even, as qt_f32_to_bf16)
 * and stored by tiles of MM_BF16_NT tokens: tile j, pair p, token t of the
 * tile at xb + (j * np + p) * MM_BF16_NT + t, one 32-bit pair (element 2p
 * low); a last tile of fewer tokens leaves its other slots unused.
 */
#ifndef KVD_MATMUL_BF16_H
#define KVD_MATMUL_BF16_H

#include "model/matmul_internal.h"

#define MM_BF16_NT 12 /* tokens per tile */

/* The kernels, over the jobs of matmul_internal.h's struct mm_pack_job:
 * w->packed holds bf16 pairs, xb the activations by tiles as above. */
struct mm_bf16_kernels {
    const char *name; /* NULL: the level has no bf16 kernels */
    /* Token t's activations xt[n_in], rounded to bf16 pairs, into its
     * column of its tile: jb->xb + (t / MM_BF16_NT * np + p) * MM_BF16_NT
     * + t % MM_BF16_NT for p < np. */
    void (*round)(const struct mm_pack_job *jb, const float *xt, int t);
    /* Row groups [g0, g1) x token tiles [j0, j1) of the job. */
    void (*groups)(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1);
    /* Groups 2 pp and 2 pp + 1 of w's stored rows (bf16, or f16 rounded
     * to nearest even) into dst in pairs, as above (mm_bf16_pair_bytes,
     * 64-byte aligned; a group past the last is zeros). */
    void (*pack_pair)(const struct mm_weight *w, size_t pp, uint32_t *dst);
};

KERN_DECLARE(const struct mm_bf16_kernels, mm_bf16_kernels);

/*
 * AMX's bf16 tiles over the same copy (matmul_amx.c), where the CPU has
 * them (cpu_amx()) and a row's pairs fill whole tiles (n_in a multiple of
 * MM_AMX_K inputs): every product of such a weight, a decoding step's too,
 * so that a token's results do not depend on its batch. Their sums are
 * not vdpbf16ps's bits (the matrix unit adds a row's pairs in its own
 * order), so the choice is per weight and per process, never per batch.
 *
 * Activations, rounded to bf16 as round does, one row per token: token
 * t's pair p at xb + t * np + p; the rows are read by tiles of MM_AMX_NT
 * tokens, so the scratch holds the batch rounded up to MM_AMX_NT rows
 * (the rows past it are read, their results not stored).
 */
#define MM_AMX_NT 32 /* tokens per tile of the split: two tiles of 16 */
#define MM_AMX_K 32  /* inputs per tile's depth: 16 pairs of 64 bytes */

struct mm_amx_kernels {
    const char *name; /* NULL: the level has no AMX kernels */
    /* Token t's activations xt[n_in] into its row, as above. */
    void (*round)(const struct mm_pack_job *jb, const float *xt, int t);
    /* Row groups [g0, g1) (g0 even) x token tiles [j0, j1) of MM_AMX_NT
     * tokens. Call only while cpu_amx(). */
    void (*groups)(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1);
};

KERN_DECLARE(const struct mm_amx_kernels, mm_amx_kernels);

/* Pairs of inputs of a row of w. */
static inline int mm_bf16_pairs(const struct mm_weight *w)
{
    return (w->n_in + 1) / 2;
}

/* Bytes of one pair of groups (32 rows) in pairs of inputs. */
static inline size_t mm_bf16_pair_bytes(const struct mm_weight *w)
{
    return (size_t)mm_bf16_pairs(w) * 128;
}

#endif /* KVD_MATMUL_BF16_H */
