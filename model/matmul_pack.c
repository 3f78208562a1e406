/*
 * matmul_pack.c - out[t][o] = sum_i W[o][i] * x[t][i] over weights
 * repacked at load (matmul_internal.h's layouts, written by
 * matmul_pack_run.c): the prefill microkernels, at the AVX-512 level (the
 * same tiles in 256-bit registers, for the AVX2 level: matmul_pack_avx2.c).
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
 * Float weights (f32, f16, bf16)
 * ---------------------------------------------------------------------------
 *
 * Stored as 16 rows' element k side by side, one load (and for f16/bf16
 * one exact widening to f32) gives the 16 rows' weights of input k, and one
 * FMA with the token's x[k] broadcast (from memory) adds to each row's own
 * lane. A tile of 2 groups x 12 tokens makes 24 FMAs per 2 loads and
 * widenings. The activations stay f32 and are read where the caller has
 * them, a row per token: the tile's 12 tokens are 12 read streams, one
 * cache line per 16 inputs each, their offsets kept in registers. They
 * used to be copied first into a tile-major layout (x[t][k] at constant
 * offsets from one pointer); that copy, a strided store per element, was
 * ~7% of the float products' samples and the streams cost nothing
 * measurable in the tile. Numerics: the exact f32 products
 * of the stored weights, summed in one f32 chain per (row, token) along k
 * (matmul.c sums 16 lanes and adds them at the end): the same error bound,
 * n_in roundings of at most 2^-24 of the running |sum|. The FMA, not the
 * memory, is the limit here, so this gains less than q8_0 (matmul.c's f16
 * tile already keeps ~70% of the FMA peak busy); avx512_bf16's two-wide
 * dot product would be the next step, at the price of rounding weights and
 * activations to bf16.
 *
 * f16 weights are widened once per pair of groups, not once per tile,
 * where that pays. A vcvtph2ps is two instructions on the FMA's two ports,
 * so a 2 x 12 tile spends 4 of every 28 of their slots widening: it kept
 * 70-71% of the FMA peak busy in bench_prefill's layer where f32 kept
 * 77-80%. Where one kernel call crosses at least MM_PACK_WIDE_TILES = 8
 * token tiles, the thread first widens the pair's 2 x 16 x n_in weights
 * into its own f32 copy in the scratch (n_in x 128 bytes per thread,
 * sized by mm_scratch_bytes for the call's threads: 192 KiB at 1,536
 * inputs), and f32 tiles read that copy. The products are the same exact
 * f32 products in the same order, so the bits are the f16 tile's; a token
 * alone (decoding) never widens, and test_quant's batch invariance checks
 * one against the other. Measured (bench_prefill, one thread's CPU time,
 * load 0.3-0.6): f16 71% -> 81-84% of the FMA peak, two threads 334 ->
 * 392-400 GOPS; the 576 x 30 f16 model prefilling 741 tokens on 2
 * threads, 3 alternated rounds: 1,052-1,112 -> 1,121-1,252 tokens/s,
 * decoding unchanged. Below the threshold the copy costs more than it
 * saves: one product alone, its weights hot in L2 (576 -> 1536, 1536 ->
 * 576, 576 -> 576), widening every call ran 2 tiles at 136-139 GFLOP/s
 * against 179-184 and 64 tokens 2-3% slower, level at 84 tokens, and
 * 10-15% faster from 96 tokens on one thread (0-10% on two). The same
 * copy of f32 weights (to read a thread's own buffer) gained 1-2%, within
 * the noise: not made.
 *
 * ---------------------------------------------------------------------------
 * q4_K: the stored nibbles, regrouped
 * ---------------------------------------------------------------------------
 *
 * The K format people download most keeps its bytes (4,736 per 32 rows x
 * 256 inputs against 4,608 stored). A 64-byte chunk holds 4 stored bytes of
 * each of 16 rows; their low nibbles are 4 weights of one sub-block of 32
 * and their high nibbles the same 4 of the next, as q4_K stores them, so a
 * row's bytes move in runs of 4. vpdpbusd takes the nibbles as unsigned
 * bytes straight against the activations (q8_0's slots: a block of 32 is
 * one sub-block), each row's exact integer sum in its own lane; the
 * sub-block's 6-bit scale and min times d and dmin are exact f32 vectors
 * (16 rows each), applied once per sub-block:
 *
 *     acc += isum * (d sc_s) * dx - (dmin m_s) * (dx sum(q))
 *
 * in that order for a (row, token) in every tile. Activations per 32
 * rather than matmul_k.c's per 256 round less. A decoding tile sums both
 * sub-blocks of a chunk in one pass (the registers hold 2 x 8 sums); two
 * passes, a reload and a shift each, had left it compute-bound at 54 GB/s
 * from DRAM. Measured (bench_matmul 4096 x 4096, 2 threads, load ~1.2,
 * stored rows' kernel -> this copy): cold 60 -> 66-73 GB/s, 64 tokens
 * 511 -> 834-842 GFLOP/s. A 768 x 12 q4_K model (output q6_K, 790-token
 * prompt, alternated, load 1.0-1.3) prefills at 1.5x (2118-2242 ->
 * 3152-3380 tokens/s) and decodes as fast as before (488-525 -> 505-539):
 * its matrices are small enough that the stored kernel kept up there.
 * q5_K the same way (its fifth bits as a 64-bit mask per chunk half, added
 * under the mask) prefilled at 1.6x but decoded 10-15% slower than its
 * stored kernel, so q5_K is not repacked. Nor is q6_K: its scale per 16
 * elements costs each 16 a start and a fold of its own (conversion,
 * multiply, fused add per row group and token), which the tile's products
 * do not hide. Tried two ways (bench_matmul 4096 x 4096, 2 threads, GB/s of
 * the stored bytes, against the stored kernel in the same runs): its
 * stored bits regrouped (6,720 bytes per 32 rows x 256, as stored; the
 * codes rebuilt per chunk by a mask, shifts and a ternary logic) decoded
 * at 42-44 GB/s against 61 and gave 536-551 GFLOP/s at 64 tokens against
 * 447-479; its codes widened to bytes (8,768 bytes) 53-56 GB/s and
 * 570-650 GFLOP/s against 411-473. At most ~1.4x the prefill, for a
 * slower decode or a third more memory.
 *
 * ---------------------------------------------------------------------------
 * 4- and 5-bit blocks: the stored bits
 * ---------------------------------------------------------------------------
 *
 * q4_0, q4_1, q5_0, q5_1, iq4_nl and iq4_xs keep their bytes too
 * (matmul_pack_run.c): a 64-byte chunk holds a block's stored bytes
 * 4k..4k+3 of each of 16 rows, whose low nibbles are elements 4k.. and
 * high nibbles 16 + 4k.., so a block is 4 chunks, each two vpdpbusd
 * operands after a mask and a shift; q5's fifth bits come from one more
 * chunk per block by a shift and a ternary logic each, iq4's levels + 128
 * (unsigned) by a vpshufb. The sum starts at the activations' own -8
 * sum(q) (q4_0's u = w + 8), -16 sum(q) (q5_0) or -128 sum(q) (the levels
 * + 128), q4_1's and q5_1's min is one more fused add per block, and the
 * fold is q8_0's, so a block gives bit for bit what a q8_0 block of the
 * same integers and scale gives. Against the copies widened to q8_0's
 * blocks they replaced: the same speed at 64 tokens for the 4-bit ones
 * (q5_0 ~9% less), 1.2-1.8x the weights per second from DRAM, half the
 * memory; q4_1 and q5_1 had no repacked kernel (figures in
 * matmul_pack_run.c).
 *
 * ---------------------------------------------------------------------------
 * AMX: tried, not landed
 * ---------------------------------------------------------------------------
 *
 * On a CPU with AMX's int8 tiles the q8_0 copy is already what tdpbsud
 * takes as its weights (a group's chunk k is row k of an 8 x 64-byte tile,
 * the pair's stride 128 bytes), and the activations' slots by tiles of 16
 * tokens are its 16 x 32-byte other operand; one instruction makes the
 * 8,192 products of 16 tokens x 16 rows x one block, and adding each
 * token's -128 sum(q) to the int32 sums gives this kernel's integers, so
 * the fold (the same f32 operations in the same order) gave these tiles'
 * results bit for bit. But q8_0's scale per block of 32 forces the sums
 * out of the tile after every tdpbsud of half the tile's depth: a tile
 * store per block and 16 tokens, which the vector loads of the fold
 * cannot take from the store buffer (they wait for it to reach L1), then
 * the fold itself. Measured (bench of the product alone, 512 tokens, 2
 * threads, load ~0.5; three C tiles in turn, two blocks issued ahead of
 * the one folded, the accumulators in registers): 4096 x 4096 1,237-1,255
 * GFLOP/s against these tiles' 915-990; 2048 x 2048 1,139 against 963;
 * 2048 x 5632 1,015 against 960; 576 x 1536 975-1,030 against 941-1,060.
 * Without the fold (wrong results, the tiles' part alone) 1,490-1,584 at
 * 4096: the tile stores and half-depth products already bound it near
 * 1.6x. A 576 x 30 q8_0 model prefilled 741 tokens at 1,693-2,014
 * tokens/s with it against 1,799-2,153 without (three alternated rounds):
 * its matrices are too narrow (18 blocks per row) to pay. So the tiles
 * are not used here. A format whose scale covers a tile's whole depth
 * does take them: bf16 weights in pairs (matmul_amx.c).
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
 * threads; decoding one token runs this same kernel (a 2 x 1 tile).
 *
 * ---------------------------------------------------------------------------
 * Decoding: one sequential stream
 * ---------------------------------------------------------------------------
 *
 * A decoding step reads every weight once and does little with it (the
 * 2 x 1 tile runs at ~85 GB/s on one core when the weights sit in L3), so
 * its speed is how fast one core's loads come back from DRAM. Demand misses
 * alone are few at a time (one core's L1 miss buffers at DRAM latency give
 * ~13-16 GB/s); beyond that it is the L2 stream prefetcher, and it runs
 * ahead only on a stream it has learned, which it must learn again at each
 * break. So the pair of groups a tile reads is stored as one run of bytes
 * in the order the tile reads them (matmul_internal.h), and a thread's
 * share of a matrix (consecutive pairs) is one run too. Measured on the
 * 576x30 q8_0 shape, one thread, CPU time per decoding step over its 211
 * matrices (143 MB): a plain read of the same bytes 4.3-4.9 ms; the layout
 * of separate groups (two quant runs and two scale runs per tile, breaking
 * every 9.8 KB) 8.3-10.2 ms, and a plain read in that order as slow; the
 * pair layout 5.2-7.1 ms. Splitting the 8 products of a block into
 * independent chains gave nothing: the tile is not waiting on their
 * latency.
 *
 * Software prefetch: a decoding tile asks for its weights into L1
 * (prefetch_pairs), MM_PACK_PREFETCH_FAR = 2 KiB ahead for f16 and q4_K,
 * MM_PACK_PREFETCH = 1 KiB for the other copies: measured on an AMX Xeon
 * (below, and in the 2048 x 16 models' decoding, q4_K 1.16x, q8_0 and
 * q4_0 within noise). The history, machine by machine: the tiles used to
 * ask for their weights 4 KiB ahead into L2 (prefetcht1) and it once measured 12-15% faster on one thread; measured
 * again (the 211 matrices of the 576x30 step, each variant alternated step
 * by step in one process, 25-200 steps, load 2-3.5, an AVX-512 EPYC), it
 * was the slowest choice on both 1 and 2 threads for q8_0, bf16 and f32:
 * with it, 2 threads, medians, q8_0 3.05 ms against 2.95 without; bf16
 * 6.56 against 5.69; f32 11.16 against 9.67; one thread q8_0 5.62 -> 5.25,
 * bf16 9.56 -> 8.10, f32 17.06 -> 15.47. A plain read of the same bytes
 * sets the pace, and the q8_0 tiles without prefetch reach it (one thread,
 * q8_0 at 8 groups: 28.2 GB/s against the plain read's 29.0; on an AMX
 * Xeon, 2 threads, 1.01 of the triad's bus). f16 exact was the first
 * exception: its widening makes ~4 times the instructions per byte of
 * f32, so the out-of-order window covers a quarter of the bytes ahead and
 * fewer misses are in flight; asking for lines into L1 2 KiB ahead keeps
 * them in flight (EPYC, 2 threads: 7.70 ms with prefetcht1 4 KiB, 7.86
 * with none, 6.84 with prefetcht0 2 KiB; then distances 1, 2, 4, 8 KiB:
 * 6.18, 6.23, 6.52, 6.65 against none 6.42). There, prefetcht0 2 KiB
 * ahead came within noise of none for bf16 and was slower for f32. On an
 * AMX Xeon (Sapphire Rapids class), `bench_matmul decode 3` (the 576x30
 * step, 2 threads, the fraction of a triad's 40 GB/s, two rounds of each
 * distance, load ~0.6) put 1 KiB ahead first for both: bf16 pairs 0.69
 * (none) -> 0.78 (512 B), 0.77-0.78 (768), 0.79-0.82 (1 KiB), 0.73-0.74
 * (2 KiB), 0.71-0.72 (4 KiB), 0.74-0.76 (1.5 KiB); f32 0.78 (none) ->
 * 0.82-0.83 (512), 0.81-0.85 (1 KiB), 0.83-0.85 (1.5 KiB), 0.76-0.78 (2
 * KiB). f16 exact there: 0.66-0.67 (none), 0.70-0.71 (512), 0.74-0.77 (1
 * KiB), 0.77-0.80 (1.5 KiB), 0.75-0.76 (2 KiB, kept).
 *
 * ---------------------------------------------------------------------------
 * Narrow tiles: decoding's chains
 * ---------------------------------------------------------------------------
 *
 * A tile's sums are chains: each (row, token) accumulator waits for its
 * previous multiply-add. A 2 x 1 tile has two, so one k step of the float
 * tile costs at least the FMA's latency (4 cycles) and vdpbf16ps's for the
 * bf16 pairs, whatever the memory does: measured in one core's L2, the f16
 * 2 x 1 tile ran at ~55 GB/s, the bf16 one at ~72. Streaming from DRAM a
 * stall then leaves the chain behind, and it catches up at that rate only.
 * So a batch of at most MM_PACK_NARROW tokens runs narrow tiles of up to
 * N_MG = 8 groups (four pairs, four sequential streams) for float weights
 * and for one q8_0 token (Q_MG; two q8_0 tokens take 4, the register
 * budget of 2 x 4 i32 and f32 sums): f16 in L2 with 4 groups ~55 -> ~83
 * GB/s. Each
 * row's chain is the very sequence of operations it has in a 2-group tile,
 * so nothing changes in the bits, and the driver hands the kernels up to
 * four pairs at a time only where a thread's share holds them
 * (matmul_pack_run.c): the split among threads is the same. Measured on
 * the 576x30 model decoding step (bench_matmul decode, best of 30 steps):
 * 4 groups, 2 threads, 2 alternated pairs at load 2.7-3.0: bf16 6.8-7.0
 * -> 5.6 ms, f16 rounded to bf16 6.9-7.0 -> 5.6-5.7, f16 exact 7.1-7.3 ->
 * 6.7-6.8, f32 11.1-11.6 -> 10.0-10.4, q8_0 unchanged (its 8 vpdpbusd per
 * block were never the limit); then 8 groups against 4, one thread by its
 * CPU time, 3 alternated pairs at load 5-8: f16 11.4-13.3 -> 9.7-11.1 ms,
 * f16 as bf16 10.4-12.9 -> 8.7-10.0, bf16 8.7-13.4 -> 8.7-9.7, f32
 * 17.2-23.3 -> 16.2-18.8; a second such run at load 6-7 within noise. The
 * kernel alone, one core, 576x576 in L2 (best call of 2,000), 4 -> 8
 * groups, 2 alternated pairs: bf16 pairs 129-142 -> 158-166 GB/s, f16
 * rounded 122-124 -> 162-166, f16 exact 93-102 -> 103-106, f32 87 -> 89-95.
 * One q8_0 token in 8 groups rather than 4 (without prefetch, the 211
 * matrices alternated step by step): 2 threads 2.95 -> 2.69 ms median,
 * one thread 5.25 -> 4.79 ms.
 *
 * Measured (bench_prefill, one SmolLM-135M layer x 512 tokens, one
 * thread's CPU time, load ~12 on 2 cores): q8_0 314 GOPS = 68% of the
 * vpdpbusd peak measured beside it (matmul.c: 89, 19%); f16 80% and f32 86%
 * of the FMA peak (matmul.c: 71% and 69%).
 *
 * On an AMX Xeon the same bench gives f16 63-69% and f32 64-68% of the
 * FMA peak. The float tile's loop alone (2 x 12, its operands in L1, a
 * separate microbenchmark) reaches 85-95% there, and 75-80% with the
 * weights streaming from L2 as they do here (a pair of groups is 72 KiB
 * of f32 at 576 inputs, read again for each token tile). The copy of the
 * activations was the one cost found outside the tile: reading them in
 * place, one f32 product of 512 tokens on one thread by its CPU time (best
 * of 40 calls, alternated binaries, against the FMA peak measured beside
 * it) went 576 -> 192 from 71-72% to 80-81%, 1536 -> 576 from 64-69% to
 * 73-75%, 576 -> 1536 69-74% to 73-77%, 576 -> 576 77-78% to 79-81%; a
 * 576 x 30 model prefilling 741 tokens on 2 threads, 3 alternated rounds:
 * f32 853-884 -> 929-975 tokens/s, f16 984-995 -> 1,027-1,053; the
 * layer in bench_prefill (its copies now in 2 MiB pages, as the model's
 * are: in 4 KiB pages the layer's products took 3% longer), 3 alternated
 * runs: f16 67% -> 71-72%, f32 67-70% -> 72-73%. The layer stays below
 * the products measured one by one (each of its products starts with the
 * others' weights in the caches). Nothing tried around the tile itself
 * helped: the inputs
 * cut in blocks of 64, 128 or 256 per call, each tile's sums carried
 * through the output between blocks so that a block's weights stay in L1
 * (54%, 58-62%, 56-61% against 63-67%); 4 groups x 6 tokens (one thread
 * 55-59%; two threads f32 +8%, f16 -5%); 2 x 14 (64-69%); the weights
 * prefetched 256 B to 2 KiB ahead in wide tiles too (+0-4%, within the
 * run's noise).
 *
 * Levels: avx512 (with VNNI) has these kernels; avx2 has its own in
 * matmul_pack_avx2.c, over the same copies, with the same bits. At a
 * level without kernels for a type (scalar) its repacked copy is not
 * made (see matmul_pack_run.c), and matmul.c runs.
 */
