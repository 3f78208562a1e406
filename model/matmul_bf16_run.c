/*
 * matmul_bf16_run.c - the bf16 path's entry (matmul_bf16.h): which weights
 * take it, their copy in bf16 pairs, the activations rounded by tiles, the
 * thread split, and the line that says what runs.
 *
 * F16 weights: rounding them to bf16 keeps 8 of their 11 significant bits
 * (a relative error up to 2^-9 per weight, on top of the activations'
 * 2^-9), for twice the multiply rate. A file stored as F16 was meant to be
 * multiplied at f16 precision, so by default it is not: F16 weights are
 * widened exactly and run matmul_pack.c's f32 FMA tile. KVD_F16=bf16 (or
 * mm_f16_set_bf16) opts in, for whoever prefers the speed; the kernels
 * line says which was chosen. The choice is taken when a weight is packed
 * (at load): a model loaded before a change keeps its copies.
 */
#include "model/matmul_bf16.h"

#include <assert.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/pool.h"

static const struct mm_bf16_kernels *const bkernels[CPU_N_LEVELS] = KERN_TABLE(mm_bf16_kernels);

static _Atomic int f16_bf16 = 0;

void mm_f16_set_bf16(bool on)
{
    atomic_store_explicit(&f16_bf16, on, memory_order_relaxed);
}

bool mm_f16_bf16(void)
{
    return atomic_load_explicit(&f16_bf16, memory_order_relaxed);
}

int mm_f16_init_env(char *err, size_t errlen)
{
    const char *v = getenv("KVD_F16");
    if (!v || !*v)
        return 0;
    if (strcmp(v, "exact") && strcmp(v, "bf16")) {
        snprintf(err, errlen, "KVD_F16: unknown value '%s' (exact, bf16)", v);
        return -1;
    }
    mm_f16_set_bf16(!strcmp(v, "bf16"));
    return 0;
}

/* The bf16 kernels, when the level in use has them and the CPU runs them. */
static const struct mm_bf16_kernels *bkern(void)
{
    const struct mm_bf16_kernels *k = bkernels[cpu_level()];
    return k && k->name && cpu_bf16() ? k : NULL;
}

bool mm_bf16_ready(void)
{
    return bkern() != NULL;
}

bool mm_bf16_wants(const struct mm_weight *w)
{
    return bkern() && (w->type == GGML_TYPE_BF16 || (w->type == GGML_TYPE_F16 && mm_f16_bf16()));
}

static size_t n_groups(const struct mm_weight *w)
{
    return ((size_t)w->n_out + MM_PACK_ROWS - 1) / MM_PACK_ROWS;
}

size_t mm_bf16_pack_bytes(const struct mm_weight *w)
{
    return n_groups(w) * mm_bf16_group_bytes(w);
}

/* Element k of a stored row as bf16 (an f16 rounded to nearest: every f16,
 * subnormals included, is a normal number in bf16's range). */
static uint32_t bf16_at(const struct mm_weight *w, const uint8_t *row, int k)
{
    if (!row || k >= w->n_in)
        return 0;
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)k, 2);
    return w->type == GGML_TYPE_BF16 ? h : qt_f32_to_bf16(qt_f16_to_f32(h));
}

void mm_bf16_pack_weight(struct mm_weight *w, void *dst)
{
    assert(dst && ((uintptr_t)dst & 63) == 0 && mm_bf16_wants(w));
    const int np = mm_bf16_pairs(w);
    uint32_t *p = dst;
    for (size_t g = 0; g < n_groups(w); g++)
        for (int r = 0; r < MM_PACK_ROWS; r++) {
            size_t o = g * MM_PACK_ROWS + (size_t)r;
            const uint8_t *row =
                o < (size_t)w->n_out ? (const uint8_t *)w->data + o * w->row_bytes : NULL;
            uint32_t *lane = p + g * (size_t)np * MM_PACK_ROWS + (size_t)r;
            for (int q = 0; q < np; q++)
                lane[(size_t)q * MM_PACK_ROWS] = bf16_at(w, row, 2 * q) | bf16_at(w, row, 2 * q + 1)
                                                                              << 16;
        }
    w->packed = dst;
    w->packed_bf16 = true;
}

size_t mm_bf16_scratch_bytes(const struct mm_weight *w, int n_tok)
{
    size_t tiles = ((size_t)n_tok + MM_BF16_NT - 1) / MM_BF16_NT;
    return (tiles * MM_BF16_NT * (size_t)mm_bf16_pairs(w) * 4 + 63) / 64 * 64;
}

/*
 * The split among threads, as matmul_pack_run.c's (its essay says why):
 * by token tiles for a prefill of at least BF16_SPLIT_TILES tiles per
 * thread, each thread rounding its own tokens and multiplying them by
 * every group; else by pairs of row groups after the calling thread has
 * rounded every token. Every (row, token) sum is the same instructions
 * either way (matmul_bf16.c's tiles), so the bits do not depend on it.
 */
