/*
 * test_tokenizer.c - SentencePiece-style and byte-level BPE tokenizers.
 *
 * The heart of it is the reference vectors in $KVD_SHARED/vocab: for each
 * vocabulary every test string must encode (without BOS) to exactly the
 * ids the reference tokenizer gave, and decode back to itself. Small
 * vocabularies built in memory with the GGUF writer pin down each rule on
 * its own (best-score order, merge rank order, space prefix, user-defined
 * and control tokens, every pre-tokenizer family) and every hostile-input
 * error, so those run even without the shared files.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/gguf.h"
#include "model/tokenizer.h"

#define SP "\xe2\x96\x81" /* "▁" */

/* ------------------------------------------------------------------------
 * Helpers
 * ------------------------------------------------------------------------ */

static const char *shared_dir(void)
{
    const char *s = getenv("KVD_SHARED");
    return s && *s ? s : "../shared";
}

/* Whole file into a new NUL-terminated buffer, or NULL. */
static char *read_file(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, fp), (size_t)n);
    buf[n] = '\0';
    fclose(fp);
    if (len)
        *len = (size_t)n;
    return buf;
}

/* Load a vocabulary from a GGUF file (closed again before use, which
 * checks that tok_load copied what it needs). NULL when the file is absent. */
static tok_vocab *load_path(const char *path)
{
    char err[512];
    gguf_file *f = gguf_open(path, err, sizeof err);
    if (!f)
        return NULL;
    tok_vocab *v = tok_load(f, err, sizeof err);
    if (!v)
        fail_msg("tok_load(%s): %s", path, err);
    gguf_close(f);
    return v;
}

/* Serialise a writer and load a tokenizer from the bytes, with the
 * pre-tokenizer forced (NULL: the file's); the writer is destroyed.
 * Returns NULL with the error in err. */
static tok_vocab *load_writer_forced(gguf_writer *w, const char *force, char *err, size_t errlen)
{
    void *buf;
    size_t size;
    assert_int_equal(gguf_writer_to_memory(w, &buf, &size), 0);
    gguf_writer_destroy(w);
    gguf_file *f = gguf_open_memory(buf, size, err, errlen);
    if (!f)
        fail_msg("gguf_open_memory: %s", err);
    tok_vocab *v = tok_load_forced(f, force, err, errlen);
    gguf_close(f);
    free(buf);
    return v;
}

static tok_vocab *load_writer(gguf_writer *w, char *err, size_t errlen)
{
    return load_writer_forced(w, NULL, err, errlen);
}

/* Encode without BOS into a fixed array; returns the count. */
static int enc(const tok_vocab *v, const char *s, int32_t *ids, int max)
{
    int n = tok_encode(v, s, strlen(s), false, ids, max);
    assert_true(n >= 0);
    assert_true(n <= max);
    return n;
}

static void expect_ids(const tok_vocab *v, const char *s, const int32_t *want, int n_want)
{
    int32_t got[256];
    int n = enc(v, s, got, 256);
    if (n != n_want || (n > 0 && memcmp(got, want, sizeof *got * (size_t)n) != 0)) {
        char buf[1024];
        size_t o = 0;
        for (int i = 0; i < n && o < sizeof buf - 16; i++)
            o += (size_t)snprintf(buf + o, sizeof buf - o, " %d", got[i]);
        buf[o] = '\0';
        fail_msg("'%s': got%s (%d ids, want %d)", s, buf, n, n_want);
    }
}

/* Decode ids as a whole text into a new NUL-terminated string. */
static char *dec(const tok_vocab *v, const int32_t *ids, int n, bool at_start)
{
    int len = tok_decode(v, ids, n, at_start, NULL, 0);
    assert_true(len >= 0);
    char *s = malloc((size_t)len + 1);
    assert_non_null(s);
    assert_int_equal(tok_decode(v, ids, n, at_start, s, (size_t)len), len);
    s[len] = '\0';
    return s;
}

/* Whether s[0..n) is well-formed UTF-8 (no partial or invalid sequence). */
static bool utf8_valid(const unsigned char *s, size_t n)
{
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t k = c < 0x80                 ? 1
                   : c >= 0xC2 && c <= 0xDF ? 2
                   : c >= 0xE0 && c <= 0xEF ? 3
                   : c >= 0xF0 && c <= 0xF4 ? 4
                                            : 0;
        if (k == 0 || i + k > n)
            return false;
        for (size_t j = 1; j < k; j++)
            if ((s[i + j] & 0xC0) != 0x80)
                return false;
        if ((c == 0xE0 && s[i + 1] < 0xA0) || (c == 0xED && s[i + 1] > 0x9F) ||
            (c == 0xF0 && s[i + 1] < 0x90) || (c == 0xF4 && s[i + 1] > 0x8F))
            return false;
        i += k;
    }
    return true;
}

/* ------------------------------------------------------------------------
 * Small vocabularies built in memory
 * ------------------------------------------------------------------------ */

/* An SPM vocabulary: <unk> <s> </s>, the 256 byte tokens, then extra
 * pieces with their scores and types (0 = normal). */
static gguf_writer *spm_writer(const char *const *extra, const float *scores, const int32_t *types,
                               int n_extra)
{
    int n = 3 + 256 + n_extra;
    const char **toks = calloc((size_t)n, sizeof *toks);
    char(*bytes)[8] = calloc(256, sizeof *bytes);
    float *sc = calloc((size_t)n, sizeof *sc);
    int32_t *ty = calloc((size_t)n, sizeof *ty);
    assert_true(toks && bytes && sc && ty);
    toks[0] = "<unk>";
    toks[1] = "<s>";
    toks[2] = "</s>";
    ty[0] = 2;
    ty[1] = ty[2] = 3;
    for (int b = 0; b < 256; b++) {
        snprintf(bytes[b], sizeof bytes[b], "<0x%02X>", b);
        toks[3 + b] = bytes[b];
        ty[3 + b] = 6;
    }
    for (int i = 0; i < n_extra; i++) {
        toks[259 + i] = extra[i];
        sc[259 + i] = scores ? scores[i] : -(float)i;
        ty[259 + i] = types && types[i] ? types[i] : 1;
    }
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), 0);
    assert_int_equal(gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n), 0);
    assert_int_equal(gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", sc, (uint64_t)n), 0);
    assert_int_equal(gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", ty, (uint64_t)n), 0);
    assert_int_equal(gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 1), 0);
    assert_int_equal(gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2), 0);
    free(toks);
    free(bytes);
    free(sc);
    free(ty);
    return w;
}

