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

/*
 * The prompt of a chat request on a session under [eviction] unit = turn:
 * the conversation with its `drop` oldest turns left out (the rendering
 * decision the session's first request made, so the prompt still matches
 * the session's history), rendered whole, tokenized, with the spans of
 * its droppable turns. The cache drops those in place as it needs room
 * (kv_seq_set_turns); the system and developer messages, the tools, the
 * last user turn and the generation prompt are pinned.
 *
 * Returns 0 with out filled; 1 when the turns cannot be dropped in place
 * (why says why: the template does not render turns apart, a cut is not a
 * token boundary, the conversation has more than max_prompt tokens); 2
 * when the pinned part alone has more than budget tokens (nothing is
 * wrong with the template: the caller's fitting path reports it or cuts
 * the last turn); -1 when the conversation cannot be rendered (err).
 * out is empty unless 0; free it with srv_chat_turns_free.
 */
struct srv_chat_in_place {
    struct srv_chat_turns p; /* the prompt and its turns */
    int dropped_messages;    /* messages of the `drop` turns left out */
    int pinned_tokens;       /* prompt tokens in no turn */
};

int srv_chat_in_place(const model *m, const tpl_chat *c, const json_t *msgs,
                      const json_t *tools, int drop, time_t now, int budget, int max_prompt,
                      struct srv_chat_in_place *out, char *why, size_t whylen,
                      struct tpl_error *err);

/*
 * A last turn larger than the whole window: render the conversation with
 * every droppable turn left out, find the last user message's text in it
 * and cut tokens from the middle of that text until the prompt has budget
 * tokens. Everything else stays whole: the system prompt, the tools, the
 * turn's role header before the text and what follows the text (the end
 * of the turn, the generation prompt).
 *
 * Returns 0 with *ids (new) of *n_ids = budget tokens and *cut the tokens
 * taken out; -1 with why filled: the text is not found in the rendering
 * (a template that rewrites it), or the pinned part without any of the
 * text already has more than budget tokens; err for a render failure.
 */
int srv_chat_cut_last_turn(const model *m, const tpl_chat *c, const json_t *msgs,
                           const json_t *tools, time_t now, int budget, int32_t **ids,
                           int *n_ids, int *cut, char *why, size_t whylen, struct tpl_error *err);

#endif /* KVD_SERVER_CHAT_TURNS_H */
