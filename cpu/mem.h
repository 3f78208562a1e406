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

#endif /* KVD_CPU_MEM_H */
