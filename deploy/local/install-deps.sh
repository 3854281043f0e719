#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Installs the Debian packages pdproxy needs to build, test and benchmark.
# Idempotent: returns at once when everything is already installed.
set -euo pipefail

PKGS=(
  build-essential cmake pkg-config git ca-certificates
  libevent-dev libcurl4-openssl-dev libcjson-dev libyaml-dev libssl-dev libucx-dev ucx-utils libcmocka-dev
  python3 curl openssl
  nginx-light wrk
  strace   # tests/integration/test_proxy_budget.py counts system calls per request
  valgrind # tests/integration/test_proxy_budget.py counts instructions per request (callgrind)
  clang libclang-rt-dev
  python3-yaml   # deploy/check.sh parses the rendered Kubernetes manifests
  mkdocs   # the documentation site (mkdocs.yml, docs/): CTest docs.site builds it with --strict
  libzmq3-dev libmsgpack-dev   # KV-cache events from the engines (ZeroMQ + msgpack)
  python3-zmq python3-msgpack   # tests/integration/test_sim_kvevents.py subscribes to them
  python3-torch python3-pip python3-setuptools   # the vLLM plugin's tests: real tensors as KV caches, pip install of the package
  python3-prometheus-client   # the plugin's vllm:pdkv_* metrics, as vLLM's /metrics renders them
  # deploy/check.sh renders them with `kubectl kustomize`: Debian's kubectl,
  # unless one is installed already (its /usr/bin/kubectl would clash).
  # Debian bookworm's (1.20) is too old for the manifests' components and
  # replacements (kubectl 1.22 or later): check.sh says so and fails; install
  # kubectl from Kubernetes' apt repository (pkgs.k8s.io) there.
  $(command -v kubectl >/dev/null 2>&1 || echo kubernetes-client)
)

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install-deps: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
