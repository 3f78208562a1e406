/*
 * attention_internal.h - what the kernel files (attn*.c, kvtype.c) share.
 *
 * The fused kernel is split in two layers. attn.c plans the work (which
 * sequence, query block, KV heads and key range each work item
 * covers), walks the key tiles, resolves page addresses and computes RoPE
 * angles per tile. The arithmetic on one tile - scores, the online-softmax
 * update, P.V, staging rotated keys - goes through a table of tile
 * operations (struct attn_ops): a portable scalar table in attn_scalar.c
 * and a SIMD table in attn_simd.c (AVX-512 or AVX2, whichever -march
 * allowed). Both tables compute the same thing; tests run both. Scores of
 * q8_0 keys without RoPE take attn_q8.c's integer path instead.
 *
 * Not for use outside attention/.
 */
#ifndef KVD_ATTENTION_INTERNAL_H
#define KVD_ATTENTION_INTERNAL_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "attention.h"

/* Keys per tile: a tile of K and V (64 x 128 x f16 = 16 KiB each) stays in L1/L2. */
#define ATTN_TILE 64

/* --- element conversions (exact) -------------------------------------------- */

/* IEEE binary16 -> binary32, portable (normals, subnormals, inf, NaN). */
static inline float attn_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf / NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13); /* normal: rebias 15 -> 127 */
    } else if (man == 0) {
        bits = sign; /* signed zero */
    } else {
        /* subnormal: man * 2^-24, renormalised */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* binary32 -> binary16, round to nearest even (tests and benchmarks fill caches with it). */
static inline uint16_t attn_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
    if (ax >= 0x477ff000u) /* rounds to >= 65520: overflow */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below the smallest normal half: subnormal or zero */
        if (ax < 0x33000000u)
            return (uint16_t)sign;
        uint32_t e = ax >> 23;
        uint32_t man = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* 14..24 */
        uint32_t half = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1u);
        uint32_t mid = 1u << (shift - 1u);
        if (rem > mid || (rem == mid && (half & 1u)))
            half++;
        return (uint16_t)(sign | half);
    }
    uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u); /* round to nearest even on bit 13 */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

static inline float attn_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint16_t attn_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof(x));
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Bytes of one q8_0 / q4_0 block (see attention.h). */
#define ATTN_Q8_0_BYTES 34
#define ATTN_Q4_0_BYTES 18

/* The f16 scale at the start of a block (any alignment). */
static inline float attn_block_scale(const uint8_t *blk)
{
    return attn_f16_to_f32((uint16_t)(blk[0] | (blk[1] << 8)));
}

/* Element i of a K or V row of the given type, as f32 (dequantised). */
static inline float attn_load(const void *row, int i, enum attn_type type)
{
    const uint8_t *b = row;
    switch (type) {
    case ATTN_F16:
        return attn_f16_to_f32(((const uint16_t *)row)[i]);
    case ATTN_BF16:
        return attn_bf16_to_f32(((const uint16_t *)row)[i]);
    case ATTN_Q8_0:
        b += (size_t)(i / ATTN_QK) * ATTN_Q8_0_BYTES;
        return attn_block_scale(b) * (float)(int8_t)b[2 + i % ATTN_QK];
    case ATTN_Q4_0: {
        b += (size_t)(i / ATTN_QK) * ATTN_Q4_0_BYTES;
        int j = i % ATTN_QK;
        int nib = j < ATTN_QK / 2 ? b[2 + j] & 15 : b[2 + j - ATTN_QK / 2] >> 4;
        return attn_block_scale(b) * (float)(nib - 8);
    }
    case ATTN_F32:
        break;
    }
    return ((const float *)row)[i];
}

static inline bool attn_type_blocked(enum attn_type type)
{
    return type == ATTN_Q8_0 || type == ATTN_Q4_0;
}

/* --- tile operations ------------------------------------------------------------ */

/*
 * The bias one score row receives, described per row (query head and
 * position). kind is POS_ALIBI (slope * (pos_k - pos_q)), POS_T5
 * (t5[min(pos_q - pos_k, t5_n)]: the head's table already composed with
 * the bucket lookup, t5_n + 1 entries) or anything else for no bias.
 */
