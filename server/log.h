/*
 * log.h - the daemon's log (log.c): one line per event on stderr, text or
 * JSON, thread-safe.
 */
#ifndef KVD_SERVER_LOG_H
#define KVD_SERVER_LOG_H

#include <stdbool.h>

enum srv_log_level { SRV_LOG_DEBUG = 0, SRV_LOG_INFO, SRV_LOG_WARN, SRV_LOG_ERROR };

/* Set the threshold and the format (json: one JSON object per line). */
void srv_log_setup(enum srv_log_level level, bool json);
/* Thread-safe: each call writes one whole line. */
void srv_log(enum srv_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif /* KVD_SERVER_LOG_H */
