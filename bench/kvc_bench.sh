#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Connector benchmark: kvc_bench over tcp and over shared memory, each next to
# ucx_perftest ucp_get (and ucp_am_bw, what the push protocol uses) at the
# same sizes and UCX_TLS, in one run.  Not a test.
#
# usage: bench/kvc_bench.sh [BUILD_DIR] [--quick]
#   BUILD_DIR defaults to ./build; kvc_bench must be built there (bin/).
#        bench/kvc_bench.sh --ipc [BUILD_DIR]   (the CUDA IPC path, below)
#        bench/kvc_bench.sh [BUILD_DIR] --staged
#   The staged path without a GPU: kvc_gpu_test_standin (the CUDA stand-in
#   copying like a GPU: copy-engine threads, CUDASIM_GBPS caps them) fetches
#   the same bytes as device memory (staged, through the pinned pools) and
#   as host memory (pushed), under the same UCX_TLS, KVC_BENCH_RUNS (5)
#   times alternating; prints the medians and one line
#   staged_pct_of_host=N (staged GB/s as % of host GB/s).  KVC_BENCH_BASE=DIR
#   also times the staged fetch of another build (e.g. main) in the same
#   loop: base_staged_pct_of_host=N.  KVC_BENCH_MB (128) sets the size.
set -euo pipefail

# --ipc: the same-node CUDA IPC path on the CUDA stand-in (no GPU): a
# producer and a consumer process of kvc_gpu_test_standin (device memory is a
# memfd the consumer maps with cudaIpcOpenMemHandle), the fetch's GB/s
# against a memcpy of the same runs in the consumer right after it (the
# stand-in's device-to-device cudaMemcpyAsync is a host memcpy), three runs;
# prints each run and ipc_pct_of_memcpy=N, the median of the runs' ratios.
#   usage: bench/kvc_bench.sh --ipc [BUILD_DIR]
case "${1:-}" in
--ipc)
    BUILD=${2:-build}
    BIN="$BUILD/bin/kvc_gpu_test_standin"
    [ -x "$BIN" ] || { echo "kvc_gpu_test_standin not found in $BUILD/bin (build it first)" >&2; exit 2; }
    export UCX_WARN_UNUSED_ENV_VARS=n KVC_SECRET=${KVC_SECRET-kvc-bench-secret} KVC_IPC=1
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    # 8 regions x 1024 blocks x 64 KiB per process, 512 blocks fetched in
    # runs of 64: 256 MiB over IPC.
    sizes=(--regions 8 --blocks 1024 --block-kb 64 --fetch 512)
    ratios=()
    for run in 1 2 3; do
        rm -f "$dir/p.json"*
        timeout 120 "$BIN" producer --params "$dir/p.json" "${sizes[@]}" >"$dir/p.out" 2>"$dir/p.err" &
        ppid=$!
        timeout 120 "$BIN" consumer --params "$dir/p.json" "${sizes[@]}" >"$dir/c.out" 2>"$dir/c.err" || true
        wait "$ppid" || true
        line=$(grep '^RESULT fetch' "$dir/c.out" || true)
        g=$(echo "$line" | sed -n 's/.* gbps=\([^ ]*\).*/\1/p')
        m=$(echo "$line" | sed -n 's/.* memcpy_gbps=\([^ ]*\).*/\1/p')
        path=$(echo "$line" | sed -n 's/.* path=\([^ ]*\).*/\1/p')
        if [ "$(echo "$line" | sed -n 's/.*bad_words=\([^ ]*\).*/\1/p')" != 0 ] || [ "$path" != ipc ]; then
            echo "run $run failed: ${line:-no result} $(tail -2 "$dir/c.err")" >&2
            exit 1
        fi
        echo "run $run: ipc_gbps=$g memcpy_gbps=$m first_fetch_ms=$(echo "$line" | sed -n 's/.*first_fetch_ms=\([^ ]*\).*/\1/p')"
        ratios+=("$(awk -v a="$g" -v b="$m" 'BEGIN { printf "%.1f", (b > 0) ? 100 * a / b : 0 }')")
    done
    printf '%s\n' "${ratios[@]}" | sort -n | awk '{ v[NR] = $1 } END { printf "ipc_pct_of_memcpy=%.0f\n", v[int((NR + 1) / 2)] }'
    exit 0
    ;;
esac

BUILD=build QUICK="" STAGED=0
for arg in "$@"; do
    case $arg in
    --staged) STAGED=1 ;;
    --quick) QUICK=--quick ;;
    *) BUILD=$arg ;;
    esac
done
BENCH="$BUILD/bin/kvc_bench"
export UCX_WARN_UNUSED_ENV_VARS=n
# The authenticated side channel, as deployed (KVC_SECRET= measures without).
export KVC_SECRET=${KVC_SECRET-kvc-bench-secret}

