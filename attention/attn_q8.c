/*
 * attn_q8.c - scores against q8_0 keys by 8-bit integer dot products.
 *
 * Where keys are stored in q8_0 and the position scheme does not rotate
 * them (none, ALiBi, T5), a score needs no dequantised key at all: the
 * prepared query row is quantised once per work item, per block of 32 like
 * the key, and each block's dot product is a sum of int8 x int8 products,
 * scaled once by the two block scales - what the weight matmuls do.
 *
 * One 8-bit level would add the query's rounding (up to d/2 per element,
 * d = max|q| / 127) to every score, and the kernel promises scores exact
 * to the dequantised cache (1e-4 against the reference). So the query is
 * split in two levels of the same block scale d: q = d * (a1 + a2 / 254),
 * a1 = round(q / d), a2 = round((q - d a1) * 254 / d), both in [-127, 127];
 * what is left is at most d / 508 per element, 2^-16 of the block's largest
 * query element. Per block, J = 254 * sum(a1 k) + sum(a2 k) is an exact
 * integer and the score is sum over blocks of d_k * (d / 254) * J.
 *
 * Paths, chosen at run time by the kernel level in use (cpu_level(), see
 * cpu/cpu.h; attn_q8_name() says which):
 *   avx512-vnni  vpdpbusd multiplies u8 by s8 in groups of four: the query
 *                levels are stored offset by 128 (u = a + 128), and
 *                sum(u k) - 128 sum(k) = sum(a k), 128 sum(k) coming from
 *                one more vpdpbusd per key shared by every row;
 *   avx2         vpmaddubsw: |a| times k carrying a's sign (no 16-bit
 *                overflow: 127 * 127 * 2 < 32767), vpmaddwd to 32 bits;
 *   scalar       the same integers in plain C.
 * RoPE keys do not come here; see attn.c for why they are dequantised.
 */
#include "attention_internal.h"
#include "cpu/cpu.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#endif

/* ------------------------------------------------------------------------
 * The query, quantised
 * ------------------------------------------------------------------------ */

static int clamp127(float x)
{
    float r = nearbyintf(x);
    return r < -127.0f ? -127 : r > 127.0f ? 127 : (int)r;
}

void attn_q8_query(const struct attn_q8row *out, const float *q, int D)
{
    for (int b = 0; b < D / ATTN_QK; b++) {
        const float *x = q + b * ATTN_QK;
        float amax = 0.0f;
        for (int i = 0; i < ATTN_QK; i++)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float d = amax / 127.0f;
        float id = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < ATTN_QK; i++) {
            int a1 = clamp127(x[i] * id);
            int a2 = clamp127((x[i] - d * (float)a1) * id * 254.0f);
            out->u1[b * ATTN_QK + i] = (uint8_t)(a1 + 128);
            out->u2[b * ATTN_QK + i] = (uint8_t)(a2 + 128);
        }
        out->d[b] = d / 254.0f;
    }
}

/* ------------------------------------------------------------------------
 * Scalar
 * ------------------------------------------------------------------------ */

static void qk_q8_scalar(float *S, const struct attn_q8row *q, int nrows, const void *const *kp,
                         int nt, int D)
{
    const int nb = D / ATTN_QK;
    for (int t = 0; t < nt; t++) {
        const uint8_t *k = kp[t];
        for (int r = 0; r < nrows; r++) {
            float s = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = k + (size_t)b * ATTN_Q8_0_BYTES;
                const uint8_t *u1 = q[r].u1 + b * ATTN_QK, *u2 = q[r].u2 + b * ATTN_QK;
                int32_t j1 = 0, j2 = 0;
                for (int i = 0; i < ATTN_QK; i++) {
                    int kv = (int8_t)blk[2 + i];
                    j1 += (u1[i] - 128) * kv;
                    j2 += (u2[i] - 128) * kv;
                }
                s += attn_block_scale(blk) * q[r].d[b] * (float)(254 * j1 + j2);
            }
            S[(size_t)r * ATTN_TILE + t] = s;
        }
    }
}

#ifdef HAVE_X86

