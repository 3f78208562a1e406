/*
 * bench_table.c - `make bench`'s table: how fast whole kvd binaries decode
 * and prefill on the SmolLM-135M shape at 512, 4k, 16k and 64k tokens of
 * context, each row beside the roofline it could reach.
 *
 * What a cell is. One `kvd generate` run: a real prompt of P tokens (text
 * the binary tokenizes and prefills in --batch chunks, as it would a
 * user's), then N greedy tokens. Its "prefill:" line gives prefill tokens/s
 * over the whole prompt, its "decode:" line decode tokens/s at contexts P
 * to P+N. Up to 16k the K/V a decode row reads is the one its own prefill
 * wrote. Above 16k (the 64k rows; --fill-above moves the line, --real
 * removes it) a row is a "fill" row: a real 4k-token prompt is read, then
 * `kvd generate --fill P` copies its K/V rows, repeating, into new slots
 * until the cache holds P tokens, and decoding starts there. Decode reads
 * P tokens of K/V either way, the same number of bytes from as many
 * distinct pages, and its time depends on that, not on the values; so its
 * speed is the row's, while a real 64k prefill (tens of minutes here,
 * attention growing with the square of the prompt) would only make the
 * row unaffordable. Fill rows print "fill" for prefill: not measured.
 * Driving the binary rather than linking
 * the library is what lets one run compare two builds (--before OLD): each
 * row runs both binaries back to back, their order alternating from row to
 * row, so a change in the machine's load falls on both alike, and the
 * table prints both columns and their ratio.
 *
 * Rooflines, measured in the same run:
 *  - Decode is memory-bound: each token reads every weight once and the K/V
 *    of every position. Roofline = bus bandwidth / (weight bytes read per
 *    token + K/V bytes at the decode's mean context). Weight bytes come
 *    from the GGUF (every tensor, the tied embedding read in full as the
 *    output matrix; with a separate output matrix the embedding is one
 *    row). The bandwidth is bench_util.h's triad on the same threads,
 *    measured just before and just after the row's runs (the better of
 *    the two: a neighbour's burst lowers a triad, nothing raises it),
 *    counting the write-allocate read: the ceiling of a read-only stream.
 *  - Prefill is compute-bound. Operations per token = 2 x the weights'
 *    multiply-adds (the output matrix once per prompt: only the last
 *    token's logits are computed) + attention's 4 x heads x head_dim x
 *    layers x mean keys (QK and PV; causal, so (P+1)/2 keys on average).
 *    Roofline = 1 / (weight ops / weight peak + attention ops / f32 FMA
 *    peak), the peaks bench_peak.h's, per core, times the threads. The
 *    weight peak is vpdpbusd's for q8_0 (vpmaddubsw + vpmaddwd's on a CPU
 *    without AVX-512 VNNI, and the FMA's at 256 bits without AVX-512),
 *    vdpbf16ps's for bf16 where the CPU
 *    has it and kvd takes the pairs (tdpbf16ps's where it has AMX's bf16
 *    tiles, which then run the pairs), and the f32 FMA's for f32 and f16
 *    (the yardstick the issue sets them). An "f16-bf16" row is the f16
 *    model run with KVD_F16=bf16 in the binary's environment: its weights
 *    are rounded to bf16 at load and multiplied in pairs, so that
 *    instruction's peak is its yardstick (a binary
 *    whose kernels line does not say so gets a note); the other rows run
 *    with KVD_F16 taken out of the environment. The norms, rotations and SwiGLU are left out: they are
 *    work a real forward must do, so 100% is out of reach by a few points.
 *
 * Time. A 16k prompt takes one to three minutes per weight type and
 * binary, a 64k fill row about what its 4k prompt takes plus the decode:
 * by default every type runs at 512 and 4k and q8_0 (the fastest) also at
 * 16k; --full runs the whole grid, --ctx
 * chooses contexts for every type. Rows not run are listed under the table
 * with the option that runs them. The models are written once into
 * --models (kvd mkmodel's seeded weights) and reused.
 *
 * The machine: its CPU, kvd's kernel level (the library's, and each
 * binary's own "kernels" line), the threads, the load average at the start
 * and beside each row. Nothing here asserts a time: the table is read by
 * people; test_bench_table checks only that it is well formed.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache/kv_cache.h"
#include "cpu/cpu.h"
#include "model/gguf.h"
#include "model/mkmodel.h"
#include "model/model.h"
#include "model/quant.h"
#include "tests/bench/bench_peak.h"
#include "tests/bench/bench_util.h"

extern char **environ;

#define MAX_TYPES 5
#define MAX_CTX 8
#define MAX_KV 2
#define MAX_BINS 2
#define MAX_ROWS (MAX_TYPES * MAX_CTX * MAX_KV)
/* One argument's limit on Linux (MAX_ARG_STRLEN): the prompt is one. */
#define ARG_LIMIT (32 * 4096 - 1)

/* The model shape the table measures, written by mkmodel's writer. */
struct shape {
    const char *name;
    int n_embd, n_layer, n_head, n_kv_head, n_ff, n_vocab, n_ctx_train;
    int grid[4];  /* the table's contexts */
    int quick[4]; /* run by default for every type (0 ends) */
    int n_gen;    /* decoded tokens per cell */
    int fill_above, fill_prompt; /* contexts above fill_above: a real prompt of fill_prompt
                                    tokens, its K/V repeated to the context (--fill) */
};

static const struct shape SMOLLM = {"576x30 (SmolLM-135M)", 576, 30, 9, 3, 1536, 49152, 131072,
                                    {512, 4096, 16384, 65536}, {512, 4096}, 32, 16384, 4096};
/* The smoke test's: seconds for the whole table (head_dim 32: q8_0 K/V's
 * block, so its rows run too). */