#include "model/matmul_internal.h"
#include "model/matmul_simd.h"

#if defined(KERN_AVX512)

#define P_MG 2          /* row groups per tile */
#define N_MG 8 /* row groups per narrow float tile (MM_PACK_NARROW tokens at most) */
#define Q_MG 8 /* row groups per narrow q8_0 tile of one token: 8 i32 + 8 f32 sums */
#define Q_MG2 4 /* ... of MM_PACK_NARROW tokens: 4 i32 + 4 f32 sums per token fit */
#define P_NT MM_PACK_NT /* tokens per tile */

/* Group g's outputs for nt tokens from t0: the rows that exist (a padded
 * last group stores fewer lanes). */
INLINE void store_group(const struct mm_pack_job *jb, int g, int t0, int nt, const __m512 *acc)
{
    const int o0 = g * MM_PACK_ROWS, n = jb->w->n_out - o0;
    const __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    for (int t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(jb->out + (size_t)(t0 + t) * (size_t)jb->w->n_out + (size_t)o0, m,
                              acc[t]);
}

/* iq4_nl's 16 levels plus 128, as unsigned bytes, in each 128-bit lane
 * (vpshufb looks up within lanes). */
INLINE __m512i nl_levels(void)
{
    return _mm512_broadcast_i32x4(_mm_setr_epi8((char)1, (char)24, (char)45, (char)63, (char)79,
                                                (char)93, (char)106, (char)118, (char)129,
                                                (char)141, (char)153, (char)166, (char)181,
                                                (char)197, (char)217, (char)241));
}

/*
 * mg groups from g0 x nt tokens of token tile j, blocks as the copy of
 * type holds them: q8_0's int8 blocks, or one of the nibble formats (mg,
 * nt and type are constants where this is inlined, so the loops below
 * unroll into registers and the format's branches fold away; a tile's
 * activations are one pointer apart by constants). Per block of 32, each
 * (row, token) sum is exact in int32: vpdpbusd of the unsigned codes
 * against the int8 activations, started at the activations' own
 * correction for the codes' offset (-128 sum(q) for q8_0's w + 128 and
 * iq4's levels + 128, -8 sum(q) for q4_0's u = w + 8, -16 sum(q) for
 * q5_0's; none for q4_1 and q5_1, whose weight is d u + m), then acc +=
 * (float)sum * (d * dx), and for q4_1 and q5_1 acc += m * (dx * sum(q)).
 * The integer sum is exact and the fold q8_0's, so a block gives bit for
 * bit what a q8_0 block of the same integers and scale gives.
 */
INLINE void int8_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int nt,
                      enum ggml_type type)
{
    const struct mm_weight *w = jb->w;
    const int nb = w->n_in / QT_QK;
    const bool nib = type != GGML_TYPE_Q8_0;
    const bool five = type == GGML_TYPE_Q5_0 || type == GGML_TYPE_Q5_1;
    const bool mins = type == GGML_TYPE_Q4_1 || type == GGML_TYPE_Q5_1;
    const bool levels = type == GGML_TYPE_IQ4_NL || type == GGML_TYPE_IQ4_XS;
    const size_t bstride = nib ? mm_pack_nib_block(type) : MM_PACK_Q8_PAIR;
    const size_t soff = nib ? mm_pack_nib_scales(type) : MM_PACK_Q8_SCALES;
    const int cshift = type == GGML_TYPE_Q4_0 ? 4 : type == GGML_TYPE_Q5_0 ? 3 : 0;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10), lv = nl_levels();
    /* the pair of g0 (even: tiles start on pairs); group g's chunk k of
     * block b at b * bstride + 128 k + 64 g, its scales after the
     * block's chunks */
    const uint8_t *pq[Q_MG / 2];
    for (int h = 0; h < (mg + 1) / 2; h++)
        pq[h] = (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_pack_pair_bytes(w);
    const size_t at = (size_t)j * (size_t)nb * P_NT;
    const int8_t *xq = jb->q + at * QT_QK;
    const float *xd = jb->d + at;
    const int32_t *xc = jb->c + at;

    __m512 acc[Q_MG][P_NT];
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            acc[g][t] = _mm512_setzero_ps();

    for (int b = 0; b < nb; b++, xq += P_NT * QT_QK, xd += P_NT, xc += P_NT) {
        const uint8_t *blk[Q_MG / 2];
        for (int h = 0; h < (mg + 1) / 2; h++)
            blk[h] = pq[h] + (size_t)b * bstride;
        if (nt == 1)
            prefetch_pairs(pq, mg, (size_t)b * bstride, bstride, MM_PACK_PREFETCH);
        __m512i ia[Q_MG][P_NT];
        for (int t = 0; t < nt; t++) {
            /* -128 sum(q) >> cshift: exact, a multiple of 128 */
            __m512i c = mins ? _mm512_setzero_si512() : _mm512_set1_epi32(xc[t] / (1 << cshift));
            for (int g = 0; g < mg; g++)
                ia[g][t] = c;
        }
        for (int k = 0; k < (nib ? 4 : 8); k++) {
            __m512i wv[Q_MG], wh[Q_MG];
            for (int g = 0; g < mg; g++) {
                const uint8_t *p = blk[g / 2] + 64 * (g % 2);
                wv[g] = _mm512_load_si512((const void *)(p + 128 * k));
                if (nib) { /* low nibbles: elements 4k.., high: 16 + 4k.. */
                    wh[g] = _mm512_and_si512(_mm512_srli_epi16(wv[g], 4), lo4);
                    wv[g] = _mm512_and_si512(wv[g], lo4);
                }
                if (five) { /* the fifth bits, to bit 4: 4k.. at bit 4 + k, 16 + 4k.. at k */
                    const __m512i h = _mm512_load_si512((const void *)(p + MM_PACK_NIB_CHUNKS));
                    wv[g] = _mm512_ternarylogic_epi32(wv[g], _mm512_srli_epi16(h, (unsigned)k), b4,
                                                      0xf8); /* a | (b & c) */
                    wh[g] = _mm512_ternarylogic_epi32(wh[g], _mm512_slli_epi16(h, 4 - (unsigned)k),
                                                      b4, 0xf8);
                }
                if (levels) {
                    wv[g] = _mm512_shuffle_epi8(lv, wv[g]);
                    wh[g] = _mm512_shuffle_epi8(lv, wh[g]);
                }
            }
            for (int t = 0; t < nt; t++) {
                int32_t x4;
                memcpy(&x4, xq + QT_QK * t + 4 * k, 4);
                __m512i xv = _mm512_set1_epi32(x4);
                for (int g = 0; g < mg; g++)
                    ia[g][t] = _mm512_dpbusd_epi32(ia[g][t], wv[g], xv);
                if (nib) {
                    memcpy(&x4, xq + QT_QK * t + 16 + 4 * k, 4);
                    xv = _mm512_set1_epi32(x4);
                    for (int g = 0; g < mg; g++)
                        ia[g][t] = _mm512_dpbusd_epi32(ia[g][t], wh[g], xv);
                }
            }
        }
        __m512 sc[Q_MG], mn[Q_MG];
        for (int g = 0; g < mg; g++) {
            const uint8_t *s = blk[g / 2] + soff;
            sc[g] = type == GGML_TYPE_IQ4_XS
                        ? _mm512_load_ps((const void *)(s + 64 * (g % 2)))
                        : _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(s + 32 * (g % 2))));
            if (mins)
                mn[g] = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(s + 64 + 32 * (g % 2))));
        }
        for (int t = 0; t < nt; t++) {
            __m512 dx = _mm512_set1_ps(xd[t]);
            for (int g = 0; g < mg; g++)
                acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[g][t]), _mm512_mul_ps(sc[g], dx),
                                            acc[g][t]);
            if (mins) { /* dx sum(q) */
                const __m512 sq = _mm512_set1_ps(xd[t] * (float)(xc[t] / -128));
                for (int g = 0; g < mg; g++)
                    acc[g][t] = _mm512_fmadd_ps(mn[g], sq, acc[g][t]);
            }
        }
    }

    for (int g = 0; g < mg; g++)
        store_group(jb, g0 + g, j * P_NT, nt, acc[g]);
}

