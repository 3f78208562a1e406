/*
 * test_retrieval.c - the constructed retrieval model (`kvd mkmodel
 * --preset retrieval`, model/mkmodel_retrieval.c) and `kvd eval --task
 * retrieval`.
 *
 * The model must copy a code from any distance the cache holds: for each
 * position scheme (RoPE, ALiBi, T5) one session of ~33k tokens holds five
 * codes at distances from ~50 to ~32k tokens, with no eviction, and each is
 * asked for at the end; every digit of every code must come back (greedy).
 * Under AddressSanitizer the session is 4k tokens (the distances scale
 * down), so the suite stays quick; the construction is the same.
 *
 * `kvd eval --task retrieval` (the built binary, KVD_BIN) runs on the RoPE
 * model with a short training length: no eviction retrieves every key;
 * sink + window retrieves exactly the keys inside its window, and the
 * recompute baseline (the same retained tokens, fresh) agrees with it;
 * the chunked baseline retrieves exactly the keys inside its chunk; the
 * JSON, the table and the plot carry every case; bad options are refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include "tests/serve_util.h"

#include "model/model.h"

#include <sys/wait.h>

#if defined(__SANITIZE_ADDRESS__)
#define SESSION_TOKENS 4096
#else
#ifndef SESSION_TOKENS
#define SESSION_TOKENS 33000
#endif
#endif

/* Filler words: no digit, no "secret", "is", or the codes' names. */
static const char *const filler_words[] = {
    "the",   "a",     "and",  "was",  "to",     "of",   "in",    "it",     "on",    "at",
    "my",    "her",   "old",  "new",  "little", "big",  "red",   "blue",   "green", "day",
    "night", "sun",   "rain", "wind", "river",  "tree", "house", "garden", "road",  "hill",
    "bird",  "dog",   "cat",  "fox",  "walked", "sat",  "saw",   "ran",    "found", "kept",
    "said",  "there", "then", "very", "quiet",  "long",
};
#define N_FILLER (sizeof(filler_words) / sizeof(filler_words[0]))

/* The five codes: their names and where they sit (fraction of the session
 * that follows them). */
static const char *const names[5] = {"code", "number", "key", "box", "door"};
static const double after[5] = {0.995, 0.75, 0.25, 0.03, 0.0015};

struct session {
    model *m;
    model_ctx *ctx;
    kv_cache *cache;
    kv_seq *seq;
    float *logits;
    int n_vocab;
};

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Append text (no BOS unless first) to the session; logits of the last
 * token in s->logits. */
static void feed_text(struct session *s, const char *text, bool first)
{
    int n = model_tokenize(s->m, text, strlen(text), first, NULL, 0);
    assert_true(n > 0);
    int32_t *t = malloc(sizeof(int32_t) * (size_t)n);
    assert_int_equal(model_tokenize(s->m, text, strlen(text), first, t, n), n);
    for (int at = 0; at < n; at += 512) {
        int k = n - at < 512 ? n - at : 512;
        struct model_batch_seq b = {.seq = s->seq,
                                    .tokens = t + at,
                                    .n_tokens = k,
                                    .logits = at + k == n ? s->logits : NULL};
        assert_int_equal(model_reserve_forward(s->ctx, &b, 1, NULL), 0);
    }
    free(t);
}

/* Greedy: the next token, fed back. */
static int32_t next_token(struct session *s)
{
    int32_t best = 0;
    for (int v = 1; v < s->n_vocab; v++)
        if (s->logits[v] > s->logits[best])
            best = v;
    struct model_batch_seq b = {.seq = s->seq, .tokens = &best, .n_tokens = 1, .logits = s->logits};
    assert_int_equal(model_reserve_forward(s->ctx, &b, 1, NULL), 0);
    return best;
}