static const struct shape TINY = {"64x2 (tiny)", 64, 2, 2, 1, 128, 512, 4096,
                                  {64, 256, 1024, 2048}, {64, 256}, 8, 1024, 256};

/* A row's weights: the file's type, and for f16 whether the binary is
 * asked to round them to bf16 at load (KVD_F16=bf16: the "f16-bf16" rows,
 * held to the vdpbf16ps peak). */
struct wtype {
    enum ggml_type file;
    bool f16_bf16;
};

struct opts {
    const char *bins[MAX_BINS]; /* [0] before (if n_bins == 2), last: the binary measured */
    const char *labels[MAX_BINS];
    int n_bins;
    struct wtype types[MAX_TYPES];
    int n_types;
    int ctx[MAX_CTX]; /* --ctx: these for every type; 0 entries = the default plan */
    int n_ctx;
    enum kv_type kv[MAX_KV];
    int n_kv;
    bool full;
    int fill_above; /* contexts above this are filled (kvd generate --fill); -1: none */
    int rounds, threads, batch, n_gen;
    const char *models;
    const struct shape *shape;
};

/* One binary's result in one cell. */
struct run {
    bool ok;
    double prefill_tps, decode_tps, cores;
    int prompt_tokens, gen_tokens;
    char note[160];
};

struct row {
    int ti; /* its weights: opts.types[ti] */
    enum kv_type kv;
    int ctx;
    bool run;
    bool fill; /* a real prompt of shape.fill_prompt tokens, then --fill ctx */
    double bus_gbs, decode_roof, prefill_roof;
    char load[24];
    struct run best[MAX_BINS];
};

/* What the rooflines need from a model file. */
struct model_cost {
    char path[512];
    double weight_bytes; /* read per decoded token */
    double layer_macs;   /* multiply-adds per token in the blocks */
    double output_macs;  /* the output matrix's, once per prompt */
};

static struct {
    double int8, fma, bf16, amx; /* per core, GOPS (amx: tdpbf16ps) */
    char kernels[MAX_BINS][MAX_TYPES][MODEL_KERNELS_LINE], weights[MAX_BINS][MAX_TYPES][256];
} g;

static void die(const char *fmt, const char *arg)
{
    fprintf(stderr, "bench_table: ");
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n");
    exit(2);
}

static const char *ctx_name(int ctx, char *buf, size_t len)
{
    if (ctx >= 1024 && ctx % 1024 == 0)
        snprintf(buf, len, "%dk", ctx / 1024);
    else
        snprintf(buf, len, "%d", ctx);
    return buf;
}

/* The table's name for a row's weights: the GGUF type, or "f16-bf16". */
static const char *wname(const struct wtype *w)
{
    return w->f16_bf16 ? "f16-bf16" : gguf_ggml_type_name(w->file);
}

/* ------------------------------------------------------------------------
 * Options
 * ------------------------------------------------------------------------ */

static void usage(FILE *f)
{
    fprintf(f,
            "usage: bench_table --kvd KVD [--before KVD] [options]\n"
            "  --kvd KVD        the kvd binary measured (the \"after\" column)\n"
            "  --before KVD     a second binary, run alternately with the first: both columns\n"
            "                   and their ratio\n"
            "  --types LIST     weight types, of f32,f16,f16-bf16,q8_0,bf16 (default all\n"
            "                   five); f16-bf16 = the f16 model run with KVD_F16=bf16 (its\n"
            "                   weights rounded to bf16 at load, the vdpbf16ps peak)\n"
            "  --ctx LIST       contexts run for every type, e.g. 512,4k,16k (default: 512 and\n"
            "                   4k for every type, 16k for q8_0)\n"
            "  --full           the whole grid: 512, 4k, 16k and 64k for every type\n"
            "  --kv LIST        K/V types, of f16,q8_0 (default f16)\n"
            "  --fill-above CTX contexts above CTX (default 16k) decode after a fill: a real\n"
            "                   4k-token prompt, its K/V repeated to the context by `kvd\n"
            "                   generate --fill` (decode reads the whole context; prefill is\n"
            "                   not measured there)\n"
            "  --real           no fill: a real prompt at every context (64k: tens of minutes)\n"
            "  --rounds N       runs per binary and cell, the best kept (default 1)\n"
            "  --threads N      (default 2)\n"
            "  --batch N        prefill chunk (default 512)\n"
            "  -n N             decoded tokens per cell (default 32)\n"
            "  --models DIR     where the models are written once and reused (default\n"
            "                   build/bench/models)\n"
            "  --tiny           a 64x2 model and contexts of 64 to 2k: the smoke test's\n");
}

static int parse_ctx(const char *s)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*end == 'k' || *end == 'K') {
        v *= 1024;
        end++;
    }
    if (end == s || *end || v < 16 || v > (1 << 20))
        die("a context wants 16..1048576 tokens, e.g. 512 or 16k; got '%s'", s);
    return (int)v;
}

/* Split a comma list into at most max items, each given to parse(). */
static int parse_list(const char *list, int max, void (*parse)(const char *, void *, int),
                      void *out)
{
    char buf[256];
    snprintf(buf, sizeof buf, "%s", list);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == max)
            die("too many items in '%s'", list);
        parse(t, out, n++);
    }
    if (n == 0)
        die("an empty list: '%s'", list);
    return n;
}

static void parse_type_item(const char *s, void *out, int i)
{
    struct wtype w = {.f16_bf16 = !strcmp(s, "f16-bf16")};
    if (w.f16_bf16)
        w.file = GGML_TYPE_F16;
    else if (model_mk_parse_type(s, &w.file) ||
             (w.file != GGML_TYPE_F32 && w.file != GGML_TYPE_F16 && w.file != GGML_TYPE_Q8_0 &&
              w.file != GGML_TYPE_BF16))
        die("--types wants f32, f16, f16-bf16, q8_0 or bf16; got '%s'", s);
    for (int k = 0; k < i; k++)
        if (!memcmp(&((struct wtype *)out)[k], &w, sizeof w))
            die("--types names '%s' twice", s);
    ((struct wtype *)out)[i] = w;
}

