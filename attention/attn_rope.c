/*
 * attn_rope.c - the RoPE angles of a tile's keys, once per kernel level.
 *
 * Keys are cached unrotated; the kernel rotates each one by its own
 * position's angles as it reads it. This file computes those angles for a
 * tile: cos and sin of pos * theta_i for every pair i of every key. It runs
 * once per tile and serves every KV head of the unit (attn.c), so at decode
 * it is paid once per key and layer, beside the rotation itself (the tile
 * operations, attn_simd.c).
 *
 * Why angle addition and not cos/sin per key: a libm cos and sin per pair
 * and key would cost more than the dot products they feed. A position is
 * split as pos = block + 64 * hi + lo (block a multiple of 4096), and
 *
 *     angle(pos) = angle(block) + angle(64 * hi) + angle(lo)
 *
 * with cos/sin of the block's angle taken in double (exact for any
 * position, cached per thread: it changes every 4096 positions), those of
 * 64 * hi and lo from two 64-row tables built once (attn.c), and two
 * complex products in f32 (three float roundings in all, any position,
 * holes or not). "cur" = block + 64 * hi is cached too: consecutive keys
 * share it for 64 positions, so the per-key work is one complex product
 * per pair, 6 vector operations per 16 pairs.
 *
 * Every copy computes the same products in the same order with separate
 * multiplies and adds (no fused multiply-add, which would round once less):
 * the SIMD copies give bit for bit what the scalar copy gives, which the
 * tests check (test_attention's rope-angle test), so a forced level changes
 * no result. The Makefile compiles this file once per kernel level
 * (cpu/kernel.h); attn_rope_select() picks the copy of cpu_level().
 */
#include "attention_internal.h"
#include "cpu/kernel.h"

#include <math.h>

#if defined(KERN_AVX512) || defined(KERN_AVX2)
#include <immintrin.h>
#endif

/* cos/sin (double, rounded once to f32) of the angles at a block's first position. */
static void block_base(const struct attn_rope_tabs *tb, int64_t blk, float *c, float *s)
{
    double p0 = (double)(blk << ATTN_ROPE_BLOCK_SHIFT);
    for (int i = 0; i < tb->half; i++) {
        double a = p0 * tb->theta[i];
        c[i] = (float)cos(a);
        s[i] = (float)sin(a);
    }
}

/*
 * (oc, os) = (ac, as) * (bc, bs) as complex numbers, n pairs:
 * oc = ac*bc - as*bs, os = as*bc + ac*bs, each product rounded alone.
 */
static inline __attribute__((always_inline)) void cmul(float *oc, float *os, const float *ac,
                                                       const float *as, const float *bc,
                                                       const float *bs, int n)
{
    int i = 0;
#if defined(KERN_AVX512)
    for (; i + 16 <= n; i += 16) {
        __m512 xc = _mm512_loadu_ps(ac + i), xs = _mm512_loadu_ps(as + i);
        __m512 yc = _mm512_loadu_ps(bc + i), ys = _mm512_loadu_ps(bs + i);
        _mm512_storeu_ps(oc + i, _mm512_sub_ps(_mm512_mul_ps(xc, yc), _mm512_mul_ps(xs, ys)));
        _mm512_storeu_ps(os + i, _mm512_add_ps(_mm512_mul_ps(xs, yc), _mm512_mul_ps(xc, ys)));
    }
#endif
#if defined(KERN_AVX512) || defined(KERN_AVX2)
    for (; i + 8 <= n; i += 8) {
        __m256 xc = _mm256_loadu_ps(ac + i), xs = _mm256_loadu_ps(as + i);
        __m256 yc = _mm256_loadu_ps(bc + i), ys = _mm256_loadu_ps(bs + i);
        _mm256_storeu_ps(oc + i, _mm256_sub_ps(_mm256_mul_ps(xc, yc), _mm256_mul_ps(xs, ys)));
        _mm256_storeu_ps(os + i, _mm256_add_ps(_mm256_mul_ps(xs, yc), _mm256_mul_ps(xc, ys)));
    }
#endif
    for (; i < n; i++) { /* one operation per statement: no compiler fuses them */
        float cc = ac[i] * bc[i], ss = as[i] * bs[i], sc = as[i] * bc[i], cs = ac[i] * bs[i];
        oc[i] = cc - ss;
        os[i] = sc + cs;
    }
}

static void rope_angles(const struct attn_rope_tabs *tb, struct attn_rope_state *st,
                        const int32_t *kpos, int nt, float *cs, float *sn)
{
    const int half = tb->half;
    for (int t = 0; t < nt; t++) {
        int32_t p = kpos[t];
        int64_t blk = (int64_t)p >> ATTN_ROPE_BLOCK_SHIFT;
        if (blk != st->base_block) {
            block_base(tb, blk, st->base_c, st->base_s);
            st->base_block = blk;
            st->cur_hi = -1;
        }
        int d = p & ((1 << ATTN_ROPE_BLOCK_SHIFT) - 1);
        int hi = d / ATTN_ROPE_LO, lo = d % ATTN_ROPE_LO;
        if (hi != st->cur_hi) {
            cmul(st->cur_c, st->cur_s, st->base_c, st->base_s, tb->hi_c + (size_t)hi * half,
                 tb->hi_s + (size_t)hi * half, half);
            st->cur_hi = hi;
        }
        cmul(cs + (size_t)t * half, sn + (size_t)t * half, st->cur_c, st->cur_s,
             tb->lo_c + (size_t)lo * half, tb->lo_s + (size_t)lo * half, half);
    }
}

const attn_rope_fn KERN(attn_rope_angles) = rope_angles;
