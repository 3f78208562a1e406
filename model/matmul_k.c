/*
 * matmul_k.c - out[t][o] = sum_i W[o][i] * x[t][i] for the K formats
 * (q2_K, q3_K, q4_K, q5_K, q6_K), with the scales applied in integers.
 *
 * ---------------------------------------------------------------------------
 * Why these formats need their own kernels
 * ---------------------------------------------------------------------------
 *
 * A K super-block holds 256 weights as small unsigned integers with one
 * small integer scale per 32 (q4_K, q5_K: 6 bits, plus a 6-bit min) or per
 * 16 (q6_K: int8; q3_K: 6 bits signed; q2_K: 4 bits, plus a 4-bit min),
 * and one or two f16 factors for the whole super-block.
 * The general path (matmul.c) meets activations quantised per block of 32,
 * each block with its own f32 scale, so every 32 weights end in a float
 * step: convert the block's integer sums, multiply by (weight scale x
 * activation scale), add. For q8_0 that step is a sixth of the work per
 * weight byte; for a 4-bit format, with half the bytes per weight, it is a
 * third, and decoding at q8_0's bytes per second needs twice q8_0's weights
 * per second.
 *
 * Here the activations are quantised per super-block instead (one f32
 * scale dx per 256, the int8 values q, and the sum of every 16 q's), so that
 * within a super-block everything is an integer:
 *
 *   sum_i w_i x_i = dx * ( d * sum_g s_g * sum_{i in g} u_i q_i
 *                          - c * d * sum_g s_g * sum_{i in g} q_i  (q6_K, q3_K)
 *                          - dmin * sum_j m_j * sum_{i in j} q_i ) (q2_K, q4_K, q5_K)
 *
 * with u the unsigned weight integers, s_g their scales, c the offset
 * (q6_K 32; q3_K 4, its 3-bit quants stored as u = q + 4 by the third bit
 * of hmask), m_j the mins. The products u q go through vpmaddubsw (u8 x s8 ->
 * pairs summed in i16) and meet the scales in vpmaddwd / vpdpwssd (i16 x
 * i16 -> pairs summed in i32), so a super-block costs one conversion and
 * two multiply-adds in f32, not eight or sixteen. The q sums per 16 carry
 * the offset and the mins (vpmaddwd against the scales or mins). This is
 * the shape of ggml's q8_K dot products; the code is kvd's.
 *
 * Before these kernels q2_K and q3_K went through the per-32 path
 * (matmul_blocks.c) at 2-3 GB/s: their two scales per block of 32 cost a
 * float step per 16 weights.
 *
 * Bounds (nothing saturates or overflows): |q| <= 127 and u <= 63, so a
 * vpmaddubsw pair is at most 2 * 63 * 127 = 16002 < 32767; scales are at
 * most 128 in magnitude, so a super-block's i32 sum is below 2^28.
 *
 * Accuracy: coarser than per-32 quantisation of the activations. The only
 * difference from a product over the dequantised weights is still the
 * activations' rounding, now at most sum over super-blocks b of
 * (dx_b / 2) * sum_{i in b} |W[o][i]| (dx_b = max|x| / 127 over 256), plus
 * f32 summation; tests/test_quant.c checks both against a double product.
 *
 * ---------------------------------------------------------------------------
 * Work split and invariance
 * ---------------------------------------------------------------------------
 *
 * As in matmul.c: the pool's threads take groups of MM_GROUP rows
 * (matmul_k_run.c); inside, tiles of
 * MR rows x NT tokens walk whole rows, each super-block's weights decoded
 * in registers once per tile and its activations loaded once per MR rows.
 * A token's sums use only its own activations and run in the same order in
 * every tile, so results depend neither on the threads nor on the batch.
 *
 * Kernels, one per level (this file is compiled once per kernel level, see
 * cpu/kernel.h; matmul_k_run.c takes the copy of the level in use):
 *   avx512  per half super-block (128 weights), one 64-byte load gives two
 *           vectors of 64 weight integers (low and high nibbles); vpdpbusd
 *           sums 4 products per i32 lane straight from u8 x s8, vpackssdw
 *           packs two such vectors to i16 (|sum| <= 4 * 63 * 127 = 32004:
 *           no saturation) and one vpdpwssd applies the scales: three
 *           instructions per 64 weights and token. The nibbles of q4_K and
 *           q5_K hold sub-blocks (0, 2) and (1, 3) of a 64-byte load, so the
 *           activations are stored with sub-blocks 1, 2 and 5, 6 swapped;
 *           q2_K's and q3_K's 32 bytes of a half give elements in order,
 *           shifted by 0 and 2 (lo) and 4 and 6 (hi) bits.
 *   avx2    per sub-block of 32: vpmaddubsw, vpmaddwd with the scales, add.
 *   scalar  the same integer sums in plain C.
 * Measured one thread, in L2 (4096 x 128, load ~13): q8_0 41.5, q4_K 49,
 * q5_K 40, q6_K 43 Gweights/s.
 */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "model/matmul_internal.h"