static void parse_ctx_item(const char *s, void *out, int i)
{
    ((int *)out)[i] = parse_ctx(s);
}

static void parse_kv_item(const char *s, void *out, int i)
{
    enum kv_type t;
    if (kv_type_parse(s, &t) || (t != KV_F16 && t != KV_Q8_0))
        die("--kv wants f16 or q8_0; got '%s'", s);
    ((enum kv_type *)out)[i] = t;
}

static int parse_int(const char *s, int min, int max)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < min || v > max)
        die("a number out of range: '%s'", s);
    return (int)v;
}

static void parse_opts(int argc, char **argv, struct opts *o)
{
    *o = (struct opts){.rounds = 1, .threads = 2, .batch = 512, .shape = &SMOLLM,
                       .models = "build/bench/models"};
    const char *kvd = NULL, *before = NULL;
    int n_gen = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        bool takes = strcmp(a, "--full") && strcmp(a, "--tiny") && strcmp(a, "--help") &&
                     strcmp(a, "--real");
        if (takes && !v)
            die("%s wants a value", a);
        if (!strcmp(a, "--kvd"))
            kvd = v;
        else if (!strcmp(a, "--before"))
            before = v;
        else if (!strcmp(a, "--types"))
            o->n_types = parse_list(v, MAX_TYPES, parse_type_item, o->types);
        else if (!strcmp(a, "--ctx"))
            o->n_ctx = parse_list(v, MAX_CTX, parse_ctx_item, o->ctx);
        else if (!strcmp(a, "--kv"))
            o->n_kv = parse_list(v, MAX_KV, parse_kv_item, o->kv);
        else if (!strcmp(a, "--rounds"))
            o->rounds = parse_int(v, 1, 100);
        else if (!strcmp(a, "--threads"))
            o->threads = parse_int(v, 1, 1024);
        else if (!strcmp(a, "--batch"))
            o->batch = parse_int(v, 1, 65536);
        else if (!strcmp(a, "-n"))
            n_gen = parse_int(v, 2, 4096);
        else if (!strcmp(a, "--models"))
            o->models = v;
        else if (!strcmp(a, "--fill-above"))
            o->fill_above = parse_ctx(v);
        else if (!strcmp(a, "--real"))
            o->fill_above = -1;
        else if (!strcmp(a, "--full"))
            o->full = true;
        else if (!strcmp(a, "--tiny"))
            o->shape = &TINY;
        else if (!strcmp(a, "--help")) {
            usage(stdout);
            exit(0);
        } else {
            usage(stderr);
            die("unknown option '%s'", a);
        }
        i += takes;
    }
    if (!kvd)
        die("%s", "--kvd KVD is required");
    if (before) {
        o->bins[o->n_bins] = before;
        o->labels[o->n_bins++] = "before";
    }
    o->bins[o->n_bins] = kvd;
    o->labels[o->n_bins++] = before ? "after" : "kvd";
    if (!o->n_types) {
        const struct wtype all[5] = {{GGML_TYPE_F32, false}, {GGML_TYPE_F16, false},
                                     {GGML_TYPE_F16, true},  {GGML_TYPE_Q8_0, false},
                                     {GGML_TYPE_BF16, false}};
        memcpy(o->types, all, sizeof all);
        o->n_types = 5;
    }
    if (!o->n_kv)
        o->kv[o->n_kv++] = KV_F16;
    o->n_gen = n_gen ? n_gen : o->shape->n_gen;
    if (!o->fill_above)
        o->fill_above = o->shape->fill_above;
}

/* ------------------------------------------------------------------------
 * The machine
 * ------------------------------------------------------------------------ */

static void cpu_model_name(char *buf, size_t len)
{
    snprintf(buf, len, "unknown CPU");
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512];
    while (f && fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10))
            continue;
        char *c = strchr(line, ':');
        if (c) {
            c += 1 + (c[1] == ' ');
            c[strcspn(c, "\n")] = '\0';
            snprintf(buf, len, "%s", c);
        }
        break;
    }
    if (f)
        fclose(f);
}

static void print_machine(const struct opts *o)
{
    char cpu[256], lvl[256], load[32];
    struct utsname u;
    cpu_model_name(cpu, sizeof cpu);
    bench_load_average(load, sizeof load);
    uname(&u);
    printf("machine: %s, %ld CPUs online, Linux %s; kvd kernels (this library) %s\n", cpu,
           sysconf(_SC_NPROCESSORS_ONLN), u.release, cpu_describe(lvl, sizeof lvl));
    printf("threads %d, prefill chunk %d, %d decoded tokens per cell, %d round%s; load average "
           "at the start %s\n",
           o->threads, o->batch, o->n_gen, o->rounds, o->rounds > 1 ? "s (best kept)" : "", load);
}

/* The peaks, per core: best of 5 each. */
static void measure_peaks(void)
{
    for (int i = 0; i < 5; i++) {
        g.int8 = fmax(g.int8, bench_peak_int8());
        g.fma = fmax(g.fma, bench_peak_fma());
        g.bf16 = fmax(g.bf16, bench_peak_bf16());
        if (cpu_amx_supported()) /* and the tile permission with it */
            g.amx = fmax(g.amx, bench_peak_amx_bf16());
    }
    char v[32] = "not measured (no AVX2)", f[32] = "not measured (no AVX2 FMA)",
         b[32] = "not measured (no AVX-512 BF16)", a[32] = "not measured (no AMX-BF16)";
    if (g.int8 > 0)
        snprintf(v, sizeof v, "%.0f GOPS", g.int8);
    if (g.fma > 0)
        snprintf(f, sizeof f, "%.0f GFLOPS", g.fma);
    if (g.bf16 > 0)
        snprintf(b, sizeof b, "%.0f GFLOPS", g.bf16);
    if (g.amx > 0)
        snprintf(a, sizeof a, "%.0f GFLOPS", g.amx);
    printf("peaks of one core, measured now (bench_peak.h): %s %s, %s %s, "
           "vdpbf16ps %s, tdpbf16ps %s\n",
           bench_peak_int8_name(), v, bench_peak_fma_name(), f, b, a);
}

