/*
 * matmul_pack_avx2.c - the AVX2 kernels over repacked weights, every copy
 * matmul_pack.c multiplies (f32, f16, bf16; q8_0; q4_0, q4_1, q5_0,
 * q5_1, iq4_nl, iq4_xs; q4_K) in 256-bit registers, for CPUs without
 * AVX-512 (a Zen 3 EPYC, a desktop core). The copies are the ones the
 * AVX-512 kernels read (matmul_internal.h), byte for byte, and the
 * results their bits.
 *
 * ---------------------------------------------------------------------------
 * Why
 * ---------------------------------------------------------------------------
 *
 * Without these, an AVX2 CPU multiplies weights as GGUF stores them
 * (matmul.c: a tile of 2 rows x 4 tokens, each (row, token) a vector of
 * partial sums along the row summed across its lanes at the end; the
 * nibble formats decoded block by block in C-like steps, at a tenth of
 * the bus when decoding). The
 * repacked copy (matmul_internal.h: per input k, one group's 16 rows side
 * by side, then the other group's) lets a lane be an output row, as in
 * matmul_pack.c's essay: one load (and for f16/bf16 one exact widening)
 * gives 8 rows' weights of input k, one FMA against the token's x[k]
 * broadcast adds them to the rows' own sums, nothing is summed across
 * lanes, and a thread streams its pairs of groups as one run of bytes.
 *
 * ---------------------------------------------------------------------------
 * Tiles
 * ---------------------------------------------------------------------------
 *
 * AVX2 has 16 vector registers. A wide tile is one group (its 16 rows are
 * two vectors) x A_NT = 6 tokens: 12 accumulators, 2 weight vectors and a
 * broadcast; per input, 2 loads (or widenings) and 6 broadcasts (loads on
 * the cores met so far) for 12 FMAs. The driver's token tile is
 * MM_PACK_FNT = 12 tokens (the activations are read in place by tiles of
 * that width, matmul_internal.h), run here as two tiles of 6. Decoding (at
 * most MM_PACK_NARROW tokens) runs narrow tiles: one token in A_MG = 4
 * groups (8 chains, enough to cover the FMA's latency twice over on two
 * FMA ports), two tokens in 2 groups; a decoding tile asks for its
 * weights ahead into L1 as matmul_pack.c's do ("Decoding").
 *
 * f16 over a batch of at least MM_PACK_WIDE_TILES token tiles: the thread
 * widens each pair of groups once into its own f32 copy (jb->wide, sized
 * by matmul_pack_run.c whatever the level) and the f32 tiles read that, as
 * matmul_pack.c does.
 *
 * Q8_0 (q8_tile). The copy holds per block of 32 and 4 inputs each of 16
 * rows' 4 bytes as w + 128, for vpdpbusd's unsigned operand. AVX2's
 * vpmaddubsw multiplies unsigned by signed bytes too, but sums pairs into
 * 16 bits: (w + 128) x q reaches 2 x 255 x 127 and would saturate. So a
 * tile flips the bytes back to w once per load (shared by its tokens) and
 * takes |w|, and each token's 4 activations q, broadcast, get w's sign:
 * |w| x sign(q, w) = w q, pairs within 2 x 128 x 127. vpmaddwd against
 * ones widens the pairs to the row's i32 lane, exactly: per 32 products a
 * vpsignb, a vpmaddubsw, a vpmaddwd and a vpaddd, against matmul.c's six
 * instructions per (row, token, block) and its sums across lanes. A wide
 * tile is one group x Q_NT = 2 tokens (4 i32 block sums and 4 f32 sums
 * fill the registers with the weights); decoding runs one token in Q_MG =
 * 2 groups, or two tokens in one, each block's weights asked for ahead.
 * The activations are quantised by matmul.c's own quantize_x of this level
 * into the tiles' slots (quantize_avx2), so they have its values.
 *
 * The nibble copies (nib_tile) and q4_K (k4_tile) take the same tiles.
 * Their codes (at most 15, or 31 with a fifth bit) are vpmaddubsw's
 * unsigned operand as stored, no sign needed: a block's low-nibble and
 * high-nibble pairs add in 16 bits before one vpmaddwd, and q4_K's, at
 * most 2 x 15 x 128 each, over a whole sub-block of 8 chunks (30,720 at
 * most). iq4's levels are looked up as signed bytes and take q8_0's way.
 *
 * ---------------------------------------------------------------------------
 * Numerics and invariance
 * ---------------------------------------------------------------------------
 *
 * Each (row, token) sum is one f32 chain along k from 0: acc = fma(w[k],
 * x[k], acc), the exact widening of the stored weight times the caller's
 * f32 activation. That is the sequence of matmul_pack.c's float tiles, so
 * this level gives the bits the AVX-512 kernels give (test_quant checks),
 * and every tile shape here runs it: a token's results depend neither on
 * the other tokens of its batch nor on the split among threads. The
 * integer copies' block sums are exact integers, folded block after block
 * with int8_tile's and q4k_fold's operations in their order (acc =
 * fma((float)sum, d x dx, acc), then the mins'): the AVX-512 kernels'
 * bits again, from activations of the same values.
 *
 * Measured: see the essay's last section, "Figures".
 *
 * ---------------------------------------------------------------------------
 * Registers
 * ---------------------------------------------------------------------------
 *
 * The wide tile (a_wide) names its 12 sums one by one. Written first as
 * the narrow tiles' [group][token][2] array, GCC kept the array in memory
 * and stored every sum at each step of k: the tile ran at 31-32% of the
 * FMA peak, half the stored rows' kernel. Named, the loop is 2 loads, 6
 * broadcasts and 12 FMAs with nothing stored. The narrow tiles keep the
 * array (their final stores unrolled, so it can live in registers): one
 * token in 4 groups wants 8 sums, 8 weight vectors and a broadcast, one
 * more than the 16 registers, and GCC keeps one sum in memory; a decoding
 * step waits for the bus far longer than for that. The integer tiles add
 * each product into its sum through in_reg, an empty asm: without it GCC
 * reassociated the integer adds into trees and stored their partial
 * products to the stack.
 *
 * ---------------------------------------------------------------------------
 * Figures
 * ---------------------------------------------------------------------------
 *
 * AMD EPYC Zen 3 (AVX2 and FMA, no AVX-512), 2 cores, load 0.1-1.7, this
 * level's repacked copies against the rows as stored (matmul.c,
 * matmul_k.c, matmul_blocks.c), the build before beside this one:
 *  - build/bench/bench_prefill (one SmolLM-135M layer x 512 tokens): one
 *    thread by CPU time, of its peak, q8_0 90-102% against 55-59% (of
 *    vpmaddubsw+vpmaddwd's), f32 70-91% against 44-60% and f16 73-88%
 *    against 54-59% (of the 256-bit FMA's); two threads q8_0 179 GOPS
 *    against 100, f16 143-152 against 112, f32 141-152 against 89-106.
 *    The wide float tile written as an array ran at 31-32% ("Registers").
 *  - build/bench/bench_matmul (4096 x 4096, 2 threads), from DRAM in GB/s
 *    and at 64 tokens in GFLOP/s: q8_0 24.0 / 181 against 18.3 / 111,
 *    q4_0 32.0 / 305 against 11.6 / 100, q4_1 32.2 / 214 against 6.4 /
 *    41, q5_0 27.4 / 171 against 5.9 / 61, q5_1 29.1 / 164 against 4.9 /
 *    32, iq4_nl 33.4 / 194 against 4.4 / 38, iq4_xs 29.7 / 196 against
 *    5.4 / 31, q4_K 26.6 / 204 against 18.8 / 113 (triad 36.5 GB/s).
 *  - build/bench/bench_matmul decode (the 576x30 model's products, two
 *    alternated runs of each build), tokens/s: q8_0 206-212 against
 *    100-105, f16 116-129 against 75-82, bf16 122-137 against 65-74, f32
 *    63-72 against 49-50; 2048x16 q8_0 36-39 against 22-23, q4_K 62
 *    against 58-63 (its one-token tile no faster than the stored rows').
 *  - in_reg: q8_0's wide tile went from 99 stack accesses to 13, one
 *    thread from 94% to 97% of the peak in the run that measured both.
 */