/* Token-count cases of the tile switches below: each a call with constants. */
#define T_CASE(call, n)                                                                            \
    case n:                                                                                        \
        call(n);                                                                                   \
        break;

/* Each copy's tile: int8_tile with its type constant. */
#define TYPE_TILE(name, type_)                                                                     \
    INLINE void name(const struct mm_pack_job *jb, int g0, int mg, int j, int nt)                  \
    {                                                                                              \
        int8_tile(jb, g0, mg, j, nt, type_);                                                       \
    }
TYPE_TILE(q8_tile, GGML_TYPE_Q8_0)
TYPE_TILE(q4_tile, GGML_TYPE_Q4_0)
TYPE_TILE(q41_tile, GGML_TYPE_Q4_1)
TYPE_TILE(q50_tile, GGML_TYPE_Q5_0)
TYPE_TILE(q51_tile, GGML_TYPE_Q5_1)
TYPE_TILE(nl_tile, GGML_TYPE_IQ4_NL)
TYPE_TILE(xs_tile, GGML_TYPE_IQ4_XS)

/*
 * The 8 tiles of an integer copy whose tile is p##_tile, each a call with
 * constant groups and tokens: p##_tile_1 and _2 for 1 or 2 groups and up
 * to P_NT tokens, _3 and _4 for MM_PACK_NARROW tokens at most, _5 to _8
 * for one token (decoding's narrowest).
 */
