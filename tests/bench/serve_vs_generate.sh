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
# timings.predicted_per_token_ms, each stream's own). ROUNDS (default 2)
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
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

load() { uptime | sed 's/.*load average: //; s/,.*//'; }

body="{\"prompt\":\"$prompt\",\"n_predict\":$n,\"temperature\":0,\"ignore_eos\":true}"

# one stream's ms per generated token from a /completion answer
per_token() { sed -n 's/.*"predicted_per_token_ms": *\([0-9.]*\).*/\1/p' "$1"; }

serve_rows() { # binary label
    "$1" serve --model "$model" --listen 127.0.0.1:0 --set server.threads="$threads" \
        >"$tmp/out" 2>"$tmp/log" &
    pid=$!
    port=""
    for _ in $(seq 300); do
        port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$tmp/out")
        [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.1
    done
    url="http://127.0.0.1:$port/completion"
    curl -s -d "$body" "$url" >/dev/null # warm up
    l=$(load)
    curl -s -d "$body" "$url" >"$tmp/a"
    printf '%-40s serve, 1 stream       %8.2f ms/token  (load %s)\n' "$2" "$(per_token "$tmp/a")" "$l"
    l=$(load)
    curl -s -d "$body" "$url" >"$tmp/b1" &
    c1=$!
    curl -s -d "$body" "$url" >"$tmp/b2"
    wait $c1
    printf '%-40s serve, 2 streams      %8.2f %8.2f ms/token  (load %s)\n' "$2" \
        "$(per_token "$tmp/b1")" "$(per_token "$tmp/b2")" "$l"
    kill -TERM $pid
    wait $pid 2>/dev/null
}

gen_row() { # binary label
    l=$(load)
    line=$("$1" generate --model "$model" --prompt "$prompt" -n "$n" --temp 0 --no-echo \
        --threads "$threads" 2>&1 >/dev/null | grep 'decode:')
    ms=$(echo "$line" | sed -n 's/.*decode: *\([0-9]*\) tokens in \([0-9.]*\) s.*/\1 \2/p' |
        awk '{ if ($1 > 0) printf "%.2f", 1000 * $2 / $1 }')
    printf '%-40s generate              %8s ms/token  (load %s)\n' "$2" "$ms" "$l"
}

echo "model $model, $n tokens, $threads threads, $rounds rounds"
for r in $(seq "$rounds"); do
    for b in "$@"; do
        label="$(basename "$(dirname "$(dirname "$b")")")/$(basename "$(dirname "$b")")"
        gen_row "$b" "$label"
        serve_rows "$b" "$label"
    done
done