#include "model/matmul_simd.h"

/* Register tiles: MR rows x NT tokens; a lone token walks one row at a time
 * (MR1): decoding from DRAM, one sequential stream per thread reads about
 * twice as fast here as two or four interleaved ones (the prefetchers).
 * On an AMX Xeon too (2048 x 16 models, tokens/s, alternated), two adjacent
 * rows at once were slower: q6_K 40.3-40.8 -> 38.2-38.8, q5_K 46.5-48.4 ->
 * 40.1-42.3. Two rows half a group of 16 apart (two streams) gave q6_K
 * +3-7% and q5_K +1-5%, too close to the noise to take on a guess about
 * the other machines. */
#define MR 2
#define MR1 1

/* How far ahead of its row a decoding tile (one row, one token) asks for
 * the row's bytes into L1 (prefetcht0), once per super-block for every
 * line of one. On an AMX Xeon (2 threads, 2048 x 16 models of each type,
 * 64 tokens decoded after a short prompt, alternated), tokens/s without ->
 * 1 KiB ahead: q6_K 30.0-30.2 -> 39.9-40.6 (2 KiB 36.1-40.0, 4 and 8 KiB
 * 27.3-28.2: worse than none), q5_K 20.4-23.2 -> 48.6, q3_K 50.8-52.5 ->
 * 61.7-63.7, q2_K 37.8-42.8 -> 75.3-76.7. The stream prefetchers alone
 * left these kernels (more instructions per byte than q8_0's, so fewer
 * bytes within the out-of-order window) short of the bus, as f16's in
 * matmul_pack.c. */
#define K_PREFETCH 1024
#if defined(KERN_AVX512)
#define NT 4 /* 8 i32 + 8 f32 accumulators of 32 zmm */
#else
#define NT 2 /* 4 + 4 of 16 ymm */
#endif

/* log2 of the offset c of the formula above (q6_K 32, q3_K 4); -1: none. */
static inline int k_offset_log2(enum ggml_type type)
{
    return type == GGML_TYPE_Q6_K ? 5 : type == GGML_TYPE_Q3_K ? 2 : -1;
}

#ifdef KERN_SIMD
/* Whether the type has mins (dmin * m_g). */
static inline bool k_mins(enum ggml_type type)
{
    return type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K;
}

/* Whether the SIMD kernels' scales come per 32, paired with q4_K's nibbles
 * (q4_K, q5_K): the AVX-512 kernel then reads the activations' sub-blocks
 * in the order 0 2 1 3 4 6 5 7 (kx_quantize). */
static inline bool k_paired(enum ggml_type type)
{
    return type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K;
}
#endif

/* ------------------------------------------------------------------------
 * Activations per super-block (struct mm_kx, matmul_internal.h)
 * ------------------------------------------------------------------------ */

/* max |x| over 256 floats */
static float amax256(const float *x)
{
#ifdef KERN_SIMD
    const __m256 signbit = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < QT_QK_K; k += 8)
        m = _mm256_max_ps(m, _mm256_andnot_ps(signbit, _mm256_loadu_ps(x + k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
#else
    float m = 0.0f;
    for (int k = 0; k < QT_QK_K; k++)
        m = fmaxf(m, fabsf(x[k]));
    return m;
#endif
}

/*
 * One token: n_in / 256 super-blocks. q = round-to-nearest-even(x * (127 /
 * max|x|)) in f32, as matmul.c's blocks of 32 (and the tests) compute it.
 * The AVX-512 kernel of q4_K and q5_K reads the 32-byte sub-blocks of q in
 * the order 0 2 1 3 4 6 5 7 (see k_unpack), so they are stored so there;
 * the sums bs stay in element order.
 */
static void kx_quantize(enum ggml_type type, const float *x, int n_in, int8_t *q, float *d,
                        int16_t *bs)
{
    static const int order[2][8] = {{0, 1, 2, 3, 4, 5, 6, 7}, {0, 2, 1, 3, 4, 6, 5, 7}};
#if defined(KERN_AVX512)
    const int *at = order[k_paired(type)];
#else
    const int *at = order[0];
    (void)type;
#endif
    for (int b = 0; b < n_in / QT_QK_K; b++, x += QT_QK_K, q += QT_QK_K, bs += 16) {
        float amax = amax256(x);
        d[b] = amax / 127.0f;
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
#ifdef KERN_SIMD
        const __m256 vid = _mm256_set1_ps(id);
        for (int k = 0; k < QT_QK_K; k += 32) {
            __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), vid));
            __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), vid));
            __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), vid));
            __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), vid));
            /* the sums of each 16 */
            __m256i s01 = _mm256_add_epi32(i0, i1), s23 = _mm256_add_epi32(i2, i3);
            __m256i h = _mm256_hadd_epi32(s01, s23); /* lanes: 01 01 23 23 | 01 01 23 23 */
            h = _mm256_hadd_epi32(h, h);             /* 01 23 01 23 | 01 23 01 23 */
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            bs[k / 16] = (int16_t)_mm_cvtsi128_si32(s4);
            bs[k / 16 + 1] = (int16_t)_mm_extract_epi32(s4, 1);
            /* i32 -> i8: the packs interleave 128-bit lanes; one permute restores order */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + 32 * at[k / 32]), p);
        }
