/*
 * matmul_pack_run.c - weights repacked at load for the register-blocked
 * kernels: the layout written (matmul_internal.h describes matmul_pack.c's,
 * matmul_bf16.h the bf16 pairs'), the scratch of the activations, and the
 * one driver mm_matmul hands a repacked weight to. A copy is one of three
 * variants, each with its own preparation of a token's activations and
 * its own kernel over row groups x token tiles, under the same split:
 *
 *   q8_0          quantised by the level's kernel (matmul_pack.c; at the
 *                 AVX2 level matmul_pack_avx2.c), for
 *                 q8_0's int8 blocks, the 4- and 5-bit blocks' nibbles
 *                 (q4_0 .. q5_1, iq4_nl, iq4_xs) and q4_K;
 *   f32, f16      read in place, exact f32 FMA (matmul_pack.c; at the
 *                 AVX2 level matmul_pack_avx2.c); f16 over 8+ token tiles
 *                 widened a pair of groups at a time into the thread's
 *                 own f32 copy (its slot of the scratch);
 *   bf16 pairs    rounded to bf16 pairs by tiles, vdpbf16ps (matmul_bf16.c).
 *
 * A weight is repacked only when the kernel level in use when it is packed
 * has kernels for its type (mm_pack_bytes says 0 otherwise), and a product
 * takes the repacked copy only when the level in use at the call has them
 * too: a level forced lower between calls (tests, comparisons) runs
 * matmul.c over the original rows, which stay valid.
 */
#include "model/matmul_bf16.h"
#include "model/matmul_internal.h"

#include <assert.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/pool.h"

static const struct mm_pack_kernels *const pkernels[CPU_N_LEVELS] = KERN_TABLE(mm_pack_kernels);

static const struct mm_pack_kernels *pkern(void)
{
    return pkernels[cpu_level()];
}

const char *mm_pack_kernel_name(void)
{
    return pkern()->name;
}

bool mm_pack_has(enum ggml_type type)
{
    return pkern()->has(type);
}

/*
 * A two-valued switch from the environment: variable var unset or empty
 * leaves *flag; value `on` sets it, `off` clears it; anything else is
 * refused with err naming var and its two values (off first, as the
 * defaults are documented).
 */
static int env_switch(const char *var, const char *off, const char *on, _Atomic int *flag,
                      char *err, size_t errlen)
{
    const char *v = getenv(var);
    if (!v || !*v)
        return 0;
    if (strcmp(v, off) && strcmp(v, on)) {
        snprintf(err, errlen, "%s: unknown value '%s' (%s, %s)", var, v, off, on);
        return -1;
    }
    atomic_store_explicit(flag, !strcmp(v, on), memory_order_relaxed);
    return 0;
}

/* ------------------------------------------------------------------------
 * Which weights go to bf16 pairs
 *
 * F16 weights: rounding them to bf16 keeps 8 of their 11 significant bits
 * (a relative error up to 2^-9 per weight, on top of the activations'
 * 2^-9), for twice the multiply rate. A file stored as F16 was meant to be
 * multiplied at f16 precision, so by default it is not: F16 weights are
 * widened exactly and run matmul_pack.c's f32 FMA tile. KVD_F16=bf16 (or
 * mm_f16_set_bf16) opts in, for whoever prefers the speed; the kernels
 * line says which was chosen. The choice is taken when a weight is packed
 * (at load): a model loaded before a change keeps its copies.
 *
 * BF16 weights: the pairs round the activations to bf16 too, for
 * vdpbf16ps's rate, which doubles the FMA's on AMD's cores but halves it
 * on Intel's (cpu_bf16_dot_fast). So by default BF16 weights take the
 * pairs where that rate pays and are widened exactly to the f32 FMA tile
 * elsewhere: on an AMX Xeon the 576x30 bf16 model prefilled 741 tokens at
 * 1,088-1,095 tokens/s widened against 772-786 in pairs, and decoded at
 * 102-103 against 105-108 (alternated, load ~0.6). KVD_BF16=pairs|exact
 * (or mm_bf16_set_pairs) overrides, chosen at load like KVD_F16.
 *
 * With AMX's bf16 tiles (matmul_amx.c) the pairs pay on Intel's cores too,
 * and BF16 weights take them by default where the tiles run. Their
 * prefill is the tiles' and their decoding the tiles' arithmetic in
 * vector registers (the same bits, as fast as the widened copy). On the
 * same Xeon, 576x30 bf16 model, 2 threads, alternated (load 0.9-1.7):
 * prefill of 741 tokens 2,820-2,900 tokens/s against 1,120-1,200
 * widened, of 3,779 tokens 1,520-1,610 against 840-865; decode 104-106
 * against 104-106 at 741+ keys, 70.5-71.8 against 71.4-72.4 at 3,779. When
 * decoding ran on the tiles themselves it was 7-12% slower (95-96 and 66
 * there), and the default had stayed widened. KVD_BF16=exact keeps the
 * widened copy (the activations then stay f32).
 * ------------------------------------------------------------------------ */

