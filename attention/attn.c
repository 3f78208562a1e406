/*
 * attn.c - the fused paged attention kernel: planning and the tile loop.
 *
 * For every query, out = softmax(q.k^T * scale + bias(pos_q, pos_k)) . v over
 * the sequence's cached keys, causal by position number. The keys stream
 * through in tiles of ATTN_TILE, with an online softmax (running max m and
 * sum l per query row, f32): nothing of size L x L exists, and no per-pair
 * bias either - ALiBi's slope * (pos_k - pos_q), T5's table[bucket] and RoPE's
 * rotation of each key by its own position are computed per tile.
 *
 * Work is cut into items, run on the thread pool (cpu/pool.h), each item
 * taken by whichever thread is free next:
 *
 *   - A unit is (sequence, query block, KV heads). A decode-like sequence
 *     (n_q * n_head <= 64 rows) is one unit with ALL its KV heads, so a
 *     tile's page addresses and RoPE angles are computed once and serve
 *     every head; otherwise a unit is one KV head and up to 768 query
 *     rows (256 queries of a GQA group of 3). All query heads that share a
 *     KV head are rows of the same unit, so each K/V tile is read once per
 *     GQA group - and, in a prefill chunk, staged once per 768 rows: the
 *     staging (conversion, rotation, transposition), the RoPE angles and
 *     the misses of reading the tile are paid per unit, the products per
 *     row. At long context those misses are what a unit's size decides:
 *     units of 768 rows read each K/V tile a quarter as often as units of
 *     192 did, and a 512-query chunk over 16k keys took ~13% less CPU.
 *   - A unit whose cost (rows x visible keys) exceeds a share of the batch
 *     is split along its keys (split-K, flash-decoding): each part keeps
 *     (m, l, acc) per row, and the part that finishes last merges them. So
 *     one long sequence among short ones still occupies every thread.
 *   - With sorted positions (the usual case) a unit stops at the last key
 *     its queries can see; otherwise tiles entirely in the future are skipped.
 *
 * A tile, for each KV head of the unit: scores of the head's rows (qk), the
 * online-softmax update per row with the bias and causal mask (softmax),
 * then acc += P V (pv). With many rows (a prefill chunk: up to 768 rows,
 * the queries of a block times their GQA group) this is a flash tile: the
 * keys are staged once to f32, rotated and transposed (stage_kt), so the
 * rows x keys scores are a register-blocked product with no horizontal
 * sums (qk_t), the values are widened once to f32 (head_values) for
 * P.V's 6-row blocks, and the rows go through
 * qk_t, softmax and pv in passes of 48 so that a pass's scores stay in L1
 * (tile_head). The softmax of a row that sees the whole tile skips the
 * mask, a pass whose queries all precede the tile (the causal diagonal) is
 * skipped, and the next tile's K/V lines are prefetched across the
 * softmax rows. With few rows (decode, decode_head) the keys are rotated
 * in registers inside qk, a GQA group of 3 scored as one block with its
 * queries held in registers, and K/V rows are read as stored. A decode
 * tile's row offsets are computed once for all its KV heads, and one tile
 * ahead: while one head is computed the next head's rows (or the next
 * tile's first head's) are prefetched key by key - they sit in page-sized
 * runs the hardware prefetcher follows poorly.
 *
 * RoPE: the query is rotated once per item, exactly (posenc, double
 * angles). A key's angles are built per tile by angle addition
 * (attn_rope.c, a kernel file: three float roundings, any position, holes
 * or not), once for every KV head of the unit. Adjacent pairs
 * are de-interleaved in rotated keys and prepared queries alike, so the
 * rotation always has the NeoX halves form; the pairs' order in the halves
 * is the one the level's shuffles leave (enum attn_pairs: AVX2 skips the
 * lane-crossing permutes), and the keys' angle tables follow it.
 *
 * Quantised K/V (q8_0, q4_0): in the flash tile, values, and keys under
 * RoPE or in q4_0, are dequantised once per tile into f32 scratch and
 * everything after - RoPE, scores, P.V - runs on those values, so the
 * kernel is exact to the dequantised cache whatever the position scheme.
 * Decode reads q8_0 rows as stored and dequantises them in registers (the
 * same products, scale x level): the pass through scratch per tile it
 * saves had made q8_0 decode slower than f16 at half the bytes. q4_0 rows
 * still go through scratch. q8_0 keys that need no
 * rotation (none, ALiBi, T5) are scored in 8-bit integers against the
 * query quantised once per item in two levels (attn_q8.c: VNNI, AVX2 or
 * scalar, chosen at run time), exact to about 2^-16 of the query; decode
 * takes its own tile for them too (decode_q8_scores: rows as stored,
 * prefetched, values read in registers), where the flash tile had left
 * them unprefetched with their values dequantised through scratch.
 * Why RoPE keys are rotated after dequantising rather than the query
 * rotated per key: RoPE turns a stored key k at position p into R(p)k, and
 * q.R(p)k = (R(p)^T q).k, so an integer dot product on the stored int8 key
 * needs the query rotated back by each key's own angle and requantised -
 * O(head_dim) rotation and quantisation per key and per query row (each
 * row of a GQA group pays it), against one dequantise-and-rotate per key
 * shared by the group here; the bytes read, which bound decode at long
 * context, are the same either way.
 *
 * Memory: attn_create allocates the per-thread scratch (O(rows x (tile +
 * head_dim))) and the tables; attn_run grows the batch workspace (per-row
 * statistics, split partials, work list) once at its start, sized by queries,
 * sequences and threads, never by the number of cached tokens. The attention
 * mass, when asked for, is a second pass over the keys once every row's
 * final (m, l) is known: exact probabilities, no O(L) buffer.
 *
 * Threads: one parallel region per call (two with the mass); a context
 * serves one caller at a time (its scratch is per pool thread index, not
 * per caller).
 *
 * Decode at long context, where the time goes (bench_decode: the 576x30
 * shape, 16k tokens, an AMX Xeon of 2 cores). A layer's call reads f16
 * K/V at 47-50% of the triad's bus and 55-59% of what a read-only stream
 * of as many threads gets (bench_util.h's bench_read), q8_0 K/V at 34-39%
 * and 41-45%. Its compute alone (K/V in the caches) takes ~12.5 ns per key
 * and KV head on a core, about what a core's read stream needs to bring
 * the key's 256 bytes (~17 ns), and the two add up rather than overlap:
 * 26-27 ns on one thread. The compute, hot: qk 46-52%, pv 22-25%, softmax
 * 7-8%, the rest per tile. Per key and KV head at head dim 64, qk issues
 * ~39 vector operations (4 conversions, 4 de-interleaving permutes, 8 for
 * the rotation, 12 FMAs, 11 for its share of the transposing reduction),
 * pv 16, where the products themselves are 24 FMAs. What did not move it:
 *   - the layout: pages of 64 and 256 tokens (a head's rows in runs of 8
 *     and 32 KiB instead of 2) gave 49-51% and 53-55% against 49%; one
 *     pool per layer (a layer's consecutive pages adjacent) +3-4% for f16
 *     and -5% for q8_0;
 *   - the prefetch (attn_simd.c's prefetch_k): into L3 (T2) as into L2
 *     (T1), 50% and 49%; into L1 44%; none 40%; one line per 128-byte
 *     row, the stream prefetcher left to take the other, 41%.
 * A core's misses in flight bind: prefetches that keep its read stream
 * busy hold the miss buffers its own loads then wait for. Reaching 85% of
 * the bus would need the compute per key about halved. Keys stored
 * transposed within a page (element d of 16 keys in one vector: no
 * reduction, no de-interleaving, ~24 operations per key in qk instead of
 * ~39) would not do it: in a microbenchmark of qk alone (K in the caches,
 * the same 3 rows, rotation and f16 keys), rows took 7.1 ns per key and
 * head and the transposed layout 5.0-5.4, a sixth of the whole call's
 * compute, for a new cache layout.
 *
 * On a Zen 3 EPYC of 2 cores (AVX2 only; bench_decode, 4k tokens) the
 * picture differed in one place: pv waited for its values. Half of its
 * samples fell on the first product after a value load, and it took a
 * third of a cold call against a fifth of a hot one, while qk's keys had
 * arrived. Asking for the V lines in qk with the K lines (attn_simd.c's
 * PF_V_IN_QK) took a layer from 205 to 170 us on 2 threads, and 16k and
 * 32k to 0.70x; pv keeping 4 output vectors per row for 3 rows took the
 * hot call from 362 to 290 us on one thread. What is left is compute: hot,
 * one thread, 290 us for 4096 keys x 3 KV heads, qk 55%, pv 16-22%,
 * softmax 8% - so 2 threads need ~145 us where the layer's 3.1 MB take
 * ~105 us at a read stream's 29-30 GB/s: about 70% of a read stream is
 * the most this kernel can reach here, and it reached ~60%. Without RoPE
 * the hot call takes 228 us (rotation and de-interleaving: ~20%); keeping
 * the two halves of qk's sums apart (shorter FMA chains) spilled and took
 * 300. De-interleaving adjacent pairs with the in-lane shuffles alone,
 * the queries and angle tables laid out in the order they leave
 * (ATTN_PAIRS_SHUF8), took the hot call from 299 to 261-268 us (q8_0
 * keys 366 -> 338) and a 16k layer on one thread 0.95x (q8_0 0.93x).
 */
#include "attention_internal.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "cpu/pool.h"

