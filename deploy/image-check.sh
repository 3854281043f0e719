#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds deploy/Dockerfile into a real image with buildah (Docker format, so
# the HEALTHCHECK stays), checks its HEALTHCHECK, OCI labels and kill, and
# runs it: `pdproxy --version`, the HEALTHCHECK script, and engine-sim prefill +
# decode + pdproxy inside the image answering one streamed request on
# loopback.  Prints the image's size and what is in it.
#
#   deploy/image-check.sh [WORK_DIR]        (default: build-image/ at the root)
#
# Needs root, buildah and, without an image registry, debootstrap (Debian
# packages; deploy/local/install-deps.sh does not install them: this is not
# part of the default test run, see deploy/README.md "The image, for real").
# Containers run with `--isolation chroot` (no cgroups or namespaces needed;
# the host's network, so the processes inside listen on free 127.0.0.1 ports).
#
# Base image: BASE_IMAGE=<ref> uses that for both stages (a registry mirror of
# debian:bookworm); else the public debian:bookworm / bookworm-slim when
# `buildah pull` reaches them; else debootstrap makes a bookworm minbase from
# the Debian mirror (DEBIAN_MIRROR, default deb.debian.org) and imports it.
# Storage lives under WORK_DIR (its own root, vfs driver): nothing touches
# the host's container storage.  Every wait is bounded.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/build-image}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tag=localhost/pdproxy:check
t0=$(date +%s)
die() { echo "image-check: FAIL: $*" >&2; exit 1; }
section() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }

[ "$(id -u)" = 0 ] || die "needs root (buildah with its own storage root)"
command -v buildah >/dev/null || die "buildah not found (apt-get install buildah)"
mkdir -p "$work"
bh() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }

ctr=
cleanup() {
    [ -n "$ctr" ] && bh rm "$ctr" >/dev/null 2>&1 || true
}
trap cleanup EXIT

section "base image"
if [ -n "${BASE_IMAGE:-}" ]; then
    build_base=$BASE_IMAGE runtime_base=$BASE_IMAGE
    bh pull -q "$BASE_IMAGE" >/dev/null || die "cannot pull BASE_IMAGE=$BASE_IMAGE"
elif timeout 60 buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs \
        pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1 &&
     timeout 120 buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs \
        pull -q docker.io/library/debian:bookworm >/dev/null 2>&1; then
    build_base=docker.io/library/debian:bookworm runtime_base=docker.io/library/debian:bookworm-slim
    echo "   public debian:bookworm and bookworm-slim"
else
    command -v debootstrap >/dev/null || die "no registry reachable and no debootstrap (apt-get install debootstrap)"
    build_base=localhost/debian-bootstrap:bookworm runtime_base=$build_base
    if ! bh inspect --type image "$build_base" >/dev/null 2>&1; then
        echo "   no registry: debootstrap --variant=minbase bookworm from $mirror"
        if [ ! -f "$work/rootfs.done" ]; then
            rm -rf "$work/rootfs"
            timeout 900 debootstrap --variant=minbase bookworm "$work/rootfs" "$mirror" \
                >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; die "debootstrap failed"; }
            touch "$work/rootfs.done"
        fi
        # apt inside the image fetches from the same mirror.
        echo "deb $mirror bookworm main" >"$work/rootfs/etc/apt/sources.list"
        rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"*
        base=$(bh from scratch)
        mnt=$(bh mount "$base")
        tar -C "$work/rootfs" -cf - . | tar -C "$mnt" -xf -
        bh umount "$base" >/dev/null
        bh config --cmd /bin/bash "$base"
        bh commit -q "$base" "$build_base" >/dev/null
        bh rm "$base" >/dev/null
        rm -rf "$work/rootfs" "$work/rootfs.done"
    fi
    echo "   $build_base ($(bh images --format '{{.Size}}' "$build_base" | head -1))"
fi

section "buildah bud --format docker --isolation chroot -f deploy/Dockerfile"
# Docker format: the OCI image format has no HEALTHCHECK (buildah drops it).
version=$(sed -n 's/^project(pdproxy VERSION \([0-9.]*\).*/\1/p' "$root/CMakeLists.txt")
revision=$(git -C "$root" rev-parse HEAD 2>/dev/null || echo unknown)
source_url=$(git -C "$root" remote get-url origin 2>/dev/null || true)
case "$source_url" in https://*) ;; *) source_url=https://example.com/pdproxy ;; esac
if ! timeout 1200 env JOBS="${JOBS:-2}" buildah --root "$work/storage" --runroot "$work/run" \
        --storage-driver vfs bud --format docker --isolation chroot --layers=false \
        --build-arg BUILD_BASE="$build_base" --build-arg RUNTIME_BASE="$runtime_base" \
        --build-arg VERSION="$version" --build-arg REVISION="$revision" \
        --build-arg SOURCE_URL="$source_url" \
        -f "$root/deploy/Dockerfile" -t "$tag" "$root" >"$work/bud.log" 2>&1; then
    tail -40 "$work/bud.log" >&2; die "image build failed (log: $work/bud.log)"
fi
echo "   built $tag"