#define I_CASE(tile, mg_, n)                                                                       \
    case n:                                                                                        \
        tile(jb, g0, mg_, j, n);                                                                   \
        break;
#define I_WIDE(p, mg_)                                                                             \
    static void p##_tile_##mg_(const struct mm_pack_job *jb, int g0, int j, int nt)                \
    {                                                                                              \
        switch (nt) {                                                                              \
            I_CASE(p##_tile, mg_, 1)                                                               \
            I_CASE(p##_tile, mg_, 2)                                                               \
            I_CASE(p##_tile, mg_, 3)                                                               \
            I_CASE(p##_tile, mg_, 4)                                                               \
            I_CASE(p##_tile, mg_, 5)                                                               \
        default:                                                                                   \
            p##_tile(jb, g0, mg_, j, P_NT);                                                        \
            break;                                                                                 \
        }                                                                                          \
    }
#define I_NARROW(p, mg_)                                                                           \
    static void p##_tile_##mg_(const struct mm_pack_job *jb, int g0, int j, int nt)                \
    {                                                                                              \
        if (nt == 1)                                                                               \
            p##_tile(jb, g0, mg_, j, 1);                                                           \
        else                                                                                       \
            p##_tile(jb, g0, mg_, j, MM_PACK_NARROW);                                              \
    }
#define I_ONE(p, mg_)                                                                              \
    static void p##_tile_##mg_(const struct mm_pack_job *jb, int g0, int j, int nt)                \
    {                                                                                              \
        (void)nt;                                                                                  \
        p##_tile(jb, g0, mg_, j, 1);                                                               \
    }
#define INT_TILES(p)                                                                               \
    I_WIDE(p, 1) I_WIDE(p, 2) I_NARROW(p, 3) I_NARROW(p, 4) I_ONE(p, 5) I_ONE(p, 6) I_ONE(p, 7)    \
        I_ONE(p, 8)
INT_TILES(q8)
INT_TILES(q4)
INT_TILES(q41)
INT_TILES(q50)
INT_TILES(q51)
INT_TILES(nl)
INT_TILES(xs)

/* The narrow tiles: mg (3 to N_MG, or Q_MG2 for q8_0) groups for nt tokens
 * (1..MM_PACK_NARROW). */
#define NARROW_TILES(name, call, mg_)                                                              \
    static void name(const struct mm_pack_job *jb, int g0, int j, int nt)                          \
    {                                                                                              \
        const int mg = mg_;                                                                        \
        if (nt == 1)                                                                               \
            call(1);                                                                               \
        else                                                                                       \
            call(MM_PACK_NARROW);                                                                  \
    }

/* ------------------------------------------------------------------------
 * q4_K: the nibbles as they are, the scales applied per sub-block
 * ------------------------------------------------------------------------ */

/* Group g's 16 (scale or min) codes of sub-block s at p, times the group's
 * f16 factor at f: exact in f32 (an f16 times a 6-bit integer). */
INLINE __m512 q4k_factor(const uint8_t *p, const uint8_t *f)
{
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_load_si128((const __m128i *)p))),
                         _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)f)));
}