#include "model/matmul_internal.h"
#include "model/matmul_simd.h"

#if defined(KERN_AVX2)

#define A_NT 6  /* tokens per wide tile: 2 x 6 accumulators */
#define A_MG 4  /* groups per narrow tile of one token: 8 chains */
#define A_MG2 2 /* groups per narrow tile of MM_PACK_NARROW tokens */

/* Eight rows' element k at p, widened to f32 exactly. */
INLINE __m256 a_widen(enum ggml_type type, const uint8_t *p)
{
    if (type == GGML_TYPE_F32)
        return _mm256_load_ps((const float *)p);
    const __m128i h = _mm_load_si128((const __m128i *)p);
    if (type == GGML_TYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); /* bf16 */
}

/* Group g's outputs of token t (lo: rows 0..7, hi: 8..15): the rows that
 * exist (a padded last group stores fewer). By value: the accumulators
 * passed by address were stored to the stack at every step of the loop. */
INLINE void a_store(const struct mm_pack_job *jb, int g, int t, __m256 lo, __m256 hi)
{
    const int o0 = g * MM_PACK_ROWS, n = jb->w->n_out - o0;
    float *o = jb->out + (size_t)t * (size_t)jb->w->n_out + (size_t)o0;
    if (n >= MM_PACK_ROWS) {
        _mm256_storeu_ps(o, lo);
        _mm256_storeu_ps(o + 8, hi);
    } else {
        float tmp[MM_PACK_ROWS];
        _mm256_storeu_ps(tmp, lo);
        _mm256_storeu_ps(tmp + 8, hi);
        memcpy(o, tmp, (size_t)n * sizeof(float));
    }
}

/* mg groups from g0 x nt tokens from t0: one f32 chain per row and token
 * along k. The weights are w's copy as stored in type, or (wide: type F32,
 * mg 1) the thread's f32 copy of g0's pair of f16 groups. */
