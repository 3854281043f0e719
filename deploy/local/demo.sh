#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The local demo: installs what is missing, builds, starts one prefill and one
# decode engine-sim plus pdproxy on loopback, sends a streamed chat request
# through the proxy, prints the answer as it streams and the KV transfer
# figures, then stops everything it started (also on Ctrl-C).
#
#   deploy/local/demo.sh ["your prompt"]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
prompt=${1:-"Explain in a few words why prefill and decode run on different GPUs."}

deploy/local/install-deps.sh
echo "== building (build/)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
if ! cmake --build build -j "$(nproc)" >build/demo-build.log 2>&1; then
    cat build/demo-build.log; exit 1
fi
bin=$root/build/bin

work=$(mktemp -d)
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(free_port); D=$(free_port); X=$(free_port)

echo "== starting prefill engine-sim :$P, decode engine-sim :$D, pdproxy :$X"
"$bin/engine-sim" --role prefill --port "$P" --ttft-ms 40 --layers 4 --block-bytes 16384 \
    2>"$work/prefill.log" & pids+=($!)
# Decode logs at debug level: the connector names the UCX transports of each
# producer endpoint ("transports=...") only there; the summary below prints them.
"$bin/engine-sim" --role decode --port "$D" --ttft-ms 10 --itl-ms 40 --layers 4 --block-bytes 16384 \
    --log-level debug 2>"$work/decode.log" & pids+=($!)
"$bin/pdproxy" --port "$X" --prefiller-hosts 127.0.0.1 --prefiller-ports "$P" \
    --decoder-hosts 127.0.0.1 --decoder-ports "$D" 2>"$work/pdproxy.log" & pids+=($!)

for port in "$P" "$D" "$X"; do
    path=/health
    for i in $(seq 1 100); do
        curl -sf "http://127.0.0.1:$port$path" >/dev/null && break
        [ "$i" = 100 ] && { echo "port $port never became ready" >&2; cat "$work"/*.log >&2; exit 1; }
        sleep 0.05
    done
done

echo "== POST http://127.0.0.1:$X/v1/chat/completions (stream) — prompt: $prompt"
body=$(python3 -c 'import json,sys; print(json.dumps({"model":"sim-model","stream":True,
  "max_tokens":24,"stream_options":{"include_usage":True},
  "messages":[{"role":"user","content":sys.argv[1]}]}))' "$prompt")
printf "answer:"
curl -sN "http://127.0.0.1:$X/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" |
python3 -u -c '
import json, sys
usage = None
for line in sys.stdin:
    line = line.strip()
    if not line.startswith("data: "): continue
    data = line[6:]
    if data == "[DONE]": break
    ev = json.loads(data)
    for ch in ev.get("choices", []):
        sys.stdout.write(ch.get("delta", {}).get("content", "")); sys.stdout.flush()
    usage = ev.get("usage") or usage
print()
if usage: print("usage:", json.dumps(usage))
'

metric() { curl -s "http://127.0.0.1:$1/metrics" | awk -v m="$2" '$1==m {print $2}'; }
echo "== KV transfer (decode pulled the blocks from prefill over UCX, then notified it)"
{ grep -o 'msg="kv fetch done".*' "$work/decode.log" || true; } | tail -1 | sed 's/^/decode: /'
{ grep -o 'transports=[a-z0-9_,]* path=[a-z_]*' "$work/decode.log" || true; } | head -1 |
    sed 's/^/decode: UCX /'
printf "fetches=%s bytes=%s seconds=%s\n" "$(metric "$D" engine_sim_kv_fetches_total)" \
    "$(metric "$D" engine_sim_kv_bytes_fetched_total)" "$(metric "$D" engine_sim_kv_fetch_seconds_total)"
printf "prefill: blocks published=%s released by decode's notification=%s expired=%s\n" \
    "$(metric "$P" engine_sim_kv_blocks_published_total)" \
    "$(metric "$P" engine_sim_kv_blocks_released_by_consumer_total)" \
    "$(metric "$P" engine_sim_kv_blocks_expired_total)"
{ grep -o 'msg="request".*' "$work/pdproxy.log" || true; } | tail -1 | sed 's/^/pdproxy: /'
