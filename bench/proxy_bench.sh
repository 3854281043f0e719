#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Benchmark: pdproxy's cost per request, side by side in one run.
#
#   (a) wrk straight at a mock decode engine (nginx returning a canned answer)
#   (b) wrk through pdproxy (two upstream calls: mock prefill, then mock decode)
#   (c) wrk through an nginx reverse proxy making one keep-alive hop to the mock
#
# Prints req/s, p50 and p99 for 1, 16 and 64 connections (wrk -t1), CPU per
# request of pdproxy, nginx one hop and the mock (the direct row) with its
# user and kernel parts, the TCP segments per request of each path (from
# /proc/net/snmp: run it on an otherwise quiet host), the ratios (pdproxy's
# CPU against nginx one hop's plus its mock's), and pdproxy's RSS idle and
# under load.
#   bench/proxy_bench.sh [build-dir]     (DURATION=10 THREADS=1 by default)
#   SYSCALLS=1: also count pdproxy's system calls per request (strace -c) at 1
#   and 64 connections; PROFILE=1: also a perf profile at 64 connections
#   (PERF_KEEP=<file>: its perf data kept as <file>.c64, SSE's as <file>);
#   SSE=1: also 256 concurrent streams of 200 events (SSE_CONNS="16 64":
#   those counts instead), pdproxy beside nginx
#   (with PROFILE=1, profiled too). CONNS="64" runs only the listed
#   connection counts. ALLOCS=1: heap allocations per request (a counting
#   allocator, bench/alloc_count.c, preloaded into a third pdproxy).
# ACCESS_LOG=1: pdproxy with its default flags (the access log on, to a
# file) instead of --access-log=false. BASELINE=<build-dir>: a second
# pdproxy from that build (another commit) measured in the same loop, right
# after the first, in every mode above but HTTPS and OTLP; ROUNDS=n repeats
# the loop n times (1 by default) and the summary gives medians.
# HTTPS=1 adds pdproxy and nginx one hop reaching the same mocks over TLS.
# OTLP=1 adds (d): a second pdproxy exporting every request's spans
# (OTEL_TRACES_SAMPLER=traceidratio, ratio 1.0) to an nginx that answers
# /v1/traces with 200, measured right after (b): the cost of tracing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
duration=${DURATION:-10}
pthreads=${THREADS:-1}
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
bench_pdproxy "$build"
bench_needs wrk nginx python3
baseline=""
if [ -n "${BASELINE:-}" ]; then
    baseline=$BASELINE/bin/pdproxy
    [ -x "$baseline" ] || { echo "BASELINE: $baseline missing" >&2; exit 1; }
fi
rounds=${ROUNDS:-1}
logargs=(--log-level warn --access-log=false)
[ "${ACCESS_LOG:-0}" = 1 ] && logargs=()
B=$(free_port); BS=$(free_port)
S=$(free_port); NS=$(free_port); XS=$(free_port)
P=$(free_port); D=$(free_port); N=$(free_port); X=$(free_port); O=$(free_port); Y=$(free_port)
otlp=${OTLP:-0}
https=${HTTPS:-0}
TP=$(free_port); TD=$(free_port); TN=$(free_port); TX=$(free_port)

# SSE=1: a decode mock answering 200 events of ~120 bytes each, as fast as it
# can write them: nginx serving one file (POSTs included, via error_page).
mkdir -p "$work/sse"
python3 -c '
import json, sys
with open(sys.argv[1], "w") as f:
    for i in range(200):
        d = {"id": "cmpl-bench", "object": "text_completion", "created": 1, "model": "bench",
             "choices": [{"index": 0, "text": " tok%03d" % i, "finish_reason": None}]}
        f.write("data: " + json.dumps(d, separators=(",", ":")) + "\n\n")
    f.write("data: [DONE]\n\n")' "$work/sse/events.txt"

