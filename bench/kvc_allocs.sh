#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Heap allocations per staged chunk made by the connector's own code, on the
# CUDA stand-in (no GPU): a producer and a consumer process of
# kvc_gpu_test_standin, each with bench/alloc_count.c preloaded counting by
# calling site, fetch SMALL and then LARGE blocks of 32 KiB in 4 regions
# (staged, KVC_IPC=0); the sites inside connector/ are resolved with
# addr2line and their difference divided by the difference in chunks
# (the consumer's copies).  UCX's and the stand-in's own allocations are left
# out (printed as a total).  Not a test.
#   usage: bench/kvc_allocs.sh [BUILD_DIR] [shm|wire]   (KVC_ALLOCS_SMALL=128 LARGE=1152)
set -euo pipefail
B=${1:-build} WAY=${2:-shm}
BIN=$B/bin/kvc_gpu_test_standin SO=$B/lib/alloc_count.so
if [ ! -x "$BIN" ] || [ ! -f "$SO" ]; then
    echo "build kvc_gpu_test_standin and alloc_count in $B first" >&2
    exit 2
fi
SO=$(realpath "$SO")
export UCX_WARN_UNUSED_ENV_VARS=n KVC_SECRET=${KVC_SECRET-kvc-bench-secret} KVC_CUDA_STAGED=1 KVC_IPC=0
[ "$WAY" = wire ] && export KVC_STAGED_WIRE=1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# One fetch of $1 blocks: prints "chunks", leaves $dir/{p,c}.$1 (site counts).
run() {
    local f=$1 opts=(--regions 4 --blocks "$(($1 * 2))" --block-kb 32 --fetch "$1")
    ALLOC_COUNT_CALLERS=1 ALLOC_COUNT_OUT=$dir/p.$f LD_PRELOAD=$SO \
        timeout 120 "$BIN" producer --params "$dir/j$f" "${opts[@]}" >"$dir/po.$f" 2>&1 &
    local pp=$!
    ALLOC_COUNT_CALLERS=1 ALLOC_COUNT_OUT=$dir/c.$f LD_PRELOAD=$SO \
        timeout 120 "$BIN" consumer --params "$dir/j$f" "${opts[@]}" >"$dir/co.$f" 2>&1 || true
    wait "$pp" || true
    grep -q "outcome=done bad_words=0" "$dir/co.$f" || { tail -3 "$dir/co.$f" >&2; exit 1; }
    grep -o "staged=[a-z]*" "$dir/co.$f" | head -1 >"$dir/way.$f"
    grep -o "copies=[0-9]*" "$dir/co.$f" | head -1 | cut -d= -f2
}
# Site counts of file $1 inside connector/, by function: "function count".
sites() {
    awk '/^@ / { print $2, $3, $4 }' "$1" | while read -r obj off n; do
        [ "$(realpath "$obj")" = "$(realpath "$BIN")" ] || continue
        loc=$(addr2line -f -e "$obj" "0x$off" | paste -sd' ')
        case $loc in *"/connector/"*) echo "${loc%% *} $n" ;; esac
    done | awk '{ s[$1] += $2 } END { for (k in s) print k, s[k] }' | sort
}
S=${KVC_ALLOCS_SMALL:-128} L=${KVC_ALLOCS_LARGE:-1152}
cs=$(run "$S") cl=$(run "$L")
echo "kvc_allocs way=$(cat "$dir/way.$L") chunks=$cs/$cl UCX_TLS=${UCX_TLS:-default}"
for side in p c; do
    name=$([ $side = p ] && echo producer || echo consumer)
    join -a1 -a2 -e0 -o 0,1.2,2.2 <(sites "$dir/$side.$S") <(sites "$dir/$side.$L") |
        awk -v n=$((cl - cs)) -v who="$name" '{ d = $3 - $2; t += d; if (d) printf "  %s %s: %.2f per chunk\n", who, $1, d / n }
            END { printf "%s_connector_allocs_per_chunk=%.2f\n", who, t / n }'
    tot() { head -1 "$1" | awk '{ print $1 + $2 + $3 }'; }
    echo "  ${name}_process_allocs_per_chunk=$(awk -v a="$(tot "$dir/$side.$S")" -v b="$(tot "$dir/$side.$L")" -v n=$((cl - cs)) 'BEGIN { printf "%.1f", (b - a) / n }') (UCX and the stand-in included)"
done
