#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs what is missing, builds pdproxy twice (optimised, and with
# AddressSanitizer + UndefinedBehaviorSanitizer) and runs every test in both.
#
#   tests/run_all.sh            everything
#   SKIP_SANITIZE=1 tests/run_all.sh   only the optimised build
#   SKIP_FUZZ=1 tests/run_all.sh       no fuzzing step
#   SKIP_TSAN=1 tests/run_all.sh       no ThreadSanitizer run of the connector
#   FUZZ_SECONDS=60 tests/run_all.sh   fuzz each target 60 s (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
jobs=$(nproc 2>/dev/null || echo 2)

deploy/local/install-deps.sh

run_suite() {
    local dir=$1 par=$2 ctest_args=$3; shift 3
    echo "=== configure $dir ($*)"
    cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@" >/dev/null
    echo "=== build $dir"
    if ! cmake --build "$dir" -j "$jobs" >"$dir/build.log" 2>&1; then
        cat "$dir/build.log"
        exit 1
    fi
    echo "=== test $dir"
    # Integration tests mostly wait on sockets and timers (their waits are
    # on what they observe, not fixed sleeps): twice as many as there are
    # cores keep the machine busy, and the sanitized build, whose tests use
    # the CPU more, runs one more than there are cores. On a 2-core machine:
    # 6.4 -> 3.7 minutes (plain, 4 at a time) and ~10 -> 6.9 (sanitized, 3).
    # shellcheck disable=SC2086
    ctest --test-dir "$dir" --output-on-failure --timeout 300 -j "${CTEST_JOBS:-$par}" $ctest_args
}

run_suite build $((jobs * 2)) ""
if [ -z "${SKIP_SANITIZE:-}" ]; then
    export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0:exitcode=23}
    export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
    if [ -f "$root/tests/lsan.supp" ]; then
        export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$root/tests/lsan.supp}
    fi
    # The deploy check builds and inspects packaging, not our C code: once is enough.
    run_suite build-asan $((jobs + 1)) "-LE deploy" -DSANITIZE=address,undefined
fi

# The connector's threaded tests under ThreadSanitizer (build-tsan): its
# progress thread and application threads calling the API at once.
if [ -z "${SKIP_TSAN:-}" ]; then
    tests/tsan/run.sh
fi

# Replays every fuzz corpus, then fuzzes each target under ASan/UBSan
# (clang, build-fuzz); a crash fails the run and its input is kept there.
if [ -z "${SKIP_FUZZ:-}" ]; then
    echo "=== fuzz (${FUZZ_SECONDS:-30}s per target)"
    FUZZ_SECONDS=${FUZZ_SECONDS:-30} tests/fuzz/run.sh
fi
