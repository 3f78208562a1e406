/*
 * attention.h - position schemes and the fused paged attention kernel.
 *
 * This room owns two things:
 *
 *   1. Position schemes (posenc.c): T5 relative buckets, ALiBi slopes and
 *      RoPE frequencies/rotations. They are exact transcriptions of what the
 *      reference implementations compute, because a model trained with one
 *      formula and served with another silently degrades.
 *
 *   2. The attention kernel (attn.c, fused; attn_ref.c, reference): softmax
 *      over keys and values that live in fixed-size pages of a KV cache,
 *      with the position bias or rotation computed inside the tile loop from
 *      per-token position numbers. Nothing of size L x L is ever written.
 *
 * Offset convention, everywhere in kvd: offset = key position - query
 * position. A negative offset looks back; a key is visible to a query iff
 * pos_k <= pos_q.
 *
 * This room depends on libc and the thread pool (cpu/pool.h) only. It owns
 * no memory of the cache: callers describe where pages are with the plain
 * structs below.
 */
#ifndef KVD_ATTENTION_H
#define KVD_ATTENTION_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ------------------------------------------------------------------------
 * Position schemes
 * ------------------------------------------------------------------------ */

enum pos_kind {
    POS_NONE = 0, /* no positional signal in attention */
    POS_ROPE,     /* rotary: keys stored unrotated, rotated by the kernel */
    POS_ALIBI,    /* bias = slope_h * (pos_k - pos_q) */
    POS_T5,       /* bias = table[h][bucket(pos_k - pos_q)] */
};

enum pos_rope_pairing {
    POS_ROPE_ADJACENT = 0, /* pairs (x[2i], x[2i+1]): original Llama GGUF layout */
    POS_ROPE_NEOX,         /* pairs (x[i], x[i + n_rot/2]): GPT-NeoX halves */
};

/*
 * A position scheme, as a plain description. Pointers are borrowed: the
 * caller keeps the slopes and tables alive while the scheme is in use.
 */
struct pos_scheme {
    enum pos_kind kind;

    /* POS_ROPE */
    float rope_theta;                   /* base, e.g. 10000 */
    int rope_dims;                      /* rotated dims per head (even, <= head_dim) */
    enum pos_rope_pairing rope_pairing; /* which elements form a rotation pair */
    float rope_freq_scale;              /* linear scaling: angle = pos * scale * inv_freq; 1 = none */
    const float *rope_freq_factors;     /* NULL, or [rope_dims/2]: pair i's frequency is divided
                                           by factor i (> 0): Llama 3.1's rope_freqs, Phi-3's
                                           long/short factors, YaRN's ramp */

    /* POS_ALIBI */
    const float *alibi_slopes; /* [n_head] slope per query head */

    /* POS_T5 */
    const float *t5_table;  /* [n_head][t5_num_buckets] learned bias per bucket */
    int t5_num_buckets;     /* total buckets, >= 4 */
    int t5_max_distance;    /* distance where the last logarithmic bucket saturates */
    bool t5_bidirectional;  /* false for decoders (causal) */
};

const char *pos_kind_name(enum pos_kind kind);

/* --- T5 relative buckets ------------------------------------------------ */

/*
 * Validate a T5 bucket configuration. Returns 0, or -EINVAL with a one-line
 * reason in err. Rejected: num_buckets < 4, max_distance not greater than
 * the exact range (num_buckets/4 bidirectional, num_buckets/2 causal), where
 * Hugging Face's formula divides by log(1) or returns negative bucket ids.
 */
int pos_t5_check(int num_buckets, int max_distance, bool bidirectional, char *err,
                 size_t errlen);

/*
 * The bucket of offset (= key position - query position), computed exactly
 * as Hugging Face's T5Attention._relative_position_bucket does: halve the
 * buckets (floor) for bidirectional, float32 log, truncation toward zero,
 * clamp to the last slot. The configuration must pass pos_t5_check().
 */
int pos_t5_bucket(int64_t offset, bool bidirectional, int num_buckets, int max_distance);

