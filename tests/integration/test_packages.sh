#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The Debian packages, installed for real: cpack -G DEB in the build
# directory makes pdproxy, libkvconnector and libkvconnector-dev; dpkg -i
# installs them; then the installed pdproxy runs (--version, its packaged
# config, /health on loopback, a SIGTERM drain), its man page renders, its
# systemd unit verifies, and a small C program is built against the installed
# library twice, with pkg-config and with find_package(kvconnector), and runs
# (it creates and destroys an agent).  The packages are purged at the end.
#
# Needs root and dpkg (a throwaway CI machine): exits 77 (skipped) otherwise.
# Runs under a lock, so two builds on one machine do not install at once.
set -eu

bld=${PX_BUILD_DIR:?PX_BUILD_DIR: the build directory}
src=${PX_SOURCE_DIR:?PX_SOURCE_DIR: the source directory}
work=$bld/pkgtest
fail() { echo "test_packages: FAIL: $*" >&2; exit 1; }
skip() { echo "test_packages: skipped: $*"; exit 77; }

[ "$(id -u)" = 0 ] || skip "needs root to dpkg -i"
for t in dpkg cpack cc cmake pkg-config curl flock; do
    command -v "$t" >/dev/null || skip "$t not installed"
done
exec 9>/tmp/pdproxy-packages-test.lock
flock -w 600 9 || fail "another package test holds the lock"

rm -rf "$work"
mkdir -p "$work"
(cd "$bld" && cpack -G DEB -B "$work" --config CPackConfig.cmake) >"$work/cpack.log" 2>&1 ||
    { tail -30 "$work/cpack.log" >&2; fail "cpack -G DEB"; }
pkgs="pdproxy libkvconnector libkvconnector-dev"
for p in $pkgs; do
    set -- "$work"/${p}_*.deb
    [ -f "$1" ] || fail "no $p package in $work"
    echo "$(basename "$1"): $(stat -c %s "$1") bytes"
done

pid=
svcdir=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    if [ -n "$svcdir" ]; then rm -rf "$svcdir"; fi
    dpkg -P libkvconnector-dev libkvconnector pdproxy >/dev/null 2>&1 || true
}
trap cleanup EXIT
dpkg -i "$work"/pdproxy_*.deb "$work"/libkvconnector_*.deb "$work"/libkvconnector-dev_*.deb \
    >"$work/dpkg.log" 2>&1 || { cat "$work/dpkg.log" >&2; fail "dpkg -i"; }
for p in $pkgs; do
    [ "$(dpkg-query -W -f '${Status}' "$p")" = "install ok installed" ] || fail "$p not installed"
done

# --- pdproxy
v=$(/usr/bin/pdproxy --version) || fail "pdproxy --version"
echo "installed: $v"
case "$v" in "pdproxy "[0-9]*) ;; *) fail "unexpected --version: $v" ;; esac
dpkg-query -W -f '${Conffiles}' pdproxy | grep -q /etc/pdproxy/pdproxy.yaml ||
    fail "/etc/pdproxy/pdproxy.yaml is not a conffile"
/usr/bin/pdproxy --config /etc/pdproxy/pdproxy.yaml --print-config >/dev/null ||
    fail "the packaged /etc/pdproxy/pdproxy.yaml does not load"
man=$(zcat /usr/share/man/man1/pdproxy.1.gz | groff -man -Tascii -P-c 2>/dev/null | col -b) ||
    fail "pdproxy(1) does not render"
for want in PDPROXY_PREFILL --decode-policy SIGHUP /etc/pdproxy/pdproxy.yaml; do
    printf '%s' "$man" | grep -q -- "$want" || fail "pdproxy(1) lacks $want"
done
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify /lib/systemd/system/pdproxy.service >"$work/verify.log" 2>&1 ||
        { cat "$work/verify.log" >&2; fail "systemd-analyze verify pdproxy.service"; }
fi
for opt in DynamicUser=yes NoNewPrivileges=yes ProtectSystem=strict CapabilityBoundingSet= \
    'ExecReload=/bin/kill -HUP $MAINPID' 'ExecStart=/usr/bin/pdproxy --config /etc/pdproxy/pdproxy.yaml'; do
    grep -qxF -- "$opt" /lib/systemd/system/pdproxy.service || fail "pdproxy.service lacks $opt"
