/*
 * report.c - `kvd load`'s results: the table on stdout (one row per step)
 * and the files --csv, --json and --plot (through gnuplot) ask for.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "load/load_internal.h"

void load_print_header(void)
{
    printf("%8s %7s %5s %4s %8s %9s | %-31s | %-31s | %-31s | %8s %6s\n", "", "", "", "", "", "",
           "     time to first token (ms)", "     inter-token latency (ms)",
           "     end-to-end latency (ms)", "", "");
    printf("%8s %7s %5s %4s %8s %9s | %7s %7s %7s %7s | %7s %7s %7s %7s | %7s %7s %7s %7s | %8s "
           "%6s\n",
           "context", "cached", "ok", "err", "req/s", "out tok/s", "mean", "p50", "p90", "p99",
           "mean", "p50", "p90", "p99", "mean", "p50", "p90", "p99", "rss MiB", "pages");
}

static const char *status_note(int code)
{
    return code == 0                     ? " (no answer: connection failed or timed out)"
           : code == STATUS_STREAM_ERROR ? " (error event inside a 200 answer)"
                                         : "";
}

void load_print_row(const struct step_result *r)
{
    char cached[16];
    if (r->cached >= 0)
        snprintf(cached, sizeof(cached), "%.0f", r->cached);
    else
        snprintf(cached, sizeof(cached), "-");
    printf("%8d %7s %5d %4d %8.2f %9.1f |", r->context, cached, r->n_ok, r->n_err, r->rps,
           r->out_tps);
    const double *groups[3] = {r->ttft, r->itl, r->e2e};
    const long counts[3] = {r->n_ttft, r->n_itl, r->n_ok};
    for (int g = 0; g < 3; g++) {
        for (int k = 0; k < 4; k++) {
            if (counts[g] == 0) /* e.g. no inter-token gaps without streaming */
                printf(" %7s", "-");
            else
                printf(" %7.*f", g == 1 ? 2 : 1, groups[g][k] * 1e3);
        }
        printf(" |");
    }
    printf(" %8.1f %6.0f\n", r->rss_mb, r->pages_used);
    for (int k = 0; k < MAX_STATUS && r->status_count[k]; k++)
        printf("         errors: status %d x %d%s\n", r->status_code[k], r->status_count[k],
               status_note(r->status_code[k]));
}

static int write_csv(const char *path, const struct step_result *res, int n)
{
    FILE *f = fopen(path, "w");
    if (!f)
        return -1;
    fprintf(f, "context,cached_tokens,ok,errors,wall_s,req_per_s,out_tokens,out_tok_per_s,"
               "ttft_mean_ms,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,itl_mean_ms,itl_p50_ms,"
               "itl_p90_ms,itl_p99_ms,e2e_mean_ms,e2e_p50_ms,e2e_p90_ms,e2e_p99_ms,rss_mib,"
               "kv_pages_used,errors_by_status\n");
    for (int i = 0; i < n; i++) {
        const struct step_result *r = &res[i];
        fprintf(f, "%d,%.1f,%d,%d,%.3f,%.3f,%ld,%.2f", r->context, r->cached, r->n_ok, r->n_err,
                r->wall, r->rps, r->out_tokens, r->out_tps);
        const double *groups[3] = {r->ttft, r->itl, r->e2e};
        for (int g = 0; g < 3; g++)
            for (int k = 0; k < 4; k++)
                fprintf(f, ",%.3f", groups[g][k] * 1e3);
        fprintf(f, ",%.1f,%.0f,", isnan(r->rss_mb) ? -1.0 : r->rss_mb,
                isnan(r->pages_used) ? -1.0 : r->pages_used);
        for (int k = 0; k < MAX_STATUS && r->status_count[k]; k++) /* "503:2 0:1" */
            fprintf(f, "%s%d:%d", k ? " " : "", r->status_code[k], r->status_count[k]);
        fprintf(f, "\n");
    }
    return fclose(f);
}

static json_t *stats_json(const double v[4])
{
    return json_pack("{s:f,s:f,s:f,s:f}", "mean", v[0] * 1e3, "p50", v[1] * 1e3, "p90", v[2] * 1e3,
                     "p99", v[3] * 1e3);
}