if [ $STAGED = 1 ]; then
    # shellcheck source=bench/lib.sh
    source "$(dirname "$0")/lib.sh"
    runs=${KVC_BENCH_RUNS:-5} mb=${KVC_BENCH_MB:-128}
    # 4 regions of 32 KiB blocks, runs of 64 blocks (2 MiB chunks), mb MiB moved.
    fetch=$((mb * 1024 / 32 / 4))
    opts=(--regions 4 --blocks $((fetch * 2)) --block-kb 32 --fetch $fetch)
    pair() { # BUILD_DIR ENV... -- [--host]: prints the consumer's GB/s (or "fail")
        local bin=$1/bin/kvc_gpu_test_standin envs=()
        shift
        while [ "$1" != -- ]; do envs+=("$1"); shift; done
        shift
        [ -x "$bin" ] || { echo "$bin not built" >&2; exit 2; }
        local j=$work/p$RANDOM.json
        env "${envs[@]}" timeout 300 "$bin" producer --params "$j" "${opts[@]}" "$@" \
            >"$j.p" 2>&1 &
        local pp=$!
        pids+=("$pp")
        env "${envs[@]}" timeout 300 "$bin" consumer --params "$j" "${opts[@]}" "$@" \
            >"$j.c" 2>&1 || true
        wait "$pp" 2>/dev/null || true
        local g
        g=$(sed -n 's/^RESULT fetch outcome=done bad_words=0 .* gbps=\([^ ]*\).*/\1/p' "$j.c")
        echo "${g:-fail}"
        [ -n "$g" ] || sed 's/^/  | /' "$j.c" | tail -5 >&2
    }
    median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]; else print 0}'; }
    pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.0f", 100 * a / b; else print 0 }'; }
    host="" staged="" wire="" base=""
    for ((i = 1; i <= runs; i++)); do
        host+=" $(pair "$BUILD" -- --host)"
        staged+=" $(pair "$BUILD" KVC_CUDA_STAGED=1 --)"
        wire+=" $(pair "$BUILD" KVC_CUDA_STAGED=1 KVC_STAGED_WIRE=1 --)"
        if [ -n "${KVC_BENCH_BASE:-}" ]; then base+=" $(pair "$KVC_BENCH_BASE" KVC_CUDA_STAGED=1 --)"; fi
    done
    H=$(echo "$host" | median) S=$(echo "$staged" | median) W=$(echo "$wire" | median)
    echo "staged_bench runs=$runs bytes=$((mb << 20)) UCX_TLS=${UCX_TLS:-default} CUDASIM_GBPS=${CUDASIM_GBPS:-none} window=${KVC_STAGE_WINDOW:-default}"
    echo "host_gbps=$H [$host ] staged_gbps=$S [$staged ] staged_wire_gbps=$W [$wire ]"
    echo "staged_wire_pct_of_host=$(pct "$W" "$H")"
    if [ -n "${KVC_BENCH_BASE:-}" ]; then
        B=$(echo "$base" | median)
        echo "base_staged_gbps=$B [$base ] ($KVC_BENCH_BASE)"
        echo "base_staged_pct_of_host=$(pct "$B" "$H")"
    fi
    echo "staged_pct_of_host=$(pct "$S" "$H")"
    exit 0
fi
[ -x "$BENCH" ] || { echo "kvc_bench not found in $BUILD/bin (build first)" >&2; exit 2; }

# shellcheck source=bench/lib.sh
source "$(dirname "$0")/lib.sh" # free_port

# Waits until a socket listens on port $1 (bounded).  Reads /proc/net/tcp*
# instead of connecting: ucx_perftest's server takes exactly one connection.
wait_listen() {
    python3 - "$1" <<'PY'
import sys, time
port = "%04X" % int(sys.argv[1])
end = time.monotonic() + 20
while time.monotonic() < end:
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in open(f).read().splitlines()[1:]:
                c = line.split()
                if c[1].endswith(":" + port) and c[3] == "0A":
                    sys.exit(0)
        except OSError:
            pass
    time.sleep(0.01)
sys.exit(1)
PY
}

perftest() { # TLS TEST SIZE ITERS
    local port; port=$(free_port)
    UCX_TLS=$1 timeout 120 ucx_perftest -p "$port" -t "$2" -s "$3" -n "$4" -w 10 >/dev/null 2>&1 &
    local srv=$!
    # ucx_perftest's server opens its port for the exchange only; poll for it.
    if ! wait_listen "$port"; then kill $srv 2>/dev/null; echo "perftest $2 size=$3: server did not start"; return; fi
    local out
    out=$(UCX_TLS=$1 timeout 120 ucx_perftest 127.0.0.1 -p "$port" -t "$2" -s "$3" -n "$4" -w 10 2>&1 | awk '/Final:/ {print $(NF-2)}' || true)
    wait $srv 2>/dev/null || true
    # Column is MB/s (2^20 bytes); report GB/s (1e9) like kvc_bench.
    python3 -c "v='$out'; print('ucx_perftest tls=$1 test=$2 size=$3 GBps=%.3f' % (float(v)*1048576/1e9) if v else 'ucx_perftest tls=$1 test=$2 size=$3 failed')"
}

for TLS in tcp,self sm,tcp,self; do
    echo "=== UCX_TLS=$TLS"
    "$BENCH" --tls "$TLS" $QUICK
    for size in 16384 262144 2097152; do
        iters=$(( (256 << 20) / size )); [ "$iters" -gt 20000 ] && iters=20000
        [ -n "$QUICK" ] && iters=$(( iters / 8 + 10 ))
        perftest "$TLS" ucp_get "$size" "$iters"
        perftest "$TLS" ucp_am_bw "$size" "$iters"
    done
done
