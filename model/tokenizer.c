/*
 * tokenizer.c - loading a tokenizer from GGUF metadata, the shared tables,
 * the split around user-defined tokens, and streaming UTF-8 detokenisation.
 *
 * Loading copies what encoding and decoding need out of the GGUF mapping:
 * token texts into one pool, their decoded bytes into another (so decoding
 * a token is a memcpy), scores and types into arrays, and builds a hash
 * table from text to id over the tokens the encoders may produce. Control,
 * unknown, unused and byte tokens are left out of that table, which is what
 * keeps "<s>" in a prompt from ever becoming BOS.
 *
 * The merge loops themselves live in tokenizer_spm.c and tokenizer_bpe.c.
 *
 * The stream decoder is a small UTF-8 validator: bytes of a character that
 * is not yet complete are held back; a byte that cannot continue what is
 * held ends it as one U+FFFD (the "maximal subpart" rule of Unicode), and
 * whatever is held at the end becomes U+FFFD too.
 */
#include <errno.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/tokenizer.h"
#include "model/tokenizer_internal.h"

#define K_MODEL "tokenizer.ggml.model"
#define K_TOKENS "tokenizer.ggml.tokens"
#define K_SCORES "tokenizer.ggml.scores"
#define K_TYPES "tokenizer.ggml.token_type"

/* Most tokens a vocabulary may have, and most text one tok_encode takes. */
#define TOK_MAX_VOCAB (1 << 24)
#define TOK_MAX_TEXT ((size_t)256 << 20)

static const char UTF8_FFFD[3] = {(char)0xEF, (char)0xBF, (char)0xBD};
static const char UTF8_UNK[3] = {(char)0xE2, (char)0x96, (char)0x85}; /* ▅ */

