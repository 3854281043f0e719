#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU check of libkvconnector, one command for a machine with an NVIDIA GPU
# (well under 8 minutes).  Builds what it needs (CUDA toolkit required), then
# runs a producer and a consumer as two processes on device memory:
#   vLLM-sized regions: 32 layers x K/V = 64 regions of up to 16k blocks of
#   16 tokens x 8 heads x 128 x bf16 (32 KiB), as many blocks as the GPU's
#   free memory holds for both processes, a quarter of them fetched
#   (scattered runs);
# every byte checked, untouched blocks too; GB/s against cudaMemcpy
# device-to-device and pinned host-to-device measured in the same run; the
# staged path in both variants, staged-shm (one host: the consumer copies
# from the producer's mapped pool; target: 70 % of pinned H2D, end to end)
# and staged-wire (KVC_STAGED_WIRE=1: through the transport, reported) and, where UCX has
# CUDA transports, the direct one (it says which); two GPUs over cuda_ipc
# when there are two; stream-order probes (publish right after a slow stream
# operation, no host sync) on a created stream and on the legacy default
# stream (handle 0); a fetch after the publication expired and one after the
# engine aborted it (both must FAIL); heterogeneous TP (two decode ranks
# fetch one prefill rank's blocks, released after both); a producer killed
# mid-fetch, also over shared memory only (must fail cleanly; a fetch that
# finished before the kill proves nothing and FAILS the check); the consumer
# under compute-sanitizer when it is installed; the same-node CUDA IPC path
# (byte-exact, GB/s against D2D cudaMemcpy of the same runs, target 70 %,
# first-fetch latency, stream order, two GPUs, reads after expiry/abort
# denied, producer killed; also from VMM memory mapped as PyTorch's
# expandable segments map it, fetch-ipc-vmm) while every other check runs
# with KVC_IPC=0, so the staged and direct figures stay those of their
# paths.  One summary line per check;
# exit status 0 only if every check passed, 77 when nvidia-smi sees no GPU
# (nothing to check).  A GPU that nvidia-smi sees with no test binary built
# or buildable FAILS.
#
# usage: tests/gpu/run_gpu_tests.sh [BUILD_DIR]          (default: build-gpu)
#        tests/gpu/run_gpu_tests.sh --standin BUILD_DIR
#   --standin: the same flow with kvc_gpu_test_standin (the CUDA stand-in of
#   tests/cudasim, CPU only): small sizes, no bandwidth targets, no direct
#   path; this is how the script itself is tested without a GPU.
#        tests/gpu/run_gpu_tests.sh --blocks-for FREE_MIB
#   prints the blocks per region it would use with FREE_MIB MiB free on GPU 0
#   (exit 1 when that is too little), and nothing else: its sizing, tested.
set -uo pipefail

# vLLM-sized: 64 regions x BLK blocks x 32 KiB per process, i.e. 2 MiB of
# GPU memory per block index, two processes on GPU 0, 80 % of its free
# memory (FREE_MIB, in MiB) at most, a multiple of 64, 16k blocks at most.
blocks_for() {
    awk -v f="${1:-0}" 'BEGIN { b = int(f * 0.8 / 2 / (64 * 32 / 1024)); b -= b % 64;
                               if (b < 0) b = 0; if (b > 16384) b = 16384; print b }'
}
MIN_BLK=1024
too_little() { # FREE_MIB
    echo "GPU 0 has ${1:-?} MiB free: too little for 64 regions x $MIN_BLK blocks x 32 KiB in two processes"
}
if [ "${1:-}" = --blocks-for ]; then
    if ! [[ "${2:-}" =~ ^[0-9]+$ ]]; then
        echo "usage: $0 --blocks-for FREE_MIB (a whole number of MiB)" >&2
        exit 2
    fi
    b=$(blocks_for "$2")
    echo "$b"
    if [ "$b" -lt $MIN_BLK ]; then
        too_little "$2"
        exit 1
    fi
    exit 0
fi

SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STANDIN=0
if [ "${1:-}" = --standin ]; then
    STANDIN=1
    shift
fi
BUILD=${1:-${PX_BUILD_DIR:-$SRC/build-gpu}}
LIMIT=${KVC_GPU_TIME_LIMIT:-450} # seconds for all checks
START=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvc-gpu.XXXXXX")
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}" $(cat "$WORK"/*.pid 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

