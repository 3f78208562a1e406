#!/bin/sh
# soak.sh - `make soak`: does kvd serve stay flat over a long run of mixed
# traffic? Not part of `make test` or CI: it runs for SOAK_SECONDS (an hour
# by default).
#
# One `kvd serve` on a free loopback port with a small cache (a 256-token
# budget, at most 16 sessions kept, idle sessions dropped after 20 s), and
# three `kvd load` loops against it until the time is up:
#   sessions  4 clients, 12 turns of +128 tokens each on /completion with
#             the answers fed back: every session runs far past its budget
#             and evicts, and new sessions push old ones out (max_sessions);
#   sweep     2 clients, streamed /v1/completions at 64..2048 prompt tokens;
#   fixed     2 clients, non-streamed /v1/completions of 512-token prompts.
# Every SOAK_INTERVAL seconds a sample goes to soak.csv: the server's RSS
# and open descriptors (from /proc) and, from /metrics, KV pages used and
# free, queue depth, sessions, running sequences and responses sent.
#
# At the end the loops stop, and the server must return to rest: no
# session left (the idle timeout), no KV page used, descriptors back to the
# first sample's count or fewer; then SIGTERM, and it must exit 0. The
# drift of each series is the mean of the last 10% of the samples taken
# under load minus the mean of the first 10%. RSS fails as a leak when its
# drift is over SOAK_RSS_SLACK_MB (default 16 MiB) plus 10% of its start
# *and* it is still growing over the second half (least-squares slope times
# the half's duration above half that tolerance): allocator warm-up raises
# the first minutes, a leak keeps rising. soak.png plots every series.
#
# Environment: KVD_BIN (the binary), SOAK_MODEL (default
# $KVD_SHARED/models/stories260K.gguf; when it is missing a model is made
# with `kvd mkmodel`, and the run says so), SOAK_SECONDS (3600),
# SOAK_INTERVAL (10), SOAK_OUT (the output folder, default build/soak),
# SOAK_RSS_SLACK_MB (16).
set -u

KVD_BIN=${KVD_BIN:-build/kvd}
SHARED=${KVD_SHARED:-../shared}
SECONDS_TOTAL=${SOAK_SECONDS:-3600}
INTERVAL=${SOAK_INTERVAL:-10}
OUT=${SOAK_OUT:-build/soak}
SLACK_MB=${SOAK_RSS_SLACK_MB:-16}
MODEL=${SOAK_MODEL:-$SHARED/models/stories260K.gguf}

mkdir -p "$OUT" || exit 1
CSV=$OUT/soak.csv
PLOT=$OUT/soak.png
LOG=$OUT/serve.log
LOADLOG=$OUT/load.log
: >"$LOADLOG"

if [ ! -f "$MODEL" ]; then
    echo "soak: $MODEL not found; making a model with kvd mkmodel instead"
    MODEL=$OUT/soak.gguf
    "$KVD_BIN" mkmodel --out "$MODEL" --layers 4 --dim 128 --heads 4 --kv-heads 2 >/dev/null || exit 1
fi
echo "soak: model $MODEL, $SECONDS_TOTAL s, a sample every $INTERVAL s, output in $OUT"

# --- the server ------------------------------------------------------------------
STDOUT=$OUT/serve.out
OMP_WAIT_POLICY=passive "$KVD_BIN" serve --model "$MODEL" --listen 127.0.0.1:0 \
    --set cache.memory=8MiB --set eviction.max_cache_tokens=256 --set eviction.sink_tokens=4 \
    --set eviction.max_sessions=16 --set eviction.session_idle_timeout=20s \
    --set limits.max_running=8 --set limits.queue_length=64 --set limits.max_tokens=256 \
    --set server.threads=1 >"$STDOUT" 2>"$LOG" &
SERVER=$!
PORT=
for _ in $(seq 1 150); do # its first stdout line names the port
    PORT=$(head -n 1 "$STDOUT" | sed -n 's/.*127\.0\.0\.1:\([0-9]*\).*/\1/p')
    [ -n "$PORT" ] && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 0.2
