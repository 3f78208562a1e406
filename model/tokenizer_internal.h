/*
 * tokenizer_internal.h - what tokenizer.c (loading, tables, decoding),
 * tokenizer_spm.c and tokenizer_bpe.c share. Included by those files only.
 *
 * The vocabulary keeps every token's text in one pool, a hash table from
 * text to id holding only the tokens the encoders may produce (normal and
 * user-defined ones), and for BPE a hash table from a merge's pair of ids
 * to its rank and result.
 */
#ifndef KVD_TOKENIZER_INTERNAL_H
#define KVD_TOKENIZER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/tokenizer.h"

/* Open-addressing table from text to token id (texts live in the vocab). */
struct tok_text_tab {
    uint32_t mask;  /* slots - 1; slots is a power of two */
    int32_t *ids;   /* [slots] token id, or -1 for an empty slot */
    uint32_t *hash; /* [slots] hash of the slot's text */
};

/* Open-addressing table from a merge's (left id, right id) to rank and result. */
struct tok_merge_tab {
    uint32_t mask;
    uint64_t *keys;  /* [slots] (left << 32 | right) + 1; 0 = empty */
    int32_t *rank;   /* [slots] position in tokenizer.ggml.merges */
    int32_t *result; /* [slots] id of the merged token */
};

struct tok_pretok; /* compiled pre-tokenizer patterns (tokenizer_bpe.c) */

struct tok_vocab {
    enum tok_kind kind;
    int32_t n; /* tokens */

    /* Token texts as stored, each NUL-terminated inside the pool. */
    char *text;         /* pool */
    uint32_t *text_off; /* [n] */
    uint32_t *text_len; /* [n] */

    /* Decoded bytes of each token (tok_piece). */
    char *piece;         /* pool */
    uint32_t *piece_off; /* [n] */
    uint32_t *piece_len; /* [n] */
    size_t max_piece;
    size_t max_text; /* the longest stored token text (tok_max_token_bytes) */

    float *score;  /* [n] SPM merge priority (0 when absent) */
    uint8_t *type; /* [n] enum tok_type */
    uint8_t *eog;  /* [n] 1 if the token ends generation */

    int32_t bos, eos, unk, eot, eom; /* -1 when absent */
    bool add_bos, add_space_prefix;

    /* SPM: id of <0xXX> for each byte; BPE: id of each byte's character.
     * -1 where the vocabulary has none. */
    int32_t byte_id[256];

    struct tok_text_tab lookup; /* tokens the encoders may produce */

    /* User-defined tokens, matched whole in the text before encoding:
     * ids sorted by first byte, then by length (longest first). */
    /* Tokens matched whole in text, longest first per leading byte:
     * [0] user-defined tokens (always), [1] those and the control tokens
     * (tok_encode_special: chat markers in a rendered template). */
    struct tok_whole {
        int32_t *ids;
        int32_t n;
        int32_t first[257]; /* ids[first[b] .. first[b+1]) start with byte b */
    } whole[2];

    /* BPE only. */
    struct tok_merge_tab merges;
    struct tok_pretok *pre;
    const char *pre_name;
    bool ignore_merges; /* llama3: a word that is a token is taken whole */

    char warning[192]; /* empty, or the note tok_warning returns */
};

/* Collects encoder output: ids beyond max are counted, not stored. With
 * stop, an encoder may end early once more than max are counted
 * (tok_out_over). */
struct tok_out {
    int32_t *ids;
    int64_t max;
    int64_t n;
    bool stop;
};

/* Whether an encoder may stop: the caller asked to, and max is passed. */
static inline bool tok_out_over(const struct tok_out *o)
{
    return o->stop && o->n > o->max;
}

static inline void tok_out_push(struct tok_out *o, int32_t id)
{
    if (o->n < o->max)
        o->ids[o->n] = id;
    o->n++;
}

/* Id of the token whose text is s[0..len), among those the encoders may
 * produce; -1 if none. */
int32_t tok_lookup(const tok_vocab *v, const char *s, size_t len);

/* Bytes of the UTF-8 character a lead byte starts (1 for stray bytes),
 * as llama.cpp counts them: by the top four bits. */
static inline size_t tok_utf8_len(unsigned char c)
{
    static const uint8_t lens[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lens[c >> 4];
}

/* SPM: encode one run of raw text (no user-defined tokens inside). */
int tok_spm_encode(const tok_vocab *v, const char *text, size_t len, bool space_prefix,
                   struct tok_out *out);

/* BPE: the merge table (tokenizer.ggml.merges) and the pre-tokenizer
 * named by tokenizer.ggml.pre, or by force_pre when not NULL (see
 * tok_load_forced). 0, or -errno with err filled. */
int tok_bpe_init(tok_vocab *v, const gguf_file *f, const char *force_pre, char *err,
                 size_t errlen);
void tok_bpe_free(tok_vocab *v);
/* BPE: encode one run of raw text (no user-defined tokens inside). */
int tok_bpe_encode(const tok_vocab *v, const char *text, size_t len, struct tok_out *out);
/* BPE: pre-tokenizer word starts (see tok_split_words). */
int tok_bpe_split(const tok_vocab *v, const char *text, size_t len, size_t **starts,
                  size_t *n_starts);
/* BPE: byte <-> GPT-2 character. The character of byte b as UTF-8 (1 or 2
 * bytes) into out; returns its length. */
size_t tok_bpe_byte_char(unsigned char b, char out[2]);
/* BPE: the byte code point cp stands for, or -1 if cp is not one of the 256. */
int tok_bpe_char_byte(uint32_t cp);

#endif /* KVD_TOKENIZER_INTERNAL_H */
