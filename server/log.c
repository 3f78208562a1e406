/*
 * log.c - the daemon's log: one line per event on stderr.
 *
 * Two formats: text ("2024-05-01T12:00:00.123Z info message") for people
 * and JSON ({"ts":...,"level":...,"msg":...}) for collectors. Each call
 * formats the whole line first and writes it with one fwrite, so lines
 * from the loop thread and the engine thread never interleave.
 */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

#include "server/log.h"

/* Set by the loop thread (start, reload), read by both threads. */
static atomic_int log_level = SRV_LOG_INFO;
static atomic_bool log_json;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void srv_log_setup(enum srv_log_level level, bool json)
{
    atomic_store(&log_level, (int)level);
    atomic_store(&log_json, json);
}

/* Append s to out as the inside of a JSON string. */
static size_t json_escape(char *out, size_t cap, const char *s)
{
    size_t n = 0;
    for (; *s && n + 7 < cap; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            out[n++] = '\\';
            out[n++] = (char)c;
        } else if (c < 0x20) {
            n += (size_t)snprintf(out + n, cap - n, "\\u%04x", c);
        } else {
            out[n++] = (char)c;
        }
    }
    out[n] = '\0';
    return n;
}

void srv_log(enum srv_log_level level, const char *fmt, ...)
{
    if ((int)level < atomic_load(&log_level))
        return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);

    struct timeval tv;
    gettimeofday(&tv, NULL);
    struct tm tm;
    gmtime_r(&tv.tv_sec, &tm);
    char ts[96];
    snprintf(ts, sizeof(ts), "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
             tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(tv.tv_usec / 1000));

    char line[2400];
    int n;
    if (atomic_load(&log_json)) {
        char esc[2200];
        json_escape(esc, sizeof(esc), msg);
        n = snprintf(line, sizeof(line), "{\"ts\":\"%s\",\"level\":\"%s\",\"msg\":\"%s\"}\n", ts,
                     level_names[level], esc);
    } else {
        n = snprintf(line, sizeof(line), "%s %s %s\n", ts, level_names[level], msg);
    }
    if (n < 0)
        return;
    if ((size_t)n >= sizeof(line))
        n = (int)sizeof(line) - 1;
    fwrite(line, 1, (size_t)n, stderr);
    fflush(stderr);
}
