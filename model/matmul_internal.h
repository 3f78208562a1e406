/*
 * matmul_internal.h - between mm_matmul's entry (matmul_run.c) and its
 * kernels (matmul.c, compiled once per kernel level, see cpu/kernel.h).
 *
 * The entry validates, lays out the scratch, and splits the output rows
 * into groups of MM_GROUP among the threads; the kernel level in use
 * (cpu_level()) supplies the two operations that touch data: quantising a
 * token's activations, and computing one group of rows for every token.
 */
#ifndef KVD_MATMUL_INTERNAL_H
#define KVD_MATMUL_INTERNAL_H

#include "cpu/kernel.h"
#include "model/quant.h"

/* Output rows per unit of thread work (16 floats: one cache line of out). */
#define MM_GROUP 16

/* The work of one call, shared read-only by its threads. */
struct mm_job {
    const struct mm_weight *w;
    const float *x; /* [n_tok][n_in] */
    float *out;     /* [n_tok][n_out] */
    int n_tok;
    struct mm_xq xa; /* quantised activations (quantised types only) */
};

/* One kernel level's operations. */
struct mm_kernels {
    const char *name; /* "avx512-vnni", "avx2", "scalar" */
    /* One token's activations x[n_in] into n_in / 32 blocks: q, d as in struct mm_xq. */
    void (*quantize_x)(const float *x, int n_in, int8_t *q, float *d);
    /* Output rows [g * MM_GROUP, +MM_GROUP) of every token of the job. */
    void (*run_group)(const struct mm_job *jb, int g);
};

KERN_DECLARE(const struct mm_kernels, mm_kernels);

/*
 * The K formats (q4_K, q5_K, q6_K): matmul_k_run.c's entry and the kernels
 * of matmul_k.c, a kernel file too. Activations per super-block of 256, in
 * scratch, each array 64-byte aligned, per token:
 *   q   int8  [ldq]  round(x / dx), ldq = n_in rounded up to 64 (sub-blocks
 *                    of 32 in the order the level's kernel reads them)
 *   d   float [ldd]  dx = max|x| / 127 per 256 (0 for an all-zero one)
 *   bs  int16 [lds]  sum of q over each 16 in element order (|sum| <= 2032)
 */
struct mm_kx {
    int8_t *q;
    float *d;
    int16_t *bs;
    size_t ldq, ldd, lds;
};

struct mm_k_job {
    const struct mm_weight *w;
    struct mm_kx a; /* [n_tok] tokens' activations */
    float *out;     /* [n_tok][n_out] */
    int n_tok;
};

struct mm_k_kernels {
    const char *name; /* "avx512-vnni", "avx2", "scalar" */
    /* One token's activations x[n_in] into n_in / 256 super-blocks (q, d,
     * bs of struct mm_kx), for weights of type. */
    void (*quantize)(enum ggml_type type, const float *x, int n_in, int8_t *q, float *d,
                     int16_t *bs);
    /* Output rows [o0, o1) of every token of the job. */
    void (*rows)(const struct mm_k_job *jb, int o0, int o1);
};

KERN_DECLARE(const struct mm_k_kernels, mm_k_kernels);

