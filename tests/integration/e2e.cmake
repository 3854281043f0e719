# End-to-end tests: pdproxy + engine-sim + libkvconnector, real processes on
# 127.0.0.1 with UCX over tcp on loopback.
foreach(t e2e_flow e2e_faults e2e_openai_sdk docs)
  add_test(NAME integration.${t}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_${t}.py)
  set_tests_properties(integration.${t} PROPERTIES LABELS integration TIMEOUT 300
                       ENVIRONMENT "${PX_TEST_ENV}" SKIP_RETURN_CODE 77)
endforeach()
