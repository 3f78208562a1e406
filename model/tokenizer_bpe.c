/*
 * tokenizer_bpe.c - byte-level BPE (GPT-2 style): the pre-tokenizer
 * regular expressions, the byte-to-character table, and rank-ordered merges.
 *
 * Encoding a run of text goes in three steps, as in llama.cpp's
 * llm_tokenizer_bpe:
 *
 *   1. Pre-tokenize. A list of patterns (one to three, chosen by
 *      tokenizer.ggml.pre) cuts the text into words. Each pattern is applied
 *      within the pieces the previous one left, and the text between two
 *      matches is kept as a piece of its own. Patterns are PCRE2, compiled
 *      once at load in UTF mode with Unicode properties (\p{L}, \p{N}, and
 *      \s meaning Unicode white space), JIT-compiled when the library can;
 *      invalid UTF-8 simply never matches.
 *   2. Map every byte of a word to its GPT-2 character (printable bytes are
 *      themselves; the 68 others are U+0100 onwards, in byte order).
 *   3. Merge. Each character starts as a symbol holding its token id;
 *      adjacent pairs that tokenizer.ggml.merges lists go into a priority
 *      queue by rank (ties: leftmost first); popping the best pair turns the
 *      two symbols into the merge's result token. A queue entry is stale
 *      once either symbol changed, which is seen from the ids it recorded.
 *
 * Merges are kept as a hash table from the pair of token ids to (rank,
 * result id), which tok_load builds after checking that both pieces and
 * their concatenation are tokens.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "model/tokenizer_internal.h"

#define K_MERGES "tokenizer.ggml.merges"
#define K_PRE "tokenizer.ggml.pre"

/* ------------------------------------------------------------------------
 * Pre-tokenizer patterns
 * ------------------------------------------------------------------------ */

/* GPT-2's pattern; also the second step of several others. */
#define PAT_GPT2 "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"
#define PAT_LLAMA3                                                                                 \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define PAT_QWEN2                                                                                  \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"     \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

/* DeepSeek LLM's cased letters (the Lu/Ll/Lt letters of its tokenizer.json
 * class, written as code point ranges), its ASCII and full-width
 * punctuation, and the CJK/Hangul run both DeepSeek tokenizers cut out. */
