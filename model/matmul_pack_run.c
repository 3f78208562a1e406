/*
 * matmul_pack_run.c - weights repacked for matmul_pack.c's kernels: the
 * layout written (matmul_internal.h describes it), the scratch of the
 * activations, and the entry mm_matmul hands a repacked weight to.
 *
 * A weight is repacked only when the kernel level in use when it is packed
 * has kernels for its type (mm_pack_bytes says 0 otherwise), and a product
 * takes the repacked copy only when the level in use at the call has them
 * too: a level forced lower between calls (tests, comparisons) runs
 * matmul.c over the original rows, which stay valid.
 */
#include "model/matmul_internal.h"

#include <assert.h>
#include <stdint.h>
#include <string.h>

#include "cpu/pool.h"

static const struct mm_pack_kernels *const pkernels[CPU_N_LEVELS] = KERN_TABLE(mm_pack_kernels);
static const struct mm_kernels *const kernels[CPU_N_LEVELS] = KERN_TABLE(mm_kernels);

static const struct mm_pack_kernels *pkern(void)
{
    return pkernels[cpu_level()];
}

const char *mm_pack_kernel_name(void)
{
    return pkern()->name;
}

bool mm_pack_ready(const struct mm_weight *w)
{
    return w->packed && pkern()->has(w->type);
}

static size_t n_groups(const struct mm_weight *w)
{
    return ((size_t)w->n_out + MM_PACK_ROWS - 1) / MM_PACK_ROWS;
}

size_t mm_pack_bytes(const struct mm_weight *w)
{
    if (!pkern()->has(w->type))
        return 0;
    return n_groups(w) * mm_pack_group_bytes(w);
}

/* One group of q8_0 rows (matmul_internal.h); rows past n_out are zeros. */
static void pack_q8_group(const struct mm_weight *w, size_t g, uint8_t *dst)
{
    const int nb = w->n_in / QT_QK;
    uint8_t *scales = dst + (size_t)nb * MM_PACK_Q8_QUANTS;
    for (int r = 0; r < MM_PACK_ROWS; r++) {
        size_t o = g * MM_PACK_ROWS + (size_t)r;
        const uint8_t *row =
            o < (size_t)w->n_out ? (const uint8_t *)w->data + o * w->row_bytes : NULL;
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row ? row + 34 * (size_t)b : NULL;
            uint8_t *q = dst + (size_t)b * MM_PACK_Q8_QUANTS + 4 * r;
            for (int k = 0; k < 8; k++)
                for (int j = 0; j < 4; j++)
                    q[64 * k + j] = blk ? (uint8_t)(blk[2 + 4 * k + j] ^ 0x80) : 0x80;
            uint8_t *s = scales + 32 * (size_t)b + 2 * r;
            s[0] = blk ? blk[0] : 0;
            s[1] = blk ? blk[1] : 0;
        }
    }
}

/* One group of float rows: element k of the 16 rows side by side (rows
 * past n_out are zeros). Elements are copied as 2- or 4-byte words. */
static void pack_float_group(const struct mm_weight *w, size_t g, uint8_t *dst)
{
    const size_t esz = w->type == GGML_TYPE_F32 ? 4 : 2;
    const uint8_t *rows[MM_PACK_ROWS];
    for (int r = 0; r < MM_PACK_ROWS; r++) {
        size_t o = g * MM_PACK_ROWS + (size_t)r;
        rows[r] = o < (size_t)w->n_out ? (const uint8_t *)w->data + o * w->row_bytes : NULL;
    }
    for (int k = 0; k < w->n_in; k++, dst += MM_PACK_ROWS * esz)
        for (int r = 0; r < MM_PACK_ROWS; r++) {
            if (!rows[r])
                memset(dst + (size_t)r * esz, 0, esz);
            else if (esz == 2)
                memcpy(dst + 2 * (size_t)r, rows[r] + 2 * (size_t)k, 2);
            else
                memcpy(dst + 4 * (size_t)r, rows[r] + 4 * (size_t)k, 4);
        }
}

void mm_pack_weight(struct mm_weight *w, void *dst)
{
    assert(dst && ((uintptr_t)dst & 63) == 0 && mm_pack_bytes(w) > 0);
    const size_t gb = mm_pack_group_bytes(w);
    if (w->type != GGML_TYPE_Q8_0) {
        for (size_t g = 0; g < n_groups(w); g++)
            pack_float_group(w, g, (uint8_t *)dst + g * gb);
        w->packed = dst;
        return;
    }
    const size_t used = (size_t)(w->n_in / QT_QK) * MM_PACK_Q8_BLOCK;
    uint8_t *p = dst;
    for (size_t g = 0; g < n_groups(w); g++) {
        pack_q8_group(w, g, p + g * gb);
        memset(p + g * gb + used, 0, gb - used); /* the padding after the scales */
    }
    w->packed = dst;
}

/* ------------------------------------------------------------------------
 * Activations (layout: struct mm_pack_job, matmul_internal.h): quantised by
 * the level's matmul.c function into a row of scratch, then spread over
 * the token tiles with each block's correction -128 * sum(q).
 * ------------------------------------------------------------------------ */

static size_t round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

struct pack_scratch {
    int8_t *q, *row_q;
    float *d, *row_d, *x;
    int32_t *c;
};