static void open_session(struct session *s, const char *position, char *dir)
{
    char path[600], err[512];
    snprintf(dir, 256, "/tmp/kvd-retrieval-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof(path), "%s/r.gguf", dir);
    struct model_mk_params p;
    assert_int_equal(model_mk_preset(&p, "retrieval", position, err, sizeof(err)), 0);
    assert_int_equal(model_mk_write(&p, path, err, sizeof(err)), 0);
    struct model_params mp = {.path = path};
    s->m = model_load(&mp, err, sizeof(err));
    assert_non_null(s->m);
    struct model_info info;
    model_get_info(s->m, &info);
    s->n_vocab = info.n_vocab;
    struct kv_cache_params kp = {.page_tokens = 16, .k_type = KV_F32, .v_type = KV_F32};
    model_kv_shape(s->m, &kp);
    size_t tok_bytes =
        2 * (size_t)info.n_layer * (size_t)info.n_kv_head * (size_t)info.head_dim * sizeof(float);
    kp.memory_bytes = (size_t)(SESSION_TOKENS + 4096) * tok_bytes;
    s->cache = kv_cache_create(&kp, err, sizeof(err));
    assert_non_null(s->cache);
    struct kv_policy none = {.kind = KV_EVICT_NONE, .max_cache_tokens = SESSION_TOKENS + 2048};
    s->seq = kv_seq_create(s->cache, &none, true, err, sizeof(err));
    assert_non_null(s->seq);
    s->ctx = model_ctx_create(s->m, 512, 0, err, sizeof(err));
    assert_non_null(s->ctx);
    s->logits = malloc(sizeof(float) * (size_t)s->n_vocab);
}

static void close_session(struct session *s, char *dir)
{
    free(s->logits);
    model_ctx_destroy(s->ctx);
    kv_seq_destroy(s->seq);
    kv_cache_destroy(s->cache);
    model_free(s->m);
    su_remove_dir(dir);
}

/* Filler of about n tokens (one word, one token) into buf. */
static void filler(char *buf, size_t cap, int n, uint64_t *rng)
{
    size_t len = 0;
    buf[0] = '\0';
    for (int i = 0; i < n && len + 16 < cap; i++) {
        const char *w = filler_words[rng_next(rng) % N_FILLER];
        len += (size_t)snprintf(buf + len, cap - len, "%s%s",
                                i == 0         ? ""
                                : i % 12 == 11 ? ". "
                                               : " ",
                                w);
    }
}

/*
 * Five distinct digits, "d d d d d", none of whose adjacent pairs (with
 * "is" before the first, row 10) another code of the session has: the RoPE
 * and T5 constructions match a context of two tokens, so a pair shared by
 * two codes would be a fork (and the ALiBi one would prefer the nearer).
 */
static void random_code(char *out, bool pair_used[11][10], uint64_t *rng)
{
    for (;;) {
        int d[5], used = 0;
        bool ok = true;
        for (int k = 0; k < 5; k++) {
            do
                d[k] = (int)(rng_next(rng) % 10);
            while (used & (1 << d[k]));
            used |= 1 << d[k];
            ok = ok && !pair_used[k ? d[k - 1] : 10][d[k]];
        }
        if (!ok)
            continue;
        for (int k = 0; k < 5; k++) {
            pair_used[k ? d[k - 1] : 10][d[k]] = true;
            out[2 * k] = (char)('0' + d[k]);
            out[2 * k + 1] = k < 4 ? ' ' : '\0';
        }
        return;
    }
}

static void copies_at_every_distance(const char *position)
{
    struct session s = {0};
    char dir[256];
    open_session(&s, position, dir);
    uint64_t rng = 15;
    char codes[5][16];
    size_t cap = (size_t)SESSION_TOKENS * 12;
    char *buf = malloc(cap);
    int fed = 0;
    bool pair_used[11][10] = {{false}};
    int code_pos[5];
    for (int c = 0; c < 5; c++) {
        random_code(codes[c], pair_used, &rng);
        int upto = (int)((1.0 - after[c]) * SESSION_TOKENS);
        filler(buf, cap, upto - fed > 8 ? upto - fed : 8, &rng);
        char *text = malloc(strlen(buf) + 128);
        sprintf(text, "%s. the secret %s is", buf, names[c]);
        feed_text(&s, text, c == 0);
        code_pos[c] = kv_seq_n_tokens(s.seq);
        sprintf(text, "%s.", codes[c]); /* the tokenizer adds the word boundary */
        feed_text(&s, text, false);
        fed = kv_seq_n_tokens(s.seq);
        free(text);
    }
    filler(buf, cap, SESSION_TOKENS - fed > 8 ? SESSION_TOKENS - fed : 8, &rng);
    feed_text(&s, buf, false);
    int good = 0;
    for (int c = 0; c < 5; c++) {
        char q[64];
        snprintf(q, sizeof(q), "the secret %s is", names[c]);
        feed_text(&s, q, false);
        char got[64] = "";
        model_detok *d = model_detok_create(s.m);
        for (int k = 0; k < 5; k++) {
            char piece[32];
            int n = model_detok_push(d, next_token(&s), piece, sizeof(piece) - 1);
            piece[n > 0 ? n : 0] = '\0';
            strncat(got, piece, sizeof(got) - strlen(got) - 1);
        }
        model_detok_destroy(d);
        char want[32];
        snprintf(want, sizeof(want), " %s", codes[c]);
        bool ok = !strcmp(got, want);
        good += ok;
        print_message("%s: the secret %s, %d tokens back:%s ->%s %s\n", position, names[c],
                      kv_seq_n_tokens(s.seq) - code_pos[c], want, got, ok ? "ok" : "WRONG");
    }
    const int32_t *hist;
    assert_int_equal(kv_seq_history(s.seq, &hist), kv_seq_n_tokens(s.seq)); /* nothing evicted */
    free(buf);
    close_session(&s, dir);
    assert_int_equal(good, 5);
}

static void test_copies_rope(void **state)
{
    (void)state;
    copies_at_every_distance("rope");
}

static void test_copies_alibi(void **state)
{
    (void)state;
    copies_at_every_distance("alibi");
}

static void test_copies_t5(void **state)
{
    (void)state;
    copies_at_every_distance("t5");
}

/* The preset's weights fit one shape: another dim or head count is refused. */
static void test_preset_shape_is_fixed(void **state)
{
    (void)state;
    struct model_mk_params p;
    char err[512];
    assert_int_equal(model_mk_preset(&p, "retrieval", "t5", err, sizeof(err)), 0);
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), 0);
    p.n_embd = 128;
    assert_int_equal(model_mk_check(&p, err, sizeof(err)), -EINVAL);
    assert_non_null(strstr(err, "retrieval preset"));
    assert_int_equal(model_mk_preset(&p, "retrieval", "nope", err, sizeof(err)), -EINVAL);
    assert_int_equal(model_mk_preset(&p, "other", NULL, err, sizeof(err)), -EINVAL);
}

