/*
 * gguf_write.c - the GGUF writer: an in-memory builder serialised in one go.
 *
 * Each metadata setter encodes its value at once into the exact bytes that
 * follow the key in the file (type tag, then payload), so serialising is a
 * concatenation and the setters' inputs are never referenced after they
 * return. Keys keep their first insertion position; setting a key again
 * replaces its value in place. Tensors are copied too; their data offsets
 * are assigned at serialisation time, each rounded up to the alignment.
 *
 * Output: version 3, alignment 32 unless general.alignment was set (as a
 * uint32 power of two), header, metadata in insertion order, tensor infos
 * in insertion order, padding to the alignment, tensor data each padded to
 * the alignment except the last, so the file ends where the last tensor's
 * bytes end (a shorter file is then always a truncated one).
 *
 * One serialiser feeds two sinks: a malloc'd buffer of the exact size, or
 * a buffered file descriptor (gguf_writer_write never holds a second copy
 * of the tensor data in memory).
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define MAX_NAME_BYTES 65536

struct wkv {
    char *key;
    size_t key_len;
    uint8_t *val; /* type tag + payload, as in the file */
    size_t val_len;
};

struct wtensor {
    char *name;
    size_t name_len;
    enum ggml_type type;
    int n_dims;
    uint64_t ne[GGUF_MAX_DIMS];
    void *data;
    size_t size;
};

struct gguf_writer {
    struct wkv *kvs;
    size_t n_kv, cap_kv;
    struct wtensor *tensors;
    size_t n_tensors, cap_tensors;
    uint32_t alignment;
};

/* Bytes of one scalar of a fixed-size value type; 0 for string and array. */
static size_t scalar_bytes(enum gguf_type t)
{
    static const size_t bytes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return (unsigned)t < GGUF_TYPE_COUNT ? bytes[t] : 0;
}

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

gguf_writer *gguf_writer_create(void)
{
    gguf_writer *w = calloc(1, sizeof(*w));
    if (w)
        w->alignment = GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void gguf_writer_destroy(gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].val);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        free(w->tensors[i].name);
        free(w->tensors[i].data);
    }
    free(w->kvs);
    free(w->tensors);
    free(w);
}

/* ------------------------------------------------------------------------
 * Metadata
 * ------------------------------------------------------------------------ */

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

/* Store one host scalar of type t from src as little-endian bytes at dst. */
static void put_scalar(uint8_t *dst, enum gguf_type t, const void *src)
{
    switch (scalar_bytes(t)) {
    case 1:
        if (t == GGUF_TYPE_BOOL)
            dst[0] = *(const bool *)src ? 1 : 0;
        else
            memcpy(dst, src, 1);
        break;
    case 2: {
        uint16_t v;
        memcpy(&v, src, 2);
        dst[0] = (uint8_t)v;
        dst[1] = (uint8_t)(v >> 8);
        break;
    }
    case 4: {
        uint32_t v;
        memcpy(&v, src, 4);
        put32(dst, v);
        break;
    }
    case 8: {
        uint64_t v;
        memcpy(&v, src, 8);
        put64(dst, v);
        break;
    }
    }
}

/* Host size of one element handed to the setters (bool is C's bool). */
static size_t host_bytes(enum gguf_type t)
{
    return t == GGUF_TYPE_BOOL ? sizeof(bool) : scalar_bytes(t);
}

static bool valid_name(const char *s, size_t *len)
{
    if (!s)
        return false;
    *len = strnlen(s, MAX_NAME_BYTES + 1);
    return *len >= 1 && *len <= MAX_NAME_BYTES;
}

/*
 * Attach an encoded value (steals val) to key: replaces the value of an
 * existing key in place, or appends. On error val is freed.
 */
static int put_kv(gguf_writer *w, const char *key, uint8_t *val, size_t val_len)
{
    size_t klen;
    if (!w || !valid_name(key, &klen)) {
        free(val);
        return -EINVAL;
    }
    /* general.alignment decides the layout: only a uint32 power of two. */
    if (strcmp(key, "general.alignment") == 0) {
        uint32_t a = val_len == 8 ? ((uint32_t)val[4] | (uint32_t)val[5] << 8 |
                                     (uint32_t)val[6] << 16 | (uint32_t)val[7] << 24)
                                  : 0;
        if (val_len != 8 || val[0] != GGUF_TYPE_UINT32 || a == 0 || (a & (a - 1)) != 0) {
            free(val);
            return -EINVAL;
        }
        w->alignment = a;
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (w->kvs[i].key_len == klen && memcmp(w->kvs[i].key, key, klen) == 0) {
            free(w->kvs[i].val);
            w->kvs[i].val = val;
            w->kvs[i].val_len = val_len;
            return 0;
        }
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        struct wkv *k = realloc(w->kvs, cap * sizeof(*k));
        if (!k) {
            free(val);
            return -ENOMEM;
        }
        w->kvs = k;
        w->cap_kv = cap;
    }
    char *kcopy = malloc(klen + 1);
    if (!kcopy) {
        free(val);
        return -ENOMEM;
    }
    memcpy(kcopy, key, klen + 1);
    w->kvs[w->n_kv++] = (struct wkv){kcopy, klen, val, val_len};
    return 0;
}

