/*
 * mem.h - memory the kernels stream: anonymous mappings on a 2 MiB
 * boundary, advised as huge pages.
 *
 * A decoding step streams the weights once and, at long context, a few KiB
 * of every KV page of the sequence per layer. In 4 KiB pages each of those
 * pieces costs a TLB miss (a two-level walk under a hypervisor) and
 * restarts the hardware prefetcher; in 2 MiB pages the same bytes take a
 * few hundred TLB entries. The advice (MADV_HUGEPAGE; transparent huge
 * pages are often "madvise" only) may be refused or turned off: nothing
 * depends on it but speed, and the callers say which they got.
 */
#ifndef KVD_CPU_MEM_H
#define KVD_CPU_MEM_H

#include <stdbool.h>
#include <stddef.h>

/*
 * bytes of zeroed anonymous memory starting on a 2 MiB boundary; when
 * advise is set, advised as huge pages, and *advised (may be NULL) says
 * whether the kernel took the advice. NULL with errno if it cannot be
 * mapped. Pages become resident as they are first touched. Free with
 * cpu_unmap(p, bytes).
 */
void *cpu_map_huge(size_t bytes, bool advise, bool *advised);
void cpu_unmap(void *p, size_t bytes);

/*
 * The one switch for that advice, over the repacked weights and the KV
 * pool alike. A caller's small_pages (kvd serve's [model] huge_pages =
 * false) asks for 4 KiB pages; KVD_HUGE_PAGES=off|on, read once by
 * cpu_pages_init_env, wins over the caller either way. Off asks for 4 KiB
 * pages outright (MADV_NOHUGEPAGE), so a system whose transparent huge
 * pages are "always" does not give 2 MiB pages anyway.
 */
struct cpu_pages {
    bool huge;        /* advised as 2 MiB pages, and the kernel took the advice */
    bool refused;     /* 2 MiB pages wanted, the kernel refused the advice */
    const char *says; /* for the load line (constant): "2 MiB pages advised",
                         "4 KiB pages, KVD_HUGE_PAGES=off", ... */
};

/* KVD_HUGE_PAGES=on|off (unset or empty: the callers' small_pages decide)
 * for the mappings made from now on. Returns -1 with err naming the
 * variable for any other value, the setting before it kept. */
int cpu_pages_init_env(char *err, size_t errlen);

/* cpu_map_huge(bytes, ...) with the advice the switch decides; *got says
 * what was asked and what the kernel did. NULL with errno if it cannot be
 * mapped. Free with cpu_unmap(p, bytes). */
void *cpu_map_pages(size_t bytes, bool small_pages, struct cpu_pages *got);

#endif /* KVD_CPU_MEM_H */