INLINE void a_tile(const struct mm_pack_job *jb, enum ggml_type type, bool wide, int g0, int mg,
                   int t0, int nt)
{
    const struct mm_weight *w = jb->w;
    const size_t esz = type == GGML_TYPE_F32 ? 4 : 2, step = 2 * MM_PACK_ROWS * esz;
    /* group g's element k at pp[g / 2] + k * step + (g % 2) * step / 2 */
    const uint8_t *pp[A_MG / 2];
    for (int h = 0; h < (mg + (g0 & 1) + 1) / 2; h++)
        pp[h] = wide ? (const uint8_t *)jb->wide
                     : (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_pack_pair_bytes(w);
    const size_t ld = (size_t)w->n_in;
    const float *xt = jb->x + (size_t)t0 * ld;

    __m256 acc[A_MG][A_NT][2];
#pragma GCC unroll 4
    for (int g = 0; g < mg; g++)
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++)
            acc[g][t][0] = acc[g][t][1] = _mm256_setzero_ps();
    for (int k = 0; k < w->n_in; k++, xt++) {
        if (nt <= MM_PACK_NARROW && !wide)
            prefetch_pairs(pp, mg + (g0 & 1), (size_t)k * step, step, mm_pack_float_prefetch(type));
        __m256 wv[A_MG][2];
#pragma GCC unroll 4
        for (int g = 0; g < mg; g++) {
            const int a = (g0 & 1) + g; /* the group's place in its pair run */
            const uint8_t *p = pp[a / 2] + (size_t)k * step + (size_t)(a % 2) * (step / 2);
            wv[g][0] = a_widen(type, p);
            wv[g][1] = a_widen(type, p + step / 4);
        }
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++) {
            const __m256 xv = _mm256_broadcast_ss(xt + (size_t)t * ld);
#pragma GCC unroll 4
            for (int g = 0; g < mg; g++) {
                acc[g][t][0] = _mm256_fmadd_ps(wv[g][0], xv, acc[g][t][0]);
                acc[g][t][1] = _mm256_fmadd_ps(wv[g][1], xv, acc[g][t][1]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < mg; g++)
#pragma GCC unroll 6
        for (int t = 0; t < nt; t++)
            a_store(jb, g0 + g, t0 + t, acc[g][t][0], acc[g][t][1]);
}

/* Token i's two sums of the wide tile: its activation at input k
 * broadcast, times the group's two vectors of weights. */
#define A_FMA2(i)                                                                                  \
    xv = _mm256_broadcast_ss(xt + (size_t)(i)*ld);                                                 \
    l##i = _mm256_fmadd_ps(w0, xv, l##i);                                                          \
    h##i = _mm256_fmadd_ps(w1, xv, h##i);

/* The wide tile: group g x A_NT tokens from t0, the sequence of a_tile,
 * with its 12 sums named one by one. Written as a_tile's array, GCC kept
 * them in memory and stored each at every step of k, at half the speed;
 * 12 sums, 2 weight vectors and a broadcast are 15 of the 16 registers. */
INLINE void a_wide(const struct mm_pack_job *jb, enum ggml_type type, bool wide, int g, int t0)
{
    const struct mm_weight *w = jb->w;
    const size_t esz = type == GGML_TYPE_F32 ? 4 : 2, step = 2 * MM_PACK_ROWS * esz;
    const uint8_t *p =
        (wide ? (const uint8_t *)jb->wide
              : (const uint8_t *)w->packed + (size_t)(g / 2) * mm_pack_pair_bytes(w)) +
        (size_t)(g % 2) * (step / 2);
    const size_t ld = (size_t)w->n_in;
    const float *xt = jb->x + (size_t)t0 * ld;
    __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, l4 = l0, l5 = l0;
    __m256 h0 = l0, h1 = l0, h2 = l0, h3 = l0, h4 = l0, h5 = l0;
    const int n_in = w->n_in;
    for (int k = 0; k < n_in; k++, xt++, p += step) {
        const __m256 w0 = a_widen(type, p), w1 = a_widen(type, p + step / 4);
        __m256 xv;
        A_FMA2(0)
        A_FMA2(1)
        A_FMA2(2)
        A_FMA2(3)
        A_FMA2(4)
        A_FMA2(5)
    }
    a_store(jb, g, t0, l0, h0);
    a_store(jb, g, t0 + 1, l1, h1);
    a_store(jb, g, t0 + 2, l2, h2);
    a_store(jb, g, t0 + 3, l3, h3);
    a_store(jb, g, t0 + 4, l4, h4);
    a_store(jb, g, t0 + 5, l5, h5);
}

/* One group x 1..A_NT tokens, each count a call with constants. */
#define A_CASE(n)                                                                                  \
    case n:                                                                                        \
        a_tile(jb, type, wide, g, 1, t0, n);                                                       \
        break;
#define A_WIDE(name, type_, wide_)                                                                 \
    static void name(const struct mm_pack_job *jb, int g, int t0, int nt)                          \
    {                                                                                              \
        const enum ggml_type type = type_;                                                         \
        const bool wide = wide_;                                                                   \
        switch (nt) {                                                                              \
            A_CASE(1)                                                                              \
            A_CASE(2)                                                                              \
            A_CASE(3)                                                                              \
            A_CASE(4)                                                                              \
            A_CASE(5)                                                                              \
        default:                                                                                   \
            a_wide(jb, type, wide, g, t0);                                                         \
            break;                                                                                 \
        }                                                                                          \
    }
A_WIDE(f32_wide, GGML_TYPE_F32, false)
A_WIDE(f16_wide, GGML_TYPE_F16, false)
A_WIDE(bf16_wide, GGML_TYPE_BF16, false)
A_WIDE(f16w_wide, GGML_TYPE_F32, true) /* f16 widened by the thread first */

/* Decoding: mg groups (1..A_MG) from g0 for one token, or (1..A_MG2) for two. */
#define A_NARROW(name, type_)                                                                      \
    static void name(const struct mm_pack_job *jb, int g0, int mg, int nt)                         \
    {                                                                                              \
        const enum ggml_type type = type_;                                                         \
        if (nt == 1) {                                                                             \
            switch (mg) {                                                                          \
            case 1:                                                                                \
                a_tile(jb, type, false, g0, 1, 0, 1);                                              \
                break;                                                                             \
            case 2:                                                                                \
                a_tile(jb, type, false, g0, 2, 0, 1);                                              \
                break;                                                                             \
            case 3:                                                                                \
                a_tile(jb, type, false, g0, 3, 0, 1);                                              \
                break;                                                                             \
            default:                                                                               \
                a_tile(jb, type, false, g0, A_MG, 0, 1);                                           \
                break;                                                                             \
            }                                                                                      \
        } else if (mg == 1) {                                                                      \
            a_tile(jb, type, false, g0, 1, 0, MM_PACK_NARROW);                                     \
        } else {                                                                                   \
            a_tile(jb, type, false, g0, A_MG2, 0, MM_PACK_NARROW);                                 \
        }                                                                                          \
    }
A_NARROW(f32_narrow, GGML_TYPE_F32)
A_NARROW(f16_narrow, GGML_TYPE_F16)
A_NARROW(bf16_narrow, GGML_TYPE_BF16)

/* ------------------------------------------------------------------------
 * Q8_0: vpmaddubsw on the weights' magnitudes
 * ------------------------------------------------------------------------ */

#define Q_NT 2 /* tokens per wide q8_0 tile of one group: 4 i32 + 4 f32 sums */
#define Q_MG 2 /* groups per decoding q8_0 tile of one token: the same count */

/* v, kept in a register as it is: an empty asm that GCC cannot see
 * through, so that it adds a tile's products into its sums one by one
 * rather than reassociating the integer adds into a tree whose partial
 * products it had to store to the stack (16 registers). */
INLINE __m256i in_reg(__m256i v)
{
    __asm__("" : "+x"(v));
    return v;
}

/* Eight rows' 4 bytes at p, stored w + 128 (matmul_internal.h), as the
 * signed weights w. */
INLINE __m256i q_weights(const uint8_t *p)
{
    return _mm256_xor_si256(_mm256_load_si256((const __m256i *)p), _mm256_set1_epi8((char)0x80));
}

/* Each of 8 rows' 4 weights w (aw = |w| as unsigned bytes) times the 4
 * activations x4 repeated in every lane, summed into the row's i32 lane:
 * exact, as vpmaddubsw's pairs |w| x (x with w's sign) stay within
 * 2 x 128 x 127 and never saturate. */
INLINE __m256i q_dot4(__m256i aw, __m256i w, __m256i x4)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x4, w)),
                             _mm256_set1_epi16(1));
}