#define CACHE_LINE 64
#define QROWS 768           /* query rows per unit when a sequence is split by KV head */
#define WHOLE_ROWS 64       /* a sequence of at most this many rows is one unit (decode) */
#define FLASH_PASS 48       /* rows per pass over a staged flash tile (tile_head) */
#define SPLIT_PER_THREAD 4  /* items per thread the split-K aims for */
#define MIN_SPLIT_KEYS 128  /* keys per split part, at least */

/* ------------------------------------------------------------------------
 * Types
 * ------------------------------------------------------------------------ */

/* One thread's scratch; every array starts on its own cache line. */
struct tscratch {
    float *S;                 /* [rows_max][ATTN_TILE] scores, then probabilities */
    float *acc;               /* [rows_max][head_dim] output accumulators */
    float *m, *l;             /* [rows_max] running max and sum */
    float *qr;                /* [rows_max][head_dim] prepared (scaled, rotated) queries */
    const float **qrow;       /* [rows_max] prepared query of each row */
    const float **qturn;      /* [rows_max] decode: the row's query turned back by a tile's
                                 first position (decode_turn_queries), in kst */
    int32_t *rpos;            /* [rows_max] position of each row's query */
    struct attn_bias *bias;   /* [rows_max] bias of each row's head */
    int32_t *kpos;            /* [ATTN_TILE] positions of the tile's keys, padded */
    int32_t kmin, kmax;       /* the smallest and largest of the tile's nt positions */
    size_t *tok;              /* [ATTN_TILE] byte offset of each key's page */
    int *slot;                /* [ATTN_TILE] each key's slot in its page */
    size_t *koff, *voff;      /* [2][ATTN_TILE] decode: byte offset of each key's K / V row
                                 from its head's rows in page 0, this tile's and the next's */
    const void **kp, **vp;    /* [ATTN_TILE] key and value rows of one head */
    float *kst;               /* [ATTN_TILE][head_dim] staged (converted, rotated) keys */
    float *vst;               /* [ATTN_TILE][head_dim] staged (converted) values; before
                                 them, a quantised key tile dequantised */
    struct attn_prefetch *pf; /* [1] rows of the next head or tile */
    struct attn_q8row *q8;    /* [rows_max] the prepared queries quantised (q8_0 keys, no RoPE) */
    uint8_t *q8_u1, *q8_u2;   /* [rows_max][head_dim] their levels */
    int16_t *q8_a16;          /* [rows_max][head_dim] the levels as one */
    float *q8_d;              /* [rows_max][head_dim / 32] their block scales */
    float *cs, *sn;           /* [ATTN_TILE][half] cos and sin of each key's angles */
    struct attn_rope_state rope; /* cached angles of the last block (attn_rope.c) */
    float *qbuf;              /* [head_dim + rot] a query being rotated, its cos/sin */
};

/* (sequence, query block, KV heads): rows share one scratch in one item. */
struct unit {
    int seq, q0, nq, g0, ng;
    int rows;        /* nq * ng * group */
    int k_end;       /* keys [0, k_end) may be visible */
    int nsplit;      /* parts along the keys; 1 = not split */
    size_t part0;    /* first partial row (rows of part i at part0 + i * rows) */
    int32_t qmax;    /* largest query position */
    atomic_int done; /* parts finished; the part that finishes last merges */
};

enum item_kind { ITEM_ATTN, ITEM_MASS };

struct item {
    enum item_kind kind;
    int unit;   /* ITEM_ATTN: the unit; ITEM_MASS: the sequence */
    int part;   /* ITEM_ATTN: part index, -1 when the unit is not split */
    int k0, k1; /* key range */
    double cost;
};

/* Per-sequence facts found while validating. */
struct seqinfo {
    int qoff;    /* first query of the sequence in the batch */
    bool sorted; /* positions non-decreasing */
};

struct attn_ctx {
    struct attn_params p;
    int32_t window; /* the current attn_run's kv->sliding_window */
    const struct attn_ops *ops;
    attn_qk_q8_fn qk_q8; /* q8_0 keys without RoPE: integer scores */
    int n_threads;
    int group;     /* query heads per KV head */
    int rows_max;  /* rows one item may hold */
    int rot, half; /* RoPE rotated dims and pairs; 0 without RoPE */
    enum attn_pairs pairs;      /* the pairs' slots in keys, queries and theta */
    attn_rope_fn rope_angles;   /* the keys' angles per tile (attn_rope.c) */
    struct attn_rope_tabs rope; /* its tables (the arrays below) */

    double *inv_freq;   /* [half] posenc's frequencies (queries) */
    double *theta;      /* [half] freq_scale * inv_freq (keys) */
    float *lo_c, *lo_s; /* [ATTN_ROPE_LO][half] cos/sin of lo * theta */
    float *hi_c, *hi_s; /* [ATTN_ROPE_LO][half] cos/sin of 64 * hi * theta */
    struct pos_t5_lut lut;
    bool has_lut;
    float *t5bias; /* [n_head][lut.n + 1] table[h][bucket(-d)], refreshed per run */

    /* The queries' RoPE cos/sin, by the query's index in the batch, and the
     * position each slot holds: every layer of a forward pass calls with
     * the same positions, so the angles are computed once per batch, not
     * once per layer and KV head (rope_queries). */
    float *qcs;      /* [cap_qcs][rot] cos, sin pairs */
    int32_t *qcs_pos; /* [cap_qcs] the position slot k was computed for */
    size_t cap_qcs, cap_qcs_pos, n_qcs; /* slots valid: [0, n_qcs) */

    struct tscratch *ts; /* [n_threads] */
    void *ts_mem;

    /* batch workspace, grown by attn_run */
    float *stats; /* [total_q][n_head][2] final (m, l) */
    float *parts; /* [..][head_dim + 2] split partials: m, l, acc */
    struct unit *units;
    struct item *items;
    struct seqinfo *si;
    size_t cap_stats, cap_parts, cap_units, cap_items, cap_si;

    size_t bytes; /* everything allocated */
    char err[192];
};

/* ------------------------------------------------------------------------
 * Small helpers
 * ------------------------------------------------------------------------ */

static size_t align_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

