#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Benchmark: the cost of admission control (issue 26), side by side in one run.
#
#   off:  pdproxy with no admission setting (the gate runs, nothing limits)
#   on:   pdproxy with every part of the gate busy but nothing saturated: a
#         tenant (x-tenant) with requests- and tokens-per-minute limits far
#         above the load (a CAS per request, usage scanned in every answer,
#         x-ratelimit-* headers on every answer) among 64 tenants (the
#         lookup scans the table), priority classes named by the request's
#         x-priority header, a pool limit above the connection count and a
#         queue
#   full: pdproxy with --pool-max-inflight FULL_POOL (4) under FULL_CONNS
#         (64) connections: all but 4 requests always wait, so its rate is
#         the dispatch rate out of a full queue; --threads FULL_THREADS (2),
#         so slots freed on one worker serve requests waiting on the other
#         (the cross-worker wake: FULL_POOL=1 FULL_CONNS=4 shows it most)
#   fair: two engine-sims (--itl-ms FAIR_ITL_MS, 8 tokens an answer) behind
#         pdproxy --pool-max-inflight 2 with tenants loud and quiet of equal
#         weight. The quiet tenant runs 2 connections alone, then again while
#         the loud one runs 20 (10x); the figure is the quiet one's p99 queue
#         wait (queue_ms of the access lines, 0 for a request that never
#         waited) under the burst against alone, and its p99 latency
#         (wait + service, wrk's) likewise. Alone it hardly waits (2 clients,
#         2 slots), so the wait ratio is also given against one service time.
#
# Mock engines: nginx returning canned prefill and decode answers. Each
# round runs off and on back to back (ROUNDS rounds, alternating which goes
# first) and prints req/s and pdproxy's CPU per request (utime+stime from
# /proc over the run / requests served); then the medians and the ratio.
#   bench/admission_bench.sh [build-dir]
#       (DURATION=5 ROUNDS=5 CONNS=16 FULL_THREADS=2 FAIR_ITL_MS=2 PHASES="overhead full fair")
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
duration=${DURATION:-5}
rounds=${ROUNDS:-5}
phases=${PHASES:-overhead full fair}
fair_itl=${FAIR_ITL_MS:-2}
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
    --tenant "$(for i in $(seq 1 63); do printf 't%02d:weight=3 ' "$i"; done)bench:weight=2:rpm=1000000000:tpm=1000000000000" \
    --priority-class "interactive:-100..0 normal:1..10 batch:11..100" \
    --tenant-header-from 127.0.0.1 2>"$work/logs/on.err" & pb=$!; pids+=($pb)
"$pdproxy" --port "$C" --threads "$full_threads" "${common[@]}" --pool-max-inflight "$full_pool" --queue-max 1024 \
    2>"$work/logs/full.err" & pc=$!; pids+=($pc)
for p in $P $D $A $B $C; do wait_port "$p"; done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
# run NAME PORT PID CONNS: prints "NAME rps us_cpu_per_req"
run() {
    local t0 t1 out rps reqs
    t0=$(cpu_ticks "$3")
    out=$(wrk -t1 -c"$4" -d"${duration}s" -H "x-tenant: bench" -H "x-priority: normal" -s "$root/bench/wrk/completion.lua" \
          "http://127.0.0.1:$2/v1/completions")
    t1=$(cpu_ticks "$3")
    rps=$(awk '/^Requests\/sec/{print $2}' <<<"$out")
    reqs=$(awk '/requests in/{print $1}' <<<"$out")
    if grep -q "Non-2xx" <<<"$out"; then echo "$1: non-2xx answers: $out" >&2; exit 1; fi
    echo "$1 $rps $(awk -v a="$t0" -v b="$t1" -v n="$reqs" -v hz="$hz" 'BEGIN{printf "%.2f", (b-a)/hz*1e6/n}')"
}
if [[ " $phases " == *" overhead "* ]]; then
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
# Each round's on and off ran back to back: the median of their ratios.
awk '{k[NR]=$1; c[NR]=$3} END{for (i = 1; i < NR; i += 2) print (k[i]=="on" ? c[i]/c[i+1] : c[i+1]/c[i])}' \
    "$work/results" | sort -g | awk '{a[NR]=$1} END{printf "CPU per request, on vs off, median of the rounds'"'"' ratios: %+.1f %%\n", (a[int((NR+1)/2)]-1)*100}'
