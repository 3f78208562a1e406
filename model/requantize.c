/*
 * requantize.c - `kvd quantize`: a GGUF file in, the same file out with its
 * weight matrices in another format.
 *
 * What is rewritten: every tensor of two or more dimensions whose name ends
 * in ".weight" (the matrices: embedding, output, attention and MLP
 * projections), except blk.0.attn_rel_b.weight (a T5 position table, not
 * a product). Vectors (norms, biases, RoPE factor tables) are copied as
 * they are, so are all metadata but general.file_type, which names the
 * mix as llama.cpp's llama_ftype does.
 *
 * Which type a matrix gets (the _M mixes follow the mainstream quantiser's
 * recipe in its simple form):
 *   output.weight (or token_embd.weight when the output is tied)  q6_K for
 *       the K mixes and q6_K; the target's type otherwise
 *   attn_v.weight, ffn_down.weight of the layers that "use more bits" -
 *       the first and last eighth of the stack, and every third layer
 *       between (i - n/8) % 3 == 2 - the mix's "more" type (q6_K for both
 *       q4_K_M and q5_K_M); attn_qkv.weight (fused) always
 *   everything else  the base type (q4_K, q5_K, ...)
 * Fallbacks, reported per tensor: a K type (or iq4_xs) needs rows of a
 * multiple of 256 elements; a matrix whose rows are only a multiple of 32
 * gets the block format of 32 the mainstream tool gives it there, so that
 * a file quantised by either holds the same types: q4_K -> q5_0, q5_K ->
 * q5_1, q6_K -> q8_0, and for the smaller types (q2_K, q3_K, iq4_xs) the
 * tool's iq4_nl, which kvd reads but does not write, is replaced by q4_0,
 * its size (4.5 bits per weight). q8_0, q4_0, q4_1, q5_0 and q5_1 need
 * multiples of 32 - a matrix without keeps its type.
 * A source type kvd cannot decode is refused with its name.
 *
 * Memory: the writer holds the whole output (its tensor data is copied
 * in); the input stays mapped. Rows are quantised by the thread pool
 * (cpu/pool.h), each thread its own contiguous run of rows.
 */
#include "model/requantize.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/pool.h"
#include "model/quant.h"

static const struct model_quant_target targets[] = {
    {"q8_0", GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, GGML_TYPE_Q8_0, 7},
    {"q4_0", GGML_TYPE_Q4_0, GGML_TYPE_Q4_0, GGML_TYPE_Q4_0, 2},
    {"q4_1", GGML_TYPE_Q4_1, GGML_TYPE_Q4_1, GGML_TYPE_Q4_1, 3},
    {"q5_0", GGML_TYPE_Q5_0, GGML_TYPE_Q5_0, GGML_TYPE_Q5_0, 8},
    {"q5_1", GGML_TYPE_Q5_1, GGML_TYPE_Q5_1, GGML_TYPE_Q5_1, 9},
    {"q2_K", GGML_TYPE_Q2_K, GGML_TYPE_Q2_K, GGML_TYPE_Q6_K, 10},
    {"q3_K", GGML_TYPE_Q3_K, GGML_TYPE_Q3_K, GGML_TYPE_Q6_K, 11},
    {"q4_K", GGML_TYPE_Q4_K, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, 14},
    {"q5_K", GGML_TYPE_Q5_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, 16},
    {"q6_K", GGML_TYPE_Q6_K, GGML_TYPE_Q6_K, GGML_TYPE_Q6_K, 18},
    {"q4_K_M", GGML_TYPE_Q4_K, GGML_TYPE_Q6_K, GGML_TYPE_Q6_K, 15},
    {"q5_K_M", GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q6_K, 17},
    {"iq4_xs", GGML_TYPE_IQ4_XS, GGML_TYPE_IQ4_XS, GGML_TYPE_Q6_K, 30},
};

const struct model_quant_target *model_quant_target(const char *name)
{
    for (size_t i = 0; name && i < sizeof(targets) / sizeof(targets[0]); i++)
        if (!strcmp(name, targets[i].name))
            return &targets[i];
    return NULL;
}

static bool ends_with(const char *s, const char *tail)
{
    size_t n = strlen(s), k = strlen(tail);
    return n >= k && !strcmp(s + n - k, tail);
}

/* The layer of "blk.N.<...>", or -1. */
static int layer_of(const char *name)
{
    int l, used = 0;
    return sscanf(name, "blk.%d.%n", &l, &used) == 1 && used > 0 ? l : -1;
}

