# libkvconnector two-process tests over UCX on loopback, once with tcp only
# and once with shared memory carrying the data.
if(TARGET kvconnector)
  add_executable(kvc_testpeer ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_peer.c)
  target_link_libraries(kvc_testpeer PRIVATE kvconnector)
  # A hostile peer that speaks the wire by hand (library internals; tests only).
  add_executable(kvc_hostile ${CMAKE_CURRENT_SOURCE_DIR}/integration/kvc_hostile.c)
  target_include_directories(kvc_hostile PRIVATE ${PROJECT_SOURCE_DIR}/connector)
  target_link_libraries(kvc_hostile PRIVATE kvconnector_static)
  foreach(mode tcp sm)
    add_test(NAME integration.kvc_${mode}
             COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_test.py --mode ${mode})
    set_tests_properties(integration.kvc_${mode} PROPERTIES
      LABELS integration TIMEOUT 300 ENVIRONMENT "${PX_TEST_ENV}")
    add_test(NAME integration.kvc_hostile_${mode}
             COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_hostile.py --mode ${mode})
    set_tests_properties(integration.kvc_hostile_${mode} PROPERTIES
      LABELS integration TIMEOUT 300 ENVIRONMENT "${PX_TEST_ENV}")
  endforeach()
  # engine-sim with a secret file, tokens and heterogeneous TP.
  add_test(NAME integration.kvc_sim COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_sim.py)
  set_tests_properties(integration.kvc_sim PROPERTIES
    LABELS integration TIMEOUT 300 ENVIRONMENT "${PX_TEST_ENV}")
endif()

# CUDA end to end (tests/gpu): label gpu, skipped (code 77) without a device.
if(TARGET kvconnector AND PDPROXY_WITH_CUDA)
  add_executable(kvc_gpu_test ${PROJECT_SOURCE_DIR}/tests/gpu/kvc_gpu_test.c)
  target_link_libraries(kvc_gpu_test PRIVATE kvconnector CUDA::cudart)
  add_test(NAME gpu.kvc_cuda COMMAND kvc_gpu_test)
  set_tests_properties(gpu.kvc_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 180
                       ENVIRONMENT "UCX_TLS=sm,tcp,self")
endif()
