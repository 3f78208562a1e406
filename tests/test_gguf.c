/*
 * test_gguf.c - the GGUF reader and writer.
 *
 * One small valid file is built with the writer (every metadata type, a few
 * tensors of different types) and read back value by value and byte by
 * byte. Hostile files are that same file with one field mutated, each case
 * a row of a table naming the field, the bytes written and the words the
 * error must contain; every prefix of the file is opened and must fail;
 * a seeded random mutation loop opens thousands of damaged copies and walks
 * whatever opens. Every buffer handed to the reader is a malloc'd copy of
 * exactly its size, so an out-of-bounds read shows under AddressSanitizer.
 * Real files from the shared directory (KVD_SHARED, default ../shared) are
 * read when present.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "model/gguf.h"

/* ------------------------------------------------------------------------
 * The sample file
 * ------------------------------------------------------------------------ */

static uint64_t rng_state;

static uint32_t rng(void)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t)(rng_state >> 33);
}

static const char *const arr_strs[] = {"a", "", "tokens", "<0x0A>", "h\xc3\xa9llo"};
static const int32_t arr_i32[] = {-7, 0, 7, INT32_MIN, INT32_MAX};
static const float arr_f32[] = {0.5f, -2.25f, 1e30f};
static const double arr_f64[] = {3.25, -1e300};
static const uint8_t arr_u8[] = {1, 2, 255};
static const int8_t arr_i8[] = {-1, 5, -128};
static const uint16_t arr_u16[] = {65535, 3};
static const int16_t arr_i16[] = {-32768, 12};
static const uint32_t arr_u32[] = {4000000000u, 1};
static const uint64_t arr_u64[] = {UINT64_MAX, 0};
static const int64_t arr_i64[] = {INT64_MIN, 42};
static const bool arr_bool[] = {true, false, true};

struct sample_tensor {
    const char *name;
    enum ggml_type type;
    int n_dims;
    uint64_t ne[4];
    size_t size;
};

static const struct sample_tensor sample_tensors[] = {
    {"tok_embd.weight", GGML_TYPE_F32, 2, {4, 3}, 4 * 3 * 4},
    {"blk.0.attn_q.weight", GGML_TYPE_Q8_0, 2, {64, 2}, 4 * 34},
    {"blk.0.ffn.weight", GGML_TYPE_Q4_K, 4, {256, 1, 1, 2}, 2 * 144},
    {"norm.weight", GGML_TYPE_F16, 1, {5}, 10},
    {"bf.weight", GGML_TYPE_BF16, 2, {3, 2}, 12},
    {"dup.t1", GGML_TYPE_F32, 1, {1}, 4},
    {"dup.t2", GGML_TYPE_Q6_K, 1, {256}, 210},
};
#define N_SAMPLE_TENSORS (sizeof(sample_tensors) / sizeof(sample_tensors[0]))
#define N_SAMPLE_KV 31

/* Deterministic bytes of tensor i. */
static void tensor_bytes(size_t i, uint8_t *out, size_t n)
{
    rng_state = 1000 + i;
    for (size_t k = 0; k < n; k++)
        out[k] = (uint8_t)rng();
}

/* Add every metadata type and the sample tensors to w. */
static void fill_sample(gguf_writer *w)
{
    uint8_t u8 = 200;
    int8_t i8 = -100;
    uint16_t u16 = 60000;
    int16_t i16 = -30000;
    int64_t i64 = -((int64_t)1 << 62);
    double f64 = 3.141592653589793;
    assert_int_equal(gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 32), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.u8", GGUF_TYPE_UINT8, &u8), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i8", GGUF_TYPE_INT8, &i8), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.u16", GGUF_TYPE_UINT16, &u16), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i16", GGUF_TYPE_INT16, &i16), 0);
    assert_int_equal(gguf_writer_set_u32(w, "t.u32", 4000000000u), 0);
    assert_int_equal(gguf_writer_set_i32(w, "t.i32", -2000000000), 0);
    assert_int_equal(gguf_writer_set_f32(w, "t.f32", 1.5f), 0);
    assert_int_equal(gguf_writer_set_bool(w, "t.bool", true), 0);
    assert_int_equal(gguf_writer_set_str(w, "t.str", "h\xc3\xa9llo world"), 0);
    assert_int_equal(gguf_writer_set_u64(w, "t.u64", ((uint64_t)1 << 63) + 5), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.i64", GGUF_TYPE_INT64, &i64), 0);
    assert_int_equal(gguf_writer_set_scalar(w, "t.f64", GGUF_TYPE_FLOAT64, &f64), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_u8", GGUF_TYPE_UINT8, arr_u8, 3), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_i8", GGUF_TYPE_INT8, arr_i8, 3), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_u16", GGUF_TYPE_UINT16, arr_u16, 2), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_i16", GGUF_TYPE_INT16, arr_i16, 2), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_u32", GGUF_TYPE_UINT32, arr_u32, 2), 0);
    assert_int_equal(gguf_writer_set_arr_i32(w, "t.arr_i32", arr_i32, 5), 0);
    assert_int_equal(gguf_writer_set_arr_f32(w, "t.arr_f32", arr_f32, 3), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_bool", GGUF_TYPE_BOOL, arr_bool, 3), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_u64", GGUF_TYPE_UINT64, arr_u64, 2), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_i64", GGUF_TYPE_INT64, arr_i64, 2), 0);
    assert_int_equal(gguf_writer_set_arr(w, "t.arr_f64", GGUF_TYPE_FLOAT64, arr_f64, 2), 0);
    assert_int_equal(gguf_writer_set_arr_str(w, "t.arr_str", arr_strs, 5), 0);
    assert_int_equal(gguf_writer_set_arr_i32(w, "t.arr_empty", NULL, 0), 0);
    assert_int_equal(gguf_writer_set_arr_str(w, "t.arr_str_empty", NULL, 0), 0);
    assert_int_equal(gguf_writer_set_u32(w, "dup.key1", 1), 0);
    assert_int_equal(gguf_writer_set_u32(w, "dup.key2", 2), 0);
    assert_int_equal(gguf_writer_set_bool(w, "t.last", false), 0);

    for (size_t i = 0; i < N_SAMPLE_TENSORS; i++) {
        const struct sample_tensor *t = &sample_tensors[i];
        uint8_t *data = malloc(t->size);
        assert_non_null(data);
        tensor_bytes(i, data, t->size);
        assert_int_equal(
            gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, data, t->size), 0);
        free(data);
    }
}

