-- SPDX-License-Identifier: Apache-2.0
-- POST a streamed completion; used by bench/proxy_bench.sh (SSE=1), where the
-- decode mock answers 200 server-sent events of about 120 bytes each.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":200,"stream":true}'
