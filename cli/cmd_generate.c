/*
 * cmd_generate.c - `kvd generate`: offline text generation from a prompt.
 *
 * The same engine pieces as the daemon, in one process and one sequence:
 * load the model, make a paged cache sized for --ctx tokens with the chosen
 * eviction policy, prefill the prompt in chunks, then decode one token at a
 * time, streaming each complete UTF-8 character to stdout as it is sampled.
 * Throughput of prefill and decode goes to stderr, so stdout is only text.
 *
 * Without --model it uses models/default.gguf, writing that default model
 * (kvd mkmodel --preset retrieval, as `make run` does) first if the file
 * does not exist.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/args.h"
#include "model/mkmodel.h"
#include "model/model.h"

#define DEFAULT_MODEL_DIR "models"
#define DEFAULT_MODEL "models/default.gguf"

struct gen_opts {
    const char *model;
    const char *prompt;
    int n_predict;
    int ctx;       /* cache budget of the sequence in tokens; 0 = from the model */
    int batch;     /* prefill chunk */
    int threads;
    int page_tokens;
    enum kv_type k_type, v_type;
    struct kv_policy policy;
    bool window_set;
    bool echo;
    struct model_sampling sampling;
    struct model_params mp; /* offset-only bias values for files that lack them */
};

static void generate_usage(FILE *f)
{
    fprintf(f,
            "usage: kvd generate [--model FILE] --prompt TEXT [options]\n"
            "  --model FILE       GGUF model (default %s, written by kvd mkmodel\n"
            "                     --preset retrieval if absent)\n"
            "  --prompt TEXT      the text to continue\n"
            "  -n N               tokens to generate (default 128)\n"
            "  --temp T           temperature, 0 = greedy (default 0.8)\n"
            "  --top-k K          (default 40; 0 = off)\n"
            "  --top-p P          (default 0.95; 1 = off)\n"
            "  --seed S           sampling seed (default 0)\n"
            "  --ctx N            cache budget in tokens (default: the model's context\n"
            "                     length, at most 4096)\n"
            "  --policy P         none | sink-window | h2o (default none: stop when full)\n"
            "  --sink S           sink tokens kept (default 4)\n"
            "  --window W         recent tokens kept (default: what the budget allows)\n"
            "  --heavy H          h2o: heavy-hitter tokens kept (default 0)\n"
            "  --preserve         keep positions after eviction (default: renumber)\n"
            "  --kv-type T        K and V type: f32 | f16 | bf16 | q8_0 | q4_0 (default f16)\n"
            "  --k-type T, --v-type T  the K or the V type alone\n"
            "  --threads N        OpenMP threads (default: all)\n"
            "  --batch N          prefill chunk in tokens (default 256)\n"
            "  --no-echo          print only the generated text, not the prompt\n"
            "  --alibi-max-bias F ALiBi max_bias for a file that lacks it\n"
            "  --t5-buckets N     T5 bias buckets for a file that lacks kvd.t5.num_buckets\n"
            "  --t5-max-distance N  T5 max distance for a file that lacks kvd.t5.max_distance\n",
            DEFAULT_MODEL);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int parse_int_opt(const char *v, const char *name, long min, long max, int *out)
{
    long n;
    if (srv_parse_long(v, min, max, &n)) {
        fprintf(stderr, "kvd generate: %s wants an integer in [%ld, %ld], got '%s'\n", name, min,
                max, v);
        return -1;
    }
    *out = (int)n;
    return 0;
}

static int parse_opts(int argc, char **argv, struct gen_opts *o)
{
    *o = (struct gen_opts){
        .n_predict = 128,
        .batch = 256,
        .page_tokens = 16,
        .k_type = KV_F16,
        .v_type = KV_F16,
        .policy = {.kind = KV_EVICT_NONE, .sink_tokens = 4, .renumber = true},
        .echo = true,
    };
    model_sampling_defaults(&o->sampling);
    bool bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        double x;
        if (srv_opt_value(argc, argv, &i, "generate", "--model", &v, &bad)) {
            o->model = v;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--prompt", &v, &bad)) {
            o->prompt = v;
        } else if (srv_opt_value(argc, argv, &i, "generate", "-n", &v, &bad) ||
                   srv_opt_value(argc, argv, &i, "generate", "--n-predict", &v, &bad)) {
            if (!bad && parse_int_opt(v, "-n", 0, 1 << 24, &o->n_predict))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--temp", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 0.0, 100.0, &x)) {
                fprintf(stderr, "kvd generate: --temp wants a number in [0, 100], got '%s'\n", v);
                return -1;
            }
            o->sampling.temperature = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--top-k", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--top-k", 0, 1 << 24, &o->sampling.top_k))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--top-p", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 0.0, 1.0, &x)) {
                fprintf(stderr, "kvd generate: --top-p wants a number in [0, 1], got '%s'\n", v);
                return -1;
            }
            o->sampling.top_p = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--seed", &v, &bad)) {
            char *end;
            if (!bad) {
                o->sampling.seed = strtoull(v, &end, 10);
                if (!*v || *end || *v == '-') {
                    fprintf(stderr, "kvd generate: --seed wants a non-negative integer, got '%s'\n",
                            v);
                    return -1;
                }
            }
        } else if (srv_opt_value(argc, argv, &i, "generate", "--ctx", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--ctx", 1, 1 << 24, &o->ctx))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--policy", &v, &bad)) {
            if (!bad && kv_policy_parse_kind(v, &o->policy.kind)) {
                fprintf(stderr, "kvd generate: --policy wants none, sink-window or h2o, got '%s'\n",
                        v);
                return -1;
            }
        } else if (srv_opt_value(argc, argv, &i, "generate", "--sink", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--sink", 0, 1 << 24, &o->policy.sink_tokens))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--window", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--window", 1, 1 << 24, &o->policy.window_tokens))
                return -1;
            o->window_set = true;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--heavy", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--heavy", 0, 1 << 24, &o->policy.heavy_tokens))
                return -1;
        } else if (srv_opt_kv_types(argc, argv, &i, "generate", &o->k_type, &o->v_type, &bad)) {
            if (bad)
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--threads", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--threads", 1, 1024, &o->threads))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--batch", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--batch", 1, 65536, &o->batch))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--alibi-max-bias", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 1e-3, 1024.0, &x)) {
                fprintf(stderr, "kvd generate: --alibi-max-bias wants a number in [0.001, 1024], "
                        "got '%s'\n", v);
                return -1;
            }
            o->mp.alibi_max_bias = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--t5-buckets", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--t5-buckets", 4, 4096, &o->mp.t5_num_buckets))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--t5-max-distance", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--t5-max-distance", 1, 1 << 20, &o->mp.t5_max_distance))
                return -1;
        } else if (!strcmp(argv[i], "--preserve")) {
            o->policy.renumber = false;
            i++;
        } else if (!strcmp(argv[i], "--no-echo")) {
            o->echo = false;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            return 1; /* help: the caller prints it and succeeds */
        } else {
            fprintf(stderr, "kvd generate: unknown option '%s'\n", argv[i]);
            generate_usage(stderr);
            return -1;
        }
    }
    if (bad)
        return -1;
    if (!o->prompt) {
        fprintf(stderr, "kvd generate: --prompt TEXT is required\n");
        generate_usage(stderr);
        return -1;
    }
    return 0;
}

