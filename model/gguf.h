/*
 * gguf.h - reading and writing GGUF files (versions 2 and 3).
 *
 * A GGUF file is: a header (magic "GGUF", version, tensor count, metadata
 * count), the metadata key/value pairs, the tensor infos (name, dims, type,
 * offset), padding to the alignment (general.alignment, default 32), then
 * the tensor data. All integers are little-endian.
 *
 * The reader maps the file and validates *everything* at open time: every
 * count, string length, array length, dimension, type, offset and size is
 * checked against the file before it is used, and tensors must lie inside
 * the data section without overlapping. After gguf_open succeeds, every
 * accessor below is safe. A hostile or truncated file gives a clear error
 * naming what is wrong and where (byte offset, key or tensor name).
 *
 * Ownership: strings and data pointers returned by accessors are borrowed
 * from the mapping and live until gguf_close. Numeric array data may be
 * unaligned: read it with memcpy or the typed helpers.
 *
 * The writer builds a file in memory from typed metadata and tensors and
 * writes it in one go; `kvd mkmodel` and the tests use it.
 */
#ifndef KVD_GGUF_H
#define KVD_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Metadata value types, numbered as in the GGUF specification. */
enum gguf_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT
};

/* Tensor element types, numbered as ggml numbers them. */
enum ggml_type {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q8_1 = 9,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q3_K = 11,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_Q8_K = 15,
    GGML_TYPE_IQ2_XXS = 16,
    GGML_TYPE_IQ2_XS = 17,
    GGML_TYPE_IQ3_XXS = 18,
    GGML_TYPE_IQ1_S = 19,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_IQ3_S = 21,
    GGML_TYPE_IQ2_S = 22,
    GGML_TYPE_IQ4_XS = 23,
    GGML_TYPE_I8 = 24,
    GGML_TYPE_I16 = 25,
    GGML_TYPE_I32 = 26,
    GGML_TYPE_I64 = 27,
    GGML_TYPE_F64 = 28,
    GGML_TYPE_IQ1_M = 29,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_TQ1_0 = 34,
    GGML_TYPE_TQ2_0 = 35,
    GGML_TYPE_MXFP4 = 39,
    GGML_TYPE_COUNT = 40 /* upper bound for tables; unknown ids are rejected */
};

#define GGUF_MAX_DIMS 4
#define GGUF_DEFAULT_ALIGNMENT 32

/* Name of a tensor type ("f32", "q4_K", ...), or NULL for an unknown id. */
const char *gguf_ggml_type_name(enum ggml_type type);

/* Elements per block and bytes per block of a tensor type; 0 if unknown. */
int gguf_ggml_block_size(enum ggml_type type);
size_t gguf_ggml_block_bytes(enum ggml_type type);

/* Name of a metadata value type ("uint32", "string", ...). */
const char *gguf_type_name(enum gguf_type type);

/* ------------------------------------------------------------------------
 * Reader
 * ------------------------------------------------------------------------ */

typedef struct gguf_file gguf_file;

/* One tensor, as described by its info record; data points into the map. */
struct gguf_tensor {
    const char *name;              /* NUL-terminated copy owned by the reader */
    enum ggml_type type;
    int n_dims;                    /* 1..GGUF_MAX_DIMS */
    uint64_t ne[GGUF_MAX_DIMS];    /* elements per dimension, ne[0] fastest; unused dims are 1 */
    uint64_t n_elements;
    uint64_t offset;               /* from the start of the data section */
    size_t size;                   /* bytes */
    const void *data;              /* borrowed, aligned to the file's alignment */
};

/*
 * Map and validate a file. Returns NULL with the reason in err (which names
 * the section, key or tensor and the byte offset where the file went wrong).
 */
gguf_file *gguf_open(const char *path, char *err, size_t errlen);

/* The same from a caller-owned buffer (borrowed; must outlive the handle). */
gguf_file *gguf_open_memory(const void *data, size_t size, char *err, size_t errlen);

void gguf_close(gguf_file *f);