static const struct mm_bf16_kernels *const bkernels[CPU_N_LEVELS] = KERN_TABLE(mm_bf16_kernels);

static _Atomic int f16_bf16 = 0;

void mm_f16_set_bf16(bool on)
{
    atomic_store_explicit(&f16_bf16, on, memory_order_relaxed);
}

bool mm_f16_bf16(void)
{
    return atomic_load_explicit(&f16_bf16, memory_order_relaxed);
}

int mm_f16_init_env(char *err, size_t errlen)
{
    return env_switch("KVD_F16", "exact", "bf16", &f16_bf16, err, errlen);
}

/* BF16 weights in pairs: -1 as the CPU's rate says, 0 no, 1 yes. */
static _Atomic int bf16_pairs = -1;

void mm_bf16_set_pairs(int mode)
{
    atomic_store_explicit(&bf16_pairs, mode < 0 ? -1 : mode > 0, memory_order_relaxed);
}

int mm_bf16_init_env(char *err, size_t errlen)
{
    const char *v = getenv("KVD_BF16");
    _Atomic int pairs = 0;
    if (!v || !*v)
        return 0;
    if (env_switch("KVD_BF16", "exact", "pairs", &pairs, err, errlen))
        return -1;
    mm_bf16_set_pairs(atomic_load_explicit(&pairs, memory_order_relaxed));
    return 0;
}

/* ------------------------------------------------------------------------
 * The 4- and 5-bit blocks as their stored bits
 *
 * q4_0, q4_1, q5_0, q5_1, iq4_nl and iq4_xs hold 32 weights as 16 bytes of
 * nibbles (q5_0 and q5_1 a u32 of fifth bits beside them) under one scale
 * d, and for q4_1 and q5_1 a min m: q4_0 d (u - 8), q5_0 d (u - 16), q4_1
 * and q5_1 d u + m, iq4_nl d times an int8 level the nibble picks from a
 * table, iq4_xs the same levels under d (ls - 32) with a 6-bit ls per 32
 * and an f16 d per 256. Their copy keeps the nibble bytes, moved in runs
 * of 4 into 16-row chunks, the fifth bits regrouped so that a shift and a
 * mask bring each to bit 4 of its byte, and the scale and min (iq4_xs's
 * scale as f32: d (ls - 32) can need 17 significant bits); matmul_pack.c's
 * int8 tile takes the codes as vpdpbusd's unsigned bytes: as many bytes as
 * stored (iq4_xs 20 per 32 weights, against 17).
 *
 * Until then q4_0, q5_0, iq4_nl and iq4_xs were widened to q8_0's int8
 * blocks (34 bytes per 32 weights, 36 for iq4_xs; KVD_WIDEN=stored kept
 * the stored rows instead), which decoding read and memory held twice
 * over, and q4_1 and q5_1 ran matmul_blocks.c's AVX2 kernel at 10-12 GB/s.
 * Measured, before -> after, the binaries alternated, load 0.2-1.5:
 * bench_matmul 4096 x 4096, 2 threads, GB/s of the stored bytes from DRAM:
 * q4_0 45-48 -> 81-89, iq4_nl 44-50 -> 64-67, iq4_xs 40 -> 54-58, q5_0
 * 50 -> 61, q4_1 10.6 -> 72, q5_1 12.4 -> 48; at 64 tokens the 4-bit
 * widened copies and their nibbles alike 1,190-1,290 GFLOP/s, q5_0 1,286
 * -> 1,169 (its fifth bits cost ~9% there), q4_1 91 -> 1,139, q5_1 82 ->
 * 1,100. `kvd generate` (790-token prompt, 64 tokens, 2 threads, 3
 * rounds): a 2048 x 16 q4_0 model (852 M weights) decodes at 79-102
 * tokens/s against 46-50 and prefills at 628-670 against 591-660, its
 * weights in 422 MiB against 797 (load 341 ms against 1,575); iq4_xs 80-89
 * against 65-76, 481 MiB against 825; the 768 x 12 q4_0 model 470-506
 * against 364-373, iq4_xs 428-457 against 392-420; the 576 x 30 q4_0 model
 * (its decoding step dominated by the tied 49152-row output and the
 * attention) 262-304 against 261-288. The 2048 x 16 model's weights in
 * the other formats (the same 2048 x 16 q4_0 model requantised): q4_1
 * decodes at 73-109 against 19.5-20 and prefills at 639-667 against 63-64,
 * q5_1 72-76 against 19 and 584-613 against 56-57; q5_0 decodes as fast
 * (69-76 against 70-77) and prefills at 597-650 against 631-678 (its fifth
 * bits), in 516 MiB against 797 (load 598 ms against 2,437).
 * ------------------------------------------------------------------------ */

