/*
 * quant.h - weight element formats and the matrix products over them
 * (internal to the model room; never included from outside model/).
 *
 * Two halves:
 *
 *   quant.c   the element formats GGUF files use (f32, f16, bf16, q8_0,
 *             q4_0, q4_K, q6_K): half-precision conversions, dequantising a
 *             row to f32 and quantising f32 rows into the formats kvd writes.
 *   quant_blocks.c  the other formats of common files (q4_1, q5_0, q5_1,
 *             iq4_nl, q2_K, q3_K, q5_K), each as integers, scales and mins
 *             per block of 32.
 *
 *   matmul.c  out[t][o] = sum_i W[o][i] * x[t][i] for a weight matrix W in
 *             any supported format, SIMD inside a row and threads over rows;
 *             matmul_blocks.c the kernels for quant_blocks.c's formats.
 *
 * The central idea of the products: a weight block is decoded in registers
 * once and used against a tile of several tokens, so decoding (matrix times
 * vector) reads each weight byte once at memory speed and prefill (matrix
 * times matrix) spends its time in multiply-adds, not in decoding.
 * Quantised weights meet activations quantised to 8 bits per block of 32
 * (one f32 scale per block, value = round(x / d), d = max|x| / 127) in
 * integer dot products; float weights meet f32 activations in f32
 * multiply-adds. The activation rounding is the only difference from a f32
 * product over the dequantised weights: for each output it is at most
 * sum over blocks b of (d_b / 2) * sum_{i in b} |W[o][i]|.
 *
 * Block layouts (little-endian, f16 scales, no padding), as ggml defines them:
 *   q8_0  32 elements, 34 bytes: d, int8 q[32];            w = d * q
 *   q4_0  32 elements, 18 bytes: d, uint8 qs[16];          w = d * (nibble - 8),
 *         low nibbles of qs[0..15] are elements 0..15, high nibbles 16..31
 *   q4_K  256 elements, 144 bytes: d, dmin, scales[12], qs[128]; eight
 *         sub-blocks of 32 with 6-bit scale s_j and min m_j packed in scales[]:
 *         w = d * s_j * q - dmin * m_j, q a nibble (see quant.c)
 *   q6_K  256 elements, 210 bytes: ql[128], qh[64], int8 scales[16], d;
 *         sixteen groups of 16 with scale s_g: w = d * s_g * (q - 32), q six
 *         bits (low four in ql, high two in qh; see quant.c)
 *
 * Row conversions take (src, dst, n) like qt_dequantize_row; every function
 * here is thread-safe and allocates nothing, except mm_matmul's per-thread
 * scratch described below.
 */
#ifndef KVD_QUANT_H
#define KVD_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "model/gguf.h"

#define QT_QK 32    /* elements per block of q8_0 and q4_0 (and of activations) */
#define QT_QK_K 256 /* elements per super-block of the K formats */

/* ------------------------------------------------------------------------
 * Element types
 * ------------------------------------------------------------------------ */

/* Name of any known type id ("f32", "q4_K", ...), or NULL for an unknown id. */
const char *qt_type_name(enum ggml_type type);

/* Whether this file can dequantise it and mm_matmul can multiply by it. */
bool qt_type_supported(enum ggml_type type);

/* Elements and bytes per block of a supported type; 0 if unsupported. */
int qt_block_elems(enum ggml_type type);
size_t qt_block_bytes(enum ggml_type type);

/* Bytes of a row of n elements; 0 if unsupported or n is not a positive
 * multiple of the block. */
size_t qt_row_bytes(enum ggml_type type, int n);

/* ------------------------------------------------------------------------
 * Half precision
 * ------------------------------------------------------------------------ */

/*
 * IEEE binary16 and bfloat16 bit patterns. f32 -> half rounds to nearest,
 * ties to even; overflow gives infinity; NaN stays NaN (quiet, sign kept);
 * f16 subnormals are produced and read exactly. Uses F16C where the build
 * has it.
 */