/* A q4_K tile's pointers: its pairs' copies, its token tile's activations. */
struct q4k_at {
    const uint8_t *pq[Q_MG / 2];
    const int8_t *xq;
    const float *xd;
    const int32_t *xc;
};

/*
 * The integer sums of sub-blocks 2h (the chunks' low nibbles, into lo) and
 * 2h + 1 (high nibbles, into hi) of super-block sb, for mg groups x nt
 * tokens; `both` false: only the half `high` says. One pass over a chunk
 * for both where the registers hold both sets of sums (a narrow tile:
 * half the loads and shifts of two passes); two passes otherwise.
 */
INLINE void q4k_sums(const struct q4k_at *a, int mg, int nt, int sb, int h, bool both, bool high,
                     __m512i lo[][P_NT], __m512i hi[][P_NT])
{
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    const size_t o = (size_t)sb * MM_PACK_Q4K_PAIR + MM_PACK_Q4K_QS + 128 * 8 * (size_t)h;
    const size_t b0 = (size_t)(8 * sb + 2 * h) * P_NT; /* the activations' blocks */
    const size_t b1 = b0 + P_NT;
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            lo[g][t] = hi[g][t] = _mm512_setzero_si512();
    for (int k = 0; k < 8; k++) {
        __m512i v[Q_MG];
        for (int g = 0; g < mg; g++)
            v[g] = _mm512_load_si512((const void *)(a->pq[g / 2] + o + 128 * k + 64 * (g % 2)));
        for (int t = 0; t < nt; t++) {
            int32_t x0, x1;
            memcpy(&x0, a->xq + (b0 + (size_t)t) * QT_QK + 4 * k, 4);
            memcpy(&x1, a->xq + (b1 + (size_t)t) * QT_QK + 4 * k, 4);
            const __m512i xv0 = _mm512_set1_epi32(x0), xv1 = _mm512_set1_epi32(x1);
            for (int g = 0; g < mg; g++) {
                if (both || !high)
                    lo[g][t] = _mm512_dpbusd_epi32(lo[g][t], _mm512_and_si512(v[g], lo4), xv0);
                if (both || high)
                    hi[g][t] = _mm512_dpbusd_epi32(
                        hi[g][t], _mm512_and_si512(_mm512_srli_epi16(v[g], 4), lo4), xv1);
            }
        }
    }
}

