/*
 * gguf.c - the GGUF reader: map a file, validate all of it, then serve
 * typed lookups.
 *
 * The idea: one pass at open time reads every field through a bounds-checked
 * cursor and records only offsets and copies of names. Nothing is trusted
 * before it is checked against the bytes that remain: counts are bounded by
 * the smallest record they could describe (a 2^62-entry array needs 2^62
 * bytes the file does not have), lengths are compared with the bytes left
 * rather than added to positions (so 2^64-1 cannot wrap), and element counts
 * and byte sizes are multiplied with overflow checks. Tensors are checked
 * against the data section and against each other (sorted by offset, no
 * overlap). After gguf_open returns a handle, accessors do no validation of
 * the file, only of their arguments.
 *
 * Decisions where the specification leaves room:
 *   - Versions 2 and 3 only. Version 1 used 32-bit counts and lengths and is
 *     rejected by name; a byte-swapped version number is reported as a
 *     big-endian file (not supported).
 *   - Arrays of arrays are rejected with a clear message: no model or
 *     tokenizer key uses them and the accessors have no way to reach them.
 *   - A dimension of 0 is rejected: an empty tensor carries no weights and
 *     would have no place in the non-overlap check.
 *   - Keys and tensor names must be 1..65536 bytes without NUL bytes; they
 *     are copied and NUL-terminated. String values are bytes, not checked.
 *   - Bool values must be 0 or 1.
 *   - general.alignment may be stored in any integer type; it must be a
 *     nonzero power of two that fits in 32 bits.
 *   - Tensor offsets must be multiples of the alignment; tensors may appear
 *     in any order and gaps are allowed, overlap is not. No bytes are
 *     required after the end of the last tensor, and a file without tensors
 *     may end right after its tensor infos.
 *   - Tensor data pointers are aligned to the file's alignment when the
 *     buffer itself is (a mapped file is page-aligned; a buffer given to
 *     gguf_open_memory is as aligned as the caller made it).
 */
#include "gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER_BYTES 24            /* magic, version, n_tensors, n_kv */
#define MAX_NAME_BYTES 65536       /* keys and tensor names */
#define MIN_KV_BYTES (8 + 1 + 4 + 1) /* key length, 1-byte key, type, u8 value */
#define MIN_TENSOR_INFO_BYTES (8 + 1 + 4 + 8 + 4 + 8) /* name, n_dims, ne[0], type, offset */

/* ------------------------------------------------------------------------
 * Type tables
 * ------------------------------------------------------------------------ */

struct type_traits {
    const char *name;
    int block;          /* elements per block; 0 marks an unknown id */
    size_t block_bytes; /* bytes per block */
};

static const struct type_traits ggml_traits[GGML_TYPE_COUNT] = {
    [GGML_TYPE_F32] = {"f32", 1, 4},       [GGML_TYPE_F16] = {"f16", 1, 2},
    [GGML_TYPE_Q4_0] = {"q4_0", 32, 18},   [GGML_TYPE_Q4_1] = {"q4_1", 32, 20},
    [GGML_TYPE_Q5_0] = {"q5_0", 32, 22},   [GGML_TYPE_Q5_1] = {"q5_1", 32, 24},
    [GGML_TYPE_Q8_0] = {"q8_0", 32, 34},   [GGML_TYPE_Q8_1] = {"q8_1", 32, 36},
    [GGML_TYPE_Q2_K] = {"q2_K", 256, 84},  [GGML_TYPE_Q3_K] = {"q3_K", 256, 110},
    [GGML_TYPE_Q4_K] = {"q4_K", 256, 144}, [GGML_TYPE_Q5_K] = {"q5_K", 256, 176},
    [GGML_TYPE_Q6_K] = {"q6_K", 256, 210}, [GGML_TYPE_Q8_K] = {"q8_K", 256, 292},
    [GGML_TYPE_IQ4_NL] = {"iq4_nl", 32, 18}, [GGML_TYPE_IQ4_XS] = {"iq4_xs", 256, 136},
    [GGML_TYPE_BF16] = {"bf16", 1, 2},
    /* read, so that a file holding them is refused by name where a tensor
     * of theirs is used (no kernels multiply them) */
    [GGML_TYPE_IQ2_XXS] = {"iq2_xxs", 256, 66}, [GGML_TYPE_IQ2_XS] = {"iq2_xs", 256, 74},
    [GGML_TYPE_IQ3_XXS] = {"iq3_xxs", 256, 98}, [GGML_TYPE_IQ1_S] = {"iq1_s", 256, 50},
    [GGML_TYPE_IQ3_S] = {"iq3_s", 256, 110},    [GGML_TYPE_IQ2_S] = {"iq2_s", 256, 82},
    [GGML_TYPE_IQ1_M] = {"iq1_m", 256, 56},     [GGML_TYPE_TQ1_0] = {"tq1_0", 256, 54},
    [GGML_TYPE_TQ2_0] = {"tq2_0", 256, 66},     [GGML_TYPE_MXFP4] = {"mxfp4", 32, 17},
    [GGML_TYPE_I8] = {"i8", 1, 1},              [GGML_TYPE_I16] = {"i16", 1, 2},
    [GGML_TYPE_I32] = {"i32", 1, 4},            [GGML_TYPE_I64] = {"i64", 1, 8},
    [GGML_TYPE_F64] = {"f64", 1, 8},
};

