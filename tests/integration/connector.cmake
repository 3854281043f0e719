# SPDX-License-Identifier: Apache-2.0
# libkvconnector two-process tests over UCX on loopback, once with tcp only
# and once with shared memory carrying the data.
if(TARGET kvconnector)
  add_executable(kvc_testpeer ${CMAKE_CURRENT_SOURCE_DIR}/integration/connector_peer.c)
  target_link_libraries(kvc_testpeer PRIVATE kvconnector)
  # A hostile peer that speaks the wire by hand (library internals; tests only).
  add_executable(kvc_hostile ${CMAKE_CURRENT_SOURCE_DIR}/integration/kvc_hostile.c)
  target_link_libraries(kvc_hostile PRIVATE kvconnector_static)
  foreach(mode tcp sm)
    px_py_test(kvc_${mode} SCRIPT connector_test.py ARGS --mode ${mode})
    px_py_test(kvc_hostile_${mode} SCRIPT connector_hostile.py ARGS --mode ${mode})
  endforeach()
  # engine-sim with a secret file, tokens and heterogeneous TP.
  px_py_test(kvc_sim SCRIPT connector_sim.py)
endif()

# The GPU check (tests/gpu/run_gpu_tests.sh builds and runs kvc_gpu_test):
# label gpu, skipped (code 77) where nvidia-smi sees no GPU.  kvc_gpu_test
# also times the connector's own staging copies, hence the static library and
# its internal header.
if(TARGET kvconnector_static AND PDPROXY_WITH_CUDA)
  add_executable(kvc_gpu_test ${PROJECT_SOURCE_DIR}/tests/gpu/kvc_gpu_test.c)
  target_link_libraries(kvc_gpu_test PRIVATE kvconnector_static CUDA::cudart)
  add_test(NAME gpu.kvc_cuda
           COMMAND ${PROJECT_SOURCE_DIR}/tests/gpu/run_gpu_tests.sh ${CMAKE_BINARY_DIR})
  set_tests_properties(gpu.kvc_cuda PROPERTIES LABELS gpu SKIP_RETURN_CODE 77 TIMEOUT 600)
endif()

# The GPU check's sizing (no GPU needed): free MiB on GPU 0 -> blocks per
# region, 2 MiB per block index for 64 regions of 32 KiB blocks.  An H200's
# free memory is capped at 16k; 5120 MiB is the least that holds 1024.
foreach(case "143156;^16384\n$" "8192;^1600\n$" "5120;^1024\n$"
       "5119;^960\nGPU 0 has 5119 MiB free: too little")
  list(GET case 0 mib)
  list(GET case 1 want)
  add_test(NAME integration.kvc_gpu_sizes_${mib}
           COMMAND ${PROJECT_SOURCE_DIR}/tests/gpu/run_gpu_tests.sh --blocks-for ${mib})
  set_tests_properties(integration.kvc_gpu_sizes_${mib} PROPERTIES LABELS integration TIMEOUT 30
                       PASS_REGULAR_EXPRESSION "${want}")
endforeach()

# The same program built against the asynchronous CUDA stand-in
# (tests/cudasim, kvc_cudasim from tests/unit/connector.cmake): the GPU
# check's flow (two processes, staged path, stream-order probe, producer
# killed mid-fetch) runs here on CPUs, with small sizes and no bandwidth
# thresholds.
if(TARGET kvconnector_static)
  add_executable(kvc_gpu_test_standin ${PROJECT_SOURCE_DIR}/tests/gpu/kvc_gpu_test.c)
  target_link_libraries(kvc_gpu_test_standin PRIVATE kvc_cudasim)
  add_test(NAME integration.kvc_gpu_standin
           COMMAND ${PROJECT_SOURCE_DIR}/tests/gpu/run_gpu_tests.sh --standin ${CMAKE_BINARY_DIR})
  set_tests_properties(integration.kvc_gpu_standin PROPERTIES LABELS integration TIMEOUT 300)
endif()

# One libkvconnector for hosts with and without CUDA: the CUDA runtime is
# loaded when the first CUDA region is registered (connector/cudart.c), never
# linked.
if(TARGET kvconnector)
  add_executable(kvc_cudart_probe ${CMAKE_CURRENT_SOURCE_DIR}/integration/kvc_cudart_probe.c)
  target_link_libraries(kvc_cudart_probe PRIVATE kvconnector)
  if(PDPROXY_WITH_CUDA)
    set(kvc_with_cuda 1)
  else()
    set(kvc_with_cuda 0)
  endif()
  add_test(NAME integration.kvc_cudart
           COMMAND sh ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_kvc_cudart.sh
                   $<TARGET_FILE:kvconnector> $<TARGET_FILE:kvc_cudart_probe> ${kvc_with_cuda})
  set_tests_properties(integration.kvc_cudart PROPERTIES LABELS "integration;deploy" TIMEOUT 60)
endif()