/* Sub-block s of super-block sb into the accumulators: acc += sum * (d
 * sc_s) dx - (dmin m_s) (dx sum(q)), per group and token. */
INLINE void q4k_fold(const struct q4k_at *a, int mg, int nt, int sb, int s, __m512i ia[][P_NT],
                     __m512 acc[][P_NT])
{
    const size_t blk = (size_t)(8 * sb + s) * P_NT;
    for (int g = 0; g < mg; g++) {
        const uint8_t *sg =
            a->pq[g / 2] + (size_t)sb * MM_PACK_Q4K_PAIR + MM_PACK_Q4K_GSCALES * (g % 2);
        const __m512 sc = q4k_factor(sg + 64 + 16 * s, sg);
        const __m512 mn = q4k_factor(sg + 192 + 16 * s, sg + 32);
        for (int t = 0; t < nt; t++) {
            const float dx = a->xd[blk + (size_t)t];
            const float sq = dx * (float)(a->xc[blk + (size_t)t] / -128); /* dx sum(q) */
            acc[g][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[g][t]),
                                        _mm512_mul_ps(sc, _mm512_set1_ps(dx)), acc[g][t]);
            acc[g][t] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(sq), acc[g][t]);
        }
    }
}

/* mg groups from g0 x nt tokens of token tile j, q4_K. Per sub-block s of
 * a super-block (activation block 8 sb + s): vpdpbusd of the unsigned
 * nibbles against the token's int8 activations gives each row's exact
 * integer sum (q4k_sums), then q4k_fold applies the scales in f32: the
 * same operations for a (row, token) in every tile. */
