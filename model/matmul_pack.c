/*
 * matmul_pack.c - out[t][o] = sum_i W[o][i] * x[t][i] over weights
 * repacked at load (matmul_internal.h's layouts, written by
 * matmul_pack_run.c): the prefill microkernels.
 *
 * ---------------------------------------------------------------------------
 * Why repack
 * ---------------------------------------------------------------------------
 *
 * matmul.c reads weights as GGUF stores them, row after row. A register
 * tile of a few rows x a few tokens then holds, per row and token, a
 * vector of partial sums along the row that must be scaled per block and,
 * at the end, summed across its lanes: for q8_0 every vpdpbusd (64 products)
 * comes with a conversion, a scale multiply and an add, so at most a
 * quarter of the instructions are the products themselves (~25% of the
 * VNNI peak measured, whatever the tile).
 *
 * Stored in groups of 16 rows interleaved by 4 bytes, one 64-byte load
 * holds 4 consecutive weights of each of 16 rows, and one vpdpbusd against
 * the token's 4 matching activations broadcast to every lane (an embedded
 * broadcast from memory, no extra instruction) adds 4 products to each
 * row's own i32 lane: the lanes ARE the output rows, nothing is summed
 * across lanes, and a block of 32 costs 8 vpdpbusd per (16 rows, token)
 * plus one conversion, one multiply and one fused add to apply the scales
 * (the block's 16 weight scales are one more 32-byte load per tile, shared
 * by its tokens). At most 8 / 11 of the instructions are products.
 *
 * ---------------------------------------------------------------------------
 * Numerics
 * ---------------------------------------------------------------------------
 *
 * The same as matmul.c's q8_0 path: the activations quantised per block of
 * 32 by the same function (q = round-to-even(x * 127 / max|x|), d =
 * max|x| / 127), integer sums exact, then per block acc += (float)isum *
 * (w_scale * d). vpdpbusd multiplies unsigned by signed bytes, so the
 * weights are stored as w + 128 and each token's block starts its sum at
 * -128 * sum(q) (computed once per token and block by the entry), which
 * makes the integer sum exactly sum(w q). Only the f32 summation order
 * differs from matmul.c: one chain per row along the blocks, instead of
 * lanes summed at the end.
 *
 * ---------------------------------------------------------------------------
 * Tiles and invariance
 * ---------------------------------------------------------------------------
 *
 * A tile is P_MG groups (32 rows) x P_NT tokens: 12 i32 and 12 f32
 * accumulators of the 32 zmm registers, 2 weight vectors, the rest
 * temporaries. Its weights (2 x 544 bytes per block) are loaded once per
 * P_NT tokens, its activations once per 32 rows. Each (row, token) sum is
 * the same sequence of operations in every tile shape (the tails use
 * smaller tiles of the same code), so a token's results depend neither on
 * the other tokens of the batch nor on how the groups are split among
 * threads; decoding one token runs this same kernel (a 2 x 1 tile, which
 * streams a group's weights as one sequential read).
 *
 * Levels: only avx512 (with VNNI) has these kernels; at the other levels
 * the repacked copy is not made (see matmul_pack_run.c), and matmul.c runs.
 */
#include "model/matmul_internal.h"
#include "model/matmul_simd.h"

#if defined(KERN_AVX512)

#define P_MG 2          /* row groups per tile */
#define P_NT MM_PACK_NT /* tokens per tile */

/* mg groups from g0 x nt tokens of token tile j, q8_0. mg and nt are
 * constants where this is inlined, so the loops below unroll into
 * registers; a tile's activations are one pointer apart by constants. */
