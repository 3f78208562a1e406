/*
 * attn_simd.c - the SIMD tile operations of the fused attention kernel.
 *
 * One implementation written against a thin vector layer (vf, VL lanes)
 * that is either AVX-512 (16 lanes; F, BW, VL, DQ) or AVX2 + FMA + F16C
 * (8 lanes). The Makefile compiles this file once per kernel level
 * (cpu/kernel.h); the avx512 and avx2 copies each export their table
 * (attn_simd_avx512, attn_simd_avx2), attn_kernels.c picks one by
 * cpu_level(), and the scalar copy compiles to nothing: that level uses the
 * scalar table (attn_scalar.c).
 *
 * The central trick is in qk: a block of RB query rows x KB keys with
 * RB * KB = VL is accumulated in VL vector registers over head_dim, then
 * reduced with one transposing add tree into a single vector holding the
 * VL dot products - no horizontal sum per dot. That serves a few rows
 * (decode); for many rows (prefill) the tile's keys are staged transposed
 * (VL x VL register transposes), and qk_t computes rows x 64 keys as a
 * register-blocked product of broadcast query elements and key rows (6 x 4
 * accumulators at AVX-512), with no reduction at all. P.V keeps a block of
 * 6 rows x NV vectors of the output in registers while it streams the
 * tile's values: for few rows 16-bit ones converted as they are loaded
 * (f16 and bf16 become f32 in registers: vcvtph2ps; a 16-bit shift), for
 * the flash tile widened once beforehand (dequant, attn.c's head_values).
 */
#include "attention_internal.h"
#include "cpu/kernel.h"

#include <math.h>

#if defined(KERN_AVX512)
#define SIMD_AVX512 1
#elif defined(KERN_AVX2)
#define SIMD_AVX2 1
#endif

#if defined(SIMD_AVX512) || defined(SIMD_AVX2)

#include <immintrin.h>

#define INLINE static inline __attribute__((always_inline))

/* ------------------------------------------------------------------------
 * Vector layer
 * ------------------------------------------------------------------------ */

#ifdef SIMD_AVX512

#define VL 16
#define PV_NV 4  /* output vectors per row kept in registers by pv */
#define PV_RB 6  /* rows per pv block: 6 x 4 accumulators, 4 values, a broadcast */
#define PV_NV3 4 /* output vectors per row for up to 3 rows (a GQA group of 3) */
typedef __m512 vf;

INLINE __mmask16 lanes(int n)
{
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n > 0 ? n : 0)) - 1u);
}
/* clang-format off */
INLINE vf vzero(void) { return _mm512_setzero_ps(); }
INLINE vf vset1(float x) { return _mm512_set1_ps(x); }
INLINE vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
INLINE vf vfnma(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a*b */
INLINE float vhsum(vf a) { return _mm512_reduce_add_ps(a); }
INLINE float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
/* clang-format on */

INLINE vf vload(const float *p)
{
    return _mm512_loadu_ps(p);
}
INLINE vf vload_n(const float *p, int n)
{
    return n >= VL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes(n), p);
}
INLINE void vstore(float *p, vf x)
{
    _mm512_storeu_ps(p, x);
}
INLINE void vstore_n(float *p, vf x, int n)
{
    if (n >= VL)
        _mm512_storeu_ps(p, x);
    else
        _mm512_mask_storeu_ps(p, lanes(n), x);
}
INLINE vf vload_h_n(const uint16_t *p, int n)
{
    __m256i h =
        n >= VL ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(lanes(n), p);
    return _mm512_cvtph_ps(h);
}
INLINE vf vload_b_n(const uint16_t *p, int n)
{
    __m256i h =
        n >= VL ? _mm256_loadu_si256((const __m256i *)p) : _mm256_maskz_loadu_epi16(lanes(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* even and odd elements of the 2*VL elements a:b */
INLINE void vdeinterleave(vf a, vf b, vf *even, vf *odd)
{
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}

/* Natural order costs what SHUF8 does here (one two-source permute per half). */
#define SHUF8_PAIRS false

/* The same pairs in ATTN_PAIRS_SHUF8's slots (attn_pair_at's order in each group of 8). */
INLINE void vdeinterleave_shuf8(vf a, vf b, vf *even, vf *odd)
{
    const __m512i ie = _mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 16, 18, 24, 26, 20, 22, 28, 30);
    const __m512i io = _mm512_setr_epi32(1, 3, 9, 11, 5, 7, 13, 15, 17, 19, 25, 27, 21, 23, 29, 31);
    *even = _mm512_permutex2var_ps(a, ie, b);
    *odd = _mm512_permutex2var_ps(a, io, b);
}

/*
 * Lane o of the result = the sum of all lanes of a[o]. A transposing add
 * tree (45 instructions for 16 dots). The tree leaves sums in lane order
 * 4j + c for input 4c + j, so the inputs are taken in that order.
 */
INLINE vf vreduce(const vf *a)
{
    vf b[16], t[8], u[4];
    for (int i = 0; i < 16; i++)
        b[i] = a[(i % 4) * 4 + i / 4];
    for (int p = 0; p < 8; p++)
        t[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0x44),
                             _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], 0xEE));
    for (int q = 0; q < 4; q++)
        u[q] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0x88),
                             _mm512_shuffle_f32x4(t[2 * q], t[2 * q + 1], 0xDD));
    vf w0 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
    vf w1 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
    return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, 0x44), _mm512_shuffle_ps(w0, w1, 0xEE));
}

/* Transpose 16 rows of 16 (in place): unpack pairs of rows, shuffle quads, then two
 * rounds of 128-bit lane exchanges put column c in r[c]. */