INLINE void q4k_tile(const struct mm_pack_job *jb, int g0, int mg, int j, int nt)
{
    const struct mm_weight *w = jb->w;
    const int nsb = w->n_in / QT_QK_K, nb = w->n_in / QT_QK;
    const size_t at = (size_t)j * (size_t)nb * P_NT;
    struct q4k_at a = {.xq = jb->q + at * QT_QK, .xd = jb->d + at, .xc = jb->c + at};
    for (int h = 0; h < (mg + 1) / 2; h++)
        a.pq[h] = (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_pack_pair_bytes(w);
    const bool both = mg * nt <= Q_MG; /* 2 x mg x nt sums, mg x nt accumulators */

    __m512 acc[Q_MG][P_NT];
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            acc[g][t] = _mm512_setzero_ps();
    for (int sb = 0; sb < nsb; sb++)
        for (int h = 0; h < 4; h++) {
            if (nt == 1) /* a quarter of the super-block's bytes per h */
                prefetch_pairs(a.pq, mg, (size_t)sb * MM_PACK_Q4K_PAIR + h * MM_PACK_Q4K_PAIR / 4,
                               MM_PACK_Q4K_PAIR / 4, MM_PACK_PREFETCH_FAR);
            __m512i lo[Q_MG][P_NT], hi[Q_MG][P_NT];
            q4k_sums(&a, mg, nt, sb, h, both, false, lo, hi);
            q4k_fold(&a, mg, nt, sb, 2 * h, lo, acc);
            if (!both)
                q4k_sums(&a, mg, nt, sb, h, false, true, lo, hi);
            q4k_fold(&a, mg, nt, sb, 2 * h + 1, hi, acc);
        }
    for (int g = 0; g < mg; g++)
        store_group(jb, g0 + g, j * P_NT, nt, acc[g]);
}

INT_TILES(q4k)

/* ------------------------------------------------------------------------
 * Float weights: f32 multiply-adds, the weights widened in registers
 * ------------------------------------------------------------------------ */

#define F_NT MM_PACK_FNT /* tokens per tile: 2 x 12 accumulators */

/* The 16 rows' element k at p, widened to f32 (exactly). */
INLINE __m512 f_widen(enum ggml_type type, const uint8_t *p)
{
    if (type == GGML_TYPE_F32)
        return _mm512_load_ps((const float *)p);
    __m256i h = _mm256_load_si256((const __m256i *)p);
    if (type == GGML_TYPE_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16 */
}

/* mg groups from g0 x nt tokens of token tile j: one f32 chain per row and
 * token along k, the tile's activations one pointer apart by constants.
 * The weights are w's copy as stored in type, or (wide, type F32, mg <= 2)
 * the thread's f32 copy of g0's pair of f16 groups (f16_widen_pair). */
INLINE void f_tile(const struct mm_pack_job *jb, enum ggml_type type, bool wide, int g0, int mg,
                   int j, int nt)
{
    const struct mm_weight *w = jb->w;
    /* the pair of g0 (even): group g's elements k at k * step + g * step / 2 */
    const size_t esz = type == GGML_TYPE_F32 ? 4 : 2, step = 2 * MM_PACK_ROWS * esz;
    const uint8_t *pp[N_MG / 2];
    for (int h = 0; h < (mg + 1) / 2; h++)
        pp[h] = wide ? (const uint8_t *)jb->wide
                     : (const uint8_t *)w->packed + (size_t)(g0 / 2 + h) * mm_pack_pair_bytes(w);
    /* token t of the tile at xt + t * n_in: the caller's rows, in place */
    const size_t ld = (size_t)w->n_in;
    const float *xt = jb->x + (size_t)j * F_NT * ld;

    __m512 acc[N_MG][F_NT];
    for (int g = 0; g < mg; g++)
        for (int t = 0; t < nt; t++)
            acc[g][t] = _mm512_setzero_ps();
    for (int k = 0; k < w->n_in; k++, xt++) {
        if (nt == 1)
            prefetch_pairs(pp, mg, (size_t)k * step, step, mm_pack_float_prefetch(type));
        __m512 wv[N_MG];
        for (int g = 0; g < mg; g++)
            wv[g] = f_widen(type, pp[g / 2] + (size_t)k * step + (size_t)(g % 2) * (step / 2));
        for (int t = 0; t < nt; t++) {
            __m512 xv = _mm512_set1_ps(xt[(size_t)t * ld]);
            for (int g = 0; g < mg; g++)
                acc[g][t] = _mm512_fmadd_ps(wv[g], xv, acc[g][t]);
        }
    }
    for (int g = 0; g < mg; g++)
        store_group(jb, g0 + g, j * F_NT, nt, acc[g]);
}

/* The float tile for nt tokens (1..F_NT), type, wide and mg constant. */
#define F_CALL(n) f_tile(jb, type, wide, g0, mg, j, n)
#define F_TILES(name, type_, wide_, mg_)                                                           \
    static void name(const struct mm_pack_job *jb, int g0, int j, int nt)                          \
    {                                                                                              \
        const enum ggml_type type = type_;                                                         \
        const bool wide = wide_;                                                                   \
        const int mg = mg_;                                                                        \
        switch (nt) {                                                                              \
            T_CASE(F_CALL, 1)                                                                      \
            T_CASE(F_CALL, 2)                                                                      \
            T_CASE(F_CALL, 3)                                                                      \
            T_CASE(F_CALL, 4)                                                                      \
            T_CASE(F_CALL, 5)                                                                      \
            T_CASE(F_CALL, 6)                                                                      \
            T_CASE(F_CALL, 7)                                                                      \
            T_CASE(F_CALL, 8)                                                                      \
            T_CASE(F_CALL, 9)                                                                      \
            T_CASE(F_CALL, 10)                                                                     \
            T_CASE(F_CALL, 11)                                                                     \
        default:                                                                                   \
            F_CALL(F_NT);                                                                          \
            break;                                                                                 \
        }                                                                                          \
    }
F_TILES(f32_tile_1, GGML_TYPE_F32, false, 1)
F_TILES(f32_tile_2, GGML_TYPE_F32, false, 2)
F_TILES(f16_tile_1, GGML_TYPE_F16, false, 1)
F_TILES(f16_tile_2, GGML_TYPE_F16, false, 2)
F_TILES(bf16_tile_1, GGML_TYPE_BF16, false, 1)
F_TILES(bf16_tile_2, GGML_TYPE_BF16, false, 2)
F_TILES(f16w_tile_1, GGML_TYPE_F32, true, 1) /* f16 weights widened by the thread first */
F_TILES(f16w_tile_2, GGML_TYPE_F32, true, 2)
#define F32_CALL(n) f_tile(jb, GGML_TYPE_F32, false, g0, mg, j, n)
#define F16_CALL(n) f_tile(jb, GGML_TYPE_F16, false, g0, mg, j, n)
#define BF16_CALL(n) f_tile(jb, GGML_TYPE_BF16, false, g0, mg, j, n)
NARROW_TILES(f32_tile_3, F32_CALL, 3)
NARROW_TILES(f32_tile_4, F32_CALL, 4)
NARROW_TILES(f16_tile_3, F16_CALL, 3)
NARROW_TILES(f16_tile_4, F16_CALL, 4)
NARROW_TILES(bf16_tile_3, BF16_CALL, 3)
NARROW_TILES(bf16_tile_4, BF16_CALL, 4)
NARROW_TILES(f32_tile_5, F32_CALL, 5)
NARROW_TILES(f32_tile_6, F32_CALL, 6)
NARROW_TILES(f32_tile_7, F32_CALL, 7)
NARROW_TILES(f32_tile_8, F32_CALL, 8)
NARROW_TILES(f16_tile_5, F16_CALL, 5)
NARROW_TILES(f16_tile_6, F16_CALL, 6)
NARROW_TILES(f16_tile_7, F16_CALL, 7)
NARROW_TILES(f16_tile_8, F16_CALL, 8)
NARROW_TILES(bf16_tile_5, BF16_CALL, 5)
NARROW_TILES(bf16_tile_6, BF16_CALL, 6)
NARROW_TILES(bf16_tile_7, BF16_CALL, 7)
NARROW_TILES(bf16_tile_8, BF16_CALL, 8)

typedef void tile_fn(const struct mm_pack_job *jb, int g0, int j, int nt);

/* Each kind of copy's tiles by their number of row groups (1..N_MG). */
#define TILES(p)                                                                                   \
    {NULL, p##_tile_1, p##_tile_2, p##_tile_3, p##_tile_4,                                        \
     p##_tile_5, p##_tile_6, p##_tile_7, p##_tile_8}
static tile_fn *const q8_tiles[N_MG + 1] = TILES(q8), *const q4_tiles[N_MG + 1] = TILES(q4),
                      *const nl_tiles[N_MG + 1] = TILES(nl), *const xs_tiles[N_MG + 1] = TILES(xs),
                      *const q41_tiles[N_MG + 1] = TILES(q41),
                      *const q50_tiles[N_MG + 1] = TILES(q50),
                      *const q51_tiles[N_MG + 1] = TILES(q51),
                      *const q4k_tiles[N_MG + 1] = TILES(q4k),
                      *const f32_tiles[N_MG + 1] = TILES(f32),
                      *const f16_tiles[N_MG + 1] = TILES(f16),
                      *const bf16_tiles[N_MG + 1] = TILES(bf16);
static tile_fn *const f16w_tiles[P_MG + 1] = {NULL, f16w_tile_1, f16w_tile_2};

/* g0's pair of f16 groups (g0 even) widened into the thread's f32 copy at
 * jb->wide, laid out as an f32 pair: exact, so its tiles give the bits the
 * f16 tiles give. */
static void f16_widen_pair(const struct mm_pack_job *jb, int g0)
{
    const struct mm_weight *w = jb->w;
    const uint8_t *src = (const uint8_t *)w->packed + (size_t)(g0 / 2) * mm_pack_pair_bytes(w);
    for (size_t k = 0; k < 2 * (size_t)w->n_in; k++) /* 16 rows' element per step */
        _mm512_store_ps(jb->wide + 16 * k,
                        _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(src + 32 * k))));
}

/* Row groups outside, token tiles inside: the groups' weights stay in
 * cache while the tiles [j0, j1) pass. A batch of MM_PACK_NARROW tokens at
 * most (decoding) is one narrow tile, taken N_MG groups at a time (Q_MG
 * for one token of the integer copies, Q_MG2 for two): see "Narrow tiles"
 * above. */
static void groups_avx512(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1)
{
    tile_fn *const *by;
    switch (jb->w->type) {
    case GGML_TYPE_Q8_0:
        by = q8_tiles;
        break;
    case GGML_TYPE_Q4_0:
        by = q4_tiles;
        break;
    case GGML_TYPE_Q4_1:
        by = q41_tiles;
        break;
    case GGML_TYPE_Q5_0:
        by = q50_tiles;
        break;
    case GGML_TYPE_Q5_1:
        by = q51_tiles;
        break;
    case GGML_TYPE_IQ4_NL:
        by = nl_tiles;
        break;
    case GGML_TYPE_IQ4_XS:
        by = xs_tiles;
        break;
    case GGML_TYPE_Q4_K:
        by = q4k_tiles;
        break;
    case GGML_TYPE_F32:
        by = f32_tiles;
        break;
    case GGML_TYPE_F16:
        by = f16_tiles;
        break;
    default:
        by = bf16_tiles;
        break;
    }
    const bool fl = mm_is_float_type(jb->w->type);
    const int tnt = fl ? F_NT : P_NT, nmg = fl ? N_MG : jb->n_tok == 1 ? Q_MG : Q_MG2;
    const int step = jb->n_tok <= MM_PACK_NARROW ? nmg : P_MG;
    /* f16 over several tiles: each pair widened once, not once per tile */
    const bool widen = jb->wide && step == P_MG && j1 - j0 >= MM_PACK_WIDE_TILES;
    for (int g = g0; g < g1; g += step) {
        int mg = g1 - g < step ? g1 - g : step;
        if (widen)
            f16_widen_pair(jb, g);
        for (int j = j0; j < j1; j++) {
            int nt = jb->n_tok - j * tnt < tnt ? jb->n_tok - j * tnt : tnt;
            (widen ? f16w_tiles : by)[mg](jb, g, j, nt);
        }
    }
}

/* Token t's activations into its tile's q8_0 slots: per block of 32 the
 * values of matmul.c's quantize_x at this level (the same f32 operations:
 * max|x| exact in any order, d = amax / 127, q = round-to-even(x * (127 /
 * amax)) saturated to int8), with the block's correction -128 * sum(q)
 * summed from the saturated bytes themselves. Written straight into the
 * slots, one block at a time: no row copy, no scalar pass. */
static void quantize_avx512(const struct mm_pack_job *jb, const float *xt, int t)
{
    const int nb = jb->w->n_in / QT_QK;
    const size_t slot0 = (size_t)(t / P_NT) * (size_t)nb * P_NT + (size_t)(t % P_NT);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    const __m512i lo = _mm512_set1_epi32(-128), hi = _mm512_set1_epi32(127);
    for (int b = 0; b < nb; b++, xt += QT_QK) {
        const size_t slot = slot0 + (size_t)b * P_NT;
        __m512 v0 = _mm512_loadu_ps(xt), v1 = _mm512_loadu_ps(xt + 16);
        float amax = _mm512_reduce_max_ps(
            _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1)));
        const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, id));
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, id));
        i0 = _mm512_min_epi32(_mm512_max_epi32(i0, lo), hi); /* NaN's INT_MIN: -128, as packs */
        i1 = _mm512_min_epi32(_mm512_max_epi32(i1, lo), hi);
        int8_t *q = jb->q + slot * QT_QK;
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(i1));
        jb->d[slot] = amax / 127.0f;
        jb->c[slot] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    }
}

static bool has_avx512(enum ggml_type type)
{
    return type == GGML_TYPE_Q8_0 || mm_pack_nibbles(type) ||
           type == GGML_TYPE_Q4_K || type == GGML_TYPE_F32 || type == GGML_TYPE_F16 || type == GGML_TYPE_BF16;
}

const struct mm_pack_kernels KERN(mm_pack_kernels) = {
    .name = "avx512-vnni 16-row",
    .has = has_avx512,
    .quantize = quantize_avx512,
    .groups = groups_avx512,
};

#elif !defined(KERN_AVX2) /* scalar: no kernels over repacked weights (AVX2: matmul_pack_avx2.c) */

static bool has_none(enum ggml_type type)
{
    (void)type;
    return false;
}

const struct mm_pack_kernels KERN(mm_pack_kernels) = {
    .name = NULL,
    .has = has_none,
    .quantize = NULL,
    .groups = NULL,
};

#endif
