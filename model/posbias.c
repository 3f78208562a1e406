/*
 * posbias.c - the offset-only position biases of a model: ALiBi slopes and
 * the T5 bias table, read and validated at load.
 *
 * Offset-only biases depend on key position - query position alone, so
 * kvd can evict tokens and renumber positions without rewriting any cached
 * byte: the kernel adds slope_h * (pos_k - pos_q) (ALiBi) or
 * table[h][bucket(pos_k - pos_q)] (T5) from the position numbers it reads.
 * What the model owns is only the per-head numbers: n_head slopes, or an
 * n_head x num_buckets table.
 *
 * The T5-bias decoder is kvd's own variant of a Llama-shaped model
 * (general.architecture llama or qwen2) whose attention has no RoPE:
 *
 *   kvd.position.kind = "t5"           (string; "rope" or absent: RoPE,
 *                                       "alibi": ALiBi with
 *                                       <arch>.attention.max_alibi_bias)
 *   kvd.t5.num_buckets                 (integer, 4..4096)
 *   kvd.t5.max_distance                (integer, above the exact range
 *                                       num_buckets/2, at most 2^20)
 *   blk.0.attn_rel_b.weight            [n_head, num_buckets] in GGUF order
 *                                       (ne0 = n_head: each bucket's n_head
 *                                       values are contiguous), the name and
 *                                       layout llama.cpp gives T5's
 *                                       relative attention bias
 *
 * As in T5, one table serves the whole stack: it is owned by the first
 * layer and every layer reads it. A file with a table in any other layer,
 * or with none, is rejected with the tensors named, rather than guessing
 * which table a layer meant. Buckets are causal (a decoder: every key at or
 * before the query), computed by posenc's pos_t5_bucket exactly as Hugging
 * Face's _relative_position_bucket does with bidirectional=False.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model_internal.h"

/* Largest T5 max_distance: the kernel's lookup table is O(max_distance). */
#define T5_MAX_DISTANCE (1 << 20)
#define T5_MAX_BUCKETS 4096

int model_pos_kind(const gguf_file *f, enum pos_kind *kind, char *err, size_t errlen)
{
    const char *s;
    size_t n;
    int rc = gguf_get_str(f, "kvd.position.kind", &s, &n);
    if (rc == -ENOENT) {
        *kind = POS_ROPE;
        return 0;
    }
    if (rc) {
        snprintf(err, errlen, "metadata key kvd.position.kind is not a string");
        return -EINVAL;
    }
    static const struct {
        const char *name;
        enum pos_kind kind;
    } kinds[] = {{"rope", POS_ROPE}, {"alibi", POS_ALIBI}, {"t5", POS_T5}};
    for (size_t i = 0; i < sizeof(kinds) / sizeof(kinds[0]); i++) {
        if (n == strlen(kinds[i].name) && !memcmp(s, kinds[i].name, n)) {
            *kind = kinds[i].kind;
            return 0;
        }
    }
    snprintf(err, errlen, "kvd.position.kind = '%.*s' is not supported (rope, alibi or t5)",
             (int)(n > 32 ? 32 : n), s);
    return -EINVAL;
}

int model_pos_alibi(model *m, float max_bias, char *err, size_t errlen)
{
    if (!(max_bias > 0.0f) || !isfinite(max_bias)) {
        snprintf(err, errlen, "ALiBi max_bias %g must be a positive number", max_bias);
        return -EINVAL;
    }
    float *slopes = malloc(sizeof(float) * (size_t)m->n_head);
    if (!slopes) {
        snprintf(err, errlen, "out of memory for %d ALiBi slopes", m->n_head);
        return -ENOMEM;
    }
    pos_alibi_slopes(slopes, m->n_head, max_bias); /* n_head >= 1, max_bias > 0: cannot fail */
    free(m->pos_data);
    m->pos_data = slopes;
    m->alibi_max_bias = max_bias;
    m->pos = (struct pos_scheme){.kind = POS_ALIBI, .alibi_slopes = slopes};
    return 0;
}

/*
 * A T5 metadata integer: from the file, else from params (> 0), else an
 * error naming the key. Range-checked either way.
 */
static int t5_key(const gguf_file *f, const char *key, int from_params, long lo, long hi, int *out,
                  char *err, size_t errlen)
{
    int64_t v;
    int rc = gguf_get_i64(f, key, &v);
    const char *src = "metadata key";
    if (rc == -ENOENT) {
        if (from_params <= 0) {
            snprintf(err, errlen,
                     "kvd.position.kind = t5 but metadata key %s is missing (and "
                     "no override was given)",
                     key);
            return -EINVAL;
        }
        v = from_params;
        src = "override for missing";
    } else if (rc) {
        snprintf(err, errlen, "metadata key %s is not an integer", key);
        return -EINVAL;
    }
    if (v < lo || v > hi) {
        snprintf(err, errlen, "%s %s = %lld is outside [%ld, %ld]", src, key, (long long)v, lo, hi);
        return -EINVAL;
    }
    *out = (int)v;
    return 0;
}

/* Names of blk.N.attn_rel_b.weight for N in [from, n_layer), comma-joined
 * into list; returns how many there are. */
