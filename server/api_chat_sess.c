/*
 * api_chat_sess.c - what each chat session's earlier requests decided
 * under [eviction] unit = turn: how many of the conversation's oldest
 * turns (and messages) its prompt leaves out, so the next request renders
 * the same prefix (and the engine finds it cached). Most recently used
 * first; the least recently used entry goes past MAX_CHAT_SESSIONS.
 * Loop thread only.
 */
#include <stdlib.h>
#include <string.h>

#include "server/api_internal.h"

static struct chat_sess *sess_find(srv_api *a, const char *id)
{
    for (struct chat_sess **pp = &a->chat_sess; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->id, id)) {
            struct chat_sess *x = *pp; /* move to the front: most recent first */
            *pp = x->next;
            x->next = a->chat_sess;
            a->chat_sess = x;
            return x;
        }
    return NULL;
}

static void sess_free(struct chat_sess *x)
{
    free(x->id);
    free(x);
}

const struct chat_sess *srv_chat_sess_get(srv_api *a, const char *id)
{
    return id ? sess_find(a, id) : NULL;
}

void srv_chat_sess_fallback_logged(srv_api *a, const char *id)
{
    struct chat_sess *x = sess_find(a, id);
    if (x)
        x->fallback_logged = true;
}

/* Record a session's decision; the least recently used entry goes past
 * MAX_CHAT_SESSIONS (the engine drops idle sessions too). */
int srv_chat_sess_set(srv_api *a, const char *id, int turns, int messages)
{
    struct chat_sess *x = sess_find(a, id);
    if (!x) {
        x = calloc(1, sizeof(*x));
        if (!x || !(x->id = strdup(id))) {
            free(x);
            return -1;
        }
        x->next = a->chat_sess;
        a->chat_sess = x;
        if (++a->n_chat_sess > MAX_CHAT_SESSIONS) {
            struct chat_sess **pp = &a->chat_sess;
            while ((*pp)->next)
                pp = &(*pp)->next;
            sess_free(*pp);
            *pp = NULL;
            a->n_chat_sess--;
        }
    }
    x->dropped_turns = turns;
    x->dropped_messages = messages;
    return 0;
}

void srv_chat_sess_forget(srv_api *a, const char *id)
{
    for (struct chat_sess **pp = &a->chat_sess; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->id, id)) {
            struct chat_sess *x = *pp;
            *pp = x->next;
            sess_free(x);
            a->n_chat_sess--;
            return;
        }
}

void srv_chat_sess_free_all(srv_api *a)
{
    while (a->chat_sess) {
        struct chat_sess *x = a->chat_sess;
        a->chat_sess = x->next;
        sess_free(x);
    }
    a->n_chat_sess = 0;
}
