/*
 * stop.h - stop-string scanning (stop.c), for the engine and its tests.
 */
#ifndef KVD_SERVER_STOP_H
#define KVD_SERVER_STOP_H

#include <stddef.h>

/*
 * The engine's stop-string scan (stop.c). Given the text held back
 * so far, find the earliest stop string occurring in it: returns its index
 * and sets *at to its offset. Otherwise returns -1 and sets *safe to the
 * number of leading bytes that no stop string can still start in (the rest
 * is a proper prefix of some stop string and must be held).
 */
int srv_stop_scan(const char *text, size_t len, char *const *stop, int n_stop, size_t *at,
                  size_t *safe);

#endif /* KVD_SERVER_STOP_H */
