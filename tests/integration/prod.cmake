# SPDX-License-Identifier: Apache-2.0
# Integration tests of pdproxy's production features (issue 5): health checks,
# failover, routing policies, DNS discovery, limits, drain, endpoints, config,
# stranded prefill blocks. Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name backends health failover policies limits drain endpoints config stranded)
  px_py_test(prod_${name})
endforeach()
# Issue 26: admission control (queue, priorities, fairness, rate limits).
px_py_test(admission)