/* Bookkeeping allocation tracked in ctx->bytes; NULL on failure. */
static void *ctx_alloc(attn_ctx *ctx, size_t bytes)
{
    size_t n = align_up(bytes ? bytes : 1, CACHE_LINE);
    void *p = aligned_alloc(CACHE_LINE, n);
    ctx->bytes += p ? n : 0;
    return p;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

/* Carve one thread's scratch out of mem (or only measure it when mem is NULL). */
static size_t carve_scratch(struct tscratch *w, uint8_t *mem, int rows_max, int D, int half)
{
    size_t off = 0;
#define CARVE(field, count)                                                                        \
    do {                                                                                           \
        size_t bytes_ = align_up(sizeof(*w->field) * (size_t)(count), CACHE_LINE);                 \
        if (mem)                                                                                   \
            w->field = (void *)(mem + off);                                                        \
        off += bytes_;                                                                             \
    } while (0)
    CARVE(S, (size_t)rows_max * ATTN_TILE);
    CARVE(acc, (size_t)rows_max * D);
    CARVE(m, rows_max);
    CARVE(l, rows_max);
    CARVE(qr, (size_t)rows_max * D);
    CARVE(qrow, rows_max);
    CARVE(qturn, rows_max);
    CARVE(rpos, rows_max);
    CARVE(bias, rows_max);
    CARVE(kpos, ATTN_TILE);
    CARVE(tok, ATTN_TILE);
    CARVE(slot, ATTN_TILE);
    CARVE(koff, 2 * ATTN_TILE);
    CARVE(voff, 2 * ATTN_TILE);
    CARVE(kp, ATTN_TILE);
    CARVE(vp, ATTN_TILE);
    CARVE(kst, (size_t)ATTN_TILE * D);
    CARVE(vst, (size_t)ATTN_TILE * D);
    CARVE(pf, 1);
    CARVE(q8, rows_max);
    CARVE(q8_u1, (size_t)rows_max * D);
    CARVE(q8_u2, (size_t)rows_max * D);
    CARVE(q8_a16, (size_t)rows_max * D);
    CARVE(q8_d, (size_t)rows_max * (D / ATTN_QK + 1));
    CARVE(cs, (size_t)ATTN_TILE * (half ? half : 1));
    CARVE(sn, (size_t)ATTN_TILE * (half ? half : 1));
    CARVE(rope.base_c, half ? half : 1);
    CARVE(rope.base_s, half ? half : 1);
    CARVE(rope.cur_c, half ? half : 1);
    CARVE(rope.cur_s, half ? half : 1);
    CARVE(qbuf, 2 * D + 2);
#undef CARVE
    if (mem) {
        w->rope.base_block = -1;
        w->rope.cur_hi = -1;
        for (int r = 0; r < rows_max; r++)
            w->q8[r] = (struct attn_q8row){.u1 = w->q8_u1 + (size_t)r * D,
                                           .u2 = w->q8_u2 + (size_t)r * D,
                                           .a16 = w->q8_a16 + (size_t)r * D,
                                           .d = w->q8_d + (size_t)r * (D / ATTN_QK + 1)};
    }
    return off;
}

attn_ctx *attn_create(const struct attn_params *params, char *err, size_t errlen)
{
    if (!params) {
        attn_fail(err, errlen, "no parameters");
        return NULL;
    }
    if (attn_check_params(params, err, errlen))
        return NULL;
    attn_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        attn_fail(err, errlen, "out of memory (%zu bytes for the context)", sizeof(*ctx));
        return NULL;
    }
    ctx->bytes = sizeof(*ctx);
    ctx->p = *params;
    const struct attn_ops *simd = attn_simd_ops();
    ctx->ops = attn_softcap_ops(params->force_scalar || !simd ? &attn_scalar_ops : simd,
                                params->softcap);
    ctx->qk_q8 = attn_q8_select(params->force_scalar, &(const char *){NULL}); /* name unused */
    ctx->n_threads = cpu_pool_threads(params->n_threads);
    ctx->group = params->n_head / params->n_kv_head;
    ctx->rows_max = params->n_head > QROWS ? params->n_head : QROWS;
    const struct pos_scheme *ps = &params->pos;
    int D = params->head_dim;

    if (ps->kind == POS_ROPE) {
        ctx->rot = ps->rope_dims;
        ctx->half = ps->rope_dims / 2;
        int half = ctx->half;
        ctx->inv_freq = ctx_alloc(ctx, sizeof(double) * (size_t)half);
        ctx->theta = ctx_alloc(ctx, sizeof(double) * (size_t)half);
        size_t tab = sizeof(float) * ATTN_ROPE_LO * (size_t)half;
        ctx->lo_c = ctx_alloc(ctx, tab);
        ctx->lo_s = ctx_alloc(ctx, tab);
        ctx->hi_c = ctx_alloc(ctx, tab);
        ctx->hi_s = ctx_alloc(ctx, tab);
        if (!ctx->inv_freq || !ctx->theta || !ctx->lo_c || !ctx->lo_s || !ctx->hi_c || !ctx->hi_s)
            goto out_nomem;
        pos_rope_freqs(ctx->inv_freq, ps);
        ctx->pairs = ps->rope_pairing == POS_ROPE_NEOX        ? ATTN_PAIRS_NEOX
                     : ctx->ops->shuf8_pairs && half % 8 == 0 ? ATTN_PAIRS_SHUF8
                                                              : ATTN_PAIRS_ADJACENT;
        for (int i = 0; i < half; i++) /* in slot order, as are the tables built from it */
            ctx->theta[i] =
                (double)ps->rope_freq_scale * ctx->inv_freq[attn_pair_at(ctx->pairs, i)];
        for (int j = 0; j < ATTN_ROPE_LO; j++) {
            for (int i = 0; i < half; i++) {
                double a = (double)j * ctx->theta[i];
                double b = (double)(j * ATTN_ROPE_LO) * ctx->theta[i];
                ctx->lo_c[j * half + i] = (float)cos(a);
                ctx->lo_s[j * half + i] = (float)sin(a);
                ctx->hi_c[j * half + i] = (float)cos(b);
                ctx->hi_s[j * half + i] = (float)sin(b);
            }
        }
        ctx->rope = (struct attn_rope_tabs){.half = half,
                                            .theta = ctx->theta,
                                            .lo_c = ctx->lo_c,
                                            .lo_s = ctx->lo_s,
                                            .hi_c = ctx->hi_c,
                                            .hi_s = ctx->hi_s};
        ctx->rope_angles = attn_rope_select(params->force_scalar, NULL);
    }
    if (ps->kind == POS_T5) {
        if (pos_t5_lut_init(&ctx->lut, ps->t5_bidirectional, ps->t5_num_buckets,
                            ps->t5_max_distance))
            goto out_nomem;
        ctx->has_lut = true;
        ctx->bytes += sizeof(int32_t) * 2 * (size_t)ctx->lut.n;
        ctx->t5bias = ctx_alloc(ctx, sizeof(float) * (size_t)params->n_head * (ctx->lut.n + 1));
        if (!ctx->t5bias)
            goto out_nomem;
    }

    /* per-thread scratch, each thread's block starting on its own cache line */
    ctx->ts = ctx_alloc(ctx, sizeof(struct tscratch) * (size_t)ctx->n_threads);
    if (!ctx->ts)
        goto out_nomem;
    size_t per = carve_scratch(&ctx->ts[0], NULL, ctx->rows_max, D, ctx->half);
    ctx->ts_mem = ctx_alloc(ctx, per * (size_t)ctx->n_threads);
    if (!ctx->ts_mem)
        goto out_nomem;
    memset(ctx->ts_mem, 0, per * (size_t)ctx->n_threads); /* padding lanes read defined data */
    for (int i = 0; i < ctx->n_threads; i++)
        carve_scratch(&ctx->ts[i], (uint8_t *)ctx->ts_mem + per * (size_t)i, ctx->rows_max, D,
                      ctx->half);
    return ctx;

out_nomem:
    attn_fail(err, errlen, "out of memory creating the attention context");
    attn_destroy(ctx);
    return NULL;
}

void attn_destroy(attn_ctx *ctx)
{
    if (!ctx)
        return;
    free(ctx->inv_freq);
    free(ctx->theta);
    free(ctx->lo_c);
    free(ctx->lo_s);
    free(ctx->hi_c);
    free(ctx->hi_s);
    if (ctx->has_lut)
        pos_t5_lut_deinit(&ctx->lut);
    free(ctx->t5bias);
    free(ctx->ts);
    free(ctx->ts_mem);
    free(ctx->stats);
    free(ctx->parts);
    free(ctx->qcs);
    free(ctx->qcs_pos);
    free(ctx->units);
    free(ctx->items);
    free(ctx->si);
    free(ctx);
}

const char *attn_error(const attn_ctx *ctx)
{
    return ctx ? ctx->err : "no context";
}

size_t attn_workspace_bytes(const attn_ctx *ctx)
{
    return ctx ? ctx->bytes : 0;
}

/*
 * Make *buf hold at least n elements of size elt, replacing (not copying)
 * it when it is too small. 0 or -ENOMEM (the old buffer is kept).
 */
static int grow(attn_ctx *ctx, void **buf, size_t *cap, size_t n, size_t elt)
{
    if (n <= *cap)
        return 0;
    void *p = aligned_alloc(CACHE_LINE, align_up(n * elt, CACHE_LINE));
    if (!p)
        return -ENOMEM;
    free(*buf);
    ctx->bytes += align_up(n * elt, CACHE_LINE) - align_up(*cap * elt, CACHE_LINE) * (*cap > 0);
    *buf = p;
    *cap = n;
    return 0;
}

/* ------------------------------------------------------------------------
 * Validation and planning
 * ------------------------------------------------------------------------ */

static __attribute__((format(printf, 3, 4))) int run_fail(attn_ctx *ctx, int code, const char *fmt,
                                                         ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(ctx->err, sizeof(ctx->err), fmt, ap);
    va_end(ap);
    return code;
}

static int validate(attn_ctx *ctx, const struct attn_kv *kv, const struct attn_seq *seqs,
                    int n_seqs, int *total_q)
{
    const struct attn_params *p = &ctx->p;
    if (!kv || (n_seqs > 0 && !seqs) || n_seqs < 0)
        return run_fail(ctx, -EINVAL, "no kv description or sequences");
    if (kv->page_tokens < 1)
        return run_fail(ctx, -EINVAL, "page_tokens %d must be >= 1", kv->page_tokens);
    if (kv->sliding_window < 0)
        return run_fail(ctx, -EINVAL, "sliding_window %d must be >= 0", kv->sliding_window);
    ctx->window = kv->sliding_window;
    char why[160];
    if (attn_type_check(kv->k_type, p->head_dim, why, sizeof(why)) ||
        attn_type_check(kv->v_type, p->head_dim, why, sizeof(why)))
        return run_fail(ctx, -EINVAL, "%s", why);
    const size_t per_head = (size_t)p->n_kv_head * (size_t)kv->page_tokens;
    const size_t kblock = per_head * attn_row_bytes(kv->k_type, p->head_dim);
    const size_t vblock = per_head * attn_row_bytes(kv->v_type, p->head_dim);
    long tq = 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        if (sq->n_kv < 0 || sq->n_q < 0)
            return run_fail(ctx, -EINVAL, "sequence %d: negative n_kv %d or n_q %d", s, sq->n_kv,
                            sq->n_q);
        if (sq->n_q > 0 && (!sq->q || !sq->out || !sq->q_pos))
            return run_fail(ctx, -EINVAL, "sequence %d: %d queries but no q, out or q_pos", s,
                            sq->n_q);
        if (sq->n_kv > 0 && (!sq->pos || !sq->page_table))
            return run_fail(ctx, -EINVAL, "sequence %d: %d cached tokens but no pos or page_table",
                            s, sq->n_kv);
        for (int i = 0; i < sq->n_q; i++)
            if (sq->q_pos[i] < 0)
                return run_fail(ctx, -EINVAL, "sequence %d: query %d has position %d < 0", s, i,
                                sq->q_pos[i]);
        tq += sq->n_q;
        if (tq > INT32_MAX / 2)
            return run_fail(ctx, -EINVAL, "too many queries in one call");
        ctx->si[s].sorted = true;
        if (sq->n_kv == 0)
            continue;
        if (!kv->base)
            return run_fail(ctx, -EINVAL, "kv base is NULL");
        if (kv->k_offset + kblock > kv->page_bytes || kv->v_offset + vblock > kv->page_bytes)
            return run_fail(ctx, -EINVAL,
                            "a layer's K or V block (%zu / %zu bytes at %zu / %zu) does not fit "
                            "in a %zu-byte page",
                            kblock, vblock, kv->k_offset, kv->v_offset, kv->page_bytes);
        int n_pages = (sq->n_kv + kv->page_tokens - 1) / kv->page_tokens;
        for (int i = 0; i < n_pages; i++) {
            int32_t id = sq->page_table[i];
            if (id < 0 || (kv->n_pages > 0 && id >= kv->n_pages))
                return run_fail(ctx, -EINVAL, "sequence %d: page_table[%d] = %d is outside 0..%d",
                                s, i, id, kv->n_pages > 0 ? kv->n_pages - 1 : INT32_MAX);
        }
        bool sorted = true;
        for (int i = 0; i < sq->n_kv; i++) {
            if (sq->pos[i] < 0)
                return run_fail(ctx, -EINVAL, "sequence %d: key %d has position %d < 0", s, i,
                                sq->pos[i]);
            if (i && sq->pos[i] < sq->pos[i - 1])
                sorted = false;
        }
        ctx->si[s].sorted = sorted;
    }
    *total_q = (int)tq;
    return 0;
}