/* Whether a row's weight products run as bf16 pairs: f16 weights rounded
 * to bf16 (KVD_F16=bf16), or bf16 ones where kvd takes the pairs by
 * default (mm_bf16_in_pairs: the library's own rule, KVD_BF16 being taken
 * out of every run's environment), on a CPU with vdpbf16ps. */
static bool bf16_products(const struct wtype *w)
{
    return (w->f16_bf16 || (w->file == GGML_TYPE_BF16 && mm_bf16_in_pairs())) && g.bf16 > 0;
}

/* The peak a row's weight products are held to (per core), or 0: bf16
 * pairs run on AMX's tiles where the CPU has them (model/matmul_amx.c). */
static double weight_peak(const struct wtype *w)
{
    if (w->file == GGML_TYPE_Q8_0)
        return g.int8;
    if (bf16_products(w))
        return g.amx > 0 ? g.amx : g.bf16;
    return g.fma;
}

static const char *weight_peak_name(const struct wtype *w)
{
    if (w->file == GGML_TYPE_Q8_0)
        return bench_peak_int8_name();
    if (bf16_products(w))
        return g.amx > 0 ? "tdpbf16ps" : "vdpbf16ps";
    return bench_peak_fma_name();
}

/* ------------------------------------------------------------------------
 * Models and their cost
 * ------------------------------------------------------------------------ */

static void make_dirs(const char *path)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(buf, 0755);
            *p = '/';
        }
    if (mkdir(buf, 0755) && errno != EEXIST)
        die("cannot create %s", path);
}

/* The model of type t, written first if absent. */
static void model_file(const struct opts *o, enum ggml_type t, char *path, size_t len)
{
    const struct shape *s = o->shape;
    snprintf(path, len, "%s/%dx%d_%s.gguf", o->models, s->n_embd, s->n_layer,
             gguf_ggml_type_name(t));
    struct stat st;
    if (stat(path, &st) == 0)
        return;
    make_dirs(o->models);
    struct model_mk_params p;
    model_mk_defaults(&p);
    p.n_embd = s->n_embd;
    p.n_layer = s->n_layer;
    p.n_head = s->n_head;
    p.n_kv_head = s->n_kv_head;
    p.n_ff = s->n_ff;
    p.n_vocab = s->n_vocab;
    p.n_ctx_train = s->n_ctx_train;
    p.tied = true;
    p.type = t;
    char err[512], tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    double t0 = bench_now();
    if (model_mk_write(&p, tmp, err, sizeof err) || rename(tmp, path))
        die("writing the model: %s", err);
    fprintf(stderr, "bench_table: wrote %s in %.1f s\n", path, bench_now() - t0);
}

/* Weight bytes per decoded token and multiply-adds, from the file. */
static void model_cost_of(const char *path, struct model_cost *c)
{
    char err[512];
    gguf_file *f = gguf_open(path, err, sizeof err);
    if (!f)
        die("%s", err);
    memset(c, 0, sizeof *c);
    snprintf(c->path, sizeof c->path, "%s", path);
    const struct gguf_tensor *out = gguf_find_tensor(f, "output.weight");
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(f, i);
        bool embd = !strcmp(t->name, "token_embd.weight");
        if (embd && out) /* separate output matrix: one embedding row per token */
            c->weight_bytes += (double)t->size / (double)t->ne[1];
        else
            c->weight_bytes += (double)t->size;
        if (t->n_dims < 2)
            continue;
        double macs = (double)t->ne[0] * (double)t->ne[1];
        if (!strncmp(t->name, "blk.", 4))
            c->layer_macs += macs;
        else if (t == out || (embd && !out))
            c->output_macs = macs;
    }
    gguf_close(f);
}

/* ------------------------------------------------------------------------
 * Prompts: text of exactly the wanted tokens (with BOS)
 * ------------------------------------------------------------------------ */

/* Words the model's vocabulary holds as pieces, each followed by a number
 * (digits are pieces of their own): about 1.4 bytes per token, so a 64k
 * prompt still fits in one argument. The order comes from a fixed
 * generator and does not repeat with a short period. */
static const char *const WORDS[] = {"the", "cat", "sat", "on", "mat", "and", "a",   "dog",
                                    "ran", "to",  "park", "in", "sun", "with", "it", "was",
                                    "of",  "red", "big",  "old", "man", "saw", "we", "go"};

static size_t text_of(int n_words, char *buf, size_t cap)
{
    size_t len = 0;
    uint64_t st = 12345;
    for (int w = 0; w < n_words; w++) {
        st = st * 6364136223846793005ull + 1442695040888963407ull;
        const char *word = WORDS[(st >> 33) % (sizeof WORDS / sizeof *WORDS)];
        int k = snprintf(buf + len, cap - len, "%s%s %u", w ? " " : "", word,
                         (unsigned)(st >> 40) % 900000u + 100000u);
        if (k < 0 || (size_t)k >= cap - len)
            return 0;
        len += (size_t)k;
    }
    return len;
}

/* The longest text of whole word-number pairs that tokenizes to at most ctx tokens
 * (BOS included), or NULL if it would not fit in one argument. */
