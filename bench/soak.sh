#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Soak benchmark: wrk through pdproxy to engine-sims for DURATION seconds
# (default 300) while a second client population disconnects at random points
# and one prefill instance is killed and restarted every FLAP seconds.
# Reports pdproxy's RSS and open fds at the start and the end (they must stay
# flat) and the prefill blocks that expired unclaimed (must be 0: a client that
# leaves after prefill answered has its blocks released through decode).
#
#   bench/soak.sh [build-dir]     DURATION=300 FLAP=20 CONNS=16
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
bin=$build/bin
duration=${DURATION:-300}
flap=${FLAP:-20}
conns=${CONNS:-16}
expiry_ms=${EXPIRY_MS:-10000}
[ -x "$bin/pdproxy" ] && [ -x "$bin/engine-sim" ] || { echo "build first ($bin)" >&2; exit 1; }

# shellcheck source=bench/lib.sh
source "$root/bench/lib.sh"
# The flapping prefill is restarted under new pids: stopped on exit as well.
trap '[ -n "${p2:-}" ] && kill "$p2" 2>/dev/null; bench_cleanup' EXIT INT TERM
P1=$(free_port); P2=$(free_port); D1=$(free_port); D2=$(free_port); X=$(free_port)
sim() { "$bin/engine-sim" --port "$1" --ttft-ms 20 --itl-ms 5 --kv-expiry-ms "$expiry_ms" \
        --num-blocks 4096 2>>"$work/sim-$1.log" & }
sim "$P1"; pids+=($!)
sim "$P2"; p2=$!
sim "$D1"; pids+=($!)
sim "$D2"; pids+=($!)
"$bin/pdproxy" --port "$X" --threads 2 --log-level warn --access-log=false --drain-delay 0 \
    --health-interval 1 --unhealthy-after 2 --healthy-after 1 --connect-timeout 1 \
    --prefill "http://127.0.0.1:$P1" --prefill "http://127.0.0.1:$P2" \
    --decode "http://127.0.0.1:$D1" --decode "http://127.0.0.1:$D2" 2>"$work/pdproxy.log" &
px=$!; pids+=($px)
for port in $P1 $P2 $D1 $D2 $X; do
    for i in $(seq 1 200); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.05; done
done

metric() { curl -s "http://127.0.0.1:$1/metrics" | awk -v m="$2" '$1==m {print $2}'; }
rss() { awk '/VmRSS/{print $2}' "/proc/$px/status"; }
fds() { ls "/proc/$px/fd" | wc -l; }

# Warm up, then take the starting figures.
wrk -t1 -c"$conns" -d3s -s "$root/deploy/wrk/chat_stream.lua" "http://127.0.0.1:$X" >/dev/null
rss0=$(rss); fds0=$(fds)

# Clients that leave at random points: during prefill, just after, mid-stream.
python3 - "$X" "$duration" >"$work/leavers.out" 2>&1 <<'PY' &
import json, random, socket, sys, time
port, duration = int(sys.argv[1]), float(sys.argv[2])
end = time.monotonic() + duration
rng = random.Random(7)
n = left = 0
while time.monotonic() < end and n < 1000000:
    n += 1
    body = json.dumps({"model": "sim-model", "stream": True, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "leaver %d " % n + "word " * rng.randint(1, 400)}]})
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               "Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)).encode())
    if rng.random() < 1 / 3:
        time.sleep(rng.random() * 0.15)  # 0-150 ms: prefill (20 ms), handoff, or stream
        left += 1
    else:
        try:
            while s.recv(65536):
                pass
        except OSError:
            pass
    s.close()
print("leaver requests", n, "left early", left)
PY
leavers=$!

# The flapping prefill.
(
    end=$((SECONDS + duration))
    while [ $SECONDS -lt $end ]; do
        sleep "$flap"
        kill -9 "$(cat "$work/p2.pid" 2>/dev/null || echo $p2)" 2>/dev/null || true
        sleep 2
        "$bin/engine-sim" --port "$P2" --ttft-ms 20 --itl-ms 5 --kv-expiry-ms "$expiry_ms" \
            --num-blocks 4096 2>>"$work/sim-$P2.log" &
        echo $! >"$work/p2.pid"
    done
) &
flapper=$!

out=$(wrk -t1 -c"$conns" -d"${duration}s" --latency -s "$root/deploy/wrk/chat_stream.lua" "http://127.0.0.1:$X")
wait "$leavers" || true
kill "$flapper" 2>/dev/null || true
wait "$flapper" 2>/dev/null || true
[ -f "$work/p2.pid" ] && p2=$(cat "$work/p2.pid")
sleep $(( expiry_ms / 1000 + 2 ))   # anything stranded has expired by now
rss1=$(rss); fds1=$(fds)
# What the descriptors are: client sockets, upstream sockets kept in curl's
# connection pools (bounded), and the rest.
sockets=$(ss -tanp 2>/dev/null | grep -c "pid=$px," || true)
upstream=$(ss -tanp 2>/dev/null | grep "pid=$px," | grep -cE ":($P1|$P2|$D1|$D2)\s*(users|$)" || true)

echo "== soak: ${duration}s, wrk -t1 -c$conns chat_stream + random leavers, prefill :$P2 killed every ${flap}s"
grep -E "Requests/sec|requests in|Non-2xx|Socket errors|50%|99%" <<<"$out" | sed 's/^/wrk: /'
cat "$work/leavers.out"
echo "pdproxy RSS: start $((rss0/1024)) MiB  end $((rss1/1024)) MiB   open fds: start $fds0  end $fds1 (end: $sockets TCP sockets, $upstream of them pooled upstream connections)"
printf "prefill :%s (never killed): published=%s released_by_consumer=%s expired=%s\n" "$P1" \
    "$(metric "$P1" engine_sim_kv_blocks_published_total)" \
    "$(metric "$P1" engine_sim_kv_blocks_released_by_consumer_total)" \
    "$(metric "$P1" engine_sim_kv_blocks_expired_total)"
printf "prefill :%s (last life): published=%s released_by_consumer=%s expired=%s\n" "$P2" \
    "$(metric "$P2" engine_sim_kv_blocks_published_total)" \
    "$(metric "$P2" engine_sim_kv_blocks_released_by_consumer_total)" \
    "$(metric "$P2" engine_sim_kv_blocks_expired_total)"
curl -s "http://127.0.0.1:$X/metrics" | grep -E '^pdproxy_(client_disconnects|stranded|retries)' | sed 's/^/pdproxy: /'