#else
        (void)at; /* only the SIMD kernels reorder */
        for (int g = 0; g < 16; g++) {
            int sum = 0;
            for (int k = 16 * g; k < 16 * g + 16; k++) {
                float v = nearbyintf(x[k] * id);
                /* clamp before converting: also turns NaN into a defined value */
                v = v >= -127.0f ? v : -127.0f;
                v = v <= 127.0f ? v : 127.0f;
                q[k] = (int8_t)v;
                sum += q[k];
            }
            bs[g] = (int16_t)sum;
        }
#endif
    }
}

/* ------------------------------------------------------------------------
 * Super-block fields (quant.h and quant_blocks.c describe the layouts)
 * ------------------------------------------------------------------------ */

#define Q5K_QH 16 /* q5_K: 32 bytes of fifth bits */
#define Q5K_QS 48 /* q5_K: 128 bytes of nibbles */

static size_t sb_bytes(enum ggml_type type)
{
    switch (type) {
    case GGML_TYPE_Q2_K:
        return 84;
    case GGML_TYPE_Q3_K:
        return 110;
    case GGML_TYPE_Q4_K:
        return 144;
    case GGML_TYPE_Q5_K:
        return 176;
    default:
        return 210;
    }
}

#ifndef KERN_SIMD

/* ------------------------------------------------------------------------
 * Plain C
 * ------------------------------------------------------------------------ */

/* q2_K and q3_K (quant_blocks.c has their layouts): element 128h + 32j + l
 * takes bits 2j, 2j+1 of qs[32h + l]; q3_K's third bit (u = q + 4) is bit
 * 4h + j of hmask[l]. */
static void sb_decode_23(enum ggml_type type, const uint8_t *u, uint8_t *w, int *sc, int *mn,
                         float *d, float *dmin)
{
    const bool q3 = type == GGML_TYPE_Q3_K;
    uint32_t w3[4];
    uint8_t s3[16];
    if (q3) {
        qt_q3k_scale_words(u + QT_Q3K_SCALES, w3);
        memcpy(s3, w3, sizeof s3);
    }
    *d = qt_f16_to_f32(qt_rd16(u + (q3 ? QT_Q3K_D : QT_Q2K_D)));
    *dmin = q3 ? 0.0f : qt_f16_to_f32(qt_rd16(u + QT_Q2K_DMIN));
    for (int g = 0; g < 16; g++) {
        sc[g] = q3 ? s3[g] - 32 : u[QT_Q2K_SCALES + g] & 15;
        mn[g] = q3 ? 0 : u[QT_Q2K_SCALES + g] >> 4;
    }
    const uint8_t *qs = u + (q3 ? QT_Q3K_QS : QT_Q2K_QS);
    for (int i = 0; i < QT_QK_K; i++) {
        int h = i / 128, j = (i % 128) / 32, l = i % 32;
        int v = (qs[32 * h + l] >> (2 * j)) & 3;
        if (q3)
            v |= ((u[QT_Q3K_HMASK + l] >> (4 * h + j)) & 1) << 2;
        w[i] = (uint8_t)v;
    }
}

/* Super-block u as integers w[256] (q6_K, q3_K: before the offset), the
 * scale of every 16 (sc[16]), the min of every 16 (mn[16], 0 without
 * mins), d and dmin. */
