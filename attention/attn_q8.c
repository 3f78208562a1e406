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
 *   avx2         the levels as one 16-bit query a16 = 254 a1 + a2 (at
 *                most 32385: it fits), made once per row by
 *                attn_q8_query, times k widened to 16 bits by vpmaddwd:
 *                J in one product per half block. Four keys' partial
 *                sums are reduced in one transposing pass;
 *   scalar       the same integers in plain C.
 *
 * The AVX2 path was vpmaddubsw on each level (|a| times k carrying a's
 * sign), both levels signed against every key, J = 254 j1 + j2 by an
 * integer multiply, a sum across lanes per key and row, and the scales
 * widened in C. Its single-level products took 57% of a 16k-token decode
 * layer's time over q8_0 K/V with ALiBi (bench_decode 16384 profile alibi
 * q8_0, one thread), its values' dequantising a further 15%. On a Zen 3
 * EPYC (AVX2 only) the form here with decode's own tile (attn.c,
 * "decode_q8_scores") took that layer from 1976-1984 to 1504-1529 us on
 * one thread and from 1176-1184 to 794-806 us on two (the call reading
 * the next layer each time); `kvd generate --fill 16384` of a 576x30
 * ALiBi model with q8_0 K/V went from 22.8-23.1 to 31.8-32.8 tokens/s.
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
            out->a16[b * ATTN_QK + i] = (int16_t)(254 * a1 + a2); /* |.| <= 32385 */
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
 * AVX2: the two levels as one 16-bit query, vpmaddwd per half block
 * ------------------------------------------------------------------------ */

#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/*
 * One key's score against the 16-bit query a (nb blocks, scales dq) as 8
 * partial sums. Per block, each lane's four products a k (at most
 * 4 x 32385 x 128 < 2^24) are an exact integer, and so is their f32; then
 * acc += J * (d_k * d_q), the block's scales multiplied in f32 as the
 * other paths do (d_k widened by F16C, exactly as attn_block_scale).
 */
AVX2_TARGET static inline __m256 key_lanes(const int16_t *a, const float *dq, const uint8_t *k,
                                           int nb)
{
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *blk = k + (size_t)b * ATTN_Q8_0_BYTES;
        const int16_t *ab = a + b * ATTN_QK;
        const __m256i k0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 2)));
        const __m256i k1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 18)));
        const __m256i j =
            _mm256_add_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)ab), k0),
                             _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(ab + 16)), k1));
        uint16_t h;
        memcpy(&h, blk, 2); /* little-endian, as attn_block_scale reads it */
        const __m256 sc =
            _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)h)), _mm256_set1_ps(dq[b]));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(j), sc, acc);
    }
    return acc;
}

/*
 * The 8 lanes l of each of v[0..3] summed, each as ((l0 + l4) + (l2 + l6))
 * + ((l1 + l5) + (l3 + l7)) - a key's score is the same bits whichever
 * keys share its four - in one transposing pass where a sum per key took
 * six instructions.
 */
AVX2_TARGET static inline __m128 sum4(const __m256 v[4])
{
    /* m_k[i] = l_i + l_{i+4} of v[k]: [m0 | m1] and [m2 | m3] */
    const __m256 t01 = _mm256_add_ps(_mm256_permute2f128_ps(v[0], v[1], 0x20),
                                     _mm256_permute2f128_ps(v[0], v[1], 0x31));
    const __m256 t23 = _mm256_add_ps(_mm256_permute2f128_ps(v[2], v[3], 0x20),
                                     _mm256_permute2f128_ps(v[2], v[3], 0x31));
    /* per 128-bit lane (keys 0 and 2 low, 1 and 3 high): [m_0 m_2 ...], [m_1 m_3 ...] */
    const __m256 e = _mm256_shuffle_ps(t01, t23, 0x88), o = _mm256_shuffle_ps(t01, t23, 0xDD);
    /* s = [m0 + m2 of the first key, of the second, m1 + m3 of the first, of the second] */
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(e, o, 0x88), _mm256_shuffle_ps(e, o, 0xDD));
    const __m256 f = _mm256_add_ps(s, _mm256_permute_ps(s, 0x4E));
    /* f: keys 0 and 2 in lanes 0 and 1, keys 1 and 3 in lanes 4 and 5 */
    return _mm_unpacklo_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
}

AVX2_TARGET static void qk_q8_avx2(float *S, const struct attn_q8row *q, int nrows,
                                   const void *const *kp, int nt, int D)
{
    const int nb = D / ATTN_QK;
    for (int r = 0; r < nrows; r++) {
        const int16_t *a = q[r].a16;
        float *s = S + (size_t)r * ATTN_TILE;
        for (int t0 = 0; t0 < nt; t0 += 4) {
            __m256 acc[4];
            for (int i = 0; i < 4; i++) /* past nt: the last key again, not stored */
                acc[i] = key_lanes(a, q[r].d, kp[t0 + i < nt ? t0 + i : nt - 1], nb);
            float four[4];
            _mm_storeu_ps(four, sum4(acc));
            memcpy(s + t0, four, sizeof(float) * (size_t)(nt - t0 < 4 ? nt - t0 : 4));
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