done
if [ -z "$PORT" ]; then
    echo "soak: kvd serve did not say its port; its log:"
    cat "$LOG"
    kill "$SERVER" 2>/dev/null
    exit 1
fi
URL=http://127.0.0.1:$PORT
tries=0
until curl -sf "$URL/health" >/dev/null; do
    tries=$((tries + 1))
    [ $tries -lt 150 ] || { echo "soak: kvd serve never became healthy"; kill "$SERVER"; exit 1; }
    sleep 0.2
done

# --- sampling ----------------------------------------------------------------------
T0=$(date +%s)
metric_sum() { # NAME: the sum of every sample of NAME (any labels) in $M
    printf '%s\n' "$M" | awk -v n="$1" '$1 == n || index($1, n "{") == 1 { s += $2 } END { print s + 0 }'
}
sample() { # PHASE: one CSV row
    M=$(curl -s --max-time 10 "$URL/metrics")
    rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$SERVER/status" 2>/dev/null)
    fds=$(ls "/proc/$SERVER/fd" 2>/dev/null | wc -l)
    printf '%s,%s,%.2f,%s,%s,%s,%s,%s,%s,%s\n' "$(($(date +%s) - T0))" "$1" \
        "$(echo "${rss:-0}" | awk '{ print $1 / 1024 }')" "$fds" \
        "$(metric_sum kvd_kv_pages_used)" "$(metric_sum kvd_kv_pages_free)" \
        "$(metric_sum kvd_queue_depth)" "$(metric_sum kvd_sessions)" \
        "$(metric_sum kvd_running_sequences)" "$(metric_sum kvd_http_requests_total)" >>"$CSV"
}
echo "t_s,phase,rss_mib,fds,kv_pages_used,kv_pages_free,queue_depth,sessions,running,responses" >"$CSV"
sample start

# --- the load ------------------------------------------------------------------------
END=$((T0 + SECONDS_TOTAL))
loop() { # NAME ARGS...: kvd load ARGS until END; one line per run in load.log
    name=$1
    shift
    runs=0
    while [ "$(date +%s)" -lt "$END" ]; do
        runs=$((runs + 1))
        if "$KVD_BIN" load --url "$URL" --timeout 120 "$@" >"$OUT/load-$name.out" 2>&1; then
            rc=0
        else
            rc=$?
        fi
        errs=$(grep -c 'errors: status' "$OUT/load-$name.out")
        echo "$name run $runs: exit $rc, error lines $errs" >>"$LOADLOG"
        grep 'errors: status' "$OUT/load-$name.out" | sed "s/^ */$name: /" >>"$LOADLOG"
    done
}
loop sessions --scenario session --endpoint /completion --turns 12 --turn-tokens 128 \
    --concurrency 4 --max-tokens 32 &
L1=$!
loop sweep --scenario sweep --contexts 64,256,1024,2048 --concurrency 2 --requests 8 \
    --max-tokens 48 &
L2=$!
loop fixed --scenario fixed --prompt-tokens 512 --concurrency 2 --requests 8 --max-tokens 64 \
    --no-stream &
L3=$!

while [ "$(date +%s)" -lt "$END" ]; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "soak: kvd serve died; its log:"
        tail -n 50 "$LOG"
        kill "$L1" "$L2" "$L3" 2>/dev/null
        exit 1
    fi
    sample load
    sleep "$INTERVAL"
done
wait "$L1" "$L2" "$L3"

# --- back to rest ------------------------------------------------------------------------
rest_ok=0
for _ in $(seq 1 60); do
    sample rest
    last=$(tail -n 1 "$CSV")
    used=$(echo "$last" | cut -d, -f5)
    sessions=$(echo "$last" | cut -d, -f8)
    if [ "$used" = 0 ] && [ "$sessions" = 0 ]; then
        rest_ok=1
        break
    fi
    sleep 1
