/*
 * cmd_generate.c - `kvd generate`: offline text generation from a prompt.
 *
 * The daemon's engine (engine/engine.h), in one process for one request:
 * load the model, create an engine whose pool holds one sequence at --ctx
 * tokens under the chosen eviction policy, submit the prompt, and step the
 * engine until the request ends, streaming each piece of text (whole UTF-8
 * characters) to stdout as the engine posts it. Prefill in --batch chunks,
 * decoding, sampling and detokenization are the engine's, so a greedy
 * completion is the text `kvd serve` gives for the same prompt. Throughput
 * of prefill and decode goes to stderr, so stdout is only text.
 *
 * --fill N is for decode benchmarks at long context (bench_table's 64k
 * rows): the prompt is read for real, then its K/V rows are copied,
 * repeating, until the cache holds N tokens (engine/fill.c says why decode
 * speed is unchanged by that and what it is not), and decoding starts
 * there. The report says so on a line of its own, and the prefill line
 * counts only the prompt read.
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
#include "engine/engine.h"
#include "model/mkmodel.h"
#include "model/model.h"

#define DEFAULT_MODEL_DIR "models"
#define DEFAULT_MODEL "models/default.gguf"

struct gen_opts {
    const char *model;
    const char *prompt;
    int n_predict;
    int ctx;   /* cache budget of the sequence in tokens; 0 = from the model */
    int batch; /* prefill chunk */
    int fill;  /* --fill: cache tokens after the prompt's K/V is repeated; 0 none */
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
            "  --policy P         none | sink-window | h2o | tova | knorm | snapkv\n"
            "                     (default none: stop when full; config/kvd.conf says what\n"
            "                     each keeps and costs)\n"
            "  --sink S           sink tokens kept (default 4)\n"
            "  --window W         recent tokens kept (default: what the budget allows)\n"
            "  --heavy H          h2o, tova, knorm, snapkv: middle tokens kept by score\n"
            "                     (default 0; these policies need at least 1)\n"
            "  --observe N        snapkv: last queries of a prompt chunk observed (default 32)\n"
            "  --pool N           snapkv: max-pool width over neighbours (default 7)\n"
            "  --knorm-evict E    knorm: largest | smallest key norms evicted (default largest)\n"
            "  --preserve         keep positions after eviction (default: renumber)\n"
            "  --kv-type T        K and V type: f32 | f16 | bf16 | q8_0 | q4_0 (default f16)\n"
            "  --k-type T, --v-type T  the K or the V type alone\n"
            "  --threads N        compute threads (default: OMP_NUM_THREADS, else all CPUs)\n"
            "  --batch N          prefill chunk in tokens (default 256)\n"
            "  --no-echo          print only the generated text, not the prompt\n"
            "  --fill N           benchmarks: after reading the prompt, copy its K/V rows,\n"
            "                     repeating, until the cache holds N tokens, then decode\n"
            "                     (decode reads N tokens of K/V; the text is not what a real\n"
            "                     N-token prompt gives; policy none, N + -n within --ctx)\n"
            "  --alibi-max-bias F ALiBi max_bias for a file that lacks it\n"
            "  --t5-buckets N     T5 bias buckets for a file that lacks kvd.t5.num_buckets\n"
            "  --t5-max-distance N  T5 max distance for a file that lacks kvd.t5.max_distance\n",
            DEFAULT_MODEL);
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
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
        .policy = {.kind = KV_EVICT_NONE,
                   .sink_tokens = 4,
                   .observe_tokens = 32,
                   .pool_tokens = 7,
                   .renumber = true},
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
                fprintf(stderr,
                        "kvd generate: --policy wants none, sink-window, h2o, tova, knorm or "
                        "snapkv, got '%s'\n",
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
        } else if (srv_opt_value(argc, argv, &i, "generate", "--observe", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--observe", 1, 1 << 20, &o->policy.observe_tokens))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--pool", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--pool", 1, 1 << 10, &o->policy.pool_tokens))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--knorm-evict", &v, &bad)) {
            if (!bad && strcmp(v, "largest") && strcmp(v, "smallest")) {
                fprintf(stderr, "kvd generate: --knorm-evict wants largest or smallest, got '%s'\n",
                        v);
                return -1;
            }
            o->policy.knorm_smallest = !bad && !strcmp(v, "smallest");
        } else if (srv_opt_kv_types(argc, argv, &i, "generate", &o->k_type, &o->v_type, &bad)) {
            if (bad)
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--threads", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--threads", 1, 1024, &o->threads))
                return -1;
        } else if (srv_opt_value(argc, argv, &i, "generate", "--fill", &v, &bad)) {
            if (!bad && parse_int_opt(v, "--fill", 1, 1 << 24, &o->fill))
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

/* How the engine ended the request. */
struct gen_result {
    bool failed; /* an ERROR event: status and message */
    int status;
    char message[600];
    enum engine_finish finish; /* DONE */
    struct engine_usage usage;
};

/*
 * Drive the engine until req ends, streaming its text to stdout as the
 * engine posts it: the same admission, chunked prefill, reservation,
 * sampling and detokenization as `kvd serve`, for one request.
 */
static void run_engine(engine *eng, struct engine_req *req, struct gen_result *res)
{
    *res = (struct gen_result){0};
    engine_submit(eng, req);
    for (bool ended = false; !ended;) {
        bool worked = engine_step(eng, now_ns());
        struct engine_event *ev = engine_take_events(eng), *next;
        if (!worked && !ev) {
            /* nothing ran and nothing ended: a bug, never a hang */
            res->failed = true;
            res->status = 500;
            snprintf(res->message, sizeof(res->message),
                     "the engine stopped with the request open");
            return;
        }
        for (; ev; ev = next) {
            next = ev->next;
            if (ev->kind == ENGINE_EV_TEXT) {
                emit(ev->text, (int)ev->len);
            } else if (ev->kind == ENGINE_EV_DONE) {
                res->finish = ev->finish;
                res->usage = ev->usage;
                ended = true;
            } else if (ev->kind == ENGINE_EV_ERROR) {
                res->failed = true;
                res->status = ev->status;
                snprintf(res->message, sizeof(res->message), "%s", ev->message);
                ended = true;
            }
            engine_event_free(ev);
        }
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
    fprintf(stderr,
            "kvd generate: loaded %s: arch %s, positions %s, %s weights, dim %d, "
            "%d layers, %d heads (%d kv), vocab %d\n",
            info.name, info.arch, pos_kind_name(info.pos), info.weight_type, info.n_embd,
            info.n_layer, info.n_head, info.n_kv_head, info.n_vocab);
    char kern[MODEL_KERNELS_LINE];
    fprintf(stderr, "kvd generate: kernels %s\n", model_kernels_describe(kern, sizeof(kern)));
    fprintf(stderr, "kvd generate: weights %s\n", model_pack_describe(m, kern, sizeof(kern)));
    fprintf(stderr, "kvd generate: attention %s, K %s, V %s%s%s\n",
            attn_path_name(info.attn_softcap),
            kv_type_name(o.k_type), kv_type_name(o.v_type),
            o.k_type == KV_Q8_0 && info.pos != POS_ROPE ? ", q8_0 key scores: int8 " : "",
            o.k_type == KV_Q8_0 && info.pos != POS_ROPE ? attn_q8_name() : "");

    int status = 1;
    engine *eng = NULL;
    struct engine_req *req = engine_req_new(ENGINE_REQ_COMPLETION);
    if (!req) {
        fprintf(stderr, "kvd generate: out of memory\n");
        goto out;
    }

    /* Prompt tokens (BOS as the model says). */
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
    req->prompt = malloc(sizeof(int32_t) * (size_t)n_prompt);
    if (!req->prompt) {
        fprintf(stderr, "kvd generate: out of memory\n");
        goto out;
    }
    model_tokenize(m, o.prompt, plen, bos, req->prompt, n_prompt);
    req->n_prompt = n_prompt;
    req->max_tokens = o.n_predict;
    req->fill_tokens = o.fill;
    req->sampling = o.sampling;

    /* The engine: one sequence with a budget of ctx tokens, a pool that
     * holds it at its full budget, prefill chunks of --batch tokens. */
    if (o.ctx == 0)
        o.ctx = info.n_ctx_train > 0 && info.n_ctx_train < 4096 ? info.n_ctx_train : 4096;
    o.policy.max_cache_tokens = o.ctx;
    int pt = o.page_tokens;
    struct kv_budget budget;
    kv_policy_budget(&o.policy, pt, &budget);
    if (o.policy.kind != KV_EVICT_NONE && !o.window_set)
        o.policy.window_tokens = (int)budget.window_tokens; /* fill the budget */
    if (kv_policy_check(&o.policy, pt, err, sizeof(err))) {
        fprintf(stderr, "kvd generate: %s\n", err);
        status = 2;
        goto out;
    }
    if (o.fill && (o.fill <= n_prompt || (int64_t)o.fill + o.n_predict > o.ctx ||
                   o.policy.kind != KV_EVICT_NONE)) {
        fprintf(stderr,
                "kvd generate: --fill %d wants more tokens than the prompt's %d, at most --ctx "
                "%d less -n %d, and policy none\n",
                o.fill, n_prompt, o.ctx, o.n_predict);
        status = 2;
        goto out;
    }
    /* Phi-3's LongRoPE table by the positions this run reaches. */
    int n_ctx = srv_run_positions(&o.policy,
                                  (int64_t)(o.fill > n_prompt ? o.fill : n_prompt) + o.n_predict);
    model_set_n_ctx(m, n_ctx);
    model_get_info(m, &info);
    srv_rope_note(&info, n_ctx, err, sizeof(err));
    if (err[0])
        fprintf(stderr, "kvd generate: %s\n", err);
    struct srv_one_engine_params ep = {.m = m,
                                       .policy = &o.policy,
                                       .page_tokens = pt,
                                       .k_type = o.k_type,
                                       .v_type = o.v_type,
                                       .n_threads = o.threads,
                                       .step_tokens = o.batch < n_prompt ? o.batch : n_prompt};
    eng = srv_one_engine(&ep, err, sizeof(err));
    if (!eng) {
        fprintf(stderr, "kvd generate: %s\n", err);
        goto out;
    }
    fprintf(stderr, "kvd generate: KV pool %d pages of %d tokens (%s)\n",
            kv_cache_n_pages(engine_cache(eng)), pt, kv_cache_pages(engine_cache(eng))->says);
    if (o.echo)
        emit(o.prompt, (int)plen);

    struct gen_result res;
    run_engine(eng, req, &res);
    printf("\n");
    fflush(stdout);

    struct engine_stats st;
    engine_get_stats(eng, &st);
    fprintf(stderr, "kvd generate: %s (%s, %s positions, %s), kv %s/%s, policy %s, positions %s\n",
            info.name, info.arch, pos_kind_name(info.pos), info.weight_type, kv_type_name(o.k_type),
            kv_type_name(o.v_type), kv_policy_kind_name(o.policy.kind),
            o.policy.renumber ? "renumber" : "preserve");
    double t_fill = res.usage.fill_ms / 1e3;
    double t_prefill = res.usage.prompt_ms / 1e3 - t_fill, t_decode = res.usage.gen_ms / 1e3;
    int done = res.failed ? 0 : n_prompt;
    fprintf(stderr, "  prefill: %d tokens in %.3f s (%.1f tokens/s)\n", done, t_prefill,
            t_prefill > 0 ? done / t_prefill : 0.0);
    if (o.fill && !res.failed)
        fprintf(stderr,
                "  fill:    %d tokens in %.3f s (the prompt's K/V copied, repeating, from %d to "
                "%d tokens: not a prefill; decode reads %d tokens of K/V)\n",
                o.fill - n_prompt, t_fill, n_prompt, o.fill, o.fill);
    /* The first sampled token needs no forward; decode forwards = n_gen - 1. */
    int n_gen = res.usage.completion_tokens + (res.finish == ENGINE_FINISH_EOG);
    int n_fwd = n_gen > 0 ? n_gen - 1 : 0;
    fprintf(stderr, "  decode:  %d tokens in %.3f s (%.1f tokens/s)\n", n_gen, t_decode,
            t_decode > 0 && n_fwd > 0 ? n_fwd / t_decode : 0.0);
    fprintf(stderr, "  cache: %d tokens retained, %llu evicted in %llu evictions\n",
            res.usage.retained_tokens, (unsigned long long)st.kv.tokens_evicted,
            (unsigned long long)st.kv.evictions);
    const char *why = res.failed                            ? res.message
                      : res.finish == ENGINE_FINISH_EOG     ? "end of text"
                      : res.finish == ENGINE_FINISH_CONTEXT ? "context full (policy none; use "
                                                              "--ctx or --policy sink-window)"
                      : res.finish == ENGINE_FINISH_LENGTH  ? NULL
                                                            : "cut short";
    if (why)
        fprintf(stderr, "  stopped: %s\n", why);
    status = res.failed ? (res.status == 400 ? 2 : 1) : 0;

out:
    engine_destroy(eng);
    engine_req_free(req);
    model_free(m);
    return status;
}