INLINE void vtranspose(vf *r)
{
    vf t[16], u[16], v[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int j = 0; j < 4; j++) { /* u[4j + k], lane L: column 4L + k of rows 4j..4j+3 */
        u[4 * j] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
        u[4 * j + 1] = _mm512_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
        u[4 * j + 2] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
        u[4 * j + 3] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        v[k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
        v[k + 4] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        v[k + 8] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        v[k + 12] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm512_shuffle_f32x4(v[k], v[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(v[k], v[k + 8], 0xDD);
        r[k + 4] = _mm512_shuffle_f32x4(v[k + 4], v[k + 12], 0x88);
        r[k + 12] = _mm512_shuffle_f32x4(v[k + 4], v[k + 12], 0xDD);
    }
}

/* round to the nearest integer; p * 2^n for integral n (>= -126) */
INLINE vf vround(vf x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
INLINE vf vscale2(vf p, vf n)
{
    return _mm512_scalef_ps(p, n);
}

/*
 * Score bias and visibility for lanes t0.. of a tile: returns x + bias,
 * with -inf where the key is masked (pos_k > pos_q or t >= nt).
 */
INLINE vf vbias_mask(vf x, const int32_t *kpos, int t0, int nt, int32_t pos_q,
                     const struct attn_bias *b)
{
    __m512i kp = _mm512_loadu_si512((const void *)(kpos + t0));
    __m512i pq = _mm512_set1_epi32(pos_q);
    __mmask16 vis = _mm512_cmple_epi32_mask(kp, pq) & lanes(nt - t0);
    if (b->window)
        vis &= _mm512_cmpgt_epi32_mask(kp, _mm512_set1_epi32(attn_window_floor(pos_q, b->window)));
    if (b->kind == POS_ALIBI) {
        vf dist = _mm512_cvtepi32_ps(_mm512_sub_epi32(kp, pq));
        x = _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(b->slope), dist));
    } else if (b->kind == POS_T5) {
        __m512i d = _mm512_max_epi32(_mm512_sub_epi32(pq, kp), _mm512_setzero_si512());
        d = _mm512_min_epi32(d, _mm512_set1_epi32(b->t5_n));
        x = _mm512_add_ps(x, _mm512_i32gather_ps(d, b->t5, 4));
    }
    return _mm512_mask_blend_ps(vis, _mm512_set1_ps(-INFINITY), x);
}

/* p where x > -inf, else 0 */
INLINE vf vkeep_finite(vf x, vf p)
{
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(live, p);
}

static const char simd_name[] = "avx512";

#else /* SIMD_AVX2 */

#define VL 8
#define PV_NV 2
#define PV_RB 6  /* 6 x 2 accumulators, 2 values, a broadcast in 16 registers */
#define PV_NV3 4 /* up to 3 rows: 3 x 4 accumulators, 3 broadcasts, a value */
typedef __m256 vf;

INLINE __m256i lanes_i(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* clang-format off */
INLINE vf vzero(void) { return _mm256_setzero_ps(); }
INLINE vf vset1(float x) { return _mm256_set1_ps(x); }
INLINE vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
INLINE vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
INLINE vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
INLINE vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
INLINE vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
INLINE vf vfnma(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
/* clang-format on */
INLINE float vhsum(vf a)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
INLINE float vhmax(vf a)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

INLINE vf vload(const float *p)
{
    return _mm256_loadu_ps(p);
}
INLINE vf vload_n(const float *p, int n)
{
    return n >= VL ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes_i(n));
}
INLINE void vstore(float *p, vf x)
{
    _mm256_storeu_ps(p, x);
}
INLINE void vstore_n(float *p, vf x, int n)
{
    if (n >= VL)
        _mm256_storeu_ps(p, x);
    else
        _mm256_maskstore_ps(p, lanes_i(n), x);
}
/* 16-bit tails go through a zeroed buffer: they occur only for odd head sizes. */
INLINE __m128i load_u16_n(const uint16_t *p, int n)
{
    if (n >= VL)
        return _mm_loadu_si128((const __m128i *)p);
    uint16_t buf[8] = {0};
    if (n > 0)
        memcpy(buf, p, sizeof(uint16_t) * (size_t)n);
    return _mm_loadu_si128((const __m128i *)buf);
}
INLINE vf vload_h_n(const uint16_t *p, int n)
{
    return _mm256_cvtph_ps(load_u16_n(p, n));
}
INLINE vf vload_b_n(const uint16_t *p, int n)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_u16_n(p, n)), 16));
}

/* Even and odd elements of a:b: each 128-bit lane's shuffle, then a lane-crossing permute. */
INLINE void vdeinterleave(vf a, vf b, vf *even, vf *odd)
{
    *even = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *odd = _mm256_castpd_ps(
        _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* Adjacent pairs are de-interleaved without the permutes where the layout allows. */
#define SHUF8_PAIRS true

/* The shuffles alone: pairs 0 1 4 5 2 3 6 7, ATTN_PAIRS_SHUF8's slots. */
INLINE void vdeinterleave_shuf8(vf a, vf b, vf *even, vf *odd)
{
    *even = _mm256_shuffle_ps(a, b, 0x88);
    *odd = _mm256_shuffle_ps(a, b, 0xDD);
}

/* Lane o = sum of a[o]; the tree leaves input 2c + j in lane 4j + c. */
INLINE vf vreduce(const vf *a)
{
    vf b[8], t[4];
    for (int i = 0; i < 8; i++)
        b[i] = a[(i % 2) * 4 + i / 2];
    for (int p = 0; p < 4; p++)
        t[p] = _mm256_add_ps(_mm256_permute2f128_ps(b[2 * p], b[2 * p + 1], 0x20),
                             _mm256_permute2f128_ps(b[2 * p], b[2 * p + 1], 0x31));
    vf w0 = _mm256_add_ps(_mm256_unpacklo_ps(t[0], t[1]), _mm256_unpackhi_ps(t[0], t[1]));
    vf w1 = _mm256_add_ps(_mm256_unpacklo_ps(t[2], t[3]), _mm256_unpackhi_ps(t[2], t[3]));
    return _mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x44), _mm256_shuffle_ps(w0, w1, 0xEE));
}

/* Transpose 8 rows of 8 (in place), as the AVX-512 version with one lane exchange. */
INLINE void vtranspose(vf *r)
{
    vf t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int j = 0; j < 2; j++) {
        u[4 * j] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0x44);
        u[4 * j + 1] = _mm256_shuffle_ps(t[4 * j], t[4 * j + 2], 0xEE);
        u[4 * j + 2] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0x44);
        u[4 * j + 3] = _mm256_shuffle_ps(t[4 * j + 1], t[4 * j + 3], 0xEE);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[k + 4] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}

INLINE vf vround(vf x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n built in the exponent field: n >= -126 gives a normal number */
INLINE vf vscale2(vf p, vf n)
{
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

INLINE vf vbias_mask(vf x, const int32_t *kpos, int t0, int nt, int32_t pos_q,
                     const struct attn_bias *b)
{
    __m256i kp = _mm256_loadu_si256((const __m256i *)(kpos + t0));
    __m256i pq = _mm256_set1_epi32(pos_q);
    __m256i hidden = _mm256_or_si256(_mm256_cmpgt_epi32(kp, pq),
                                     _mm256_xor_si256(lanes_i(nt - t0), _mm256_set1_epi32(-1)));
    if (b->window) {
        __m256i lo = _mm256_set1_epi32(attn_window_floor(pos_q, b->window));
        hidden = _mm256_or_si256(hidden, _mm256_xor_si256(_mm256_cmpgt_epi32(kp, lo),
                                                          _mm256_set1_epi32(-1)));
    }
    if (b->kind == POS_ALIBI) {
        vf dist = _mm256_cvtepi32_ps(_mm256_sub_epi32(kp, pq));
        x = _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(b->slope), dist));
    } else if (b->kind == POS_T5) {
        __m256i d = _mm256_max_epi32(_mm256_sub_epi32(pq, kp), _mm256_setzero_si256());
        d = _mm256_min_epi32(d, _mm256_set1_epi32(b->t5_n));
        x = _mm256_add_ps(x, _mm256_i32gather_ps(b->t5, d, 4));
    }
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(hidden));
}

INLINE vf vkeep_finite(vf x, vf p)
{
    vf live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    return _mm256_and_ps(live, p);
}

static const char simd_name[] = "avx2";

#endif

/*
 * exp(x) for x <= 0 (softmax arguments) as 2^y, y = x * log2(e): n = round(y),
 * f = y - n in [-1/2, 1/2] (exact), 2^f by a degree-5 polynomial (Chebyshev
 * nodes: within 2.3e-7 of 2^f in f32 arithmetic), 2^n by scaling. Rounding y
 * costs x * 2^-24 relative, 1e-6 at the x = -14 where a probability drops
 * below 1e-6 of the row's largest. 10 operations, where a two-constant
 * reduction of x and a degree-7 polynomial take 14; the exponential is most
 * of a prefill tile's softmax. x is clamped to -87.3 first (n >= -126, as
 * vscale2 needs; -inf too): masked lanes are zeroed by the caller
 * (vkeep_finite).
 */