uint32_t gguf_version(const gguf_file *f);
size_t gguf_alignment(const gguf_file *f);

/* --- metadata --- */

int64_t gguf_n_kv(const gguf_file *f);
const char *gguf_kv_key(const gguf_file *f, int64_t i);          /* NUL-terminated */
enum gguf_type gguf_kv_type(const gguf_file *f, int64_t i);
int64_t gguf_find_key(const gguf_file *f, const char *key);        /* -1 if absent */

/*
 * Typed getters. Each returns 0 and stores the value, -ENOENT if the key is
 * absent, or -EINVAL if its type does not fit (integer getters accept any
 * integer type whose value fits in the destination; the float getter also
 * accepts float64 and integers).
 */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
int gguf_get_f32(const gguf_file *f, const char *key, float *out);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out);
/* Any fixed-size scalar as stored: its type in *type, its value into out
 * (room for 8 bytes) as the host's value of that type. -EINVAL for a
 * string or an array. */
int gguf_get_scalar(const gguf_file *f, const char *key, enum gguf_type *type, void *out);
/* String value: not NUL-terminated in the file; *len is its byte length. */
int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len);

/*
 * Array value: element type and count. For numeric arrays *data points at
 * the packed elements (possibly unaligned). For string arrays use
 * gguf_get_arr_str, which is O(1) per element (*data is NULL for them).
 * Element getters return -ERANGE for an index past the end.
 */
int gguf_get_arr(const gguf_file *f, const char *key, enum gguf_type *elem_type,
                 uint64_t *n, const void **data);
int gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s,
                     size_t *len);
/* Numeric array element i converted to float / int64 (any numeric type). */
int gguf_get_arr_f32(const gguf_file *f, const char *key, uint64_t i, float *out);
int gguf_get_arr_i64(const gguf_file *f, const char *key, uint64_t i, int64_t *out);

/* --- tensors --- */

int64_t gguf_n_tensors(const gguf_file *f);
const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i);
const struct gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name); /* NULL if absent */

/* ------------------------------------------------------------------------
 * Writer
 * ------------------------------------------------------------------------ */

typedef struct gguf_writer gguf_writer;

gguf_writer *gguf_writer_create(void);
void gguf_writer_destroy(gguf_writer *w);

/*
 * Metadata setters copy their arguments. Return 0 or -ENOMEM (-EINVAL for
 * an empty key, a key over 64 KiB or a NULL value). Setting a key again
 * replaces its value and keeps its first position.
 */
int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
int gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v);
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
int gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n);
int gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n);
int gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n);
/*
 * Any fixed-size type (integers, floats, bool): v points at one host value
 * of that type (uint8_t .. double, C bool), or at n packed host values for
 * an array. -EINVAL for string/array types. general.alignment is accepted
 * only as a uint32 power of two and sets the layout's alignment.
 */
int gguf_writer_set_scalar(gguf_writer *w, const char *key, enum gguf_type type, const void *v);
int gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_type elem_type,
                        const void *data, uint64_t n);

/*
 * Add a tensor; data (size bytes, which must equal the size implied by type
 * and ne) is copied. ne[0] is the fastest-varying dimension. Returns 0,
 * -EINVAL (unknown type, n_dims outside 1..4, a dimension of 0, ne[0] not a
 * multiple of the block size, size mismatch), -EEXIST (name taken) or -ENOMEM.
 */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, enum ggml_type type, int n_dims,
                           const uint64_t *ne, const void *data, size_t size);

/* Copy key i of f (any type, arrays of strings too) into w. 0, -ENOMEM, or
 * -EINVAL for a value the writer refuses. */
int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *f, int64_t i);

/* Serialise (version 3, alignment 32) into a new malloc'd buffer. */
int gguf_writer_to_memory(const gguf_writer *w, void **out, size_t *out_size);

/* Write the file atomically (temp file + rename). 0, or -errno with err filled. */
int gguf_writer_write(const gguf_writer *w, const char *path, char *err, size_t errlen);

#endif /* KVD_GGUF_H */