/* The bf16 kernels, when the level in use has them and the CPU runs them. */
static const struct mm_bf16_kernels *bkern(void)
{
    const struct mm_bf16_kernels *k = bkernels[cpu_level()];
    return k && k->name && cpu_bf16() ? k : NULL;
}

static const struct mm_amx_kernels *const akernels[CPU_N_LEVELS] = KERN_TABLE(mm_amx_kernels);

/* The AMX kernels, when the level in use has them and the CPU runs them. */
static const struct mm_amx_kernels *akern(void)
{
    const struct mm_amx_kernels *k = akernels[cpu_level()];
    return k && k->name && cpu_amx() ? k : NULL;
}

/* Whether w's pairs take the AMX tiles now (matmul_bf16.h): a per-weight
 * choice, the same for every batch. */
static const struct mm_amx_kernels *amx_for(const struct mm_weight *w)
{
    return w->packed_bf16 && w->n_in % MM_AMX_K == 0 ? akern() : NULL;
}

bool mm_bf16_in_pairs(void)
{
    const int m = atomic_load_explicit(&bf16_pairs, memory_order_relaxed);
    return bkern() && (m < 0 ? cpu_bf16_dot_fast() || akern() : m > 0);
}

/* Whether w, not yet packed, is to be packed in bf16 pairs now. */
static bool bf16_wants(const struct mm_weight *w)
{
    return bkern() && ((w->type == GGML_TYPE_BF16 && mm_bf16_in_pairs()) ||
                       (w->type == GGML_TYPE_F16 && mm_f16_bf16()));
}

const char *mm_bf16_describe(char *buf, size_t len)
{
    const struct mm_bf16_kernels *k = bkern();
    const int m = atomic_load_explicit(&bf16_pairs, memory_order_relaxed);
    const char *f16 = mm_f16_bf16() ? "rounded to bf16 (KVD_F16=bf16)" : "exact";
    if (k && mm_bf16_in_pairs() && akern())
        snprintf(buf, len,
                 "bf16 by %s (decoding by their arithmetic in avx512 registers; %s where a row's "
                 "inputs are not a multiple of %d), f16 %s",
                 akern()->name, k->name, MM_AMX_K, f16);
    else if (k && mm_bf16_in_pairs())
        snprintf(buf, len, "bf16 by %s, f16 %s", k->name, f16);
    else if (k)
        snprintf(buf, len, "bf16 exact by f32 FMA (%s), f16 %s",
                 m == 0 ? "KVD_BF16=exact" : "vdpbf16ps at half the FMA's rate on Intel cores",
                 mm_f16_bf16() ? "rounded to bf16 (KVD_F16=bf16) in bf16 pairs" : "exact");
    else if (cpu_level() == CPU_AVX512)
        snprintf(buf, len, "bf16 and f16 exact by f32 FMA (%s)",
                 cpu_bf16_supported() ? "avx512bf16 forced off" : "no avx512bf16 on this CPU");
    else
        snprintf(buf, len, "bf16 and f16 exact");
    return buf;
}

/* A copy's layout is fixed when it is written: bf16 pairs run only while
 * the bf16 kernels do, the other copies while the level has kernels for
 * the type. */
bool mm_pack_ready(const struct mm_weight *w)
{
    if (w->packed && w->packed_bf16)
        return bkern() != NULL;
    return w->packed && pkern()->has(w->type);
}

static size_t n_groups(const struct mm_weight *w)
{
    return ((size_t)w->n_out + MM_PACK_ROWS - 1) / MM_PACK_ROWS;
}

