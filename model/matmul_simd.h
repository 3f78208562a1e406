/*
 * matmul_simd.h - small register helpers shared by the matrix-product
 * kernel files (matmul.c, matmul_k.c, matmul_pack.c, matmul_bf16.c,
 * matmul_amx.c, compiled once per kernel level, see
 * cpu/kernel.h). Include it after cpu/kernel.h; it is empty in the scalar
 * copy, so only code under KERN_SIMD may use it.
 */
#ifndef KVD_MATMUL_SIMD_H
#define KVD_MATMUL_SIMD_H

#include "cpu/kernel.h"

#define INLINE static inline __attribute__((always_inline))

#ifdef KERN_SIMD
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* An f16 (a block or super-block scale) at any alignment, in 8 f32 lanes. */
INLINE __m256 f16_bcast(const uint8_t *p)
{
    short h;
    memcpy(&h, p, 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(h));
}

/* Decoding: the cache lines holding bytes [p, p + n), dist bytes further
 * on, asked for into L1 (prefetcht0): how far ahead each kernel asks, and
 * why, is in matmul_pack.c's "Decoding" and matmul_k.c's K_PREFETCH. A
 * prefetch never faults, past the end of a mapping too. */
INLINE void prefetch_ahead(const uint8_t *p, size_t n, size_t dist)
{
    const uintptr_t end = (uintptr_t)p + n;
    for (uintptr_t l = (uintptr_t)p & ~(uintptr_t)63; l < end; l += 64)
        _mm_prefetch((const char *)(l + dist), _MM_HINT_T0);
}

/* The same for bytes [off, off + n) of each pair of row groups from pq[0]
 * that a repacked tile of mg groups reads (matmul_internal.h's layouts). */
INLINE void prefetch_pairs(const uint8_t *const *pq, int mg, size_t off, size_t n, size_t dist)
{
    for (int h = 0; h < (mg + 1) / 2; h++)
        prefetch_ahead(pq[h] + off, n, dist);
}

/* The sum of 8 f32 lanes, in one fixed order. */
INLINE float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#ifdef KERN_AVX512
/* 16 floats rounded to bf16 to nearest even (NaN kept quiet), in the low
 * halves of 16 32-bit lanes: qt_f32_to_bf16's bits. */
INLINE __m512i round16(__m512 f)
{
    const __m512i u = _mm512_castps_si512(f);
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                            _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(
        nan, r, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
#endif

#endif /* KVD_MATMUL_SIMD_H */
