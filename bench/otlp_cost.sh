#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# What trace export costs pdproxy, in instructions per request (valgrind
# callgrind): a figure that a busy or shared machine does not blur, unlike
# req/s.  pdproxy runs under callgrind with export off, then on (sampler 1.0,
# to an nginx that accepts OTLP/HTTP), each for N1 and N2 sequential
# keep-alive requests against nginx mock engines; (Ir(N2) - Ir(N1)) / (N2 - N1)
# removes start-up and shutdown.
#   bench/otlp_cost.sh [build-dir]        (N1=200 N2=1200; a few minutes)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
pdproxy=${1:-$root/build}/bin/pdproxy
n1=${N1:-200} n2=${N2:-1200}
[ -x "$pdproxy" ] || { echo "build pdproxy first ($pdproxy missing)" >&2; exit 1; }
for t in valgrind nginx python3; do
    command -v $t >/dev/null || { echo "needs $t" >&2; exit 1; }
done
# shellcheck source=bench/lib.sh
. "$root/bench/lib.sh"
P=$(free_port); D=$(free_port); O=$(free_port)
pbody='{"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"p0","remote_request_id":"cmpl-bench-0-deadbeef","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}'
dbody='{"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" jumps over the lazy dog","finish_reason":"length"}]}'
mkdir -p "$work/logs"
cat >"$work/nginx.conf" <<CONF
user root; worker_processes 1; pid $work/nginx.pid; error_log $work/logs/nginx.err warn;
events { worker_connections 1024; }
http {
  access_log off; keepalive_requests 1000000; client_body_temp_path $work/body;
  server { listen 127.0.0.1:$P; location / { default_type application/json; return 200 '$pbody'; } }
  server { listen 127.0.0.1:$D; location / { default_type application/json; return 200 '$dbody'; } }
  server { listen 127.0.0.1:$O; client_max_body_size 64m;
           location /v1/traces { default_type application/json; return 200 '{}'; } }
}
CONF
nginx -c "$work/nginx.conf" -g 'daemon off;' & pids+=($!)
for p in $P $D $O; do wait_port "$p" 60; done

instructions() { # on|off N -> total instructions of one pdproxy run
    local X envs=() vp
    X=$(free_port)
    [ "$1" = on ] && envs=(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$O"
                           OTEL_TRACES_SAMPLER=traceidratio OTEL_TRACES_SAMPLER_ARG=1.0)
    env ${envs[@]+"${envs[@]}"} valgrind --tool=callgrind --callgrind-out-file="$work/cg.$1.$2" \
        "$pdproxy" --port "$X" --threads 1 --log-level warn --access-log=false \
        --prefill "http://127.0.0.1:$P" --decode "http://127.0.0.1:$D" 2>"$work/logs/vg.$1.$2" &
    vp=$!
    wait_port "$X" 60
    python3 - "$X" "$2" <<'PY'
import http.client, sys
c = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=60)
for _ in range(int(sys.argv[2])):
    c.request("POST", "/v1/completions", body=b'{"model":"m","prompt":"hello world","max_tokens":8}',
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    r.read()
    assert r.status == 200, r.status
PY
    kill -INT "$vp"
    wait "$vp" || true
    sed -n 's/.*Collected : *\([0-9]*\).*/\1/p' "$work/logs/vg.$1.$2" | tail -1
}
declare -A ir
for mode in off on; do
    for n in "$n1" "$n2"; do ir[$mode.$n]=$(instructions "$mode" "$n"); done
    echo "export $mode: $(( (ir[$mode.$n2] - ir[$mode.$n1]) / (n2 - n1) )) instructions per request"
done
