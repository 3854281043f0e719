# SPDX-License-Identifier: Apache-2.0
# Hardening tests of pdproxy (issue 7): hostile clients (item 2) and upstream
# faults (item 3). Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name clients upstream)
  px_py_test(hostile_${name})
endforeach()

# Issue 18: bounded memory, no self-inflicted outage, every exit cancels.
px_py_test(hold_line)

# Issue 30: path spellings, stray upstream bytes, one header rule, self-loops,
# reloads that empty a pool, control-plane scale.
px_py_test(hold_line3)
# Issue 30's Low items: --reuse-port, the sidecar allowlist and 4xx bodies,
# --decode-idle-timeout.
px_py_test(hold_line3_low)
# Issue 41: fragments, byte-order marks and nested kv_transfer_params.
px_py_test(hold_line4)