static void sb_decode(enum ggml_type type, const uint8_t *u, uint8_t *w, int *sc, int *mn, float *d,
                      float *dmin)
{
    if (type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K) {
        sb_decode_23(type, u, w, sc, mn, d, dmin);
        return;
    }
    if (type == GGML_TYPE_Q6_K) {
        *d = qt_f16_to_f32(qt_rd16(u + QT_Q6K_D));
        *dmin = 0.0f;
        for (int g = 0; g < 16; g++) {
            sc[g] = ((const int8_t *)(u + QT_Q6K_SCALES))[g];
            mn[g] = 0;
        }
        for (int i = 0; i < QT_QK_K; i++) {
            int h = i / 128, kk = (i % 128) / 32, l = i % 32;
            int lo = (u[QT_Q6K_QL + 64 * h + 32 * (kk & 1) + l] >> (4 * (kk >> 1))) & 15;
            int hi = (u[QT_Q6K_QH + 32 * h + l] >> (2 * kk)) & 3;
            w[i] = (uint8_t)(lo | hi << 4);
        }
        return;
    }
    const bool q5 = type == GGML_TYPE_Q5_K;
    *d = qt_f16_to_f32(qt_rd16(u + QT_Q4K_D));
    *dmin = qt_f16_to_f32(qt_rd16(u + QT_Q4K_DMIN));
    for (int j = 0; j < 8; j++) {
        int s, m;
        qt_q4k_scale_min(u + QT_Q4K_SCALES, j, &s, &m);
        sc[2 * j] = sc[2 * j + 1] = s;
        mn[2 * j] = mn[2 * j + 1] = m;
        const uint8_t *qs = u + (q5 ? Q5K_QS : QT_Q4K_QS) + 32 * (j / 2);
        for (int l = 0; l < 32; l++) {
            int v = (qs[l] >> (4 * (j & 1))) & 15;
            if (q5)
                v |= ((u[Q5K_QH + l] >> j) & 1) << 4;
            w[32 * j + l] = (uint8_t)v;
        }
    }
}

static void rows_scalar(const struct mm_k_job *jb, int o0, int o1)
{
    const struct mm_weight *w = jb->w;
    const struct mm_kx *a = &jb->a;
    const enum ggml_type type = w->type;
    float *out = jb->out;
    const int n_tok = jb->n_tok;
    const int nsb = w->n_in / QT_QK_K;
    const size_t bb = sb_bytes(type);
    const int c = k_offset_log2(type) < 0 ? 0 : 1 << k_offset_log2(type);
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
        for (int t0 = 0; t0 < n_tok; t0 += NT) {
            int nt = n_tok - t0 < NT ? n_tok - t0 : NT;
            float acc[NT] = {0};
            for (int b = 0; b < nsb; b++) {
                uint8_t u[QT_QK_K];
                int sc[16], mn[16];
                float d, dmin;
                sb_decode(type, row + bb * (size_t)b, u, sc, mn, &d, &dmin);
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = a->q + (size_t)(t0 + t) * a->ldq + QT_QK_K * (size_t)b;
                    const int16_t *bs = a->bs + (size_t)(t0 + t) * a->lds + 16 * (size_t)b;
                    float dx = a->d[(size_t)(t0 + t) * a->ldd + b];
                    int32_t isum = 0, msum = 0;
                    for (int g = 0; g < 16; g++) {
                        int32_t dot = 0;
                        for (int l = 16 * g; l < 16 * g + 16; l++)
                            dot += u[l] * q[l];
                        isum += sc[g] * (dot - c * bs[g]);
                        msum += mn[g] * bs[g];
                    }
                    acc[t] += (float)isum * (d * dx) - (float)msum * (dmin * dx);
                }
            }
            for (int t = 0; t < nt; t++)
                out[(size_t)(t0 + t) * (size_t)w->n_out + (size_t)o] = acc[t];
        }
    }
}

#endif /* !KERN_SIMD */

#ifdef KERN_SIMD

/* ------------------------------------------------------------------------
 * SIMD
 * ------------------------------------------------------------------------ */

/* Per-row state of the current super-block. */
struct ksr {
    __m256i sc;   /* q4_K/q5_K: the 8 scales as i16 in both 128-bit halves;
                   * q2_K/q3_K/q6_K: the 16 scales as i16 (groups 0..7 low,
                   * 8..15 high) */
    __m256i mn;   /* the min of every 16 as i16 (types without mins: unused) */
    __m256 d, dm; /* d and dmin broadcast */
#if defined(KERN_AVX512)
    __m512i sv[2]; /* the scales of each half of 128, as k_sb_dot pairs them */
#endif
};

/* The 16 scales (as i8), mins (as i16) and factors of a type with a scale
 * per 16 (q2_K, q3_K, q6_K). */
INLINE __m128i ksr_per16(enum ggml_type type, const uint8_t *u, struct ksr *k)
{
    k->mn = _mm256_setzero_si256();
    k->dm = _mm256_setzero_ps();
    if (type == GGML_TYPE_Q6_K) {
        k->d = f16_bcast(u + QT_Q6K_D);
        return _mm_loadu_si128((const __m128i *)(u + QT_Q6K_SCALES));
    }
    if (type == GGML_TYPE_Q3_K) {
        uint32_t w[4]; /* built in registers: bytes stored one by one and loaded
                        * as a vector stall on store forwarding */
        qt_q3k_scale_words(u + QT_Q3K_SCALES, w);
        k->d = f16_bcast(u + QT_Q3K_D);
        return _mm_sub_epi8(_mm_set_epi32((int)w[3], (int)w[2], (int)w[1], (int)w[0]),
                            _mm_set1_epi8(32));
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)(u + QT_Q2K_SCALES)), lo4 = _mm_set1_epi8(15);
    k->mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), lo4));
    k->d = f16_bcast(u + QT_Q2K_D);
    k->dm = f16_bcast(u + QT_Q2K_DMIN);
    return _mm_and_si128(b, lo4);
}