static char *prompt_for(const model *tok, int ctx, int *n_tokens)
{
    size_t cap = (size_t)ctx * 16 + 64;
    char *buf = malloc(cap);
    if (!buf)
        die("%s", "out of memory");
    int lo = 1, hi = ctx, best = 1; /* words; a word is at least one token */
    while (lo <= hi) {
        int mid = lo + (hi - lo) / 2;
        size_t len = text_of(mid, buf, cap);
        int n = model_tokenize(tok, buf, len, model_add_bos(tok), NULL, 0);
        if (n >= 0 && n <= ctx) {
            best = mid;
            *n_tokens = n;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    /* then digits on the last number, one token each, up to ctx */
    size_t len = text_of(best, buf, cap);
    while (*n_tokens < ctx && len + 1 < cap) {
        buf[len] = (char)('0' + len % 10);
        buf[++len] = '\0';
        int n = model_tokenize(tok, buf, len, model_add_bos(tok), NULL, 0);
        if (n < 0 || n > ctx) {
            buf[--len] = '\0';
            break;
        }
        *n_tokens = n;
    }
    if (len > ARG_LIMIT) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* ------------------------------------------------------------------------
 * One cell: kvd generate, its report parsed
 * ------------------------------------------------------------------------ */

static void parse_report(FILE *f, struct run *r, char *kernels, char *weights)
{
    char line[1024], last[1024] = "";
    rewind(f);
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        double s, tps;
        int n;
        if (sscanf(line, " prefill: %d tokens in %lf s (%lf", &n, &s, &tps) == 3) {
            r->prompt_tokens = n;
            r->prefill_tps = tps;
        } else if (sscanf(line, " decode: %d tokens in %lf s (%lf", &n, &s, &tps) == 3) {
            r->gen_tokens = n;
            r->decode_tps = tps;
        } else if (!strncmp(line, "kvd generate: kernels ", 22)) {
            snprintf(kernels, MODEL_KERNELS_LINE, "%.760s", line + 22); /* whole: checked below */
        } else if (!strncmp(line, "kvd generate: weights ", 22)) {
            snprintf(weights, 256, "%.250s", line + 22);
        } else if (!strncmp(line, "  stopped: ", 11)) {
            snprintf(r->note, sizeof r->note, "stopped: %.140s", line + 11);
        } else if (strstr(line, "unknown option '--fill'")) {
            snprintf(r->note, sizeof r->note,
                     "this binary has no --fill (older than it): --real reads the whole prompt");
        }
        if (line[0])
            snprintf(last, sizeof last, "%s", line);
    }
    if (!r->note[0] && !r->prompt_tokens)
        snprintf(r->note, sizeof r->note, "%.150s", last);
}

/* The environment a row's binary runs in: ours without KVD_F16, plus
 * KVD_F16=bf16 for an f16-bf16 row (so a KVD_F16 the caller exported cannot
 * change a plain f16 row unseen). The array is static: one run at a time. */
static char **row_environ(const struct wtype *w)
{
    static char **env;
    static size_t cap;
    size_t n = 0, k = 0;
    while (environ[n])
        n++;
    if (n + 2 > cap) {
        cap = n + 2;
        env = realloc(env, cap * sizeof *env);
        if (!env)
            die("%s", "out of memory");
    }
    for (size_t i = 0; i < n; i++) /* each binary's own choices: no KVD_F16, KVD_BF16 */
        if (strncmp(environ[i], "KVD_F16=", 8) && strncmp(environ[i], "KVD_BF16=", 9))
            env[k++] = environ[i];
    if (w->f16_bf16)
        env[k++] = "KVD_F16=bf16";
    env[k] = NULL;
    return env;
}

static void run_generate(const struct opts *o, int bin, const char *model_path, const char *prompt,
                         const struct row *row, struct run *r)
{
    char n_arg[16], ctx_arg[16], thr_arg[16], batch_arg[16], fill_arg[16];
    int ti = row->ti;
    snprintf(n_arg, sizeof n_arg, "%d", o->n_gen);
    snprintf(ctx_arg, sizeof ctx_arg, "%d", row->ctx + o->n_gen + 64);
    snprintf(fill_arg, sizeof fill_arg, "%d", row->ctx);
    snprintf(thr_arg, sizeof thr_arg, "%d", o->threads);
    snprintf(batch_arg, sizeof batch_arg, "%d", o->batch);
    char *const argv[] = {(char *)o->bins[bin], "generate", "--model", (char *)model_path,
                          "--prompt", (char *)prompt, "-n", n_arg, "--temp", "0", "--threads",
                          thr_arg, "--batch", batch_arg, "--ctx", ctx_arg, "--kv-type",
                          (char *)kv_type_name(row->kv), "--no-echo",
                          row->fill ? "--fill" : NULL, fill_arg, NULL};
    FILE *err = tmpfile();
    if (!err)
        die("%s", "no temporary file");
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, fileno(err), 2);
    memset(r, 0, sizeof *r);
    pid_t pid;
    double t0 = bench_now();
    int rc = posix_spawn(&pid, o->bins[bin], &fa, NULL, argv, row_environ(&o->types[ti]));
    posix_spawn_file_actions_destroy(&fa);
    if (rc) {
        snprintf(r->note, sizeof r->note, "cannot run %s: %s", o->bins[bin], strerror(rc));
        fclose(err);
        return;
    }
    int status;
    struct rusage ru;
    while (wait4(pid, &status, 0, &ru) < 0 && errno == EINTR)
        ;
    double wall = bench_now() - t0;
    double cpu = (double)ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 +
                 (double)ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
    r->cores = wall > 0 ? cpu / wall : 0;
    parse_report(err, r, g.kernels[bin][ti], g.weights[bin][ti]);
    fclose(err);
    if (o->types[ti].f16_bf16 && g.kernels[bin][ti][0] && !strstr(g.kernels[bin][ti], "rounded to bf16"))
        snprintf(r->note, sizeof r->note, "its kernels line does not say \"f16 rounded to bf16\": "
                 "this binary ran f16 exact (KVD_F16 unknown to it, or no vdpbf16ps)");
    r->ok = WIFEXITED(status) && WEXITSTATUS(status) == 0 && r->prompt_tokens > 0 &&
            r->gen_tokens > 1;
    if (r->ok && r->gen_tokens < o->n_gen && !r->note[0])
        snprintf(r->note, sizeof r->note, "%d of %d tokens", r->gen_tokens, o->n_gen);
    if (!r->ok && !r->note[0])
        snprintf(r->note, sizeof r->note, "exit status %d", status);
}

/* Keep the better of two runs of one binary (a failed run never wins). */
static void keep_best(struct run *best, const struct run *r)
{
    if (!best->ok) {
        if (r->ok || !best->note[0])
            *best = *r;
        return;
    }
    if (!r->ok)
        return;
    best->prefill_tps = fmax(best->prefill_tps, r->prefill_tps);
    best->decode_tps = fmax(best->decode_tps, r->decode_tps);
    best->cores = fmax(best->cores, r->cores);
}

/* ------------------------------------------------------------------------
 * The plan and the rooflines
 * ------------------------------------------------------------------------ */

static bool in_list(const int *list, int n, int v)
{
    for (int i = 0; i < n; i++)
        if (list[i] == v)
            return true;
    return false;
}

/* Whether the default plan runs type t at ctx (--ctx and --full aside). */
static bool quick_cell(const struct shape *s, const struct wtype *t, int ctx)
{
    int n = 0;
    while (n < 4 && s->quick[n])
        n++;
    return in_list(s->quick, n, ctx) || (t->file == GGML_TYPE_Q8_0 && ctx == s->grid[2]);
}

static int plan_rows(const struct opts *o, struct row *rows)
{
    int ctxs[MAX_CTX + 4], n_ctx = 0;
    for (int i = 0; i < 4; i++)
        ctxs[n_ctx++] = o->shape->grid[i];
    for (int i = 0; i < o->n_ctx; i++)
        if (!in_list(ctxs, n_ctx, o->ctx[i]))
            ctxs[n_ctx++] = o->ctx[i];
    int n = 0;
    for (int ti = 0; ti < o->n_types; ti++)
        for (int k = 0; k < o->n_kv; k++)
            for (int c = 0; c < n_ctx && n < MAX_ROWS; c++) {
                struct row *r = &rows[n++];
                memset(r, 0, sizeof *r);
                r->ti = ti;
                r->kv = o->kv[k];
                r->ctx = ctxs[c];
                r->fill = o->fill_above >= 0 && ctxs[c] > o->fill_above &&
                          ctxs[c] > o->shape->fill_prompt;
                r->run = o->full || (o->n_ctx ? in_list(o->ctx, o->n_ctx, ctxs[c])
                                              : quick_cell(o->shape, &o->types[ti], ctxs[c]));
            }
    return n;
}

/* K/V bytes per position, all layers. */
static double kv_bytes_per_pos(const struct shape *s, enum kv_type kv)
{
    int hd = s->n_embd / s->n_head;
    return 2.0 * s->n_layer * s->n_kv_head * (double)kv_type_row_bytes(kv, hd);
}

static double decode_roofline(const struct opts *o, const struct model_cost *c, const struct row *r)
{
    double ctx = r->ctx + o->n_gen / 2.0;
    double bytes = c->weight_bytes + kv_bytes_per_pos(o->shape, r->kv) * ctx;
    return r->bus_gbs * 1e9 / bytes;
}

static double prefill_roofline(const struct opts *o, const struct model_cost *c,
                               const struct row *r)
{
    const struct shape *s = o->shape;
    double wpeak = weight_peak(&o->types[r->ti]) * 1e9 * o->threads, fpeak = g.fma * 1e9 * o->threads;
    if (wpeak <= 0 || fpeak <= 0)
        return 0;
    double w_ops = 2.0 * (c->layer_macs + c->output_macs / r->ctx);
    double a_ops = 4.0 * s->n_head * (s->n_embd / s->n_head) * s->n_layer * (r->ctx + 1) / 2.0;
    return 1.0 / (w_ops / wpeak + a_ops / fpeak);
}

/* ------------------------------------------------------------------------
 * Running the rows
 * ------------------------------------------------------------------------ */

/* Floats per array of the triad the table runs. */
static size_t triad_floats(const struct opts *o)
{
    return o->shape == &TINY ? (size_t)4 << 20 : (size_t)32 << 20;
}

/* The bus bandwidth on the table's threads (GB/s, the write-allocate read
 * counted), if better than *best. */
static void triad_into(const struct opts *o, double *best)
{
    double bus = 0;
    size_t n = triad_floats(o);
    bench_triad(o->threads, n, n, 3, &bus);
    *best = fmax(*best, bus);
}

/* What a read-only stream gets of the bus on the table's threads, printed
 * before the rows: decoding only reads, so on a machine where a read gets
 * less than the triad moves, the decode fractions' ceiling is this ratio,
 * not 100% (bench_util.h's bench_read). */
static void print_read_ceiling(const struct opts *o)
{
    double bus = 0;
    triad_into(o, &bus);
    double rd = bench_read(o->threads, 3 * triad_floats(o) * sizeof(float), 3); /* its bytes */
    if (rd > 0 && bus > 0)
        printf("read-only stream on %d threads: %.1f GB/s = %.2f of the bus (%.1f GB/s): the "
               "most a decode that only reads can reach of its roofline here\n",
               o->threads, rd, rd / bus, bus);
}

static void run_row(const struct opts *o, const struct model_cost *cost, const model *tok,
                    struct row *r, int order)
{
    char cn[16];
    int n_tok = 0;
    char *prompt = prompt_for(tok, r->fill ? o->shape->fill_prompt : r->ctx, &n_tok);
    if (!prompt) {
        for (int b = 0; b < o->n_bins; b++)
            snprintf(r->best[b].note, sizeof r->best[b].note,
                     "a %s prompt exceeds one argument's limit", ctx_name(r->ctx, cn, sizeof cn));
        return;
    }
    bench_load_average(r->load, sizeof r->load);
    r->load[strcspn(r->load, " ")] = '\0';
    double bus = 0;
    triad_into(o, &bus);
    fprintf(stderr, "bench_table: %s %s-KV %s: a prompt of %d tokens (%zu bytes)%s, bus %.1f "
            "GB/s, load %s\n", wname(&o->types[r->ti]), kv_type_name(r->kv),
            ctx_name(r->ctx, cn, sizeof cn), n_tok, strlen(prompt),
            r->fill ? " filled to the context" : "", bus, r->load);
    int ti = r->ti;
    for (int round = 0; round < o->rounds; round++)
        for (int k = 0; k < o->n_bins; k++) {
            int b = (k + order + round) % o->n_bins; /* alternate who goes first */
            struct run run;
            double t0 = bench_now();
            run_generate(o, b, cost->path, prompt, r, &run);
            fprintf(stderr,
                    "bench_table: %s %s-KV %s %s: prefill %d tokens %.1f tok/s, decode %d "
                    "tokens %.1f tok/s, %.2f cores, %.0f s%s%s\n",
                    wname(&o->types[ti]), kv_type_name(r->kv),
                    ctx_name(r->ctx, cn, sizeof cn), o->labels[b], run.prompt_tokens,
                    run.prefill_tps, run.gen_tokens, run.decode_tps, run.cores,
                    bench_now() - t0, run.note[0] ? "; " : "", run.note);
            keep_best(&r->best[b], &run);
        }
    triad_into(o, &bus); /* and after: the better of the two is the bus beside the row */
    r->bus_gbs = bus;
    r->decode_roof = decode_roofline(o, cost, r);
    r->prefill_roof = r->fill ? 0 : prefill_roofline(o, cost, r);
    free(prompt);
}

/* ------------------------------------------------------------------------
 * The table
 * ------------------------------------------------------------------------ */

static const char *fmt_tps(const struct run *r, double tps, char *buf, size_t len)
{
    if (!r->ok)
        snprintf(buf, len, "failed");
    else
        snprintf(buf, len, "%.1f", tps);
    return buf;
}

static const char *fmt_frac(const struct run *r, double tps, double roof, char *buf, size_t len)
{
    if (!r->ok || roof <= 0)
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%.0f%%", 100.0 * tps / roof);
    return buf;
}

static const char *fmt_ratio(const struct run *a, const struct run *b, double ta, double tb,
                             char *buf, size_t len)
{
    if (!a->ok || !b->ok || ta <= 0)
        snprintf(buf, len, "-");
    else
        snprintf(buf, len, "%.2f", tb / ta);
    return buf;
}

/* One half of a row (decode or prefill): speeds, ratio, roofline, fraction. */
static void print_half(const struct opts *o, const struct row *r, bool decode)
{
    char s[MAX_BINS][24], f[MAX_BINS][16], x[16];
    double roof = decode ? r->decode_roof : r->prefill_roof;
    if (!decode && r->fill) { /* the prompt read was not the context's */
        printf(o->n_bins == 2 ? " fill | fill | - | - | - |" : " fill | - | - |");
        return;
    }
    for (int b = 0; b < o->n_bins && b < MAX_BINS; b++) {
        double tps = decode ? r->best[b].decode_tps : r->best[b].prefill_tps;
        fmt_tps(&r->best[b], tps, s[b], sizeof s[b]);
        fmt_frac(&r->best[b], tps, roof, f[b], sizeof f[b]);
    }
    if (o->n_bins == 2) {
        fmt_ratio(&r->best[0], &r->best[1], decode ? r->best[0].decode_tps : r->best[0].prefill_tps,
                  decode ? r->best[1].decode_tps : r->best[1].prefill_tps, x, sizeof x);
        printf(" %s | %s | %s | %.0f | %s → %s |", s[0], s[1], x, roof, f[0], f[1]);
    } else {
        printf(" %s | %.0f | %s |", s[0], roof, f[0]);
    }
}

static void print_header(const struct opts *o)
{
    if (o->n_bins == 2) {
        printf("| weights | KV | context | bus GB/s | decode before | decode after | × | "
               "decode roofline | of roofline | prefill before | prefill after | × | "
               "prefill roofline | of roofline | load |\n");
        printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    } else {
        printf("| weights | KV | context | bus GB/s | decode tok/s | decode roofline | of roofline "
               "| prefill tok/s | prefill roofline | of roofline | load |\n");
        printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
    }
}

static void print_table(const struct opts *o, const struct row *rows, int n)
{
    char cn[16];
    printf("\n");
    print_header(o);
    for (int i = 0; i < n; i++) {
        const struct row *r = &rows[i];
        if (!r->run)
            continue;
        printf("| %s | %s | %s | %.1f |", wname(&o->types[r->ti]), kv_type_name(r->kv),
               ctx_name(r->ctx, cn, sizeof cn), r->bus_gbs);
        print_half(o, r, true);
        print_half(o, r, false);
        printf(" %s |\n", r->load);
    }
}

static void print_notes(const struct opts *o, const struct row *rows, int n)
{
    char cn[16];
    printf("\ntokens/s, each cell one `kvd generate` run. Decode: %d greedy tokens after the "
           "prompt; its roofline is weight + K/V bytes at the mean context over the bus (triad, "
           "write-allocate counted, the better of one before and one after the row). Prefill: "
           "the whole prompt, real text the binary tokenizes and reads in chunks of %d; its "
           "roofline is weight ops at the "
           "type's peak + attention ops at the f32 FMA peak, x %d threads. Weight peaks: q8_0 "
           "%s, bf16 %s, f16-bf16 %s, f32 and f16 %s. f16-bf16 rows run the f16 "
           "model with KVD_F16=bf16 in the binary's environment (its f16 weights rounded to "
           "bf16 at load); every other row runs without KVD_F16 (and every row without "
           "KVD_BF16).\n",
           o->n_gen, o->batch, o->threads, bench_peak_int8_name(),
           weight_peak_name(&(struct wtype){.file = GGML_TYPE_BF16}),
           weight_peak_name(&(struct wtype){.file = GGML_TYPE_F16, .f16_bf16 = true}),
           bench_peak_fma_name());
    printf("each run: KVD generate --model %s/%dx%d_TYPE.gguf --prompt TEXT -n %d --temp 0 "
           "--threads %d --batch %d --ctx P+%d --kv-type KV --no-echo [--fill P]\n",
           o->models, o->shape->n_embd, o->shape->n_layer, o->n_gen, o->threads, o->batch,
           o->n_gen + 64);
    bool filled = false;
    for (int i = 0; i < n; i++)
        filled |= rows[i].run && rows[i].fill;
    if (filled)
        printf("fill rows (contexts above %s; --real reads every prompt): the prompt is %d real "
               "tokens, read in chunks as above, then `kvd generate --fill P` copies their K/V "
               "rows, repeating, into new pages until the cache holds P tokens, and decoding "
               "starts there: decode reads P tokens of K/V, the same bytes a real P-token "
               "prefill leaves (engine/fill.c); their prefill is not measured (\"fill\").\n",
               ctx_name(o->fill_above, cn, sizeof cn), o->shape->fill_prompt);
    for (int i = 0; i < n; i++)
        for (int b = 0; b < o->n_bins; b++)
            if (rows[i].run && rows[i].best[b].note[0])
                printf("note: %s %s-KV %s %s: %s\n", wname(&o->types[rows[i].ti]),
                       kv_type_name(rows[i].kv), ctx_name(rows[i].ctx, cn, sizeof cn),
                       o->labels[b], rows[i].best[b].note);
    bool any = false;
    for (int i = 0; i < n; i++) {
        if (rows[i].run)
            continue;
        printf("%s %s%s", any ? "," : "not run (--full, or --ctx; make bench FULL=1 or CTX=...):",
               wname(&o->types[rows[i].ti]), rows[i].kv == KV_F16 ? "" : "/q8_0-KV");
        printf(" %s", ctx_name(rows[i].ctx, cn, sizeof cn));
        any = true;
    }
    if (any)
        printf("\n");
    for (int b = 0; b < o->n_bins; b++) {
        /* the binary's kernels line, then each type's where it differs */
        const char *first = "";
        for (int t = 0; t < o->n_types && !first[0]; t++)
            first = g.kernels[b][t];
        printf("%s = %s: kernels %s\n", o->labels[b], o->bins[b],
               first[0] ? first : "(not printed)");
        for (int t = 0; t < o->n_types; t++) {
            if (g.kernels[b][t][0] && strcmp(g.kernels[b][t], first))
                printf("  %s kernels %s\n", wname(&o->types[t]), g.kernels[b][t]);
            if (g.weights[b][t][0])
                printf("  %s weights %s\n", wname(&o->types[t]), g.weights[b][t]);
        }
    }
}

/* A shared machine: say what its figures can and cannot show. */
static void warn_if_busy(const struct opts *o, const struct row *rows, int n)
{
    double worst = 0, over = 0;
    for (int i = 0; i < n; i++) {
        if (!rows[i].run)
            continue;
        worst = fmax(worst, atof(rows[i].load));
        for (int b = 0; b < o->n_bins; b++)
            if (rows[i].best[b].ok && rows[i].decode_roof > 0)
                over = fmax(over, rows[i].best[b].decode_tps / rows[i].decode_roof);
    }
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    if (worst > (double)cpus)
        printf("warning: the load average reached %.1f on %ld CPUs: each run got a share of the "
               "machine, and the triad too, so the fractions are unreliable (%s); the ratio of "
               "two binaries alternated row by row is the figure to read\n",
               worst, cpus,
               over > 1.0 ? "a decode above 100% of its roofline shows a triad slowed by the "
                            "others"
                          : "quiet, they are the figures to read");
}

int main(int argc, char **argv)
{
    struct opts o;
    parse_opts(argc, argv, &o);
    print_machine(&o);
    measure_peaks();

    static struct row rows[MAX_ROWS];
    int n_rows = plan_rows(&o, rows);
    struct model_cost cost[MAX_TYPES];
    for (int t = 0; t < o.n_types; t++) {
        char path[512];
        model_file(&o, o.types[t].file, path, sizeof path);
        model_cost_of(path, &cost[t]);
        printf("model %s %s: %.1f MB of weights read per decoded token, %.1f M multiply-adds "
               "per prompt token in the blocks\n",
               o.shape->name, wname(&o.types[t]), cost[t].weight_bytes / 1e6,
               cost[t].layer_macs / 1e6);
    }
    print_read_ceiling(&o);
    fflush(stdout);

    char err[512];
    struct model_params mp = {.path = cost[0].path, .vocab_only = true};
    model *tok = model_load(&mp, err, sizeof err);
    if (!tok)
        die("%s", err);
    for (int i = 0, k = 0; i < n_rows; i++)
        if (rows[i].run)
            run_row(&o, &cost[rows[i].ti], tok, &rows[i], k++);
    model_free(tok);

    char load[32];
    bench_load_average(load, sizeof load);
    print_table(&o, rows, n_rows);
    print_notes(&o, rows, n_rows);
    printf("load average at the end: %s\n", load);
    warn_if_busy(&o, rows, n_rows);
    for (int i = 0; i < n_rows; i++)
        for (int b = 0; b < o.n_bins; b++)
            if (rows[i].run && !rows[i].best[b].ok)
                return 1; /* the table says which cell and why */
    return 0;
}
