/*
 * main.c - `kvd`: one binary, many subcommands.
 *
 * The table below is the single list of subcommands; `kvd help` prints it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_internal.h"
#include "config/config.h"
#include "cpu/cpu.h"
#include "cpu/mem.h"
#include "cpu/pool.h"
#include "load/load.h"
#include "model/model.h"
#include "model/quant.h"

static int cmd_version(int argc, char **argv);
static int cmd_help(int argc, char **argv);

static const struct srv_command commands[] = {
    {"buckets", "print the T5 relative-position bucket table", srv_cmd_buckets},
    {"chat-template", "print the prompt a chat template makes of a conversation",
     srv_cmd_chat_template},
    {"check-config", "check a config file, print the effective values", srv_cmd_check_config},
    {"eval", "measure an eviction policy's cost in perplexity on a text", srv_cmd_eval},
    {"generate", "generate text from a prompt, offline", srv_cmd_generate},
    {"load", "load-test a running kvd across context lengths", srv_cmd_load},
    {"mkmodel", "write a small seeded GGUF model", srv_cmd_mkmodel},
    {"quantize", "rewrite a GGUF file's weights as q8_0, q4_0 or K-quants", srv_cmd_quantize},
    {"serve", "run the HTTP daemon (OpenAI and llama.cpp completions)", srv_cmd_serve},
    {"tokenize", "print the token ids of a text", srv_cmd_tokenize},
    {"version", "print the version", cmd_version},
    {"help", "list the subcommands", cmd_help},
};

#define N_ELEMS(a) (sizeof(a) / sizeof((a)[0]))

static int cmd_version(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("kvd %s\n", KVD_VERSION);
    return 0;
}

static int cmd_help(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    printf("usage: kvd COMMAND [OPTIONS]\n\ncommands:\n");
    for (size_t i = 0; i < N_ELEMS(commands); i++)
        printf("  %-14s %s\n", commands[i].name, commands[i].summary);
    printf("\n`kvd COMMAND --help` describes a command's options.\n");
    return 0;
}

#ifdef KVD_THREADS_OMP
/*
 * (Built with THREADS=omp only: kvd's own pool, cpu/pool.h, spins briefly
 * and then sleeps, which is what this chooses for OpenMP's team.)
 * The daemon's OpenMP workers share the cores with the loop thread. With
 * libgomp's default wait policy, idle workers spin between engine steps and
 * take the CPU the loop thread needs to parse requests and flush tokens, so
 * streams stutter on small machines. The policy is read from the
 * environment when the runtime starts, before main, hence the re-exec.
 * An operator's explicit OMP_WAIT_POLICY is respected.
 */
static void passive_openmp(char **argv)
{
    if (getenv("OMP_WAIT_POLICY"))
        return;
    setenv("OMP_WAIT_POLICY", "passive", 1);
    execv("/proc/self/exe", argv);
    /* exec failed (no /proc): run on with the default policy */
}
#endif

int main(int argc, char **argv)
{
    cfg_set_hooks(&srv_cfg_hooks);
    if (argc < 2) {
        cmd_help(0, NULL);
        return 2;
    }
    const char *name = argv[1];
    if (!strcmp(name, "--help") || !strcmp(name, "-h"))
        return cmd_help(0, NULL);
    if (!strcmp(name, "--version"))
        return cmd_version(0, NULL);
    /* KVD_CPU forces a lower kernel level (cpu/cpu.h); a bad one stops here */
    char err[256];
    if (cpu_init_env(err, sizeof(err))) {
        fprintf(stderr, "kvd: %s\n", err);
        return 2;
    }
    /* KVD_F16=bf16 multiplies F16 weights as bf16, KVD_BF16=pairs|exact
     * chooses BF16 weights' product (model/quant.h) */
    if (mm_f16_init_env(err, sizeof(err)) || mm_bf16_init_env(err, sizeof(err))) {
        fprintf(stderr, "kvd: %s\n", err);
        return 2;
    }
    /* KVD_HUGE_PAGES=off: the repacked weights and the KV pool in 4 KiB pages (cpu/mem.h) */
    if (cpu_pages_init_env(err, sizeof(err))) {
        fprintf(stderr, "kvd: %s\n", err);
        return 2;
    }
    /* OMP_NUM_THREADS and KVD_SPIN_US (cpu/pool.h): a bad one stops here too */
    if (cpu_pool_init_env(err, sizeof(err))) {
        fprintf(stderr, "kvd: %s\n", err);
        return 2;
    }
#ifdef KVD_THREADS_OMP
    if (!strcmp(name, "serve"))
        passive_openmp(argv);
#endif
    for (size_t i = 0; i < N_ELEMS(commands); i++)
        if (!strcmp(name, commands[i].name)) {
            int rc = commands[i].run(argc - 1, argv + 1);
            cpu_pool_shutdown();
            return rc;
        }
    fprintf(stderr, "kvd: unknown command '%s' (try 'kvd help')\n", name);
    return 2;
}
