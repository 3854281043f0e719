# SPDX-License-Identifier: Apache-2.0
# The vLLM plugin (connector/python, package pdkv): PdkvConnector driven as
# vLLM's scheduler and model runner drive it, between engine processes with
# torch CPU tensors as KV caches, and behind pdproxy.  The scripts need torch:
# they re-run themselves under /usr/bin/python3 (Debian's python3-torch) when
# the python3 found here lacks it, and skip (77) when neither has it.
# Under -DSANITIZE the interpreter loads the sanitized libkvconnector: the
# sanitizer runtimes are preloaded, and leaks of the interpreter and torch
# (not the library's) are suppressed (lsan.supp).
set(PX_PLUGIN_ENV ${PX_TEST_ENV})
if(SANITIZE)
  set(preload "")
  foreach(rt asan ubsan)
    if(SANITIZE MATCHES "address" AND rt STREQUAL "asan" OR
       SANITIZE MATCHES "undefined" AND rt STREQUAL "ubsan")
      execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=lib${rt}.so
                      OUTPUT_VARIABLE so OUTPUT_STRIP_TRAILING_WHITESPACE)
      list(APPEND preload ${so})
    endif()
  endforeach()
  string(REPLACE ";" ":" preload "${preload}")
  list(APPEND PX_PLUGIN_ENV "LD_PRELOAD=${preload}"
       "LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/plugin/lsan.supp")
endif()
foreach(t lib drift flow layouts faults proxy)
  add_test(NAME plugin.${t}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plugin/test_plugin_${t}.py)
  set_tests_properties(plugin.${t} PROPERTIES LABELS plugin TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${PX_PLUGIN_ENV}")
endforeach()