INLINE void ksr_load(enum ggml_type type, const uint8_t *u, struct ksr *k)
{
    if (!k_paired(type)) {
        k->sc = _mm256_cvtepi8_epi16(ksr_per16(type, u, k));
#if defined(KERN_AVX512)
        /* 128-bit lane L of half h: groups 8h + L (x4) and 8h + 4 + L (x4) */
        const __m512i ctl = _mm512_set_epi64(
            0x0f0e0f0e0f0e0f0e, 0x0706070607060706, 0x0d0c0d0c0d0c0d0c, 0x0504050405040504,
            0x0b0a0b0a0b0a0b0a, 0x0302030203020302, 0x0908090809080908, 0x0100010001000100);
        k->sv[0] = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_castsi256_si128(k->sc)), ctl);
        k->sv[1] =
            _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm256_extracti128_si256(k->sc, 1)), ctl);
#endif
        return;
    }
    uint64_t sc, mn;
    qt_q4k_scales_mins(u + QT_Q4K_SCALES, &sc, &mn);
    __m128i s8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc));
    __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn));
    k->sc = _mm256_broadcastsi128_si256(s8);
    k->mn = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    k->d = f16_bcast(u + QT_Q4K_D);
    k->dm = f16_bcast(u + QT_Q4K_DMIN);
#if defined(KERN_AVX512)
    /* half h: 128-bit lanes 0, 1 sub-blocks 4h, 4h+1 (x4 each); lanes 2, 3: 4h+2, 4h+3 */
    const __m512i b8 = _mm512_broadcast_i32x4(s8);
    k->sv[0] = _mm512_shuffle_epi8(b8, _mm512_set_epi64(0x0706070607060706, 0x0504050405040504,
                                                        0x0706070607060706, 0x0504050405040504,
                                                        0x0302030203020302, 0x0100010001000100,
                                                        0x0302030203020302, 0x0100010001000100));
    k->sv[1] = _mm512_shuffle_epi8(b8, _mm512_set_epi64(0x0f0e0f0e0f0e0f0e, 0x0d0c0d0c0d0c0d0c,
                                                        0x0f0e0f0e0f0e0f0e, 0x0d0c0d0c0d0c0d0c,
                                                        0x0b0a0b0a0b0a0b0a, 0x0908090809080908,
                                                        0x0b0a0b0a0b0a0b0a, 0x0908090809080908));
#endif
}

#if defined(KERN_AVX512)

typedef __m512i vi;
typedef __m512 vf;
#define vf_zero() _mm512_setzero_ps()
#define vi_zero() _mm512_setzero_si512()
#define vf_hsum(v) _mm512_reduce_add_ps(v)

/* q2_K, q3_K: half h as k_unpack gives it, from the 32 bytes of qs[32h..]
 * shifted by 0 and 2 (lo) and 4 and 6 (hi) bits; q3_K adds 4 where bit
 * 4h + j of hmask[l] is set (j = 0, 1 in lo, 2, 3 in hi). */
INLINE void k_unpack_23(enum ggml_type type, const uint8_t *u, int h, __m512i *lo, __m512i *hi)
{
    const bool q3 = type == GGML_TYPE_Q3_K;
    const __m512i three = _mm512_set1_epi8(3);
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256((const __m256i *)(u + (q3 ? QT_Q3K_QS : QT_Q2K_QS) + 32 * h)));
    *lo = _mm512_and_si512(
        _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1)),
        three);
    *hi = _mm512_and_si512(
        _mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1)),
        three);
    if (q3) {
        __m512i hm =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(u + QT_Q3K_HMASK)));
        const __m512i four = _mm512_set1_epi8(4);
        __m512i sel_lo = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h))),
                                            _mm256_set1_epi8((char)(1 << (4 * h + 1))), 1);
        __m512i sel_hi = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h + 2))),
                                            _mm256_set1_epi8((char)(1 << (4 * h + 3))), 1);
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(hm, sel_lo), *lo, four);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(hm, sel_hi), *hi, four);
    }
}

/*
 * Half h of a super-block (elements 128h..128h+127) as two vectors of 64
 * unsigned weight integers: q4_K/q5_K lo = sub-blocks 4h, 4h+2 and hi =
 * 4h+1, 4h+3 (the nibbles of one 64-byte load, whence the activations'
 * swapped order); q6_K lo = elements 128h..+63 and hi = 128h+64..+127 (the
 * nibbles of ql[64h..64h+63] with their top bits from qh[32h..32h+31]);
 * q2_K and q3_K likewise in order (k_unpack_23).
 */