/* --- kvd eval --task retrieval -------------------------------------------- */

static const char *kvd_bin(void)
{
    const char *b = getenv("KVD_BIN");
    if (!b)
        print_message("skipped: KVD_BIN is not set (run through make test)\n");
    return b;
}

/* The RoPE retrieval model in a scratch dir; its path in path. */
static void write_model(char *dir, char *path, size_t cap)
{
    char err[512];
    snprintf(dir, 256, "/tmp/kvd-retrieval-XXXXXX");
    assert_non_null(mkdtemp(dir));
    snprintf(path, cap, "%s/r.gguf", dir);
    struct model_mk_params p;
    assert_int_equal(model_mk_preset(&p, "retrieval", NULL, err, sizeof(err)), 0);
    assert_int_equal(model_mk_write(&p, path, err, sizeof(err)), 0);
}

/* Run `kvd eval --model M ARGS` (stderr to dir/err.txt); stdout in a new
 * string, exit status in *status. */
static char *run_eval(const char *bin, const char *dir, const char *mpath, const char *args,
                      int *status)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s eval --model %s %s 2>%s/err.txt", bin, mpath, args, dir);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    size_t got;
    while ((got = fread(out + len, 1, cap - len - 1, p)) > 0) {
        len += got;
        if (len + 1 == cap)
            out = realloc(out, cap *= 2);
    }
    out[len] = '\0';
    int st = pclose(p);
    *status = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (*status != 0) { /* show why (bad-option cases expect 2) */
        struct su_proc shown = {0};
        snprintf(shown.log, sizeof(shown.log), "%s/err.txt", dir);
        su_dump_log(&shown);
    }
    return out;
}

#define EVAL_ARGS                                                                                  \
    "--task retrieval --train-len 256 --lengths 1,2,4 --depths 0,0.5,0.9,0.97 --page-tokens 4 "    \
    "--policy sink-window:4:60 --baseline dense --baseline chunked --baseline recompute "