static size_t n_pairs(const struct mm_weight *w)
{
    return (n_groups(w) + 1) / 2;
}

size_t mm_pack_bytes(const struct mm_weight *w)
{
    if (bf16_wants(w))
        return n_pairs(w) * mm_bf16_pair_bytes(w);
    if (!pkern()->has(w->type))
        return 0;
    return n_pairs(w) * mm_pack_pair_bytes(w);
}

/* Row o of w, or NULL for the padding past n_out (zero rows). */
static const uint8_t *row_or_pad(const struct mm_weight *w, size_t o)
{
    return o < (size_t)w->n_out ? (const uint8_t *)w->data + o * w->row_bytes : NULL;
}

/* Pair p of q8_0 groups (matmul_internal.h): row r of the pair is row
 * 32 p + r, in group r / 16 at lane r % 16; its weights as w + 128. */
static void pack_q8_pair(const struct mm_weight *w, size_t p, uint8_t *dst)
{
    const int nb = w->n_in / QT_QK;
    for (int r = 0; r < 2 * MM_PACK_ROWS; r++) {
        const uint8_t *row = row_or_pad(w, p * 2 * MM_PACK_ROWS + (size_t)r);
        const int g = r / MM_PACK_ROWS, lane = r % MM_PACK_ROWS;
        for (int b = 0; b < nb; b++) {
            static const uint8_t zero[34];
            const uint8_t *blk = row ? row + 34 * (size_t)b : zero;
            uint8_t *q = dst + (size_t)b * MM_PACK_Q8_PAIR + 64 * g + 4 * lane;
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < 4; j++)
                    q[128 * k + j] = blk[2 + 4 * k + j] ^ 0x80;
            memcpy(dst + (size_t)b * MM_PACK_Q8_PAIR + MM_PACK_Q8_SCALES + 32 * g + 2 * lane, blk,
                   2);
        }
    }
}

/* Block b of a nibble format's row as the copy takes it: its 16 bytes of
 * nibbles, its fifth bits (q5_0, q5_1; else 0), its scale's bytes (the
 * f16 as stored, or iq4_xs's d * (ls - 32) as an f32) and its f16 min's
 * (q4_1, q5_1). A padding row (NULL) gives zeros. */
struct nib_block {
    const uint8_t *qs;
    uint32_t qh;
    uint8_t d[4], m[2];
};

static struct nib_block nib_block(enum ggml_type t, const uint8_t *row, int b)
{
    static const uint8_t zero[16];
    struct nib_block k = {.qs = zero};
    if (!row)
        return k;
    if (t == GGML_TYPE_IQ4_XS) {
        const uint8_t *sb = qt_iq4xs_sb(row, b);
        float d = qt_f16_to_f32(qt_rd16(sb + QT_IQ4XS_D)) * (float)qt_iq4xs_scale(sb, b % 8);
        memcpy(k.d, &d, 4);
        k.qs = qt_iq4xs_qs(row, b);
        return k;
    }
    /* an f16 d at 0, then per type: q4_0, iq4_nl the nibbles; q4_1 the min,
     * the nibbles; q5_0 the fifth bits, the nibbles; q5_1 all three */
    const bool mins = t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_1;
    const bool five = t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
    const uint8_t *blk = row + (size_t)(18 + 2 * mins + 4 * five) * (size_t)b;
    memcpy(k.d, blk, 2);
    if (mins)
        memcpy(k.m, blk + 2, 2);
    if (five)
        memcpy(&k.qh, blk + 2 + 2 * mins, 4);
    k.qs = blk + 2 + 2 * mins + 4 * five;
    return k;
}

/* Row lane's 4 bytes of a group's fifth bits (matmul_internal.h): byte j
 * holds element 4k + j's bit at bit 4 + k and 16 + 4k + j's at bit k. */
static void fifth_bits(uint32_t qh, uint8_t *dst)
{
    for (int j = 0; j < 4; j++) {
        unsigned v = 0;
        for (int k = 0; k < 4; k++)
            v |= ((qh >> (4 * k + j)) & 1u) << (4 + k) | ((qh >> (16 + 4 * k + j)) & 1u) << k;
        dst[j] = (uint8_t)v;
    }
}

/* Pair p of nibble groups (matmul_internal.h): each block's 16 bytes of
 * nibbles in runs of 4 to its row's lane of the chunks, its fifth bits
 * regrouped, its scale and min to the lane; rows past n_out are zeros. */
