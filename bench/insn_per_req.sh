#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Instructions per request (valgrind callgrind), pdproxy's two hops beside
# nginx's one hop over the same mock: a figure a busy or shared machine does
# not blur, unlike req/s or CPU seconds. User-space instructions only (the
# kernel's share, the system calls, is counted by strace in
# tests/integration/test_proxy_budget.py and by SYSCALLS=1 bench/proxy_bench.sh).
#
# Each process under test runs under callgrind; WARM requests warm its
# keep-alive pools, callgrind_control dumps (and zeroes) the counts, N
# requests run on CONNS keep-alive connections, a second dump holds those N
# requests alone: its total divided by N is the figure. Measured, one after
# the other, against nginx mocks that return canned answers (the same as
# bench/proxy_bench.sh's):
#   pdproxy            --threads 1, default flags (access log on, to a file)
#   pdproxy, log off   --threads 1 --access-log=false
#   nginx one hop      one worker (master_process off), proxy_pass with
#                      keep-alive to the decode mock, as in proxy_bench.sh
#   mock               the decode mock itself (nginx, return 200), what the
#                      one hop's figure leaves out: pdproxy's target is nginx's
#                      one hop plus its mock
#   bench/insn_per_req.sh [build-dir]   (N=1000 WARM=200 CONNS=1; ~2 minutes)
# PROMPT_BYTES=16384: a prompt of about that many bytes (the sentence repeated;
# ~4k tokens), where the body's scans and copies weigh as in real traffic.
# BASELINE=<build-dir>: also pdproxy from that build (another commit), both
# modes. PD_ARGS="...": more pdproxy flags for every pdproxy run (word-split);
# HEADERS="name: value|...": more request header lines; with ONLY="pdproxy"
# and a second run without them, the cost of a feature (admission's gate:
# PD_ARGS="--tenant bench --tenant-header-from 127.0.0.1" HEADERS="x-tenant: bench").
# PROFILE=<dir>: keep the callgrind files of the measured requests
# there (callgrind_annotate PROFILE/pdproxy.out).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
n=${N:-1000} warm=${WARM:-200} conns=${CONNS:-1}
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
bench_pdproxy "$build"
bench_needs valgrind callgrind_control nginx python3
baseline=""
if [ -n "${BASELINE:-}" ]; then
    baseline=$BASELINE/bin/pdproxy
    [ -x "$baseline" ] || { echo "BASELINE: $baseline missing" >&2; exit 1; }
fi
P=$(free_port); D=$(free_port); N1=$(free_port); M=$(free_port)
mkdir -p "$work/logs"
cat >"$work/backends.conf" <<CONF
user root; worker_processes 1; pid $work/backends.pid; error_log $work/logs/backends.err warn;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; client_body_temp_path $work/body;
  server { listen 127.0.0.1:$P; location / { default_type application/json; return 200 '$pbody'; } }
  server { listen 127.0.0.1:$D; location / { default_type application/json; return 200 '$dbody'; } }
}
CONF
# The same decode mock, alone in a process of its own: measured, not used.
cat >"$work/mock.conf" <<CONF
master_process off; daemon off; worker_processes 1; pid $work/mock.pid;
error_log $work/logs/mock.err warn;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; client_body_temp_path $work/body3;
  server { listen 127.0.0.1:$M; location / { default_type application/json; return 200 '$dbody'; } }
}
CONF
cat >"$work/onehop.conf" <<CONF
master_process off; daemon off; worker_processes 1; pid $work/onehop.pid;
error_log $work/logs/onehop.err warn;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000;
  client_body_temp_path $work/body2; proxy_temp_path $work/ptemp;
  upstream dmock { server 127.0.0.1:$D; keepalive 128; }
  server { listen 127.0.0.1:$N1;
    location / { proxy_pass http://dmock; proxy_http_version 1.1;
                 proxy_set_header Connection ""; proxy_buffering off; } }
}
CONF
nginx -c "$work/backends.conf" -g 'daemon off;' & pids+=($!)
for p in $P $D; do wait_port "$p" 30; done

