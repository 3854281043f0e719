#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Connector benchmark: kvc_bench over tcp and over shared memory, each next to
# ucx_perftest ucp_get (and ucp_am_bw, what the push protocol uses) at the
# same sizes and UCX_TLS, in one run.  Not a test.
#
# usage: bench/kvc_bench.sh [BUILD_DIR] [--quick]
#   BUILD_DIR defaults to ./build; kvc_bench must be built there (bin/).
#        bench/kvc_bench.sh --ipc [BUILD_DIR]   (the CUDA IPC path, below)
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

BUILD=${1:-build}
QUICK=${2:-}
BENCH="$BUILD/bin/kvc_bench"
[ -x "$BENCH" ] || { echo "kvc_bench not found in $BUILD/bin (build first)" >&2; exit 2; }
export UCX_WARN_UNUSED_ENV_VARS=n
# The authenticated side channel, as deployed (KVC_SECRET= measures without).
export KVC_SECRET=${KVC_SECRET-kvc-bench-secret}

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