static void errf(char *err, size_t errlen, const char *fmt, ...)
{
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static bool str_eq(const char *s, size_t len, const char *lit)
{
    return strlen(lit) == len && memcmp(s, lit, len) == 0;
}

/* ------------------------------------------------------------------------
 * Text -> id table
 * ------------------------------------------------------------------------ */

static uint32_t hash_text(const char *s, size_t len)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static const char *text_of(const tok_vocab *v, int32_t id)
{
    return v->text + v->text_off[id];
}

int32_t tok_lookup(const tok_vocab *v, const char *s, size_t len)
{
    const struct tok_text_tab *t = &v->lookup;
    uint32_t h = hash_text(s, len);
    for (uint32_t i = h & t->mask;; i = (i + 1) & t->mask) {
        int32_t id = t->ids[i];
        if (id < 0)
            return -1;
        if (t->hash[i] == h && v->text_len[id] == len && memcmp(text_of(v, id), s, len) == 0)
            return id;
    }
}

/* Whether the encoders may produce a token of this type. */
static bool producible(uint8_t type)
{
    return type == TOK_TYPE_NORMAL || type == TOK_TYPE_UNDEFINED || type == TOK_TYPE_USER_DEFINED;
}

/* Build v->lookup over the producible tokens; a later duplicate text wins,
 * as in llama.cpp. 0 or -ENOMEM. */
static int build_lookup(tok_vocab *v)
{
    uint32_t slots = 16;
    while (slots < (uint32_t)v->n * 2u)
        slots <<= 1;
    struct tok_text_tab *t = &v->lookup;
    t->mask = slots - 1;
    t->ids = malloc(sizeof *t->ids * slots);
    t->hash = malloc(sizeof *t->hash * slots);
    if (!t->ids || !t->hash)
        return -ENOMEM;
    memset(t->ids, 0xff, sizeof *t->ids * slots);
    for (int32_t id = 0; id < v->n; id++) {
        if (!producible(v->type[id]) || v->text_len[id] == 0)
            continue;
        const char *s = text_of(v, id);
        size_t len = v->text_len[id];
        uint32_t h = hash_text(s, len);
        for (uint32_t i = h & t->mask;; i = (i + 1) & t->mask) {
            int32_t o = t->ids[i];
            if (o < 0 ||
                (t->hash[i] == h && v->text_len[o] == len && memcmp(text_of(v, o), s, len) == 0)) {
                t->ids[i] = id;
                t->hash[i] = h;
                break;
            }
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------
 * Loading
 * ------------------------------------------------------------------------ */

static int load_tokens(tok_vocab *v, const gguf_file *f, char *err, size_t errlen)
{
    enum gguf_type et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, K_TOKENS, &et, &n, &data);
    if (rc == -ENOENT) {
        errf(err, errlen, "%s is missing", K_TOKENS);
        return -EINVAL;
    }
    if (rc < 0) {
        errf(err, errlen, "%s is not an array", K_TOKENS);
        return -EINVAL;
    }
    if (et != GGUF_TYPE_STRING) {
        errf(err, errlen, "%s holds %s values, not strings", K_TOKENS, gguf_type_name(et));
        return -EINVAL;
    }
    if (n == 0 || n > TOK_MAX_VOCAB) {
        errf(err, errlen, "%s has %llu entries (1..%d allowed)", K_TOKENS, (unsigned long long)n,
             TOK_MAX_VOCAB);
        return -EINVAL;
    }
    v->n = (int32_t)n;
    v->text_off = malloc(sizeof *v->text_off * n);
    v->text_len = malloc(sizeof *v->text_len * n);
    if (!v->text_off || !v->text_len)
        return -ENOMEM;

    /* First pass: sizes; second: copy. */
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if (gguf_get_arr_str(f, K_TOKENS, i, &s, &len) < 0) {
            errf(err, errlen, "%s[%llu] cannot be read", K_TOKENS, (unsigned long long)i);
            return -EINVAL;
        }
        if (len > TOK_MAX_TOKEN_BYTES) {
            errf(err, errlen, "%s[%llu] is %zu bytes long (at most %d allowed)", K_TOKENS,
                 (unsigned long long)i, len, TOK_MAX_TOKEN_BYTES);
            return -EINVAL;
        }
        total += len + 1;
    }
    if (total > UINT32_MAX) {
        errf(err, errlen, "%s: the texts total %llu bytes, too many", K_TOKENS,
             (unsigned long long)total);
        return -EINVAL;
    }
    v->text = malloc(total);
    if (!v->text)
        return -ENOMEM;
    uint32_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        gguf_get_arr_str(f, K_TOKENS, i, &s, &len);
        memcpy(v->text + off, s, len);
        v->text[off + len] = '\0';
        v->text_off[i] = off;
        v->text_len[i] = (uint32_t)len;
        off += (uint32_t)len + 1;
    }
    return 0;
}

/* Check that an optional per-token array has one numeric entry per token.
 * 1 if present, 0 if absent, -EINVAL with err filled. */
static int per_token_array(const tok_vocab *v, const gguf_file *f, const char *key, char *err,
                           size_t errlen)
{
    enum gguf_type et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, key, &et, &n, &data);
    if (rc == -ENOENT)
        return 0;
    if (rc < 0) {
        errf(err, errlen, "%s is not an array", key);
        return -EINVAL;
    }
    if (et == GGUF_TYPE_STRING || et == GGUF_TYPE_ARRAY || et == GGUF_TYPE_BOOL) {
        errf(err, errlen, "%s holds %s values, not numbers", key, gguf_type_name(et));
        return -EINVAL;
    }
    if (n != (uint64_t)v->n) {
        errf(err, errlen, "%s has %llu entries but %s has %d", key, (unsigned long long)n, K_TOKENS,
             (int)v->n);
        return -EINVAL;
    }
    return 1;
}

