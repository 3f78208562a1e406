/*
 * fingerprint.c - a 64-bit name for "this model, loaded this way": what a
 * saved session's K and V were computed by.
 *
 * A session saved to disk holds keys and values the model produced; they
 * are worth something only to the same model loaded the same way. The
 * fingerprint hashes what decides them without reading the weights whole
 * (a 70 GB file must not be read at every start): every metadata key with
 * its type and value (architecture, hyperparameters, the whole vocabulary,
 * the chat template), every tensor's name, type, shape and size with the
 * first and last 64 bytes of its data (a fine-tune of the same shape
 * differs there with near certainty), and the settings loading may take
 * from the operator instead of the file (ALiBi max_bias, T5 buckets, the
 * Phi-3 long RoPE choice). FNV-1a over that, 64 bits: a fingerprint tells
 * honest files apart; it is no defence against a forged one.
 */
#include <string.h>

#include "model/model_internal.h"

#define FNV_OFFSET 14695981039346656037ull
#define FNV_PRIME 1099511628211ull

static uint64_t fnv(uint64_t h, const void *data, size_t n)
{
    const uint8_t *p = data;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * FNV_PRIME;
    return h;
}

static uint64_t fnv_u64(uint64_t h, uint64_t v)
{
    return fnv(h, &v, sizeof(v));
}

static uint64_t fnv_str(uint64_t h, const char *s, size_t n)
{
    return fnv(fnv_u64(h, n), s, n);
}

/* Bytes of one element of a numeric GGUF array type (0: not numeric). */
static size_t elem_bytes(enum gguf_type t)
{
    switch (t) {
    case GGUF_TYPE_UINT8:
    case GGUF_TYPE_INT8:
    case GGUF_TYPE_BOOL:
        return 1;
    case GGUF_TYPE_UINT16:
    case GGUF_TYPE_INT16:
        return 2;
    case GGUF_TYPE_UINT32:
    case GGUF_TYPE_INT32:
    case GGUF_TYPE_FLOAT32:
        return 4;
    case GGUF_TYPE_UINT64:
    case GGUF_TYPE_INT64:
    case GGUF_TYPE_FLOAT64:
        return 8;
    default:
        return 0;
    }
}

static uint64_t hash_kv(uint64_t h, const gguf_file *f, int64_t i)
{
    const char *key = gguf_kv_key(f, i);
    enum gguf_type t = gguf_kv_type(f, i);
    h = fnv_str(h, key, strlen(key));
    h = fnv_u64(h, (uint64_t)t);
    if (t == GGUF_TYPE_STRING) {
        const char *s;
        size_t n;
        if (gguf_get_str(f, key, &s, &n) == 0)
            h = fnv_str(h, s, n);
    } else if (t == GGUF_TYPE_ARRAY) {
        enum gguf_type et;
        uint64_t n;
        const void *data;
        if (gguf_get_arr(f, key, &et, &n, &data) != 0)
            return h;
        h = fnv_u64(fnv_u64(h, (uint64_t)et), n);
        if (et == GGUF_TYPE_STRING) {
            for (uint64_t j = 0; j < n; j++) {
                const char *s;
                size_t len;
                if (gguf_get_arr_str(f, key, j, &s, &len) == 0)
                    h = fnv_str(h, s, len);
            }
        } else if (data && elem_bytes(et)) {
            h = fnv(h, data, (size_t)n * elem_bytes(et));
        }
    } else {
        uint64_t v = 0;
        enum gguf_type st;
        if (gguf_get_scalar(f, key, &st, &v) == 0)
            h = fnv(h, &v, elem_bytes(st));
    }
    return h;
}

static uint64_t hash_tensor(uint64_t h, const struct gguf_tensor *t)
{
    h = fnv_str(h, t->name, strlen(t->name));
    h = fnv_u64(fnv_u64(h, (uint64_t)t->type), (uint64_t)t->n_dims);
    for (int d = 0; d < t->n_dims; d++)
        h = fnv_u64(h, t->ne[d]);
    h = fnv_u64(h, (uint64_t)t->size);
    size_t edge = t->size < 64 ? t->size : 64;
    h = fnv(h, t->data, edge);
    return fnv(h, (const uint8_t *)t->data + t->size - edge, edge);
}

uint64_t model_fingerprint(const model *m)
{
    uint64_t h = FNV_OFFSET;
    const gguf_file *f = m->file;
    for (int64_t i = 0; i < gguf_n_kv(f); i++)
        h = hash_kv(h, f, i);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++)
        h = hash_tensor(h, gguf_tensor_at(f, i));
    /* What the operator may set where the file is silent. */
    h = fnv(h, &m->alibi_max_bias, sizeof(m->alibi_max_bias));
    h = fnv_u64(h, (uint64_t)m->pos.kind);
    h = fnv_u64(h, (uint64_t)m->pos.t5_num_buckets);
    h = fnv_u64(h, (uint64_t)m->pos.t5_max_distance);
    h = fnv_u64(h, (uint64_t)m->rope_long);
    return h;
}