static const struct type_traits *ggml_trait(uint32_t type)
{
    if (type >= GGML_TYPE_COUNT || ggml_traits[type].block == 0)
        return NULL;
    return &ggml_traits[type];
}

const char *gguf_ggml_type_name(enum ggml_type type)
{
    const struct type_traits *t = ggml_trait((uint32_t)type);
    return t ? t->name : NULL;
}

int gguf_ggml_block_size(enum ggml_type type)
{
    const struct type_traits *t = ggml_trait((uint32_t)type);
    return t ? t->block : 0;
}

size_t gguf_ggml_block_bytes(enum ggml_type type)
{
    const struct type_traits *t = ggml_trait((uint32_t)type);
    return t ? t->block_bytes : 0;
}

static const char *const value_type_names[GGUF_TYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool",  "string", "array", "uint64", "int64", "float64",
};

/* Bytes of one scalar of a fixed-size value type; 0 for string and array. */
static const size_t value_type_bytes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

const char *gguf_type_name(enum gguf_type type)
{
    if ((unsigned)type >= GGUF_TYPE_COUNT)
        return "unknown";
    return value_type_names[type];
}

static bool type_is_int(enum gguf_type t)
{
    switch (t) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
        return true;
    default:
        return false;
    }
}

static bool type_is_float(enum gguf_type t)
{
    return t == GGUF_TYPE_FLOAT32 || t == GGUF_TYPE_FLOAT64;
}

/* ------------------------------------------------------------------------
 * Little-endian loads (the file's byte order, whatever the host's)
 * ------------------------------------------------------------------------ */

static uint16_t le16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}

static uint32_t le32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
           ((uint32_t)p[3] << 24);
}

static uint64_t le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | ((uint64_t)le32(p + 4) << 32);
}

/* ------------------------------------------------------------------------
 * Name index: open addressing over (bytes, length) -> record number
 * ------------------------------------------------------------------------ */

struct name_slot {
    const char *s; /* NULL: empty slot */
    size_t len;
    int64_t idx;
};

struct name_index {
    struct name_slot *slots;
    size_t mask;
};

