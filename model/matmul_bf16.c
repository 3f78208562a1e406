/*
 * matmul_bf16.c - out[t][o] = sum_i W[o][i] * x[t][i] with AVX-512 BF16's
 * vdpbf16ps over weights repacked in bf16 pairs (matmul_bf16.h's layout,
 * written at load by matmul_pack_run.c).
 *
 * ---------------------------------------------------------------------------
 * Why a dot product of pairs
 * ---------------------------------------------------------------------------
 *
 * matmul_pack.c's float tile spends one f32 FMA per (row, token, input):
 * 16 products per instruction, and on this core the FMA is the limit. One
 * vdpbf16ps multiplies 16 lanes x 2 bf16 pairs and adds both products to
 * the lane's f32 sum: 32 products per instruction at the FMA's issue rate
 * (bench_prefill measures both peaks beside each other). Stored with the
 * 16 rows' pairs side by side, one 64-byte load holds inputs 2p and 2p + 1
 * of every row of a group, and the token's pair (x[2p], x[2p + 1]) comes
 * broadcast from memory: as in matmul_pack.c, the lanes are the output
 * rows and nothing is summed across lanes. A tile is 2 groups (32 rows) x
 * 12 tokens: 24 accumulators, 2 weight loads per 24 dot products. A
 * decoding batch (MM_PACK_NARROW tokens at most) takes up to 8 groups,
 * four pairs, so that more than two chains of vdpbf16ps are in flight
 * (matmul_pack.c, "Narrow tiles"); its pairs are each one sequential stream.
 *
 * ---------------------------------------------------------------------------
 * Numerics
 * ---------------------------------------------------------------------------
 *
 * The weights are bf16: exact for a BF16 file; for F16 (only when asked,
 * see matmul_bf16.h) rounded to nearest at load. The activations are
 * rounded to bf16 here (to nearest even, the same bits as qt_f32_to_bf16),
 * a relative error of at most 2^-8 each. The product of two bf16 (8
 * significant bits each) is exact in f32, and vdpbf16ps adds the lane's
 * two products to the f32 sum one after the other, each addition rounded
 * to nearest (bf16 subnormal inputs and subnormal results count as zero,
 * as the instruction defines). So an output is the exact sum over the
 * rounded activations, plus n_in f32 roundings of the running sum: the
 * bound tests/test_bf16.c checks. Each (row, token) sum is the same
 * sequence of instructions in every tile shape (the tails use smaller
 * tiles of the same code, a token's pairs sit in its own column), so a
 * result depends neither on the other tokens of the batch nor on how the
 * groups are split among threads, and decoding one token (a 2 x 1 tile,
 * streaming its pair of groups as one sequential read) is the same
 * computation as the prefill.
 *
 * Levels: only the avx512 copy has these kernels, compiled for the
 * avx512bf16 target function by function (the rest of the level does not
 * assume it), and matmul_pack_run.c calls them only while cpu_bf16(): for
 * F16 weights asked to round (KVD_F16=bf16), and for BF16 weights where
 * vdpbf16ps outruns the FMA, AMX's tiles run them (on a weight whose
 * rows are no multiple of 32 inputs, these kernels), or KVD_BF16=pairs
 * asks (mm_bf16_in_pairs).
 */
#include "model/matmul_bf16.h"

#include "model/matmul_simd.h"

#if defined(KERN_AVX512)

#define BF16_FN __attribute__((target("avx512bf16")))
#define BF16_INLINE static inline __attribute__((always_inline, target("avx512bf16")))

#define B_MG 2          /* row groups per tile */
#define N_MG 8          /* row groups per narrow tile (matmul_internal.h's MM_PACK_NARROW) */
#define B_NT MM_BF16_NT /* tokens per tile */

/* A decoding tile asks for its weights MM_PACK_PREFETCH bytes ahead of
 * each pair's stream into L1 (matmul_pack.c's "Decoding": 0.69 -> ~0.8 of
 * the bus on the 576x30 step). */

/* Token t's pairs into its column of its tile: 16 inputs (8 pairs) at a time. */
static void round_avx512(const struct mm_pack_job *jb, const float *x, int t)
{
    const int n_in = jb->w->n_in;
    uint32_t *dst = jb->xb + (size_t)(t / B_NT) * (size_t)mm_bf16_pairs(jb->w) * B_NT +
                    (size_t)(t % B_NT);
    int i = 0;
    for (; i + 16 <= n_in; i += 16, dst += 8 * B_NT) {
        uint32_t pairs[8];
        _mm256_storeu_si256((__m256i *)pairs,
                            _mm512_cvtepi32_epi16(round16(_mm512_loadu_ps(x + i))));
        for (int p = 0; p < 8; p++)
            dst[p * B_NT] = pairs[p];
    }
    for (; i < n_in; i += 2, dst += B_NT) {
        uint32_t lo = qt_f32_to_bf16(x[i]), hi = i + 1 < n_in ? qt_f32_to_bf16(x[i + 1]) : 0;
        *dst = lo | hi << 16;
    }
}

