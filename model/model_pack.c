/*
 * model_pack.c - a model's weight matrices repacked (or copied) once, at
 * load, into memory of its own for the product kernels, and what that costs.
 *
 * Which matrices: every matrix a product reads (each layer's q, k, v, o,
 * gate, up, down, and the output matrix). Those whose type the kernel level
 * in use at load has kernels over repacked weights for (mm_pack_bytes) are
 * repacked (see model/quant.h); the others (q2_K, q3_K, q5_K, q6_K, and
 * every type at a level without such kernels) are copied as stored,
 * row for row, so that their kernels read them from the same huge pages
 * (see Pages: on the 512 x 30 shape a decoding step's q4_K products took
 * ~20% less CPU time from 2 MiB pages than from 4 KiB ones, q6_K ~30%,
 * q4_0 ~12%, one thread, measured side by side in one process). The token
 * embedding is read row by row and stays as mapped.
 *
 * Memory: the copies are one anonymous mapping owned by the model (the
 * same bytes as the mapped rows, plus each matrix's last group of 16 rows
 * padded). The mapped rows of a packed matrix are not read again at this
 * level, so their pages are given back (MADV_DONTNEED on the whole pages a
 * matrix covers): the process's resident memory holds one copy of the
 * weights, not two. They stay mapped: a level forced lower later (tests,
 * comparisons) or the tied embedding reads them in again from the file.
 * model_pack_describe says what was done, for the logs.
 *
 * Pages: the copy is mapped on a 2 MiB boundary and advised as huge pages
 * (MADV_HUGEPAGE; transparent huge pages are often "madvise" only). A
 * decoding step streams every weight once, and in 4 KiB pages each page
 * costs a TLB miss (a two-level walk under a hypervisor) and restarts the
 * hardware prefetcher: on the 576x30 q8_0 shape the weights' matrix-vector
 * products took ~15% less time on one thread in 2 MiB pages, measured
 * side by side in one process. The advice may be refused; nothing depends
 * on it but speed. It can be turned off, to compare or where huge pages are
 * unwelcome (memory fragmented, khugepaged's work): the caller's
 * small_pages or KVD_HUGE_PAGES, the switch cpu/mem.h owns for the KV pool
 * too (cpu_map_pages). The load line says which pages were asked for.
 */
#include "model/model_internal.h"

#include "cpu/mem.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* Every matrix of m a product reads, into ws (at most 7 per layer + 1). */
static int product_matrices(model *m, struct mm_weight **ws)
{
    int n = 0;
    for (int l = 0; l < m->n_layer; l++) {
        struct model_layer *L = &m->layers[l];
        struct mm_weight *lw[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++)
            if (lw[i]->data) /* gate: SwiGLU only */
                ws[n++] = lw[i];
    }
    ws[n++] = &m->output;
    return n;
}

static double mono_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Give back the whole pages of a mapped matrix's rows. */
static void release_rows(const struct mm_weight *w)
{
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)w->data, b = a + w->row_bytes * (size_t)w->n_out;
    a = (a + page - 1) / page * page;
    b = b / page * page;
    if (b > a)
        (void)madvise((void *)a, b - a, MADV_DONTNEED); /* advice: failure changes nothing */
}

/* Add type's name to the model's list of copied types, once. */
static void note_type(model *m, enum ggml_type type)
{
    const char *name = qt_type_name(type);
    char *list = m->pack_copied_types;
    const size_t cap = sizeof m->pack_copied_types, used = strlen(list);
    for (const char *q = list; name && (q = strstr(q, name)); q += strlen(name))
        if ((q == list || q[-1] == ' ') && (q[strlen(name)] == ' ' || !q[strlen(name)]))
            return;
    if (name)
        snprintf(list + used, cap - used, "%s%s", used ? " " : "", name);
}

/* The bytes of w in the copy: its repacked form, or, when the level has no
 * kernels over repacked weights of its type, its rows as stored. */
static size_t copy_bytes(const struct mm_weight *w)
{
    size_t b = mm_pack_bytes(w);
    return b ? b : w->row_bytes * (size_t)w->n_out;
}

int model_pack_weights(model *m, bool small_pages, char *err, size_t errlen)
{
    struct mm_weight **ws = malloc(sizeof(*ws) * (7 * (size_t)m->n_layer + 1));
    if (!ws) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    const double t0 = mono_s();
    int n = product_matrices(m, ws);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (copy_bytes(ws[i]) + 63) / 64 * 64;
    if (total == 0) {
        free(ws);
        return 0;
    }
    struct cpu_pages got;
    void *mem = cpu_map_pages(total, small_pages, &got);
    m->pack_pages = got.says;
    if (!mem) {
        snprintf(err, errlen, "repacking the weights: cannot map %zu bytes", total);
        free(ws);
        return -ENOMEM;
    }
    uint8_t *p = mem;
    m->pack_copied_types[0] = '\0';
    int packed = 0, bf16 = 0, copied = 0;
    for (int i = 0; i < n; i++) {
        size_t b = copy_bytes(ws[i]);
        bool repack = mm_pack_bytes(ws[i]) > 0;
        if (ws[i]->packed) /* the same matrix twice */
            continue;
        if (repack) {
            mm_pack_weight(ws[i], p);
            packed++;
            bf16 += ws[i]->packed_bf16;
        } else {
            memcpy(p, ws[i]->data, b);
            copied++;
            note_type(m, ws[i]->type);
        }
        release_rows(ws[i]); /* at once: the peak holds one matrix twice, not the model */
        if (!repack)
            ws[i]->data = p; /* after the release: it gives back the mapped rows */
        p += (b + 63) / 64 * 64;
    }
    m->pack_mem = mem;
    m->pack_bytes = total;
    m->pack_count = packed;
    m->pack_copied = copied;
    m->pack_bf16 = bf16;
    m->pack_ms = (mono_s() - t0) * 1e3;
    free(ws);
    return 0;
}

void model_pack_free(model *m)
{
    if (m->pack_mem)
        munmap(m->pack_mem, m->pack_bytes);
    m->pack_mem = NULL;
    m->pack_bytes = 0;
}

const char *model_pack_describe(const model *m, char *buf, size_t len)
{
    const char *k = mm_pack_kernel_name();
    char packed[256] = "", copied[224] = "";
    if (m->pack_count)
        snprintf(packed, sizeof packed, "%d matrices repacked for %s%s", m->pack_count,
                 k ? k : "kernels of another level",
                 m->pack_bf16 ? " and avx512bf16 (bf16 pairs)" : "");
    if (m->pack_copied)
        snprintf(copied, sizeof copied,
                 "%s%d copied as stored (no repacked kernels for %s at this level)",
                 m->pack_count ? ", " : "", m->pack_copied, m->pack_copied_types);
    snprintf(buf, len, "%s%s in %.0f ms: %.1f MiB owned (%s), the mapped rows released", packed,
             copied, m->pack_ms, (double)m->pack_bytes / (1024.0 * 1024.0), m->pack_pages);
    return buf;
}
