/*
 * mem.c - 2 MiB-aligned anonymous mappings advised as huge pages (mem.h):
 * map 2 MiB more than asked, keep the aligned middle, give back the rest.
 */
#include "cpu/mem.h"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_PAGE ((size_t)2 << 20)

void *cpu_map_huge(size_t bytes, bool advise, bool *advised)
{
    if (advised)
        *advised = false;
    size_t span = bytes + HUGE_PAGE;
    uint8_t *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED)
        return NULL;
    uint8_t *p = (uint8_t *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t head = (size_t)(p - raw), used = (bytes + page - 1) / page * page;
    if (head)
        munmap(raw, head);
    if (span - head > used)
        munmap(p + used, span - head - used);
    if (advise) {
        bool ok = madvise(p, used, MADV_HUGEPAGE) == 0; /* refused: it only costs speed */
        if (advised)
            *advised = ok;
    }
    return p;
}

void cpu_unmap(void *p, size_t bytes)
{
    if (p)
        munmap(p, bytes);
}
