# SPDX-License-Identifier: Apache-2.0
# pdproxy integration tests (Python 3 stdlib, real processes on 127.0.0.1).
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(area cli flow errors stream conn http check_config)
  px_py_test(proxy_${area} TIMEOUT 180)
endforeach()

# The connector's publication token in kv_transfer_params survives the proxy.
px_py_test(proxy_kvtoken TIMEOUT 180)

# The upstream part of the suite once more with every mock engine behind TLS
# (PX_MOCK_TLS=1: https:// backends, so pdproxy's libcurl transport instead of
# its own http client), so both transports meet the same expectations.
foreach(t proxy_flow proxy_errors proxy_stream hostile_upstream)
  px_py_test(${t}_https SCRIPT test_${t}.py ENV PX_MOCK_TLS=1)
endforeach()
# KV-cache events (issue 24): a ZeroMQ publisher written with the standard
# library (pdharness/kvpub.py) feeds pdproxy's subscriber and index.
px_py_test(kv_events TIMEOUT 120)
px_py_test(kv_replicas TIMEOUT 120)
px_py_test(kv_routing TIMEOUT 120)
# Routing and admission by predicted latency (the latency policy) on engine-sims
# of different speeds and links.
px_py_test(latency_routing TIMEOUT 240)
# Per-backend endpoints (config entries, admin API) with engine-sim publishing.
px_py_test(kv_endpoints TIMEOUT 180)

# The fast path's budget (issue 36): system calls (strace -c) and heap
# allocations per request through both hops. The allocation count preloads
# bench/alloc_count.c, built here as a module; sanitizer builds skip both
# (their runtimes allocate and call the kernel on their own).
if(NOT SANITIZE AND NOT BUILD_FUZZERS)
  add_library(alloc_count MODULE ${CMAKE_SOURCE_DIR}/bench/alloc_count.c)
  set_target_properties(alloc_count PROPERTIES PREFIX "" LIBRARY_OUTPUT_DIRECTORY
                        ${CMAKE_BINARY_DIR}/lib)
endif()
px_py_test(proxy_budget TIMEOUT 180)