section "run inside the image"
ctr=$(bh from "$tag")
brun() { timeout 60 buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs \
    run --isolation chroot "$@"; }
user=$(bh inspect --format '{{.OCIv1.Config.User}}' "$ctr")
[ "$user" = "10001:10001" ] || die "image user is '$user', want 10001:10001"
# The configuration the image carries: the HEALTHCHECK (lost in OCI format)
# and the OCI labels.
hc=$(bh inspect --type image --format '{{if .Docker.Config.Healthcheck}}{{.Docker.Config.Healthcheck.Test}}{{end}}' "$tag")
case "$hc" in *pdproxy-healthcheck*) echo "   HEALTHCHECK: $hc" ;; *) die "the image has no HEALTHCHECK (got '$hc')" ;; esac
for l in source version revision licenses; do
    v=$(bh inspect --type image --format "{{index .OCIv1.Config.Labels \"org.opencontainers.image.$l\"}}" "$tag")
    [ -n "$v" ] || die "label org.opencontainers.image.$l missing"
    echo "   org.opencontainers.image.$l=$v"
done
[ "$(bh inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.version"}}' "$tag")" = "$version" ] ||
    die "org.opencontainers.image.version is not $version"
[ "$(bh inspect --type image --format '{{index .OCIv1.Config.Labels "org.opencontainers.image.licenses"}}' "$tag")" = Apache-2.0 ] ||
    die "org.opencontainers.image.licenses is not Apache-2.0"
v=$(brun "$ctr" -- pdproxy --version) || die "pdproxy --version failed in the image"
echo "   pdproxy --version: $v"
case "$v" in "pdproxy "[0-9]*) ;; *) die "unexpected pdproxy --version: $v" ;; esac
v=$(brun "$ctr" -- engine-sim --version) || die "engine-sim --version failed in the image"
echo "   engine-sim --version: $v"
# `kubectl exec POD -- kill -HUP 1` (the documented reload) execs /bin/kill.
[ "$(brun "$ctr" -- kill -l HUP)" = 1 ] || die "no kill in the image (kubectl exec ... -- kill -HUP 1)"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
P=$(free_port); D=$(free_port); X=$(free_port); K=$(free_port)
# One script inside the image (as its user, uid 10001): the P/D pair and
# pdproxy on loopback, readiness polled, the HEALTHCHECK script against the
# live proxy and against a closed port, one streamed request.
cat >"$work/inside.sh" <<'SH'
set -eu
P=$1 D=$2 X=$3 K=$4
export UCX_TLS=tcp,self
engine-sim --role prefill --port "$P" --kv-port "$K" --layers 2 --block-bytes 4096 \
    --num-blocks 256 --log-level warn & p1=$!
engine-sim --role decode --port "$D" --layers 2 --block-bytes 4096 --num-blocks 256 \
    --log-level warn & p2=$!
PDPROXY_HOST=127.0.0.1 pdproxy --port "$X" --threads 1 --log-level warn \
    --prefill "http://127.0.0.1:$P" --decode "http://127.0.0.1:$D" --drain-delay 0 & p3=$!
trap 'kill $p1 $p2 $p3 2>/dev/null || true; wait 2>/dev/null || true' EXIT
ok=0
for i in $(seq 1 200); do
    if curl -sf -o /dev/null --max-time 1 "http://127.0.0.1:$X/ready"; then ok=1; break; fi
    sleep 0.05
done
[ "$ok" = 1 ] || { echo "pdproxy never became ready" >&2; exit 1; }
HEALTHCHECK_PORT=$X pdproxy-healthcheck || { echo "healthcheck failed on a live pdproxy" >&2; exit 1; }
if HEALTHCHECK_PORT=1 pdproxy-healthcheck 2>/dev/null; then echo "healthcheck passed on a closed port" >&2; exit 1; fi
echo "healthcheck: healthy on :$X, unhealthy on a closed port"
out=$(curl -sfN --max-time 20 "http://127.0.0.1:$X/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model":"sim-model","prompt":"Hello from inside the image","max_tokens":8,"stream":true}')
echo "$out" | grep -q '^data: \[DONE\]' || { echo "no [DONE] in: $out" >&2; exit 1; }
echo "streamed: $(echo "$out" | grep -c '^data: {') events, then [DONE]"
SH
bh copy --chown 10001:10001 "$ctr" "$work/inside.sh" /tmp/inside.sh >/dev/null
brun "$ctr" -- sh /tmp/inside.sh "$P" "$D" "$X" "$K" | sed 's/^/   /' ||
    die "P/D pair + pdproxy inside the image failed"

section "what is in it"
size=$(bh images --format '{{.Size}}' "$tag" | head -1)
echo "   image $tag: $size (base $runtime_base: $(bh images --format '{{.Size}}' "$runtime_base" | head -1))"
brun "$ctr" -- sh -c 'ls -l /usr/local/bin; echo "$(dpkg-query -W | wc -l) Debian packages"; \
    du -sh /usr/lib/x86_64-linux-gnu/ucx 2>/dev/null | sed "s/^/UCX transport modules: /"' | sed 's/^/   /'
section "image-check: all passed"