done
kill -TERM "$SERVER"
wait "$SERVER"
exit_code=$?

# --- the plot ------------------------------------------------------------------------
gnuplot 2>/dev/null <<EOF || echo "soak: gnuplot failed (is gnuplot-nox installed?)"
set terminal pngcairo size 1100,900 noenhanced
set output '$PLOT'
set datafile separator ','
set key autotitle columnhead
set multiplot layout 4,1 title 'kvd soak: $(basename "$MODEL"), $SECONDS_TOTAL s'
set grid
set xlabel 'minutes'
set ylabel 'RSS (MiB)'
plot '$CSV' using (\$1/60):3 with lines title 'RSS MiB'
set ylabel 'descriptors'
plot '$CSV' using (\$1/60):4 with lines title 'open fds'
set ylabel 'KV pages'
plot '$CSV' using (\$1/60):5 with lines title 'used', '' using (\$1/60):6 with lines title 'free'
set ylabel 'count'
plot '$CSV' using (\$1/60):7 with lines title 'queue depth', '' using (\$1/60):8 with lines title 'sessions', '' using (\$1/60):9 with lines title 'running'
unset multiplot
EOF

# --- drift and verdict ------------------------------------------------------------------------
echo "soak: $(grep -c ',load,' "$CSV") samples under load; load runs:" \
    "$(grep -c ' run ' "$LOADLOG"), with error lines: $(grep -c 'error lines [1-9]' "$LOADLOG")"
awk -F, -v slack="$SLACK_MB" '
$2 == "load" { n++; t[n] = $1; for (c = 3; c <= 10; c++) v[c, n] = $c }
$2 == "start" { fds0 = $4 }
$2 == "rest" { rest_fds = $4 }
END {
    if (n < 10) { print "soak: fewer than 10 samples under load: no verdict"; exit 2 }
    k = int(n / 10); if (k < 1) k = 1
    split("rss_mib fds kv_pages_used kv_pages_free queue_depth sessions running", names, " ")
    for (c = 3; c <= 9; c++) {
        a = 0; b = 0
        for (i = 1; i <= k; i++) { a += v[c, i]; b += v[c, n - k + i] }
        first[c] = a / k; last[c] = b / k
        printf "drift %-14s first 10%% %10.2f  last 10%% %10.2f  drift %+10.2f\n", names[c - 2], first[c], last[c], last[c] - first[c]
    }
    # least-squares slope of RSS over the second half, per second
    h = int(n / 2); sx = sy = sxx = sxy = 0; m = 0
    for (i = h + 1; i <= n; i++) { m++; sx += t[i]; sy += v[3, i]; sxx += t[i] * t[i]; sxy += t[i] * v[3, i] }
    den = m * sxx - sx * sx
    slope = den > 0 ? (m * sxy - sx * sy) / den : 0
    half = t[n] - t[h + 1]
    tol = slack + 0.10 * first[3]
    rise = slope * half
    printf "rss: tolerance %.2f MiB; second half slope %.4f MiB/min, %+.2f MiB over %.0f s\n", tol, slope * 60, rise, half
    bad = 0
    if (last[3] - first[3] > tol && rise > tol / 2) { print "soak: FAIL: RSS keeps growing (a leak trend)"; bad = 1 }
    if (rest_fds > fds0) { printf "soak: FAIL: %d descriptors at rest, %d at the start\n", rest_fds, fds0; bad = 1 }
    exit bad
}' "$CSV"
verdict=$?
[ $rest_ok = 1 ] || { echo "soak: FAIL: sessions or KV pages still held 60 s after the load stopped"; verdict=1; }
[ $exit_code = 0 ] || { echo "soak: FAIL: kvd serve exited $exit_code on SIGTERM"; verdict=1; }
echo "soak: samples $CSV, plot $PLOT, server log $LOG, load log $LOADLOG"
[ $verdict = 0 ] && echo "soak: passed"
exit $verdict
