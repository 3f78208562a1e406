/*
 * config_internal.h - helpers shared inside the config room only.
 */
#ifndef KVD_CONFIG_INTERNAL_H
#define KVD_CONFIG_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config/config.h"

/*
 * A whole decimal integer ("-12", "4096"; no spaces, no '+', no hex).
 * Returns 0, -EINVAL (not an integer) or -ERANGE (outside int64).
 */
int cfg_parse_int(const char *s, int64_t *out);

/*
 * A finite decimal number ("8", "0.5", "1e-3"; no hex, inf or nan).
 * Returns 0 or -EINVAL.
 */
int cfg_parse_number(const char *s, double *out);

/*
 * HOST:PORT where HOST is a dotted IPv4 address, a bracketed IPv6 address
 * or a host name, and PORT is in [0, 65535]. Returns 0, or -EINVAL with
 * the reason in err.
 */
int cfg_check_listen(const char *s, char *err, size_t errlen);

/* Case-insensitive ASCII string equality. */
bool cfg_streq_ci(const char *a, const char *b);

/* --- the key table (keys.c) --- */

enum cfg_ktype {
    CFG_T_INT,
    CFG_T_SIZE,
    CFG_T_DURATION,
    CFG_T_BOOL,
    CFG_T_ENUM,
    CFG_T_STRING,
    CFG_T_NUMBER
};

struct cfg_key_def {
    const char *section;
    const char *name;
    enum cfg_ktype type;
    size_t offset;            /* of the value in struct cfg */
    size_t size;              /* bytes of the value (CFG_T_STRING: the buffer) */
    const char *def;          /* default, spelled as in kvd.conf */
    int64_t min, max;         /* CFG_T_INT; CFG_T_SIZE in bytes; CFG_T_DURATION in ms */
    double fmin, fmax;        /* CFG_T_NUMBER */
    const char *const *names; /* CFG_T_ENUM: spellings, NULL-terminated; index = value */
    const char *unit;         /* what a CFG_T_INT counts ("tokens"); NULL if nothing */
    const char *doc;          /* one line: what the key changes */
    bool live;                /* a running server applies changes on reload */
    bool secret;              /* never echoed in errors or dumps */
    int (*check)(const char *s, char *err, size_t errlen); /* CFG_T_STRING: extra syntax */
};

/* One row per key, indexed by enum cfg_key. */
extern const struct cfg_key_def cfg_keys[CFG_N_KEYS];

/* The section names, in the order the table lists them. */
#define CFG_N_SECTIONS 8
extern const char *const cfg_sections[CFG_N_SECTIONS];

/* Where key k's value lives in c. */
static inline void *cfg_field(struct cfg *c, int k)
{
    return (char *)c + cfg_keys[k].offset;
}

static inline const void *cfg_cfield(const struct cfg *c, int k)
{
    return (const char *)c + cfg_keys[k].offset;
}

/* True if s names a section of the table. */
bool cfg_section_known(const char *s);

/*
 * Parse `s` as key k's type and store it in c. On failure (-EINVAL) *c is
 * unchanged and `why` says what is accepted.
 */
int cfg_key_parse(int k, const char *s, struct cfg *c, char *why, size_t whylen);

/*
 * snprintf for messages that may be cut short on purpose (a long value or
 * path in a bounded error field); the return value is still the full length.
 */
__attribute__((format(printf, 3, 4))) int cfg_fmt(char *buf, size_t len, const char *f, ...);

/* --- errors and rules (config.c, rules.c) --- */

/* Append one error to errs ("dropped" counts those beyond CFG_MAX_ERRORS). */
__attribute__((format(printf, 5, 6))) void cfg_add_error(struct cfg_errors *errs,
                                                         const char *source, int line,
                                                         const char *key, const char *format, ...);

/*
 * cfg_validate, skipping every rule that involves a key marked in failed
 * ([CFG_N_KEYS], may be NULL): its value was rejected and already reported.
 */
int cfg_validate_failed(const struct cfg *c, struct cfg_errors *errs, const bool *failed);

#endif /* KVD_CONFIG_INTERNAL_H */
