# SPDX-License-Identifier: Apache-2.0
# The vLLM plugin (connector/python, package pdkv): PdkvConnector driven as
# vLLM's scheduler and model runner drive it, between engine processes with
# torch CPU tensors as KV caches, and behind pdproxy.  The scripts need torch:
# they re-run themselves under /usr/bin/python3 (Debian's python3-torch) when
# the python3 found here lacks it, and skip (77) when neither has it.
foreach(t lib drift flow layouts faults proxy)
  add_test(NAME plugin.${t}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/plugin/test_plugin_${t}.py)
  set_tests_properties(plugin.${t} PROPERTIES LABELS plugin TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "${PX_TEST_ENV}")
endforeach()