/* The mainstream recipe's layers that get more bits in attn_v / ffn_down. */
static bool more_bits(int l, int n_layer)
{
    return l < n_layer / 8 || l >= 7 * n_layer / 8 || (l - n_layer / 8) % 3 == 2;
}

/* The type the rule gives tensor t, before fallbacks; the source type when
 * the tensor is not a matrix to rewrite. */
static enum ggml_type rule(const struct model_quant_target *tg, const struct gguf_tensor *t,
                           int n_layer, bool tied)
{
    if (t->n_dims < 2 || !ends_with(t->name, ".weight") ||
        !strcmp(t->name, "blk.0.attn_rel_b.weight"))
        return t->type;
    if (!strcmp(t->name, "output.weight") || (tied && !strcmp(t->name, "token_embd.weight")))
        return tg->output;
    int l = layer_of(t->name);
    if (l >= 0 && strstr(t->name, ".attn_qkv."))
        return tg->more;
    if (l >= 0 && (strstr(t->name, ".attn_v.") || strstr(t->name, ".ffn_down.")) &&
        more_bits(l, n_layer))
        return tg->more;
    return tg->base;
}

/* The block format of 32 for a matrix that cannot take want's super-blocks
 * of 256 (see the head of this file), and why. */
static enum ggml_type fallback_32(enum ggml_type want, const char **why)
{
    switch (want) {
    case GGML_TYPE_Q4_K:
        *why = "rows are not a multiple of 256 elements: q5_0";
        return GGML_TYPE_Q5_0;
    case GGML_TYPE_Q5_K:
        *why = "rows are not a multiple of 256 elements: q5_1";
        return GGML_TYPE_Q5_1;
    case GGML_TYPE_Q6_K:
        *why = "rows are not a multiple of 256 elements: q8_0";
        return GGML_TYPE_Q8_0;
    default: /* q2_K, q3_K, iq4_xs */
        *why = "rows are not a multiple of 256 elements: q4_0";
        return GGML_TYPE_Q4_0;
    }
}

/* The type t can take instead of want, and why (NULL: want itself). */
static enum ggml_type fallback(const struct gguf_tensor *t, enum ggml_type want, const char **why)
{
    *why = NULL;
    if (want == t->type)
        return want;
    int blk = qt_block_elems(want);
    if (t->ne[0] % (uint64_t)blk == 0)
        return want;
    if (blk == 256 && t->ne[0] % 32 == 0)
        return fallback_32(want, why);
    *why = "rows are not a multiple of 32 elements: kept as they are";
    return t->type;
}

/* One tensor's conversion, shared by the threads; the first failure (the
 * lowest row among those that failed) is kept under `lock`. */
struct convert_job {
    const struct gguf_tensor *t;
    enum ggml_type to;
    uint8_t *dst;
    int n;
    size_t rb_in, rb_out;
    pthread_mutex_t lock;
    int failed;
    size_t bad_row;
};

static void convert_rows(void *arg, size_t r0, size_t r1, int t)
{
    (void)t;
    struct convert_job *j = arg;
    float *x = malloc(sizeof(float) * (size_t)j->n);
    for (size_t r = r0; r < r1; r++) {
        int rc =
            !x ? -ENOMEM
               : qt_dequantize_row(j->t->type, (const uint8_t *)j->t->data + r * j->rb_in, x, j->n);
        rc = rc ? rc : qt_quantize_row(j->to, x, j->dst + r * j->rb_out, j->n);
        if (rc) {
            pthread_mutex_lock(&j->lock);
            if (!j->failed || r < j->bad_row) {
                j->failed = rc;
                j->bad_row = r;
            }
            pthread_mutex_unlock(&j->lock);
            break; /* this thread's later rows cannot fail earlier */
        }
    }
    free(x);
}

/* Rewrite one tensor's rows (ne[0] elements each) from its type to `to`. */
static int convert(const struct gguf_tensor *t, enum ggml_type to, uint8_t *dst, int n_threads,
                   char *err, size_t errlen)
{
    int n = (int)t->ne[0];
    struct convert_job j = {.t = t,
                            .to = to,
                            .dst = dst,
                            .n = n,
                            .rb_in = qt_row_bytes(t->type, n),
                            .rb_out = qt_row_bytes(to, n),
                            .lock = PTHREAD_MUTEX_INITIALIZER};
    cpu_pool_for(cpu_pool_threads(n_threads), t->n_elements / t->ne[0], convert_rows, &j);
    pthread_mutex_destroy(&j.lock);
    int failed = j.failed;
    if (failed)
        snprintf(err, errlen, "tensor %s: row %zu cannot be written as %s (%s)", t->name, j.bad_row,
                 qt_type_name(to),
                 failed == -ERANGE   ? "a scale beyond f16"
                 : failed == -ENOMEM ? "out of memory"
                                     : "a value that is not finite");
    return failed ? (failed == -ENOMEM ? -ENOMEM : -EINVAL) : 0;
}

