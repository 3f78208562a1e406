/*
 * matmul.c - out[t][o] = sum_i W[o][i] * x[t][i] for weights in any
 * supported format.
 *
 * This file holds the kernels; the Makefile compiles it once per kernel
 * level (cpu/kernel.h) and matmul_run.c, the entry, picks the copy of the
 * level in use. The work is split like ggml's kernels: threads take contiguous
 * groups of MM_GROUP output rows; inside a group, a register tile of MR rows
 * x NT tokens walks the rows from start to end, so every weight block is
 * loaded and decoded once per NT tokens, and NT activation blocks are
 * loaded once per MR rows. With one token (decoding) the tile is MR x 1 and
 * the loop streams weights at memory speed; with many (prefill) it is
 * compute bound and each decoded block is reused NT times.
 *
 * Float weights (f32, f16, bf16) are widened to f32 in registers and meet
 * f32 activations in multiply-adds. Quantised weights (q8_0, q4_0) meet
 * activations quantised per block of 32 to int8 with an f32 scale (done by
 * the calling thread, into scratch, before the team starts) in integer dot
 * products:
 *
 *   AVX-512 VNNI  vpdpbusd on 512 bits: two blocks of 32 per step, u8
 *                 weights x s8 activations, four products per i32 lane.
 *   AVX2          vpmaddubsw + vpmaddwd on 256 bits, one block per step.
 *   scalar        the same integer sums in plain C (the scalar level).
 *
 * The weights enter as unsigned bytes w + c, and the offset's contribution
 * -c * sum(x) is the starting value of each integer sum (see "SIMD:
 * quantised weights"). Each block's i32 sums are scaled in f32 by (weight
 * scale) x (activation scale) and accumulated in f32 lanes. (The K formats
 * have their own kernels, matmul_k.c; quant_blocks.c's other formats go to
 * matmul_blocks.c.)
 *
 * Each output is summed in the same order whatever the split among threads
 * and whatever the other tokens of the batch, so results depend on neither.
 */
#include "model/matmul_internal.h"
#include "model/matmul_simd.h"

#include <math.h>
#include <string.h>

/* The copy's level (cpu/kernel.h): avx512 includes VNNI, avx2 FMA and F16C. */
#if defined(KERN_AVX512)
#define MM_AVX512 1
#define MM_SIMD 1
#elif defined(KERN_AVX2)
#define MM_AVX2 1
#define MM_SIMD 1
#endif

/* Register tiles: rows x tokens. MM_GROUP must be a multiple of the rows. */
#if defined(MM_AVX512)
#define F_MR 4 /* float weights: 16 zmm accumulators */
#define F_NT 4
#define Q_MR 4 /* quantised weights: 16 zmm accumulators */
#define Q_NT 4
#else
#define F_MR 2 /* 16 ymm registers: 8 accumulators */
#define F_NT 4
#define Q_MR 2
#define Q_NT 4
#endif

/* ------------------------------------------------------------------------
 * Quantised activations (layout: struct mm_xq, matmul_run.c)
 * ------------------------------------------------------------------------ */