/* 2^f ~ sum C_i f^i on [-1/2, 1/2] */
#define EXP2_C5 1.3390863314e-3f
#define EXP2_C4 9.6760317683e-3f
#define EXP2_C3 5.5503569543e-2f
#define EXP2_C2 2.4022106826e-1f
#define EXP2_C1 6.9314718246e-1f
#define EXP2_C0 1.0000001192f
INLINE vf vexp(vf x)
{
    vf y = vmul(vmax(x, vset1(-87.3f)), vset1(1.44269504088896341f));
    vf n = vround(y);
    vf f = vsub(y, n);
    vf p = vfma(vset1(EXP2_C5), f, vset1(EXP2_C4));
    p = vfma(p, f, vset1(EXP2_C3));
    p = vfma(p, f, vset1(EXP2_C2));
    p = vfma(p, f, vset1(EXP2_C1));
    p = vfma(p, f, vset1(EXP2_C0));
    return vscale2(p, n);
}

/* VL int8 values as f32. */
INLINE vf vload_i8(const int8_t *p)
{
#ifdef SIMD_AVX512
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#endif
}

/* A block's f16 scale, as f32 in every lane. */
INLINE vf vblock_scale(const uint8_t *blk)
{
    uint16_t h;
    memcpy(&h, blk, sizeof(h));
#ifdef SIMD_AVX512
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
#else
    return _mm256_cvtph_ps(_mm_set1_epi16((short)h));
#endif
}

/*
 * n elements of a q8_0 row from element off, dequantised in registers:
 * the same products (scale x level, one rounding) dequant_block stores, so
 * a tile read this way gives what a dequantised copy gives. Lanes within
 * one block take one load; others (partial rotation, odd offsets) go
 * element by element.
 */
INLINE vf vload_q8_n(const uint8_t *row, int off, int n)
{
    if (n == VL && off % VL == 0) {
        const uint8_t *blk = row + (size_t)(off / ATTN_QK) * ATTN_Q8_0_BYTES;
        return vmul(vblock_scale(blk), vload_i8((const int8_t *)blk + 2 + off % ATTN_QK));
    }
    float buf[VL];
    for (int i = 0; i < n; i++)
        buf[i] = attn_load(row, off + i, ATTN_Q8_0);
    return vload_n(buf, n);
}

/*
 * Whether elements [off, off + len) of a row of type T are q8_0 in one
 * block, read as whole vectors (n = VL lanes in the last), so that a
 * caller can take the block's scale once for them. AVX2 only: the AVX-512
 * kernels, measured on their machines, keep vload_q8_n's scale per vector.
 */
INLINE bool q8_one_block(enum attn_type T, int off, int len, int n)
{
#ifdef SIMD_AVX512
    (void)T, (void)off, (void)len, (void)n;
    return false;
#else
    return T == ATTN_Q8_0 && n == VL && off / ATTN_QK == (off + len - 1) / ATTN_QK;
#endif
}

/* n elements (n <= VL) of a K/V row of type T from element offset off, as f32 */
INLINE vf vload_t(const void *row, int off, enum attn_type T, int n)
{
    switch (T) {
    case ATTN_F16:
        return vload_h_n((const uint16_t *)row + off, n);
    case ATTN_BF16:
        return vload_b_n((const uint16_t *)row + off, n);
    case ATTN_Q8_0: /* the few-row operations read q8_0 as stored (attn.c's decode_head) */
        return vload_q8_n(row, off, n);
    case ATTN_F32:
    case ATTN_Q4_0: /* dequantised to f32 rows before any tile operation */
        break;
    }
    return vload_n((const float *)row + off, n);
}

/* ------------------------------------------------------------------------
 * Scores: S = Q K^T for a tile
 * ------------------------------------------------------------------------ */

/* Rows r0.. (RB of them, the first nr stored) x keys t0..t0+KB-1, RB * KB == VL. */
INLINE void qk_block(float *S, const float *const *q, const void *const *kp, int t0,
                     enum attn_type T, int D, const int RB, const int KB, int nr)
{
    vf acc[VL];
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++)
        acc[i] = vzero();
    int d = 0;
    for (; d + VL <= D; d += VL) {
#pragma GCC unroll 16
        for (int kb = 0; kb < KB; kb++) {
            vf k = vload_t(kp[t0 + kb], d, T, VL);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++)
                acc[r * KB + kb] = vfma(vload(q[r] + d), k, acc[r * KB + kb]);
        }
    }
    if (d < D) {
        int n = D - d;
#pragma GCC unroll 16
        for (int kb = 0; kb < KB; kb++) {
            vf k = vload_t(kp[t0 + kb], d, T, n);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++)
                acc[r * KB + kb] = vfma(vload_n(q[r] + d, n), k, acc[r * KB + kb]);
        }
    }
    float dots[VL];
    vstore(dots, vreduce(acc));
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
        if (r < nr)
            memcpy(S + (size_t)r * ATTN_TILE + t0, dots + r * KB, sizeof(float) * (size_t)KB);
}

/*
 * Request the K lines of keys [t0, t1) in pf (those it has), as qk scores
 * keys t0..t1-1 of its own head; pv asks for the same keys' V lines as it
 * walks its own keys (prefetch_v) - or, at AVX2, qk asks for both (below).
 * The hint is T1 (into L2, not L1): on the AVX-512 EPYC that was measured,
 * requests into L1 fill the core's few L1 miss buffers, and the loop
 * stalls on its own prefetches (25-40% of qk's samples fell on them); into
 * L2 the same requests cost a 16k-token layer ~0.75x the time on one
 * thread (bench_decode, alternated in one process). The rows come from L2
 * when the loop reaches them a head later.
 *
 * Why K here and V in pv at AVX-512: asked for together in qk, a tile's K
 * and V lines (four per key at head dim 64) still crowded the miss buffers
 * - a quarter of qk's samples fell on the V requests - while pv, a third
 * of the work, asked for none. Spread over both loops the same requests
 * cost a 16k layer 2-4% less with f16 K/V and 5-7% less with q8_0
 * (bench_decode's rows, alternated in one process, 1 and 2 threads, 16k
 * and 64k). On an AMX Xeon T1 was still the best hint, with T2 (attn.c's
 * "Decode at long context" has those figures).
 *
 * Why both in qk at AVX2 (PF_V_IN_QK): on the Zen 3 EPYC measured (AVX2
 * only), the split left pv waiting for its values - half of pv's samples
 * on the first product after a value load, pv a third of a cold call
 * against a fifth of a hot one - while qk's keys had arrived. Asked for
 * with the keys, a 4k-token layer took 0.80x the time on 2 threads (205 ->
 * 165 us), 16k 0.70x and 32k 0.70x (bench_decode, f16; q8_0 0.79x and
 * 0.77x), and the hot call (K/V in the caches) did not change. The level
 * stands for the machine here: each choice is the one measured on the
 * machines that had that level.
 */
#ifdef SIMD_AVX512
#define PF_V_IN_QK 0
#else
#define PF_V_IN_QK 1
#endif

/* Key t's n lines from p, T1; rows of up to 128 bytes need no inner loop. */
INLINE void prefetch_row(const char *p, int lines)
{
    if (lines <= 2) {
        _mm_prefetch(p, _MM_HINT_T1);
        _mm_prefetch(p + (lines > 1 ? 64 : 0), _MM_HINT_T1);
        return;
    }
    for (int l = 0; l < lines; l++)
        _mm_prefetch(p + 64 * l, _MM_HINT_T1);
}

INLINE void prefetch_k(const struct attn_prefetch *pf, int t0, int t1)
{
    if (!pf)
        return;
    t1 = t1 < pf->n ? t1 : pf->n;
    for (int t = t0; t < t1; t++) {
        prefetch_row(pf->k + pf->koff[t], pf->klines);
        if (PF_V_IN_QK)
            prefetch_row(pf->v + pf->voff[t], pf->vlines);
    }
}