/* A byte-level BPE vocabulary: the 256 byte characters (ids 0..255 in
 * byte order), then extra tokens, merges and pre-tokenizer name. */
static gguf_writer *bpe_writer(const char *const *extra, int n_extra, const char *const *merges,
                               int n_merges, const char *pre)
{
    int n = 256 + n_extra;
    const char **toks = calloc((size_t)n, sizeof *toks);
    char(*chars)[4] = calloc(256, sizeof *chars);
    assert_true(toks && chars);
    for (int b = 0; b < 256; b++) {
        /* GPT-2's table: printable bytes are themselves, the rest U+0100.. */
        bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        unsigned cp = printable   ? (unsigned)b
                      : b <= 0x20 ? 0x100u + (unsigned)b
                      : b <= 0xA0 ? 0x100u + 33 + (unsigned)(b - 0x7F)
                                  : 0x100u + 67;
        if (cp < 0x80) {
            chars[b][0] = (char)cp;
        } else {
            chars[b][0] = (char)(0xC0 | (cp >> 6));
            chars[b][1] = (char)(0x80 | (cp & 0x3F));
        }
        toks[b] = chars[b];
    }
    for (int i = 0; i < n_extra; i++)
        toks[256 + i] = extra[i];
    gguf_writer *w = gguf_writer_create();
    assert_non_null(w);
    assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"), 0);
    assert_int_equal(gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, (uint64_t)n), 0);
    static const char *const none[1] = {""};
    assert_int_equal(gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", n_merges ? merges : none,
                                             (uint64_t)n_merges),
                     0);
    if (pre)
        assert_int_equal(gguf_writer_set_str(w, "tokenizer.ggml.pre", pre), 0);
    free(toks);
    free(chars);
    return w;
}

static tok_vocab *must_load(gguf_writer *w)
{
    char err[256];
    tok_vocab *v = load_writer(w, err, sizeof err);
    if (!v)
        fail_msg("tok_load: %s", err);
    return v;
}

/* ------------------------------------------------------------------------
 * Reference vectors from the shared vocabularies
 * ------------------------------------------------------------------------ */

struct vocab_case {
    const char *name;
    enum tok_kind kind;
    const char *pre;
};

/*
 * Encode every test string of NAME.gguf.inp and compare with NAME.gguf.out;
 * decode each encoding and compare with the string. The .inp file is each
 * string followed by "\n__ggml_vocab_test__\n" (so a string's own trailing
 * newlines are the ones before that separator line); the .out file has one
 * line of space-separated ids per string.
 */
static void run_vocab(const struct vocab_case *c)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-%s.gguf", shared_dir(), c->name);
    tok_vocab *v = load_path(path);
    if (!v) {
        print_message("%s absent: set KVD_SHARED to the shared data folder\n", path);
        skip();
    }
    assert_int_equal(tok_get_kind(v), c->kind);
    assert_string_equal(tok_pre_name(v), c->pre);
    assert_null(tok_warning(v));

    char *inp, *outp;
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-%s.gguf.inp", shared_dir(), c->name);
    assert_non_null(inp = read_file(path, NULL));
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-%s.gguf.out", shared_dir(), c->name);
    assert_non_null(outp = read_file(path, NULL));

    static const char SEP[] = "\n__ggml_vocab_test__\n";
    int total = 0, passed = 0, round_trips = 0;
    char *s = inp, *line = outp;
    int32_t ids[4096], want[4096];
    for (char *end; (end = strstr(s, SEP)) != NULL; s = end + strlen(SEP)) {
        size_t len = (size_t)(end - s);
        char *eol = strchr(line, '\n');
        assert_non_null(eol);
        *eol = '\0';
        int n_want = 0;
        for (char *p = line, *q;; p = q) {
            long x = strtol(p, &q, 10);
            if (q == p)
                break;
            assert_true(n_want < 4096);
            want[n_want++] = (int32_t)x;
        }
        line = eol + 1;

        int n = tok_encode(v, s, len, false, ids, 4096);
        assert_true(n >= 0 && n <= 4096);
        bool ok = n == n_want && memcmp(ids, want, sizeof *ids * (size_t)n) == 0;
        if (!ok) {
            print_message("%s: string %d '%.*s' encodes differently (%d ids, want %d)\n", c->name,
                          total, (int)(len > 60 ? 60 : len), s, n, n_want);
            for (int i = 0; i < n || i < n_want; i++)
                if (i >= n || i >= n_want || ids[i] != want[i]) {
                    print_message("  first difference at %d: got %d want %d\n", i,
                                  i < n ? ids[i] : -1, i < n_want ? want[i] : -1);
                    break;
                }
        }
        passed += ok;

        /* Round trip: every supported vocabulary is lossless on these. */
        char *back = dec(v, ids, n, true);
        if (strlen(back) == len && memcmp(back, s, len) == 0)
            round_trips++;
        else
            print_message("%s: string %d does not decode back: '%s'\n", c->name, total, back);
        free(back);
        total++;
    }
    print_message("%s: %d/%d strings encode as expected, %d/%d decode back\n", c->name, passed,
                  total, round_trips, total);
    assert_true(total >= 40);
    assert_int_equal(passed, total);
    assert_int_equal(round_trips, total);
    free(inp);
    free(outp);
    tok_free(v);
}

static void test_vocab_llama_spm(void **state)
{
    (void)state;
    run_vocab(&(struct vocab_case){"llama-spm", TOK_KIND_SPM, "spm"});
}

static void test_vocab_phi3(void **state)
{
    (void)state;
    run_vocab(&(struct vocab_case){"phi-3", TOK_KIND_SPM, "spm"});
}

/* Phi-3's specials: "</s>" is user-defined there (matched whole in text),
 * EOS is <|endoftext|>, and <|end|> ends a turn. */
