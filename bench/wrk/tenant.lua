-- SPDX-License-Identifier: Apache-2.0
-- POST a small non-streamed completion as tenant $TENANT, each request's
-- X-Request-Id "$TAG-<n>" so the access log's queue_ms lines can be told
-- apart by tenant; used by bench/admission_bench.sh's fairness phase.
local tenant = os.getenv("TENANT") or "default"
local tag = os.getenv("TAG") or tenant
local n = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["x-tenant"] = tenant
wrk.body = '{"model":"sim-model","prompt":"fair share","max_tokens":8,"temperature":0}'
request = function()
    n = n + 1
    wrk.headers["X-Request-Id"] = tag .. "-" .. n
    return wrk.format()
end
