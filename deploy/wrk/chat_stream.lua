-- SPDX-License-Identifier: Apache-2.0
-- wrk script: POST /v1/chat/completions with "stream":true (SSE answers) through pdproxy,
-- prompts varied per thread and request.  See README.md beside this file.
--   wrk -t2 -c32 -d30s --latency -s deploy/wrk/chat_stream.lua http://127.0.0.1:8000
local dir = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(dir .. "common.lua").install("chat", true)
