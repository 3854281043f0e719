-- SPDX-License-Identifier: Apache-2.0
-- POST a small non-streamed completion; used by bench/proxy_bench.sh.
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"bench","prompt":"The quick brown fox jumps over the lazy dog","max_tokens":16,"temperature":0}'