/* Number of keys [0, n) with pos <= qmax, when pos is sorted. */
static int visible_end(const int32_t *pos, int n, int32_t qmax)
{
    int lo = 0, hi = n;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (pos[mid] <= qmax)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Item order: larger cost first, ties by unit then key range (deterministic). */
static bool item_before(const struct item *x, const struct item *y)
{
    if (x->cost != y->cost)
        return x->cost > y->cost;
    if (x->unit != y->unit)
        return x->unit < y->unit;
    return x->k0 < y->k0;
}

/* In-place heapsort (qsort may allocate; attn_run does not). */
static void sort_items(struct item *a, int n)
{
    for (int end = n, start = n / 2 - 1;;) {
        int root;
        if (start >= 0) {
            root = start--;
        } else {
            if (--end <= 0)
                return;
            struct item tmp = a[0];
            a[0] = a[end];
            a[end] = tmp;
            root = 0;
        }
        for (int child; (child = 2 * root + 1) < end; root = child) {
            /* max-heap in final order: the item that goes last rises */
            if (child + 1 < end && item_before(&a[child], &a[child + 1]))
                child++;
            if (!item_before(&a[root], &a[child]))
                break;
            struct item tmp = a[root];
            a[root] = a[child];
            a[child] = tmp;
        }
    }
}

/* Queries per unit when a sequence is cut by KV head. */
static int unit_qblock(const attn_ctx *ctx)
{
    int qb = QROWS / ctx->group;
    return qb > 0 ? qb : 1;
}

static bool whole_sequence_unit(const attn_ctx *ctx, const struct attn_seq *sq)
{
    int whole = ctx->p.n_head > WHOLE_ROWS ? ctx->p.n_head : WHOLE_ROWS;
    return (long)sq->n_q * ctx->p.n_head <= whole;
}

/*
 * Number of parts a range of n keys with the given cost splits into, and
 * its chunk size. Where the key floor (MIN_SPLIT_KEYS) leaves fewer parts
 * than the cost asks for, their count is rounded down to a multiple of the
 * nth threads: a decode step's one unit over ~1000 keys made 3 parts for 2
 * threads, and one thread ran two of them while the other waited.
 *
 * Below 2 x MIN_SPLIT_KEYS a decode step is one item, and on 2 threads the
 * other thread waits for it: measured in a q8_0 576x30 decode from 97 to
 * 397 keys (the pool's own timers, an AMX Xeon), the caller ran 13-14 us
 * of attention per layer and the worker 5.4 on average. A lower floor
 * does not pay: at 64 keys the two ran 13.0 and 9.1-9.5 us, at 32 keys
 * 13.7 and 12.7-12.9, and the step was as fast (229-233 tokens/s against
 * 226-240) or slower (217-219): a part's fixed cost (its queries
 * prepared, its partial merged) is most of the work at that length.
 */
static int split_range(int n, double cost, double target, int nth, int *chunk)
{
    int nsplit = 1;
    if (target > 0 && cost > target) {
        double want = ceil(cost / target);
        int most = n / MIN_SPLIT_KEYS;
        nsplit = want < most ? (int)want : most;
        if (nsplit == most && nsplit > nth)
            nsplit -= nsplit % nth;
        if (nsplit < 1)
            nsplit = 1;
    }
    int c = (n + nsplit - 1) / nsplit;
    c = (c + ATTN_TILE - 1) / ATTN_TILE * ATTN_TILE;
    if (c < 1)
        c = ATTN_TILE;
    *chunk = c;
    return n > 0 ? (n + c - 1) / c : 1;
}

/*
 * Build units and items for the batch. The workspace was sized by bounds
 * that depend on queries and threads only; see attn_run.
 */
static void plan(attn_ctx *ctx, const struct attn_seq *seqs, int n_seqs, int *n_units_out,
                 int *n_items_out, int *n_attn_items_out)
{
    const int H = ctx->p.n_head, G = ctx->p.n_kv_head, group = ctx->group;
    int nu = 0;
    double total = 0, total_mass = 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        if (sq->n_q == 0)
            continue;
        if (sq->mass)
            total_mass += (double)sq->n_q * H * (sq->n_kv + 1);
        int qb = whole_sequence_unit(ctx, sq) ? sq->n_q : unit_qblock(ctx);
        int ng = whole_sequence_unit(ctx, sq) ? G : 1;
        for (int g0 = 0; g0 < G; g0 += ng) {
            for (int q0 = 0; q0 < sq->n_q; q0 += qb) {
                struct unit *u = &ctx->units[nu++];
                u->seq = s;
                u->q0 = q0;
                u->nq = sq->n_q - q0 < qb ? sq->n_q - q0 : qb;
                u->g0 = g0;
                u->ng = ng;
                u->rows = u->nq * ng * group;
                int32_t qmax = 0;
                for (int i = 0; i < u->nq; i++)
                    qmax = sq->q_pos[q0 + i] > qmax ? sq->q_pos[q0 + i] : qmax;
                u->qmax = qmax;
                u->k_end = ctx->si[s].sorted ? visible_end(sq->pos, sq->n_kv, qmax) : sq->n_kv;
                atomic_init(&u->done, 0);
                total += (double)u->rows * (u->k_end + 1);
            }
        }
    }
    double target = ctx->n_threads > 1 ? total / (ctx->n_threads * SPLIT_PER_THREAD) : 0;
    int ni = 0;
    size_t part = 0;
    for (int ui = 0; ui < nu; ui++) {
        struct unit *u = &ctx->units[ui];
        double cost = (double)u->rows * (u->k_end + 1);
        int chunk;
        u->nsplit = split_range(u->k_end, cost, target, ctx->n_threads, &chunk);
        u->part0 = part;
        if (u->nsplit > 1)
            part += (size_t)u->nsplit * u->rows;
        for (int i = 0; i < u->nsplit; i++) {
            struct item *it = &ctx->items[ni++];
            it->kind = ITEM_ATTN;
            it->unit = ui;
            it->part = u->nsplit > 1 ? i : -1;
            it->k0 = i * chunk;
            it->k1 = (i + 1) * chunk < u->k_end ? (i + 1) * chunk : u->k_end;
            it->cost = (double)u->rows * (it->k1 - it->k0 + 1);
        }
    }
    int n_attn = ni;
    double target_m = ctx->n_threads > 1 ? total_mass / (ctx->n_threads * SPLIT_PER_THREAD) : 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        if (!sq->mass || sq->n_kv == 0 || sq->n_q == 0)
            continue; /* no queries: zeroed after the parallel region */
        double cost = (double)sq->n_q * H * (sq->n_kv + 1);
        int chunk;
        int n = split_range(sq->n_kv, cost, target_m, ctx->n_threads, &chunk);
        for (int i = 0; i < n; i++) {
            struct item *it = &ctx->items[ni++];
            it->kind = ITEM_MASS;
            it->unit = s;
            it->part = -1;
            it->k0 = i * chunk;
            it->k1 = (i + 1) * chunk < sq->n_kv ? (i + 1) * chunk : sq->n_kv;
            it->cost = (double)sq->n_q * H * (it->k1 - it->k0 + 1);
        }
    }
    /* largest first, so the dynamic schedule ends balanced */
    sort_items(ctx->items, n_attn);
    sort_items(ctx->items + n_attn, ni - n_attn);
    *n_units_out = nu;
    *n_items_out = ni;
    *n_attn_items_out = n_attn;
}

/* ------------------------------------------------------------------------
 * The tile loop
 * ------------------------------------------------------------------------ */

/*
 * Load the positions and page-slot offsets of keys [k0, k0 + nt) into the
 * scratch, padded to ATTN_TILE. Returns the smallest position.
 */
static void tile_offsets(size_t *tok, int *slot, const struct attn_kv *kv,
                         const struct attn_seq *sq, int k0, int nt)
{
    const int pt = kv->page_tokens;
    for (int t = 0; t < nt; t++) {
        int k = k0 + t;
        tok[t] = (size_t)sq->page_table[k / pt] * kv->page_bytes;
        slot[t] = k % pt;
    }
}

/* The positions of keys [k0, k0 + nt), padded to ATTN_TILE; returns the smallest. */
static int32_t tile_positions(struct tscratch *w, const struct attn_seq *sq, int k0, int nt)
{
    int32_t pmin = INT32_MAX, pmax = INT32_MIN;
    for (int t = 0; t < nt; t++) {
        w->kpos[t] = sq->pos[k0 + t];
        pmin = sq->pos[k0 + t] < pmin ? sq->pos[k0 + t] : pmin;
        pmax = sq->pos[k0 + t] > pmax ? sq->pos[k0 + t] : pmax;
    }
    w->kmin = pmin;
    w->kmax = pmax;
    for (int t = nt; t < ATTN_TILE; t++)
        w->kpos[t] = INT32_MAX;
    return pmin;
}

