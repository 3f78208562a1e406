/*
 * bench_template.c - chat-template render speed.
 *
 * Renders conversations of 10, 100, 1000 and 10000 messages (alternating
 * user and assistant, 200 bytes of text each, a system message first) with
 * three real templates of tests/cases/templates/models: ChatML (the
 * default), Llama 3.2 (tojson of tools, strftime_now) and Qwen 3 (two
 * loops, a reversed slice, string methods per message). Prints the best of
 * a few trials per size: microseconds per message and MB/s of output, so
 * linearity in the conversation's length shows as flat columns. Printed,
 * never asserted. Run from the repository's root (`make bench`).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "template/template.h"
#include "tests/bench/bench_util.h"

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b)
        b[n] = 0;
    fclose(f);
    *len = (size_t)n;
    return b;
}

static json_t *conversation(int n)
{
    char text[201];
    memset(text, 'x', 200);
    for (int i = 0; i < 200; i += 6)
        text[i] = ' ';
    text[200] = 0;
    json_t *m = json_pack("[{s:s,s:s}]", "role", "system", "content", "You are helpful.");
    for (int i = 0; i < n; i++)
        json_array_append_new(m, json_pack("{s:s,s:s}", "role", i % 2 ? "assistant" : "user",
                                           "content", text));
    return m;
}

int main(void)
{
    static const char *const models[] = {"chatml-openhermes", "llama-3.2", "qwen3"};
    static const int sizes[] = {10, 100, 1000, 3000, 10000, 30000};
    double load[1];
    if (getloadavg(load, 1) == 1)
        printf("load average at start: %.2f\n", load[0]);
    printf("%-18s %8s %12s %10s\n", "template", "messages", "us/message", "MB/s out");
    for (size_t t = 0; t < sizeof models / sizeof models[0]; t++) {
        char path[256];
        snprintf(path, sizeof path, "tests/cases/templates/models/%s.jinja", models[t]);
        size_t len;
        char *src = slurp(path, &len);
        if (!src) {
            printf("%s: cannot read (run from the repository's root)\n", path);
            return 1;
        }
        struct tpl_chat_params p = {.bos_token = "<s>", .eos_token = "</s>"};
        struct tpl_error err;
        tpl_chat *c = tpl_chat_create(src, len, &p, &err);
        free(src);
        if (!c) {
            printf("%s: %s\n", models[t], err.msg);
            return 1;
        }
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            json_t *msgs = conversation(sizes[k]);
            double best = 1e30;
            size_t out_len = 0;
            int trials = sizes[k] >= 10000 ? 3 : 10;
            for (int r = 0; r < trials; r++) {
                char *out;
                double t0 = bench_now();
                if (tpl_chat_render(c, msgs, NULL, true, 0, &out, &out_len, &err) < 0) {
                    printf("%s: %s\n", models[t], err.msg);
                    return 1;
                }
                double dt = bench_now() - t0;
                best = dt < best ? dt : best;
                free(out);
            }
            printf("%-18s %8d %12.2f %10.1f\n", models[t], sizes[k], best * 1e6 / sizes[k],
                   (double)out_len / best / 1e6);
            json_decref(msgs);
        }
        tpl_chat_destroy(c);
    }
    return 0;
}