/* The sample serialised: a malloc'd buffer of exactly *size bytes. */
static uint8_t *sample(size_t *size)
{
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    fill_sample(w);
    void *buf;
    assert_int_equal(gguf_writer_to_memory(w, &buf, size), 0);
    gguf_writer_destroy(w);
    return buf;
}

static uint8_t *copy_of(const uint8_t *buf, size_t size)
{
    uint8_t *c = malloc(size ? size : 1);
    assert_non_null(c);
    memcpy(c, buf, size);
    return c;
}

/* ------------------------------------------------------------------------
 * Checking a file against the sample
 * ------------------------------------------------------------------------ */

static void expect_arr_i64(const gguf_file *f, const char *key, enum gguf_type type,
                           const int64_t *want, uint64_t n)
{
    enum gguf_type et;
    uint64_t got_n;
    const void *data;
    assert_int_equal(gguf_get_arr(f, key, &et, &got_n, &data), 0);
    assert_int_equal(et, type);
    assert_int_equal(got_n, n);
    assert_non_null(data);
    for (uint64_t i = 0; i < n; i++) {
        int64_t v;
        assert_int_equal(gguf_get_arr_i64(f, key, i, &v), 0);
        assert_true(v == want[i]);
    }
    int64_t v;
    assert_int_equal(gguf_get_arr_i64(f, key, n, &v), -ERANGE);
}

static void check_sample(const gguf_file *f)
{
    assert_int_equal(gguf_n_kv(f), N_SAMPLE_KV);
    assert_int_equal(gguf_alignment(f), 32);

    /* Keys in insertion order, each found at its index. */
    static const char *const order[] = {"general.architecture", "general.alignment", "t.u8"};
    for (int i = 0; i < 3; i++) {
        assert_string_equal(gguf_kv_key(f, i), order[i]);
        assert_int_equal(gguf_find_key(f, order[i]), i);
    }
    assert_string_equal(gguf_kv_key(f, N_SAMPLE_KV - 1), "t.last");
    assert_null(gguf_kv_key(f, N_SAMPLE_KV));
    assert_null(gguf_kv_key(f, -1));
    assert_int_equal(gguf_find_key(f, "t.nope"), -1);
    assert_int_equal(gguf_find_key(f, "t.u"), -1);
    for (int64_t i = 0; i < gguf_n_kv(f); i++)
        assert_int_equal(gguf_find_key(f, gguf_kv_key(f, i)), i);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "t.u8")), GGUF_TYPE_UINT8);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "t.f64")), GGUF_TYPE_FLOAT64);
    assert_int_equal(gguf_kv_type(f, gguf_find_key(f, "t.arr_str")), GGUF_TYPE_ARRAY);

    /* Scalars. */
    const char *s;
    size_t len;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &len), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "llama", 5);
    assert_int_equal(gguf_get_str(f, "t.str", &s, &len), 0);
    assert_int_equal(len, strlen("h\xc3\xa9llo world"));
    assert_memory_equal(s, "h\xc3\xa9llo world", len);

    uint32_t u32;
    int64_t i64;
    float f32;
    bool b;
    assert_int_equal(gguf_get_u32(f, "t.u8", &u32), 0);
    assert_int_equal(u32, 200);
    assert_int_equal(gguf_get_i64(f, "t.i8", &i64), 0);
    assert_int_equal(i64, -100);
    assert_int_equal(gguf_get_u32(f, "t.u16", &u32), 0);
    assert_int_equal(u32, 60000);
    assert_int_equal(gguf_get_i64(f, "t.i16", &i64), 0);
    assert_int_equal(i64, -30000);
    assert_int_equal(gguf_get_u32(f, "t.u32", &u32), 0);
    assert_int_equal(u32, 4000000000u);
    assert_int_equal(gguf_get_i64(f, "t.i32", &i64), 0);
    assert_int_equal(i64, -2000000000);
    assert_int_equal(gguf_get_f32(f, "t.f32", &f32), 0);
    assert_true(f32 == 1.5f);
    assert_int_equal(gguf_get_bool(f, "t.bool", &b), 0);
    assert_true(b);
    assert_int_equal(gguf_get_bool(f, "t.last", &b), 0);
    assert_false(b);
    assert_int_equal(gguf_get_i64(f, "t.i64", &i64), 0);
    assert_true(i64 == -((int64_t)1 << 62));
    assert_int_equal(gguf_get_f32(f, "t.f64", &f32), 0);
    assert_true(f32 == (float)3.141592653589793);

    /* Type fitting: integers convert when the value fits, nothing else does. */
    assert_int_equal(gguf_get_u32(f, "t.i8", &u32), -EINVAL);   /* negative */
    assert_int_equal(gguf_get_u32(f, "t.u64", &u32), -EINVAL);  /* too big */
    assert_int_equal(gguf_get_i64(f, "t.u64", &i64), -EINVAL);  /* 2^63+5 */
    assert_int_equal(gguf_get_i64(f, "t.u32", &i64), 0);
    assert_int_equal(i64, 4000000000);
    assert_int_equal(gguf_get_f32(f, "t.i16", &f32), 0);
    assert_true(f32 == -30000.0f);
    assert_int_equal(gguf_get_f32(f, "t.str", &f32), -EINVAL);
    assert_int_equal(gguf_get_u32(f, "t.f32", &u32), -EINVAL);
    assert_int_equal(gguf_get_u32(f, "t.bool", &u32), -EINVAL);
    assert_int_equal(gguf_get_bool(f, "t.u8", &b), -EINVAL);
    assert_int_equal(gguf_get_str(f, "t.u8", &s, &len), -EINVAL);
    assert_int_equal(gguf_get_u32(f, "t.absent", &u32), -ENOENT);
    assert_int_equal(gguf_get_str(f, "t.absent", &s, &len), -ENOENT);

    /* Numeric arrays, every element, through both getters. */
    int64_t want[8];
    for (int i = 0; i < 3; i++)
        want[i] = arr_u8[i];
    expect_arr_i64(f, "t.arr_u8", GGUF_TYPE_UINT8, want, 3);
    for (int i = 0; i < 3; i++)
        want[i] = arr_i8[i];
    expect_arr_i64(f, "t.arr_i8", GGUF_TYPE_INT8, want, 3);
    for (int i = 0; i < 2; i++)
        want[i] = arr_u16[i];
    expect_arr_i64(f, "t.arr_u16", GGUF_TYPE_UINT16, want, 2);
    for (int i = 0; i < 2; i++)
        want[i] = arr_i16[i];
    expect_arr_i64(f, "t.arr_i16", GGUF_TYPE_INT16, want, 2);
    for (int i = 0; i < 2; i++)
        want[i] = arr_u32[i];
    expect_arr_i64(f, "t.arr_u32", GGUF_TYPE_UINT32, want, 2);
    for (int i = 0; i < 5; i++)
        want[i] = arr_i32[i];
    expect_arr_i64(f, "t.arr_i32", GGUF_TYPE_INT32, want, 5);
    for (int i = 0; i < 2; i++)
        want[i] = arr_i64[i];
    expect_arr_i64(f, "t.arr_i64", GGUF_TYPE_INT64, want, 2);
    for (int i = 0; i < 3; i++)
        want[i] = arr_bool[i];
    expect_arr_i64(f, "t.arr_bool", GGUF_TYPE_BOOL, want, 3);
    expect_arr_i64(f, "t.arr_empty", GGUF_TYPE_INT32, want, 0);

    assert_int_equal(gguf_get_arr_i64(f, "t.arr_u64", 0, &i64), -EINVAL); /* 2^64-1 */
    assert_int_equal(gguf_get_arr_i64(f, "t.arr_u64", 1, &i64), 0);
    assert_int_equal(i64, 0);
    for (uint64_t i = 0; i < 3; i++) {
        assert_int_equal(gguf_get_arr_f32(f, "t.arr_f32", i, &f32), 0);
        assert_true(f32 == arr_f32[i]);
    }
    assert_int_equal(gguf_get_arr_i64(f, "t.arr_f32", 0, &i64), -EINVAL); /* 0.5 */
    for (uint64_t i = 0; i < 2; i++) {
        assert_int_equal(gguf_get_arr_f32(f, "t.arr_f64", i, &f32), 0);
        assert_true(f32 == (float)arr_f64[i]);
    }
    {
        /* The packed data pointer holds the little-endian elements. */
        const void *data;
        uint64_t n;
        assert_int_equal(gguf_get_arr(f, "t.arr_f64", NULL, &n, &data), 0);
        double d;
        memcpy(&d, (const uint8_t *)data + 8, 8);
        assert_true(d == -1e300);
    }
    assert_int_equal(gguf_get_arr_f32(f, "t.arr_i32", 3, &f32), 0);
    assert_true(f32 == (float)INT32_MIN);
    assert_int_equal(gguf_get_arr_f32(f, "t.arr_str", 0, &f32), -EINVAL);
    assert_int_equal(gguf_get_arr_f32(f, "t.u8", 0, &f32), -EINVAL);
    assert_int_equal(gguf_get_arr(f, "t.u8", NULL, NULL, NULL), -EINVAL);

    /* String arrays. */
    enum gguf_type et;
    uint64_t n;
    const void *data = &n;
    assert_int_equal(gguf_get_arr(f, "t.arr_str", &et, &n, &data), 0);
    assert_int_equal(et, GGUF_TYPE_STRING);
    assert_int_equal(n, 5);
    assert_null(data);
    for (uint64_t i = 0; i < 5; i++) {
        assert_int_equal(gguf_get_arr_str(f, "t.arr_str", i, &s, &len), 0);
        assert_int_equal(len, strlen(arr_strs[i]));
        assert_memory_equal(s, arr_strs[i], len);
    }
    assert_int_equal(gguf_get_arr_str(f, "t.arr_str", 5, &s, &len), -ERANGE);
    assert_int_equal(gguf_get_arr_str(f, "t.arr_i32", 0, &s, &len), -EINVAL);
    assert_int_equal(gguf_get_arr(f, "t.arr_str_empty", &et, &n, NULL), 0);
    assert_int_equal(n, 0);
    assert_int_equal(gguf_get_arr_str(f, "t.arr_str_empty", 0, &s, &len), -ERANGE);

    /* Tensors: infos, placement and every byte. */
    assert_int_equal(gguf_n_tensors(f), N_SAMPLE_TENSORS);
    assert_null(gguf_tensor_at(f, (int64_t)N_SAMPLE_TENSORS));
    assert_null(gguf_find_tensor(f, "blk.0"));
    for (size_t i = 0; i < N_SAMPLE_TENSORS; i++) {
        const struct sample_tensor *st = &sample_tensors[i];
        const struct gguf_tensor *t = gguf_tensor_at(f, (int64_t)i);
        assert_non_null(t);
        assert_ptr_equal(gguf_find_tensor(f, st->name), t);
        assert_string_equal(t->name, st->name);
        assert_int_equal(t->type, st->type);
        assert_int_equal(t->n_dims, st->n_dims);
        uint64_t n_elem = 1;
        for (int d = 0; d < GGUF_MAX_DIMS; d++) {
            assert_int_equal(t->ne[d], d < st->n_dims ? st->ne[d] : 1);
            n_elem *= t->ne[d];
        }
        assert_int_equal(t->n_elements, n_elem);
        assert_int_equal(t->size, st->size);
        assert_int_equal(t->offset % 32, 0);
        uint8_t *want_bytes = malloc(st->size);
        assert_non_null(want_bytes);
        tensor_bytes(i, want_bytes, st->size);
        assert_memory_equal(t->data, want_bytes, st->size);
        free(want_bytes);
    }
}