mkdir -p "$work/logs"
# HTTPS=1: the same mock engines behind TLS (a self-signed certificate),
# reached by pdproxy (libcurl) and by nginx one hop (proxy_ssl).
tls_servers=""
if [ "$https" = 1 ]; then
    openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=127.0.0.1 \
        -addext subjectAltName=IP:127.0.0.1 -keyout "$work/key.pem" -out "$work/cert.pem" 2>/dev/null
    tls_servers="server { listen 127.0.0.1:$TP ssl; ssl_certificate $work/cert.pem; ssl_certificate_key $work/key.pem;
           location / { default_type application/json; return 200 '$pbody'; } }
  server { listen 127.0.0.1:$TD ssl; ssl_certificate $work/cert.pem; ssl_certificate_key $work/key.pem;
           location / { default_type application/json; return 200 '$dbody'; } }"
fi
cat > "$work/backends.conf" <<CONF
user root;
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
  server { listen 127.0.0.1:$S; root $work/sse; location / { default_type text/event-stream;
           error_page 405 =200 /events.txt; try_files /events.txt =404; } }
  $tls_servers
  # An OTLP/HTTP collector that accepts everything (reads and drops the body).
  server { listen 127.0.0.1:$O; client_max_body_size 64m;
           location /v1/traces { default_type application/json; return 200 '{}'; } }
}
CONF
tls_onehop=""
if [ "$https" = 1 ]; then
    tls_onehop="upstream tmock { server 127.0.0.1:$TD; keepalive 128; }
  server { listen 127.0.0.1:$TN;
    location / { proxy_pass https://tmock; proxy_http_version 1.1; proxy_set_header Connection \"\";
                 proxy_ssl_session_reuse on; proxy_buffering off; } }"
