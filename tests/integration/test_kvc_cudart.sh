#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# libkvconnector built with CUDA serves hosts with and without CUDA alike
# (connector/cudart.c loads the CUDA runtime when the first CUDA region is
# registered): the shared library must not need libcudart, export or leave
# undefined any cuda* symbol, and on a host where the runtime cannot be
# loaded it must still load, make an agent and refuse a CUDA region with
# KVC_ERR_NO_DEVICE, naming the library it looked for.
#
#   test_kvc_cudart.sh LIBKVCONNECTOR PROBE WITH_CUDA
set -eu
lib=$1 probe=$2 with_cuda=$3
fail() { echo "test_kvc_cudart: FAIL: $*" >&2; exit 1; }

needed=$(readelf -d "$lib" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | tr '\n' ' ')
echo "NEEDED: $needed"
case " $needed " in *" libcudart"*|*" libcuda."*) fail "$lib needs the CUDA runtime: $needed" ;; esac
exported=$(nm -D --defined-only "$lib" | awk '$3 ~ /^cuda/ {print $3}' | tr '\n' ' ')
[ -z "$exported" ] || fail "$lib exports CUDA runtime names: $exported"
undef=$(nm -D --undefined-only "$lib" | awk '$2 ~ /^cuda/ {print $2}' | tr '\n' ' ')
[ -z "$undef" ] || fail "$lib leaves CUDA runtime names undefined: $undef"

# No runtime to load: the region is refused, the reason names the library.
out=$(KVC_CUDART_LIBRARY=/nonexistent/libcudart.so KVC_LOG_LEVEL=error UCX_TLS=tcp,self \
      UCX_WARN_UNUSED_ENV_VARS=n timeout 30 "$probe" 2>&1) || fail "probe failed: $out"
echo "$out" | sed 's/^/   /'
if [ "$with_cuda" = 1 ]; then
    echo "$out" | grep -q "register CUDA region: KVC_ERR_NO_DEVICE" ||
        fail "a CUDA region without a runtime was not refused with KVC_ERR_NO_DEVICE: $out"
    echo "$out" | grep -q "/nonexistent/libcudart.so" ||
        fail "the refusal does not name the CUDA runtime it tried to load: $out"
else
    echo "$out" | grep -q "register CUDA region: KVC_ERR_UNSUPPORTED" ||
        fail "a build without CUDA did not refuse the CUDA region with KVC_ERR_UNSUPPORTED: $out"
fi
echo "test_kvc_cudart: passed"