static void test_round_trip(void **state)
{
    (void)state;
    size_t size;
    uint8_t *buf = sample(&size);
    char err[512] = "";
    gguf_file *f = gguf_open_memory(buf, size, err, sizeof(err));
    if (!f)
        fail_msg("open: %s", err);
    assert_int_equal(gguf_version(f), 3);
    check_sample(f);
    gguf_close(f);

    /* The writer is deterministic: the same input gives the same bytes. */
    size_t size2;
    uint8_t *buf2 = sample(&size2);
    assert_int_equal(size, size2);
    assert_memory_equal(buf, buf2, size);
    free(buf2);
    free(buf);
}

/* Version 2 has the same layout as version 3 (64-bit counts and lengths). */
static void test_version_2(void **state)
{
    (void)state;
    size_t size;
    uint8_t *buf = sample(&size);
    buf[4] = 2;
    char err[512] = "";
    gguf_file *f = gguf_open_memory(buf, size, err, sizeof(err));
    if (!f)
        fail_msg("open v2: %s", err);
    assert_int_equal(gguf_version(f), 2);
    check_sample(f);
    gguf_close(f);
    free(buf);
}

/* ------------------------------------------------------------------------
 * Writer behaviour
 * ------------------------------------------------------------------------ */

static void test_writer_rules(void **state)
{
    (void)state;
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    assert_int_equal(gguf_writer_set_u32(w, "a", 1), 0);
    assert_int_equal(gguf_writer_set_u32(w, "b", 2), 0);
    /* Setting again replaces the value and keeps the first position. */
    assert_int_equal(gguf_writer_set_str(w, "a", "again"), 0);
    /* Setters copy: the caller's buffers may change afterwards. */
    char name[] = "name.x";
    char val[] = "value";
    const char *arr[] = {val};
    assert_int_equal(gguf_writer_set_str(w, name, val), 0);
    assert_int_equal(gguf_writer_set_arr_str(w, "arr", arr, 1), 0);
    float fdata[64] = {1.0f};
    assert_int_equal(gguf_writer_add_tensor(w, name, GGML_TYPE_F32, 1, (uint64_t[]){32}, fdata, 128),
                     0);
    name[5] = 'y';
    val[0] = 'V';
    fdata[0] = 9.0f;

    /* Rejected input. */
    uint64_t ne[4] = {32, 2, 1, 1};
    assert_int_equal(gguf_writer_set_u32(w, "", 1), -EINVAL);
    assert_int_equal(gguf_writer_set_str(w, "k", NULL), -EINVAL);
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 48), -EINVAL);
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 0), -EINVAL);
    assert_int_equal(gguf_writer_set_u64(w, "general.alignment", 64), -EINVAL);
    assert_int_equal(gguf_writer_set_scalar(w, "k", GGUF_TYPE_STRING, "x"), -EINVAL);
    assert_int_equal(gguf_writer_set_arr(w, "k", GGUF_TYPE_ARRAY, fdata, 1), -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", (enum ggml_type)99, 1, ne, fdata, 128),
                     -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", GGML_TYPE_F32, 0, ne, fdata, 128), -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", GGML_TYPE_F32, 5, ne, fdata, 128), -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", GGML_TYPE_F32, 1, ne, fdata, 124), -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", GGML_TYPE_Q8_0, 1, (uint64_t[]){33}, fdata,
                                            34),
                     -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "t", GGML_TYPE_F32, 1, (uint64_t[]){0}, fdata, 0),
                     -EINVAL);
    assert_int_equal(gguf_writer_add_tensor(w, "name.x", GGML_TYPE_F32, 1, ne, fdata, 128),
                     -EEXIST);
    /* A valid 64-byte alignment changes the layout. */
    assert_int_equal(gguf_writer_set_u32(w, "general.alignment", 64), 0);
    assert_int_equal(gguf_writer_add_tensor(w, "t2", GGML_TYPE_F32, 2, ne, fdata, 256), 0);

    void *buf;
    size_t size;
    assert_int_equal(gguf_writer_to_memory(w, &buf, &size), 0);
    gguf_writer_destroy(w);
    char err[512] = "";
    gguf_file *f = gguf_open_memory(buf, size, err, sizeof(err));
    if (!f)
        fail_msg("open: %s", err);
    assert_int_equal(gguf_n_kv(f), 5);
    assert_string_equal(gguf_kv_key(f, 0), "a");
    assert_string_equal(gguf_kv_key(f, 1), "b");
    assert_string_equal(gguf_kv_key(f, 2), "name.x");
    const char *s;
    size_t len;
    assert_int_equal(gguf_get_str(f, "a", &s, &len), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "again", 5);
    assert_int_equal(gguf_get_str(f, "name.x", &s, &len), 0);
    assert_memory_equal(s, "value", 5);
    assert_int_equal(gguf_get_arr_str(f, "arr", 0, &s, &len), 0);
    assert_memory_equal(s, "value", 5);
    assert_int_equal(gguf_alignment(f), 64);
    const struct gguf_tensor *t = gguf_find_tensor(f, "name.x");
    assert_non_null(t);
    float first;
    memcpy(&first, t->data, 4);
    assert_true(first == 1.0f);
    t = gguf_find_tensor(f, "t2");
    assert_non_null(t);
    assert_int_equal(t->offset % 64, 0);
    assert_int_equal(t->offset, 128);
    /* The file ends exactly where the last tensor's bytes end. */
    assert_int_equal((const uint8_t *)t->data + t->size - (const uint8_t *)buf, size);
    gguf_close(f);
    free(buf);

    /* No tensors: a header and metadata only. */
    w = gguf_writer_create();
    assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), 0);
    assert_int_equal(gguf_writer_to_memory(w, &buf, &size), 0);
    gguf_writer_destroy(w);
    f = gguf_open_memory(buf, size, err, sizeof(err));
    if (!f)
        fail_msg("open: %s", err);
    assert_int_equal(gguf_n_tensors(f), 0);
    gguf_close(f);
    free(buf);
}