#define DS_LETTERS                                                                                 \
    "A-Za-z\\x{b5}\\x{c0}-\\x{d6}\\x{d8}-\\x{f6}\\x{f8}-\\x{1ba}\\x{1bc}-\\x{1bf}"                 \
    "\\x{1c4}-\\x{293}\\x{295}-\\x{2af}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37b}-\\x{37d}"         \
    "\\x{37f}\\x{386}\\x{388}-\\x{38a}\\x{38c}\\x{38e}-\\x{3a1}\\x{3a3}-\\x{3f5}"                  \
    "\\x{3f7}-\\x{481}\\x{48a}-\\x{52f}\\x{531}-\\x{556}\\x{10a0}-\\x{10c5}\\x{13a0}-\\x{13f5}"    \
    "\\x{13f8}-\\x{13fd}\\x{1c90}-\\x{1cba}\\x{1cbd}-\\x{1cbf}\\x{1d00}-\\x{1d2b}"                 \
    "\\x{1d6b}-\\x{1d77}\\x{1d79}-\\x{1d9a}\\x{1e00}-\\x{1f15}\\x{1f18}-\\x{1f1d}"                 \
    "\\x{1f20}-\\x{1f45}\\x{1f48}-\\x{1f4d}\\x{1f50}-\\x{1f57}\\x{1f59}\\x{1f5b}\\x{1f5d}"         \
    "\\x{1f5f}-\\x{1f7d}\\x{1f80}-\\x{1fb4}\\x{1fb6}-\\x{1fbc}\\x{1fbe}\\x{1fc2}-\\x{1fc4}"        \
    "\\x{1fc6}-\\x{1fcc}\\x{1fd0}-\\x{1fd3}\\x{1fd6}-\\x{1fdb}\\x{1fe0}-\\x{1fec}"                 \
    "\\x{1ff2}-\\x{1ff4}\\x{1ff6}-\\x{1ffc}\\x{2102}\\x{2107}\\x{210a}-\\x{2113}\\x{2115}"         \
    "\\x{2119}-\\x{211d}\\x{2124}\\x{2126}\\x{2128}\\x{212a}-\\x{212d}\\x{212f}-\\x{2134}"         \
    "\\x{2139}\\x{213c}-\\x{213f}\\x{2145}-\\x{2149}\\x{214e}\\x{2183}\\x{2184}"                   \
    "\\x{2c00}-\\x{2c7b}\\x{2c7e}-\\x{2ce4}\\x{2ceb}-\\x{2cee}\\x{2cf2}\\x{2cf3}"                  \
    "\\x{a640}-\\x{a66d}\\x{a680}-\\x{a69b}\\x{a722}-\\x{a76f}\\x{a771}-\\x{a787}"                 \
    "\\x{a78b}-\\x{a78e}\\x{ab70}-\\x{abbf}\\x{fb00}-\\x{fb06}\\x{fb13}-\\x{fb17}"                 \
    "\\x{ff21}-\\x{ff3a}\\x{ff41}-\\x{ff5a}\\x{10400}-\\x{1044f}\\x{104b0}-\\x{104d3}"             \
    "\\x{104d8}-\\x{104fb}\\x{10c80}-\\x{10cb2}\\x{10cc0}-\\x{10cf2}\\x{118a0}-\\x{118df}"         \
    "\\x{1e900}-\\x{1e943}"
#define DS_PUNCT                                                                                   \
    "!-/:-~\\x{ff01}-\\x{ff0f}\\x{ff1a}-\\x{ff5e}\\x{2018}-\\x{201f}\\x{3000}-\\x{3002}"
#define DS_CJK "[\\x{4e00}-\\x{9fa5}\\x{800}-\\x{4e00}\\x{ac00}-\\x{d7ff}]+"
/* Tekken (Mistral Nemo) and GPT-4o: a word is an optional non-letter, then
 * upper-case letters followed by lower-case ones (or the other way round),
 * so "HelloWorld" cuts into "Hello" and "World". Written with the Unicode
 * case classes, as the tokenizer.json states it (PCRE2 has them). */
#define CASE_WORDS(sfx)                                                                            \
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]"     \
    "+" sfx "|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}"   \
            "\\p{M}]*" sfx
#define CONTRACTIONS_I "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
#define BLOOM_WORDS " ?[^(\\s|.,!?\\x{2026}\\x{3002}\\x{ff0c}\\x{3001}\\x{964}\\x{6d4}\\x{60c})]+"

struct pre_family {
    const char *name;
    int n;
    const char *pats[6];
};

