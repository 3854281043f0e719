#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the fuzz targets (clang, ASan + UBSan) in build-fuzz, replays every
# seed corpus, then fuzzes each target for a while.
#
#   tests/fuzz/run.sh [seconds]     seconds per target (default: $FUZZ_SECONDS, else 60)
#
# Environment: FUZZ_BUILD_DIR (default build-fuzz), FUZZ_JOBS (targets fuzzed
# at once, default: CPU count), FUZZ_TARGETS (space-separated names such as
# "http json"; default: every fuzz_* target built).
#
# Each target fuzzes a working corpus kept in $FUZZ_BUILD_DIR/fuzz-corpus/<t>
# (the seed corpus tests/fuzz/corpus/<t> is merged into it first), with
# tests/fuzz/<t>.dict when there is one. A crash, leak, hang or broken
# invariant is saved under $FUZZ_BUILD_DIR/fuzz-artifacts/<t>/ and makes the
# script exit 1; the log tells how to replay it. Executions per target come
# from libFuzzer's final stats.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
secs=${1:-${FUZZ_SECONDS:-60}}
bdir=${FUZZ_BUILD_DIR:-build-fuzz}
jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 2)}
case $bdir in /*) ;; *) bdir=$root/$bdir ;; esac

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

echo "=== configure $bdir (clang, BUILD_FUZZERS=ON, address,undefined)"
if [ ! -f "$bdir/CMakeCache.txt" ]; then
    mkdir -p "$bdir"
    cmake -S "$root" -B "$bdir" -DCMAKE_C_COMPILER=clang -DBUILD_FUZZERS=ON \
        -DSANITIZE=address,undefined -DCMAKE_BUILD_TYPE=RelWithDebInfo >"$bdir/configure.log" 2>&1 ||
        { cat "$bdir/configure.log"; exit 1; }
fi
mapfile -t targets < <(cmake --build "$bdir" --target help | sed -n 's/^\.\.\. \(fuzz_[A-Za-z0-9_]*\).*/\1/p' | sort)
if [ ${#targets[@]} -eq 0 ]; then
    echo "no fuzz targets in $bdir (configured without -DBUILD_FUZZERS=ON?)" >&2
    exit 1
fi
echo "=== build ${targets[*]}"
if ! cmake --build "$bdir" -j "$jobs" --target "${targets[@]}" >"$bdir/fuzz-build.log" 2>&1; then
    cat "$bdir/fuzz-build.log"
    exit 1
fi

echo "=== replay seed corpora"
ctest --test-dir "$bdir" -L fuzz --output-on-failure --timeout 300

# A target fuzz_<x> keeps its seeds in tests/fuzz/corpus/<x> (or corpus/fuzz_<x>).
seed_dir() {
    local t=$1 x=${1#fuzz_}
    if [ -d "$root/tests/fuzz/corpus/$x" ]; then echo "$root/tests/fuzz/corpus/$x"
    elif [ -d "$root/tests/fuzz/corpus/$t" ]; then echo "$root/tests/fuzz/corpus/$t"
    fi
}

fuzz_one() {
    local t=$1 x=${1#fuzz_}
    local work=$bdir/fuzz-corpus/$x art=$bdir/fuzz-artifacts/$x/ log=$bdir/fuzz-logs/$x.log
    local seeds dict=()
    seeds=$(seed_dir "$t")
    rm -rf "$art"
    mkdir -p "$work" "$art" "$bdir/fuzz-logs"
    [ -f "$root/tests/fuzz/$x.dict" ] && dict=(-dict="$root/tests/fuzz/$x.dict")
    {
        if [ -n "$seeds" ]; then
            "$bdir/bin/$t" -merge=1 "${dict[@]}" -artifact_prefix="$art" "$work" "$seeds"
        fi
        "$bdir/bin/$t" -max_total_time="$secs" -print_final_stats=1 -timeout=10 \
            -rss_limit_mb=2048 "${dict[@]}" -artifact_prefix="$art" "$work"
    } >"$log" 2>&1
    echo $? >"$bdir/fuzz-logs/$x.rc"
}

if [ -n "${FUZZ_TARGETS:-}" ]; then
    targets=()
    for x in $FUZZ_TARGETS; do targets+=("fuzz_${x#fuzz_}"); done
fi
echo "=== fuzz ${#targets[@]} targets for ${secs}s each, $jobs at a time"
running=0
for t in "${targets[@]}"; do
    if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
    fi
    rm -f "$bdir/fuzz-logs/${t#fuzz_}.rc"
    (set +e; fuzz_one "$t") &
    running=$((running + 1))
done
wait

failed=0
printf '%-18s %12s %10s %8s  %s\n' target executions exec/s corpus result
for t in "${targets[@]}"; do
    x=${t#fuzz_}
    log=$bdir/fuzz-logs/$x.log
    rc=$(cat "$bdir/fuzz-logs/$x.rc" 2>/dev/null || echo missing)
    if [ "$rc" = 0 ]; then result=ok; else result="FAILED (rc $rc)"; failed=1; fi
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    ncorp=$(find "$bdir/fuzz-corpus/$x" -type f | wc -l)
    printf '%-18s %12s %10s %8s  %s\n' "$x" "${execs:-?}" "${rate:-?}" "$ncorp" "$result"
done
if [ "$failed" -ne 0 ]; then
    for t in "${targets[@]}"; do
        x=${t#fuzz_}
        art=$bdir/fuzz-artifacts/$x
        if [ "$(cat "$bdir/fuzz-logs/$x.rc" 2>/dev/null)" != 0 ]; then
            echo "=== $x: $bdir/fuzz-logs/$x.log (tail)"
            tail -n 40 "$bdir/fuzz-logs/$x.log"
            for f in "$art"/*; do
                [ -e "$f" ] && echo "saved input: $f  (replay: $bdir/bin/$t $f)"
            done
        fi
    done
    exit 1
fi