/* Group g's outputs for nt tokens from t0: the rows that exist. */
INLINE void store_group(const struct mm_pack_job *jb, int g, int t0, int nt, const __m512 *acc)
{
    const int o0 = g * MM_PACK_ROWS, n = jb->w->n_out - o0;
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    for (int t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(jb->out + (size_t)(t0 + t) * (size_t)jb->w->n_out + (size_t)o0, m,
                              acc[t]);
}

/* mg groups from g0 x nt tokens of token tile j: one f32 chain per row and
 * token along the pairs. mg and nt are constants where this is inlined. */
BF16_INLINE void b_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int nt)
{
    const struct mm_weight *w = jb->w;
    const int np = mm_bf16_pairs(w);
    /* the pair of g0 (even: tiles start on pairs): group g's line of input
     * pair p at p * 128 + 64 g */
    const uint8_t *pp[N_MG / 2];
    for (int h = 0; h < (mg + 1) / 2; h++)
        pp[h] = (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_bf16_pair_bytes(w);
    const uint32_t *xt = jb->xb + (size_t)j * (size_t)np * B_NT;

    __m512 acc[N_MG][B_NT];
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            acc[g][t] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++, xt += B_NT) {
        if (nt == 1) /* decoding: 128 bytes per pair and input pair */
            prefetch_pairs(pp, mg, (size_t)p * 128, 128, MM_PACK_PREFETCH);
        __m512bh wv[N_MG];
        for (int g = 0; g < mg; g++)
            wv[g] = (__m512bh)_mm512_load_si512(
                (const void *)(pp[g / 2] + (size_t)p * 128 + 64 * (g % 2)));
        for (int t = 0; t < nt; t++) {
            __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xt[t]);
            for (int g = 0; g < mg; g++)
                acc[g][t] = _mm512_dpbf16_ps(acc[g][t], wv[g], xv);
        }
    }
    for (int g = 0; g < mg; g++)
        store_group(jb, g0 + g, j * B_NT, nt, acc[g]);
}

#define B_CASE(n)                                                                                  \
    case n:                                                                                        \
        b_tile(jb, g0, mg, j, n);                                                                  \
        break;

/* The tile for nt tokens (1..B_NT), mg constant. */
#define B_TILES(mg_)                                                                               \
    BF16_FN static void b_tile_##mg_(const struct mm_pack_job *jb, int g0, int j, int nt)          \
    {                                                                                              \
        const int mg = mg_;                                                                        \
        switch (nt) {                                                                              \
            B_CASE(1)                                                                              \
            B_CASE(2)                                                                              \
            B_CASE(3)                                                                              \
            B_CASE(4)                                                                              \
            B_CASE(5)                                                                              \
            B_CASE(6)                                                                              \
            B_CASE(7)                                                                              \
            B_CASE(8)                                                                              \
            B_CASE(9)                                                                              \
            B_CASE(10)                                                                             \
            B_CASE(11)                                                                             \
        default:                                                                                   \
            b_tile(jb, g0, mg, j, B_NT);                                                           \
            break;                                                                                 \
        }                                                                                          \
    }
B_TILES(1)
B_TILES(2)

/* The narrow tiles: mg (3 to N_MG) groups for nt tokens (1..MM_PACK_NARROW). */
#define B_NARROW(mg_)                                                                              \
    BF16_FN static void b_tile_##mg_(const struct mm_pack_job *jb, int g0, int j, int nt)          \
    {                                                                                              \
        if (nt == 1)                                                                               \
            b_tile(jb, g0, mg_, j, 1);                                                             \
        else                                                                                       \
            b_tile(jb, g0, mg_, j, MM_PACK_NARROW);                                                \
    }
B_NARROW(3)
B_NARROW(4)
B_NARROW(5)
B_NARROW(6)
B_NARROW(7)
B_NARROW(8)

/* Row groups outside, token tiles inside: the groups' pairs stay in cache
 * while every token passes. A batch of MM_PACK_NARROW tokens at most
 * (decoding) is one narrow tile, taken N_MG groups at a time, as in
 * matmul_pack.c. */