float qt_f16_to_f32(uint16_t h);
uint16_t qt_f32_to_f16(float f);
float qt_bf16_to_f32(uint16_t h);
uint16_t qt_f32_to_bf16(float f);

/* The same over n elements (SIMD); src and dst must not overlap. */
void qt_f16_to_f32_row(const uint16_t *src, float *dst, size_t n);
void qt_f32_to_f16_row(const float *src, uint16_t *dst, size_t n);
void qt_bf16_to_f32_row(const uint16_t *src, float *dst, size_t n);
void qt_f32_to_bf16_row(const float *src, uint16_t *dst, size_t n);

/* ------------------------------------------------------------------------
 * Rows
 * ------------------------------------------------------------------------ */

/*
 * Decode n elements of type from src (qt_row_bytes(type, n) bytes, any
 * alignment) into dst. Returns 0, or -EINVAL (dst untouched) if the type is
 * unsupported or n is not a positive multiple of its block.
 */
int qt_dequantize_row(enum ggml_type type, const void *src, float *dst, int n);

/*
 * Encode n floats into qt_row_bytes(type, n) bytes at dst. Supports f32,
 * f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, the K-quants q2_K to q6_K and
 * iq4_xs (qt_quantize_k, quant_k.c: every element within half a step,
 * iq4_xs within 14 steps of its uneven levels); q8_0, q4_0 and q5_0 choose
 * each block's scale from its largest magnitude and round every element to
 * the nearest level of the stored (f16) scale; q4_1 and q5_1 take the
 * block's minimum rounded down and the step to its maximum rounded up
 * (every element within half a step).
 * Returns 0; -EINVAL for another type, n not a positive multiple of the
 * block, or a non-finite input; -ERANGE if a block's scale (or min) does
 * not fit in f16. On error dst may be partly written.
 */
int qt_quantize_row(enum ggml_type type, const float *src, void *dst, int n);

/* q2_K, q3_K, q4_K, q5_K, q6_K or iq4_xs rows of n (a multiple of 256)
 * floats (quant_k.c), with qt_quantize_row's contract. */
int qt_quantize_k(enum ggml_type type, const float *src, void *dst, int n);

/* ------------------------------------------------------------------------
 * Block access, shared by quant.c and matmul.c
 * ------------------------------------------------------------------------ */

/* Byte offsets inside a q4_K super-block (144 bytes). */
#define QT_Q4K_D 0      /* f16 scale of the 6-bit scales */
#define QT_Q4K_DMIN 2   /* f16 scale of the 6-bit mins */
#define QT_Q4K_SCALES 4 /* 12 bytes: eight 6-bit scales and eight 6-bit mins */
#define QT_Q4K_QS 16    /* 128 bytes of nibbles */
/* Byte offsets inside a q6_K super-block (210 bytes). */
#define QT_Q6K_QL 0       /* 128 bytes: low four bits */
#define QT_Q6K_QH 128     /* 64 bytes: high two bits */
#define QT_Q6K_SCALES 192 /* 16 int8 scales, one per 16 elements */
#define QT_Q6K_D 208      /* f16 super-block scale */
/* Byte offsets inside a q2_K super-block (84 bytes). */
#define QT_Q2K_SCALES 0 /* 16 bytes: scale (low nibble) and min (high) of each 16 */
#define QT_Q2K_QS 16    /* 64 bytes: four 2-bit quants per byte */
#define QT_Q2K_D 80     /* f16 scale of the scales */
#define QT_Q2K_DMIN 82  /* f16 scale of the mins */
/* Byte offsets inside a q3_K super-block (110 bytes). */
#define QT_Q3K_HMASK 0   /* 32 bytes: the third bit of every quant */
#define QT_Q3K_QS 32     /* 64 bytes: the low two bits, four per byte */
#define QT_Q3K_SCALES 96 /* 12 bytes: sixteen 6-bit scales (qt_q3k_scales) */
#define QT_Q3K_D 108     /* f16 super-block scale */

