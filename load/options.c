/*
 * options.c - `kvd load`'s command line: every option with its bounds, the
 * loopback guard, and the usage text.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config/args.h"
#include "load/client.h"
#include "load/load_internal.h"

void load_usage(FILE *f)
{
    fprintf(f, "usage: kvd load [--url http://127.0.0.1:8080] [--scenario fixed|sweep|session]\n"
               "  --prompt-tokens N     fixed: prompt length (default 512)\n"
               "  --contexts A,B,...    sweep: prompt lengths (default 512,1024,2048,4096)\n"
               "  --turns T             session: turns per client (default 8)\n"
               "  --turn-tokens N       session: tokens each turn adds (default 256)\n"
               "  --concurrency C       clients in parallel (default 4)\n"
               "  --rate R              pace to R requests/s (default: unpaced)\n"
               "  --requests N          requests per step (default 16; a session step is one\n"
               "                        turn per client)\n"
               "  --duration SECONDS    per step; with --requests, whichever ends first\n"
               "  --max-tokens M        tokens generated per request (default 16)\n"
               "  --no-stream           non-streamed responses (TTFT = end-to-end, no ITL)\n"
               "  --endpoint PATH       /v1/completions (default) or /completion\n"
               "  --file TEXT           text whose tokens make the prompts\n"
               "  --timeout SECONDS     longest a request may take (default 600)\n"
               "  --csv F --json F --plot F.png   write results (plot needs gnuplot)\n"
               "  --api-key KEY         sent as Authorization: Bearer KEY\n"
               "  --allow-remote        allow a non-loopback address\n");
}

static int parse_contexts(const char *s, struct load_opts *o)
{
    o->n_contexts = 0;
    char buf[1024];
    if (strlen(s) >= sizeof(buf))
        return -1;
    snprintf(buf, sizeof(buf), "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        long v;
        if (o->n_contexts == MAX_STEPS || srv_parse_long(tok, 1, 1 << 24, &v))
            return -1;
        o->contexts[o->n_contexts++] = (int)v;
    }
    return o->n_contexts ? 0 : -1;
}

static int bad_value(const char *name, const char *v)
{
    fprintf(stderr, "kvd load: invalid value for %s: '%s'\n", name, v ? v : "");
    return -1;
}

int load_parse_opts(int argc, char **argv, struct load_opts *o, bool *help)
{
    const char *url = "http://127.0.0.1:8080";
    bool allow_remote = false, bad = false, requests_given = false;
    *o = (struct load_opts){.scenario = SC_FIXED,
                            .prompt_tokens = 512,
                            .turns = 8,
                            .turn_tokens = 256,
                            .concurrency = 4,
                            .requests = 16,
                            .max_tokens = 16,
                            .stream = true,
                            .endpoint = "/v1/completions",
                            .timeout = 600};
    parse_contexts("512,1024,2048,4096", o);
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        long n;
        double d;
#define OPT(name) srv_opt_value(argc, argv, &i, "load", name, &v, &bad)
        if (OPT("--url")) {
            url = v;
        } else if (OPT("--scenario")) {
            if (bad)
                break;
            if (!strcmp(v, "fixed"))
                o->scenario = SC_FIXED;
            else if (!strcmp(v, "sweep"))
                o->scenario = SC_SWEEP;
            else if (!strcmp(v, "session"))
                o->scenario = SC_SESSION;
            else
                return bad_value("--scenario (fixed|sweep|session)", v);
        } else if (OPT("--prompt-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 24, &n))
                return bad_value("--prompt-tokens", v);
            o->prompt_tokens = (int)n;
        } else if (OPT("--contexts")) {
            if (bad || parse_contexts(v, o))
                return bad_value("--contexts (up to 64 lengths, e.g. 512,2048,8192)", v);
        } else if (OPT("--turns")) {
            if (bad || srv_parse_long(v, 1, MAX_STEPS, &n))
                return bad_value("--turns (1..64)", v);
            o->turns = (int)n;
        } else if (OPT("--turn-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 20, &n))
                return bad_value("--turn-tokens", v);
            o->turn_tokens = (int)n;
        } else if (OPT("--concurrency")) {
            if (bad || srv_parse_long(v, 1, MAX_CLIENTS, &n))
                return bad_value("--concurrency (1..1024)", v);
            o->concurrency = (int)n;
        } else if (OPT("--rate")) {
            if (bad || srv_parse_double(v, 0.001, 1e6, &d))
                return bad_value("--rate", v);
            o->rate = d;
        } else if (OPT("--requests")) {
            if (bad || srv_parse_long(v, 1, 1000000, &n))
                return bad_value("--requests", v);
            o->requests = (int)n;
            requests_given = true;
        } else if (OPT("--duration")) {
            if (bad || srv_parse_double(v, 0.1, 86400, &d))
                return bad_value("--duration (seconds)", v);
            o->duration = d;
        } else if (OPT("--max-tokens")) {
            if (bad || srv_parse_long(v, 1, 1 << 20, &n))
                return bad_value("--max-tokens", v);
            o->max_tokens = (int)n;
        } else if (OPT("--endpoint")) {
            if (bad || (strcmp(v, "/v1/completions") && strcmp(v, "/completion")))
                return bad_value("--endpoint (/v1/completions or /completion)", v);
            o->endpoint = v;
        } else if (OPT("--file")) {
            o->file = v;
        } else if (OPT("--timeout")) {
            if (bad || srv_parse_double(v, 0.1, 86400, &d))
                return bad_value("--timeout (seconds)", v);
            o->timeout = d;
        } else if (OPT("--csv")) {
            o->csv = v;
        } else if (OPT("--json")) {
            o->json = v;
        } else if (OPT("--plot")) {
            if (!bad && strpbrk(v, "'\n\\"))
                return bad_value("--plot (a path without quotes or backslashes)", v);
            o->plot = v;
        } else if (OPT("--api-key")) {
            if (!bad && strpbrk(v, "\r\n"))
                return bad_value("--api-key", "(contains a line break)");
            o->api_key = v;
        } else if (!strcmp(argv[i], "--no-stream")) {
            o->stream = false;
            i++;
        } else if (!strcmp(argv[i], "--allow-remote")) {
            allow_remote = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help = true;
            return 0;
        } else {
            fprintf(stderr, "kvd load: unknown option '%s' (try --help)\n", argv[i]);
            return -1;
        }
#undef OPT
    }
    if (bad)
        return -1;
    if (o->duration > 0 && !requests_given)
        o->requests = 0; /* the duration alone bounds the step */
    if (lc_parse_url(url, o->host, sizeof(o->host), &o->port))
        return bad_value("--url (http://HOST:PORT)", url);
    if (!allow_remote && !lc_is_loopback(o->host)) {
        fprintf(stderr,
                "kvd load: refusing non-loopback address %s: pass --allow-remote to load a "
                "server on another machine\n",
                o->host);
        return -1;
    }
    return 0;
}

const char *load_scenario_name(enum scenario s)
{
    return s == SC_FIXED ? "fixed" : s == SC_SWEEP ? "sweep" : "session";
}