static uint64_t name_hash(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static int index_init(struct name_index *ix, int64_t n)
{
    size_t cap = 8;
    while (cap < (size_t)n * 2)
        cap *= 2;
    ix->slots = calloc(cap, sizeof(*ix->slots));
    ix->mask = cap - 1;
    return ix->slots ? 0 : -ENOMEM;
}

/* The record holding this name, or -1; *slot gets the slot to insert at. */
static int64_t index_lookup(const struct name_index *ix, const char *s, size_t len,
                            struct name_slot **slot)
{
    size_t i = (size_t)name_hash(s, len) & ix->mask;
    for (;;) {
        struct name_slot *e = &ix->slots[i];
        if (!e->s) {
            if (slot)
                *slot = e;
            return -1;
        }
        if (e->len == len && memcmp(e->s, s, len) == 0)
            return e->idx;
        i = (i + 1) & ix->mask;
    }
}

/* ------------------------------------------------------------------------
 * The handle
 * ------------------------------------------------------------------------ */

struct kv {
    char *key;             /* NUL-terminated copy */
    size_t key_len;
    enum gguf_type type;
    enum gguf_type elem;   /* arrays: element type */
    uint64_t n;            /* arrays: element count */
    size_t val;            /* file offset of the value (strings: of the length field;
                              arrays: of the first element) */
    uint64_t *str_at;      /* string arrays: file offset of each element's length field */
};

struct gguf_file {
    const uint8_t *base; /* the file's bytes */
    size_t size;
    void *map;           /* gguf_open's mapping, or NULL for caller memory */
    size_t map_size;

    uint32_t version;
    size_t alignment;
    size_t data_start;   /* file offset of the data section */
    size_t *offset_at;   /* [n_tensors] file offset of each info's data offset field */

    int64_t n_kv;
    struct kv *kvs;      /* [n_kv] in file order */
    struct name_index key_index;

    int64_t n_tensors;
    struct gguf_tensor *tensors; /* [n_tensors] in file order */
    struct name_index tensor_index;
};

/* ------------------------------------------------------------------------
 * Parser: a cursor whose every read is checked against the end
 * ------------------------------------------------------------------------ */

struct parser {
    gguf_file *f;
    size_t pos;     /* invariant: pos <= f->size */
    char ctx[256];  /* what is being read, for errors: "metadata kv 3 'x'" */
    char *err;
    size_t errlen;
};

/* Record "<ctx>: <message> (byte offset N)" as the error. Returns false. */
__attribute__((format(printf, 3, 4))) static bool fail(struct parser *ps, uint64_t off,
                                                       const char *fmt, ...)
{
    if (!ps->err || ps->errlen == 0)
        return false;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    snprintf(ps->err, ps->errlen, "%s: %s (byte offset %" PRIu64 ")", ps->ctx, msg, off);
    return false;
}

static size_t left(const struct parser *ps)
{
    return ps->f->size - ps->pos;
}

/* Make sure n more bytes exist for `what`; report a truncation otherwise. */
static bool need(struct parser *ps, size_t n, const char *what)
{
    if (left(ps) >= n)
        return true;
    return fail(ps, ps->pos, "file truncated: %s needs %zu bytes but only %zu remain", what, n,
                left(ps));
}

static bool rd_u32(struct parser *ps, const char *what, uint32_t *v)
{
    if (!need(ps, 4, what))
        return false;
    *v = le32(ps->f->base + ps->pos);
    ps->pos += 4;
    return true;
}

static bool rd_u64(struct parser *ps, const char *what, uint64_t *v)
{
    if (!need(ps, 8, what))
        return false;
    *v = le64(ps->f->base + ps->pos);
    ps->pos += 8;
    return true;
}

/* Copy a name for printing: at most ~64 bytes, control bytes shown as '?'. */
static const char *shown(char *buf, size_t bufsz, const char *s, size_t len)
{
    size_t max = bufsz - 4, o = 0;
    for (size_t i = 0; i < len && o < max; i++) {
        unsigned char c = (unsigned char)s[i];
        buf[o++] = (c < 0x20 || c == 0x7f) ? '?' : (char)c;
    }
    if (len > max) {
        memcpy(buf + o, "...", 3);
        o += 3;
    }
    buf[o] = '\0';
    return buf;
}

/*
 * Read a length-prefixed name (key or tensor name): 1..MAX_NAME_BYTES bytes,
 * no NUL. On success *out is a new NUL-terminated copy.
 */
static bool rd_name(struct parser *ps, const char *what, char **out, size_t *out_len)
{
    uint64_t len;
    size_t at = ps->pos;
    char lenwhat[64];
    snprintf(lenwhat, sizeof(lenwhat), "the %s length", what);
    if (!rd_u64(ps, lenwhat, &len))
        return false;
    if (len == 0)
        return fail(ps, at, "empty %s", what);
    if (len > MAX_NAME_BYTES)
        return fail(ps, at, "%s length %" PRIu64 " exceeds the limit of %d bytes", what, len,
                    MAX_NAME_BYTES);
    if (len > left(ps))
        return fail(ps, at, "%s length %" PRIu64 " runs past the end of the file (%zu bytes remain)",
                    what, len, left(ps));
    const char *s = (const char *)ps->f->base + ps->pos;
    const char *nul = memchr(s, '\0', (size_t)len);
    if (nul)
        return fail(ps, ps->pos + (size_t)(nul - s), "%s contains a NUL byte", what);
    char *copy = malloc((size_t)len + 1);
    if (!copy)
        return fail(ps, at, "out of memory copying a %" PRIu64 "-byte %s", len, what);
    memcpy(copy, s, (size_t)len);
    copy[len] = '\0';
    ps->pos += (size_t)len;
    *out = copy;
    *out_len = (size_t)len;
    return true;
}

/* Skip one string value (length + bytes), checking the length. */
static bool skip_string(struct parser *ps, const char *what)
{
    uint64_t len;
    size_t at = ps->pos;
    char lenwhat[64];
    snprintf(lenwhat, sizeof(lenwhat), "the %s length", what);
    if (!rd_u64(ps, lenwhat, &len))
        return false;
    if (len > left(ps))
        return fail(ps, at,
                    "%s length %" PRIu64 " runs past the end of the file (%zu bytes remain)", what,
                    len, left(ps));
    ps->pos += (size_t)len;
    return true;
}

static bool check_bool(struct parser *ps, size_t at, uint8_t b)
{
    if (b > 1)
        return fail(ps, at, "bool value %u is neither 0 nor 1", b);
    return true;
}

/* Read the array header and elements of kv; validates every element. */
static bool rd_array(struct parser *ps, struct kv *kv)
{
    uint32_t elem;
    size_t at = ps->pos;
    if (!rd_u32(ps, "the array element type", &elem))
        return false;
    if (elem == GGUF_TYPE_ARRAY)
        return fail(ps, at, "arrays of arrays are not supported");
    if (elem >= GGUF_TYPE_COUNT)
        return fail(ps, at, "unknown array element type %" PRIu32, elem);
    kv->elem = (enum gguf_type)elem;

    uint64_t n;
    at = ps->pos;
    if (!rd_u64(ps, "the array length", &n))
        return false;
    kv->n = n;
    kv->val = ps->pos;

    if (elem != GGUF_TYPE_STRING) {
        size_t sz = value_type_bytes[elem];
        if (n > left(ps) / sz)
            return fail(ps, at,
                        "array of %" PRIu64 " %s elements runs past the end of the file (it "
                        "needs more than the %zu bytes that remain)",
                        n, value_type_names[elem], left(ps));
        if (elem == GGUF_TYPE_BOOL)
            for (uint64_t i = 0; i < n; i++)
                if (!check_bool(ps, ps->pos + i, ps->f->base[ps->pos + i]))
                    return false;
        ps->pos += (size_t)(n * sz);
        return true;
    }

    /* Strings: each needs at least its 8-byte length; index them for O(1) access. */
    if (n > left(ps) / 8)
        return fail(ps, at,
                    "array of %" PRIu64 " strings runs past the end of the file (it needs more "
                    "than the %zu bytes that remain)",
                    n, left(ps));
    kv->str_at = malloc((n ? (size_t)n : 1) * sizeof(*kv->str_at));
    if (!kv->str_at)
        return fail(ps, at, "out of memory indexing %" PRIu64 " strings", n);
    for (uint64_t i = 0; i < n; i++) {
        kv->str_at[i] = ps->pos;
        char what[64];
        snprintf(what, sizeof(what), "array string %" PRIu64, i);
        if (!skip_string(ps, what))
            return false;
    }
    return true;
}

static bool rd_kv(struct parser *ps, int64_t i)
{
    gguf_file *f = ps->f;
    struct kv *kv = &f->kvs[i];
    snprintf(ps->ctx, sizeof(ps->ctx), "metadata kv %" PRId64, i);
    if (!rd_name(ps, "key", &kv->key, &kv->key_len))
        return false;

    char nm[80];
    snprintf(ps->ctx, sizeof(ps->ctx), "metadata kv %" PRId64 " '%s'", i,
             shown(nm, sizeof(nm), kv->key, kv->key_len));
    struct name_slot *slot = NULL;
    int64_t first = index_lookup(&f->key_index, kv->key, kv->key_len, &slot);
    if (first >= 0)
        return fail(ps, ps->pos - kv->key_len, "duplicate key (first defined by kv %" PRId64 ")",
                    first);
    *slot = (struct name_slot){kv->key, kv->key_len, i};

    uint32_t type;
    size_t at = ps->pos;
    if (!rd_u32(ps, "the value type", &type))
        return false;
    if (type >= GGUF_TYPE_COUNT)
        return fail(ps, at, "unknown value type %" PRIu32, type);
    kv->type = (enum gguf_type)type;
    kv->val = ps->pos;

    switch (kv->type) {
    case GGUF_TYPE_STRING:
        return skip_string(ps, "string value");
    case GGUF_TYPE_ARRAY:
        return rd_array(ps, kv);
    default: {
        size_t sz = value_type_bytes[type];
        char what[48];
        snprintf(what, sizeof(what), "the %s value", value_type_names[type]);
        if (!need(ps, sz, what))
            return false;
        if (kv->type == GGUF_TYPE_BOOL && !check_bool(ps, ps->pos, f->base[ps->pos]))
            return false;
        ps->pos += sz;
        return true;
    }
    }
}

/* Integer scalar of type t at p, as a sign and a magnitude (exact for all 64 bits). */
static void load_int(enum gguf_type t, const uint8_t *p, bool *neg, uint64_t *mag)
{
    int64_t s = 0;
    switch (t) {
    case GGUF_TYPE_UINT8: *neg = false; *mag = p[0]; return;
    case GGUF_TYPE_UINT16: *neg = false; *mag = le16(p); return;
    case GGUF_TYPE_UINT32: *neg = false; *mag = le32(p); return;
    case GGUF_TYPE_UINT64: *neg = false; *mag = le64(p); return;
    case GGUF_TYPE_INT8: s = (int8_t)p[0]; break;
    case GGUF_TYPE_INT16: s = (int16_t)le16(p); break;
    case GGUF_TYPE_INT32: s = (int32_t)le32(p); break;
    case GGUF_TYPE_INT64: s = (int64_t)le64(p); break;
    default: break;
    }
    *neg = s < 0;
    *mag = s < 0 ? (uint64_t)0 - (uint64_t)s : (uint64_t)s;
}

static bool rd_alignment(struct parser *ps)
{
    gguf_file *f = ps->f;
    f->alignment = GGUF_DEFAULT_ALIGNMENT;
    int64_t i = gguf_find_key(f, "general.alignment");
    if (i < 0)
        return true;
    const struct kv *kv = &f->kvs[i];
    snprintf(ps->ctx, sizeof(ps->ctx), "metadata kv %" PRId64 " 'general.alignment'", i);
    if (!type_is_int(kv->type))
        return fail(ps, kv->val, "alignment must be an integer (uint32), not %s",
                    value_type_names[kv->type]);
    bool neg;
    uint64_t a;
    load_int(kv->type, f->base + kv->val, &neg, &a);
    if (neg || a == 0 || a > UINT32_MAX || (a & (a - 1)) != 0)
        return fail(ps, kv->val, "alignment %s%" PRIu64 " is not a nonzero power of two",
                    neg ? "-" : "", a);
    f->alignment = (size_t)a;
    return true;
}

static bool rd_tensor_info(struct parser *ps, int64_t i)
{
    gguf_file *f = ps->f;
    struct gguf_tensor *t = &f->tensors[i];
    char *name;
    size_t name_len;
    snprintf(ps->ctx, sizeof(ps->ctx), "tensor info %" PRId64, i);
    if (!rd_name(ps, "tensor name", &name, &name_len))
        return false;
    t->name = name;

    char nm[80];
    snprintf(ps->ctx, sizeof(ps->ctx), "tensor '%s' (info %" PRId64 ")",
             shown(nm, sizeof(nm), name, name_len), i);
    struct name_slot *slot = NULL;
    int64_t first = index_lookup(&f->tensor_index, name, name_len, &slot);
    if (first >= 0)
        return fail(ps, ps->pos - name_len,
                    "duplicate tensor name (first defined by tensor info %" PRId64 ")", first);
    *slot = (struct name_slot){name, name_len, i};

    uint32_t n_dims;
    size_t at = ps->pos;
    if (!rd_u32(ps, "n_dims", &n_dims))
        return false;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS)
        return fail(ps, at, "n_dims %" PRIu32 " is outside 1..%d", n_dims, GGUF_MAX_DIMS);
    t->n_dims = (int)n_dims;

    /* Dimensions: each >= 1, product below 2^63. */
    uint64_t n_elem = 1;
    for (int d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = 1;
    for (int d = 0; d < (int)n_dims; d++) {
        at = ps->pos;
        if (!rd_u64(ps, "a dimension", &t->ne[d]))
            return false;
        if (t->ne[d] == 0)
            return fail(ps, at, "dimension %d is 0 (empty tensors are not supported)", d);
        if (t->ne[d] > INT64_MAX)
            return fail(ps, at, "dimension %d is %" PRIu64 ", above 2^63-1", d, t->ne[d]);
        if (__builtin_mul_overflow(n_elem, t->ne[d], &n_elem) || n_elem > INT64_MAX)
            return fail(ps, at,
                        "the product of the dimensions overflows 64 bits at dimension %d (%" PRIu64
                        ")",
                        d, t->ne[d]);
    }
    t->n_elements = n_elem;

    uint32_t type;
    at = ps->pos;
    if (!rd_u32(ps, "the tensor type", &type))
        return false;
    const struct type_traits *tr = ggml_trait(type);
    if (!tr)
        return fail(ps, at, "has unknown type %" PRIu32, type);
    t->type = (enum ggml_type)type;
    if (t->ne[0] % (uint64_t)tr->block != 0)
        return fail(ps, at, "ne[0] = %" PRIu64 " is not a multiple of the %s block size %d",
                    t->ne[0], tr->name, tr->block);
    uint64_t bytes;
    if (__builtin_mul_overflow(n_elem / (uint64_t)tr->block, (uint64_t)tr->block_bytes, &bytes) ||
        bytes > SIZE_MAX)
        return fail(ps, at, "byte size of %" PRIu64 " %s elements overflows", n_elem, tr->name);
    t->size = (size_t)bytes;

    at = ps->pos;
    f->offset_at[i] = at;
    if (!rd_u64(ps, "the data offset", &t->offset))
        return false;
    if (t->offset % f->alignment != 0)
        return fail(ps, at, "data offset %" PRIu64 " is not a multiple of the alignment %zu",
                    t->offset, f->alignment);
    return true;
}

struct span {
    uint64_t offset;
    size_t size;
    int64_t idx;
};

static int by_offset(const void *a, const void *b)
{
    const struct span *x = a, *y = b;
    return (x->offset > y->offset) - (x->offset < y->offset);
}

/* Every tensor inside the data section; no two overlapping. */
static bool check_placement(struct parser *ps)
{
    gguf_file *f = ps->f;
    if (f->n_tensors == 0)
        return true;
    snprintf(ps->ctx, sizeof(ps->ctx), "data section");
    if (f->data_start > f->size)
        return fail(ps, f->size,
                    "file truncated: the data section starts at byte %zu but the file has %zu "
                    "bytes",
                    f->data_start, f->size);
    size_t data_size = f->size - f->data_start;
    char nm[80];
    for (int64_t i = 0; i < f->n_tensors; i++) {
        struct gguf_tensor *t = &f->tensors[i];
        if (t->offset > data_size || t->size > data_size - t->offset) {
            snprintf(ps->ctx, sizeof(ps->ctx), "tensor '%s' (info %" PRId64 ")",
                     shown(nm, sizeof(nm), t->name, strlen(t->name)), i);
            return fail(ps, f->offset_at[i],
                        "data offset %" PRIu64 " + %zu bytes runs past the end of the data "
                        "section (%zu bytes from byte %zu): file truncated or offset wrong",
                        t->offset, t->size, data_size, f->data_start);
        }
        t->data = f->base + f->data_start + t->offset;
    }

    struct span *order = malloc((size_t)f->n_tensors * sizeof(*order));
    if (!order)
        return fail(ps, 0, "out of memory sorting %" PRId64 " tensors", f->n_tensors);
    for (int64_t i = 0; i < f->n_tensors; i++)
        order[i] = (struct span){f->tensors[i].offset, f->tensors[i].size, i};
    qsort(order, (size_t)f->n_tensors, sizeof(*order), by_offset);
    bool ok = true;
    for (int64_t k = 1; k < f->n_tensors && ok; k++) {
        const struct gguf_tensor *a = &f->tensors[order[k - 1].idx], *b = &f->tensors[order[k].idx];
        if (a->offset + a->size > b->offset) {
            char nm2[80];
            ok = fail(ps, f->data_start + b->offset,
                      "tensors '%s' (offset %" PRIu64 ", %zu bytes) and '%s' (offset %" PRIu64
                      ") overlap",
                      shown(nm, sizeof(nm), a->name, strlen(a->name)), a->offset, a->size,
                      shown(nm2, sizeof(nm2), b->name, strlen(b->name)), b->offset);
        }
    }
    free(order);
    return ok;
}

static bool parse(struct parser *ps)
{
    gguf_file *f = ps->f;
    const uint8_t *p = f->base;
    snprintf(ps->ctx, sizeof(ps->ctx), "header");

    /* Magic and version. */
    if (f->size == 0)
        return fail(ps, 0, "empty file (0 bytes)");
    if (f->size < 4 || memcmp(p, "GGUF", 4) != 0) {
        if (f->size < 4)
            return fail(ps, 0, "file is %zu bytes, smaller than the %d-byte GGUF header", f->size,
                        HEADER_BYTES);
        return fail(ps, 0, "bad magic %02x %02x %02x %02x: not a GGUF file (expected \"GGUF\")",
                    p[0], p[1], p[2], p[3]);
    }
    if (f->size < 8)
        return fail(ps, 4, "file is %zu bytes, smaller than the %d-byte GGUF header", f->size,
                    HEADER_BYTES);
    f->version = le32(p + 4);
    if (f->version == 1)
        return fail(ps, 4,
                    "GGUF version 1 is not supported (it used 32-bit counts and lengths); "
                    "versions 2 and 3 are");
    if (f->version != 2 && f->version != 3) {
        uint32_t v = f->version;
        uint32_t swapped = (v >> 24) | ((v >> 8) & 0xff00) | ((v << 8) & 0xff0000) | (v << 24);
        if (swapped >= 1 && swapped <= 3)
            return fail(ps, 4,
                        "GGUF version field 0x%08" PRIx32 " is byte-swapped: big-endian files "
                        "are not supported",
                        v);
        return fail(ps, 4, "unsupported GGUF version %" PRIu32 " (versions 2 and 3 are supported)",
                    v);
    }
    if (f->size < HEADER_BYTES)
        return fail(ps, 8, "file is %zu bytes, smaller than the %d-byte GGUF header", f->size,
                    HEADER_BYTES);

    /* Counts: bounded by the smallest records the remaining bytes could hold. */
    uint64_t n_tensors = le64(p + 8), n_kv = le64(p + 16);
    ps->pos = HEADER_BYTES;
    size_t rest = left(ps);
    if (n_kv > rest / MIN_KV_BYTES)
        return fail(ps, 16,
                    "metadata kv count %" PRIu64 " is impossible: the %zu bytes after the header "
                    "hold at most %zu (each needs at least %d bytes)",
                    n_kv, rest, rest / MIN_KV_BYTES, MIN_KV_BYTES);
    rest -= (size_t)n_kv * MIN_KV_BYTES;
    if (n_tensors > rest / MIN_TENSOR_INFO_BYTES)
        return fail(ps, 8,
                    "tensor count %" PRIu64 " is impossible: the %zu bytes left after the "
                    "metadata hold at most %zu tensor infos (each needs at least %d bytes)",
                    n_tensors, rest, rest / MIN_TENSOR_INFO_BYTES, MIN_TENSOR_INFO_BYTES);
    f->n_kv = (int64_t)n_kv;
    f->n_tensors = (int64_t)n_tensors;

    f->kvs = calloc(n_kv ? (size_t)n_kv : 1, sizeof(*f->kvs));
    f->tensors = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof(*f->tensors));
    f->offset_at = calloc(n_tensors ? (size_t)n_tensors : 1, sizeof(*f->offset_at));
    if (!f->kvs || !f->tensors || !f->offset_at || index_init(&f->key_index, f->n_kv) != 0 ||
        index_init(&f->tensor_index, f->n_tensors) != 0)
        return fail(ps, 8, "out of memory for %" PRIu64 " kvs and %" PRIu64 " tensors", n_kv,
                    n_tensors);

    for (int64_t i = 0; i < f->n_kv; i++)
        if (!rd_kv(ps, i))
            return false;
    if (!rd_alignment(ps))
        return false;
    for (int64_t i = 0; i < f->n_tensors; i++)
        if (!rd_tensor_info(ps, i))
            return false;

    /* The data section starts at the next multiple of the alignment. */
    size_t a = f->alignment, pad = (a - ps->pos % a) % a;
    if (pad > SIZE_MAX - ps->pos) {
        snprintf(ps->ctx, sizeof(ps->ctx), "data section");
        return fail(ps, ps->pos, "data section start overflows");
    }
    f->data_start = ps->pos + pad;
    return check_placement(ps);
}