fi
cat > "$work/onehop.conf" <<CONF
user root;
worker_processes $pthreads;
pid $work/onehop.pid;
error_log $work/logs/onehop.err warn;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path $work/body2;
  proxy_temp_path $work/ptemp;
  upstream dmock { server 127.0.0.1:$D; keepalive 128; }
  upstream smock { server 127.0.0.1:$S; keepalive 512; }
  server {
    listen 127.0.0.1:$N;
    location / {
      proxy_pass http://dmock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
  server {
    listen 127.0.0.1:$NS;
    location / {
      proxy_pass http://smock;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }
  }
  $tls_onehop
}
CONF
nginx -c "$work/backends.conf" -g 'daemon off;' & pids+=($!)
nginx -c "$work/onehop.conf" -g 'daemon off;' & pids+=($!)
"$pdproxy" --port "$X" --threads "$pthreads" "${logargs[@]}" \
    --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
    --decoder-hosts 127.0.0.1 --decoder-ports "$D" 2>"$work/logs/pdproxy.err" & ppid=$!
pids+=($ppid)
ports="$P $D $N $X"
if [ -n "$baseline" ]; then
    "$baseline" --port "$B" --threads "$pthreads" "${logargs[@]}" \
        --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
        --decoder-hosts 127.0.0.1 --decoder-ports "$D" 2>"$work/logs/baseline.err" & bpid=$!
    pids+=($bpid)
    ports="$ports $B"
fi
if [ "$https" = 1 ]; then
    "$pdproxy" --port "$TX" --threads "$pthreads" --log-level warn --access-log=false --upstream-insecure \
        --prefill "https://127.0.0.1:$TP" --decode "https://127.0.0.1:$TD" \
        2>"$work/logs/pdproxy-https.err" & tpid=$!
    pids+=($tpid)
    ports="$ports $TP $TD $TN $TX"
fi
if [ "$otlp" = 1 ]; then
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$O OTEL_SERVICE_NAME=pdproxy-bench \
    OTEL_TRACES_SAMPLER=traceidratio OTEL_TRACES_SAMPLER_ARG=1.0 \
        "$pdproxy" --port "$Y" --threads "$pthreads" --log-level warn --access-log=false \
        --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
        --decoder-hosts 127.0.0.1 --decoder-ports "$D" 2>"$work/logs/pdproxy-otlp.err" & pids+=($!)
    ports="$ports $Y"
fi

for p in $ports; do wait_port "$p"; done
# nginx one hop's worker, for its CPU per request, and the mocks' worker,
# whose CPU per request (the direct row) completes the target: pdproxy's CPU
# per request at or below nginx one hop's plus its mock's.
ngw=$(pgrep -f "nginx: worker process" -P "$(cat "$work/onehop.pid")" | head -1)
mkw=$(pgrep -f "nginx: worker process" -P "$(cat "$work/backends.pid")" | head -1)
curl -sf -X POST "http://127.0.0.1:$X/v1/completions" -d '{"prompt":"x"}' >/dev/null

rss_kb() { awk '/VmRSS/{print $2}' "/proc/$1/status"; }
rss_idle=$(rss_kb "$ppid")

# wrk's latency table: "50%  123.00us"; normalise to milliseconds.
to_ms() { awk '{v=$1; if (v ~ /us$/) {sub(/us/,"",v); v/=1000} else if (v ~ /ms$/) {sub(/ms/,"",v)} else if (v ~ /s$/) {sub(/s/,"",v); v*=1000}; printf "%.3f", v}'; }
# CPU seconds a process has used, user and system, from /proc/<pid>/stat.
cpu_s() { awk '{printf "%.2f %.2f", $14 / 100, $15 / 100}' "/proc/$1/stat"; }
cpu_total() { cpu_s "$1" | awk '{printf "%.2f", $1 + $2}'; }
# TCP segments sent by every socket of the host (loopback included).
tcp_segs() { awk '/^Tcp:/ && $11 ~ /^[0-9]+$/ {print $11}' /proc/net/snmp; }
run() { # name url conns [pid whose CPU per request to report]
    local out c0="0 0" cpu="" n s0
    [ -n "${4:-}" ] && c0=$(cpu_s "$4")
    s0=$(tcp_segs)
    out=$(wrk -t1 -c"$3" -d"${duration}s" --latency -s "$root/bench/wrk/completion.lua" "$2/v1/completions")
    if [ -n "${4:-}" ]; then
        # CPU per request, then its user and kernel parts, and the TCP
        # segments per request of the whole path (wrk's included; see the
        # summary below for what they tell).
        n=$(awk '/requests in/{print $1}' <<<"$out")
        cpu=$(awk -v a="$c0" -v b="$(cpu_s "$4")" -v n="$n" -v s0="$s0" -v s1="$(tcp_segs)" 'BEGIN {
            split(a, x, " "); split(b, y, " "); u = (y[1] - x[1]) * 1e6 / n; k = (y[2] - x[2]) * 1e6 / n
            printf "CPU %.1f us/req %.1f %.1f %.2f", u + k, u, k, (s1 - s0) / n }')
    fi
    local rps p50 p99 errs
    rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
    p50=$(awk '$1=="50%"{print $2}' <<<"$out" | to_ms)
    p99=$(awk '$1=="99%"{print $2}' <<<"$out" | to_ms)
    errs=$(awk '/Non-2xx|Socket errors/{print}' <<<"$out" | tr '\n' ' ')
    printf "%-8s c=%-3s %10s req/s  p50 %8s ms  p99 %8s ms  %s %s\n" "$1" "$3" "$rps" "$p50" "$p99" \
        "${cpu:+$(awk '{printf "CPU %s us/req (user %s, kernel %s; %s TCP segments/req)", $2, $4, $5, $6}' <<<"$cpu")}" "$errs"
    echo "$1 $3 $rps $p50 $p99 ${cpu:+$(awk '{print $2, $4, $5, $6}' <<<"$cpu")}" >> "$work/results"
}

echo "pdproxy bench: wrk -t1 -d${duration}s, pdproxy --threads $pthreads ${logargs[*]:-(default flags)}, nginx one-hop worker_processes $pthreads${baseline:+, baseline $baseline}, $rounds round(s)"
for round in $(seq 1 "$rounds"); do
for c in ${CONNS:-1 16 64}; do
    run direct "http://127.0.0.1:$D" "$c" "$mkw"
    run pdproxy "http://127.0.0.1:$X" "$c" "$ppid"
    [ -n "$baseline" ] && run baseline "http://127.0.0.1:$B" "$c" "$bpid"
    [ "$otlp" = 1 ] && run pdproxy+otlp "http://127.0.0.1:$Y" "$c"
    run nginx1hop "http://127.0.0.1:$N" "$c" "$ngw"
    if [ "$https" = 1 ]; then
        run pdproxy-tls "http://127.0.0.1:$TX" "$c" "$tpid"
        run nginx1hop-tls "http://127.0.0.1:$TN" "$c" "$ngw"
    fi
done
done

if [ -n "${SSE:-}" ]; then
    # Streaming: 256 concurrent client streams of 200 events each, through
    # pdproxy (prefill, then the SSE decode) and through nginx one hop with
    # proxy_buffering off, on the same mock. CPU from /proc/<pid>/stat.
    "$pdproxy" --port "$XS" --threads "$pthreads" "${logargs[@]}" \
        --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
        --decoder-hosts 127.0.0.1 --decoder-ports "$S" 2>>"$work/logs/pdproxy.err" & spid=$!
    pids+=($spid)
    wait_port "$XS"; wait_port "$NS"
    if [ -n "$baseline" ]; then
        "$baseline" --port "$BS" --threads "$pthreads" "${logargs[@]}" \
            --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
            --decoder-hosts 127.0.0.1 --decoder-ports "$S" 2>>"$work/logs/baseline.err" & sbpid=$!
        pids+=($sbpid)
        wait_port "$BS"
    fi
    stream() { # name url pid conns
        local c0 out rps mbs c1
        c0=$(cpu_total "$3")
        out=$(wrk -t1 -c"$4" -d"${duration}s" -s "$root/bench/wrk/stream.lua" "$2/v1/completions")
        c1=$(cpu_total "$3")
        rps=$(awk '/Requests\/sec/{print $2}' <<<"$out")
        mbs=$(awk '/Transfer\/sec/{v=$2; if (v ~ /MB$/) {sub(/MB/,"",v)} else if (v ~ /KB$/) {sub(/KB/,"",v); v/=1024} else if (v ~ /GB$/) {sub(/GB/,"",v); v*=1024}; print v}' <<<"$out")
        awk -v n="$1" -v r="$rps" -v m="$mbs" -v c="$(awk -v a="$c0" -v b="$c1" 'BEGIN{print b-a}')" -v d="$duration" \
            -v k="$4" 'BEGIN { printf "%-9s c=%-3s %9.0f events/s %8.1f MB/s  CPU %5.2f s = %.1f ms per MB\n", n, k, r * 201, m, c, 1000 * c / (m * d) }'
        echo "$1 $(awk -v r="$rps" 'BEGIN{print r*201}') $mbs $c0 $c1 $4" >> "$work/sse.results"
    }
    echo
    echo "streaming (SSE=1): ${SSE_CONNS:-256} streams x 200 events, wrk -t1 ${duration}s"
    if [ -n "${PROFILE:-}" ]; then
        perf record -q -e cpu-clock -F 2000 -g -p "$spid" -o "$work/perf.sse" -- sleep 4 &
        prof=$!
    fi
    for round in $(seq 1 "$rounds"); do
    for sc in ${SSE_CONNS:-256}; do
    stream pdproxy "http://127.0.0.1:$XS" "$spid" "$sc"
    if [ -n "${PROFILE:-}" ] && [ -z "${prof_done:-}" ]; then
        prof_done=1
        wait "$prof" || true
        echo "pdproxy profile while streaming (self time, top entries):"
        perf report -q -g none -i "$work/perf.sse" --no-children --sort dso,symbol 2>/dev/null | grep -v "^$" | head -30 || true; [ -n "${PERF_KEEP:-}" ] && cp "$work/perf.sse" "$PERF_KEEP"
    fi
    [ -n "$baseline" ] && stream baseline "http://127.0.0.1:$BS" "$sbpid" "$sc"
    stream nginx1hop "http://127.0.0.1:$NS" "$ngw" "$sc"
    done
    done
    python3 - "$work/sse.results" <<'PY'
import statistics, sys
ev = {}
for line in open(sys.argv[1]):
    p = line.split()
    ev.setdefault((p[0], p[5]), []).append(float(p[1]))
for c in sorted({c for _, c in ev}, key=int):
    for k in ("pdproxy", "baseline"):
        if (k, c) in ev:
            print("c=%-3s %s/nginx1hop events/s = %.2f (median of %d)" % (
                c, k, statistics.median(ev[(k, c)]) / statistics.median(ev[("nginx1hop", c)]),
                len(ev[(k, c)])))
PY
fi
if [ -n "${SYSCALLS:-}" ]; then
    # System calls per request on pdproxy (both hops), counted by strace over
    # a fixed-length wrk run; requests from pdproxy's own counter.
    reqs() { curl -s "http://127.0.0.1:$1/metrics" |
        awk '/^pdproxy_requests_total\{endpoint="\/v1\/completions",code="200"\}/{print $2}'; }
    per_req() { # requests strace-output
        awk -v n="$1" '$NF ~ /^[a-z_0-9]+$/ && $4 ~ /^[0-9]+$/ && $NF != "total" {
            printf "  %-14s %6.2f\n", $NF, $4 / n; t += $4 }
            END { printf "  %-14s %6.2f\n", "total", t / n }' "$2"
    }
    count() { # name port pid conns
        local before n
        before=$(reqs "$2")
        strace -c -f -p "$3" -o "$work/strace.$1.$4" & spid=$!
        wait_traced "$3"
        wrk -t1 -c"$4" -d3s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$2/v1/completions" >/dev/null
        kill -INT "$spid"; wait "$spid" 2>/dev/null || true
        n=$(( $(reqs "$2") - before ))
        echo "$1: syscalls per request at c=$4 ($n requests under strace):"
        per_req "$n" "$work/strace.$1.$4"
    }
    echo
    for c in 1 64; do
        count pdproxy "$X" "$ppid" "$c"
        [ -n "$baseline" ] && count baseline "$B" "$bpid" "$c"
        # The same for nginx's one hop worker, side by side.
        strace -c -f -p "$ngw" -o "$work/strace.ngx.$c" & spid=$!
        wait_traced "$ngw"
        n=$(wrk -t1 -c"$c" -d3s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$N/v1/completions" |
            awk '/requests in/{print $1}')
        kill -INT "$spid"; wait "$spid" 2>/dev/null || true
        echo "nginx one hop, syscalls per request at c=$c ($n requests under strace):"
        per_req "$n" "$work/strace.ngx.$c"
    done
fi
if [ -n "${ALLOCS:-}" ]; then
    # Heap allocations per request: a third pdproxy with a counting
    # allocator preloaded, read before and after a fixed wrk run.
    cc -O2 -shared -fPIC -o "$work/alloc_count.so" "$root/bench/alloc_count.c"
    A=$(free_port)
    ALLOC_COUNT_OUT=$work/allocs LD_PRELOAD=$work/alloc_count.so \
        "$pdproxy" --port "$A" --threads "$pthreads" --log-level warn --access-log=false \
        --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
        --decoder-hosts 127.0.0.1 --decoder-ports "$D" 2>>"$work/logs/pdproxy.err" & apid=$!
    pids+=($apid)
    wait_port "$A"
    echo
    for c in 1 64; do
        wrk -t1 -c"$c" -d1s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$A/v1/completions" >/dev/null
        : > "$work/allocs"
        kill -USR2 "$apid"; wait_lines "$work/allocs" 1
        n=$(wrk -t1 -c"$c" -d3s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$A/v1/completions" |
            awk '/requests in/{print $1}')
        kill -USR2 "$apid"; wait_lines "$work/allocs" 2
        awk -v n="$n" -v c="$c" 'NR == 1 { m = $1; k = $2; r = $3 } NR == 2 {
            printf "allocations per request at c=%d (%d requests): malloc %.2f calloc %.2f realloc %.2f\n",
                c, n, ($1 - m) / n, ($2 - k) / n, ($3 - r) / n }' "$work/allocs"
    done
