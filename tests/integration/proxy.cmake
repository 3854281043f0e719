# pdproxy integration tests (Python 3 stdlib, real processes on 127.0.0.1).
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(area cli flow errors stream conn http)
  add_test(NAME integration.proxy_${area}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_proxy_${area}.py)
  set_tests_properties(integration.proxy_${area} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 180)
endforeach()

# The connector's publication token in kv_transfer_params survives the proxy.
add_test(NAME integration.proxy_kvtoken
         COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_proxy_kvtoken.py)
set_tests_properties(integration.proxy_kvtoken PROPERTIES
                     LABELS integration ENVIRONMENT "${PX_TEST_ENV}" TIMEOUT 180)

# The upstream part of the suite once more with every mock engine behind TLS
# (PX_MOCK_TLS=1: https:// backends, so pdproxy's libcurl transport instead of
# its own http client), so both transports meet the same expectations.
foreach(t proxy_flow proxy_errors proxy_stream hostile_upstream)
  add_test(NAME integration.${t}_https
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_${t}.py)
  set_tests_properties(integration.${t}_https PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV};PX_MOCK_TLS=1"
                       TIMEOUT 300)
endforeach()