INLINE void q8_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int nt)
{
    const struct mm_weight *w = jb->w;
    const int nb = w->n_in / QT_QK;
    const size_t gb = mm_pack_group_bytes(w);
    const uint8_t *gq[P_MG], *gs[P_MG];
    for (int g = 0; g < mg; g++) {
        gq[g] = (const uint8_t *)w->packed + (size_t)(g0 + g) * gb;
        gs[g] = gq[g] + (size_t)nb * MM_PACK_Q8_QUANTS;
    }
    const size_t at = (size_t)j * (size_t)nb * P_NT;
    const int8_t *xq = jb->q + at * QT_QK;
    const float *xd = jb->d + at;
    const int32_t *xc = jb->c + at;

    __m512 acc[P_MG][P_NT];
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            acc[g][t] = _mm512_setzero_ps();

    for (int b = 0; b < nb; b++, xq += P_NT * QT_QK, xd += P_NT, xc += P_NT) {
        __m512i ia[P_MG][P_NT];
        for (int t = 0; t < nt; t++) {
            __m512i c = _mm512_set1_epi32(xc[t]);
            for (int g = 0; g < mg; g++)
                ia[g][t] = c;
        }
        for (int k = 0; k < 8; k++) {
            __m512i wv[P_MG];
            for (int g = 0; g < mg; g++)
                wv[g] = _mm512_load_si512(
                    (const void *)(gq[g] + (size_t)b * MM_PACK_Q8_QUANTS + 64 * k));
            for (int t = 0; t < nt; t++) {
                int32_t x4;
                memcpy(&x4, xq + QT_QK * t + 4 * k, 4);
                __m512i xv = _mm512_set1_epi32(x4);
                for (int g = 0; g < mg; g++)
                    ia[g][t] = _mm512_dpbusd_epi32(ia[g][t], wv[g], xv);
            }
        }
        __m512 sc[P_MG];
        for (int g = 0; g < mg; g++)
            sc[g] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(gs[g] + 32 * (size_t)b)));
        for (int t = 0; t < nt; t++) {
            __m512 dx = _mm512_set1_ps(xd[t]);
            for (int g = 0; g < mg; g++)
                acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[g][t]), _mm512_mul_ps(sc[g], dx),
                                            acc[g][t]);
        }
    }

    /* the rows that exist: a padded last group stores fewer lanes */
    const int t0 = j * P_NT;
    for (int g = 0; g < mg; g++) {
        int o0 = (g0 + g) * MM_PACK_ROWS, n = w->n_out - o0;
        __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
        for (int t = 0; t < nt; t++)
            _mm512_mask_storeu_ps(jb->out + (size_t)(t0 + t) * (size_t)w->n_out + (size_t)o0, m,
                                  acc[g][t]);
    }
}

/* The tile for nt tokens (1..P_NT), with constant arguments. */
#define Q8_TILES(mg)                                                                               \
    static void q8_tile_##mg(const struct mm_pack_job *jb, int g0, int j, int nt)                  \
    {                                                                                              \
        switch (nt) {                                                                              \
        case 1:                                                                                    \
            q8_tile(jb, g0, mg, j, 1);                                                             \
            break;                                                                                 \
        case 2:                                                                                    \
            q8_tile(jb, g0, mg, j, 2);                                                             \
            break;                                                                                 \
        case 3:                                                                                    \
            q8_tile(jb, g0, mg, j, 3);                                                             \
            break;                                                                                 \
        case 4:                                                                                    \
            q8_tile(jb, g0, mg, j, 4);                                                             \
            break;                                                                                 \
        case 5:                                                                                    \
            q8_tile(jb, g0, mg, j, 5);                                                             \
            break;                                                                                 \
        default:                                                                                   \
            q8_tile(jb, g0, mg, j, P_NT);                                                          \
            break;                                                                                 \
        }                                                                                          \
    }
Q8_TILES(1)
Q8_TILES(2)

/* Row groups outside, token tiles inside: the groups' weights stay in
 * cache while every token passes. */
static void groups_avx512(const struct mm_pack_job *jb, int g0, int g1)
{
    for (int g = g0; g < g1; g += P_MG) {
        int mg = g1 - g < P_MG ? g1 - g : P_MG;
        for (int j = 0; j * P_NT < jb->n_tok; j++) {
            int nt = jb->n_tok - j * P_NT < P_NT ? jb->n_tok - j * P_NT : P_NT;
            if (mg == 2)
                q8_tile_2(jb, g, j, nt);
            else
                q8_tile_1(jb, g, j, nt);
        }
    }
}

static bool has_avx512(enum ggml_type type)
{
    return type == GGML_TYPE_Q8_0;
}

const struct mm_pack_kernels KERN(mm_pack_kernels) = {
    .name = "avx512-vnni 16-row",
    .has = has_avx512,
    .groups = groups_avx512,
};

#else /* no kernels over repacked weights at this level */

static bool has_none(enum ggml_type type)
{
    (void)type;
    return false;
}

const struct mm_pack_kernels KERN(mm_pack_kernels) = {
    .name = NULL,
    .has = has_none,
    .groups = NULL,
};

#endif