INLINE void k_unpack(enum ggml_type type, const uint8_t *u, int h, __m512i *lo, __m512i *hi)
{
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    if (type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K) {
        k_unpack_23(type, u, h, lo, hi);
        return;
    }
    if (type == GGML_TYPE_Q6_K) {
        __m512i ql = _mm512_loadu_si512((const void *)(u + QT_Q6K_QL + 64 * h));
        __m512i qh =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(u + QT_Q6K_QH + 32 * h)));
        /* bits 0-1 | 2-3 (lo) and 4-5 | 6-7 (hi) of qh to bits 4-5, per 256-bit half */
        const __m512i c42 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
        const __m512i c02 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
        const __m512i m30 = _mm512_set1_epi8(0x30);
        *lo = _mm512_or_si512(_mm512_and_si512(ql, lo4),
                              _mm512_and_si512(_mm512_sllv_epi16(qh, c42), m30));
        *hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), lo4),
                              _mm512_and_si512(_mm512_srlv_epi16(qh, c02), m30));
        return;
    }
    const bool q5 = type == GGML_TYPE_Q5_K;
    __m512i v = _mm512_loadu_si512((const void *)(u + (q5 ? Q5K_QS : QT_Q4K_QS) + 64 * h));
    *lo = _mm512_and_si512(v, lo4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
    if (q5) {
        /* fifth bits: bit j of qh[l] for sub-block j */
        __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(u + Q5K_QH)));
        const __m512i sixteen = _mm512_set1_epi8(16);
        __m512i sel_lo = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h))),
                                            _mm256_set1_epi8((char)(1 << (4 * h + 2))), 1);
        __m512i sel_hi = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h + 1))),
                                            _mm256_set1_epi8((char)(1 << (4 * h + 3))), 1);
        *lo = _mm512_mask_add_epi8(*lo, _mm512_test_epi8_mask(qh, sel_lo), *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, _mm512_test_epi8_mask(qh, sel_hi), *hi, sixteen);
    }
}

/*
 * One super-block's integer sums for every row and token of a tile. Per
 * half: vpdpbusd gives sums of 4 products in i32 lanes (each within one
 * sub-block or group: at most 4 * 63 * 127 = 32004), vpackssdw packs the
 * lo and hi results to i16 without saturating, and vpdpwssd multiplies
 * them by the scales (ksr.sv, laid out as the pack interleaves: 128-bit
 * lane L holds 4 lanes of lo, then 4 of hi) and accumulates in i32.
 */
INLINE void k_sb_dot(enum ggml_type type, int mr, int nt, const uint8_t *const *up,
                     const struct ksr *ks, const int8_t *const *xq, size_t off, __m512i isum[][NT])
{
    const __m512i zero = _mm512_setzero_si512();
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        __m512i lo[MR], hi[MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
            k_unpack(type, up[r], h, &lo[r], &hi[r]);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m512i x0 = _mm512_loadu_si512((const void *)(xq[t] + off + 128 * h));
            __m512i x1 = _mm512_loadu_si512((const void *)(xq[t] + off + 128 * h + 64));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                __m512i p = _mm512_packs_epi32(_mm512_dpbusd_epi32(zero, lo[r], x0),
                                               _mm512_dpbusd_epi32(zero, hi[r], x1));
                isum[r][t] = _mm512_dpwssd_epi32(isum[r][t], p, ks[r].sv[h]);
            }
        }
    }
}

/* isum (16 lanes) -> f32 lanes scaled and added; the mins' i32 lanes (8) likewise. */
INLINE vf k_fold(vf acc, vi isum, __m256i msum, __m256 dd, __m256 dm, bool mins)
{
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_broadcast_f32x8(dd), acc);
    if (mins)
        acc = _mm512_fnmadd_ps(_mm512_zextps256_ps512(_mm256_cvtepi32_ps(msum)),
                               _mm512_zextps256_ps512(dm), acc);
    return acc;
}

INLINE vi vi_sub_corr(vi isum, __m256i corr)
{
    return _mm512_sub_epi32(isum, _mm512_zextsi256_si512(corr));
}

#else /* AVX2 */

typedef __m256i vi;
typedef __m256 vf;
#define vf_zero() _mm256_setzero_ps()
#define vi_zero() _mm256_setzero_si256()
#define vf_hsum(v) hsum8(v)

/* Bits b.. of every byte moved to bits at..: shifts of 16-bit lanes (the
 * mask after it keeps each byte's own bits). */
INLINE __m256i bits_to(__m256i v, int b, int at)
{
    return b <= at ? _mm256_slli_epi16(v, at - b) : _mm256_srli_epi16(v, b - at);
}

