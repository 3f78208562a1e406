/*
 * tokenizer.h - text <-> token ids, built from a GGUF file's tokenizer.ggml.*
 * metadata. Internal to the model room (model.h wraps it for the server).
 *
 * Two families are supported, chosen by `tokenizer.ggml.model`:
 *
 *   llama  SentencePiece-style. Spaces become "▁" (U+2581) and one is put in
 *          front of the text (add_space_prefix); the text is cut into UTF-8
 *          characters, and adjacent pieces are merged, best score first, as
 *          long as the merged text is a token. Characters no token covers
 *          fall back to byte tokens <0xXX>.
 *   gpt2   byte-level BPE. A pre-tokenizer (regular expressions chosen by
 *          `tokenizer.ggml.pre`, matched with PCRE2 in UTF mode) cuts the text
 *          into words; each word's bytes are mapped to printable characters
 *          (GPT-2's byte-to-unicode table) and merged pairwise by the rank of
 *          `tokenizer.ggml.merges`, lowest rank first.
 *
 * Both merge loops keep candidate pairs in a priority queue, so encoding is
 * O(n log n) in the text length. Tokens of type user-defined are matched
 * whole in the text before either algorithm runs; control tokens (BOS, EOS,
 * chat markers) are never produced from text, only by tok_encode's add_bos.
 *
 * Decoding goes through a tok_stream, which takes ids one at a time and
 * gives back only complete UTF-8 characters, holding partial bytes (a
 * character split over byte tokens) until the rest arrives.
 *
 * Threading: a tok_vocab is immutable after tok_load; any number of threads
 * may encode and decode with it at once. A tok_stream belongs to one thread.
 */
#ifndef KVD_TOKENIZER_H
#define KVD_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

typedef struct tok_vocab tok_vocab;

/* The tokenizer family (tokenizer.ggml.model). */
enum tok_kind {
    TOK_KIND_SPM = 1, /* "llama": SentencePiece-style, scores */
    TOK_KIND_BPE = 2, /* "gpt2": byte-level BPE, merges */
};

/* Token types as GGUF's tokenizer.ggml.token_type numbers them. */
enum tok_type {
    TOK_TYPE_UNDEFINED = 0, /* treated as normal */
    TOK_TYPE_NORMAL = 1,
    TOK_TYPE_UNKNOWN = 2,
    TOK_TYPE_CONTROL = 3,      /* BOS, EOS, chat markers: never produced from text */
    TOK_TYPE_USER_DEFINED = 4, /* matched whole in the text, decoded as is */
    TOK_TYPE_UNUSED = 5,
    TOK_TYPE_BYTE = 6, /* <0xXX> byte fallback */
};

/* Longest token text tok_load accepts, in bytes. */
#define TOK_MAX_TOKEN_BYTES 65535

/* ------------------------------------------------------------------------
 * Lifecycle
 * ------------------------------------------------------------------------ */

/*
 * Build a tokenizer from f's metadata. Everything needed is copied: f may
 * be closed afterwards. Returns a new vocabulary, or NULL with the reason
 * in err naming the key (and index) at fault: tokens missing or not
 * strings, scores or token types whose length differs from the tokens', a
 * merge naming a piece that is not a token, a special token id outside
 * the vocabulary, an unsupported tokenizer.ggml.model, a
 * tokenizer.ggml.pre kvd has no patterns for (named: never another
 * family's patterns in its place).
 */
tok_vocab *tok_load(const gguf_file *f, char *err, size_t errlen);

/*
 * The same, with the pre-tokenizer named by the operator (force_pre: any
 * tokenizer.ggml.pre value tok_pre_known accepts) instead of the file's;
 * NULL means the file's. Forcing one on a SentencePiece vocabulary, or
 * naming an unknown one, fails.
 */
tok_vocab *tok_load_forced(const gguf_file *f, const char *force_pre, char *err, size_t errlen);

/* Whether pre is a tokenizer.ggml.pre value kvd has patterns for. */
bool tok_pre_known(const char *pre);

/* Free a vocabulary (NULL is fine). */
void tok_free(tok_vocab *v);