/* ------------------------------------------------------------------------
 * Open and close
 * ------------------------------------------------------------------------ */

void gguf_close(gguf_file *f)
{
    if (!f)
        return;
    if (f->kvs)
        for (int64_t i = 0; i < f->n_kv; i++) {
            free(f->kvs[i].key);
            free(f->kvs[i].str_at);
        }
    if (f->tensors)
        for (int64_t i = 0; i < f->n_tensors; i++)
            free((char *)f->tensors[i].name);
    free(f->kvs);
    free(f->tensors);
    free(f->offset_at);
    free(f->key_index.slots);
    free(f->tensor_index.slots);
    if (f->map)
        munmap(f->map, f->map_size);
    free(f);
}

/* Validate f->base/f->size; on failure frees f (not its map) and returns NULL. */
static gguf_file *open_common(gguf_file *f, char *err, size_t errlen)
{
    struct parser ps = {.f = f, .err = err, .errlen = errlen};
    if (parse(&ps))
        return f;
    f->map = NULL; /* the caller unmaps */
    gguf_close(f);
    return NULL;
}

gguf_file *gguf_open_memory(const void *data, size_t size, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!data && size) {
        if (err && errlen)
            snprintf(err, errlen, "no buffer given for %zu bytes", size);
        return NULL;
    }
    gguf_file *f = calloc(1, sizeof(*f));
    if (!f) {
        if (err && errlen)
            snprintf(err, errlen, "out of memory");
        return NULL;
    }
    f->base = data ? data : (const uint8_t *)"";
    f->size = size;
    return open_common(f, err, errlen);
}

