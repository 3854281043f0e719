# SPDX-License-Identifier: Apache-2.0
# pdproxy and engine-sim fuzz targets (clang, -DBUILD_FUZZERS=ON), one per
# parser of outside input. They link the same static libraries as the
# product (pxbase, pxcore, simcore), which the top-level CMakeLists.txt
# compiles with -fsanitize=fuzzer-no-link in this build; configure with
# -DSANITIZE=address,undefined for ASan/UBSan, as tests/fuzz/run.sh does.
#   fuzz.<target> replays tests/fuzz/corpus/<target>/ (label fuzz); fuzz by
#   hand with  bin/fuzz_http -dict=tests/fuzz/http.dict tests/fuzz/corpus/http
set(PX_FUZZ_TARGETS
  "http:pxbase"
  "http_response:pxbase"
  "json:pxbase"
  "rewrite:pxcore"
  "config:pxcore"
  "kv_events:pxcore"
  "sim_request:simcore,pxcore")
foreach(entry ${PX_FUZZ_TARGETS})
  string(REGEX REPLACE "[:,]" ";" parts "${entry}")
  list(GET parts 0 t)
  list(SUBLIST parts 1 -1 libs)
  set(have_libs TRUE)
  foreach(l ${libs})
    if(NOT TARGET ${l})
      set(have_libs FALSE)
    endif()
  endforeach()
  if(NOT have_libs)
    continue()
  endif()
  add_executable(fuzz_${t} ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/fuzz_${t}.c)
  target_link_libraries(fuzz_${t} PRIVATE ${libs})
  target_compile_options(fuzz_${t} PRIVATE -fsanitize=fuzzer)
  target_link_options(fuzz_${t} PRIVATE -fsanitize=fuzzer)
  add_test(NAME fuzz.${t}
           COMMAND fuzz_${t} -runs=0 ${CMAKE_CURRENT_SOURCE_DIR}/fuzz/corpus/${t})
  set_tests_properties(fuzz.${t} PROPERTIES LABELS fuzz TIMEOUT 120)
endforeach()