static int32_t load_tile(struct tscratch *w, const struct attn_kv *kv, const struct attn_seq *sq,
                         int k0, int nt)
{
    int32_t pmin = tile_positions(w, sq, k0, nt);
    tile_offsets(w->tok, w->slot, kv, sq, k0, nt);
    for (int t = nt; t < ATTN_TILE; t++) {
        w->tok[t] = w->tok[nt - 1];
        w->slot[t] = w->slot[nt - 1];
    }
    return pmin;
}

/* Whether q8_0 keys are scored in integers (no rotation to apply to them). */
static bool int8_keys(const attn_ctx *ctx, const struct attn_kv *kv)
{
    return kv->k_type == ATTN_Q8_0 && !ctx->rot;
}

/* Quantise the prepared queries of rows [0, rows) for int8_keys scoring. */
static void setup_q8(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv, int rows)
{
    if (int8_keys(ctx, kv))
        for (int r = 0; r < rows; r++)
            attn_q8_query(&w->q8[r], w->qrow[r], ctx->p.head_dim);
}

/*
 * Point w->kp and w->vp at KV head g's key and value rows of the tile;
 * quantised keys are dequantised once (into vst, free until the values).
 * Returns the type the key rows now have.
 */
static enum attn_type head_rows(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv,
                                int g, int nt)
{
    const int D = ctx->p.head_dim;
    const size_t krow = attn_row_bytes(kv->k_type, D), vrow = attn_row_bytes(kv->v_type, D);
    const uint8_t *kb = kv->base + kv->k_offset + (size_t)g * kv->page_tokens * krow;
    const uint8_t *vb = kv->base + kv->v_offset + (size_t)g * kv->page_tokens * vrow;
    for (int t = 0; t < ATTN_TILE; t++) {
        w->kp[t] = kb + w->tok[t] + (size_t)w->slot[t] * krow;
        w->vp[t] = vb + w->tok[t] + (size_t)w->slot[t] * vrow;
    }
    enum attn_type kt = kv->k_type;
    if (attn_type_blocked(kt) && !int8_keys(ctx, kv)) {
        /* exact to the stored values: rotation and scores run on the f32 rows */
        ctx->ops->dequant(w->vst, w->kp, nt, kt, D);
        for (int t = 0; t < ATTN_TILE; t++)
            w->kp[t] = w->vst + (size_t)(t < nt ? t : nt - 1) * D;
        kt = ATTN_F32;
    }
    return kt;
}

/* The flash tile's keys: staged once (converted, rotated) and transposed into w->kst. */
static void stage_head_keys(const attn_ctx *ctx, struct tscratch *w, enum attn_type kt, int nt)
{
    ctx->ops->stage_kt(w->kst, w->kp, nt, kt, ctx->p.head_dim, ctx->rot, ctx->pairs, w->cs, w->sn,
                       ctx->half);
}

/*
 * Scores of rows_h rows (prepared queries q) against KV head g's keys of
 * the tile, into w->S; also points w->vp at the head's value rows. Keys are
 * staged once (converted, rotated) when many rows reuse them, and rotated
 * in registers when few do.
 */
static void head_scores(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv, int g,
                        int nt, int r0, int rows_h, const struct attn_prefetch *pf)
{
    const float *const *q = w->qrow + r0;
    const int D = ctx->p.head_dim;
    enum attn_type kt = head_rows(ctx, w, kv, g, nt);
    if (int8_keys(ctx, kv)) {
        ctx->qk_q8(w->S, w->q8 + r0, rows_h, w->kp, nt, D);
        return;
    }
    if (rows_h <= 4 && ctx->rot) {
        ctx->ops->qk_rope(w->S, q, rows_h, w->kp, nt, kt, D, ctx->rot, ctx->pairs, w->cs, w->sn,
                          ctx->half, pf);
        return;
    }
    if (rows_h <= 4) {
        ctx->ops->qk(w->S, q, rows_h, w->kp, nt, kt, D, pf);
        return;
    }
    /* many rows: the keys staged once, transposed, for a register-blocked product */
    stage_head_keys(ctx, w, kt, nt);
    ctx->ops->qk_t(w->S, q, rows_h, w->kst, D);
}

/* The bias of query head h. */
static struct attn_bias head_bias(const attn_ctx *ctx, int h)
{
    struct attn_bias b = {.kind = POS_NONE, .window = ctx->window, .softcap = ctx->p.softcap};
    if (ctx->p.pos.kind == POS_ALIBI) {
        b.kind = POS_ALIBI;
        b.slope = ctx->p.pos.alibi_slopes[h];
    } else if (ctx->p.pos.kind == POS_T5) {
        b.kind = POS_T5;
        b.t5 = ctx->t5bias + (size_t)h * (ctx->lut.n + 1);
        b.t5_n = ctx->lut.n;
    }
    return b;
}

/* dst = q * scale, rotated by pos_q's exact angles cs, laid out like staged keys. */
static void prep_row(const attn_ctx *ctx, float *x, const float *cs, const float *src, float *dst)
{
    const int D = ctx->p.head_dim, rot = ctx->rot, half = ctx->half;
    const float scale = ctx->p.scale;
    if (!rot) {
        for (int d = 0; d < D; d++)
            dst[d] = src[d] * scale;
        return;
    }
    memcpy(x, src, sizeof(float) * (size_t)D);
    pos_rope_apply(x, cs, rot, ctx->p.pos.rope_pairing);
    if (ctx->pairs != ATTN_PAIRS_NEOX) {
        for (int i = 0; i < half; i++) {
            int p = attn_pair_at(ctx->pairs, i);
            dst[i] = x[2 * p] * scale;
            dst[half + i] = x[2 * p + 1] * scale;
        }
    } else {
        for (int d = 0; d < rot; d++)
            dst[d] = x[d] * scale;
    }
    for (int d = rot; d < D; d++)
        dst[d] = x[d] * scale;
}

/*
 * Set up rows [0, rows) of a unit-shaped block: for each of ng KV heads from
 * g0, each of nq queries from q0, each query head of the group. Row order is
 * (head of block, query, group member), so one KV head's rows are contiguous.
 * Each row's query is prepared into the thread's scratch.
 */
static void setup_rows(const attn_ctx *ctx, struct tscratch *w, const struct attn_seq *sq, int qoff,
                       int q0, int nq, int g0, int ng)
{
    const int H = ctx->p.n_head, D = ctx->p.head_dim, group = ctx->group;
    float *x = w->qbuf;
    for (int qi = 0; qi < nq; qi++) {
        const float *cs = ctx->rot ? ctx->qcs + (size_t)(qoff + q0 + qi) * ctx->rot : NULL;
        for (int hh = 0; hh < ng; hh++)
            for (int j = 0; j < group; j++) {
                int r = (hh * nq + qi) * group + j, h = (g0 + hh) * group + j;
                float *dst = w->qr + (size_t)r * D;
                prep_row(ctx, x, cs, sq->q + ((size_t)(q0 + qi) * H + h) * D, dst);
                w->qrow[r] = dst;
                w->rpos[r] = sq->q_pos[q0 + qi];
                w->bias[r] = head_bias(ctx, h);
            }
    }
}

/* Row r of a unit -> (query, head). */
static void row_coords(const attn_ctx *ctx, const struct unit *u, int r, int *query, int *head)
{
    int per_head = u->nq * ctx->group;
    int hh = r / per_head, rem = r % per_head;
    *query = u->q0 + rem / ctx->group;
    *head = (u->g0 + hh) * ctx->group + rem % ctx->group;
}

/*
 * The values of a head's tile as P.V reads them (w->vp, the type returned):
 * quantised rows dequantised into vst (after the keys, which may have used
 * it), and in the flash tile 16-bit rows widened there too. The flash
 * tile's P.V reads every value row once per block of 6 rows, so a
 * conversion in its loop is paid 128 times per tile at 768 rows, where it
 * sits beside 24 FMAs per key and block: widened once, pv's share of a 4k
 * q8_0 prefill fell from 24% to 20% of the samples and a 16k f16 prefill
 * ran 320.6-322.7 -> 350.1-350.4 tokens/s (AMX Xeon, 2 threads,
 * alternated). Few rows (decode, and prefill rows against int8 keys) read
 * 16-bit rows as stored: there each row is read by one block.
 */
static enum attn_type head_values(const attn_ctx *ctx, struct tscratch *w, enum attn_type vt,
                                  int nt, bool flash)
{
    const int D = ctx->p.head_dim;
    const bool wide16 = flash && (vt == ATTN_F16 || vt == ATTN_BF16);
    if (!attn_type_blocked(vt) && !wide16)
        return vt;
    ctx->ops->dequant(w->vst, w->vp, nt, vt, D);
    for (int t = 0; t < nt; t++)
        w->vp[t] = w->vst + (size_t)t * D;
    return ATTN_F32;
}

/*
 * Request the first `upto` of pf's lines (key t's K lines, then its V
 * lines, key after key) that *done does not yet count, into L2 (as
 * decode's qk does). The flash tile spreads the next tile's rows over its
 * softmax rows, a line or two per row: asked for all at once, the requests
 * filled the miss buffers and the prefetch instructions themselves
 * stalled. Always inlined: GCC finds a function that only prefetches pure
 * and drops its calls.
 */
static inline __attribute__((always_inline)) void prefetch_upto(const struct attn_prefetch *pf,
                                                                int *done, int upto)
{
    const int per = pf->klines + pf->vlines;
    for (; *done < upto; ++*done) {
        const int t = *done / per, j = *done % per;
        const char *p = j < pf->klines ? pf->k + pf->koff[t] + (size_t)j * 64
                                       : pf->v + pf->voff[t] + (size_t)(j - pf->klines) * 64;
        __builtin_prefetch(p, 0, 2);
    }
}

