/*
 * chat_turns.h - a chat prompt as tokens with the spans of its turns
 * (chat_turns.c): what the engine gives a session's sequence so that the
 * cache can drop whole turns in place (kv_seq_set_turns).
 */
#ifndef KVD_SERVER_CHAT_TURNS_H
#define KVD_SERVER_CHAT_TURNS_H

#include <stddef.h>
#include <stdint.h>

#include "cache/kv_cache.h"
#include "model/model.h"
#include "template/template.h"

struct srv_chat_turns {
    int32_t *ids;          /* [n_ids] the prompt (new) */
    int n_ids;
    struct kv_turn *turns; /* [n_turns] the droppable turns, as spans of prompt indices
                              (a session's history indices once matched) (new) */
    int n_turns;
};

/*
 * Tokenize a cut rendering (tpl_chat_turns): the head as a prompt starts
 * (BOS when the model adds it), each turn and the tail as continuations
 * (model_tokenize_continuation). Their concatenation must be the
 * tokenization of the whole text, or a cut is not a token boundary and
 * the turns cannot be dropped whole.
 *
 * Returns 0 with out filled; 1 when a cut is not a token boundary (why
 * says which; out empty); -1 when the text cannot be tokenized (why says
 * so; out empty). Free out with srv_chat_turns_free in every case.
 */
int srv_chat_turns_tokenize(const model *m, const struct tpl_turns *t, struct srv_chat_turns *out,
                            char *why, size_t whylen);
void srv_chat_turns_free(struct srv_chat_turns *x);

#endif /* KVD_SERVER_CHAT_TURNS_H */
