#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Benchmark: the cost of admission control (issue 26), side by side in one run.
#
#   off:  pdproxy with no admission setting (the gate runs, nothing limits)
#   on:   pdproxy with every part of the gate busy but nothing saturated: a
#         tenant (x-tenant) with requests- and tokens-per-minute limits far
#         above the load (a CAS per request, usage scanned in every answer,
#         x-ratelimit-* headers on every answer), a pool limit above the
#         connection count and a queue
#   full: pdproxy with --pool-max-inflight FULL_POOL (4) under FULL_CONNS
#         (64) connections: all but 4 requests always wait, so its rate is
#         the dispatch rate out of a full queue; --threads FULL_THREADS (2),
#         so slots freed on one worker serve requests waiting on the other
#         (the cross-worker wake: FULL_POOL=1 FULL_CONNS=4 shows it most)
#
# Mock engines: nginx returning canned prefill and decode answers. Each
# round runs off and on back to back (ROUNDS rounds, alternating which goes
# first) and prints req/s and pdproxy's CPU per request (utime+stime from
# /proc over the run / requests served); then the medians and the ratio.
#   bench/admission_bench.sh [build-dir]   (DURATION=5 ROUNDS=3 CONNS=16 FULL_THREADS=2)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
duration=${DURATION:-5}
rounds=${ROUNDS:-3}
conns=${CONNS:-16}
full_threads=${FULL_THREADS:-2}
full_pool=${FULL_POOL:-4}
full_conns=${FULL_CONNS:-64}
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
bench_pdproxy "$build"
bench_needs wrk nginx
P=$(free_port); D=$(free_port); A=$(free_port); B=$(free_port); C=$(free_port)
mkdir -p "$work/logs"
cat > "$work/backends.conf" <<CONF
worker_processes 1;
pid $work/backends.pid;
error_log $work/logs/backends.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $work/body;
  server { listen 127.0.0.1:$P; location / { default_type application/json; return 200 '$pbody'; } }
  server { listen 127.0.0.1:$D; location / { default_type application/json; return 200 '$dbody'; } }
}
CONF
nginx -c "$work/backends.conf" -g 'daemon off;' & pids+=($!)
common=(--log-level warn --access-log=false
        --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" --decoder-hosts 127.0.0.1 --decoder-ports "$D")
"$pdproxy" --port "$A" --threads 1 "${common[@]}" 2>"$work/logs/off.err" & pa=$!; pids+=($pa)
"$pdproxy" --port "$B" --threads 1 "${common[@]}" --pool-max-inflight 100000 --queue-max 1024 \
    --tenant "bench:weight=2:rpm=1000000000:tpm=1000000000000" 2>"$work/logs/on.err" & pb=$!; pids+=($pb)
"$pdproxy" --port "$C" --threads "$full_threads" "${common[@]}" --pool-max-inflight "$full_pool" --queue-max 1024 \
    2>"$work/logs/full.err" & pc=$!; pids+=($pc)
for p in $P $D $A $B $C; do wait_port "$p"; done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
# run NAME PORT PID CONNS: prints "NAME rps us_cpu_per_req"
run() {
    local t0 t1 out rps reqs
    t0=$(cpu_ticks "$3")
    out=$(wrk -t1 -c"$4" -d"${duration}s" -H "x-tenant: bench" -s "$root/bench/wrk/completion.lua" \
          "http://127.0.0.1:$2/v1/completions")
    t1=$(cpu_ticks "$3")
    rps=$(awk '/^Requests\/sec/{print $2}' <<<"$out")
    reqs=$(awk '/requests in/{print $1}' <<<"$out")
    if grep -q "Non-2xx" <<<"$out"; then echo "$1: non-2xx answers: $out" >&2; exit 1; fi
    echo "$1 $rps $(awk -v a="$t0" -v b="$t1" -v n="$reqs" -v hz="$hz" 'BEGIN{printf "%.2f", (b-a)/hz*1e6/n}')"
}
wrk -t1 -c"$conns" -d1s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$A/v1/completions" >/dev/null
wrk -t1 -c"$conns" -d1s -H "x-tenant: bench" -s "$root/bench/wrk/completion.lua" \
    "http://127.0.0.1:$B/v1/completions" >/dev/null
echo "admission bench: wrk -t1 -c$conns -d${duration}s, pdproxy --threads 1, $rounds rounds"
: > "$work/results"
for i in $(seq 1 "$rounds"); do
    if [ $((i % 2)) = 1 ]; then
        run off "$A" "$pa" "$conns" | tee -a "$work/results"
        run on "$B" "$pb" "$conns" | tee -a "$work/results"
    else
        run on "$B" "$pb" "$conns" | tee -a "$work/results"
        run off "$A" "$pa" "$conns" | tee -a "$work/results"
    fi
done
med() { awk -v k="$1" -v f="$2" '$1==k{print $f}' "$work/results" | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}'; }
off_rps=$(med off 2); on_rps=$(med on 2); off_cpu=$(med off 3); on_cpu=$(med on 3)
echo "median off: $off_rps req/s, $off_cpu us CPU/request"
echo "median on:  $on_rps req/s, $on_cpu us CPU/request"
awk -v a="$off_cpu" -v b="$on_cpu" 'BEGIN{printf "CPU per request, on vs off: %+.1f %%\n", (b-a)/a*100}'
# Dispatch out of a full queue: FULL_CONNS connections, FULL_POOL sent on at a time.
for i in $(seq 1 "$rounds"); do run full "$C" "$pc" "$full_conns" >> "$work/full"; done
awk '{print "full queue (pool '"$full_pool"', '"$full_conns"' connections, --threads '"$full_threads"'): " $2 " req/s dispatched, " $3 " us CPU/request"}' "$work/full"
awk '{print $2}' "$work/full" | sort -g | awk '{a[NR]=$1} END{print "median full-queue dispatch rate: " a[int((NR+1)/2)] " req/s"}'
curl -s "http://127.0.0.1:$C/metrics" | grep -E '^pdproxy_admission_total\{event="(queued|dispatched|queue_full|woken)"' || true