/* Quantise one token's activations: n_in / 32 blocks. */
static void quantize_x(const float *x, int n_in, int8_t *q, float *d)
{
    int nb = n_in / QT_QK;
    for (int b = 0; b < nb; b++, x += QT_QK, q += QT_QK) {
#ifdef MM_SIMD
        const __m256 signbit = _mm256_set1_ps(-0.0f);
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 m = _mm256_max_ps(
            _mm256_max_ps(_mm256_andnot_ps(signbit, v0), _mm256_andnot_ps(signbit, v1)),
            _mm256_max_ps(_mm256_andnot_ps(signbit, v2), _mm256_andnot_ps(signbit, v3)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float db = amax / 127.0f;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        /* round to nearest even (MXCSR default), |q| <= 127 */
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
        /* i32 -> i8: the packs interleave 128-bit lanes; one permute restores order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)q, p);
        d[b] = db;
#else
        float amax = 0.0f;
        for (int k = 0; k < QT_QK; k++)
            amax = fmaxf(amax, fabsf(x[k]));
        float db = amax / 127.0f;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < QT_QK; k++) {
            float v = nearbyintf(x[k] * id);
            /* clamp before converting: also turns NaN into a defined value */
            v = v >= -127.0f ? v : -127.0f;
            v = v <= 127.0f ? v : 127.0f;
            q[k] = (int8_t)v;
        }
        d[b] = db;
#endif
    }
}

/* ------------------------------------------------------------------------
 * Tiles (the SIMD copies; the scalar one works row by row)
 * ------------------------------------------------------------------------ */

#ifdef MM_SIMD
/* Row pointers of a tile; rows past the end repeat the last row (discarded). */
INLINE void tile_rows(const struct mm_job *jb, int r0, int mr, const uint8_t **rows)
{
    const uint8_t *base = jb->w->data;
    for (int r = 0; r < mr; r++) {
        int o = r0 + r < jb->w->n_out ? r0 + r : jb->w->n_out - 1;
        rows[r] = base + (size_t)o * jb->w->row_bytes;
    }
}

/* Token indices of a tile; tokens past the end repeat the last one. */
INLINE void tile_toks(const struct mm_job *jb, int t0, int nt, int *toks)
{
    for (int t = 0; t < nt; t++)
        toks[t] = t0 + t < jb->n_tok ? t0 + t : jb->n_tok - 1;
}

#define NT_MAX (Q_NT > F_NT ? Q_NT : F_NT)

/* Write the valid part of a tile's results. */
INLINE void tile_store(const struct mm_job *jb, int r0, int t0, int mr, int nt, float res[][NT_MAX])
{
    for (int t = 0; t < nt && t0 + t < jb->n_tok; t++)
        for (int r = 0; r < mr && r0 + r < jb->w->n_out; r++)
            jb->out[(size_t)(t0 + t) * (size_t)jb->w->n_out + (size_t)(r0 + r)] = res[r][t];
}
#endif

/* One float weight element, for tails and the scalar copy. */
INLINE float f_elem(enum ggml_type type, const uint8_t *row, int i)
{
    switch (type) {
    case GGML_TYPE_F32: {
        float v;
        memcpy(&v, row + 4 * (size_t)i, 4);
        return v;
    }
    case GGML_TYPE_F16:
        return qt_f16_to_f32(qt_rd16(row + 2 * (size_t)i));
    default:
        return qt_bf16_to_f32(qt_rd16(row + 2 * (size_t)i));
    }
}

#ifdef MM_SIMD

/* ------------------------------------------------------------------------
 * SIMD: float weights
 * ------------------------------------------------------------------------ */

#if defined(MM_AVX512)
typedef __m512 vf;
#define VF_N 16
#define vf_zero() _mm512_setzero_ps()
#define vf_loadu(p) _mm512_loadu_ps(p)
#define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vf_hsum(v) _mm512_reduce_add_ps(v)
INLINE vf vf_weights(enum ggml_type type, const uint8_t *p)
{
    switch (type) {
    case GGML_TYPE_F32:
        return _mm512_loadu_ps((const float *)p);
    case GGML_TYPE_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    default:
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    }
}
#else
typedef __m256 vf;
#define VF_N 8
#define vf_zero() _mm256_setzero_ps()
#define vf_loadu(p) _mm256_loadu_ps(p)
#define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#define vf_hsum(v) hsum8(v)
INLINE vf vf_weights(enum ggml_type type, const uint8_t *p)
{
    switch (type) {
    case GGML_TYPE_F32:
        return _mm256_loadu_ps((const float *)p);
    case GGML_TYPE_F16:
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    default:
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    }
}
#endif

/* mr rows x nt tokens of float weights, over the whole row. */
INLINE void f_tile(const struct mm_job *jb, enum ggml_type type, int r0, int t0, int mr, int nt)
{
    const int n_in = jb->w->n_in;
    const size_t esz = type == GGML_TYPE_F32 ? 4 : 2;
    const uint8_t *rows[F_MR];
    const float *xs[F_NT];
    int toks[F_NT];
    tile_rows(jb, r0, mr, rows);
    tile_toks(jb, t0, nt, toks);
    for (int t = 0; t < nt; t++)
        xs[t] = jb->x + (size_t)toks[t] * (size_t)n_in;

    vf acc[F_MR][F_NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            acc[r][t] = vf_zero();

    int i = 0;
    for (; i + VF_N <= n_in; i += VF_N) {
        vf wv[F_MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            wv[r] = vf_weights(type, rows[r] + esz * (size_t)i);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            vf xv = vf_loadu(xs[t] + i);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
                acc[r][t] = vf_fmadd(wv[r], xv, acc[r][t]);
        }
    }

    float res[F_MR][NT_MAX];
    for (int r = 0; r < mr; r++)
        for (int t = 0; t < nt; t++) {
            float s = vf_hsum(acc[r][t]);
            for (int k = i; k < n_in; k++)
                s += f_elem(type, rows[r], k) * xs[t][k];
            res[r][t] = s;
        }
    tile_store(jb, r0, t0, mr, nt, res);
}

/* ------------------------------------------------------------------------
 * SIMD: quantised weights
 *
 * Weights are decoded to unsigned bytes u = w + c (q4_0: the nibble, c = 8;
 * q8_0: w + 128 by flipping the top bit) and meet signed activations x:
 * sum(w x) = sum(u x) - c sum(x). The correction -c sum(x) depends only on
 * the activation block, so it is computed once per token and block (as the
 * dot product of c with -x, lane by lane) and shared by the tile's rows as
 * the starting value of each integer accumulator. AVX2's vpmaddubsw would
 * saturate on q8_0's u up to 255, so there q8_0 uses |w| and x with w's
 * sign instead (c = 0).
 * ------------------------------------------------------------------------ */

/* Offset c of the unsigned weight bytes (see above); 0: no correction. */
INLINE int q_offset(enum ggml_type type)
{
    switch (type) {
    case GGML_TYPE_Q4_0:
        return 8;
#if defined(MM_AVX512)
    case GGML_TYPE_Q8_0:
        return 128;
#endif
    default:
        return 0;
    }
}

/* The block of 32 at u: its weights as unsigned bytes w + c (AVX2 q8_0:
 * signed w) and its scale in every lane. */
INLINE __m256i q_unpack(enum ggml_type type, const uint8_t *u, __m256 *ws)
{
    *ws = f16_bcast(u);
    if (type == GGML_TYPE_Q8_0) {
        __m256i w = _mm256_loadu_si256((const __m256i *)(u + 2));
#if defined(MM_AVX512)
        w = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
#endif
        return w;
    }
    /* Q4_0: low nibbles are elements 0..15, high 16..31 */
    __m128i v = _mm_loadu_si128((const __m128i *)(u + 2));
    __m256i n = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(n, _mm256_set1_epi8(0x0f));
}

/* Block b of the rows' (at up[r]) for every row and token of a tile, in
 * 256-bit vectors. */
INLINE void q_block256(enum ggml_type type, int mr, int nt, const uint8_t *const *up,
                       const int8_t *const *xq, const float *const *xd, int b, __m256 acc[][Q_NT])
{
    const int c = q_offset(type);
    const __m256i zero = _mm256_setzero_si256();
    const __m256i cvec = _mm256_set1_epi8((char)c);
#if !defined(MM_AVX512)
    const __m256i ones16 = _mm256_set1_epi16(1);
#endif
    __m256i w[Q_MR];
    __m256 ws[Q_MR];
#if !defined(MM_AVX512)
    __m256i wabs[Q_MR];
#endif
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) {
        w[r] = q_unpack(type, up[r], &ws[r]);
#if !defined(MM_AVX512)
        if (type == GGML_TYPE_Q8_0)
            wabs[r] = _mm256_sign_epi8(w[r], w[r]);
#endif
    }
#pragma GCC unroll 4
    for (int t = 0; t < nt; t++) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(xq[t] + QT_QK * b));
        __m256 dx = _mm256_set1_ps(xd[t][b]);
        /* -c * (sums of four consecutive x), the accumulators' start */
        __m256i xb = zero;
        if (c) {
            __m256i nx = _mm256_sub_epi8(zero, x);
#if defined(MM_AVX512)
            xb = _mm256_dpbusd_epi32(zero, cvec, nx);
#else
            xb = _mm256_madd_epi16(_mm256_maddubs_epi16(cvec, nx), ones16);
#endif
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            __m256i isum;
#if defined(MM_AVX512)
            isum = _mm256_dpbusd_epi32(xb, w[r], x);
#else
            if (type == GGML_TYPE_Q8_0)
                isum = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs[r], _mm256_sign_epi8(x, w[r])),
                                         ones16);
            else
                isum =
                    _mm256_add_epi32(xb, _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], x), ones16));
