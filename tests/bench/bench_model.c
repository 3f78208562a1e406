/*
 * bench_model.c - prefill and decode throughput of the model runtime, and
 * decode as a fraction of the memory-bandwidth roofline.
 *
 * Decoding one token reads every weight once and every cached K/V entry
 * once per layer, so its speed limit is bandwidth / bytes per token. The
 * bandwidth is measured here, with the same two threads, by a STREAM-style
 * triad (a[i] = b[i] + s * c[i]; four arrays cross the bus counting the
 * write-allocate read) run right before each row's decode steps, so a
 * machine shared with other work is judged against what it offered then.
 * Each decode figure is printed beside that limit.
 *
 * Models: stories260K from ../shared (KVD_SHARED; skipped when absent) and
 * a kvd mkmodel model shaped like SmolLM-135M (dim 576, 30 layers, 9 heads,
 * 3 KV heads, ffn 1536, vocab 49152, tied embeddings) written at F32, F16
 * and Q8_0 into a temporary directory. Contexts 0, 4k and 16k: the cache is
 * filled with that many tokens of synthetic K/V (written, so the pages are
 * resident) before a prefill chunk and the decode steps are timed; a real
 * 16k prefill of the 135M model would take minutes on two cores.
 *
 * Architectures: the same SmolLM-like shape (dim 576, 30 layers, 9 heads,
 * 3 KV heads, f16) as llama with RoPE, llama with ALiBi, the T5-bias
 * decoder, bloom and mpt (GELU MLP of 2304 = as many weights as the SwiGLU
 * one of 1536), decoded at 4k context, each beside llama/RoPE's figure of
 * the same run. `bench_model arch` runs only this part.
 *
 * KV types: the SmolLM-like shape with q8_0 weights decoded at 4k, 16k, 64k
 * and 128k tokens of context with K/V in f16, q8_0, q8_0/q4_0 (K/V) and
 * q4_0, each beside the roofline for its own bytes (weights + the cache's
 * K/V bytes per token). The context is synthetic K/V written through
 * attn_store_row (quantised once, as the forward pass stores it), not a
 * real prefill: 128k real tokens would take hours on two cores. At 64k and
 * more the cache outweighs the weights, so decode should speed up roughly
 * with the bytes a type saves. `bench_model kv` runs only this part.
 */
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "model/mkmodel.h"
#include "model/model_internal.h"
#include "model/quant.h"
#include "model/requantize.h"
#include "tests/bench/bench_util.h"

#define THREADS 2

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/*
 * STREAM triad over 3 arrays of n floats with THREADS threads; best of 5. The
 * arrays must outsize the last-level cache (some hosts report hundreds of
 * MB) or the triad measures the cache. Returns the
 * bytes the memory bus moved per second: STREAM counts three arrays, but
 * the stored array is also read first (write-allocate), so four move.
 * *stream_bw gets STREAM's own count.
 */
static double triad_bandwidth(double *stream_bw, size_t n)
{
    double bus = 0.0;
    *stream_bw = bench_triad(THREADS, n, n, 5, &bus) * 1e9;
    return bus * 1e9;
}

/* Bytes one decode step reads from weights: every matrix once (the output
 * matrix too, the embedding's one row aside). */
static double weight_bytes(const model *m)
{
    double b = (double)m->output.row_bytes * m->output.n_out + m->tok_embd.row_bytes;
    for (int l = 0; l < m->n_layer; l++) {
        const struct model_layer *L = &m->layers[l];
        const struct mm_weight *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo,
                                        &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++)
            b += (double)ws[i]->row_bytes * ws[i]->n_out;
    }
    return b;
}

/*
 * Read one byte of every page of every weight: the first touch of a freshly
 * written, mmap'd file is slow on some systems (seconds for a few hundred
 * MB), and that is loading, not decoding.
 */