done
# Secrets under DynamicUser=yes: the unit hands /etc/pdproxy/credentials
# (root's, 0700) to the service with LoadCredential=, and the packaged
# config's api-key-file names the copy in $CREDENTIALS_DIRECTORY.  PID 1 is
# not systemd here, so what systemd does at start is done by hand: the files
# copied into a directory of the service's (unprivileged) user, pdproxy run
# as that user with CREDENTIALS_DIRECTORY set.  The root-only file itself is
# unreadable to that user (the restart loop the old unit fell into).
grep -qxF 'LoadCredential=pdproxy:/etc/pdproxy/credentials' /lib/systemd/system/pdproxy.service ||
    fail "pdproxy.service does not load /etc/pdproxy/credentials with LoadCredential="
[ "$(stat -c '%a %U' /etc/pdproxy/credentials)" = "700 root" ] ||
    fail "/etc/pdproxy/credentials is not root's, mode 0700: $(stat -c '%a %U' /etc/pdproxy/credentials)"
keyline=$(grep -E '^# *api-key-file: ' /etc/pdproxy/pdproxy.yaml | sed 's/^# *//') ||
    fail "the packaged config suggests no api-key-file"
case "$keyline" in *'${CREDENTIALS_DIRECTORY}/pdproxy_api-keys') ;;
    *) fail "the packaged config's api-key-file is not the credential: $keyline" ;; esac