struct attn_bias {
    enum pos_kind kind;
    float slope;
    const float *t5;
    int t5_n;
    int32_t window; /* 0, or keys with pos_k <= pos_q - window are hidden too */
    float softcap;  /* 0, or the row's scores were capped to softcap * tanh(s / softcap)
                       before the bias (attn_softcap.c; the base tables ignore it) */
};

/* The last hidden position below a query at pos_q for a window (INT32_MIN
 * when there is none): keys with pos_k <= it are masked. */
static inline int32_t attn_window_floor(int32_t pos_q, int32_t window)
{
    int64_t lo = (int64_t)pos_q - window;
    return window <= 0 || lo < INT32_MIN ? INT32_MIN : (int32_t)lo;
}

/*
 * Memory to prefetch while a tile is scored (decode): the K and V rows of
 * the next head, or of the first head of the next tile - key t's rows at
 * k + koff[t] and v + voff[t], klines and vlines cache lines from there.
 * The SIMD qk requests key t's K lines as it scores key t of its own head
 * and pv key t's V lines as it reaches key t, so the requests are spread
 * evenly over both key loops, at the cost of one offset load and a prefetch
 * per line; n = 0 (or a NULL pointer) asks for nothing.
 */
struct attn_prefetch {
    const char *k, *v;
    const size_t *koff, *voff; /* [n] */
    int n;
    int klines, vlines;
};

/*
 * How a key's rotated pairs lie once de-interleaved: slot i of the "low"
 * half and slot i of the "high" half hold the two elements of one pair.
 * Staged and rotated keys, the prepared queries and the keys' angle tables
 * (attn.c's theta) all use the context's layout, so a score never sees it.
 *   NEOX      pair i = elements (i, half + i), in slot i: nothing to move.
 *   ADJACENT  pair i = elements (2i, 2i + 1), in slot i.
 *   SHUF8     adjacent pairs, slot i holding pair i with bits 1 and 2 of
 *             i swapped (0 1 4 5 2 3 6 7 in each group of 8): where AVX2's
 *             in-lane shuffles leave them. Putting them in order costs two
 *             lane-crossing permutes per 16 elements, ~10% of a decode
 *             tile's compute on Zen 3. Only when half is a multiple of 8.
 * Every level computes every layout; attn.c picks SHUF8 where the level
 * says it is its cheapest (attn_ops.shuf8_pairs).
 */
enum attn_pairs { ATTN_PAIRS_NEOX, ATTN_PAIRS_ADJACENT, ATTN_PAIRS_SHUF8 };

/* The pair held in slot i under layout m (its own inverse). */
static inline int attn_pair_at(enum attn_pairs m, int i)
{
    if (m != ATTN_PAIRS_SHUF8)
        return i;
    return (i & ~6) | ((i & 2) << 1) | ((i & 4) >> 1);
}

/* Which lines of an attn_prefetch a level's qk asks for as it scores. */
enum attn_pf_scores {
    ATTN_PF_NONE, /* none: the portable path leaves prefetching to the hardware */
    ATTN_PF_K,    /* the keys' K lines; its pv asks for their V lines */
    ATTN_PF_KV,   /* K and V lines both (attn_simd.c's PF_V_IN_QK) */
};

/*
 * Operations on one tile of at most ATTN_TILE keys. Key and value rows are
 * given as pointers (kp[t], vp[t]); kp has ATTN_TILE valid entries (padding
 * repeats a real key) so blocked loops may read past nt. Score rows have
 * ATTN_TILE columns. Queries are f32, already scaled, rotated and laid out
 * like staged keys.
 */
struct attn_ops {
    const char *name;
    bool shuf8_pairs;              /* adjacent pairs cost least as ATTN_PAIRS_SHUF8 */
    enum attn_pf_scores pf_scores; /* what qk prefetches; decode's int8 scores do the same */

    /*
     * S[r][t] = q[r] . k_t for r < nrows, t < nt (columns up to ATTN_TILE
     * may be written); pf (or NULL): ask for its keys' K lines (and, at
     * AVX2, their V lines too: attn_simd.c's PF_V_IN_QK).
     */
    void (*qk)(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
               enum attn_type type, int head_dim, const struct attn_prefetch *pf);