/* A little-endian u16 at any alignment (f16 scales sit at odd offsets). */
static inline uint16_t qt_rd16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

/*
 * Scale and min of q4_K sub-block j (0..7) from the 12 packed bytes:
 * bytes 0..3 hold scales 0..3 in their low six bits, bytes 4..7 mins 0..3;
 * sub-blocks 4..7 take their low four bits from the nibbles of bytes 8..11
 * (scale low, min high) and their top two bits from the top two bits of
 * bytes 0..3 (scales) and 4..7 (mins).
 */
static inline void qt_q4k_scale_min(const uint8_t *s, int j, int *scale, int *min)
{
    if (j < 4) {
        *scale = s[j] & 63;
        *min = s[j + 4] & 63;
    } else {
        *scale = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* All eight scales (sc) and mins (mn) of those 12 bytes at once, sub-block
 * j in byte j: qt_q4k_scale_min word by word (a, b, c: bytes 0..3, 4..7,
 * 8..11). For kernels that widen them in vector registers. */
static inline void qt_q4k_scales_mins(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    *sc = (uint64_t)(a & 0x3f3f3f3f) | (uint64_t)((c & 0x0f0f0f0f) | (((a >> 6) & 0x03030303) << 4))
                                           << 32;
    *mn = (uint64_t)(b & 0x3f3f3f3f) |
          (uint64_t)(((c >> 4) & 0x0f0f0f0f) | (((b >> 6) & 0x03030303) << 4)) << 32;
}

/*
 * The sixteen 6-bit scales of a q3_K super-block (used as scale - 32) from
 * its 12 packed bytes s, group g in byte g of w[4]: the low four bits are
 * the nibbles of bytes 0..7 (groups 0..7 low nibbles, 8..15 high), the top
 * two bits pairs of bits of bytes 8..11 (group g: bits 2(g/4).. of byte
 * 8 + g%4). Word by word, for kernels that widen them in vector registers.
 */
static inline void qt_q3k_scale_words(const uint8_t *s, uint32_t w[4])
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    w[0] = (a & 0x0f0f0f0f) | (c & 0x03030303) << 4;
    w[1] = (b & 0x0f0f0f0f) | ((c >> 2) & 0x03030303) << 4;
    w[2] = ((a >> 4) & 0x0f0f0f0f) | ((c >> 4) & 0x03030303) << 4;
    w[3] = ((b >> 4) & 0x0f0f0f0f) | ((c >> 6) & 0x03030303) << 4;
}

/* Byte offsets inside an iq4_xs super-block (QT_IQ4XS_BYTES). */
#define QT_IQ4XS_BYTES 136
#define QT_IQ4XS_D 0        /* f16 super-block scale */
#define QT_IQ4XS_SCALES_H 2 /* u16: the top two bits of each sub-block's scale */
#define QT_IQ4XS_SCALES_L 4 /* 4 bytes: their low four bits, a nibble each */
#define QT_IQ4XS_QS 8       /* 8 x 16 bytes of nibbles, sub-block j at 16 j */

/* The scale of iq4_xs sub-block j (0..7) of the super-block sb, as used
 * (ls - 32): low four bits the nibble (j odd: high) of scales_l[j / 2],
 * top two bits 2j, 2j+1 of scales_h. */
static inline int qt_iq4xs_scale(const uint8_t *sb, int j)
{
    int lo = (sb[QT_IQ4XS_SCALES_L + j / 2] >> (4 * (j & 1))) & 15;
    int hi = (qt_rd16(sb + QT_IQ4XS_SCALES_H) >> (2 * j)) & 3;
    return (lo | hi << 4) - 32;
}

/* The super-block holding block b (of 32) of an iq4_xs row, and that
 * block's 16 bytes of nibbles (low: elements 0..15, high: 16..31). */
static inline const uint8_t *qt_iq4xs_sb(const uint8_t *row, int b)
{
    return row + QT_IQ4XS_BYTES * (size_t)(b / 8);
}
static inline const uint8_t *qt_iq4xs_qs(const uint8_t *row, int b)
{
    return qt_iq4xs_sb(row, b) + QT_IQ4XS_QS + 16 * (b % 8);
}

/* ------------------------------------------------------------------------
 * The other block formats (quant_blocks.c)
 * ------------------------------------------------------------------------ */

/* Whether type is one of quant_blocks.c's: q4_1, q5_0, q5_1, iq4_nl, q2_K,
 * q3_K, q5_K, iq4_xs. */
bool qt_is_block_type(enum ggml_type type);

/*
 * Block b (elements 32b .. 32b+31) of a row of such a type, as integers
 * w[32], scales s[2] and mins mn[2] per half of 16: element k is
 * s[k / 16] * w[k] - mn[k / 16] exactly as the format defines it.
 */
void qt_block32_decode(enum ggml_type type, const uint8_t *row, int b, int8_t *w, float *s,
                       float *mn);

/* Only the scales and mins of that block (for kernels that decode the
 * integers themselves). */
void qt_block32_scales(enum ggml_type type, const uint8_t *row, int b, float *s, float *mn);

/* qt_dequantize_row for these types (0 or -EINVAL). */
int qt_blocks_dequantize(enum ggml_type type, const uint8_t *src, float *dst, int n);

/* ------------------------------------------------------------------------
 * Matrix products
 * ------------------------------------------------------------------------ */

/*
 * A weight matrix as stored in GGUF: ne[0] = n_in elements per row
 * (contiguous, quantised along the row), ne[1] = n_out rows of row_bytes
 * each. A plain description; data is borrowed (usually from the mapping).
 */
struct mm_weight {
    enum ggml_type type; /* element format */
    int n_in;            /* columns: elements per row, a multiple of the block */
    int n_out;           /* rows */
    const void *data;    /* n_out * row_bytes bytes, any alignment */
    size_t row_bytes;    /* qt_row_bytes(type, n_in) */
    const void *packed;  /* the rows repacked for the prefill kernels (mm_pack_weight), or NULL */
    bool packed_bf16;    /* packed holds bf16 pairs for AVX-512 BF16 (model/matmul_bf16.h) */
};

/*
 * Describe a weight matrix. Returns 0, or -EINVAL with the reason in err
 * (the type named, e.g. "q5_K", or the shape) if the type is unsupported,
 * n_in is not a positive multiple of its block, n_out < 1 or data is NULL.
 * w is fully written on success and untouched on error.
 */
int mm_weight_init(struct mm_weight *w, enum ggml_type type, int n_in, int n_out, const void *data,
                   char *err, size_t errlen);

/* Bytes of scratch mm_matmul_scratch needs for n_tok tokens on n_threads
 * (as passed to it): the quantised activations, the bf16 pairs' rounded
 * ones, or each thread's f32 copy of the f16 rows it multiplies; 0 for
 * f32 weights. */
size_t mm_scratch_bytes(const struct mm_weight *w, int n_tok, int n_threads);

/*
 * out[n_tok][n_out] = x[n_tok][n_in] . W^T, with n_threads threads (0 = the
 * default count, cpu/pool.h; 1 = no parallel region). out must not overlap x.
 * Results do not depend on the number of threads nor on the other tokens of
 * the batch: each output is summed in the same order whatever the split.
 *
 * Quantised weights need x quantised first, into scratch. mm_matmul keeps
 * one scratch buffer per calling thread (thread-local), grown when a call
 * needs more and never shrunk, so steady-state calls allocate nothing;
 * mm_scratch_release frees the calling thread's buffer (call it before an
 * engine thread exits). Returns 0, or -ENOMEM if that buffer could not grow
 * (out untouched). mm_matmul_scratch uses caller-provided scratch instead
 * (at least mm_scratch_bytes(w, n_tok, n_threads) bytes, 64-byte aligned) and cannot
 * fail.
 */
int mm_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads);
void mm_matmul_scratch(float *out, const struct mm_weight *w, const float *x, int n_tok,
                       int n_threads, void *scratch);
