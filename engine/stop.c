/*
 * stop.c - stop strings: where a completion's text must end.
 *
 * A stop string may arrive split across tokens, so the engine keeps the
 * text it has not emitted yet and asks, after every token, whether a stop
 * string now occurs in it (cut there, never emit it) and otherwise how much
 * of it is safe to emit: everything but the longest tail that is still a
 * proper prefix of some stop string.
 */
#include <string.h>

#include "engine/engine_internal.h"

int engine_stop_scan(const char *text, size_t len, char *const *stop, int n_stop, size_t *at,
                     size_t *safe)
{
    /* 1. The earliest complete occurrence of any stop string wins; at the
     *    same offset, the longer string. */
    int best = -1;
    size_t best_at = 0;
    for (int i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        if (sl == 0 || sl > len)
            continue;
        const char *hit = memmem(text, len, stop[i], sl);
        if (!hit)
            continue;
        size_t off = (size_t)(hit - text);
        if (best < 0 || off < best_at || (off == best_at && sl > strlen(stop[best]))) {
            best = i;
            best_at = off;
        }
    }
    if (best >= 0) {
        *at = best_at;
        return best;
    }
    /* 2. No match: hold back the longest tail that is a proper prefix of a
     *    stop string. */
    size_t hold = 0;
    for (int i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        size_t maxk = sl - 1 < len ? sl - 1 : len;
        for (size_t k = maxk; k > hold; k--) {
            if (!memcmp(text + len - k, stop[i], k)) {
                hold = k;
                break;
            }
        }
    }
    *safe = len - hold;
    return -1;
}
