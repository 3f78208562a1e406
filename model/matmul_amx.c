/*
 * matmul_amx.c - out[t][o] = sum_i W[o][i] * x[t][i] over weights in bf16
 * pairs (matmul_bf16.h's copy) by AMX's bf16 tiles: tdpbf16ps.
 *
 * ---------------------------------------------------------------------------
 * Why tiles
 * ---------------------------------------------------------------------------
 *
 * matmul_bf16.c's vdpbf16ps makes 32 products per instruction, and on an
 * Intel core it issues at half the FMA's rate, so there BF16 weights were
 * multiplied faster widened to f32 (matmul_pack_run.c's choice). One
 * tdpbf16ps makes 8,192: 16 tokens x 16 rows x 32 inputs, from an "A"
 * tile of 16 tokens' 16 pairs and a "B" tile of 16 pairs of 16 rows, into
 * a "C" tile of 16 x 16 f32 sums, in about 16 cycles of the core's matrix
 * unit. The copy in pairs is already what B wants: pair p's line of a
 * group (64 bytes: 16 rows' elements 2p and 2p + 1) is row p of the tile,
 * and the next pair's line of the same group is 128 bytes on, the tile's
 * stride. The activations go one row per token (matmul_bf16.h), a tile's
 * 16 rows np x 4 bytes apart.
 *
 * A block is a pair of row groups (32 rows) x MM_AMX_NT tokens: four C
 * tiles (2 token tiles x 2 groups) held in the matrix unit for the whole
 * depth, two A and two B tiles loaded per 32 inputs, each used twice:
 * 2 KiB of weights and 2 KiB of activations per four tdpbf16ps. The f32
 * sums leave the tiles once, at the end of the row, straight into out
 * where the block is whole. Nothing else runs per input: unlike q8_0's
 * blocks (matmul_pack.c's "AMX: tried, not landed") bf16 has no scale to
 * fold every 32 inputs.
 *
 * Measured on an AMX Xeon (one thread, 512 tokens, the 576 x 30 model's
 * shapes): a scratch program of this loop alone over activations already
 * in bf16, 1,250-1,770 GFLOP/s; bench_bf16's layer (rounding included)
 * 691 GFLOP/s on one thread, 1,660 on two, against the f32 tile's 161 and
 * 321 and vdpbf16ps's 108 and 217, of a tdpbf16ps peak of ~3,500 per
 * core: each step's 4 KiB of tile loads come from L2. Figures on the
 * model are in matmul_pack_run.c's "Which weights go to bf16 pairs".
 *
 * ---------------------------------------------------------------------------
 * Numerics and invariance
 * ---------------------------------------------------------------------------
 *
 * Inputs as for vdpbf16ps: the weights as stored (bf16), the activations
 * rounded to bf16 to nearest even; each product is exact, and the sums are
 * f32. But the matrix unit does not add a row's products in vdpbf16ps's
 * order (odd element, then even, each rounded, pair after pair). What it
 * does, measured bit for bit (0 of 7,680 sums of 576 pairs differ; adding
 * each pair's two products first, fused or rounded, the 32 products of an
 * instruction fused, or in a tree, all differ in 55-95% of them): per
 * tdpbf16ps (16 pairs), for each C element, the 16 even products added in
 * one chain of f32 roundings starting from 0, the 16 odd ones in another,
 * the two chains added, and that added to C; denormal inputs read as 0 and
 * denormal results flushed to 0 (the instruction's DAZ and FTZ).
 * tests/test_bf16.c holds both engines to the same bound.
 *
 * So a token's result is the same whatever the other rows of its tile
 * hold, the batch or the split among threads (rows of a tile past the
 * batch are read from the scratch, uninitialised, maybe NaN, and their sums
 * dropped: a C element depends only on its own A row and B column). And
 * decoding (at most MM_PACK_NARROW tokens) need not use the tiles at all:
 * tiles_in_vectors does the same arithmetic in AVX-512 registers, each
 * chain one FMA per pair, under MXCSR's DAZ and FTZ. A token alone and the
 * same token in a batch of the tiles give the same bits (test_bf16's
 * bound_invariance; test_amx_denormals where products underflow).
 *
 * Decoding: when it ran on the tiles (the token's row as an A tile read
 * with stride 0, two pairs of groups at a time), it was 7-12% slower than
 * the vector kernels in the model, for a cause not found (not the tile
 * configuration per call, the prefetch distance or level, the stores, the
 * core's clock or the attention around it), and bench_matmul's decoding
 * step (211 matrices) took 9.19-9.50 ms against the widened copy's
 * 7.88-8.17. In vector registers, streaming up to four pairs of groups
 * side by side as the vector kernels' narrow tiles do, it takes 8.09-8.26.
 *
 * The tiles: Linux grants their state per process on request (cpu.c asks
 * once); each call loads the configuration on its thread and releases the
 * tiles on return, so a thread holds their 8 KiB of state only while it
 * multiplies and a context switch between calls saves none of it.
 *
 * Levels: only the avx512 copy has these kernels, compiled for the amx-tile
 * and amx-bf16 targets function by function (the rest of the level does
 * not assume them), and matmul_pack_run.c calls them only while cpu_amx().
 */