/* An integer tile's pointers: its pairs' copies (group g of the tile in
 * pp[a / 2] at 64 (a % 2) within each chunk, a = (g0 & 1) + g), and its
 * tokens' activation slots (quantize_avx2) from token t0 of tile j. */
struct int_at {
    const uint8_t *pp[Q_MG];
    const int8_t *xq;
    const float *xd;
    const int32_t *xc;
};

INLINE struct int_at int_at_of(const struct mm_pack_job *jb, int g0, int mg, int j, int t0)
{
    const struct mm_weight *w = jb->w;
    struct int_at a;
    for (int h = 0; h < (mg + (g0 & 1) + 1) / 2; h++)
        a.pp[h] = (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_pack_pair_bytes(w);
    const size_t at = (size_t)j * (size_t)(w->n_in / QT_QK) * MM_PACK_NT + (size_t)t0;
    a.xq = jb->q + at * QT_QK;
    a.xd = jb->d + at;
    a.xc = jb->c + at;
    return a;
}

/* An integer tile's f32 sums, zero. */
INLINE void int_acc_zero(__m256 acc[Q_MG][Q_NT][2], int mg, int nt)
{
#pragma GCC unroll 2
    for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++)
            acc[g][t][0] = acc[g][t][1] = _mm256_setzero_ps();
}

/* An integer tile's f32 sums to the outputs of its groups and tokens. */
INLINE void int_acc_store(const struct mm_pack_job *jb, int g0, int mg, int j, int t0, int nt,
                          __m256 acc[Q_MG][Q_NT][2])
{
#pragma GCC unroll 2
    for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++)
            a_store(jb, g0 + g, j * MM_PACK_NT + t0 + t, acc[g][t][0], acc[g][t][1]);
}

/*
 * mg groups from g0 x nt tokens from t0 of token tile j (MM_PACK_NT wide).
 * Per block of 32, each (row, token) sum is exact in i32; then acc +=
 * (float)sum * (d * dx), as matmul_pack.c's int8_tile folds it. Its i32
 * sum there (vpdpbusd of w + 128, started at -128 sum(q)) is the same
 * integer, so this level gives the AVX-512 kernel's bits.
 */
INLINE void q8_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int t0, int nt)
{
    const int nb = jb->w->n_in / QT_QK;
    /* group g's chunk k of block b at pp[a / 2] + b * MM_PACK_Q8_PAIR +
     * 128 k + 64 (a % 2); its 16 f16 scales at MM_PACK_Q8_SCALES + 32 (a % 2) */
    const struct int_at at = int_at_of(jb, g0, mg, j, t0);
    const uint8_t *const *pp = at.pp;
    const int8_t *xq = at.xq;
    const float *xd = at.xd;
    __m256 acc[Q_MG][Q_NT][2];
    int_acc_zero(acc, mg, nt);
    for (int b = 0; b < nb; b++, xq += MM_PACK_NT * QT_QK, xd += MM_PACK_NT) {
        const size_t off = (size_t)b * MM_PACK_Q8_PAIR;
        if (nt == 1)
            prefetch_pairs(pp, mg + (g0 & 1), off, MM_PACK_Q8_PAIR, MM_PACK_PREFETCH);
        __m256i ia[Q_MG][Q_NT][2];
#pragma GCC unroll 2
        for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
            for (int t = 0; t < nt; t++)
                ia[g][t][0] = ia[g][t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m256i wv[Q_MG][2], aw[Q_MG][2];
#pragma GCC unroll 2
            for (int g = 0; g < mg; g++) {
                const int a = (g0 & 1) + g;
                const uint8_t *p = pp[a / 2] + off + 128 * k + 64 * (a % 2);
                wv[g][0] = q_weights(p);
                wv[g][1] = q_weights(p + 32);
                aw[g][0] = _mm256_abs_epi8(wv[g][0]);
                aw[g][1] = _mm256_abs_epi8(wv[g][1]);
            }
#pragma GCC unroll 2
            for (int t = 0; t < nt; t++) {
                int32_t x4;
                memcpy(&x4, xq + QT_QK * t + 4 * k, 4);
                const __m256i xv = _mm256_set1_epi32(x4);
#pragma GCC unroll 2
                for (int g = 0; g < mg; g++) {
                    ia[g][t][0] =
                        in_reg(_mm256_add_epi32(ia[g][t][0], q_dot4(aw[g][0], wv[g][0], xv)));
                    ia[g][t][1] =
                        in_reg(_mm256_add_epi32(ia[g][t][1], q_dot4(aw[g][1], wv[g][1], xv)));
                }
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < mg; g++) {
            const int a = (g0 & 1) + g;
            const uint8_t *s = pp[a / 2] + off + MM_PACK_Q8_SCALES + 32 * (a % 2);
            const __m256 s0 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)s));
            const __m256 s1 = _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(s + 16)));
