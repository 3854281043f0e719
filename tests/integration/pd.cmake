# Per-request decisions: conditional disaggregation, the decode-only fallback
# after a failed prefill, the endpoints passed to decode, and the usage the
# client gets across the two legs. Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name endpoints fallback usage disagg)
  add_test(NAME integration.pd_${name}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_pd_${name}.py)
  set_tests_properties(integration.pd_${name} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 300)
endforeach()

# The passed-through endpoints once more with https:// backends (libcurl's
# transport: methods other than GET and POST go through CURLOPT_CUSTOMREQUEST).
add_test(NAME integration.pd_endpoints_https
         COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_pd_endpoints.py)
set_tests_properties(integration.pd_endpoints_https PROPERTIES
                     LABELS integration
                     ENVIRONMENT "${PX_TEST_ENV};PX_MOCK_TLS=1"
                     TIMEOUT 300)