FAILS=0
summary() { # STATUS CHECK TEXT
    printf '%-4s %-20s %s\n' "$1" "$2" "$3"
    if [ "$1" = FAIL ]; then FAILS=$((FAILS + 1)); fi
}
val() { # FILE KEY: the value of KEY=... on the file's RESULT line
    sed -n "s/^RESULT .*[ ]$2=\([^ ]*\).*/\1/p" "$1" | head -1
}
ratio_ok() { # A B MIN: A/B >= MIN
    awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN { exit !(b > 0 && a / b >= m) }'
}
pct() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.0f", 100 * a / b; else print "?" }'; }
time_left() { [ $((SECONDS - START)) -lt "$LIMIT" ]; }
tail_of() { sed -n '1,200p' "$1" | tail -n 8 | sed 's/^/     | /'; }

export UCX_WARN_UNUSED_ENV_VARS=n

# ------------------------------------------------------------ device, build --
if [ $STANDIN = 0 ]; then
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
        summary SKIP device "nvidia-smi sees no NVIDIA GPU: nothing to check"
        exit 77
    fi
    GPU=$(nvidia-smi -L | head -1)
    summary INFO device "$GPU"
    BIN=$BUILD/bin/kvc_gpu_test
    if [ ! -x "$BIN" ]; then
        { cmake -S "$SRC" -B "$BUILD" -DPDPROXY_WITH_CUDA=ON -DCMAKE_BUILD_TYPE=Release &&
            cmake --build "$BUILD" -j"$(nproc)" --target kvc_gpu_test; } >"$WORK/build.log" 2>&1
    fi
    if [ ! -x "$BIN" ]; then
        summary FAIL build "a GPU is present but $BIN is missing and could not be built (CUDA toolkit and headers needed); build log:"
        tail_of "$WORK/build.log"
        exit 1
    fi
    summary PASS build "$BIN"
    "$BIN" probe-device >"$WORK/probe.out" 2>&1
    if [ $? -ne 0 ]; then
        summary FAIL device "nvidia-smi sees a GPU but the CUDA runtime does not: $(cat "$WORK/probe.out")"
        exit 1
    fi
    NGPU=$(nvidia-smi -L | grep -c '^GPU ')
    FREE_MIB=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 | head -1)
    BLK=$(blocks_for "${FREE_MIB:-0}")
    if [ "$BLK" -lt $MIN_BLK ]; then
        summary FAIL memory "$(too_little "$FREE_MIB")"
        exit 1
    fi
    REG=64 KB=32 FETCH=$((BLK / 4))
    if [ $FETCH -gt 8192 ]; then FETCH=8192; fi
    summary INFO sizes "64 regions x $BLK blocks x 32 KiB per process ($((64 * BLK / 32)) MiB), $FETCH blocks fetched; GPU 0 had $FREE_MIB MiB free"
    SMALL=(--regions 8 --blocks 1024 --block-kb 32 --fetch 256)
    VMM=(--vmm) # 20 MiB physical allocations, as PyTorch's large pool maps them
    TIMEOUT=240
else
    BIN=$BUILD/bin/kvc_gpu_test_standin
    if [ ! -x "$BIN" ]; then
        summary FAIL build "$BIN not built"
        exit 1
    fi
    summary INFO device "CUDA stand-in (tests/cudasim), 2 simulated devices, no GPU"
    NGPU=2
    REG=4 BLK=256 KB=4 FETCH=128
    SMALL=(--regions 2 --blocks 128 --block-kb 4 --fetch 64)
    VMM=(--vmm --vmm-piece-kb 192) # 1 MiB regions across 192 KiB allocations
    TIMEOUT=120
fi
FULL=(--regions $REG --blocks $BLK --block-kb $KB --fetch $FETCH)

