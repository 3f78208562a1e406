/*
 * cmd_buckets.c - `kvd buckets`: the T5 bucket table, for operators.
 *
 * A T5-bias model only distinguishes distances its buckets separate; this
 * prints which offsets share each bucket, which are exact, and where the
 * last bucket swallows everything, so an operator can see what a window
 * size means to the model. `--raw A:B` prints offset<TAB>bucket for scripts.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention/attention.h"
#include "cli/cli.h"
#include "config/args.h"

struct buckets_opts {
    int num_buckets;
    int max_distance;
    bool bidirectional;
    bool raw;
    long raw_from, raw_to;
};

static void buckets_usage(FILE *f)
{
    fprintf(f, "usage: kvd buckets [--num-buckets N] [--max-distance D] [--causal]"
               " [--raw A:B]\n"
               "  --num-buckets N   total buckets (default 32, at least 4)\n"
               "  --max-distance D  distance where the last bucket saturates (default 128)\n"
               "  --causal          decoder (one direction) instead of bidirectional\n"
               "  --raw A:B         print 'offset<TAB>bucket' for every offset in [A, B]\n"
               "offset = key position - query position (negative looks back)\n");
}

static int parse_range(const char *s, long *from, long *to)
{
    /* "A:B" with A and B possibly negative. */
    const char *colon = strchr(s + (*s == '-' ? 1 : 0), ':');
    if (!colon)
        return -1;
    char left[32];
    size_t n = (size_t)(colon - s);
    if (n == 0 || n >= sizeof(left))
        return -1;
    memcpy(left, s, n);
    left[n] = '\0';
    const long lim = 1000000000L;
    if (srv_parse_long(left, -lim, lim, from) || srv_parse_long(colon + 1, -lim, lim, to))
        return -1;
    return *from <= *to ? 0 : -1;
}

static int parse_opts(int argc, char **argv, struct buckets_opts *o)
{
    *o = (struct buckets_opts){.num_buckets = 32, .max_distance = 128, .bidirectional = true};
    bool bad = false;
    for (int i = 1; i < argc && !bad;) {
        const char *v = NULL;
        long n;
        if (srv_opt_value(argc, argv, &i, "buckets", "--num-buckets", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_long(v, 1, 1 << 20, &n)) {
                fprintf(stderr, "kvd buckets: --num-buckets wants an integer, got '%s'\n", v);
                return -1;
            }
            o->num_buckets = (int)n;
        } else if (srv_opt_value(argc, argv, &i, "buckets", "--max-distance", &v, &bad)) {
            if (bad) /* the option lacks its value: said, and the loop ends */
                break;
            if (srv_parse_long(v, 1, 1L << 30, &n)) {
                fprintf(stderr, "kvd buckets: --max-distance wants a positive integer, got '%s'\n",
                        v);
                return -1;
            }
            o->max_distance = (int)n;
        } else if (srv_opt_value(argc, argv, &i, "buckets", "--raw", &v, &bad)) {
            if (!bad && parse_range(v, &o->raw_from, &o->raw_to)) {
                fprintf(stderr, "kvd buckets: --raw wants A:B with A <= B, got '%s'\n", v);
                return -1;
            }
            o->raw = true;
        } else if (!strcmp(argv[i], "--causal")) {
            o->bidirectional = false;
            i++;
        } else if (!strcmp(argv[i], "--bidirectional")) {
            o->bidirectional = true;
            i++;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            return 1; /* help: the caller prints it and succeeds */
        } else {
            fprintf(stderr, "kvd buckets: unknown option '%s'\n", argv[i]);
            return -1;
        }
    }
    return bad ? -1 : 0;
}

/* Print the offsets [lo, hi] of one direction as a readable range. */
static void print_span(int sign, long lo, long hi, bool open_end)
{
    long a = sign * lo, b = sign * hi;
    if (open_end)
        printf(sign < 0 ? "<= %ld" : ">= %+ld", a);
    else if (lo == hi)
        printf(sign < 0 || lo == 0 ? "%ld" : "%+ld", a);
    else if (sign < 0)
        printf("%ld..%ld", b, a);
    else
        printf("%+ld..%+ld", a, b);
}

/*
 * Walk one direction from distance `start` to saturation and print one row
 * per bucket it visits. Buckets are non-decreasing in distance, so each
 * bucket covers one contiguous run of distances.
 */
static void print_direction(const struct buckets_opts *o, int sign, int start, bool *seen)
{
    int nb = o->num_buckets, md = o->max_distance;
    bool bidi = o->bidirectional;
    int slots = bidi ? nb / 2 : nb;
    int exact = slots / 2;
    int sat = pos_t5_saturation(sign > 0, bidi, nb, md);
    long run_lo = start;
    int cur = pos_t5_bucket((int64_t)sign * start, bidi, nb, md);
    for (long d = start + 1; d <= sat; d++) {
        int b = pos_t5_bucket((int64_t)sign * d, bidi, nb, md);
        if (b == cur)
            continue;
        printf("%-7d ", cur);
        print_span(sign, run_lo, d - 1, false);
        printf("\t%s\n", run_lo < exact ? "exact" : "log");
        seen[cur] = true;
        cur = b;
        run_lo = d;
    }
    printf("%-7d ", cur);
    print_span(sign, run_lo, sat, true);
    printf("\t%s (saturated)\n", run_lo < exact ? "exact" : "log");
    seen[cur] = true;
}

static void print_table(const struct buckets_opts *o)
{
    int nb = o->num_buckets;
    bool bidi = o->bidirectional;
    int slots = bidi ? nb / 2 : nb;
    printf("T5 relative-position buckets: %d buckets, max distance %d, %s\n", nb,
           o->max_distance, bidi ? "bidirectional" : "causal");
    printf("offset = key position - query position (negative looks back)\n");
    printf("exact distances: 0..%d%s\n", slots / 2 - 1, bidi ? " in each direction" : "");
    printf("saturation: looking back from distance %d",
           pos_t5_saturation(false, bidi, nb, o->max_distance));
    if (bidi)
        printf(", looking forward from distance %d",
               pos_t5_saturation(true, bidi, nb, o->max_distance));
    else
        printf("; every forward offset maps to bucket 0 (masked by causality)");
    printf("\n\nbucket  offsets\tkind\n");

    bool *seen = calloc((size_t)nb, sizeof(bool));
    if (!seen) {
        fprintf(stderr, "kvd buckets: out of memory\n");
        return;
    }
    print_direction(o, -1, 0, seen);
    if (bidi)
        print_direction(o, +1, 1, seen);
    for (int b = 0; b < nb; b++)
        if (!seen[b])
            printf("%-7d never selected\n", b);
    free(seen);
}

int srv_cmd_buckets(int argc, char **argv)
{
    struct buckets_opts o;
    int prc = parse_opts(argc, argv, &o);
    if (prc > 0) {
        buckets_usage(stdout);
        return 0;
    }
    if (prc)
        return 2;
    char err[256];
    if (pos_t5_check(o.num_buckets, o.max_distance, o.bidirectional, err, sizeof(err))) {
        fprintf(stderr, "kvd buckets: %s\n", err);
        return 2;
    }
    if (o.raw) {
        for (long off = o.raw_from; off <= o.raw_to; off++)
            printf("%ld\t%d\n", off,
                   pos_t5_bucket(off, o.bidirectional, o.num_buckets, o.max_distance));
        return 0;
    }
    print_table(&o);
    return 0;
}