/*
 * Repacked weights (matmul_pack_run.c writes them at load, matmul_pack.c's
 * kernels read them; see matmul_pack.c's opening essay). Rows are taken in
 * groups of MM_PACK_ROWS, and groups in pairs (the kernels' tile height),
 * the last group padded with zero rows and an odd count with a zero group.
 * A pair is stored so that one 64-byte load holds a slice of all of one
 * group's rows, and so that a tile of the pair reads its bytes in address
 * order (one sequential stream per thread: see matmul_pack.c):
 *
 *   q8_0  per block of 32 inputs, MM_PACK_Q8_PAIR bytes: for k = 0..7 the
 *         first group's chunk k, then the second's (64 bytes each: row r =
 *         0..15's weights 4k..4k+3 as unsigned bytes w + 128, at bytes
 *         4r..4r+3), then the first group's 16 f16 scales, then the
 *         second's. Pair stride: nb x MM_PACK_Q8_PAIR (a multiple of 64).
 *   nibbles (mm_pack_nibbles: q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs)
 *         per block of 32 inputs, mm_pack_nib_block bytes: for k = 0..3
 *         the first group's chunk k, then the second's (64 bytes each: row
 *         r's bytes 4r..4r+3 are its block's stored bytes of nibbles
 *         4k..4k+3, whose low nibbles code elements 4k.. and high nibbles
 *         16 + 4k..); for q5_0 and q5_1 then each group's fifth bits (64
 *         bytes: row r's byte 4r + j holds the fifth bit of element 4k + j
 *         at bit 4 + k and of element 16 + 4k + j at bit k, k = 0..3);
 *         then at mm_pack_nib_scales each group's 16 scales (f16 as stored,
 *         or f32 d * (ls - 32) for iq4_xs, which can need 17 significant
 *         bits); then for q4_1 and q5_1 each group's 16 f16 mins.
 *   f32, f16, bf16  per input k: the first group's 16 elements k, then the
 *         second's, as stored (2 x 64 or 2 x 32 bytes). Pair stride: 2 x 16
 *         x n_in x the element size.
 *   q4_K  per super-block of 256 inputs, MM_PACK_Q4K_PAIR bytes: first
 *         each group's scales (the first group's MM_PACK_Q4K_GSCALES bytes,
 *         then the second's: 16 f16 d at 0, 16 f16 dmin at 32, then per
 *         sub-block s = 0..7 the 16 rows' 6-bit scales as bytes at 64 +
 *         16 s and their mins at 192 + 16 s), then from MM_PACK_Q4K_QS, for
 *         each pair of sub-blocks h = 0..3 and k = 0..7, the first group's
 *         chunk and then the second's (64 bytes each: row r's bytes 4r..4r+3
 *         are its stored qs[32h + 4k .. +3], whose low nibbles are elements
 *         64h + 4k.. and high nibbles 64h + 32 + 4k..). Pair stride: n_in /
 *         256 x MM_PACK_Q4K_PAIR. The activations are q8_0's (per block of
 *         32, below): a sub-block of 32 meets one activation block.
 */
#define MM_PACK_ROWS 16
#define MM_PACK_Q8_SCALES (2 * 8 * 64) /* the scales' offset in a pair's block */
#define MM_PACK_Q8_PAIR (MM_PACK_Q8_SCALES + 2 * 2 * MM_PACK_ROWS) /* one block of a pair */
#define MM_PACK_NIB_CHUNKS (2 * 4 * 64) /* a nibble block's chunks, both groups */
#define MM_PACK_Q4K_GSCALES (2 * 2 * MM_PACK_ROWS + 2 * 8 * MM_PACK_ROWS) /* one group's */
#define MM_PACK_Q4K_QS (2 * MM_PACK_Q4K_GSCALES)                 /* the nibbles' offset */
#define MM_PACK_Q4K_PAIR (MM_PACK_Q4K_QS + 4 * 8 * 2 * 64)        /* one super-block of a pair */

/* A nibble block of a pair (above): where its scales start, and its bytes. */
static inline size_t mm_pack_nib_scales(enum ggml_type t)
{
    return MM_PACK_NIB_CHUNKS + (t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1 ? 2 * 64 : 0);
}
static inline size_t mm_pack_nib_block(enum ggml_type t)
{
    return mm_pack_nib_scales(t) + 2 * (t == GGML_TYPE_IQ4_XS ? 64 : 32) +
           (t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_1 ? 2 * 32 : 0);
}

/* Whether w's repacked kernels take q8_0's activation slots: q8_0, the
 * nibble blocks and q4_K. */
static inline bool mm_pack_q8_acts(const struct mm_weight *w)
{
    return w->type == GGML_TYPE_Q8_0 || mm_pack_nibbles(w->type) || w->type == GGML_TYPE_Q4_K;
}

/* Bytes of one pair of groups (2 x MM_PACK_ROWS rows) of w, repacked (0: a
 * type that is never repacked). */
static inline size_t mm_pack_pair_bytes(const struct mm_weight *w)
{
    if (w->type == GGML_TYPE_Q8_0)
        return (size_t)(w->n_in / QT_QK) * MM_PACK_Q8_PAIR;
    if (mm_pack_nibbles(w->type))
        return (size_t)(w->n_in / QT_QK) * mm_pack_nib_block(w->type);
    if (w->type == GGML_TYPE_Q4_K)
        return (size_t)(w->n_in / QT_QK_K) * MM_PACK_Q4K_PAIR;
    if (w->type == GGML_TYPE_F32)
        return (size_t)w->n_in * 2 * MM_PACK_ROWS * 4;
    if (w->type == GGML_TYPE_F16 || w->type == GGML_TYPE_BF16)
        return (size_t)w->n_in * 2 * MM_PACK_ROWS * 2;
    return 0;
}