#include "model/matmul_bf16.h"

#include "model/matmul_simd.h"

#if defined(KERN_AVX512)

#define AMX_FN __attribute__((target("amx-tile,amx-bf16")))

/* Tile numbers (literals: the intrinsics paste them into register names):
 * C (token tile h, group e) = 2h + e, A (token tile h) = 4 + h, B (group
 * e) = 6 + e. */

/* Palette 1, every tile 16 rows x 64 bytes. Static and const: ldtilecfg
 * reads all 64 bytes. */
static const struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_cfg = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

/* Token t's pairs into its row, 16 inputs at a time. */
static void round_amx(const struct mm_pack_job *jb, const float *x, int t)
{
    const int n_in = jb->w->n_in;
    uint32_t *dst = jb->xb + (size_t)t * (size_t)mm_bf16_pairs(jb->w);
    int i = 0;
    for (; i + 16 <= n_in; i += 16, dst += 8)
        _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(round16(_mm512_loadu_ps(x + i))));
    for (; i < n_in; i += 2, dst++) {
        uint32_t lo = qt_f32_to_bf16(x[i]), hi = i + 1 < n_in ? qt_f32_to_bf16(x[i + 1]) : 0;
        *dst = lo | hi << 16;
    }
}

/* C tile c (16 tokens from t0 x group g's 16 rows) into out: straight when
 * all of it exists, else through buf, the rows and tokens that do. */
#define STORE_C(c, g, t0, nt)                                                                      \
    do {                                                                                           \
        const int o0_ = (g)*MM_PACK_ROWS, no_ = n_out - o0_;                                       \
        float *dst_ = jb->out + (size_t)(t0) * (size_t)n_out + (size_t)o0_;                        \
        if (no_ >= MM_PACK_ROWS && (nt) == 16) {                                                   \
            _tile_stored(c, dst_, (size_t)n_out * sizeof(float));                                  \
        } else if (no_ > 0) {                                                                      \
            _tile_stored(c, buf, 64);                                                              \
            for (int t_ = 0; t_ < (nt); t_++)                                                      \
                memcpy(dst_ + (size_t)t_ * (size_t)n_out, buf[t_],                                 \
                       sizeof(float) * (size_t)(no_ < MM_PACK_ROWS ? no_ : MM_PACK_ROWS));         \
        }                                                                                          \
    } while (0)

/* Pair of groups q (groups 2q, 2q + 1) x the nt (1..MM_AMX_NT) tokens from
 * t0: one token tile's two C tiles, or both tiles' four. */
