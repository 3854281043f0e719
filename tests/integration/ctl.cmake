# SPDX-License-Identifier: Apache-2.0
# Integration tests of the control plane: model pools and readiness, the
# YAML config file and its reload, the admin API, the llm-d sidecar mode.
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name pools config reload admin sidecar scale k8s)
  px_py_test(ctl_${name})
endforeach()
