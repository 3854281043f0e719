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
foreach(t lib drift flow layouts faults proxy vllm)
  add_test(NAME plugin.${t}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plugin/test_plugin_${t}.py)
  set_tests_properties(plugin.${t} PROPERTIES LABELS plugin TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${PX_PLUGIN_ENV}")
endforeach()
# The GPU check's plugin script (tests/plugin/gpu_plugin_check.py) on CPU
# tensors: every case loads (what --path direct demands); and told the path
# is staged, it must fail when TP 1->2 loads instead of being refused.
add_test(NAME plugin.gpu_check_cpu
         COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plugin/gpu_plugin_check.py
                 --device cpu --path direct)
add_test(NAME plugin.gpu_check_cpu_staged
         COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plugin/gpu_plugin_check.py
                 --device cpu --path staged)
# Under -DSANITIZE without leak checking: these run the engines' torch
# threads inside the interpreter, and LeakSanitizer's tracer crashes at its
# exit ("Tracer caught signal 11"); the library's leaks are checked by the
# tests above and the connector's unit tests.
set(PX_GPU_CHECK_ENV ${PX_PLUGIN_ENV})
if(SANITIZE)
  list(APPEND PX_GPU_CHECK_ENV "ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:exitcode=23")
endif()
set_tests_properties(plugin.gpu_check_cpu plugin.gpu_check_cpu_staged PROPERTIES
                     LABELS plugin TIMEOUT 300 SKIP_RETURN_CODE 77 ENVIRONMENT "${PX_GPU_CHECK_ENV}")
set_tests_properties(plugin.gpu_check_cpu_staged PROPERTIES PASS_REGULAR_EXPRESSION
  "RESULT plugin path=staged cases=3 failed=[1-9][0-9]* refused_as_documented=0 .*tp1to2: request 0 FINISHED_LENGTH_CAPPED, expected FINISHED_ERROR")