/* Every tensor of f into w, converted as the rule says. */
static int add_tensors(const struct model_quant_params *p, const gguf_file *f, gguf_writer *w,
                       struct model_quant_stats *st, char *err, size_t errlen)
{
    char key[160];
    const char *arch;
    size_t alen;
    int64_t n_layer = 0;
    if (!gguf_get_str(f, "general.architecture", &arch, &alen)) {
        snprintf(key, sizeof(key), "%.*s.block_count", (int)(alen > 64 ? 64 : alen), arch);
        gguf_get_i64(f, key, &n_layer);
    }
    bool tied = !gguf_find_tensor(f, "output.weight");
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        enum ggml_type want = rule(p->target, t, (int)n_layer, tied), to = want;
        const char *why = NULL;
        to = fallback(t, want, &why);
        if (to != t->type && t->ne[0] > (1u << 30)) {
            snprintf(err, errlen, "tensor %s: rows of %llu elements are too long", t->name,
                     (unsigned long long)t->ne[0]);
            return -EINVAL;
        }
        if (to != t->type && !qt_type_supported(t->type)) {
            snprintf(err, errlen, "tensor %s: type %s cannot be decoded by kvd", t->name,
                     gguf_ggml_type_name(t->type) ? gguf_ggml_type_name(t->type) : "unknown");
            return -EINVAL;
        }
        size_t size = to == t->type ? t->size : qt_row_bytes(to, (int)t->ne[0]) *
                                                    (size_t)(t->n_elements / t->ne[0]);
        uint8_t *buf = to == t->type ? NULL : malloc(size);
        if (to != t->type && !buf) {
            snprintf(err, errlen, "out of memory for tensor %s (%zu bytes)", t->name, size);
            return -ENOMEM;
        }
        int rc = buf ? convert(t, to, buf, p->n_threads, err, errlen) : 0;
        if (!rc && (rc = gguf_writer_add_tensor(w, t->name, to, t->n_dims, t->ne,
                                                buf ? buf : t->data, size)))
            snprintf(err, errlen, "tensor %s: the writer refused it (%d)", t->name, rc);
        free(buf);
        if (rc)
            return rc;
        st->tensors++;
        st->quantized += to != t->type;
        st->kept += to == t->type;
        st->fallbacks += why != NULL;
        st->bytes_in += t->size;
        st->bytes_out += size;
        if (p->report)
            p->report(p->report_ctx, t->name, t->type, to, why);
    }
    return 0;
}

int model_quantize(const struct model_quant_params *p, struct model_quant_stats *st, char *err,
                   size_t errlen)
{
    memset(st, 0, sizeof(*st));
    if (!p->in || !p->out || !p->target) {
        snprintf(err, errlen, "quantize needs an input, an output and a type");
        return -EINVAL;
    }
    char why[512];
    gguf_file *f = gguf_open(p->in, why, sizeof(why));
    if (!f) {
        snprintf(err, errlen, "%s", why);
        return -EINVAL;
    }
    gguf_writer *w = gguf_writer_create();
    int rc = w ? 0 : -ENOMEM;
    for (int64_t i = 0; !rc && i < gguf_n_kv(f); i++)
        if ((rc = gguf_writer_copy_kv(w, f, i)))
            snprintf(err, errlen, "%s: metadata key %s could not be copied (%d)", p->in,
                     gguf_kv_key(f, i), rc);
    if (!rc && (rc = gguf_writer_set_u32(w, "general.file_type", p->target->ftype)))
        snprintf(err, errlen, "out of memory");
    if (!rc && (rc = add_tensors(p, f, w, st, why, sizeof(why))))
        snprintf(err, errlen, "%s: %s", p->in, why);
    if (!rc)
        rc = gguf_writer_write(w, p->out, err, errlen);
    if (rc == -ENOMEM && !err[0])
        snprintf(err, errlen, "out of memory");
    gguf_writer_destroy(w);
    gguf_close(f);
    return rc;
}