#pragma GCC unroll 2
            for (int t = 0; t < nt; t++) {
                const __m256 dx = _mm256_set1_ps(xd[t]);
                acc[g][t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[g][t][0]),
                                               _mm256_mul_ps(s0, dx), acc[g][t][0]);
                acc[g][t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[g][t][1]),
                                               _mm256_mul_ps(s1, dx), acc[g][t][1]);
            }
        }
    }
    int_acc_store(jb, g0, mg, j, t0, nt, acc);
}

/* ------------------------------------------------------------------------
 * Q4_K: the nibbles as they are, the scales applied per sub-block
 * ------------------------------------------------------------------------ */

/* Eight rows' (scale or min) codes of one sub-block at p times their f16
 * factors at f: exact in f32 (an f16 times a 6-bit integer). */
INLINE __m256 k4_factor(const uint8_t *p, const uint8_t *f)
{
    return _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))),
        _mm256_cvtph_ps(_mm_load_si128((const __m128i *)f)));
}

/*
 * mg groups from g0 x nt tokens from t0 of token tile j, q4_K (the copy's
 * layout: matmul_internal.h). Per sub-block s of a super-block (activation
 * block 8 sb + s), vpmaddubsw of the unsigned nibbles (at most 15) against
 * the token's int8 activations gives pairs of at most 2 x 15 x 128, and
 * the 8 chunks' pairs add up in 16 bits to at most 30,720: exact without
 * widening, so one vpmaddubsw and one vpaddw per 32 products, and one
 * vpmaddwd per sub-block turns each row's two 16-bit lanes into its i32
 * sum. That is the integer int8_tile's vpdpbusd sums, and the fold is
 * matmul_pack.c's q4k_fold: acc += sum * (d sc_s) dx, then acc -= (dmin
 * m_s) (dx sum(q)). The same bits as the AVX-512 kernel.
 */
INLINE void k4_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int t0, int nt)
{
    const int nsb = jb->w->n_in / QT_QK_K;
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    const struct int_at at = int_at_of(jb, g0, mg, j, t0);
    const uint8_t *const *pp = at.pp;
    const int8_t *xq = at.xq;
    const float *xd = at.xd;
    const int32_t *xc = at.xc;
    __m256 acc[Q_MG][Q_NT][2];
    int_acc_zero(acc, mg, nt);
    for (int sb = 0; sb < nsb; sb++) {
        const size_t off = (size_t)sb * MM_PACK_Q4K_PAIR;
        for (int h = 0; h < 4; h++) {
            if (nt == 1) /* a quarter of the super-block's bytes per h */
                prefetch_pairs(pp, mg + (g0 & 1), off + (size_t)h * MM_PACK_Q4K_PAIR / 4,
                               MM_PACK_Q4K_PAIR / 4, MM_PACK_PREFETCH_FAR);
#pragma GCC unroll 2
            for (int high = 0; high < 2; high++) {
                const int s = 2 * h + high; /* the chunks' low nibbles, then their high ones */
                const size_t blk = (size_t)(8 * sb + s) * MM_PACK_NT;
                __m256i is[Q_MG][Q_NT][2];
#pragma GCC unroll 2
                for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
                    for (int t = 0; t < nt; t++)
                        is[g][t][0] = is[g][t][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) {
                    __m256i u[Q_MG][2];
#pragma GCC unroll 2
                    for (int g = 0; g < mg; g++) {
                        const int a = (g0 & 1) + g;
                        const uint8_t *p = pp[a / 2] + off + MM_PACK_Q4K_QS +
                                           128 * (size_t)(8 * h + k) + 64 * (a % 2);
#pragma GCC unroll 2
                        for (int hh = 0; hh < 2; hh++) {
                            const __m256i v = _mm256_load_si256((const __m256i *)(p + 32 * hh));
                            u[g][hh] = _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, lo4);
                        }
                    }
#pragma GCC unroll 2
                    for (int t = 0; t < nt; t++) {
                        int32_t x4;
                        memcpy(&x4, xq + (blk + (size_t)t) * QT_QK + 4 * k, 4);
                        const __m256i xv = _mm256_set1_epi32(x4);
#pragma GCC unroll 2
                        for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
                            for (int hh = 0; hh < 2; hh++)
                                is[g][t][hh] = in_reg(_mm256_add_epi16(
                                    is[g][t][hh], _mm256_maddubs_epi16(u[g][hh], xv)));
                    }
                }
#pragma GCC unroll 2
                for (int g = 0; g < mg; g++) {
                    const int a = (g0 & 1) + g;
                    const uint8_t *sg = pp[a / 2] + off + MM_PACK_Q4K_GSCALES * (size_t)(a % 2);
#pragma GCC unroll 2
                    for (int hh = 0; hh < 2; hh++) {
                        const __m256 sc = k4_factor(sg + 64 + 16 * s + 8 * hh, sg + 16 * hh);
                        const __m256 mn = k4_factor(sg + 192 + 16 * s + 8 * hh, sg + 32 + 16 * hh);
#pragma GCC unroll 2
                        for (int t = 0; t < nt; t++) {
                            const float dx = xd[blk + (size_t)t];
                            const float sq =
                                dx * (float)(xc[blk + (size_t)t] / -128); /* dx sum(q) */
                            const __m256i ia =
                                _mm256_madd_epi16(is[g][t][hh], _mm256_set1_epi16(1));
                            acc[g][t][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia),
                                                            _mm256_mul_ps(sc, _mm256_set1_ps(dx)),
                                                            acc[g][t][hh]);
                            acc[g][t][hh] = _mm256_fnmadd_ps(mn, _mm256_set1_ps(sq), acc[g][t][hh]);
                        }
                    }
                }
            }
        }
    }
    int_acc_store(jb, g0, mg, j, t0, nt, acc);
}