int gguf_writer_set_scalar(gguf_writer *w, const char *key, enum gguf_type type, const void *v)
{
    size_t sz = scalar_bytes(type);
    if (sz == 0 || !v)
        return -EINVAL;
    uint8_t *val = malloc(4 + sz);
    if (!val)
        return -ENOMEM;
    put32(val, (uint32_t)type);
    put_scalar(val + 4, type, v);
    return put_kv(w, key, val, 4 + sz);
}

int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v)
{
    return gguf_writer_set_scalar(w, key, GGUF_TYPE_UINT32, &v);
}

int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v)
{
    return gguf_writer_set_scalar(w, key, GGUF_TYPE_INT32, &v);
}

int gguf_writer_set_u64(gguf_writer *w, const char *key, uint64_t v)
{
    return gguf_writer_set_scalar(w, key, GGUF_TYPE_UINT64, &v);
}

int gguf_writer_set_f32(gguf_writer *w, const char *key, float v)
{
    return gguf_writer_set_scalar(w, key, GGUF_TYPE_FLOAT32, &v);
}

int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v)
{
    return gguf_writer_set_scalar(w, key, GGUF_TYPE_BOOL, &v);
}

int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v)
{
    if (!v)
        return -EINVAL;
    size_t len = strlen(v);
    uint8_t *val = malloc(4 + 8 + len);
    if (!val)
        return -ENOMEM;
    put32(val, GGUF_TYPE_STRING);
    put64(val + 4, len);
    memcpy(val + 12, v, len);
    return put_kv(w, key, val, 12 + len);
}

int gguf_writer_set_arr(gguf_writer *w, const char *key, enum gguf_type elem_type,
                        const void *data, uint64_t n)
{
    size_t sz = scalar_bytes(elem_type), hsz = host_bytes(elem_type);
    if (sz == 0 || (n && !data) || n > (SIZE_MAX - 16) / sz)
        return -EINVAL;
    uint8_t *val = malloc(16 + (size_t)n * sz);
    if (!val)
        return -ENOMEM;
    put32(val, GGUF_TYPE_ARRAY);
    put32(val + 4, (uint32_t)elem_type);
    put64(val + 8, n);
    const uint8_t *src = data;
    for (uint64_t i = 0; i < n; i++)
        put_scalar(val + 16 + i * sz, elem_type, src + i * hsz);
    return put_kv(w, key, val, 16 + (size_t)n * sz);
}

int gguf_writer_set_arr_i32(gguf_writer *w, const char *key, const int32_t *v, uint64_t n)
{
    return gguf_writer_set_arr(w, key, GGUF_TYPE_INT32, v, n);
}

int gguf_writer_set_arr_f32(gguf_writer *w, const char *key, const float *v, uint64_t n)
{
    return gguf_writer_set_arr(w, key, GGUF_TYPE_FLOAT32, v, n);
}

int gguf_writer_set_arr_str(gguf_writer *w, const char *key, const char *const *v, uint64_t n)
{
    if (n && !v)
        return -EINVAL;
    size_t total = 16;
    for (uint64_t i = 0; i < n; i++) {
        if (!v[i])
            return -EINVAL;
        size_t len = strlen(v[i]);
        if (len > SIZE_MAX - 8 - total)
            return -EINVAL;
        total += 8 + len;
    }
    uint8_t *val = malloc(total);
    if (!val)
        return -ENOMEM;
    put32(val, GGUF_TYPE_ARRAY);
    put32(val + 4, GGUF_TYPE_STRING);
    put64(val + 8, n);
    size_t o = 16;
    for (uint64_t i = 0; i < n; i++) {
        size_t len = strlen(v[i]);
        put64(val + o, len);
        memcpy(val + o + 8, v[i], len);
        o += 8 + len;
    }
    return put_kv(w, key, val, total);
}

/* ------------------------------------------------------------------------
 * Tensors
 * ------------------------------------------------------------------------ */