#endif
            acc[r][t] =
                _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(ws[r], dx), acc[r][t]);
        }
    }
}

/* Tile setup shared by both widths: row and activation pointers. */
struct qtile {
    const uint8_t *rows[Q_MR];
    const int8_t *xq[Q_NT];
    const float *xd[Q_NT];
};

INLINE void qtile_init(const struct mm_job *jb, int r0, int t0, int mr, int nt, struct qtile *q)
{
    int toks[Q_NT];
    tile_rows(jb, r0, mr, q->rows);
    tile_toks(jb, t0, nt, toks);
    for (int t = 0; t < nt; t++) {
        q->xq[t] = jb->xa.q + (size_t)toks[t] * jb->xa.ldq;
        q->xd[t] = jb->xa.d + (size_t)toks[t] * jb->xa.ldb;
    }
}

/* Bytes of a block of 32. */
INLINE size_t block_bytes(enum ggml_type type)
{
    return type == GGML_TYPE_Q8_0 ? 34 : 18;
}

#if defined(MM_AVX512)

/* Lane selectors for the scales of two blocks: (0 x8, 1 x8), or (0, 1, 0, 1) x4 for q4_0. */
INLINE __m512i pair_sel(int interleaved)
{
    return interleaved ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                       : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
}

/* Two f16 block scales spread over the lanes of their blocks. */
INLINE __m512 scale_pair(const uint8_t *p0, const uint8_t *p1, int interleaved)
{
    __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(qt_rd16(p0) | ((uint32_t)qt_rd16(p1) << 16))));
    return _mm512_permutexvar_ps(pair_sel(interleaved), _mm512_castps128_ps512(d));
}

