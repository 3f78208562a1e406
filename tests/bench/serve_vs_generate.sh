#!/bin/sh
# serve_vs_generate.sh - per-token decode speed of `kvd generate` and of
# `kvd serve` side by side, for one or more kvd binaries (e.g. a build
# before a change and one after), on one model, in one run.
#
#   sh tests/bench/serve_vs_generate.sh MODEL.gguf [N_TOKENS] KVD [KVD...]
#
# For each binary: `kvd generate` greedy from a short prompt (its "decode:"
# line), then `kvd serve` on a free loopback port answering the same prompt
# as one stream, then as two concurrent streams (/completion's
# timings.predicted_per_token_ms, each stream's own). Beside each wall-clock
# figure, the CPU time the process spent per generated token (all its
# threads; generate's includes loading and the short prefill): on a busy
# machine wall time mostly measures the share of the cores a process got,
# and CPU time shows what spinning costs. ROUNDS (default 2)
# repeats the whole set, binaries interleaved, so a busy machine's swings
# hit every binary alike; THREADS (default 2) is --threads and
# server.threads. Every row carries `uptime`'s load at its start. Prints,
# never asserts.
set -u
[ $# -ge 2 ] || { echo "usage: $0 MODEL [N_TOKENS] KVD [KVD...]" >&2; exit 2; }
model=$1; shift
n=64
case $1 in *[!0-9]*) ;; *) n=$1; shift ;; esac
rounds=${ROUNDS:-2}
threads=${THREADS:-2}
prompt="Once upon a time there was a"
. "$(dirname "$0")/serve_util.sh"

body="{\"prompt\":\"$prompt\",\"n_predict\":$n,\"temperature\":0,\"ignore_eos\":true}"

# one stream's ms per generated token from a /completion answer
per_token() { sed -n 's/.*"predicted_per_token_ms": *\([0-9.]*\).*/\1/p' "$1"; }

# user + system clock ticks of process $1 so far
ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'; }
hz=$(getconf CLK_TCK)
# CPU ms per token from ticks before, after and tokens
cpu_ms() { awk -v a="$1" -v b="$2" -v n="$3" -v hz="$hz" 'BEGIN { printf "%.1f", (b - a) * 1000 / hz / n }'; }
# children's user + system seconds in a file the shell's `times` wrote (not
# run in a subshell: a subshell's children are not the shell's)
child_s() { tail -n 1 "$1" | awk '{ for (i = 1; i <= 2; i++) { split($i, p, "m"); s += p[1] * 60 + p[2] } print s }'; }

serve_rows() { # binary label
    start_serve "$1"
    url="http://127.0.0.1:$port/completion"
    curl -s -d "$body" "$url" >/dev/null # warm up
    l=$(load)
    t0=$(ticks $pid)
    curl -s -d "$body" "$url" >"$tmp/a"
    t1=$(ticks $pid)
    printf '%-40s serve, 1 stream       %8.2f ms/token, CPU %s ms/token  (load %s)\n' "$2" \
        "$(per_token "$tmp/a")" "$(cpu_ms "$t0" "$t1" "$n")" "$l"
    l=$(load)
    t0=$(ticks $pid)
    curl -s -d "$body" "$url" >"$tmp/b1" &
    c1=$!
    curl -s -d "$body" "$url" >"$tmp/b2"
    wait $c1
    t1=$(ticks $pid)
    printf '%-40s serve, 2 streams      %8.2f %8.2f ms/token, CPU %s ms/token  (load %s)\n' "$2" \
        "$(per_token "$tmp/b1")" "$(per_token "$tmp/b2")" "$(cpu_ms "$t0" "$t1" $((2 * n)))" "$l"
    kill -TERM $pid
    wait $pid 2>/dev/null
    pid=""
}

gen_row() { # binary label
    l=$(load)
    times >"$tmp/t0"
    "$1" generate --model "$model" --prompt "$prompt" -n "$n" --temp 0 --no-echo \
        --threads "$threads" 2>"$tmp/gen" >/dev/null
    line=$(grep 'decode:' "$tmp/gen")
    ms=$(echo "$line" | sed -n 's/.*decode: *\([0-9]*\) tokens in \([0-9.]*\) s.*/\1 \2/p' |
        awk '{ if ($1 > 0) printf "%.2f", 1000 * $2 / $1 }')
    times >"$tmp/t1"
    cpu=$(awk -v a="$(child_s "$tmp/t0")" -v b="$(child_s "$tmp/t1")" -v n="$n" 'BEGIN { printf "%.1f", (b - a) * 1000 / n }')
    printf '%-40s generate              %8s ms/token, CPU %s ms/token  (load %s)\n' "$2" "$ms" \
        "$cpu" "$l"
}

echo "model $model, $n tokens, $threads threads, $rounds rounds"
for r in $(seq "$rounds"); do
    for b in "$@"; do
        label=$b # the path as given: two binaries of one folder stay apart
        gen_row "$b" "$label"
        serve_rows "$b" "$label"
    done
done