# UCX's transports: CUDA ones decide whether the direct path can run here.
# tls UCX_INFO: the transports that ucx_info lists.
tls() { "$@" -d 2>/dev/null | sed -n 's/^#[[:space:]]*Transport:[[:space:]]*//p' | sort -u | tr '\n' ' '; }
cuda_tls() { echo "$1" | tr ' ' '\n' | grep -E '^(cuda_ipc|cuda_copy|gdr_copy|rc_.*|dc_.*)$' | tr '\n' ' '; }
TLS=$(tls ucx_info)
CUDA_TLS=$(cuda_tls "$TLS")
summary INFO ucx "$(ucx_info -v 2>/dev/null | sed -n 's/^# *Library version: *//p' | head -1) transports: ${TLS:-unknown (no ucx_info)}; CUDA-capable: ${CUDA_TLS:-none}"
# DIRECT_ENV: the environment the direct path's checks run in.  The system's
# UCX when it has cuda_copy; otherwise KVC_GPU_UCX may name the prefix of a
# UCX built with CUDA transports (same soname: the checks load it through
# LD_LIBRARY_PATH; docs/gpu.md says how to build one).
HAVE_CUDA_UCX=0 DIRECT_ENV=""
if [ $STANDIN = 0 ] && echo "$TLS" | grep -qw cuda_copy; then HAVE_CUDA_UCX=1; fi
if [ $STANDIN = 0 ] && [ $HAVE_CUDA_UCX = 0 ] && [ -n "${KVC_GPU_UCX:-}" ]; then
    lib=$KVC_GPU_UCX/lib
    XTLS=$(LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} tls "$KVC_GPU_UCX/bin/ucx_info")
    if echo "$XTLS" | grep -qw cuda_copy; then
        HAVE_CUDA_UCX=1
        DIRECT_ENV="LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        summary INFO ucx-direct "$KVC_GPU_UCX: $(LD_LIBRARY_PATH=$lib "$KVC_GPU_UCX/bin/ucx_info" -v | sed -n 's/^# *Library version: *//p' | head -1) transports: $XTLS; CUDA-capable: $(cuda_tls "$XTLS")"
    else
        summary FAIL ucx-direct "KVC_GPU_UCX=$KVC_GPU_UCX has no cuda_copy transport (transports: ${XTLS:-none})"
    fi
fi

# ------------------------------------------------------------- baselines --
D2D=0 H2D=0
if "$BIN" baseline "${FULL[@]}" >"$WORK/base.out" 2>"$WORK/base.err"; then
    D2D=$(val "$WORK/base.out" d2d_gbps)
    H2D=$(val "$WORK/base.out" h2d_pinned_gbps)
    summary PASS baseline "cudaMemcpy 2 MiB copies: device-to-device $D2D GB/s, pinned host-to-device $H2D GB/s"
else
    summary FAIL baseline "$(tail -1 "$WORK/base.err")"
fi

# The connector's own staging copies (pool slots -> device, the fetch's
# blocks in pushed-message chunks): target >= 70 % of pinned host-to-device
# cudaMemcpy.
if "$BIN" staging "${FULL[@]}" >"$WORK/stg.out" 2>"$WORK/stg.err"; then
    S=$(val "$WORK/stg.out" h2d_gbps)
    C=$(val "$WORK/stg.out" copies_per_region)
    if [ $STANDIN = 1 ]; then
        summary PASS staging-copy "$S GB/s in $C copy call(s) per region (stand-in: no target)"
    elif ratio_ok "$S" "$H2D" 0.70; then
        summary PASS staging-copy "$S GB/s = $(pct "$S" "$H2D") % of pinned H2D ($C copy calls per region; target 70 %)"
    else
        summary FAIL staging-copy "$S GB/s = $(pct "$S" "$H2D") % of pinned H2D, below the 70 % target"
    fi
else
    summary FAIL staging-copy "$(tail -1 "$WORK/stg.err")"
fi

# ------------------------------------------------------- two processes --
# pair NAME ENV CONSUMER_WRAPPER -- producer/consumer options...
# Runs the producer in the background, the consumer in the foreground; sets
# CRC and PRC and leaves $WORK/NAME.{c,p}.{out,err}.  PX and CX (arrays):
# options for the producer or the consumer only.  C2=1: a second consumer
# with the same options runs beside the first (RC in CRC2, $WORK/NAME.c2.*).
PX=() CX=() C2=0 WANT_STAGED=
pair() {
    local name=$1 envs=$2 wrap=$3
    shift 4
    local json=$WORK/$name.json
    rm -f "$json"
    # In a subshell, which reports the producer's end (a kill) on its own
    # stderr instead of the script's.
    (env $envs timeout $TIMEOUT "$BIN" producer --params "$json" "$@" "${PX[@]}" \
        >"$WORK/$name.p.out" 2>"$WORK/$name.p.err"; exit $?) 2>/dev/null &
    local ppid=$!
    PIDS+=("$ppid")
    local extra=() c2pid=
    case $name in kill*) extra=(--kill "$json.pid") ;; esac
    if [ "$C2" = 1 ]; then
        env $envs timeout $TIMEOUT "$BIN" consumer --params "$json" "$@" "${CX[@]}" \
            >"$WORK/$name.c2.out" 2>"$WORK/$name.c2.err" &
        c2pid=$!
        PIDS+=("$c2pid")
    fi
    env $envs timeout $TIMEOUT $wrap "$BIN" consumer --params "$json" "$@" "${CX[@]}" "${extra[@]}" \
        >"$WORK/$name.c.out" 2>"$WORK/$name.c.err"
    CRC=$?
    CRC2=0
    if [ -n "$c2pid" ]; then
        wait "$c2pid"
        CRC2=$?
    fi
    { wait "$ppid"; } 2>/dev/null
    PRC=$?
}

