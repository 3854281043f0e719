# SPDX-License-Identifier: Apache-2.0
# libkvconnector unit tests: wire formats (pure), agent bookkeeping (a real
# agent on loopback, no peer), the CUDA path against an asynchronous CUDA
# stand-in (kvc_cudasim: the core sources, connector/cuda.c and
# tests/cudasim; tests only), and the pure path/copy-plan choices.  They
# reach internal functions through connector/kvc_int.h.
if(TARGET kvconnector_static)
  foreach(m kvc_wire kvc_agent kvc_path kvc_xfer kvc_api2 kvc_owner kvc_threads kvc_layers)
    px_unit_test(${m} kvconnector_static)
  endforeach()

  # The libevent recipe of kvconnector.h, driving a producer and a consumer.
  px_unit_test(kvc_event kvconnector PkgConfig::LIBEVENT)

  # The CUDA path: connector/cuda.c itself, built against the asynchronous
  # CUDA stand-in in tests/cudasim (its cuda_runtime_api.h comes first on the
  # include path), so the real staging code runs here without a GPU.
  add_library(kvc_cudasim STATIC EXCLUDE_FROM_ALL ${KVC_CORE_SOURCES}
              ${PROJECT_SOURCE_DIR}/connector/cuda.c ${PROJECT_SOURCE_DIR}/connector/cuda_vmm.c
              ${PROJECT_SOURCE_DIR}/tests/cudasim/cudasim.c
              ${PROJECT_SOURCE_DIR}/tests/cudasim/cudasim_ipc.c
              ${PROJECT_SOURCE_DIR}/tests/cudasim/cudasim_vmm.c)
  target_include_directories(kvc_cudasim BEFORE PUBLIC ${PROJECT_SOURCE_DIR}/tests/cudasim)
  target_include_directories(kvc_cudasim PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(kvc_cudasim PUBLIC PkgConfig::UCX PkgConfig::CJSON PkgConfig::OPENSSL
                                           Threads::Threads m)
  px_unit_test(kvc_staging kvc_cudasim)
  px_unit_test(kvc_stage_owner kvc_cudasim)
  # The same-node CUDA IPC path across two processes (the test runs itself
  # again as the producer).
  px_unit_test(kvc_ipc kvc_cudasim)
  px_unit_test(cudasim kvc_cudasim)
endif()