/* ------------------------------------------------------------------------
 * Properties
 * ------------------------------------------------------------------------ */

enum tok_kind tok_get_kind(const tok_vocab *v);
int tok_n_vocab(const tok_vocab *v);
int32_t tok_bos(const tok_vocab *v); /* -1 if the vocabulary has none */
int32_t tok_eos(const tok_vocab *v); /* -1 if none */
/* The unknown token (tokenizer.ggml.unknown_token_id), -1 if none: what a
 * byte-level BPE vocabulary without a character for some byte encodes that
 * byte as, so such a text does not come back from the ids. */
int32_t tok_unk(const tok_vocab *v);
/* Whether prompts should start with BOS (tokenizer.ggml.add_bos_token;
 * default true for llama, false for gpt2) and BOS exists. */
bool tok_add_bos(const tok_vocab *v);
/* Whether encoding puts a space before the text (SPM only). */
bool tok_add_space_prefix(const tok_vocab *v);
/* End of generation: EOS, EOT, EOM, and control tokens named like an end
 * of turn ("<|eot_id|>", "<|im_end|>", "<|end|>", ...). False when out of range. */
bool tok_is_eog(const tok_vocab *v, int32_t id);
/* Token type of id, or -1 when out of range. */
int tok_token_type(const tok_vocab *v, int32_t id);
/* The token's text as stored in the vocabulary (SPM "▁" and GPT-2 byte
 * characters undecoded), borrowed from v; NULL when out of range. */
const char *tok_token_text(const tok_vocab *v, int32_t id, size_t *len);

/* The pre-tokenizer family in use: "gpt2", "llama3", "qwen2", "starcoder",
 * "falcon", "default" (llama.cpp's BPE default set), "deepseek-llm",
 * "deepseek-coder", "deepseek-v3", "tekken", "gpt-4o", "bloom", "viking"
 * for BPE; "spm" for SentencePiece-style. Borrowed, static. */
const char *tok_pre_name(const tok_vocab *v);
/*
 * A note the caller prints, or NULL: set when tokenizer.ggml.pre is missing
 * (llama.cpp's "default" patterns are used, as llama.cpp does) or when the
 * operator's forced family replaced the file's value. Borrowed from v.
 */
const char *tok_warning(const tok_vocab *v);

/* ------------------------------------------------------------------------
 * Encoding
 * ------------------------------------------------------------------------ */

/*
 * Encode text (len bytes, need not be NUL-terminated; any bytes, invalid
 * UTF-8 included). With add_bos and a BOS id, BOS comes first. Writes at
 * most max ids to out; returns the number of ids of the full encoding
 * (which may exceed max: call again with a bigger buffer), or
 * -EINVAL (NULL text with len > 0, negative max, NULL out with max > 0),
 * -E2BIG (text over 256 MiB, or past PCRE2's match limits),
 * -EOVERFLOW (more than INT_MAX ids),
 * -ENOMEM, or -EILSEQ (a character neither a token, a byte token nor
 * <unk> can represent). out's contents are unspecified on error.
 */
int tok_encode(const tok_vocab *v, const char *text, size_t len, bool add_bos, int32_t *out,
               int max);
/* tok_encode, but control tokens written in the text ("<|im_start|>",
 * "<s>") become those tokens, as a rendered chat template needs. */
int tok_encode_special(const tok_vocab *v, const char *text, size_t len, bool add_bos,
                       int32_t *out, int max);
/* tok_encode_special for text that continues earlier text: no BOS, and
 * its first run is not the start of a text (SPM puts no space before it).
 * Where the tokenization of A + B is that of A followed by this of B, B
 * starts at a token boundary: how a chat engine checks that the spans of
 * a conversation's messages can be kept and dropped whole. */
int tok_encode_continuation(const tok_vocab *v, const char *text, size_t len, int32_t *out,
                            int max);
/*
 * tok_encode (special: tok_encode_special) that may stop early once the
 * encoding has more than max ids: a return <= max is the whole encoding;
 * one above max says only "more than max". It stops between the runs cut
 * out by user-defined/control tokens and, for BPE, between pre-tokenizer
 * words (an SPM run is encoded whole).
 */
