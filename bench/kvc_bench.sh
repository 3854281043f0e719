#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Connector benchmark: kvc_bench over tcp and over shared memory, each next to
# ucx_perftest ucp_get (and ucp_am_bw, what the push protocol uses) at the
# same sizes and UCX_TLS, in one run.  Not a test.
#
# usage: bench/kvc_bench.sh [BUILD_DIR] [--quick]
#   BUILD_DIR defaults to ./build; kvc_bench must be built there (bin/).
set -euo pipefail
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