/* ------------------------------------------------------------------------
 * The 4- and 5-bit blocks: their nibbles as they are
 * ------------------------------------------------------------------------ */

/* iq4_nl's 16 levels as signed bytes, in each 128-bit lane (vpshufb looks
 * up within lanes). */
INLINE __m256i nib_levels(void)
{
    return _mm256_broadcastsi128_si256(
        _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113));
}

/* The sum into 32 bits of 8 rows' two 4-product runs, low nibbles u
 * against xl and high ones v against xh: their vpmaddubsw pairs (at most
 * 2 x 31 x 128 each) add in 16 bits exactly. */
INLINE __m256i nib_dot(__m256i u, __m256i xl, __m256i v, __m256i xh)
{
    return _mm256_madd_epi16(
        _mm256_add_epi16(_mm256_maddubs_epi16(u, xl), _mm256_maddubs_epi16(v, xh)),
        _mm256_set1_epi16(1));
}

/*
 * mg groups from g0 x nt tokens from t0 of token tile j, one of the nibble
 * copies (q4_0, q4_1, q5_0, q5_1, iq4_nl, iq4_xs: matmul_internal.h), as
 * matmul_pack.c's int8_tile reads them: per block of 32 the exact i32
 * sum of codes times activations, started at the activations' correction
 * for the codes' offset (-8 sum(q) for q4_0, -16 sum(q) for q5_0; none
 * for q4_1 and q5_1, whose weight is d u + m), then acc += (float)sum *
 * (d dx), and for q4_1 and q5_1 acc += m (dx sum(q)). The codes (at most
 * 31) are vpmaddubsw's unsigned operand as they are. iq4's levels are
 * signed: looked up as such, they take q8_0's way (|w| against q with w's
 * sign) where AVX-512 looks up levels + 128. Every integer sum is the one
 * int8_tile forms, and the folds are its own: the AVX-512 kernel's bits.
 */
INLINE void nib_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int t0, int nt,
                     enum ggml_type type)
{
    const struct mm_weight *w = jb->w;
    const int nb = w->n_in / QT_QK;
    const bool five = type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1;
    const bool mins = type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1;
    const bool levels = type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_IQ4_XS;
    const size_t bstride = mm_pack_nib_block(type), soff = mm_pack_nib_scales(type);
    const int cshift = type == GGML_TYPE_Q4_0 ? 4 : type == GGML_TYPE_Q5_0 ? 3 : 0;
    const __m256i lo4 = _mm256_set1_epi8(0x0f), b4 = _mm256_set1_epi8(0x10), lv = nib_levels();
    /* group g's chunk k of block b at pp[a / 2] + b * bstride + 128 k +
     * 64 (a % 2), a = (g0 & 1) + g; its fifth bits at MM_PACK_NIB_CHUNKS +
     * 64 (a % 2), its scales (and mins) from soff */
    const struct int_at at = int_at_of(jb, g0, mg, j, t0);
    const uint8_t *const *pp = at.pp;
    const int8_t *xq = at.xq;
    const float *xd = at.xd;
    const int32_t *xc = at.xc;
    __m256 acc[Q_MG][Q_NT][2];
    int_acc_zero(acc, mg, nt);
    for (int b = 0; b < nb; b++, xq += MM_PACK_NT * QT_QK, xd += MM_PACK_NT, xc += MM_PACK_NT) {
        const size_t off = (size_t)b * bstride;
        if (nt == 1)
            prefetch_pairs(pp, mg + (g0 & 1), off, bstride, MM_PACK_PREFETCH);
        __m256i ia[Q_MG][Q_NT][2];
#pragma GCC unroll 2
        for (int t = 0; t < nt; t++) {
            /* -128 sum(q) >> cshift: exact, a multiple of 128 */
            const __m256i c =
                mins || levels ? _mm256_setzero_si256() : _mm256_set1_epi32(xc[t] / (1 << cshift));
#pragma GCC unroll 2
            for (int g = 0; g < mg; g++)
                ia[g][t][0] = ia[g][t][1] = c;
        }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m256i ul[Q_MG][2], uh[Q_MG][2];
#pragma GCC unroll 2
            for (int g = 0; g < mg; g++) {
                const int a = (g0 & 1) + g;
                const uint8_t *p = pp[a / 2] + off + 64 * (a % 2);
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++) {
                    const __m256i v = _mm256_load_si256((const __m256i *)(p + 128 * k + 32 * hh));
                    ul[g][hh] = _mm256_and_si256(v, lo4);                       /* elements 4k.. */
                    uh[g][hh] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4); /* 16 + 4k.. */
                    if (five) { /* the fifth bits to bit 4: 4k.. at bit 4 + k, 16 + 4k.. at k */
                        const __m256i f =
                            _mm256_load_si256((const __m256i *)(p + MM_PACK_NIB_CHUNKS + 32 * hh));
                        ul[g][hh] = _mm256_or_si256(ul[g][hh],
                                                    _mm256_and_si256(_mm256_srli_epi16(f, k), b4));
                        uh[g][hh] = _mm256_or_si256(
                            uh[g][hh], _mm256_and_si256(_mm256_slli_epi16(f, 4 - k), b4));
                    }
                    if (levels) {
                        ul[g][hh] = _mm256_shuffle_epi8(lv, ul[g][hh]);
                        uh[g][hh] = _mm256_shuffle_epi8(lv, uh[g][hh]);
                    }
                }
            }