static unsigned touch_weights(const model *m)
{
    const struct mm_weight *ws[2 + 7 * 1024];
    int n = 0;
    ws[n++] = &m->tok_embd;
    ws[n++] = &m->output;
    for (int l = 0; l < m->n_layer && l < 1024; l++) {
        const struct model_layer *L = &m->layers[l];
        const struct mm_weight *lw[] = {&L->wq, &L->wk, &L->wv, &L->wo,
                                        &L->gate, &L->up, &L->down};
        for (int i = 0; i < 7; i++)
            if (lw[i]->data) /* gate: SwiGLU only */
                ws[n++] = lw[i];
    }
    unsigned sum = 0;
    for (int i = 0; i < n; i++) {
        const volatile uint8_t *p = ws[i]->data;
        size_t bytes = ws[i]->row_bytes * (size_t)ws[i]->n_out;
        for (size_t o = 0; o < bytes; o += 4096)
            sum += p[o];
    }
    return sum;
}

/* Append n tokens with synthetic K/V (small values, every byte written). */
static int fill_context(kv_seq *seq, const model *m, enum kv_type k_type, enum kv_type v_type,
                        int n)
{
    int32_t ids[256];
    float row[1024];
    uint32_t s = 12345;
    for (int done = 0; done < n;) {
        int k = n - done < 256 ? n - done : 256;
        for (int i = 0; i < k; i++)
            ids[i] = 3 + (int32_t)((done + i) % (m->n_vocab - 3));
        int first;
        int rc = kv_seq_append(seq, ids, k, &first);
        if (rc)
            return rc;
        for (int i = 0; i < k; i++)
            for (int l = 0; l < m->n_layer; l++)
                for (int h = 0; h < m->n_kv_head; h++)
                    for (int v = 0; v < 2; v++) {
                        for (int e = 0; e < m->head_dim; e++) {
                            s = s * 1664525u + 1013904223u;
                            row[e] = (float)((int)(s >> 20) - 2048) / 2048.0f;
                        }
                        void *dst = v ? kv_seq_v(seq, l, h, first + i)
                                      : kv_seq_k(seq, l, h, first + i);
                        enum kv_type t = v ? v_type : k_type;
                        if (t == KV_F16)
                            qt_f32_to_f16_row(row, dst, (size_t)m->head_dim);
                        else
                            attn_store_row(dst, row, m->head_dim, (enum attn_type)t);
                    }
        done += k;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

struct result {
    double prefill_tps, decode_tps, bytes_per_tok;
    double decode_best_tps; /* the fastest decode step */
    double bw; /* bus bytes/s of a triad run just before the decode steps */
};

/* Prefill a chunk then decode n_decode tokens on top of ctx cached tokens,
 * K and V stored in the given types. */
static int run_case_typed(const model *m, int ctx, int chunk, int n_decode, enum kv_type k_type,
                          enum kv_type v_type, struct result *r)
{
    int total = ctx + 2 * chunk + n_decode + 2;
    struct kv_cache_params cp = {.page_tokens = 16, .k_type = k_type, .v_type = v_type};
    model_kv_shape(m, &cp);
    size_t page = kv_cache_token_bytes(&cp) * 16;
    page = (page + 63) / 64 * 64;
    cp.memory_bytes = page * (size_t)(total / 16 + 4);
    char err[256];
    kv_cache *cache = kv_cache_create(&cp, err, sizeof(err));
    if (!cache) {
        fprintf(stderr, "cache: %s\n", err);
        return -1;
    }
    struct kv_policy pol = {.kind = KV_EVICT_NONE, .max_cache_tokens = total, .renumber = true};
    kv_seq *seq = kv_seq_create(cache, &pol, false, err, sizeof(err));
    model_ctx *mc = model_ctx_create(m, chunk, THREADS, err, sizeof(err));
    float *logits = malloc(sizeof(float) * (size_t)m->n_vocab);
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)chunk);
    int rc = -1;
    if (!seq || !mc || !logits || !toks) {
        fprintf(stderr, "setup: %s\n", err);
        goto out;
    }
    if (fill_context(seq, m, k_type, v_type, ctx)) {
        fprintf(stderr, "filling %d tokens of context failed\n", ctx);
        goto out;
    }
    for (int i = 0; i < chunk; i++)
        toks[i] = 3 + (i * 7919) % (m->n_vocab - 3);

    /* One token first: faults the weights in and starts the threads. */
    int32_t tok = 3;
    struct model_batch_seq b = {.seq = seq, .tokens = &tok, .n_tokens = 1, .logits = logits};
    if (model_reserve_forward(mc, &b, 1, NULL))
        goto out;
    /* Prefill: the better of two chunks in a row (the second sees chunk
     * more tokens of context, a small difference against ctx). */
    double best_prefill = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        double t0 = now_s();
        b = (struct model_batch_seq){.seq = seq, .tokens = toks, .n_tokens = chunk,
                                     .logits = logits};
        if (model_reserve_forward(mc, &b, 1, NULL))
            goto out;
        double t = now_s() - t0;
        best_prefill = t < best_prefill ? t : best_prefill;
    }
    /* The bandwidth now, in the same conditions as the decode steps. */
    double stream_bw;
    r->bw = triad_bandwidth(&stream_bw, (size_t)64 << 20);
    /* Decode steps, timed one by one; the median resists the other
     * processes of a shared machine. */
    double *dt = malloc(sizeof(double) * (size_t)n_decode);
    if (!dt)
        goto out;
    for (int i = 0; i < n_decode; i++) {
        tok = 3 + (int32_t)((tok * 31 + i) % (m->n_vocab - 3));
        /* (decode reads the cache as it grows; kv_avg below is the middle) */
        b = (struct model_batch_seq){.seq = seq, .tokens = &tok, .n_tokens = 1, .logits = logits};
        double ts = now_s();
        if (model_reserve_forward(mc, &b, 1, NULL)) {
            free(dt);
            goto out;
        }
        dt[i] = now_s() - ts;
    }
    qsort(dt, (size_t)n_decode, sizeof(double), cmp_double);
    double med = dt[n_decode / 2];
    r->decode_best_tps = 1.0 / dt[0];
    free(dt);
    int kv_avg = ctx + 2 * chunk + 1 + n_decode / 2; /* cached tokens read per decode step */
    r->prefill_tps = chunk / best_prefill;
    r->decode_tps = 1.0 / med;
    r->bytes_per_tok = weight_bytes(m) + (double)kv_avg * (double)kv_cache_token_bytes(&cp);
    rc = 0;