static int write_json(const char *path, const struct load_opts *o, const struct step_result *res,
                      int n)
{
    json_t *steps = json_array();
    for (int i = 0; i < n; i++) {
        const struct step_result *r = &res[i];
        json_t *errs = json_object();
        for (int k = 0; k < MAX_STATUS && r->status_count[k]; k++) {
            char code[16];
            snprintf(code, sizeof(code), "%d", r->status_code[k]);
            json_object_set_new(errs, code, json_integer(r->status_count[k]));
        }
        json_array_append_new(
            steps, json_pack("{s:i,s:f,s:i,s:i,s:f,s:f,s:I,s:f,s:o,s:o,s:o,s:o,s:f,s:f}", "context",
                             r->context, "cached_tokens", r->cached, "ok", r->n_ok, "errors",
                             r->n_err, "wall_s", r->wall, "requests_per_s", r->rps, "output_tokens",
                             (json_int_t)r->out_tokens, "output_tokens_per_s", r->out_tps,
                             "ttft_ms", stats_json(r->ttft), "itl_ms", stats_json(r->itl), "e2e_ms",
                             stats_json(r->e2e), "errors_by_status", errs, "rss_mib",
                             isnan(r->rss_mb) ? -1.0 : r->rss_mb, "kv_pages_used",
                             isnan(r->pages_used) ? -1.0 : r->pages_used));
    }
    json_t *doc = json_pack("{s:s,s:s,s:i,s:i,s:f,s:f,s:i,s:b,s:o}", "scenario",
                            load_scenario_name(o->scenario), "endpoint", o->endpoint, "concurrency",
                            o->concurrency, "requests_per_step", o->requests, "duration_s",
                            o->duration, "rate", o->rate, "max_tokens", o->max_tokens, "stream",
                            o->stream, "steps", steps);
    int rc = doc ? json_dump_file(doc, path, JSON_INDENT(2)) : -1;
    json_decref(doc);
    return rc;
}

/* Latency (top) and output throughput (bottom) against context length,
 * drawn by gnuplot. The path has no quote (checked with the options). */
static int write_plot(const char *path, const struct load_opts *o, const struct step_result *res,
                      int n)
{
    FILE *g = popen("gnuplot 2>/dev/null", "w");
    if (!g)
        return -1;
    fprintf(g, "set terminal pngcairo size 1000,760 noenhanced\nset output '%s'\n", path);
    fprintf(g,
            "set multiplot layout 2,1 title 'kvd load: %s, %d clients, %d tokens out'\n"
            "set logscale x 2\nset xlabel 'context (prompt tokens)'\nset grid\n"
            "set key right bottom\nset logscale y 10\nset ylabel 'latency (ms)'\n",
            load_scenario_name(o->scenario), o->concurrency, o->max_tokens);
    fprintf(g, "plot '-' using 1:2 with linespoints title 'ttft p50', "
               "'-' using 1:2 with linespoints title 'ttft p99', "
               "'-' using 1:2 with linespoints title 'itl p50', "
               "'-' using 1:2 with linespoints title 'e2e p50', "
               "'-' using 1:2 with linespoints title 'e2e p99'\n");
    for (int s = 0; s < 5; s++) {
        for (int i = 0; i < n; i++) {
            const struct step_result *r = &res[i];
            double v = s == 0   ? r->ttft[1]
                       : s == 1 ? r->ttft[3]
                       : s == 2 ? r->itl[1]
                       : s == 3 ? r->e2e[1]
                                : r->e2e[3];
            fprintf(g, "%d %f\n", r->context, v * 1e3);
        }
        fprintf(g, "e\n");
    }
    /* throughput falls by orders of magnitude over a long sweep: log scale,
     * unless a step had none (a log axis cannot show zero) */
    bool all_positive = true;
    for (int i = 0; i < n; i++)
        all_positive = all_positive && res[i].out_tps > 0;
    fprintf(g,
            "%s\nset ylabel 'output tokens/s'\n%s\n"
            "plot '-' using 1:2 with linespoints title 'output tokens/s'\n",
            all_positive ? "set logscale y 10" : "unset logscale y",
            all_positive ? "set key right top" : "set yrange [0:*]");
    for (int i = 0; i < n; i++)
        fprintf(g, "%d %f\n", res[i].context, res[i].out_tps);
    fprintf(g, "e\nunset multiplot\n");
    return pclose(g) == 0 ? 0 : -1;
}

int load_write_outputs(const struct load_opts *o, const struct step_result *res, int n)
{
    int rc = 0;
    if (o->csv && write_csv(o->csv, res, n)) {
        fprintf(stderr, "kvd load: cannot write %s\n", o->csv);
        rc = 1;
    }
    if (o->json && write_json(o->json, o, res, n)) {
        fprintf(stderr, "kvd load: cannot write %s\n", o->json);
        rc = 1;
    }
    if (o->plot) {
        if (write_plot(o->plot, o, res, n)) {
            fprintf(stderr, "kvd load: gnuplot failed writing %s (is gnuplot-nox installed?)\n",
                    o->plot);
            rc = 1;
        } else {
            printf("plot: %s\n", o->plot);
        }
    }
    return rc;
}
