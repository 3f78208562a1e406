/*
 * matmul_run.c - mm_matmul's entry: weight descriptions, the scratch for
 * quantised activations, the split of the output rows among threads, and
 * the choice of kernels.
 *
 * The kernels themselves are in matmul.c, compiled once per kernel level;
 * mm_matmul_scratch takes the copy of the level in use (cpu_level(), see
 * cpu/cpu.h) at each call, so a level forced between calls (tests) applies
 * to the next product.
 */
#include "model/matmul_internal.h"

#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/pool.h"

static const struct mm_kernels *const kernels[CPU_N_LEVELS] = KERN_TABLE(mm_kernels);

static const struct mm_kernels *kern(void)
{
    return kernels[cpu_level()];
}

const char *mm_kernel_name(void)
{
    return kern()->name;
}

/* ------------------------------------------------------------------------
 * Weights
 * ------------------------------------------------------------------------ */

int mm_weight_init(struct mm_weight *w, enum ggml_type type, int n_in, int n_out, const void *data,
                   char *err, size_t errlen)
{
    const char *name = qt_type_name(type);
    char idbuf[32];
    if (!name) {
        snprintf(idbuf, sizeof idbuf, "type id %d", (int)type);
        name = idbuf;
    }
    if (!qt_type_supported(type)) {
        snprintf(err, errlen,
                 "weight type %s is not supported by the matrix product "
                 "(supported: f32 f16 bf16 q8_0 q4_0 q4_1 q5_0 q5_1 iq4_nl iq4_xs q2_K q3_K q4_K "
                 "q5_K q6_K)",
                 name);
        return -EINVAL;
    }
    int block = qt_block_elems(type);
    if (n_in <= 0 || n_in % block != 0) {
        snprintf(err, errlen, "a %s weight row needs a positive multiple of %d elements, not %d",
                 name, block, n_in);
        return -EINVAL;
    }
    if (n_out <= 0) {
        snprintf(err, errlen, "a %s weight matrix needs at least one row, not %d", name, n_out);
        return -EINVAL;
    }
    if (!data) {
        snprintf(err, errlen, "%s weight matrix %dx%d has no data", name, n_out, n_in);
        return -EINVAL;
    }
    w->type = type;
    w->n_in = n_in;
    w->n_out = n_out;
    w->data = data;
    w->row_bytes = qt_row_bytes(type, n_in);
    w->packed = NULL;
    w->packed_bf16 = false;
    return 0;
}

/* ------------------------------------------------------------------------
 * Quantised activations
 *
 * Layout in scratch, each array 64-byte aligned:
 *   q   int8  [n_tok][ldq]   round(x / d), ldq = n_in rounded up to 64
 *   d   float [n_tok][ldb]   block scale max|x| / 127 (0 for an all-zero block)
 * ------------------------------------------------------------------------ */

static size_t round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

static void xq_layout(struct mm_xq *xa, void *scratch, int n_in, int n_tok)
{
    size_t nb = (size_t)n_in / QT_QK;
    xa->ldq = round_up((size_t)n_in, 64);
    xa->ldb = round_up(nb, 16);
    uint8_t *p = scratch;
    xa->q = (int8_t *)p;
    p += xa->ldq * (size_t)n_tok;
    xa->d = (float *)p;
}

size_t mm_scratch_bytes(const struct mm_weight *w, int n_tok, int n_threads)
{
    if (n_tok <= 0)
        return 0;
    /* a repacked weight: enough for either path, the level may change between calls */
    size_t packed = w->packed ? mm_pack_scratch_bytes(w, n_tok, n_threads) : 0, rows;
    if (mm_is_float_type(w->type))
        rows = 0;
    else if (mm_k_type(w->type))
        rows = mm_k_scratch_bytes(w->n_in, n_tok);
    else
        rows = (size_t)n_tok * (round_up((size_t)w->n_in, 64) +
                                sizeof(float) * round_up((size_t)w->n_in / QT_QK, 16));
    return packed > rows ? packed : rows;
}

/* ------------------------------------------------------------------------
 * Entry points
 * ------------------------------------------------------------------------ */

struct mm_groups {
    const struct mm_kernels *k;
    const struct mm_job *jb;
};

/* A thread's share of the row groups (cpu/pool.h's static chunks). */
static void run_groups(void *arg, size_t g0, size_t g1, int t)
{
    (void)t;
    const struct mm_groups *r = arg;
    for (size_t g = g0; g < g1; g++)
        r->k->run_group(r->jb, (int)g);
}

