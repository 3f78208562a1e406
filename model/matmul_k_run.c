/*
 * matmul_k_run.c - the K formats' products (q2_K to q6_K): the entry
 * mm_matmul hands them to, the scratch of their activations, the split of
 * the output rows among threads, and the choice of kernels.
 *
 * The kernels are in matmul_k.c, compiled once per kernel level (see
 * cpu/kernel.h and matmul_k.c's opening essay); mm_k_matmul takes the copy
 * of the level in use at each call, as mm_matmul_scratch does for the
 * other formats, so a level forced between calls applies to the next one.
 */
#include "model/matmul_internal.h"

#include <assert.h>
#include <stdint.h>

#include "cpu/pool.h"

static const struct mm_k_kernels *const kernels[CPU_N_LEVELS] = KERN_TABLE(mm_k_kernels);

static const struct mm_k_kernels *kern(void)
{
    return kernels[cpu_level()];
}

bool mm_k_type(enum ggml_type type)
{
    return type == GGML_TYPE_Q2_K || type == GGML_TYPE_Q3_K || type == GGML_TYPE_Q4_K ||
           type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
}

const char *mm_k_kernel_name(void)
{
    return kern()->name;
}

static size_t round_up(size_t n, size_t a)
{
    return (n + a - 1) / a * a;
}

/* struct mm_kx's leading dimensions for rows of n_in (matmul_internal.h). */
static void kx_dims(int n_in, size_t *ldq, size_t *ldd, size_t *lds)
{
    *ldq = round_up((size_t)n_in, 64);
    *ldd = round_up((size_t)n_in / QT_QK_K, 16);
    *lds = round_up((size_t)n_in / 16, 32);
}

size_t mm_k_scratch_bytes(int n_in, int n_tok)
{
    size_t ldq, ldd, lds;
    kx_dims(n_in, &ldq, &ldd, &lds);
    return (size_t)n_tok * (ldq + sizeof(float) * ldd + sizeof(int16_t) * lds);
}

static void kx_layout(struct mm_kx *a, void *scratch, int n_in, int n_tok)
{
    kx_dims(n_in, &a->ldq, &a->ldd, &a->lds);
    uint8_t *p = scratch;
    a->q = (int8_t *)p;
    p += a->ldq * (size_t)n_tok;
    a->d = (float *)p;
    p += sizeof(float) * a->ldd * (size_t)n_tok;
    a->bs = (int16_t *)p;
}

struct mm_k_groups {
    const struct mm_k_kernels *k;
    const struct mm_k_job *jb;
};

/* A thread's share of the row groups (cpu/pool.h's static chunks). */
static void run_groups(void *arg, size_t g0, size_t g1, int t)
{
    (void)t;
    const struct mm_k_groups *r = arg;
    const int n_out = r->jb->w->n_out;
    for (int g = (int)g0; g < (int)g1; g++) {
        int o0 = g * MM_GROUP, o1 = o0 + MM_GROUP < n_out ? o0 + MM_GROUP : n_out;
        r->k->rows(r->jb, o0, o1);
    }
}

void mm_k_matmul(float *out, const struct mm_weight *w, const float *x, int n_tok, int n_threads,
                 void *scratch)
{
    assert(mm_k_type(w->type) && w->n_in % QT_QK_K == 0);
    assert(scratch && ((uintptr_t)scratch & 63) == 0);
    if (n_tok <= 0)
        return;
    const struct mm_k_kernels *k = kern();
    struct mm_k_job jb = {.w = w, .out = out, .n_tok = n_tok};
    struct mm_kx *a = &jb.a;
    kx_layout(a, scratch, w->n_in, n_tok);
    /* by the calling thread, before the team starts: the region has no
     * barrier but its end */
    for (int t = 0; t < n_tok; t++)
        k->quantize(w->type, x + (size_t)t * (size_t)w->n_in, w->n_in, a->q + (size_t)t * a->ldq,
                    a->d + (size_t)t * a->ldd, a->bs + (size_t)t * a->lds);

    const int n_groups = (w->n_out + MM_GROUP - 1) / MM_GROUP;
    cpu_pool_for(cpu_pool_threads(n_threads), (size_t)n_groups, run_groups,
                 &(struct mm_k_groups){k, &jb});
}