void mm_scratch_release(void);

/*
 * The n products out[i][n_tok][w[i]->n_out] = x . W_i^T of one x (n <=
 * MM_MANY_MAX; Q, K and V; gate and up), each exactly as mm_matmul_scratch
 * gives it, but in one parallel region with x prepared once when every W_i
 * is repacked (mm_pack_ready) with one type and n_in; otherwise one
 * product after another. scratch as mm_matmul_scratch's, for the largest.
 *
 * tail (or NULL; then any heights): every W_i has the same n_out, and
 * tail->fn(tail->arg, r0, r1, t0, t1) runs once for each block of a
 * partition of the outputs (rows [0, n_out) x tokens [0, n_tok)) into
 * blocks of rows [r0, r1) x tokens [t0, t1), after that block of every
 * product is written, possibly at the same time as other blocks (gate and
 * up, then the activation over the block, in the same region when the
 * products share it). fn must write only within its block.
 */
#define MM_MANY_MAX 4
struct mm_tail {
    void (*fn)(void *arg, int r0, int r1, int t0, int t1);
    void *arg;
};
void mm_matmul_many(float *const *out, const struct mm_weight *const *w, int n, const float *x,
                    int n_tok, int n_threads, void *scratch, const struct mm_tail *tail);

/* The kernels of the level in use (cpu/cpu.h): "avx512-vnni", "avx2" or "scalar". */
const char *mm_kernel_name(void);