/* The arrays in scratch, each 64-byte aligned; returns the bytes used. */
static size_t scratch_layout(const struct mm_weight *w, int n_tok, void *scratch,
                             struct pack_scratch *ps)
{
    uint8_t *base = scratch, *p = base;
    if (w->type != GGML_TYPE_Q8_0) { /* float weights: the transposed tiles */
        if (ps)
            ps->x = (float *)p;
        return round_up(round_up((size_t)n_tok, MM_PACK_FNT) * (size_t)w->n_in * sizeof(float), 64);
    }
    const size_t nb = (size_t)w->n_in / QT_QK;
    const size_t slots = round_up((size_t)n_tok, MM_PACK_NT) * nb; /* (token, block) pairs */
    if (ps)
        ps->q = (int8_t *)p;
    p += round_up(slots * QT_QK, 64);
    if (ps)
        ps->d = (float *)p;
    p += round_up(slots * sizeof(float), 64);
    if (ps)
        ps->c = (int32_t *)p;
    p += round_up(slots * sizeof(int32_t), 64);
    if (ps)
        ps->row_q = (int8_t *)p;
    p += round_up(nb * QT_QK, 64);
    if (ps)
        ps->row_d = (float *)p;
    p += round_up(nb * sizeof(float), 64);
    return (size_t)(p - base);
}

size_t mm_pack_scratch_bytes(const struct mm_weight *w, int n_tok)
{
    return scratch_layout(w, n_tok, NULL, NULL);
}

/* Token t's activations into its tile's slots. */
static void quantize_token(const struct mm_weight *w, const float *x, int t,
                           const struct pack_scratch *ps)
{
    const int nb = w->n_in / QT_QK;
    kernels[cpu_level()]->quantize_x(x, w->n_in, ps->row_q, ps->row_d);
    const size_t tile0 = (size_t)(t / MM_PACK_NT) * (size_t)nb * MM_PACK_NT;
    for (int b = 0; b < nb; b++) {
        const int8_t *q = ps->row_q + QT_QK * b;
        size_t slot = tile0 + (size_t)b * MM_PACK_NT + (size_t)(t % MM_PACK_NT);
        int s = 0;
        for (int i = 0; i < QT_QK; i++)
            s += q[i];
        memcpy(ps->q + slot * QT_QK, q, QT_QK);
        ps->d[slot] = ps->row_d[b];
        ps->c[slot] = -128 * s;
    }
}

/* Token t's f32 activations into its tile's column. */
static void transpose_token(const struct mm_weight *w, const float *x, int t,
                            const struct pack_scratch *ps)
{
    float *dst = ps->x + (size_t)(t / MM_PACK_FNT) * (size_t)w->n_in * MM_PACK_FNT +
                 (size_t)(t % MM_PACK_FNT);
    for (int k = 0; k < w->n_in; k++)
        dst[(size_t)k * MM_PACK_FNT] = x[k];
}

/* The products of one call, their pairs of groups (the kernel's tile
 * height) numbered one after another: product i's pair v is unit
 * u_end[i - 1] + v. */
struct pack_units {
    const struct mm_pack_kernels *pk;
    const struct mm_pack_job *jb; /* [n] */
    int ng[MM_MANY_MAX];    /* groups of product i */
    int u_end[MM_MANY_MAX]; /* units of products 0..i */
};

/* A thread's share of the units (cpu/pool.h's static chunks): the same
 * calls of the kernel, whatever the split. */
static void run_units(void *arg, size_t u0, size_t u1, int t)
{
    (void)t;
    const struct pack_units *r = arg;
    int i = 0;
    for (int u = (int)u0; u < (int)u1; u++) {
        while (u >= r->u_end[i])
            i++;
        int v = u - (i ? r->u_end[i - 1] : 0);
        r->pk->groups(&r->jb[i], 2 * v, 2 * v + 2 < r->ng[i] ? 2 * v + 2 : r->ng[i]);
    }
}

void mm_pack_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads,
                    void *scratch)
{
    mm_pack_matmul_many(&out, &w, 1, x, n_tok, n_threads, scratch);
}

void mm_pack_matmul_many(float *const *out, const struct mm_weight *const *ws, int n, const float *x,
                         int n_tok, int n_threads, void *scratch)
{
    const struct mm_weight *w = ws[0]; /* the activations are laid out by it, for all */
    assert(n >= 1 && n <= MM_MANY_MAX && scratch && ((uintptr_t)scratch & 63) == 0);
    struct pack_scratch ps = {0};
    scratch_layout(w, n_tok, scratch, &ps);
    /* by the calling thread, before the team starts (see matmul_run.c) */
    for (int t = 0; t < n_tok; t++) {
        const float *xt = x + (size_t)t * (size_t)w->n_in;
        if (w->type == GGML_TYPE_Q8_0)
            quantize_token(w, xt, t, &ps);
        else
            transpose_token(w, xt, t, &ps);
    }
    struct mm_pack_job jb[MM_MANY_MAX];
    struct pack_units r = {.pk = pkern(), .jb = jb};
    for (int i = 0; i < n; i++) {
        assert(mm_pack_ready(ws[i]) && ws[i]->type == w->type && ws[i]->n_in == w->n_in);
        jb[i] = (struct mm_pack_job){.w = ws[i], .q = ps.q, .d = ps.d, .c = ps.c, .x = ps.x,
                                     .out = out[i], .n_tok = n_tok};
        r.ng[i] = (int)n_groups(ws[i]);
        r.u_end[i] = (i ? r.u_end[i - 1] : 0) + (r.ng[i] + 1) / 2;
    }
    cpu_pool_for(cpu_pool_threads(n_threads), (size_t)r.u_end[n - 1], run_units, &r);
}
