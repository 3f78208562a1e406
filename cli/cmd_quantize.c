/*
 * cmd_quantize.c - `kvd quantize IN OUT --type T`: rewrite a GGUF file's
 * weight matrices as q8_0, q4_0, q4_1, q5_0, q5_1, q2_K to q6_K, iq4_xs or the q4_K_M / q5_K_M
 * mixes (model/requantize.c has the rules). Prints each tensor whose type
 * differs from the rule's (a fallback, and why) and a summary.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "config/args.h"
#include "model/quant.h"
#include "model/requantize.h"

static void quantize_usage(FILE *f)
{
    fprintf(f, "usage: kvd quantize IN.gguf OUT.gguf --type T [--threads N] [--verbose]\n"
               "  --type T     q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K,\n"
               "               q4_K_M, q5_K_M or iq4_xs\n"
               "               (the K mixes: output and, in the first and last eighth and\n"
               "               every third layer between, attn_v and ffn_down as q6_K)\n"
               "  --threads N  quantising threads (default: all)\n"
               "  --verbose    print every tensor's type, not only the fallbacks\n");
}

struct report {
    bool verbose;
};

static void print_tensor(void *ctx, const char *tensor, enum ggml_type from, enum ggml_type to,
                         const char *note)
{
    const struct report *r = ctx;
    if (note || r->verbose)
        printf("  %-36s %-6s -> %-6s%s%s\n", tensor, qt_type_name(from) ? qt_type_name(from) : "?",
               qt_type_name(to) ? qt_type_name(to) : "?", note ? "  " : "", note ? note : "");
}

int srv_cmd_quantize(int argc, char **argv)
{
    const char *paths[2] = {NULL, NULL}, *type = NULL, *v;
    long threads = 0;
    bool bad = false;
    struct report rep = {false};
    int np = 0;
    for (int i = 1; i < argc && !bad;) {
        if (srv_opt_value(argc, argv, &i, "quantize", "--type", &v, &bad)) {
            type = v;
        } else if (srv_opt_value(argc, argv, &i, "quantize", "--threads", &v, &bad)) {
            if (!bad && srv_parse_long(v, 0, 1024, &threads)) {
                fprintf(stderr, "kvd quantize: --threads wants an integer in [0, 1024], got "
                        "'%s'\n", v);
                return 2;
            }
        } else if (!strcmp(argv[i], "--verbose")) {
            rep.verbose = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            quantize_usage(stdout);
            return 0;
        } else if (argv[i][0] != '-' && np < 2) {
            paths[np++] = argv[i++];
        } else {
            fprintf(stderr, "kvd quantize: unexpected argument '%s'\n", argv[i]);
            quantize_usage(stderr);
            return 2;
        }
    }
    if (bad)
        return 2;
    const struct model_quant_target *tg = model_quant_target(type);
    if (np != 2 || !tg) {
        if (type && !tg)
            fprintf(stderr, "kvd quantize: --type '%s' is not one kvd writes\n", type);
        quantize_usage(stderr);
        return 2;
    }
    struct model_quant_params p = {.in = paths[0],
                                   .out = paths[1],
                                   .target = tg,
                                   .n_threads = (int)threads,
                                   .report = print_tensor,
                                   .report_ctx = &rep};
    struct model_quant_stats st;
    char err[512] = "";
    if (model_quantize(&p, &st, err, sizeof(err))) {
        fprintf(stderr, "kvd quantize: %s\n", err);
        return 1;
    }
    printf("wrote %s: %s, %d tensors (%d rewritten, %d kept, %d fallbacks), %.2f MB -> "
           "%.2f MB\n",
           paths[1], tg->name, st.tensors, st.quantized, st.kept, st.fallbacks,
           (double)st.bytes_in / 1e6, (double)st.bytes_out / 1e6);
    return 0;
}
