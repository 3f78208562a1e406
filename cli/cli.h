/*
 * cli.h - the kvd command: main and its subcommands.
 *
 * main.c dispatches `kvd SUBCOMMAND ...` to one srv_cmd_* function per
 * subcommand. Each returns the process exit status: 0 success, 1 runtime
 * failure, 2 usage or input error. Only this room prints and exits.
 */
#ifndef KVD_CLI_H
#define KVD_CLI_H

#define KVD_VERSION "0.1.0"

/* One subcommand: its name, a one-line summary, and its entry point. */
struct srv_command {
    const char *name;
    const char *summary;
    int (*run)(int argc, char **argv); /* argv[0] is the subcommand name */
};

int srv_cmd_buckets(int argc, char **argv);
int srv_cmd_chat_template(int argc, char **argv);
int srv_cmd_check_config(int argc, char **argv);
int srv_cmd_eval(int argc, char **argv);
int srv_cmd_generate(int argc, char **argv);
int srv_cmd_mkmodel(int argc, char **argv);
int srv_cmd_quantize(int argc, char **argv);
int srv_cmd_tokenize(int argc, char **argv);
int srv_cmd_serve(int argc, char **argv);

#endif /* KVD_CLI_H */
