# Observability, TLS and auth tests of pdproxy (issue 6 items 1-5; otlp: issue 16): Python 3
# stdlib plus the openssl CLI, real processes on 127.0.0.1.
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(area metrics log trace tls auth otlp)
  add_test(NAME integration.obs_${area}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_obs_${area}.py)
  set_tests_properties(integration.obs_${area} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 300)
endforeach()