static void test_eval_retrieval_shape(void **state)
{
    (void)state;
    const char *bin = kvd_bin();
    if (!bin)
        skip();
    char dir[256], mpath[600], args[1024];
    write_model(dir, mpath, sizeof(mpath));
    bool plot = su_on_path("gnuplot");
    snprintf(args, sizeof(args), EVAL_ARGS "--json %s%s%s", plot ? "--plot " : "", plot ? dir : "",
             plot ? "/r.png" : "");
    int status;
    char *out = run_eval(bin, dir, mpath, args, &status);
    assert_int_equal(status, 0);
    json_error_t jerr;
    json_t *doc = json_loads(out, 0, &jerr);
    assert_non_null(doc);
    json_t *runs = json_object_get(doc, "runs");
    assert_int_equal(json_array_size(runs), 4);
    const char *want[4] = {"sink-window:4:60", "dense (no eviction)", "chunked (256)",
                           "recompute (sink-window:4:60)"};
    json_t *rows[4];
    for (int r = 0; r < 4; r++) {
        rows[r] = json_object_get(json_array_get(runs, r), "cases");
        assert_string_equal(json_string_value(json_object_get(json_array_get(runs, r), "label")),
                            want[r]);
        assert_int_equal(json_array_size(rows[r]), 12);
    }
    assert_true(json_real_value(json_object_get(json_array_get(runs, 1), "accuracy")) == 1.0);
    int inside = 0, outside = 0;
    for (size_t k = 0; k < 12; k++) {
        int d = (int)json_integer_value(json_object_get(json_array_get(rows[0], k), "distance"));
        int got[4];
        for (int r = 0; r < 4; r++)
            got[r] =
                (int)json_integer_value(json_object_get(json_array_get(rows[r], k), "correct"));
        /* the window holds the last 60..64 tokens; the chunk the last 255 */
        if (d <= 50)
            assert_int_equal(got[0], 1), inside++;
        if (d >= 70)
            assert_int_equal(got[0], 0), outside++;
        assert_int_equal(got[3], got[0]);
        if (d <= 240)
            assert_int_equal(got[2], 1);
        if (d >= 260)
            assert_int_equal(got[2], 0);
    }
    assert_true(inside >= 3 && outside >= 6);
    json_decref(doc);
    free(out);
    if (plot) {
        char png[600];
        snprintf(png, sizeof(png), "%s/r.png", dir);
        FILE *f = fopen(png, "rb");
        assert_non_null(f);
        unsigned char magic[4] = {0};
        assert_int_equal(fread(magic, 1, 4, f), 4);
        fclose(f);
        assert_memory_equal(magic, "\x89PNG", 4);
    }
    /* the table: the path first (stderr), one row per run, then the depths */
    out = run_eval(bin, dir, mpath, EVAL_ARGS, &status);
    assert_int_equal(status, 0);
    assert_non_null(strstr(out, "dense (no eviction)"));
    assert_non_null(strstr(out, "1x (256)"));
    assert_non_null(strstr(out, "by depth"));
    free(out);
    char errpath[600];
    snprintf(errpath, sizeof(errpath), "%s/err.txt", dir);
    FILE *f = fopen(errpath, "r");
    char line[512];
    bool path = false;
    while (f && fgets(line, sizeof(line), f))
        path = path || (strstr(line, "attention: fused paged kernel") && strstr(line, "rope"));
    if (f)
        fclose(f);
    assert_true(path);
    su_remove_dir(dir);
}

static void test_eval_retrieval_bad_options(void **state)
{
    (void)state;
    const char *bin = kvd_bin();
    if (!bin)
        skip();
    char dir[256], mpath[600];
    write_model(dir, mpath, sizeof(mpath));
    static const char *const bad[][2] = {
        {"--task retrieval --key-len 11", "--key-len (1..10)"},
        {"--task nope", "--task (retrieval|perplexity)"},
        {"--task retrieval --lengths 1.5", "--lengths (whole multiples)"},
        {"--task retrieval --depths 0,2", "--depths"},
        {"--task retrieval --trials 0", "--trials"},
        {"--lengths 1,2", "--file are required"},
    };
    char errpath[600];
    snprintf(errpath, sizeof(errpath), "%s/err.txt", dir);
    for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
        int status;
        char *out = run_eval(bin, dir, mpath, bad[k][0], &status);
        free(out);
        assert_int_equal(status, 2);
        FILE *f = fopen(errpath, "r");
        char line[512] = "";
        assert_non_null(f);
        assert_non_null(fgets(line, sizeof(line), f));
        fclose(f);
        if (!strstr(line, bad[k][1]))
            print_message("'%s': %s", bad[k][0], line);
        assert_non_null(strstr(line, bad[k][1]));
    }
    su_remove_dir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_preset_shape_is_fixed),
        cmocka_unit_test(test_eval_retrieval_bad_options),
        cmocka_unit_test(test_eval_retrieval_shape),
        cmocka_unit_test(test_copies_rope),
        cmocka_unit_test(test_copies_alibi),
        cmocka_unit_test(test_copies_t5),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