static void test_vocab_phi3_specials(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-phi-3.gguf", shared_dir());
    tok_vocab *v = load_path(path);
    if (!v) {
        print_message("%s absent: set KVD_SHARED to the shared data folder\n", path);
        skip();
    }
    assert_int_equal(tok_token_type(v, 2), TOK_TYPE_USER_DEFINED);
    int32_t ids[16];
    int n = enc(v, "a</s>b", ids, 16);
    assert_int_equal(n, 3);
    assert_int_equal(ids[1], 2);
    assert_int_equal(tok_eos(v), 32000);
    assert_true(tok_is_eog(v, 32000));
    assert_true(tok_is_eog(v, 32007));  /* <|end|> */
    assert_false(tok_is_eog(v, 32010)); /* <|user|> */
    assert_true(tok_add_bos(v));
    /* Control tokens in text are text: "<|end|>" is never id 32007. */
    n = enc(v, "<|end|><|user|>", ids, 16);
    for (int i = 0; i < n; i++)
        assert_true(ids[i] < 32000);
    /* ... except in a rendered chat template (tok_encode_special), where
     * the markers are the control tokens, and text around them is text. */
    n = tok_encode_special(v, "<|user|>\nHi<|end|>", 18, true, ids, 16);
    assert_true(n >= 4 && n < 16);
    assert_int_equal(ids[0], tok_bos(v));
    assert_int_equal(ids[1], 32010);
    assert_int_equal(ids[n - 1], 32007);
    int32_t plain[16];
    int k = tok_encode(v, "\nHi", 3, false, plain, 16);
    assert_int_equal(n, k + 3);
    assert_memory_equal(ids + 2, plain, sizeof(int32_t) * (size_t)k);
    tok_free(v);
}

static void test_vocab_gpt2(void **state)
{
    (void)state;
    run_vocab(&(struct vocab_case){"gpt-2", TOK_KIND_BPE, "gpt2"});
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-gpt-2.gguf", shared_dir());
    tok_vocab *v = load_path(path);
    assert_non_null(v);
    assert_false(tok_add_bos(v)); /* absent key: gpt2 default */
    assert_int_equal(tok_bos(v), 50256);
    assert_true(tok_is_eog(v, 50256));
    int32_t ids[16];
    int n = enc(v, "<|endoftext|>", ids, 16);
    assert_true(n > 1);
    for (int i = 0; i < n; i++)
        assert_int_not_equal(ids[i], 50256);
    tok_free(v);
}

static void test_vocab_starcoder(void **state)
{
    (void)state;
    run_vocab(&(struct vocab_case){"starcoder", TOK_KIND_BPE, "starcoder"});
    /* starcoder has no token for GPT-2's character of byte 0xF1: that byte
     * becomes the vocabulary's unknown token (id 0), which tok_unk names so
     * that a caller can tell the text will not come back from the ids. */
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-starcoder.gguf", shared_dir());
    tok_vocab *v = load_path(path);
    assert_non_null(v);
    assert_int_equal(tok_unk(v), 0);
    int32_t ids[16];
    int n = enc(v, "\xf1\x9f\x98\x80H", ids, 16);
    assert_true(n >= 2);
    assert_int_equal(ids[0], tok_unk(v));
    tok_free(v);
}

static void test_vocab_falcon(void **state)
{
    (void)state;
    run_vocab(&(struct vocab_case){"falcon", TOK_KIND_BPE, "falcon"});
}

/* ------------------------------------------------------------------------
 * stories260K (llama2.c's 512-token SentencePiece vocabulary)
 * ------------------------------------------------------------------------ */

static tok_vocab *load_stories(void)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/models/stories260K.gguf", shared_dir());
    tok_vocab *v = load_path(path);
    if (!v) {
        print_message("%s absent: set KVD_SHARED to the shared data folder\n", path);
        skip();
    }
    return v;
}

/*
 * llama2.c's encoder on tok512 starts from " " + the characters and merges
 * the best-scoring pair: "Once upon a time" becomes " Once" (403, score
 * -144), " upon" (407, -148), " a" (261, -2), " time" (378, -119).
 */
static void test_stories_once_upon(void **state)
{
    (void)state;
    tok_vocab *v = load_stories();
    assert_int_equal(tok_n_vocab(v), 512);
    assert_true(tok_add_bos(v));
    assert_int_equal(tok_bos(v), 1);
    assert_int_equal(tok_eos(v), 2);
    assert_true(tok_is_eog(v, 2));
    assert_false(tok_is_eog(v, 1));
    assert_false(tok_is_eog(v, 512));
    size_t len;
    assert_string_equal(tok_token_text(v, 403, &len), SP "Once");
    assert_string_equal(tok_token_text(v, 378, &len), SP "time");

    int32_t want[] = {403, 407, 261, 378};
    expect_ids(v, "Once upon a time", want, 4);

    int32_t ids[8];
    int n = tok_encode(v, "Once upon a time", 16, true, ids, 8);
    assert_int_equal(n, 5);
    assert_int_equal(ids[0], 1);
    assert_memory_equal(ids + 1, want, sizeof want);
    /* Too small a buffer: the full count, and only max ids written. */
    int32_t small[2] = {-7, -7};
    assert_int_equal(tok_encode(v, "Once upon a time", 16, true, small, 1), 5);
    assert_int_equal(small[0], 1);
    assert_int_equal(small[1], -7);
    assert_int_equal(tok_encode(v, "Once upon a time", 16, false, NULL, 0), 4);

    /* Decoding at text start drops the prefix space, also after BOS. */
    char *s = dec(v, ids, n, true);
    assert_string_equal(s, "Once upon a time");
    free(s);
    s = dec(v, ids + 2, n - 2, false); /* a continuation keeps its spaces */
    assert_string_equal(s, " upon a time");
    free(s);
    char piece[16];
    assert_int_equal(tok_piece(v, 403, piece, sizeof piece), 5);
    assert_memory_equal(piece, " Once", 5);
    assert_int_equal(tok_piece(v, 1, piece, sizeof piece), 0); /* control: no text */
    assert_int_equal(tok_piece(v, 3 + 'A', piece, sizeof piece), 1);
    assert_int_equal(piece[0], 'A');
    assert_int_equal(tok_piece(v, 512, piece, sizeof piece), -EINVAL);
    assert_int_equal(tok_piece(v, -1, piece, sizeof piece), -EINVAL);
    tok_free(v);
}

/* A text of a few hundred KB encodes and decodes back (the time this
 * takes is what the benchmark measures; here only correctness). */
