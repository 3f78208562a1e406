/*
 * cpu_levels.h - for tests that run the kernels at every level the CPU
 * runs (cpu/cpu.h), forcing each in turn, so that a machine with AVX-512
 * also tests the AVX2 and scalar copies. Include after <cmocka.h>.
 */
#ifndef KVD_TESTS_CPU_LEVELS_H
#define KVD_TESTS_CPU_LEVELS_H

#include "cpu/cpu.h"

/* The levels from `from` up that this build carries and this CPU runs,
 * lowest first, into out; returns how many. */
static inline int cl_levels(enum cpu_level from, enum cpu_level *out)
{
    int n = 0;
    for (int l = from; l < CPU_N_LEVELS; l++)
        if (cpu_level_built((enum cpu_level)l) && cpu_level_supported((enum cpu_level)l, NULL, 0))
            out[n++] = (enum cpu_level)l;
    return n;
}

/* Force level l (which cl_levels returned); fails the test if refused. */
static inline void cl_force(enum cpu_level l)
{
    char err[256];
    if (cpu_force(cpu_level_name(l), err, sizeof(err)))
        fail_msg("cpu_force(%s): %s", cpu_level_name(l), err);
}

#endif /* KVD_TESTS_CPU_LEVELS_H */