# pair_done NAME: the pair's fetch completed with every byte right and the
# producer was released; else a FAIL line (and its logs) and status 1.
pair_done() {
    local name=$1 o=$WORK/$1.c.out
    if [ $CRC -ne 0 ] || [ "$(val "$o" outcome)" != done ] || [ "$(val "$o" bad_words)" != 0 ]; then
        summary FAIL "$name" "consumer rc=$CRC producer rc=$PRC $(grep -h '^RESULT' "$o" | head -1)"
        tail_of "$WORK/$name.c.err"
        tail_of "$WORK/$name.p.err"
        return 1
    fi
    if [ $PRC -ne 0 ]; then
        summary FAIL "$name" "bytes right but the producer was not released (rc=$PRC)"
        return 1
    fi
}

fetch_check() { # NAME ENV WANT_MEMORY (staged|direct) -- options
    local name=$1 envs=$2 want=$3
    shift 4
    if ! time_left; then
        summary FAIL "$name" "time budget of $LIMIT s used up before this check"
        return
    fi
    pair "$name" "$envs" "" -- "$@"
    local o=$WORK/$name.c.out
    local g mem path tl
    g=$(val "$o" gbps) mem=$(val "$o" memory) path=$(val "$o" path) tl=$(val "$o" transports)
    pair_done "$name" || return
    if [ "$mem" != "$want" ]; then
        summary FAIL "$name" "expected the $want path, the connector used $mem"
        return
    fi
    local staged
    staged=$(val "$o" staged)
    if [ -n "$WANT_STAGED" ] && [ "$staged" != "$WANT_STAGED" ]; then
        summary FAIL "$name" "expected the staged-$WANT_STAGED variant, the connector used staged-$staged"
        return
    fi
    if [ "$mem" = staged ]; then mem="staged-$staged"; fi
    local text="$(val "$o" blocks) blocks x $(val "$o" regions) regions: every byte right, untouched blocks untouched; $g GB/s in $(val "$o" seconds) s (first fetch $(val "$o" first_fetch_ms) ms), $mem, $path over $tl, UCX $(val "$o" ucx)"
    if [ $STANDIN = 0 ] && [ "$name" = fetch-direct ] && echo "$tl" | grep -q cuda_ipc; then
        if ratio_ok "$g" "$D2D" 0.70; then
            summary PASS "$name" "$text = $(pct "$g" "$D2D") % of D2D (target 70 %)"
        else
            summary FAIL "$name" "$text = $(pct "$g" "$D2D") % of D2D, below the 70 % target"
        fi
    elif [ $STANDIN = 0 ] && [ "$name" = fetch-staged-shm ]; then
        if ratio_ok "$g" "$H2D" 0.70; then
            summary PASS "$name" "$text = $(pct "$g" "$H2D") % of pinned H2D end to end (target 70 %)"
        else
            summary FAIL "$name" "$text = $(pct "$g" "$H2D") % of pinned H2D end to end, below the 70 % target"
        fi
    elif [[ $name == fetch-staged-* ]]; then
        # The wire variant is bounded by the transport (tcp or sm rendezvous
        # here), not by the copies: reported against pinned H2D, no target.
        summary PASS "$name" "$text = $(pct "$g" "$H2D") % of pinned H2D end to end"
    else
        summary PASS "$name" "$text"
    fi
}

# Staged, both variants side by side: on one host the consumer copies from
# the producer's pool mapped into it (staged-shm, the default here), or
# every chunk crosses the wire into its own pool (staged-wire, forced by
# KVC_STAGED_WIRE=1 on the consumer, what another host gets).
WANT_STAGED=shm fetch_check fetch-staged-shm "KVC_CUDA_STAGED=1 KVC_IPC=0" staged -- "${FULL[@]}"
WANT_STAGED=wire fetch_check fetch-staged-wire "KVC_CUDA_STAGED=1 KVC_STAGED_WIRE=1 KVC_IPC=0" staged -- "${FULL[@]}"
# KVC_GPU_WINDOWS="2 8 16": staged-shm again with those windows (slots per
# job, KVC_STAGE_WINDOW; 4 by default), to tune it on this device.
for w in ${KVC_GPU_WINDOWS:-}; do
    WANT_STAGED=shm fetch_check "fetch-staged-shm-w$w" "KVC_CUDA_STAGED=1 KVC_STAGE_WINDOW=$w KVC_IPC=0" staged -- "${FULL[@]}"
