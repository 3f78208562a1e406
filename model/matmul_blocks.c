/*
 * matmul_blocks.c - the matrix products of quant_blocks.c's formats of 32
 * (q4_1, q5_0, q5_1, iq4_nl, and iq4_xs's sub-blocks of 32; its q2_K, q3_K
 * and q5_K go to matmul_k.c) against 8-bit activations.
 *
 * Every block of 32 weights is decoded once per tile of tokens into
 * integers w[32], two scales and two mins (qt_block32_decode; the AVX2
 * kernel decodes the integers in registers itself), and meets
 * each token's quantised activations q (scale dx) in integer dot products:
 *
 *     sum_k value[k] x[k] = dx * sum_h ( s[h] * sum_{k in h} w[k] q[k]
 *                                       - mn[h] * sum_{k in h} q[k] )
 *
 * with h the two halves of 16. The integer sums are exact, so the result
 * differs from a product over the dequantised weights only by the
 * activations' rounding (as for every quantised type of matmul.c) and f32
 * summation.
 *
 * Kernels, chosen at run time by the kernel level in use (cpu/cpu.h; the
 * build need not target AVX2, the AVX2 code carries target attributes):
 *   avx2    one block per 256-bit step: vpmaddubsw(|w|, sign(q, w)) and
 *           vpmaddwd give eight i32 lanes, lanes 0..3 the first half's
 *           sums and 4..7 the second's, scaled by (s0 x4, s1 x4) * dx in
 *           f32 lanes; the mins the same way from the sums of q.
 *           |w| <= 127 and |q| <= 127, so the pairwise i16 sums of
 *           vpmaddubsw cannot saturate.
 *   scalar  the same integer sums in plain C.
 * Rows are independent and each token's outputs are summed block by block
 * in one fixed order, so results depend neither on the threads nor on the
 * other tokens of the batch.
 */
#include <assert.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "cpu/cpu.h"
#include "model/quant.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define MMB_X86 1
#endif

/* Tokens whose activations one decoded block meets before the next block. */
#define MMB_NT 4

struct block32 {
    int8_t w[32];
    float s[2], mn[2];
};

/* ------------------------------------------------------------------------
 * Plain C
 * ------------------------------------------------------------------------ */

static void rows_scalar(const struct mm_weight *w, const struct mm_xq *xa, float *out, int n_tok,
                        int o0, int o1)
{
    const int nb = w->n_in / QT_QK;
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
        for (int t0 = 0; t0 < n_tok; t0 += MMB_NT) {
            int nt = n_tok - t0 < MMB_NT ? n_tok - t0 : MMB_NT;
            float acc[MMB_NT] = {0};
            for (int b = 0; b < nb; b++) {
                struct block32 k;
                qt_block32_decode(w->type, row, b, k.w, k.s, k.mn);
                for (int t = 0; t < nt; t++) {
                    const int8_t *q = xa->q + (size_t)(t0 + t) * xa->ldq + QT_QK * (size_t)b;
                    float dx = xa->d[(size_t)(t0 + t) * xa->ldb + b];
                    int dot[2] = {0, 0}, sum[2] = {0, 0};
                    for (int i = 0; i < 32; i++) {
                        dot[i / 16] += k.w[i] * q[i];
                        sum[i / 16] += q[i];
                    }
                    acc[t] += dx * ((k.s[0] * (float)dot[0] - k.mn[0] * (float)sum[0]) +
                                    (k.s[1] * (float)dot[1] - k.mn[1] * (float)sum[1]));
                }
            }
            for (int t = 0; t < nt; t++)
                out[(size_t)(t0 + t) * (size_t)w->n_out + (size_t)o] = acc[t];
        }
    }
}

/* ------------------------------------------------------------------------
 * AVX2
 * ------------------------------------------------------------------------ */

#ifdef MMB_X86

#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

