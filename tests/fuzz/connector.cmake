# SPDX-License-Identifier: Apache-2.0
# libkvconnector fuzz targets (clang, -DBUILD_FUZZERS=ON).  The parsers are
# compiled straight into each target with the fuzzer's instrumentation; they
# call no UCX function, so only UCX's headers are needed.
#   fuzz.kvc_<target> replays the seed corpus (label fuzz); fuzz by hand with
#   bin/fuzz_handshake tests/fuzz/corpus/fuzz_handshake -max_total_time=60
#   fuzz_kvc_slice: heterogeneous-TP part counts and sizes (connector/slice.c, PULL)
set(KVC_FUZZ_FLAGS -fsanitize=fuzzer,address,undefined -fno-omit-frame-pointer)
foreach(t fuzz_handshake fuzz_kvc_notify fuzz_kvc_slice)
  add_executable(${t} ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/${t}.c
                      ${PROJECT_SOURCE_DIR}/connector/wire.c
                      ${PROJECT_SOURCE_DIR}/connector/slice.c
                      ${PROJECT_SOURCE_DIR}/connector/params.c
                      ${PROJECT_SOURCE_DIR}/connector/auth.c
                      ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/kvc_fuzz_stubs.c)
  target_include_directories(${t} PRIVATE ${PROJECT_SOURCE_DIR})
  target_compile_options(${t} PRIVATE ${KVC_FUZZ_FLAGS})
  target_link_options(${t} PRIVATE ${KVC_FUZZ_FLAGS})
  target_link_libraries(${t} PRIVATE PkgConfig::UCX PkgConfig::CJSON PkgConfig::OPENSSL m)
  add_test(NAME fuzz.kvc_${t}
           COMMAND ${t} -runs=0 ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus/${t})
  set_tests_properties(fuzz.kvc_${t} PROPERTIES LABELS fuzz TIMEOUT 120)
endforeach()
