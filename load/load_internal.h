/*
 * load_internal.h - what the pieces of `kvd load` share: its options
 * (options.c), one step's results and how they are reported (report.c).
 * The driver (cmd_load.c) runs the steps between the two.
 */
#ifndef KVD_LOAD_INTERNAL_H
#define KVD_LOAD_INTERNAL_H

#include <stdbool.h>
#include <stdio.h>

#define MAX_STEPS 64
#define MAX_STATUS 8
#define MAX_CLIENTS 1024

/* Status recorded for a 200 stream that ended with an error event. */
#define STATUS_STREAM_ERROR (-1)

enum scenario { SC_FIXED, SC_SWEEP, SC_SESSION };

struct load_opts {
    char host[256];
    int port;
    enum scenario scenario;
    int prompt_tokens;
    int contexts[MAX_STEPS];
    int n_contexts;
    int turns, turn_tokens;
    int concurrency;
    double rate;     /* requests/s; 0 = as fast as the clients go */
    int requests;    /* per step; 0 = bounded by the duration only */
    double duration; /* per step, seconds; 0 = bounded by requests only */
    int max_tokens;
    bool stream;
    const char *endpoint; /* /v1/completions or /completion */
    const char *file;     /* text to tokenize for prompts */
    const char *csv, *json, *plot;
    const char *api_key;
    double timeout; /* seconds a request may take */
};

struct step_result {
    int context; /* prompt tokens of this step (mean sent, for sessions) */
    int n_ok, n_err;
    int status_code[MAX_STATUS], status_count[MAX_STATUS];
    double wall;
    double rps, out_tps;
    double ttft[4], itl[4], e2e[4]; /* mean, p50, p90, p99 (seconds) */
    long n_ttft, n_itl;             /* how many values each summarises */
    double cached;                  /* mean cached prompt tokens (-1 unknown) */
    long out_tokens;
    double rss_mb;     /* peak while the step ran (NaN unknown) */
    double pages_used; /* peak KV pages used (NaN unknown) */
};

/*
 * Parse argv into o. Returns 0 (with *help set for --help), or -1 having
 * said why on stderr (exit status 2).
 */
int load_parse_opts(int argc, char **argv, struct load_opts *o, bool *help);

/* The usage text. */
void load_usage(FILE *f);

/* "fixed", "sweep" or "session". */
const char *load_scenario_name(enum scenario s);

/* The table on stdout: its two header lines, then one row per step. */
void load_print_header(void);
void load_print_row(const struct step_result *r);

/*
 * The files --csv, --json and --plot ask for, from the n steps in res.
 * Returns 0, or 1 having named each file that could not be written.
 */
int load_write_outputs(const struct load_opts *o, const struct step_result *res, int n);

#endif /* KVD_LOAD_INTERNAL_H */
