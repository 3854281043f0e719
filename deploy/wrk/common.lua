-- SPDX-License-Identifier: Apache-2.0
-- Shared by completions.lua, chat.lua and chat_stream.lua (loaded from the
-- directory of the script wrk runs).  Builds OpenAI-compatible request
-- bodies with prompts that vary deterministically per wrk thread and per
-- request, checks the answers, and prints one machine-readable result line.
--
-- Environment:
--   WRK_MODEL       model name sent in every request (default: sim-model)
--   WRK_MAX_TOKENS  max_tokens (default: 16)
--   WRK_PAD         0..N extra context sentences per prompt, varied per request
--                   up to this bound (default: 3): longer prompts, more KV blocks
--   WRK_API_KEY     sent as "Authorization: Bearer ..." when set
--   WRK_CHECK       1 (default): count 2xx answers whose body is not a
--                   completion (or, streaming, not an SSE stream ending in
--                   [DONE]); 0: skip the check (wrk then skips reading bodies
--                   into Lua, a little faster)
local M = {}

local function env(name, default)
  local v = os.getenv(name)
  if v == nil or v == "" then return default end
  return v
end

M.model = env("WRK_MODEL", "sim-model")
M.max_tokens = tonumber(env("WRK_MAX_TOKENS", "16")) or 16
M.pad = tonumber(env("WRK_PAD", "3")) or 3
M.api_key = env("WRK_API_KEY", nil)
M.check = env("WRK_CHECK", "1") ~= "0"

local questions = {
  "Explain why prefill and decode run on different GPUs.",
  "Write a haiku about a proxy that never sleeps.",
  "Summarise the plot of a detective story in two sentences.",
  "What is the capital of France, and why is it famous?",
  "List three uses of a key-value cache in language models.",
  "Translate 'good morning, how are you?' into Spanish.",
  "Give one tip for writing clear commit messages.",
  "Why does streaming a response lower perceived latency?",
  "Describe the colour blue to someone who has never seen it.",
  "How do load balancers decide where to send a request?",
  "Name two differences between TCP and UDP.",
  "Suggest a name for a cat who likes keyboards.",
  "What happens when a network packet is lost?",
  "Write a limerick about a slow database.",
  "Explain backpressure in one paragraph.",
  "Which is heavier, a kilogram of feathers or a kilogram of steel?",
}
local context = {
  "The system runs on a cluster of machines connected by a fast network.",
  "Each request carries a unique identifier that every component logs.",
  "Answers should be short, accurate and written in plain English.",
  "The reader is an engineer who has little time and a lot of curiosity.",
  "Numbers should be given with their units, and sources where possible.",
}

-- JSON string escaping (the prompts are ASCII, but keep it correct anyway).
local function esc(s)
  return (s:gsub('[%c"\\]', function(c)
    if c == '"' then return '\\"' elseif c == "\\" then return "\\\\"
    elseif c == "\n" then return "\\n" else return string.format("\\u%04x", c:byte()) end
  end))
end
M.esc = esc

-- Deterministic prompt for request n of thread tid: the same run gives the
-- same sequence, and threads start at different points of it.
function M.prompt(tid, n)
  local k = (tid - 1) * 7 + n
  local q = questions[(k * 5) % #questions + 1]
  local parts = {}
  local npad = (M.pad > 0) and ((k * 3) % (M.pad + 1)) or 0
  for i = 1, npad do parts[#parts + 1] = context[(k + i) % #context + 1] end
  parts[#parts + 1] = string.format("Request %d.%d: %s", tid, n, q)
  return table.concat(parts, " ")
end

function M.body(kind, stream, tid, n)
  local p = esc(M.prompt(tid, n))
  local s = stream and ',"stream":true,"stream_options":{"include_usage":true}' or ""
  if kind == "completions" then
    return string.format('{"model":"%s","prompt":"%s","max_tokens":%d,"temperature":0%s}',
                         esc(M.model), p, M.max_tokens, s)
  end
  return string.format('{"model":"%s","messages":[{"role":"system","content":"You are a concise assistant."},'
                       .. '{"role":"user","content":"%s"}],"max_tokens":%d,"temperature":0%s}',
                       esc(M.model), p, M.max_tokens, s)
end

function M.valid(stream, body)
  if body == nil then return false end
  if stream then
    return body:find("data: ", 1, true) ~= nil and body:find("data: [DONE]", 1, true) ~= nil
  end
  return body:find('"choices"', 1, true) ~= nil
end

-- Installs wrk's callbacks (setup, init, request, response, done) as globals.
function M.install(kind, stream)
  local path = (kind == "completions") and "/v1/completions" or "/v1/chat/completions"
  local headers = { ["Content-Type"] = "application/json" }
  if stream then headers["Accept"] = "text/event-stream" end
  if M.api_key then headers["Authorization"] = "Bearer " .. M.api_key end
  local threads, nthreads = {}, 0

  setup = function(thread)          -- main state, once per thread
    nthreads = nthreads + 1
    thread:set("thread_id", nthreads)
    threads[#threads + 1] = thread
  end

  init = function(args)             -- in each thread
    tid = thread_id or 1
    n = 0
    bad = 0
  end

  request = function()
    n = n + 1
    return wrk.format("POST", path, headers, M.body(kind, stream, tid, n))
  end

  if M.check then
    response = function(status, hdrs, body)
      if status >= 200 and status < 300 and not M.valid(stream, body) then bad = bad + 1 end
    end
  end

  done = function(summary, latency, requests)
    local b = 0
    for _, t in ipairs(threads) do b = b + (t:get("bad") or 0) end
    local e = summary.errors
    io.write(string.format(
      'wrk-result {"script":"%s","requests":%d,"non2xx":%d,"bad_bodies":%d,"connect_errors":%d,'
      .. '"read_errors":%d,"write_errors":%d,"timeouts":%d,"duration_s":%.3f,"p50_ms":%.3f,"p99_ms":%.3f}\n',
      kind .. (stream and "_stream" or ""), summary.requests, e.status, b, e.connect, e.read, e.write,
      e.timeout, summary.duration / 1e6, latency:percentile(50) / 1e3, latency:percentile(99) / 1e3))
  end
end

return M