gguf_file *gguf_open(const char *path, char *err, size_t errlen)
{
    char sub[768];
    if (err && errlen)
        err[0] = '\0';
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        if (err && errlen)
            snprintf(err, errlen, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (S_ISDIR(st.st_mode) || !S_ISREG(st.st_mode)) {
        if (err && errlen)
            snprintf(err, errlen, "%s: is a %s, not a GGUF file", path,
                     S_ISDIR(st.st_mode) ? "directory" : "special file");
        close(fd);
        return NULL;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        if (err && errlen)
            snprintf(err, errlen, "%s: file too large to map", path);
        close(fd);
        return NULL;
    }
    size_t size = (size_t)st.st_size;
    if (size < HEADER_BYTES) { /* no mapping needed to say why it is too small */
        uint8_t head[HEADER_BYTES];
        ssize_t got = size ? pread(fd, head, size, 0) : 0;
        close(fd);
        if (got != (ssize_t)size) {
            if (err && errlen)
                snprintf(err, errlen, "%s: cannot read: %s", path,
                         got < 0 ? strerror(errno) : "short read");
            return NULL;
        }
        gguf_file *f = gguf_open_memory(head, size, sub, sizeof(sub));
        if (f) { /* cannot happen: a header needs 24 bytes */
            gguf_close(f);
            snprintf(sub, sizeof(sub), "file too small");
        }
        if (err && errlen)
            snprintf(err, errlen, "%s: %s", path, sub);
        return NULL;
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) {
        if (err && errlen)
            snprintf(err, errlen, "%s: cannot map %zu bytes: %s", path, size, strerror(map_errno));
        return NULL;
    }
    gguf_file *f = calloc(1, sizeof(*f));
    if (!f) {
        munmap(map, size);
        if (err && errlen)
            snprintf(err, errlen, "%s: out of memory", path);
        return NULL;
    }
    f->base = map;
    f->size = size;
    if (!open_common(f, sub, sizeof(sub))) {
        munmap(map, size);
        if (err && errlen)
            snprintf(err, errlen, "%s: %s", path, sub);
        return NULL;
    }
    f->map = map;
    f->map_size = size;
    return f;
}

/* ------------------------------------------------------------------------
 * Accessors
 * ------------------------------------------------------------------------ */

uint32_t gguf_version(const gguf_file *f)
{
    return f->version;
}

size_t gguf_alignment(const gguf_file *f)
{
    return f->alignment;
}

int64_t gguf_n_kv(const gguf_file *f)
{
    return f->n_kv;
}

const char *gguf_kv_key(const gguf_file *f, int64_t i)
{
    return (i >= 0 && i < f->n_kv) ? f->kvs[i].key : NULL;
}

enum gguf_type gguf_kv_type(const gguf_file *f, int64_t i)
{
    return (i >= 0 && i < f->n_kv) ? f->kvs[i].type : GGUF_TYPE_COUNT;
}

int64_t gguf_find_key(const gguf_file *f, const char *key)
{
    if (!key)
        return -1;
    return index_lookup(&f->key_index, key, strlen(key), NULL);
}

static int find(const gguf_file *f, const char *key, const struct kv **kv)
{
    int64_t i = gguf_find_key(f, key);
    if (i < 0)
        return -ENOENT;
    *kv = &f->kvs[i];
    return 0;
}

/* One numeric (or bool) scalar of type t at p: as double, and exactly for integers. */
static void load_num(enum gguf_type t, const uint8_t *p, double *d, bool *neg, uint64_t *mag,
                     bool *is_int)
{
    *is_int = !type_is_float(t);
    if (t == GGUF_TYPE_FLOAT32) {
        uint32_t bits = le32(p);
        float v;
        memcpy(&v, &bits, 4);
        *d = v;
    } else if (t == GGUF_TYPE_FLOAT64) {
        uint64_t bits = le64(p);
        memcpy(d, &bits, 8);
    } else if (t == GGUF_TYPE_BOOL) {
        *neg = false;
        *mag = p[0];
        *d = p[0];
    } else {
        load_int(t, p, neg, mag);
        *d = *neg ? -(double)*mag : (double)*mag;
    }
}

int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (!type_is_int(kv->type))
        return -EINVAL;
    bool neg;
    uint64_t mag;
    load_int(kv->type, f->base + kv->val, &neg, &mag);
    if (neg || mag > UINT32_MAX)
        return -EINVAL;
    *out = (uint32_t)mag;
    return 0;
}