/* An f16 at any alignment, as f32. */
AVX2_FN static inline float f16_at(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/*
 * Scales and mins of block b, as qt_block32_scales gives them: read here
 * for the blocks of 32, whose scale (and min) lead the block, so the hot
 * loop makes no call for them; the K formats' packed scales go through
 * quant_blocks.c.
 */
AVX2_FN static inline void scales_avx2(enum ggml_type type, const uint8_t *row, int b, float *s,
                                       float *mn)
{
    switch (type) {
    case GGML_TYPE_Q4_1:
    case GGML_TYPE_Q5_1: {
        const uint8_t *u = row + (type == GGML_TYPE_Q4_1 ? 20 : 24) * (size_t)b;
        s[0] = s[1] = f16_at(u);
        mn[0] = mn[1] = -f16_at(u + 2);
        return;
    }
    case GGML_TYPE_Q5_0:
    case GGML_TYPE_IQ4_NL:
        s[0] = s[1] = f16_at(row + (type == GGML_TYPE_Q5_0 ? 22 : 18) * (size_t)b);
        mn[0] = mn[1] = 0.0f;
        return;
    case GGML_TYPE_IQ4_XS: {
        const uint8_t *u = qt_iq4xs_sb(row, b);
        s[0] = s[1] = f16_at(u + QT_IQ4XS_D) * (float)qt_iq4xs_scale(u, b % 8);
        mn[0] = mn[1] = 0.0f;
        return;
    }
    default:
        qt_block32_scales(type, row, b, s, mn);
        return;
    }
}

AVX2_FN static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 nibbles of 16 bytes: low nibbles in bytes 0..15, high in 16..31. */
AVX2_FN static inline __m256i nibbles(const uint8_t *p)
{
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    __m256i n = _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
    return _mm256_and_si256(n, _mm256_set1_epi8(15));
}

/* 0x10 in byte e where bit e of the little-endian u32 at p is set. */
AVX2_FN static inline __m256i fifth_bits(const uint8_t *p)
{
    uint32_t qh;
    memcpy(&qh, p, 4);
    /* byte e takes byte e/8 of qh, then tests bit e%8 of it */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                            2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/*
 * The integers of block b of a row (quant_blocks.c's layouts, the same
 * values as qt_block32_decode gives) in one vector; scales and mins come
 * from qt_block32_scales.
 */
AVX2_FN static inline __m256i decode_avx2(enum ggml_type type, const uint8_t *row, int b)
{
    switch (type) {
    case GGML_TYPE_Q4_1:
        return nibbles(row + 20 * (size_t)b + 4);
    case GGML_TYPE_Q5_0: {
        const uint8_t *u = row + 22 * (size_t)b;
        __m256i q = _mm256_or_si256(nibbles(u + 6), fifth_bits(u + 2));
        return _mm256_sub_epi8(q, _mm256_set1_epi8(16));
    }
    case GGML_TYPE_Q5_1: {
        const uint8_t *u = row + 24 * (size_t)b;
        return _mm256_or_si256(nibbles(u + 8), fifth_bits(u + 4));
    }
    default: { /* IQ4_NL, IQ4_XS: the same levels */
        const __m256i levels = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25,
                                                38, 53, 69, 89, 113, -127, -104, -83, -65, -49, -35,
                                                -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
        const uint8_t *qs =
            type == GGML_TYPE_IQ4_XS ? qt_iq4xs_qs(row, b) : row + 18 * (size_t)b + 2;
        return _mm256_shuffle_epi8(levels, nibbles(qs));
    }
    }
}

AVX2_FN static void rows_avx2(const struct mm_weight *w, const struct mm_xq *xa, float *out,
                              int n_tok, int o0, int o1)
{
    const int nb = w->n_in / QT_QK;
    const bool mins = w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q5_1;
    const __m256i ones16 = _mm256_set1_epi16(1), ones8 = _mm256_set1_epi8(1);
    for (int o = o0; o < o1; o++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)o * w->row_bytes;
        for (int t0 = 0; t0 < n_tok; t0 += MMB_NT) {
            int nt = n_tok - t0 < MMB_NT ? n_tok - t0 : MMB_NT;
            __m256 acc[MMB_NT];
            for (int t = 0; t < MMB_NT; t++)
                acc[t] = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                struct block32 k;
                scales_avx2(w->type, row, b, k.s, k.mn);
                __m256i wv = decode_avx2(w->type, row, b);
                __m256i wabs = _mm256_sign_epi8(wv, wv);
                __m256 sv =
                    _mm256_setr_ps(k.s[0], k.s[0], k.s[0], k.s[0], k.s[1], k.s[1], k.s[1], k.s[1]);
                __m256 mv = _mm256_setr_ps(k.mn[0], k.mn[0], k.mn[0], k.mn[0], k.mn[1], k.mn[1],
                                           k.mn[1], k.mn[1]);
                for (int t = 0; t < nt; t++) {
                    size_t tok = (size_t)(t0 + t);
                    __m256i x = _mm256_loadu_si256(
                        (const __m256i *)(xa->q + tok * xa->ldq + 32 * (size_t)b));
                    __m256 dx = _mm256_set1_ps(xa->d[tok * xa->ldb + b]);
                    __m256i dot = _mm256_madd_epi16(
                        _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, wv)), ones16);
                    __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(dot), sv);
                    if (mins) {
                        __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, x), ones16);
                        part = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sum), mv, part);
                    }
                    acc[t] = _mm256_fmadd_ps(part, dx, acc[t]);
                }
            }
            for (int t = 0; t < nt; t++)
                out[(size_t)(t0 + t) * (size_t)w->n_out + (size_t)o] = hsum8(acc[t]);
        }
    }
}

#endif /* MMB_X86 */

/* ------------------------------------------------------------------------
 * Dispatch
 * ------------------------------------------------------------------------ */

/* Set by mm_blocks_use("scalar"): plain C whatever the kernel level. */
static _Atomic bool force_scalar;

/* AVX2 when the kernel level in use has it (cpu/cpu.h) and it is not forced off. */
static bool have_avx2(void)
{
#ifdef MMB_X86
    return !atomic_load_explicit(&force_scalar, memory_order_relaxed) && cpu_level() >= CPU_AVX2;
#else
    return false;
#endif
}

int mm_blocks_use(const char *kernel)
{
    if (!strcmp(kernel, "scalar")) {
        atomic_store_explicit(&force_scalar, true, memory_order_relaxed);
        return 0;
    }
    if (strcmp(kernel, "auto") != 0)
        return -EINVAL;
    atomic_store_explicit(&force_scalar, false, memory_order_relaxed);
    return 0;
}

const char *mm_blocks_kernel_name(void)
{
    return have_avx2() ? "avx2" : "scalar";
}

void mm_blocks_rows(const struct mm_weight *w, const struct mm_xq *xa, float *out, int n_tok,
                    int o0, int o1)
{
    assert(qt_is_block_type(w->type) && !mm_k_type(w->type));
#ifdef MMB_X86
    if (have_avx2()) {
        rows_avx2(w, xa, out, n_tok, o0, o1);
        return;
    }
#endif
    rows_scalar(w, xa, out, n_tok, o0, o1);
}