fi
if [ -n "${PROFILE:-}" ]; then
    # Where pdproxy's time goes at 64 connections (perf, software clock).
    perf record -q -e cpu-clock -F 2000 -g -p "$ppid" -o "$work/perf.data" -- sleep 4 &
    prof=$!
    wrk -t1 -c64 -d4s -s "$root/bench/wrk/completion.lua" "http://127.0.0.1:$X/v1/completions" >/dev/null
    wait "$prof" || true
    echo; echo "pdproxy profile at c=64 (self time, top entries):"
    perf report -q -g none -i "$work/perf.data" --no-children --sort dso,symbol 2>/dev/null | grep -v "^$" | head -40 || true
    echo "by object (user space against the kernel):"
    perf report -q -g none -i "$work/perf.data" --no-children --sort dso 2>/dev/null | grep -v "^$" | head -8 || true
    [ -n "${PERF_KEEP:-}" ] && cp "$work/perf.data" "$PERF_KEEP.c64"
fi

echo
python3 - "$work/results" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    p = line.split()
    runs.setdefault((p[0], int(p[1])), []).append([float(x) for x in p[2:]])
def med(name, c, i):
    v = [r[i] for r in runs.get((name, c), []) if len(r) > i]
    return statistics.median(v) if v else 0.0
for c in sorted({c for _, c in runs}):
    n = med("nginx1hop", c, 0)
    if not n:
        continue
    out = ["c=%-3d" % c]
    for name in ("pdproxy", "baseline"):
        if (name, c) in runs:
            cpu_n = med("nginx1hop", c, 3)
            out.append("%s/nginx1hop req/s = %.2f  CPU/req = %.2f" % (
                name, med(name, c, 0) / n, med(name, c, 3) / cpu_n if cpu_n else 0))
    if ("baseline", c) in runs:
        out.append("pdproxy/baseline req/s = %.2f  CPU/req = %.2f" % (
            med("pdproxy", c, 0) / med("baseline", c, 0),
            med("pdproxy", c, 3) / med("baseline", c, 3) if med("baseline", c, 3) else 0))
    if med("direct", c, 3) and med("nginx1hop", c, 3):
        out.append("CPU/req pdproxy/(nginx1hop+mock) = %.2f" % (
            med("pdproxy", c, 3) / (med("nginx1hop", c, 3) + med("direct", c, 3))))
    if med("direct", c, 0):
        out.append("p50 pdproxy - direct = %.3f ms" % (med("pdproxy", c, 1) - med("direct", c, 1)))
    print("   ".join(out) + "   (medians of %d)" % len(runs[("nginx1hop", c)]))
    # Paired by round: a busy host slows every process of a round alike, so
    # the ratio within each round, then their median, blurs less than a
    # ratio of medians taken over different rounds.
    def series(name):
        return [r[3] for r in runs.get((name, c), []) if len(r) > 3]
    pd, ng, mk, bl = series("pdproxy"), series("nginx1hop"), series("direct"), series("baseline")
    paired = []
    k = min(len(pd), len(ng), len(mk))
    if k > 1:
        v = sorted(pd[i] / (ng[i] + mk[i]) for i in range(k) if ng[i] + mk[i])
    if k > 1 and v:
        paired.append("CPU/req pdproxy/(nginx1hop+mock) %.2f (%.2f-%.2f)" % (
            statistics.median(v), v[0], v[-1]))
    k = min(len(pd), len(bl))
    if k > 1:
        v = sorted(pd[i] / bl[i] for i in range(k) if bl[i])
    if k > 1 and v:
        paired.append("CPU/req pdproxy/baseline %.2f (%.2f-%.2f)" % (statistics.median(v), v[0], v[-1]))
    if paired:
        print("c=%-3d paired by round, median (range): " % c + "   ".join(paired))
    # Where the CPU goes: user space against the kernel. The kernel's part
    # follows the connections a process serves per request (a read and a
    # write on each, a request segment and an answer segment): pdproxy 3
    # (client, prefill, decode), nginx one hop 2, the mock 1. The segments
    # per request of the whole path (every sender, wrk's too) show whether
    # any path sends more than that floor (a split write, a bare ACK).
    if med("pdproxy", c, 6) and med("nginx1hop", c, 6):
        print("c=%-3d user/kernel us/req: pdproxy %.1f/%.1f, nginx1hop %.1f/%.1f, mock %.1f/%.1f;"
              " kernel us per connection of a request: pdproxy %.1f (3), nginx1hop %.1f (2),"
              " mock %.1f (1); TCP segments/req: two hops %.2f, one hop %.2f, direct %.2f" % (
                  c, med("pdproxy", c, 4), med("pdproxy", c, 5), med("nginx1hop", c, 4),
                  med("nginx1hop", c, 5), med("direct", c, 4), med("direct", c, 5),
                  med("pdproxy", c, 5) / 3, med("nginx1hop", c, 5) / 2, med("direct", c, 5),
                  med("pdproxy", c, 6), med("nginx1hop", c, 6), med("direct", c, 6)))