int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (!type_is_int(kv->type))
        return -EINVAL;
    bool neg;
    uint64_t mag;
    load_int(kv->type, f->base + kv->val, &neg, &mag);
    if (!neg && mag > INT64_MAX)
        return -EINVAL;
    *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    return 0;
}

int gguf_get_f32(const gguf_file *f, const char *key, float *out)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (!type_is_int(kv->type) && !type_is_float(kv->type))
        return -EINVAL;
    double d;
    bool neg, is_int;
    uint64_t mag;
    load_num(kv->type, f->base + kv->val, &d, &neg, &mag, &is_int);
    *out = (float)d;
    return 0;
}

int gguf_get_scalar(const gguf_file *f, const char *key, enum gguf_type *type, void *out)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    size_t n = kv->type == GGUF_TYPE_UINT8 || kv->type == GGUF_TYPE_INT8 ||
                       kv->type == GGUF_TYPE_BOOL
                   ? 1
               : kv->type == GGUF_TYPE_UINT16 || kv->type == GGUF_TYPE_INT16 ? 2
               : kv->type == GGUF_TYPE_UINT32 || kv->type == GGUF_TYPE_INT32 ||
                       kv->type == GGUF_TYPE_FLOAT32
                   ? 4
               : kv->type == GGUF_TYPE_UINT64 || kv->type == GGUF_TYPE_INT64 ||
                       kv->type == GGUF_TYPE_FLOAT64
                   ? 8
                   : 0;
    if (!n)
        return -EINVAL;
    memcpy(out, f->base + kv->val, n); /* little-endian file, little-endian host */
    *type = kv->type;
    return 0;
}

