/*
 * bench_tokenizer.c - encoding and streaming-decoding speed of the SPM and
 * BPE tokenizers on the shared TinyStories text.
 *
 * For each vocabulary it encodes a tenth of the text and the whole of it
 * and prints the ratio of the two times next to the ratio of the sizes:
 * an encoder that is O(n log n) stays near the size ratio, a quadratic one
 * would show its square. Best of three runs each.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "model/gguf.h"
#include "model/tokenizer.h"
#include "tests/bench/bench_util.h"

static char *read_file(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        fclose(fp);
        free(buf);
        return NULL;
    }
    fclose(fp);
    buf[n] = '\0';
    *len = (size_t)n;
    return buf;
}

/* Best of three encodes of text[0..len): seconds; *n_tokens set. */
static double time_encode(const tok_vocab *v, const char *text, size_t len, int *n_tokens)
{
    double best = 1e30;
    int32_t *ids = NULL;
    for (int r = 0; r < 3; r++) {
        double t0 = bench_now();
        int n = tok_encode(v, text, len, false, NULL, 0);
        if (n < 0)
            return -1;
        free(ids);
        ids = malloc(sizeof *ids * ((size_t)n + 1));
        if (!ids || tok_encode(v, text, len, false, ids, n) != n)
            return -1;
        double t = bench_now() - t0;
        if (t < best)
            best = t;
        *n_tokens = n;
    }
    free(ids);
    return best / 2; /* each run encoded twice: count, then fill */
}

static double time_stream(const tok_vocab *v, const char *text, size_t len, size_t *out_len)
{
    int n = tok_encode(v, text, len, false, NULL, 0);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    size_t cap = tok_stream_max_out(v);
    char *buf = malloc(cap);
    if (!ids || !buf || tok_encode(v, text, len, false, ids, n) != n)
        return -1;
    double best = 1e30;
    for (int r = 0; r < 3; r++) {
        double t0 = bench_now();
        struct tok_stream s;
        tok_stream_init(&s, v, true);
        size_t total = 0;
        for (int i = 0; i < n; i++)
            total += (size_t)tok_stream_push(&s, v, ids[i], buf, cap);
        total += (size_t)tok_stream_flush(&s, buf, cap);
        double t = bench_now() - t0;
        if (t < best)
            best = t;
        *out_len = total;
    }
    free(ids);
    free(buf);
    return best;
}

static void bench(const char *shared, const char *rel, const char *text, size_t len)
{
    char path[1024], err[256];
    snprintf(path, sizeof path, "%s/%s", shared, rel);
    gguf_file *f = gguf_open(path, err, sizeof err);
    if (!f) {
        printf("%-32s skipped: %s\n", rel, err);
        return;
    }
    double t0 = bench_now();
    tok_vocab *v = tok_load(f, err, sizeof err);
    double t_load = bench_now() - t0;
    gguf_close(f);
    if (!v) {
        printf("%-32s tok_load: %s\n", rel, err);
        return;
    }
    size_t small = len / 10;
    while (small < len && (text[small] & 0xC0) == 0x80)
        small++;
    int n_small = 0, n_all = 0;
    double ts = time_encode(v, text, small, &n_small);
    double ta = time_encode(v, text, len, &n_all);
    size_t out_len = 0;
    double td = time_stream(v, text, len, &out_len);
    printf("%-32s load %6.1f ms | encode %7zu B -> %6d tok %7.2f ms (%6.1f MB/s) | "
           "%6zu B %6.2f ms | time ratio %5.2f for size ratio %5.2f | stream decode %6.1f "
           "Mtok/s\n",
           rel, 1e3 * t_load, len, n_all, 1e3 * ta, (double)len / ta / 1e6, small, 1e3 * ts,
           ta / ts, (double)len / (double)small, (double)n_all / td / 1e6);
    if (out_len != len)
        printf("  decode gave %zu bytes, not %zu\n", out_len, len);
    tok_free(v);
}

int main(void)
{
    const char *shared = getenv("KVD_SHARED");
    if (!shared || !*shared)
        shared = "../shared";
    char path[1024];
    snprintf(path, sizeof path, "%s/data/tinystories-train-head-197k.txt", shared);
    size_t len;
    char *text = read_file(path, &len);
    if (!text) {
        printf("bench_tokenizer: %s absent, nothing to measure\n", path);
        return 0;
    }
    bench(shared, "models/stories260K.gguf", text, len);
    bench(shared, "vocab/ggml-vocab-llama-spm.gguf", text, len);
    bench(shared, "vocab/ggml-vocab-phi-3.gguf", text, len);
    bench(shared, "vocab/ggml-vocab-gpt-2.gguf", text, len);
    bench(shared, "vocab/ggml-vocab-starcoder.gguf", text, len);
    bench(shared, "vocab/ggml-vocab-falcon.gguf", text, len);
    free(text);
    return 0;
}
