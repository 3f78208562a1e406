/*
 * cmd_tokenize.c - `kvd tokenize`: show how a model's tokenizer cuts text.
 *
 * Prints the ids space-separated on one line, without BOS (--bos adds it),
 * or with --pieces one token per line: the id and the text that token
 * decodes to, quoted, with control and non-printable bytes escaped.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "config/args.h"
#include "model/model.h"

static void tokenize_usage(FILE *f)
{
    fprintf(f, "usage: kvd tokenize --model FILE [--pieces] [--bos] [--tokenizer-pre NAME]\n"
               "                    (--file PATH | [--] TEXT)\n"
               "  --model FILE   GGUF model (or vocabulary-only file) whose tokenizer to use\n"
               "  --tokenizer-pre NAME  pre-tokenizer to use instead of the file's\n"
               "                 tokenizer.ggml.pre (llama-bpe, qwen2, deepseek-llm, ...)\n"
               "  --file PATH    tokenize the bytes of a regular file (at most 256 MiB)\n"
               "  --pieces       one token per line: id and its text\n"
               "  --bos          start with BOS as a prompt would\n");
}

/* The largest file --file takes: tokenizing is linear, but the ids of a
 * larger text would not be useful on a terminal either. */
#define MAX_FILE_BYTES (256u << 20)

/*
 * Read a whole regular file of at most MAX_FILE_BYTES (new buffer). A
 * device, FIFO or directory is refused before reading (/dev/zero would
 * never end), and so is a file that grows past the cap while being read.
 * NULL with the reason in err on failure.
 */
static char *read_file(const char *path, size_t *len, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    char *buf = NULL;
    if (fstat(fileno(f), &st) != 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        goto out_close;
    }
    if (!S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s is not a regular file", path);
        goto out_close;
    }
    if ((uint64_t)st.st_size > MAX_FILE_BYTES) {
        snprintf(err, errlen, "%s is %lld bytes; --file takes at most %u", path,
                 (long long)st.st_size, MAX_FILE_BYTES);
        goto out_close;
    }
    /* One byte more than the size says, to notice a file that grew. */
    size_t cap = (size_t)st.st_size + 1;
    buf = malloc(cap);
    if (!buf) {
        snprintf(err, errlen, "%s: out of memory (%zu bytes)", path, cap);
        goto out_close;
    }
    size_t n = fread(buf, 1, cap, f);
    if (ferror(f) || n == cap) {
        snprintf(err, errlen, "%s: %s", path, ferror(f) ? "read error" : "the file grew while read");
        free(buf);
        buf = NULL;
        goto out_close;
    }
    *len = n;
out_close:
    fclose(f);
    return buf;
}

/* Print text quoted: printable ASCII and UTF-8 as is, the rest escaped. */
static void print_quoted(const char *s, int n)
{
    putchar('\'');
    for (int i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '\n')
            fputs("\\n", stdout);
        else if (c == '\t')
            fputs("\\t", stdout);
        else if (c == '\\' || c == '\'')
            printf("\\%c", c);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    putchar('\'');
}

int srv_cmd_tokenize(int argc, char **argv)
{
    const char *model_path = NULL, *file = NULL, *text = NULL, *pre = NULL;
    bool pieces = false, bos = false, bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        if (srv_opt_value(argc, argv, &i, "tokenize", "--model", &v, &bad)) {
            model_path = v;
        } else if (srv_opt_value(argc, argv, &i, "tokenize", "--file", &v, &bad)) {
            file = v;
        } else if (srv_opt_value(argc, argv, &i, "tokenize", "--tokenizer-pre", &v, &bad)) {
            pre = v;
        } else if (!strcmp(argv[i], "--pieces")) {
            pieces = true;
            i++;
        } else if (!strcmp(argv[i], "--") && i + 1 < argc && !text) {
            text = argv[i + 1]; /* text that starts with '-' */
            i += 2;
        } else if (!strcmp(argv[i], "--bos")) {
            bos = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            tokenize_usage(stdout);
            return 0;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0' && !text) {
            fprintf(stderr, "kvd tokenize: unknown option '%s'\n", argv[i]);
            tokenize_usage(stderr);
            return 2;
        } else if (!text) {
            text = argv[i++];
        } else {
            fprintf(stderr, "kvd tokenize: give the text as one argument (quote it)\n");
            return 2;
        }
    }
    if (bad)
        return 2;
    if (!model_path || (!file && !text) || (file && text)) {
        fprintf(stderr, "kvd tokenize: need --model FILE and either --file PATH or TEXT\n");
        tokenize_usage(stderr);
        return 2;
    }

    size_t len = 0;
    char *owned = NULL;
    if (file) {
        char ferr[600];
        owned = read_file(file, &len, ferr, sizeof(ferr));
        if (!owned) {
            fprintf(stderr, "kvd tokenize: %s\n", ferr);
            return 1;
        }
        text = owned;
    } else {
        len = strlen(text);
    }

    char err[512];
    /* Only the tokenizer is needed: vocabulary-only files load too. */
    struct model_params mp = {.path = model_path, .vocab_only = true, .tokenizer_pre = pre};
    model *m = model_load(&mp, err, sizeof(err));
    if (!m) {
        fprintf(stderr, "kvd tokenize: %s\n", err);
        free(owned);
        return 1;
    }
    struct model_info info;
    model_get_info(m, &info);
    if (info.tokenizer_note)
        fprintf(stderr, "kvd tokenize: note: %s\n", info.tokenizer_note);
    int status = 1;
    int n = model_tokenize(m, text, len, bos, NULL, 0);
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (n < 0) {
        fprintf(stderr, "kvd tokenize: tokenizing failed: %s\n", strerror(-n));
        goto out;
    }
    if (n > 0 && !ids) {
        fprintf(stderr, "kvd tokenize: out of memory for %d tokens\n", n);
        goto out;
    }
    if (n > 0 && model_tokenize(m, text, len, bos, ids, n) != n) {
        fprintf(stderr, "kvd tokenize: tokenizing failed\n");
        goto out;
    }
    if (!pieces) {
        for (int i = 0; i < n; i++)
            printf(i ? " %d" : "%d", ids[i]);
        printf("\n");
        status = 0;
        goto out;
    }
    for (int i = 0; i < n; i++) {
        /* Each token decoded on its own: a byte token that is only part of
         * a character shows as U+FFFD. */
        char piece[1024];
        model_detok *d = model_detok_create(m);
        if (!d) {
            fprintf(stderr, "kvd tokenize: out of memory\n");
            goto out;
        }
        int a = model_detok_push(d, ids[i], piece, sizeof(piece) - 8);
        int b = a >= 0 ? model_detok_flush(d, piece + a, sizeof(piece) - (size_t)a) : 0;
        model_detok_destroy(d);
        printf("%d\t", ids[i]);
        if (a < 0 || b < 0)
            printf("(piece too long to show)");
        else
            print_quoted(piece, a + b);
        printf("\n");
    }
    status = 0;
out:
    free(ids);
    free(owned);
    model_free(m);
    return status;
}