out:
    free(logits);
    free(toks);
    model_ctx_destroy(mc);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    return rc;
}

static int run_case(const model *m, int ctx, int chunk, int n_decode, struct result *r)
{
    return run_case_typed(m, ctx, chunk, n_decode, KV_F16, KV_F16, r);
}

static void bench_model(const char *label, const char *path)
{
    char err[512];
    struct model_params mp = {.path = path};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "%s: %s\n", label, err);
        return;
    }
    double t0 = now_s();
    unsigned sum = touch_weights(m);
    double t_touch = now_s() - t0;
    if (t_touch > 1.0)
        printf("  (%s: first touch of the weights took %.1f s%s)\n", label, t_touch,
               sum == 1 ? "" : "");
    static const int ctxs[] = {0, 4096, 16384};
    for (int i = 0; i < 3; i++) {
        int chunk = ctxs[i] >= 16384 ? 32 : 64;
        int n_decode = ctxs[i] >= 16384 ? 6 : 12;
        struct result r;
        if (run_case(m, ctxs[i], chunk, n_decode, &r)) {
            printf("%-22s %-5s %6d  (failed)\n", label, m->weight_type, ctxs[i]);
            continue;
        }
        double roof = r.bw / r.bytes_per_tok;
        printf("%-22s %-5s %6d %10.1f %10.1f %9.1f %7.1f %10.1f %7.0f%%\n", label,
               m->weight_type, ctxs[i], r.prefill_tps, r.decode_tps, r.bytes_per_tok / 1e6,
               r.bw / 1e9, roof, 100.0 * r.decode_tps / roof);
        fflush(stdout);
    }
    model_free(m);
}