/*
 * The key positions row r's softmax needs: NULL when the tile is full and
 * every key of it is visible to the row with no bias to add (ALiBi and T5
 * add one per key), so the softmax skips the mask - at long context almost
 * every tile of a prefill chunk, all but the causal diagonal's.
 */
static const int32_t *row_kpos(const struct tscratch *w, int nt, int r)
{
    const struct attn_bias *b = &w->bias[r];
    bool plain = b->kind != POS_ALIBI && b->kind != POS_T5;
    bool visible = w->kmax <= w->rpos[r] && w->kmin > attn_window_floor(w->rpos[r], b->window);
    return nt == ATTN_TILE && plain && visible ? NULL : w->kpos;
}

/*
 * Whether every key of the tile is in the future of rows [r, r + n): then
 * their softmax would mask the whole tile and leave (m, l, acc) as they
 * are, so the pass is skipped - on the causal diagonal of a prefill chunk,
 * the passes of its earlier queries.
 */
static bool pass_before_tile(const struct tscratch *w, int r, int n)
{
    int32_t qmax = INT32_MIN;
    for (int i = r; i < r + n; i++)
        qmax = w->rpos[i] > qmax ? w->rpos[i] : qmax;
    return qmax < w->kmin;
}

/*
 * One KV head's part of a tile for rows [r0, r0 + rows_h) of the unit:
 * scores, online softmax, acc += P.V. With many rows (the flash tile) the
 * keys are staged once for all of them, and the rows then go
 * through in passes of FLASH_PASS, so that a pass's scores stay in L1 from
 * the product that writes them to the one that reads them.
 */
static void tile_head(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv, int g,
                      int nt, int r0, int rows_h, const struct attn_prefetch *pf)
{
    const int D = ctx->p.head_dim;
    const struct attn_ops *ops = ctx->ops;
    const bool flash = rows_h > 4 && !int8_keys(ctx, kv);
    if (flash)
        stage_head_keys(ctx, w, head_rows(ctx, w, kv, g, nt), nt);
    else
        head_scores(ctx, w, kv, g, nt, r0, rows_h, pf);
    enum attn_type vt = head_values(ctx, w, kv->v_type, nt, flash);
    const int pass = flash ? FLASH_PASS : rows_h;
    const int pf_lines = pf ? pf->n * (pf->klines + pf->vlines) : 0;
    int pf_done = 0;
    for (int p0 = 0; p0 < rows_h; p0 += pass) {
        const int n = rows_h - p0 < pass ? rows_h - p0 : pass, r = r0 + p0;
        if (flash && pass_before_tile(w, r, n))
            continue;
        if (flash)
            ops->qk_t(w->S, w->qrow + r, n, w->kst, D);
        for (int i = 0; i < n; i++) {
            if (flash && pf) /* the next tile's lines, spread over the rows */
                prefetch_upto(pf, &pf_done, (int)((long)pf_lines * (p0 + i + 1) / rows_h));
            /* the flash tile skips the mask where it can */
            ops->softmax(w->S + (size_t)i * ATTN_TILE, nt, flash ? row_kpos(w, nt, r + i) : w->kpos,
                         w->rpos[r + i], &w->bias[r + i], &w->m[r + i], &w->l[r + i],
                         w->acc + (size_t)(r + i) * D, D);
        }
        /* the flash tile asked for the next tile's V lines with its K lines */
        ops->pv(w->acc + (size_t)r * D, n, w->S, w->vp, nt, vt, D, flash ? NULL : pf);
    }
}

/*
 * Decode (few rows): the byte offsets of keys [k0, k0 + n)'s K and V rows
 * from a head's rows in page 0, padded to ATTN_TILE with the last; once
 * per tile for every KV head of the unit, as the RoPE angles are.
 */
static void decode_offsets(const attn_ctx *ctx, const struct attn_kv *kv,
                           const struct attn_seq *sq, int k0, int n, size_t *koff, size_t *voff)
{
    const size_t krow = attn_row_bytes(kv->k_type, ctx->p.head_dim);
    const size_t vrow = attn_row_bytes(kv->v_type, ctx->p.head_dim);
    const int pt = kv->page_tokens;
    int pg = k0 / pt, slot = k0 % pt;
    size_t page = (size_t)sq->page_table[pg] * kv->page_bytes;
    for (int t = 0; t < n; t++) {
        koff[t] = page + (size_t)slot * krow;
        voff[t] = page + (size_t)slot * vrow;
        if (++slot == pt && t + 1 < n) {
            slot = 0;
            page = (size_t)sq->page_table[++pg] * kv->page_bytes;
        }
    }
    for (int t = n; t < ATTN_TILE; t++) {
        koff[t] = koff[n - 1];
        voff[t] = voff[n - 1];
    }
}

/* Where KV head g's rows of page 0 start. */
static const uint8_t *head_k(const attn_ctx *ctx, const struct attn_kv *kv, int g)
{
    return kv->base + kv->k_offset +
           (size_t)g * kv->page_tokens * attn_row_bytes(kv->k_type, ctx->p.head_dim);
}
static const uint8_t *head_v(const attn_ctx *ctx, const struct attn_kv *kv, int g)
{
    return kv->base + kv->v_offset +
           (size_t)g * kv->page_tokens * attn_row_bytes(kv->v_type, ctx->p.head_dim);
}

/* Ask decode's qk to prefetch KV head g's rows of n keys at offsets koff, voff. */
static const struct attn_prefetch *decode_prefetch(const attn_ctx *ctx, struct attn_prefetch *pf,
                                                   const struct attn_kv *kv, int g,
                                                   const size_t *koff, const size_t *voff, int n)
{
    const int D = ctx->p.head_dim;
    *pf = (struct attn_prefetch){.k = (const char *)head_k(ctx, kv, g),
                                 .v = (const char *)head_v(ctx, kv, g),
                                 .koff = koff,
                                 .voff = voff,
                                 .n = n,
                                 .klines = (int)((attn_row_bytes(kv->k_type, D) + 63) / 64),
                                 .vlines = (int)((attn_row_bytes(kv->v_type, D) + 63) / 64)};
    return n > 0 ? pf : NULL;
}

/* The queries a decode tile's keys are scored against, and the keys' angles. */
struct decode_rope {
    const float *const *q; /* [rows] */
    const float *cs, *sn;  /* [ATTN_TILE][half] */
};

/*
 * RoPE over a decode tile of consecutive positions P, P + 1, ...: key t's
 * rotation is R(P + t) = R(P) R(t), and q.R(P)R(t)k = (R(P)^T q).R(t)k, so
 * the unit's queries are turned back by P's angles once per tile (rows x
 * half pairs) and each key is rotated by t's angles, which are the rows of
 * a table built once (ctx->lo_c, lo_s: t < ATTN_ROPE_LO) - no angles per
 * key, where the tile's angles cost one complex product per pair and key.
 * The result is as exact (one more f32 rotation of the query instead of
 * one more complex product per angle). False, with nothing done, when the
 * positions have a hole or the rows do not fit the scratch.
 */
static bool decode_turn_queries(const attn_ctx *ctx, struct tscratch *w, int rows, int nt)
{
    const int D = ctx->p.head_dim, half = ctx->half, rot = ctx->rot;
    const int32_t p0 = w->kpos[0];
    if (rows > ATTN_TILE || ATTN_TILE > ATTN_ROPE_LO || p0 > INT32_MAX - ATTN_TILE)
        return false;
    for (int t = 1; t < nt; t++)
        if (w->kpos[t] != p0 + t)
            return false;
    float *c = w->qbuf, *s = w->qbuf + half; /* 2 * half <= 2 * D + 2 floats */
    ctx->rope_angles(&ctx->rope, &w->rope, &p0, 1, c, s);
    for (int r = 0; r < rows; r++) {
        const float *x = w->qrow[r];
        float *y = w->kst + (size_t)r * D;
        for (int i = 0; i < half; i++) {
            float lc = x[i] * c[i], hs = x[half + i] * s[i];
            float hc = x[half + i] * c[i], ls = x[i] * s[i];
            y[i] = lc + hs;
            y[half + i] = hc - ls;
        }
        for (int d = rot; d < D; d++)
            y[d] = x[d];
        w->qturn[r] = y;
    }
    return true;
}

/* Keys per call of the integer scores in decode, each chunk's lines asked for before it. */
#define Q8_CHUNK 16

/*
 * Decode's scores against q8_0 keys in integers (int8_keys): the integer
 * kernels take no prefetch of their own, so the tile goes to them in
 * chunks of Q8_CHUNK keys and pf's lines of each chunk's keys are asked
 * for just before it, the lines the level's qk would ask for
 * (attn_ops.pf_scores). A score does not depend on its chunk.
 */
static void decode_q8_scores(const attn_ctx *ctx, struct tscratch *w, int nt, int r0, int rows_h,
                             const struct attn_prefetch *pf)
{
    const enum attn_pf_scores how = pf ? ctx->ops->pf_scores : ATTN_PF_NONE;
    for (int c0 = 0; c0 < nt; c0 += Q8_CHUNK) {
        const int n = nt - c0 < Q8_CHUNK ? nt - c0 : Q8_CHUNK;
        for (int t = c0; how != ATTN_PF_NONE && t < c0 + n && t < pf->n; t++) {
            for (int l = 0; l < pf->klines; l++)
                __builtin_prefetch(pf->k + pf->koff[t] + (size_t)l * 64, 0, 2);
            for (int l = 0; how == ATTN_PF_KV && l < pf->vlines; l++)
                __builtin_prefetch(pf->v + pf->voff[t] + (size_t)l * 64, 0, 2);
        }
        ctx->qk_q8(w->S + c0, w->q8 + r0, rows_h, w->kp + c0, n, ctx->p.head_dim);
    }
}

