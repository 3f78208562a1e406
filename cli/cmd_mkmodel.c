/*
 * cmd_mkmodel.c - `kvd mkmodel`: write a small seeded GGUF model.
 *
 * The model is a pure function of the options and the seed (see
 * model/mkmodel.h); it is what `make run` serves when no model is given and
 * what tests and benchmarks build their fixtures from. Any GGUF reader can
 * open it: llama.cpp's metadata keys and tensor names (llama, qwen2, qwen3,
 * bloom, mpt, gemma2, gemma3, phi3). Without --arch it is a llama model with RoPE, the default of
 * `make run`; --position alibi|t5 gives a llama-shaped model with an
 * offset-only bias instead (kvd's own kvd.position.* metadata).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "config/args.h"
#include "model/mkmodel.h"
#include "model/quant.h"

static void mkmodel_usage(FILE *f)
{
    struct model_mk_params d;
    model_mk_defaults(&d);
    fprintf(f,
            "usage: kvd mkmodel --out FILE [options]\n"
            "  --out FILE        where to write the GGUF file (required)\n"
            "  --preset retrieval  computed weights that copy what followed an earlier\n"
            "                    occurrence of the current context (with --position;\n"
            "                    only --ctx and --seed may be given besides)\n"
            "  --arch A          llama, qwen2, qwen3, bloom, mpt, gemma2, gemma3 or phi3\n"
            "                    (default %s)\n"
            "  --position P      rope, alibi or t5 (default: rope for llama/qwen2,\n"
            "                    alibi for bloom/mpt, which run only alibi)\n"
            "  --alibi-max-bias F  ALiBi slopes' max_bias (default 8; bloom: always 8)\n"
            "  --clamp-kqv F     mpt: clamp q, k, v to +-F (default 0: off)\n"
            "  --t5-buckets N    t5: bias table buckets (default %d)\n"
            "  --t5-max-distance N  t5: distance of the last bucket (default %d)\n"
            "  --dim N           model width (default %d)\n"
            "  --layers N        transformer blocks (default %d)\n"
            "  --heads N         query heads (default %d)\n"
            "  --head-dim N      elements per head (default: dim / heads; Gemma: 256)\n"
            "  --kv-heads N      key/value heads, dividing heads (default %d)\n"
            "  --ff N            feed-forward width (default %d)\n"
            "  --vocab N         vocabulary size, >= 260 (default %d)\n"
            "  --rope-dims N     rotated dims per head (default: the head dim)\n"
            "  --rope-theta F    RoPE base (default %g)\n"
            "  --rope-scaling S  none, linear or yarn, with --rope-factor F and\n"
            "                    (yarn) --rope-orig-ctx N; longrope (phi3) with\n"
            "                    --rope-orig-ctx N: Phi-3's long/short factor tables\n"
            "  --rope-freqs      write Llama 3.1's rope_freqs.weight (llama3 scaling)\n"
            "  --sliding-window N  every layer attends to the last N positions (Mistral;\n"
            "                    Gemma: the local layers; gemma3 needs it)\n"
            "  --attn-softcap F, --final-softcap F  gemma2: the soft-caps written\n"
            "                    (default: none written, the loader's 50 and 30 apply)\n"
            "  --rope-theta-swa F  gemma3: the local layers' RoPE base (default: none\n"
            "                    written, 10000 applies)\n"
            "  --ctx N           context_length written to the metadata (default %d)\n"
            "  --tied            no output.weight: logits from the token embedding\n"
            "                    (bloom is always tied)\n"
            "  --type T          f32, f16, bf16, q8_0, q4_0, q2_K, q3_K, q4_K, q5_K or q6_K (default f32)\n"
            "  --seed S          seed of every weight (default %llu)\n",
            d.arch, d.t5_num_buckets, d.t5_max_distance, d.n_embd, d.n_layer, d.n_head,
            d.n_kv_head, d.n_ff, d.n_vocab, d.rope_theta, d.n_ctx_train,
            (unsigned long long)d.seed);
}

int srv_cmd_mkmodel(int argc, char **argv)
{
    struct model_mk_params p;
    model_mk_defaults(&p);
    const char *out = NULL, *preset = NULL;
    const char *shape_opt = NULL; /* the first option a preset does not take */
    bool ctx_given = false;
    bool bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        long n;
        double x;
        struct {
            const char *name;
            int *dst;
            long min, max;
        } ints[] = {
            {"--dim", &p.n_embd, 2, 65536},      {"--layers", &p.n_layer, 1, 1024},
            {"--heads", &p.n_head, 1, 4096},     {"--kv-heads", &p.n_kv_head, 1, 4096},
            {"--ff", &p.n_ff, 1, 1 << 20},       {"--vocab", &p.n_vocab, 260, 1 << 20},
            {"--rope-dims", &p.rope_dims, 2, 1024}, {"--ctx", &p.n_ctx_train, 1, INT32_MAX},
            {"--t5-buckets", &p.t5_num_buckets, 4, 4096},
            {"--t5-max-distance", &p.t5_max_distance, 1, 1 << 20},
            {"--rope-orig-ctx", &p.rope_orig_ctx, 1, INT32_MAX},
            {"--sliding-window", &p.sliding_window, 1, INT32_MAX},
            {"--head-dim", &p.head_dim, 2, 1024},
        };
        bool matched = false;
        struct {
            const char *name;
            float *dst;
        } floats[] = {{"--attn-softcap", &p.attn_softcap},
                      {"--final-softcap", &p.final_softcap},
                      {"--rope-theta-swa", &p.rope_theta_swa}};
        for (size_t k = 0; k < sizeof(floats) / sizeof(floats[0]) && !matched; k++) {
            if (srv_opt_value(argc, argv, &i, "mkmodel", floats[k].name, &v, &bad)) {
                matched = true;
                if (!bad && srv_parse_double(v, 1e-3, 1e12, &x)) {
                    fprintf(stderr, "kvd mkmodel: %s wants a positive number, got '%s'\n",
                            floats[k].name, v);
                    return 2;
                }
                *floats[k].dst = (float)x;
                shape_opt = shape_opt ? shape_opt : floats[k].name;
            }
        }
        for (size_t k = 0; k < sizeof(ints) / sizeof(ints[0]) && !matched; k++) {
            if (srv_opt_value(argc, argv, &i, "mkmodel", ints[k].name, &v, &bad)) {
                matched = true;
                if (bad)
                    break;
                if (srv_parse_long(v, ints[k].min, ints[k].max, &n)) {
                    fprintf(stderr, "kvd mkmodel: %s wants an integer in [%ld, %ld], got '%s'\n",
                            ints[k].name, ints[k].min, ints[k].max, v);
                    return 2;
                }
                *ints[k].dst = (int)n;
                if (ints[k].dst == &p.n_ctx_train)
                    ctx_given = true;
                else if (!shape_opt)
                    shape_opt = ints[k].name;
            }
        }
        if (matched)
            continue;
        const char *opt = argv[i];
        if (strcmp(opt, "--out") && strcmp(opt, "--position") && strcmp(opt, "--seed") &&
            strcmp(opt, "--preset") && strcmp(opt, "--help") && strcmp(opt, "-h") && !shape_opt)
            shape_opt = opt;
        if (srv_opt_value(argc, argv, &i, "mkmodel", "--out", &v, &bad)) {
            out = v;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--preset", &v, &bad)) {
            preset = v;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--arch", &v, &bad)) {
            p.arch = v;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--position", &v, &bad)) {
            p.position = v;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--alibi-max-bias", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 1e-3, 1024.0, &x)) {
                fprintf(stderr, "kvd mkmodel: --alibi-max-bias wants a number in [0.001, 1024], "
                        "got '%s'\n", v);
                return 2;
            }
            p.alibi_max_bias = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--clamp-kqv", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 0.0, 1e6, &x)) {
                fprintf(stderr, "kvd mkmodel: --clamp-kqv wants a number >= 0, got '%s'\n", v);
                return 2;
            }
            p.clamp_kqv = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--type", &v, &bad)) {
            if (!bad && model_mk_parse_type(v, &p.type)) {
                fprintf(stderr, "kvd mkmodel: --type wants f32, f16, bf16, q8_0, q4_0, q2_K, q3_K, q4_K, q5_K or q6_K, "
                        "got '%s'\n",
                        v);
                return 2;
            }
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--rope-theta", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 1e-3, 1e12, &x)) {
                fprintf(stderr, "kvd mkmodel: --rope-theta wants a positive number, got '%s'\n", v);
                return 2;
            }
            p.rope_theta = (float)x;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--rope-scaling", &v, &bad)) {
            p.rope_scaling = v;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--rope-factor", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_double(v, 1e-3, 1e6, &x)) {
                fprintf(stderr, "kvd mkmodel: --rope-factor wants a positive number, got '%s'\n",
                        v);
                return 2;
            }
            p.rope_scale_factor = (float)x;
        } else if (!strcmp(argv[i], "--rope-freqs")) {
            p.rope_freqs = true;
            i++;
        } else if (srv_opt_value(argc, argv, &i, "mkmodel", "--seed", &v, &bad)) {
            char *end;
            if (!bad) {
                p.seed = strtoull(v, &end, 10);
                if (!*v || *end || *v == '-') {
                    fprintf(stderr, "kvd mkmodel: --seed wants a non-negative integer, got '%s'\n",
                            v);
                    return 2;
                }
            }
        } else if (!strcmp(argv[i], "--tied")) {
            p.tied = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            mkmodel_usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvd mkmodel: unknown option '%s'\n", argv[i]);
            mkmodel_usage(stderr);
            return 2;
        }
    }
    if (bad)
        return 2;
    if (!out) {
        fprintf(stderr, "kvd mkmodel: --out FILE is required\n");
        mkmodel_usage(stderr);
        return 2;
    }
    char err[512];
    if (preset) {
        struct model_mk_params q;
        if (shape_opt) {
            fprintf(stderr, "kvd mkmodel: --preset %s fixes the shape; %s cannot be given with "
                            "it (only --position, --ctx and --seed)\n", preset, shape_opt);
            return 2;
        }
        if (model_mk_preset(&q, preset, p.position, err, sizeof(err))) {
            fprintf(stderr, "kvd mkmodel: %s\n", err);
            return 2;
        }
        q.seed = p.seed;
        if (ctx_given)
            q.n_ctx_train = p.n_ctx_train;
        p = q;
    }
    if (model_mk_check(&p, err, sizeof(err))) {
        fprintf(stderr, "kvd mkmodel: %s\n", err);
        return 2;
    }
    if (model_mk_write(&p, out, err, sizeof(err))) {
        fprintf(stderr, "kvd mkmodel: %s\n", err);
        return 1;
    }
    if (preset) {
        printf("wrote %s: the %s model (%s, %s positions, dim %d, %d layers, %d heads, "
               "%d kv head; computed weights)\n",
               out, preset, p.arch, model_mk_position(&p), p.n_embd, p.n_layer, p.n_head,
               p.n_kv_head);
        return 0;
    }
    int hd = model_mk_head_dim(&p);
    bool gelu = !strcmp(p.arch, "bloom") || !strcmp(p.arch, "mpt"); /* no gate */
    bool tied = p.tied || !strcmp(p.arch, "bloom") || !strncmp(p.arch, "gemma", 5);
    long long params = (long long)p.n_embd * p.n_vocab * (tied ? 1 : 2) +
                       (long long)p.n_layer *
                           ((long long)p.n_embd * (p.n_head + 2 * p.n_kv_head) * hd +
                            (long long)p.n_head * hd * p.n_embd +
                            (gelu ? 2LL : 3LL) * p.n_embd * p.n_ff);
    const char *tn = qt_type_name(p.type);
    printf("wrote %s: %s, %s positions, dim %d, %d layers, %d heads, %d kv heads, ff %d, "
           "vocab %d, %s%s, %.2fM parameters, seed %llu\n",
           out, p.arch, model_mk_position(&p), p.n_embd, p.n_layer, p.n_head, p.n_kv_head, p.n_ff,
           p.n_vocab, tn, tied ? ", tied output" : "", (double)params / 1e6,
           (unsigned long long)p.seed);
    return 0;
}