/* ------------------------------------------------------------------------
 * AVX-512 VNNI: two blocks per 512-bit step
 * ------------------------------------------------------------------------ */

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* Blocks b and b+1 of a q8_0 row: their 64 quants in one register. */
VNNI_TARGET static inline __m512i load_pair(const uint8_t *k, int b)
{
    __m256i lo = _mm256_loadu_si256((const __m256i *)(k + (size_t)b * ATTN_Q8_0_BYTES + 2));
    __m256i hi = _mm256_loadu_si256((const __m256i *)(k + (size_t)(b + 1) * ATTN_Q8_0_BYTES + 2));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

/* 8 lanes of x and 8 of y */
VNNI_TARGET static inline __m512 halves(float x, float y)
{
    return _mm512_insertf32x8(_mm512_set1_ps(x), _mm256_set1_ps(y), 1);
}

VNNI_TARGET static void qk_q8_vnni(float *S, const struct attn_q8row *q, int nrows,
                                   const void *const *kp, int nt, int D)
{
    const int nb = D / ATTN_QK, np = nb / 2;
    const __m512i off = _mm512_set1_epi8((char)0x80), k254 = _mm512_set1_epi32(254);
    const __m256i off256 = _mm256_set1_epi8((char)0x80), k254_256 = _mm256_set1_epi32(254);
    __m512i kq[16], corr[16];
    __m512 dk[16];
    __m256i kq_last = _mm256_setzero_si256(), corr_last = _mm256_setzero_si256();
    float dk_last = 0.0f;
    for (int t = 0; t < nt; t++) {
        const uint8_t *k = kp[t];
        /* the key: quants, 128 * (sums of four), scales - shared by every row */
        for (int p = 0; p < np; p++) {
            kq[p] = load_pair(k, 2 * p);
            corr[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), off, kq[p]);
            dk[p] = halves(attn_block_scale(k + (size_t)(2 * p) * ATTN_Q8_0_BYTES),
                           attn_block_scale(k + (size_t)(2 * p + 1) * ATTN_Q8_0_BYTES));
        }
        if (nb % 2) {
            const uint8_t *blk = k + (size_t)(nb - 1) * ATTN_Q8_0_BYTES;
            kq_last = _mm256_loadu_si256((const __m256i *)(blk + 2));
            corr_last = _mm256_dpbusd_epi32(_mm256_setzero_si256(), off256, kq_last);
            dk_last = attn_block_scale(blk);
        }
        for (int r = 0; r < nrows; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int p = 0; p < np; p++) {
                __m512i u1 = _mm512_loadu_si512((const void *)(q[r].u1 + p * 64));
                __m512i u2 = _mm512_loadu_si512((const void *)(q[r].u2 + p * 64));
                __m512i j1 = _mm512_sub_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, kq[p]), corr[p]);
                __m512i j2 = _mm512_sub_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), u2, kq[p]), corr[p]);
                __m512i j = _mm512_add_epi32(_mm512_mullo_epi32(j1, k254), j2);
                __m512 sc = _mm512_mul_ps(dk[p], halves(q[r].d[2 * p], q[r].d[2 * p + 1]));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j), sc, acc);
            }
            float s = _mm512_reduce_add_ps(acc);
            if (nb % 2) {
                const int b = nb - 1;
                __m256i u1 = _mm256_loadu_si256((const __m256i *)(q[r].u1 + b * ATTN_QK));
                __m256i u2 = _mm256_loadu_si256((const __m256i *)(q[r].u2 + b * ATTN_QK));
                __m256i j1 = _mm256_sub_epi32(
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, kq_last), corr_last);
                __m256i j2 = _mm256_sub_epi32(
                    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u2, kq_last), corr_last);
                __m256 f = _mm256_cvtepi32_ps(
                    _mm256_add_epi32(_mm256_mullo_epi32(j1, k254_256), j2));
                __m128 h = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
                h = _mm_add_ps(h, _mm_movehl_ps(h, h));
                h = _mm_add_ss(h, _mm_movehdup_ps(h));
                s += _mm_cvtss_f32(h) * dk_last * q[r].d[b];
            }
            S[(size_t)r * ATTN_TILE + t] = s;
        }
    }
}

/* ------------------------------------------------------------------------
 * AVX2: one block per 256-bit step
 * ------------------------------------------------------------------------ */

#define AVX2_TARGET __attribute__((target("avx2,fma")))

/* sum over groups of four of a * k, a signed (u - 128), as 8 int32 lanes */
AVX2_TARGET static inline __m256i dot_s8(__m256i u, __m256i k)
{
    __m256i a = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)); /* u - 128 as s8 */
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(k, a));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

AVX2_TARGET static void qk_q8_avx2(float *S, const struct attn_q8row *q, int nrows,
                                   const void *const *kp, int nt, int D)
{
    const int nb = D / ATTN_QK;
    const __m256i k254 = _mm256_set1_epi32(254);
    for (int t = 0; t < nt; t++) {
        const uint8_t *k = kp[t];
        for (int r = 0; r < nrows; r++) {
            __m256 acc = _mm256_setzero_ps();
            for (int b = 0; b < nb; b++) {
                const uint8_t *blk = k + (size_t)b * ATTN_Q8_0_BYTES;
                __m256i kq = _mm256_loadu_si256((const __m256i *)(blk + 2));
                __m256i u1 = _mm256_loadu_si256((const __m256i *)(q[r].u1 + b * ATTN_QK));
                __m256i u2 = _mm256_loadu_si256((const __m256i *)(q[r].u2 + b * ATTN_QK));
                __m256i j = _mm256_add_epi32(_mm256_mullo_epi32(dot_s8(u1, kq), k254),
                                             dot_s8(u2, kq));
                __m256 sc = _mm256_set1_ps(attn_block_scale(blk) * q[r].d[b]);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j), sc, acc);
            }
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            S[(size_t)r * ATTN_TILE + t] = _mm_cvtss_f32(h);
        }
    }
}

#endif /* HAVE_X86 */

/* ------------------------------------------------------------------------
 * Dispatch
 * ------------------------------------------------------------------------ */

#ifdef HAVE_X86
/* Whether the CPU can run a path at all (attn_q8_path, for tests). */
static bool cpu_has(enum cpu_level l)
{
    return cpu_level_supported(l, NULL, 0);
}
#endif

attn_qk_q8_fn attn_q8_path(const char *name)
{
#ifdef HAVE_X86
    if (!strcmp(name, "avx512-vnni"))
        return cpu_has(CPU_AVX512) ? qk_q8_vnni : NULL;
    if (!strcmp(name, "avx2"))
        return cpu_has(CPU_AVX2) ? qk_q8_avx2 : NULL;
#endif
    return !strcmp(name, "scalar") ? qk_q8_scalar : NULL;
}

attn_qk_q8_fn attn_q8_select(bool scalar, const char **name)
{
#ifdef HAVE_X86
    /* the kernel level in use: avx512 includes VNNI (cpu.h) */
    if (!scalar && cpu_level() >= CPU_AVX512) {
        *name = "avx512-vnni";
        return qk_q8_vnni;
    }
    if (!scalar && cpu_level() >= CPU_AVX2) {
        *name = "avx2";
        return qk_q8_avx2;
    }
#endif
    *name = "scalar";
    return qk_q8_scalar;
}

const char *attn_q8_name(void)
{
    const char *name;
    attn_q8_select(false, &name);
    return name;
}