static const struct pre_family FAMILIES[] = {
    {"gpt2", 1, {PAT_GPT2}},
    {"llama3", 1, {PAT_LLAMA3}},
    {"qwen2", 1, {PAT_QWEN2}},
    /* digits alone first, then GPT-2's pattern */
    {"starcoder", 2, {"\\p{N}", PAT_GPT2}},
    /* runs of punctuation first, GPT-2's pattern, then digits in threes */
    {"falcon", 3, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", PAT_GPT2, "[0-9][0-9][0-9]"}},
    /* llama.cpp's BPE default, for vocabularies that say "default" */
    {"default", 4, {"[\\p{P}\\$\\+<=>\\^~\\|]+", PAT_GPT2, "\\p{N}+", "[0-9][0-9][0-9]"}},
    /* line breaks alone, cased letters with one optional leading space,
     * punctuation runs, trailing white space, CJK/Hangul runs, digit runs.
     * "$" of the original is the end of the piece: \z here (PCRE2's "$"
     * would also match before a final newline). */
    {"deepseek-llm",
     6,
     {"[\\r\\n]", "\\s?[" DS_LETTERS "]+", "\\s?[" DS_PUNCT "]+", "\\s+\\z", DS_CJK, "\\p{N}+"}},
    {"deepseek-coder", 5, {"[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", DS_CJK, "\\p{N}"}},
    {"deepseek-v3",
     3,
     {"\\p{N}{1,3}", "[\\x{4e00}-\\x{9fa5}\\x{3040}-\\x{309f}\\x{30a0}-\\x{30ff}]+",
      "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\\r\\n\\p{L}\\p{P}\\p{S}]?"
      "[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {"tekken",
     1,
     {CASE_WORDS("") "|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}},
    {"gpt-4o",
     1,
     {CASE_WORDS(CONTRACTIONS_I) "|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|"
                                 "\\s+(?!\\S)|\\s+"}},
    /* everything but white space and a few (Western, CJK, Indic, Arabic)
     * punctuation marks, with an optional leading space */
    {"bloom", 1, {BLOOM_WORDS}},
    {"viking", 2, {BLOOM_WORDS, "\\p{N}"}},
};

/* tokenizer.ggml.pre values and the family each uses (as llama.cpp maps them). */
static const struct {
    const char *pre;
    const char *family;
    bool ignore_merges; /* a word that is a token is taken whole */
    bool add_bos;       /* BOS default when tokenizer.ggml.add_bos_token is absent */
} ALIASES[] = {
    {"gpt-2", "gpt2", false, false},
    {"gpt2", "gpt2", false, false},
    {"phi-2", "gpt2", false, false},
    {"mpt", "gpt2", false, false},
    {"olmo", "gpt2", false, false},
    {"jais", "gpt2", false, false},
    {"roberta-bpe", "gpt2", false, false},
    {"jina-es", "gpt2", false, false},
    {"jina-de", "gpt2", false, false},
    {"jina-v1-en", "gpt2", false, false},
    {"jina-v2-es", "gpt2", false, false},
    {"jina-v2-de", "gpt2", false, false},
    {"jina-v2-code", "gpt2", false, false},
    {"gigachat", "gpt2", false, false},
    {"exaone4", "gpt2", false, false},
    {"a.x-4.0", "gpt2", false, false},
    {"mellum", "gpt2", false, false},
    {"llama3", "llama3", true, true},
    {"llama-v3", "llama3", true, true},
    {"llama-bpe", "llama3", true, true},
    {"falcon3", "llama3", true, true},
    {"falcon-h1", "llama3", true, true},
    {"pixtral", "llama3", true, true},
    {"midm-2.0", "llama3", true, true},
    {"lfm2", "llama3", true, true},
    {"dbrx", "llama3", false, false},
    {"smaug-bpe", "llama3", false, false},
    {"chatglm-bpe", "llama3", false, false},
    {"glm4", "llama3", false, false},
    {"qwen2", "qwen2", false, false},
    {"stablelm2", "qwen2", false, false},
    {"deepseek-r1-qwen", "qwen2", false, false},
    {"kormo", "qwen2", false, false},
    {"megrez", "qwen2", false, false},
    {"hunyuan", "qwen2", false, false},
    {"grok-2", "qwen2", false, false},
    {"starcoder", "starcoder", false, false},
    {"refact", "starcoder", false, false},
    {"command-r", "starcoder", false, false},
    {"smollm", "starcoder", false, false},
    {"codeshell", "starcoder", false, false},
    {"exaone", "starcoder", false, false},
    {"minerva-7b", "starcoder", false, false},
    {"falcon", "falcon", false, false},
    {"default", "default", false, false},
    {"deepseek-llm", "deepseek-llm", false, false},
    {"deepseek-coder", "deepseek-coder", false, false},
    {"deepseek-v3", "deepseek-v3", false, false},
    {"hunyuan-dense", "deepseek-v3", false, false},
    {"tekken", "tekken", true, true},
    {"gpt-4o", "gpt-4o", false, false},
    {"llama4", "gpt-4o", false, false},
    {"bloom", "bloom", false, false},
    {"poro-chat", "bloom", false, false},
    {"gpt3-finnish", "bloom", false, false},
    {"viking", "viking", false, false},
};

struct tok_pretok {
    int n;
    pcre2_code *code[6];
};

static const struct pre_family *family(const char *name)
{
    for (size_t i = 0; i < sizeof FAMILIES / sizeof FAMILIES[0]; i++)
        if (strcmp(FAMILIES[i].name, name) == 0)
            return &FAMILIES[i];
    return NULL;
}

static int compile_family(tok_vocab *v, const struct pre_family *fam, char *err, size_t errlen)
{
    struct tok_pretok *p = calloc(1, sizeof *p);
    if (!p)
        return -ENOMEM;
    v->pre = p;
    v->pre_name = fam->name;
    for (int i = 0; i < fam->n; i++) {
        int code;
        PCRE2_SIZE off;
        p->code[i] =
            pcre2_compile((PCRE2_SPTR)fam->pats[i], PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &code, &off, NULL);
        if (!p->code[i]) {
            PCRE2_UCHAR msg[120];
            pcre2_get_error_message(code, msg, sizeof msg);
            snprintf(err, errlen, "pre-tokenizer %s: pattern %d does not compile at %zu: %s",
                     fam->name, i, (size_t)off, (const char *)msg);
            return -EINVAL;
        }
        p->n = i + 1;
        /* JIT when available; the interpreter gives the same matches. */
        (void)pcre2_jit_compile(p->code[i], PCRE2_JIT_COMPLETE);
    }
    return 0;
}

/* The alias row for a tokenizer.ggml.pre value, or -1. */
static int find_alias(const char *pre, size_t len)
{
    for (size_t i = 0; i < sizeof ALIASES / sizeof ALIASES[0]; i++)
        if (strlen(ALIASES[i].pre) == len && memcmp(ALIASES[i].pre, pre, len) == 0)
            return (int)i;
    return -1;
}

/*
 * Pick and compile the patterns for tokenizer.ggml.pre. An unknown value is
 * refused with its name: tokenizing with another family's patterns would
 * give different ids on some texts and nobody would know. The operator may
 * name the family instead (force: any value of the alias table), which
 * wins over the file's. A file without the key (converters before 2024)
 * gets llama.cpp's "default" patterns, and tok_warning says so.
 */
static int init_pre(tok_vocab *v, const gguf_file *f, const char *force, char *err, size_t errlen)
{
    const char *pre;
    size_t len;
    int rc = gguf_get_str(f, K_PRE, &pre, &len);
    if (rc < 0 && rc != -ENOENT) {
        snprintf(err, errlen, "%s is not a string", K_PRE);
        return -EINVAL;
    }
    int k;
    if (force) {
        k = find_alias(force, strlen(force));
        if (k < 0) {
            snprintf(err, errlen, "pre-tokenizer '%.64s' (forced by the operator) is unknown",
                     force);
            return -EINVAL;
        }
        if (rc == 0 && (strlen(force) != len || memcmp(force, pre, len) != 0))
            snprintf(v->warning, sizeof v->warning,
                     "%s '%.*s' overridden: using '%s' as configured", K_PRE,
                     (int)(len > 64 ? 64 : len), pre, force);
    } else if (rc == 0) {
        k = find_alias(pre, len);
        if (k < 0) {
            snprintf(err, errlen,
                     "%s '%.*s' is not supported (name a known one with [model] tokenizer_pre "
                     "to force it)",
                     K_PRE, (int)(len > 64 ? 64 : len), pre);
            return -EINVAL;
        }
    } else {
        k = find_alias("default", 7);
        snprintf(v->warning, sizeof v->warning, "%s is missing: using llama.cpp's default patterns",
                 K_PRE);
    }
    v->ignore_merges = ALIASES[k].ignore_merges;
    bool b;
    if (gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &b) == -ENOENT)
        v->add_bos = ALIASES[k].add_bos;
    return compile_family(v, family(ALIASES[k].family), err, errlen);
}

bool tok_pre_known(const char *pre)
{
    return pre && find_alias(pre, strlen(pre)) >= 0;
}

/* ------------------------------------------------------------------------
 * Bytes <-> GPT-2 characters
 * ------------------------------------------------------------------------ */

static bool printable_byte(unsigned b)
{
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* The code point GPT-2 maps byte b to. The 68 bytes that are not printable
 * (0x00-0x20, 0x7F-0xA0, 0xAD) take U+0100.. in byte order. */
static uint32_t byte_cp(unsigned b)
{
    if (printable_byte(b))
        return b;
    if (b <= 0x20)
        return 0x100 + b;
    if (b >= 0x7F && b <= 0xA0)
        return 0x100 + 33 + (b - 0x7F);
    return 0x100 + 33 + 34; /* 0xAD */
}

size_t tok_bpe_byte_char(unsigned char b, char out[2])
{
    uint32_t cp = byte_cp(b);
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

int tok_bpe_char_byte(uint32_t cp)
{
    if (cp < 0x100)
        return printable_byte(cp) ? (int)cp : -1;
    if (cp < 0x100 + 33)
        return (int)(cp - 0x100);
    if (cp < 0x100 + 67)
        return (int)(0x7F + cp - 0x100 - 33);
    if (cp == 0x100 + 67)
        return 0xAD;
    return -1;
}

/* ------------------------------------------------------------------------
 * Merge table
 * ------------------------------------------------------------------------ */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static uint64_t pair_key(int32_t l, int32_t r)
{
    return (((uint64_t)(uint32_t)l << 32) | (uint32_t)r) + 1;
}

/* Find the merge of (l, r): its rank and result, or false. */
static bool find_merge(const struct tok_merge_tab *t, int32_t l, int32_t r, int32_t *rank,
                       int32_t *result)
{
    uint64_t key = pair_key(l, r);
    for (uint32_t i = (uint32_t)mix64(key) & t->mask;; i = (i + 1) & t->mask) {
        if (t->keys[i] == 0)
            return false;
        if (t->keys[i] == key) {
            *rank = t->rank[i];
            *result = t->result[i];
            return true;
        }
    }
}

static int load_merges(tok_vocab *v, const gguf_file *f, char *err, size_t errlen)
{
    enum gguf_type et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, K_MERGES, &et, &n, &data);
    if (rc == -ENOENT) {
        snprintf(err, errlen, "%s is missing (a gpt2 tokenizer needs it)", K_MERGES);
        return -EINVAL;
    }
    if (rc < 0 || et != GGUF_TYPE_STRING) {
        snprintf(err, errlen, "%s is not an array of strings", K_MERGES);
        return -EINVAL;
    }
    if (n > (uint64_t)INT32_MAX / 2) {
        snprintf(err, errlen, "%s has %llu entries, too many", K_MERGES, (unsigned long long)n);
        return -EINVAL;
    }
    uint32_t slots = 16;
    while (slots < 2 * n)
        slots <<= 1;
    struct tok_merge_tab *t = &v->merges;
    t->mask = slots - 1;
    t->keys = calloc(slots, sizeof *t->keys);
    t->rank = malloc(sizeof *t->rank * slots);
    t->result = malloc(sizeof *t->result * slots);
    char *joined = malloc(2 * TOK_MAX_TOKEN_BYTES + 1);
    if (!t->keys || !t->rank || !t->result || !joined) {
        free(joined);
        return -ENOMEM;
    }
    rc = 0;
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        const char *s;
        size_t len;
        if (gguf_get_arr_str(f, K_MERGES, i, &s, &len) < 0) {
            snprintf(err, errlen, "%s[%llu] cannot be read", K_MERGES, (unsigned long long)i);
            rc = -EINVAL;
            break;
        }
        /* "left right", split at the first space after the first byte. */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        int shown = (int)(len > 48 ? 48 : len);
        if (!sp) {
            snprintf(err, errlen, "%s[%llu] '%.*s' is not two pieces separated by a space",
                     K_MERGES, (unsigned long long)i, shown, s);
            rc = -EINVAL;
            break;
        }
        size_t ll = (size_t)(sp - s), rl = len - ll - 1;
        int32_t l = tok_lookup(v, s, ll), r = tok_lookup(v, sp + 1, rl), m = -1;
        if (l >= 0 && r >= 0 && ll + rl <= 2 * TOK_MAX_TOKEN_BYTES) {
            memcpy(joined, s, ll);
            memcpy(joined + ll, sp + 1, rl);
            m = tok_lookup(v, joined, ll + rl);
        }
        if (l < 0 || r < 0 || m < 0) {
            const char *what = l < 0 ? s : r < 0 ? sp + 1 : NULL;
            int wl = (int)(l < 0 ? ll : rl);
            if (what)
                snprintf(err, errlen, "%s[%llu] '%.*s': '%.*s' is not a token", K_MERGES,
                         (unsigned long long)i, shown, s, wl > 32 ? 32 : wl, what);
            else
                snprintf(err, errlen, "%s[%llu] '%.*s': the merged piece is not a token", K_MERGES,
                         (unsigned long long)i, shown, s);
            rc = -EINVAL;
            break;
        }
        /* Insert; for a pair listed twice the first (lowest) rank stays. */
        uint64_t key = pair_key(l, r);
        for (uint32_t k = (uint32_t)mix64(key) & t->mask;; k = (k + 1) & t->mask) {
            if (t->keys[k] == key)
                break;
            if (t->keys[k] == 0) {
                t->keys[k] = key;
                t->rank[k] = (int32_t)i;
                t->result[k] = m;
                break;
            }
        }
    }
    free(joined);
    return rc;
}

int tok_bpe_init(tok_vocab *v, const gguf_file *f, const char *force_pre, char *err, size_t errlen)
{
    int rc = load_merges(v, f, err, errlen);
    if (rc < 0)
        return rc;
    return init_pre(v, f, force_pre, err, errlen);
}

void tok_bpe_free(tok_vocab *v)
{
    if (v->pre) {
        for (int i = 0; i < v->pre->n; i++)
            pcre2_code_free(v->pre->code[i]);
        free(v->pre);
        v->pre = NULL;
    }
    free(v->merges.keys);
    free(v->merges.rank);
    free(v->merges.result);
}

/* ------------------------------------------------------------------------
 * Pre-tokenizing
 * ------------------------------------------------------------------------ */

struct spans {
    size_t *start, *len;
    size_t n, cap;
};

static int spans_push(struct spans *s, size_t start, size_t len)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        size_t *a = realloc(s->start, sizeof *a * cap);
        if (!a)
            return -ENOMEM;
        s->start = a;
        size_t *b = realloc(s->len, sizeof *b * cap);
        if (!b)
            return -ENOMEM;
        s->len = b;
        s->cap = cap;
    }
    s->start[s->n] = start;
    s->len[s->n] = len;
    s->n++;
    return 0;
}

static void spans_free(struct spans *s)
{
    free(s->start);
    free(s->len);
    memset(s, 0, sizeof *s);
}

/* Cut text into words: each pattern splits the pieces the last one left,
 * keeping the text between matches. On success *words holds the pieces in
 * order (caller frees with spans_free). */
static int split(const tok_vocab *v, const char *text, size_t len, struct spans *words)
{
    struct spans cur = {0}, next = {0};
    int rc = 0;
    pcre2_match_data *md = NULL;
    if (len > 0 && (rc = spans_push(&cur, 0, len)) < 0)
        goto out;
    for (int p = 0; p < v->pre->n; p++) {
        const pcre2_code *code = v->pre->code[p];
        md = pcre2_match_data_create_from_pattern(code, NULL);
        if (!md) {
            rc = -ENOMEM;
            goto out;
        }
        next.n = 0;
        for (size_t w = 0; w < cur.n; w++) {
            const char *s = text + cur.start[w];
            size_t sl = cur.len[w], pos = 0, last = 0;
            while (pos < sl) {
                int m = pcre2_match(code, (PCRE2_SPTR)s, sl, pos, 0, md, NULL);
                if (m == PCRE2_ERROR_NOMATCH)
                    break;
                if (m < 0) {
                    rc = m == PCRE2_ERROR_NOMEMORY ? -ENOMEM : -E2BIG;
                    goto out;
                }
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
                if (ov[1] == ov[0]) { /* empty match: step over one character */
                    pos = ov[0] + 1;
                    while (pos < sl && ((unsigned char)s[pos] & 0xC0) == 0x80)
                        pos++;
                    continue;
                }
                if (ov[0] > last && (rc = spans_push(&next, cur.start[w] + last, ov[0] - last)) < 0)
                    goto out;
                if ((rc = spans_push(&next, cur.start[w] + ov[0], ov[1] - ov[0])) < 0)
                    goto out;
                pos = last = ov[1];
            }
            if (sl > last && (rc = spans_push(&next, cur.start[w] + last, sl - last)) < 0)
                goto out;
        }
        pcre2_match_data_free(md);
        md = NULL;
        struct spans t = cur;
        cur = next;
        next = t;
    }
    *words = cur;
    cur = (struct spans){0};
out:
    pcre2_match_data_free(md);
    spans_free(&cur);
    spans_free(&next);
    return rc;
}

int tok_bpe_split(const tok_vocab *v, const char *text, size_t len, size_t **starts,
                  size_t *n_starts)
{
    struct spans w = {0};
    int rc = split(v, text, len, &w);
    if (rc < 0)
        return rc;
    free(w.len);
    *starts = w.start;
    *n_starts = w.n;
    return 0;
}

/* ------------------------------------------------------------------------
 * Merging
 * ------------------------------------------------------------------------ */

struct bsym {
    int32_t prev, next; /* -1 at the ends */
    int32_t id;         /* token, or -1 for a character with no token */
    uint32_t nbytes;    /* bytes of the word; 0 once merged away */
};

struct bpair {
    int32_t rank;
    int32_t left, right; /* symbols */
    int32_t lid, rid;    /* their ids when queued */
    int32_t result;      /* the merged token */
};

/* Reused across the words of one encode call. */
struct scratch {
    struct bsym *sym;
    size_t sym_cap;
    struct bpair *heap;
    size_t heap_n, heap_cap;
    char *enc;
    size_t enc_cap;
};

static bool first(const struct bpair *x, const struct bpair *y)
{
    return x->rank < y->rank || (x->rank == y->rank && x->left < y->left);
}

static int pair_push(struct scratch *sc, struct bpair p)
{
    if (sc->heap_n == sc->heap_cap) {
        size_t cap = sc->heap_cap ? 2 * sc->heap_cap : 64;
        struct bpair *a = realloc(sc->heap, sizeof *a * cap);
        if (!a)
            return -ENOMEM;
        sc->heap = a;
        sc->heap_cap = cap;
    }
    size_t i = sc->heap_n++;
    while (i > 0) {
        size_t up = (i - 1) / 2;
        if (!first(&p, &sc->heap[up]))
            break;
        sc->heap[i] = sc->heap[up];
        i = up;
    }
    sc->heap[i] = p;
    return 0;
}

static struct bpair pair_pop(struct scratch *sc)
{
    struct bpair top = sc->heap[0], last = sc->heap[--sc->heap_n];
    size_t i = 0, n = sc->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && first(&sc->heap[c + 1], &sc->heap[c]))
            c++;
        if (!first(&sc->heap[c], &last))
            break;
        sc->heap[i] = sc->heap[c];
        i = c;
    }
    if (n > 0)
        sc->heap[i] = last;
    return top;
}