/* Key t's V lines in pf (when it has key t), as pv reaches its own key t. */
INLINE void prefetch_v(const struct attn_prefetch *pf, int t)
{
    if (!PF_V_IN_QK && pf && t < pf->n)
        prefetch_row(pf->v + pf->voff[t], pf->vlines);
}

/*
 * Key chunks of VL outer, row blocks inner; the first row block asks for
 * its keys' lines a key block at a time. Asked for per chunk of VL keys (8
 * keys' K and V lines at once at AVX2), the requests stalled each other: a
 * 16k-token ALiBi layer over f16 K/V took 674-688 us on 2 threads against
 * 574-580 spread out (bench_decode 16384 profile alibi cold, Zen 3), and
 * the 3-row block paid for the requests' instructions in the hot call
 * (958 us either way).
 */
INLINE void qk_typed(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                     enum attn_type T, int D, const struct attn_prefetch *pf)
{
    for (int c0 = 0; c0 < nt; c0 += VL) {
        int r = 0;
        if (nrows < 3) /* else the first 4-row block asks, a key block at a time */
            prefetch_k(pf, c0, c0 + VL);
        for (; r + 3 <= nrows; r += 4) {
            /* three rows (a GQA group of 3) take a 3-row block: each key is
             * loaded once, not twice, and its 4-row block's scores come out */
            const bool three = nrows - r == 3;
            for (int t0 = c0; t0 < c0 + VL && t0 < nt; t0 += VL / 4) {
                if (r == 0)
                    prefetch_k(pf, t0, t0 + VL / 4);
                if (three)
                    qk_block(S + (size_t)r * ATTN_TILE, q + r, kp, t0, T, D, 3, VL / 4, 3);
                else
                    qk_block(S + (size_t)r * ATTN_TILE, q + r, kp, t0, T, D, 4, VL / 4, 4);
            }
        }
        for (; r + 2 <= nrows; r += 2)
            for (int t0 = c0; t0 < c0 + VL && t0 < nt; t0 += VL / 2)
                qk_block(S + (size_t)r * ATTN_TILE, q + r, kp, t0, T, D, 2, VL / 2, 2);
        for (; r < nrows; r++)
            qk_block(S + (size_t)r * ATTN_TILE, q + r, kp, c0, T, D, 1, VL, 1);
    }
}

INLINE void qk_types(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                     enum attn_type type, int D, const struct attn_prefetch *pf)
{
    switch (type) {
    case ATTN_F32:
        qk_typed(S, q, nrows, kp, nt, ATTN_F32, D, pf);
        break;
    case ATTN_F16:
        qk_typed(S, q, nrows, kp, nt, ATTN_F16, D, pf);
        break;
    case ATTN_BF16:
        qk_typed(S, q, nrows, kp, nt, ATTN_BF16, D, pf);
        break;
    case ATTN_Q8_0:
        qk_typed(S, q, nrows, kp, nt, ATTN_Q8_0, D, pf);
        break;
    case ATTN_Q4_0: /* dequantised by the caller (attn.c) */
        break;
    }
}

/* Head sizes of 64 and 128 get their own copies: with D a constant the
 * loops unroll fully and no lane mask or tail test is left in them. */
static void qk_simd(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                    enum attn_type type, int D, const struct attn_prefetch *pf)
{
    if (D == 64)
        qk_types(S, q, nrows, kp, nt, type, 64, pf);
    else if (D == 128)
        qk_types(S, q, nrows, kp, nt, type, 128, pf);
    else
        qk_types(S, q, nrows, kp, nt, type, D, pf);
}

/* ------------------------------------------------------------------------
 * Scores with keys rotated in registers (RoPE, few rows)
 * ------------------------------------------------------------------------ */

/* The low and high halves of slots i..i+n-1 of a key's pairs, laid out as m says. */
INLINE void load_pairs(const void *k, int i, int half, int n, enum attn_pairs m, enum attn_type T,
                       vf *lo, vf *hi)
{
    if (m == ATTN_PAIRS_NEOX) {
        *lo = vload_t(k, i, T, n);
        *hi = vload_t(k, half + i, T, n);
        return;
    }
    vf a = vload_t(k, 2 * i, T, 2 * n < VL ? 2 * n : VL);
    vf b = vload_t(k, 2 * i + VL, T, 2 * n - VL);
    if (m == ATTN_PAIRS_SHUF8) /* whole groups of 8 pairs: half is a multiple of 8 */
        vdeinterleave_shuf8(a, b, lo, hi);
    else
        vdeinterleave(a, b, lo, hi);
}

INLINE void qk_rope_block(float *S, const float *const *q, const void *const *kp, int t0,
                          enum attn_type T, int D, int rot, enum attn_pairs m, const float *cs,
                          const float *sn, int ld, const int RB, const int KB, int nr)
{
    const int half = rot / 2;
    vf acc[VL];
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++)
        acc[i] = vzero();
    for (int i = 0; i < half; i += VL) {
        int n = half - i < VL ? half - i : VL;
#pragma GCC unroll 16
        for (int kb = 0; kb < KB; kb++) {
            vf lo, hi;
            load_pairs(kp[t0 + kb], i, half, n, m, T, &lo, &hi);
            const size_t row = (size_t)(t0 + kb) * ld + i;
            vf c = vload_n(cs + row, n), s = vload_n(sn + row, n);
            vf rlo = vfnma(hi, s, vmul(lo, c)), rhi = vfma(lo, s, vmul(hi, c));
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++) {
                acc[r * KB + kb] = vfma(vload_n(q[r] + i, n), rlo, acc[r * KB + kb]);
                acc[r * KB + kb] = vfma(vload_n(q[r] + half + i, n), rhi, acc[r * KB + kb]);
            }
        }
    }
    for (int d = rot; d < D; d += VL) {
        int n = D - d < VL ? D - d : VL;
#pragma GCC unroll 16
        for (int kb = 0; kb < KB; kb++) {
            vf k = vload_t(kp[t0 + kb], d, T, n);
#pragma GCC unroll 4
            for (int r = 0; r < RB; r++)
                acc[r * KB + kb] = vfma(vload_n(q[r] + d, n), k, acc[r * KB + kb]);
        }
    }
    float dots[VL];
    vstore(dots, vreduce(acc));
#pragma GCC unroll 4
    for (int r = 0; r < RB; r++)
        if (r < nr)
            memcpy(S + (size_t)r * ATTN_TILE + t0, dots + r * KB, sizeof(float) * (size_t)KB);
}

/* Heads up to this size take the three-row path, their queries in registers. */
#define QK3_DMAX 128
#define QK3_KB (VL / 4) /* keys per block: 3 x 4 accumulators at AVX-512, 3 x 2 at AVX2 */

/*
 * Three rows (a GQA group of 3: one decode query's heads that share a KV
 * head) x QK3_KB keys from t0, every element of the head rotated. The
 * rows' queries come in registers (qv, loaded once per tile); each key is
 * loaded, converted and rotated once for the three rows, and the 3 x KB
 * dots fill 3/4 of the reduction's lanes - where the 4-row block repeated
 * a row, a quarter of the products went to it. The products and their
 * order are those of qk_rope_block, so the scores are the same bits.
 */