/* Write the default model if it is missing. 0 or -1 (reported). */
static int ensure_default_model(void)
{
    struct stat st;
    if (stat(DEFAULT_MODEL, &st) == 0)
        return 0;
    if (mkdir(DEFAULT_MODEL_DIR, 0755) && errno != EEXIST) {
        fprintf(stderr, "kvd generate: cannot create %s/: %s\n", DEFAULT_MODEL_DIR,
                strerror(errno));
        return -1;
    }
    struct model_mk_params p;
    char err[512];
    model_mk_preset(&p, "retrieval", NULL, err, sizeof(err)); /* cannot fail */
    fprintf(stderr, "kvd generate: no --model; writing the default model to %s\n", DEFAULT_MODEL);
    if (model_mk_write(&p, DEFAULT_MODEL, err, sizeof(err))) {
        fprintf(stderr, "kvd generate: %s\n", err);
        return -1;
    }
    return 0;
}

/* Stream text, flushing so a reader sees each token as it comes. */
static void emit(const char *s, int n)
{
    if (n > 0) {
        fwrite(s, 1, (size_t)n, stdout);
        fflush(stdout);
    }
}

int srv_cmd_generate(int argc, char **argv)
{
    struct gen_opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc > 0) {
        generate_usage(stdout);
        return 0;
    }
    if (prc)
        return 2;
    if (!o.model) {
        if (ensure_default_model())
            return 1;
        o.model = DEFAULT_MODEL;
    }

    char err[512];
    struct model_params mp = o.mp;
    mp.path = o.model;
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "kvd generate: %s\n", err);
        return 1;
    }
    struct model_info info;
    model_get_info(m, &info);
    fprintf(stderr, "kvd generate: loaded %s: arch %s, positions %s, %s weights, dim %d, "
            "%d layers, %d heads (%d kv), vocab %d\n", info.name, info.arch,
            pos_kind_name(info.pos), info.weight_type, info.n_embd, info.n_layer, info.n_head,
            info.n_kv_head, info.n_vocab);
    fprintf(stderr, "kvd generate: attention %s, K %s, V %s%s%s\n", attn_simd_name(),
            kv_type_name(o.k_type), kv_type_name(o.v_type),
            o.k_type == KV_Q8_0 && info.pos != POS_ROPE ? ", q8_0 key scores: int8 " : "",
            o.k_type == KV_Q8_0 && info.pos != POS_ROPE ? attn_q8_name() : "");

    int status = 1;
    kv_cache *cache = NULL;
    kv_seq *seq = NULL;
    model_ctx *ctx = NULL;
    model_sampler *smp = NULL;
    model_detok *detok = NULL;
    int32_t *hist = NULL;
    float *logits = NULL;

    /* Prompt tokens; the history array also receives generated tokens. */
    size_t plen = strlen(o.prompt);
    bool bos = model_add_bos(m);
    int n_prompt = model_tokenize(m, o.prompt, plen, bos, NULL, 0);
    if (n_prompt < 0) {
        fprintf(stderr, "kvd generate: tokenizing the prompt failed: %s\n", strerror(-n_prompt));
        goto out;
    }
    if (n_prompt == 0) {
        fprintf(stderr, "kvd generate: the prompt is empty and the model has no BOS token\n");
        status = 2;
        goto out;
    }
    hist = malloc(sizeof(int32_t) * ((size_t)n_prompt + (size_t)o.n_predict));
    logits = malloc(sizeof(float) * (size_t)info.n_vocab);
    if (!hist || !logits) {
        fprintf(stderr, "kvd generate: out of memory\n");
        goto out;
    }
    model_tokenize(m, o.prompt, plen, bos, hist, n_prompt);

    /* The cache: one sequence with a budget of ctx tokens. */
    if (o.ctx == 0)
        o.ctx = info.n_ctx_train > 0 && info.n_ctx_train < 4096 ? info.n_ctx_train : 4096;
    o.policy.max_cache_tokens = o.ctx;
    int pt = o.page_tokens;
    struct kv_budget budget;
    kv_policy_budget(&o.policy, pt, &budget);
    if (o.policy.kind != KV_EVICT_NONE && !o.window_set)
        o.policy.window_tokens = (int)budget.window_room; /* fill the budget */
    if (kv_policy_check(&o.policy, pt, err, sizeof(err))) {
        fprintf(stderr, "kvd generate: %s\n", err);
        status = 2;
        goto out;
    }
    struct kv_cache_params cp = {.page_tokens = pt, .k_type = o.k_type, .v_type = o.v_type};
    model_kv_shape(m, &cp);
    cp.memory_bytes = kv_cache_memory_for(&cp, budget.sequence_pages);
    cache = kv_cache_create(&cp, err, sizeof(err));
    if (!cache) {
        fprintf(stderr, "kvd generate: cache: %s\n", err);
        goto out;
    }
    seq = kv_seq_create(cache, &o.policy, false, err, sizeof(err));
    if (!seq) {
        fprintf(stderr, "kvd generate: %s\n", err);
        goto out;
    }
    int max_batch = o.batch < n_prompt ? o.batch : n_prompt;
    ctx = model_ctx_create(m, max_batch, o.threads, err, sizeof(err));
    smp = model_sampler_create(&o.sampling, info.n_vocab);
    detok = model_detok_create(m);
    if (!ctx || !smp || !detok) {
        fprintf(stderr, "kvd generate: %s\n", !ctx ? err : "out of memory");
        goto out;
    }
    if (o.echo)
        emit(o.prompt, (int)plen);

    /* Prefill in chunks the policy can take. */
    double t0 = now_s();
    int done = 0;
    const char *stop_reason = NULL;
    while (done < n_prompt) {
        int room = kv_seq_max_append(seq);
        int chunk = n_prompt - done;
        if (chunk > max_batch)
            chunk = max_batch;
        if (chunk > room)
            chunk = room;
        if (chunk < 1) {
            stop_reason = "the prompt does not fit in the context (--ctx, --policy)";
            break;
        }
        struct model_batch_seq b = {
            .seq = seq, .tokens = hist + done, .n_tokens = chunk,
            .logits = done + chunk == n_prompt ? logits : NULL,
        };
        int rc = model_reserve_forward(ctx, &b, 1, NULL);
        if (rc) {
            fprintf(stderr, "\nkvd generate: forward failed during prefill: %s\n", strerror(-rc));
            goto out;
        }
        done += chunk;
    }
    double t1 = now_s();

    /* Decode. */
    int n_gen = 0, n_hist = n_prompt;
    char text[1024];
    while (!stop_reason && n_gen < o.n_predict) {
        int32_t tok = model_sample(smp, logits, hist, n_hist);
        hist[n_hist++] = tok;
        n_gen++;
        if (model_is_eog(m, tok)) {
            stop_reason = "end of text";
            break;
        }
        int w = model_detok_push(detok, tok, text, sizeof(text));
        if (w > 0)
            emit(text, w);
        if (n_gen == o.n_predict)
            break;
        struct model_batch_seq b = {.seq = seq, .tokens = &tok, .n_tokens = 1, .logits = logits};
        int rc = model_reserve_forward(ctx, &b, 1, NULL);
        if (rc == -ENOSPC) {
            stop_reason = "context full (policy none; use --ctx or --policy sink-window)";
            break;
        }
        if (rc) {
            fprintf(stderr, "\nkvd generate: forward failed: %s\n", strerror(-rc));
            goto out;
        }
    }
    int w = model_detok_flush(detok, text, sizeof(text));
    emit(text, w);
    printf("\n");
    fflush(stdout);
    double t2 = now_s();

    struct kv_stats ks;
    kv_cache_stats(cache, &ks);
    fprintf(stderr, "kvd generate: %s (%s, %s positions, %s), kv %s/%s, policy %s, positions %s\n",
            info.name, info.arch, pos_kind_name(info.pos), info.weight_type,
            kv_type_name(o.k_type), kv_type_name(o.v_type), kv_policy_kind_name(o.policy.kind),
            o.policy.renumber ? "renumber" : "preserve");
    fprintf(stderr, "  prefill: %d tokens in %.3f s (%.1f tokens/s)\n", done, t1 - t0,
            t1 > t0 ? done / (t1 - t0) : 0.0);
    /* The first sampled token needs no forward; decode forwards = n_gen - 1. */
    int n_fwd = n_gen > 0 ? n_gen - 1 : 0;
    fprintf(stderr, "  decode:  %d tokens in %.3f s (%.1f tokens/s)\n", n_gen, t2 - t1,
            t2 > t1 && n_fwd > 0 ? n_fwd / (t2 - t1) : 0.0);
    fprintf(stderr, "  cache: %d tokens retained, %llu evicted in %llu evictions\n",
            kv_seq_n_tokens(seq), (unsigned long long)ks.tokens_evicted,
            (unsigned long long)ks.evictions);
    if (stop_reason)
        fprintf(stderr, "  stopped: %s\n", stop_reason);
    status = done < n_prompt ? 2 : 0;

out:
    model_detok_destroy(detok);
    model_sampler_destroy(smp);
    model_ctx_destroy(ctx);
    kv_seq_destroy(seq);
    kv_cache_destroy(cache);
    free(hist);
    free(logits);
    model_free(m);
    return status;
}