fi
if [[ " $phases " == *" full "* ]]; then
# Dispatch out of a full queue: FULL_CONNS connections, FULL_POOL sent on at a time.
for i in $(seq 1 "$rounds"); do run full "$C" "$pc" "$full_conns" >> "$work/full"; done
awk '{print "full queue (pool '"$full_pool"', '"$full_conns"' connections, --threads '"$full_threads"'): " $2 " req/s dispatched, " $3 " us CPU/request"}' "$work/full"
awk '{print $2}' "$work/full" | sort -g | awk '{a[NR]=$1} END{print "median full-queue dispatch rate: " a[int((NR+1)/2)] " req/s"}'
curl -s "http://127.0.0.1:$C/metrics" | grep -E '^pdproxy_admission_total\{event="(queued|dispatched|queue_full|woken)"' || true
fi

# Fairness: the quiet tenant's queue wait alone and under the loud one's 10x burst.
if [[ " $phases " == *" fair "* ]]; then
    sim=$build/bin/engine-sim
    [ -x "$sim" ] || { echo "build engine-sim first ($sim missing)" >&2; exit 1; }
    SP=$(free_port); SD=$(free_port); F=$(free_port)
    for pp in "$SP:prefill" "$SD:decode"; do
        "$sim" --role "${pp#*:}" --port "${pp%%:*}" --itl-ms "$fair_itl" --num-blocks 4096 --layers 2 \
            --block-bytes 4096 2>"$work/logs/sim-${pp#*:}.err" & pids+=($!)
    done
    wait_port "$SP"; wait_port "$SD"
    "$pdproxy" --port "$F" --threads 1 --log-level info --prefiller-hosts 127.0.0.1 --prefiller-ports "$SP" \
        --decoder-hosts 127.0.0.1 --decoder-ports "$SD" --pool-max-inflight 2 --queue-max 256 \
        --tenant "loud quiet" --tenant-header-from 127.0.0.1 2>"$work/logs/fair.err" & pids+=($!)
    wait_port "$F"
    fair_wrk() { TENANT=$1 TAG=$2 wrk -t1 -c"$3" -d"${duration}s" --latency -s "$root/bench/wrk/tenant.lua" \
                 "http://127.0.0.1:$F/v1/completions"; }
    # p99 of queue_ms over the access lines whose id starts with $1 (0: did not wait).
    wait_p() { awk -v tag="$1-" -v q="$2" '
        match($0, /req=[^ ]+/) { id = substr($0, RSTART + 4, RLENGTH - 4)
            if (index(id, tag) != 1 || $0 !~ /msg="request"/) next
            w = 0; if (match($0, /queue_ms=[0-9.]+/)) w = substr($0, RSTART + 9, RLENGTH - 9)
            print w }' "$work/logs/fair.err" | sort -g |
        awk -v q="$2" '{a[NR]=$1} END{i=int(NR*q); if (i<1) i=1; if (i>NR) i=NR; printf "%.2f %d", a[i], NR}'; }
    lat_p99() { awk '$1=="99%"{print $2}' <<<"$1"; }
    fair_wrk quiet warm 2 >/dev/null
    alone=$(fair_wrk quiet alone 2)
    fair_wrk loud loud 20 >"$work/loud.out" & lw=$!
    sleep 0.5  # the burst fills the queue first
    burst=$(fair_wrk quiet burst 2)
    wait "$lw"
    for o in "$alone" "$burst" "$(cat "$work/loud.out")"; do
        if grep -q "Non-2xx" <<<"$o"; then echo "fair: non-2xx answers: $o" >&2; exit 1; fi
    done
    read -r wa na <<<"$(wait_p alone 0.99)"; read -r wb nb <<<"$(wait_p burst 0.99)"
    read -r svc _ <<<"$(awk '/msg="request"/ && /req=alone-/ && match($0, /total_ms=[0-9.]+/) {print substr($0, RSTART + 9, RLENGTH - 9)}' "$work/logs/fair.err" | sort -g | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')"
    read -r wl nl <<<"$(wait_p loud 0.5)"
    echo "fairness (pool 2, engine-sim --itl-ms $fair_itl, ${duration}s each): quiet alone: $na requests, p99 wait $wa ms, p99 latency $(lat_p99 "$alone"); under loud 10x: $nb requests, p99 wait $wb ms, p99 latency $(lat_p99 "$burst"); loud: $nl requests, median wait $wl ms; service (median total_ms alone) $svc ms"
    awk -v a="$wa" -v b="$wb" -v s="$svc" 'BEGIN{d = a > s ? a : s; printf "quiet p99 wait under burst / max(alone p99 wait, one service time): %.2f (target <= 2)\n", b / d}'
fi
