#!/bin/sh
# itl_load.sh - inter-token latency of `kvd serve` while long prompts
# arrive: streams decoding beside a prefill, for one or more kvd binaries
# (e.g. a build before a change and one after) in one run.
#
#   sh tests/bench/itl_load.sh MODEL.gguf KVD[@KEY=VALUE,...] [KVD...]
#
# For each binary: `kvd serve` on a free loopback port (prefix cache off,
# so every prompt is read in full), then that binary's `kvd load` with
# PROMPT_TOKENS-token prompts (default 4096), CONCURRENCY streams (default
# 2), REQUESTS requests (default 6) of MAX_TOKENS tokens (default 64),
# streamed. Printed per row: ITL p50 and p99 and their ratio (the
# scheduler's goal is p99 <= 3 x p50: a prompt chunk must not stall the
# decoding streams), output tokens/s, TTFT p50, the run's wall time, the
# engine steps it took (/metrics: how finely prompts were cut), and
# `uptime`'s load at the start. SET="limits.step_budget=0 ..." adds --set
# options to every serve; KVD@KEY=VALUE,... adds them to that row only, so
# one binary runs with and without an option side by side (e.g. build/kvd
# build/kvd@limits.step_budget=0, the scheduler without a time budget).
# THREADS (default 2) is server.threads; ROUNDS (default 1) repeats the
# set, rows interleaved. LOGS=DIR keeps each row's server log there
# (rowN.log, N counting rows as printed). Prints, never asserts.
set -u
[ $# -ge 2 ] || { echo "usage: $0 MODEL KVD[@KEY=VALUE,...] [KVD...]" >&2; exit 2; }
model=$1; shift
rounds=${ROUNDS:-1}
threads=${THREADS:-2}
prompt=${PROMPT_TOKENS:-4096}
conc=${CONCURRENCY:-2}
reqs=${REQUESTS:-6}
maxt=${MAX_TOKENS:-64}
. "$(dirname "$0")/serve_util.sh"

# a column of the one data row of kvd load's CSV, by header name
col() { awk -F, -v c="$2" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i } NR == 2 { print $k }' "$1"; }

row() { # binary[@key=value,...]
    bin=${1%%@*}
    sets=""
    for s in ${SET:-}; do sets="$sets --set $s"; done
    case $1 in *@*) for s in $(echo "${1#*@}" | tr , ' '); do sets="$sets --set $s"; done ;; esac
    # shellcheck disable=SC2086 # $sets is a list of options
    start_serve "$bin" --set cache.prefix_cache=false $sets
    l=$(load)
    rm -f "$tmp/csv"
    "$bin" load --url "http://127.0.0.1:$port" --prompt-tokens "$prompt" --concurrency "$conc" \
        --requests "$reqs" --max-tokens "$maxt" --csv "$tmp/csv" >"$tmp/load" 2>&1
    steps=$(curl -sf "http://127.0.0.1:$port/metrics" | awk '$1 == "kvd_batch_tokens_count" { print $2 }')
    kill -TERM $pid
    wait $pid 2>/dev/null
    pid=""
    nrow=$((nrow + 1))
    [ -n "${LOGS:-}" ] && cp "$tmp/log" "$LOGS/row$nrow.log"
    if [ ! -s "$tmp/csv" ]; then
        printf '%-40s failed: %s\n' "$1" "$(tail -n 1 "$tmp/load")"
        return
    fi
    p50=$(col "$tmp/csv" itl_p50_ms)
    p99=$(col "$tmp/csv" itl_p99_ms)
    printf '%-40s %6s %4s %9.1f %9.1f %6.2f %9.2f %10.0f %7.1f %6s %6s\n' "$1" "$(col "$tmp/csv" ok)" \
        "$(col "$tmp/csv" errors)" "$p50" "$p99" "$(awk -v a="$p50" -v b="$p99" \
        'BEGIN { print (a > 0 ? b / a : 0) }')" "$(col "$tmp/csv" out_tok_per_s)" \
        "$(col "$tmp/csv" ttft_p50_ms)" "$(col "$tmp/csv" wall_s)" "${steps:-?}" "$l"
}

echo "model $model; $prompt-token prompts, $conc streams, $reqs requests of $maxt tokens," \
    "$threads threads, prefix cache off${SET:+, --set $SET}"
printf '%-40s %6s %4s %9s %9s %6s %9s %10s %7s %6s %6s\n' binary ok err "ITL p50" "ITL p99" "p99/50" \
    "out tok/s" "TTFT p50" "wall s" steps load
nrow=0
for r in $(seq "$rounds"); do
    for b in "$@"; do
        row "$b"
    done
done