/*
 * Repacked weights (matmul_pack_run.c, kernels in matmul_pack.c): the rows
 * of a matrix stored again, interleaved in groups of 16, in the layout the
 * kernel level's register-blocked kernels read, so a prefill runs near the
 * CPU's multiply-add peak. The copy is the caller's memory (a model makes
 * one at load, model_pack.c); w->data stays valid and is what the other
 * levels read.
 *
 * mm_pack_bytes: the bytes w's copy needs at the kernel level in use, 0
 * when that level has no kernels over repacked weights of w's type (then
 * nothing is to be done). mm_pack_weight writes the copy to dst (that many
 * bytes, 64-byte aligned, not freed while w is used) and sets w->packed.
 * From then on mm_matmul takes the copy whenever the level in use has
 * kernels for it (mm_pack_ready), for one token or many alike, so prefill
 * and decode sum each output in the same order.
 */
size_t mm_pack_bytes(const struct mm_weight *w);
void mm_pack_weight(struct mm_weight *w, void *dst);
bool mm_pack_ready(const struct mm_weight *w);
/* The kernels over repacked weights at the level in use ("avx512-vnni
 * 16-row"), or NULL when it has none. */
const char *mm_pack_kernel_name(void);
/* Whether those kernels multiply weights of type (the AVX2 level's, the
 * float types only). */
bool mm_pack_has(enum ggml_type type);
/*
 * BF16 and F16 weights with AVX-512 BF16 (model/matmul_bf16.h): BF16
 * weights are repacked in bf16 pairs wherever cpu_bf16(); F16 weights only
 * when mm_f16_set_bf16(true) was called before they are packed (they are
 * then rounded to bf16; by default they stay exact). mm_f16_init_env sets
 * it from KVD_F16=exact|bf16 (unset or empty: unchanged), or returns -1
 * with err naming the variable. mm_bf16_describe: one phrase saying how
 * bf16 and f16 weights are multiplied now, for the kernels line.
 */