INLINE void qk3_rope_block(float *S, const vf qv[3][QK3_DMAX / VL], const void *const *kp, int t0,
                           enum attn_type T, int D, enum attn_pairs m, const float *cs,
                           const float *sn, int ld)
{
    const int half = D / 2, KB = QK3_KB;
    vf acc[VL];
#pragma GCC unroll 16
    for (int i = 0; i < VL; i++)
        acc[i] = vzero();
#pragma GCC unroll 8
    for (int i = 0; i < half; i += VL) {
#pragma GCC unroll 8
        for (int kb = 0; kb < KB; kb++) {
            vf lo, hi;
            load_pairs(kp[t0 + kb], i, half, VL, m, T, &lo, &hi);
            const size_t row = (size_t)(t0 + kb) * ld + i;
            vf c = vload(cs + row), s = vload(sn + row);
            vf rlo = vfnma(hi, s, vmul(lo, c)), rhi = vfma(lo, s, vmul(hi, c));
#pragma GCC unroll 3
            for (int r = 0; r < 3; r++) {
                acc[r * KB + kb] = vfma(qv[r][i / VL], rlo, acc[r * KB + kb]);
                acc[r * KB + kb] = vfma(qv[r][(half + i) / VL], rhi, acc[r * KB + kb]);
            }
        }
    }
    float dots[VL];
    vstore(dots, vreduce(acc));
#pragma GCC unroll 3
    for (int r = 0; r < 3; r++)
        memcpy(S + (size_t)r * ATTN_TILE + t0, dots + r * KB, sizeof(float) * (size_t)KB);
}

/* The tile for three rows (see qk3_rope_block): prefetches spread over its key blocks. */
INLINE void qk3_rope(float *S, const float *const *q, const void *const *kp, int nt,
                     enum attn_type T, int D, enum attn_pairs m, const float *cs, const float *sn,
                     int ld, const struct attn_prefetch *pf)
{
    vf qv[3][QK3_DMAX / VL];
#pragma GCC unroll 3
    for (int r = 0; r < 3; r++)
#pragma GCC unroll 16
        for (int j = 0; j < D / VL; j++)
            qv[r][j] = vload(q[r] + j * VL);
    for (int t0 = 0; t0 < nt; t0 += QK3_KB) {
        prefetch_k(pf, t0, t0 + QK3_KB);
        qk3_rope_block(S, qv, kp, t0, T, D, m, cs, sn, ld);
    }
}

INLINE void qk_rope_typed(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                          enum attn_type T, int D, int rot, enum attn_pairs m, const float *cs,
                          const float *sn, int ld, const struct attn_prefetch *pf)
{
    if (nrows == 3 && rot == D && D <= QK3_DMAX && (D / 2) % VL == 0) {
        qk3_rope(S, q, kp, nt, T, D, m, cs, sn, ld, pf);
        return;
    }
    for (int c0 = 0; c0 < nt; c0 += VL) {
        prefetch_k(pf, c0, c0 + VL);
        int r = 0;
        for (; r + 3 <= nrows; r += 4) {
            /* as in qk_typed: three rows in a 4-row block, so each key is
             * rotated once rather than once per 2-row and 1-row block */
            const float *q4[4] = {q[r], q[r + 1], q[r + 2], q[r + (nrows - r > 3 ? 3 : 2)]};
            int nr = nrows - r < 4 ? nrows - r : 4;
            for (int t0 = c0; t0 < c0 + VL && t0 < nt; t0 += VL / 4)
                qk_rope_block(S + (size_t)r * ATTN_TILE, q4, kp, t0, T, D, rot, m, cs, sn, ld, 4,
                              VL / 4, nr);
        }
        for (; r + 2 <= nrows; r += 2)
            for (int t0 = c0; t0 < c0 + VL && t0 < nt; t0 += VL / 2)
                qk_rope_block(S + (size_t)r * ATTN_TILE, q + r, kp, t0, T, D, rot, m, cs, sn, ld, 2,
                              VL / 2, 2);
        for (; r < nrows; r++)
            qk_rope_block(S + (size_t)r * ATTN_TILE, q + r, kp, c0, T, D, rot, m, cs, sn, ld, 1, VL,
                          1);
    }
}

INLINE void qk_rope_types(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                          enum attn_type type, int D, int rot, enum attn_pairs m, const float *cs,
                          const float *sn, int ld, const struct attn_prefetch *pf)
{
    switch (type) {
    case ATTN_F32:
        qk_rope_typed(S, q, nrows, kp, nt, ATTN_F32, D, rot, m, cs, sn, ld, pf);
        break;
    case ATTN_F16:
        qk_rope_typed(S, q, nrows, kp, nt, ATTN_F16, D, rot, m, cs, sn, ld, pf);
        break;
    case ATTN_BF16:
        qk_rope_typed(S, q, nrows, kp, nt, ATTN_BF16, D, rot, m, cs, sn, ld, pf);
        break;
    case ATTN_Q8_0: /* read as stored (decode_head) */
        qk_rope_typed(S, q, nrows, kp, nt, ATTN_Q8_0, D, rot, m, cs, sn, ld, pf);
        break;
    case ATTN_Q4_0: /* dequantised by the caller (attn.c) */
        break;
    }
}

/* Whole heads of 64 and 128 rotated get their own copies, as in qk_simd. */
/* A whole head rotated (D = rot, ld = D/2): a copy per layout. */
INLINE void qk_rope_whole(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                          enum attn_type type, int D, enum attn_pairs m, const float *cs,
                          const float *sn, const struct attn_prefetch *pf)
{
    switch (m) {
    case ATTN_PAIRS_NEOX:
        qk_rope_types(S, q, nrows, kp, nt, type, D, D, ATTN_PAIRS_NEOX, cs, sn, D / 2, pf);
        break;
    case ATTN_PAIRS_ADJACENT:
        qk_rope_types(S, q, nrows, kp, nt, type, D, D, ATTN_PAIRS_ADJACENT, cs, sn, D / 2, pf);
        break;
    case ATTN_PAIRS_SHUF8:
        qk_rope_types(S, q, nrows, kp, nt, type, D, D, ATTN_PAIRS_SHUF8, cs, sn, D / 2, pf);
        break;
    }
}

static void qk_rope_simd(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                         enum attn_type type, int D, int rot, enum attn_pairs m, const float *cs,
                         const float *sn, int ld, const struct attn_prefetch *pf)
{
    if (D == 64 && rot == 64 && ld == 32)
        qk_rope_whole(S, q, nrows, kp, nt, type, 64, m, cs, sn, pf);
    else if (D == 128 && rot == 128 && ld == 64)
        qk_rope_whole(S, q, nrows, kp, nt, type, 128, m, cs, sn, pf);
    else
        qk_rope_types(S, q, nrows, kp, nt, type, D, rot, m, cs, sn, ld, pf);
}

/* ------------------------------------------------------------------------
 * Online softmax on one score row
 * ------------------------------------------------------------------------ */

/* Multiply acc[D] by alpha (the row's max grew). */
INLINE void rescale_acc(float *acc, int D, float alpha)
{
    vf va = vset1(alpha);
    for (int d = 0; d < D; d += VL) {
        int n = D - d < VL ? D - d : VL;
        vstore_n(acc + d, vmul(va, vload_n(acc + d, n)), n);
    }
}

/*
 * softmax_simd for a row with every key of a full tile visible and no bias
 * (kpos NULL): the scores stay in registers from the max to the
 * exponentials, and no lane is masked - the same bits as the masked path,
 * with about a third fewer operations per score.
 */
