# Hardening tests of pdproxy (issue 7): hostile clients (item 2) and upstream
# faults (item 3). Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name clients upstream)
  add_test(NAME integration.hostile_${name}
           COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_hostile_${name}.py)
  set_tests_properties(integration.hostile_${name} PROPERTIES
                       LABELS integration
                       ENVIRONMENT "${PX_TEST_ENV}"
                       TIMEOUT 300)
endforeach()

# Issue 18: bounded memory, no self-inflicted outage, every exit cancels.
add_test(NAME integration.hold_line
         COMMAND ${PYTHON3} ${CMAKE_CURRENT_SOURCE_DIR}/integration/test_hold_line.py)
set_tests_properties(integration.hold_line PROPERTIES
                     LABELS integration
                     ENVIRONMENT "${PX_TEST_ENV}"
                     TIMEOUT 300)