done
if [ $HAVE_CUDA_UCX = 1 ]; then
    fetch_check fetch-direct "$DIRECT_ENV KVC_IPC=0" direct -- "${FULL[@]}"
else
    summary SKIP fetch-direct "UCX here has no CUDA transports (cuda_copy/cuda_ipc): the direct path cannot run; staged only"
fi
# A 4k-token prompt's blocks, as an engine fetches them for one request:
# 256 blocks of 16 tokens in each of the 64 regions (512 MiB at full size).
PROMPT=(--regions $REG --blocks $BLK --block-kb $KB --fetch $((BLK / 2 < 256 ? BLK / 2 : 256)))
fetch_check prompt4k-staged "KVC_CUDA_STAGED=1 KVC_IPC=0" staged -- "${PROMPT[@]}"
if [ $HAVE_CUDA_UCX = 1 ]; then fetch_check prompt4k-direct "$DIRECT_ENV KVC_IPC=0" direct -- "${PROMPT[@]}"; fi

# Stream-order probe: the producer's blocks are written by copies queued
# behind a 300 ms stream operation and published at once with that stream;
# the consumer reads them through its own stream after FETCH_DONE.
fetch_check probe-staged "KVC_CUDA_STAGED=1 KVC_IPC=0" staged -- "${SMALL[@]}" --probe
if [ $HAVE_CUDA_UCX = 1 ]; then fetch_check probe-direct "$DIRECT_ENV KVC_IPC=0" direct -- "${SMALL[@]}" --probe; fi
# The same on the legacy default stream: handle 0 with the stream field set
# (torch.cuda.current_stream().cuda_stream unless a side stream is used).
fetch_check probe-default-staged "KVC_CUDA_STAGED=1 KVC_IPC=0" staged -- "${SMALL[@]}" --probe --default-stream
if [ $HAVE_CUDA_UCX = 1 ]; then
    fetch_check probe-default-direct "$DIRECT_ENV KVC_IPC=0" direct -- "${SMALL[@]}" --probe --default-stream
fi

# Two GPUs: the producer on GPU 0, the consumer on GPU 1 (cuda_ipc where
# UCX has it; the stand-in's two devices, staged, otherwise).
if [ "$NGPU" -ge 2 ]; then
    PX=(--device 0) CX=(--device 1)
    if [ $HAVE_CUDA_UCX = 1 ]; then
        fetch_check two-gpus "$DIRECT_ENV KVC_IPC=0" direct -- "${FULL[@]}"
        if ! grep -q 'transports=[^ ]*cuda_ipc' "$WORK/two-gpus.c.out" 2>/dev/null; then
            summary FAIL two-gpus-ipc "two GPUs but the fetch did not go over cuda_ipc: $(grep -h '^RESULT' "$WORK/two-gpus.c.out" | head -1)"
        fi
    else
        fetch_check two-gpus "KVC_CUDA_STAGED=1 KVC_IPC=0" staged -- "${FULL[@]}"
    fi
    PX=() CX=()
else
    summary SKIP two-gpus "one GPU: nothing to check over cuda_ipc"
fi

# fail_check NAME ENV -- options: the consumer's fetch must FAIL (cleanly,
# in time), and the producer must end as told (expired or aborted).
fail_check() {
    local name=$1 envs=$2
    shift 3
    if ! time_left; then
        summary FAIL "$name" "time budget of $LIMIT s used up before this check"
        return
    fi
    pair "$name" "$envs" "" -- "$@"
    local o=$WORK/$name.c.out
    if [ $CRC -eq 0 ] && [ "$(val "$o" outcome)" = failed ] && [ $PRC -eq 0 ]; then
        summary PASS "$name" "FETCH_FAILED $(val "$o" status) after $(val "$o" seconds) s, as it must"
    else
        summary FAIL "$name" "consumer rc=$CRC producer rc=$PRC: $(grep -h '^RESULT' "$o" | head -1)"
        tail_of "$WORK/$name.c.err"
        tail_of "$WORK/$name.p.err"
    fi
}

