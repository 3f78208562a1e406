/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader. Every input is
 * opened with gguf_open_memory; whatever opens is walked through every
 * accessor, so a validation gap shows as an out-of-bounds read under
 * AddressSanitizer. Built and run by `make fuzz` from the small GGUF files
 * in tests/fuzz/corpus/gguf/ (a tensor file, a vocabulary, an f16 tensor)
 * with tests/fuzz/gguf.dict.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "model/gguf.h"

static volatile uint64_t sink;

static void walk(const gguf_file *f)
{
    uint64_t h = gguf_version(f) + gguf_alignment(f);
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        const char *key = gguf_kv_key(f, i);
        h += strlen(key) + (uint64_t)gguf_kv_type(f, i);
        const char *s;
        size_t len;
        uint32_t u32;
        int64_t i64;
        float x;
        bool b;
        enum gguf_type et;
        uint64_t n;
        const void *data;
        if (gguf_get_str(f, key, &s, &len) == 0 && len)
            h += (uint8_t)s[0] + (uint8_t)s[len - 1];
        if (gguf_get_u32(f, key, &u32) == 0)
            h += u32;
        if (gguf_get_i64(f, key, &i64) == 0)
            h += (uint64_t)i64;
        if (gguf_get_f32(f, key, &x) == 0)
            h += x == x;
        if (gguf_get_bool(f, key, &b) == 0)
            h += b;
        if (gguf_get_arr(f, key, &et, &n, &data) == 0)
            for (uint64_t k = 0; k < n; k++) {
                if (gguf_get_arr_str(f, key, k, &s, &len) == 0 && len)
                    h += (uint8_t)s[0] + (uint8_t)s[len - 1];
                if (gguf_get_arr_f32(f, key, k, &x) == 0)
                    h += x == x;
                if (gguf_get_arr_i64(f, key, k, &i64) == 0)
                    h += (uint64_t)i64;
            }
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        if (gguf_find_tensor(f, t->name) != t)
            __builtin_trap();
        const uint8_t *p = t->data;
        h += p[0] + p[t->size - 1] + t->n_elements;
    }
    sink = h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char err[512];
    gguf_file *f = gguf_open_memory(data, size, err, sizeof(err));
    if (f) {
        walk(f);
        gguf_close(f);
    } else if (err[0] == '\0') {
        __builtin_trap(); /* every refusal must say why */
    }
    return 0;
}