/* Step j (sub-block j, elements 32j..32j+31): the 32 unsigned weight integers. */
INLINE vi k_unpack(enum ggml_type type, const uint8_t *u, int j)
{
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    if (type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K) {
        /* bits 2(j%4).. of qs[32(j/4)..]; q3_K's third bit: bit j of hmask */
        const bool q3 = type == GGML_TYPE_Q3_K;
        __m256i v = _mm256_loadu_si256(
            (const __m256i *)(u + (q3 ? QT_Q3K_QS : QT_Q2K_QS) + 32 * (j >> 2)));
        v = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j & 3)), _mm256_set1_epi8(3));
        if (q3) {
            __m256i hm = _mm256_loadu_si256((const __m256i *)(u + QT_Q3K_HMASK));
            v = _mm256_or_si256(v, _mm256_and_si256(bits_to(hm, j, 2), _mm256_set1_epi8(4)));
        }
        return v;
    }
    if (type == GGML_TYPE_Q6_K) {
        int h = j >> 2, kk = j & 3;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(u + QT_Q6K_QL + 64 * h + 32 * (kk & 1)));
        if (kk & 2)
            ql = _mm256_srli_epi16(ql, 4);
        __m256i qh = _mm256_loadu_si256((const __m256i *)(u + QT_Q6K_QH + 32 * h));
        return _mm256_or_si256(_mm256_and_si256(ql, lo4),
                               _mm256_and_si256(bits_to(qh, 2 * kk, 4), _mm256_set1_epi8(0x30)));
    }
    const bool q5 = type == GGML_TYPE_Q5_K;
    __m256i v =
        _mm256_loadu_si256((const __m256i *)(u + (q5 ? Q5K_QS : QT_Q4K_QS) + 32 * (j >> 1)));
    if (j & 1)
        v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, lo4);
    if (q5) {
        __m256i qh = _mm256_loadu_si256((const __m256i *)(u + Q5K_QH));
        v = _mm256_or_si256(v, _mm256_and_si256(bits_to(qh, j, 4), _mm256_set1_epi8(0x10)));
    }
    return v;
}

/* Step j's scales as i16 lanes matching vpmaddubsw's pairs: q4_K/q5_K
 * s_j everywhere; the per-16 types s_2j in the low half, s_2j+1 in the high. */
INLINE vi k_scale(enum ggml_type type, const struct ksr *k, int j)
{
    if (!k_paired(type)) {
        /* both halves from the 128-bit half holding groups 2j, 2j+1 */
        __m256i s = j < 4 ? _mm256_permute2x128_si256(k->sc, k->sc, 0x00)
                          : _mm256_permute2x128_si256(k->sc, k->sc, 0x11);
        int w0 = 2 * (2 * j % 8), w1 = w0 + 2; /* byte offsets of the two words */
        __m256i ctl =
            _mm256_setr_epi8(w0, w0 + 1, w0, w0 + 1, w0, w0 + 1, w0, w0 + 1, w0, w0 + 1, w0, w0 + 1,
                             w0, w0 + 1, w0, w0 + 1, w1, w1 + 1, w1, w1 + 1, w1, w1 + 1, w1, w1 + 1,
                             w1, w1 + 1, w1, w1 + 1, w1, w1 + 1, w1, w1 + 1);
        return _mm256_shuffle_epi8(s, ctl);
    }
    int w0 = 2 * j;
    return _mm256_shuffle_epi8(k->sc, _mm256_set1_epi16((short)(w0 | (w0 + 1) << 8)));
}

INLINE vf k_fold(vf acc, vi isum, __m256i msum, __m256 dd, __m256 dm, bool mins)
{
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dd, acc);
    if (mins)
        acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), dm, acc);
    return acc;
}

INLINE vi vi_sub_corr(vi isum, __m256i corr)
{
    return _mm256_sub_epi32(isum, corr);
}

/* One super-block's integer sums for every row and token of a tile: per
 * sub-block, vpmaddubsw pairs in i16, vpmaddwd against the scales, i32 adds. */
INLINE void k_sb_dot(enum ggml_type type, int mr, int nt, const uint8_t *const *up,
                     const struct ksr *ks, const int8_t *const *xq, size_t off, __m256i isum[][NT])
{
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        __m256i u[MR], s[MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            u[r] = k_unpack(type, up[r], j);
            s[r] = k_scale(type, &ks[r], j);
        }
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(xq[t] + off + 32 * j));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
                isum[r][t] = _mm256_add_epi32(
                    isum[r][t], _mm256_madd_epi16(_mm256_maddubs_epi16(u[r], x), s[r]));
        }
    }
}

#endif /* AVX2 */

/*
 * mr rows x nt tokens over whole rows (rows past the end repeat the last
 * row, tokens past the end the last token; their results are discarded).
 */