    /*
     * qk with every key rotated on the fly, as stage_k would rotate it (for
     * few rows, where staging would cost more than it saves).
     */
    void (*qk_rope)(float *S, const float *const *q, int nrows, const void *const *kp, int nt,
                    enum attn_type type, int head_dim, int rot, enum attn_pairs pairs,
                    const float *cs, const float *sn, int ld_cs, const struct attn_prefetch *pf);

    /*
     * Online-softmax update of one score row s (nt valid scores): add the
     * bias, mask keys with pos_k > pos_q and t >= nt, raise the running max
     * *m (rescaling *l and acc[head_dim] when it grows), and overwrite s with
     * the unnormalised probabilities exp(s - m) (0 where masked, also for
     * t in [nt, ATTN_TILE)). *l gains their sum. kpos NULL says the row
     * needs no mask and no bias (nt == ATTN_TILE, every key visible, no
     * ALiBi or T5 term): the same result, without the per-key tests.
     */
    void (*softmax)(float *s, int nt, const int32_t *kpos, int32_t pos_q, const struct attn_bias *b,
                    float *m, float *l, float *acc, int head_dim);

    /* Final probabilities: s[t] = exp(s + bias - m) * inv_l (0 where masked, t < ATTN_TILE). */
    void (*probs)(float *s, int nt, const int32_t *kpos, int32_t pos_q, const struct attn_bias *b,
                  float m, float inv_l);

    /*
     * acc[r][:] += sum_{t < nt} P[r][t] * v_t, acc rows head_dim apart, P
     * rows ATTN_TILE apart. pf (or NULL): as it reaches key t, ask for the
     * V lines of pf's key t (qk asks for the K lines), unless the level's
     * qk asked for them already (PF_V_IN_QK).
     */
    void (*pv)(float *acc, int nrows, const float *P, const void *const *vp, int nt,
               enum attn_type type, int head_dim, const struct attn_prefetch *pf);

    /*
     * out[t][:] = k_t converted to f32 and, when rot > 0, rotated: the first
     * rot elements become rot/2 "low" then rot/2 "high" halves (adjacent
     * pairs de-interleaved into the slots of layout pairs), low' =
     * low*c - high*s, high' = low*s + high*c with c = cs[t*ld_cs + i],
     * s = sn[t*ld_cs + i]. Elements past rot are copied. With rot = 0 it
     * only converts (values are staged this way; cs and sn are unused).
     */
    void (*stage_k)(float *out, const void *const *kp, int nt, enum attn_type type, int head_dim,
                    int rot, enum attn_pairs pairs, const float *cs, const float *sn, int ld_cs);

    /*
     * out[t][:] = row t as f32 (t < nt): a block type (q8_0, q4_0)
     * dequantised, a 16-bit type (f16, bf16) widened exactly. The tile's
     * quantised keys or values become f32 once, and everything after
     * (rotation, scores, P.V) runs on them as on f32 rows; so do the flash
     * tile's 16-bit values (attn.c's head_values).
     */
    void (*dequant)(float *out, const void *const *rows, int nt, enum attn_type type,
                    int head_dim);

    /*
     * The tile for many rows (a prefill chunk): kt[d][t] (head_dim rows of
     * ATTN_TILE floats) = element d of key t staged as stage_k stages it,
     * columns nt.. zero. Block types come dequantised (f32 rows).
     */
    void (*stage_kt)(float *kt, const void *const *kp, int nt, enum attn_type type, int head_dim,
                     int rot, enum attn_pairs pairs, const float *cs, const float *sn, int ld_cs);

    /* S[r][t] = q[r] . column t of kt, r < nrows, every t < ATTN_TILE: each
     * key element is loaded once per block of rows, and no dot product needs
     * a horizontal sum (the flash tile of a prefill chunk). */
    void (*qk_t)(float *S, const float *const *q, int nrows, const float *kt, int head_dim);
};

/* --- RoPE angles of a tile's keys (attn_rope.c) ---------------------------------- */