#pragma GCC unroll 2
            for (int t = 0; t < nt; t++) {
                int32_t x0, x1;
                memcpy(&x0, xq + QT_QK * t + 4 * k, 4);
                memcpy(&x1, xq + QT_QK * t + 16 + 4 * k, 4);
                const __m256i xl = _mm256_set1_epi32(x0), xh = _mm256_set1_epi32(x1);
#pragma GCC unroll 2
                for (int g = 0; g < mg; g++)
#pragma GCC unroll 2
                    for (int hh = 0; hh < 2; hh++) {
                        const __m256i l = ul[g][hh], h = uh[g][hh];
                        const __m256i d = levels
                                              ? _mm256_add_epi32(q_dot4(_mm256_abs_epi8(l), l, xl),
                                                                 q_dot4(_mm256_abs_epi8(h), h, xh))
                                              : nib_dot(l, xl, h, xh);
                        ia[g][t][hh] = in_reg(_mm256_add_epi32(ia[g][t][hh], d));
                    }
            }
        }
#pragma GCC unroll 2
        for (int g = 0; g < mg; g++) {
            const int a = (g0 & 1) + g;
            const uint8_t *sp = pp[a / 2] + off + soff;
#pragma GCC unroll 2
            for (int hh = 0; hh < 2; hh++) {
                const __m256 sc = type == GGML_TYPE_IQ4_XS
                                      ? _mm256_load_ps((const float *)(sp + 64 * (a % 2) + 32 * hh))
                                      : _mm256_cvtph_ps(_mm_load_si128(
                                            (const __m128i *)(sp + 32 * (a % 2) + 16 * hh)));
#pragma GCC unroll 2
                for (int t = 0; t < nt; t++) {
                    acc[g][t][hh] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[g][t][hh]),
                                        _mm256_mul_ps(sc, _mm256_set1_ps(xd[t])), acc[g][t][hh]);
                    if (mins) { /* dx sum(q) */
                        const __m256 mn = _mm256_cvtph_ps(
                            _mm_load_si128((const __m128i *)(sp + 64 + 32 * (a % 2) + 16 * hh)));
                        const __m256 sq = _mm256_set1_ps(xd[t] * (float)(xc[t] / -128));
                        acc[g][t][hh] = _mm256_fmadd_ps(mn, sq, acc[g][t][hh]);
                    }
                }
            }
        }
    }
    int_acc_store(jb, g0, mg, j, t0, nt, acc);
}

/* ------------------------------------------------------------------------
 * The integer copies' tiles by shape
 * ------------------------------------------------------------------------ */

typedef void narrow_fn(const struct mm_pack_job *jb, int g0, int mg, int nt);
typedef void int_wide_fn(const struct mm_pack_job *jb, int g, int j, int t0, int nt);

/* p##_wide: token tile j's tokens [t0, t0 + nt) in group g; p##_narrow
 * (decoding): mg groups (1..Q_MG) from g0 for one token, one group for
 * two. Each a call of tile(jb, g0, mg, j, t0, nt) with constant mg, nt. */
#define INT_SHAPES(p, tile)                                                                        \
    static void p##_wide(const struct mm_pack_job *jb, int g, int j, int t0, int nt)               \
    {                                                                                              \
        if (nt == 1)                                                                               \
            tile(jb, g, 1, j, t0, 1);                                                              \
        else                                                                                       \
            tile(jb, g, 1, j, t0, Q_NT);                                                           \
    }                                                                                              \
    static void p##_narrow(const struct mm_pack_job *jb, int g0, int mg, int nt)                   \
    {                                                                                              \
        if (nt > 1)                                                                                \
            tile(jb, g0, 1, 0, 0, Q_NT);                                                           \
        else if (mg == 1)                                                                          \
            tile(jb, g0, 1, 0, 0, 1);                                                              \
        else                                                                                       \
            tile(jb, g0, Q_MG, 0, 0, 1);                                                           \
    }
/* nib_tile with its type constant */
#define NIB_TILE(name, type_)                                                                      \
    INLINE void name(const struct mm_pack_job *jb, int g0, int mg, int j, int t0, int nt)          \
    {                                                                                              \
        nib_tile(jb, g0, mg, j, t0, nt, type_);                                                    \
    }
NIB_TILE(q40_tile, GGML_TYPE_Q4_0)
NIB_TILE(q41_tile, GGML_TYPE_Q4_1)
NIB_TILE(q50_tile, GGML_TYPE_Q5_0)
NIB_TILE(q51_tile, GGML_TYPE_Q5_1)
NIB_TILE(nl_tile, GGML_TYPE_IQ4_NL)
NIB_TILE(xs_tile, GGML_TYPE_IQ4_XS)
INT_SHAPES(q8, q8_tile)
INT_SHAPES(k4, k4_tile)
INT_SHAPES(q40, q40_tile)
INT_SHAPES(q41, q41_tile)
INT_SHAPES(q50, q50_tile)
INT_SHAPES(q51, q51_tile)
INT_SHAPES(nl, nl_tile)
INT_SHAPES(xs, xs_tile)

/* Token t's activations into its tile's q8_0 slots (matmul_internal.h):
 * per block of 32, the values of matmul.c's quantize_x at this level (it
 * quantises the block), with its correction -128 sum(q), which the
 * kernels here do not need but the layout promises. */
static void quantize_avx2(const struct mm_pack_job *jb, const float *xt, int t)
{
    const int nb = jb->w->n_in / QT_QK;
    const size_t slot0 =
        (size_t)(t / MM_PACK_NT) * (size_t)nb * MM_PACK_NT + (size_t)(t % MM_PACK_NT);
    for (int b = 0; b < nb; b++, xt += QT_QK) {
        const size_t slot = slot0 + (size_t)b * MM_PACK_NT;
        int8_t *q = jb->q + slot * QT_QK;
        KERN(mm_kernels).quantize_x(xt, QT_QK, q, jb->d + slot);
        int32_t sum = 0;
        for (int i = 0; i < QT_QK; i++)
            sum += q[i];
        jb->c[slot] = -128 * sum;
    }
}

