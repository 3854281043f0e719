# SPDX-License-Identifier: Apache-2.0
# Per-request decisions: conditional disaggregation, the decode-only fallback
# after a failed prefill, the endpoints passed to decode, and the usage the
# client gets across the two legs. Included from tests/CMakeLists.txt, so
# CMAKE_CURRENT_SOURCE_DIR is tests/.
foreach(name endpoints fallback usage disagg responses generate kvload dp)
  px_py_test(pd_${name})
endforeach()

# The passed-through endpoints once more with https:// backends (libcurl's
# transport: methods other than GET and POST go through CURLOPT_CUSTOMREQUEST).
px_py_test(pd_endpoints_https SCRIPT test_pd_endpoints.py ENV PX_MOCK_TLS=1)

# engine-sim as vLLM with --kv-events-config: KV events over ZeroMQ, their
# replay, /tokenize and the prefix cache charging prefill per uncached token.
px_py_test(sim_kvevents)

# engine-sim in push mode: both legs at once, decode's fetch held at prefill
# until it publishes under the caller's id and token.
px_py_test(sim_push)

# engine-sim's queueing on /metrics: the wait for free KV blocks and the
# wait behind prompts computed before (decode's queueing in pd_mixed.py).
px_py_test(sim_queue)

# engine-sim's speeds: --decode-us-per-token and --kv-peer-cost (a delay and
# a bandwidth cap per prefill-decode link), what latency routing learns.
px_py_test(sim_speed)

# --dispatch concurrent: both legs at once (mocks decide the race and the
# failures; engine-sims in push mode move real KV).
px_py_test(pd_concurrent)
# The mock cases once more with https:// backends (libcurl's transport, its
# header lines read for X-KV-Wait-Ms).
px_py_test(pd_concurrent_https SCRIPT test_pd_concurrent.py ARGS ConcurrentMockTest
           ENV PX_MOCK_TLS=1)