INLINE void softmax_visible(float *s, float *m, float *l, float *acc, int D)
{
    vf x[ATTN_TILE / VL];
    vf mx = x[0] = vload(s);
#pragma GCC unroll 8
    for (int i = 1; i < ATTN_TILE / VL; i++) {
        x[i] = vload(s + i * VL);
        mx = vmax(mx, x[i]);
    }
    float m_old = *m;
    float m_new = fmaxf(m_old, vhmax(mx));
    if (m_new > m_old) {
        float alpha = expf(m_old - m_new); /* 0 when m_old = -inf */
        *l *= alpha;
        rescale_acc(acc, D, alpha);
        *m = m_new;
    }
    vf vm = vset1(m_new), sum = vzero();
#pragma GCC unroll 8
    for (int i = 0; i < ATTN_TILE / VL; i++) {
        vf p = vexp(vsub(x[i], vm));
        vstore(s + i * VL, p);
        sum = vadd(sum, p);
    }
    *l += vhsum(sum);
}

static void softmax_simd(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                         const struct attn_bias *b, float *m, float *l, float *acc, int D)
{
    if (!kpos) {
        if (D == 64)
            softmax_visible(s, m, l, acc, 64);
        else
            softmax_visible(s, m, l, acc, D);
        return;
    }
    vf mx = vset1(-INFINITY);
    for (int t0 = 0; t0 < ATTN_TILE; t0 += VL) {
        vf x = vbias_mask(vload(s + t0), kpos, t0, nt, pos_q, b);
        vstore(s + t0, x);
        mx = vmax(mx, x);
    }
    float m_old = *m;
    float m_new = fmaxf(m_old, vhmax(mx));
    if (m_new == -INFINITY) { /* nothing visible yet */
        for (int t0 = 0; t0 < ATTN_TILE; t0 += VL)
            vstore(s + t0, vzero());
        return;
    }
    if (m_new > m_old) {
        float alpha = expf(m_old - m_new); /* 0 when m_old = -inf */
        *l *= alpha;
        rescale_acc(acc, D, alpha);
        *m = m_new;
    }
    vf vm = vset1(m_new), sum = vzero();
    for (int t0 = 0; t0 < ATTN_TILE; t0 += VL) {
        vf x = vload(s + t0);
        vf p = vkeep_finite(x, vexp(vsub(x, vm)));
        vstore(s + t0, p);
        sum = vadd(sum, p);
    }
    *l += vhsum(sum);
}

static void probs_simd(float *s, int nt, const int32_t *kpos, int32_t pos_q,
                       const struct attn_bias *b, float m, float inv_l)
{
    vf vm = vset1(m), vi = vset1(inv_l);
    for (int t0 = 0; t0 < ATTN_TILE; t0 += VL) {
        vf x = vbias_mask(vload(s + t0), kpos, t0, nt, pos_q, b);
        vstore(s + t0, vkeep_finite(x, vmul(vexp(vsub(x, vm)), vi)));
    }
}

/* ------------------------------------------------------------------------
 * Output: acc += P V
 * ------------------------------------------------------------------------ */

/*
 * pv_block for up to 3 rows over q8_0 values whose pass lies in one block
 * (q8_one_block): each key's block scale is folded into the rows'
 * probabilities first, (p d) x v, so the loop over the keys is the f16
 * one with int8 values widened - 3 broadcasts, and per value vector a
 * widening and 3 FMAs. With the scale taken per vector in the loop, 12
 * accumulators, 3 broadcasts, a scale and a value did not fit AVX2's 16
 * registers and GCC kept an accumulator on the stack (its load, FMA and
 * store took 60% of pv's samples).
 */
INLINE void pv_block_q8(float *acc, int D, const float *P, const void *const *vp, int nt, int d0,
                        const int RB, const int NV, const struct attn_prefetch *pf)
{
    const size_t boff = (size_t)(d0 / ATTN_QK) * ATTN_Q8_0_BYTES;
    float pd[3][ATTN_TILE];
    for (int t = 0; t < nt; t++) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)vp[t] + boff, sizeof(h));
        const float d = _cvtsh_ss(h); /* F16C, as attn_block_scale's value */
        for (int r = 0; r < RB; r++)
            pd[r][t] = P[(size_t)r * ATTN_TILE + t] * d;
    }
    vf a[3][PV_NV3];
#pragma GCC unroll 3
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            a[r][j] = vload(acc + (size_t)r * D + d0 + j * VL);
    for (int t = 0; t < nt; t++) {
        prefetch_v(pf, t);
        const int8_t *x = (const int8_t *)vp[t] + boff + 2 + d0 % ATTN_QK;
        vf p[3];
#pragma GCC unroll 3
        for (int r = 0; r < RB; r++)
            p[r] = vset1(pd[r][t]);
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++) {
            vf v = vload_i8(x + j * VL);
#pragma GCC unroll 3
            for (int r = 0; r < RB; r++)
                a[r][j] = vfma(p[r], v, a[r][j]);
        }
    }
#pragma GCC unroll 3
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            vstore(acc + (size_t)r * D + d0 + j * VL, a[r][j]);
}

/*
 * RB rows x NV vectors of output starting at element d0; n = lanes of the
 * last vector. Up to 3 rows, the rows' probabilities are broadcast first
 * and each value vector is used as soon as it is loaded, so RB x NV
 * accumulators, RB broadcasts and one value fit the registers: at AVX2
 * three rows (a GQA group of 3, decode's usual case) keep 4 vectors each
 * and walk a tile's keys twice at head dim 64, not four times as with 2
 * (each walk broadcasts the probabilities again and touches every value
 * row): a hot 4k-token layer took 0.8x the time (bench_decode 4096
 * profile). More rows load the NV values first and broadcast one row's
 * probability at a time (6 rows x 2 at AVX2: 12 + 2 + 1 registers; six
 * broadcasts held would not fit). Either way each accumulator gets one
 * FMA per key in key order: the same bits for any NV and order.
 */