#define BF16_SPLIT_TILES 8

/* One call: n products of one x, their pairs of groups (the kernel's tile
 * height) numbered one after another: product i's pair v is unit
 * u_end[i - 1] + v. */
struct bf16_run {
    const struct mm_bf16_kernels *k;
    const struct mm_bf16_job *jb; /* [n] */
    const float *x;               /* [n_tok][n_in] */
    int n, tiles;                 /* products; token tiles */
    int ng[MM_MANY_MAX];          /* groups of product i */
    int u_end[MM_MANY_MAX];       /* units of products 0..i */
};

/* Tokens [t0, t1) rounded into their tiles' columns (laid out by jb[0]). */
static void round_tokens(const struct bf16_run *r, int t0, int t1)
{
    const struct mm_weight *w = r->jb[0].w;
    const size_t np = (size_t)mm_bf16_pairs(w);
    uint32_t *xb = (uint32_t *)r->jb[0].x;
    for (int t = t0; t < t1; t++)
        r->k->round_x(r->x + (size_t)t * (size_t)w->n_in, w->n_in,
                      xb + (size_t)(t / MM_BF16_NT) * np * MM_BF16_NT + (size_t)(t % MM_BF16_NT));
}

/* A thread's token tiles [j0, j1): their rounding, then every group of
 * every product. */
static void run_tiles(void *arg, size_t j0, size_t j1, int t)
{
    (void)t;
    const struct bf16_run *r = arg;
    const int n_tok = r->jb[0].n_tok;
    round_tokens(r, (int)j0 * MM_BF16_NT,
                 (int)j1 * MM_BF16_NT < n_tok ? (int)j1 * MM_BF16_NT : n_tok);
    for (int i = 0; i < r->n; i++)
        r->k->groups(&r->jb[i], 0, r->ng[i], (int)j0, (int)j1);
}

/* A thread's share of the units [u0, u1), every tile. */
static void run_units(void *arg, size_t u0, size_t u1, int t)
{
    (void)t;
    const struct bf16_run *r = arg;
    int i = 0;
    for (int u = (int)u0; u < (int)u1; u++) {
        while (u >= r->u_end[i])
            i++;
        int v = u - (i ? r->u_end[i - 1] : 0);
        r->k->groups(&r->jb[i], 2 * v, 2 * v + 2 < r->ng[i] ? 2 * v + 2 : r->ng[i], 0, r->tiles);
    }
}

void mm_bf16_matmul_many(float *const *out, const struct mm_weight *const *ws, int n,
                         const float *x, int n_tok, int n_threads, void *scratch)
{
    const struct mm_bf16_kernels *k = bkern();
    const struct mm_weight *w = ws[0]; /* the activations are laid out by it, for all */
    assert(k && n >= 1 && n <= MM_MANY_MAX && scratch && ((uintptr_t)scratch & 63) == 0);
    struct mm_bf16_job jb[MM_MANY_MAX];
    struct bf16_run r = {
        .k = k, .jb = jb, .x = x, .n = n, .tiles = (n_tok + MM_BF16_NT - 1) / MM_BF16_NT};
    for (int i = 0; i < n; i++) {
        assert(ws[i]->packed_bf16 && ws[i]->n_in == w->n_in);
        jb[i] = (struct mm_bf16_job){.w = ws[i], .x = scratch, .out = out[i], .n_tok = n_tok};
        r.ng[i] = (int)n_groups(ws[i]);
        r.u_end[i] = (i ? r.u_end[i - 1] : 0) + (r.ng[i] + 1) / 2;
    }
    const int nth = cpu_pool_threads(n_threads);
    if (nth > 1 && r.tiles >= BF16_SPLIT_TILES * nth) {
        cpu_pool_for(nth, (size_t)r.tiles, run_tiles, &r);
        return;
    }
    round_tokens(&r, 0, n_tok); /* by the calling thread, before the team starts */
    cpu_pool_for(nth, (size_t)r.u_end[n - 1], run_units, &r);
}

const char *mm_bf16_describe(char *buf, size_t len)
{
    const struct mm_bf16_kernels *k = bkern();
    if (k)
        snprintf(buf, len, "bf16 by %s, f16 %s", k->name,
                 mm_f16_bf16() ? "rounded to bf16 (KVD_F16=bf16)" : "exact");
    else if (cpu_level() == CPU_AVX512)
        snprintf(buf, len, "bf16 and f16 exact by f32 FMA (%s)",
                 cpu_bf16_supported() ? "avx512bf16 forced off" : "no avx512bf16 on this CPU");
    else
        snprintf(buf, len, "bf16 and f16 exact");
    return buf;
}