/* A key position = block (a multiple of 4096) + 64 * hi + lo: see attn_rope.c. */
#define ATTN_ROPE_BLOCK_SHIFT 12
#define ATTN_ROPE_LO 64

/* A context's frequencies and angle tables (built by attn_create, read only). */
struct attn_rope_tabs {
    int half;              /* rotated pairs */
    const double *theta;   /* [half] freq_scale * inv_freq */
    const float *lo_c, *lo_s; /* [ATTN_ROPE_LO][half] cos/sin of lo * theta */
    const float *hi_c, *hi_s; /* [ATTN_ROPE_LO][half] cos/sin of 64 * hi * theta */
};

/* One thread's cached angles: at its current 4096-block start, and that plus 64 * hi. */
struct attn_rope_state {
    float *base_c, *base_s; /* [half] */
    float *cur_c, *cur_s;   /* [half] */
    int64_t base_block;     /* -1 = none */
    int cur_hi;             /* -1 = none */
};

/*
 * cos[t][i], sin[t][i] (rows of half floats) of pair i's angle at kpos[t],
 * t < nt. Every level gives the same bits.
 */
typedef void (*attn_rope_fn)(const struct attn_rope_tabs *tb, struct attn_rope_state *st,
                             const int32_t *kpos, int nt, float *cs, float *sn);

/* The copy of the kernel level in use (the scalar one when asked), its level name in *name. */
attn_rope_fn attn_rope_select(bool scalar, const char **name);
/* One copy by level name ("avx512", "avx2", "scalar"), NULL if this CPU or build lacks it. */
attn_rope_fn attn_rope_path(const char *name);

/* --- scores against q8_0 keys in integers (attn_q8.c) ---------------------------- */

/*
 * A prepared query row quantised for q8_0 keys: per block b of 32 elements,
 * q ~ d[b] * (254 * a1 + a2) with a1, a2 in [-127, 127] stored offset by
 * 128 (u1 = a1 + 128, u2 = a2 + 128); d[b] is the block scale / 254.
 */
struct attn_q8row {
    uint8_t *u1, *u2; /* [head_dim] the levels a1, a2 as a + 128 */
    int16_t *a16;     /* [head_dim] 254 a1 + a2: both in one 16-bit integer (the AVX2 path) */
    float *d;         /* [head_dim / 32] */
};

/* Quantise one prepared query row (head_dim a multiple of 32) into out's arrays. */
void attn_q8_query(const struct attn_q8row *out, const float *q, int head_dim);

/* S[r][t] = q[r] . k_t for q8_0 key rows kp[t], t < nt, from the integer levels. */
typedef void (*attn_qk_q8_fn)(float *S, const struct attn_q8row *q, int nrows,
                              const void *const *kp, int nt, int head_dim);

/* The best path the CPU runs (scalar when asked), its name in *name. */
attn_qk_q8_fn attn_q8_select(bool scalar, const char **name);
/* One path by name ("avx512-vnni", "avx2", "scalar"), NULL if this CPU lacks it (tests). */
attn_qk_q8_fn attn_q8_path(const char *name);

/*
 * base itself when softcap is 0, else a table that runs base's operations
 * with every score row capped (cap * tanh(s / cap), the cap taken from the
 * row's attn_bias) before softmax and probs (attn_softcap.c). Static
 * tables: never freed.
 */
const struct attn_ops *attn_softcap_ops(const struct attn_ops *base, float softcap);

/* --- parameters (attn_params.c) -------------------------------------------------- */

/* printf into err (nothing when err is NULL or errlen 0). */
__attribute__((format(printf, 3, 4))) void attn_fail(char *err, size_t errlen, const char *fmt,
                                                     ...);

/* 0, or -EINVAL with err naming the parameter that is out of range. */
int attn_check_params(const struct attn_params *p, char *err, size_t errlen);

/* The portable table (attn_scalar.c). */
extern const struct attn_ops attn_scalar_ops;

/* The SIMD table of the kernel level in use (cpu_level()), or NULL at the
 * scalar level (attn_kernels.c). */
const struct attn_ops *attn_simd_ops(void);

#endif /* KVD_ATTENTION_INTERNAL_H */