int gguf_writer_add_tensor(gguf_writer *w, const char *name, enum ggml_type type, int n_dims,
                           const uint64_t *ne, const void *data, size_t size)
{
    size_t nlen;
    int block = gguf_ggml_block_size(type);
    if (!w || !valid_name(name, &nlen) || block == 0 || n_dims < 1 || n_dims > GGUF_MAX_DIMS ||
        !ne || (size && !data))
        return -EINVAL;
    uint64_t n_elem = 1;
    for (int d = 0; d < n_dims; d++)
        if (ne[d] == 0 || ne[d] > INT64_MAX || __builtin_mul_overflow(n_elem, ne[d], &n_elem) ||
            n_elem > INT64_MAX)
            return -EINVAL;
    uint64_t bytes;
    if (ne[0] % (uint64_t)block != 0 ||
        __builtin_mul_overflow(n_elem / (uint64_t)block, (uint64_t)gguf_ggml_block_bytes(type),
                               &bytes) ||
        bytes != size)
        return -EINVAL;
    for (size_t i = 0; i < w->n_tensors; i++)
        if (w->tensors[i].name_len == nlen && memcmp(w->tensors[i].name, name, nlen) == 0)
            return -EEXIST;

    if (w->n_tensors == w->cap_tensors) {
        size_t cap = w->cap_tensors ? w->cap_tensors * 2 : 16;
        struct wtensor *t = realloc(w->tensors, cap * sizeof(*t));
        if (!t)
            return -ENOMEM;
        w->tensors = t;
        w->cap_tensors = cap;
    }
    struct wtensor t = {.name_len = nlen, .type = type, .n_dims = n_dims, .size = size};
    t.name = malloc(nlen + 1);
    t.data = malloc(size ? size : 1);
    if (!t.name || !t.data) {
        free(t.name);
        free(t.data);
        return -ENOMEM;
    }
    memcpy(t.name, name, nlen + 1);
    memcpy(t.data, data, size);
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t.ne[d] = d < n_dims ? ne[d] : 1;
    w->tensors[w->n_tensors++] = t;
    return 0;
}

/* ------------------------------------------------------------------------
 * Serialisation
 * ------------------------------------------------------------------------ */

/* Where bytes go: a preallocated buffer, or a file descriptor through buf. */
struct sink {
    uint8_t *buf;
    size_t pos, cap;
    int fd;    /* -1: memory sink */
    int error; /* first errno from write(), 0 if none */
};

static void flush(struct sink *s)
{
    size_t off = 0;
    while (off < s->pos && !s->error) {
        ssize_t n = write(s->fd, s->buf + off, s->pos - off);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            s->error = n < 0 ? errno : EIO;
        else
            off += (size_t)n;
    }
    s->pos = 0;
}

static void emit(struct sink *s, const void *data, size_t n)
{
    const uint8_t *p = data;
    while (n > 0 && !s->error) {
        if (s->fd >= 0 && s->pos == s->cap)
            flush(s);
        size_t k = s->cap - s->pos < n ? s->cap - s->pos : n;
        memcpy(s->buf + s->pos, p, k);
        s->pos += k;
        p += k;
        n -= k;
    }
}

static void emit32(struct sink *s, uint32_t v)
{
    uint8_t b[4];
    put32(b, v);
    emit(s, b, 4);
}

static void emit64(struct sink *s, uint64_t v)
{
    uint8_t b[8];
    put64(b, v);
    emit(s, b, 8);
}

static void emit_zeros(struct sink *s, size_t n)
{
    static const uint8_t zeros[64];
    while (n > 0) {
        size_t k = n < sizeof(zeros) ? n : sizeof(zeros);
        emit(s, zeros, k);
        n -= k;
    }
}

static size_t pad_to(size_t x, size_t a)
{
    return (a - x % a) % a;
}

/* Total file size, and each tensor's data offset written into offsets[]. */
static size_t layout(const gguf_writer *w, uint64_t *offsets, size_t *info_end)
{
    size_t pos = 24;
    for (size_t i = 0; i < w->n_kv; i++)
        pos += 8 + w->kvs[i].key_len + w->kvs[i].val_len;
    for (size_t i = 0; i < w->n_tensors; i++)
        pos += 8 + w->tensors[i].name_len + 4 + 8 * (size_t)w->tensors[i].n_dims + 4 + 8;
    *info_end = pos;
    if (w->n_tensors == 0)
        return pos;
    pos += pad_to(pos, w->alignment);
    size_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        off += pad_to(off, w->alignment);
        offsets[i] = off;
        off += w->tensors[i].size;
    }
    return pos + off;
}