/*
 * The two blocks at u as 64 unsigned bytes w + c, and their 16 lane
 * scales. Lanes follow the activation bytes, except q4_0, whose 16-byte
 * lanes hold (block 0 elements 0..15, block 1 0..15, block 0 16..31,
 * block 1 16..31); its activations are permuted to match.
 */
INLINE __m512i q_unpack2(enum ggml_type type, const uint8_t *u, __m512 *ws)
{
    if (type == GGML_TYPE_Q8_0) {
        *ws = scale_pair(u, u + 34, 0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(u + 2));
        __m256i b = _mm256_loadu_si256((const __m256i *)(u + 36));
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1),
                                _mm512_set1_epi8((char)0x80));
    }
    /* Q4_0 */
    *ws = scale_pair(u, u + 18, 1);
    __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(u + 20)),
                                 _mm_loadu_si128((const __m128i *)(u + 2)));
    __m512i n = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(n, _mm512_set1_epi8(0x0f));
}

INLINE void q_tile(const struct mm_job *jb, enum ggml_type type, int r0, int t0, int mr, int nt)
{
    const int c = q_offset(type);
    const size_t bb = block_bytes(type);
    const int nb = jb->w->n_in / QT_QK; /* blocks of 32 */
    struct qtile q;
    qtile_init(jb, r0, t0, mr, nt, &q);

    __m512 acc[Q_MR][Q_NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            acc[r][t] = _mm512_setzero_ps();
    const __m512i zero = _mm512_setzero_si512();
    const __m512i cvec = _mm512_set1_epi8((char)c);
    /* activation scales of blocks (b, b+1) spread over the lanes */
    const __m512i dsel = pair_sel(type == GGML_TYPE_Q4_0);

    /* b: the first block of the pair along the row */
    for (int b = 0; b + 1 < nb; b += 2) {
        __m512i w[Q_MR];
        __m512 ws[Q_MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            w[r] = q_unpack2(type, q.rows[r] + (size_t)b * bb, &ws[r]);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m512i x = _mm512_loadu_si512((const void *)(q.xq[t] + QT_QK * b));
            if (type == GGML_TYPE_Q4_0)
                x = _mm512_shuffle_i64x2(x, x, _MM_SHUFFLE(3, 1, 2, 0));
            __m128 d2 = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(q.xd[t] + b)));
            __m512 dx = _mm512_permutexvar_ps(dsel, _mm512_castps128_ps512(d2));
            __m512i xb = _mm512_dpbusd_epi32(zero, cvec, _mm512_sub_epi8(zero, x));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                __m512i isum = _mm512_dpbusd_epi32(xb, w[r], x);
                acc[r][t] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(ws[r], dx), acc[r][t]);
            }
        }
    }

    float res[Q_MR][NT_MAX];
    if (nb & 1) {
        /* an odd last block */
        __m256 tail[Q_MR][Q_NT];
        const uint8_t *up[Q_MR];
        for (int r = 0; r < mr; r++) {
            up[r] = q.rows[r] + (size_t)(nb - 1) * bb;
            for (int t = 0; t < nt; t++)
                tail[r][t] = _mm256_setzero_ps();
        }
        q_block256(type, mr, nt, up, q.xq, q.xd, nb - 1, tail);
        for (int r = 0; r < mr; r++)
            for (int t = 0; t < nt; t++)
                res[r][t] = _mm512_reduce_add_ps(acc[r][t]) + hsum8(tail[r][t]);
    } else {
        for (int r = 0; r < mr; r++)
            for (int t = 0; t < nt; t++)
                res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
    }
    tile_store(jb, r0, t0, mr, nt, res);
}