static int hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The byte a "<0xXX>" text names, or -1 if the text is not of that form. */
static int byte_token_value(const char *s, size_t len)
{
    if (len != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int hi = hex_digit(s[3]), lo = hex_digit(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

static int load_scores_types(tok_vocab *v, const gguf_file *f, char *err, size_t errlen)
{
    v->score = calloc((size_t)v->n, sizeof *v->score);
    v->type = malloc((size_t)v->n);
    v->eog = calloc((size_t)v->n, 1);
    if (!v->score || !v->type || !v->eog)
        return -ENOMEM;
    memset(v->type, TOK_TYPE_NORMAL, (size_t)v->n);

    int rc = per_token_array(v, f, K_SCORES, err, errlen);
    if (rc < 0)
        return rc;
    for (int32_t i = 0; rc == 1 && i < v->n; i++) {
        float s;
        if (gguf_get_arr_f32(f, K_SCORES, (uint64_t)i, &s) < 0 || s != s) {
            errf(err, errlen, "%s[%d] is not a number", K_SCORES, (int)i);
            return -EINVAL;
        }
        v->score[i] = s;
    }

    rc = per_token_array(v, f, K_TYPES, err, errlen);
    if (rc < 0)
        return rc;
    bool have_types = rc == 1;
    for (int32_t i = 0; have_types && i < v->n; i++) {
        int64_t t;
        if (gguf_get_arr_i64(f, K_TYPES, (uint64_t)i, &t) < 0 || t < 0 || t > TOK_TYPE_BYTE) {
            errf(err, errlen, "%s[%d] is not a token type (0..6)", K_TYPES, (int)i);
            return -EINVAL;
        }
        v->type[i] = (uint8_t)t;
    }

    /* Byte tokens <0xXX>. Without a type array, SPM vocabularies mark them
     * by their text alone. */
    for (int b = 0; b < 256; b++)
        v->byte_id[b] = -1;
    for (int32_t i = 0; i < v->n; i++) {
        int b = byte_token_value(text_of(v, i), v->text_len[i]);
        bool looks = b >= 0;
        if (!have_types && v->kind == TOK_KIND_SPM && looks)
            v->type[i] = TOK_TYPE_BYTE;
        if (v->type[i] != TOK_TYPE_BYTE)
            continue;
        if (!looks) {
            errf(err, errlen, "%s[%d] '%.16s' has type byte but is not <0xXX>", K_TOKENS, (int)i,
                 text_of(v, i));
            return -EINVAL;
        }
        if (v->kind == TOK_KIND_SPM && v->byte_id[b] < 0)
            v->byte_id[b] = i;
    }
    return 0;
}

/* A special token id: absent -> dflt; -1 (or 0xFFFFFFFF, as some converters
 * write "none") -> -1; otherwise it must name a token. */
static int special_id(const tok_vocab *v, const gguf_file *f, const char *key, int32_t dflt,
                      int32_t *out, char *err, size_t errlen)
{
    int64_t x;
    int rc = gguf_get_i64(f, key, &x);
    if (rc == -ENOENT) {
        *out = dflt < v->n ? dflt : -1;
        return 0;
    }
    if (rc < 0) {
        errf(err, errlen, "%s is not an integer", key);
        return -EINVAL;
    }
    if (x == -1 || x == (int64_t)UINT32_MAX) {
        *out = -1;
        return 0;
    }
    if (x < 0 || x >= v->n) {
        errf(err, errlen, "%s = %lld is outside the vocabulary (%d tokens)", key, (long long)x,
             (int)v->n);
        return -EINVAL;
    }
    *out = (int32_t)x;
    return 0;
}

static int flag(const gguf_file *f, const char *key, bool dflt, bool *out, char *err, size_t errlen)
{
    int rc = gguf_get_bool(f, key, out);
    if (rc == -ENOENT) {
        *out = dflt;
        return 0;
    }
    if (rc < 0) {
        errf(err, errlen, "%s is not a bool", key);
        return -EINVAL;
    }
    return 0;
}

static int load_specials(tok_vocab *v, const gguf_file *f, char *err, size_t errlen)
{
    bool spm = v->kind == TOK_KIND_SPM;
    int rc;
    if ((rc = special_id(v, f, "tokenizer.ggml.bos_token_id", spm ? 1 : -1, &v->bos, err, errlen)) <
            0 ||
        (rc = special_id(v, f, "tokenizer.ggml.eos_token_id", spm ? 2 : -1, &v->eos, err, errlen)) <
            0 ||
        (rc = special_id(v, f, "tokenizer.ggml.unknown_token_id", spm ? 0 : -1, &v->unk, err,
                         errlen)) < 0 ||
        (rc = special_id(v, f, "tokenizer.ggml.eot_token_id", -1, &v->eot, err, errlen)) < 0 ||
        (rc = special_id(v, f, "tokenizer.ggml.eom_token_id", -1, &v->eom, err, errlen)) < 0)
        return rc;
    if ((rc = flag(f, "tokenizer.ggml.add_bos_token", spm, &v->add_bos, err, errlen)) < 0 ||
        (rc = flag(f, "tokenizer.ggml.add_space_prefix", spm, &v->add_space_prefix, err, errlen)) <
            0)
        return rc;
    if (!spm)
        v->add_space_prefix = false; /* byte-level BPE has no such step */

    /* End of generation: the ids named, and end-of-turn markers by name. */
    static const char *const eog_names[] = {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>",   "<|endoftext|>",
        "<|eom_id|>", "<EOT>",      "_<EOT>",  "<|end_of_text|>",
    };
    int32_t named[] = {v->eos, v->eot, v->eom};
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
        if (named[i] >= 0)
            v->eog[named[i]] = 1;
    for (int32_t id = 0; id < v->n; id++) {
        if (v->type[id] != TOK_TYPE_CONTROL && v->type[id] != TOK_TYPE_USER_DEFINED)
            continue;
        for (size_t k = 0; k < sizeof eog_names / sizeof eog_names[0]; k++)
            if (str_eq(text_of(v, id), v->text_len[id], eog_names[k]))
                v->eog[id] = 1;
    }
    return 0;
}

/* Decode one SPM/BPE token text into the bytes it stands for; out has
 * room for max(len, 3) bytes. Returns the length. */
static size_t decode_text(const tok_vocab *v, int32_t id, char *out)
{
    const unsigned char *s = (const unsigned char *)text_of(v, id);
    size_t len = v->text_len[id], o = 0;
    switch (v->type[id]) {
    case TOK_TYPE_CONTROL:
    case TOK_TYPE_UNUSED:
        return 0;
    case TOK_TYPE_UNKNOWN:
        memcpy(out, UTF8_UNK, 3);
        return 3;
    case TOK_TYPE_USER_DEFINED:
        memcpy(out, s, len);
        return len;
    case TOK_TYPE_BYTE: /* checked at load */
        out[0] = (char)byte_token_value((const char *)s, len);
        return 1;
    default:
        break;
    }
    if (v->kind == TOK_KIND_SPM) {
        for (size_t i = 0; i < len;) {
            if (i + 3 <= len && s[i] == 0xE2 && s[i + 1] == 0x96 && s[i + 2] == 0x81) {
                out[o++] = ' ';
                i += 3;
            } else {
                out[o++] = (char)s[i++];
            }
        }
        return o;
    }
    /* BPE: each character stands for one byte; others are copied. */
    for (size_t i = 0; i < len;) {
        size_t cl = tok_utf8_len(s[i]);
        uint32_t cp = 0xFFFFFFFFu;
        if (cl == 1 && s[i] < 0x80)
            cp = s[i];
        else if (cl == 2 && i + 2 <= len && (s[i + 1] & 0xC0) == 0x80)
            cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
        int b = cp == 0xFFFFFFFFu ? -1 : tok_bpe_char_byte(cp);
        if (b >= 0) {
            out[o++] = (char)b;
            i += cl;
        } else {
            if (i + cl > len)
                cl = len - i;
            memcpy(out + o, s + i, cl);
            o += cl;
            i += cl;
        }
    }
    return o;
}

static int build_pieces(tok_vocab *v)
{
    size_t total = 0;
    for (int32_t i = 0; i < v->n; i++)
        total += (v->text_len[i] > 3 ? v->text_len[i] : 3);
    if (total > UINT32_MAX)
        return -E2BIG;
    v->piece = malloc(total ? total : 1);
    v->piece_off = malloc(sizeof *v->piece_off * (size_t)v->n);
    v->piece_len = malloc(sizeof *v->piece_len * (size_t)v->n);
    if (!v->piece || !v->piece_off || !v->piece_len)
        return -ENOMEM;
    uint32_t off = 0;
    for (int32_t i = 0; i < v->n; i++) {
        size_t len = decode_text(v, i, v->piece + off);
        v->piece_off[i] = off;
        v->piece_len[i] = (uint32_t)len;
        off += (uint32_t)len;
        if (len > v->max_piece)
            v->max_piece = len;
        if (v->text_len[i] > v->max_text)
            v->max_text = v->text_len[i];
    }
    return 0;
}

/* Sort key of a user-defined token: by first byte, then longest first. */
struct user_key {
    unsigned char first;
    uint32_t len;
    int32_t id;
};

static int cmp_user(const void *a, const void *b)
{
    const struct user_key *x = a, *y = b;
    if (x->first != y->first)
        return x->first < y->first ? -1 : 1;
    if (x->len != y->len)
        return x->len > y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static bool whole_match(const tok_vocab *v, int32_t i, bool control)
{
    return v->text_len[i] > 0 &&
           (v->type[i] == TOK_TYPE_USER_DEFINED || (control && v->type[i] == TOK_TYPE_CONTROL));
}

/* The table of tokens matched whole: user-defined ones, and with control
 * the control tokens too. */
static int build_whole(tok_vocab *v, bool control)
{
    struct tok_whole *w = &v->whole[control];
    int32_t n = 0;
    for (int32_t i = 0; i < v->n; i++)
        n += whole_match(v, i, control);
    w->n = n;
    memset(w->first, 0, sizeof w->first);
    if (n == 0)
        return 0;
    struct user_key *keys = malloc(sizeof *keys * (size_t)n);
    w->ids = malloc(sizeof *w->ids * (size_t)n);
    if (!keys || !w->ids) {
        free(keys);
        return -ENOMEM;
    }
    n = 0;
    for (int32_t i = 0; i < v->n; i++)
        if (whole_match(v, i, control))
            keys[n++] = (struct user_key){(unsigned char)text_of(v, i)[0], v->text_len[i], i};
    qsort(keys, (size_t)n, sizeof *keys, cmp_user);
    int32_t k = 0;
    for (int b = 0; b < 256; b++) {
        w->first[b] = k;
        while (k < n && keys[k].first == b) {
            w->ids[k] = keys[k].id;
            k++;
        }
    }
    w->first[256] = n;
    free(keys);
    return 0;
}

tok_vocab *tok_load(const gguf_file *f, char *err, size_t errlen)
{
    return tok_load_forced(f, NULL, err, errlen);
}

tok_vocab *tok_load_forced(const gguf_file *f, const char *force_pre, char *err, size_t errlen)
{
    if (err && errlen)
        err[0] = '\0';
    if (!f) {
        errf(err, errlen, "no GGUF file");
        return NULL;
    }
    tok_vocab *v = calloc(1, sizeof *v);
    if (!v) {
        errf(err, errlen, "out of memory");
        return NULL;
    }
    v->bos = v->eos = v->unk = v->eot = v->eom = -1;
    v->pre_name = "spm";

    const char *model;
    size_t model_len;
    int rc = gguf_get_str(f, K_MODEL, &model, &model_len);
    if (rc == -ENOENT) {
        errf(err, errlen, "%s is missing", K_MODEL);
        goto fail;
    }
    if (rc < 0) {
        errf(err, errlen, "%s is not a string", K_MODEL);
        goto fail;
    }
    if (str_eq(model, model_len, "llama")) {
        v->kind = TOK_KIND_SPM;
    } else if (str_eq(model, model_len, "gpt2")) {
        v->kind = TOK_KIND_BPE;
    } else {
        errf(err, errlen, "%s '%.*s' is not supported (llama, gpt2)", K_MODEL,
             (int)(model_len > 32 ? 32 : model_len), model);
        goto fail;
    }

    if ((rc = load_tokens(v, f, err, errlen)) < 0 ||
        (rc = load_scores_types(v, f, err, errlen)) < 0 ||
        (rc = load_specials(v, f, err, errlen)) < 0)
        goto fail_rc;
    if ((rc = build_pieces(v)) < 0 || (rc = build_lookup(v)) < 0 || (rc = build_whole(v, false)) < 0 ||
        (rc = build_whole(v, true)) < 0)
        goto fail_rc;
    if (v->kind == TOK_KIND_BPE) {
        char c[2];
        for (int b = 0; b < 256; b++)
            v->byte_id[b] = tok_lookup(v, c, tok_bpe_byte_char((unsigned char)b, c));
        if ((rc = tok_bpe_init(v, f, force_pre, err, errlen)) < 0)
            goto fail_rc;
    } else if (force_pre) {
        errf(err, errlen,
             "a pre-tokenizer ('%.64s') was forced, but %s is 'llama' (SentencePiece), "
             "which has none",
             force_pre, K_MODEL);
        goto fail;
    }
    if (v->bos < 0)
        v->add_bos = false;
    return v;

fail_rc:
    if (rc == -ENOMEM)
        errf(err, errlen, "out of memory loading the tokenizer");
    else if (rc == -E2BIG)
        errf(err, errlen, "%s: token texts too large", K_TOKENS);
fail:
    tok_free(v);
    return NULL;
}

void tok_free(tok_vocab *v)
{
    if (!v)
        return;
    tok_bpe_free(v);
    free(v->text);
    free(v->text_off);
    free(v->text_len);
    free(v->piece);
    free(v->piece_off);
    free(v->piece_len);
    free(v->score);
    free(v->type);
    free(v->eog);
    free(v->lookup.ids);
    free(v->lookup.hash);
    free(v->whole[0].ids);
    free(v->whole[1].ids);
    free(v);
}

/* ------------------------------------------------------------------------
 * Properties
 * ------------------------------------------------------------------------ */

enum tok_kind tok_get_kind(const tok_vocab *v)
{
    return v->kind;
}
int tok_n_vocab(const tok_vocab *v)
{
    return v->n;
}
int32_t tok_bos(const tok_vocab *v)
{
    return v->bos;
}
int32_t tok_eos(const tok_vocab *v)
{
    return v->eos;
}
int32_t tok_unk(const tok_vocab *v)
{
    return v->unk;
}
bool tok_add_bos(const tok_vocab *v)
{
    return v->add_bos;
}
bool tok_add_space_prefix(const tok_vocab *v)
{
    return v->add_space_prefix;
}
const char *tok_pre_name(const tok_vocab *v)
{
    return v->pre_name;
}
const char *tok_warning(const tok_vocab *v)
{
    return v->warning[0] ? v->warning : NULL;
}

bool tok_is_eog(const tok_vocab *v, int32_t id)
{
    return id >= 0 && id < v->n && v->eog[id];
}

int tok_token_type(const tok_vocab *v, int32_t id)
{
    return id >= 0 && id < v->n ? v->type[id] : -1;
}

const char *tok_token_text(const tok_vocab *v, int32_t id, size_t *len)
{
    if (id < 0 || id >= v->n)
        return NULL;
    if (len)
        *len = v->text_len[id];
    return text_of(v, id);
}

/* ------------------------------------------------------------------------
 * Encoding
 * ------------------------------------------------------------------------ */

/* The longest token of table w that s starts with, if any. */
static int32_t match_whole(const tok_vocab *v, const struct tok_whole *w, const char *s,
                           size_t len, size_t *mlen)
{
    unsigned char b = (unsigned char)s[0];
    for (int32_t k = w->first[b]; k < w->first[b + 1]; k++) {
        int32_t id = w->ids[k];
        size_t tl = v->text_len[id];
        if (tl <= len && memcmp(s, text_of(v, id), tl) == 0) {
            *mlen = tl;
            return id;
        }
    }
    return -1;
}

static int encode_run(const tok_vocab *v, const char *s, size_t len, bool after_special,
                      struct tok_out *o)
{
    if (v->kind == TOK_KIND_SPM)
        return tok_spm_encode(v, s, len, v->add_space_prefix && after_special, o);
    return tok_bpe_encode(v, s, len, o);
}

static int encode(const tok_vocab *v, const char *text, size_t len, bool add_bos, bool special,
                  bool continuation, bool stop, int32_t *out, int max)
{
    if (!v || (!text && len > 0) || max < 0 || (!out && max > 0))
        return -EINVAL;
    if (len > TOK_MAX_TEXT)
        return -E2BIG;
    struct tok_out o = {out, max, 0, stop};
    if (add_bos && v->bos >= 0)
        tok_out_push(&o, v->bos);

    /* Cut out user-defined (and with special, control) tokens; encode the
     * runs of text between them.
     * Like llama.cpp, SPM puts a space before every run that follows a
     * special token or starts the text. */
    bool after_special = !continuation;
    size_t run = 0;
    int rc;
    const struct tok_whole *w = &v->whole[special];
    for (size_t i = 0; w->n > 0 && i < len && !tok_out_over(&o);) {
        size_t ml;
        int32_t id = match_whole(v, w, text + i, len - i, &ml);
        if (id < 0) {
            i++;
            continue;
        }
        if (i > run) {
            if ((rc = encode_run(v, text + run, i - run, after_special, &o)) < 0)
                return rc;
        }
        tok_out_push(&o, id);
        after_special = true;
        i += ml;
        run = i;
    }
    if (len > run && !tok_out_over(&o)) {
        if ((rc = encode_run(v, text + run, len - run, after_special, &o)) < 0)
            return rc;
    }
    if (o.n > INT_MAX)
        return -EOVERFLOW;
    return (int)o.n;
}

int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos, int32_t *out,
               int max)
{
    return encode(v, text, len, add_bos, false, false, false, out, max);
}

int tok_encode_special(const tok_vocab *v, const char *text, size_t len, bool add_bos,
                       int32_t *out, int max)
{
    return encode(v, text, len, add_bos, true, false, false, out, max);
}

int tok_encode_continuation(const tok_vocab *v, const char *text, size_t len, int32_t *out,
                            int max)
{
    return encode(v, text, len, false, true, true, false, out, max);
}

int tok_encode_upto(const tok_vocab *v, const char *text, size_t len, bool add_bos, bool special,
                    int32_t *out, int max)
{
    return encode(v, text, len, add_bos, special, false, true, out, max);
}

size_t tok_max_token_bytes(const tok_vocab *v)
{
    return v->max_text > 4 ? v->max_text : 4;
}

int tok_split_words(const tok_vocab *v, const char *text, size_t len, size_t *starts, int max)
{
    if (!v || v->kind != TOK_KIND_BPE || (!text && len > 0) || max < 0 || (!starts && max > 0))
        return -EINVAL;
    if (len > TOK_MAX_TEXT)
        return -E2BIG;
    size_t *all = NULL, n = 0;
    int rc = tok_bpe_split(v, text, len, &all, &n);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < n && i < (size_t)max; i++)
        starts[i] = all[i];
    free(all);
    return n > INT_MAX ? -EOVERFLOW : (int)n;
}

/* ------------------------------------------------------------------------
 * Decoding
 * ------------------------------------------------------------------------ */

int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap)
{
    if (!v || id < 0 || id >= v->n || (!buf && cap > 0))
        return -EINVAL;
    size_t len = v->piece_len[id];
    if (cap > 0)
        memcpy(buf, v->piece + v->piece_off[id], len < cap ? len : cap);
    return (int)len;
}

void tok_stream_init(struct tok_stream *s, const tok_vocab *v, bool at_text_start)
{
    memset(s, 0, sizeof *s);
    s->strip_space = at_text_start && v->add_space_prefix;
}

size_t tok_stream_max_out(const tok_vocab *v)
{
    return 3 * (v->max_piece + 4);
}

/* Whether b may be byte idx (1..3) of the character whose first byte is lead. */
static bool utf8_cont_ok(unsigned char lead, int idx, unsigned char b)
{
    unsigned char lo = 0x80, hi = 0xBF;
    if (idx == 1) {
        if (lead == 0xE0)
            lo = 0xA0; /* no overlong 3-byte forms */
        else if (lead == 0xED)
            hi = 0x9F; /* no surrogates */
        else if (lead == 0xF0)
            lo = 0x90; /* no overlong 4-byte forms */
        else if (lead == 0xF4)
            hi = 0x8F; /* nothing above U+10FFFF */
    }
    return b >= lo && b <= hi;
}

/* Feed one byte; writes up to 6 bytes (a U+FFFD and a 3-byte character's
 * end, or U+FFFD twice) to out and returns how many. */
static size_t utf8_feed(struct tok_stream *s, unsigned char b, char *out)
{
    size_t w = 0;
    if (s->need) {
        if (utf8_cont_ok(s->pend[0], s->n_pend, b)) {
            s->pend[s->n_pend++] = b;
            if (s->n_pend == s->need) {
                memcpy(out, s->pend, s->need);
                w = s->need;
                s->need = s->n_pend = 0;
            }
            return w;
        }
        /* What is held can never complete: one U+FFFD, then b afresh. */
        memcpy(out, UTF8_FFFD, 3);
        w = 3;
        s->need = s->n_pend = 0;
    }
    if (b < 0x80) {
        out[w++] = (char)b;
        return w;
    }
    uint8_t need = b >= 0xC2 && b <= 0xDF   ? 2
                   : b >= 0xE0 && b <= 0xEF ? 3
                   : b >= 0xF0 && b <= 0xF4 ? 4
                                            : 0;
    if (!need) {
        memcpy(out + w, UTF8_FFFD, 3);
        return w + 3;
    }
    s->pend[0] = b;
    s->n_pend = 1;
    s->need = need;
    return w;
}

int tok_stream_push(struct tok_stream *s, const tok_vocab *v, int32_t id, char *out, size_t cap)
{
    if (!s || !v || id < 0 || id >= v->n || (!out && cap > 0))
        return -EINVAL;
    const unsigned char *p = (const unsigned char *)v->piece + v->piece_off[id];
    size_t len = v->piece_len[id];
    if (cap < 3 * (len + s->n_pend))
        return -ENOSPC;
    if (len > 0 && s->strip_space) {
        if (p[0] == ' ') {
            p++;
            len--;
        }
        s->strip_space = false;
    }
    size_t w = 0;
    for (size_t i = 0; i < len; i++)
        w += utf8_feed(s, p[i], out + w);
    return (int)w;
}

int tok_stream_flush(struct tok_stream *s, char *out, size_t cap)
{
    if (!s || (!out && cap > 0))
        return -EINVAL;
    if (!s->need)
        return 0;
    if (cap < 3)
        return -ENOSPC;
    memcpy(out, UTF8_FFFD, 3);
    s->need = s->n_pend = 0;
    return 3;
}

int tok_decode(const tok_vocab *v, const int32_t *ids, int n, bool at_text_start, char *out,
               size_t cap)
{
    if (!v || n < 0 || (!ids && n > 0) || (!out && cap > 0))
        return -EINVAL;
    size_t bufcap = tok_stream_max_out(v);
    char *buf = malloc(bufcap);
    if (!buf)
        return -ENOMEM;
    struct tok_stream s;
    tok_stream_init(&s, v, at_text_start);
    size_t total = 0;
    int rc = 0;
    for (int i = 0; i <= n; i++) {
        int w =
            i < n ? tok_stream_push(&s, v, ids[i], buf, bufcap) : tok_stream_flush(&s, buf, bufcap);
        if (w < 0) {
            rc = w;
            goto out_free;
        }
        if (total < cap)
            memcpy(out + total, buf, (size_t)w < cap - total ? (size_t)w : cap - total);
        total += (size_t)w;
        if (total > INT_MAX) {
            rc = -EOVERFLOW;
            goto out_free;
        }
    }
    rc = (int)total;
out_free:
    free(buf);
    return rc;
}