static void serialise(const gguf_writer *w, const uint64_t *offsets, size_t info_end,
                      struct sink *s)
{
    emit(s, "GGUF", 4);
    emit32(s, 3);
    emit64(s, w->n_tensors);
    emit64(s, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        emit64(s, w->kvs[i].key_len);
        emit(s, w->kvs[i].key, w->kvs[i].key_len);
        emit(s, w->kvs[i].val, w->kvs[i].val_len);
    }
    for (size_t i = 0; i < w->n_tensors; i++) {
        const struct wtensor *t = &w->tensors[i];
        emit64(s, t->name_len);
        emit(s, t->name, t->name_len);
        emit32(s, (uint32_t)t->n_dims);
        for (int d = 0; d < t->n_dims; d++)
            emit64(s, t->ne[d]);
        emit32(s, (uint32_t)t->type);
        emit64(s, offsets[i]);
    }
    if (w->n_tensors == 0)
        return;
    emit_zeros(s, pad_to(info_end, w->alignment));
    size_t off = 0;
    for (size_t i = 0; i < w->n_tensors; i++) {
        emit_zeros(s, (size_t)offsets[i] - off);
        emit(s, w->tensors[i].data, w->tensors[i].size);
        off = (size_t)offsets[i] + w->tensors[i].size;
    }
}

int gguf_writer_to_memory(const gguf_writer *w, void **out, size_t *out_size)
{
    if (!w || !out || !out_size)
        return -EINVAL;
    uint64_t *offsets = malloc((w->n_tensors ? w->n_tensors : 1) * sizeof(*offsets));
    if (!offsets)
        return -ENOMEM;
    size_t info_end, total = layout(w, offsets, &info_end);
    uint8_t *buf = malloc(total);
    if (!buf) {
        free(offsets);
        return -ENOMEM;
    }
    struct sink s = {.buf = buf, .cap = total, .fd = -1};
    serialise(w, offsets, info_end, &s);
    free(offsets);
    *out = buf;
    *out_size = total;
    return 0;
}

int gguf_writer_write(const gguf_writer *w, const char *path, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!w || !path) {
        if (err && errlen)
            snprintf(err, errlen, "no writer or path given");
        return -EINVAL;
    }
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 5);
    uint64_t *offsets = malloc((w->n_tensors ? w->n_tensors : 1) * sizeof(*offsets));
    uint8_t *buf = malloc(1 << 16);
    int rc = 0;
    if (!tmp || !offsets || !buf) {
        rc = -ENOMEM;
        if (err && errlen)
            snprintf(err, errlen, "%s: out of memory", path);
        goto out_free;
    }
    memcpy(tmp, path, plen);
    memcpy(tmp + plen, ".tmp", 5);

    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = -errno;
        if (err && errlen)
            snprintf(err, errlen, "%s: cannot create: %s", tmp, strerror(errno));
        goto out_free;
    }
    size_t info_end;
    layout(w, offsets, &info_end);
    struct sink s = {.buf = buf, .cap = 1 << 16, .fd = fd};
    serialise(w, offsets, info_end, &s);
    flush(&s);
    if (!s.error && fsync(fd) != 0)
        s.error = errno;
    if (close(fd) != 0 && !s.error)
        s.error = errno;
    if (s.error) {
        rc = -s.error;
        if (err && errlen)
            snprintf(err, errlen, "%s: write failed: %s", tmp, strerror(s.error));
        goto out_unlink;
    }
    if (rename(tmp, path) != 0) {
        rc = -errno;
        if (err && errlen)
            snprintf(err, errlen, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
        goto out_unlink;
    }
    goto out_free;

out_unlink:
    unlink(tmp);
out_free:
    free(tmp);
    free(offsets);
    free(buf);
    return rc;
}

int gguf_writer_copy_kv(gguf_writer *w, const gguf_file *f, int64_t i)
{
    const char *key = gguf_kv_key(f, i);
    enum gguf_type t = gguf_kv_type(f, i);
    if (t == GGUF_TYPE_STRING) {
        const char *s;
        size_t n;
        int rc = gguf_get_str(f, key, &s, &n);
        char *c = rc ? NULL : strndup(s, n);
        rc = rc ? rc : c ? gguf_writer_set_str(w, key, c) : -ENOMEM;
        free(c);
        return rc;
    }
    if (t != GGUF_TYPE_ARRAY) {
        uint64_t v; /* 8 bytes: room for any scalar */
        int rc = gguf_get_scalar(f, key, &t, &v);
        return rc ? rc : gguf_writer_set_scalar(w, key, t, &v);
    }
    enum gguf_type et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, key, &et, &n, &data);
    if (rc || et != GGUF_TYPE_STRING)
        return rc ? rc : gguf_writer_set_arr(w, key, et, data, n);
    char **v = calloc(n ? n : 1, sizeof(char *));
    if (!v)
        return -ENOMEM;
    for (uint64_t j = 0; j < n && !rc; j++) {
        const char *s;
        size_t len;
        rc = gguf_get_arr_str(f, key, j, &s, &len);
        if (!rc && !(v[j] = strndup(s, len)))
            rc = -ENOMEM;
    }
    rc = rc ? rc : gguf_writer_set_arr_str(w, key, (const char *const *)v, n);
    for (uint64_t j = 0; j < n; j++)
        free(v[j]);
    free(v);
    return rc;
}