#else /* AVX2 */

INLINE void q_tile(const struct mm_job *jb, enum ggml_type type, int r0, int t0, int mr, int nt)
{
    const size_t bb = block_bytes(type);
    const int nb = jb->w->n_in / QT_QK;
    struct qtile q;
    qtile_init(jb, r0, t0, mr, nt, &q);

    __m256 acc[Q_MR][Q_NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            acc[r][t] = _mm256_setzero_ps();

    for (int b = 0; b < nb; b++) {
        const uint8_t *up[Q_MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            up[r] = q.rows[r] + (size_t)b * bb;
        q_block256(type, mr, nt, up, q.xq, q.xd, b, acc);
    }

    float res[Q_MR][NT_MAX];
    for (int r = 0; r < mr; r++)
        for (int t = 0; t < nt; t++)
            res[r][t] = hsum8(acc[r][t]);
    tile_store(jb, r0, t0, mr, nt, res);
}

#endif /* AVX2 */

/*
 * One group of rows: token tiles outside (an activation tile is reused
 * across the group's rows from cache), row tiles inside, each tile over
 * whole rows. A lone last token uses a 1-token tile, which sums in the same
 * order: a token's result does not depend on the batch it came in.
 */
INLINE void group_simd(const struct mm_job *jb, enum ggml_type type, int g)
{
    const bool fl = mm_is_float_type(type);
    const int g0 = g * MM_GROUP;
    const int g1 = g0 + MM_GROUP < jb->w->n_out ? g0 + MM_GROUP : jb->w->n_out;
    for (int t0 = 0; t0 < jb->n_tok; t0 += fl ? F_NT : Q_NT) {
        bool one = jb->n_tok - t0 == 1;
        for (int r0 = g0; r0 < g1; r0 += fl ? F_MR : Q_MR) {
            if (fl) {
                if (one)
                    f_tile(jb, type, r0, t0, F_MR, 1);
                else
                    f_tile(jb, type, r0, t0, F_MR, F_NT);
            } else {
                if (one)
                    q_tile(jb, type, r0, t0, Q_MR, 1);
                else
                    q_tile(jb, type, r0, t0, Q_MR, Q_NT);
            }
        }
    }
}

static void run_group(const struct mm_job *jb, int g)
{
    switch (jb->w->type) {
    case GGML_TYPE_F32:
        group_simd(jb, GGML_TYPE_F32, g);
        break;
    case GGML_TYPE_F16:
        group_simd(jb, GGML_TYPE_F16, g);
        break;
    case GGML_TYPE_BF16:
        group_simd(jb, GGML_TYPE_BF16, g);
        break;
    case GGML_TYPE_Q8_0:
        group_simd(jb, GGML_TYPE_Q8_0, g);
        break;
    case GGML_TYPE_Q4_0:
        group_simd(jb, GGML_TYPE_Q4_0, g);
        break;
    default: /* quant_blocks.c's formats */
        mm_blocks_rows(jb->w, &jb->xa, jb->out, jb->n_tok, g * MM_GROUP,
                       g * MM_GROUP + MM_GROUP < jb->w->n_out ? g * MM_GROUP + MM_GROUP
                                                              : jb->w->n_out);
        break;
    }
}

#else /* !MM_SIMD */

/* ------------------------------------------------------------------------
 * Portable scalar kernels
 * ------------------------------------------------------------------------ */

/* Decode block b (32 weights) of a q8_0 or q4_0 row: integers and scale. */
static float q_block_scalar(enum ggml_type type, const uint8_t *row, int b, int8_t *w)
{
    if (type == GGML_TYPE_Q8_0) {
        const uint8_t *u = row + 34 * (size_t)b;
        memcpy(w, u + 2, 32);
        return qt_f16_to_f32(qt_rd16(u));
    }
    const uint8_t *u = row + 18 * (size_t)b;
    for (int k = 0; k < 16; k++) {
        w[k] = (int8_t)((u[2 + k] & 0x0f) - 8);
        w[k + 16] = (int8_t)((u[2 + k] >> 4) - 8);
    }
    return qt_f16_to_f32(qt_rd16(u));
}

/* One row against every token: decode each block once, use it n_tok times. */
static void row_scalar(const struct mm_job *jb, int o)
{
    const struct mm_weight *w = jb->w;
    const uint8_t *row = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
    float *out = jb->out + o;
    const size_t ldo = (size_t)w->n_out;
    for (int t = 0; t < jb->n_tok; t++)
        out[(size_t)t * ldo] = 0.0f;

    if (mm_is_float_type(w->type)) {
        float wb[64];
        for (int i0 = 0; i0 < w->n_in; i0 += 64) {
            int n = w->n_in - i0 < 64 ? w->n_in - i0 : 64;
            for (int k = 0; k < n; k++)
                wb[k] = f_elem(w->type, row, i0 + k);
            for (int t = 0; t < jb->n_tok; t++) {
                const float *x = jb->x + (size_t)t * (size_t)w->n_in + i0;
                /* eight partial sums: a fixed order the compiler can vectorise */
                float s8[8] = {0};
                int k = 0;
                for (; k + 8 <= n; k += 8)
                    for (int l = 0; l < 8; l++)
                        s8[l] += wb[k + l] * x[k + l];
                float s = ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));
                for (; k < n; k++)
                    s += wb[k] * x[k];
                out[(size_t)t * ldo] += s;
            }
        }
        return;
    }

    int nb = w->n_in / QT_QK;
    for (int b = 0; b < nb; b++) {
        int8_t wq[32];
        float ws = q_block_scalar(w->type, row, b, wq);
        for (int t = 0; t < jb->n_tok; t++) {
            const int8_t *xq = jb->xa.q + (size_t)t * jb->xa.ldq + QT_QK * (size_t)b;
            int dot = 0;
            for (int k = 0; k < 32; k++)
                dot += wq[k] * xq[k];
            float dx = jb->xa.d[(size_t)t * jb->xa.ldb + b];
            out[(size_t)t * ldo] += dx * (ws * (float)dot);
        }
    }
}

static void run_group(const struct mm_job *jb, int g)
{
    int g0 = g * MM_GROUP;
    int g1 = g0 + MM_GROUP < jb->w->n_out ? g0 + MM_GROUP : jb->w->n_out;
    if (qt_is_block_type(jb->w->type)) {
        mm_blocks_rows(jb->w, &jb->xa, jb->out, jb->n_tok, g0, g1);
        return;
    }
    for (int o = g0; o < g1; o++)
        row_scalar(jb, o);
}

#endif /* MM_SIMD */

const struct mm_kernels KERN(mm_kernels) = {
#if defined(MM_AVX512)
    .name = "avx512-vnni",
#elif defined(MM_AVX2)
    .name = "avx2",
#else
    .name = "scalar",
#endif
    .quantize_x = quantize_x,
    .run_group = run_group,
};