/* ------------------------------------------------------------------------
 * Files on disk
 * ------------------------------------------------------------------------ */

static char tmpdir[256];

static void make_tmpdir(void)
{
    const char *base = getenv("TMPDIR");
    snprintf(tmpdir, sizeof(tmpdir), "%s/kvd-gguf-XXXXXX", base && *base ? base : "/tmp");
    assert_non_null(mkdtemp(tmpdir));
}

static void write_bytes(const char *path, const void *data, size_t n)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(data, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

static void expect_open_fails(const char *path, const char *w1, const char *w2)
{
    char err[512] = "";
    gguf_file *f = gguf_open(path, err, sizeof(err));
    if (f)
        fail_msg("%s opened but should not", path);
    if (!strstr(err, w1) || (w2 && !strstr(err, w2)))
        fail_msg("error for %s lacks '%s'/'%s': %s", path, w1, w2 ? w2 : "", err);
    if (!strstr(err, path))
        fail_msg("error does not name the path: %s", err);
}

static void test_files(void **state)
{
    (void)state;
    make_tmpdir();
    char path[512], tmp[520];

    snprintf(path, sizeof(path), "%s/absent.gguf", tmpdir);
    expect_open_fails(path, "cannot open", "No such file");
    expect_open_fails(tmpdir, "directory", NULL);

    snprintf(path, sizeof(path), "%s/empty.gguf", tmpdir);
    write_bytes(path, "", 0);
    expect_open_fails(path, "empty", NULL);

    snprintf(path, sizeof(path), "%s/short.gguf", tmpdir);
    write_bytes(path, "GGUF\3\0\0\0\0\0", 10);
    expect_open_fails(path, "smaller than the 24-byte", NULL);

    snprintf(path, sizeof(path), "%s/text.gguf", tmpdir);
    write_bytes(path, "this is not a model file at all", 31);
    expect_open_fails(path, "magic", "not a GGUF file");

    /* The writer's file opens, mapped, with aligned data pointers. */
    snprintf(path, sizeof(path), "%s/sample.gguf", tmpdir);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    gguf_writer *w = gguf_writer_create();
    fill_sample(w);
    char err[512] = "";
    if (gguf_writer_write(w, path, err, sizeof(err)) != 0)
        fail_msg("write: %s", err);
    assert_int_equal(access(tmp, F_OK), -1);
    gguf_file *f = gguf_open(path, err, sizeof(err));
    if (!f)
        fail_msg("open: %s", err);
    check_sample(f);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++)
        assert_int_equal((uintptr_t)gguf_tensor_at(f, i)->data % 32, 0);
    gguf_close(f);

    /* Its bytes equal gguf_writer_to_memory's. */
    void *mem;
    size_t size;
    assert_int_equal(gguf_writer_to_memory(w, &mem, &size), 0);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal((size_t)st.st_size, size);
    FILE *fp = fopen(path, "rb");
    uint8_t *disk = malloc(size);
    assert_int_equal(fread(disk, 1, size, fp), size);
    fclose(fp);
    assert_memory_equal(disk, mem, size);
    free(disk);
    free(mem);

    /* Writing into a missing directory fails with the errno and the path. */
    snprintf(path, sizeof(path), "%s/no/such/dir/x.gguf", tmpdir);
    assert_int_equal(gguf_writer_write(w, path, err, sizeof(err)), -ENOENT);
    assert_non_null(strstr(err, "x.gguf.tmp"));
    gguf_writer_destroy(w);

    const char *names[] = {"absent.gguf", "empty.gguf", "short.gguf", "text.gguf", "sample.gguf"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s", tmpdir, names[i]);
        unlink(path);
    }
    rmdir(tmpdir);
}