/*
 * One KV head's part of a tile for few rows (decode): scores with the keys
 * rotated in registers (or, for q8_0 keys without rotation, in integers),
 * the online softmax, acc += P.V. Rows are read as stored - f16, bf16, f32
 * and q8_0 converted (q8_0 dequantised) in registers, so a q8_0 tile costs
 * no pass through scratch; q4_0 rows are dequantised into scratch first.
 */
static void decode_head(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv, int g,
                        const size_t *koff, const size_t *voff, int nt, int r0, int rows_h,
                        const struct decode_rope *dr, const struct attn_prefetch *pf)
{
    const int D = ctx->p.head_dim;
    const struct attn_ops *ops = ctx->ops;
    const uint8_t *kb = head_k(ctx, kv, g), *vb = head_v(ctx, kv, g);
    /* through locals: a store through w->kp may alias w->kp itself, so GCC
     * reloaded both each key and left the loop scalar (~3% of a 16k step) */
    const void **kp = w->kp, **vp = w->vp;
    for (int t = 0; t < ATTN_TILE; t++) {
        kp[t] = kb + koff[t];
        vp[t] = vb + voff[t];
    }
    enum attn_type kt = kv->k_type, vt = kv->v_type;
    if (kt == ATTN_Q4_0) { /* into vst, free until the values */
        ops->dequant(w->vst, w->kp, nt, kt, D);
        for (int t = 0; t < ATTN_TILE; t++)
            w->kp[t] = w->vst + (size_t)(t < nt ? t : nt - 1) * D;
        kt = ATTN_F32;
    }
    if (int8_keys(ctx, kv))
        decode_q8_scores(ctx, w, nt, r0, rows_h, pf);
    else if (ctx->rot)
        ops->qk_rope(w->S, dr->q + r0, rows_h, w->kp, nt, kt, D, ctx->rot, ctx->pairs, dr->cs,
                     dr->sn, ctx->half, pf);
    else
        ops->qk(w->S, w->qrow + r0, rows_h, w->kp, nt, kt, D, pf);
    if (vt == ATTN_Q4_0)
        vt = head_values(ctx, w, vt, nt, false);
    for (int i = 0; i < rows_h; i++)
        ops->softmax(w->S + (size_t)i * ATTN_TILE, nt, w->kpos, w->rpos[r0 + i], &w->bias[r0 + i],
                     &w->m[r0 + i], &w->l[r0 + i], w->acc + (size_t)(r0 + i) * D, D);
    ops->pv(w->acc + (size_t)r0 * D, rows_h, w->S, w->vp, nt, vt, D, pf);
}

/*
 * A decode unit's tile: every KV head's part (decode_head), each while the
 * next head's rows - or, for the last head, the first head's rows of the
 * next tile - are prefetched. The offsets of the next tile are computed
 * here for that, into the other of the two buffers; *cur says which buffer
 * holds this tile's, *have the first key of the one computed ahead.
 */
static void decode_tile(const attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv,
                        const struct attn_seq *sq, const struct unit *u, int k0, int nt, int k1,
                        int *cur, int *have, const struct decode_rope *dr)
{
    const int rows_h = u->nq * ctx->group;
    if (*have == k0)
        *cur = 1 - *cur;
    else
        decode_offsets(ctx, kv, sq, k0, nt, w->koff + (size_t)*cur * ATTN_TILE,
                       w->voff + (size_t)*cur * ATTN_TILE);
    const size_t *ko = w->koff + (size_t)*cur * ATTN_TILE, *vo = w->voff + (size_t)*cur * ATTN_TILE;
    size_t *kn = w->koff + (size_t)(1 - *cur) * ATTN_TILE;
    size_t *vn = w->voff + (size_t)(1 - *cur) * ATTN_TILE;
    const int nn = k1 - (k0 + ATTN_TILE) < ATTN_TILE ? k1 - (k0 + ATTN_TILE) : ATTN_TILE;
    *have = -1;
    if (nn > 0) {
        decode_offsets(ctx, kv, sq, k0 + ATTN_TILE, nn, kn, vn);
        *have = k0 + ATTN_TILE;
    }
    for (int hh = 0; hh < u->ng; hh++) {
        const struct attn_prefetch *pf =
            hh + 1 < u->ng ? decode_prefetch(ctx, w->pf, kv, u->g0 + hh + 1, ko, vo, nt)
                           : decode_prefetch(ctx, w->pf, kv, u->g0, kn, vn, nn);
        decode_head(ctx, w, kv, u->g0 + hh, ko, vo, nt, hh * rows_h, rows_h, dr, pf);
    }
}

static void run_attn_item(attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv,
                          const struct attn_seq *seqs, const struct item *it)
{
    const struct unit *u = &ctx->units[it->unit];
    const struct attn_seq *sq = &seqs[u->seq];
    const int D = ctx->p.head_dim, H = ctx->p.n_head;
    const int rows_h = u->nq * ctx->group;
    const int qoff = ctx->si[u->seq].qoff;
    /* few rows per KV head: decode_head; else the flash tile (or int8 scores) */
    const bool decode = rows_h <= 4;

    setup_rows(ctx, w, sq, qoff, u->q0, u->nq, u->g0, u->ng);
    setup_q8(ctx, w, kv, u->rows);
    for (int r = 0; r < u->rows; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, sizeof(float) * (size_t)u->rows * D);

    int cur = 0, have = -1; /* decode: which offsets buffer is this tile's; the next tile's k0 */
    for (int k0 = it->k0; k0 < it->k1; k0 += ATTN_TILE) {
        int nt = it->k1 - k0 < ATTN_TILE ? it->k1 - k0 : ATTN_TILE;
        /* decode finds its rows by decode_offsets, not the tile's tok/slot */
        if ((decode ? tile_positions(w, sq, k0, nt) : load_tile(w, kv, sq, k0, nt)) > u->qmax)
            continue; /* every key of the tile is in every query's future */
        if (decode) {
            struct decode_rope dr = {w->qrow, w->cs, w->sn};
            if (ctx->rot && decode_turn_queries(ctx, w, u->rows, nt))
                dr = (struct decode_rope){w->qturn, ctx->lo_c, ctx->lo_s};
            else if (ctx->rot)
                ctx->rope_angles(&ctx->rope, &w->rope, w->kpos, nt, w->cs, w->sn);
            decode_tile(ctx, w, kv, sq, u, k0, nt, it->k1, &cur, &have, &dr);
            continue;
        }
        if (ctx->rot)
            ctx->rope_angles(&ctx->rope, &w->rope, w->kpos, nt, w->cs, w->sn);
        /* a prefill unit (one KV head) prefetches its next tile's rows */
        const int kn = k0 + ATTN_TILE, nn = it->k1 - kn < ATTN_TILE ? it->k1 - kn : ATTN_TILE;
        const struct attn_prefetch *pf = NULL;
        if (u->ng == 1 && nn > 0) {
            decode_offsets(ctx, kv, sq, kn, nn, w->koff, w->voff);
            pf = decode_prefetch(ctx, w->pf, kv, u->g0, w->koff, w->voff, nn);
        }
        for (int hh = 0; hh < u->ng; hh++)
            tile_head(ctx, w, kv, u->g0 + hh, nt, hh * rows_h, rows_h, pf);
    }

    for (int r = 0; r < u->rows; r++) {
        const float *a = w->acc + (size_t)r * D;
        if (it->part >= 0) { /* a part of a split unit: keep (m, l, acc) for the merge */
            float *pr = ctx->parts + (u->part0 + (size_t)it->part * u->rows + r) * (D + 2);
            pr[0] = w->m[r];
            pr[1] = w->l[r];
            memcpy(pr + 2, a, sizeof(float) * (size_t)D);
            continue;
        }
        int qi, h;
        row_coords(ctx, u, r, &qi, &h);
        float *o = sq->out + ((size_t)qi * H + h) * D;
        float inv = w->l[r] > 0.0f ? 1.0f / w->l[r] : 0.0f;
        for (int d = 0; d < D; d++)
            o[d] = a[d] * inv;
        float *st = ctx->stats + ((size_t)(qoff + qi) * H + h) * 2;
        st[0] = w->m[r];
        st[1] = w->l[r];
    }
}

/* Combine the parts of a split unit: rescale each to the common max. */
static void merge_unit(attn_ctx *ctx, const struct attn_seq *seqs, const struct unit *u)
{
    const int D = ctx->p.head_dim, H = ctx->p.n_head;
    const struct attn_seq *sq = &seqs[u->seq];
    const int qoff = ctx->si[u->seq].qoff;
    for (int r = 0; r < u->rows; r++) {
        float m = -INFINITY;
        for (int i = 0; i < u->nsplit; i++)
            m = fmaxf(m, ctx->parts[(u->part0 + (size_t)i * u->rows + r) * (D + 2)]);
        int qi, h;
        row_coords(ctx, u, r, &qi, &h);
        float *o = sq->out + ((size_t)qi * H + h) * D;
        memset(o, 0, sizeof(float) * (size_t)D);
        float l = 0.0f;
        if (m != -INFINITY) {
            for (int i = 0; i < u->nsplit; i++) {
                const float *pr = ctx->parts + (u->part0 + (size_t)i * u->rows + r) * (D + 2);
                if (pr[0] == -INFINITY)
                    continue;
                float f = expf(pr[0] - m);
                l += pr[1] * f;
                for (int d = 0; d < D; d++)
                    o[d] += pr[2 + d] * f;
            }
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int d = 0; d < D; d++)
                o[d] *= inv;
        }
        float *st = ctx->stats + ((size_t)(qoff + qi) * H + h) * 2;
        st[0] = m;
        st[1] = l;
    }
}