void mm_f16_set_bf16(bool on);
bool mm_f16_bf16(void);
int mm_f16_init_env(char *err, size_t errlen);
/*
 * BF16 weights go to bf16 pairs where cpu_bf16() and the CPU's vdpbf16ps
 * outruns its FMA (cpu_bf16_dot_fast), and are widened exactly for the f32
 * FMA tile elsewhere; mm_bf16_set_pairs(1) or (0) forces either (-1: back
 * to the CPU's choice), taken when a weight is packed. mm_bf16_init_env
 * sets it from KVD_BF16=pairs|exact (unset or empty: unchanged), or
 * returns -1 with err naming the variable. mm_bf16_in_pairs: whether BF16
 * weights packed now take pairs.
 */
void mm_bf16_set_pairs(int mode);
int mm_bf16_init_env(char *err, size_t errlen);
bool mm_bf16_in_pairs(void);
/* Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS weights at a level with
 * kernels over repacked weights are repacked as their stored nibbles (and
 * fifth bits), in blocks of 32 with one scale (and min) each, in as many
 * bytes as stored (IQ4_XS: 20 per 32 weights against 17; matmul_pack.c). */
static inline bool mm_pack_nibbles(enum ggml_type type)
{
    return type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_0 ||
           type == GGML_TYPE_Q5_1 || type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_IQ4_XS;
}
const char *mm_bf16_describe(char *buf, size_t len);
/* mm_matmul_scratch's work for a weight with mm_pack_ready, and its scratch. */
size_t mm_pack_scratch_bytes(const struct mm_weight *w, int n_tok, int n_threads);
void mm_pack_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads,
                    void *scratch);
/* mm_matmul_many's work when every weight is mm_pack_ready, of one type and n_in. */
void mm_pack_matmul_many(float *const *out, const struct mm_weight *const *w, int n, const float *x,
                         int n_tok, int n_threads, void *scratch, const struct mm_tail *tail);

/*
 * Activations quantised per block of 32 (matmul.c fills them before the
 * products): q int8 [n_tok][ldq] = round(x / d); d float [n_tok][ldb] the
 * block scales max|x| / 127.
 */
struct mm_xq {
    int8_t *q;
    float *d;
    size_t ldq, ldb;
};

/*
 * Rows [o0, o1) of out[n_tok][w->n_out] for a weight of a qt_is_block_type
 * type (matmul_blocks.c). The kernel is picked at run time: AVX2 when the
 * CPU has it, else plain C. Each output is summed in the same order
 * whatever the rows and tokens around it.
 */
void mm_blocks_rows(const struct mm_weight *w, const struct mm_xq *xa, float *out, int n_tok,
                    int o0, int o1);

/* The kernel mm_blocks_rows uses on this CPU: "avx2" or "scalar". */
const char *mm_blocks_kernel_name(void);
/* For tests and benchmarks: "scalar" forces the plain C kernel, "auto"
 * returns to the CPU's best. 0, or -EINVAL for another name. Not to be
 * called while products run. */
int mm_blocks_use(const char *kernel);

/* ------------------------------------------------------------------------
 * The K formats' products (matmul_k.c)
 * ------------------------------------------------------------------------ */

/* Whether mm_matmul multiplies type through matmul_k.c: q2_K to q6_K. */
bool mm_k_type(enum ggml_type type);

/* Scratch mm_k_matmul needs for n_tok tokens of n_in (a multiple of 256). */
size_t mm_k_scratch_bytes(int n_in, int n_tok);

/*
 * mm_matmul_scratch for a weight of an mm_k_type type (matmul_k_run.c,
 * kernels in matmul_k.c): the activations
 * quantised per super-block of 256 (one scale each, sums per 16) into
 * scratch (mm_k_scratch_bytes, 64-byte aligned), then integer dot products
 * with the weights' scales applied in integers. The same invariance: each
 * output summed in one order whatever the threads and the batch.
 */
void mm_k_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads,
                 void *scratch);

/* The kernel mm_k_matmul uses at the kernel level in use (cpu/cpu.h):
 * "avx512-vnni", "avx2" or "scalar". */
const char *mm_k_kernel_name(void);

#endif /* KVD_QUANT_H */