AMX_FN static void amx_block(const struct mm_pack_job *jb, size_t q, int t0, int nt)
{
    const struct mm_weight *w = jb->w;
    const int np = mm_bf16_pairs(w), n_out = w->n_out;
    const uint8_t *pw = (const uint8_t *)w->packed + q * mm_bf16_pair_bytes(w);
    const uint32_t *x0 = jb->xb + (size_t)t0 * (size_t)np, *x1 = x0 + 16 * (size_t)np;
    /* one token: its row 16 times (stride 0), no other row read */
    const size_t xs = nt == 1 ? 0 : (size_t)np * 4;
    float buf[16][16] __attribute__((aligned(64)));

    _tile_zero(0);
    _tile_zero(1);
    if (nt > 16) {
        _tile_zero(2);
        _tile_zero(3);
        for (int p = 0; p < np; p += 16) {
            _tile_loadd(6, pw + (size_t)p * 128, 128);
            _tile_loadd(7, pw + (size_t)p * 128 + 64, 128);
            _tile_loadd(4, x0 + p, xs);
            _tile_loadd(5, x1 + p, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int p = 0; p < np; p += 16) {
            _tile_loadd(6, pw + (size_t)p * 128, 128);
            _tile_loadd(7, pw + (size_t)p * 128 + 64, 128);
            _tile_loadd(4, x0 + p, xs);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
    }
    const int g = 2 * (int)q, n0 = nt < 16 ? nt : 16;
    STORE_C(0, g, t0, n0);
    STORE_C(1, g + 1, t0, n0);
    if (nt > 16) {
        STORE_C(2, g, t0 + 16, nt - 16);
        STORE_C(3, g + 1, t0 + 16, nt - 16);
    }
}

/* A lane's even (low) and odd (high) bf16 as f32. */
static inline __m512 bf16_even(__m512i v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
static inline __m512 bf16_odd(__m512i v)
{
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}

/* Pairs of groups a decoding call runs side by side: up to 4 streams for
 * one token, 2 for two (the 3 x 2 x tokens x pairs sums in 24 registers). */
#define VEC_PAIRS 4

/*
 * Decoding (nt <= MM_PACK_NARROW tokens from token 0), the np pairs of
 * groups from q, by the tiles' arithmetic in vector registers ("Decoding"
 * above): per 16 pairs, for each row and token, the even products in one
 * chain of f32 FMAs and the odd ones in another, the two added, then added
 * to the sum. Call with MXCSR's DAZ and FTZ set, as the matrix unit works.
 * Each pair of groups is its own stream, prefetched as the vector kernels'
 * are (matmul_pack.c's "Decoding").
 */
static inline __attribute__((always_inline)) void
tiles_in_vectors(const struct mm_pack_job *jb, size_t q, const int npq, const int nt)
{
    const struct mm_weight *w = jb->w;
    const int np = mm_bf16_pairs(w), n_out = w->n_out;
    const uint8_t *pq[VEC_PAIRS];
    for (int h = 0; h < npq; h++)
        pq[h] = (const uint8_t *)w->packed + (q + (size_t)h) * mm_bf16_pair_bytes(w);
    __m512 acc[MM_PACK_NARROW][2 * VEC_PAIRS];
    for (int t = 0; t < nt; t++)
        for (int e = 0; e < 2 * npq; e++)
            acc[t][e] = _mm512_setzero_ps();
    for (int p0 = 0; p0 < np; p0 += 16) {
        float xe[MM_PACK_NARROW][16] __attribute__((aligned(64)));
        float xo[MM_PACK_NARROW][16] __attribute__((aligned(64)));
        __m512 ev[MM_PACK_NARROW][2 * VEC_PAIRS], od[MM_PACK_NARROW][2 * VEC_PAIRS];
        for (int t = 0; t < nt; t++) {
            const __m512i xv = _mm512_loadu_si512(jb->xb + (size_t)t * (size_t)np + p0);
            _mm512_store_ps(xe[t], bf16_even(xv));
            _mm512_store_ps(xo[t], bf16_odd(xv));
            for (int e = 0; e < 2 * npq; e++)
                ev[t][e] = od[t][e] = _mm512_setzero_ps();
        }
        prefetch_pairs(pq, 2 * npq, (size_t)p0 * 128, 16 * 128, MM_PACK_PREFETCH);
        for (int k = 0; k < 16; k++) {
            for (int h = 0; h < npq; h++) {
                const uint8_t *line = pq[h] + (size_t)(p0 + k) * 128;
                const __m512i w0 = _mm512_loadu_si512(line), w1 = _mm512_loadu_si512(line + 64);
                const __m512 e0 = bf16_even(w0), o0 = bf16_odd(w0);
                const __m512 e1 = bf16_even(w1), o1 = bf16_odd(w1);
                for (int t = 0; t < nt; t++) {
                    const __m512 a = _mm512_set1_ps(xe[t][k]), b = _mm512_set1_ps(xo[t][k]);
                    ev[t][2 * h] = _mm512_fmadd_ps(a, e0, ev[t][2 * h]);
                    od[t][2 * h] = _mm512_fmadd_ps(b, o0, od[t][2 * h]);
                    ev[t][2 * h + 1] = _mm512_fmadd_ps(a, e1, ev[t][2 * h + 1]);
                    od[t][2 * h + 1] = _mm512_fmadd_ps(b, o1, od[t][2 * h + 1]);
                }
            }
        }
        for (int t = 0; t < nt; t++)
            for (int e = 0; e < 2 * npq; e++)
                acc[t][e] = _mm512_add_ps(acc[t][e], _mm512_add_ps(ev[t][e], od[t][e]));
    }
    for (int e = 0; e < 2 * npq; e++) {
        const int o0 = (2 * (int)q + e) * MM_PACK_ROWS, no = n_out - o0;
        if (no <= 0)
            break;
        const __mmask16 m = no >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << no) - 1u);
        for (int t = 0; t < nt; t++)
            _mm512_mask_storeu_ps(jb->out + (size_t)t * (size_t)n_out + (size_t)o0, m, acc[t][e]);
    }
}

/* Decoding's groups [g0, g1) (g0 even) by tiles_in_vectors, as many pairs
 * side by side as the registers hold. Not inlined: its arithmetic stays
 * between the caller's two MXCSR writes. */
static __attribute__((noinline)) void narrow_groups(const struct mm_pack_job *jb, int g0, int g1)
{
    int g = g0;
    if (jb->n_tok == 1) {
        for (; g + 6 < g1; g += 8)
            tiles_in_vectors(jb, (size_t)g / 2, 4, 1);
        for (; g + 2 < g1; g += 4)
            tiles_in_vectors(jb, (size_t)g / 2, 2, 1);
        for (; g < g1; g += 2)
            tiles_in_vectors(jb, (size_t)g / 2, 1, 1);
    } else {
        for (; g + 2 < g1; g += 4)
            tiles_in_vectors(jb, (size_t)g / 2, 2, 2);
        for (; g < g1; g += 2)
            tiles_in_vectors(jb, (size_t)g / 2, 1, 2);
    }
}

/* narrow_groups under DAZ and FTZ, MXCSR restored on return. */
static void narrow_in_vectors(const struct mm_pack_job *jb, int g0, int g1)
{
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    narrow_groups(jb, g0, g1);
    _mm_setcsr(csr);
}

/* Pairs of groups outside (their weights stay in cache while the token
 * tiles pass), token tiles inside, on this thread's tiles. */
AMX_FN static void groups_amx(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1)
{
    if (jb->n_tok <= MM_PACK_NARROW) {
        if (j0 < j1)
            narrow_in_vectors(jb, g0, g1);
        return;
    }
    __asm__ volatile("" ::: "memory"); /* tileloadd's asm names no memory it reads */
    _tile_loadconfig(&amx_cfg);
    for (int g = g0; g < g1; g += 2)
        for (int j = j0; j < j1; j++) {
            const int t0 = j * MM_AMX_NT, left = jb->n_tok - t0;
            amx_block(jb, (size_t)g / 2, t0, left < MM_AMX_NT ? left : MM_AMX_NT);
        }
    _tile_release();
}

const struct mm_amx_kernels KERN(mm_amx_kernels) = {
    .name = "amx-bf16 tiles",
    .round = round_amx,
    .groups = groups_amx,
};

#else /* no AMX kernels at this level */

const struct mm_amx_kernels KERN(mm_amx_kernels) = {
    .name = NULL,
    .round = NULL,
    .groups = NULL,
};

#endif