INLINE void k_tile(const struct mm_k_job *jb, enum ggml_type type, int r0, int t0, int mr, int nt)
{
    const struct mm_weight *w = jb->w;
    const struct mm_kx *a = &jb->a;
    const size_t bb = sb_bytes(type);
    const int nsb = w->n_in / QT_QK_K;
    const bool mins = k_mins(type);
    const uint8_t *rows[MR];
    const int8_t *xq[NT];
    const float *xd[NT];
    const int16_t *xb[NT];
    for (int r = 0; r < mr; r++) {
        int o = r0 + r < w->n_out ? r0 + r : w->n_out - 1;
        rows[r] = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
    }
    for (int t = 0; t < nt; t++) {
        int tk = t0 + t < jb->n_tok ? t0 + t : jb->n_tok - 1;
        xq[t] = a->q + (size_t)tk * a->ldq;
        xd[t] = a->d + (size_t)tk * a->ldd;
        xb[t] = a->bs + (size_t)tk * a->lds;
    }

    vf acc[MR][NT];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++)
            acc[r][t] = vf_zero();

    for (int b = 0; b < nsb; b++) {
        struct ksr ks[MR];
        const uint8_t *up[MR];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            up[r] = rows[r] + bb * (size_t)b;
            ksr_load(type, up[r], &ks[r]);
        }
        if (mr == 1 && nt == 1) /* decoding: see K_PREFETCH */
            prefetch_ahead(up[0], bb, K_PREFETCH);
        vi isum[MR][NT];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
            for (int t = 0; t < nt; t++)
                isum[r][t] = vi_zero();
        k_sb_dot(type, mr, nt, up, ks, xq, QT_QK_K * (size_t)b, isum);
#pragma GCC unroll 4
        for (int t = 0; t < nt; t++) {
            __m256i bs = _mm256_load_si256((const __m256i *)(xb[t] + 16 * (size_t)b));
            __m256 dx = _mm256_set1_ps(xd[t][b]);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                __m256i msum = _mm256_setzero_si256();
                vi is = isum[r][t];
                if (mins) /* sum_g m_g * (sum of q over g) */
                    msum = _mm256_madd_epi16(bs, ks[r].mn);
                if (k_offset_log2(type) >= 0) /* c * sum_g s_g * (sum of q over g) */
                    is = vi_sub_corr(is, _mm256_slli_epi32(_mm256_madd_epi16(bs, ks[r].sc),
                                                           k_offset_log2(type)));
                acc[r][t] = k_fold(acc[r][t], is, msum, _mm256_mul_ps(ks[r].d, dx),
                                   _mm256_mul_ps(ks[r].dm, dx), mins);
            }
        }
    }

    for (int t = 0; t < nt && t0 + t < jb->n_tok; t++)
        for (int r = 0; r < mr && r0 + r < w->n_out; r++)
            jb->out[(size_t)(t0 + t) * (size_t)w->n_out + (size_t)(r0 + r)] = vf_hsum(acc[r][t]);
}

/* Rows [o0, o1): token tiles outside, row tiles inside; a lone last token
 * in a 1-token tile, which sums in the same order. */
INLINE void rows_simd_type(const struct mm_k_job *jb, enum ggml_type type, int o0, int o1)
{
    for (int t0 = 0; t0 < jb->n_tok; t0 += NT) {
        bool one = jb->n_tok - t0 == 1;
        if (one)
            for (int r0 = o0; r0 < o1; r0 += MR1)
                k_tile(jb, type, r0, t0, MR1, 1);
        else
            for (int r0 = o0; r0 < o1; r0 += MR)
                k_tile(jb, type, r0, t0, MR, NT);
    }
}

static void rows_simd(const struct mm_k_job *jb, int o0, int o1)
{
    switch (jb->w->type) {
    case GGML_TYPE_Q2_K:
        rows_simd_type(jb, GGML_TYPE_Q2_K, o0, o1);
        break;
    case GGML_TYPE_Q3_K:
        rows_simd_type(jb, GGML_TYPE_Q3_K, o0, o1);
        break;
    case GGML_TYPE_Q4_K:
        rows_simd_type(jb, GGML_TYPE_Q4_K, o0, o1);
        break;
    case GGML_TYPE_Q5_K:
        rows_simd_type(jb, GGML_TYPE_Q5_K, o0, o1);
        break;
    default:
        rows_simd_type(jb, GGML_TYPE_Q6_K, o0, o1);
        break;
    }
}

#endif /* KERN_SIMD */

/* ------------------------------------------------------------------------
 * This level's kernels
 * ------------------------------------------------------------------------ */

const struct mm_k_kernels KERN(mm_k_kernels) = {
#if defined(KERN_AVX512)
    .name = "avx512-vnni",
    .rows = rows_simd,
#elif defined(KERN_AVX2)
    .name = "avx2",
    .rows = rows_simd,
#else
    .name = "scalar",
    .rows = rows_scalar,
#endif
    .quantize = kx_quantize,
};
