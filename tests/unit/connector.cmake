# libkvconnector unit tests: wire formats (pure) and agent bookkeeping
# (a real agent on loopback, no peer).  They reach internal functions via
# the static library and connector/kvc_int.h.
if(TARGET kvconnector_static)
  foreach(m kvc_wire kvc_agent)
    px_unit_test(${m} kvconnector_static)
    if(TARGET test_${m})
      target_include_directories(test_${m} PRIVATE ${PROJECT_SOURCE_DIR}/connector)
    endif()
  endforeach()
endif()