static int try_pair(const tok_vocab *v, struct scratch *sc, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return 0;
    int32_t lid = sc->sym[l].id, rid = sc->sym[r].id, rank, result;
    if (lid < 0 || rid < 0 || !find_merge(&v->merges, lid, rid, &rank, &result))
        return 0;
    return pair_push(sc, (struct bpair){rank, l, r, lid, rid, result});
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *a = realloc(*p, c * elem);
    if (!a)
        return -ENOMEM;
    *p = a;
    *cap = c;
    return 0;
}

static int encode_word(const tok_vocab *v, const unsigned char *w, size_t len, struct scratch *sc,
                       struct tok_out *o)
{
    int rc;
    if (v->ignore_merges) {
        /* Whole word as a token, if it is one (llama3). */
        if ((rc = grow((void **)&sc->enc, &sc->enc_cap, 2 * len, 1)) < 0)
            return rc;
        size_t el = 0;
        for (size_t i = 0; i < len; i++)
            el += tok_bpe_byte_char(w[i], sc->enc + el);
        int32_t id = tok_lookup(v, sc->enc, el);
        if (id >= 0) {
            tok_out_push(o, id);
            return 0;
        }
    }
    if ((rc = grow((void **)&sc->sym, &sc->sym_cap, len, sizeof *sc->sym)) < 0)
        return rc;
    struct bsym *sy = sc->sym;
    for (size_t i = 0; i < len; i++)
        sy[i] = (struct bsym){(int32_t)i - 1, (int32_t)i + 1, v->byte_id[w[i]], 1};
    sy[len - 1].next = -1;
    sc->heap_n = 0;
    for (size_t i = 1; i < len; i++)
        if ((rc = try_pair(v, sc, (int32_t)i - 1, (int32_t)i)) < 0)
            return rc;
    while (sc->heap_n > 0) {
        struct bpair p = pair_pop(sc);
        struct bsym *l = &sy[p.left], *r = &sy[p.right];
        if (l->nbytes == 0 || r->nbytes == 0 || l->next != p.right || l->id != p.lid ||
            r->id != p.rid)
            continue; /* stale */
        l->id = p.result;
        l->nbytes += r->nbytes;
        r->nbytes = 0;
        l->next = r->next;
        if (r->next >= 0)
            sy[r->next].prev = p.left;
        if ((rc = try_pair(v, sc, l->prev, p.left)) < 0 ||
            (rc = try_pair(v, sc, p.left, l->next)) < 0)
            return rc;
    }
    for (int32_t i = 0; i >= 0; i = sy[i].next) {
        if (sy[i].id >= 0) {
            tok_out_push(o, sy[i].id);
        } else if (v->unk >= 0) {
            tok_out_push(o, v->unk); /* a byte whose character is not a token */
        } else {
            return -EILSEQ;
        }
    }
    return 0;
}

int tok_bpe_encode(const tok_vocab *v, const char *text, size_t len, struct tok_out *out)
{
    struct spans words = {0};
    struct scratch sc = {0};
    int rc = split(v, text, len, &words);
    for (size_t i = 0; rc == 0 && i < words.n && !tok_out_over(out); i++)
        rc = encode_word(v, (const unsigned char *)text + words.start[i], words.len[i], &sc, out);
    spans_free(&words);
    free(sc.sym);
    free(sc.heap);
    free(sc.enc);
    return rc;
}
