/*
 * fuzz_template.c - libFuzzer target for the chat-template interpreter
 * (template/): each input is a template's source, loaded and, when it
 * loads, rendered over a conversation with system, user and assistant
 * turns (bos/eos tokens, add_generation_prompt) under small limits, and
 * through the chat layer (its system-role probe, then the conversation). A refusal must say why and where (a
 * message; a line and column inside the source when it has one), and a
 * render must stay within its output limit. Built and run by `make fuzz`.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "template/template.h"

static json_t *ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    ctx = json_pack("{s:[{s:s,s:s},{s:s,s:s},{s:s,s:s},{s:s,s:[{s:s,s:s}]}],s:s,s:s,s:b}",
                    "messages", "role", "system", "content", "Be brief.", "role", "user",
                    "content", "Hi", "role", "assistant", "content", "Hello!", "role", "user",
                    "content", "type", "text", "text", "More?", "bos_token", "<s>", "eos_token",
                    "</s>", "add_generation_prompt", 1);
    if (!ctx)
        abort();
    return 0;
}

static void check_error(const struct tpl_error *e, const char *src, size_t len)
{
    if (!e->msg[0] || e->line < 0 || e->col < 0)
        __builtin_trap();
    /* Lines end at LF, CRLF or a lone CR, as Jinja counts them. */
    int lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += src[i] == '\n' || (src[i] == '\r' && (i + 1 == len || src[i + 1] != '\n'));
    if (e->line > lines)
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    const char *src = (const char *)data;
    struct tpl_limits lim = {.max_depth = 64, .max_iterations = 20000, .max_output = 1 << 16};
    struct tpl_error err = {0};
    tpl_template *t = tpl_load(src, size, &lim, &err);
    if (!t) {
        check_error(&err, src, size);
        return 0;
    }
    char *out = NULL;
    size_t out_len = 0;
    memset(&err, 0, sizeof(err));
    if (tpl_render(t, ctx, 0, &out, &out_len, &err) == 0) {
        if (!out || out_len > lim.max_output || strlen(out) > out_len)
            __builtin_trap();
        free(out);
    } else {
        if (out)
            __builtin_trap();
        check_error(&err, src, size);
    }
    tpl_free(t);

    struct tpl_chat_params cp = {.bos_token = "<s>", .eos_token = "</s>", .strip_bos = true,
                                 .limits = lim};
    memset(&err, 0, sizeof(err));
    tpl_chat *c = tpl_chat_create(src, size, &cp, &err);
    if (!c) {
        check_error(&err, src, size);
        return 0;
    }
    memset(&err, 0, sizeof(err));
    if (tpl_chat_render(c, json_object_get(ctx, "messages"), NULL, true, 0, &out, &out_len,
                        &err) == 0)
        free(out);
    else
        check_error(&err, src, size);
    tpl_chat_destroy(c);
    return 0;
}