static void test_long_text(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/data/tinystories-train-head-197k.txt", shared_dir());
    size_t len;
    char *text = read_file(path, &len);
    if (!text) {
        print_message("%s absent: set KVD_SHARED to the shared data folder\n", path);
        skip();
    }
    tok_vocab *v = load_stories();
    int n = tok_encode(v, text, len, true, NULL, 0);
    assert_true(n > 1000);
    int32_t *ids = malloc(sizeof *ids * (size_t)n);
    assert_non_null(ids);
    assert_int_equal(tok_encode(v, text, len, true, ids, n), n);
    char *back = dec(v, ids, n, true);
    assert_int_equal(strlen(back), len);
    assert_memory_equal(back, text, len);
    print_message("stories260K: %zu bytes -> %d tokens\n", len, n);
    free(back);
    free(ids);

    /* One long run of a single character, then of spaces: the worst case
     * for merge queues and for the pre-tokenizer's backtracking. */
    size_t big = 200000;
    char *same = malloc(big);
    assert_non_null(same);
    memset(same, 'a', big);
    n = tok_encode(v, same, big, false, NULL, 0);
    assert_true(n > 0 && n <= (int)big);
    tok_free(v);

    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-gpt-2.gguf", shared_dir());
    v = load_path(path);
    if (v) {
        n = tok_encode(v, text, len, false, NULL, 0);
        assert_true(n > 1000);
        ids = malloc(sizeof *ids * (size_t)n);
        assert_int_equal(tok_encode(v, text, len, false, ids, n), n);
        back = dec(v, ids, n, true);
        assert_memory_equal(back, text, len);
        free(back);
        free(ids);
        memset(same, ' ', big); /* GPT-2 has no merge of two spaces */
        n = tok_encode(v, same, big, false, NULL, 0);
        assert_true(n > 0 && n <= (int)big);
        tok_free(v);
    }
    free(same);
    free(text);
}

/* ------------------------------------------------------------------------
 * Streaming detokenisation
 * ------------------------------------------------------------------------ */

/*
 * Push ids one by one: every chunk the stream gives back must be valid
 * UTF-8 on its own, and the chunks together must equal want.
 */
static void stream_check(const tok_vocab *v, const int32_t *ids, int n, bool at_start,
                         const char *want)
{
    struct tok_stream st;
    tok_stream_init(&st, v, at_start);
    size_t cap = tok_stream_max_out(v), total = 0;
    char *chunk = malloc(cap);
    char *all = malloc(cap * (size_t)(n + 1) + 1);
    assert_true(chunk && all);
    for (int i = 0; i <= n; i++) {
        int w =
            i < n ? tok_stream_push(&st, v, ids[i], chunk, cap) : tok_stream_flush(&st, chunk, cap);
        assert_true(w >= 0);
        if (!utf8_valid((unsigned char *)chunk, (size_t)w))
            fail_msg("chunk %d (%d bytes) is not complete UTF-8", i, w);
        memcpy(all + total, chunk, (size_t)w);
        total += (size_t)w;
    }
    all[total] = '\0';
    assert_string_equal(all, want);
    free(chunk);
    free(all);
}

/* Concatenate the pieces of ids, as raw bytes (no stream). */
static char *raw_pieces(const tok_vocab *v, const int32_t *ids, int n)
{
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += (size_t)tok_piece(v, ids[i], NULL, 0);
    char *s = malloc(total + 1);
    size_t o = 0;
    for (int i = 0; i < n; i++)
        o += (size_t)tok_piece(v, ids[i], s + o, total - o);
    s[o] = '\0';
    return s;
}

static void stream_roundtrip(const tok_vocab *v, const char *text, bool expect_split)
{
    int32_t ids[256];
    int n = tok_encode(v, text, strlen(text), true, ids, 256);
    assert_true(n > 0 && n <= 256);
    /* Some token must end inside a character, or the test proves nothing. */
    bool split = false;
    for (int i = 0; i < n; i++) {
        char p[64];
        int pl = tok_piece(v, ids[i], p, sizeof p);
        assert_true(pl >= 0 && pl <= (int)sizeof p);
        split = split || !utf8_valid((unsigned char *)p, (size_t)pl);
    }
    assert_int_equal(split, expect_split);
    stream_check(v, ids, n, true, text);
    char *whole = dec(v, ids, n, true);
    assert_string_equal(whole, text);
    free(whole);
    /* The raw pieces carry the encoder's prefix space (SPM) and no more. */
    char *raw = raw_pieces(v, ids, n);
    if (tok_add_space_prefix(v)) {
        assert_int_equal(raw[0], ' ');
        assert_string_equal(raw + 1, text);
    } else {
        assert_string_equal(raw, text);
    }
    free(raw);
}

static const char MULTI[] = "h\xc3\xa9llo \xe2\x86\x92 \xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x8e\x89";
/* "héllo → 世界 🎉" */

static void test_stream_spm_byte_fallback(void **state)
{
    (void)state;
    /* Built in memory: only ASCII pieces, so every other character goes
     * through byte tokens <0xE2> <0x86> <0x92> ... */
    const char *extra[] = {SP, "h", "l", "o", "ll", "llo", SP "h"};
    tok_vocab *v = must_load(spm_writer(extra, NULL, NULL, 7));
    stream_roundtrip(v, MULTI, true);
    tok_free(v);
}

static void test_stream_spm_stories(void **state)
{
    (void)state;
    tok_vocab *v = load_stories();
    stream_roundtrip(v, MULTI, true);
    stream_roundtrip(v, "Once upon a time, there was a cat.", false);
    tok_free(v);
}

static void test_stream_bpe_gpt2(void **state)
{
    (void)state;
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-gpt-2.gguf", shared_dir());
    tok_vocab *v = load_path(path);
    if (!v) {
        print_message("%s absent: set KVD_SHARED to the shared data folder\n", path);
        skip();
    }
    stream_roundtrip(v, MULTI, true);
    tok_free(v);
}

static void test_stream_bpe_bytes(void **state)
{
    (void)state;
    /* No merges at all: every byte is its own token, so every multi-byte
     * character arrives split. */
    tok_vocab *v = must_load(bpe_writer(NULL, 0, NULL, 0, "gpt-2"));
    stream_roundtrip(v, MULTI, true);
    tok_free(v);
}

/* Invalid sequences become U+FFFD as soon as they cannot complete; a
 * partial character held at the end becomes U+FFFD on flush. */
