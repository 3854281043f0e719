# SPDX-License-Identifier: Apache-2.0
# End-to-end tests: pdproxy + engine-sim + libkvconnector, real processes on
# 127.0.0.1 with UCX over tcp on loopback.
foreach(t e2e_flow e2e_faults e2e_openai_sdk docs)
  px_py_test(${t} SKIPPABLE)
endforeach()
