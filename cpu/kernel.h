/*
 * kernel.h - for a SIMD kernel file that the Makefile compiles once per
 * level (KERNEL_SRC), and for the module that picks among the copies.
 *
 * In the file itself, select code by the KERN_AVX512 / KERN_AVX2 macros
 * defined here, never by the compiler's __AVX2__ family: the scalar copy is
 * compiled for the build's ARCH, which may well be a native AVX-512 machine,
 * and must still be the plain C path when that level is forced. Export only
 * names wrapped in KERN(), which appends the level (foo_avx2), so the
 * copies link side by side; everything else in the file stays static.
 *
 * In the dispatching module, KERN_TABLE(name) makes the array of the three
 * copies of an exported object, indexed by enum cpu_level, NULL where this
 * build does not carry the level (cpu_level() never picks those).
 */
#ifndef KVD_CPU_KERNEL_H
#define KVD_CPU_KERNEL_H

#include "cpu/cpu.h"

#if defined(KVD_LEVEL_AVX512)
#define KERN_AVX512 1
#define KERN_SIMD 1
#define KERN_LEVEL CPU_AVX512
#define KERN(name) name##_avx512
#elif defined(KVD_LEVEL_AVX2)
#define KERN_AVX2 1
#define KERN_SIMD 1
#define KERN_LEVEL CPU_AVX2
#define KERN(name) name##_avx2
#else
#define KERN_LEVEL CPU_SCALAR
#define KERN(name) name##_scalar
#endif

/* Declares the copies of an exported object of type T named name. */
#define KERN_DECLARE(T, name) extern T name##_scalar, name##_avx2, name##_avx512

#if defined(KVD_KERNEL_LEVELS) && KVD_KERNEL_LEVELS > 1
#define KERN_TABLE(name) {&name##_scalar, &name##_avx2, &name##_avx512}
#else
#define KERN_TABLE(name) {&name##_scalar, NULL, NULL}
#endif

#endif /* KVD_CPU_KERNEL_H */