/* ------------------------------------------------------------------------
 * Hostile files: one field of the sample changed per case
 * ------------------------------------------------------------------------ */

static void put_le(uint8_t *p, uint64_t v, int width)
{
    for (int i = 0; i < width; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int width)
{
    uint64_t v = 0;
    for (int i = 0; i < width; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

/*
 * Offset of the 8-byte length field that precedes `name` (a key or tensor
 * name) in buf; the length prefix makes the match exact.
 */
static size_t locate(const uint8_t *buf, size_t size, const char *name)
{
    size_t n = strlen(name);
    uint8_t needle[128];
    assert_true(n + 8 <= sizeof(needle));
    put_le(needle, n, 8);
    memcpy(needle + 8, name, n);
    const uint8_t *hit = memmem(buf, size, needle, n + 8);
    if (!hit)
        fail_msg("'%s' not found in the sample", name);
    assert_null(memmem(hit + 1, size - (size_t)(hit + 1 - buf), needle, n + 8));
    return (size_t)(hit - buf);
}

enum anchor {
    HEADER,  /* offset from the start of the file */
    KEY,     /* from the key's length field */
    VALUE,   /* from the kv's type field (just after the key) */
    TENSOR,  /* from the tensor info's n_dims field (just after the name) */
};

struct mutation {
    const char *what;
    enum anchor anchor;
    const char *name; /* key or tensor name for KEY/VALUE/TENSOR */
    size_t at;        /* byte offset from the anchor */
    int width;        /* bytes written, little-endian */
    uint64_t value;
    const char *expect[3]; /* words the error must contain */
};

#define T_OFFSET(n_dims) (4 + 8 * (n_dims) + 4) /* data offset field, from n_dims */
#define T_TYPE(n_dims) (4 + 8 * (n_dims))       /* type field, from n_dims */

static const struct mutation mutations[] = {
    /* header */
    {"bad magic", HEADER, NULL, 0, 4, 0x46554747ull ^ 0x20, {"magic", "not a GGUF file"}},
    {"version 1", HEADER, NULL, 4, 4, 1, {"version 1", "not supported"}},
    {"version 0", HEADER, NULL, 4, 4, 0, {"unsupported GGUF version 0"}},
    {"version 4", HEADER, NULL, 4, 4, 4, {"unsupported GGUF version 4"}},
    {"big-endian version", HEADER, NULL, 4, 4, 0x03000000u, {"big-endian"}},
    {"tensor count 2^40", HEADER, NULL, 8, 8, 1ull << 40, {"tensor count 1099511627776"}},
    {"tensor count 2^64-1", HEADER, NULL, 8, 8, UINT64_MAX, {"tensor count", "impossible"}},
    {"kv count 2^62", HEADER, NULL, 16, 8, 1ull << 62, {"kv count 4611686018427387904"}},
    {"kv count 2^64-1", HEADER, NULL, 16, 8, UINT64_MAX, {"kv count", "impossible"}},
    {"kv count one too many", HEADER, NULL, 16, 8, N_SAMPLE_KV + 1, {"tensor"}},
    {"kv count one too few", HEADER, NULL, 16, 8, N_SAMPLE_KV - 1,
     {"tensor 't.last' (info 0)", "n_dims 7"}},
    /* keys */
    {"key length 2^63", KEY, "t.u16", 0, 8, 1ull << 63, {"metadata kv 4", "key length", "limit"}},
    {"key length 2^64-1", KEY, "t.u16", 0, 8, UINT64_MAX, {"key length 18446744073709551615"}},
    {"key length 0", KEY, "t.u16", 0, 8, 0, {"metadata kv 4", "empty key"}},
    {"key length 70000", KEY, "t.u16", 0, 8, 70000, {"key length 70000", "limit"}},
    {"key with NUL", KEY, "t.u16", 9, 1, 0, {"metadata kv 4", "NUL"}},
    {"duplicate key", KEY, "dup.key2", 8 + 7, 1, '1', {"'dup.key1'", "duplicate key", "kv 28"}},
    /* values */
    {"unknown value type 13", VALUE, "t.f32", 0, 4, 13, {"'t.f32'", "unknown value type 13"}},
    {"unknown value type 2^32-1", VALUE, "t.u8", 0, 4, UINT32_MAX, {"'t.u8'", "unknown value"}},
    {"bool value 2", VALUE, "t.bool", 4, 1, 2, {"'t.bool'", "bool value 2"}},
    {"string length 2^63", VALUE, "t.str", 4, 8, 1ull << 63,
     {"'t.str'", "string value length 9223372036854775808", "past the end"}},
    {"string length 2^64-1", VALUE, "t.str", 4, 8, UINT64_MAX,
     {"'t.str'", "length 18446744073709551615", "past the end"}},
    {"array string length 2^63", VALUE, "t.arr_str", 16, 8, 1ull << 63,
     {"'t.arr_str'", "array string 0 length 9223372036854775808", "past the end"}},
    {"array string length 2^64-1", VALUE, "t.arr_str", 16 + 9, 8, UINT64_MAX,
     {"'t.arr_str'", "array string 1", "past the end"}},
    {"array length 2^62", VALUE, "t.arr_i32", 8, 8, 1ull << 62,
     {"'t.arr_i32'", "array of 4611686018427387904 int32"}},
    {"array length 2^64-1", VALUE, "t.arr_u8", 8, 8, UINT64_MAX, {"'t.arr_u8'", "array of"}},
    {"string array length 2^62", VALUE, "t.arr_str", 8, 8, 1ull << 62,
     {"'t.arr_str'", "array of 4611686018427387904 strings"}},
    {"array of arrays", VALUE, "t.arr_i32", 4, 4, GGUF_TYPE_ARRAY,
     {"'t.arr_i32'", "arrays of arrays"}},
    {"unknown array element type", VALUE, "t.arr_i32", 4, 4, 77,
     {"'t.arr_i32'", "unknown array element type 77"}},
    {"bool array element 255", VALUE, "t.arr_bool", 16 + 1, 1, 255, {"'t.arr_bool'", "bool"}},
    {"alignment 0", VALUE, "general.alignment", 4, 4, 0,
     {"'general.alignment'", "alignment 0", "power of two"}},
    {"alignment 48", VALUE, "general.alignment", 4, 4, 48, {"alignment 48", "power of two"}},
    {"alignment 2^31", VALUE, "general.alignment", 4, 4, 1u << 31,
     {"tensor 'blk.0.attn_q.weight'", "not a multiple of the alignment 2147483648"}},
    {"alignment 64", VALUE, "general.alignment", 4, 4, 64,
     {"tensor 'blk.0.ffn.weight'", "offset 224", "alignment 64"}},
    {"alignment as float", VALUE, "general.alignment", 0, 4, GGUF_TYPE_FLOAT32,
     {"'general.alignment'", "must be an integer"}},
    /* tensor infos */
    {"tensor name length 2^64-1", KEY, "norm.weight", 0, 8, UINT64_MAX,
     {"tensor info 3", "tensor name length", "limit"}},
    {"tensor name length past the end", KEY, "dup.t2", 0, 8, 60000,
     {"tensor info 6", "past the end"}},
    {"duplicate tensor name", KEY, "dup.t2", 8 + 5, 1, '1',
     {"tensor 'dup.t1'", "duplicate tensor name"}},
    {"n_dims 0", TENSOR, "norm.weight", 0, 4, 0, {"tensor 'norm.weight'", "n_dims 0"}},
    {"n_dims 5", TENSOR, "norm.weight", 0, 4, 5, {"tensor 'norm.weight'", "n_dims 5"}},
    {"n_dims 2^32-1", TENSOR, "norm.weight", 0, 4, UINT32_MAX, {"'norm.weight'", "n_dims"}},
    {"dimension 0", TENSOR, "bf.weight", 4 + 8, 8, 0, {"tensor 'bf.weight'", "dimension 1 is 0"}},
    {"dimension 2^63", TENSOR, "bf.weight", 4, 8, 1ull << 63,
     {"tensor 'bf.weight'", "dimension 0", "2^63-1"}},
    {"dims product overflow", TENSOR, "blk.0.ffn.weight", 4 + 8, 8, 1ull << 62,
     {"tensor 'blk.0.ffn.weight'", "product of the dimensions overflows"}},
    {"byte size overflow", TENSOR, "tok_embd.weight", 4 + 8, 8, 1ull << 60,
     {"tensor 'tok_embd.weight'", "byte size"}},
    {"unknown tensor type 99", TENSOR, "blk.0.attn_q.weight", T_TYPE(2), 4, 99,
     {"tensor 'blk.0.attn_q.weight'", "has unknown type 99"}},
    {"removed tensor type 4", TENSOR, "norm.weight", T_TYPE(1), 4, 4,
     {"tensor 'norm.weight'", "unknown type 4"}},
    {"iq2_xxs tensor (blocks of 256)", TENSOR, "blk.0.attn_q.weight", T_TYPE(2), 4, 16,
     {"tensor 'blk.0.attn_q.weight'", "iq2_xxs block size 256"}},
    {"ne[0] not a multiple of the block", TENSOR, "blk.0.attn_q.weight", 4, 8, 48,
     {"tensor 'blk.0.attn_q.weight'", "ne[0] = 48", "q8_0 block size 32"}},
    {"misaligned offset", TENSOR, "norm.weight", T_OFFSET(1), 8, 4 * 32 + 8,
     {"tensor 'norm.weight'", "offset 136", "not a multiple of the alignment 32"}},
    {"offset past the end", TENSOR, "norm.weight", T_OFFSET(1), 8, 1ull << 40,
     {"tensor 'norm.weight'", "data offset 1099511627776", "past the end"}},
    {"offset 2^64-32", TENSOR, "bf.weight", T_OFFSET(2), 8, UINT64_MAX - 31,
     {"tensor 'bf.weight'", "past the end"}},
    {"tensor grows past the end", TENSOR, "dup.t2", 4, 8, 512,
     {"tensor 'dup.t2'", "past the end"}},
    {"overlap", TENSOR, "dup.t2", T_OFFSET(1), 8, 0,
     {"'tok_embd.weight'", "'dup.t2'", "overlap"}},
    {"overlap by growth", TENSOR, "tok_embd.weight", 4 + 8, 8, 5,
     {"'tok_embd.weight'", "'blk.0.attn_q.weight'", "overlap"}},
};

/* Apply m to a fresh copy of the sample; returns the copy. */
static uint8_t *mutate(const uint8_t *base, size_t size, const struct mutation *m)
{
    uint8_t *buf = copy_of(base, size);
    size_t at = 0;
    switch (m->anchor) {
    case HEADER: at = 0; break;
    case KEY: at = locate(buf, size, m->name); break;
    case VALUE: at = locate(buf, size, m->name) + 8 + strlen(m->name); break;
    case TENSOR: at = locate(buf, size, m->name) + 8 + strlen(m->name); break;
    }
    at += m->at;
    assert_true(at + (size_t)m->width <= size);
    put_le(buf + at, m->value, m->width);
    return buf;
}

static void test_hostile_fields(void **state)
{
    (void)state;
    size_t size;
    uint8_t *base = sample(&size);
    /* Sanity: the anchors point where the table thinks. */
    size_t q = locate(base, size, "blk.0.attn_q.weight") + 8 + strlen("blk.0.attn_q.weight");
    assert_int_equal(get_le(base + q, 4), 2);
    assert_int_equal(get_le(base + q + T_TYPE(2), 4), GGML_TYPE_Q8_0);
    size_t v = locate(base, size, "general.alignment") + 8 + strlen("general.alignment");
    assert_int_equal(get_le(base + v, 4), GGUF_TYPE_UINT32);
    assert_int_equal(get_le(base + v + 4, 4), 32);

    int failures = 0;
    for (size_t i = 0; i < sizeof(mutations) / sizeof(mutations[0]); i++) {
        const struct mutation *m = &mutations[i];
        uint8_t *buf = mutate(base, size, m);
        char err[512] = "";
        gguf_file *f = gguf_open_memory(buf, size, err, sizeof(err));
        if (f) {
            print_error("case '%s': opened but should fail\n", m->what);
            failures++;
            gguf_close(f);
        } else {
            if (getenv("KVD_TEST_VERBOSE"))
                print_message("%-34s %s\n", m->what, err);
            for (int k = 0; k < 3 && m->expect[k]; k++)
                if (!strstr(err, m->expect[k])) {
                    print_error("case '%s': error lacks \"%s\": %s\n", m->what, m->expect[k],
                                err);
                    failures++;
                }
            if (m->anchor != HEADER && !strstr(err, "byte offset")) {
                print_error("case '%s': error has no byte offset: %s\n", m->what, err);
                failures++;
            }
        }
        free(buf);
    }
    free(base);
    assert_int_equal(failures, 0);
}

/* Every prefix of a valid file is a truncated file and must be refused. */
static void test_every_prefix_fails(void **state)
{
    (void)state;
    size_t size;
    uint8_t *base = sample(&size);
    for (size_t n = 0; n < size; n++) {
        uint8_t *buf = copy_of(base, n);
        char err[512] = "";
        gguf_file *f = gguf_open_memory(buf, n, err, sizeof(err));
        if (f)
            fail_msg("prefix of %zu of %zu bytes opened", n, size);
        if (err[0] == '\0')
            fail_msg("prefix of %zu bytes: empty error", n);
        if (n >= 24 && !strstr(err, "byte offset"))
            fail_msg("prefix of %zu bytes: no byte offset in: %s", n, err);
        if (n >= 24 && !strstr(err, "truncated") && !strstr(err, "past the end") &&
            !strstr(err, "impossible"))
            fail_msg("prefix of %zu bytes: error does not say truncated: %s", n, err);
        free(buf);
    }
    /* And the whole file opens. */
    gguf_file *f = gguf_open_memory(base, size, NULL, 0);
    assert_non_null(f);
    gguf_close(f);
    free(base);
}

/* Read everything an opened file offers (to catch out-of-bounds reads). */
static uint64_t walk(const gguf_file *f)
{
    uint64_t h = 0;
    for (int64_t i = 0; i < gguf_n_kv(f); i++) {
        const char *key = gguf_kv_key(f, i);
        h += strlen(key);
        const char *s;
        size_t len;
        enum gguf_type et;
        uint64_t n;
        float x;
        int64_t y;
        if (gguf_get_str(f, key, &s, &len) == 0)
            for (size_t k = 0; k < len; k++)
                h += (uint8_t)s[k];
        if (gguf_get_arr(f, key, &et, &n, NULL) == 0)
            for (uint64_t k = 0; k < n; k++) {
                if (gguf_get_arr_str(f, key, k, &s, &len) == 0)
                    for (size_t c = 0; c < len; c++)
                        h += (uint8_t)s[c];
                if (gguf_get_arr_f32(f, key, k, &x) == 0)
                    h += (uint64_t)(x == x);
                if (gguf_get_arr_i64(f, key, k, &y) == 0)
                    h += (uint64_t)y;
            }
        if (gguf_get_f32(f, key, &x) == 0)
            h += (uint64_t)(x == x);
    }
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        assert_ptr_equal(gguf_find_tensor(f, t->name), t);
        for (size_t k = 0; k < t->size; k++)
            h += ((const uint8_t *)t->data)[k];
    }
    return h;
}

/* Seeded random damage: whatever happens, no crash and no out-of-bounds read. */
static void test_random_damage(void **state)
{
    (void)state;
    size_t size;
    uint8_t *base = sample(&size);
    int opened = 0, refused = 0;
    rng_state = 12345;
    for (int iter = 0; iter < 20000; iter++) {
        uint8_t *buf = copy_of(base, size);
        int n_flips = 1 + (int)(rng() % 4);
        for (int k = 0; k < n_flips; k++) {
            size_t at = rng() % size;
            switch (rng() % 4) {
            case 0: buf[at] ^= (uint8_t)(1u << (rng() % 8)); break;
            case 1: buf[at] = (uint8_t)rng(); break;
            case 2: buf[at] = 0xff; break;
            default: /* a large little-endian integer in an 8-byte field */
                if (at + 8 <= size)
                    put_le(buf + at, (uint64_t)rng() << (rng() % 40), 8);
            }
        }
        char err[512] = "";
        gguf_file *f = gguf_open_memory(buf, size, err, sizeof(err));
        if (f) {
            opened++;
            (void)walk(f);
            gguf_close(f);
        } else {
            refused++;
            assert_true(err[0] != '\0');
        }
        free(buf);
    }
    print_message("random damage: %d opened, %d refused\n", opened, refused);
    assert_true(refused > 10000 && opened > 1000); /* both paths exercised */
    free(base);
}

/* ------------------------------------------------------------------------
 * Real files
 * ------------------------------------------------------------------------ */

static const char *shared_dir(void)
{
    const char *s = getenv("KVD_SHARED");
    return s && *s ? s : "../shared";
}

static void test_stories260k(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", shared_dir());
    if (access(path, R_OK) != 0) {
        print_message("skipping: %s not found (set KVD_SHARED)\n", path);
        skip();
    }
    char err[512] = "";
    gguf_file *f = gguf_open(path, err, sizeof(err));
    if (!f)
        fail_msg("%s", err);
    const char *s;
    size_t len;
    assert_int_equal(gguf_get_str(f, "general.architecture", &s, &len), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "llama", 5);
    /* 5 layers x 9 tensors, embeddings, final norm, output. */
    assert_int_equal(gguf_n_tensors(f), 48);
    const struct gguf_tensor *t = gguf_find_tensor(f, "token_embd.weight");
    assert_non_null(t);
    assert_int_equal(t->n_dims, 2);
    assert_int_equal(t->ne[0], 64);
    assert_int_equal(t->ne[1], 512);
    assert_int_equal(t->type, GGML_TYPE_F32);
    assert_int_equal(t->size, 64 * 512 * 4);
    uint32_t n_layer;
    assert_int_equal(gguf_get_u32(f, "llama.block_count", &n_layer), 0);
    assert_int_equal(n_layer, 5);
    enum gguf_type et;
    uint64_t n;
    assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", &et, &n, NULL), 0);
    assert_int_equal(et, GGUF_TYPE_STRING);
    assert_int_equal(n, 512);
    assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", 0, &s, &len), 0);
    assert_int_equal(len, 5);
    assert_memory_equal(s, "<unk>", 5);
    uint32_t ctx;
    assert_int_equal(gguf_get_u32(f, "llama.context_length", &ctx), 0);
    assert_int_equal(ctx, 2048);
    (void)walk(f);
    gguf_close(f);

    /* The same weights from a second converter. */
    snprintf(path, sizeof(path), "%s/models/stories260K-ctx128.gguf", shared_dir());
    if (access(path, R_OK) == 0) {
        f = gguf_open(path, err, sizeof(err));
        if (!f)
            fail_msg("%s", err);
        assert_int_equal(gguf_get_u32(f, "llama.context_length", &ctx), 0);
        assert_int_equal(ctx, 128);
        t = gguf_find_tensor(f, "token_embd.weight");
        assert_non_null(t);
        assert_int_equal(t->ne[0], 64);
        assert_int_equal(t->ne[1], 512);
        assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", NULL, &n, NULL), 0);
        assert_int_equal(n, 512);
        (void)walk(f);
        gguf_close(f);
    }
}

static void test_shared_vocabs(void **state)
{
    (void)state;
    static const char *const names[] = {"llama-spm", "phi-3", "gpt-2", "starcoder", "falcon"};
    char path[1024];
    int found = 0;
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        snprintf(path, sizeof(path), "%s/vocab/ggml-vocab-%s.gguf", shared_dir(), names[i]);
        if (access(path, R_OK) != 0)
            continue;
        found++;
        char err[512] = "";
        gguf_file *f = gguf_open(path, err, sizeof(err));
        if (!f)
            fail_msg("%s", err);
        const char *s;
        size_t len;
        assert_int_equal(gguf_get_str(f, "tokenizer.ggml.model", &s, &len), 0);
        uint64_t n = 0;
        assert_int_equal(gguf_get_arr(f, "tokenizer.ggml.tokens", NULL, &n, NULL), 0);
        assert_true(n > 256);
        for (uint64_t k = 0; k < n; k++)
            assert_int_equal(gguf_get_arr_str(f, "tokenizer.ggml.tokens", k, &s, &len), 0);
        (void)walk(f);
        gguf_close(f);
    }
    if (!found) {
        print_message("skipping: no vocab files in %s/vocab (set KVD_SHARED)\n", shared_dir());
        skip();
    }
}

/* ------------------------------------------------------------------------
 * Type tables
 * ------------------------------------------------------------------------ */

static void test_type_tables(void **state)
{
    (void)state;
    static const struct {
        enum ggml_type t;
        int block;
        size_t bytes;
        const char *name;
    } want[] = {
        {GGML_TYPE_F32, 1, 4, "f32"},       {GGML_TYPE_F16, 1, 2, "f16"},
        {GGML_TYPE_BF16, 1, 2, "bf16"},     {GGML_TYPE_Q4_0, 32, 18, "q4_0"},
        {GGML_TYPE_Q4_1, 32, 20, "q4_1"},   {GGML_TYPE_Q5_0, 32, 22, "q5_0"},
        {GGML_TYPE_Q5_1, 32, 24, "q5_1"},   {GGML_TYPE_Q8_0, 32, 34, "q8_0"},
        {GGML_TYPE_Q8_1, 32, 36, "q8_1"},   {GGML_TYPE_Q2_K, 256, 84, "q2_K"},
        {GGML_TYPE_Q3_K, 256, 110, "q3_K"}, {GGML_TYPE_Q4_K, 256, 144, "q4_K"},
        {GGML_TYPE_Q5_K, 256, 176, "q5_K"}, {GGML_TYPE_Q6_K, 256, 210, "q6_K"},
        {GGML_TYPE_Q8_K, 256, 292, "q8_K"}, {GGML_TYPE_IQ4_NL, 32, 18, "iq4_nl"},
        {GGML_TYPE_IQ4_XS, 256, 136, "iq4_xs"}, {GGML_TYPE_IQ2_XXS, 256, 66, "iq2_xxs"},
        {GGML_TYPE_IQ2_XS, 256, 74, "iq2_xs"}, {GGML_TYPE_IQ3_XXS, 256, 98, "iq3_xxs"},
        {GGML_TYPE_IQ1_S, 256, 50, "iq1_s"},   {GGML_TYPE_IQ3_S, 256, 110, "iq3_s"},
        {GGML_TYPE_IQ2_S, 256, 82, "iq2_s"},   {GGML_TYPE_IQ1_M, 256, 56, "iq1_m"},
        {GGML_TYPE_TQ1_0, 256, 54, "tq1_0"},   {GGML_TYPE_TQ2_0, 256, 66, "tq2_0"},
        {GGML_TYPE_MXFP4, 32, 17, "mxfp4"},    {GGML_TYPE_I8, 1, 1, "i8"},
        {GGML_TYPE_I16, 1, 2, "i16"},          {GGML_TYPE_I32, 1, 4, "i32"},
        {GGML_TYPE_I64, 1, 8, "i64"},          {GGML_TYPE_F64, 1, 8, "f64"},
    };
    for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
        assert_int_equal(gguf_ggml_block_size(want[i].t), want[i].block);
        assert_int_equal(gguf_ggml_block_bytes(want[i].t), want[i].bytes);
        assert_string_equal(gguf_ggml_type_name(want[i].t), want[i].name);
    }
    static const int unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, 40, 99, -1};
    for (size_t i = 0; i < sizeof(unknown) / sizeof(unknown[0]); i++) {
        assert_int_equal(gguf_ggml_block_size((enum ggml_type)unknown[i]), 0);
        assert_int_equal(gguf_ggml_block_bytes((enum ggml_type)unknown[i]), 0);
        assert_null(gguf_ggml_type_name((enum ggml_type)unknown[i]));
    }
    assert_string_equal(gguf_type_name(GGUF_TYPE_UINT32), "uint32");
    assert_string_equal(gguf_type_name(GGUF_TYPE_FLOAT64), "float64");
    assert_string_equal(gguf_type_name(GGUF_TYPE_STRING), "string");
    assert_string_equal(gguf_type_name((enum gguf_type)13), "unknown");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_tables),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_version_2),
        cmocka_unit_test(test_writer_rules),
        cmocka_unit_test(test_files),
        cmocka_unit_test(test_hostile_fields),
        cmocka_unit_test(test_every_prefix_fails),
        cmocka_unit_test(test_random_damage),
        cmocka_unit_test(test_stories260k),
        cmocka_unit_test(test_shared_vocabs),
    };
    return cmocka_run_group_tests_name("gguf", tests, NULL, NULL);
}