int tok_encode_upto(const tok_vocab *v, const char *text, size_t len, bool add_bos, bool special,
                    int32_t *out, int max);

/*
 * The most bytes of text one token can stand for: its stored text's length
 * bounds what it covers (a BPE byte is stored as one or two bytes, SPM's
 * space as the three of U+2581), and an <unk> stands for at most one
 * character, 4 bytes. So a text of len bytes has at least
 * ceil(len / tok_max_token_bytes) tokens, a bound that costs nothing.
 */
size_t tok_max_token_bytes(const tok_vocab *v);

/*
 * The pre-tokenizer alone, for tests and diagnostics: cuts text into the
 * words BPE merges within. Stores the byte offset where each word starts
 * in starts[] (at most max) and returns the number of words (the end of
 * word i is starts[i + 1], and len for the last), or -EINVAL (an SPM
 * vocabulary, bad arguments) or -ENOMEM. User-defined tokens are not
 * split out here.
 */
int tok_split_words(const tok_vocab *v, const char *text, size_t len, size_t *starts, int max);

/* ------------------------------------------------------------------------
 * Decoding
 * ------------------------------------------------------------------------ */

/*
 * The raw bytes one token stands for: SPM "▁" -> " ", byte tokens -> their
 * byte, GPT-2 byte characters -> bytes, user-defined tokens as written,
 * control and unused tokens -> nothing, <unk> -> "▅" (as llama.cpp shows
 * it). Copies min(length, cap) bytes to buf (no NUL) and returns the full
 * length, or -EINVAL for an id out of range.
 */
int tok_piece(const tok_vocab *v, int32_t id, char *buf, size_t cap);


/*
 * Streaming decoder state, in storage the caller provides (tok_stream_init,
 * no deinit needed). Fields are private to tokenizer.c.
 */
struct tok_stream {
    unsigned char pend[4]; /* bytes of a UTF-8 character not yet complete */
    uint8_t n_pend;        /* bytes held in pend */
    uint8_t need;          /* length of the held character (2..4); 0 if none */
    bool strip_space;      /* drop one leading ' ' from the next non-empty piece */
};

/*
 * Start a stream. at_text_start: the ids pushed begin a text (a prompt, or
 * a decode of a whole encoding), so for an SPM vocabulary that adds a space
 * prefix the space the encoder added is removed from the first piece that
 * has text (BOS and other control tokens before it are skipped over). Pass
 * false when continuing a text, e.g. for tokens generated after a prompt.
 */
void tok_stream_init(struct tok_stream *s, const tok_vocab *v, bool at_text_start);

/* Bytes one tok_stream_push may write at most for this vocabulary. */
size_t tok_stream_max_out(const tok_vocab *v);

/*
 * Add token id to the stream and write the complete UTF-8 characters now
 * available to out. Bytes that cannot start or continue a valid character
 * become U+FFFD. Returns the number of bytes written (possibly 0), or
 * -EINVAL for an id out of range, or -ENOSPC when cap could be too small
 * (less than 3 * (piece length + held bytes); tok_stream_max_out always
 * suffices). The stream is unchanged on error.
 */
int tok_stream_push(struct tok_stream *s, const tok_vocab *v, int32_t id, char *out, size_t cap);

/*
 * End of the text: a held incomplete character becomes U+FFFD. Returns the
 * bytes written (0 or 3), or -ENOSPC if cap < 3 and something is held.
 */
int tok_stream_flush(struct tok_stream *s, char *out, size_t cap);

/*
 * Decode n ids at once, as a stream started with at_text_start and
 * flushed at the end. Copies at most cap bytes to out (no NUL) and returns
 * the full length, or -EINVAL (an id out of range, bad arguments),
 * -ENOMEM, -EOVERFLOW.
 */
int tok_decode(const tok_vocab *v, const int32_t *ids, int n, bool at_text_start, char *out,
               size_t cap);

#endif /* KVD_TOKENIZER_H */