typedef void wide_fn(const struct mm_pack_job *jb, int g, int t0, int nt);

/* g0's pair of f16 groups (g0 even) widened into the thread's f32 copy at
 * jb->wide, laid out as an f32 pair: exact, so its tiles give the f16
 * tiles' bits. */
static void f16_widen_pair(const struct mm_pack_job *jb, int g0)
{
    const struct mm_weight *w = jb->w;
    const uint8_t *src = (const uint8_t *)w->packed + (size_t)(g0 / 2) * mm_pack_pair_bytes(w);
    for (size_t k = 0; k < 4 * (size_t)w->n_in; k++) /* 8 rows' element per step */
        _mm256_store_ps(jb->wide + 8 * k,
                        _mm256_cvtph_ps(_mm_load_si128((const __m128i *)(src + 16 * k))));
}

/* Decoding: the groups [g0, g1) for MM_PACK_NARROW tokens at most, step
 * groups per tile. */
static void narrow_groups(const struct mm_pack_job *jb, narrow_fn *fn, int step, int g0, int g1)
{
    for (int g = g0; g < g1; g += step)
        fn(jb, g, g1 - g < step ? g1 - g : step, jb->n_tok);
}

/* An integer copy's groups [g0, g1) x token tiles [j0, j1): decoding in
 * narrow tiles, else group by group, each tile of MM_PACK_NT tokens as
 * tiles of Q_NT. */
static void int_groups(const struct mm_pack_job *jb, narrow_fn *narrow, int_wide_fn *wide, int g0,
                       int g1, int j0, int j1)
{
    if (jb->n_tok <= MM_PACK_NARROW) {
        narrow_groups(jb, narrow, jb->n_tok == 1 ? Q_MG : 1, g0, g1);
        return;
    }
    for (int g = g0; g < g1; g++)
        for (int j = j0; j < j1; j++) {
            const int nt =
                jb->n_tok - j * MM_PACK_NT < MM_PACK_NT ? jb->n_tok - j * MM_PACK_NT : MM_PACK_NT;
            for (int t0 = 0; t0 < nt; t0 += Q_NT)
                wide(jb, g, j, t0, nt - t0 < Q_NT ? nt - t0 : Q_NT);
        }
}

/* The integer copies this level multiplies, each with its tiles. */
static const struct int_copy {
    enum ggml_type type;
    narrow_fn *narrow;
    int_wide_fn *wide;
} int_copies[] = {
    {GGML_TYPE_Q8_0, q8_narrow, q8_wide},   {GGML_TYPE_Q4_K, k4_narrow, k4_wide},
    {GGML_TYPE_Q4_0, q40_narrow, q40_wide}, {GGML_TYPE_Q4_1, q41_narrow, q41_wide},
    {GGML_TYPE_Q5_0, q50_narrow, q50_wide}, {GGML_TYPE_Q5_1, q51_narrow, q51_wide},
    {GGML_TYPE_IQ4_NL, nl_narrow, nl_wide}, {GGML_TYPE_IQ4_XS, xs_narrow, xs_wide},
};

/* Type's entry in int_copies, or NULL. */
static const struct int_copy *int_copy_of(enum ggml_type type)
{
    for (size_t i = 0; i < sizeof int_copies / sizeof int_copies[0]; i++)
        if (int_copies[i].type == type)
            return &int_copies[i];
    return NULL;
}

/* Float weights: row groups outside, token tiles inside: a group's
 * weights stay in cache while the tiles [j0, j1) of MM_PACK_FNT tokens
 * pass, each as two tiles of A_NT. */
static void groups_avx2(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1)
{
    const enum ggml_type type = jb->w->type;
    if (!mm_is_float_type(type)) { /* has_avx2: one of int_copies */
        const struct int_copy *c = int_copy_of(type);
        int_groups(jb, c->narrow, c->wide, g0, g1, j0, j1);
        return;
    }
    if (jb->n_tok <= MM_PACK_NARROW) {
        narrow_groups(jb,
                      type == GGML_TYPE_F32   ? f32_narrow
                      : type == GGML_TYPE_F16 ? f16_narrow
                                              : bf16_narrow,
                      jb->n_tok == 1 ? A_MG : A_MG2, g0, g1);
        return;
    }
    const bool widen = jb->wide && j1 - j0 >= MM_PACK_WIDE_TILES;
    wide_fn *fn = widen                   ? f16w_wide
                  : type == GGML_TYPE_F32 ? f32_wide
                  : type == GGML_TYPE_F16 ? f16_wide
                                          : bf16_wide;
    for (int g = g0; g < g1; g++) {
        if (widen && (g % 2 == 0 || g == g0))
            f16_widen_pair(jb, g & ~1);
        for (int j = j0; j < j1; j++) {
            const int t1 = (j + 1) * MM_PACK_FNT < jb->n_tok ? (j + 1) * MM_PACK_FNT : jb->n_tok;
            for (int t = j * MM_PACK_FNT; t < t1; t += A_NT)
                fn(jb, g, t, t1 - t < A_NT ? t1 - t : A_NT);
        }
    }
}

static bool has_avx2(enum ggml_type type)
{
    return mm_is_float_type(type) || int_copy_of(type) != NULL;
}

const struct mm_pack_kernels KERN(mm_pack_kernels) = {
    .name = "avx2-maddubs 16-row",
    .has = has_avx2,
    .quantize = quantize_avx2,
    .groups = groups_avx2,
};

#else
typedef int matmul_pack_avx2_empty; /* ISO C: a translation unit declares something */
#endif