static void pack_nib_pair(const struct mm_weight *w, size_t p, uint8_t *dst)
{
    const enum ggml_type t = w->type;
    const bool five = t == GGML_TYPE_Q5_0 || t == GGML_TYPE_Q5_1;
    const bool mins = t == GGML_TYPE_Q4_1 || t == GGML_TYPE_Q5_1;
    const size_t ds = t == GGML_TYPE_IQ4_XS ? 4 : 2; /* the scale's bytes */
    const size_t stride = mm_pack_nib_block(t), so = mm_pack_nib_scales(t);
    for (int r = 0; r < 2 * MM_PACK_ROWS; r++) {
        const uint8_t *row = row_or_pad(w, p * 2 * MM_PACK_ROWS + (size_t)r);
        const int g = r / MM_PACK_ROWS, lane = r % MM_PACK_ROWS;
        for (int b = 0; b < w->n_in / QT_QK; b++) {
            const struct nib_block k = nib_block(t, row, b);
            uint8_t *o = dst + (size_t)b * stride;
            for (int c = 0; c < 4; c++)
                memcpy(o + 128 * c + 64 * g + 4 * lane, k.qs + 4 * c, 4);
            if (five)
                fifth_bits(k.qh, o + MM_PACK_NIB_CHUNKS + 64 * g + 4 * lane);
            memcpy(o + so + 16 * ds * (size_t)g + ds * (size_t)lane, k.d, ds);
            if (mins)
                memcpy(o + so + 64 + 32 * g + 2 * lane, k.m, 2);
        }
    }
}

/* Pair p of q4_K groups (matmul_internal.h): each stored super-block's d,
 * dmin, scales and mins go to its row's lane, its 128 bytes of nibbles in
 * runs of 4 to its lane of the chunks; rows past n_out are zeros. */
static void pack_q4k_pair(const struct mm_weight *w, size_t p, uint8_t *dst)
{
    const int nsb = w->n_in / QT_QK_K;
    for (int r = 0; r < 2 * MM_PACK_ROWS; r++) {
        const uint8_t *row = row_or_pad(w, p * 2 * MM_PACK_ROWS + (size_t)r);
        const int g = r / MM_PACK_ROWS, lane = r % MM_PACK_ROWS;
        for (int b = 0; b < nsb; b++) {
            static const uint8_t zero[144];
            const uint8_t *u = row ? row + 144 * (size_t)b : zero;
            uint8_t *o = dst + (size_t)b * MM_PACK_Q4K_PAIR;
            uint8_t *sg = o + MM_PACK_Q4K_GSCALES * g;
            memcpy(sg + 2 * lane, u + QT_Q4K_D, 2);
            memcpy(sg + 32 + 2 * lane, u + QT_Q4K_DMIN, 2);
            for (int sb = 0; sb < 8; sb++) {
                int sc, mn;
                qt_q4k_scale_min(u + QT_Q4K_SCALES, sb, &sc, &mn);
                sg[64 + 16 * sb + lane] = (uint8_t)sc;
                sg[192 + 16 * sb + lane] = (uint8_t)mn;
            }
            for (int h = 0; h < 4; h++)
                for (int k = 0; k < 8; k++)
                    memcpy(o + MM_PACK_Q4K_QS + 128 * (8 * h + k) + 64 * g + 4 * lane,
                           u + QT_Q4K_QS + 32 * h + 4 * k, 4);
        }
    }
}

/* Pair p of float groups: element k of its 32 rows side by side (rows past
 * n_out are zeros). Elements are copied as 2- or 4-byte words. */
static void pack_float_pair(const struct mm_weight *w, size_t p, uint8_t *dst)
{
    const size_t esz = w->type == GGML_TYPE_F32 ? 4 : 2;
    const uint8_t *rows[2 * MM_PACK_ROWS];
    for (int r = 0; r < 2 * MM_PACK_ROWS; r++)
        rows[r] = row_or_pad(w, p * 2 * MM_PACK_ROWS + (size_t)r);
    for (int k = 0; k < w->n_in; k++, dst += 2 * MM_PACK_ROWS * esz)
        for (int r = 0; r < 2 * MM_PACK_ROWS; r++) {
            if (!rows[r])
                memset(dst + (size_t)r * esz, 0, esz);
            else if (esz == 2)
                memcpy(dst + 2 * (size_t)r, rows[r] + 2 * (size_t)k, 2);
            else
                memcpy(dst + 4 * (size_t)r, rows[r] + 4 * (size_t)k, 4);
        }
}