/*
 * Smallest distance d >= 0 from which every larger distance in the given
 * direction maps to the same (last) bucket. Used to size lookup tables and
 * by `kvd buckets` to report where saturation starts. `forward` selects
 * keys after the query (offset > 0); for causal configurations forward
 * offsets all map to bucket 0 and the function returns 1.
 */
int pos_t5_saturation(bool forward, bool bidirectional, int num_buckets, int max_distance);

/*
 * A per-configuration lookup table so kernels never call log() per key:
 * bucket(offset) for |offset| < n, and the saturated bucket beyond.
 * Storage is O(max_distance), independent of context length.
 */
struct pos_t5_lut {
    int n;          /* entries per direction */
    int32_t *back;  /* [n] bucket of offset -d (key behind or at the query) */
    int32_t *fwd;   /* [n] bucket of offset +d */
    int32_t back_last, fwd_last; /* bucket for d >= n */
};

/* Build the table (allocates; config must pass pos_t5_check). 0 or -ENOMEM. */
int pos_t5_lut_init(struct pos_t5_lut *lut, bool bidirectional, int num_buckets,
                    int max_distance);
void pos_t5_lut_deinit(struct pos_t5_lut *lut);

static inline int pos_t5_lut_bucket(const struct pos_t5_lut *lut, int64_t offset)
{
    if (offset <= 0) {
        int64_t d = -offset;
        return d < lut->n ? lut->back[d] : lut->back_last;
    }
    return offset < lut->n ? lut->fwd[offset] : lut->fwd_last;
}

/* --- ALiBi ---------------------------------------------------------------- */

/*
 * Per-head slopes in the max_bias form GGUF ALiBi models carry (llama.cpp's
 * soft_max with max_bias): with n2 = largest power of two <= n_head,
 * m0 = 2^(-max_bias/n2), m1 = 2^(-max_bias/2/n2),
 * slope[h] = m0^(h+1) for h < n2, else m1^(2(h-n2)+1).
 * max_bias = 8 reproduces the ALiBi paper's / BLOOM's slopes for every head
 * count, including the interleaving rule for counts that are not powers of
 * two. Returns 0, or -EINVAL for n_head < 1 or max_bias <= 0.
 */
int pos_alibi_slopes(float *slopes, int n_head, float max_bias);

/* --- RoPE ---------------------------------------------------------------- */

/*
 * inv_freq[i] = theta^(-2i/rope_dims), i in [0, rope_dims/2), in double
 * precision so large positions keep their accuracy.
 */
void pos_rope_inv_freq(double *inv_freq, int rope_dims, double theta);

/*
 * The frequencies a ROPE scheme rotates with: pos_rope_inv_freq of its
 * theta and dims, each divided by its rope_freq_factors entry when it has
 * them. inv_freq has room for rope_dims / 2 values.
 */
void pos_rope_freqs(double *inv_freq, const struct pos_scheme *ps);

/*
 * cos and sin of every pair's angle at position pos:
 * angle_i = pos * freq_scale * inv_freq[i], evaluated in double and rounded
 * to float, so a position of 10^5 is as exact as a position of 1.
 * cs has room for rope_dims floats: cs[2i] = cos, cs[2i+1] = sin.
 */
void pos_rope_cos_sin(float *cs, const double *inv_freq, int rope_dims, double freq_scale,
                      int64_t pos);

/*
 * Rotate x (head_dim floats, the first rope_dims rotated) in place by the
 * angles in cs, with the given pairing.
 */
void pos_rope_apply(float *x, const float *cs, int rope_dims, enum pos_rope_pairing pairing);

/* ------------------------------------------------------------------------
 * Paged attention
 * ------------------------------------------------------------------------ */

/*
 * Element types of cached keys and values. The float types store each
 * element alone; the block types (GGUF's q8_0 and q4_0) store a row of
 * head_dim elements as head_dim / 32 blocks of 32, little-endian, no padding:
 *
 *   q8_0  34 bytes: f16 scale d, int8 q[32];                x[i] = d * q[i]
 *   q4_0  18 bytes: f16 scale d, uint8 qs[16];              x[i] = d * (nib(i) - 8),
 *         nib(i) = low nibble of qs[i] for i < 16, high nibble of qs[i - 16] after
 *
 * A row of a block type is written once (attn_store_row) and only read after:
 * the kernels compute on its dequantised values, exactly.
 */