static void groups_avx512(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1)
{
    const int step = jb->n_tok <= MM_PACK_NARROW ? N_MG : B_MG;
    for (int g = g0; g < g1; g += step) {
        const int mg = g1 - g < step ? g1 - g : step;
        for (int j = j0; j < j1; j++) {
            const int nt = jb->n_tok - j * B_NT < B_NT ? jb->n_tok - j * B_NT : B_NT;
            switch (mg) {
            case 1:
                b_tile_1(jb, g, j, nt);
                break;
            case 2:
                b_tile_2(jb, g, j, nt);
                break;
            case 3:
                b_tile_3(jb, g, j, nt);
                break;
            case 4:
                b_tile_4(jb, g, j, nt);
                break;
            case 5:
                b_tile_5(jb, g, j, nt);
                break;
            case 6:
                b_tile_6(jb, g, j, nt);
                break;
            case 7:
                b_tile_7(jb, g, j, nt);
                break;
            default:
                b_tile_8(jb, g, j, nt);
                break;
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * The copy in pairs, at load
 *
 * Each group is a transpose: 16 stored rows in, for every pair of inputs
 * one 64-byte line of the 16 rows' pairs out. Per 16 inputs, each row's
 * elements become 8 pairs in one register (f16 rounded to bf16 on the
 * way, bf16 as stored), two 8 x 8 transposes of 32-bit pairs turn the 16
 * registers into the 8 lines, and the lines are stored whole. An element
 * at a time, through f32, the same copy of a SmolLM-shaped model took
 * about three times as long from f16 as from bf16, most of a second.
 * The rounding is round16's, so the bits are qt_f32_to_bf16's of the
 * exact f32 of each f16 (tests/test_bf16.c compares all 65,536).
 * ------------------------------------------------------------------------ */

/* Element k of a stored row as bf16 (0 past the row's end or for a row
 * past n_out): the inputs after the last whole 16. */
static uint32_t bf16_at(const struct mm_weight *w, const uint8_t *row, int k)
{
    if (!row || k >= w->n_in)
        return 0;
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)k, 2);
    return w->type == GGML_TYPE_BF16 ? h : qt_f32_to_bf16(qt_f16_to_f32(h));
}

/* Inputs k..k+15 of a stored row as 8 bf16 pairs (zeros for no row). */
INLINE __m256i pairs8(const struct mm_weight *w, const uint8_t *row, int k)
{
    if (!row)
        return _mm256_setzero_si256();
    const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * (size_t)k));
    if (w->type == GGML_TYPE_BF16)
        return h;
    return _mm512_cvtepi32_epi16(round16(_mm512_cvtph_ps(h)));
}

/* r[i] lane j <- r[j] lane i, for 8 registers of 8 32-bit lanes. */
INLINE void transpose8(__m256i r[8])
{
    __m256 b[8], c[8];
    for (int i = 0; i < 8; i += 2) {
        b[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
        b[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(r[i]), _mm256_castsi256_ps(r[i + 1]));
    }
    for (int i = 0; i < 8; i += 4) { /* c[i + m]: lanes m and 4 + m of rows i..i+3 */
        c[i] = _mm256_shuffle_ps(b[i], b[i + 2], 0x44);
        c[i + 1] = _mm256_shuffle_ps(b[i], b[i + 2], 0xee);
        c[i + 2] = _mm256_shuffle_ps(b[i + 1], b[i + 3], 0x44);
        c[i + 3] = _mm256_shuffle_ps(b[i + 1], b[i + 3], 0xee);
    }
    for (int m = 0; m < 4; m++) {
        r[m] = _mm256_castps_si256(_mm256_permute2f128_ps(c[m], c[4 + m], 0x20));
        r[4 + m] = _mm256_castps_si256(_mm256_permute2f128_ps(c[m], c[4 + m], 0x31));
    }
}

/* Group g of w (bf16 or f16) in pairs into its lines of a pair: pair p's
 * line at dst + p * 2 * MM_PACK_ROWS (matmul_bf16.h's layout). */
static void pack_group(const struct mm_weight *w, size_t g, uint32_t *dst)
{
    const size_t line = 2 * MM_PACK_ROWS; /* 32-bit words from one pair's line to the next */
    const uint8_t *rows[MM_PACK_ROWS];
    for (int r = 0; r < MM_PACK_ROWS; r++) {
        size_t o = g * MM_PACK_ROWS + (size_t)r;
        rows[r] = o < (size_t)w->n_out ? (const uint8_t *)w->data + o * w->row_bytes : NULL;
    }
    int k = 0;
    for (; k + 16 <= w->n_in; k += 16) {
        __m256i lo[8], hi[8]; /* rows 0..7 and 8..15 */
        for (int r = 0; r < 8; r++) {
            lo[r] = pairs8(w, rows[r], k);
            hi[r] = pairs8(w, rows[8 + r], k);
        }
        transpose8(lo);
        transpose8(hi);
        for (int p = 0; p < 8; p++)
            _mm512_store_si512((void *)(dst + (size_t)(k / 2 + p) * line),
                               _mm512_inserti64x4(_mm512_castsi256_si512(lo[p]), hi[p], 1));
    }
    for (int q = k / 2; q < mm_bf16_pairs(w); q++)
        for (int r = 0; r < MM_PACK_ROWS; r++)
            dst[(size_t)q * line + (size_t)r] =
                bf16_at(w, rows[r], 2 * q) | bf16_at(w, rows[r], 2 * q + 1) << 16;
}

/* Pair pp of groups (2 pp, 2 pp + 1) into dst, the two groups' lines
 * alternating. */
static void pack_pair_avx512(const struct mm_weight *w, size_t pp, uint32_t *dst)
{
    pack_group(w, 2 * pp, dst);
    pack_group(w, 2 * pp + 1, dst + MM_PACK_ROWS);
}

const struct mm_bf16_kernels KERN(mm_bf16_kernels) = {
    .name = "avx512bf16 16-row pairs",
    .round = round_avx512,
    .pack_pair = pack_pair_avx512,
    .groups = groups_avx512,
};

#else /* no bf16 kernels at this level */

const struct mm_bf16_kernels KERN(mm_bf16_kernels) = {
    .name = NULL,
    .round = NULL,
    .pack_pair = NULL,
    .groups = NULL,
};

#endif