# A fetch after the publication expired, and one after the engine aborted
# the request (kvc_unpublish): nothing may be read from blocks the engine
# may have reused.
for mem in staged direct; do
    if [ $mem = direct ] && [ $HAVE_CUDA_UCX = 0 ]; then continue; fi
    envs="$DIRECT_ENV KVC_IPC=0"
    if [ $mem = staged ]; then envs="KVC_CUDA_STAGED=1 KVC_IPC=0"; fi
    PX=(--expiry-ms 500) CX=(--delay-ms 1500 --expect failed)
    fail_check "expired-$mem" "$envs" -- "${SMALL[@]}"
    PX=(--unpublish-ms 300) CX=(--delay-ms 1500 --expect failed)
    fail_check "aborted-$mem" "$envs" -- "${SMALL[@]}"
done
PX=() CX=()

# ------------------------------------------------------------ CUDA IPC --
# Same-node CUDA IPC (connector/ipc.c): the consumer maps the producer's
# device memory (cudaIpcOpenMemHandle, once per producer) and copies device
# to device on its own stream between the producer's HOLD and UNHOLD.
# Target on a GPU: 70 % of cudaMemcpyAsync device-to-device of the same runs
# in the consumer right after the fetch (memcpy_gbps, same run); also
# reported: the baseline's D2D and the first-fetch latency (the warm-up
# fetch of one block: handshake, IPC open, one read).
ipc_check() { # NAME ENV -- options
    local name=$1 envs=$2
    shift 3
    if ! time_left; then
        summary FAIL "$name" "time budget of $LIMIT s used up before this check"
        return
    fi
    pair "$name" "KVC_IPC=1 KVC_LOG_LEVEL=info $envs" "" -- "$@"
    local o=$WORK/$name.c.out
    local g path mc first
    g=$(val "$o" gbps) path=$(val "$o" path) mc=$(val "$o" memcpy_gbps)
    first=$(val "$o" first_fetch_ms)
    pair_done "$name" || return
    if [ "$path" != ipc ]; then
        summary FAIL "$name" "expected the CUDA IPC path, the connector used $path: $(grep -h 'CUDA IPC' "$WORK/$name.c.err" "$WORK/$name.p.err" | tail -2 | tr '\n' ' ')"
        return
    fi
    local text="$(val "$o" blocks) blocks x $(val "$o" regions) regions: every byte right, untouched blocks untouched; $g GB/s over CUDA IPC; first fetch $first ms (handshake + IPC open + one block)"
    if [ "${name%-vmm}" != "$name" ]; then
        # VMM memory: the producer's allocations came as fds over its socket.
        local vm
        vm=$(grep -ho 'CUDA IPC with engine [^ ]*: [0-9]* allocations mapped ([0-9]* VMM pieces[^)]*) in [0-9.]* ms' "$WORK/$name.c.err" | tail -1)
        if [ "$(val "$o" alloc)" != vmm ] || [ -z "$vm" ]; then
            summary FAIL "$name" "expected VMM memory opened from the producer's fds: alloc=$(val "$o" alloc); $(grep -h 'CUDA IPC' "$WORK/$name.c.err" "$WORK/$name.p.err" | tail -2 | tr '\n' ' ')"
            return
        fi
        text="$text; ${vm#CUDA IPC with engine * }"
    fi
    if [ $STANDIN = 0 ] && { [ "$name" = fetch-ipc ] || [ "$name" = fetch-ipc-vmm ]; }; then
        if ratio_ok "$g" "$mc" 0.70; then
            summary PASS "$name" "$text = $(pct "$g" "$mc") % of D2D cudaMemcpy of the same runs ($mc GB/s; baseline D2D $D2D GB/s; target 70 %)"
        else
            summary FAIL "$name" "$text = $(pct "$g" "$mc") % of D2D cudaMemcpy of the same runs ($mc GB/s; baseline D2D $D2D GB/s), below the 70 % target"
        fi
    else
        summary PASS "$name" "$text; $(pct "$g" "$mc") % of a memcpy of the same runs ($mc GB/s; stand-in: no target)"
    fi
}

ipc_check fetch-ipc "" -- "${FULL[@]}"
# The producer's regions mapped with the VMM API (cuMemCreate, cuMemMap) in
# 20 MiB physical allocations, as PyTorch's expandable segments map them:
# cudaIpcGetMemHandle refuses that memory; the allocations travel as POSIX
# fds over the producer's Unix socket and are mapped again in the consumer.
ipc_check fetch-ipc-vmm "" -- "${FULL[@]}" "${VMM[@]}"
ipc_check prompt4k-ipc "" -- "${PROMPT[@]}"
# Stream order across processes: the producer's blocks are written behind a
# 300 ms stream operation and published at once; the consumer's copies must
# read what that operation's queue wrote (the producer completes the capture
# before any consumer can read over IPC).
ipc_check probe-ipc "" -- "${SMALL[@]}" --probe
if [ "$NGPU" -ge 2 ]; then
    PX=(--device 0) CX=(--device 1)
    ipc_check two-gpus-ipc "" -- "${SMALL[@]}"
    PX=() CX=()