enum attn_type {
    ATTN_F32 = 0,
    ATTN_F16,
    ATTN_BF16,
    ATTN_Q8_0,
    ATTN_Q4_0,
};

#define ATTN_QK 32 /* elements per block of q8_0 and q4_0 */

/* Bytes per element of a float type; 0 for a block type or an unknown value. */
size_t attn_type_size(enum attn_type type);
/* "f32", "f16", "bf16", "q8_0", "q4_0"; "unknown" otherwise. */
const char *attn_type_name(enum attn_type type);
/* Elements per block: 1 for a float type, ATTN_QK for q8_0/q4_0, 0 if unknown. */
int attn_type_block(enum attn_type type);
/* Bytes of one row of n elements; 0 for an unknown type or n that is not a
 * positive multiple of the type's block. */
size_t attn_row_bytes(enum attn_type type, int n);
/*
 * Whether rows of head_dim elements can be stored in this type. Returns 0,
 * or -EINVAL with a reason naming the type and the head dim in err (block
 * types need a multiple of 32).
 */
int attn_type_check(enum attn_type type, int head_dim, char *err, size_t errlen);

/*
 * Store n floats (n valid for attn_row_bytes) as one row of the type: convert
 * (f16 and bf16 round to nearest even) or quantise. Quantising picks each
 * block's scale from its largest magnitude (q8_0: d = max|x| / 127; q4_0:
 * d = -x_max / 8 for the element x_max of largest magnitude, which so maps
 * to -8 exactly), rounds d to f16 and every element to the nearest level of
 * that stored d. A block holding inf or NaN stores a NaN scale (its values
 * read back as NaN, as they would in f16); a scale beyond f16's range is
 * clamped to 65504. Thread-safe, allocates nothing.
 */
void attn_store_row(void *dst, const float *src, int n, enum attn_type type);
/* The inverse: n floats of a row (dequantised), exactly as the kernels see them. */
void attn_load_row(float *dst, const void *src, int n, enum attn_type type);

/*
 * Where one layer's keys and values are. Page p starts at
 * base + p * page_bytes. Inside a page, this layer's K block starts at
 * k_offset and holds, per KV head h, page_tokens rows of head_dim elements
 * contiguous (head h at k_offset + h * page_tokens * krow, token slot s at
 * + s * krow, krow = attn_row_bytes(k_type, head_dim)); the V block is laid
 * out the same way from v_offset with rows of v_type.
 */
struct attn_kv {
    const uint8_t *base;   /* first byte of page 0 */
    size_t page_bytes;     /* bytes from one page to the next */
    size_t k_offset;       /* byte offset of this layer's K block in a page */
    size_t v_offset;       /* byte offset of this layer's V block in a page */
    int page_tokens;       /* tokens per page */
    enum attn_type k_type; /* element type of K */
    enum attn_type v_type; /* element type of V */
    int n_pages;         /* pages in the pool: page ids are checked against it;
                            0 = not checked (the caller vouches for them) */
    int sliding_window;  /* 0, or this layer's window W: a key is visible only when
                            pos_q - W < pos_k (and pos_k <= pos_q), masked in the tile
                            loop like the causal mask (Mistral, Gemma's local layers) */
};

/*
 * One sequence's part of a batch. Cached token i (logical order) lives in
 * page page_table[i / page_tokens], slot i % page_tokens, and has position
 * pos[i]. Queries attend to every cached token with pos_k <= pos_q, so the
 * tokens of a prefill chunk are appended to the cache before the call.
 * Positions are >= 0; they need not be consecutive (holes after eviction)
 * nor sorted, but sorted positions let the kernel skip invisible keys
 * without reading them.
 */