int gguf_get_bool(const gguf_file *f, const char *key, bool *out)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (kv->type != GGUF_TYPE_BOOL)
        return -EINVAL;
    *out = f->base[kv->val] != 0;
    return 0;
}

int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (kv->type != GGUF_TYPE_STRING)
        return -EINVAL;
    *len = (size_t)le64(f->base + kv->val);
    *s = (const char *)f->base + kv->val + 8;
    return 0;
}

int gguf_get_arr(const gguf_file *f, const char *key, enum gguf_type *elem_type, uint64_t *n,
                 const void **data)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (kv->type != GGUF_TYPE_ARRAY)
        return -EINVAL;
    if (elem_type)
        *elem_type = kv->elem;
    if (n)
        *n = kv->n;
    if (data)
        *data = kv->elem == GGUF_TYPE_STRING ? NULL : (const void *)(f->base + kv->val);
    return 0;
}

int gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s,
                     size_t *len)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem != GGUF_TYPE_STRING)
        return -EINVAL;
    if (i >= kv->n)
        return -ERANGE;
    const uint8_t *p = f->base + kv->str_at[i];
    *len = (size_t)le64(p);
    *s = (const char *)p + 8;
    return 0;
}

/* Element i of a numeric (or bool) array, loaded. */
static int arr_num(const gguf_file *f, const char *key, uint64_t i, double *d, bool *neg,
                   uint64_t *mag, bool *is_int)
{
    const struct kv *kv;
    int rc = find(f, key, &kv);
    if (rc)
        return rc;
    if (kv->type != GGUF_TYPE_ARRAY || kv->elem == GGUF_TYPE_STRING)
        return -EINVAL;
    if (i >= kv->n)
        return -ERANGE;
    load_num(kv->elem, f->base + kv->val + i * value_type_bytes[kv->elem], d, neg, mag, is_int);
    return 0;
}

