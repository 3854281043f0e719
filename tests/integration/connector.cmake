# libkvconnector two-process tests over UCX on loopback, once with tcp only
# and once with shared memory carrying the data.
if(TARGET kvconnector)
  add_executable(kvc_testpeer ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_peer.c)
  target_link_libraries(kvc_testpeer PRIVATE kvconnector)
  foreach(mode tcp sm)
    add_test(NAME integration.kvc_${mode}
             COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_test.py --mode ${mode})
    set_tests_properties(integration.kvc_${mode} PROPERTIES
      LABELS integration TIMEOUT 300 ENVIRONMENT "${PX_TEST_ENV}")
  endforeach()
endif()
