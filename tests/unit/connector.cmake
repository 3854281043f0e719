# libkvconnector unit tests: wire formats (pure), agent bookkeeping (a real
# agent on loopback, no peer), and the CUDA staging flow against a fake CUDA
# layer (kvc_fakecuda: the core sources plus the fake in the test file; tests
# only).  They reach internal functions through connector/kvc_int.h.
if(TARGET kvconnector_static)
  foreach(m kvc_wire kvc_agent)
    px_unit_test(${m} kvconnector_static)
    if(TARGET test_${m})
      target_include_directories(test_${m} PRIVATE ${PROJECT_SOURCE_DIR}/connector)
    endif()
  endforeach()

  # The libevent recipe of kvconnector.h, driving a producer and a consumer.
  px_unit_test(kvc_event kvconnector PkgConfig::LIBEVENT)

  add_library(kvc_fakecuda STATIC EXCLUDE_FROM_ALL ${KVC_CORE_SOURCES})
  target_include_directories(kvc_fakecuda PUBLIC ${PROJECT_SOURCE_DIR}/include
                                                 ${PROJECT_SOURCE_DIR}/connector)
  target_link_libraries(kvc_fakecuda PUBLIC PkgConfig::UCX PkgConfig::CJSON PkgConfig::OPENSSL m)
  px_unit_test(kvc_staging kvc_fakecuda)
endif()