/*
 * Decode (and prefill) at 4k context for every architecture and position
 * scheme, same shape and weight type, ratios to llama/RoPE of this run.
 * Four passes over all models, the best figure of each kept, so a burst
 * of other work on a shared machine does not land on one row alone.
 */
static void bench_arches(const char *dir)
{
    enum { NK = 5, PASSES = 4 };
    static const struct {
        const char *label, *arch, *position;
        int n_ff;
    } kinds[NK] = {
        {"llama rope", "llama", "rope", 1536},  {"llama alibi", "llama", "alibi", 1536},
        {"llama t5 (T5-bias)", "llama", "t5", 1536}, {"bloom (alibi)", "bloom", NULL, 2304},
        {"mpt (alibi)", "mpt", NULL, 2304},
    };
    model *ms[NK] = {0};
    char files[NK][600];
    for (int k = 0; k < NK; k++) {
        struct model_mk_params p;
        model_mk_defaults(&p);
        p.arch = kinds[k].arch;
        p.position = kinds[k].position;
        p.n_embd = 576;
        p.n_layer = 30;
        p.n_head = 9;
        p.n_kv_head = 3;
        p.n_ff = kinds[k].n_ff;
        p.n_vocab = 49152;
        p.tied = true;
        p.n_ctx_train = 8192;
        p.type = GGML_TYPE_F16;
        char err[512];
        snprintf(files[k], sizeof(files[k]), "%s/arch-%d.gguf", dir, k);
        if (model_mk_write(&p, files[k], err, sizeof(err))) {
            fprintf(stderr, "mkmodel %s: %s\n", kinds[k].label, err);
            continue;
        }
        struct model_params mp = {.path = files[k]};
        ms[k] = model_load(&mp, err, sizeof(err));
        if (!ms[k])
            fprintf(stderr, "%s: %s\n", kinds[k].label, err);
        else
            touch_weights(ms[k]);
    }
    struct result best[NK] = {0};
    for (int pass = 0; pass < PASSES; pass++) {
        for (int k = 0; k < NK; k++) {
            struct result r;
            if (!ms[k] || run_case(ms[k], 4096, 64, 12, &r))
                continue;
            if (r.decode_tps > best[k].decode_tps) {
                double pf = best[k].prefill_tps;
                best[k] = r;
                best[k].prefill_tps = pf;
            }
            if (r.prefill_tps > best[k].prefill_tps)
                best[k].prefill_tps = r.prefill_tps;
        }
    }
    printf("\narchitectures at 4096 tokens of context: dim 576, 30 layers, 9 heads, 3 KV heads, "
           "f16 weights, f16 KV; best of %d passes\n", PASSES);
    printf("%-20s %10s %10s %9s %7s %10s %8s %10s\n", "model", "prefill/s", "decode/s",
           "MB/token", "GB/s", "roof tok/s", "of roof", "vs rope");
    for (int k = 0; k < NK; k++) {
        const struct result *r = &best[k];
        if (!ms[k] || r->decode_tps <= 0.0) {
            printf("%-20s (failed)\n", kinds[k].label);
            continue;
        }
        double roof = r->bw / r->bytes_per_tok;
        printf("%-20s %10.1f %10.1f %9.1f %7.1f %10.1f %7.0f%% %9.2fx\n", kinds[k].label,
               r->prefill_tps, r->decode_tps, r->bytes_per_tok / 1e6, r->bw / 1e9, roof,
               100.0 * r->decode_tps / roof,
               best[0].decode_tps > 0.0 ? r->decode_tps / best[0].decode_tps : 0.0);
    }
    for (int k = 0; k < NK; k++) {
        model_free(ms[k]);
        unlink(files[k]);
    }
}