PY
if [ "$https" = 1 ]; then
    awk '{ rps[$1" "$2]=$3; cpu[$1" "$2]=$6 } END { for (i = 1; i <= 3; i++) { c = (i == 1) ? 1 : (i == 2) ? 16 : 64
        if (!rps["nginx1hop-tls " c]) continue
        printf "c=%-3d https upstreams: pdproxy/nginx1hop req/s = %.2f   CPU/req pdproxy/nginx1hop = %.2f\n",
            c, rps["pdproxy-tls " c] / rps["nginx1hop-tls " c],
            cpu["nginx1hop-tls " c] ? cpu["pdproxy-tls " c] / cpu["nginx1hop-tls " c] : 0 } }' "$work/results"
fi
if [ "$otlp" = 1 ]; then
    awk '{ rps[$1" "$2]=$3 } END { for (i = 1; i <= 3; i++) { c = (i == 1) ? 1 : (i == 2) ? 16 : 64
        printf "c=%-3d tracing on/off req/s = %.3f\n", c, rps["pdproxy+otlp " c] / rps["pdproxy " c] } }' "$work/results"
    curl -sf "http://127.0.0.1:$Y/metrics" | grep -E '^pdproxy_trace_spans' | sed 's/^/  /'
    # CPU per request (the export thread included) resists a busy machine
    # better than req/s does.
    for pp in "pdproxy $X" "pdproxy+otlp $Y"; do
        set -- $pp
        curl -sf "http://127.0.0.1:$2/metrics" | awk -v n="$1" '
            /^pdproxy_requests_total\{endpoint="\/v1\/completions"/ { r += $2 }
            /^process_cpu_seconds_total/ { c = $2 }
            END { printf "%-13s %.1f us CPU per request (%d requests)\n", n, c * 1e6 / r, r }'
    done
fi
# The peak from the kernel's high-water mark, read once at the end: polling
# RSS while wrk ran (a process spawned twice a second) took CPU from the
# pdproxy run alone and showed in its p99 (~2 ms against ~0.2 ms at c=1).
rss_peak=$(awk '/VmHWM/{print $2}' "/proc/$ppid/status")
echo "pdproxy RSS: idle $((rss_idle / 1024)).$(( (rss_idle % 1024) * 10 / 1024 )) MiB, peak under load $((rss_peak / 1024)).$(( (rss_peak % 1024) * 10 / 1024 )) MiB"
if [ -s "$work/logs/pdproxy.err" ]; then echo "pdproxy stderr (last lines):"; tail -5 "$work/logs/pdproxy.err"; fi
