# serve_util.sh - what the serving benchmarks (serve_vs_generate.sh,
# itl_load.sh) share; sourced, not run. Gives a scratch directory $tmp, a
# server in $pid that goes with the script however it ends, `load` (the
# 1-minute load average), and `start_serve KVD [ARGS...]`: `KVD serve` on a
# free loopback port with $model and server.threads=$threads, its stdout
# and stderr in $tmp/out and $tmp/log; returns once /health answers (or
# after 60 s), with the port in $port.
tmp=$(mktemp -d)
pid=""
trap '[ -n "$pid" ] && kill -TERM $pid 2>/dev/null; rm -rf "$tmp"' EXIT
trap 'exit 1' INT TERM PIPE

load() { uptime | sed 's/.*load average: //; s/,.*//'; }

start_serve() { # binary [serve options...]
    bin=$1; shift
    "$bin" serve --model "$model" --listen 127.0.0.1:0 --set server.threads="$threads" \
        "$@" >"$tmp/out" 2>"$tmp/log" &
    pid=$!
    port=""
    for _ in $(seq 600); do
        port=$(sed -n 's/.*listening on http:\/\/127.0.0.1:\([0-9]*\).*/\1/p' "$tmp/out")
        [ -n "$port" ] && curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.1
    done
}
