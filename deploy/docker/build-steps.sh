#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The build steps of deploy/Dockerfile, as one script so that the image build
# and CI (deploy/check.sh, where no Docker engine runs) execute the same
# commands.
#
#   build-steps.sh apt-install PKG...          apt-get install, no recommends, lists removed
#   build-steps.sh build SRC BUILD_DIR PREFIX  configure (CUDA off), build, install stripped
#   build-steps.sh smoke PREFIX                run the installed binaries' --version
#
# JOBS (default: nproc) bounds the build's parallelism.
set -eu

cmd=${1:-}
[ $# -gt 0 ] && shift

case "$cmd" in
apt-install)
    [ $# -gt 0 ] || { echo "build-steps: apt-install: no packages" >&2; exit 2; }
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "$@"
    apt-get clean
    rm -rf /var/lib/apt/lists/*
    ;;
build)
    [ $# -eq 3 ] || { echo "usage: build-steps.sh build SRC BUILD_DIR PREFIX" >&2; exit 2; }
    src=$1 bld=$2 prefix=$3
    jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
    # RelWithDebInfo (-O2) is what every test suite builds; --strip drops the
    # debug info at install time.
    cmake -S "$src" -B "$bld" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        -DPDPROXY_WITH_CUDA=OFF -DBUILD_FUZZERS=OFF -DCMAKE_INSTALL_PREFIX="$prefix"
    cmake --build "$bld" -j "$jobs" --target pdproxy engine-sim
    cmake --install "$bld" --strip
    ;;
smoke)
    [ $# -eq 1 ] || { echo "usage: build-steps.sh smoke PREFIX" >&2; exit 2; }
    for b in pdproxy engine-sim; do
        out=$("$1/bin/$b" --version) || { echo "build-steps: $b --version failed" >&2; exit 1; }
        echo "$out"
        case "$out" in
            "$b "[0-9]*) ;;
            *) echo "build-steps: unexpected '$b --version' output: $out" >&2; exit 1 ;;
        esac
    done
    ;;
*)
    sed -n '2,11p' "$0" >&2
    exit 2
    ;;
esac
