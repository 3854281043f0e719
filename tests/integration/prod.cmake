# Integration tests of pdproxy's production features (issue 5): health checks,
# failover, routing policies, DNS discovery, limits, drain, endpoints, config,
# stranded prefill blocks. Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name backends health failover policies limits drain endpoints config stranded)
  add_test(NAME integration.prod_${name}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_prod_${name}.py)
  set_tests_properties(integration.prod_${name} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 300)
endforeach()