# drive PORT COUNT: COUNT completions (wrk's completion body) on CONNS
# keep-alive connections, each sent in one write; fails unless all are 200.
drive() {
    ROOT=$root python3 - "$1" "$2" "$conns" <<'PY'
import os, socket, sys, threading
sys.path.insert(0, os.path.join(os.environ["ROOT"], "tests", "integration"))
from pdharness.canned import response_length as length
port, count, conns = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
words = b"The quick brown fox jumps over the lazy dog"
want = int(os.environ.get("PROMPT_BYTES") or 0)
prompt = (words + b" ") * (want // (len(words) + 1)) + words if want else words
body = b'{"model":"bench","prompt":"' + prompt + b'","max_tokens":16,"temperature":0}'
extra = b"".join(h.strip().encode() + b"\r\n" for h in os.environ.get("HEADERS", "").split("|")
                if h.strip())
req = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
       + extra + b"Content-Length: %d\r\n\r\n" % len(body)) + body
ok = [0] * conns
def one(i, k):
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = b""
    for _ in range(k):
        s.sendall(req)
        for _ in range(10000):
            m = length(buf)
            if m is not None:
                ok[i] += buf.startswith(b"HTTP/1.1 200")
                buf = buf[m:]
                break
            data = s.recv(65536)
            if not data:
                return
            buf += data
    s.close()
ts = [threading.Thread(target=one, args=(i, count // conns + (i < count % conns))) for i in range(conns)]
for t in ts: t.start()
for t in ts: t.join()
sys.exit(0 if sum(ok) == count else "%d of %d answered 200" % (sum(ok), count))
PY
}

# measure NAME PORT COMMAND...: COMMAND under callgrind; prints instructions
# per request of the N measured requests.
measure() {
    local name=$1 port=$2 vp ir
    shift 2
    valgrind --tool=callgrind --callgrind-out-file="$work/cg.$name" "$@" \
        2>"$work/logs/vg.$name" & vp=$!
    pids+=("$vp")
    wait_port "$port" 60
    drive "$port" "$warm"
    callgrind_control -d "$vp" >/dev/null 2>&1  # start-up and warm-up: part 1
    drive "$port" "$n"
    callgrind_control -d "$vp" >/dev/null 2>&1  # the N requests: part 2
    kill -INT "$vp" 2>/dev/null || true
    wait "$vp" 2>/dev/null || true
    # nginx with master_process off may leave its pid file behind.
    ir=$(sed -n 's/^summary: *\([0-9]*\).*/\1/p' "$work/cg.$name.2" | head -1)
    [ -n "$ir" ] || ir=$(sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$work/cg.$name.2" | head -1)
    [ -n "${PROFILE:-}" ] && mkdir -p "$PROFILE" && cp "$work/cg.$name.2" "$PROFILE/$name.out"
    echo "$name $((ir / n))" >>"$work/results"
    printf "%-22s %9d instructions per request\n" "$name" "$((ir / n))"
}

pd() { # name binary [args]: pdproxy against the two mocks
    local name=$1 bin=$2 X
    shift 2
    X=$(free_port)
    # shellcheck disable=SC2086
    measure "$name" "$X" "$bin" --port "$X" --threads 1 --prefill "http://127.0.0.1:$P" \
        --decode "http://127.0.0.1:$D" ${PD_ARGS:-} "$@"
}

# ONLY="pdproxy nginx1hop ...": those runs alone.
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
echo "instructions per request (callgrind): $n requests after $warm, $conns connection(s)"
want pdproxy && pd pdproxy "$pdproxy" --log-file "$work/logs/access.pdproxy"
want pdproxy-logoff && pd pdproxy-logoff "$pdproxy" --access-log=false --log-level warn
if [ -n "$baseline" ]; then
    want baseline && pd baseline "$baseline" --log-file "$work/logs/access.baseline"
    want baseline-logoff && pd baseline-logoff "$baseline" --access-log=false --log-level warn
fi
want nginx1hop && measure nginx1hop "$N1" nginx -c "$work/onehop.conf"
want mock && measure mock "$M" nginx -c "$work/mock.conf"
python3 - "$work/results" <<'PY'
import sys
r = dict((l.split()[0], int(l.split()[1])) for l in open(sys.argv[1]))
if "nginx1hop" in r and "mock" in r:
    one = r["nginx1hop"] + r["mock"]
    for k in ("pdproxy", "pdproxy-logoff", "baseline", "baseline-logoff"):
        if k in r:
            print("%-15s / nginx1hop = %.2f   / (nginx1hop + mock) = %.2f"
                  % (k, r[k] / r["nginx1hop"], r[k] / one))
PY