/*
 * Activations for the repacked kernels, quantised as struct mm_xq's (per
 * block of 32, the same values) but stored by tiles of MM_PACK_NT tokens so
 * that a tile's tokens are one pointer and constant offsets apart: tile j,
 * block b, token t of the tile:
 *   q  int8   at q + ((j * nb + b) * MM_PACK_NT + t) * 32   (32 bytes)
 *   d  float  at d + (j * nb + b) * MM_PACK_NT + t           the block scale
 *   c  int32  at c + (j * nb + b) * MM_PACK_NT + t           -128 * sum(q)
 * (a last tile of fewer tokens leaves its other slots unused).
 *
 * For float weights the activations are the caller's f32 rows, read in
 * place by tiles of MM_PACK_FNT tokens: tile j, input k, token t at
 *   x  float  at x + (j * MM_PACK_FNT + t) * n_in + k
 * (no copy: see matmul_pack.c, "Float weights").
 */
#define MM_PACK_NT 6
#define MM_PACK_FNT 12

/* A batch of at most this many tokens (decoding) runs narrow tiles of up
 * to 8 row groups (4 pairs; two q8_0 tokens 4 groups) instead of 2: more independent
 * sums in flight (matmul_pack.c, "Narrow tiles"). The driver hands such a
 * batch's pairs to the kernels MM_PACK_NARROW_PAIRS at a time where a
 * thread's share allows. */
#define MM_PACK_NARROW 2
#define MM_PACK_NARROW_PAIRS 4

/* f16 weights over at least this many token tiles in one kernel call: a
 * thread widens each pair of groups to f32 once, into its own copy, and
 * the f32 tiles read that (matmul_pack.c, "Float weights"). */
#define MM_PACK_WIDE_TILES 8

/* How far ahead a decoding tile asks for its weights into L1, in bytes of
 * each pair's stream: the far distance for the copies with the most
 * instructions per byte (f16 widened exactly, q4_K's two scales per
 * sub-block). matmul_pack.c, "Decoding". */
#define MM_PACK_PREFETCH 1024
#define MM_PACK_PREFETCH_FAR 2048

/* The distance for a float copy of this type (every level's float tiles). */
static inline int mm_pack_float_prefetch(enum ggml_type type)
{
    return type == GGML_TYPE_F16 ? MM_PACK_PREFETCH_FAR : MM_PACK_PREFETCH;
}

/* The work of one product over repacked weights. Its threads write the
 * activations' slots of their own token tiles only (matmul_pack_run.c). */
struct mm_pack_job {
    const struct mm_weight *w; /* w->packed set */
    int8_t *q;
    float *d;
    int32_t *c;
    const float *x; /* float weights: the caller's activations [n_tok][n_in] */
    float *wide;    /* f16, more than MM_PACK_NARROW tokens: this thread's f32 copy of
                       one pair of groups (n_in x 2 x MM_PACK_ROWS), or NULL */
    uint32_t *xb; /* bf16 pairs: the rounded activations (matmul_bf16.h) */
    float *out; /* [n_tok][n_out] */
    int n_tok;
};

struct mm_pack_kernels {
    const char *name; /* NULL: the level has no kernels over repacked weights */
    /* Whether the level multiplies repacked weights of type. */
    bool (*has)(enum ggml_type type);
    /* Token t's activations xt[n_in] into its q8_0 slots (q, d, c above),
     * the values of struct mm_kernels' quantize_x for the same level. */
    void (*quantize)(const struct mm_pack_job *jb, const float *xt, int t);
    /* Row groups [g0, g1) of the token tiles [j0, j1) (of the type's tile
     * width: MM_PACK_NT for q8_0, MM_PACK_FNT for float weights). */
    void (*groups)(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1);
};

KERN_DECLARE(const struct mm_pack_kernels, mm_pack_kernels);

static inline bool mm_is_float_type(enum ggml_type t)
{
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

#endif /* KVD_MATMUL_INTERNAL_H */
