/*
 * fuzz_tokenizer.c - libFuzzer target for both tokenizers: the first byte
 * picks a vocabulary (SentencePiece-style llama-spm, or byte-level BPE:
 * gpt-2, starcoder, falcon, from $KVD_SHARED/vocab), the rest is the text.
 * The text is encoded (every id inside the vocabulary, the length the same
 * however large the output buffer), then decoded through the streaming
 * detokenizer one id at a time. The decoded text must be valid UTF-8, and
 * for a text that is valid UTF-8 itself it must be the text again (behind
 * SentencePiece's dummy-prefix space): both tokenizers fall back to
 * bytes, so nothing may be lost or invented, except where the vocabulary
 * has no token for a byte (starcoder lacks some of GPT-2's byte
 * characters) and the byte became the vocabulary's unknown token. Built
 * and run by `make fuzz`.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

static const char *const vocabs[] = {"llama-spm", "gpt-2", "starcoder", "falcon"};
#define N_VOCABS (int)(sizeof(vocabs) / sizeof(vocabs[0]))
static model *models[N_VOCABS];
static int n_vocab[N_VOCABS];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    const char *shared = getenv("KVD_SHARED");
    for (int i = 0; i < N_VOCABS; i++) {
        char path[4096], err[512];
        snprintf(path, sizeof(path), "%s/vocab/ggml-vocab-%s.gguf", shared ? shared : "../shared",
                 vocabs[i]);
        struct model_params p = {.path = path, .vocab_only = true};
        models[i] = model_load(&p, err, sizeof(err));
        if (!models[i]) {
            fprintf(stderr, "fuzz_tokenizer: %s: %s (set KVD_SHARED)\n", path, err);
            exit(1);
        }
        struct model_info info;
        model_get_info(models[i], &info);
        n_vocab[i] = info.n_vocab;
    }
    return 0;
}

/* Whether s[0..n) is valid UTF-8 (no overlongs, surrogates or > U+10FFFF). */
static bool utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned c = s[i];
        size_t k = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (k == 0 || i + k > n)
            return false;
        uint32_t cp = k == 1 ? c : k == 2 ? c & 0x1f : k == 3 ? c & 0x0f : c & 0x07;
        for (size_t j = 1; j < k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return false;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        static const uint32_t min[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min[k] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        i += k;
    }
    return true;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    int v = data[0] % N_VOCABS;
    const model *m = models[v];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;

    /* Encode: the count first (no room), then the ids. */
    int n = model_tokenize(m, text, len, false, NULL, 0);
    if (n < 0)
        return 0; /* refused (an error code), never a crash */
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    if (model_tokenize(m, text, len, false, ids, n + 1) != n)
        __builtin_trap();
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_vocab[v])
            __builtin_trap();

    /* Decode one id at a time. */
    size_t cap = len * 4 + 64, out_len = 0;
    char *out = malloc(cap);
    model_detok *d = model_detok_create(m);
    for (int i = 0; i < n; i++) {
        if (cap - out_len < 256) {
            cap *= 2;
            out = realloc(out, cap);
        }
        int k = model_detok_push(d, ids[i], out + out_len, cap - out_len);
        if (k < 0)
            __builtin_trap();
        out_len += (size_t)k;
    }
    if (cap - out_len < 64)
        out = realloc(out, cap += 64);
    int k = model_detok_flush(d, out + out_len, cap - out_len);
    if (k < 0)
        __builtin_trap();
    out_len += (size_t)k;
    model_detok_destroy(d);

    if (!utf8_valid((const unsigned char *)out, out_len))
        __builtin_trap();
    /* SentencePiece encodes a non-empty text with its dummy prefix (a
     * space), and the streaming detokenizer keeps it, as a continuation
     * must: the text comes back behind one space. */
    size_t pre = v == 0 && len > 0 ? 1 : 0;
    /* ... and it writes a space as U+2581, so a literal U+2581 in the text
     * comes back as a space (SentencePiece's own ambiguity). */
    bool lossy = v == 0 && memmem(text, len, "\xe2\x96\x81", 3);
    for (int i = 0; i < n; i++)
        lossy = lossy || ids[i] == model_unk(m);
    if (!lossy && utf8_valid((const unsigned char *)text, len) &&
        (out_len != len + pre || (pre && out[0] != ' ') || memcmp(out + pre, text, len) != 0))
        __builtin_trap();
    free(out);
    free(ids);
    return 0;
}
