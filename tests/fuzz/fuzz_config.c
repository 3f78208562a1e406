/*
 * fuzz_config.c - libFuzzer target for the config parser: each input is an
 * INI file's text (cfg_load_string on top of the defaults), then the
 * cross-key rules, the dump, the reload decision against the defaults and
 * one command-line override built from the input's first line. Every
 * error must name where it came from (a message, and a line within the
 * text when it is about a line), and a text that loads cleanly must dump
 * to a text that loads to the same values. Built and run by `make fuzz`.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli_internal.h"
#include "config/config.h"

static struct cfg_errors errs; /* ~100 KB: not on the stack */
static char dump[1 << 16];

static void check_errors(const char *text, size_t len)
{
    int lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += text[i] == '\n';
    for (int i = 0; i < errs.count && i < CFG_MAX_ERRORS; i++) {
        const struct cfg_error *e = &errs.list[i];
        if (!e->message[0] || e->line < 0 || e->line > lines)
            __builtin_trap();
        char buf[1024];
        cfg_error_format(e, buf, sizeof(buf));
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    cfg_set_hooks(&srv_cfg_hooks); /* the cache's budget, as kvd's main wires it */
    char *text = malloc(size + 1);
    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0'; /* an embedded NUL ends the text, as in a C string */
    size_t len = strlen(text);

    struct cfg c, d;
    cfg_defaults(&c);
    cfg_defaults(&d);
    cfg_errors_init(&errs);
    int rc = cfg_load_string(&c, text, "fuzz.conf", &errs);
    if (rc == 0)
        rc = cfg_validate(&c, &errs);
    check_errors(text, len);
    if (rc != 0 && errs.count == 0)
        __builtin_trap(); /* a refusal says why */

    /* The first line as a command-line override. */
    char set[256];
    size_t n = strcspn(text, "\n");
    if (n >= sizeof(set))
        n = sizeof(set) - 1;
    memcpy(set, text, n);
    set[n] = '\0';
    cfg_errors_init(&errs);
    cfg_set(&d, set, &errs);

    if (rc == 0) {
        /* Round trip: the dump of what loaded loads to the same values. */
        cfg_dump(&c, dump, sizeof(dump));
        struct cfg back;
        cfg_defaults(&back);
        cfg_errors_init(&errs);
        if (cfg_load_string(&back, dump, "dump", &errs) != 0)
            __builtin_trap();
        for (int k = 0; k < CFG_N_KEYS; k++) /* api_key is dumped as a comment only */
            if (k != CFG_AUTH_API_KEY && !cfg_value_equal(&c, &back, (enum cfg_key)k))
                __builtin_trap();
        struct cfg next;
        struct cfg_diff diff;
        cfg_reload_diff(&d, &c, &diff);
        cfg_errors_init(&errs);
        cfg_reload(&d, &c, &next, &diff, &errs);
    }
    free(text);
    return 0;
}
