# Integration tests of the control plane: model pools and readiness, the
# YAML config file and its reload, the admin API, the llm-d sidecar mode.
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name pools config reload admin sidecar)
  add_test(NAME integration.ctl_${name}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_ctl_${name}.py)
  set_tests_properties(integration.ctl_${name} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 300)
endforeach()