/* The SmolLM-135M shape (llama, RoPE) in the given weight type. */
static void smollm_shape(struct model_mk_params *p, enum ggml_type type)
{
    model_mk_defaults(p);
    p->n_embd = 576;
    p->n_layer = 30;
    p->n_head = 9;
    p->n_kv_head = 3;
    p->n_ff = 1536;
    p->n_vocab = 49152;
    p->tied = true;
    p->rope_theta = 10000.0f;
    p->n_ctx_train = 2048;
    p->type = type;
}

/*
 * The weight formats' products in a model, as `kvd quantize` writes them.
 * Decode at a short context is matrix-vector products over the weights, so
 * its bytes per token times tokens per second is the products' GB/s;
 * prefill (64-token chunks) is their matrix-matrix speed. One f16 model of
 * a Qwen3-0.6B-like layer shape (dim 1024, ff 3072, 16 heads, 8 KV heads:
 * rows of a multiple of 256, so every K type applies; 8 layers, vocab
 * 32000, tied) quantised with
 * model_quantize to q8_0, q4_K, q5_K and q6_K (the K targets write the
 * tied embedding/output matrix as q6_K, as the mainstream tool does). All
 * four are loaded first and then measured round-robin, best of KQ_ROUNDS
 * rounds each, so that a machine whose load changes meanwhile slows them
 * alike: the "vs q8_0" columns are the figures to read. Decode here is the
 * fastest step (of 16 per round), not the median: on a shared machine the
 * fastest step is the one the other processes disturbed least.
 */
#define KQ_ROUNDS 3
static void bench_kquants(const char *dir)
{
    static const char *names[] = {"q8_0", "q4_K", "q5_K", "q6_K"};
    enum { NK = 4 };
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.arch = "qwen3";
    p.n_embd = 1024;
    p.n_layer = 8;
    p.n_head = 16;
    p.n_kv_head = 8;
    p.head_dim = 128;
    p.n_ff = 3072;
    p.n_vocab = 32000;
    p.tied = true;
    p.type = GGML_TYPE_F16;
    char src[600], file[NK][600], err[512];
    snprintf(src, sizeof(src), "%s/kq-f16.gguf", dir);
    if (model_mk_write(&p, src, err, sizeof(err))) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return;
    }
    model *m[NK] = {NULL};
    for (int i = 0; i < NK; i++) {
        snprintf(file[i], sizeof(file[i]), "%s/kq-%s.gguf", dir, names[i]);
        struct model_quant_params qp = {
            .in = src, .out = file[i], .target = model_quant_target(names[i]), .n_threads = THREADS};
        struct model_quant_stats st;
        struct model_params mp = {.path = file[i]};
        if (model_quantize(&qp, &st, err, sizeof(err)) || !(m[i] = model_load(&mp, err, sizeof(err))))
            fprintf(stderr, "%s: %s\n", names[i], err);
        else
            touch_weights(m[i]);
    }
    unlink(src);
    char load0[64], load1[64];
    bench_load_average(load0, sizeof(load0));
    struct result best[NK];
    memset(best, 0, sizeof(best));
    for (int round = 0; round < KQ_ROUNDS; round++)
        for (int i = 0; i < NK; i++) {
            struct result r;
            if (!m[i] || run_case(m[i], 0, 64, 16, &r))
                continue;
            if (r.decode_best_tps > best[i].decode_tps) {
                best[i].decode_tps = r.decode_best_tps;
                best[i].bytes_per_tok = r.bytes_per_tok;
            }
            best[i].prefill_tps = fmax(best[i].prefill_tps, r.prefill_tps);
        }
    bench_load_average(load1, sizeof(load1));

    printf("\nweight formats (kvd quantize of one f16 model): qwen3-0.6B layer shape, 8 layers, "
           "vocab 32000 tied (q6_K for the K targets), ctx 0, KV f16, K kernels %s; best of %d "
           "rounds, round-robin, decode = fastest step; load average %s before, %s after\n"
           "%-6s %10s %10s %9s %12s %9s %9s\n",
           mm_k_kernel_name(), KQ_ROUNDS, load0, load1, "type", "prefill/s", "decode/s",
           "MB/token", "decode GB/s", "vs q8_0", "tok/s vs");
    for (int i = 0; i < NK; i++) {
        if (!m[i] || best[i].decode_tps <= 0) {
            printf("%-6s (failed)\n", names[i]);
        } else {
            double gbs = best[i].decode_tps * best[i].bytes_per_tok / 1e9;
            double gbs0 = best[0].decode_tps * best[0].bytes_per_tok / 1e9;
            printf("%-6s %10.1f %10.1f %9.1f %12.2f %8.2fx %8.2fx\n", names[i],
                   best[i].prefill_tps, best[i].decode_tps, best[i].bytes_per_tok / 1e6, gbs,
                   gbs0 > 0 ? gbs / gbs0 : 0,
                   best[0].decode_tps > 0 ? best[i].decode_tps / best[0].decode_tps : 0);
        }
        fflush(stdout);
        model_free(m[i]);
        unlink(file[i]);
    }
}

