/*
 * config_view.c - the effective configuration as JSON, for the web page's
 * server view (GET /v1/config answers it; `kvd serve` renders it at start
 * and on every applied reload).
 *
 * It says what `kvd check-config` says, from the same functions: "text" is
 * cfg_dump's INI (each key followed by its origin), and "keys" the same
 * values one by one with their origin ("default", FILE:LINE or "command
 * line") and whether a reload applies them live. The API key's value never
 * appears: the dump hides it, and its entry says only whether it is set.
 */
#include <jansson.h>
#include <stdlib.h>

#include "cli/cli_internal.h"

static json_t *key_json(const struct cfg *c, enum cfg_key k)
{
    char value[CFG_PATH_MAX], origin[CFG_PATH_MAX + 32];
    cfg_format_value(c, k, value, sizeof(value));
    cfg_format_origin(c, k, origin, sizeof(origin));
    if (k == CFG_AUTH_API_KEY && value[0])
        snprintf(value, sizeof(value), "(set, hidden)");
    return json_pack("{s:s, s:s, s:s, s:s, s:b, s:s}", "section", cfg_key_section(k), "key",
                     cfg_key_name(k), "value", value, "origin", origin, "live", cfg_key_live(k),
                     "doc", cfg_key_doc(k));
}

char *srv_config_view_json(const struct cfg *c)
{
    int n = cfg_dump(c, NULL, 0);
    char *text = n >= 0 ? malloc((size_t)n + 1) : NULL;
    json_t *keys = json_array();
    char *out = NULL;
    if (!text || !keys)
        goto out_free;
    cfg_dump(c, text, (size_t)n + 1);
    for (int k = 0; k < CFG_N_KEYS; k++)
        if (json_array_append_new(keys, key_json(c, (enum cfg_key)k)) != 0)
            goto out_free;
    json_t *v =
        json_pack("{s:s?, s:s, s:{s:I, s:b}, s:O}", "file", c->file[0] ? c->file : NULL, "text",
                  text, "eviction_window", "tokens", (json_int_t)cfg_window_tokens(c), "automatic",
                  c->eviction.window_tokens == 0, "keys", keys);
    out = v ? json_dumps(v, JSON_COMPACT) : NULL;
    json_decref(v);
out_free:
    json_decref(keys);
    free(text);
    return out;
}