void mm_pack_weight(struct mm_weight *w, void *dst)
{
    assert(dst && ((uintptr_t)dst & 63) == 0 && mm_pack_bytes(w) > 0);
    if (bf16_wants(w)) {
        const size_t pb = mm_bf16_pair_bytes(w);
        for (size_t p = 0; p < n_pairs(w); p++)
            bkern()->pack_pair(w, p, (uint32_t *)((uint8_t *)dst + p * pb));
        w->packed = dst;
        w->packed_bf16 = true;
        return;
    }
    w->packed_bf16 = false;
    const size_t pb = mm_pack_pair_bytes(w);
    for (size_t p = 0; p < n_pairs(w); p++)
        if (w->type == GGML_TYPE_Q8_0)
            pack_q8_pair(w, p, (uint8_t *)dst + p * pb);
        else if (mm_pack_nibbles(w->type))
            pack_nib_pair(w, p, (uint8_t *)dst + p * pb);
        else if (w->type == GGML_TYPE_Q4_K)
            pack_q4k_pair(w, p, (uint8_t *)dst + p * pb);
        else
            pack_float_pair(w, p, (uint8_t *)dst + p * pb);
    w->packed = dst;
}

/* ------------------------------------------------------------------------
 * Activations (layout: struct mm_pack_job, matmul_internal.h): q8_0's
 * quantised by the level's kernel straight into their tile's slots, float
 * weights' transposed by tiles.
 * ------------------------------------------------------------------------ */

static size_t round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

/* One thread's f32 copy of a pair of f16 groups (struct mm_pack_job's
 * wide), where a call of n_tok tokens makes them: 0 for other weights. */
static size_t wide_bytes(const struct mm_weight *w, int n_tok)
{
    if (w->type != GGML_TYPE_F16 || w->packed_bf16 || n_tok <= MM_PACK_NARROW)
        return 0;
    return (size_t)w->n_in * 2 * MM_PACK_ROWS * sizeof(float);
}

/* The arrays in scratch, each 64-byte aligned, into jb (if non-NULL), for
 * a call on nth threads; returns the bytes used. */
static size_t scratch_layout(const struct mm_weight *w, int n_tok, int nth, void *scratch,
                             struct mm_pack_job *jb)
{
    uint8_t *base = scratch, *p = base;
    if (w->packed_bf16) { /* bf16 pairs: the rounded tokens, by tiles or (AMX) by rows */
        if (jb)
            jb->xb = (uint32_t *)p;
        const size_t rows = round_up((size_t)n_tok, MM_BF16_NT),
                     amx = round_up((size_t)n_tok, MM_AMX_NT);
        /* the larger: whether the tiles run may change between sizing and
         * call (a level forced in between) */
        return round_up((rows > amx ? rows : amx) * (size_t)mm_bf16_pairs(w) * 4, 64);
    }
    if (!mm_pack_q8_acts(w)) { /* float weights: the caller's rows, read in place */
        if (jb && wide_bytes(w, n_tok))
            jb->wide = (float *)p; /* thread t's copy at t * wide_bytes */
        return (size_t)nth * wide_bytes(w, n_tok);
    }
    const size_t nb = (size_t)w->n_in / QT_QK;
    const size_t slots = round_up((size_t)n_tok, MM_PACK_NT) * nb; /* (token, block) pairs */
    if (jb)
        jb->q = (int8_t *)p;
    p += round_up(slots * QT_QK, 64);
    if (jb)
        jb->d = (float *)p;
    p += round_up(slots * sizeof(float), 64);
    if (jb)
        jb->c = (int32_t *)p;
    p += round_up(slots * sizeof(int32_t), 64);
    return (size_t)(p - base);
}

size_t mm_pack_scratch_bytes(const struct mm_weight *w, int n_tok, int n_threads)
{
    return scratch_layout(w, n_tok, cpu_pool_threads(n_threads), NULL, NULL);
}