int gguf_get_arr_f32(const gguf_file *f, const char *key, uint64_t i, float *out)
{
    double d;
    bool neg, is_int;
    uint64_t mag;
    int rc = arr_num(f, key, i, &d, &neg, &mag, &is_int);
    if (rc)
        return rc;
    *out = (float)d;
    return 0;
}

int gguf_get_arr_i64(const gguf_file *f, const char *key, uint64_t i, int64_t *out)
{
    double d;
    bool neg = false, is_int;
    uint64_t mag = 0;
    int rc = arr_num(f, key, i, &d, &neg, &mag, &is_int);
    if (rc)
        return rc;
    if (!is_int) { /* floats: only integral values that fit */
        if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0) || d != (double)(int64_t)d)
            return -EINVAL;
        *out = (int64_t)d;
        return 0;
    }
    if (!neg && mag > INT64_MAX)
        return -EINVAL;
    *out = neg ? (int64_t)(0 - mag) : (int64_t)mag;
    return 0;
}

int64_t gguf_n_tensors(const gguf_file *f)
{
    return f->n_tensors;
}

const struct gguf_tensor *gguf_tensor_at(const gguf_file *f, int64_t i)
{
    return (i >= 0 && i < f->n_tensors) ? &f->tensors[i] : NULL;
}

const struct gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name)
{
    if (!name)
        return NULL;
    int64_t i = index_lookup(&f->tensor_index, name, strlen(name), NULL);
    return i >= 0 ? &f->tensors[i] : NULL;
}