/*
 * Decode at 4k..128k of context for each KV type on the SmolLM-like shape
 * (q8_0 weights), beside each type's own roofline. Long contexts take
 * fewer decode steps (each reads gigabytes) and a short prefill chunk.
 */
static void bench_kv_types(const char *dir)
{
    struct model_mk_params p;
    smollm_shape(&p, GGML_TYPE_Q8_0);
    char file[600], err[512];
    snprintf(file, sizeof(file), "%s/smollm-shape-kv.gguf", dir);
    if (model_mk_write(&p, file, err, sizeof(err))) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return;
    }
    struct model_params mp = {.path = file};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "kv types: %s\n", err);
        unlink(file);
        return;
    }
    touch_weights(m);
    static const struct {
        enum kv_type k, v;
        const char *name;
    } types[] = {{KV_F16, KV_F16, "f16"},
                 {KV_Q8_0, KV_Q8_0, "q8_0"},
                 {KV_Q8_0, KV_Q4_0, "q8_0/q4_0"},
                 {KV_Q4_0, KV_Q4_0, "q4_0"}};
    static const int ctxs[] = {4096, 16384, 65536, 131072};
    printf("\nKV types: smollm135M-shape, q8_0 weights (%.1f MB), K/V bytes per token in "
           "parentheses;\ncontext is synthetic K/V stored as the forward pass stores it; decode is "
           "the fastest of 6 steps (4 at 64k and more): on a shared machine the others wait on "
           "other work\n",
           weight_bytes(m) / 1e6);
    printf("%-22s %7s %10s %9s %7s %10s %8s %9s\n", "K/V type", "ctx", "decode/s", "MB/token",
           "GB/s", "roof tok/s", "of roof", "vs f16");
    for (int c = 0; c < 4; c++) {
        double f16_tps = 0.0;
        for (int t = 0; t < 4; t++) {
            struct kv_cache_params cp = {.k_type = types[t].k, .v_type = types[t].v};
            model_kv_shape(m, &cp);
            char label[48];
            snprintf(label, sizeof(label), "%s (%zu B)", types[t].name, kv_cache_token_bytes(&cp));
            struct result r;
            int n_decode = ctxs[c] >= 65536 ? 4 : 6;
            if (run_case_typed(m, ctxs[c], 8, n_decode, types[t].k, types[t].v, &r)) {
                printf("%-22s %7d  (failed)\n", label, ctxs[c]);
                continue;
            }
            if (t == 0)
                f16_tps = r.decode_best_tps;
            double roof = r.bw / r.bytes_per_tok;
            printf("%-22s %7d %10.2f %9.1f %7.1f %10.2f %7.0f%% %8.2fx\n", label, ctxs[c],
                   r.decode_best_tps, r.bytes_per_tok / 1e6, r.bw / 1e9, roof,
                   100.0 * r.decode_best_tps / roof,
                   f16_tps > 0 ? r.decode_best_tps / f16_tps : 0.0);
            fflush(stdout);
        }
    }
    model_free(m);
    unlink(file);
}

