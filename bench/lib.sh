# SPDX-License-Identifier: Apache-2.0
# Shared by the benchmark scripts (sourced): a work directory removed on
# exit, background processes (append their pids to `pids`) stopped on exit,
# free loopback ports, and waiting for a port to accept connections; for
# the scripts timing pdproxy against canned engines, bench_pdproxy and
# bench_needs (the preamble's checks) and the canned answers.
work=$(mktemp -d)
pids=()
bench_cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap bench_cleanup EXIT INT TERM

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# wait_port PORT [SECONDS]: exits the script when nothing listens in time.
wait_port() {
    local tries=$(( ${2:-5} * 20 ))
    for _ in $(seq 1 "$tries"); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    echo "port $1 never opened" >&2; exit 1
}

# wait_traced PID: until a tracer (strace -p) is attached to PID, at most 5 s.
wait_traced() {
    for _ in $(seq 1 100); do
        [ "$(awk '/^TracerPid:/{print $2}' "/proc/$1/status" 2>/dev/null)" != 0 ] && return 0
        sleep 0.05
    done
    echo "no tracer attached to $1" >&2; exit 1
}

# wait_lines FILE N: until FILE has N lines, at most 5 s.
wait_lines() {
    for _ in $(seq 1 100); do
        [ "$(wc -l < "$1" 2>/dev/null || echo 0)" -ge "$2" ] && return 0
        sleep 0.05
    done
    echo "$1 never reached $2 lines" >&2; exit 1
}

# bench_pdproxy BUILD_DIR: sets `pdproxy` to BUILD_DIR/bin/pdproxy, or exits
# when it is not built.
bench_pdproxy() {
    pdproxy=$1/bin/pdproxy
    [ -x "$pdproxy" ] || { echo "build pdproxy first ($pdproxy missing)" >&2; exit 1; }
}

# bench_needs TOOL...: exits unless every tool is on PATH.
bench_needs() {
    local t
    for t in "$@"; do
        command -v "$t" >/dev/null || { echo "needs $* (deploy/local/install-deps.sh)" >&2; exit 1; }
    done
}

# The canned answers of the mock engines (nginx `return 200`): prefill's
# with kv_transfer_params, decode's with usage.
pbody='{"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" a","finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[1,2,3],"remote_engine_id":"p0","remote_request_id":"cmpl-bench-0-deadbeef","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1}}'
dbody='{"id":"cmpl-bench","object":"text_completion","created":1,"model":"bench","choices":[{"index":0,"text":" jumps over the lazy dog again and again","finish_reason":"length"}],"usage":{"prompt_tokens":9,"completion_tokens":16,"total_tokens":25}}'