INLINE void pv_block(float *acc, int D, const float *P, const void *const *vp, int nt,
                     enum attn_type T, int d0, int n, const int RB, const int NV,
                     const struct attn_prefetch *pf)
{
    if (RB <= 3 && q8_one_block(T, d0, NV * VL, n)) {
        pv_block_q8(acc, D, P, vp, nt, d0, RB, NV, pf);
        return;
    }
    vf a[PV_RB][PV_NV > PV_NV3 ? PV_NV : PV_NV3];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            a[r][j] = vload_n(acc + (size_t)r * D + d0 + j * VL, j == NV - 1 ? n : VL);
    for (int t = 0; t < nt; t++) {
        prefetch_v(pf, t);
        if (RB <= 3) {
            vf p[3];
#pragma GCC unroll 3
            for (int r = 0; r < RB; r++)
                p[r] = vset1(P[(size_t)r * ATTN_TILE + t]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++) {
                vf v = vload_t(vp[t], d0 + j * VL, T, j == NV - 1 ? n : VL);
#pragma GCC unroll 3
                for (int r = 0; r < RB; r++)
                    a[r][j] = vfma(p[r], v, a[r][j]);
            }
            continue;
        }
        vf v[PV_NV];
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            v[j] = vload_t(vp[t], d0 + j * VL, T, j == NV - 1 ? n : VL);
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            vf p = vset1(P[(size_t)r * ATTN_TILE + t]);
#pragma GCC unroll 4
            for (int j = 0; j < NV; j++)
                a[r][j] = vfma(p, v[j], a[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < NV; j++)
            vstore_n(acc + (size_t)r * D + d0 + j * VL, a[r][j], j == NV - 1 ? n : VL);
}

/* pf's V lines are asked for once, by the first block's walk over the keys. */
INLINE void pv_rows(float *acc, int D, const float *P, const void *const *vp, int nt,
                    enum attn_type T, const int RB, const struct attn_prefetch *pf)
{
    const int NV = RB <= 3 ? PV_NV3 : PV_NV;
    int d0 = 0;
    for (; d0 + NV * VL <= D; d0 += NV * VL)
        pv_block(acc, D, P, vp, nt, T, d0, VL, RB, NV, d0 ? NULL : pf);
    for (; d0 < D; d0 += VL)
        pv_block(acc, D, P, vp, nt, T, d0, D - d0 < VL ? D - d0 : VL, RB, 1, d0 ? NULL : pf);
}

INLINE void pv_typed(float *acc, int nrows, const float *P, const void *const *vp, int nt,
                     enum attn_type T, int D, const struct attn_prefetch *pf)
{
    int r = 0;
    for (; r + PV_RB <= nrows; r += PV_RB)
        pv_rows(acc + (size_t)r * D, D, P + (size_t)r * ATTN_TILE, vp, nt, T, PV_RB,
                r ? NULL : pf);
    if (r)
        pf = NULL;
    /* the rest in one block, so each value row is loaded once (GQA groups of 3 and 2) */
    acc += (size_t)r * D;
    P += (size_t)r * ATTN_TILE;
#define PV_REST(k)                                                                                 \
    case k:                                                                                        \
        pv_rows(acc, D, P, vp, nt, T, k, pf);                                                      \
        break;
    switch (nrows - r) {
        PV_REST(5)
        PV_REST(4)
        PV_REST(3)
        PV_REST(2)
        PV_REST(1)
    }
#undef PV_REST
}

INLINE void pv_types(float *acc, int nrows, const float *P, const void *const *vp, int nt,
                     enum attn_type type, int D, const struct attn_prefetch *pf)
{
    switch (type) {
    case ATTN_F32:
        pv_typed(acc, nrows, P, vp, nt, ATTN_F32, D, pf);
        break;
    case ATTN_F16:
        pv_typed(acc, nrows, P, vp, nt, ATTN_F16, D, pf);
        break;
    case ATTN_BF16:
        pv_typed(acc, nrows, P, vp, nt, ATTN_BF16, D, pf);
        break;
    case ATTN_Q8_0: /* read as stored by decode_head; the flash tile dequantises */
        pv_typed(acc, nrows, P, vp, nt, ATTN_Q8_0, D, pf);
        break;
    case ATTN_Q4_0: /* dequantised by the caller (attn.c) */
        break;
    }
}

static void pv_simd(float *acc, int nrows, const float *P, const void *const *vp, int nt,
                    enum attn_type type, int D, const struct attn_prefetch *pf)
{
    if (D == 64)
        pv_types(acc, nrows, P, vp, nt, type, 64, pf);
    else if (D == 128)
        pv_types(acc, nrows, P, vp, nt, type, 128, pf);
    else
        pv_types(acc, nrows, P, vp, nt, type, D, pf);
}

/* ------------------------------------------------------------------------
 * Staging keys: convert, de-interleave and rotate a tile once
 * ------------------------------------------------------------------------ */

INLINE void stage_typed(float *out, const void *const *kp, int nt, enum attn_type T, int D, int rot,
                        enum attn_pairs pairs, const float *cs, const float *sn, int ld_cs)
{
    int half = rot / 2;
    for (int t = 0; t < nt; t++) {
        const void *k = kp[t];
        float *o = out + (size_t)t * D;
        const float *c = cs + (size_t)t * ld_cs, *s = sn + (size_t)t * ld_cs;
        for (int i = 0; i < half; i += VL) {
            int n = half - i < VL ? half - i : VL;
            vf lo, hi;
            load_pairs(k, i, half, n, pairs, T, &lo, &hi);
            vf vc = vload_n(c + i, n), vs = vload_n(s + i, n);
            vstore_n(o + i, vfnma(hi, vs, vmul(lo, vc)), n);
            vstore_n(o + half + i, vfma(lo, vs, vmul(hi, vc)), n);
        }
        for (int d = rot; d < D; d += VL) {
            int n = D - d < VL ? D - d : VL;
            vstore_n(o + d, vload_t(k, d, T, n), n);
        }
    }
}

INLINE void stage_types(float *out, const void *const *kp, int nt, enum attn_type type, int D,
                        int rot, enum attn_pairs pairs, const float *cs, const float *sn, int ld_cs)
{
    switch (type) {
    case ATTN_F32:
        stage_typed(out, kp, nt, ATTN_F32, D, rot, pairs, cs, sn, ld_cs);
        break;
    case ATTN_F16:
        stage_typed(out, kp, nt, ATTN_F16, D, rot, pairs, cs, sn, ld_cs);
        break;
    case ATTN_BF16:
        stage_typed(out, kp, nt, ATTN_BF16, D, rot, pairs, cs, sn, ld_cs);
        break;
    case ATTN_Q8_0: /* dequantised by the caller (attn.c) */
    case ATTN_Q4_0:
        break;
    }
}

static void stage_k_simd(float *out, const void *const *kp, int nt, enum attn_type type, int D,
                         int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                         int ld_cs)
{
    if (D == 64 && rot == 0)
        stage_types(out, kp, nt, type, 64, 0, pairs, cs, sn, ld_cs);
    else if (D == 64 && rot == 64 && ld_cs == 32)
        stage_types(out, kp, nt, type, 64, 64, pairs, cs, sn, 32);
    else if (D == 128 && rot == 0)
        stage_types(out, kp, nt, type, 128, 0, pairs, cs, sn, ld_cs);
    else if (D == 128 && rot == 128 && ld_cs == 64)
        stage_types(out, kp, nt, type, 128, 128, pairs, cs, sn, 64);
    else
        stage_types(out, kp, nt, type, D, rot, pairs, cs, sn, ld_cs);
}


/* ------------------------------------------------------------------------
 * Scores for many rows: the tile's keys transposed, no reduction
 * ------------------------------------------------------------------------ */

/* Rows of keys staged before a transpose: VL keys of up to this many elements. */
#define KT_STAGE_D 128

/*
 * kt[d][t] (rows of ATTN_TILE floats) = element d of key t staged as
 * stage_k stages it (converted, rotated, de-interleaved); columns from nt
 * to ATTN_TILE are zero. VL keys at a time are staged into a small buffer,
 * then transposed VL x VL in registers.
 */
INLINE void stage_kt_typed(float *kt, const void *const *kp, int nt, enum attn_type T, int D,
                           int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                           int ld_cs)
{
    float buf[VL * KT_STAGE_D];
    for (int t0 = 0; t0 < ATTN_TILE; t0 += VL) {
        int n = nt - t0 < VL ? (nt - t0 > 0 ? nt - t0 : 0) : VL;
        stage_typed(buf, kp + t0, n, T, D, rot, pairs, cs + (size_t)t0 * ld_cs,
                    sn + (size_t)t0 * ld_cs, ld_cs);
        for (int t = n; t < VL; t++)
            memset(buf + (size_t)t * D, 0, sizeof(float) * (size_t)D);
        for (int d0 = 0; d0 < D; d0 += VL) { /* VL x VL blocks, the last one narrower */
            int w = D - d0 < VL ? D - d0 : VL;
            vf r[VL];
#pragma GCC unroll 16
            for (int t = 0; t < VL; t++)
                r[t] = vload_n(buf + (size_t)t * D + d0, w);
            vtranspose(r);
            for (int i = 0; i < w; i++)
                vstore(kt + (size_t)(d0 + i) * ATTN_TILE + t0, r[i]);
        }
    }
}

INLINE void stage_kt_types(float *kt, const void *const *kp, int nt, enum attn_type type, int D,
                           int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                           int ld_cs)
{
    switch (type) {
    case ATTN_F16:
        stage_kt_typed(kt, kp, nt, ATTN_F16, D, rot, pairs, cs, sn, ld_cs);
        break;
    case ATTN_BF16:
        stage_kt_typed(kt, kp, nt, ATTN_BF16, D, rot, pairs, cs, sn, ld_cs);
        break;
    case ATTN_F32:
    case ATTN_Q8_0: /* block types come dequantised to f32 rows (attn.c) */
    case ATTN_Q4_0:
        stage_kt_typed(kt, kp, nt, ATTN_F32, D, rot, pairs, cs, sn, ld_cs);
        break;
    }
}

static void stage_kt_simd(float *kt, const void *const *kp, int nt, enum attn_type type, int D,
                          int rot, enum attn_pairs pairs, const float *cs, const float *sn,
                          int ld_cs)
{
    if (D == 64 && rot == 0)
        stage_kt_types(kt, kp, nt, type, 64, 0, pairs, cs, sn, ld_cs);
    else if (D == 64 && rot == 64 && ld_cs == 32)
        stage_kt_types(kt, kp, nt, type, 64, 64, pairs, cs, sn, 32);
    else if (D == 128 && rot == 0)
        stage_kt_types(kt, kp, nt, type, 128, 0, pairs, cs, sn, ld_cs);
    else if (D == 128 && rot == 128 && ld_cs == 64)
        stage_kt_types(kt, kp, nt, type, 128, 128, pairs, cs, sn, 64);
    else if (D <= KT_STAGE_D)
        stage_kt_types(kt, kp, nt, type, D, rot, pairs, cs, sn, ld_cs);
    else /* long heads: one key at a time through the scalar table */
        attn_scalar_ops.stage_kt(kt, kp, nt, type, D, rot, pairs, cs, sn, ld_cs);
}

#ifdef SIMD_AVX512
#define KT_RB 6 /* rows per block: 6 x 4 accumulators + 4 key vectors in 32 registers */
#else
#define KT_RB 2 /* 2 x 4 accumulators + 4 key vectors in 16 registers */
#endif
#define KT_NV 4 /* key vectors per block */

/*
 * S[r][t0 + t] for RB rows (the first nr stored) and KT_NV * VL keys from
 * t0: a register-blocked product over d, each q[r][d] broadcast, each key
 * row of kt loaded once for the RB rows.
 */
INLINE void qkt_block(float *S, const float *const *q, const float *kt, int t0, int D,
                      const int RB, int nr)
{
    vf acc[KT_RB][KT_NV];
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
#pragma GCC unroll 4
        for (int j = 0; j < KT_NV; j++)
            acc[r][j] = vzero();
    for (int d = 0; d < D; d++) {
        vf k[KT_NV];
#pragma GCC unroll 4
        for (int j = 0; j < KT_NV; j++)
            k[j] = vload(kt + (size_t)d * ATTN_TILE + t0 + j * VL);
#pragma GCC unroll 8
        for (int r = 0; r < RB; r++) {
            vf qb = vset1(q[r][d]);
#pragma GCC unroll 4
            for (int j = 0; j < KT_NV; j++)
                acc[r][j] = vfma(qb, k[j], acc[r][j]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < RB; r++)
        if (r < nr)
#pragma GCC unroll 4
            for (int j = 0; j < KT_NV; j++)
                vstore(S + (size_t)r * ATTN_TILE + t0 + j * VL, acc[r][j]);
}

INLINE void qk_t_dim(float *S, const float *const *q, int nrows, const float *kt, int D)
{
    for (int t0 = 0; t0 < ATTN_TILE; t0 += KT_NV * VL)
        for (int r = 0; r < nrows; r += KT_RB) {
            /* a last partial block repeats its last row and stores only its own */
            const float *qb[KT_RB];
            for (int i = 0; i < KT_RB; i++)
                qb[i] = q[r + i < nrows ? r + i : nrows - 1];
            int nr = nrows - r < KT_RB ? nrows - r : KT_RB;
            qkt_block(S + (size_t)r * ATTN_TILE, qb, kt, t0, D, KT_RB, nr);
        }
}

static void qk_t_simd(float *S, const float *const *q, int nrows, const float *kt, int D)
{
    if (D == 64)
        qk_t_dim(S, q, nrows, kt, 64);
    else if (D == 128)
        qk_t_dim(S, q, nrows, kt, 128);
    else
        qk_t_dim(S, q, nrows, kt, D);
}

/* ------------------------------------------------------------------------
 * Dequantising a tile of q8_0 / q4_0 rows
 * ------------------------------------------------------------------------ */

/* One block of 32 as f32: q8_0 directly, q4_0 after splitting its nibbles. */
INLINE void dequant_block(float *o, const uint8_t *blk, enum attn_type T)
{
    vf d = vset1(attn_block_scale(blk));
    const int8_t *q = (const int8_t *)(blk + 2);
    int8_t buf[ATTN_QK];
    if (T == ATTN_Q4_0) {
        __m128i b = _mm_loadu_si128((const __m128i *)(blk + 2)), m = _mm_set1_epi8(15),
                eight = _mm_set1_epi8(8);
        _mm_storeu_si128((__m128i *)buf, _mm_sub_epi8(_mm_and_si128(b, m), eight));
        _mm_storeu_si128((__m128i *)(buf + 16),
                         _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), m), eight));
        q = buf;
    }
#pragma GCC unroll 4
    for (int i = 0; i < ATTN_QK; i += VL)
        vstore(o + i, vmul(d, vload_i8(q + i)));
}

/* Rows of a 16-bit type widened to f32 rows (exactly): the flash tile's values. */
INLINE void widen_rows(float *out, const void *const *rows, int nt, enum attn_type T, int D)
{
    for (int t = 0; t < nt; t++)
        for (int d = 0; d < D; d += VL) {
            const int n = D - d < VL ? D - d : VL;
            vstore_n(out + (size_t)t * D + d, vload_t(rows[t], d, T, n), n);
        }
}

static void dequant_simd(float *out, const void *const *rows, int nt, enum attn_type type, int D)
{
    if (type == ATTN_F16) {
        widen_rows(out, rows, nt, ATTN_F16, D);
        return;
    }
    if (type == ATTN_BF16) {
        widen_rows(out, rows, nt, ATTN_BF16, D);
        return;
    }
    const size_t bb = type == ATTN_Q8_0 ? ATTN_Q8_0_BYTES : ATTN_Q4_0_BYTES;
    for (int t = 0; t < nt; t++) {
        const uint8_t *r = rows[t];
        float *o = out + (size_t)t * D;
        if (type == ATTN_Q8_0)
            for (int b = 0; b < D / ATTN_QK; b++)
                dequant_block(o + b * ATTN_QK, r + b * bb, ATTN_Q8_0);
        else
            for (int b = 0; b < D / ATTN_QK; b++)
                dequant_block(o + b * ATTN_QK, r + b * bb, ATTN_Q4_0);
    }
}

const struct attn_ops KERN(attn_simd) = {
    .name = simd_name,
    .shuf8_pairs = SHUF8_PAIRS,
    .pf_scores = PF_V_IN_QK ? ATTN_PF_KV : ATTN_PF_K,
    .qk = qk_simd,
    .qk_rope = qk_rope_simd,
    .softmax = softmax_simd,
    .probs = probs_simd,
    .pv = pv_simd,
    .stage_k = stage_k_simd,
    .dequant = dequant_simd,
    .stage_kt = stage_kt_simd,
    .qk_t = qk_t_simd,
};

#endif /* SIMD_AVX512 || SIMD_AVX2; the scalar copy is empty */