/* ------------------------------------------------------------------------
 * The split among threads
 *
 * Two ways, each giving every (row, token) sum the same operations (the
 * kernels' tiles are invariant, matmul_pack.c), so the bits depend neither
 * on the split nor on the thread count:
 *
 *  - by token tiles, when the batch has at least MM_PACK_SPLIT_TILES tiles
 *    per thread (prefill): each thread prepares the activations of its own
 *    tiles (quantises, transposes or rounds them) and multiplies them by every row
 *    group. The preparation runs in parallel and needs no barrier, since a
 *    thread reads only slots it wrote; each thread reads the whole weight
 *    matrix, which a chunk of hundreds of tokens amortises (and the second
 *    reader mostly finds it in the shared L3).
 *  - by pairs of row groups otherwise (decoding, short chunks): the calling
 *    thread prepares every token first, then each thread streams its share
 *    of the weights once. A few tiles split by tokens would leave a thread
 *    idle for most of a tile; rows split evenly at any batch size.
 *
 * Preparing by the calling thread before a 512-token chunk cost ~9% of
 * the products' time, serial: on two threads a seventh of the wall time.
 * ------------------------------------------------------------------------ */

#define MM_PACK_SPLIT_TILES 8

/* A copy's kernel variant: how a token's activations are prepared into
 * the scratch (its slots of its tile; NULL: the kernel reads the caller's
 * rows in place), the kernel over row groups [g0, g1) x token tiles
 * [j0, j1), and the tile width in tokens. */
struct pack_variant {
    void (*token)(const struct mm_pack_job *jb, const float *xt, int t);
    void (*groups)(const struct mm_pack_job *jb, int g0, int g1, int j0, int j1);
    int tw;
};

static struct pack_variant variant_of(const struct mm_weight *w)
{
    const struct mm_amx_kernels *ak = amx_for(w);
    if (ak)
        return (struct pack_variant){ak->round, ak->groups, MM_AMX_NT};
    if (w->packed_bf16) {
        const struct mm_bf16_kernels *bk = bkern();
        return (struct pack_variant){bk->round, bk->groups, MM_BF16_NT};
    }
    const struct mm_pack_kernels *pk = pkern();
    if (mm_pack_q8_acts(w))
        return (struct pack_variant){pk->quantize, pk->groups, MM_PACK_NT};
    return (struct pack_variant){NULL, pk->groups, MM_PACK_FNT}; /* read in place */
}

/* One call: n products of one x (mm_matmul_many; n = 1 for mm_matmul),
 * their jobs sharing the activations' slots. By rows, the pairs of groups
 * (the kernels' tile height) of all products are numbered one after
 * another: product i's pair v is unit u_end[i - 1] + v. */
struct pack_run {
    struct pack_variant v;
    const struct mm_pack_job *jb; /* [n] */
    const float *x;               /* [n_tok][n_in] */
    int n;                        /* products */
    int ng[MM_MANY_MAX];          /* row groups of product i */
    int u_end[MM_MANY_MAX];       /* units of products 0..i */
    const struct mm_tail *tail;   /* or NULL; with it, by rows, unit v is pair v of every product */
};

/* Tokens [t0, t1)'s activations into the scratch (laid out by jb[0]). */
static void prepare(const struct pack_run *r, int t0, int t1)
{
    const struct mm_pack_job *jb = r->jb;
    if (!r->v.token)
        return;
    for (int t = t0; t < t1; t++)
        r->v.token(jb, r->x + (size_t)t * (size_t)jb->w->n_in, t);
}

static int n_tiles(const struct pack_run *r)
{
    return (r->jb->n_tok + r->v.tw - 1) / r->v.tw;
}

/* Product i's groups [g0, g1) x tiles [j0, j1) on thread t: its job with
 * the thread's own f32 copy of a pair, if the job has copies. */
static void run_groups(const struct pack_run *r, int i, int t, int g0, int g1, int j0, int j1)
{
    struct mm_pack_job jb = r->jb[i];
    if (jb.wide)
        jb.wide += (size_t)t * wide_bytes(jb.w, jb.n_tok) / sizeof(float);
    r->v.groups(&jb, g0, g1, j0, j1);
}

/* A thread's token tiles [j0, j1): their activations, then every group of
 * every product. */
static void run_tiles(void *arg, size_t j0, size_t j1, int t)
{
    const struct pack_run *r = arg;
    const int tw = r->v.tw, t1 = (int)j1 * tw < r->jb->n_tok ? (int)j1 * tw : r->jb->n_tok;
    prepare(r, (int)j0 * tw, t1);
    for (int i = 0; i < r->n; i++)
        run_groups(r, i, t, 0, r->ng[i], (int)j0, (int)j1);
    if (r->tail)
        r->tail->fn(r->tail->arg, 0, r->jb->w->n_out, (int)j0 * tw, t1);
}