static void test_stream_invalid(void **state)
{
    (void)state;
    tok_vocab *v = must_load(spm_writer(NULL, NULL, NULL, 0));
#define B(x) (3 + (x))
#define FFFD "\xef\xbf\xbd"
    struct {
        int32_t ids[6];
        int n;
        const char *want;
    } cases[] = {
        {{B(0xE2)}, 1, FFFD},                                           /* truncated at the end */
        {{B(0xE2), B(0x96)}, 2, FFFD},                                  /* still truncated */
        {{B(0xE2), B('A')}, 2, FFFD "A"},                               /* interrupted */
        {{B(0xFF), B('a')}, 2, FFFD "a"},                               /* never valid */
        {{B(0x80)}, 1, FFFD},                                           /* stray continuation */
        {{B(0xC0), B(0x80)}, 2, FFFD FFFD},                             /* overlong */
        {{B(0xED), B(0xA0), B(0x80)}, 3, FFFD FFFD FFFD},               /* surrogate */
        {{B(0xF4), B(0x90), B(0x80), B(0x80)}, 4, FFFD FFFD FFFD FFFD}, /* > U+10FFFF */
        {{B(0xE2), B(0x96), B(0x81)}, 3, SP},                           /* fine */
        {{B(0xF0), B(0x9F), B(0x8E), B(0x89)}, 4, "\xf0\x9f\x8e\x89"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        stream_check(v, cases[i].ids, cases[i].n, false, cases[i].want);

    /* Errors leave the stream as it was. */
    struct tok_stream st;
    tok_stream_init(&st, v, false);
    char out[64];
    assert_int_equal(tok_stream_push(&st, v, B(0xE2), out, sizeof out), 0);
    assert_int_equal(tok_stream_push(&st, v, 100000, out, sizeof out), -EINVAL);
    assert_int_equal(tok_stream_push(&st, v, B(0x96), out, 2), -ENOSPC);
    assert_int_equal(tok_stream_push(&st, v, B(0x96), out, sizeof out), 0);
    assert_int_equal(tok_stream_flush(&st, out, 2), -ENOSPC);
    assert_int_equal(tok_stream_push(&st, v, B(0x81), out, sizeof out), 3);
    assert_memory_equal(out, SP, 3);
    assert_int_equal(tok_stream_flush(&st, out, sizeof out), 0);
#undef B
#undef FFFD
    tok_free(v);
}

/* ------------------------------------------------------------------------
 * Arbitrary bytes
 * ------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *x)
{
    *x ^= *x << 13; /* xorshift64 */
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/*
 * Seeded random byte strings (ASCII, spaces, newlines, valid multi-byte
 * characters and stray high bytes; no literal "▁", which SPM cannot tell
 * from a space): the ids are in range and never
 * control tokens, the raw pieces give back exactly the input (after the
 * SPM prefix space), and the stream always yields valid UTF-8.
 */
static void fuzz_vocab(const tok_vocab *v, uint64_t seed)
{
    static const char *const atoms[] = {
        "a",    "b",    "c",        " ",   "  ",       "\n",           "\t",
        "'s",   "1",    "22",       "!",   "\xc3\xa9", "\xe4\xb8\x96", "\xf0\x9f\x8e\x89",
        "\xff", "\x80", "\xe2\x96", "<s>", "\x00"};
    uint64_t x = seed;
    char text[512];
    int32_t ids[1024];
    for (int iter = 0; iter < 300; iter++) {
        size_t len = 0;
        int n_atoms = (int)(rng_next(&x) % 40);
        for (int k = 0; k < n_atoms; k++) {
            const char *a = atoms[rng_next(&x) % (sizeof atoms / sizeof atoms[0])];
            size_t al = strcmp(a, "") == 0 ? 1 : strlen(a); /* "\x00" is one NUL byte */
            memcpy(text + len, a, al);
            len += al;
        }
        int n = tok_encode(v, text, len, false, ids, 1024);
        assert_true(n >= 0 && n <= 1024);
        size_t total = 0;
        char raw[2048];
        for (int i = 0; i < n; i++) {
            assert_true(ids[i] >= 0 && ids[i] < tok_n_vocab(v));
            assert_int_not_equal(tok_token_type(v, ids[i]), TOK_TYPE_CONTROL);
            int pl = tok_piece(v, ids[i], raw + total, sizeof raw - total);
            assert_true(pl >= 0 && total + (size_t)pl <= sizeof raw);
            total += (size_t)pl;
        }
        size_t skip_space = tok_add_space_prefix(v) && len > 0;
        assert_int_equal(total, len + skip_space);
        if (skip_space)
            assert_int_equal(raw[0], ' ');
        assert_memory_equal(raw + skip_space, text, len);
        char *d = dec(v, ids, n, true);
        assert_true(utf8_valid((unsigned char *)d, strlen(d)));
        free(d);
    }
}

static void test_random_bytes(void **state)
{
    (void)state;
    const char *extra[] = {SP, "a", "b", SP "a", "ab", "<", "s", ">", "<s", "\n", "'"};
    tok_vocab *v = must_load(spm_writer(extra, NULL, NULL, 11));
    fuzz_vocab(v, 0x9E3779B97F4A7C15ULL);
    tok_free(v);
    const char *bextra[] = {"ab", "\xc4\xa0"
                                  "a"};
    const char *merges[] = {"a b", "\xc4\xa0 a"};
    v = must_load(bpe_writer(bextra, 2, merges, 2, "llama-bpe"));
    fuzz_vocab(v, 12345);
    tok_free(v);
    char path[1024];
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-gpt-2.gguf", shared_dir());
    if ((v = load_path(path)) != NULL) {
        fuzz_vocab(v, 777);
        tok_free(v);
    }
    snprintf(path, sizeof path, "%s/vocab/ggml-vocab-llama-spm.gguf", shared_dir());
    if ((v = load_path(path)) != NULL) {
        fuzz_vocab(v, 4242);
        tok_free(v);
    }
}

/* ------------------------------------------------------------------------
 * SPM rules
 * ------------------------------------------------------------------------ */

static void test_spm_best_score_first(void **state)
{
    (void)state;
    /* "abc": both "ab" and "bc" are tokens; the better score merges first. */
    const char *extra[] = {"a", "b", "c", "ab", "bc", SP};
    float bc_wins[] = {-10, -10, -10, -5, -1, -10};
    float ab_wins[] = {-10, -10, -10, -1, -5, -10};
    int32_t ty[] = {0, 0, 0, 0, 0, 0};
    gguf_writer *w = spm_writer(extra, bc_wins, ty, 6);
    assert_int_equal(gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false), 0);
    tok_vocab *v = must_load(w);
    assert_false(tok_add_space_prefix(v));
    expect_ids(v, "abc", (int32_t[]){259, 263}, 2); /* a + bc */
    tok_free(v);

    w = spm_writer(extra, ab_wins, ty, 6);
    assert_int_equal(gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false), 0);
    v = must_load(w);
    expect_ids(v, "abc", (int32_t[]){262, 261}, 2); /* ab + c */
    /* Equal scores: the leftmost pair first. */
    tok_free(v);
    float tie[] = {-10, -10, -10, -3, -3, -10};
    w = spm_writer(extra, tie, ty, 6);
    assert_int_equal(gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", false), 0);
    v = must_load(w);
    expect_ids(v, "abc", (int32_t[]){262, 261}, 2);
    tok_free(v);
}

static void test_spm_space_prefix_and_bytes(void **state)
{
    (void)state;
    const char *extra[] = {SP, "a", SP "a", "b"};
    tok_vocab *v = must_load(spm_writer(extra, NULL, NULL, 4)); /* default: prefix on */
    assert_true(tok_add_space_prefix(v));
    expect_ids(v, "a", (int32_t[]){261}, 1);                  /* "▁a" */
    expect_ids(v, "a a", (int32_t[]){261, 261}, 2);           /* spaces become ▁ */
    expect_ids(v, "b\n", (int32_t[]){259, 262, 3 + '\n'}, 3); /* no "\n" piece: byte token */
    expect_ids(v, "", NULL, 0);
    int32_t ids[4];
    assert_int_equal(tok_encode(v, "", 0, true, ids, 4), 1); /* BOS alone */
    assert_int_equal(ids[0], 1);
    /* "é" has no piece: its two bytes. */
    expect_ids(v, "\xc3\xa9", (int32_t[]){259, 3 + 0xC3, 3 + 0xA9}, 3);
    tok_free(v);
}

/* Control tokens are never made from text; user-defined ones are matched
 * whole and decoded as written. */
static void test_special_tokens(void **state)
{
    (void)state;
    /* Normal pieces that could spell "<s>" and "<|u|>" if the encoder
     * looked control tokens up, and a user-defined token <|u|>. */
    const char *extra[] = {"<", "s", ">", "<s", "s>", "<|u|>", "|", "u", "x", SP "x", SP};
    int32_t ty[] = {1, 1, 1, 1, 1, 4, 1, 1, 1, 1, 1};
    float sc[] = {-9, -9, -9, -1, -1, 0, -9, -9, -9, -2, -9};
    gguf_writer *w = spm_writer(extra, sc, ty, 11);
    assert_int_equal(gguf_writer_set_u32(w, "tokenizer.ggml.eot_token_id", 264), 0);
    tok_vocab *v = must_load(w);
    int32_t ids[64];
    int n = enc(v, "<s></s>", ids, 64);
    for (int i = 0; i < n; i++) {
        assert_int_not_equal(ids[i], 1);
        assert_int_not_equal(ids[i], 2);
    }
    /* "x<|u|>x": the user token is cut out; the run after it gets a space
     * prefix again, as after any special token. */
    expect_ids(v, "x<|u|>x", (int32_t[]){268, 264, 268}, 3);
    char *s = dec(v, (int32_t[]){1, 268, 264, 268}, 4, true);
    assert_string_equal(s, "x<|u|> x");
    free(s);
    assert_true(tok_is_eog(v, 264)); /* eot_token_id */
    assert_true(tok_is_eog(v, 2));
    assert_false(tok_is_eog(v, 268));
    assert_int_equal(tok_token_type(v, 264), TOK_TYPE_USER_DEFINED);
    assert_int_equal(tok_token_type(v, 1), TOK_TYPE_CONTROL);
    assert_int_equal(tok_token_type(v, -1), -1);
    tok_free(v);
}

/* ------------------------------------------------------------------------
 * BPE rules
 * ------------------------------------------------------------------------ */

static void test_bpe_rank_order(void **state)
{
    (void)state;
    const char *extra[] = {"ab", "bc", "abc"};
    /* "b c" ranks before "a b": abc -> a + bc; then "a bc" is no merge. */
    const char *m1[] = {"b c", "a b", "ab c"};
    tok_vocab *v = must_load(bpe_writer(extra, 3, m1, 3, "gpt-2"));
    expect_ids(v, "abc", (int32_t[]){'a', 257}, 2);
    tok_free(v);
    /* "a b" first, then "ab c" -> one token. */
    const char *m2[] = {"a b", "b c", "ab c"};
    v = must_load(bpe_writer(extra, 3, m2, 3, "gpt-2"));
    expect_ids(v, "abc", (int32_t[]){258}, 1);
    /* Words are merged separately: " abc" is 'Ġ' + a b c, and "Ġ a" is no
     * merge, so the leading space stays a token of its own. */
    expect_ids(v, " abc", (int32_t[]){32 /* byte 0x20 */, 258}, 2);
    assert_false(tok_add_bos(v)); /* gpt2 default */
    assert_int_equal(tok_bos(v), -1);
    char *s = dec(v, (int32_t[]){32, 258, 0xC3, 0xA9}, 4, true);
    assert_string_equal(s, " abc\xc3\xa9"); /* no space stripped for BPE */
    free(s);
    tok_free(v);
}

/* Split text with a vocabulary's pre-tokenizer; returns words joined by '|'. */
static char *words(const tok_vocab *v, const char *text)
{
    size_t len = strlen(text), starts[256];
    int n = tok_split_words(v, text, len, starts, 256);
    assert_true(n >= 0 && n <= 256);
    char *out = malloc(2 * len + 2);
    size_t o = 0;
    for (int i = 0; i < n; i++) {
        size_t end = i + 1 < n ? starts[i + 1] : len;
        if (i)
            out[o++] = '|';
        memcpy(out + o, text + starts[i], end - starts[i]);
        o += end - starts[i];
    }
    out[o] = '\0';
    return out;
}

static void expect_words(const char *pre, const char *want_name, const char *text, const char *want)
{
    tok_vocab *v = must_load(bpe_writer(NULL, 0, NULL, 0, pre));
    assert_string_equal(tok_pre_name(v), want_name);
    char *got = words(v, text);
    if (strcmp(got, want) != 0)
        fail_msg("pre %s on '%s': got '%s', want '%s'", pre, text, got, want);
    free(got);
    tok_free(v);
}

static void test_pretokenizers(void **state)
{
    (void)state;
    const char *t = "Hello world's 12345 \xc3\xa9t\xc3\xa9!! $x\n\n  ok";
    expect_words("gpt-2", "gpt2", t,
                 "Hello| world|'s| 12345| \xc3\xa9t\xc3\xa9|!!| $|x|\n\n |"
                 " ok");
    expect_words("llama-bpe", "llama3", t,
                 "Hello| world|'s| |123|45| \xc3\xa9t\xc3\xa9|!!| $|x|\n\n| | ok");
    expect_words("qwen2", "qwen2", t,
                 "Hello| world|'s| |1|2|3|4|5| \xc3\xa9t\xc3\xa9|!!| $|x|\n\n| | ok");
    expect_words("starcoder", "starcoder", t,
                 "Hello| world|'s| |1|2|3|4|5| \xc3\xa9t\xc3\xa9|!!| $|x|\n\n | ok");
    expect_words("falcon", "falcon", "a, b 1234567 x+=y", "a|,| b| |123|456|7| x|+=|y");
    /* Unicode letters and white space: \p{L} and \s are Unicode-aware. */
    expect_words("gpt-2", "gpt2", "\xd0\xbd\xd0\xb5\xd1\x89\xd0\xbe\xe3\x80\x80\xe3\x80\x80x",
                 "\xd0\xbd\xd0\xb5\xd1\x89\xd0\xbe|\xe3\x80\x80|\xe3\x80\x80|x");
    /* Invalid UTF-8 never matches; it is kept as a piece of its own. */
    expect_words("gpt-2", "gpt2", "ab\xff\xfe cd", "ab|\xff\xfe| cd");

    /* An unknown pre-tokenizer is refused with its value named; the
     * operator may force a known one, which the note reports. */
    char err[256];
    assert_null(load_writer(bpe_writer(NULL, 0, NULL, 0, "no-such-pre"), err, sizeof err));
    assert_non_null(strstr(err, "'no-such-pre' is not supported"));
    tok_vocab *v = load_writer_forced(bpe_writer(NULL, 0, NULL, 0, "no-such-pre"), "qwen2", err,
                                      sizeof err);
    assert_non_null(v);
    assert_string_equal(tok_pre_name(v), "qwen2");
    assert_non_null(tok_warning(v));
    assert_non_null(strstr(tok_warning(v), "no-such-pre"));
    tok_free(v);
    assert_null(load_writer_forced(bpe_writer(NULL, 0, NULL, 0, "gpt-2"), "nope", err, sizeof err));
    assert_non_null(strstr(err, "'nope'"));
    assert_null(load_writer_forced(spm_writer(NULL, NULL, NULL, 0), "qwen2", err, sizeof err));
    assert_non_null(strstr(err, "SentencePiece"));
    assert_true(tok_pre_known("tekken") && !tok_pre_known("no-such-pre") && !tok_pre_known(NULL));
    /* A file from before pre-tokenizers existed: llama.cpp's default set,
     * with a note for the caller to print. */
    v = must_load(bpe_writer(NULL, 0, NULL, 0, NULL));
    assert_string_equal(tok_pre_name(v), "default");
    assert_non_null(tok_warning(v));
    assert_int_equal(tok_split_words(v, NULL, 1, NULL, 0), -EINVAL);
    tok_free(v);
    v = must_load(spm_writer(NULL, NULL, NULL, 0));
    assert_int_equal(tok_split_words(v, "a", 1, NULL, 0), -EINVAL); /* SPM has none */
    tok_free(v);
}

/*
 * The families of the mainstream models' BPE vocabularies. The expected
 * cuts were worked out by hand from the patterns' definitions (each pattern
 * cuts the pieces the previous one left; unmatched text stays a piece).
 */
static void test_pretokenizers_more(void **state)
{
    (void)state;
    const char *t = "Hello world's 12345 \xc3\xa9t\xc3\xa9!! $x\n\n  ok";
    /* DeepSeek LLM: line breaks alone; cased letters (é too) with one
     * space; runs of its "punctuation" (0x21-0x2F and 0x3A-0x7E, which
     * takes in the ASCII letters, so " été" is cut again around its "t");
     * trailing space; digit runs. */
    expect_words("deepseek-llm", "deepseek-llm", t,
                 "Hello| world|'|s| |12345| \xc3\xa9|t|\xc3\xa9|!!| $|x|\n|\n| | ok");
    /* Cyrillic is in its letter class, CJK is cut out of the space before. */
    expect_words("deepseek-llm", "deepseek-llm",
                 "\xd0\x9f\xd1\x80\xd0\xb8 \xd0\xbc\xd0\xb8 \xe4\xbd\xa0\xe5\xa5\xbd",
                 "\xd0\x9f\xd1\x80\xd0\xb8| \xd0\xbc\xd0\xb8| |\xe4\xbd\xa0\xe5\xa5\xbd");
    /* "$" is a symbol, not punctuation, for DeepSeek Coder; digits alone. */
    expect_words("deepseek-coder", "deepseek-coder", t,
                 "Hello| world|'|s| |1|2|3|4|5| \xc3\xa9t\xc3\xa9|!!| $|x|\n|\n| | ok");
    expect_words("deepseek-v3", "deepseek-v3",
                 "Hello world's 12345 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e!! $x\n\n  ok",
                 "Hello| world|'s| |123|45| |\xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e|!!| $|x|\n\n| | ok");
    /* Tekken (Mistral Nemo): a word ends where upper case follows lower. */
    expect_words("tekken", "tekken", "HelloWorld ABCdef 12 a/b\n\n  ok",
                 "Hello|World| ABCdef| |1|2| a|/b|\n\n| | ok");
    expect_words("gpt-4o", "gpt-4o", "HelloWorld's 12345 a/b", "Hello|World's| |123|45| a|/b");
    expect_words("bloom", "bloom", "Hello, world! (x) a|b",
                 "Hello|,| world|! (|x|)| a|||b");
    expect_words("viking", "viking", "ab12 c3", "ab|1|2| c|3");
    /* Aliases map to their families. */
    expect_words("pixtral", "llama3", "a 1234", "a| |123|4");
    expect_words("deepseek-r1-qwen", "qwen2", "a 12", "a| |1|2");
    expect_words("hunyuan-dense", "deepseek-v3", "x 1234", "x| |123|4");

    /* llama-bpe and tekken start prompts with BOS unless the file says no. */
    static const char *const bos[] = {"<s>"};
    for (int i = 0; i < 3; i++) {
        const char *pre = i == 2 ? "gpt-2" : i ? "tekken" : "llama-bpe";
        gguf_writer *w = bpe_writer(bos, 1, NULL, 0, pre);
        assert_int_equal(gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 256), 0);
        tok_vocab *v = must_load(w);
        assert_int_equal(tok_add_bos(v), i < 2);
        tok_free(v);
    }
}

