/*
 * mkmodel_internal.h - what mkmodel.c (the seeded models, the vocabulary,
 * the GGUF metadata) shares with mkmodel_retrieval.c (the constructed
 * retrieval model, `kvd mkmodel --preset retrieval`). Never included from
 * outside the model room (tests excepted: they are white-box).
 */
#ifndef KVD_MKMODEL_INTERNAL_H
#define KVD_MKMODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"
#include "model/mkmodel.h"

/* A SentencePiece-shaped vocabulary under construction (mkmodel.c). */
struct mk_vocab {
    char **tok;    /* [n] piece strings */
    float *score;  /* [n] */
    int32_t *type; /* [n] llama token types: 1 normal, 2 unknown, 3 control, 6 byte */
    int n, cap;
};

/* splitmix64: tiny, seedable, and good enough for weights and shuffles. */
uint64_t mk_rng_next(uint64_t *s);

/* The retrieval preset's words: every one is a whole-word piece of its
 * vocabulary (with its prefixes), and nothing else is (no n-gram fill). */
extern const char *const mk_retrieval_words[];
extern const size_t mk_retrieval_n_words;

/* Check that p has the retrieval construction's shape (position, heads,
 * dims); 0 or -EINVAL with the reason in err. */
int mk_retrieval_check(const struct model_mk_params *p, char *err, size_t errlen);

/*
 * Add every tensor of the retrieval model, computed from p and the
 * vocabulary v, to w. 0, or a negative code with err filled; w may then
 * hold some of the tensors (the caller discards it).
 */
int mk_retrieval_tensors(gguf_writer *w, const struct model_mk_params *p, const struct mk_vocab *v,
                         char *err, size_t errlen);

#endif /* KVD_MKMODEL_INTERNAL_H */
