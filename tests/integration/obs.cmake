# SPDX-License-Identifier: Apache-2.0
# Observability, TLS and auth tests of pdproxy (issue 6 items 1-5; otlp: issue 16): Python 3
# stdlib plus the openssl CLI, real processes on 127.0.0.1.
# Included from tests/CMakeLists.txt, so CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(area metrics log trace tls auth otlp)
  px_py_test(obs_${area})
endforeach()
# The log's sink (issue 36): a stalled reader, batches, exits, rotation.
px_py_test(obs_logsink TIMEOUT 180)