/* llama3's ignore_merges: a word that is a token is taken whole even when
 * the merges would not build it. */
static void test_bpe_ignore_merges(void **state)
{
    (void)state;
    const char *extra[] = {"ab", "abc"};
    const char *m[] = {"a b"};
    tok_vocab *v = must_load(bpe_writer(extra, 2, m, 1, "llama-bpe"));
    expect_ids(v, "abc", (int32_t[]){257}, 1);
    tok_free(v);
    v = must_load(bpe_writer(extra, 2, m, 1, "gpt-2"));
    expect_ids(v, "abc", (int32_t[]){256, 'c'}, 2);
    tok_free(v);
}

/* ------------------------------------------------------------------------
 * Hostile metadata
 * ------------------------------------------------------------------------ */

static void expect_error(gguf_writer *w, const char *needle)
{
    char err[256];
    tok_vocab *v = load_writer(w, err, sizeof err);
    if (v) {
        tok_free(v);
        fail_msg("tok_load accepted a vocabulary that should fail with '%s'", needle);
    }
    if (!strstr(err, needle))
        fail_msg("error '%s' does not mention '%s'", err, needle);
}

static void test_hostile_metadata(void **state)
{
    (void)state;
    const char *toks[] = {"a", "b", "ab"};

    /* tokens missing */
    gguf_writer *w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    expect_error(w, "tokenizer.ggml.tokens is missing");

    /* tokens not strings */
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.tokens", (int32_t[]){1, 2}, 2);
    expect_error(w, "not strings");

    /* model missing, unsupported */
    w = gguf_writer_create();
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    expect_error(w, "tokenizer.ggml.model is missing");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "bert");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    expect_error(w, "'bert' is not supported");

    /* scores length mismatch */
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    gguf_writer_set_arr_f32(w, "tokenizer.ggml.scores", (float[]){0, 0}, 2);
    expect_error(w, "tokenizer.ggml.scores has 2 entries but tokenizer.ggml.tokens has 3");

    /* token types: length and range */
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (int32_t[]){1, 1, 1, 1}, 4);
    expect_error(w, "tokenizer.ggml.token_type has 4 entries");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (int32_t[]){1, 9, 1}, 3);
    expect_error(w, "tokenizer.ggml.token_type[1] is not a token type");
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "llama");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", (int32_t[]){1, 6, 1}, 3);
    expect_error(w, "tokenizer.ggml.tokens[1] 'b' has type byte but is not <0xXX>");

    /* bos id out of range, and of the wrong type */
    w = spm_writer(NULL, NULL, NULL, 0);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 259);
    expect_error(w, "tokenizer.ggml.bos_token_id = 259 is outside the vocabulary (259 tokens)");
    w = spm_writer(NULL, NULL, NULL, 0);
    gguf_writer_set_i32(w, "tokenizer.ggml.eos_token_id", -5);
    expect_error(w, "tokenizer.ggml.eos_token_id = -5 is outside");
    w = spm_writer(NULL, NULL, NULL, 0);
    gguf_writer_set_str(w, "tokenizer.ggml.bos_token_id", "1");
    expect_error(w, "tokenizer.ggml.bos_token_id is not an integer");
    w = spm_writer(NULL, NULL, NULL, 0);
    gguf_writer_set_u32(w, "tokenizer.ggml.add_bos_token", 1);
    expect_error(w, "tokenizer.ggml.add_bos_token is not a bool");
    /* 0xFFFFFFFF means "none", as llama.cpp's converters write it */
    w = spm_writer(NULL, NULL, NULL, 0);
    gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 0xFFFFFFFFu);
    tok_vocab *v = must_load(w);
    assert_int_equal(tok_bos(v), -1);
    assert_false(tok_add_bos(v));
    int32_t ids[4];
    assert_int_equal(tok_encode(v, "", 0, true, ids, 4), 0);
    tok_free(v);

    /* merges: missing, unknown pieces, malformed, result not a token */
    const char *bt[] = {"ab", "bc"};
    v = must_load(bpe_writer(bt, 2, NULL, 0, "gpt-2")); /* an empty list is fine */
    tok_free(v);
    w = gguf_writer_create();
    gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, 3);
    expect_error(w, "tokenizer.ggml.merges is missing");
    w = bpe_writer(bt, 2, (const char *[]){"a b", SP " b"}, 2, "gpt-2");
    expect_error(w, "tokenizer.ggml.merges[1] '" SP " b': '" SP "' is not a token");
    w = bpe_writer(bt, 2, (const char *[]){"a b", "b zz"}, 2, "gpt-2");
    expect_error(w, "'zz' is not a token");
    w = bpe_writer(bt, 2, (const char *[]){"ab"}, 1, "gpt-2");
    expect_error(w, "tokenizer.ggml.merges[0] 'ab' is not two pieces separated by a space");
    w = bpe_writer(bt, 2, (const char *[]){"a c"}, 1, "gpt-2");
    expect_error(w, "the merged piece is not a token");

    /* API misuse */
    v = must_load(spm_writer(NULL, NULL, NULL, 0));
    assert_int_equal(tok_encode(v, NULL, 3, false, ids, 4), -EINVAL);
    assert_int_equal(tok_encode(v, "abc", 3, false, NULL, 4), -EINVAL);
    assert_int_equal(tok_encode(v, "abc", 3, false, ids, -1), -EINVAL);
    assert_int_equal(tok_decode(v, (int32_t[]){5000}, 1, false, NULL, 0), -EINVAL);
    assert_null(tok_token_text(v, 259, NULL));
    tok_free(v);
    char err[64];
    assert_null(tok_load(NULL, err, sizeof err));
    tok_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vocab_llama_spm),
        cmocka_unit_test(test_vocab_phi3),
        cmocka_unit_test(test_vocab_phi3_specials),
        cmocka_unit_test(test_vocab_gpt2),
        cmocka_unit_test(test_vocab_starcoder),
        cmocka_unit_test(test_vocab_falcon),
        cmocka_unit_test(test_stories_once_upon),
        cmocka_unit_test(test_long_text),
        cmocka_unit_test(test_stream_spm_byte_fallback),
        cmocka_unit_test(test_stream_spm_stories),
        cmocka_unit_test(test_stream_bpe_gpt2),
        cmocka_unit_test(test_stream_bpe_bytes),
        cmocka_unit_test(test_stream_invalid),
        cmocka_unit_test(test_random_bytes),
        cmocka_unit_test(test_spm_best_score_first),
        cmocka_unit_test(test_spm_space_prefix_and_bytes),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_bpe_rank_order),
        cmocka_unit_test(test_pretokenizers),
        cmocka_unit_test(test_pretokenizers_more),
        cmocka_unit_test(test_bpe_ignore_merges),
        cmocka_unit_test(test_hostile_metadata),
    };
    return cmocka_run_group_tests_name("tokenizer", tests, NULL, NULL);
}