echo "pkgtest-key-0123456789abcdef" >/etc/pdproxy/credentials/api-keys
chmod 0600 /etc/pdproxy/credentials/api-keys
svc_uid=61873
# What the service's user reads lies in a directory of its own under /tmp:
# the build directory may sit below one that user cannot enter (a home
# directory, a private temporary directory).
svcdir=$(mktemp -d /tmp/pdproxy-pkgtest.XXXXXX)
chmod 0755 "$svcdir"
cred=$svcdir/credentials
mkdir -p "$cred"
for f in /etc/pdproxy/credentials/*; do cp "$f" "$cred/pdproxy_$(basename "$f")"; done
chown -R "$svc_uid:$svc_uid" "$cred"; chmod 0500 "$cred"; chmod 0400 "$cred"/*
sed "s|^# *api-key-file: .*|$keyline|" /etc/pdproxy/pdproxy.yaml >"$svcdir/pdproxy-cred.yaml"
chmod 0644 "$svcdir/pdproxy-cred.yaml"
as_service() { setpriv --reuid="$svc_uid" --regid="$svc_uid" --clear-groups "$@"; }
rc=0
as_service /usr/bin/pdproxy --config /etc/pdproxy/pdproxy.yaml --api-key-file \
    /etc/pdproxy/credentials/api-keys --check-config >/dev/null 2>"$work/direct.err" || rc=$?
[ "$rc" = 2 ] && grep -q 'Permission denied' "$work/direct.err" ||
    fail "the root-only key file read directly by the service's user: exit $rc, $(cat "$work/direct.err")"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# setpriv itself in the background (not the shell function: $! would be a
# subshell, and SIGTERM would miss pdproxy), without the lock's descriptor.
setpriv --reuid="$svc_uid" --regid="$svc_uid" --clear-groups env CREDENTIALS_DIRECTORY="$cred" \
    /usr/bin/pdproxy --config "$svcdir/pdproxy-cred.yaml" --port "$port" --drain-delay 0 \
    --health-interval 0 --threads 1 >"$work/cred.log" 2>&1 9>&- &
pid=$!
ok=0
for _ in $(seq 1 100); do
    if curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$port/health"; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
done
[ "$ok" = 1 ] || { cat "$work/cred.log" >&2; fail "pdproxy as the service's user with the credential did not start"; }
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$port/v1/models")
[ "$code" = 401 ] || fail "without the key /v1/models answered $code, not 401"
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 -H 'Authorization: Bearer pkgtest-key-0123456789abcdef' \
    "http://127.0.0.1:$port/v1/models")
[ "$code" != 401 ] || fail "with the credential's key /v1/models still answered 401"
kill -TERM "$pid"; wait "$pid" || true; pid=
rm -f /etc/pdproxy/credentials/api-keys
echo "credentials: LoadCredential=pdproxy:/etc/pdproxy/credentials; the service's user reads the key as \${CREDENTIALS_DIRECTORY}/pdproxy_api-keys (401 without it, $code with it)"

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
/usr/bin/pdproxy --config /etc/pdproxy/pdproxy.yaml --port "$port" --drain-delay 0 \
    --health-interval 0 --threads 1 >"$work/pdproxy.log" 2>&1 9>&- &
pid=$!
ok=0
for _ in $(seq 1 100); do
    if curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$port/health"; then ok=1; break; fi
    sleep 0.05
done
[ "$ok" = 1 ] || { cat "$work/pdproxy.log" >&2; fail "installed pdproxy never answered /health"; }
kill -TERM "$pid"
rc=0
wait "$pid" || rc=$?
pid=
[ "$rc" = 0 ] || { cat "$work/pdproxy.log" >&2; fail "installed pdproxy exited $rc after SIGTERM"; }
echo "installed pdproxy: /health answered on :$port, SIGTERM drained, exit 0"

# --- libkvconnector: a program against the installed library
cat >"$work/prog.c" <<'C'
#include <kvconnector.h>
#include <stdio.h>

int main(void) {
    kvc_agent_params_t p = {.field_mask = KVC_AGENT_FIELD_ENGINE_ID, .engine_id = "pkgtest"};
    kvc_agent_t *a = NULL;
    kvc_status_t st = kvc_agent_create(&p, &a);
    printf("kvc_agent_create: %s\n", kvc_status_str(st));
    kvc_agent_destroy(a);
    return st == KVC_OK ? 0 : 1;
}
C
[ "$(pkg-config --variable=libdir kvconnector)" = "/usr/lib/$(cc -print-multiarch)" ] ||
    fail "kvconnector.pc's libdir is $(pkg-config --variable=libdir kvconnector)"
# shellcheck disable=SC2046
cc -std=c11 -Wall -Werror -o "$work/prog_pc" "$work/prog.c" $(pkg-config --cflags --libs kvconnector) ||
    fail "cc with pkg-config kvconnector"
mkdir -p "$work/cm"
cat >"$work/cm/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.18)
project(pkgtest C)
find_package(kvconnector 0.1 REQUIRED CONFIG)
add_executable(prog_cm ../prog.c)
target_link_libraries(prog_cm PRIVATE kvconnector::kvconnector)
CM
(cmake -S "$work/cm" -B "$work/cm/build" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF &&
    cmake --build "$work/cm/build") >"$work/cm.log" 2>&1 ||
    { tail -30 "$work/cm.log" >&2; fail "find_package(kvconnector)"; }
grep -q "kvconnector_DIR:PATH=/usr/lib/" "$work/cm/build/CMakeCache.txt" ||
    fail "find_package found kvconnector elsewhere: $(grep kvconnector_DIR "$work/cm/build/CMakeCache.txt")"
for prog in "$work/prog_pc" "$work/cm/build/prog_cm"; do
    ldd "$prog" | grep -Eq "libkvconnector.so.0 => (/usr)?/lib/$(cc -print-multiarch)/" ||
        fail "$prog does not load the installed libkvconnector: $(ldd "$prog" | grep kvconnector)"
    out=$(UCX_TLS=tcp,self UCX_WARN_UNUSED_ENV_VARS=n timeout 30 "$prog") ||
        fail "$prog: $out"
    echo "$(basename "$prog"): $out"
done

# --- purge leaves nothing behind
trap - EXIT
rm -rf "$svcdir"
dpkg -P libkvconnector-dev libkvconnector pdproxy >"$work/purge.log" 2>&1 ||
    { cat "$work/purge.log" >&2; fail "dpkg -P"; }
for f in /usr/bin/pdproxy /etc/pdproxy /lib/systemd/system/pdproxy.service \
    /usr/include/kvconnector.h "/usr/lib/$(cc -print-multiarch)/libkvconnector.so.0"; do
    [ ! -e "$f" ] || fail "$f left after dpkg -P"
done
echo "test_packages: all passed"