else
    summary SKIP two-gpus-ipc "one GPU: CUDA IPC between two GPUs not checked"
fi
# A read after expiry or after the engine aborted the request: DENIED at
# the producer's HOLD, nothing copied from blocks the engine may reuse.
PX=(--expiry-ms 500) CX=(--delay-ms 1500 --expect failed)
fail_check expired-ipc "KVC_IPC=1" -- "${SMALL[@]}"
PX=(--unpublish-ms 300) CX=(--delay-ms 1500 --expect failed)
fail_check aborted-ipc "KVC_IPC=1" -- "${SMALL[@]}"
PX=() CX=()

# Heterogeneous TP: two decode ranks (tp 2) fetch the blocks of one prefill
# rank; the producer is released only after both notified.
if time_left; then
    C2=1 CX=(--tp 2)
    pair hetero-tp "KVC_CUDA_STAGED=1 KVC_IPC=0" "" -- "${SMALL[@]}"
    C2=0 CX=()
    if [ $CRC -eq 0 ] && [ $CRC2 -eq 0 ] && [ $PRC -eq 0 ] &&
        [ "$(val "$WORK/hetero-tp.c.out" bad_words)" = 0 ] &&
        [ "$(val "$WORK/hetero-tp.c2.out" bad_words)" = 0 ]; then
        summary PASS hetero-tp "two tp-2 consumers, every byte right in both, producer released after both"
    else
        summary FAIL hetero-tp "consumers rc=$CRC/$CRC2 producer rc=$PRC: $(grep -h '^RESULT' "$WORK/hetero-tp.c.out" "$WORK/hetero-tp.c2.out" | head -2 | tr '\n' ' ')"
        tail_of "$WORK/hetero-tp.p.err"
    fi
else
    summary FAIL hetero-tp "time budget of $LIMIT s used up before this check"
fi

# kill_check CHECK NAME ENV -- options: the producer is killed (SIGKILL) as
# soon as the handshake is done; the consumer must report a clear failure in
# time, never hang or crash.  A fetch that completed first proves nothing.
kill_check() {
    local check=$1 name=$2 envs=$3
    shift 4
    if ! time_left; then
        summary FAIL "$check" "time budget of $LIMIT s used up before this check"
        return
    fi
    pair "$name" "$envs" "" -- "$@"
    local o=$WORK/$name.c.out out
    out=$(val "$o" outcome)
    if [ $CRC -eq 0 ] && [ "$out" = failed ]; then
        summary PASS "$check" "FETCH_FAILED $(val "$o" status) after $(val "$o" seconds) s"
    elif [ "$out" = done ]; then
        summary FAIL "$check" "the fetch completed before the kill took effect: the case was not exercised (make the fetch larger)"
    else
        summary FAIL "$check" "consumer rc=$CRC $(grep -h '^RESULT' "$o" | head -1)"
        tail_of "$WORK/$name.c.err"
    fi
}

# Push, so that the producer process has to be alive to serve the data.
kill_check kill-producer kill "KVC_CUDA_STAGED=1 KVC_PROTO=push KVC_IPC=0" -- "${FULL[@]}"

