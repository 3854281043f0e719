# Hardening tests of pdproxy (issue 7): hostile clients (item 2) and upstream
# faults (item 3). Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name clients upstream)
  px_py_test(hostile_${name})
endforeach()

# Issue 18: bounded memory, no self-inflicted outage, every exit cancels.
px_py_test(hold_line)