void mm_matmul_scratch(float *out, const struct mm_weight *w, const float *x, int n_tok,
                       int n_threads, void *scratch)
{
    assert(w && w->data && qt_type_supported(w->type));
    if (n_tok <= 0)
        return;
    if (mm_pack_ready(w)) {
        mm_pack_matmul(out, w, x, n_tok, n_threads, scratch); /* matmul_pack_run.c */
        return;
    }
    if (mm_k_type(w->type)) {
        mm_k_matmul(out, w, x, n_tok, n_threads, scratch); /* matmul_k.c */
        return;
    }
    const struct mm_kernels *k = kern();
    struct mm_job jb = {.w = w, .x = x, .out = out, .n_tok = n_tok};
    const bool quantised = !mm_is_float_type(w->type);
    if (quantised) {
        assert(scratch && ((uintptr_t)scratch & 63) == 0);
        xq_layout(&jb.xa, scratch, w->n_in, n_tok);
    }
    const int n_groups = (w->n_out + MM_GROUP - 1) / MM_GROUP;
    int nth = cpu_pool_threads(n_threads);

    /* The activations are quantised by the calling thread before the team
     * starts (a few microseconds per token, under 1% of a prefill's
     * products), so the parallel region has no barrier but its end. */
    if (quantised)
        for (int t = 0; t < n_tok; t++)
            k->quantize_x(x + (size_t)t * (size_t)w->n_in, w->n_in, jb.xa.q + (size_t)t * jb.xa.ldq,
                          jb.xa.d + (size_t)t * jb.xa.ldb);

    cpu_pool_for(nth, (size_t)n_groups, run_groups, &(struct mm_groups){k, &jb});
}

/* A tail over the row ranges of a parallel for, every token (the products
 * ran apart). */
struct tail_rows {
    const struct mm_tail *tail;
    int n_tok;
};

static void run_tail(void *arg, size_t r0, size_t r1, int t)
{
    (void)t;
    const struct tail_rows *tr = arg;
    tr->tail->fn(tr->tail->arg, (int)r0, (int)r1, 0, tr->n_tok);
}

void mm_matmul_many(float *const *out, const struct mm_weight *const *w, int n, const float *x,
                    int n_tok, int n_threads, void *scratch, const struct mm_tail *tail)
{
    assert(n >= 1 && n <= MM_MANY_MAX);
    bool one_region = true;
    for (int i = 0; i < n; i++) {
        assert(!tail || w[i]->n_out == w[0]->n_out);
        one_region = one_region && mm_pack_ready(w[i]) && w[i]->type == w[0]->type &&
                     w[i]->n_in == w[0]->n_in && w[i]->packed_bf16 == w[0]->packed_bf16;
    }
    if (n_tok <= 0)
        return;
    if (one_region) { /* matmul_pack_run.c, the tail inside its region */
        mm_pack_matmul_many(out, w, n, x, n_tok, n_threads, scratch, tail);
        return;
    }
    for (int i = 0; i < n; i++)
        mm_matmul_scratch(out[i], w[i], x, n_tok, n_threads, scratch);
    if (tail)
        cpu_pool_for(cpu_pool_threads(n_threads), (size_t)w[0]->n_out, run_tail,
                     &(struct tail_rows){tail, n_tok});
}

/* The calling thread's scratch for mm_matmul: grown, never shrunk. */
static _Thread_local struct {
    void *p;
    size_t cap;
} tls_scratch;

void mm_scratch_release(void)
{
    free(tls_scratch.p);
    tls_scratch.p = NULL;
    tls_scratch.cap = 0;
}

int mm_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads)
{
    size_t need = n_tok > 0 ? mm_scratch_bytes(w, n_tok, n_threads) : 0;
    if (need > tls_scratch.cap) {
        /* grow by half again so a slowly rising batch size reallocates rarely */
        size_t cap = round_up(need + need / 2, 64);
        void *p = aligned_alloc(64, cap);
        if (!p)
            return -ENOMEM;
        free(tls_scratch.p);
        tls_scratch.p = p;
        tls_scratch.cap = cap;
    }
    mm_matmul_scratch(out, w, x, n_tok, n_threads, tls_scratch.p);
    return 0;
}