# The same over shared memory only: UCX 1.13's sm transports have no
# peer-failure handling, so the endpoint is made without it; the side
# channel, kept open, closes with the dead producer and fails the fetch at
# once (PEER_FAILED well within the 3 s data timeout, which would otherwise
# be the only catch: TIMED_OUT fails the check).  The kill races the PULL
# send: three tries on the stand-in (one on a GPU, whose full sizes take
# long to set up), every one must fail cleanly and promptly.
if time_left; then
    CX=(--xfer-timeout-ms 3000)
    tries=3
    if [ $STANDIN = 0 ]; then tries=1; fi
    for ((try = 1; try <= tries; try++)); do
        pair kill-sm "KVC_CUDA_STAGED=1 KVC_PROTO=push KVC_IPC=0 UCX_TLS=sm,self" "" -- "${FULL[@]}"
        o=$WORK/kill-sm.c.out
        out=$(val "$o" outcome)
        if [ $CRC -ne 0 ] || [ "$out" != failed ] || [ "$(val "$o" status)" != KVC_ERR_PEER_FAILED ]; then break; fi
    done
    CX=()
    if [ $CRC -eq 0 ] && [ "$out" = failed ] && [ "$(val "$o" status)" != KVC_ERR_PEER_FAILED ]; then
        summary FAIL kill-producer-sm "FETCH_FAILED $(val "$o" status) after $(val "$o" seconds) s: only the data timeout caught the dead producer, not its side channel"
    elif [ $CRC -eq 0 ] && [ "$out" = failed ]; then
        summary PASS kill-producer-sm "FETCH_FAILED $(val "$o" status) after $(val "$o" seconds) s (side channel closed)"
    elif [ "$out" = done ]; then
        summary FAIL kill-producer-sm "the fetch completed before the kill took effect: the case was not exercised (make the fetch larger)"
    else
        summary FAIL kill-producer-sm "consumer rc=$CRC $(grep -h '^RESULT' "$o" | head -1)"
        tail_of "$WORK/kill-sm.c.err"
    fi
else
    summary FAIL kill-producer-sm "time budget of $LIMIT s used up before this check"
fi

# Over CUDA IPC: the producer's allocations are mapped in the consumer when
# it dies; the fetch must fail cleanly (no word on the hold can come), and
# closing the mappings of a dead exporter must neither crash nor hang.
kill_check kill-ipc kill-ipc "KVC_IPC=1 KVC_LOG_LEVEL=info" -- "${SMALL[@]}"

# The consumer under compute-sanitizer (memcheck), small sizes.
if [ $STANDIN = 0 ] && command -v compute-sanitizer >/dev/null 2>&1; then
    if time_left; then
        pair sanitizer "KVC_IPC=0" "compute-sanitizer --tool memcheck --error-exitcode 86" -- "${SMALL[@]}"
        if [ $CRC -eq 0 ] && [ "$(val "$WORK/sanitizer.c.out" bad_words)" = 0 ]; then
            summary PASS sanitizer "compute-sanitizer memcheck: no errors in the consumer"
        else
            summary FAIL sanitizer "compute-sanitizer rc=$CRC"
            grep -h -m5 '=========' "$WORK/sanitizer.c.err" "$WORK/sanitizer.c.out" | sed 's/^/     | /'
        fi
    else
        summary FAIL sanitizer "time budget of $LIMIT s used up before this check"
    fi
else
    summary SKIP sanitizer "compute-sanitizer not installed"
fi

# The vLLM plugin (connector/python) on device memory, when a python3 has
# torch with CUDA (/usr/bin/python3 first: Debian's torch is CPU-only, a
# CUDA torch usually lives in a venv named by PDKV_PYTHON).
PLUGIN_PY=""
for py in ${PDKV_PYTHON:-} python3 /usr/bin/python3; do
    if "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        PLUGIN_PY=$py
        break
    fi
done
# The plugin's regions go the direct path where UCX has CUDA transports and
# are staged otherwise; the check is told which (TP 1->2 must be refused on
# the staged path, as documented, and must load on the direct one).
PLUGIN_PATH=staged
if [ $HAVE_CUDA_UCX = 1 ]; then PLUGIN_PATH=direct; fi
if [ $STANDIN = 0 ] && [ -n "$PLUGIN_PY" ]; then
    if time_left; then
        out=$(env $DIRECT_ENV PX_BUILD_DIR=$BUILD PDKV_LIBRARY=$BUILD/connector/libkvconnector.so KVC_SECRET=gpu-check \
              KVC_LOG_LEVEL=error timeout 240 "$PLUGIN_PY" "$SRC/tests/plugin/gpu_plugin_check.py" \
              --path $PLUGIN_PATH 2>&1)
        rc=$?
        if [ $rc -eq 0 ]; then
            summary PASS plugin "$(echo "$out" | grep '^RESULT' | tail -1)"
        else
            summary FAIL plugin "rc=$rc $(echo "$out" | grep '^RESULT' | tail -1)"
            echo "$out" | tail -15 | sed 's/^/     | /'
        fi
    else
        summary FAIL plugin "time budget of $LIMIT s used up before this check"
    fi
else
    summary SKIP plugin "no python3 with torch and CUDA (PDKV_PYTHON names one)"
fi

echo "---- $((SECONDS - START)) s, $FAILS failed"
[ $FAILS -eq 0 ]