/* Pairs [v, v + s) of product i's groups, every tile, on thread t. */
static void run_pairs(const struct pack_run *r, int i, int t, int v, int s)
{
    const int g1 = 2 * (v + s) < r->ng[i] ? 2 * (v + s) : r->ng[i];
    run_groups(r, i, t, 2 * v, g1, 0, n_tiles(r));
}

/* A thread's share of the units [u0, u1), every tile: the same calls of
 * the kernel, whatever the split. A narrow batch (decoding) hands the
 * kernels up to MM_PACK_NARROW_PAIRS pairs of one product at a time, as
 * many as the share holds (their narrow tiles take several groups); each
 * row's sum is the same sequence of operations in any tile, so the split
 * still changes no bit. */
static void run_units(void *arg, size_t u0, size_t u1, int t)
{
    const struct pack_run *r = arg;
    const int span = r->jb->n_tok <= MM_PACK_NARROW ? MM_PACK_NARROW_PAIRS : 1;
    int i = 0;
    for (int u = (int)u0; u < (int)u1;) {
        if (r->tail) { /* pairs u.. of every product, then the tail over their rows */
            const int s = (int)u1 - u < span ? (int)u1 - u : span;
            for (i = 0; i < r->n; i++)
                run_pairs(r, i, t, u, s);
            int n_out = r->jb->w->n_out, r1 = 2 * MM_PACK_ROWS * (u + s);
            r->tail->fn(r->tail->arg, 2 * MM_PACK_ROWS * u, r1 < n_out ? r1 : n_out, 0,
                        r->jb->n_tok);
            u += s;
            continue;
        }
        while (u >= r->u_end[i])
            i++;
        const int left = ((int)u1 < r->u_end[i] ? (int)u1 : r->u_end[i]) - u;
        const int s = left < span ? left : span;
        run_pairs(r, i, t, u - (i ? r->u_end[i - 1] : 0), s);
        u += s;
    }
}

void mm_pack_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads,
                    void *scratch)
{
    mm_pack_matmul_many(&out, &w, 1, x, n_tok, n_threads, scratch, NULL);
}

void mm_pack_matmul_many(float *const *out, const struct mm_weight *const *ws, int n,
                         const float *x, int n_tok, int n_threads, void *scratch,
                         const struct mm_tail *tail)
{
    const struct mm_weight *w = ws[0]; /* the activations are laid out by it, for all */
    const int nth = cpu_pool_threads(n_threads);
    assert(n >= 1 && n <= MM_MANY_MAX && ((uintptr_t)scratch & 63) == 0);
    assert(scratch || !scratch_layout(w, n_tok, nth, NULL, NULL));
    struct mm_pack_job jb[MM_MANY_MAX] = {{0}};
    struct pack_run r = {.v = variant_of(w), .jb = jb, .x = x, .n = n, .tail = tail};
    scratch_layout(w, n_tok, nth, scratch, &jb[0]);
    jb[0].x = x; /* the float tiles read it in place (scratch_layout gave them no slots) */
    for (int i = 0; i < n; i++) {
        assert(mm_pack_ready(ws[i]) && ws[i]->type == w->type && ws[i]->n_in == w->n_in &&
               ws[i]->packed_bf16 == w->packed_bf16);
        jb[i] = jb[0];
        jb[i].w = ws[i];
        jb[i].out = out[i];
        jb[i].n_tok = n_tok;
        r.ng[i] = (int)n_groups(ws[i]);
        r.u_end[i] = (i ? r.u_end[i - 1] : 0) + (r.ng[i] + 1) / 2;
    }

    const int tiles = n_tiles(&r);
    if (nth > 1 && tiles >= MM_PACK_SPLIT_TILES * nth) {
        cpu_pool_for(nth, (size_t)tiles, run_tiles, &r);
        return;
    }
    prepare(&r, 0, n_tok); /* by the calling thread, before the team starts */
    size_t units = tail ? (size_t)(r.ng[0] + 1) / 2 : (size_t)r.u_end[n - 1];
    /* in pieces of one kernel call, stolen by a thread done with its own
     * share (cpu/pool.h): a preempted thread no longer holds the product */
    const size_t span = n_tok <= MM_PACK_NARROW ? MM_PACK_NARROW_PAIRS : 1;
    cpu_pool_for_steal(nth, units, span, run_units, &r);
}
