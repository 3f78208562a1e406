/*
 * mem.c - 2 MiB-aligned anonymous mappings advised as huge pages (mem.h):
 * map 2 MiB more than asked, keep the aligned middle, give back the rest.
 */
#include "cpu/mem.h"

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

/* KVD_HUGE_PAGES: -1 unset (the caller decides), else 0 off or 1 on. */
static _Atomic int huge_env = -1;

int cpu_pages_init_env(char *err, size_t errlen)
{
    const char *v = getenv("KVD_HUGE_PAGES");
    if (!v || !*v) {
        atomic_store(&huge_env, -1);
        return 0;
    }
    if (strcmp(v, "on") && strcmp(v, "off")) {
        snprintf(err, errlen, "KVD_HUGE_PAGES: unknown value '%s' (on, off)", v);
        return -1;
    }
    atomic_store(&huge_env, !strcmp(v, "on"));
    return 0;
}

/* Whether 2 MiB pages are wanted, and what the load line says of it. */
static bool huge_wanted(bool small_pages, const char **says)
{
    const int env = atomic_load(&huge_env);
    if (env >= 0) {
        *says = env ? "2 MiB pages advised, KVD_HUGE_PAGES=on" : "4 KiB pages, KVD_HUGE_PAGES=off";
        return env;
    }
    *says = small_pages ? "4 KiB pages, huge pages off" : "2 MiB pages advised";
    return !small_pages;
}

void *cpu_map_pages(size_t bytes, bool small_pages, struct cpu_pages *got)
{
    const bool want = huge_wanted(small_pages, &got->says);
    got->huge = got->refused = false;
    void *p = cpu_map_huge(bytes, want, &got->huge);
    if (p && !want)
        (void)madvise(p, bytes, MADV_NOHUGEPAGE); /* refused: it only changes speed */
    if (p && want && !got->huge) {
        got->refused = true;
        got->says = "4 KiB pages: the kernel refused the 2 MiB advice (transparent huge pages off?)";
    }
    return p;
}