static int list_tables(const model *m, int from, char *list, size_t cap)
{
    int count = 0;
    size_t len = 0;
    list[0] = '\0';
    for (int l = from; l < m->n_layer; l++) {
        char name[64];
        snprintf(name, sizeof(name), "blk.%d.attn_rel_b.weight", l);
        if (!gguf_find_tensor(m->file, name))
            continue;
        if (count < 4 && len < cap) {
            int w = snprintf(list + len, cap - len, "%s%s", count ? ", " : "", name);
            len += w > 0 ? (size_t)w : 0;
        } else if (count == 4 && len < cap) {
            int w = snprintf(list + len, cap - len, ", ...");
            len += w > 0 ? (size_t)w : 0;
        }
        count++;
    }
    return count;
}

int model_pos_t5(model *m, const struct model_params *params, char *err, size_t errlen)
{
    const gguf_file *f = m->file;
    int nb, md;
    int rc = t5_key(f, "kvd.t5.num_buckets", params->t5_num_buckets, 4, T5_MAX_BUCKETS, &nb, err,
                    errlen);
    rc = rc ? rc
            : t5_key(f, "kvd.t5.max_distance", params->t5_max_distance, 1, T5_MAX_DISTANCE, &md,
                     err, errlen);
    if (rc)
        return rc;
    char why[256];
    if (pos_t5_check(nb, md, false, why, sizeof(why))) {
        snprintf(err, errlen, "kvd.t5.num_buckets = %d, kvd.t5.max_distance = %d: %s", nb, md, why);
        return -EINVAL;
    }

    /* One table, owned by layer 0. */
    char list[320];
    int extra = list_tables(m, 1, list, sizeof(list));
    if (extra) {
        snprintf(err, errlen,
                 "unexpected tensor%s %s: a T5-bias decoder has one bias table, "
                 "blk.0.attn_rel_b.weight, shared by every layer",
                 extra > 1 ? "s" : "", list);
        return -EINVAL;
    }
    const char *name = "blk.0.attn_rel_b.weight";
    const struct gguf_tensor *t = gguf_find_tensor(f, name);
    if (!t) {
        snprintf(err, errlen,
                 "missing tensor %s (the T5 bias table, [n_head %d, num_buckets %d], "
                 "shared by every layer)",
                 name, m->n_head, nb);
        return -EINVAL;
    }
    if (t->ne[0] != (uint64_t)m->n_head || t->ne[2] != 1 || t->ne[3] != 1) {
        snprintf(err, errlen,
                 "tensor %s has shape [%llu, %llu, %llu, %llu]: expected [n_head %d, "
                 "num_buckets %d]",
                 name, (unsigned long long)t->ne[0], (unsigned long long)t->ne[1],
                 (unsigned long long)t->ne[2], (unsigned long long)t->ne[3], m->n_head, nb);
        return -EINVAL;
    }
    if (t->ne[1] != (uint64_t)nb) {
        snprintf(err, errlen,
                 "tensor %s has %llu buckets (shape [%llu, %llu]) but "
                 "kvd.t5.num_buckets = %d",
                 name, (unsigned long long)t->ne[1], (unsigned long long)t->ne[0],
                 (unsigned long long)t->ne[1], nb);
        return -EINVAL;
    }
    if (t->type != GGML_TYPE_F32 && t->type != GGML_TYPE_F16 && t->type != GGML_TYPE_BF16) {
        snprintf(err, errlen,
                 "tensor %s: type %s is not supported for a bias table (f32, f16, "
                 "bf16)",
                 name, gguf_ggml_type_name(t->type) ? gguf_ggml_type_name(t->type) : "unknown");
        return -EINVAL;
    }

    /* Transpose [bucket][head] (the file) to [head][bucket] (the kernel). */
    int H = m->n_head;
    float *table = malloc(sizeof(float) * (size_t)H * (size_t)nb);
    float *row = malloc(sizeof(float) * (size_t)H);
    if (!table || !row) {
        free(table);
        free(row);
        snprintf(err, errlen, "out of memory for a %d x %d T5 table", H, nb);
        return -ENOMEM;
    }
    size_t rb = qt_row_bytes(t->type, H);
    for (int b = 0; b < nb; b++) {
        qt_dequantize_row(t->type, (const uint8_t *)t->data + rb * (size_t)b, row, H);
        for (int h = 0; h < H; h++) {
            if (!isfinite(row[h])) {
                snprintf(err, errlen, "tensor %s: bucket %d, head %d is not finite", name, b, h);
                free(table);
                free(row);
                return -EINVAL;
            }
            table[(size_t)h * nb + b] = row[h];
        }
    }
    free(row);
    free(m->pos_data);
    m->pos_data = table;
    m->pos = (struct pos_scheme){
        .kind = POS_T5,
        .t5_table = table,
        .t5_num_buckets = nb,
        .t5_max_distance = md,
        .t5_bidirectional = false,
    };
    return 0;
}

int model_pos_no_t5_tables(const model *m, char *err, size_t errlen)
{
    char list[320];
    int n = list_tables(m, 0, list, sizeof(list));
    if (!n)
        return 0;
    snprintf(err, errlen,
             "unexpected tensor%s %s: T5 bias tables, but the position scheme is %s "
             "(kvd.position.kind = t5 selects them)",
             n > 1 ? "s" : "", list, pos_kind_name(m->pos.kind));
    return -EINVAL;
}
