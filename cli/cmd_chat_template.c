/*
 * cmd_chat_template.c - `kvd chat-template`: print the prompt a chat
 * template makes of a conversation, so a template can be checked by hand.
 *
 * The template comes from --template FILE, or from --model FILE's
 * tokenizer.chat_template (ChatML when it has none), chosen by the same
 * code `kvd serve` uses. The rendered prompt goes to stdout byte for byte
 * (no newline is added); where the template came from and how it treats a
 * system message go to stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli/cli.h"
#include "config/args.h"
#include "model/model.h"
#include "server/chat_template.h"

static void chat_template_usage(FILE *f)
{
    fprintf(f,
            "usage: kvd chat-template (--model FILE | --template FILE) [--messages FILE.json]\n"
            "                         [--tools FILE.json] [--bos-token S] [--eos-token S]\n"
            "                         [--no-generation-prompt] [--name NAME]\n"
            "  --model FILE            GGUF model: its tokenizer.chat_template, BOS and EOS\n"
            "  --template FILE         a Jinja template file (wins over the model's)\n"
            "  --name NAME             the model's tokenizer.chat_template.NAME instead\n"
            "  --messages FILE.json    the conversation, a JSON array of {role, content}\n"
            "                          (default: a short sample with a system message)\n"
            "  --tools FILE.json       tool definitions, a JSON array\n"
            "  --bos-token S, --eos-token S   the BOS / EOS text (default: the model's, or \"\")\n"
            "  --no-generation-prompt  leave out the assistant header at the end\n");
}

static const char sample_messages[] =
    "[{\"role\": \"system\", \"content\": \"You are a helpful assistant.\"},"
    " {\"role\": \"user\", \"content\": \"Hello!\"},"
    " {\"role\": \"assistant\", \"content\": \"Hi. How can I help?\"},"
    " {\"role\": \"user\", \"content\": \"Tell me a story.\"}]";

static json_t *load_json_arg(const char *path, const char *what)
{
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        fprintf(stderr, "kvd chat-template: %s %s:%d:%d: %s\n", what, path, je.line, je.column,
                je.text);
    else if (!json_is_array(j)) {
        fprintf(stderr, "kvd chat-template: %s %s must hold a JSON array\n", what, path);
        json_decref(j);
        j = NULL;
    }
    return j;
}

int srv_cmd_chat_template(int argc, char **argv)
{
    struct srv_chat_template_opts o = {0};
    const char *model_path = NULL, *messages_path = NULL, *tools_path = NULL;
    bool gen_prompt = true, bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        if (srv_opt_value(argc, argv, &i, "chat-template", "--model", &v, &bad))
            model_path = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--template", &v, &bad))
            o.path = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--name", &v, &bad))
            o.name = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--messages", &v, &bad))
            messages_path = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--tools", &v, &bad))
            tools_path = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--bos-token", &v, &bad))
            o.bos_token = v;
        else if (srv_opt_value(argc, argv, &i, "chat-template", "--eos-token", &v, &bad))
            o.eos_token = v;
        else if (!strcmp(argv[i], "--no-generation-prompt")) {
            gen_prompt = false;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            chat_template_usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "kvd chat-template: unknown option '%s'\n", argv[i]);
            chat_template_usage(stderr);
            return 2;
        }
    }
    if (bad)
        return 2;
    if (!model_path && !o.path) {
        fprintf(stderr, "kvd chat-template: need --model FILE or --template FILE\n");
        chat_template_usage(stderr);
        return 2;
    }
    if (o.name && !model_path) {
        fprintf(stderr, "kvd chat-template: --name picks a template of --model FILE\n");
        return 2;
    }

    int status = 1;
    model *m = NULL;
    tpl_chat *c = NULL;
    json_t *messages = NULL, *tools = NULL;
    char err[512], source[1200];
    if (model_path) {
        struct model_params mp = {.path = model_path, .vocab_only = true};
        m = model_load(&mp, err, sizeof err);
        if (!m) {
            fprintf(stderr, "kvd chat-template: %s\n", err);
            goto out;
        }
    }
    c = srv_chat_template_load(m, &o, source, sizeof source, err, sizeof err);
    if (!c) {
        fprintf(stderr, "kvd chat-template: %s\n", err);
        goto out;
    }
    messages = messages_path ? load_json_arg(messages_path, "--messages")
                             : json_loads(sample_messages, 0, NULL);
    if (!messages || (tools_path && !(tools = load_json_arg(tools_path, "--tools"))))
        goto out;
    fprintf(stderr, "kvd chat-template: template from %s; system messages %s\n", source,
            tpl_chat_supports_system(c) ? "rendered by the template"
                                        : "joined to the first user message (the template "
                                          "has no system role)");
    char *out;
    size_t len;
    struct tpl_error te;
    if (tpl_chat_render(c, messages, tools, gen_prompt, time(NULL), &out, &len, &te) < 0) {
        char msg[320];
        fprintf(stderr, "kvd chat-template: render: %s\n", tpl_error_string(&te, msg, sizeof msg));
        goto out;
    }
    fwrite(out, 1, len, stdout);
    free(out);
    status = 0;
out:
    json_decref(tools);
    json_decref(messages);
    tpl_chat_destroy(c);
    model_free(m);
    return status;
}