struct attn_seq {
    const int32_t *page_table; /* [ceil(n_kv / page_tokens)] page ids */
    const int32_t *pos;        /* [n_kv] position number of each cached token */
    int n_kv;                  /* cached tokens */
    int n_q;                   /* queries of this sequence in the call */
    const int32_t *q_pos;      /* [n_q] position number of each query */
    const float *q;            /* [n_q][n_head][head_dim], unrotated */
    float *out;                /* [n_q][n_head][head_dim] result */
    float *mass;               /* optional [n_kv], overwritten: the attention
                                  probability each key got, summed over the heads
                                  and queries of this call (so it sums to
                                  n_head x the queries that see a key) */
};

/*
 * Query head h reads KV head h / (n_head / n_kv_head): consecutive query
 * heads share a KV head (GQA; MQA when n_kv_head = 1).
 */
struct attn_params {
    int n_head;            /* query heads */
    int n_kv_head;         /* key/value heads; n_head % n_kv_head == 0 */
    int head_dim;          /* elements per head, 1..1024 */
    float scale;           /* logit scale, usually 1/sqrt(head_dim); > 0 */
    struct pos_scheme pos; /* position scheme (RoPE, ALiBi, T5 or none) */
    float softcap;         /* 0, or every score q.k * scale becomes softcap * tanh(score /
                              softcap) before bias and masks (Gemma 2's attention logit
                              soft-capping, in the tile loop: attn_softcap.c); finite */
    int n_threads;         /* threads; 0 = the default count (cpu/pool.h) */
    bool force_scalar;     /* run the portable scalar path even where a SIMD path
                              was compiled (tests compare both) */
};

typedef struct attn_ctx attn_ctx;

/*
 * Create a kernel context: validates the shape and scheme and allocates
 * every workspace the kernel needs (per-thread scratch, RoPE tables, T5
 * lookup tables), so that attn_run allocates nothing in its loops. Returns
 * NULL with the reason in err. The scheme's slopes and T5 table are
 * borrowed and read at every attn_run.
 */
attn_ctx *attn_create(const struct attn_params *params, char *err, size_t errlen);
void attn_destroy(attn_ctx *ctx);

/*
 * Fused kernel: for each sequence and each of its queries,
 * out = softmax(q . k^T * scale + bias(pos_q, pos_k)) . v over the visible
 * cached keys. Returns 0, -EINVAL for a malformed batch (the reason is in
 * attn_error), or -ENOMEM when the batch needs more workspace than the
 * context has and growing it failed; on error no output is written.
 * A query that sees no key gets a zero output.
 *
 * Workspace grows (once, at the start of a call) with the batch: queries x
 * heads x head_dim, never with the number of cached tokens. A context is
 * used by one thread at a time.
 */
int attn_run(attn_ctx *ctx, const struct attn_kv *kv, const struct attn_seq *seqs, int n_seqs);

/* The reason for the last attn_run error ("" after a success). Borrowed. */
const char *attn_error(const attn_ctx *ctx);

/* Bytes the context holds (scratch, tables, workspace), for memory checks. */
size_t attn_workspace_bytes(const attn_ctx *ctx);

/*
 * Reference kernel: the same contract, computed the obvious way (scores
 * materialised per query in double precision, bias materialised from
 * positions, keys rotated with posenc's exact angles). Tests and benchmarks
 * only; allocates f32 copies of a sequence's keys and values (O(n_kv x
 * n_kv_head x head_dim)). Returns 0, -EINVAL or -ENOMEM.
 */
int attn_reference(const struct attn_params *params, const struct attn_kv *kv,
                   const struct attn_seq *seqs, int n_seqs);

/* The tile operations of the kernel level in use (cpu/cpu.h):
 * "avx512" / "avx2" / "scalar". */
const char *attn_simd_name(void);

/* The tile path attn_create picks for a context with this softcap (not
 * forced scalar): attn_simd_name(), or it followed by "+softcap". */
const char *attn_path_name(float softcap);

/*
 * The path scoring q8_0 keys under schemes that do not rotate keys (none,
 * ALiBi, T5), chosen at run time by the CPU: "avx512-vnni", "avx2" or
 * "scalar" (8-bit integer dot products with a two-level query, see
 * attn_q8.c). RoPE keys are dequantised and rotated by the tile path.
 */
const char *attn_q8_name(void);

#endif /* KVD_ATTENTION_H */