/*
 * mass[k] for keys [k0, k1) of one sequence: recompute each score, turn it
 * into its final probability with the row's (m, l), sum over rows.
 */
static void run_mass_item(attn_ctx *ctx, struct tscratch *w, const struct attn_kv *kv,
                          const struct attn_seq *seqs, const struct item *it)
{
    const struct attn_seq *sq = &seqs[it->unit];
    const int H = ctx->p.n_head, G = ctx->p.n_kv_head;
    const int qoff = ctx->si[it->unit].qoff;
    const int qb = unit_qblock(ctx);
    const struct attn_ops *ops = ctx->ops;
    memset(sq->mass + it->k0, 0, sizeof(float) * (size_t)(it->k1 - it->k0));

    for (int g = 0; g < G; g++) {
        for (int q0 = 0; q0 < sq->n_q; q0 += qb) {
            int nq = sq->n_q - q0 < qb ? sq->n_q - q0 : qb;
            int rows = nq * ctx->group;
            setup_rows(ctx, w, sq, qoff, q0, nq, g, 1);
            setup_q8(ctx, w, kv, rows);
            int32_t qmax = 0;
            for (int r = 0; r < rows; r++) {
                int h = g * ctx->group + r % ctx->group, qi = q0 + r / ctx->group;
                const float *st = ctx->stats + ((size_t)(qoff + qi) * H + h) * 2;
                bool live = st[1] > 0.0f;
                w->m[r] = live ? st[0] : 0.0f;
                w->l[r] = live ? 1.0f / st[1] : 0.0f; /* here: the inverse sum */
                qmax = w->rpos[r] > qmax ? w->rpos[r] : qmax;
            }
            for (int k0 = it->k0; k0 < it->k1; k0 += ATTN_TILE) {
                int nt = it->k1 - k0 < ATTN_TILE ? it->k1 - k0 : ATTN_TILE;
                if (load_tile(w, kv, sq, k0, nt) > qmax)
                    continue;
                if (ctx->rot)
                    ctx->rope_angles(&ctx->rope, &w->rope, w->kpos, nt, w->cs, w->sn);
                head_scores(ctx, w, kv, g, nt, 0, rows, NULL);
                float *mass = sq->mass + k0;
                for (int r = 0; r < rows; r++) {
                    float *s = w->S + (size_t)r * ATTN_TILE;
                    ops->probs(s, nt, w->kpos, w->rpos[r], &w->bias[r], w->m[r], w->l[r]);
                    for (int t = 0; t < nt; t++)
                        mass[t] += s[t];
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * Entry point
 * ------------------------------------------------------------------------ */

/* Items [next, end) of one region, each taken by whichever thread is free
 * next (thread t uses scratch t); the last part of a split unit to finish
 * merges it. */
struct run_job {
    attn_ctx *ctx;
    const struct attn_kv *kv;
    const struct attn_seq *seqs;
    _Atomic int next;
    int end;
    bool mass; /* mass items (after every attention item is done) */
};

static void run_items(void *arg, int t, int nth)
{
    (void)nth;
    struct run_job *j = arg;
    struct tscratch *w = &j->ctx->ts[t];
    for (int i; (i = atomic_fetch_add(&j->next, 1)) < j->end;) {
        const struct item *it = &j->ctx->items[i];
        if (j->mass) {
            run_mass_item(j->ctx, w, j->kv, j->seqs, it);
            continue;
        }
        run_attn_item(j->ctx, w, j->kv, j->seqs, it);
        struct unit *u = &j->ctx->units[it->unit];
        if (it->part >= 0 &&
            atomic_fetch_add_explicit(&u->done, 1, memory_order_acq_rel) == u->nsplit - 1)
            merge_unit(j->ctx, j->seqs, u);
    }
}

/*
 * The cos/sin of every query's position (posenc, double angles, rounded
 * once to f32), slot k for the batch's query k. A slot is recomputed only
 * when its position changed since the last call: the layers of a forward
 * pass share this context and call it with the same positions, so a
 * 512-query chunk computes its 512 x rot/2 angles once instead of 30 x 3
 * times (once per layer and KV head), the same values either way.
 */
static int rope_queries(attn_ctx *ctx, const struct attn_seq *seqs, int n_seqs, int total_q)
{
    size_t n = (size_t)total_q + 1, cap = ctx->cap_qcs, cap_pos = ctx->cap_qcs_pos;
    if (grow(ctx, (void **)&ctx->qcs, &ctx->cap_qcs, n * (size_t)ctx->rot, sizeof(float)) ||
        grow(ctx, (void **)&ctx->qcs_pos, &ctx->cap_qcs_pos, n, sizeof(int32_t))) {
        ctx->n_qcs = 0;
        return -ENOMEM;
    }
    if (ctx->cap_qcs != cap || ctx->cap_qcs_pos != cap_pos) /* grow keeps nothing */
        ctx->n_qcs = 0;
    for (int s = 0, k = 0; s < n_seqs; s++)
        for (int i = 0; i < seqs[s].n_q; i++, k++) {
            int32_t pos = seqs[s].q_pos[i];
            if ((size_t)k < ctx->n_qcs && ctx->qcs_pos[k] == pos)
                continue;
            pos_rope_cos_sin(ctx->qcs + (size_t)k * ctx->rot, ctx->inv_freq, ctx->rot,
                             (double)ctx->p.pos.rope_freq_scale, pos);
            ctx->qcs_pos[k] = pos;
        }
    if ((size_t)total_q > ctx->n_qcs)
        ctx->n_qcs = (size_t)total_q;
    return 0;
}

int attn_run(attn_ctx *ctx, const struct attn_kv *kv, const struct attn_seq *seqs, int n_seqs)
{
    if (!ctx)
        return -EINVAL;
    ctx->err[0] = '\0';
    const int H = ctx->p.n_head, D = ctx->p.head_dim;
    if (n_seqs < 0)
        return run_fail(ctx, -EINVAL, "n_seqs %d < 0", n_seqs);

    /* Workspace bounds: queries, sequences and threads only (see plan()). */
    if (grow(ctx, (void **)&ctx->si, &ctx->cap_si, (size_t)n_seqs + 1, sizeof(struct seqinfo)))
        return run_fail(ctx, -ENOMEM, "out of memory for %d sequences", n_seqs);
    int total_q = 0;
    int rc = validate(ctx, kv, seqs, n_seqs, &total_q);
    if (rc)
        return rc;
    size_t n_units = 0, units_rows = 0;
    int qoff = 0;
    for (int s = 0; s < n_seqs; s++) {
        const struct attn_seq *sq = &seqs[s];
        ctx->si[s].qoff = qoff;
        qoff += sq->n_q;
        if (sq->n_q == 0)
            continue;
        if (whole_sequence_unit(ctx, sq))
            n_units += 1;
        else
            n_units += (size_t)ctx->p.n_kv_head *
                       (size_t)((sq->n_q + unit_qblock(ctx) - 1) / unit_qblock(ctx));
        units_rows += (size_t)sq->n_q * H;
    }
    size_t spread = (size_t)ctx->n_threads * SPLIT_PER_THREAD;
    size_t n_items = 2 * n_units + spread + (size_t)n_seqs + spread + 2;
    size_t n_parts = units_rows + (size_t)ctx->rows_max * (spread + 1);
    if (grow(ctx, (void **)&ctx->units, &ctx->cap_units, n_units + 1, sizeof(struct unit)) ||
        grow(ctx, (void **)&ctx->items, &ctx->cap_items, n_items, sizeof(struct item)) ||
        grow(ctx, (void **)&ctx->stats, &ctx->cap_stats, (size_t)total_q * H * 2 + 1,
             sizeof(float)) ||
        grow(ctx, (void **)&ctx->parts, &ctx->cap_parts, n_parts * (size_t)(D + 2), sizeof(float)))
        return run_fail(ctx, -ENOMEM, "out of memory for the workspace of %d queries", total_q);

    if (ctx->rot && rope_queries(ctx, seqs, n_seqs, total_q))
        return run_fail(ctx, -ENOMEM, "out of memory for the angles of %d queries", total_q);

    if (ctx->p.pos.kind == POS_T5) { /* compose the table with the bucket lookup */
        const int nb = ctx->p.pos.t5_num_buckets, n = ctx->lut.n;
        for (int h = 0; h < H; h++)
            for (int d = 0; d <= n; d++)
                ctx->t5bias[(size_t)h * (n + 1) + d] =
                    ctx->p.pos.t5_table[(size_t)h * nb + pos_t5_lut_bucket(&ctx->lut, -d)];
    }

    int nu, ni, na;
    plan(ctx, seqs, n_seqs, &nu, &ni, &na);

    /* the attention items, then the mass: a second region, as it needs
     * every row's final (m, l) */
    struct run_job j = {ctx, kv, seqs, 0, na, false};
    cpu_pool_run(ctx->n_threads, run_items, &j);
    if (ni > na) {
        j.next = na;
        j.end = ni;
        j.mass = true;
        cpu_pool_run(ctx->n_threads, run_items, &j);
    }

    /* no query saw the keys of a sequence without queries */
    for (int s = 0; s < n_seqs; s++)
        if (seqs[s].mass && seqs[s].n_q == 0 && seqs[s].n_kv > 0)
            memset(seqs[s].mass, 0, sizeof(float) * (size_t)seqs[s].n_kv);
    return 0;
}