int main(int argc, char **argv)
{
    /* The OpenMP wait policy is the environment's, as for kvd itself:
     * libgomp's default spins, the fastest on an idle machine; on one busy
     * with other work OMP_WAIT_POLICY=passive keeps barriers from waiting
     * on descheduled spinners. Printed with the results. */
    bool arch_only = argc > 1 && !strcmp(argv[1], "arch");
    bool kv_only = argc > 1 && !strcmp(argv[1], "kv");
    bool kq_only = argc > 1 && !strcmp(argv[1], "kquant");
    double t_start = now_s();
    double stream_bw = 0.0;
    double bw = triad_bandwidth(&stream_bw, (size_t)64 << 20);
    printf("model runtime: %d threads, matmul %s, attention %s, OMP_WAIT_POLICY=%s\n", THREADS,
           mm_kernel_name(), attn_simd_name(),
           getenv("OMP_WAIT_POLICY") ? getenv("OMP_WAIT_POLICY") : "(unset)");
    printf("STREAM triad (%d threads, 3 x 256 MiB): %.2f GB/s as STREAM counts it, %.2f GB/s "
           "moved with write-allocate\n",
           THREADS, stream_bw / 1e9, bw / 1e9);
    printf("roof = triad bus bandwidth measured just before each row's decode steps (GB/s "
           "column) / bytes read per token (weights + K/V);\n"
           "a model that fits in the last-level cache (stories260K) can pass its DRAM roof\n");
    printf("contexts are synthetic K/V (f16 KV); prefill: best of 2 chunks of 64 tokens (32 at 16k); decode "
           "is the median step\n\n");

    const char *t = getenv("TMPDIR");
    char dir[512];
    snprintf(dir, sizeof(dir), "%s/kvd-bench-model-XXXXXX", t && *t ? t : "/tmp");
    if (!mkdtemp(dir)) {
        fprintf(stderr, "mkdtemp: %s\n", strerror(errno));
        return 1;
    }
    if (arch_only || kv_only || kq_only) {
        if (arch_only)
            bench_arches(dir);
        else if (kv_only)
            bench_kv_types(dir);
        else
            bench_kquants(dir);
        rmdir(dir);
        return 0;
    }
    printf("%-22s %-5s %6s %10s %10s %9s %7s %10s %8s\n", "model", "type", "ctx", "prefill/s",
           "decode/s", "MB/token", "GB/s", "roof tok/s", "of roof");

    const char *sh = getenv("KVD_SHARED");
    char path[1024];
    snprintf(path, sizeof(path), "%s/models/stories260K.gguf", sh && *sh ? sh : "../shared");
    if (access(path, R_OK) == 0)
        bench_model("stories260K", path);
    else
        printf("stories260K: skipped (%s not found; set KVD_SHARED)\n", path);

    static const struct {
        enum ggml_type type;
        const char *name;
    } types[] = {{GGML_TYPE_F32, "f32"}, {GGML_TYPE_F16, "f16"}, {GGML_TYPE_Q8_0, "q8_0"}};
    for (int i = 0; i < 3; i++) {
        struct model_mk_params p;
        smollm_shape(&p, types[i].type);
        char file[600], err[512];
        snprintf(file, sizeof(file), "%s/smollm-shape-%s.gguf", dir, types[i].name);
        double g0 = now_s();
        if (model_mk_write(&p, file, err, sizeof(err))) {
            fprintf(stderr, "mkmodel: %s\n", err);
            continue;
        }
        double g1 = now_s();
        char label[64];
        snprintf(label, sizeof(label), "smollm135M-shape (%.0fs)", g1 - g0);
        bench_model(label, file);
        unlink(file);
    }
    bench_arches(dir);
    bench_kv_types(dir);
    bench_kquants(dir);
    rmdir(dir);
    printf("\n(mkmodel write time in parentheses; total %.0f s)\n", now_s() - t_start);
    return 0;
}
